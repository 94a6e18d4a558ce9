"""Engine mode (docs/spec/WIRE.md "Engine mode", docs/spec/CLI.md): mmadmit between a test SMG
and a test scheduler.

Three real processes on loopback per case: ``tests/engine_peers.py smg`` (binds,
answers HELLO with INIT, publishes on command, reports every output with its
SHA-256), ``mmadmit serve --smg-handshake ... --engine-handshake-listen ...``,
and ``tests/engine_peers.py scheduler`` (the engine handshake, decodes every
request with the project's codec, answers TokenSpeed's tagged
``BatchTokenIDOutSlim``, here with extra trailing fields after its load
counters: ``"abort"`` when ``validation_error`` is set).

Contract pinned here:

* every vector arrives at the scheduler materialized exactly as the reference
  did it, exactly once; the error vector arrives marked ``INVALID_REQUEST``
  (features removed) and yields an ``"abort"`` output; every output reaches
  SMG byte-identical (trailing fields and an aux frame included); the ready
  response reaches SMG unchanged; metrics count the relay;
* any start order works (scheduler, SMG or mmadmit first); health is
  NOT_SERVING until both handshakes are done;
* an ABORT racing a large ADD reaches the scheduler after that ADD; a small
  request sent after a large one is not held up behind it;
* SIGKILL of the scheduler: one ``ENGINE_CORE_DEAD`` at SMG within a second of
  the scheduler's death (measured from when its process is reaped, i.e. its
  sockets are closed: the only wall-clock assertion here, see the test), exit 3;
* SIGTERM with the scheduler alive: requests arriving during the drain are
  forwarded marked ``SHUTTING_DOWN``, outputs keep flowing until every
  forwarded request finished, then ``ENGINE_CORE_DEAD``, exit 0;
* SIGTERM when the scheduler never answers: ``ENGINE_CORE_DEAD`` once
  ``--drain-timeout`` has passed, exit 0;
* a malformed INIT, a malformed ready response and a scheduler presenting
  another engine index: one clear line naming the step and the field, exit 2;
* in process (the relay, a test SMG and a test scheduler on one loop): outputs
  leave as the very received ``zmq.Frame`` objects; the scheduler's own
  ``ENGINE_CORE_DEAD`` is relayed once and reported as its death; other
  message types pass through unchanged; the ready response reaches SMG
  unchanged; a step that never comes times out naming it, with progress lines;
  a scheduler that restarts mid-handshake (a second HELLO) starts it over; a
  scheduler that stops reading stops intake from SMG (back-pressure) and, once
  it reads again, gets every request, in order, none dropped;
* the flag rules (one handshake flag alone, or with ``--zmq-forward``: exit 2).

Run with: python -m pytest tests/test_engine_mode.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import engine_peers
import grpc
import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from conftest import (
    CONFIGS,
    TESTS_DIR,
    free_port,
    free_ports,
    grown,
    load_vector,
    outcome_counts,
    scrape_metrics,
    until,
    vector_names,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mmadmit import handshake as hs
from mmadmit import scheduler_link, wire
from mmadmit.config import build_config
from mmadmit.engine_mode import EngineRelay
from mmadmit.errors import AbortCode, ConfigError
from mmadmit.materializer import Materializer
from mmadmit.model import Tensor
from mmadmit.pool import MaterializerPool
from mmadmit.profile import load_profile
from mmadmit.scheduler_link import SchedulerLink
from mmadmit.telemetry import Telemetry
from mmadmit_client.frames import parse_frames
from test_admission_both_transports import small_request
from test_zmq_ingest import assert_error_vector, assert_matches_vector

pytestmark = pytest.mark.timeout(60)

PEERS = str(TESTS_DIR / "engine_peers.py")
READY_RE = re.compile(r"^mmadmit ready grpc=(\S+) zmq=(\S+) metrics=(\S+) engine=(\S+)$")
LISTEN_RE = re.compile(r"^mmadmit engine-handshake (\S+)$")
FAMILY_MODEL = {
    "qwen3_5": "qwen3_5.json",
    "qwen3_omni": "qwen3_omni_moe.json",
    "llama": "llama.json",
}
WAIT_S = 30.0


# --------------------------------------------------------------------------- processes


class Proc:
    """A child process whose output lines a thread collects (JSON events or text)."""

    def __init__(self, cmd: list[str], *, json_stdout: bool) -> None:
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE if json_stdout else subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.events: list[dict[str, Any]] = []
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._pumps = []
        if json_stdout:
            self._pumps.append(threading.Thread(target=self._pump_events, daemon=True))
        self._pumps.append(threading.Thread(target=self._pump_lines, daemon=True))
        for pump in self._pumps:
            pump.start()

    def _pump_events(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.events.append(json.loads(line))
                self._cond.notify_all()

    def _pump_lines(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def _wait(self, find: Callable[[], Any], what: str, timeout_s: float) -> Any:
        end = time.monotonic() + timeout_s
        with self._cond:
            while True:
                found = find()
                if found is not None:
                    return found
                if self.proc.poll() is not None and not self._alive_pumps():
                    raise AssertionError(
                        f"{what}: process exited {self.proc.returncode}\n{self.text}"
                    )
                left = end - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"{what}: not within {timeout_s}s\n{self.text}")
                self._cond.wait(min(left, 0.1))

    def _alive_pumps(self) -> bool:
        return any(p.is_alive() for p in self._pumps)

    async def event(self, kind: str, timeout_s: float = WAIT_S, **match: Any) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            for ev in self.events:
                if ev["event"] == kind and all(ev.get(k) == v for k, v in match.items()):
                    return ev
            return None

        return await asyncio.to_thread(self._wait, find, f"event {kind} {match}", timeout_s)

    async def count(self, kind: str, n: int, timeout_s: float = WAIT_S) -> list[dict[str, Any]]:
        def find() -> list[dict[str, Any]] | None:
            got = [ev for ev in self.events if ev["event"] == kind]
            return got if len(got) >= n else None

        return await asyncio.to_thread(self._wait, find, f"{n} x {kind}", timeout_s)

    async def line(self, pattern: re.Pattern[str], timeout_s: float = WAIT_S) -> re.Match[str]:
        def find() -> re.Match[str] | None:
            for line in self.lines:
                m = pattern.match(line)
                if m:
                    return m
            return None

        return await asyncio.to_thread(self._wait, find, f"line {pattern.pattern}", timeout_s)

    def of(self, kind: str) -> list[dict[str, Any]]:
        with self._cond:
            return [ev for ev in self.events if ev["event"] == kind]

    def command(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    async def exit_status(self, timeout_s: float = WAIT_S) -> int:
        try:
            return await asyncio.to_thread(self.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout_s}s:\n{self.text}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pump in self._pumps:
            pump.join(5)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()


class Trio:
    """The three processes of one case; everything is killed at the end."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []
        self.smg: Proc | None = None
        self.sch: Proc | None = None
        self.mm: Proc | None = None

    def start_smg(self, handshake: str = "tcp://127.0.0.1:0", *extra: str) -> Proc:
        self.smg = self._add([sys.executable, PEERS, "smg", "--handshake", handshake, *extra], True)
        return self.smg

    def start_scheduler(self, handshake: str, *extra: str) -> Proc:
        cmd = [sys.executable, PEERS, "scheduler", "--handshake", handshake, *extra]
        self.sch = self._add(cmd, True)
        return self.sch

    def start_mmadmit(
        self, smg: str, listen: str, *extra: str, model: str = "qwen3_5.json"
    ) -> Proc:
        cmd = [
            sys.executable, "-m", "mmadmit", "serve",
            "--model", str(CONFIGS / model), "--device", "cpu", "--workers", "1",
            "--grpc-listen", "127.0.0.1:0", "--zmq-listen", "off",
            "--metrics-listen", "127.0.0.1:0",
            "--smg-handshake", smg, "--engine-handshake-listen", listen,
            "--handshake-timeout", "40", *extra,
        ]  # fmt: skip
        self.mm = self._add(cmd, False)
        return self.mm

    def _add(self, cmd: list[str], json_stdout: bool) -> Proc:
        proc = Proc(cmd, json_stdout=json_stdout)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()


