#!/usr/bin/env bash
# Imports every cached image tarball (build-images.sh) that containerd does not hold yet.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
have=$(ctr_ images ls -q 2>/dev/null || true)
for tar in "$CLUSTER_CACHE/images"/*.tar; do
  [ -f "$tar.ref" ] || continue
  # Images marked .registry are pushed to the local registry (start.sh), not imported: the
  # same image under two names confuses containerd 1.6's CRI image store.
  [ -f "$tar.registry" ] && continue
  ref=$(cat "$tar.ref")
  grep -qxF "$ref" <<<"$have" || { log "importing $ref"; ctr_ images import --no-unpack "$tar" >/dev/null; }
done
