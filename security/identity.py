"""Who a peer is: a role and a name, carried in a certificate's URI SAN.

The URI is ``spiffe://geodiloco/<role>/<name>`` (SPIFFE-style, so it stays meaningful to
tools that already understand workload identities). The role makes a site certificate useless
for admin calls and an admin certificate useless for pushing gradients.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

TRUST_DOMAIN = "geodiloco"
ROLES = ("site", "admin", "coordinator")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_URI = re.compile(rf"^spiffe://{TRUST_DOMAIN}/({'|'.join(ROLES)})/([^/]+)$")


@dataclass(frozen=True, slots=True)
class Identity:
    role: str
    name: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: unknown value {self.role!r}; accepted: {', '.join(ROLES)}")
        if not _NAME.match(self.name):
            raise ValueError(f"name: {self.name!r} must be 1-63 letters, digits, '.', '-' or '_'")

    @property
    def uri(self) -> str:
        return f"spiffe://{TRUST_DOMAIN}/{self.role}/{self.name}"

    @classmethod
    def from_uri(cls, uri: str) -> Identity | None:
        """The identity a URI SAN names, or None for URIs of other trust domains or shapes."""
        match = _URI.match(uri)
        if match is None or not _NAME.match(match.group(2)):
            return None
        return cls(match.group(1), match.group(2))

    def __str__(self) -> str:
        return f"{self.role} {self.name}"
