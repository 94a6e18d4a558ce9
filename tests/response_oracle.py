"""The ``AdmitResponse`` of an outcome built by protobuf alone: the oracle of
:func:`mmadmit.servicer.encode_response`, which writes the ids and the positions
itself. Tests only; production has the one encoder."""

from __future__ import annotations

from mmadmit.materializer import Outcome
from mmadmit.model import Materialized
from mmadmit.servicer import _items_and_delta_to_proto, _positions_i64, abort_response
from mmadmit_client.proto import admission_pb2 as pb


def response_from_outcome(rid: str, outcome: Outcome, *, echo_features: bool) -> pb.AdmitResponse:
    """One outcome (materialized or abort) as an ``AdmitResponse`` message."""
    if not isinstance(outcome, Materialized):
        return abort_response(rid, outcome)
    req = outcome.request
    resp = pb.AdmitResponse(request_id=rid)
    out = resp.materialized
    out.input_ids.extend(req.input_ids.tolist())  # protobuf range-checks each id
    if req.input_ids_unpadded is not None:
        out.input_ids_unpadded.extend(req.input_ids_unpadded.tolist())
    out.passthrough = outcome.passthrough
    mm = req.mm
    if mm is not None:
        _items_and_delta_to_proto(mm, out, echo_features)
        if mm.mrope_positions is not None:
            arr = _positions_i64(mm.mrope_positions)
            out.mrope_positions.shape.extend(arr.shape)
            out.mrope_positions.dtype = "int64"
            out.mrope_positions.inline = arr.tobytes()
    return resp
