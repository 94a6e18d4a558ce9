"""Exceptions of the mmadmit client library.

An *abort* is not an exception: it is a normal, in-band outcome
(``mmadmit_client.grpc.Aborted``,
or a ZMQ outcome whose ``aborted`` is true). Exceptions are for what is not a
request outcome::

    ClientError
    ├── ClientStateError        the client is not open (or already closed)
    ├── TransportError          the connection or call failed (chained from the
    │   │                       grpc / zmq error with ``from``)
    │   └── ServerUnavailable   nothing answers at the address
    ├── ProtocolError           the server answered something undecodable
    └── RequestTimeout          no outcome within the client-side timeout
"""

from __future__ import annotations


class ClientError(Exception):
    """Base of every client library error."""


class ClientStateError(ClientError):
    """The client is not open, or already closed."""


class TransportError(ClientError):
    """The transport failed (connection, call, socket)."""


class ServerUnavailable(TransportError):
    """Nothing answers at the address."""


class ProtocolError(ClientError):
    """The server's answer does not decode."""


class RequestTimeout(ClientError):
    """No outcome arrived within the client-side timeout."""
