#!/usr/bin/env bash
# Builds kubectl (for `kubectl kustomize` and `kubectl apply -k --dry-run=server` in the
# tests of infra/) from the same k8s.io/kubernetes release as the test kube-apiserver, and
# caches it next to it: ~/.cache/lapse/kube/<version>/kubectl. Idempotent; prints the path
# of the binary on stdout (last line). Debian's kubectl (1.20) is too old for kustomize v5.
# The recipe is lapse/embedded/build-kube.sh's (it builds kube-apiserver and etcd too, if
# they are not cached yet).
set -euo pipefail

dir=$(bash "$(dirname "$0")/../lapse/embedded/build-kube.sh" kubectl | tail -1)
echo "$dir/kubectl"
