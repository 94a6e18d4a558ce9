"""The SMG gRPC face: SMG's ``TokenSpeedScheduler`` worker contract in front of a scheduler.

SMG 1.13 sends the M-RoPE families (Qwen2/2.5-VL, Qwen3-VL, Qwen3.5,
Qwen3-Omni) to an engine only over its gRPC transport, preprocessed, with the
placeholder token repeated in ``input_ids`` and no positions (docs/spec/SMG_GRPC.md).
This face serves that contract (``tokenspeed.grpc.scheduler.TokenSpeedScheduler``,
taken from the ``smg-grpc-proto`` package, never a hand copy) and stands, as
SMG would, in front of a headless scheduler that connects to
``--engine-handshake-listen`` (:class:`~mmadmit.scheduler_link.SchedulerLink`,
the handshake engine mode uses)::

    SMG --Generate--> face --ADD / ABORT (msgpack)--> scheduler
        <--chunks, Complete--  <--BatchTokenIDOutSlim--

A ``Generate`` call:

1. **decode**: the request deserializer strips large inline tensors without
   copying them (:func:`~mmadmit.pbwire.parse_admit_request`: the
   ``GenerateRequest`` fields it walks have ``AdmitRequest``'s numbers) and
   counts the limits from the wire bytes; :func:`request_from_generate` turns
   the message into the internal request, its items through the gRPC
   admission API's own item translation (:mod:`mmadmit.servicer`), and the
   ``TokenizedGenerateReqInput`` envelope SMG's msgpack encoder would write
   (sampling parameters, ``stream``, logprob options, the KV bootstrap), and
   each ``encode_bootstrap_info`` entry (EPD) as its item's ``encode_handshake``;
2. **admit**: one :class:`~mmadmit.admission.Admissions` (the same registry,
   pool and outcome counting as every other transport, label ``smg_grpc``);
3. **forward**: the materialized request goes to the scheduler as an ADD under
   the call's ``request_id``; a refused one never reaches it and the call ends
   with the status of docs/spec/SMG_GRPC.md's table, its message starting with
   mmadmit's code;
4. **outputs**: each ``BatchTokenIDOutSlim`` from the scheduler is read
   leniently (rids, token ids, finish reasons, token counts, load counters)
   and each rid's part becomes a ``GenerateStreamChunk`` (when ``stream``) and,
   once finished, a ``GenerateComplete``; then the stream ends. The scheduler's
   own ``"abort"`` is a ``GenerateComplete`` with finish reason ``abort``, what
   SMG shows its client on the msgpack path too.

``Abort`` and a cancelled call: a request still materializing is cancelled
there and never reaches the scheduler; one already forwarded gets an ABORT
after its ADD (one FIFO carries both) and its stream ends at once (SMG keeps
the stream open after ``Abort`` and cancels it itself only 30 s later).

Death and drain are engine mode's: when the scheduler goes away every open
call ends ``UNAVAILABLE`` and ``on_gone`` fires (``mmadmit serve`` exits 3);
at SIGTERM new calls end ``UNAVAILABLE`` (``SHUTTING_DOWN``) while outputs of
forwarded requests keep flowing until each finished or the drain deadline.

Non-goals: what the msgpack wire cannot carry (tokenizer streaming, KV-event
subscription, profiling, cache flush: ``UNIMPLEMENTED`` with a message),
``n > 1`` (the scheduler's rid scheme for choices is the in-process frontend's).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _package_version
from typing import Annotated, Any

import grpc
import msgspec
import zmq
import zmq.asyncio
from google.protobuf import struct_pb2
from smg_grpc_proto import tokenspeed_scheduler_pb2 as ts
from smg_grpc_proto.generated import common_pb2

from . import wire
from .admission import Admissions, AdmissionStats
from .errors import (
    Abort,
    AbortCode,
    AdmissionError,
    InvalidRequest,
    ShuttingDown,
    Unsupported,
    abort_from_exception,
)
from .handshake import ENGINE_CORE_DEAD
from .limits import Limits
from .model import Materialized, Modality, MultimodalInputs, Request
from .pbwire import (
    RefusedRequest,
    StrippedRequest,
    Undecodable,
    ids_of,
    message_and_payloads,
    parse_or_undecodable,
    parse_request,
)
from .pool import MaterializerPool
from .profile import ModelProfile
from .scheduler_link import SchedulerLink, SchedulerStats
from .servicer import attach_encode_handshakes, items_from_proto
from .telemetry import Telemetry
from .zsock import WATCHDOG_S, OrderedSender, SocketReader

logger = logging.getLogger(__name__)

TRANSPORT = "smg_grpc"
try:
    _VERSION = "mmadmit " + _package_version("mmadmit")
except PackageNotFoundError:  # pragma: no cover - run from a source tree
    _VERSION = "mmadmit"
SERVICE = ts.DESCRIPTOR.services_by_name["TokenSpeedScheduler"].full_name

# mmadmit's abort code -> the status a refused Generate ends with (docs/spec/SMG_GRPC.md).
STATUS_OF: dict[AbortCode, grpc.StatusCode] = {
    AbortCode.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.TEXT_ONLY_MODEL: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.UNSUPPORTED: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.TOO_LARGE: grpc.StatusCode.INVALID_ARGUMENT,
    AbortCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    AbortCode.SHUTTING_DOWN: grpc.StatusCode.UNAVAILABLE,
    AbortCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    AbortCode.CANCELLED: grpc.StatusCode.CANCELLED,
    AbortCode.INTERNAL: grpc.StatusCode.INTERNAL,
}

# The sender's pending bound for ADD / ABORT messages that libzmq has not taken
# yet (a scheduler that stops reading). Nothing pauses on it: what queues is
# bounded by the calls gRPC lets in (--max-grpc-streams), each waiting for its
# outputs.
MAX_PENDING_ADDS = 4096

_ADD = bytes([wire.MSG_ADD])
_ABORT = bytes([wire.MSG_ABORT])
_ENC = msgspec.msgpack.Encoder()
_OUTPUT_TAG = "BatchTokenIDOutSlim"
_DEAD_LEN = len(ENGINE_CORE_DEAD)
_MODALITIES = {
    Modality.IMAGE: common_pb2.IMAGE,
    Modality.VIDEO: common_pb2.VIDEO,
    Modality.AUDIO: common_pb2.AUDIO,
}


# --------------------------------------------------------------------------- request side

# TokenSpeed's SamplingParams on the msgpack wire: an untagged positional array
# (docs/spec/WIRE.md). The defaults are what SMG 1.13's own msgpack encoder sends for a
# request that sets nothing (captured from the real gateway): already normalized,
# top_k "all" as 1 << 30, n 1, no stop strings.
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
    msgpack encoder sends it: ``top_k`` of 0 or less is "all" (``1 << 30``), stop
    strings go in ``stop_strs`` with ``stop_str_max_len`` their longest byte
    length (an over-estimate of their token count, which the scheduler's stop
    check tolerates; mmadmit holds no tokenizer), ``is_normalized`` set."""
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


