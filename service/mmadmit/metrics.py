"""Prometheus ``/metrics`` over HTTP (``--metrics-listen``), served by ``prometheus_client``.

The exposition is ``prometheus_client``'s own (text format, gzip and
``name[]`` filtering included) for the server's registry
(:class:`~mmadmit.telemetry.Telemetry`), served from a daemon thread by the
library's threading WSGI server. Only ``GET /metrics`` is answered;
any other path is 404 and any other method 405, so a stray probe never looks
like a scrape. Scrapes never touch the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

logger = logging.getLogger(__name__)

_StartResponse = Callable[..., Any]


class _ThreadingWSGIServerV6(ThreadingWSGIServer):
    address_family = socket.AF_INET6  # an IPv6 literal in --metrics-listen


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # one line per scrape would drown the service's own log


def metrics_app(registry: CollectorRegistry) -> Callable[[dict[str, Any], _StartResponse], Any]:
    """A WSGI app: ``/metrics`` from ``registry``; 404 elsewhere, 405 for other methods."""
    exposition = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: _StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") != "/metrics":
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"see /metrics\n"]
        if environ.get("REQUEST_METHOD") != "GET":
            start_response("405 Method Not Allowed", [("Allow", "GET")])
            return [b"only GET\n"]
        return exposition(environ, start_response)  # type: ignore[no-any-return]

    return app


class MetricsServer:
    """``/metrics`` of one registry on ``HOST:PORT`` (port 0: ephemeral)."""

    def __init__(self, registry: CollectorRegistry, *, listen: str) -> None:
        self.registry = registry
        host, _, port = listen.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._httpd: ThreadingWSGIServer | None = None
        self._thread: threading.Thread | None = None

    async def start(self) -> str:
        """Bind and serve; return the bound ``HOST:PORT``. Raises ``OSError`` on bind."""
        server_class = _ThreadingWSGIServerV6 if ":" in self.host else ThreadingWSGIServer
        try:
            httpd = make_server(
                self.host, self.port, metrics_app(self.registry), server_class, _QuietHandler
            )
        except OSError as exc:  # e.g. address in use: name the address, as the others do
            raise OSError(
                exc.errno, f"cannot bind metrics to {self.host}:{self.port}: {exc.strerror}"
            ) from exc
        self._httpd = httpd
        self._thread = threading.Thread(
            target=httpd.serve_forever, args=(0.1,), name="mmadmit-metrics", daemon=True
        )
        self._thread.start()
        host, port = str(httpd.server_address[0]), httpd.server_address[1]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        logger.info("metrics on http://%s/metrics", address)
        return address

    async def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        # shutdown() waits for serve_forever to notice (its poll interval): not on the loop
        await asyncio.to_thread(httpd.shutdown)
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(1.0)
