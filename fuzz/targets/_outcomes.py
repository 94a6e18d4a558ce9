"""Materializer outcomes in comparable form, and the never-``INTERNAL`` rule."""

from __future__ import annotations

from typing import Any

import numpy as np
from mmadmit.errors import Abort, AbortCode
from mmadmit.model import Materialized, Tensor


def _t(t: Any) -> Any:
    if isinstance(t, Tensor):
        return (t.dtype.name, tuple(t.shape), bytes(t.data))
    return t


def _offsets(off: Any) -> Any:
    return None if off is None else np.asarray(off).tolist()


def summary(out: Materialized | Abort) -> Any:
    """Everything a materialization decided; an abort as (code, message)."""
    if isinstance(out, Abort):
        assert out.code is not AbortCode.INTERNAL, f"INTERNAL outcome: {out.message}"
        return ("abort", out.code.value, out.message)
    req = out.request
    mm = req.mm
    items = None
    if mm is not None:
        items = [(it.modality, it.hash, it.pad_value, _offsets(it.offsets)) for it in mm.items]
        mm_part: Any = (
            items,
            mm.im_token_id,
            mm.video_token_id,
            _t(mm.mrope_positions),
            _t(mm.mrope_position_delta),
            mm.mrope_position_delta_scalar,
        )
    else:
        mm_part = None
    unpadded = req.input_ids_unpadded
    return (
        "materialized",
        out.rule.value,
        np.asarray(req.input_ids).tolist(),
        None if unpadded is None else np.asarray(unpadded).tolist(),
        mm_part,
    )


def same_outcome(a: Materialized | Abort, b: Materialized | Abort, what: str) -> None:
    sa, sb = summary(a), summary(b)
    assert sa == sb, f"{what}: native and fallback disagree:\n  native   {sa!r}\n  fallback {sb!r}"
