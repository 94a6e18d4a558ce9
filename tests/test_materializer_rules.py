"""docs/spec/MATERIALIZE.md, rule by rule and abort by abort, on the internal model directly."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Any

import msgspec
import numpy as np
import pytest
from mmadmit.errors import Abort, AbortCode, InvalidRequest
from mmadmit.materializer import Limits, Materializer
from mmadmit.model import (
    Item,
    Materialized,
    MultimodalInputs,
    Request,
    Rule,
    ShmHandle,
    Tensor,
)
from mmadmit.profile import ModelProfile, load_profile, profile_from_config
from mmadmit.rules import PAD_BASE, PAD_SLOTS
from mmadmit.tensorcheck import TensorName

BASE = 1_000_000
SLOTS = 715_494_549
IMAGE, VIDEO, AUDIO = 1, 2, 3

# special ids of the public checkpoints
Q35 = {"vs": 248053, "ve": 248054, "image": 248056, "video": 248057}
QWEN = {
    "vs": 151652,
    "ve": 151653,
    "image": 151655,
    "video": 151656,
    "audio": 151675,
    "as": 151669,
    "ae": 151670,
}

LLAVA_CONFIG = {
    "architectures": ["LlavaForConditionalGeneration"],
    "model_type": "llava",
    "image_token_index": 32000,
    "text_config": {"model_type": "llama", "vocab_size": 32064},
    "vision_config": {"model_type": "clip_vision_model", "patch_size": 14},
}
KIMI_CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "media_placeholder_token_id": 163605,
    "text_config": {"vocab_size": 163840},
    "vision_config": {"patch_size": 14, "merge_kernel_size": [2, 2]},
}


# --------------------------------------------------------------------------- helpers


@functools.cache
def profile(
    name: str, role: str = "aggregated", lmo: bool = False, max_model_len: int | None = None
) -> ModelProfile:
    if name == "llava":
        return profile_from_config(
            LLAVA_CONFIG, role=role, language_model_only=lmo, max_model_len=max_model_len
        )
    if name == "kimi":
        return profile_from_config(
            KIMI_CONFIG, role=role, language_model_only=lmo, max_model_len=max_model_len
        )
    return load_profile(name, role=role, language_model_only=lmo, max_model_len=max_model_len)


def run(req: Request, name: str = "qwen3_5", limits: Limits | None = None, **kw: Any):
    return Materializer(profile(name, **kw), limits).run(req)


def ok(
    req: Request, name: str = "qwen3_5", limits: Limits | None = None, **kw: Any
) -> Materialized:
    out = run(req, name, limits, **kw)
    assert isinstance(out, Materialized), out
    return out


def aborts(
    req: Request,
    code: AbortCode,
    *patterns: str,
    name: str = "qwen3_5",
    limits: Limits | None = None,
    **kw: Any,
) -> Abort:
    out = run(req, name, limits, **kw)
    assert isinstance(out, Abort), f"expected {code.name}, got a materialized outcome"
    assert out.code is code, out
    import re

    for pat in patterns:
        assert re.search(pat, out.message), f"{pat!r} not in {out.message!r}"
    return out


def arr(values: Any, dtype: Any = np.int64) -> Tensor:
    return Tensor.from_numpy(np.asarray(values, dtype=dtype))


def feature(nbytes: int = 64, seed: int = 0) -> Tensor:
    data = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8)
    return Tensor.from_numpy(data.view(np.float32).reshape(-1, 2))


def fhash(t: Tensor) -> int:
    return int.from_bytes(hashlib.blake2b(bytes(t.data), digest_size=8).digest(), "big")


class Prompt:
    """Builds expanded ids and items the way a gateway does."""

    def __init__(self, ids: dict[str, int] | None = None, merge: int = 2) -> None:
        self.tok = ids or Q35
        self.merge2 = merge * merge
        self.ids: list[int] = []
        self.items: list[Item] = []
        self._next_text = 1000

    def text(self, n: int = 2) -> Prompt:
        for _ in range(n):
            self.ids.append(self._next_text)
            self._next_text += 1
        return self

    def _run(
        self, placeholder: int, count: int, start_tok: str = "vs", end_tok: str = "ve"
    ) -> list[int]:
        self.ids.append(self.tok[start_tok])
        s = len(self.ids)
        self.ids.extend([placeholder] * count)
        self.ids.append(self.tok[end_tok])
        return [s, s + count - 1]

    def image(self, h: int = 4, w: int = 6, *, grid: bool = True, **kw: Any) -> Item:
        span = self._run(self.tok["image"], h * w // self.merge2)
        side = {"image_grid_thw": arr([[1, h, w]])} if grid else {}
        kw.setdefault("hash", 1000 + len(self.items))
        it = Item(IMAGE, offsets=np.asarray([span], np.int64), side=side, **kw)
        self.items.append(it)
        self.text(1)
        return it

    def video_per_frame(self, t: int = 3, h: int = 4, w: int = 4, **kw: Any) -> Item:
        """Qwen3-VL / Qwen3.5: one run per temporal frame, a timestamp token before each."""
        spans = []
        for _ in range(t):
            self.text(1)  # "<x.x seconds>"
            spans.append(self._run(self.tok["video"], h * w // self.merge2))
        kw.setdefault("hash", 2000 + len(self.items))
        side = {"video_grid_thw": arr([[t, h, w]])}
        side.update(kw.pop("side", {}))
        it = Item(VIDEO, offsets=np.asarray(spans, np.int64), side=side, **kw)
        self.items.append(it)
        self.text(1)
        return it

    def video_rows(self, rows: list[list[int]], **kw: Any) -> Item:
        """Qwen2/2.5-VL and Omni: one run per grid row holding t*h*w/merge^2 tokens."""
        spans = [self._run(self.tok["video"], t * h * w // self.merge2) for t, h, w in rows]
        kw.setdefault("hash", 3000 + len(self.items))
        side = {"video_grid_thw": arr(rows)}
        side.update(kw.pop("side", {}))
        it = Item(VIDEO, offsets=np.asarray(spans, np.int64), side=side, **kw)
        self.items.append(it)
        self.text(1)
        return it

    def audio(self, n: int = 5, **kw: Any) -> Item:
        span = self._run(self.tok["audio"], n, "as", "ae")
        kw.setdefault("hash", 4000 + len(self.items))
        it = Item(AUDIO, offsets=np.asarray([span], np.int64), **kw)
        self.items.append(it)
        self.text(1)
        return it

    def request(self, rid: str = "r", **mm_kw: Any) -> Request:
        mm = MultimodalInputs(items=list(self.items), **mm_kw)
        return Request(rid=rid, input_ids=np.asarray(self.ids, np.int64), mm=mm)


def simple_image_request(**mm_kw: Any) -> Request:
    """text(2) <vs> image 4x6 (6 tokens) <ve> text(1): hand-computable positions."""
    p = Prompt().text(2)
    p.image(4, 6, hash=12345)
    return p.request(**mm_kw)


# hand-computed for simple_image_request (docs/spec/MATERIALIZE.md "M-RoPE conventions")
SIMPLE_POS = np.array(
    [
        [0, 1, 2, 3, 3, 3, 3, 3, 3, 6, 7],
        [0, 1, 2, 3, 3, 3, 4, 4, 4, 6, 7],
        [0, 1, 2, 3, 4, 5, 3, 4, 5, 6, 7],
    ]
)
SIMPLE_DELTA = -3


def snapshot(req: Request) -> Any:
    def t(x: Tensor | None) -> Any:
        return None if x is None else (x.dtype.name, x.shape, bytes(x.data))

    mm = req.mm
    return (
        req.rid,
        req.input_ids.copy(),
        None if req.input_ids_unpadded is None else req.input_ids_unpadded.copy(),
        req.validation_error,
        None
        if mm is None
        else (
            len(mm.items),
            mm.im_token_id,
            mm.video_token_id,
            t(mm.mrope_positions),
            t(mm.mrope_position_delta),
            mm.mrope_position_delta_scalar,
            [
                (
                    it.modality,
                    it.hash,
                    it.pad_value,
                    None if it.offsets is None else it.offsets.copy(),
                    t(it.feature),
                    {k: t(v) if isinstance(v, Tensor) else v for k, v in it.side.items()},
                )
                for it in mm.items
            ],
        ),
    )


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, np.ndarray):
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    else:
        assert a == b


def freeze(req: Request) -> Request:
    """Make every input array read-only: an in-place write would fail loudly."""
    req.input_ids.flags.writeable = False
    if req.input_ids_unpadded is not None:
        req.input_ids_unpadded.flags.writeable = False
    if req.mm is not None:
        for it in req.mm.items:
            if it.offsets is not None:
                it.offsets.flags.writeable = False
    return req


def upstream_request(p: Prompt, **mm_kw: Any) -> Request:
    """Rule 4 input: pad values preset, ids substituted, input_ids_unpadded the originals."""
    original = np.asarray(p.ids, np.int64)
    padded = original.copy()
    items = []
    for it in p.items:
        tag = int(it.modality) - 1  # rule 6: image 0, video 1, audio 2
        pad = BASE + tag * SLOTS + (it.hash or 7) % SLOTS
        for s, e in it.offsets:
            padded[s : e + 1] = pad
        items.append(msgspec.structs.replace(it, pad_value=pad))
    return Request(
        rid="up",
        input_ids=padded,
        input_ids_unpadded=original,
        mm=MultimodalInputs(items=items, **mm_kw),
    )


# --------------------------------------------------------------------------- rule 1


def test_rule1_text_request_unchanged() -> None:
    req = freeze(Request(rid="t", input_ids=np.arange(5, dtype=np.int64)))
    before = snapshot(req)
    out = ok(req)
    assert out.rule is Rule.TEXT and not out.passthrough
    assert_same(snapshot(out.request), before)
    assert out.request.mm is None and out.request.input_ids_unpadded is None


def test_padding_says_how_the_padded_ids_were_made() -> None:
    """Rule 6's substitution is recorded (model.Padding): the padded ids are the
    unpadded ones with each span set to its pad value, spans sorted and disjoint;
    the outcomes of the other rules carry none."""
    p = Prompt().text(2)
    p.image(4, 6, hash=12345)
    p.text(3)
    p.image(2, 4, hash=777)
    out = ok(p.request())
    assert out.rule is Rule.NORMAL
    pad = out.request.padding
    assert pad is not None
    assert pad.result is out.request.input_ids and pad.unpadded is out.request.input_ids_unpadded
    spans = [(int(a), int(b) + 1) for it in out.request.mm.items for a, b in it.offsets]
    assert list(zip(pad.starts.tolist(), pad.stops.tolist(), strict=True)) == spans
    assert spans[0] == (3, 9) and spans[0][1] < spans[1][0]
    assert pad.values.tolist() == [it.pad_value for it in out.request.mm.items]
    filled = pad.unpadded.copy()
    for a, b, v in zip(pad.starts.tolist(), pad.stops.tolist(), pad.values.tolist(), strict=True):
        filled[a:b] = v
    assert np.array_equal(filled, out.request.input_ids)
    text = ok(Request(rid="t", input_ids=np.arange(5, dtype=np.int64)))
    assert text.request.padding is None
    upstream = ok(upstream_request(_upstream_prompt()))
    assert upstream.rule is Rule.UPSTREAM and upstream.request.padding is None


def test_rule1_empty_multimodal_inputs_is_text() -> None:
    req = Request(rid="t", input_ids=np.arange(5, dtype=np.int64), mm=MultimodalInputs(items=[]))
    out = ok(req)
    assert out.rule is Rule.TEXT
    assert out.request.mm is None or (
        out.request.mm.mrope_positions is None and not out.request.mm.items
    )
    np.testing.assert_array_equal(out.request.input_ids, np.arange(5))


@pytest.mark.parametrize("name", ["llama", "qwen2_5_vl", "llava"])
def test_rule1_text_request_on_any_model(name: str) -> None:
    out = ok(Request(rid="t", input_ids=np.asarray([1, 2, 3], np.int64)), name)
    assert out.rule is Rule.TEXT
    np.testing.assert_array_equal(out.request.input_ids, [1, 2, 3])


def test_rule1_text_request_with_scalar_only_goes_to_rule7() -> None:
    """No items but an M-RoPE field: not rule 1; positions are 1-D text positions, delta 0."""
    req = Request(
        rid="t",
        input_ids=np.arange(4, dtype=np.int64),
        mm=MultimodalInputs(items=[], mrope_position_delta_scalar=0),
    )
    out = ok(req)
    np.testing.assert_array_equal(
        out.request.mm.mrope_positions.to_numpy(), np.tile(np.arange(4), (3, 1))
    )
    assert out.request.mm.mrope_position_delta_scalar == 0
    req = Request(
        rid="t",
        input_ids=np.arange(4, dtype=np.int64),
        mm=MultimodalInputs(items=[], mrope_position_delta_scalar=5),
    )
    aborts(req, AbortCode.INVALID_REQUEST, "5", "0")


# --------------------------------------------------------------------------- rule 2

DECODE = {"role": "decode", "lmo": True}


def test_rule2_decode_keeps_carried_delta_drops_items() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=None)  # no hash, no feature: never hashed on decode
    req = freeze(p.request(mrope_position_delta_scalar=-3))
    before = snapshot(req)
    out = ok(req, **DECODE)
    assert out.rule is Rule.DECODE_EXEMPT and not out.passthrough
    r = out.request
    np.testing.assert_array_equal(r.input_ids, req.input_ids)
    assert r.input_ids_unpadded is None
    assert r.mm is not None and r.mm.items == []
    assert r.mm.mrope_positions is None
    assert r.mm.mrope_position_delta_scalar == -3
    np.testing.assert_array_equal(r.mm.mrope_position_delta.to_numpy(), [[-3]])
    assert_same(snapshot(req), before)


def test_rule2_decode_keeps_carried_tensor_delta() -> None:
    req = simple_image_request(mrope_position_delta=arr([[-9]]))
    out = ok(req, **DECODE)
    assert out.request.mm.mrope_position_delta_scalar == -9
    np.testing.assert_array_equal(out.request.mm.mrope_position_delta.to_numpy(), [[-9]])


def test_rule2_decode_computes_delta_from_grids() -> None:
    p = Prompt().text(3)
    p.image(4, 6)
    p.video_per_frame(3, 4, 8)
    p.image(8, 8)
    req = p.request()
    want = ok(req).request.mm.mrope_position_delta_scalar
    out = ok(req, **DECODE)
    assert out.request.mm.items == [] and out.request.mm.mrope_positions is None
    assert out.request.mm.mrope_position_delta_scalar == want
    np.testing.assert_array_equal(out.request.mm.mrope_position_delta.to_numpy(), [[want]])
    assert (
        ok(simple_image_request(), **DECODE).request.mm.mrope_position_delta_scalar == SIMPLE_DELTA
    )


def test_rule2_decode_keeps_ids_and_unpadded_as_received() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    req = freeze(upstream_request(p))
    out = ok(req, **DECODE)
    np.testing.assert_array_equal(out.request.input_ids, req.input_ids)
    np.testing.assert_array_equal(out.request.input_ids_unpadded, req.input_ids_unpadded)
    assert out.request.mm.items == []


def test_rule2_decode_positions_carried_not_forwarded() -> None:
    req = simple_image_request(mrope_positions=Tensor.from_numpy(SIMPLE_POS.astype(np.int64)))
    out = ok(req, **DECODE)
    assert out.request.mm.mrope_positions is None
    assert out.request.mm.mrope_position_delta_scalar == SIMPLE_DELTA


def test_rule2_decode_non_mrope_family_drops_multimodal_inputs() -> None:
    p = Prompt({"vs": 1, "ve": 2, "image": 32000}, merge=1).text(2)
    p.image(2, 3, grid=False)
    out = ok(p.request(), "llava", **DECODE)
    assert out.rule is Rule.DECODE_EXEMPT
    assert out.request.mm is None
    np.testing.assert_array_equal(out.request.input_ids, p.ids)


def test_rule2_never_text_only_model() -> None:
    # language_model_only would make rule 3 fire for aggregated; decode is exempt.
    aborts(simple_image_request(), AbortCode.TEXT_ONLY_MODEL, lmo=True)
    assert isinstance(run(simple_image_request(), lmo=True, role="decode"), Materialized)


def test_rule2_decode_invalid_grid_still_invalid() -> None:
    p = Prompt().text(2)
    it = p.image(4, 6)
    it.side["image_grid_thw"] = arr([[1, 5, 6]])
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "divisible", **DECODE)


def test_rule2_decode_span_mismatch_still_invalid() -> None:
    p = Prompt().text(2)
    it = p.image(4, 6)
    it.side["image_grid_thw"] = arr([[1, 4, 8]])
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", r"span 0", **DECODE)


def test_decode_role_without_language_model_only_is_normal() -> None:
    out = ok(simple_image_request(), role="decode")
    assert out.rule is Rule.NORMAL


def test_prefill_role_behaves_like_aggregated() -> None:
    a = ok(simple_image_request())
    b = ok(simple_image_request(), role="prefill")
    assert b.rule is Rule.NORMAL
    np.testing.assert_array_equal(a.request.input_ids, b.request.input_ids)
    np.testing.assert_array_equal(
        a.request.mm.mrope_positions.to_numpy(), b.request.mm.mrope_positions.to_numpy()
    )
    aborts(simple_image_request(), AbortCode.TEXT_ONLY_MODEL, role="prefill", lmo=True)


# --------------------------------------------------------------------------- rule 3


def test_rule3_text_only_model_rejects_items() -> None:
    p = Prompt({"vs": 1, "ve": 2, "image": 128000}).text(2)
    p.image(4, 6)
    aborts(
        p.request(),
        AbortCode.TEXT_ONLY_MODEL,
        "^multimodal inputs were provided for a text-only model$",
        name="llama",
    )


def test_rule3_language_model_only_aggregated() -> None:
    aborts(simple_image_request(), AbortCode.TEXT_ONLY_MODEL, "text-only model", lmo=True)
    p = Prompt({"vs": 1, "ve": 2, "image": 32000}, merge=1).text(2)
    p.image(2, 3, grid=False)
    aborts(p.request(), AbortCode.TEXT_ONLY_MODEL, name="llava", lmo=True)


def test_rule3_upstream_request_on_text_only_model() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    aborts(upstream_request(p), AbortCode.TEXT_ONLY_MODEL, lmo=True)


# --------------------------------------------------------------------------- rule 4


def _upstream_prompt() -> Prompt:
    p = Prompt().text(3)
    p.image(4, 6, hash=None)
    p.video_per_frame(2, 4, 4)
    p.text(2)
    return p


def test_rule4_upstream_keeps_everything_and_computes_positions() -> None:
    p = _upstream_prompt()
    req = freeze(upstream_request(p))
    before = snapshot(req)
    out = ok(req)
    assert out.rule is Rule.UPSTREAM and out.passthrough
    r = out.request
    np.testing.assert_array_equal(r.input_ids, req.input_ids)
    np.testing.assert_array_equal(r.input_ids_unpadded, req.input_ids_unpadded)
    for a, b in zip(r.mm.items, req.mm.items, strict=True):
        assert (a.hash, a.pad_value) == (b.hash, b.pad_value)
    assert r.mm.items[0].hash is None  # nothing hashed
    # positions computed from the unpadded ids: same as a normal materialization
    plain = p.request()
    plain.mm.items = [msgspec.structs.replace(it, hash=it.hash or 1) for it in plain.mm.items]
    normal = ok(plain).request.mm
    np.testing.assert_array_equal(
        r.mm.mrope_positions.to_numpy(), normal.mrope_positions.to_numpy()
    )
    assert r.mm.mrope_position_delta_scalar == normal.mrope_position_delta_scalar
    np.testing.assert_array_equal(
        r.mm.mrope_position_delta.to_numpy(), [[normal.mrope_position_delta_scalar]]
    )
    assert_same(snapshot(req), before)


def test_rule4_hand_computed_positions() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    out = ok(upstream_request(p))
    np.testing.assert_array_equal(out.request.mm.mrope_positions.to_numpy(), SIMPLE_POS)
    assert out.request.mm.mrope_position_delta_scalar == SIMPLE_DELTA


def test_rule4_upstream_feature_not_hashed() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=None, feature=feature())
    req = upstream_request(p)
    out = ok(req)
    assert out.request.mm.items[0].hash is None
    assert out.request.mm.items[0].pad_value == req.mm.items[0].pad_value


def test_rule4_positions_present_untouched() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    pos = Tensor.from_numpy(SIMPLE_POS.astype(np.int64))
    req = upstream_request(
        p,
        mrope_positions=pos,
        mrope_position_delta=arr([[SIMPLE_DELTA]]),
        mrope_position_delta_scalar=SIMPLE_DELTA,
    )
    out = ok(req)
    assert out.rule is Rule.UPSTREAM and out.passthrough
    assert out.request.mm.mrope_positions is pos
    assert out.request.mm.mrope_position_delta is req.mm.mrope_position_delta
    assert out.request.mm.mrope_position_delta_scalar == SIMPLE_DELTA
    np.testing.assert_array_equal(out.request.input_ids, req.input_ids)


def test_rule4_positions_present_missing_scalar_derived() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    pos = Tensor.from_numpy(SIMPLE_POS.astype(np.int64))
    req = upstream_request(p, mrope_positions=pos, mrope_position_delta=arr([[SIMPLE_DELTA]]))
    out = ok(req)
    assert out.request.mm.mrope_positions is pos
    assert out.request.mm.mrope_position_delta_scalar == SIMPLE_DELTA


def test_rule4_non_mrope_passthrough() -> None:
    p = Prompt({"vs": 1, "ve": 2, "image": 32000}, merge=1).text(2)
    p.image(2, 3, grid=False)
    req = upstream_request(p)
    out = ok(req, "llava")
    assert out.rule is Rule.UPSTREAM and out.passthrough
    np.testing.assert_array_equal(out.request.input_ids, req.input_ids)
    np.testing.assert_array_equal(out.request.input_ids_unpadded, req.input_ids_unpadded)
    assert out.request.mm.mrope_positions is None
    assert out.request.mm.mrope_position_delta_scalar is None
    assert [it.pad_value for it in out.request.mm.items] == [it.pad_value for it in req.mm.items]


def test_rule4_item_without_pad_value_invalid() -> None:
    p = _upstream_prompt()
    req = upstream_request(p)
    req.mm.items[1] = msgspec.structs.replace(req.mm.items[1], pad_value=None)
    aborts(req, AbortCode.INVALID_REQUEST, r"item 1\b", "pad_value")


def test_rule4_differing_id_not_the_items_pad_invalid() -> None:
    p = _upstream_prompt()
    req = upstream_request(p)
    s = int(req.mm.items[0].offsets[0, 0])
    ids = req.input_ids.copy()
    ids[s] = req.mm.items[1].pad_value  # another item's pad inside item 0's span
    req = dataclasses.replace(req, input_ids=ids)
    aborts(req, AbortCode.INVALID_REQUEST, rf"input_ids\[{s}\]", "item 0")


def test_rule4_differing_id_outside_spans_invalid() -> None:
    p = _upstream_prompt()
    req = upstream_request(p)
    ids = req.input_ids.copy()
    ids[0] = 5
    req = dataclasses.replace(req, input_ids=ids)
    aborts(req, AbortCode.INVALID_REQUEST, r"input_ids\[0\]", "outside")


def test_rule4_length_mismatch_invalid() -> None:
    p = _upstream_prompt()
    req = upstream_request(p)
    req = dataclasses.replace(req, input_ids=np.concatenate([req.input_ids, [1]]))
    aborts(req, AbortCode.INVALID_REQUEST, "input_ids_unpadded")


def test_rule4_partially_substituted_span_ok() -> None:
    """Only differing ids are checked: a placeholder left in place is fine."""
    p = _upstream_prompt()
    req = upstream_request(p)
    ids = req.input_ids.copy()
    s = int(req.mm.items[0].offsets[0, 0])
    ids[s] = req.input_ids_unpadded[s]
    assert isinstance(run(dataclasses.replace(req, input_ids=ids)), Materialized)


def test_rule4_upstream_validates_structure() -> None:
    p = _upstream_prompt()
    req = upstream_request(p)
    req.mm.items[0].side["image_grid_thw"] = arr([[1, 4, 8]])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", r"span 0")


# --------------------------------------------------------------------------- rule 5


def test_rule5_unknown_modality() -> None:
    req = simple_image_request()
    req.mm.items[0] = msgspec.structs.replace(req.mm.items[0], modality=7)
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "modality 7")


def test_rule5_unsupported_modality_audio_on_qwen3_5() -> None:
    p = Prompt({**Q35, "audio": 5000, "as": 5001, "ae": 5002}).text(2)
    p.image(4, 6)
    p.audio(4)
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 1\b", "audio")


def test_rule5_video_on_llava_unsupported() -> None:
    p = Prompt({"vs": 1, "ve": 2, "image": 32000, "video": 32001}, merge=1).text(2)
    p.image(2, 3, grid=False)
    p.video_rows([[1, 2, 2]])
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 1\b", "video", name="llava")


@pytest.mark.parametrize("offsets", [None, np.zeros((0, 2), np.int64)])
def test_rule5_empty_offsets(offsets: Any) -> None:
    req = simple_image_request()
    req.mm.items[0] = msgspec.structs.replace(req.mm.items[0], offsets=offsets)
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "offsets")


@pytest.mark.parametrize(
    "span",
    [[3, 11], [11, 11], [-1, 4], [6, 3]],
    ids=["end_out_of_range", "start_out_of_range", "negative_start", "start_gt_end"],
)
def test_rule5_bad_span(span: list[int]) -> None:
    req = simple_image_request()
    offs = np.asarray([span], np.int64)
    req.mm.items[0] = msgspec.structs.replace(req.mm.items[0], offsets=offs)
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", r"span 0", rf"\[{span[0]}, {span[1]}\]")


def test_rule5_bad_second_span_named() -> None:
    p = Prompt().text(2)
    p.video_per_frame(2, 4, 4)
    req = p.request()
    offs = req.mm.items[0].offsets.copy()
    offs[1] = [offs[1, 0], len(p.ids) + 3]
    req.mm.items[0] = msgspec.structs.replace(req.mm.items[0], offsets=offs)
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", r"span 1")


def test_rule5_overlapping_spans_across_items() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    p.image(4, 6)
    req = p.request()
    first = req.mm.items[0].offsets
    req.mm.items[1] = msgspec.structs.replace(req.mm.items[1], offsets=first.copy())
    out = aborts(req, AbortCode.INVALID_REQUEST, "overlap")
    assert "item 0" in out.message and "item 1" in out.message


def test_rule5_overlapping_spans_within_item() -> None:
    p = Prompt().text(2)
    p.video_per_frame(2, 4, 4)
    req = p.request()
    offs = req.mm.items[0].offsets.copy()
    offs[1] = offs[0]
    req.mm.items[0] = msgspec.structs.replace(req.mm.items[0], offsets=offs)
    aborts(req, AbortCode.INVALID_REQUEST, "overlap", r"item 0")


def test_rule5_span_not_holding_placeholder() -> None:
    req = simple_image_request()
    ids = req.input_ids.copy()
    ids[5] = 77
    req = dataclasses.replace(req, input_ids=ids)
    aborts(
        req,
        AbortCode.INVALID_REQUEST,
        r"item 0",
        r"span 0 \[3, 8\]",
        "77",
        r"\b5\b",
        str(Q35["image"]),
    )


def test_rule5_video_span_holding_image_placeholder() -> None:
    p = Prompt().text(2)
    p.video_per_frame(2, 4, 4)
    req = p.request()
    ids = req.input_ids.copy()
    s, e = req.mm.items[0].offsets[1]
    ids[s : e + 1] = Q35["image"]
    aborts(
        dataclasses.replace(req, input_ids=ids),
        AbortCode.INVALID_REQUEST,
        r"item 0",
        r"span 1",
        str(Q35["video"]),
    )


def test_rule5_tokens_around_span_not_checked() -> None:
    req = simple_image_request()
    ids = req.input_ids.copy()
    ids[2] = 42  # vision_start replaced by text
    ids[9] = 43  # vision_end replaced by text
    assert isinstance(run(dataclasses.replace(req, input_ids=ids)), Materialized)


def test_rule5_im_token_id_override_honored() -> None:
    other = 151655
    p = Prompt({**Q35, "image": other}).text(2)
    p.image(4, 6)
    out = ok(p.request(im_token_id=other))
    assert out.request.mm.im_token_id == other
    # the profile's placeholder is then wrong
    aborts(
        simple_image_request(im_token_id=other), AbortCode.INVALID_REQUEST, r"item 0", str(other)
    )


def test_rule5_video_token_id_override_honored() -> None:
    other = 151656
    p = Prompt({**Q35, "video": other}).text(2)
    p.video_per_frame(2, 4, 4)
    assert isinstance(run(p.request(video_token_id=other)), Materialized)
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", str(Q35["video"]))


def test_rule5_shm_feature_without_hash_invalid() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=None, feature_shm=ShmHandle("psm_1", (48, 2), "float32"))
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "shared-memory")


def test_rule5_shm_feature_with_hash_ok() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=99, feature_shm=ShmHandle("psm_1", (48, 2), "float32"))
    out = ok(p.request())
    assert out.request.mm.items[0].pad_value == BASE + 99
    assert out.request.mm.items[0].feature_shm.name == "psm_1"


def test_rule5_nothing_to_hash_invalid() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=None)
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "hash")


def test_rule5_feature_byte_length_mismatch_cannot_be_built() -> None:
    """A feature whose bytes do not match its shape never reaches the materializer:
    the Tensor refuses to exist (the transports word it with the item's name)."""
    with pytest.raises(InvalidRequest, match=r"item 0 feature: 40 data bytes .* needs 80"):
        Tensor(feature().dtype, (10, 2), memoryview(bytes(40)), TensorName(0, "feature"))


@pytest.mark.parametrize("pad", [BASE - 1, BASE + SLOTS, BASE + 3 * SLOTS, -5, 5])
def test_rule5_preset_pad_value_outside_interval(pad: int) -> None:
    p = Prompt().text(2)
    p.image(4, 6, pad_value=pad)
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "pad_value", str(pad))


