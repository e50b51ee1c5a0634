"""The per-site side: the outer-sync algorithm (this package's modules), the parallel layouts
(`parallel/`), the gRPC edge (`edge/`) and the daemon that composes them (`daemon/`)."""

from geodiloco.site.edge.grpc_link import connect
from geodiloco.site.outer_sync import OuterSync

__all__ = ["OuterSync", "connect"]
