# lapse — developer entry points. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.DEFAULT_GOAL := help
# What `make cluster` installs on Kubernetes after the node: "eventing serving" or "eventing".
CLUSTER_KNATIVE ?= eventing serving
.PHONY: help install lock databases mlmd-venv kube crds observability seaweedfs stack test test-unit lint format run demo functions images kubectl helm helm-docs release bench bench-quick bench-knative cluster cluster-stop test-cluster clean

help: ## Show the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-13s %s\n", $$1, $$2}'

install: $(STAMP) ## Create .venv and install lapse (with the embedded NATS server) and its dev tools

# requirements.lock pins what CI and images install, with hashes; pyproject.toml keeps ranges.
# pip takes a lock with hashes as requirements, not as constraints beside an editable
# install ("no single file to hash"): the lock first, hash-checked, then lapse without deps.
$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q --require-hashes -r requirements.lock
	$(BIN)/pip install -q --no-deps -e .
	@touch $@

lock: ## Regenerate requirements.lock from pyproject.toml's ranges (newest versions in range), with hashes
	$(BIN)/uv pip compile -q --universal --python-version 3.11 --extra dev --extra embedded --generate-hashes \
		pyproject.toml -o requirements.lock

databases: ## Install (Debian packages) and start PostgreSQL and MariaDB on loopback
	bash scripts/databases.sh

mlmd-venv: install ## ML Metadata's own library in a test-only venv (~/.cache/lapse/mlmd-venv)
	PYTHON311=$${PYTHON311:-$(BIN)/python} bash scripts/build-mlmd-venv.sh >/dev/null

kube: ## Build etcd + kube-apiserver from the Go module proxy (cached by version)
	bash lapse/embedded/build-kube.sh >/dev/null

observability: ## Build Prometheus, an OpenTelemetry Collector and Jaeger from the Go module proxy (cached)
	bash scripts/build-observability.sh >/dev/null

seaweedfs: ## Build SeaweedFS (an S3 server, for the artifacts target's tests) from the Go module proxy (cached)
	bash scripts/build-seaweedfs.sh >/dev/null

stack: databases kube kubectl helm helm-docs crds observability seaweedfs images mlmd-venv ## Everything the integration tests need (NATS is started by the tests)

# The tests in three steps, so that on empty caches the builds only some of them need use the
# cores the others leave idle: scripts/build-late.sh builds those and the cluster in the
# background (niced) while every test but the `late_build` ones runs; `make stack` then
# waits for those builds (each holds its cache's lock); then the `late_build` tests and the
# cluster's run side by side — both mostly wait on clocks (a CI run used 30% of 2 cores),
# and they share no server: the cluster's output goes to CLUSTER_LOG, printed when both end.
# Every step runs even when one before it failed: one run reports them all.
BUILD_LOG ?= $(or $(TMPDIR),/tmp)/lapse-build-late.log
CLUSTER_LOG ?= $(or $(TMPDIR),/tmp)/lapse-test-cluster.log
test: install databases kube kubectl crds ## Run the whole test suite against real servers, then on the real cluster
	@( nice -n 19 bash scripts/build-late.sh >$(BUILD_LOG) 2>&1 & )
	@echo "helm, images, SeaweedFS, observability, the cluster: building in the background (log: $(BUILD_LOG))"
	$(BIN)/pytest -m "not late_build"; status=$$?; \
	  $(MAKE) stack || status=1; \
	  echo "make test-cluster: running beside the late_build tests (log: $(CLUSTER_LOG), printed below when done)"; \
	  rm -f $(CLUSTER_LOG).rc; ( $(MAKE) test-cluster >$(CLUSTER_LOG) 2>&1; echo $$? >$(CLUSTER_LOG).rc ) & cluster=$$!; \
	  $(BIN)/pytest -m late_build || status=1; \
	  wait $$cluster; echo "----- make test-cluster (from $(CLUSTER_LOG)) -----"; cat $(CLUSTER_LOG); \
	  [ "$$(cat $(CLUSTER_LOG).rc 2>/dev/null)" = 0 ] || status=1; \
	  exit $$status

