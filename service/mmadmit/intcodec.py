"""msgpack arrays of ints <-> int64 numpy arrays, fast.

The msgpack wire carries token ids as a plain msgpack array of ints (128K
elements for a long prompt). Generic msgpack decoding builds one Python int
per element (about 9 ms for 128K ids); this module decodes straight into a
numpy ``int64`` array and encodes from one.

Two implementations with the same results and the same errors, messages
included:

* native: the optional C extension ``mmadmit._intcodec`` (built by
  ``setup.py``; no numpy headers, buffers go through the buffer protocol).
* fallback: pure Python/numpy, used when the extension is not built. Decoding
  goes through ``msgspec`` (one Python int per element, then ``np.array``);
  errors are re-diagnosed by a byte-level scan so the messages match the
  native ones. Encoding is ``msgspec`` on ``values.tolist()``.

``HAVE_NATIVE`` says which one :func:`decode_int_array` and
:func:`encode_int_array` use (:mod:`mmadmit.native` can switch the native one off).

Splitting (for the wire codec): :func:`split_array` walks one msgpack array
and returns where each element starts and ends, decoding chosen int-array
elements (token ids) into int64 arrays in the same pass, so a 128K-id payload
is read once; :func:`array_spans` gives the element spans of an array of
arrays (multimodal items), and :func:`int_rows` decodes arrays of int rows
at given offsets (their offset pairs) into one int64 table. The native walk
checks the structure only (lengths, the never-used byte ``0xc1``, trailing
bytes), iteratively: no depth limit, no recursion; the fallback splits with
``msgspec`` and walks the bytes in Python where the nesting is deeper than
``msgspec`` follows. Both raise ``ValueError`` for malformed input and agree
on every result for valid input; error texts differ (the caller wraps them).

Format: exactly one msgpack array (fixarray, array16 or array32) whose
elements are ints in any msgpack int encoding; values must fit int64 (a uint64
above ``2**63 - 1`` is refused). Encoding writes the smallest array header
and the smallest form of each int, byte for byte what ``msgpack.packb`` writes
for the same list. Non-goals: nested arrays, nil elements, arrays of more than
``2**32 - 1`` elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from mmadmit import native
from mmadmit.limits import MAX_DEPTH

try:
    from mmadmit import _intcodec as _BUILT  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler at install time): use the fallback
    _BUILT = None

_intcodec: Any = _BUILT  # the extension; the _*_impl below say which one runs

__all__ = [
    "HAVE_NATIVE",
    "IntArrayTooLong",
    "array_len",
    "array_spans",
    "check_int_arrays",
    "check_structure",
    "decode_int_array",
    "encode_int_array",
    "int_rows",
    "offsets_of",
    "split_array",
]

HAVE_NATIVE: bool = _intcodec is not None

_INT64_MAX = 2**63 - 1
_MAX_ARRAY_COUNT = 2**32 - 1
_PREFIX = "msgpack int array: "

# Element type bytes 0xcc..0xd3 -> (payload width, signed).
_INT_FORMS = {
    0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
    0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True),
}  # fmt: skip


# --------------------------------------------------------------------------
# Public API


def decode_int_array(raw: Any) -> npt.NDArray[np.int64]:
    """Decode one msgpack array of ints into a new 1-D ``int64`` array.

    ``raw``: ``bytes``, ``bytearray``, ``memoryview``, ``msgspec.Raw`` or any
    buffer holding exactly one msgpack array and nothing after it. Raises
    ``ValueError`` (naming the element index and type byte where there is one)
    for a non-array, a non-int element, truncated input, a uint64 above
    ``2**63 - 1`` and trailing bytes.
    """
    return _decode_impl(_as_bytes(raw))


def encode_int_array(values: Any) -> bytes:
    """Encode a 1-D int array (any int dtype) as one msgpack array of ints.

    Byte-identical to ``msgpack.packb(values.tolist())``. Raises ``TypeError``
    for a non-integer dtype and ``ValueError`` for a non-1-D array, a uint64
    value above ``2**63 - 1`` or more than ``2**32 - 1`` elements.
    """
    return _encode_impl(_as_int64(values))


class IntArrayTooLong(ValueError):
    """An ``int_fields`` element of :func:`split_array` declares more than ``max_ints``
    elements; raised from its header, before anything is allocated for it."""

    def __init__(self, element: int, count: int, limit: int) -> None:
        super().__init__(f"element {element}: an array of {count} elements, limit {limit}")
        self.element, self.count, self.limit = element, count, limit


def array_len(raw: Any) -> int:
    """The element count of the msgpack array header at the start of ``raw``.

    Header only; ``ValueError`` for a non-array, a cut header, or a count
    larger than the bytes that follow (every element takes one byte at least).
    """
    return _len_impl(_as_bytes(raw))


def check_structure(
    raw: Any, offsets: list[int], skip: tuple[int, ...], max_depth: int, max_len: int
) -> tuple[int, int, int] | None:
    """Walk the elements of ``raw`` at :func:`split_array`'s ``offsets`` against limits.

    Every element whose index is not in ``skip`` (at most 8) is walked, the
    array itself counting as nesting depth 1: no container may sit deeper than
    ``max_depth`` (1 to 1024) or declare more than ``max_len`` elements (an
    array) or entries (a map). Returns None, or the first breach as ``(kind,
    element, value)``: kind 1 (array) or 2 (map) with its length, 3 (depth)
    with the depth reached; ``element`` the index holding it. The walk reads
    headers only and allocates nothing. ``ValueError`` for offsets that do not
    split ``raw`` into single values.
    """
    if not 1 <= max_depth <= MAX_DEPTH or max_len < 0:
        raise ValueError(f"check_structure: max_depth must be 1..{MAX_DEPTH}, max_len >= 0")
    if len(skip) > 8:
        raise ValueError("check_structure: at most 8 skipped elements")
    return _check_impl(_as_bytes(raw), list(offsets), tuple(skip), max_depth, max_len)


def split_array(
    raw: Any, int_fields: tuple[int, ...] = (), max_ints: int | None = None
) -> tuple[list[int], list[npt.NDArray[np.int64] | None]]:
    """Element boundaries of one msgpack array, int arrays decoded on the way.

    ``raw`` holds exactly one msgpack array of ``n`` elements. Returns
    ``(offsets, ints)``: ``offsets`` has ``n + 1`` entries, element ``i`` being
    ``raw[offsets[i]:offsets[i + 1]]`` (``offsets[0]`` is the header length,
    ``offsets[n] == len(raw)``). ``ints[k]`` is element ``int_fields[k]``
    decoded as by :func:`decode_int_array` (a new writable int64 array), or
    ``None`` when that element is missing or is not an array of int64-range
    ints (decode it with :func:`decode_int_array` for the precise error).
    At most 8 distinct ``int_fields``. Raises ``ValueError`` for input that is
    not one well-formed msgpack array (not an array, truncated, the byte
    ``0xc1``, trailing bytes), and :class:`IntArrayTooLong` for an
    ``int_fields`` element that is an array of more than ``max_ints`` elements
    (decided from its header: nothing is allocated for it).
    """
    if len(int_fields) > 8 or len(set(int_fields)) != len(int_fields):
        raise ValueError("split_array: at most 8 distinct int_fields")
    return _split_impl(_as_bytes(raw), tuple(int_fields), max_ints)


def array_spans(raw: Any) -> list[int]:
    """Spans of the elements of one msgpack array, and of their first elements.

    Returns 5 ints per element of the array in ``raw``: its start and end
    offsets, its element count (``-1`` if it is not an array), and the offsets
    where its element 1 and its element 3 start (``-1`` both when it has
    fewer than 3 elements). Offsets are relative to ``raw``. ``ValueError``
    as :func:`split_array`.
    """
    return _spans_impl(_as_bytes(raw))


def int_rows(raw: Any, starts: list[int], width: int) -> tuple[npt.NDArray[np.int64], list[int]]:
    """Decode the arrays of int rows at the given offsets of ``raw`` into one table.

    At each offset in ``starts`` the msgpack value must be nil or an array of
    rows, each an array of exactly ``width`` (1 to 15) ints in the int64 range.
    Returns ``(table, bounds)``: ``table`` a new 1-D int64 array holding every
    row in order (reshape it to ``(-1, width)``), ``bounds`` two ints per
    offset, the first row and the end row of its array, ``-1, -1`` for nil.
    Raises ``ValueError`` for any other value or an offset outside ``raw``.
    """
    if not 1 <= width <= 15:
        raise ValueError("int_rows: width must be 1..15")
    return _rows_impl(_as_bytes(raw), list(starts), width)


# --------------------------------------------------------------------------
# Shared input normalization


def _as_bytes(raw: Any) -> memoryview:
    view = memoryview(raw)
    if view.format != "B" or view.ndim != 1:
        if not view.c_contiguous:
            view = memoryview(view.tobytes())
        view = view.cast("B")
    elif not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view


def _as_int64(values: Any) -> npt.NDArray[np.int64]:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{_PREFIX}expected a 1-D int array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size:
            raise TypeError(f"{_PREFIX}expected an integer dtype, got {arr.dtype}")
        arr = arr.astype(np.int64)  # np.asarray([]) is float64
    if arr.size > _MAX_ARRAY_COUNT:
        raise ValueError(f"{_PREFIX}{arr.size} elements exceed the array32 limit")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        index = int(np.argmax(arr > _INT64_MAX))
        raise ValueError(
            f"{_PREFIX}element {index}: uint64 value {int(arr[index])} exceeds the int64 range"
        )
    return np.ascontiguousarray(arr, dtype=np.int64)


# --------------------------------------------------------------------------
# Native


def _decode_native(buf: memoryview) -> npt.NDArray[np.int64]:
    assert _intcodec is not None
    # array_len refuses a count larger than the bytes that follow, so a forged
    # header cannot make this allocate more than 8 bytes per input byte.
    out = np.empty(_intcodec.array_len(buf), dtype=np.int64)
    _intcodec.decode_into(buf, out)
    return out


def _encode_native(values: npt.NDArray[np.int64]) -> bytes:
    assert _intcodec is not None
    result: bytes = _intcodec.encode(values)
    return result


def _alloc_int64(count: int) -> npt.NDArray[np.int64]:
    return np.empty(count, dtype=np.int64)


class _BoundedAlloc:
    """split's ``alloc``: refuses a count over ``limit`` (the header's, before any decode)."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __call__(self, count: int) -> npt.NDArray[np.int64]:
        if count > self.limit:
            raise IntArrayTooLong(-1, count, self.limit)  # the element is found by the caller
        return np.empty(count, dtype=np.int64)


