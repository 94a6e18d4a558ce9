"""gRPC ``mmadmit.v1.Admission`` servicer: proto <-> internal model translation only.

Scope: decode an ``AdmitRequest`` into a :class:`mmadmit.model.Request`, hand it
to the :class:`~mmadmit.pool.MaterializerPool` (through
:class:`~mmadmit.admission.Admissions`, which keeps the request ids in flight
and counts outcomes), encode the one outcome as an ``AdmitResponse``. No
materialization rule lives here (docs/spec/MATERIALIZE.md: a transport only decodes,
submits and encodes); what this module checks is only
what the internal model cannot represent or what is specific to the gRPC
encoding (docs/spec/GRPC.md, "Translation checks"; the internal model has no
audio placeholder override, hence the audio rule there).

Copies (``pbwire.py``): ``Admit`` and ``AdmitStream`` receive what the request
deserializer ``pbwire.parse_admit_request`` made, a plain ``AdmitRequest`` or,
for one with inline tensors of 64 KiB or more, a ``StrippedRequest`` whose
large tensors stay in the received bytes (the tensors built here are views on
them: no copy at all); the response's id fields are encoded as packed varints
in one pass (``pbwire.packed_uint32_field``) instead of element by element.

Outcomes are in band (docs/spec/GRPC.md, "AdmitResponse"). The
per-RPC error ladder (STYLE 5): :class:`~mmadmit.errors.AdmissionError` ->
in-band abort of its code; ``grpc.aio.AbortError`` -> re-raised untouched;
``CancelledError`` (the client cancelled, or its deadline passed) -> the pool
ticket is cancelled (``Ticket.outcome`` does it), the call is counted in
``stats.calls_cancelled`` and nothing is sent; anything else -> logged with its
traceback and answered in band ``INTERNAL``.

Non-goals: the ``GenerateRequest`` fields the spec leaves out (protobuf keeps
them as unknown fields), reading shared memory, transport options (``grpc_server.py``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeAlias

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from mmadmit_client.proto import admission_pb2 as pb
from mmadmit_client.proto import admission_pb2_grpc as pb_grpc

from .admission import Admissions
from .dtypes import parse_dtype
from .errors import (
    Abort,
    AbortCode,
    AdmissionError,
    InvalidRequest,
    Unsupported,
    abort_from_exception,
)
from .limits import Limits
from .materializer import Outcome
from .model import (
    Item,
    Materialized,
    Modality,
    MultimodalInputs,
    Request,
    ShmHandle,
    Tensor,
    check_shm_name,
)
from .pbwire import (
    RefusedRequest,
    StrippedRequest,
    Undecodable,
    encode_varint,
    ids_of,
    message_and_payloads,
    packed_uint32_field,
    resolve_inline,
    unpadded_of,
)
from .pool import MaterializerPool
from .profile import ModelProfile
from .telemetry import (
    RECEIVED_BYTES,
    SENT_BYTES,
    UNDELIVERABLE,
    Sample,
    Telemetry,
    counter,
    counters,
)
from .tensorcheck import label

logger = logging.getLogger(__name__)

# gRPC Modality enum value -> internal Modality (docs/spec/GRPC.md: the numberings differ).
MODALITY_FROM_PROTO: dict[Any, Modality] = {
    pb.IMAGE: Modality.IMAGE,
    pb.AUDIO: Modality.AUDIO,
    pb.VIDEO: Modality.VIDEO,
}
MODALITY_TO_PROTO: dict[int, Any] = {int(m): p for p, m in MODALITY_FROM_PROTO.items()}
_MODALITY: dict[int, Modality] = {int(m): m for m in Modality}  # a dict read, not an enum call

# AbortCode by name: the internal enum's values are the proto enum's names.
_ABORT_CODE_TO_PROTO: dict[AbortCode, Any] = {
    code: pb.AbortCode.Value(code.value) for code in AbortCode
}

# The inline payloads a stripped request's markers stand for (None: a plain message).
Payloads: TypeAlias = list[memoryview] | None
# What Admit and AdmitStream answer: an AdmitResponse, or its bytes (encode_response);
# the response serializer (grpc_server.admission_handlers) sends bytes as they are.
Response: TypeAlias = pb.AdmitResponse | bytes


@dataclass
class ServicerStats:
    """Counters of the gRPC transport (``AdmissionServicer.stats``); its outcomes are
    the admission path's (``admissions.stats``). Written on the event loop thread only.
    """

    requests: int = 0  # AdmitRequests received (Admit calls + stream messages)
    streams: int = 0  # AdmitStream calls opened
    calls_cancelled: int = 0  # requests whose call was cancelled or expired: nothing sent
    aborts_requested: int = 0  # Abort RPCs that cancelled a request
    received_bytes: int = 0  # bytes of AdmitRequest messages received
    sent_bytes: int = 0  # bytes of AdmitResponse messages serialized for sending

    # exported as mmadmit_grpc_<field>_total, with this help (metrics())
    COUNTERS: ClassVar[dict[str, str]] = {
        "requests": "AdmitRequests received (Admit calls and AdmitStream messages).",
        "streams": "AdmitStream calls opened.",
        "aborts_requested": "Abort RPCs that cancelled a request.",
    }

    def metrics(self) -> Iterator[Sample]:
        yield from counters(self, "grpc", self.COUNTERS)
        lost = self.calls_cancelled  # cancelled or past their deadline: nothing sent
        yield counter("undeliverable_replies", UNDELIVERABLE, lost, transport="grpc")
        yield counter("received_bytes", RECEIVED_BYTES, self.received_bytes, transport="grpc")
        yield counter("sent_bytes", SENT_BYTES, self.sent_bytes, transport="grpc")


# --------------------------------------------------------------------------- proto -> model


# A tensor's name in a message: a string, or (item index, what) formatted only
# when a message is (tensorcheck.label, as :class:`~mmadmit.model.Tensor` takes it).
_Name: TypeAlias = str | tuple[int, str]


# A dtype name -> its DType, for the valid names seen (a finite set: the canonical
# names, their aliases and numpy's type strings for them; capped all the same);
# parse_dtype words a refusal.
_DTYPES: dict[str, Any] = {}
_DTYPES_MAX = 256


def _dtype(td: pb.TensorData, name: _Name) -> Any:
    text = td.dtype
    found = _DTYPES.get(text)
    if found is not None:
        return found
    try:
        found = parse_dtype(text)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{label(name)}: {exc.message}") from None
    if len(_DTYPES) < _DTYPES_MAX:
        _DTYPES[text] = found
    return found


def tensor_from_proto(
    td: pb.TensorData, what: _Name, payloads: Payloads = None, limits: Limits | None = None
) -> Tensor | ShmHandle:
    """A ``TensorData`` as an inline :class:`Tensor` or a handle.

    An inline tensor is a view on protobuf's bytes, or, for a payload the
    request deserializer stripped (``payloads``, see ``pbwire.py``), a view on
    the received message itself; the :class:`Tensor` checks its byte length
    and, with ``limits``, its rank, dimensions and bytes. ``what`` names the
    tensor in a message: a string or an ``(item, key)`` pair.
    """
    kind = td.WhichOneof("payload")
    if kind is None:
        raise InvalidRequest(
            f"{label(what)}: TensorData carries no payload (neither inline bytes nor shm)"
        )
    if kind == "remote":  # SMG's RemoteTensorHandle (NIXL and the like)
        raise Unsupported(
            f"{label(what)}: a remote tensor payload "
            f"({td.remote.transport or 'unnamed transport'}) cannot be forwarded; send it "
            "inline or in shared memory"
        )
    dtype = _dtype(td, what)
    shape = tuple(td.shape[:])  # a slice is one C call; iterating reads element by element
    if kind == "inline":
        # Reading a bytes field makes protobuf's one copy; keep a view on it, copy nothing
        # more. A stripped payload's marker resolves to a view on the received bytes.
        return Tensor(dtype, shape, resolve_inline(td.inline, payloads), what, limits)
    expected = math.prod(shape) * dtype.itemsize
    shm = td.shm
    check_shm_name(shm.name, label(what))
    if shm.nbytes and shm.nbytes != expected:
        raise InvalidRequest(
            f"{label(what)}: shm nbytes {shm.nbytes} but shape {list(shape)} of "
            f"{dtype.name} needs {expected}"
        )
    return ShmHandle(
        name=shm.name,
        shape=shape,
        dtype=dtype.name,
        offset=shm.offset,
        nbytes=shm.nbytes or expected,
        owner_id=shm.owner_id or None,
    )


def _inline_tensor(
    td: pb.TensorData, what: _Name, payloads: Payloads, limits: Limits | None
) -> Tensor:
    t = tensor_from_proto(td, what, payloads, limits)
    if isinstance(t, ShmHandle):
        raise InvalidRequest(
            f"{label(what)}: must be inline bytes (shared memory is accepted only for "
            "encoder_input)"
        )
    return t


def _offset_table(proto_items: Any) -> tuple[np.ndarray, list[int], tuple[int, int] | None]:
    """Every item's placeholders as inclusive ``[start, end]`` rows of one table, each
    item's rows ``table[bounds[i]:bounds[i + 1]]``, and the first zero-length
    placeholder as (item, index) (None: none), which the item's translation words:
    one array for the request, not one per item."""
    flat: list[int] = []
    bounds = [0]
    zero = None
    for i, it in enumerate(proto_items):
        phs = it.placeholders
        for k in range(len(phs)):  # indexing: iterating a repeated message field is slower
            ph = phs[k]
            start, length = ph.offset, ph.length
            if not length and zero is None:
                zero = (i, k)
            flat.append(start)
            flat.append(start + length - 1)
        bounds.append(len(flat) >> 1)
    table = np.array(flat, np.int64).reshape(-1, 2)
    return table, bounds, zero


def _zero_length(proto_items: Any, idx: int, k: int) -> InvalidRequest:
    return InvalidRequest(
        f"item {idx}: placeholders[{k}] (offset {proto_items[idx].placeholders[k].offset}) "
        "has length 0; a placeholder range covers at least one token"
    )


def _item_from_proto(
    msg: pb.MultimodalItem, idx: int, payloads: Payloads, limits: Limits | None
) -> Item:
    modality = MODALITY_FROM_PROTO.get(msg.modality)
    if modality is None:
        name = pb.Modality.Name(msg.modality) if msg.modality in pb.Modality.values() else "unknown"
        raise InvalidRequest(
            f"item {idx}: modality {msg.modality} ({name}) is not one of IMAGE (1), AUDIO (2), "
            "VIDEO (3)"
        )
    content_hash = None
    raw_hash = msg.content_hash
    if raw_hash:
        # SMG's convention: the first 8 bytes, little-endian; shorter values zero-extended.
        content_hash = int.from_bytes(raw_hash[:8], "little")
    feature: Tensor | None = None
    feature_shm: ShmHandle | None = None
    if msg.HasField("encoder_input"):
        got = tensor_from_proto(msg.encoder_input, (idx, "encoder_input"), payloads, limits)
        if isinstance(got, ShmHandle):
            feature_shm = got
        else:
            feature = got
    side: dict[str, Any] = {}
    tensors = msg.model_specific_tensors
    if len(tensors):
        # keys, then each value: reading the map's items() is slower
        for key in tensors:
            side[key] = _inline_tensor(
                tensors[key], (idx, f"model_specific_tensors[{key!r}]"), payloads, limits
            )
    return Item(
        int(modality),
        content_hash,
        msg.pad_value if _has_pad_value(msg) else None,
        None,  # offsets: items_from_proto sets them from one table
        feature,
        feature_shm,
        side,
    )


def _placeholder_overrides(
    items: Any, models: list[Item], profile: ModelProfile
) -> dict[Modality, int]:
    overrides: dict[Modality, int] = {}
    for idx, (msg, item) in enumerate(zip(items, models, strict=True)):
        if not msg.HasField("placeholder_token_id"):
            continue
        modality = _MODALITY[item.modality]  # an Item from _item_from_proto: a known value
        token = msg.placeholder_token_id
        prev = overrides.setdefault(modality, token)
        if prev != token:
            raise InvalidRequest(
                f"item {idx}: placeholder_token_id {token} differs from {prev} given by an "
                f"earlier {modality.name.lower()} item"
            )
        audio_id = profile.audio_token_id
        if modality is Modality.AUDIO and audio_id is not None and token != audio_id:
            raise InvalidRequest(
                f"item {idx}: placeholder_token_id {token} differs from the model's audio "
                f"placeholder {audio_id} (audio placeholders cannot be overridden)"
            )
    return overrides


def _has_pad_value(msg: Any) -> bool:
    """mmadmit's ``pad_value`` (100): SMG's own ``MultimodalItem`` has no such field."""
    return "pad_value" in msg.DESCRIPTOR.fields_by_name and bool(msg.HasField("pad_value"))


def items_from_proto(
    proto_items: Any, profile: ModelProfile, payloads: Payloads, limits: Limits | None = None
) -> MultimodalInputs:
    """The ``MultimodalItem`` list of a request, translated (shared with the SMG gRPC
    face: ``tokenspeed.grpc.scheduler.MultimodalItem`` has the same fields and
    numbers, less ``pad_value``); ``limits``: the tensors' (see :class:`Tensor`)."""
    proto_items = proto_items[:]  # a list: one C call, then plain iteration
    table, bounds, zero = _offset_table(proto_items)
    items: list[Item] = []
    for i, it in enumerate(proto_items):
        item = _item_from_proto(it, i, payloads, limits)
        if zero is not None and zero[0] == i:  # worded after the item's tensors, as before
            raise _zero_length(proto_items, i, zero[1])
        item.offsets = table[bounds[i] : bounds[i + 1]]
        items.append(item)
    overrides = _placeholder_overrides(proto_items, items, profile)
    return MultimodalInputs(
        items=items,
        im_token_id=overrides.get(Modality.IMAGE),
        video_token_id=overrides.get(Modality.VIDEO),
    )


