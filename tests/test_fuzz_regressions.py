"""Every crash or native/Python divergence the fuzz targets found, as a fixed test.

Each case is the smallest input that showed the fault (RELIABILITY.md lists
when and how each was found, and its root-cause fix). The native entry points
are called directly where the fault was in one; the whole path runs with
native code on and off where the fault was visible from the network. The
saved fuzzer inputs (``fuzz/corpus/*/regress-*``) are replayed by
``tests/test_fuzz_smoke.py``.

Run with: python -m pytest tests/test_fuzz_regressions.py -q
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
import pytest
from conftest import SESSION_NATIVE, forged_tensor, rules_builds
from mmadmit import native, planner, wire
from mmadmit.dtypes import parse_dtype
from mmadmit.errors import Abort, AbortCode, InvalidRequest, TooLarge
from mmadmit.limits import DEFAULT_LIMITS, Limits
from mmadmit.materializer import Materializer
from mmadmit.model import Item, Materialized, MultimodalInputs, Request, Tensor
from mmadmit.mrope import RunPlan
from mmadmit.profile import load_profile

Ext = msgspec.msgpack.Ext
ENC = msgspec.msgpack.Encoder()
TAG = "TokenizedGenerateReqInput"
IMG, VID = 248056, 248057  # Qwen3.5 image / video placeholders

needs_planner = pytest.mark.skipif(planner._BUILT is None, reason="_rules_c not built")


def both_ways(m: Materializer, req: Request) -> list[Materialized | Abort]:
    """The outcome with native code on, then off (the fallback is the reference)."""
    out = []
    for on in (True, False):
        native.set_enabled(on)
        try:
            out.append(m.run(req))
        finally:
            native.set_enabled(SESSION_NATIVE)
    return out


def _summary(o: Materialized | Abort) -> Any:
    if isinstance(o, Abort):
        return (o.code, o.message)
    r = o.request
    return (r.input_ids.tolist(), [(it.hash, it.pad_value) for it in r.mm.items] if r.mm else None)


def _image_request(grid: Tensor, **mm: Any) -> Request:
    ids = np.array([1, 2, *([IMG] * 4), 3], np.int64)
    item = Item(1, hash=7, offsets=np.array([[2, 5]], np.int64), side={"image_grid_thw": grid})
    return Request("r", ids, mm=MultimodalInputs(items=[item], **mm))


# ------------------------------------------------------------ 1. planner grid reader


@needs_planner
def test_forged_grid_shape_is_not_trusted_by_the_planner() -> None:
    """A grid whose shape claims 2**61 + 1 rows over 24 bytes: ``r * 3 * 8`` wrapped to 24,
    the byte check passed and the (C) planner's row buffer was allocated 24 bytes for
    3 * r values. Such a tensor can no longer be built; one forged around the
    constructor is read by its bytes (one row), alike compiled and interpreted."""
    data = np.array([1, 4, 4], np.int64).data.cast("B")
    for rows in (2**61 + 1, 2**62 + 1, 2**63 - 1):
        with pytest.raises(InvalidRequest, match="24 data bytes"):
            Tensor(parse_dtype("int64"), (rows, 3), data)
        req = _image_request(forged_tensor(parse_dtype("int64"), (rows, 3), data))
        m = Materializer(load_profile("qwen3_5"), Limits(max_tensor_dim=2**63 - 1))
        a, b = both_ways(m, req)
        assert _summary(a) == _summary(b)


@needs_planner
def test_forged_seconds_shape_is_not_trusted_by_the_planner() -> None:
    """``numel * 4`` of a timing tensor overflowed the same way (numel up to 2**63 - 1)."""
    m = Materializer(load_profile("qwen2_5_vl"), Limits(max_tensor_dim=2**63 - 1))
    ids = np.array([1, *([151656] * 8), 2], np.int64)
    one = np.ones(1, np.float32).data.cast("B")
    with pytest.raises(InvalidRequest, match="4 data bytes"):
        Tensor(parse_dtype("float32"), (2**62 + 1,), one)
    with pytest.raises(TooLarge, match="--max-tensor-dim"):  # the shape alone, before the bytes
        Tensor(parse_dtype("float32"), (2**62 + 1,), one, "secs", DEFAULT_LIMITS)
    secs = forged_tensor(parse_dtype("float32"), (2**62 + 1,), one)
    grid = Tensor.from_numpy(np.array([[2, 4, 4]], np.int64))
    item = Item(2, hash=3, offsets=np.array([[1, 8]], np.int64),
                side={"video_grid_thw": grid, "second_per_grid_ts": secs})  # fmt: skip
    req = Request("r", ids, mm=MultimodalInputs(items=[item]))
    a, b = both_ways(m, req)
    assert _summary(a) == _summary(b)


# ------------------------------------------------ 2. placeholder override outside int64


def _wire_image_message(im_token_id: int, video_only: bool = False) -> list[bytes]:
    grid = ["int64", [1, 3], Ext(3, np.array([1, 4, 4], np.int64).tobytes())]
    modality, key, tok = (2, "video_grid_thw", VID) if video_only else (1, "image_grid_thw", IMG)
    ids = [11, 12, *([tok] * 4), 13]
    item = [modality, 9, None, [[2, 5]], None, None, {key: grid}, None, None, None]
    mm = [[item], im_token_id, None, None, None, None, None]
    elems: list[Any] = [TAG, "rid-big", None, None, ids, [], False, -1, 0, None]
    elems += [False, None, None, None, False, 0.5, None, None, None, None, None, None, mm, None]
    return [b"\x00", ENC.encode(elems)]


@pytest.mark.parametrize("override", [2**63, 2**63 + 5, 2**64 - 1, -(2**63) - 1])
def test_placeholder_override_outside_int64_is_invalid_request_not_internal(override: int) -> None:
    """``im_token_id`` is any msgpack int; the native planner's conversion raised
    OverflowError, which the materializer reported as ``INTERNAL`` (reachable from the
    network); the Python path then also failed to build its int64 comparison array."""
    m = Materializer(load_profile("qwen3_5"))
    if override >= 0:  # msgpack has no int below -2**63
        req = wire.decode_message(_wire_image_message(override)).request
        assert req is not None and req.mm is not None and req.mm.im_token_id == override
    else:
        req = _image_request(Tensor.from_numpy(np.array([[1, 4, 4]], np.int64)))
        assert req.mm is not None
        req.mm.im_token_id = override
    a, b = both_ways(m, req)
    assert isinstance(a, Abort) and a.code is AbortCode.INVALID_REQUEST, a
    assert a == b
    assert f"must be the placeholder {override}" in a.message


def test_placeholder_override_outside_int64_unused_still_materializes() -> None:
    """An override for a modality the request does not use changes nothing."""
    m = Materializer(load_profile("qwen3_5"))
    req = wire.decode_message(_wire_image_message(2**64 - 1, video_only=True)).request
    assert req is not None
    a, b = both_ways(m, req)
    assert isinstance(a, Materialized) and _summary(a) == _summary(b)


@pytest.mark.parametrize("scalar", [2**63, 2**64 - 1])
def test_delta_scalar_outside_int64_is_invalid_request_not_internal(scalar: int) -> None:
    """Found by the planner target: a carried ``mrope_position_delta_scalar`` beyond int64
    (with positions and no delta tensor) failed building the int64 delta tensor."""
    m = Materializer(load_profile("qwen3_5"))
    req = _image_request(Tensor.from_numpy(np.array([[1, 4, 4]], np.int64)))
    assert req.mm is not None
    req.mm.mrope_positions = Tensor.from_numpy(np.tile(np.arange(7, dtype=np.int64), (3, 1)))
    req.mm.mrope_position_delta_scalar = scalar
    a, b = both_ways(m, req)
    assert isinstance(a, Abort) and a.code is AbortCode.INVALID_REQUEST and a == b
    decode = Materializer(load_profile("qwen3_5", role="decode", language_model_only=True))
    a, b = both_ways(decode, req)
    assert isinstance(a, Abort) and a.code is AbortCode.INVALID_REQUEST and a == b


# ---------------------------------------------------------- 3. M-RoPE positions loop


# rules.positions in every build: the interpreted source always, each compiled one
# this CPU runs
POSITION_BUILDS = rules_builds()


def _runs(start, frames, rows, cols, t_off, t_index) -> RunPlan:
    a = lambda v: np.array(v, np.int64)  # noqa: E731
    return RunPlan(a(start), a(frames), a(rows), a(cols), a(t_off), a(t_index))


@pytest.mark.parametrize("build", POSITION_BUILDS)
@pytest.mark.parametrize(
    "t_index, message",
    [
        ([2**63 - 1], "overflow"),
        ([2**63 - 4], "overflow"),
        ([0, 2**63 - 2], "overflow"),
        ([-1], "non-negative"),
        ([-(2**63)], "non-negative"),
    ],
)
def test_positions_refuse_time_indices_that_overflow(
    build: Any, t_index: list[int], message: str
) -> None:
    """``origin + t_index[f]`` was computed for any caller-supplied t_index (signed
    overflow: undefined behaviour, found in the C kernel this loop replaced). The
    position arithmetic is replayed per run before writing, and what would leave
    int64 is refused."""
    frames = len(t_index)
    with pytest.raises(ValueError, match=message):
        build.positions(2 + frames, _runs([1], [frames], [1], [1], [0], t_index))


@pytest.mark.parametrize("build", POSITION_BUILDS)
def test_positions_refuse_positions_that_overflow_across_runs(build: Any) -> None:
    """Each run's time index fits; their sum does not."""
    big = 2**62
    out, delta = build.positions(3, _runs([0], [1], [1], [1], [0], [big]))
    assert out[0].tolist() == [big, big + 1, big + 2] and delta == big  # one run is fine
    with pytest.raises(ValueError, match="overflow"):
        build.positions(3, _runs([0, 1], [1, 1], [1, 1], [1, 1], [0, 1], [big, big]))