def offsets_of(total: int, raws: Sequence[Any]) -> list[int]:
    """:func:`split_array`'s offsets for elements ``raws`` (back to back, ending a
    buffer of ``total`` bytes), from their sizes."""
    sizes = [len(r) for r in raws]
    offsets = [total - sum(sizes)]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    return offsets


def check_int_arrays(
    raw: Any, offsets: list[int], int_fields: tuple[int, ...], max_ints: int
) -> None:
    """Raise :class:`IntArrayTooLong` for the first ``int_fields`` element at ``offsets``
    that is an array of more than ``max_ints`` elements (its header only)."""
    _too_long_field(_as_bytes(raw), offsets, int_fields, max_ints)


def _too_long_field(
    buf: memoryview, offsets: list[int], int_fields: tuple[int, ...], max_ints: int
) -> None:
    for field in sorted(int_fields):
        if 0 <= field < len(offsets) - 1:
            b = buf[offsets[field]]
            if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
                count, _ = _parse_header(buf[offsets[field] : offsets[field + 1]])
                if count > max_ints:
                    raise IntArrayTooLong(field, count, max_ints)


def _split_native(
    buf: memoryview, int_fields: tuple[int, ...], max_ints: int | None = None
) -> tuple[list[int], list[npt.NDArray[np.int64] | None]]:
    assert _intcodec is not None
    if max_ints is None or not int_fields:
        offsets, ints = _intcodec.split(buf, int_fields, _alloc_int64)
        return offsets, ints
    try:
        offsets, ints = _intcodec.split(buf, int_fields, _BoundedAlloc(max_ints))
    except IntArrayTooLong:
        # which element: the split without decoding (a breach only) names it
        _too_long_field(buf, _intcodec.split(buf, (), None)[0], int_fields, max_ints)
        raise  # pragma: no cover - the walk above raises for the same header
    return offsets, ints