def attach_encode_handshakes(msg: Any, mm: MultimodalInputs | None) -> None:
    """EPD: each ``encode_bootstrap_info`` entry of ``msg`` (an ``AdmitRequest`` or
    SMG's ``GenerateRequest``: field 10, the same message) becomes the
    ``encode_handshake`` of item ``item_index`` of ``mm`` (the request's items), as
    TokenSpeed's own gRPC servicer attaches it; refusals: docs/spec/SMG_GRPC.md,
    "One `Generate` call", step 1."""
    if not msg.HasField("encode_bootstrap_info"):
        return
    entries = msg.encode_bootstrap_info.items
    if not msg.HasField("mm_inputs") or mm is None:
        raise InvalidRequest(
            f"encode_bootstrap_info has {len(entries)} entries but the request has no "
            "mm_inputs; each entry names an item of mm_inputs.items"
        )
    items = mm.items
    first: dict[int, int] = {}  # item index -> the entry that named it
    for k, entry in enumerate(entries):
        idx = entry.item_index
        if idx >= len(items):
            raise InvalidRequest(
                f"encode_bootstrap_info.items[{k}]: item_index {idx} is out of range for "
                f"{len(items)} mm item(s)"
            )
        if idx in first:
            raise InvalidRequest(
                f"encode_bootstrap_info.items[{k}]: item {idx} already has a handshake "
                f"(encode_bootstrap_info.items[{first[idx]}]); one entry per item"
            )
        first[idx] = k
        items[idx].encode_handshake = {
            "bootstrap_host": entry.bootstrap_host,
            "bootstrap_port": entry.bootstrap_port,
            "bootstrap_room": entry.bootstrap_room,
        }


