"""The ZMQ msgpack wire of SMG / TokenSpeed (docs/spec/WIRE.md): frames <-> internal model.

Scope: pure codec, no sockets. A message is ``[type, payload, aux_1, ...]``;
the payload is a positional msgpack array (``TokenizedGenerateReqInput``).

How it stays fast and loses nothing:

* One call decodes an ADD (:func:`mmadmit.intcodec.decode_add`): one walk
  splits the payload into its elements (zero-copy views of the received
  frame, one :class:`msgspec.Raw` each) and decodes the token-id arrays
  (``input_ids``, ``input_ids_unpadded``) into int64 numpy arrays on the way,
  never through per-token Python ints; the same call checks the limits, the
  tag and the rid and builds the items.
  Elements mmadmit does not interpret keep their raw bytes and are re-emitted
  verbatim (docs/spec/WIRE.md, "Encoding rules": longer and shorter arrays).
* A token array the request still holds as the very object decoded from the
  wire is re-emitted from its received bytes instead of being re-encoded
  (``input_ids`` of a text request or a passthrough, ``input_ids_unpadded``
  = the received ``input_ids`` after substitution). mmadmit never writes a
  decoded array in place (the materializer substitutes into a copy); code that
  changes token ids must assign a new array, which is then encoded. The padded
  ids the materializer made are written from its :class:`~mmadmit.model.Padding`
  (:func:`~mmadmit.intcodec.encode_int_array_filled`): the received
  ``input_ids`` bytes with only the pad runs written, neither array read.
* One decode path per message kind, whatever its size: an ADD by that call,
  whose walk over ``mm_items`` (:func:`mmadmit.msgpack_walk.build_items`)
  takes every legal item and words its own refusals (which item, which field
  or tensor) as it reads, then reads every item's offsets in one table; an
  ABORT by one typed ``list[str]`` decode. An item that changed only in ``hash`` /
  ``pad_value`` (what materialization does) is re-emitted as its received
  bytes with those two elements replaced.
* Tensors are :class:`~mmadmit.model.Tensor` views, each built in one place
  (:meth:`_TensorReader.build`), which checks dtype, shape, byte length and
  the limits once: inline data (ext code 3, < 256 bytes) or a ``memoryview``
  on the received aux frame. Re-encoding hands back, for every received aux
  frame still referenced, the very object it arrived in (a ``zmq.Frame``:
  libzmq then shares the received message instead of wrapping a Python
  buffer), so feature bytes are never copied by mmadmit. Ownership: the
  received frames are kept alive by the request referencing them; a buffer
  given to the transport for sending is never written afterwards.
* Every element that is not a token array is decoded by a decoder whose
  ext hook refuses every extension type but 3 (docs/spec/WIRE.md, "Encoding rules").
* Limits (:mod:`mmadmit.limits`) are decided before the decode they guard:
  the payload's length from its header, each token array's length from its
  header before its int64 buffer exists, every other element's container
  lengths and nesting depth by a walk over headers only
  (:func:`mmadmit.msgpack_walk.check_structure`) before ``msgspec`` sees it, the
  item count from its header, each tensor's rank, dimensions and bytes from
  its shape before the byte check, an ABORT's id count from its header. Every
  breach is worded by :mod:`mmadmit.limits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import msgspec
import numpy as np
import zmq
from mmadmit_client.wire import (
    EXT_TENSOR_DATA,
    F_INPUT_IDS,
    F_MM,
    F_RID,
    F_SAMPLING,
    F_UNPADDED,
    F_VALIDATION_ERROR,
    FIELD_DEFAULTS,
    ITEM_FIELDS,
    MM_FIELDS,
    MSG_ABORT,
    MSG_ADD,
    N_FIELDS,
    STATUS_ABORTED,
    STATUS_MATERIALIZED,
    TAG,
    TensorWriter,
    ext_refusal,
)

from .errors import Abort, AbortCode, AdmissionError, InvalidRequest
from .intcodec import (
    array_len,
    decode_add,
    element_span,
    encode_int_array,
    encode_int_array_filled,
    encoded_bound,
    splice_items,
)
from .limits import (
    DEFAULT_LIMITS,
    Limits,
    abort_ids_over,
)
from .model import (
    Item,
    Materialized,
    MultimodalInputs,
    Padding,
    Request,
    ShmHandle,
    Tensor,
    check_shm_name,
)
from .tensorcheck import TensorName

# The wire's constants are the client's (one copy, mmadmit_client.wire).
_FIELD_DEFAULTS = FIELD_DEFAULTS

_MM_FIELDS = MM_FIELDS
_ITEM_FIELDS = ITEM_FIELDS
# Defaults of MultimodalInputs / MultimodalDataItem fields a shorter array
# leaves out: nil, except model_specific_data, a map.
_MM_DEFAULTS: dict[int, Any] = {}
_ITEM_DEFAULTS: dict[int, Any] = {6: {}}
# an item's fields between model_specific_data and encode_handshake (the model keeps
# neither)
_ITEM_UNSET = (None,) * (_ITEM_FIELDS - 8)  # 7 encoded, 8 encoded_deepstack


class WireError(InvalidRequest):
    """A message that does not decode, or breaks a limit (``code`` TOO_LARGE);
    ``rid`` is what could be recovered ("" if nothing)."""

    def __init__(
        self, message: str, rid: str = "", code: AbortCode = AbortCode.INVALID_REQUEST
    ) -> None:
        super().__init__(message)
        self.rid = rid
        self.code = code


@dataclass(frozen=True)
class _InlineData:
    data: bytes


def _ext_hook(code: int, data: memoryview) -> Any:
    if code == EXT_TENSOR_DATA:
        # msgspec only guarantees the view for the hook's duration: copy (< 256 bytes).
        return _InlineData(bytes(data))
    raise InvalidRequest(ext_refusal(code))


_SPLIT = msgspec.msgpack.Decoder(list[msgspec.Raw])
_ANY = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
# what the ingest receives: a flat byte buffer. memoryview(frame) is its view; a
# frame's .buffer is the same view, made and kept behind a weak reference on first
# use (measured 15 against 10 us for the 130 aux frames of a 128-item request)
_Frame: Any = zmq.Frame  # Any: pyzmq types Frame as no buffer
_ENC = msgspec.msgpack.Encoder()


def _split(raw: msgspec.Raw | bytes | memoryview, what: str) -> list[msgspec.Raw]:
    """The elements of an array inside the payload (``multimodal_inputs``, an item),
    whose structure the payload's walk has checked: one ``msgspec`` call."""
    try:
        return _SPLIT.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise InvalidRequest(f"{what} must be a msgpack array ({exc})") from exc


