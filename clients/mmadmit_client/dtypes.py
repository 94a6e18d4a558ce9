"""Tensor dtype names of both wires (docs/spec/WIRE.md, docs/spec/GRPC.md), owned by the client.

The wires name dtypes as torch does without the ``torch.`` prefix
(``"float32"``, ``"bfloat16"``); a numpy type string (``"<f4"``) is also legal
on the msgpack wire. :data:`DTYPES` is the one table of the names, their item
sizes and numpy equivalents (None where numpy has none: bfloat16, float8),
and :func:`canonical_dtype` the one resolver; the service builds its own
``DType`` objects from both (``mmadmit.dtypes``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np


class DTypeSpec(NamedTuple):
    itemsize: int
    numpy_code: str | None  # little-endian numpy type string; None: numpy has no such type
    kind: str  # "f" float, "i" signed, "u" unsigned, "b" bool


DTYPES: dict[str, DTypeSpec] = {
    "float64": DTypeSpec(8, "<f8", "f"),
    "float32": DTypeSpec(4, "<f4", "f"),
    "float16": DTypeSpec(2, "<f2", "f"),
    "bfloat16": DTypeSpec(2, None, "f"),
    "float8_e4m3fn": DTypeSpec(1, None, "f"),
    "float8_e5m2": DTypeSpec(1, None, "f"),
    "int64": DTypeSpec(8, "<i8", "i"),
    "int32": DTypeSpec(4, "<i4", "i"),
    "int16": DTypeSpec(2, "<i2", "i"),
    "int8": DTypeSpec(1, "|i1", "i"),
    "uint64": DTypeSpec(8, "<u8", "u"),
    "uint32": DTypeSpec(4, "<u4", "u"),
    "uint16": DTypeSpec(2, "<u2", "u"),
    "uint8": DTypeSpec(1, "|u1", "u"),
    "bool": DTypeSpec(1, "|b1", "b"),
}

# torch spellings that are aliases of a canonical name
ALIASES = {
    "float": "float32",
    "double": "float64",
    "half": "float16",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}

_NAME_OF_NUMPY = {
    np.dtype(spec.numpy_code): name for name, spec in DTYPES.items() if spec.numpy_code
}
# Only this shape reaches numpy: np.dtype() parses far more (comma lists, subarray
# shapes through ast.literal_eval) and raised SyntaxError on ",loat16" from the wire
# (found by fuzzing the service, RELIABILITY.md).
_TYPESTR = re.compile(r"[<>|=]?[A-Za-z?][0-9]{0,2}")


def canonical_dtype(name: object) -> str | None:
    """The canonical name of a wire dtype string (``"torch.float"`` -> ``"float32"``,
    ``"<f4"`` -> ``"float32"``); None when it names no supported dtype. A numpy
    type string must be little-endian or byte-order free."""
    if not isinstance(name, str) or not name:
        return None
    key = name.removeprefix("torch.")
    key = ALIASES.get(key, key)
    if key in DTYPES:
        return key
    if not _TYPESTR.fullmatch(key):
        return None
    try:
        npd = np.dtype(key)
    except (TypeError, ValueError):
        return None
    if npd.kind not in "fiub" or npd.byteorder not in "<|=" or not npd.isnative:
        return None
    return _NAME_OF_NUMPY.get(npd.newbyteorder("<") if npd.byteorder == "=" else npd)


def numpy_dtype(name: str) -> np.dtype | None:
    """The little-endian numpy dtype of a canonical name (None: numpy has no such type)."""
    code = DTYPES[name].numpy_code
    return None if code is None else np.dtype(code)


def dtype_of_array(arr: np.ndarray) -> str:
    """The wire name of a numpy array's dtype; ``ValueError`` when it has none."""
    if arr.dtype.name == "bfloat16":  # ml_dtypes / torch-style numpy extension
        return "bfloat16"
    name = _NAME_OF_NUMPY.get(
        arr.dtype.newbyteorder("<") if arr.dtype.byteorder != "|" else arr.dtype
    )
    if name is None:
        raise ValueError(f"numpy dtype {arr.dtype} has no wire name; pass dtype= explicitly")
    return name
