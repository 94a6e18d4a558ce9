"""Fused per-token loops of the CPU path: the C extension ``_kernels`` when built,
else (or with native code switched off, :mod:`mmadmit.native`) the numpy
implementations (identical results; tests compare them).

The numpy versions need several full passes and temporaries per step, which is
what dominates a 128K-token request; the C loops write each element once and
run without the GIL (so workers scale across cores).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import mrope, native

try:
    from . import _kernels as _BUILT  # type: ignore[attr-defined]
except ImportError:  # no compiler at install time: numpy fallback
    _BUILT = None

_kernels: Any = _BUILT  # the active extension; None: numpy (native.set_enabled)
HAVE_NATIVE = _kernels is not None


def _use_native(on: bool) -> bool:
    global _kernels, HAVE_NATIVE
    _kernels = _BUILT if on else None
    HAVE_NATIVE = _kernels is not None
    return HAVE_NATIVE


native.register(__name__, _use_native)


def _i64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def positions(n: int, plan: mrope.RunPlan) -> tuple[np.ndarray, int]:
    """M-RoPE ``[3, n]`` positions and delta (see :func:`mrope.positions`)."""
    if _kernels is None or len(plan.start) == 0:
        return mrope.positions(n, plan)
    out = np.empty((3, n), np.int64)
    delta = _kernels.mrope_fill(
        out,
        _i64(plan.start),
        _i64(plan.frames),
        _i64(plan.rows),
        _i64(plan.cols),
        _i64(plan.t_off),
        _i64(plan.t_index),
    )
    return out, int(delta)


def first_mismatch(
    ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, expected: np.ndarray
) -> int:
    """First span ``k`` holding a token other than ``expected[k]``; -1 when none."""
    if _kernels is not None:
        try:  # the C takes C-contiguous int64 buffers (what the rules pass) and checks them
            return int(_kernels.spans_check(ids, starts, stops, expected))
        except (TypeError, ValueError, BufferError):  # another dtype, a strided view
            return int(_kernels.spans_check(_i64(ids), _i64(starts), _i64(stops), _i64(expected)))
    bad = np.zeros(len(starts), np.bool_)
    for ph in np.unique(expected).tolist():
        # per placeholder id, a prefix count must grow by exactly the span length
        sel = expected == ph
        counts = np.zeros(len(ids) + 1, np.int32)
        np.cumsum(ids == ph, dtype=np.int32, out=counts[1:])
        bad[sel] = counts[stops[sel]] - counts[starts[sel]] != stops[sel] - starts[sel]
    return int(np.argmax(bad)) if bad.any() else -1


# Below this many spans, filling slices one by one beats building per-token arrays.
_SLICE_FILL_MAX_SPANS = 128


def fill_spans(
    ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, values: np.ndarray
) -> np.ndarray:
    """A copy of ``ids`` with ``ids[starts[k]:stops[k]] = values[k]`` (disjoint spans)."""
    if _kernels is not None:
        src = _i64(ids)
        out = np.empty(len(src), np.int64)  # every element written once, sorted spans in one pass
        _kernels.spans_fill(out, src, _i64(starts), _i64(stops), _i64(values))
        return out
    out = np.array(ids, dtype=np.int64, copy=True)
    if len(starts) <= _SLICE_FILL_MAX_SPANS:
        for a, b, v in zip(starts.tolist(), stops.tolist(), values.tolist(), strict=True):
            out[a:b] = v
        return out
    # Many spans: mark entries/exits in difference arrays, one cumulative sum each.
    n = len(ids)
    val = np.zeros(n + 1, np.int64)
    val[starts] = values
    val[stops] -= values  # a stop may be the next span's start: subtract after setting
    cover = np.zeros(n + 1, np.int8)
    cover[starts] = 1
    cover[stops] -= 1
    inside = np.cumsum(cover[:n], dtype=np.int8).view(np.bool_)
    np.copyto(out, np.cumsum(val[:n]), where=inside)
    return out
