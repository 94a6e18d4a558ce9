"""``mmadmit-client``: the command-line client over the client library (docs/spec/CLI.md).

::

    mmadmit-client admit TARGET FILE [--json] [--out REPLY.frames] [--rid RID]
    mmadmit-client health TARGET [--service NAME] [--quiet]
    mmadmit-client model-info TARGET [--json]
    mmadmit-client bench TARGET FILE... [--duration S | --requests N] [--concurrency C]
                                        [--json] [--plot FILE.png] [--no-progress]

TARGET is ``grpc://HOST:PORT`` (gRPC) or ``tcp://HOST:PORT`` / ``ipc://PATH``
(ZMQ reply mode). FILE is a ``.frames`` container (a captured ZMQ ADD
message) or a JSON request (schema: ``clients/README.md``). Every command
takes ``--timeout S`` (reaching the server, default 5) and the request
commands ``--request-timeout S`` (one outcome, default 60). Transport
security, as the server's (docs/spec/CLI.md): ``--tls-ca``, ``--tls-cert``,
``--tls-key`` for gRPC over TLS (mutual with a client certificate),
``--curve-server-key`` and ``--curve-client-key`` for ZMQ CURVE.

Exit status: 0 materialized (``health``: SERVING; ``bench``: every request got
an outcome), 1 aborted (``health``: not SERVING; ``bench``: requests without an
outcome), 2 unusable arguments or request file, 3 unreachable or no answer
(connection refused, nothing within the timeout, a broken answer, a failed
TLS or CURVE handshake: the message says which when it can be told).

Output: readable (rich) on stdout, or with ``--json`` one JSON object there;
progress and notes go to stderr. Readable output wraps at the terminal's width
(or ``COLUMNS``), not at all into a file or pipe with no terminal, and never
inside a number (``_cli_output``). Files are written only where ``--out`` and
``--plot`` name them. ``health`` prints one line (``SERVING``)
and imports neither rich nor the codec: it is what a compose healthcheck runs.
Imports are lazy throughout, so each command loads only what it uses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

EXIT_OK = 0
EXIT_ABORTED = 1  # also: health not SERVING, bench with requests lacking an outcome
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_REQUEST_TIMEOUT_S = 60.0

PROG = "mmadmit-client"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2 (as argparse does)
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Command-line client of the mmadmit admission service (gRPC and ZMQ).",
        epilog="exit status: 0 materialized (health: SERVING; bench: every request got an "
        "outcome), 1 aborted (health: not SERVING; bench: requests without an outcome), "
        "2 unusable arguments or request file, 3 unreachable or no outcome. "
        "files: none is written unless named, by admit --out and bench --plot (a relative "
        "path is from the current directory; in a checkout of the repository, the names its "
        "README uses, reply.frames and bench.png, are git-ignored at its root)",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p: argparse.ArgumentParser, *, request: bool, zmq: bool = True) -> None:
        p.add_argument(
            "--timeout",
            type=_positive(float),
            default=DEFAULT_CONNECT_TIMEOUT_S,
            metavar="S",
            help="seconds to reach the server before giving up with exit 3 (default %(default)s)",
        )
        tls = p.add_argument_group("gRPC over TLS")
        tls.add_argument(
            "--tls-ca",
            metavar="PEM",
            help="CA bundle that verifies the server (turns TLS on; default: system roots)",
        )
        tls.add_argument(
            "--tls-cert", metavar="PEM", help="client certificate chain (mutual TLS; TLS on)"
        )
        tls.add_argument("--tls-key", metavar="PEM", help="the client certificate's private key")
        if zmq:
            curve = p.add_argument_group("ZMQ CURVE")
            curve.add_argument(
                "--curve-server-key",
                metavar="FILE",
                help="the server's public key file (zmq.auth format; turns CURVE on)",
            )
            curve.add_argument(
                "--curve-client-key",
                metavar="FILE",
                help="this client's NAME.key_secret (default: a fresh keypair per run)",
            )
        if request:
            p.add_argument(
                "--request-timeout",
                type=_positive(float),
                default=DEFAULT_REQUEST_TIMEOUT_S,
                metavar="S",
                help="seconds to wait for one request's outcome (default %(default)s)",
            )

    target_help = "grpc://HOST:PORT, or tcp://HOST:PORT / ipc://PATH for ZMQ"

    p = sub.add_parser("admit", help="admit one request and show its outcome")
    p.add_argument("target", metavar="TARGET", help=target_help)
    p.add_argument("file", metavar="FILE", help=".frames container or JSON request")
    p.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
    p.add_argument(
        "--out",
        metavar="FILE",
        help="write the reply frames [status, payload, *aux] to FILE (default: no file)",
    )
    p.add_argument("--rid", metavar="RID", help="send under this request id")
    common(p, request=True)

    p = sub.add_parser("health", help="gRPC health check: exit 0 only when SERVING")
    p.add_argument("target", metavar="TARGET", help="grpc://HOST:PORT")
    p.add_argument("--service", default="", help="service name to check (default: the server)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing on success")
    common(p, request=False, zmq=False)

    p = sub.add_parser("model-info", help="the profile the server loaded")
    p.add_argument("target", metavar="TARGET", help="grpc://HOST:PORT")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    common(p, request=False, zmq=False)

    p = sub.add_parser(
        "bench", help="steady load, then throughput, latency percentiles, outcomes by code"
    )
    p.add_argument("target", metavar="TARGET", help=target_help)
    p.add_argument("files", metavar="FILE", nargs="+", help="request files, sent in turn")
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--duration", type=_positive(float), metavar="S", help="seconds of load (default 10)"
    )
    load.add_argument("--requests", type=_positive(int), metavar="N", help="send N requests")
    p.add_argument(
        "--concurrency",
        type=_positive(int),
        default=4,
        metavar="C",
        help="requests in flight (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write a PNG: latency histogram, throughput, outcomes by code (default: no "
        "file; needs matplotlib)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    common(p, request=True)
    return parser


# --------------------------------------------------------------------------- commands


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: {message}", file=sys.stderr)
    return status


def _grpc_client(args: argparse.Namespace) -> Any:
    """The blocking gRPC client of ``health`` / ``model-info`` (TLS from the options)."""
    from ._cli_transport import grpc_client, parse_target

    target = parse_target(args.target)
    if target.transport != "grpc":
        from ._cli_usage import UsageError

        raise UsageError(
            f"target {args.target!r}: this command speaks gRPC only (grpc://HOST:PORT)"
        )
    return grpc_client(target, _options(args))


def _probe_timeout(exc: Exception) -> Exception:
    """A probe that got no answer within ``--timeout``: the server is unreachable."""
    from ._exceptions import ServerUnavailable

    err = ServerUnavailable(str(exc))
    err.__cause__ = exc
    return err


def cmd_health(args: argparse.Namespace) -> int:
    from ._exceptions import RequestTimeout

    with _grpc_client(args) as client:
        try:
            status = client.health(args.service, timeout_s=args.timeout)
        except RequestTimeout as exc:
            raise _probe_timeout(exc) from exc
    if status == "SERVING":
        if not args.quiet:
            print(status)
        return EXIT_OK
    print(status)
    return EXIT_ABORTED


def cmd_model_info(args: argparse.Namespace) -> int:
    import dataclasses

    from ._exceptions import RequestTimeout

    with _grpc_client(args) as client:
        try:
            info = client.model_info(timeout_s=args.timeout)
        except RequestTimeout as exc:
            raise _probe_timeout(exc) from exc
    doc = dataclasses.asdict(info)
    doc["architectures"] = list(info.architectures)
    if args.json:
        print(json.dumps(doc))
        return EXIT_OK
    from rich.table import Table

    from ._cli_output import print_table, stdout_console

    table = Table(title=f"model loaded at {args.target}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    for key, value in doc.items():
        shown = ", ".join(value) if isinstance(value, list) else value
        table.add_row(key, "-" if shown is None else str(shown))
    print_table(stdout_console(), table)
    return EXIT_OK


def _options(args: argparse.Namespace) -> Any:
    from ._cli_transport import TransportOptions

    return TransportOptions(
        connect_timeout_s=args.timeout,
        request_timeout_s=getattr(args, "request_timeout", DEFAULT_REQUEST_TIMEOUT_S),
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        curve_server_key=getattr(args, "curve_server_key", None),
        curve_client_key=getattr(args, "curve_client_key", None),
    )


async def _admit(args: argparse.Namespace) -> int:
    from ._cli_request import load_request_file
    from ._cli_transport import open_transport, parse_target

    target = parse_target(args.target)
    loaded = load_request_file(args.file)
    transport = open_transport(target, _options(args))
    transport.prepare(loaded, args.rid)  # refuse what cannot be sent before connecting
    async with transport:
        result = await transport.admit(loaded, args.rid)
    if args.out:
        from .frames import pack_frames

        blob = pack_frames(result.reply_frames)
        _write(args.out, blob)
        print(
            f"reply written to {args.out} ({len(result.reply_frames)} frames, {len(blob)} bytes)",
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        _render_result(result, target.text)
    return EXIT_OK if result.materialized else EXIT_ABORTED


def _write(path: str, blob: bytes) -> None:
    from ._cli_usage import UsageError

    try:
        with open(path, "wb") as fh:
            fh.write(blob)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _render_result(result: Any, target: str) -> None:
    import numpy as np
    from rich.markup import escape
    from rich.table import Table

    from ._cli_output import print_line, print_table, stdout_console

    console = stdout_console()
    where = escape(f"rid={result.request_id}  {target}  {result.latency_ms:.2f} ms")
    if not result.materialized:
        print_line(console, f"[bold red]ABORTED[/] [bold]{result.abort_code}[/]  {where}")
        print_line(console, result.abort_message, markup=False)
        return
    print_line(console, f"[bold green]MATERIALIZED[/]  {where}")
    n = int(result.input_ids.size)
    facts = [f"{n} tokens"]
    if result.input_ids_unpadded is not None and result.input_ids_unpadded.size == n:
        changed = int(np.count_nonzero(result.input_ids != result.input_ids_unpadded))
        facts.append(f"{changed} substituted")
    facts.append(f"{len(result.items)} item(s)")
    if result.mrope_positions is not None:
        shape = "x".join(str(d) for d in result.mrope_positions.shape)
        facts.append(f"M-RoPE positions [{shape}], delta {result.mrope_position_delta}")
    elif result.mrope_position_delta is not None:
        facts.append(f"M-RoPE delta {result.mrope_position_delta}")
    if result.passthrough:
        facts.append("passthrough (materialized upstream)")
    print_line(console, ", ".join(facts), markup=False)
    if result.items:
        table = Table()
        for col, justify in (("#", "right"), ("modality", "left"), ("hash", "right"),
                             ("pad value", "right"), ("spans [start, end]", "left")):  # fmt: skip
            table.add_column(col, justify=justify)  # type: ignore[arg-type]
        for i, it in enumerate(result.items):
            spans = " ".join(f"[{s}, {e}]" for s, e in it.offsets)
            table.add_row(
                str(i),
                it.modality,
                "-" if it.hash is None else f"{it.hash:#018x}",
                "-" if it.pad_value is None else str(it.pad_value),
                spans,
            )
        print_table(console, table)


async def _bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ._bench import BenchSettings, render_report, require_matplotlib, run_bench, write_plot
    from ._cli_request import UsageError, load_request_file
    from ._cli_transport import open_transport, parse_target

    if args.plot:
        require_matplotlib()
    target = parse_target(args.target)
    files = [load_request_file(f) for f in args.files]
    settings = BenchSettings(
        concurrency=args.concurrency,
        duration_s=args.duration if args.requests is None else None,
        requests=args.requests,
        progress=not args.no_progress,
    )
    if settings.duration_s is None and settings.requests is None:
        settings = BenchSettings(args.concurrency, 10.0, None, settings.progress)
    transport = open_transport(target, _options(args))
    for loaded in files:
        transport.prepare(loaded, "bench-check")
    async with transport:
        report = await run_bench(transport, files, settings, stderr_console=Console(stderr=True))
    if args.plot:
        try:
            write_plot(report, args.plot)
        except OSError as exc:
            raise UsageError(f"cannot write {args.plot}: {exc.strerror or exc}") from exc
        print(f"plot written to {args.plot}", file=sys.stderr)
    if args.json:
        doc = report.to_json()
        doc["plot"] = args.plot
        print(json.dumps(doc))
    else:
        from ._cli_output import stdout_console

        render_report(report, stdout_console())
    return EXIT_OK if report.all_received else EXIT_ABORTED


def _run(args: argparse.Namespace) -> int:
    if args.command == "health":
        return cmd_health(args)
    if args.command == "model-info":
        return cmd_model_info(args)
    if args.command == "admit":
        return asyncio.run(_admit(args))
    return asyncio.run(_bench(args))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # gRPC's core logs every failed TLS handshake at INFO on stderr, which would
    # break "errors are one line"; the failure reaches us as UNAVAILABLE anyway.
    # (Read by grpc when it loads, which no command has done yet.)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    from ._cli_usage import UsageError
    from ._exceptions import ClientError, ServerUnavailable

    try:
        return _run(args)
    except UsageError as exc:
        return _fail(f"error: {exc}", EXIT_USAGE)
    except ServerUnavailable as exc:
        from ._cli_transport import explain_unavailable, parse_target

        why = explain_unavailable(str(exc), _options(args), parse_target(args.target).transport)
        return _fail(f"{args.target}: unreachable: {why}", EXIT_UNREACHABLE)
    except ClientError as exc:  # timed out, transport failure, broken answer: no outcome
        return _fail(f"{args.target}: no outcome: {type(exc).__name__}: {exc}", EXIT_UNREACHABLE)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
