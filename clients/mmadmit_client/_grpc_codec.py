"""The client's model <-> the admission API's protobuf messages (docs/spec/GRPC.md).

:func:`request_to_proto` makes an ``AdmitRequest`` of a
:class:`~mmadmit_client.Request`; :func:`outcome_from_proto` reads an
``AdmitResponse`` into an :class:`~mmadmit_client.Outcome`. What the gRPC API
cannot carry is a ``ValueError`` naming it rather than something silently
dropped: a ``validation_error`` mark, a modality number without a gRPC
equivalent, token ids or pad values outside ``uint32``. The msgpack wire's
own fields (``Request.wire_fields``) do not exist on gRPC and are not sent.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import _models as models
from ._exceptions import ProtocolError
from .proto import admission_pb2 as pb

MODALITIES: dict[str, Any] = {"image": pb.IMAGE, "audio": pb.AUDIO, "video": pb.VIDEO}
_MODALITY_NAMES = {v: k for k, v in MODALITIES.items()}
_UINT32_MAX = 2**32 - 1


def tensor_to_proto(value: models.Tensor | models.ShmFeature) -> pb.TensorData:
    """A ``TensorData``: inline bytes, or a shared-memory handle."""
    if isinstance(value, models.ShmFeature):
        return pb.TensorData(
            shape=list(value.shape),
            dtype=value.dtype,
            shm=pb.ShmHandle(
                name=value.name, offset=value.offset, nbytes=value.nbytes, owner_id=value.owner_id
            ),
        )
    return pb.TensorData(shape=list(value.shape), dtype=value.dtype, inline=bytes(value.data))


def _check_ids(what: str, rid: str, ids: np.ndarray | None) -> None:
    if ids is not None and ids.size and (int(ids.min()) < 0 or int(ids.max()) > _UINT32_MAX):
        raise ValueError(f"{what} of {rid!r} hold values outside uint32 (gRPC's type)")


def _item_to_proto(i: int, item: models.Item) -> pb.MultimodalItem:
    if not isinstance(item.modality, str):
        raise ValueError(f"item {i}: modality {item.modality} has no gRPC equivalent")
    if item.pad_value is not None and not 0 <= item.pad_value <= _UINT32_MAX:
        raise ValueError(f"item {i}: pad_value {item.pad_value} is outside uint32")
    msg = pb.MultimodalItem(modality=MODALITIES[item.modality])
    for start, end in item.offsets.tolist():
        msg.placeholders.add(offset=start, length=end - start + 1)
    if item.feature is not None:
        msg.encoder_input.CopyFrom(tensor_to_proto(item.feature))
    if item.hash is not None:
        # read little-endian (docs/spec/GRPC.md)
        msg.content_hash = int(item.hash).to_bytes(8, "little")
    if item.pad_value is not None:
        msg.pad_value = item.pad_value
    if item.placeholder_token_id is not None:
        msg.placeholder_token_id = item.placeholder_token_id
    for key, tensor in item.side.items():
        msg.model_specific_tensors[key].CopyFrom(tensor_to_proto(tensor))
    return msg


def _bootstrap_entry(i: int, handshake: Any) -> pb.EncodeItemBootstrapInfo:
    try:
        return pb.EncodeItemBootstrapInfo(
            item_index=i,
            bootstrap_host=handshake["bootstrap_host"],
            bootstrap_port=handshake["bootstrap_port"],
            bootstrap_room=handshake["bootstrap_room"],
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(
            f"item {i}: encode_handshake needs bootstrap_host (str), bootstrap_port (int32) "
            f"and bootstrap_room (int64) for gRPC ({exc!r})"
        ) from exc


def _handshake_from_proto(it: pb.MaterializedItem) -> dict[str, Any] | None:
    if not it.HasField("encode_handshake"):
        return None
    h = it.encode_handshake
    return {
        "bootstrap_host": h.bootstrap_host,
        "bootstrap_port": h.bootstrap_port,
        "bootstrap_room": h.bootstrap_room,
    }


def request_to_proto(req: models.Request) -> pb.AdmitRequest:
    """The request as an ``AdmitRequest``; ``ValueError`` for what gRPC cannot carry."""
    if req.validation_error is not None:
        raise ValueError(
            f"request {req.request_id!r} is already marked invalid (validation_error "
            f"{req.validation_error!r}); the gRPC API has no such field: send it over ZMQ"
        )
    _check_ids("input_ids", req.request_id, req.input_ids)
    _check_ids("input_ids_unpadded", req.request_id, req.input_ids_unpadded)
    msg = pb.AdmitRequest(
        request_id=req.request_id, echo_features=req.echo_features, timeout_ms=req.timeout_ms
    )
    msg.tokenized.input_ids.extend(req.input_ids.tolist())
    if req.input_ids_unpadded is not None:
        msg.input_ids_unpadded.extend(req.input_ids_unpadded.tolist())
    if req.multimodal:
        msg.mm_inputs.SetInParent()  # present even with no items, as on the msgpack wire
        msg.mm_inputs.items.extend(_item_to_proto(i, it) for i, it in enumerate(req.items))
        for i, item in enumerate(req.items):
            if item.encode_handshake is not None:
                msg.encode_bootstrap_info.items.append(_bootstrap_entry(i, item.encode_handshake))
    if req.mrope_positions is not None or req.mrope_position_delta is not None:
        msg.mrope.SetInParent()
        if req.mrope_positions is not None:
            msg.mrope.positions.CopyFrom(
                tensor_to_proto(models.Tensor.from_numpy(req.mrope_positions))
            )
        if req.mrope_position_delta is not None:
            msg.mrope.delta = int(req.mrope_position_delta)
    return msg


def _tensor_from_proto(td: pb.TensorData) -> models.Tensor | models.ShmFeature:
    if td.WhichOneof("payload") == "shm":
        s = td.shm
        return models.ShmFeature(s.name, tuple(td.shape), td.dtype, s.offset, s.nbytes, s.owner_id)
    return models.Tensor(td.dtype, tuple(td.shape), td.inline)


def _ids(values: Any) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def outcome_from_proto(resp: pb.AdmitResponse) -> models.Outcome:
    """An ``AdmitResponse`` as an outcome; :class:`ProtocolError` when it carries none
    or does not decode."""
    kind = resp.WhichOneof("outcome")
    if kind == "abort":
        code = resp.abort.code
        name = pb.AbortCode.Name(code) if code in pb.AbortCode.values() else str(code)
        return models.Aborted(resp.request_id, name, resp.abort.message)
    if kind != "materialized":
        raise ProtocolError(f"response for {resp.request_id!r} carries no outcome")
    m = resp.materialized
    try:
        items = tuple(
            models.MaterializedItem(
                modality=_MODALITY_NAMES.get(it.modality, "unspecified"),
                hash=it.hash if it.HasField("hash") else None,
                pad_value=it.pad_value,
                offsets=np.array(
                    [(p.offset, p.offset + p.length - 1) for p in it.placeholders], dtype=np.int64
                ).reshape(-1, 2),
                feature=_tensor_from_proto(it.encoder_input)
                if it.HasField("encoder_input")
                else None,
                side={
                    k: t
                    for k, td in it.model_specific_tensors.items()
                    if isinstance(t := _tensor_from_proto(td), models.Tensor)
                },
                encode_handshake=_handshake_from_proto(it),
            )
            for it in m.items
        )
    except ValueError as exc:  # a tensor whose bytes do not match its shape
        raise ProtocolError(f"response for {resp.request_id!r}: {exc}") from exc
    positions = None
    if m.HasField("mrope_positions"):
        td = m.mrope_positions
        if td.dtype != "int64" or td.WhichOneof("payload") != "inline":
            raise ProtocolError(f"mrope_positions must be inline int64, got {td.dtype!r}")
        positions = np.frombuffer(td.inline, dtype="<i8").reshape(tuple(td.shape))
    return models.Materialized(
        request_id=resp.request_id,
        input_ids=_ids(m.input_ids),
        input_ids_unpadded=_ids(m.input_ids_unpadded) if len(m.input_ids_unpadded) else None,
        items=items,
        mrope_positions=positions,
        mrope_position_delta=m.mrope_position_delta if m.HasField("mrope_position_delta") else None,
        passthrough=m.passthrough,
    )


def model_info_from_proto(info: pb.GetModelInfoResponse) -> models.ModelInfo:
    def opt(name: str) -> int | None:
        return getattr(info, name) if info.HasField(name) else None

    return models.ModelInfo(
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


__all__ = [
    "MODALITIES",
    "model_info_from_proto",
    "outcome_from_proto",
    "request_to_proto",
    "tensor_to_proto",
]
