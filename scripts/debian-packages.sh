#!/usr/bin/env bash
# Installs the given Debian packages when they are missing (one apt-get for all of them).
# Idempotent; needs root only when something is missing. Usage: debian-packages.sh PKG...
set -euo pipefail

missing=()
for pkg in "$@"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
  echo "debian-packages: ${missing[*]} missing and not root; install them with apt-get" >&2
  exit 1
fi
echo "debian-packages: installing ${missing[*]}" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
