"""ZMQ transport: mmadmit's reply mode (docs/spec/WIRE.md) over one DEALER socket.

The DEALER connects to the service's ROUTER; each ADD gets exactly one reply,
possibly out of order. A background task reads replies and routes each to the
future of its request id (several requests in flight with the same id are
answered in arrival order: the service itself refuses a duplicate id that is
still in flight, and that refusal is usually the first reply). Requests are
encoded by :mod:`mmadmit_client.wire`; :meth:`ZmqTransport.admit_frames` sends
raw frames, malformed ones included (the service answers them with an abort).

Errors, each chained ``from`` the zmq error behind it: no connection within
the connect timeout (or the request's timeout) is
:class:`~mmadmit_client.ServerUnavailable`, and so is a request the
connection was lost under; a connection that took the request but gave no
reply in time :class:`~mmadmit_client.RequestTimeout`; a socket failure
:class:`~mmadmit_client.TransportError`; an undecodable reply
:class:`~mmadmit_client.ProtocolError`.

Nothing is delivered after the caller gave up. A request that has ended for
its caller (a timeout, ``ServerUnavailable``, a cancelled await, a closed
client) is never sent later, to this server or to one started afterwards on
the same address:

* no queueing for an absent peer: a message is handed to the socket only
  while a handshaken connection exists (the socket monitor says so); until
  then the request waits in this transport, where ending it discards it.
  (Not ``ZMQ_IMMEDIATE``: with it libzmq drops replies received but not yet
  read when the server disconnects, which is what a draining server does.)
* a request that ends while the socket may still hold its message (handed
  over, no reply, and no reply yet to any message sent after it, which would
  prove it left) *resets the connection*: the DEALER is closed with linger 0,
  which discards everything still queued in it, and a fresh one connects.
  Replies already received are dispatched first. Every other request whose
  message the old socket had taken and that has no reply yet ends
  ``ServerUnavailable`` (its message may or may not have reached the server,
  and no reply can reach this client now); requests still waiting for a
  connection never left and go out on the new socket. With no ``identity``
  the new socket has a new routing identity.
* a vanished server: the connection's loss (a closed connection at once, a
  frozen server or a dead link through ZMTP heartbeats, ``heartbeat_s``) ends
  every request it carried ``ServerUnavailable`` at once, through the same
  reset, instead of at their timeouts.

What was already written to the network before a request ended is beyond
recall: a server that was frozen may still read it when it thaws (the
service's ``ABORT``, :meth:`ZmqTransport.abort`, cancels what it still holds).

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
import functools
import logging
import os
from collections.abc import Sequence
from typing import Any, ClassVar, cast

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


class _Call:
    """One request on its way: its reply future, and whether the socket took it.

    ``seq`` is the order in which sockets took messages (None: not handed over
    yet, so nothing of it left this process); ``gen`` the socket generation that
    took it; ``settled`` that the transport ended it (a reply, a reset, a close),
    not its caller.
    """

    __slots__ = ("fut", "gen", "rid", "seq", "settled")

    def __init__(self, rid: str, fut: asyncio.Future[Outcome]) -> None:
        self.rid = rid
        self.fut = fut
        self.seq: int | None = None
        self.gen = -1
        self.settled = False


class ZmqTransport(AsyncTransport):
    """One DEALER socket to ``address`` (``tcp://HOST:PORT``, ``ipc://PATH``).

    ``timeout_s`` bounds each request by default (connecting included: with
    nothing listening the call ends in :class:`ServerUnavailable`).
    ``connect_timeout_s`` bounds the part of it spent waiting for a connection
    (None: only ``timeout_s``); a request that finds no connection within it
    ends :class:`ServerUnavailable` without anything sent. ``heartbeat_s``: the
    ZMTP heartbeat interval (a PING that long apart; a connection silent for
    ``heartbeat_s`` after one is dropped, so a frozen server or a dead link
    ends its requests ``ServerUnavailable`` within about twice that); None turns
    heartbeats off (a server that exits still ends them at once).
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
        connect_timeout_s: float | None = None,
        heartbeat_s: float | None = 1.0,
        identity: bytes | None = None,
        context: zmq.asyncio.Context | None = None,
        curve_server_key: bytes | None = None,
        curve_keypair: tuple[bytes, bytes] | None = None,
    ) -> None:
        if curve_keypair is not None and curve_server_key is None:
            raise ValueError("curve_keypair needs curve_server_key (the server's public key)")
        if heartbeat_s is not None and not 0.1 <= heartbeat_s <= 600:
            raise ValueError(f"heartbeat_s must be None or within 0.1..600 s, not {heartbeat_s}")
        self.target = address
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.heartbeat_s = heartbeat_s
        self.identity = identity
        self.curve_server_key = curve_server_key
        self._curve_keypair = curve_keypair
        # Why the last handshake failed, and whether the server refused our key.
        self.handshake_error: str | None = None
        self.refused = False
        self._refused_event = asyncio.Event()
        self._ctx = context
        self._own_ctx = context is None
        self._closed = False
        self._sock: zmq.asyncio.Socket | None = None
        self._recv_task: asyncio.Task[None] | None = None
        self._recv_fut: asyncio.Future[Any] | None = None  # the receive task's pending recv
        self._monitor: zmq.asyncio.Socket | None = None
        self._monitor_task: asyncio.Task[None] | None = None
        self._gen = 0  # socket generation: one more per reset
        self._seq = 0  # messages handed to a socket so far
        self._answered_seq = 0  # the latest-handed message a reply came back for
        self.connected = False  # a handshaken connection to the server exists right now
        self._connected_event = asyncio.Event()  # set while ``connected``
        self._pending: dict[str, collections.deque[_Call]] = {}
        self.unmatched_replies = 0  # replies no pending request was waiting for
        self.connection_resets = 0  # sockets rebuilt (a request ended unsent, a lost server)

    @property
    def address(self) -> str:
        return self.target

    async def open(self) -> None:
        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        try:
            self._build_socket()
        except zmq.ZMQError as exc:
            self._closed = True
            self._close_socket()
            raise TransportError(f"cannot connect to {self.target}: {exc}") from exc

    def _build_socket(self) -> None:
        """A fresh DEALER (and its monitor and tasks), connecting to the target."""
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        self._sock = sock
        sock.setsockopt(zmq.LINGER, 0)
        # Not ZMQ_IMMEDIATE (see the module docstring): requests are held back in
        # this transport until the monitor reports a connection instead.
        self._monitor = sock.get_monitor_socket(
            _MONITOR_EVENTS, addr=f"inproc://mmadmit-monitor-{id(self):x}-{self._gen}"
        )
        if self.identity is not None:
            sock.setsockopt(zmq.IDENTITY, self.identity)
        if self.heartbeat_s is not None:
            ms = max(100, round(self.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_IVL, ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
            sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ms)  # the server drops us when we go silent
        if self.curve_server_key is not None:
            public, secret = self._curve_keypair or zmq.curve_keypair()
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.curve_server_key)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        sock.connect(self.target)
        gen = self._gen
        self._recv_task = asyncio.create_task(self._receive(sock, gen), name="mmadmit-client-recv")
        self._monitor_task = asyncio.create_task(
            self._watch(self._monitor, gen), name="mmadmit-client-monitor"
        )

    async def _watch(self, monitor: zmq.asyncio.Socket, gen: int) -> None:
        """Follow connection events (sets ``connected``, ``handshake_error``, ``refused``);
        a lost connection that carried requests resets the socket (:meth:`_reset`)."""
        while True:
            try:
                event = parse_monitor_message(await monitor.recv_multipart())
            except (asyncio.CancelledError, zmq.ZMQError):
                return  # closed: a reset or aclose
            if gen != self._gen:
                return
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connected = True
                self.handshake_error = None
                self._connected_event.set()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected = False
                self._connected_event.clear()
                if self._outstanding():
                    self._reset(
                        f"the connection to {self.target} was lost (the server went away, "
                        "or its heartbeat stopped) with this request unanswered"
                    )
                    return
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
        await self._wait_connected(timeout_s)
        if self.connected:
            return
        if self.refused:
            raise ServerUnavailable(f"{self.target}: {self.handshake_error}")
        raise ServerUnavailable(
            f"no connection to {self.target} within {timeout_s}s{self._unavailable_detail()}"
        )

    async def _wait_connected(
        self, timeout_s: float, ended: asyncio.Future[Outcome] | None = None
    ) -> None:
        """Wait until connected, refused, ``ended`` is done, or ``timeout_s`` passed."""
        waiters = [
            asyncio.ensure_future(self._connected_event.wait()),
            asyncio.ensure_future(self._refused_event.wait()),
        ]
        watched: set[asyncio.Future[Any]] = set(waiters)
        if ended is not None:
            watched.add(ended)
        try:
            await asyncio.wait(
                watched,
                timeout=max(timeout_s, 0.0),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def aclose(self) -> None:
        """Close: requests still waiting fail with ClientStateError, and the socket is
        closed with linger 0, so nothing it still held is sent later."""
        self._closed = True
        for queue in self._pending.values():
            for call in queue:
                if not call.fut.done():
                    call.settled = True
                    call.fut.set_exception(ClientStateError("the client was closed"))
        self._pending.clear()
        tasks = [t for t in (self._recv_task, self._monitor_task) if t is not None]
        self._recv_task = self._monitor_task = None
        self._close_socket()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _close_socket(self) -> None:
        self._close_current()
        if self._own_ctx and self._ctx is not None and not self._ctx.closed:
            self._ctx.term()  # every socket is closed with linger 0: returns at once

    def _close_current(self) -> None:
        """Close this generation's socket and monitor, discarding whatever they hold."""
        if self._monitor is not None and not self._monitor.closed:
            self._monitor.close(linger=0)
        if self._sock is not None and not self._sock.closed:
            self._sock.close(linger=0)
        self.connected = False
        self._connected_event.clear()

    def _check_open(self) -> zmq.asyncio.Socket:
        if self._closed or self._sock is None or self._sock.closed:
            raise ClientStateError(f"the ZMQ transport to {self.target} is not open")
        return self._sock

    # ------------------------------------------------------------------ requests

    async def admit(self, request: Request, timeout_s: float | None = None) -> Outcome:
        return await self.admit_frames(wire.encode_add(request), timeout_s)

    async def admit_frames(self, frames: Sequence[Any], timeout_s: float | None = None) -> Outcome:
        """Send one message as the raw frames ``[type, payload, *aux]`` (anything the
        service should see, malformed included) and return its reply."""
        self._check_open()
        frames = list(frames)
        if not frames:
            raise ValueError("a message needs at least one frame")
        rid = wire.recover_rid(frames[1]) if len(frames) > 1 else ""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        call = _Call(rid, loop.create_future())
        queue = self._pending.setdefault(rid, collections.deque())
        queue.append(call)
        try:
            async with asyncio.timeout(timeout):
                await self._hand_over(call, frames, loop.time())
                return await call.fut
        except TimeoutError as exc:
            if call.seq is None:  # never handed over: nothing of it left this process
                raise ServerUnavailable(
                    f"no connection to {self.target} took the request within {timeout}s"
                    f"{self._unavailable_detail()}"
                ) from exc
            raise RequestTimeout(f"rid={rid}: no reply within {timeout}s") from exc
        finally:
            if not call.fut.done():
                call.fut.cancel()
            if call in queue:
                queue.remove(call)
            if not queue and self._pending.get(rid) is queue:
                del self._pending[rid]
            self._settle(call)

    async def _hand_over(self, call: _Call, frames: list[Any], started: float) -> None:
        """Give the message to the socket once a connection exists; returns at once if
        ``call`` ended meanwhile (the caller's ``await call.fut`` raises why)."""
        loop = asyncio.get_running_loop()
        limit = self.connect_timeout_s
        while not call.fut.done():
            self._check_open()
            if self.refused:
                raise ServerUnavailable(f"{self.target}: {self.handshake_error}")
            if not self.connected:
                if limit is not None and loop.time() - started >= limit:
                    raise ServerUnavailable(
                        f"no connection to {self.target} within {limit}s"
                        f"{self._unavailable_detail()}"
                    )
                left = None if limit is None else started + limit - loop.time()
                await self._wait_connected(3600.0 if left is None else left, call.fut)
                continue
            sock, gen = self._check_open(), self._gen
            sent = cast(asyncio.Future[Any], sock.send_multipart(frames, copy=False))
            if sent.done():
                self._record(call, gen, sent)
            else:  # at the high-water mark: recorded the moment pyzmq hands it over
                sent.add_done_callback(functools.partial(self._record, call, gen))
                try:
                    await asyncio.wait({sent, call.fut}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    if not sent.done():
                        sent.cancel()
            if sent.cancelled():
                continue  # the socket was reset before it took the message: try the new one
            exc = sent.exception()
            if exc is not None:
                raise TransportError(f"rid={call.rid}: send failed: {exc}") from exc
            if call.gen != self._gen and not call.fut.done():
                # handed to a socket that a reset closed before this was recorded
                raise ServerUnavailable(
                    f"rid={call.rid}: the connection to {self.target} was reset as the "
                    "request went out (it may or may not have reached the server)"
                )
            return

    def _record(self, call: _Call, gen: int, sent: asyncio.Future[Any]) -> None:
        if call.seq is None and not sent.cancelled() and sent.exception() is None:
            self._seq += 1
            call.seq, call.gen = self._seq, gen

    def _outstanding(self) -> bool:
        """Whether the current socket took a message that has no outcome yet."""
        return any(
            c.seq is not None and c.gen == self._gen and not c.fut.done()
            for queue in self._pending.values()
            for c in queue
        )

    def _settle(self, call: _Call) -> None:
        """``call`` has ended; if its caller gave up while the socket may still hold
        its message, reset the connection so that it is never sent."""
        if call.settled or call.seq is None or call.gen != self._gen or self._closed:
            return
        if self._answered_seq > call.seq:
            return  # a message handed after it was answered: this one left the socket
        self._reset(
            f"the connection to {self.target} was reset: request {call.rid!r} ended while "
            "its message may still have been queued, and closing the socket discards it"
        )

    def _reset(self, why: str) -> None:
        """Replace the socket: dispatch the replies already received, close it with
        linger 0 (nothing it holds goes out later), end every request it had taken
        ``ServerUnavailable``, and connect a fresh one. Requests still waiting for a
        connection go out on the new socket."""
        sock, gen = self._sock, self._gen
        assert sock is not None
        taken, self._recv_fut = self._recv_fut, None
        if taken is not None and taken.done() and not taken.cancelled():
            if taken.exception() is None:
                self._dispatch(taken.result())
        while True:
            try:
                now = cast(asyncio.Future[Any], sock.recv_multipart(zmq.DONTWAIT, copy=False))
                frames = now.result()  # DONTWAIT: pyzmq answers at once
            except zmq.ZMQError:
                break
            self._dispatch(frames)
        self._gen += 1
        self.connection_resets += 1
        self._close_current()
        logger.debug("%s", why)
        for queue in self._pending.values():
            for call in queue:
                if call.seq is not None and call.gen == gen and not call.fut.done():
                    call.settled = True
                    call.fut.set_exception(
                        ServerUnavailable(
                            f"rid={call.rid}: {why}; the request may or may not have "
                            "reached the server, and its reply can no longer arrive"
                        )
                    )
        try:
            self._build_socket()
        except zmq.ZMQError as exc:
            self._closed = True
            self._fail_all(TransportError(f"cannot reconnect to {self.target}: {exc}"), exc)

    async def abort(self, request_ids: tuple[str, ...], reason: str = "") -> bool:
        """Send one ABORT naming the ids (no reply; each cancelled ADD gets its own).
        True once handed to the socket; the wire carries no ``reason``. Like a request,
        it waits for a connection (at most ``connect_timeout_s``, then
        :class:`ServerUnavailable`) rather than queueing for a server that is absent."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        limit = self.timeout_s
        if self.connect_timeout_s is not None:
            limit = min(limit, self.connect_timeout_s)
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    sock = self._check_open()
                    if self.connected:
                        await sock.send_multipart(wire.encode_abort(request_ids))
                        return True
                    if self.refused or loop.time() - started >= limit:
                        break
                    await self._wait_connected(started + limit - loop.time())
        except TimeoutError:
            pass
        except zmq.ZMQError as exc:
            raise TransportError(f"ABORT send failed: {exc}") from exc
        raise ServerUnavailable(
            f"no connection to {self.target} took the ABORT{self._unavailable_detail()}"
        )

    # ------------------------------------------------------------------ replies

    async def _receive(self, sock: zmq.asyncio.Socket, gen: int) -> None:
        while True:
            fut = cast(asyncio.Future[Any], sock.recv_multipart(copy=False))
            self._recv_fut = fut
            try:
                frames = await fut
            except asyncio.CancelledError:
                return  # closed: a reset (which took over what was received) or aclose
            except zmq.ZMQError as exc:
                if gen == self._gen and not self._closed:
                    self._fail_all(TransportError(f"receive failed: {exc}"), exc)
                return
            if self._recv_fut is not fut:
                return  # a reset dispatched it and closed this socket
            self._recv_fut = None
            self._dispatch(frames)

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        rid, result = wire.decode_reply(frames)
        queue = self._pending.get(rid)
        if queue:
            # Which of several same-id requests this answers is a guess (arrival
            # order): only the earliest-handed one counts as proven to have left.
            handed = [c.seq for c in queue if c.seq is not None and c.gen == self._gen]
            if handed:
                self._answered_seq = max(self._answered_seq, min(handed))
        while queue:
            call = queue.popleft()
            if not call.fut.done():
                call.settled = True
                if isinstance(result, wire.WireFormatError):
                    err = ProtocolError(f"undecodable reply: {result}")
                    err.__cause__ = result
                    call.fut.set_exception(err)
                else:
                    call.fut.set_result(result)
                return
        self.unmatched_replies += 1
        logger.debug("rid=%s: reply with no request waiting for it (dropped)", rid)

    def _fail_all(self, err: TransportError, cause: BaseException) -> None:
        err.__cause__ = cause
        for queue in self._pending.values():
            for call in queue:
                if not call.fut.done():
                    call.settled = True
                    call.fut.set_exception(err)

    @property
    def counters(self) -> dict[str, int]:
        return {
            "unmatched_replies": self.unmatched_replies,
            "connection_resets": self.connection_resets,
        }


__all__ = ["ZmqTransport", "curve_keypair_from_file", "curve_server_key_from_file"]
