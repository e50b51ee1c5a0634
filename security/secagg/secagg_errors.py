"""Refusals of the secure-aggregation messages; ``status`` names the gRPC code each becomes at the
edge (a ``grpc.StatusCode`` member name, so nothing here imports grpc), ``field`` the bad field."""

from __future__ import annotations


class SecAggError(Exception):
    """A message refused; nothing in the receiver's state changed."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class InvalidField(SecAggError):
    """Malformed or inconsistent: wrong size, ring width, range, an unknown site, a bad tag."""


class WrongSession(SecAggError):
    """Meant for another run, round or fragment: a stale or replayed message."""

    status = "FAILED_PRECONDITION"


class WrongPhase(SecAggError):
    """Valid input at the wrong time, or from a site the phase does not admit (e.g. a site that
    sent shares but no push asking to take part in unmasking)."""

    status = "FAILED_PRECONDITION"


class Duplicate(SecAggError):
    """A second message where one is allowed (a replayed share, a second push of a range)."""

    status = "ALREADY_EXISTS"


class RecoveryFailed(SecAggError):
    """Fewer shares than the threshold survived: the round cannot be unmasked; re-run it."""

    status = "ABORTED"
