"""`geodiloco export`: the committed θ of a real coordinator's run directory, in the model's own
names and order, as safetensors or DCP; what it cannot read is refused in one line."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from geodiloco.app import cli
from geodiloco.app.export import ExportError, export, model_with
from geodiloco.builders import build_model
from geodiloco.config import RunConfig
from geodiloco.coordinator.durable import STATE_LABEL
from geodiloco.coordinator.edge.server import data_shard_sizes, initial_parameters
from geodiloco.coordinator.rounds import RoundController
from geodiloco.params import flatten_parameters
from geodiloco.security.sealing import Keyring
from geodiloco.testing.configs import tiny_config

RUN_SECRET = bytes(range(32))


def committed_run(run_dir: Path, cfg: RunConfig, sealed: bool = False) -> torch.Tensor:
    """A coordinator that committed one round (two sites' pseudo-gradients); returns θ_1."""
    sealer = Keyring(RUN_SECRET, cfg.run_id).at_rest(STATE_LABEL) if sealed else None
    c = RoundController(cfg, initial_parameters(cfg), data_shard_sizes(cfg), run_dir, sealer)

    async def one_round() -> None:
        gen = torch.Generator().manual_seed(3)
        for name in cfg.sites:
            await c.join(name, "")
        for name in cfg.sites:
            await c.contribute(name, "", 0, 100, 1e-3 * torch.randn(c.num_params, generator=gen))

    asyncio.run(one_round())
    assert c.round == 1
    return c.theta.clone()


def config(**overrides: object) -> RunConfig:
    return tiny_config(round_timeout_s=0.2, limits__max_delta_norm_ratio=0.0, **overrides)


def test_safetensors_hold_the_committed_theta_in_the_models_own_names_and_order(tmp_path: Path) -> None:
    cfg = config()
    theta = committed_run(tmp_path / "coord", cfg)
    done = export(cfg, tmp_path / "coord", tmp_path / "out", "safetensors")
    assert done["round"] == 1 and done["parameters"] == theta.numel() and done["buffers_as_built"] == []
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    model = build_model(cfg)
    assert list(tensors) == sorted(model.state_dict())  # safetensors sorts its keys
    assert set(tensors) == set(model.state_dict())
    reloaded = build_model(cfg)
    reloaded.load_state_dict(tensors)
    assert torch.equal(flatten_parameters(reloaded), theta)  # bit for bit
    assert json.loads((tmp_path / "out" / "geodiloco-export.json").read_text())["round"] == 1


def test_dcp_keeps_the_models_order_and_reloads_bit_for_bit(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    cfg = config()
    theta = committed_run(tmp_path / "coord", cfg)
    export(cfg, tmp_path / "coord", tmp_path / "dcp", "dcp")
    model = build_model(cfg)
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    model.load_state_dict(state)
    assert torch.equal(flatten_parameters(model), theta)
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    assert set(meta.state_dict_metadata) == set(model.state_dict())
    # and the DCP directory seeds θ_0 of a new run (workload.init_weights)
    warm = config(workload__init_weights=str(tmp_path / "dcp"))
    assert torch.equal(initial_parameters(warm), theta)


def test_a_sealed_state_needs_the_run_secret_and_the_cli_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = config()
    theta = committed_run(tmp_path / "coord", cfg, sealed=True)
    (tmp_path / "run.secret").write_bytes(RUN_SECRET)
    (tmp_path / "coord" / "config.json").write_text(cfg.to_json())
    args = ["export", str(tmp_path / "coord"), "--out", str(tmp_path / "out")]
    assert cli.main(args) == 2
    # the CLI's own output is one line; an earlier test's server thread may log a stray
    # "--- Logging error ---" report into this capture, so only export's lines are read
    ours = [line for line in capsys.readouterr().err.splitlines() if line.startswith("geodiloco export")]
    assert len(ours) == 1 and ours[0].startswith("geodiloco export: ") and "is sealed" in ours[0]
    (tmp_path / "run.secret").chmod(0o600)
    assert cli.main([*args, "--run-secret", str(tmp_path / "run.secret")]) == 0
    assert "round 1 of run test-run" in capsys.readouterr().out
    assert torch.equal(flatten_parameters(model_with(cfg, theta)), theta)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    reloaded = build_model(cfg)
    reloaded.load_state_dict(tensors)
    assert torch.equal(flatten_parameters(reloaded), theta)


def test_what_export_cannot_read_is_refused_with_the_reason(tmp_path: Path) -> None:
    cfg = config()
    committed_run(tmp_path / "coord", cfg)
    cases = [
        (cfg, tmp_path / "nowhere", None, "not a directory"),
        (cfg, tmp_path, None, "no committed round"),
        (cfg, tmp_path / "coord", 5, "round 5 is not available (rounds 0 to 1 are)"),
        (config(model__n_layer=2), tmp_path / "coord", None, "export with the run's own config"),
        (config(run_id="other"), tmp_path / "coord", None, "holds run 'test-run', the config names 'other'"),
    ]
    for i, (c, run_dir, round_, message) in enumerate(cases):
        with pytest.raises(ExportError, match=re.escape(message)):
            export(c, run_dir, tmp_path / f"out{i}", "safetensors", round_=round_)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("")
    with pytest.raises(ExportError, match="exists and is not an empty directory"):
        export(cfg, tmp_path / "coord", tmp_path / "busy", "safetensors")


def test_round_zero_is_theta_zero_from_the_builders(tmp_path: Path) -> None:
    cfg = config()
    (tmp_path / "empty").mkdir()
    export(cfg, tmp_path / "empty", tmp_path / "out", "safetensors", round_=0)
    tensors = load_file(str(tmp_path / "out" / "model.safetensors"))
    model = build_model(cfg)
    model.load_state_dict(tensors)
    assert torch.equal(flatten_parameters(model), initial_parameters(cfg))
