"""ZMQ msgpack client of mmadmit's reply mode (WIRE.md).

A DEALER connects to the service's ROUTER; each ADD gets exactly one reply,
possibly out of order. A background task reads replies and routes each to the
future of its request id (several requests in flight with the same id are
answered in arrival order: the service itself refuses a duplicate id that is
still in flight, and that refusal is usually the first reply).

An abort is an outcome, not an exception: :meth:`AsyncZmqClient.admit` returns a
:class:`ZmqOutcome` for both. Exceptions (``mmadmit_client._exceptions``) are for
what is not an outcome, each chained ``from`` the zmq error behind it::

    async with AsyncZmqClient("tcp://127.0.0.1:5557", timeout_s=10) as client:
        outcome = await client.admit(request)          # an mmadmit.model.Request
        outcome = await client.admit(frames)           # raw [type, payload, *aux]
        await client.abort("rid-1", "rid-2")

    with ZmqClient("tcp://127.0.0.1:5557") as client:  # blocking twin
        outcome = client.admit(request)

CURVE: give the server's public key (``curve_server_key=``, Z85, e.g. from
:func:`curve_server_key_from_file`) and the socket speaks CURVE, with this
client's keypair (``curve_keypair=``, from :func:`curve_keypair_from_file`, for
a server that admits only listed keys) or a fresh one per client. "Connected"
means the ZMTP handshake completed (CURVE or not); a server that refuses the
key (its ZAP allow-list) or the mechanism makes :meth:`AsyncZmqClient.wait_connected`
raise :class:`~mmadmit_client.ServerUnavailable` saying so.

Buffers: frames are sent with ``copy=False``; the caller must not modify a
buffer it passed to :meth:`~AsyncZmqClient.admit` until the call returns.
Reply frames are ``zmq.Frame`` objects; the decoded request's tensors are views
on them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal, TypeVar

import msgspec
import zmq
import zmq.asyncio
from mmadmit import wire
from mmadmit.model import Request
from zmq.utils.monitor import parse_monitor_message

from ._exceptions import (
    ClientStateError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
)
from ._state import ClientState

logger = logging.getLogger(__name__)

T = TypeVar("T")
_ABORT_ENC = msgspec.msgpack.Encoder()


@dataclass(frozen=True, eq=False)
class ZmqOutcome:
    """One reply: materialized, or aborted with its code and message."""

    status: Literal["materialized", "aborted"]
    rid: str
    request: Request  # the reply payload, decoded (features removed when aborted)
    abort_code: str | None  # e.g. "INVALID_REQUEST"; None when materialized
    abort_message: str | None
    frames: list[Any]  # the reply as received: [status, payload, *aux] (zmq.Frame)

    @property
    def materialized(self) -> bool:
        return self.status == "materialized"

    @property
    def aborted(self) -> bool:
        return self.status == "aborted"


def parse_validation_error(text: str) -> tuple[str, str]:
    """``"CODE: message"`` -> (code, message); text without a code is INVALID_REQUEST."""
    code, sep, message = text.partition(": ")
    if sep and code.isupper() and code.replace("_", "").isalpha():
        return code, message
    return "INVALID_REQUEST", text


def decode_reply(frames: Sequence[Any]) -> tuple[str, ZmqOutcome | ProtocolError]:
    """Decode a reply into (rid, outcome), or (rid if readable else "", the error)."""
    if len(frames) < 2:
        return "", ProtocolError(f"a reply needs at least 2 frames, got {len(frames)}")
    status = bytes(frames[0])
    try:
        request = wire.decode_request(frames[1], list(frames[2:]))
    except wire.WireError as exc:
        err = ProtocolError(f"undecodable reply payload: {exc.message}")
        err.__cause__ = exc
        return exc.rid, err
    if status == bytes([wire.STATUS_MATERIALIZED]):
        return request.rid, ZmqOutcome(
            "materialized", request.rid, request, None, None, list(frames)
        )
    if status == bytes([wire.STATUS_ABORTED]):
        code, message = parse_validation_error(request.validation_error or "")
        return request.rid, ZmqOutcome("aborted", request.rid, request, code, message, list(frames))
    return request.rid, ProtocolError(f"unknown reply status byte {status.hex() or '(empty)'}")


def _frames_of(request_or_frames: Request | Sequence[Any]) -> tuple[list[Any], str]:
    if isinstance(request_or_frames, Request):
        return [
            bytes([wire.MSG_ADD]),
            *wire.encode_request(request_or_frames),
        ], request_or_frames.rid
    frames = list(request_or_frames)
    if not frames:
        raise ValueError("a message needs at least one frame")
    rid = wire.recover_rid(frames[1]) if len(frames) > 1 else ""
    return frames, rid


def _key_file_pair(path: str | os.PathLike[str], what: str) -> tuple[bytes, bytes | None]:
    import zmq.auth

    name = os.fspath(path)
    try:
        return zmq.auth.load_certificate(name)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"{what} {name}: not a readable zmq.auth key file: {why}") from exc


def curve_server_key_from_file(path: str | os.PathLike[str]) -> bytes:
    """The server's public key (Z85) from its ``zmq.auth`` key file (``NAME.key``;
    a ``NAME.key_secret`` holds it too). ``ValueError`` names an unusable file."""
    public, _ = _key_file_pair(path, "CURVE server key")
    return public


def curve_keypair_from_file(path: str | os.PathLike[str]) -> tuple[bytes, bytes]:
    """This client's (public, secret) keypair from its ``NAME.key_secret`` file."""
    public, secret = _key_file_pair(path, "CURVE client key")
    if not secret:
        raise ValueError(
            f"CURVE client key {os.fspath(path)}: holds no secret key (give the "
            "NAME.key_secret file, not the public NAME.key)"
        )
    return public, secret


