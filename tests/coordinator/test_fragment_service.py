"""Per-fragment rounds over gRPC: a real coordinator on loopback keeping one round controller per
fragment, with raw clients (routing, validation) and with the site's own outer loop over the
gRPC link (streaming, late fragments, catch-up); and the fragments' durable state."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
import torch
from torch import nn

from geodiloco.app.export import read_committed
from geodiloco.app.status import fetch_status
from geodiloco.compression import encode_chunks, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.coordinator.edge.server import RunningServer, run_until_stopped, start_server
from geodiloco.coordinator.fragment_rounds import PLAN_FILE, FragmentedController, fragment_dir, resumes
from geodiloco.coordinator.rundir import ROUND_LOG, STATE_FILE, ConfigDrift
from geodiloco.fragment_plan import FragmentPlan
from geodiloco.params import canonical_parameters, flatten_parameters, state_hash
from geodiloco.security.pki import PkiDir
from geodiloco.security.policy import ServerSecurity
from geodiloco.security.sealing import Keyring
from geodiloco.security.secrets import load_secret
from geodiloco.site.edge.client import OuterSyncClient, delta_messages
from geodiloco.site.edge.grpc_link import GrpcLink
from geodiloco.site.outer_sync import OuterSync
from geodiloco.testing.configs import streaming_config
from geodiloco.testing.local_runs import Blocks, global_snapshot
from geodiloco.testing.servers import PLAINTEXT
from geodiloco.v1 import outer_sync_pb2, outer_sync_pb2_grpc

pytestmark = pytest.mark.integration
T = TypeVar("T")
TOKENS = 100
SHARDS = [10_000, 10_000]  # the config's two data shards


def config(fragments: int = 2, overlap: int = 1, **overrides: object) -> RunConfig:
    return streaming_config(fragments, overlap, **overrides)


def fragmented(cfg: RunConfig, run_dir: Path | None = None) -> FragmentedController:
    model = Blocks()
    plan = FragmentPlan.of_model(model, cfg.outer.fragments)
    return FragmentedController.create(cfg, flatten_parameters(model), SHARDS, plan, run_dir)


class Server:
    """A real grpc.aio coordinator of a fragmented run, on a loopback port, in a thread."""

    def __init__(self, cfg: RunConfig, security: ServerSecurity = PLAINTEXT) -> None:
        self.cfg = cfg
        self.loop = asyncio.new_event_loop()
        self.run: FragmentedController | None = None
        self.running: RunningServer | None = None
        ready = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self.loop)

            async def serve() -> None:
                self.run = fragmented(cfg)
                self.running = await start_server(
                    self.run.primary, "127.0.0.1", 0, security=security, grace_s=0.5, fragments=self.run
                )
                ready.set()
                await run_until_stopped(self.running)

            self.loop.run_until_complete(serve())

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        assert ready.wait(30), "the coordinator did not start"

    @property
    def target(self) -> str:
        assert self.running is not None
        return f"127.0.0.1:{self.running.port}"

    @property
    def fragments(self) -> FragmentedController:
        assert self.run is not None
        return self.run

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.running is not None
        self.loop.call_soon_threadsafe(self.running.request_stop)
        self._thread.join(60)


def push(client: OuterSyncClient, fragment: int, round_: int, delta: torch.Tensor) -> list[Any]:
    codec = "q8|zstd:3"
    chunks, _ = encode_chunks(parse_pipeline(codec), delta, 1 << 20, round_=round_)
    return delta_messages(client.run_id, client.site, round_, codec, chunks, TOKENS, [], fragment=fragment)


def refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def test_join_answers_every_fragment_and_the_old_fields_are_the_last() -> None:
    with Server(config()) as server:
        client = OuterSyncClient(server.target, "site-a")
        info = client.join()
        run = server.fragments
        assert len(info.fragments) == 2
        for state, c in zip(info.fragments, run.fragments, strict=True):
            assert (state.round, state.state_hash, state.finished) == (0, c.hashes[0], False)
        assert info.fragments[0].state_hash != info.fragments[1].state_hash
        assert (info.round, info.state_hash) == (0, run.primary.hashes[0])  # what an old client reads
        assert info.num_params == run.num_params
        assert all(c.sites["site-a"].state == "joined" for c in run.fragments)  # joined every fragment
        client.close()


def test_a_fragment_out_of_range_is_invalid_argument_and_changes_nothing() -> None:
    with Server(config()) as server:
        client = OuterSyncClient(server.target, "site-a")
        client.join()
        stub = outer_sync_pb2_grpc.OuterSyncStub(client.channel)
        run = server.fragments
        thetas = [c.theta.clone() for c in run.fragments]
        delta = torch.zeros(run.plan.numel(0))
        for fragment in (2, 2**32 - 1):
            err = refused(lambda f=fragment: stub.PushDelta(iter(push(client, f, 0, delta)), timeout=10))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and f"fragment {fragment}" in err.details()
            pull = outer_sync_pb2.PullRequest(
                run_id=client.run_id, site="site-a", round=0, kind=1, fragment=fragment
            )
            err = refused(lambda p=pull: list(stub.PullUpdate(p, timeout=10)))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not exist" in err.details()
            err = refused(lambda f=fragment: client.report(0, "x", 0.0, 0, 0.0, 1, 0.0, fragment=f))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(c.round == 0 and not c.mean.contributors for c in run.fragments)
        assert all(torch.equal(c.theta, t) for c, t in zip(run.fragments, thetas, strict=True))
        assert all(not c.history for c in run.fragments)
        client.close()


def test_pushes_and_pulls_are_routed_to_their_fragment() -> None:
    """Each fragment commits on its own contributions; a pull names its fragment's round, hash
    and header; only the primary (last) fragment's pull carries the site's data."""
    with Server(config(min_sites=1, round_timeout_s=0.3)) as server:
        client = OuterSyncClient(server.target, "site-a")
        client.join()
        run = server.fragments
        delta = torch.full((run.plan.numel(0),), 1e-3)
        client.push(
            0,
            "q8|zstd:3",
            encode_chunks(parse_pipeline("q8|zstd:3"), delta, 1 << 20, round_=0)[0],
            TOKENS,
            [],
        )
        pulled = client.pull(0, fragment=0)
        assert (pulled.next_round, pulled.state_hash, pulled.data) == (1, run.fragments[0].hashes[1], [])
        assert run.fragments[0].round == 1 and run.primary.round == 0  # fragment 1 untouched
        assert run.fragments[0].history[0].contributors == ["site-a"]
        ok = client.report(0, pulled.state_hash, 0.0, 0, 0.0, TOKENS, 0.0, fragment=0).hash_ok
        assert ok and run.fragments[0].history[0].hash_reports == {"site-a": True}
        # the same hash reported for the other fragment's round does not match it
        assert refused(
            lambda: client.report(0, pulled.state_hash, 0.0, 0, 0.0, 1, 0.0, fragment=1)
        ).code() == (
            grpc.StatusCode.FAILED_PRECONDITION  # fragment 1's round 0 has not committed
        )
        state = client.pull(0, full_state=True, fragment=1)
        assert state.is_full_state and state.state_hash == run.primary.hashes[0]
        assert state.data == client.assigned and state.data  # the primary fragment: the ledger's data
        client.close()


def inner_step(model: nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for _, p in canonical_parameters(model):
            p.add_(torch.randn(p.shape, generator=gen) * 1e-2)


Hook = Callable[[OuterSync, int], None]


Links = Callable[[str, str], GrpcLink]


def train(
    target: str, name: str, out: dict[str, Any], hook: Hook | None = None, links: Links = GrpcLink
) -> None:
    sync = OuterSync.over(links(target, name))
    model = sync.attach(Blocks())
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    step = 0
    try:
        while not sync.finished:
            if hook is not None:
                hook(sync, step)
            inner_step(model, gen)
            if sync.step(tokens=TOKENS):
                sync.report(1.0, 1, 0.5, 0.01)
            step += 1
    finally:
        sync.close()
    out[name] = sync


def run_sites(
    server: Server, hooks: dict[str, Hook] | None = None, links: Links = GrpcLink
) -> dict[str, OuterSync]:
    out: dict[str, Any] = {}
    threads = [
        threading.Thread(target=train, args=(server.target, n, out, (hooks or {}).get(n), links))
        for n in server.cfg.sites
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == set(server.cfg.sites), "a site did not finish"
    return out


@pytest.mark.parametrize(("fragments", "overlap"), [(2, 1), (2, 0)])
def test_sites_stream_fragments_over_grpc_and_hashes_agree(fragments: int, overlap: int) -> None:
    cfg = config(fragments, overlap)
    with Server(cfg) as server:
        out = run_sites(server)
        run = server.fragments
        for c in run.fragments:
            assert len(c.history) == cfg.rounds
            assert all(h.contributors == ["site-a", "site-b"] for h in c.history)
            assert all(h.hashes_agree and len(h.hash_reports) == 2 for h in c.history)
        theta = server.call(_theta(run))
        for sync in out.values():
            assert torch.equal(global_snapshot(sync), theta)
        consumed = [row for h in run.primary.history for row in h.data]
        assert len(consumed) == len({tuple(row[1:]) for row in consumed}) > 0  # each window once


def test_sealed_fragments_over_mutual_tls_agree(tmp_path: Path) -> None:
    """Every fragment's chunks sealed (the fragment id in the associated data), over mTLS."""
    pki = PkiDir(tmp_path / "pki")
    pki.init()
    cfg = config(2, 1, rounds=2)
    keyring = Keyring(load_secret(pki.run_secret), cfg.run_id)
    security = ServerSecurity(tls=pki.issue_coordinator(["127.0.0.1", "localhost"]), keyring=keyring)
    sites = {name: pki.issue_site(name) for name in cfg.sites}

    def link(target: str, name: str) -> GrpcLink:
        files, secret = sites[name]
        return GrpcLink(target, name, tls=files, site_secret=load_secret(secret))

    with Server(cfg, security) as server:
        out = run_sites(server, links=link)
        run = server.fragments
        assert all(
            len(c.history) == cfg.rounds and all(h.hashes_agree for h in c.history) for c in run.fragments
        )
        theta = server.call(_theta(run))
        assert all(torch.equal(global_snapshot(s), theta) for s in out.values())


