"""The drain promise: every request that reaches the service gets exactly one answer.

Contract (docs/spec/CLI.md, "Shutdown"): on SIGTERM the service answers every request
that reaches it, on every path and whichever way it runs: materialized when
its work finishes within ``--drain-timeout``, otherwise ``SHUTTING_DOWN``; it
closes a socket only once its own work is done and nothing more is arriving,
and exits 0.

The matrix is {inline, worker} x {ZMQ reply, ZMQ forward, engine mode, gRPC
Admit, AdmitStream, the SMG face}. Each round serves in process with the
whole shutdown sequence of ``mmadmit serve`` (:func:`mmadmit.server.serve`;
the stop event is what the SIGTERM handler sets), sends a burst, stops the
service at the first answer and keeps sending a few requests a few
milliseconds apart while it drains, then checks that every request had
exactly one answer and that the service exited 0. Rounds vary the sizes, so
that an intermittent loss shows. :func:`test_sigterm_real_process_answers_every_zmq_request`
is the same over a real process and a real SIGTERM.

Run with: pytest tests/test_drain.py
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import engine_peers
import grpc
import numpy as np
import pytest
import zmq
import zmq.asyncio
from client_helpers import proto_of
from conftest import CONFIGS, free_ports
from mmadmit import server, wire
from mmadmit.config import build_config
from mmadmit.handshake import ENGINE_CORE_DEAD
from mmadmit.model import Request
from mmadmit_client.proto import admission_pb2_grpc as pb_grpc
from mmadmit_client.wire import decode_reply
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
from smg_grpc_proto import tokenspeed_scheduler_pb2_grpc as ts_grpc

MODEL = CONFIGS / "qwen3_5.json"
PATHS = ("reply", "forward", "engine", "admit", "stream", "smg")
MODES = ("inline", "worker")
ROUNDS = 20
BURST = 8  # sent at once before the stop
LATE = 6  # sent while the service drains, LATE_GAP_S apart
LATE_GAP_S = 0.004
MATERIALIZED = "MATERIALIZED"
SHUTTING_DOWN = "SHUTTING_DOWN"
UNAVAILABLE = "UNAVAILABLE"  # a gRPC call the server refused once it stopped listening


def mode_args(mode: str) -> dict[str, Any]:
    if mode == "inline":  # every request materialized on the loop, never in flight
        return {"inline_max_tokens": 1 << 20, "inline_max_us": 1e9}
    return {"inline_max_tokens": 0, "inline_max_us": 0.0, "workers": 2}


def ids_of(rid: str, tokens: int) -> np.ndarray:
    return (np.arange(tokens, dtype=np.int64) * 7919 + len(rid)) % 150_000


def text_request(rid: str, tokens: int) -> Request:
    return Request(rid=rid, input_ids=ids_of(rid, tokens))


@dataclass
class Round:
    """One round's requests and what came back for each."""

    sizes: list[int]
    answers: dict[str, list[str]] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    all_answered: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def rids(self) -> list[str]:
        return [f"r{i}" for i in range(len(self.sizes))]

    def answer(self, rid: str, code: str) -> None:
        self.answers.setdefault(rid, []).append(code)
        self.stop.set()  # the first answer stops the service
        if len(self.answers) == len(self.sizes):
            self.all_answered.set()

    def check(self, allowed: set[str], covered: set[str] | None = None) -> None:
        """Each request answered exactly once (``covered``: ended for its peer by a
        terminal signal of the whole connection instead, e.g. ENGINE_CORE_DEAD)."""
        twice = {rid: codes for rid, codes in self.answers.items() if len(codes) > 1}
        assert not twice, f"answered more than once: {twice}"
        missing = set(self.rids) - set(self.answers) - (covered or set())
        assert not missing, f"never answered: {sorted(missing)} (answers {self.answers})"
        codes = Counter(c for codes in self.answers.values() for c in codes)
        assert set(codes) <= allowed, f"unexpected codes: {codes}"


Client = Callable[[Round, dict[str, Any]], Awaitable[set[str] | None]]


async def paced(
    rnd: Round, build: Callable[[str, int], Any], send: Callable[[str, Any], Awaitable[None]]
) -> None:
    """The burst, then (once the service is stopping) the late requests, paced.
    Every message is built first, so the late ones leave at once when their turn comes."""
    built = [(rid, build(rid, size)) for rid, size in zip(rnd.rids, rnd.sizes, strict=True)]
    for rid, msg in built[:BURST]:
        await send(rid, msg)
    await rnd.stop.wait()
    for rid, msg in built[BURST:]:
        await asyncio.sleep(LATE_GAP_S)
        await send(rid, msg)


def add_frames(rid: str, size: int) -> list[Any]:
    return [b"\x00", *wire.encode_request(text_request(rid, size))]


