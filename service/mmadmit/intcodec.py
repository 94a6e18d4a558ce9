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

Interpreted (``--native off``, or no extension built), the walker's loops
are Python loops: on image-heavy ids it decodes 8K / 32K / 256K ids in about
4-8 / 16-31 / 130-180 ms, where the compiled walker takes 0.01 / 0.05 / 0.3 ms.
No other decoder stands in for it: every function here is the walker's,
through ``_WALK``, in both builds.

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

from typing import Any

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
    "decode_add",
    "decode_int_array",
    "element_span",
    "encode_int_array",
    "encode_int_array_filled",
    "encoded_bound",
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
    out: npt.NDArray[np.int64] = _WALK.decode(_as_bytes(raw))
    return out


def encode_int_array(values: Any) -> memoryview:
    """Encode a 1-D int array (any int dtype) as one msgpack array of ints.

    Byte-identical to ``msgpack.packb(values.tolist())``, as a view of a fresh
    buffer (no copy of a 128K-id encoding). Raises ``TypeError``
    for a non-integer dtype and ``ValueError`` for a non-1-D array, a uint64
    value above ``2**63 - 1`` or more than ``2**32 - 1`` elements.
    """
    result: memoryview = _WALK.encode(_as_int64(values))
    return result


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
    array was not decoded).
    """
    if len(int_fields) > 8 or len(set(int_fields)) != len(int_fields):
        raise ValueError("split_array: at most 8 distinct int_fields")
    if marks is not None:
        marks[:] = [None] * len(int_fields)
    bound = -1 if max_ints is None else max_ints
    offsets, ints = _WALK.split(_as_bytes(raw), tuple(int_fields), bound, marks)
    return offsets, ints


def encode_int_array_filled(
    old: npt.NDArray[np.int64],
    raw: Any,
    marks: npt.NDArray[np.int64] | None,
    starts: Any,
    stops: Any,
    fill: Any,
    out: Any = None,
    start: int = 0,
) -> memoryview:
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
    buf = _as_bytes(raw)
    if marks is None:
        _, marks = _WALK.decode_marked(buf)
    if _WALK.array_len(buf) != len(old):
        raise ValueError(f"{_PREFIX}encode_filled: the array and the bytes do not match")
    result: memoryview = _WALK.encode_filled(buf, marks, a, b, v, out, start)
    return result


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
    which says what it returns and refuses), compiled or interpreted."""
    buf = _as_bytes(raw)
    return _WALK.decode_add(buf, buf, limits, marks, env, refusal)


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
# The walker the public functions run: compiled (mmadmit._walk_c) when it is built
# and native code is on, else the same source interpreted (_use_native).

_WALK: Any = msgpack_walk


def _use_native(on: bool) -> bool:
    """Point the public functions at the compiled walker (when built and ``on``)
    or at the interpreted one."""
    global _WALK, HAVE_NATIVE
    HAVE_NATIVE = on and _BUILT is not None
    _WALK = _BUILT if HAVE_NATIVE else msgpack_walk
    return HAVE_NATIVE


native.register(__name__, _use_native)
