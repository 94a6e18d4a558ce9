"""docs/spec/MATERIALIZE.md rules 5 to 8 (and rule 1's vocabulary bound): the
one source of the materializer's CPU work.

:func:`plan_items` checks every item of a request (rule 5: modality, spans,
placeholders, hash and pad value ranges, and for the M-RoPE families the
grids, timing tensors and span lengths), then derives what the materializer
needs: the spans sorted by start, the M-RoPE run plan, and each item's pad
value (rule 6, :func:`pad_value`) from its supplied hash. It either returns
that (:class:`ItemPlan`) or raises the abort, worded here and nowhere else.
The per-token loops follow: rule 5's placeholder check
(:func:`first_mismatch`), rule 7's positions (:func:`positions`) and rule 8's
substitution (:func:`fill_spans`).

One file, two builds (Cython's pure-Python mode, like :mod:`mmadmit.msgpack_walk`).
This file runs as plain Python, and ``setup.py`` also compiles it into
``mmadmit._rules_c`` when Cython and a compiler are present at install time
(and on x86-64 into ``mmadmit._rules_avx2`` with ``-mavx2``, whose per-token
loops store four int64 at a time: the M-RoPE positions of 128K tokens in
about 40 us against 60 us, in one process on one output alignment);
:mod:`mmadmit.planner` picks the compiled module the CPU runs unless native
code is switched off (``--native off``). ``tests/test_planner.py`` and the ``planner``
fuzz target run both on valid and on mutated requests and demand the same
outcome, message included. The ``cython.*`` annotations type locals for the
compiled build (C integers, typed memoryviews on int64 tables); interpreted
they do nothing. ``cython.compiled`` is tested where the compiled code must
differ: :func:`_round32`; :func:`_i64_at` and :func:`_f32_at`, which read a
tensor's values from its buffer; :func:`first_outside`'s pass (C integer
compares compiled, Python ints interpreted: the same verdict); and the
loops of the per-token helpers (``_repeat``, ``_fill``, ``_copy``,
``_differs``, ``_text``, ``_grid``: C loops and ``memcpy`` / ``memcmp``
compiled, numpy operations on slices interpreted).

The work is laid out for the compiled build: everything per span or grid row
runs in loops over C integers on a few int64 tables allocated once per
request, and Python objects are touched once per item (its fields, its grid
and timing tensors). C integers never overflow here: every count and product
is bounded by ``len(input_ids)`` before it is formed (a product that would
pass that bound is refused first), and a grid value outside int64 is refused.
The per-token loops are compiled loops rather than numpy passes because they
measured faster end to end (README, "Fast paths": 1.9-4.7x against the numpy
references now in ``tests/kernels_oracle.py``); for rule 1's vocabulary bound
(one compare an id) numpy's reduction cost 6-10 us at 1K ids inside a request,
this loop compiled about 1 us.
"""

from __future__ import annotations

import math
import struct
import sys

import cython
import msgspec
import numpy as np
from msgspec.structs import astuple

from .dtypes import parse_dtype
from .errors import InvalidRequest, Unsupported
from .limits import Limits, check_shape, tensor_bytes_over
from .model import MODALITY_OF, Item, Modality, MultimodalInputs, Tensor
from .mrope import RunPlan
from .profile import Family, ModelProfile
from .tensorcheck import TensorName

if cython.compiled:
    from cython.cimports.cpython.memoryview import PyMemoryView_GET_BUFFER
    from cython.cimports.libc.string import memcmp, memcpy

i64 = cython.typedef(cython.longlong)
u64 = cython.typedef(cython.ulonglong)
ssize = cython.typedef(cython.Py_ssize_t)

IMAGE_GRID = "image_grid_thw"
VIDEO_GRID = "video_grid_thw"
AUDIO_IN_VIDEO = "use_audio_in_video"

# Rule 6: pad values, by modality tag (image 0, video 1, audio 2).
PAD_BASE = 1_000_000
PAD_SLOTS = (2**31 - 1 - PAD_BASE + 1) // 3  # 715_494_549
UINT64_MAX = 2**64 - 1

# Timing side tensors, in lookup order per family (docs/spec/MATERIALIZE.md table).
_QWEN25_TIME_KEYS = ("second_per_grid_ts", "video_second_per_grid")
_OMNI_TIME_KEYS = ("video_second_per_grid", "second_per_grid_ts")

MAX_SECONDS_PER_ROW = 1e6  # far beyond any video; keeps float32 products finite
# Temporal indices at or above this are refused (a profile's tokens_per_second or
# position_id_per_seconds times MAX_SECONDS_PER_ROW can exceed int64): far beyond
# any video, and low enough that positions never overflow int64.
MAX_TEMPORAL_INDEX = 2**40

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
_I64 = np.dtype(np.int64)
_F32 = struct.Struct("<f")
_F32_INF_FROM = cython.declare(cython.double, 2.0**128 - 2.0**103)  # rounds to float32 inf
_replace = msgspec.structs.replace
_MODALITY_OF = cython.declare(dict, MODALITY_OF)
_DT_INT64 = parse_dtype("int64")
_DT_FLOAT32 = parse_dtype("float32")

# time_mode of a RuleSet: how a video frame's temporal index is computed
_TIME_FRAME = cython.declare(cython.int, 0)  # the frame number (Qwen2-VL)
_TIME_QWEN25 = cython.declare(cython.int, 1)  # trunc((k * s) * tokens_per_second)
_TIME_OMNI = cython.declare(cython.int, 2)  # trunc(k * (s * position_id_per_seconds))

# how an item gets its pad value (ItemPlan.new_items)
_PAD_SET = cython.declare(cython.int, 0)  # carried pad_value: the item as it is
_PAD_FROM_HASH = cython.declare(cython.int, 1)  # a copy with hash and pad_value set
_PAD_HASH_FEATURE = cython.declare(cython.int, 2)  # None: the materializer hashes the feature
_PAD_NONE = cython.declare(
    cython.int, 3
)  # no pad value needed (the decode exemption): the item as it is

# rows of plan_items' per-item table
_COL_MOD = cython.declare(cython.int, 0)
_COL_PAD = cython.declare(cython.int, 1)
_COL_HOW = cython.declare(cython.int, 2)
_COL_WANT = cython.declare(cython.int, 3)


