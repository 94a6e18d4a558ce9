"""ZMQ transport: mmadmit's reply mode (WIRE.md) over one DEALER socket.

The DEALER connects to the service's ROUTER; each ADD gets exactly one reply,
possibly out of order. A background task reads replies and routes each to the
future of its request id (several requests in flight with the same id are
answered in arrival order: the service itself refuses a duplicate id that is
still in flight, and that refusal is usually the first reply). Requests are
encoded by :mod:`mmadmit_client.wire`; :meth:`ZmqTransport.admit_frames` sends
raw frames, malformed ones included (the service answers them with an abort).

Errors, each chained ``from`` the zmq error behind it: nothing connected
within the timeout is :class:`~mmadmit_client.ServerUnavailable`, a
connection that took the request but gave no reply in time
:class:`~mmadmit_client.RequestTimeout`, a socket failure
:class:`~mmadmit_client.TransportError`, an undecodable reply
:class:`~mmadmit_client.ProtocolError`.

CURVE: give the server's public key (``curve_server_key=``, Z85, e.g. from
:func:`curve_server_key_from_file`) and the socket speaks CURVE, with this
client's keypair (``curve_keypair=``, from :func:`curve_keypair_from_file`, for
a server that admits only listed keys) or a fresh one per transport.
"Connected" means the ZMTP handshake completed (CURVE or not); a server that
refuses the key (its ZAP allow-list) or the mechanism makes
:meth:`ZmqTransport.wait_ready` raise :class:`~mmadmit_client.ServerUnavailable`
saying so.

Buffers: frames are sent with ``copy=False``; the caller must not modify a
buffer it passed until the call returns. Reply frames are ``zmq.Frame``
objects; the outcome's arrays and tensors are views on them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from .. import wire
from .._exceptions import (
    ClientStateError,
    ProtocolError,
    RequestTimeout,
    ServerUnavailable,
    TransportError,
)
from .._models import Outcome, Request
from .base import AsyncTransport

logger = logging.getLogger(__name__)


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


class ZmqTransport(AsyncTransport):
    """One DEALER socket to ``address`` (``tcp://HOST:PORT``, ``ipc://PATH``).

    ``timeout_s`` bounds each request by default (connecting included: with
    nothing listening the call ends in :class:`ServerUnavailable`).
    ``identity`` sets the DEALER's routing identity (request ids are scoped to
    it by the service). ``curve_server_key`` (Z85) turns CURVE on, with
    ``curve_keypair`` (public, secret; Z85) or an ephemeral keypair.
    """

    kind: ClassVar[str] = "zmq"

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
        self.target = address
        self.timeout_s = timeout_s
        self.identity = identity
        self.curve_server_key = curve_server_key
        self._curve_keypair = curve_keypair
        # Why the last handshake failed, and whether the server refused our key.
        self.handshake_error: str | None = None
        self.refused = False
        self._refused_event = asyncio.Event()
        self._ctx = context
        self._own_ctx = context is None
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self.connected = False  # a handshaken connection to the server exists right now
        self._connected_event = asyncio.Event()  # set while ``connected``
        self._pending: dict[str, collections.deque[asyncio.Future[Outcome]]] = {}
        self.unmatched_replies = 0  # replies no pending request was waiting for

    @property
    def address(self) -> str:
        return self.target

    async def open(self) -> None:
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
            sock.connect(self.target)
        except zmq.ZMQError as exc:
            self._close_socket()
            raise TransportError(f"cannot connect to {self.target}: {exc}") from exc
        self._recv_task = asyncio.create_task(self._receive(), name="mmadmit-client-recv")
        self._monitor_task = asyncio.create_task(self._watch(), name="mmadmit-client-monitor")

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
                # A mismatch or refusal ends the session (libzmq does not retry it);
                # a connection reset mid-handshake (NO_DETAIL) is retried.
                self.handshake_error = self._describe_failure(kind, value)
                logger.debug("%s: %s", self.target, self.handshake_error)
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
        # NO_DETAIL: the connection failed mid-handshake (``value`` is the errno),
        # e.g. a CURVE server reset it before this side read the mismatch.
        why = f": {os.strerror(value)}" if value > 0 else ""
        return (
            f"the CURVE handshake failed{why} (is the server's public key right?)"
            if curve
            else f"the ZMTP handshake failed{why} (if the server speaks CURVE, give its public key)"
        )

    def _unavailable_detail(self) -> str:
        return f" ({self.handshake_error})" if self.handshake_error else ""

    async def wait_ready(self, timeout_s: float) -> None:
        """Return once a connection to the server exists; :class:`ServerUnavailable`
        when none is made within ``timeout_s``.

        A short connect check before sending: without it, a request to an address
        where nothing listens waits out its whole request timeout. A connection
        counts once its ZMTP handshake completed (CURVE included); a server that
        refuses this client's CURVE key fails the wait at once, one that fails the
        handshake otherwise (a mechanism mismatch, a wrong server key) at the
        timeout, and the message says why.
        """
        self._check_open()
        connected = asyncio.ensure_future(self._connected_event.wait())
        refused = asyncio.ensure_future(self._refused_event.wait())
        try:
            await asyncio.wait(
                {connected, refused}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in (connected, refused):
                waiter.cancel()
        if self.connected:
            return
        if self.refused:
            raise ServerUnavailable(f"{self.target}: {self.handshake_error}")
        raise ServerUnavailable(
            f"no connection to {self.target} within {timeout_s}s{self._unavailable_detail()}"
        )

    async def aclose(self) -> None:
        tasks = [t for t in (self._recv_task, self._monitor_task) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._recv_task = self._monitor_task = None
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
        if self._sock is None or self._sock.closed:
            raise ClientStateError(f"the ZMQ transport to {self.target} is not open")
        return self._sock

    # ------------------------------------------------------------------ requests

    async def admit(self, request: Request, timeout_s: float | None = None) -> Outcome:
        return await self.admit_frames(wire.encode_add(request), timeout_s)

    async def admit_frames(self, frames: Sequence[Any], timeout_s: float | None = None) -> Outcome:
        """Send one message as the raw frames ``[type, payload, *aux]`` (anything the
        service should see, malformed included) and return its reply."""
        sock = self._check_open()
        frames = list(frames)
        if not frames:
            raise ValueError("a message needs at least one frame")
        rid = wire.recover_rid(frames[1]) if len(frames) > 1 else ""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
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
                    f"no connection to {self.target} accepted the request within {timeout}s"
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

    async def abort(self, request_ids: tuple[str, ...], reason: str = "") -> bool:
        """Send one ABORT naming the ids (no reply; each cancelled ADD gets its own).
        True once handed to the socket; the wire carries no ``reason``."""
        sock = self._check_open()
        try:
            async with asyncio.timeout(self.timeout_s):
                await sock.send_multipart(wire.encode_abort(request_ids))
        except TimeoutError as exc:
            raise ServerUnavailable(f"no connection to {self.target} took the ABORT") from exc
        except zmq.ZMQError as exc:
            raise TransportError(f"ABORT send failed: {exc}") from exc
        if not self.connected:
            # queued in the socket; it goes out if the server comes up while we are open
            logger.debug("ABORT queued: no connection to %s yet", self.target)
        return True

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
        rid, result = wire.decode_reply(frames)
        queue = self._pending.get(rid)
        while queue:
            fut = queue.popleft()
            if not fut.done():
                if isinstance(result, wire.WireFormatError):
                    err = ProtocolError(f"undecodable reply: {result}")
                    err.__cause__ = result
                    fut.set_exception(err)
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

    @property
    def counters(self) -> dict[str, int]:
        return {"unmatched_replies": self.unmatched_replies}


__all__ = ["ZmqTransport", "curve_keypair_from_file", "curve_server_key_from_file"]
