"""The protobuf walks (``mmadmit.pbwalk``) compiled against interpreted, the tests'
reference walk and protobuf.

First byte even: ``strip_inline`` on the rest (a would-be ``AdmitRequest``)
with a small strip threshold, so short inputs exercise it, in both builds and
in the tests' reference walk (``tests/pbwire_oracle.py``); the stripped bytes
and payloads must be identical, and held to protobuf (:func:`check_strip`):
when it strips, the stripped message parses exactly when the rest does, to the
same message once the markers are resolved. 1 mod 4: ``packed_uint32_field``
on an int64 array from the rest (the same bytes, or the same ``ValueError``
message). 3 mod 8: ``limits_breach`` on the rest under limits drawn from the
next bytes: the same outcome in both builds (passed, not understood, or the
same refusal with the same request id). 7 mod 8: ``take_ids`` on the rest in
both builds, held to each other and to protobuf (:func:`check_take`): when it
takes, the rest parses exactly when the message it returns parses, to the same
message less the ids, and the ids it returns are the parsed ones.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from mmadmit import pbwalk, pbwire
from mmadmit.errors import TooLarge
from mmadmit.limits import Limits
from mmadmit_client.proto import admission_pb2 as pb

from ._common import outcome, same
from ._data import Data

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from pbwire_oracle import strip as oracle_strip  # noqa: E402  (the tests' reference)

NAME = "pbwire"


def _strip(d: Data) -> None:
    min_bytes = d.int_in(1, 64)
    data = d.rest()
    a = outcome(pbwire._BUILT.strip_inline, data, min_bytes, pbwire._NONCE)
    same(a, outcome(pbwalk.strip_inline, data, min_bytes, pbwire._NONCE), "strip_inline builds")
    same(a, outcome(oracle_strip, data, min_bytes), f"strip_inline(min_bytes={min_bytes})")
    if a[0] == "ok" and a[1] is not None:
        check_strip(data, *a[1])


def _inline_fields(msg: Any) -> list[Any]:
    """The TensorData fields the stripper walks, of a parsed message (present ones only:
    reaching into an absent one would make it present)."""
    out = []
    if msg.HasField("mm_inputs"):
        for item in msg.mm_inputs.items:
            if item.HasField("encoder_input"):
                out.append(item.encoder_input)
            out.extend(item.model_specific_tensors.values())
    if isinstance(msg, pb.AdmitRequest) and msg.HasField("mrope"):
        if msg.mrope.HasField("positions"):
            out.append(msg.mrope.positions)
    return out


def restored(msg: Any, payloads: list[memoryview]) -> Any:
    """A copy of the stripped message ``msg`` with every marker replaced by its bytes."""
    out = type(msg)()
    out.CopyFrom(msg)
    for td in _inline_fields(out):
        if td.WhichOneof("payload") == "inline":
            td.inline = bytes(pbwire.resolve_inline(td.inline, payloads))
    return out


def _same_message(a: Any, b: Any, what: str) -> None:
    assert a == b, f"{what}: another message than protobuf's"
    same_bytes = a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)
    assert same_bytes, f"{what}: serializes otherwise than protobuf's"


def check_strip(data: bytes, small: bytes, payloads: list[memoryview]) -> None:
    """A strip of ``data`` (an ``AdmitRequest``) held to protobuf: ``small`` parses exactly
    when ``data`` does (a string upb refuses stays in it: the walk reads no strings),
    and then to ``data``'s message once the markers are resolved."""
    assert payloads, "strip_inline: a result without payloads"
    whole = outcome(pb.AdmitRequest.FromString, data, errors=(DecodeError,))
    part = outcome(pb.AdmitRequest.FromString, small, errors=(DecodeError,))
    assert whole[0] == part[0], f"strip_inline: the message {whole[0]}, the stripped {part[0]}"
    if whole[0] == "ok":
        _same_message(restored(part[1], payloads), whole[1], "strip_inline")


