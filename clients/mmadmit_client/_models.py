"""The client's own request and outcome model, shared by every transport.

One :class:`Request` goes over gRPC or ZMQ alike (the transports encode it:
``_grpc_codec.py`` into an ``AdmitRequest``, :mod:`mmadmit_client.wire` into
the msgpack frames of docs/spec/WIRE.md), and every transport answers with one
:class:`Outcome`: :class:`Materialized` or :class:`Aborted`. An abort is the
server's in-band answer, a value and not an exception (``_exceptions.py``).

Arrays are numpy: token ids int64 ``[N]``, item spans int64 ``[k, 2]``
inclusive ``[start, end]`` rows (the msgpack wire's form; ``Item.placeholders``
gives gRPC's ``(offset, length)``), M-RoPE positions int64 ``[3, N]``. A
tensor is raw little-endian, C-order bytes with a dtype name and a shape
(:class:`Tensor`), so dtypes numpy lacks (bfloat16, float8) travel unchanged.

Values are frozen; derive a changed one with :func:`dataclasses.replace` or
:meth:`Request.with_request_id`. A request decoded from captured frames
(:func:`mmadmit_client.wire.decode_request`) remembers the fields of the
msgpack wire it does not model (sampling parameters and the like) and sends
them again unchanged over ZMQ; gRPC has no such fields.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from .dtypes import DTYPES, canonical_dtype, dtype_of_array, numpy_dtype

ModalityName = Literal["image", "video", "audio"]
MODALITIES: tuple[ModalityName, ...] = ("image", "video", "audio")


@dataclass(frozen=True, eq=False)
class Tensor:
    """Raw tensor bytes (little-endian, C order) with a wire dtype name and a shape."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    def __post_init__(self) -> None:
        name = canonical_dtype(self.dtype)
        if name is None:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}")
        if name != self.dtype:
            object.__setattr__(self, "dtype", name)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        want = math.prod(self.shape) * DTYPES[name].itemsize
        if memoryview(self.data).nbytes != want:
            raise ValueError(
                f"{memoryview(self.data).nbytes} bytes but shape {list(self.shape)} of "
                f"{name} needs {want}"
            )

    @classmethod
    def from_numpy(cls, value: Any, dtype: str | None = None) -> Tensor:
        """An array as a tensor (copied only to make it little-endian and C-contiguous).

        ``dtype`` names the wire dtype when the array's own does not say it,
        e.g. a ``uint16`` array holding ``bfloat16`` bits.
        """
        arr = np.asarray(value)
        if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        if dtype is None:
            name = dtype_of_array(arr)
        else:
            name = canonical_dtype(dtype) or dtype
            size = DTYPES[name].itemsize if name in DTYPES else None
            if size is not None and size != arr.dtype.itemsize:
                raise ValueError(
                    f"dtype {dtype} has {size}-byte items but the array's are {arr.dtype.itemsize}"
                )
        return cls(name, tuple(arr.shape), arr.data.cast("B") if arr.size else b"")

    @property
    def nbytes(self) -> int:
        return memoryview(self.data).nbytes

    def to_numpy(self) -> np.ndarray:
        """A read-only view of the bytes; ``TypeError`` for dtypes numpy lacks (use ``data``)."""
        npd = numpy_dtype(self.dtype)
        if npd is None:
            raise TypeError(f"dtype {self.dtype} has no numpy equivalent; use .data")
        return np.frombuffer(self.data, dtype=npd).reshape(self.shape)


@dataclass(frozen=True)
class ShmFeature:
    """A feature in a named shared-memory segment (same host); the server only passes it on."""

    name: str
    shape: tuple[int, ...] = ()
    dtype: str = ""
    offset: int = 0
    nbytes: int = 0  # 0 = prod(shape) * itemsize
    owner_id: str = ""


def _as_ids(values: Any) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == np.int64 and values.ndim == 1:
        return values
    return np.asarray(values, dtype=np.int64).reshape(-1)


def spans_from_placeholders(placeholders: Sequence[tuple[int, int]]) -> np.ndarray:
    """gRPC ``(offset, length)`` pairs as inclusive ``[start, end]`` rows."""
    pairs = np.asarray(placeholders, dtype=np.int64).reshape(-1, 2)
    return np.stack([pairs[:, 0], pairs[:, 0] + pairs[:, 1] - 1], axis=1)


