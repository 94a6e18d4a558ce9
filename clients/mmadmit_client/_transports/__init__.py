"""Transports of :class:`~mmadmit_client.Client` (httpx-style): ``base.py`` the
interface, ``grpc.py``, ``zmq.py`` and ``memory.py`` its implementations.

The gRPC and ZMQ ones are imported lazily (``mmadmit_client.GrpcTransport``),
so a ZMQ-only user never loads grpc and the other way round.
"""
