"""The ZMQ msgpack wire (docs/spec/WIRE.md) as the client speaks it: its constants and codec.

The constants (message types, reply status bytes, the struct tag, element
indices, the tensor ext code and inline limit) are the one copy of them: the
service's codec (``mmadmit.wire``) imports them from here.

Scope: the client's side of the wire, numpy and ``msgspec`` only. It encodes a
:class:`~mmadmit_client.Request` as an ADD message, decodes a reply into an
:class:`~mmadmit_client.Outcome`, and decodes a captured ADD message into a
:class:`~mmadmit_client.Request` (``mmadmit-client`` replays ``.frames``
files). Limits and the detailed validation of untrusted input are the
service's business; here a payload that does not decode is a ``ValueError``
(:class:`WireFormatError`).

Nothing is lost in a round trip: a request decoded from frames keeps the raw
msgpack elements of every field the model does not carry (sampling
parameters, fields of a newer peer) in ``Request.wire_fields`` and
``Item.wire_elements``, and the aux frames they may point at keep their
indices; tensors added since are appended. In what it decodes, only
extension type 3 (tensor data) is accepted: pickle (1, 2) and unknown types
are refused; what it passes through stays raw bytes, never decoded (the
service checks every element of what it receives).

Buffers: tensors at or above :data:`INLINE_LIMIT_BYTES` go out as aux frames
without a copy (the caller must not change them until sent); decoded tensors
are views on the received frames.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from ._models import (
    Aborted,
    Item,
    Materialized,
    MaterializedItem,
    Outcome,
    Request,
    ShmFeature,
    Tensor,
)

MSG_ADD = 0x00
MSG_ABORT = 0x01
STATUS_MATERIALIZED = 0x00
STATUS_ABORTED = 0x01

TAG = "TokenizedGenerateReqInput"
EXT_TENSOR_DATA = 3
INLINE_LIMIT_BYTES = 256  # the reference encoder inlines tensors below this size

# TokenizedGenerateReqInput element indices
F_RID = 1
F_INPUT_IDS = 4
F_SAMPLING = 5
F_UNPADDED = 21
F_MM = 22
F_VALIDATION_ERROR = 23
N_FIELDS = 24

# Defaults of the typed fields, for elements a shorter array leaves out and for
# a request built here (a scheduler's typed decoder rejects nil for them).
FIELD_DEFAULTS: dict[int, Any] = {
    6: False,  # return_logprob
    7: -1,  # logprob_start_len
    8: 0,  # top_logprobs_num
    10: False,  # stream
    14: False,  # return_hidden_states
    15: 0.0,  # created_time
}
MM_FIELDS = 7  # MultimodalInputs
ITEM_FIELDS = 10  # MultimodalDataItem

# Modality numbers of the msgpack wire (the gRPC enum differs)
MODALITY_NUMBERS = {"image": 1, "video": 2, "audio": 3}
MODALITY_OF_NUMBER = {v: k for k, v in MODALITY_NUMBERS.items()}


class WireFormatError(ValueError):
    """A message that does not decode as docs/spec/WIRE.md describes it."""


@dataclass(frozen=True)
class _Inline:
    data: bytes


def ext_refusal(code: int) -> str:
    """Why a msgpack ext type other than tensor data is refused (both codecs' wording)."""
    if code in (1, 2):
        return f"msgpack ext type {code} (pickle) is never accepted"
    return f"unknown msgpack ext type {code}"


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_TENSOR_DATA:
        return _Inline(bytes(data))  # the view is only valid during the hook
    raise WireFormatError(ext_refusal(code))


_ELEMENTS = msgspec.msgpack.Decoder(list[msgspec.Raw])
_VALUE = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
_ENC = msgspec.msgpack.Encoder()
_ID_LIST = msgspec.msgpack.Decoder(list[int])


@dataclass(frozen=True, eq=False)
class WireFields:
    """What a request decoded from frames keeps of them (``Request.wire_fields``)."""

    elements: list[msgspec.Raw]  # the payload's elements, raw
    mm_elements: list[msgspec.Raw]  # MultimodalInputs' elements, raw (empty: none)
    aux: list[memoryview]  # the aux frames, as views (tensors decoded are views on them)
    sources: list[Any]  # the aux frames as received (sent again as those very objects)
    ints: tuple[tuple[np.ndarray, msgspec.Raw], ...]  # decoded arrays and their bytes
    delta: int | None = None  # the M-RoPE delta decoded


# --------------------------------------------------------------------------- decode


def _view(frame: Any) -> memoryview:
    return memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")


def _split(raw: Any, what: str) -> list[msgspec.Raw]:
    try:
        return _ELEMENTS.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
        raise WireFormatError(f"{what} must be a msgpack array ({exc})") from exc


def _value(raw: Any, what: str) -> Any:
    try:
        return _VALUE.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise WireFormatError(f"{what}: {exc}") from exc


def _opt_int(value: Any, what: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise WireFormatError(f"{what} must be an integer or nil, got {type(value).__name__}")


def _ids(raw: msgspec.Raw, what: str) -> np.ndarray:
    try:
        return np.array(_ID_LIST.decode(raw), dtype=np.int64)
    except (msgspec.DecodeError, msgspec.ValidationError, OverflowError) as exc:
        raise WireFormatError(f"{what} must be an array of int64 token ids ({exc})") from exc


def _tensor(value: Any, aux: list[memoryview], what: str) -> Tensor:
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[1], list)):
        raise WireFormatError(f"{what} must be a tensor [dtype, shape, data]")
    dtype, shape, data = value
    if isinstance(data, _Inline):
        buf: bytes | memoryview = data.data
    elif isinstance(data, int) and not isinstance(data, bool) and 1 <= data <= len(aux):
        buf = aux[data - 1]
    else:
        raise WireFormatError(f"{what}: data must be inline bytes or an aux frame index")
    try:
        return Tensor(dtype, tuple(shape), buf)
    except (TypeError, ValueError) as exc:
        raise WireFormatError(f"{what}: {exc}") from exc


