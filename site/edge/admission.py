"""Ask the coordinator whether it admits a site, before starting the site's ranks.

A refusal (a site name missing from the run's allow-list, a certificate naming another site, a
wrong or missing site secret) used to surface as every rank's traceback from inside torchrun.
The probe is a Join for a run id no coordinator serves, carrying the site's key proof: the
coordinator checks the site and its proof before the run id, and refuses the run id before
anything changes, so the answer says whether the site would be admitted and admits nothing.
"""

from __future__ import annotations

import grpc

from geodiloco.security.joinproof import join_proof
from geodiloco.security.tls import TlsFiles, open_channel
from geodiloco.v1 import outer_sync_pb2, outer_sync_pb2_grpc

REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
PROBE_RUN_ID = "\0admission-probe"  # a NUL byte: no real run's id
NOT_SEALING = "does not seal"  # protocol.md §3.1: a secret offered to a run that does not seal


class NotAdmitted(Exception):
    """The coordinator refuses this site; the message is the coordinator's reason."""


def check_admitted(
    target: str, site: str, tls: TlsFiles | None, secret: bytes | None = None, timeout_s: float = 5.0
) -> None:
    """NotAdmitted when the coordinator refuses ``site`` (with ``secret``); anything else
    (admitted, unreachable) is left to the site's own retries."""
    request = outer_sync_pb2.JoinRequest(run_id=PROBE_RUN_ID, site=site, world_size=1)
    if secret is not None:
        request.key_proof = join_proof(secret, PROBE_RUN_ID, site, 1)
    with open_channel(target, tls) as channel:
        try:
            outer_sync_pb2_grpc.OuterSyncStub(channel).Join(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            refused = exc.code() in REFUSED
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and NOT_SEALING in (exc.details() or ""):
                refused = True
            if refused:
                raise NotAdmitted(
                    f"the coordinator at {target} refuses site {site!r}: {exc.details()}"
                ) from None
