"""mmadmit.intcodec: msgpack int arrays <-> int64 numpy arrays.

Contract: the walker compiled (``mmadmit._walk_c``, built by Cython from
``mmadmit/msgpack_walk.py``), the same source interpreted and msgpack-python
agree byte for byte on encoding and value for value on decoding; both builds
raise ``ValueError`` with the *same* message for each malformed input (split
errors included).

The "native" cases skip when the extension is not built (``intcodec._BUILT`` is
None: a machine without a compiler or Cython at install time, ``pip install -e .``
then installs the pure module only), not when native code is switched off
(``MMADMIT_NATIVE=0``): they run the compiled walker all the same, with native
switched on for the case; the interpreted cases always run.
``mmadmit.intcodec.HAVE_NATIVE`` says which one the public functions use.

Run with: python -m pytest tests/test_intcodec.py -q
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgpack
import msgspec
import numpy as np
import pytest
from conftest import REPO_ROOT, native_as
from hypothesis import given, settings
from hypothesis import strategies as st
from mmadmit import intcodec as ic
from mmadmit import msgpack_walk

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))
from fuzz.targets._common import on_walk  # noqa: E402

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

EDGE_VALUES = [
    0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
]  # fmt: skip


# each public function on the compiled walker (_native) and the interpreted one (_py)
_decode_native, _decode_py = (
    on_walk(ic._BUILT, ic.decode_int_array),
    on_walk(msgpack_walk, ic.decode_int_array),
)
_encode_native, _encode_py = (
    on_walk(ic._BUILT, ic.encode_int_array),
    on_walk(msgpack_walk, ic.encode_int_array),
)
_split_native, _split_py = on_walk(ic._BUILT, ic.split_array), on_walk(msgpack_walk, ic.split_array)


def _rows_on(walk: Any) -> Callable[..., Any]:
    """int_rows of one build of the walker, on any buffer."""
    return lambda raw, starts, width: walk.int_rows(ic._as_bytes(raw), list(starts), width)


_rows_native, _rows_py = _rows_on(ic._BUILT), _rows_on(msgpack_walk)
_filled_native = on_walk(ic._BUILT, ic.encode_int_array_filled)
_filled_py = on_walk(msgpack_walk, ic.encode_int_array_filled)

native_only = pytest.mark.skipif(
    ic._BUILT is None,
    reason="mmadmit._walk_c not built (no C compiler or Cython at install time); interpreted only",
)


@contextmanager
def _native(on: bool) -> Iterator[None]:
    """Native switched ``on`` or off, whatever the session's setting
    (``MMADMIT_NATIVE``); the session's setting restored afterwards."""
    with native_as(on):
        assert ic.HAVE_NATIVE is (on and ic._BUILT is not None)
        yield


_NATIVE_PARAMS: list[Callable[..., Any]] = []


def _native_param(fn: Callable[..., Any]) -> Any:
    """A "native" case: skipped only where the walker is not built, run with native
    switched on (``_compiled_native_params``)."""
    _NATIVE_PARAMS.append(fn)
    return pytest.param(fn, id="native", marks=native_only)


@pytest.fixture(autouse=True)
def _compiled_native_params(request: pytest.FixtureRequest) -> Iterator[None]:
    """A case with a "native" param runs entirely with native switched on (``_native``),
    so that what the public functions hand it (marks) comes from the compiled walker."""
    callspec = getattr(request.node, "callspec", None)
    values = list(callspec.params.values()) if callspec is not None else []
    if any(v is fn for v in values for fn in _NATIVE_PARAMS):
        with _native(True):
            yield
    else:
        yield


Decoder = Callable[[Any], np.ndarray]
Encoder = Callable[[Any], bytes]

