"""A small deterministic mutation fuzzer, for where atheris is not installed.

No coverage feedback: seeds from the corpus are mutated (bit flips, boundary
bytes and ints, msgpack/protobuf type bytes, chunk insert/delete/duplicate,
splices of two seeds, truncation), one to eight mutations stacked per input.
A seeded ``random.Random`` makes a run reproducible: the test suite's smoke
run (``tests/test_fuzz_smoke.py``) cannot flake, and a failure names the
seed and iteration that reproduce it.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence

# Bytes that change a msgpack / protobuf parse the most.
_MAGIC_BYTES = (
    0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC2, 0xC3, 0xC4, 0xC7, 0xCA, 0xCB,
    0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD3, 0xD4, 0xD9, 0xDC, 0xDD, 0xDE, 0xDF, 0x90,
    0x9F, 0x8F, 0xE0, 0x0A, 0x12, 0x1A, 0x22, 0x08, 0x10,
)  # fmt: skip
_MAGIC_INTS = (0, 1, 2**7, 2**8 - 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1,
               2**63 - 1, 2**63, 2**64 - 1)  # fmt: skip


def mutate(rng: random.Random, data: bytes, seeds: Sequence[bytes], max_len: int) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        op = rng.randrange(9)
        n = len(buf)
        if op == 0 and n:
            i = rng.randrange(n)
            buf[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            buf[rng.randrange(n)] = rng.choice(_MAGIC_BYTES)
        elif op == 2 and n:
            buf[rng.randrange(n)] = rng.randrange(256)
        elif op == 3:
            width = rng.choice((1, 2, 4, 8))
            value = rng.choice(_MAGIC_INTS) % (1 << (8 * width))
            packed = value.to_bytes(width, rng.choice(("big", "little")))
            i = rng.randint(0, n)
            buf[i : i + width] = packed
        elif op == 4 and n:
            i = rng.randrange(n)
            del buf[i : i + rng.randint(1, min(16, n - i))]
        elif op == 5:
            i = rng.randint(0, n)
            buf[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 6 and n:
            i = rng.randrange(n)
            chunk = buf[i : i + rng.randint(1, 32)]
            j = rng.randint(0, n)
            buf[j:j] = chunk
        elif op == 7 and seeds:
            other = rng.choice(seeds)
            if other:
                i, j = rng.randint(0, n), rng.randrange(len(other))
                buf[i:] = other[j:]
        elif op == 8 and n:
            del buf[rng.randint(0, n - 1) :]
        else:
            buf += struct.pack("<Q", rng.choice(_MAGIC_INTS))
    return bytes(buf[:max_len])


def fuzz(
    one: Callable[[bytes], None],
    seeds: Sequence[bytes],
    *,
    runs: int | None = None,
    seconds: float | None = None,
    seed: int = 0,
    max_len: int = 4096,
    on_failure: Callable[[bytes, int], None] | None = None,
) -> int:
    """Run ``one`` on mutated seeds until ``runs`` inputs or ``seconds`` pass; returns runs.

    The seeds themselves run first. A failing input is passed to ``on_failure``
    (with its iteration) and the exception propagates.
    """
    import time

    rng = random.Random(seed)
    pool = [bytes(s) for s in seeds] or [b""]
    deadline = None if seconds is None else time.monotonic() + seconds
    count = 0
    while True:
        if runs is not None and count >= runs:
            break
        if deadline is not None and count % 16 == 0 and time.monotonic() > deadline:
            break
        if count < len(pool):
            data = pool[count]
        else:
            data = mutate(rng, rng.choice(pool), pool, max_len)
        try:
            one(data)
        except BaseException:
            if on_failure is not None:
                on_failure(data, count)
            raise
        count += 1
    return count
