"""msgpack arrays of ints <-> int64 numpy arrays, and the walks of msgpack messages.

The msgpack wire carries token ids as a plain msgpack array of ints (128K
elements for a long prompt). Generic msgpack decoding builds one Python int
per element (about 9 ms for 128K ids); this module decodes straight into a
numpy ``int64`` array and encodes from one.

All the work is done by one walker, :mod:`mmadmit.msgpack_walk`: a Python
source in Cython's pure-Python mode that holds every rule and every error
text. ``setup.py`` compiles it into the optional extension
``mmadmit._walk_c``; this module calls the compiled one when it is built and
native code is on (:mod:`mmadmit.native`, ``--native off``), and the same
source interpreted otherwise. ``HAVE_NATIVE`` says which.

Interpreted, the walker's loops are Python loops, far too slow for token
arrays: on 128K ids (measured here, on a loaded 2-core machine) it takes 6 s
to decode, 2.4 s to encode and 5.5 s to split a message around them, against
50 ms, 21 ms and 0.18 s through ``msgspec``. So when the walker is
interpreted, and only then, ``msgspec`` shortcuts run for the int-array codec,
each only where it gives the walker's result: :func:`decode_int_array` and
the int fields of :func:`split_array` decode through ``Decoder(list[int])``,
the offsets of :func:`split_array` come from ``Decoder(list[msgspec.Raw])``,
and whenever ``msgspec`` refuses the walker runs and words the error;
:func:`encode_int_array` (and :func:`encode_int_array_filled` where the
received bytes are smallest forms) is ``msgspec`` on ``values.tolist()``,
byte-identical (the tests check it). Every other function is the walker's alone, through ``_WALK``.

The wire codec decodes an ADD with one call, :func:`decode_add`: the walker's
split (where each element starts and ends, the token arrays decoded into int64
arrays in the same pass, so a 128K-id payload is read once), its limits walk,
its item builder and its table of the items' offset rows, in order
(:func:`mmadmit.msgpack_walk.decode_add`). :func:`split_array` is that split
alone. The walk checks
the structure only (lengths, the never-used byte ``0xc1``, trailing bytes),
iteratively: no depth limit, no recursion. Errors are ``ValueError`` with the
same text compiled and interpreted.

Format: exactly one msgpack array (fixarray, array16 or array32), as
docs/spec/WIRE.md, "Encoding rules" states for token-id arrays (int64 values,
smallest forms written). Non-goals: nested arrays, nil elements, arrays of
more than ``2**32 - 1`` elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from mmadmit import msgpack_walk, native
from mmadmit.msgpack_walk import IntArrayTooLong

try:
    from mmadmit import _walk_c as _BUILT  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler or no Cython at install time)
    _BUILT = None

__all__ = [
    "HAVE_NATIVE",
    "IntArrayTooLong",
    "array_len",
    "check_int_arrays",
    "decode_add",
    "decode_int_array",
    "element_span",
    "encode_int_array",
    "encode_int_array_filled",
    "encoded_bound",
    "offsets_of",
    "splice_items",
    "split_array",
]

HAVE_NATIVE: bool = _BUILT is not None

_INT64_MAX = 2**63 - 1
_PREFIX = "msgpack int array: "


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


def encode_int_array(values: Any) -> bytes | memoryview:
    """Encode a 1-D int array (any int dtype) as one msgpack array of ints.

    Byte-identical to ``msgpack.packb(values.tolist())`` (``bytes``, or a view of a
    fresh buffer from the compiled walker: no copy of a 128K-id encoding). Raises ``TypeError``
    for a non-integer dtype and ``ValueError`` for a non-1-D array, a uint64
    value above ``2**63 - 1`` or more than ``2**32 - 1`` elements.
    """
    return _encode_impl(_as_int64(values))


def array_len(raw: Any) -> int:
    """The element count of the msgpack array header at the start of ``raw``.

    Header only; ``ValueError`` for a non-array, a cut header, or a count
    larger than the bytes that follow (every element takes one byte at least).
    """
    count: int = _WALK.array_len(_as_bytes(raw))
    return count


def split_array(
    raw: Any,
    int_fields: tuple[int, ...] = (),
    max_ints: int | None = None,
    marks: list[Any] | None = None,
) -> tuple[list[int], list[npt.NDArray[np.int64] | str | None]]:
    """Element boundaries of one msgpack array, int arrays decoded on the way.

    ``raw`` holds exactly one msgpack array of ``n`` elements. Returns
    ``(offsets, ints)``: ``offsets`` has ``n + 1`` entries, element ``i`` being
    ``raw[offsets[i]:offsets[i + 1]]`` (``offsets[0]`` is the header length,
    ``offsets[n] == len(raw)``). ``ints[k]`` is element ``int_fields[k]``
    decoded as by :func:`decode_int_array` (a new writable int64 array),
    ``None`` when that element is missing, or the message
    :func:`decode_int_array` raises for its bytes when it is not an array of
    int64-range ints (the walk words it as it goes: nothing is decoded twice).
    At most 8 distinct ``int_fields``. Raises ``ValueError`` for input that is
    not one well-formed msgpack array (not an array, truncated, the byte
    ``0xc1``, trailing bytes), and :class:`IntArrayTooLong` for an
    ``int_fields`` element that is an array of more than ``max_ints`` elements
    (decided from its header: nothing is allocated for it).

    With ``marks`` (a list), its contents become one entry per ``int_fields``
    entry: that array's marks for :func:`encode_int_array_filled`, or None (the
    array was not decoded, or not by the compiled walker).
    """
    if len(int_fields) > 8 or len(set(int_fields)) != len(int_fields):
        raise ValueError("split_array: at most 8 distinct int_fields")
    if marks is None:
        return _split_impl(_as_bytes(raw), tuple(int_fields), max_ints, None)
    got: list[Any] = [None] * len(int_fields)
    result = _split_impl(_as_bytes(raw), tuple(int_fields), max_ints, got)
    marks[:] = got
    return result


def encode_int_array_filled(
    old: npt.NDArray[np.int64],
    raw: Any,
    marks: npt.NDArray[np.int64] | None,
    starts: Any,
    stops: Any,
    fill: Any,
    out: Any = None,
    start: int = 0,
) -> bytes | memoryview:
    """:func:`encode_int_array` of ``old`` with ``old[starts[k]:stops[k]] = fill[k]``,
    written from the bytes ``old`` was decoded from (with ``out``: written into
    that byte buffer from ``start``, as :func:`mmadmit.msgpack_walk.encode_filled`
    says).

    ``old`` was decoded from ``raw`` (one msgpack array of ints: an element
    :func:`split_array` decoded, with its ``marks``, or None). The spans say
    what changed, so no int array is read: the elements outside
    them are ``raw``'s bytes, copied, each span its value's smallest form
    repeated (the padded ids: the received ids with the pad runs written).
    Byte-identical to :func:`encode_int_array` of the filled array whenever
    ``raw`` holds smallest forms, the same values always. ``ValueError`` when
    the spans are not sorted, disjoint and inside the array, or ``old``,
    ``raw`` and ``marks`` do not belong together.
    """
    a, b, v = _as_int64(starts), _as_int64(stops), _as_int64(fill)
    if old.dtype != np.int64 or old.ndim != 1:
        raise ValueError(f"{_PREFIX}encode_filled: old must be a 1-D int64 array")
    if not len(a) == len(b) == len(v):
        raise ValueError(f"{_PREFIX}encode_filled: starts, stops and fill differ in length")
    return _filled_impl(old, _as_bytes(raw), marks, a, b, v, out, start)


def encoded_bound(n: int) -> int:
    """The most bytes an encoded array of ``n`` ints takes (what
    :func:`encode_int_array_filled` needs of the room in ``out``)."""
    bound: int = msgpack_walk.encoded_bound(n)
    return bound


def element_span(raw: Any, index: int) -> tuple[int, int]:
    """``(start, end)`` of element ``index`` of the one msgpack array filling ``raw``,
    whose structure is checked whole (:func:`mmadmit.msgpack_walk.element_span`: any
    depth, nothing allocated by its size); ``ValueError`` as :func:`split_array`, or
    where there is no such element."""
    start, end = _WALK.element_span(_as_bytes(raw), index)
    return start, end


def decode_add(raw: Any, limits: Any, marks: list[Any], env: tuple[Any, ...], refusal: Any) -> Any:
    """An ADD payload decoded in one walk (:func:`mmadmit.msgpack_walk.decode_add`,
    which says what it returns and refuses), compiled or interpreted; the
    interpreted one decodes the token arrays through this module's msgspec
    shortcut (:func:`split_array`)."""
    buf = _as_bytes(raw)
    split_ints = None if HAVE_NATIVE else _split_py
    return _WALK.decode_add(buf, buf, limits, marks, env, refusal, split_ints)


def splice_items(
    items: list[Any], aux: list[Any], src_type: type, encode_item: Any, splice: bool = True
) -> memoryview:
    """The msgpack array of ``items``, spliced from their received bytes where the
    model still says what they say (:func:`mmadmit.msgpack_walk.splice_items`,
    which states the rule), compiled or interpreted (the same source)."""
    spliced: memoryview = _WALK.splice_items(items, aux, src_type, encode_item, splice)
    return spliced


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
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > _INT64_MAX:
        index = int(np.argmax(arr > _INT64_MAX))
        raise ValueError(msgpack_walk.range_message(index, int(arr[index])))
    return np.ascontiguousarray(arr, dtype=np.int64)


# --------------------------------------------------------------------------
# Header-only checks (no walk)


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
    buf = _as_bytes(raw)
    for field in sorted(int_fields):
        if 0 <= field < len(offsets) - 1:
            b = buf[offsets[field]]
            if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
                count = _WALK.array_len(buf[offsets[field] : offsets[field + 1]])
                if count > max_ints:
                    raise IntArrayTooLong(field, count, max_ints)


# --------------------------------------------------------------------------
# The int-array codec compiled (_X_native: mmadmit._walk_c) and interpreted (_X_py:
# the same source run by Python, with the msgspec shortcuts of the module doc).
# Tests and the fuzz target compare each pair.


def _decode_native(buf: memoryview) -> npt.NDArray[np.int64]:
    assert _BUILT is not None
    out: npt.NDArray[np.int64] = _BUILT.decode(buf)
    return out


def _encode_native(values: npt.NDArray[np.int64]) -> bytes | memoryview:
    assert _BUILT is not None
    result: memoryview = _BUILT.encode(values)
    return result


def _split_native(
    buf: memoryview,
    int_fields: tuple[int, ...],
    max_ints: int | None = None,
    marks: list[Any] | None = None,
) -> tuple[list[int], list[npt.NDArray[np.int64] | str | None]]:
    assert _BUILT is not None
    bound = -1 if max_ints is None else max_ints
    offsets, ints = _BUILT.split(buf, int_fields, bound, True, marks)
    return offsets, ints


def _filled_walk(walk: Any, old: Any, buf: memoryview, marks: Any, *spans_out: Any) -> memoryview:
    """``walk.encode_filled`` (one build of the walker), after the checks that
    ``old`` is the array ``buf`` holds (its length; marks None: read again);
    ``spans_out``: starts, stops, fill, then optionally out and start."""
    if marks is None:
        _, marks = walk.decode_marked(buf)
    if walk.array_len(buf) != len(old):
        raise ValueError(f"{_PREFIX}encode_filled: the array and the bytes do not match")
    result: memoryview = walk.encode_filled(buf, marks, *spans_out)
    return result


def _filled_native(old: Any, buf: memoryview, marks: Any, *spans_out: Any) -> memoryview:
    return _filled_walk(_BUILT, old, buf, marks, *spans_out)


_LIST_OF_INT_DECODER = msgspec.msgpack.Decoder(list[int])


def _ints_by_msgspec(buf: memoryview) -> npt.NDArray[np.int64] | None:
    """The int array filling ``buf`` through msgspec; None where it refuses."""
    try:
        return np.array(_LIST_OF_INT_DECODER.decode(buf), dtype=np.int64)
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError, ValueError):
        return None  # OverflowError: a uint64 above INT64_MAX


def _decode_py(buf: memoryview) -> npt.NDArray[np.int64]:
    count = msgpack_walk.array_len(buf)  # a forged count refused before msgspec allocates
    out = _ints_by_msgspec(buf)
    if out is None or out.shape != (count,):
        decoded: npt.NDArray[np.int64] = msgpack_walk.decode(buf)  # the error, worded
        return decoded
    return out


# msgspec writes ints in the same smallest forms as msgpack-python (the tests
# check it). Going through .tolist() was measured faster than a vectorized
# numpy writer (one pass per int form plus a scatter) at 128K ids.
_ENCODER = msgspec.msgpack.Encoder()


def _encode_py(values: npt.NDArray[np.int64]) -> bytes | memoryview:
    if values.size > msgpack_walk.MAX_ARRAY_COUNT:  # the walker words the limit
        refused: memoryview = msgpack_walk.encode(values)
        return refused
    return _ENCODER.encode(values.tolist())


def _filled_py(
    old: npt.NDArray[np.int64],
    buf: memoryview,
    marks: Any,
    starts: npt.NDArray[np.int64],
    stops: npt.NDArray[np.int64],
    fill: npt.NDArray[np.int64],
    out: Any = None,
    start: int = 0,
) -> bytes | memoryview:
    # Where the received bytes are smallest forms (what msgpack encoders write),
    # the walker's result is the plain encoding of the filled array (the spans
    # checked as the walker does, with its message); otherwise the walker runs
    # (interpreted: a Python loop, for bytes no known encoder writes).
    n = len(old)
    if buf == _encode_py(old):
        if marks is not None and len(marks) != (n + 63) >> 6:
            raise ValueError(f"{_PREFIX}encode_filled: the bytes and marks do not match")
        if out is not None:  # the walker's room check, in its order, with its message
            room, need = memoryview(out).nbytes, msgpack_walk.encoded_bound(n)
            if start < 0 or start > room or room - start < need:
                raise ValueError(
                    f"{_PREFIX}encode_filled: the output has no room for {need} bytes "
                    f"from offset {start}"
                )
        if len(starts) and not (
            starts[0] >= 0
            and stops[-1] <= n
            and bool(np.all(starts <= stops))
            and bool(np.all(stops[:-1] <= starts[1:]))
        ):
            raise ValueError(
                f"{_PREFIX}encode_filled: the spans are not sorted, disjoint and inside"
            )
        filled = old.copy()
        for a, b, v in zip(starts.tolist(), stops.tolist(), fill.tolist(), strict=True):
            filled[a:b] = v
        encoded = _encode_py(filled)
        if out is None:
            return encoded
        view = memoryview(out).cast("B")
        view[start : start + len(encoded)] = encoded
        return view[start : start + len(encoded)]
    return _filled_walk(msgpack_walk, old, buf, marks, starts, stops, fill, out, start)


_RAW_LIST_DECODER = msgspec.msgpack.Decoder(list[msgspec.Raw])


def _split_py(
    buf: memoryview,
    int_fields: tuple[int, ...],
    max_ints: int | None = None,
    marks: list[Any] | None = None,
) -> tuple[list[int], list[npt.NDArray[np.int64] | str | None]]:
    # msgspec finds the offsets where it accepts the message (the msgpack format
    # leaves it no other reading, and it accepts no message the walker
    # refuses); the walker does where it does not, and words the error. Then
    # msgspec decodes the int fields; where it refuses, the walker's decode
    # words why (as the compiled split does).
    try:
        offsets = offsets_of(len(buf), _RAW_LIST_DECODER.decode(buf))
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        bound = -1 if max_ints is None else max_ints
        offsets, _ = msgpack_walk.split(buf, int_fields, bound, False)
    else:
        if max_ints is not None:  # as the walk would, in element order, from the headers
            check_int_arrays(buf, offsets, int_fields, max_ints)
    ints: list[npt.NDArray[np.int64] | str | None] = []
    for field in int_fields:
        value: npt.NDArray[np.int64] | str | None = None
        if 0 <= field < len(offsets) - 1:
            elem = buf[offsets[field] : offsets[field + 1]]
            b = elem[0]
            if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):
                value = _ints_by_msgspec(elem)
            if value is None:
                try:
                    value = msgpack_walk.decode(elem)
                except ValueError as exc:
                    value = str(exc)
        ints.append(value)
    return offsets, ints


# --------------------------------------------------------------------------
# The walker the public functions run: compiled (mmadmit._walk_c) when it is built
# and native code is on, else the same source interpreted (_use_native), the
# int-array codec's five with the shortcuts above.

_WALK: Any = msgpack_walk
_decode_impl = _decode_py
_encode_impl = _encode_py
_filled_impl: Any = _filled_py
_split_impl = _split_py


def _use_native(on: bool) -> bool:
    """Point the public functions at the compiled walker (when built and ``on``)
    or at the interpreted one."""
    global _WALK, HAVE_NATIVE, _decode_impl, _encode_impl, _filled_impl, _split_impl
    HAVE_NATIVE = on and _BUILT is not None
    _WALK = _BUILT if HAVE_NATIVE else msgpack_walk
    if HAVE_NATIVE:
        _decode_impl = _decode_native
        _encode_impl = _encode_native
        _filled_impl = _filled_native
        _split_impl = _split_native
    else:
        _decode_impl = _decode_py
        _encode_impl = _encode_py
        _filled_impl = _filled_py
        _split_impl = _split_py
    return HAVE_NATIVE


native.register(__name__, _use_native)
