"""In-memory transport: a :class:`~mmadmit_client.Client` over a function, for tests.

Code that takes a :class:`~mmadmit_client.Client` can be tested without a
server (httpx's ``MockTransport``)::

    async def handler(request: Request) -> Outcome:
        if not request.items:
            return Aborted(request.request_id, "INVALID_REQUEST", "no items")
        return Materialized(request.request_id, request.input_ids, None)

    async with Client(MemoryTransport(handler)) as client:
        outcome = await client.admit(request)

The handler gets the very :class:`~mmadmit_client.Request` given to
``admit`` (no encoding in between) and returns its outcome; whatever it
raises reaches the caller unchanged (a ``timeout_s`` that runs out is
:class:`~mmadmit_client.RequestTimeout`), so it can also play a failing server
(``raise ServerUnavailable(...)``). ``abort`` hands the ids to ``on_abort``
(if given; else it only records them in :attr:`MemoryTransport.aborted`),
``health`` answers ``health_status``, ``model_info`` returns ``model_info_value``
(:class:`~mmadmit_client.UnsupportedOperation` when not given).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import ClassVar

from .._exceptions import RequestTimeout, UnsupportedOperation
from .._models import ModelInfo, Outcome, Request
from .base import AsyncTransport

Handler = Callable[[Request], Awaitable[Outcome]]
AbortHandler = Callable[[tuple[str, ...]], Awaitable[bool]]


@dataclass(eq=False)
class MemoryTransport(AsyncTransport):
    kind: ClassVar[str] = "memory"

    handler: Handler
    _: KW_ONLY
    on_abort: AbortHandler | None = None
    health_status: str = "SERVING"
    model_info_value: ModelInfo | None = None
    target: str = "memory://"
    requests: list[Request] = field(default_factory=list)  # every request admitted, in order
    aborted: list[str] = field(default_factory=list)  # every id given to abort, in order

    async def admit(self, request: Request, timeout_s: float | None = None) -> Outcome:
        self.requests.append(request)
        try:
            async with asyncio.timeout(timeout_s):
                return await self.handler(request)
        except TimeoutError as exc:
            raise RequestTimeout(
                f"rid={request.request_id}: no outcome within {timeout_s}s"
            ) from exc

    async def abort(self, request_ids: tuple[str, ...], reason: str = "") -> bool:
        self.aborted.extend(request_ids)
        return await self.on_abort(request_ids) if self.on_abort is not None else True

    async def health(self, service: str = "", timeout_s: float | None = None) -> str:
        return self.health_status

    async def model_info(self, timeout_s: float | None = None) -> ModelInfo:
        if self.model_info_value is None:
            raise UnsupportedOperation("this MemoryTransport was given no model_info_value")
        return self.model_info_value


__all__ = ["AbortHandler", "Handler", "MemoryTransport"]
