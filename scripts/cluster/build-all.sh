#!/usr/bin/env bash
# Builds everything `make cluster` starts, ahead of it: the node's binaries, every image the
# cluster and Knative run, kube-router. `make test` runs this in the background while pytest
# runs (the cluster's tests come after), so on empty caches the cluster's ~10 minutes of Go
# builds use the cores the tests leave idle. Each build holds its cache's lock: start.sh and
# knative.sh, calling the same scripts, wait for a build in progress instead of repeating it.
# A no-op when everything is cached (docs/cluster.md, "Figures").
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
# What the image builds pack with (start.sh installs the same, and more, to run the node).
bash "$HERE/../debian-packages.sh" umoci skopeo mmdebstrap gcc libc6-dev
bash "$HERE/build-node.sh" >/dev/null
bash "$HERE/build-images.sh" pause coredns python eventing serving envoy observability >/dev/null
bash "$HERE/build-netpol.sh" >/dev/null
echo "cluster builds: done"
