"""Protobuf wire shortcuts of the gRPC transport (``mmadmit.pbwire``), both builds of
its walks (``mmadmit.pbwalk``: compiled ``_pbwalk_c`` when built, and interpreted).

Pinned here, with native code on and off:

* ``packed_uint32_field`` gives byte for byte what protobuf serializes for the
  same ``repeated uint32`` values (random arrays, every varint size boundary,
  0 and ``2**32 - 1``), protobuf parses it back to the same values, and a value
  out of range fails with protobuf's own ``ValueError`` message; the servicer's
  response builder gives the same message as filling the fields with ``extend``.
* ``strip_inline_payloads`` / ``parse_admit_request``: the stripped message,
  with its markers put back, equals ``AdmitRequest.FromString`` of the original
  bytes (unknown fields included) for every request the gRPC API tests build,
  every wire vector, unknown fields 3-8 and nested unknown fields, several
  items, map side tensors, M-RoPE positions, and field orders protobuf merges
  (split ``mm_inputs``, repeated ``encoder_input``, repeated ``inline``, ``inline``
  vs ``shm``, duplicate map keys); both builds and the tests' reference walk
  (``tests/pbwire_oracle.py``) give the same bytes;
  truncated (every cut of a small message), bit-flipped and garbage bytes parse
  or fail exactly as ``FromString`` does.
* A large feature becomes a tensor that is a view on the received bytes (no
  copy); a client ``inline`` value is never mistaken for a marker.

Run with: python -m pytest tests/test_pbwire.py -q
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from client_helpers import build_item, build_request, tensor_data
from conftest import (
    REPO_ROOT,
    generate_request,
    load_vector,
    native_as,
    vector_names,
)
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from mmadmit import pbwalk, pbwire, smg_request
from mmadmit.limits import DEFAULT_LIMITS
from mmadmit.materializer import Materializer
from mmadmit.model import Materialized
from mmadmit.profile import load_profile
from mmadmit.servicer import _packed_ids, encode_response, request_from_proto
from mmadmit_client.proto import admission_pb2 as pb
from pbwire_oracle import strip as _oracle_strip
from response_oracle import response_from_outcome
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
from test_grpc_api import BAD_INPUTS, MODEL_CONFIG, _image_request, request_from_vector

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from fuzz.targets.pbwire_target import check_parse, check_take, count  # noqa: E402  (the targets' properties)

IMPLS = ["native", "python"]
NOT_BUILT = "mmadmit._pbwalk_c is not built (no compiler at install time): interpreted only"


@contextmanager
def _compiled() -> Iterator[None]:
    """Native switched on (the compiled walks run), whatever the session's setting
    (``MMADMIT_NATIVE``); the session's setting restored afterwards."""
    with native_as(True):
        assert pbwire.HAVE_NATIVE
        yield


@pytest.fixture
def stripping() -> Iterator[None]:
    """The compiled walks on (they strip; without them nothing is stripped and upb
    parses the whole message: ``test_without_the_extension_nothing_is_stripped``)."""
    if pbwire._BUILT is None:
        pytest.skip(NOT_BUILT)
    with _compiled():
        yield


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run a test with native code on (the compiled walks; also under
    ``MMADMIT_NATIVE=0``), then off (interpreted)."""
    if request.param == "native":
        if pbwire._BUILT is None:
            pytest.skip(NOT_BUILT)
        with _compiled():
            yield request.param
    else:
        with native_as(False):
            assert not pbwire.HAVE_NATIVE
            yield request.param


def _builds() -> list[ModuleType]:
    """The walks' builds: interpreted, and compiled when built."""
    return [pbwalk, *([pbwire._BUILT] if pbwire._BUILT is not None else [])]


def _varint(value: int) -> bytes:
    return pbwire.encode_varint(value)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    key = _varint((number << 3) | wire_type)
    if wire_type == 2:
        return key + _varint(len(payload)) + payload
    return key + payload


# ----------------------------------------------------------------------------- packed encoder


EDGES = [0, 1, 127, 128, 2**14 - 1, 2**14, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**32 - 1]


def _reference(field_number: int, values: np.ndarray) -> bytes:
    msg = pb.MaterializedRequest()
    target = msg.input_ids if field_number == 1 else msg.input_ids_unpadded
    target.extend(values.tolist())
    return msg.SerializeToString()


