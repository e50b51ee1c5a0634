"""Durability proportional to the round: each commit logs its compressed update; restarts replay
the log after the last snapshot, bit for bit, including after a kill -9 at any point between
the snapshot and the log appends."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from geodiloco.coordinator import updatelog
from geodiloco.coordinator.durable import STATE_FILE, CorruptStateError, DurableWriter
from geodiloco.coordinator.replay import committed_parameters
from geodiloco.coordinator.rounds import RoundController
from geodiloco.params import state_hash
from geodiloco.testing.configs import tiny_config

N = 50_000
TESTS = Path(__file__).resolve().parents[1]
THETA_0 = torch.linspace(-1, 1, N)


def controller(run_dir: Path | None, snapshot_every: int = 4) -> RoundController:
    cfg = tiny_config(
        rounds=20, round_timeout_s=60.0, limits__max_delta_norm_ratio=0.0, snapshot_every=snapshot_every
    )
    return RoundController(cfg, THETA_0, [1000] * cfg.data.shards, run_dir)


async def commit_rounds(c: RoundController, rounds: int) -> None:
    for name in c.cfg.sites:
        await c.join(name, "")
    for _ in range(rounds):
        r = c.round
        for i, name in enumerate(c.cfg.sites):
            gen = torch.Generator().manual_seed(100 * r + i)
            await c.contribute(name, "", r, 100 + i, torch.randn(N, generator=gen) * 1e-3)


def test_between_snapshots_a_commit_writes_its_update_not_the_model(tmp_path: Path) -> None:
    c = controller(tmp_path)
    asyncio.run(commit_rounds(c, 3))
    assert not (tmp_path / STATE_FILE).exists()  # no snapshot yet: round 4 takes the first
    update_bytes = c.history[-1].update_bytes
    assert update_bytes <= c.disk_bytes <= 2 * update_bytes
    assert c.disk_bytes < N  # about one byte per parameter; the model is 4
    asyncio.run(commit_rounds(c, 1))
    assert (tmp_path / STATE_FILE).exists() and c.snapshot_round == 4


def test_restart_replays_the_log_bit_for_bit_and_serves_catch_up_from_it(tmp_path: Path) -> None:
    c = controller(tmp_path)
    asyncio.run(commit_rounds(c, 6))  # a snapshot at round 4, rounds 4 and 5 only logged
    restarted = controller(tmp_path)
    assert restarted.round == 6 and torch.equal(restarted.theta, c.theta)
    assert restarted.hashes == c.hashes and state_hash(restarted.theta) == c.hashes[6]
    assert [h.state_hash for h in restarted.history] == [h.state_hash for h in c.history]
    assert restarted.ledger.consumed == c.ledger.consumed
    assert restarted.sites["site-b"].tokens == c.sites["site-b"].tokens
    for r in (4, 5):
        kept = asyncio.run(restarted.kept_update(r))
        assert kept is not None and kept.state_hash == c.hashes[r + 1]
    lines = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [(x["base_hash"], x["state_hash"]) for x in lines] == [
        (c.hashes[r], c.hashes[r + 1]) for r in range(6)
    ]
    for r in (4, 5, 6):
        assert committed_parameters(tmp_path, r).state_hash == c.hashes[r]
    assert torch.equal(committed_parameters(tmp_path).theta, c.theta)


def test_a_tampered_or_moved_update_is_refused(tmp_path: Path) -> None:
    c = controller(tmp_path)
    asyncio.run(commit_rounds(c, 2))
    path = updatelog.update_path(tmp_path, 1)
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match="checksum"):
        controller(tmp_path)
    path.unlink()
    os.rename(updatelog.update_path(tmp_path, 0), path)  # round 0's file passed off as round 1's
    with pytest.raises(CorruptStateError):
        controller(tmp_path)


def test_update_buffers_reuse_their_memory_and_still_refuse_a_tampered_file(tmp_path: Path) -> None:
    """A restart's replay reads update after update into two buffers in turn: the same updates as
    fresh reads, the third in the first one's memory, and a file altered after a good read of it
    into the same buffer is refused, not served from what the buffer held."""
    c = controller(tmp_path)
    asyncio.run(commit_rounds(c, 3))
    fresh = [updatelog.read_update(tmp_path, r, None) for r in range(3)]
    buffers = updatelog.UpdateBuffers(2)
    read = []
    for r in range(3):
        read.append(buffers.read(tmp_path, r, None))
        assert read[r] == fresh[r]  # valid until two more are read: round 2 reuses round 0's memory
    owners = [
        u.chunks[0].payload.obj for u in read if u is not None and isinstance(u.chunks[0].payload, memoryview)
    ]
    assert len(owners) == 3 and owners[2] is owners[0] and owners[1] is not owners[0]
    path = updatelog.update_path(tmp_path, 1)  # the next read goes into the buffer holding round 1
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match="checksum"):
        buffers.read(tmp_path, 1, None)
    assert buffers.read(tmp_path, 7, None) is None  # not logged


def test_an_update_logged_by_an_earlier_version_still_reads(tmp_path: Path) -> None:
    """Earlier files put the record before the chunks; today's put it after (written as the
    chunks are computed). Both read to the same update."""
    c = controller(tmp_path)
    asyncio.run(commit_rounds(c, 2))
    logged = updatelog.read_update(tmp_path, 1, None)
    assert logged is not None
    meta = {
        "run_id": logged.run_id,
        "round": 1,
        "codec": logged.codec,
        "base_hash": logged.base_hash,
        "state_hash": logged.state_hash,
        "chunks": [[x.start, x.numel, len(x.payload)] for x in logged.chunks],
        "record": logged.record,
    }
    head = json.dumps(meta).encode()
    pieces = [struct.pack("<Q", len(head)) + head, *(x.payload for x in logged.chunks)]
    path = updatelog.update_path(tmp_path, 1)
    with DurableWriter(path, None, "coordinator-update:1") as out:
        for piece in pieces:
            out.write(piece)
        out.commit()
    assert updatelog.read_update(tmp_path, 1, None) == logged
    assert torch.equal(controller(tmp_path).theta, c.theta)


def test_the_log_refuses_a_record_that_is_not_of_the_chunks_written(tmp_path: Path) -> None:
    c = controller(tmp_path)
    asyncio.run(commit_rounds(c, 1))
    logged = updatelog.read_update(tmp_path, 0, None)
    assert logged is not None
    with updatelog.UpdateLogWriter(tmp_path, 0, None) as out:
        for chunk in [*logged.chunks, logged.chunks[0]]:  # one chunk too many
            out.add(chunk)
        with pytest.raises(ValueError, match="not the one written"):
            out.commit(logged)
    assert updatelog.read_update(tmp_path, 0, None) == logged  # the committed file is untouched


CRASH = """
import asyncio, os, signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from geodiloco.coordinator import rounds
from test_update_log import commit_rounds, controller

