#!/usr/bin/env bash
# Builds the node's Kubernetes binaries (kubelet, kube-controller-manager, kube-scheduler,
# kube-proxy, kubectl) next to kube-apiserver and etcd, with lapse/embedded/build-kube.sh's
# recipe, from the same k8s.io/kubernetes version and into the same cache directory
# (~/.cache/lapse/kube/<version>). A no-op when they are cached.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
BINS=(kubelet kube-controller-manager kube-scheduler kube-proxy kubectl)

ok=1
for b in "${BINS[@]}"; do [ -x "$KUBE_BIN/$b" ] || ok=0; done
if [ "$ok" = 1 ]; then echo "$KUBE_BIN"; exit 0; fi

start=$(date +%s)
log "building ${BINS[*]} $KUBE_VERSION (cold: ~10 minutes; warm module cache: ~2-3 minutes)"
nice -n 19 bash "$REPO/lapse/embedded/build-kube.sh" "${BINS[@]}" >/dev/null
echo $(( $(date +%s) - start )) > "$KUBE_BIN/node-build-seconds"
log "node binaries built in $(cat "$KUBE_BIN/node-build-seconds") s"
echo "$KUBE_BIN"
