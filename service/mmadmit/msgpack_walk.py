"""The msgpack walker and int-array codec: one source, interpreted or compiled.

This module is the reference for every structural rule :mod:`mmadmit.intcodec`
applies to msgpack bytes, and it words every error. It is plain Python (it
imports ``cython`` only for the type annotations, which do nothing when it
runs interpreted), and ``setup.py`` compiles the same file with Cython into
the optional extension ``mmadmit._walk_c`` (Cython's pure-Python mode). Both
are importable side by side; :mod:`mmadmit.intcodec` picks one at run time
(``mmadmit.native``, ``--native off``), and the tests and the ``intcodec`` fuzz
target run both on the same inputs and compare results and messages.

Entry points (buffers are 1-D contiguous bytes; ``intcodec`` normalizes them):

* :func:`array_len`, :func:`decode`, :func:`encode`: one msgpack array of ints
  <-> a 1-D ``int64`` array (errors prefixed ``msgpack int array:``);
  :func:`decode_marked`: the same with marks (where every 64th element
  starts), so that :func:`encode_filled` writes an array made from a received
  one by setting spans to one value each (the padded ids: the pad runs) from
  the bytes and the spans alone, the received bytes copied where unchanged.
* :func:`decode_add`: a whole ADD payload in one call (the split, the limits,
  the tag and rid, the items and their offsets), refusals worded as it goes.
* :func:`build_items` and :func:`splice_items`: a request's multimodal items
  built from their received bytes (every legal item; refusals worded), and
  the reply's items array written back from those
  bytes with only hash and pad_value written again.
* :func:`split`, :func:`element_span`, :func:`int_rows`,
  :func:`check_structure`: walks over one whole msgpack message that check
  its structure only (lengths, the never-used byte ``0xc1``, trailing bytes),
  iteratively (no recursion: any nesting depth costs no stack), every read
  bounds-checked (errors prefixed ``msgpack:`` or the entry point's name).

The int loops touch no Python object and, compiled, run without the GIL for
arrays of ``_GIL_MIN`` elements or more. Decoding takes runs of one int form
(a placeholder id over an image, a pad value over its span) eight elements
at a time, and elements eight at a time with one unaligned 8-byte big-endian
load each while 72 bytes are left; encoding writes runs of one value eight at
a time, and a long run by copying what it has written (``memcpy``, doubling).
Results and errors are those of the element-by-element loop.

Arithmetic is written to give the same numbers in C (64-bit, wrapping) and in
Python (unbounded ints): an unsigned value that may wrap goes through
:func:`_wrap` (a no-op compiled), and every count stays far below 2**62.
``cython.compiled`` is tested only where the compiled code must differ:
:func:`_wrap` (interpreted, it also makes a numpy int a Python int);
:func:`_load8`, which reads through a pointer when compiled (GCC merges byte
loads into one load and a byte swap only at constant offsets from one
pointer, not at a variable index into a memoryview) and with one
``int.from_bytes`` interpreted;
:func:`_copy` and :func:`_bytes_at` (``memcpy`` and a pointer slice
compiled, slicing interpreted); and the imports at the top.
"""

from __future__ import annotations

import cython
import numpy as np
from mmadmit_client.wire import F_INPUT_IDS, F_MM, F_RID, F_UNPADDED, TAG
from msgspec.structs import astuple

from .dtypes import parse_dtype
from .errors import AdmissionError, InvalidRequest
from .limits import MAX_DEPTH, depth_over, items_over, msgpack_len_over, tokens_over

__all__ = [
    "MAX_ARRAY_COUNT",
    "MAX_DEPTH",
    "IntArrayTooLong",
    "RowsError",
    "array_len",
    "build_items",
    "check_structure",
    "decode",
    "decode_add",
    "decode_marked",
    "element_span",
    "encode",
    "encode_filled",
    "int_rows",
    "range_message",
    "splice_items",
    "split",
]

if cython.compiled:
    # One class for both builds: intcodec and wire catch the pure module's.
    from mmadmit.msgpack_walk import IntArrayTooLong, RowsError  # type: ignore[attr-defined]
else:

    class IntArrayTooLong(ValueError):  # type: ignore[no-redef]
        """An ``int_fields`` element of :func:`split` declares more than ``max_ints``
        elements; raised from its header, before anything is allocated for it."""

        def __init__(self, element: int, count: int, limit: int) -> None:
            super().__init__(f"element {element}: an array of {count} elements, limit {limit}")
            self.element, self.count, self.limit = element, count, limit

    class RowsError(ValueError):  # type: ignore[no-redef]
        """:func:`int_rows` refuses the value at ``starts[index]``: the first start, in
        ``starts``' order, whose value it refuses."""

        def __init__(self, message: str, index: int) -> None:
            super().__init__(message)
            self.index = index


if cython.compiled:
    from cython.cimports.libc.string import memcmp, memcpy

ssize = cython.typedef(cython.Py_ssize_t)
u8 = cython.typedef(cython.uchar)
i64 = cython.typedef(cython.longlong)
u64 = cython.typedef(cython.ulonglong)

# the deepest nesting check_structure follows; _walk_limits's stack is sized by the
# literal 1024 (Cython wants one), so it is checked against the setting here
assert MAX_DEPTH == 1024, MAX_DEPTH
# check_structure's odd elements: an array nested deeper than this inside an
# element is decoded by its caller anyway (msgspec's recursion limit words it).
PLAIN_DEPTH = 64
_PLAIN_DEPTH = cython.declare(cython.int, PLAIN_DEPTH)
MAX_ARRAY_COUNT = 0xFFFFFFFF  # array32: the most elements encode writes
_GIL_MIN = cython.declare(ssize, 1 << 16)  # int loops this long run without the GIL
_INT = "msgpack int array: "
_NO_MARKS = np.empty(0, dtype=np.int64)  # _ints without marks
_LONG_RUN = cython.declare(ssize, 32)  # encode: a run this long is copied, not rewritten
_MARK_SHIFT = cython.declare(cython.int, 6)  # marks: where every 64th element starts

# Int-array decode outcomes (_ints) and split errors (_split_error).
_OK = cython.declare(cython.int, 0)
_E_MISSING = cython.declare(cython.int, 1)  # input ended before element i
_E_TYPE = cython.declare(cython.int, 2)  # element i is not an int
_E_TRUNC = cython.declare(cython.int, 3)  # element i cut short
_E_RANGE = cython.declare(cython.int, 4)  # a uint64 above INT64_MAX
_S_END = cython.declare(cython.int, 1)  # input ended where a value was expected
_S_TRUNC = cython.declare(cython.int, 2)  # a value cut short
_S_PENDING = cython.declare(cython.int, 3)  # more values announced than bytes left
_S_BYTE = cython.declare(cython.int, 4)  # the never-used type byte 0xc1
_S_COUNT = cython.declare(cython.int, 5)  # the top array declares more than bytes left


# --------------------------------------------------------------------------
# Type bytes


def _type_name(b: cython.int) -> str:
    if b <= 0x7F or b >= 0xE0 or 0xCC <= b <= 0xD3:
        return "int"
    if b <= 0x8F or b == 0xDE or b == 0xDF:
        return "map"
    if b <= 0x9F or b == 0xDC or b == 0xDD:
        return "array"
    if b <= 0xBF or 0xD9 <= b <= 0xDB:
        return "str"
    if b == 0xC0:
        return "nil"
    if b == 0xC1:
        return "never-used byte"
    if b == 0xC2 or b == 0xC3:
        return "bool"
    if 0xC4 <= b <= 0xC6:
        return "bin"
    if b == 0xCA:
        return "float32"
    if b == 0xCB:
        return "float64"
    return "ext"  # 0xc7..0xc9, 0xd4..0xd8


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
def _wrap(x: u64) -> u64:
    """``x`` modulo 2**64: what C's unsigned arithmetic does by itself."""
    if not cython.compiled:
        x = int(x) & 0xFFFFFFFFFFFFFFFF  # a numpy int interpreted: a Python int
    return x


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
def _int_width(b: cython.uint) -> ssize:
    """Payload bytes after an int's type byte: 0 for a fixint, 1, 2, 4 or 8 for
    uint8..64 / int8..64 (0xcc..0xd3), -1 for a byte that does not start an int."""
    if b < 0x80 or b >= 0xE0:
        return 0
    if 0xCC <= b <= 0xD3:
        return 1 << (b & 3)
    return -1


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
def _int_value(b: cython.uint, u: u64) -> i64:
    """The int of type byte ``b`` and payload ``u``: sign-extended for a fixint
    (``u`` unused) and int8..64, as is for uint8..32, and uint64 as int64 (a
    value above INT64_MAX comes out negative, in range for the caller to refuse)."""
    m: u64 = 0
    one: u64 = 1
    if b < 0x80 or b >= 0xE0:
        u = b
        m = 0x80
    elif b >= 0xCF:
        m = one << (8 * (1 << (b & 3)) - 1)
    r: i64 = (u ^ m) - m  # C wraps in 64 bits, Python needs not
    return r


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _load(p: cython.const[u8][::1], at: ssize, width: cython.int) -> u64:
    """``width`` bytes at ``p[at]``, big-endian (the caller has checked they are there)."""
    v: u64 = 0
    k: cython.int
    for k in range(width):
        v = (v << 8) | p[at + k]
    return v


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _load8(p: cython.const[u8][::1], at: ssize) -> u64:
    """8 bytes at ``p[at]``, big-endian (one unaligned load and a byte swap, compiled)."""
    q: cython.pointer(cython.const[u8])
    if not cython.compiled:
        return int.from_bytes(p[at : at + 8], "big")
    q = cython.address(p[at])
    return (
        (cython.cast(u64, q[0]) << 56)
        | (cython.cast(u64, q[1]) << 48)
        | (cython.cast(u64, q[2]) << 40)
        | (cython.cast(u64, q[3]) << 32)
        | (cython.cast(u64, q[4]) << 24)
        | (cython.cast(u64, q[5]) << 16)
        | (cython.cast(u64, q[6]) << 8)
        | cython.cast(u64, q[7])
    )


# --------------------------------------------------------------------------
# Int arrays: decode


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _array_head(p: cython.const[u8][::1], end: ssize, pos: ssize) -> tuple[ssize, ssize]:
    """The array header at ``p[pos]`` (``pos < end``): ``(count, header length)``;
    ``(-1, 0)`` if it is no array header, ``(-2, need)`` if it is cut short."""
    b: cython.uint = p[pos]
    h: ssize
    if 0x90 <= b <= 0x9F:
        return b & 0x0F, 1
    if b == 0xDC or b == 0xDD:
        h = 3 if b == 0xDC else 5
        if end - pos < h:
            return -2, h
        return cython.cast(ssize, _load(p, pos + 1, h - 1)), h
    return -1, 0


