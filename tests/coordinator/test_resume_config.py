"""Resuming a run directory (issue 16 item 8): the run's config is saved on its first start; a
resume under another run_id, or with other data or sites, is refused naming the field; a
finished run restarted does not show its departed sites as lost."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from geodiloco.coordinator.durable import STATE_LABEL
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.rundir import RUN_CONFIG, ConfigDrift
from geodiloco.security.sealing import Keyring
from geodiloco.testing.configs import tiny_config

N = 1000
SECRET = bytes(range(32))


def controller(run_dir: Path, sealed: bool = False, **overrides: Any) -> RoundController:
    cfg = tiny_config(limits__max_delta_norm_ratio=0.0, snapshot_every=1, **overrides)
    sealer = Keyring(SECRET, cfg.run_id).at_rest(STATE_LABEL) if sealed else None
    return RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, run_dir, sealer)


async def commit_rounds(c: RoundController, rounds: int) -> None:
    for name in c.cfg.sites:
        await c.join(name, "")
    for _ in range(rounds):
        for name in c.cfg.sites:
            await c.contribute(name, "", c.round, 100, torch.full((N,), 1e-3))


def test_the_run_config_is_saved_on_the_first_start(tmp_path: Path) -> None:
    c = controller(tmp_path)
    assert json.loads((tmp_path / RUN_CONFIG).read_text()) == json.loads(c.cfg.to_json())


def test_a_changed_run_id_is_named_not_taken_for_another_secret(tmp_path: Path) -> None:
    asyncio.run(commit_rounds(controller(tmp_path, sealed=True), 1))
    with pytest.raises(ConfigDrift, match="belongs to run 'test-run', not 'renamed': run_id changed") as err:
        controller(tmp_path, sealed=True, run_id="renamed")
    assert "secret" not in str(err.value)


@pytest.mark.parametrize(
    ("field", "override"),
    [
        ("data.shards", {"data__shards": 3}),
        ("data.max_bytes", {"data__max_bytes": 200_000}),
        ("data.paths", {"data__paths": [str(Path(json.__file__).parent)]}),
        ("sites", {"sites": ["site-a", "site-b", "site-c"]}),
    ],
)
def test_resume_refuses_drift_in_data_and_sites_naming_the_field(
    tmp_path: Path, field: str, override: dict[str, Any]
) -> None:
    asyncio.run(commit_rounds(controller(tmp_path), 1))
    with pytest.raises(ConfigDrift, match=f"^{field}: .* when run 'test-run' started"):
        controller(tmp_path, **override)


def test_resume_accepts_a_longer_run(tmp_path: Path) -> None:
    asyncio.run(commit_rounds(controller(tmp_path), 1))
    assert controller(tmp_path, rounds=5).round == 1


def test_a_finished_run_restarted_shows_its_sites_as_left_not_lost(tmp_path: Path) -> None:
    c = controller(tmp_path)
    asyncio.run(commit_rounds(c, c.cfg.rounds))
    assert c.finished
    restarted = controller(tmp_path)
    assert {s.state for s in restarted.sites.values()} == {"left"}
    for record in restarted.sites.values():
        record.last_seen = 0.0  # long past any lease
    asyncio.run(restarted.tick())
    assert {s.state for s in restarted.sites.values()} == {"left"}
    assert restarted.all_sites_done()