def request_from_proto(
    request: pb.AdmitRequest | StrippedRequest,
    profile: ModelProfile,
    limits: Limits | None = None,
) -> Request:
    """Translate an ``AdmitRequest``; :class:`InvalidRequest` names what cannot be translated,
    :class:`~mmadmit.errors.TooLarge` a tensor over ``limits``.

    ``request``: the message, or what the request deserializer made of it, a
    :class:`~mmadmit.pbwire.StrippedRequest`: its inline payloads and token ids
    are read from the received bytes, not from the parsed message (which no
    longer holds them).
    """
    msg, payloads = message_and_payloads(request)
    rid = msg.request_id
    if not rid:
        raise InvalidRequest("request_id is empty; responses are matched by request_id")
    input_ids = ids_of(request)
    unpadded = unpadded_of(request)
    mm = None
    has_mm = msg.HasField("mm_inputs")
    has_mrope = msg.HasField("mrope")
    if has_mm or has_mrope:
        mm = items_from_proto(msg.mm_inputs.items, profile, payloads, limits)
        if has_mrope:
            mrope = msg.mrope
            if mrope.HasField("positions"):
                mm.mrope_positions = _inline_tensor(
                    mrope.positions, "mrope.positions", payloads, limits
                )
            if mrope.HasField("delta"):
                mm.mrope_position_delta_scalar = mrope.delta
    attach_encode_handshakes(msg, mm)
    return Request(rid=rid, input_ids=input_ids, input_ids_unpadded=unpadded, mm=mm)


