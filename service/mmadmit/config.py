"""One typed, frozen configuration object, built once at start-up (docs/spec/CLI.md).

Every setting is a field of :class:`ServeConfig` with a default, a command-line
flag and an environment variable (``MMADMIT_`` + the flag name upper-cased with
``-`` as ``_``). A flag wins over the variable, the variable over the default.
Invalid values raise :class:`ConfigError`; the CLI prints one line naming the
flag (and the variable, when the value came from it) and exits 2. Every
``--max-*`` setting has a range (:class:`IntRange`), shown in ``--help`` and the
README's table and checked here, typed values included.
No other module reads the environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigError
from .limits import INT32_MAX, INT64_MAX, MAX_DEPTH, MAX_RANK, MSGPACK_MAX_LEN, Limits
from .profile import PRESETS, ROLES, ModelProfile, Role, load_profile
from .runtime import ARENA_MAX
from .security import curve_from_config, grpc_tls_from_config

ENV_PREFIX = "MMADMIT_"
DeviceChoice = Literal["auto", "cpu", "cuda"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["text", "json"]
OFF = "off"


_INTEGER = re.compile(r"[+-]?[0-9]+")
_HUGE = 10**30  # stands for a longer number: beyond every range, not worth int()


def _integer(text: str) -> int:
    """A decimal integer (ASCII digits, an optional sign, surrounding blanks)."""
    s = text.strip()
    if not _INTEGER.fullmatch(s):
        raise ValueError("must be an integer")
    digits = s.lstrip("+-").lstrip("0")
    if len(digits) > 30:
        return -_HUGE if s.startswith("-") else _HUGE
    return int(s)


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError("must be a number") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _nonneg_int(text: str) -> int:
    value = _integer(text)
    if value < 0:
        raise ValueError("must be a non-negative integer")
    return value


def _nonneg_float(text: str) -> float:
    value = _number(text)
    if not value >= 0:  # also rejects NaN
        raise ValueError("must be a non-negative number")
    return value


def _positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:  # also rejects NaN
        raise ValueError("must be a positive number")
    return value


@dataclass(frozen=True)
class IntRange:
    """The valid values of an integer setting, ``lo..hi``, with why a bound is where
    it is (``low``/``high``: said in the error line); parses a flag's or variable's
    text and checks a typed value alike."""

    lo: int
    hi: int
    low: str = ""
    high: str = ""

    def __call__(self, text: str) -> int:
        try:
            value = _integer(text)
        except ValueError:
            raise ValueError(f"must be an integer in {self}") from None
        return self.check(value)

    def check(self, value: int) -> int:
        if value < self.lo:
            raise ValueError(f"must be at least {self.lo}" + (f": {self.low}" if self.low else ""))
        if value > self.hi:
            raise ValueError(f"must be at most {self.hi}" + (f": {self.high}" if self.high else ""))
        return value

    def __str__(self) -> str:
        return f"{self.lo}..{self.hi}"


_COUNT = IntRange(1, INT32_MAX)
_BYTES = IntRange(1, INT64_MAX)


def _engine_index(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 0xFFFF:
        raise ValueError("must be 0..65535 (the engine identity is 2 bytes)")
    return value


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError("must be a boolean (1/0, true/false, yes/no, on/off)")


LogOutcomes = Literal["off", "aborts", "all"]


def _log_outcomes(text: str) -> LogOutcomes:
    low = text.strip().lower()
    if low in ("aborts", "abort"):
        return "aborts"
    if low in ("all", "on", "1", "true", "yes"):
        return "all"
    if low in ("off", "0", "false", "no"):
        return "off"
    raise ValueError("must be aborts, all (on) or off")


def _host_port(text: str) -> str:
    if text == OFF:
        return text
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("must be HOST:PORT (port 0 binds an ephemeral port) or 'off'")
    return text


def _zmq_addr(text: str) -> str:
    if text == OFF:
        return text
    if "://" not in text:
        raise ValueError("must be a ZMQ endpoint such as tcp://127.0.0.1:5557 or 'off'")
    return text


def _choice(options: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"must be one of {', '.join(options)}")
        return text

    return parse


@dataclass(frozen=True)
class ServeConfig:
    """Settings of ``mmadmit serve`` (and, for the model part, ``materialize``)."""

    model: str = field(
        default="qwen2_5_vl",
        metadata={
            "help": "built-in profile (" + ", ".join(PRESETS) + ") or a config.json path/dir"
        },
    )
    role: Role = field(
        default="aggregated",
        metadata={"parse": _choice(ROLES), "help": "aggregated, prefill or decode"},
    )
    language_model_only: bool = field(
        default=False,
        metadata={
            "parse": _bool,
            "flag": True,
            "help": "the engine serves only the language half of a multimodal checkpoint",
        },
    )
    max_model_len: int | None = field(
        default=None,
        metadata={
            "parse": IntRange(2, INT32_MAX, low="one prompt token and one to generate"),
            "help": "the model's context length: a prompt must leave room for one token to "
            "generate (longer: TOO_LARGE)",
        },
    )
    grpc_listen: str = field(
        default="127.0.0.1:50051", metadata={"parse": _host_port, "help": "gRPC HOST:PORT, or off"}
    )
    zmq_listen: str = field(
        default="tcp://127.0.0.1:5557",
        metadata={"parse": _zmq_addr, "help": "ZMQ ROUTER endpoint (reply mode), or off"},
    )
    zmq_forward: str | None = field(
        default=None, metadata={"parse": _zmq_addr, "help": "PUSH endpoint for forward mode"}
    )
    smg_handshake: str | None = field(
        default=None,
        metadata={
            "parse": _zmq_addr,
            "help": "engine mode: SMG's handshake endpoint to connect to as an engine "
            "(needs --engine-handshake-listen)",
        },
    )
    engine_handshake_listen: str | None = field(
        default=None,
        metadata={
            "parse": _zmq_addr,
            "help": "engine mode and the SMG gRPC face: the handshake endpoint to bind for the "
            "scheduler; its input and output sockets are bound on the same host, ephemeral "
            "ports (needs --smg-handshake or --smg-grpc-listen)",
        },
    )
    engine_index: int = field(
        default=0,
        metadata={
            "parse": _engine_index,
            "help": "engine mode: the engine index presented to SMG; must equal the "
            "scheduler's own (0..65535)",
        },
    )
    handshake_timeout: float = field(
        default=600.0,
        metadata={
            "parse": _positive_float,
            "help": "engine mode: seconds to wait for each handshake step (progress every 30 s)",
        },
    )
    smg_grpc_listen: str | None = field(
        default=None,
        metadata={
            "parse": _host_port,
            "help": "SMG gRPC face: serve SMG's TokenSpeedScheduler worker contract on this "
            "HOST:PORT in front of the scheduler that connects to --engine-handshake-listen",
        },
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": "SMG gRPC face: the model name reported to SMG (default: the --model "
            "directory as given, the directory of a config.json path, or the profile name)",
        },
    )
    grpc_tls_cert: str | None = field(
        default=None,
        metadata={
            "help": "serve gRPC over TLS with this PEM certificate chain (needs --grpc-tls-key; "
            "the SMG face's port too)"
        },
    )
    grpc_tls_key: str | None = field(
        default=None,
        metadata={"help": "the PEM private key of --grpc-tls-cert (unencrypted)"},
    )
    grpc_tls_client_ca: str | None = field(
        default=None,
        metadata={
            "help": "require client certificates signed by this PEM CA bundle (mutual TLS; "
            "needs --grpc-tls-cert)"
        },
    )
    zmq_curve_secret_key: str | None = field(
        default=None,
        metadata={
            "help": "CURVE on the --zmq-listen ROUTER with this server key file (zmq.auth "
            "format, NAME.key_secret); engine-mode sockets stay plain"
        },
    )
    zmq_curve_clients: str | None = field(
        default=None,
        metadata={
            "help": "a folder of allowed client public keys (*.key); without it any CURVE "
            "client with the server key may connect"
        },
    )
    metrics_listen: str = field(
        default="127.0.0.1:9464",
        metadata={"parse": _host_port, "help": "Prometheus /metrics HOST:PORT, or off"},
    )
    device: DeviceChoice = field(
        default="auto",
        metadata={
            "parse": _choice(("auto", "cpu", "cuda")),
            "help": "auto (CUDA when present), cpu or cuda",
        },
    )
    workers: int | None = field(
        default=None,
        metadata={
            "parse": _positive_int,
            "help": "materializer workers (default 2 on CPU, 4 with CUDA)",
        },
    )
    max_inflight: int = field(
        default=64,
        metadata={"parse": _COUNT, "help": "admitted requests in flight before OVERLOADED"},
    )
    inline_max_tokens: int = field(
        default=16_384,
        metadata={
            "parse": _nonneg_int,
            "help": "requests of at most this many tokens (and no features to hash) are "
            "materialized on the event loop instead of a worker; 0 turns inline runs off",
        },
    )
    inline_max_us: float = field(
        default=1000.0,
        metadata={
            "parse": _nonneg_float,
            "help": "any other request, features to hash included, is materialized on the "
            "event loop when its estimated time (tokens and items at the rate learned from "
            "the runs, feature bytes at BLAKE2b's measured rate, shared with idle workers "
            "when large) is at most this many "
            "microseconds; 0: only --inline-max-tokens decides, and nothing that hashes "
            "runs inline",
        },
    )
    max_tokens: int = field(
        default=262_144,
        metadata={"parse": _COUNT, "help": "tokens per request (beyond: TOO_LARGE)"},
    )
    max_items: int = field(
        default=256, metadata={"parse": _COUNT, "help": "multimodal items per request"}
    )
    max_tensor_bytes: int = field(
        default=536_870_912, metadata={"parse": _BYTES, "help": "bytes of one tensor"}
    )
    max_message_bytes: int = field(
        default=1_073_741_824,
        metadata={
            "parse": _BYTES,
            "help": "bytes of one received message (gRPC receive limit too, at most "
            "2147483647 there)",
        },
    )
    max_tensor_rank: int = field(
        default=8,
        metadata={
            "parse": IntRange(1, MAX_RANK, high="numpy's largest rank"),
            "help": "dimensions of one tensor",
        },
    )
    max_tensor_dim: int = field(
        default=2**31 - 1,
        metadata={"parse": _BYTES, "help": "size of any one dimension of a tensor"},
    )
    max_msgpack_depth: int = field(
        default=32,
        metadata={
            "parse": IntRange(
                2, MAX_DEPTH, low="the payload array and its elements", high="the walk's stack"
            ),
            "help": "ZMQ: nesting depth of a payload's msgpack, the payload array being 1 "
            "(deeper is INVALID_REQUEST)",
        },
    )
    max_msgpack_len: int = field(
        default=65_536,
        metadata={
            "parse": IntRange(1, MSGPACK_MAX_LEN, high="msgpack's longest array or map"),
            "help": "elements of one msgpack array or entries of one map (ZMQ); map entries "
            "of one item and fields of one message (gRPC, messages of 64 KiB or more); token "
            "arrays excepted (--max-tokens bounds those)",
        },
    )
    max_abort_ids: int = field(
        default=4096,
        metadata={
            "parse": IntRange(1, MSGPACK_MAX_LEN, high="msgpack's longest array"),
            "help": "ZMQ: request ids in one ABORT message (a longer one is dropped)",
        },
    )
    max_frames: int = field(
        default=1024,
        metadata={
            "parse": IntRange(2, INT32_MAX, low="a message has a type and a payload frame"),
            "help": "ZMQ: frames of one message (type, payload and aux frames)",
        },
    )
    max_peer_inflight: int | None = field(
        default=None,
        metadata={
            "parse": _COUNT,
            "help": "ZMQ: requests one peer may have in flight before OVERLOADED (unset: "
            "--max-inflight); set it lower when several frontends share a replica",
        },
    )
    max_grpc_streams: int = field(
        default=1024,
        metadata={
            "parse": IntRange(1, INT32_MAX, high="gRPC's options are C ints"),
            "help": "gRPC: concurrent calls, streams and unary alike (beyond: "
            "RESOURCE_EXHAUSTED), and the HTTP/2 streams one connection may open",
        },
    )
    max_stream_inflight: int = field(
        default=64,
        metadata={
            "parse": _COUNT,
            "help": "gRPC: requests of one AdmitStream awaiting their outcome; the stream "
            "reads no further request until one is answered",
        },
    )
    cuda_min_tokens: int = field(
        default=32_768,
        metadata={
            "parse": _positive_int,
            "help": "requests shorter than this stay on the CPU path even with CUDA",
        },
    )
    drain_timeout: float = field(
        default=10.0,
        metadata={"parse": _nonneg_float, "help": "seconds to finish in-flight work on SIGTERM"},
    )
    log_level: LogLevel = field(
        default="info",
        metadata={"parse": _choice(("debug", "info", "warning", "error")), "help": "log level"},
    )
    log_format: LogFormat = field(
        default="text",
        metadata={
            "parse": _choice(("text", "json")),
            "help": "text, or json: one JSON object per line (outcomes, start-up, ready, drain)",
        },
    )
    log_outcomes: LogOutcomes = field(
        default="aborts",
        metadata={
            "parse": _log_outcomes,
            "help": "an info line per terminal outcome (rid, transport, outcome, code, tokens, "
            "items, latency): aborts (the operator's signal), all (successes too; on is the "
            "same), or off",
        },
    )
    malloc_arenas: int = field(
        default=ARENA_MAX,
        metadata={
            "parse": _nonneg_int,
            "help": "glibc malloc arenas the process may use (0: glibc's default, 8 per "
            "core); few arenas keep freed memory reused under a long mixed load",
        },
    )
    native: bool = field(
        default=True,
        metadata={
            "parse": _bool,
            "help": "run the extensions this project builds on request bytes (on), or not "
            "(off: their Python sources run, many times slower, or protobuf's upb parses "
            "whole messages; no extension of this project parses request bytes, while "
            "msgspec and upb still do)",
        },
    )

    @property
    def engine_mode(self) -> bool:
        """Both engine-mode addresses are set (:func:`build_config` checks the pair)."""
        return self.smg_handshake not in (None, OFF) and self.engine_handshake_listen not in (
            None,
            OFF,
        )

    @property
    def smg_grpc(self) -> bool:
        """The SMG gRPC face is on (:func:`build_config` checks what it needs)."""
        return self.smg_grpc_listen not in (None, OFF)

    def model_name(self) -> str:
        """The name the SMG gRPC face reports: ``--served-model-name``, else the
        ``--model`` directory as given, the directory of a ``config.json`` path, or
        the built-in profile's name."""
        if self.served_model_name:
            return self.served_model_name
        path = Path(self.model)
        if path.is_dir():
            return self.model
        if path.is_file():
            return str(path.parent)
        return self.model

    @functools.cached_property
    def limits(self) -> Limits:
        """The request limits, one object per configuration: the codecs build each
        tensor under it and the materializer skips re-checking a tensor built under
        the very object it holds (an identity test; a second ``Limits`` of equal
        values would make it check every tensor of every request again)."""
        return Limits(
            max_tokens=self.max_tokens,
            max_items=self.max_items,
            max_tensor_bytes=self.max_tensor_bytes,
            max_tensor_rank=self.max_tensor_rank,
            max_tensor_dim=self.max_tensor_dim,
            max_msgpack_depth=self.max_msgpack_depth,
            max_msgpack_len=self.max_msgpack_len,
            max_abort_ids=self.max_abort_ids,
        )

    def load_profile(self) -> ModelProfile:
        return load_profile(
            self.model,
            role=self.role,
            language_model_only=self.language_model_only,
            max_model_len=self.max_model_len,
        )


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def field_help(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    """A field's help text, its valid range appended (what ``--help`` and the README's
    table show)."""
    text = str(f.metadata.get("help", ""))
    parse = f.metadata.get("parse")
    return f"{text}; range {parse}" if isinstance(parse, IntRange) else text


def _shown(raw: str) -> str:
    """A refused value as the error line shows it: as given, or quoted when blank,
    spaced, unprintable or long."""
    if re.fullmatch(r"[\x21-\x7e]{1,40}", raw):
        return raw
    return repr(raw if len(raw) <= 40 else raw[:40] + "...")


def add_config_arguments(
    parser: argparse.ArgumentParser, fields: Sequence[str] | None = None
) -> None:
    """Add one flag per config field; values stay raw strings until :func:`build_config`."""
    for f in dataclasses.fields(ServeConfig):
        if fields is not None and f.name not in fields:
            continue
        help_text = f"{field_help(f)} (env {env_name(f.name)}; default {f.default})"
        if f.metadata.get("flag"):
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                action="store_const",
                const="1",
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag_name(f.name), dest=f.name, default=None, metavar="VALUE", help=help_text
            )


