"""The materializer: docs/spec/MATERIALIZE.md rules 1 to 8, transport-free.

``Materializer.materialize(request)`` returns a :class:`Materialized` outcome or
raises an :class:`AdmissionError`; ``Materializer.run`` turns the latter into an
:class:`Abort`. Everything is validated before any work is spent (hashing,
positions, substitution), and the input request is never modified: a request is
either fully materialized into a *new* request object or aborted.

Array work (pad substitution, M-RoPE positions) goes through an
:class:`ArrayOps` object so the CUDA stream pool can run it on a device; the
CPU implementation is numpy. Hashing always runs on the CPU: on the calling
thread, or through the ``hash_many`` a caller passes (the pool's spreads one
request's items over its idle workers; the hashes, and so the outcome, are the
same bytes either way). Rule 6's pad values and item copies come from the
active build of the rules (:mod:`mmadmit.planner`: compiled when it is built).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from . import mrope, planner, rules
from .errors import (
    Abort,
    AbortCode,
    AdmissionError,
    InvalidRequest,
    TextOnlyModel,
    TooLarge,
    abort_from_exception,
)
from .hashing import HashMany, feature_hashes
from .limits import Limits, items_over, tokens_over
from .model import (
    MODALITY_OF,
    Item,
    Materialized,
    MultimodalInputs,
    Padding,
    Request,
    Rule,
    Tensor,
)
from .profile import ModelProfile

logger = logging.getLogger(__name__)

Outcome = Materialized | Abort


class ArrayOps(Protocol):
    """The array work of a materialization; CPU (numpy) or a CUDA stream."""

    def substitute(
        self, ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, values: np.ndarray
    ) -> np.ndarray:
        """A copy of ``ids`` with ``ids[starts[k]:stops[k]] = values[k]`` (disjoint spans)."""
        ...

    def positions(self, n: int, plan: mrope.RunPlan) -> tuple[np.ndarray, int]:
        """M-RoPE ``[3, n]`` int64 positions and the delta."""
        ...


class CpuArrayOps:
    """The CPU: rules 7 and 8's loops in :mod:`mmadmit.rules`, in the active build."""

    def substitute(
        self, ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, values: np.ndarray
    ) -> np.ndarray:
        return planner.fill_spans(ids, starts, stops, values)

    def positions(self, n: int, plan: mrope.RunPlan) -> tuple[np.ndarray, int]:
        return planner.positions(n, plan)


CPU_OPS = CpuArrayOps()


def _owner_at(spans: rules.Spans, positions: np.ndarray) -> np.ndarray:
    """The item owning each token position, -1 outside every span (sorted, disjoint)."""
    if not len(spans.start):
        return np.full(len(positions), -1, np.int64)
    j = np.searchsorted(spans.start, positions, side="right") - 1
    inside = (j >= 0) & (positions < spans.stop[np.maximum(j, 0)])
    return np.where(inside, spans.owner[np.maximum(j, 0)], -1)


def _parse_validation_error(text: str) -> Abort:
    code_name, sep, rest = text.partition(": ")
    if sep and code_name in AbortCode.__members__:
        return Abort(AbortCode[code_name], rest)
    return Abort(AbortCode.INVALID_REQUEST, text)


def _scalar_of(t: Tensor, what: str) -> int:
    if not t.dtype.is_integer or t.dtype.numpy is None:
        raise InvalidRequest(f"{what} must be an integer tensor, got {t.dtype.name}")
    arr = t.to_numpy()
    if arr.size != 1:
        raise InvalidRequest(f"{what} must hold exactly one value, got shape {list(t.shape)}")
    return int(arr.reshape(-1)[0])


def _delta_tensor(delta: int) -> Tensor:
    return Tensor.of_int64(np.array([[delta]], dtype=np.int64))


def _copy_mm(mm: MultimodalInputs, items: list[Item]) -> MultimodalInputs:
    """``dataclasses.replace(mm, items=items)`` without its per-call introspection."""
    return MultimodalInputs(
        items,
        mm.im_token_id,
        mm.video_token_id,
        mm.mrope_positions,
        mm.mrope_position_delta,
        mm.mrope_position_delta_scalar,
        mm.extra,
    )


