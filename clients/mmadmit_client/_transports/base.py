"""The transport interface every :class:`~mmadmit_client.Client` speaks through.

A transport moves one :class:`~mmadmit_client.Request` to a server and brings
back its one :class:`~mmadmit_client.Outcome`; it owns its connection and maps
its library's errors into the client's exception tree (``_exceptions.py``),
chained with ``from``. It holds no client state: :class:`~mmadmit_client.Client`
guards the lifecycle (open once, then closed for good) and calls
:meth:`~AsyncTransport.open` / :meth:`~AsyncTransport.aclose` exactly once each.

What a transport cannot do raises :class:`~mmadmit_client.UnsupportedOperation`
(the defaults here): ZMQ has no health check or model info, the in-memory
transport only what its user gives it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import ClassVar

from .._exceptions import UnsupportedOperation
from .._models import ModelInfo, Outcome, Request


class AsyncTransport:
    """Base class of the transports; subclasses implement :meth:`admit` at least."""

    kind: ClassVar[str] = "base"
    target: str = ""

    async def open(self) -> None:
        """Make the connection (lazily: nothing has to answer yet)."""

    async def aclose(self) -> None:
        """Release the connection; requests still waiting fail with ClientStateError."""

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once the server is reachable; ServerUnavailable when not within
        ``timeout_s``. The default has nothing to wait for."""

    async def admit(self, request: Request, timeout_s: float | None = None) -> Outcome:
        """Send one request and return its outcome; ``timeout_s`` bounds the wait."""
        raise NotImplementedError

    async def admit_many(
        self,
        requests: Iterable[Request] | AsyncIterable[Request],
        timeout_s: float | None = None,
    ) -> AsyncIterator[Outcome]:
        """Admit many, outcomes in completion order (match them by ``request_id``).

        The default sends them all concurrently through :meth:`admit`; a failure
        ends the iteration with that exception after cancelling the rest.
        """
        if isinstance(requests, AsyncIterable):
            reqs = [r async for r in requests]
        else:
            reqs = list(requests)
        tasks = [asyncio.ensure_future(self.admit(r, timeout_s)) for r in reqs]
        try:
            for done in asyncio.as_completed(tasks):
                yield await done
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def abort(self, request_ids: tuple[str, ...], reason: str = "") -> bool:
        """Cancel requests in flight; True when the server took the cancellation."""
        raise UnsupportedOperation(f"the {self.kind} transport cannot abort requests")

    async def health(self, service: str = "", timeout_s: float | None = None) -> str:
        """The health status name (``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``)."""
        raise UnsupportedOperation(f"the {self.kind} transport has no health check")

    async def model_info(self, timeout_s: float | None = None) -> ModelInfo:
        raise UnsupportedOperation(f"the {self.kind} transport has no model info")

    @property
    def counters(self) -> dict[str, int]:
        """Transport-level counters worth reporting (e.g. replies nobody waited for)."""
        return {}
