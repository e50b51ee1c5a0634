"""Hugging Face models through the builder route: a tiny random LlamaForCausalLM made here (no
downloads), imported from its save_pretrained directory, trained on the byte data, exported and
read back by transformers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from geodiloco.app.export import export, model_with
from geodiloco.builders import build_data, build_loss, build_model, check_workload
from geodiloco.config import ConfigError, RunConfig, load_config
from geodiloco.coordinator.edge.server import data_shard_sizes, initial_parameters
from geodiloco.coordinator.rounds import RoundController
from geodiloco.params import flatten_parameters
from geodiloco.workload.data import DataRange
from geodiloco.workload.hf import tiny_llama
from geodiloco.workload.steps import inner_step


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def pretrained(path: Path, tie: bool = False) -> Path:
    """A tiny Llama saved as a user's pretrained model would be (random, seed 5)."""
    tiny_llama(5, tie=tie).save_pretrained(path)
    return path


def hf_config(path: Path, *more: str) -> RunConfig:
    return load_config(
        None,
        [
            "run_id=hf",
            "workload.model=geodiloco.workload.hf:build_model",
            f'workload.options.hf_model="{path}"',
            "model.seq_len=16",
            "data.max_bytes=200000",
            "data.eval_sequences=8",
            "data.batch_size=2",
            *more,
        ],
    )


def test_import_then_export_at_round_zero_is_bit_identical(tmp_path: Path) -> None:
    for tie in (False, True):
        source = pretrained(tmp_path / f"pre-{tie}", tie)
        cfg = hf_config(source, f'workload.init_weights="{source}"')
        out = tmp_path / f"out-{tie}"
        (tmp_path / f"run-{tie}").mkdir()
        export(cfg, tmp_path / f"run-{tie}", out, "safetensors", round_=0)
        before = load_file(str(source / "model.safetensors"))
        after = load_file(str(out / "model.safetensors"))
        assert list(before) == list(after)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert (out / "config.json").is_file()


def test_seeded_without_init_weights_and_options_errors_name_the_field(tmp_path: Path) -> None:
    source = pretrained(tmp_path / "pre")
    a, b = initial_parameters(hf_config(source)), initial_parameters(hf_config(source))
    assert torch.equal(a, b) and not torch.equal(a, initial_parameters(hf_config(source, "seed=9")))
    layers = hf_config(source, "workload.options.hf_config.num_hidden_layers=1")
    assert (
        sum(
            1
            for n, _ in build_model(layers).named_modules()
            if n.startswith("model.layers.") and n.count(".") == 2
        )
        == 1
    )
    for more, message in [
        (["workload.options.hf_model=3"], "workload.options.hf_model: name a transformers config"),
        ([f'workload.options.hf_model="{tmp_path / "none"}"'], "workload.options.hf_model: cannot read"),
        (["workload.options.hf_config.no_such=1"], "workload.options.hf_config.no_such: not a field"),
    ]:
        with pytest.raises(ConfigError, match=message):
            build_model(hf_config(source, *more))


def test_a_committed_theta_exports_to_the_same_logits_in_transformers(tmp_path: Path) -> None:
    source = pretrained(tmp_path / "pre")
    cfg = hf_config(source, f'workload.init_weights="{source}"', "limits.max_delta_norm_ratio=0")
    check_workload(cfg)  # the dry step: logits from .logits, scored by the default loss
    # a site's inner steps, then a committed round at a real coordinator
    model, data, loss_fn = build_model(cfg), build_data(cfg), build_loss(cfg)
    theta0 = flatten_parameters(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = data.batch([DataRange(0, 0, 8)], 0, 0, 1)
    losses = [inner_step(model, optimizer, cfg.inner, s, *batch, loss_fn=loss_fn) for s in range(5)]
    assert losses[-1] < losses[0]
    delta = theta0 - flatten_parameters(model)
    controller = RoundController(cfg, initial_parameters(cfg), data_shard_sizes(cfg), tmp_path / "run")

    async def one_round() -> None:
        for name in cfg.sites:
            await controller.join(name, "")
        for name in cfg.sites:
            await controller.contribute(name, "", 0, 100, delta.clone())

    asyncio.run(one_round())
    theta = controller.theta.clone()
    export(cfg, tmp_path / "run", tmp_path / "out", "safetensors")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ours = model_with(cfg, theta)
    x = batch[0]
    reloaded.eval()
    ours.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(x).logits, ours(x).logits)
    assert not torch.equal(theta, theta0)
