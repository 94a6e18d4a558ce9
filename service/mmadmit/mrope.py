"""M-RoPE positions for the Qwen-VL families (MATERIALIZE.md "M-RoPE conventions").

Two steps, both transport-free:

* :func:`plan_runs` turns the items' spans and grids into *runs*: placeholder
  runs that get 3-D grid positions. It validates grids against spans under the
  family's convention and raises :class:`InvalidRequest` naming the item, the
  span and what was expected. Audio spans (Qwen3-Omni) advance linearly on all
  axes exactly like text, so they produce no run.
* :func:`positions` builds the ``[3, N]`` int64 positions and the delta from the
  runs with array operations only: no Python loop over tokens or over runs on
  the token axis. :func:`delta_only` gives the delta without per-token work
  (the decode exemption needs nothing else).

A run starting at position ``s`` with merged grid ``T' x H' x W'`` gets
``t = s + t_index[frame]``, ``h = s + row``, ``w = s + col``; the text after it
resumes at ``s + extent + 1`` with ``extent = max(t_index[-1], H'-1, W'-1)``.
Because every run ends one below where the next token starts, the largest
position of the prompt is ``N - 1 + shift`` where ``shift`` is the total
displacement, so ``delta = shift``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest, Unsupported
from .model import MODALITY_OF, Item, Modality, Tensor
from .profile import Family, ModelProfile

GRID_KEYS = {Modality.IMAGE: "image_grid_thw", Modality.VIDEO: "video_grid_thw"}

# Timing side tensors, in lookup order per family (MATERIALIZE.md table).
_QWEN25_TIME_KEYS = ("second_per_grid_ts", "video_second_per_grid")
_OMNI_TIME_KEYS = ("video_second_per_grid", "second_per_grid_ts")


@dataclass(frozen=True)
class RunPlan:
    """The runs of one prompt, as parallel int64 arrays sorted by start.

    ``t_index`` holds every run's temporal indices back to back; run ``k`` owns
    ``t_index[t_off[k] : t_off[k] + frames[k]]``.
    """

    start: np.ndarray
    frames: np.ndarray  # T'
    rows: np.ndarray  # H'
    cols: np.ndarray  # W'
    t_off: np.ndarray
    t_index: np.ndarray

    @property
    def length(self) -> np.ndarray:
        return self.frames * self.rows * self.cols

    @property
    def extent(self) -> np.ndarray:
        """Largest offset inside each run over all three axes."""
        if len(self.start) == 0:
            return np.zeros(0, np.int64)
        last_t = self.t_index[self.t_off + self.frames - 1]
        return np.maximum(np.maximum(last_t, self.rows - 1), self.cols - 1)


def _grid_rows(
    profile: ModelProfile, idx: int, item: Item, modality: Modality
) -> list[list[int]] | None:
    """The item's raw grid rows ``[[t, h, w], ...]`` after the key checks (None for audio).

    Grids are a few ints per item: plain Python lists beat numpy round trips here.
    """
    if modality is Modality.AUDIO:
        for key in GRID_KEYS.values():
            if key in item.side:
                raise InvalidRequest(f"item {idx}: an audio item must not carry {key}")
        return None
    key = GRID_KEYS[modality]
    wrong = GRID_KEYS[Modality.VIDEO if modality is Modality.IMAGE else Modality.IMAGE]
    if wrong in item.side:
        raise InvalidRequest(f"item {idx}: a {modality.name.lower()} item must not carry {wrong}")
    tensor = item.side.get(key)
    if tensor is None:
        raise InvalidRequest(f"item {idx}: {modality.name.lower()} item has no {key}")
    if not isinstance(tensor, Tensor):
        raise InvalidRequest(f"item {idx}: {key} must be a tensor")
    if not tensor.dtype.is_integer:
        raise InvalidRequest(
            f"item {idx}: {key} must be an integer tensor, got dtype {tensor.dtype.name}"
        )
    shape = tensor.shape
    if not (shape == (3,) or (len(shape) == 2 and shape[1] == 3 and shape[0] > 0)):
        raise InvalidRequest(f"item {idx}: {key} must have shape [rows, 3], got {list(shape)}")
    if tensor.dtype.name == "int64" and tensor.data.nbytes % 8 == 0:
        flat = tensor.data.cast("q").tolist()
    else:
        flat = tensor.to_numpy().reshape(-1).tolist()
    return [flat[k : k + 3] for k in range(0, len(flat), 3)]


_F32 = struct.Struct("<f")
MAX_SECONDS_PER_ROW = 1e6  # far beyond any video; keeps float32 products finite
# Temporal indices at or above this are refused (a profile's tokens_per_second or
# position_id_per_seconds times MAX_SECONDS_PER_ROW can exceed int64): far beyond
# any video, and low enough that positions never overflow int64. _planner.c
# leaves such a video to this path, which words the abort.
MAX_TEMPORAL_INDEX = 2**40


def _f32(x: float) -> float:
    """Round a double to float32, as numpy's float32 arithmetic does (nearest-even).

    Products of two float32 values are exact in a double, so rounding the double
    product reproduces a float32 multiplication bit for bit.
    """
    return float(_F32.unpack(_F32.pack(x))[0])


def time_keys(profile: ModelProfile) -> tuple[str, ...]:
    """The side keys holding a video's seconds per grid row, in lookup order."""
    return _OMNI_TIME_KEYS if profile.family is Family.QWEN3_OMNI else _QWEN25_TIME_KEYS


