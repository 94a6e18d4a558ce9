"""The internal request model: what every transport decodes into and encodes from.

It is transport-free. Arrays are numpy; tensors are raw little-endian,
C-contiguous bytes (``memoryview``) plus a dtype and a shape, usually a view on
the buffer the transport received (never copied by a codec). The ``extra``
slots belong to the codec that built the object (for the msgpack wire: the raw
bytes of fields mmadmit passes through untouched); the materializer never reads
them and carries them over unchanged.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .dtypes import DType, parse_dtype
from .errors import InvalidRequest


class Modality(enum.IntEnum):
    """Modality, numbered as on the msgpack wire (the gRPC enum differs)."""

    IMAGE = 1
    VIDEO = 2
    AUDIO = 3

    @property
    def pad_tag(self) -> int:
        """The interval tag of MATERIALIZE.md rule 6: image 0, video 1, audio 2."""
        return int(self) - 1


# Lookup without the cost of an Enum call on hot paths (None for unknown values).
MODALITY_OF: dict[int, Modality] = {int(m): m for m in Modality}


class TensorName(NamedTuple):
    """A tensor's name in an error message (``item 3 feature``, ``mrope_positions``),
    formatted only when a message is: the checks run on every request."""

    item: int | None
    key: str

    def __str__(self) -> str:
        return self.key if self.item is None else f"item {self.item} {self.key}"


@dataclass(eq=False)
class Tensor:
    """Raw tensor bytes with a dtype and a shape.

    ``data`` is a flat byte ``memoryview``. Whoever built the tensor keeps the
    underlying buffer alive through it (a received ZMQ frame, a protobuf
    ``bytes`` value, or a numpy array the materializer made).
    """

    dtype: DType
    shape: tuple[int, ...]
    data: memoryview

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    @property
    def expected_nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @classmethod
    def from_numpy(cls, arr: np.ndarray) -> Tensor:
        """Wrap a numpy array (made C-contiguous little-endian) without copying when it is."""
        arr = np.ascontiguousarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        dtype = parse_dtype(arr.dtype.str if arr.dtype.kind != "b" else "bool")
        return cls(dtype, tuple(int(d) for d in arr.shape), arr.data.cast("B"))

    @classmethod
    def of_int64(cls, arr: np.ndarray) -> Tensor:
        """:meth:`from_numpy` for the int64 arrays the materializer makes, minus its checks."""
        if arr.dtype != np.int64 or not arr.flags.c_contiguous:
            return cls.from_numpy(arr)
        return cls(_INT64, arr.shape, arr.data.cast("B"))

    def to_numpy(self) -> np.ndarray:
        """A read-only numpy view of the bytes (raises for dtypes numpy lacks)."""
        if self.dtype.numpy is None:
            raise TypeError(f"dtype {self.dtype.name} has no numpy equivalent")
        arr = np.frombuffer(self.data, dtype=self.dtype.numpy)
        return arr.reshape(self.shape)


_INT64 = parse_dtype("int64")


SHM_NAME_MAX = 255  # NAME_MAX of the shm filesystems


def check_shm_name(name: str, what: str) -> None:
    """A request's shared-memory name must be a plain name, never a path.

    The service only passes the handle on; the check keeps whoever opens it
    downstream from being pointed outside the shm filesystem. Both transports'
    decoders call it. Raises :class:`~mmadmit.errors.InvalidRequest`.
    """
    if not name:
        raise InvalidRequest(f"{what}: shared-memory name is empty")
    if len(name) > SHM_NAME_MAX:
        raise InvalidRequest(f"{what}: shared-memory name is longer than {SHM_NAME_MAX} characters")
    if "/" in name or "\\" in name or ".." in name or "\x00" in name:
        raise InvalidRequest(
            f"{what}: shared-memory name {name!r} must be a plain name (no '/', '\\', '..' or NUL)"
        )


@dataclass(eq=False)
class ShmHandle:
    """A shared-memory feature handle, passed on as a handle (never opened here)."""

    name: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    offset: int = 0
    nbytes: int | None = None
    owner_id: str | None = None
    extra: Any = None


@dataclass(eq=False)
class Item:
    """One multimodal item. ``modality`` is kept as received (an int) so that an
    unknown value reaches validation and is reported, not lost in decoding."""

    modality: int
    hash: int | None = None
    pad_value: int | None = None
    offsets: np.ndarray | None = None  # [k, 2] int64, inclusive [start, end] rows
    feature: Tensor | None = None
    feature_shm: ShmHandle | None = None
    side: dict[str, Tensor] = field(default_factory=dict)  # model-specific tensors
    extra: Any = None

    def with_pad(self, content_hash: int | None, pad_value: int) -> Item:
        """A copy with ``hash`` and ``pad_value`` set (cheaper than dataclasses.replace)."""
        return Item(
            self.modality,
            content_hash,
            pad_value,
            self.offsets,
            self.feature,
            self.feature_shm,
            self.side,
            self.extra,
        )


@dataclass(eq=False)
class MultimodalInputs:
    items: list[Item] = field(default_factory=list)
    im_token_id: int | None = None
    video_token_id: int | None = None
    mrope_positions: Tensor | None = None  # [3, N] integer
    mrope_position_delta: Tensor | None = None  # [1, 1] integer
    mrope_position_delta_scalar: int | None = None
    extra: Any = None


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: np.ndarray  # int64 [N]
    input_ids_unpadded: np.ndarray | None = None
    mm: MultimodalInputs | None = None
    validation_error: str | None = None
    extra: Any = None


class Rule(enum.Enum):
    """Which rule of MATERIALIZE.md produced a materialized outcome."""

    TEXT = "text"
    DECODE_EXEMPT = "decode_exempt"
    UPSTREAM = "upstream"
    NORMAL = "normal"


@dataclass(eq=False)
class Materialized:
    """A successful outcome: the request with its derived fields set."""

    request: Request
    rule: Rule

    @property
    def passthrough(self) -> bool:
        """True when taken as already materialized upstream (gRPC ``passthrough``)."""
        return self.rule is Rule.UPSTREAM