class Materializer:
    """One instance per process; thread-safe (it holds no per-request state)."""

    def __init__(self, profile: ModelProfile, limits: Limits | None = None) -> None:
        self.profile = profile
        self.limits = limits or Limits()
        self._rules = rules.RuleSet(profile)

    # ------------------------------------------------------------------ entry points

    def run(
        self, req: Request, ops: ArrayOps = CPU_OPS, hash_many: HashMany | None = None
    ) -> Outcome:
        """Materialize or abort; never raises (unexpected errors become ``INTERNAL``).
        ``hash_many``: how the features left to hash are hashed (default: one after
        another on this thread)."""
        try:
            return self.materialize(req, ops, hash_many)
        except AdmissionError as exc:
            return exc.to_abort()
        except Exception as exc:  # noqa: BLE001 - a bug must still end in one outcome
            logger.exception("rid=%s: materializer failed", req.rid)
            return abort_from_exception(exc)

    def materialize(
        self, req: Request, ops: ArrayOps = CPU_OPS, hash_many: HashMany | None = None
    ) -> Materialized:
        if req.validation_error is not None:
            abort = _parse_validation_error(req.validation_error)
            raise _Marked(abort)
        self._check_sizes(req)
        original = req.input_ids_unpadded if req.input_ids_unpadded is not None else req.input_ids
        self._check_vocab(
            original, "input_ids_unpadded" if req.input_ids_unpadded is not None else "input_ids"
        )
        mm = req.mm
        profile = self.profile
        has_mrope_field = mm is not None and (
            mm.mrope_positions is not None
            or mm.mrope_position_delta is not None
            or mm.mrope_position_delta_scalar is not None
        )
        items = mm.items if mm is not None else []

        # Rule 1: text request.
        if mm is None or (not items and not has_mrope_field):
            self._check_unpadded(req, [])
            return Materialized(req, Rule.TEXT)

        # Rule 2: decode-side exemption.
        if profile.role == "decode" and profile.language_model_only and profile.multimodal:
            return self._decode_exempt(req, mm, original)

        # Rule 3: text-only model.
        if items and not profile.multimodal_active:
            raise TextOnlyModel("multimodal inputs were provided for a text-only model")

        # Rule 4: materialized upstream.
        if req.input_ids_unpadded is not None:
            return self._upstream(req, mm, original, ops)

        # Rules 5 to 8.
        plan = self._plan(items, mm, original, need_pad=False)
        new_items, hashed = _hash_remaining(items, plan, hash_many or feature_hashes)
        new_mm = _copy_mm(mm, new_items)
        if profile.uses_mrope:
            self._set_positions(new_mm, mm, len(original), plan.runs, ops)
        spans = plan.spans
        values = plan.pads[spans.owner]
        padded = ops.substitute(original, spans.start, spans.stop, values)
        out = Request(
            req.rid,
            padded,
            original,
            new_mm,
            req.validation_error,
            req.extra,  # rule 8
            Padding(padded, original, spans.start, spans.stop, values),
        )
        return Materialized(out, Rule.NORMAL, hashed)

    # ------------------------------------------------------------------ rules

    def _decode_exempt(
        self, req: Request, mm: MultimodalInputs, original: np.ndarray
    ) -> Materialized:
        self._check_unpadded(req, mm.items)
        if not self.profile.uses_mrope:
            return Materialized(dataclasses.replace(req, mm=None), Rule.DECODE_EXEMPT)
        delta = self._carried_delta(mm)
        if delta is None and mm.mrope_positions is not None:
            pos = self._check_positions(mm.mrope_positions, len(req.input_ids))
            delta = int(pos.max()) + 1 - len(req.input_ids) if pos.size else 0
        if delta is None:
            plan = self._plan(mm.items, mm, original, need_pad=False, hashable=False)
            assert plan.runs is not None
            delta = mrope.delta_only(len(original), plan.runs)
        new_mm = MultimodalInputs(
            items=[],
            im_token_id=mm.im_token_id,
            video_token_id=mm.video_token_id,
            mrope_positions=None,
            mrope_position_delta=_delta_tensor(delta),
            mrope_position_delta_scalar=delta,
            extra=mm.extra,
        )
        return Materialized(dataclasses.replace(req, mm=new_mm), Rule.DECODE_EXEMPT)

    def _upstream(
        self, req: Request, mm: MultimodalInputs, original: np.ndarray, ops: ArrayOps
    ) -> Materialized:
        items = mm.items
        plan = self._plan(items, mm, original, need_pad=True)
        self._check_unpadded(req, items, plan.spans)
        if not self.profile.uses_mrope:
            return Materialized(req, Rule.UPSTREAM)
        new_mm = dataclasses.replace(mm)
        self._set_positions(new_mm, mm, len(original), plan.runs, ops)
        return Materialized(dataclasses.replace(req, mm=new_mm), Rule.UPSTREAM)

    def _set_positions(
        self,
        new_mm: MultimodalInputs,
        mm: MultimodalInputs,
        n: int,
        plan: mrope.RunPlan | None,
        ops: ArrayOps,
    ) -> None:
        """Rule 7: keep and check carried positions, or compute them."""
        carried = self._carried_delta(mm)
        if mm.mrope_positions is not None:
            if carried is None:
                pos = self._check_positions(mm.mrope_positions, n)
                carried = int(pos.max()) + 1 - n if pos.size else 0
            else:
                self._check_positions(mm.mrope_positions, n)
            if mm.mrope_position_delta is None:
                new_mm.mrope_position_delta = _delta_tensor(carried)
            new_mm.mrope_position_delta_scalar = carried
            return
        assert plan is not None
        positions, delta = ops.positions(n, plan)
        if carried is not None and carried != delta:
            raise InvalidRequest(
                f"the payload carries mrope_position_delta {carried} but the grids and spans "
                f"give {delta}"
            )
        new_mm.mrope_positions = Tensor.of_int64(positions)
        new_mm.mrope_position_delta = _delta_tensor(delta)
        new_mm.mrope_position_delta_scalar = delta

    # ------------------------------------------------------------------ validation

    def _check_sizes(self, req: Request) -> None:
        lim = self.limits
        n = len(req.input_ids)
        if n == 0:
            raise InvalidRequest("input_ids is empty")
        if n > lim.max_tokens:
            raise tokens_over("input_ids", n, lim.max_tokens)
        mml = self.profile.max_model_len
        if mml is not None and n > mml - 1:
            raise TooLarge(
                f"{n} prompt tokens leave no room to generate within max_model_len {mml} "
                f"(at most {mml - 1})"
            )
        mm = req.mm
        if mm is None:
            return
        if len(mm.items) > lim.max_items:
            raise items_over(len(mm.items), lim.max_items)
        planner.tensors_within(mm, lim)

    def _check_vocab(self, ids: np.ndarray, what: str) -> None:
        vocab = self.profile.vocab_size
        i = planner.first_outside(np.ascontiguousarray(ids, np.int64), vocab)
        if i >= 0:
            raise InvalidRequest(
                f"{what}[{i}] = {int(ids[i])} is outside the vocabulary [0, {vocab})"
            )

    def _check_unpadded(
        self, req: Request, items: Sequence[Item], spans: rules.Spans | None = None
    ) -> None:
        unpadded = req.input_ids_unpadded
        if unpadded is None:
            return
        ids = req.input_ids
        if len(unpadded) != len(ids):
            raise InvalidRequest(
                f"input_ids_unpadded has {len(unpadded)} tokens but input_ids has {len(ids)}"
            )
        differs = np.flatnonzero(ids != unpadded)
        if differs.size == 0:
            return
        if spans is None:  # not validated yet (decode exemption): they must be usable here
            spans = planner.spans_of(list(items), len(ids))
        owner = _owner_at(spans, differs)
        pads = np.asarray(
            [-1 if it.pad_value is None else it.pad_value for it in items] + [-2], np.int64
        )
        # owner -1 picks the trailing sentinel -2, which never equals an id
        bad = ids[differs] != pads[owner]
        if bad.any():
            k = int(np.argmax(bad))
            p, who = int(differs[k]), int(owner[k])
            where = "outside every item's span" if who < 0 else f"in item {who}'s span"
            raise InvalidRequest(
                f"input_ids[{p}] = {int(ids[p])} differs from input_ids_unpadded[{p}] = "
                f"{int(unpadded[p])} {where}; only an item's pad value may replace its placeholders"
            )

    def _check_positions(self, t: Tensor, n: int) -> np.ndarray:
        if not t.dtype.is_integer or t.dtype.numpy is None:
            raise InvalidRequest(f"mrope_positions must be an integer tensor, got {t.dtype.name}")
        if t.shape != (3, n):
            raise InvalidRequest(f"mrope_positions must have shape [3, {n}], got {list(t.shape)}")
        return t.to_numpy()

    def _carried_delta(self, mm: MultimodalInputs) -> int | None:
        tensor_delta = (
            None
            if mm.mrope_position_delta is None
            else _scalar_of(mm.mrope_position_delta, "mrope_position_delta")
        )
        scalar = mm.mrope_position_delta_scalar
        if scalar is not None and not rules.INT64_MIN <= scalar <= rules.INT64_MAX:
            # any msgpack int on the wire; it is stored as an int64 tensor
            raise InvalidRequest(f"mrope_position_delta_scalar {scalar} is outside int64")
        if tensor_delta is not None and scalar is not None and tensor_delta != scalar:
            raise InvalidRequest(
                f"mrope_position_delta {tensor_delta} disagrees with mrope_position_delta_scalar "
                f"{scalar}"
            )
        return tensor_delta if tensor_delta is not None else scalar

    def _plan(
        self,
        items: list[Item],
        mm: MultimodalInputs,
        original: np.ndarray,
        *,
        need_pad: bool,
        hashable: bool = True,
    ) -> rules.ItemPlan:
        """Rules 5 and 6 over the items (:func:`mmadmit.rules.plan_items`, compiled when
        it is built)."""
        placeholders = self._placeholders(mm)
        return planner.plan_items(self._rules, items, original, placeholders, need_pad, hashable)

    def _placeholders(self, mm: MultimodalInputs) -> tuple[int | None, int | None, int | None]:
        """Image, video and audio placeholder ids: the request's overrides, else the profile's."""
        profile = self.profile
        return (
            mm.im_token_id if mm.im_token_id is not None else profile.image_token_id,
            mm.video_token_id if mm.video_token_id is not None else profile.video_token_id,
            profile.audio_token_id,
        )


