"""The engine handshake of SMG's msgpack deployment (docs/spec/WIRE.md, "Engine mode"):
messages only.

Scope: building and validating the handshake messages mmadmit exchanges when
it stands between SMG and a scheduler (:mod:`mmadmit.engine_mode`), and the
``ENGINE_CORE_DEAD`` sentinel. No sockets here. The messages, their keys and the
checks made on the scheduler's ready response are docs/spec/WIRE.md, "Engine
mode: between SMG and a scheduler".

A message that does not fit raises :class:`HandshakeError`, which names the
step and the field (``"INIT from SMG: addresses.inputs: must be a non-empty
array of strings"``); exit status 2, because a peer speaking another protocol
is a deployment problem a restart cannot fix.

Non-goals: the data-parallel coordinator, ``parallel_config`` negotiation (the
scheduler's handshake completes before SMG's INIT exists, see
:mod:`mmadmit.engine_mode`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"

# The keys docs/spec/WIRE.md lists for the ready response, each with the check it gets
# when present (parse_ready_response): "int" a non-negative integer, "str?" nil or a
# string, "own" a check of its own below, "any" none (SMG reads it).
_READY_TYPES = {
    "max_model_len": "own",
    "num_gpu_blocks": "int",
    "prefix_granularity": "int",
    "dp_stats_address": "str?",
    "dtype": "str?",
    "multimodal_encoder_dtype": "str?",
    "vllm_version": "str?",
    "world_size": "int",
    "data_parallel_size": "int",
    "tensor_parallel_size": "int",
    "pipeline_parallel_size": "int",
    "decode_context_parallel_size": "int",
    "data_parallel_rank": "int",
    "max_num_seqs": "int",
    "max_num_batched_tokens": "int",
    "instance_id": "str?",
    "kv_cache_size_tokens": "own",
    "kv_cache_max_concurrency": "own",
    "kv_events_config": "any",
}
READY_RESPONSE_KEYS = tuple(_READY_TYPES)
_READY_INTS = tuple(k for k, kind in _READY_TYPES.items() if kind == "int")
_READY_OPT_STRS = tuple(k for k, kind in _READY_TYPES.items() if kind == "str?")

_ENC = msgspec.msgpack.Encoder()


class HandshakeError(Exception):
    """A handshake message that does not fit docs/spec/WIRE.md: names the step and the field."""

    def __init__(self, step: str, field_name: str, problem: str) -> None:
        self.step = step
        self.field = field_name
        self.problem = problem
        super().__init__(f"{step}: {field_name}: {problem}")


class HandshakeTimeout(Exception):
    """A handshake step did not complete within ``--handshake-timeout``."""

    def __init__(self, step: str, timeout_s: float) -> None:
        self.step = step
        self.timeout_s = timeout_s
        super().__init__(f"{step}: nothing within {timeout_s:g}s (--handshake-timeout)")


def engine_identity(index: int) -> bytes:
    """The socket identity of engine ``index``: 2 bytes little-endian."""
    if not 0 <= index <= 0xFFFF:
        raise ValueError("an engine index is 0..65535 (2 bytes on the wire)")
    return index.to_bytes(2, "little")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_map(data: Any, step: str) -> dict[str, Any]:
    """Decode one handshake frame as a msgpack map with string keys."""
    try:
        value = msgspec.msgpack.decode(memoryview(data))
    except (msgspec.DecodeError, TypeError, ValueError) as exc:
        raise HandshakeError(step, "(message)", f"not msgpack ({exc})") from None
    if not isinstance(value, dict):
        raise HandshakeError(
            step, "(message)", f"must be a msgpack map, got {type(value).__name__}"
        )
    for key in value:
        if not isinstance(key, str):
            raise HandshakeError(step, "(message)", f"map keys must be strings, got {key!r}")
    return value


# --------------------------------------------------------------------------- HELLO / READY


def status_message(status: str) -> bytes:
    """HELLO or READY as an engine sends it (docs/spec/WIRE.md, steps 1 and 3)."""
    return _ENC.encode(
        {"status": status, "local": True, "headless": True, "parallel_config_hash": None}
    )


def parse_status(data: Any, expected: str, step: str) -> dict[str, Any]:
    """Check a HELLO / READY map: ``status`` must be ``expected``."""
    msg = decode_map(data, step)
    status = msg.get("status")
    if status != expected:
        raise HandshakeError(step, "status", f"must be {expected!r}, got {status!r}")
    for key in ("local", "headless"):
        if key in msg and not isinstance(msg[key], bool):
            raise HandshakeError(step, key, f"must be a boolean, got {msg[key]!r}")
    return msg


# --------------------------------------------------------------------------- INIT


@dataclass(frozen=True)
class Init:
    """What an INIT tells an engine (unknown keys dropped)."""

    inputs: list[str]
    outputs: list[str]
    coordinator_input: str | None = None
    coordinator_output: str | None = None
    frontend_stats_publish_address: str | None = None
    parallel_config: dict[str, Any] = field(default_factory=dict)


def encode_init(inputs: list[str], outputs: list[str]) -> bytes:
    """The INIT mmadmit sends the scheduler: its input and output addresses, no coordinator."""
    return _ENC.encode(
        {
            "addresses": {
                "inputs": inputs,
                "outputs": outputs,
                "coordinator_input": None,
                "coordinator_output": None,
                "frontend_stats_publish_address": None,
            },
            "parallel_config": {},
        }
    )


def _addresses(value: Any, step: str, name: str) -> list[str]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(a, str) and "://" in a for a in value)
    ):
        raise HandshakeError(
            step, f"addresses.{name}", f"must be a non-empty array of ZMQ endpoints, got {value!r}"
        )
    return value


def parse_init(data: Any, step: str = "INIT from SMG") -> Init:
    msg = decode_map(data, step)
    addresses = msg.get("addresses")
    if not isinstance(addresses, dict):
        raise HandshakeError(step, "addresses", f"must be a map, got {addresses!r}")
    opt: dict[str, str | None] = {}
    for key in ("coordinator_input", "coordinator_output", "frontend_stats_publish_address"):
        value = addresses.get(key)
        if value is not None and not isinstance(value, str):
            raise HandshakeError(step, f"addresses.{key}", f"must be nil or a string: {value!r}")
        opt[key] = value
    parallel = msg.get("parallel_config", {})
    if parallel is None:
        parallel = {}
    if not isinstance(parallel, dict):
        raise HandshakeError(step, "parallel_config", f"must be a map, got {parallel!r}")
    return Init(
        inputs=_addresses(addresses.get("inputs"), step, "inputs"),
        outputs=_addresses(addresses.get("outputs"), step, "outputs"),
        parallel_config=parallel,
        **opt,
    )


# --------------------------------------------------------------------------- ready response


def parse_ready_response(data: Any, step: str = "ready response from the scheduler") -> list[str]:
    """Validate the scheduler's ready response; return the docs/spec/WIRE.md keys it lacks
    (the check: docs/spec/WIRE.md, "Engine mode: between SMG and a scheduler", step 2)."""
    msg = decode_map(data, step)
    mml = msg.get("max_model_len")
    if not isinstance(mml, int) or isinstance(mml, bool) or mml <= 0:
        raise HandshakeError(step, "max_model_len", f"must be a positive integer, got {mml!r}")
    for key in _READY_INTS:
        value = msg.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise HandshakeError(step, key, f"must be a non-negative integer, got {value!r}")
    for key in _READY_OPT_STRS:
        value = msg.get(key)
        if value is not None and not isinstance(value, str):
            raise HandshakeError(step, key, f"must be nil or a string, got {value!r}")
    value = msg.get("kv_cache_size_tokens")
    if value is not None and not _is_int(value):
        raise HandshakeError(step, "kv_cache_size_tokens", f"must be nil or an integer: {value!r}")
    value = msg.get("kv_cache_max_concurrency")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise HandshakeError(
            step, "kv_cache_max_concurrency", f"must be nil or a number, got {value!r}"
        )
    return [key for key in READY_RESPONSE_KEYS if key not in msg]


__all__ = [
    "ENGINE_CORE_DEAD",
    "READY_RESPONSE_KEYS",
    "HandshakeError",
    "HandshakeTimeout",
    "Init",
    "decode_map",
    "encode_init",
    "engine_identity",
    "parse_init",
    "parse_ready_response",
    "parse_status",
    "status_message",
]
