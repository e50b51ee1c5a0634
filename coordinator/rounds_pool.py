"""The coordinator's pool for chunk-parallel passes over the model (commit, replay).

Codec kernels, zstd, numpy and torch release the GIL, so a round costs its passes over the
model divided by the cores, while the event loop keeps answering.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

WORKERS = ThreadPoolExecutor(min(8, os.cpu_count() or 1), thread_name_prefix="chunks")
