"""A user's own group on a backend that refuses CPU tensors, as NCCL does: the documented
own-loop recipe (examples/train_mlp_teacher.py) and the daemon's worker both train on it.

No GPU is here, so the default group is ``strictnccl`` (geodiloco.testing.strict_backend): gloo
underneath, refusing a CPU tensor that code outside torch passes to a collective, as NCCL
refuses CPU tensors. Each site is 2 real gloo-backed rank processes from the test worker's pool
that start that group themselves, then run their entry point: site-1 the example's ``main``,
site-2 the daemon's (``site/daemon/worker.py``, FSDP2), against a coordinator on loopback."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from geodiloco.config import load_config
from geodiloco.testing.rank_pool import RankPool, run_sites
from geodiloco.testing.servers import CoordinatorThread

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
ROUNDS = 2


def recipe_in_example() -> str:
    source = (EXAMPLES / "train_mlp_teacher.py").read_text()
    start, end = source.index("    # [recipe]\n"), source.index("    # [/recipe]\n")
    return textwrap.dedent(source[start + len("    # [recipe]\n") : end])


def test_the_documented_own_loop_is_the_example_this_file_runs() -> None:
    doc = (ROOT / "docs" / "own-model.md").read_text()
    section = doc[doc.index("## Your own training loop instead of the daemon") :]
    block = section[section.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```\n")]
    assert "dist.init_process_group(" in block and "sync.step(" in block
    assert block == recipe_in_example()


@pytest.mark.integration
def test_own_loop_and_daemon_train_on_a_group_that_refuses_cpu_tensors(
    rank_pool: RankPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))  # the coordinator builds θ_0 with the example's builders
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = load_config(
        EXAMPLES / "mlp_teacher.toml",
        [
            f"rounds={ROUNDS}",
            "min_sites=2",
            "inner.steps_per_round=4",
            "workload.options.items_per_shard=256",
        ],
    )
    sites = {"site-1": (2, ["--backend", "strictnccl"]), "site-2": (2, ["--layout", "fsdp"])}
    with CoordinatorThread(cfg) as coordinator:
        run_sites(
            rank_pool,
            coordinator.target,
            sites,
            tmp_path,
            timeout=240,
            paths=[str(EXAMPLES)],
            prepare={  # the example starts its group itself; the daemon keeps the one it finds
                "site-1": "geodiloco.testing.strict_backend:register",
                "site-2": "geodiloco.testing.strict_backend:init_default_group",
            },
            entries={"site-1": "train_mlp_teacher:main"},
        )
        history = coordinator.controller.history
        hashes = coordinator.controller.hashes
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in sites}
    assert [h.round for h in history] == list(range(ROUNDS)), logs
    for record in history:
        assert sorted(record.contributors) == ["site-1", "site-2"]
        assert sorted(record.hash_reports) == ["site-1", "site-2"] and record.hashes_agree, logs
        assert record.state_hash == hashes[record.round + 1]
    assert f"round {ROUNDS - 1}: eval loss" in logs["site-1"]
    assert "layout: fsdp over 2 ranks" in logs["site-2"]
    assert "CpuTensorRefused" not in "".join(logs.values())