@pytest.mark.parametrize("build", POSITION_BUILDS)
def test_positions_refuse_run_products_that_overflow(build: Any) -> None:
    """Run sizes are compared by division: frames * rows * cols cannot wrap."""
    big = 2**32 + 1
    with pytest.raises(ValueError, match="past the end"):
        build.positions(8, _runs([0], [1], [big], [big], [0], [0]))


@pytest.mark.parametrize(("frames", "seconds"), [(2, None), (400, 9e5)])
def test_temporal_index_beyond_bound_is_invalid_request_not_internal(
    frames: int, seconds: float | None
) -> None:
    """A profile whose tokens_per_second puts a frame's temporal index beyond 2**40 (or
    int64) aborts ``INVALID_REQUEST`` on both paths instead of overflowing; beyond
    float32's range too (``(k * s) * tps`` rounds to infinity: the compiled rules
    must not cast such a double to a C float, which C leaves undefined)."""
    profile = dataclasses.replace(load_profile("qwen2_5_vl"), tokens_per_second=1e30)
    m = Materializer(profile)
    tokens = frames * 4
    ids = np.array([1, *([151656] * tokens), 2], np.int64)
    grid = Tensor.from_numpy(np.array([[frames, 4, 4]], np.int64))
    side = {"video_grid_thw": grid}
    if seconds is not None:
        side["second_per_grid_ts"] = Tensor.from_numpy(np.array([seconds], np.float32))
    item = Item(2, hash=3, offsets=np.array([[1, tokens]], np.int64), side=side)
    a, b = both_ways(m, Request("r", ids, mm=MultimodalInputs(items=[item])))
    assert isinstance(a, Abort) and a.code is AbortCode.INVALID_REQUEST and a == b
    assert "temporal index" in a.message
    assert ("index inf," in a.message) == (seconds is not None)


