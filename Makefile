# mmadmit developer entry points. `make run` and `make test` set everything up;
# `make help` (or plain `make`) lists every target.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and explicitly, so that resolving the package's loose
# `torch>=2.4` never pulls a multi-GB CUDA build onto a CPU machine. On a machine
# without a local CPU wheel, point TORCH_INDEX at a CPU wheel index, e.g.
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
MMADMIT_ARGS ?=

# Two installs, each with its own stamp: serving (`make run`) needs the package and
# its client only; the `test` extra (pytest, transformers, the SMG gateway, ruff,
# mypy, ...) comes with `make setup` / `make test` and every developer target. pip
# runs without -q, so a first install shows what it is doing (a few minutes).
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test

.DEFAULT_GOAL := help
.PHONY: help setup setup-serve run test lint bench protos clean

help: ## list the targets (this)
	@echo "make TARGET [VARIABLE=value ...]; the targets:"
	@awk -F':.*## ' '/^[a-zA-Z0-9_-]+:.*## / {printf "  %-25s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "variables: TORCH_SPEC TORCH_INDEX PYTHON VENV MMADMIT_ARGS SOAK_SECONDS FUZZ_SECONDS FUZZ_TARGETS"

# $(VENV) with torch in it, installed on its own before anything can pull it in.
define venv_with_torch
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || \
	  echo "setup: installing $(TORCH_SPEC) into $(VENV) first (CPU build; a few minutes)"
	$(PY) -c "import torch" 2>/dev/null || \
	  $(PY) -m pip install "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
endef

# The client (clients/) is installed editable first; MMADMIT_CLIENT_REQUIREMENT
# tells setup.py to require it by name, which that install satisfies.
CLIENT_FIRST := $(PY) -m pip install -e ./clients && MMADMIT_CLIENT_REQUIREMENT=mmadmit-client
PACKAGING := pyproject.toml setup.py clients/pyproject.toml clients/setup.py

$(SERVE_STAMP): $(PACKAGING)
	$(venv_with_torch)
	@echo "setup: installing mmadmit and its client into $(VENV) (builds the C extensions)"
	$(CLIENT_FIRST) $(PY) -m pip install -e .
	touch $@

$(TEST_STAMP): $(PACKAGING)
	$(venv_with_torch)
	@echo "setup: installing mmadmit with the test extra into $(VENV) (a few minutes)"
	$(CLIENT_FIRST) $(PY) -m pip install -e ".[test]"
	touch $@ $(SERVE_STAMP)

setup: $(TEST_STAMP) ## .venv for development: torch (CPU), the package, the test extra

setup-serve: $(SERVE_STAMP) ## .venv for serving only: torch (CPU), the package and its client

run: $(SERVE_STAMP) ## serve the default profile (flags: MMADMIT_ARGS="--model ...")
	$(VENV)/bin/mmadmit serve $(MMADMIT_ARGS)

test: setup ## the whole test suite, CPU only (what .ci/run calls)
	$(PY) -m pytest -q -p no:cacheprovider

lint: setup ## ruff and mypy
	$(VENV)/bin/ruff check service clients tests bench scripts fuzz setup.py
	$(VENV)/bin/mypy service/mmadmit clients/mmadmit_client

bench: setup ## every benchmark in bench/ (medians next to their baselines)
	$(PY) bench/bench_materialize.py
	$(PY) bench/bench_zmq.py
	$(PY) bench/bench_grpc.py
	$(PY) bench/bench_pool.py
	$(PY) bench/bench_pool.py --only share
	$(PY) bench/bench_engine.py
	$(PY) bench/bench_smg_grpc.py
	$(PY) bench/bench_inline.py
	$(PY) bench/bench_fast_paths.py

protos: setup ## regenerate the protobuf modules from protos/
	$(PY) scripts/gen_protos.py