def _int_header(p: cython.const[u8][::1]) -> tuple[ssize, ssize]:
    """(count, header length) of the int array filling ``p``, or ValueError."""
    n: ssize = p.shape[0]
    count: ssize
    h: ssize
    if n < 1:
        raise ValueError(f"{_INT}truncated input: empty buffer")
    count, h = _array_head(p, n, 0)
    if count == -1:
        raise ValueError(_not_an_array(p[0]))
    if count == -2:
        raise ValueError(
            f"{_INT}truncated input: array header (type byte 0x{p[0]:02x}) "
            f"needs {h} bytes, only {n} given"
        )
    # Each element takes at least one byte: refusing a larger count here keeps
    # a forged header from making the caller allocate gigabytes.
    if count > n - h:
        raise ValueError(
            f"{_INT}truncated input: array header declares {count} elements "
            f"but only {n - h} bytes follow"
        )
    return count, h


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _run8(
    p: cython.const[u8][::1], pos: ssize, b: cython.uint, s: ssize, out: i64[::1], o: ssize
) -> cython.bint:
    """Eight elements of type byte ``b`` (0xcc..0xd3), ``s`` bytes apart, decoded
    with independent loads into ``out[o:o + 8]``. False (``out`` then holds
    nothing to keep) unless all eight have type byte ``b`` and none is a uint64
    above INT64_MAX. Needs ``7 * s + 9`` bytes at ``p[pos]``."""
    k: cython.int
    same: cython.bint = True
    for k in range(1, 8):
        same &= p[pos + k * s] == b
    if not same:
        return False
    shift: cython.int = (64 - 8 * (1 << (b & 3))) & 63
    seen: u64 = 0
    raw: u64
    for k in range(8):
        raw = _load8(p, pos + k * s + 1)
        seen |= raw
        out[o + k] = _int_value(b, raw >> shift)
    return not (b == 0xCF and (seen >> 63))


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _same(p: cython.const[u8][::1], a: ssize, b: ssize, m: ssize) -> cython.bint:
    """Whether ``p[a:a + m]`` and ``p[b:b + m]`` hold the same bytes (both inside ``p``):
    8 to 72 bytes 8 at a time (the last 8 read where they end), and one
    ``memcmp`` compiled otherwise (its call costs more than a short compare)."""
    same: cython.bint
    k: ssize = 0
    if 8 <= m <= 72:
        while k < m - 8:
            if _load8(p, a + k) != _load8(p, b + k):
                return False
            k += 8
        return _load8(p, a + m - 8) == _load8(p, b + m - 8)
    if cython.compiled:
        same = memcmp(cython.address(p[a]), cython.address(p[b]), m) == 0
    else:
        same = p[a : a + m] == p[b : b + m]
    return same


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
def _repeats(p: cython.const[u8][::1], end: ssize, pos: ssize, s: ssize, most: ssize) -> ssize:
    """How many elements from ``p[pos]`` are the ``s`` bytes there again, in steps of
    8 (0 if not 8 of them; at most ``most``). ``r`` elements are one encoding
    repeated when ``p[pos:pos + (r - 1) * s]`` equals the same bytes ``s``
    later; a run is extended by comparing its next bytes the same way. A run
    of one token (a placeholder over an image) is compared, never decoded,
    past its first element."""
    r: ssize = 8
    t: ssize
    if most < 16 or end - pos < 16 * s or not _same(p, pos, pos + s, 7 * s):
        return 0
    while most - r >= 8 and end - pos >= (r + 8) * s:
        # steps of 64 once the run has shown it is long (a short one ends within them)
        t = 64 if r >= 64 and most - r >= 64 and end - pos >= (r + 64) * s else 8
        if not _same(p, pos + (r - 1) * s, pos + r * s, t * s):
            if t == 8 or not _same(p, pos + (r - 1) * s, pos + r * s, 8 * s):
                break
            t = 8
        r += t
    return r


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _ints(
    p: cython.const[u8][::1],
    end: ssize,
    pos: ssize,
    count: ssize,
    out: i64[::1],
    o: ssize,
    mk: i64[::1],
) -> tuple[cython.int, ssize, ssize, u64]:
    """Decode ``count`` ints from ``p[pos]`` into ``out[o:o + count]``.

    ``(_OK, count, end position, 0)``, or ``(error kind, element, its offset,
    the uint64 value for _E_RANGE)`` for the first bad element. Bytes past the
    array are not looked at (the 8-wide loop reads, never uses, up to 8 bytes
    past its end, within ``end``). ``mk`` (may be empty) gets the marks of
    :func:`encode_filled`: ``mk[k]`` is where element ``64 * k`` starts, counted
    from ``pos``, for each ``k`` it has room for."""
    i: ssize = 0
    base: ssize = pos
    nmk: ssize = mk.shape[0]
    r: ssize
    k: ssize
    x: i64
    b: cython.uint
    first: cython.uint
    w: ssize
    s: ssize
    _k: cython.int
    raw: u64
    u: u64
    # 8 elements at a time while 72 bytes are left (8 elements take at most
    # that, the last one's 8-byte load included: no bounds check inside a
    # chunk); first a look for a run of one form, taken while it lasts.
    while count - i >= 8 and end - pos >= 72:
        if (i & 63) == 0 and (i >> 6) < nmk:  # i is a multiple of 8 here
            mk[i >> 6] = pos - base
        first = p[pos]
        if 0xCC <= first <= 0xD3:
            s = 1 + (1 << (first & 3))
            r = 0  # (a look at two neighbours' first 8 bytes first: most text stops here)
            if _load8(p, pos) == _load8(p, pos + s):  # 72 bytes are left
                r = _repeats(p, end, pos, s, count - i)
            if r and not (first == 0xCF and p[pos + 1] >= 0x80):  # r copies of one int
                x = _int_value(first, _load8(p, pos + 1) >> ((72 - 8 * s) & 63))
                for k in range(r):
                    out[o + i + k] = x
                k = (i & ~63) + 64  # the marks inside the run
                while k < i + r and (k >> 6) < nmk:
                    mk[k >> 6] = pos + (k - i) * s - base
                    k += 64
                i += r
                pos += r * s
                continue
            if _run8(p, pos, first, s, out, o + i):  # 7 * s + 9 <= 72
                i += 8
                pos += 8 * s
                continue
        for _k in range(8):
            b = p[pos]
            w = _int_width(b)
            if w < 0:
                return _E_TYPE, i, pos, 0
            raw = _load8(p, pos + 1)
            u = raw >> ((64 - 8 * w) & 63)
            if b == 0xCF and u >> 63:
                return _E_RANGE, i, pos, u
            out[o + i] = _int_value(b, u)
            pos += 1 + w
            i += 1
    # the last few elements: every read checked
    while i < count:
        if (i & 63) == 0 and (i >> 6) < nmk:
            mk[i >> 6] = pos - base
        if pos >= end:
            return _E_MISSING, i, pos, 0
        b = p[pos]
        w = _int_width(b)
        if w < 0:
            return _E_TYPE, i, pos, 0
        if end - pos < 1 + w:
            return _E_TRUNC, i, pos, 0
        u = _load(p, pos + 1, w)
        if b == 0xCF and u >> 63:
            return _E_RANGE, i, pos, u
        out[o + i] = _int_value(b, u)
        pos += 1 + w
        i += 1
    return _OK, i, pos, 0


@cython.cfunc
@cython.exceptval(check=False)
def _decode_ints(
    p: cython.const[u8][::1],
    end: ssize,
    pos: ssize,
    count: ssize,
    out: i64[::1],
    o: ssize,
    mk: i64[::1],
) -> tuple[cython.int, ssize, ssize, u64]:
    """:func:`_ints`, without the GIL for a long array (compiled)."""
    r: tuple[cython.int, ssize, ssize, u64]
    if count >= _GIL_MIN:
        with cython.nogil:
            r = _ints(p, end, pos, count, out, o, mk)
    else:
        r = _ints(p, end, pos, count, out, o, mk)
    return r


def _not_an_array(b: cython.int) -> str:
    """The error of an int array whose header is type byte ``b``, not an array's."""
    return f"{_INT}expected an array header, got {_type_name(b)} (type byte 0x{b:02x})"


def _int_error(p: cython.const[u8][::1], kind: cython.int, i: ssize, pos: ssize, value: u64) -> str:
    """The message of an :func:`_ints` outcome."""
    n: ssize = p.shape[0]
    if kind == _E_MISSING:
        return f"{_INT}truncated input: element {i} missing at offset {pos}"
    b: cython.uint = p[pos]
    if kind == _E_TYPE:
        return f"{_INT}element {i}: expected an int, got {_type_name(b)} (type byte 0x{b:02x})"
    if kind == _E_TRUNC:
        return (
            f"{_INT}truncated input: element {i} (type byte 0x{b:02x}) needs "
            f"{1 + _int_width(b)} bytes at offset {pos}, only {n - pos} left"
        )
    return range_message(i, value)


def range_message(i: ssize, value: u64) -> str:
    """The error of a uint64 above INT64_MAX at element ``i``, decoded or to encode."""
    return f"{_INT}element {i}: uint64 value {value} exceeds the int64 range"


def array_len(p: cython.const[u8][::1]) -> int:
    """The element count of the int array header at the start of ``p`` (header only).

    ValueError for a non-array, a cut header, or a count larger than the bytes
    that follow (so ``count`` int64 may be allocated safely)."""
    count: ssize
    count, _ = _int_header(p)
    return count


def decode(p: cython.const[u8][::1]) -> np.ndarray:
    """The one msgpack array of ints filling ``p``, as a new 1-D int64 array."""
    return _decode(p, False)[0]


def decode_marked(p: cython.const[u8][::1]) -> tuple:
    """:func:`decode`, and the array's marks for :func:`encode_filled`."""
    return _decode(p, True)


def _decode(p: cython.const[u8][::1], marked: cython.bint) -> tuple:
    count: ssize
    h: ssize
    count, h = _int_header(p)
    arr = np.empty(count, dtype=np.int64)
    out: i64[::1] = arr
    mka = np.empty(_marks_len(count), dtype=np.int64) if marked else _NO_MARKS
    mk: i64[::1] = mka
    kind: cython.int
    i: ssize
    pos: ssize
    value: u64
    kind, i, pos, value = _decode_ints(p, p.shape[0], h, count, out, 0, mk)
    if kind != _OK:
        raise ValueError(_int_error(p, kind, i, pos, value))
    if pos != p.shape[0]:
        raise ValueError(
            f"{_INT}{p.shape[0] - pos} trailing bytes after the array (at offset {pos})"
        )
    return arr, mka


