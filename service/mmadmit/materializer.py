"""The materializer: MATERIALIZE.md rules 1 to 8, transport-free.

``Materializer.materialize(request)`` returns a :class:`Materialized` outcome or
raises an :class:`AdmissionError`; ``Materializer.run`` turns the latter into an
:class:`Abort`. Everything is validated before any work is spent (hashing,
positions, substitution), and the input request is never modified: a request is
either fully materialized into a *new* request object or aborted.

Array work (pad substitution, M-RoPE positions) goes through an
:class:`ArrayOps` object so the CUDA stream pool can run it on a device; the
CPU implementation is numpy. Hashing always runs on the CPU.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import kernels, mrope, planner
from .errors import (
    Abort,
    AbortCode,
    AdmissionError,
    InvalidRequest,
    TextOnlyModel,
    TooLarge,
    abort_from_exception,
)
from .hashing import UINT64_MAX, feature_hash, pad_interval, pad_value
from .limits import Limits, check_shape
from .model import (
    MODALITY_OF,
    Item,
    Materialized,
    Modality,
    MultimodalInputs,
    Request,
    Rule,
    Tensor,
    TensorName,
)
from .profile import ModelProfile

logger = logging.getLogger(__name__)

Outcome = Materialized | Abort

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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
    """numpy, with the fused C loops of :mod:`mmadmit.kernels` when they are built."""

    def substitute(
        self, ids: np.ndarray, starts: np.ndarray, stops: np.ndarray, values: np.ndarray
    ) -> np.ndarray:
        return kernels.fill_spans(ids, starts, stops, values)

    def positions(self, n: int, plan: mrope.RunPlan) -> tuple[np.ndarray, int]:
        return kernels.positions(n, plan)


CPU_OPS = CpuArrayOps()


@dataclass(frozen=True)
class _SpanTable:
    """Every span of a request, in item order (row ``k`` is span ``k_in_item`` of ``owner``)."""

    start: np.ndarray  # [S] int64
    stop: np.ndarray  # [S] int64, exclusive
    owner: np.ndarray  # [S] item index
    k_in_item: np.ndarray  # [S] index of the span inside its item

    @classmethod
    def of(cls, items: Sequence[Item]) -> _SpanTable:
        counts = [0 if it.offsets is None else len(it.offsets) for it in items]
        if not any(counts):
            e = np.zeros(0, np.int64)
            return cls(e, e, e, e)
        sp = np.concatenate(
            [it.offsets for it in items if it.offsets is not None and len(it.offsets)]
        )
        owner = np.repeat(np.arange(len(items)), counts)
        k_in_item = np.arange(len(sp)) - np.repeat(np.cumsum(counts) - counts, counts)
        return cls(sp[:, 0], sp[:, 1] + 1, owner, k_in_item)

    def describe(self, k: int) -> str:
        return (
            f"item {int(self.owner[k])}: span {int(self.k_in_item[k])} "
            f"[{int(self.start[k])}, {int(self.stop[k]) - 1}]"
        )

    def check_bounds(self, n: int) -> None:
        bad = (self.start < 0) | (self.start >= self.stop) | (self.stop > n)
        if bad.any():
            raise InvalidRequest(
                f"{self.describe(int(np.argmax(bad)))} is not a valid inclusive range inside "
                f"input_ids (0 <= start <= end < {n})"
            )

    def owner_at(self, positions: np.ndarray) -> np.ndarray:
        """The item owning each token position, -1 outside every span (spans disjoint)."""
        if not len(self.start):
            return np.full(len(positions), -1, np.int64)
        order = np.argsort(self.start, kind="stable")
        starts = self.start[order]
        j = np.searchsorted(starts, positions, side="right") - 1
        inside = (j >= 0) & (positions < self.stop[order][np.maximum(j, 0)])
        return np.where(inside, self.owner[order][np.maximum(j, 0)], -1)


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
        self._supported = frozenset(m for m in Modality if profile.supports(m))
        # the native per-item pass (M-RoPE families; None: the Python path only)
        self._ctx = planner.make_ctx(profile) if profile.uses_mrope else None

    # ------------------------------------------------------------------ entry points

    def run(self, req: Request, ops: ArrayOps = CPU_OPS) -> Outcome:
        """Materialize or abort; never raises (unexpected errors become ``INTERNAL``)."""
        try:
            return self.materialize(req, ops)
        except AdmissionError as exc:
            return exc.to_abort()
        except Exception as exc:  # noqa: BLE001 - a bug must still end in one outcome
            logger.exception("rid=%s: materializer failed", req.rid)
            return abort_from_exception(exc)

    def materialize(self, req: Request, ops: ArrayOps = CPU_OPS) -> Materialized:
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
        fast = self._fast_plan(items, mm, original, need_pad=False)
        if fast is not None:
            plan: mrope.RunPlan | None = fast.plan
            new_items = _hash_remaining(items, fast.new_items)
            starts, stops, owner = fast.span_start, fast.span_stop, fast.span_owner
        else:
            plan, spans = self._validate_items(items, mm, original, need_pad=False)
            new_items = [self._with_pad_value(i, item) for i, item in enumerate(items)]
            starts, stops, owner = spans.start, spans.stop, spans.owner
        new_mm = _copy_mm(mm, new_items)
        if profile.uses_mrope:
            assert plan is not None
            self._set_positions(new_mm, mm, len(original), plan, ops)
        pads = np.fromiter((it.pad_value for it in new_items), np.int64, len(new_items))
        padded = ops.substitute(original, starts, stops, pads[owner])
        out = Request(
            req.rid,
            padded,
            original,
            new_mm,
            req.validation_error,
            req.extra,  # rule 8
        )
        return Materialized(out, Rule.NORMAL)

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
            plan, _ = self._validate_items(mm.items, mm, original, need_pad=False, hashable=False)
            assert plan is not None
            delta = mrope.delta_only(len(original), plan)
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
        fast = self._fast_plan(items, mm, original, need_pad=True)
        if fast is not None:
            plan: mrope.RunPlan | None = fast.plan
            # k_in_item only words span errors, which a valid plan no longer has
            none = np.full(len(fast.span_start), -1, np.int64)
            spans = _SpanTable(fast.span_start, fast.span_stop, fast.span_owner, none)
        else:
            plan, spans = self._validate_items(items, mm, original, need_pad=True)
        self._check_unpadded(req, items, spans)
        if not self.profile.uses_mrope:
            return Materialized(req, Rule.UPSTREAM)
        new_mm = dataclasses.replace(mm)
        self._set_positions(new_mm, mm, len(original), plan, ops)
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
            raise TooLarge(f"{n} tokens exceed the limit of {lim.max_tokens} (--max-tokens)")
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
            raise TooLarge(
                f"{len(mm.items)} items exceed the limit of {lim.max_items} (--max-items)"
            )
        rank_max, bytes_max = lim.max_tensor_rank, lim.max_tensor_bytes
        dim_max = lim.max_tensor_dim
        if (
            self._ctx is not None
            and mm.mrope_positions is None
            and mm.mrope_position_delta is None
            and planner.tensors_ok(mm.items, self._ctx, rank_max, bytes_max, dim_max)
        ):
            return  # the native pass vouches for every item tensor (no feature_shm)
        for what, t in self._tensors(mm):
            check_shape(what, t.shape, lim)
            nbytes = t.data.nbytes
            if nbytes > bytes_max:
                raise TooLarge(
                    f"{what}: {nbytes} bytes exceed the limit of {bytes_max} (--max-tensor-bytes)"
                )
        for i, item in enumerate(mm.items):
            shm = item.feature_shm
            if shm is not None and shm.shape is not None and len(shm.shape) > rank_max:
                raise TooLarge(
                    f"item {i} feature_shm: rank {len(shm.shape)} exceeds the limit of "
                    f"{rank_max} (--max-tensor-rank)"
                )

    @staticmethod
    def _tensors(mm: MultimodalInputs) -> Iterator[tuple[TensorName, Tensor]]:
        """Every tensor of a request, named lazily (formatting names costs on the hot path)."""
        if mm.mrope_positions is not None:
            yield TensorName(None, "mrope_positions"), mm.mrope_positions
        if mm.mrope_position_delta is not None:
            yield TensorName(None, "mrope_position_delta"), mm.mrope_position_delta
        for i, item in enumerate(mm.items):
            if item.feature is not None:
                yield TensorName(i, "feature"), item.feature
            for key, value in item.side.items():
                if isinstance(value, Tensor):
                    yield TensorName(i, key), value

    def _check_vocab(self, ids: np.ndarray, what: str) -> None:
        vocab = self.profile.vocab_size
        i = planner.first_outside(ids, 0, vocab)
        if i >= 0:
            raise InvalidRequest(
                f"{what}[{i}] = {int(ids[i])} is outside the vocabulary [0, {vocab})"
            )

    def _check_unpadded(
        self, req: Request, items: Sequence[Item], spans: _SpanTable | None = None
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
            spans = _SpanTable.of(items)
            spans.check_bounds(len(ids))
        owner = spans.owner_at(differs)
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
        if scalar is not None and not _INT64_MIN <= scalar <= _INT64_MAX:
            # any msgpack int on the wire; it is stored as an int64 tensor
            raise InvalidRequest(f"mrope_position_delta_scalar {scalar} is outside int64")
        if tensor_delta is not None and scalar is not None and tensor_delta != scalar:
            raise InvalidRequest(
                f"mrope_position_delta {tensor_delta} disagrees with mrope_position_delta_scalar "
                f"{scalar}"
            )
        return tensor_delta if tensor_delta is not None else scalar

    def _validate_items(
        self,
        items: Sequence[Item],
        mm: MultimodalInputs,
        original: np.ndarray,
        *,
        need_pad: bool,
        hashable: bool = True,
    ) -> tuple[mrope.RunPlan | None, _SpanTable]:
        """Rule 5 for every item; returns the M-RoPE plan (M-RoPE families) and the spans."""
        profile = self.profile
        n = len(original)
        placeholder = dict(
            zip(
                (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO),
                self._placeholders(mm),
                strict=True,
            )
        )
        expected_ids = []
        for i, item in enumerate(items):
            modality = MODALITY_OF.get(item.modality)
            if modality is None:
                raise InvalidRequest(
                    f"item {i}: unknown modality {item.modality} (1 image, 2 video, 3 audio)"
                )
            if modality not in self._supported:
                raise InvalidRequest(
                    f"item {i}: the model ({profile.model_type or profile.family.value}) takes no "
                    f"{modality.name.lower()} input"
                )
            if item.offsets is None or len(item.offsets) == 0:
                raise InvalidRequest(f"item {i}: offsets must be a non-empty list of [start, end]")
            self._check_hash_and_pad(i, item, modality, need_pad, hashable)
            expected_ids.append(placeholder[modality])
        spans = _SpanTable.of(items)
        spans.check_bounds(n)
        if len(spans.start) > 1:
            order = np.argsort(spans.start, kind="stable")
            clash = spans.start[order[1:]] < spans.stop[order[:-1]]
            if clash.any():
                k = int(np.argmax(clash))
                raise InvalidRequest(
                    f"{spans.describe(int(order[k + 1]))} overlaps {spans.describe(int(order[k]))}"
                )
        self._check_placeholders(
            original, spans, expected_ids, [Modality(it.modality).name.lower() for it in items]
        )
        if profile.uses_mrope:
            return mrope.plan_runs(profile, items), spans
        for i, item in enumerate(items):
            mrope.check_no_audio_in_video(i, item)
        return None, spans

    def _check_hash_and_pad(
        self, i: int, item: Item, modality: Modality, need_pad: bool, hashable: bool
    ) -> None:
        if item.hash is not None and not 0 <= item.hash <= UINT64_MAX:
            raise InvalidRequest(f"item {i}: hash {item.hash} is not an unsigned 64-bit integer")
        if item.pad_value is not None:
            lo, hi = pad_interval(modality)
            if not lo <= item.pad_value <= hi:
                raise InvalidRequest(
                    f"item {i}: pad_value {item.pad_value} is outside the "
                    f"{modality.name.lower()} interval [{lo}, {hi}]"
                )
        elif need_pad:
            raise InvalidRequest(
                f"item {i}: input_ids_unpadded is set (materialized upstream) but the item has no "
                "pad_value"
            )
        elif hashable and item.hash is None:
            if item.feature is None:
                why = (
                    "a shared-memory feature cannot be hashed without reading the segment"
                    if item.feature_shm is not None
                    else "it has no feature to hash"
                )
                raise InvalidRequest(f"item {i}: no pad_value and no content hash, and {why}")

    @staticmethod
    def _check_placeholders(
        original: np.ndarray,
        spans: _SpanTable,
        expected_ids: list[int | None],
        modalities: list[str],
    ) -> None:
        """Every token of a span is its modality's placeholder (rule 5)."""
        if not len(spans.start):
            return
        # A request's placeholder override may be any msgpack int; one outside int64
        # (like a missing id) matches no token: ids were checked to be in [0, vocab).
        per_item = [
            -1 if e is None or not _INT64_MIN <= e <= _INT64_MAX else e for e in expected_ids
        ]
        want = np.asarray(per_item, np.int64)[spans.owner]
        k = kernels.first_mismatch(original, spans.start, spans.stop, want)
        if k >= 0:
            a, b = int(spans.start[k]), int(spans.stop[k])
            off = int(np.flatnonzero(original[a:b] != want[k])[0])
            owner = int(spans.owner[k])
            shown = expected_ids[owner]
            raise InvalidRequest(
                f"{spans.describe(k)} holds token {int(original[a + off])} at {a + off}; every "
                f"token in a {modalities[owner]} span must be the placeholder "
                f"{-1 if shown is None else shown}"
            )

    def _fast_plan(
        self, items: list[Item], mm: MultimodalInputs, original: np.ndarray, *, need_pad: bool
    ) -> planner.FastPlan | None:
        """Rules 5 and 6 in one native pass; ``None`` sends the request down the Python path."""
        if self._ctx is None:
            return None
        placeholders = self._placeholders(mm)
        return planner.fast_plan(items, original, self._ctx, placeholders, need_pad=need_pad)

    def _placeholders(self, mm: MultimodalInputs) -> tuple[int | None, int | None, int | None]:
        """Image, video and audio placeholder ids: the request's overrides, else the profile's."""
        profile = self.profile
        return (
            mm.im_token_id if mm.im_token_id is not None else profile.image_token_id,
            mm.video_token_id if mm.video_token_id is not None else profile.video_token_id,
            profile.audio_token_id,
        )

    # ------------------------------------------------------------------ rule 6

    @staticmethod
    def _with_pad_value(i: int, item: Item) -> Item:
        if item.pad_value is not None:
            return item
        content_hash = item.hash
        if content_hash is None:
            assert item.feature is not None
            content_hash = feature_hash(item.feature.data)
        return item.with_pad(content_hash, pad_value(MODALITY_OF[item.modality], content_hash))


def _hash_remaining(items: list[Item], new_items: list[Item | None]) -> list[Item]:
    """Rule 6 after a native pass: hash the features of the items it left as None."""
    if None not in new_items:
        return new_items  # type: ignore[return-value]
    return [
        Materializer._with_pad_value(i, items[i]) if new is None else new
        for i, new in enumerate(new_items)
    ]


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
