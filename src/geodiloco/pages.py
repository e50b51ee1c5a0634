"""A process that passes megabyte buffers through every round keeps what it frees for its next
buffers (glibc): a site's ranks, and the coordinator.

Every round a rank receives and sends its share of the model in megabyte buffers: gRPC's read
slices, encoded chunks, decoded values; the coordinator does the same for every site, and its
round close encodes the whole update. glibc hands a burst of them back to the kernel as soon
as they are freed (its trim threshold follows the largest recent block, a few MiB), so the next
round takes fresh pages, which the kernel must zero: with 2 synthetic sites at 500M parameters
(``benchmarks/scale.py``) zeroing pages was 16% of each site's CPU time, most of it under
gRPC's socket reads, and at 100M a coordinator's round close faulted in 20-26k fresh pages
(0 with these thresholds). Fixed thresholds keep up to :data:`TRIM_THRESHOLD` of freed memory
per arena for reuse; blocks over :data:`MMAP_THRESHOLD` are still mapped and unmapped one by
one.
"""

from __future__ import annotations

from geodiloco.mallopt import M_MMAP_THRESHOLD, M_TRIM_THRESHOLD, set_malloc_option

MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic threshold: chunk-sized blocks stay in arenas
TRIM_THRESHOLD = 256 << 20  # a few rounds' worth of chunks in flight, kept rather than returned


def keep_freed_pages() -> bool:
    """Fix glibc's mmap and trim thresholds for this process, each unless its ``MALLOC_*_``
    variable is set. True when both were set; no-op off glibc."""
    mapped = set_malloc_option(M_MMAP_THRESHOLD, MMAP_THRESHOLD, "MALLOC_MMAP_THRESHOLD_")
    trimmed = set_malloc_option(M_TRIM_THRESHOLD, TRIM_THRESHOLD, "MALLOC_TRIM_THRESHOLD_")
    return mapped and trimmed