@contextlib.contextmanager
def trio() -> Iterator[Trio]:
    t = Trio()
    try:
        yield t
    finally:
        t.close()


async def start_all(
    t: Trio, *sched_args: str, mm_args: tuple[str, ...] = (), model: str = "qwen3_5.json"
) -> dict[str, str]:
    """SMG, then mmadmit, then the scheduler; returns the ready line's addresses."""
    smg = t.start_smg()
    bound = (await smg.event("bound"))["handshake"]
    mm = t.start_mmadmit(bound, "tcp://127.0.0.1:0", *mm_args, model=model)
    listen = (await mm.line(LISTEN_RE)).group(1)
    t.start_scheduler(listen, *sched_args)
    return await ready(mm)


async def ready(mm: Proc) -> dict[str, str]:
    m = await mm.line(READY_RE)
    return dict(zip(("grpc", "zmq", "metrics", "engine"), m.groups(), strict=True))


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int((await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status)


def vector_rid(name: str) -> str:
    req = wire.decode_message(load_vector(name).frames).request
    assert req is not None
    return req.rid


# --------------------------------------------------------------------------- end to end


@pytest.mark.parametrize("family", sorted(FAMILY_MODEL))
async def test_every_vector_relayed_materialized_once_outputs_byte_identical(
    family: str, tmp_path: Path
) -> None:
    names = [n for n in vector_names() if load_vector(n).meta["family"] == family]
    if not names:
        pytest.skip(f"no {family} vectors")
    with trio() as t:
        addr = await start_all(
            t, "--trailing", "3", "--aux-bytes", "70000", "--save", str(tmp_path),
            model=FAMILY_MODEL[family],
        )  # fmt: skip
        assert t.smg is not None and t.sch is not None and t.mm is not None
        assert await health(addr["grpc"]) == health_pb2.HealthCheckResponse.SERVING
        # the ready response reached SMG unchanged
        ready_ev = await t.smg.event("ready")
        assert ready_ev["ready_response"]["instance_id"] == "test-scheduler"
        for name in names:
            t.smg.command(cmd="send", vector=name)
        outputs = await t.smg.count("output", len(names))
        adds = await t.sch.count("add", len(names))
        # awaited, not read: the scheduler's "sent" line can trail its output to SMG
        sent = {ev["rid"]: ev for ev in await t.sch.count("sent", len(names))}
        # every vector at the scheduler exactly once, materialized as the reference did
        assert sorted(ev["rid"] for ev in adds) == sorted(vector_rid(n) for n in names)
        by_rid = {ev["rid"]: ev for ev in adds}
        for name in names:
            v = load_vector(name)
            ev = by_rid[vector_rid(name)]
            req = wire.decode_message(parse_frames(Path(ev["file"]).read_bytes())).request
            assert req is not None
            if v.error is None:
                assert_matches_vector(req, v)
            else:
                code = req.validation_error.split(":", 1)[0] if req.validation_error else None
                assert_error_vector(code, req, v)
        # every output byte-identical at SMG; the error vector's is an abort
        assert len(outputs) == len(names)
        for out in outputs:
            (rid,) = out["rids"]
            assert out["sha"] == sent[rid]["sha"] and out["frames"] == 2
            v = load_vector(next(n for n in names if vector_rid(n) == rid))
            assert out["reasons"] == ["abort" if v.error else "stop"]
        m = await scrape_metrics(addr["metrics"])
        assert m["mmadmit_engine_relayed_requests_total"] == len(names)
        assert m["mmadmit_engine_relayed_outputs_total"] == len(names)
        assert m["mmadmit_engine_relayed_output_bytes_total"] > 70000 * len(names)
        assert m['mmadmit_engine_handshake_steps_total{side="scheduler"}'] == 4
        assert m['mmadmit_engine_handshake_steps_total{side="smg"}'] == 5
        assert m["mmadmit_engine_scheduler_up"] == 1
        engine_outcomes = [
            v for k, v in m.items() if k.startswith("mmadmit_requests_total{") and "engine" in k
        ]
        assert sum(engine_outcomes) == len(names), [k for k in m if "requests_total" in k]
        t.mm.proc.send_signal(signal.SIGTERM)
        assert await t.mm.exit_status() == 0
        await t.smg.event("dead")
        assert len(t.smg.of("dead")) == 1


@pytest.mark.parametrize("order", ["scheduler-first", "smg-first", "mmadmit-first"])
async def test_any_start_order(order: str) -> None:
    smg_port, listen_port = free_ports(2)
    smg_addr = f"tcp://127.0.0.1:{smg_port}"
    listen = f"tcp://127.0.0.1:{listen_port}"
    with trio() as t:
        if order == "scheduler-first":
            sch = t.start_scheduler(listen)
            await asyncio.sleep(0.5)  # it connects (and retries) before anyone binds
            smg = t.start_smg(smg_addr)
            await smg.event("bound")
            mm = t.start_mmadmit(smg_addr, listen)
        elif order == "smg-first":
            smg = t.start_smg(smg_addr)
            await smg.event("bound")
            mm = t.start_mmadmit(smg_addr, listen)
            await mm.line(LISTEN_RE)
            sch = t.start_scheduler(listen)
        else:
            mm = t.start_mmadmit(smg_addr, listen)
            await mm.line(LISTEN_RE)
            grpc_addr = await _grpc_address(mm)
            # bound, warmed up, but neither handshake done: not serving
            assert await health(grpc_addr) == health_pb2.HealthCheckResponse.NOT_SERVING
            sch = t.start_scheduler(listen)
            await sch.event("connected")
            await asyncio.sleep(0.3)
            assert await health(grpc_addr) == health_pb2.HealthCheckResponse.NOT_SERVING
            smg = t.start_smg(smg_addr)
        addr = await ready(mm)
        assert await health(addr["grpc"]) == health_pb2.HealthCheckResponse.SERVING
        hello = await smg.event("hello")
        assert hello["identity"] == "0000" and hello["message"]["status"] == "HELLO"
        smg.command(cmd="send", vector="qwen3_5_image1", rid="order-1")
        out = await smg.event("output")
        assert out["rids"] == ["order-1"] and out["reasons"] == ["stop"]
        assert (await sch.event("sent", rid="order-1"))["sha"] == out["sha"]
        mm.proc.send_signal(signal.SIGTERM)
        assert await mm.exit_status() == 0


async def _grpc_address(mm: Proc) -> str:
    m = await mm.line(re.compile(r".*gRPC listening on (\S+) "))
    return m.group(1)


# --------------------------------------------------------------------------- ordering


async def test_abort_after_its_large_add_and_small_not_held_up() -> None:
    with trio() as t:
        await start_all(t)
        assert t.smg is not None and t.sch is not None
        # 32K tokens, 23 items whose 1 MiB features carry no hash: hashed on the worker
        t.smg.command(cmd="send", kind="big", rid="big-1", tokens=32768, feature_kb=1024)
        t.smg.command(cmd="send", vector="qwen3_5_image1", rid="small-after-big")
        t.smg.command(cmd="send", kind="big", rid="race", tokens=32768, feature_kb=1024)
        t.smg.command(cmd="abort", rids=["race"])
        await t.sch.event("abort")
        await t.sch.count("add", 3)
        await t.smg.count("output", 3)
        seq = {ev["rid"]: ev["seq"] for ev in t.sch.of("add")}
        (abort,) = t.sch.of("abort")
        assert abort["rids"] == ["race"]
        assert seq["race"] < abort["seq"]  # never an ABORT before its ADD
        race = next(ev for ev in t.sch.of("add") if ev["rid"] == "race")
        # cancelled here while hashing (or, on a fast box, materialized first): one ADD either way
        assert race["validation_error"] is None or race["validation_error"].startswith("CANCELLED")
        # the small request, inline, overtook the large one being hashed
        assert seq["small-after-big"] < seq["big-1"]
        assert [ev["rid"] for ev in t.sch.of("add")].count("race") == 1


# --------------------------------------------------------------------------- death and drain


async def test_scheduler_sigkill_sends_engine_core_dead_and_exits_3() -> None:
    with trio() as t:
        addr = await start_all(t, "--delay", "60")  # it never answers before it dies
        assert t.smg is not None and t.sch is not None and t.mm is not None
        for k in range(3):
            t.smg.command(cmd="send", vector="qwen3_5_image1", rid=f"doomed-{k}")
        await t.sch.count("add", 3)
        assert await health(addr["grpc"]) == health_pb2.HealthCheckResponse.SERVING
        t.sch.proc.kill()
        await asyncio.to_thread(t.sch.proc.wait)
        # From here the scheduler's sockets are closed by the kernel: the drop is
        # observable. The spec's "within a second" is measured from this point
        # (monotonic clocks of both processes are the same clock on Linux); the
        # relay typically reacts in a few milliseconds, so 1 s leaves room for a
        # loaded 2-core box.
        gone_at = time.monotonic()
        dead = await t.smg.event("dead")
        assert dead["time"] - gone_at < 1.0, dead["time"] - gone_at
        assert await t.mm.exit_status() == 3
        await asyncio.sleep(0.2)
        assert len(t.smg.of("dead")) == 1
        assert not t.smg.of("output")
        assert "the scheduler went away" in t.mm.text


async def test_sigterm_drains_forwarded_work_then_engine_core_dead_exit_0() -> None:
    with trio() as t:
        await start_all(t, "--delay", "1.5", mm_args=("--drain-timeout", "20"))
        assert t.smg is not None and t.sch is not None and t.mm is not None
        for k in range(3):
            t.smg.command(cmd="send", vector="qwen3_5_image1", rid=f"before-{k}")
        await t.sch.count("add", 3)
        t.mm.proc.send_signal(signal.SIGTERM)
        await t.mm.line(re.compile(r".*\[shutdown\] draining"))
        for k in range(2):
            t.smg.command(cmd="send", vector="qwen3_5_image1", rid=f"during-{k}")
        assert await t.mm.exit_status() == 0
        outputs = t.smg.of("output")
        dead = await t.smg.event("dead")
        reasons = {ev["rids"][0]: ev["reasons"][0] for ev in outputs}
        assert reasons == {
            "before-0": "stop", "before-1": "stop", "before-2": "stop",
            "during-0": "abort", "during-1": "abort",
        }  # fmt: skip
        during = [ev for ev in t.sch.of("add") if ev["rid"].startswith("during")]
        assert len(during) == 2
        assert all(ev["validation_error"].startswith("SHUTTING_DOWN: ") for ev in during)
        assert all(ev["time"] < dead["time"] for ev in outputs)  # outputs, then the end
        assert len(t.smg.of("dead")) == 1


async def test_sigterm_with_a_silent_scheduler_ends_at_the_drain_timeout() -> None:
    with trio() as t:
        await start_all(t, "--delay", "60", mm_args=("--drain-timeout", "1"))
        assert t.smg is not None and t.sch is not None and t.mm is not None
        t.smg.command(cmd="send", vector="qwen3_5_image1", rid="unanswered")
        await t.sch.count("add", 1)
        t.mm.proc.send_signal(signal.SIGTERM)
        assert await t.mm.exit_status() == 0
        await t.smg.event("dead")
        assert not t.smg.of("output") and len(t.smg.of("dead")) == 1
        assert "without a finished output at the drain deadline" in t.mm.text


# --------------------------------------------------------------------------- bad handshakes


@pytest.mark.parametrize(
    ("case", "smg_args", "sched_args", "words"),
    [
        ("malformed-init", ("--init", "malformed"), (), "INIT from SMG: addresses.inputs"),
        (
            "malformed-ready-response",
            (),
            ("--ready", "malformed"),
            "ready response from the scheduler: max_model_len",
        ),
        ("ready-response-not-a-map", (), ("--ready", "array"), "ready response from the scheduler"),
        ("engine-index-mismatch", (), ("--hello-index", "1"), "HELLO from the scheduler: identity"),
    ],
)
async def test_malformed_handshake_is_one_clear_line_and_exit_2(
    case: str, smg_args: tuple[str, ...], sched_args: tuple[str, ...], words: str
) -> None:
    with trio() as t:
        smg = t.start_smg("tcp://127.0.0.1:0", *smg_args)
        bound = (await smg.event("bound"))["handshake"]
        mm = t.start_mmadmit(bound, "tcp://127.0.0.1:0")
        listen = (await mm.line(LISTEN_RE)).group(1)
        t.start_scheduler(listen, *sched_args)
        assert await mm.exit_status() == 2, mm.text
        failed = [line for line in mm.lines if line.startswith("mmadmit: engine handshake failed:")]
        assert len(failed) == 1 and words in failed[0], mm.text
        assert not READY_RE.search(mm.text)
        if case != "malformed-init":
            assert not smg.of("hello")  # SMG never heard of a scheduler that did not fit


def test_engine_flags_rules() -> None:
    base = {"smg_handshake": "tcp://127.0.0.1:1", "engine_handshake_listen": "tcp://127.0.0.1:0"}
    config = build_config(base, environ={})
    assert config.engine_mode and config.engine_index == 0 and config.handshake_timeout == 600
    for alone in ("smg_handshake", "engine_handshake_listen"):
        with pytest.raises(ConfigError, match="engine mode"):
            build_config({alone: base[alone]}, environ={})
    with pytest.raises(ConfigError, match="excludes --zmq-forward"):
        build_config({**base, "zmq_forward": "tcp://127.0.0.1:2"}, environ={})
    env = {
        "MMADMIT_SMG_HANDSHAKE": "tcp://127.0.0.1:1",
        "MMADMIT_ENGINE_HANDSHAKE_LISTEN": "tcp://127.0.0.1:0",
        "MMADMIT_ENGINE_INDEX": "3",
        "MMADMIT_HANDSHAKE_TIMEOUT": "5",
    }
    config = build_config({}, environ=env)
    assert (config.engine_index, config.handshake_timeout) == (3, 5.0)
    for key, bad in (("engine_index", "65536"), ("engine_index", "-1"), ("handshake_timeout", "0")):
        with pytest.raises(ConfigError):
            build_config({**base, key: bad}, environ={})


@pytest.mark.parametrize(
    "args",
    [
        ("--smg-handshake", "tcp://127.0.0.1:1"),
        ("--smg-handshake", "tcp://127.0.0.1:1", "--engine-handshake-listen", "tcp://127.0.0.1:0",
         "--zmq-forward", "tcp://127.0.0.1:2"),
    ],
    ids=["alone", "with-zmq-forward"],
)  # fmt: skip
def test_engine_flag_misuse_exits_2(args: tuple[str, ...]) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "mmadmit", "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert "engine mode" in p.stderr and len(p.stderr.strip().splitlines()) == 1


# --------------------------------------------------------------------------- messages


def test_handshake_messages_name_step_and_field() -> None:
    enc = msgspec.msgpack.encode
    init = hs.parse_init(
        enc({"addresses": {"inputs": ["tcp://a:1"], "outputs": ["tcp://a:2"], "x": 1}, "y": 2})
    )
    assert init.inputs == ["tcp://a:1"] and init.outputs == ["tcp://a:2"]
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: hs.parse_init(b"\xc1"), "INIT from SMG: (message): not msgpack"),
        (lambda: hs.parse_init(enc([1])), "INIT from SMG: (message): must be a msgpack map"),
        (lambda: hs.parse_init(enc({"addresses": 1})), "INIT from SMG: addresses: must be a map"),
        (
            lambda: hs.parse_init(enc({"addresses": {"inputs": [], "outputs": ["tcp://a:2"]}})),
            "addresses.inputs",
        ),
        (
            lambda: hs.parse_init(enc({"addresses": {"inputs": ["tcp://a:1"], "outputs": "x"}})),
            "addresses.outputs",
        ),
        (lambda: hs.parse_status(enc({"status": "READY"}), "HELLO", "HELLO"), "HELLO: status"),
        (lambda: hs.parse_ready_response(enc({"max_model_len": 0})), "max_model_len"),
        (
            lambda: hs.parse_ready_response(enc({"max_model_len": 8, "num_gpu_blocks": "x"})),
            "num_gpu_blocks",
        ),
        (lambda: hs.parse_ready_response(enc({"max_model_len": 8, "dtype": 3})), ": dtype:"),
    ]
    for call, words in cases:
        with pytest.raises(hs.HandshakeError) as err:
            call()
        assert words in str(err.value), str(err.value)
    missing = hs.parse_ready_response(enc({"max_model_len": 8, "newer": True}))
    assert "num_gpu_blocks" in missing and "newer" not in missing
    assert hs.engine_identity(1) == b"\x01\x00"
    assert msgspec.msgpack.decode(hs.status_message("READY")) == {
        "status": "READY", "local": True, "headless": True, "parallel_config_hash": None,
    }  # fmt: skip


