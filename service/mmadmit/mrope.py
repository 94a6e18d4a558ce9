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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest, Unsupported
from .model import Item, Modality, Tensor
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


def _int_tensor(item_idx: int, key: str, tensor: Tensor) -> np.ndarray:
    if not tensor.dtype.is_integer:
        raise InvalidRequest(
            f"item {item_idx}: {key} must be an integer tensor, got dtype {tensor.dtype.name}"
        )
    return tensor.to_numpy().astype(np.int64, copy=False)


def item_grid(profile: ModelProfile, idx: int, item: Item) -> np.ndarray | None:
    """Validate an item's grid (rule 5) and return it as ``[rows, 3]`` int64 (None for audio)."""
    modality = Modality(item.modality)
    merge = profile.spatial_merge_size
    other = {Modality.IMAGE: Modality.VIDEO, Modality.VIDEO: Modality.IMAGE}
    if modality is Modality.AUDIO:
        for key in GRID_KEYS.values():
            if key in item.side:
                raise InvalidRequest(f"item {idx}: an audio item must not carry {key}")
        return None
    key = GRID_KEYS[modality]
    wrong = GRID_KEYS[other[modality]]
    if wrong in item.side:
        raise InvalidRequest(f"item {idx}: a {modality.name.lower()} item must not carry {wrong}")
    tensor = item.side.get(key)
    if tensor is None:
        raise InvalidRequest(f"item {idx}: {modality.name.lower()} item has no {key}")
    grid = _int_tensor(idx, key, tensor)
    if grid.ndim == 1 and grid.shape[0] == 3:
        grid = grid.reshape(1, 3)
    if grid.ndim != 2 or grid.shape[1] != 3 or grid.shape[0] == 0:
        raise InvalidRequest(
            f"item {idx}: {key} must have shape [rows, 3], got {list(tensor.shape)}"
        )
    if (grid <= 0).any():
        raise InvalidRequest(f"item {idx}: {key} rows must be positive, got {grid.tolist()}")
    if (grid[:, 1] % merge).any() or (grid[:, 2] % merge).any():
        raise InvalidRequest(
            f"item {idx}: {key} h and w must be divisible by spatial_merge_size {merge}, "
            f"got {grid.tolist()}"
        )
    if modality is Modality.IMAGE and (grid[:, 0] != 1).any():
        raise InvalidRequest(f"item {idx}: image_grid_thw rows must have t == 1, got {grid.tolist()}")
    return grid


def _seconds_per_row(
    profile: ModelProfile, idx: int, item: Item, rows: int
) -> np.ndarray:
    """float32 seconds per grid row for a video item (one value broadcast or one per row)."""
    if profile.family is Family.QWEN3_OMNI:
        keys, default = _OMNI_TIME_KEYS, profile.seconds_per_chunk or 2.0
    else:
        keys, default = _QWEN25_TIME_KEYS, 1.0
    for key in keys:
        tensor = item.side.get(key)
        if tensor is None:
            continue
        if not (tensor.dtype.is_float or tensor.dtype.is_integer) or tensor.dtype.numpy is None:
            raise InvalidRequest(f"item {idx}: {key} must be a numeric tensor, got {tensor.dtype.name}")
        values = tensor.to_numpy().astype(np.float32).reshape(-1)
        if values.size == 1:
            values = np.repeat(values, rows)
        if values.size != rows:
            raise InvalidRequest(
                f"item {idx}: {key} holds {values.size} values; expected 1 or one per grid row ({rows})"
            )
        if not np.isfinite(values).all() or (values < 0).any():
            raise InvalidRequest(f"item {idx}: {key} must hold finite non-negative seconds")
        return values
    return np.full(rows, default, dtype=np.float32)


def _temporal_index(profile: ModelProfile, modality: Modality, frames: int, seconds: float) -> np.ndarray:
    k = np.arange(frames, dtype=np.int64)
    if modality is not Modality.VIDEO:
        return np.zeros(frames, np.int64)
    family = profile.family
    if family is Family.QWEN2_5_VL:
        tps = np.float32(profile.tokens_per_second)
        return np.trunc((k.astype(np.float32) * np.float32(seconds)) * tps).astype(np.int64)
    if family is Family.QWEN3_OMNI:
        step = np.float32(np.float32(seconds) * np.float32(profile.position_id_per_seconds))
        return np.trunc(k.astype(np.float32) * step).astype(np.int64)
    if family.video_run_per_frame:
        return np.zeros(frames, np.int64)
    return k  # Qwen2-VL


def check_no_audio_in_video(idx: int, item: Item) -> None:
    flag = item.side.get("use_audio_in_video")
    if flag is not None and flag.nbytes and flag.dtype.numpy is not None and flag.to_numpy().any():
        raise Unsupported(
            f"item {idx}: use_audio_in_video (audio interleaved into video) is not supported yet"
        )