def _seconds_per_row(profile: ModelProfile, idx: int, item: Item, rows: int) -> list[float]:
    """float32 seconds per grid row for a video item (one value broadcast or one per row)."""
    if profile.family is Family.QWEN3_OMNI:
        default = profile.seconds_per_chunk or 2.0
    else:
        default = 1.0
    for key in time_keys(profile):
        tensor = item.side.get(key)
        if tensor is None:
            continue
        if (
            not isinstance(tensor, Tensor)
            or not (tensor.dtype.is_float or tensor.dtype.is_integer)
            or tensor.dtype.numpy is None
        ):
            raise InvalidRequest(f"item {idx}: {key} must be a numeric tensor")
        values: list[float]
        if tensor.dtype.name == "float32" and tensor.data.nbytes % 4 == 0:
            values = [float(v) for v in tensor.data.cast("f").tolist()]
        else:
            values = tensor.to_numpy().astype(np.float32).reshape(-1).tolist()
        if len(values) == 1:
            values = values * rows
        if len(values) != rows:
            raise InvalidRequest(
                f"item {idx}: {key} holds {len(values)} values; "
                f"expected 1 or one per grid row ({rows})"
            )
        if not all(0 <= v < MAX_SECONDS_PER_ROW for v in values):  # also rejects NaN
            raise InvalidRequest(
                f"item {idx}: {key} must hold finite non-negative seconds "
                f"(below {MAX_SECONDS_PER_ROW:g})"
            )
        return values
    return [_f32(default)] * rows


def check_no_audio_in_video(idx: int, item: Item) -> None:
    flag = item.side.get("use_audio_in_video")
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


