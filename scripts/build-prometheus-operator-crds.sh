#!/usr/bin/env bash
# The Prometheus Operator's CRDs (PodMonitor, ServiceMonitor, PrometheusRule, ...), for the
# tests that prove infra/components/monitoring is accepted by a real API server. The Go
# module proxy serves the operator's API types (github.com/prometheus-operator/
# prometheus-operator/pkg/apis/monitoring) but not the repository root where the released
# CRD YAMLs live, so they are generated from those types with controller-gen, the way the
# operator's own Makefile makes them. Cached in
# ~/.cache/lapse/prometheus-operator-crds/<version>/; idempotent, with a lock; prints the
# folder on stdout (last line).
set -euo pipefail

OPERATOR_VERSION=v0.95.2
CONTROLLER_TOOLS_VERSION=v0.20.1
MODULE=github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring

cache=${XDG_CACHE_HOME:-$HOME/.cache}/lapse
out=$cache/prometheus-operator-crds/$OPERATOR_VERSION
gen=$cache/controller-gen/$CONTROLLER_TOOLS_VERSION

mkdir -p "$cache"
exec 9>"$cache/prometheus-operator-crds.lock"
flock 9

if [ -f "$out/.done" ]; then
  echo "$out"
  exit 0
fi

if [ ! -x "$gen/controller-gen" ]; then
  mkdir -p "$gen"
  GOBIN="$gen" go install "sigs.k8s.io/controller-tools/cmd/controller-gen@$CONTROLLER_TOOLS_VERSION" >&2
fi

src=$(go mod download -json "$MODULE@$OPERATOR_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
work=$(mktemp -d)
trap 'chmod -R u+w "$work"; rm -rf "$work"' EXIT
cp -r "$src/." "$work/"
chmod -R u+w "$work"
rm -rf "$out.partial"
mkdir -p "$out.partial"
(
  cd "$work"
  go mod download >&2
  "$gen/controller-gen" crd:crdVersions=v1,maxDescLen=0 paths=./v1/... \
    output:crd:dir="$out.partial" >&2
)
touch "$out.partial/.done"
rm -rf "$out"
mv "$out.partial" "$out"
echo "$out"
