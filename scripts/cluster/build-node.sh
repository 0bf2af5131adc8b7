#!/usr/bin/env bash
# Builds the node's Kubernetes binaries (kubelet, kube-controller-manager, kube-scheduler,
# kube-proxy, kubectl) next to the kube-apiserver and etcd that lapse/embedded/build-kube.sh
# builds, from the same k8s.io/kubernetes version and into the same cache directory
# (~/.cache/lapse/kube/<version>). build-kube.sh runs first (it is a no-op when cached).
# The wrapper module is made the way build-kube.sh makes it (see its header for why); it
# cannot be shared because build-kube.sh deletes its work directory when done.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
RECIPE=1
BINS=(kubelet kube-controller-manager kube-scheduler kube-proxy kubectl)

nice -n 19 bash "$REPO/lapse/embedded/build-kube.sh" >/dev/null
ok=1
for b in "${BINS[@]}"; do [ -x "$KUBE_BIN/$b" ] || ok=0; done
[ "$(cat "$KUBE_BIN/node-recipe" 2>/dev/null)" = "$RECIPE" ] || ok=0
if [ "$ok" = 1 ]; then echo "$KUBE_BIN"; exit 0; fi

start=$(date +%s)
work="$CACHE_ROOT/kube/build-node-$KUBE_VERSION"
rm -rf "$work"; mkdir -p "$work"; cd "$work"
gomod=$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
staging_version="v0.${KUBE_VERSION#v1.}"
{
  echo "module lapse.local/kubenode"
  echo
  echo "go $(awk '$1 == "go" {print $2; exit}' "$gomod")"
  echo
  echo "require k8s.io/kubernetes $KUBE_VERSION"
  echo
  echo "replace ("
  grep -E '^\s*k8s\.io/[a-z0-9-]+ => \./staging/' "$gomod" | awk -v v="$staging_version" '{print "\t" $1 " => " $1 " " v}'
  echo ")"
} > go.mod
{
  echo "//go:build tools"; echo; echo "package kubenode"; echo; echo "import ("
  for b in "${BINS[@]}"; do echo "	_ \"k8s.io/kubernetes/cmd/$b\""; done
  echo ")"
} > tools.go
log "building ${BINS[*]} $KUBE_VERSION (cold: ~10 minutes; warm module cache: ~2-3 minutes)"
go mod tidy -e >/dev/null 2>&1 || true
export CGO_ENABLED=0
minor="${KUBE_VERSION#v1.}"; minor="${minor%%.*}"
ldflags="-X k8s.io/component-base/version.gitVersion=$KUBE_VERSION -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$minor -X k8s.io/component-base/version.gitTreeState=clean"
for b in "${BINS[@]}"; do
  nice -n 19 go build -mod=mod -trimpath -ldflags "$ldflags" -o "$KUBE_BIN/$b.tmp" "k8s.io/kubernetes/cmd/$b"
  mv "$KUBE_BIN/$b.tmp" "$KUBE_BIN/$b"
done
echo "$RECIPE" > "$KUBE_BIN/node-recipe"
echo $(( $(date +%s) - start )) > "$KUBE_BIN/node-build-seconds"
rm -rf "$work"
log "node binaries built in $(cat "$KUBE_BIN/node-build-seconds") s"
echo "$KUBE_BIN"
