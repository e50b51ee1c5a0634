"""The loss contract and the dry step: logits, `.loss` outputs and plain losses are accepted;
every mismatch is one config error naming the builder, found before any rank trains."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from geodiloco.builders import (
    BuilderError,
    build_data,
    build_loss,
    build_model,
    check_site_step,
    check_workload,
    exit_config_error,
)
from geodiloco.config import ConfigError, RunConfig, load_config
from geodiloco.testing.configs import tiny_config
from geodiloco.workload.data import DataRange
from geodiloco.workload.loss import cross_entropy, model_loss
from geodiloco.workload.steps import evaluate_batches, inner_step

FEATURES, CLASSES = 6, 3
MODULE = "test_loss_contract"


class Logits(nn.Module):
    """What most people write: ``model(x)`` gives logits."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Dropout(0.5), nn.Linear(8, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@dataclass
class Output:
    """A transformers-style output."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class WithLoss(Logits):
    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> Output:  # type: ignore[override]
        logits = self.net(x)
        return Output(loss=F.cross_entropy(logits, labels), logits=logits)


class ThreeInputs(Logits):
    def forward(self, x: torch.Tensor, mask: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.net(x)


class Toy:
    """Eight shards of 16 random examples and a held-out set, as SiteData."""

    def __init__(self, cfg: RunConfig) -> None:
        gen = torch.Generator().manual_seed(cfg.seed)
        self.x = torch.randn(8 * 16 + 32, FEATURES, generator=gen)
        self.y = torch.randint(0, CLASSES, (self.x.shape[0],), generator=gen)
        self.batch_size = cfg.data.batch_size

    @property
    def shard_sizes(self) -> list[int]:
        return [16] * 8

    def batch(
        self, ranges: Sequence[DataRange], step: int, rank: int, world: int
    ) -> tuple[torch.Tensor, ...]:
        rows = torch.cat([r.shard * 16 + torch.arange(r.start, r.end) for r in ranges])
        first = (step * world + rank) * self.batch_size
        rows = rows[first : first + self.batch_size]
        return self.x[rows], self.y[rows]

    def tokens(self, batch: tuple[torch.Tensor, ...]) -> int:
        return int(batch[0].shape[0])

    def eval_batches(self, part: int, parts: int) -> Iterator[tuple[torch.Tensor, ...]]:
        yield self.x[-32:][part::parts], self.y[-32:][part::parts]


def _seeded(cls: type[nn.Module], cfg: RunConfig) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return cls()


def logits_model(cfg: RunConfig) -> nn.Module:
    return _seeded(Logits, cfg)


def with_loss_model(cfg: RunConfig) -> nn.Module:
    return _seeded(WithLoss, cfg)


def three_inputs_model(cfg: RunConfig) -> nn.Module:
    return _seeded(ThreeInputs, cfg)


def sgd(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "lr": 0.05},
            {"params": [p for n, p in model.named_parameters() if not n.endswith("bias")], "lr": 0.1},
        ]
    )


def toy_data(cfg: RunConfig) -> Toy:
    return Toy(cfg)


def plain_cross_entropy(cfg: RunConfig) -> object:
    return cross_entropy


def detached_loss(cfg: RunConfig) -> object:
    return lambda model, batch: cross_entropy(model, batch).detach()


def own(model: str, *more: str) -> RunConfig:
    return load_config(
        None,
        [
            f"workload.model={MODULE}:{model}",
            f"workload.optimizer={MODULE}:sgd",
            f"workload.data={MODULE}:toy_data",
            "data.shards=8",
            "data.batch_size=4",
            *more,
        ],
    )


def test_a_logits_model_and_a_transformers_style_output_pass_the_dry_step_and_train() -> None:
    for cfg in (
        own("logits_model"),
        own("with_loss_model", "workload.loss=geodiloco.workload.loss:build_model_loss"),
    ):
        check_workload(cfg)
        model, data, loss_fn = build_model(cfg), build_data(cfg), build_loss(cfg)
        batch = data.batch([DataRange(0, 0, 16)], 0, 0, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        first = inner_step(model, optimizer, cfg.inner, 0, *batch, loss_fn=loss_fn)
        for step in range(1, 20):
            last = inner_step(model, optimizer, cfg.inner, step, *batch, loss_fn=loss_fn)
        assert last < first


def test_the_default_loss_of_the_reference_model_is_its_own_loss() -> None:
    cfg = tiny_config()
    model, data = build_model(cfg), build_data(cfg)
    x, y = data.batch([DataRange(0, 0, 8)], 0, 0, 1)
    assert cfg.workload.loss == "geodiloco.workload.loss:build_cross_entropy"
    assert torch.equal(build_loss(cfg)(model, (x, y)), model(x, y))
    check_workload(cfg)


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (
            ["workload.model=test_loss_contract:three_inputs_model"],
            r"^workload.model: test_loss_contract:three_inputs_model's model with workload.loss .*TypeError: "
            r".*forward\(\) missing 2 required positional arguments",
        ),
        (
            [
                "workload.model=test_loss_contract:logits_model",
                "workload.loss=geodiloco.workload.loss:build_model_loss",
            ],
            r"^workload.model: .*takes 2 positional arguments but 3 were given "
            r"\(it calls model\(\*batch\) for a loss; ",
        ),
        (
            ["workload.model=test_loss_contract:with_loss_model"],
            r"^workload.model: .*missing 1 required positional argument: 'labels' "
            r"\(it calls model\(\*inputs\) .*set workload.loss = geodiloco.workload.loss:build_model_loss\)$",
        ),
        (
            [
                "workload.model=test_loss_contract:logits_model",
                "workload.loss=test_loss_contract:detached_loss",
            ],
            r"^workload.loss: test_loss_contract:detached_loss gave a loss that does not depend",
        ),
        (
            ["workload.model=test_loss_contract:logits_model", "workload.loss=test_loss_contract:toy_data"],
            r"^workload.loss: test_loss_contract:toy_data returned Toy, not a function",
        ),
    ],
)
def test_mismatches_are_one_line_config_errors_naming_the_builder(more: list[str], message: str) -> None:
    cfg = load_config(
        None, [f"workload.optimizer={MODULE}:sgd", f"workload.data={MODULE}:toy_data", "data.shards=8", *more]
    )
    with pytest.raises(BuilderError, match=message) as err:
        check_workload(cfg)
    assert "\n" not in str(err.value)


def test_a_site_dry_step_refuses_in_one_line_and_leaves_a_good_model_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = own("three_inputs_model")
    with pytest.raises(BuilderError) as err:
        check_site_step(cfg, build_model(cfg), build_data(cfg), build_loss(cfg))
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(SystemExit) as exit_:
        exit_config_error(err.value)
    assert exit_.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("geodiloco site: invalid config: workload.model: ") and "\n" not in line
    shown = json.loads((tmp_path / "error.json").read_text())["message"]["extraInfo"]["py_callstack"]
    assert shown == line.removeprefix("geodiloco site: ")
    good = own("logits_model")
    model = build_model(good)
    before = [p.detach().clone() for p in model.parameters()]
    check_site_step(good, model, build_data(good), build_loss(good))  # passes and changes nothing
    assert model.training and all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_the_coordinator_refuses_to_serve_a_mismatch_in_one_line(tmp_path: Path) -> None:
    tests = Path(__file__).parent
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "geodiloco",
            "coordinator",
            "serve",
            "--insecure",
            "--port",
            "0",
            "--set",
            f"workload.model={MODULE}:three_inputs_model",
            "--set",
            f"workload.optimizer={MODULE}:sgd",
            "--set",
            f"workload.data={MODULE}:toy_data",
            "--set",
            "data.shards=8",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(tests)},
        cwd=tmp_path,
    )
    assert result.returncode == 2
    # the dry step runs once θ_0 is built, after --insecure's warning: the error is one line
    lines = [
        line for line in result.stderr.strip().splitlines() if not line.startswith("WARNING: --insecure")
    ]
    assert len(lines) == 1 and lines[0].startswith(
        "geodiloco coordinator: invalid config: workload.model: test_loss_contract:three_inputs_model's model"
    ), result.stderr


def test_evaluation_runs_in_eval_mode_and_restores_the_mode() -> None:
    cfg = own("logits_model")
    model, data = build_model(cfg), build_data(cfg)
    batches = list(data.eval_batches(0, 1))
    model.train()
    first = evaluate_batches(model, batches, cross_entropy)
    assert model.training
    assert evaluate_batches(model, batches, cross_entropy) == first  # no dropout: the same every time
    model.eval()
    with torch.no_grad():
        want = float(cross_entropy(model, batches[0])) * batches[0][0].shape[0]
    assert first == (pytest.approx(want), 32)
    assert not model.training


def test_inner_settings_are_what_the_run_uses() -> None:
    reference = load_config(None)
    assert (reference.inner.lr, reference.inner.weight_decay, reference.inner.grad_clip) == (6e-3, 0.01, 1.0)
    saved = json.loads(own("logits_model").to_json())["inner"]
    assert (saved["lr"], saved["weight_decay"], saved["grad_clip"]) == (None, None, 0.0)
    assert RunConfig.from_json(own("logits_model").to_json()) == own("logits_model")
    assert json.loads(own("logits_model", "inner.grad_clip=0.5").to_json())["inner"]["grad_clip"] == 0.5
    for name in ("lr", "weight_decay"):
        with pytest.raises(
            ConfigError,
            match=rf"^inner.{name}: is read only by the reference optimizer; "
            r"workload.optimizer test_loss_contract:sgd sets its own",
        ):
            own("logits_model", f"inner.{name}=0.01")


def test_the_schedule_scales_each_group_of_ones_own_optimizer() -> None:
    cfg = own("logits_model", "inner.warmup_steps=4")
    model = build_model(cfg)
    optimizer = sgd(model, cfg)
    batch = build_data(cfg).batch([DataRange(0, 0, 16)], 0, 0, 1)
    inner_step(model, optimizer, cfg.inner, 1, *batch, loss_fn=cross_entropy)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.025, 0.05])
    inner_step(model, optimizer, cfg.inner, 9, *batch, loss_fn=cross_entropy)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.1])


def test_clipping_is_applied_only_when_set() -> None:
    for clip, bounded in ((0.0, False), (1e-3, True)):
        cfg = own("logits_model", f"inner.grad_clip={clip}")
        model = build_model(cfg)
        before = [p.detach().clone() for p in model.parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        batch = build_data(cfg).batch([DataRange(0, 0, 16)], 0, 0, 1)
        inner_step(model, optimizer, cfg.inner, 0, *batch, loss_fn=cross_entropy)
        moved = torch.cat(
            [(p.detach() - b).reshape(-1) for p, b in zip(model.parameters(), before, strict=True)]
        )
        assert (float(moved.norm()) <= 1e-3 + 1e-6) == bounded


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.n_layer=2",
            r"^model.n_layer: is read only by the reference model builders; "
            r"workload.model test_loss_contract:logits_model does not read it",
        ),
        ("model.seq_len=32", r"^model.seq_len: is read only by the reference model and data builders"),
        (
            'data.paths=["x"]',
            r"^data.paths: is read only by the reference data; workload.data test_loss_contract:toy_data",
        ),
        ("data.max_bytes=5", r"^data.max_bytes: is read only by the reference data"),
    ],
)
def test_settings_ones_own_builders_do_not_read_are_refused(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        own("logits_model", override)


def test_the_reference_data_still_reads_seq_len_with_ones_own_model() -> None:
    cfg = load_config(None, [f"workload.model={MODULE}:logits_model", "model.seq_len=32"])
    assert cfg.model.seq_len == 32


def test_model_loss_reads_a_plain_scalar_and_an_output_with_loss() -> None:
    torch.manual_seed(0)
    model = WithLoss()
    x, y = torch.randn(4, FEATURES), torch.randint(0, CLASSES, (4,))
    model.eval()
    assert torch.equal(model_loss(model, (x, y)), model(x, y).loss)
    plain = nn.Module()
    plain.forward = lambda x, y: (x * 0).sum()
    assert float(model_loss(plain, (x, y))) == 0.0


def test_the_demo_counts_tokens_as_the_builder_does_and_refuses_a_baseline_it_cannot_run() -> None:
    from geodiloco.app.demo import DemoOptions, demo_config

    mine = [f"workload.model={MODULE}:logits_model", f"workload.optimizer={MODULE}:sgd"]
    with pytest.raises(
        ConfigError, match=r"^workload.model: the demo's synchronous baseline trains the reference"
    ):
        demo_config(DemoOptions(overrides=mine))
    cfg = demo_config(DemoOptions(overrides=mine, baseline=False))
    assert cfg.inner.lr is None  # the demo's lr is the reference optimizer's, not applied to yours