def _len_native(buf: memoryview) -> int:
    assert _intcodec is not None
    count: int = _intcodec.array_len(buf)
    return count


def _check_native(
    buf: memoryview, offsets: list[int], skip: tuple[int, ...], max_depth: int, max_len: int
) -> tuple[int, int, int] | None:
    assert _intcodec is not None
    breach: tuple[int, int, int] | None = _intcodec.check_structure(
        buf, offsets, skip, max_depth, max_len
    )
    return breach


def _spans_native(buf: memoryview) -> list[int]:
    assert _intcodec is not None
    spans: list[int] = _intcodec.array_spans(buf)
    return spans


def _rows_native(
    buf: memoryview, starts: list[int], width: int
) -> tuple[npt.NDArray[np.int64], list[int]]:
    assert _intcodec is not None
    table, bounds = _intcodec.int_rows(buf, starts, width, _alloc_int64)
    return table, bounds


# --------------------------------------------------------------------------
# Fallback: decode


_LIST_OF_INT_DECODER = msgspec.msgpack.Decoder(list[int])


def _decode_py(buf: memoryview) -> npt.NDArray[np.int64]:
    count, _ = _parse_header(buf)  # refuse a forged count before msgspec allocates
    try:
        values = _LIST_OF_INT_DECODER.decode(buf)
        out = np.array(values, dtype=np.int64)  # OverflowError above INT64_MAX
    except (msgspec.DecodeError, OverflowError, ValueError) as exc:
        _scan(buf)  # raises the precise error (same text as the native decoder)
        raise ValueError(f"{_PREFIX}{exc}") from exc  # pragma: no cover - scan raises
    if out.shape != (count,):  # pragma: no cover - msgspec checked the count
        raise ValueError(f"{_PREFIX}expected {count} elements, decoded {out.shape}")
    return out