# --------------------------------------------------------------------------- in process


@dataclass
class Env:
    ctx: zmq.asyncio.Context
    smg: engine_peers.Smg
    relay: EngineRelay
    listen: str
    gone: list[str]
    hooked: list[list[Any]]
    tasks: list[asyncio.Future[Any]] = field(default_factory=list)

    def scheduler(self, **kw: Any) -> list[tuple[str, Any]]:
        seen: list[tuple[str, Any]] = []
        self.tasks.append(
            asyncio.ensure_future(
                engine_peers.run_scheduler(self.ctx, self.listen, report=False, seen=seen, **kw)
            )
        )
        return seen

    async def handshakes(self) -> None:
        accept = asyncio.ensure_future(self.smg.accept())
        self.tasks.append(accept)
        await asyncio.wait_for(handshakes(self.relay), 20)
        await asyncio.wait_for(accept, 20)


async def handshakes(relay: EngineRelay) -> None:
    """The scheduler's handshake on the relay's link, then SMG's (as ``mmadmit serve``)."""
    await relay.link.handshake()
    await relay.start()


@contextlib.asynccontextmanager
async def relay_env(
    smg_handshake: str | None = None, timeout_s: float = 20, telemetry: Telemetry | None = None
) -> AsyncIterator[Env]:
    ctx = zmq.asyncio.Context()
    smg = engine_peers.Smg(ctx, "tcp://127.0.0.1:0", report=False)
    profile = load_profile(str(CONFIGS / "qwen3_5.json"))
    pool = MaterializerPool(Materializer(profile), workers=1, inline_max_tokens=16384)
    gone: list[str] = []
    hooked: list[list[Any]] = []
    link = SchedulerLink(
        listen="tcp://127.0.0.1:0",
        engine_index=0,
        handshake_timeout_s=timeout_s,
        on_gone=gone.append,
    )
    relay = EngineRelay(
        pool,
        link,
        smg_handshake=smg_handshake or smg.handshake,
        max_message_bytes=1 << 30,
        watchdog_s=None,
        output_hook=hooked.append,
        telemetry=telemetry,
    )
    env = Env(ctx, smg, relay, "", gone, hooked)
    try:
        env.listen = await link.bind()
        yield env
    finally:
        for task in env.tasks:
            task.cancel()
        await asyncio.gather(*env.tasks, return_exceptions=True)
        await relay.stop(0.1)
        await link.close()
        smg.close()
        pool.close()
        ctx.term()


