"""The coordinator's pools for bulk work: chunk-parallel passes over the model (commit, replay)
and the intake's decoding.

Codec kernels, zstd, numpy and torch release the GIL, so a round costs its passes over the
model divided by the cores, while the event loop keeps answering. Their threads also run at a
lower scheduling priority than the event loop and gRPC's own threads (Linux: a thread's nice
value is its own): when every core is busy with a round's bulk work, a heartbeat or a pull's
next message still gets a core at once rather than after a worker's time slice.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

BULK_WORKERS = min(8, os.cpu_count() or 1)  # the round close's chunk passes
BULK_NICENESS = 5  # added to the process's; raising one's own niceness needs no privilege


def _lower_priority() -> None:
    if hasattr(os, "setpriority") and os.uname().sysname == "Linux":
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):  # refused (a sandbox): bulk work competes as an equal
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + BULK_NICENESS)


def bulk_pool(workers: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run at :data:`BULK_NICENESS` below the process."""
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=_lower_priority)


WORKERS = bulk_pool(BULK_WORKERS, "chunks")
