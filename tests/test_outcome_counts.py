"""Each outcome is counted once, and that count is what ``/metrics`` exports.

Contract: a request a transport ends adds exactly 1 to exactly one sample of
``mmadmit_requests_total{transport,outcome,code}`` (its transport, ``materialized``
/ ``OK`` or ``aborted`` and its code) and nothing to any other sample, as seen
by scraping the real ``/metrics`` endpoint of a real server (gRPC and ZMQ on
ephemeral loopback ports, in reply and in forward mode). Every outcome the
transport can produce is driven once: materialized, ``INVALID_REQUEST``,
``UNSUPPORTED``, ``TOO_LARGE``, ``OVERLOADED``, ``CANCELLED``,
``DEADLINE_EXCEEDED`` (gRPC: the msgpack wire carries no timeout),
``INTERNAL`` and ``SHUTTING_DOWN``; ``TEXT_ONLY_MODEL`` on a server started
``--language-model-only``. The engine and SMG gRPC transports count through
the same ladder (``Admissions.finish``) (``test_engine_mode.py``, ``test_smg_grpc.py``).
The pool counts no outcome (no ``mmadmit_outcomes_total``), and the
transports' untyped series do not export the count a second time.

Run with: .venv/bin/python -m pytest tests/test_outcome_counts.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc
import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from conftest import http_get, until
from mmadmit import wire
from mmadmit.errors import AbortCode
from mmadmit.model import Request, Tensor
from mmadmit_client.proto import admission_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families
from test_admission_both_transports import MODEL, Service, running, small_request

pytestmark = [
    pytest.mark.skipif(not MODEL.is_file(), reason=f"no model config at {MODEL}"),
    pytest.mark.timeout(90),
]

MAX_TOKENS = 1000
Series = tuple[str, str, str]  # (transport, outcome, code)


async def requests_total(svc: Service) -> dict[Series, float]:
    """Every ``mmadmit_requests_total`` sample of one scrape of the live endpoint."""
    status, body = await http_get(svc.handle.addresses["metrics"])
    assert status == 200
    out: dict[Series, float] = {}
    for family in text_string_to_metric_families(body):
        assert family.name != "mmadmit_outcomes"  # the pool counts no outcome
        for s in family.samples:
            if s.name == "mmadmit_requests_total":
                out[(s.labels["transport"], s.labels["outcome"], s.labels["code"])] = s.value
            # the transports' own series never repeat the outcome count
            assert not s.name.endswith(("_materialized", "_aborted_by_code")), s.name
    return out


async def counted_once(svc: Service, series: Series, action: Awaitable[Any]) -> Any:
    """Run ``action`` (one request to its outcome): exactly ``series`` grew, by 1."""
    before = await requests_total(svc)
    assert series in before, sorted(before)  # present (0) before it ever happens
    result = await action
    after = await requests_total(svc)
    grew = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    assert grew == {series: 1.0}, (series, grew)
    return result


def aborted(transport: str, code: AbortCode) -> Series:
    return (transport, "aborted", code.value)


async def ladder_ends(svc: Service, transport: str, late: Awaitable[Any], aborts: int) -> None:
    """The end of a transport's ladder: the held request released and the pool idle, the
    drain begins and ``late`` ends SHUTTING_DOWN, counted once; the transport's own
    stats then hold 1 materialized and ``aborts`` aborted, the other transport's none."""
    svc.hold.release()
    await until(lambda: svc.pool.inflight == 0)
    svc.pool.begin_drain()
    await counted_once(svc, aborted(transport, AbortCode.SHUTTING_DOWN), late)
    handles = {"zmq": svc.handle.zmq.admissions, "grpc": svc.handle.grpc.servicer.admissions}
    stats = handles.pop(transport).stats
    assert stats.materialized == 1 and sum(stats.aborted_by_code.values()) == aborts
    (other,) = handles.values()
    assert not other.stats.aborted_by_code  # nothing under the other label


# --------------------------------------------------------------------------- requests


def unsupported(rid: str) -> Request:
    req = small_request(rid)
    assert req.mm is not None
    req.mm.items[0].side["use_audio_in_video"] = Tensor.from_numpy(np.array([1], np.int64))
    return req


