"""The SMG gRPC face's output side: the scheduler's outputs as ``GenerateResponse``s.

:class:`Outputs` reads each ``BatchTokenIDOutSlim`` (``ENGINE_CORE_DEAD``: the
scheduler's death) and hands each rid's part to its open :class:`Call`: a
:class:`Piece`, or a :class:`Fault` when the part cannot become a response (the
call ends ``INTERNAL`` naming the field; docs/spec/SMG_GRPC.md, "Refusal").
:class:`Responses` turns a call's pieces into its chunks and ``GenerateComplete``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import msgspec
import zmq
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts

from .handshake import ENGINE_CORE_DEAD

# The face's lines, whichever of its modules writes them.
logger = logging.getLogger("mmadmit.smg_grpc")

_OUTPUT_TAG = "BatchTokenIDOutSlim"
_DEAD_LEN = len(ENGINE_CORE_DEAD)

# What a token id or count must be to go into its uint32 protobuf field.
_U32_MAX = 0xFFFF_FFFF
_U32 = Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]


class _Output(msgspec.Struct, array_like=True, gc=False):
    """TokenSpeed's ``BatchTokenIDOutSlim`` (docs/spec/WIRE.md, "Abort output as a
    frontend sees it (reference)"). Read leniently: a missing trailing element takes
    its default, the load counters are checked by hand. Every value that goes
    into a protobuf field is typed for it here (token ids and counts uint32,
    logprobs floats), so msgspec checks them while decoding, in C; an output
    that fails goes to :meth:`Outputs._on_bad_output`, which says per rid what was wrong."""

    tag: str
    rids: list[str]
    output_ids: list[list[_U32]]  # newly generated ids this step, per rid
    finished_reasons: list[Any]  # "" while generating
    prompt_tokens: list[_U32] = []
    completion_tokens: list[_U32] = []
    cached_tokens: list[_U32] = []
    # per rid: a float per new id, empty (or nil) when not asked
    logprobs_val: list[list[float] | None] = []
    logprobs_idx: list[list[_U32] | None] = []
    engine_index: Any = 0
    num_running: Any = 0
    num_waiting: Any = 0
    kv_active_pages: Any = 0
    kv_total_pages: Any = 0  # 0: no load snapshot


_OUTPUT = msgspec.msgpack.Decoder(_Output)


@dataclass
class Loads:
    """The scheduler's load counters, as its latest output reported them."""

    num_running: int = 0
    num_waiting: int = 0
    kv_active_pages: int = 0
    kv_total_pages: int = 0


class Piece(msgspec.Struct, gc=False):
    """One rid's part of one scheduler output."""

    token_ids: list[int]
    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    logprobs: list[float]  # empty when not asked (or not sent)
    logprob_ids: list[int]


def _column(values: list[Any], i: int, default: Any) -> Any:
    return values[i] if i < len(values) else default


class _BadOutput(Exception):
    """One rid's part of a scheduler output that cannot become a response; the
    message says what is wrong with it ("has output_ids[3] = 4294967296, ...")."""