async def run_round(
    path: str, mode: str, rnd: Round, client: Client, extra: dict[str, Any]
) -> None:
    args: dict[str, Any] = {
        "model": str(MODEL),
        "device": "cpu",
        "grpc_listen": "off",
        "zmq_listen": "off",
        "metrics_listen": "off",
        "drain_timeout": 5.0,
        "log_level": "warning",
        **mode_args(mode),
        **extra,
    }
    config = build_config(args, environ={})
    ready: asyncio.Future[server.ServerHandle] = asyncio.get_running_loop().create_future()
    serving = asyncio.ensure_future(
        server.serve(config, on_ready=ready.set_result, install_signals=False)
    )
    try:
        handle = await asyncio.wait_for(asyncio.shield(ready), 30)

        async def stop_on_first() -> None:
            await rnd.stop.wait()
            handle.stop_event.set()  # what SIGTERM's handler does

        stopper = asyncio.ensure_future(stop_on_first())
        covered = await asyncio.wait_for(client(rnd, handle.addresses), 30)
        rc = await asyncio.wait_for(serving, 30)
        stopper.cancel()
    finally:
        if not serving.done():
            serving.cancel()
            await asyncio.gather(serving, return_exceptions=True)
    assert rc == 0
    allowed = {MATERIALIZED, SHUTTING_DOWN, UNAVAILABLE}
    rnd.check(allowed, covered)


# --------------------------------------------------------------------------- clients


async def collect_until_quiet(
    recv: Callable[[], Awaitable[Any]], on: Callable[[Any], bool], rnd: Round
) -> None:
    """Receive until ``on`` says done, every request is answered, or nothing came
    for 3 s (the service has gone)."""
    done = asyncio.ensure_future(rnd.all_answered.wait())
    try:
        while not done.done():
            got = asyncio.ensure_future(recv())
            await asyncio.wait({got, done}, timeout=3.0, return_when=asyncio.FIRST_COMPLETED)
            if not got.done():
                got.cancel()
                await asyncio.gather(got, return_exceptions=True)
                return
            if on(got.result()):
                return
    finally:
        done.cancel()


async def zmq_reply_client(rnd: Round, addresses: dict[str, Any], dealers: int = 2) -> None:
    ctx = zmq.asyncio.Context()
    socks = [ctx.socket(zmq.DEALER) for _ in range(dealers)]
    try:
        for d in socks:
            d.connect(addresses["zmq"])

        async def send(rid: str, frames: list[Any]) -> None:
            await socks[int(rid[1:]) % dealers].send_multipart(frames, copy=False)

        async def read(d: zmq.asyncio.Socket) -> None:
            def on(frames: list[bytes]) -> bool:
                rid, out = decode_reply(frames)
                rnd.answer(rid, getattr(out, "code", repr(out)))
                return len(rnd.answers) == len(rnd.rids)

            await collect_until_quiet(d.recv_multipart, on, rnd)

        readers = [asyncio.ensure_future(read(d)) for d in socks]
        await paced(rnd, add_frames, send)
        await asyncio.wait(readers, return_when=asyncio.ALL_COMPLETED)
    finally:
        for d in socks:
            d.close(linger=0)
        ctx.term()
    return None


@contextlib.asynccontextmanager
async def forward_target() -> AsyncIterator[tuple[zmq.asyncio.Socket, str]]:
    ctx = zmq.asyncio.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind("tcp://127.0.0.1:0")
    try:
        yield pull, pull.getsockopt_string(zmq.LAST_ENDPOINT)
    finally:
        pull.close(linger=0)
        ctx.term()


def forwarded_code(frames: list[bytes]) -> tuple[str, str]:
    req = wire.decode_message(frames).request
    assert req is not None
    err = req.validation_error
    return req.rid, MATERIALIZED if err is None else str(err).split(":")[0]


def zmq_forward_client(pull: zmq.asyncio.Socket) -> Client:
    async def client(rnd: Round, addresses: dict[str, Any]) -> None:
        ctx = zmq.asyncio.Context()
        dealer = ctx.socket(zmq.DEALER)
        try:
            dealer.connect(addresses["zmq"])

            async def send(rid: str, frames: list[Any]) -> None:
                await dealer.send_multipart(frames, copy=False)

            def on(frames: list[bytes]) -> bool:
                rid, code = forwarded_code(frames)
                rnd.answer(rid, code)
                return len(rnd.answers) == len(rnd.rids)

            reader = asyncio.ensure_future(collect_until_quiet(pull.recv_multipart, on, rnd))
            await paced(rnd, add_frames, send)
            await reader
        finally:
            dealer.close(linger=0)
            ctx.term()

    return client


