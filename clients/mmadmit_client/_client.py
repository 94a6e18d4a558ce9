"""The one client: :class:`Client` (async) over any transport, :class:`BlockingClient`.

::

    transport = GrpcTransport("127.0.0.1:50051")        # or ZmqTransport("tcp://..."),
    async with Client(transport) as client:              #    MemoryTransport(handler)
        outcome = await client.admit(request)
        if isinstance(outcome, Aborted):
            print(outcome.code, outcome.message)

    with BlockingClient(ZmqTransport("tcp://127.0.0.1:5557")) as client:
        outcome = client.admit(request)

State is explicit (:class:`~mmadmit_client.ClientState`): ``UNOPENED`` ->
``OPENED`` -> ``CLOSED``; a closed client is never reopened, and a call while
not open raises :class:`~mmadmit_client.ClientStateError`. Outcomes are
values (:class:`~mmadmit_client.Materialized` / :class:`~mmadmit_client.Aborted`);
exceptions are for what is not an outcome (``_exceptions.py``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Coroutine,
    Iterable,
    Iterator,
)
from typing import Any, TypeVar, cast

from ._exceptions import ClientStateError
from ._models import ModelInfo, Outcome, Request
from ._state import ClientState
from ._transports.base import AsyncTransport

T = TypeVar("T")


class Client:
    """Async client over one transport; use it on one event loop, inside ``async with``.

    ``timeout_s``: the default bound on each request's outcome (None: the
    transport's own). The transport is opened on entry and closed on exit.
    """

    def __init__(self, transport: AsyncTransport, *, timeout_s: float | None = None) -> None:
        self.transport = transport
        self.timeout_s = timeout_s
        self._state = ClientState.UNOPENED

    @property
    def state(self) -> ClientState:
        return self._state

    def _require_open(self) -> AsyncTransport:
        if self._state is not ClientState.OPENED:
            raise ClientStateError(
                f"the client for {self.transport.target} is {self._state.name.lower()}; "
                "use it inside 'async with' (a closed client cannot be reopened)"
            )
        return self.transport

    async def open(self) -> None:
        if self._state is not ClientState.UNOPENED:
            raise ClientStateError(
                f"the client for {self.transport.target} cannot be opened twice (state "
                f"{self._state.name.lower()})"
            )
        try:
            await self.transport.open()
        except BaseException:
            self._state = ClientState.CLOSED
            raise
        self._state = ClientState.OPENED

    async def aclose(self) -> None:
        """Close (idempotent); requests still waiting fail with ClientStateError."""
        if self._state is ClientState.OPENED:
            self._state = ClientState.CLOSED
            await self.transport.aclose()
        self._state = ClientState.CLOSED

    async def __aenter__(self) -> Client:
        await self.open()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s

    async def wait_ready(self, timeout_s: float = 5.0) -> None:
        """Return once the server is reachable; ServerUnavailable when not in time
        (gRPC: a health check; ZMQ: a handshaken connection)."""
        await self._require_open().wait_ready(timeout_s)

    async def admit(self, request: Request, *, timeout_s: float | None = None) -> Outcome:
        """Admit one request and return its outcome."""
        return await self._require_open().admit(request, self._timeout(timeout_s))

    async def admit_many(
        self,
        requests: Iterable[Request] | AsyncIterable[Request],
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Outcome]:
        """Admit many requests; outcomes arrive in completion order (match them by
        ``request_id``). gRPC sends them on one ``AdmitStream`` call."""
        transport = self._require_open()
        async for outcome in transport.admit_many(requests, self._timeout(timeout_s)):
            yield outcome

    async def abort(self, *request_ids: str, reason: str = "") -> bool:
        """Cancel requests in flight on the server (each still gets its outcome,
        ``CANCELLED``). gRPC: False when none was in flight there; ZMQ: True once sent."""
        return await self._require_open().abort(tuple(request_ids), reason)

    async def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        """The health status name: ``SERVING``, ``NOT_SERVING``, ``SERVICE_UNKNOWN``
        (the server does not know ``service``). gRPC only."""
        return await self._require_open().health(service, timeout_s)

    async def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        """The profile the server loaded. gRPC only."""
        return await self._require_open().model_info(timeout_s)


class BlockingClient:
    """The blocking face of :class:`Client`: the same methods, run on a private event
    loop in a thread. Methods are safe to call from any thread; each blocks until
    the loop has the answer. Use it inside ``with``."""

    def __init__(self, transport: AsyncTransport, *, timeout_s: float | None = None) -> None:
        self.client = Client(transport, timeout_s=timeout_s)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> ClientState:
        return self.client.state

    @property
    def transport(self) -> AsyncTransport:
        return self.client.transport

    def __enter__(self) -> BlockingClient:
        self.open()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def open(self) -> None:
        if self.state is not ClientState.UNOPENED:
            raise ClientStateError(f"cannot open a client that is {self.state.name.lower()}")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="mmadmit-client", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self.client.open())
        except BaseException:
            self._stop_loop()
            raise

    def close(self) -> None:
        if self._loop is None:
            self.client._state = ClientState.CLOSED
            return
        try:
            self._call(self.client.aclose())
        finally:
            self._stop_loop()

    def wait_ready(self, timeout_s: float = 5.0) -> None:
        self._call(self.client.wait_ready(timeout_s))

    def admit(self, request: Request, *, timeout_s: float | None = None) -> Outcome:
        return self._call(self.client.admit(request, timeout_s=timeout_s))

    def admit_many(
        self, requests: Iterable[Request], *, timeout_s: float | None = None
    ) -> Iterator[Outcome]:
        """Outcomes in completion order, each as it arrives."""
        agen = cast(
            AsyncGenerator[Outcome, None],
            self.client.admit_many(list(requests), timeout_s=timeout_s),
        )

        async def step() -> Outcome:
            return await agen.__anext__()

        try:
            while True:
                try:
                    yield self._call(step())
                except StopAsyncIteration:
                    return
        finally:
            if self._loop is not None and not self._loop.is_closed():
                self._call(agen.aclose())

    def abort(self, *request_ids: str, reason: str = "") -> bool:
        return self._call(self.client.abort(*request_ids, reason=reason))

    def health(self, service: str = "", *, timeout_s: float | None = None) -> str:
        return self._call(self.client.health(service, timeout_s=timeout_s))

    def model_info(self, *, timeout_s: float | None = None) -> ModelInfo:
        return self._call(self.client.model_info(timeout_s=timeout_s))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            raise ClientStateError(f"the client is {self.state.name.lower()}")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()
        loop.close()


__all__ = ["BlockingClient", "Client"]
