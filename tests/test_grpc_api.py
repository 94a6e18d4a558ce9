"""The gRPC admission API (docs/spec/GRPC.md) against a real server on an ephemeral port.

Contract pinned here: every wire vector, translated into an ``AdmitRequest``,
comes back with exactly the reference ids, pad values, hashes, positions and
delta (the error vector as an in-band ``INVALID_REQUEST``), through ``Admit``
and through ``AdmitStream`` interleaved with bad requests; a
``GenerateRequest``-shaped message (test-only proto compiled here) parses as an
``AdmitRequest``; health, reflection, ``timeout_ms``, call deadlines and client
cancellation, the ``Abort`` RPC, ``OVERLOADED``, bad input as in-band aborts
while the server keeps serving, and ``GetModelInfo``.

Everything is real: ``MaterializerPool`` + ``Materializer`` behind a
``grpc.aio`` server on ``127.0.0.1:0``, the client library in front; workers
are held deterministically with the pool's ``before_run`` hook. Fixtures are
local to this file and close every channel and server.

Run with: python -m pytest tests/test_grpc_api.py -q
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import grpc
import numpy as np
import pytest
from client_helpers import build_item, build_request, tensor_data
from conftest import CONFIGS, Vector, generate_request, load_vector, until, vector_names
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from mmadmit import pbwire
from mmadmit.errors import InvalidRequest
from mmadmit.grpc_server import ADMISSION_SERVICE, GrpcServer
from mmadmit.limits import DEFAULT_LIMITS, Limits
from mmadmit.materializer import Materializer
from mmadmit.model import Request
from mmadmit.pool import MaterializerPool
from mmadmit.profile import ModelProfile, load_profile
from mmadmit.servicer import items_from_proto
from mmadmit.telemetry import Telemetry
from mmadmit.wire import decode_message
from mmadmit_client import (
    Aborted,
    BlockingClient,
    Client,
    ClientState,
    ClientStateError,
    GrpcTransport,
    Item,
    Materialized,
    RequestTimeout,
    ShmFeature,
    TransportError,
    grid,
    request_to_proto,
)
from mmadmit_client import Request as ClientRequest
from mmadmit_client import wire as client_wire
from mmadmit_client.proto import admission_pb2 as pb

MODEL_CONFIG = {
    "qwen3_5": CONFIGS / "qwen3_5.json",
    "qwen3_omni": CONFIGS / "qwen3_omni_moe.json",
    "llama": CONFIGS / "llama.json",
}
VECTORS = vector_names()
# every case with native code on and off (conftest.native_mode)
pytestmark = pytest.mark.usefixtures("native_mode")
needs_vectors = pytest.mark.skipif(not VECTORS, reason="no wire vectors (set MMADMIT_VECTORS)")


# ---------------------------------------------------------------------------------------- fixtures


class Gate:
    """A ``before_run`` hook that holds every worker until :meth:`open`.

    A request the test never releases fails after ``HOLD_S`` (the worker raises
    and ``running`` reports it) instead of quietly going on."""

    HOLD_S = 10.0

    def __init__(self) -> None:
        self._open = threading.Event()
        self.timed_out: list[str] = []

    def __call__(self, req: Request) -> None:
        if not self._open.wait(self.HOLD_S):
            self.timed_out.append(req.rid)
            raise AssertionError(f"{req.rid} was held {self.HOLD_S} s and never released")

    def open(self) -> None:
        self._open.set()


@dataclass
class Running:
    server: GrpcServer
    pool: MaterializerPool
    profile: ModelProfile
    address: str
    client: Client

    @property
    def grpc(self) -> GrpcTransport:
        """The client's transport: raw ``AdmitRequest`` messages, the channel, the stub."""
        assert isinstance(self.client.transport, GrpcTransport)
        return self.client.transport


@contextlib.asynccontextmanager
async def running(
    family: str,
    *,
    workers: int = 2,
    max_inflight: int = 64,
    gate: Gate | None = None,
    serving: bool = True,
    limits: Limits = DEFAULT_LIMITS,
    **server_kw: Any,
) -> AsyncIterator[Running]:
    profile = load_profile(str(MODEL_CONFIG[family]))
    pool = MaterializerPool(
        Materializer(profile, limits), workers=workers, max_inflight=max_inflight, before_run=gate
    )
    server = GrpcServer(
        pool, profile, listen="127.0.0.1:0", max_message_bytes=64 << 20, **server_kw
    )
    try:
        address = await server.start()
        if serving:
            await server.set_serving()
        async with Client(GrpcTransport(address)) as client:
            yield Running(server, pool, profile, address, client)
    finally:
        if gate is not None:
            gate.open()  # never leave a worker thread blocked behind
        await server.stop(0)
        pool.close()
    assert gate is None or not gate.timed_out, f"held, never released: {gate.timed_out}"


@pytest.fixture
async def qwen() -> AsyncIterator[Running]:
    async with running("qwen3_5") as r:
        yield r


@pytest.fixture
def gate() -> Iterator[Gate]:
    g = Gate()
    yield g
    g.open()


# ------------------------------------------------------------------------- vectors -> AdmitRequest


def request_from_vector(v: Vector, request_id: str | None = None) -> pb.AdmitRequest:
    """The vector's captured ADD message, decoded by the client's codec and translated
    by the client into an ``AdmitRequest``."""
    req = client_wire.decode_add(v.frames)
    return request_to_proto(req if request_id is None else req.with_request_id(request_id))