def _hash_remaining(
    items: list[Item], plan: rules.ItemPlan, hash_many: HashMany
) -> tuple[list[Item], int]:
    """Rule 6 for the items the plan left to hash (no hash and no pad value supplied):
    the items, and how many feature bytes were hashed."""
    new_items = plan.new_items
    if None not in new_items:
        return new_items, 0  # type: ignore[return-value]
    todo = [i for i, new in enumerate(new_items) if new is None]
    features: list[Tensor] = []
    for i in todo:
        feature = items[i].feature
        assert feature is not None  # the plan leaves only items with a feature to hash
        features.append(feature)
    hashes = hash_many([f.data for f in features])
    # the plan's own list, made for this request: filled in place
    out: list[Item] = new_items  # type: ignore[assignment]
    pads = plan.pads
    hashed = 0
    for i, feature, content_hash in zip(todo, features, hashes, strict=True):
        item = items[i]
        hashed += feature.nbytes
        pad = planner.pad_value(MODALITY_OF[item.modality], content_hash)
        pads[i] = pad
        out[i] = planner.with_pad(item, content_hash, pad)
    return out, hashed


class _Marked(AdmissionError):
    """A request that arrived already marked invalid (``validation_error`` set)."""

    def __init__(self, abort: Abort) -> None:
        super().__init__(abort.message)
        self.code = abort.code


__all__ = [
    "ArrayOps",
    "CPU_OPS",
    "CpuArrayOps",
    "Limits",
    "Materializer",
    "Outcome",
]