# --------------------------------------------------------------------------
# Int arrays: encode


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _put9(o: u8[::1], at: ssize, t: cython.uint, payload: u64) -> cython.void:
    """Type byte ``t`` and 8 payload bytes (big-endian) at ``o[at]``; the caller
    then advances by the int's true size, the next write overwrites the rest.
    Written as the 8 bytes of one big-endian word and a ninth byte, which GCC
    turns into one byte-swapped 8-byte store and a byte store."""
    w: u64 = t
    w = (w << 56) | (payload >> 8)
    o[at] = w >> 56
    o[at + 1] = (w >> 48) & 0xFF
    o[at + 2] = (w >> 40) & 0xFF
    o[at + 3] = (w >> 32) & 0xFF
    o[at + 4] = (w >> 24) & 0xFF
    o[at + 5] = (w >> 16) & 0xFF
    o[at + 6] = (w >> 8) & 0xFF
    o[at + 7] = w & 0xFF
    o[at + 8] = payload & 0xFF


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
def _form(v: i64) -> tuple[cython.uint, u64, ssize]:
    """``(type byte, payload, size)`` of ``v`` in its smallest msgpack form,
    msgpack-python's choice, with one branch only (a fixint, rare among ids):
    a fixint (the type byte is the value, size 1), else 0xcc + k (uint) /
    0xd0 + k (int) and a payload of ``1 << k`` bytes (left-aligned in
    ``payload``)."""
    u: u64 = _wrap(v)
    neg: u64 = u >> 63
    # for v < 0, ~v: the int8/16/32 ranges are then ~v <= 0x7f, 0x7fff,
    # 0x7fffffff and negative fixints ~v <= 31; for v >= 0 the uint8/16/32
    # ranges are v <= 0xff, 0xffff, 0xffffffff and fixints v <= 127.
    m: u64 = u ^ _wrap(0 - neg)
    one: u64 = 1
    fixint: cython.bint = m <= ((one << 7) - 1) >> (2 * neg)
    k: cython.uint = 0
    k += m > ((one << 8) - 1) >> neg
    k += m > ((one << 16) - 1) >> neg
    k += m > ((one << 32) - 1) >> neg
    width: cython.uint = 1 << k
    if fixint:  # its payload is never kept (its size is 1)
        return u & 0xFF, 0, 1
    return 0xCC + 4 * neg + k, _wrap(u << ((64 - 8 * width) & 63)), 1 + width


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
def _put(o: u8[::1], at: ssize, x: i64) -> ssize:
    """Write ``x`` at ``o[at]`` (9 writable bytes); where the next value goes."""
    t: cython.uint
    payload: u64
    size: ssize
    t, payload, size = _form(x)
    _put9(o, at, t, payload)
    return at + size


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _copy(o: u8[::1], at: ssize, p: cython.const[u8][::1], a: ssize, m: ssize) -> cython.void:
    """``o[at:at + m] = p[a:a + m]``, not overlapping (the caller has checked both
    ranges): one ``memcpy`` compiled."""
    if m <= 0:
        return
    if cython.compiled:
        memcpy(cython.address(o[at]), cython.address(p[a]), m)
    else:
        o[at : at + m] = p[a : a + m]


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
def _repeat(
    o: u8[::1], at: ssize, t: cython.uint, payload: u64, size: ssize, count: ssize
) -> ssize:
    """``count`` copies of one int (:func:`_form`'s ``t``, ``payload``, ``size``) from
    ``o[at]``; the end offset. Eight are written, then what is written is copied
    after itself, doubling each time (never overlapping its source)."""
    total: ssize = size * count
    done: ssize = 0
    m: ssize
    _k: ssize
    for _k in range(min(count, 8)):
        _put9(o, at + done, t, payload)
        done += size
    while done < total:
        m = min(done, total - done)  # [at, at + done) is whole copies
        _copy(o, at + done, o, at, m)
        done += m
    return at + total


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _differ8(v: cython.const[i64][::1], w: cython.const[i64][::1], i: ssize) -> i64:
    """Nonzero unless ``v[i:i + 8]`` and ``w[i:i + 8]`` are equal (8 there, both)."""
    return (
        (v[i] ^ w[i])
        | (v[i + 1] ^ w[i + 1])
        | (v[i + 2] ^ w[i + 2])
        | (v[i + 3] ^ w[i + 3])
        | (v[i + 4] ^ w[i + 4])
        | (v[i + 5] ^ w[i + 5])
        | (v[i + 6] ^ w[i + 6])
        | (v[i + 7] ^ w[i + 7])
    )


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _same_until(v: cython.const[i64][::1], old: cython.const[i64][::1], i: ssize) -> ssize:
    """The first index from ``i`` where ``v`` and ``old`` differ (their length if none)."""
    n: ssize = v.shape[0]
    while n - i >= 8 and _differ8(v, old, i) == 0:
        i += 8
    while i < n and v[i] == old[i]:
        i += 1
    return i


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _write_ints(o: u8[::1], at: ssize, v: cython.const[i64][::1]) -> ssize:
    """Write ``v``'s values at ``o[at]`` (9 writable bytes a value); the end offset."""
    n: ssize = v.shape[0]
    i: ssize = 0
    t: cython.uint
    payload: u64
    size: ssize
    x: i64
    _k: ssize
    r: ssize
    while n - i >= 8:
        # every 8 values, a look for a run of one value (8 more equal to the
        # previous one): its encoding written again while it lasts
        if i > 0 and v[i] == v[i - 1]:
            x = v[i - 1]
            # the run's end: the first r with v[r] != v[r - 1], i.e. where v from 1
            # on first differs from v itself
            r = 1 + _same_until(v[1:n], v[: n - 1], i - 1)  # no negative index: wraparound off
            if r - i >= 8:
                t, payload, size = _form(x)
                if r - i >= _LONG_RUN:
                    at = _repeat(o, at, t, payload, size, r - i)
                else:
                    for _k in range(r - i):
                        _put9(o, at, t, payload)
                        at += size
                i = r
                continue
        # eight values, unrolled by hand: GCC does not unroll a loop this long
        at = _put(o, at, v[i])
        at = _put(o, at, v[i + 1])
        at = _put(o, at, v[i + 2])
        at = _put(o, at, v[i + 3])
        at = _put(o, at, v[i + 4])
        at = _put(o, at, v[i + 5])
        at = _put(o, at, v[i + 6])
        at = _put(o, at, v[i + 7])
        i += 8
    while i < n:
        at = _put(o, at, v[i])
        i += 1
    return at


@cython.cfunc
@cython.inline
def encoded_bound(n: ssize) -> ssize:
    """The most bytes an array of ``n`` ints takes: a 5-byte header, then 9 bytes a
    value (what every encoder here sizes its output for, and checks room against).
    Compiled it is no entry point (``n`` is a length here); interpreted, the one
    :mod:`mmadmit.intcodec` and the wire codec call."""
    return 5 + 9 * n


@cython.cfunc
@cython.inline
def _put_header(o: u8[::1], n: ssize) -> ssize:
    """The smallest array header of ``n`` elements at ``o[0]``; its length."""
    if n < 16:
        o[0] = 0x90 | n
        return 1
    if n <= 0xFFFF:
        o[0], o[1], o[2] = 0xDC, n >> 8, n & 0xFF
        return 3
    o[0], o[1], o[2], o[3], o[4] = 0xDD, n >> 24, (n >> 16) & 0xFF, (n >> 8) & 0xFF, n & 0xFF
    return 5


def encode(v: cython.const[i64][::1]) -> memoryview:
    """The msgpack array of ``v``'s values, each in its smallest form: byte for
    byte what ``msgpack.packb(list_of_ints)`` writes, as a read-only-by-contract
    view of a fresh buffer. ValueError above the array32 limit."""
    n: ssize = v.shape[0]
    if n > MAX_ARRAY_COUNT:
        raise ValueError(f"{_INT}{n} elements exceed the array32 limit")
    buf = np.empty(encoded_bound(n), dtype=np.uint8)
    o: u8[::1] = buf
    at: ssize = _put_header(o, n)
    if n >= _GIL_MIN:
        with cython.nogil:
            at = _write_ints(o, at, v)
    else:
        at = _write_ints(o, at, v)
    # A view of the used part: no copy (the C encoder shrank a bytes in place; a
    # Cython module cannot, and copying into one cost 15 us of 46 at 128K ids).
    # Callers hand it to msgspec.Raw or compare it with bytes; both take a view.
    return memoryview(buf)[:at]


@cython.cfunc
@cython.inline
def _marks_len(n: ssize) -> ssize:
    """How many marks an array of ``n`` elements has (one every 64 elements)."""
    return (n + 63) >> _MARK_SHIFT


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _seek(
    p: cython.const[u8][::1], h: ssize, mk: cython.const[i64][::1], ci: ssize, cpos: ssize, t: ssize
) -> tuple[ssize, ssize]:
    """The cursor (element ``ci`` starts at ``p[cpos]``) moved to element ``t >= ci``:
    from the last mark at or before ``t`` when it is ahead of the cursor, then
    element by element. ``(t, where element t starts)``, ``(-1, -1)`` when the
    bytes or the marks do not hold up (a position outside the elements, not an
    int). Element ``t == count`` starts where the array ends."""
    end: ssize = p.shape[0]
    w: ssize
    m: ssize = min(t >> _MARK_SHIFT, mk.shape[0] - 1)  # the last mark at or before t
    if ci < 0 or cpos < 0:
        return -1, -1
    if m > (ci >> _MARK_SHIFT):  # ahead of the cursor
        ci = m << _MARK_SHIFT
        cpos = h + mk[m]
    if cpos < h or cpos > end:
        return -1, -1
    while ci < t:
        if cpos >= end:
            return -1, -1
        w = _int_width(p[cpos])
        if w < 0 or end - cpos < 1 + w:
            return -1, -1
        cpos += 1 + w
        ci += 1
    return ci, cpos


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
def _copy_received(
    o: u8[::1],
    at: ssize,
    p: cython.const[u8][::1],
    h: ssize,
    mk: cython.const[i64][::1],
    ci: ssize,
    cpos: ssize,
    i: ssize,
    j: ssize,
) -> tuple[ssize, ssize, ssize]:
    """Elements ``i`` to ``j - 1`` (``i < j``, the cursor at or before ``i``: element
    ``ci`` starts at ``p[cpos]``) copied from their received bytes to ``o[at]``:
    ``(end offset, ci, cpos)`` with the cursor moved to ``j``; an end offset of -1
    if ``p`` (its elements from ``p[h]``) and the marks ``mk`` do not hold up."""
    a: ssize
    b: ssize
    ci, a = _seek(p, h, mk, ci, cpos, i)
    ci, b = _seek(p, h, mk, ci, a, j)
    # marks that lie may put a and b anywhere in p: never more bytes than j - i
    # ints can take (what the output was sized for)
    if a < 0 or b < a or b - a > 9 * (j - i):
        return -1, ci, cpos
    _copy(o, at, p, a, b - a)
    return at + b - a, ci, b


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _write_filled(
    o: u8[::1],
    at: ssize,
    p: cython.const[u8][::1],
    h: ssize,
    n: ssize,
    mk: cython.const[i64][::1],
    starts: cython.const[i64][::1],
    stops: cython.const[i64][::1],
    fill: cython.const[i64][::1],
) -> ssize:
    """:func:`encode_filled`'s ``n`` elements from ``o[at]``: the end offset; -1 if
    the spans are not sorted, disjoint and inside the array; -2 if ``p`` (its
    elements from ``p[h]``) and ``mk`` do not hold up."""
    count: ssize = starts.shape[0]
    k: ssize
    s: ssize
    e: ssize
    i: ssize = 0  # the elements before i are written
    ci: ssize = 0  # the cursor: element ci starts at p[cpos]; it only moves forward
    cpos: ssize = h
    t: cython.uint
    payload: u64
    size: ssize
    for k in range(count + 1):
        if k < count:
            s, e = starts[k], stops[k]
            if s < i or e < s or e > n:
                return -1
        else:
            s, e = n, n
        if s > i:  # elements i..s-1 unchanged: their received bytes
            at, ci, cpos = _copy_received(o, at, p, h, mk, ci, cpos, i, s)
            if at < 0:
                return -2
        if e > s:  # the span: one value, its smallest form repeated
            t, payload, size = _form(fill[k])
            at = _repeat(o, at, t, payload, size, e - s)
        i = e
    return at


