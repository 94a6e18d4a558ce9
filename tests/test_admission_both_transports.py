"""One shared materializer pool behind both transports: back-pressure, cancellation,
drain and metrics, in process (docs/spec/MATERIALIZE.md "Execution", docs/spec/GRPC.md,
docs/spec/WIRE.md reply mode, docs/spec/CLI.md drain semantics).

Contract pinned here:

* the pool is bounded across transports: a burst from gRPC and ZMQ at once, past
  ``--max-inflight``, gets ``OVERLOADED`` for the excess and exactly one outcome
  for every request, none lost, none duplicated; once the work is let go the
  pool is empty;
* cancellation from either side leaves nothing running and nothing held: a ZMQ
  ABORT removes a queued request (``CANCELLED`` reply) and discards a running
  one's result (``CANCELLED`` reply at once, the late result never sent); a gRPC
  call cancelled by its client or past its deadline removes its queued work; the
  ``Abort`` RPC ends a running request ``CANCELLED`` in band; the pool counters
  say which was which;
* while draining, new requests on both transports get ``SHUTTING_DOWN`` at once,
  health is NOT_SERVING, and the work admitted before still gets its outcome;
* ``GET /metrics`` reports what happened; any other path is 404.

The real server wiring runs: ``mmadmit.server.start_server`` on ephemeral ports
with the pool's ``before_run`` hook holding requests whose id starts with
``hold`` (a threading.Event), so queueing is deterministic, never timed. The
clients are the client library's.

Run with: python -m pytest tests/test_admission_both_transports.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio
from client_helpers import build_item, build_request, grpc_admit, grpc_client, zmq_admit, zmq_client
from conftest import CONFIGS, http_get, requests_total, scrape_metrics, until
from mmadmit import native, wire
from mmadmit.config import build_config
from mmadmit.grpc_server import ADMISSION_SERVICE
from mmadmit.model import Item, Modality, MultimodalInputs, Request, Tensor
from mmadmit.pool import MaterializerPool
from mmadmit.server import ServerHandle, shutdown, start_server
from mmadmit_client import Aborted, Client, Materialized, Outcome, RequestTimeout
from mmadmit_client._transports.grpc import LoadBalancing
from mmadmit_client.proto import admission_pb2 as pb
from mmadmit_client.wire import WireFormatError, decode_reply

MODEL = CONFIGS / "qwen3_5.json"
QWEN35_IMAGE = 248056  # Qwen3.5 <|image_pad|>

pytestmark = [
    pytest.mark.skipif(not MODEL.is_file(), reason=f"no model config at {MODEL}"),
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("native_mode"),  # every case with native code on and off
]


# --------------------------------------------------------------------------- fixtures


class Hold:
    """``before_run`` hook: blocks requests whose rid starts with ``hold`` until
    :meth:`release`; :meth:`arm` makes it hold again; raises for a rid that starts
    with ``boom`` (a worker bug: INTERNAL). A held request the test
    never releases fails after ``HOLD_S`` (the worker raises and ``running``
    reports it) instead of quietly going on."""

    HOLD_S = 10.0

    def __init__(self) -> None:
        self._gate = threading.Event()
        self._entered = threading.Semaphore(0)
        self.timed_out: list[str] = []

    def __call__(self, req: Request) -> None:
        if req.rid.startswith("boom"):
            raise RuntimeError("a worker bug (test hook)")  # answered INTERNAL
        if req.rid.startswith("hold"):
            self._entered.release()
            if not self._gate.wait(self.HOLD_S):
                self.timed_out.append(req.rid)
                raise AssertionError(f"{req.rid} was held {self.HOLD_S} s and never released")

    async def wait_entered(self, timeout_s: float = 5.0) -> None:
        """Until a held request is on the worker (a worker is busy with it)."""
        entered = await asyncio.to_thread(self._entered.acquire, True, timeout_s)
        assert entered, f"no worker started a held request within {timeout_s} s"

    def release(self) -> None:
        self._gate.set()

    def arm(self) -> None:
        self._gate.clear()

    @property
    def holding(self) -> bool:
        return not self._gate.is_set()


@dataclass
class Service:
    handle: ServerHandle
    hold: Hold
    grpc: Client
    zmq: Client
    stack: contextlib.AsyncExitStack

    @property
    def pool(self) -> MaterializerPool:
        return self.handle.pool

    async def zmq_client(self) -> Client:
        """One more ZMQ peer (its own DEALER), closed with the service."""
        return await self.stack.enter_async_context(
            zmq_client(self.handle.addresses["zmq"], timeout_s=10)
        )


@contextlib.asynccontextmanager
async def running(*, hook: bool = True, **settings: Any) -> AsyncIterator[Service]:
    """The real server on ephemeral ports, a hold hook, one client per transport.

    ``hook=False``: no hook, so small requests run inline as in production."""
    hold = Hold()
    config = build_config(
        {
            "model": str(MODEL),
            "device": "cpu",
            "grpc_listen": "127.0.0.1:0",
            "zmq_listen": "tcp://127.0.0.1:0",
            "metrics_listen": "127.0.0.1:0",
            "native": "on" if native.enabled() else "off",  # as the native_mode fixture set
            **settings,
        },
        environ={},
    )
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(hold.release)  # whatever fails, never leave a worker blocked
        handle = await start_server(config, stack, before_run=hold if hook else None)
        stack.callback(hold.release)  # LIFO: released before the transports and pool stop
        gc = await stack.enter_async_context(grpc_client(handle.addresses["grpc"]))
        zc = await stack.enter_async_context(zmq_client(handle.addresses["zmq"], timeout_s=10))
        yield Service(handle, hold, gc, zc, stack)
    assert not hold.timed_out, f"held requests were never released: {hold.timed_out}"


# --------------------------------------------------------------------------- requests


def small_request(rid: str) -> Request:
    """Qwen3.5, 40 tokens, one 8x8-patch image (16 placeholders), feature hashed here."""
    ids = np.full(40, 100, np.int64)
    ids[10:26] = QWEN35_IMAGE
    item = Item(
        modality=int(Modality.IMAGE),
        offsets=np.array([[10, 25]], np.int64),
        feature=Tensor.from_numpy(np.arange(64 * 32, dtype=np.float32).reshape(64, 32)),
        side={"image_grid_thw": Tensor.from_numpy(np.array([[1, 8, 8]], np.int64))},
    )
    return Request(rid=rid, input_ids=ids, mm=MultimodalInputs(items=[item]))


def admit_request(rid: str) -> pb.AdmitRequest:
    """The same request as an ``AdmitRequest``, built with the client library."""
    feature = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    ids = np.full(40, 100, np.int64)
    ids[10:26] = QWEN35_IMAGE
    item = build_item("image", offsets=[(10, 25)], feature=feature, image_grid_thw=[1, 8, 8])
    return build_request(rid, ids, [item])


def code_of(out: Outcome) -> str:
    """``MATERIALIZED`` or the abort code, for either transport's outcome."""
    return out.code


