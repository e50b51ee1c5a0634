"""Refusals raised by the round logic and intake; the gRPC layer maps each to its status code.

``status`` names the code (a ``grpc.StatusCode`` member name), so nothing here imports grpc.
"""

from geodiloco.compression import CodecError
from geodiloco.security.chunks import KeyMismatch
from geodiloco.security.request_errors import Denied, MalformedRequest
from geodiloco.security.sealing import SealError


class CoordinatorError(Exception):
    status = "INTERNAL"


class InvalidArgument(CoordinatorError):
    """Malformed or inconsistent input: wrong shape, bad codec, corrupt payload."""

    status = "INVALID_ARGUMENT"


class FailedPrecondition(CoordinatorError):
    """Valid input at the wrong time: stale or future round, not joined, run finished."""

    status = "FAILED_PRECONDITION"


class LateContribution(FailedPrecondition):
    """A push for a round that already closed without it (a straggler); ``after_s``: how long
    after its round's first contribution it came (None when no longer known)."""

    def __init__(self, message: str, after_s: float | None = None) -> None:
        super().__init__(message)
        self.after_s = after_s


class AlreadyAccepted(CoordinatorError):
    """A repeat of a push already accepted for a round, with other content: refused, not a retry."""

    status = "ALREADY_EXISTS"


class Unavailable(CoordinatorError):
    """Try again shortly (e.g. the same part of a push is still being received)."""

    status = "UNAVAILABLE"


class ContributionMissing(CoordinatorError):
    """A site waits for a round it has no contribution in (lost in a restart): push again."""

    status = "ABORTED"


class PermissionDenied(CoordinatorError):
    """A site that is not part of the run, or a peer whose certificate does not allow the call."""

    status = "PERMISSION_DENIED"


class Unauthenticated(CoordinatorError):
    """A site that cannot prove it holds its secret (a wrong or missing ``--secret``)."""

    status = "UNAUTHENTICATED"


class ResourceExhausted(CoordinatorError):
    """Too many requests from one peer (a flood of joins)."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(CoordinatorError):
    """A stream that stopped sending, or a wait the coordinator will not extend."""

    status = "DEADLINE_EXCEEDED"


class StateError(ValueError):
    """The run directory holds a state this coordinator must not resume from."""


class CorruptStateError(StateError):
    """A state file that is truncated, altered or not a geodiloco state file."""


# every refusal of a request: the core's own, the codecs', the sealing's and the transport's
REFUSALS = (CoordinatorError, CodecError, SealError, MalformedRequest, Denied)


def refusal_code(exc: Exception) -> str:
    """The gRPC status code name a refusal is answered with (the edge maps the name to the code)."""
    if isinstance(exc, CoordinatorError):
        return exc.status
    if isinstance(exc, Denied):
        return "PERMISSION_DENIED"
    if isinstance(exc, KeyMismatch):
        return "FAILED_PRECONDITION"
    return "INVALID_ARGUMENT"  # corrupt, undecodable or tampered input