def test_rule5_preset_video_pad_in_image_interval() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    p.video_per_frame(2, 4, 4, pad_value=BASE + 5)
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 1\b", "video")


def test_rule5_image_item_with_video_grid() -> None:
    req = simple_image_request()
    req.mm.items[0].side["video_grid_thw"] = arr([[1, 4, 6]])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "video_grid_thw")


def test_rule5_video_item_with_image_grid() -> None:
    p = Prompt().text(2)
    p.video_per_frame(2, 4, 4, side={"image_grid_thw": arr([[1, 4, 4]])})
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "image_grid_thw")


def test_rule5_audio_item_with_grid() -> None:
    p = Prompt(QWEN).text(2)
    p.audio(4)
    p.items[0].side["image_grid_thw"] = arr([[1, 2, 2]])
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "audio", name="qwen3_omni_moe")


def test_rule5_missing_grid() -> None:
    p = Prompt().text(2)
    p.image(4, 6, grid=False)
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "image_grid_thw")


@pytest.mark.parametrize("row", [[1, 5, 6], [1, 4, 7]])
def test_rule5_grid_not_divisible_by_merge(row: list[int]) -> None:
    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = arr([row])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "divisible")


@pytest.mark.parametrize("row", [[0, 4, 6], [1, 0, 6], [1, -4, 6]])
def test_rule5_grid_not_positive(row: list[int]) -> None:
    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = arr([row])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "positive")


