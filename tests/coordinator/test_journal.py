"""The run directory's one journal policy: torn tails truncated, short writes never left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from geodiloco.coordinator.errors import CorruptStateError
from geodiloco.coordinator.journal import JsonLines, read_lines


def test_open_truncates_a_torn_tail_and_appends_stay_whole(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text('{"a": 1}\n{"a": 2')
    journal = JsonLines(path, durable=True)
    assert journal.open() == [{"a": 1}]
    assert path.read_text() == '{"a": 1}\n'
    journal.append({"a": 3}, {"a": 4})
    assert read_lines(path) == [{"a": 1}, {"a": 3}, {"a": 4}]


def test_reader_skips_a_line_being_written_without_repairing(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text('{"a": 1}\n{"a": ')
    assert read_lines(path) == [{"a": 1}]
    assert path.read_text().endswith('{"a": ')  # only the lock holder truncates


def test_a_whole_line_that_is_not_json_is_refused_with_its_number(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    path.write_text('{"a": 1}\n{"a": 2{"a": 3}\n')
    with pytest.raises(CorruptStateError, match="line 2 is not a JSON object"):
        JsonLines(path, durable=False).open()


def test_a_short_write_on_a_full_disk_leaves_no_torn_line(tmp_path: Path) -> None:
    """A real short write: RLIMIT_FSIZE lets the append write part of its line, then EFBIG
    (a full disk behaves alike). The append raises and the file is as before it."""
    path = tmp_path / "j.jsonl"
    JsonLines(path, durable=True).append({"round": 0})
    before = path.read_bytes()
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        from pathlib import Path
        from geodiloco.coordinator.journal import JsonLines
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        path = Path({str(path)!r})
        resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, resource.RLIM_INFINITY))
        try:
            JsonLines(path, durable=True).append({{"round": 1, "pad": "x" * 100}})
        except OSError as exc:
            print("refused", exc.errno)
            sys.exit(0)
        sys.exit("the append did not notice its short write")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "refused" in done.stdout, done.stdout + done.stderr
    assert path.read_bytes() == before
    JsonLines(path, durable=True).append({"round": 1})
    assert [json.loads(line)["round"] for line in path.read_text().splitlines()] == [0, 1]