test-unit: install ## Run only the unit tests (no servers)
	$(BIN)/pytest tests/unit

lint: install ## ruff, mypy and the import contracts (layers: docs/architecture.md)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

format: install ## Apply ruff's formatting and safe fixes
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

run: install seaweedfs ## Run lapse (lapse up) on embedded defaults where nothing is configured
	$(BIN)/lapse up

demo: install seaweedfs ## A self-contained tour on embedded servers (about a minute)
	$(BIN)/lapse demo

bench: install databases kube seaweedfs ## Benchmarks (printed figures; see bench/): bench-quick's comparison at full size, then bench-knative
	$(BIN)/python bench/bench_planner.py
	$(BIN)/python bench/bench_row_reaper.py
	$(BIN)/python -m bench.bench_artifacts
	$(BIN)/python -m bench.bench_pending
	$(BIN)/python -m bench.compare
	$(MAKE) bench-knative

bench-knative: install databases observability images cluster ## The Knative path on the real cluster beside `lapse up` (bench/out/knative.json; the cluster stopped after)
	$(BIN)/python -m bench.bench_knative; status=$$?; \
	  bash scripts/cluster/stop.sh; exit $$status

bench-quick: install kube ## lapse vs Argo's controller vs a janitor sweep, scaled down (bench/out/bench-quick.json)
	$(BIN)/python -m bench.compare --quick

functions: install ## Prepare functions/*/ for `func build` (vendors lapse, writes pyproject.toml)
	$(BIN)/python scripts/package-functions.py

# buildah builds the Containerfile; the image tests unpack with umoci and push to a local
# docker-registry (images/README.md).
images: install ## Build every image from the Containerfile with buildah, no daemon (cached by inputs)
	bash scripts/debian-packages.sh mmdebstrap buildah skopeo umoci docker-registry
	nice -n 19 $(BIN)/python scripts/build-images.py >/dev/null

# A release of this tree's version (pyproject.toml's: the images and the wheel carry it),
# into dist/release/<version>/ (git-ignored): docs/releasing.md. Tags and pushes nothing.
VERSION ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
release: install helm images ## Wheel, sdist, images (OCI archives), SBOMs, the chart pinned by digest, SHA256SUMS, notes
	$(BIN)/python scripts/release.py --version $(VERSION) --helm "$$(bash scripts/build-helm.sh | tail -n 1)"

kubectl: ## Build kubectl (for `kubectl kustomize` of infra/) from the Go module proxy (cached by version)
	bash scripts/build-kubectl.sh >/dev/null

helm: ## Build helm (the chart's tests: lint, template, install on the cluster) from the Go module proxy (cached by version)
	bash scripts/build-helm.sh >/dev/null

helm-docs: ## Build helm-docs (charts/lapse/README.md is generated by it; docs/helm.md) from the Go module proxy (cached)
	bash scripts/build-helm-docs.sh >/dev/null

crds: ## Generate the Prometheus Operator's CRDs (for infra/components/monitoring's tests) from its Go module (cached)
	bash scripts/build-prometheus-operator-crds.sh >/dev/null

cluster: ## Start a single-node Kubernetes with Knative Eventing + Serving here (root; docs/cluster.md)
	bash scripts/cluster/start.sh >/dev/null
	bash scripts/cluster/knative.sh $(CLUSTER_KNATIVE)

cluster-stop: ## Stop that cluster and restore the host (processes, mounts, iptables, cgroups, sysctls)
	bash scripts/cluster/stop.sh

test-cluster: install databases observability helm images cluster ## The tests on the real cluster (started here, stopped after, pass or fail)
	$(BIN)/pytest -p no:cacheprovider -rP tests/cluster; status=$$?; \
	  bash scripts/cluster/stop.sh; exit $$status

clean: ## Remove the virtualenv and caches kept inside the repository
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build *.egg-info
