"""The one logging setup: text by default, JSON lines on request, always run/round/site/rank."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from geodiloco import logs


class Stderr:
    def __init__(self, capsys: pytest.CaptureFixture[str]) -> None:
        self.capsys = capsys

    def getvalue(self) -> str:
        return self.capsys.readouterr().err


@pytest.fixture
def stderr(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[Stderr]:
    monkeypatch.delenv(logs.FORMAT_ENV, raising=False)
    yield Stderr(capsys)
    logs._context.run, logs._context.round = "", None
    logging.basicConfig(force=True, handlers=[logging.NullHandler()])


def test_json_lines_carry_run_round_site_and_rank(stderr: Stderr) -> None:
    logs.setup_logging(site="dc-west", rank=1, fmt="json")
    logging.getLogger("geodiloco.site").info("before the join")
    current = {"round": 7}
    logs.bind(run="run-42", round=lambda: current["round"])
    logging.getLogger("geodiloco.site").warning("pushed %d chunks", 3)
    current["round"] = 8
    logging.getLogger("geodiloco.site").info("next")
    first, second, third = (json.loads(line) for line in stderr.getvalue().splitlines())
    for line in (first, second, third):
        assert set(line) >= {"time", "level", "logger", "run", "round", "site", "rank", "message"}
        assert (line["site"], line["rank"], line["role"]) == ("dc-west", 1, "site")
    assert (first["run"], first["round"]) == (None, None)
    assert second == {**second, "run": "run-42", "round": 7, "level": "WARNING", "message": "pushed 3 chunks"}
    assert third["round"] == 8


def test_text_is_one_readable_line_with_the_same_fields(stderr: Stderr) -> None:
    logs.setup_logging(fmt="text")
    logs.bind(run="run-42", round=lambda: 3)
    logging.getLogger("geodiloco.coordinator").info("round %d committed", 2)
    line = stderr.getvalue().strip()
    assert line.endswith("INFO [coordinator run=run-42 round=3] geodiloco.coordinator: round 2 committed")


def test_a_broken_round_source_never_costs_a_line(stderr: Stderr) -> None:
    logs.setup_logging(fmt="json")
    logs.bind(run="r", round=lambda: 1 // 0)
    logging.getLogger("x").error("still logged")
    assert json.loads(stderr.getvalue())["round"] is None


def test_the_environment_chooses_the_format_and_bad_values_are_named(
    stderr: Stderr, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(logs.FORMAT_ENV, "json")
    assert logs.resolve_format(None) == "json"
    assert logs.resolve_format("text") == "text"  # the flag wins
    monkeypatch.setenv(logs.FORMAT_ENV, "yaml")
    with pytest.raises(
        ValueError, match="GEODILOCO_LOG_FORMAT: unknown log format 'yaml'; expected one of text, json"
    ):
        logs.resolve_format(None)