def image_proto(rid: str, placeholders: int = 16, **side: np.ndarray) -> pb.AdmitRequest:
    """``small_request`` as an ``AdmitRequest`` (built here from the service's own
    protos, so that the test does not depend on the client library)."""
    ids = np.full(40, 100, np.int64)
    ids[10:26] = 248056  # Qwen3.5 <|image_pad|>
    msg = pb.AdmitRequest(request_id=rid)
    msg.tokenized.input_ids.extend(ids.tolist())
    item = msg.mm_inputs.items.add(modality=pb.IMAGE)
    item.placeholders.add(offset=10, length=placeholders)
    feature = np.arange(64 * 32, dtype=np.float32)
    item.encoder_input.CopyFrom(tensor([64, 32], "float32", feature))
    item.model_specific_tensors["image_grid_thw"].CopyFrom(
        tensor([1, 3], "int64", np.array([1, 8, 8], np.int64))
    )
    for key, value in side.items():
        item.model_specific_tensors[key].CopyFrom(tensor(list(value.shape), "int64", value))
    return msg


def tensor(shape: list[int], dtype: str, values: np.ndarray) -> pb.TensorData:
    return pb.TensorData(shape=shape, dtype=dtype, inline=values.tobytes())


def text_proto(rid: str, n: int = 8) -> pb.AdmitRequest:
    msg = pb.AdmitRequest(request_id=rid)
    msg.tokenized.input_ids.extend([100] * n)
    return msg


class GrpcPeer:
    """The Admit and Abort RPCs, raw: an outcome is the ``AdmitResponse``."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self._admit = self.channel.unary_unary(
            "/mmadmit.v1.Admission/Admit",
            request_serializer=pb.AdmitRequest.SerializeToString,
            response_deserializer=pb.AdmitResponse.FromString,
        )
        self._abort = self.channel.unary_unary(
            "/mmadmit.v1.Admission/Abort",
            request_serializer=pb.AbortRequest.SerializeToString,
            response_deserializer=pb.AbortResponse.FromString,
        )

    async def admit(self, msg: pb.AdmitRequest) -> pb.AdmitResponse:
        out: pb.AdmitResponse = await self._admit(msg, timeout=20)
        return out

    async def abort(self, rid: str) -> bool:
        out: pb.AbortResponse = await self._abort(pb.AbortRequest(request_id=rid), timeout=5)
        return out.success


@contextlib.asynccontextmanager
async def grpc_peer(svc: Service) -> AsyncIterator[GrpcPeer]:
    peer = GrpcPeer(svc.handle.addresses["grpc"])
    try:
        yield peer
    finally:
        await peer.channel.close()


def too_long(rid: str) -> Request:
    return Request(rid=rid, input_ids=np.full(MAX_TOKENS + 1, 100, np.int64))


def text(rid: str) -> Request:
    return Request(rid=rid, input_ids=np.full(8, 100, np.int64))


# --------------------------------------------------------------------------- a ZMQ peer


class ZmqPeer:
    """A plain DEALER on the ingest; in forward mode also the downstream PULL. An
    outcome is the reply (reply mode) or the forwarded ADD (forward mode)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, pull: zmq.asyncio.Socket | None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.pull = pull

    async def send(self, frames: list[Any]) -> None:
        await self.sock.send_multipart(frames, copy=False)

    async def outcome(self, timeout_s: float = 10.0) -> list[zmq.Frame]:
        """The next outcome message (forward mode: the next ADD; ABORTs skipped)."""
        while True:
            src = self.pull if self.pull is not None else self.sock
            frames = await asyncio.wait_for(src.recv_multipart(copy=False), timeout_s)
            if self.pull is None or frames[0].bytes == bytes([wire.MSG_ADD]):
                return frames

    async def admit(self, req: Request) -> list[zmq.Frame]:
        await self.send([bytes([wire.MSG_ADD]), *wire.encode_request(req)])
        return await self.outcome()

    async def abort(self, rid: str) -> None:
        await self.send([bytes([wire.MSG_ABORT]), msgspec.msgpack.encode([rid])])


