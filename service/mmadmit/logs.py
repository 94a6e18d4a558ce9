"""Logging set-up of ``mmadmit serve``: ``--log-level`` and ``--log-format`` (docs/spec/CLI.md).

``text`` is the classic ``time LEVEL logger: message`` line. ``json`` writes
one JSON object per line on standard error, with ``ts`` (UTC, ISO 8601, ms),
``level``, ``logger`` and ``message``, plus the structured fields a call site
passes as ``extra={"fields": {...}}`` (the outcome lines carry ``event``,
``rid``, ``transport``, ``outcome``, ``code``, ``tokens``, ``items`` and
``latency_ms``; start-up, readiness and drain lines carry ``event`` and their
addresses or counts). An exception's traceback goes in ``exc_info``.

Modules log through ``logging.getLogger(__name__)`` and know nothing of this.

Logging never blocks the event loop: a record is put on a bounded queue (its
message formatted later, off the loop; only a traceback is rendered at once)
and one writer thread formats and writes it. A standard error that nobody
reads therefore stalls the writer, never the service: once the queue is full,
records are dropped and counted (:func:`dropped_records`, exported as
``mmadmit_log_records_dropped_total``). The service's machine-readable lines
(:func:`write_line`: the ready line and the like) go through the same queue,
so they keep their order with the log records around them. :func:`stop_writer`
flushes for a bounded time at exit.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import queue
import sys
import threading
from datetime import UTC, datetime
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Records and lines waiting for the writer thread before new ones are dropped.
QUEUE_RECORDS = 10_000
# How long stop_writer() waits for the queue to drain at exit (a reader may be gone).
FLUSH_S = 2.0


def fields(event: str, **values: Any) -> dict[str, Any]:
    """``extra=`` for a structured line: ``logger.info(msg, extra=fields("ready", ...))``."""
    return {"fields": {"event": event, **values}}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; never raises on odd values (they become strings)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            for key, value in extra.items():
                out.setdefault(str(key), value)
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def json_line(name: str, message: str, extra: dict[str, Any]) -> str:
    """The JSON line of an INFO record of logger ``name`` (for lines shown at any level)."""
    record = logging.LogRecord(name, logging.INFO, __file__, 0, message, None, None)
    record.__dict__.update(extra)
    return JsonFormatter().format(record)


class _QueueHandler(logging.handlers.QueueHandler):
    """Puts records on the writer's bounded queue without ever waiting; a full queue
    drops the record and counts it."""

    def __init__(self, q: queue.Queue[Any]) -> None:
        super().__init__(q)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        # The message is formatted by the writer, off the loop; a traceback must be
        # rendered now (its frames do not outlive the except block meaningfully).
        if record.exc_info:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return record

    def enqueue(self, record: Any) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class _Writer(threading.Thread):
    """Formats what the queue holds and writes it to the stderr file descriptor with
    ``os.write``: the only place that may block on a full pipe, and it holds no
    lock meanwhile (neither a logging handler's nor ``sys.stderr``'s), so neither
    the service nor the interpreter's exit waits on it."""

    def __init__(self, q: queue.Queue[Any], formatter: logging.Formatter, fd: int) -> None:
        super().__init__(name="mmadmit-log-writer", daemon=True)
        self.queue, self.formatter, self.fd = q, formatter, fd

    def run(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            try:
                text = item if isinstance(item, str) else self.formatter.format(item)
                data = (text + "\n").encode("utf-8", "replace")
                while data:
                    data = data[os.write(self.fd, data) :]
            except Exception:  # noqa: BLE001 - a closed stream must not kill the writer
                pass


_state: dict[str, Any] = {}


def configure_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once (replacing any earlier set-up): a queue handler
    in front of a writer thread and the stderr handler."""
    stop_writer()
    formatter = JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT)
    sys.stderr.flush()  # what was printed before goes first
    q: queue.Queue[Any] = queue.Queue(maxsize=QUEUE_RECORDS)
    front = _QueueHandler(q)
    writer = _Writer(q, formatter, sys.stderr.fileno())
    writer.start()
    _state.update(handler=front, writer=writer)
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[front], force=True)


def write_line(line: str) -> None:
    """A machine-readable line on standard error, in order with the log records
    (through the writer when logging is configured, else printed at once)."""
    front = _state.get("handler")
    if front is None:
        print(line, file=sys.stderr, flush=True)
        return
    front.enqueue(line)


def dropped_records() -> int:
    """Records (and lines) dropped because the writer could not keep up."""
    front = _state.get("handler")
    return 0 if front is None else int(front.dropped)


def stop_writer(timeout_s: float = FLUSH_S) -> None:
    """Flush what is queued for at most ``timeout_s`` and stop the writer (idempotent;
    records logged afterwards are dropped: this runs as the process ends)."""
    writer = _state.pop("writer", None)
    _state.pop("handler", None)
    if writer is None:
        return
    try:
        writer.queue.put(None, timeout=timeout_s)
    except queue.Full:
        return  # nobody reads: the daemon thread dies with the process
    writer.join(timeout_s)


__all__ = [
    "JsonFormatter",
    "TEXT_FORMAT",
    "configure_logging",
    "dropped_records",
    "fields",
    "json_line",
    "stop_writer",
    "write_line",
]
