"""The round state machine: membership, contributions, commit, and the committed history.

Pure asyncio and tensors; the gRPC service in :mod:`.service` decodes requests and delegates
here. Round r starts from θ_r; once its contributions are in, the coordinator averages them,
asks the outer optimizer for a change, compresses the change (with error feedback), applies the
*decoded* change to θ_r and publishes it. Sites apply the same decoded bytes, so every replica
stays bit-identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from geodiloco import faults
from geodiloco.compression import EncodedChunk, ErrorFeedback, Place, parse_pipeline
from geodiloco.compression.frames import chunk_ranges
from geodiloco.config import RunConfig
from geodiloco.coordinator.aggregator import Contribution, TensorContribution, sum_of_squares
from geodiloco.coordinator.durable import STATE_FILE, CorruptStateError, StateError, load_state, save_state
from geodiloco.coordinator.grace import Arrival, GraceWindow
from geodiloco.coordinator.journal import JsonLines
from geodiloco.coordinator.ledger import DataLedger, LedgerExhausted
from geodiloco.coordinator.outer_optimizer import NesterovOuter, build_outer_optimizer
from geodiloco.coordinator.refusals import (
    ContributionMissing,
    FailedPrecondition,
    InvalidArgument,
    LateContribution,
    PermissionDenied,
)
from geodiloco.coordinator.replay import apply_update
from geodiloco.coordinator.reports import REPORT_LOG, HashReport, append_report, read_reports
from geodiloco.coordinator.robust import build_aggregate
from geodiloco.coordinator.rounds_pool import WORKERS
from geodiloco.coordinator.rundir import ROUND_LOG as ROUND_LOG
from geodiloco.coordinator.rundir import check_run_config
from geodiloco.coordinator.updatelog import (
    LoggedUpdate,
    UpdateBuffers,
    UpdateLogWriter,
    logged_rounds,
    prune,
    read_update,
)
from geodiloco.params import Checksum, add_encoded_and_hash, state_hash
from geodiloco.security.sealing import Sealer
from geodiloco.workload.data import DataRange, split_windows

log = logging.getLogger("geodiloco.coordinator")
T = TypeVar("T")

FULL_STATE_CODEC = "fp32|zstd:1"
KEEP_UPDATES = 4  # committed updates kept for sites that fall a round or two behind
KEEP_DIGESTS = 4  # closed rounds whose accepted pushes' digests are kept, to tell a retry


@dataclass(slots=True)
class SiteRecord:
    name: str
    shard_index: int
    state: str = "absent"  # absent, joined, left, lost
    last_seen: float = 0.0
    last_round: int = -1  # last round contributed to
    accepted: int = 0
    rejected: int = 0
    late: int = 0  # pushes dropped because their round had closed
    late_merged: int = 0  # pushes merged into a later round (outer.max_staleness)
    bytes_in: int = 0
    bytes_out: int = 0
    eval_loss: float = float("nan")
    train_loss: float = float("nan")
    tokens: int = 0
    hash_ok: bool = True
    last_report_round: int = -1
    world_size: int = 1


@dataclass(slots=True)
class CommittedUpdate:
    """The published change that takes θ_round to θ_{round+1}."""

    round: int
    codec: str
    chunks: list[EncodedChunk]
    state_hash: str  # of θ_{round+1}

    @property
    def payload_bytes(self) -> int:
        return sum(len(c.payload) for c in self.chunks)


@dataclass(slots=True)
class FullState:
    round: int
    codec: str
    chunks: list[EncodedChunk]
    state_hash: str


@dataclass(slots=True)
class RoundRecord:
    round: int
    contributors: list[str]
    tokens: int
    state_hash: str
    duration_s: float
    update_bytes: int
    data: list[list[Any]] = field(default_factory=list)  # [site, shard, start, end, epoch] consumed
    eval_loss_sum: float = 0.0
    eval_count: int = 0
    hash_reports: dict[str, bool] = field(default_factory=dict)
    late: list[list[Any]] = field(default_factory=list)  # [site, round trained, tokens, weight] merged
    # the ledger's held and returned windows after the commit (late merging), for a replay
    pending: dict[str, Any] | None = None
    # the arrival lags the grace window measured in this round: a restart measures on from them
    lags: list[float] | None = None
    # contributions the aggregation rule dropped (0) or scaled down (their factor): site or site@round
    set_aside: dict[str, float] = field(default_factory=dict)
    trained_s: float | None = None  # from the round's opening to its first contribution (the same)

    @property
    def eval_loss(self) -> float:
        return self.eval_loss_sum / self.eval_count if self.eval_count else float("nan")

    @property
    def hashes_agree(self) -> bool:
        return all(self.hash_reports.values())


class RoundController:
    """Owns θ, the outer optimizer and the run's membership; one per coordinator.

    With ``run_dir`` every commit is durable there (sealed with ``sealer`` when the run seals
    its payloads) and a restart resumes from it."""

    def __init__(
        self,
        cfg: RunConfig,
        initial: torch.Tensor | None,
        shard_sizes: list[int] | None,
        run_dir: Path | None = None,
        sealer: Sealer | None = None,
    ) -> None:
        """``initial`` is θ_0 and ``shard_sizes`` the data's; either may be None only when
        ``run_dir`` holds a snapshot to resume (it holds θ and the ledger)."""
        began = time.monotonic()
        self.cfg = cfg
        self.run_dir = run_dir
        self.sealer = sealer
        state = None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
            check_run_config(run_dir, cfg)  # before the state: a changed run_id is named as such
            state = load_state(run_dir / STATE_FILE, sealer)
        if (initial is None or shard_sizes is None) and state is None:
            raise StateError(f"no saved state in {run_dir} to resume, and no θ_0 or data given")
        theta = initial if initial is not None else state["theta"]  # type: ignore[index]
        self.ledger = (  # on a resume, restore() puts the snapshot's ledger in its place
            DataLedger.create(shard_sizes, cfg.sites)
            if shard_sizes is not None
            else DataLedger.from_state_dict(state["ledger"])  # type: ignore[index]
        )
        self.theta = theta if initial is None else theta.detach().to(torch.float32).clone()  # loaded: ours
        self.num_params = self.theta.numel()
        self.round = 0
        self.optimizer = build_outer_optimizer(cfg.outer)
        self.uplink = cfg.compression.uplink_pipeline
        self.downlink = cfg.compression.downlink_pipeline
        self.full_state_codec = parse_pipeline(FULL_STATE_CODEC)
        self.downlink_feedback = ErrorFeedback(self.num_params, cfg.compression.downlink_decay)
        self.sites = {name: SiteRecord(name, i) for i, name in enumerate(cfg.sites)}
        self.mean = build_aggregate(cfg.aggregation, self.num_params, run_dir)
        self.updates: dict[int, CommittedUpdate] = {}  # the latest; older ones are read from the log
        self.history: list[RoundRecord] = []
        self.hashes: dict[int, str] = {} if state is not None else {0: state_hash(self.theta)}
        self.theta_norm = math.sqrt(sum_of_squares(self.theta))
        self.round_opened = time.monotonic()
        by_time = cfg.inner.round_seconds > 0  # the grace window's bound is on by default
        self.grace = GraceWindow(cfg.grace, cfg.round_timeout_s, by_time)  # the deadline, from arrivals
        self.arrivals: list[Arrival] = []  # the open round's, in order
        self.firsts: dict[int, float] = {}  # recent rounds' first arrivals (deadlines, late lags)
        self.late_keys: dict[str, list[Any]] = {}  # the open round's late merges: key -> record
        self.late_data: list[list[Any]] = []  # and the windows they consumed
        self.trained: dict[str, list[DataRange]] = {}  # the open round's part-trained reservations
        self.merged_late: dict[tuple[str, int], int] = {}  # (site, round trained) -> merged into
        self.started = time.monotonic()
        self.unattributed_bytes = 0
        self._full_state: FullState | None = None
        self._changed = asyncio.Condition()
        self._commit_lock = asyncio.Lock()
        self._logged: int | None = None  # lines in the round log, once read
        self._round_tokens: dict[str, int] = {}
        self._set_aside: dict[str, float] = {}  # what the last close's rule dropped or scaled down
        self.push_digests: dict[tuple[str, int], tuple[bytes, ...]] = {}  # (site, round) -> per part
        self._transfers: dict[str, int] = {}  # push and pull streams in flight, per site
        self._broken: dict[str, float] = {}  # when a site's last stream broke (see suspect_s)
        self.disk_bytes = 0  # written by the last commit
        self.snapshot_round: int | None = None  # the round of the snapshot on disk
        if run_dir is not None:
            if state is not None:
                self.restore(state)
                self.snapshot_round = self.round
            loaded = time.monotonic()
            replayed = self._replay()
            if state is not None or replayed:
                log.info(
                    "resumed run %s at round %d (hash %s; snapshot of round %s read in %.2fs, "
                    "%d rounds replayed in %.2fs)",
                    self.cfg.run_id,
                    self.round,
                    self.hashes[self.round][:12],
                    self.snapshot_round,
                    loaded - began,
                    replayed,
                    time.monotonic() - loaded,
                )
            self._sync_round_log()
            for report in read_reports(run_dir / REPORT_LOG):
                self._apply_report(report)
            if self.finished:  # the run was over before this restart: its sites left, none is lost
                for record in self.sites.values():
                    if record.state == "joined":
                        record.state = "left"

    def _replay(self) -> int:
        """Apply the rounds logged after the snapshot, each checked against the hash chain;
        returns how many. The next round's file is read while this one is applied."""
        assert self.run_dir is not None
        run_dir, rounds = self.run_dir, [r for r in logged_rounds(self.run_dir) if r >= self.round]
        buffers = UpdateBuffers(2)  # the update applied and the one read ahead
        with ThreadPoolExecutor(1, thread_name_prefix="replay-read") as reader:
            ahead = [reader.submit(buffers.read, run_dir, r, self.sealer) for r in rounds[:1]]  # in flight
            for i, r in enumerate(rounds):
                update = ahead.pop().result()
                ahead += [reader.submit(buffers.read, run_dir, n, self.sealer) for n in rounds[i + 1 : i + 2]]
                self._replay_one(r, update)
        return len(rounds)

    def _replay_one(self, r: int, update: LoggedUpdate | None) -> None:
        if r != self.round or update is None:
            raise CorruptStateError(f"{self.run_dir}: round {self.round} is not logged, but round {r} is")
        if update.run_id != self.cfg.run_id:
            raise StateError(
                f"the state in {self.run_dir} belongs to run {update.run_id!r}, not {self.cfg.run_id!r}"
            )
        if update.base_hash != self.hashes[r]:
            raise CorruptStateError(f"{self.run_dir}: the update of round {r} does not start from θ_{r}")
        self._apply_logged(update)

    def _apply_logged(self, update: LoggedUpdate) -> None:
        r = update.round
        try:
            self.theta_norm = apply_update(self.theta, update)
        except CorruptStateError as exc:
            raise CorruptStateError(f"{self.run_dir}: {exc}") from None
        fields = {k: v for k, v in update.record.items() if k != "tokens_by_site"}
        record = RoundRecord(**fields)
        self.history.append(record)
        self.ledger.replay(r, record.data, record.pending)
        if record.lags is not None:
            self.grace.restore(record.lags, record.trained_s)
        for name, tokens in update.record.get("tokens_by_site", {}).items():
            if name in self.sites:
                site = self.sites[name]
                site.last_round, site.accepted, site.tokens = r, site.accepted + 1, site.tokens + tokens
        for name, trained, tokens, _ in record.late:
            self.merged_late[(name, trained)] = r
            if name in self.sites:
                site = self.sites[name]
                site.late_merged, site.tokens = site.late_merged + 1, site.tokens + tokens
        if isinstance(self.optimizer, NesterovOuter):
            self.optimizer.steps += 1  # the momentum itself resumes from the snapshot
        self.hashes[r + 1] = update.state_hash
        self.round = r + 1

    # -- membership -------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.round >= self.cfg.rounds

    def site(self, name: str) -> SiteRecord:
        record = self.sites.get(name)
        if record is None:
            raise PermissionDenied(f"site {name!r} is not part of run {self.cfg.run_id!r}")
        return record

    def check_run(self, run_id: str) -> None:
        if run_id and run_id != self.cfg.run_id:
            raise FailedPrecondition(
                f"run id {run_id!r} does not match this coordinator's run {self.cfg.run_id!r}"
            )

    def member(self, name: str, run_id: str) -> SiteRecord:
        """The record of a site that has joined this run; anything else is refused."""
        self.check_run(run_id)
        record = self.site(name)
        if record.state != "joined":
            raise FailedPrecondition(f"site {name!r} has not joined (state: {record.state}); call Join")
        record.last_seen = time.monotonic()
        return record

    @contextlib.contextmanager
    def transferring(self, name: str) -> Iterator[None]:
        """A push or pull stream of ``name`` in progress: the site is alive while it lasts.

        Heartbeats can queue behind a bulk transfer on a slow link (they share its connection),
        so a long pull must not cost the site its lease: the lease is renewed when the stream
        starts and ends, and :meth:`tick` does not expire a site with a stream in flight (a
        dead peer's stream is ended by the keepalive or ``limits.chunk_timeout_s``)."""
        record = self.sites.get(name)
        if record is None:
            yield
            return
        self._transfers[name] = self._transfers.get(name, 0) + 1
        record.last_seen = time.monotonic()
        broken = False
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            # the peer went away mid-stream (or its deadline passed): a push's task is cancelled,
            # a pull's generator closed where it waited to send
            broken = True
            raise
        finally:
            self._transfers[name] -= 1
            if not self._transfers[name]:
                del self._transfers[name]
            record.last_seen = time.monotonic()
            if broken:
                self._broken[name] = record.last_seen

    @property
    def suspect_s(self) -> float:
        """How long a site whose stream broke is waited for without a heartbeat: a few
        heartbeats, not a whole lease. A killed site's connection closes, and the healthy sites
        should not wait a lease for it; a live one heartbeats again within an interval."""
        return min(self.cfg.lease_s, 3 * self.cfg.heartbeat_interval_s)

    def _silent_for(self, record: SiteRecord, now: float) -> str | None:
        """Why a joined site is to be expired now, or None."""
        silent = now - record.last_seen
        if silent > self.cfg.lease_s:
            return f"no heartbeat for {silent:.1f}s"
        broken = self._broken.get(record.name)
        if broken is not None and record.last_seen <= broken and silent > self.suspect_s:
            return f"its stream broke and no heartbeat came for {silent:.1f}s since"
        return None

    async def join(self, name: str, run_id: str, world_size: int = 1) -> SiteRecord:
        """Admit a site; its declared ``world_size`` (0: one rank) must fit the limits and the
        data, else nothing changes and the refusal says why."""
        self.check_run(run_id)
        record = self.site(name)
        world = max(1, world_size)
        limit = self.cfg.limits.max_world_size
        if world > limit:
            raise InvalidArgument(f"world_size {world_size} exceeds limits.max_world_size {limit}")
        if not self.finished:
            windows = self.windows_for(world)
            others = {
                s.name: self.windows_per_round(s)
                for s in self.sites.values()
                if s.state == "joined" and s.name != name
            }
            try:
                if not self.ledger.can_feed({**others, name: windows}):
                    raise LedgerExhausted(f"the data holds {self.ledger.progress()[1]} windows")
                self.ledger.reserve(name, windows)
            except LedgerExhausted as exc:
                raise InvalidArgument(
                    f"world_size {world} needs {windows} data windows per round "
                    f"(inner.steps_per_round x world_size x data.batch_size), more than the data "
                    f"can feed every round next to the other sites' {sum(others.values())}: {exc}"
                ) from None
        record.state, record.last_seen, record.world_size = "joined", time.monotonic(), world
        log.info("site %s joined at round %d (shard %d)", name, self.round, record.shard_index)
        await self._notify()
        return record

    async def leave(self, name: str, run_id: str, reason: str) -> None:
        self.check_run(run_id)
        if self.site(name).state == "left":
            return  # a retried Leave changes nothing
        record = self.member(name, run_id)
        record.state = "left"
        self.ledger.release_site(name)
        log.info("site %s left: %s", name, reason or "no reason given")
        await self._maybe_close()

    def windows_per_round(self, record: SiteRecord) -> int:
        return self.windows_for(record.world_size)

    def windows_for(self, world_size: int) -> int:
        return self.cfg.inner.steps_per_round * world_size * self.cfg.data.batch_size

    def _reserve_next_round(self) -> None:
        """Reserve the live sites' windows for the round just opened. A site the data cannot
        feed any more gets none (it is refused when it pushes); the commit goes on."""
        for name in sorted(self.live_sites()):
            try:
                self.ledger.reserve(name, self.windows_per_round(self.sites[name]))
            except LedgerExhausted as exc:
                log.error("round %d: no data for site %s: %s", self.round, name, exc)

    def data_for(self, name: str) -> list[DataRange]:
        """The windows the site trains on in the current round (empty once the run is over)."""
        return self.ledger.reservation(name) or []

    def check_data(self, name: str, data: list[DataRange]) -> None:
        """A contribution must have trained on exactly the windows the ledger reserved for it
        (in a round by time, the first whole steps' worth of them: kept in ``trained``)."""
        expected = self.ledger.reservation(name)
        if expected is None:
            try:
                expected = self.ledger.reserve(name, self.windows_per_round(self.sites[name]))
            except LedgerExhausted as exc:
                raise FailedPrecondition(f"site {name!r} has no data reserved this round: {exc}") from None
        if not self._trained_part(name, data, expected):
            raise FailedPrecondition(
                f"site {name!r} trained on {_ranges(data)}, "
                f"but the ledger reserved {_ranges(expected)}; rejoin"
            )
        if data != expected:
            self.trained[name] = data

    def _trained_part(self, name: str, data: list[DataRange], reserved: list[DataRange]) -> bool:
        """``data`` is all of ``reserved``, or with ``inner.round_seconds`` the windows of its
        first n ≥ 1 steps (n × world_size × data.batch_size windows)."""
        if data == reserved:
            return True
        per_step = self.windows_for(self.sites[name].world_size) // self.cfg.inner.steps_per_round
        count = sum(d.windows for d in data)
        return (
            self.cfg.inner.round_seconds > 0
            and count > 0
            and count % per_step == 0
            and split_windows(reserved, count)[0] == data
        )

    def live_sites(self) -> set[str]:
        return {s.name for s in self.sites.values() if s.state == "joined"}

    # -- contributions ----------------------------------------------------------------------

    def check_push(self, name: str, run_id: str, round_: int) -> bool:
        """Validate a push before its payload is read. True when it is a duplicate."""
        self.member(name, run_id)
        if round_ < self.round - KEEP_DIGESTS:
            # its digests are gone: an acknowledgement could not say whether it was accepted
            raise FailedPrecondition(
                f"round {round_} closed more than {KEEP_DIGESTS} rounds ago and its pushes are no "
                f"longer kept, so a repeat cannot be told from another push; the current round is "
                f"{self.round}: pull the current state"
            )
        if round_ < self.round:
            if self._contributed(name, round_):
                return True  # a repeat of a push the round took
            if self._mergeable(name, round_):
                return False  # to be merged into the open round
            first, bound = self.firsts.get(round_), self.cfg.outer.max_staleness
            beyond = (
                ""
                if not bound
                else f"; it is more than outer.max_staleness ({bound}) rounds behind"
                if self.round - round_ > bound
                else "; no windows are held for it (an earlier push of it was merged late, or it was lost)"
            )
            raise LateContribution(
                f"round {round_} is closed; the current round is {self.round}{beyond}",
                None if first is None else time.monotonic() - first,
            )
        if self.finished:
            raise FailedPrecondition(f"run {self.cfg.run_id!r} has finished; nothing to push")
        if round_ == self.round:
            return name in self.mean.contributors
        raise FailedPrecondition(f"round {round_} is not open yet; the current round is {self.round}")

    def _contributed(self, name: str, round_: int) -> bool:
        """Whether ``name``'s contribution is in closed round ``round_`` (its record, kept
        for every round and across restarts)."""
        record = self.history[round_] if 0 <= round_ < len(self.history) else None
        if (name, round_) in self.merged_late:
            return True
        if record is None or record.round != round_:
            return self.sites[name].last_round >= round_  # no record of that round: as before
        return name in record.contributors

    def _mergeable(self, name: str, round_: int) -> bool:
        """Whether a late push of ``name`` for closed ``round_`` is merged into the open round:
        within ``outer.max_staleness`` rounds, and its windows still held for it."""
        stale = self.round - round_
        return (
            not self.finished
            and 0 < stale <= self.cfg.outer.max_staleness
            and self.ledger.held_for(name, round_) is not None
        )

    async def contribute(
        self,
        name: str,
        run_id: str,
        round_: int,
        tokens: int,
        delta: torch.Tensor | Contribution,
        data: list[DataRange] | None = None,
        digest: tuple[bytes, ...] | None = None,
    ) -> bool:
        """Fold one site's whole pseudo-gradient into the round. False for an idempotent duplicate.

        ``delta`` is a decoded vector (tests, tools) or a staged contribution (pushes), whose
        values were checked as they were decoded. ``data`` is what it trained on; None means
        what the ledger reserved. ``digest`` (of each part as pushed) is kept for the current
        and ``KEEP_DIGESTS`` closed rounds, so that only an identical repeat is a duplicate."""
        if not 0 < tokens <= self.cfg.limits.max_tokens:
            raise InvalidArgument(f"tokens must be in [1, {self.cfg.limits.max_tokens}] (limits.max_tokens)")
        if isinstance(delta, torch.Tensor):
            if delta.shape != (self.num_params,) or delta.dtype != torch.float32:
                raise InvalidArgument(
                    f"pseudo-gradient has shape {tuple(delta.shape)} and dtype {delta.dtype}, "
                    f"expected ({self.num_params},) float32"
                )
            delta = TensorContribution(delta)
        self._check_values(delta)
        async with self._commit_lock:
            if self.check_push(name, run_id, round_):
                return False
            if round_ < self.round:
                await self._merge_late(name, round_, tokens, delta, data, digest)
                return True
            trained = self.data_for(name) if data is None else data
            self.check_data(name, trained)
            tokens = self._ledger_weight(name, round_, tokens, trained)
            await asyncio.to_thread(self.mean.fold, name, delta, tokens)
            now = time.monotonic()
            first = self.firsts.setdefault(round_, now)
            self.arrivals.append(Arrival(name, now - first))
            record = self.sites[name]
            record.last_round, record.accepted = round_, record.accepted + 1
            record.tokens += tokens
            if digest is not None:
                self.push_digests[(name, round_)] = digest
            log.info("round %d: accepted %s (%d tokens)", round_, name, tokens)
        await self._maybe_close()
        return True

    async def _merge_late(
        self,
        name: str,
        round_: int,
        tokens: int,
        delta: Contribution,
        data: list[DataRange] | None,
        digest: tuple[bytes, ...] | None,
    ) -> None:
        """Fold a late push into the open round with weight ``tokens // (1 + staleness)``; the
        windows it trained, held since its round closed, become consumed in this round."""
        held = self.ledger.held_for(name, round_)
        if data is not None and (held is None or not self._trained_part(name, data, held)):
            raise FailedPrecondition(
                f"site {name!r} trained round {round_} on {_ranges(data)}, "
                f"but the ledger reserved {_ranges(held or [])}; rejoin"
            )
        stale = self.round - round_
        tokens = self._ledger_weight(name, round_, tokens, held if data is None else data)
        weight = max(1, tokens // (1 + stale))
        key = f"{name}@{round_}"
        await asyncio.to_thread(self.mean.fold, key, delta, weight)
        self.late_keys[key] = [name, round_, tokens, weight]
        self.merged_late[(name, round_)] = self.round
        for d in self.ledger.consume_held(self.round, name, round_, data):
            self.late_data.append([name, d.shard, d.start, d.end, d.epoch])
        first = self.firsts.get(round_)
        if first is not None:
            self.grace.late(name, time.monotonic() - first)
        record = self.sites[name]
        record.late_merged, record.tokens = record.late_merged + 1, record.tokens + tokens
        if digest is not None:
            self.push_digests[(name, round_)] = digest
        log.info(
            "round %d: merged %s's push of round %d (%d tokens, weight %d, %d rounds stale)",
            self.round,
            name,
            round_,
            tokens,
            weight,
            stale,
        )

    def _ledger_weight(self, name: str, round_: int, claimed: int, trained: list[DataRange] | None) -> int:
        """What a contribution weighs: the tokens of the windows the ledger handed the site and it
        trained (``data.tokens_per_item`` each), or its claim where that is less. A larger claim
        is capped, not refused: refusing would throw away the windows it trained, and capping
        leaves nothing to gain by inflating."""
        given = sum(d.windows for d in trained or []) * self.cfg.item_tokens
        if claimed <= given:
            return claimed
        log.warning(
            "round %d: %s claims %d tokens, the ledger gave it %d for what it trained: weighed %d",
            round_,
            name,
            claimed,
            given,
            given,
        )
        return max(1, given)

    def accepted_digest(self, name: str, round_: int) -> tuple[bytes, ...] | None:
        """The part digests of ``name``'s accepted push for ``round_``; None when not kept
        (pushed through :meth:`contribute` without one, too old, or before a restart)."""
        return self.push_digests.get((name, round_))

    def _check_values(self, delta: Contribution | torch.Tensor) -> None:
        """Refuse NaN/Inf and norms no honest site produces (a poisoning or a broken site)."""
        sumsq = (TensorContribution(delta) if isinstance(delta, torch.Tensor) else delta).sumsq
        if not math.isfinite(sumsq):
            raise InvalidArgument("pseudo-gradient contains NaN or Inf")
        ratio = self.cfg.limits.max_delta_norm_ratio
        norm = math.sqrt(sumsq)
        if ratio and norm > ratio * self.theta_norm:
            raise InvalidArgument(
                f"pseudo-gradient norm {norm:.4g} exceeds limits.max_delta_norm_ratio {ratio} "
                f"x the parameter norm {self.theta_norm:.4g}"
            )

    def record_rejection(self, name: str, reason: Exception) -> None:
        """Count a refused push: late (its round had closed) or rejected (anything else)."""
        record = self.sites.get(name)
        if record is None:
            return
        if isinstance(reason, LateContribution):
            record.late += 1
            if reason.after_s is not None:  # the grace window was too short for it: measured
                self.grace.late(name, reason.after_s)
            log.info("round %d: dropped a late contribution from %s", self.round, name)
        else:
            record.rejected += 1

    # -- closing a round --------------------------------------------------------------------

    def _ready_to_close(self, now: float) -> bool:
        """Quorum, and everyone waited for in or the deadline passed. The run's first round waits
        for every site in ``sites``, joined or not: at start-up the first site to join would
        otherwise commit rounds alone, at the default quorum, before the others have joined."""
        contributed = set(self.mean.contributors) - set(self.late_keys)
        if self.finished or len(contributed) < self.cfg.quorum:
            return False
        waited_for = self.live_sites() - self.grace.stragglers if self.history else set(self.sites)
        return waited_for <= contributed or self.overdue(now)

    def overdue(self, now: float) -> bool:
        """Past the round's deadline: the grace window (``round_timeout_s``, or measured with
        ``grace.adaptive``) after its first contribution arrived.

        Counting from the first arrival (not the round's start) means slow starts, e.g. sites
        still importing at round 0, do not count against the stragglers."""
        first = self.first_contribution
        return first is not None and now - first >= self.grace.window_s

    @property
    def first_contribution(self) -> float | None:
        """When the open round's first contribution arrived (its deadline counts from there)."""
        return self.firsts.get(self.round)

    @property
    def waiting_for(self) -> list[str]:
        """The live sites the open round still waits for."""
        waited = self.live_sites() - self.grace.stragglers if self.history else set(self.sites)
        return sorted(waited - set(self.mean.contributors))  # late merges are keyed site@round

    async def _maybe_close(self) -> None:
        async with self._commit_lock:
            if self._ready_to_close(time.monotonic()):
                await self._commit()

    async def _commit(self) -> None:
        """Close the round: compute (in a worker thread), make it durable, and only then publish it."""
        r, mean = self.round, self.mean
        started = time.monotonic()
        contributors = sorted(c for c in mean.contributors if c not in self.late_keys)
        late = [self.late_keys[k] for k in sorted(self.late_keys)]
        tokens = sum(mean.tokens[c] for c in contributors) + sum(item[2] for item in late)  # trained
        self._round_tokens = {c: mean.tokens[c] for c in contributors}
        kept = 1 if self.run_dir is not None else KEEP_UPDATES  # with a run directory: in the log
        # The older updates leave memory before the next is computed (a pull still sending one
        # holds its own reference), freed in a worker: a model-sized free is not the loop's work.
        dropped = [self.updates.pop(k) for k in [k for k in self.updates if k <= r - kept]]
        await asyncio.to_thread(dropped.clear)
        log_file = await self._on_disk(r, self._open_update_log, r)
        try:
            await self._close_round(r, started, contributors, tokens, log_file, late)
        finally:
            if log_file is not None:
                log_file.abort()  # a commit that did not finish leaves no file; none once committed

    async def _close_round(
        self,
        r: int,
        started: float,
        contributors: list[str],
        tokens: int,
        log_file: UpdateLogWriter | None,
        late: list[list[Any]],
    ) -> None:
        update = await self._on_disk(r, self._advance, r, log_file)
        computed = time.monotonic()
        digest = update.state_hash
        self.updates[r] = update
        self.hashes[r + 1] = digest
        consumed = self.late_data + [
            [site, d.shard, d.start, d.end, d.epoch]
            for site in contributors
            for d in self.trained.get(site, self.data_for(site))
        ]
        staleness = self.cfg.outer.max_staleness
        # with late merging, a live site that missed the round may still push what it trained
        self.ledger.settle(
            r, set(contributors), hold=self.live_sites() if staleness else None, trained=self.trained
        )
        record = RoundRecord(
            round=r,
            contributors=contributors,
            tokens=tokens,
            state_hash=digest,
            duration_s=started - self.round_opened,
            update_bytes=update.payload_bytes,
            data=consumed,
            late=late,
            set_aside=self._set_aside,
        )
        if record.set_aside:
            log.warning(
                "round %d: aggregation.rule %s set aside %s (0: dropped, else scaled by)",
                r,
                self.cfg.aggregation.rule,
                record.set_aside,
            )
        self.history.append(record)
        self.round += 1
        self.late_keys, self.late_data, self.trained = {}, [], {}
        self.ledger.expire_held(self.round - staleness)  # too stale to merge: the windows go back
        by_time = self.cfg.inner.round_seconds > 0  # returns what a round by time did not train
        record.pending = self.ledger.pending_state() if staleness or by_time else None
        for key in [k for k, merged in self.merged_late.items() if merged < self.round - KEEP_DIGESTS]:
            del self.merged_late[key]
        for key in [k for k in self.push_digests if k[1] < self.round - KEEP_DIGESTS]:
            del self.push_digests[key]
        if not self.finished:
            self._reserve_next_round()
        first = self.firsts.get(r)  # the first round's opening is the start-up: not training
        trained = first - self.round_opened if first is not None and r > 0 else None
        record.trained_s = None if trained is None else round(trained, 4)
        missing = self.live_sites() - set(contributors) - self.grace.stragglers
        open_s = started - first if first is not None else 0.0
        self.round_opened = time.monotonic()
        self.grace.closed(self.arrivals, self.cfg.quorum, trained, missing, open_s)
        record.lags = [round(lag, 4) for lag in self.grace.rounds[-1]]
        self.arrivals = []
        for old in [k for k in self.firsts if k < self.round - KEEP_DIGESTS]:
            del self.firsts[old]
        self._full_state = None
        faults.at_commit(r)  # tests: a fault plan's kill or raise, advanced in memory, not yet durable
        await self._persist(log_file)
        log.info(
            "round %d committed: %s, %d tokens, update %d bytes, hash %s (outer step %.2fs, durable %.2fs)",
            r,
            ",".join(record.contributors),
            record.tokens,
            record.update_bytes,
            digest[:12],
            computed - started,
            time.monotonic() - computed,
        )
        await self._notify()

    def _open_update_log(self, round_: int) -> UpdateLogWriter | None:
        return None if self.run_dir is None else UpdateLogWriter(self.run_dir, round_, self.sealer)

    async def _on_disk(self, round_: int, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` in a worker thread. Crash-only: if the disk fails, the process exits
        and a restart resumes from the last durable round."""
        try:
            return await asyncio.to_thread(work, *args)
        except OSError:
            log.critical("cannot commit round %d to %s; exiting", round_, self.run_dir, exc_info=True)
            os._exit(70)

    def _advance(self, round_: int, log_file: UpdateLogWriter | None) -> CommittedUpdate:
        """θ_round → θ_{round+1} (worker thread), chunk by chunk and in place, chunks in parallel,
        every step on a chunk while it is in cache: average, outer step and downlink residual in
        one pass (:meth:`~OuterOptimizer.send_step`), encode, then apply the change as every site
        decodes it (from the codes, q8 values never written out), keep what the encoding dropped,
        and hash and measure the new θ in another (:func:`~geodiloco.params.add_encoded_and_hash`).
        A round costs a few passes over the model. Each encoded chunk goes to the round's log
        file as it comes, in order: the disk writes while the next chunks are computed."""
        feedback, total = self.downlink_feedback, self.mean.total
        self.mean.ready()
        send_step = self.optimizer.send_step(total, self.mean.divisor, feedback.residual, feedback.decay)

        def one(span: tuple[int, int]) -> tuple[EncodedChunk, Checksum, float]:
            start, numel = span
            self.mean.prepare(start, numel)  # a robust rule's aggregate of the span, into total
            send = send_step(total[start : start + numel], start)  # in the residual's span
            place = Place.span(round_, start, numel)
            payload, raw = self.downlink.roundtrip_raw(send, place)
            theta = self.theta[start : start + numel]
            checksum, sumsq = add_encoded_and_hash(
                self.downlink, raw, place, theta, residual=send
            )  # send keeps what was dropped
            return EncodedChunk(start, numel, payload), checksum, sumsq

        done = []
        for result in WORKERS.map(one, chunk_ranges(self.num_params, self.cfg.compression.chunk_elements)):
            if log_file is not None:
                log_file.add(result[0])
            done.append(result)
        self._set_aside = self.mean.set_aside()
        self.mean.reset()
        checksum = Checksum()
        for _, part, _ in done:
            checksum = checksum.merge(part)
        self.theta_norm = math.sqrt(sum(s for _, _, s in done))
        return CommittedUpdate(round_, self.downlink.spec, [c for c, _, _ in done], checksum.hexdigest())

    async def _persist(self, log_file: UpdateLogWriter | None) -> None:
        """Commit the round's log file (its compressed update, written by :meth:`_advance`, and
        now its record), and every ``snapshot_every`` rounds the whole state, then the round log."""
        if self.run_dir is None or log_file is None:
            return
        r = self.round - 1
        update, record = self.updates[r], self.history[-1]
        logged = LoggedUpdate(
            self.cfg.run_id,
            r,
            update.codec,
            self.hashes[r],
            update.state_hash,
            update.chunks,
            {**dataclasses.asdict(record), "tokens_by_site": self._round_tokens},
        )
        due = self.round % self.cfg.snapshot_every == 0 or self.finished
        snapshot = self.snapshot() if due else None  # the small parts, read on the loop
        await self._on_disk(r, self._write_commit, log_file, logged, snapshot)

    def _write_commit(
        self, log_file: UpdateLogWriter, logged: LoggedUpdate, snapshot: dict[str, Any] | None
    ) -> None:
        assert self.run_dir is not None
        self.disk_bytes = log_file.commit(logged)
        if snapshot is not None:
            self.disk_bytes += self._write_snapshot(snapshot)
        assert self.snapshot_round is None or self.snapshot_round <= self.round
        floor = min(self.round - KEEP_UPDATES, self.snapshot_round if self.snapshot_round is not None else 0)
        prune(self.run_dir, floor)
        self._sync_round_log()  # here too, not on the event loop: an append can wait on the disk

    def _write_snapshot(self, snapshot: dict[str, Any]) -> int:
        assert self.run_dir is not None
        path = self.run_dir / STATE_FILE
        save_state(path, snapshot, self.sealer)
        self.snapshot_round = int(snapshot["round"])
        return path.stat().st_size

    async def checkpoint(self) -> None:
        """Snapshot the whole state now unless the snapshot on disk is current (graceful stop),
        so the next start replays nothing and resumes the outer momentum exactly."""
        if self.run_dir is None:
            return
        async with self._commit_lock:
            if self.snapshot_round == self.round:
                return
            await asyncio.to_thread(self._write_snapshot, self.snapshot())

    async def kept_update(self, round_: int) -> CommittedUpdate | None:
        """The committed update closing ``round_``, from memory or the update log; None when
        it is no longer kept."""
        update = self.updates.get(round_)
        if update is not None or self.run_dir is None or round_ < self.round - KEEP_UPDATES:
            return update
        logged = await asyncio.to_thread(read_update, self.run_dir, round_, self.sealer)
        if logged is None:
            return None
        return CommittedUpdate(logged.round, logged.codec, logged.chunks, logged.state_hash)

    def _sync_round_log(self) -> None:
        """Append the committed rounds the log does not have yet (one line each, in order)."""
        assert self.run_dir is not None
        journal = JsonLines(self.run_dir / ROUND_LOG, durable=False)  # rewritten from the history
        if self._logged is None:  # read once per process, not at every commit
            self._logged = len(journal.open())
        journal.append(*(self._round_line(record) for record in self.history[self._logged :]))
        self._logged = len(self.history)

    def _round_line(self, record: RoundRecord) -> dict[str, Any]:
        return {
            "round": record.round,
            "contributors": record.contributors,
            "tokens": record.tokens,
            "base_hash": self.hashes[record.round],  # θ it started from: the log chains
            "state_hash": record.state_hash,
            "update_bytes": record.update_bytes,
            "duration_s": round(record.duration_s, 3),
            "data": record.data,
            "late": record.late,
            "pending": record.pending,
            "set_aside": record.set_aside,
        }

    def snapshot(self) -> dict[str, Any]:
        """Everything a restarted coordinator needs to resume after the last committed round."""
        return {
            "version": 1,
            "run_id": self.cfg.run_id,
            "round": self.round,
            "theta": self.theta,  # written while the commit lock keeps it still
            "optimizer": self.optimizer.state_dict(),
            "downlink_residual": self.downlink_feedback.residual,
            "hashes": dict(self.hashes),
            "sites": {name: _site_state(s) for name, s in self.sites.items()},
            "history": [dataclasses.asdict(h) for h in self.history],
            "ledger": self.ledger.state_dict(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        if state["run_id"] != self.cfg.run_id:
            raise StateError(
                f"the state in {self.run_dir} belongs to run {state['run_id']!r}, not {self.cfg.run_id!r}"
            )
        theta = state["theta"]
        if theta.numel() != self.num_params:
            raise StateError(f"the saved state has {theta.numel()} parameters, the model {self.num_params}")
        self.theta = theta
        self.theta_norm = math.sqrt(sum_of_squares(self.theta))
        self.round = int(state["round"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.downlink_feedback.load_state_dict({"residual": state["downlink_residual"]})
        self.hashes = {int(k): v for k, v in state["hashes"].items()}
        self.history = [RoundRecord(**h) for h in state["history"]]
        for h in self.history[-self.cfg.grace.rounds :]:  # the grace window as it was, not the bound
            if h.lags is not None:
                self.grace.restore(h.lags, h.trained_s)
        for h in self.history[-KEEP_DIGESTS:]:  # to tell a merged push's retry from a late push
            for name, trained, _, _ in h.late:
                self.merged_late[(name, trained)] = h.round
        self.ledger = DataLedger.from_state_dict(state["ledger"])
        now = time.monotonic()
        for name, saved in state["sites"].items():
            if name in self.sites:
                for key, value in saved.items():
                    setattr(self.sites[name], key, value)
                self.sites[name].last_seen = now  # a fresh lease after the restart

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def tick(self) -> None:
        """Expire leases and close rounds past their deadline; called periodically."""
        now = time.monotonic()
        for record in self.sites.values():
            if record.name in self._transfers:
                record.last_seen = now  # a stream in flight is a heartbeat
            elif record.state == "joined" and (why := self._silent_for(record, now)) is not None:
                record.state = "lost"
                self._broken.pop(record.name, None)
                self.ledger.release_site(record.name)
                log.warning("site %s lost: %s", record.name, why)
        await self._maybe_close()

    # -- updates and state for the sites ----------------------------------------------------

    async def wait_for_update(self, round_: int, name: str) -> CommittedUpdate | None:
        """The committed update closing ``round_``; None when it is no longer kept.

        Waiting for an open round the site has no contribution in would never end if the
        contribution was lost (a coordinator restart drops uncommitted ones): say so instead.
        """
        if round_ >= self.cfg.rounds:
            raise FailedPrecondition(f"round {round_} is past the run's last round {self.cfg.rounds - 1}")
        if round_ == self.round and name not in self.mean.contributors:
            raise ContributionMissing(f"site {name!r} has no contribution in open round {round_}; push it")
        async with self._changed:
            await self._changed.wait_for(lambda: self.round > round_)
        await self.settle()  # the round counter moves before the commit is durable: wait for that
        return await self.kept_update(round_)

    def full_state(self) -> FullState:
        """θ at the current round, lossless; cached until the next commit."""
        if self._full_state is None or self._full_state.round != self.round:
            codec, chunks = self.full_state_codec, []
            for start, numel in chunk_ranges(self.num_params, self.cfg.compression.chunk_elements):
                values = self.theta[start : start + numel]
                chunks.append(
                    EncodedChunk(start, numel, codec.encode(values, Place.span(self.round, start, numel)))
                )
            self._full_state = FullState(self.round, FULL_STATE_CODEC, chunks, self.hashes[self.round])
        return self._full_state

    async def serve_full_state(self) -> FullState:
        """:meth:`full_state` once no commit is in progress, encoded off the event loop."""
        async with self._commit_lock:
            return await asyncio.to_thread(self.full_state)

    async def report(
        self,
        name: str,
        run_id: str,
        round_: int,
        digest: str,
        eval_loss_sum: float,
        eval_count: int,
        train_loss: float,
    ) -> tuple[bool, str]:
        """A site's parameter hash and metrics after applying the update that closed ``round_``.

        Durable before it is answered: it arrives after the round's snapshot was written."""
        self.member(name, run_id)
        expected = self.hashes.get(round_ + 1)
        if expected is None:
            raise FailedPrecondition(f"round {round_} has not been committed")
        ok = digest == expected
        if not ok:
            log.error(
                "site %s diverged after round %d: hash %s, expected %s",
                name,
                round_,
                digest[:12],
                expected[:12],
            )
        report = HashReport(round_, name, ok, eval_loss_sum, eval_count, train_loss)
        if self._apply_report(report) and self.run_dir is not None:
            try:
                await asyncio.to_thread(append_report, self.run_dir / REPORT_LOG, report)
            except OSError:  # metrics only: the run goes on; the next commit persists it anyway
                log.error("cannot persist the report of %s for round %d", name, round_, exc_info=True)
        return ok, expected

    def _apply_report(self, report: HashReport) -> bool:
        """Record a report; False when the round already had this site's report."""
        if not 0 <= report.round < len(self.history):
            log.warning("ignoring a report of %s for uncommitted round %d", report.site, report.round)
            return False
        record = self.sites.get(report.site)
        if record is not None and report.round >= record.last_report_round:
            record.hash_ok = report.hash_ok
            record.last_report_round = report.round
            record.train_loss = report.train_loss
            if report.eval_count:
                record.eval_loss = report.eval_loss_sum / report.eval_count
        history = self.history[report.round]  # committed rounds are contiguous from 0
        if report.site in history.hash_reports:
            return False
        history.hash_reports[report.site] = report.hash_ok
        history.eval_loss_sum += report.eval_loss_sum
        history.eval_count += report.eval_count
        return True

    # -- accounting -------------------------------------------------------------------------

    def count_bytes(self, name: str | None, received: int = 0, sent: int = 0) -> None:
        record = self.sites.get(name) if name else None
        if record is None:
            self.unattributed_bytes += received + sent
            return
        record.bytes_in += received
        record.bytes_out += sent

    @property
    def phase(self) -> str:
        if self.finished:
            return "finished"
        if not self.history and self.live_sites() != set(self.sites):
            return "waiting_for_sites"
        if self.overdue(time.monotonic()) and len(self.mean.contributors) < self.cfg.quorum:
            return "waiting_for_quorum"  # past the deadline, but too few contributions to commit
        return "training"

    async def settle(self) -> None:
        """Wait until a commit in progress is durable and published (graceful shutdown)."""
        async with self._commit_lock:
            pass

    def all_sites_done(self) -> bool:
        return self.finished and all(s.state != "joined" for s in self.sites.values())


_SITE_FIELDS_SAVED = (
    "state",
    "last_round",
    "accepted",
    "rejected",
    "late",
    "late_merged",
    "bytes_in",
    "bytes_out",
    "eval_loss",
    "train_loss",
    "tokens",
    "hash_ok",
    "world_size",
    "last_report_round",
)


def _site_state(record: SiteRecord) -> dict[str, Any]:
    return {key: getattr(record, key) for key in _SITE_FIELDS_SAVED}


def _ranges(data: list[DataRange]) -> str:
    return ", ".join(f"shard {d.shard}[{d.start}:{d.end}]" for d in data) or "nothing"