def rid_of(out: Outcome) -> str:
    return out.request_id


class RawPeer:
    """A plain DEALER (no ``ZMQ_IMMEDIATE``) for the drain test: its replies survive the
    server closing the connection right after sending them (the server's contract,
    pinned without the client library; see ``test_server_lifecycle.py``,
    ``test_zmq_client_keeps_replies_received_before_the_server_closed``)."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    async def send(self, req: Request) -> None:
        await self.sock.send_multipart([b"\x00", *wire.encode_request(req)], copy=False)

    async def reply(self, timeout_s: float = 5.0) -> Outcome:
        frames = await asyncio.wait_for(self.sock.recv_multipart(copy=False), timeout_s)
        _, out = decode_reply(frames)
        assert not isinstance(out, WireFormatError), out
        return out

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# --------------------------------------------------------------------------- metrics


async def scrape(svc: Service) -> dict[str, float]:
    return await scrape_metrics(svc.handle.addresses["metrics"])


def outcomes(m: dict[str, float], code: str) -> float:
    """``mmadmit_requests_total`` of ``code`` (``OK``: materialized), all transports."""
    return requests_total(m, code=code)


# --------------------------------------------------------------------------- back-pressure


async def test_burst_from_both_transports_one_outcome_each() -> None:
    """workers=1, max_inflight=2, one held request on the worker: a burst of 25 ZMQ
    (5 peers) + 25 gRPC requests at once. Exactly one is admitted (queued), 49 are
    OVERLOADED at once; after the release both admitted ones are materialized."""
    async with running(workers=1, max_inflight=2) as svc:
        held = asyncio.ensure_future(zmq_admit(svc.zmq, small_request("hold-0")))
        await svc.hold.wait_entered()
        peers = [await svc.zmq_client() for _ in range(5)]
        calls = [zmq_admit(peers[i % 5], small_request(f"z{i}")) for i in range(25)]
        calls += [grpc_admit(svc.grpc, admit_request(f"g{i}"), timeout=10) for i in range(25)]
        burst = [asyncio.ensure_future(c) for c in calls]
        try:
            await until(lambda: sum(t.done() for t in burst) == 49)
            # the one admitted request is queued behind the held one: in flight, unanswered
            assert svc.pool.inflight == 2 and svc.pool.queued == 1 and svc.pool.running == 1
            m = await scrape(svc)
            assert m["mmadmit_inflight"] == 2
            assert m["mmadmit_queue_depth"] == 1
            assert m["mmadmit_running"] == 1
            assert outcomes(m, "OVERLOADED") == 49
            assert m["mmadmit_admitted_total"] == 3  # warm-up, hold-0, the queued one
            svc.hold.release()
            outs = await asyncio.wait_for(asyncio.gather(*burst), 10)
        finally:
            for task in burst:
                task.cancel()
            await asyncio.gather(*burst, return_exceptions=True)
        assert code_of(await held) == "MATERIALIZED"
        sent = [f"z{i}" for i in range(25)] + [f"g{i}" for i in range(25)]
        assert [rid_of(o) for o in outs] == sent  # each call got its own request's outcome
        codes = [code_of(o) for o in outs]
        assert codes.count("OVERLOADED") == 49 and codes.count("MATERIALIZED") == 1, codes
        await until(lambda: svc.pool.inflight == 0)
        await asyncio.sleep(0.2)  # a duplicate reply would arrive now
        assert all(c.transport.counters["unmatched_replies"] == 0 for c in [svc.zmq, *peers])
        assert svc.handle.zmq.stats.received == 26 and svc.handle.zmq.output.stats.replied == 26
        assert svc.handle.grpc.stats.requests == 25
        stats = svc.pool.stats
        assert (stats.admitted, stats.completed) == (3, 3)  # warm-up, hold-0, the queued one
        zstats = svc.handle.zmq.admissions.stats
        gstats = svc.handle.grpc.servicer.admissions.stats
        assert zstats.materialized + gstats.materialized == 2  # each outcome counted once
        assert (zstats.aborted_by_code["OVERLOADED"] + gstats.aborted_by_code["OVERLOADED"]
                == 49)  # fmt: skip
        m = await scrape(svc)
        assert m["mmadmit_inflight"] == 0 and m["mmadmit_queue_depth"] == 0
        assert outcomes(m, "OVERLOADED") == 49
        assert outcomes(m, "OK") == 2
        assert m["mmadmit_zmq_replied_total"] == 26 and m["mmadmit_grpc_requests_total"] == 25


# --------------------------------------------------------------------------- cancellation


async def test_cancellation_from_each_transport_leaves_nothing_behind() -> None:
    async with running(workers=1, max_inflight=8) as svc:
        pool, zc, gc = svc.pool, svc.zmq, svc.grpc
        servicer_stats, zstats = svc.handle.grpc.stats, svc.handle.zmq.stats

        # A request held on the worker; everything below queues behind it.
        hold_z = asyncio.ensure_future(zmq_admit(zc, small_request("hold-z")))
        await svc.hold.wait_entered()
        assert pool.inflight == 1

        # ZMQ ABORT of a queued request: removed from the queue, CANCELLED reply.
        queued_z = asyncio.ensure_future(zmq_admit(zc, small_request("queued-z")))
        await until(lambda: pool.inflight == 2)
        await zc.abort("queued-z")
        out = await asyncio.wait_for(queued_z, 5)
        assert (out.request_id, out.code) == ("queued-z", "CANCELLED")
        assert pool.inflight == 1 and pool.stats.cancelled_queued == 1

        # gRPC client-side cancellation of a queued call: its work is removed.
        queued_g = asyncio.ensure_future(grpc_admit(gc, admit_request("queued-g")))
        await until(lambda: pool.inflight == 2)
        queued_g.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued_g
        await until(lambda: pool.inflight == 1)
        await until(lambda: servicer_stats.calls_cancelled == 1)
        assert pool.stats.cancelled_queued == 2

        # gRPC deadline of a queued call: same.
        with pytest.raises(RequestTimeout):
            await grpc_admit(gc, admit_request("deadline-g"), timeout=0.3)
        await until(lambda: pool.inflight == 1 and servicer_stats.calls_cancelled == 2)
        assert pool.stats.cancelled_queued == 3

        # ZMQ ABORT of the running request: CANCELLED at once, while still on the worker.
        await zc.abort("hold-z")
        out = await asyncio.wait_for(hold_z, 5)
        assert (out.request_id, out.code) == ("hold-z", "CANCELLED")
        assert svc.hold.holding and pool.inflight == 1  # still holds its worker
        assert pool.stats.discarded_running == 1
        svc.hold.release()
        await until(lambda: pool.inflight == 0)
        await asyncio.sleep(0.2)  # its late result is discarded, never sent
        assert zc.transport.unmatched_replies == 0

        # The gRPC Abort RPC of a running request: CANCELLED in band.
        svc.hold.arm()
        hold_g = asyncio.ensure_future(grpc_admit(gc, admit_request("hold-g")))
        await svc.hold.wait_entered()
        assert await gc.abort("hold-g", reason="user left") is True
        out = await asyncio.wait_for(hold_g, 5)
        assert isinstance(out, Aborted) and out.code == "CANCELLED", out
        assert "user left" in out.message
        assert await gc.abort("hold-g") is False  # no longer in flight
        assert svc.hold.holding and pool.inflight == 1
        svc.hold.release()
        await until(lambda: pool.inflight == 0)

        # Nothing running, nothing held, and the counters tell the story.
        assert (pool.inflight, pool.queued, pool.running) == (0, 0, 0)
        assert svc.handle.grpc.servicer.inflight_ids == frozenset()
        assert svc.handle.zmq.inflight == 0
        stats = pool.stats
        assert (stats.cancelled_queued, stats.discarded_running) == (3, 2)
        g_outcomes = svc.handle.grpc.servicer.admissions.stats
        z_outcomes = svc.handle.zmq.admissions.stats
        assert g_outcomes.aborted_by_code == {"CANCELLED": 3}  # 2 calls gone, 1 Abort RPC
        assert z_outcomes.aborted_by_code == {"CANCELLED": 2}  # the ABORTs
        assert g_outcomes.materialized == z_outcomes.materialized == 0
        assert servicer_stats.aborts_requested == 1 and servicer_stats.calls_cancelled == 2
        assert zstats.cancelled_by_peer == 2 and svc.handle.zmq.output.stats.replied == 2
        m = await scrape(svc)
        assert m["mmadmit_cancelled_queued_total"] == 3
        assert m["mmadmit_discarded_running_total"] == 2
        assert outcomes(m, "CANCELLED") == 5
        assert m["mmadmit_inflight"] == 0
        # and both transports still serve
        assert (await zmq_admit(zc, small_request("after-z"))).materialized
        assert isinstance(await grpc_admit(gc, admit_request("after-g"), timeout=10), Materialized)


# --------------------------------------------------------------------------- drain


async def test_drain_refuses_new_work_and_finishes_admitted_work() -> None:
    """``shutdown(handle)`` while a ZMQ request is held on the worker and a gRPC call is
    queued: new requests on both transports get SHUTTING_DOWN at once, health is
    NOT_SERVING, and after the release both admitted requests are materialized."""
    async with running(workers=1, max_inflight=4, drain_timeout=10) as svc:
        pool, gc = svc.pool, svc.grpc
        peer = RawPeer(svc.handle.addresses["zmq"])
        stopping: asyncio.Future[None] | None = None
        try:
            await peer.send(small_request("hold-d"))
            await svc.hold.wait_entered()
            queued = asyncio.ensure_future(grpc_admit(gc, admit_request("queued-d"), timeout=20))
            await until(lambda: pool.inflight == 2)
            assert await gc.health() == "SERVING"

            stopping = asyncio.ensure_future(shutdown(svc.handle))
            await until(lambda: pool.draining)
            late_z = await zmq_admit(svc.zmq, small_request("late-z"), timeout_s=5)
            await peer.send(small_request("late-z2"))
            late_z2 = await peer.reply(5)
            late_g = await grpc_admit(gc, admit_request("late-g"), timeout=5)
            # answered while the held work still holds the worker: not queued behind it
            assert svc.hold.holding and pool.inflight == 2 and not queued.done()
            assert svc.hold.timed_out == []
            assert (late_z.request_id, late_z.code) == ("late-z", "SHUTTING_DOWN")
            assert (late_z2.request_id, late_z2.code) == ("late-z2", "SHUTTING_DOWN")
            assert isinstance(late_g, Aborted) and late_g.code == "SHUTTING_DOWN", late_g
            for name in ("", ADMISSION_SERVICE):
                assert await gc.health(name, timeout_s=2) == "NOT_SERVING"
            # the admitted work is still waiting for the held worker
            assert not queued.done() and not stopping.done()
            svc.hold.release()
            held = await peer.reply(5)
            assert (held.request_id, code_of(held)) == ("hold-d", "MATERIALIZED")
            assert code_of(await asyncio.wait_for(queued, 5)) == "MATERIALIZED"
            await asyncio.wait_for(stopping, 10)
        finally:
            svc.hold.release()
            if stopping is not None:
                stopping.cancel()
                await asyncio.gather(stopping, return_exceptions=True)
            peer.close()
        stats = pool.stats
        assert stats.shutdown_aborted == 0
        assert svc.handle.zmq.admissions.stats.aborted_by_code == {"SHUTTING_DOWN": 2}
        assert svc.handle.grpc.servicer.admissions.stats.aborted_by_code == {"SHUTTING_DOWN": 1}
        assert pool.inflight == 0
        assert svc.handle.zmq.output.stats.undeliverable == 0


# --------------------------------------------------------------------------- metrics


async def test_metrics_endpoint_paths() -> None:
    async with running(workers=1, max_inflight=2) as svc:
        address = svc.handle.addresses["metrics"]
        assert (await zmq_admit(svc.zmq, small_request("m-z"))).materialized
        assert isinstance(
            await grpc_admit(svc.grpc, admit_request("m-g"), timeout=10), Materialized
        )
        status, body = await http_get(address, "/metrics?name[]=mmadmit_inflight")
        assert status == 200  # prometheus_client's name filter
        assert "mmadmit_inflight 0.0" in body and "mmadmit_requests" not in body
        status, body = await http_get(address, "/metrics")
        assert status == 200
        assert "# TYPE mmadmit_inflight gauge" in body
        assert "# TYPE mmadmit_requests_total counter" in body
        assert "mmadmit_outcomes" not in body  # the pool counts no outcome (one count each)
        m = await scrape(svc)
        assert m["mmadmit_inflight"] == 0 and m["mmadmit_queue_depth"] == 0
        assert m["mmadmit_max_inflight"] == 2 and m["mmadmit_draining"] == 0
        assert outcomes(m, "OK") == 2  # the warm-up is no transport's request
        assert not [k for k in m if "materialized_total" in k]  # once, as requests_total
        assert m["mmadmit_grpc_requests_total"] == 1 and m["mmadmit_zmq_replied_total"] == 1
        for path in ("/", "/metric", "/metrics/x", "/healthz"):
            assert (await http_get(address, path))[0] == 404, path
        assert (await http_get(address, "/metrics", method="POST"))[0] == 405


async def test_transports_decode_under_the_materializers_limits() -> None:
    """One Limits object for the whole server: a tensor a codec built under it is not
    checked again by the materializer (an identity test), so a second object of
    equal values would make every request's tensors be checked twice."""
    async with running(hook=False, workers=1) as svc:
        limits = svc.pool.materializer.limits
        assert svc.handle.zmq.limits is limits
        out = await zmq_admit(svc.zmq, small_request("lim-z"))
        assert code_of(out) == "MATERIALIZED", out