def plan_runs(profile: ModelProfile, items: Sequence[Item]) -> RunPlan:
    """Match every item's spans to its grid rows and return the runs (rule 5 checks).

    Spans must already be validated (bounds, disjointness, placeholder ids); this
    checks the grids and that each span's length equals its row's merged patch
    count, and builds the runs in prompt order. Work is per grid row and per
    frame (a few per item), never per token.
    """
    merge = profile.spatial_merge_size
    merge2 = merge * merge
    split_video = profile.family.video_run_per_frame
    starts: list[int] = []
    frames: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    t_index: list[int] = []
    t_off: list[int] = []
    for idx, item in enumerate(items):
        modality = MODALITY_OF[item.modality]
        check_no_audio_in_video(idx, item)
        grid = _grid_rows(profile, idx, item, modality)
        if grid is None:
            continue
        assert item.offsets is not None
        key = GRID_KEYS[modality]
        is_video = modality is Modality.VIDEO
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
        split = is_video and split_video  # one span per temporal frame of each row
        expected = sum(row[0] for row in grid) if split else len(grid)
        spans = item.offsets.tolist()
        if len(spans) != expected:
            unit = "temporal frame" if split else "grid row"
            raise InvalidRequest(
                f"item {idx}: {len(spans)} placeholder spans but {expected} expected "
                f"(one per {unit}; {key}={grid})"
            )
        seconds = _seconds_per_row(profile, idx, item, len(grid)) if is_video else None
        k = 0
        for row_i, (t, h, w) in enumerate(grid):
            hh, ww = h // merge, w // merge
            for unit_t in [1] * t if split else [t]:
                start, end = spans[k]
                want = unit_t * hh * ww
                if end - start + 1 != want:
                    raise InvalidRequest(
                        f"item {idx}: span {k} [{start}, {end}] holds {end - start + 1} tokens; "
                        f"grid row {row_i} {[t, h, w]} requires {want} (t*h*w/{merge2}"
                        + (" per frame)" if split else ")")
                    )
                starts.append(start)
                frames.append(unit_t)
                rows.append(hh)
                cols.append(ww)
                t_off.append(len(t_index))
                if is_video and not split:
                    assert seconds is not None
                    tv = _temporal_index(profile, unit_t, seconds[row_i])
                    if not 0 <= tv[-1] < MAX_TEMPORAL_INDEX:  # monotone: the last is extreme
                        raise InvalidRequest(
                            f"item {idx}: grid row {row_i} gives frame {unit_t - 1} the temporal "
                            f"index {tv[-1]}, outside [0, {MAX_TEMPORAL_INDEX}) (seconds per grid "
                            f"row {seconds[row_i]:g})"
                        )
                    t_index.extend(tv)
                else:
                    t_index.extend([0] * unit_t)
                k += 1
    if not starts:
        empty = np.zeros(0, np.int64)
        return RunPlan(empty, empty, empty, empty, empty, empty)
    start_a = np.array(starts, np.int64)
    order = np.argsort(start_a, kind="stable")
    return RunPlan(
        start=start_a[order],
        frames=np.array(frames, np.int64)[order],
        rows=np.array(rows, np.int64)[order],
        cols=np.array(cols, np.int64)[order],
        t_off=np.array(t_off, np.int64)[order],
        t_index=np.array(t_index, np.int64),
    )


def _temporal_index(profile: ModelProfile, frames: int, seconds: float) -> list[int]:
    """Temporal index of each frame of a video run (MATERIALIZE.md table), float32 math."""
    family = profile.family
    if family is Family.QWEN2_5_VL:  # trunc((k * s) * tokens_per_second)
        tps = _f32(float(profile.tokens_per_second or 0.0))
        return [int(_f32(_f32(k * seconds) * tps)) for k in range(frames)]
    if family is Family.QWEN3_OMNI:  # trunc(k * (s * position_id_per_seconds))
        step = _f32(seconds * _f32(float(profile.position_id_per_seconds or 0.0)))
        return [int(_f32(k * step)) for k in range(frames)]
    return list(range(frames))  # Qwen2-VL (per-frame families never get here)


def delta_only(n: int, plan: RunPlan) -> int:
    """The position delta (``max + 1 - N``) without building per-token positions."""
    del n  # the delta does not depend on the prompt length, only on the runs
    return int((plan.extent + 1 - plan.length).sum())