def check_vector(v: Vector, outcome: Any) -> None:
    """Compare an outcome with the vector's reference arrays (``.npz``)."""
    if v.error is not None:
        assert isinstance(outcome, Aborted), outcome
        assert outcome.code == "INVALID_REQUEST", outcome
        assert "item 0" in outcome.message, outcome.message
        return
    assert isinstance(outcome, Materialized), outcome
    a = v.arrays
    np.testing.assert_array_equal(outcome.input_ids, a["input_ids_padded"])
    if v.meta.get("multimodal") is None:  # a text request: originals are not repeated
        assert outcome.input_ids_unpadded is None
        np.testing.assert_array_equal(outcome.input_ids, a["input_ids_unpadded"])
        assert outcome.items == () and outcome.mrope_positions is None
        return
    np.testing.assert_array_equal(outcome.input_ids_unpadded, a["input_ids_unpadded"])
    assert [it.pad_value for it in outcome.items] == a["item_pad_values"].tolist()
    for i, it in enumerate(outcome.items):
        if a["item_hash_is_none"][i]:
            assert it.hash is None
        else:
            assert it.hash == int(a["item_hashes"][i]), (i, it.hash)
    got_offsets = [[i, s, e] for i, it in enumerate(outcome.items) for s, e in it.offsets.tolist()]
    assert got_offsets == a["item_offsets"].tolist()
    if "mrope_positions" in a:
        assert outcome.mrope_positions is not None
        np.testing.assert_array_equal(outcome.mrope_positions, a["mrope_positions"])
        assert outcome.mrope_position_delta == int(a["mrope_position_delta"].reshape(-1)[0])
    else:
        assert outcome.mrope_positions is None
    # passthrough exactly when the payload was materialized upstream (rule 4)
    wire_req = decode_message(v.frames).request
    assert wire_req is not None
    assert outcome.passthrough == (wire_req.input_ids_unpadded is not None)


# ----------------------------------------------------------------------------------------- vectors


@needs_vectors
@pytest.mark.parametrize("name", VECTORS)
async def test_vector_through_admit(name: str) -> None:
    v = load_vector(name)
    async with running(v.meta["family"]) as r:
        outcome = await r.grpc.admit_proto(request_from_vector(v))
        check_vector(v, outcome)
        assert outcome.request_id == decode_message(v.frames).request.rid
        await until(lambda: r.pool.inflight == 0)


def _bad_requests(profile: ModelProfile) -> list[tuple[str, pb.AdmitRequest]]:
    """(rid prefix, request) pairs that must each abort INVALID_REQUEST."""
    base = _image_request(profile, "bad")
    out = []
    for label, mutate in BAD_INPUTS.items():
        if label == "empty request_id":  # responses are matched by id: not in a stream
            continue
        req = pb.AdmitRequest()
        req.CopyFrom(base)
        mutate[0](req)
        out.append((label, req))
    return out


@needs_vectors
async def test_stream_interleaves_100_good_and_bad(qwen: Running) -> None:
    good = [load_vector(n) for n in VECTORS if n.startswith("qwen3_5")]
    bad = _bad_requests(qwen.profile)
    requests: list[pb.AdmitRequest] = []
    expect: dict[str, Vector | None] = {}
    for k in range(100):
        rid = f"s{k:03d}"
        if k % 3 == 2:
            _, proto = bad[k % len(bad)]
            req = pb.AdmitRequest()
            req.CopyFrom(proto)
            req.request_id = rid
            expect[rid] = None
        else:
            v = good[k % len(good)]
            req = request_from_vector(v, rid)
            expect[rid] = v
        requests.append(req)

    seen: dict[str, int] = {}
    order = []
    async for outcome in qwen.grpc.admit_proto_stream(requests):
        seen[outcome.request_id] = seen.get(outcome.request_id, 0) + 1
        order.append(outcome.request_id)
        v = expect[outcome.request_id]
        if v is None:
            assert isinstance(outcome, Aborted) and outcome.code == "INVALID_REQUEST", outcome
        else:
            check_vector(v, outcome)
    assert seen == {rid: 1 for rid in expect}, "every request answered exactly once"
    assert len(order) == 100
    await until(lambda: qwen.pool.inflight == 0)
    assert qwen.server.stats.streams == 1 and qwen.server.stats.requests == 100


# ------------------------------------------------------------------------------ wire compatibility


