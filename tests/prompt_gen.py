"""Seeded random prompts per M-RoPE family, as mmadmit items and as transformers inputs.

A prompt is a random sequence of text and media laid out by the family's
convention (docs/spec/MATERIALIZE.md "M-RoPE conventions per family"):

* Qwen2-VL / Qwen2.5-VL: ``<vision_start>`` run ``<vision_end>``; a video row is
  one run holding all its frames.
* Qwen3-VL(-MoE) / Qwen3.5(-MoE): images as above; a video row ``[T, h, w]`` is
  ``T`` runs ``<timestamp text><vision_start>`` run ``<vision_end>``, one span per
  frame, one grid row per video.
* Qwen3-Omni (thinker): image/video runs right after ``<vision_start>`` (one run
  per grid row), audio ``<audio_start>`` run ``<audio_end>``.

Text ids are random ids below every special id of the family. Items may own
several runs (several grid rows), not necessarily adjacent ones, so mmadmit's
sort by span start is exercised; transformers gets its grids in prompt order.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from hf_oracle import checkpoint_config, token_ids
from mmadmit.model import Item, Modality, Tensor

PER_FRAME_VIDEO = {"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}
OMNI = "qwen3_omni_moe"
MERGE = 2


@dataclass
class Prompt:
    family: str
    input_ids: np.ndarray  # [N] int64
    items: list[Item]
    hf: dict[str, Any]  # keyword arguments for hf_oracle.hf_positions
    n_images: int = 0
    n_videos: int = 0
    n_audios: int = 0
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return (
            f"{self.family}: N={len(self.input_ids)} images={self.n_images} "
            f"videos={self.n_videos} audios={self.n_audios} hf={self.hf}"
        )


@dataclass
class _Run:
    """One placeholder run in the prompt, before items are formed."""

    modality: Modality
    start: int
    end: int  # inclusive
    grid: tuple[int, int, int] | None  # the HF grid row (Qwen3 video: the whole [T, h, w] row)
    seconds: float | None = None  # video seconds per grid row
    audio_tokens: int = 0
    video_row: int = -1  # Qwen3 per-frame: which video row the frame belongs to


def text_id_limit(family: str) -> int:
    """Every id below this is plain text (under bos/eos/vision/audio specials)."""
    cfg = checkpoint_config(family)
    specials = [int(v) for k, v in cfg.items() if k.endswith("_token_id") and isinstance(v, int)]
    return min(specials)


def _spatial(rng: np.random.Generator, max_side: int = 8) -> tuple[int, int]:
    """Pre-merge (h, w), both even, merged sides in 1..max_side."""
    h = int(rng.integers(1, max_side + 1)) * MERGE
    w = int(rng.integers(1, max_side + 1)) * MERGE
    return h, w


def gen_prompt(
    family: str,
    seed: int,
    *,
    images: bool = True,
    videos: bool = True,
    audio: bool = True,
    hf_compatible: bool = True,
    max_tokens: int = 3000,
) -> Prompt:
    """A random prompt for ``family``.

    ``hf_compatible`` restricts videos to the cases where the spec follows
    transformers 5.x: Qwen3-Omni videos get seconds with an integral
    ``seconds * position_id_per_seconds``; Qwen2/2.5-VL videos keep their
    temporal extent within their spatial one (5.x resumes text at
    ``s + max(H', W')``, the spec at the run's largest position + 1).
    """
    rng = np.random.default_rng([seed, zlib.crc32(family.encode())])
    ids_cfg = token_ids(family)
    ckpt = checkpoint_config(family)
    limit = text_id_limit(family)
    image_id = ids_cfg["image_token_id"]
    video_id = ids_cfg["video_token_id"]
    vs, ve = ids_cfg["vision_start_token_id"], ids_cfg["vision_end_token_id"]
    omni = family == OMNI
    per_frame = family in PER_FRAME_VIDEO
    audio = audio and omni
    tps = float(ckpt["vision_config"].get("tokens_per_second", 0))

    tokens: list[np.ndarray] = []
    length = 0
    runs: list[_Run] = []
    video_rows: list[tuple[tuple[int, int, int], float | None]] = []  # per HF video row

    def text(lo: int, hi: int) -> None:
        nonlocal length
        n = int(rng.integers(lo, hi + 1))
        if n:
            tokens.append(rng.integers(0, limit, size=n, dtype=np.int64))
            length += n

    def special(tok: int) -> None:
        nonlocal length
        tokens.append(np.array([tok], np.int64))
        length += 1

    def run(tok: int, n: int) -> tuple[int, int]:
        nonlocal length
        start = length
        tokens.append(np.full(n, tok, np.int64))
        length += n
        return start, length - 1

    kinds = ["image"] * images + ["video"] * videos + ["audio"] * audio
    n_media = int(rng.integers(0, 13)) if kinds else 0
    if kinds and rng.random() < 0.97:
        n_media = max(n_media, 1)
    text(0, 12)  # leading text (may be empty: the prompt may open with a media block)
    for _ in range(n_media):
        if length > max_tokens - 450:
            break
        kind = kinds[int(rng.integers(0, len(kinds)))]
        if kind == "image":
            h, w = _spatial(rng, 16 if rng.random() < 0.1 else 8)
            special(vs)
            s, e = run(image_id, h * w // MERGE**2)
            special(ve)
            runs.append(_Run(Modality.IMAGE, s, e, (1, h, w)))
        elif kind == "audio":
            n = int(rng.integers(1, 60))
            special(ids_cfg["audio_start_token_id"])
            s, e = run(ids_cfg["audio_token_id"], n)
            special(ids_cfg["audio_end_token_id"])
            runs.append(_Run(Modality.AUDIO, s, e, None, audio_tokens=n))
        else:
            h, w = _spatial(rng, 6)
            t = int(rng.integers(1, 7))
            seconds: float | None = None
            if family == "qwen2_5_vl":
                seconds = float(rng.choice([0.5, 1.0, 1.5, 2.0, 0.25]))
            elif omni:
                seconds = float(
                    rng.choice(
                        [1.0, 2.0, 3.0, 0.0] if hf_compatible else [0.5, 1.0, 2.0, 0.3, 1 / 13]
                    )
                )
            if hf_compatible and family in ("qwen2_vl", "qwen2_5_vl"):
                spatial = max(h, w) // MERGE - 1
                step = 1.0 if family == "qwen2_vl" else float(seconds or 0.0) * tps
                while t > 1 and int((t - 1) * step) > spatial:
                    t -= 1
            video_rows.append(((t, h, w), seconds))
            row = len(video_rows) - 1
            if per_frame:
                for _frame in range(t):
                    text(1, 5)  # the "<x.x seconds>" timestamp text
                    special(vs)
                    s, e = run(video_id, h * w // MERGE**2)
                    special(ve)
                    runs.append(_Run(Modality.VIDEO, s, e, (t, h, w), seconds, video_row=row))
            else:
                special(vs)
                s, e = run(video_id, t * h * w // MERGE**2)
                special(ve)
                runs.append(_Run(Modality.VIDEO, s, e, (t, h, w), seconds, video_row=row))
        text(0, 20)
    if length == 0:
        text(1, 12)  # never an empty prompt
    input_ids = np.concatenate(tokens)

    # ---- transformers inputs (prompt order) ----
    hf: dict[str, Any] = {}
    image_rows = [r.grid for r in runs if r.modality is Modality.IMAGE]
    if image_rows:
        hf["image_grid_thw"] = np.array(image_rows, np.int64)
    if video_rows:
        hf["video_grid_thw"] = np.array([g for g, _ in video_rows], np.int64)
        if family == "qwen2_5_vl":
            hf["second_per_grid_ts"] = np.array([s for _, s in video_rows], np.float32)
        elif omni:
            hf["video_second_per_grid"] = np.array([s for _, s in video_rows], np.float32)
    audio_runs = [r for r in runs if r.modality is Modality.AUDIO]
    if audio_runs:
        hf["audio_lengths"] = [r.audio_tokens for r in audio_runs]

    # ---- mmadmit items: group the runs (per modality) into items ----
    items = _make_items(rng, family, runs, video_rows)
    return Prompt(
        family=family,
        input_ids=input_ids,
        items=items,
        hf=hf,
        n_images=len(image_rows),
        n_videos=len(video_rows),
        n_audios=len(audio_runs),
    )


def _make_items(
    rng: np.random.Generator,
    family: str,
    runs: list[_Run],
    video_rows: list[tuple[tuple[int, int, int], float | None]],
) -> list[Item]:
    omni = family == OMNI
    per_frame = family in PER_FRAME_VIDEO
    items: list[Item] = []

    # Units: the smallest groups that must stay in one item. A Qwen3 video row's
    # frames belong together (one grid row, T spans).
    units: dict[Modality, list[list[_Run]]] = {m: [] for m in Modality}
    by_row: dict[int, list[_Run]] = {}
    for r in runs:
        if r.modality is Modality.VIDEO and per_frame:
            if r.video_row not in by_row:
                by_row[r.video_row] = []
                units[Modality.VIDEO].append(by_row[r.video_row])
            by_row[r.video_row].append(r)
        else:
            units[r.modality].append([r])

    for modality, mod_units in units.items():
        if not mod_units:
            continue
        # Usually one unit per item; sometimes an item takes 2-3 units, picked
        # at random (not necessarily adjacent in the prompt).
        order = list(range(len(mod_units)))
        rng.shuffle(order)
        groups: list[list[int]] = []
        i = 0
        while i < len(order):
            single = modality is Modality.AUDIO or rng.random() < 0.7
            size = 1 if single else int(rng.integers(2, 4))
            groups.append(sorted(order[i : i + size]))
            i += size
        for group in groups:
            unit_runs = [mod_units[u] for u in group]
            spans = np.array([[r.start, r.end] for u in unit_runs for r in u], np.int64)
            side: dict[str, Tensor] = {}
            if modality is Modality.IMAGE:
                side["image_grid_thw"] = Tensor.from_numpy(
                    np.array([u[0].grid for u in unit_runs], np.int64)
                )
            elif modality is Modality.VIDEO:
                side["video_grid_thw"] = Tensor.from_numpy(
                    np.array([u[0].grid for u in unit_runs], np.int64)
                )
                seconds = [u[0].seconds for u in unit_runs]
                if family == "qwen2_5_vl" or omni:
                    _timing(rng, family, side, seconds)
            items.append(Item(modality=int(modality), offsets=spans, side=side))
    order_items = list(range(len(items)))
    rng.shuffle(order_items)  # item order is free: mmadmit sorts runs by start
    return [items[i] for i in order_items]


def _timing(
    rng: np.random.Generator, family: str, side: dict[str, Tensor], seconds: list[float | None]
) -> None:
    """Attach a timing side tensor as the spec allows (per row, one broadcast value,
    the other family's key, or absent when the value is the family default)."""
    assert all(s is not None for s in seconds)
    values = np.array(seconds, np.float32)
    default = 1.0 if family == "qwen2_5_vl" else 2.0  # Omni: seconds_per_chunk
    primary = "second_per_grid_ts" if family == "qwen2_5_vl" else "video_second_per_grid"
    secondary = "video_second_per_grid" if family == "qwen2_5_vl" else "second_per_grid_ts"
    if (values == default).all() and rng.random() < 0.4:
        return  # absent: the default applies
    key = primary if rng.random() < 0.8 else secondary
    if (values == values[0]).all() and rng.random() < 0.5:
        values = values[:1]  # one value applied to every row
    side[key] = Tensor.from_numpy(values)