def _is_tensor(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)


def _item(
    raw: msgspec.Raw, aux: list[memoryview], what: str, tokens: dict[str, int | None]
) -> Item:
    elems = _split(raw, what)
    values = [_value(e, what) for e in elems[:10]]
    values += [None] * (10 - len(values))
    modality, hsh, pad, offsets, feature, shm, side, _, _, handshake = values
    if handshake is not None and not isinstance(handshake, dict):
        raise WireFormatError(f"{what}: encode_handshake must be nil or a map")
    if not isinstance(modality, int) or isinstance(modality, bool):
        raise WireFormatError(f"{what}: modality must be an integer")
    try:
        spans = np.array(offsets if offsets is not None else [], dtype=np.int64).reshape(-1, 2)
    except (TypeError, ValueError, OverflowError) as exc:
        raise WireFormatError(f"{what}: offsets must be [start, end] pairs") from exc
    feat: Tensor | ShmFeature | None = None
    if feature is not None:
        feat = _tensor(feature, aux, f"{what} feature")
    elif isinstance(shm, dict) and isinstance(shm.get("shm_name"), str):
        feat = ShmFeature(
            shm["shm_name"],
            tuple(shm.get("shape") or ()),
            shm.get("dtype") or "",
        )
    tensors = {
        k: _tensor(v, aux, f"{what} {k}")
        for k, v in (side or {}).items()
        if isinstance(k, str) and _is_tensor(v)
    }
    name = MODALITY_OF_NUMBER.get(modality)
    try:
        return Item(
            modality if name is None else name,  # type: ignore[arg-type]
            spans,
            feat,
            _opt_int(hsh, f"{what} hash"),
            _opt_int(pad, f"{what} pad_value"),
            tensors,
            placeholder_token_id=None if name is None else tokens.get(name),
            encode_handshake=handshake,
            wire_elements=tuple(elems),
        )
    except (TypeError, ValueError) as exc:
        raise WireFormatError(f"{what}: {exc}") from exc