# ------------------------------------------------ 4. item decoder, tensor arity


@pytest.mark.parametrize("where", ["feature", "grid"])
def test_item_decoder_refuses_a_tensor_with_trailing_elements(where: str) -> None:
    """``[dtype, shape, data, extra]``: the typed item decoder once skipped the extra
    element (an array-like struct ignores trailing fields); it is refused, naming it."""
    grid: list[Any] = ["int64", [1, 3], Ext(3, np.array([1, 4, 4], np.int64).tobytes())]
    feature: list[Any] = ["float32", [2], Ext(3, bytes(8))]
    if where == "feature":
        feature.append(0)
    else:
        grid.append(None)
    ids = [11, 12, *([IMG] * 4), 13]
    item = [1, None, None, [[2, 5]], feature, None, {"image_grid_thw": grid}, None, None, None]
    mm = [[item], None, None, None, None, None, None]
    elems: list[Any] = [TAG, "rid-t", None, None, ids, [], False, -1, 0, None]
    elems += [False, None, None, None, False, 0.5, None, None, None, None, None, None, mm, None]
    frames = [b"\x00", ENC.encode(elems)]
    if where == "feature":
        with pytest.raises(wire.WireError) as info:
            wire.decode_message(frames)
        assert info.value.message == "item 0 feature must be a tensor [dtype, shape, data]"
        assert info.value.code is AbortCode.INVALID_REQUEST
    else:  # a side value of another form is not a tensor: kept as a value, the grid missing
        req = wire.decode_message(frames).request
        assert req is not None and req.mm is not None
        kept = req.mm.items[0].side["image_grid_thw"]
        assert not isinstance(kept, Tensor) and len(kept) == 4
        out = Materializer(load_profile("qwen3_5")).run(req)
        assert isinstance(out, Abort) and out.code is AbortCode.INVALID_REQUEST
        assert "image_grid_thw must be a tensor" in out.message


# ------------------------------------ 5. dtype strings reaching numpy's dtype parser


