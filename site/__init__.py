"""The per-site side: the outer-sync algorithm (this package's modules), the parallel layouts
(`parallel/`), the gRPC edge (`edge/`) and the daemon that composes them (`daemon/`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geodiloco.site.edge.grpc_link import connect
    from geodiloco.site.outer_sync import OuterSync

__all__ = ["OuterSync", "connect"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the package: `geodiloco site run` (the launcher, which
    # only starts torchrun) imports geodiloco.site.daemon.launcher and must not pay torch's
    # import (nor grpc's).
    if name == "OuterSync":
        from geodiloco.site.outer_sync import OuterSync

        return OuterSync
    if name == "connect":
        from geodiloco.site.edge.grpc_link import connect

        return connect
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
