"""The SMG gRPC face's request side: a ``GenerateRequest`` as the internal request.

:func:`parse_generate` is the ``Generate`` deserializer; :func:`request_from_generate`
translates the message (items through :mod:`mmadmit.servicer`'s own translation,
EPD's ``encode_bootstrap_info`` included) with the ``TokenizedGenerateReqInput``
envelope SMG's msgpack encoder would write (:func:`sampling_array`, logprob
options, ``stream``, the KV bootstrap). Contract: docs/spec/SMG_GRPC.md, step 1.
"""

from __future__ import annotations

import time
from typing import Any

from google.protobuf import struct_pb2
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts

from . import wire
from .errors import InvalidRequest, Unsupported
from .limits import Limits
from .model import MultimodalInputs, Request
from .pbwire import StrippedRequest, ids_of, message_and_payloads, parse_request
from .profile import ModelProfile
from .servicer import attach_encode_handshakes, items_from_proto

# TokenSpeed's SamplingParams on the msgpack wire (docs/spec/WIRE.md), with the defaults
# of docs/spec/SMG_GRPC.md, "One `Generate` call", step 1 (captured from the real gateway).
_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens",
    "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "thinking_budget", "custom_params",
    "stream_interval", "logit_bias", "seed", "logprobs", "n", "stop_strs", "stop_str_max_len",
    "is_normalized",
)  # fmt: skip
TOP_K_ALL = 1 << 30
_SAMPLING_DEFAULTS: dict[str, Any] = dict.fromkeys(_SAMPLING_FIELDS)
_SAMPLING_DEFAULTS.update(
    temperature=1.0,
    top_p=1.0,
    top_k=TOP_K_ALL,
    min_p=0.0,
    frequency_penalty=0.0,
    presence_penalty=0.0,
    repetition_penalty=1.0,
    min_new_tokens=0,
    ignore_eos=False,
    skip_special_tokens=True,
    spaces_between_special_tokens=True,
    no_stop_trim=False,
    n=1,
    stop_strs=[],
    stop_str_max_len=0,
    is_normalized=True,
)
_OPTIONAL_SCALARS = (
    "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty",
)  # fmt: skip
_CONSTRAINTS = {
    "regex": "regex",
    "json_schema": "json_schema",
    "ebnf_grammar": "ebnf",
    "structural_tag": "structural_tag",
}


def _struct_value(value: struct_pb2.Value) -> Any:
    kind = value.WhichOneof("kind")
    if kind == "struct_value":
        return {k: _struct_value(v) for k, v in value.struct_value.fields.items()}
    if kind == "list_value":
        return [_struct_value(v) for v in value.list_value.values]
    if kind == "number_value":
        number = value.number_value
        return int(number) if number.is_integer() else number
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    return None


def sampling_array(params: ts.SamplingParams) -> list[Any]:
    """The msgpack ``SamplingParams`` array for ``params``, normalized as SMG's own
    msgpack encoder sends it (docs/spec/SMG_GRPC.md, "One `Generate` call", step 1)."""
    values = dict(_SAMPLING_DEFAULTS)
    for name in _OPTIONAL_SCALARS:
        if params.HasField(name):
            values[name] = getattr(params, name)
    if values["top_k"] <= 0:
        values["top_k"] = TOP_K_ALL
    if params.min_new_tokens:
        values["min_new_tokens"] = params.min_new_tokens
    if params.stop:
        stops = list(params.stop)
        values["stop_strs"] = stops
        values["stop_str_max_len"] = max(len(s.encode()) for s in stops)
    if params.stop_token_ids:
        values["stop_token_ids"] = list(params.stop_token_ids)
    values["ignore_eos"] = params.ignore_eos
    values["skip_special_tokens"] = params.skip_special_tokens
    values["spaces_between_special_tokens"] = params.spaces_between_special_tokens
    values["no_stop_trim"] = params.no_stop_trim
    if params.n > 1:
        raise Unsupported(
            f"sampling_params.n is {params.n}; the SMG gRPC face forwards one choice per "
            "request (send n requests)"
        )
    if params.logit_bias:
        values["logit_bias"] = dict(params.logit_bias)
    constraint = params.WhichOneof("constraint")
    if constraint is not None:
        values[_CONSTRAINTS[constraint]] = getattr(params, constraint)
    if params.HasField("custom_params"):
        values["custom_params"] = {
            k: _struct_value(v) for k, v in params.custom_params.fields.items()
        }
    if params.HasField("sampling_seed"):
        values["seed"] = params.sampling_seed
    return [values[name] for name in _SAMPLING_FIELDS]


def _envelope(msg: ts.GenerateRequest) -> wire.WireExtra:
    """The ``TokenizedGenerateReqInput`` fields the materializer does not own."""
    raw: list[Any] = [None] * wire.N_FIELDS
    raw[0] = wire.TAG
    raw[wire.F_SAMPLING] = sampling_array(msg.sampling_params)
    raw[6] = msg.return_logprob
    raw[7] = msg.logprob_start_len if msg.HasField("logprob_start_len") else -1
    raw[8] = msg.top_logprobs_num
    raw[9] = list(msg.token_ids_logprob) if msg.token_ids_logprob else None
    raw[10] = msg.stream
    raw[14] = False  # return_hidden_states
    raw[15] = time.time()  # created_time
    if msg.HasField("kv_bootstrap_info"):
        boot = msg.kv_bootstrap_info
        raw[16] = boot.bootstrap_host or None
        raw[17] = boot.bootstrap_port
        raw[18] = boot.bootstrap_room
    return wire.WireExtra(raw=raw, aux=[])


def request_from_generate(
    request: ts.GenerateRequest | StrippedRequest,
    profile: ModelProfile,
    limits: Limits | None = None,
) -> Request:
    """A ``GenerateRequest`` (or what the deserializer made of it, see
    :func:`mmadmit.servicer.request_from_proto`) as the internal request (with its
    ADD envelope in ``extra``); :class:`~mmadmit.errors.AdmissionError` names what
    cannot be carried (a tensor over ``limits`` among them)."""
    msg, payloads = message_and_payloads(request)
    if not msg.request_id:
        raise InvalidRequest("request_id is empty; outputs are matched by request_id")
    ids = ids_of(request)
    if not len(ids):
        raise InvalidRequest("tokenized.input_ids is empty")
    mm: MultimodalInputs | None = None
    if msg.HasField("mm_inputs"):
        mm = items_from_proto(msg.mm_inputs.items, profile, payloads, limits)
    attach_encode_handshakes(msg, mm)
    return Request(rid=msg.request_id, input_ids=ids, mm=mm, extra=_envelope(msg))


def parse_generate(data: bytes, limits: Limits) -> ts.GenerateRequest | StrippedRequest | Any:
    """The ``Generate`` request deserializer: :func:`mmadmit.pbwire.parse_request`
    (limits counted from the wire bytes, large inline tensors left in ``data``);
    a :class:`~mmadmit.pbwire.RefusedRequest` for a breach; raises ``DecodeError``."""
    return parse_request(data, ts.GenerateRequest, limits=limits)


__all__ = ["TOP_K_ALL", "parse_generate", "request_from_generate", "sampling_array"]
