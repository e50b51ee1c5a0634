"""The per-site daemon: local data-parallel training plus the outer-sync client."""

from geodiloco.site.client import OuterSyncClient
from geodiloco.site.outer_sync import OuterSync

__all__ = ["OuterSync", "OuterSyncClient"]