def decode_request(payload: Any, aux_frames: Sequence[Any] = ()) -> Request:
    """A ``TokenizedGenerateReqInput`` payload (and its aux frames) as a :class:`Request`."""
    sources = list(aux_frames)
    aux = [_view(f) for f in sources]
    elems = _split(_view(payload), "the payload")
    if len(elems) <= F_INPUT_IDS or _value(elems[0], "the tag") != TAG:
        raise WireFormatError(f"the payload is not a tagged {TAG}")
    rid = _value(elems[F_RID], "rid")
    if not isinstance(rid, str):
        raise WireFormatError("rid must be a string")
    ids = _ids(elems[F_INPUT_IDS], "input_ids")
    ints = [(ids, elems[F_INPUT_IDS])]
    unpadded = None
    if len(elems) > F_UNPADDED and _value(elems[F_UNPADDED], "input_ids_unpadded") is not None:
        unpadded = _ids(elems[F_UNPADDED], "input_ids_unpadded")
        ints.append((unpadded, elems[F_UNPADDED]))
    error = _value(elems[F_VALIDATION_ERROR], "validation_error") if len(elems) > 23 else None
    if error is not None and not isinstance(error, str):
        raise WireFormatError("validation_error must be a string or nil")
    mm_elems: list[msgspec.Raw] = []
    items: list[Item] = []
    positions: np.ndarray | None = None
    delta: Any = None
    multimodal = len(elems) > F_MM and _value(elems[F_MM], "multimodal_inputs") is not None
    if multimodal:
        mm_elems = _split(elems[F_MM], "multimodal_inputs")
        head: list[Any] = [_value(e, "multimodal_inputs") for e in mm_elems[1:6]]
        im, video, pos, delta_t, delta = head + [None] * (5 - len(head))
        raw_items = _split(mm_elems[0], "mm_items") if mm_elems else []
        tokens = {"image": _opt_int(im, "im_token_id"), "video": _opt_int(video, "video_token_id")}
        items = [_item(raw, aux, f"item {i}", tokens) for i, raw in enumerate(raw_items)]
        if pos is not None:
            positions = _tensor(pos, aux, "mrope_positions").to_numpy()
            if positions.dtype != np.int64:
                raise WireFormatError("mrope_positions must be int64")
            ints.append((positions, mm_elems[3]))
        if delta is None and delta_t is not None:
            values = _tensor(delta_t, aux, "mrope_position_delta").to_numpy().reshape(-1)
            delta = int(values[0]) if values.size == 1 else None
        delta = _opt_int(delta, "mrope_position_delta_scalar")
    return Request(
        rid,
        ids,
        tuple(items),
        input_ids_unpadded=unpadded,
        mrope_positions=positions,
        mrope_position_delta=delta,
        multimodal=multimodal,
        validation_error=error,
        wire_fields=WireFields(elems, mm_elems, aux, sources, tuple(ints), delta),
    )


def decode_add(frames: Sequence[Any]) -> Request:
    """A captured ADD message ``[0x00, payload, *aux]`` as a :class:`Request`."""
    if len(frames) < 2 or bytes(frames[0]) != bytes([MSG_ADD]):
        raise WireFormatError("an ADD message is [0x00, payload, *aux]")
    return decode_request(frames[1], frames[2:])


def recover_rid(payload: Any) -> str:
    """The request id of a payload that may not decode otherwise ("" if unreadable)."""
    try:
        elems = _ELEMENTS.decode(_view(payload))
        rid = _VALUE.decode(elems[F_RID]) if len(elems) > F_RID else ""
    except Exception:  # noqa: BLE001 - anything unreadable has no rid
        return ""
    return rid if isinstance(rid, str) else ""


def parse_validation_error(text: str) -> tuple[str, str]:
    """``"CODE: message"`` -> (code, message); text without a code is INVALID_REQUEST."""
    code, sep, message = text.partition(": ")
    if sep and code.isupper() and code.replace("_", "").isalpha():
        return code, message
    return "INVALID_REQUEST", text


def outcome_from_request(status: int, req: Request, frames: list[Any]) -> Outcome:
    """The outcome a decoded reply payload stands for."""
    if status == STATUS_ABORTED:
        code, message = parse_validation_error(req.validation_error or "")
        return Aborted(req.request_id, code, message, frames)
    items = tuple(
        MaterializedItem(
            str(it.modality),
            it.hash,
            it.pad_value,
            it.offsets,
            it.feature,
            it.side,
            it.encode_handshake,
        )
        for it in req.items
    )
    return Materialized(
        req.request_id,
        req.input_ids,
        req.input_ids_unpadded,
        items,
        req.mrope_positions,
        req.mrope_position_delta,
        None,
        frames,
    )


def decode_reply(frames: Sequence[Any]) -> tuple[str, Outcome | WireFormatError]:
    """A reply ``[status, payload, *aux]`` as (rid, outcome), or (rid if readable, the error)."""
    frames = list(frames)
    if len(frames) < 2:
        return "", WireFormatError(f"a reply needs at least 2 frames, got {len(frames)}")
    status = bytes(_view(frames[0]))
    try:
        req = decode_request(frames[1], frames[2:])
    except WireFormatError as exc:
        return recover_rid(frames[1]), exc
    if status not in (bytes([STATUS_MATERIALIZED]), bytes([STATUS_ABORTED])):
        return req.request_id, WireFormatError(
            f"unknown reply status byte {status.hex() or '(empty)'}"
        )
    return req.request_id, outcome_from_request(status[0], req, frames)


# --------------------------------------------------------------------------- encode