def encode_filled(
    raw: cython.const[u8][::1],
    marks: cython.const[i64][::1],
    starts: cython.const[i64][::1],
    stops: cython.const[i64][::1],
    fill: cython.const[i64][::1],
    out: object = None,
    start: ssize = 0,
) -> memoryview:
    """:func:`encode` of the array decoded from ``raw`` (with ``marks``, see
    :func:`decode_marked`) with ``[starts[k], stops[k])`` set to ``fill[k]``,
    written from the bytes alone: the elements outside the spans are ``raw``'s
    bytes for them, copied, each span its value's smallest form repeated. No
    int array is read or compared; the spans (sorted, disjoint, inside the
    array) say what changed. That is :func:`encode` of the filled array
    whenever ``raw`` holds smallest forms (what msgpack encoders write), and
    always the same values. ValueError for spans that are not sorted,
    disjoint and inside the array, and for bytes and marks that do not belong
    together.

    With ``out`` (a writable byte buffer) the array is written into it from
    offset ``start`` instead of a fresh buffer (the reply payload, written in
    place), and the view of what was written is returned; ValueError, before
    anything is written, unless ``out`` has room from ``start`` for the header
    and 9 bytes a value (what the array may take). After any other ValueError
    what was written into ``out`` means nothing."""
    count: ssize
    h: ssize
    count, h = _int_header(raw)
    k: ssize = starts.shape[0]
    if stops.shape[0] != k or fill.shape[0] != k:
        raise ValueError(f"{_INT}encode_filled: starts, stops and fill differ in length")
    if marks.shape[0] != _marks_len(count):
        raise ValueError(f"{_INT}encode_filled: the bytes and marks do not match")
    need: ssize = encoded_bound(count)
    if out is None:
        out = np.empty(need, dtype=np.uint8)
        start = 0
    o: u8[::1] = out
    if start < 0 or start > o.shape[0] or o.shape[0] - start < need:
        raise ValueError(
            f"{_INT}encode_filled: the output has no room for {need} bytes from offset {start}"
        )
    at: ssize = start + _put_header(o[start:], count)
    if count >= _GIL_MIN:
        with cython.nogil:
            at = _write_filled(o, at, raw, h, count, marks, starts, stops, fill)
    else:
        at = _write_filled(o, at, raw, h, count, marks, starts, stops, fill)
    if at == -1:
        raise ValueError(f"{_INT}encode_filled: the spans are not sorted, disjoint and inside")
    if at < 0:
        raise ValueError(f"{_INT}encode_filled: the bytes are not those of an int array")
    return memoryview(out)[start:at]


# --------------------------------------------------------------------------
# Structure walks: split, check_structure, int_rows.
#
# One counter holds the values still to be skipped (an array header adds its
# count, a map header twice its count). Every length is checked against the
# bytes left before it is used, and the pending count is kept below the bytes
# left (each value takes one byte at least), so a forged header fails at once
# instead of making the walk run long. Only the structure is checked; the
# values are validated by whoever decodes them.


def _split_error(
    kind: cython.int, element: ssize, p: cython.const[u8][::1], end: ssize, pos: ssize, need: u64
) -> ValueError:
    """The ValueError of a malformed message: ``kind`` what, at ``p[pos]``, inside
    top-level ``element``; ``need`` the bytes (_S_TRUNC) or values (_S_PENDING)."""
    if kind == _S_END:
        return ValueError(
            f"msgpack: truncated input: element {element}: input ends at "
            f"offset {pos} where a value is expected"
        )
    if kind == _S_PENDING:
        return ValueError(
            f"msgpack: truncated input: element {element}: {need} more values "
            f"announced at offset {pos} but only {end - pos} bytes left"
        )
    if kind == _S_COUNT:
        return ValueError(
            f"msgpack: truncated input: the array header declares {need} "
            f"elements but only {end - pos} bytes follow"
        )
    b: cython.uint = p[pos]
    if kind == _S_BYTE:
        return ValueError(
            f"msgpack: element {element}: invalid type byte 0x{b:02x} at offset {pos}"
        )
    return ValueError(
        f"msgpack: truncated input: element {element}: the {_type_name(b)} at offset {pos} "
        f"(type byte 0x{b:02x}) needs {need} bytes, only {end - pos} left"
    )


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _head(p: cython.const[u8][::1], end: ssize, pos: ssize) -> tuple[ssize, ssize, cython.int]:
    """The head of the value at ``p[pos]`` (``pos < end``, not a fixint).

    ``(size, children, container)``: its size with its children excluded, the
    values that follow as its children (a map: two per entry), and 0, 1 (an
    array) or 2 (a map). ``(-1, need, _S_TRUNC)`` for a value cut short,
    ``(-1, 0, _S_BYTE)`` for the byte 0xc1."""
    b: cython.uint = p[pos]
    size: ssize = 1
    lw: ssize = 0  # width of a length field after the type byte
    ext: ssize = 0  # ext: the type code byte after the length
    container: cython.int = 0
    m: ssize
    if b <= 0x8F:  # fixmap (fixints are the caller's)
        return 1, 2 * (b & 0x0F), 2
    if b <= 0x9F:  # fixarray
        return 1, b & 0x0F, 1
    if b <= 0xBF:  # fixstr
        size = 1 + (b & 0x1F)
    elif b == 0xC1:
        return -1, 0, _S_BYTE
    elif b == 0xC0 or b == 0xC2 or b == 0xC3:  # nil, bool
        size = 1
    elif b == 0xC4 or b == 0xD9:  # bin8, str8
        lw = 1
    elif b == 0xC5 or b == 0xDA:  # bin16, str16
        lw = 2
    elif b == 0xC6 or b == 0xDB:  # bin32, str32
        lw = 4
    elif 0xC7 <= b <= 0xC9:  # ext8, ext16, ext32
        lw = 1 << (b - 0xC7)
        ext = 1
    elif b == 0xCA:  # float32
        size = 5
    elif b == 0xCB:  # float64
        size = 9
    elif 0xCC <= b <= 0xD3:  # uint8..64, int8..64
        size = 1 + (1 << (b & 3))
    elif 0xD4 <= b <= 0xD8:  # fixext 1, 2, 4, 8, 16
        size = 2 + (1 << (b - 0xD4))
    else:  # 0xdc..0xdf: array16, array32, map16, map32
        lw = 2 if (b & 1) == 0 else 4
        container = 1 if b <= 0xDD else 2
    if lw:
        if end - pos < 1 + lw:
            return -1, 1 + lw, _S_TRUNC
        m = cython.cast(ssize, _load(p, pos + 1, lw))
        if container:
            return 1 + lw, m * container, container
        size = 1 + lw + ext + m
    if size > end - pos:
        return -1, size, _S_TRUNC
    return size, 0, 0


@cython.cfunc
@cython.exceptval(-1, check=True)
@cython.boundscheck(False)
@cython.wraparound(False)
def _skip(p: cython.const[u8][::1], end: ssize, pos: ssize, n: ssize, element: ssize) -> ssize:
    """Skip ``n`` values from ``p[pos]``; where they end (ValueError if malformed)."""
    pending: ssize = n
    b: cython.uint
    size: ssize
    children: ssize
    kind: cython.int
    while pending:
        if pos >= end:
            raise _split_error(_S_END, element, p, end, pos, 0)
        b = p[pos]
        pending -= 1
        if b <= 0x7F or b >= 0xE0:  # fixint
            pos += 1
            continue
        size, children, kind = _head(p, end, pos)
        if size < 0:
            raise _split_error(kind, element, p, end, pos, children)
        pos += size
        pending += children
        if pending > end - pos:
            raise _split_error(_S_PENDING, element, p, end, pos, pending)
    return pos


@cython.cfunc
@cython.exceptval(-3, check=True)
def _array_at(p: cython.const[u8][::1], end: ssize, pos: ssize, element: ssize) -> ssize:
    """The count of the array header at ``p[pos]``, -1 if it is not one
    (ValueError for a cut header or a count over the bytes that follow)."""
    count: ssize
    h: ssize
    if pos >= end:
        raise _split_error(_S_END, element, p, end, pos, 0)
    count, h = _array_head(p, end, pos)
    if count == -2:
        raise _split_error(_S_TRUNC, element, p, end, pos, h)
    if count > end - pos - h:
        raise _split_error(_S_PENDING, element, p, end, pos + h, count)
    return count


@cython.cfunc
@cython.inline
def _head_len(p: cython.const[u8][::1], pos: ssize) -> ssize:
    """The length of the array header at ``p[pos]`` (one checked by _array_at)."""
    b: cython.uint = p[pos]
    return 1 if b <= 0x9F else (3 if b == 0xDC else 5)


def _top(p: cython.const[u8][::1]) -> ssize:
    """The element count of the array that must fill ``p``."""
    n: ssize = p.shape[0]
    count: ssize
    h: ssize
    if n < 1:
        raise ValueError("msgpack: truncated input: empty buffer")
    count, h = _array_head(p, n, 0)
    if count == -1:
        b: cython.uint = p[0]
        raise ValueError(f"msgpack: expected an array, got {_type_name(b)} (type byte 0x{b:02x})")
    if count == -2:
        raise _split_error(_S_TRUNC, -1, p, n, 0, h)
    if count > n - h:
        raise _split_error(_S_COUNT, -1, p, n, h, count)
    return count


def _trailing(p: cython.const[u8][::1], pos: ssize) -> ValueError:
    n: ssize = p.shape[0]
    return ValueError(f"msgpack: {n - pos} trailing bytes after the array (at offset {pos})")


@cython.cfunc
def _index_mask(indices: tuple) -> u64:
    """Bit ``i`` set for each index ``0 <= i < 63`` in ``indices``; bit 63 set when
    ``indices`` holds any other value (then :func:`_in_mask` asks the tuple)."""
    mask: u64 = 0
    for x in indices:
        if type(x) is int and 0 <= x < 63:
            mask |= cython.cast(u64, 1) << cython.cast(cython.int, x)
        else:
            mask |= cython.cast(u64, 1) << 63
    return mask


@cython.cfunc
@cython.inline
def _in_mask(mask: u64, i: ssize, indices: tuple) -> cython.bint:
    """Whether element ``i`` is in ``indices`` (``mask`` its :func:`_index_mask`)."""
    if not mask >> 63:  # every index is below 63
        return i < 63 and (mask >> i) & 1 != 0
    return i in indices


def split(
    p: cython.const[u8][::1],
    int_fields: tuple,
    max_ints: ssize,
    marks: list | None = None,
) -> tuple:
    """Element boundaries of the one array filling ``p``, int arrays decoded on the way.

    ``(offsets, ints)``: ``n + 1`` offsets (element ``i`` is
    ``p[offsets[i]:offsets[i + 1]]``) and, per ``int_fields`` entry, that
    element as a new int64 array, None when it is missing, or, when it is not
    an array of int64-range ints, why not (the message :func:`decode` gives
    for its bytes). :class:`IntArrayTooLong` for an ``int_fields``
    element declaring more than ``max_ints`` (``-1``: no bound) elements,
    from its header; ValueError for a malformed message (that error, not the
    int field's, when both are wrong). With
    ``marks`` (a list as long as ``int_fields``), each decoded array's
    :func:`encode_filled` marks are put at its index.
    """
    n: ssize = p.shape[0]
    count: ssize = _top(p)
    pos: ssize = _head_len(p, 0)
    offsets: list = []
    ints: list = [None] * len(int_fields)
    i: ssize
    k: ssize
    m: ssize
    h: ssize
    kind: cython.int
    at: ssize
    end: ssize
    value: u64
    out: i64[::1]
    mk: i64[::1]
    picked: u64 = _index_mask(int_fields)
    for i in range(count):
        offsets.append(pos)
        if _in_mask(picked, i, int_fields):
            k = int_fields.index(i)
            m = _array_at(p, n, pos, i)
            if 0 <= max_ints < m:
                raise IntArrayTooLong(i, m, max_ints)
            if m < 0:
                ints[k] = _not_an_array(p[pos])
            else:
                arr = np.empty(m, dtype=np.int64)
                out = arr
                mka = _NO_MARKS if marks is None else np.empty(_marks_len(m), dtype=np.int64)
                mk = mka
                h = _head_len(p, pos)
                kind, at, end, value = _decode_ints(p, n, pos + h, m, out, 0, mk)
                if kind == _OK:
                    ints[k] = arr
                    if marks is not None:
                        marks[k] = mka
                    pos = end
                    continue
                # worded as decode words the element's own bytes (a cut element makes
                # the walk below fail first)
                ints[k] = _int_error(p[pos:], kind, at, end - pos, value)
        pos = _skip(p, n, pos, 1, i)
    if pos != n:
        raise _trailing(p, pos)
    offsets.append(pos)
    return offsets, ints


