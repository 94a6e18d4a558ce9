"""Configuration: one typed object, flag > MMADMIT_* env > default, clear errors.

Run with: python -m pytest tests/test_config.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from mmadmit.config import ServeConfig, build_config, env_name
from mmadmit.errors import ConfigError
from mmadmit.profile import Family


def test_defaults_match_cli_md() -> None:
    c = build_config({}, environ={})
    assert c == ServeConfig()
    assert (c.model, c.role, c.grpc_listen, c.zmq_listen, c.metrics_listen) == (
        "qwen2_5_vl",
        "aggregated",
        "127.0.0.1:50051",
        "tcp://127.0.0.1:5557",
        "127.0.0.1:9464",
    )
    assert (c.max_inflight, c.max_tokens, c.max_items) == (64, 262144, 256)
    assert (c.max_tensor_bytes, c.max_message_bytes, c.drain_timeout) == (
        536870912,
        1073741824,
        10.0,
    )
    assert c.load_profile().family is Family.QWEN2_5_VL
    assert c.inline_max_tokens == 16384  # not in docs/spec/CLI.md: small requests skip the workers


def test_limits_is_one_object_per_config() -> None:
    config = build_config({}, environ={})
    assert config.limits is config.limits  # codecs and materializer share it (identity)
    assert config.limits.max_items == config.max_items


def test_inline_max_tokens_accepts_zero_refuses_negative() -> None:
    assert build_config({}, environ={"MMADMIT_INLINE_MAX_TOKENS": "0"}).inline_max_tokens == 0
    with pytest.raises(ConfigError, match="--inline-max-tokens"):
        build_config({"inline_max_tokens": "-1"}, environ={})


def test_flag_beats_env_beats_default() -> None:
    env = {env_name("max_inflight"): "7", env_name("role"): "decode"}
    assert env_name("grpc_listen") == "MMADMIT_GRPC_LISTEN"
    c = build_config({"max_inflight": "9"}, environ=env)
    assert c.max_inflight == 9 and c.role == "decode"
    assert build_config({}, environ={"MMADMIT_LANGUAGE_MODEL_ONLY": "true"}).language_model_only


@pytest.mark.parametrize(
    "args, fragment",
    [
        ({"role": "encoder"}, "--role"),
        ({"max_inflight": "0"}, "--max-inflight"),
        ({"grpc_listen": "nowhere"}, "--grpc-listen"),
        ({"zmq_listen": "127.0.0.1:5"}, "--zmq-listen"),
        ({"drain_timeout": "-1"}, "--drain-timeout"),
        ({"device": "tpu"}, "--device"),
    ],
)
def test_invalid_values_name_the_flag(args: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_config(args, environ={})


def test_invalid_env_names_the_variable() -> None:
    with pytest.raises(ConfigError, match="MMADMIT_WORKERS"):
        build_config({}, environ={"MMADMIT_WORKERS": "many"})


def test_unknown_model_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="neither a built-in profile"):
        build_config({"model": "/nonexistent/model"}, environ={}).load_profile()


def test_cli_exits_2_with_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mmadmit", "serve", "--max-inflight", "-3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "--max-inflight" in proc.stderr


def test_allocator_tuning_applies_on_glibc() -> None:
    import platform

    from mmadmit.runtime import tune_allocator

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    assert tune_allocator() is True


_ARENA_PROBE = """
import ctypes, ctypes.util, sys, threading
from mmadmit.runtime import tune_allocator
tune_allocator(arena_max=int(sys.argv[1]))
start = threading.Barrier(8)
def work():
    start.wait()
    for _ in range(200):
        blocks = [ctypes.create_string_buffer(4096) for _ in range(50)]
        del blocks
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
ctypes.CDLL(ctypes.util.find_library("c")).malloc_stats()  # one "Arena N:" per arena
"""


@pytest.mark.parametrize(("arena_max", "most"), [(1, 1), (2, 2)])
def test_arena_cap_holds_under_concurrent_threads(arena_max: int, most: int) -> None:
    """--malloc-arenas: 8 threads allocating at once share at most that many arenas
    (glibc's own default gives them several)."""
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")

    def arenas(n: int) -> int:
        out = subprocess.run([sys.executable, "-c", _ARENA_PROBE, str(n)],
                             capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        return sum(line.startswith("Arena ") for line in out.stderr.splitlines())

    assert 1 <= arenas(arena_max) <= most
    assert arenas(0) > 2  # the control: uncapped, the same threads take more


_GC_PROBE = """
import gc, sys
sys.path.insert(0, sys.argv[2])  # bench/: its workloads
import workloads
from mmadmit import wire
from mmadmit.config import build_config
from mmadmit.materializer import Materializer
from mmadmit.runtime import tune_gc
config = build_config({"model": "qwen3_omni_moe", "device": "cpu"})
materializer = Materializer(config.load_profile(), config.limits)
req = workloads.build_request(workloads.profile_for("qwen3_omni_moe"), 131072, with_hash=True)
frames = [bytes([wire.MSG_ADD]), *wire.encode_request(req)]
if sys.argv[1] == "tuned":
    print(*tune_gc(), gc.get_freeze_count() > 0, file=sys.stderr)
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info) if phase == "start" else None)
for _ in range(5):
    outcome = materializer.run(wire.decode_message(frames, config.limits).request)
    assert wire.encode_materialized(outcome)[0] == bytes([wire.STATUS_MATERIALIZED])
print(len(runs))
"""


_FAULT_PROBE = """
import resource, sys
sys.path.insert(0, sys.argv[2])  # bench/: its workloads
import workloads
from mmadmit import wire
from mmadmit.config import build_config
from mmadmit.materializer import Materializer
from mmadmit.runtime import tune_allocator
if sys.argv[1] == "tuned":
    tune_allocator()
config = build_config({"model": "qwen3_5", "device": "cpu"})
materializer = Materializer(config.load_profile(), config.limits)
for tokens in (8192, 32768, 131072):
    req = workloads.build_request(workloads.profile_for("qwen3_5"), tokens, with_hash=True)
    frames = [bytes([wire.MSG_ADD]), *wire.encode_request(req)]
    def once():
        outcome = materializer.run(wire.decode_message(frames, config.limits).request)
        reply = wire.encode_materialized(outcome)
        assert reply[0] == bytes([wire.STATUS_MATERIALIZED]), reply[1]
    for _ in range(5):
        once()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        once()
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


def test_allocator_tuning_keeps_output_buffers_faulted_in() -> None:
    """Issue #18's warm output buffers: with ``mmadmit serve``'s allocator tuning, a
    request's fresh arrays (its decoded ids, the padded ids, the ``[3, N]``
    positions, the reply payload; 4-7 MB at 128K tokens) reuse memory the heap
    already holds, so steady-state requests take no page faults; glibc's own
    thresholds (the control) give the memory back and fault it in again."""
    import platform

    from conftest import REPO_ROOT

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")

    def faults(mode: str) -> list[float]:
        out = subprocess.run(
            [sys.executable, "-c", _FAULT_PROBE, mode, str(REPO_ROOT / "bench")],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return [float(line) for line in out.stdout.split()]

    tuned = faults("tuned")
    assert len(tuned) == 3 and max(tuned) <= 2, tuned  # 8K, 32K, 128K tokens
    assert max(faults("default")) > 100  # here about 300 a request at 32K, 1,500 at 128K


def test_gc_tuning_keeps_collections_out_of_large_requests() -> None:
    """``mmadmit serve``'s tune_gc: five Qwen3-Omni 128K requests (128 items each)
    decoded, materialized and encoded set off no collection; CPython's own
    thresholds (the control) collect during them."""
    from conftest import REPO_ROOT

    def collections(mode: str) -> tuple[int, str]:
        out = subprocess.run(
            [sys.executable, "-c", _GC_PROBE, mode, str(REPO_ROOT / "bench")],
            capture_output=True, text=True, timeout=120, check=True,
        )  # fmt: skip
        return int(out.stdout), out.stderr.strip()

    tuned, thresholds = collections("tuned")
    assert thresholds.split() == ["20000", "10", "10", "True"]
    assert tuned == 0
    assert collections("default")[0] > 0


def test_serve_tunes_the_process_with_its_arenas(monkeypatch: pytest.MonkeyPatch) -> None:
    """``server.run`` (``mmadmit serve``) applies ``runtime.tune_process`` with the
    configuration's ``--malloc-arenas``, before its event loop starts: the allocator
    and collector tuning above reach the service only through this call."""
    from mmadmit import server

    class Stop(Exception):
        pass

    calls: list[int] = []

    def tune(arenas: int) -> None:
        calls.append(arenas)
        raise Stop  # the event loop never starts

    async def serve(config: ServeConfig) -> int:
        raise Stop  # were it ever reached: nothing is bound, the test ends at once

    monkeypatch.setattr(server, "configure_logging", lambda *args: None)
    monkeypatch.setattr(server, "disable_created_metrics", lambda: None)  # process-wide
    monkeypatch.setattr(server, "tune_process", tune)
    monkeypatch.setattr(server, "serve", serve)
    config = build_config({"malloc_arenas": 3})
    with pytest.raises(Stop):
        server.run(config)
    assert calls == [3]
