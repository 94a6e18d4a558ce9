"""The SMG gRPC face in process (docs/spec/SMG_GRPC.md): the real gRPC server and the real
scheduler sockets, with the project's test scheduler (``tests/engine_peers.py``)
on the other side of the engine handshake and SMG's own generated client
(``smg_grpc_proto``) on this side.

Contract pinned here:

* every vector of the Qwen3.5 family, sent as SMG sends it over gRPC
  (placeholder runs in ``input_ids``, ``content_hash`` bytes, grids as side
  tensors, no positions), reaches the scheduler as an ADD its decoder accepts,
  materialized exactly as the vector says (padded ids, unpadded ids, pad
  values, hashes, M-RoPE positions and delta), with the sampling parameters
  SMG's own msgpack encoder would write; the scheduler's output comes back as
  ``GenerateStreamChunk``s and one ``GenerateComplete``;
* a refused request never reaches the scheduler and ends with the status of
  docs/spec/SMG_GRPC.md's table, its message starting with mmadmit's code;
* EPD: each ``encode_bootstrap_info`` entry reaches the scheduler as its item's
  ``encode_handshake`` (item element 9), whether the item kept its encoder
  input or not, and the request is materialized exactly as without it; a
  malformed entry is refused naming it;
* ``Abort`` ends the open stream at once and the scheduler sees the ABORT
  after the ADD; a cancelled call does the same; a request still
  materializing is cancelled there and never forwarded;
* the scheduler's death ends every open call ``UNAVAILABLE``, turns
  ``HealthCheck`` unhealthy and reports the death once;
* ``HealthCheck``, ``GetModelInfo``, ``GetServerInfo``, ``GetLoads`` answer
  from what mmadmit knows; what the msgpack wire cannot carry is
  ``UNIMPLEMENTED`` with a message.

Run with: python -m pytest tests/test_smg_grpc.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import engine_peers
import grpc
import msgspec
import numpy as np
import pytest
import workloads
import zmq.asyncio
from conftest import CONFIGS, grown, load_vector, outcome_counts, until
from mmadmit import wire
from mmadmit.config import build_config
from mmadmit.errors import AbortCode, ConfigError
from mmadmit.grpc_server import GrpcPort
from mmadmit.limits import Limits
from mmadmit.materializer import Materializer
from mmadmit.model import Request
from mmadmit.pool import MaterializerPool
from mmadmit.profile import load_profile
from mmadmit.scheduler_link import SchedulerLink
from mmadmit.smg_grpc import SERVICE, STATUS_OF, SmgGrpcFace
from mmadmit.smg_request import TOP_K_ALL, sampling_array
from mmadmit.telemetry import StatsCollector, Telemetry
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
from smg_grpc_proto import tokenspeed_scheduler_pb2_grpc as ts_grpc
from smg_grpc_proto.generated import common_pb2

pytestmark = pytest.mark.timeout(60)

MODEL = CONFIGS / "qwen3_5.json"
QWEN35_VECTORS = ("qwen3_5_image1", "qwen3_5_mixed", "qwen3_5_video_multi", "qwen3_5_big_hash")


# --------------------------------------------------------------------------- requests


def vector_generate(
    name: str, rid: str, *, stream: bool = False, every_hash: bool = False
) -> tuple[ts.GenerateRequest, Any]:
    """A vector's request as SMG sends it over gRPC (``workloads.generate_request``):
    the gateway-hashed items with their hash as ``content_hash``, the engine-hashed
    ones without (mmadmit hashes their features; ``every_hash``: with the hash the
    vector resolved for them), each item's placeholder token."""
    vec = load_vector(name)
    req = wire.decode_message(vec.frames).request
    assert req is not None
    meta = vec.meta["multimodal"]
    items = meta["items"] if meta else []
    hashes = {i: int(m["hash"]) for i, m in enumerate(items) if m["hash_source"] == "gateway"}
    if every_hash:
        hashes = {i: int(h) for i, h in enumerate(vec.arrays["item_hashes"].tolist())}
    tokens = {
        i: meta["im_token_id"] if m["modality"] == "IMAGE" else meta["video_token_id"]
        for i, m in enumerate(items)
        if m["modality"] in ("IMAGE", "VIDEO")
    }
    msg = workloads.generate_request(req, rid, hashes=hashes, placeholders=tokens, stream=stream)
    return msg, vec


# --------------------------------------------------------------------------- fixture