def element_span(p: cython.const[u8][::1], index: ssize) -> tuple:
    """``(start, end)`` of element ``index`` of the one array filling ``p``: the
    whole array walked as :func:`split` walks it (its structure checked, any
    depth), but nothing allocated for its elements. ValueError as :func:`split`,
    or where the array has no element ``index``."""
    n: ssize = p.shape[0]
    count: ssize = _top(p)
    if not 0 <= index < count:
        raise ValueError(f"msgpack: the array of {count} elements has no element {index}")
    start: ssize = _skip(p, n, _head_len(p, 0), index, 0)
    end: ssize = _skip(p, n, start, 1, index)
    pos: ssize = _skip(p, n, end, count - index - 1, index + 1)
    if pos != n:
        raise _trailing(p, pos)
    return start, end


@cython.cfunc
@cython.exceptval(-2, check=True)
@cython.boundscheck(False)
@cython.wraparound(False)
def _walk_limits(
    p: cython.const[u8][::1],
    end: ssize,
    pos: ssize,
    element: ssize,
    max_depth: cython.int,
    max_len: u64,
    breach: list,
    odd: list,
) -> ssize:
    """Walk the one value at ``p[pos]`` (inside the top array: depth 1) against the
    limits; where it ends, or -1 with the breach appended to ``breach``
    (ValueError if malformed). One counter per open container, and no container
    deeper than ``max_depth`` is ever opened. ``element`` is appended to ``odd``
    (once) if the value holds a str, a map or an ext, or nests deeper than
    ``PLAIN_DEPTH`` (see :func:`check_structure`)."""
    pending = cython.declare(ssize[1024])  # values left in each open level: MAX_DEPTH
    top: cython.int = 0  # level 0: the value itself
    b: cython.uint
    size: ssize
    children: ssize
    container: cython.int
    entries: ssize
    plain: cython.bint = True
    pending[0] = 1
    while True:
        while pending[top] == 0:
            if top == 0:
                return pos
            top -= 1
        if pos >= end:
            raise _split_error(_S_END, element, p, end, pos, 0)
        pending[top] -= 1
        b = p[pos]
        if b <= 0x7F or b >= 0xE0:  # fixint
            pos += 1
            continue
        if plain and (
            b <= 0x8F  # fixmap
            or 0xA0 <= b <= 0xBF  # fixstr
            or 0xC7 <= b <= 0xC9  # ext
            or 0xD4 <= b <= 0xDB  # fixext, str
            or b >= 0xDE  # map16, map32
            or top >= _PLAIN_DEPTH
        ):
            plain = False
            odd.append(element)
        size, children, container = _head(p, end, pos)
        if size < 0:
            raise _split_error(container, element, p, end, pos, children)
        pos += size
        if not container:
            continue
        entries = children // 2 if container == 2 else children
        if cython.cast(u64, entries) > max_len:
            breach += [container, element, entries]
            return -1
        if top + 2 > max_depth:  # this container sits inside 1 + top others
            breach += [3, element, top + 2]
            return -1
        if children > end - pos:
            raise _split_error(_S_PENDING, element, p, end, pos, children)
        if children:
            top += 1  # top + 1 <= max_depth - 1 < _DEPTH_CAP
            pending[top] = children


def check_structure(
    p: cython.const[u8][::1],
    offsets: list,
    skip: tuple,
    max_depth: int,
    max_len: int,
    odd: list | None = None,
) -> tuple | None:
    """Walk the elements at :func:`split`'s ``offsets`` not in ``skip`` against a
    nesting depth (the array itself: 1) and a container length limit.

    None, or the first breach ``(kind, element, value)``: kind 1 (array) or 2
    (map) with its length, 3 (depth) with the depth reached. ValueError for
    limits out of range and for offsets that do not split ``p`` into values.

    ``odd`` (a list) gets, in order, every walked element, up to a breach, that
    is not made of nil, bools, ints, floats, bins and arrays of them nesting at
    most ``PLAIN_DEPTH`` levels: the values whose decoding can refuse them (an
    ext, a str's UTF-8, a map's keys, msgspec's recursion), which a caller
    decodes for that check; the others always decode."""
    if odd is None:
        odd = []
    if not 1 <= max_depth <= MAX_DEPTH or max_len < 0:
        raise ValueError(f"check_structure: max_depth must be 1..{MAX_DEPTH}, max_len >= 0")
    if len(skip) > 8:
        raise ValueError("check_structure: at most 8 skipped elements")
    n: ssize = p.shape[0]
    depth: cython.int = max_depth
    limit: u64 = max_len
    i: ssize
    start: ssize
    end: ssize
    pos: ssize
    breach: list = []
    skipped: u64 = _index_mask(skip)
    for i in range(len(offsets) - 1):
        start, end = offsets[i], offsets[i + 1]
        if start < 0 or end < start or end > n:
            raise ValueError(f"check_structure: element {i} spans {start}..{end} of {n} bytes")
        if _in_mask(skipped, i, skip):
            continue
        pos = _walk_limits(p, end, start, i, depth, limit, breach, odd)
        if pos < 0:
            return tuple(breach)
        if pos != end:
            raise ValueError(
                f"check_structure: element {i} is not one value ({pos - start} of "
                f"{end - start} bytes)"
            )
    return None


def int_rows(p: cython.const[u8][::1], starts: list, width: ssize) -> tuple:
    """The arrays of ``width``-int rows (or nil) at ``starts`` in ``p``, in one table.

    ``(table, bounds)``: a new 1-D int64 array of every row in order, and per
    start its first and end row (``-1, -1`` for nil). :class:`RowsError` for
    any other value or a start outside ``p``, naming the first such start in
    ``starts``' order; ValueError for a width outside 1..15."""
    if not 1 <= width <= 15:
        raise ValueError("int_rows: width must be 1..15")
    n: ssize = p.shape[0]
    bounds: list = []
    at_of: list = []
    total: ssize = 0
    bad: ssize = -1  # the first start whose header pass 1 refuses
    bad_message: str = ""
    k: ssize = 0
    at: ssize
    rows: ssize
    r: ssize
    pos: ssize
    o: ssize
    kind: cython.int
    value: u64
    cells: ssize
    h: ssize
    # pass 1: the row count of each array (headers only), up to the first refused;
    # the rows before it are checked by pass 2 first (a start before it may be wrong
    # in its rows)
    for item in starts:
        at = item
        if at < 0 or at >= n:
            bad, bad_message = len(at_of), f"int_rows: start {at} outside the input"
            break
        if p[at] == 0xC0:
            at_of.append(at)
            bounds += [-1, -1]
            continue
        rows, _ = _array_head(p, n, at)
        if rows < 0 or rows > n - at - _head_len(p, at):
            bad = len(at_of)
            bad_message = f"int_rows: the value at offset {at} is not an array of rows"
            break
        at_of.append(at)
        bounds += [total, total + rows]
        total += rows
    table = np.empty(total * width, dtype=np.int64)
    out: i64[::1] = table
    nomk: i64[::1] = _NO_MARKS
    o = 0
    # pass 2: every row, checked and decoded
    for k in range(len(at_of)):
        at = at_of[k]
        if p[at] == 0xC0:
            continue
        rows, _ = _array_head(p, n, at)
        pos = at + _head_len(p, at)
        for r in range(rows):
            if o + width > total * width:  # pragma: no cover - pass 1 counted them
                raise ValueError("int_rows: the input changed")
            cells, h = -1, 0
            if pos < n:
                cells, h = _array_head(p, n, pos)
            if cells != width or cells > n - pos - h:
                raise RowsError(
                    f"int_rows: row {r} of the array at offset {at} is not an array of "
                    f"{width} ints",
                    k,
                )
            kind, _, pos, value = _ints(p, n, pos + h, width, out, o, nomk)
            if kind != _OK:
                raise RowsError(
                    f"int_rows: row {r} of the array at offset {at} is not an array "
                    f"of {width} int64 values",
                    k,
                )
            o += width
    if bad >= 0:
        raise RowsError(bad_message, bad)
    return table, bounds


# --------------------------------------------------------------------------
# Multimodal items: one walk that builds them and words every refusal.
#
# build_items takes every legal MultimodalDataItem (docs/spec/WIRE.md,
# "MultimodalDataItem (untagged)"; at least one element). The common form (ints,
# nils, tensors ``[str, [int, ...], int | ext 3]``) is read straight from the bytes.
# Any other value of an element (a flag among the side values, a feature_shm map,
# an encode_handshake map, encoded data, a newer peer's trailing fields, a tensor
# of another form) is decoded once by the caller's ``value`` (every ext code but 3
# refused) and, for a tensor, built by its ``loose_tensor``, which words what is
# wrong with it. A refusal is an InvalidRequest (Tensor's TooLarge for a limit)
# naming the item and its field, a type in msgspec's words ("item 1: hash:
# Expected `int | null`, got `str`").
# tests/wire_oracle.py holds the reference these builds are compared with.

_ITEM_ELEMS = cython.declare(ssize, 10)


@cython.cfunc
def _bytes_at(p: cython.const[u8][::1], at: ssize, m: ssize) -> bytes:
    """``bytes(p[at:at + m])`` (the caller has checked they are there); compiled,
    straight from the buffer, without a memoryview slice in between."""
    out: bytes = b""
    if m == 0:
        pass
    elif cython.compiled:
        out = cython.cast(cython.p_char, cython.address(p[at]))[:m]
    else:
        out = bytes(p[at : at + m])
    return out


@cython.cclass
class _At:
    """Where :func:`_build_items` reads next. The helpers that read one value
    (``_int_at``, ``_opt_int_at``, ``_side_key_at``, ``_tensor_at``) move it past
    that value and return the value itself, or ``_BAD`` if the bytes there are
    not of its form: no ``(value, end)`` tuple is made for every value read."""

    pos: ssize

    def __init__(self, pos: ssize) -> None:
        self.pos = pos


_BAD = cython.declare(object, object())  # a helper's "not of this form" (None is nil)


@cython.cfunc
def _int_at(p: cython.const[u8][::1], n: ssize, at: _At) -> object:
    """The msgpack int at ``p[at.pos]`` (``at`` moved past it), ``_BAD`` if it is not one."""
    pos: ssize = at.pos
    if pos >= n:
        return _BAD
    b: cython.uint = p[pos]
    w: ssize = _int_width(b)
    if w < 0 or n - pos < 1 + w:
        return _BAD
    u: u64 = _load(p, pos + 1, w) if w else 0
    at.pos = pos + 1 + w
    if b == 0xCF:
        return u  # uint64: the value as it is (a hash may need all 64 bits)
    return _int_value(b, u)