def test_rule5_grid_float_dtype() -> None:
    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = arr([[1, 4, 6]], np.float32)
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "integer")


def test_rule5_grid_bad_shape() -> None:
    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = arr([[1, 4]])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "shape")


def test_rule5_image_t_not_1() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    req = p.request()
    req.mm.items[0].side["image_grid_thw"] = arr([[2, 4, 6]])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "t == 1")


def test_rule5_wrong_number_of_spans_vs_rows() -> None:
    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = arr([[1, 4, 6], [1, 4, 6]])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "1 placeholder spans", "2 expected")


def test_rule5_qwen3_5_video_needs_one_span_per_frame() -> None:
    # one run holding all 3 frames (Qwen2-VL layout) is wrong for Qwen3.5
    p = Prompt().text(2)
    p.video_rows([[3, 4, 4]])
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "1 placeholder spans", "3 expected")
    # the per-frame layout is right
    p = Prompt().text(2)
    p.video_per_frame(3, 4, 4)
    assert isinstance(run(p.request()), Materialized)


def test_rule5_qwen2_5_video_one_span_per_row() -> None:
    p = Prompt(QWEN).text(2)
    p.video_rows([[2, 4, 4]])
    assert isinstance(run(p.request(), "qwen2_5_vl"), Materialized)
    p = Prompt(QWEN).text(2)
    p.video_per_frame(2, 4, 4)  # per-frame runs: wrong for Qwen2.5-VL
    aborts(
        p.request(),
        AbortCode.INVALID_REQUEST,
        r"item 0",
        "2 placeholder spans",
        "1 expected",
        name="qwen2_5_vl",
    )


