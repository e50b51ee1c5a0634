"""gRPC credentials for mutual TLS, and the peer identity a servicer sees.

The coordinator requires a client certificate signed by the run's CA on every connection
(``require_client_auth=True``): a peer without one never reaches a servicer. Authorisation
then uses the identity in the verified certificate (:mod:`.policy`), never a name the request
claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A certificate, its private key and the CA that peers' certificates must chain to."""

    cert: Path
    key: Path
    ca: Path

    def __post_init__(self) -> None:
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if not Path(path).is_file():
                raise ValueError(f"tls.{name}: no such file: {path}")

    def _read(self) -> tuple[bytes, bytes, bytes]:
        return self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes()

    def server_credentials(self) -> grpc.ServerCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_server_credentials(((key, cert),), root_certificates=ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self._read()
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def open_channel(
    target: str, tls: TlsFiles | None, options: list[tuple[str, object]] | None = None
) -> grpc.Channel:
    """A blocking channel: mTLS with ``tls``, plaintext only when it is None (loopback runs)."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.channel_credentials(), options=options)
