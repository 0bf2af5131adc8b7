#!/usr/bin/env bash
# Stops the cluster start.sh started and leaves the host as it found it: no process of ours
# left, pods' network namespaces, veths, the bridge, the KUBE-*/CNI-* iptables chains, the
# kubepods cgroups and our mounts removed, and the kernel settings the kubelet, kube-proxy
# and start.sh changed put back. Only what this cluster created is touched (processes by our
# pid files, mounts under our state directories, chains and cgroups only Kubernetes and CNI
# make). Fine to run when nothing runs. Keeps the cached images in containerd's store and
# the registry's storage; --purge removes all of $STATE as well.
set -uo pipefail
source "$(dirname "$0")/lib.sh"
[ "$(id -u)" = 0 ] || die "needs root"
purge=0; [ "${1:-}" = --purge ] && purge=1

pid_of() { [ -f "$RUN/$1.pid" ] && cat "$RUN/$1.pid"; }
alive() { local p; p=$(pid_of "$1") && kill -0 "$p" 2>/dev/null; }
stop() {  # stop NAME: TERM, then KILL after 15 s
  local p; p=$(pid_of "$1") || return 0
  if kill -0 "$p" 2>/dev/null; then
    kill -TERM "$p" 2>/dev/null
    for _ in $(seq 150); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$p" 2>/dev/null && { log "$1 ignored TERM: KILL"; kill -KILL "$p" 2>/dev/null; sleep 0.2; }
  fi
  rm -f "$RUN/$1.pid"
}

# 1. No new pods: stop the controllers, then delete every pod while the kubelet runs, so CNI
#    tears down each pod's netns, veth and NAT rules.
stop kube-controller-manager
stop kube-scheduler
if alive kube-apiserver && alive kubelet && [ -f "$KUBECONFIG_ADMIN" ]; then
  # Webhooks whose pods are going away would refuse the deletions below.
  kctl delete validatingwebhookconfigurations,mutatingwebhookconfigurations --all --wait=false >/dev/null 2>&1
  kctl delete pods -A --all --grace-period=2 --wait=false >/dev/null 2>&1
  log "pods deleted, waiting for the kubelet to stop them"
  for _ in $(seq 20); do
    [ -z "$(kctl get pods -A -o name 2>/dev/null)" ] && break
    sleep 1
  done
  # Pods already terminating with a long grace period (Knative revisions' queue-proxy drains
  # for minutes) keep it: force them out of the API, the kubelet then kills them and tears
  # down their sandboxes (CNI included) as orphans.
  if [ -n "$(kctl get pods -A -o name 2>/dev/null)" ]; then
    kctl delete pods -A --all --force --grace-period=0 >/dev/null 2>&1
  fi
  for _ in $(seq 30); do
    [ -z "$(ctr_ tasks ls -q 2>/dev/null)" ] && break
    sleep 1
  done
fi
log "stopping kubelet, kube-proxy, containerd"
stop kubelet
stop kube-proxy
[ -x "$KUBE_BIN/kube-proxy" ] && "$KUBE_BIN/kube-proxy" --cleanup >/dev/null 2>&1
# kube-router's NetworkPolicy firewall: its chains and ipsets (the KUBE-* chains go below too)
if [ -f "$RUN/kube-router.pid" ]; then
  stop kube-router
  router="$CLUSTER_CACHE/netpol/kube-router-$KUBE_ROUTER_VERSION/kube-router"
  [ -x "$router" ] && "$router" --cleanup-config >/dev/null 2>&1
fi
# ipsets of kube-router's policies that its cleanup leaves (once nothing references them:
# after the iptables chains below go, so this runs again at the end)
router_sets() {
  command -v ipset >/dev/null || return 0
  ipset list -n 2>/dev/null | grep -E '^(KUBE-(SRC|DST)-|kube-router-)' | while read -r set; do
    ipset destroy "$set" 2>/dev/null
  done
}
router_sets