def _arrays() -> Iterator[np.ndarray]:
    rng = np.random.default_rng(7)
    yield np.array([], np.int64)
    yield np.array(EDGES, np.int64)
    yield np.array(EDGES[::-1] * 3, np.int64)
    for value in EDGES:
        yield np.array([value], np.int64)
    for n in (1, 2, 3, 100, 1024, 20_000):
        for top in (2, 128, 2**14, 2**21, 2**28, 2**32):
            arr = rng.integers(0, top, n, dtype=np.int64)
            arr[rng.integers(0, n, max(1, n // 10))] = rng.choice(EDGES)
            yield arr
    # log-uniform sizes: every varint length in one array
    yield (2 ** rng.uniform(0, 32, 5000)).astype(np.int64).clip(0, 2**32 - 1)


@pytest.mark.parametrize("field_number", [1, 2])
def test_packed_uint32_equals_protobuf(impl: str, field_number: int) -> None:
    for arr in _arrays():
        got = pbwire.packed_uint32_field(field_number, arr)
        assert got == _reference(field_number, arr), (len(arr), arr[:8])
        back = pb.MaterializedRequest.FromString(got)
        values = back.input_ids if field_number == 1 else back.input_ids_unpadded
        assert list(values) == arr.tolist()


def test_packed_uint32_non_contiguous_and_large_field_number(impl: str) -> None:
    arr = np.arange(0, 4000, dtype=np.int64)[::3]
    assert pbwire.packed_uint32_field(1, arr) == _reference(1, arr)
    # a field number with a multi-byte tag
    got = pbwire.packed_uint32_field(100, np.array(EDGES, np.int64))
    assert got == _field(100, 2, _reference(1, np.array(EDGES, np.int64))[2:])
    assert list(pb.AdmitRequest.FromString(got).input_ids_unpadded) == EDGES


@pytest.mark.parametrize(
    "values",
    [[2**32], [-1], [5, 2**32 + 1, -1], [1, 2, -(2**63)], [2**63 - 1], [0, 2**32 - 1, 2**40]],
)
def test_packed_uint32_out_of_range_is_protobufs_error(impl: str, values: list[int]) -> None:
    arr = np.array(values, np.int64)
    with pytest.raises(ValueError) as want:
        pb.MaterializedRequest().input_ids.extend(arr.tolist())
    with pytest.raises(ValueError) as got:
        pbwire.packed_uint32_field(1, arr)
    assert str(got.value) == str(want.value)
    assert str(got.value).startswith("Value out of range: ")


def test_packed_uint32_refuses_other_dtypes(impl: str) -> None:
    with pytest.raises(TypeError):
        pbwire.packed_uint32_field(1, np.arange(3, dtype=np.int32))
    with pytest.raises(TypeError):
        pbwire.packed_uint32_field(1, np.zeros((2, 2), np.int64))


@pytest.mark.parametrize("size", [0, 5, 1024, 9000])
def test_response_ids_equal_extend(impl: str, size: int) -> None:
    rng = np.random.default_rng(size)
    ids = rng.integers(0, 2**32, size, dtype=np.int64)
    for unpadded in (None, rng.integers(0, 300_000, size, dtype=np.int64)):
        got = pb.MaterializedRequest.FromString(_packed_ids(ids, unpadded))
        want = pb.MaterializedRequest()
        want.input_ids.extend(ids.tolist())
        if unpadded is not None:
            want.input_ids_unpadded.extend(unpadded.tolist())
        assert got == want
        assert _packed_ids(ids, unpadded) == want.SerializeToString()


@pytest.mark.parametrize("size", [3, 9000])
def test_response_ids_out_of_range_as_extend(impl: str, size: int) -> None:
    """The message protobuf's ``extend`` gives (it becomes an in-band INTERNAL abort)."""
    ids = np.arange(size, dtype=np.int64)
    unpadded = ids.copy()
    unpadded[-1] = 2**32
    with pytest.raises(ValueError, match=r"^Value out of range: 4294967296$"):
        _packed_ids(ids, unpadded)
    ids[1] = -5  # the first field is checked first
    with pytest.raises(ValueError, match=r"^Value out of range: -5$"):
        _packed_ids(ids, unpadded)
    # another integer dtype is packed as int64, with the same check
    with pytest.raises(ValueError, match=r"^Value out of range: -5$"):
        _packed_ids(ids.astype(np.int32), None)
    assert _packed_ids(np.arange(4, dtype=np.int32), None) == _packed_ids(np.arange(4), None)


def _outcomes_to_encode() -> Iterator[tuple[str, Any]]:
    """(request id, outcome): every wire vector as the gRPC API receives it, the
    image request of each family (plain, echoed features, carried positions), and
    outcomes the reference builds differently (aborts, no items, int32 ids, a
    negative delta, a shared-memory feature)."""
    import dataclasses

    import msgspec
    from mmadmit.errors import Abort, AbortCode
    from mmadmit.model import ShmHandle

    for name in vector_names():
        v = load_vector(name)
        profile = load_profile(str(MODEL_CONFIG[v.meta["family"]]))
        rid = f"vector {name} \u00e9"
        yield (
            rid,
            Materializer(profile).run(request_from_proto(request_from_vector(v, rid), profile)),
        )
    for family in ("qwen3_5", "qwen3_omni"):
        profile = load_profile(str(MODEL_CONFIG[family]))
        msg = _image_request(profile, f"image {family}")
        outcome = Materializer(profile).run(request_from_proto(msg, profile))
        yield msg.request_id, outcome
        yield "", outcome  # an empty request_id: proto3 writes no field for it
        if not isinstance(outcome, Materialized) or outcome.request.mm is None:
            continue
        # taken as materialized upstream: carried positions, passthrough
        again = pb.AdmitRequest()
        again.CopyFrom(msg)
        again.input_ids_unpadded.extend(outcome.request.input_ids_unpadded.tolist())
        del again.tokenized.input_ids[:]
        again.tokenized.input_ids.extend(outcome.request.input_ids.tolist())
        for item, done in zip(again.mm_inputs.items, outcome.request.mm.items, strict=True):
            item.pad_value = done.pad_value
        upstream = Materializer(profile).run(request_from_proto(again, profile))
        yield "upstream", upstream
        req = outcome.request
        mm = req.mm
        assert mm is not None
        yield (
            "int32 ids",
            dataclasses.replace(
                outcome, request=dataclasses.replace(req, input_ids=req.input_ids.astype(np.int32))
            ),
        )
        yield (
            "no unpadded",
            dataclasses.replace(outcome, request=dataclasses.replace(req, input_ids_unpadded=None)),
        )
        shm = ShmHandle(name="feat", shape=(4, 2), dtype="float32", nbytes=32, owner_id="o")
        item = msgspec.structs.replace(mm.items[0], feature=None, feature_shm=shm, hash=2**64 - 1)
        odd_mm = dataclasses.replace(mm, items=[item, *mm.items[1:]])
        if mm.mrope_position_delta_scalar is not None:
            odd_mm.mrope_position_delta_scalar = -(2**40)
        yield "odd items", dataclasses.replace(outcome, request=dataclasses.replace(req, mm=odd_mm))
        yield (
            "no items",
            dataclasses.replace(
                outcome, request=dataclasses.replace(req, mm=dataclasses.replace(mm, items=[]))
            ),
        )
        yield (
            "text",
            dataclasses.replace(
                outcome, request=dataclasses.replace(req, mm=None, input_ids_unpadded=None)
            ),
        )
    yield "aborted", Abort(AbortCode.INVALID_REQUEST, "item 0: no \u00e9")
    yield "", Abort(AbortCode.INTERNAL, "")


@pytest.mark.parametrize("echo", [False, True])
def test_encode_response_parses_as_the_reference(impl: str, echo: bool) -> None:
    """What Admit and AdmitStream send (``encode_response``: packed ids and the
    positions' bytes written directly, protobuf for the rest) parses to the
    message ``response_from_outcome`` builds, for every outcome above; and a
    materialized one is never larger (no field written twice)."""
    seen = set()
    for rid, outcome in _outcomes_to_encode():
        want = response_from_outcome(rid, outcome, echo_features=echo)
        got = encode_response(rid, outcome, echo_features=echo)
        assert type(got) is bytes
        assert pb.AdmitResponse.FromString(got) == want, rid
        assert len(got) == len(want.SerializeToString()), rid
        seen.add(want.WhichOneof("outcome"))
        if want.materialized.HasField("mrope_positions"):
            seen.add("positions")
    assert seen == {"materialized", "abort", "positions"}


def test_encode_response_ids_out_of_range_as_the_reference(impl: str) -> None:
    """An id the response cannot carry fails as the reference does (an in-band INTERNAL)."""
    profile = load_profile(str(MODEL_CONFIG["qwen3_5"]))
    outcome = Materializer(profile).run(request_from_proto(_image_request(profile, "x"), profile))
    assert isinstance(outcome, Materialized)
    outcome.request.input_ids[3] = 2**32
    with pytest.raises(ValueError, match=r"^Value out of range: 4294967296$"):
        encode_response("x", outcome, echo_features=False)
    with pytest.raises(ValueError, match=r"^Value out of range: 4294967296$"):
        response_from_outcome("x", outcome, echo_features=False)


# ------------------------------------------------------------------------------- the stripper


def _tensor_fields(msg: pb.AdmitRequest) -> Iterator[pb.TensorData]:
    for item in msg.mm_inputs.items:
        if item.HasField("encoder_input"):
            yield item.encoder_input
        yield from item.model_specific_tensors.values()
    if msg.mrope.HasField("positions"):
        yield msg.mrope.positions


def _restore(small: bytes, payloads: list[memoryview]) -> pb.AdmitRequest:
    """The stripped message with every marker replaced by the bytes it stands for."""
    msg = pb.AdmitRequest.FromString(small)
    markers = 0
    for td in _tensor_fields(msg):
        if td.WhichOneof("payload") != "inline":
            continue
        value = td.inline
        markers += value.startswith(pbwire._NONCE)
        td.inline = bytes(pbwire.resolve_inline(value, payloads))
    # fewer when protobuf merged a stripped value away (a repeated inline, a map key)
    assert markers <= len(payloads)
    return msg


def _same(a: pb.AdmitRequest, b: pb.AdmitRequest) -> None:
    assert a == b
    assert a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


def _put_back_ids(msg: pb.AdmitRequest, parsed: pbwire.StrippedRequest) -> None:
    """The ids :func:`pbwire.take_ids` took out of ``parsed``, back in ``msg``."""
    if parsed.ids is not None and len(parsed.ids):  # (extend([]) would make it present)
        assert not msg.tokenized.input_ids
        msg.tokenized.input_ids.extend(parsed.ids.tolist())
    if parsed.unpadded is not None:
        assert not msg.input_ids_unpadded
        msg.input_ids_unpadded.extend(parsed.unpadded.tolist())


def check_strip(data: bytes, min_bytes: int = 1) -> int:
    """Strip ``data`` with every implementation; each must restore to FromString's message.

    Returns how many payloads were stripped (0: the walker left it alone).
    """
    ref = pb.AdmitRequest.FromString(data)
    results = []
    impls: list[Any] = [_oracle_strip, lambda d, m: pbwalk.strip_inline(d, m, pbwire._NONCE)]
    if pbwire._BUILT is not None:
        impls.append(lambda d, m: pbwire._BUILT.strip_inline(d, m, pbwire._NONCE))
    for strip in impls:
        got = strip(data, min_bytes)
        if got is None:
            results.append(None)
            continue
        small, payloads = got
        assert payloads, "a result always strips something"
        for view in payloads:
            assert view.obj is data and view.readonly and view.nbytes >= min_bytes
        assert len(small) < len(data) or min_bytes <= len(pbwire._NONCE) + 4
        _same(_restore(small, payloads), ref)
        results.append((small, [bytes(v) for v in payloads]))
    assert all(r == results[0] for r in results), "both builds and the reference strip alike"
    # parse_admit_request too (both implementations, via the module switch), its ids
    # taken from any message (take_ids)
    parsed = pbwire.parse_admit_request(data, min_bytes, take_min_bytes=1)
    if isinstance(parsed, pbwire.StrippedRequest):
        msg = pb.AdmitRequest()
        msg.CopyFrom(parsed.msg)
        for td in _tensor_fields(msg):
            if td.WhichOneof("payload") == "inline":
                td.inline = bytes(parsed.inline(td))
        _put_back_ids(msg, parsed)
        _same(msg, ref)
    else:
        _same(parsed, ref)
    return 0 if results[0] is None else len(results[0][1])


def _big_feature(rows: int = 64, cols: int = 600, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).random((rows, cols), dtype=np.float32)  # 150 KiB


def _large_request(rid: str = "big", **kwargs: Any) -> pb.AdmitRequest:
    """Two images with large features and a large side tensor, M-RoPE positions carried."""
    ids = np.arange(1000, 1000 + 5000, dtype=np.int64)
    items = [
        build_item(
            "image",
            placeholders=[(10, 16)],
            feature=_big_feature(seed=1),
            content_hash=7,
            image_grid_thw=[1, 8, 8],
            side={"pixel_extra": _big_feature(40, 500, seed=2), "tiny": np.arange(3)},
        ),
        build_item(
            "video",
            placeholders=[(100, 8), (200, 8)],
            feature=_big_feature(seed=3).view(np.uint16),
            feature_dtype="bfloat16",
            video_grid_thw=[[2, 4, 4]],
            placeholder_token_id=5,
        ),
    ]
    positions = np.tile(np.arange(5000, dtype=np.int64), (3, 1))  # 117 KiB
    return build_request(rid, ids, items, mrope=(positions, 3), **kwargs)


UNKNOWN_TOP = (
    _field(3, 2, _field(1, 5, b"\x00\x00\x80\x3f") + _field(2, 0, b"\x14"))  # sampling_params
    + _field(4, 0, b"\x01")  # return_logprob
    + _field(5, 0, b"\xff\xff\xff\xff\x0f")  # varint
    + _field(6, 1, b"\x01" * 8)  # fixed64
    + _field(7, 0, b"\x01")  # stream
    + _field(8, 2, b"\x08\x09")  # (an unknown length-delimited field)
    + _field(11, 2, _field(1, 2, b"10.0.0.1") + _field(2, 0, b"\xa6\x46"))  # kv_bootstrap_info
    + _field(12, 0, b"\x01")
)


def _with_unknown_nested(data: bytes) -> bytes:
    """``data`` plus unknown fields inside mm_inputs, an item, a TensorData and a map entry."""
    tensor = _field(1, 2, b"\x02\x03") + _field(2, 2, b"int8") + _field(3, 2, b"\x01" * 6)
    tensor += _field(5, 2, b"remote") + _field(99, 5, b"abcd")
    entry = _field(1, 2, b"odd") + _field(2, 2, tensor) + _field(7, 0, b"\x05")
    item = _field(1, 0, b"\x01") + _field(4, 2, entry) + _field(3, 2, tensor)
    item += _field(50, 2, b"unknown item field") + _field(5, 2, _field(1, 0, b"\x00"))
    mm = _field(1, 2, item) + _field(2, 0, b"\x07")
    return data + _field(9, 2, mm) + _field(101, 2, _field(9, 0, b"\x01"))


def _small_request(rid: str) -> pb.AdmitRequest:
    """``test_grpc_api._image_request`` without a profile (a fixed placeholder id)."""
    ids = np.arange(100, 120, dtype=np.int64)
    ids[5:9] = 248056
    item = build_item(
        "image",
        placeholders=[(5, 4)],
        feature=np.arange(16 * 6, dtype=np.float32).reshape(16, 6),
        image_grid_thw=[1, 4, 4],
        placeholder_token_id=248056,
    )
    return build_request(rid, ids, [item])


def _overlong(value: int) -> bytes:
    """A valid but non-minimal varint (two bytes more)."""
    return _varint(value)[:-1] + bytes([_varint(value)[-1] | 0x80, 0x80, 0x00])


def _requests() -> Iterator[tuple[str, bytes]]:
    base = _small_request("img")
    yield "image", base.SerializeToString()
    for label, (mutate, _) in BAD_INPUTS.items():
        req = pb.AdmitRequest()
        req.CopyFrom(base)
        mutate(req)
        yield f"bad {label}", req.SerializeToString()
    yield "text only", build_request("t", [1, 2, 3]).SerializeToString()
    yield "empty", b""
    big = _large_request().SerializeToString()
    yield "large", big
    yield "large + unknown 3-8", UNKNOWN_TOP + big + UNKNOWN_TOP
    yield "unknown nested", _with_unknown_nested(big)
    yield "unknown nested, small", _with_unknown_nested(base.SerializeToString())
    # field orders protobuf merges: mm_inputs in two parts, request_id last
    req = _large_request()
    first, second = pb.AdmitRequest(), pb.AdmitRequest()
    first.mm_inputs.items.append(req.mm_inputs.items[0])
    second.mm_inputs.items.append(req.mm_inputs.items[1])
    req.ClearField("mm_inputs")
    req.ClearField("request_id")
    yield (
        "split mm_inputs",
        first.SerializeToString()
        + req.SerializeToString()
        + second.SerializeToString()
        + _field(1, 2, b"late-id"),
    )
    feature = tensor_data(_big_feature(seed=4))
    other = tensor_data(_big_feature(seed=5))
    shm = pb.TensorData(shm=pb.ShmHandle(name="seg", nbytes=3))
    for label, tensors in {
        "encoder_input twice (merged)": [feature, other],
        "inline then shm": [feature, shm],
        "shm then inline": [shm, feature],
    }.items():
        item = b"".join(_field(3, 2, t.SerializeToString()) for t in tensors)
        yield label, _field(1, 2, b"x") + _field(9, 2, _field(1, 2, _field(1, 0, b"\x01") + item))
    inline_twice = feature.SerializeToString() + _field(3, 2, b"\x05" * 70_000)
    yield "inline twice", _field(9, 2, _field(1, 2, _field(3, 2, inline_twice)))
    entries = b"".join(
        _field(4, 2, _field(1, 2, b"k") + _field(2, 2, t.SerializeToString()))
        for t in (feature, other, feature)
    )
    yield "duplicate map keys", _field(9, 2, _field(1, 2, entries))
    entry_value_first = _field(2, 2, feature.SerializeToString()) + _field(1, 2, b"v")
    yield "map value before key", _field(9, 2, _field(1, 2, _field(4, 2, entry_value_first)))
    # non-minimal length prefixes (protobuf accepts them; the walker rewrites them)
    raw = _big_feature(seed=6).tobytes()
    td = b"\x1a" + _overlong(len(raw)) + raw + _field(2, 2, b"float32")
    item = b"\x1a" + _overlong(len(td)) + td
    yield "overlong lengths", _field(9, 2, b"\x0a" + _overlong(len(item)) + item)
    for name in vector_names():
        yield f"vector {name}", request_from_vector(load_vector(name)).SerializeToString()


REQUESTS = dict(_requests())


@pytest.mark.parametrize("label", list(REQUESTS))
@pytest.mark.parametrize("min_bytes", [1, 100, pbwire.STRIP_MIN_BYTES])
def test_strip_equals_fromstring(impl: str, label: str, min_bytes: int) -> None:
    stripped = check_strip(REQUESTS[label], min_bytes)
    # _large_request: 3 large features and positions; 3 small side tensors (2 grids, "tiny")
    if label.startswith("large") or label in {"unknown nested", "split mm_inputs"}:
        # + the unknown-nested item's feature (its odd map entry is kept whole)
        small = 3 + (label == "unknown nested")
        assert stripped == (4 if min_bytes > 1 else 4 + small), stripped
    if label in {"image", "unknown nested, small"} and min_bytes == 1:
        assert stripped >= 2


def test_large_request_strips_every_large_payload(stripping: None) -> None:
    data = _large_request().SerializeToString()
    small, payloads = pbwire.strip_inline_payloads(data) or (b"", [])
    # two features, one large side tensor, the positions; not the 3-value ones
    assert len(payloads) == 4 and len(small) < 40_000
    nested = _with_unknown_nested(UNKNOWN_TOP + data)
    assert len((pbwire.strip_inline_payloads(nested) or (b"", []))[1]) == 4


def test_generate_request_with_every_scheduler_field(
    stripping: None, compat_pb2: ModuleType
) -> None:
    """A frontend's GenerateRequest (fields 3 to 8, 10 to 12 set) with large tensors."""
    c = compat_pb2
    gen = generate_request(c, list(range(4000)), encode_item=2)
    for k in range(3):
        item = gen.mm_inputs.items.add(modality=c.IMAGE, content_hash=bytes([k]) * 8)
        item.placeholders.add(offset=10 + 100 * k, length=16)
        item.encoder_input.shape.extend([64, 600])
        item.encoder_input.dtype = "float32"
        item.encoder_input.inline = _big_feature(seed=k).tobytes()
        grid = item.model_specific_tensors["image_grid_thw"]
        grid.shape.extend([1, 3])
        grid.dtype = "int64"
        grid.inline = np.array([1, 8, 8], np.int64).tobytes()
        big_side = item.model_specific_tensors["big"]
        big_side.dtype = "uint8"
        big_side.inline = bytes(70_000)
        big_side.shape.append(70_000)
    data = gen.SerializeToString()
    assert check_strip(data, pbwire.STRIP_MIN_BYTES) == 6
    assert check_strip(data, 1) == 9
    parsed = pbwire.parse_admit_request(data)
    assert isinstance(parsed, pbwire.StrippedRequest)
    assert parsed.msg.ByteSize() < 20_000
    # the scheduler's fields are kept as unknown fields, byte for byte (check_strip: equal)
    numbers = {f.field_number for f in UnknownFieldSet(parsed.msg)}
    assert numbers == {3, 4, 5, 6, 7, 8, 11, 12}
    (entry,) = parsed.msg.encode_bootstrap_info.items  # field 10 is AdmitRequest's own
    assert (entry.item_index, entry.bootstrap_room) == (2, 9)


def test_map_entry_with_other_fields_is_kept_whole(stripping: None) -> None:
    """upb keeps such an entry as an unknown field of the item; its bytes must not change."""
    value = tensor_data(_big_feature()).SerializeToString()
    for extra in (_field(3, 0, b"\x01"), _field(1, 0, b"\x01"), _field(2, 5, b"abcd")):
        entry = _field(1, 2, b"k") + _field(2, 2, value) + extra
        plain = _field(4, 2, _field(1, 2, b"p") + _field(2, 2, value))
        data = _field(9, 2, _field(1, 2, _field(4, 2, entry) + plain))
        assert check_strip(data, pbwire.STRIP_MIN_BYTES) == 1  # the plain entry only
        parsed = pbwire.parse_admit_request(data)
        assert isinstance(parsed, pbwire.StrippedRequest)
        assert list(parsed.msg.mm_inputs.items[0].model_specific_tensors) == ["p"]


def test_groups_and_reserved_wire_types_fall_back(impl: str) -> None:
    big = _large_request().SerializeToString()
    group = _varint((20 << 3) | 3) + _field(1, 0, b"\x01") + _varint((20 << 3) | 4)
    data = big + group
    assert pb.AdmitRequest.FromString(data)  # protobuf keeps the group as unknown
    assert pbwire.strip_inline_payloads(data) is None
    parsed = pbwire.parse_admit_request(data)
    assert isinstance(parsed, pb.AdmitRequest) and parsed == pb.AdmitRequest.FromString(data)


GARBAGE = [
    b"\xff\xff\xff not protobuf",
    b"\x00\x01",  # field number 0
    b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # length beyond 2**63
    b"\x08" + b"\x80" * 10 + b"\x01",  # varint over 10 bytes
    b"\x08" + b"\xff" * 9 + b"\x02",  # varint over 64 bits
    b"\x0e\x00",  # wire type 6
    b"\x0f\x00",  # wire type 7
    b"\x0c",  # end group without start
    b"\x4a\x05\x0a\x03\x1a",  # mm_inputs whose item is cut short
    _field(9, 2, _field(1, 2, _field(3, 2, _field(3, 2, b"x" * 10)[:-3]))),
]


def _same_outcome(data: bytes, min_bytes: int) -> None:
    try:
        want = pb.AdmitRequest.FromString(data)
    except DecodeError as exc:
        with pytest.raises(DecodeError) as info:
            pbwire.parse_admit_request(data, min_bytes, take_min_bytes=1)
        assert str(info.value) == str(exc)
        return
    got = pbwire.parse_admit_request(data, min_bytes, take_min_bytes=1)
    if isinstance(got, pbwire.StrippedRequest):
        check_strip(data, min_bytes)
    else:
        _same(got, want)


@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_fails_as_fromstring(impl: str, data: bytes) -> None:
    _same_outcome(data, 1)
    _same_outcome(data + _large_request().SerializeToString(), 1)
    _same_outcome(_large_request().SerializeToString() + data, 1)


def test_every_truncation_fails_or_parses_as_fromstring(impl: str) -> None:
    data = _with_unknown_nested(UNKNOWN_TOP + _small_request("cut").SerializeToString())
    assert check_strip(data) > 0
    failures = 0
    for k in range(len(data)):
        try:
            pb.AdmitRequest.FromString(data[:k])
        except DecodeError:
            failures += 1
        _same_outcome(data[:k], 1)
    assert failures > len(data) // 2  # most cuts do not parse


def test_random_bytes_and_bit_flips(impl: str) -> None:
    rng = np.random.default_rng(3)
    data = _with_unknown_nested(_small_request("flip").SerializeToString())
    for _ in range(300):
        _same_outcome(rng.integers(0, 256, rng.integers(1, 64), dtype=np.uint8).tobytes(), 1)
    for k in range(len(data)):
        flipped = bytearray(data)
        flipped[k] ^= 1 << int(rng.integers(0, 8))
        _same_outcome(bytes(flipped), 1)


def test_invalid_utf8_fails_with_protobufs_error(stripping: None) -> None:
    data = _large_request().SerializeToString() + _field(1, 2, b"\xff\xfe")
    with pytest.raises(DecodeError):
        pb.AdmitRequest.FromString(data)
    assert pbwire.strip_inline_payloads(data) is not None  # the walker does not check strings
    _same_outcome(data, pbwire.STRIP_MIN_BYTES)


def test_min_bytes_must_be_positive(impl: str) -> None:
    with pytest.raises(ValueError):
        pbwire.strip_inline_payloads(b"", 0)


# ------------------------------------------------------------------------------- take_ids


def _take_cases() -> Iterator[tuple[str, bytes]]:
    yield from REQUESTS.items()
    a = build_request("u", [1, 200, 70000, 151655, 0, 2**32 - 1])
    a.tokenized.original_text = "hi"
    a.input_ids_unpadded.extend([1, 2, 3, 4, 5, 6])
    b = pb.AdmitRequest()
    b.tokenized.input_ids.extend([9, 8])
    b.input_ids_unpadded.extend([7])
    yield "unpadded", a.SerializeToString()
    yield "merged", a.SerializeToString() + b.SerializeToString()
    tok = _field(1, 0, _varint(5)) + _field(2, 2, b"t") + _field(1, 2, _varint(7) + _varint(300))
    yield "unpacked and packed", _field(2, 2, tok) + _field(100, 0, _varint(3)) + _field(1, 2, b"r")
    yield "empty packed", _field(2, 2, _field(1, 2, b""))
    yield "overlong value", _field(2, 2, _field(1, 2, _overlong(70000) + _varint(1)))


TAKE_CASES = dict(_take_cases())
TAKEN = {"unpadded", "merged", "unpacked and packed", "empty packed", "overlong value"}


@pytest.mark.parametrize("label", list(TAKE_CASES))
def test_take_ids_equals_fromstring(impl: str, label: str) -> None:
    took = check_take(TAKE_CASES[label], True) | check_take(TAKE_CASES[label], False)
    if label.startswith(("vector", "large")) or label in TAKEN:
        assert took
    # production takes with the compiled walk only (native off: upb parses the ids)
    assert (pbwire.take_ids(TAKE_CASES[label], True) is not None) is (took and impl == "native")


@pytest.mark.parametrize(
    "data",
    [
        _field(2, 2, _field(1, 0, _varint(2**32))),  # upb would truncate it
        _field(2, 2, _field(1, 2, _varint(2**32) + _varint(1))),
        _field(2, 2, _field(1, 2, b"\x81")),  # a cut varint
        _field(2, 2, _field(1, 2, b"\x81\x81")[:-1]),  # the field itself cut
        _field(2, 2, _field(1, 2, b"\xff" * 10 + b"\x01")),  # over 10 bytes
        _field(2, 0, _varint(5)),  # tokenized as a varint: upb keeps it as unknown
        _field(2, 2, _field(1, 5, b"\x01\x00\x00\x00")),  # an id as fixed32
        _field(100, 1, bytes(8)),  # unpadded as fixed64
        _field(2, 2, _field(1, 0, _varint(5))) + b"\x0b",  # a group start after it
        _field(1, 2, b"no ids") + _field(2, 2, _field(2, 2, b"text only")),  # nothing to take
        b"",
    ],
    ids=range(11),
)
def test_take_ids_declines_what_it_does_not_take_exactly(data: bytes) -> None:
    assert pbwalk.take_ids(data, True) is None
    if pbwire._BUILT is not None:
        assert pbwire._BUILT.take_ids(data, True) is None


def test_take_ids_truncations_and_bit_flips(impl: str) -> None:
    data = TAKE_CASES["unpacked and packed"] + TAKE_CASES["unpadded"]
    took = sum(check_take(data[:k], True) for k in range(len(data)))
    rng = np.random.default_rng(7)
    for k in range(len(data)):
        flipped = bytearray(data)
        flipped[k] ^= 1 << int(rng.integers(0, 8))
        took += check_take(bytes(flipped), True)
        _same_outcome(bytes(flipped), 1)
    assert took > len(data) // 2


@pytest.mark.parametrize("name", vector_names())
def test_request_from_taken_ids_equals_the_plain_parse(impl: str, name: str) -> None:
    msg = request_from_vector(load_vector(name))
    data = msg.SerializeToString()
    profile = load_profile(str(MODEL_CONFIG[load_vector(name).meta["family"]]))
    parsed = pbwire.parse_admit_request(data, take_min_bytes=1)
    if impl == "native":
        assert isinstance(parsed, pbwire.StrippedRequest) and parsed.ids is not None
    a = Materializer(profile).run(request_from_proto(parsed, profile))
    b = Materializer(profile).run(request_from_proto(pb.AdmitRequest.FromString(data), profile))
    assert response_from_outcome("v", a, echo_features=True) == response_from_outcome(
        "v", b, echo_features=True
    )


# ------------------------------------------------------- keys and lengths as upb reads them

# upb (protobuf 7.x, the python package's runtime) reads a key or a length in 5 bytes
# at most, a non-minimal encoding included (test_upb_reads_keys_and_lengths_in_5_bytes
# pins it): a 6th byte is "Wire format was corrupt". The walks rewrite the lengths of
# what they change (minimal varints) and take ids' keys and lengths out, so read
# leniently, a 6-to-10-byte key or length vanished and upb took the rewritten message.
UPB_KEY_LEN_MAX = 5


def _wide(value: int, n: int) -> bytes:
    """``value`` as an ``n``-byte varint (non-minimal when ``n`` is more than it needs)."""
    assert value < 1 << (7 * n)
    return bytes(((value >> (7 * k)) & 0x7F) | (0x80 if k < n - 1 else 0) for k in range(n))


def _wfield(number: int, payload: bytes, key_bytes: int = 0, len_bytes: int = 0) -> bytes:
    """A length-delimited field, its key and/or length that many bytes wide (or minimal,
    when that is wider)."""
    key, length = _varint((number << 3) | 2), _varint(len(payload))
    key = _wide((number << 3) | 2, max(key_bytes, len(key)))
    return key + _wide(len(payload), max(len_bytes, len(length))) + payload


_IDS = b"".join(_varint(v) for v in (5, 300, 70000, 2**32 - 1))


def _take_wide(where: str, n: int) -> bytes:
    """A request whose key or length at ``where`` (``"<field> key"`` or ``"<field> length"``)
    takes ``n`` bytes; the others minimal."""

    def w(name: str, number: int, payload: bytes) -> bytes:
        key = n if where == f"{name} key" else 0
        return _wfield(number, payload, key, n if where == f"{name} length" else 0)

    unpacked = _wide(0x08, max(n, 1) if where == "input_ids key, unpacked" else 1) + _varint(9)
    tok = w("input_ids", 1, _IDS) + unpacked + w("original_text", 2, b"t")
    return w("request_id", 1, b"r") + w("tokenized", 2, tok) + w("unpadded", 100, _IDS)


TAKE_WIDE = [
    f"{name} {part}"
    for name in ("tokenized", "input_ids", "unpadded", "request_id", "original_text")
    for part in ("key", "length")
] + ["input_ids key, unpacked"]


def _strip_wide(where: str, n: int) -> bytes:
    """A request of 3 large inline payloads (an item's feature, a side tensor, the M-RoPE
    positions) whose key or length at ``where`` takes ``n`` bytes; the others minimal."""

    def w(name: str, number: int, payload: bytes) -> bytes:
        key = n if where == f"{name} key" else 0
        return _wfield(number, payload, key, n if where == f"{name} length" else 0)

    big = bytes(range(256)) * 275  # 70,400 bytes: over STRIP_MIN_BYTES
    td = w("dtype", 2, b"uint8") + w("inline", 3, big)
    entry = w("map key", 1, b"k") + w("map value", 2, td)
    item = w("encoder_input", 3, td) + w("map entry", 4, entry)
    mrope = w("positions", 1, td)
    return (
        w("request_id", 1, b"r") + w("mm_inputs", 9, w("items", 1, item)) + w("mrope", 101, mrope)
    )


STRIP_WIDE = [
    f"{name} {part}"
    for name in ("mm_inputs", "items", "encoder_input", "map entry", "map key", "map value",
                 "mrope", "positions", "dtype", "inline", "request_id")
    for part in ("key", "length")
]  # fmt: skip


def _width_cases(build: Any, places: list[str]) -> list[Any]:
    """(where, n) for every width from the minimal one (keys and lengths alike) to 10."""
    out = []
    for where in places:
        minimal = build(where, 0)
        low = next(n for n in range(1, 11) if len(build(where, n)) > len(minimal)) - 1
        out += [pytest.param(where, n, id=f"{where}-{n}") for n in range(max(low, 1), 11)]
    return out


def _parses(message: Any, data: bytes) -> bool:
    try:
        message.FromString(data)
    except DecodeError:
        return False
    return True


def test_upb_reads_keys_and_lengths_in_5_bytes() -> None:
    """The facts the walks follow, established on protobuf's own parser: a key or a
    length of 1 to 5 bytes, minimal or not, parses; 6 to 10 bytes do not; a value
    varint takes 10 bytes (any 10th byte below 0x80; upb drops the bits over 64),
    not 11; a 5-byte key above 2**32 - 1 or of field number 0 does not parse."""
    for message in (pb.AdmitRequest, ts.GenerateRequest):
        for n in range(1, 11):
            upb_takes = n <= UPB_KEY_LEN_MAX
            for where in ("tokenized key", "tokenized length", "input_ids key",
                          "input_ids length", "input_ids key, unpacked"):  # fmt: skip
                assert _parses(message, _take_wide(where, n)) is upb_takes, (where, n)
            assert _parses(message, _field(50, 0, _wide(1, n)))  # a value: 10 bytes
        for last in (1, 2, 0x7F):
            assert _parses(message, _field(50, 0, b"\xff" * 9 + bytes([last])))
        assert not _parses(message, _field(50, 0, b"\x81" * 10 + b"\x00"))
        assert not _parses(message, b"\xfa\xff\xff\xff\x1f\x00")  # field 2**30 - 1: key > u32
        assert _parses(message, b"\xfa\xff\xff\xff\x0f\x00")  # field 2**29 - 1
        assert not _parses(message, _wide(2, 5) + b"\x00")  # field 0, length-delimited
    for n in range(2, 11):
        assert _parses(pb.AdmitRequest, _take_wide("unpadded key", n)) is (n <= 5)
        assert _parses(pb.AdmitRequest, _take_wide("unpadded length", n)) is (n <= 5)


@pytest.mark.parametrize(("where", "n"), _width_cases(_take_wide, TAKE_WIDE))
def test_take_ids_reads_keys_and_lengths_as_upb(impl: str, where: str, n: int) -> None:
    """take_ids takes a request with a 1-to-5-byte key or length anywhere, and declines
    one of 6 to 10 bytes (which protobuf refuses); the transport's parse answers as
    ``FromString`` either way, AdmitRequest and GenerateRequest alike."""
    data = _take_wide(where, n)
    upb_takes = n <= UPB_KEY_LEN_MAX
    assert _parses(pb.AdmitRequest, data) is upb_takes
    for unpadded in (True, False):
        took = check_take(data, unpadded)
        assert took is upb_takes, (unpadded, took)
    check_parse(data, pb.AdmitRequest, 1)
    check_parse(data, ts.GenerateRequest, 1)
    _same_outcome(data, 1)


COUNTED = {"request_id", "mm_inputs", "items", "encoder_input", "map entry", "mrope"}


@pytest.mark.parametrize(("where", "n"), _width_cases(_strip_wide, STRIP_WIDE))
def test_strip_reads_keys_and_lengths_as_upb(impl: str, where: str, n: int) -> None:
    """strip_inline (both builds and the reference) strips a request with a 1-to-5-byte
    key or length anywhere it walks or skips, and declines one of 6 to 10 bytes (which
    protobuf refuses); so does the limits count where it walks (both builds)."""
    data = _strip_wide(where, n)
    upb_takes = n <= UPB_KEY_LEN_MAX
    assert _parses(pb.AdmitRequest, data) is upb_takes
    if upb_takes:
        assert check_strip(data, pbwire.STRIP_MIN_BYTES) == 3
    else:
        assert _oracle_strip(data, pbwire.STRIP_MIN_BYTES) is None
        for build in _builds():
            assert build.strip_inline(data, pbwire.STRIP_MIN_BYTES, pbwire._NONCE) is None
        assert pbwire.strip_inline_payloads(data) is None
    _same_outcome(data, pbwire.STRIP_MIN_BYTES)
    check_parse(data, pb.AdmitRequest, pbwire.STRIP_MIN_BYTES)
    check_parse(data, ts.GenerateRequest, pbwire.STRIP_MIN_BYTES)
    # the pre-parse count reads keys and lengths alike, where it walks (not in map
    # entries, tensors or mrope)
    counted = where.rsplit(" ", 1)[0] in COUNTED
    for build in _builds():
        assert count(build, data, DEFAULT_LIMITS) == ("ok", upb_takes or not counted)
    assert pbwire.check_admit_limits(data, DEFAULT_LIMITS) is None


@pytest.mark.parametrize(
    "key",
    [
        _wide(0x12, 5)[:4] + b"\x10",  # field 2 in 5 bytes, the key above 2**32 - 1
        _wide(2, 5),  # field 0, length-delimited, in 5 bytes
    ],
)
def test_five_byte_keys_upb_refuses_are_declined(impl: str, key: bytes) -> None:
    tok = _field(1, 2, _IDS)
    for data in (key + _varint(len(tok)) + tok, _field(2, 2, key + b"\x00" + tok)):
        assert not _parses(pb.AdmitRequest, data)
        assert not check_take(data, True)
        check_parse(data, pb.AdmitRequest, 1)
        check_parse(data, ts.GenerateRequest, 1)
    big = _strip_wide("", 1)
    for data in (big + key + b"\x00", _field(9, 2, _field(1, 2, key + b"\x00")) + big):
        assert not _parses(pb.AdmitRequest, data)
        assert _oracle_strip(data, pbwire.STRIP_MIN_BYTES) is None
        assert pbwire.strip_inline_payloads(data) is None
        _same_outcome(data, pbwire.STRIP_MIN_BYTES)


@pytest.mark.parametrize("n", [1, 5, 6, 10])
def test_wide_lengths_end_admit_and_generate_as_protobuf(native_mode: Any, n: int) -> None:
    """End to end through the request deserializers of ``Admit`` and SMG's ``Generate``
    (the transport's thresholds: the ids are taken), native on and off: a 6-byte
    length of ``tokenized`` or of its ``input_ids`` is undecodable (``INVALID_ARGUMENT``,
    protobuf's words), a 5-byte one materializes as the minimal one does."""
    ids = list(range(1000, 1600))  # 1.2 KB: over TAKE_MIN_BYTES
    packed = b"".join(_varint(v) for v in ids)
    profile = load_profile(str(MODEL_CONFIG["qwen3_5"]))
    for at in ("tokenized", "input_ids"):
        tok = _wfield(1, packed, len_bytes=n if at == "input_ids" else 0)
        data = _field(1, 2, b"wide") + _wfield(2, tok, len_bytes=n if at == "tokenized" else 0)
        assert len(data) >= pbwire.TAKE_MIN_BYTES
        admit = pbwire.parse_or_undecodable(
            lambda b: pbwire.parse_admit_request(b, limits=DEFAULT_LIMITS), data
        )
        gen = pbwire.parse_or_undecodable(
            lambda b: smg_request.parse_generate(b, DEFAULT_LIMITS), data
        )
        if n > UPB_KEY_LEN_MAX:
            for got, message in ((admit, pb.AdmitRequest), (gen, ts.GenerateRequest)):
                with pytest.raises(DecodeError) as info:
                    message.FromString(data)
                assert isinstance(got, pbwire.Undecodable) and got.message == str(info.value)
            continue
        assert pbwire.ids_of(admit).tolist() == ids and pbwire.ids_of(gen).tolist() == ids
        if pbwire.HAVE_NATIVE:
            assert isinstance(admit, pbwire.StrippedRequest) and admit.ids is not None
        out = Materializer(profile).run(request_from_proto(admit, profile))
        assert isinstance(out, Materialized) and out.request.input_ids.tolist() == ids
        gen_req = smg_request.request_from_generate(gen, profile)
        assert gen_req.input_ids.tolist() == ids


# ------------------------------------------------------------------------------ zero copy


def test_large_feature_is_a_view_on_the_received_bytes(stripping: None) -> None:
    profile = load_profile(str(MODEL_CONFIG["qwen3_5"]))
    assert profile.image_token_id is not None
    ids = np.arange(100, 120, dtype=np.int64)
    ids[5:9] = profile.image_token_id
    feature = np.random.default_rng(0).random((16, 1200), dtype=np.float32)  # 75 KiB
    item = build_item("image", placeholders=[(5, 4)], feature=feature, image_grid_thw=[1, 4, 4])
    data = build_request("zc", ids, [item]).SerializeToString()
    parsed = pbwire.parse_admit_request(data)
    assert isinstance(parsed, pbwire.StrippedRequest)
    assert parsed.msg.ByteSize() < 1000
    req = request_from_proto(parsed, profile)
    assert req.mm is not None
    got = req.mm.items[0].feature
    assert got is not None and got.data.obj is data  # no copy: a slice of what was received
    assert np.shares_memory(got.to_numpy(), np.frombuffer(data, np.uint8))
    np.testing.assert_array_equal(got.to_numpy(), feature)
    # small side tensors are protobuf's own copies, as before
    grid = req.mm.items[0].side["image_grid_thw"]
    assert grid.data.obj is not data
    np.testing.assert_array_equal(grid.to_numpy(), [[1, 4, 4]])
    # and it materializes like the plain message
    plain = request_from_proto(pb.AdmitRequest.FromString(data), profile)
    a, b = Materializer(profile).run(req), Materializer(profile).run(plain)
    assert isinstance(a, Materialized) and isinstance(b, Materialized)
    assert response_from_outcome("zc", a, echo_features=True) == response_from_outcome(
        "zc", b, echo_features=True
    )


def test_small_message_is_parsed_plainly(impl: str) -> None:
    profile = load_profile(str(MODEL_CONFIG["qwen3_5"]))
    data = _image_request(profile, "small").SerializeToString()
    parsed = pbwire.parse_admit_request(data)
    assert isinstance(parsed, pb.AdmitRequest) and parsed == pb.AdmitRequest.FromString(data)


def test_client_inline_is_never_a_marker(stripping: None) -> None:
    foreign = bytes(16) + (0).to_bytes(4, "little")  # marker-sized, another nonce
    assert pbwire.resolve_inline(foreign, [memoryview(b"x")]).tobytes() == foreign
    ours_out_of_range = pbwire._NONCE + (5).to_bytes(4, "little")
    assert pbwire.resolve_inline(ours_out_of_range, [memoryview(b"x")]).tobytes() == (
        ours_out_of_range
    )
    assert pbwire.resolve_inline(ours_out_of_range, None).tobytes() == ours_out_of_range
    # a marker-sized client value next to a stripped payload stays itself
    item = build_item(
        "image",
        placeholders=[(0, 1)],
        feature=_big_feature(),
        side={"odd": (np.frombuffer(foreign, np.uint8), "uint8")},
    )
    data = build_request("m", [1], [item]).SerializeToString()
    parsed = pbwire.parse_admit_request(data)
    assert isinstance(parsed, pbwire.StrippedRequest) and len(parsed.payloads) == 1
    odd = parsed.msg.mm_inputs.items[0].model_specific_tensors["odd"]
    assert parsed.inline(odd).tobytes() == foreign


def test_without_the_extension_nothing_is_stripped() -> None:
    """Native off (or not built): no strip and no ids taken, though the interpreted
    walks would; upb parses the whole message."""
    data = _large_request().SerializeToString()
    assert pbwalk.strip_inline(data, pbwire.STRIP_MIN_BYTES, pbwire._NONCE) is not None
    assert pbwalk.take_ids(data, True) is not None
    with native_as(False):
        _not_stripped(data)


def _not_stripped(data: bytes) -> None:
    assert pbwire.strip_inline_payloads(data) is None
    assert pbwire.take_ids(data, True) is None
    parsed = pbwire.parse_admit_request(data, take_min_bytes=1)
    assert type(parsed) is pb.AdmitRequest
    _same(parsed, pb.AdmitRequest.FromString(data))
    assert _oracle_strip(data, pbwire.STRIP_MIN_BYTES) is not None  # there was something to strip