DECODERS = [
    _native_param(lambda raw: _decode_native(ic._as_bytes(raw))),
    pytest.param(lambda raw: _decode_py(ic._as_bytes(raw)), id="interpreted"),
    pytest.param(ic.decode_int_array, id="public"),
]
ENCODERS = [
    _native_param(lambda v: _encode_native(ic._as_int64(v))),
    pytest.param(lambda v: _encode_py(ic._as_int64(v)), id="interpreted"),
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
def test_native_and_interpreted_errors_identical(raw: bytes, message: str) -> None:
    errors = []
    for impl in (_decode_native, _decode_py):
        with pytest.raises(ValueError) as info:
            impl(ic._as_bytes(raw))
        errors.append((type(info.value), str(info.value)))
    assert errors[0] == errors[1]


# --------------------------------------------------------------------------
# Native low-level API


@native_only
def test_native_low_level_api() -> None:
    from mmadmit import _walk_c  # type: ignore[attr-defined]

    raw = msgpack.packb([1, 2, 3])
    assert _walk_c.array_len(raw) == 3
    assert _walk_c.decode(raw).tolist() == [1, 2, 3]
    assert _walk_c.encode(np.array([1, 2, 3], dtype=np.int64)) == raw
    readonly = np.array([1, 2, 3], dtype=np.int64)
    readonly.flags.writeable = False
    assert _walk_c.encode(readonly) == raw
    for bad in (np.empty(3, dtype=np.float64), np.array([1, 2], dtype=np.int32)):
        with pytest.raises(ValueError, match="dtype mismatch"):
            _walk_c.encode(bad)
    with pytest.raises(ValueError):  # a big-endian buffer is refused, never misread
        _walk_c.encode(np.array([1, 2], dtype=">i8"))
    with pytest.raises(TypeError):
        _walk_c.decode()
    with pytest.raises(TypeError):  # the wrappers pass lists and tuples, nothing else
        _walk_c.check_structure(raw, (0, 4), (), 4, 4)


def test_one_walker_source() -> None:
    """The compiled walker is the pure module compiled: the same entry points,
    one IntArrayTooLong class for both."""
    from mmadmit import msgpack_walk

    public = {"array_len", "check_structure", "decode", "element_span", "encode",
              "int_rows", "build_items", "splice_items"}  # fmt: skip
    assert public | {"split"} <= set(dir(msgpack_walk))
    if ic._BUILT is not None:
        assert public | {"split"} <= set(dir(ic._BUILT))
        assert ic._BUILT.IntArrayTooLong is msgpack_walk.IntArrayTooLong is ic.IntArrayTooLong
        assert "compiled" in ic._BUILT.__doc__ and ic._BUILT.__file__.endswith(".so")


# --------------------------------------------------------------------------
# Property: any int64 list round-trips and matches msgpack-python


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=INT64_MIN, max_value=INT64_MAX), max_size=40))
def test_property_round_trip(values: list[int]) -> None:
    arr = np.array(values, dtype=np.int64)
    raw = msgpack.packb(values)
    impls: list[tuple[Callable[[Any], Any], Callable[[Any], Any]]] = [(_encode_py, _decode_py)]
    if ic._BUILT is not None:
        impls.append((_encode_native, _decode_native))
    for encode, decode in impls:
        assert encode(arr) == raw
        assert decode(memoryview(raw)).tolist() == values


# --------------------------------------------------------------------------
# Splitting: split_array / int_rows, native vs interpreted
#
# For every valid input both implementations return the very same offsets,
# spans, rows and int arrays; for every malformed one both raise ValueError
# (texts differ: the wire codec wraps them).

SPLITTERS = [
    _native_param(_split_native),
    pytest.param(_split_py, id="interpreted"),
]
ROWERS = [
    _native_param(_rows_native),
    pytest.param(_rows_py, id="interpreted"),
]

Ext = msgpack.ExtType


def _every_form() -> list[Any]:
    """One value of every msgpack type and length form (nested containers too)."""
    return [
        None, True, False, 0, 127, -1, -32, -33, 255, 256, 65536, 2**32, 2**64 - 1, -(2**63),
        1.5, "", "x" * 31, "y" * 32, "z" * 256, "w" * 65536, b"", b"b" * 256, b"c" * 65536,
        Ext(3, b""), Ext(3, b"1"), Ext(4, b"22"), Ext(5, b"4444"), Ext(6, b"8" * 8),
        Ext(7, b"g" * 16), Ext(8, b"h" * 3), Ext(9, b"i" * 300), Ext(10, b"j" * 70000),
        [], [1, [2, [3, [4]]]], list(range(16)), list(range(70000)), {}, {"a": {"b": [1]}},
        {str(i): i for i in range(16)}, {i: [i] for i in range(70000)},
    ]  # fmt: skip


def _pack(values: list[Any]) -> bytes:
    return msgpack.packb(values, use_bin_type=True)


def _expected_offsets(values: list[Any]) -> list[int]:
    parts = [_pack([v])[1:] if len(values) else b"" for v in values]  # each value alone
    header = len(_pack(values)) - sum(len(p) for p in parts)
    offsets = [header]
    for p in parts:
        offsets.append(offsets[-1] + len(p))
    return offsets


@pytest.mark.parametrize("split", SPLITTERS)
def test_split_every_value_form(split: Callable[..., Any]) -> None:
    values = _every_form()
    raw = _pack(values)
    offsets, ints = split(ic._as_bytes(raw), ())
    assert ints == []
    assert len(offsets) == len(values) + 1 and offsets[-1] == len(raw)
    for i, v in enumerate(values):
        assert (
            msgpack.unpackb(raw[offsets[i] : offsets[i + 1]], strict_map_key=False)
            == (msgpack.unpackb(_pack([v]), strict_map_key=False)[0])
        ), i