# --------------------------------------------------------------------------- model -> proto


def _tensor_to_proto(t: Tensor | ShmHandle, out: pb.TensorData) -> None:
    if isinstance(t, ShmHandle):
        out.shape.extend(t.shape or ())
        out.dtype = t.dtype or ""
        out.shm.name = t.name
        out.shm.offset = t.offset
        out.shm.nbytes = t.nbytes or 0
        out.shm.owner_id = t.owner_id or ""
        return
    out.shape.extend(t.shape)
    out.dtype = t.dtype.name
    obj = t.data.obj
    # A view on a whole bytes object (what the decoder built) is handed over as is.
    out.inline = obj if isinstance(obj, bytes) and len(obj) == t.nbytes else t.data.tobytes()


def _packed_ids(ids: np.ndarray, unpadded: np.ndarray | None) -> bytes:
    """``input_ids`` (1) and ``input_ids_unpadded`` (2) as packed fields, encoded in
    one pass and range-checked as protobuf's ``extend`` does (its message)."""
    raw = packed_uint32_field(1, np.ascontiguousarray(ids, np.int64))
    if unpadded is not None:
        raw += packed_uint32_field(2, np.ascontiguousarray(unpadded, np.int64))
    return raw


def _positions_i64(t: Tensor) -> np.ndarray:
    """The positions tensor as a C-contiguous little-endian int64 array."""
    arr = t.to_numpy()
    if arr.dtype != np.dtype("<i8"):
        arr = arr.astype("<i8")
    return np.ascontiguousarray(arr)


