# rdma-device-plugin: every check a contributor or CI runs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: help setup system-deps demo stop status prometheus-local test test-sequential lint test-plugin test-plugin-loaded test-chart test-ops test-node test-molecule collection image bench bench-fleet proto clean kube imgsig cluster-up cluster-down node-up node-down dra-demo

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

# One line per package collected, downloaded and then installed (a few minutes and about 1.3 GB on a
# first run, seconds from the pip cache): scripts/pip_progress.py.
$(VENV)/.stamp: requirements-dev.txt plugin_src/pyproject.toml plugins/module_utils/pyproject.toml plugin_src/kubesim/pyproject.toml
	@echo "setup [1/3] $(VENV): Python virtual environment"
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "setup [2/3] requirements-dev.txt (pip, ansible, molecule, helm engine, test tools; every file checked against its sha256)"
	@$(PY) scripts/pip_progress.py --require-hashes -r requirements-dev.txt
	@echo "setup [3/3] the plugin, the node package and the kubelet simulator (editable: plugin_src/, plugins/module_utils/, plugin_src/kubesim/)"
	@$(PY) -m pip install -q --no-deps --no-build-isolation -e plugins/module_utils -e plugin_src -e plugin_src/kubesim
	@$(PY) -m pip check -q
	@touch $@
	@echo "setup done: $(VENV)"

system-deps: ## install the Debian packages the tests use (buildah, registry, pyverbs, ...)
	bash scripts/setup-system.sh

setup: $(VENV)/.stamp ## create .venv from the pinned requirements

# Upstream Kubernetes from the modules pinned in kube/go.mod (the version is that one pin:
# scripts/kube-bump.sh VERSION moves it). The first build compiles for tens of minutes on 2 cores and
# prints progress; later ones come from Go's build cache in seconds.
kube: ## build etcd, kube-apiserver, -controller-manager, -scheduler, kubectl, helm and kubelet-managers into .cache/kubernetes/<version>/bin
	bash scripts/kube-build.sh

# tools/imgsig: cosign's key-pair signature format from go-containerregistry and sigstore/sigstore (the
# deploy role's image verifier, the tests' signer); about 2 minutes the first time, then a stamp skips it.
imgsig: ## build the image signature verifier tools/imgsig into .cache/imgsig/bin
	bash scripts/imgsig-build.sh

cluster-up: setup kube ## a local control plane of upstream Kubernetes on 127.0.0.1; writes out/cluster/kubeconfig
	$(PY) scripts/kube_cluster.py up --no-build

cluster-down: ## stop every process cluster-up started
	@if [ -x $(PY) ]; then $(PY) scripts/kube_cluster.py down; else python3 scripts/kube_cluster.py down; fi

node-up: setup system-deps kube ## a real node (kubelet, containerd, runc) joined to cluster-up's control plane; writes out/cluster/node-values.yaml
	$(PY) scripts/real_node.py up

node-down: ## stop the real node: no process, mount, bridge or cgroup of it is left
	@if [ -x $(PY) ]; then $(PY) scripts/real_node.py down; else python3 scripts/real_node.py down; fi

dra-demo: setup kube ## the DRA driver on the local control plane: a fixture node, an rdma/hca: 1 pod and a claim aligned to a stub GPU, what each got
	$(PY) scripts/dra_demo.py

demo: setup ## the main job on the local default: validate, deploy and verify a fixture Lingjun node via Ansible
	$(BIN)/ansible-playbook playbooks/site.yml -i inventories/local

stop: ## stop the local default's plugin and kubelet simulator (playbooks/uninstall.yml -i inventories/local)
	@if [ -x $(BIN)/ansible-playbook ]; then $(BIN)/ansible-playbook playbooks/uninstall.yml -i inventories/local; \
	else echo "no $(VENV): nothing of the local default can be running from it"; fi

LOCAL_STATE := out/local/run/local-plugin.json
status: setup ## the local default's plugin status: mode, capacity/allocatable, NICs with health, last allocations; its processes and metrics address
	@$(PY) scripts/local_status.py $(LOCAL_STATE) out/local/dp "make demo"

PROMETHEUS_ARGS ?= --keep
prometheus-local: setup system-deps ## a real Prometheus with the chart's alerts scraping the local default's plugin (`make demo` first): prints alert states and its address
	@target=$$($(PY) -c 'import json,sys; print(json.load(open(sys.argv[1])).get("metrics_address",""))' $(LOCAL_STATE) 2>/dev/null); \
	  [ -n "$$target" ] || { echo "the local plugin serves no metrics ($(LOCAL_STATE)): run make demo first" >&2; exit 1; }; \
	  $(PY) scripts/prometheus_local.py --target $$target --node lingjun-node-0 --port 0 $(PROMETHEUS_ARGS)