class Fault:
    """Queued to a call whose scheduler output cannot become a response: it ends
    ``INTERNAL`` with ``message``."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _logprobs_of(val: list[float] | None, idx: list[int] | None) -> tuple[list[float], list[int]]:
    """One rid's logprob columns, as the decoder typed them (floats, uint32 ids): none
    when both are empty or nil; raises :class:`_BadOutput` when they do not pair up."""
    if not val and not idx:
        return [], []
    if val is None or idx is None or len(val) != len(idx):
        n = "nil" if val is None else f"{len(val)} value(s)"
        m = "nil" if idx is None else f"{len(idx)} id(s)"
        raise _BadOutput(f"has logprobs_val of {n} but logprobs_idx of {m}")
    return val, idx


def _output_logprobs(values: list[float], ids: list[int]) -> ts.OutputLogProbs | None:
    if not values:
        return None
    # one (empty) TopLogProbs per token: the gateway aligns positions by it
    return ts.OutputLogProbs(
        token_logprobs=values,
        token_ids=ids,
        top_logprobs=[ts.TopLogProbs() for _ in values],
    )


# ----------------------------------------------------------- outputs the decoder refused
#
# The slow path: only an output that fails the typed decode (or carries another tag)
# comes here. It is read as plain msgpack and each rid's part is checked field by
# field, so that each open call learns exactly what was wrong with its own part (the
# others in the same output still get theirs).

_COLUMNS = (
    "tag", "rids", "output_ids", "finished_reasons", "prompt_tokens", "completion_tokens",
    "cached_tokens", "logprobs_val", "logprobs_idx",
)  # fmt: skip
_REQUIRED = 4  # tag, rids, output_ids, finished_reasons


def _kind(value: Any) -> str:
    return "nil" if value is None else type(value).__name__


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _u32(name: str, value: Any) -> int:
    """``value`` as a uint32 protobuf field takes it, else :class:`_BadOutput`."""
    if type(value) is int and 0 <= value <= _U32_MAX:
        return value
    if isinstance(value, bool):
        raise _BadOutput(f"has {name} = {_shown(value)}, a bool where an int belongs")
    if isinstance(value, int):
        raise _BadOutput(f"has {name} = {value}, outside uint32")
    raise _BadOutput(f"has {name} = {_shown(value)}, not an int")


def _u32s(name: str, value: Any) -> list[int]:
    if not isinstance(value, list):
        raise _BadOutput(f"has {name} = {_shown(value)}, not an array")
    for k, t in enumerate(value):
        _u32(f"{name}[{k}]", t)
    return value


def _floats(name: str, value: Any) -> list[float]:
    if not isinstance(value, list):
        raise _BadOutput(f"has {name} = {_shown(value)}, not an array")
    out = []
    for k, v in enumerate(value):
        if isinstance(v, bool):
            raise _BadOutput(f"has {name}[{k}] = {_shown(v)}, a bool where a float belongs")
        if not isinstance(v, int | float):
            raise _BadOutput(f"has {name}[{k}] = {_shown(v)}, not a number")
        out.append(float(v))
    return out


def _part_of(raw: list[Any], i: int) -> Piece:
    """Rid ``i``'s part of a leniently decoded output, checked field by field (the
    typed decoder's rules, with a message); raises :class:`_BadOutput`."""

    def entry(j: int, default: Any) -> Any:
        name = _COLUMNS[j]
        if j >= len(raw):
            if j < _REQUIRED:
                raise _BadOutput(f"has no {name} column ({len(raw)} elements)")
            return default  # a missing trailing element
        column = raw[j]
        if not isinstance(column, list):
            raise _BadOutput(f"has {name} = {_shown(column)}, not an array (one entry per rid)")
        return column[i] if i < len(column) else default

    ids = _u32s("output_ids", entry(2, []))
    reason = _reason_text(entry(3, None))
    counts = [_u32(_COLUMNS[j], entry(j, 0)) for j in (4, 5, 6)]
    val, idx = entry(7, None), entry(8, None)
    values = None if val is None else _floats("logprobs_val", val)
    lp_ids = None if idx is None else _u32s("logprobs_idx", idx)
    logprobs, logprob_ids = _logprobs_of(values, lp_ids)
    return Piece(ids, reason, counts[0], counts[1], counts[2], logprobs, logprob_ids)


def _array_at(data: bytes, pos: int) -> tuple[int, int]:
    b = data[pos]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F, pos + 1
    width = {0xDC: 2, 0xDD: 4}.get(b)
    if width is None or pos + 1 + width > len(data):
        raise ValueError("not an array")
    return int.from_bytes(data[pos + 1 : pos + 1 + width], "big"), pos + 1 + width


def _str_at(data: bytes, pos: int) -> tuple[str, int]:
    b = data[pos]
    if 0xA0 <= b <= 0xBF:
        n, pos = b & 0x1F, pos + 1
    else:
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4}.get(b)
        if width is None or pos + 1 + width > len(data):
            raise ValueError("not a string")
        n, pos = int.from_bytes(data[pos + 1 : pos + 1 + width], "big"), pos + 1 + width
    if pos + n > len(data):
        raise ValueError("truncated")
    return data[pos : pos + n].decode(), pos + n


def _rids_in(data: bytes) -> list[str]:
    """The rids at the head of bytes that are not one msgpack value (truncated,
    trailing bytes, a reserved byte further on): an array whose first element is a
    string and whose second is an array of strings, read as far as it is sound."""
    rids: list[str] = []
    try:
        n, pos = _array_at(data, 0)
        if n < 2:
            return rids
        pos = _str_at(data, pos)[1]
        count, pos = _array_at(data, pos)
        for _ in range(count):
            rid, pos = _str_at(data, pos)
            rids.append(rid)
    except (IndexError, ValueError):  # UnicodeDecodeError is a ValueError
        pass
    return rids