def test_rule5_span_length_vs_grid_mismatch() -> None:
    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = arr([[1, 4, 8]])
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", r"span 0 \[3, 8\]", "6 tokens", "8")


def test_rule5_per_frame_span_length_mismatch_names_span() -> None:
    p = Prompt().text(2)
    p.video_per_frame(3, 4, 4)
    req = p.request()
    offs = req.mm.items[0].offsets.copy()
    offs[2, 1] -= 1
    req.mm.items[0] = msgspec.structs.replace(req.mm.items[0], offsets=offs)
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", r"span 2", "per frame")


@pytest.mark.parametrize(
    "name, key", [("qwen2_5_vl", "second_per_grid_ts"), ("qwen3_omni_moe", "video_second_per_grid")]
)
def test_rule5_timing_tensor_count(name: str, key: str) -> None:
    def req_with(values: list[float]) -> Request:
        p = Prompt(QWEN).text(2)
        p.video_rows([[2, 4, 4], [2, 4, 4]], side={key: arr(values, np.float32)})
        return p.request()

    assert isinstance(run(req_with([1.0]), name), Materialized)  # one value for every row
    assert isinstance(run(req_with([1.0, 2.0]), name), Materialized)  # one per row
    aborts(
        req_with([1.0, 2.0, 3.0]), AbortCode.INVALID_REQUEST, r"item 0", key, "3 values", name=name
    )


