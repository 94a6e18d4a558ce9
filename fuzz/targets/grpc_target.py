"""The whole gRPC path: request deserializer, proto translation, materializer, response.

The input is one profile byte, one strip-threshold byte, then a serialized
``AdmitRequest`` (or garbage). It goes through exactly what ``Admit`` does:
``pbwire.parse_admit_request`` (a low threshold, so short inputs exercise the
inline-payload stripping), ``servicer.request_from_proto``, the materializer,
``servicer.encode_response`` (what the servicer sends, which must parse to the
message ``tests/response_oracle.py`` builds with protobuf alone); once with native code on
and once off. The two must answer the same: both refuse the bytes (protobuf's ``DecodeError``),
or both produce byte-identical responses. No response may carry ``INTERNAL``.
In each mode the deserializer is also held to protobuf itself
(``pbwire_target.check_parse``): it refuses exactly the bytes
``AdmitRequest.FromString`` refuses, with its words, and otherwise gives its
message once the stripped payloads and taken ids are put back.
The pre-parse count (``pbwire.check_admit_limits``) runs on every input under
tight limits and is held to protobuf's parse of the same bytes (:func:`_counted`).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

from google.protobuf.message import DecodeError
from mmadmit import pbwire, servicer
from mmadmit.errors import AbortCode, AdmissionError
from mmadmit.limits import Limits
from mmadmit.materializer import Materializer
from mmadmit.profile import load_profile
from mmadmit_client.proto import admission_pb2 as pb

from ._common import native_mode
from .pbwire_target import check_parse, count

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from response_oracle import response_from_outcome  # noqa: E402  (the tests' oracle)

NAME = "grpc"
MAX_LEN = 1 << 16
_PROFILES = ("qwen3_5", "qwen3_omni_moe", "llama", "qwen2_5_vl")
_INTERNAL = pb.INTERNAL  # the AbortCode enum value


@functools.cache
def _materializer(name: str) -> Materializer:
    return Materializer(load_profile(name))


def _admit(m: Materializer, data: bytes, min_bytes: int) -> bytes | None:
    try:
        parsed = pbwire.parse_admit_request(data, min_bytes, take_min_bytes=min_bytes)
    except DecodeError:
        return None
    msg = pbwire.message_and_payloads(parsed)[0]
    rid = msg.request_id
    try:
        req = servicer.request_from_proto(parsed, m.profile)
    except AdmissionError as exc:
        resp = servicer.abort_response(rid, exc.to_abort())
    else:
        outcome = m.run(req)
        sent = servicer.encode_response(rid, outcome, echo_features=msg.echo_features)
        resp = pb.AdmitResponse.FromString(sent)
        oracle = response_from_outcome(rid, outcome, echo_features=msg.echo_features)
        assert resp == oracle, "encode_response differs from the oracle"
    if resp.HasField("abort"):
        assert resp.abort.code != _INTERNAL, f"INTERNAL outcome: {resp.abort.message}"
    return resp.SerializeToString(deterministic=True)


# Tight limits for the pre-parse count (pbwire.check_admit_limits), held to what
# protobuf then parses from the same bytes.
TIGHT = Limits(max_tokens=64, max_items=4, max_msgpack_len=32)


def _counted(body: bytes) -> None:
    """The count's verdict agrees with protobuf's parse of the same bytes: a walk that
    neither bailed nor refused saw everything within the limits; a refusal for tokens,
    items or placeholders is a real excess."""
    got = count(pbwire._walks, body, TIGHT)
    if got == ("ok", False):
        return  # not understood: left to protobuf
    verdict: str | None = None
    if got[0] == "refused":
        assert got[1] is AbortCode.TOO_LARGE
        verdict = got[2]
    try:
        msg = pb.AdmitRequest.FromString(body)
    except DecodeError:
        return
    items = msg.mm_inputs.items
    sizes = {
        "input_ids": len(msg.tokenized.input_ids) > 64,
        "input_ids_unpadded": len(msg.input_ids_unpadded) > 64,
        "items": len(items) > 4,
        "placeholders": any(len(it.placeholders) > 64 for it in items),
    }
    if verdict is None:
        over = [k for k, v in sizes.items() if v]
        assert not over, f"counted within the limits, parsed over them: {over}"
        assert not any(len(it.model_specific_tensors) > 32 for it in items)
    else:
        for key, what in (("input_ids_unpadded", "input_ids_unpadded:"),
                          ("input_ids", "input_ids:"), ("items", "items exceed"),
                          ("placeholders", "placeholders")):  # fmt: skip
            if what in verdict:
                assert sizes[key], f"refused ({verdict}) but protobuf parsed it within"
                break


def one(data: bytes) -> None:
    if len(data) < 2:
        return
    m = _materializer(_PROFILES[data[0] % len(_PROFILES)])
    min_bytes = 1 + data[1] % 64
    body = data[2:]
    _counted(body)
    with native_mode(True):
        check_parse(body, pb.AdmitRequest, min_bytes)
        a = _admit(m, body, min_bytes)
    with native_mode(False):
        check_parse(body, pb.AdmitRequest, min_bytes)
        b = _admit(m, body, min_bytes)
    assert a == b, "native and fallback gRPC responses differ" + (
        ""
        if a is None or b is None
        else f"\n  native   {pb.AdmitResponse.FromString(a)}"
        f"\n  fallback {pb.AdmitResponse.FromString(b)}"
    )


def seed_input(profile: str, msg: pb.AdmitRequest) -> bytes:
    return bytes([_PROFILES.index(profile), 15]) + msg.SerializeToString()
