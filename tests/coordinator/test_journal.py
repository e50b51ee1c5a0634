"""The run directory's one journal policy: torn tails truncated, short writes never left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from geodiloco.coordinator.journal import EVENTS_FILE, Journal, JsonLines, read_lines
from geodiloco.coordinator.refusals import CorruptStateError


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
    with pytest.raises(CorruptStateError, match=":2: not JSON"):
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


def test_events_are_written_off_the_caller_in_order_and_close_writes_them_all(tmp_path: Path) -> None:
    journal = Journal(tmp_path)
    for i in range(300):
        journal.write("push", site=f"site-{i % 3}", round=i)
    journal.close()
    assert [r["round"] for r in read_lines(tmp_path / EVENTS_FILE)] == list(range(300))
    journal.write("pull", site="site-0", round=300)  # a writer starts again after a close
    journal.close()
    assert read_lines(tmp_path / EVENTS_FILE)[-1]["event"] == "pull"


def test_an_events_journal_that_cannot_be_written_stops_without_stopping_the_caller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = Journal(tmp_path)
    (tmp_path / EVENTS_FILE).mkdir()  # appends now fail with an OSError
    journal.write("push", site="site-a", round=0)
    journal.close()
    journal.write("push", site="site-a", round=1)  # ignored: the journal stopped
    journal.close()
    assert "the journal stops here" in caplog.text
