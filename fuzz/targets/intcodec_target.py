"""The msgpack walker compiled (``mmadmit._walk_c``) against the same source interpreted.

``mmadmit/msgpack_walk.py`` is compiled by Cython into ``_walk_c`` (under
``make fuzz``: with ASan and UBSan, ``fuzz/build_sanitized.sh``); the
interpreted side is the module run by Python; each side is reached through
intcodec's public functions.

The first input byte picks an entry point, the rest is its input:
``decode_int_array`` on the bytes or on an array built element by element from
them (every int form, boundary values; results and error messages must
match; then ``decode_marked``'s marks, and ``encode_filled`` with spans and
marks taken from the bytes, the compiled walker against the interpreted one),
``encode_int_array``
(bytes from an int array of a chosen dtype), ``split_array`` with chosen int
fields (and a ``max_ints`` bound), ``check_structure`` at the split's offsets
(or offsets chosen freely) with chosen limits, ``element_span`` of a
chosen element, ``int_rows`` at offsets taken from the split (or chosen
freely), and ``build_items`` on
the bytes or on an items array built item by item from them. Results, error
types and error texts must all match (one source words every error); what
``build_items`` builds must be what the reference item decoder
(``tests/wire_oracle.py``) builds from the same bytes, and what it refuses
(InvalidRequest or TooLarge, never another exception) the reference refuses.
A first byte of 250 or more builds a ``Tensor`` from arguments taken from the
bytes (dtype, shape, data of some buffer kind, name, limits) with
``tensorcheck`` compiled (``_tensorcheck_c``) and interpreted: the same tensor
or the same refusal.
"""

from __future__ import annotations

import sys
from pathlib import Path

import msgpack
import msgspec
import numpy as np
from mmadmit import intcodec as ic
from mmadmit import model, msgpack_walk, tensorcheck, wire
from mmadmit.dtypes import parse_dtype
from mmadmit.errors import AdmissionError
from mmadmit.limits import Limits
from mmadmit.model import Item, Tensor

from ._common import on_walk, outcome, same
from ._data import Data

NAME = "intcodec"
_DTYPES = ("<i8", "<u8", "<i4", "<u4", "<i2", "<u2", "<i1", "<u1", ">i8")


def _decode(buf: memoryview) -> None:
    a = outcome(_decode_native, buf)
    b = outcome(_decode_py, buf)
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
        enc = _encode_native(a[1])
        assert enc == _encode_py(a[1]) == msgpack.packb(ref), "encode of a decoded array"
        assert np.array_equal(_decode_native(memoryview(enc)), a[1]), "round trip"
        _marked(buf, a[1])


def _marked(buf: memoryview, old: np.ndarray) -> None:
    """``decode_marked`` compiled and interpreted: the decoded array and its marks
    (where every 64th element starts) alike; then :func:`_filled` with them."""
    assert ic._BUILT is not None
    got, marks = ic._BUILT.decode_marked(buf)
    walk_got, walk_marks = msgpack_walk.decode_marked(buf)
    assert np.array_equal(got, old) and np.array_equal(walk_got, old), "decode_marked"
    assert np.array_equal(marks, walk_marks), "marks"
    _filled(buf, old, marks)


