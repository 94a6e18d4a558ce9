"""Exceptions of the mmadmit client library.

An *abort* is not an exception: it is a normal, in-band outcome
(:class:`~mmadmit_client.Aborted`, on every transport). Exceptions are for what
is not a request outcome::

    ClientError
    ├── ClientStateError        the client is not open (or already closed)
    ├── UnsupportedOperation    the transport cannot do this (ZMQ has no health check)
    ├── TransportError          the connection or call failed (chained from the
    │   │                       grpc / zmq error with ``from``)
    │   └── ServerUnavailable   nothing answers at the address (a failed TLS or
    │                           CURVE handshake included)
    ├── ProtocolError           the server answered something undecodable
    └── RequestTimeout          no outcome within the client-side timeout

A request the chosen transport cannot express (a ``validation_error`` mark
over gRPC, ids outside ``uint32``) is a ``ValueError`` before anything is sent.
"""

from __future__ import annotations


class ClientError(Exception):
    """Base of every client library error."""


class ClientStateError(ClientError):
    """The client is not open, or already closed."""


class UnsupportedOperation(ClientError):
    """The transport cannot do this (a ZMQ health check, an in-memory model info)."""


class TransportError(ClientError):
    """The transport failed (connection, call, socket)."""


class ServerUnavailable(TransportError):
    """Nothing answers at the address."""


class ProtocolError(ClientError):
    """The server's answer does not decode."""


class RequestTimeout(ClientError):
    """No outcome arrived within the client-side timeout."""
