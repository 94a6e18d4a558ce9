"""The whole gRPC path: request deserializer, proto translation, materializer, response.

The input is one profile byte, one strip-threshold byte, then a serialized
``AdmitRequest`` (or garbage). It goes through exactly what ``Admit`` does:
``pbwire.parse_admit_request`` (a low threshold, so short inputs exercise the
inline-payload stripping), ``servicer.request_from_proto``, the materializer,
``servicer.response_from_outcome``; once with native code on and once off. The
two must answer the same: both refuse the bytes (protobuf's ``DecodeError``),
or both produce byte-identical responses. No response may carry ``INTERNAL``.
"""

from __future__ import annotations

import functools

from google.protobuf.message import DecodeError
from mmadmit import pbwire, servicer
from mmadmit._proto import admission_pb2 as pb
from mmadmit.errors import AdmissionError
from mmadmit.materializer import Materializer
from mmadmit.profile import load_profile

from ._common import native_mode

NAME = "grpc"
MAX_LEN = 1 << 16
_PROFILES = ("qwen3_5", "qwen3_omni_moe", "llama", "qwen2_5_vl")
_INTERNAL = pb.INTERNAL  # the AbortCode enum value


@functools.cache
def _materializer(name: str) -> Materializer:
    return Materializer(load_profile(name))


def _admit(m: Materializer, data: bytes, min_bytes: int) -> bytes | None:
    try:
        parsed = pbwire.parse_admit_request(data, min_bytes)
    except DecodeError:
        return None
    if isinstance(parsed, pbwire.StrippedRequest):
        msg, payloads = parsed.msg, parsed.payloads
    else:
        msg, payloads = parsed, None
    rid = msg.request_id
    try:
        req = servicer.request_from_proto(msg, m.profile, payloads)
    except AdmissionError as exc:
        resp = servicer.abort_response(rid, exc.to_abort())
    else:
        outcome = m.run(req)
        resp = servicer.response_from_outcome(rid, outcome, echo_features=msg.echo_features)
    if resp.HasField("abort"):
        assert resp.abort.code != _INTERNAL, f"INTERNAL outcome: {resp.abort.message}"
    return resp.SerializeToString(deterministic=True)


def one(data: bytes) -> None:
    if len(data) < 2:
        return
    m = _materializer(_PROFILES[data[0] % len(_PROFILES)])
    min_bytes = 1 + data[1] % 64
    body = data[2:]
    with native_mode(True):
        a = _admit(m, body, min_bytes)
    with native_mode(False):
        b = _admit(m, body, min_bytes)
    assert a == b, "native and fallback gRPC responses differ" + (
        ""
        if a is None or b is None
        else f"\n  native   {pb.AdmitResponse.FromString(a)}"
        f"\n  fallback {pb.AdmitResponse.FromString(b)}"
    )


def seed_input(profile: str, msg: pb.AdmitRequest) -> bytes:
    return bytes([_PROFILES.index(profile), 15]) + msg.SerializeToString()