def _filled(buf: memoryview, old: np.ndarray, marks: np.ndarray) -> None:
    """``encode_filled`` on a decoded array: spans taken from the bytes (valid ones,
    then any), compiled, interpreted and through the public function alike, holding the filled
    values; marks of any value, the same outcome both builds."""
    assert ic._BUILT is not None
    n = len(old)
    raw = np.frombuffer(bytes(buf), np.uint8).astype(np.int64)
    cuts = np.sort(np.resize(raw * 31 % (n + 1), 2 * min(len(raw), 9))) if n else raw[:0]
    starts, stops = cuts[0::2].copy(), cuts[1::2].copy()
    fill = np.resize(raw * 0x0101010101 - 2**35, len(starts))
    a = outcome(_filled_native, old, buf, marks, starts, stops, fill)
    same(a, outcome(msgpack_walk.encode_filled, buf, marks, starts, stops, fill), "encode_filled")
    public = outcome(_filled_py, old, buf, None, starts, stops, fill)
    same(a, public, "encode_filled, public, interpreted, marks read again")
    want = old.copy()
    for x, y, v in zip(starts.tolist(), stops.tolist(), fill.tolist(), strict=True):
        want[x:y] = v
    assert a[0] == "ok" and msgpack.unpackb(a[1]) == want.tolist(), "encode_filled values"
    if n:
        loose = np.resize(raw * 13 % (n + 3) - 1, len(starts))  # any order, outside too
        lying = np.resize(raw * 7 - 5, len(marks))
        for spans, mk in (((loose, stops, fill), marks), ((starts, stops, fill), lying)):
            a = outcome(ic._BUILT.encode_filled, buf, mk, *spans)
            b = outcome(msgpack_walk.encode_filled, buf, mk, *spans)
            same(a, b, "encode_filled, spans or marks of any value")
    # into a caller's buffer, from an offset: room and offset of any value (the
    # bound is 5 + 9 bytes an element), the same outcome both builds and the
    # public function; what was written is what a fresh buffer gets
    need = 5 + 9 * n
    pick = int((raw * np.arange(1, len(raw) + 1)).sum())  # every byte stirs it
    room = need + pick % 24 if pick & 1 else (pick >> 1) % (need + 24)  # enough, or any
    start = (pick >> 6) % (room - need + 3) - 1 if pick & 1 else (pick >> 6) % (room + 3) - 1
    outs = [np.zeros(room, np.uint8) for _ in range(3)]
    a = outcome(_filled_native, old, buf, marks, starts, stops, fill, outs[0], start)
    b = outcome(msgpack_walk.encode_filled, buf, marks, starts, stops, fill, outs[1], start)
    c = outcome(_filled_py, old, buf, None, starts, stops, fill, outs[2], start)
    same(a, b, "encode_filled into a buffer")
    same(a, c, "encode_filled into a buffer, public, interpreted")
    if a[0] == "ok":
        fresh = outcome(_filled_native, old, buf, marks, starts, stops, fill)
        assert fresh[1] == a[1], "encode_filled into a buffer: other bytes"
        assert 0 <= start and start + len(a[1]) <= room, "encode_filled wrote past the room"
        assert all(bytes(o[start : start + len(a[1])]) == a[1] for o in outs), "in place"


def _encode(d: Data) -> None:
    dtype = np.dtype(d.pick(_DTYPES))
    raw = d.rest()
    raw = raw[: len(raw) - len(raw) % dtype.itemsize]
    values = np.frombuffer(raw, dtype)
    # the public entry point normalizes (uint64 range check) before either encoder
    arr = outcome(ic._as_int64, values, errors=(ValueError, TypeError))
    if arr[0] != "ok":
        return
    same(outcome(_encode_native, arr[1]), outcome(_encode_py, arr[1]), "encode_int_array")


def _split(d: Data) -> None:
    fields = tuple(sorted({d.int_in(0, 30) for _ in range(d.int_in(0, 4))}))
    buf = memoryview(d.rest())
    a = outcome(_split_native, buf, fields)
    b = outcome(_split_py, buf, fields)
    same(a, b, f"split_array{fields}")


def _split_bounded(d: Data) -> None:
    fields = tuple(sorted({d.int_in(0, 30) for _ in range(d.int_in(1, 3))}))
    limit = d.int_in(0, 40)
    buf = memoryview(d.rest())
    a = outcome(_split_native, buf, fields, limit)
    b = outcome(_split_py, buf, fields, limit)
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
            offsets, _ = _split_native(buf, ())
        except ValueError:
            return
    odd_a: list[int] = []
    odd_b: list[int] = []
    a = outcome(_check_native, buf, offsets, skip, depth, length, odd_a)
    b = outcome(_check_py, buf, offsets, skip, depth, length, odd_b)
    what = f"check_structure(depth={depth}, len={length}, skip={skip})"
    same(a, b, what)
    assert odd_a == odd_b, f"{what}: odd elements {odd_a} native, {odd_b} interpreted"


def _element_span(d: Data) -> None:
    index = d.int_in(-1, 5)
    buf = memoryview(d.rest())
    a = outcome(ic._BUILT.element_span, buf, index)
    same(a, outcome(msgpack_walk.element_span, buf, index), f"element_span({index})")


