"""Transport security from files: gRPC over TLS (optionally mutual) and ZMQ CURVE.

Scope: read and check the operator's files once at start-up, and hand the
transports what they need (docs/spec/CLI.md, ``--grpc-tls-*`` and ``--zmq-curve-*``):

* **gRPC TLS**: a PEM certificate chain and its private key, optionally a PEM
  CA bundle for mutual TLS. :meth:`GrpcTls.server_credentials` gives the
  ``grpc.ssl_server_credentials`` that :class:`~mmadmit.grpc_server.GrpcServer`
  binds with ``add_secure_port``.
* **ZMQ CURVE** on the ``--zmq-listen`` ROUTER: the server's key file in pyzmq's
  ``zmq.auth`` certificate format (``zmq.auth.create_certificates`` writes
  ``NAME.key`` and ``NAME.key_secret``; the server needs the secret one), and
  optionally a folder of allowed client public keys (``*.key``), which a ZAP
  authenticator (:class:`CurveAuthenticator`) enforces (a client without CURVE
  never gets through).

Every problem is a :class:`~mmadmit.errors.ConfigError` naming the flag and the
file, raised when :func:`mmadmit.config.build_config` loads them once to check
(so ``mmadmit serve`` exits 2 with one line before anything binds) and again,
should a file change in between, when the server loads the files. Which flag
combinations are allowed is the configuration's business (``config.py``); this
module only reads and checks the files, from any object with the five settings
(:class:`SecuritySettings`), and imports nothing of the configuration.

Non-goals: certificate reloading (restart to rotate; a Kubernetes rollout does
this), encrypted private keys (gRPC takes none), and engine mode's sockets
(plain: docs/spec/WIRE.md, "Engine mode: between SMG and a scheduler"). Nothing
here is reached from a request: only operator flags name files.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .errors import ConfigError

if TYPE_CHECKING:
    import grpc


class SecuritySettings(Protocol):
    """The settings this module reads (the frozen ``ServeConfig`` has them)."""

    @property
    def grpc_tls_cert(self) -> str | None: ...
    @property
    def grpc_tls_key(self) -> str | None: ...
    @property
    def grpc_tls_client_ca(self) -> str | None: ...
    @property
    def zmq_curve_secret_key(self) -> str | None: ...
    @property
    def zmq_curve_clients(self) -> str | None: ...


_CERT_MARK = b"-----BEGIN CERTIFICATE-----"


def read_file(path: str, flag: str) -> bytes:
    """The bytes of ``path``; :class:`ConfigError` naming ``flag`` when it cannot be read."""
    if not os.path.isfile(path):
        why = "is not a file" if os.path.exists(path) else "no such file"
        raise ConfigError(f"{flag} {path}: {why}")
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ConfigError(f"{flag} {path}: cannot read it: {exc.strerror or exc}") from exc


def _check_dir(path: str, flag: str) -> None:
    if not os.path.isdir(path):
        why = "is not a folder" if os.path.exists(path) else "no such folder"
        raise ConfigError(f"{flag} {path}: {why}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: cannot read the folder (permission denied)")


# --------------------------------------------------------------------------- gRPC TLS


@dataclass(frozen=True, repr=False)
class GrpcTls:
    """The PEM material of ``--grpc-tls-cert``, ``--grpc-tls-key``, ``--grpc-tls-client-ca``."""

    cert_chain: bytes
    private_key: bytes
    client_ca: bytes | None = None  # set: client certificates are required and verified

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def __repr__(self) -> str:  # never print key material
        return f"GrpcTls(mutual={self.mutual})"


def load_grpc_tls(cert: str, key: str, client_ca: str | None = None) -> GrpcTls:
    """Read and check the files: PEM content, the key matching the certificate, the CA."""
    import ssl

    cert_pem = read_file(cert, "--grpc-tls-cert")
    key_pem = read_file(key, "--grpc-tls-key")
    if _CERT_MARK not in cert_pem:
        raise ConfigError(f"--grpc-tls-cert {cert}: no PEM certificate in it")
    if b"-----BEGIN ENCRYPTED PRIVATE KEY-----" in key_pem:
        raise ConfigError(f"--grpc-tls-key {key}: the key is encrypted; gRPC needs it unencrypted")
    if b"PRIVATE KEY-----" not in key_pem:
        raise ConfigError(f"--grpc-tls-key {key}: no PEM private key in it")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An empty password: an encrypted key fails here instead of prompting on a terminal.
        context.load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"--grpc-tls-cert {cert} / --grpc-tls-key {key}: unusable pair: {exc}"
        ) from exc
    ca_pem = None
    if client_ca is not None:
        ca_pem = read_file(client_ca, "--grpc-tls-client-ca")
        if _CERT_MARK not in ca_pem:
            raise ConfigError(f"--grpc-tls-client-ca {client_ca}: no PEM certificate in it")
        try:
            context.load_verify_locations(cafile=client_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"--grpc-tls-client-ca {client_ca}: unusable: {exc}") from exc
    return GrpcTls(cert_pem, key_pem, ca_pem)


# --------------------------------------------------------------------------- ZMQ CURVE


@dataclass(frozen=True, repr=False)
class CurveServer:
    """The server's CURVE keypair (Z85) and the folder of allowed client keys, if any."""

    public_key: bytes
    secret_key: bytes
    clients_dir: str | None = None  # None: any CURVE client with the server key connects
    allowed: int = 0  # public keys found in clients_dir

    def apply(self, sock: Any) -> None:
        """Make ``sock`` a CURVE server; call before it binds."""
        import zmq

        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)

    def __repr__(self) -> str:
        return f"CurveServer(public_key={self.public_key.decode()!r}, clients={self.clients_dir!r})"


