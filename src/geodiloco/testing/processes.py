"""Start `geodiloco` as a real process, and kill one with everything below it.

Tests, benchmarks and the demo's tooling share these: a site is a launcher, torchrun and its
ranks, and torchrun starts each rank in a session of its own, so killing the launcher's process
group would leave the ranks training under the site's name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path


def spawn_geodiloco(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`geodiloco ARGS` in its own process group, output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "geodiloco", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and every process below it, as if its machine died."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, parents first (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # exited meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
