"""The fragment plan (a pure function of the canonical parameter list) and the schedule."""

from __future__ import annotations

import pytest
import torch

from geodiloco.site.fragment_schedule import FragmentPlan, Schedule, block_index

GPT = [  # canonical order (sorted by name), as a 4-block GPT lists them
    *((f"blocks.{i}.{part}", n) for i in range(4) for part, n in (("attn.w", 64), ("mlp.w", 128))),
    ("head.weight", 300),
    ("ln_f.weight", 8),
    ("pos_emb", 100),
    ("tok_emb.weight", 300),
]


def test_blocks_are_strided_and_the_rest_balances_the_sizes() -> None:
    plan = FragmentPlan.strided(GPT, 2)
    names = [[GPT[i][0] for i in members] for members in plan.members]
    assert {n.split(".")[1] for n in names[0] if n.startswith("blocks")} == {"0", "2"}
    assert {n.split(".")[1] for n in names[1] if n.startswith("blocks")} == {"1", "3"}
    assert {"head.weight", "tok_emb.weight"} <= set(names[0]) | set(names[1])
    assert "head.weight" in names[0] and "tok_emb.weight" in names[1]  # largest first, lightest fragment
    sizes = [plan.numel(p) for p in range(2)]
    assert sum(sizes) == sum(n for _, n in GPT) and max(sizes) / min(sizes) < 1.15  # greedy, largest first
    assert all(list(m) == sorted(m) for m in plan.members)  # canonical order inside a fragment


def test_the_plan_is_a_pure_function_of_the_parameter_list() -> None:
    assert FragmentPlan.strided(GPT, 3) == FragmentPlan.strided(list(GPT), 3)
    assert FragmentPlan.strided(GPT, 1).members == (tuple(range(len(GPT))),)


def test_gather_and_scatter_are_inverse_over_the_canonical_vector() -> None:
    plan = FragmentPlan.strided(GPT, 3)
    flat = torch.arange(sum(n for _, n in GPT), dtype=torch.float32)
    out = torch.full_like(flat, -1.0)
    for p in range(3):
        part = plan.gather(p, flat)
        assert part.numel() == plan.numel(p)
        plan.scatter(p, part, out)
    assert torch.equal(out, flat)


def test_more_fragments_than_the_model_fills_are_refused() -> None:
    with pytest.raises(ValueError, match=r"fragments \[2\] would be empty"):
        FragmentPlan.strided([("blocks.0.w", 4), ("head", 4)], 3)


def test_block_index_reads_the_first_number() -> None:
    assert block_index("blocks.12.attn.w") == 12 and block_index("layers.3") == 3
    assert block_index("tok_emb.weight") is None and block_index("w2v") is None


def test_schedule_staggers_fragments_and_bounds_the_overlap() -> None:
    s = Schedule(steps=8, fragments=4, overlap=1)
    assert [s.merge_step(p) for p in range(4)] == [2, 4, 6, 8]
    assert [s.push_step(p) for p in range(4)] == [1, 3, 5, 7]
    assert Schedule(steps=25, fragments=1, overlap=0).push_step(0) == 25
    with pytest.raises(ValueError, match="overlap_steps"):
        Schedule(steps=8, fragments=4, overlap=2)
    with pytest.raises(ValueError, match="fragments"):
        Schedule(steps=2, fragments=3, overlap=0)
