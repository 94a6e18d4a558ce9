#!/usr/bin/env bash
# Bring docker-compose.yml up for real and prove it (`make compose-smoke`):
# build the image, start the stack, wait until its healthcheck passes, admit a
# vector from the host over gRPC and over ZMQ with mmadmit-client, read
# /metrics, stop the stack, and check that the service drained and exited 0.
#
#   scripts/compose_smoke.sh            run it (without a container engine: SKIP, exit 0)
#   scripts/compose_smoke.sh --check    only say which engine and compose tool would run;
#                                       exit 0 if there is one, 77 (skip) if not
#
# Normal path: docker (or podman) with a registry: the image builds on
# python:3.11-slim-bookworm and CPU torch from download.pytorch.org.
# Offline path (no registry, no package index): OFFLINE=1 makes what is missing,
# the base images with scripts/compose_base.sh (debootstrap, needs root) and the
# wheelhouse with scripts/compose_wheelhouse.sh, then builds from them.
#
# Settings (environment):
#   ENGINE        podman | docker (default: the first that answers `info`)
#   COMPOSE       the compose command (default: `docker compose`, docker-compose or
#                 podman-compose, whichever fits ENGINE)
#   BASE_IMAGE, BUILD_IMAGE, TORCH_SPEC, TORCH_INDEX   image build arguments (Dockerfile)
#   OFFLINE=1     BASE_IMAGE/BUILD_IMAGE default to the debootstrapped localhost images
#                 (made if missing) and WHEELHOUSE to .cache/wheelhouse (filled if empty)
#   WHEELHOUSE    a folder of wheels to build from: linked into deploy/wheelhouse/ for
#                 the build, removed again afterwards
#   PROJECT       compose project name (default mmadmit-smoke)
#   SMOKE_GRPC_PORT, SMOKE_ZMQ_PORT, SMOKE_METRICS_PORT  host loopback ports
#                 (default 50651, 5657, 9564: not the service defaults, which a
#                 developer's own `make run` may hold)
#   VECTOR        frames file to admit (default tests/data/vectors/qwen3_5_image1.frames,
#                 matching the compose file's default model config)
#   CLIENT        mmadmit-client on the host (default .venv/bin/mmadmit-client)
#   PYTHON        host Python with numpy, to compare the answers with the vector's .npz
#                 (default .venv/bin/python)
#   HEALTH_TIMEOUT  seconds to wait for healthy (default 240)
#   REQUIRE_ENGINE=1  fail instead of skipping when there is no engine
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PROJECT=${PROJECT:-mmadmit-smoke}
SERVICE=mmadmit
VECTOR=${VECTOR:-tests/data/vectors/qwen3_5_image1.frames}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-240}
export MMADMIT_HOST_GRPC_PORT=${SMOKE_GRPC_PORT:-50651}
export MMADMIT_HOST_ZMQ_PORT=${SMOKE_ZMQ_PORT:-5657}
export MMADMIT_HOST_METRICS_PORT=${SMOKE_METRICS_PORT:-9564}
DRAIN_TIMEOUT=${MMADMIT_DRAIN_TIMEOUT:-10}
export MMADMIT_DRAIN_TIMEOUT=$DRAIN_TIMEOUT

step() { printf '\n[compose-smoke] == %s\n' "$*"; }
log() { printf '[compose-smoke] %s\n' "$*"; }
die() { printf '[compose-smoke] FAIL: %s\n' "$*" >&2; exit 1; }
skip() {
    printf '[compose-smoke] SKIP: %s\n' "$*"
    if [[ ${CHECK_ONLY:-0} == 1 ]]; then exit 77; fi
    if [[ ${REQUIRE_ENGINE:-0} == 1 ]]; then exit 1; fi
    exit 0
}

CHECK_ONLY=0
case ${1:-} in
    --check) CHECK_ONLY=1 ;;
    "") ;;
    *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

# --- engine and compose tool ------------------------------------------------
engine_works() { command -v "$1" >/dev/null 2>&1 && "$1" info >/dev/null 2>&1; }
if [[ -z ${ENGINE:-} ]]; then
    if engine_works podman; then ENGINE=podman
    elif engine_works docker; then ENGINE=docker
    else
        skip "no container engine: neither 'podman info' nor 'docker info' works here" \
            "(install podman + podman-compose, or docker with its compose plugin)"
    fi