@pytest.mark.parametrize("dtype", [",loat16", "(2,)i4", "i4,i4", "f4" * 40, "[('a', 'f4')]"])
def test_dtype_strings_numpy_would_parse_are_invalid_request(dtype: str) -> None:
    """Found by the grpc target under ASan (the first sanitizer campaign): a
    TensorData.dtype of ",loat16" made np.dtype() raise SyntaxError (it parses comma
    lists and subarray shapes with ast.literal_eval), which the servicer reported as
    INTERNAL. Only a plain numpy type string ever reaches numpy now."""
    from mmadmit import servicer
    from mmadmit.errors import InvalidRequest
    from mmadmit_client.proto import admission_pb2 as pb

    with pytest.raises(InvalidRequest, match="unsupported tensor dtype"):
        parse_dtype(dtype)
    # gRPC: the translation refuses it in band
    msg = pb.AdmitRequest(request_id="d")
    msg.tokenized.input_ids.extend([1, 2, 3])
    item = msg.mm_inputs.items.add(modality=pb.IMAGE)
    item.placeholders.add(offset=1, length=1)
    item.encoder_input.dtype = dtype
    item.encoder_input.shape.extend([2])
    item.encoder_input.inline = bytes(4)
    with pytest.raises(InvalidRequest, match="dtype"):
        servicer.request_from_proto(msg, load_profile("qwen3_5"))
    # ZMQ: the item decoder refuses it
    feature: list[Any] = [dtype, [2], Ext(3, bytes(4))]
    item_w = [1, None, None, [[2, 5]], feature, None, {}, None, None, None]
    elems: list[Any] = [TAG, "rid-d", None, None, [1, 2, IMG, IMG, IMG, IMG, 3], [], False, -1]
    elems += [0, None, False, None, None, None, False, 0.5, None, None, None, None, None, None]
    elems += [[[item_w], None, None, None, None, None, None], None]
    with pytest.raises(wire.WireError, match="unsupported tensor dtype"):
        wire.decode_message([b"\x00", ENC.encode(elems)])


def test_numpy_type_strings_stay_legal() -> None:
    """docs/spec/WIRE.md: a numpy type string such as "<f4" is legal."""
    for typestr, name in (("<f4", "float32"), ("|u1", "uint8"), ("=i8", "int64"), ("?", "bool")):
        assert parse_dtype(typestr).name == name
    for refused in (">f4", "<c8", "O", "U4"):
        with pytest.raises(Exception, match="unsupported tensor dtype"):
            parse_dtype(refused)


# ------------------------------------ 6. keys and lengths over 5 bytes, which upb refuses


def _wide(value: int, n: int) -> bytes:
    """``value`` as an ``n``-byte (non-minimal) varint."""
    return bytes(((value >> (7 * k)) & 0x7F) | (0x80 if k < n - 1 else 0) for k in range(n))


@pytest.mark.parametrize("where", ["tokenized length", "input_ids length", "items length"])
def test_six_byte_lengths_end_admit_and_generate_as_protobuf(where: str) -> None:
    """Found by an independent fuzz (issue 33): upb reads a key or a length in 5 bytes at
    most ("Wire format was corrupt" at a 6th), but ``take_ids`` and ``strip_inline`` read
    up to 10 and rewrote what they changed as minimal varints, so the over-long length
    vanished and upb took the rewritten message: with native code on, ``Generate``
    answered and ``Admit`` materialized; off, both ended ``INVALID_ARGUMENT``
    (``take_ids`` is native only; the Python stripper did the same). Both now decline
    such bytes (or keep them, where they do not walk), and the deserializers fail
    with protobuf's words either way."""
    from google.protobuf.message import DecodeError
    from mmadmit import pbwire, smg_request
    from mmadmit_client.proto import admission_pb2 as pb
    from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts

    def ld(number: int, payload: bytes, width: int = 0) -> bytes:
        length = _wide(len(payload), width) if width else pbwire.encode_varint(len(payload))
        return pbwire.encode_varint((number << 3) | 2) + length + payload

    ids = b"".join(pbwire.encode_varint(v) for v in range(1000, 1600))
    tok = ld(1, ids, 6 if where == "input_ids length" else 0)
    td = ld(2, b"uint8") + ld(3, bytes(70_000))
    mm = ld(1, ld(3, td), 6 if where == "items length" else 0)
    data = ld(1, b"r") + ld(2, tok, 6 if where == "tokenized length" else 0) + ld(9, mm)
    for message, parse in (
        (pb.AdmitRequest, lambda b: pbwire.parse_admit_request(b, limits=DEFAULT_LIMITS)),
        (ts.GenerateRequest, lambda b: smg_request.parse_generate(b, DEFAULT_LIMITS)),
    ):
        with pytest.raises(DecodeError) as want:
            message.FromString(data)
        for on in (True, False):
            native.set_enabled(on)
            try:
                got = pbwire.parse_or_undecodable(parse, data)
                # each declines, or keeps the wide length where it does not walk
                taken = pbwire.take_ids(data, True)
                stripped = pbwire.strip_inline_payloads(data)
                for rest in (taken, stripped):
                    if rest is not None:
                        with pytest.raises(DecodeError):
                            message.FromString(rest[0])
            finally:
                native.set_enabled(SESSION_NATIVE)
            assert isinstance(got, pbwire.Undecodable), (message.__name__, on)
            assert got.message == str(want.value)