def _type_name(b: int) -> str:
    if b <= 0x7F or b >= 0xE0 or 0xCC <= b <= 0xD3:
        return "int"
    if b <= 0x8F or b in (0xDE, 0xDF):
        return "map"
    if b <= 0x9F or b in (0xDC, 0xDD):
        return "array"
    if b <= 0xBF or 0xD9 <= b <= 0xDB:
        return "str"
    return {
        0xC0: "nil",
        0xC1: "never-used byte",
        0xC2: "bool",
        0xC3: "bool",
        0xC4: "bin",
        0xC5: "bin",
        0xC6: "bin",
        0xCA: "float32",
        0xCB: "float64",
    }.get(b, "ext")  # 0xc7..0xc9, 0xd4..0xd8


def _parse_header(buf: memoryview) -> tuple[int, int]:
    """(count, header length); the same checks as the native array_len."""
    n = len(buf)
    if n < 1:
        raise ValueError(f"{_PREFIX}truncated input: empty buffer")
    b = buf[0]
    if 0x90 <= b <= 0x9F:
        count, hlen = b & 0x0F, 1
    elif b in (0xDC, 0xDD):
        hlen = 3 if b == 0xDC else 5
        if n < hlen:
            raise ValueError(
                f"{_PREFIX}truncated input: array header (type byte 0x{b:02x}) "
                f"needs {hlen} bytes, only {n} given"
            )
        count = int.from_bytes(buf[1:hlen], "big")
    else:
        raise ValueError(
            f"{_PREFIX}expected an array header, got {_type_name(b)} (type byte 0x{b:02x})"
        )
    if count > n - hlen:
        raise ValueError(
            f"{_PREFIX}truncated input: array header declares {count} elements "
            f"but only {n - hlen} bytes follow"
        )
    return count, hlen


def _scan(buf: memoryview) -> None:
    """Walk the array byte by byte and raise the first error, as the C code does."""
    count, pos = _parse_header(buf)
    n = len(buf)
    for i in range(count):
        if pos >= n:
            raise ValueError(f"{_PREFIX}truncated input: element {i} missing at offset {pos}")
        b = buf[pos]
        if b <= 0x7F or b >= 0xE0:
            pos += 1
            continue
        form = _INT_FORMS.get(b)
        if form is None:
            raise ValueError(
                f"{_PREFIX}element {i}: expected an int, got {_type_name(b)} (type byte 0x{b:02x})"
            )
        width, signed = form
        if n - pos < 1 + width:
            raise ValueError(
                f"{_PREFIX}truncated input: element {i} (type byte 0x{b:02x}) needs "
                f"{1 + width} bytes at offset {pos}, only {n - pos} left"
            )
        value = int.from_bytes(buf[pos + 1 : pos + 1 + width], "big", signed=signed)
        if value > _INT64_MAX:
            raise ValueError(f"{_PREFIX}element {i}: uint64 value {value} exceeds the int64 range")
        pos += 1 + width
    if pos != n:
        raise ValueError(f"{_PREFIX}{n - pos} trailing bytes after the array (at offset {pos})")


# --------------------------------------------------------------------------
# Fallback: split

