"""Callers the server does not trust: TLS, mutual TLS, bearer tokens.

    credentials = server_credentials(config)  # None: plaintext
    context = server_ssl_context(config)      # the same for the REST port (server.rest); None: plaintext
    token = bearer_token(config)  # None: no token asked for; used by server.gate per call

TLS is served when --tls-cert and --tls-key are given; with --tls-client-ca too, every client
must present a certificate that chains to it (mutual TLS). Files are read and checked once, at
startup: a missing, unreadable or mismatched file is a SecurityError (the server exits 3 and
says which file and why) instead of a failure at the first handshake.

With --auth-token-file every call must carry `authorization: Bearer <token>`; the value is
compared in constant time (hmac.compare_digest) and anything else is refused with
UNAUTHENTICATED before the call's handler sees it (server.gate asks BearerToken when the
headers arrive, and answers REFUSAL through server.errors). The standard health service and
server reflection stay open, so load balancers and probes need no secret. Neither the token nor
any metadata value is ever logged.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import ssl
import time
from pathlib import Path
from typing import Any

import grpc
from attnserve.server.config import ServerConfig
from attnserve.server.quoting import logged

from attnserve.files import MAX_PEM_BYTES, MAX_TOKEN_BYTES, FileRefused, read_bounded

logger = logging.getLogger(__name__)

# The peer of the native port's refusals, which it counts without saying who sent them.
NATIVE_PORT = "the native port"

# RPCs that need no token: probes (grpc.health.v1) and service discovery (reflection).
OPEN_METHOD_PREFIXES = (
    "/grpc.health.v1.Health/",
    "/grpc.reflection.v1alpha.ServerReflection/",
    "/grpc.reflection.v1.ServerReflection/",
)
# On the REST port: the probes' paths, the server's liveness and readiness.
OPEN_PATH_PREFIXES = ("/v2/health/",)
_REFUSAL_LOG_EVERY_S = 10.0  # refusals are counted; the log gets one line per interval at most
# The native data plane names the real caller in this header on every call it relays (native/grpc/relay.h)
# and drops a client's own: trusted only on the private socket it relays to, which no client reaches.
PEER_HEADER = "x-attnserve-peer"
# Likewise the method the caller called, where the relayed call's differs (a stream's request relayed
# as a ModelInfer call).
METHOD_HEADER = "x-attnserve-method"
# What a refused caller is told (with UNAUTHENTICATED).
REFUSAL = "missing or invalid bearer token: send metadata 'authorization: Bearer <token>'"


class SecurityError(RuntimeError):
    """A TLS or token setting that cannot be used; the message names the flag and the file."""


def _read(path: Path, flag: str) -> bytes:
    """The file's bytes; a FIFO or a device (/dev/zero) is refused without blocking or reading it
    (attnserve.files.read_bounded), and OpenSSL, which opens the certificate and key again by
    name, only ever meets a regular file."""
    limit = MAX_TOKEN_BYTES if flag == "--auth-token-file" else MAX_PEM_BYTES
    try:
        data = read_bounded(Path(path), limit)
    except FileRefused as err:
        raise SecurityError(f"{flag} {logged(path)}: {err}") from None
    except OSError as err:
        raise SecurityError(f"{flag} {logged(path)}: cannot read it ({err.strerror or err})") from None
    if not data.strip():
        raise SecurityError(f"{flag} {logged(path)}: the file is empty")
    return data


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (mutual when config.tls_client_ca is set) server credentials, or None for plaintext."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    cert = _read(config.tls_cert, "--tls-cert")
    key = _read(config.tls_key, "--tls-key")
    _check_key_pair(config.tls_cert, config.tls_key)
    client_ca = None
    if config.tls_client_ca is not None:
        client_ca = _read(config.tls_client_ca, "--tls-client-ca")
        try:
            ssl.create_default_context().load_verify_locations(cadata=client_ca.decode("ascii"))
        except (ssl.SSLError, ValueError, UnicodeDecodeError) as err:
            raise SecurityError(f"--tls-client-ca {config.tls_client_ca}: not PEM certificates ({err})") from None
    logger.info("TLS on (certificate %s)%s", logged(config.tls_cert),
                f"; mutual TLS: client certificates signed by {logged(config.tls_client_ca)} required"
                if client_ca is not None else "")
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def read_tls_files(config: ServerConfig) -> tuple[bytes, bytes, bytes]:
    """The PEM bytes of --tls-cert, --tls-key and --tls-client-ca (b"" for each not given), for
    the native data plane's port (server.native). Call after server_credentials, which checks them."""
    if config.tls_cert is None or config.tls_key is None:
        return b"", b"", b""
    client_ca = _read(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca is not None else b""
    return _read(config.tls_cert, "--tls-cert"), _read(config.tls_key, "--tls-key"), client_ca


def server_ssl_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The same TLS for the REST port: the same files, mutual TLS when config.tls_client_ca is
    set; None for plaintext. Call after server_credentials, which checks the files first."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # as gRPC's own default
    context.load_cert_chain(certfile=str(config.tls_cert), keyfile=str(config.tls_key), password=_no_password)
    if config.tls_client_ca is not None:
        context.load_verify_locations(cafile=str(config.tls_client_ca))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _check_key_pair(cert: Path, key: Path) -> None:
    """Load the pair with OpenSSL, as the handshake will, so a bad pair fails at startup."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile=str(cert), keyfile=str(key), password=_no_password)
    except _EncryptedKey:
        raise SecurityError(f"--tls-key {key}: the private key is encrypted; give an unencrypted one") from None
    except ssl.SSLError as err:
        # err.reason: e.g. KEY_VALUES_MISMATCH, NO_START_LINE; never the key's bytes.
        raise SecurityError(f"--tls-cert {cert} / --tls-key {key}: not a usable PEM certificate and "
                            f"matching private key ({err.reason or err})") from None
    except OSError as err:
        raise SecurityError(f"--tls-cert {cert} / --tls-key {key}: cannot read ({err.strerror or err})") from None


class _EncryptedKey(Exception):
    pass


def _no_password() -> bytes:
    raise _EncryptedKey  # OpenSSL asks for a password only for an encrypted key


def read_token(path: Path) -> bytes:
    """The token in `path`, surrounding whitespace stripped; one line of printable ASCII."""
    text = _read(path, "--auth-token-file")
    token = text.strip()
    if not all(0x21 <= c <= 0x7E for c in token):
        raise SecurityError(f"--auth-token-file {path}: the token must be one word of printable ASCII "
                            "(no spaces, line breaks or control characters)")
    return token


def bearer_token(config: ServerConfig) -> BearerToken | None:
    """The token check when --auth-token-file is set, else None."""
    if config.auth_token_file is None:
        return None
    check = BearerToken(read_token(config.auth_token_file))
    logger.info("bearer-token authentication on (token from %s); open without it: %s",
                logged(config.auth_token_file), ", ".join(p.strip("/") for p in OPEN_METHOD_PREFIXES))
    if config.tls_cert is None and not _is_loopback(config.host):
        logger.warning("bearer tokens will cross the network in plaintext: serve TLS (--tls-cert, --tls-key)")
    return check


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class BearerToken:
    """Admits a call only with exactly one `authorization: Bearer <token>` header whose token
    equals the configured one (constant-time comparison); OPEN_METHOD_PREFIXES need none.
    A refused call never reaches its handler: server.gate answers it without reading its
    message, and reports it here (note_refusal) to be counted and logged."""

    def __init__(self, token: bytes, open_prefixes: tuple[str, ...] = OPEN_METHOD_PREFIXES) -> None:
        if not token:
            raise SecurityError("the bearer token is empty")
        self._token = token
        self._open = open_prefixes
        self.refused = 0  # calls refused over the server's life
        self._refused_unlogged = 0
        self._last_log = float("-inf")

    def __repr__(self) -> str:  # never show the token
        return f"{type(self).__name__}(refused={self.refused})"

    def admits(self, method: str, metadata: Any) -> bool:
        return method.startswith(self._open) or self.authorized(metadata)

    def authorized(self, metadata: Any) -> bool:
        values = [value for key, value in (metadata or ()) if key == "authorization"]
        if len(values) != 1:
            return False
        value = values[0]
        if isinstance(value, str):
            value = value.encode("utf-8", "replace")
        scheme, _, credential = value.strip().partition(b" ")
        # Compare even when the scheme is wrong, so the time taken tells nothing.
        matches = hmac.compare_digest(credential.strip(), self._token)
        return matches and scheme.lower() == b"bearer"

    def note_refusal(self, method: str, peer: str, count: int = 1) -> None:
        """count: refusals noted at once (the native port's, read now and then: server.native,
        which names NATIVE_PORT as the peer: our words, not the caller's, so not quoted)."""
        self.refused += count
        self._refused_unlogged += count
        now = time.monotonic()
        if now - self._last_log >= _REFUSAL_LOG_EVERY_S:
            logger.warning("refused %d call(s) without a valid bearer token (latest: %s from %s)",
                           self._refused_unlogged, logged(method), peer if peer == NATIVE_PORT else logged(peer))
            self._refused_unlogged = 0
            self._last_log = now


def call_peer(context, relayed: bool) -> str:
    """The caller's address: gRPC's peer(), or behind the native data plane (relayed) the one it names."""
    return relayed_call(context, relayed, "")[0]


def relayed_call(context, relayed: bool, method: str) -> tuple[str, str]:
    """The caller's address and the method it called: gRPC's peer() and `method`, or behind the
    native data plane (relayed) those it names."""
    peer = None
    if relayed:
        for key, value in context.invocation_metadata() or ():
            if key == PEER_HEADER:
                peer = value
            elif key == METHOD_HEADER:
                method = value
    return peer if peer is not None else context.peer(), method