# 2. Whatever containerd still runs (a kubelet that died early): kill and remove it, then
#    every sandbox's network through the CRI is gone with the containers.
if alive containerd; then
  for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks kill -s SIGKILL "$t" >/dev/null 2>&1; done
  sleep 1
  for t in $(ctr_ tasks ls -q 2>/dev/null); do ctr_ tasks delete -f "$t" >/dev/null 2>&1; done
  for c in $(ctr_ containers ls -q 2>/dev/null); do ctr_ containers delete "$c" >/dev/null 2>&1; done
fi
stop containerd
# containerd's shims outlive it by design: end the ones serving our socket.
for p in $(pgrep -f "containerd-shim-runc-v2 .*-address $CONTAINERD_SOCK" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
stop kube-apiserver
stop etcd
stop registry

# 3. Mounts under our directories and the pods' network namespaces (deepest first).
awk -v s="$STATE" '$2 == s || index($2, s "/") == 1 || $2 ~ "^/run/lapse-cluster" || $2 ~ "^/run/netns/cni-" {print $2}' /proc/mounts \
  | sort -r | while read -r m; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
for ns in /run/netns/cni-*; do [ -e "$ns" ] && rm -f "$ns"; done

# 4. The bridge, then the chains Kubernetes (KUBE-*) and CNI (CNI-*) made, ip and ip6.
ip link show "$BRIDGE" >/dev/null 2>&1 && ip link delete "$BRIDGE"
for ipt in iptables ip6tables; do
  command -v "$ipt" >/dev/null || continue
  for table in filter nat mangle; do
    # rules in any chain that jump to ours, then our chains
    "$ipt-save" -t "$table" 2>/dev/null | grep -E '^-A .* -j (KUBE|CNI)-' | grep -vE '^-A (KUBE|CNI)-' | sed 's/^-A //' \
      | while read -r rule; do eval "$ipt -t $table -D $rule" 2>/dev/null; done
    chains=$("$ipt-save" -t "$table" 2>/dev/null | sed -n 's/^:\(\(KUBE\|CNI\)-[^ ]*\) .*/\1/p')
    for c in $chains; do "$ipt" -t "$table" -F "$c" 2>/dev/null; done
    for c in $chains; do "$ipt" -t "$table" -X "$c" 2>/dev/null; done
  done
done
if command -v nft >/dev/null; then
  for t in "ip kube-proxy" "ip6 kube-proxy"; do nft delete table $t 2>/dev/null; done
  if [ -f "$STATE/nft-tables.before" ]; then
    nft list tables 2>/dev/null | while read -r _ fam name; do
      grep -qxF "table $fam $name" "$STATE/nft-tables.before" && continue
      # a rule is a line with a handle that declares no table or chain
      nft -a list table "$fam" "$name" | grep '# handle' | grep -qvE '^\s*(table|chain) ' || nft delete table "$fam" "$name"
    done
    rm -f "$STATE/nft-tables.before"
  fi
fi

# 5. The kubelet's cgroups (cgroupfs driver: /kubepods in every v1 hierarchy), leaves first.
for d in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
  [ -d "$d" ] && find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
done

# 6. Kernel settings back to what they were before the first start.
if [ -f "$STATE/sysctl.saved" ]; then
  while IFS= read -r kv; do sysctl -qw "$kv" >/dev/null 2>&1; done < "$STATE/sysctl.saved"
  rm -f "$STATE/sysctl.saved"
fi

# 7. State: this run's (etcd data, certificates, pod logs, IP allocations) always; the image
#    store and registry only with --purge. Paths the kubelet insists on, if it made them.
[ -f "$STATE/created-paths" ] && while read -r p; do rm -rf "$p"; done < "$STATE/created-paths"
rm -f "$STATE/created-paths"
rm -rf "$RUN" "$STATE/kubelet" "$STATE/kubelet-plugins" "$STATE/pod-logs" "$STATE/cni/ipam" "$STATE/flexvolume" /run/lapse-cluster
[ "$purge" = 1 ] && rm -rf "$STATE"

router_sets
left=$(pgrep -f "$STATE|$CONTAINERD_SOCK" 2>/dev/null | tr '\n' ' ')
[ -n "$left" ] && log "warning: processes still mention the cluster's paths: $left"
log "stopped"
exit 0