@dataclass
class Env:
    face: SmgGrpcFace
    stub: ts_grpc.TokenSpeedSchedulerStub
    seen: list[tuple[str, Any]]
    gone: list[str]
    ctx: zmq.asyncio.Context
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    channel: Any = None

    def adds(self) -> list[Request]:
        return [req for kind, req in self.seen if kind == "ADD"]

    def aborts(self) -> list[str]:
        return [rid for kind, rids in self.seen if kind == "ABORT" for rid in rids]

    def scheduler(self, **kwargs: Any) -> None:
        assert self.face.link.endpoint is not None
        self.tasks.append(
            asyncio.ensure_future(
                engine_peers.run_scheduler(
                    self.ctx, self.face.link.endpoint, report=False, seen=self.seen, **kwargs
                )
            )
        )


async def start_face(face: SmgGrpcFace) -> None:
    """The scheduler's handshake on the face's link, then the face starts (as
    ``mmadmit serve`` does)."""
    await face.link.handshake()
    await face.start()


@contextlib.asynccontextmanager
async def face_env(
    *,
    scheduler: dict[str, Any] | None = None,
    workers: int = 1,
    hold: threading.Event | None = None,
    telemetry: Telemetry | None = None,
    limits: Limits | None = None,
    max_inflight: int = 64,
) -> AsyncIterator[Env]:
    profile = load_profile(str(MODEL))

    def before_run(req: Request) -> None:
        if hold is not None and req.rid.startswith("hold"):
            assert hold.wait(20)
        if req.rid.startswith("boom"):
            raise RuntimeError("a worker bug (test hook)")

    pool = MaterializerPool(
        Materializer(profile, limits),
        workers=workers,
        max_inflight=max_inflight,
        inline_max_tokens=0,
        before_run=before_run,
    )
    gone: list[str] = []
    link = SchedulerLink(
        listen="tcp://127.0.0.1:0", engine_index=0, handshake_timeout_s=20, on_gone=gone.append
    )
    face = SmgGrpcFace(
        pool,
        profile,
        link,
        served_model_name="tiny-qwen3.5",
        model_path="/models/tiny-qwen3.5",
        watchdog_s=None,
        telemetry=telemetry,
    )
    ctx = zmq.asyncio.Context()
    await link.bind()
    port = GrpcPort({SERVICE: face.handlers()}, listen="127.0.0.1:0", max_message_bytes=1 << 30)
    address = await port.start()
    channel = grpc.aio.insecure_channel(address)
    env = Env(face, ts_grpc.TokenSpeedSchedulerStub(channel), [], gone, ctx, channel=channel)
    try:
        if scheduler is not None:
            env.scheduler(**scheduler)
            await asyncio.wait_for(start_face(face), 20)
        yield env
    finally:
        await channel.close()
        for task in env.tasks:
            task.cancel()
        await asyncio.gather(*env.tasks, return_exceptions=True)
        await face.stop()
        await link.close()
        await port.stop(0)
        pool.close()
        ctx.term()


async def collect(call: Any) -> list[ts.GenerateResponse]:
    return [resp async for resp in call]


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", QWEN35_VECTORS)
async def test_every_qwen3_5_vector_reaches_the_scheduler_materialized(name: str) -> None:
    async with face_env(scheduler={}) as env:
        msg, vec = vector_generate(name, f"rid-{name}")
        responses = await collect(env.stub.Generate(msg))
        assert [r.WhichOneof("response") for r in responses] == ["complete"]
        complete = responses[0].complete
        assert responses[0].request_id == f"rid-{name}"
        assert list(complete.output_ids) == [11, 12, 13]
        assert complete.finish_reason == "stop"
        assert complete.prompt_tokens == len(msg.tokenized.input_ids)
        (add,) = env.adds()
        want = vec.arrays
        assert add.rid == f"rid-{name}"
        np.testing.assert_array_equal(add.input_ids, want["input_ids_padded"])
        assert add.input_ids_unpadded is not None
        np.testing.assert_array_equal(add.input_ids_unpadded, want["input_ids_unpadded"])
        assert add.mm is not None and add.mm.mrope_positions is not None
        np.testing.assert_array_equal(add.mm.mrope_positions.to_numpy(), want["mrope_positions"])
        assert add.mm.mrope_position_delta_scalar == int(want["mrope_position_delta"][0, 0])
        pads = [item.pad_value for item in add.mm.items]
        assert pads == want["item_pad_values"].tolist()
        hashes = [item.hash for item in add.mm.items]
        assert hashes == [int(h) for h in want["item_hashes"].tolist()]
        assert add.validation_error is None
        # the envelope SMG's msgpack encoder would write
        extra = add.extra
        sampling = wire._ANY.decode(extra.raw[wire.F_SAMPLING])
        assert sampling == sampling_array(msg.sampling_params)
        assert sampling[0] == 16 and sampling[5] == TOP_K_ALL and sampling[-1] is True