@cython.cfunc
def _str_span(p: cython.const[u8][::1], n: ssize, pos: ssize) -> tuple[ssize, ssize]:
    """``(start, length)`` of the bytes of the msgpack str at ``p[pos]``, ``(-1, 0)``
    if it is not one (or is cut short)."""
    if pos >= n:
        return -1, 0
    b: cython.uint = p[pos]
    h: ssize
    m: ssize
    if 0xA0 <= b <= 0xBF:
        h, m = 1, b & 0x1F
    elif 0xD9 <= b <= 0xDB:
        h = 1 + (1 << (b - 0xD9))
        if n - pos < h:
            return -1, 0
        m = cython.cast(ssize, _load(p, pos + 1, h - 1))
    else:
        return -1, 0
    if m > n - pos - h:
        return -1, 0
    return pos + h, m


# The names the tensors built are given (``(item index, key)``, what a message
# names them by), made once per index and key: a tensor of item i gets the same
# tuple every time. A side key is looked up by its bytes among the keys seen (a
# bounded number, first come) and is the str made when it was first seen, its
# hash kept; past the bounds (an index, a key) a name is made as before.
_NAMED = cython.declare(ssize, 256)  # the item indexes with a kept name


@cython.cfunc
def _names_of(key: str) -> tuple:
    """The names of ``key``'s tensors for the item indexes below ``_NAMED``."""
    return tuple([(i, key) for i in range(_NAMED)])


_FEATURE_NAMES = cython.declare(tuple, _names_of("feature"))
_SIDE_KEYS = cython.declare(list, [])  # (key bytes, key str, its names by index)
_SIDE_KEYS_MAX = cython.declare(ssize, 16)


@cython.cfunc
def _name(names: tuple | None, i: ssize, key: str) -> tuple:
    """Item ``i``'s name for ``key``: kept in ``names`` (None: none kept), else made."""
    return names[i] if names is not None and i < _NAMED else (i, key)


@cython.cfunc
def _side_key_at(p: cython.const[u8][::1], n: ssize, at: _At) -> object:
    """``(key bytes, key, names)`` of the msgpack str at ``p[at.pos]`` (UTF-8
    checked; ``at`` moved past it): the key's str and the names of its tensors by
    item index (None: made as needed); ``_BAD`` if it is not a str. A key seen
    before is its kept entry, made once."""
    start: ssize
    m: ssize
    start, m = _str_span(p, n, at.pos)
    if start < 0:
        return _BAD
    at.pos = start + m
    entry = _seen_at(_SIDE_KEYS, p, start, m)
    if entry is not None:
        return entry
    key = _bytes_at(p, start, m).decode("utf-8")
    if len(_SIDE_KEYS) < _SIDE_KEYS_MAX:
        entry = (_bytes_at(p, start, m), key, _names_of(key))
        _SIDE_KEYS.append(entry)
        return entry
    return None, key, None


# Tensor dtype names seen, with what they name: (the name's bytes, its DType).
# A tensor's dtype is then looked up by its bytes (no str made, no hash), and
# its check gets the DType. Only names parse_dtype takes are kept, a bounded
# number of them (a name past the bound is passed on as a str, resolved by the
# check as before).
_DTYPE_NAMES = cython.declare(list, [])
_DTYPE_NAMES_MAX = cython.declare(ssize, 16)


@cython.cfunc
@cython.boundscheck(False)
@cython.wraparound(False)
def _same_bytes(p: cython.const[u8][::1], at: ssize, key: bytes) -> cython.bint:
    """Whether ``p[at:at + len(key)]`` (there, the caller checked) is ``key``."""
    m: ssize = len(key)
    same: cython.bint
    if m == 0:
        same = True
    elif cython.compiled:
        same = memcmp(cython.address(p[at]), cython.cast(cython.p_const_char, key), m) == 0
    else:
        same = bytes(p[at : at + m]) == key
    return same


@cython.cfunc
def _seen_at(seen: list, p: cython.const[u8][::1], at: ssize, m: ssize) -> tuple:
    """The entry of ``seen`` (tuples whose first element is a name's bytes) for the
    ``m`` bytes at ``p[at]``, None if there is none."""
    entry: tuple
    for entry in seen:
        key: bytes = entry[0]
        if len(key) == m and _same_bytes(p, at, key):
            return entry
    return None


@cython.cfunc
def _dtype_named_at(p: cython.const[u8][::1], at: ssize, m: ssize) -> object:
    """The DType the ``m`` name bytes at ``p[at]`` name when that name was seen
    before, else the name as a str (remembered with its DType if it names one):
    the tensor check takes either, and words a name that names nothing."""
    entry = _seen_at(_DTYPE_NAMES, p, at, m)
    if entry is not None:
        return entry[1]
    text = _bytes_at(p, at, m).decode("utf-8")
    if len(_DTYPE_NAMES) < _DTYPE_NAMES_MAX:
        try:
            found = parse_dtype(text)
        except InvalidRequest:
            return text
        _DTYPE_NAMES.append((_bytes_at(p, at, m), found))
        return found
    return text


@cython.cfunc
def _dims_at(p: cython.const[u8][::1], n: ssize, at: _At, count: ssize) -> object:
    """``count`` msgpack ints from ``p[at.pos]`` as a tuple (``at`` moved past
    them), ``_BAD`` if one is not an int. Two (a feature's rows and width, a grid
    row) are read into the tuple straight, without a list."""
    a: object
    b: object
    _k: ssize
    if count == 2:
        a = _int_at(p, n, at)
        b = _BAD if a is _BAD else _int_at(p, n, at)
        return _BAD if b is _BAD else (a, b)
    dims: list = []
    for _k in range(count):
        a = _int_at(p, n, at)
        if a is _BAD:
            return _BAD
        dims.append(a)
    return tuple(dims)


@cython.cfunc
def _nil(p: cython.const[u8][::1], n: ssize, pos: ssize) -> cython.bint:
    return pos < n and p[pos] == 0xC0


@cython.cfunc
def _opt_int_at(p: cython.const[u8][::1], n: ssize, at: _At) -> object:
    """nil (None) or the int at ``p[at.pos]`` (``at`` moved past it), ``_BAD`` for
    anything else."""
    if _nil(p, n, at.pos):
        at.pos += 1
        return None
    return _int_at(p, n, at)


@cython.cfunc
def _tensor_at(
    p: cython.const[u8][::1], n: ssize, at: _At, env: tuple, name: tuple, roles: list
) -> object:
    """The tensor ``[str, [int, ...], int | ext 3]`` at ``p[at.pos]`` (``at`` moved
    past it), built by ``env``'s constructor on its aux frame (its index added to
    ``roles``) or its inline bytes; ``_BAD`` for any other value or an index
    that refers to no aux frame (Tensor's own refusals raise)."""
    count: ssize
    h: ssize
    pos: ssize = at.pos
    if pos >= n:
        return _BAD
    count, h = _array_head(p, n, pos)
    if count != 3:
        return _BAD
    start: ssize
    m: ssize
    start, m = _str_span(p, n, pos + h)
    if start < 0:
        return _BAD
    dtype = _dtype_named_at(p, start, m)
    pos = start + m
    if pos >= n:
        return _BAD
    count, h = _array_head(p, n, pos)
    if count < 0 or count > n - pos - h:
        return _BAD
    at.pos = pos + h
    shape = _dims_at(p, n, at, count)
    if shape is _BAD:
        return _BAD
    pos = at.pos
    if pos >= n:
        return _BAD
    b: cython.uint = p[pos]
    size: ssize
    if 0xD4 <= b <= 0xD8:  # fixext 1..16: code, then the bytes
        size, start = 1 << (b - 0xD4), pos + 2
    elif 0xC7 <= b <= 0xC9:  # ext 8/16/32: length, code, bytes
        h = 1 << (b - 0xC7)
        if n - pos < 2 + h:
            return _BAD
        size, start = cython.cast(ssize, _load(p, pos + 1, h)), pos + 2 + h
    else:  # an aux frame's index
        index = _int_at(p, n, at)
        aux: list = env[0]
        if index is _BAD or not 0 < index <= len(aux):
            return _BAD
        roles.append(index)
        return env[2](dtype, shape, aux[index - 1], name, env[1])
    if start > n or size > n - start or p[start - 1] != 3:  # ext code 3: tensor data
        return _BAD
    at.pos = start + size
    return env[2](dtype, shape, memoryview(_bytes_at(p, start, size)), name, env[1])


