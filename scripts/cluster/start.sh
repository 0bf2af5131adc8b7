#!/usr/bin/env bash
# Starts a single-node Kubernetes cluster on this machine (root, no systemd): containerd +
# runc + CNI bridge, etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet,
# kube-proxy, kube-router's NetworkPolicy firewall, CoreDNS and a registry on 127.0.0.1:5000. Idempotent: what already runs is
# left alone. Waits for the node to be Ready and CoreDNS to answer. Stop with stop.sh.
# docs/cluster.md says why each setting is there.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
[ "$(id -u)" = 0 ] || die "needs root (containerd, kubelet, iptables)"
t0=$(date +%s)

# --- packages (Debian) --------------------------------------------------------------------
bash "$(dirname "$0")/../debian-packages.sh" containerd runc containernetworking-plugins \
  iptables umoci skopeo docker-registry conntrack mmdebstrap openssl nftables gcc libc6-dev socat ipset

# --- binaries and images (cached by version) ----------------------------------------------
bash "$(dirname "$0")/build-node.sh" >/dev/null
bash "$(dirname "$0")/build-images.sh" pause coredns python >/dev/null

NODE_IP=$(node_ip); [ -n "$NODE_IP" ] || die "no address on the default route"
NODE_NAME=lapse-node
mkdir -p "$RUN" "$LOGS" "$STATE/containerd" "$STATE/cni/net.d" "$STATE/kubelet" /run/lapse-cluster
echo "$NODE_IP" > "$RUN/node-ip"