@pytest.mark.parametrize("split", SPLITTERS)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 65536])
def test_split_array_headers(split: Callable[..., Any], n: int) -> None:
    values = list(range(n))
    body = b"".join(_pack([v])[1:] for v in values)
    forms = [_pack(values), b"\xdd" + _be(n, 4, False) + body]
    if n <= 0xFFFF:
        forms.append(b"\xdc" + _be(n, 2, False) + body)
    for raw in forms:
        offsets, ints = split(ic._as_bytes(raw), (0,))
        assert len(offsets) == n + 1 and offsets[-1] == len(raw)
        assert offsets[1:] == [len(raw) - len(body) + k + 1 for k in _cumulative(body, n)]


def _cumulative(body: bytes, n: int) -> list[int]:
    """End offsets (minus one) of n concatenated msgpack ints in body."""
    out, pos = [], 0
    for _ in range(n):
        b = body[pos]
        pos += 1 if b <= 0x7F else {0xCC: 2, 0xCD: 3, 0xCE: 5}[b]
        out.append(pos - 1)
    return out


@pytest.mark.parametrize("split", SPLITTERS)
def test_split_decodes_int_fields(split: Callable[..., Any]) -> None:
    ids = _random_ids(np.random.default_rng(7), 5000)
    values = ["tag", ids.tolist(), None, [], [1, "x"], [2**63], [[1]], "s", ids[:3].tolist()]
    raw = _pack(values)
    offsets, ints = split(ic._as_bytes(raw), (1, 2, 3, 4, 5, 6, 8, 40))
    assert offsets == _expected_offsets(values)
    assert ints[0].dtype == np.int64 and ints[0].tolist() == ids.tolist()
    assert ints[2].tolist() == [] and ints[2].dtype == np.int64
    # nil, and arrays not all of int64-range ints: what decode_int_array says of the
    # element's bytes, worded by the split itself
    for k, field in ((1, 2), (3, 4), (4, 5), (5, 6)):
        with pytest.raises(ValueError) as exc:
            ic.decode_int_array(raw[offsets[field] : offsets[field + 1]])
        assert ints[k] == str(exc.value), (k, ints[k])
    assert ints[1] == "msgpack int array: expected an array header, got nil (type byte 0xc0)"
    assert ints[6].tolist() == ids[:3].tolist()
    assert ints[7] is None  # no element 40
    ints[0][0] = 1  # a new writable array
    with pytest.raises(ValueError, match="distinct"):
        ic.split_array(raw, (1, 1))


def _small_message() -> bytes:
    return _pack(
        [
            "TokenizedGenerateReqInput", "rid", None, "text", [1, 200, 70000, -5],
            [16, None, [1], 1.0, {"k": Ext(3, b"ab")}], False, -1, 0, None, True,
            [[1, 2], [3]], b"bin", [[1, [[2, 3]], ["float32", [2], Ext(3, b"12345678")]]],
        ]
    )  # fmt: skip


@pytest.mark.parametrize("split", SPLITTERS)
def test_split_truncated_at_every_offset(split: Callable[..., Any]) -> None:
    raw = _small_message()
    split(ic._as_bytes(raw), (4,))
    for cut in range(len(raw)):
        with pytest.raises(ValueError):
            split(ic._as_bytes(raw[:cut]), (4,))
    with pytest.raises(ValueError):
        split(ic._as_bytes(raw + b"\x00"), (4,))  # trailing byte


@pytest.mark.parametrize("split", SPLITTERS)
@pytest.mark.parametrize(
    "raw",
    [
        b"\xc1",  # never-used byte
        b"\x91\xc1",
        b"\x92\x01\x91\xc1",
        b"\xa5hello",  # not an array
        b"\x81\x01\x02",
        b"\xdd\xff\xff\xff\xff",  # forged counts
        b"\x91\xdd\xff\xff\xff\xff",
        b"\x91\xdf\xff\xff\xff\xff",
        b"\x91\xdb\xff\xff\xff\xff",
        b"\x91\xc6\xff\xff\xff\xff",
        b"\x91\xc9\xff\xff\xff\xff\x03",
        b"\x91\xd8\x03",  # fixext 16 cut
    ],
)
def test_split_malformed(split: Callable[..., Any], raw: bytes) -> None:
    with pytest.raises(ValueError):
        split(ic._as_bytes(raw), ())


@native_only
def test_split_native_nesting_has_no_depth_limit() -> None:
    deep = b"\x92" + b"\x91" * 200_000 + b"\xc0" + b"\x01"
    offsets, _ = _split_native(ic._as_bytes(deep), ())
    assert offsets == [1, len(deep) - 1, len(deep)]
    with pytest.raises(ValueError):
        _split_native(ic._as_bytes(deep[:-1]), ())  # the outer array misses an element