def _require_curve() -> None:
    import zmq

    if not zmq.has("curve"):
        raise ConfigError(
            f"--zmq-curve-secret-key: this libzmq ({zmq.zmq_version()}) was built without CURVE"
        )


def load_curve_keypair(path: str, flag: str) -> tuple[bytes, bytes]:
    """(public, secret) from a ``zmq.auth`` secret key file; :class:`ConfigError` otherwise."""
    import zmq.auth

    read_file(path, flag)  # a clear error for a missing or unreadable file
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: not a zmq.auth key file: {exc}") from exc
    if not secret:
        raise ConfigError(
            f"{flag} {path}: holds no secret key (give the NAME.key_secret file, not the "
            "public NAME.key)"
        )
    return public, secret


def load_curve_server(secret_key: str, clients_dir: str | None = None) -> CurveServer:
    """Read the server key file and count the allowed client keys in ``clients_dir``."""
    _require_curve()
    public, secret = load_curve_keypair(secret_key, "--zmq-curve-secret-key")
    allowed = 0
    if clients_dir is not None:
        import zmq.auth

        _check_dir(clients_dir, "--zmq-curve-clients")
        try:
            allowed = len(zmq.auth.load_certificates(clients_dir))
        except (ValueError, OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"--zmq-curve-clients {clients_dir}: a key file there is unusable: {exc}"
            ) from exc
        if allowed == 0:
            raise ConfigError(
                f"--zmq-curve-clients {clients_dir}: no client public key (*.key) in it, so no "
                "client could connect"
            )
    return CurveServer(public, secret, clients_dir, allowed)


class CurveAuthenticator:
    """The ZAP handler that admits only the CURVE keys of ``--zmq-curve-clients``.

    pyzmq's ``ThreadAuthenticator`` on a synchronous shadow of the ingest's
    context (ZAP is per context: its REP socket binds ``inproc://zeromq.zap.01``
    there, and an asyncio socket cannot serve a thread). The keys are read once,
    at :meth:`start`. :meth:`stop` must run before the context is terminated,
    else ``term()`` waits forever for the authenticator's sockets.
    """

    def __init__(self, context: Any, clients_dir: str) -> None:
        self._context = context
        self.clients_dir = clients_dir
        self._auth: Any = None

    def start(self) -> None:
        import zmq
        from zmq.auth.thread import ThreadAuthenticator

        shadow: zmq.Context[Any] = zmq.Context.shadow(self._context.underlying)
        auth = ThreadAuthenticator(shadow, log=logging.getLogger("mmadmit.zap"))
        auth.start()
        self._auth = auth
        auth.configure_curve(domain="*", location=self.clients_dir)

    def stop(self) -> None:
        """Stop the ZAP thread and close its sockets (idempotent)."""
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()


# --------------------------------------------------------------------------- from the config


def grpc_tls_from_config(config: SecuritySettings) -> GrpcTls | None:
    if config.grpc_tls_cert is None or config.grpc_tls_key is None:
        return None
    return load_grpc_tls(config.grpc_tls_cert, config.grpc_tls_key, config.grpc_tls_client_ca)


def curve_from_config(config: SecuritySettings) -> CurveServer | None:
    if config.zmq_curve_secret_key is None:
        return None
    return load_curve_server(config.zmq_curve_secret_key, config.zmq_curve_clients)


__all__ = [
    "SecuritySettings",
    "CurveAuthenticator",
    "CurveServer",
    "GrpcTls",
    "curve_from_config",
    "grpc_tls_from_config",
    "load_curve_keypair",
    "load_curve_server",
    "load_grpc_tls",
    "read_file",
]
