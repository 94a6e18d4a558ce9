# mmadmit developer entry points. `make run` and `make test` set everything up.
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

.PHONY: setup run test lint bench protos clean

$(VENV)/.installed: pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || \
	  $(PY) -m pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(VENV)/bin/mmadmit serve $(MMADMIT_ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider

lint: setup
	$(VENV)/bin/ruff check service clients tests bench scripts fuzz setup.py
	$(VENV)/bin/mypy service/mmadmit clients/mmadmit_client

bench: setup
	$(PY) bench/bench_materialize.py
	$(PY) bench/bench_zmq.py
	$(PY) bench/bench_grpc.py
	$(PY) bench/bench_pool.py
	$(PY) bench/bench_engine.py
	$(PY) bench/bench_smg_grpc.py
	$(PY) bench/bench_inline.py

protos: setup
	$(PY) scripts/gen_protos.py

clean:
	rm -rf $(VENV) build *.egg-info clients/build clients/*.egg-info clients/mmadmit_client/_proto service/mmadmit/*.so

# Containers (deploy/README.md). compose-smoke builds the image, brings
# docker-compose.yml up, admits a vector over gRPC and ZMQ from the host and
# checks the drain on stop; without podman or docker it prints SKIP and passes.
# Offline (no registry, no index): make compose-smoke OFFLINE=1 (as root: it
# debootstraps the base images and fills a wheelhouse when they are missing).
.PHONY: compose-smoke compose-base compose-wheelhouse compose-wheelhouse-clean deploy-validate

compose-smoke: setup
	scripts/compose_smoke.sh

compose-base:
	scripts/compose_base.sh

compose-wheelhouse:
	scripts/compose_wheelhouse.sh deploy/wheelhouse

compose-wheelhouse-clean:
	rm -f deploy/wheelhouse/*.whl

deploy-validate: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/test_deploy.py

# Fuzzing (RELIABILITY.md). fuzz-build: the C extensions with ASan + UBSan in
# build/fuzz/mmadmit (clang; FUZZ_CC=gcc works without coverage), and atheris (the
# `fuzz` extra) when it installs. fuzz: every target for FUZZ_SECONDS each on
# the sanitizer build; native-vs-Python divergences and INTERNAL outcomes fail
# it like crashes. fuzz-smoke: the seconds-long, sanitizer-free run of the suite.
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= intcodec pbwire planner kernels zmq grpc smg
FUZZ_ENGINE ?= auto
FUZZ_EXT_DIR := build/fuzz/mmadmit
.PHONY: fuzz-build fuzz fuzz-smoke

fuzz-build: setup
	$(PY) -c "import atheris" 2>/dev/null || $(PY) -m pip install -q -e ".[fuzz]" || \
	  echo "fuzz-build: atheris did not install; make fuzz uses fuzz/mutator.py"
	PYTHON=$(PY) OUT=$(FUZZ_EXT_DIR) fuzz/build_sanitized.sh

fuzz: fuzz-build
	@asan=$$(fuzz/asan_runtime.sh $(PY)); echo "fuzz: LD_PRELOAD=$$asan"; \
	for t in $(FUZZ_TARGETS); do \
	  LD_PRELOAD=$$asan ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=1 \
	  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 MMADMIT_FUZZ_EXT_DIR=$(FUZZ_EXT_DIR) \
	  $(PY) fuzz/run.py $$t --engine $(FUZZ_ENGINE) --seconds $(FUZZ_SECONDS) || exit 1; \
	done

fuzz-smoke: setup
	$(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz_smoke.py tests/test_fuzz_regressions.py

# Load and soak (RELIABILITY.md): scripts/soak.py starts `mmadmit serve` on loopback
# ephemeral ports, holds a mixed load on gRPC and ZMQ for SOAK_SECONDS and fails on
# any lost request or server RSS growth over 5% after warm-up; JSON in build/soak.json.
SOAK_SECONDS ?= 300
.PHONY: soak

soak: setup
	mkdir -p build
	$(PY) scripts/soak.py --duration $(SOAK_SECONDS) --json build/soak.json
