"""Progress: a redrawn bar on a terminal, plain periodic lines in a log file."""

from __future__ import annotations

import io

import pytest

from geodiloco.progress import Progress


def test_lines_for_a_log_file_show_the_start_the_end_and_nothing_in_between() -> None:
    out = io.StringIO()
    with Progress("pull", 100, stream=out, every_s=3600) as progress:
        for done in range(1, 101):
            progress.update(done, f"chunk {done}")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2  # the first update, then the end (an hour has not passed)
    assert lines[0].startswith("pull 1/100 (1%)") and lines[0].endswith("chunk 1")
    assert lines[1].startswith("pull 100/100 (100%)") and "\r" not in out.getvalue()


def test_a_terminal_gets_a_bar_redrawn_in_place() -> None:
    out = io.StringIO()
    progress = Progress("train", 4, stream=out, tty=True)
    progress.advance(2)
    progress.close()
    text = out.getvalue()
    assert text.startswith("\r\x1b[2Ktrain [" + "#" * 15 + "." * 15 + "] 2/4 (50%)")
    assert text.endswith("\n") and text.count("\n") == 1


def test_close_shows_where_an_interrupted_run_stopped() -> None:
    out = io.StringIO()
    progress = Progress("bench", 10, stream=out, every_s=3600)
    progress.update(1)
    progress.update(4)
    progress.close()
    assert out.getvalue().splitlines()[-1].startswith("bench 4/10 (40%)")


def test_nothing_to_do_is_refused() -> None:
    with pytest.raises(ValueError, match="total must be positive"):
        Progress("x", 0)