def test_split_public_api_matches_interpreted() -> None:
    raw = _small_message()
    assert ic.split_array(raw, (4,))[0] == _split_py(ic._as_bytes(raw), (4,))[0]
    assert ic.split_array(memoryview(raw))[0] == _expected_offsets(msgpack.unpackb(raw))


def _items_payload() -> tuple[bytes, list[Any]]:
    items = [
        [1, 5, None, [[1, 2], [3, 4]], None, None, {}, None, None, None],
        "not an array",
        [],
        [2],
        [3, None],
        [1, None, 7],
        [1, None, 7, None],
        [1, 2**64 - 1, None, [], ["f", [1], 3], {"a": 1}, {"g": ["int64", [0], Ext(3, b"")]}, None,
         None, None, "trailing", {"x": [1]}],
    ]  # fmt: skip
    return _pack(items), items


def test_element_span_both_builds() -> None:
    """element_span (recover_rid's one probe): every element's span, compiled and
    interpreted alike; the whole array checked (a cut or trailing byte refused
    even past the element asked for), any nesting depth, no element out of range."""
    from mmadmit import msgpack_walk

    raw, items = _items_payload()
    walks = [msgpack_walk] + ([ic._BUILT] if ic._BUILT is not None else [])
    offsets = _expected_offsets(items)
    deep = b"\x93\xa1T\xa3rid" + b"\x91" * 5000 + b"\xc0"
    for walk in walks:
        for i in range(len(items)):
            assert walk.element_span(ic._as_bytes(raw), i) == (offsets[i], offsets[i + 1])
        assert walk.element_span(ic._as_bytes(deep), 1) == (3, 7)
        for bad, index in ((raw, len(items)), (raw, -1), (raw + b"\xc0", 0), (deep[:-1], 1)):
            with pytest.raises(ValueError):
                walk.element_span(ic._as_bytes(bad), index)
    for cut in range(len(raw)):
        outcomes = []
        for walk in walks:
            try:
                outcomes.append(walk.element_span(ic._as_bytes(raw[:cut]), 0))
            except ValueError as exc:
                outcomes.append(str(exc))
        assert outcomes[1:] == outcomes[:1] * (len(walks) - 1)


@pytest.mark.parametrize("rows", ROWERS)
def test_int_rows(rows: Callable[..., Any]) -> None:
    values = [None, [[1, 2], [3, -4]], [], [[INT64_MAX, INT64_MIN]], "pad", [[0, 0]]]
    raw = _pack(values)
    starts = _expected_offsets(values)[:-1]
    table, bounds = rows(ic._as_bytes(raw), [starts[i] for i in (0, 1, 2, 3, 5)], 2)
    assert table.dtype == np.int64
    assert table.tolist() == [1, 2, 3, -4, INT64_MAX, INT64_MIN, 0, 0]
    assert bounds == [-1, -1, 0, 2, 2, 2, 2, 3, 3, 4]
    table, bounds = rows(ic._as_bytes(raw), [], 2)
    assert table.tolist() == [] and bounds == []


@pytest.mark.parametrize("rows", ROWERS)
@pytest.mark.parametrize(
    "bad",
    [
        [[1, 2, 3]],
        [[1]],
        [[1, 2**63]],
        [[1, 1.5]],
        [[True, 1]],
        [[None, 1]],
        [1, 2],
        "x",
        5,
        [[1, Ext(1, b"")]],
        {"a": 1},
        [[[1], 2]],
    ],  # fmt: skip
)
def test_int_rows_rejects(rows: Callable[..., Any], bad: Any) -> None:
    raw = _pack(["pad", bad])
    with pytest.raises(ValueError):
        rows(ic._as_bytes(raw), [4], 2)


@pytest.mark.parametrize("rows", ROWERS)
def test_int_rows_bad_offsets(rows: Callable[..., Any]) -> None:
    raw = _pack([[[1, 2]]])
    for starts in ([-1], [len(raw)], [len(raw) + 5]):
        with pytest.raises(ValueError):
            rows(ic._as_bytes(raw), starts, 2)
    with pytest.raises(ValueError):
        rows(ic._as_bytes(raw[:-1]), [1], 2)  # truncated