@needs_vectors
async def test_generate_request_bytes_are_an_admit_request(compat_pb2: ModuleType) -> None:
    """A frontend's GenerateRequest (sampling, logprobs, stream, bootstrap fields set) is
    accepted byte for byte and materialized like the equivalent AdmitRequest."""
    v = load_vector("qwen3_5_image1")
    wire_req = decode_message(v.frames).request
    assert wire_req is not None and wire_req.mm is not None
    item = wire_req.mm.items[0]
    c = compat_pb2
    gen = generate_request(c, wire_req.input_ids.tolist(), encode_item=0)
    g_item = gen.mm_inputs.items.add(
        modality=c.IMAGE,
        content_hash=item.hash.to_bytes(8, "little"),
        placeholder_token_id=wire_req.mm.im_token_id,
    )
    for s, e in item.offsets.tolist():
        g_item.placeholders.add(offset=s, length=e - s + 1)
    g_item.encoder_input.shape.extend(item.feature.shape)
    g_item.encoder_input.dtype = item.feature.dtype.name
    g_item.encoder_input.inline = bytes(item.feature.data)
    grid = item.side["image_grid_thw"]
    g_item.model_specific_tensors["image_grid_thw"].shape.extend(grid.shape)
    g_item.model_specific_tensors["image_grid_thw"].dtype = "int64"
    g_item.model_specific_tensors["image_grid_thw"].inline = bytes(grid.data)
    raw = gen.SerializeToString()

    # It parses as an AdmitRequest, and protobuf keeps the scheduler's fields as unknown ones.
    parsed = pb.AdmitRequest.FromString(raw)
    assert parsed.request_id == "smg-1"
    assert list(parsed.tokenized.input_ids) == wire_req.input_ids.tolist()
    assert len(parsed.SerializeToString()) == len(raw)

    async with running("qwen3_5") as r:
        resp = await _bytes_call(r)(raw)  # the GenerateRequest's bytes, as is
    from mmadmit_client import outcome_from_proto

    outcome = outcome_from_proto(resp)
    assert outcome.request_id == "smg-1"
    check_vector(v, outcome)
    # field 10 is shared: its entry comes back as the item's handshake
    want = {"bootstrap_host": "", "bootstrap_port": 0, "bootstrap_room": 9}
    assert isinstance(outcome, Materialized) and outcome.items[0].encode_handshake == want


# ------------------------------------------------------------------------ health, reflection, info


async def test_health_transitions() -> None:
    async with running("qwen3_5", serving=False) as r:
        for name in ("", ADMISSION_SERVICE):
            assert await r.client.health(name) == "NOT_SERVING"
        await r.server.set_serving()
        for name in ("", ADMISSION_SERVICE):
            assert await r.client.health(name) == "SERVING"
        await r.server.enter_drain()
        for name in ("", ADMISSION_SERVICE):
            assert await r.client.health(name) == "NOT_SERVING"
        assert await r.client.health("no.such.Service") == "SERVICE_UNKNOWN"


async def test_reflection_lists_admission(qwen: Running) -> None:
    channel = qwen.grpc._channel
    assert channel is not None
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = []
    async for resp in call:
        names = [s.name for s in resp.list_services_response.service]
    assert "mmadmit.v1.Admission" in names and "grpc.health.v1.Health" in names


async def test_model_info_qwen3_5_and_llama() -> None:
    async with running("qwen3_5") as r:
        info = await r.client.model_info()
    assert info.family == "qwen3_5" and info.model_type == "qwen3_5"
    assert info.architectures == ("Qwen3_5ForConditionalGeneration",)
    assert info.vocab_size == r.profile.vocab_size
    assert (info.image_token_id, info.video_token_id, info.audio_token_id) == (248056, 248057, None)
    assert info.max_model_len is None and info.role == "aggregated"
    assert info.multimodal_active and info.uses_mrope and not info.language_model_only

    async with running("llama") as r:
        raw = await r.grpc.stub.GetModelInfo(pb.GetModelInfoRequest())
    for name in ("image_token_id", "video_token_id", "audio_token_id"):
        assert not raw.HasField(name), name  # absent, not 0
    assert raw.family == "text_only" and raw.model_type == "llama"
    assert not raw.multimodal_active and not raw.uses_mrope and raw.vocab_size == 128256


# ------------------------------------------------------------------------ deadlines, cancel, abort


def _image_request(profile: ModelProfile, rid: str, **kwargs: Any) -> pb.AdmitRequest:
    """16 text tokens around one 2x2-merged image (grid [1, 4, 4]) with an inline feature."""
    assert profile.image_token_id is not None
    ids = np.arange(100, 120, dtype=np.int64)
    ids[5:9] = profile.image_token_id
    item = build_item(
        "image",
        placeholders=[(5, 4)],
        feature=np.arange(16 * 6, dtype=np.float32).reshape(16, 6),
        image_grid_thw=[1, 4, 4],
        placeholder_token_id=profile.image_token_id,
    )
    return build_request(rid, ids, [item], **kwargs)


def _image_model_request(profile: ModelProfile, rid: str) -> ClientRequest:
    """:func:`_image_request` as the client's own model."""
    assert profile.image_token_id is not None
    ids = np.arange(100, 120, dtype=np.int64)
    ids[5:9] = profile.image_token_id
    item = Item.with_placeholders(
        "image",
        [(5, 4)],
        feature=np.arange(16 * 6, dtype=np.float32).reshape(16, 6),
        side={"image_grid_thw": grid([1, 4, 4])},
        placeholder_token_id=profile.image_token_id,
    )
    return ClientRequest(rid, ids, [item])


async def test_timeout_ms_is_deadline_exceeded_in_band(gate: Gate) -> None:
    async with running("qwen3_5", workers=1, gate=gate) as r:
        outcome = await r.grpc.admit_proto(_image_request(r.profile, "t1", timeout_ms=150))
        assert isinstance(outcome, Aborted) and outcome.code == "DEADLINE_EXCEEDED", outcome
        assert "150 ms" in outcome.message
        gate.open()
        await until(lambda: r.pool.inflight == 0)
        ok = await r.grpc.admit_proto(_image_request(r.profile, "t2", timeout_ms=5000))
        assert isinstance(ok, Materialized)