async def one_call_each(
    rnd: Round,
    target: str,
    build: Callable[[str, int], Any],
    call: Callable[[grpc.aio.Channel, Any], Awaitable[str]],
) -> None:
    """Each request on a gRPC call of its own (``call`` returns the answer's code);
    a call that ends with a status is answered by it (``SHUTTING_DOWN`` when its
    details say so, else the status' name)."""
    async with grpc.aio.insecure_channel(target) as channel:
        calls: list[asyncio.Task[None]] = []

        async def one(rid: str, msg: Any) -> None:
            try:
                code = await call(channel, msg)
            except grpc.aio.AioRpcError as exc:
                said = (exc.details() or "").split(":")[0]
                code = SHUTTING_DOWN if said == SHUTTING_DOWN else exc.code().name
            rnd.answer(rid, code)

        async def send(rid: str, msg: Any) -> None:
            calls.append(asyncio.ensure_future(one(rid, msg)))

        await paced(rnd, build, send)
        await asyncio.gather(*calls)


async def grpc_admit_client(rnd: Round, addresses: dict[str, Any]) -> None:
    async def admit(channel: grpc.aio.Channel, msg: Any) -> str:
        resp = await pb_grpc.AdmissionStub(channel).Admit(msg, timeout=20)
        kind = resp.WhichOneof("outcome")
        return MATERIALIZED if kind == "materialized" else abort_name(resp)

    await one_call_each(rnd, addresses["grpc"], admit_request, admit)


def admit_request(rid: str, size: int) -> Any:
    return proto_of(text_request(rid, size), rid)


def abort_name(resp: Any) -> str:
    from mmadmit_client.proto import admission_pb2 as pb

    return pb.AbortCode.Name(resp.abort.code).removeprefix("ABORT_CODE_")


async def grpc_stream_client(rnd: Round, addresses: dict[str, Any]) -> set[str]:
    """One AdmitStream: every request is answered in band, or the stream's end
    status answers the ones it never did (the client library fails those)."""
    async with grpc.aio.insecure_channel(addresses["grpc"]) as channel:
        stub = pb_grpc.AdmissionStub(channel)
        call = stub.AdmitStream(timeout=20)

        async def send(rid: str, msg: Any) -> None:
            await call.write(msg)

        async def read() -> None:
            async for resp in call:
                kind = resp.WhichOneof("outcome")
                rnd.answer(
                    resp.request_id, MATERIALIZED if kind == "materialized" else abort_name(resp)
                )
                if len(rnd.answers) == len(rnd.rids):
                    return

        reader = asyncio.ensure_future(read())
        try:
            await paced(rnd, admit_request, send)
            await call.done_writing()
        except grpc.aio.AioRpcError:
            pass  # the stream ended while writing: its status answers the rest
        try:
            await reader
        except grpc.aio.AioRpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), exc
        unanswered = set(rnd.rids) - set(rnd.answers)
        if unanswered:  # ended by the stream's status, which the caller saw
            code = await call.code()
            assert code is not grpc.StatusCode.OK, f"stream ended OK without {unanswered}"
        return unanswered


def generate_of(rid: str, size: int) -> ts.GenerateRequest:
    msg = ts.GenerateRequest(request_id=rid)
    msg.tokenized.input_ids.extend(ids_of(rid, size).tolist())
    return msg


async def smg_face_client(rnd: Round, addresses: dict[str, Any]) -> None:
    async def generate(channel: grpc.aio.Channel, msg: Any) -> str:
        stub = ts_grpc.TokenSpeedSchedulerStub(channel)
        responses = [r async for r in stub.Generate(msg, timeout=20)]
        assert responses[-1].HasField("complete"), responses
        return MATERIALIZED

    await one_call_each(rnd, addresses["smg-grpc"], generate_of, generate)


def engine_client(smg: engine_peers.Smg, accepted: Awaitable[Any]) -> Client:
    """SMG's side of engine mode: ADDs on its input, outputs on its PULL. A request
    SMG sent is answered by its finished output, or by ENGINE_CORE_DEAD (which fails
    every request SMG still has open); none twice."""

    async def client(rnd: Round, addresses: dict[str, Any]) -> set[str]:
        await asyncio.wait_for(asyncio.shield(accepted), 10)  # SMG's side of the handshake
        dead = asyncio.Event()

        async def send(rid: str, frames: list[Any]) -> None:
            await smg.send(frames)

        def on(frames: list[Any]) -> bool:
            if len(frames) == 1 and frames[0].bytes == ENGINE_CORE_DEAD:
                dead.set()
                return True
            rids, reasons = engine_peers.read_output(frames)
            for rid, reason in zip(rids, reasons, strict=True):
                if reason:
                    rnd.answer(rid, MATERIALIZED if reason == "stop" else SHUTTING_DOWN)
            return False

        reader = asyncio.ensure_future(collect_until_quiet(smg.recv_output, on, rnd))
        await paced(rnd, add_frames, send)
        await reader
        unanswered = set(rnd.rids) - set(rnd.answers)
        assert dead.is_set() or not unanswered, "stopped without ENGINE_CORE_DEAD"
        return unanswered

    return client


