"""The TypeScript site (clients/typescript) follows docs/protocol.md §3.1 on ALREADY_EXISTS: the
coordinator already holds a different push of this site for the round, so the site gives its own
up and pulls the round's update, as after an accepted push (it is not a failure)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from geodiloco.compression import encode_chunks, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.site.edge.client import OuterSyncClient, delta_messages
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.processes import kill_tree
from geodiloco.testing.servers import CoordinatorThread

pytestmark = pytest.mark.integration

TS_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "typescript"


def push(client: OuterSyncClient, cfg: RunConfig, n: int, seed: int) -> bool:
    """A whole round-0 contribution (random, small) of ``client``'s site; True if a duplicate."""
    codec = cfg.compression.uplink
    delta = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 1e-3
    chunks, _ = encode_chunks(parse_pipeline(codec), delta, cfg.compression.chunk_elements, round_=0)
    msgs = delta_messages(client.run_id, client.site, 0, codec, chunks, 100, client.assigned)
    return bool(client.stub.PushDelta(iter(msgs), timeout=30).duplicate)


def events(log: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]


def test_a_push_refused_as_already_held_is_followed_by_the_pull(tmp_path: Path) -> None:
    # round 0 stays open until site-py pushes; leases and the deadline outlast the TS start-up
    cfg = tiny_config(
        sites=["site-py", "site-ts"], min_sites=2, rounds=1, lease_s=60.0, round_timeout_s=120.0
    )
    tsx = TS_CLIENT / "node_modules" / ".bin" / "tsx"
    assert tsx.exists(), "run `npm ci` in clients/typescript (make setup does)"
    log = tmp_path / "site-ts.log"
    with CoordinatorThread(cfg) as coordinator:
        n = coordinator.controller.num_params
        # an earlier push of site-ts for round 0 (say, from before the site restarted)
        earlier = OuterSyncClient(coordinator.target, "site-ts")
        earlier.join()
        assert not push(earlier, cfg, n, seed=1)
        command = [str(tsx), "src/site.ts", "--coordinator", coordinator.target, "--name", "site-ts"]
        with open(log, "wb") as out:
            ts = subprocess.Popen(
                [*command, "--insecure"], cwd=TS_CLIENT, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            deadline = time.monotonic() + 120
            while not any(e.get("code") == "ALREADY_EXISTS" for e in events(log)):
                assert ts.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            py = OuterSyncClient(coordinator.target, "site-py")
            py.join()
            assert not push(py, cfg, n, seed=2)
            py.close()
            assert ts.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            if ts.poll() is None:
                kill_tree(ts)
            earlier.close()
        history = coordinator.controller.history
        site = coordinator.controller.sites["site-ts"]
    assert len(history) == 1 and history[0].contributors == ["site-py", "site-ts"]
    lines = events(log)
    assert not any(e["event"] == "pushed" for e in lines)  # its own push was never accepted
    (round_,) = [e for e in lines if e["event"] == "round"]
    # it applied the update of the round its earlier push went into: θ_1 agrees with the coordinator
    assert (round_["round"], round_["hash"], round_["hash_ok"]) == (0, history[0].state_hash, True)
    assert site.state == "left" and site.accepted == 1