async def test_call_deadline_cancels_the_work(gate: Gate) -> None:
    async with running("qwen3_5", workers=1, gate=gate) as r:
        running_call = asyncio.ensure_future(
            r.grpc.admit_proto(_image_request(r.profile, "d1"), timeout_s=0.4)
        )
        await until(lambda: r.pool.running == 1)
        queued_call = asyncio.ensure_future(
            r.grpc.admit_proto(_image_request(r.profile, "d2"), timeout_s=0.2)
        )
        for fut in (queued_call, running_call):
            with pytest.raises(RequestTimeout) as info:
                await fut
            assert isinstance(info.value.__cause__, grpc.RpcError)
        await until(lambda: r.server.stats.calls_cancelled == 2)
        assert r.pool.stats.cancelled_queued == 1  # left the queue at once
        assert r.pool.inflight == 1  # the running one still holds its worker
        assert r.server.servicer.inflight_ids == frozenset()
        gate.open()
        await until(lambda: r.pool.inflight == 0)
        assert r.pool.stats.discarded_running == 1  # its result was thrown away, not sent
        outcomes = r.server.servicer.admissions.stats
        assert outcomes.aborted_by_code == {"CANCELLED": 2}  # counted once each


async def test_client_cancellation_cancels_the_work(gate: Gate) -> None:
    async with running("qwen3_5", workers=1, gate=gate) as r:
        holder = asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, "c1")))
        await until(lambda: r.pool.running == 1)
        victim = asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, "c2")))
        await until(lambda: r.pool.inflight == 2)
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        await until(lambda: r.server.stats.calls_cancelled == 1)
        await until(lambda: r.pool.inflight == 1)
        assert r.pool.stats.cancelled_queued == 1
        gate.open()
        assert isinstance(await holder, Materialized)
        await until(lambda: r.pool.inflight == 0)


async def test_stream_cancellation_cancels_its_work(gate: Gate) -> None:
    async with running("qwen3_5", workers=1, gate=gate) as r:
        reqs = [_image_request(r.profile, f"sc{k}") for k in range(3)]

        async def consume() -> None:
            async for _ in r.grpc.admit_proto_stream(reqs):
                pass

        task = asyncio.ensure_future(consume())
        await until(lambda: r.pool.inflight == 3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: r.server.stats.calls_cancelled == 3)
        await until(lambda: r.pool.inflight == 1)  # the running one only
        gate.open()
        await until(lambda: r.pool.inflight == 0)


async def test_abort_rpc_cancels_the_request(gate: Gate) -> None:
    async with running("qwen3_5", workers=1, gate=gate) as r:
        pending = asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, "victim")))
        await until(lambda: "victim" in r.server.servicer.inflight_ids)
        assert await r.client.abort("victim", reason="user went away") is True
        outcome = await pending
        assert isinstance(outcome, Aborted) and outcome.code == "CANCELLED", outcome
        assert "user went away" in outcome.message
        assert await r.client.abort("victim") is False  # no longer in flight
        assert await r.client.abort("never-seen") is False
        gate.open()
        await until(lambda: r.pool.inflight == 0)


async def test_overloaded_when_the_pool_is_full(gate: Gate) -> None:
    async with running("qwen3_5", workers=1, max_inflight=2, gate=gate) as r:
        first = [
            asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, f"o{k}")))
            for k in range(2)
        ]
        await until(lambda: r.pool.inflight == 2)
        outcome = await r.grpc.admit_proto(_image_request(r.profile, "o-extra"))
        assert isinstance(outcome, Aborted) and outcome.code == "OVERLOADED", outcome
        assert "--max-inflight" in outcome.message
        gate.open()
        for fut in first:
            assert isinstance(await fut, Materialized)


async def test_duplicate_request_id_in_flight(gate: Gate) -> None:
    async with running("qwen3_5", workers=1, gate=gate) as r:
        first = asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, "dup")))
        await until(lambda: "dup" in r.server.servicer.inflight_ids)
        second = await r.grpc.admit_proto(_image_request(r.profile, "dup"))
        assert isinstance(second, Aborted) and second.code == "INVALID_REQUEST"
        assert "already in flight" in second.message
        gate.open()
        assert isinstance(await first, Materialized)
        # once answered, the id is free again
        assert isinstance(await r.grpc.admit_proto(_image_request(r.profile, "dup")), Materialized)


# --------------------------------------------------------------------------------------- bad input


def _feature(req: pb.AdmitRequest) -> pb.TensorData:
    return req.mm_inputs.items[0].encoder_input


def _set_shm(name: str) -> Callable[[pb.AdmitRequest], None]:
    def mutate(req: pb.AdmitRequest) -> None:
        item = req.mm_inputs.items[0]
        item.encoder_input.CopyFrom(tensor_data(ShmFeature(name, (16, 6), "float32")))
        item.content_hash = b"\x01"

    return mutate


def _no_payload(req: pb.AdmitRequest) -> None:
    _feature(req).ClearField("inline")


def _clear_placeholders(req: pb.AdmitRequest) -> None:
    del req.mm_inputs.items[0].placeholders[:]


