"""TLS for the router's front doors (server side) and for the clients that reach them.

The servers terminate TLS themselves, through their own options: grpcio's
``ssl_server_credentials`` for gRPC and uvicorn's ``ssl_*`` settings for HTTP. ``ServerTls``
checks the files once, at start, so a missing file or a key that does not match its
certificate is a one-line error instead of a traceback from deep inside either server.

With ``ca_certs`` (``--ssl-ca-certs``) both front doors require a client certificate signed
by one of those CAs (mutual TLS).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc


class TlsError(ValueError):
    """A TLS file is missing, unreadable, or not what its option says it is."""


def read_pem(path: str, option: str) -> bytes:
    """The file's bytes, or a TlsError naming the option and the path."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TlsError(f"{option} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN" not in data:
        raise TlsError(f"{option} {path}: not a PEM file (no -----BEGIN line)")
    return data


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key, and optionally the CAs its clients must be signed by."""

    certfile: str
    keyfile: str
    ca_certs: str | None = None

    @classmethod
    def from_options(
        cls, certfile: str | None, keyfile: str | None, ca_certs: str | None = None
    ) -> ServerTls | None:
        """None when no TLS option is set; else a checked ServerTls (TlsError on a bad file)."""
        if certfile is None and keyfile is None:
            if ca_certs is not None:
                raise TlsError("--ssl-ca-certs needs --ssl-certfile and --ssl-keyfile")
            return None
        if certfile is None or keyfile is None:
            raise TlsError("--ssl-certfile and --ssl-keyfile go together: give both")
        tls = cls(certfile, keyfile, ca_certs)
        tls.check()
        return tls

    def check(self) -> None:
        """Load every file as the servers will, so a bad one fails here with a clear message."""
        read_pem(self.certfile, "--ssl-certfile")
        read_pem(self.keyfile, "--ssl-keyfile")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except ssl.SSLError as exc:
            raise TlsError(
                f"--ssl-certfile {self.certfile} / --ssl-keyfile {self.keyfile}: cannot use them "
                f"together ({exc.reason or exc}): is the key the certificate's?"
            ) from None
        if self.ca_certs is not None:
            read_pem(self.ca_certs, "--ssl-ca-certs")
            try:
                context.load_verify_locations(self.ca_certs)
            except ssl.SSLError as exc:
                raise TlsError(
                    f"--ssl-ca-certs {self.ca_certs}: no usable certificate ({exc.reason})"
                ) from None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(read_pem(self.keyfile, "--ssl-keyfile"), read_pem(self.certfile, "--ssl-certfile"))],
            root_certificates=read_pem(self.ca_certs, "--ssl-ca-certs") if self.ca_certs else None,
            require_client_auth=self.ca_certs is not None,
        )

    def uvicorn_options(self) -> dict[str, Any]:
        """The ``uvicorn.Config`` keyword arguments that serve HTTPS."""
        options: dict[str, Any] = {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile}
        if self.ca_certs is not None:
            options |= {"ssl_ca_certs": self.ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        return options

    def argv(self) -> list[str]:
        """These settings as command-line options (a cluster passes them to its router)."""
        argv = ["--ssl-certfile", self.certfile, "--ssl-keyfile", self.keyfile]
        return argv + (["--ssl-ca-certs", self.ca_certs] if self.ca_certs else [])


@dataclass(frozen=True)
class ClientTls:
    """How a client reaches a TLS server: the roots it trusts (None: the system's), its own
    certificate for mutual TLS, and the name to expect in the server's certificate when it is
    not the host dialled (a container reaching itself on 127.0.0.1, say)."""

    ca_certs: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.certfile is None) != (self.keyfile is None):
            raise TlsError("a client certificate needs both --ssl-certfile and --ssl-keyfile")

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca_certs, "--ssl-ca-certs") if self.ca_certs else None,
            private_key=read_pem(self.keyfile, "--ssl-keyfile") if self.keyfile else None,
            certificate_chain=read_pem(self.certfile, "--ssl-certfile") if self.certfile else None,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def grpc_channel(
    address: str, tls: ClientTls | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A blocking channel to ``address``: plaintext when ``tls`` is None, else TLS."""
    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=[*options, *tls.channel_options()])
