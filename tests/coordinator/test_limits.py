"""Every count a site declares is bounded by a named limit and refused before anything changes."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from geodiloco.compression import encode_chunks, parse_pipeline
from geodiloco.config import DataConfig, InnerConfig, LimitsConfig, RunConfig
from geodiloco.coordinator.edge.server import data_shard_sizes
from geodiloco.coordinator.refusals import InvalidArgument
from geodiloco.coordinator.rounds import RoundController
from geodiloco.exchange import WireChunk
from geodiloco.segment import Segment
from geodiloco.site.edge.client import OuterSyncClient, delta_messages
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import outer_sync_pb2, outer_sync_pb2_grpc

CODEC = "q8|zstd:3"


@pytest.fixture(scope="module")
def default_shards() -> list[int]:
    return data_shard_sizes(RunConfig())


@pytest.mark.parametrize("world", [64, 150, 300, 1000])
async def test_declared_worlds_are_fed_every_round_or_refused_at_join(
    default_shards: list[int], world: int
) -> None:
    """The default config: a world the data can feed next to the other site trains round after
    round (it used to crash the coordinator at a commit); a larger one is refused at Join with
    the reason, before the site counts as joined or the ledger moves."""
    cfg = RunConfig(round_timeout_s=0.1, limits=LimitsConfig(max_delta_norm_ratio=0.0))
    c = RoundController(cfg, torch.zeros(100), default_shards)
    await c.join("site-2", "", world_size=1)
    feedable = c.ledger.can_feed({"site-2": c.windows_for(1), "site-1": c.windows_for(world)})
    assert feedable == (world <= 150)  # 60,024 windows; 200 per rank and round
    if not feedable:
        ledger = c.ledger.state_dict()
        with pytest.raises(InvalidArgument, match=f"world_size {world} needs"):
            await c.join("site-1", "", world_size=world)
        assert c.sites["site-1"].state == "absent" and c.ledger.state_dict() == ledger
        world = 1
    await c.join("site-1", "", world_size=world)
    for r in range(6):
        for name in cfg.sites:
            await c.contribute(name, "", r, 100, torch.full((100,), 1e-3))
        await c.tick()
    assert c.round == 6 and c.data_for("site-1") and c.data_for("site-2")


async def test_world_size_over_the_limit_is_refused() -> None:
    cfg = tiny_config(limits__max_world_size=8)
    c = RoundController(cfg, torch.zeros(10), [1000] * cfg.data.shards)
    with pytest.raises(InvalidArgument, match=r"limits\.max_world_size 8"):
        await c.join("site-a", "", world_size=9)
    assert c.sites["site-a"].state == "absent" and not c.ledger.reservations


def test_join_of_a_world_too_large_is_invalid_argument_over_grpc(default_shards: list[int]) -> None:
    with CoordinatorThread(RunConfig(), initial=torch.zeros(100)) as coordinator:
        client = OuterSyncClient(coordinator.target, "site-1")
        with pytest.raises(grpc.RpcError) as err:
            client.join(world_size=300)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "world_size 300 needs" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:  # not a member: the refused Join left no trace
            client.heartbeat(0)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        client.close()


def limited_config(**overrides: Any) -> RunConfig:
    limits = {
        "limits__max_tokens": 1000,
        "limits__max_parts": 4,
        "limits__max_chunks_per_part": 8,
        "limits__max_data_ranges": 2,
    }
    return tiny_config(min_sites=1, round_timeout_s=2.0, **{**limits, **overrides})


def test_every_declared_count_is_refused_with_the_limit_named() -> None:
    with CoordinatorThread(limited_config(sites=["site-a"])) as coordinator:
        n = coordinator.controller.num_params
        a = OuterSyncClient(coordinator.target, "site-a")
        a.join()
        stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
        chunks, _ = encode_chunks(parse_pipeline(CODEC), torch.randn(n) * 1e-3, n // 4 + 1, round_=0)

        def push(tokens: int = 10, parts: int = 1, data: Any = a.assigned, pieces: Any = chunks) -> list[Any]:
            return delta_messages(a.run_id, a.site, 0, CODEC, pieces, tokens, data, 0, parts)

        many_ranges = [*a.assigned] * 3
        tiny = [WireChunk(Segment(i, 1, 1, 1), b"") for i in range(9)]
        cases = {
            "limits.max_tokens": push(tokens=1001),
            "limits.max_parts": push(parts=5),
            "limits.max_data_ranges": push(data=many_ranges),
            "limits.max_chunks_per_part": push(pieces=tiny),
        }
        for limit, msgs in cases.items():
            with pytest.raises(grpc.RpcError) as err:
                stub.PushDelta(iter(msgs), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, limit
            assert limit in err.value.details(), limit
        pull = outer_sync_pb2.PullRequest(
            run_id=a.run_id, site=a.site, round=0, kind=outer_sync_pb2.PullRequest.UPDATE, part=0, parts=5
        )
        with pytest.raises(grpc.RpcError) as err:
            list(stub.PullUpdate(pull, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limits.max_parts" in err.value.details()
        report = outer_sync_pb2.ReportRequest(run_id=a.run_id, site=a.site, round=0, eval_count=1001)
        with pytest.raises(grpc.RpcError) as err:
            stub.Report(report, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "limits.max_tokens" in err.value.details()
        c = coordinator.controller
        assert c.round == 0 and not c.mean.contributors and c.sites["site-a"].rejected == 4
        stub.PushDelta(iter(push()), timeout=10)  # the honest push after them all is accepted
        assert c.history[0].contributors == ["site-a"]
        a.close()


def test_a_site_of_4096_ranks_pushes_one_part_per_rank() -> None:
    parts = 4096
    cfg = tiny_config(
        sites=["site-a"],
        min_sites=1,
        round_timeout_s=60.0,
        inner__steps_per_round=1,
        data__batch_size=1,
        data__max_bytes=600_000,
    )
    with CoordinatorThread(cfg) as coordinator:
        c = coordinator.controller
        n = c.num_params
        assert n >= parts
        clients = [OuterSyncClient(coordinator.target, "site-a") for _ in range(8)]
        info = clients[0].join(world_size=parts)
        for client in clients[1:]:
            client.adopt(info.run_id, info.key_id)
            client.assigned = clients[0].assigned
        delta = torch.randn(n) * 1e-3
        bounds = torch.linspace(0, n, parts + 1).round().long().tolist()
        codec = parse_pipeline(CODEC)

        def push(part: int) -> Any:
            start, end = bounds[part], bounds[part + 1]
            payload = codec.encode(delta[start:end])
            chunk = WireChunk(Segment(start, 1, end - start, end - start), payload)
            return clients[part % 8].push(0, CODEC, [chunk], tokens=100, part=part, parts=parts)

        began = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            acks = list(pool.map(push, range(parts)))
        assert not any(ack.duplicate for ack in acks)
        assert c.history[0].contributors == ["site-a"] and c.sites["site-a"].accepted == 1
        assert c.sites["site-a"].world_size == parts
        assert time.monotonic() - began < 120
        for client in clients:
            client.close()


def test_limits_are_validated_by_name() -> None:
    with pytest.raises(ValueError, match=r"limits\.max_parts"):
        tiny_config(limits__max_parts=0)


async def test_as_many_one_rank_sites_as_shards_are_all_admitted() -> None:
    sites = [f"site-{i}" for i in range(8)]
    cfg = RunConfig(
        sites=sites, data=DataConfig(shards=8, batch_size=1), inner=InnerConfig(steps_per_round=1)
    )
    c = RoundController(cfg, torch.zeros(10), [568] * 8)
    for name in sites:
        await c.join(name, "")
    assert c.live_sites() == set(sites)
