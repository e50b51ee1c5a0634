"""The per-site daemon: local training in any parallel layout plus the outer-sync client."""

from geodiloco.site.client import OuterSyncClient
from geodiloco.site.outer_sync import OuterSync

__all__ = ["OuterSync", "OuterSyncClient"]
