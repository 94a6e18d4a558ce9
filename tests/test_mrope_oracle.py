"""Differential test: mmadmit's M-RoPE positions equal transformers' ``get_rope_index``.

docs/spec/MATERIALIZE.md makes each family's ``get_rope_index`` in Hugging Face
transformers the reference, except for two known deviations of 5.x, which are
kept out of these prompts and covered by hand-computed tests in
``test_mrope_hand.py``:

1. Qwen2-VL / Qwen2.5-VL videos (5.x resumes text at ``s + max(H', W')``):
   the main test uses prompts without videos; a second test adds videos whose
   temporal extent stays within their spatial extent, where both rules agree.
2. Qwen3-Omni videos with a fractional ``seconds * position_id_per_seconds``:
   only integral steps here.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from hf_oracle import FAMILIES, hf_positions  # noqa: E402
from mmadmit import mrope, planner, rules  # noqa: E402
from mmadmit.profile import load_profile  # noqa: E402
from prompt_gen import Prompt, gen_prompt  # noqa: E402

N_PROMPTS = 200


def _compare(prompt: Prompt) -> None:
    profile = load_profile(prompt.family)
    plan = rules.plan_runs(profile, prompt.items)
    pos, delta = planner.positions(len(prompt.input_ids), plan)
    want_pos, want_delta = hf_positions(prompt.family, prompt.input_ids, **prompt.hf)
    assert pos.dtype == np.int64 and pos.shape == (3, len(prompt.input_ids))
    if not np.array_equal(pos, want_pos) or delta != want_delta:
        diff = np.nonzero((pos != want_pos).any(axis=0))[0]
        first = int(diff[0]) if len(diff) else None
        window = slice(max(0, (first or 0) - 3), (first or 0) + 4)
        pytest.fail(
            f"mmadmit != transformers for {prompt.describe()}\n"
            f"delta mmadmit={delta} transformers={want_delta}; first differing token {first}\n"
            f"ids[{window.start}:{window.stop}]={prompt.input_ids[window].tolist()}\n"
            f"mmadmit={pos[:, window].tolist()}\ntransformers={want_pos[:, window].tolist()}"
        )
    # The decode exemption's delta-only path must agree too.
    assert mrope.delta_only(len(prompt.input_ids), plan) == want_delta


def _run(family: str, seeds: range, **gen_kwargs: object) -> dict[str, int]:
    seen = {"images": 0, "videos": 0, "audios": 0, "tokens": 0}
    for seed in seeds:
        prompt = gen_prompt(family, seed, **gen_kwargs)  # type: ignore[arg-type]
        _compare(prompt)
        seen["images"] += prompt.n_images
        seen["videos"] += prompt.n_videos
        seen["audios"] += prompt.n_audios
        seen["tokens"] += len(prompt.input_ids)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers(family: str) -> None:
    """200 random prompts per family; Qwen2/2.5-VL without videos (deviation 1)."""
    no_video = family in ("qwen2_vl", "qwen2_5_vl")
    seen = _run(family, range(N_PROMPTS), videos=not no_video, hf_compatible=True)
    # The generator must actually have produced the media this test claims to cover.
    assert seen["images"] > N_PROMPTS
    if not no_video:
        assert seen["videos"] > N_PROMPTS // 2
    if family == "qwen3_omni_moe":
        assert seen["audios"] > N_PROMPTS // 2


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_qwen2_videos_within_spatial_extent_match_transformers(family: str) -> None:
    """Qwen2/2.5-VL videos whose largest temporal index does not exceed ``max(H', W') - 1``:
    there 5.x's ``s + max(H', W')`` equals the spec's largest position + 1, so the
    two must agree (this checks the temporal index itself against 5.x)."""
    seen = _run(family, range(1000, 1000 + N_PROMPTS), videos=True, hf_compatible=True)
    assert seen["videos"] > N_PROMPTS // 2


def test_text_only_prompt_matches_transformers() -> None:
    ids = np.arange(17, dtype=np.int64) * 7
    for family in FAMILIES:
        pos, delta = planner.positions(len(ids), rules.plan_runs(load_profile(family), []))
        want_pos, want_delta = hf_positions(family, ids)
        np.testing.assert_array_equal(pos, want_pos)
        assert delta == want_delta == 0
