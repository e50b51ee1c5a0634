"""The fault plan's ``poison``: validation naming the field, each mode's effect on plain tensors,
placement from a round on for every rank of the site, and the hook in a site's outer loop (the
in-process link)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from geodiloco import faults
from geodiloco.faults import FAULT_PLAN_ENV, Fault, FaultInjector, FaultPlanError, fired, load_plan
from geodiloco.site.outer_sync import OuterSync
from geodiloco.testing.configs import streaming_config
from geodiloco.testing.local_runs import Blocks, coordinator_for, inner_step


def write_plan(tmp_path: Path, *items: dict[str, Any]) -> Path:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"faults": list(items)}))
    return path


POISON = {"action": "poison", "site": "a", "round": 1, "at": "push"}


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"mode": "zero"}, "faults[0].mode: unknown 'zero'; accepted: sign_flip, noise, constant"),
        ({"mode": "sign_flip", "factor": 0}, "faults[0].factor: a sign_flip needs a factor > 0"),
        ({"mode": "noise"}, "faults[0].norm: a noise poison needs a norm > 0"),
        (
            {"mode": "noise", "norm": 1.0, "value": 2.0},
            "faults[0].value: only a constant poison takes a value",
        ),
        (
            {"mode": "constant", "value": float("inf")},
            "faults[0].value: a constant poison needs a finite value",
        ),
        ({"mode": "constant", "value": 1.0, "factor": 2}, "faults[0].factor: only a sign_flip poison"),
        (
            {"mode": "constant", "value": 1.0, "at": "step"},
            'faults[0].at: a poison acts on the pushes: place it at "push"',
        ),
    ],
)
def test_bad_poisons_name_the_field(tmp_path: Path, fields: dict[str, Any], message: str) -> None:
    with pytest.raises(FaultPlanError) as err:
        load_plan(write_plan(tmp_path, {**POISON, **fields}))
    assert message in str(err.value)


def test_only_a_poison_takes_a_mode_norm_or_value() -> None:
    with pytest.raises(FaultPlanError, match="mode: only a poison takes a mode"):
        Fault(action="kill", site="a", round=1, mode="noise")
    with pytest.raises(FaultPlanError, match="norm: only a poison takes a norm"):
        Fault(action="kill", site="a", round=1, norm=1.0)


def test_each_mode_replaces_the_values() -> None:
    delta = torch.linspace(-1, 1, 10_000)
    flipped = delta.clone()
    Fault(**POISON, mode="sign_flip", factor=4).poison(flipped, 10_000, seed=1)
    assert torch.equal(flipped, delta * -4)
    constant = delta.clone()
    Fault(**POISON, mode="constant", value=0.25).poison(constant, 10_000, seed=1)
    assert torch.equal(constant, torch.full_like(delta, 0.25))
    noise, again, other = delta.clone(), delta.clone(), delta.clone()
    fault = Fault(**POISON, mode="noise", norm=3.0)
    (
        fault.poison(noise, 10_000, seed=1),
        fault.poison(again, 10_000, seed=1),
        fault.poison(other, 10_000, seed=2),
    )
    assert float(noise.norm()) == pytest.approx(3.0, rel=0.05)  # the whole fragment's norm
    assert torch.equal(noise, again) and not torch.equal(noise, other)


def test_a_poison_holds_from_its_round_for_every_rank_and_is_recorded_once(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, {**POISON, "rank": 1, "mode": "constant", "value": 1.0})
    for rank in (0, 1):
        injector = FaultInjector(plan, "a", rank)
        assert injector.poisoning(0) is None
        assert [injector.poisoning(r).mode for r in (1, 2, 5)] == ["constant"] * 3  # type: ignore[union-attr]
    assert FaultInjector(plan, "b", 0).poisoning(3) is None
    assert list(fired(plan)) == [0] and fired(plan)[0]["round"] == 1  # by the named rank
    assert FaultInjector(plan, "a", 1).poisoning(4) is not None  # a restarted site still poisons


def test_a_sites_push_carries_the_poison(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        FAULT_PLAN_ENV, str(write_plan(tmp_path, {**POISON, "round": 0, "mode": "constant", "value": 0.5}))
    )
    cfg = streaming_config(2, 0, sites=["a", "b"])
    with coordinator_for(cfg) as coordinator:
        sync = OuterSync.over(coordinator.link("a"))
        model = sync.attach(Blocks())
        inner_step(model, torch.Generator().manual_seed(0))
        honest = sync.fragments[0].encode_delta().to_send.clone()
        sync.tamper = functools.partial(faults.poison, "a", 0)  # as the site daemon sets it
        for f in sync.fragments:
            sent = f.encode_delta().to_send
            assert torch.equal(sent, torch.full_like(sent, 0.5))
        assert not torch.equal(honest, torch.full_like(honest, 0.5))
        assert sum(f.numel for f in sync.fragments) == sum(p.numel() for p in model.parameters())
        sync.close()