async def test_stream_chunks_then_complete_and_the_envelope() -> None:
    async with face_env(scheduler={}) as env:
        msg = ts.GenerateRequest(request_id="s1", stream=True, return_logprob=True)
        msg.tokenized.input_ids.extend([1, 2, 3, 4])
        msg.sampling_params.stop.extend(["ab", "\n"])
        msg.sampling_params.top_k = 5
        msg.sampling_params.sampling_seed = 7
        responses = await collect(env.stub.Generate(msg))
        kinds = [r.WhichOneof("response") for r in responses]
        assert kinds == ["chunk", "complete"]
        assert list(responses[0].chunk.token_ids) == [11, 12, 13]
        assert responses[1].complete.finish_reason == "stop"
        (add,) = env.adds()
        assert add.mm is None and add.input_ids.tolist() == [1, 2, 3, 4]
        raw = [wire._ANY.decode(r) for r in add.extra.raw]
        assert raw[0] == "TokenizedGenerateReqInput" and raw[6] is True and raw[10] is True
        assert raw[7] == -1  # logprob_start_len unset
        sampling = raw[wire.F_SAMPLING]
        assert sampling[5] == 5 and sampling[23] == 7
        assert sampling[26] == ["ab", "\n"] and sampling[27] == 2 and sampling[28] is True