async def recv_or_none(smg: engine_peers.Smg, timeout_s: float) -> list[zmq.Frame] | None:
    try:
        return await asyncio.wait_for(smg.recv_output(), timeout_s)
    except TimeoutError:
        return None


async def test_in_process_zero_copy_outputs_scheduler_dead_frame_and_passthrough() -> None:
    async with relay_env() as env:
        seen = env.scheduler(aux_bytes=100_000, dead_after=3)
        await env.handshakes()
        assert env.smg.ready_response == dict(engine_peers.READY_RESPONSE, data_parallel_rank=0)
        assert env.relay.link.stats.scheduler_alive == 1
        await env.smg.send(engine_peers.vector_frames("qwen3_5_image1", "z1"))
        utility = [b"\x03", msgspec.msgpack.encode([0, "get_load", []])]
        await env.smg.send(utility)
        await env.smg.send(engine_peers.vector_frames("qwen3_5_mixed", "z2"))
        outs = [await asyncio.wait_for(env.smg.recv_output(), 10) for _ in range(3)]
        assert [engine_peers.read_output(o)[0] for o in outs[:2]] == [["z1"], ["z2"]]
        assert [f.bytes for f in outs[2]] == [hs.ENGINE_CORE_DEAD]
        assert await recv_or_none(env.smg, 0.3) is None  # one ENGINE_CORE_DEAD, not two
        assert env.gone == ["it sent ENGINE_CORE_DEAD"]
        assert env.relay.link.stats.scheduler_alive == 0
        assert env.relay.stats.engine_core_dead_sent == 1
        # the other message type went through unchanged, between the two ADDs
        kinds = [kind for kind, _ in seen]
        assert kinds == ["ADD", "OTHER", "ADD"]
        assert [f.bytes for f in seen[1][1]] == utility
        # outputs left as the received frame objects (libzmq shares them; no copy)
        assert len(env.hooked) == 3
        for msg in env.hooked:
            assert all(isinstance(f, zmq.Frame) for f in msg)
        assert [len(f) for f in env.hooked[0]][1] == 100_000
        await env.relay.stop(0.5)
        assert await recv_or_none(env.smg, 0.3) is None  # stopping sends no second one


