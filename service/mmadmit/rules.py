"""docs/spec/MATERIALIZE.md rules 5 and 6 over a request's items (and rule 1's
vocabulary bound): the one source.

:func:`plan_items` checks every item of a request (rule 5: modality, spans,
placeholders, hash and pad value ranges, and for the M-RoPE families the
grids, timing tensors and span lengths), then derives what the materializer
needs: the spans sorted by start, the M-RoPE run plan, and each item's pad
value (rule 6, :func:`pad_value`) from its supplied hash. It either returns
that (:class:`ItemPlan`) or raises the abort, worded here and nowhere else.

One file, two builds (Cython's pure-Python mode, like :mod:`mmadmit.msgpack_walk`).
This file runs as plain Python, and ``setup.py`` also compiles it into
``mmadmit._rules_c`` when Cython and a compiler are present at install time;
:mod:`mmadmit.planner` picks the compiled module unless native code is
switched off (``--native off``). ``tests/test_planner.py`` and the ``planner``
fuzz target run both on valid and on mutated requests and demand the same
outcome, message included. The ``cython.*`` annotations type locals for the
compiled build (C integers, typed memoryviews on int64 tables); interpreted
they do nothing. ``cython.compiled`` is tested where the compiled code must
differ: :func:`_round32`; :func:`_i64_at` and :func:`_f32_at`, which read a
tensor's values from its buffer; and :func:`first_outside`'s pass (C integer
compares compiled, Python ints interpreted: the same verdict).

The work is laid out for the compiled build: everything per span or grid row
runs in loops over C integers on a few int64 tables allocated once per
request, and Python objects are touched once per item (its fields, its grid
and timing tensors). C integers never overflow here: every count and product
is bounded by ``len(input_ids)`` before it is formed (a product that would
pass that bound is refused first), and a grid value outside int64 is refused.
Per-token loops stay in :mod:`mmadmit.kernels`, but for rule 1's vocabulary
bound (:func:`first_outside`, one compare an id): inside a request numpy's
reduction cost 6-10 us at 1K ids, this loop compiled about 1 us.
"""

from __future__ import annotations

import math
import struct
import sys

import cython
import msgspec
import numpy as np
from msgspec.structs import astuple

from . import kernels
from .dtypes import parse_dtype
from .errors import InvalidRequest, Unsupported
from .limits import Limits, check_shape, tensor_bytes_over
from .model import MODALITY_OF, Item, Modality, MultimodalInputs, Tensor
from .mrope import RunPlan
from .profile import Family, ModelProfile
from .tensorcheck import TensorName

if cython.compiled:
    from cython.cimports.cpython.memoryview import PyMemoryView_GET_BUFFER
    from cython.cimports.libc.string import memcpy

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
    top: u64 = vocab
    a: u64 = 0
    b: u64 = 0
    c: u64 = 0
    d: u64 = 0
    if cython.compiled:  # one unsigned compare an id (a negative one is above top),
        # four independent chains: about 1 us for 1K ids, 43 us for 128K
        while i + 4 <= n:
            a |= cython.cast(u64, ids[i]) >= top
            b |= cython.cast(u64, ids[i + 1]) >= top
            c |= cython.cast(u64, ids[i + 2]) >= top
            d |= cython.cast(u64, ids[i + 3]) >= top
            i += 4
        while i < n:
            a |= cython.cast(u64, ids[i]) >= top
            i += 1
    else:  # the same verdict over Python ints (--native off)
        a = any(v < 0 or v >= vocab for v in ids.tolist())
    if a | b | c | d:
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
    k = kernels.first_mismatch(ids, table[0], table[1], table[4])
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