# --------------------------------------------------------------------------- output side

# What a token id or count must be to go into its uint32 protobuf field.
_U32_MAX = 0xFFFF_FFFF
_U32 = Annotated[int, msgspec.Meta(ge=0, le=_U32_MAX)]


class _Output(msgspec.Struct, array_like=True, gc=False):
    """TokenSpeed's ``BatchTokenIDOutSlim`` (14 elements: the tag, eight per-rid
    columns, ``engine_index``, four load counters; SMG's decoder reads the same
    and skips anything after). Read leniently: a missing trailing element takes
    its default, the load counters are checked by hand. Every value that goes
    into a protobuf field is typed for it here (token ids and counts uint32,
    logprobs floats), so msgspec checks them while decoding, in C; an output
    that fails goes to :func:`_faults_of`, which says per rid what was wrong."""

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


class _Piece(msgspec.Struct, gc=False):
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


class _Fault:
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


def _part_of(raw: list[Any], i: int) -> _Piece:
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
    return _Piece(ids, reason, counts[0], counts[1], counts[2], logprobs, logprob_ids)


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


_DEAD = object()  # the scheduler went away
_ABORTED = object()  # an Abort call ended it
_STOPPED = object()  # the face stopped (drain deadline)


class _Call:
    """One forwarded request: the queue its outputs arrive on."""

    __slots__ = ("queue", "stream", "finished", "aborted")

    def __init__(self, stream: bool) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.stream = stream
        self.finished = False
        self.aborted = False


