#!/usr/bin/env bash
# Prints where the running cluster is, as KEY=value lines (read by tests/cluster).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
echo "KUBECONFIG=$KUBECONFIG_ADMIN"
echo "KUBECTL=$KUBE_BIN/kubectl"
echo "STATE=$STATE"
echo "PYTHON_IMAGE=$REGISTRY/lapse/python:3.11"
echo "REGISTRY=$REGISTRY"
echo "NODE_IP=$(node_ip)"
echo "CONTAINERD_SOCK=$CONTAINERD_SOCK"
# Who enforces NetworkPolicy on the node: kube-router (start.sh) or nobody.
if [ -f "$RUN/kube-router.pid" ] && kill -0 "$(cat "$RUN/kube-router.pid")" 2>/dev/null; then
  echo "NETWORK_POLICY=kube-router"
else
  echo "NETWORK_POLICY=none"
fi