async def test_small_requests_run_inline_on_both_transports() -> None:
    """With the serve defaults, a small request with its hash supplied is answered
    inline on either transport, and so is one whose small feature must be hashed
    (its hashing is priced by the same estimate: pool.InlineCost). Both give what
    the worker path gives."""

    def hashed(rid: str) -> Request:
        req = small_request(rid)
        assert req.mm is not None
        req.mm.items[0].hash = 0x0123_4567_89AB_CDEF
        req.mm.items[0].feature = None
        return req

    async with running(hook=False, workers=1) as svc:
        assert svc.pool.inline_max_tokens == 16384  # the serve default
        inline_z = await zmq_admit(svc.zmq, hashed("in-z"))
        ids = np.full(40, 100, np.int64)
        ids[10:26] = QWEN35_IMAGE
        item = build_item(
            "image",
            offsets=[(10, 25)],
            image_grid_thw=[1, 8, 8],
            content_hash=0x0123_4567_89AB_CDEF,
        )
        inline_g = await grpc_admit(svc.grpc, build_request("in-g", ids, [item]), timeout=10)
        m = await scrape(svc)
        assert m["mmadmit_inline_total"] == 3  # warm-up + 2
        assert m["mmadmit_zmq_inline_total"] == 1
        hashed_z = await zmq_admit(svc.zmq, small_request("to-hash"))
        assert (await scrape(svc))["mmadmit_inline_total"] == 4  # 8 KiB to hash: inline too
    assert inline_z.materialized and hashed_z.materialized
    assert isinstance(inline_g, Materialized)
    async with running(hook=True, workers=1) as ref:  # the hook turns inline off
        worker_z = await zmq_admit(ref.zmq, hashed("in-z"))
        assert ref.pool.stats.inline == 0
    assert [f.bytes for f in inline_z.frames] == [f.bytes for f in worker_z.frames]


