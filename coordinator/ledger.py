"""The data ledger: which window ranges of which data shard each site trains on, per round.

The training text is cut into many shards, each a sequence of windows. Every site owns some
shards and consumes them front to back. For each round the coordinator *reserves* the next
windows for every live site; when the round commits, the reservations of the sites whose
contribution was accepted become *consumed*, and the others are released (the cursor stays,
so the same windows are handed out again). A lost site's shards go back to the pool, from which
any site that runs short takes the next one. So across committed rounds every window is trained
on exactly once per epoch, whatever sites die, stall or come back.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from geodiloco.workload.data import DataRange


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
        while windows > 0:
            index, start, epoch = self._next_shard(site, ranges)
            shard = self.shards[index]
            take = min(windows, shard.size - start)
            ranges.append(DataRange(index, start, start + take, epoch))
            windows -= take
            if start + take == shard.size:
                shard.owner = None  # fully reserved: the next round continues elsewhere
        return ranges

    def _next_shard(self, site: str, ranges: list[DataRange]) -> tuple[int, int, int]:
        """Where the site's next windows start (shard, window, epoch): a shard it owns with
        windows left, else one from the pool, else its own shard's next epoch, else another
        site's, else the next epoch of a used-up one."""
        mine = {r.shard for r in ranges}
        reserved = mine | {r.shard for held in self.reservations.values() for r in held}
        for want_owner in (site, None):
            for i, shard in enumerate(self.shards):
                if shard.owner == want_owner and shard.consumed < shard.size and i not in reserved:
                    shard.owner = site
                    return i, shard.consumed, shard.epoch
        # the shard this reservation just used up continues into its next epoch. Without this,
        # a site whose shard runs dry mid-round takes another live site's shard, and with as
        # many shards as sites the last of them finds none (issue 16: `data.shards == sites`)
        if ranges and ranges[-1].end == self.shards[ranges[-1].shard].size:
            last = ranges[-1]
            self.shards[last.shard].owner = site
            return last.shard, 0, last.epoch + 1
        # a large site can outrun its own shards: continue another site's, rather than start an
        # epoch early (cursors only move forward, so every window is still consumed once)
        for i, shard in enumerate(self.shards):
            if shard.consumed < shard.size and i not in reserved:
                shard.owner = site
                return i, shard.consumed, shard.epoch
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
        return index, 0, shard.epoch

    def settle(self, round_: int, contributors: set[str]) -> None:
        """At commit: contributors' reservations become consumed, the others are released."""
        for site, ranges in self.reservations.items():
            if site not in contributors:
                for r in ranges:
                    shard = self.shards[r.shard]
                    if shard.owner is None and shard.consumed == r.start and shard.epoch == r.epoch:
                        shard.owner = site  # its shard was handed off as full; take it back
                continue
            for r in ranges:  # in order: a range in a shard's next epoch comes last
                shard = self.shards[r.shard]
                shard.consumed, shard.epoch = r.end, r.epoch
                self.consumed.append(ConsumedRecord(round_, site, r))
        self.reservations.clear()

    def replay(self, round_: int, consumed: list[list[Any]]) -> None:
        """Apply a logged round's consumed ranges ``[site, shard, start, end, epoch]`` (a restart
        replaying the rounds after its snapshot): the cursors end where the round left them."""
        self.reservations.clear()
        for site, index, start, end, epoch in consumed:
            shard = self.shards[index]
            shard.consumed, shard.epoch = end, epoch
            shard.owner = site if end < shard.size else None
            self.consumed.append(ConsumedRecord(round_, site, DataRange(index, start, end, epoch)))

    def release_site(self, site: str) -> None:
        """A lost or departed site: its reservation is dropped and its shards return to the pool."""
        self.reservations.pop(site, None)
        for shard in self.shards:
            if shard.owner == site:
                shard.owner = None

    def can_feed(self, demands: dict[str, int], rounds: int = 4) -> bool:
        """Whether sites needing ``demands`` windows per round can each be reserved for the next
        ``rounds`` rounds, tried on a copy of the ledger (every round settled as committed)."""
        trial = DataLedger(
            [ShardState(s.size, s.consumed, s.epoch, s.owner) for s in self.shards],
            {site: list(ranges) for site, ranges in self.reservations.items() if site in demands},
        )
        try:
            for r in range(rounds):
                for site, windows in demands.items():
                    trial.reserve(site, windows)
                trial.settle(r, set(demands))
        except LedgerExhausted:
            return False
        return True

    def progress(self) -> tuple[int, int]:
        """(windows consumed in the current epochs, windows in all shards)."""
        return sum(s.consumed for s in self.shards), sum(s.size for s in self.shards)

    def state_dict(self) -> dict[str, Any]:
        return {
            "shards": [asdict(s) for s in self.shards],
            "reservations": {k: [asdict(r) for r in v] for k, v in self.reservations.items()},
            "consumed": [[c.round, c.site, asdict(c.range)] for c in self.consumed],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> DataLedger:
        return cls(
            shards=[ShardState(**s) for s in state["shards"]],
            reservations={k: [DataRange(**r) for r in v] for k, v in state["reservations"].items()},
            consumed=[ConsumedRecord(r, s, DataRange(**d)) for r, s, d in state["consumed"]],
        )


def check_exactly_once(records: list[ConsumedRecord], shard_sizes: list[int]) -> list[str]:
    """Problems in a consumption log: overlaps within an epoch, or gaps before a shard's cursor."""
    problems: list[str] = []
    by_shard: dict[tuple[int, int], list[DataRange]] = {}
    for record in records:
        by_shard.setdefault((record.range.shard, record.range.epoch), []).append(record.range)
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
