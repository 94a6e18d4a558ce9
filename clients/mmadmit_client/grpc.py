"""gRPC client of the mmadmit admission API (``mmadmit.v1.Admission``).

Two clients with the same methods: :class:`AsyncAdmissionClient` (``grpc.aio``)
and :class:`AdmissionClient` (blocking). Both are context managers with an
explicit state (``UNOPENED`` -> ``OPENED`` -> ``CLOSED``; a closed client is not
reopened) and raise :class:`~mmadmit_client.ClientStateError` when used while
not open::

    async with AsyncAdmissionClient("127.0.0.1:50051") as client:
        req = build_request("r1", ids, items=[
            build_item("image", placeholders=[(10, 256)], feature=pixels,
                       image_grid_thw=[1, 32, 32], content_hash=0x1234),
        ])
        outcome = await client.admit(req)
        if isinstance(outcome, Aborted):
            print(outcome.code, outcome.message)

Outcomes are values, not exceptions: :class:`Materialized` or :class:`Aborted`
(an abort is the server's in-band answer, gRPC status OK). Exceptions are for
what is not an outcome (``_exceptions.py``): gRPC errors are mapped to
:class:`~mmadmit_client.ServerUnavailable` (UNAVAILABLE),
:class:`~mmadmit_client.RequestTimeout` (the call's deadline) or
:class:`~mmadmit_client.TransportError`, chained with ``from``; an answer with
no outcome is a :class:`~mmadmit_client.ProtocolError`.

TLS: ``credentials=tls_credentials(ca="ca.pem")`` opens a TLS channel (add
``cert=`` and ``key=`` for a server that requires client certificates). A
failed handshake is :class:`~mmadmit_client.ServerUnavailable`: gRPC reports
it as UNAVAILABLE, with the TLS error in the message when this side refused
the server's certificate, as a closed socket when the server refused ours.

Message size: responses for long prompts are large (a 128K-token response
carries about 4 MB of ids and positions, above gRPC's default 4 MB receive
limit), so both directions default to ``DEFAULT_MAX_MESSAGE_BYTES`` (1 GiB,
the server's default). A message over a limit fails its whole call; on
``admit_many`` that ends the stream (outcomes not yet received are lost).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Literal, TypeVar

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from mmadmit._proto import admission_pb2 as pb
from mmadmit._proto import admission_pb2_grpc as pb_grpc

from ._exceptions import (
    ClientStateError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
)
from ._state import ClientState

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
_GRPC_MAX_MESSAGE_BYTES = 2**31 - 1

MODALITIES: dict[str, Any] = {"image": pb.IMAGE, "audio": pb.AUDIO, "video": pb.VIDEO}
_MODALITY_NAMES = {v: k for k, v in MODALITIES.items()}

# numpy dtype -> the wire's torch-style name
_NP_DTYPE_NAMES = {
    "f8": "float64", "f4": "float32", "f2": "float16",
    "i8": "int64", "i4": "int32", "i2": "int16", "i1": "int8",
    "u8": "uint64", "u4": "uint32", "u2": "uint16", "u1": "uint8", "b1": "bool",
}  # fmt: skip
_NUMPY_OF = {name: np.dtype(code).newbyteorder("<") for code, name in _NP_DTYPE_NAMES.items()}
_ITEMSIZE = {
    **{n: d.itemsize for n, d in _NUMPY_OF.items()},
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


# --------------------------------------------------------------------------- values


@dataclass(frozen=True)
class ShmFeature:
    """A feature in a named shared-memory segment (same host); the server only passes it on."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int = 0
    nbytes: int = 0  # 0 = prod(shape) * itemsize
    owner_id: str = ""