async def test_an_add_that_fails_to_encode_ends_internal_counted_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The request materialized but its ADD could not be made (a bug of ours): the call
    ends INTERNAL, the scheduler never sees it, and it is counted INTERNAL once, never
    materialized (the ladder counts only once the outcome is encoded)."""
    from mmadmit import smg_grpc

    real = smg_grpc.wire.encode_request

    def encode(req: Request, *args: Any, **kwargs: Any) -> Any:
        if req.rid == "enc":
            raise RuntimeError("planted: the ADD encoder failed")
        return real(req, *args, **kwargs)

    async with face_env(scheduler={}) as env:
        monkeypatch.setattr(smg_grpc.wire, "encode_request", encode)
        msg = ts.GenerateRequest(request_id="enc")
        msg.tokenized.input_ids.extend([1, 2, 3])
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(msg))
        assert info.value.code() is grpc.StatusCode.INTERNAL
        assert info.value.details().startswith("INTERNAL: ")
        ok = ts.GenerateRequest(request_id="ok")
        ok.tokenized.input_ids.extend([1, 2, 3])
        (resp,) = await collect(env.stub.Generate(ok))
        assert resp.complete.finish_reason == "stop"
        assert [req.rid for req in env.adds()] == ["ok"]
        stats = env.face.admissions.stats
        assert stats.materialized == 1 and stats.aborted_by_code == {"INTERNAL": 1}


@pytest.mark.parametrize("limit", ["max_tokens", "max_items"])
async def test_request_limits_hold_at_their_value_and_refuse_one_past_it(limit: str) -> None:
    """The face enforces the request limits as the other transports do: a request at
    the limit reaches the scheduler, one past it ends TOO_LARGE naming the flag."""
    msg, _ = vector_generate("qwen3_5_mixed", "at")
    value = {
        "max_tokens": len(msg.tokenized.input_ids),
        "max_items": len(msg.mm_inputs.items),
    }[limit]
    async with face_env(scheduler={}, limits=Limits(**{limit: value})) as env:
        (resp,) = await collect(env.stub.Generate(msg))
        assert resp.complete.finish_reason == "stop"
    async with face_env(scheduler={}, limits=Limits(**{limit: value - 1})) as env:
        msg.request_id = "past"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(msg))
        assert info.value.code() is STATUS_OF[AbortCode.TOO_LARGE]
        assert info.value.details().startswith("TOO_LARGE: ")
        assert f"--{limit.replace('_', '-')}" in info.value.details()
        assert not env.adds()


async def test_a_refused_request_never_reaches_the_scheduler() -> None:
    async with face_env(scheduler={}) as env:
        msg, _ = vector_generate("qwen3_5_image1", "bad")
        item = msg.mm_inputs.items[0]
        ph = item.placeholders[0]
        item.placeholders[0].length = ph.length - 1  # one token short of its grid
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(msg))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("INVALID_REQUEST: ")
        empty = ts.GenerateRequest(request_id="empty")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(empty))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "input_ids is empty" in info.value.details()
        many = ts.GenerateRequest(request_id="n2")
        many.tokenized.input_ids.append(1)
        many.sampling_params.n = 2
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(many))
        assert info.value.details().startswith("UNSUPPORTED: ")
        await asyncio.sleep(0.1)
        assert env.adds() == []
        assert env.face.admissions.stats.aborted_by_code == {"INVALID_REQUEST": 2, "UNSUPPORTED": 1}


def handshake(i: int) -> dict[str, Any]:
    return {
        "bootstrap_host": f"10.0.0.{i}",
        "bootstrap_port": 9000 + i,
        "bootstrap_room": 2**62 + i,
    }


def epd_generate(rid: str, keep_inputs: set[int]) -> tuple[ts.GenerateRequest, Any]:
    """The mixed Qwen3.5 vector as SMG sends it to the prefill in EPD mode: every item's
    hash as ``content_hash``, one ``encode_bootstrap_info`` entry per item (in reverse
    order: entries name their item), encoder inputs kept only for ``keep_inputs``."""
    msg, vec = vector_generate("qwen3_5_mixed", rid, every_hash=True)
    n = len(msg.mm_inputs.items)
    for i in reversed(range(n)):
        msg.encode_bootstrap_info.items.add(item_index=i, **handshake(i))
        if i not in keep_inputs:
            msg.mm_inputs.items[i].ClearField("encoder_input")
    return msg, vec


@pytest.mark.parametrize("keep", [set(), {0}], ids=["no_encoder_inputs", "first_keeps_its_input"])
async def test_epd_entries_reach_the_scheduler_as_item_handshakes(keep: set[int]) -> None:
    async with face_env(scheduler={}) as env:
        msg, vec = epd_generate("epd", keep)
        (resp,) = await collect(env.stub.Generate(msg))
        assert resp.complete.finish_reason == "stop"
        (add,) = env.adds()
        want = vec.arrays
        # materialized exactly as the same request without EPD
        np.testing.assert_array_equal(add.input_ids, want["input_ids_padded"])
        np.testing.assert_array_equal(add.input_ids_unpadded, want["input_ids_unpadded"])
        assert add.mm is not None and add.mm.mrope_positions is not None
        np.testing.assert_array_equal(add.mm.mrope_positions.to_numpy(), want["mrope_positions"])
        assert [item.pad_value for item in add.mm.items] == want["item_pad_values"].tolist()
        for i, item in enumerate(add.mm.items):
            assert item.encode_handshake == handshake(i)
            # item element 9 as the scheduler's decoder reads it
            assert msgspec.msgpack.decode(item.extra.elems()[9]) == handshake(i)
            assert (item.feature is not None) == (i in keep)


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("out_of_range", "encode_bootstrap_info.items[1]: item_index 1000 is out of range"),
        ("twice", "encode_bootstrap_info.items[1]: item 0 already has a handshake"),
        ("no_mm_inputs", "encode_bootstrap_info has 1 entries but the request has no mm_inputs"),
        ("no_hash_no_input", "item 0: no pad_value and no content hash"),
    ],
)  # fmt: skip
async def test_a_malformed_encode_bootstrap_info_is_refused_naming_the_entry(
    case: str, fragment: str
) -> None:
    async with face_env(scheduler={}) as env:
        msg, _ = epd_generate(case, set())
        entries = msg.encode_bootstrap_info.items
        if case == "out_of_range":
            entries[1].item_index = 1000
        elif case == "twice":
            entries[1].item_index = entries[0].item_index = 0
        elif case == "no_mm_inputs":
            msg.ClearField("mm_inputs")
            del entries[1:]
        else:
            msg.mm_inputs.items[0].ClearField("content_hash")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(msg))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("INVALID_REQUEST: ")
        assert fragment in info.value.details()
        await asyncio.sleep(0.05)
        assert env.adds() == []


# docs/spec/SMG_GRPC.md's table, and what SMG makes of each status (HTTP 400: no retry; 429 and
# 503: another worker is tried): a code in the wrong row changes what the client sees.
SMG_TABLE = {
    AbortCode.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,  # 400
    AbortCode.TEXT_ONLY_MODEL: grpc.StatusCode.INVALID_ARGUMENT,  # 400
    AbortCode.UNSUPPORTED: grpc.StatusCode.INVALID_ARGUMENT,  # 400
    AbortCode.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,  # 400
    AbortCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,  # 429
    AbortCode.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,  # 503
    AbortCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,  # 504
    AbortCode.CANCELLED: grpc.StatusCode.CANCELLED,
    AbortCode.INTERNAL: grpc.StatusCode.INTERNAL,  # 500
}


def test_status_table_is_smgs() -> None:
    assert set(STATUS_OF) == set(AbortCode)
    assert STATUS_OF == SMG_TABLE


async def test_each_refusal_ends_with_its_table_status_through_the_face() -> None:
    """TOO_LARGE, OVERLOADED and INTERNAL refusals through the face (the others:
    the tests above), each with docs/spec/SMG_GRPC.md's status and its code first."""
    hold = threading.Event()
    limits = Limits(max_tokens=8)
    async with face_env(scheduler={}, hold=hold, limits=limits, max_inflight=1) as env:

        def generate(rid: str, tokens: int = 3) -> ts.GenerateRequest:
            req = ts.GenerateRequest(request_id=rid)
            req.tokenized.input_ids.extend(range(1, tokens + 1))
            return req

        async def refused(req: ts.GenerateRequest, code: AbortCode) -> None:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(collect(env.stub.Generate(req)), 10)
            assert info.value.code() is SMG_TABLE[code], info.value.details()
            assert str(info.value.details()).startswith(f"{code.value}: ")

        await refused(generate("big", tokens=9), AbortCode.TOO_LARGE)
        await refused(generate("boom"), AbortCode.INTERNAL)
        held = asyncio.ensure_future(collect(env.stub.Generate(generate("hold-1"))))
        await until(lambda: "hold-1" in env.face.admissions.rids())
        await refused(generate("over"), AbortCode.OVERLOADED)
        hold.set()
        (resp,) = await asyncio.wait_for(held, 10)
        assert resp.complete.finish_reason == "stop"
        assert [req.rid for req in env.adds()] == ["hold-1"]
        codes = env.face.admissions.stats.aborted_by_code
        assert codes == {"TOO_LARGE": 1, "INTERNAL": 1, "OVERLOADED": 1}


