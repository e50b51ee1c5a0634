"""The proof a site gives at Join that it holds its site secret.

A site with the wrong secret must never become a member: the run would wait a lease for a site
that cannot seal a single chunk, and under a restarting supervisor it would stall every round.
The chunk keys cannot show it at Join (the first sealed chunk comes a round later), so the Join
request carries an HMAC over its own fields under a key derived from the site secret; the
coordinator derives the same key from the run secret and checks it before anything changes.
The MAC covers the run id as sent (empty: "the run served"), the site and its world size.
"""

from __future__ import annotations

import hashlib
import hmac
import struct

from geodiloco.security.secrets import hkdf

PROOF_MAGIC = b"geodiloco-join-v1\0"


def join_message(run_id: str, site: str, world_size: int) -> bytes:
    """The authenticated bytes: fixed, length-prefixed, independent of protobuf."""
    text = b"".join(struct.pack(">H", len(b)) + b for b in (run_id.encode(), site.encode()))
    return PROOF_MAGIC + text + struct.pack(">I", world_size)


def join_proof(site_secret: bytes, run_id: str, site: str, world_size: int) -> bytes:
    """HMAC-SHA256 under ``HKDF(site_secret, "join-proof")`` of :func:`join_message`."""
    key = hkdf(site_secret, b"join-proof")
    return hmac.new(key, join_message(run_id, site, world_size), hashlib.sha256).digest()


def proves(site_secret: bytes, proof: bytes, run_id: str, site: str, world_size: int) -> bool:
    return hmac.compare_digest(proof, join_proof(site_secret, run_id, site, world_size))
