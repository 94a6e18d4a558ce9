"""The test scheduler (``tests/engine_peers.py``) answers exactly what TokenSpeed's scheduler sends.

Where the layout comes from (read for facts, nothing copied):

* TokenSpeed ``python/tokenspeed/runtime/engine/io_struct.py``:
  ``class BatchTokenIDOutSlim(BaseBatchReq, kw_only=True)``, a
  ``msgspec.Struct(tag=True, array_like=True)`` whose base contributes
  ``rids``; fields in order ``output_ids, finished_reasons, prompt_tokens,
  completion_tokens, cached_tokens, output_token_logprobs_val,
  output_token_logprobs_idx, engine_index, num_running, num_waiting,
  kv_active_pages, kv_total_pages``. ``from_full`` fills each logprob column
  with one ``[]`` per rid when logprobs are off ("so the columns stay
  non-ragged"). ``zmq_msgpack.MsgpackSendSocket.send_pyobj`` encodes it as
  one frame on the output PUSH, the load tail from ``set_load_snapshot``
  (zeros before the first observation). TokenSpeed's own test pins "SMG's exact
  14-element positional contract".
* SMG ``crates/engine_zmq_client/src/protocol/tokenspeed/output.rs``
  (``BatchTokenIDOutSlim``'s ``Deserialize``): checks the tag, reads the eight
  columns, then ``engine_index`` as u32 and the four counters as u64
  (``next_element::<u64>``, so a map there fails with "wrong msgpack marker"),
  skips anything after; ``into_outputs`` fails with "ragged columns" unless
  every column, the logprob ones included, has ``len(rids)`` entries.
  ``protocol/tokenspeed/mod.rs``: ``kv_total_pages == 0`` means "no load
  snapshot".

If this fails, the peer drifted from what the real gateway decodes.
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import msgspec
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_peers  # noqa: E402

FIELDS = (
    "_tag",
    "rids",
    "output_ids",
    "finished_reasons",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "output_token_logprobs_val",
    "output_token_logprobs_idx",
    "engine_index",
    "num_running",
    "num_waiting",
    "kv_active_pages",
    "kv_total_pages",
)
PER_RID = FIELDS[1:9]
COUNTERS = FIELDS[9:]
U64_MAX = 2**64 - 1


class Slim(msgspec.Struct, tag="BatchTokenIDOutSlim", array_like=True, forbid_unknown_fields=True):
    """A strict decoder for TokenSpeed's struct (as SMG reads it, without tolerance)."""

    rids: list[str]
    output_ids: list[list[int]]
    finished_reasons: list[str]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs_val: list[list[float]]
    output_token_logprobs_idx: list[list[int]]
    engine_index: int
    num_running: int
    num_waiting: int
    kv_active_pages: int
    kv_total_pages: int


def elements(frames: list[bytes]) -> list:
    value = msgspec.msgpack.decode(frames[0])
    assert isinstance(value, list)
    return value


def assert_u64(value: object, name: str) -> None:
    assert type(value) is int, f"{name} must be an unsigned integer, got {value!r}"
    assert 0 <= value <= U64_MAX, f"{name} out of u64 range: {value!r}"


@pytest.mark.parametrize("reason", ["stop", "abort"])
def test_default_is_the_exact_fourteen_element_tokenspeed_layout(reason: str) -> None:
    frames = engine_peers.output_frames("r-1", reason, 17, 3, load=(2, 1, 4, 4096))
    assert len(frames) == 1  # one payload frame, no aux frame
    raw = elements(frames)
    assert len(raw) == len(FIELDS) == 14
    assert raw[0] == "BatchTokenIDOutSlim"
    got = dict(zip(FIELDS, raw, strict=True))
    assert got["rids"] == ["r-1"]
    assert got["output_ids"] == [[11, 12, 13]]
    assert got["finished_reasons"] == [reason]
    assert got["prompt_tokens"] == [17]
    assert got["completion_tokens"] == [3]
    assert got["cached_tokens"] == [0]
    # one (empty) logprob list per rid, never a bare []
    assert got["output_token_logprobs_val"] == [[]]
    assert got["output_token_logprobs_idx"] == [[]]
    for name in PER_RID:
        assert isinstance(got[name], list) and len(got[name]) == len(got["rids"]), name
    for name in COUNTERS:
        assert_u64(got[name], name)
    assert [got[n] for n in COUNTERS] == [3, 2, 1, 4, 4096]


def test_default_decodes_with_a_strict_struct_of_the_same_shape() -> None:
    frames = engine_peers.output_frames("abc", "stop", 5, 0)
    slim = msgspec.msgpack.Decoder(Slim).decode(frames[0])
    assert slim.rids == ["abc"]
    assert slim.output_token_logprobs_val == [[]] and slim.output_token_logprobs_idx == [[]]
    # no load observed: zeros, which SMG reads as "no snapshot"
    assert (slim.engine_index, slim.num_running, slim.num_waiting) == (0, 0, 0)
    assert (slim.kv_active_pages, slim.kv_total_pages) == (0, 0)
    # and it is byte-for-byte what msgspec makes of the struct
    assert msgspec.msgpack.encode(slim) == frames[0]


def test_trailing_fields_only_after_the_load_counters() -> None:
    base = elements(engine_peers.output_frames("r", "stop", 4, 1))
    extra = engine_peers.output_frames("r", "stop", 4, 1, trailing=3, aux_bytes=10)
    assert len(extra) == 2 and len(extra[1]) == 10
    raw = elements(extra)
    assert len(raw) == 14 + 3
    assert raw[:14] == base  # the real layout is untouched; extras come after it
    for name, value in zip(COUNTERS, raw[9:14], strict=True):
        assert_u64(value, name)


def test_scheduler_defaults_add_nothing_beyond_the_real_layout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert inspect.signature(engine_peers.run_scheduler).parameters["trailing"].default == 0
    assert inspect.signature(engine_peers.output_frames).parameters["trailing"].default == 0
    captured: list[argparse.Namespace] = []

    async def capture(args: argparse.Namespace) -> int:
        captured.append(args)
        return 0

    monkeypatch.setattr(engine_peers, "_scheduler_main", capture)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # the plain asyncio.run branch
    assert engine_peers.main(["scheduler", "--handshake", "tcp://127.0.0.1:1"]) == 0
    (args,) = captured
    assert (args.trailing, args.aux_bytes) == (0, 0)


def test_load_snapshot_is_four_u64_with_a_total() -> None:
    snap = engine_peers.load_snapshot(2, 30)
    assert len(snap) == 4
    for name, value in zip(COUNTERS[1:], snap, strict=True):
        assert_u64(value, name)
    running, waiting, active, total = snap
    assert (running, waiting) == (2, 0)
    assert total == engine_peers.READY_RESPONSE["num_gpu_blocks"] > 0
    assert 0 < active <= total
    with pytest.raises(ValueError):
        engine_peers.output_frames("r", "stop", 1, 0, load=(1, 2, 3))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        engine_peers.output_frames("r", "stop", 1, 0, load=(1, -2, 3, 4))
