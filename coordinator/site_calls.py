"""What the coordinator answers a site's calls, on plain values: join, heartbeat, report, leave
and what a pull serves. A push is :class:`~geodiloco.coordinator.intake.Pushes`' alone.

The gRPC servicer (:mod:`geodiloco.coordinator.edge.service`) translates each request into
these calls and their answers back into messages; the in-process link of the tests
(:mod:`geodiloco.testing.local_link`) calls the same, so both transports decide alike. Every
refusal is a domain error (:mod:`~geodiloco.coordinator.refusals`), raised before anything
changes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

from geodiloco import __version__
from geodiloco.compression import EncodedChunk
from geodiloco.coordinator.fragment_rounds import FragmentedController
from geodiloco.coordinator.intake import Pushes
from geodiloco.coordinator.journal import Journal
from geodiloco.coordinator.refusals import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unauthenticated,
)
from geodiloco.coordinator.rounds import CommittedUpdate, RoundController
from geodiloco.exchange import FragmentState, JoinInfo, PullShare, RoundReport, Served
from geodiloco.security.sealing import Keyring

log = logging.getLogger("geodiloco.coordinator")

PULL_GRACE_S = 300.0  # a pull waits for its round's commit at most the round's timeout plus this


@dataclass(frozen=True, slots=True)
class JoinCall:
    site: str
    run_id: str
    world_size: int
    key_proof: bytes = b""
    version: str = ""


@dataclass(frozen=True, slots=True)
class Lease:
    """A heartbeat's answer: the run's round, how long a lease lasts, whether the run is over."""

    round: int
    lease_s: float
    finished: bool


@dataclass(frozen=True, slots=True)
class ReportCall:
    site: str
    run_id: str
    report: RoundReport


@dataclass(frozen=True, slots=True)
class PullCall:
    site: str
    run_id: str
    share: PullShare


def _finite_or_zero(x: float) -> float:
    return x if math.isfinite(x) else 0.0


class SiteCalls:
    """The run's answers to its sites' calls (every fragment's rounds, one ledger)."""

    def __init__(self, run: FragmentedController, keyring: Keyring | None, pushes: Pushes, journal: Journal):
        self.run = run
        self.c = run.primary
        self.keyring = keyring
        self.pushes = pushes
        self.journal = journal

    def check_key_proof(self, call: JoinCall) -> None:
        """A sealing run admits only a site that proves it holds its secret: one with a wrong
        secret would otherwise be a member, waited for, that cannot seal a chunk."""
        if self.keyring is None:
            if call.key_proof:
                raise FailedPrecondition(
                    "this run does not seal payloads (the coordinator runs --insecure): "
                    "a site with a secret refuses to send them in the clear; drop its --secret"
                )
            return
        if not call.key_proof:
            raise Unauthenticated(
                f"this run seals payloads: site {call.site!r} must prove its secret at Join "
                "(give it --secret site-<name>.secret)"
            )
        if not self.keyring.proves_key(call.site, call.key_proof, call.run_id, call.world_size):
            raise Unauthenticated(
                f"site {call.site!r} does not hold its secret for this run (its --secret belongs "
                "to another run secret or another site); it is not admitted"
            )

    async def join(self, call: JoinCall) -> JoinInfo:
        """Admit (or readmit) a site: who it is, then its proof, then the run it names."""
        self.c.site(call.site)  # a site outside the run is told that first
        self.check_key_proof(call)
        record = await self.run.join(call.site, call.run_id, call.world_size)
        self.pushes.forget_site(call.site)  # a rejoined site pushes its rounds afresh
        if call.version and call.version != __version__:
            log.warning(
                "site %s sent version %r, this coordinator is geodiloco %s (docs/protocol.md: a "
                "site that is not this package sends an empty version)",
                call.site,
                call.version,
                __version__,
            )
        return JoinInfo(
            run_id=self.c.cfg.run_id,
            run_config_json=self.c.cfg.to_json(),
            round=self.c.round,
            state_hash=self.c.hashes[self.c.round],
            shard_index=record.shard_index,
            shard_count=len(self.c.sites),
            num_params=self.run.num_params,
            heartbeat_interval_s=self.c.cfg.heartbeat_interval_s,
            finished=self.run.finished,
            data=self.c.data_for(call.site),
            key_id=self.keyring.site(call.site).key_id if self.keyring is not None else 0,
            fragments=tuple(
                FragmentState(c.round, c.hashes[c.round], c.finished) for c in self.run.fragments
            ),
        )

    def heartbeat(self, site: str, run_id: str) -> Lease:
        self.run.member(site, run_id)
        return Lease(self.c.round, self.c.cfg.lease_s, self.run.finished)

    async def report(self, call: ReportCall) -> tuple[bool, str]:
        """A site's hash of a fragment after a round, and its metrics: (hash agrees, expected)."""
        r = call.report
        c = self.run.fragment(r.fragment)
        if r.eval_count and not math.isfinite(r.eval_loss_sum):
            raise InvalidArgument("eval_loss_sum must be finite")
        limit = self.c.cfg.limits.max_tokens
        if not 0 <= r.eval_count <= limit or not 0 <= r.tokens <= limit:
            raise InvalidArgument(f"eval_count or tokens exceeds limits.max_tokens {limit}")
        train_loss = _finite_or_zero(r.train_loss)
        answer = await c.report(
            call.site, call.run_id, r.round, r.state_hash, r.eval_loss_sum, r.eval_count, train_loss
        )
        self.journal.write(
            "report",
            site=call.site,
            round=r.round,
            **({"fragment": r.fragment} if self.run.count > 1 else {}),
            eval_loss_sum=r.eval_loss_sum,
            eval_count=r.eval_count,
            train_loss=train_loss,
            tokens=r.tokens,
            compute_s=_finite_or_zero(r.compute_seconds),
        )
        return answer

    async def leave(self, site: str, run_id: str, reason: str) -> None:
        await self.run.leave(site, run_id, reason)

    async def pull(self, call: PullCall) -> Served:
        """What a pull streams: the update closing ``share.round`` once it commits (the current
        full state when that update is no longer kept), or the fragment's current full state."""
        share = call.share
        c = self.run.fragment(share.fragment)
        c.member(call.site, call.run_id)
        limit = self.c.cfg.limits.max_parts
        if not 0 <= share.part < max(share.parts, 1) <= limit:
            raise InvalidArgument(
                f"part {share.part} of {share.parts} is out of range (limits.max_parts {limit})"
            )
        update = None if share.full_state else await self._wait_for_update(c, share.round, call.site)
        if update is not None:
            chunks, codec, digest = update.chunks, update.codec, update.state_hash
            full_state, round_, next_round = False, update.round, update.round + 1
        else:
            state = await c.serve_full_state()  # never one a commit has not made durable
            chunks, codec, digest = state.chunks, state.codec, state.state_hash
            full_state, round_, next_round = True, state.round, state.round
        parts = share.parts or 1
        mine = [(seq, chunk) for seq, chunk in enumerate(chunks) if seq % parts == share.part]
        if not mine:  # more pullers than chunks: this one gets the stream's facts, no payload
            mine = [(len(chunks), EncodedChunk(0, 0, b""))]
        settles = self.run.settles_data(share.fragment)
        return Served(
            full_state,
            codec,
            round_,
            next_round,
            digest,
            len(chunks),
            next_round >= self.c.cfg.rounds,
            mine,
            self.c.data_for(call.site) if settles else [],
        )

    async def _wait_for_update(self, c: RoundController, round_: int, site: str) -> CommittedUpdate | None:
        """The server's own bound on a pull's wait, whatever deadline the client set."""
        limit = c.cfg.round_timeout_s + PULL_GRACE_S
        try:
            return await asyncio.wait_for(c.wait_for_update(round_, site), limit)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"round {round_} did not commit within {limit:.0f}s; pull again") from None

    def pulled(self, call: PullCall, served: Served, t0: float, t_ready: float, t1: float, sent: int) -> None:
        """The journal's line for one pull stream, once it ended."""
        self.journal.write(
            "pull",
            site=call.site,
            round=served.round,
            **({"fragment": call.share.fragment} if self.run.count > 1 else {}),
            kind="full_state" if served.full_state else "update",
            t0=t0,
            t_ready=t_ready,
            t1=t1,
            bytes=sent,
        )
