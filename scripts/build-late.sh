#!/usr/bin/env bash
# Builds, in the background of `make test`, what only some tests need (the `late_build`
# ones: tests/conftest.py) and then the cluster (scripts/cluster/build-all.sh), while the
# other tests run. On empty caches that is about half of the first run's build time, spent
# on the cores the tests leave idle. Every build holds its cache's lock, so `make stack`
# after the first pytest session waits for a build in progress instead of repeating it.
# A no-op when everything is cached. Log: where `make test` says.
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for target in helm helm-docs mlmd-venv images seaweedfs observability; do
  start=$SECONDS
  make -s "$target" || status=1
  echo "build-late: $target $((SECONDS - start)) s"
done
bash scripts/cluster/build-all.sh || status=1
echo "build-late: done (status $status)"
exit $status
