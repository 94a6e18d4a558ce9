"""The per-item work of a materialization in one native pass, when it is built.

:func:`fast_plan` runs rule 5's item checks, the M-RoPE run plan and rule 6's
pad values from supplied hashes over every item at once (``_planner.c``). It
either answers *valid, and here is everything* (a :class:`FastPlan`) or
``None``: *not sure*. On ``None`` the materializer runs its Python path,
which raises the exact abort or succeeds for an input shape the native pass
does not take (a shared-memory feature, an int16 grid, float64 seconds, ...).
So the accelerator never decides an abort and never words a message; tests
compare it with the Python path on valid and on mutated requests.

Without the extension (or with native code switched off, :mod:`mmadmit.native`)
every call answers ``None`` and the Python path does everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import native
from .dtypes import parse_dtype
from .model import Item, Modality, Tensor
from .mrope import GRID_KEYS, RunPlan, _f32, time_keys
from .profile import Family, ModelProfile

try:
    from . import _planner as _BUILT  # type: ignore[attr-defined]
except ImportError:  # no compiler at install time: the Python path does it all
    _BUILT = None

_planner: Any = _BUILT  # the active extension; None: the Python path (native.set_enabled)
HAVE_NATIVE = _planner is not None


def _use_native(on: bool) -> bool:
    global _planner, HAVE_NATIVE
    _planner = _BUILT if on else None
    HAVE_NATIVE = _planner is not None
    return HAVE_NATIVE


native.register(__name__, _use_native)

# The C side knows these keys by name; keep them in step with mrope.
assert GRID_KEYS[Modality.IMAGE] == "image_grid_thw"
assert GRID_KEYS[Modality.VIDEO] == "video_grid_thw"


@dataclass(frozen=True)
class FastPlan:
    """Spans sorted by start, the run plan, and each item's pad value (-1: hash needed)."""

    span_start: np.ndarray
    span_stop: np.ndarray  # exclusive
    span_owner: np.ndarray  # item index of each span
    plan: RunPlan
    pads: np.ndarray  # [items]
    new_items: list[Item | None]  # rule 6 applied; None where the feature must be hashed


def make_ctx(profile: ModelProfile) -> tuple[Any, ...]:
    """The per-profile constants of the native pass (built once per materializer)."""
    family = profile.family
    time_mode = {Family.QWEN2_5_VL: 1, Family.QWEN3_OMNI: 2}.get(family, 0)
    default_seconds = (profile.seconds_per_chunk or 2.0) if family is Family.QWEN3_OMNI else 1.0
    supported = sum(1 << int(m) for m in Modality if profile.supports(m))
    return (
        Tensor,
        supported,
        profile.spatial_merge_size,
        profile.family.video_run_per_frame,
        time_mode,
        _f32(float(profile.tokens_per_second or 0.0)),
        _f32(float(profile.position_id_per_seconds or 0.0)),
        _f32(float(default_seconds)),
        parse_dtype("int64"),
        parse_dtype("int32"),
        parse_dtype("float32"),
        time_keys(profile),
        Item,
    )


def tensors_ok(
    items: list[Item],
    ctx: tuple[Any, ...],
    rank_max: int,
    bytes_max: int,
    dim_max: int = 2**63 - 1,
) -> bool:
    """True when every item tensor is surely within limits and of exact byte length."""
    if _planner is None:
        return False
    return bool(_planner.check_tensors(items, ctx, rank_max, bytes_max, dim_max))


def fast_plan(
    items: Sequence[Item],
    ids: np.ndarray,
    ctx: tuple[Any, ...],
    placeholders: tuple[int | None, int | None, int | None],
    *,
    need_pad: bool,
) -> FastPlan | None:
    """Everything rules 5 and 6 derive from valid items, or ``None`` (see module doc)."""
    if _planner is None or not isinstance(items, list):
        return None
    ph = [-1 if p is None else p for p in placeholders]
    out = _planner.plan(items, ids, ctx, ph[0], ph[1], ph[2], need_pad)
    if out is None:
        return None
    data, s, r, t, new_items = out
    a = np.frombuffer(data, np.int64)
    plan = RunPlan(
        start=a[3 * s : 3 * s + r],
        frames=a[3 * s + r : 3 * s + 2 * r],
        rows=a[3 * s + 2 * r : 3 * s + 3 * r],
        cols=a[3 * s + 3 * r : 3 * s + 4 * r],
        t_off=a[3 * s + 4 * r : 3 * s + 5 * r],
        t_index=a[3 * s + 5 * r : 3 * s + 5 * r + t],
    )
    pads = a[3 * s + 5 * r + t :]
    return FastPlan(a[:s], a[s : 2 * s], a[2 * s : 3 * s], plan, pads, new_items)


def first_outside(ids: np.ndarray, lo: int, hi: int) -> int:
    """Index of the first id outside ``[lo, hi)``, -1 when none (one pass)."""
    if _planner is not None and ids.dtype == np.int64 and ids.flags.c_contiguous:
        return int(_planner.first_outside(ids, lo, hi))
    if not len(ids) or (int(ids.min()) >= lo and int(ids.max()) < hi):
        return -1
    return int(np.argmax((ids < lo) | (ids >= hi)))