@dataclass(frozen=True, eq=False)
class RawTensor:
    """A tensor whose dtype numpy may lack (``bfloat16``): dtype name, shape, raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    def to_numpy(self) -> np.ndarray:
        npd = _NUMPY_OF.get(self.dtype)
        if npd is None:
            raise TypeError(f"dtype {self.dtype} has no numpy equivalent; use .data")
        return np.frombuffer(self.data, dtype=npd).reshape(self.shape)


@dataclass(frozen=True, eq=False)
class MaterializedItem:
    modality: str  # "image", "video", "audio" (or "unspecified")
    hash: int | None
    pad_value: int
    offsets: np.ndarray  # [k, 2] int64, inclusive [start, end]
    feature: RawTensor | ShmFeature | None = None  # only with echo_features
    side: dict[str, RawTensor] = field(default_factory=dict)  # only with echo_features

    @property
    def placeholders(self) -> list[tuple[int, int]]:
        """The spans as gRPC ``(offset, length)`` pairs."""
        return [(int(s), int(e - s + 1)) for s, e in self.offsets]


@dataclass(frozen=True, eq=False)
class Materialized:
    """The request with its derived fields set."""

    request_id: str
    input_ids: np.ndarray  # int64 [N], pad-substituted
    input_ids_unpadded: np.ndarray  # int64 [N] originals; empty for text requests
    items: tuple[MaterializedItem, ...]
    mrope_positions: np.ndarray | None  # int64 [3, N]; None for non-M-RoPE models
    mrope_position_delta: int | None
    passthrough: bool  # taken as already materialized upstream


@dataclass(frozen=True)
class Aborted:
    """The request's terminal abort: ``code`` is the AbortCode name (``"INVALID_REQUEST"``...)."""

    request_id: str
    code: str
    message: str


Outcome = Materialized | Aborted


@dataclass(frozen=True)
class ModelInfo:
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


# --------------------------------------------------------------------------- request builder


def _dtype_name(arr: np.ndarray, override: str | None) -> str:
    if override is not None:
        size = _ITEMSIZE.get(override.removeprefix("torch."))
        if size is not None and size != arr.dtype.itemsize:
            raise ValueError(
                f"dtype {override} has {size}-byte items but the array's are {arr.dtype.itemsize}"
            )
        return override
    if arr.dtype.name == "bfloat16":  # ml_dtypes / torch-style numpy extension
        return "bfloat16"
    code = f"{arr.dtype.kind}{arr.dtype.itemsize}"
    name = _NP_DTYPE_NAMES.get(code)
    if name is None:
        raise ValueError(f"numpy dtype {arr.dtype} has no wire name; pass dtype= explicitly")
    return name


def tensor_data(value: Any, dtype: str | None = None) -> pb.TensorData:
    """A ``TensorData`` from an array (inline, little-endian, C order) or a :class:`ShmFeature`.

    ``dtype`` names the wire dtype when the array's own does not say it, e.g. a
    ``uint16`` array holding ``bfloat16`` bits.
    """
    if isinstance(value, ShmFeature):
        return pb.TensorData(
            shape=list(value.shape),
            dtype=value.dtype,
            shm=pb.ShmHandle(
                name=value.name, offset=value.offset, nbytes=value.nbytes, owner_id=value.owner_id
            ),
        )
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not _little_endian()):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    name = _dtype_name(arr, dtype)
    return pb.TensorData(
        shape=list(arr.shape), dtype=name, inline=np.ascontiguousarray(arr).tobytes()
    )


def _little_endian() -> bool:
    return np.little_endian


def _hash_bytes(content_hash: int | bytes) -> bytes:
    if isinstance(content_hash, (bytes, bytearray)):
        return bytes(content_hash)
    if not 0 <= content_hash < 2**64:
        raise ValueError(f"content_hash must be an unsigned 64-bit integer, got {content_hash}")
    return int(content_hash).to_bytes(8, "little")  # the service reads it little-endian