def check_parse(data: bytes, message: Any, min_bytes: int) -> None:
    """``pbwire.parse_request`` (the strip and the take, thresholds ``min_bytes``, in the
    current native mode) held to ``message.FromString``: the same ``DecodeError``
    text, or the same message once the payloads and ids are put back. For a message
    other than ``AdmitRequest`` unknown fields are not compared: the walk enters field
    101 (``AdmitRequest.mrope``) of any message, and its markers stay in that unknown
    field, which no face reads."""
    ref = outcome(message.FromString, data, errors=(DecodeError,))
    got = outcome(
        pbwire.parse_request, data, message, min_bytes, None, min_bytes, errors=(DecodeError,)
    )
    if got[0] != "ok" or ref[0] != "ok":
        assert got == ref, f"parse_request {got}, protobuf {ref}"
        return
    parsed, want = got[1], ref[1]
    if isinstance(parsed, pbwire.StrippedRequest):
        msg = restored(parsed.msg, parsed.payloads)
        if parsed.ids is not None:
            assert not msg.tokenized.input_ids, "ids taken and left"
            if len(parsed.ids):  # (extend([]) would make tokenized present)
                msg.tokenized.input_ids.extend(parsed.ids.tolist())
        if parsed.unpadded is not None:
            assert not msg.input_ids_unpadded, "unpadded ids taken and left"
            msg.input_ids_unpadded.extend(parsed.unpadded.tolist())
    else:
        msg = parsed
    if message is not pb.AdmitRequest:
        msg.DiscardUnknownFields()
        want.DiscardUnknownFields()
    _same_message(msg, want, f"parse_request({message.__name__}, min_bytes={min_bytes})")


def _packed(d: Data) -> None:
    field = d.int_in(1, 2**29 - 1)
    near = d.flag(70)
    raw = d.rest()
    values = np.frombuffer(raw[: len(raw) - len(raw) % 8], "<i8")
    if near:  # mostly inside [0, 2**32), some just outside
        values = values % (2**32 + 64) - 32
    a = outcome(pbwire._BUILT.packed_uint32_field, field, values)
    b = outcome(pbwalk.packed_uint32_field, field, values)
    same(a, b, "packed_uint32_field")


def count(build: Any, data: bytes, limits: Limits) -> tuple[Any, ...]:
    """``build``'s count of ``data`` (``pbwalk._Count.walk``): ("ok", walked within
    the limits, or False: not understood) or the refusal, with the request id."""
    walk = build._Count(data, limits.max_tokens, limits.max_items, limits.max_msgpack_len)
    try:
        return ("ok", walk.walk())
    except TooLarge as exc:
        return ("refused", exc.code, exc.message, walk.request_id())


def _within(d: Data) -> None:
    limits = Limits(
        max_tokens=d.int_in(0, 80), max_items=d.int_in(0, 6), max_msgpack_len=d.int_in(0, 40)
    )
    data = d.rest()
    a, b = count(pbwire._BUILT, data, limits), count(pbwalk, data, limits)
    assert a == b, f"the count: compiled {a}, interpreted {b} ({limits})"


def check_take(data: bytes, unpadded: bool) -> bool:
    """``take_ids`` on ``data`` in both builds (the compiled one when built), held to
    each other and to protobuf (also ``tests/test_pbwire.py``'s check): when it
    takes, the rest parses exactly when ``data`` does, to the same message less the
    ids, and the ids are the parsed ones. Whether it took."""
    got = pbwalk.take_ids(data, unpadded)
    if pbwire._BUILT is not None:
        same(outcome(pbwire._BUILT.take_ids, data, unpadded), ("ok", got), "take_ids builds")
    if got is None:
        return False
    small, ids, unp = got
    assert ids.dtype == np.int64 and ids.flags.writeable, "ids unlike np.array's"
    whole = outcome(pb.AdmitRequest.FromString, data, errors=(DecodeError,))
    part = outcome(pb.AdmitRequest.FromString, small, errors=(DecodeError,))
    assert whole[0] == part[0], f"take_ids: the whole message {whole[0]}, the rest {part[0]}"
    if whole[0] != "ok":
        return True
    msg, rest = whole[1], part[1]
    assert ids.tolist() == list(msg.tokenized.input_ids), "ids differ"
    if unpadded:
        got_unp = [] if unp is None else unp.tolist()
        assert got_unp == list(msg.input_ids_unpadded), "input_ids_unpadded differ"
        del msg.input_ids_unpadded[:]
    else:
        assert unp is None
    if msg.HasField("tokenized"):  # (reaching into an absent one would make it present)
        del msg.tokenized.input_ids[:]
    assert rest == msg, "take_ids: the rest parses to another message"
    same_bytes = rest.SerializeToString(deterministic=True) == msg.SerializeToString(
        deterministic=True
    )
    assert same_bytes, "take_ids: the rest serializes otherwise"
    return True


def _take(d: Data) -> None:
    unpadded = d.flag(50)
    check_take(d.rest(), unpadded)


def one(data: bytes) -> None:
    if pbwire._BUILT is None:
        return  # nothing native to compare
    d = Data(data)
    kind = d.u8()
    if kind % 2 == 0:
        _strip(d)
    elif kind % 4 == 1:
        _packed(d)
    elif kind % 8 == 3:
        _within(d)
    else:
        _take(d)