def _value(raw: msgspec.Raw | memoryview, what: str) -> Any:
    """Any msgpack value (ext 3 as inline data); a refusal names ``what``."""
    try:
        return _ANY.decode(raw)
    except InvalidRequest as exc:  # the ext hook: pickle or an unknown ext code
        raise InvalidRequest(f"{what}: {exc.message}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"{what}: undecodable msgpack ({exc})") from exc
    except RecursionError as exc:
        raise InvalidRequest(f"{what}: undecodable msgpack (nested too deeply)") from exc


def _is_nil(raw: msgspec.Raw) -> bool:
    return len(raw) == 1 and bytes(raw) == b"\xc0"


def _opt_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{what} must be an integer, got {type(value).__name__}")
    return value


# --------------------------------------------------------------------------- decode


@dataclass
class WireExtra:
    """What the codec keeps to re-encode a request: raw elements and aux frames.

    ``ints``: each token array decoded from the wire with its received bytes
    and its marks (:func:`~mmadmit.intcodec.split_array`, or None); a request
    that still holds that very array object re-emits those bytes, an array
    made from it (the padded ids) reuses them where it is unchanged.
    ``payload`` and ``offsets``: the received payload and its elements' offsets
    (``raw[i]`` is ``payload[offsets[i]:offsets[i + 1]]``), which re-emit the
    elements the encoder does not write as slices of it (None: built otherwise).
    ``raw`` is then only those bytes again, never edited: a codec that needs
    other elements builds a ``WireExtra`` without a payload (as the SMG face does).
    """

    raw: list[msgspec.Raw]
    aux: list[memoryview]
    feature_aux: set[int] = field(default_factory=set)  # aux indices used by features only
    ints: list[tuple[np.ndarray, msgspec.Raw, np.ndarray | None]] = field(default_factory=list)
    sources: list[Any] = field(default_factory=list)  # the objects ``aux`` views came in
    payload: memoryview | None = None
    offsets: list[int] | None = None


@dataclass
class WireMessage:
    """A decoded message: an ADD (``request``) or an ABORT (``abort_rids``)."""

    kind: int
    request: Request | None = None
    abort_rids: list[str] = field(default_factory=list)


def _as_buffer(frame: Any) -> memoryview:
    if type(frame) is _Frame:
        return memoryview(frame)  # already a flat byte view
    # a zmq.Frame subclass exposes .buffer; bytes / memoryview work directly.
    buf = getattr(frame, "buffer", frame)
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class _TensorReader:
    """Builds the request's tensors on its aux frames and records what each frame held."""

    def __init__(self, aux: list[memoryview], limits: Limits = DEFAULT_LIMITS) -> None:
        self.aux = aux
        self.features: set[int] = set()  # aux indices a feature refers to
        self.others: set[int] = set()  # aux indices any other tensor refers to
        self.limits = limits

    def feature_only(self) -> set[int]:
        """The aux indices that only features refer to (blanked when features are dropped)."""
        return self.features - self.others

    def build(self, dtype: Any, shape: Any, data: Any, name: Any, role: str) -> Tensor:
        """The one place a received tensor is made: its data resolved (inline bytes or an
        aux frame), everything else checked by :class:`~mmadmit.model.Tensor`. ``name``:
        a :class:`TensorName` or its ``(item, key)`` pair."""
        if type(data) is int:  # never a bool (type(), not isinstance)
            aux = self.aux
            if not 0 < data <= len(aux):
                raise InvalidRequest(
                    f"{TensorName(*name)}: data refers to aux frame {data}, but the message "
                    f"has {len(aux)} aux frame(s)"
                )
            buf: Any = aux[data - 1]
            (self.features if role == "feature" else self.others).add(data)
        elif type(data) is _InlineData:
            buf = memoryview(data.data)
        else:
            raise InvalidRequest(
                f"{TensorName(*name)}: data must be ext type 3 or an aux frame index"
            )
        return Tensor(dtype, shape, buf, name, self.limits)

    def tensor(self, value: Any, item: int | None, key: str, role: str) -> Tensor:
        """A tensor from a decoded value ``[dtype, shape, data]``; errors name
        ``item <item> <key>`` (or just ``key``)."""
        if not isinstance(value, (list, tuple)) or len(value) != 3:
            raise InvalidRequest(f"{TensorName(item, key)} must be a tensor [dtype, shape, data]")
        return self.build(value[0], value[1], value[2], (item, key), role)


def _decode_shm(value: Any, what: str) -> ShmHandle | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("shm_name"), str):
        raise InvalidRequest(f"{what}: feature_shm must be a map with a string shm_name")
    check_shm_name(value["shm_name"], f"{what} feature_shm")
    shape = value.get("shape")
    dtype = value.get("dtype")
    return ShmHandle(
        name=value["shm_name"],
        shape=tuple(shape) if isinstance(shape, (list, tuple)) else None,
        dtype=dtype if isinstance(dtype, str) else None,
    )