def build_item(
    modality: str | int,
    placeholders: Sequence[tuple[int, int]] | None = None,
    *,
    offsets: Sequence[tuple[int, int]] | np.ndarray | None = None,
    feature: np.ndarray | ShmFeature | None = None,
    feature_dtype: str | None = None,
    content_hash: int | bytes | None = None,
    pad_value: int | None = None,
    image_grid_thw: Any = None,
    video_grid_thw: Any = None,
    second_per_grid_ts: Any = None,
    video_second_per_grid: Any = None,
    side: Mapping[str, Any] | None = None,
    placeholder_token_id: int | None = None,
) -> pb.MultimodalItem:
    """One ``MultimodalItem``.

    Spans are ``placeholders`` as gRPC ``(offset, length)`` pairs, or ``offsets``
    as inclusive ``(start, end)`` pairs. ``content_hash`` as an int is sent as
    8 bytes little-endian (GRPC.md); leave it out to let the service hash an
    inline feature. Grids and timing values become ``model_specific_tensors``
    (grids int64 ``[rows, 3]``, seconds float32); ``side`` adds any others
    (arrays, or ``(array, dtype)`` pairs).
    """
    if isinstance(modality, str):
        try:
            proto_modality = MODALITIES[modality.lower()]
        except KeyError:
            raise ValueError(f"modality must be one of {', '.join(MODALITIES)}") from None
    else:
        proto_modality = int(modality)
    item = pb.MultimodalItem(modality=proto_modality)
    if placeholders is not None and offsets is not None:
        raise ValueError("give placeholders (offset, length) or offsets (start, end), not both")
    if offsets is not None:
        for start, end in np.asarray(offsets, dtype=np.int64).reshape(-1, 2).tolist():
            item.placeholders.add(offset=start, length=end - start + 1)
    for offset, length in placeholders or ():
        item.placeholders.add(offset=int(offset), length=int(length))
    if feature is not None:
        item.encoder_input.CopyFrom(tensor_data(feature, feature_dtype))
    if content_hash is not None:
        item.content_hash = _hash_bytes(content_hash)
    if pad_value is not None:
        item.pad_value = pad_value
    if placeholder_token_id is not None:
        item.placeholder_token_id = placeholder_token_id
    tensors = item.model_specific_tensors
    if image_grid_thw is not None:
        tensors["image_grid_thw"].CopyFrom(tensor_data(_grid(image_grid_thw)))
    if video_grid_thw is not None:
        tensors["video_grid_thw"].CopyFrom(tensor_data(_grid(video_grid_thw)))
    if second_per_grid_ts is not None:
        tensors["second_per_grid_ts"].CopyFrom(tensor_data(_seconds(second_per_grid_ts)))
    if video_second_per_grid is not None:
        tensors["video_second_per_grid"].CopyFrom(tensor_data(_seconds(video_second_per_grid)))
    for key, value in (side or {}).items():
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
            tensors[key].CopyFrom(tensor_data(value[0], value[1]))
        else:
            tensors[key].CopyFrom(tensor_data(value))
    return item


def _grid(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.int64).reshape(-1, 3)


def _seconds(value: Any) -> np.ndarray:
    return np.atleast_1d(np.asarray(value, dtype=np.float32))


def build_request(
    request_id: str,
    input_ids: Sequence[int] | np.ndarray,
    items: Sequence[pb.MultimodalItem] = (),
    *,
    input_ids_unpadded: Sequence[int] | np.ndarray | None = None,
    mrope: tuple[np.ndarray | None, int | None] | None = None,
    echo_features: bool = False,
    timeout_ms: int = 0,
    original_text: str = "",
) -> pb.AdmitRequest:
    """An ``AdmitRequest``. ``items`` from :func:`build_item`; ``mrope`` is
    ``(positions [3, N] or None, delta or None)``; ``input_ids_unpadded`` set
    means the request was materialized upstream (``input_ids`` then holds the
    substituted ids). ``timeout_ms`` is the server-side budget (0 = none)."""
    req = pb.AdmitRequest(request_id=request_id, echo_features=echo_features, timeout_ms=timeout_ms)
    req.tokenized.input_ids.extend(np.asarray(input_ids, dtype=np.int64).tolist())
    if original_text:
        req.tokenized.original_text = original_text
    if items:
        req.mm_inputs.items.extend(items)
    if input_ids_unpadded is not None:
        req.input_ids_unpadded.extend(np.asarray(input_ids_unpadded, dtype=np.int64).tolist())
    if mrope is not None:
        positions, delta = mrope
        req.mrope.SetInParent()
        if positions is not None:
            req.mrope.positions.CopyFrom(tensor_data(np.asarray(positions, dtype=np.int64)))
        if delta is not None:
            req.mrope.delta = int(delta)
    return req


# --------------------------------------------------------------------------- response decoding


def _raw_tensor(td: pb.TensorData) -> RawTensor | ShmFeature:
    if td.WhichOneof("payload") == "shm":
        s = td.shm
        return ShmFeature(s.name, tuple(td.shape), td.dtype, s.offset, s.nbytes, s.owner_id)
    return RawTensor(td.dtype, tuple(td.shape), td.inline)


