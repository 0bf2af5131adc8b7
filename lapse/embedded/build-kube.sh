#!/usr/bin/env bash
# Builds kube-apiserver and etcd from the Go module proxy (no registry here ships them),
# and any more binaries of the same release named as arguments (`kubectl`, `kubelet`,
# `kube-controller-manager`, ...: k8s.io/kubernetes/cmd/<name>), and caches them outside the
# repository, keyed by version. Idempotent: what is cached is reused, only what is missing
# is built. Prints the directory holding the binaries on stdout (last line).
#
# Why a wrapper module: k8s.io/kubernetes' go.mod replaces its ~31 staging modules
# (k8s.io/api, k8s.io/apiserver, ...) with local paths, so `go install ...@vX` fails.
# The wrapper requires k8s.io/kubernetes and replaces each staging module with its
# published k8s.io/<name> v0.Y.Z. etcd is built inside the same module graph, at the
# version k8s.io/kubernetes pins. The one place this recipe lives: scripts/build-kubectl.sh
# and scripts/cluster/build-node.sh call this script.
set -euo pipefail

KUBE_VERSION="${LAPSE_KUBE_VERSION:-v1.35.4}"
CACHE_ROOT="${LAPSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lapse}"
OUT="$CACHE_ROOT/kube/$KUBE_VERSION"
# Bump when the way the binaries are built changes, so caches from an older recipe rebuild.
RECIPE=2

# Callers that find nothing to build never wait. The others take turns: test sessions and
# `make` targets starting at once would otherwise compile the same packages side by side.
if [ -z "${LAPSE_KUBE_BUILD_LOCKED:-}" ]; then
  mkdir -p "$CACHE_ROOT/kube"
  missing=0
  for name in kube-apiserver etcd "$@"; do [ -x "$OUT/$name" ] || missing=1; done
  [ "$(cat "$OUT/recipe" 2>/dev/null)" = "$RECIPE" ] || missing=1
  if [ "$missing" = 1 ]; then
    export LAPSE_KUBE_BUILD_LOCKED=1
    exec flock "$CACHE_ROOT/kube/$KUBE_VERSION.lock" bash "$0" "$@"
  fi
fi

core=1
if [ -x "$OUT/kube-apiserver" ] && [ -x "$OUT/etcd" ] && [ "$(cat "$OUT/recipe" 2>/dev/null)" = "$RECIPE" ]; then
  core=0
fi
extra=()
for name in "$@"; do
  [[ "$name" =~ ^[a-z][a-z0-9-]*$ ]] || { echo "kube-binaries: $name is not a command name" >&2; exit 2; }
  [ -x "$OUT/$name" ] || extra+=("$name")
done
if [ "$core" = 0 ] && [ ${#extra[@]} -eq 0 ]; then
  echo "$OUT"
  exit 0
fi

command -v go >/dev/null || { echo "kube-binaries: the 'go' tool is required" >&2; exit 1; }

staging_version="v0.${KUBE_VERSION#v1.}"
# One work directory per run (the lock above makes runs take turns).
mkdir -p "$CACHE_ROOT/kube" "$OUT"
work=$(mktemp -d "$CACHE_ROOT/kube/build-$KUBE_VERSION.XXXXXX")
trap 'rm -rf "$work"' EXIT
cd "$work"

gomod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
[ -f "$gomod" ] || { echo "kube-binaries: could not download k8s.io/kubernetes@$KUBE_VERSION" >&2; exit 1; }
go_directive=$(awk '$1 == "go" {print $2; exit}' "$gomod")
etcd_version=$(awk '$1 == "go.etcd.io/etcd/server/v3" {print $2; exit}' "$gomod")

{
  echo "module lapse.local/kubebuild"
  echo
  echo "go $go_directive"
  echo
  echo "require ("
  echo "	k8s.io/kubernetes $KUBE_VERSION"
  echo "	go.etcd.io/etcd/server/v3 $etcd_version"
  echo ")"
  echo
  echo "replace ("
  grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} > go.mod

{
  echo "//go:build tools"
  echo
  echo "package kubebuild"
  echo
  echo "import ("
  echo "	_ \"go.etcd.io/etcd/server/v3\""
  echo "	_ \"k8s.io/kubernetes/cmd/kube-apiserver\""
  for name in "${extra[@]}"; do echo "	_ \"k8s.io/kubernetes/cmd/$name\""; done
  echo ")"
} > tools.go

go mod tidy -e >&2 2>/dev/null || true
export CGO_ENABLED=0
minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
kube_ldflags="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
if [ "$core" = 1 ]; then
  echo "kube-binaries: building kube-apiserver $KUBE_VERSION and etcd $etcd_version (a cold build takes 10-20 minutes)" >&2
  go build -mod=mod -trimpath -ldflags "$kube_ldflags" -o "$OUT/kube-apiserver.tmp" k8s.io/kubernetes/cmd/kube-apiserver
  go build -mod=mod -trimpath -o "$OUT/etcd.tmp" go.etcd.io/etcd/server/v3
  mv "$OUT/kube-apiserver.tmp" "$OUT/kube-apiserver"
  mv "$OUT/etcd.tmp" "$OUT/etcd"
  echo "$etcd_version" > "$OUT/etcd.version"
  echo "$RECIPE" > "$OUT/recipe"
fi
for name in "${extra[@]}"; do
  echo "kube-binaries: building $name $KUBE_VERSION" >&2
  go build -mod=mod -trimpath -ldflags "$kube_ldflags" -o "$OUT/$name.tmp.$$" "k8s.io/kubernetes/cmd/$name"
  mv "$OUT/$name.tmp.$$" "$OUT/$name"
done
echo "$OUT"