def build_items(
    p: cython.const[u8][::1],
    view: object,
    aux: list,
    limits: object,
    tensor: object,
    item: object,
    source: object,
    no_side: object,
    value: object,
    loose_tensor: object,
    shm: object,
) -> tuple:
    """The items of the mm_items array filling ``p`` (see above).

    ``(items, feature_aux, other_aux, offsets_at)``: per item ``item(modality, hash,
    pad_value, None, feature, feature_shm, side, source(view, aux, start, end,
    count, start of element 1, start of element 3, modality, feature, side copy
    or no_side), encode_handshake)``, its tensors of the common form
    ``tensor(dtype, shape, data, (index, key), limits)`` on ``aux[index - 1]`` or
    the inline bytes, any other ``loose_tensor(value, index, key, role)``; the
    aux indices the features and side tensors of the common form refer to;
    where each item's element 3 starts (-1: it has none; the offsets are the
    caller's, :func:`int_rows`). ``value(bytes, what)`` decodes any other
    element, ``shm(value, what)`` makes a feature_shm. The source's elements 1
    and 3 start where those elements of the item start (-1 both for an item of
    fewer than 3 elements)."""
    env: tuple = (aux, limits, tensor, item, source, no_side, value, loose_tensor, shm)
    n: ssize = p.shape[0]
    count: ssize
    i: ssize
    start: ssize
    pos: ssize
    k: ssize
    e: ssize
    _k: ssize
    off1: ssize
    off3: ssize
    keys: _At
    try:
        count = _top(p)
    except ValueError as exc:
        raise InvalidRequest(f"mm_items must be a msgpack array ({exc})") from exc
    at: _At = _At(_head_len(p, 0))
    items: list = []
    features: list = []
    others: list = []
    offsets_at: list = []
    i = 0
    try:
        for i in range(count):
            start = at.pos
            off1 = -1
            off3 = -1
            k = _array_at(p, n, start, i)
            if k < 0:
                raise _expected(i, "", "array", p, n, start)
            if k == 0:
                raise InvalidRequest(f"item {i}: Expected `array` of at least length 1, got 0")
            at.pos = start + _head_len(p, start)
            pos = at.pos
            modality = _int_at(p, n, at)  # 0 modality
            if modality is _BAD:
                raise _expected(i, "modality: ", "int", p, n, pos)
            hash_ = None
            pad = None
            if k >= 2:  # 1 hash
                pos = at.pos
                hash_ = _opt_int_at(p, n, at)
                if hash_ is _BAD:
                    raise _expected(i, "hash: ", "int | null", p, n, pos)
                if k >= 3:  # 2 pad_value
                    off1 = pos
                    pos = at.pos
                    pad = _opt_int_at(p, n, at)
                    if pad is _BAD:
                        raise _expected(i, "pad_value: ", "int | null", p, n, pos)
                    off3 = at.pos
            if k >= 4:  # 3 offsets: the caller's (int_rows)
                offsets_at.append(off3)
                at.pos = _skip(p, n, off3, 1, i)
            else:
                offsets_at.append(-1)
            feature = None  # 4 feature
            if k >= 5:
                if _nil(p, n, at.pos):
                    at.pos += 1
                else:
                    pos = at.pos
                    feature = _tensor_at(
                        p, n, at, env, _name(_FEATURE_NAMES, i, "feature"), features
                    )
                    if feature is _BAD:  # another form: decoded, then built or worded
                        at.pos = pos
                        loose = _other(p, n, view, env, at, i, f"item {i} feature")
                        feature = env[7](loose, i, "feature", "feature")
            shm = None  # 5 feature_shm
            if k >= 6:
                if _nil(p, n, at.pos):
                    at.pos += 1
                else:
                    shm = env[8](_other(p, n, view, env, at, i, f"item {i}"), f"item {i}")
            side: dict = {}  # 6 model_specific_data
            if k >= 7:
                if _nil(p, n, at.pos):
                    at.pos += 1
                else:
                    e = _map_at(p, n, at, i, "model_specific_data")
                    for _k in range(e):
                        pos = at.pos
                        entry = _side_key_at(p, n, at)
                        if entry is _BAD:
                            raise _expected(i, "model_specific_data: a key: ", "str", p, n, pos)
                        key = entry[1]
                        if key in side:  # no encoder writes one: refused, not a value picked
                            raise InvalidRequest(
                                f"item {i}: model_specific_data: the key {key!r} is repeated"
                            )
                        pos = at.pos
                        t = _tensor_at(p, n, at, env, _name(entry[2], i, key), others)
                        if t is _BAD:  # a flag or any other value, or a tensor of another form
                            at.pos = pos
                            t = _other(p, n, view, env, at, i, f"item {i} {key}")
                            if _is_tensor_form(t):
                                t = env[7](t, i, key, "side")
                        side[key] = t
            for _k in range(7, min(k, 9)):  # 7 encoded, 8 encoded_deepstack: checked, not kept
                if _nil(p, n, at.pos):
                    at.pos += 1
                else:
                    _other(p, n, view, env, at, i, f"item {i}")
            handshake = None  # 9 encode_handshake: nil or a map of str keys, kept as decoded
            if k >= 10:
                if _nil(p, n, at.pos):
                    at.pos += 1
                else:
                    keys = _At(at.pos)
                    e = _map_at(p, n, keys, i, "encode_handshake")
                    for _k in range(e):
                        if _str_span(p, n, keys.pos)[0] < 0:
                            raise _expected(i, "encode_handshake: a key: ", "str", p, n, keys.pos)
                        keys.pos = _skip(p, n, keys.pos, 2, i)
                    handshake = _other(p, n, view, env, at, i, f"item {i}")
            for _k in range(_ITEM_ELEMS, k):  # a newer peer's fields: checked, kept as bytes
                _other(p, n, view, env, at, i, f"item {i}")
            src = env[4](
                view, env[0], start, at.pos, k, off1, off3, modality, feature,
                side.copy() if side else env[5],
            )  # fmt: skip
            if handshake is None:  # left to its default (passing it costs 0.1 us an item)
                items.append(env[3](modality, hash_, pad, None, feature, shm, side, src))
            else:
                items.append(env[3](modality, hash_, pad, None, feature, shm, side, src, handshake))
    except ValueError as exc:  # bytes cut short (a direct call), a str not UTF-8
        raise InvalidRequest(f"item {i}: undecodable msgpack ({exc})") from exc
    if at.pos != n:
        raise InvalidRequest(f"mm_items must be a msgpack array ({_trailing(p, at.pos)})")
    return items, features, others, offsets_at


# --------------------------------------------------------------------------
# A whole ADD payload: one call


_ADD_INTS = (F_INPUT_IDS, F_UNPADDED)  # the token arrays, decoded by the split
_ADD_DECODED = cython.declare(frozenset, frozenset((0, F_RID, F_INPUT_IDS, F_UNPADDED, F_MM)))
_ADD_NAMES = cython.declare(
    dict, {F_INPUT_IDS: "input_ids", F_UNPADDED: "input_ids_unpadded", F_MM: "multimodal_inputs"}
)


def _element_name(i: ssize) -> str:
    name = _ADD_NAMES.get(i)
    return f"element {i}" if name is None else f"element {i} ({name})"


def _ids(got: object, what: str) -> object:
    """A token array of the split, or the refusal its message words."""
    if isinstance(got, np.ndarray):
        return got
    raise InvalidRequest(f"{what} must be an array of integers ({got})")


def decode_add(
    p: cython.const[u8][::1],
    view: object,
    limits: object,
    marks: list,
    env: tuple,
    refusal: object,
) -> tuple:
    """Everything of the ADD payload filling ``p`` (``view``: the same bytes as a
    Python buffer) that is walked or built, in one call, refusals worded as it
    goes, in this order (the first fault found is the one refused):

    1. the payload's length from its header, then :func:`split` with the token
       arrays (``input_ids``, ``input_ids_unpadded``) decoded on the way, each
       bounded by ``limits.max_tokens`` from its header (``marks`` gets their
       marks); then every other element's nesting depth and container lengths
       (:func:`check_structure`), headers only;
    2. the tag and the rid (``value(bytes, what)`` decodes them);
    3. once the rid is known (a refusal is then ``refusal(message, rid, code)``):
       every element holding a str, a map or an ext decoded once for its check,
       the token arrays (or why they are not), and ``multimodal_inputs``: its
       elements, the item count from its header (``limits.max_items``), the
       items (:func:`build_items`, with ``env``: its arguments after
       ``limits``) and their offsets in one :func:`int_rows` table.

    Returns ``(offsets, ints, rid, mm)``: :func:`split`'s offsets and int arrays,
    and for a non-nil ``multimodal_inputs`` ``(its element offsets, items,
    feature aux indices, other aux indices)`` (None otherwise); the caller
    decodes the small values left (``multimodal_inputs``' scalars,
    ``validation_error``)."""
    n: ssize = p.shape[0]
    value: object = env[5]
    count: ssize
    try:  # the length from the header (an unreadable one: the split words it)
        count = array_len(p)
    except ValueError:
        count = -1
    if count > limits.max_msgpack_len:
        raise msgpack_len_over(
            "the payload", count, "elements", limits.max_msgpack_len, container="an array of "
        )
    try:
        offsets, ints = split(p, _ADD_INTS, limits.max_tokens, marks)
    except IntArrayTooLong as exc:
        name = _ADD_NAMES.get(exc.element, f"element {exc.element}")
        raise tokens_over(name, exc.count, exc.limit) from exc
    except ValueError as exc:
        raise InvalidRequest(f"the payload must be a msgpack array ({exc})") from exc
    odd: list = []  # the elements whose decoding can refuse them
    breach = check_structure(
        p, offsets, _ADD_INTS, limits.max_msgpack_depth, limits.max_msgpack_len, odd
    )
    if breach is not None:
        where = _element_name(breach[1])
        if breach[0] == 3:
            raise depth_over(where, breach[2], limits.max_msgpack_depth)
        if breach[0] == 1:
            raise msgpack_len_over(
                where, breach[2], "elements", limits.max_msgpack_len, container="an array of "
            )
        raise msgpack_len_over(
            where, breach[2], "entries", limits.max_msgpack_len, container="a map of "
        )
    k: ssize = len(offsets) - 1
    if k == 0:
        raise InvalidRequest("the payload is an empty array")
    tag = value(view[offsets[0] : offsets[1]], "tag")
    if tag != TAG:
        raise InvalidRequest(f"payload tag must be {TAG!r}, got {tag!r}")
    rid = value(view[offsets[F_RID] : offsets[F_RID + 1]], "rid") if k > F_RID else None
    if not isinstance(rid, str):
        raise InvalidRequest(f"rid must be a string, got {type(rid).__name__}")
    mm = None
    try:
        for i in odd:  # the others are nil, bools, numbers, bins and arrays of them
            if i not in _ADD_DECODED:
                value(view[offsets[i] : offsets[i + 1]], f"element {i}")
        if k <= F_INPUT_IDS:
            raise InvalidRequest("the payload has no input_ids")
        _ids(ints[0], "input_ids")
        if k > F_UNPADDED and not _nil(p, n, offsets[F_UNPADDED]):
            _ids(ints[1], "input_ids_unpadded")
        if k > F_MM and not _nil(p, n, offsets[F_MM]):
            mm = _add_mm(p, view, offsets[F_MM], offsets[F_MM + 1], limits, env)
    except AdmissionError as exc:
        raise refusal(exc.message, rid, exc.code) from exc
    return offsets, ints, rid, mm


def _add_mm(
    p: cython.const[u8][::1], view: object, start: ssize, end: ssize, limits: object, env: tuple
) -> tuple:
    """``multimodal_inputs`` at ``p[start:end]`` (one value, its structure checked):
    its element offsets, its items built, with their offsets, and the aux indices
    their tensors refer to."""
    b: cython.uint = p[start]
    count: ssize
    h: ssize
    count, h = _array_head(p, end, start)
    if count < 0:
        raise InvalidRequest(
            f"multimodal_inputs must be a msgpack array, got {_type_name(b)} (type byte 0x{b:02x})"
        )
    offsets: list = []
    pos: ssize = start + h
    i: ssize
    for i in range(count):
        offsets.append(pos)
        pos = _skip(p, end, pos, 1, i)
    offsets.append(pos)
    if count == 0 or _nil(p, end, offsets[0]):
        return offsets, [], [], []
    a: ssize = offsets[0]
    z: ssize = offsets[1]
    sub: cython.const[u8][::1] = p[a:z]
    try:  # the item count from its header, before any item is built
        count = array_len(sub)
    except ValueError:  # not an array: build_items words it
        count = -1
    if count > limits.max_items:
        raise items_over(count, limits.max_items)
    items, features, others, offsets_at = build_items(sub, view[a:z], env[0], limits, *env[1:])
    _item_offsets(sub, items, offsets_at)
    return offsets, items, features, others


def _item_offsets(p: cython.const[u8][::1], items: list, offsets_at: list) -> None:
    """Each item's offsets (element 3 at ``offsets_at``, -1: none) from one
    :func:`int_rows` table: a view of its rows, None where nil. A refusal
    names the first item, in order, whose offsets are refused."""
    which: list = [i for i, at in enumerate(offsets_at) if at >= 0]
    if not which:
        return
    try:
        flat, bounds = int_rows(p, [offsets_at[i] for i in which], 2)
    except RowsError as exc:
        raise InvalidRequest(
            f"item {which[exc.index]}: offsets must be nil or an array of [start, end] "
            f"pairs of int64 ({exc})"
        ) from exc
    table = flat.reshape(-1, 2)
    j: ssize
    for j in range(len(which)):
        if bounds[2 * j] >= 0:  # nil: None
            items[which[j]].offsets = table[bounds[2 * j] : bounds[2 * j + 1]]


def _got(b: cython.uint) -> str:
    """msgspec's name for the type of type byte ``b`` (its "got `...`")."""
    name: str = _type_name(b)
    if name == "map":
        return "object"
    if name == "nil":
        return "None"
    if name == "bin":
        return "bytes"
    return "float" if name.startswith("float") else name


@cython.cfunc
def _expected(
    i: ssize, field: str, want: str, p: cython.const[u8][::1], n: ssize, pos: ssize
) -> Exception:
    """Item ``i``'s refusal of the value at ``p[pos]`` as ``field`` (a ValueError
    where the bytes end there)."""
    if pos >= n:
        return _split_error(_S_END, i, p, n, pos, 0)
    return InvalidRequest(f"item {i}: {field}Expected `{want}`, got `{_got(p[pos])}`")


