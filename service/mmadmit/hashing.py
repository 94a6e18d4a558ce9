"""Content hashes (docs/spec/MATERIALIZE.md rule 6; the pad values are
:mod:`mmadmit.rules`'). Always on the CPU.

``hashlib.blake2b`` reads the feature through the buffer protocol: no copy of
the feature is made, and CPython releases the GIL while hashing buffers larger
than 2 KiB, so worker threads hash in parallel.
"""

from __future__ import annotations

import hashlib


def feature_hash(data: memoryview | bytes) -> int:
    """BLAKE2b, 8-byte digest, over the raw bytes, read as a big-endian unsigned int."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