# label -> (mutation, substrings the abort message must hold)
BAD_INPUTS: dict[str, tuple[Callable[[pb.AdmitRequest], None], tuple[str, ...]]] = {
    "wrong dtype": (
        lambda r: setattr(_feature(r), "dtype", "float33"),
        ("item 0 encoder_input", "unsupported tensor dtype 'float33'"),
    ),
    "byte-length mismatch": (
        lambda r: setattr(_feature(r), "inline", b"\0" * 10),
        ("item 0 encoder_input", "10 data bytes", "needs 384"),
    ),
    "placeholders out of range": (
        lambda r: r.mm_inputs.items[0].placeholders[0].MergeFrom(pb.PlaceholderRange(offset=18)),
        ("item 0", "span 0 [18, 21]", "inside input_ids"),
    ),
    "no placeholders": (_clear_placeholders, ("item 0", "non-empty")),
    "zero-length placeholder": (
        lambda r: setattr(r.mm_inputs.items[0].placeholders[0], "length", 0),
        ("item 0", "placeholders[0]", "length 0"),
    ),
    "unspecified modality": (
        lambda r: setattr(r.mm_inputs.items[0], "modality", 0),
        ("item 0", "MODALITY_UNSPECIFIED"),
    ),
    "unknown modality": (
        lambda r: setattr(r.mm_inputs.items[0], "modality", 7),
        ("item 0", "modality 7"),
    ),
    "shm name ../x": (_set_shm("../x"), ("item 0 encoder_input", "plain name")),
    "shm name a/b": (_set_shm("a/b"), ("item 0 encoder_input", "plain name")),
    "TensorData without payload": (_no_payload, ("item 0 encoder_input", "no payload")),
    "side tensor dtype": (
        lambda r: setattr(
            r.mm_inputs.items[0].model_specific_tensors["image_grid_thw"], "dtype", "complex64"
        ),
        ("item 0 model_specific_tensors['image_grid_thw']", "unsupported tensor dtype"),
    ),
    "empty request_id": (lambda r: setattr(r, "request_id", ""), ("request_id is empty",)),
}


def _three_items(profile: ModelProfile) -> pb.AdmitRequest:
    """Three image items, the second with two placeholder ranges."""
    assert profile.image_token_id is not None
    ids = np.arange(100, 140, dtype=np.int64)
    spans = [[(2, 4)], [(10, 4), (20, 3)], [(30, 4)]]
    items = []
    for ranges in spans:
        for start, length in ranges:
            ids[start : start + length] = profile.image_token_id
        items.append(
            build_item(
                "image",
                placeholders=ranges,
                feature=np.zeros((16, 6), np.float32),
                image_grid_thw=[1, 4, 4],
            )
        )
    return build_request("three", ids, items)


def test_items_take_their_own_placeholder_rows() -> None:
    # the rows of all items are read into one table; each item gets its own slice
    msg = _three_items(load_profile("qwen3_5"))
    mm = items_from_proto(msg.mm_inputs.items, load_profile("qwen3_5"), None)
    got = [item.offsets.tolist() for item in mm.items]  # type: ignore[union-attr]
    assert got == [[[2, 5]], [[10, 13], [20, 22]], [[30, 33]]]


Fault = Callable[[pb.AdmitRequest], None]


def _zero_length(item: int, row: int) -> Fault:
    return lambda r: setattr(r.mm_inputs.items[item].placeholders[row], "length", 0)


def _bad_dtype(item: int) -> Fault:
    return lambda r: setattr(r.mm_inputs.items[item].encoder_input, "dtype", "float33")


def _modality_7(item: int) -> Fault:
    return lambda r: setattr(r.mm_inputs.items[item], "modality", 7)


# faults, made in this order -> the message's start: the first fault in item order wins,
# and within an item its tensors are checked before its placeholder ranges
PRECEDENCE: dict[str, tuple[tuple[Fault, ...], str]] = {
    "zero length in item 1, bad dtype in item 2": (
        (_zero_length(1, 1), _bad_dtype(2)),
        "item 1: placeholders[1] (offset 20) has length 0",
    ),
    "bad dtype in item 0, zero length in item 0 and 1": (
        (_zero_length(0, 0), _zero_length(1, 0), _bad_dtype(0)),
        "item 0 encoder_input: unsupported tensor dtype",
    ),
    "zero length in item 2, unknown modality in item 2": (
        (_zero_length(2, 0), _modality_7(2)),
        "item 2: modality 7",
    ),
    "zero length in items 0 and 2": (
        (_zero_length(2, 0), _zero_length(0, 0)),
        "item 0: placeholders[0] (offset 2) has length 0",
    ),
}


@pytest.mark.parametrize("label", list(PRECEDENCE))
def test_item_faults_are_worded_in_item_order(label: str) -> None:
    faults, start = PRECEDENCE[label]
    profile = load_profile("qwen3_5")
    msg = _three_items(profile)
    for fault in faults:
        fault(msg)
    with pytest.raises(InvalidRequest) as caught:
        items_from_proto(msg.mm_inputs.items, profile, None)
    assert caught.value.message.startswith(start), caught.value.message


@pytest.mark.parametrize("label", list(BAD_INPUTS))
async def test_bad_input_is_an_in_band_abort(qwen: Running, label: str) -> None:
    mutate, needles = BAD_INPUTS[label]
    req = _image_request(qwen.profile, f"bad-{label}")
    mutate(req)
    outcome = await qwen.grpc.admit_proto(req)
    assert isinstance(outcome, Aborted), outcome
    assert outcome.code == "INVALID_REQUEST", outcome
    for needle in needles:
        assert needle in outcome.message, (needle, outcome.message)
    # the server keeps serving
    assert isinstance(
        await qwen.grpc.admit_proto(_image_request(qwen.profile, "after")), Materialized
    )
    assert qwen.pool.inflight == 0
    assert "INTERNAL" not in qwen.server.servicer.admissions.stats.aborted_by_code


