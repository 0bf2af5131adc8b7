#!/usr/bin/env bash
# Builds Argo's own workflow-controller from the pinned argo-workflows Go module (an exact
# version: the module proxy serves it; it refuses version lists) and caches the binary
# outside the repository, keyed by version, like lapse/embedded/build-kube.sh does.
# Idempotent: a cached build is reused. Prints the directory holding the binary (last line).
#
# The module's go.mod carries a `replace`, so `go install ...@version` is refused; the
# module is copied out of the read-only module cache and built as the main module, with its
# own go.mod and go.sum (the exact dependency versions Argo released with). The build runs
# under `nice` (it shares the machine's cores with whatever else is running).
set -euo pipefail

ARGO_VERSION="${LAPSE_ARGO_VERSION:-v3.7.9}"
MODULE="github.com/argoproj/argo-workflows/v3"
CACHE_ROOT="${LAPSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lapse}"
OUT="$CACHE_ROOT/argo/$ARGO_VERSION"
NICE="${LAPSE_BUILD_NICE:-15}"
# Bump when the way the binary is built changes, so caches from an older recipe rebuild.
RECIPE=1

if [ -x "$OUT/workflow-controller" ] && [ "$(cat "$OUT/recipe" 2>/dev/null)" = "$RECIPE" ]; then
  echo "$OUT"
  exit 0
fi

command -v go >/dev/null || { echo "argo-build: the 'go' tool is required" >&2; exit 1; }

info=$(go mod download -json "$MODULE@$ARGO_VERSION")
dir=$(printf '%s\n' "$info" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
commit=$(printf '%s\n' "$info" | sed -n 's/.*"Hash": "\(.*\)",*/\1/p')
[ -f "$dir/go.mod" ] || { echo "argo-build: could not download $MODULE@$ARGO_VERSION" >&2; exit 1; }

work="$CACHE_ROOT/argo/build-$ARGO_VERSION"
rm -rf "$work"
mkdir -p "$work" "$OUT"
cp -r "$dir/." "$work/"
chmod -R u+w "$work"
cd "$work"

echo "argo-build: building workflow-controller $ARGO_VERSION (a cold build takes 10-20 minutes)" >&2
pkg="github.com/argoproj/argo-workflows/v3"
ldflags="-X $pkg.version=$ARGO_VERSION -X $pkg.gitTag=$ARGO_VERSION -X $pkg.gitCommit=${commit:-unknown} -X $pkg.gitTreeState=clean"
CGO_ENABLED=0 GOFLAGS=-mod=readonly nice -n "$NICE" \
  go build -trimpath -ldflags "$ldflags" -o "$OUT/workflow-controller.tmp" ./cmd/workflow-controller
mv "$OUT/workflow-controller.tmp" "$OUT/workflow-controller"
echo "$RECIPE" > "$OUT/recipe"
cd /
rm -rf "$work"
echo "$OUT"