@pytest.mark.parametrize("rows", ROWERS)
def test_int_rows_names_the_first_start_it_refuses(rows: Callable[..., Any]) -> None:
    """The refusal names the first start, in the order given, whose value is refused,
    whichever check (a header, or a row) refuses it: each is refused alone with
    the same message."""
    good, bad_row, bad_head = [[1, 2]], [[1, 2], [3]], "x"
    for values in (
        [good, bad_row, good, bad_head],  # a row before a header
        [good, bad_head, bad_row],  # a header before a row
        [bad_row, bad_row],
        [good, None, bad_head],
    ):
        raw = _pack(values)
        starts = _expected_offsets(values)[:-1]
        first = next(i for i, v in enumerate(values) if v in (bad_row, bad_head))
        with pytest.raises(msgpack_walk.RowsError) as exc:
            rows(ic._as_bytes(raw), starts, 2)
        assert exc.value.index == first, values
        with pytest.raises(ValueError) as alone:
            rows(ic._as_bytes(raw), [starts[first]], 2)
        assert str(exc.value) == str(alone.value)
    with pytest.raises(msgpack_walk.RowsError) as outside:
        rows(ic._as_bytes(_pack([good])), [1, 99], 2)
    assert outside.value.index == 1 and "outside" in str(outside.value)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(-(2**63), 2**64 - 1)
            | st.floats()
            | st.text(max_size=40)
            | st.binary(max_size=300),
            lambda inner: (
                st.lists(inner, max_size=5)
                | st.dictionaries(st.text(max_size=5), inner, max_size=5)
            ),
            max_leaves=20,
        ),
        max_size=12,
    )
)
def test_property_split_native_matches_interpreted(values: list[Any]) -> None:
    raw = _pack(values)
    fields = tuple(range(min(len(values), 8)))
    py_offsets, py_ints = _split_py(ic._as_bytes(raw), fields)
    assert py_offsets == _expected_offsets(values)
    if ic._BUILT is None:
        return
    offsets, ints = _split_native(ic._as_bytes(raw), fields)
    assert offsets == py_offsets
    assert [a.tolist() if isinstance(a, np.ndarray) else a for a in ints] == [
        a.tolist() if isinstance(a, np.ndarray) else a for a in py_ints
    ]
    for cut in range(0, len(raw), max(1, len(raw) // 16)):
        for impl in (_split_native, _split_py):
            with pytest.raises(ValueError):
                impl(ic._as_bytes(raw[:cut]), fields)


# --------------------------------------------------------------------------
# Runs: the native codec takes runs of one int form (decoding) or one value
# (encoding) eight at a time; results and errors must not change.

_FORMS = [  # type byte, width, signed, a value in range for the form
    (0xCC, 1, False, 200), (0xCD, 2, False, 60000), (0xCE, 4, False, 248056),
    (0xCF, 8, False, 2**40 + 3), (0xD0, 1, True, -100), (0xD1, 2, True, -30000),
    (0xD2, 4, True, -(2**31)), (0xD3, 8, True, INT64_MIN),
]  # fmt: skip


def _runs(rng: np.random.Generator, n: int) -> np.ndarray:
    """Runs of random lengths of values of every form (edges included), mixed with noise."""
    out: list[int] = []
    while len(out) < n:
        length = int(rng.choice([1, 2, 7, 8, 9, 15, 16, 17, int(rng.integers(1, 400))]))
        if rng.random() < 0.3:
            out += _random_ids(rng, length).tolist()
        else:
            value = int(rng.choice(EDGE_VALUES + [248056, 151655, 300]))
            out += [value] * length
    return np.array(out[:n], dtype=np.int64)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("n", [7, 8, 9, 64, 5000, 70000])
def test_runs_match_msgpack(seed: int, n: int) -> None:
    values = _runs(np.random.default_rng([seed, n]), n)
    raw = msgpack.packb(values.tolist())
    for encode in (_encode_py, *([_encode_native] if ic._BUILT is not None else [])):
        assert encode(values) == raw
    for decode in (_decode_py, *([_decode_native] if ic._BUILT is not None else [])):
        assert decode(memoryview(raw)).tolist() == values.tolist()


@pytest.mark.parametrize("decode", DECODERS)
@pytest.mark.parametrize("form", _FORMS, ids=[hex(f[0]) for f in _FORMS])
def test_decode_runs_of_every_form(decode: Decoder, form: tuple[int, int, bool, int]) -> None:
    type_byte, width, signed, value = form
    elem = bytes([type_byte]) + _be(value, width, signed)
    for lead in range(10):  # other elements before the run: every alignment to a chunk
        for length in (1, 7, 8, 9, 16, 17, 40):
            for tail in (0, 1, 8, 20):
                ids = list(range(lead)) + [value] * length + [5] * tail
                body = b"".join(_pack([v])[1:] for v in range(lead)) + elem * length
                body += b"\x05" * tail
                raw = b"\xdd" + _be(len(ids), 4, False) + body
                assert decode(raw).tolist() == ids, (lead, length, tail)


@pytest.mark.parametrize("decode", DECODERS)
def test_decode_run_errors_name_the_element(decode: Decoder) -> None:
    big = b"\xcf" + _be(2**63 + 5, 8, False)
    good = b"\xcf" + _be(7, 8, False)
    nil = b"\xc0"
    for bad, message in (
        (big, "uint64 value 9223372036854775813 exceeds the int64 range"),
        (nil, "expected an int, got nil (type byte 0xc0)"),
        (b"\xd3" + _be(-1, 8, True), None),  # another form in the run: fine
    ):
        for at in range(0, 40):
            elems = [good] * 40
            elems[at] = bad
            raw = b"\xdc" + _be(40, 2, False) + b"".join(elems)
            if message is None:
                expected = [7] * 40
                expected[at] = -1
                assert decode(raw).tolist() == expected
                continue
            with pytest.raises(ValueError) as info:
                decode(raw)
            assert str(info.value) == f"msgpack int array: element {at}: {message}", at


@pytest.mark.parametrize("encode", ENCODERS)
def test_encode_runs_every_length_and_form(encode: Encoder) -> None:
    for value in [*EDGE_VALUES, 248056]:
        for lead in range(10):
            for length in (1, 7, 8, 9, 16, 17, 33):
                values = (
                    list(range(lead)) + [value] * length + [value + 1 if value < INT64_MAX else 0]
                )
                assert encode(np.array(values, dtype=np.int64)) == msgpack.packb(values)


# --------------------------------------------------------------------------
# Reads stay inside the input: every native routine on inputs that end right
# before an unreadable page (a read past the end would crash the process).


class _Guarded:
    """Buffers that end at a page boundary followed by a PROT_NONE page."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util
        import mmap

        self.page = mmap.PAGESIZE
        self.size = 64 * self.page
        self.map = mmap.mmap(-1, self.size + self.page)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        mprotect = libc.mprotect
        mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if mprotect(self.base + self.size, self.page, 0) != 0:  # PROT_NONE
            raise OSError(ctypes.get_errno(), "mprotect")

    def __call__(self, raw: bytes) -> memoryview:
        assert len(raw) <= self.size
        start = self.size - len(raw)
        self.map[start : self.size] = raw
        return memoryview(self.map)[start : self.size]


@pytest.fixture(scope="module")
def guarded() -> _Guarded:
    try:
        return _Guarded()
    except (OSError, AttributeError, TypeError) as exc:  # no mmap / libc here
        pytest.skip(f"no guard pages: {exc}")


@native_only
def test_native_reads_stay_in_bounds(guarded: _Guarded) -> None:
    rng = np.random.default_rng(5)
    cases: list[list[int]] = [[], [1], [2**63 - 1] * 9, [-1] * 20, [248056] * 100]
    cases += [_runs(rng, int(n)).tolist() for n in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 200)]
    cases += [[int(v)] * n for v in EDGE_VALUES for n in (8, 9, 16, 24)]
    for values in cases:
        raw = msgpack.packb(values)
        buf = guarded(raw)
        assert _decode_native(buf).tolist() == values
        for cut in range(len(raw)):  # truncated: an error, never a read past the end
            part = guarded(raw[:cut])
            with pytest.raises(ValueError):
                _decode_native(part)
        message = _pack(["x", values, [values[:2], None], {"k": values[-3:]}])
        offsets, ints = _split_native(guarded(message), (1,))
        assert ints[0] is not None and ints[0].tolist() == values
        assert offsets[-1] == len(message)
        for cut in range(0, len(message), max(1, len(message) // 50)):
            with pytest.raises(ValueError):
                _split_native(guarded(message[:cut]), (1,))
        rows = _pack([[[v, v] for v in values[:20]]])
        table, _ = _rows_native(guarded(rows), [1], 2)
        assert table.tolist() == [v for v in values[:20] for _ in range(2)]


# --------------------------------------------------------------------------
# Received arrays in other forms than encoders write, for the filled encoding below


def _received(raw: bytes) -> tuple[np.ndarray, Any]:
    """The array and its marks as the wire codec gets them: element 1 of a payload."""
    marks: list[Any] = []
    _, ints = ic.split_array(b"\x92\xa1x" + raw, (1,), None, marks)
    assert ints[0] is not None and len(marks) == 1
    return ints[0], marks[0]


def _wide(values: np.ndarray, rng: np.random.Generator) -> bytes:
    """``values`` as a msgpack array, about half of them in the 8-byte forms (legal,
    not what encoders write), under an array32 header."""
    out = bytearray(b"\xdd" + len(values).to_bytes(4, "big"))
    for v in values.tolist():
        if rng.random() < 0.5:
            out += msgpack.packb(v)
        elif v >= 0:
            out += b"\xcf" + v.to_bytes(8, "big")
        else:
            out += b"\xd3" + v.to_bytes(8, "big", signed=True)
    return bytes(out)


def _pack_header(n: int) -> bytes:
    return msgpack.packb([0] * n)[: len(msgpack.packb([0] * n)) - n]


def _walkers() -> list[Any]:
    from mmadmit import msgpack_walk

    return [msgpack_walk, *([ic._BUILT] if ic._BUILT is not None else [])]


def _outcome(f: Callable[..., Any], *args: Any) -> Any:
    try:
        return ("ok", bytes(f(*args)))
    except ValueError as exc:
        return ("err", str(exc))


# --------------------------------------------------------------------------
# Encoding filled spans of a received array: encode_int_array_filled (the
# reply's padded ids, written from the received bytes and the pad spans)

FILLS = [
    _native_param(lambda *a: _filled_native(*a)),
    pytest.param(lambda *a: _filled_py(*a), id="interpreted"),
    pytest.param(
        lambda old, buf, mk, *spans: ic.encode_int_array_filled(old, buf, mk, *spans),
        id="public",
    ),
]


def _spans(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sorted, disjoint spans over ``n`` elements (empty ones, touching ones and
    the array's ends among them) and a value each, from every int form."""
    k = int(rng.integers(0, 12))
    cuts = np.sort(rng.integers(0, n + 1, size=2 * k)) if n else np.zeros(2 * k, np.int64)
    if k and rng.random() < 0.3:
        cuts[0], cuts[-1] = 0, n  # the first span at 0, the last to the end
    if k > 1 and rng.random() < 0.3:
        cuts[2] = cuts[1]  # two spans touching
    fill = np.array([int(rng.choice(EDGE_VALUES + [2**30 + 17])) for _ in range(k)], np.int64)
    return cuts[0::2].astype(np.int64), cuts[1::2].astype(np.int64), fill


def _filled(old: np.ndarray, starts: Any, stops: Any, fill: Any) -> np.ndarray:
    out = old.copy()
    for a, b, v in zip(starts, stops, fill, strict=True):
        out[a:b] = v
    return out


@pytest.mark.parametrize("filled", FILLS)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 128, 1000, 70000])
def test_encode_filled_is_encode_of_the_filled_array(filled: Any, n: int) -> None:
    rng = np.random.default_rng([13, n])
    values = _runs(rng, n)
    raw = msgpack.packb(values.tolist())
    old, marks = _received(raw)
    for _ in range(6):
        spans = _spans(rng, n)
        expected = msgpack.packb(_filled(old, *spans).tolist())
        assert bytes(filled(old, ic._as_bytes(raw), marks, *spans)) == expected
        assert bytes(filled(old, ic._as_bytes(raw), None, *spans)) == expected  # marks read again