async def test_abort_ends_the_stream_and_follows_the_add() -> None:
    async with face_env(scheduler={"delay_s": 30}) as env:
        msg = ts.GenerateRequest(request_id="a1", stream=True)
        msg.tokenized.input_ids.extend([1, 2, 3])
        call = env.stub.Generate(msg)
        reader = asyncio.ensure_future(collect(call))
        await until(lambda: len(env.adds()) == 1)
        resp = await env.stub.Abort(ts.AbortRequest(request_id="a1", reason="client left"))
        assert resp.success
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(reader, 5)
        assert info.value.code() is grpc.StatusCode.CANCELLED
        await until(lambda: env.aborts() == ["a1"])
        assert [kind for kind, _ in env.seen] == ["ADD", "ABORT"]
        again = await env.stub.Abort(ts.AbortRequest(request_id="a1"))
        assert not again.success


async def test_a_cancelled_call_sends_abort_after_its_add() -> None:
    async with face_env(scheduler={"delay_s": 30}) as env:
        msg = ts.GenerateRequest(request_id="c1", stream=True)
        msg.tokenized.input_ids.extend([1, 2, 3])
        call = env.stub.Generate(msg)
        reader = asyncio.ensure_future(collect(call))
        await until(lambda: len(env.adds()) == 1)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await until(lambda: env.aborts() == ["c1"])
        assert [kind for kind, _ in env.seen] == ["ADD", "ABORT"]
        await until(lambda: env.face.stats.calls_cancelled == 1)


async def test_abort_while_materializing_never_forwards() -> None:
    hold = threading.Event()
    async with face_env(scheduler={}, hold=hold) as env:
        msg, _ = vector_generate("qwen3_5_image1", "hold-1")
        reader = asyncio.ensure_future(collect(env.stub.Generate(msg)))
        await until(lambda: "hold-1" in env.face.admissions.rids())
        resp = await env.stub.Abort(ts.AbortRequest(request_id="hold-1"))
        assert resp.success
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(reader, 5)
        assert info.value.code() is grpc.StatusCode.CANCELLED
        assert info.value.details().startswith("CANCELLED: ")
        hold.set()
        await asyncio.sleep(0.2)
        assert env.seen == []


async def test_duplicate_request_id_in_flight_is_refused() -> None:
    async with face_env(scheduler={"delay_s": 30}) as env:
        msg = ts.GenerateRequest(request_id="d1")
        msg.tokenized.input_ids.extend([1, 2])
        first = asyncio.ensure_future(collect(env.stub.Generate(msg)))
        await until(lambda: len(env.adds()) == 1)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(msg))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "already in flight" in info.value.details()
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)


async def test_scheduler_death_ends_open_calls_unavailable() -> None:
    async with face_env(scheduler={"dead_after": 2, "delay_s": 30}) as env:
        msg = ts.GenerateRequest(request_id="x1", stream=True)
        msg.tokenized.input_ids.extend([1, 2, 3])
        first = asyncio.ensure_future(collect(env.stub.Generate(msg)))
        await until(lambda: len(env.adds()) == 1)
        msg2 = ts.GenerateRequest(request_id="x2")
        msg2.tokenized.input_ids.extend([1, 2, 3])
        second = asyncio.ensure_future(collect(env.stub.Generate(msg2)))
        for fut in (first, second):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(fut, 10)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert env.gone == ["it sent ENGINE_CORE_DEAD"]
        health = await env.stub.HealthCheck(ts.HealthCheckRequest())
        assert not health.healthy and "went away" in health.message
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(env.stub.Generate(ts.GenerateRequest(request_id="late")))
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE


# --------------------------------------------------------------------------- the connections


def plain(rid: str) -> ts.GenerateRequest:
    msg = ts.GenerateRequest(request_id=rid)
    msg.tokenized.input_ids.extend([1, 2, 3])
    return msg