def _ids(values: Any) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def outcome_from_proto(resp: pb.AdmitResponse) -> Outcome:
    """Decode an ``AdmitResponse``; :class:`ProtocolError` when it carries no outcome."""
    kind = resp.WhichOneof("outcome")
    if kind == "abort":
        return Aborted(
            resp.request_id,
            pb.AbortCode.Name(resp.abort.code)
            if resp.abort.code in pb.AbortCode.values()
            else str(resp.abort.code),
            resp.abort.message,
        )
    if kind != "materialized":
        raise ProtocolError(f"response for {resp.request_id!r} carries no outcome")
    m = resp.materialized
    items = []
    for it in m.items:
        offsets = np.array(
            [(p.offset, p.offset + p.length - 1) for p in it.placeholders], dtype=np.int64
        ).reshape(-1, 2)
        feature = _raw_tensor(it.encoder_input) if it.HasField("encoder_input") else None
        side = {}
        for key, td in it.model_specific_tensors.items():
            raw = _raw_tensor(td)
            if isinstance(raw, RawTensor):
                side[key] = raw
        items.append(
            MaterializedItem(
                modality=_MODALITY_NAMES.get(it.modality, "unspecified"),
                hash=it.hash if it.HasField("hash") else None,
                pad_value=it.pad_value,
                offsets=offsets,
                feature=feature,
                side=side,
            )
        )
    positions = None
    if m.HasField("mrope_positions"):
        td = m.mrope_positions
        if td.dtype != "int64" or td.WhichOneof("payload") != "inline":
            raise ProtocolError(f"mrope_positions must be inline int64, got {td.dtype!r}")
        positions = np.frombuffer(td.inline, dtype="<i8").reshape(tuple(td.shape))
    return Materialized(
        request_id=resp.request_id,
        input_ids=_ids(m.input_ids),
        input_ids_unpadded=_ids(m.input_ids_unpadded),
        items=tuple(items),
        mrope_positions=positions,
        mrope_position_delta=m.mrope_position_delta if m.HasField("mrope_position_delta") else None,
        passthrough=m.passthrough,
    )


def model_info_from_proto(info: pb.GetModelInfoResponse) -> ModelInfo:
    def opt(name: str) -> int | None:
        return getattr(info, name) if info.HasField(name) else None

    return ModelInfo(
        family=info.family,
        model_type=info.model_type,
        architectures=tuple(info.architectures),
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len or None,
        image_token_id=opt("image_token_id"),
        video_token_id=opt("video_token_id"),
        audio_token_id=opt("audio_token_id"),
        role=info.role,
        language_model_only=info.language_model_only,
        multimodal_active=info.multimodal_active,
        uses_mrope=info.uses_mrope,
    )


# --------------------------------------------------------------------------- errors


@contextlib.contextmanager
def map_grpc_errors(what: str) -> Iterator[None]:
    """Map ``grpc.RpcError`` (sync and aio) to the client's exceptions, chained."""
    try:
        yield
    except grpc.RpcError as exc:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        name = code.name if code is not None else "UNKNOWN"
        message = f"{what}: {name}: {details}"
        if code == grpc.StatusCode.UNAVAILABLE:
            raise ServerUnavailable(message) from exc
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise RequestTimeout(message) from exc
        raise TransportError(message) from exc


LoadBalancing = Literal["pick_first", "round_robin"]


def _channel_options(
    max_message_bytes: int,
    load_balancing: LoadBalancing | None = None,
    extra: Sequence[tuple[str, Any]] = (),
) -> list[tuple[str, Any]]:
    """Channel options: message limits, the load-balancing policy, then ``extra``.

    ``round_robin`` spreads calls over every address the target resolves to
    (a headless Kubernetes Service ``dns:///mmadmit.NS.svc:50051``, or
    ``ipv4:HOST:PORT,HOST:PORT``); gRPC's default, ``pick_first``, sends every
    call to one replica.
    """
    limit = min(max_message_bytes, _GRPC_MAX_MESSAGE_BYTES)
    options: list[tuple[str, Any]] = [
        ("grpc.max_receive_message_length", limit),
        ("grpc.max_send_message_length", limit),
    ]
    if load_balancing is not None:
        config: dict[str, Any] = {"loadBalancingConfig": [{load_balancing: {}}]}
        options.append(("grpc.service_config", json.dumps(config)))
    options.extend(extra)
    return options


