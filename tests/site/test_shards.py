"""Where a rank's local pieces lie in the canonical vector, and who owns what, for every layout.

The layouts run for real: two (or four) gloo processes (pooled across tests: tests/rank_pool.py)
apply DDP-style replication, FSDP2 or tensor parallelism to the reference model and report what
their ShardMap says.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from geodiloco.compression import Place, encode_chunks, parse_pipeline
from geodiloco.params import Checksum, flatten_parameters, state_hash
from geodiloco.segment import Segment
from geodiloco.site.parallel.layout import ParallelConfig, build_mesh, parallelize
from geodiloco.site.shards import ShardMap, subview
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import free_port
from geodiloco.workload import GPTConfig, build_model

MODEL = GPTConfig(n_layer=1, n_head=2, d_model=16, seq_len=8)


def test_segment_views_and_splits_cover_its_elements() -> None:
    flat = torch.arange(100, dtype=torch.float32)
    seg = Segment(start=3, rows=4, row_len=5, stride=10)
    assert seg.view_of(flat).tolist() == [
        [3, 4, 5, 6, 7],
        [13, 14, 15, 16, 17],
        [23, 24, 25, 26, 27],
        [33, 34, 35, 36, 37],
    ]
    assert seg.positions().tolist() == seg.view_of(flat).reshape(-1).tolist()
    for limit in (1, 3, 5, 11, 100):
        seen = []
        for offset, sub in seg.split_rows(limit):
            assert sub.numel <= limit
            part = subview(seg.view_of(flat), seg, offset, sub)
            assert part.reshape(-1).tolist() == sub.positions().tolist()
            seen += sub.positions().tolist()
        assert seen == seg.positions().tolist()


@pytest.mark.parametrize("world", [1, 2, 3])
def test_replicated_parameters_are_owned_once_across_ranks(world: int) -> None:
    model = build_model(MODEL, seed=0)
    owned: list[int] = []
    for rank in range(world):
        shards = ShardMap(model, rank, world)
        assert shards.local_numel == shards.num_params  # every rank holds all of a plain model
        for o in shards.owned:
            owned += o.segment.positions().tolist()
    assert sorted(owned) == list(range(shards.num_params))


def test_scattering_the_canonical_vector_rebuilds_the_pieces() -> None:
    model = build_model(MODEL, seed=0)
    flat = flatten_parameters(model)
    shards = ShardMap(model)
    targets = [torch.zeros_like(p.local) for p in shards.pieces]
    written = sum(shards.scatter_range(a, flat[a : a + 37], targets) for a in range(0, flat.numel(), 37))
    assert written == flat.numel()
    assert all(torch.equal(t, p.local) for t, p in zip(targets, shards.pieces, strict=True))


def _added_as_pulled(shards: ShardMap) -> tuple[bool, bool | None]:
    """An update's chunks added from their encoding (:meth:`ShardMap.add_encoded_range`): whether
    the pieces then hold what decoding and scattering gives, and whether the checksums taken on
    the way are those of the pieces' elements (None when a chunk fell in rows of a matrix)."""
    codec = parse_pipeline("q8|zstd:1")
    chunks, _ = encode_chunks(codec, torch.randn(shards.num_params) * 1e-2, 500, round_=2)
    added = [torch.zeros_like(p.local) for p in shards.pieces]
    expected = [torch.zeros_like(p.local) for p in shards.pieces]
    checksum: Checksum | None = Checksum()
    for c in chunks:
        place = Place.span(2, c.start, c.numel)
        _, part = shards.add_encoded_range(codec, c.payload, place, added)
        shards.scatter_range(c.start, codec.decode(c.payload, c.numel, place), expected, add=True)
        checksum = None if checksum is None or part is None else checksum.merge(part)
    same = all(torch.equal(a, e) for a, e in zip(added, expected, strict=True))
    if checksum is None:
        return same, None
    reference = Checksum()
    for piece, values in zip(shards.pieces, expected, strict=True):
        reference.add(piece.segment.positions(), values)
    return same, checksum.hexdigest() == reference.hexdigest()


def _rank_main(rank: int, world: int, port: int, layout: str, precision: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(MODEL, seed=0)
        flat = flatten_parameters(model)
        config = ParallelConfig.parse(layout, world, precision)
        trained = parallelize(model, config, build_mesh(config))
        x = torch.randint(0, 256, (2, MODEL.seq_len))
        loss = trained(x, x)  # the layout trains (bf16 compute under FSDP2's policy)
        loss.backward()
        shards = ShardMap(model, rank, world)
        targets = [torch.zeros_like(p.local) for p in shards.pieces]
        written = sum(
            shards.scatter_range(a, flat[a : a + 500], targets) for a in range(0, flat.numel(), 500)
        )
        added, hashed = _added_as_pulled(shards)
        out.put(
            {
                "rank": rank,
                "owned": [p for o in shards.owned for p in o.segment.positions().tolist()],
                "local": shards.local_numel,
                "num_params": shards.num_params,
                "rebuilt": written == shards.local_numel
                and all(torch.equal(t, p.local) for t, p in zip(targets, shards.pieces, strict=True)),
                "owned_values": shards.gather_owned().tolist(),
                "added": added,
                "hashed": hashed,
                "hash": state_hash(flat),
                "loss": float(loss),
            }
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("layout", "precision", "world"),
    [
        ("ddp", "fp32", 2),
        ("fsdp", "bf16", 2),
        ("tp", "fp32", 2),
        ("ddp", "bf16", 2),
        ("hsdp", "bf16", 4),
        ("fsdp+tp", "bf16", 4),  # FSDP2 over TP: a strided shard of the TP-split rows
    ],
)
def test_each_layout_owns_every_element_exactly_once(
    rank_pool: RankPool, layout: str, precision: str, world: int
) -> None:
    port = free_port()
    ranks = [(r, world, port, layout, precision) for r in range(world)]
    results = sorted(rank_pool.run(_rank_main, ranks, timeout=120), key=lambda r: r["rank"])
    n = results[0]["num_params"]
    owned = [i for r in results for i in r["owned"]]
    assert sorted(owned) == list(range(n))  # disjoint, and together everything
    assert all(
        r["rebuilt"] and math.isfinite(r["loss"]) for r in results
    )  # each rank's pieces sit where the layout says
    flat = flatten_parameters(build_model(MODEL, seed=0))
    for r in results:
        assert r["owned_values"] == flat[r["owned"]].tolist()
        assert r["added"] and r["hashed"] is not False  # added as decoded; hashed right where hashed
    if layout in ("ddp", "fsdp"):  # whole rows or whole parameters: every chunk is hashed as added
        assert all(r["hashed"] for r in results)
    if layout != "ddp":  # sharded layouts hold less than the model on each rank
        assert all(r["local"] < n for r in results)