# --------------------------------------------------------------------------- the matrix


@contextlib.asynccontextmanager
async def path_env(path: str) -> AsyncIterator[tuple[Client, dict[str, Any]]]:
    """The client for ``path`` and the serve settings it needs (peers started)."""
    if path == "reply":
        yield zmq_reply_client, {"zmq_listen": "tcp://127.0.0.1:0"}
    elif path == "forward":
        async with forward_target() as (pull, target):
            yield (
                zmq_forward_client(pull),
                {"zmq_listen": "tcp://127.0.0.1:0", "zmq_forward": target},
            )
    elif path in ("admit", "stream"):
        client = grpc_admit_client if path == "admit" else grpc_stream_client
        yield client, {"grpc_listen": "127.0.0.1:0"}
    elif path in ("engine", "smg"):
        async with scheduler_peers(path) as pair:
            yield pair
    else:  # pragma: no cover
        raise AssertionError(path)


@contextlib.asynccontextmanager
async def scheduler_peers(path: str) -> AsyncIterator[tuple[Client, dict[str, Any]]]:
    """A test scheduler on a fixed engine-handshake port (and SMG's stand-in in
    engine mode); it connects, retrying, as soon as the service binds."""
    ctx = zmq.asyncio.Context()
    (port,) = free_ports(1)
    listen = f"tcp://127.0.0.1:{port}"
    scheduler = asyncio.ensure_future(
        engine_peers.run_scheduler(ctx, listen, report=False, delay_s=0.002)
    )
    smg = engine_peers.Smg(ctx, "tcp://127.0.0.1:0", report=False) if path == "engine" else None
    accept = asyncio.ensure_future(smg.accept()) if smg is not None else None
    try:
        if smg is not None:
            assert accept is not None
            yield (
                engine_client(smg, accept),
                {
                    "engine_handshake_listen": listen,
                    "smg_handshake": smg.handshake,
                },
            )
        else:
            yield (
                smg_face_client,
                {
                    "engine_handshake_listen": listen,
                    "smg_grpc_listen": "127.0.0.1:0",
                },
            )
    finally:
        for task in (scheduler, accept):
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in (scheduler, accept) if t), return_exceptions=True)
        if smg is not None:
            smg.close()
        ctx.term()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", PATHS)
async def test_every_request_is_answered_once_through_the_drain(path: str, mode: str) -> None:
    rng = np.random.default_rng(PATHS.index(path) * 10 + MODES.index(mode))
    for _ in range(ROUNDS):
        sizes = rng.integers(64, 65_536, size=BURST + LATE).tolist()
        rnd = Round(sizes)
        async with path_env(path) as (client, extra):
            await run_round(path, mode, rnd, client, extra)


# --------------------------------------------------------------------------- a real SIGTERM


def start_serve(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "mmadmit", "serve", "--model", str(MODEL), "--device", "cpu",
         "--grpc-listen", "off", "--metrics-listen", "off", "--zmq-listen", "tcp://127.0.0.1:0",
         "--max-inflight", "1000", *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    for line in proc.stderr:
        m = re.match(r"mmadmit ready .*zmq=(tcp://\S+)", line)
        if m:
            return proc, m.group(1)
    proc.wait()
    raise AssertionError(f"serve exited {proc.returncode} before its ready line")


async def sigterm_round(rnd: Round, *args: str) -> None:
    proc, endpoint = start_serve(*args)

    async def signal_on_first() -> None:
        await rnd.stop.wait()
        proc.send_signal(signal.SIGTERM)

    sig = asyncio.ensure_future(signal_on_first())
    try:
        await zmq_reply_client(rnd, {"zmq": endpoint}, dealers=4)
        rc = await asyncio.to_thread(proc.wait, 30)
    finally:
        sig.cancel()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()
    assert rc == 0
    rnd.check({MATERIALIZED, SHUTTING_DOWN})


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
async def test_sigterm_real_process_answers_every_zmq_request(mode: str) -> None:
    """The operator's scenario: about 1 MB requests from 4 DEALERs at once, SIGTERM
    right after the first reply, a few more sent while the process drains: every
    request is answered exactly once and the process exits 0."""
    extra = ("--inline-max-tokens", "0", "--inline-max-us", "0") if mode == "worker" else ()
    rng = np.random.default_rng(7)
    for _ in range(3):
        await sigterm_round(
            Round(rng.integers(100_000, 160_000, size=BURST + LATE).tolist()), *extra
        )