async def _theta(run: FragmentedController) -> torch.Tensor:
    return run.theta()


def test_a_late_fragment_is_dropped_counted_and_caught_up_over_grpc() -> None:
    """site-b stalls before its push of fragment 0 in round 1 until fragment 0 closed round 1
    without it: the push is late (FAILED_PRECONDITION, counted by fragment 0 alone), and site-b
    rejoins and catches up through the kept update; every replica ends bit-identical."""
    cfg = config(2, 1, rounds=4, min_sites=1, round_timeout_s=0.3, outer__max_staleness=0)  # dropped
    with Server(cfg) as server:
        run = server.fragments
        c0 = run.fragments[0]
        push_at = cfg.inner.steps_per_round + (cfg.inner.steps_per_round // 2 - 1) - 1

        def stall(sync: OuterSync, step: int) -> None:
            if step == push_at:
                deadline = time.monotonic() + 30
                while c0.round < 2:
                    assert time.monotonic() < deadline, "fragment 0 did not close without site-b"
                    time.sleep(0.01)

        out = run_sites(server, {"site-b": stall})
        assert c0.sites["site-b"].late == 1  # counted by its fragment
        assert run.late("site-b") >= 1
        status = {site.site: site for site in fetch_status(server.target, None).sites}
        assert status["site-b"].late == run.late("site-b") and status["site-b"].hash_ok  # every fragment's
        assert c0.history[1].contributors == ["site-a"]
        theta = server.call(_theta(run))
        assert all(torch.equal(global_snapshot(s), theta) for s in out.values())
        assert all(h.hashes_agree for c in run.fragments for h in c.history)


def commit_rounds(run: FragmentedController, rounds: int) -> None:
    async def go() -> None:
        for name in run.cfg.sites:
            await run.join(name, "", 1)
        for _ in range(rounds):
            for p, c in enumerate(run.fragments):
                r = c.round
                for i, name in enumerate(run.cfg.sites):
                    delta = torch.full((run.plan.numel(p),), 1e-3 * (i + 1 + p))
                    data = None if p < run.count - 1 else run.data_for(name)
                    await c.contribute(name, "", r, TOKENS, delta, data)
        await run.settle()

    asyncio.run(go())


def test_each_fragment_is_durable_in_its_own_directory_and_resumes_bit_exact(tmp_path: Path) -> None:
    cfg = config(snapshot_every=2)
    run = fragmented(cfg, tmp_path)
    assert not resumes(tmp_path)  # the plan marks a run to resume; written last
    asyncio.run(run.persist_start())
    assert resumes(tmp_path) and (tmp_path / PLAN_FILE).exists()
    commit_rounds(run, 3)
    for p in range(2):
        d = fragment_dir(tmp_path, p)
        assert (d / STATE_FILE).exists() and (d / ROUND_LOG).exists()
    assert not (tmp_path / STATE_FILE).exists() and not (tmp_path / ROUND_LOG).exists()
    again = FragmentedController.resume(cfg, None, tmp_path)  # as the server: the ledger from the state
    assert again.plan == run.plan
    for before, after in zip(run.fragments, again.fragments, strict=True):
        assert after.round == before.round == 3
        assert torch.equal(after.theta, before.theta) and after.hashes == before.hashes
    assert torch.equal(again.theta(), run.theta())
    assert again.primary.ledger.consumed == run.primary.ledger.consumed


def test_one_fragment_keeps_the_run_directory_layout(tmp_path: Path) -> None:
    cfg = config(fragments=1, overlap=0)
    run = fragmented(cfg, tmp_path)
    asyncio.run(run.persist_start())
    commit_rounds(run, 1)
    assert (tmp_path / STATE_FILE).exists() and (tmp_path / ROUND_LOG).exists()
    assert not (tmp_path / PLAN_FILE).exists() and not fragment_dir(tmp_path, 0).exists()


def test_a_resume_with_other_fragments_is_refused(tmp_path: Path) -> None:
    run = fragmented(config(), tmp_path)
    asyncio.run(run.persist_start())
    with pytest.raises(ConfigDrift, match=r"outer\.fragments: 2 when run"):
        FragmentedController.resume(config(fragments=4, overlap=0), SHARDS, tmp_path)
    one = tmp_path / "one"  # a run of one fragment is not resumed as fragments, nor the reverse
    asyncio.run(fragmented(config(fragments=1, overlap=0), one).persist_start())
    with pytest.raises(ConfigDrift, match=r"outer\.fragments: 1 when run"):
        fragmented(config(), one)


def test_export_assembles_a_streaming_runs_theta_from_every_fragment(tmp_path: Path) -> None:
    cfg = config(snapshot_every=2)
    run = fragmented(cfg, tmp_path)
    asyncio.run(run.persist_start())
    commit_rounds(run, 3)
    last = read_committed(tmp_path, cfg, None)
    assert last.round == 3 and torch.equal(last.theta, run.theta())
    assert last.state_hash == state_hash(run.theta())
    assert torch.equal(read_committed(tmp_path, cfg, None, round_=3).theta, last.theta)
    assert not torch.equal(last.theta, flatten_parameters(Blocks()))  # θ_0: three rounds were applied
