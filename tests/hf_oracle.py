"""Hugging Face ``transformers`` as the M-RoPE oracle (docs/spec/MATERIALIZE.md, "The model
profile").

For each family this builds the transformers class that owns ``get_rope_index``
from its default config on the ``meta`` device (no weights, no download), with
the token ids and vision geometry of the public checkpoint overridden from
``tests/data/vectors/configs/`` (transformers 5.x defaults differ: Qwen2.5-VL
``tokens_per_second`` is 4 instead of 2, the Qwen3-Omni thinker defaults are
Qwen2.5-Omni's, without ``vision_start_token_id``). Models are built once per
process.

Where ``get_rope_index`` lives in transformers 5.24:

=================  ================================================================
family             owner
=================  ================================================================
qwen2_vl           ``Qwen2VLModel``
qwen2_5_vl         ``Qwen2_5_VLModel``
qwen3_vl           ``Qwen3VLModel``
qwen3_vl_moe       ``Qwen3VLMoeModel``
qwen3_5            ``Qwen3_5Model``
qwen3_5_moe        ``Qwen3_5MoeModel``
qwen3_omni_moe     ``Qwen3OmniMoeThinkerModel`` (inherits it from
                   ``Qwen3OmniMoePreTrainedModelForConditionalGeneration``)
=================  ================================================================

Inputs each one needs:

* Qwen2/2.5/3-VL, Qwen3.5: ``mm_token_type_ids`` (0 text, 1 image, 2 video),
  built here from the placeholder ids exactly as the processors do. Runs are
  found by grouping equal types, so two runs need a text token between them;
  grids are consumed in prompt order, per type. Qwen2.5-VL also takes
  ``second_per_grid_ts`` (one value per video grid row, default 1). Qwen3-VL /
  Qwen3.5 split each video row ``[T, h, w]`` into ``T`` rows ``[1, h, w]``.
* Qwen3-Omni thinker: token ids (``<vision_start>``, ``<audio_start>`` mark the
  runs), ``audio_seqlens`` (mel-frame lengths, mapped to token counts by
  ``_get_feat_extract_output_lengths``), ``second_per_grids`` (one value for
  every video row: required), ``use_audio_in_video=False`` and an attention
  mask (its code indexes ``attention_mask[i]`` unconditionally). It returns
  float positions.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mmadmit.profile import PRESETS, load_profile

# Same location rule as conftest.py: $MMADMIT_VECTORS, else tests/data/vectors.
_VECTORS = Path(
    os.environ.get("MMADMIT_VECTORS") or Path(__file__).resolve().parent / "data" / "vectors"
)
CONFIG_DIR = _VECTORS / "configs"

# The service's built-in profiles with M-RoPE: every one needs an owner below.
FAMILIES: tuple[str, ...] = tuple(p for p in PRESETS if load_profile(p).uses_mrope)

# family -> (config file, transformers config class, class owning get_rope_index)
_CLASSES: dict[str, tuple[str, str, str]] = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLConfig", "Qwen2VLModel"),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLConfig", "Qwen2_5_VLModel"),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLConfig", "Qwen3VLModel"),
    # The MoE checkpoints share the dense ones' special tokens and vision geometry.
    "qwen3_vl_moe": ("qwen3_vl", "Qwen3VLMoeConfig", "Qwen3VLMoeModel"),
    "qwen3_5": ("qwen3_5", "Qwen3_5Config", "Qwen3_5Model"),
    "qwen3_5_moe": ("qwen3_5", "Qwen3_5MoeConfig", "Qwen3_5MoeModel"),
    "qwen3_omni_moe": ("qwen3_omni_moe", "Qwen3OmniMoeThinkerConfig", "Qwen3OmniMoeThinkerModel"),
}

_TOKEN_KEYS = (
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
    "audio_token_id",
    "audio_start_token_id",
    "audio_end_token_id",
)


@functools.cache
def checkpoint_config(family: str) -> dict[str, Any]:
    """The checkpoint's config scope holding the token ids (Omni: ``thinker_config``)."""
    name = _CLASSES[family][0]
    config = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    if family == "qwen3_omni_moe":
        return dict(config["thinker_config"])
    return dict(config)


