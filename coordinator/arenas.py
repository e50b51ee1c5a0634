"""Fewer malloc arenas for the coordinator (glibc).

glibc gives threads that allocate at once arenas of their own, up to eight per core, and an
arena keeps what its threads freed for reuse instead of returning it. The coordinator's threads
(gRPC's, the intake's, the round close's) each pass megabyte buffers through, so each arena
settles at a high-water mark of its own: with 8 sites pulling at once the peak RSS at 100M
parameters was 2.29 GB with glibc's default against 2.21 GB with two arenas, and with sites that
read faster 2.67 against 2.34 GB (``benchmarks/scale.py``). Big buffers are mapped one by one
anyway, so fewer arenas cost the workers no measurable time.
"""

from __future__ import annotations

from geodiloco.coordinator.rounds_pool import BULK_WORKERS
from geodiloco.mallopt import M_ARENA_MAX, set_malloc_option


def arena_count() -> int:
    """One arena per bulk worker (:mod:`.rounds_pool`), at least two."""
    return max(2, BULK_WORKERS)


def limit_arenas() -> bool:
    """Cap this process's malloc arenas at :func:`arena_count`, unless ``MALLOC_ARENA_MAX`` says
    otherwise (glibc has read it already). True when the cap was set; no-op off glibc."""
    return set_malloc_option(M_ARENA_MAX, arena_count(), "MALLOC_ARENA_MAX")
