"""Prometheus ``/metrics`` over plain HTTP/1.1 (``--metrics-listen``).

Deliberately small: an ``asyncio`` stream server that answers ``GET /metrics``
with the text exposition format and closes the connection. It reads the
pool's counters and the transports' ``stats`` objects when they have them; it
holds no state of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .server import ServerHandle

logger = logging.getLogger(__name__)

_MAX_REQUEST_BYTES = 8192


def _line(name: str, value: float, labels: dict[str, str] | None = None) -> str:
    if labels:
        inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        return f"{name}{{{inner}}} {value}"
    return f"{name} {value}"


def render(handle: ServerHandle) -> str:
    pool = handle.pool
    stats = pool.stats
    out = [
        "# HELP mmadmit_inflight Requests admitted and not yet released by a worker.",
        "# TYPE mmadmit_inflight gauge",
        _line("mmadmit_inflight", pool.inflight),
        "# HELP mmadmit_queue_depth Admitted requests waiting for a worker.",
        "# TYPE mmadmit_queue_depth gauge",
        _line("mmadmit_queue_depth", pool.queued),
        "# TYPE mmadmit_running gauge",
        _line("mmadmit_running", pool.running),
        "# TYPE mmadmit_max_inflight gauge",
        _line("mmadmit_max_inflight", pool.max_inflight),
        "# TYPE mmadmit_draining gauge",
        _line("mmadmit_draining", int(pool.draining)),
        "# HELP mmadmit_admitted_total Requests admitted to the pool.",
        "# TYPE mmadmit_admitted_total counter",
        _line("mmadmit_admitted_total", stats.admitted),
        "# TYPE mmadmit_cancelled_queued_total counter",
        _line("mmadmit_cancelled_queued_total", stats.cancelled_queued),
        "# TYPE mmadmit_discarded_running_total counter",
        _line("mmadmit_discarded_running_total", stats.discarded_running),
        "# HELP mmadmit_inline_total Admitted requests materialized inline (--inline-max-tokens).",
        "# TYPE mmadmit_inline_total counter",
        _line("mmadmit_inline_total", stats.inline),
        "# HELP mmadmit_outcomes_total Terminal outcomes of admitted requests by code.",
        "# TYPE mmadmit_outcomes_total counter",
    ]
    outcomes = dict(stats.outcomes)
    outcomes["OVERLOADED"] = outcomes.get("OVERLOADED", 0) + stats.overloaded
    outcomes["SHUTTING_DOWN"] = outcomes.get("SHUTTING_DOWN", 0) + stats.rejected_shutting_down
    out += [_line("mmadmit_outcomes_total", v, {"outcome": k}) for k, v in sorted(outcomes.items())]
    for transport in ("grpc", "zmq"):
        obj = getattr(handle, transport)
        for name, value in _numeric_stats(getattr(obj, "stats", None)).items():
            out.append(_line(f"mmadmit_{transport}_{name}", value))
    return "\n".join(out) + "\n"


def _numeric_stats(stats: Any) -> dict[str, float]:
    if stats is None:
        return {}
    items = vars(stats).items() if hasattr(stats, "__dict__") else []
    return {k: v for k, v in items if isinstance(v, (int, float)) and not isinstance(v, bool)}


class MetricsServer:
    def __init__(self, handle: ServerHandle, *, listen: str) -> None:
        self.handle = handle
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, self.host, self.port)
        sock = self._server.sockets[0].getsockname()
        return f"{sock[0]}:{sock[1]}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
            if len(head) > _MAX_REQUEST_BYTES:
                raise ValueError("request head too large")
            method, path, *_ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if method != "GET":
                status, body = "405 Method Not Allowed", "only GET\n"
            elif path.split("?")[0] != "/metrics":
                status, body = "404 Not Found", "see /metrics\n"
            else:
                status, body = "200 OK", render(self.handle)
            data = body.encode()
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
                + data
            )
            await writer.drain()
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ValueError,
            ConnectionError,
        ):
            pass  # a broken scrape is the scraper's problem; never the service's
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