@pytest.mark.parametrize(
    ("at", "past", "flag"),
    [
        (Limits(max_tensor_dim=16), Limits(max_tensor_dim=15),
         "dimension 16 exceeds the limit of 15"),
        (Limits(max_tensor_rank=2), Limits(max_tensor_rank=1), "rank 2 exceeds the limit of 1"),
        (Limits(max_tensor_bytes=384), Limits(max_tensor_bytes=383),
         "shape [16, 6] of float32 is 384 bytes, over the limit of 383"),
    ],
)  # fmt: skip
async def test_tensor_limits_refuse_at_translation(at: Limits, past: Limits, flag: str) -> None:
    """The servicer builds each inline tensor within the server's limits (the Tensor
    checks them, worded by mmadmit.limits): at the limit admitted, one past TOO_LARGE
    naming the proto field."""
    async with running("qwen3_5", limits=at) as r:
        assert isinstance(await r.grpc.admit_proto(_image_request(r.profile, "at")), Materialized)
    async with running("qwen3_5", limits=past) as r:
        outcome = await r.grpc.admit_proto(_image_request(r.profile, "past"))
        assert isinstance(outcome, Aborted) and outcome.code == "TOO_LARGE", outcome
        assert outcome.message.startswith(f"item 0 encoder_input: {flag}"), outcome.message
        assert "INTERNAL" not in r.server.servicer.admissions.stats.aborted_by_code


# ------------------------------------------------------------------------- outcome shapes, clients


async def test_echo_features_and_derived_fields(qwen: Running) -> None:
    req = _image_request(qwen.profile, "echo", echo_features=True)
    req.mm_inputs.items[0].content_hash = (2**64 - 1).to_bytes(8, "little")
    outcome = await qwen.grpc.admit_proto(req)
    assert isinstance(outcome, Materialized)
    item = outcome.items[0]
    assert item.modality == "image" and item.hash == 2**64 - 1
    assert item.placeholders == [(5, 4)]
    assert outcome.input_ids[5:9].tolist() == [item.pad_value] * 4
    assert outcome.mrope_positions is not None and outcome.mrope_positions.shape == (3, 20)
    np.testing.assert_array_equal(
        item.feature.to_numpy(), np.arange(16 * 6, dtype=np.float32).reshape(16, 6)
    )
    np.testing.assert_array_equal(item.side["image_grid_thw"].to_numpy(), [[1, 4, 4]])

    plain = await qwen.grpc.admit_proto(_image_request(qwen.profile, "plain"))
    assert isinstance(plain, Materialized)
    assert plain.items[0].feature is None and plain.items[0].side == {}