# Handshake events: "connected" is a completed ZMTP handshake, not a TCP connection.
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED


class AsyncZmqClient:
    """Async client over one DEALER socket; an async context manager.

    ``timeout_s`` bounds each :meth:`admit` (connecting included: with nothing
    listening the call ends in :class:`ServerUnavailable`). ``identity`` sets the
    DEALER's routing identity (request ids are scoped to it by the service).
    ``curve_server_key`` (Z85) turns CURVE on, with ``curve_keypair`` (public,
    secret; Z85) or an ephemeral keypair.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        identity: bytes | None = None,
        context: zmq.asyncio.Context | None = None,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
    ) -> None:
        if curve_keypair is not None and curve_server_key is None:
            raise ValueError("curve_keypair needs curve_server_key (the server's public key)")
        self.address = address
        self.timeout_s = timeout_s
        self.identity = identity
        self.curve_server_key = curve_server_key
        self._curve_keypair = curve_keypair
        # Why the last handshake failed, and whether the server refused our key.
        self.handshake_error: str | None = None
        self.refused = False
        self._refused_event = asyncio.Event()
        self.state = ClientState.UNOPENED
        self._ctx = context
        self._own_ctx = context is None
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self.connected = False  # a handshaken connection to the server exists right now
        self._connected_event = asyncio.Event()  # set while ``connected``
        self._pending: dict[str, collections.deque[asyncio.Future[ZmqOutcome]]] = {}
        self.unmatched_replies = 0  # replies no pending request was waiting for

    async def __aenter__(self) -> AsyncZmqClient:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def open(self) -> None:
        if self.state is not ClientState.UNOPENED:
            raise ClientStateError(f"cannot open a client that is {self.state.name}")
        try:
            if self._ctx is None:
                self._ctx = zmq.asyncio.Context()
            sock = self._ctx.socket(zmq.DEALER)
            self._sock = sock
            sock.setsockopt(zmq.LINGER, 0)
            # Not ZMQ_IMMEDIATE: with it, libzmq drops replies already received but
            # not yet read when the server disconnects (exactly what a draining
            # server does). Whether a connection exists is tracked by a monitor
            # instead, so a timeout with nothing connected is ServerUnavailable.
            self._monitor = sock.get_monitor_socket(_MONITOR_EVENTS)
            if self.identity is not None:
                sock.setsockopt(zmq.IDENTITY, self.identity)
            if self.curve_server_key is not None:
                public, secret = self._curve_keypair or zmq.curve_keypair()
                sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve_server_key)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.connect(self.address)
        except zmq.ZMQError as exc:
            self._close_socket()
            self.state = ClientState.CLOSED
            raise TransportError(f"cannot connect to {self.address}: {exc}") from exc
        self._recv_task = asyncio.create_task(self._receive(), name="mmadmit-client-recv")
        self._monitor_task = asyncio.create_task(self._watch(), name="mmadmit-client-monitor")
        self.state = ClientState.OPENED

    async def _watch(self) -> None:
        """Follow connection events (sets ``connected``, ``handshake_error``, ``refused``)."""
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self.handshake_error = None
                self._connected_event.set()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self._connected_event.clear()
            elif kind & _HANDSHAKE_FAILED:
                self.handshake_error = self._describe_failure(kind, value)
                logger.debug("%s: %s", self.address, self.handshake_error)
                if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    self.refused = True
                    self._refused_event.set()

    def _describe_failure(self, kind: int, value: int) -> str:
        curve = self.curve_server_key is not None
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return f"the server refused this client's CURVE key (ZAP status {value})"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                return (
                    "security mechanism mismatch: the server speaks CURVE (give its public key)"
                    if not curve
                    else "security mechanism mismatch: the server does not speak CURVE"
                )
            return f"ZMTP handshake failed (protocol error {value:#x})"
        return (
            "the CURVE handshake failed (is the server's public key right?)"
            if curve
            else "the ZMTP handshake failed (does the server require CURVE?)"
        )

    def _unavailable_detail(self) -> str:
        return f" ({self.handshake_error})" if self.handshake_error else ""

    async def wait_connected(self, timeout_s: float | None = None) -> None:
        """Return once a connection to the server exists; :class:`ServerUnavailable`
        when none is made within ``timeout_s`` (default: the client's ``timeout_s``).

        A short connect check before sending: without it, a request to an address
        where nothing listens waits out its whole request timeout. A connection
        counts once its ZMTP handshake completed (CURVE included); a server that
        refuses this client's CURVE key fails the wait at once, one that fails the
        handshake otherwise (a mechanism mismatch, a wrong server key) at the
        timeout, and the message says why.
        """
        self._check_open()
        timeout = self.timeout_s if timeout_s is None else timeout_s
        connected = asyncio.ensure_future(self._connected_event.wait())
        refused = asyncio.ensure_future(self._refused_event.wait())
        try:
            await asyncio.wait(
                {connected, refused}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in (connected, refused):
                waiter.cancel()
        if self.connected:
            return
        if self.refused:
            raise ServerUnavailable(f"{self.address}: {self.handshake_error}")
        raise ServerUnavailable(
            f"no connection to {self.address} within {timeout}s{self._unavailable_detail()}"
        )

    async def aclose(self) -> None:
        """Close (idempotent); requests still waiting fail with ClientStateError."""
        if self.state is ClientState.CLOSED:
            return
        self.state = ClientState.CLOSED
        tasks = [t for t in (self._recv_task, self._monitor_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for futs in self._pending.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(ClientStateError("the client was closed"))
        self._pending.clear()
        self._close_socket()

    def _close_socket(self) -> None:
        if self._monitor is not None and not self._monitor.closed:
            self._monitor.close(linger=0)
        if self._sock is not None and not self._sock.closed:
            self._sock.close(linger=0)
        if self._own_ctx and self._ctx is not None and not self._ctx.closed:
            self._ctx.term()  # every socket is closed with linger 0: returns at once

    def _check_open(self) -> zmq.asyncio.Socket:
        if self.state is not ClientState.OPENED or self._sock is None:
            raise ClientStateError(
                f"the client is {self.state.name}; use it inside 'async with' (or call open())"
            )
        return self._sock

    # ------------------------------------------------------------------ requests

    async def admit(
        self, request_or_frames: Request | Sequence[Any], *, timeout_s: float | None = None
    ) -> ZmqOutcome:
        """Send one ADD (a Request, or raw frames ``[type, payload, *aux]``) and
        return its reply. Raw frames may be anything the service should see,
        malformed ones included (their reply is an abort)."""
        sock = self._check_open()
        frames, rid = _frames_of(request_or_frames)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        fut: asyncio.Future[ZmqOutcome] = asyncio.get_running_loop().create_future()
        queue = self._pending.setdefault(rid, collections.deque())
        queue.append(fut)
        sent = False
        try:
            async with asyncio.timeout(timeout):
                await sock.send_multipart(frames, copy=False)
                sent = True
                return await fut
        except TimeoutError as exc:
            if not sent or not self.connected:
                raise ServerUnavailable(
                    f"no connection to {self.address} accepted the request within {timeout}s"
                    f"{self._unavailable_detail()}"
                ) from exc
            raise RequestTimeout(f"rid={rid}: no reply within {timeout}s") from exc
        except zmq.ZMQError as exc:
            raise TransportError(f"rid={rid}: send failed: {exc}") from exc
        finally:
            if not fut.done():
                fut.cancel()
            if fut in queue:
                queue.remove(fut)
            if not queue and self._pending.get(rid) is queue:
                del self._pending[rid]

    async def abort(self, *rids: str) -> None:
        """Send one ABORT naming ``rids`` (no reply; each cancelled ADD gets its own)."""
        sock = self._check_open()
        try:
            async with asyncio.timeout(self.timeout_s):
                await sock.send_multipart([bytes([wire.MSG_ABORT]), _ABORT_ENC.encode(list(rids))])
        except TimeoutError as exc:
            raise ServerUnavailable(f"no connection to {self.address} took the ABORT") from exc
        except zmq.ZMQError as exc:
            raise TransportError(f"ABORT send failed: {exc}") from exc
        if not self.connected:
            # queued in the socket; it goes out if the server comes up while we are open
            logger.debug("ABORT queued: no connection to %s yet", self.address)

    # ------------------------------------------------------------------ replies

    async def _receive(self) -> None:
        sock = self._sock
        assert sock is not None
        while True:
            try:
                frames = await sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                self._fail_all(TransportError(f"receive failed: {exc}"), exc)
                return
            self._dispatch(frames)

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        rid, result = decode_reply(frames)
        queue = self._pending.get(rid)
        while queue:
            fut = queue.popleft()
            if not fut.done():
                if isinstance(result, ProtocolError):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
                return
        self.unmatched_replies += 1
        logger.debug("rid=%s: reply with no request waiting for it (dropped)", rid)

    def _fail_all(self, err: TransportError, cause: BaseException) -> None:
        err.__cause__ = cause
        for futs in self._pending.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(err)


class ZmqClient:
    """Blocking twin of :class:`AsyncZmqClient`: a private event loop in a thread.

    Methods are safe to call from any thread; they block until the loop thread
    has the answer.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = 30.0,
        identity: bytes | None = None,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
    ) -> None:
        self._client = AsyncZmqClient(
            address,
            timeout_s=timeout_s,
            identity=identity,
            curve_server_key=curve_server_key,
            curve_keypair=curve_keypair,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def state(self) -> ClientState:
        return self._client.state

    def __enter__(self) -> ZmqClient:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> None:
        if self.state is not ClientState.UNOPENED:
            raise ClientStateError(f"cannot open a client that is {self.state.name}")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="mmadmit-zmq-client", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self._client.open())
        except BaseException:
            self._stop_loop()
            raise

    def close(self) -> None:
        if self._loop is None:
            self._client.state = ClientState.CLOSED
            return
        try:
            self._call(self._client.aclose())
        finally:
            self._stop_loop()

    def admit(
        self, request_or_frames: Request | Sequence[Any], *, timeout_s: float | None = None
    ) -> ZmqOutcome:
        return self._call(self._client.admit(request_or_frames, timeout_s=timeout_s))

    def abort(self, *rids: str) -> None:
        self._call(self._client.abort(*rids))

    def wait_connected(self, timeout_s: float | None = None) -> None:
        self._call(self._client.wait_connected(timeout_s))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None or loop.is_closed():
            coro.close()
            raise ClientStateError(f"the client is {self.state.name}")
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