def token_ids(family: str) -> dict[str, int]:
    """Special token ids of the family's public checkpoint (from the vectors configs)."""
    cfg = checkpoint_config(family)
    return {key: int(cfg[key]) for key in _TOKEN_KEYS if key in cfg}


def _tiny_config(family: str) -> Any:
    import transformers

    ckpt = checkpoint_config(family)
    config_cls = getattr(transformers, _CLASSES[family][1])
    vision_ckpt = ckpt["vision_config"]
    vision: dict[str, Any] = {"spatial_merge_size": int(vision_ckpt["spatial_merge_size"])}
    if family == "qwen2_5_vl":
        # transformers 5.x defaults this to 4; the checkpoints use 2.
        vision["tokens_per_second"] = vision_ckpt["tokens_per_second"]
    kwargs: dict[str, Any] = {"vision_config": vision}
    for key in _TOKEN_KEYS:
        if key in ckpt:
            kwargs[key] = int(ckpt[key])
    if family == "qwen3_omni_moe":
        kwargs["position_id_per_seconds"] = ckpt["position_id_per_seconds"]
        kwargs["audio_config"] = {"n_window": int(ckpt["audio_config"]["n_window"])}
    config = config_cls(**kwargs)
    # The overrides must have landed (a silently ignored kwarg would test the defaults).
    for key in _TOKEN_KEYS:
        if key in ckpt:
            assert getattr(config, key) == ckpt[key], (family, key, getattr(config, key))
    assert config.vision_config.spatial_merge_size == vision["spatial_merge_size"]
    if family == "qwen2_5_vl":
        assert config.vision_config.tokens_per_second == vision["tokens_per_second"]
    if family == "qwen3_omni_moe":
        assert config.position_id_per_seconds == ckpt["position_id_per_seconds"]
        assert config.audio_config.n_window == ckpt["audio_config"]["n_window"]
    return config