@contextlib.asynccontextmanager
async def zmq_peer(svc: Service, pull: zmq.asyncio.Socket | None) -> AsyncIterator[ZmqPeer]:
    ctx = zmq.asyncio.Context.instance()
    peer = ZmqPeer(ctx, svc.handle.addresses["zmq"], pull)
    try:
        yield peer
    finally:
        peer.sock.close(linger=0)


@contextlib.asynccontextmanager
async def downstream(mode: str) -> AsyncIterator[tuple[dict[str, Any], zmq.asyncio.Socket | None]]:
    """The server settings of ``mode`` and, in forward mode, the PULL it forwards to."""
    if mode == "reply":
        yield {}, None
        return
    pull = zmq.asyncio.Context.instance().socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind("tcp://127.0.0.1:*")
    address = pull.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        yield {"zmq_forward": address}, pull
    finally:
        pull.close(linger=0)


# --------------------------------------------------------------------------- ZMQ


@pytest.mark.parametrize("mode", ["reply", "forward"])
async def test_every_zmq_outcome_is_counted_once(mode: str) -> None:
    z = "zmq"
    async with (
        downstream(mode) as (settings, pull),
        running(workers=1, max_inflight=1, max_tokens=MAX_TOKENS, **settings) as svc,
        zmq_peer(svc, pull) as peer,
    ):
        await counted_once(svc, (z, "materialized", "OK"), peer.admit(small_request("ok")))
        await counted_once(
            svc, aborted(z, AbortCode.INVALID_REQUEST), _raw(peer, b"\xc1 not msgpack")
        )
        await counted_once(svc, aborted(z, AbortCode.UNSUPPORTED), peer.admit(unsupported("un")))
        await counted_once(svc, aborted(z, AbortCode.TOO_LARGE), peer.admit(too_long("big")))
        await counted_once(svc, aborted(z, AbortCode.INTERNAL), peer.admit(small_request("boom")))

        # one request held on the only worker: the next is OVERLOADED (max_inflight 1),
        # and an ABORT then ends the held one CANCELLED
        await peer.send([bytes([wire.MSG_ADD]), *wire.encode_request(small_request("hold-1"))])
        await svc.hold.wait_entered()
        await counted_once(svc, aborted(z, AbortCode.OVERLOADED), peer.admit(small_request("o")))
        await counted_once(svc, aborted(z, AbortCode.CANCELLED), _abort(peer, "hold-1"))
        await ladder_ends(svc, z, peer.admit(small_request("l")), aborts=7)


async def _raw(peer: ZmqPeer, payload: bytes) -> list[zmq.Frame]:
    await peer.send([bytes([wire.MSG_ADD]), payload])
    return await peer.outcome()


async def _abort(peer: ZmqPeer, rid: str) -> list[zmq.Frame]:
    await peer.abort(rid)
    return await peer.outcome()


# --------------------------------------------------------------------------- gRPC


async def test_every_grpc_outcome_is_counted_once() -> None:
    g = "grpc"
    async with (
        running(workers=1, max_inflight=1, max_tokens=MAX_TOKENS) as svc,
        grpc_peer(svc) as gc,
    ):
        await counted_once(svc, (g, "materialized", "OK"), gc.admit(image_proto("ok")))
        bad = image_proto("bad", placeholders=15)  # 15 placeholders for a 16 grid
        await counted_once(svc, aborted(g, AbortCode.INVALID_REQUEST), gc.admit(bad))
        un = image_proto("un", use_audio_in_video=np.array([1], np.int64))
        await counted_once(svc, aborted(g, AbortCode.UNSUPPORTED), gc.admit(un))
        big = text_proto("big", MAX_TOKENS + 1)
        await counted_once(svc, aborted(g, AbortCode.TOO_LARGE), gc.admit(big))
        await counted_once(svc, aborted(g, AbortCode.INTERNAL), gc.admit(image_proto("boom")))

        # one request held on the only worker: the next is OVERLOADED (max_inflight 1),
        # and the Abort RPC then ends the held one CANCELLED, in band
        held = asyncio.ensure_future(gc.admit(image_proto("hold-1")))
        await svc.hold.wait_entered()
        await counted_once(svc, aborted(g, AbortCode.OVERLOADED), gc.admit(image_proto("o")))

        async def abort_rpc() -> pb.AdmitResponse:
            assert await gc.abort("hold-1") is True
            return await held

        out = await counted_once(svc, aborted(g, AbortCode.CANCELLED), abort_rpc())
        assert out.abort.code == pb.CANCELLED
        svc.hold.release()
        await until(lambda: svc.pool.inflight == 0)  # its late result is discarded

        # the request's own deadline (timeout_ms) passes while it holds the worker
        late = image_proto("hold-late")
        late.timeout_ms = 100
        svc.hold.arm()
        await counted_once(svc, aborted(g, AbortCode.DEADLINE_EXCEEDED), gc.admit(late))
        await ladder_ends(svc, g, gc.admit(image_proto("l")), aborts=8)


