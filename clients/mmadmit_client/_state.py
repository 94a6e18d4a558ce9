"""The explicit lifecycle state every client carries (httpx-style)."""

from __future__ import annotations

import enum


class ClientState(enum.Enum):
    UNOPENED = 1  # constructed; enter the context (or call open()) first
    OPENED = 2  # connected; requests may be sent
    CLOSED = 3  # closed for good; a client is never reopened