@dataclass(frozen=True, eq=False)
class Item:
    """One multimodal item of a request.

    ``offsets``: inclusive ``[start, end]`` rows in ``input_ids`` (build from
    gRPC's ``(offset, length)`` pairs with :meth:`with_placeholders`).
    ``feature``: the encoder input (:class:`Tensor`, or a numpy array, taken
    as :meth:`Tensor.from_numpy`), or a :class:`ShmFeature`. ``hash``: the
    unsigned 64-bit content hash, or None to let the service hash the
    feature. ``side``: model-specific tensors (``image_grid_thw`` int64
    ``[rows, 3]``, ``second_per_grid_ts`` float32, ...). ``placeholder_token_id``
    overrides the profile's placeholder id for this item (on the msgpack wire
    it is the request's ``im_token_id`` / ``video_token_id``).
    ``encode_handshake`` (EPD): the encode worker that ships this item's
    embedding to the prefill, ``{"bootstrap_host": str, "bootstrap_port": int,
    "bootstrap_room": int}``; the item may then come without ``feature`` if it
    has a ``hash``. It is passed to the scheduler unchanged (gRPC: the request's
    ``encode_bootstrap_info`` entry for this item).
    """

    modality: ModalityName | int
    offsets: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    feature: Tensor | ShmFeature | None = None
    hash: int | None = None
    pad_value: int | None = None
    side: Mapping[str, Tensor] = field(default_factory=dict)
    placeholder_token_id: int | None = None
    encode_handshake: Mapping[str, Any] | None = None
    # The received msgpack elements of an item decoded from frames (wire.py).
    wire_elements: tuple[Any, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.modality, str):
            name = self.modality.lower()
            if name not in MODALITIES:
                raise ValueError(f"modality must be one of {', '.join(MODALITIES)}")
            object.__setattr__(self, "modality", name)
        object.__setattr__(self, "offsets", np.asarray(self.offsets, dtype=np.int64).reshape(-1, 2))
        if self.feature is not None and not isinstance(self.feature, Tensor | ShmFeature):
            object.__setattr__(self, "feature", Tensor.from_numpy(self.feature))
        if self.hash is not None and not 0 <= self.hash < 2**64:
            raise ValueError(f"hash must be an unsigned 64-bit integer, got {self.hash}")
        side = {
            k: v if isinstance(v, Tensor) else Tensor.from_numpy(v) for k, v in self.side.items()
        }
        object.__setattr__(self, "side", side)

    @classmethod
    def with_placeholders(
        cls, modality: ModalityName | int, placeholders: Sequence[tuple[int, int]], **kwargs: Any
    ) -> Item:
        """An item whose spans are gRPC ``(offset, length)`` pairs."""
        return cls(modality, spans_from_placeholders(placeholders), **kwargs)

    @property
    def placeholders(self) -> list[tuple[int, int]]:
        """The spans as gRPC ``(offset, length)`` pairs."""
        return [(int(s), int(e - s + 1)) for s, e in self.offsets.tolist()]


def grid(value: Any) -> Tensor:
    """A ``*_grid_thw`` side tensor: int64 ``[rows, 3]`` from ``[t, h, w]`` or rows of them."""
    return Tensor.from_numpy(np.asarray(value, dtype=np.int64).reshape(-1, 3))


def seconds(value: Any) -> Tensor:
    """A timing side tensor (``second_per_grid_ts``, ``video_second_per_grid``): float32 ``[n]``."""
    return Tensor.from_numpy(np.atleast_1d(np.asarray(value, dtype=np.float32)))