# --------------------------------------------------------------------------- text-only model


async def test_text_only_model_is_counted_once_on_both_transports() -> None:
    async with (
        running(workers=1, language_model_only=True) as svc,
        zmq_peer(svc, None) as peer,
        grpc_peer(svc) as gc,
    ):
        await counted_once(svc, ("zmq", "materialized", "OK"), peer.admit(text("t-z")))
        await counted_once(
            svc, aborted("zmq", AbortCode.TEXT_ONLY_MODEL), peer.admit(small_request("i-z"))
        )
        await counted_once(svc, ("grpc", "materialized", "OK"), gc.admit(text_proto("t-g")))
        await counted_once(
            svc, aborted("grpc", AbortCode.TEXT_ONLY_MODEL), gc.admit(image_proto("i-g"))
        )


# --------------------------------------------------------------------------- encoding fails


def failing_for(rid: str, real: Any) -> Any:
    """``real`` (an encoder), raising for a materialized request ``rid``: a bug of ours
    met after the outcome was known."""

    def encode(*args: Any, **kwargs: Any) -> Any:
        named = [a for a in args if getattr(a, "rid", None) == rid or a == rid]
        inner = [a for a in args if getattr(getattr(a, "request", None), "rid", None) == rid]
        if named or inner:
            raise RuntimeError("planted: the encoder failed")
        return real(*args, **kwargs)

    return encode


@pytest.mark.parametrize("transport", ["grpc", "reply", "forward"])
async def test_an_outcome_that_fails_to_encode_is_counted_internal_once(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ladder counts what the client receives: the request was materialized, its
    reply could not be made, so it ends INTERNAL, counted once (never materialized)."""
    from mmadmit import servicer, zmq_output

    mode = "forward" if transport == "forward" else "reply"
    async with (
        downstream(mode) as (settings, pull),
        running(workers=1, max_inflight=1, max_tokens=MAX_TOKENS, **settings) as svc,
    ):
        if transport == "grpc":
            monkeypatch.setattr(
                servicer, "encode_response", failing_for("enc", servicer.encode_response)
            )
            async with grpc_peer(svc) as gc:
                resp = await counted_once(
                    svc, aborted("grpc", AbortCode.INTERNAL), gc.admit(image_proto("enc"))
                )
            assert resp.WhichOneof("outcome") == "abort"
            assert resp.abort.code == pb.INTERNAL
            stats = svc.handle.grpc.servicer.admissions.stats
        else:
            add = [bytes([wire.MSG_ADD]), *wire.encode_request(small_request("enc"))]
            name = "encode_materialized" if mode == "reply" else "encode_request"
            monkeypatch.setattr(zmq_output.wire, name, failing_for("enc", getattr(wire, name)))
            async with zmq_peer(svc, pull) as peer:

                async def admit() -> list[zmq.Frame]:
                    await peer.send(add)
                    return await peer.outcome()

                frames = await counted_once(svc, aborted("zmq", AbortCode.INTERNAL), admit())
            monkeypatch.undo()
            if mode == "reply":
                assert frames[0].bytes == bytes([wire.STATUS_ABORTED])
                body = msgspec.msgpack.decode(frames[1].bytes)
                assert "INTERNAL" in repr(body)
            else:
                req = wire.decode_message(frames).request
                assert req is not None and req.validation_error is not None
                assert "INTERNAL" in str(req.validation_error)
            stats = svc.handle.zmq.admissions.stats
        assert stats.materialized == 0
        assert stats.aborted_by_code == {"INTERNAL": 1}