def test_rule5_use_audio_in_video_unsupported() -> None:
    p = Prompt(QWEN).text(2)
    p.video_rows([[2, 4, 4]], side={"use_audio_in_video": arr([True], np.bool_)})
    aborts(
        p.request(), AbortCode.UNSUPPORTED, r"item 0", "use_audio_in_video", name="qwen3_omni_moe"
    )
    p = Prompt(QWEN).text(2)
    p.video_rows([[2, 4, 4]], side={"use_audio_in_video": arr([False], np.bool_)})
    assert isinstance(run(p.request(), "qwen3_omni_moe"), Materialized)


def test_rule5_use_audio_in_video_plain_bool_unsupported() -> None:
    """The wire keeps non-tensor model_specific_data values as plain Python values."""
    p = Prompt(QWEN).text(2)
    p.video_rows([[2, 4, 4]], side={"use_audio_in_video": True})
    aborts(
        p.request(), AbortCode.UNSUPPORTED, r"item 0", "use_audio_in_video", name="qwen3_omni_moe"
    )


def test_rule5_grid_not_a_tensor_invalid() -> None:
    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = [[1, 4, 6]]
    aborts(req, AbortCode.INVALID_REQUEST, r"item 0", "image_grid_thw")


def test_rule5_timing_not_a_tensor_is_not_internal() -> None:
    p = Prompt(QWEN).text(2)
    p.video_rows([[2, 4, 4]], side={"second_per_grid_ts": 2.0})
    out = run(p.request(), "qwen2_5_vl")
    assert isinstance(out, Materialized) or out.code is AbortCode.INVALID_REQUEST, out