@dataclass(frozen=True, eq=False)
class Request:
    """One admission request, for any transport.

    ``input_ids_unpadded`` set means materialized upstream (``input_ids`` then
    hold the substituted ids; docs/spec/MATERIALIZE.md rule 4). ``mrope_positions``
    ``[3, N]`` and ``mrope_position_delta`` are values computed upstream.
    ``multimodal`` says whether the request carries multimodal inputs at all
    (default: when it has items, M-RoPE values or a placeholder override); a
    text request has none. gRPC only: ``echo_features`` (the response carries
    the features back) and ``timeout_ms`` (the server-side budget, 0 = none).
    ZMQ only: ``validation_error`` (marked invalid upstream: the service must
    abort it). ``wire_fields`` are the raw msgpack elements of a request
    decoded from frames, sent again unchanged over ZMQ.
    """

    request_id: str
    input_ids: np.ndarray
    items: tuple[Item, ...] = ()
    input_ids_unpadded: np.ndarray | None = None
    mrope_positions: np.ndarray | None = None
    mrope_position_delta: int | None = None
    multimodal: bool | None = None
    echo_features: bool = False
    timeout_ms: int = 0
    validation_error: str | None = None
    wire_fields: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str):
            raise TypeError("request_id must be a string")
        object.__setattr__(self, "input_ids", _as_ids(self.input_ids))
        object.__setattr__(self, "items", tuple(self.items))
        if self.input_ids_unpadded is not None:
            object.__setattr__(self, "input_ids_unpadded", _as_ids(self.input_ids_unpadded))
        if self.mrope_positions is not None:
            object.__setattr__(
                self, "mrope_positions", np.asarray(self.mrope_positions, dtype=np.int64)
            )
        if self.multimodal is None:
            object.__setattr__(
                self,
                "multimodal",
                bool(self.items)
                or self.mrope_positions is not None
                or self.mrope_position_delta is not None,
            )

    def with_request_id(self, request_id: str) -> Request:
        """The same request under another id (everything else shared, nothing copied)."""
        return dataclasses.replace(self, request_id=request_id)


@dataclass(frozen=True, eq=False)
class MaterializedItem:
    modality: str  # "image", "video", "audio" (or the wire's number as text when unknown)
    hash: int | None
    pad_value: int | None
    offsets: np.ndarray  # [k, 2] int64, inclusive [start, end]
    feature: Tensor | ShmFeature | None = None  # gRPC: only with echo_features
    side: Mapping[str, Tensor] = field(default_factory=dict)
    encode_handshake: Mapping[str, Any] | None = None  # EPD: as the request carried it

    @property
    def placeholders(self) -> list[tuple[int, int]]:
        """The spans as gRPC ``(offset, length)`` pairs."""
        return [(int(s), int(e - s + 1)) for s, e in self.offsets.tolist()]


@dataclass(frozen=True, eq=False)
class Materialized:
    """The request with its derived fields set.

    ``passthrough``: taken as already materialized upstream (gRPC reports it;
    None over ZMQ, whose wire has no such field). ``frames``: the ZMQ reply as
    received, ``[status, payload, *aux]`` (empty over other transports).
    """

    request_id: str
    input_ids: np.ndarray  # int64 [N], pad-substituted
    input_ids_unpadded: np.ndarray | None  # int64 [N] originals; None for text requests
    items: tuple[MaterializedItem, ...] = ()
    mrope_positions: np.ndarray | None = None  # int64 [3, N]; None for non-M-RoPE models
    mrope_position_delta: int | None = None
    passthrough: bool | None = None
    frames: list[Any] = field(default_factory=list, repr=False)

    code = "MATERIALIZED"  # what bench tallies; an abort's is its code

    @property
    def materialized(self) -> bool:
        return True


@dataclass(frozen=True, eq=False)
class Aborted:
    """The request's terminal abort: ``code`` is the AbortCode name (``"INVALID_REQUEST"``...)."""

    request_id: str
    code: str
    message: str
    frames: list[Any] = field(default_factory=list, repr=False)

    @property
    def materialized(self) -> bool:
        return False


Outcome = Materialized | Aborted


@dataclass(frozen=True)
class ModelInfo:
    """The profile the server loaded (gRPC ``GetModelInfo``)."""

    family: str
    model_type: str
    architectures: tuple[str, ...]
    vocab_size: int
    max_model_len: int | None
    image_token_id: int | None
    video_token_id: int | None
    audio_token_id: int | None
    role: str
    language_model_only: bool
    multimodal_active: bool
    uses_mrope: bool


__all__ = [
    "MODALITIES",
    "Aborted",
    "Item",
    "Materialized",
    "MaterializedItem",
    "ModelInfo",
    "Outcome",
    "Request",
    "ShmFeature",
    "Tensor",
    "grid",
    "seconds",
    "spans_from_placeholders",
]
