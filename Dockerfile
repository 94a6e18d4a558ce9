# mmadmit service image (see deploy/README.md).
#
#   docker build -t mmadmit:local .            # python:3.11-slim-bookworm, CPU torch
#   docker compose up -d --build               # the same through docker-compose.yml
#
# Stages: `build` makes a virtual environment in /opt/mmadmit (torch first, from
# TORCH_INDEX, so that the package's loose `torch>=2.4` never resolves to a
# multi-GB CUDA build; then this source tree, with its protobuf stubs and C
# extensions); `runtime` copies that environment onto BASE_IMAGE and runs
# `mmadmit serve` as the non-root user mmadmit (uid 10001).
#
# Build arguments:
#   BASE_IMAGE   runtime base: python3 >= 3.11 with venv, or apt-get to install it
#                (e.g. a CUDA image on Ubuntu 24.04, or one made by `make compose-base`)
#   BUILD_IMAGE  build-stage base (default: BASE_IMAGE). Its python3 must be the same
#                version at the same path as BASE_IMAGE's (the environment is copied).
#                A C compiler and the Python headers there (or apt-get to install them)
#                build the optional C extensions; without them the pure fallbacks run.
#   TORCH_SPEC   default torch==2.13.0 (as the Makefile)
#   TORCH_INDEX  default https://download.pytorch.org/whl/cpu; for CUDA e.g.
#                https://download.pytorch.org/whl/cu128
#   Offline: wheels in deploy/wheelhouse/ (`make compose-wheelhouse`). When any *.whl is
#   there, every pip install reads only that folder (--no-index); TORCH_INDEX is unused.

ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG BUILD_IMAGE=

FROM ${BUILD_IMAGE:-${BASE_IMAGE}} AS build
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive

# python3 with venv, a C compiler and the Python headers: kept when the base has
# them, otherwise installed with apt-get where it works (the compiler is optional).
RUN set -eu; \
    if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 python3-venv python3-dev \
            gcc libc6-dev ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    headers() { python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; }; \
    missing=""; \
    command -v cc >/dev/null 2>&1 || missing="gcc libc6-dev"; \
    headers || missing="$missing python3-dev"; \
    if [ -n "$missing" ]; then \
        { apt-get update && apt-get install -y --no-install-recommends $missing \
          && rm -rf /var/lib/apt/lists/*; } \
        || echo "mmadmit image: no C toolchain ($missing); the C extensions use their pure fallbacks"; \
    fi

# Offline wheels, if any (the folder always exists: it holds a README).
COPY deploy/wheelhouse/ /wheels/

RUN set -eu; \
    python3 -m venv /opt/mmadmit; \
    if ls /wheels/*.whl >/dev/null 2>&1; then \
        echo "mmadmit image: installing from deploy/wheelhouse only"; \
        /opt/mmadmit/bin/pip install --no-index --find-links /wheels "$TORCH_SPEC"; \
    else \
        /opt/mmadmit/bin/pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"; \
    fi

COPY pyproject.toml setup.py MANIFEST.in README.md /src/
COPY scripts/gen_protos.py /src/scripts/gen_protos.py
COPY protos/ /src/protos/
COPY service/ /src/service/
COPY clients/ /src/clients/
RUN set -eu; \
    if ls /wheels/*.whl >/dev/null 2>&1; then set -- --no-index --find-links /wheels; fi; \
    /opt/mmadmit/bin/pip install "$@" /src; \
    /opt/mmadmit/bin/python -c "import importlib.util as u; print('mmadmit image: C extensions:', ', '.join(m for m in ('_walk_c', '_rules_c', '_rules_avx2', '_tensorcheck_c', '_pbwalk_c') if u.find_spec('mmadmit.' + m)) or 'none (pure fallbacks)')"

FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN set -eu; \
    if ! command -v python3 >/dev/null 2>&1; then \
        apt-get update; \
        apt-get install -y --no-install-recommends python3 ca-certificates; \
        rm -rf /var/lib/apt/lists/*; \
    fi; \
    groupadd --system --gid 10001 mmadmit; \
    useradd --uid 10001 --gid 10001 --create-home --home-dir /home/mmadmit \
        --shell /usr/sbin/nologin mmadmit

COPY --from=build /opt/mmadmit /opt/mmadmit

# Inside the container the service listens on every interface; the compose file
# and the Kubernetes manifests decide what is published. Any MMADMIT_* variable
# (docs/spec/CLI.md) configures it; arguments after the image name are `serve` flags.
ENV PATH=/opt/mmadmit/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    MMADMIT_GRPC_LISTEN=0.0.0.0:50051 \
    MMADMIT_ZMQ_LISTEN=tcp://0.0.0.0:5557 \
    MMADMIT_METRICS_LISTEN=0.0.0.0:9464

# Fail the build, not the first start, when the copied environment does not run here.
RUN mmadmit serve --help >/dev/null && python -c "import mmadmit.server, mmadmit_client"

USER 10001:10001
WORKDIR /home/mmadmit
EXPOSE 50051 5557 9464
STOPSIGNAL SIGTERM
ENTRYPOINT ["mmadmit", "serve"]
