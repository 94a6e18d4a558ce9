"""Protobuf wire-format shortcuts for the gRPC transport's hot copies.

Three things upb (the protobuf runtime) does slowly for our message shapes:

* **Request side.** ``AdmitRequest.FromString`` copies every ``bytes`` field
  into its arena (a 2.4 MB image feature: about 120 us), and reading
  ``TensorData.inline`` copies it once more into a Python ``bytes``.
  :func:`parse_admit_request` (the ``Admit`` / ``AdmitStream`` request
  deserializer, see ``grpc_server.py``) walks the wire format first and
  *strips* every large inline payload: the ``inline`` field's bytes are
  replaced by a short marker, the enclosing lengths are rewritten, and every
  other byte (unknown fields included) is kept as is. upb then parses the
  small stripped message, and the servicer turns a marker back into a
  zero-copy ``memoryview`` slice of the received bytes
  (:meth:`StrippedRequest.inline`).
* **Token ids.** upb reads a packed ``repeated uint32`` at about 7 ns a value,
  and an int64 array is then made from the repeated field. :func:`take_ids`
  (compiled only) takes ``tokenized.input_ids`` (and ``input_ids_unpadded``) out of
  the received bytes first, at about 3 ns a value, and upb parses the rest; it
  declines whatever it would not take exactly as upb parses it, and whatever upb
  refuses in the fields it takes out or rewrites.
* **Response side.** Filling a ``repeated uint32`` field from Python converts
  and range-checks element by element (about 75 us per 1K ids).
  :func:`packed_uint32_field` encodes an ``int64`` array as one packed field
  (tag, length, varints); merged into the message with ``MergeFromString``,
  upb parses it in C.

The walker is conservative: anything it does not fully understand (a
malformed or truncated message, groups, a reserved wire type, a varint over 64
bits) and anything upb refuses in the keys and lengths it reads (a key or a
length over 5 bytes: upb takes non-minimal ones of up to 5, and calls a 6th
byte "Wire format was corrupt" whatever the value; field number 0 or above
2**29 - 1) makes :func:`parse_admit_request` fall back to plain
``AdmitRequest.FromString`` on the original bytes, so a message that does not
parse fails exactly as before, with protobuf's own error. (The walks rewrite
the lengths of what they change as minimal varints: read leniently, an
over-long one would vanish and upb would take the rewritten message.) Markers
carry a per-process random nonce, so no client-sent ``inline`` value can be
mistaken for one (and a marker never leaves the process: echoed features are
the resolved tensors).

Which fields are walked (every other field is skipped whole, byte-exact)::

    AdmitRequest.mm_inputs (9)            -> MultimodalInputs
    AdmitRequest.mrope (101)              -> MropeInputs
    MultimodalInputs.items (1)            -> MultimodalItem
    MultimodalItem.encoder_input (3)      -> TensorData
    MultimodalItem.model_specific_tensors (4) -> map entry; its value (2) -> TensorData
        (only in an entry of nothing but key (1) and value (2) fields: upb keeps an
        entry with any other field whole, as an unknown field of the item)
    MropeInputs.positions (1)             -> TensorData
    TensorData.inline (3)                 -> stripped when >= STRIP_MIN_BYTES

protobuf semantics are kept whatever the field order or repetition (a
repeated sub-message merges, a repeated ``inline`` or map key: the last one
wins): only the bytes of an ``inline`` value change, so upb applies its own
rules to the stripped message, and each marker names exactly the bytes it
replaced.

The walks are :mod:`mmadmit.pbwalk`, one source in Cython's pure-Python mode
that ``setup.py`` also compiles into ``mmadmit._pbwalk_c``; ``HAVE_NATIVE``
says whether the compiled build runs (:mod:`mmadmit.native` switches it).
The limits' count and :func:`packed_uint32_field` run in whichever build is
active. The strip and the take run compiled only: interpreted, they cost more
than they save, so with native code off (or not built) nothing is stripped and
no ids are taken, and upb parses the whole message.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError
from mmadmit_client.proto import admission_pb2 as pb

from . import native, pbwalk
from .errors import AbortCode
from .limits import Limits

try:
    from . import _pbwalk_c as _BUILT  # type: ignore[attr-defined]
except ImportError:  # no compiler (or no Cython) at install time: pbwalk.py interpreted
    _BUILT = None

_compiled: Any = _BUILT  # the compiled walks when they run, else None (native.set_enabled)
_walks: Any = _BUILT or pbwalk  # the active build

__all__ = [
    "HAVE_NATIVE",
    "PRECHECK_MIN_BYTES",
    "STRIP_MIN_BYTES",
    "RefusedRequest",
    "Undecodable",
    "check_admit_limits",
    "parse_or_undecodable",
    "parse_request",
    "StrippedRequest",
    "encode_varint",
    "message_and_payloads",
    "packed_uint32_field",
    "parse_admit_request",
    "resolve_inline",
    "strip_inline_payloads",
    "take_ids",
    "ids_of",
    "unpadded_of",
    "TAKE_MIN_BYTES",
]

HAVE_NATIVE: bool = _compiled is not None


def _use_native(on: bool) -> bool:
    global _compiled, _walks, HAVE_NATIVE
    _compiled = _BUILT if on else None
    _walks = _compiled or pbwalk
    HAVE_NATIVE = _compiled is not None
    return HAVE_NATIVE


native.register(__name__, _use_native)

# Inline payloads at least this large are stripped (smaller ones cost less to
# copy than to track).
STRIP_MIN_BYTES = 64 << 10

# A marker: the process nonce + the payload's index (4 bytes, little-endian).
_NONCE = os.urandom(16)
_MARKER_LEN = len(_NONCE) + 4


# ------------------------------------------------------------------------------- varints


def encode_varint(value: int) -> bytes:
    """The protobuf varint of a non-negative int (:func:`mmadmit.pbwalk.varint`)."""
    result: bytes = _walks.varint(value)
    return result


# ------------------------------------------------------------------------ response side


def packed_uint32_field(field_number: int, values: np.ndarray) -> bytes:
    """``values`` as one packed ``repeated uint32`` field (tag, length, varints).

    Empty for an empty array (protobuf writes no empty packed field). A value
    outside ``[0, 2**32 - 1]`` raises ``ValueError("Value out of range: V")``
    for the first such value, the message protobuf's own ``extend`` gives.
    ``values`` must be a 1-D ``int64`` array.
    """
    if values.ndim != 1 or values.dtype != np.int64:
        raise TypeError(f"packed_uint32_field needs a 1-D int64 array, got {values.dtype}")
    result: bytes = _walks.packed_uint32_field(field_number, np.ascontiguousarray(values))
    return result


# ------------------------------------------------------------------------- request side


class StrippedRequest:
    """A request (``AdmitRequest``, SMG's ``GenerateRequest``) parsed without its
    large inline payloads, or without its token ids, or both.

    ``msg`` is the parsed stripped message; ``payloads`` the stripped bytes, as
    read-only ``memoryview`` slices of the received message, in wire order.
    ``ids``: the ``tokenized.input_ids`` taken out before parsing (:func:`take_ids`;
    None: they are in ``msg``); ``unpadded``: ``input_ids_unpadded`` likewise
    (None: in ``msg``, or absent).
    """

    __slots__ = ("msg", "payloads", "ids", "unpadded")

    def __init__(
        self,
        msg: Any,
        payloads: list[memoryview],
        ids: np.ndarray | None = None,
        unpadded: np.ndarray | None = None,
    ) -> None:
        self.msg = msg
        self.payloads = payloads
        self.ids = ids
        self.unpadded = unpadded

    def inline(self, td: pb.TensorData) -> memoryview:
        """``td.inline`` (``td`` of :attr:`msg`): the stripped payload, or the value's bytes."""
        return resolve_inline(td.inline, self.payloads)


def message_and_payloads(parsed: Any) -> tuple[Any, list[memoryview] | None]:
    """What :func:`parse_request` made, as (the message, the stripped payloads or
    None for a plain message)."""
    if isinstance(parsed, StrippedRequest):
        return parsed.msg, parsed.payloads
    return parsed, None


def ids_of(parsed: Any) -> np.ndarray:
    """The ``tokenized.input_ids`` of what :func:`parse_request` made, as int64: the
    ids taken before parsing, or read from the parsed message."""
    if isinstance(parsed, StrippedRequest):
        if parsed.ids is not None:
            return parsed.ids
        parsed = parsed.msg
    return np.array(parsed.tokenized.input_ids, dtype=np.int64)


def unpadded_of(parsed: Any) -> np.ndarray | None:
    """An ``AdmitRequest``'s ``input_ids_unpadded`` (of what :func:`parse_request`
    made) as int64, None when it has none."""
    if isinstance(parsed, StrippedRequest):
        if parsed.unpadded is not None:
            return parsed.unpadded if len(parsed.unpadded) else None
        parsed = parsed.msg
    values = parsed.input_ids_unpadded
    return np.array(values, dtype=np.int64) if len(values) else None


def resolve_inline(value: bytes, payloads: list[memoryview] | None) -> memoryview:
    """An ``inline`` value read from a stripped message, as the bytes it stands for."""
    if payloads and len(value) == _MARKER_LEN and value.startswith(_NONCE):
        index = int.from_bytes(value[len(_NONCE) :], "little")
        if index < len(payloads):
            return payloads[index]
    return memoryview(value)


def parse_request(
    data: bytes,
    message: Any,
    min_bytes: int = STRIP_MIN_BYTES,
    limits: Limits | None = None,
    take_min_bytes: int | None = None,
) -> Any:
    """Parse ``data`` as ``message`` (a protobuf message class whose request id,
    tokens and items have ``AdmitRequest``'s field numbers: ``AdmitRequest``, SMG's
    ``GenerateRequest``), the walks above applied.

    A :class:`StrippedRequest` when ``data`` holds at least one inline payload
    of ``min_bytes`` or more, else the plain parsed message. Raises what
    ``message.FromString(data)`` raises for bytes that do not parse. A message
    of ``take_min_bytes`` (default :data:`TAKE_MIN_BYTES`) or more once stripped
    has its token ids taken first (:func:`take_ids`), kept on the
    :class:`StrippedRequest` (:func:`ids_of`, :func:`unpadded_of` read them).

    With ``limits``, a message of :data:`PRECHECK_MIN_BYTES` or more is first
    counted from its wire bytes (:func:`check_admit_limits`); a breach is a
    :class:`RefusedRequest`, which protobuf never parses.
    """
    if limits is not None and len(data) >= PRECHECK_MIN_BYTES:
        refused = check_admit_limits(data, limits)
        if refused is not None:
            return refused
    small: Any = data
    payloads: list[memoryview] = []
    if len(data) >= min_bytes and type(data) is bytes:
        stripped = strip_inline_payloads(data, min_bytes)
        if stripped is not None:
            small, payloads = stripped
    ids = unpadded = None
    if len(small) >= (TAKE_MIN_BYTES if take_min_bytes is None else take_min_bytes):
        taken = take_ids(small, message is pb.AdmitRequest)
        if taken is not None:
            small, ids, unpadded = taken
    if small is not data:
        try:
            return StrippedRequest(message.FromString(small), payloads, ids, unpadded)
        except DecodeError:
            pass  # let the original bytes fail with protobuf's own message
    return message.FromString(data)


# Messages at least this large have their token ids taken before upb parses them
# (upb reads a packed uint32 field at about 7 ns a value; take_ids at about 2).
TAKE_MIN_BYTES = 1024


def take_ids(
    data: bytes | memoryview, unpadded: bool
) -> tuple[bytes, np.ndarray, np.ndarray | None] | None:
    """``data`` (an ``AdmitRequest`` or ``GenerateRequest``) without its
    ``tokenized.input_ids`` (and, with ``unpadded``, ``input_ids_unpadded``, field
    100 of ``AdmitRequest``), and their values as int64 arrays in wire order
    (protobuf concatenates a repeated field's occurrences, packed or not).

    ``None`` when there is nothing to take, when the compiled walks do not run
    (upb then parses the ids), and for anything the walk does not take
    exactly as upb parses it (malformed bytes, a tag or a length over 5 bytes or
    a field number upb refuses, an unexpected wire type, a value above
    ``2**32 - 1``, which upb truncates): the caller then parses ``data`` whole.
    Parsing the returned message gives what parsing ``data`` gives, less those
    fields.
    """
    if _compiled is None:
        return None
    got: tuple[bytes, np.ndarray, np.ndarray | None] | None = _compiled.take_ids(data, unpadded)
    return got


def parse_admit_request(
    data: bytes,
    min_bytes: int = STRIP_MIN_BYTES,
    limits: Limits | None = None,
    take_min_bytes: int | None = None,
) -> pb.AdmitRequest | StrippedRequest | RefusedRequest:
    """The request deserializer of ``Admit`` and ``AdmitStream`` (:func:`parse_request`)."""
    result: pb.AdmitRequest | StrippedRequest | RefusedRequest = parse_request(
        data, pb.AdmitRequest, min_bytes, limits, take_min_bytes
    )
    return result


def strip_inline_payloads(
    data: bytes, min_bytes: int = STRIP_MIN_BYTES
) -> tuple[bytes, list[memoryview]] | None:
    """``data`` (an ``AdmitRequest``) with its inline payloads of ``min_bytes`` or more
    replaced by markers, and those payloads (views on ``data``).

    ``None`` when there is nothing to strip, when the compiled walks do not
    run, or when the walker does not understand the bytes, which includes
    every key and length upb refuses (the caller then parses ``data`` as it is).
    """
    if min_bytes < 1:
        raise ValueError("strip_inline_payloads: min_bytes must be positive")
    if _compiled is None:
        return None
    result: tuple[bytes, list[memoryview]] | None = _compiled.strip_inline(data, min_bytes, _NONCE)
    return result


# ------------------------------------------------------------------- limits, pre-parse

# Messages at least this large are counted before protobuf parses them. Below it
# what upb builds is bounded by this size times its per-field overhead (an empty
# sub-message is 2 wire bytes, about 50 in upb's arena): a few MB at most.
PRECHECK_MIN_BYTES = 64 << 10


class Undecodable:
    """Bytes that do not parse as the RPC's request message: what a request
    deserializer hands the handler instead of raising, so that the call ends
    ``INVALID_ARGUMENT`` in mmadmit's words on every RPC (gRPC itself would end
    a unary call ``UNKNOWN``, naming a Python class). ``message``: protobuf's."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def parse_or_undecodable(parse: Any, data: bytes) -> Any:
    """``parse(data)``, or :class:`Undecodable` for bytes protobuf refuses."""
    try:
        return parse(data)
    except DecodeError as exc:
        return Undecodable(str(exc) or "not a protobuf message")


class RefusedRequest:
    """An ``AdmitRequest`` refused from its wire bytes, never parsed: ``request_id``
    (the last field 1 read, "" if none), the abort ``code`` and ``message``."""

    __slots__ = ("code", "message", "request_id")

    def __init__(self, request_id: str, code: AbortCode, message: str) -> None:
        self.request_id, self.code, self.message = request_id, code, message


def check_admit_limits(data: bytes | memoryview, limits: Limits) -> RefusedRequest | None:
    """Count an ``AdmitRequest``'s wire bytes against ``limits``, before any parse.

    What is counted (``max_tokens``, ``max_items``, ``max_msgpack_len``) and whom
    the refusal names: docs/spec/GRPC.md, "Limits and errors". The first breach
    is a :class:`RefusedRequest`. None within the limits, and for bytes the walk
    does not understand (protobuf then refuses them with its own error).

    The walk (:func:`mmadmit.pbwalk.limits_breach`, in the active build) visits
    each field once and stops at the first breach, so it is bounded by the
    limits, not by what the sender put in the message.
    """
    breach = _walks.limits_breach(data, limits.max_tokens, limits.max_items, limits.max_msgpack_len)
    if breach is None:
        return None
    request_id, exc = breach
    return RefusedRequest(request_id, exc.code, exc.message)
