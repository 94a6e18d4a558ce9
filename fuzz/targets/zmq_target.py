"""The whole ZMQ path: decode a captured message, materialize, encode the reply.

The input is a frames container (``mmadmit_client.frames``: ``[type, payload, *aux]``),
what ``mmadmit materialize`` replays. It runs three ways: native code on,
native code off (the Python fallbacks), and native on with the reply's
shortcuts off (no received item spliced, ``tests/wire_oracle.encode_items``
instead, and no token array re-emitted from its received bytes: everything
encoded from the decoded model). Native and
fallback must send the same reply bytes (or the same abort code to the same
rid); the plain encoding must reach the same outcome (the reply bytes may
differ: a received encoding need not be canonical). No outcome may be
``INTERNAL``. Half the inputs run under tight limits (:data:`TIGHT`), so that
every codec limit's breach is reached and decided alike.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
from mmadmit import wire
from mmadmit.cli import replay
from mmadmit.errors import Abort, AbortCode
from mmadmit.intcodec import encode_int_array
from mmadmit.limits import DEFAULT_LIMITS, Limits
from mmadmit.materializer import Materializer
from mmadmit.profile import load_profile
from mmadmit_client.frames import MAGIC, parse_frames

from ._common import native_mode
from ._data import Data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from wire_oracle import encode_items  # noqa: E402

NAME = "zmq"
MAX_LEN = 1 << 16
_PROFILES = ("qwen3_5", "qwen3_omni_moe", "llama", "qwen2_5_vl")


# Tight limits for half the inputs (the first byte's top bit), so that breaches of
# every codec limit are reached often, and decided the same way native and not.
TIGHT = Limits(
    max_tokens=1 << 14, max_items=4, max_tensor_bytes=1 << 22, max_tensor_rank=3,
    max_tensor_dim=1 << 12, max_msgpack_depth=8, max_msgpack_len=64, max_abort_ids=16,
)  # fmt: skip


@functools.cache
def _materializer(name: str, tight: bool = False) -> Materializer:
    return Materializer(load_profile(name), TIGHT if tight else DEFAULT_LIMITS)


@contextlib.contextmanager
def _mode(name: str) -> Iterator[None]:
    saved = wire._encode_items, wire._int_array
    try:
        if name == "encoded":
            wire._encode_items = encode_items  # type: ignore[assignment]
            wire._int_array = lambda extra, values, padding=None: msgspec.Raw(
                encode_int_array(values)
            )
        with native_mode(name != "fallback"):
            yield
    finally:
        wire._encode_items, wire._int_array = saved  # type: ignore[method-assign]


def _run(m: Materializer, frames: list[Any], mode: str) -> tuple[list[bytes], Abort | None]:
    with _mode(mode):
        reply, abort = replay(m, frames)
    assert abort is None or abort.code is not AbortCode.INTERNAL, (
        f"{mode}: INTERNAL outcome: {abort.message}"
    )
    return [bytes(memoryview(f).cast("B")) for f in reply], abort


def _meaning(reply: list[bytes]) -> Any:
    """What a reply says, independent of how each element was encoded."""
    try:
        req = wire.decode_request(reply[1], reply[2:])
    except wire.WireError as exc:  # pragma: no cover - replies always decode
        raise AssertionError(f"a reply does not decode: {exc}") from exc
    mm = req.mm
    items = None if mm is None else [(it.modality, it.hash, it.pad_value) for it in mm.items]
    pos = None if mm is None or mm.mrope_positions is None else bytes(mm.mrope_positions.data)
    return (
        reply[0],
        req.rid,
        req.input_ids.tolist(),
        None if req.input_ids_unpadded is None else req.input_ids_unpadded.tolist(),
        items,
        pos,
        None if mm is None else mm.mrope_position_delta_scalar,
    )


def frames_of(blob: bytes) -> list[bytes]:
    """The frames of a container, read leniently so that most mutations still give frames:
    a bad count or length is clamped to what is there, trailing bytes are one more frame."""
    try:
        return [bytes(f) for f in parse_frames(blob)]
    except ValueError:
        pass
    view = blob[len(MAGIC) :] if blob.startswith(MAGIC) else blob
    count = min(int.from_bytes(view[:4], "little"), 8)
    pos = 4 + 8 * count
    frames = []
    for k in range(count):
        length = int.from_bytes(view[4 + 8 * k : 12 + 8 * k], "little")
        frames.append(view[pos : pos + length])
        pos += min(length, max(0, len(view) - pos))
    if pos < len(view):
        frames.append(view[pos:])
    return frames


def one(data: bytes) -> None:
    if len(data) < 1:
        return
    profile = _PROFILES[data[0] % len(_PROFILES)]
    frames = frames_of(data[1:])
    if len(frames) < 2:
        return
    m = _materializer(profile, bool(data[0] & 0x80))
    a, abort_a = _run(m, frames, "native")
    b, abort_b = _run(m, frames, "fallback")
    code_a = None if abort_a is None else abort_a.code
    code_b = None if abort_b is None else abort_b.code
    assert code_a == code_b, f"native {abort_a} != fallback {abort_b}"
    if abort_a is None:
        assert a == b, "native and fallback replies differ"
    else:
        assert a[0] == b[0] and _rid(a) == _rid(b), "abort replies differ in status or rid"
    c, abort_c = _run(m, frames, "encoded")
    code_c = None if abort_c is None else abort_c.code
    assert code_a == code_c, f"spliced reply {abort_a} != encoded reply {abort_c}"
    if abort_a is None:
        assert _meaning(a) == _meaning(c), "spliced and encoded replies mean different things"


def _rid(reply: list[bytes]) -> Any:
    return msgspec.msgpack.decode(reply[1])[1]


def seed_input(profile: str, frames: list[Any]) -> bytes:
    """A corpus file for ``frames`` under ``profile`` (the layout :func:`one` reads)."""
    from mmadmit_client.frames import pack_frames

    return bytes([_PROFILES.index(profile)]) + pack_frames(frames)


__all__ = ["NAME", "Data", "one", "seed_input"]
