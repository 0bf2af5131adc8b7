#!/usr/bin/env bash
# Builds SeaweedFS's `weed` (an Apache-2.0 S3-compatible object store; the tests of the
# `artifacts` target and `lapse up`'s embedded default run it) from the Go module proxy,
# and caches it outside the repository keyed by version:
#   ~/.cache/lapse/seaweedfs/<version>/weed
# Idempotent (a cached build is reused) and locked (one build per version at a time).
# Prints the path of the binary on stdout (last line); progress goes to stderr and the
# cache directory keeps `build-seconds` of its cold build.
#
# Why a wrapper module: SeaweedFS' go.mod has a replace directive (go-bip39), which
# `go install pkg@version` refuses; a module of our own requires it at an exact version
# and copies the replace. The proxy here lists no versions of this module: the version
# is an exact pseudo-version (never @latest). Needs Go >= 1.26.6 (the module's go line).
set -euo pipefail

# Other work shares this machine's cores: the build yields to it.
if [ -z "${LAPSE_BUILD_NICED:-}" ]; then
  export LAPSE_BUILD_NICED=1
  exec nice -n 15 bash "$0" "$@"
fi

SEAWEEDFS_VERSION="${LAPSE_SEAWEEDFS_VERSION:-v0.0.0-20261109003541-7506e5f91cd6}"
MODULE=github.com/seaweedfs/seaweedfs
CACHE_ROOT="${LAPSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lapse}"
OUT="$CACHE_ROOT/seaweedfs/$SEAWEEDFS_VERSION"
# Bump when the way the binary is built changes, so caches from an older recipe rebuild.
RECIPE=1

cached() { [ -x "$OUT/weed" ] && [ "$(cat "$OUT/recipe" 2>/dev/null)" = "$RECIPE" ]; }
if cached; then echo "$OUT/weed"; exit 0; fi
command -v go >/dev/null || { echo "build-seaweedfs: the 'go' tool is required" >&2; exit 1; }

work=""
trap '[ -z "$work" ] || rm -rf "$work"' EXIT

build() {
  cached && return 0
  local start info gomod source go_directive
  work=$(mktemp -d "$CACHE_ROOT/seaweedfs/build-$SEAWEEDFS_VERSION.XXXXXX")
  cd "$work"
  start=$(date +%s)
  info=$(go mod download -json "$MODULE@$SEAWEEDFS_VERSION")
  gomod=$(echo "$info" | sed -n 's/.*"GoMod": "\(.*\)",*/\1/p')
  source=$(echo "$info" | sed -n 's/.*"Dir": "\(.*\)",*/\1/p')
  [ -f "$gomod" ] || { echo "build-seaweedfs: could not download $MODULE@$SEAWEEDFS_VERSION" >&2; exit 1; }
  # The module's own go.sum: dependencies are verified against the hashes its
  # maintainers recorded.
  if [ -f "$source/go.sum" ]; then cat "$source/go.sum" > go.sum; fi
  go_directive=$(awk '$1 == "go" {print $2; exit}' "$gomod")
  {
    echo "module lapse.local/seaweedfsbuild"
    echo
    echo "go $go_directive"
    echo
    echo "require $MODULE $SEAWEEDFS_VERSION"
    # Version-pinned replace lines only (local-path replaces are the maintainers' setup).
    sed -n 's/^\(replace \)\{0,1\}[[:space:]]*\([^[:space:]]\{1,\}\)\( v[^[:space:]]*\)\{0,1\} => \([^.\/][^[:space:]]*\) \(v[^[:space:]]*\)$/replace \2\3 => \4 \5/p' "$gomod"
  } > go.mod
  printf '//go:build tools\n\npackage seaweedfsbuild\n\nimport _ "%s/weed"\n' "$MODULE" > tools.go
  echo "build-seaweedfs: building weed $SEAWEEDFS_VERSION (a cold build takes 10-30 minutes)" >&2
  go mod tidy -e >&2 2>/dev/null || true
  CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -buildvcs=false" \
    go build -mod=mod -trimpath -ldflags "-s -w" -o "$OUT/weed.tmp" "$MODULE/weed"
  mv "$OUT/weed.tmp" "$OUT/weed"
  echo "$(( $(date +%s) - start ))" > "$OUT/build-seconds"
  echo "$RECIPE" > "$OUT/recipe"
  echo "build-seaweedfs: weed built in $(cat "$OUT/build-seconds")s" >&2
}

mkdir -p "$OUT"
( flock 9; build ) 9>"$OUT.lock"
cached || { echo "build-seaweedfs: no weed binary after the build" >&2; exit 1; }
echo "$OUT/weed"
