"""Real gloo rank processes for the tests that run a function on every rank of a small process
group (the layout, pipeline and expert tests), and for the integration tests whose sites'
layouts are what they test (:func:`run_sites`: a site's ranks as the daemon's entry point,
without the launcher and torchrun).

The pool was meant to keep its processes from task to task (spawning a rank costs seconds);
a reused process kept torch.distributed's state of its last task, and DTensor collectives then
named a destroyed group, so each task's ranks now stop when it ends (:meth:`RankPool.wait`) and
the next task spawns afresh. Each :meth:`RankPool.run`
hands rank ``r`` of the task to process ``r``, which runs it in a process group of its own
(the function initialises and destroys it, on a fresh port) and puts its result on the queue
the function is given, as before. A task that raises on any rank, or does not answer in time,
fails the test with that rank's traceback, and the pool is torn down (a rank may be left
waiting in a collective) and spawned afresh for the next test. Every process must exit 0 when
the pool closes, as each rank process had to.
"""

from __future__ import annotations

import importlib
import os
import queue
import sys
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from geodiloco.testing.ports import free_port

STOP = None


def _serve(index: int, tasks: Any, out: Any, errors: Any) -> None:
    """One pooled process: run each task given to it until told to stop."""
    while True:
        task = tasks.get()
        if task is STOP:
            return
        fn, args = task
        torch.seed()  # a fresh process's generator: seeded from the OS, not from the last task
        environ, threads = dict(os.environ), torch.get_num_threads()
        try:
            fn(*args, out)
        except BaseException:
            errors.put((index, traceback.format_exc()))
        finally:  # what a task set for its own group (MASTER_PORT, RANK, threads) goes with it
            os.environ.clear()
            os.environ.update(environ)
            torch.set_num_threads(threads)


class RankPool:
    """Up to ``size`` ranks (spawned as needed); :meth:`run` gives each rank's arguments to one
    process."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._tasks: list[Any] = []
        self._pending = 0  # results of the task given out and not yet collected

    def _grow(self, ranks: int) -> None:
        """Spawn processes until there are ``ranks`` (a pool grows to the largest group asked)."""
        if not self._procs:
            self.out, self.errors = self._ctx.Queue(), self._ctx.Queue()
            self._tasks = []
        while len(self._procs) < ranks:
            i = len(self._procs)
            self._tasks.append(self._ctx.Queue())
            args = (i, self._tasks[i], self.out, self.errors)
            proc = self._ctx.Process(target=_serve, args=args, daemon=True)
            proc.start()
            self._procs.append(proc)

    def run(self, fn: Callable[..., None], ranks: Sequence[tuple[Any, ...]], timeout: float) -> list[Any]:
        """``fn(*ranks[r], out)`` on process ``r`` for every rank; what they put on ``out``
        (one result each, in the order they came)."""
        self.submit(fn, ranks)
        return self.wait(timeout)

    def submit(self, fn: Callable[..., None], ranks: Sequence[tuple[Any, ...]]) -> None:
        """Give out ``fn(*ranks[r], out)`` to process ``r`` and return; :meth:`wait` collects."""
        assert len(ranks) <= self.size, f"{len(ranks)} ranks, a pool of {self.size}"
        if self._pending:  # a test that ended before collecting its ranks: they may still run
            self._kill()
        self._grow(len(ranks))
        for index, args in enumerate(ranks):
            self._tasks[index].put((fn, tuple(args)))
        self._pending = len(ranks)

    def wait(self, timeout: float) -> list[Any]:
        """The results of the task given out, once every rank has put its own (in the order
        they came); a rank's error, or ``timeout`` seconds, fails the test."""
        deadline = time.monotonic() + timeout
        results = []
        try:
            while self._pending:
                results.append(self._next(deadline, timeout))
                self._pending -= 1
        except BaseException:
            self._kill()
            raise
        # The ranks stop after each task (each must exit 0): a process reused for a later task
        # kept torch.distributed's state of the last one, and DTensor collectives then named a
        # destroyed group ("Could not resolve the process group", seen on a clean clone's run).
        self.trim(0)
        return results

    def _next(self, deadline: float, timeout: float) -> Any:
        """The next result; a rank's error (or none by ``deadline``) fails the test."""
        while True:
            try:
                index, trace = self.errors.get_nowait()
            except queue.Empty:
                pass
            else:
                raise AssertionError(f"rank {index} failed:\n{trace}")
            try:
                return self.out.get(timeout=0.2)
            except queue.Empty:
                dead = [p.exitcode for p in self._procs if not p.is_alive()]
                assert not dead, f"a pooled rank process died (exit codes {dead})"
                assert time.monotonic() < deadline, f"no result from the ranks in {timeout:.0f}s"

    def trim(self, keep: int) -> None:
        """Stop the processes beyond the first ``keep`` (each must exit 0): idle ranks hold a
        few hundred MB each while the next tests start processes of their own."""
        if self._pending:
            self._kill()
        extra = self._procs[keep:]
        for tasks in self._tasks[keep:]:
            tasks.put(STOP)
        for p in extra:
            p.join(60)
        del self._procs[keep:], self._tasks[keep:]
        codes = [p.exitcode for p in extra]
        assert codes == [0] * len(codes), f"pooled rank processes exited with {codes}"

    def abandon(self) -> None:
        """After a test that may have failed before :meth:`wait`: ranks still at work are killed
        (the pool starts afresh), so they do not run on into the next test."""
        if self._pending:
            self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            p.kill()
            p.join(10)
        self._procs = []
        self._pending = 0

    def close(self) -> None:
        """Stop every process; each must exit 0 (as each rank process of a test had to)."""
        if self._pending:
            self._kill()
        if not self._procs:
            return
        for tasks in self._tasks:
            tasks.put(STOP)
        codes = []
        for p in self._procs:
            p.join(60)
            codes.append(p.exitcode)
        self._procs = []
        assert codes == [0] * len(codes), f"pooled rank processes exited with {codes}"


