"""The SMG gRPC face's request path: deserializer, translation, materializer, the ADD.

The input is one profile byte, one strip-threshold byte, then a serialized
``tokenspeed.grpc.scheduler.GenerateRequest`` (or garbage). It goes through
exactly what ``Generate`` does before the scheduler: ``pbwire.parse_request``
(a low threshold, so short inputs exercise the inline-payload stripping),
``smg_request.request_from_generate``, the materializer, ``wire.encode_request``;
once with native code on and once off. The two must answer the same: both
refuse the bytes (protobuf's ``DecodeError``), both refuse the request with the
same code, or both produce the same ADD. No outcome may be ``INTERNAL``, and
every ADD must decode with the scheduler's codec (``wire.decode_message``).
In each mode ``parse_request`` is also held to protobuf itself
(``pbwire_target.check_parse``): it refuses exactly the bytes
``GenerateRequest.FromString`` refuses, with its words, and otherwise gives its
message once the stripped payloads and taken ids are put back.
"""

from __future__ import annotations

import functools

import msgspec
from google.protobuf.message import DecodeError
from mmadmit import pbwire, smg_request, wire
from mmadmit.errors import Abort, AbortCode, AdmissionError
from mmadmit.materializer import Materializer
from mmadmit.profile import load_profile
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts

from ._common import native_mode
from .pbwire_target import check_parse

NAME = "smg"
MAX_LEN = 1 << 16
_PROFILES = ("qwen3_5", "qwen3_omni_moe", "llama", "qwen2_5_vl")
_CREATED_TIME = 15  # the envelope's created_time: the clock, not the request
_SPLIT = msgspec.msgpack.Decoder(list[msgspec.Raw])


@functools.cache
def _materializer(name: str) -> Materializer:
    return Materializer(load_profile(name))


def _generate(m: Materializer, data: bytes, min_bytes: int) -> tuple[str, list[bytes]] | None:
    """``("add", frames)`` or ``("abort", [code])``; None for bytes protobuf refuses."""
    try:
        parsed = pbwire.parse_request(data, ts.GenerateRequest, min_bytes, take_min_bytes=min_bytes)
    except DecodeError:
        return None
    msg = pbwire.message_and_payloads(parsed)[0]
    try:
        req = smg_request.request_from_generate(parsed, m.profile)
    except AdmissionError as exc:
        assert exc.code is not AbortCode.INTERNAL, exc.message
        return "abort", [exc.code.value.encode()]
    outcome = m.run(req)
    if isinstance(outcome, Abort):
        assert outcome.code is not AbortCode.INTERNAL, f"INTERNAL outcome: {outcome.message}"
        return "abort", [outcome.code.value.encode()]
    frames = [bytes(f) for f in wire.encode_request(outcome.request)]
    decoded = wire.decode_message([bytes([wire.MSG_ADD]), *frames])  # the scheduler's view
    assert decoded.request is not None and decoded.request.rid == msg.request_id
    elems = _SPLIT.decode(frames[0])
    elems[_CREATED_TIME] = msgspec.Raw(b"\xc0")
    return "add", [msgspec.msgpack.encode(elems), *frames[1:]]


def one(data: bytes) -> None:
    if len(data) < 2:
        return
    m = _materializer(_PROFILES[data[0] % len(_PROFILES)])
    min_bytes = 1 + data[1] % 64
    body = data[2:]
    with native_mode(True):
        check_parse(body, ts.GenerateRequest, min_bytes)
        a = _generate(m, body, min_bytes)
    with native_mode(False):
        check_parse(body, ts.GenerateRequest, min_bytes)
        b = _generate(m, body, min_bytes)
    assert a == b, f"native and fallback SMG face outcomes differ:\n  {a}\n  {b}"


def seed_input(profile: str, msg: ts.GenerateRequest) -> bytes:
    return bytes([_PROFILES.index(profile), 15]) + msg.SerializeToString()