# --------------------------------------------------------------------------- after the loop


def test_work_finishing_after_the_loop_closed_is_dropped_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """What ``mmadmit serve`` does when a drain runs out of time: the running request
    ends SHUTTING_DOWN, the servers stop, the event loop closes, and the worker
    finishes the discarded work afterwards. That late finish must be dropped quietly
    (its outcome was already given), not reported as an error."""
    from mmadmit.errors import AbortCode
    from mmadmit.materializer import Materializer
    from mmadmit.profile import load_profile

    hold = Hold()
    pool = MaterializerPool(
        Materializer(load_profile(str(MODEL))), workers=1, max_inflight=2, before_run=hold
    )

    async def drain_while_running() -> None:
        ticket = pool.submit(small_request("hold-late"))
        await hold.wait_entered()
        assert await pool.drain(0.05) == 1
        out = await ticket.outcome()
        assert out.code is AbortCode.SHUTTING_DOWN  # type: ignore[union-attr]

    try:
        asyncio.run(drain_while_running())  # the loop is closed now; the worker still holds
        with caplog.at_level(logging.WARNING):
            hold.release()
            pool.close()
            pool._executor.shutdown(wait=True)  # the worker has finished the request
    finally:
        hold.release()
        pool.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


async def test_admitted_requests_are_freed_by_refcount_not_left_to_the_cyclic_gc() -> None:
    """A materialized request's objects (request, items, outcome, ticket) must be
    freed as soon as the reply is out: a reference cycle through the pool's future
    or a raised-and-stored zmq.Again once kept each one alive until the cyclic GC
    ran, which cost ~10% of a ZMQ request's time in collections."""
    import gc

    async with running() as svc:
        for i in range(3):  # warm every path once
            await zmq_admit(svc.zmq, small_request(f"w{i}"))
            await grpc_admit(svc.grpc, admit_request(f"wg{i}"), timeout=10)
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for i in range(20):
                assert code_of(await zmq_admit(svc.zmq, small_request(f"z{i}"))) == "MATERIALIZED"
                out = await grpc_admit(svc.grpc, admit_request(f"g{i}"), timeout=10)
                assert code_of(out) == "MATERIALIZED"
            gc.collect()
            leaked = [
                type(o).__name__
                for o in gc.garbage
                if type(o).__name__ in {"Request", "Item", "Materialized", "Ticket", "Tensor"}
            ]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
        assert leaked == [], f"{len(leaked)} objects freed only by the cyclic GC: {leaked[:8]}"


# --------------------------------------------------------------------------- scale-out


async def test_round_robin_client_spreads_calls_over_replicas() -> None:
    """Two replicas behind one target, as a headless Service resolves: ``round_robin``
    sends calls to both; gRPC's default ``pick_first`` sends every call to one."""
    async with running(hook=False) as a, running(hook=False) as b:
        ports = [svc.handle.addresses["grpc"].rpartition(":")[2] for svc in (a, b)]
        target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
        counts = []
        policies: tuple[LoadBalancing, ...] = ("round_robin", "pick_first")
        for policy in policies:
            before = [svc.handle.grpc.stats.requests for svc in (a, b)]
            async with grpc_client(target, load_balancing=policy) as client:
                await client.health(timeout_s=10)  # connected
                for i in range(10):
                    out = await grpc_admit(client, admit_request(f"{policy}-{i}"), timeout=10)
                    assert isinstance(out, Materialized)
            after = [svc.handle.grpc.stats.requests for svc in (a, b)]
            counts.append([n - m for n, m in zip(after, before, strict=True)])
        # round_robin alternates over the ready subchannels (one may connect a call late)
        assert min(counts[0]) >= 3 and sum(counts[0]) == 10, counts
        assert sorted(counts[1]) == [0, 10], counts
