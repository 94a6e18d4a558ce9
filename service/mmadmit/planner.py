"""The per-item work of a materialization in one native pass, when it is built.

:func:`fast_plan` runs rule 5's item checks, the M-RoPE run plan and rule 6's
pad values from supplied hashes over every item at once (``_planner.c``). It
either answers *valid, and here is everything* (a :class:`mmadmit.rules.ItemPlan`,
what :func:`mmadmit.rules.plan_items` returns) or ``None``: *not sure*. On
``None`` the materializer runs :mod:`mmadmit.rules`, the one source of the
rules, which raises the exact abort or succeeds for an input shape the native
pass does not take (a shared-memory feature, an int16 grid, float64 seconds,
...). So the accelerator never decides an abort and never words a message;
tests compare it with :mod:`mmadmit.rules` on valid and on mutated requests.

It is kept for speed only: :mod:`mmadmit.rules` alone (also compiled with
Cython) measured 1.5-1.75x the materializer's time (README, "Native code").

Without the extension (or with native code switched off, :mod:`mmadmit.native`)
every call answers ``None`` and :mod:`mmadmit.rules` does everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import native
from .dtypes import parse_dtype
from .model import Item, Modality, Tensor
from .mrope import RunPlan
from .profile import Family, ModelProfile
from .rules import GRID_KEYS, ItemPlan, Spans, f32, time_keys

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

# The C side knows these keys by name; keep them in step with rules.
assert GRID_KEYS[Modality.IMAGE] == "image_grid_thw"
assert GRID_KEYS[Modality.VIDEO] == "video_grid_thw"


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
        f32(float(profile.tokens_per_second or 0.0)),
        f32(float(profile.position_id_per_seconds or 0.0)),
        f32(float(default_seconds)),
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
) -> ItemPlan | None:
    """Everything rules 5 and 6 derive from valid items, or ``None`` (see module doc)."""
    if _planner is None or not isinstance(items, list):
        return None
    ph = [-1 if p is None else p for p in placeholders]
    out = _planner.plan(items, ids, ctx, ph[0], ph[1], ph[2], need_pad)
    if out is None:
        return None
    data, s, r, t, new_items = out
    a = np.frombuffer(data, np.int64)
    runs = RunPlan(
        start=a[3 * s : 3 * s + r],
        frames=a[3 * s + r : 3 * s + 2 * r],
        rows=a[3 * s + 2 * r : 3 * s + 3 * r],
        cols=a[3 * s + 3 * r : 3 * s + 4 * r],
        t_off=a[3 * s + 4 * r : 3 * s + 5 * r],
        t_index=a[3 * s + 5 * r : 3 * s + 5 * r + t],
    )
    pads = a[3 * s + 5 * r + t :]
    return ItemPlan(Spans(a[:s], a[s : 2 * s], a[2 * s : 3 * s]), runs, pads, new_items)
