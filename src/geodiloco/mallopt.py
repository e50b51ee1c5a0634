"""glibc's ``mallopt``, for the processes that tune their allocator (the coordinator, a site's
ranks). An operator's ``MALLOC_*`` environment variable always wins: glibc has read it already."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8


def set_malloc_option(param: int, value: int, env: str) -> bool:
    """``mallopt(param, value)`` unless the environment variable ``env`` is set. True when set;
    False off glibc, where ``env`` is set, or where glibc refused."""
    if env in os.environ or platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    return bool(ctypes.CDLL(name).mallopt(param, value))
