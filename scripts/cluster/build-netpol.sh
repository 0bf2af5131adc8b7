#!/usr/bin/env bash
# Builds the NetworkPolicy enforcer the cluster runs on its node: kube-router's network
# policy controller (iptables + ipset; its router and service proxy stay off), from the Go
# module proxy at an exact version, cached in ~/.cache/lapse/cluster/netpol/<version>.
# A no-op when cached; prints the binary's path.
# (sigs.k8s.io/kube-network-policies cannot run here: it queues new connections with an
# nftables `queue` rule, and this kernel has no CONFIG_NFT_QUEUE; docs/cluster.md.)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
out="$CLUSTER_CACHE/netpol/kube-router-$KUBE_ROUTER_VERSION"
if [ -x "$out/kube-router" ]; then echo "$out/kube-router"; exit 0; fi
# Built once however many callers ask at the same time (build-all.sh runs in the background).
if [ -z "${LAPSE_NETPOL_LOCKED:-}" ]; then
  mkdir -p "$CLUSTER_CACHE/netpol"
  export LAPSE_NETPOL_LOCKED=1
  exec flock "$CLUSTER_CACHE/netpol/.lock" bash "$0" "$@"
fi
command -v go >/dev/null || die "the 'go' tool is required"
mkdir -p "$out"
work=$(mktemp -d "$out.XXXXXX"); trap 'rm -rf "$work"' EXIT
start=$(date +%s)
log "building kube-router $KUBE_ROUTER_VERSION (cold: ~5 minutes)"
GOFLAGS=-mod=mod CGO_ENABLED=0 GOBIN="$work" nice -n 19 \
  go install -trimpath "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@$KUBE_ROUTER_VERSION"
mv "$work/kube-router" "$out/kube-router"
log "kube-router built in $(( $(date +%s) - start )) s"
echo "$out/kube-router"