async def test_a_dropped_connection_after_the_handshake_is_death() -> None:
    """The scheduler's sockets close (a crash, no ENGINE_CORE_DEAD): every open call
    ends UNAVAILABLE promptly and on_gone fires once."""
    async with face_env(scheduler={"delay_s": 30}) as env:
        calls = []
        for rid in ("d1", "d2"):
            calls.append(asyncio.ensure_future(collect(env.stub.Generate(plain(rid)))))
            await until(lambda rid=rid: rid in [r.rid for r in env.adds()])
        for task in env.tasks:
            task.cancel()  # the test scheduler closes its sockets
        for call in calls:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await asyncio.wait_for(call, 5)
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
        assert len(env.gone) == 1 and env.gone[0].endswith("connection dropped")
        assert env.face.link.gone and env.face.link.stats.scheduler_alive == 0
        health = await env.stub.HealthCheck(ts.HealthCheckRequest())
        assert not health.healthy


async def test_a_drop_before_the_handshake_is_not_death() -> None:
    """A scheduler that connects its input and output and dies before READY, then
    comes back: the face completes the new handshake and serves; nothing is gone."""
    async with face_env() as env:
        assert env.face.link.endpoint is not None
        handshaking = asyncio.ensure_future(start_face(env.face))
        env.tasks.append(handshaking)
        first = await asyncio.wait_for(
            engine_peers.connect_scheduler(env.ctx, env.face.link.endpoint, ready=False), 10
        )
        first.close()
        await until(lambda: env.face.link.stats.scheduler_drops == 2)  # input and output
        env.scheduler()  # the restarted one: a new HELLO
        await asyncio.wait_for(handshaking, 20)
        (resp,) = await asyncio.wait_for(collect(env.stub.Generate(plain("after"))), 10)
        assert resp.complete.finish_reason == "stop"
        assert env.gone == [] and not env.face.link.gone
        assert (await env.stub.HealthCheck(ts.HealthCheckRequest())).healthy


