"""``mmadmit`` command line: ``serve`` and ``materialize`` (docs/spec/CLI.md).

Exit statuses: ``serve`` 0 after a clean drain, 1 on a forced exit, 2 for
unusable configuration (or, in engine mode, a malformed handshake message), 3
in engine mode when the scheduler goes away or a handshake step times out;
``materialize`` 0 materialized, 1 aborted, 2 unusable arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmadmit_client.frames import pack_frames, parse_frames

from . import native, wire
from .config import add_config_arguments, build_config
from .errors import Abort, AbortCode, ConfigError
from .materializer import Materializer
from .model import Materialized

EXIT_OK = 0
EXIT_ABORTED = 1
EXIT_USAGE = 2

_MODEL_FIELDS = ("model", "role", "language_model_only", "max_model_len", "native")


def replay(materializer: Materializer, frames: Sequence[Any]) -> tuple[list[Any], Abort | None]:
    """Exactly what reply mode does with one ADD message, minus the socket.

    Returns the reply frames ``[status, payload, *aux]`` and the abort, if any.
    The message is decoded within the materializer's limits.
    """
    try:
        msg = wire.decode_message(list(frames), materializer.limits)
    except wire.WireError as exc:
        abort = exc.to_abort()
        return wire.encode_aborted(None, abort, exc.rid), abort
    if msg.request is None:
        abort = Abort(AbortCode.INVALID_REQUEST, "an ABORT message has no reply to replay")
        return wire.encode_aborted(None, abort), abort
    outcome = materializer.run(msg.request)
    if isinstance(outcome, Materialized):
        return wire.encode_materialized(outcome), None
    return wire.encode_aborted(msg.request, outcome), outcome


def _read_input(path: str) -> bytes:
    if path == "-":
        return sys.stdin.buffer.read()
    return Path(path).read_bytes()


def _write_output(path: str, data: bytes) -> None:
    if path == "-":
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    else:
        Path(path).write_bytes(data)


def _cmd_materialize(args: argparse.Namespace) -> int:
    config = build_config({k: getattr(args, k) for k in _MODEL_FIELDS})
    native.set_enabled(config.native)
    materializer = Materializer(config.load_profile(), config.limits)
    try:
        frames = parse_frames(_read_input(args.input))
    except (OSError, ValueError) as exc:
        print(f"mmadmit materialize: cannot read {args.input}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    reply, abort = replay(materializer, frames)
    try:
        _write_output(args.output, pack_frames(reply))
    except OSError as exc:
        print(f"mmadmit materialize: cannot write {args.output}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if abort is not None:
        print(f"aborted: {abort.as_validation_error()}", file=sys.stderr)
        return EXIT_ABORTED
    return EXIT_OK


def _cmd_serve(args: argparse.Namespace) -> int:
    config = build_config(args)
    # gRPC's core writes to stderr on its own (an unformatted line for every failed
    # TLS handshake, for one), which would break --log-format json: only its
    # errors, unless the operator set GRPC_VERBOSITY. Set before grpc is imported.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from .server import run  # deferred: pulls in grpc, zmq and (maybe) torch

    return run(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmadmit",
        description="Admission of precomputed multimodal LLM requests (gRPC and ZMQ msgpack).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the admission service")
    add_config_arguments(serve)
    serve.set_defaults(func=_cmd_serve)
    mat = sub.add_parser(
        "materialize",
        help="replay one captured ZMQ ADD message offline",
        description="Read a frames container, run the service's materializer, write the reply "
        "container [status, payload, *aux]. Exit 0 materialized, 1 aborted, 2 unusable "
        "arguments. '-' reads or writes standard streams.",
    )
    add_config_arguments(mat, _MODEL_FIELDS)
    mat.add_argument("input", metavar="IN", help="frames container of the ADD message, or -")
    mat.add_argument("output", metavar="OUT", help="where to write the reply container, or -")
    mat.set_defaults(func=_cmd_materialize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"mmadmit: {exc}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())


__all__ = ["build_parser", "main", "replay"]