_NO_SIDE: dict[str, Any] = {}  # an item decoded without side values (compared, never changed)


class _ItemSrc(msgspec.Struct, gc=False):
    """Where a received MultimodalDataItem came from (an :class:`Item`'s ``extra``).

    The item is ``buf[start:end]``, an array of ``count`` elements whose
    element 1 (hash) starts at ``off1`` and element 3 (offsets) at ``off3``;
    ``aux`` is the received aux frame list its tensor indices refer to.
    ``modality``, ``feature`` and ``side`` (a copy of the dict) are what was
    decoded from it. An item with all 10 fields whose modality, feature and
    side dict are still those (tensors cannot change: identity says it),
    re-encoded with the request it was decoded in (the same ``aux``), is
    re-emitted as its received bytes with elements 1 and 2 replaced
    (:func:`mmadmit.msgpack_walk.splice_items`, which states the rule): its
    tensors keep their aux indices (received frames keep theirs) and their
    inline data, every other element its bytes.
    """

    buf: memoryview
    aux: list[memoryview]
    start: int
    end: int
    count: int
    off1: int
    off3: int
    modality: int
    feature: Tensor | None
    side: dict[str, Any]
    raw_elems: list[msgspec.Raw] | None = None

    def elems(self) -> list[msgspec.Raw]:
        """The raw elements, for the general re-encode."""
        if self.raw_elems is None:
            self.raw_elems = _split(self.buf[self.start : self.end], "item")
        return self.raw_elems


