"""Nothing is delivered after the caller gave up (issue 33).

Contract pinned here, with real sockets on ephemeral loopback ports:

* ZMQ: a request that ended for its caller (``ServerUnavailable`` with nothing
  listening, ``RequestTimeout`` against a peer that stopped reading, a cancelled
  await, a closed client) never reaches a peer later: not a server bound on the
  port afterwards while the client stays open, not the stalled peer once it
  reads again; and a new request afterwards works;
* ZMQ, multiplexed requests: a request that ends while the socket may still hold
  its message resets the connection; every other request the old socket had
  taken ends ``ServerUnavailable`` (exactly one outcome each); a request whose
  message provably left (a later one was answered) ends without a reset;
* ZMQ: a vanished server ends its requests ``ServerUnavailable`` at once (a
  closed connection) or within about two heartbeats (a frozen server), not at
  the request timeout;
* ``mmadmit-client bench`` against a server that stops mid-run ends promptly,
  counts the requests it held as ``ServerUnavailable``, and the server bound
  next on the same port receives none of them;
* gRPC: a call that timed out, was cancelled, or whose client was closed while
  it waited for a connection is never sent to a server that comes up later.

Run with: python -m pytest tests/test_client_delivery.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import mmadmit_client as mc
import pytest
import zmq
import zmq.asyncio
from conftest import REPO_ROOT, free_port, until
from mmadmit_client import wire
from mmadmit_client.proto import admission_pb2 as pb
from mmadmit_client.proto import admission_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)

EXAMPLE = REPO_ROOT / "examples" / "request_qwen3_5.json"


def request(rid: str) -> mc.Request:
    return mc.Request(rid, [1, 2, 3, 4])


def zmq_client(port: int, **kw: Any) -> mc.Client:
    return mc.Client(mc.ZmqTransport(f"tcp://127.0.0.1:{port}", **kw))


class Peer:
    """A ROUTER on ``port`` standing in for the server: it records the request id of
    every message it reads and answers those ``answer(rid)`` accepts (materialized,
    the request echoed) -- or reads nothing at all until :meth:`start` when
    ``stalled`` (its receive high-water mark 1, its kernel buffer small)."""

    def __init__(
        self, port: int, answer: Callable[[str], bool] = lambda rid: True, stalled: bool = False
    ) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if stalled:
            self.sock.setsockopt(zmq.RCVHWM, 1)
            self.sock.setsockopt(zmq.RCVBUF, 4096)
        self.port = port
        self.answer = answer
        self.rids: list[str] = []
        self._task: asyncio.Task[None] | None = None

    async def bind(self) -> Peer:
        """Bind (retrying while a just-closed socket still holds the port)."""
        end = time.monotonic() + 5
        while True:
            try:
                self.sock.bind(f"tcp://127.0.0.1:{self.port}")
                return self
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE or time.monotonic() > end:
                    raise
                await asyncio.sleep(0.02)

    def start(self) -> None:
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            ident, *frames = await self.sock.recv_multipart()
            rid = wire.recover_rid(frames[1]) if len(frames) > 1 else ""
            self.rids.append(rid)
            if frames[0] == bytes([wire.MSG_ADD]) and rid and self.answer(rid):
                req = wire.decode_add(frames)
                out = wire.outcome_from_request(wire.STATUS_MATERIALIZED, req, [])
                await self.sock.send_multipart([ident, *wire.encode_reply(out, req)])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self.sock.close(linger=0)
        self.ctx.term()


@contextlib.asynccontextmanager
async def peer_on(port: int, **kw: Any) -> AsyncIterator[Peer]:
    peer = await Peer(port, **kw).bind()
    if not kw.get("stalled"):
        peer.start()
    try:
        yield peer
    finally:
        await peer.close()


# --------------------------------------------------------------------------- ZMQ: no later delivery


async def end_call(end: str, call: asyncio.Future[Any], client: Any) -> None:
    """End an admit in flight as its caller would: ``cancel`` it (its await raises
    CancelledError) or ``close`` the client (ClientStateError)."""
    if end == "cancel":
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    else:
        await client.aclose()
        with pytest.raises(mc.ClientStateError):
            await call


async def end_stale(end: str, client: Any, timed_out: type[Exception], wait_s: float) -> None:
    """Send request ``stale`` and end it by ``end``: its own 0.5 s timeout (the admit
    raises ``timed_out``), or ``wait_s`` after it was sent, by :func:`end_call`."""
    if end == "timeout":
        with pytest.raises(timed_out):
            await client.admit(request("stale"), timeout_s=0.5)
    else:
        task = asyncio.ensure_future(client.admit(request("stale")))
        await asyncio.sleep(wait_s)
        await end_call(end, task, client)


@pytest.mark.parametrize("end", ["timeout", "cancel", "close"])
async def test_request_ended_with_nothing_listening_never_reaches_a_later_server(end: str) -> None:
    """The operator's scenario: nothing listening, the request ends, a server comes up
    on the port while the client stays open: it must not get the ended request."""
    port = free_port()
    client = zmq_client(port, timeout_s=30)
    await client.open()
    try:
        await end_stale(end, client, mc.ServerUnavailable, 0.3)
        async with peer_on(port) as peer:
            if end == "close":
                await asyncio.sleep(0.6)  # a closed client never connects: nothing arrives
            else:
                out = await client.admit(request("fresh"), timeout_s=5)
                assert isinstance(out, mc.Materialized) and out.request_id == "fresh"
                await asyncio.sleep(0.2)  # anything queued would have come first anyway
            assert "stale" not in peer.rids, peer.rids
            assert peer.rids == ([] if end == "close" else ["fresh"])
    finally:
        await client.aclose()


def test_blocking_client_unavailable_then_server_on_the_port() -> None:
    """The same over :class:`BlockingClient`, as the operator ran it."""
    port = free_port()

    async def serve_once(got: list[str]) -> None:
        async with peer_on(port) as peer:
            await until(lambda: bool(peer.rids), 5)
            await asyncio.sleep(0.2)
            got.extend(peer.rids)

    with mc.BlockingClient(mc.ZmqTransport(f"tcp://127.0.0.1:{port}")) as client:
        with pytest.raises(mc.ServerUnavailable):
            client.admit(request("stale"), timeout_s=1.0)
        got: list[str] = []
        import threading

        runner = threading.Thread(target=lambda: asyncio.run(serve_once(got)))
        runner.start()
        try:
            out = client.admit(request("fresh"), timeout_s=5)
        finally:
            runner.join(10)
        assert out.request_id == "fresh"
        assert got == ["fresh"], got


BALLAST = b"\xab" * (8 << 20)


def ballast(i: int) -> list[Any]:
    """An ADD with an 8 MiB extra frame: a few of them fill the socket buffers of a
    peer that does not read, so what is sent after them waits in the DEALER."""
    return [*wire.encode_add(request(f"ballast-{i}")), BALLAST]


@pytest.mark.parametrize("end", ["timeout", "cancel"])
async def test_request_queued_behind_a_stalled_peer_is_discarded(end: str) -> None:
    """A peer that stopped reading: the request ends (RequestTimeout, or cancelled)
    with its message still queued in the client; the connection is reset, so the
    peer never reads it when it resumes, and every other request the old socket had
    taken gets exactly one outcome, ServerUnavailable."""
    port = free_port()
    async with peer_on(port, stalled=True) as peer, zmq_client(port, timeout_s=10) as client:
        await client.wait_ready(5)
        transport = client.transport
        assert isinstance(transport, mc.ZmqTransport)
        loads = [asyncio.ensure_future(transport.admit_frames(ballast(i))) for i in range(4)]
        await asyncio.sleep(0.3)
        await end_stale(end, client, mc.RequestTimeout, 0.5)
        results = await asyncio.wait_for(asyncio.gather(*loads, return_exceptions=True), 3)
        assert all(isinstance(r, mc.ServerUnavailable) for r in results), results
        assert transport.counters["connection_resets"] == 1
        peer.start()  # it reads again: what reached it before the reset, then new requests
        out = await client.admit(request("fresh"), timeout_s=5)
        assert isinstance(out, mc.Materialized)
        await asyncio.sleep(0.3)
        assert "stale" not in peer.rids, peer.rids
        assert peer.rids[-1] == "fresh" and peer.rids.count("fresh") == 1


async def test_a_request_that_provably_left_ends_without_a_reset() -> None:
    """Multiplexed: a reply to a later message proves an earlier one left the socket,
    so cancelling the earlier one resets nothing and the others keep their replies;
    cancelling a request with no such proof resets, and the request the old socket
    had taken ends ServerUnavailable."""
    port = free_port()
    async with (
        peer_on(port, answer=lambda rid: rid.startswith("ok")) as peer,
        zmq_client(port, timeout_s=10) as client,
    ):
        await client.wait_ready(5)
        transport = client.transport
        assert isinstance(transport, mc.ZmqTransport)
        slow = asyncio.ensure_future(client.admit(request("slow-1")))
        await until(lambda: "slow-1" in peer.rids)
        assert (await client.admit(request("ok-1"))).request_id == "ok-1"
        slow.cancel()
        await asyncio.gather(slow, return_exceptions=True)
        assert transport.counters["connection_resets"] == 0

        held = asyncio.ensure_future(client.admit(request("slow-2")))
        last = asyncio.ensure_future(client.admit(request("slow-3")))
        await until(lambda: "slow-3" in peer.rids)
        last.cancel()  # nothing after it was answered: it may still be queued
        await asyncio.gather(last, return_exceptions=True)
        with pytest.raises(mc.ServerUnavailable, match="reset"):
            await asyncio.wait_for(held, 2)
        assert transport.counters["connection_resets"] == 1
        assert (await client.admit(request("ok-2"), timeout_s=5)).request_id == "ok-2"


# --------------------------------------------------------------------------- ZMQ: a vanished server


async def test_closed_server_ends_its_requests_at_once() -> None:
    port = free_port()
    async with zmq_client(port, timeout_s=30) as client:
        async with peer_on(port, answer=lambda rid: False) as peer:
            await client.wait_ready(5)
            tasks = [asyncio.ensure_future(client.admit(request(f"held-{i}"))) for i in range(3)]
            await until(lambda: len(peer.rids) == 3)
            t0 = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 3)
        assert all(isinstance(r, mc.ServerUnavailable) for r in results), results
        assert time.monotonic() - t0 < 2
        async with peer_on(port) as later:
            assert (await client.admit(request("fresh"), timeout_s=5)).request_id == "fresh"
            assert later.rids == ["fresh"]


FROZEN_PEER = """
import sys, zmq
ctx = zmq.Context()
r = ctx.socket(zmq.ROUTER)
port = r.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    r.recv_multipart()  # reads, never answers
"""


async def test_frozen_server_ends_its_requests_within_two_heartbeats() -> None:
    """A server process that is stopped (SIGSTOP) keeps its connection open: only the
    ZMTP heartbeat notices, and the request ends ServerUnavailable, not RequestTimeout."""
    proc = subprocess.Popen([sys.executable, "-c", FROZEN_PEER], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(await asyncio.to_thread(proc.stdout.readline))
        async with zmq_client(port, timeout_s=30, heartbeat_s=0.3) as client:
            await client.wait_ready(5)
            task = asyncio.ensure_future(client.admit(request("held")))
            await asyncio.sleep(0.3)
            os.kill(proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(mc.ServerUnavailable):
                await asyncio.wait_for(task, 5)
            assert time.monotonic() - t0 < 1.5
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()


# --------------------------------------------------------------------------- the CLI bench


async def test_bench_against_a_server_that_stops_mid_run() -> None:
    """Server A answers 6 requests, takes 4 more without answering, and goes away;
    server B binds the same port at once and answers everything. The bench ends
    promptly, counts A's 4 as ServerUnavailable, and B receives none of them."""
    port = free_port()
    n, answered, concurrency = 14, 6, 4
    a = await Peer(port, answer=lambda rid: int(rid.rsplit("-", 1)[1]) < answered).bind()
    a.start()
    cmd = [sys.executable, "-m", "mmadmit_client.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MMADMIT_")}
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *cmd, "bench", f"tcp://127.0.0.1:{port}", str(EXAMPLE), "--requests", str(n),
        "--concurrency", str(concurrency), "--timeout", "2", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    b: Peer | None = None
    try:
        await until(lambda: len(a.rids) == answered + concurrency, 15)
        held = set(a.rids[answered:])
        await a.close()
        b = await Peer(port).bind()
        b.start()
        out, err = await asyncio.wait_for(proc.communicate(), 15)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if b is not None:
            await b.close()
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, err.decode()
    doc = json.loads(out)
    assert elapsed < 10, doc
    assert doc["sent"] == n and doc["received"] == answered + len(b.rids), (doc, b.rids)
    assert doc["errors"] == {"ServerUnavailable": n - doc["received"]}, doc
    assert doc["errors"]["ServerUnavailable"] >= concurrency
    assert doc["transport_counters"]["unmatched_replies"] == 0, doc
    assert not held & set(b.rids), (held, b.rids)
    assert len(set(b.rids)) == len(b.rids)


