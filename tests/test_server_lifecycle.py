"""``mmadmit serve`` as a real process: readiness, SIGTERM drain, forced exit, bad config.

Contract pinned here (docs/spec/CLI.md, STYLE 7 and 8):

* readiness: the one machine-readable line ``mmadmit ready grpc=HOST:PORT
  zmq=tcp://HOST:PORT metrics=HOST:PORT`` on stderr, with the addresses really
  bound (``off`` for a disabled transport), and gRPC health SERVING by then;
* SIGTERM under load from both transports: health turns NOT_SERVING, the
  transports keep reading and answer every new request ``SHUTTING_DOWN`` at
  once, every request sent before the signal gets exactly one outcome
  (materialized or ``SHUTTING_DOWN``; gRPC calls in band), exit 0 within the
  drain timeout;
* a drain that runs out of time ends the rest ``SHUTTING_DOWN`` and still
  exits 0; a second signal exits at once with status 1;
* unusable configuration (a bad flag value, a port already in use) exits 2
  with one line on stderr.

Load is real work, not a hook: Qwen3.5 32K-token requests with 23 media items
whose float16 features carry no content hash, so the service hashes them (about
2 ms/MB on one worker). On gRPC each item has its own 1 MB feature (24 MB per
request); on ZMQ the 23 items share one 2-8 MB aux frame, so a request is hashed
23 times what it weighs on the wire: hashing and a loopback transfer run at about
the same speed here, and only this makes the backlog the drain tests rely on
(requests queued when the signal comes) independent of the box's speed. Each
server runs ``--workers 1 --device cpu``. The gRPC side uses the client library;
the ZMQ side a plain DEALER (:class:`ZmqPeer`, why there), and the test reads
``/metrics`` to know when work is admitted.

Also here, as an expected failure: the ZMQ client library drops replies that
arrived just before the server closed the connection.

Run with: python -m pytest tests/test_server_lifecycle.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio
from client_helpers import grpc_admit, grpc_client, proto_of, zmq_admit, zmq_client
from conftest import CONFIGS, REPO_ROOT, requests_total, scrape_metrics
from mmadmit import wire
from mmadmit.errors import Abort, AbortCode
from mmadmit.grpc_server import ADMISSION_SERVICE
from mmadmit.hashing import feature_hash
from mmadmit.model import Item, Modality, MultimodalInputs, Request, Tensor
from mmadmit.profile import load_profile
from mmadmit_client import Client, Materialized, Outcome, RequestTimeout, TransportError
from mmadmit_client.proto import admission_pb2 as pb
from mmadmit_client.wire import WireFormatError, decode_reply

sys.path.insert(0, str(REPO_ROOT / "bench"))
import workloads  # noqa: E402  (bench/ is not a package)

MODEL = CONFIGS / "qwen3_5.json"
pytestmark = [
    pytest.mark.skipif(not MODEL.is_file(), reason=f"no model config at {MODEL}"),
    pytest.mark.timeout(90),
]

READY_RE = re.compile(r"^mmadmit ready grpc=(\S+) zmq=(\S+) metrics=(\S+)$")
SERVE = (sys.executable, "-m", "mmadmit", "serve", "--model", str(MODEL), "--device", "cpu")
EPHEMERAL = (
    "--grpc-listen", "127.0.0.1:0",
    "--zmq-listen", "tcp://127.0.0.1:0",
    "--metrics-listen", "127.0.0.1:0",
)  # fmt: skip


# --------------------------------------------------------------------------- the process


class ServeProcess:
    """One ``python -m mmadmit serve`` child; a thread collects its stderr lines."""

    def __init__(self, *args: str) -> None:
        cmd = [*SERVE, *args]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines: list[str] = []
        self.addresses: dict[str, str] | None = None
        self._ready = threading.Event()
        self._pump = threading.Thread(target=self._read_stderr, daemon=True)
        self._pump.start()
        self.sigterm_at: float | None = None

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.lines.append(line)
            m = READY_RE.match(line)
            if m and self.addresses is None:
                self.addresses = dict(zip(("grpc", "zmq", "metrics"), m.groups(), strict=True))
                self._ready.set()

    @property
    def stderr(self) -> str:
        return "\n".join(self.lines)

    async def wait_ready(self, timeout_s: float = 30.0) -> dict[str, str]:
        end = time.monotonic() + timeout_s
        while not self._ready.is_set():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"serve exited {self.proc.returncode} before ready:\n{self.stderr}"
                )
            if time.monotonic() > end:
                raise AssertionError(f"no ready line within {timeout_s}s:\n{self.stderr}")
            await asyncio.sleep(0.02)
        assert self.addresses is not None
        return self.addresses

    def send(self, signum: int = signal.SIGTERM) -> None:
        if self.sigterm_at is None:
            self.sigterm_at = time.monotonic()
        self.proc.send_signal(signum)

    async def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        """(exit status, seconds since the first signal)."""
        try:
            rc = await asyncio.to_thread(self.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"serve still running {timeout_s}s later:\n{self.stderr}"
            ) from None
        start = self.sigterm_at if self.sigterm_at is not None else time.monotonic()
        return rc, time.monotonic() - start

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._pump.join(5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@contextlib.contextmanager
def serve(*args: str) -> Iterator[ServeProcess]:
    srv = ServeProcess(*args)
    try:
        yield srv
    finally:
        srv.kill()


# --------------------------------------------------------------------------- helpers


async def metrics(address: str, attempts: int = 5) -> dict[str, float]:
    """One scrape, parsed; retried when the server closes the connection without an answer
    (its metrics handler gives up on a request head that takes over 5 s to arrive, which a
    loaded 2-core box can cause)."""
    return await scrape_metrics(address, attempts)


async def until_metric(
    address: str, name: str, at_least: float, timeout_s: float = 30.0
) -> dict[str, float]:
    end = time.monotonic() + timeout_s
    while True:
        m = await metrics(address)
        if m.get(name, 0) >= at_least:
            return m
        if time.monotonic() > end:
            raise AssertionError(f"{name} stayed at {m.get(name)} (< {at_least})")
        await asyncio.sleep(0.01)


def to_proto(req: Request, rid: str) -> pb.AdmitRequest:
    """The internal request as the client library sends it over gRPC."""
    return proto_of(req, rid)


def big_request(feature_mb_per_item: float) -> Request:
    """32K tokens, 23 media items, no content hash: the service hashes 23 x N MB."""
    return workloads.build_request(
        load_profile(str(MODEL)),
        32768,
        seed=7,
        with_hash=False,
        feature_bytes=int(feature_mb_per_item * (1 << 20)),
    )


# the seconds of hashing on one worker that the old fixed 8 MB shared feature made
# on the box the drain tests were written on (23 x 8 MB at about 0.5 GB/s)
HEAD_S = 0.35


@functools.cache
def hash_bytes_per_s() -> float:
    """How fast this box hashes features (the service's own function), the best of
    three passes over 64 MB. The drain tests size their work by it: their work must
    outlast, or fit, what they do meanwhile, whatever the speed of the box (a fixed
    size calibrated on one box gave a faster one too little work to queue behind)."""
    buf = memoryview(np.zeros(64 << 20, np.uint8))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        feature_hash(buf)
        best = min(best, time.perf_counter() - t0)
    return (64 << 20) / best


def shared_feature_request(seconds: float) -> Request:
    """:func:`big_request` whose 23 items share one feature sized for about ``seconds``
    of hashing on this box (:func:`hash_bytes_per_s`; at least 1 MB): on the ZMQ wire
    that is one aux frame every item points at, so the feature travels once and is
    hashed 23 times.

    Hashing runs at roughly the speed of a loopback transfer on this kind of box, so
    with one feature per item a worker keeps up with what arrives and no backlog builds
    up; sharing the frame makes work outlast transfer, and the drain tests can rely on
    work being queued when the signal comes.
    """
    feature_mb = max(1, round(seconds * hash_bytes_per_s() / 23 / (1 << 20)))
    req = big_request(1 / 1024)
    shared = Tensor.from_numpy(np.zeros((feature_mb << 20) // 2, np.float16).reshape(-1, 2))
    assert req.mm is not None
    for item in req.mm.items:
        item.feature = shared
    return req


def small_request(rid: str) -> Request:
    """A Qwen3.5 request with one 8x8-patch image (16 placeholders), hashed by the service."""
    profile = load_profile(str(MODEL))
    ids = np.full(40, 100, np.int64)
    ids[10:26] = profile.image_token_id
    item = Item(
        modality=int(Modality.IMAGE),
        offsets=np.array([[10, 25]], np.int64),
        feature=Tensor.from_numpy(np.ones((64, 32), np.float32)),
        side={"image_grid_thw": Tensor.from_numpy(np.array([[1, 8, 8]], np.int64))},
    )
    return Request(rid=rid, input_ids=ids, mm=MultimodalInputs(items=[item]))


def zmq_frames(req: Request, rid: str) -> list[Any]:
    """ADD frames for ``req`` under ``rid``; the feature buffers are shared, not copied."""
    return [bytes([wire.MSG_ADD]), *wire.encode_request(dataclasses.replace(req, rid=rid))]


def grpc_copy(base: pb.AdmitRequest, rid: str) -> pb.AdmitRequest:
    msg = pb.AdmitRequest()
    msg.CopyFrom(base)
    msg.request_id = rid
    return msg


def outcome_name(out: Outcome) -> str:
    """``MATERIALIZED`` or the abort code, for either transport's outcome."""
    return out.code


class ZmqPeer:
    """A plain DEALER that sends ADDs and records every reply by request id.

    Not the client library's ``ZmqTransport``: the drain tests pin the
    *server's* contract, so they read with a bare socket that keeps its pipe
    across the disconnect (``ZMQ_IMMEDIATE`` would make libzmq drop replies
    already received but not yet read when the server closes the connection;
    the transport does not set it either, see
    :func:`test_zmq_client_keeps_replies_received_before_the_server_closed`).
    """

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.replies: dict[str, list[str]] = {}
        self._changed = asyncio.Event()
        self._task = asyncio.ensure_future(self._receive())

    async def _receive(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            rid, out = decode_reply(frames)
            assert not isinstance(out, WireFormatError), out
            self.replies.setdefault(rid, []).append(outcome_name(out))
            self._changed.set()

    async def send(self, req: Request, rid: str) -> None:
        await self.sock.send_multipart(zmq_frames(req, rid), copy=False)

    def answered(self, rids: Iterable[str]) -> bool:
        return all(rid in self.replies for rid in rids)

    async def wait(self, rids: Iterable[str], timeout_s: float) -> dict[str, str]:
        """Each rid's one outcome; fails on a missing or a second reply."""
        rids = list(rids)
        async with asyncio.timeout(timeout_s):
            while not self.answered(rids):
                self._changed.clear()
                await self._changed.wait()
        assert all(len(self.replies[r]) == 1 for r in rids), self.replies
        return {r: self.replies[r][0] for r in rids}

    async def aclose(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def zmq_peer(endpoint: str) -> AsyncIterator[ZmqPeer]:
    peer = ZmqPeer(endpoint)
    try:
        yield peer
    finally:
        await peer.aclose()


@contextlib.asynccontextmanager
async def owned_tasks() -> AsyncIterator[list[asyncio.Task[Any]]]:
    """A list of tasks that are cancelled and awaited on the way out, whatever happened."""
    tasks: list[asyncio.Task[Any]] = []
    try:
        yield tasks
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def one_worker_serving(
    drain_s: float,
) -> AsyncIterator[tuple[ServeProcess, dict[str, str], Client, ZmqPeer, list[asyncio.Task[Any]]]]:
    """``serve`` with one worker, 16 requests in flight at most and ``drain_s`` of drain
    timeout, once ready: the process, its addresses, a gRPC client, a :class:`ZmqPeer` and
    a list of owned tasks (:func:`owned_tasks`)."""
    with serve(
        *EPHEMERAL, "--workers", "1", "--max-inflight", "16", "--drain-timeout", str(drain_s)
    ) as srv:
        addr = await srv.wait_ready()
        async with (
            grpc_client(addr["grpc"]) as gc,
            zmq_peer(addr["zmq"]) as peer,
            owned_tasks() as tasks,
        ):
            yield srv, addr, gc, peer, tasks


async def grpc_outcome(gc: Client, msg: pb.AdmitRequest) -> tuple[str, str]:
    out = await grpc_admit(gc, msg, timeout=60)
    assert out.request_id == msg.request_id, (out, msg.request_id)
    return msg.request_id, outcome_name(out)


async def poll_health(client: Client, seen: list[str], stop: asyncio.Event) -> None:
    """Record every change of health status (both names) until ``stop`` or the server is gone."""
    while not stop.is_set():
        try:
            a = await client.health(timeout_s=1.0)
            b = await client.health(ADMISSION_SERVICE, timeout_s=1.0)
        except TransportError:
            return  # the server stopped
        for status in (a, b):
            if not seen or seen[-1] != status:
                seen.append(status)
        await asyncio.sleep(0.01)


@dataclasses.dataclass
class Load:
    """What :func:`load_in_order` sent: ZMQ rids, gRPC rids and the gRPC call tasks."""

    zmq_rids: list[str]
    grpc_rids: list[str]
    grpc_tasks: list[asyncio.Task[tuple[str, str]]]


async def load_in_order(
    addr: dict[str, str],
    peer: ZmqPeer,
    gc: Client,
    tasks: list[asyncio.Task[Any]],
    *,
    zmq_head: Request,
    n_head: int,
    grpc_req: Request | None = None,
    n_grpc: int = 0,
    zmq_tail: Request | None = None,
    n_tail: int = 0,
) -> Load:
    """Admit, in this order, ``n_head`` ZMQ requests (a backlog for the one worker),
    ``n_grpc`` gRPC calls, then ``n_tail`` ZMQ requests, each batch only once the one
    before is admitted; return once all are. The pool works FIFO, so while the head
    backlog lasts the gRPC calls and the tail are queued, i.e. in flight, whatever
    the transfer speed of the box."""
    load = Load([], [], [])
    admitted = 1  # the warm-up request went through the pool
    for i in range(n_head):
        load.zmq_rids.append(f"zh{i}")
        await peer.send(zmq_head, f"zh{i}")
    admitted += n_head
    await until_metric(addr["metrics"], "mmadmit_admitted_total", admitted)
    if n_grpc:
        assert grpc_req is not None
        base = to_proto(grpc_req, "")
        for i in range(n_grpc):
            msg = grpc_copy(base, f"g{i}")
            load.grpc_rids.append(msg.request_id)
            load.grpc_tasks.append(asyncio.ensure_future(grpc_outcome(gc, msg)))
        tasks.extend(load.grpc_tasks)
        admitted += n_grpc
        await until_metric(addr["metrics"], "mmadmit_admitted_total", admitted)
    for i in range(n_tail):
        assert zmq_tail is not None
        load.zmq_rids.append(f"zt{i}")
        await peer.send(zmq_tail, f"zt{i}")
    admitted += n_tail
    await until_metric(addr["metrics"], "mmadmit_admitted_total", admitted)
    return load


# --------------------------------------------------------------------------- readiness


async def test_ready_line_then_serving_on_every_transport() -> None:
    with serve(*EPHEMERAL, "--workers", "1") as srv:
        addr = await srv.wait_ready()
        assert re.fullmatch(r"127\.0\.0\.1:[1-9]\d*", addr["grpc"]), addr
        assert re.fullmatch(r"tcp://127\.0\.0\.1:[1-9]\d*", addr["zmq"]), addr
        assert re.fullmatch(r"127\.0\.0\.1:[1-9]\d*", addr["metrics"]), addr
        async with grpc_client(addr["grpc"]) as gc:
            # SERVING as soon as the line is out: the warm-up already ran
            assert await gc.health(timeout_s=5) == "SERVING"
            assert await gc.health(ADMISSION_SERVICE, timeout_s=5) == "SERVING"
            assert isinstance(
                await grpc_admit(gc, to_proto(small_request("g"), "g"), timeout=10), Materialized
            )
        async with zmq_client(addr["zmq"], timeout_s=10) as zc:
            assert (await zmq_admit(zc, small_request("z"))).materialized
        m = await metrics(addr["metrics"])
        assert m["mmadmit_inflight"] == 0
        assert requests_total(m, outcome="materialized") == 2  # the warm-up is no request
        assert requests_total(m, transport="grpc", code="OK") == 1
        assert requests_total(m, transport="zmq", code="OK") == 1
        srv.send()
        rc, took = await srv.wait_exit(10)
        assert rc == 0, srv.stderr
        assert took < 5


@pytest.mark.parametrize("off", ["zmq", "grpc+metrics"])
async def test_disabled_transport_reads_off(off: str) -> None:
    args = dict(zip(EPHEMERAL[::2], EPHEMERAL[1::2], strict=True))
    for name in off.split("+"):
        args[f"--{name}-listen"] = "off"
    with serve(*(x for kv in args.items() for x in kv), "--workers", "1") as srv:
        addr = await srv.wait_ready()
        for name in ("grpc", "zmq", "metrics"):
            assert (addr[name] == "off") == (name in off.split("+")), addr
        if addr["grpc"] != "off":
            async with grpc_client(addr["grpc"]) as gc:
                assert await gc.health(timeout_s=5) == "SERVING"
        if addr["zmq"] != "off":
            async with zmq_client(addr["zmq"], timeout_s=10) as zc:
                assert (await zmq_admit(zc, small_request("z"))).materialized
        srv.send()
        assert (await srv.wait_exit(10))[0] == 0, srv.stderr


# --------------------------------------------------------------------------- SIGTERM


async def test_sigterm_under_load_drains_both_transports() -> None:
    """12 admitted (4 ZMQ of HEAD_S of hashing each, 4 gRPC carrying 24 MB each, 4 ZMQ
    of a quarter of that: about 2 s of hashing on one worker), then SIGTERM: health turns
    NOT_SERVING for good, new requests on both transports get SHUTTING_DOWN at once
    while the drain runs, every request sent before the signal gets exactly one outcome
    (all fit the 5 s drain: materialized; gRPC in band), and the process exits 0 in
    time."""
    drain_s = 5.0
    async with (
        one_worker_serving(drain_s) as (srv, addr, gc, peer, tasks),
        grpc_client(addr["grpc"]) as health_client,
        owned_tasks() as polling,
    ):
        load = await load_in_order(
            addr,
            peer,
            gc,
            tasks,
            zmq_head=shared_feature_request(HEAD_S),
            n_head=4,
            grpc_req=big_request(1),
            n_grpc=4,
            zmq_tail=shared_feature_request(HEAD_S / 4),
            n_tail=4,
        )
        # in flight from both transports at the signal
        assert not all(t.done() for t in load.grpc_tasks)
        assert not peer.answered(load.zmq_rids)
        seen: list[str] = []
        stop_polling = asyncio.Event()
        polling.append(asyncio.ensure_future(poll_health(health_client, seen, stop_polling)))
        async with asyncio.timeout(5):
            while not seen:  # SERVING under load, before the signal
                await asyncio.sleep(0.005)
        srv.send()
        async with asyncio.timeout(drain_s):
            while "NOT_SERVING" not in seen:
                await asyncio.sleep(0.005)
        # from now on both transports answer new requests SHUTTING_DOWN at once
        t0 = time.monotonic()
        late_g = asyncio.ensure_future(
            grpc_outcome(gc, to_proto(small_request("late-g"), "late-g"))
        )
        tasks.append(late_g)
        await peer.send(small_request("late-z"), "late-z")
        await peer.send(shared_feature_request(HEAD_S), "late-z-big")
        late = await peer.wait(["late-z", "late-z-big"], timeout_s=drain_s)
        late["late-g"] = (await asyncio.wait_for(late_g, drain_s))[1]
        late_s = time.monotonic() - t0
        assert late == {
            "late-z": "SHUTTING_DOWN",
            "late-z-big": "SHUTTING_DOWN",
            "late-g": "SHUTTING_DOWN",
        }
        # answered while work sent before the signal was still running: not queued
        assert not peer.answered(load.zmq_rids), (late_s, peer.replies)
        results = await peer.wait(load.zmq_rids, timeout_s=drain_s + 5)
        results.update(await asyncio.wait_for(asyncio.gather(*load.grpc_tasks), drain_s))
        assert len(results) == 12
        # 2 s of work fits the 5 s drain: everything admitted was materialized
        assert set(results.values()) == {"MATERIALIZED"}, results
        stop_polling.set()
        rc, took = await srv.wait_exit(drain_s + 5)
        assert rc == 0, srv.stderr
        assert took < drain_s + 3, took
        await asyncio.sleep(0.2)  # no second reply for anything
        assert all(len(v) == 1 for v in peer.replies.values()), peer.replies
        assert seen[0] == "SERVING" and "NOT_SERVING" in seen, seen
        assert "SERVING" not in seen[seen.index("NOT_SERVING") :], seen  # for good
        assert not any("Traceback" in line for line in srv.lines), srv.stderr


async def test_drain_timeout_ends_the_rest_shutting_down() -> None:
    """8 ZMQ requests of 0.4 s of hashing each (3.2 s of work), then 4 gRPC calls queued
    behind them, and a 1 s drain: what finished by then is materialized, the rest ends
    SHUTTING_DOWN (the gRPC calls in band), each exactly once; exit 0 in time."""
    drain_s = 1.0
    async with one_worker_serving(drain_s) as (srv, addr, gc, peer, tasks):
        load = await load_in_order(
            addr,
            peer,
            gc,
            tasks,
            zmq_head=shared_feature_request(0.4),
            n_head=8,
            grpc_req=big_request(1),
            n_grpc=4,
        )
        assert not any(t.done() for t in load.grpc_tasks)
        srv.send()
        results = await peer.wait(load.zmq_rids, timeout_s=drain_s + 10)
        results.update(await asyncio.wait_for(asyncio.gather(*load.grpc_tasks), 10))
        assert len(results) == 12
        assert set(results.values()) <= {"MATERIALIZED", "SHUTTING_DOWN"}, results
        # queued behind more than a second of work: cut short by the drain deadline
        assert [results[rid] for rid in load.grpc_rids] == ["SHUTTING_DOWN"] * 4, results
        assert results["zh0"] == "MATERIALIZED", results  # running or done before
        rc, took = await srv.wait_exit(drain_s + 10)
        assert rc == 0, srv.stderr
        assert took < drain_s + 4, took
        await asyncio.sleep(0.2)
        assert all(len(v) == 1 for v in peer.replies.values()), peer.replies
    assert any("ended SHUTTING_DOWN" in line for line in srv.lines), srv.stderr


async def test_second_signal_exits_at_once_with_status_1() -> None:
    async with one_worker_serving(30) as (srv, addr, gc, peer, tasks):
        load = await load_in_order(
            addr, peer, gc, tasks, zmq_head=shared_feature_request(HEAD_S), n_head=8
        )
        srv.send()
        async with asyncio.timeout(10):
            while await gc.health(timeout_s=2) != "NOT_SERVING":  # the drain is running
                await asyncio.sleep(0.005)
        assert srv.proc.poll() is None
        srv.send(signal.SIGTERM)
        rc = await asyncio.to_thread(srv.proc.wait, 10)  # the drain would take 30 s
        assert rc == 1, srv.stderr
        # it did not wait for the work: none of it was answered, the drain never ended
        assert not peer.answered(load.zmq_rids)
        assert "[shutdown] done" not in srv.stderr, srv.stderr


async def test_zmq_client_keeps_replies_received_before_the_server_closed() -> None:
    """The client's half of the drain contract: a reply the service sent before it
    exited reaches the caller, even when the caller's loop reads it only after the
    connection closed. Stand-in server: a ROUTER that answers once, then closes with a
    linger (as ``ZmqIngest.stop`` does at the end of a drain). Whether libzmq has
    already dropped the pipe when the client reads is a race inside libzmq, so the
    scenario runs several times; any lost reply fails."""
    lost = 0
    for attempt in range(5):
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        port = router.bind_to_random_port("tcp://127.0.0.1")

        def serve_one(router: zmq.Socket[bytes] = router, ctx: zmq.Context[Any] = ctx) -> None:
            ident, *frames = router.recv_multipart()
            rid = wire.recover_rid(frames[1])
            abort = Abort(AbortCode.SHUTTING_DOWN, "the service is shutting down")
            router.send_multipart([ident, *wire.encode_aborted(None, abort, rid)])
            router.close(linger=1000)  # the reply is flushed, then the connection goes
            ctx.term()

        server = threading.Thread(target=serve_one, daemon=True)
        server.start()
        try:
            async with zmq_client(f"tcp://127.0.0.1:{port}", timeout_s=1) as zc:
                pending = asyncio.ensure_future(zmq_admit(zc, small_request(f"last-{attempt}")))
                await asyncio.sleep(0.1)  # sent
                # this loop is busy (blocked) while the reply arrives and the server closes
                server.join(5)
                time.sleep(0.2)
                try:
                    out = await pending
                except RequestTimeout:
                    lost += 1
                else:
                    assert (out.request_id, out.code) == (f"last-{attempt}", "SHUTTING_DOWN")
        finally:
            server.join(5)
    assert lost == 0, f"{lost} of 5 replies were dropped with the connection"


# --------------------------------------------------------------------------- bad config


def _run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [*SERVE, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)


def _stderr_lines(p: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "flag,value",
    [
        ("--workers", "0"),
        ("--max-inflight", "many"),
        ("--drain-timeout", "-1"),
        ("--grpc-listen", "nohost"),
    ],
)
def test_bad_flag_value_exits_2_with_one_line(flag: str, value: str) -> None:
    p = _run_serve(*EPHEMERAL, flag, value)
    assert p.returncode == 2, p.stderr
    lines = _stderr_lines(p)
    assert len(lines) == 1, p.stderr
    assert flag in lines[0] and value in lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that this test holds (bound and listening)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


@pytest.mark.parametrize(
    "transport",
    [
        "grpc",
        "zmq",
        "metrics",
    ],
)
def test_port_in_use_exits_2_with_one_line(transport: str, busy_port: int) -> None:
    args = dict(zip(EPHEMERAL[::2], EPHEMERAL[1::2], strict=True))
    prefix = "tcp://" if transport == "zmq" else ""
    args[f"--{transport}-listen"] = f"{prefix}127.0.0.1:{busy_port}"
    # --log-level warning: the start-up INFO lines are not part of the contract
    p = _run_serve(*(x for kv in args.items() for x in kv), "--log-level", "warning")
    assert p.returncode == 2, p.stderr
    lines = _stderr_lines(p)
    assert len(lines) == 1, p.stderr
    assert str(busy_port) in lines[0] and "Traceback" not in p.stderr
