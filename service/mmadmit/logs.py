"""Logging set-up of ``mmadmit serve``: ``--log-level`` and ``--log-format`` (CLI.md).

``text`` is the classic ``time LEVEL logger: message`` line. ``json`` writes
one JSON object per line on standard error, with ``ts`` (UTC, ISO 8601, ms),
``level``, ``logger`` and ``message``, plus the structured fields a call site
passes as ``extra={"fields": {...}}`` (the outcome lines carry ``event``,
``rid``, ``transport``, ``outcome``, ``code``, ``tokens``, ``items`` and
``latency_ms``; start-up, readiness and drain lines carry ``event`` and their
addresses or counts). An exception's traceback goes in ``exc_info``.

Modules log through ``logging.getLogger(__name__)`` and know nothing of this.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


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


def configure_logging(level: str, fmt: str = "text") -> None:
    """Configure the root logger once (replacing any earlier set-up)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler], force=True)


__all__ = ["JsonFormatter", "TEXT_FORMAT", "configure_logging", "fields", "json_line"]
