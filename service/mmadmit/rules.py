"""MATERIALIZE.md rules 5 and 6 over a request's items: the one source.

:func:`plan_items` checks every item of a request (rule 5: modality, spans,
placeholders, hash and pad value ranges, and for the M-RoPE families the
grids, timing tensors and span lengths), then derives what the materializer
needs: the spans sorted by start, the M-RoPE run plan, and each item's pad
value (rule 6) from its supplied hash. It either returns that
(:class:`ItemPlan`) or raises the abort, worded here and nowhere else.

The materializer asks :mod:`mmadmit.planner`'s native pass first; it answers
only "valid, here is the plan" or "not sure", never an abort, and on "not
sure" (or with native code off) this module decides. ``tests/test_planner.py``
and the ``planner`` fuzz target hold the two to the same outcome. Per-token
loops are :mod:`mmadmit.kernels`'; the loops here are per item, span and grid
row. (Compiled by Cython in pure-Python mode, this file measured 1.5-1.75x the
native pass's materialize time, so the native pass stays; README, "Native code".)
"""

import struct

import numpy as np

from . import kernels
from .errors import InvalidRequest, Unsupported
from .hashing import UINT64_MAX, pad_interval, pad_value
from .limits import Limits, check_shape, tensor_bytes_over
from .model import MODALITY_OF, Item, Modality, MultimodalInputs, Tensor, TensorName
from .mrope import RunPlan
from .profile import Family, ModelProfile

IMAGE_GRID = "image_grid_thw"
VIDEO_GRID = "video_grid_thw"
GRID_KEYS = {Modality.IMAGE: IMAGE_GRID, Modality.VIDEO: VIDEO_GRID}
AUDIO_IN_VIDEO = "use_audio_in_video"

# Timing side tensors, in lookup order per family (MATERIALIZE.md table).
_QWEN25_TIME_KEYS = ("second_per_grid_ts", "video_second_per_grid")
_OMNI_TIME_KEYS = ("video_second_per_grid", "second_per_grid_ts")

MAX_SECONDS_PER_ROW = 1e6  # far beyond any video; keeps float32 products finite
# Temporal indices at or above this are refused (a profile's tokens_per_second or
# position_id_per_seconds times MAX_SECONDS_PER_ROW can exceed int64): far beyond
# any video, and low enough that positions never overflow int64.
MAX_TEMPORAL_INDEX = 2**40

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1
_I64 = np.dtype(np.int64)
_F32 = struct.Struct("<f")

# how an item gets its pad value (ItemPlan.new_items)
_PAD_SET = 0  # carried pad_value: the item as it is
_PAD_FROM_HASH = 1  # a copy with hash and pad_value set
_PAD_HASH_FEATURE = 2  # None: the materializer hashes the feature
_PAD_NONE = 3  # no pad value needed (the decode exemption): the item as it is


def f32(x: float) -> float:
    """Round a double to float32, as numpy's float32 arithmetic does (nearest-even).

    Products of two float32 values are exact in a double, so rounding the double
    product reproduces a float32 multiplication bit for bit.
    """
    return float(_F32.unpack(_F32.pack(x))[0])


def time_keys(profile: ModelProfile) -> tuple[str, ...]:
    """The side keys holding a video's seconds per grid row, in lookup order."""
    return _OMNI_TIME_KEYS if profile.family is Family.QWEN3_OMNI else _QWEN25_TIME_KEYS


class RuleSet:
    """A profile's constants of rules 5 and 6, computed once per materializer."""

    def __init__(self, profile: ModelProfile) -> None:
        family = profile.family
        self.profile = profile
        self.supported = frozenset(int(m) for m in Modality if profile.supports(m))
        self.model_name = profile.model_type or family.value
        self.uses_mrope = profile.uses_mrope
        self.merge = profile.spatial_merge_size
        self.split_video = family.video_run_per_frame
        self.family = family
        self.time_keys = time_keys(profile)
        default = (profile.seconds_per_chunk or 2.0) if family is Family.QWEN3_OMNI else 1.0
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