@pytest.mark.parametrize("n", [0, 1, 8, 9, 64, 65, 200, 3000])
def test_encode_filled_keeps_other_forms_outside_the_spans(n: int) -> None:
    """Bytes no encoder writes: every element outside the spans as received, the
    spans in smallest forms; compiled and interpreted alike."""
    from mmadmit import msgpack_walk

    rng = np.random.default_rng([14, n])
    values = _runs(rng, n)
    raw = _wide(values, rng)
    old, marks = _received(raw)
    _, walk_marks = msgpack_walk.decode_marked(memoryview(raw))
    for _ in range(6):
        starts, stops, fill = _spans(rng, n)
        got = bytes(ic.encode_int_array_filled(old, raw, marks, starts, stops, fill))
        assert msgpack.unpackb(got) == _filled(old, starts, stops, fill).tolist()
        assert got == bytes(_filled_py(old, memoryview(raw), None, starts, stops, fill))
        assert got == bytes(
            msgpack_walk.encode_filled(memoryview(raw), walk_marks, starts, stops, fill)
        )
        # outside the spans, the received bytes: the whole array again when no span
        # has a length
        if all(a == b for a, b in zip(starts, stops, strict=True)):
            assert got == bytes(_pack_header(n)) + raw[5:]


def test_encode_filled_refuses_spans_out_of_order_or_outside() -> None:
    """Spans that overlap, run backwards, start before 0 or end past the array:
    ValueError with one message, whichever build runs."""
    values = np.arange(200, dtype=np.int64)
    raw = msgpack.packb(values.tolist())
    old, marks = _received(raw)
    bad = [
        ([10, 15], [20, 30], [1, 2]),  # overlapping
        ([30, 10], [40, 20], [1, 2]),  # out of order
        ([20], [10], [1]),  # backwards
        ([-1], [5], [1]),  # before the first element
        ([190], [201], [1]),  # past the last
    ]
    for starts, stops, fill in bad:
        spans = [np.array(x, np.int64) for x in (starts, stops, fill)]
        got = {_outcome(_filled_py, old, memoryview(raw), marks, *spans)}
        for w in _walkers():
            got.add(_outcome(w.encode_filled, memoryview(raw), marks_of(w, raw), *spans))
        assert got == {("err", "msgpack int array: encode_filled: the spans are not sorted, "
                                "disjoint and inside")}  # fmt: skip
    with pytest.raises(ValueError, match="differ in length"):
        ic.encode_int_array_filled(old, raw, marks, [1], [2, 3], [1])
    with pytest.raises(ValueError, match="do not match"):  # another array's bytes
        ic.encode_int_array_filled(old[:-1], raw, marks, [1], [2], [1])