# kind -> (loop time of the last line, lines left out since)
_WARNED: dict[str, list[float]] = {}
WARN_EVERY_S = 60.0


def _warn(kind: str, text: str, *args: Any) -> None:
    """A warning line per ``kind`` at most every ``WARN_EVERY_S`` (a scheduler that
    sends bad outputs sends many); the next line says how many were left out."""
    now = time.monotonic()
    seen = _WARNED.get(kind)
    if seen is not None and now - seen[0] < WARN_EVERY_S:
        seen[1] += 1
        return
    left_out = int(seen[1]) if seen is not None else 0
    _WARNED[kind] = [now, 0]
    suffix = f" ({left_out} more like it not logged in the last {WARN_EVERY_S:.0f}s)"
    logger.warning(text + (suffix if left_out else ""), *args)


def _reason_text(reason: Any) -> str:
    """A finished reason as the face reports it: "" (not finished), "stop", "length",
    "abort" (a map ``{type: ...}`` as some schedulers send is read by its type)."""
    if not reason:
        return ""
    if isinstance(reason, dict):
        reason = reason.get("type", "stop")
    text = str(reason)
    return text if text in ("stop", "length", "abort") else "stop"


class Call:
    """One forwarded request: the queue its outputs arrive on."""

    __slots__ = ("queue", "stream", "finished", "aborted")

    def __init__(self, stream: bool) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.stream = stream
        self.finished = False
        self.aborted = False


class _Counts(Protocol):
    """The face's counters (``SmgStats``) that :class:`Outputs` keeps."""

    output_messages: int
    outputs_untracked: int
    outputs_bad: int
    outputs_undecodable: int


class Outputs:
    """The scheduler's outputs to the open ``calls`` (rid -> :class:`Call`), as the
    output socket's reader callback; ``on_dead(why)`` for ``ENGINE_CORE_DEAD``."""

    def __init__(
        self, calls: dict[str, Call], stats: _Counts, on_dead: Callable[[str], None]
    ) -> None:
        self.calls = calls
        self.stats = stats
        self.on_dead = on_dead
        self.loads = Loads()  # as the latest output with a load snapshot reported them

    def __call__(self, frames: list[zmq.Frame]) -> None:
        """One scheduler output: each rid's part to its call. An output the typed
        decoder refuses, or tagged otherwise, goes to :meth:`_on_bad_output`."""
        stats = self.stats
        stats.output_messages += 1
        first = frames[0]
        if len(frames) == 1 and len(first) == _DEAD_LEN and first.bytes == ENGINE_CORE_DEAD:
            self.on_dead("it sent ENGINE_CORE_DEAD")
            return
        try:
            out = _OUTPUT.decode(first.buffer)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._on_bad_output(first.bytes, exc)
            return
        if out.tag != _OUTPUT_TAG:
            self._on_bad_output(first.bytes, None)
            return
        loads = (out.num_running, out.num_waiting, out.kv_active_pages, out.kv_total_pages)
        if all(type(v) is int and v >= 0 for v in loads) and out.kv_total_pages:
            self.loads = Loads(*loads)  # kv_total_pages 0: no snapshot in this output
        calls = self.calls
        for i, rid in enumerate(out.rids):
            call = calls.get(rid)
            if call is None:
                stats.outputs_untracked += 1
                continue
            try:
                values, ids = _logprobs_of(
                    _column(out.logprobs_val, i, None), _column(out.logprobs_idx, i, None)
                )
            except _BadOutput as exc:
                self._bad_part(rid, call, str(exc))
                continue
            call.queue.put_nowait(
                Piece(
                    _column(out.output_ids, i, []),
                    _reason_text(_column(out.finished_reasons, i, None)),
                    _column(out.prompt_tokens, i, 0),
                    _column(out.completion_tokens, i, 0),
                    _column(out.cached_tokens, i, 0),
                    values,
                    ids,
                )
            )

    def _on_bad_output(self, data: bytes, error: Exception | None) -> None:
        """An output the typed decoder refused (``error``) or tagged otherwise: read
        leniently, each open call's part goes to it when sound, else the call ends
        ``INTERNAL`` saying what was wrong; an output naming no open call is counted
        (``outputs_undecodable``) and logged."""
        calls = self.calls
        try:
            raw = msgspec.msgpack.decode(data)
        except msgspec.DecodeError as exc:  # not one msgpack value: its rids, if legible
            why = f"does not decode as msgpack ({exc})"
            found = [(rid, calls.get(rid)) for rid in dict.fromkeys(_rids_in(data))]
            for rid, call in found:
                if call is not None:
                    self._bad_part(rid, call, why)
            if not any(call is not None for _, call in found):
                self._undecodable("msgpack", "does not decode as msgpack (%s)", exc)
            return
        if not (isinstance(raw, list) and len(raw) >= 2 and isinstance(raw[1], list)):
            self._undecodable(
                "shape", "is not a BatchTokenIDOutSlim array (msgpack %s; %s)", _kind(raw), error
            )
            return
        tag = raw[0]
        wrong_tag = None if tag == _OUTPUT_TAG else f"is tagged {tag!r}, not {_OUTPUT_TAG!r}"
        named = 0
        for i, rid in enumerate(raw[1]):
            call = calls.get(rid) if isinstance(rid, str) else None
            if call is None:
                self.stats.outputs_untracked += 1
                continue
            named += 1
            if wrong_tag is not None:
                self._bad_part(rid, call, wrong_tag)
                continue
            try:
                piece = _part_of(raw, i)
            except _BadOutput as exc:
                self._bad_part(rid, call, str(exc))
                continue
            call.queue.put_nowait(piece)
        if not named:
            self._undecodable("rids", "names no open call in its rids (%s)", wrong_tag or error)

    def _bad_part(self, rid: str, call: Call, why: str) -> None:
        """``rid``'s part of an output cannot become a response: its call ends INTERNAL."""
        self.stats.outputs_bad += 1
        message = f"the scheduler's output for request {rid!r} {why}"
        _warn("bad part", "SMG gRPC face: %s; the call ends INTERNAL", message)
        call.queue.put_nowait(Fault(message))

    def _undecodable(self, kind: str, text: str, *args: Any) -> None:
        self.stats.outputs_undecodable += 1
        _warn(kind, "SMG gRPC face: a scheduler output " + text + "; dropped", *args)


