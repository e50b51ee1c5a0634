"""A certificates directory as ``geodiloco certs`` lays it out, used by the CLI and the demo.

``ca.pem``/``ca-key.pem`` (the CA), ``run.secret`` (the run secret, coordinator only),
``<role>-<name>.pem``/``-key.pem`` per identity, and ``site-<name>.secret`` per site.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from geodiloco.security.certs import init_ca, issue
from geodiloco.security.files import write_private
from geodiloco.security.identity import Identity
from geodiloco.security.secrets import (
    RUN_SECRET,
    load_secret,
    new_run_secret,
    site_secret,
    write_site_secret,
)
from geodiloco.security.tls import TlsFiles


@dataclass(frozen=True, slots=True)
class PkiDir:
    path: Path

    @property
    def run_secret(self) -> Path:
        return self.path / RUN_SECRET

    def init(self) -> None:
        """A new CA and a new run secret."""
        init_ca(self.path)
        new_run_secret(self.run_secret)

    def _files(self, identity: Identity, hosts: list[str] | None = None) -> TlsFiles:
        issued = issue(self.path, identity, hosts)
        return TlsFiles(issued.cert, issued.key, issued.ca)

    def issue_coordinator(self, hosts: list[str]) -> TlsFiles:
        return self._files(Identity("coordinator", hosts[0]), hosts)

    def issue_admin(self, name: str) -> TlsFiles:
        return self._files(Identity("admin", name))

    def issue_site(self, name: str) -> tuple[TlsFiles, Path]:
        """The site's certificate and its secret (derived from the run secret here)."""
        return self._files(Identity("site", name)), write_site_secret(self.path, name)

    def rotate_secret(self) -> list[Path]:
        """A new run secret, and every site secret here re-derived from it; returns those."""
        new_secret = self.path / (RUN_SECRET + ".new")
        new_run_secret(new_secret)
        new_secret.replace(self.run_secret)
        secret = load_secret(self.run_secret)
        rewritten = []
        for path in sorted(self.path.glob("site-*.secret")):
            name = path.name[len("site-") : -len(".secret")]
            path.unlink()
            write_private(path, site_secret(secret, name))
            rewritten.append(path)
        return rewritten
