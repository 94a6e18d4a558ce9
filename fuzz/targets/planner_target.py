"""Rules 5-6 (``rules.py``, compiled as ``_rules_c``) and the materializer, compiled
against interpreted.

A request is built from the input: a profile (Qwen2-VL, Qwen2.5-VL, Qwen3.5,
Qwen3-Omni, a decode-side language-model-only Qwen3.5), text, and up to five
items whose spans, grids, timing tensors, hashes, pad values and features are
mostly well formed, then mutated with boundary values (forged tensor shapes,
ints outside int64, wrong dtypes, overlapping or out-of-range spans, wild
placeholder overrides, carried M-RoPE fields, an upstream-materialized form).
``Materializer.run`` with native code on and off must give the same outcome
(materialized fields, or abort code and message), never ``INTERNAL``; and
``plan_items`` called directly on the same items (with wild placeholder ids and
either ``need_pad`` and ``hashable``), compiled and interpreted, must give the
same plan or raise the same error with the same message.
"""

from __future__ import annotations

import functools
import struct

import numpy as np
from mmadmit import planner, rules
from mmadmit.materializer import Materializer
from mmadmit.model import Item, Modality, MultimodalInputs, Request, ShmHandle, Tensor
from mmadmit.profile import load_profile

from ._common import native_mode
from ._data import Data
from ._outcomes import same_outcome

NAME = "planner"
_PROFILES = (
    ("qwen2_vl", {}),
    ("qwen2_5_vl", {}),
    ("qwen3_5", {}),
    ("qwen3_omni_moe", {}),
    ("qwen3_5", {"role": "decode", "language_model_only": True}),
)
_GRID_DTYPES = ("int64", "int64", "int64", "int32", "int16", "float32", "uint8")
_SECONDS = (0.5, 1.0, 2.0, 3.25, 0.0, float("nan"), -1.0, 1e7, float("inf"), 999999.9)


@functools.cache
def _materializer(i: int) -> Materializer:
    name, kw = _PROFILES[i]
    return Materializer(load_profile(name, **kw))


def _tensor(arr: np.ndarray) -> Tensor:
    return Tensor.from_numpy(np.ascontiguousarray(arr))


def _forged(d: Data, t: Tensor) -> Tensor:
    """The same bytes under another shape: a wrong rank or layout, or with a dimension
    of 0 (no bytes), or 1s added. A shape that does not match the bytes cannot be built
    (the Tensor refuses it: ``tests/test_fuzz_regressions.py``)."""
    n = t.nbytes // t.dtype.itemsize
    choice = d.int_in(0, 4)
    if choice == 0:
        return Tensor(t.dtype, (n,), t.data)
    if choice == 1:
        return Tensor(t.dtype, (1, n), t.data)
    if choice == 2:
        return Tensor(t.dtype, (n, 1, 1), t.data)
    if choice == 3:
        return Tensor(t.dtype, (0, *t.shape), t.data[:0])
    return Tensor(t.dtype, (1,) * d.int_in(0, 9) + t.shape, t.data)


def _grid(d: Data, rows: list[list[int]]) -> Tensor:
    dtype = d.pick(_GRID_DTYPES)
    arr = np.array(rows, np.int64)
    if d.flag(10):
        arr = arr.reshape(-1)  # [3] form when one row, else a wrong shape
    with np.errstate(all="ignore"):
        t = _tensor(arr.astype(dtype))
    return _forged(d, t) if d.flag(8) else t


def _seconds(d: Data, nrows: int) -> Tensor:
    count = d.pick((1, nrows, nrows + 1))
    if d.flag(20):
        vals = [struct.unpack("<f", d.take(4).ljust(4, b"\0"))[0] for _ in range(count)]
    else:
        vals = [d.pick(_SECONDS) for _ in range(count)]
    dtype = d.pick(("float32", "float32", "float32", "float64", "int64"))
    with np.errstate(all="ignore"):
        t = _tensor(np.array(vals, np.float64).astype(dtype))
    return _forged(d, t) if d.flag(5) else t


def _pad_interval(modality: int) -> tuple[int, int]:
    lo = 1_000_000 + (modality - 1) * 715_494_549
    return lo, lo + 715_494_548