@cython.cfunc
def _map_head(p: cython.const[u8][::1], n: ssize, pos: ssize) -> tuple[ssize, ssize]:
    """``(entries, header length)`` of the map header at ``p[pos]``, ``(-1, 0)`` if
    it is no map (or ``pos`` is past the end), ``(-2, 0)`` if it is cut short."""
    if pos >= n:
        return -1, 0
    b: cython.uint = p[pos]
    h: ssize
    if 0x80 <= b <= 0x8F:
        return b & 0x0F, 1
    if b == 0xDE or b == 0xDF:
        h = 3 if b == 0xDE else 5
        if n - pos < h:
            return -2, 0
        return cython.cast(ssize, _load(p, pos + 1, h - 1)), h
    return -1, 0


@cython.cfunc
def _map_at(p: cython.const[u8][::1], n: ssize, at: _At, i: ssize, field: str) -> ssize:
    """The entry count of the map at ``p[at.pos]``, item ``i``'s ``field`` (``at``
    moved past its header); refused if it is no map."""
    entries: ssize
    h: ssize
    entries, h = _map_head(p, n, at.pos)
    if entries == -2:
        raise _split_error(_S_TRUNC, i, p, n, at.pos, 5)
    if entries < 0:
        raise _expected(i, f"{field}: ", "object | null", p, n, at.pos)
    at.pos += h
    return entries


@cython.cfunc
def _other(
    p: cython.const[u8][::1], n: ssize, view: object, env: tuple, at: _At, i: ssize, what: str
) -> object:
    """The value at ``p[at.pos]`` decoded by ``env``'s ``value`` (``at`` moved past it)."""
    pos: ssize = at.pos
    at.pos = _skip(p, n, pos, 1, i)
    return env[6](view[pos : at.pos], what)


@cython.cfunc
def _is_tensor_form(v: object) -> cython.bint:
    """A decoded value of a tensor's form ``[str, list, data]`` (built, or refused)."""
    return type(v) is list and len(v) == 3 and type(v[0]) is str and type(v[1]) is list


# --------------------------------------------------------------------------
# Multimodal items: the reply's mm_items array, spliced from the received bytes.
#
# An item built from a received MultimodalDataItem keeps where its bytes are
# (wire._ItemSrc, its ``extra``). When the item is re-encoded with the request it
# was received in and the model still says what those bytes say, its bytes are
# re-emitted with only elements 1 and 2 (hash, pad_value) written again. The
# condition, in full: ``src.aux is aux`` (its tensors' aux indices are this
# message's), ``src.count >= 10`` (every field there), the same modality
# (``==``), the very feature tensor (``is``) and a side dict equal to the one
# decoded (``==``: tensor equality is identity), hash and pad_value each None or
# an int of the msgpack range. Any other item is encoded by the caller's
# ``encode_item`` (its bytes are taken as they are).

_INT64_MAX = cython.declare(object, (1 << 63) - 1)
_UINT64_MAX = cython.declare(object, (1 << 64) - 1)
_INT64_MIN = cython.declare(object, -(1 << 63))
_TWO64 = cython.declare(object, 1 << 64)
_K_NONE = cython.declare(i64, 1)  # a hash or pad_value to write: nil
_K_INT = cython.declare(i64, 2)  # an int64 (its smallest form)
_K_UINT = cython.declare(i64, 3)  # a uint64 above INT64_MAX (0xcf and 8 bytes)


@cython.cfunc
@cython.inline
def _int_ok(v: object) -> cython.bint:
    """``v`` is None or an int msgpack carries (int64 or uint64): one the splice
    writes (a bool, a float, a larger int: the item is encoded instead)."""
    return v is None or (type(v) is int and _INT64_MIN <= v <= _UINT64_MAX)


@cython.cfunc
def _int_kind(v: object, row: i64[::1], at: ssize) -> ssize:
    """How ``v`` (None or an int) is written: its kind and value in ``row[at]``,
    ``row[at + 1]`` (the uint64's bits as int64); its size in bytes, 0 if it is
    neither (a bool, an int out of range: the caller encodes the item)."""
    x: i64
    t: cython.uint
    payload: u64
    size: ssize
    if v is None:
        row[at] = _K_NONE
        return 1
    if not _int_ok(v):
        return 0
    if v > _INT64_MAX:
        row[at] = _K_UINT
        row[at + 1] = v - _TWO64  # the same 64 bits as an int64
        return 9
    x = v
    row[at] = _K_INT
    row[at + 1] = x
    t, payload, size = _form(x)
    return size


@cython.cfunc
@cython.exceptval(check=False)
def _put_kind(o: u8[::1], at: ssize, kind: i64, x: i64) -> ssize:
    """Write the value :func:`_int_kind` described at ``o[at]`` (9 writable bytes);
    where the next value goes."""
    if kind == _K_NONE:
        o[at] = 0xC0
        return at + 1
    if kind == _K_UINT:
        _put9(o, at, 0xCF, _wrap(cython.cast(u64, x)))
        return at + 9
    return _put(o, at, x)


# (Struct class, field names) -> their positions: found once per class (a Struct's
# fields never change), a bounded number kept
_INDEXES = cython.declare(dict, {})
_INDEXES_MAX = cython.declare(ssize, 64)


@cython.cfunc
def _indexes(cls: object, names: tuple) -> tuple:
    """Where each of ``names`` is among the msgspec Struct ``cls``'s fields (what
    ``astuple`` gives, in that order)."""
    key = (cls, names)
    found = _INDEXES.get(key)
    if found is None:
        fields: tuple = cls.__struct_fields__
        found = tuple([fields.index(name) for name in names])
        if len(_INDEXES) < _INDEXES_MAX:
            _INDEXES[key] = found
    return found


_ITEM_READ = ("extra", "modality", "feature", "side", "hash", "pad_value")
_SRC_READ = ("aux", "count", "modality", "feature", "side", "buf", "start", "off1", "off3", "end")


@cython.cfunc
@cython.inline
def _may_splice(
    it: tuple,
    st: tuple,
    aux: object,
    i_mod: ssize,
    i_feat: ssize,
    i_side: ssize,
    s_aux: ssize,
    s_count: ssize,
    s_mod: ssize,
    s_feat: ssize,
    s_side: ssize,
) -> cython.bint:
    """The rule (see above) but for hash and pad_value, on an item's fields ``it``
    and its source's ``st`` (``astuple``'s; the ``i_``/``s_`` positions in them)."""
    return (
        st[s_aux] is aux
        and st[s_count] >= _ITEM_ELEMS
        and it[i_mod] == st[s_mod]
        and it[i_feat] is st[s_feat]
        and it[i_side] == st[s_side]
    )


@cython.boundscheck(False)
@cython.wraparound(False)
def splice_items(
    items: list, aux: list, src_type: object, encode_item: object, splice: cython.bint = True
) -> memoryview:
    """The msgpack array of ``items`` (the reply's mm_items): each item that may be
    spliced (see above; none when ``splice`` is False) as its received bytes with
    hash and pad_value written again, every other one as ``encode_item(item)``'s
    bytes. A view of a fresh buffer, as :func:`encode` returns.

    Items and their sources are msgspec Structs, read as ``astuple`` gives their
    fields (one call each instead of an attribute lookup per field)."""
    n: ssize = len(items)
    parts: list = [None] * n  # the received bytes of a spliced item, or its encoding
    table = np.zeros((n, 9), dtype=np.int64)
    # a spliced item's row: start, off1, off3, end, then hash and pad_value as
    # _int_kind writes them (kind, value), then the two's size; an encoded item's
    # row: zeros
    tv: i64[:, ::1] = table
    total: ssize = 5
    i: ssize
    m: ssize
    k: ssize
    item_type: object = None
    # where each field read is in astuple's tuples (_ITEM_READ's, _SRC_READ's order)
    i_extra: ssize = 0
    i_mod: ssize = 0
    i_feat: ssize = 0
    i_side: ssize = 0
    i_hash: ssize = 0
    i_pad: ssize = 0
    sx: tuple = _indexes(src_type, _SRC_READ) if splice else (0,) * len(_SRC_READ)
    s_aux: ssize = sx[0]
    s_count: ssize = sx[1]
    s_mod: ssize = sx[2]
    s_feat: ssize = sx[3]
    s_side: ssize = sx[4]
    s_buf: ssize = sx[5]
    s_start: ssize = sx[6]
    s_off1: ssize = sx[7]
    s_off3: ssize = sx[8]
    s_end: ssize = sx[9]
    for i in range(n):
        item = items[i]
        if splice:
            if type(item) is not item_type:
                item_type = type(item)
                i_extra, i_mod, i_feat, i_side, i_hash, i_pad = _indexes(item_type, _ITEM_READ)
            it: tuple = astuple(item)
            src = it[i_extra]
            if type(src) is src_type:
                st: tuple = astuple(src)
                if _may_splice(
                    it, st, aux, i_mod, i_feat, i_side, s_aux, s_count, s_mod, s_feat, s_side
                ):
                    row: i64[::1] = tv[i]
                    k = _int_kind(it[i_hash], row, 4)
                    m = _int_kind(it[i_pad], row, 6)
                    if k and m:
                        row[0] = st[s_start]
                        row[1] = st[s_off1]
                        row[2] = st[s_off3]
                        row[3] = st[s_end]
                        if not 0 <= row[0] <= row[1] <= row[2] <= row[3]:
                            raise ValueError(f"splice_items: item {i}'s source is not in order")
                        parts[i] = st[s_buf]
                        row[8] = k + m
                        total += (row[1] - row[0]) + k + m + (row[3] - row[2])
                        continue
                    row[4] = row[6] = 0
        got = memoryview(encode_item(item)).cast("B")
        parts[i] = got
        total += got.shape[0]
    out = np.empty(total + 9, dtype=np.uint8)  # 9: _put9 writes a whole word
    o: u8[::1] = out
    at: ssize = _put_header(o, n)
    p: cython.const[u8][::1]
    q: cython.const[u8][::1]
    buf: object = None  # the received bytes q views (one view for every spliced item)
    for i in range(n):
        part = parts[i]
        if tv[i, 4] == 0:  # encoded
            p = part
            m = p.shape[0]
            if at + m > total:  # pass one counted these very bytes: a bug
                raise ValueError(f"splice_items: item {i} is longer than counted")
            _copy(o, at, p, 0, m)
            at += m
            continue
        if part is not buf:
            buf = part
            q = buf
        if tv[i, 3] > q.shape[0]:
            raise ValueError(f"splice_items: item {i}'s source ends past its bytes")
        if at + (tv[i, 1] - tv[i, 0]) + tv[i, 8] + (tv[i, 3] - tv[i, 2]) > total:
            raise ValueError(f"splice_items: item {i} is longer than counted")
        _copy(o, at, q, tv[i, 0], tv[i, 1] - tv[i, 0])
        at += tv[i, 1] - tv[i, 0]
        at = _put_kind(o, at, tv[i, 4], tv[i, 5])
        at = _put_kind(o, at, tv[i, 6], tv[i, 7])
        _copy(o, at, q, tv[i, 2], tv[i, 3] - tv[i, 2])
        at += tv[i, 3] - tv[i, 2]
    return memoryview(out)[:at]