def test_rule5_several_failures_one_abort_naming_a_bad_item() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    p.image(4, 6, grid=False)
    p.image(4, 6, hash=2**64)
    out = aborts(p.request(), AbortCode.INVALID_REQUEST, r"item [12]\b")
    assert "item 0" not in out.message


# --------------------------------------------------------------------------- rule 6


def test_rule6_preset_pad_value_kept_hash_untouched() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=None, pad_value=BASE + 17)
    p.image(4, 6, hash=123, pad_value=BASE + 999)  # not the formula's value: kept anyway
    out = ok(p.request())
    a, b = out.request.mm.items
    assert (a.hash, a.pad_value) == (None, BASE + 17)
    assert (b.hash, b.pad_value) == (123, BASE + 999)
    s, e = a.offsets[0]
    assert (out.request.input_ids[s : e + 1] == BASE + 17).all()


def test_rule6_content_hash_used() -> None:
    h = 0xDEADBEEFCAFEBABE
    p = Prompt().text(2)
    p.image(4, 6, hash=h, feature=feature())  # the content hash wins over the feature
    out = ok(p.request())
    it = out.request.mm.items[0]
    assert it.hash == h and it.pad_value == BASE + 0 * SLOTS + h % SLOTS


def test_rule6_feature_hashed_blake2b_8_big_endian() -> None:
    f = feature(256, seed=3)
    p = Prompt().text(2)
    p.image(4, 6, hash=None, feature=f)
    out = ok(p.request())
    it = out.request.mm.items[0]
    want = int.from_bytes(hashlib.blake2b(bytes(f.data), digest_size=8).digest(), "big")
    assert it.hash == want
    assert it.pad_value == BASE + want % SLOTS


def test_rule6_pad_formula_per_modality() -> None:
    assert PAD_BASE == BASE and PAD_SLOTS == SLOTS == (2**31 - 1 - BASE + 1) // 3
    h = 987654321987
    p = Prompt(QWEN).text(2)
    p.image(4, 4, hash=h)
    p.video_rows([[2, 4, 4]], hash=h)
    p.audio(3, hash=h)
    out = ok(p.request(), "qwen3_omni_moe")
    pads = [it.pad_value for it in out.request.mm.items]
    assert pads == [BASE + tag * SLOTS + h % SLOTS for tag in (0, 1, 2)]
    assert all(BASE <= v <= BASE + 3 * SLOTS - 1 < 2**31 for v in pads)


def test_rule6_hash_max_uint64_ok() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=2**64 - 1)
    p.image(4, 6, hash=0)
    out = ok(p.request())
    a, b = out.request.mm.items
    assert a.hash == 2**64 - 1 and a.pad_value == BASE + (2**64 - 1) % SLOTS
    assert b.hash == 0 and b.pad_value == BASE


@pytest.mark.parametrize("h", [2**64, -1, -(2**63)])
def test_rule6_hash_out_of_uint64_invalid(h: int) -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=h)
    aborts(p.request(), AbortCode.INVALID_REQUEST, r"item 0", "hash", str(h))


# --------------------------------------------------------------------------- rule 7


def test_rule7_positions_present_kept_scalar_derived() -> None:
    pos = Tensor.from_numpy(SIMPLE_POS.astype(np.int64))
    req = simple_image_request(mrope_positions=pos, mrope_position_delta=arr([[SIMPLE_DELTA]]))
    out = ok(req)
    assert out.rule is Rule.NORMAL
    assert out.request.mm.mrope_positions is pos
    assert out.request.mm.mrope_position_delta_scalar == SIMPLE_DELTA


def test_rule7_positions_present_kept_even_if_different() -> None:
    """Carried positions are kept as received (validated for shape and dtype only)."""
    custom = np.tile(np.arange(11, dtype=np.int32), (3, 1))
    req = simple_image_request(mrope_positions=Tensor.from_numpy(custom))
    out = ok(req)
    np.testing.assert_array_equal(out.request.mm.mrope_positions.to_numpy(), custom)
    assert out.request.mm.mrope_position_delta_scalar == 0


def test_rule7_both_deltas_missing_derived_from_positions() -> None:
    pos = SIMPLE_POS.astype(np.int64).copy()
    pos[:, -1] += 4  # max 11 -> delta 11 + 1 - 11 = 1
    req = simple_image_request(mrope_positions=Tensor.from_numpy(pos))
    out = ok(req)
    assert out.request.mm.mrope_position_delta_scalar == 1
    np.testing.assert_array_equal(out.request.mm.mrope_position_delta.to_numpy(), [[1]])


def test_rule7_tensor_scalar_delta_disagree() -> None:
    pos = Tensor.from_numpy(SIMPLE_POS.astype(np.int64))
    req = simple_image_request(
        mrope_positions=pos,
        mrope_position_delta=arr([[SIMPLE_DELTA]]),
        mrope_position_delta_scalar=SIMPLE_DELTA + 1,
    )
    aborts(req, AbortCode.INVALID_REQUEST, "disagree", str(SIMPLE_DELTA), str(SIMPLE_DELTA + 1))
    req = simple_image_request(
        mrope_position_delta=arr([[SIMPLE_DELTA]]), mrope_position_delta_scalar=SIMPLE_DELTA + 1
    )
    aborts(req, AbortCode.INVALID_REQUEST, "disagree")


def test_rule7_scalar_only_on_prefill_computes_positions() -> None:
    req = simple_image_request(mrope_position_delta_scalar=SIMPLE_DELTA)
    out = ok(req, role="prefill")
    np.testing.assert_array_equal(out.request.mm.mrope_positions.to_numpy(), SIMPLE_POS)
    assert out.request.mm.mrope_position_delta_scalar == SIMPLE_DELTA
    np.testing.assert_array_equal(out.request.mm.mrope_position_delta.to_numpy(), [[SIMPLE_DELTA]])


def test_rule7_tensor_only_delta_checked_and_positions_computed() -> None:
    out = ok(simple_image_request(mrope_position_delta=arr([[SIMPLE_DELTA]])))
    np.testing.assert_array_equal(out.request.mm.mrope_positions.to_numpy(), SIMPLE_POS)


@pytest.mark.parametrize("field", ["scalar", "tensor"])
def test_rule7_mismatching_carried_delta(field: str) -> None:
    kw = (
        {"mrope_position_delta_scalar": 4}
        if field == "scalar"
        else {"mrope_position_delta": arr([[4]])}
    )
    aborts(simple_image_request(**kw), AbortCode.INVALID_REQUEST, "4", str(SIMPLE_DELTA))