def _decode_mm(buf: memoryview, parts: tuple[Any, ...], reader: _TensorReader) -> MultimodalInputs:
    """``multimodal_inputs`` from what the walk made of it (``parts``: its elements'
    offsets in ``buf``, its items built, the aux indices their tensors refer to):
    the scalars and position tensors decoded here."""
    offsets, items, features, others = parts
    elems = [msgspec.Raw(buf[a:b]) for a, b in pairwise(offsets)]
    reader.features.update(features)
    reader.others.update(others)
    vals = [_value(r, "multimodal_inputs") for r in elems[1:_MM_FIELDS]]
    for extra_raw in elems[_MM_FIELDS:]:
        _value(extra_raw, "multimodal_inputs")
    vals += [None] * (_MM_FIELDS - 1 - len(vals))
    positions = vals[2]
    delta = vals[3]
    return MultimodalInputs(
        items=items,
        im_token_id=_opt_int(vals[0], "im_token_id"),
        video_token_id=_opt_int(vals[1], "video_token_id"),
        mrope_positions=None
        if positions is None
        else reader.tensor(positions, None, "mrope_positions", "positions"),
        mrope_position_delta=None
        if delta is None
        else reader.tensor(delta, None, "mrope_position_delta", "delta"),
        mrope_position_delta_scalar=_opt_int(vals[4], "mrope_position_delta_scalar"),
        extra=elems,
    )


_STR = msgspec.msgpack.Decoder(str)


def recover_rid(payload: Any) -> str:
    """Best effort: the rid of a payload that failed to decode ("" if unreadable).

    One probe: element 1 of a payload that is one well-formed msgpack array
    (:func:`mmadmit.intcodec.element_span`: any nesting depth, nothing allocated
    by the payload's size).
    """
    try:
        buf = _as_buffer(payload)
        start, end = element_span(buf, F_RID)
        return _STR.decode(buf[start:end])
    except Exception:  # noqa: BLE001 - any failure means "no rid"
        return ""