_PEM_CERT = b"-----BEGIN CERTIFICATE-----"
_PEM_KEY = b"PRIVATE KEY-----"


def _read_pem(path: str | os.PathLike[str], what: str, mark: bytes) -> bytes:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ValueError(
            f"{what} {os.fspath(path)}: cannot read it: {exc.strerror or exc}"
        ) from exc
    if mark not in data:  # gRPC would only fail the handshake later, obscurely
        label = "certificate" if mark == _PEM_CERT else "private key"
        raise ValueError(f"{what} {os.fspath(path)}: no PEM {label} in it")
    return data


def tls_credentials(
    ca: str | os.PathLike[str] | None = None,
    cert: str | os.PathLike[str] | None = None,
    key: str | os.PathLike[str] | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials from PEM files, for ``credentials=``.

    ``ca``: the CA bundle that verifies the server (default: the system's
    roots). ``cert`` and ``key`` (both or neither): this client's certificate
    chain and private key, for a server that requires client certificates
    (mutual TLS). The server's certificate must name the host of the target
    (an IP target needs an IP SAN); the channel option
    ``grpc.ssl_target_name_override`` checks another name instead. A file that
    cannot be read raises ``ValueError`` naming it.
    """
    if (cert is None) != (key is None):
        raise ValueError("a client certificate needs its key, and a key its certificate")
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(ca, "CA bundle", _PEM_CERT) if ca is not None else None,
        private_key=_read_pem(key, "client key", _PEM_KEY) if key is not None else None,
        certificate_chain=(
            _read_pem(cert, "client certificate", _PEM_CERT) if cert is not None else None
        ),
    )


_HEALTH_NAMES = {v: k for k, v in health_pb2.HealthCheckResponse.ServingStatus.items()}

_T = TypeVar("_T", bound="_StateMixin")


class _StateMixin:
    _state: ClientState
    target: str

    def _require_open(self) -> None:
        if self._state is not ClientState.OPENED:
            raise ClientStateError(
                f"the client for {self.target} is {self._state.name.lower()}; "
                "use it inside 'with' / 'async with' (a closed client cannot be reopened)"
            )

    def _begin_open(self) -> None:
        if self._state is not ClientState.UNOPENED:
            raise ClientStateError(
                f"the client for {self.target} cannot be opened twice (state "
                f"{self._state.name.lower()})"
            )


# --------------------------------------------------------------------------- async client


class AsyncAdmissionClient(_StateMixin):
    """``grpc.aio`` client; use it on one event loop, inside ``async with``.

    ``credentials`` (:func:`tls_credentials`) opens a TLS channel; without them
    the channel is plaintext.
    """

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        load_balancing: LoadBalancing | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target = target
        self.max_message_bytes = max_message_bytes
        self.credentials = credentials
        self._options = _channel_options(max_message_bytes, load_balancing, channel_options)
        self._state = ClientState.UNOPENED
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.AdmissionStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    @property
    def state(self) -> ClientState:
        return self._state

    async def open(self) -> None:
        self._begin_open()
        if self.credentials is not None:
            self._channel = grpc.aio.secure_channel(
                self.target, self.credentials, options=self._options
            )
        else:
            self._channel = grpc.aio.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.AdmissionStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._state = ClientState.OPENED

    async def aclose(self) -> None:
        if self._state is ClientState.OPENED and self._channel is not None:
            await self._channel.close()
        self._channel = self._stub = self._health = None
        self._state = ClientState.CLOSED

    async def __aenter__(self: _T) -> _T:
        await self.open()  # type: ignore[attr-defined]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def stub(self) -> pb_grpc.AdmissionStub:
        """The raw generated stub (for calls the typed API does not cover)."""
        self._require_open()
        assert self._stub is not None
        return self._stub

    async def admit(self, request: pb.AdmitRequest, timeout: float | None = None) -> Outcome:
        """Admit one request; ``timeout`` is the call's deadline in seconds (client side)."""
        stub = self.stub
        with map_grpc_errors(f"Admit {request.request_id!r}"):
            resp = await stub.Admit(request, timeout=timeout)
        return outcome_from_proto(resp)

    async def admit_many(
        self,
        requests: Iterable[pb.AdmitRequest] | AsyncIterable[pb.AdmitRequest],
        timeout: float | None = None,
    ) -> AsyncIterator[Outcome]:
        """Admit many requests on one ``AdmitStream`` call; outcomes arrive in
        completion order (match them by ``request_id``)."""
        stub = self.stub
        call = stub.AdmitStream(requests, timeout=timeout)
        try:
            with map_grpc_errors("AdmitStream"):
                async for resp in call:
                    yield outcome_from_proto(resp)
        finally:
            call.cancel()  # no-op once the call has ended; stops it if the caller broke off

    async def abort(self, request_id: str, reason: str = "") -> bool:
        """Cancel a request in flight on the server; False when none is in flight there."""
        stub = self.stub
        with map_grpc_errors(f"Abort {request_id!r}"):
            resp = await stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason))
        return resp.success

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        stub = self.stub
        with map_grpc_errors("GetModelInfo"):
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
        return model_info_from_proto(info)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        """The health status name (``SERVING``, ``NOT_SERVING``; ``SERVICE_UNKNOWN`` when the
        server does not know ``service``)."""
        self._require_open()
        assert self._health is not None
        try:
            with map_grpc_errors(f"Health.Check {service!r}"):
                resp = await self._health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
        except TransportError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
        return _HEALTH_NAMES.get(resp.status, str(resp.status))


