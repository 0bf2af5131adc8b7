# Shared by scripts/cluster/*.sh: versions, where things are cached and where the running
# cluster keeps its state. Sourced, not run.
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_ROOT="${LAPSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lapse}"
# The Kubernetes version is build-kube.sh's pin: one place to bump it.
KUBE_VERSION="${LAPSE_KUBE_VERSION:-$(sed -n 's/^KUBE_VERSION="\${LAPSE_KUBE_VERSION:-\(v[0-9.]*\)}"$/\1/p' "$REPO/lapse/embedded/build-kube.sh")}"
KUBE_BIN="$CACHE_ROOT/kube/$KUBE_VERSION"
COREDNS_VERSION="${LAPSE_COREDNS_VERSION:-v1.15.0}"
EVENTING_VERSION="${LAPSE_EVENTING_VERSION:-v0.50.0}"
# v0.51.0 needs knative.dev/pkg and networking pseudo-versions the module proxy refuses (403).
SERVING_VERSION="${LAPSE_SERVING_VERSION:-v0.50.0}"
KOURIER_VERSION="${LAPSE_KOURIER_VERSION:-v0.48.0}"
ENVOY_VERSION="${LAPSE_ENVOY_VERSION:-1.40.0}"
# The NetworkPolicy enforcer on the node (build-netpol.sh); LAPSE_CLUSTER_NETPOL=off: none.
KUBE_ROUTER_VERSION="${LAPSE_KUBE_ROUTER_VERSION:-v2.1.0}"
# Built images and binaries other than the node's: kept across stops, keyed by version.
CLUSTER_CACHE="$CACHE_ROOT/cluster"
# Everything the running cluster writes (containerd's image store survives a stop, the rest
# is removed by stop.sh).
STATE="${LAPSE_CLUSTER_STATE:-/var/lib/lapse-cluster}"
RUN="$STATE/run"          # pid files, logs, certificates, kubeconfigs, etcd data
LOGS="$RUN/logs"
KUBECONFIG_ADMIN="$RUN/admin.kubeconfig"
# Addresses. The pod and service ranges and the bridge are ours alone; the API server and
# etcd use fixed ports that the tests' loopback servers (random ports) never pick from.
BRIDGE=lapse0
POD_CIDR=10.244.0.0/16
SERVICE_CIDR=10.96.0.0/16
KUBE_SVC_IP=10.96.0.1
DNS_IP=10.96.0.10
API_PORT=16443
ETCD_CLIENT_PORT=12379
ETCD_PEER_PORT=12380
REGISTRY=127.0.0.1:5000
CONTAINERD_SOCK=/run/lapse-cluster/containerd.sock

log() { printf '[cluster %s] %s\n' "$(date +%T)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The node's own address: the one on the default route (pods reach the API server there).
node_ip() { ip -4 route get 1.1.1.1 2>/dev/null | sed -n 's/.* src \([0-9.]*\).*/\1/p'; }

kctl() { "$KUBE_BIN/kubectl" --kubeconfig "$KUBECONFIG_ADMIN" "$@"; }
ctr_() { ctr --address "$CONTAINERD_SOCK" -n k8s.io "$@"; }