elif ! engine_works "$ENGINE"; then
    skip "ENGINE=$ENGINE does not answer '$ENGINE info'"
fi
if [[ -z ${COMPOSE:-} ]]; then
    if [[ $ENGINE == docker ]] && docker compose version >/dev/null 2>&1; then
        COMPOSE="docker compose"
    elif [[ $ENGINE == docker ]] && command -v docker-compose >/dev/null 2>&1; then
        COMPOSE=docker-compose
    elif [[ $ENGINE == podman ]] && command -v podman-compose >/dev/null 2>&1; then
        COMPOSE=podman-compose
    else
        skip "$ENGINE works but no compose tool for it was found" \
            "(docker: the compose plugin; podman: pip install podman-compose)"
    fi
fi
read -r -a COMPOSE_CMD <<<"$COMPOSE"
if [[ $CHECK_ONLY == 1 ]]; then
    log "engine: $ENGINE ($("$ENGINE" --version 2>/dev/null | head -n1)); compose: $COMPOSE"
    exit 0
fi

# --- client on the host -----------------------------------------------------
if [[ -z ${CLIENT:-} ]]; then
    if [[ -x .venv/bin/mmadmit-client ]]; then CLIENT=.venv/bin/mmadmit-client
    else CLIENT=$(command -v mmadmit-client || true); fi