class TensorWriter:
    """Tensors as ``[dtype, shape, data]``: inline below :data:`INLINE_LIMIT_BYTES`,
    else an aux frame. ``aux``: the received aux frames, which keep their indices
    (a buffer is found by identity); a new buffer is appended. ``frames`` is the
    aux frame list to send. The service's codec writes its tensors with it too."""

    def __init__(self, aux: list[Any]) -> None:
        self.frames: list[Any] = list(aux)
        # id -> 1-based index, built in C (a comprehension cost ~1K instructions a frame)
        n = len(self.frames)
        self._index = dict(zip(map(id, self.frames), range(1, n + 1), strict=True))

    def encode(self, dtype: str, shape: Sequence[int], data: Any) -> list[Any]:
        nbytes = data.nbytes if type(data) is memoryview else memoryview(data).nbytes
        if nbytes < INLINE_LIMIT_BYTES:
            value: Any = msgspec.msgpack.Ext(EXT_TENSOR_DATA, bytes(data))
        else:
            value = self._index.get(id(data))
            if value is None:  # a new tensor (e.g. computed positions): appended
                self.frames.append(data)
                value = self._index[id(data)] = len(self.frames)
        return [dtype, list(shape), value]


def _tensor_value(writer: TensorWriter, t: Tensor) -> list[Any]:
    return writer.encode(t.dtype, t.shape, t.data)


def _ids_raw(fields: WireFields | None, values: np.ndarray) -> Any:
    """The received bytes of an array still the very one decoded, else its values."""
    for decoded, raw in fields.ints if fields is not None else ():
        if decoded is values:
            return raw
    return values.tolist()


def _padded(elements: Sequence[Any], n: int, defaults: dict[int, Any]) -> list[Any]:
    return [
        elements[i] if i < len(elements) else defaults.get(i) for i in range(max(n, len(elements)))
    ]


def _encode_item(item: Item, writer: TensorWriter, drop_feature: bool) -> list[Any]:
    out = _padded(item.wire_elements or (), ITEM_FIELDS, {6: {}})
    modality = item.modality
    out[0] = MODALITY_NUMBERS[modality] if isinstance(modality, str) else modality
    out[1] = item.hash
    out[2] = item.pad_value
    out[3] = item.offsets.tolist()
    feature = None if drop_feature else item.feature
    out[4] = _tensor_value(writer, feature) if isinstance(feature, Tensor) else None
    if isinstance(item.feature, ShmFeature) and item.wire_elements is None:
        s = item.feature
        out[5] = {"shm_name": s.name, "shape": list(s.shape), "dtype": s.dtype}
    if item.side or item.wire_elements is None:
        out[6] = {k: _tensor_value(writer, v) for k, v in item.side.items()}
    if item.encode_handshake is not None or item.wire_elements is None:
        out[9] = None if item.encode_handshake is None else dict(item.encode_handshake)
    return out


def _feature_frames(req: Request) -> set[int]:
    """The aux indices the received items' features point at."""
    return {
        i + 1
        for it in req.items
        if isinstance(it.feature, Tensor)
        for i, f in enumerate(req.wire_fields.aux)
        if f is it.feature.data
    }


def encode_request(
    req: Request, *, validation_error: str | None = None, drop_features: bool = False
) -> list[Any]:
    """``[payload, *aux]``: the frames after the type (or status) byte.

    ``drop_features`` writes the items without their features (blanking the
    received aux frames they used, so other indices stay valid), as an abort
    reply carries them; ``validation_error`` marks the request invalid.
    """
    fields = req.wire_fields if isinstance(req.wire_fields, WireFields) else None
    aux: list[Any] = list(fields.aux) if fields is not None else []
    if drop_features and fields is not None:
        blank = _feature_frames(req)
        aux = [b"" if i + 1 in blank else f for i, f in enumerate(aux)]
    writer = TensorWriter(aux)
    out = _padded(fields.elements if fields is not None else (), N_FIELDS, FIELD_DEFAULTS)
    out[0] = TAG
    out[F_RID] = req.request_id
    out[F_INPUT_IDS] = _ids_raw(fields, req.input_ids)
    if fields is None:
        out[F_SAMPLING] = []
    out[F_UNPADDED] = (
        None if req.input_ids_unpadded is None else _ids_raw(fields, req.input_ids_unpadded)
    )
    mm = None
    if req.multimodal:
        mm = _padded(fields.mm_elements if fields is not None else (), MM_FIELDS, {})
        mm[0] = [_encode_item(it, writer, drop_features) for it in req.items]
        for key, name in ((1, "image"), (2, "video")):
            # the request-wide override: its items' (gRPC's form), else as received
            tokens = [it.placeholder_token_id for it in req.items if it.modality == name]
            token = next((t for t in tokens if t is not None), None)
            if token is not None or fields is None:
                mm[key] = token
        positions = req.mrope_positions
        if positions is None:
            mm[3] = None
        else:
            raw = _ids_raw(fields, positions)
            mm[3] = (
                raw
                if isinstance(raw, msgspec.Raw)
                else _tensor_value(writer, Tensor.from_numpy(positions))
            )
        delta = req.mrope_position_delta
        if fields is None or delta != fields.delta:  # else: as received
            mm[4] = (
                None
                if delta is None
                else _tensor_value(writer, Tensor.from_numpy(np.full((1, 1), delta)))
            )
            mm[5] = delta
    out[F_MM] = mm
    out[F_VALIDATION_ERROR] = (
        validation_error if validation_error is not None else req.validation_error
    )
    frames = writer.frames
    if fields is not None:
        for i, (view, source) in enumerate(zip(fields.aux, fields.sources, strict=False)):
            if frames[i] is view:  # still the received frame: send that very object
                frames[i] = source
    return [_ENC.encode(out), *frames]


