"""The ZMQ msgpack ingest (docs/spec/WIRE.md) against real sockets on ephemeral loopback ports.

Contract pinned here:

* every wire vector sent through a DEALER comes back exactly as the reference
  materialized it (padded and unpadded ids, pad values, hashes, offsets,
  positions, delta; the error vector as an ``INVALID_REQUEST`` abort), in reply
  mode and in forward mode (a PULL plays the scheduler);
* many concurrent peers: every ADD gets exactly one reply, matched by rid;
* every kind of bad input gets one aborted reply (rid when recoverable, else
  ``""``) and the service keeps serving;
* ABORT cancels a queued and a running request with exactly one ``CANCELLED``
  reply each; request ids are scoped per peer (duplicate in flight refused,
  same id from two peers fine); forward mode sends the marked ADD before the
  ABORT; ``OVERLOADED``, ``SHUTTING_DOWN`` while draining; undeliverable replies
  are retried then counted; forward back-pressure stops intake and loses
  nothing; features of >= 1 MiB leave from the very buffers they arrived in.

Small requests run inline (the pool's ``inline_max_tokens``): the vector,
concurrency and bad-input tests run both ways and must give the same bytes;
an ABORT naming a request already answered inline is ignored (forwarded after
its ADD in forward mode). The intake watchdog is off in every test, so a lost
``ZMQ_FD`` wake-up shows as a stall; one test loses a wake-up on purpose and
sees the watchdog recover it.

Everything is real: ``MaterializerPool`` + ``Materializer`` behind
``ZmqIngest`` on ``tcp://127.0.0.1:0``, the client library (a
``mmadmit_client.Client`` over a ``ZmqTransport``) or raw DEALER / PULL
sockets in front; workers are
held deterministically with the pool's ``before_run`` hook (a pool with the
hook never runs inline). Fixtures close every socket, context, ingest and pool.

Run with: python -m pytest tests/test_zmq_ingest.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from client_helpers import served, zmq_admit, zmq_client
from conftest import (
    FAMILY_CONFIG,
    Service,
    Sockets,
    Vector,
    config_for_family,
    free_port,
    load_vector,
    until,
    vector_names,
)
from mmadmit import wire
from mmadmit.limits import Limits
from mmadmit.materializer import Materializer
from mmadmit.model import Item, Modality, MultimodalInputs, Request, Tensor
from mmadmit.pool import MaterializerPool
from mmadmit.profile import load_profile
from mmadmit.zmq_ingest import ZmqIngest
from mmadmit.zmq_output import Forward, Reply
from mmadmit.zsock import CutMessage, recv_now, send_now
from mmadmit_client import (
    Aborted,
    BlockingClient,
    ClientState,
    ClientStateError,
    Outcome,
    RequestTimeout,
    ServerUnavailable,
    ZmqTransport,
)
from mmadmit_client import wire as client_wire

# every case with native code on and off (conftest.native_mode)
pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("native_mode")]

VECTORS = vector_names()
needs_vectors = pytest.mark.skipif(not VECTORS, reason="no wire vectors (set MMADMIT_VECTORS)")
QWEN35_IMAGE = 248056  # Qwen3.5 <|image_pad|>
SMALL = "qwen3_5_smg_style"  # a small good request (1.8 KB)


# --------------------------------------------------------------------------- fixtures


Factory = Callable[..., Any]


def dealer(net: Sockets, endpoint: str, identity: bytes | None = None) -> zmq.asyncio.Socket:
    sock = net.socket(zmq.DEALER)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(endpoint)
    return sock


async def pull_at(
    net: Sockets, endpoint: str = "tcp://127.0.0.1:0"
) -> tuple[zmq.asyncio.Socket, str]:
    sock = net.socket(zmq.PULL)
    sock.bind(endpoint)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def recv(sock: zmq.asyncio.Socket, timeout_s: float = 5.0) -> list[zmq.Frame]:
    return await asyncio.wait_for(sock.recv_multipart(copy=False), timeout_s)


async def silent(sock: zmq.asyncio.Socket, for_s: float = 0.3) -> bool:
    """True when nothing arrives on ``sock`` for ``for_s`` seconds."""
    return not await sock.poll(int(for_s * 1000))


def as_outcome(frames: list[zmq.Frame]) -> Outcome:
    from mmadmit_client.wire import WireFormatError, decode_reply

    _, result = decode_reply(frames)
    assert not isinstance(result, WireFormatError), result
    return result


def forwarded(frames: list[zmq.Frame]) -> tuple[str, Any]:
    """A message the PUSH sent: ("ADD", Request) or ("ABORT", [rids])."""
    msg = wire.decode_message(frames)
    if msg.kind == wire.MSG_ADD:
        return "ADD", msg.request
    return "ABORT", msg.abort_rids


# --------------------------------------------------------------------------- requests


def request_of(v: Vector, rid: str | None = None) -> Request:
    req = wire.decode_message(v.frames).request
    assert req is not None
    return req if rid is None else dataclasses.replace(req, rid=rid)


def frames_of(v: Vector, rid: str) -> list[Any]:
    return [b"\x00", *wire.encode_request(request_of(v, rid))]


def image_request(rid: str, feature_bytes: int, *, with_hash: bool = False) -> Request:
    """A Qwen3.5 request with one 8x8-patch image whose float32 feature is
    ``feature_bytes`` long (an aux frame on the wire)."""
    ids = np.full(40, 100, np.int64)
    ids[10:26] = QWEN35_IMAGE  # 1*8*8 / merge^2 = 16 placeholders
    feature = np.arange(feature_bytes // 4, dtype=np.float32).reshape(-1, 256)
    item = Item(
        modality=int(Modality.IMAGE),
        hash=0xDEADBEEF if with_hash else None,
        offsets=np.array([[10, 25]], np.int64),
        feature=Tensor.from_numpy(feature),
        side={"image_grid_thw": Tensor.from_numpy(np.array([[1, 8, 8]], np.int64))},
    )
    return Request(rid=rid, input_ids=ids, mm=MultimodalInputs(items=[item]))


def assert_matches_vector(req: Request, v: Vector) -> None:
    """The decoded reply equals the reference materialization of ``v``."""
    a = v.arrays
    np.testing.assert_array_equal(req.input_ids, a["input_ids_padded"])
    if req.input_ids_unpadded is None:  # text: passed through unchanged (rule 1)
        np.testing.assert_array_equal(req.input_ids, a["input_ids_unpadded"])
    else:
        np.testing.assert_array_equal(req.input_ids_unpadded, a["input_ids_unpadded"])
    assert req.validation_error is None
    if "item_pad_values" not in a:
        assert req.mm is None or not req.mm.items
        return
    assert req.mm is not None
    items = req.mm.items
    assert [it.pad_value if it.pad_value is not None else -1 for it in items] == a[
        "item_pad_values"
    ].tolist()
    for it, want, none in zip(
        items, a["item_hashes"].tolist(), a["item_hash_is_none"].tolist(), strict=True
    ):
        assert (it.hash is None) if none else (it.hash == want)
    rows = [[i, int(s), int(e)] for i, it in enumerate(items) for s, e in it.offsets.tolist()]
    assert sorted(rows) == sorted(a["item_offsets"].tolist())
    assert req.mm.mrope_positions is not None and req.mm.mrope_position_delta is not None
    np.testing.assert_array_equal(req.mm.mrope_positions.to_numpy(), a["mrope_positions"])
    np.testing.assert_array_equal(req.mm.mrope_position_delta.to_numpy(), a["mrope_position_delta"])
    assert req.mm.mrope_position_delta_scalar == int(a["mrope_position_delta"].reshape(-1)[0])


def assert_error_vector(code: str | None, req: Request, v: Vector) -> None:
    assert v.error is not None
    assert code == "INVALID_REQUEST"
    assert req.validation_error is not None and req.validation_error.startswith("INVALID_REQUEST: ")
    assert req.rid == request_of(v).rid
    assert all(it.feature is None for it in (req.mm.items if req.mm else []))  # features removed


# --------------------------------------------------------------------------- vectors


INLINE = pytest.mark.parametrize("inline", [0, 16384], ids=["workers", "inline"])


def expected_inline(svc: Service, requests: list[Request]) -> int:
    return sum(svc.pool.runs_inline(r) for r in requests)


@needs_vectors
@pytest.mark.parametrize("name", VECTORS)
@INLINE
async def test_vector_reply_mode(service: Factory, name: str, inline: int) -> None:
    v = load_vector(name)
    svc = await service(v.meta["family"], inline_max_tokens=inline)
    async with zmq_client(svc.endpoint, timeout_s=10) as client:
        outcome = await zmq_admit(client, v.frames)  # the captured bytes, unchanged
    assert outcome.request_id == request_of(v).rid
    if v.error:
        assert not outcome.materialized
        assert_error_vector(outcome.code, served(outcome), v)
    else:
        assert outcome.materialized, outcome.message
        assert_matches_vector(served(outcome), v)
        # aux frames keep their indices; feature bytes come back untouched
        for i, sent in enumerate(v.frames[2:], start=2):
            assert outcome.frames[i].bytes == bytes(sent)
    assert svc.ingest.output.stats.replied == 1
    assert svc.ingest.stats.inline == svc.pool.stats.inline == expected_inline(svc, [request_of(v)])
    assert svc.pool.inflight == 0


@needs_vectors
async def test_inline_and_worker_replies_are_the_same_bytes(service: Factory) -> None:
    """Every vector whose request runs inline gets, byte for byte, the reply a
    worker gives it."""
    by_family: dict[str, list[Vector]] = {}
    for name in VECTORS:
        v = load_vector(name)
        by_family.setdefault(v.meta["family"], []).append(v)
    compared = 0
    for family, vectors in sorted(by_family.items()):
        inline = await service(family, inline_max_tokens=1 << 20)
        workers = await service(family)
        async with (
            zmq_client(inline.endpoint, timeout_s=10) as a,
            zmq_client(workers.endpoint, timeout_s=10) as b,
        ):
            for v in vectors:
                got_a, got_b = await zmq_admit(a, v.frames), await zmq_admit(b, v.frames)
                assert [f.bytes for f in got_a.frames] == [f.bytes for f in got_b.frames], v.name
                compared += inline.pool.runs_inline(request_of(v))
        assert inline.ingest.stats.inline == expected_inline(
            inline, [request_of(v) for v in vectors]
        )
        assert workers.ingest.stats.inline == 0
    assert compared > 0


@needs_vectors
@pytest.mark.parametrize("family", sorted(FAMILY_CONFIG))
@INLINE
async def test_vectors_forward_mode(
    service: Factory, zctx: Sockets, family: str, inline: int
) -> None:
    pull, address = await pull_at(zctx)
    svc = await service(family, forward=address, inline_max_tokens=inline)
    vectors = [load_vector(n) for n in VECTORS if load_vector(n).meta["family"] == family]
    sock = dealer(zctx, svc.endpoint)
    for v in vectors:
        await sock.send_multipart(v.frames, copy=False)
    got = {}
    for _ in vectors:
        kind, req = forwarded(await recv(pull))
        assert kind == "ADD"
        got[req.rid] = req
    for v in vectors:
        req = got[request_of(v).rid]
        if v.error:
            code = req.validation_error.partition(":")[0] if req.validation_error else None
            assert_error_vector(code, req, v)
        else:
            assert_matches_vector(req, v)
    assert await silent(sock, 0.1)  # senders get no replies in forward mode
    assert svc.ingest.output.stats.forwarded == len(vectors)
    assert svc.ingest.output.stats.replied == 0
    assert svc.ingest.stats.inline == expected_inline(svc, [request_of(v) for v in vectors])


@needs_vectors
@INLINE
async def test_many_concurrent_peers_one_reply_each(service: Factory, inline: int) -> None:
    """Also the edge-triggered intake under load: with the watchdog off, a wake-up
    lost to a reply send would leave a peer waiting (the test times out)."""
    qwen = [load_vector(n) for n in VECTORS if n.startswith("qwen3_5")]
    svc = await service("qwen3_5", workers=2, max_inflight=512, inline_max_tokens=inline)
    peers, per_peer = 8, 25

    async def run_peer(p: int) -> list[tuple[str, Outcome, Vector]]:
        async with zmq_client(svc.endpoint, timeout_s=20) as client:
            jobs = []
            for i in range(per_peer):
                v = qwen[(p + i) % len(qwen)]
                # the same rids on every peer: ids are scoped per peer
                rid = f"r{i}" if i % 2 else f"p{p}-r{i}"
                jobs.append((rid, v, zmq_admit(client, frames_of(v, rid))))
            outcomes = await asyncio.gather(*(job for _, _, job in jobs))
            assert client.transport.unmatched_replies == 0
            return [(rid, o, v) for (rid, v, _), o in zip(jobs, outcomes, strict=True)]

    results = await asyncio.gather(*(run_peer(p) for p in range(peers)))
    total = 0
    for per in results:
        for rid, outcome, v in per:
            assert outcome.request_id == rid
            assert outcome.materialized, outcome.message
            assert_matches_vector(served(outcome), v)
            total += 1
    assert total == peers * per_peer
    stats, out, outcomes = svc.ingest.stats, svc.ingest.output.stats, svc.ingest.admissions.stats
    assert stats.received == out.replied == outcomes.materialized == total
    assert out.undeliverable == 0 and not outcomes.aborted_by_code
    assert stats.inline == sum(
        svc.pool.runs_inline(request_of(qwen[(p + i) % len(qwen)]))
        for p in range(peers)
        for i in range(per_peer)
    )
    assert svc.pool.inflight == 0


# --------------------------------------------------------------------------- bad input


def _payload_with(v: Vector, index: int, value: Any) -> bytes:
    elems = msgspec.msgpack.decode(bytes(v.frames[1]), type=list[msgspec.Raw])
    elems[index] = msgspec.Raw(msgspec.msgpack.encode(value))
    return msgspec.msgpack.encode(elems)


def _bad_cases() -> dict[str, tuple[Callable[[], list[Any]], str, bool]]:
    """name -> (frames builder, expected code, rid recoverable)."""

    def small() -> Vector:
        return load_vector(SMALL)

    return {
        "bad_type_byte": (lambda: [b"\x07", *small().frames[1:]], "INVALID_REQUEST", True),
        "one_frame": (lambda: [b"\x00"], "INVALID_REQUEST", False),
        "undecodable_msgpack": (lambda: [b"\x00", b"\xc1\xc1\xc1"], "INVALID_REQUEST", False),
        "wrong_tag": (
            lambda: [b"\x00", _payload_with(small(), 0, "SomethingElse"), *small().frames[2:]],
            "INVALID_REQUEST",
            True,
        ),
        "missing_aux_frame": (lambda: small().frames[:-1], "INVALID_REQUEST", True),
        "pickle_ext": (
            lambda: [
                b"\x00",
                _payload_with(small(), 13, msgspec.msgpack.Ext(1, b"x")),
                *small().frames[2:],
            ],
            "INVALID_REQUEST",
            True,
        ),
        "tensor_bytes_mismatch": (
            lambda: [*small().frames[:-1], bytes(small().frames[-1])[:-8]],
            "INVALID_REQUEST",
            True,
        ),
        "over_max_message_bytes": (lambda: load_vector("qwen3_5_image1").frames, "TOO_LARGE", True),
    }


BAD = _bad_cases()


@needs_vectors
@pytest.mark.parametrize("case", sorted(BAD))
@INLINE
async def test_bad_input_is_aborted_and_service_keeps_serving(
    service: Factory, case: str, inline: int
) -> None:
    build, code, recoverable = BAD[case]
    # image1 is 295 KB
    svc = await service("qwen3_5", max_message_bytes=200_000, inline_max_tokens=inline)
    frames = build()
    rid = wire.recover_rid(frames[1]) if recoverable else ""
    async with zmq_client(svc.endpoint, timeout_s=10) as client:
        outcome = await zmq_admit(client, frames)
        assert not outcome.materialized
        assert outcome.code == code, outcome.message
        assert outcome.request_id == rid
        assert rid or not recoverable
        assert served(outcome).validation_error == f"{code}: {outcome.message}"
        good = await zmq_admit(client, load_vector(SMALL).frames)
        assert good.materialized
        assert_matches_vector(served(good), load_vector(SMALL))
    assert svc.ingest.admissions.stats.aborted_by_code == {code: 1}


async def test_malformed_abort_is_dropped_without_reply(service: Factory, zctx: Sockets) -> None:
    svc = await service("llama")
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart([b"\x01", b"\xc1"])  # undecodable
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode([1, 2])])  # not strings
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["a"]), b"extra"])
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["nobody"])])  # unknown: fine
    assert await silent(sock)
    assert svc.ingest.stats.malformed == 3
    assert svc.ingest.stats.aborts_received == 1


# --------------------------------------------------------------------------- ABORT, per-peer ids


@needs_vectors
async def test_abort_cancels_queued_and_running_with_one_reply_each(
    service: Factory, zctx: Sockets
) -> None:
    v = load_vector(SMALL)
    svc = await service("qwen3_5", workers=1)
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(v, "hold-running"), copy=False)
    await until(lambda: svc.gate.started == ["hold-running"])
    await sock.send_multipart(frames_of(v, "hold-queued"), copy=False)
    await until(lambda: svc.pool.inflight == 2)
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["hold-queued", "unknown"])])
    first = as_outcome(await recv(sock))
    assert (first.request_id, first.code) == ("hold-queued", "CANCELLED")
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["hold-running"])])
    second = as_outcome(await recv(sock))
    assert (second.request_id, second.code) == ("hold-running", "CANCELLED")
    assert all(it.feature is None for it in served(second).mm.items)
    svc.gate.open()
    await until(lambda: svc.pool.inflight == 0)
    assert await silent(sock)  # the running one's late result is discarded, not sent
    assert svc.pool.stats.cancelled_queued == 1 and svc.pool.stats.discarded_running == 1
    assert svc.ingest.stats.cancelled_by_peer == 2
    assert svc.ingest.output.stats.replied == 2
    await sock.send_multipart(frames_of(v, "after"), copy=False)
    assert as_outcome(await recv(sock)).materialized


@needs_vectors
async def test_abort_is_scoped_to_its_peer(service: Factory, zctx: Sockets) -> None:
    """docs/spec/WIRE.md: ABORT cancels only the sending peer's requests. Two peers hold the same
    rid (one running, one queued); a third peer's ABORT of that rid and the queued
    owner's ABORT leave the other peer's request alone."""
    v = load_vector(SMALL)
    svc = await service("qwen3_5", workers=1)
    a, b, c = (dealer(zctx, svc.endpoint, name) for name in (b"peer-a", b"peer-b", b"peer-c"))
    await a.send_multipart(frames_of(v, "hold-same"), copy=False)
    await until(lambda: svc.gate.started == ["hold-same"])  # a's is on the worker
    await b.send_multipart(frames_of(v, "hold-same"), copy=False)
    await until(lambda: svc.pool.inflight == 2)  # b's is queued behind it
    abort = [b"\x01", msgspec.msgpack.encode(["hold-same"])]

    await c.send_multipart(abort)  # c has no such request: nothing happens
    await until(lambda: svc.ingest.stats.aborts_received == 1)
    assert svc.pool.inflight == 2 and svc.ingest.inflight == 2
    assert svc.pool.stats.cancelled_queued == 0 and svc.pool.stats.discarded_running == 0

    await b.send_multipart(abort)  # b's own request only: the queued one
    out = as_outcome(await recv(b))
    assert (out.request_id, out.code) == ("hold-same", "CANCELLED")
    assert svc.pool.stats.cancelled_queued == 1 and svc.pool.stats.discarded_running == 0
    assert svc.pool.inflight == 1 and svc.ingest.stats.cancelled_by_peer == 1
    assert await silent(a) and await silent(c)

    svc.gate.open()
    done = as_outcome(await recv(a))
    assert done.request_id == "hold-same" and done.materialized, done.message
    assert await silent(b)  # one reply per request: b already had its CANCELLED
    assert svc.ingest.output.stats.replied == 2


@needs_vectors
@pytest.mark.parametrize("mode", ["reply", "forward"])
async def test_abort_of_a_request_answered_inline(
    service: Factory, zctx: Sockets, mode: str
) -> None:
    """An inline request is answered before its ABORT can arrive: the ABORT finds
    nothing in flight (reply mode: no second reply; forward mode: it follows the
    ADD downstream, as for any finished request)."""
    v = load_vector(SMALL)
    pull, forward = await pull_at(zctx) if mode == "forward" else (None, None)
    svc = await service("qwen3_5", inline_max_tokens=16384, forward=forward)
    assert svc.pool.runs_inline(request_of(v))
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(v, "quick"), copy=False)
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["quick"])])
    if pull is None:
        assert as_outcome(await recv(sock)).materialized
        assert await silent(sock)
    else:
        kind, req = forwarded(await recv(pull))
        assert (kind, req.rid, req.validation_error) == ("ADD", "quick", None)
        assert forwarded(await recv(pull)) == ("ABORT", ["quick"])
    await until(lambda: svc.ingest.stats.aborts_received == 1)
    assert svc.ingest.stats.cancelled_by_peer == 0 and svc.ingest.stats.inline == 1
    assert svc.pool.stats.inline == svc.pool.stats.admitted == svc.pool.stats.completed == 1


@needs_vectors
@pytest.mark.parametrize("watchdog_s", [None, 0.05], ids=["no-watchdog", "watchdog"])
async def test_watchdog_recovers_a_lost_wake_up(
    service: Factory, zctx: Sockets, watchdog_s: float | None
) -> None:
    """``ZMQ_FD`` is edge-triggered: reading ``EVENTS`` consumes its signal. The
    test does that behind the ingest's back while a request waits, so the reader
    never fires: without the watchdog the request stalls, with it it is read."""
    v = load_vector(SMALL)
    svc = await service("qwen3_5", inline_max_tokens=16384, watchdog_s=watchdog_s)
    router = svc.ingest._res.router
    loop, fd = svc.ingest._res.reader
    intake = svc.ingest._res.intake
    assert intake is not None
    await until(lambda: not intake.read_scheduled)  # the start-up read is done
    # Deaf for a moment, the watchdog too: a 50 ms watchdog could otherwise read the
    # message before the test sees it waiting (a flake seen once).
    intake.disarm_watchdog()
    loop.remove_reader(fd)
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(v, "lost"), copy=False)
    await until(lambda: bool(router.getsockopt(zmq.EVENTS) & zmq.POLLIN))  # signal consumed
    loop.add_reader(fd, intake.on_readable)
    intake.arm_watchdog()
    if watchdog_s is None:
        assert await silent(sock, 0.3)  # the lost wake-up is real
        assert svc.ingest.stats.received == 0
        intake.schedule_read()  # release it, so teardown has nothing pending
        assert as_outcome(await recv(sock)).materialized
        assert svc.ingest.stats.watchdog_reads == 0
    else:
        assert as_outcome(await recv(sock)).materialized
        assert svc.ingest.stats.watchdog_reads == 1


@needs_vectors
async def test_duplicate_rid_in_flight_is_refused_first_completes(
    service: Factory, zctx: Sockets
) -> None:
    v = load_vector(SMALL)
    svc = await service("qwen3_5")
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(v, "hold-dup"), copy=False)
    await until(lambda: svc.ingest.inflight == 1)
    await sock.send_multipart(frames_of(v, "hold-dup"), copy=False)
    dup = as_outcome(await recv(sock))
    assert (dup.request_id, dup.code) == ("hold-dup", "INVALID_REQUEST")
    assert "already in flight" in dup.message
    svc.gate.open()
    first = as_outcome(await recv(sock))
    assert first.request_id == "hold-dup" and first.materialized
    assert_matches_vector(served(first), v)
    assert await silent(sock, 0.1)
    assert svc.pool.stats.admitted == 1
    # once answered, the id may be used again
    await sock.send_multipart(frames_of(v, "hold-dup"), copy=False)
    assert as_outcome(await recv(sock)).materialized


@needs_vectors
async def test_same_rid_from_two_peers_both_succeed(service: Factory) -> None:
    v = load_vector(SMALL)
    svc = await service("qwen3_5", workers=2)
    async with (
        zmq_client(svc.endpoint, identity=b"peer-a") as a,
        zmq_client(svc.endpoint, identity=b"peer-b") as b,
    ):
        jobs = [asyncio.ensure_future(zmq_admit(c, frames_of(v, "hold-same"))) for c in (a, b)]
        await until(lambda: len(svc.gate.started) == 2)  # both in flight at once
        svc.gate.open()
        outcomes = await asyncio.gather(*jobs)
    assert [o.code for o in outcomes] == ["MATERIALIZED", "MATERIALIZED"]
    assert all(o.request_id == "hold-same" for o in outcomes)


@needs_vectors
async def test_forward_mode_abort_goes_after_marked_add(service: Factory, zctx: Sockets) -> None:
    v = load_vector(SMALL)
    pull, address = await pull_at(zctx)
    svc = await service("qwen3_5", workers=1, forward=address)
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(v, "hold-running"), copy=False)
    await until(lambda: svc.gate.started == ["hold-running"])
    await sock.send_multipart(frames_of(v, "hold-queued"), copy=False)
    await until(lambda: svc.pool.inflight == 2)
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["hold-queued", "ghost"])])
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["hold-running"])])
    seen = [forwarded(await recv(pull)) for _ in range(4)]
    svc.gate.open()
    order = [(kind, req.rid if kind == "ADD" else tuple(req)) for kind, req in seen]
    for rid, abort_msg in (
        ("hold-queued", ("hold-queued", "ghost")),
        ("hold-running", ("hold-running",)),
    ):
        assert order.index(("ADD", rid)) < order.index(("ABORT", abort_msg)), order
    for kind, req in seen:
        if kind == "ADD":
            assert req.validation_error.startswith("CANCELLED: ")
            assert all(it.feature is None for it in req.mm.items)
    await until(lambda: svc.pool.inflight == 0)
    assert await silent(pull)  # nothing more: the running one's result was discarded
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["ghost-2"])])
    assert forwarded(await recv(pull)) == ("ABORT", ["ghost-2"])  # unknown ids go on
    assert svc.ingest.output.stats.forwarded_aborts == 3


@needs_vectors
async def test_forward_mode_duplicate_goes_after_the_original(
    service: Factory, zctx: Sockets
) -> None:
    v = load_vector(SMALL)
    pull, address = await pull_at(zctx)
    svc = await service("qwen3_5", forward=address)
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(v, "hold-dup"), copy=False)
    await until(lambda: svc.ingest.inflight == 1)
    await sock.send_multipart(frames_of(v, "hold-dup"), copy=False)
    await until(lambda: svc.ingest.stats.received == 2)
    assert await silent(pull, 0.1)  # the refusal waits for the original's ADD
    svc.gate.open()
    first = forwarded(await recv(pull))
    second = forwarded(await recv(pull))
    assert first[1].rid == second[1].rid == "hold-dup"
    assert first[1].validation_error is None
    assert second[1].validation_error.startswith("INVALID_REQUEST: ")


@needs_vectors
async def test_worker_failure_still_gets_exactly_one_reply(service: Factory, zctx: Sockets) -> None:
    svc = await service("qwen3_5")
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(load_vector(SMALL), "boom-1"), copy=False)
    reply = as_outcome(await recv(sock))
    assert (reply.request_id, reply.code) == ("boom-1", "INTERNAL")
    assert await silent(sock, 0.1)
    await sock.send_multipart(frames_of(load_vector(SMALL), "fine"), copy=False)
    assert as_outcome(await recv(sock)).materialized


# --------------------------------------------------------------------------- admission refusals


@needs_vectors
async def test_overloaded_when_pool_full(service: Factory) -> None:
    v = load_vector(SMALL)
    svc = await service("qwen3_5", workers=1, max_inflight=2)
    async with zmq_client(svc.endpoint, timeout_s=10) as client:
        held = [
            asyncio.ensure_future(zmq_admit(client, frames_of(v, f"hold-{i}"))) for i in range(2)
        ]
        await until(lambda: svc.pool.inflight == 2)
        refused = await zmq_admit(client, frames_of(v, "third"))
        assert (refused.request_id, refused.code) == ("third", "OVERLOADED")
        assert not any(job.done() for job in held)
        svc.gate.open()
        assert [o.code for o in await asyncio.gather(*held)] == ["MATERIALIZED"] * 2


# --------------------------------------------------------------------------- limits


@needs_vectors
async def test_too_many_frames_is_too_large_and_the_rest_is_released(
    service: Factory, zctx: Sockets
) -> None:
    """A message over --max-frames keeps only its first frames; the ADD is answered
    TOO_LARGE with its rid, an ABORT is dropped, and the service keeps serving."""
    v = load_vector(SMALL)
    good = frames_of(v, "within")
    svc = await service("qwen3_5", max_frames=len(good), inline_max_tokens=1 << 20)
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(good, copy=False)
    assert as_outcome(await recv(sock)).materialized
    # exactly one frame past the limit: refused, though every frame is well formed
    one_over = [*frames_of(v, "one-over"), b""]
    assert len(one_over) == len(good) + 1
    await sock.send_multipart(one_over, copy=False)
    reply = as_outcome(await recv(sock))
    assert (reply.request_id, reply.code) == ("one-over", "TOO_LARGE")
    assert svc.ingest.admissions.stats.aborted_by_code == {"TOO_LARGE": 1}
    over = [*frames_of(v, "many"), *([b"x" * 10] * 500)]
    before = svc.ingest.stats.received_bytes
    await sock.send_multipart(over, copy=False)
    reply = as_outcome(await recv(sock))
    assert (reply.request_id, reply.code) == ("many", "TOO_LARGE")
    assert f"message of {len(over)} frames exceeds the limit of {len(good)}" in reply.message
    assert "--max-frames" in reply.message
    # every byte is counted though only the first frames were kept
    assert svc.ingest.stats.received_bytes - before == sum(len(bytes(f)) for f in over[1:]) + 1
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["x"]), *([b""] * len(good))])
    assert await silent(sock, 0.2)
    await sock.send_multipart(frames_of(v, "after"), copy=False)
    assert as_outcome(await recv(sock)).materialized


@needs_vectors
async def test_codec_limits_are_the_ingests(service: Factory, zctx: Sockets) -> None:
    """The ingest decodes with its ``limits``: a breach is answered with its code."""
    v = load_vector(SMALL)
    n = len(request_of(v).input_ids)
    svc = await service("qwen3_5", limits=Limits(max_tokens=n - 1, max_abort_ids=2))
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames_of(v, "long"), copy=False)
    reply = as_outcome(await recv(sock))
    assert (reply.request_id, reply.code) == ("long", "TOO_LARGE")
    expected = f"input_ids: {n} tokens exceed the limit of {n - 1} (--max-tokens)"
    assert reply.message == expected
    # an ABORT over --max-abort-ids is dropped: it cancels nothing
    svc.gate.open()
    assert svc.ingest.stats.aborts_received == 0
    await sock.send_multipart([b"\x01", msgspec.msgpack.encode(["a", "b", "c"])])
    assert await silent(sock, 0.2)
    stats = svc.ingest.stats  # a dropped ABORT counts as malformed, an ADD by its code
    codes = svc.ingest.admissions.stats.aborted_by_code
    assert (stats.malformed, stats.aborts_received, codes) == (
        1, 0, {"TOO_LARGE": 1}
    )  # fmt: skip


@needs_vectors
async def test_one_peer_cannot_take_the_whole_pool(service: Factory, zctx: Sockets) -> None:
    """--max-peer-inflight: a peer's next request past it is OVERLOADED, another peer's
    is admitted; the count goes down as outcomes are sent."""
    v = load_vector(SMALL)
    svc = await service("qwen3_5", workers=1, max_inflight=8, max_peer_inflight=2)
    greedy, other = dealer(zctx, svc.endpoint, b"greedy"), dealer(zctx, svc.endpoint, b"other")
    for i in range(2):
        await greedy.send_multipart(frames_of(v, f"hold-{i}"), copy=False)
    await until(lambda: svc.ingest.inflight == 2)
    await greedy.send_multipart(frames_of(v, "third"), copy=False)
    reply = as_outcome(await recv(greedy))
    assert (reply.request_id, reply.code) == ("third", "OVERLOADED")
    assert "2 requests in flight" in reply.message
    assert "--max-peer-inflight" in reply.message
    await other.send_multipart(frames_of(v, "hold-other"), copy=False)
    await until(lambda: svc.ingest.inflight == 3)  # admitted, not refused
    svc.gate.open()
    got = sorted([as_outcome(await recv(greedy)).request_id for _ in range(2)])
    assert got == ["hold-0", "hold-1"]
    assert as_outcome(await recv(other)).materialized
    await until(lambda: not svc.ingest.admissions._peer_counts)  # nothing kept per peer once idle
    await greedy.send_multipart(frames_of(v, "again"), copy=False)
    assert as_outcome(await recv(greedy)).materialized


@needs_vectors
async def test_draining_answers_shutting_down_and_finishes_in_flight(service: Factory) -> None:
    v = load_vector(SMALL)
    svc = await service("qwen3_5")
    async with zmq_client(svc.endpoint, timeout_s=10) as client:
        held = asyncio.ensure_future(zmq_admit(client, frames_of(v, "hold-before")))
        await until(lambda: svc.pool.inflight == 1)
        svc.pool.begin_drain()
        late = await zmq_admit(client, frames_of(v, "late"))
        assert (late.request_id, late.code) == ("late", "SHUTTING_DOWN")
        svc.gate.open()
        assert (await held).materialized
        assert await svc.pool.drain(1.0) == 0
    await svc.ingest.stop(1.0)
    await svc.ingest.stop(1.0)  # idempotent
    assert svc.ingest.output.stats.undeliverable == 0


# --------------------------------------------------------------------------- delivery


@needs_vectors
async def test_reply_to_gone_peer_is_retried_then_undeliverable(
    service: Factory, zctx: Sockets
) -> None:
    svc = await service("qwen3_5", send_timeout_s=0.3)
    router = svc.ingest._res.router
    monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        sock = dealer(zctx, svc.endpoint)
        await sock.send_multipart(frames_of(load_vector(SMALL), "hold-gone"), copy=False)
        await until(lambda: svc.ingest.inflight == 1)
        sock.close(linger=0)
        await recv(monitor)  # the ROUTER saw the peer go: its identity is now unroutable
    finally:
        router.disable_monitor()
        monitor.close(linger=0)
    svc.gate.open()
    await until(lambda: svc.ingest.output.stats.undeliverable == 1)
    assert svc.ingest.output.stats.send_retries > 0
    assert svc.ingest.output.stats.replied == 0


@needs_vectors
@INLINE
async def test_forward_back_pressure_stops_intake_and_drops_nothing(
    service: Factory, zctx: Sockets, inline: int
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"  # nobody listens there yet
    v = load_vector(SMALL)
    svc = await service(
        "qwen3_5", forward=address, max_pending_forwards=3, inline_max_tokens=inline
    )
    sock = dealer(zctx, svc.endpoint)
    n = 20
    for i in range(3):
        await sock.send_multipart(frames_of(v, f"bp-{i}"), copy=False)
    await until(lambda: svc.ingest.stats.received == 3)
    woken = svc.ingest.stats.wakeups
    late = dealer(zctx, svc.endpoint)  # a peer connecting signals the ROUTER too
    for i in range(3, n):  # these arrive while intake waits for room
        await (sock if i % 2 else late).send_multipart(frames_of(v, f"bp-{i}"), copy=False)
    await asyncio.sleep(0.3)
    assert svc.ingest.stats.received == 3  # intake waits for the downstream
    # ... without spinning: the waiting input does not wake the loop on every turn
    assert svc.ingest.stats.wakeups - woken < 50
    pull, _ = await pull_at(zctx, address)  # the scheduler appears
    rids = []
    for _ in range(n):
        kind, req = forwarded(await recv(pull))
        assert kind == "ADD" and req.validation_error is None
        rids.append(req.rid)
    assert sorted(rids) == sorted(f"bp-{i}" for i in range(n))
    assert svc.ingest.output.stats.forwarded == n and svc.ingest.output.stats.undeliverable == 0


@needs_vectors
async def test_forward_stop_counts_undelivered(service: Factory, zctx: Sockets) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    svc = await service("qwen3_5", forward=address)
    sock = dealer(zctx, svc.endpoint)
    for i in range(2):
        await sock.send_multipart(frames_of(load_vector(SMALL), f"lost-{i}"), copy=False)
    await until(lambda: svc.ingest.admissions.stats.materialized == 2)
    await svc.ingest.stop(0.2)
    assert svc.ingest.output.stats.undeliverable == 2 and svc.ingest.output.stats.forwarded == 0


# --------------------------------------------------------------------------- raw send / recv


def test_send_now_and_recv_now_move_whole_messages() -> None:
    """zsock's sends and receives past pyzmq's Python layer keep its contract: a
    message arrives whole, a part that is no buffer is refused before any part
    leaves (never a half-sent message), a long one is cut at ``max_frames`` with
    the rest counted, and nothing waiting is zmq.Again."""
    ctx = zmq.Context()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    try:
        pull.bind("inproc://raw-send-recv")
        push.connect("inproc://raw-send-recv")
        with pytest.raises(zmq.Again):
            recv_now(pull)
        big = np.arange(20_000, dtype=np.int64)  # over pyzmq's copy threshold: zero-copy
        parts = [b"\x00", b"", memoryview(b"mid"), zmq.Frame(b"frame"), big]
        send_now(push, parts)
        with pytest.raises(TypeError):
            send_now(push, [b"a", b"b", object()])
        send_now(push, [b"after"])
        assert pull.poll(5000)
        got = recv_now(pull)
        assert [f.bytes for f in got[:4]] == [b"\x00", b"", b"mid", b"frame"]
        assert np.array_equal(np.frombuffer(got[4].buffer, np.int64), big)
        assert [f.bytes for f in recv_now(pull)] == [b"after"]  # nothing of the refused one
        send_now(push, [b"%d" % i for i in range(7)])
        assert pull.poll(5000)
        cut = recv_now(pull, max_frames=3)
        assert isinstance(cut, CutMessage) and [f.bytes for f in cut] == [b"0", b"1", b"2"]
        assert (cut.total_frames, cut.total_bytes) == (7, 7)
        send_now(push, [b"x", b"y", b"z"])
        assert pull.poll(5000)
        exact = recv_now(pull, max_frames=3)
        assert not isinstance(exact, CutMessage) and [f.bytes for f in exact] == [b"x", b"y", b"z"]
        with pytest.raises(zmq.Again):
            recv_now(pull)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------- zero-copy


@pytest.mark.parametrize("mode", ["reply", "forward"])
async def test_large_features_leave_from_the_received_buffers(
    service: Factory, zctx: Sockets, mode: str
) -> None:
    sent: list[list[Any]] = []
    forward = None
    if mode == "forward":
        pull, forward = await pull_at(zctx)
    svc = await service("qwen3_5", forward=forward, sent_hook=sent.append)
    request = image_request("big", 3 << 19)  # 1.5 MiB feature
    frames = [b"\x00", *wire.encode_request(request)]
    feature_bytes = bytes(request.mm.items[0].feature.data)
    sock = dealer(zctx, svc.endpoint)
    await sock.send_multipart(frames, copy=False)
    if mode == "reply":
        got = await recv(sock)
        assert got[0].bytes == b"\x00"
    else:
        got = await recv(pull)
        assert got[0].bytes == b"\x00"
    # what the worker was handed: the feature is a view on the received zmq.Frame
    (decoded,) = svc.gate.seen
    data = decoded.mm.items[0].feature.data
    assert isinstance(data.obj, zmq.Frame)
    frame_addr = np.frombuffer(data.obj.buffer, np.uint8).__array_interface__["data"][0]
    assert np.frombuffer(data, np.uint8).__array_interface__["data"][0] == frame_addr
    # what went to libzmq: that very zmq.Frame (libzmq shares the received message)
    (out,) = sent
    assert sum(f is data.obj for f in out) == 1
    # and the peer got the bytes intact
    reply = wire.decode_request(got[1], got[2:])
    assert bytes(reply.mm.items[0].feature.data) == feature_bytes
    assert reply.mm.items[0].pad_value is not None


# --------------------------------------------------------------------------- lifecycle, client


async def test_start_failure_releases_everything(zctx: Sockets) -> None:
    pool = MaterializerPool(Materializer(load_profile(str(config_for_family("llama")))), workers=1)
    try:
        blocker, taken = await pull_at(zctx)
        busy = ZmqIngest(pool, listen=taken, max_message_bytes=1 << 20)
        with pytest.raises(OSError, match="cannot bind ZMQ"):
            await busy.start()  # address in use: an operator error (serve exits 2)
        await busy.stop(0.1)
        # half-way: the ROUTER binds, then the PUSH address is unusable
        half = ZmqIngest(
            pool, Forward("nonsense://x"), listen="tcp://127.0.0.1:0", max_message_bytes=1 << 20
        )
        with pytest.raises(OSError, match="cannot connect ZMQ forward"):
            await half.start()
        assert half._res.router is not None and half._res.router.closed
        assert half._res.ctx is not None and half._res.ctx.closed
        await half.stop(0.1)
        await half.stop(0.1)
        # a stop() without start() is a no-op too
        await ZmqIngest(pool, listen="tcp://127.0.0.1:0", max_message_bytes=1).stop(0)
    finally:
        pool.close()


@pytest.mark.parametrize("mode", ["reply", "forward"])
async def test_an_ingest_dropped_without_stop_releases_its_sockets(mode: str) -> None:
    """The output (held by the ingest's finalizer) never keeps the ingest alive: an
    ingest dropped without ``stop()`` is freed and its finalizer closes its sockets
    and its own context."""
    import gc
    import weakref

    pool = MaterializerPool(Materializer(load_profile(str(config_for_family("llama")))), workers=1)
    try:
        output = Reply() if mode == "reply" else Forward("tcp://127.0.0.1:1")
        ingest = ZmqIngest(pool, output, listen="tcp://127.0.0.1:0", max_message_bytes=1 << 20)
        await ingest.start()
        router, ctx = ingest._res.router, ingest._res.ctx
        assert router is not None and ctx is not None and not router.closed
        ref = weakref.ref(ingest)
        del ingest
        await asyncio.sleep(0)  # let the forward sender task start and park
        gc.collect()
        assert ref() is None
        assert router.closed and ctx.closed
        assert mode == "reply" or (output.socket is not None and output.socket.closed)
    finally:
        pool.close()


async def test_endpoint_is_the_bound_port(service: Factory) -> None:
    svc = await service("llama")
    assert svc.endpoint.startswith("tcp://127.0.0.1:")
    assert int(svc.endpoint.rsplit(":", 1)[1]) > 0
    # ZMQ_MAXMSGSIZE would drop an oversized peer without a reply: never set
    assert svc.ingest._res.router.getsockopt(zmq.MAXMSGSIZE) == -1


@needs_vectors
async def test_client_states_errors_and_sync_twin(service: Factory) -> None:
    svc = await service("qwen3_5")
    client = zmq_client(svc.endpoint, timeout_s=5)
    assert client.state is ClientState.UNOPENED
    with pytest.raises(ClientStateError):
        await zmq_admit(client, load_vector(SMALL).frames)
    async with client:
        assert client.state is ClientState.OPENED
        outcome = await zmq_admit(client, request_of(load_vector(SMALL), "typed"))
        assert outcome.materialized and outcome.request_id == "typed"
    assert client.state is ClientState.CLOSED
    with pytest.raises(ClientStateError):
        await client.abort("x")
    with pytest.raises(ClientStateError):
        await client.open()

    # held past its timeout: RequestTimeout, chained from asyncio's TimeoutError
    async with zmq_client(svc.endpoint, timeout_s=0.2) as short:
        with pytest.raises(RequestTimeout) as info:
            await zmq_admit(short, frames_of(load_vector(SMALL), "hold-slow"))
        assert isinstance(info.value.__cause__, TimeoutError)
    svc.gate.open()

    # nothing listening: the send never finds a connection
    async with zmq_client("tcp://127.0.0.1:1", timeout_s=0.2) as nowhere:
        with pytest.raises(ServerUnavailable):
            await zmq_admit(nowhere, load_vector(SMALL).frames)

    def blocking() -> tuple[bool, str, str]:
        request = client_wire.decode_add(load_vector(SMALL).frames).with_request_id("sync")
        with BlockingClient(ZmqTransport(svc.endpoint, timeout_s=5)) as sync_client:
            ok = sync_client.admit(request)
            marked = dataclasses.replace(request, request_id="marked", validation_error="bad")
            bad = sync_client.admit(marked)
            sync_client.abort("nothing")
        with pytest.raises(ClientStateError):
            sync_client.admit(request)
        assert isinstance(bad, Aborted)
        return ok.materialized, bad.code, bad.message

    assert await asyncio.to_thread(blocking) == (True, "INVALID_REQUEST", "bad")