def build_config(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeConfig:
    """Resolve flag > environment > default for every field and validate it."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for f in dataclasses.fields(ServeConfig):
        raw = given.get(f.name)
        source = flag_name(f.name)
        if raw is None and env_name(f.name) in env:
            raw, source = env[env_name(f.name)], f"{env_name(f.name)} ({flag_name(f.name)})"
        if raw is None:
            continue
        parse = f.metadata.get("parse", str)
        try:
            if not isinstance(raw, str):  # already typed (programmatic use): ranges hold
                if isinstance(parse, IntRange) and isinstance(raw, int):
                    parse.check(raw)
                values[f.name] = raw
            else:
                values[f.name] = parse(raw)
        except ValueError as exc:
            # one line: the flag (and the variable), what is wrong, the value given
            shown = _shown(raw) if isinstance(raw, str) else repr(raw)
            raise ConfigError(f"{source} {exc} (got {shown})") from exc
    config = ServeConfig(**values)
    if config.zmq_forward is not None and config.zmq_listen == OFF:
        raise ConfigError("--zmq-forward needs --zmq-listen (forward mode takes requests from it)")
    _check_engine_mode(config)
    _check_security(config)  # TLS / CURVE flags, then their files read and checked
    return config


def _check_security(config: ServeConfig) -> None:
    """The TLS and CURVE flags' combinations, then their files read and checked
    (:mod:`mmadmit.security` raises the ConfigError naming a flag and a file)."""
    cert, key, ca = config.grpc_tls_cert, config.grpc_tls_key, config.grpc_tls_client_ca
    if (cert is None) != (key is None):
        given, missing = (
            ("--grpc-tls-cert", "--grpc-tls-key") if cert else ("--grpc-tls-key", "--grpc-tls-cert")
        )
        raise ConfigError(f"{given} needs {missing} too")
    if ca is not None and cert is None:
        raise ConfigError(
            "--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key (mutual TLS is TLS)"
        )
    if cert is not None and config.grpc_listen == OFF and not config.smg_grpc:
        raise ConfigError(
            "--grpc-tls-cert with --grpc-listen off (and no --smg-grpc-listen): there is no "
            "gRPC server"
        )
    secret, clients = config.zmq_curve_secret_key, config.zmq_curve_clients
    if clients is not None and secret is None:
        raise ConfigError("--zmq-curve-clients needs --zmq-curve-secret-key (the server's key)")
    if secret is not None and config.zmq_listen == OFF:
        raise ConfigError(
            "--zmq-curve-secret-key with --zmq-listen off: CURVE applies to the --zmq-listen "
            "ROUTER only (engine-mode sockets stay plain)"
        )
    grpc_tls_from_config(config)
    curve_from_config(config)


def _check_engine_mode(config: ServeConfig) -> None:
    """Engine mode: both handshake addresses or neither, and never with --zmq-forward;
    the SMG gRPC face: the scheduler's handshake address, never with either."""
    smg = config.smg_handshake not in (None, OFF)
    listen = config.engine_handshake_listen not in (None, OFF)
    if config.smg_grpc:
        if not listen:
            raise ConfigError(
                "the SMG gRPC face: --smg-grpc-listen needs --engine-handshake-listen (the "
                "scheduler connects there)"
            )
        for flag, given in (("--smg-handshake", smg), ("--zmq-forward", config.zmq_forward)):
            if given:
                raise ConfigError(
                    f"the SMG gRPC face (--smg-grpc-listen) excludes {flag}: requests from SMG "
                    "go to the scheduler that connects to --engine-handshake-listen"
                )
        return
    if smg != listen:
        given, missing = (
            ("--smg-handshake", "--engine-handshake-listen")
            if smg
            else ("--engine-handshake-listen", "--smg-handshake")
        )
        raise ConfigError(f"engine mode: {given} needs {missing} too")
    if smg and config.zmq_forward is not None:
        raise ConfigError(
            "engine mode (--smg-handshake) excludes --zmq-forward: requests from SMG go to the "
            "scheduler that connects to --engine-handshake-listen"
        )


def default_workers(config: ServeConfig, cuda: bool) -> int:
    return config.workers if config.workers is not None else (4 if cuda else 2)
