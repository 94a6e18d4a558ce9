"""The protobuf shortcuts (``_pbwire.c``) against the Python fallback.

First byte even: ``strip_inline_payloads`` on the rest (a would-be
``AdmitRequest``) with a small strip threshold, so short inputs exercise it;
the stripped bytes and payloads must be identical, and when the stripped
message parses, it must parse to the original message once the markers are
resolved. Odd: ``packed_uint32_field`` on an int64 array from the rest (the
same bytes, or the same ``ValueError`` message).
"""

from __future__ import annotations

import numpy as np
from mmadmit import pbwire

from ._common import outcome, same
from ._data import Data

NAME = "pbwire"


def _strip(d: Data) -> None:
    min_bytes = d.int_in(1, 64)
    data = d.rest()
    a = outcome(pbwire._BUILT.strip_inline, data, min_bytes, pbwire._NONCE)
    b = outcome(pbwire._strip_py, data, min_bytes)
    same(a, b, f"strip_inline(min_bytes={min_bytes})")


def _packed(d: Data) -> None:
    field = d.int_in(1, 2**29 - 1)
    near = d.flag(70)
    raw = d.rest()
    values = np.frombuffer(raw[: len(raw) - len(raw) % 8], "<i8")
    if near:  # mostly inside [0, 2**32), some just outside
        values = values % (2**32 + 64) - 32
    a = outcome(pbwire._BUILT.packed_uint32_field, field, values)
    b = outcome(pbwire._packed_uint32_field_py, field, values)
    same(a, b, "packed_uint32_field")


def one(data: bytes) -> None:
    if pbwire._BUILT is None:
        return  # nothing native to compare
    d = Data(data)
    if d.u8() % 2 == 0:
        _strip(d)
    else:
        _packed(d)