@pytest.mark.parametrize("filled", FILLS)
@pytest.mark.parametrize("n", [0, 1, 9, 65, 1000])
def test_encode_filled_into_a_buffer_writes_in_place(filled: Any, n: int) -> None:
    """With ``out``: the same bytes as a fresh buffer gets, written from ``start``
    and nowhere else; room for 5 + 9 bytes an element is required from ``start``
    (one byte less, a negative start or one past the end: ValueError, nothing
    written), whichever build runs."""
    rng = np.random.default_rng([15, n])
    old, marks = _received(msgpack.packb(_runs(rng, n).tolist()))
    raw = ic._as_bytes(msgpack.packb(old.tolist()))
    spans = _spans(rng, n)
    fresh = bytes(filled(old, raw, marks, *spans))
    need = 5 + 9 * n
    for start in (0, 3):
        out = np.full(start + need + 4, 0xEE, np.uint8)
        got = filled(old, raw, marks, *spans, out, start)
        assert bytes(got) == fresh
        assert bytes(out[start : start + len(fresh)]) == fresh
        untouched = np.r_[out[:start], out[start + len(fresh) :]]
        assert (untouched == 0xEE).all()
    for room, start in ((need - 1, 0), (need + 2, 3), (need, -1), (need, need + 1)):
        out = np.full(max(room, 0), 0xEE, np.uint8)
        with pytest.raises(ValueError, match="the output has no room"):
            filled(old, raw, marks, *spans, out, start)
        assert (out == 0xEE).all()


