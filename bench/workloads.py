"""Synthetic precomputed requests for the benchmarks (seeded, reproducible).

``qwen3_5_request(n)`` / ``qwen3_omni_request(n)`` build an ``n``-token prompt
whose media tokens are 50-85% of it (images, videos with several frames, audio
for Omni), with content hashes supplied, as the internal model. Every item
also carries a feature (32 bytes a media token, or ``feature_bytes`` each), so
``with_hash`` switches between the two cases the benchmarks compare: every
hash supplied (nothing to hash; the feature travels unread) or none (the
service hashes every feature). ``frames_of`` encodes one as a ZMQ ADD message
through the service's own codec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from mmadmit import wire
from mmadmit.model import Item, Modality, MultimodalInputs, Request, Tensor
from mmadmit.profile import ModelProfile, load_profile


def _grid(key: str, t: int, h: int, w: int) -> dict[str, Tensor]:
    return {key: Tensor.from_numpy(np.array([[t, h, w]], np.int64))}


def _feature(rows: int, nbytes: int | None = None) -> Tensor:
    if nbytes is not None:
        return Tensor.from_numpy(np.zeros(nbytes // 2, np.uint16).view(np.float16).reshape(-1, 2))
    return Tensor.from_numpy(np.ones((rows, 2), np.float32))


def build_request(
    profile: ModelProfile,
    n: int,
    *,
    seed: int = 0,
    media_fraction: float = 0.7,
    feature_bytes: int | None = None,
    with_hash: bool = True,
) -> Request:
    """An n-token request for a Qwen3.5 or Qwen3-Omni profile (see module docstring)."""
    rng = np.random.default_rng(seed)
    omni = profile.audio_token_id is not None
    ids = rng.integers(0, 150_000, n).astype(np.int64)
    items: list[Item] = []
    pos = 8
    media_budget = int(n * media_fraction)
    used = 0
    k = 0
    # long prompts carry larger media, as real ones do (and stay under --max-items)
    side_img = 32 if n <= 8192 else 64
    side_vid = 16 if n <= 8192 else 32
    img_tokens = side_img * side_img // 4
    per_frame = side_vid * side_vid // 4

    def item(modality: Modality, spans: list[list[int]], rows: int, side: dict[str, Any]) -> Item:
        return Item(
            int(modality),
            hash=int(rng.integers(0, 2**63)),
            offsets=np.array(spans, np.int64),
            feature=_feature(rows, feature_bytes),
            side=side,
        )

    while used < media_budget:
        kind = k % (3 if omni else 2)
        k += 1
        if kind == 0:  # image side_img x side_img patches
            length = img_tokens
            if pos + length + 16 >= n:
                break
            ids[pos - 1] = profile.vision_start_token_id or 0
            ids[pos : pos + length] = profile.image_token_id
            side = _grid("image_grid_thw", 1, side_img, side_img)
            items.append(item(Modality.IMAGE, [[pos, pos + length - 1]], length * 4, side))
        elif kind == 1:  # video of 4 frames
            frames, per = 4, per_frame
            length = frames * per + (frames * 8 if not omni else 0)
            if pos + length + 16 >= n:
                break
            spans = []
            if omni:
                ids[pos : pos + frames * per] = profile.video_token_id
                spans.append([pos, pos + frames * per - 1])
                length = frames * per
            else:
                p = pos
                for _ in range(frames):
                    ids[p : p + per] = profile.video_token_id
                    spans.append([p, p + per - 1])
                    p += per + 8  # timestamp text + vision_end/start between frame runs
            side = _grid("video_grid_thw", frames, side_vid, side_vid)
            if omni:
                side["video_second_per_grid"] = Tensor.from_numpy(np.array([1.0], np.float32))
            items.append(item(Modality.VIDEO, spans, frames * per * 4, side))
        else:  # audio 100 tokens
            length = 100
            if pos + length + 16 >= n:
                break
            ids[pos : pos + length] = profile.audio_token_id
            items.append(item(Modality.AUDIO, [[pos, pos + length - 1]], length * 4, {}))
        used += length
        pos += length + 8
    if not with_hash:
        for item in items:
            item.hash = None
    mm = MultimodalInputs(
        items=items, im_token_id=profile.image_token_id, video_token_id=profile.video_token_id
    )
    return Request(rid=f"bench-{n}-{seed}", input_ids=ids, mm=mm)


def profile_for(name: str) -> ModelProfile:
    return load_profile(name)


# issue 35's workload: Qwen3-Omni, 32K tokens, 22 items, 17 of them to hash
MIXED_FAMILY, MIXED_TOKENS, MIXED_FRACTION, MIXED_FEATURE_BYTES = (
    "qwen3_omni_moe",
    32768,
    0.48,
    37_888,
)


def mixed_hash_request(
    family: str = MIXED_FAMILY,
    tokens: int = MIXED_TOKENS,
    *,
    media_fraction: float = MIXED_FRACTION,
    feature_bytes: int = MIXED_FEATURE_BYTES,
    all_hashes: bool = False,
) -> Request:
    """A request whose items come partly with their hash, partly without (the
    service hashes those features): :func:`build_request` with every item's feature
    ``feature_bytes`` long, and the hash kept on every fourth item (items 2, 6, 10,
    ...). The defaults are issue 35's request: Qwen3-Omni, 32K tokens, 22 items, 17
    of them to hash (629 KiB of features), 5 with their hash supplied.
    ``all_hashes``: its twin with every hash kept (nothing to hash)."""
    req = build_request(
        profile_for(family),
        tokens,
        media_fraction=media_fraction,
        feature_bytes=feature_bytes,
        with_hash=True,
    )
    assert req.mm is not None
    for i, item in enumerate(req.mm.items):
        if i % 4 != 2 and not all_hashes:
            item.hash = None
    return req


def bytes_to_hash(req: Request) -> list[memoryview]:
    """The feature buffers the service hashes for ``req``: items with no hash and no
    pad value supplied (docs/spec/MATERIALIZE.md rule 6)."""
    items = req.mm.items if req.mm is not None else []
    return [
        memoryview(it.feature.data)
        for it in items
        if it.hash is None and it.pad_value is None and it.feature is not None
    ]


def frames_of(req: Request) -> list[Any]:
    return [bytes([wire.MSG_ADD]), *wire.encode_request(req)]


def staged(family: str, tokens: int) -> tuple[Any, Any, list[Any]]:
    """What an in-process bench of a request's stages needs: the profile's limits
    and ``Materializer`` (as ``mmadmit serve`` builds them, on the CPU) and the
    ADD frames of ``build_request(..., tokens, with_hash=True)``."""
    from mmadmit.config import build_config
    from mmadmit.materializer import Materializer

    config = build_config({"model": family, "device": "cpu"})
    materializer = Materializer(config.load_profile(), config.limits)
    req = build_request(profile_for(family), tokens, with_hash=True)
    return config.limits, materializer, frames_of(req)


def admit_request(req: Request, rid: str | None = None, *, timeout_ms: int = 0) -> Any:
    """The request as the client library sends it over gRPC (an ``AdmitRequest``):
    encoded by the service's codec, decoded and translated by the client's."""
    from mmadmit_client import request_to_proto
    from mmadmit_client.wire import decode_add

    sent = decode_add(frames_of(req))
    rid = sent.request_id if rid is None else rid
    return request_to_proto(dataclasses.replace(sent, request_id=rid, timeout_ms=timeout_ms))


def media_share(req: Request) -> float:
    assert req.mm is not None
    total = sum(
        int((it.offsets[:, 1] - it.offsets[:, 0] + 1).sum())
        for it in req.mm.items
        if it.offsets is not None
    )
    return total / len(req.input_ids)


def generate_request(
    req: Request,
    rid: str,
    *,
    hashes: dict[int, int] | None = None,
    placeholders: dict[int, int] | None = None,
    stream: bool = False,
) -> Any:
    """``req`` as SMG sends it over gRPC (``tokenspeed.grpc.scheduler.GenerateRequest``):
    the placeholder runs in ``input_ids`` (the unpadded ids when ``req`` has them),
    each item's feature, side tensors and placeholder ranges, no positions and no
    pad values. ``hashes`` (item index -> hash; default: each item's own hash, if
    any) become ``content_hash`` as 8 little-endian bytes; ``placeholders`` (item
    index -> token) its ``placeholder_token_id``."""
    from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
    from smg_grpc_proto.generated import common_pb2

    modality_of = {
        int(Modality.IMAGE): common_pb2.IMAGE,
        int(Modality.VIDEO): common_pb2.VIDEO,
        int(Modality.AUDIO): common_pb2.AUDIO,
    }

    def tensor(t: Tensor) -> Any:
        return ts.TensorData(shape=list(t.shape), dtype=t.dtype.name, inline=bytes(t.data))

    msg = ts.GenerateRequest(request_id=rid, stream=stream)
    ids = req.input_ids_unpadded if req.input_ids_unpadded is not None else req.input_ids
    msg.tokenized.input_ids.extend(ids.tolist())
    msg.sampling_params.temperature = 0.5
    msg.sampling_params.max_new_tokens = 16
    for i, item in enumerate(req.mm.items if req.mm is not None else []):
        out = msg.mm_inputs.items.add(modality=modality_of[item.modality])
        if item.feature is not None:
            out.encoder_input.CopyFrom(tensor(item.feature))
        for key, value in item.side.items():
            out.model_specific_tensors[key].CopyFrom(tensor(value))
        assert item.offsets is not None
        for start, end in item.offsets.tolist():
            out.placeholders.add(offset=start, length=end - start + 1)
        content_hash = item.hash if hashes is None else hashes.get(i)
        if content_hash is not None:
            out.content_hash = content_hash.to_bytes(8, "little")
        if placeholders is not None and i in placeholders:
            out.placeholder_token_id = placeholders[i]
    return msg
