#!/usr/bin/env bash
# Fill an offline wheelhouse for the image build (`make compose-wheelhouse`):
# torch (TORCH_SPEC, CPU build by default), every runtime dependency of the
# package and its build requirements, as wheels. With any wheel in
# deploy/wheelhouse/ the Dockerfile installs from there only (pip --no-index).
#
#   scripts/compose_wheelhouse.sh [DIR]        (default DIR: deploy/wheelhouse)
#
# The wheels are for the Python that runs this script (PYTHON, default python3):
# its minor version must be the image's (3.11 for Debian bookworm and
# python:3.11-slim). For another target pass pip's options in
# WHEELHOUSE_PIP_ARGS, e.g. "--python-version 3.12 --platform manylinux_2_28_x86_64".
# Settings: TORCH_SPEC (default torch==2.13.0), TORCH_INDEX (an index for torch,
# e.g. https://download.pytorch.org/whl/cpu; default: pip's configured indexes).
set -euo pipefail

cd "$(dirname "$0")/.."
DIR=${1:-deploy/wheelhouse}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
TORCH_INDEX=${TORCH_INDEX:-}
read -r -a EXTRA <<<"${WHEELHOUSE_PIP_ARGS:-}"

log() { printf '[compose-wheelhouse] %s\n' "$*" >&2; }

mkdir -p "$DIR"
# Runtime dependencies and build requirements of the server (setup.py's
# INSTALL_REQUIRES, pyproject.toml's build requirements) and of the client
# (clients/pyproject.toml), the client itself excluded: it is built from clients/.
mapfile -t REQS < <("$PYTHON" - <<'PY'
import ast
import tomllib

reqs = []
for path in ("pyproject.toml", "clients/pyproject.toml"):
    with open(path, "rb") as f:
        data = tomllib.load(f)
    reqs += data["build-system"]["requires"] + data["project"].get("dependencies", [])
with open("setup.py") as f:
    for node in ast.walk(ast.parse(f.read())):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "INSTALL_REQUIRES":
            reqs += [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
for req in dict.fromkeys(reqs):
    if not req.replace(" ", "").startswith(("torch", "mmadmit")):
        print(req)
PY
)
log "torch: $TORCH_SPEC${TORCH_INDEX:+ from $TORCH_INDEX} -> $DIR"
"$PYTHON" -m pip download --only-binary=:all: -d "$DIR" "${EXTRA[@]}" \
    ${TORCH_INDEX:+--index-url "$TORCH_INDEX"} "$TORCH_SPEC"
log "dependencies and build requirements: ${REQS[*]}"
"$PYTHON" -m pip download --only-binary=:all: -d "$DIR" "${EXTRA[@]}" "${REQS[@]}"
log "$(find "$DIR" -name '*.whl' | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR"