# --------------------------------------------------------------------------- gRPC


class FakeAdmission(pb_grpc.AdmissionServicer):
    def __init__(self) -> None:
        self.rids: list[str] = []

    async def Admit(self, request: pb.AdmitRequest, context: Any) -> pb.AdmitResponse:  # noqa: N802
        self.rids.append(request.request_id)
        ids = request.tokenized.input_ids
        done = pb.MaterializedRequest(input_ids=ids)
        return pb.AdmitResponse(request_id=request.request_id, materialized=done)


@contextlib.asynccontextmanager
async def grpc_server(port: int) -> AsyncIterator[FakeAdmission]:
    server = grpc.aio.server()
    fake = FakeAdmission()
    pb_grpc.add_AdmissionServicer_to_server(fake, server)
    assert server.add_insecure_port(f"127.0.0.1:{port}") == port
    await server.start()
    try:
        yield fake
    finally:
        await server.stop(None)


FAST_RETRY = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
]


@pytest.mark.parametrize("end", ["timeout", "cancel", "close"])
async def test_grpc_call_ended_while_connecting_never_reaches_a_later_server(end: str) -> None:
    """A listener that never speaks HTTP/2 holds the call in the channel (it waits for a
    connection); the call ends; then a real gRPC server takes the port."""
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)
    port = mute.getsockname()[1]
    client = mc.Client(mc.GrpcTransport(f"127.0.0.1:{port}", channel_options=FAST_RETRY))
    await client.open()
    try:
        call = asyncio.ensure_future(client.admit(request("stale"), timeout_s=0.8))
        await asyncio.sleep(0.3)
        assert not call.done()
        if end == "timeout":
            with pytest.raises(mc.RequestTimeout):
                await call
        else:
            await end_call(end, call, client)
        mute.close()
        async with grpc_server(port) as fake:
            if end == "close":
                await asyncio.sleep(0.6)
            else:
                for _ in range(50):  # until the channel has reconnected
                    with contextlib.suppress(mc.ServerUnavailable):
                        out = await client.admit(request("fresh"), timeout_s=2)
                        break
                    await asyncio.sleep(0.1)
                assert out.request_id == "fresh"
            assert "stale" not in fake.rids
            assert fake.rids == ([] if end == "close" else ["fresh"])
    finally:
        mute.close()
        await client.aclose()
