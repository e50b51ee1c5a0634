"""The run secret and the per-site secrets derived from it.

Key model: the coordinator holds the *run secret* (32 random bytes in a 0600 file). Each site
holds only its own *site secret*, HKDF(run secret, site name), written next to its certificate
by ``geodiloco certs issue --site``. Chunk keys are derived from the site secret per run id and
direction (see :mod:`.sealing`), so one site's secret opens nothing of another site's, and a new
run id gives new keys even under the same secret. Rotating means a new run secret
(``geodiloco certs secret DIR --rotate``) and reissuing the site secrets.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from geodiloco.security.files import write_private

log = logging.getLogger("geodiloco.security")

SECRET_BYTES = 32
RUN_SECRET = "run.secret"
SALT = b"geodiloco/v1"


def hkdf(secret: bytes, info: bytes, length: int = SECRET_BYTES) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=length, salt=SALT, info=info).derive(secret)


def site_secret(run_secret: bytes, site: str) -> bytes:
    """The secret a site holds: derived, so the coordinator needs to store only the run secret."""
    return hkdf(run_secret, b"site-secret\0" + site.encode())


def new_run_secret(path: Path) -> None:
    write_private(path, os.urandom(SECRET_BYTES))


def load_secret(path: Path) -> bytes:
    """Read a 32-byte secret file; warns when others may read it (the value is never logged)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"secret file {path}: {exc.strerror}") from None
    if len(data) != SECRET_BYTES:
        raise ValueError(f"secret file {path}: expected {SECRET_BYTES} bytes, found {len(data)}")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret file %s is readable by group or others; chmod 600 it", path)
    return data


def write_site_secret(directory: Path, site: str) -> Path:
    """Derive ``site-<name>.secret`` from the run secret in ``directory``."""
    path = directory / f"site-{site}.secret"
    write_private(path, site_secret(load_secret(directory / RUN_SECRET), site))
    return path
