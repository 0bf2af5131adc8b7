#!/usr/bin/env bash
# Builds the observability backends lapse's tests run against, from the Go module proxy
# (no registry reachable here ships them), and caches them outside the repository keyed by
# version:
#   prometheus, promtool  github.com/prometheus/prometheus  (cmd/prometheus, cmd/promtool)
#   otelcol-lapse         an OpenTelemetry Collector made by the Collector Builder from
#                         infra/otel/builder-config.yaml (keyed by the manifest's hash too)
#   jaeger                Jaeger v2 (github.com/jaegertracing/jaeger, cmd/jaeger)
# Idempotent: cached builds are reused. Prints the directory holding (links to) all four
# binaries on stdout (last line). Progress and build times go to stderr, and each cache
# directory keeps `build-seconds` of its cold build.
#
# Why wrapper modules: `go install pkg@version` refuses modules whose go.mod has replace
# directives (Jaeger's has), and a module of our own lets every build use the same flags
# (CGO_ENABLED=0 go build -mod=mod -trimpath). Versions are always exact: the proxy here
# refuses version lists (and `@latest`) for some of these modules.
set -euo pipefail

# Other work shares this machine's cores: the builds yield to it.
if [ -z "${LAPSE_BUILD_NICED:-}" ]; then
  export LAPSE_BUILD_NICED=1
  exec nice -n 15 bash "$0" "$@"
fi

PROMETHEUS_VERSION="${LAPSE_PROMETHEUS_VERSION:-v0.316.0}"  # Prometheus 3.16.0
JAEGER_VERSION="${LAPSE_JAEGER_VERSION:-v1.76.0}"  # Jaeger v2.13.0 (module keeps v1 tags)
BUILDER_VERSION="${LAPSE_OTELCOL_BUILDER_VERSION:-v0.158.0}"
CACHE_ROOT="${LAPSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lapse}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
MANIFEST="$REPO/infra/otel/builder-config.yaml"
# Bump when the way the binaries are built changes, so caches from an older recipe rebuild.
RECIPE=1
LDFLAGS="-s -w"  # no symbol tables: a third of the size; stack traces keep function names

command -v go >/dev/null || { echo "build-observability: the 'go' tool is required" >&2; exit 1; }
export CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -buildvcs=false"

cached() {  # cached <dir> <binary>...: all binaries present, built by this recipe
  local dir="$1"; shift
  [ "$(cat "$dir/recipe" 2>/dev/null)" = "$RECIPE" ] || return 1
  for bin in "$@"; do [ -x "$dir/$bin" ] || return 1; done
}

locked() {  # locked <dir> <command>...: one build per cache directory at a time
  local dir="$1"; shift
  mkdir -p "$(dirname "$dir")"
  (
    flock 9
    "$@"
  ) 9>"$dir.lock"
}

finish() {  # finish <dir> <seconds>
  echo "$2" > "$1/build-seconds"
  echo "$RECIPE" > "$1/recipe"
  echo "build-observability: $(basename "$(dirname "$1")") $(basename "$1") built in ${2}s" >&2
}