_RAW_LIST_DECODER = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _split_py(
    buf: memoryview, int_fields: tuple[int, ...], max_ints: int | None = None
) -> tuple[list[int], list[npt.NDArray[np.int64] | None]]:
    try:
        elems = _RAW_LIST_DECODER.decode(buf)
    except RecursionError:  # nested deeper than msgspec follows: walk it here
        offsets = _walk_py(buf)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ValueError(f"msgpack: {exc}") from exc
    else:
        offsets = offsets_of(len(buf), elems)  # back to back, ending the input
    if max_ints is not None:
        _too_long_field(buf, offsets, int_fields, max_ints)
    ints: list[npt.NDArray[np.int64] | None] = []
    for field in int_fields:
        value = None
        if 0 <= field < len(offsets) - 1:
            try:
                value = _decode_py(buf[offsets[field] : offsets[field + 1]])
            except ValueError:
                pass
        ints.append(value)
    return offsets, ints


def _walk_py(buf: memoryview) -> list[int]:
    """split_array's offsets by a byte walk (no recursion: any nesting depth)."""
    n = len(buf)
    if n < 1 or not (0x90 <= buf[0] <= 0x9F or buf[0] in (0xDC, 0xDD)):
        raise ValueError("msgpack: expected an array")
    hlen = 1 if buf[0] <= 0x9F else (3 if buf[0] == 0xDC else 5)
    if n < hlen:
        raise ValueError("msgpack: truncated input: array header")
    count = buf[0] & 0x0F if hlen == 1 else int.from_bytes(buf[1:hlen], "big")
    if count > n - hlen:
        raise ValueError(f"msgpack: truncated input: the array header declares {count} elements")
    offsets = [hlen]
    for _ in range(count):
        offsets.append(_value_end_py(buf, offsets[-1]))
    if offsets[-1] != n:
        raise ValueError(f"msgpack: {n - offsets[-1]} trailing bytes after the array")
    return offsets


def _spans_py(buf: memoryview) -> list[int]:
    offsets, _ = _split_py(buf, ())
    out: list[int] = []
    for start, end in pairwise(offsets):
        b = buf[start]
        count, off1, off3 = -1, -1, -1
        if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
            sub, _ = _split_py(buf[start:end], ())
            count = len(sub) - 1
            if count >= 3:
                off1, off3 = start + sub[1], start + sub[3]
        out += [start, end, count, off1, off3]
    return out


def _value_end_py(buf: memoryview, pos: int) -> int:
    """Where the msgpack value starting at ``pos`` ends (structure only, as the C walk)."""
    n = len(buf)
    pending = 1
    while pending:
        if pos >= n:
            raise ValueError(f"msgpack: truncated input at offset {pos}")
        b = buf[pos]
        pending -= 1
        if b <= 0x7F or b >= 0xE0:
            pos += 1
            continue
        size, children, _ = _head_py(buf, pos, n)
        pos += size
        pending += children
        if pending > n - pos:
            raise ValueError(f"msgpack: truncated input at offset {pos}")
    return pos


_FIXED_SIZE = {  # type byte -> size of the whole value
    0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9,
    0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9, 0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9,
    0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18,
}  # fmt: skip
_LENGTH_FORMS = {  # type byte -> (length field width, ext type byte, container: 1 array, 2 map)
    0xC4: (1, 0, 0), 0xC5: (2, 0, 0), 0xC6: (4, 0, 0),  # bin
    0xD9: (1, 0, 0), 0xDA: (2, 0, 0), 0xDB: (4, 0, 0),  # str
    0xC7: (1, 1, 0), 0xC8: (2, 1, 0), 0xC9: (4, 1, 0),  # ext
    0xDC: (2, 0, 1), 0xDD: (4, 0, 1),  # array
    0xDE: (2, 0, 2), 0xDF: (4, 0, 2),  # map
}  # fmt: skip


def _len_py(buf: memoryview) -> int:
    return _parse_header(buf)[0]


def _check_py(
    buf: memoryview, offsets: list[int], skip: tuple[int, ...], max_depth: int, max_len: int
) -> tuple[int, int, int] | None:
    """The C walk of check_structure: one counter per open container, headers only."""
    n = len(buf)
    for i, (start, end) in enumerate(pairwise(offsets)):
        if not 0 <= start <= end <= n:
            raise ValueError(f"check_structure: element {i} spans {start}..{end} of {n} bytes")
        if i in skip:
            continue
        pos, pending = start, [1]  # values left in each open level; level 0: the element
        while True:
            while pending[-1] == 0:
                pending.pop()
                if not pending:
                    break
            if not pending:
                break
            if pos >= end:
                raise ValueError(f"msgpack: truncated input at offset {pos}")
            pending[-1] -= 1
            b = buf[pos]
            if b <= 0x7F or b >= 0xE0:
                pos += 1
                continue
            size, children, container = _head_py(buf, pos, end)
            pos += size
            if not container:
                continue
            entries = children // 2 if container == 2 else children
            if entries > max_len:
                return (container, i, entries)
            depth = len(pending) + 1  # inside the array (1) and len(pending) - 1 levels
            if depth > max_depth:
                return (3, i, depth)
            if children > end - pos:
                raise ValueError(f"msgpack: truncated input at offset {pos}")
            if children:
                pending.append(children)
        if pos != end:
            raise ValueError(
                f"check_structure: element {i} is not one value ({pos - start} of "
                f"{end - start} bytes)"
            )
    return None