# An Item's and a Tensor's fields as astuple gives them (one call per item instead
# of a getattr per field, which costs compiled code ~150 instructions each).
_ITEM_FIELDS = Item.__struct_fields__
_I_MOD = cython.declare(ssize, _ITEM_FIELDS.index("modality"))
_I_HASH = cython.declare(ssize, _ITEM_FIELDS.index("hash"))
_I_PAD = cython.declare(ssize, _ITEM_FIELDS.index("pad_value"))
_I_OFFSETS = cython.declare(ssize, _ITEM_FIELDS.index("offsets"))
_I_FEATURE = cython.declare(ssize, _ITEM_FIELDS.index("feature"))
_I_SHM = cython.declare(ssize, _ITEM_FIELDS.index("feature_shm"))
_I_SIDE = cython.declare(ssize, _ITEM_FIELDS.index("side"))
_I_EXTRA = cython.declare(ssize, _ITEM_FIELDS.index("extra"))
_I_HANDSHAKE = cython.declare(ssize, _ITEM_FIELDS.index("encode_handshake"))
# with_pad builds an Item from its fields in this order
assert _ITEM_FIELDS == (
    "modality", "hash", "pad_value", "offsets", "feature", "feature_shm", "side", "extra",
    "encode_handshake",
)  # fmt: skip
_TENSOR_FIELDS = Tensor.__struct_fields__
_T_DTYPE = cython.declare(ssize, _TENSOR_FIELDS.index("dtype"))
_T_SHAPE = cython.declare(ssize, _TENSOR_FIELDS.index("shape"))
_T_DATA = cython.declare(ssize, _TENSOR_FIELDS.index("data"))
_BASE = cython.declare(i64, PAD_BASE)
_SLOTS = cython.declare(i64, PAD_SLOTS)


@cython.cfunc
@cython.inline
@cython.exceptval(check=False)
def _pad_lo(modality: cython.int) -> i64:
    """The first pad value of a modality (1 image, 2 video, 3 audio): rule 6's tag."""
    return _BASE + (modality - 1) * _SLOTS


def pad_interval(modality: int) -> tuple[int, int]:
    """Inclusive interval of a modality's pad values (1 image, 2 video, 3 audio)."""
    lo = _pad_lo(modality)
    return lo, lo + PAD_SLOTS - 1


@cython.ccall
def with_pad(item: Item, content_hash: object, pad: i64) -> Item:
    """Rule 6 applied to an item: a copy with ``hash`` and ``pad_value`` set (a request
    is never modified). The copy shares every other field with ``item``."""
    return _replace(item, hash=content_hash, pad_value=pad)


@cython.cfunc
def _with_pad_of(item: Item, f: tuple, content_hash: object, pad: i64) -> Item:
    """:func:`with_pad` of an item whose fields ``f`` (``astuple``) are at hand: an
    Item made from them (a third fewer instructions than replace's keywords)."""
    if type(item) is not Item:  # a subclass keeps its type
        return _replace(item, hash=content_hash, pad_value=pad)
    return Item(
        f[_I_MOD], content_hash, pad, f[_I_OFFSETS], f[_I_FEATURE], f[_I_SHM], f[_I_SIDE],
        f[_I_EXTRA], f[_I_HANDSHAKE],
    )  # fmt: skip


@cython.ccall
def pad_value(modality: cython.int, content_hash: cython.ulonglong) -> i64:
    """Rule 6: the pad value of a content hash (``modality`` 1 image, 2 video, 3 audio)."""
    return _pad_lo(modality) + cython.cast(i64, content_hash % _SLOTS)


@cython.boundscheck(False)
@cython.wraparound(False)
def first_outside(ids: cython.const[i64][::1], vocab: i64) -> ssize:
    """Rule 1's vocabulary bound: the index of the first id outside ``[0, vocab)``,
    -1 when there is none. One pass that only says whether any id is outside,
    then, only then, the search for the first."""
    n: ssize = ids.shape[0]
    i: ssize = 0
    if vocab <= 0:
        return 0 if n else -1
    last: u64 = vocab - 1
    bad: u64 = 0
    if cython.compiled:
        # an id is outside iff bit 63 is set in id | (last - id), both read as
        # unsigned (a negative id has it; so has last - id, wrapped, for an id
        # above last): subtracts and ors with no compare, which compilers turn
        # into vector code for any x86-64 (2 ids at a time, 4 with AVX2)
        while i < n:
            bad |= cython.cast(u64, ids[i]) | (last - cython.cast(u64, ids[i]))
            i += 1
        bad >>= 63
    else:  # the same verdict over Python ints (--native off)
        bad = any(v < 0 or v >= vocab for v in ids.tolist())
    if bad:
        for i in range(n):
            if ids[i] < 0 or ids[i] >= vocab:
                return i
    return -1


def f32(x: float) -> float:
    """Round a double to float32, as numpy's float32 arithmetic does (nearest-even).

    Products of two float32 values are exact in a double, so rounding the double
    product reproduces a float32 multiplication bit for bit. Beyond float32's
    range the result is an infinity (NaN stays NaN), as in float32 arithmetic.
    """
    if not -_F32_INF_FROM < x < _F32_INF_FROM:
        return x if x != x else math.copysign(math.inf, x)
    return float(_F32.unpack(_F32.pack(x))[0])


@cython.cfunc
@cython.inline
@cython.exceptval(check=False)
def _round32(x: cython.double) -> cython.double:
    """:func:`f32` without the calls where the build has C floats (the same conversion;
    a double beyond float32's range is left to :func:`f32`: C leaves that cast undefined)."""
    if cython.compiled and -_F32_INF_FROM < x < _F32_INF_FROM:
        return cython.cast(cython.float, x)
    return f32(x)


class RuleSet:
    """A profile's constants of rules 5 and 6, computed once per materializer."""

    def __init__(self, profile: ModelProfile) -> None:
        family = profile.family
        self.profile = profile
        self.supported = sum(1 << int(m) for m in Modality if profile.supports(m))  # bit mask
        self.model_name = profile.model_type or family.value
        self.uses_mrope = profile.uses_mrope
        self.merge = profile.spatial_merge_size
        self.split_video = family.video_run_per_frame
        self.time_mode = {Family.QWEN2_5_VL: _TIME_QWEN25, Family.QWEN3_OMNI: _TIME_OMNI}.get(
            family, _TIME_FRAME
        )
        # the side keys holding a video's seconds per grid row, in lookup order
        omni = family is Family.QWEN3_OMNI
        self.time_keys = _OMNI_TIME_KEYS if omni else _QWEN25_TIME_KEYS
        default = (profile.seconds_per_chunk or 2.0) if omni else 1.0
        self.default_seconds = f32(default)
        self.tps = f32(float(profile.tokens_per_second or 0.0))
        self.pps = f32(float(profile.position_id_per_seconds or 0.0))


class Spans:
    """Every span of a request sorted by start (``stop`` exclusive), with its item."""

    __slots__ = ("owner", "start", "stop")

    def __init__(self, start: np.ndarray, stop: np.ndarray, owner: np.ndarray) -> None:
        self.start = start
        self.stop = stop
        self.owner = owner