def _offsets(item: Item) -> np.ndarray | None:
    """The item's spans as an int64 ``[k, 2]`` array (rows ``[start, end]``)."""
    off = item.offsets
    if off is None or (type(off) is np.ndarray and off.dtype == _I64 and off.ndim == 2):
        return off
    return np.asarray(off, dtype=np.int64).reshape(-1, 2)


def _span_table(offs: list, n: int, wants: list | None) -> tuple:
    """Every span in item order, checked inside ``input_ids``: ``(table, first)``.

    ``table`` rows: start, stop (exclusive), owner item, index in its item, and the
    owner's placeholder id (when ``wants`` gives one per item, else -1);
    ``first[i]`` is the column of item ``i``'s first span. The first span out of
    bounds, in item order, is the one reported.
    """
    counts = [0 if o is None else len(o) for o in offs]
    present = [o for o in offs if o is not None and len(o)]
    pairs = np.concatenate(present) if present else np.zeros((0, 2), np.int64)
    first = np.zeros(len(offs) + 1, np.int64)
    np.cumsum(counts, out=first[1:])
    owner = np.repeat(np.arange(len(offs), dtype=np.int64), counts)
    kin = np.arange(len(pairs), dtype=np.int64) - first[owner]
    start, end = pairs[:, 0], pairs[:, 1]
    bad = (start < 0) | (start > end) | (end >= n)
    if bad.any():
        k = int(np.argmax(bad))
        raise InvalidRequest(
            f"{_describe(int(owner[k]), int(kin[k]), int(start[k]), int(end[k]))} is not a "
            f"valid inclusive range inside input_ids (0 <= start <= end < {n})"
        )
    want = np.asarray(wants, np.int64)[owner] if wants is not None else np.full_like(owner, -1)
    return np.stack([start, end + 1, owner, kin, want]), first


def _sorted_disjoint(table: np.ndarray) -> Spans:
    """The spans sorted by start; overlapping ones are refused."""
    if table.shape[1] > 1 and (table[0, 1:] < table[0, :-1]).any():
        table = table[:, np.argsort(table[0], kind="stable")]
    clash = table[0, 1:] < table[1, :-1]
    if clash.any():
        k = int(np.argmax(clash)) + 1
        a, b = table[:, k].tolist(), table[:, k - 1].tolist()
        raise InvalidRequest(
            f"{_describe(a[2], a[3], a[0], a[1] - 1)} overlaps "
            f"{_describe(b[2], b[3], b[0], b[1] - 1)}"
        )
    return Spans(table[0], table[1], table[2])


def spans_of(items: list, n: int) -> Spans:
    """Every item's spans, checked inside ``input_ids`` and disjoint, sorted by start.

    Items without offsets contribute none (the caller decides whether that is
    allowed). Errors name the item and its span.
    """
    table, _ = _span_table([_offsets(it) for it in items], n, None)
    return _sorted_disjoint(table)


def _check_placeholders(
    ids: np.ndarray, table: tuple, modalities: list, placeholders: tuple
) -> None:
    """Every token of a span is its modality's placeholder (spans in item order: the
    first one that is not is reported)."""
    start, stop, owner, kin, want = table[0]
    k = kernels.first_mismatch(ids, start, stop, want)
    if k < 0:
        return
    a, b = int(start[k]), int(stop[k])
    off = int(np.flatnonzero(ids[a:b] != want[k])[0])
    who = int(owner[k])
    shown = placeholders[modalities[who] - 1]
    raise InvalidRequest(
        f"{_describe(who, int(kin[k]), a, b - 1)} holds token {int(ids[a + off])} at "
        f"{a + off}; every token in a {Modality(modalities[who]).name.lower()} span must be "
        f"the placeholder {-1 if shown is None else shown}"
    )