@pytest.mark.parametrize(
    "positions, word",
    [
        (np.zeros((3, 10), np.int64), "shape"),
        (np.zeros((2, 11), np.int64), "shape"),
        (np.zeros((11,), np.int64), "shape"),
        (np.zeros((3, 12), np.int64), "shape"),
        (SIMPLE_POS.astype(np.float32), "integer"),
    ],
    ids=["shape-3x10", "shape-2x11", "shape-11", "shape-3x12", "float-dtype"],
)
def test_rule7_carried_positions_refused(positions: np.ndarray, word: str) -> None:
    aborts(
        simple_image_request(mrope_positions=Tensor.from_numpy(positions)),
        AbortCode.INVALID_REQUEST,
        "mrope_positions",
        word,
    )


def test_rule7_delta_float_dtype() -> None:
    aborts(
        simple_image_request(mrope_position_delta=arr([[-3.0]], np.float32)),
        AbortCode.INVALID_REQUEST,
        "mrope_position_delta",
    )


def test_rule7_not_for_non_mrope_family() -> None:
    p = Prompt({"vs": 1, "ve": 2, "image": 32000}, merge=1).text(2)
    p.image(2, 3, grid=False)
    out = ok(p.request(), "llava")
    assert out.request.mm.mrope_positions is None
    assert out.request.mm.mrope_position_delta is None
    assert out.request.mm.mrope_position_delta_scalar is None


# --------------------------------------------------------------------------- rule 8


def test_rule8_substitution_hand_computed() -> None:
    req = freeze(simple_image_request())
    before = snapshot(req)
    out = ok(req)
    assert out.rule is Rule.NORMAL and not out.passthrough
    r = out.request
    pad = BASE + 12345
    want = req.input_ids.copy()
    want[3:9] = pad
    np.testing.assert_array_equal(r.input_ids, want)
    np.testing.assert_array_equal(r.input_ids_unpadded, req.input_ids)
    assert r.input_ids.dtype == np.int64
    np.testing.assert_array_equal(r.mm.mrope_positions.to_numpy(), SIMPLE_POS)
    assert r.mm.mrope_positions.dtype.name == "int64"
    assert r.mm.mrope_position_delta_scalar == SIMPLE_DELTA
    np.testing.assert_array_equal(r.mm.mrope_position_delta.to_numpy(), [[SIMPLE_DELTA]])
    assert r.mm.mrope_position_delta.shape == (1, 1)
    assert r.mm.items[0].pad_value == pad and r.mm.items[0].hash == 12345
    # the input object was not modified
    assert_same(snapshot(req), before)
    assert req.input_ids_unpadded is None and req.mm.items[0].pad_value is None
    assert req.mm.mrope_positions is None and req.mm.mrope_position_delta_scalar is None
    assert r is not req and r.mm is not req.mm and r.input_ids is not req.input_ids


def test_rule8_multi_span_video_substituted() -> None:
    p = Prompt().text(2)
    p.video_per_frame(3, 4, 4, hash=77)
    req = p.request()
    out = ok(req)
    pad = BASE + SLOTS + 77
    for s, e in req.mm.items[0].offsets:
        assert (out.request.input_ids[s : e + 1] == pad).all()
    mask = np.ones(len(p.ids), bool)
    for s, e in req.mm.items[0].offsets:
        mask[s : e + 1] = False
    np.testing.assert_array_equal(out.request.input_ids[mask], req.input_ids[mask])


def test_rule8_other_multimodal_substitution_no_mrope() -> None:
    p = Prompt({"vs": 1, "ve": 2, "image": 32000}, merge=1).text(2)
    it = p.image(2, 3, grid=False, hash=None, feature=feature(48))
    out = ok(p.request(), "llava")
    assert out.rule is Rule.NORMAL
    pad = BASE + fhash(it.feature) % SLOTS
    s, e = it.offsets[0]
    assert (out.request.input_ids[s : e + 1] == pad).all()
    np.testing.assert_array_equal(out.request.input_ids_unpadded, p.ids)


def test_rule8_kimi_style_media_placeholder() -> None:
    tok = {"vs": 1, "ve": 2, "image": 163605, "video": 163605}
    p = Prompt(tok, merge=1).text(2)
    p.image(2, 2, grid=False)
    p.video_rows([[2, 2, 2]], hash=5)
    out = ok(p.request(), "kimi")
    a, b = out.request.mm.items
    assert b.pad_value == BASE + SLOTS + 5
    assert out.request.mm.mrope_positions is None


@pytest.mark.parametrize("bad", ["item", "span", "vocab", "too_large"])
def test_input_unchanged_after_abort(bad: str) -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=None, feature=feature())
    p.video_per_frame(2, 4, 4)
    req = p.request(mrope_position_delta_scalar=None)
    if bad == "item":
        req.mm.items[1].side["video_grid_thw"] = arr([[2, 4, 8]])
    elif bad == "span":
        req.mm.items[1].offsets = req.mm.items[1].offsets.copy()
        req.mm.items[1].offsets[0, 1] += 1
    elif bad == "vocab":
        req.input_ids[-1] = 10**9
    freeze(req)
    before = snapshot(req)
    limits = Limits(max_tokens=10) if bad == "too_large" else None
    out = run(req, limits=limits)
    assert isinstance(out, Abort) and out.code is not AbortCode.INTERNAL, out
    assert_same(snapshot(req), before)
    assert req.mm.items[0].hash is None and req.mm.items[0].pad_value is None


# ------------------------------------------------------------------ checks on every request


def test_vocab_id_too_large() -> None:
    req = simple_image_request()
    ids = req.input_ids.copy()
    ids[1] = 248320
    aborts(
        dataclasses.replace(req, input_ids=ids),
        AbortCode.INVALID_REQUEST,
        r"input_ids\[1\]",
        "248320",
        "vocabulary",
    )
    aborts(
        Request(rid="t", input_ids=np.asarray([1, 128256], np.int64)),
        AbortCode.INVALID_REQUEST,
        r"input_ids\[1\]",
        name="llama",
    )


def test_vocab_negative_id() -> None:
    aborts(
        Request(rid="t", input_ids=np.asarray([1, 2, -1], np.int64)),
        AbortCode.INVALID_REQUEST,
        r"input_ids\[2\]",
        "-1",
    )


def test_vocab_checked_on_unpadded_when_set() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    req = upstream_request(p)
    assert isinstance(run(req), Materialized)  # padded ids exceed the vocabulary: fine
    un = req.input_ids_unpadded.copy()
    un[0] = 300000
    aborts(
        dataclasses.replace(req, input_ids_unpadded=un),
        AbortCode.INVALID_REQUEST,
        r"input_ids_unpadded\[0\]",
    )


def test_text_request_with_unpadded_mismatch_invalid() -> None:
    req = Request(
        rid="t",
        input_ids=np.asarray([1, 2, 3], np.int64),
        input_ids_unpadded=np.asarray([1, 2, 4], np.int64),
    )
    aborts(req, AbortCode.INVALID_REQUEST, r"input_ids\[2\]")


def test_empty_input_ids_invalid() -> None:
    aborts(Request(rid="t", input_ids=np.zeros(0, np.int64)), AbortCode.INVALID_REQUEST, "empty")


