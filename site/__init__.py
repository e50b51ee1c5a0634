"""The per-site daemon: local training in any parallel layout plus the outer-sync client."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from geodiloco.site.client import OuterSyncClient
    from geodiloco.site.outer_sync import OuterSync

__all__ = ["OuterSync", "OuterSyncClient"]


def __getattr__(name: str) -> Any:
    # Imported on first use, not with the package: `geodiloco site run` (the launcher, which
    # only starts torchrun) imports geodiloco.site.launcher and must not pay torch's import.
    if name == "OuterSync":
        from geodiloco.site.outer_sync import OuterSync

        return OuterSync
    if name == "OuterSyncClient":
        from geodiloco.site.client import OuterSyncClient

        return OuterSyncClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