def _named(spec: str) -> Callable[..., Any]:
    """The function ``module:function`` names (imported in the rank, after its paths are set)."""
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _site_rank(
    site: str,
    rank: int,
    world: int,
    port: int,
    argv: list[str],
    log: str,
    env: dict[str, str],
    paths: list[str],
    entry: str | None,
    prepare: str | None,
    out: Any,
) -> None:
    """One rank of a site as `geodiloco site run` starts it: the daemon's entry point
    (:func:`geodiloco.site.daemon.worker.main`, or ``entry``) in the environment torchrun gives
    a rank (and the launcher's ``OMP_NUM_THREADS``), its output appended to the site's log as
    torchrun's is. ``env`` and ``paths`` (on ``sys.path``, as ``PYTHONPATH`` would put them) are
    the environment the test gives its sites; both are undone after the task. ``prepare``
    (``module:function``) runs first, in that environment (e.g. to start the default group with
    a backend of the test's); ``entry`` and ``prepare`` are imported from ``paths``."""
    from geodiloco.site.daemon import worker

    path = list(sys.path)
    sys.path[:0] = paths
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        if prepare is not None:
            _named(prepare)()
        (_named(entry) if entry is not None else worker.main)(argv)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
        sys.path[:] = path
    out.put({"site": site, "rank": rank})


def start_sites(
    pool: RankPool,
    target: str,
    sites: Mapping[str, tuple[int, Sequence[str]]],
    logs: Path,
    env: Mapping[str, str] | None = None,
    paths: Sequence[str] = (),
    prepare: Mapping[str, str] | None = None,
    entries: Mapping[str, str] | None = None,
) -> None:
    """Start sites ``{name: (ranks, daemon flags)}`` of the coordinator at ``target``, each a
    process group of pooled ranks running the site daemon on the CPU; each logs to
    ``logs/<name>.log``. ``pool.wait(timeout)`` returns once every rank has left; a rank that
    fails fails the test. ``env``: variables set in the ranks; ``paths``: put on their
    ``sys.path`` (as ``PYTHONPATH``); ``prepare``: a site's ``module:function`` run on each of
    its ranks before the entry point; ``entries``: a site's own entry point (``module:function``, taking argv)
    instead of the daemon's: a training loop of the user's, given ``--coordinator`` and
    ``--site`` before the site's flags.

    What only `geodiloco site run` itself does (the launcher, torchrun, a site killed or
    signalled) is tested with real site processes elsewhere."""
    tasks = []
    for name, (ranks, flags) in sites.items():
        port = free_port()
        entry, before = (entries or {}).get(name), (prepare or {}).get(name)
        argv = ["--coordinator", target, "--site", name, *([] if entry else ["--device", "cpu"]), *flags]
        log = str(logs / f"{name}.log")
        common = (argv, log, dict(env or {}), list(paths), entry, before)
        tasks += [(name, r, ranks, port, *common) for r in range(ranks)]
    pool.submit(_site_rank, tasks)


def run_sites(
    pool: RankPool,
    target: str,
    sites: Mapping[str, tuple[int, Sequence[str]]],
    logs: Path,
    timeout: float = 300,
    env: Mapping[str, str] | None = None,
    paths: Sequence[str] = (),
    prepare: Mapping[str, str] | None = None,
    entries: Mapping[str, str] | None = None,
) -> None:
    """:func:`start_sites`, then wait for every rank to leave (``timeout`` seconds at most)."""
    start_sites(pool, target, sites, logs, env, paths, prepare, entries)
    pool.wait(timeout)