def test_too_large_max_model_len() -> None:
    ids = np.arange(10, dtype=np.int64)
    assert isinstance(run(Request("t", ids[:9]), max_model_len=10), Materialized)
    aborts(Request("t", ids), AbortCode.TOO_LARGE, "max_model_len", "10", max_model_len=10)
    aborts(simple_image_request(), AbortCode.TOO_LARGE, max_model_len=11)


def test_too_large_max_tokens() -> None:
    ids = np.arange(6, dtype=np.int64)
    assert isinstance(run(Request("t", ids[:5]), limits=Limits(max_tokens=5)), Materialized)
    aborts(Request("t", ids), AbortCode.TOO_LARGE, "6", "5", limits=Limits(max_tokens=5))


def test_too_large_max_items() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    p.image(4, 6)
    assert isinstance(run(p.request(), limits=Limits(max_items=2)), Materialized)
    aborts(p.request(), AbortCode.TOO_LARGE, "2 items", limits=Limits(max_items=1))


def test_too_large_max_tensor_bytes() -> None:
    p = Prompt().text(2)
    p.image(4, 6, feature=feature(128))
    assert isinstance(run(p.request(), limits=Limits(max_tensor_bytes=128)), Materialized)
    aborts(
        p.request(),
        AbortCode.TOO_LARGE,
        r"item 0 feature",
        "128",
        limits=Limits(max_tensor_bytes=127),
    )


def test_too_large_positions_tensor_bytes() -> None:
    pos = Tensor.from_numpy(SIMPLE_POS.astype(np.int64))  # 264 bytes
    aborts(
        simple_image_request(mrope_positions=pos),
        AbortCode.TOO_LARGE,
        "mrope_positions",
        limits=Limits(max_tensor_bytes=200),
    )


def test_too_large_tensor_rank() -> None:
    deep = Tensor.from_numpy(np.zeros((1,) * 9 + (16,), np.float32))
    p = Prompt().text(2)
    p.image(4, 6, feature=deep)
    aborts(p.request(), AbortCode.TOO_LARGE, r"item 0 feature", "rank")
    p = Prompt().text(2)
    p.image(4, 6, feature=Tensor.from_numpy(np.zeros((2, 2, 2), np.float32)))
    aborts(p.request(), AbortCode.TOO_LARGE, "rank", limits=Limits(max_tensor_rank=2))


@pytest.mark.parametrize(
    "text, code, message",
    [
        ("TOO_LARGE: prompt too long", AbortCode.TOO_LARGE, "prompt too long"),
        ("UNSUPPORTED: nope", AbortCode.UNSUPPORTED, "nope"),
        ("INVALID_REQUEST: bad", AbortCode.INVALID_REQUEST, "bad"),
        (
            "something went wrong upstream",
            AbortCode.INVALID_REQUEST,
            "something went wrong upstream",
        ),
    ],
)
def test_validation_error_already_set(text: str, code: AbortCode, message: str) -> None:
    req = dataclasses.replace(simple_image_request(), validation_error=text)
    out = run(req)
    assert isinstance(out, Abort) and out.code is code and out.message == message
    # also before any other check: an empty, oversized request keeps the marked code
    req = Request(rid="t", input_ids=np.zeros(0, np.int64), validation_error=text)
    out = run(req, "llama")
    assert isinstance(out, Abort) and out.code is code


# --------------------------------------------------------------------------- media cases


def test_duplicated_media_same_pad_value() -> None:
    p = Prompt().text(2)
    p.image(4, 6, hash=555)
    p.text(3)
    p.image(4, 6, hash=555)
    out = ok(p.request())
    a, b = out.request.mm.items
    assert a.pad_value == b.pad_value == BASE + 555
    for it in (a, b):
        s, e = it.offsets[0]
        assert (out.request.input_ids[s : e + 1] == a.pad_value).all()
    pos = out.request.mm.mrope_positions.to_numpy()
    assert pos[0, a.offsets[0, 0]] != pos[0, b.offsets[0, 0]]  # runs still positioned apart


def test_duplicated_feature_bytes_same_pad_value() -> None:
    f = feature(96, seed=9)
    g = Tensor.from_numpy(f.to_numpy().copy())
    p = Prompt().text(2)
    p.image(4, 6, hash=None, feature=f)
    p.image(4, 6, hash=None, feature=g)
    p.image(4, 6, hash=None, feature=feature(96, seed=10))
    a, b, c = ok(p.request()).request.mm.items
    assert a.hash == b.hash == fhash(f) and a.pad_value == b.pad_value
    assert c.pad_value != a.pad_value


@pytest.mark.parametrize("name", ["qwen3_5", "qwen2_5_vl", "qwen3_omni_moe"])
def test_reordered_items_same_result(name: str) -> None:
    tok = Q35 if name == "qwen3_5" else QWEN
    p = Prompt(tok).text(3)
    p.image(4, 6)
    if name == "qwen3_5":
        p.video_per_frame(3, 4, 4)
    else:
        p.video_rows(
            [[2, 4, 4], [3, 4, 8]],
            side={
                ("second_per_grid_ts" if name == "qwen2_5_vl" else "video_second_per_grid"): arr(
                    [0.5, 1.0], np.float32
                )
            },
        )
    p.image(8, 4)
    if name == "qwen3_omni_moe":
        p.audio(7)
    p.text(2)
    in_order = ok(p.request(), name).request
    rev = p.request()
    rev.mm.items = list(reversed(rev.mm.items))
    reordered = ok(rev, name).request
    np.testing.assert_array_equal(reordered.input_ids, in_order.input_ids)
    np.testing.assert_array_equal(
        reordered.mm.mrope_positions.to_numpy(), in_order.mm.mrope_positions.to_numpy()
    )
    assert reordered.mm.mrope_position_delta_scalar == in_order.mm.mrope_position_delta_scalar
    assert [it.pad_value for it in reordered.mm.items] == [
        it.pad_value for it in reversed(in_order.mm.items)
    ]


def test_run_never_raises_and_materialize_raises() -> None:
    from mmadmit.errors import InvalidRequest

    req = simple_image_request()
    req.mm.items[0].side["image_grid_thw"] = arr([[1, 4, 8]])
    with pytest.raises(InvalidRequest, match="item 0"):
        Materializer(profile("qwen3_5")).materialize(req)


def test_decode_exempt_unpadded_length_mismatch_invalid() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    req = upstream_request(p, mrope_position_delta_scalar=SIMPLE_DELTA)
    req = dataclasses.replace(req, input_ids=np.concatenate([req.input_ids, [5]]))
    aborts(req, AbortCode.INVALID_REQUEST, "input_ids_unpadded", **DECODE)


def test_decode_exempt_id_changed_outside_every_span_invalid() -> None:
    p = Prompt().text(2)
    p.image(4, 6)
    req = upstream_request(p, mrope_position_delta_scalar=SIMPLE_DELTA)
    ids = req.input_ids.copy()
    ids[0] = ids[0] + 1  # text token changed: not any item's pad value
    req = dataclasses.replace(req, input_ids=ids)
    aborts(req, AbortCode.INVALID_REQUEST, "outside every item's span", **DECODE)
