"""Your own text through the real system: `geodiloco demo` on a user's file (``data.paths``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "inner.steps_per_round=2",
    "data.eval_sequences=8",
    "rounds=1",
]


def demo(tmp_path: Path, *settings: str, sites: int = 2) -> subprocess.CompletedProcess[str]:
    args = [sys.executable, "-m", "geodiloco", "demo", "--no-baseline", "--sites", str(sites)]
    args += ["--ranks-per-site", "1"]
    args += ["--run-dir", str(tmp_path / "run"), "--json", str(tmp_path / "summary.json")]
    for s in settings:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=500)


def test_a_50_mb_file_with_no_cap_trains_a_round(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    letters = torch.tensor(list(b"etaoin shrdlu\n"), dtype=torch.uint8)
    text = letters[torch.randint(len(letters), (50_000_000,), generator=torch.Generator().manual_seed(0))]
    corpus.write_bytes(text.numpy().tobytes())
    # one site: every process reads the file the same way (pread windows), none holds all of it
    result = demo(tmp_path, *TINY, "data.max_bytes=0", f'data.paths=["{corpus}"]', sites=1)
    assert result.returncode == 0, result.stderr[-3000:]
    d = json.loads((tmp_path / "summary.json").read_text())["diloco"]
    assert d["hashes_agree"] and d["tokens"] > 0 and 0 < d["final_eval_loss"] < 6
    # it learnt from this file (14 letters): below the untrained ln 256 = 5.55 after 2 steps
    assert d["final_eval_loss"] < 5.2


def test_too_little_text_stops_the_demo_with_the_coordinators_one_line_reason(tmp_path: Path) -> None:
    short = tmp_path / "short.txt"
    short.write_text("a few words only\n" * 50)
    result = demo(tmp_path, *TINY, f'data.paths=["{short}"]')
    assert result.returncode == 1
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith(
        "geodiloco demo failed: the coordinator exited during start-up: "
        "geodiloco coordinator: invalid config: data: 850 bytes of text in 1 file; need at least"
    ), line
    assert "Traceback" not in result.stderr + result.stdout