def _rows(d: Data) -> None:
    width = d.int_in(1, 4)
    free = d.flag(30)
    picks = [d.u8() for _ in range(d.int_in(0, 3))]
    buf = memoryview(d.rest())
    if free:
        starts = [p % (len(buf) + 2) - 1 for p in picks]  # anywhere, -1 and past the end too
    else:
        try:
            spans = item_spans(buf)
        except ValueError:
            return
        # element 3 of each item (its offsets), where build_items finds them
        starts = [s for s in spans[4::5] if s >= 0]
    a = outcome(_rows_native, buf, starts, width)
    b = outcome(_rows_py, buf, starts, width)
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


sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from wire_oracle import decode_items as reference_items  # noqa: E402
from wire_oracle import item_spans  # noqa: E402

_AUX = [memoryview(bytes(range(256)) * 2), memoryview(b"\x01" * 24)]  # 512 and 24 bytes
_ITEM_DTYPES = ("float32", "bfloat16", "int64", "uint8", "int8")


# each public intcodec function on the compiled walker (_native) and the interpreted one (_py)
_NATIVE, _PY = ic._BUILT, msgpack_walk
_decode_native, _decode_py = (
    on_walk(_NATIVE, ic.decode_int_array),
    on_walk(_PY, ic.decode_int_array),
)
_encode_native, _encode_py = (
    on_walk(_NATIVE, ic.encode_int_array),
    on_walk(_PY, ic.encode_int_array),
)
_split_native, _split_py = on_walk(_NATIVE, ic.split_array), on_walk(_PY, ic.split_array)
_check_native, _check_py = getattr(_NATIVE, "check_structure", None), _PY.check_structure
_rows_native, _rows_py = getattr(_NATIVE, "int_rows", None), _PY.int_rows
_filled_native = on_walk(_NATIVE, ic.encode_int_array_filled)
_filled_py = on_walk(_PY, ic.encode_int_array_filled)


def _or(d: Data, usual: object, *others: object) -> object:
    """``usual`` mostly (the form build_items takes), now and then one of ``others``."""
    return usual if d.flag(95) else d.pick(others)


