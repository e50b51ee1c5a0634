"""A process keeps freed buffers for reuse instead of faulting in fresh pages each round."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the thresholds are glibc's")

# A round's worth of megabyte buffers, allocated together and freed together, 20 times: the
# minor page faults after the first burst are the pages the allocator gave back and took anew.
BURSTS = """
import resource, sys
from geodiloco.pages import keep_freed_pages
if sys.argv[1] == "kept":
    print(keep_freed_pages())
def burst():
    buffers = [bytearray(1 << 20) for _ in range(32)]
    del buffers
burst()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    burst()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(mode: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", BURSTS, mode], env={**clean, **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_freed_buffers_are_reused_not_faulted_in_again() -> None:
    (default_faults,) = _run("default")
    kept, kept_faults = _run("kept")
    assert kept == "True"
    assert int(default_faults) > 20 * 32 * 256 // 2  # glibc's default: most pages again each burst
    assert int(kept_faults) < int(default_faults) // 20


def test_an_operators_setting_wins() -> None:
    assert _run("kept", MALLOC_TRIM_THRESHOLD_="1048576")[0] == "False"