def _item_to_proto(item: Item, out: pb.MaterializedItem, echo: bool) -> None:
    out.modality = MODALITY_TO_PROTO.get(item.modality, pb.MODALITY_UNSPECIFIED)
    if item.hash is not None:
        out.hash = item.hash
    if item.pad_value is not None:
        out.pad_value = item.pad_value
    if item.offsets is not None:
        for start, end in item.offsets.tolist():
            out.placeholders.add(offset=start, length=end - start + 1)
    if echo:
        feature = item.feature if item.feature is not None else item.feature_shm
        if feature is not None:
            _tensor_to_proto(feature, out.encoder_input)
        for key, value in item.side.items():
            if isinstance(value, Tensor):
                _tensor_to_proto(value, out.model_specific_tensors[key])
    handshake = item.encode_handshake
    if handshake is not None:  # an item of a gRPC request: set from the request's entry
        out.encode_handshake.bootstrap_host = handshake["bootstrap_host"]
        out.encode_handshake.bootstrap_port = handshake["bootstrap_port"]
        out.encode_handshake.bootstrap_room = handshake["bootstrap_room"]


def _items_and_delta_to_proto(
    mm: MultimodalInputs, out: pb.MaterializedRequest, echo: bool
) -> None:
    """The items and the delta scalar of a materialized request (protobuf builds
    them; :func:`encode_response` writes the ids and the positions itself)."""
    for item in mm.items:
        _item_to_proto(item, out.items.add(), echo)
    if mm.mrope_position_delta_scalar is not None:
        out.mrope_position_delta = mm.mrope_position_delta_scalar