clean: ## remove .venv, build outputs and generated code
	rm -rf $(VENV) build *.egg-info clients/build clients/*.egg-info clients/mmadmit_client/proto service/mmadmit/*.so

# Containers (deploy/README.md). compose-smoke builds the image, brings
# docker-compose.yml up, admits a vector over gRPC and ZMQ from the host and
# checks the drain on stop; without podman or docker it prints SKIP and passes.
# Offline (no registry, no index): make compose-smoke OFFLINE=1 (as root: it
# debootstraps the base images and fills a wheelhouse when they are missing).
.PHONY: compose-smoke compose-base compose-wheelhouse compose-wheelhouse-clean deploy-validate

compose-smoke: setup ## build the image, bring docker-compose.yml up, admit, drain
	scripts/compose_smoke.sh

compose-base: ## debootstrap the base images (offline builds)
	scripts/compose_base.sh

compose-wheelhouse: ## fill deploy/wheelhouse for an offline image build
	scripts/compose_wheelhouse.sh deploy/wheelhouse

compose-wheelhouse-clean: ## empty deploy/wheelhouse
	rm -f deploy/wheelhouse/*.whl

deploy-validate: setup ## check the compose file and k8s manifests
	$(PY) -m pytest -q -p no:cacheprovider tests/test_deploy.py

# Fuzzing (RELIABILITY.md). fuzz-build: the C extensions with ASan + UBSan in
# build/fuzz/mmadmit (clang; FUZZ_CC=gcc works without coverage), and atheris (the
# `fuzz` extra) when it installs. fuzz: every target for FUZZ_SECONDS each on
# the sanitizer build; native-vs-Python divergences and INTERNAL outcomes fail
# it like crashes. fuzz-smoke: the seconds-long, sanitizer-free run of the suite.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= intcodec pbwire planner kernels zmq grpc smg
# atheris (libFuzzer) needs a clang build; a gcc-only machine uses fuzz/mutator.py
FUZZ_ENGINE ?= $(if $(shell command -v clang 2>/dev/null),auto,mutate)
FUZZ_EXT_DIR := build/fuzz/mmadmit
.PHONY: fuzz-build fuzz fuzz-smoke

fuzz-build: setup ## the C extensions with ASan + UBSan, and atheris
	$(PY) -c "import atheris" 2>/dev/null || MMADMIT_CLIENT_REQUIREMENT=mmadmit-client $(PY) -m pip install -q -e ".[fuzz]" || \
	  echo "fuzz-build: atheris did not install; make fuzz uses fuzz/mutator.py"
	PYTHON=$(PY) OUT=$(FUZZ_EXT_DIR) fuzz/build_sanitized.sh

fuzz: fuzz-build ## every fuzz target for FUZZ_SECONDS on the sanitizer build
	@asan=$$(fuzz/asan_runtime.sh $(PY)); echo "fuzz: LD_PRELOAD=$$asan"; \
	for t in $(FUZZ_TARGETS); do \
	  LD_PRELOAD=$$asan ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=1 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 MMADMIT_FUZZ_EXT_DIR=$(FUZZ_EXT_DIR) \
	  $(PY) fuzz/run.py $$t --engine $(FUZZ_ENGINE) --seconds $(FUZZ_SECONDS) || exit 1; \
	done

fuzz-smoke: setup ## the seconds-long fuzz suite, no sanitizers
	$(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz_smoke.py tests/test_fuzz_regressions.py

# Load and soak (RELIABILITY.md): scripts/soak.py starts `mmadmit serve` on loopback
# ephemeral ports, holds a mixed load on gRPC and ZMQ for SOAK_SECONDS and fails on
# any lost request or server RSS growth over 5% after warm-up; JSON in build/soak.json.
SOAK_SECONDS ?= 300
.PHONY: soak

soak: setup ## mixed load for SOAK_SECONDS; fails on a lost request or RSS growth
	mkdir -p build
	$(PY) scripts/soak.py --duration $(SOAK_SECONDS) --json build/soak.json

# The SMG demo (docs/smg-grpc.md, "By hand"): scripts/smg_demo.py runs the real SMG in
# front of mmadmit's SMG gRPC face and the test scheduler, all on loopback ephemeral
# ports, sends a text completion and a Qwen2.5-VL image chat, prints both answers and
# stops everything; a failure names its step. smg==1.13.0 is installed when missing.
.PHONY: smg-demo

smg-demo: setup ## SMG -> mmadmit's SMG gRPC face -> test scheduler: a text and an image request
	$(PY) -c "import importlib.metadata as m, sys; sys.exit(m.version('smg') != '1.13.0')" \
	  2>/dev/null || $(PY) -m pip install "smg==1.13.0"
	$(PY) scripts/smg_demo.py