def _want(placeholder: int | None) -> int:
    """A placeholder id as the span check compares it: a request's override may be any
    msgpack int, and one outside int64 (like a missing id) matches no token (-1: ids
    were checked to be in [0, vocab))."""
    if placeholder is None or not _INT64_MIN <= placeholder <= _INT64_MAX:
        return -1
    return placeholder


# ------------------------------------------------------------------ hash and pad value


def _pad_of(i: int, item: Item, modality: Modality, need_pad: bool, hashable: bool) -> tuple:
    """Rule 5's hash and pad_value checks, and rule 6's pad value: ``(pad, how)``."""
    h = item.hash
    if h is not None and not 0 <= h <= UINT64_MAX:
        raise InvalidRequest(f"item {i}: hash {h} is not an unsigned 64-bit integer")
    pad = item.pad_value
    if pad is not None:
        lo, hi = pad_interval(modality)
        if not lo <= pad <= hi:
            raise InvalidRequest(
                f"item {i}: pad_value {pad} is outside the "
                f"{modality.name.lower()} interval [{lo}, {hi}]"
            )
        return pad, _PAD_SET
    if need_pad:
        raise InvalidRequest(
            f"item {i}: input_ids_unpadded is set (materialized upstream) but the item has no "
            "pad_value"
        )
    if h is not None:
        return pad_value(modality, h), _PAD_FROM_HASH
    if not hashable:
        return -1, _PAD_NONE
    if item.feature is None:
        why = (
            "a shared-memory feature cannot be hashed without reading the segment"
            if item.feature_shm is not None
            else "it has no feature to hash"
        )
        raise InvalidRequest(f"item {i}: no pad_value and no content hash, and {why}")
    return -1, _PAD_HASH_FEATURE


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


def _grid_rows(idx: int, item: Item, modality: int) -> list | None:
    """The item's grid values ``[t, h, w, t, h, w, ...]`` after the key checks (None: audio)."""
    side = item.side
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
    dtype = tensor.dtype
    if not dtype.is_integer:
        raise InvalidRequest(f"item {idx}: {key} must be an integer tensor, got dtype {dtype.name}")
    shape = tensor.shape
    if not (shape == (3,) or (len(shape) == 2 and shape[1] == 3 and shape[0] > 0)):
        raise InvalidRequest(f"item {idx}: {key} must have shape [rows, 3], got {list(shape)}")
    if dtype.name == "int64" and tensor.data.nbytes % 8 == 0:
        return tensor.data.cast("q").tolist()
    return tensor.to_numpy().reshape(-1).tolist()


def _shown(flat: list) -> list:
    return [flat[k : k + 3] for k in range(0, len(flat), 3)]


def _seconds_per_row(rs: RuleSet, idx: int, item: Item, rows: int) -> list:
    """float32 seconds per grid row for a video item (one value broadcast or one per row)."""
    for key in rs.time_keys:
        tensor = item.side.get(key)
        if tensor is None:
            continue
        if (
            not isinstance(tensor, Tensor)
            or not (tensor.dtype.is_float or tensor.dtype.is_integer)
            or tensor.dtype.numpy is None
        ):
            raise InvalidRequest(f"item {idx}: {key} must be a numeric tensor")
        values: list
        if tensor.dtype.name == "float32" and tensor.data.nbytes % 4 == 0:
            values = tensor.data.cast("f").tolist()
        else:
            values = tensor.to_numpy().astype(np.float32).reshape(-1).tolist()
        if len(values) == 1:
            values = values * rows
        if len(values) != rows:
            raise InvalidRequest(
                f"item {idx}: {key} holds {len(values)} values; "
                f"expected 1 or one per grid row ({rows})"
            )
        for v in values:
            if not 0 <= v < MAX_SECONDS_PER_ROW:  # also rejects NaN
                raise InvalidRequest(
                    f"item {idx}: {key} must hold finite non-negative seconds "
                    f"(below {MAX_SECONDS_PER_ROW:g})"
                )
        return values
    return [rs.default_seconds] * rows


