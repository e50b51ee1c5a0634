from __future__ import annotations

from pathlib import Path

import pytest

from geodiloco.config import ConfigError, RunConfig, load_config


def test_defaults_are_the_paper_values() -> None:
    cfg = RunConfig()
    assert (cfg.outer.optimizer, cfg.outer.lr, cfg.outer.momentum) == ("nesterov", 0.7, 0.9)
    assert cfg.min_sites == 0 and cfg.quorum == 1  # failover on: either of the two sites may be lost


def test_json_roundtrip_is_lossless() -> None:
    cfg = load_config(None, ["outer.momentum=0.5", 'sites=["a", "b", "c"]', "model.d_model=32"])
    assert RunConfig.from_json(cfg.to_json()) == cfg
    assert cfg.sites == ["a", "b", "c"] and cfg.model.d_model == 32


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("outer.optimizer=adam", "outer.optimizer: unknown value 'adam'; accepted: nesterov, fedavg"),
        ("outer.momentum=1.5", "outer.momentum"),
        ("compression.uplink=q3", "compression.uplink: unknown codec stage 'q3'"),
        ("compression.feedback_decay=1.5", "compression.feedback_decay: must be in [0, 1], got 1.5"),
        ("compression.downlink_feedback_decay=-0.1", "compression.downlink_feedback_decay: must be in"),
        ("inner.steps_per_round=0", "inner.steps_per_round"),
        ("inner.decay_steps=-1", "inner.decay_steps"),
        ("inner.min_lr_ratio=1.5", "inner.min_lr_ratio"),
        ('rounds="many"', "rounds: expected an integer"),
        ("model.d_model=30", "model.d_model (30) must be divisible by model.n_head"),
        (
            "outer.nesterov=true",
            "outer.nesterov: unknown field; accepted: fragments, lr, max_staleness, mix_alpha, momentum, "
            "optimizer, overlap_steps, warmup_rounds",
        ),
        ("outer.fragments=0", "outer.fragments: must be >= 1"),
        ("outer.fragments=26", "outer.fragments: must be <= inner.steps_per_round"),
        ("outer.overlap_steps=25", "outer.overlap_steps: must be < inner.steps_per_round // outer.fragments"),
        ("outer.mix_alpha=1.0", "outer.mix_alpha: must be in [0, 1)"),
        ("min_sites=7", "min_sites"),
    ],
)
def test_bad_values_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_toml_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'run_id = "exp1"\nsites = ["x", "y"]\n[outer]\noptimizer = "fedavg"\nlr = 1.0\nmomentum = 0.0\n'
    )
    cfg = load_config(path)
    assert cfg.run_id == "exp1" and cfg.outer.optimizer == "fedavg"


def test_unreadable_file_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.toml"):
        load_config(tmp_path / "missing.toml")