async def test_in_process_each_outcome_is_counted_once_under_engine() -> None:
    """Materialized, refused at decode, refused by the materializer, refused while
    draining: each adds exactly 1 to its own ``requests_total{transport="engine"}``
    sample, and nothing anywhere else (the relay is forward mode's very code, whose
    every code is driven in ``test_outcome_counts.py``)."""
    telemetry = Telemetry("qwen3_5", log_outcomes=False)
    async with relay_env(telemetry=telemetry) as env:
        seen = env.scheduler()
        assert outcome_counts(telemetry.registry) == {}  # no relay intake yet
        await env.handshakes()
        counts = outcome_counts(telemetry.registry)  # every code present from the start
        assert len(counts) == 1 + len(AbortCode) and not any(counts.values())
        unsupported = small_request("un")
        assert unsupported.mm is not None
        flag = Tensor.from_numpy(np.array([1], np.int64))
        unsupported.mm.items[0].side["use_audio_in_video"] = flag
        cases: list[tuple[str, list[Any]]] = [
            ("OK", engine_peers.vector_frames("qwen3_5_image1", "ok")),
            ("INVALID_REQUEST", [b"\x00", b"\xc1 not msgpack"]),
            ("UNSUPPORTED", [b"\x00", *wire.encode_request(unsupported)]),
            ("SHUTTING_DOWN", engine_peers.vector_frames("qwen3_5_image1", "late")),
        ]
        for code, frames in cases:
            if code == "SHUTTING_DOWN":
                env.relay.pool.begin_drain()
            before = outcome_counts(telemetry.registry)
            n = len(seen)
            await env.smg.send(frames)
            await until(lambda n=n: len(seen) > n)  # forwarded (marked unless OK)
            outcome = "materialized" if code == "OK" else "aborted"
            assert grown(before, outcome_counts(telemetry.registry)) == {
                ("engine", outcome, code): 1
            }, code
        assert env.relay.ingest.admissions.stats.materialized == 1
        assert env.relay.ingest.admissions.stats.aborted_by_code == {
            "INVALID_REQUEST": 1, "UNSUPPORTED": 1, "SHUTTING_DOWN": 1
        }  # fmt: skip


