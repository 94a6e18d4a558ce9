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
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from . import native, tensorcheck
from .dtypes import DType, parse_dtype
from .errors import InvalidRequest
from .limits import Limits


class Modality(enum.IntEnum):
    """Modality, numbered as on the msgpack wire (the gRPC enum differs)."""

    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


# Lookup without the cost of an Enum call on hot paths (None for unknown values).
MODALITY_OF: dict[int, Modality] = {int(m): m for m in Modality}


try:
    from . import _tensorcheck_c as _BUILT  # type: ignore[attr-defined]
except ImportError:  # no compiler (or no Cython) at install time: tensorcheck.py interpreted
    _BUILT = None
# the build whose post_init is Tensor.__post_init__ (_route_checks routes it)
_POST: Any = _BUILT if _BUILT is not None else tensorcheck


class Tensor(msgspec.Struct, frozen=True, eq=False, gc=False):
    """Raw tensor bytes with a dtype and a shape, consistent by construction.

    ``data`` is a flat, C-contiguous byte ``memoryview`` of exactly
    ``prod(shape) * dtype.itemsize`` bytes. Whoever built the tensor keeps the
    underlying buffer alive through it (a received ZMQ frame, a protobuf
    ``bytes`` value, or a numpy array the materializer made).

    Everything is checked once, here, when the tensor is built
    (``Tensor(dtype, shape, data, name, limits)``), and a built tensor cannot
    be changed (frozen): ``dtype`` a :class:`~mmadmit.dtypes.DType` or a wire
    dtype name (``unsupported tensor dtype`` otherwise), ``shape`` a list or
    tuple of non-negative ints (kept as a tuple), ``data`` a buffer (kept as a
    byte view, never copied) of the byte length the shape needs
    (:class:`~mmadmit.errors.InvalidRequest`, code INVALID_REQUEST, otherwise).
    With ``limits`` (what a transport passes for a tensor it received) its
    rank, dimensions and bytes are within them (:class:`~mmadmit.errors.TooLarge`,
    worded by :mod:`mmadmit.limits`), decided from the shape before the byte
    length is compared; without, only consistency (the arrays the
    materializer makes). ``name`` names the tensor in every message: a
    string, a :class:`~mmadmit.tensorcheck.TensorName`, or a plain ``(item, key)`` pair (``item 3
    feature``), formatted only when a message is (the hot paths build no name
    object). ``name`` and ``limits`` stay on the tensor: what it was called
    and checked against when built.

    A ``msgspec.Struct`` (frozen, no GC tracking) because it is built for
    every tensor of every request: construction runs in C, the checks in
    ``__post_init__``: :func:`mmadmit.tensorcheck.post_init` itself, compiled
    when built (no Python frame per tensor), which runs
    :func:`mmadmit.tensorcheck.check` (the checks' one source) of the build
    native code selects. Equality is identity (two tensors are never
    compared by their bytes).
    """

    dtype: DType  # a wire dtype name is accepted too, resolved when built
    shape: tuple[int, ...]  # a list is accepted too, kept as a tuple
    data: memoryview  # any C-contiguous buffer is accepted too, kept as a byte view
    name: Any = "tensor"
    limits: Limits | None = None

    # mmadmit.tensorcheck.post_init, compiled when built: msgspec calls it on every new
    # tensor (mypy wants a method; a compiled function held by the class runs no frame)
    __post_init__ = _POST.post_init  # type: ignore[misc]

    def __repr__(self) -> str:
        return f"Tensor({self.dtype.name}, {list(self.shape)}, {self.data.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

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
        """:meth:`from_numpy` for the int64 arrays the materializer makes, minus its dtype work."""
        if arr.dtype != np.int64 or not arr.flags.c_contiguous:
            return cls.from_numpy(arr)
        return cls(_INT64, arr.shape, arr.data.cast("B"))

    def to_numpy(self) -> np.ndarray:
        """A read-only numpy view of the bytes (raises for dtypes numpy lacks)."""
        if self.dtype.numpy is None:
            raise TypeError(f"dtype {self.dtype.name} has no numpy equivalent")
        arr = np.frombuffer(self.data, dtype=self.dtype.numpy)
        return arr.reshape(self.shape)


assert Tensor.__struct_fields__ == tensorcheck.FIELDS, Tensor.__struct_fields__