fi
if [[ -z ${PYTHON:-} ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
[[ -n $CLIENT ]] || die "mmadmit-client not found on the host (make setup, or set CLIENT)"
[[ -f $VECTOR ]] || die "no vector file $VECTOR"

# --- offline inputs ---------------------------------------------------------
LINKED_WHEELS=()
cleanup_wheels() {
    local f
    for f in "${LINKED_WHEELS[@]}"; do rm -f "$f"; done
}
if [[ ${OFFLINE:-0} == 1 ]]; then
    export BASE_IMAGE=${BASE_IMAGE:-localhost/mmadmit-base:bookworm}
    export BUILD_IMAGE=${BUILD_IMAGE:-localhost/mmadmit-build-base:bookworm}
    if ! "$ENGINE" image inspect "$BASE_IMAGE" >/dev/null 2>&1 \
        || ! "$ENGINE" image inspect "$BUILD_IMAGE" >/dev/null 2>&1; then
        step "base images (scripts/compose_base.sh)"
        ENGINE=$ENGINE BASE_IMAGE=$BASE_IMAGE BUILD_IMAGE=$BUILD_IMAGE scripts/compose_base.sh
    fi
    WHEELHOUSE=${WHEELHOUSE:-.cache/wheelhouse}
    if ! compgen -G "$WHEELHOUSE/*.whl" >/dev/null; then
        step "wheelhouse (scripts/compose_wheelhouse.sh $WHEELHOUSE)"
        scripts/compose_wheelhouse.sh "$WHEELHOUSE"
    fi
fi
if [[ -n ${WHEELHOUSE:-} ]]; then
    compgen -G "$WHEELHOUSE/*.whl" >/dev/null || die "WHEELHOUSE=$WHEELHOUSE holds no wheels"
    src=$(cd "$WHEELHOUSE" && pwd)
    if [[ $src != "$ROOT/deploy/wheelhouse" ]]; then
        for whl in "$src"/*.whl; do
            dest=deploy/wheelhouse/$(basename "$whl")
            [[ -e $dest ]] && continue
            ln "$whl" "$dest" 2>/dev/null || cp "$whl" "$dest"
            LINKED_WHEELS+=("$dest")
        done
    fi
    log "wheelhouse: $src ($(compgen -G "$src/*.whl" | wc -l) wheels, via deploy/wheelhouse/)"
elif compgen -G "deploy/wheelhouse/*.whl" >/dev/null; then
    log "note: deploy/wheelhouse/ holds wheels: the image installs from them only"
fi

compose() { "${COMPOSE_CMD[@]}" -p "$PROJECT" "$@"; }
CID=""
finish() {
    local rc=$?
    if [[ $rc -ne 0 && -n $CID ]]; then
        log "container log (tail):"
        "$ENGINE" logs --tail 40 "$CID" 2>&1 | sed 's/^/    /' || true
    fi
    step "cleanup: $COMPOSE -p $PROJECT down"
    compose down >/dev/null 2>&1 || true
    cleanup_wheels
    [[ -n ${TMPD:-} ]] && rm -rf "$TMPD"
    if [[ $rc -eq 0 ]]; then log "PASS"; else log "FAILED (status $rc)"; fi
}
trap finish EXIT

step "engine: $ENGINE ($("$ENGINE" --version | head -n1)); compose: $COMPOSE ($("${COMPOSE_CMD[@]}" version 2>/dev/null | tail -n1))"
log "BASE_IMAGE=${BASE_IMAGE:-<Dockerfile default>} BUILD_IMAGE=${BUILD_IMAGE:-<BASE_IMAGE>}"
log "host ports: grpc 127.0.0.1:$MMADMIT_HOST_GRPC_PORT zmq 127.0.0.1:$MMADMIT_HOST_ZMQ_PORT metrics 127.0.0.1:$MMADMIT_HOST_METRICS_PORT"

step "compose config"
compose config >/dev/null
log "docker-compose.yml parses"

step "build: $COMPOSE -p $PROJECT build $SERVICE"
t0=$SECONDS
compose build "$SERVICE"
IMAGE=${MMADMIT_IMAGE:-mmadmit:local}
log "built $IMAGE in $((SECONDS - t0)) s; $("$ENGINE" image inspect -f '{{.Size}}' "$IMAGE" 2>/dev/null | awk '{printf "%.0f MB", $1/1e6}')"
user=$("$ENGINE" image inspect -f '{{.Config.User}}' "$IMAGE")
log "image user: $user"
[[ -n $user && $user != root && $user != 0 && $user != 0:* ]] || die "image runs as root ($user)"
if ! "$ENGINE" run --rm --entrypoint python3 "$IMAGE" -c pass >/dev/null 2>&1; then
    "$ENGINE" run --rm --entrypoint python3 "$IMAGE" -c pass || true
    die "a container of $IMAGE does not start. On podman hosts: lower default_ulimits (nofile, nproc) below the host's hard limits and use runtime runc in /etc/containers/containers.conf (deploy/README.md)"
fi

step "up: $COMPOSE -p $PROJECT up -d $SERVICE"
compose up -d "$SERVICE"
CID=$("$ENGINE" ps -a -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=$SERVICE")
CID=${CID%%$'\n'*}  # the first one (no `| head`: see the log read below)
[[ -n $CID ]] || die "no container for service $SERVICE in project $PROJECT"
log "container $CID ($("$ENGINE" inspect -f '{{.Name}}' "$CID"))"
read -r restart rootfs_ro <<<"$("$ENGINE" inspect -f '{{.HostConfig.RestartPolicy.Name}} {{.HostConfig.ReadonlyRootfs}}' "$CID")"
mounts=$("$ENGINE" inspect -f '{{range .Mounts}}{{.Destination}}(rw={{.RW}}) {{end}}' "$CID")
log "restart policy: $restart; read-only root fs: $rootfs_ro; mounts: $mounts"
[[ $restart == unless-stopped ]] || die "restart policy is '$restart', not unless-stopped"
[[ $mounts == *"/etc/mmadmit/config.json(rw=false)"* ]] || die "model config is not mounted read-only"

step "wait for healthy (healthcheck: mmadmit-client health, up to $HEALTH_TIMEOUT s)"
if [[ $ENGINE == podman ]]; then
    log "podman: the healthcheck's timer needs systemd (errors above without it); polling 'podman healthcheck run'"
fi
t0=$SECONDS
while :; do
    state=$("$ENGINE" inspect -f '{{.State.Status}}' "$CID")
    [[ $state == running ]] || die "container is $state before becoming healthy"
    if [[ $ENGINE == podman ]]; then
        # No systemd here to run the healthcheck timer: run the check ourselves.
        if out=$(podman healthcheck run "$CID" 2>&1); then health=healthy; else health="${out:-unhealthy}"; fi
    else
        health=$(docker inspect -f '{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$CID")
    fi
    [[ $health == healthy ]] && break
    (( SECONDS - t0 < HEALTH_TIMEOUT )) || die "not healthy after $HEALTH_TIMEOUT s (last: $health)"
    sleep 2
done
log "healthy after $((SECONDS - t0)) s"
# Read the whole log first: with pipefail, `logs | grep -m1` fails whenever grep
# exits before the engine finished writing (SIGPIPE), a race seen in CI.
startup_log=$("$ENGINE" logs "$CID" 2>&1) || true
ready_line=$(grep -m1 '^mmadmit ready ' <<<"$startup_log") \
    || die "no 'mmadmit ready' line in the container log"
printf '    %s\n' "$ready_line"
log "from the host: $("$CLIENT" health "grpc://127.0.0.1:$MMADMIT_HOST_GRPC_PORT" 2>&1 | tail -n1)"

TMPD=$(mktemp -d)
admit() {
    local name=$1 target=$2 rc=0
    "$CLIENT" admit "$target" "$VECTOR" --json >"$TMPD/$name.json" 2>"$TMPD/$name.err" || rc=$?
    cut -c1-300 "$TMPD/$name.json" "$TMPD/$name.err" | sed 's/^/    /'
    [[ $rc -eq 0 ]] || die "mmadmit-client admit $target exited $rc (0 = materialized)"
    log "admit $target: exit 0 (materialized)"
    # The container's answer must be the reference engine's (the vector's .npz).
    "$PYTHON" - "$TMPD/$name.json" "${VECTOR%.frames}.npz" <<'PY'
import json, sys
import numpy as np
got = json.load(open(sys.argv[1]))
want = np.load(sys.argv[2])
checks = {
    "input_ids": (got["input_ids"], want["input_ids_padded"]),
    "input_ids_unpadded": (got["input_ids_unpadded"], want["input_ids_unpadded"]),
    "item pad values": ([i["pad_value"] for i in got["items"]], want["item_pad_values"]),
    "item hashes": ([i["hash"] for i in got["items"]], want["item_hashes"]),
}
if "mrope_positions" in want.files:
    checks["mrope_positions"] = (got["mrope_positions"], want["mrope_positions"])
    checks["mrope_position_delta"] = (got["mrope_position_delta"], want["mrope_position_delta"].item())
bad = [k for k, (g, w) in checks.items() if not np.array_equal(np.asarray(g, dtype=np.asarray(w).dtype), w)]
if bad:
    sys.exit(f"[compose-smoke] FAIL: differs from {sys.argv[2]}: {', '.join(bad)}")
print(f"[compose-smoke] equal to {sys.argv[2]}: {', '.join(checks)}")
PY
}
step "admit $VECTOR over gRPC from the host"
admit grpc "grpc://127.0.0.1:$MMADMIT_HOST_GRPC_PORT"
step "admit $VECTOR over ZMQ from the host"
admit zmq "tcp://127.0.0.1:$MMADMIT_HOST_ZMQ_PORT"

step "metrics from the host"
"$PYTHON" - "$MMADMIT_HOST_METRICS_PORT" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=10).read().decode()
lines = [l for l in text.splitlines() if l.startswith("mmadmit_") and not l.startswith("#")]
if not lines:
    sys.exit("[compose-smoke] FAIL: /metrics has no mmadmit_ series")
print(f"[compose-smoke] /metrics: {len(lines)} mmadmit_ samples, e.g.")
for l in lines[:6]:
    print("    " + l)
PY

step "stop: $COMPOSE -p $PROJECT stop (SIGTERM, stop_grace_period), drain ${DRAIN_TIMEOUT}s"
t0=$SECONDS
compose stop "$SERVICE"
took=$((SECONDS - t0))
state=$("$ENGINE" inspect -f '{{.State.Status}} {{.State.ExitCode}} {{.State.OOMKilled}}' "$CID")
log "stopped in $took s; state/exit code/OOM: $state"
log "shutdown log lines:"
logs=$("$ENGINE" logs "$CID" 2>&1)
printf '%s\n' "$logs" | grep -F '[shutdown]' | cut -c1-300 | sed 's/^/    /' || true
read -r status code _ <<<"$state"
[[ $status == exited ]] || die "container is $status after stop"
[[ $code == 0 ]] || die "service exited $code, not 0 (137: killed at the end of stop_grace_period)"
for needle in '[shutdown] signal 15' '[shutdown] draining' '[shutdown] done'; do
    grep -qF "$needle" <<<"$logs" || die "no '$needle' line in the log"
done
log "drained and exited 0"
