"""Bulk work runs below the event loop's priority."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from geodiloco.coordinator.rounds_pool import BULK_NICENESS, bulk_pool


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own nice value is Linux's")
def test_bulk_threads_run_niced_below_the_thread_that_made_the_pool() -> None:
    mine = _niceness()
    with bulk_pool(2, "test-bulk") as pool:
        theirs = set(pool.map(lambda _: _niceness(), range(8)))
    assert theirs == {min(mine + BULK_NICENESS, 19)}
    assert _niceness() == mine  # the caller's own priority is untouched