_check = tensorcheck.check
HAVE_NATIVE = False


def _route_checks(check: Any) -> None:
    """Check every tensor built from now on with ``check`` (one build's
    ``tensorcheck.check``; tests and the fuzz targets pick one). ``Tensor``'s
    ``__post_init__`` is the ``post_init`` of the build it was made with, which
    runs its own check unless it is routed elsewhere."""
    global _check
    _check = check
    _POST.route(None if check is _POST.check else check)


def _use_native(on: bool) -> bool:
    """Tensor checks compiled (when built and ``on``) or interpreted."""
    global HAVE_NATIVE
    HAVE_NATIVE = on and _BUILT is not None
    _route_checks(_BUILT.check if HAVE_NATIVE else tensorcheck.check)
    return HAVE_NATIVE


native.register(__name__, _use_native)


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


class Item(msgspec.Struct, eq=False):
    """One multimodal item. ``modality`` is kept as received (an int) so that an
    unknown value reaches validation and is reported, not lost in decoding.

    A ``msgspec.Struct`` (its constructor, copy and ``msgspec.structs.replace``
    run in C): one is built for every item a codec decodes, and rule 6 makes a
    copy of each item that gets its pad value from a supplied hash."""

    modality: int
    hash: int | None = None
    pad_value: int | None = None
    offsets: np.ndarray | None = None  # [k, 2] int64, inclusive [start, end] rows
    feature: Tensor | None = None
    feature_shm: ShmHandle | None = None
    side: dict[str, Tensor] = msgspec.field(default_factory=dict)  # model-specific tensors
    extra: Any = None
    # EPD: where the item's embedding comes from instead of the encoder, a map with
    # bootstrap_host, bootstrap_port and bootstrap_room (docs/spec/WIRE.md item
    # element 9); carried to the scheduler untouched, never read by the rules.
    encode_handshake: dict[str, Any] | None = None


@dataclass(eq=False)
class MultimodalInputs:
    items: list[Item] = field(default_factory=list)
    im_token_id: int | None = None
    video_token_id: int | None = None
    mrope_positions: Tensor | None = None  # [3, N] integer
    mrope_position_delta: Tensor | None = None  # [1, 1] integer
    mrope_position_delta_scalar: int | None = None
    extra: Any = None


class Padding(msgspec.Struct, frozen=True, eq=False, gc=False):
    """How the materializer made a request's padded ids (rule 6's substitution):
    ``result`` is ``unpadded`` with ``result[starts[k]:stops[k]] = values[k]``
    (spans sorted and disjoint, int64 arrays).

    The materializer sets it on the request it returns, whose ``input_ids``
    is ``result`` and ``input_ids_unpadded`` is ``unpadded``. An encoder may
    then write the padded ids from the spans and the bytes ``unpadded`` was
    decoded from, reading neither array (the msgpack codec does). It says
    how ``result`` was made: it applies while the request's ``input_ids`` is
    still ``result`` (identity says it; whatever ``input_ids_unpadded`` has
    become) and nobody writes into the two arrays (nothing in the service
    does: a change assigns a new array).
    """

    result: np.ndarray
    unpadded: np.ndarray
    starts: np.ndarray
    stops: np.ndarray
    values: np.ndarray


@dataclass(eq=False)
class Request:
    rid: str
    input_ids: np.ndarray  # int64 [N]
    input_ids_unpadded: np.ndarray | None = None
    mm: MultimodalInputs | None = None
    validation_error: str | None = None
    extra: Any = None
    padding: Padding | None = None  # set by the materializer (rule 6), see Padding


class Rule(enum.Enum):
    """Which rule of docs/spec/MATERIALIZE.md produced a materialized outcome."""

    TEXT = "text"
    DECODE_EXEMPT = "decode_exempt"
    UPSTREAM = "upstream"
    NORMAL = "normal"


@dataclass(eq=False)
class Materialized:
    """A successful outcome: the request with its derived fields set; ``hashed_bytes``:
    the feature bytes the materializer hashed for it (items that came with neither a
    hash nor a pad value), for the hashed-bytes counter."""

    request: Request
    rule: Rule
    hashed_bytes: int = 0

    @property
    def passthrough(self) -> bool:
        """True when taken as already materialized upstream (gRPC ``passthrough``)."""
        return self.rule is Rule.UPSTREAM
