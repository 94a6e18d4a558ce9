"""Hand-computed M-RoPE positions for the cases where docs/spec/MATERIALIZE.md departs from
transformers 5.x, and for the conventions worth pinning down by hand.

Every expected array below was written out from the spec's rules
("M-RoPE conventions per family"), not produced by running mrope:

* text: the same position on all three axes, counting up by one;
* a run starting at position ``s`` with merged grid ``T' x H' x W'`` (tokens
  frame-major, then row, then column) gets ``t = s + t_index[k]``,
  ``h = s + row``, ``w = s + col``;
* the text after a run resumes at (largest position of the run) + 1;
* ``delta = max(positions) + 1 - N``.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from conftest import SESSION_NATIVE  # noqa: E402
from hf_oracle import hf_positions, hf_rope_index  # noqa: E402
from mmadmit import mrope, planner, rules  # noqa: E402
from mmadmit.errors import InvalidRequest  # noqa: E402
from mmadmit.model import Item, Modality, Tensor  # noqa: E402
from mmadmit.profile import load_profile  # noqa: E402

# Public checkpoint ids (docs/spec/MATERIALIZE.md).
IMG, VID, VS, VE = 151655, 151656, 151652, 151653
AUD, AS, AE = 151675, 151669, 151670
Q35_VID, Q35_VS, Q35_VE = 248057, 248053, 248054
T = 100  # any plain text id


def _grid(key: str, rows: list[list[int]]) -> dict[str, Tensor]:
    return {key: Tensor.from_numpy(np.array(rows, np.int64))}


def _item(modality: Modality, spans: list[list[int]], **side: Tensor) -> Item:
    return Item(modality=int(modality), offsets=np.array(spans, np.int64), side=dict(side))


def _video(spans: list[list[int]], rows: list[list[int]], **timing: list[float]) -> Item:
    side = _grid("video_grid_thw", rows)
    for key, values in timing.items():
        side[key] = Tensor.from_numpy(np.array(values, np.float32))
    return Item(modality=int(Modality.VIDEO), offsets=np.array(spans, np.int64), side=side)


def _image(spans: list[list[int]], rows: list[list[int]]) -> Item:
    return Item(
        modality=int(Modality.IMAGE),
        offsets=np.array(spans, np.int64),
        side=_grid("image_grid_thw", rows),
    )


def _mmadmit(family: str, ids: list[int], items: list[Item]) -> tuple[np.ndarray, int]:
    plan = rules.plan_runs(load_profile(family), items)
    pos, delta = planner.positions(len(ids), plan)
    assert mrope.delta_only(len(ids), plan) == delta
    return pos, delta


def _check(
    family: str, ids: list[int], items: list[Item], expected: list[list[int]], delta: int
) -> None:
    want = np.array(expected, np.int64)
    assert want.shape == (3, len(ids)), "hand-written expectation has the wrong length"
    assert int(want.max()) + 1 - len(ids) == delta, "hand-written delta is inconsistent"
    pos, got_delta = _mmadmit(family, ids, items)
    np.testing.assert_array_equal(pos, want)
    assert got_delta == delta


# --------------------------------------------------------------------------------------
# Qwen2-VL: a video with several frames, then text (deviation 1)

# [t, <vs>, video (4,4,2) -> T'=4 H'=2 W'=1: 8 tokens at 2..9, <ve>, t, t]
Q2_IDS = [T, VS] + [VID] * 8 + [VE, T, T]
Q2_ITEMS = lambda: [_video([[2, 9]], [[4, 4, 2]])]  # noqa: E731
# run origin s=2; frame k -> t = 2+k; rows 0,1 -> h = 2,3; one column -> w = 2.
# Largest position of the run is 5 (t of frame 3), so <ve> is at 6, the text at 7, 8.
Q2_EXPECTED = [
    [0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 7, 8],
    [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 6, 7, 8],
    [0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 6, 7, 8],
]
Q2_DELTA = 8 + 1 - 13  # -4


def test_qwen2_vl_video_then_text_resumes_after_largest_position() -> None:
    _check("qwen2_vl", Q2_IDS, Q2_ITEMS(), Q2_EXPECTED, Q2_DELTA)


def test_qwen2_vl_video_deviates_from_transformers_5() -> None:
    """Documents deviation 1: transformers 5.x resumes the text after a video at
    ``s + max(H', W') = 2 + 2 = 4``, ignoring the temporal extent, so the text
    (positions 4, 5, 6) overlaps the video's later frames (t = 4, 5). The models
    were trained with "largest position + 1" (4.x, vLLM, SGLang); the spec keeps it.
    If this starts failing, transformers changed its rule: re-read the spec's
    deviation list before touching mmadmit."""
    hf_pos, hf_delta = hf_positions("qwen2_vl", Q2_IDS, video_grid_thw=[[4, 4, 2]])
    # The video run itself is identical ...
    np.testing.assert_array_equal(hf_pos[:, :10], np.array(Q2_EXPECTED)[:, :10])
    # ... but 5.x restarts the text at 4 (<ve>, t, t = 4, 5, 6) and its max is 6.
    np.testing.assert_array_equal(hf_pos[:, 10:], [[4, 5, 6]] * 3)
    assert hf_delta == 6 + 1 - 13
    pos, delta = _mmadmit("qwen2_vl", Q2_IDS, Q2_ITEMS())
    assert not np.array_equal(pos, hf_pos) and delta != hf_delta


# --------------------------------------------------------------------------------------
# Qwen2.5-VL: temporal index trunc((k * s) * tokens_per_second), float32, tps = 2

# [t, <vs>, A (2,4,4) 8 tokens at 2..9, <ve>, t, <vs>, B (3,2,4) 6 tokens at 13..18, <ve>, t]
Q25_IDS = [T, VS] + [VID] * 8 + [VE, T, VS] + [VID] * 6 + [VE, T]
# A: s=0.5 -> t_index = trunc(k*0.5*2) = 0, 1; origin 2; H'=W'=2.
#    largest = 2 + max(1, 1, 1) = 3 -> <ve> 4, t 5, <vs> 6.
# B: s=1.0 -> t_index = 0, 2, 4; origin 7; H'=1, W'=2.
#    largest = 7 + max(4, 0, 1) = 11 -> <ve> 12, t 13.
Q25_EXPECTED = [
    [0, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 5, 6, 7, 7, 9, 9, 11, 11, 12, 13],
    [0, 1, 2, 2, 3, 3, 2, 2, 3, 3, 4, 5, 6, 7, 7, 7, 7, 7, 7, 12, 13],
    [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 6, 7, 8, 7, 8, 7, 8, 12, 13],
]
Q25_DELTA = 13 + 1 - 21  # -7


@pytest.mark.parametrize(
    "items",
    [
        # two items, one timing value each
        lambda: [
            _video([[2, 9]], [[2, 4, 4]], second_per_grid_ts=[0.5]),
            _video([[13, 18]], [[3, 2, 4]], second_per_grid_ts=[1.0]),
        ],
        # one item with two grid rows and one value per row
        lambda: [_video([[2, 9], [13, 18]], [[2, 4, 4], [3, 2, 4]], second_per_grid_ts=[0.5, 1.0])],
        # the fallback key, and 1.0 as the default when absent
        lambda: [
            _video([[2, 9]], [[2, 4, 4]], video_second_per_grid=[0.5]),
            _video([[13, 18]], [[3, 2, 4]]),
        ],
    ],
    ids=["two-items", "one-item-two-rows", "fallback-key-and-default"],
)
def test_qwen2_5_vl_video_seconds_scale_temporal_index(items) -> None:  # type: ignore[no-untyped-def]
    _check("qwen2_5_vl", Q25_IDS, items(), Q25_EXPECTED, Q25_DELTA)


def test_qwen2_5_vl_temporal_index_is_float32() -> None:
    """s = 0.7 (float32 0.699999988...), tps = 2, T' = 6: in float32 k*s rounds to
    0, 0.7, 1.4, 2.1, 2.8, 3.5 exactly enough that (k*s)*2 = 0, 1.4, 2.8, 4.2, 5.6, 7.0,
    so t_index = 0, 1, 2, 4, 5, 7. (In float64, 5 * 0.699999988 * 2 = 6.99999988
    would truncate to 6.)"""
    ids = [VS] + [VID] * 6 + [VE, T]
    # origin 1; H'=W'=1; largest = 1 + 7 = 8 -> <ve> 9, t 10.
    expected = [
        [0, 1, 2, 3, 5, 6, 8, 9, 10],
        [0, 1, 1, 1, 1, 1, 1, 9, 10],
        [0, 1, 1, 1, 1, 1, 1, 9, 10],
    ]
    _check(
        "qwen2_5_vl",
        ids,
        [_video([[1, 6]], [[6, 2, 2]], second_per_grid_ts=[0.7])],
        expected,
        10 + 1 - 9,
    )


# --------------------------------------------------------------------------------------
# Qwen3-Omni: video temporal index trunc(k * f32(s * position_id_per_seconds)) (deviation 2)

# [t, <vs>, video (4,4,2) -> T'=4 H'=2 W'=1: 8 tokens at 2..9, <ve>, t]
OMNI_V_IDS = [T, VS] + [VID] * 8 + [VE, T]
# s=0.5, pips=13 -> step 6.5 -> t_index = trunc(0, 6.5, 13, 19.5) = 0, 6, 13, 19; origin 2.
# largest = 2 + 19 = 21 -> <ve> 22, t 23.
OMNI_V_EXPECTED = [
    [0, 1, 2, 2, 8, 8, 15, 15, 21, 21, 22, 23],
    [0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 22, 23],
    [0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 22, 23],
]
OMNI_V_DELTA = 23 + 1 - 12  # 12


@pytest.mark.parametrize("key", ["video_second_per_grid", "second_per_grid_ts"])
def test_qwen3_omni_fractional_video_step_truncates(key: str) -> None:
    item = _video([[2, 9]], [[4, 4, 2]], **{key: [0.5]})
    _check("qwen3_omni_moe", OMNI_V_IDS, [item], OMNI_V_EXPECTED, OMNI_V_DELTA)


def test_qwen3_omni_fractional_video_step_transformers_returns_fractions() -> None:
    """Documents deviation 2: transformers returns float positions 8.5 and 21.5 for
    frames 1 and 3, and the text after the run at 22.5; engines store integers."""
    pos, delta = hf_rope_index(
        "qwen3_omni_moe", OMNI_V_IDS, video_grid_thw=[[4, 4, 2]], video_second_per_grid=[0.5]
    )
    assert pos[0, 2:10].tolist() == [2.0, 2.0, 8.5, 8.5, 15.0, 15.0, 21.5, 21.5]
    assert pos[0, 10:].tolist() == [22.5, 23.5]
    with pytest.raises(ValueError, match="fractional"):
        hf_positions(
            "qwen3_omni_moe", OMNI_V_IDS, video_grid_thw=[[4, 4, 2]], video_second_per_grid=[0.5]
        )


def test_qwen3_omni_video_default_seconds_per_chunk() -> None:
    """No timing tensor: s = seconds_per_chunk = 2.0 -> step 26 -> t_index 0, 26, 52."""
    ids = [VS] + [VID] * 3 + [VE]
    # origin 1; largest = 1 + 52 = 53 -> <ve> 54.
    expected = [
        [0, 1, 27, 53, 54],
        [0, 1, 1, 1, 54],
        [0, 1, 1, 1, 54],
    ]
    _check("qwen3_omni_moe", ids, [_video([[1, 3]], [[3, 2, 2]])], expected, 54 + 1 - 5)
    # integral step: transformers agrees when given the same 2.0 seconds
    hf_pos, hf_delta = hf_positions(
        "qwen3_omni_moe", ids, video_grid_thw=[[3, 2, 2]], video_second_per_grid=[2.0]
    )
    np.testing.assert_array_equal(hf_pos, np.array(expected))
    assert hf_delta == 50


# [t, <as>, audio 5 tokens at 2..6, <ae>, t, <vs>, image (1,4,4) 4 tokens at 10..13, <ve>, t]
OMNI_A_IDS = [T, AS] + [AUD] * 5 + [AE, T, VS] + [IMG] * 4 + [VE, T]
# audio advances like text on all axes: 2..6; <ae> 7, t 8, <vs> 9;
# image origin 10, H'=W'=2: largest 11 -> <ve> 12, t 13.
OMNI_A_EXPECTED = [
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 10, 10, 12, 13],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 11, 11, 12, 13],
    [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 10, 11, 12, 13],
]
OMNI_A_DELTA = 13 + 1 - 16  # -2


def test_qwen3_omni_audio_is_linear_on_all_axes() -> None:
    items = [_item(Modality.AUDIO, [[2, 6]]), _image([[10, 13]], [[1, 4, 4]])]
    _check("qwen3_omni_moe", OMNI_A_IDS, items, OMNI_A_EXPECTED, OMNI_A_DELTA)
    # the spec follows transformers here
    hf_pos, hf_delta = hf_positions(
        "qwen3_omni_moe", OMNI_A_IDS, image_grid_thw=[[1, 4, 4]], audio_lengths=[5]
    )
    np.testing.assert_array_equal(hf_pos, np.array(OMNI_A_EXPECTED))
    assert hf_delta == OMNI_A_DELTA


def test_qwen3_omni_audio_only_prompt_is_plain_text_positions() -> None:
    ids = [T, AS] + [AUD] * 7 + [AE, T]
    expected = [list(range(11))] * 3
    _check("qwen3_omni_moe", ids, [_item(Modality.AUDIO, [[2, 8]])], expected, 0)


def test_qwen3_omni_audio_item_must_not_carry_a_grid() -> None:
    item = _item(Modality.AUDIO, [[2, 6]], **_grid("image_grid_thw", [[1, 2, 2]]))
    with pytest.raises(InvalidRequest):
        rules.plan_runs(load_profile("qwen3_omni_moe"), [item])


# --------------------------------------------------------------------------------------
# Qwen3.5 (and Qwen3-VL): a video split into one run per frame; t index always 0

# [t, (ts ts <vs> frame(4 tokens) <ve>) x 3, t]; video grid (3,4,4): per frame H'=W'=2.
Q35_IDS = [T] + ([T, T, Q35_VS] + [Q35_VID] * 4 + [Q35_VE]) * 3 + [T]
Q35_SPANS = [[4, 7], [12, 15], [20, 23]]
# frame 0 origin 4 (after t, ts, ts, <vs> at 0..3): largest 5 -> <ve> 6, ts 7 8, <vs> 9;
# frame 1 origin 10: largest 11 -> <ve> 12, ts 13 14, <vs> 15;
# frame 2 origin 16: largest 17 -> <ve> 18, t 19.
Q35_EXPECTED = [
    [0, 1, 2, 3, 4, 4, 4, 4, 6, 7, 8, 9, 10, 10, 10, 10, 12, 13, 14, 15, 16, 16, 16, 16, 18, 19],
    [0, 1, 2, 3, 4, 4, 5, 5, 6, 7, 8, 9, 10, 10, 11, 11, 12, 13, 14, 15, 16, 16, 17, 17, 18, 19],
    [0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11, 10, 11, 12, 13, 14, 15, 16, 17, 16, 17, 18, 19],
]
Q35_DELTA = 19 + 1 - 26  # -6


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_qwen3_5_video_split_per_frame(family: str) -> None:
    _check(family, Q35_IDS, [_video(Q35_SPANS, [[3, 4, 4]])], Q35_EXPECTED, Q35_DELTA)
    # the spec follows transformers here
    hf_pos, hf_delta = hf_positions(family, Q35_IDS, video_grid_thw=[[3, 4, 4]])
    np.testing.assert_array_equal(hf_pos, np.array(Q35_EXPECTED))
    assert hf_delta == Q35_DELTA


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_video_split_per_frame(family: str) -> None:
    ids = [{Q35_VS: VS, Q35_VE: VE, Q35_VID: VID}.get(t, t) for t in Q35_IDS]
    _check(family, ids, [_video(Q35_SPANS, [[3, 4, 4]])], Q35_EXPECTED, Q35_DELTA)


def test_qwen3_5_video_needs_one_span_per_frame() -> None:
    # one span holding all 12 tokens is the Qwen2-VL layout, not Qwen3.5's
    item = _video([[4, 15]], [[3, 4, 4]])
    with pytest.raises(InvalidRequest, match="spans"):
        rules.plan_runs(load_profile("qwen3_5"), [item])


# --------------------------------------------------------------------------------------
# The decode-side exemption (rule 2): only the delta, computed from the grids, through
# the whole materializer (mrope.delta_only, never the per-token positions). A wrong
# temporal extent there changes only this delta, so each video case above is checked
# against its hand-written delta here too, with native code on and off.


def _decode_delta(family: str, ids: list[int], items: list[Item]) -> int:
    from mmadmit import native
    from mmadmit.materializer import Materializer
    from mmadmit.model import Materialized, MultimodalInputs, Request

    m = Materializer(load_profile(family, role="decode", language_model_only=True))
    for i, item in enumerate(items):
        item.hash = 1000 + i
    deltas = []
    for on in (True, False):
        native.set_enabled(on)
        try:
            req = Request("decode", np.array(ids, np.int64), mm=MultimodalInputs(items=items))
            out = m.run(req)
        finally:
            native.set_enabled(SESSION_NATIVE)
        assert isinstance(out, Materialized), out
        mm = out.request.mm
        assert mm is not None and mm.items == [] and mm.mrope_positions is None
        assert mm.mrope_position_delta is not None
        assert mm.mrope_position_delta.to_numpy().tolist() == [[mm.mrope_position_delta_scalar]]
        assert np.array_equal(out.request.input_ids, ids)  # kept exactly as received
        deltas.append(mm.mrope_position_delta_scalar)
    assert deltas[0] == deltas[1]
    return int(deltas[0])


@pytest.mark.parametrize(
    "family, ids, items, delta",
    [
        ("qwen2_vl", Q2_IDS, Q2_ITEMS, Q2_DELTA),
        (
            "qwen2_5_vl",
            Q25_IDS,
            lambda: [
                _video([[2, 9]], [[2, 4, 4]], second_per_grid_ts=[0.5]),
                _video([[13, 18]], [[3, 2, 4]], second_per_grid_ts=[1.0]),
            ],
            Q25_DELTA,
        ),
        (
            "qwen2_5_vl",
            Q25_IDS,
            lambda: [
                _video([[2, 9], [13, 18]], [[2, 4, 4], [3, 2, 4]], second_per_grid_ts=[0.5, 1.0])
            ],
            Q25_DELTA,
        ),
        (
            "qwen2_5_vl",
            [VS] + [VID] * 6 + [VE, T],
            lambda: [_video([[1, 6]], [[6, 2, 2]], second_per_grid_ts=[0.7])],
            10 + 1 - 9,
        ),
        (
            "qwen3_omni_moe",
            OMNI_V_IDS,
            lambda: [_video([[2, 9]], [[4, 4, 2]], video_second_per_grid=[0.5])],
            OMNI_V_DELTA,
        ),
        (
            "qwen3_omni_moe",
            [VS] + [VID] * 3 + [VE],
            lambda: [_video([[1, 3]], [[3, 2, 2]])],
            54 + 1 - 5,
        ),
        (
            "qwen3_omni_moe",
            OMNI_A_IDS,
            lambda: [_item(Modality.AUDIO, [[2, 6]]), _image([[10, 13]], [[1, 4, 4]])],
            OMNI_A_DELTA,
        ),
        ("qwen3_5", Q35_IDS, lambda: [_video(Q35_SPANS, [[3, 4, 4]])], Q35_DELTA),
    ],
    ids=[
        "qwen2_vl-video",
        "qwen2_5_vl-two-videos",
        "qwen2_5_vl-two-rows",
        "qwen2_5_vl-float32",
        "omni-fractional-step",
        "omni-default-seconds",
        "omni-audio-image",
        "qwen3_5-split-video",
    ],
)
def test_decode_side_delta_hand_computed(family: str, ids: list[int], items, delta: int) -> None:  # type: ignore[no-untyped-def]
    assert _decode_delta(family, ids, items()) == delta