@dataclass
class SmgStats(SchedulerStats, AdmissionStats):
    """The face's counters (``mmadmit_smg_grpc_*`` and the outcome counts)."""

    generate_calls: int = 0  # Generate calls received
    adds_sent: int = 0  # ADDs handed to the scheduler's input
    aborts_sent: int = 0  # ABORTs handed to the scheduler's input
    abort_calls: int = 0  # Abort RPCs that ended a request
    calls_cancelled: int = 0  # Generate calls the client cancelled
    completes: int = 0  # GenerateComplete sent
    chunks: int = 0  # GenerateStreamChunk sent
    output_messages: int = 0  # scheduler outputs read
    outputs_untracked: int = 0  # rids' parts of outputs for no open call
    outputs_bad: int = 0  # calls ended INTERNAL: their part of an output was unusable
    outputs_undecodable: int = 0  # unusable outputs naming no open call (logged)
    undeliverable: int = 0  # ADD / ABORT messages libzmq refused
    received_bytes: int = 0  # bytes of GenerateRequest messages
    open_calls: int = 0  # forwarded requests without a finished output yet
    wakeups: int = 0  # output reader callbacks run
    watchdog_reads: int = 0  # output reads started by the watchdog


def _status_message(abort: Abort) -> str:
    return f"{abort.code.value}: {abort.message}"


