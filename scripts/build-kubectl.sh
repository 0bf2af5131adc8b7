#!/usr/bin/env bash
# Builds kubectl (for `kubectl kustomize` and `kubectl apply -k --dry-run=server` in the
# tests of infra/) from the same k8s.io/kubernetes release as the test kube-apiserver, and
# caches it next to it: ~/.cache/lapse/kube/<version>/kubectl. Idempotent; prints the path
# of the binary on stdout (last line). Debian's kubectl (1.20) is too old for kustomize v5.
#
# The wrapper module is the one lapse/embedded/build-kube.sh explains: k8s.io/kubernetes
# replaces its staging modules with local paths, so each is replaced with its published
# k8s.io/<name> v0.Y.Z.
set -euo pipefail

KUBE_VERSION="${LAPSE_KUBE_VERSION:-v1.35.4}"
CACHE_ROOT="${LAPSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lapse}"
OUT="$CACHE_ROOT/kube/$KUBE_VERSION"

if [ -x "$OUT/kubectl" ]; then
  echo "$OUT/kubectl"
  exit 0
fi
command -v go >/dev/null || { echo "build-kubectl: the 'go' tool is required" >&2; exit 1; }

staging_version="v0.${KUBE_VERSION#v1.}"
work="$CACHE_ROOT/kube/build-kubectl-$KUBE_VERSION"
rm -rf "$work"
mkdir -p "$work" "$OUT"
cd "$work"

gomod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
[ -f "$gomod" ] || { echo "build-kubectl: could not download k8s.io/kubernetes@$KUBE_VERSION" >&2; exit 1; }
go_directive=$(awk '$1 == "go" {print $2; exit}' "$gomod")
{
  echo "module lapse.local/kubectlbuild"
  echo
  echo "go $go_directive"
  echo
  echo "require k8s.io/kubernetes $KUBE_VERSION"
  echo
  echo "replace ("
  grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} > go.mod
cat > tools.go <<'GO'
//go:build tools

package kubectlbuild

import _ "k8s.io/kubernetes/cmd/kubectl"
GO

echo "build-kubectl: building kubectl $KUBE_VERSION (a few minutes cold)" >&2
go mod tidy -e >&2 2>/dev/null || true
minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
CGO_ENABLED=0 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$OUT/kubectl.tmp" k8s.io/kubernetes/cmd/kubectl
mv "$OUT/kubectl.tmp" "$OUT/kubectl"
rm -rf "$work"
echo "$OUT/kubectl"
