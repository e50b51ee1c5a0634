"""One logging setup for every geodiloco process: text for people, JSON lines for machines.

Every record carries the run, the round, the site and the rank, so lines from a coordinator
and many sites can be merged and filtered. The format is ``text`` unless ``--log-format json``
(or ``GEODILOCO_LOG_FORMAT=json``, which the CLI sets so that torchrun's ranks inherit it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone

FORMAT_ENV = "GEODILOCO_LOG_FORMAT"
FORMATS = ("text", "json")


@dataclass(slots=True)
class LogContext:
    """What every record of this process is tagged with; ``round`` is read when a line is logged."""

    role: str = "coordinator"  # coordinator, site, or the CLI command (demo, status, ...)
    run: str = ""
    site: str = ""
    rank: int | None = None
    round: Callable[[], int] | None = None


_context = LogContext()


def bind(*, run: str | None = None, round: Callable[[], int] | None = None) -> None:
    """Set the run id and where the current round is read from, once they are known."""
    if run is not None:
        _context.run = run
    if round is not None:
        _context.round = round


CONTEXT_FIELDS = ("role", "run", "round", "site", "rank")


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            round_ = _context.round() if _context.round is not None else None
        except Exception:  # a half-built object must never cost a log line
            round_ = None
        record.__dict__.update(
            role=_context.role,
            run=_context.run or None,
            round=round_,
            site=_context.site or None,
            rank=_context.rank,
        )
        return True


def _fields(record: logging.LogRecord) -> dict[str, object]:
    return {key: record.__dict__.get(key) for key in CONTEXT_FIELDS}


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        f = _fields(record)
        who = str(f["site"] or f["role"])
        if f["rank"] is not None:
            who += f"/r{f['rank']}"
        tags = [f"run={f['run']}"] if f["run"] else []
        if f["round"] is not None:
            tags.append(f"round={f['round']}")
        record.__dict__["tags"] = " ".join([who, *tags])
        return super().format(record)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            **_fields(record),
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def resolve_format(fmt: str | None) -> str:
    """``fmt``, else the environment's choice, else text; anything else is refused by name."""
    chosen = fmt or os.environ.get(FORMAT_ENV) or "text"
    if chosen not in FORMATS:
        source = "--log-format" if fmt else FORMAT_ENV
        raise ValueError(f"{source}: unknown log format {chosen!r}; expected one of {', '.join(FORMATS)}")
    return chosen


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record, not as it was at set-up: where stderr is
    replaced (a test's capture, a re-configured process), a late record from another thread goes
    to the stream in use, never to a closed one."""

    def emit(self, record: logging.LogRecord) -> None:
        self.stream = sys.stderr
        super().emit(record)


def setup_logging(
    *,
    role: str = "",
    site: str = "",
    rank: int | None = None,
    level: int = logging.INFO,
    fmt: str | None = None,
) -> None:
    """Configure the root logger for this process (stderr, text or JSON lines)."""
    _context.role = role or ("site" if site else "coordinator")
    _context.site, _context.rank = site, rank
    handler = _StderrHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    if resolve_format(fmt) == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s [%(tags)s] %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