# A wrapper module requiring <module>@<version>, with that module's own version-pinned
# replace directives (a dependency's replaces are ignored otherwise) and its go directive.
wrapper_module() {  # wrapper_module <name> <module> <version> <package>...
  local name="$1" module="$2" version="$3"; shift 3
  local info gomod source go_directive
  info=$(go mod download -json "$module@$version")
  gomod=$(echo "$info" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  source=$(echo "$info" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
  [ -f "$gomod" ] || { echo "build-observability: could not download $module@$version" >&2; exit 1; }
  # The module's own go.sum: its dependencies are verified against the hashes its
  # maintainers recorded (the checksum database here does not answer for all of them).
  if [ -f "$source/go.sum" ]; then cat "$source/go.sum" > go.sum; fi
  go_directive=$(awk '$1 == "go" {print $2; exit}' "$gomod")
  {
    echo "module lapse.local/$name"
    echo
    echo "go $go_directive"
    echo
    echo "require $module $version"
    # `replace a => b vX` lines (single or in a block); local-path replaces are the
    # module's own development setup and do not apply to a published version.
    sed -n 's/^\(replace \)\{0,1\}[[:space:]]*\([^[:space:]]\{1,\}\)\( v[^[:space:]]*\)\{0,1\} => \([^.\/][^[:space:]]*\) \(v[^[:space:]]*\)$/replace \2\3 => \4 \5/p' "$gomod"
  } > go.mod
  {
    echo "//go:build tools"
    echo
    echo "package tools"
    echo
    echo "import ("
    for package in "$@"; do echo "	_ \"$package\""; done
    echo ")"
  } > tools.go
  go mod tidy -e >/dev/null 2>&1 || true
}

build_prometheus() {
  local out="$CACHE_ROOT/prometheus/$PROMETHEUS_VERSION"
  cached "$out" prometheus promtool && return 0
  local start=$SECONDS work="$CACHE_ROOT/prometheus/build-$PROMETHEUS_VERSION"
  rm -rf "$work" && mkdir -p "$work" "$out" && cd "$work"
  echo "build-observability: building Prometheus $PROMETHEUS_VERSION (cold: several minutes)" >&2
  local module=github.com/prometheus/prometheus minor="${PROMETHEUS_VERSION#v0.3}"
  wrapper_module prometheus "$module" "$PROMETHEUS_VERSION" "$module/cmd/prometheus" "$module/cmd/promtool"
  minor="${minor%%.*}"; minor="${minor#0}"
  local version="3.$minor.${PROMETHEUS_VERSION##*.}"
  local ldflags="$LDFLAGS -X github.com/prometheus/common/version.Version=$version"
  # remove_all_sd: only the file and http service discovery (what a test needs); it
  # leaves out the cloud SDKs, most of the build.
  for cmd in prometheus promtool; do
    go build -mod=mod -trimpath -tags remove_all_sd -ldflags "$ldflags" -o "$out/$cmd.tmp" "$module/cmd/$cmd"
    mv "$out/$cmd.tmp" "$out/$cmd"
  done
  finish "$out" $((SECONDS - start))
  rm -rf "$work"
}

otelcol_dir() {
  local hash
  hash=$(sha256sum "$MANIFEST" | cut -c1-12)
  echo "$CACHE_ROOT/otelcol/$BUILDER_VERSION-$hash"
}

build_otelcol() {
  local out
  out=$(otelcol_dir)
  cached "$out" otelcol-lapse && return 0
  local start=$SECONDS work="$out.build"
  rm -rf "$work" && mkdir -p "$work" "$out" && cd "$work"
  echo "build-observability: building the Collector Builder $BUILDER_VERSION and otelcol-lapse (cold: several minutes)" >&2
  GOBIN="$work/bin" go install -trimpath "go.opentelemetry.io/collector/cmd/builder@$BUILDER_VERSION"
  cp "$MANIFEST" builder-config.yaml
  # The builder writes the sources and resolves the modules; the compile is ours, so every
  # binary here is built the same way.
  "$work/bin/builder" --config builder-config.yaml --skip-compilation >&2
  (cd otelcol-lapse && go build -mod=mod -trimpath -ldflags "$LDFLAGS" -o "$out/otelcol-lapse.tmp" .)
  mv "$out/otelcol-lapse.tmp" "$out/otelcol-lapse"
  finish "$out" $((SECONDS - start))
  rm -rf "$work"
}

build_jaeger() {
  local out="$CACHE_ROOT/jaeger/$JAEGER_VERSION"
  cached "$out" jaeger && return 0
  local start=$SECONDS work="$CACHE_ROOT/jaeger/build-$JAEGER_VERSION"
  rm -rf "$work" && mkdir -p "$work" "$out" && cd "$work"
  echo "build-observability: building Jaeger $JAEGER_VERSION (cold: several minutes)" >&2
  local module=github.com/jaegertracing/jaeger
  wrapper_module jaeger "$module" "$JAEGER_VERSION" "$module/cmd/jaeger"
  go build -mod=mod -trimpath -ldflags "$LDFLAGS" -o "$out/jaeger.tmp" "$module/cmd/jaeger"
  mv "$out/jaeger.tmp" "$out/jaeger"
  finish "$out" $((SECONDS - start))
  rm -rf "$work"
}

locked "$CACHE_ROOT/prometheus/$PROMETHEUS_VERSION" build_prometheus
locked "$(otelcol_dir)" build_otelcol
locked "$CACHE_ROOT/jaeger/$JAEGER_VERSION" build_jaeger

# One directory of links, named after everything that went into it, so worktrees on
# different versions or manifests never share one.
bins="$CACHE_ROOT/prometheus/$PROMETHEUS_VERSION/prometheus $CACHE_ROOT/prometheus/$PROMETHEUS_VERSION/promtool $(otelcol_dir)/otelcol-lapse $CACHE_ROOT/jaeger/$JAEGER_VERSION/jaeger"
key=$(echo "$RECIPE $bins" | sha256sum | cut -c1-12)
BIN="$CACHE_ROOT/observability/bin-$key"
mkdir -p "$BIN"
for bin in $bins; do ln -sfn "$bin" "$BIN/$(basename "$bin")"; done
echo "$BIN"