def marks_of(walk: Any, raw: bytes) -> np.ndarray:
    _, marks = walk.decode_marked(memoryview(raw))
    return marks


def test_encode_filled_any_marks_same_outcome_both_builds() -> None:
    """Marks of any values: bytes or a refusal, the same compiled and interpreted,
    never a copy longer than the output was sized for."""
    rng = np.random.default_rng(15)
    values = _runs(rng, 400)
    raw = _wide(values, rng)
    marks = marks_of(_walkers()[0], raw)
    refused = 0
    for _ in range(300):
        lying = rng.integers(-3, len(raw) + 3, size=len(marks))
        if rng.random() < 0.5:
            lying = np.sort(lying)
        spans = _spans(rng, 400)
        got = [_outcome(w.encode_filled, memoryview(raw), lying, *spans) for w in _walkers()]
        assert all(g == got[0] for g in got)
        refused += got[0][0] == "err"
    assert refused > 100


@native_only
def test_encode_filled_reads_stay_in_bounds(guarded: _Guarded) -> None:
    rng = np.random.default_rng(16)
    for n in (1, 8, 63, 64, 65, 130):
        values = _runs(rng, n)
        for raw in (msgpack.packb(values.tolist()), _wide(values, rng)):
            buf = guarded(raw)
            old, marks = ic._BUILT.decode_marked(buf)
            for _ in range(4):
                spans = _spans(rng, n)
                got = bytes(_filled_native(old, buf, marks, *spans))
                assert msgpack.unpackb(got) == _filled(old, *spans).tolist()


def test_split_marks_from_either_build() -> None:
    raw = msgpack.packb(list(range(200)))
    _, expected = msgpack_walk.decode_marked(memoryview(raw))
    assert len(expected) == 4  # 200 ids: 4 marks
    for on in (True, False):  # the public function with native on (compiled, where built), off
        marks: list[Any] = ["stale"]
        with _native(on):
            ic.split_array(b"\x92\xa1x" + raw, (1, 5), None, marks)
        assert len(marks) == 2 and marks[1] is None  # element 5 is missing
        assert np.array_equal(marks[0], expected)


@pytest.mark.parametrize("seed", range(4))
def test_marks_are_where_every_64th_element_starts(seed: int) -> None:
    """The marks (every 64th element's start, counted from the first element),
    whichever way the decoder took the elements: runs compared, blocks of eight,
    one by one at the end."""
    rng = np.random.default_rng([11, seed])
    for values in (_runs(rng, 5000), _random_ids(rng, 300), np.full(1000, 248056, np.int64)):
        raw = msgpack.packb(values.tolist())
        sizes = [len(msgpack.packb(v)) for v in values.tolist()]
        starts = np.concatenate([[0], np.cumsum(sizes)])[:-1]
        for walk in _walkers():
            got, marks = walk.decode_marked(memoryview(raw))
            assert got.tolist() == values.tolist()
            assert marks.tolist() == starts[::64].tolist()