async def test_in_process_handshake_timeout_names_the_step(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(scheduler_link, "PROGRESS_S", 0.05)
    caplog.set_level("INFO", logger="mmadmit.scheduler_link")  # the handshake steps
    async with relay_env(timeout_s=0.3) as env:  # nobody connects to it
        with pytest.raises(hs.HandshakeTimeout, match="HELLO from the scheduler"):
            await handshakes(env.relay)
    assert "still waiting for HELLO from the scheduler" in caplog.text
    nobody = f"tcp://127.0.0.1:{free_port()}"
    async with relay_env(smg_handshake=nobody, timeout_s=0.5) as env:  # no SMG there
        env.scheduler()
        with pytest.raises(hs.HandshakeTimeout, match="INIT from SMG"):
            await handshakes(env.relay)
        assert env.relay.link.stats.handshake_steps_scheduler == 4
        assert env.relay.stats.handshake_steps_smg == 1  # HELLO sent, INIT never came


async def test_in_process_scheduler_restarting_mid_handshake_starts_it_over() -> None:
    async with relay_env() as env:
        first = env.ctx.socket(zmq.DEALER)  # says HELLO, takes INIT, then dies
        first.setsockopt(zmq.IDENTITY, engine_peers.identity_of(0))
        first.setsockopt(zmq.LINGER, 0)
        first.connect(env.listen)
        handshake = asyncio.ensure_future(handshakes(env.relay))
        env.tasks.append(handshake)
        await first.send(engine_peers.status("HELLO"))
        init = hs.parse_init((await asyncio.wait_for(first.recv_multipart(), 10))[-1])
        assert init.inputs == [env.relay.link.input_address] and init.parallel_config == {}
        first.close(linger=0)
        seen = env.scheduler()  # the restarted one: same identity, a new HELLO
        accept = asyncio.ensure_future(env.smg.accept())
        env.tasks.append(accept)
        await asyncio.wait_for(handshake, 20)
        await asyncio.wait_for(accept, 20)
        await env.smg.send(engine_peers.vector_frames("qwen3_5_image1", "after-restart"))
        out = await asyncio.wait_for(env.smg.recv_output(), 10)
        assert engine_peers.read_output(out)[0] == ["after-restart"]
        assert [kind for kind, _ in seen] == ["ADD"]
        assert (
            env.relay.link.stats.handshake_steps_scheduler == 6
        )  # HELLO, INIT twice; READY, ready


async def test_in_process_back_pressure_from_the_scheduler_drops_nothing() -> None:
    """A scheduler that stops reading: forwards wait, then intake from SMG stops, then
    SMG's own socket refuses more; once it reads again every request arrives, in order."""
    async with relay_env() as env:
        env.smg.inp.setsockopt(zmq.SNDHWM, 16)  # before the relay connects: its pipe gets it
        ident = engine_peers.identity_of(0)
        hs_sock = env.ctx.socket(zmq.DEALER)
        inp = env.ctx.socket(zmq.DEALER)
        for sock in (hs_sock, inp):
            sock.setsockopt(zmq.IDENTITY, ident)
            sock.setsockopt(zmq.LINGER, 0)
        inp.setsockopt(zmq.RCVHWM, 8)
        hs_sock.connect(env.listen)
        handshake = asyncio.ensure_future(handshakes(env.relay))
        env.tasks.append(handshake)
        accept = asyncio.ensure_future(env.smg.accept())
        env.tasks.append(accept)
        await hs_sock.send(engine_peers.status("HELLO"))
        await hs_sock.recv_multipart()
        await hs_sock.send(engine_peers.status("READY"))
        inp.connect(env.relay.link.input_address)
        await inp.send(msgspec.msgpack.encode(engine_peers.READY_RESPONSE))
        await asyncio.wait_for(handshake, 20)
        await asyncio.wait_for(accept, 20)
        # ~40 kB each, so that the loopback's TCP buffers hold few of them
        frames = engine_peers.synthetic_frames("text", "x", 8192)
        req = wire.decode_message(frames).request
        assert req is not None
        smg_in = zmq.Socket.shadow(env.smg.inp.underlying)  # plain: NOBLOCK raises Again
        sent = 0
        blocked_seen = False
        end = time.monotonic() + 30
        while time.monotonic() < end:  # until SMG's own socket pushes back
            out = [env.smg.engine, b"\x00", *wire.encode_request(replace_rid(req, f"bp-{sent}"))]
            try:
                smg_in.send_multipart(out, flags=zmq.NOBLOCK)
            except zmq.Again:
                await asyncio.sleep(0.2)
                try:
                    smg_in.send_multipart(out, flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
            sent += 1
            if sent % 50 == 0:
                await asyncio.sleep(0.001)  # let the relay run

            ingest = env.relay.ingest
            assert ingest is not None
            blocked_seen = blocked_seen or bool(ingest._intake and ingest._intake.blocked)
        assert blocked_seen and env.relay.ingest is not None
        assert env.relay.ingest.forward_pending > 0
        rids = []
        while len(rids) < sent:  # the scheduler reads again
            got = await asyncio.wait_for(inp.recv_multipart(copy=False), 10)
            msg = wire.decode_message(got)
            assert msg.request is not None
            rids.append(msg.request.rid)
        assert rids == [f"bp-{k}" for k in range(sent)]
        assert env.relay.ingest.output.stats.undeliverable == 0
        hs_sock.close(linger=0)
        inp.close(linger=0)


def replace_rid(req: Any, rid: str) -> Any:
    return dataclasses.replace(req, rid=rid)
