"""Content hashes and pad values (MATERIALIZE.md rule 6). Always on the CPU.

``hashlib.blake2b`` reads the feature through the buffer protocol: no copy of
the feature is made, and CPython releases the GIL while hashing buffers larger
than 2 KiB, so worker threads hash in parallel.
"""

from __future__ import annotations

import hashlib

from .model import Modality

PAD_BASE = 1_000_000
PAD_SLOTS = (2**31 - 1 - PAD_BASE + 1) // 3  # 715_494_549
UINT64_MAX = 2**64 - 1


def feature_hash(data: memoryview | bytes) -> int:
    """BLAKE2b, 8-byte digest, over the raw bytes, read as a big-endian unsigned int."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def pad_value(modality: Modality, content_hash: int) -> int:
    return PAD_BASE + modality.pad_tag * PAD_SLOTS + content_hash % PAD_SLOTS


def pad_interval(modality: Modality) -> tuple[int, int]:
    """Inclusive interval of the pad values of a modality."""
    lo = PAD_BASE + modality.pad_tag * PAD_SLOTS
    return lo, lo + PAD_SLOTS - 1