def _head_py(buf: memoryview, pos: int, end: int) -> tuple[int, int, int]:
    """(size without children, children, container: 0, 1 array, 2 map) of a non-fixint."""
    b = buf[pos]
    size, children, container = 1, 0, 0
    if b <= 0x8F:
        children, container = 2 * (b & 0x0F), 2
    elif b <= 0x9F:
        children, container = b & 0x0F, 1
    elif b <= 0xBF:
        size = 1 + (b & 0x1F)
    elif b == 0xC1:
        raise ValueError(f"msgpack: invalid type byte 0xc1 at offset {pos}")
    elif b in _FIXED_SIZE:
        size = _FIXED_SIZE[b]
    else:
        width, ext, kind = _LENGTH_FORMS[b]
        if end - pos < 1 + width:
            raise ValueError(f"msgpack: truncated input at offset {pos}")
        m = int.from_bytes(buf[pos + 1 : pos + 1 + width], "big")
        if kind:
            size, children, container = 1 + width, m * kind, kind
        else:
            size = 1 + width + ext + m
    if size > end - pos:
        raise ValueError(f"msgpack: truncated input at offset {pos}")
    return size, children, container


_ROWS_DECODER = msgspec.msgpack.Decoder(list[list[int]] | None)


def _rows_py(
    buf: memoryview, starts: list[int], width: int
) -> tuple[npt.NDArray[np.int64], list[int]]:
    rows: list[list[int]] = []
    bounds: list[int] = []
    for at in starts:
        if not 0 <= at < len(buf):
            raise ValueError(f"int_rows: start {at} outside the input")
        try:
            value = _ROWS_DECODER.decode(buf[at : _value_end_py(buf, at)])
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            raise ValueError(f"int_rows: the value at offset {at}: {exc}") from exc
        if value is None:
            bounds += [-1, -1]
            continue
        if any(len(row) != width for row in value):
            raise ValueError(f"int_rows: a row at offset {at} is not an array of {width} ints")
        bounds += [len(rows), len(rows) + len(value)]
        rows += value
    try:
        table = np.array(rows, dtype=np.int64).reshape(-1)
    except OverflowError as exc:
        raise ValueError(f"int_rows: {exc}") from exc
    return table, bounds


# --------------------------------------------------------------------------
# Fallback: encode

# msgspec writes ints in the same smallest forms as msgpack-python (the tests
# check it). Going through .tolist() was measured faster than a vectorized
# numpy writer (one pass per int form plus a scatter) at 128K ids.
_ENCODER = msgspec.msgpack.Encoder()


def _encode_py(values: npt.NDArray[np.int64]) -> bytes:
    return _ENCODER.encode(values.tolist())


# --------------------------------------------------------------------------

_decode_impl = _decode_py
_encode_impl = _encode_py
_split_impl = _split_py
_spans_impl = _spans_py
_rows_impl = _rows_py
_len_impl = _len_py
_check_impl = _check_py


def _use_native(on: bool) -> bool:
    """Point the public functions at the extension (when built and ``on``) or the fallback."""
    global _decode_impl, _encode_impl, _split_impl, _spans_impl, _rows_impl, HAVE_NATIVE
    global _len_impl, _check_impl
    HAVE_NATIVE = on and _BUILT is not None
    if HAVE_NATIVE:
        _decode_impl = _decode_native
        _encode_impl = _encode_native
        _split_impl = _split_native
        _spans_impl = _spans_native
        _rows_impl = _rows_native
        _len_impl = _len_native
        _check_impl = _check_native
    else:
        _decode_impl = _decode_py
        _encode_impl = _encode_py
        _split_impl = _split_py
        _spans_impl = _spans_py
        _rows_impl = _rows_py
        _len_impl = _len_py
        _check_impl = _check_py
    return HAVE_NATIVE


native.register(__name__, _use_native)
