#!/usr/bin/env bash
# Builds the test-only virtualenv that holds ML Metadata's own Python library (the
# `ml-metadata` wheel from PyPI, for CPython 3.11), at ~/.cache/lapse/mlmd-venv/<version>.
# The tests use it to let MLMD itself create its schema and records in MariaDB
# (tests/mlmd_writer.py). It is a separate environment because ml-metadata pins protobuf
# 4.x, which lapse's own (protobuf 7, for OpenTelemetry) cannot share. Idempotent, with a
# lock; prints the venv's python on stdout (last line).
set -euo pipefail

version="${MLMD_VERSION:-1.17.1}"
# Any CPython 3.11 will do (the wheel is built for it); a virtualenv's python is fine too.
python="${PYTHON311:-python3.11}"
command -v "$python" >/dev/null || { echo "mlmd-venv: $python not found (set PYTHON311)" >&2; exit 1; }
"$python" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null \
  || { echo "mlmd-venv: $python is not CPython 3.11 (set PYTHON311)" >&2; exit 1; }
root="${XDG_CACHE_HOME:-$HOME/.cache}/lapse/mlmd-venv"
dir="$root/$version"
mkdir -p "$root"
exec 9>"$root/.lock"
flock 9
if [ ! -x "$dir/bin/python" ] || [ ! -f "$dir/.done" ]; then
  rm -rf "$dir"
  echo "mlmd-venv: building $dir (ml-metadata==$version)" >&2
  "$python" -m venv "$dir"
  "$dir/bin/pip" install -q --disable-pip-version-check "ml-metadata==$version" >&2
  "$dir/bin/python" -c "import ml_metadata" >&2
  touch "$dir/.done"
fi
echo "$dir/bin/python"