# put FILE: write stdin to FILE only if it differs (kube-proxy exits when its config changes,
# so a second start must not rewrite it)
put() {
  local t; t=$(mktemp "$1.XXXXXX"); cat > "$t"
  if cmp -s "$t" "$1"; then rm -f "$t"; else mv "$t" "$1"; fi
}
running() { [ -f "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }
# launch NAME CMD...: start CMD in the background with its own log and pid file
launch() {
  local name="$1"; shift
  if running "$name"; then return 0; fi
  setsid "$@" >>"$LOGS/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/$name.pid"
}
wait_for() {  # wait_for SECONDS WHAT CMD...
  local until=$(( $(date +%s) + $1 )) what="$2"; shift 2
  until "$@" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$until" ] || die "$what did not come up (logs: $LOGS)"
    sleep 0.5
  done
}

# Paths the kubelet and CNI use whatever they are told: remember which ones we create.
for p in /var/lib/kubelet /var/log/containers /var/log/pods /var/lib/cni /etc/cni /run/netns; do
  [ -e "$p" ] || { grep -qxF "$p" "$STATE/created-paths" 2>/dev/null || echo "$p" >> "$STATE/created-paths"; }
done

# --- kernel settings: remember the originals once, stop.sh puts them back ------------------
SYSCTLS=(kernel.panic kernel.panic_on_oops vm.overcommit_memory net.ipv4.ip_forward
  net.ipv4.conf.all.route_localnet net.bridge.bridge-nf-call-iptables
  net.bridge.bridge-nf-call-ip6tables net.netfilter.nf_conntrack_max
  net.netfilter.nf_conntrack_tcp_timeout_established net.netfilter.nf_conntrack_tcp_timeout_close_wait)
if [ ! -f "$STATE/sysctl.saved" ]; then
  for k in "${SYSCTLS[@]}"; do v=$(sysctl -n "$k" 2>/dev/null) && echo "$k=$v"; done > "$STATE/sysctl.saved.tmp"
  mv "$STATE/sysctl.saved.tmp" "$STATE/sysctl.saved"
fi
# iptables here is iptables-nft: its first use creates nftables tables; stop.sh removes the
# ones that did not exist before, once they hold no rule.
[ -f "$STATE/nft-tables.before" ] || nft list tables > "$STATE/nft-tables.before" 2>/dev/null || true
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 >/dev/null

# --- certificates: one CA for everything ----------------------------------------------------
PKI="$RUN/pki"
if [ ! -f "$PKI/done" ] || [ "$(cat "$PKI/node-ip" 2>/dev/null)" != "$NODE_IP" ]; then
  rm -rf "$PKI"; mkdir -p "$PKI"; cd "$PKI"
  openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 365 -subj "/CN=lapse-cluster-ca" 2>/dev/null
  cert() {  # cert NAME SUBJECT [SANS]
    local ext="extendedKeyUsage=clientAuth,serverAuth"
    [ -n "${3:-}" ] && ext="$ext
subjectAltName=$3"
    openssl req -newkey rsa:2048 -nodes -keyout "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 -out "$1.crt" -extfile <(echo "$ext") 2>/dev/null
    rm -f "$1.csr"
  }
  cert apiserver "/CN=kube-apiserver" "IP:$KUBE_SVC_IP,IP:$NODE_IP,IP:127.0.0.1,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost"
  cert admin "/O=system:masters/CN=lapse-admin"
  cert apiserver-kubelet "/O=system:masters/CN=kube-apiserver-kubelet-client"
  cert controller-manager "/CN=system:kube-controller-manager"
  cert scheduler "/CN=system:kube-scheduler"
  cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME"
  cert kube-proxy "/CN=system:kube-proxy"
  openssl genrsa -out sa.key 2048 2>/dev/null
  openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
  echo "$NODE_IP" > node-ip; touch done
  cd - >/dev/null
fi
kubeconfig() {  # kubeconfig NAME CERT
  put "$RUN/$1.kubeconfig" <<KC
apiVersion: v1
kind: Config
clusters:
- name: lapse
  cluster: {server: "https://$NODE_IP:$API_PORT", certificate-authority: "$PKI/ca.crt"}
users:
- name: $2
  user: {client-certificate: "$PKI/$2.crt", client-key: "$PKI/$2.key"}
contexts:
- name: lapse
  context: {cluster: lapse, user: $2}
current-context: lapse
KC
}
kubeconfig admin admin; kubeconfig controller-manager controller-manager; kubeconfig scheduler scheduler
kubeconfig kubelet kubelet; kubeconfig kube-proxy kube-proxy

# --- containerd -----------------------------------------------------------------------------
put "$RUN/containerd.toml" <<TOML
version = 2
root = "$STATE/containerd"
state = "/run/lapse-cluster/containerd"
[grpc]
  address = "$CONTAINERD_SOCK"
[ttrpc]
  address = "$CONTAINERD_SOCK.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "localhost/lapse/pause:$KUBE_VERSION"
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$STATE/cni/net.d"
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."$REGISTRY"]
    endpoint = ["http://$REGISTRY"]
  [plugins."io.containerd.grpc.v1.cri".registry.mirrors."localhost:5000"]
    endpoint = ["http://$REGISTRY"]
TOML
put "$STATE/cni/net.d/10-lapse.conflist" <<CNI
{
  "cniVersion": "1.0.0",
  "name": "lapse-pods",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": true, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$STATE/cni/ipam",
              "ranges": [[{"subnet": "10.244.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
CNI
launch containerd containerd --config "$RUN/containerd.toml"
wait_for 30 containerd ctr --address "$CONTAINERD_SOCK" version

bash "$(dirname "$0")/import-images.sh"

# --- local registry (Debian docker-registry) on 127.0.0.1:5000 ------------------------------
mkdir -p "$STATE/registry"
put "$RUN/registry.yml" <<YML
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: "$STATE/registry"}, delete: {enabled: true}}
http: {addr: "$REGISTRY"}
YML
launch registry docker-registry serve "$RUN/registry.yml"
wait_for 30 registry python3 -c "import urllib.request; urllib.request.urlopen('http://$REGISTRY/v2/')"
# Images meant to be pulled (marked .registry by build-images.sh) go to the registry.
for tar in "$CLUSTER_CACHE/images"/*.tar; do
  [ -f "$tar.registry" ] || continue
  ref=$(cat "$tar.ref"); repo=${ref#"$REGISTRY"/}
  python3 -c "import urllib.request; urllib.request.urlopen(urllib.request.Request('http://$REGISTRY/v2/${repo%:*}/manifests/${repo##*:}', method='HEAD'))" 2>/dev/null \
    || skopeo copy -q --dest-tls-verify=false "docker-archive:$tar" "docker://$ref"
done

# --- etcd, kube-apiserver -------------------------------------------------------------------
launch etcd "$KUBE_BIN/etcd" --name lapse --data-dir "$RUN/etcd" --unsafe-no-fsync \
  --listen-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
  --initial-cluster "lapse=http://127.0.0.1:$ETCD_PEER_PORT" --listen-metrics-urls "" --log-level warn
launch kube-apiserver "$KUBE_BIN/kube-apiserver" --etcd-servers "http://127.0.0.1:$ETCD_CLIENT_PORT" \
  --bind-address "$NODE_IP" --advertise-address "$NODE_IP" --secure-port "$API_PORT" \
  --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" --client-ca-file "$PKI/ca.crt" \
  --service-cluster-ip-range "$SERVICE_CIDR" --authorization-mode Node,RBAC --allow-privileged=true \
  --service-account-issuer https://kubernetes.default.svc.cluster.local \
  --service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
  --kubelet-client-certificate "$PKI/apiserver-kubelet.crt" --kubelet-client-key "$PKI/apiserver-kubelet.key" \
  --kubelet-preferred-address-types InternalIP --profiling=false
wait_for 90 kube-apiserver kctl get --raw /readyz

# --- controller-manager, scheduler ----------------------------------------------------------
mkdir -p "$STATE/flexvolume"
launch kube-controller-manager "$KUBE_BIN/kube-controller-manager" --kubeconfig "$RUN/controller-manager.kubeconfig" \
  --authentication-kubeconfig "$RUN/controller-manager.kubeconfig" --authorization-kubeconfig "$RUN/controller-manager.kubeconfig" \
  --service-account-private-key-file "$PKI/sa.key" --root-ca-file "$PKI/ca.crt" \
  --cluster-signing-cert-file "$PKI/ca.crt" --cluster-signing-key-file "$PKI/ca.key" \
  --use-service-account-credentials --leader-elect=false --bind-address 127.0.0.1 --secure-port 0 \
  --service-cluster-ip-range "$SERVICE_CIDR" --flex-volume-plugin-dir "$STATE/flexvolume" --profiling=false
launch kube-scheduler "$KUBE_BIN/kube-scheduler" --kubeconfig "$RUN/scheduler.kubeconfig" \
  --authentication-kubeconfig "$RUN/scheduler.kubeconfig" --authorization-kubeconfig "$RUN/scheduler.kubeconfig" \
  --leader-elect=false --bind-address 127.0.0.1 --secure-port 0 --profiling=false

# --- kubelet, kube-proxy --------------------------------------------------------------------
put "$RUN/kubelet.yaml" <<YAML
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
failSwapOn: false
readOnlyPort: 0
address: $NODE_IP
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: "$PKI/ca.crt"}
authorization: {mode: Webhook}
clusterDomain: cluster.local
clusterDNS: [$DNS_IP]
containerRuntimeEndpoint: unix://$CONTAINERD_SOCK
podLogsDir: $STATE/pod-logs
resolvConf: /etc/resolv.conf
evictionHard: {memory.available: "200Mi", nodefs.available: "2%", imagefs.available: "2%"}
imageGCHighThresholdPercent: 99
imageGCLowThresholdPercent: 98
serializeImagePulls: false
maxPods: 200
YAML
launch kubelet "$KUBE_BIN/kubelet" --config "$RUN/kubelet.yaml" --kubeconfig "$RUN/kubelet.kubeconfig" \
  --hostname-override "$NODE_NAME" --node-ip "$NODE_IP" --root-dir "$STATE/kubelet" --cert-dir "$STATE/kubelet/pki" \
  --volume-plugin-dir "$STATE/kubelet-plugins"
put "$RUN/kube-proxy.yaml" <<YAML
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: iptables
clientConnection: {kubeconfig: "$RUN/kube-proxy.kubeconfig"}
hostnameOverride: $NODE_NAME
clusterCIDR: $POD_CIDR
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack: {maxPerCore: 0, tcpEstablishedTimeout: 0s, tcpCloseWaitTimeout: 0s}
YAML
launch kube-proxy "$KUBE_BIN/kube-proxy" --config "$RUN/kube-proxy.yaml"

# --- NetworkPolicy: kube-router's firewall alone (no routing, no service proxy) -------------
# The bridge CNI enforces no NetworkPolicy; kube-router's controller does, with iptables and
# ipsets on the node (docs/cluster.md). LAPSE_CLUSTER_NETPOL=off leaves it out.
if [ "${LAPSE_CLUSTER_NETPOL:-kube-router}" = kube-router ]; then
  KUBE_ROUTER=$(bash "$(dirname "$0")/build-netpol.sh")
  launch kube-router "$KUBE_ROUTER" --run-firewall=true --run-router=false \
    --run-service-proxy=false --enable-cni=false --kubeconfig "$KUBECONFIG_ADMIN" \
    --hostname-override "$NODE_NAME" --service-cluster-ip-range "$SERVICE_CIDR" \
    --health-port 0 --metrics-port 0
fi

wait_for 120 "node $NODE_NAME Ready" bash -c "'$KUBE_BIN/kubectl' --kubeconfig '$KUBECONFIG_ADMIN' get node $NODE_NAME -o jsonpath='{.status.conditions[?(@.type==\"Ready\")].status}' | grep -qx True"
log "node Ready ($(( $(date +%s) - t0 )) s since start)"

# --- CoreDNS --------------------------------------------------------------------------------
sed -e "s|@DNS_IP@|$DNS_IP|g" -e "s|@IMAGE@|localhost/coredns/coredns:$COREDNS_VERSION|g" \
  "$(dirname "$0")/manifests/coredns.yaml" | kctl apply -f - >/dev/null
kctl -n kube-system rollout status deploy/coredns --timeout=120s >/dev/null
wait_for 60 "CoreDNS answering" python3 "$(dirname "$0")/dnsq.py" "$DNS_IP"
log "cluster up in $(( $(date +%s) - t0 )) s: KUBECONFIG=$KUBECONFIG_ADMIN"
echo "$KUBECONFIG_ADMIN"