# Field keys of the bytes encode_response writes itself (tag = number << 3 | wire type 2).
_KEY_REQUEST_ID = b"\x0a"  # AdmitResponse.request_id (1)
_KEY_MATERIALIZED = b"\x12"  # AdmitResponse.materialized (2)
_KEY_POSITIONS = b"\x22"  # MaterializedRequest.mrope_positions (4)
_DTYPE_INT64 = b"\x12\x05int64"  # TensorData.dtype (2) = "int64"
_KEY_INLINE = b"\x1a"  # TensorData.inline (3)


def _positions_field(t: Tensor) -> list[Any]:
    """``MaterializedRequest.mrope_positions`` as wire pieces (shape, dtype
    ``int64``, the little-endian bytes), the array's bytes as a view, not copied."""
    arr = _positions_i64(t)
    shape = packed_uint32_field(1, np.array(arr.shape, np.int64))  # TensorData.shape (1)
    head = b"".join([shape, _DTYPE_INT64, _KEY_INLINE, encode_varint(arr.nbytes)])
    body = arr.data.cast("B")
    return [_KEY_POSITIONS, encode_varint(len(head) + len(body)), head, body]


def encode_response(rid: str, outcome: Outcome, *, echo_features: bool) -> bytes:
    """One outcome as the bytes of its ``AdmitResponse`` (what Admit and AdmitStream
    send): the one encoder. A materialized outcome's two id arrays are packed
    varints written in one pass and its ``[3, N]`` positions the array's own
    bytes; protobuf builds only the rest (items, delta, passthrough). The bytes
    parse to the message protobuf alone would build (``tests/response_oracle.py``
    holds them to it), not always in the same field order. An id out of
    ``uint32`` raises ``ValueError`` as protobuf's ``extend`` would.
    """
    if not isinstance(outcome, Materialized):
        return abort_response(rid, outcome).SerializeToString()  # type: ignore[no-any-return]
    req = outcome.request
    pieces: list[Any] = [_packed_ids(req.input_ids, req.input_ids_unpadded)]
    rest = pb.MaterializedRequest(passthrough=outcome.passthrough)
    positions: list[Any] = []
    mm = req.mm
    if mm is not None:
        _items_and_delta_to_proto(mm, rest, echo_features)
        if mm.mrope_positions is not None:
            positions = _positions_field(mm.mrope_positions)
    pieces.append(rest.SerializeToString())
    pieces += positions
    raw_rid = rid.encode()
    # request_id as proto3 writes it: an empty one not at all
    head = [_KEY_REQUEST_ID, encode_varint(len(raw_rid)), raw_rid] if raw_rid else []
    head += [_KEY_MATERIALIZED, encode_varint(sum([len(p) for p in pieces]))]
    return b"".join(head + pieces)


def abort_response(rid: str, abort: Abort) -> pb.AdmitResponse:
    return pb.AdmitResponse(
        request_id=rid,
        abort=pb.AbortStatus(code=_ABORT_CODE_TO_PROTO[abort.code], message=abort.message),
    )


def model_info_from_profile(profile: ModelProfile) -> pb.GetModelInfoResponse:
    info = pb.GetModelInfoResponse(
        family=profile.family.value,
        model_type=profile.model_type,
        architectures=list(profile.architectures),
        vocab_size=profile.vocab_size,
        max_model_len=profile.max_model_len or 0,
        role=profile.role,
        language_model_only=profile.language_model_only,
        multimodal_active=profile.multimodal_active,
        uses_mrope=profile.uses_mrope,
    )
    # optional: unset when the profile has none (0 is a valid token id).
    if profile.image_token_id is not None:
        info.image_token_id = profile.image_token_id
    if profile.video_token_id is not None:
        info.video_token_id = profile.video_token_id
    if profile.audio_token_id is not None:
        info.audio_token_id = profile.audio_token_id
    return info


