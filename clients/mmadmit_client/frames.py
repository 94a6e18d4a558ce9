"""The frames container of captured ZMQ messages (tests/data/vectors/README.md).

Layout: the 13 bytes ``TSREFFRAMES1\\n``, a little-endian u32 frame count, one
little-endian u64 length per frame, then the frames back to back. Used by
``mmadmit materialize`` and by the client to replay captured requests.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

MAGIC = b"TSREFFRAMES1\n"


def parse_frames(blob: bytes | memoryview) -> list[memoryview]:
    """Split a container into zero-copy views of its frames; ValueError if malformed."""
    view = memoryview(blob).cast("B")
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("not a frames container (bad magic)")
    pos = len(MAGIC)
    if len(view) < pos + 4:
        raise ValueError("truncated frames container (no frame count)")
    (count,) = struct.unpack_from("<I", view, pos)
    pos += 4
    if len(view) < pos + 8 * count:
        raise ValueError("truncated frames container (frame lengths)")
    lengths = struct.unpack_from(f"<{count}Q", view, pos)
    pos += 8 * count
    frames = []
    for length in lengths:
        if pos + length > len(view):
            raise ValueError("truncated frames container (frame data)")
        frames.append(view[pos : pos + length])
        pos += length
    if pos != len(view):
        raise ValueError("frames container has trailing bytes")
    return frames


def pack_frames(frames: Sequence[Any]) -> bytes:
    views = [memoryview(f).cast("B") if not isinstance(f, bytes) else f for f in frames]
    head = (
        MAGIC
        + struct.pack("<I", len(views))
        + struct.pack(f"<{len(views)}Q", *(len(v) for v in views))
    )
    return head + b"".join(views)
