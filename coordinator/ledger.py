"""The data ledger: which window ranges of which data shard each site trains on, per round.

The training text is cut into many shards, each a sequence of windows. Every site owns some
shards and consumes them front to back. For each round the coordinator *reserves* the next
windows for every live site; when the round commits, the reservations of the sites whose
contribution was accepted become *consumed*, and the others are released (the cursor stays,
so the same windows are handed out again). A lost site's shards go back to the pool, from which
any site that runs short takes the next one. So across committed rounds every window is trained
on exactly once per epoch, whatever sites die, stall or come back.

Late merging (``outer.max_staleness``): a live site whose round closed without it may still be
pushing what it trained, so its reservation is *held* (the cursor moves past it, nobody else
gets it) rather than released; it becomes consumed in the round its late push is merged into,
or, when that push never comes within the bound (or the site is lost), its windows are
*returned*: the next reservations of any site take them first.
"""

from __future__ import annotations

from dataclasses import asdict, astuple, dataclass, field
from typing import Any

from geodiloco.workload.data import DataRange, split_windows


class LedgerExhausted(ValueError):
    """The free shards cannot hold a site's windows for one round next to the other sites'."""


@dataclass(slots=True)
class ShardState:
    size: int  # windows
    consumed: int = 0  # committed cursor within the current epoch
    epoch: int = 0
    owner: str | None = None


@dataclass(frozen=True, slots=True)
class ConsumedRecord:
    round: int
    site: str
    range: DataRange