lint: setup ## ruff, mypy, yamllint, actionlint and zizmor (workflows), ansible-lint, generated-code drift
	cd plugin_src && $(BIN)/ruff check src kubesim tests && $(BIN)/ruff format --check src kubesim tests
	cd plugin_src && $(BIN)/mypy
	$(BIN)/ruff check --config plugin_src/pyproject.toml bench tests plugins/module_utils/rdma_node scripts/kube_cluster.py scripts/real_node.py && $(BIN)/ruff format --check --config plugin_src/pyproject.toml bench tests plugins/module_utils/rdma_node scripts/kube_cluster.py scripts/real_node.py
	$(BIN)/ruff check --select F,E9 plugins scripts  # modules run on nodes (any Python 3): pyflakes-level checks only
	$(BIN)/yamllint -s .
	bash scripts/check-proto.sh
	bash scripts/actionlint.sh
	$(BIN)/zizmor --offline --no-progress .github/workflows  # workflow security: pinned actions, permissions, credentials
	if [ -d roles ] && ls roles/*/tasks >/dev/null 2>&1; then $(BIN)/ansible-lint; fi

test-plugin: setup kube ## plugin unit and integration tests (real gRPC over unix sockets)
	$(PY) -m pytest plugin_src/tests --junitxml=out/test-results/plugin.xml

test-plugin-loaded: setup system-deps kube ## the plugin tests with stress-ng --cpu 2 beside them (they must not flake on a loaded machine)
	stress-ng --cpu 2 --timeout 3600 --quiet & pid=$$!; \
	  $(PY) -m pytest plugin_src/tests --junitxml=out/test-results/plugin-loaded.xml; rc=$$?; kill $$pid; wait $$pid 2>/dev/null; exit $$rc

test-chart: setup system-deps kube ## Helm chart tests (real Helm engine, Kubernetes schemas, CEL, promtool and a real Prometheus)
	$(PY) -m pytest charts/rdma-device-plugin/tests --junitxml=out/test-results/chart.xml

test-ops: setup kube imgsig ## automation and docs: example inventory offline check, typed variables, uninstall, runnable doc blocks
	$(PY) -m pytest tests --ignore=tests/node --junitxml=out/test-results/ops.xml

test-node: setup system-deps kube ## the real-node tier: the chart's pods on the kubelet, containerd and runc (one node per machine)
	$(PY) -m pytest tests/node --junitxml=out/test-results/node.xml

test-molecule: setup system-deps kube imgsig ## every molecule scenario, for real on localhost
	bash scripts/run-molecule.sh

collection: setup kube ## a plain `ansible-galaxy collection build` of this repository, installed, and a playbook outside it running validate, deploy (Helm) and verify by FQCN against a real cluster
	bash scripts/build-collection.sh --check

# Two lanes side by side (each sequential, its lines prefixed): most of the real-cluster tests wait on
# the cluster (rollouts, minReadySeconds), so two lanes fit the budget on 2 cores. They share no
# port, registry or directory; the local default is taken under one lock (tests/conftest.py). A lane
# goes on after a failed target (-k); the lanes skip setup, system-deps and kube (-o): this target
# made them once, before the lanes start.
LANE_CODE := lint test-plugin test-chart test-node collection
LANE_OPS := test-ops test-molecule
LANE_SKIP := -o setup -o system-deps -o kube -o imgsig -o $(VENV)/.stamp

test: setup system-deps kube imgsig ## everything CI runs (two lanes side by side); ends with one "N passed, N failed" line
	rm -rf out/test-results
	@start=$$(date +%s); \
	  ( set -o pipefail; $(MAKE) --no-print-directory -j1 -k $(LANE_SKIP) $(LANE_CODE) 2>&1 | sed -u 's/^/[code] /' ) & code=$$!; \
	  ( set -o pipefail; $(MAKE) --no-print-directory -j1 -k $(LANE_SKIP) $(LANE_OPS) 2>&1 | sed -u 's/^/[ops]  /' ) & ops=$$!; \
	  wait $$code; rc_code=$$?; wait $$ops; rc_ops=$$?; \
	  echo "lanes: code ($(LANE_CODE)) exit $$rc_code, ops ($(LANE_OPS)) exit $$rc_ops, $$(( ($$(date +%s) - start) / 60 )) min"; \
	  $(PY) scripts/test-summary.py out/test-results; rc=$$?; \
	  [ $$rc_code -eq 0 ] && [ $$rc_ops -eq 0 ] && exit $$rc; exit 1

test-sequential: setup system-deps kube imgsig ## everything CI runs, one target after another
	rm -rf out/test-results
	$(MAKE) --no-print-directory $(LANE_CODE) $(LANE_OPS)
	$(PY) scripts/test-summary.py out/test-results

image: setup system-deps ## build the image with buildah and push it to a registry on 127.0.0.1 (the plugin-image scenario)
	bash scripts/make-base-image.sh && $(BIN)/molecule test -s plugin-image

bench: setup ## benchmark figures with progress, load average, ratios to bench/RESULTS.md, plot in out/bench/
	$(PY) bench/bench_plugin.py

FLEET_HOSTS ?= 120
FLEET_ARGS ?=
bench-fleet: setup ## Ansible at fleet scale: ping/validate/deploy/verify per host over FLEET_HOSTS fixture hosts (bench/fleet.py); FLEET_ARGS=--write-results records them
	$(PY) bench/fleet.py --hosts $(FLEET_HOSTS) $(FLEET_ARGS)

proto: setup ## regenerate the gRPC code from api/deviceplugin.proto
	bash scripts/check-proto.sh --write

clean: stop ## stop the local default, then remove the venv and caches
	rm -rf $(VENV) .pytest_cache plugin_src/.mypy_cache plugin_src/.ruff_cache
