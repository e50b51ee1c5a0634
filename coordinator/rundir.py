"""A coordinator's run directory: the names of its files and the lock that makes it one writer's.

Two coordinators on one run directory would both commit into one round log (a split run: the
same rounds twice, a broken hash chain, data consumed twice). So a coordinator takes an
exclusive ``flock`` on ``RUN_DIR/coordinator.lock`` before it reads or writes anything there,
and holds it for its lifetime. The kernel drops the lock when the process ends, however it
ends, so a lock file left by a dead coordinator never blocks the next one; the pid and host
written into it only name the holder in the refusal.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from geodiloco.coordinator.refusals import CorruptStateError, StateError

if TYPE_CHECKING:
    from geodiloco.config import RunConfig

STATE_FILE = "coordinator.state"  # the last snapshot (durable.save_state)
ROUND_LOG = "rounds.jsonl"  # one line per committed round, hash-chained
REPORT_LOG = "reports.jsonl"  # the sites' hash reports and eval losses
EVENTS_FILE = "events.jsonl"  # what each site did in each round (telemetry)
LOCK_FILE = "coordinator.lock"
RUN_CONFIG = "config.json"  # the run's config as it started (read by `geodiloco export` too)
PLAN_FILE = "fragments.json"  # a streaming run's (P > 1) fragment plan; fragment p's files in fragment-p/
# what a resumed run may not change: its data (the ledger's shards and windows), its sites, and
# its fragments (each keeps its own state: another count would start afresh beside the old ones)
FIXED_ON_RESUME = ("data.shards", "data.max_bytes", "data.paths", "sites", "outer.fragments")


class ConfigDrift(StateError):
    """A resume under a config that changes the run's identity, data or membership."""


class RunDirInUse(StateError):
    """Another live coordinator holds the run directory."""


@dataclass(slots=True)
class RunDirLock:
    """An exclusive lock on a run directory, held while the file descriptor is open."""

    path: Path
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1


def lock_run_dir(run_dir: Path) -> RunDirLock:
    """Take ``run_dir``'s lock (creating the directory), or refuse naming the holder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise RunDirInUse(
            f"run directory {run_dir} is in use by another coordinator ({holder}; lock {path}): "
            "stop that one first, or give this one another --run-dir"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()})
    os.ftruncate(fd, 0)
    os.pwrite(fd, record.encode() + b"\n", 0)
    return RunDirLock(path, fd)


def _holder(fd: int) -> str:
    """The holder as its lock file names it ("pid N on host H")."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"pid {int(info['pid'])} on host {info['host']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid and host unknown: the holder has not written them yet"


def check_run_config(run_dir: Path, cfg: RunConfig) -> None:
    """Save the run's config on its first start; on a resume, refuse a config that names another
    run or changes a field of :data:`FIXED_ON_RESUME`, naming it (the ledger, the shards each
    site reads and the membership were all built from them)."""
    path = run_dir / RUN_CONFIG
    current = json.loads(cfg.to_json())
    if not path.exists():
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(cfg.to_json() + "\n")
        os.replace(tmp, path)
        return
    try:
        saved = json.loads(path.read_text())
        saved_id = saved["run_id"]
    except (ValueError, KeyError, TypeError):
        raise CorruptStateError(f"{path}: not the run config a coordinator saved") from None
    if saved_id != cfg.run_id:
        raise ConfigDrift(
            f"the state in {run_dir} belongs to run {saved_id!r}, not {cfg.run_id!r}: run_id changed "
            f"in the config; set run_id = {saved_id!r} to resume it, or give the new run another --run-dir"
        )
    for name in FIXED_ON_RESUME:
        before, now = _field(saved, name), _field(current, name)
        if before != now:
            raise ConfigDrift(
                f"{name}: {before!r} when run {saved_id!r} started in {run_dir}, {now!r} now; a resumed "
                f"run keeps its data, sites and fragments: restore {name}, or start a new run in another "
                "--run-dir"
            )


def _field(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node