def decode_request(payload: Any, aux_frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> Request:
    """Decode an ADD payload and its aux frames; :class:`WireError` names what is wrong
    (its ``code`` TOO_LARGE for a breach of ``limits``, else INVALID_REQUEST).

    One walk (:func:`mmadmit.intcodec.decode_add`) splits the payload, decodes
    its token arrays, checks every element against the limits, the tag and the
    rid, and builds the items; what is left here are the few small values."""
    buf = _as_buffer(payload)
    # a received zmq.Frame's byte view (what _as_buffer returns), without a call each
    aux = [memoryview(f) if type(f) is _Frame else _as_buffer(f) for f in aux_frames]
    reader = _TensorReader(aux, limits)
    marks: list[Any] = [None, None]
    env = (aux, Tensor, Item, _ItemSrc, _NO_SIDE, _value, reader.tensor, _decode_shm)
    try:
        offsets, ints, rid, mm_parts = decode_add(buf, limits, marks, env, WireError)
    except WireError:
        raise
    except AdmissionError as exc:  # InvalidRequest, TooLarge: before the rid is known
        raise WireError(exc.message, recover_rid(buf), exc.code) from exc
    elems = [msgspec.Raw(buf[a:b]) for a, b in pairwise(offsets)]
    input_ids = ints[0]
    decoded = [(input_ids, elems[F_INPUT_IDS], marks[0])]
    unpadded = None
    if len(elems) > F_UNPADDED and not _is_nil(elems[F_UNPADDED]):
        unpadded = ints[1]
        decoded.append((unpadded, elems[F_UNPADDED], marks[1]))
    try:
        mm = None
        if mm_parts is not None:
            mm = _decode_mm(buf, mm_parts, reader)
        verr = None
        if len(elems) > F_VALIDATION_ERROR:
            verr = _value(elems[F_VALIDATION_ERROR], "validation_error")
            if verr is not None and not isinstance(verr, str):
                raise InvalidRequest("validation_error must be nil or a string")
    except AdmissionError as exc:  # InvalidRequest, TooLarge
        raise WireError(exc.message, rid, exc.code) from exc
    extra = WireExtra(
        raw=elems,
        aux=aux,
        feature_aux=reader.feature_only(),
        ints=decoded,
        sources=list(aux_frames),
        payload=buf,
        offsets=offsets,
    )
    return Request(
        rid=rid,
        input_ids=input_ids,
        input_ids_unpadded=unpadded,
        mm=mm,
        validation_error=verr,
        extra=extra,
    )


_ABORT_IDS = msgspec.msgpack.Decoder(list[str])


def decode_message(frames: list[Any], limits: Limits = DEFAULT_LIMITS) -> WireMessage:
    """Decode ``[type, payload, *aux]``; :class:`WireError` for anything malformed or
    over ``limits``."""
    if len(frames) < 2:
        raise WireError(f"a message needs at least 2 frames (type, payload), got {len(frames)}")
    kind = bytes(_as_buffer(frames[0]))
    if kind == bytes([MSG_ADD]):
        return WireMessage(MSG_ADD, request=decode_request(frames[1], list(frames[2:]), limits))
    if kind == bytes([MSG_ABORT]):
        if len(frames) != 2:
            raise WireError(f"an ABORT message has exactly 2 frames, got {len(frames)}")
        buf = _as_buffer(frames[1])
        try:
            n = array_len(buf)
        except ValueError:
            n = 0  # not an array: the decode below words it
        if n > limits.max_abort_ids:
            breach = abort_ids_over(n, limits.max_abort_ids)
            raise WireError(breach.message, code=breach.code)
        try:
            rids = _ABORT_IDS.decode(buf)  # typed: nothing but strings is ever built
        except msgspec.ValidationError as exc:
            raise WireError(
                f"ABORT payload must be an array of request id strings ({exc})"
            ) from exc
        except (msgspec.DecodeError, RecursionError) as exc:
            raise WireError(f"ABORT payload: undecodable ({exc})") from exc
        return WireMessage(MSG_ABORT, abort_rids=rids)
    raise WireError(
        f"unknown message type byte {kind.hex() or '(empty)'}; expected 00 (ADD) or 01 (ABORT)",
        recover_rid(frames[1]),
    )


# --------------------------------------------------------------------------- encode


class _FrameWriter(TensorWriter):
    """The client's tensor writer (received aux frames keep their indices, new
    buffers are appended) over the service's tensors."""

    def tensor(self, t: Tensor) -> list[Any]:
        return self.encode(t.dtype.name, t.shape, t.data)


def _raw_at(raw: list[msgspec.Raw], i: int, defaults: dict[int, Any]) -> Any:
    if i < len(raw):
        return raw[i]
    return defaults.get(i)


def _array_header(n: int) -> bytes:
    """The msgpack array header for ``n`` elements, in its smallest form."""
    if n < 16:
        return bytes((0x90 | n,))
    if n <= 0xFFFF:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def _item_elems(extra: Any) -> list[msgspec.Raw]:
    if isinstance(extra, _ItemSrc):
        return extra.elems()
    return list(extra) if isinstance(extra, list) else []


def _encode_items(
    items: list[Item], writer: _FrameWriter, drop_features: bool, aux: list[memoryview]
) -> msgspec.Raw:
    """The mm_items array; ``aux``: the received frames the request's writer starts from.
    An item decoded from this message whose fields are still those decoded is its
    received bytes with hash and pad_value written again (features dropped: none is);
    :func:`mmadmit.msgpack_walk.splice_items` states the rule."""
    return msgspec.Raw(
        splice_items(
            items,
            aux,
            _ItemSrc,
            lambda item: _encode_item(item, writer, drop_features),
            not drop_features,
        )
    )


def _encode_item(item: Item, writer: _FrameWriter, drop_feature: bool) -> bytes:
    elems = _item_elems(item.extra)
    if not elems:  # built without a wire original (gRPC, tests): encode every field
        shm = item.feature_shm
        return _ENC.encode(
            [
                item.modality,
                item.hash,
                item.pad_value,
                None if item.offsets is None else item.offsets.tolist(),
                None if drop_feature or item.feature is None else writer.tensor(item.feature),
                None
                if shm is None
                else {"shm_name": shm.name, "shape": list(shm.shape or ()), "dtype": shm.dtype},
                _side_field(item, writer),
                *_ITEM_UNSET,
                item.encode_handshake,
            ]
        )
    out: list[Any] = [
        _raw_at(elems, i, _ITEM_DEFAULTS) for i in range(max(_ITEM_FIELDS, len(elems)))
    ]
    out[0] = item.modality
    out[1] = item.hash
    out[2] = item.pad_value
    if drop_feature:
        out[4] = None
    elif item.feature is not None:
        out[4] = writer.tensor(item.feature)
    # side tensors may live in aux frames: re-emit them through the writer so
    # indices stay valid (received frames keep theirs).
    if item.side and any(isinstance(v, Tensor) for v in item.side.values()):
        out[6] = _side_field(item, writer)
    return _ENC.encode(out)


def _side_field(item: Item, writer: _FrameWriter) -> dict[str, Any]:
    """model_specific_data: its tensors written through the writer, other values as
    they are."""
    return {k: writer.tensor(v) if isinstance(v, Tensor) else v for k, v in item.side.items()}


def _encode_mm(
    mm: MultimodalInputs, writer: _FrameWriter, drop_features: bool, aux: list[memoryview]
) -> msgspec.Raw:
    elems = list(mm.extra) if isinstance(mm.extra, list) else []
    out: list[Any] = [_raw_at(elems, i, _MM_DEFAULTS) for i in range(max(_MM_FIELDS, len(elems)))]
    out[0] = _encode_items(mm.items, writer, drop_features, aux)
    out[1] = mm.im_token_id
    out[2] = mm.video_token_id
    out[3] = None if mm.mrope_positions is None else writer.tensor(mm.mrope_positions)
    out[4] = None if mm.mrope_position_delta is None else writer.tensor(mm.mrope_position_delta)
    out[5] = mm.mrope_position_delta_scalar
    return msgspec.Raw(_ENC.encode(out))


def _wire_extra(req: Request) -> WireExtra:
    if isinstance(req.extra, WireExtra):
        return req.extra
    return WireExtra(raw=[], aux=[])


class _Filled:
    """The padded ids of a payload, encoded from the unpadded ids' received bytes and
    the pad spans (:func:`~mmadmit.intcodec.encode_int_array_filled`), written by
    :func:`_spliced` straight into the payload (``bound``: the bytes they may take)."""

    __slots__ = ("bound", "made", "marks", "raw")

    def __init__(self, made: Padding, raw: msgspec.Raw, marks: Any):
        """``raw`` and ``marks``: what ``made.unpadded`` was decoded from."""
        self.made, self.raw, self.marks = made, raw, marks
        self.bound = encoded_bound(len(made.unpadded))

    def write(self, out: Any = None, start: int = 0) -> memoryview | bytes:
        made = self.made
        return encode_int_array_filled(
            made.unpadded, self.raw, self.marks, made.starts, made.stops, made.values, out, start
        )


def _int_array(
    extra: WireExtra, values: np.ndarray, padding: Padding | None = None
) -> msgspec.Raw | _Filled:
    """The received bytes of ``values`` if it is an array decoded from them; with
    ``padding`` (the materializer's, ``values`` its result), the unpadded ids'
    bytes and the pad spans, no array read (a :class:`_Filled`, written where it
    goes); else encoded (an array the materializer made otherwise: none does
    today)."""
    made = padding if padding is not None and padding.result is values else None
    for decoded, raw, marks in extra.ints:
        if decoded is values:
            return raw
        if made is not None and decoded is made.unpadded:
            return _Filled(made, raw, marks)
    return msgspec.Raw(encode_int_array(values))


def encode_request(
    req: Request, *, validation_error: str | None = None, drop_features: bool = False
) -> list[Any]:
    """Encode a request as ``[payload, *aux]`` (the frames after the type/status byte)."""
    extra = _wire_extra(req)
    raw = extra.raw
    aux: list[Any] = list(extra.aux)
    if drop_features:
        # Features are removed; blank their frames so other indices stay valid.
        aux = [b"" if (i + 1) in extra.feature_aux else f for i, f in enumerate(aux)]
    writer = _FrameWriter(aux)
    written = (  # in _WRITTEN's order
        TAG,
        req.rid,
        _int_array(extra, req.input_ids, req.padding),
        None if req.input_ids_unpadded is None else _int_array(extra, req.input_ids_unpadded),
        None if req.mm is None else _encode_mm(req.mm, writer, drop_features, extra.aux),
        validation_error if validation_error is not None else req.validation_error,
    )
    if extra.offsets is not None and extra.payload is not None and len(raw) >= N_FIELDS:
        payload = _spliced(extra.payload, extra.offsets, written)
    else:
        out: list[Any] = [_raw_at(raw, i, _FIELD_DEFAULTS) for i in range(max(N_FIELDS, len(raw)))]
        if not raw:
            out[F_SAMPLING] = []
        for i, value in zip(_WRITTEN, written, strict=True):
            out[i] = msgspec.Raw(value.write()) if type(value) is _Filled else value
        payload = _joined(out)
    frames = writer.frames
    sources = extra.sources
    if not drop_features and len(sources) == len(extra.aux):
        # the writer only appends: every received frame is still at its index, sent
        # as the object it arrived in
        frames[: len(sources)] = sources
    else:
        for i, (view, source) in enumerate(zip(extra.aux, sources, strict=False)):
            if frames[i] is view:  # still the received frame (not blanked): send its object
                frames[i] = source
    return [payload, *frames]


_Raw = msgspec.Raw
# The payload elements encode_request writes, in order; a received payload's other
# elements are re-emitted as its bytes (consecutive ones as one slice).
_WRITTEN = (0, F_RID, F_INPUT_IDS, F_UNPADDED, F_MM, F_VALIDATION_ERROR)
assert list(_WRITTEN) == sorted(set(_WRITTEN)) and _WRITTEN[-1] < N_FIELDS


def _spliced(buf: memoryview, offsets: list[int], written: tuple[Any, ...]) -> bytes | memoryview:
    """The payload of ``len(offsets) - 1`` elements: ``written`` at ``_WRITTEN`` (raw
    bytes as they are, a :class:`_Filled` written in place, other values
    encoded), every other element ``buf``'s."""
    n = len(offsets) - 1
    pieces: list[Any] = [_array_header(n)]
    at = 0  # the first element not emitted yet
    filled = None
    for i, value in zip(_WRITTEN, written, strict=True):
        if at < i:
            pieces.append(buf[offsets[at] : offsets[i]])
        kind = type(value)
        if kind is _Filled:
            filled = value
            pieces.append(value)
        else:
            pieces.append(value if kind is _Raw else _ENC.encode(value))
        at = i + 1
    if at < n:
        pieces.append(buf[offsets[at] : offsets[n]])
    if filled is None:
        return b"".join(pieces)
    # One buffer, each piece copied into it once, the padded ids written in place
    # (not into a buffer of their own and then copied again).
    out = np.empty(sum(p.bound if p is filled else len(p) for p in pieces), np.uint8)
    view = out.data
    at = 0
    for p in pieces:
        if p is filled:
            at += len(filled.write(out, at))
        else:
            end = at + len(p)
            view[at:end] = p
            at = end
    return view[:at]


def _joined(elems: list[Any]) -> bytes:
    """``_ENC.encode(elems)`` for an array whose large elements are raw bytes: each small
    one encoded on its own, everything copied once into a buffer of the final size
    (the encoder grows its buffer as it goes, copying a payload of token arrays
    over again)."""
    pieces: list[Any] = [_array_header(len(elems))]
    for v in elems:
        pieces.append(v if type(v) is _Raw else _ENC.encode(v))
    return b"".join(pieces)


def minimal_abort_payload(rid: str, abort: Abort) -> bytes:
    """A request that still decodes as ``TokenizedGenerateReqInput``, for broken input."""
    out: list[Any] = [_FIELD_DEFAULTS.get(i) for i in range(N_FIELDS)]
    out[0] = TAG
    out[F_RID] = rid
    out[F_INPUT_IDS] = []
    out[F_SAMPLING] = []
    out[F_VALIDATION_ERROR] = abort.as_validation_error()
    return _ENC.encode(out)


def encode_materialized(outcome: Materialized) -> list[Any]:
    """Reply-mode frames for a materialized outcome: ``[0x00, payload, *aux]``."""
    return [bytes([STATUS_MATERIALIZED]), *encode_request(outcome.request)]


def encode_aborted(req: Request | None, abort: Abort, rid: str = "") -> list[Any]:
    """Reply-mode frames for an abort: ``[0x01, payload, *aux]`` (features removed)."""
    if req is None:
        return [bytes([STATUS_ABORTED]), minimal_abort_payload(rid, abort)]
    frames = encode_request(req, validation_error=abort.as_validation_error(), drop_features=True)
    return [bytes([STATUS_ABORTED]), *frames]