def encode_add(req: Request) -> list[Any]:
    """The ADD message ``[0x00, payload, *aux]``."""
    return [bytes([MSG_ADD]), *encode_request(req)]


def encode_abort(request_ids: Sequence[str]) -> list[bytes]:
    """The ABORT message ``[0x01, msgpack array of request ids]`` (no reply of its own)."""
    return [bytes([MSG_ABORT]), _ENC.encode(list(request_ids))]


def encode_reply(outcome: Outcome, sent: Request) -> list[Any]:
    """The reply-mode frames ``[status, payload, *aux]`` the service sends for ``sent``
    with ``outcome``: the request as sent with the outcome's derived fields applied
    (an abort: ``validation_error`` set, features removed)."""
    if isinstance(outcome, Aborted):
        payload = encode_request(
            sent, validation_error=f"{outcome.code}: {outcome.message}", drop_features=True
        )
        return [bytes([STATUS_ABORTED]), *payload]
    ids = sent.input_ids if np.array_equal(outcome.input_ids, sent.input_ids) else outcome.input_ids
    unpadded = outcome.input_ids_unpadded
    if unpadded is None:
        unpadded = sent.input_ids_unpadded
    elif sent.input_ids_unpadded is not None and np.array_equal(unpadded, sent.input_ids_unpadded):
        unpadded = sent.input_ids_unpadded
    elif np.array_equal(unpadded, sent.input_ids):
        unpadded = sent.input_ids  # re-emitted from its received bytes
    items = sent.items
    if len(outcome.items) == len(items):
        items = tuple(
            dataclasses.replace(it, hash=got.hash, pad_value=got.pad_value)
            for it, got in zip(items, outcome.items, strict=True)
        )
    elif not outcome.items:
        items = ()  # dropped (the decode-side exemption)
    req = Request(
        sent.request_id,
        ids,
        items,
        input_ids_unpadded=unpadded,
        mrope_positions=(
            outcome.mrope_positions if outcome.mrope_positions is not None else sent.mrope_positions
        ),
        mrope_position_delta=(
            outcome.mrope_position_delta
            if outcome.mrope_position_delta is not None
            else sent.mrope_position_delta
        ),
        multimodal=sent.multimodal,
        wire_fields=sent.wire_fields,
    )
    return [bytes([STATUS_MATERIALIZED]), *encode_request(req)]


__all__ = [
    "EXT_TENSOR_DATA",
    "F_INPUT_IDS",
    "F_MM",
    "F_RID",
    "F_SAMPLING",
    "F_UNPADDED",
    "F_VALIDATION_ERROR",
    "FIELD_DEFAULTS",
    "INLINE_LIMIT_BYTES",
    "ITEM_FIELDS",
    "MM_FIELDS",
    "MODALITY_NUMBERS",
    "MSG_ABORT",
    "MSG_ADD",
    "N_FIELDS",
    "TensorWriter",
    "STATUS_ABORTED",
    "STATUS_MATERIALIZED",
    "TAG",
    "WireFields",
    "WireFormatError",
    "decode_add",
    "decode_reply",
    "decode_request",
    "encode_abort",
    "encode_add",
    "encode_reply",
    "encode_request",
    "ext_refusal",
    "outcome_from_request",
    "parse_validation_error",
    "recover_rid",
]