def _tensor_value(d: Data) -> object:
    """A tensor on the aux frames above (512 and 24 bytes) or inline, mostly consistent."""
    dtype = d.pick(_ITEM_DTYPES)
    size = {"float32": 4, "bfloat16": 2, "int64": 8}.get(dtype, 1)
    if d.flag(60):
        frame = d.int_in(1, 2)
        data: object = _or(d, frame, 0, -1, 3, 2**63)
        nbytes = 512 if frame == 1 else 24
    else:
        nbytes = d.pick((0, 1, 8, 24, 40))
        data = msgpack.ExtType(_or(d, 3, 1, 2, 9), d.take(nbytes))
    dims = [nbytes // size] if d.flag(50) else [1, nbytes // size]
    dims = _or(d, dims, [-1], [2**40, 0], [1.5], [], [nbytes])
    value = [_or(d, dtype, "float33", "", 5), dims, data]
    return _or(d, value, [*value, None], value[:2], "x")


def _items_array(d: Data) -> bytes:
    """An mm_items array built item by item: mostly the form build_items takes, with
    every element now and then of another type or length."""
    items = []
    for _ in range(d.int_in(0, 4)):
        side = {}
        for _ in range(d.int_in(0, 2)):
            key = d.pick(("image_grid_thw", "video_grid_thw", "g", ""))
            side[key] = _or(d, _tensor_value(d), True, 1, "x", None)
        item = [
            _or(d, d.pick((1, 2, 3, 2**63)), -1, "image", None),
            _or(d, d.pick((None, 0, 5, 2**64 - 1, -(2**63))), True, "h", 1.5),
            _or(d, d.pick((None, 7, -3, 2**33)), "p", [1]),
            _or(d, d.pick((None, [], [[3, 18]], [[0, 1], [2, 3]])), [1, 2], "x"),
            _or(d, _tensor_value(d) if d.flag(70) else None, {"t": 1}, 1),
            _or(d, None, {"shm_name": "x"}, 1),
            _or(d, side if side or d.flag(50) else None, [], 1),
            _or(d, None, 1, [None]),
            _or(d, None, 1),
            _or(d, None, {"h": 1}),
        ]
        if d.flag(5):
            item = item[: d.int_in(0, 11)]
        elif d.flag(5):
            item.append(None)
        items.append(item)
    raw = bytearray(msgpack.packb(items))
    for _ in range(d.int_in(0, 2) if d.flag(25) else 0):  # a byte or two replaced
        raw[d.uint(2) % len(raw)] = d.u8()
    return bytes(raw)


def _built(walk: object, buf: memoryview) -> object:
    """The items one build of the walk makes (comparable), or its refusal."""
    reader = wire._TensorReader(list(_AUX))
    try:
        items, features, others, offsets_at = walk.build_items(  # type: ignore[attr-defined]
            buf, buf, reader.aux, reader.limits, Tensor, Item, wire._ItemSrc, wire._NO_SIDE,
            wire._value, reader.tensor, wire._decode_shm,
        )  # fmt: skip
    except AdmissionError as exc:
        return ("refused", type(exc).__name__, exc.message)
    assert offsets_at == [it.extra.off3 if it.extra.count > 3 else -1 for it in items]
    features = sorted(set(features) | reader.features)
    return [_item_form(it) for it in items], features, sorted(set(others) | reader.others)


def _item_form(it: Item) -> object:
    def t(x: object) -> object:
        if not isinstance(x, Tensor):
            return x
        return (x.dtype.name, x.shape, bytes(x.data), x.name, x.limits is wire.DEFAULT_LIMITS)

    s = it.extra
    return (
        type(it.modality), it.modality, it.hash, it.pad_value, t(it.feature),
        repr(it.feature_shm), it.encode_handshake,
        {k: t(v) for k, v in it.side.items()},
        (s.start, s.end, s.count, s.off1, s.off3, s.modality, t(s.feature)),
        {k: t(v) for k, v in s.side.items()}, s.side is wire._NO_SIDE,
    )  # fmt: skip


def _items(buf: memoryview) -> None:
    a = _built(ic._BUILT, buf)
    b = _built(msgpack_walk, buf)
    assert a == b, f"build_items: native and interpreted disagree:\n  {a!r}\n  {b!r}"
    reader = wire._TensorReader(list(_AUX))
    try:
        items = reference_items(buf, reader)
    except AdmissionError as exc:
        assert a[0] == "refused", f"build_items built what the reference refuses: {exc}"
        return
    ref = [_item_form(it) for it in items], sorted(reader.features), sorted(reader.others)
    assert a == ref, f"build_items against the reference:\n  {a!r}\n  {ref!r}"


_ADD_LIMITS = (Limits(), Limits(max_tokens=16, max_items=2, max_msgpack_len=24,
                               max_msgpack_depth=4, max_tensor_bytes=64))  # fmt: skip


def _add_payload(d: Data) -> bytes:
    """An ADD payload: mostly the layout the engine sends (tag, rid, token ids, items
    built as for build_items), every element now and then of another type, a byte or
    two replaced; or any bytes."""
    if d.flag(10):
        return d.rest()
    ids = [d.pick((0, 5, 300, 248056, 2**40, -1)) for _ in range(d.int_in(0, 20))]
    mm = None
    if d.flag(70):
        items = msgspec.Raw(_items_array(d))
        mm = _or(d, [items, 248056, 248057, None, None, None, None], [], 5, "mm", [None])
    elems: list[object] = [
        _or(d, "TokenizedGenerateReqInput", "x", None),
        _or(d, "rid-f", 5, None, b"r"),
        None, None,
        _or(d, ids, None, "ids", [[1]], [1.5]),
        *([None] * 16),
        _or(d, None, ids[:3], {"a": 1}),
        mm,
        _or(d, None, "INVALID_REQUEST: x", 7),
    ]  # fmt: skip
    raw = bytearray(msgspec.msgpack.encode(elems[: d.int_in(0, 24)] if d.flag(5) else elems))
    for _ in range(d.int_in(1, 2) if d.flag(25) else 0):
        raw[d.uint(2) % len(raw)] = d.u8()
    return bytes(raw)


def _added(walk: object, buf: memoryview, limits: Limits) -> object:
    """What one way of decode_add makes of ``buf`` (comparable), or its refusal."""
    reader = wire._TensorReader(list(_AUX), limits)
    env = (reader.aux, Tensor, Item, wire._ItemSrc, wire._NO_SIDE, wire._value, reader.tensor,
           wire._decode_shm)  # fmt: skip
    try:
        offsets, ints, rid, mm = walk.decode_add(  # type: ignore[attr-defined]
            buf, buf, limits, [None, None], env, wire.WireError
        )
    except AdmissionError as exc:
        return ("refused", type(exc).__name__, exc.code, exc.message, getattr(exc, "rid", None))
    form = [x.tolist() if isinstance(x, np.ndarray) else x for x in ints]
    if mm is not None:
        rows = [None if it.offsets is None else it.offsets.tolist() for it in mm[1]]
        mm = (mm[0], [_item_form(it) for it in mm[1]], rows, sorted(mm[2]), sorted(mm[3]))
    return offsets, form, rid, mm


def _decode_add(d: Data) -> None:
    """decode_add compiled and interpreted (what --native off runs): the same
    result, or the same refusal."""
    limits = d.pick(_ADD_LIMITS)
    buf = memoryview(_add_payload(d))
    a = _added(ic._BUILT, buf, limits)
    b = _added(msgpack_walk, buf, limits)
    assert a == b, f"decode_add: the builds disagree:\n  {a!r}\n  {b!r}"


_TENSOR_DTYPES = ("float32", "int64", "uint8", "bfloat16", "bool", "float33", "", "<f4", "i8")
_TENSOR_LIMITS = (None, wire.DEFAULT_LIMITS, Limits(max_tensor_rank=2),
                  Limits(max_tensor_dim=5), Limits(max_tensor_bytes=16))  # fmt: skip


def _tensor_args(d: Data) -> tuple[object, ...]:
    pick = d.pick(_TENSOR_DTYPES)
    dtype: object = parse_dtype(pick) if pick in ("float32", "int64") and d.flag(30) else pick
    if d.flag(5):
        dtype = d.uint(1)
    dims: list[object] = [d.int_in(-1, 9) if d.flag(90) else d.uint(8) - 2**31
                          for _ in range(d.int_in(0, 4))]  # fmt: skip
    if dims and d.flag(5):
        dims[d.int_in(0, len(dims) - 1)] = d.pick((True, 2.0, "2", None, 2**63))
    shape: object = dims if d.flag(50) else tuple(dims)
    size = d.int_in(0, 64)
    kind = d.int_in(0, 4)
    payload = bytes(d.u8() for _ in range(min(size, 8))) + bytes(max(0, size - 8))
    data: object = (payload, bytearray(payload), memoryview(payload * 2)[::2],
                    memoryview(payload).cast("B", (1, size)) if size else b"",
                    np.frombuffer(payload[: size - size % 4], np.float32).data)[kind]  # fmt: skip
    name = d.pick(((3, "feature"), (1, "image_grid_thw"), "mrope_positions"))
    return dtype, shape, data, name, d.pick(_TENSOR_LIMITS)


def _tensor_outcome(check: object, args: tuple[object, ...]) -> object:
    saved = model._check
    model._route_checks(check)
    try:
        t = Tensor(*args)  # type: ignore[arg-type]
    except AdmissionError as exc:
        return ("refused", type(exc).__name__, exc.code, exc.message)
    finally:
        model._route_checks(saved)
    return ("built", t.dtype, t.shape, bytes(t.data), t.data.format, t.data.ndim, t.name)


def _tensor(d: Data) -> None:
    if model._BUILT is None:
        return
    args = _tensor_args(d)
    a = _tensor_outcome(model._BUILT.check, args)
    b = _tensor_outcome(tensorcheck.check, args)
    assert a == b, f"tensorcheck: native and interpreted disagree on {args!r}:\n  {a!r}\n  {b!r}"


def one(data: bytes) -> None:
    if ic._BUILT is None:
        return  # nothing native to compare
    d = Data(data)
    first = d.u8()
    if first >= 250:
        _tensor(d)
        return
    if first >= 230:
        _decode_add(d)
        return
    op = first % 10
    if op == 8:
        _items(memoryview(_items_array(d)))
    elif op == 9:
        _items(memoryview(d.rest()))
    elif op == 6:
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
        _element_span(d)
    else:
        _rows(d)
