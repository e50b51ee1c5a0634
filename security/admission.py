"""Ask the coordinator whether it admits a site, before starting the site's ranks.

A site name missing from the run's allow-list (or a certificate naming another site) used to
surface as a rank's traceback from inside torchrun. A Heartbeat is the probe: it changes nothing
for a site that has not joined (FAILED_PRECONDITION "call Join"), only refreshes the lease of one
that has, and is refused with PERMISSION_DENIED exactly where a Join would be.
"""

from __future__ import annotations

import grpc

from geodiloco.security.tls import TlsFiles, open_channel
from geodiloco.v1 import outer_sync_pb2, outer_sync_pb2_grpc

REFUSED = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)


class NotAdmitted(Exception):
    """The coordinator refuses this site; the message is the coordinator's reason."""


def check_admitted(target: str, site: str, tls: TlsFiles | None, timeout_s: float = 5.0) -> None:
    """NotAdmitted when the coordinator refuses ``site``; anything else (admitted, not joined
    yet, unreachable) is left to the site's own retries."""
    with open_channel(target, tls) as channel:
        try:
            outer_sync_pb2_grpc.OuterSyncStub(channel).Heartbeat(
                outer_sync_pb2.HeartbeatRequest(site=site), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            if exc.code() in REFUSED:
                raise NotAdmitted(
                    f"the coordinator at {target} refuses site {site!r}: {exc.details()}"
                ) from None
