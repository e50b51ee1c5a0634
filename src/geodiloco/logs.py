"""One logging setup for every geodiloco process, tagged with its role."""

from __future__ import annotations

import logging
import sys


def setup_logging(*, site: str = "", rank: int | None = None, level: int = logging.INFO) -> None:
    tag = "coordinator" if not site else site + (f"/r{rank}" if rank is not None else "")
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s",
        force=True,
    )