# --------------------------------------------------------------------------- servicer


class AdmissionServicer(pb_grpc.AdmissionServicer):
    """The four RPCs of ``mmadmit.v1.Admission`` over one shared pool.

    The requests in flight on this replica are :attr:`admissions`
    (:class:`~mmadmit.admission.Admissions`, keyed ``(b"", request_id)``; all
    RPCs run on the one event loop, so it needs no lock): the ``Abort`` RPC
    cancels through it, a second request with an id already in flight is
    refused ``INVALID_REQUEST``, and every outcome is counted there once.
    """

    def __init__(
        self,
        pool: MaterializerPool,
        profile: ModelProfile,
        telemetry: Telemetry | None = None,
        *,
        max_stream_inflight: int | None = None,
    ) -> None:
        if max_stream_inflight is not None and max_stream_inflight < 1:
            raise ValueError("max_stream_inflight must be positive")
        self.max_stream_inflight = (
            max_stream_inflight if max_stream_inflight is not None else pool.max_inflight
        )
        self.limits = pool.materializer.limits  # the request deserializer counts against them
        self._pool = pool
        self._profile = profile
        self.telemetry = telemetry
        self.stats = ServicerStats()
        self.admissions = Admissions(
            pool,
            transport="grpc",
            telemetry=telemetry,
            scope="on this replica",
        )

    def requests_received(self) -> int:
        """Requests received so far (the port's sign of activity at shutdown)."""
        return self.stats.requests

    @property
    def inflight_ids(self) -> frozenset[str]:
        """Request ids admitted through this servicer and still without an outcome."""
        return self.admissions.rids()

    # ------------------------------------------------------------------ one request

    async def _admit_one(
        self, request: pb.AdmitRequest | StrippedRequest | RefusedRequest
    ) -> Response:
        """One request to one response; raises only ``CancelledError`` and ``AbortError``.

        ``request``: what the request deserializer made (``pbwire.parse_admit_request``).
        """
        t0 = time.perf_counter()
        self.stats.requests += 1
        admissions = self.admissions
        if isinstance(request, RefusedRequest):  # a limit, decided before protobuf parsed it
            rid = request.request_id
            abort = Abort(request.code, request.message)
            logger.debug("rid=%s: refused from its bytes: %s", rid, abort.message)
            return admissions.finish(rid, None, abort, t0, self._encoder(rid, False))
        msg = message_and_payloads(request)[0]
        rid = msg.request_id
        encode = self._encoder(rid, msg.echo_features)
        try:
            req = request_from_proto(request, self._profile, self.limits)
        except AdmissionError as exc:
            logger.debug("rid=%s: refused %s: %s", rid, exc.code.value, exc.message)
            return admissions.finish(rid, None, exc.to_abort(), t0, encode)
        except Exception as exc:  # noqa: BLE001 - a bug must still end in one outcome
            logger.exception("rid=%s: unexpected error while translating", rid)
            return admissions.finish(rid, None, abort_from_exception(exc), t0, encode)
        timeout_s = msg.timeout_ms / 1000 if msg.timeout_ms else None
        try:
            return await admissions.admit((b"", rid), req, encode, t0, timeout_s=timeout_s)
        except asyncio.CancelledError:
            # The client cancelled or its deadline passed: it can receive nothing more
            # (counted CANCELLED by the ladder).
            self.stats.calls_cancelled += 1
            logger.info("rid=%s: call cancelled or past its deadline; its work is cancelled", rid)
            raise

    def _encoder(self, rid: str, echo_features: bool) -> Callable[[Materialized | Abort], Response]:
        """The ladder's ``encode``: one outcome to its response bytes."""

        def encode(outcome: Materialized | Abort) -> Response:
            if isinstance(outcome, Abort):
                logger.debug("rid=%s: aborted %s: %s", rid, outcome.code.value, outcome.message)
                return abort_response(rid, outcome)
            logger.debug("rid=%s: materialized (%s)", rid, outcome.rule.value)
            return encode_response(rid, outcome, echo_features=echo_features)

        return encode

    # ------------------------------------------------------------------ RPCs

    async def Admit(  # noqa: N802 - the wire's method name
        self,
        request: pb.AdmitRequest | StrippedRequest | RefusedRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> Response:
        if isinstance(request, Undecodable):
            # Not a request outcome: the message has no request_id to answer to.
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the message does not parse as an AdmitRequest ({request.message})",
            )
            raise AssertionError("context.abort() raises")  # pragma: no cover
        return await self._admit_one(request)

    async def AdmitStream(  # noqa: N802
        self,
        request_iterator: AsyncIterator[
            pb.AdmitRequest | StrippedRequest | RefusedRequest | Undecodable
        ],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """Read requests while earlier ones run; write each outcome as soon as it is known.

        At most ``max_stream_inflight`` requests of one stream are outstanding
        (admitted, or answered but not yet written): past that the stream stops
        reading and gRPC flow control pushes back on the client. Only this
        coroutine writes (gRPC allows one write at a time).

        A message that does not parse, or is over the size limit, ends the stream
        (docs/spec/GRPC.md, "Limits and errors").
        """
        self.stats.streams += 1
        window = asyncio.Semaphore(self.max_stream_inflight)
        responses: asyncio.Queue[Response | None] = asyncio.Queue()
        workers: set[asyncio.Task[None]] = set()

        async def one(msg: pb.AdmitRequest | StrippedRequest | RefusedRequest) -> None:
            responses.put_nowait(await self._admit_one(msg))

        async def read_all() -> None:
            read_error: Exception | None = None
            try:
                try:
                    async for msg in request_iterator:
                        if isinstance(msg, Undecodable):
                            raise DecodeError(msg.message)
                        await window.acquire()
                        task = asyncio.create_task(one(msg))
                        workers.add(task)
                        task.add_done_callback(workers.discard)
                except Exception as exc:  # noqa: BLE001 - re-raised once the admitted are answered
                    read_error = exc
                if workers:
                    await asyncio.gather(*list(workers))
            finally:
                responses.put_nowait(None)  # the writer's end marker, whatever happened
            if read_error is not None:
                raise read_error

        reader = asyncio.create_task(read_all())
        try:
            while (resp := await responses.get()) is not None:
                await context.write(resp)
                window.release()
            try:
                await reader  # re-raises a read failure, once the admitted are answered
            except DecodeError as exc:
                # Not a request outcome: the message has no request_id to answer to.
                await context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"a message on this AdmitStream does not parse as an AdmitRequest ({exc}); "
                    "the stream ends here, earlier requests were answered",
                )
        finally:
            # Cancelled call (or a failed write): cancel what is still running; each
            # cancelled request cancels its pool ticket and counts itself.
            reader.cancel()
            for task in list(workers):
                task.cancel()
            pending = [reader, *workers]
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def Abort(  # noqa: N802
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        rid = request.request_id
        reason = request.reason or "no reason given"
        if not self.admissions.cancel(
            (b"", rid), AbortCode.CANCELLED, f"aborted by an Abort call: {reason}"
        ):
            return pb.AbortResponse(
                success=False, message=f"no request {rid!r} is in flight on this replica"
            )
        self.stats.aborts_requested += 1
        logger.info("rid=%s: aborted by an Abort call (%s)", rid, reason)
        return pb.AbortResponse(success=True, message=f"request {rid!r} cancelled")

    async def GetModelInfo(  # noqa: N802
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetModelInfoResponse:
        return model_info_from_profile(self._profile)


__all__ = [
    "MODALITY_FROM_PROTO",
    "MODALITY_TO_PROTO",
    "AdmissionServicer",
    "ServicerStats",
    "abort_response",
    "encode_response",
    "model_info_from_profile",
    "request_from_proto",
    "tensor_from_proto",
]