class SmgGrpcFace(SchedulerLink):
    """The RPCs of ``TokenSpeedScheduler`` over the shared pool and one scheduler.

    Lifecycle (``mmadmit.server``)::

        face = SmgGrpcFace(pool, profile, listen=..., engine_index=0, ...)
        await face.bind()            # the scheduler may connect from now on
        await face.handshake()       # the scheduler's; then HealthCheck is healthy
        ...                          # the gRPC server serves face.handlers()
        await face.drain(deadline)   # SIGTERM: forwarded requests finish
        await face.stop()            # every open call ends; idempotent
    """

    stats: SmgStats

    def __init__(
        self,
        pool: MaterializerPool,
        profile: ModelProfile,
        *,
        listen: str,
        engine_index: int,
        handshake_timeout_s: float,
        served_model_name: str,
        model_path: str,
        telemetry: Telemetry | None = None,
        on_gone: Callable[[str], None] | None = None,
        watchdog_s: float | None = WATCHDOG_S,
    ) -> None:
        super().__init__(
            listen=listen,
            engine_index=engine_index,
            handshake_timeout_s=handshake_timeout_s,
            stats=SmgStats(),
            on_gone=on_gone,
        )
        self.pool = pool
        self.profile = profile
        self.limits = pool.materializer.limits
        self.served_model_name = served_model_name
        self.model_path = model_path
        self.admissions = Admissions(
            pool, transport=TRANSPORT, telemetry=telemetry, stats=self.stats
        )
        self.ready = False  # the scheduler's handshake is done
        self.draining = False
        self.loads = Loads()
        self.started_at = time.time()
        self._watchdog_s = watchdog_s
        self._calls: dict[str, _Call] = {}
        self._sender: OrderedSender | None = None
        self._reader: SocketReader | None = None
        self._ready_info: dict[str, Any] = {}
        self._stop_task: asyncio.Future[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def handshake(self) -> None:
        """The scheduler's handshake, then the request and output paths start."""
        await self.handshake_scheduler()
        assert self._ready_response is not None and self._in_down is not None
        assert self._pull is not None
        try:
            info = msgspec.msgpack.decode(self._ready_response.bytes)
            self._ready_info = info if isinstance(info, dict) else {}
        except msgspec.DecodeError:  # validated by the handshake; keep going without it
            self._ready_info = {}
        self._sender = OrderedSender(
            self._in_down,
            max_pending=MAX_PENDING_ADDS,
            on_sent=_ignore,
            on_failed=self._send_failed,
            prefix=[self._scheduler_identity],
            name="smg-grpc-scheduler-input",
        )
        self._sender.start()
        self._reader = SocketReader(
            self._pull,
            self._on_output,
            stats=self.stats,
            name="scheduler output",
            watchdog_s=self._watchdog_s,
        )
        self._reader.start()
        self.ready = True
        logger.info("SMG gRPC face: serving %s for the scheduler", self.served_model_name)

    def _on_death(self, why: str) -> None:
        self.ready = False
        for call in self._calls.values():
            call.queue.put_nowait(_DEAD)

    def begin_drain(self) -> None:
        """SIGTERM: HealthCheck turns unhealthy, new calls end UNAVAILABLE
        (``SHUTTING_DOWN``); forwarded requests go on."""
        self.draining = True
        self.admissions.closing = True

    async def drain(self, deadline: float) -> int:
        """Wait until every forwarded request has finished or ``deadline`` (loop
        time), new calls refused meanwhile; return how many had not finished."""
        self.begin_drain()
        loop = asyncio.get_running_loop()
        while self._calls and not self._dead and loop.time() < deadline:
            await asyncio.sleep(min(0.01, max(0.0, deadline - loop.time())))
        left = len(self._calls)
        if left and not self._dead:
            logger.warning(
                "[shutdown] %d forwarded request(s) without a finished output at the drain "
                "deadline; their calls end UNAVAILABLE",
                left,
            )
        return left

    async def stop(self) -> None:
        """End every open call, close the scheduler's sockets (idempotent)."""
        if self._stop_task is None:
            self._stop_task = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stop_task)

    async def _stop(self) -> None:
        self._stopping = True
        self.ready = False
        for call in self._calls.values():
            call.queue.put_nowait(_STOPPED)
        await asyncio.sleep(0)  # let the calls see it before the sockets go
        if self._sender is not None:
            await self._sender.stop()
        if self._reader is not None:
            self._reader.stop()
        await self._close()
        logger.info("[shutdown] SMG gRPC face stopped (%s)", self.stats)

    # ------------------------------------------------------------------ to the scheduler

    def _send(self, frames: list[Any]) -> None:
        sender = self._sender
        assert sender is not None
        sender.add_pending()
        sender.put(frames)

    def _send_failed(self, msg: list[Any], exc: BaseException) -> None:
        self.stats.undeliverable += 1
        logger.warning("SMG gRPC face: a message could not reach the scheduler (%s)", exc)

    def _send_abort(self, rid: str) -> None:
        self.stats.aborts_sent += 1
        self._send([_ABORT, _ENC.encode([rid])])

    # ------------------------------------------------------------------ from the scheduler

    def _on_output(self, frames: list[zmq.Frame]) -> None:
        """One scheduler output: each rid's part to its call. An output the typed
        decoder refuses, or tagged otherwise, goes to :meth:`_on_bad_output`."""
        stats = self.stats
        stats.output_messages += 1
        first = frames[0]
        if len(frames) == 1 and len(first) == _DEAD_LEN and first.bytes == ENGINE_CORE_DEAD:
            self._scheduler_died("it sent ENGINE_CORE_DEAD")
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
        calls = self._calls
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
                _Piece(
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
        calls = self._calls
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

    def _bad_part(self, rid: str, call: _Call, why: str) -> None:
        """``rid``'s part of an output cannot become a response: its call ends INTERNAL."""
        self.stats.outputs_bad += 1
        message = f"the scheduler's output for request {rid!r} {why}"
        _warn("bad part", "SMG gRPC face: %s; the call ends INTERNAL", message)
        call.queue.put_nowait(_Fault(message))

    def _undecodable(self, kind: str, text: str, *args: Any) -> None:
        self.stats.outputs_undecodable += 1
        _warn(kind, "SMG gRPC face: a scheduler output " + text + "; dropped", *args)

    # ------------------------------------------------------------------ RPCs

    async def Generate(  # noqa: N802 - the contract's method name
        self,
        request: ts.GenerateRequest | StrippedRequest | RefusedRequest | Undecodable,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ts.GenerateResponse]:
        t0 = time.perf_counter()
        self.stats.generate_calls += 1
        if isinstance(request, RefusedRequest):
            await self._refuse(
                context, request.request_id, None, Abort(request.code, request.message), t0
            )
            return
        if isinstance(request, Undecodable):
            why = f"the message does not parse as a GenerateRequest ({request.message})"
            await self._refuse(context, "", None, Abort(AbortCode.INVALID_REQUEST, why), t0)
            return
        msg = message_and_payloads(request)[0]
        rid = msg.request_id
        if not self.ready or self._dead or self.draining:
            why = (
                "the service is shutting down; retry on another replica"
                if self.draining or self._stopping
                else "the scheduler is not connected"
            )
            await self._refuse(context, rid, None, Abort(AbortCode.SHUTTING_DOWN, why), t0)
            return
        req: Request | None = None
        try:
            req = request_from_generate(request, self.profile, self.limits)
            if rid in self._calls:  # forwarded, still generating
                raise self.admissions.duplicate(rid)
        except AdmissionError as exc:
            await self._refuse(context, rid, req, exc.to_abort(), t0)
            return
        except Exception as exc:  # noqa: BLE001 - a bug must still end the call with a status
            logger.exception("rid=%s: unexpected error while translating", rid)
            await self._refuse(context, rid, req, abort_from_exception(exc), t0)
            return
        try:
            frames = await self.admissions.admit((b"", rid), req, self._add_frames, t0)
        except asyncio.CancelledError:
            self.stats.calls_cancelled += 1
            raise
        if isinstance(frames, Abort):
            await self._end(context, rid, frames)
            return
        # No await since the outcome was encoded: a twin of this rid was refused at
        # submit, and the scheduler was there (see _add_frames).
        call = self._calls[rid] = _Call(msg.stream)
        self.stats.open_calls = len(self._calls)
        self.stats.adds_sent += 1
        self._send(frames)
        try:
            async for response in self._responses(rid, call, context):
                yield response
        except asyncio.CancelledError:
            self.stats.calls_cancelled += 1
            logger.info("rid=%s: Generate cancelled by the client; ABORT to the scheduler", rid)
            raise
        finally:
            if not call.finished and not call.aborted and not self._dead and not self._stopping:
                call.aborted = True
                self._send_abort(rid)  # after its ADD: one FIFO
            if self._calls.get(rid) is call:
                del self._calls[rid]
            self.stats.open_calls = len(self._calls)

    def _add_frames(self, outcome: Materialized | Abort) -> list[Any] | Abort:
        """The ladder's ``encode``: the scheduler's ADD for a materialized request
        (an abort stays itself, for :meth:`_end`)."""
        if isinstance(outcome, Abort):
            return outcome
        if not self.ready:  # the scheduler went while this request materialized
            raise ShuttingDown("the scheduler went away")
        return [_ADD, *wire.encode_request(outcome.request)]

    async def _responses(
        self, rid: str, call: _Call, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ts.GenerateResponse]:
        generated: list[int] = []
        logprobs: list[float] = []
        logprob_ids: list[int] = []
        while True:
            piece = await call.queue.get()
            if piece is _ABORTED:
                await context.abort(
                    grpc.StatusCode.CANCELLED,
                    f"CANCELLED: request {rid!r} aborted by an Abort call",
                )
            if piece is _DEAD:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE, "SHUTTING_DOWN: the scheduler went away"
                )
            if piece is _STOPPED:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    "SHUTTING_DOWN: the service stopped before this request finished",
                )
            if type(piece) is _Fault:
                await self._end(context, rid, Abort(AbortCode.INTERNAL, piece.message))
            assert isinstance(piece, _Piece)
            finished = bool(piece.reason)
            chunk = complete = None
            try:  # checked when read (_Output, _part_of): a failure here is a bug of ours
                if call.stream and (piece.token_ids or not generated or finished):
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
                generated.extend(piece.token_ids)
                logprobs.extend(piece.logprobs)
                logprob_ids.extend(piece.logprob_ids)
                if finished:
                    complete = ts.GenerateResponse(
                        request_id=rid,
                        complete=ts.GenerateComplete(
                            output_ids=piece.token_ids if call.stream else generated,
                            finish_reason=piece.reason,
                            prompt_tokens=piece.prompt_tokens,
                            completion_tokens=piece.completion_tokens,
                            cached_tokens=piece.cached_tokens,
                            output_logprobs=(
                                _output_logprobs(piece.logprobs, piece.logprob_ids)
                                if call.stream
                                else _output_logprobs(logprobs, logprob_ids)
                            ),
                        ),
                    )
            except (TypeError, ValueError, OverflowError) as exc:
                self.stats.outputs_bad += 1
                logger.exception(
                    "rid=%s: a scheduler output passed the checks but not protobuf", rid
                )
                why = f"the scheduler's output for request {rid!r} cannot become a response"
                await self._end(
                    context, rid, Abort(AbortCode.INTERNAL, f"{why} ({type(exc).__name__}: {exc})")
                )
            if chunk is not None:
                self.stats.chunks += 1
                yield chunk
            if complete is not None:
                call.finished = True
                self.stats.completes += 1
                yield complete
                return

    async def _refuse(
        self,
        context: grpc.aio.ServicerContext,
        rid: str,
        req: Request | None,
        abort: Abort,
        t0: float,
    ) -> None:
        """End a call that never reached the pool (counted once, as its outcome:
        ``requests_total{transport="smg_grpc",outcome="aborted"}``)."""
        await self._end(context, rid, self.admissions.finish(rid, req, abort, t0, _same))

    async def _end(self, context: grpc.aio.ServicerContext, rid: str, abort: Abort) -> None:
        """End a call with the status of its abort (STATUS_OF, "CODE: message")."""
        logger.debug("rid=%s: ended %s: %s", rid, abort.code.value, abort.message)
        await context.abort(STATUS_OF[abort.code], _status_message(abort))

    async def Abort(  # noqa: N802
        self, request: ts.AbortRequest, context: grpc.aio.ServicerContext
    ) -> ts.AbortResponse:
        rid = request.request_id
        reason = request.reason or "no reason given"
        if self.admissions.cancel((b"", rid), AbortCode.CANCELLED, f"aborted: {reason}"):
            self.stats.abort_calls += 1
            logger.info("rid=%s: aborted by SMG while materializing (%s)", rid, reason)
            return ts.AbortResponse(success=True, message=f"request {rid!r} cancelled")
        call = self._calls.get(rid)
        if call is None or call.finished or call.aborted:
            return ts.AbortResponse(
                success=False, message=f"no request {rid!r} is in flight on this replica"
            )
        call.aborted = True
        self.stats.abort_calls += 1
        self._send_abort(rid)  # after its ADD: one FIFO
        call.queue.put_nowait(_ABORTED)  # the open stream ends now
        logger.info("rid=%s: aborted by SMG (%s); ABORT to the scheduler", rid, reason)
        return ts.AbortResponse(success=True, message=f"request {rid!r} aborted")

    async def HealthCheck(  # noqa: N802
        self, request: ts.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> ts.HealthCheckResponse:
        if self._dead:
            return ts.HealthCheckResponse(healthy=False, message="the scheduler went away")
        if self.draining or self._stopping:
            return ts.HealthCheckResponse(healthy=False, message="shutting down")
        if not self.ready:
            return ts.HealthCheckResponse(
                healthy=False, message="waiting for the scheduler's handshake"
            )
        return ts.HealthCheckResponse(healthy=True, message="ok")

    def model_info(self) -> ts.GetModelInfoResponse:
        profile = self.profile
        info = self._ready_info
        max_len = info.get("max_model_len") or profile.max_model_len or 0
        modalities = [
            _MODALITIES[m] for m in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO)
            if profile.multimodal_active and profile.supports(m)
        ]  # fmt: skip
        dtype = info.get("dtype")
        encoder_dtype = info.get("multimodal_encoder_dtype")
        return ts.GetModelInfoResponse(
            model_path=self.model_path,
            tokenizer_path=self.model_path,
            served_model_name=self.served_model_name,
            model_type=profile.model_type,
            architectures=list(profile.architectures),
            max_context_length=int(max_len) if isinstance(max_len, int) else 0,
            max_req_input_len=int(max_len) if isinstance(max_len, int) else 0,
            vocab_size=profile.vocab_size,
            supports_vision=common_pb2.IMAGE in modalities or common_pb2.VIDEO in modalities,
            supports_multimodal=bool(modalities),
            supported_modalities=modalities,
            model_dtype=dtype if isinstance(dtype, str) else "",
            multimodal_encoder_dtype=encoder_dtype if isinstance(encoder_dtype, str) else "",
        )

    async def GetModelInfo(  # noqa: N802
        self, request: ts.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetModelInfoResponse:
        return self.model_info()

    async def GetServerInfo(  # noqa: N802
        self, request: ts.GetServerInfoRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetServerInfoResponse:
        resp = ts.GetServerInfoResponse(
            active_requests=len(self._calls) + len(self.admissions),
            is_paused=False,
            uptime_seconds=time.time() - self.started_at,
            tokenspeed_version=_VERSION,
        )
        resp.start_time.FromSeconds(int(self.started_at))
        resp.server_args.update(
            {
                "served_model_name": self.served_model_name,
                "model_path": self.model_path,
                "family": self.profile.family.value,
                "engine_index": self.engine_index,
                "max_inflight": self.pool.max_inflight,
            }
        )
        scheduler = {
            k: v for k, v in self._ready_info.items() if isinstance(v, str | int | float | bool)
        }
        resp.scheduler_info.update(scheduler)
        return resp

    async def GetLoads(  # noqa: N802
        self, request: ts.GetLoadsRequest, context: grpc.aio.ServicerContext
    ) -> ts.GetLoadsResponse:
        loads = self.loads
        queued = len(self.admissions)  # materializing here, not yet at the scheduler
        usage = loads.kv_active_pages / loads.kv_total_pages if loads.kv_total_pages else 0.0
        running = loads.num_running
        waiting = loads.num_waiting + queued
        load = ts.SchedulerLoad(
            dp_rank=self.engine_index,
            num_running_reqs=running,
            num_waiting_reqs=waiting,
            num_total_reqs=running + waiting,
            token_usage=usage,
            active_token_usage=usage,
            utilization=usage,
        )
        return ts.GetLoadsResponse(
            timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            version=_VERSION,
            dp_rank_count=1,
            loads=[load],
            aggregate=ts.AggregateMetrics(
                total_running_reqs=running,
                total_waiting_reqs=waiting,
                total_reqs=running + waiting,
                avg_token_usage=usage,
                avg_utilization=usage,
            ),
        )

    # ------------------------------------------------------------------ gRPC wiring

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        """The method handlers of ``TokenSpeedScheduler`` (every method of the
        contract: those the msgpack wire cannot carry answer ``UNIMPLEMENTED``)."""
        stats = self.stats
        limits = self.limits

        def deserialize(data: bytes) -> Any:
            stats.received_bytes += len(data)
            return parse_or_undecodable(lambda b: parse_generate(b, limits), data)

        def unary(method: Any, req_type: Any, resp_type: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(
                method,
                request_deserializer=req_type.FromString,
                response_serializer=resp_type.SerializeToString,
            )

        handlers: dict[str, grpc.RpcMethodHandler] = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.Generate,
                request_deserializer=deserialize,
                response_serializer=ts.GenerateResponse.SerializeToString,
            ),
            "HealthCheck": unary(self.HealthCheck, ts.HealthCheckRequest, ts.HealthCheckResponse),
            "Abort": unary(self.Abort, ts.AbortRequest, ts.AbortResponse),
            "GetModelInfo": unary(
                self.GetModelInfo, ts.GetModelInfoRequest, ts.GetModelInfoResponse
            ),
            "GetServerInfo": unary(
                self.GetServerInfo, ts.GetServerInfoRequest, ts.GetServerInfoResponse
            ),
            "GetLoads": unary(self.GetLoads, ts.GetLoadsRequest, ts.GetLoadsResponse),
        }
        service = ts.DESCRIPTOR.services_by_name["TokenSpeedScheduler"]
        for method in service.methods:
            if method.name in handlers:
                continue
            handlers[method.name] = _unimplemented(method)
        return handlers


# What the msgpack wire to the scheduler cannot carry, by method (the status message).
_UNIMPLEMENTED_WHY = {
    "GetTokenizer": "mmadmit holds no tokenizer; give SMG the model's tokenizer path",
    "SubscribeKvEvents": "the scheduler's KV events do not travel on the msgpack wire",
    "FlushCache": "cache flushes do not travel on the msgpack wire",
    "StartProfile": "profiling does not travel on the msgpack wire",
    "StopProfile": "profiling does not travel on the msgpack wire",
}


def _unimplemented(method: Any) -> grpc.RpcMethodHandler:
    from google.protobuf import message_factory

    name = method.name
    why = _UNIMPLEMENTED_WHY.get(name, "not carried by mmadmit's SMG gRPC face")
    text = f"{name} is not implemented by mmadmit's SMG gRPC face: {why}"
    req_cls = message_factory.GetMessageClass(method.input_type)
    resp_cls = message_factory.GetMessageClass(method.output_type)

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, text)

    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            refuse,  # type: ignore[arg-type]
            request_deserializer=req_cls.FromString,
            response_serializer=resp_cls.SerializeToString,
        )
    return grpc.unary_unary_rpc_method_handler(
        refuse,
        request_deserializer=req_cls.FromString,
        response_serializer=resp_cls.SerializeToString,
    )


def _reason_text(reason: Any) -> str:
    """A finished reason as the face reports it: "" (not finished), "stop", "length",
    "abort" (a map ``{type: ...}`` as some schedulers send is read by its type)."""
    if not reason:
        return ""
    if isinstance(reason, dict):
        reason = reason.get("type", "stop")
    text = str(reason)
    return text if text in ("stop", "length", "abort") else "stop"


def _same(outcome: Materialized | Abort) -> Abort:
    """``_refuse``'s ``encode``: the call ends with the abort's own status."""
    assert isinstance(outcome, Abort)
    return outcome


def _ignore(msg: list[Any]) -> None:
    pass


__all__ = [
    "SERVICE",
    "STATUS_OF",
    "TRANSPORT",
    "SmgGrpcFace",
    "SmgStats",
    "parse_generate",
    "request_from_generate",
    "sampling_array",
]