class ItemPlan:
    """What rules 5 and 6 derive from valid items.

    ``spans``: sorted by start. ``runs``: the M-RoPE run plan (None for the
    other families). ``pads``: each item's pad value, -1 where the feature
    must be hashed first. ``new_items``: rule 6 applied: the same item where
    pad_value was set (or none is needed), a copy with hash and pad_value set
    where a hash was supplied, None where the feature must be hashed.
    """

    __slots__ = ("new_items", "pads", "runs", "spans")

    def __init__(
        self, spans: Spans, runs: RunPlan | None, pads: np.ndarray, new_items: list[Item | None]
    ) -> None:
        self.spans = spans
        self.runs = runs
        self.pads = pads
        self.new_items = new_items


# ------------------------------------------------------------------ spans


def _describe(owner: int, k: int, start: int, end: int) -> str:
    return f"item {owner}: span {k} [{start}, {end}]"


@cython.cfunc
def _offsets(off: object) -> np.ndarray:
    """An item's spans as an int64 ``[k, 2]`` array (rows ``[start, end]``)."""
    if type(off) is np.ndarray:
        dt = off.dtype
        if (dt is _I64 or dt == _I64) and off.ndim == 2 and off.shape[1] == 2:
            return off
    return np.asarray(off, dtype=np.int64).reshape(-1, 2)


@cython.boundscheck(False)
@cython.wraparound(False)
def _span_table(offs: list, n: i64, wants: np.ndarray) -> np.ndarray:
    """Every span in item order, checked inside ``input_ids``: a ``[5, S]`` int64 table
    with rows start, stop (exclusive), owner item, index in its item, and the owner's
    placeholder id (``wants``: int64, one per item). The first span out of bounds,
    in item order, is the one reported."""
    try:  # one copy of C-contiguous arrays (what the codecs make): 4x faster than concatenate
        pairs = np.frombuffer(b"".join(offs), np.int64).reshape(-1, 2)
    except (BufferError, TypeError, ValueError):  # a non-contiguous view
        pairs = np.concatenate(offs) if offs else np.zeros((0, 2), np.int64)
    total: ssize = len(pairs)
    table = np.empty((5, total), np.int64)
    pv: cython.const[i64][:, :] = pairs
    tv: i64[:, ::1] = table
    wv: i64[::1] = wants
    pos: ssize = 0
    i: ssize
    k: ssize
    a: i64
    b: i64
    for i in range(len(offs)):
        for k in range(len(offs[i])):
            a = pv[pos, 0]
            b = pv[pos, 1]
            if a < 0 or a > b or b >= n:
                raise InvalidRequest(
                    f"{_describe(i, k, a, b)} is not a valid inclusive range inside "
                    f"input_ids (0 <= start <= end < {n})"
                )
            tv[0, pos] = a
            tv[1, pos] = b + 1
            tv[2, pos] = i
            tv[3, pos] = k
            tv[4, pos] = wv[i]
            pos += 1
    return table


@cython.boundscheck(False)
@cython.wraparound(False)
def _sorted_disjoint(table: np.ndarray) -> Spans:
    """The spans sorted by start; overlapping ones are refused."""
    tv: i64[:, ::1] = table
    total: ssize = tv.shape[1]
    k: ssize
    for k in range(1, total):
        if tv[0, k] < tv[0, k - 1]:
            table = np.ascontiguousarray(table[:, np.argsort(table[0], kind="stable")])
            tv = table
            break
    for k in range(1, total):
        if tv[0, k] < tv[1, k - 1]:
            raise InvalidRequest(
                f"{_describe(tv[2, k], tv[3, k], tv[0, k], tv[1, k] - 1)} overlaps "
                f"{_describe(tv[2, k - 1], tv[3, k - 1], tv[0, k - 1], tv[1, k - 1] - 1)}"
            )
    return Spans(table[0], table[1], table[2])


def _unchecked_table(items: list, n: int) -> np.ndarray:
    """:func:`_span_table` of items whose offsets may be missing (they contribute none)."""
    offs = [_offsets(() if it.offsets is None else it.offsets) for it in items]
    return _span_table(offs, n, np.full(len(items), -1, np.int64))


def spans_of(items: list, n: int) -> Spans:
    """Every item's spans, checked inside ``input_ids`` and disjoint, sorted by start.

    Items without offsets contribute none (the caller decides whether that is
    allowed). Errors name the item and its span.
    """
    return _sorted_disjoint(_unchecked_table(items, n))


def _check_placeholders(
    ids: np.ndarray, table: np.ndarray, modalities: np.ndarray, placeholders: tuple
) -> None:
    """Every token of a span is its modality's placeholder (spans in item order: the
    first one that is not is reported)."""
    k = first_mismatch(ids, table[0], table[1], table[4])
    if k < 0:
        return
    a, b, who, kin, want = (int(x) for x in table[:, k])
    off = int(np.flatnonzero(ids[a:b] != want)[0])
    modality = int(modalities[who])
    shown = placeholders[modality - 1]
    raise InvalidRequest(
        f"{_describe(who, kin, a, b - 1)} holds token {int(ids[a + off])} at "
        f"{a + off}; every token in a {Modality(modality).name.lower()} span must be "
        f"the placeholder {-1 if shown is None else shown}"
    )


def _want(placeholder: int | None) -> int:
    """A placeholder id as the span check compares it: a request's override may be any
    msgpack int, and one outside int64 (like a missing id) matches no token (-1: ids
    were checked to be in [0, vocab))."""
    if placeholder is None or not INT64_MIN <= placeholder <= INT64_MAX:
        return -1
    return placeholder


# ------------------------------------------------------------------ grids and timing


def check_no_audio_in_video(idx: int, item: Item) -> None:
    flag = item.side.get(AUDIO_IN_VIDEO)
    if flag is None:
        return
    if isinstance(flag, Tensor):
        on = flag.nbytes > 0 and flag.dtype.numpy is not None and bool(flag.to_numpy().any())
    else:
        on = bool(flag)
    if on:
        raise Unsupported(
            f"item {idx}: use_audio_in_video (audio interleaved into video) is not supported yet"
        )


