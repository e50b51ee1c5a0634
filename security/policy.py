"""Who may call what on the coordinator, and how it listens.

With mTLS every peer is known by its certificate: a site may act only as itself, admin RPCs
need an admin certificate. Plaintext (no identities at all) is allowed only on loopback.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

import grpc

from geodiloco.security.identity import Identity
from geodiloco.security.request_errors import Denied
from geodiloco.security.sealing import Keyring
from geodiloco.security.tls import TlsFiles

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """mTLS credentials and the run's keyring; both None only for a loopback plaintext server."""

    tls: TlsFiles | None
    keyring: Keyring | None

    @property
    def authenticates(self) -> bool:
        return self.tls is not None

    def port(self, server: grpc.aio.Server, address: str) -> int:
        if self.tls is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, self.tls.server_credentials())


def peer_identity(context: grpc.aio.ServicerContext) -> Identity | None:
    """The identity gRPC verified in the peer's certificate (its SPIFFE URI SAN); None without TLS."""
    uris = context.auth_context().get("peer_spiffe_id")
    return Identity.from_uri(uris[0].decode()) if uris else None


def require_site(security: ServerSecurity, context: grpc.aio.ServicerContext, claimed: str) -> None:
    """A site may only act as the site its certificate names."""
    if not security.authenticates:
        return
    identity = peer_identity(context)
    if identity is None or identity.role != "site":
        raise Denied(f"this call needs a site certificate; the peer presented {identity or 'no identity'}")
    if identity.name != claimed:
        raise Denied(f"the certificate identifies site {identity.name!r}; the request claims {claimed!r}")


def is_admin(security: ServerSecurity, context: grpc.aio.ServicerContext) -> bool:
    """Admins hold an admin certificate; without TLS (loopback only) everyone is one."""
    if not security.authenticates:
        return True
    identity = peer_identity(context)
    return identity is not None and identity.role == "admin"