class Responses:
    """One call's pieces as ``GenerateResponse``s: a chunk per piece (when ``stream``),
    then the ``GenerateComplete`` (all the output ids and logprobs when not streaming)."""

    def __init__(self, rid: str, stream: bool) -> None:
        self.rid = rid
        self.stream = stream
        self.generated: list[int] = []
        self.logprobs: list[float] = []
        self.logprob_ids: list[int] = []

    def of(self, piece: Piece) -> tuple[ts.GenerateResponse | None, ts.GenerateResponse | None]:
        """(chunk, complete) for the next piece; protobuf raises TypeError, ValueError
        or OverflowError for a value it refuses (a bug of ours: checked when read)."""
        rid, stream, finished = self.rid, self.stream, bool(piece.reason)
        chunk = complete = None
        if stream and (piece.token_ids or not self.generated or finished):
            chunk = ts.GenerateResponse(
                request_id=rid,
                chunk=ts.GenerateStreamChunk(
                    token_ids=piece.token_ids,
                    prompt_tokens=piece.prompt_tokens,
                    completion_tokens=piece.completion_tokens,
                    cached_tokens=piece.cached_tokens,
                    output_logprobs=_output_logprobs(piece.logprobs, piece.logprob_ids),
                ),
            )
        self.generated.extend(piece.token_ids)
        self.logprobs.extend(piece.logprobs)
        self.logprob_ids.extend(piece.logprob_ids)
        if finished:
            complete = ts.GenerateResponse(
                request_id=rid,
                complete=ts.GenerateComplete(
                    output_ids=piece.token_ids if stream else self.generated,
                    finish_reason=piece.reason,
                    prompt_tokens=piece.prompt_tokens,
                    completion_tokens=piece.completion_tokens,
                    cached_tokens=piece.cached_tokens,
                    output_logprobs=(
                        _output_logprobs(piece.logprobs, piece.logprob_ids)
                        if stream
                        else _output_logprobs(self.logprobs, self.logprob_ids)
                    ),
                ),
            )
        return chunk, complete


__all__ = ["Call", "Fault", "Loads", "Outputs", "Piece", "Responses"]
