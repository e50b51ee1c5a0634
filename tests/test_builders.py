"""The config route to users' builders: validation, import errors, the reference builders."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from geodiloco import builders
from geodiloco.builders import (
    DRY_STEP_APART_PARAMS,
    BuilderError,
    build_data,
    build_loss,
    build_model,
    build_optimizer,
    check_workload,
    check_workload_sized,
    load_builder,
)
from geodiloco.config import ConfigError, RunConfig, load_config
from geodiloco.coordinator.edge.server import data_shard_sizes, initial_parameters
from geodiloco.params import flatten_parameters
from geodiloco.testing.configs import tiny_config
from geodiloco.workload import DataRange, DataShards, eval_windows, load_corpus, rank_batch
from geodiloco.workload import build_model as build_gpt

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def two_shards(cfg: RunConfig) -> Any:
    """A data builder for the tests below that gives the wrong number of shards."""

    class Two:
        shard_sizes = (5, 5)

        def batch(self, *args: object) -> None: ...
        def tokens(self, *args: object) -> None: ...
        def eval_batches(self, *args: object) -> None: ...

    return Two()


def not_a_model(cfg: RunConfig) -> object:
    return object()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("workload.model=mymodel", "workload.model: expected 'package.module:function', got 'mymodel'"),
        ("workload.data=a.b:c d", "workload.data: expected 'package.module:function'"),
        ("workload.options=3", "workload.options: expected a table, got 3"),
        ("workload.loss=ce", "workload.loss: expected 'package.module:function', got 'ce'"),
        ("workload.trainer=x:y", "workload.trainer: unknown field"),
    ],
)
def test_bad_builder_settings_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_defaults_are_the_reference_workload_and_options_survive_json() -> None:
    cfg = load_config(None, ["workload.options.hidden=64", 'workload.options.name="x"'])
    assert cfg.workload.model == "geodiloco.workload.reference:build_model"
    assert RunConfig.from_json(cfg.to_json()).workload.options == {"hidden": 64, "name": "x"}


@pytest.mark.parametrize(
    ("key", "ref", "message"),
    [
        ("model", "no_such_pkg.models:build", "workload.model: cannot import module 'no_such_pkg.models'"),
        (
            "optimizer",
            "geodiloco.builders:nothing_here",
            "workload.optimizer: module 'geodiloco.builders' has no attribute 'nothing_here'",
        ),
        (
            "data",
            "geodiloco.builders:Batch.x",
            "workload.data: module 'geodiloco.builders' has no attribute 'Batch.x'",
        ),
    ],
)
def test_missing_builders_name_the_config_key(key: str, ref: str, message: str) -> None:
    cfg = load_config(None, [f"workload.{key}={ref}"])
    with pytest.raises(BuilderError) as err:
        load_builder(cfg, key)
    assert message in str(err.value)


def test_builders_that_return_the_wrong_thing_are_refused() -> None:
    cfg = load_config(
        None, ["workload.model=test_builders:not_a_model", "workload.data=test_builders:two_shards"]
    )
    with pytest.raises(BuilderError, match=r"workload.model: test_builders:not_a_model returned object"):
        build_model(cfg)
    with pytest.raises(BuilderError, match=r"workload.data: .* gave 2 shards .* data.shards is 24"):
        data_shard_sizes(cfg)


def test_reference_builders_give_what_the_reference_workload_gave() -> None:
    cfg = tiny_config()
    assert torch.equal(initial_parameters(cfg), flatten_parameters(build_gpt(cfg.model, cfg.seed)))
    corpus = load_corpus(cfg.data.paths, cfg.data.max_bytes, cfg.data.eval_fraction)
    shards = DataShards(corpus, count=cfg.data.shards, seq_len=cfg.model.seq_len, seed=cfg.seed)
    data = build_data(cfg)
    assert data_shard_sizes(cfg) == shards.sizes == data.shard_sizes
    ranges = [DataRange(3, 0, 12), DataRange(5, 4, 8)]
    windows = shards.windows(ranges)
    for step, rank in [(0, 0), (0, 1), (1, 1)]:
        x, y = data.batch(ranges, step, rank, 2)
        want_x, want_y = rank_batch(windows, step, rank, 2, cfg.data.batch_size)
        assert torch.equal(x, want_x) and torch.equal(y, want_y)
        assert data.tokens((x, y)) == cfg.data.batch_size * cfg.model.seq_len
    # the parts of the held-out set are disjoint and cover it
    parts = [torch.cat([x for x, _ in data.eval_batches(p, 3)]) for p in range(3)]
    whole = eval_windows(corpus, cfg.data.eval_sequences, cfg.model.seq_len)[:, :-1]
    assert sum(p.shape[0] for p in parts) == whole.shape[0]
    assert sorted(map(tuple, torch.cat(parts).tolist())) == sorted(map(tuple, whole.tolist()))
    optimizer = build_optimizer(build_model(cfg), cfg)
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.param_groups[0]["lr"] == cfg.inner.lr


def test_example_builders_are_deterministic_and_split_rounds_among_ranks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    cfg = load_config(EXAMPLES / "mlp_teacher.toml")
    theta = initial_parameters(cfg)
    assert torch.equal(theta, initial_parameters(cfg))
    assert not torch.equal(theta, initial_parameters(load_config(EXAMPLES / "mlp_teacher.toml", ["seed=8"])))
    data = build_data(cfg)
    assert data_shard_sizes(cfg) == [2048] * cfg.data.shards
    ranges = [DataRange(1, 0, 100), DataRange(6, 100, 128)]  # 2 steps x 2 ranks x 32 examples
    seen = [data.batch(ranges, step, rank, 2)[0] for step in range(2) for rank in range(2)]
    rows = torch.cat(seen)
    assert rows.shape == (128, 32) and torch.unique(rows, dim=0).shape[0] == 128  # no example twice
    x, labels = data.batch(ranges, 0, 0, 2)
    assert (
        data.tokens((x, labels)) == 32 and float(build_loss(cfg)(build_model(cfg), (x, labels)).detach()) > 0
    )
    check_workload(cfg)  # the coordinator's dry step passes
    with pytest.raises(ConfigError, match=r"workload.options.width: unknown"):
        build_model(load_config(EXAMPLES / "mlp_teacher.toml", ["workload.options.width=3"]))


def test_init_weights_warm_start_the_model_and_bad_files_name_the_key(tmp_path: Path) -> None:
    cfg = load_config(None, ["model.n_layer=1"])
    trained = build_model(cfg)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(1.0)
    torch.save(trained.state_dict(), tmp_path / "plain.pt")
    torch.save({"model": trained.state_dict(), "step": 600}, tmp_path / "wrapped.pt")
    for name in ("plain.pt", "wrapped.pt"):
        warm = build_model(load_config(None, ["model.n_layer=1", f"workload.init_weights={tmp_path / name}"]))
        assert all(
            torch.equal(a, b)
            for a, b in zip(warm.state_dict().values(), trained.state_dict().values(), strict=True)
        )
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    torch.save(build_model(load_config(None, ["model.n_layer=2"])).state_dict(), tmp_path / "other.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    for name, message in [
        ("missing.pt", "cannot load"),
        ("junk.pt", "cannot load"),
        ("other.pt", "does not fit the model"),
        ("list.pt", "not a state dict"),
    ]:
        with pytest.raises(BuilderError, match=f"workload.init_weights: .*{message}"):
            build_model(load_config(None, ["model.n_layer=1", f"workload.init_weights={tmp_path / name}"]))


def test_a_large_model_takes_its_dry_step_in_a_child_with_the_same_one_line_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From DRY_STEP_APART_PARAMS parameters on, the coordinator's dry step runs in a fresh
    process (its throwaway model and optimizer state never raise the server's peak memory)."""
    bad = load_config(None, ["workload.data=test_builders:two_shards"])
    with pytest.raises(BuilderError) as in_process:
        check_workload_sized(bad, DRY_STEP_APART_PARAMS - 1)

    def not_here(cfg: RunConfig) -> None:
        raise AssertionError("the dry step ran in this process")

    monkeypatch.setattr(builders, "check_workload", not_here)
    check_workload_sized(tiny_config(), DRY_STEP_APART_PARAMS)  # the child's real step passes
    with pytest.raises(BuilderError) as apart:
        check_workload_sized(bad, DRY_STEP_APART_PARAMS)
    assert str(apart.value) == str(in_process.value)
    assert "workload.data" in str(apart.value) and "\n" not in str(apart.value)
