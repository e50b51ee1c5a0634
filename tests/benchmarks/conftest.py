"""Smoke tests of the scripts in ``benchmarks/``: each runs as a user runs it (``--smoke``, its
smallest settings), so a change to a library call a benchmark makes fails the suite, and its JSON
is checked for the documented keys with sane values."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def run_benchmark(tmp_path: Path) -> Callable[..., Any]:
    """``run_benchmark("codecs.py", *args, timeout_s=...)``: run it with ``--smoke --json``; its JSON."""

    def run(script: str, *args: str, timeout_s: float = 300) -> Any:
        out = tmp_path / "result.json"
        cmd = [sys.executable, str(BENCHMARKS / script), "--smoke", "--json", str(out), *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=tmp_path)
        assert proc.returncode == 0, f"{script} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return json.loads(out.read_text())

    return run
