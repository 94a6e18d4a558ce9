"""Tensor dtype names shared by both wires.

The msgpack wire names dtypes the way torch does without the ``torch.`` prefix
(``"float32"``, ``"bfloat16"``); a numpy type string (``"<f4"``) is also legal.
The gRPC ``TensorData.dtype`` uses the same torch-style names. Internally a
dtype is its canonical torch-style name plus an item size and, where numpy has
an equivalent, a numpy dtype (bfloat16 and the float8 types are carried as raw
bytes of the right item size: nothing here reinterprets them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from .errors import InvalidRequest


@dataclass(frozen=True)
class DType:
    name: str  # canonical torch-style name
    itemsize: int
    numpy: np.dtype | None  # None where numpy has no such type (bfloat16, float8)
    is_integer: bool
    is_float: bool


def _d(name: str, itemsize: int, np_name: str | None, kind: str) -> DType:
    return DType(
        name=name,
        itemsize=itemsize,
        numpy=np.dtype(np_name).newbyteorder("<") if np_name else None,
        is_integer=kind in "iu",
        is_float=kind == "f",
    )


_CANONICAL: dict[str, DType] = {
    d.name: d
    for d in (
        _d("float64", 8, "f8", "f"),
        _d("float32", 4, "f4", "f"),
        _d("float16", 2, "f2", "f"),
        _d("bfloat16", 2, None, "f"),
        _d("float8_e4m3fn", 1, None, "f"),
        _d("float8_e5m2", 1, None, "f"),
        _d("int64", 8, "i8", "i"),
        _d("int32", 4, "i4", "i"),
        _d("int16", 2, "i2", "i"),
        _d("int8", 1, "i1", "i"),
        _d("uint64", 8, "u8", "u"),
        _d("uint32", 4, "u4", "u"),
        _d("uint16", 2, "u2", "u"),
        _d("uint8", 1, "u1", "u"),
        _d("bool", 1, "?", "b"),
    )
}

# torch spellings that are aliases of a canonical name
_ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}


_TYPESTR = re.compile(r"[<>|=]?[A-Za-z?][0-9]{0,2}")


def parse_dtype(name: object) -> DType:
    """Resolve a wire dtype string; raise :class:`InvalidRequest` for anything else."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"tensor dtype must be a non-empty string, got {name!r}")
    key = name.removeprefix("torch.")
    key = _ALIASES.get(key, key)
    found = _CANONICAL.get(key)
    if found is not None:
        return found
    # A numpy type string such as "<f4" or "|u1": little-endian or byte-order free only.
    # Only that shape reaches numpy: np.dtype() parses far more (comma lists, subarray
    # shapes through ast.literal_eval) and raised SyntaxError on ",loat16" from the wire,
    # which escaped as INTERNAL (found by fuzzing, RELIABILITY.md).
    npd = None
    if _TYPESTR.fullmatch(key):
        try:
            npd = np.dtype(key)
        except (TypeError, ValueError):
            npd = None
    if npd is not None and npd.kind in "fiub" and npd.byteorder in "<|=" and npd.isnative:
        for cand in _CANONICAL.values():
            if cand.numpy is not None and cand.numpy == npd:
                return cand
    raise InvalidRequest(f"unsupported tensor dtype {name!r}")