@dataclass(slots=True)
class DataLedger:
    shards: list[ShardState]
    reservations: dict[str, list[DataRange]] = field(default_factory=dict)
    consumed: list[ConsumedRecord] = field(default_factory=list)
    held: dict[tuple[str, int], list[DataRange]] = field(default_factory=dict)  # (site, round)
    returned: list[DataRange] = field(default_factory=list)  # behind the cursors, handed out first
    reissued: set[DataRange] = field(default_factory=set)  # taken from `returned`, not settled yet

    @classmethod
    def create(cls, shard_sizes: list[int], sites: list[str]) -> DataLedger:
        """Shard i starts owned by site i mod S."""
        if not shard_sizes or min(shard_sizes) <= 0:
            raise ValueError("every data shard needs at least one window")
        shards = [ShardState(size, owner=sites[i % len(sites)]) for i, size in enumerate(shard_sizes)]
        return cls(shards)

    def reservation(self, site: str) -> list[DataRange] | None:
        return self.reservations.get(site)

    def reserve(self, site: str, windows: int) -> list[DataRange]:
        """The site's windows for its next round (the same answer until the round is settled).

        All or nothing: when the free shards cannot hold ``windows``, nothing changes and
        :class:`LedgerExhausted` says so (a site declaring more ranks than the data can feed)."""
        if site in self.reservations:
            return self.reservations[site]
        saved = [(s.consumed, s.epoch, s.owner) for s in self.shards]
        try:
            ranges = self._take(site, windows)
        except LedgerExhausted:
            for shard, (consumed, epoch, owner) in zip(self.shards, saved, strict=True):
                shard.consumed, shard.epoch, shard.owner = consumed, epoch, owner
            raise
        self.reservations[site] = ranges
        return ranges

    def _take(self, site: str, windows: int) -> list[DataRange]:
        ranges: list[DataRange] = []
        while windows > 0 and self.returned:  # returned windows first: they are behind the cursors
            r = self.returned.pop(0)
            take = min(windows, r.end - r.start)
            if r.start + take < r.end:
                self.returned.insert(0, DataRange(r.shard, r.start + take, r.end, r.epoch))
            piece = DataRange(r.shard, r.start, r.start + take, r.epoch)
            self.reissued.add(piece)
            ranges.append(piece)
            windows -= take
        while windows > 0:
            index, start, stop, epoch = self._next_shard(site, ranges)
            shard = self.shards[index]
            take = min(windows, stop - start)
            ranges.append(DataRange(index, start, start + take, epoch))
            windows -= take
            if start + take == shard.size:
                shard.owner = None  # fully reserved: the next round continues elsewhere
        return ranges

    def _next_shard(self, site: str, ranges: list[DataRange]) -> tuple[int, int, int, int]:
        """Where the site's next windows are (shard, first window, window to stop before, epoch):
        a shard it owns with windows left, else one from the pool, else its own shard's next
        epoch, else another site's, else the next epoch of a used-up one."""
        # returned windows are behind their shard's cursor: they overlap nothing ahead of it
        mine = {r.shard for r in ranges if r not in self.reissued}
        reserved = mine | {
            r.shard for held in self.reservations.values() for r in held if r not in self.reissued
        }
        for want_owner in (site, None):
            for i, shard in enumerate(self.shards):
                if shard.owner == want_owner and shard.consumed < shard.size and i not in reserved:
                    shard.owner = site
                    return i, shard.consumed, shard.size, shard.epoch
        # the shard this reservation just used up continues into its next epoch. Without this,
        # a site whose shard runs dry mid-round takes another live site's shard, and with as
        # many shards as sites the last of them finds none (issue 16: `data.shards == sites`).
        # It stops where this reservation began in the shard: no window twice in one round.
        if ranges and ranges[-1].end == self.shards[ranges[-1].shard].size:
            last = ranges[-1]
            began = next(r.start for r in ranges if r.shard == last.shard)
            if began > 0:
                self.shards[last.shard].owner = site
                return last.shard, 0, began, last.epoch + 1
        # a large site can outrun its own shards: continue another site's, rather than start an
        # epoch early (cursors only move forward, so every window is still consumed once)
        for i, shard in enumerate(self.shards):
            if shard.consumed < shard.size and i not in reserved:
                shard.owner = site
                return i, shard.consumed, shard.size, shard.epoch
        # every shard is used up (or reserved): start the next pass over the least-recent one
        candidates = [i for i, s in enumerate(self.shards) if s.consumed == s.size and i not in reserved]
        if not candidates:
            raise LedgerExhausted(
                f"no data shard is free ({len(self.shards)} shards, {self.progress()[1]} windows, "
                f"{len(self.reservations)} other sites holding reservations)"
            )
        index = min(candidates, key=lambda i: (self.shards[i].epoch, i))
        shard = self.shards[index]
        shard.consumed, shard.epoch, shard.owner = 0, shard.epoch + 1, site
        return index, 0, shard.size, shard.epoch

    def settle(
        self,
        round_: int,
        contributors: set[str],
        hold: set[str] | None = None,
        trained: dict[str, list[DataRange]] | None = None,
    ) -> None:
        """At commit: contributors' reservations become consumed (only the part in ``trained``,
        where a round by time trained less: the rest goes back); those of the sites in ``hold``
        (live, and possibly still pushing late) are held; the others are released."""
        for site, ranges in self.reservations.items():
            if site in contributors or site in (hold or set()):
                for r in ranges:  # in order: a range in a shard's next epoch comes last
                    self._advance(r)
                if site in contributors:
                    used, rest = split_windows(ranges, _count((trained or {}).get(site, ranges)))
                    self.consumed += [ConsumedRecord(round_, site, r) for r in used]
                    self._give_back(rest)
                else:
                    self.held[(site, round_)] = list(ranges)
                continue
            for r in ranges:
                if r in self.reissued:
                    self._give_back([r])
                    continue
                shard = self.shards[r.shard]
                if shard.owner is None and shard.consumed == r.start and shard.epoch == r.epoch:
                    shard.owner = site  # its shard was handed off as full; take it back
        self.reservations.clear()

    def _advance(self, r: DataRange) -> None:
        """A settled range moves its shard's cursor past it (a returned one is behind it)."""
        if r in self.reissued:
            self.reissued.discard(r)
            return
        shard = self.shards[r.shard]
        shard.consumed, shard.epoch = r.end, r.epoch

    def _give_back(self, ranges: list[DataRange]) -> None:
        for r in ranges:
            self.reissued.discard(r)
            self.returned.append(r)

    def held_for(self, site: str, round_: int) -> list[DataRange] | None:
        """What ``site`` was reserved for closed round ``round_``, held for its late push."""
        return self.held.get((site, round_))

    def consume_held(
        self, round_: int, site: str, trained_round: int, trained: list[DataRange] | None = None
    ) -> list[DataRange]:
        """``site``'s late push of ``trained_round`` was merged into ``round_``: its held windows
        (the ``trained`` part of them, in a round by time; the rest goes back) become consumed
        there. Windows held for the rounds after it go back: the site was still training
        ``trained_round`` then, so it never trained them."""
        held = self.held.pop((site, trained_round))
        ranges, rest = split_windows(held, _count(held if trained is None else trained))
        self._give_back(rest)
        for r in ranges:
            self.consumed.append(ConsumedRecord(round_, site, r))
        for key in sorted(k for k in self.held if k[0] == site and k[1] > trained_round):
            self._give_back(self.held.pop(key))
        return ranges

    def expire_held(self, before_round: int) -> None:
        """Held windows of rounds before ``before_round`` (too stale to merge) go back."""
        for key in sorted(k for k in self.held if k[1] < before_round):
            self._give_back(self.held.pop(key))

    def replay(self, round_: int, consumed: list[list[Any]], after: dict[str, Any] | None = None) -> None:
        """Apply a logged round's consumed ranges ``[site, shard, start, end, epoch]`` (a restart
        replaying the rounds after its snapshot): the cursors end where the round left them.
        ``after``: the held and returned windows the round left (:meth:`pending_state`), which
        the cursors passed too; None in a round logged without late merging."""
        self.reservations.clear()
        self.reissued.clear()  # reservations are made again after the restart
        for site, index, start, end, epoch in consumed:
            self._replay_cursor(site, DataRange(index, start, end, epoch))
            self.consumed.append(ConsumedRecord(round_, site, DataRange(index, start, end, epoch)))
        if after is None:
            return
        self.held = {
            (site, int(r)): [DataRange(*d) for d in ranges] for site, r, ranges in after.get("held", [])
        }
        self.returned = [DataRange(*d) for d in after.get("returned", [])]
        for (site, _), ranges in sorted(self.held.items()):
            for r in ranges:
                self._replay_cursor(site, r)
        # the untrained rest of a round by time: its reservation moved the cursor past it too,
        # or the next reservation would hand it out from the cursor as well as from `returned`
        for r in self.returned:
            self._replay_cursor(None, r)

    def _replay_cursor(self, site: str | None, r: DataRange) -> None:
        """Move the cursor past ``r`` unless it is there already (a late-merged or returned range
        is behind it); ``site`` continues the shard (None: whoever did before)."""
        shard = self.shards[r.shard]
        if (r.epoch, r.end) > (shard.epoch, shard.consumed):
            shard.consumed, shard.epoch = r.end, r.epoch
            if r.end == shard.size:
                shard.owner = None
            elif site is not None:
                shard.owner = site

    def pending_state(self) -> dict[str, Any]:
        """The held and returned windows, as a round's record keeps them for :meth:`replay`."""
        return {
            "held": [[site, r, [astuple(d) for d in v]] for (site, r), v in sorted(self.held.items())],
            "returned": [astuple(d) for d in self.returned],
        }

    def release_site(self, site: str) -> None:
        """A lost or departed site: its reservation is dropped and its shards return to the pool."""
        self._give_back([r for r in self.reservations.pop(site, []) if r in self.reissued])
        for key in sorted(k for k in self.held if k[0] == site):
            self._give_back(self.held.pop(key))
        for shard in self.shards:
            if shard.owner == site:
                shard.owner = None

    def can_feed(self, demands: dict[str, int], rounds: int = 4) -> bool:
        """Whether sites needing ``demands`` windows per round can each be reserved for the next
        ``rounds`` rounds, tried on a copy of the ledger (every round settled as committed)."""
        trial = DataLedger(
            [ShardState(s.size, s.consumed, s.epoch, s.owner) for s in self.shards],
            {site: list(ranges) for site, ranges in self.reservations.items() if site in demands},
            returned=list(self.returned),
            reissued=set(self.reissued),
        )
        try:
            for r in range(rounds):
                for site, windows in demands.items():
                    trial.reserve(site, windows)
                trial.settle(r, set(demands))
        except LedgerExhausted:
            return False
        return True

    def pending(self) -> list[DataRange]:
        """Windows behind the cursors that no committed round consumed yet: held for a late push,
        or returned and waiting to be handed out again (an audit counts them as not skipped)."""
        held = [r for ranges in self.held.values() for r in ranges]
        reserved = [r for ranges in self.reservations.values() for r in ranges if r in self.reissued]
        return held + self.returned + reserved

    def progress(self) -> tuple[int, int]:
        """(windows consumed in the current epochs, windows in all shards)."""
        return sum(s.consumed for s in self.shards), sum(s.size for s in self.shards)

    def state_dict(self) -> dict[str, Any]:
        return {
            "shards": [asdict(s) for s in self.shards],
            "reservations": {k: [asdict(r) for r in v] for k, v in self.reservations.items()},
            "consumed": [[c.round, c.site, asdict(c.range)] for c in self.consumed],
            "held": [[site, r, [asdict(d) for d in v]] for (site, r), v in self.held.items()],
            "returned": [asdict(r) for r in self.returned],
            "reissued": [asdict(r) for r in self.reissued],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> DataLedger:
        return cls(
            shards=[ShardState(**s) for s in state["shards"]],
            reservations={k: [DataRange(**r) for r in v] for k, v in state["reservations"].items()},
            consumed=[ConsumedRecord(r, s, DataRange(**d)) for r, s, d in state["consumed"]],
            held={(s, r): [DataRange(**d) for d in v] for s, r, v in state.get("held", [])},
            returned=[DataRange(**r) for r in state.get("returned", [])],
            reissued={DataRange(**r) for r in state.get("reissued", [])},
        )


def _count(ranges: list[DataRange]) -> int:
    return sum(r.windows for r in ranges)


def check_exactly_once(
    records: list[ConsumedRecord], shard_sizes: list[int], pending: list[DataRange] | None = None
) -> list[str]:
    """Problems in a consumption log: overlaps within an epoch, or gaps before a shard's cursor.
    ``pending``: the ledger's windows not consumed yet but accounted for (:meth:`DataLedger.pending`),
    which are no gap (and overlap nothing consumed)."""
    problems: list[str] = []
    by_shard: dict[tuple[int, int], list[DataRange]] = {}
    for record in records:
        by_shard.setdefault((record.range.shard, record.range.epoch), []).append(record.range)
    for r in pending or []:
        by_shard.setdefault((r.shard, r.epoch), []).append(r)
    for (shard, epoch), ranges in sorted(by_shard.items()):
        cursor = 0
        for r in sorted(ranges, key=lambda r: r.start):
            if r.start < cursor:
                problems.append(f"shard {shard} epoch {epoch}: windows {r.start}-{cursor} consumed twice")
            elif r.start > cursor:
                problems.append(f"shard {shard} epoch {epoch}: windows {cursor}-{r.start} skipped")
            cursor = max(cursor, r.end)
        if cursor > shard_sizes[shard]:
            problems.append(f"shard {shard} epoch {epoch}: consumed past its end")
    return problems