async def test_a_drop_while_stopping_is_not_death(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler goes away while the face stops (SIGTERM reaches both): no death
    is reported (on_gone would make ``mmadmit serve`` exit 3)."""
    async with face_env() as env:
        face = env.face
        assert face.link.endpoint is not None
        sched, _ = await asyncio.wait_for(
            asyncio.gather(
                engine_peers.connect_scheduler(env.ctx, face.link.endpoint), start_face(face)
            ),
            20,
        )
        assert face._sender is not None
        sender_stop = face._sender.stop

        async def stop_slowly() -> None:  # the scheduler drops while the face stops
            sched.close()
            await until(lambda: face.link.stats.scheduler_drops == 2)
            await sender_stop()

        monkeypatch.setattr(face._sender, "stop", stop_slowly)
        try:
            await asyncio.wait_for(face.stop(), 10)
        finally:
            sched.close()
        assert face.link.stats.scheduler_drops == 2  # seen, while stopping
        assert env.gone == [] and not face.link.gone


async def test_health_model_info_server_info_loads_and_unimplemented() -> None:
    async with face_env() as env:
        before = await env.stub.HealthCheck(ts.HealthCheckRequest())
        assert not before.healthy and "handshake" in before.message
        env.scheduler()
        await asyncio.wait_for(start_face(env.face), 20)
        after = await env.stub.HealthCheck(ts.HealthCheckRequest())
        assert after.healthy
        info = await env.stub.GetModelInfo(ts.GetModelInfoRequest())
        assert info.served_model_name == "tiny-qwen3.5"
        assert info.model_path == "/models/tiny-qwen3.5"
        assert info.supports_vision and info.supports_multimodal
        assert list(info.supported_modalities) == [common_pb2.IMAGE, common_pb2.VIDEO]
        assert info.max_context_length == engine_peers.READY_RESPONSE["max_model_len"]
        assert info.model_dtype == "bfloat16"
        server = await env.stub.GetServerInfo(ts.GetServerInfoRequest())
        assert server.server_args["served_model_name"] == "tiny-qwen3.5"
        assert server.scheduler_info["max_num_seqs"] == 256
        msg = ts.GenerateRequest(request_id="l1")
        msg.tokenized.input_ids.extend([1, 2])
        await collect(env.stub.Generate(msg))
        loads = await env.stub.GetLoads(ts.GetLoadsRequest())
        (load,) = loads.loads
        assert load.dp_rank == 0 and loads.dp_rank_count == 1
        assert env.face.stats.output_messages == 1
        with pytest.raises(grpc.aio.AioRpcError) as info_err:
            await env.stub.FlushCache(common_pb2.FlushCacheRequest())
        assert info_err.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert "FlushCache" in info_err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as info_err:
            await collect(env.stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
        assert info_err.value.code() is grpc.StatusCode.UNIMPLEMENTED
        assert "tokenizer" in info_err.value.details()


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"smg_grpc_listen": "127.0.0.1:0"}, "needs --engine-handshake-listen"),
        (
            {
                "smg_grpc_listen": "127.0.0.1:0",
                "engine_handshake_listen": "tcp://127.0.0.1:0",
                "smg_handshake": "tcp://127.0.0.1:1",
            },
            "excludes --smg-handshake",
        ),
        (
            {
                "smg_grpc_listen": "127.0.0.1:0",
                "engine_handshake_listen": "tcp://127.0.0.1:0",
                "zmq_forward": "tcp://127.0.0.1:1",
            },
            "excludes --zmq-forward",
        ),
        ({"smg_grpc_listen": "nowhere"}, "HOST:PORT"),
    ],
)
def test_face_flags_are_checked_at_start(args: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        build_config(args, environ={})


def test_served_model_name_defaults(tmp_path: Any) -> None:
    face = {"smg_grpc_listen": "127.0.0.1:0", "engine_handshake_listen": "tcp://127.0.0.1:0"}
    assert build_config(face, environ={}).model_name() == "qwen2_5_vl"
    assert build_config({**face, "model": str(MODEL)}, environ={}).model_name() == str(MODEL.parent)
    folder = tmp_path / "Qwen3.5-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(MODEL.read_text())
    assert build_config({**face, "model": str(folder)}, environ={}).model_name() == str(folder)
    named = {**face, "served_model_name": "qwen"}
    assert build_config(named, environ={}).model_name() == "qwen"


async def test_outcomes_are_counted_once_under_their_own_transport_label(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level("INFO", logger="mmadmit.outcome")
    telemetry = Telemetry("qwen3_5", log_outcomes=True)
    async with face_env(scheduler={}, telemetry=telemetry) as env:
        telemetry.registry.register(StatsCollector([env.face.pool, env.face], {}))
        ok = ts.GenerateRequest(request_id="m1")
        ok.tokenized.input_ids.extend([1, 2, 3])
        await collect(env.stub.Generate(ok))
        bad = ts.GenerateRequest(request_id="m2")
        with pytest.raises(grpc.aio.AioRpcError):
            await collect(env.stub.Generate(bad))

        def total(outcome: str, code: str) -> float | None:
            return telemetry.registry.get_sample_value(
                "mmadmit_requests_total",
                {"transport": "smg_grpc", "outcome": outcome, "code": code},
            )

        assert total("materialized", "OK") == 1
        assert total("aborted", "INVALID_REQUEST") == 1
        assert telemetry.registry.get_sample_value("mmadmit_smg_grpc_adds_sent_total") == 1
        assert telemetry.registry.get_sample_value("mmadmit_smg_grpc_completes_total") == 1
        assert env.face.admissions.stats.materialized == 1
        assert env.face.admissions.stats.aborted_by_code == {"INVALID_REQUEST": 1}
    lines = [r.getMessage() for r in caplog.records if r.name == "mmadmit.outcome"]
    assert len(lines) == 2 and all("transport=smg_grpc" in line for line in lines)


async def test_each_outcome_adds_one_to_its_own_sample_only() -> None:
    """Materialized, refused while translating (INVALID_REQUEST, UNSUPPORTED), refused
    while draining: each adds exactly 1 to its own ``requests_total{transport=
    "smg_grpc"}`` sample and nothing to any other (every code is present from the start)."""
    telemetry = Telemetry("qwen3_5", log_outcomes=False)
    async with face_env(scheduler={}, telemetry=telemetry) as env:
        counts = outcome_counts(telemetry.registry)
        assert len(counts) == 1 + len(AbortCode) and not any(counts.values())

        def generate(rid: str, n: int = 1) -> ts.GenerateRequest:
            req = ts.GenerateRequest(request_id=rid)
            req.tokenized.input_ids.extend([1, 2, 3] if rid != "empty" else [])
            req.sampling_params.n = n
            return req

        cases = [
            ("OK", generate("ok")),
            ("INVALID_REQUEST", ts.GenerateRequest(request_id="empty")),
            ("UNSUPPORTED", generate("two", n=2)),
            ("SHUTTING_DOWN", generate("late")),
        ]
        for code, req in cases:
            if code == "SHUTTING_DOWN":
                env.face.begin_drain()
            before = outcome_counts(telemetry.registry)
            if code == "OK":
                await collect(env.stub.Generate(req))
            else:
                with pytest.raises(grpc.aio.AioRpcError):
                    await collect(env.stub.Generate(req))
            outcome = "materialized" if code == "OK" else "aborted"
            assert grown(before, outcome_counts(telemetry.registry)) == {
                ("smg_grpc", outcome, code): 1
            }, code


async def test_logprobs_and_the_schedulers_load_reach_smg() -> None:
    async with face_env(scheduler={"chunks": 3}) as env:
        streamed = ts.GenerateRequest(request_id="lp1", stream=True, return_logprob=True)
        streamed.tokenized.input_ids.extend([1, 2, 3])
        responses = await collect(env.stub.Generate(streamed))
        assert [r.WhichOneof("response") for r in responses] == ["chunk"] * 3 + ["complete"]
        for k, resp in enumerate(responses[:3]):
            assert list(resp.chunk.token_ids) == [11 + k]
            lp = resp.chunk.output_logprobs
            assert list(lp.token_ids) == [11 + k]
            assert lp.token_logprobs[0] == pytest.approx(engine_peers.logprob_of(11 + k))
            assert len(lp.top_logprobs) == 1
        whole = ts.GenerateRequest(request_id="lp2", return_logprob=True)
        whole.tokenized.input_ids.extend([1, 2, 3])
        (resp,) = await collect(env.stub.Generate(whole))
        complete = resp.complete
        assert list(complete.output_ids) == [11, 12, 13]
        assert list(complete.output_logprobs.token_ids) == [11, 12, 13]
        assert complete.completion_tokens == 3
        plain = ts.GenerateRequest(request_id="lp3")
        plain.tokenized.input_ids.extend([1, 2, 3])
        (resp,) = await collect(env.stub.Generate(plain))
        assert not resp.complete.HasField("output_logprobs")
        loads = await env.stub.GetLoads(ts.GetLoadsRequest())
        (load,) = loads.loads
        total = engine_peers.READY_RESPONSE["num_gpu_blocks"]
        assert env.face.outputs.loads.kv_total_pages == total
        assert load.token_usage == pytest.approx(env.face.outputs.loads.kv_active_pages / total)


async def test_sigterm_drains_forwarded_requests_then_exits_0(tmp_path: Any) -> None:
    """``mmadmit serve`` with the face: the ready line names both addresses; on SIGTERM
    health turns unhealthy, a new call ends UNAVAILABLE (SHUTTING_DOWN), the call
    already forwarded still gets its outputs, then the process exits 0."""
    from test_smg_real import READY_LINE, Mmadmit

    mm = Mmadmit(MODEL, "--smg-grpc-listen", "127.0.0.1:0", "--drain-timeout", "10")
    ctx = zmq.asyncio.Context()
    seen: list[tuple[str, Any]] = []
    task: asyncio.Task[None] | None = None
    try:
        await mm.wait_for(lambda: mm.engine is not None, "engine-handshake line")
        assert mm.engine is not None
        task = asyncio.ensure_future(
            engine_peers.run_scheduler(ctx, mm.engine, report=False, seen=seen, delay_s=1.5)
        )
        await mm.wait_for(mm.ready.is_set, "ready line")
        ready = next(line for line in mm.lines if READY_LINE.match(line))
        assert ready.endswith(f"smg-grpc={mm.smg_grpc} engine={mm.engine}")
        async with grpc.aio.insecure_channel(str(mm.smg_grpc)) as channel:
            stub = ts_grpc.TokenSpeedSchedulerStub(channel)
            assert (await stub.HealthCheck(ts.HealthCheckRequest())).healthy
            first = ts.GenerateRequest(request_id="before")
            first.tokenized.input_ids.extend([1, 2, 3])
            pending = asyncio.ensure_future(collect(stub.Generate(first)))
            await until(lambda: len(seen) == 1)
            mm.proc.send_signal(signal.SIGTERM)
            await until(lambda: any("[shutdown] signal" in line for line in mm.lines))
            health = await stub.HealthCheck(ts.HealthCheckRequest())
            assert not health.healthy
            late = ts.GenerateRequest(request_id="after")
            late.tokenized.input_ids.extend([1, 2, 3])
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await collect(stub.Generate(late))
            assert info.value.code() is grpc.StatusCode.UNAVAILABLE
            assert info.value.details().startswith("SHUTTING_DOWN: ")
            (resp,) = await asyncio.wait_for(pending, 10)
            assert resp.complete.finish_reason == "stop"
        assert await mm.wait_exit() == 0
        assert [kind for kind, _ in seen] == ["ADD"]
    finally:
        mm.stop()
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        ctx.term()


async def test_bytes_that_do_not_parse_end_generate_invalid_argument() -> None:
    async with face_env(scheduler={}) as env:
        call = env.channel.unary_stream(
            f"/{SERVICE}/Generate",
            request_serializer=None,
            response_deserializer=ts.GenerateResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await collect(call(b"\xff\xff\xff not protobuf"))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("INVALID_REQUEST: the message does not parse")
        assert env.seen == []
