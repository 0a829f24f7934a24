# rdma-device-plugin: every check a contributor or CI runs. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(abspath $(VENV))/bin
export PATH := $(BIN):$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible.cfg

.PHONY: help setup system-deps demo prometheus-local test lint test-plugin test-chart test-molecule image bench proto clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-14s %s\n", $$1, $$2}'

$(VENV)/.stamp: requirements-dev.txt plugin_src/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	$(PY) -m pip install -q -e plugin_src
	touch $@

system-deps: ## install the Debian packages the tests use (buildah, registry, pyverbs, ...)
	bash scripts/setup-system.sh

setup: $(VENV)/.stamp ## create .venv from the pinned requirements

demo: setup ## the main job on the local default: validate, deploy and verify a fixture Lingjun node via Ansible
	$(BIN)/ansible-playbook playbooks/site.yml -i inventories/local

PROMETHEUS_ARGS ?= --keep
prometheus-local: setup system-deps ## a real Prometheus with the chart's alerts scraping the local default's plugin (`make demo` first): prints alert states and its address
	$(PY) scripts/prometheus_local.py --target 127.0.0.1:9410 --node lingjun-node-0 --port 0 $(PROMETHEUS_ARGS)

lint: setup ## ruff, mypy, yamllint, ansible-lint, generated-code drift
	cd plugin_src && $(BIN)/ruff check src tests && $(BIN)/ruff format --check src tests
	cd plugin_src && $(BIN)/mypy
	$(BIN)/ruff check --config plugin_src/pyproject.toml bench && $(BIN)/ruff format --check --config plugin_src/pyproject.toml bench
	$(BIN)/ruff check --select F,E9 library filter_plugins  # modules run on nodes: pyflakes-level checks only
	$(BIN)/yamllint -s .
	bash scripts/check-proto.sh
	if [ -d roles ] && ls roles/*/tasks >/dev/null 2>&1; then $(BIN)/ansible-lint; fi

test-plugin: setup ## plugin unit and integration tests (real gRPC over unix sockets)
	$(PY) -m pytest plugin_src/tests --junitxml=out/test-results/plugin.xml

test-chart: setup system-deps ## Helm chart tests (real Helm engine, Kubernetes schemas, CEL, promtool and a real Prometheus)
	$(PY) -m pytest charts/rdma-device-plugin/tests --junitxml=out/test-results/chart.xml

test-molecule: setup system-deps ## every molecule scenario, for real on localhost
	bash scripts/run-molecule.sh

test: setup system-deps ## everything CI runs; ends with one "N passed, N failed" line
	rm -rf out/test-results
	$(MAKE) --no-print-directory lint test-plugin test-chart test-molecule
	$(PY) scripts/test-summary.py out/test-results

image: setup system-deps ## build the image with buildah and push it to a registry on 127.0.0.1 (the plugin-image scenario)
	bash scripts/make-base-image.sh && $(BIN)/molecule test -s plugin-image

bench: setup ## print the benchmark figures (see bench/RESULTS.md)
	$(PY) bench/bench_plugin.py

proto: setup ## regenerate the gRPC code from api/deviceplugin.proto
	bash scripts/check-proto.sh --write

clean: ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache plugin_src/.mypy_cache plugin_src/.ruff_cache
