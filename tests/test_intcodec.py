"""mmadmit.intcodec: msgpack int arrays <-> int64 numpy arrays.

Contract: the native extension (``mmadmit._intcodec``), the pure-Python
fallback and msgpack-python agree byte for byte on encoding and value for
value on decoding; both implementations raise ``ValueError`` with the *same*
message for each malformed input.

The "native" cases skip when the extension is not built (a machine without a
compiler at install time: ``pip install -e .`` then installs the fallback only);
the fallback cases always run. ``mmadmit.intcodec.HAVE_NATIVE`` says which one
the public functions use.

Run with: python -m pytest tests/test_intcodec.py -q
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mmadmit import intcodec as ic

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

EDGE_VALUES = [
    0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
]  # fmt: skip

native_only = pytest.mark.skipif(
    not ic.HAVE_NATIVE,
    reason="mmadmit._intcodec not built (no C compiler at install time); fallback only",
)

Decoder = Callable[[Any], np.ndarray]
Encoder = Callable[[Any], bytes]

DECODERS = [
    pytest.param(lambda raw: ic._decode_native(ic._as_bytes(raw)), id="native", marks=native_only),
    pytest.param(lambda raw: ic._decode_py(ic._as_bytes(raw)), id="fallback"),
    pytest.param(ic.decode_int_array, id="public"),
]
ENCODERS = [
    pytest.param(lambda v: ic._encode_native(ic._as_int64(v)), id="native", marks=native_only),
    pytest.param(lambda v: ic._encode_py(ic._as_int64(v)), id="fallback"),
    pytest.param(ic.encode_int_array, id="public"),
]


def _random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    """Values from every msgpack int form, edges included."""
    bounds = [
        (INT64_MIN, -(2**31) - 1), (-(2**31), -32769), (-32768, -129), (-128, -33),
        (-32, -1), (0, 127), (128, 255), (256, 65535), (65536, 2**32 - 1), (2**32, INT64_MAX),
    ]  # fmt: skip
    form = rng.integers(0, len(bounds), size=n)
    out = np.empty(n, dtype=np.int64)
    for k, (lo, hi) in enumerate(bounds):
        mask = form == k
        out[mask] = rng.integers(lo, hi, size=int(mask.sum()), endpoint=True, dtype=np.int64)
    edges = np.array(EDGE_VALUES, dtype=np.int64)
    out[rng.integers(0, n, size=min(n, 64))] = rng.choice(edges, size=min(n, 64))
    return out


# --------------------------------------------------------------------------
# Encoding


@pytest.mark.parametrize("encode", ENCODERS)
@pytest.mark.parametrize("value", EDGE_VALUES)
def test_encode_edge_value_matches_packb(encode: Encoder, value: int) -> None:
    assert encode(np.array([value], dtype=np.int64)) == msgpack.packb([value])


@pytest.mark.parametrize("encode", ENCODERS)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 1000, 65535, 65536, 131072])
def test_encode_random_matches_packb(encode: Encoder, n: int) -> None:
    values = _random_ids(np.random.default_rng(n), n)
    expected = msgpack.packb(values.tolist())
    assert encode(values) == expected
    assert msgspec.msgpack.encode(values.tolist()) == expected  # msgspec agrees too


@pytest.mark.parametrize("encode", ENCODERS)
@pytest.mark.parametrize(
    ("n", "header"),
    [
        (0, b"\x90"),
        (15, b"\x9f"),
        (16, b"\xdc\x00\x10"),
        (65535, b"\xdc\xff\xff"),
        (65536, b"\xdd\x00\x01\x00\x00"),
    ],
)
def test_encode_array_headers(encode: Encoder, n: int, header: bytes) -> None:
    out = encode(np.zeros(n, dtype=np.int64))
    assert out == header + b"\x00" * n


@pytest.mark.parametrize("encode", ENCODERS)
@pytest.mark.parametrize(
    "dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64]
)
def test_encode_any_int_dtype(encode: Encoder, dtype: type) -> None:
    info = np.iinfo(dtype)
    hi = min(int(info.max), INT64_MAX)
    values = [int(info.min), 0, 1, 127, 128, hi]
    values = [v for v in values if info.min <= v <= hi]
    arr: np.ndarray = np.array(values, dtype=dtype)
    assert encode(arr) == msgpack.packb(values)
    assert encode(arr[::-1][::2]) == msgpack.packb(values[::-1][::2])  # non-contiguous


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_accepts_lists_and_empty(encode: Encoder) -> None:
    assert encode([1, -1, 300]) == msgpack.packb([1, -1, 300])
    assert encode([]) == b"\x90"
    assert encode(np.array([], dtype=np.float64)) == b"\x90"


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_errors(encode: Encoder) -> None:
    with pytest.raises(TypeError, match="integer dtype"):
        encode(np.array([1.0, 2.0]))
    with pytest.raises(TypeError, match="integer dtype"):
        encode(np.array([True]))
    with pytest.raises(ValueError, match="1-D"):
        encode(np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"element 1: uint64 value 9223372036854775808 exceeds"):
        encode(np.array([1, 2**63], dtype=np.uint64))


# --------------------------------------------------------------------------
# Decoding


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 1000, 65535, 65536, 131072])
def test_decode_random_matches_unpackb(decode: Decoder, n: int) -> None:
    values = _random_ids(np.random.default_rng(1000 + n), n)
    raw = msgpack.packb(values.tolist())
    out = decode(raw)
    assert out.dtype == np.int64 and out.shape == (n,)
    assert out.tolist() == msgpack.unpackb(raw) == values.tolist()


@pytest.mark.parametrize("decode", DECODERS)
def test_decode_edge_values(decode: Decoder) -> None:
    raw = msgpack.packb(EDGE_VALUES)
    assert decode(raw).tolist() == EDGE_VALUES


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("raw", [b"\x90", b"\xdc\x00\x00", b"\xdd\x00\x00\x00\x00"])
def test_decode_empty(decode: Decoder, raw: bytes) -> None:
    out = decode(raw)
    assert out.dtype == np.int64 and out.shape == (0,)


def _be(value: int, width: int, signed: bool) -> bytes:
    return value.to_bytes(width, "big", signed=signed)


@pytest.mark.parametrize("decode", DECODERS)
def test_decode_non_minimal_forms(decode: Decoder) -> None:
    # Other encoders may use wider forms (and array16/32 for short arrays).
    elems = [
        (b"\xcf" + _be(5, 8, False), 5),
        (b"\xce" + _be(7, 4, False), 7),
        (b"\xcd" + _be(1, 2, False), 1),
        (b"\xcc\x00", 0),
        (b"\xd0\x05", 5),
        (b"\xd1" + _be(-2, 2, True), -2),
        (b"\xd2" + _be(-3, 4, True), -3),
        (b"\xd3" + _be(-7, 8, True), -7),
        (b"\xd3" + _be(INT64_MAX, 8, True), INT64_MAX),
        (b"\xcf" + _be(INT64_MAX, 8, False), INT64_MAX),
        (b"\xd3" + _be(INT64_MIN, 8, True), INT64_MIN),
    ]
    body = b"".join(e for e, _ in elems)
    expected = [v for _, v in elems]
    assert decode(b"\xdc" + _be(len(elems), 2, False) + body).tolist() == expected
    assert decode(b"\xdd" + _be(len(elems), 4, False) + body).tolist() == expected


@pytest.mark.parametrize("decode", DECODERS)
def test_decode_input_types(decode: Decoder) -> None:
    raw = msgpack.packb([1, 300, -5, 70000])
    expected = [1, 300, -5, 70000]
    for src in (
        raw,
        bytearray(raw),
        memoryview(raw),
        msgspec.Raw(raw),
        np.frombuffer(raw, dtype=np.uint8),
        memoryview(b"xx" + raw)[2:],  # a view at an offset
        memoryview(bytes(b for pair in zip(raw, raw, strict=True) for b in pair))[::2],
    ):
        assert decode(src).tolist() == expected, type(src)


@pytest.mark.parametrize("decode", DECODERS)
def test_decode_msgspec_raw_field(decode: Decoder) -> None:
    # How wire.py uses it: one element of a larger message kept as msgspec.Raw.
    ids = list(range(0, 200000, 7))
    msg = msgpack.packb(["rid", ids, None])
    _, raw, _ = msgspec.msgpack.decode(msg, type=tuple[str, msgspec.Raw, None])
    assert decode(raw).tolist() == ids


@pytest.mark.parametrize("decode", DECODERS)
def test_decode_result_is_writable_and_owned(decode: Decoder) -> None:
    out = decode(msgpack.packb([1, 2, 3]))
    out[0] = 9  # the caller may edit it (pad substitution)
    assert out.tolist() == [9, 2, 3]


# Malformed inputs: (raw, the error message without the common prefix).
ERROR_CASES = [
    pytest.param(b"", "truncated input: empty buffer", id="empty-buffer"),
    pytest.param(b"\xc0", "expected an array header, got nil (type byte 0xc0)", id="nil-not-array"),
    pytest.param(
        b"\x81\x01\x02", "expected an array header, got map (type byte 0x81)", id="map-not-array"
    ),
    pytest.param(b"\x05", "expected an array header, got int (type byte 0x05)", id="int-not-array"),
    pytest.param(
        b"\xa1a", "expected an array header, got str (type byte 0xa1)", id="str-not-array"
    ),
    pytest.param(
        b"\xdc\x00",
        "truncated input: array header (type byte 0xdc) needs 3 bytes, only 2 given",
        id="array16-header-cut",
    ),
    pytest.param(
        b"\xdd\x00\x00",
        "truncated input: array header (type byte 0xdd) needs 5 bytes, only 3 given",
        id="array32-header-cut",
    ),
    pytest.param(
        b"\x93\x01\x02",
        "truncated input: array header declares 3 elements but only 2 bytes follow",
        id="count-exceeds-bytes",
    ),
    pytest.param(
        b"\xdd\xff\xff\xff\xff",
        "truncated input: array header declares 4294967295 elements but only 0 bytes follow",
        id="forged-huge-count",
    ),
    pytest.param(
        b"\x92\x01\xc0",
        "element 1: expected an int, got nil (type byte 0xc0)",
        id="nil-element",
    ),
    pytest.param(
        b"\x92\x01\xcb" + b"\x00" * 8,
        "element 1: expected an int, got float64 (type byte 0xcb)",
        id="float-element",
    ),
    pytest.param(
        b"\x91\xc3", "element 0: expected an int, got bool (type byte 0xc3)", id="bool-element"
    ),
    pytest.param(
        b"\x91\x91\x01",
        "element 0: expected an int, got array (type byte 0x91)",
        id="nested-array",
    ),
    pytest.param(
        b"\x91\xa1a", "element 0: expected an int, got str (type byte 0xa1)", id="str-element"
    ),
    pytest.param(
        b"\x91\xd4\x01\x00",
        "element 0: expected an int, got ext (type byte 0xd4)",
        id="ext-element",
    ),
    pytest.param(
        b"\x92\x01\xcd\x01",
        "truncated input: element 1 (type byte 0xcd) needs 3 bytes at offset 2, only 2 left",
        id="uint16-cut",
    ),
    pytest.param(
        b"\x92\x01\xd3\x00\x00\x00",
        "truncated input: element 1 (type byte 0xd3) needs 9 bytes at offset 2, only 4 left",
        id="int64-cut",
    ),
    pytest.param(
        b"\x93\xcd\x00\x01\x02",
        "truncated input: element 2 missing at offset 5",
        id="element-missing",
    ),
    pytest.param(
        b"\x92\x01\xcf" + (2**63).to_bytes(8, "big"),
        "element 1: uint64 value 9223372036854775808 exceeds the int64 range",
        id="uint64-above-int64",
    ),
    pytest.param(
        b"\x91\xcf" + (2**64 - 1).to_bytes(8, "big"),
        "element 0: uint64 value 18446744073709551615 exceeds the int64 range",
        id="uint64-max",
    ),
    pytest.param(
        b"\x91\x01\x02", "1 trailing bytes after the array (at offset 2)", id="trailing-byte"
    ),
    pytest.param(
        b"\x90\x90\x90", "2 trailing bytes after the array (at offset 1)", id="trailing-array"
    ),
]


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize(("raw", "message"), ERROR_CASES)
def test_decode_errors(decode: Decoder, raw: bytes, message: str) -> None:
    with pytest.raises(ValueError) as info:
        decode(raw)
    assert str(info.value) == "msgpack int array: " + message


@native_only
@pytest.mark.parametrize(("raw", "message"), ERROR_CASES)
def test_native_and_fallback_errors_identical(raw: bytes, message: str) -> None:
    errors = []
    for impl in (ic._decode_native, ic._decode_py):
        with pytest.raises(ValueError) as info:
            impl(ic._as_bytes(raw))
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


# --------------------------------------------------------------------------
# Native low-level API


@native_only
def test_native_low_level_api() -> None:
    from mmadmit import _intcodec  # type: ignore[attr-defined]

    raw = msgpack.packb([1, 2, 3])
    assert _intcodec.array_len(raw) == 3
    with pytest.raises(ValueError, match="out holds 2 elements, the array has 3"):
        _intcodec.decode_into(raw, np.empty(2, dtype=np.int64))
    with pytest.raises(TypeError, match="native int64"):
        _intcodec.decode_into(raw, np.empty(3, dtype=np.float64))
    with pytest.raises(TypeError, match="native int64"):
        _intcodec.decode_into(raw, np.empty(3, dtype=">i8"))
    readonly = np.empty(3, dtype=np.int64)
    readonly.flags.writeable = False
    with pytest.raises((BufferError, ValueError, TypeError)):
        _intcodec.decode_into(raw, readonly)
    with pytest.raises(TypeError, match="native int64"):
        _intcodec.encode(np.array([1, 2], dtype=np.int32))
    with pytest.raises(TypeError):
        _intcodec.decode_into(raw)
    assert _intcodec.encode(np.array([1, 2, 3], dtype=np.int64)) == raw


# --------------------------------------------------------------------------
# Property: any int64 list round-trips and matches msgpack-python


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=INT64_MIN, max_value=INT64_MAX), max_size=40))
def test_property_round_trip(values: list[int]) -> None:
    arr = np.array(values, dtype=np.int64)
    raw = msgpack.packb(values)
    impls: list[tuple[Callable[[Any], Any], Callable[[Any], Any]]] = [
        (ic._encode_py, ic._decode_py)
    ]
    if ic.HAVE_NATIVE:
        impls.append((ic._encode_native, ic._decode_native))
    for encode, decode in impls:
        assert encode(arr) == raw
        assert decode(memoryview(raw)).tolist() == values
