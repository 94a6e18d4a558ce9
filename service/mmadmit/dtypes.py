"""Tensor dtype names shared by both wires.

The msgpack wire names dtypes the way torch does without the ``torch.`` prefix
(``"float32"``, ``"bfloat16"``); a numpy type string (``"<f4"``) is also legal.
The gRPC ``TensorData.dtype`` uses the same torch-style names. Internally a
dtype is its canonical torch-style name plus an item size and, where numpy has
an equivalent, a numpy dtype (bfloat16 and the float8 types are carried as raw
bytes of the right item size: nothing here reinterprets them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mmadmit_client.dtypes import DTYPES, canonical_dtype

from .errors import InvalidRequest


@dataclass(frozen=True)
class DType:
    name: str  # canonical torch-style name
    itemsize: int
    numpy: np.dtype | None  # None where numpy has no such type (bfloat16, float8)
    is_integer: bool
    is_float: bool


# The names, sizes and numpy equivalents are the client's table (one copy,
# mmadmit_client.dtypes); here each becomes a DType.
_CANONICAL: dict[str, DType] = {
    name: DType(
        name=name,
        itemsize=spec.itemsize,
        numpy=np.dtype(spec.numpy_code) if spec.numpy_code else None,
        is_integer=spec.kind in "iu",
        is_float=spec.kind == "f",
    )
    for name, spec in DTYPES.items()
}


def parse_dtype(name: object) -> DType:
    """Resolve a wire dtype string; raise :class:`InvalidRequest` for anything else."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"tensor dtype must be a non-empty string, got {name!r}")
    found = canonical_dtype(name)
    if found is not None:
        return _CANONICAL[found]
    raise InvalidRequest(f"unsupported tensor dtype {name!r}")