async def test_large_inline_tensors_are_read_in_place(
    qwen: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admit and AdmitStream take inline tensors of 64 KiB or more as views on the received
    bytes (the request deserializer strips them from what upb parses, pbwire.py; native
    code on); outcomes, echoed features and carried positions are those of the plain
    message, native code on or off."""
    seen: list[type] = []
    admit_one = qwen.server.servicer._admit_one

    async def spy(request: Any) -> pb.AdmitResponse:
        seen.append(type(request))
        return await admit_one(request)

    monkeypatch.setattr(qwen.server.servicer, "_admit_one", spy)
    rng = np.random.default_rng(5)
    feature = rng.random((16, 1200), dtype=np.float32)  # 75 KiB

    def big(rid: str) -> pb.AdmitRequest:
        req = _image_request(qwen.profile, rid, echo_features=True)
        req.mm_inputs.items[0].encoder_input.CopyFrom(tensor_data(feature))
        return req

    n = 3000  # a request materialized upstream, carrying 72 kB of positions
    ids = np.arange(100, 100 + n, dtype=np.int64)
    positions = np.tile(np.arange(n, dtype=np.int64), (3, 1))
    carried = build_request("pos", ids, input_ids_unpadded=ids, mrope=(positions, None))

    outcomes = [await qwen.grpc.admit_proto(big("u1")), await qwen.grpc.admit_proto(carried)]
    outcomes += [
        o
        async for o in qwen.grpc.admit_proto_stream([big("s1"), _image_request(qwen.profile, "s2")])
    ]
    by_id = {o.request_id: o for o in outcomes}
    for rid in ("u1", "s1"):
        got = by_id[rid]
        assert isinstance(got, Materialized), got
        np.testing.assert_array_equal(got.items[0].feature.to_numpy(), feature)
    pos = by_id["pos"]
    assert isinstance(pos, Materialized) and pos.passthrough
    np.testing.assert_array_equal(pos.mrope_positions, positions)
    assert isinstance(by_id["s2"], Materialized)
    kinds = [k.__name__ for k in seen]
    if pbwire.HAVE_NATIVE:
        assert sorted(kinds) == [
            "AdmitRequest",
            "StrippedRequest",
            "StrippedRequest",
            "StrippedRequest",
        ]
    else:  # without the C walks nothing is stripped: upb parses every message whole
        assert kinds == ["AdmitRequest"] * 4


async def test_short_content_hash_is_zero_extended_little_endian(qwen: Running) -> None:
    req = _image_request(qwen.profile, "short")
    req.mm_inputs.items[0].content_hash = b"\x01\x02"
    outcome = await qwen.grpc.admit_proto(req)
    assert isinstance(outcome, Materialized) and outcome.items[0].hash == 0x0201


async def test_client_state_is_explicit() -> None:
    async with running("qwen3_5") as r:
        client = Client(GrpcTransport(r.address))
        assert client.state is ClientState.UNOPENED
        with pytest.raises(ClientStateError):
            await client.model_info()
        async with client:
            assert client.state is ClientState.OPENED
            assert (await client.model_info()).family == "qwen3_5"
        assert client.state is ClientState.CLOSED
        with pytest.raises(ClientStateError):
            await client.admit(ClientRequest("late", [1, 2, 3]))
        with pytest.raises(ClientStateError):
            await client.open()


async def test_sync_client_same_methods() -> None:
    async with running("qwen3_5") as r:

        def use_sync() -> tuple[Any, ...]:
            with BlockingClient(GrpcTransport(r.address)) as client:
                one = client.admit(_image_model_request(r.profile, "sync1"))
                many = list(
                    client.admit_many(
                        [_image_model_request(r.profile, "sync2"), ClientRequest("", [1, 2])]
                    )
                )
                return one, many, client.model_info(), client.health(), client.abort("nope")

        one, many, info, health, aborted = await asyncio.to_thread(use_sync)
    assert isinstance(one, Materialized) and one.request_id == "sync1"
    assert sorted(type(o).__name__ for o in many) == ["Aborted", "Materialized"]
    assert info.family == "qwen3_5" and health == "SERVING" and aborted is False


async def test_stream_window_queues_instead_of_overloading(gate: Gate) -> None:
    """One stream never has more than max_inflight outstanding: the rest wait unread."""
    async with running("qwen3_5", workers=1, max_inflight=2, gate=gate) as r:
        reqs = [_image_request(r.profile, f"w{k}") for k in range(10)]
        gate.open()
        outcomes = [o async for o in r.grpc.admit_proto_stream(reqs)]
        assert sorted(o.request_id for o in outcomes) == sorted(q.request_id for q in reqs)
        assert all(isinstance(o, Materialized) for o in outcomes), outcomes
        assert "OVERLOADED" not in r.server.servicer.admissions.stats.aborted_by_code


async def test_stream_inflight_limit_bounds_one_stream(gate: Gate) -> None:
    """--max-stream-inflight: one stream has at most that many requests admitted; the
    rest stay unread (nothing refused) until outcomes are written."""
    async with running("qwen3_5", workers=1, max_inflight=16, gate=gate,
                       max_stream_inflight=3) as r:  # fmt: skip
        reqs = [_image_request(r.profile, f"s{k}") for k in range(8)]

        async def drain() -> list[Any]:
            return [o async for o in r.grpc.admit_proto_stream(reqs)]

        job = asyncio.ensure_future(drain())
        await until(lambda: r.pool.stats.admitted == 3)
        # the stream is blocked on its window: another stream's request still gets in
        other = asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, "other")))
        await until(lambda: r.pool.stats.admitted == 4)
        assert r.pool.stats.admitted == 4 and not job.done()  # the 4th of the stream waits
        gate.open()
        outcomes = await job
        assert sorted(o.request_id for o in outcomes) == sorted(q.request_id for q in reqs)
        assert all(isinstance(o, Materialized) for o in outcomes), outcomes
        assert isinstance(await other, Materialized)
        assert "OVERLOADED" not in r.server.servicer.admissions.stats.aborted_by_code


async def test_max_grpc_streams_refuses_calls_past_it(gate: Gate) -> None:
    """--max-grpc-streams: past it, a call on another connection is RESOURCE_EXHAUSTED
    (by gRPC itself); one connection waits for a free stream instead."""
    async with running("qwen3_5", workers=2, max_inflight=8, gate=gate, max_streams=2) as r:
        held = [
            asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, f"c{k}")))
            for k in range(2)
        ]
        await until(lambda: r.pool.inflight == 2)
        queued = asyncio.ensure_future(r.grpc.admit_proto(_image_request(r.profile, "queued")))
        # its own TCP connection (channels with equal arguments share one)
        own = [("grpc.use_local_subchannel_pool", 1)]
        async with Client(GrpcTransport(r.address, channel_options=own)) as second:
            with pytest.raises(TransportError, match="RESOURCE_EXHAUSTED"):
                await second.admit(_image_model_request(r.profile, "refused"))
            assert r.pool.stats.admitted == 2  # neither the refused nor the queued one
            gate.open()
            for fut in [*held, queued]:
                assert isinstance(await fut, Materialized)
            assert isinstance(
                await second.admit(_image_model_request(r.profile, "later")), Materialized
            )


async def test_limits_are_counted_before_protobuf_parses(qwen: Running) -> None:
    """A large request over a limit is answered in band TOO_LARGE, with its request_id,
    from its counted bytes (pbwire.check_admit_limits); the server keeps serving."""
    req = _image_request(qwen.profile, "many-items")
    for _ in range(300):
        req.mm_inputs.items.add().CopyFrom(req.mm_inputs.items[0])
    assert req.ByteSize() >= 64 << 10
    for call in (qwen.grpc.admit_proto(req), _first(qwen.grpc.admit_proto_stream([req]))):
        outcome = await call
        assert isinstance(outcome, Aborted) and outcome.code == "TOO_LARGE", outcome
        assert outcome.request_id == "many-items"
        assert outcome.message == "at least 257 items exceed the limit of 256 (--max-items)"
    assert isinstance(await qwen.grpc.admit_proto(_image_request(qwen.profile, "ok")), Materialized)


async def _first(stream: Any) -> Any:
    async for outcome in stream:
        return outcome
    raise AssertionError("the stream ended without an outcome")


def _bytes_call(r: Running, stream: bool = False) -> Any:
    """``Admit`` (``stream``: ``AdmitStream``) on the client's channel, sending the bytes
    it is given as they are."""
    channel = r.grpc._channel
    assert channel is not None
    make = channel.stream_stream if stream else channel.unary_unary
    return make(
        "/mmadmit.v1.Admission/AdmitStream" if stream else "/mmadmit.v1.Admission/Admit",
        request_serializer=None,
        response_deserializer=pb.AdmitResponse.FromString,
    )


async def _unparsable_refused(r: Running, error: grpc.RpcError) -> None:
    """``error`` ended a call on bytes that are no ``AdmitRequest``: INVALID_ARGUMENT in
    mmadmit's words; and the next request is materialized."""
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "does not parse as an AdmitRequest" in error.details()
    assert isinstance(await r.grpc.admit_proto(_image_request(r.profile, "next")), Materialized)


async def test_stream_message_that_does_not_parse_ends_the_stream(qwen: Running) -> None:
    """Earlier requests are still answered; then the call ends INVALID_ARGUMENT."""
    call = _bytes_call(qwen, stream=True)

    def messages() -> Any:
        yield _image_request(qwen.profile, "before").SerializeToString()
        yield b"\xff\xff\xff not protobuf"
        yield _image_request(qwen.profile, "after").SerializeToString()

    answered = []
    with pytest.raises(grpc.RpcError) as info:
        async for resp in call(messages()):
            answered.append(resp.request_id)
    assert answered == ["before"]
    await _unparsable_refused(qwen, info.value)


async def test_draining_pool_answers_shutting_down(qwen: Running) -> None:
    qwen.server.enter_drain()
    qwen.pool.begin_drain()
    outcome = await qwen.grpc.admit_proto(_image_request(qwen.profile, "late"))
    assert isinstance(outcome, Aborted) and outcome.code == "SHUTTING_DOWN", outcome
    assert await qwen.client.health(ADMISSION_SERVICE) == "NOT_SERVING"


async def test_message_limit_is_clamped_to_grpc_max(caplog: pytest.LogCaptureFixture) -> None:
    profile = load_profile(str(MODEL_CONFIG["llama"]))
    pool = MaterializerPool(Materializer(profile), workers=1)
    try:
        with caplog.at_level("WARNING", logger="mmadmit.grpc_server"):
            server = GrpcServer(pool, profile, listen="127.0.0.1:0", max_message_bytes=2**33)
        assert server.max_message_bytes == 2**31 - 1
        assert "exceeds gRPC's maximum" in caplog.text
        address = await server.start()
        assert address.startswith("127.0.0.1:") and int(address.rpartition(":")[2]) > 0
        await server.stop(0)
        await server.stop(0)  # idempotent
    finally:
        pool.close()


async def test_busy_port_is_one_clear_oserror() -> None:
    profile = load_profile(str(MODEL_CONFIG["llama"]))
    pool = MaterializerPool(Materializer(profile), workers=1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = GrpcServer(pool, profile, listen=f"127.0.0.1:{port}", max_message_bytes=1 << 20)
        try:
            with pytest.raises(OSError, match=f"cannot bind gRPC to 127.0.0.1:{port}") as info:
                await server.start()
            assert info.value.errno == errno.EADDRINUSE
        finally:
            await server.stop(0)
            pool.close()


async def test_unary_admit_of_bytes_that_do_not_parse_is_invalid_argument(qwen: Running) -> None:
    """The same bytes end Admit as they end AdmitStream: INVALID_ARGUMENT in mmadmit's
    words (gRPC's own answer would be UNKNOWN naming a Python class)."""
    with pytest.raises(grpc.RpcError) as info:
        await _bytes_call(qwen)(b"\xff\xff\xff not protobuf")
    assert "class" not in info.value.details()
    await _unparsable_refused(qwen, info.value)


async def test_a_request_refused_before_parsing_is_counted_under_its_code() -> None:
    """The refusal decided from the wire bytes is one outcome, counted once under
    TOO_LARGE for transport grpc, like any other (telemetry and the servicer's counts)."""
    telemetry = Telemetry("qwen3_5", log_outcomes=False)
    async with running("qwen3_5", telemetry=telemetry) as r:
        req = _image_request(r.profile, "many-items")
        for _ in range(300):
            req.mm_inputs.items.add().CopyFrom(req.mm_inputs.items[0])
        outcome = await r.grpc.admit_proto(req)
        assert isinstance(outcome, Aborted) and outcome.code == "TOO_LARGE"

        def total(outcome: str, code: str) -> float | None:
            return telemetry.registry.get_sample_value(
                "mmadmit_requests_total", {"transport": "grpc", "outcome": outcome, "code": code}
            )

        assert total("aborted", "TOO_LARGE") == 1
        assert total("aborted", "INVALID_REQUEST") in (None, 0)
        outcomes = r.server.servicer.admissions.stats
        assert outcomes.aborted_by_code == {"TOO_LARGE": 1}  # one count, exported
        assert r.pool.stats.admitted == 0  # never reached the pool