def build(d: Data) -> tuple[int, Request]:
    pi = d.pick((0, 1, 2, 3, 3, 4))  # Qwen3-Omni twice: it alone takes audio
    profile = _materializer(pi).profile
    merge = profile.spatial_merge_size
    split = profile.family.video_run_per_frame
    ph = {1: profile.image_token_id, 2: profile.video_token_id, 3: profile.audio_token_id}
    ids: list[int] = [d.int_in(1, 50) for _ in range(d.int_in(0, 3))]
    items: list[Item] = []
    for _ in range(d.int_in(0, 5)):
        kinds = (1, 1, 2, 2, 3) if profile.supports(Modality.AUDIO) else (1, 1, 2, 2, 1, 2, 3)
        modality = d.pick(kinds) if not d.flag(5) else d.wild_int()
        kind = modality if modality in (1, 2, 3) else d.pick((1, 2, 3))
        side: dict[str, Tensor] = {}
        spans: list[list[int]] = []
        token = ph.get(kind) or 0
        if kind == 3:  # audio: one span, no grid
            n = d.int_in(1, 5)
            spans.append([len(ids), len(ids) + n - 1])
            ids += [token] * n
        else:
            nrows = 1 if kind == 1 and d.flag(85) else d.int_in(1, 2)
            rows = []
            for _ in range(nrows):
                t = 1 if kind == 1 else d.int_in(1, 3)
                h, w = merge * d.int_in(1, 2), merge * d.int_in(1, 3)
                if d.flag(5):
                    h += 1
                rows.append([t, h, w])
                units = t if (kind == 2 and split) else 1
                per = (1 if units > 1 or (kind == 2 and split) else t) * (h // merge) * (w // merge)
                for _u in range(units):
                    spans.append([len(ids), len(ids) + per - 1])
                    ids += [token] * per
                    ids += [d.int_in(1, 50) for _ in range(d.int_in(0, 1))]
            key = "image_grid_thw" if kind == 1 else "video_grid_thw"
            if d.flag(4):
                key = "video_grid_thw" if kind == 1 else "image_grid_thw"
            side[key] = _grid(d, rows)
            if kind == 2 and d.flag(60):
                side[d.pick(("second_per_grid_ts", "video_second_per_grid"))] = _seconds(d, nrows)
        if d.flag(3):
            side["use_audio_in_video"] = _tensor(np.array([d.flag()], np.bool_))
        ids += [d.int_in(1, 50) for _ in range(d.int_in(0, 2))]
        h_choice = d.u8() % 8
        item_hash = (
            None if h_choice < 2 else d.uint(8) if h_choice < 7 else d.wild_int() * d.pick((1, 3))
        )
        pad = None
        if d.flag(20):
            lo, hi = _pad_interval(kind)
            pad = d.pick((lo, hi, lo - 1, hi + 1, d.wild_int(), lo + d.int_in(0, 1000)))
        feature = None
        shm = None
        if item_hash is None or d.flag(20):
            shape = (d.int_in(1, 3), d.int_in(1, 4))
            feature = _tensor(np.frombuffer(d.take(4 * shape[0] * shape[1]).ljust(
                4 * shape[0] * shape[1], b"\0"), np.float32).reshape(shape))  # fmt: skip
            if d.flag(8):
                feature = _forged(d, feature)
            elif d.flag(5):
                feature = None
                shm = ShmHandle(name="seg", shape=shape, dtype="float32")
        offsets = np.array(spans, np.int64).reshape(-1, 2)
        items.append(Item(modality, item_hash, pad, offsets, feature, shm, side))
    ids += [d.int_in(1, 50) for _ in range(d.int_in(0, 3))]
    input_ids = np.array(ids or [1], np.int64)
    mm = MultimodalInputs(items=items)
    if d.flag(15):
        mm.im_token_id = d.pick((ph[1], ph[2], 5, d.wild_int()))
    if d.flag(15):
        mm.video_token_id = d.pick((ph[2], ph[1], 7, d.wild_int()))
    req = Request(rid="fuzz", input_ids=input_ids, mm=mm)
    for _ in range(d.int_in(0, 3) if d.flag(85) else 1):
        _mutate(d, req)
    if d.flag(50):
        _guard_tail(req, ph)
    if d.flag(10):
        mm.mrope_position_delta_scalar = d.wild_int()
    if d.flag(5):
        n = len(req.input_ids)
        mm.mrope_positions = _tensor(np.tile(np.arange(n, dtype=np.int64), (3, 1)))
    if d.flag(5):
        mm.mrope_position_delta = _tensor(np.array([[d.int_in(-3, 3)]], np.int64))
    if d.flag(15):
        _upstream(d, pi, req)
    return pi, req


def _mutate(d: Data, req: Request) -> None:
    mm = req.mm
    assert mm is not None
    items = mm.items
    if not items:
        return
    item = items[d.int_in(0, len(items) - 1)]
    op = d.u8() % 7
    if op == 0 and d.flag(40):
        op = 7
    if op == 7:  # the span that ends last now ends at, or one past, the last token
        spanned = [it for it in items if it.offsets is not None and it.offsets.size]
        spanned = [it for it in spanned if it.offsets.ndim == 2]
        last = max(spanned, key=lambda it: int(it.offsets[:, 1].max()), default=None)
        if last is not None:
            off = last.offsets.copy()
            k = int(np.argmax(off[:, 1]))
            shift = len(req.input_ids) - int(off[k, 1]) - d.pick((0, 1))
            off[k, 1] += shift
            if d.flag(50):
                off[k, 0] += shift  # the whole span moves: its length still matches the grid
            last.offsets = off
    elif op == 0 and item.offsets is not None and len(item.offsets):
        off = item.offsets.copy()
        off[d.int_in(0, len(off) - 1), d.int_in(0, 1)] += d.pick((-1, 1, -2, 2, 10**6))
        item.offsets = off
    elif op == 1 and item.offsets is not None:
        item.offsets = d.pick((item.offsets.astype(np.int32), item.offsets[:0], None,
                               np.concatenate([item.offsets, item.offsets[:1]])))  # fmt: skip
    elif op == 2:
        other = items[d.int_in(0, len(items) - 1)]
        item.offsets = None if other.offsets is None else other.offsets.copy()
    elif op == 3 and item.offsets is not None and len(item.offsets):
        a, b = (int(x) for x in item.offsets[0])
        if 0 <= a <= b < len(req.input_ids):
            ids = req.input_ids.copy()
            ids[d.int_in(a, b)] = d.int_in(0, 60)
            req.input_ids = ids
    elif op == 4:
        item.side = {}
    elif op == 5:
        item.hash = d.pick((-1, 2**64, 2**64 - 1, True, 0))
    elif d.flag(30):  # an id outside the vocabulary (it ends most requests early)
        ids = req.input_ids.copy()
        ids[d.int_in(0, len(ids) - 1)] = d.wild_int() % 2**63 * d.pick((1, -1))
        req.input_ids = ids


def _guard_tail(req: Request, ph: dict[int, int | None]) -> None:
    """Make the ids a view on a longer buffer whose tail repeats the placeholder of the
    item whose span ends last: a native read past the end then sees "valid" tokens and
    shows up as a divergence even without a sanitizer (the other half of the inputs
    keep the exact-size buffer ASan guards)."""
    assert req.mm is not None
    spanned = [it for it in req.mm.items if it.offsets is not None and it.offsets.size]
    spanned = [it for it in spanned if it.offsets.ndim == 2]
    last = max(spanned, key=lambda it: int(it.offsets[:, 1].max()), default=None)
    tail = 0 if last is None else (ph.get(last.modality) or 0)
    n = len(req.input_ids)
    req.input_ids = np.concatenate([req.input_ids, np.full(8, tail, np.int64)])[:n]


def _upstream(d: Data, pi: int, req: Request) -> None:
    """Turn ``req`` into its upstream-materialized form (rule 4), perhaps tampered."""
    with native_mode(False):
        out = _materializer(pi).run(req)
    from mmadmit.model import Materialized

    if not isinstance(out, Materialized) or out.request.input_ids_unpadded is None:
        return
    up = out.request
    req.input_ids, req.input_ids_unpadded = up.input_ids, up.input_ids_unpadded
    assert req.mm is not None and up.mm is not None
    req.mm.items = up.mm.items
    if d.flag(50):
        req.mm.mrope_positions = req.mm.mrope_position_delta = None
        req.mm.mrope_position_delta_scalar = None
    if d.flag(20) and req.mm.items:
        it = req.mm.items[d.int_in(0, len(req.mm.items) - 1)]
        it.pad_value = None if d.flag() else d.wild_int()


def _plan(module: object, args: tuple) -> object:
    """A plan's arrays and items, or the error it raised (type and message)."""
    try:
        p = module.plan_items(*args)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - compared, never swallowed silently
        return (type(exc), str(exc))
    runs = (
        None
        if p.runs is None
        else [getattr(p.runs, f).tolist() for f in rules.RunPlan.__struct_fields__]
    )
    items = [None if i is None else (i.hash, i.pad_value) for i in p.new_items]
    spans = (p.spans.start.tolist(), p.spans.stop.tolist(), p.spans.owner.tolist())
    return (spans, runs, p.pads.tolist(), items)


def _direct(pi: int, req: Request, d: Data) -> None:
    """``plan_items`` compiled and interpreted on the same items: the same answer."""
    m = _materializer(pi)
    if planner._BUILT is None or req.mm is None or not isinstance(req.mm.items, list):
        return
    phs = tuple(d.wild_int() if d.flag(20) else p for p in m._placeholders(req.mm))
    ids = np.asarray(req.input_ids, np.int64)
    args = (m._rules, req.mm.items, ids, phs, d.flag(), d.flag(80))
    interpreted = _plan(rules, args)
    for build in planner.COMPILED.values():  # _rules_c, and _rules_avx2 with AVX2
        compiled = _plan(build, args)
        assert compiled == interpreted, (build.__name__, compiled, interpreted)


def one(data: bytes) -> None:
    d = Data(data)
    pi, req = build(d)
    m = _materializer(pi)
    with native_mode(True):
        a = m.run(req)
    with native_mode(False):
        b = m.run(req)
    same_outcome(a, b, "materialize")
    _direct(pi, req, d)