@functools.cache
def model(family: str) -> Any:
    """The class owning ``get_rope_index``, built once on the meta device (no weights)."""
    import transformers

    config = _tiny_config(family)
    model_cls = getattr(transformers, _CLASSES[family][2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            built = model_cls(config)
    return built.eval()


# ---------------------------------------------------------------------------
# Qwen3-Omni audio: token count <-> mel-frame length


def omni_audio_tokens(mel_len: int, n_window: int = 50) -> int:
    """Audio placeholder tokens for ``mel_len`` input frames (transformers' own formula)."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    return int(_get_feat_extract_output_lengths(torch.tensor(mel_len), n_window))


@functools.cache
def _mel_len_table(n_window: int, limit: int = 20_000) -> dict[int, int]:
    table: dict[int, int] = {}
    for mel in range(1, limit):
        table.setdefault(omni_audio_tokens(mel, n_window), mel)
    return table


def omni_mel_len(tokens: int, n_window: int = 50) -> int:
    """Smallest mel-frame length whose audio encoder output has ``tokens`` tokens."""
    table = _mel_len_table(n_window)
    if tokens not in table:
        raise ValueError(f"no mel length gives {tokens} audio tokens")
    return table[tokens]


# ---------------------------------------------------------------------------


def _as_grid(grid: Any) -> torch.Tensor | None:
    if grid is None:
        return None
    arr = np.asarray(grid, dtype=np.int64).reshape(-1, 3)
    return torch.from_numpy(arr.copy())


def _seconds_list(values: Any) -> list[float] | None:
    if values is None:
        return None
    return [float(v) for v in np.asarray(values, dtype=np.float32).reshape(-1)]


def hf_rope_index(
    family: str,
    input_ids: Sequence[int] | np.ndarray,
    *,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    video_second_per_grid: Any = None,
    audio_lengths: Sequence[int] | None = None,
    audio_seqlens: Sequence[int] | None = None,
    attention_mask: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call the family's ``get_rope_index`` on one prompt; returns its raw tensors.

    Grids are ``[rows, 3]`` pre-merge, one row per *transformers* video/image,
    in prompt order (for Qwen3-VL / Qwen3.5 a video row ``[T, h, w]`` as the
    processor emits it). Timing: ``second_per_grid_ts`` (Qwen2.5-VL) or
    ``video_second_per_grid`` (Qwen3-Omni ``second_per_grids``), one float per
    video row; either name is accepted for either family. Audio (Omni): either
    ``audio_lengths`` (placeholder tokens per audio run, converted to mel
    lengths) or ``audio_seqlens`` (mel lengths as the feature extractor reports).
    """
    m = model(family)
    ids = torch.as_tensor(np.asarray(input_ids, dtype=np.int64)).reshape(1, -1)
    n = ids.shape[1]
    image = _as_grid(image_grid_thw)
    video = _as_grid(video_grid_thw)
    seconds = _seconds_list(
        second_per_grid_ts if second_per_grid_ts is not None else video_second_per_grid
    )
    mask = None
    if attention_mask is not None:
        mask = torch.as_tensor(np.asarray(attention_mask, dtype=np.int64)).reshape(1, -1)

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "qwen3_omni_moe":
            cfg = m.config
            if audio_seqlens is None and audio_lengths is not None:
                audio_seqlens = [
                    omni_mel_len(int(a), cfg.audio_config.n_window) for a in audio_lengths
                ]
            n_videos = 0 if video is None else video.shape[0]
            if n_videos and (seconds is None or len(seconds) != n_videos):
                raise ValueError("Qwen3-Omni needs one seconds value for every video row")
            if image is None and video is None:
                # Its text-only branch ignores audio (linear anyway); an empty grid keeps
                # the main branch, which walks the audio runs.
                image = torch.zeros((0, 3), dtype=torch.int64)
            if mask is None:
                mask = torch.ones_like(ids)
            pos, delta = m.get_rope_index(
                ids,
                image_grid_thw=image,
                video_grid_thw=video,
                attention_mask=mask,
                use_audio_in_video=False,
                audio_seqlens=(
                    None
                    if audio_seqlens is None
                    else torch.tensor(list(audio_seqlens), dtype=torch.int64)
                ),
                second_per_grids=(
                    None if seconds is None else torch.tensor(seconds, dtype=torch.float32)
                ),
            )
        else:
            cfg = m.config
            types = torch.zeros_like(ids, dtype=torch.int32)
            types[ids == cfg.image_token_id] = 1
            types[ids == cfg.video_token_id] = 2
            kwargs: dict[str, Any] = {}
            if family == "qwen2_5_vl" and seconds is not None:
                kwargs["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
            pos, delta = m.get_rope_index(
                ids,
                types,
                image_grid_thw=image,
                video_grid_thw=video,
                attention_mask=mask,
                **kwargs,
            )
    assert pos.shape == (3, 1, n), pos.shape
    return pos[:, 0, :], delta.reshape(-1)[0]


def hf_positions(
    family: str, input_ids: Sequence[int] | np.ndarray, **inputs: Any
) -> tuple[np.ndarray, int]:
    """transformers' positions as ``([3, N] int64, delta)``; ``inputs`` are the keyword
    arguments of :func:`hf_rope_index` (grids, seconds, audio, attention mask).

    Raises ``ValueError`` when transformers returns a non-integral position
    (Qwen3-Omni with a fractional ``seconds * position_id_per_seconds``: a known
    deviation, see :func:`hf_rope_index` to inspect the raw floats).
    """
    pos, delta = hf_rope_index(family, input_ids, **inputs)
    if pos.is_floating_point():
        as_int = pos.round().to(torch.int64)
        if not torch.equal(as_int.to(pos.dtype), pos):
            raise ValueError(f"{family}: transformers returned fractional positions")
        pos_np = as_int.numpy()
    else:
        pos_np = pos.to(torch.int64).numpy()
    d = float(delta)
    if d != int(d):
        raise ValueError(f"{family}: transformers returned a fractional delta {d}")
    return pos_np.astype(np.int64, copy=True), int(d)
