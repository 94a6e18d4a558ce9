"""Content hashes (docs/spec/MATERIALIZE.md rule 6; the pad values are
:mod:`mmadmit.rules`'). Always on the CPU.

``hashlib.blake2b`` reads the feature through the buffer protocol: no copy of
the feature is made, and CPython releases the GIL while hashing buffers larger
than 2 KiB, so threads hash in parallel (:class:`mmadmit.pool.MaterializerPool`
spreads the items of one request over its idle workers).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence

# Hashes a request's feature buffers, in order (the materializer's default hashes
# them one after another on the calling thread).
HashMany = Callable[[Sequence[memoryview]], list[int]]


def feature_hash(data: memoryview | bytes) -> int:
    """BLAKE2b, 8-byte digest, over the raw bytes, read as a big-endian unsigned int."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def feature_hashes(buffers: Sequence[memoryview]) -> list[int]:
    """:func:`feature_hash` of each buffer, one after another on this thread."""
    return [feature_hash(b) for b in buffers]


def measure_ns_per_byte(nbytes: int = 1 << 19, runs: int = 5) -> float:
    """BLAKE2b's time per byte on this machine, in ns: the median of ``runs`` timed
    hashes of one ``nbytes`` buffer (its speed does not depend on the bytes). The
    median, not the fastest run: a start-up that shares the machine measures the
    rate requests will see, not the best case."""
    buf = memoryview(bytearray(nbytes))
    feature_hash(buf)  # first touch of the buffer's pages, not timed
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        feature_hash(buf)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e9 / nbytes