@cython.cfunc
def _grid_tensor(idx: ssize, side: dict, modality: i64) -> tuple:
    """The item's grid tensor after the key, dtype and shape checks, as its fields
    (``astuple``; None: audio)."""
    if modality == 3:
        for key in (IMAGE_GRID, VIDEO_GRID):
            if key in side:
                raise InvalidRequest(f"item {idx}: an audio item must not carry {key}")
        return None
    is_video = modality == 2
    key = VIDEO_GRID if is_video else IMAGE_GRID
    wrong = IMAGE_GRID if is_video else VIDEO_GRID
    name = "video" if is_video else "image"
    if wrong in side:
        raise InvalidRequest(f"item {idx}: a {name} item must not carry {wrong}")
    tensor = side.get(key)
    if tensor is None:
        raise InvalidRequest(f"item {idx}: {name} item has no {key}")
    if not isinstance(tensor, Tensor):
        raise InvalidRequest(f"item {idx}: {key} must be a tensor")
    tf: tuple = astuple(tensor)
    dtype = tf[_T_DTYPE]
    if dtype is not _DT_INT64 and not dtype.is_integer:
        raise InvalidRequest(f"item {idx}: {key} must be an integer tensor, got dtype {dtype.name}")
    shape: tuple = tf[_T_SHAPE]
    rank: ssize = len(shape)
    if not ((rank == 1 and shape[0] == 3) or (rank == 2 and shape[1] == 3 and shape[0] > 0)):
        raise InvalidRequest(f"item {idx}: {key} must have shape [rows, 3], got {list(shape)}")
    return tf


@cython.cfunc
def _grid_values(idx: ssize, key: str, side: dict, tf: tuple) -> memoryview:
    """The values ``t, h, w, t, h, w, ...`` of the grid ``side[key]`` (``tf``: its
    fields) as int64 bytes (a byte view, read by :func:`_i64_at`; the wire's
    dtype: the tensor's own bytes)."""
    if tf[_T_DTYPE] is _DT_INT64:
        return tf[_T_DATA]  # a tensor keeps a flat byte view
    tensor = side[key]
    values = tensor.to_numpy().reshape(-1)
    if values.dtype.kind == "u" and values.size and int(values.max()) > INT64_MAX:
        raise InvalidRequest(f"item {idx}: {key} values must fit in int64, got {_shown(tensor)}")
    return memoryview(np.ascontiguousarray(values, np.int64)).cast("B")


@cython.cfunc
@cython.exceptval(check=False)
def _i64_at(data: memoryview, j: ssize) -> i64:
    """The ``j``-th native int64 of the flat byte view ``data`` (in bounds: the caller's;
    compiled, read from the view's buffer, without an object per value)."""
    x: i64 = 0
    if cython.compiled:
        at: cython.p_char = cython.cast(cython.p_char, PyMemoryView_GET_BUFFER(data).buf)
        memcpy(cython.address(x), at + 8 * j, 8)
    else:
        x = int.from_bytes(data[8 * j : 8 * j + 8], sys.byteorder, signed=True)
    return x


@cython.cfunc
@cython.exceptval(check=False)
def _f32_at(data: memoryview, j: ssize) -> cython.double:
    """The ``j``-th native float32 of the flat byte view ``data``, as a double (as
    :func:`_i64_at`)."""
    x: cython.float = 0
    if cython.compiled:
        at: cython.p_char = cython.cast(cython.p_char, PyMemoryView_GET_BUFFER(data).buf)
        memcpy(cython.address(x), at + 4 * j, 4)
    else:
        x = data[4 * j : 4 * j + 4].cast("f")[0]
    return x


def _shown(tensor: Tensor) -> list:
    """A grid as an error message shows it: its rows."""
    flat = tensor.to_numpy().reshape(-1).tolist()
    return [flat[k : k + 3] for k in range(0, len(flat), 3)]


@cython.cfunc
def _seconds_per_row(keys: tuple, idx: ssize, side: dict, rows: ssize) -> memoryview:
    """float32 seconds per grid row of a video item, as float32 bytes (a byte view, read
    by :func:`_f32_at`): one value (every row) or one per row, from the first of
    ``keys`` it carries; None: none (the family's default)."""
    k: ssize
    v: cython.double
    for key in keys:
        tensor = side.get(key)
        if tensor is None:
            continue
        if not isinstance(tensor, Tensor):
            raise InvalidRequest(f"item {idx}: {key} must be a numeric tensor")
        tf: tuple = astuple(tensor)
        dtype = tf[_T_DTYPE]
        if dtype is _DT_FLOAT32:
            values = tf[_T_DATA]  # a tensor keeps a flat byte view
        elif (dtype.is_float or dtype.is_integer) and dtype.numpy is not None:
            values = memoryview(tensor.to_numpy().astype(np.float32).reshape(-1)).cast("B")
        else:
            raise InvalidRequest(f"item {idx}: {key} must be a numeric tensor")
        count: ssize = len(values) // 4
        if count != 1 and count != rows:
            raise InvalidRequest(
                f"item {idx}: {key} holds {count} values; expected 1 or one per grid row ({rows})"
            )
        for k in range(count):
            v = _f32_at(values, k)
            if not 0 <= v < MAX_SECONDS_PER_ROW:  # also rejects NaN
                raise InvalidRequest(
                    f"item {idx}: {key} must hold finite non-negative seconds "
                    f"(below {MAX_SECONDS_PER_ROW:g})"
                )
        return values
    return None


@cython.cfunc
@cython.exceptval(check=False)
def _time(mode: cython.int, k: i64, seconds: cython.double, rate: cython.double) -> cython.double:
    """Frame ``k``'s temporal index of a video run (docs/spec/MATERIALIZE.md table) before its
    truncation: float32 math; ``rate``: the profile's tokens_per_second or
    position_id_per_seconds. The caller bounds it before making it an int."""
    if mode == _TIME_QWEN25:  # trunc((k * s) * tokens_per_second)
        return _round32(_round32(k * seconds) * rate)
    if mode == _TIME_OMNI:  # trunc(k * (s * position_id_per_seconds))
        return _round32(k * _round32(seconds * rate))
    return k


def _shown_index(x: float) -> object:
    """A temporal index as a message shows it: truncated, as it would be used."""
    return int(x) if math.isfinite(x) else x