run_dir, point = Path(sys.argv[1]), sys.argv[2]
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
if point == "after_update_before_snapshot":
    rounds.save_state = lambda *a, **k: die()
elif point == "after_snapshot_before_round_log":
    save = rounds.save_state
    def save_then_die(*a, **k):
        save(*a, **k)
        die()
    rounds.save_state = save_then_die
elif point == "before_update":  # round 5's chunks are written, its file not yet committed
    real = rounds.UpdateLogWriter.commit
    def commit(self, update):
        if update.round == 5:
            die()
        return real(self, update)
    rounds.UpdateLogWriter.commit = commit
asyncio.run(commit_rounds(controller(run_dir), 6))
"""


@pytest.mark.parametrize(
    "point", ["after_update_before_snapshot", "after_snapshot_before_round_log", "before_update"]
)
def test_kill_9_between_snapshot_and_log_append_then_replay(tmp_path: Path, point: str) -> None:
    reference = controller(None)
    asyncio.run(commit_rounds(reference, 6))
    crashed = subprocess.run(
        [sys.executable, "-c", CRASH, str(tmp_path), point, str(TESTS / "coordinator")],
        env={**os.environ, "PYTHONPATH": str(TESTS)},
        capture_output=True,
        timeout=300,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr.decode()[-2000:]
    restarted = controller(tmp_path)
    # killed while committing round 3 (the snapshot of round 4), or before logging round 5
    expected = 5 if point == "before_update" else 4
    assert restarted.round == expected
    assert torch.equal(restarted.theta, committed_parameters(tmp_path, initial=THETA_0).theta)
    assert [restarted.hashes[r] for r in range(expected + 1)] == [
        reference.hashes[r] for r in range(expected + 1)
    ]
    if point == "before_update":  # θ_5 was logged whole; the uncommitted round 5 is simply redone
        assert torch.equal(restarted.theta, _theta_at(5))
    lines = [json.loads(x) for x in (tmp_path / "rounds.jsonl").read_text().splitlines()]
    assert [x["round"] for x in lines] == list(range(expected))
    assert all(x["state_hash"] == y["base_hash"] for x, y in itertools.pairwise(lines))
    asyncio.run(commit_rounds(restarted, 6 - expected))  # and the run goes on from there
    assert restarted.round == 6
    assert not list((tmp_path / "updates").glob("*.tmp"))  # a file never committed is cleared


def _theta_at(rounds: int) -> torch.Tensor:
    c = controller(None)
    asyncio.run(commit_rounds(c, rounds))
    return c.theta
