"""A tiny FuzzedDataProvider: typed values consumed from the front of the input.

atheris has one, but the test suite runs the targets without atheris; this
one is deterministic, never raises, and reads zeros once the input is spent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

# Values that sit on boundaries the C code checks (sizes, int64, uint64, float32).
INTERESTING_INTS = (
    0, 1, 2, 3, 7, 8, 15, 16, 31, 127, 128, 255, 256, 65535, 65536,
    2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53, 2**61, 2**61 + 1,
    2**62, 2**63 - 1, 2**63, 2**64 - 1, -1, -2, -(2**31), -(2**63),
)  # fmt: skip


class Data:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = bytes(buf)
        self.pos = 0

    @property
    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int) -> bytes:
        n = max(0, min(n, self.left))
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self) -> int:
        b = self.take(1)
        return b[0] if b else 0

    def uint(self, nbytes: int) -> int:
        return int.from_bytes(self.take(nbytes).ljust(nbytes, b"\0"), "little")

    def int_in(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]`` (inclusive)."""
        span = hi - lo + 1
        if span <= 1:
            return lo
        nbytes = (span.bit_length() + 7) // 8
        return lo + self.uint(nbytes) % span

    def flag(self, percent: int = 50) -> bool:
        """True ``percent`` % of the time; False once the input is spent."""
        b = self.take(1)
        return bool(b) and b[0] % 100 < percent

    def pick(self, options: Sequence[T]) -> T:
        return options[self.int_in(0, len(options) - 1)]

    def wild_int(self) -> int:
        """Mostly an interesting boundary value, else any 64-bit pattern (signed or not)."""
        k = self.u8()
        if k < 160:
            return INTERESTING_INTS[k % len(INTERESTING_INTS)]
        v = self.uint(8)
        return v - 2**64 if k & 1 and v >= 2**63 else v

    def rest(self) -> bytes:
        return self.take(self.left)