def positions(n: int, plan: RunPlan) -> tuple[np.ndarray, int]:
    """The ``[3, n]`` int64 M-RoPE positions and the delta, vectorized.

    Built as one cumulative sum of per-token increments: text tokens step by 1
    on every axis and run tokens by (0, 0, 1) inside a grid row, so only the
    first token of each grid row and the first text token after each run need
    an explicit jump. Per-token work is a handful of streaming passes; all
    bookkeeping is per grid row (tokens / W of them), never per token.
    """
    k = len(plan.start)
    if k == 0:
        base = np.arange(n, dtype=np.int64)
        return np.broadcast_to(base, (3, n)).copy(), 0
    frames, rows, cols = plan.frames, plan.rows, plan.cols
    length = frames * rows * cols
    shift = plan.extent + 1 - length  # displacement each run adds after itself
    shift_before = np.cumsum(shift) - shift
    origin = plan.start + shift_before  # position of each run's first token
    end = plan.start + length  # one past each run

    d = np.empty((3, n), np.int64)
    # Base increments: text (1, 1, 1); run tokens (0, 0, 1).
    cover = np.zeros(n + 1, np.int8)
    cover[plan.start] += 1
    cover[end] -= 1
    in_run = np.cumsum(cover[:n], dtype=np.int8).view(np.bool_)
    np.logical_not(in_run, out=d[0], casting="unsafe")
    d[1] = d[0]
    d[2] = 1

    # Every grid row of every run, flattened: its run, frame and row inside the frame.
    rows_per_run = frames * rows
    n_rows = int(rows_per_run.sum())
    run_of_row = np.repeat(np.arange(k), rows_per_run)
    row_in_run = np.arange(n_rows, dtype=np.int64) - np.repeat(
        np.cumsum(rows_per_run) - rows_per_run, rows_per_run
    )
    r_rows = rows[run_of_row]
    frame = row_in_run // r_rows
    row = row_in_run - frame * r_rows
    t_val = plan.t_index[plan.t_off[run_of_row] + frame]
    o = origin[run_of_row]
    first_tok = plan.start[run_of_row] + row_in_run * cols[run_of_row]
    # Position of each row's first token, and of the token just before it.
    cur = np.stack([o + t_val, o + row, o])
    prev_tok = first_tok - 1
    prev = np.empty_like(cur)
    inner = row_in_run > 0  # previous token is the last of the previous row, same run
    w_last = cols[run_of_row] - 1
    prev[:, inner] = np.stack(
        [
            o[inner]
            + plan.t_index[
                plan.t_off[run_of_row[inner]] + (row_in_run[inner] - 1) // r_rows[inner]
            ],
            o[inner] + (row_in_run[inner] - 1) % r_rows[inner],
            o[inner] + w_last[inner],
        ]
    )
    starts = ~inner
    run_idx = run_of_row[starts]
    # A run's first token follows either text or the last token of the run before it.
    after_run = np.zeros(len(run_idx), np.bool_)
    after_run[1:] = end[run_idx[1:] - 1] == plan.start[run_idx[1:]]
    text_prev = (plan.start[run_idx] - 1) + shift_before[run_idx]
    prev_s = np.broadcast_to(text_prev, (3, len(run_idx))).copy()
    if after_run.any():
        p_run = run_idx[after_run] - 1
        last_frame_t = plan.t_index[plan.t_off[p_run] + frames[p_run] - 1]
        prev_s[:, after_run] = np.stack(
            [
                origin[p_run] + last_frame_t,
                origin[p_run] + rows[p_run] - 1,
                origin[p_run] + cols[p_run] - 1,
            ]
        )
    prev[:, starts] = prev_s
    valid = prev_tok >= 0
    d[:, first_tok[valid]] = cur[:, valid] - prev[:, valid]
    if not valid.all():  # a run at token 0 starts from its own origin
        d[:, first_tok[~valid]] = cur[:, ~valid]
    # The first text token after each run resumes at origin + extent + 1.
    follows = end < n
    nxt = end[follows]
    text_after = nxt[~in_run[nxt]]
    if len(text_after):
        run_k = np.searchsorted(end, text_after)
        last_t = plan.t_index[plan.t_off[run_k] + frames[run_k] - 1]
        resume = origin[run_k] + plan.extent[run_k] + 1
        d[0, text_after] = resume - (origin[run_k] + last_t)
        d[1, text_after] = resume - (origin[run_k] + rows[run_k] - 1)
        d[2, text_after] = resume - (origin[run_k] + cols[run_k] - 1)
    if not in_run[0]:
        d[:, 0] = 0
    np.cumsum(d, axis=1, out=d)
    return d, int(shift.sum())
