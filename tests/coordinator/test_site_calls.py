"""The coordinator's answers to a site's calls, on plain values and without a server: who is
admitted, what a heartbeat, a report and a pull get, and what each refuses before anything changes."""

from __future__ import annotations

import math

import pytest
import torch

from geodiloco.coordinator.fragment_rounds import FragmentedController
from geodiloco.coordinator.intake import Pushes
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.refusals import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from geodiloco.coordinator.round_metrics import CoordinatorMetrics
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.site_calls import JoinCall, PullCall, ReportCall, SiteCalls
from geodiloco.exchange import PullShare, RoundReport
from geodiloco.security.joinproof import join_proof
from geodiloco.security.sealing import Keyring
from geodiloco.security.secrets import site_secret
from geodiloco.testing.configs import tiny_config

N = 1000
SECRET = b"r" * 32


def calls(keyring: Keyring | None = None, **overrides: object) -> tuple[SiteCalls, RoundController]:
    cfg = tiny_config(**{"round_timeout_s": 60.0, "limits__max_delta_norm_ratio": 0.0, **overrides})
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards)
    run = FragmentedController.single(c)
    journal = Journal(None)
    return SiteCalls(run, keyring, Pushes(run, keyring, CoordinatorMetrics(c), journal), journal), c


async def test_join_answers_the_run_and_every_fragment() -> None:
    s, c = calls()
    info = await s.join(JoinCall("site-b", "", 1))
    assert (info.run_id, info.round, info.num_params, info.shard_count) == (c.cfg.run_id, 0, N, 2)
    assert info.state_hash == c.hashes[0] and info.fragment_states[0].state_hash == c.hashes[0]
    assert info.data == c.data_for("site-b") and info.key_id == 0
    assert c.sites["site-b"].state == "joined"


async def test_join_checks_the_site_then_its_proof_then_the_run() -> None:
    keyring = Keyring(SECRET, "test-run")
    s, c = calls(keyring)
    with pytest.raises(PermissionDenied, match="not part of run"):
        await s.join(JoinCall("intruder", "other-run", 1))
    with pytest.raises(Unauthenticated, match="must prove its secret"):
        await s.join(JoinCall("site-a", "other-run", 1))
    with pytest.raises(Unauthenticated, match="does not hold its secret"):
        await s.join(JoinCall("site-a", "test-run", 1, join_proof(b"w" * 32, "test-run", "site-a", 1)))
    assert all(r.state != "joined" for r in c.sites.values())  # nothing admitted so far
    secret = site_secret(SECRET, "site-a")
    info = await s.join(JoinCall("site-a", "test-run", 1, join_proof(secret, "test-run", "site-a", 1)))
    assert info.key_id == keyring.site("site-a").up.key_id and c.sites["site-a"].state == "joined"


async def test_a_site_with_a_secret_is_told_the_run_does_not_seal() -> None:
    s, c = calls()
    with pytest.raises(FailedPrecondition, match="does not seal payloads"):
        await s.join(JoinCall("site-a", "", 1, b"proof"))
    assert c.sites["site-a"].state != "joined"


async def test_a_heartbeat_renews_the_lease_and_says_where_the_run_is() -> None:
    s, c = calls()
    await s.join(JoinCall("site-a", "", 1))
    lease = s.heartbeat("site-a", "")
    assert (lease.round, lease.lease_s, lease.finished) == (0, c.cfg.lease_s, False)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"eval_count": 1, "eval_loss_sum": math.nan}, "eval_loss_sum must be finite"),
        ({"tokens": 2**41}, "exceeds limits.max_tokens"),
        ({"eval_count": -1}, "exceeds limits.max_tokens"),
        ({"fragment": 2}, "fragment 2 does not exist"),
    ],
)
async def test_a_report_out_of_bounds_is_refused(change: dict[str, object], words: str) -> None:
    s, c = calls()
    await s.join(JoinCall("site-a", "", 1))
    fields: dict[str, object] = {
        "fragment": 0,
        "round": 0,
        "state_hash": c.hashes[0],
        "eval_loss_sum": 1.0,
        "eval_count": 1,
        "train_loss": 0.5,
        "tokens": 10,
        "compute_seconds": 0.1,
        **change,
    }
    with pytest.raises(InvalidArgument, match=words):
        await s.report(ReportCall("site-a", "", RoundReport(**fields)))  # type: ignore[arg-type]


async def test_a_pull_of_the_state_serves_this_pullers_share_and_names_its_data() -> None:
    s, c = calls(compression__chunk_elements=300)
    await s.join(JoinCall("site-a", "", 1))
    served = await s.pull(PullCall("site-a", "", PullShare(0, 0, full_state=True, part=1, parts=2)))
    assert served.full_state and served.round == served.next_round == 0
    assert served.total_chunks == 4 and [seq for seq, _ in served.mine] == [1, 3]
    assert served.state_hash == c.hashes[0] and served.data == c.data_for("site-a")
    many = await s.pull(PullCall("site-a", "", PullShare(0, 0, full_state=True, part=7, parts=8)))
    assert [(seq, chunk.numel) for seq, chunk in many.mine] == [(4, 0)]  # the stream's facts only
    with pytest.raises(InvalidArgument, match="part 2 of 2 is out of range"):
        await s.pull(PullCall("site-a", "", PullShare(0, 0, full_state=True, part=2, parts=2)))