# --------------------------------------------------------------------------- sync client


class AdmissionClient(_StateMixin):
    """Blocking client with the methods of :class:`AsyncAdmissionClient`; use inside ``with``."""

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        load_balancing: LoadBalancing | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self.target = target
        self.max_message_bytes = max_message_bytes
        self.credentials = credentials
        self._options = _channel_options(max_message_bytes, load_balancing, channel_options)
        self._state = ClientState.UNOPENED
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.AdmissionStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None

    @property
    def state(self) -> ClientState:
        return self._state

    def open(self) -> None:
        self._begin_open()
        if self.credentials is not None:
            self._channel = grpc.secure_channel(
                self.target, self.credentials, options=self._options
            )
        else:
            self._channel = grpc.insecure_channel(self.target, options=self._options)
        self._stub = pb_grpc.AdmissionStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._state = ClientState.OPENED

    def close(self) -> None:
        if self._state is ClientState.OPENED and self._channel is not None:
            self._channel.close()
        self._channel = self._stub = self._health = None
        self._state = ClientState.CLOSED

    def __enter__(self: _T) -> _T:
        self.open()  # type: ignore[attr-defined]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def stub(self) -> pb_grpc.AdmissionStub:
        self._require_open()
        assert self._stub is not None
        return self._stub

    def admit(self, request: pb.AdmitRequest, timeout: float | None = None) -> Outcome:
        stub = self.stub
        with map_grpc_errors(f"Admit {request.request_id!r}"):
            resp = stub.Admit(request, timeout=timeout)
        return outcome_from_proto(resp)

    def admit_many(
        self, requests: Iterable[pb.AdmitRequest], timeout: float | None = None
    ) -> Iterator[Outcome]:
        stub = self.stub
        call = stub.AdmitStream(iter(requests), timeout=timeout)
        try:
            with map_grpc_errors("AdmitStream"):
                for resp in call:
                    yield outcome_from_proto(resp)
        finally:
            call.cancel()

    def abort(self, request_id: str, reason: str = "") -> bool:
        stub = self.stub
        with map_grpc_errors(f"Abort {request_id!r}"):
            resp = stub.Abort(pb.AbortRequest(request_id=request_id, reason=reason))
        return resp.success

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        stub = self.stub
        with map_grpc_errors("GetModelInfo"):
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
        return model_info_from_proto(info)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        self._require_open()
        assert self._health is not None
        try:
            with map_grpc_errors(f"Health.Check {service!r}"):
                resp = self._health.Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
        except TransportError as exc:
            cause = exc.__cause__
            if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise
        return _HEALTH_NAMES.get(resp.status, str(resp.status))


__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "MODALITIES",
    "Aborted",
    "AdmissionClient",
    "AsyncAdmissionClient",
    "ClientState",
    "Materialized",
    "MaterializedItem",
    "ModelInfo",
    "Outcome",
    "RawTensor",
    "ShmFeature",
    "build_item",
    "build_request",
    "map_grpc_errors",
    "model_info_from_proto",
    "outcome_from_proto",
    "tensor_data",
    "tls_credentials",
]