def temporal_index(rs: RuleSet, frames: int, seconds: float) -> list:
    """Temporal index of each frame of a video run (MATERIALIZE.md table), float32 math."""
    family = rs.family
    if family is Family.QWEN2_5_VL:  # trunc((k * s) * tokens_per_second)
        tps = rs.tps
        return [int(f32(f32(k * seconds) * tps)) for k in range(frames)]
    if family is Family.QWEN3_OMNI:  # trunc(k * (s * position_id_per_seconds))
        step = f32(seconds * rs.pps)
        return [int(f32(k * step)) for k in range(frames)]
    return list(range(frames))  # Qwen2-VL (per-frame families never get here)


def _plan_runs(rs: RuleSet, items: list, modalities: list, table: tuple) -> RunPlan:
    """Match every item's spans to its grid rows and return the runs in prompt order.

    Spans are already valid (bounds, disjointness, placeholder ids); this checks
    the grids and that each span's length equals its row's merged patch count.
    """
    merge = rs.merge
    split_video = rs.split_video
    span_start, span_stop = table[0][0].tolist(), table[0][1].tolist()
    first = table[1].tolist()
    starts: list[int] = []
    frames: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    t_off: list[int] = []
    t_index: list[int] = []
    for idx in range(len(items)):
        item = items[idx]
        check_no_audio_in_video(idx, item)
        flat = _grid_rows(idx, item, modalities[idx])
        if flat is None:
            continue
        is_video = modalities[idx] == 2
        key = VIDEO_GRID if is_video else IMAGE_GRID
        grid = _shown(flat)
        split = is_video and split_video  # one span per temporal frame of a row
        for t, h, w in grid:
            if t <= 0 or h <= 0 or w <= 0:
                raise InvalidRequest(f"item {idx}: {key} rows must be positive, got {grid}")
            if h % merge or w % merge:
                raise InvalidRequest(
                    f"item {idx}: {key} h and w must be divisible by spatial_merge_size "
                    f"{merge}, got {grid}"
                )
            if not is_video and t != 1:
                raise InvalidRequest(f"item {idx}: {key} rows must have t == 1, got {grid}")
        expected = sum(row[0] for row in grid) if split else len(grid)
        row0 = first[idx]
        n_item_spans = first[idx + 1] - row0
        if n_item_spans != expected:
            unit = "temporal frame" if split else "grid row"
            raise InvalidRequest(
                f"item {idx}: {n_item_spans} placeholder spans but {expected} expected "
                f"(one per {unit}; {key}={grid})"
            )
        seconds = _seconds_per_row(rs, idx, item, len(grid)) if is_video else None
        s = 0
        for k, (t, h, w) in enumerate(grid):
            hh, ww = h // merge, w // merge
            for unit_t in [1] * t if split else [t]:
                a, b = span_start[row0 + s], span_stop[row0 + s] - 1
                want = unit_t * hh * ww
                if b - a + 1 != want:
                    raise InvalidRequest(
                        f"item {idx}: span {s} [{a}, {b}] holds {b - a + 1} tokens; "
                        f"grid row {k} {[t, h, w]} requires {want} "
                        f"(t*h*w/{merge * merge}" + (" per frame)" if split else ")")
                    )
                starts.append(a)
                frames.append(unit_t)
                rows.append(hh)
                cols.append(ww)
                t_off.append(len(t_index))
                if is_video and not split:
                    assert seconds is not None
                    ti = temporal_index(rs, unit_t, seconds[k])
                    if not 0 <= ti[-1] < MAX_TEMPORAL_INDEX:  # monotone: the last is extreme
                        raise InvalidRequest(
                            f"item {idx}: grid row {k} gives frame {unit_t - 1} the temporal "
                            f"index {ti[-1]}, outside [0, {MAX_TEMPORAL_INDEX}) (seconds per "
                            f"grid row {seconds[k]:g})"
                        )
                    t_index.extend(ti)
                else:
                    t_index.extend([0] * unit_t)
                s += 1
    runs = np.array([starts, frames, rows, cols, t_off], np.int64).reshape(5, -1)
    runs = runs[:, np.argsort(runs[0], kind="stable")]
    return RunPlan(runs[0], runs[1], runs[2], runs[3], runs[4], np.array(t_index, np.int64))