@cython.boundscheck(False)
@cython.wraparound(False)
def _plan_runs(
    rs: RuleSet, items: list, sides: list, modalities: np.ndarray, table: np.ndarray, n: i64
) -> RunPlan:
    """Match every item's spans to its grid rows and return the runs in prompt order.

    Spans are already valid (bounds, disjointness, placeholder ids); this checks
    the grids and that each span's length equals its row's merged patch count.
    ``table``: :func:`_span_table`'s, in item order; ``sides``: each item's side
    tensors as a dict (:func:`_side`); ``n``: ``len(input_ids)``, which bounds
    every span (so every product formed here).
    """
    merge: i64 = rs.merge
    split_video: cython.bint = rs.split_video
    mode: cython.int = rs.time_mode
    rate: cython.double = rs.pps if mode == _TIME_OMNI else rs.tps
    default_seconds: cython.double = rs.default_seconds
    keys: tuple = rs.time_keys
    mv: i64[::1] = modalities
    tv: i64[:, ::1] = table
    n_spans: ssize = tv.shape[1]
    runs = np.empty((5, n_spans), np.int64)
    rv: i64[:, ::1] = runs
    t_index = np.empty(2 * n_spans + 16, np.int64)  # grown when a video needs more
    xv: i64[::1] = t_index
    n_t: ssize = 0  # temporal indices so far
    r: ssize = 0  # runs so far
    s0: ssize = 0  # the item's first span in the table
    idx: ssize
    k: ssize
    f: i64
    t: i64
    h: i64
    w: i64
    hh: i64
    ww: i64
    a: i64
    length: i64
    want: i64
    expected: i64
    units: i64
    unit_t: i64
    last: cython.double
    sec: cython.double
    ordered: cython.bint = True
    for idx in range(len(items)):
        s_item: ssize = s0
        while s0 < n_spans and tv[2, s0] == idx:
            s0 += 1
        n_item_spans: ssize = s0 - s_item
        side: dict = sides[idx]
        if AUDIO_IN_VIDEO in side:
            check_no_audio_in_video(idx, items[idx])
        tf = _grid_tensor(idx, side, mv[idx])
        if tf is None:
            continue
        is_video: cython.bint = mv[idx] == 2
        key = VIDEO_GRID if is_video else IMAGE_GRID
        g = _grid_values(idx, key, side, tf)  # t, h, w per row: 24 bytes
        n_rows: ssize = len(g) // 24
        split: cython.bint = is_video and split_video  # one span per temporal frame of a row
        expected = 0
        for k in range(n_rows):
            t = _i64_at(g, 3 * k)
            h = _i64_at(g, 3 * k + 1)
            w = _i64_at(g, 3 * k + 2)
            if t <= 0 or h <= 0 or w <= 0:
                raise InvalidRequest(
                    f"item {idx}: {key} rows must be positive, got {_shown(side[key])}"
                )
            if h % merge or w % merge:
                raise InvalidRequest(
                    f"item {idx}: {key} h and w must be divisible by spatial_merge_size "
                    f"{merge}, got {_shown(side[key])}"
                )
            if not is_video and t != 1:
                raise InvalidRequest(
                    f"item {idx}: {key} rows must have t == 1, got {_shown(side[key])}"
                )
            if expected <= n:  # beyond n it cannot match: no larger sum is formed
                expected += min(t, n + 1) if split else 1
        if n_item_spans != expected:
            rows = _shown(side[key])
            unit = "temporal frame" if split else "grid row"
            exact = sum(row[0] for row in rows) if split else len(rows)
            raise InvalidRequest(
                f"item {idx}: {n_item_spans} placeholder spans but {exact} expected "
                f"(one per {unit}; {key}={rows})"
            )
        seconds = _seconds_per_row(keys, idx, side, n_rows) if is_video else None
        s: ssize = 0
        for k in range(n_rows):
            if n_rows > 1:  # one row: t, h, w hold it
                t = _i64_at(g, 3 * k)
                h = _i64_at(g, 3 * k + 1)
                w = _i64_at(g, 3 * k + 2)
            hh = h // merge
            ww = w // merge
            units = t if split else 1
            unit_t = 1 if split else t
            for _ in range(units):
                a = tv[0, s_item + s]
                length = tv[1, s_item + s] - a
                # want = unit_t * hh * ww, formed only while it can equal a span (<= n)
                want = -1
                if hh <= n // unit_t and ww <= n // (unit_t * hh):
                    want = unit_t * hh * ww
                if length != want:
                    row = [_i64_at(g, 3 * k + j) for j in range(3)]
                    exact = unit_t * (row[1] // merge) * (row[2] // merge)
                    raise InvalidRequest(
                        f"item {idx}: span {s} [{a}, {a + length - 1}] holds {length} tokens; "
                        f"grid row {k} {row} requires {exact} "
                        f"(t*h*w/{merge * merge}" + (" per frame)" if split else ")")
                    )
                if r and a < rv[0, r - 1]:
                    ordered = False
                rv[0, r] = a
                rv[1, r] = unit_t
                rv[2, r] = hh
                rv[3, r] = ww
                rv[4, r] = n_t
                if n_t + unit_t > xv.shape[0]:
                    t_index = _grown(t_index, n_t + unit_t)
                    xv = t_index
                if is_video and not split:
                    sec = (
                        default_seconds
                        if seconds is None
                        else _f32_at(seconds, 0 if len(seconds) == 4 else k)
                    )
                    last = _time(mode, unit_t - 1, sec, rate)  # monotone: the extreme
                    if not 0 <= last < MAX_TEMPORAL_INDEX:  # also NaN
                        raise InvalidRequest(
                            f"item {idx}: grid row {k} gives frame {unit_t - 1} the temporal "
                            f"index {_shown_index(last)}, outside [0, {MAX_TEMPORAL_INDEX}) "
                            f"(seconds per grid row {sec:g})"
                        )
                    for f in range(unit_t):
                        xv[n_t + f] = cython.cast(i64, _time(mode, f, sec, rate))
                else:
                    for f in range(unit_t):
                        xv[n_t + f] = 0
                n_t += unit_t
                r += 1
                s += 1
    runs = runs[:, :r]
    if not ordered:
        runs = runs[:, np.argsort(runs[0], kind="stable")]
    return RunPlan(runs[0], runs[1], runs[2], runs[3], runs[4], t_index[:n_t])


def _grown(buf: np.ndarray, need: int) -> np.ndarray:
    out = np.empty(max(need, 2 * len(buf)), np.int64)
    out[: len(buf)] = buf
    return out


def _side(side: object) -> dict:
    """An item's side tensors as a dict (what every codec builds; a mapping is copied)."""
    return side if type(side) is dict else dict(side)


def plan_runs(profile: ModelProfile, items: list) -> RunPlan:
    """The grid checks and run plan alone, for items whose spans are known valid
    (tests and tools; the materializer calls :func:`plan_items`)."""
    items = list(items)
    n = 2**62
    table = _unchecked_table(items, n)
    modalities = np.array([int(it.modality) for it in items], np.int64)
    sides = [_side(it.side) for it in items]
    return _plan_runs(RuleSet(profile), items, sides, modalities, table, n)


# ------------------------------------------------------------------ tensor limits


def _breach(what: TensorName, t: Tensor, limits: Limits) -> None:
    """The limit ``t`` breaks, worded by :mod:`mmadmit.limits`."""
    check_shape(what, t.shape, limits)
    raise tensor_bytes_over(what, t.shape, t.dtype.name, t.data.nbytes, limits.max_tensor_bytes)


def _within(t: Tensor, rank: int, dim: int, nbytes_max: int) -> bool:
    shape = t.shape
    if len(shape) > rank or t.data.nbytes > nbytes_max:
        return False
    for d in shape:
        if d > dim:
            return False
    return True


def tensors_within(mm: MultimodalInputs, limits: Limits) -> None:
    """Every tensor of a request within ``limits``, and every shared-memory feature's
    declared shape. A tensor built with these very limits was checked when it was
    built (:class:`mmadmit.model.Tensor`); any other (built by a caller without
    limits, or under other ones) is checked here. Names are made only for a breach."""
    rank = limits.max_tensor_rank
    dim = limits.max_tensor_dim
    nbytes = limits.max_tensor_bytes
    for key in ("mrope_positions", "mrope_position_delta"):
        t = getattr(mm, key)
        if t is not None and t.limits is not limits and not _within(t, rank, dim, nbytes):
            _breach(TensorName(None, key), t, limits)
    items = mm.items
    for i in range(len(items)):
        f: tuple = astuple(items[i])
        t = f[_I_FEATURE]
        if t is not None and t.limits is not limits and not _within(t, rank, dim, nbytes):
            _breach(TensorName(i, "feature"), t, limits)
        shm = f[_I_SHM]
        if shm is not None and shm.shape is not None:
            check_shape(TensorName(i, "feature_shm"), shm.shape, limits)
        for key, value in f[_I_SIDE].items():
            if (
                isinstance(value, Tensor)
                and value.limits is not limits
                and not _within(value, rank, dim, nbytes)
            ):
                _breach(TensorName(i, key), value, limits)


# ------------------------------------------------------------------ entry point


@cython.boundscheck(False)
@cython.wraparound(False)
def plan_items(
    rs: RuleSet,
    items: list,
    ids: np.ndarray,
    placeholders: tuple,
    need_pad: cython.bint,
    hashable: cython.bint = True,
) -> ItemPlan:
    """Rules 5 and 6 over ``items``; ``ids`` are the original (unpadded) ids and
    ``placeholders`` the image, video and audio placeholder ids (None: no such id).

    ``need_pad``: every item must carry its pad value (rule 4). ``hashable``:
    an item without hash nor pad value needs a feature to hash (False for the
    decode exemption, which needs no pad values).
    """
    n_items: ssize = len(items)
    info = np.empty((4, n_items), np.int64)
    iv: i64[:, ::1] = info
    wants = [_want(p) for p in placeholders]
    offs: list = []
    fields: list = [None] * n_items  # each item's astuple
    supported: cython.int = rs.supported
    i: ssize
    mi: cython.int
    for i in range(n_items):
        f: tuple = astuple(items[i])
        fields[i] = f
        m = f[_I_MOD]
        modality = _MODALITY_OF.get(m)
        if modality is None:
            raise InvalidRequest(f"item {i}: unknown modality {m} (1 image, 2 video, 3 audio)")
        mi = modality
        if not (supported >> mi) & 1:
            raise InvalidRequest(
                f"item {i}: the model ({rs.model_name}) takes no {modality.name.lower()} input"
            )
        off = f[_I_OFFSETS]
        if off is None or len(off) == 0:
            raise InvalidRequest(f"item {i}: offsets must be a non-empty list of [start, end]")
        offs.append(_offsets(off))
        iv[_COL_MOD, i] = mi
        iv[_COL_WANT, i] = wants[mi - 1]
        # rule 5's hash and pad_value checks, and rule 6's pad value
        h = f[_I_HASH]
        if h is not None and not 0 <= h <= UINT64_MAX:
            raise InvalidRequest(f"item {i}: hash {h} is not an unsigned 64-bit integer")
        pad = f[_I_PAD]
        if pad is not None:
            lo, hi = pad_interval(mi)
            if not lo <= pad <= hi:
                raise InvalidRequest(
                    f"item {i}: pad_value {pad} is outside the "
                    f"{modality.name.lower()} interval [{lo}, {hi}]"
                )
            iv[_COL_PAD, i] = pad
            iv[_COL_HOW, i] = _PAD_SET
        elif need_pad:
            raise InvalidRequest(
                f"item {i}: input_ids_unpadded is set (materialized upstream) but the item has "
                "no pad_value"
            )
        elif h is not None:
            iv[_COL_PAD, i] = pad_value(mi, h)
            iv[_COL_HOW, i] = _PAD_FROM_HASH
        elif not hashable:
            iv[_COL_PAD, i] = -1
            iv[_COL_HOW, i] = _PAD_NONE
        elif f[_I_FEATURE] is None:
            why = (
                "a shared-memory feature cannot be hashed without reading the segment"
                if f[_I_SHM] is not None
                else "it has no feature to hash"
            )
            raise InvalidRequest(f"item {i}: no pad_value and no content hash, and {why}")
        else:
            iv[_COL_PAD, i] = -1
            iv[_COL_HOW, i] = _PAD_HASH_FEATURE
    n: i64 = len(ids)
    table = _span_table(offs, n, info[_COL_WANT])
    spans = _sorted_disjoint(table)
    if n_items:
        _check_placeholders(ids, table, info[_COL_MOD], placeholders)
    if rs.uses_mrope:
        sides = [_side(fields[i][_I_SIDE]) for i in range(n_items)]
        runs = _plan_runs(rs, items, sides, info[_COL_MOD], table, n)
    else:
        runs = None
        for i in range(n_items):
            check_no_audio_in_video(i, items[i])
    new_items: list = []
    for i in range(n_items):
        item = items[i]
        if iv[_COL_HOW, i] == _PAD_FROM_HASH:
            f = fields[i]
            new_items.append(_with_pad_of(item, f, f[_I_HASH], int(iv[_COL_PAD, i])))
        elif iv[_COL_HOW, i] == _PAD_HASH_FEATURE:
            new_items.append(None)
        else:
            new_items.append(item)
    return ItemPlan(spans, runs, info[_COL_PAD], new_items)


# ------------------------------------------------------------------ per-token loops
#
# The loops over tokens: rule 5's placeholder check (first_mismatch), rule 7's
# positions and rule 8's substitution (fill_spans). Each public function checks
# every index it is given before any access (ValueError otherwise), so memory
# safety never depends on its caller. Compiled, the loops are C over int64
# buffers, without the GIL from _GIL_MIN tokens; interpreted, each helper's
# innermost loop is one numpy slice operation, so Python runs per span or grid
# row, never per token.

_GIL_MIN = cython.declare(ssize, 1 << 16)
# positions: from this many tokens the output is allocated 64-byte aligned. The
# heap gives large arrays addresses 16 or 32 bytes past a cache line, as it
# happens; vector stores that straddle lines made the 128K-token grid loops
# 66 us instead of 41 (one process, AVX2), while aligning costs about 2 us.
_ALIGN_MIN = cython.declare(ssize, 16_384)
_SHORT = cython.declare(ssize, 32)  # a loop writes this much; memcpy doubles it


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _repeat(o: i64[::1], a: ssize, length: ssize, total: ssize) -> cython.void:
    """``o[a : a + total]`` = ``o[a : a + length]`` repeated (the last copy cut short).
    Compiled, by doubling ``memcpy``: the C library picks the widest vector
    stores the CPU has, which loops compiled for any x86-64 cannot."""
    done: ssize = length
    m: ssize
    if cython.compiled:
        while done < total:
            m = done if done < total - done else total - done
            memcpy(cython.address(o[a + done]), cython.address(o[a]), m * 8)
            done += m
    elif total > length:
        o[a + length : a + total] = np.resize(o[a : a + length], total - length)


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _fill(o: i64[::1], a: ssize, b: ssize, v: i64) -> cython.void:
    """``o[a:b] = v``."""
    i: ssize
    m: ssize = b - a if b - a < _SHORT else _SHORT
    if cython.compiled:
        for i in range(a, a + m):
            o[i] = v
        _repeat(o, a, m, b - a)
    else:
        o[a:b] = v


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _copy(o: i64[::1], src: cython.const[i64][::1], a: ssize, b: ssize) -> cython.void:
    """``o[a:b] = src[a:b]`` (two buffers)."""
    if cython.compiled:
        if b > a:
            memcpy(cython.address(o[a]), cython.address(src[a]), (b - a) * 8)
    else:
        o[a:b] = src[a:b]


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _differs(ids: cython.const[i64][::1], a: ssize, b: ssize, w: i64) -> cython.bint:
    """Whether ``ids[a:b]`` holds a value other than ``w``. Compiled, a loop checks
    the first values, then each next stretch is compared with the stretch already
    found equal, doubling, by ``memcmp`` (as :func:`_repeat` uses ``memcpy``)."""
    i: ssize
    m: ssize = b - a if b - a < _SHORT else _SHORT
    done: ssize = m
    acc: i64 = 0
    if cython.compiled:
        for i in range(a, a + m):
            acc |= ids[i] ^ w  # no early exit: the loop vectorizes
        while acc == 0 and done < b - a:
            m = done if done < b - a - done else b - a - done
            acc = memcmp(cython.address(ids[a + done]), cython.address(ids[a]), m * 8)
            done += m
        return acc != 0
    else:
        return bool((ids[a:b] != w).any())


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _text(o: i64[:, ::1], a: ssize, b: ssize, v: i64) -> cython.void:
    """Positions ``[a, b)`` of text from position ``v``: ``v, v + 1, ...`` on every axis."""
    i: ssize
    if cython.compiled:
        for i in range(a, b):
            o[0, i] = v + (i - a)
            o[1, i] = v + (i - a)
            o[2, i] = v + (i - a)
    else:
        o[:, a:b] = np.arange(v, v + (b - a), dtype=np.int64)


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _grid(
    o: i64[:, ::1],
    a: ssize,
    frames: ssize,
    rows: ssize,
    cols: ssize,
    origin: i64,
    t_index: cython.const[i64][:],
    t0: ssize,
) -> cython.void:
    """Positions of a ``frames x rows x cols`` run from token ``a`` at ``origin``:
    ``(origin + t_index[t0 + frame], origin + row, origin + col)``."""
    f: ssize
    h: ssize
    j: ssize
    tv: i64
    if cython.compiled:
        for f in range(frames):
            tv = origin + t_index[t0 + f]
            for h in range(rows):
                for j in range(cols):
                    o[0, a + j] = tv
                    o[1, a + j] = origin + h
                    o[2, a + j] = origin + j
                a += cols
    else:
        block = o[:, a : a + frames * rows * cols].reshape(3, frames, rows, cols)
        block[0] = (origin + t_index[t0 : t0 + frames])[:, None, None]
        block[1] = (origin + np.arange(rows, dtype=np.int64))[:, None]
        block[2] = origin + np.arange(cols, dtype=np.int64)


_SPAN_FAULTS = (None, "span arrays must have equal lengths", "span out of range")


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _spans_fault(
    n: ssize,
    a: cython.const[i64][:],
    z: cython.const[i64][:],
    per_span: cython.const[i64][:],
) -> cython.int:
    """0 when spans ``[a[k], z[k])`` lie inside ``[0, n]``, one ``per_span`` value
    each; else the index of the fault in ``_SPAN_FAULTS``."""
    r: ssize
    if z.shape[0] != a.shape[0] or per_span.shape[0] != a.shape[0]:
        return 1
    for r in range(a.shape[0]):
        if a[r] < 0 or a[r] > z[r] or z[r] > n:
            return 2
    return 0


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
def _first_bad(
    ids: cython.const[i64][::1],
    a: cython.const[i64][:],
    z: cython.const[i64][:],
    want: cython.const[i64][:],
) -> ssize:
    r: ssize
    for r in range(a.shape[0]):
        if _differs(ids, a[r], z[r], want[r]):
            return r
    return -1


def first_mismatch(
    ids: cython.const[i64][::1],
    a: cython.const[i64][:],
    z: cython.const[i64][:],
    w: cython.const[i64][:],
) -> ssize:
    """Rule 5's placeholder check: the first span ``k`` (in the given order) holding a
    token of ``ids[a[k]:z[k]]`` other than ``w[k]``; -1 when none. Every argument
    is an int64 array, ``ids`` C-contiguous (compiled, others raise ``ValueError``)."""
    fault: cython.int = _spans_fault(ids.shape[0], a, z, w)
    if fault:
        raise ValueError(_SPAN_FAULTS[fault])
    r: ssize
    if ids.shape[0] >= _GIL_MIN:
        with cython.nogil:
            r = _first_bad(ids, a, z, w)
    else:
        r = _first_bad(ids, a, z, w)
    return r


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
def _copy_fill(
    out: i64[::1],
    ids: cython.const[i64][::1],
    a: cython.const[i64][:],
    z: cython.const[i64][:],
    v: cython.const[i64][:],
) -> cython.void:
    """``out`` = ``ids`` with each span filled: sorted spans in one pass (each element
    written once), others a copy, then the fills in the given order."""
    k: ssize = a.shape[0]
    r: ssize
    at: ssize = 0  # out[:at] is written
    for r in range(1, k):
        if a[r] < z[r - 1]:
            _copy(out, ids, 0, out.shape[0])
            for r in range(k):
                _fill(out, a[r], z[r], v[r])
            return
    for r in range(k):
        _copy(out, ids, at, a[r])
        _fill(out, a[r], z[r], v[r])
        at = z[r]
    _copy(out, ids, at, out.shape[0])


def fill_spans(
    src: cython.const[i64][::1],
    a: cython.const[i64][:],
    z: cython.const[i64][:],
    v: cython.const[i64][:],
) -> np.ndarray:
    """Rule 8: a copy of ``src`` with ``src[a[k]:z[k]] = v[k]``. Every argument is an
    int64 array, ``src`` C-contiguous (compiled, others raise ``ValueError``)."""
    fault: cython.int = _spans_fault(src.shape[0], a, z, v)
    if fault:
        raise ValueError(_SPAN_FAULTS[fault])
    result = np.empty(src.shape[0], np.int64)
    out: i64[::1] = result
    if src.shape[0] >= _GIL_MIN:
        with cython.nogil:
            _copy_fill(out, src, a, z, v)
    else:
        _copy_fill(out, src, a, z, v)
    return result


_RUN_FAULTS = (
    None,
    "run arrays must have equal lengths",
    "run dimensions must be positive",
    "runs must be sorted by start and disjoint",
    "a run extends past the end of the prompt",
    "t_off/frames out of range of t_index",
    "t_index values must be non-negative",
    "positions overflow int64",
)
_I64_MAX = cython.declare(i64, INT64_MAX)


@cython.cfunc
@cython.inline
@cython.nogil
@cython.exceptval(check=False)
def _extent(t_last: i64, rows: i64, cols: i64) -> i64:
    """How far a run reaches past its origin on any axis (its last frame's time
    index, ``rows - 1``, ``cols - 1``): the text after it resumes one further."""
    e: i64 = t_last
    if rows - 1 > e:
        e = rows - 1
    if cols - 1 > e:
        e = cols - 1
    return e


@cython.cfunc
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _runs_fault(
    n: i64,
    start: cython.const[i64][:],
    frames: cython.const[i64][:],
    rows: cython.const[i64][:],
    cols: cython.const[i64][:],
    t_off: cython.const[i64][:],
    t_index: cython.const[i64][:],
) -> cython.int:
    """0 when the runs lie inside a prompt of ``n`` tokens, sorted and disjoint, their
    frames inside ``t_index``, and every position they lead to within int64; else
    the index of the fault in ``_RUN_FAULTS``. The position arithmetic of
    :func:`_fill_positions` is replayed per run and per frame (never per token),
    with every bound compared by subtraction or division, so nothing here
    overflows either."""
    k: ssize = start.shape[0]
    r: ssize
    j: ssize
    s: i64
    f: i64
    h: i64
    w: i64
    t0: i64
    reach: i64
    origin: i64
    pos: i64 = 0
    tok: i64 = 0
    if frames.shape[0] != k or rows.shape[0] != k or cols.shape[0] != k or t_off.shape[0] != k:
        return 1
    for r in range(k):
        s, f, h, w, t0 = start[r], frames[r], rows[r], cols[r], t_off[r]
        if f < 1 or h < 1 or w < 1:
            return 2
        if s < tok:  # tok: the end of the run before, 0 at first
            return 3
        if s > n or f > n or h > n // f or w > (n - s) // (f * h):
            return 4
        if t0 < 0 or t0 > t_index.shape[0] - f:
            return 5
        reach = h - 1 if h > w else w - 1
        for j in range(t0, t0 + f):
            if t_index[j] < 0:
                return 6
            if t_index[j] > reach:
                reach = t_index[j]
        origin = pos + (s - tok)  # pos <= INT64_MAX - n, s - tok <= n
        if origin > _I64_MAX - n - 1 - reach:
            return 7
        pos = origin + _extent(t_index[t0 + f - 1], h, w) + 1
        tok = s + f * h * w
    return 0


@cython.cfunc
@cython.nogil
@cython.exceptval(check=False)
@cython.boundscheck(False)
@cython.wraparound(False)
def _fill_positions(
    o: i64[:, ::1],
    start: cython.const[i64][:],
    frames: cython.const[i64][:],
    rows: cython.const[i64][:],
    cols: cython.const[i64][:],
    t_off: cython.const[i64][:],
    t_index: cython.const[i64][:],
) -> i64:
    """Rule 7 over checked runs; returns the delta."""
    n: ssize = o.shape[1]
    pos: i64 = 0  # the position of the next text token
    tok: ssize = 0  # the next token to write
    r: ssize
    origin: i64
    for r in range(start.shape[0]):
        _text(o, tok, start[r], pos)
        pos += start[r] - tok
        origin = pos
        _grid(o, start[r], frames[r], rows[r], cols[r], origin, t_index, t_off[r])
        pos = origin + _extent(t_index[t_off[r] + frames[r] - 1], rows[r], cols[r]) + 1
        tok = start[r] + frames[r] * rows[r] * cols[r]
    _text(o, tok, n, pos)
    return pos + (n - tok) - n


def positions(n: i64, plan: RunPlan) -> tuple:
    """Rule 7: the ``[3, n]`` int64 M-RoPE positions and the delta (``max + 1 - n``).

    Text counts up by one on every axis; a run at origin ``s`` writes
    ``(s + t_index[frame], s + row, s + col)``, and the text after it resumes at
    ``s + max(t_index[last frame], rows - 1, cols - 1) + 1``. The plan's arrays are
    int64 (compiled, others raise ``ValueError``)."""
    start: cython.const[i64][:] = plan.start
    frames: cython.const[i64][:] = plan.frames
    rows: cython.const[i64][:] = plan.rows
    cols: cython.const[i64][:] = plan.cols
    t_off: cython.const[i64][:] = plan.t_off
    t_index: cython.const[i64][:] = plan.t_index
    if n < 0:
        raise ValueError("n must be >= 0")
    fault: cython.int = _runs_fault(n, start, frames, rows, cols, t_off, t_index)
    if fault:
        raise ValueError(_RUN_FAULTS[fault])
    if n >= _ALIGN_MIN:  # rows that start on a cache line (for n a multiple of 8)
        buf = np.empty(3 * n + 8, np.int64)
        skip = (-buf.__array_interface__["data"][0] % 64) // 8
        result = buf[skip : skip + 3 * n].reshape(3, n)
    else:
        result = np.empty((3, n), np.int64)
    o: i64[:, ::1] = result
    delta: i64
    if n >= _GIL_MIN:
        with cython.nogil:
            delta = _fill_positions(o, start, frames, rows, cols, t_off, t_index)
    else:
        delta = _fill_positions(o, start, frames, rows, cols, t_off, t_index)
    return result, int(delta)
