"""The committed stubs must match the .proto files; the check must catch drift."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "check_protos.sh"
ENV = {**os.environ, "PYTHON": sys.executable}


def test_committed_stubs_match_protos() -> None:
    result = subprocess.run([str(CHECK)], capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr


@pytest.mark.integration
def test_drift_check_fails_when_a_proto_changes_without_regenerating(tmp_path: Path) -> None:
    shutil.copytree(ROOT / "protos", tmp_path / "protos")
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    proto = tmp_path / "protos" / "geodiloco" / "v1" / "admin.proto"
    proto.write_text(
        proto.read_text().replace("message StatusRequest {}", "message StatusRequest { bool verbose = 1; }")
    )
    result = subprocess.run(
        [str(tmp_path / "scripts" / "check_protos.sh")], capture_output=True, text=True, env=ENV
    )
    assert result.returncode != 0
    assert "stale generated stub: protos/geodiloco/v1/admin_pb2.py" in result.stderr
