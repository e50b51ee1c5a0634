"""The coordinator caps its malloc arenas on glibc, and leaves an operator's setting alone."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

CALL = "from geodiloco.coordinator.arenas import limit_arenas; print(limit_arenas())"


def _limit_in_child(**env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    done = subprocess.run([sys.executable, "-c", CALL], env={**clean, **env}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="arenas are glibc's")
def test_arenas_are_capped_unless_the_operator_chose() -> None:
    assert _limit_in_child() == "True"
    assert _limit_in_child(MALLOC_ARENA_MAX="4") == "False"