def plan_runs(profile: ModelProfile, items: list) -> RunPlan:
    """The grid checks and run plan alone, for items whose spans are known valid
    (tests and tools; the materializer calls :func:`plan_items`)."""
    items = list(items)
    table = _span_table([_offsets(it) for it in items], 2**62, None)
    return _plan_runs(RuleSet(profile), items, [int(it.modality) for it in items], table)


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
        item = items[i]
        t = item.feature
        if t is not None and t.limits is not limits and not _within(t, rank, dim, nbytes):
            _breach(TensorName(i, "feature"), t, limits)
        shm = item.feature_shm
        if shm is not None and shm.shape is not None:
            check_shape(TensorName(i, "feature_shm"), shm.shape, limits)
        for key, value in item.side.items():
            if (
                isinstance(value, Tensor)
                and value.limits is not limits
                and not _within(value, rank, dim, nbytes)
            ):
                _breach(TensorName(i, key), value, limits)


# ------------------------------------------------------------------ entry point


def plan_items(
    rs: RuleSet,
    items: list,
    ids: np.ndarray,
    placeholders: tuple,
    need_pad: bool,
    hashable: bool = True,
) -> ItemPlan:
    """Rules 5 and 6 over ``items``; ``ids`` are the original (unpadded) ids and
    ``placeholders`` the image, video and audio placeholder ids (None: no such id).

    ``need_pad``: every item must carry its pad value (rule 4). ``hashable``:
    an item without hash nor pad value needs a feature to hash (False for the
    decode exemption, which needs no pad values).
    """
    n_items = len(items)
    pads = []
    hows = []
    modalities = []
    offs = []
    wants = [_want(p) for p in placeholders]
    item_wants = []
    supported = rs.supported
    for i in range(n_items):
        item = items[i]
        m = item.modality
        modality = MODALITY_OF.get(m)
        if modality is None:
            raise InvalidRequest(f"item {i}: unknown modality {m} (1 image, 2 video, 3 audio)")
        mi = int(modality)
        if mi not in supported:
            raise InvalidRequest(
                f"item {i}: the model ({rs.model_name}) takes no {modality.name.lower()} input"
            )
        off = item.offsets
        if off is None or len(off) == 0:
            raise InvalidRequest(f"item {i}: offsets must be a non-empty list of [start, end]")
        off = _offsets(item)
        assert off is not None
        pad, how = _pad_of(i, item, modality, need_pad, hashable)
        pads.append(pad)
        hows.append(how)
        modalities.append(mi)
        offs.append(off)
        item_wants.append(wants[mi - 1])
    table = _span_table(offs, len(ids), item_wants)
    spans = _sorted_disjoint(table[0])
    if n_items:
        _check_placeholders(ids, table, modalities, placeholders)
    if rs.uses_mrope:
        runs = _plan_runs(rs, items, modalities, table)
    else:
        runs = None
        for i in range(n_items):
            check_no_audio_in_video(i, items[i])
    new_items: list = []
    for i in range(n_items):
        how = hows[i]
        item = items[i]
        if how == _PAD_FROM_HASH:
            new_items.append(item.with_pad(item.hash, pads[i]))
        elif how == _PAD_HASH_FEATURE:
            new_items.append(None)
        else:
            new_items.append(item)
    return ItemPlan(spans, runs, np.array(pads, np.int64), new_items)
