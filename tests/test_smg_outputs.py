"""The SMG gRPC face and what its scheduler sends back, in process (docs/spec/SMG_GRPC.md).

Contract pinned here, with a scheduler the test drives itself
(:func:`engine_peers.connect_scheduler`) behind the real face and gRPC server:

* a scheduler output the face cannot turn into a response (a token id or count
  outside uint32, a bool where an int belongs, a logprob that is not a number,
  logprob columns that do not pair up, a missing column, another tag, bytes
  that do not decode while their rids can be read) ends that call ``INTERNAL``
  at once, never ``UNKNOWN`` and never at the client's deadline, with a message
  naming the request, the field and the value; the scheduler gets an ABORT for
  it; the other requests of the same output get their parts;
* an unusable output that names no open call is counted
  (``outputs_undecodable``) and logged;
* values at the edge of their field (a token id of 2**32 - 1) pass.

Run with: python -m pytest tests/test_smg_outputs.py -q -p no:cacheprovider
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import engine_peers
import grpc
import msgspec
import pytest
from conftest import until
from mmadmit import smg_outputs
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
from test_smg_grpc import Env, collect, face_env, start_face

pytestmark = pytest.mark.timeout(60)

U32_MAX = 2**32 - 1


def slim(
    rids: list[str],
    ids: list[Any] | None = None,
    *,
    reasons: list[Any] | None = None,
    prompt: list[Any] | None = None,
    completion: list[Any] | None = None,
    cached: list[Any] | None = None,
    val: list[Any] | None = None,
    idx: list[Any] | None = None,
    tag: str = "BatchTokenIDOutSlim",
) -> list[Any]:
    """A ``BatchTokenIDOutSlim`` body (engine_peers.output_frames' 14 elements), every
    rid finished ``stop`` with [11, 12, 13] unless told otherwise."""
    n = len(rids)
    return [
        tag,
        rids,
        ids if ids is not None else [[11, 12, 13]] * n,
        reasons if reasons is not None else ["stop"] * n,
        prompt if prompt is not None else [3] * n,
        completion if completion is not None else [3] * n,
        cached if cached is not None else [0] * n,
        val if val is not None else [[]] * n,
        idx if idx is not None else [[]] * n,
        0,
        *engine_peers.load_snapshot(1, 3),
    ]


@contextlib.asynccontextmanager
async def driven() -> AsyncIterator[tuple[Env, engine_peers.SchedulerSockets]]:
    """The face with a scheduler the test drives (handshake done)."""
    async with face_env() as env:
        assert env.face.link.endpoint is not None
        sched, _ = await asyncio.wait_for(
            asyncio.gather(
                engine_peers.connect_scheduler(env.ctx, env.face.link.endpoint),
                start_face(env.face),
            ),
            20,
        )
        try:
            yield env, sched
        finally:
            sched.close()


def request(rid: str, *, stream: bool = False, logprobs: bool = False) -> ts.GenerateRequest:
    msg = ts.GenerateRequest(request_id=rid, stream=stream, return_logprob=logprobs)
    msg.tokenized.input_ids.extend([1, 2, 3])
    return msg


async def open_call(
    env: Env, sched: engine_peers.SchedulerSockets, rid: str, **kwargs: Any
) -> asyncio.Future[list[ts.GenerateResponse]]:
    """A Generate call whose ADD the scheduler has read."""
    call = asyncio.ensure_future(collect(env.stub.Generate(request(rid, **kwargs))))
    kind, req = await asyncio.wait_for(sched.recv(), 10)
    assert kind == "ADD" and req.rid == rid
    return call


async def ends_internal(call: asyncio.Future[Any]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 5)  # at once, not at a deadline
    assert info.value.code() is grpc.StatusCode.INTERNAL, info.value.details()
    details = info.value.details()
    assert details is not None and details.startswith("INTERNAL: ")
    return details


def truncated(rid: str) -> bytes:
    return msgspec.msgpack.encode(slim([rid]))[:-3]


def case(name: str, body: Any, says: str) -> Any:
    return pytest.param(body, says, id=name)


# (body for rid "r1", or bytes; what the message says after "request 'r1' ")
BAD_OUTPUTS = [
    case(
        "id over",
        slim(["r1"], [[11, 12, 13, 2**32]]),
        "has output_ids[3] = 4294967296, outside uint32",
    ),
    case("negative id", slim(["r1"], [[-1]]), "has output_ids[0] = -1, outside uint32"),
    case("float id", slim(["r1"], [[1.5]]), "has output_ids[0] = 1.5, not an int"),
    case(
        "bool id", slim(["r1"], [[True]]), "has output_ids[0] = True, a bool where an int belongs"
    ),
    case("ids not a list", slim(["r1"], [7]), "has output_ids = 7, not an array"),
    case(
        "prompt over",
        slim(["r1"], prompt=[2**32]),
        "has prompt_tokens = 4294967296, outside uint32",
    ),
    case(
        "completion < 0",
        slim(["r1"], completion=[-3]),
        "has completion_tokens = -3, outside uint32",
    ),
    case(
        "cached bool",
        slim(["r1"], cached=[False]),
        "has cached_tokens = False, a bool where an int belongs",
    ),
    case(
        "u64 count",
        slim(["r1"], prompt=[2**64 - 1]),
        f"has prompt_tokens = {2**64 - 1}, outside uint32",
    ),
    case(
        "bool logprob id",
        slim(["r1"], val=[[-0.1, -0.2, -0.3]], idx=[[11, True, 13]]),
        "has logprobs_idx[1] = True, a bool where an int belongs",
    ),
    case(
        "logprob id over",
        slim(["r1"], [[11]], val=[[-0.1]], idx=[[2**32 + 5]]),
        "has logprobs_idx[0] = 4294967301, outside uint32",
    ),
    case(
        "logprob a string",
        slim(["r1"], val=[["x", -0.2, -0.3]], idx=[[11, 12, 13]]),
        "has logprobs_val[0] = 'x', not a number",
    ),
    case(
        "logprob a bool",
        slim(["r1"], val=[[-0.1, True, -0.3]], idx=[[11, 12, 13]]),
        "has logprobs_val[1] = True, a bool where a float belongs",
    ),
    case(
        "logprobs unpaired",
        slim(["r1"], val=[[-0.1, -0.2]], idx=[[11, 12, 13]]),
        "has logprobs_val of 2 value(s) but logprobs_idx of 3 id(s)",
    ),
    case(
        "logprob ids alone",
        slim(["r1"], val=[None], idx=[[11, 12, 13]]),
        "has logprobs_val of nil but logprobs_idx of 3 id(s)",
    ),
    case("no reasons column", slim(["r1"])[:3], "has no finished_reasons column (3 elements)"),
    case(
        "column a map",
        [*slim(["r1"])[:4], {"r1": 3}],
        "has prompt_tokens = {'r1': 3}, not an array (one entry per rid)",
    ),
    case(
        "another tag",
        slim(["r1"], tag="BatchTokenIDOut"),
        "is tagged 'BatchTokenIDOut', not 'BatchTokenIDOutSlim'",
    ),
    case("truncated", truncated("r1"), "does not decode as msgpack (Input data was truncated)"),
    case(
        "trailing byte",
        msgspec.msgpack.encode(slim(["r1"])) + b"\xc1",
        "does not decode as msgpack (MessagePack data is malformed: trailing characters",
    ),
]


@pytest.mark.parametrize(("body", "says"), BAD_OUTPUTS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_an_unusable_output_ends_its_call_internal_naming_the_field(
    body: Any, says: str, stream: bool
) -> None:
    async with driven() as (env, sched):
        call = await open_call(env, sched, "r1", stream=stream, logprobs=True)
        await sched.send(body)
        details = await ends_internal(call)
        assert details.startswith(f"INTERNAL: the scheduler's output for request 'r1' {says}")
        assert await asyncio.wait_for(sched.recv(), 5) == ("ABORT", ["r1"])
        assert env.face.stats.outputs_bad == 1
        assert env.face.stats.open_calls == 0
        # the face goes on: the next request is served
        again = await open_call(env, sched, "r2")
        await sched.send(slim(["r2"], [[U32_MAX]], prompt=[U32_MAX]))
        (resp,) = await asyncio.wait_for(again, 5)
        assert list(resp.complete.output_ids) == [U32_MAX]
        assert resp.complete.prompt_tokens == U32_MAX


async def test_a_bad_part_ends_only_its_own_call() -> None:
    async with driven() as (env, sched):
        bad = await open_call(env, sched, "bad", stream=True)
        good = await open_call(env, sched, "good", logprobs=True)
        body = slim(
            ["bad", "gone", "good"],
            [[1, 2**32], [5], [7, 8]],
            val=[[], [], [-0.5, -0.25]],
            idx=[[], [], [7, 8]],
        )
        await sched.send(body)
        details = await ends_internal(bad)
        assert "request 'bad' has output_ids[1] = 4294967296, outside uint32" in details
        (resp,) = await asyncio.wait_for(good, 5)
        assert list(resp.complete.output_ids) == [7, 8]
        assert list(resp.complete.output_logprobs.token_logprobs) == [-0.5, -0.25]
        assert list(resp.complete.output_logprobs.token_ids) == [7, 8]
        assert env.face.stats.outputs_bad == 1
        assert env.face.stats.outputs_untracked == 1  # "gone": no open call


async def test_chunks_then_a_bad_chunk_ends_the_stream_internal() -> None:
    async with driven() as (env, sched):
        call = env.stub.Generate(request("s1", stream=True))
        kind, _ = await asyncio.wait_for(sched.recv(), 10)
        assert kind == "ADD"
        await sched.send(slim(["s1"], [[11]], reasons=[""]))
        first = await asyncio.wait_for(call.read(), 5)
        assert list(first.chunk.token_ids) == [11]
        await sched.send(slim(["s1"], [[12]], reasons=[""], completion=[2**40]))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(call.read(), 5)
        assert info.value.code() is grpc.StatusCode.INTERNAL
        assert "completion_tokens = 1099511627776, outside uint32" in str(info.value.details())


async def test_an_unusable_output_naming_no_call_is_counted_and_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(smg_outputs, "_WARNED", {})  # rate-limited per kind: start afresh
    caplog.set_level("WARNING", logger="mmadmit.smg_grpc")
    async with driven() as (env, sched):
        call = await open_call(env, sched, "live")
        stats = env.face.stats
        for body in (b"\xc1\xc1", 42, slim(["nobody"], [[2**32]]), [1, 2, 3]):
            await sched.send(body)
        await until(lambda: stats.outputs_undecodable == 4)
        assert stats.outputs_bad == 0
        assert "a scheduler output does not decode as msgpack" in caplog.text
        assert "a scheduler output is not a BatchTokenIDOutSlim array (msgpack int" in caplog.text
        assert not call.done()  # the open call is untouched
        await sched.send(slim(["live"]))
        (resp,) = await asyncio.wait_for(call, 5)
        assert resp.complete.finish_reason == "stop"