def plan_runs(profile: ModelProfile, items: Sequence[Item]) -> RunPlan:
    """Match every item's spans to its grid rows and return the runs (rule 5 checks).

    Spans must already be validated (bounds, disjointness, placeholder ids); this
    checks the grids and that each span's length equals its row's merged patch
    count, and builds the runs in prompt order.
    """
    merge = profile.spatial_merge_size
    merge2 = merge * merge
    starts: list[int] = []
    frames: list[int] = []
    rows: list[int] = []
    cols: list[int] = []
    t_parts: list[np.ndarray] = []
    per_frame = profile.family.video_run_per_frame
    for idx, item in enumerate(items):
        modality = Modality(item.modality)
        check_no_audio_in_video(idx, item)
        grid = item_grid(profile, idx, item)
        if grid is None:
            continue
        assert item.offsets is not None
        spans = item.offsets
        seconds = (
            _seconds_per_row(profile, idx, item, len(grid))
            if modality is Modality.VIDEO
            else np.zeros(len(grid), np.float32)
        )
        split = per_frame and modality is Modality.VIDEO
        expected_spans = int(grid[:, 0].sum()) if split else len(grid)
        if len(spans) != expected_spans:
            unit = "temporal frames" if split else "grid rows"
            raise InvalidRequest(
                f"item {idx}: {len(spans)} placeholder spans but {expected_spans} expected "
                f"(one per {unit[:-1]}; {GRID_KEYS[modality]}={grid.tolist()})"
            )
        span_i = 0
        for row_i, (t, h, w) in enumerate(grid.tolist()):
            hh, ww = h // merge, w // merge
            if split:
                units = [(1, np.zeros(1, np.int64))] * t
            else:
                units = [(t, _temporal_index(profile, modality, t, float(seconds[row_i])))]
            for unit_t, t_index in units:
                start, end = (int(v) for v in spans[span_i])
                want = unit_t * hh * ww
                if end - start + 1 != want:
                    raise InvalidRequest(
                        f"item {idx}: span {span_i} [{start}, {end}] holds {end - start + 1} "
                        f"tokens; grid row {row_i} [{t}, {h}, {w}] requires {want} "
                        f"(t*h*w/{merge2}" + (" per frame)" if split else ")")
                    )
                starts.append(start)
                frames.append(unit_t)
                rows.append(hh)
                cols.append(ww)
                t_parts.append(t_index)
                span_i += 1
    if not starts:
        empty = np.zeros(0, np.int64)
        return RunPlan(empty, empty, empty, empty, empty, empty)
    start_a = np.asarray(starts, np.int64)
    frames_a = np.asarray(frames, np.int64)
    t_off = np.zeros(len(starts), np.int64)
    np.cumsum(frames_a[:-1], out=t_off[1:])
    order = np.argsort(start_a, kind="stable")
    t_index = np.concatenate(t_parts)
    return RunPlan(
        start=start_a[order],
        frames=frames_a[order],
        rows=np.asarray(rows, np.int64)[order],
        cols=np.asarray(cols, np.int64)[order],
        t_off=t_off[order],
        t_index=t_index,
    )


def delta_only(n: int, plan: RunPlan) -> int:
    """The position delta (``max + 1 - N``) without building per-token positions."""
    del n  # the delta does not depend on the prompt length, only on the runs
    return int((plan.extent + 1 - plan.length).sum())


def positions(n: int, plan: RunPlan) -> tuple[np.ndarray, int]:
    """The ``[3, n]`` int64 M-RoPE positions and the delta, vectorized."""
    k = len(plan.start)
    if k == 0:
        base = np.arange(n, dtype=np.int64)
        return np.broadcast_to(base, (3, n)).copy(), 0
    length = plan.length
    shift = plan.extent + 1 - length  # displacement each run adds after itself
    shift_before = np.zeros(k, np.int64)
    np.cumsum(shift[:-1], out=shift_before[1:])
    run_s = plan.start + shift_before  # position of each run's origin

    # Text (and audio) tokens: i + total shift of the runs that end before i.
    step = np.zeros(n + 1, np.int64)
    np.add.at(step, plan.start + length, shift)
    out = np.empty((3, n), np.int64)
    text = np.arange(n, dtype=np.int64)
    text += np.cumsum(step[:n])
    out[:] = text

    # Run tokens: all runs at once, through per-token run ids.
    total = int(length.sum())
    run_of = np.repeat(np.arange(k), length)
    first_tok = np.zeros(k, np.int64)
    np.cumsum(length[:-1], out=first_tok[1:])
    local = np.arange(total, dtype=np.int64) - first_tok[run_of]
    idx = plan.start[run_of] + local
    plane = (plan.rows * plan.cols)[run_of]
    frame = local // plane
    rem = local - frame * plane
    cols = plan.cols[run_of]
    row = rem // cols
    col = rem - row * cols
    origin = run_s[run_of]
    out[0, idx] = origin + plan.t_index[plan.t_off[run_of] + frame]
    out[1, idx] = origin + row
    out[2, idx] = origin + col
    return out, int(shift.sum())
