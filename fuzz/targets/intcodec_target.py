"""The msgpack walker compiled (``mmadmit._walk_c``) against the same source interpreted.

``mmadmit/msgpack_walk.py`` is compiled by Cython into ``_walk_c`` (under
``make fuzz``: with ASan and UBSan, ``fuzz/build_sanitized.sh``); the
interpreted side is the module run by Python, with intcodec's msgspec
shortcuts where it takes them.

The first input byte picks an entry point, the rest is its input:
``decode_int_array`` on the bytes or on an array built element by element from
them (every int form, boundary values; results and error messages must
match), ``encode_int_array``
(bytes from an int array of a chosen dtype), ``split_array`` with chosen int
fields (and a ``max_ints`` bound), ``check_structure`` at the split's offsets
(or offsets chosen freely) with chosen limits, ``array_spans`` and ``int_rows``
at offsets taken from the spans (or chosen freely). Results, error types and
error texts must all match (one source words every error).
"""

from __future__ import annotations

import msgpack
import numpy as np
from mmadmit import intcodec as ic

from ._common import outcome, same
from ._data import Data

NAME = "intcodec"
_DTYPES = ("<i8", "<u8", "<i4", "<u4", "<i2", "<u2", "<i1", "<u1", ">i8")


def _decode(buf: memoryview) -> None:
    a = outcome(ic._decode_native, buf)
    b = outcome(ic._decode_py, buf)
    same(a, b, "decode_int_array")
    # Both run one source, so a third party judges the rule itself: msgpack-python.
    try:
        ref = msgpack.unpackb(buf, strict_map_key=False)
    except Exception:  # noqa: BLE001 - any refusal: then the walker must refuse too
        ref = None
    ints = isinstance(ref, list) and all(type(v) is int and -(2**63) <= v < 2**63 for v in ref)
    assert (a[0] == "ok") == ints, ("decode against msgpack.unpackb", a, ref)
    if a[0] == "ok":  # round trip: a canonical re-encoding decodes to the same values
        assert a[1].tolist() == ref, "decoded values"
        enc = ic._encode_native(a[1])
        assert enc == ic._encode_py(a[1]) == msgpack.packb(ref), "encode of a decoded array"
        assert np.array_equal(ic._decode_native(memoryview(enc)), a[1]), "round trip"


def _encode(d: Data) -> None:
    dtype = np.dtype(d.pick(_DTYPES))
    raw = d.rest()
    raw = raw[: len(raw) - len(raw) % dtype.itemsize]
    values = np.frombuffer(raw, dtype)
    # the public entry point normalizes (uint64 range check) before either encoder
    arr = outcome(ic._as_int64, values, errors=(ValueError, TypeError))
    if arr[0] != "ok":
        return
    same(outcome(ic._encode_native, arr[1]), outcome(ic._encode_py, arr[1]), "encode_int_array")


def _split(d: Data) -> None:
    fields = tuple(sorted({d.int_in(0, 30) for _ in range(d.int_in(0, 4))}))
    buf = memoryview(d.rest())
    a = outcome(ic._split_native, buf, fields)
    b = outcome(ic._split_py, buf, fields)
    same(a, b, f"split_array{fields}")


def _split_bounded(d: Data) -> None:
    fields = tuple(sorted({d.int_in(0, 30) for _ in range(d.int_in(1, 3))}))
    limit = d.int_in(0, 40)
    buf = memoryview(d.rest())
    a = outcome(ic._split_native, buf, fields, limit)
    b = outcome(ic._split_py, buf, fields, limit)
    same(a, b, f"split_array{fields} max_ints={limit}")
    if a[0] == "err" and a[1] == "IntArrayTooLong":  # the same element and count named
        assert a[2] == b[2], (a, b)


def _structure(d: Data) -> None:
    depth, length = d.int_in(1, 40), d.int_in(0, 20)
    skip = tuple({d.int_in(0, 8) for _ in range(d.int_in(0, 3))})
    free = d.flag(20)
    picks = [d.u8() for _ in range(d.int_in(1, 6))]
    buf = memoryview(d.rest())
    if free:  # offsets the walk must not trust: anywhere, past the end, decreasing
        offsets = [p % (len(buf) + 3) - 1 for p in picks]
    else:
        try:
            offsets, _ = ic._split_native(buf, ())
        except ValueError:
            return
    a = outcome(ic._check_native, buf, offsets, skip, depth, length)
    b = outcome(ic._check_py, buf, offsets, skip, depth, length)
    same(a, b, f"check_structure(depth={depth}, len={length}, skip={skip})")


def _spans(d: Data) -> None:
    buf = memoryview(d.rest())
    same(outcome(ic._spans_native, buf), outcome(ic._spans_py, buf), "array_spans")


def _rows(d: Data) -> None:
    width = d.int_in(1, 4)
    free = d.flag(30)
    picks = [d.u8() for _ in range(d.int_in(0, 3))]
    buf = memoryview(d.rest())
    if free:
        starts = [p % (len(buf) + 2) - 1 for p in picks]  # anywhere, -1 and past the end too
    else:
        try:
            spans = ic._spans_native(buf)
        except ValueError:
            return
        # element 3 of each item (its offsets), as wire.py takes them
        starts = [s for s in spans[4::5] if s >= 0]
    a = outcome(ic._rows_native, buf, starts, width)
    b = outcome(ic._rows_py, buf, starts, width)
    same(a, b, f"int_rows(width={width})")


_FORMS = ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8), (0xD0, 1), (0xD1, 2), (0xD2, 4), (0xD3, 8))


def _structured(d: Data) -> bytes:
    """A msgpack int array built element by element: every int form, boundary values
    (2**63 as a uint64 is the first one the decoders must refuse), odd headers."""
    count = d.int_in(0, 40)
    out = bytearray()
    header = d.u8() % 4
    if header == 0 and count < 16:
        out.append(0x90 | count)
    elif header <= 1:
        out += b"\xdc" + ((count + d.pick((0, 0, 0, 1, -1))) % 65536).to_bytes(2, "big")
    else:
        out += b"\xdd" + (count + d.pick((0, 0, 0, 1))).to_bytes(4, "big")
    for _ in range(count):
        value = d.wild_int()
        form = d.u8() % 10
        if form >= 8:  # a fixint (positive or negative) when it fits, else a raw byte
            out.append(value & 0xFF)
            continue
        code, width = _FORMS[form]
        out.append(code)
        out += (value % (1 << (8 * width))).to_bytes(width, "big")
    if d.flag(10):
        out += d.take(3)  # trailing bytes
    return bytes(out)


def one(data: bytes) -> None:
    if ic._BUILT is None:
        return  # nothing native to compare
    d = Data(data)
    op = d.u8() % 8
    if op == 6:
        _structure(d)
    elif op == 7:
        _split_bounded(d)
    elif op == 0:
        _decode(memoryview(d.rest()))
    elif op == 5:
        _decode(memoryview(_structured(d)))
    elif op == 1:
        _encode(d)
    elif op == 2:
        _split(d)
    elif op == 3:
        _spans(d)
    else:
        _rows(d)
