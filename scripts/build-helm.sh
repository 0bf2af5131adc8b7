#!/usr/bin/env bash
# Builds helm (for the chart in charts/lapse: `helm lint`, `helm template` in the tests,
# `helm install|upgrade|uninstall` on the real cluster) from the Go module proxy and caches
# it outside the repository: ~/.cache/lapse/helm/<version>/helm. Idempotent (a cached
# build is reused) and locked (one build at a time per version). Prints the path of the
# binary on stdout (last line); progress goes to stderr.
# `go install pkg@version` works here: helm.sh/helm/v3's go.mod has no replace directives.
# The version is exact: the proxy here refuses version lists for some modules.
set -euo pipefail

# Other work shares this machine's cores: the build yields to it.
if [ -z "${LAPSE_BUILD_NICED:-}" ]; then
  export LAPSE_BUILD_NICED=1
  exec nice -n 15 bash "$0" "$@"
fi

HELM_VERSION="${LAPSE_HELM_VERSION:-v3.22.0}"
CACHE_ROOT="${LAPSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lapse}"
OUT="$CACHE_ROOT/helm/$HELM_VERSION"
# Bump when the way the binary is built changes, so caches from an older recipe rebuild.
RECIPE=2

cached() { [ -x "$OUT/helm" ] && [ "$(cat "$OUT/recipe" 2>/dev/null)" = "$RECIPE" ]; }

build() {
  cached && return 0
  command -v go >/dev/null || { echo "build-helm: the 'go' tool is required" >&2; exit 1; }
  echo "build-helm: building helm $HELM_VERSION (a cold build takes a few minutes)" >&2
  local started=$SECONDS work
  work=$(mktemp -d "$CACHE_ROOT/helm/build-$HELM_VERSION.XXXXXX")
  # What helm's own Makefile sets: the version it reports, and the Kubernetes version
  # `helm template` and `helm lint` assume without a cluster (client-go's v0.Y.Z: 1.Y),
  # else 1.20, which the chart's kubeVersion refuses.
  local gomod client minor
  gomod=$(go mod download -json "helm.sh/helm/v3@$HELM_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  client=$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$gomod")
  minor=$(echo "$client" | cut -d. -f2)
  local ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
  for pkg in pkg/lint/rules pkg/chartutil; do
    ldflags+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=$minor"
  done
  CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -buildvcs=false" GOBIN="$work" go install -trimpath \
    -ldflags "$ldflags" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >&2
  mv "$work/helm" "$OUT/helm"
  rm -rf "$work"
  echo $((SECONDS - started)) > "$OUT/build-seconds"
  echo "$RECIPE" > "$OUT/recipe"
  echo "build-helm: helm $HELM_VERSION built in $((SECONDS - started))s" >&2
}

mkdir -p "$OUT"
(
  flock 9
  build
) 9>"$OUT.lock"
"$OUT/helm" version --short >/dev/null
echo "$OUT/helm"
