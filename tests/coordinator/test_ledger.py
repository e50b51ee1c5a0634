"""The data ledger: every window consumed exactly once across committed rounds."""

from __future__ import annotations

import random
from dataclasses import astuple

import pytest

from geodiloco.coordinator.ledger import DataLedger, DataRange, check_exactly_once

SIZES = [10, 7, 12, 9, 5, 11]
SITES = ["a", "b", "c"]


def test_sites_start_on_their_own_shards_and_advance_in_order() -> None:
    ledger = DataLedger.create(SIZES, SITES)
    assert ledger.reserve("a", 4) == [DataRange(0, 0, 4)]
    assert ledger.reserve("a", 4) == [DataRange(0, 0, 4)]  # idempotent until settled
    assert ledger.reserve("b", 4) == [DataRange(1, 0, 4)]
    ledger.settle(0, {"a", "b"})
    assert ledger.reserve("a", 8) == [DataRange(0, 4, 10), DataRange(3, 0, 2)]  # a's next own shard
    assert ledger.reserve("b", 8) == [DataRange(1, 4, 7), DataRange(4, 0, 5)]


def test_dropped_contribution_releases_its_windows() -> None:
    ledger = DataLedger.create(SIZES, SITES)
    ledger.reserve("a", 4), ledger.reserve("b", 4)
    ledger.settle(0, {"a"})  # b's contribution was dropped
    assert ledger.reserve("b", 4) == [DataRange(1, 0, 4)]  # the same windows again
    assert [c.site for c in ledger.consumed] == ["a"]


def test_lost_site_shards_go_to_the_pool_and_to_survivors() -> None:
    ledger = DataLedger.create([4, 4, 4], ["a", "b", "c"])
    ledger.reserve("c", 2)
    ledger.release_site("c")
    ledger.settle(0, {"a"})
    assert ledger.reserve("a", 6) == [DataRange(0, 0, 4), DataRange(2, 0, 2)]  # c's shard, from the start


def test_random_faults_never_skip_or_repeat_a_window() -> None:
    rng = random.Random(0)
    ledger = DataLedger.create(SIZES, SITES)
    for round_ in range(60):
        live = [s for s in SITES if rng.random() > 0.2]
        for site in SITES:
            if site not in live:
                ledger.release_site(site)
        for site in live:
            ledger.reserve(site, rng.randint(1, 6))
        contributors = {s for s in live if rng.random() > 0.2}
        ledger.settle(round_, contributors)
    assert check_exactly_once(ledger.consumed, SIZES) == []
    assert any(c.range.epoch > 0 for c in ledger.consumed)  # it wrapped around, cleanly
    restored = DataLedger.from_state_dict(ledger.state_dict())
    assert restored == ledger


def test_audit_finds_overlaps_and_gaps() -> None:
    from geodiloco.coordinator.ledger import ConsumedRecord

    records = [ConsumedRecord(0, "a", DataRange(0, 0, 4)), ConsumedRecord(1, "b", DataRange(0, 3, 6))]
    assert "consumed twice" in check_exactly_once(records, [10])[0]
    records = [ConsumedRecord(0, "a", DataRange(0, 2, 4))]
    assert "skipped" in check_exactly_once(records, [10])[0]


def test_empty_shards_are_refused() -> None:
    with pytest.raises(ValueError):
        DataLedger.create([3, 0], SITES)


@pytest.mark.parametrize(
    ("sizes", "windows"),
    [([1979, 1979, 1979], 12), ([50, 37, 41], 12), ([10, 10, 10], 9)],
    ids=["issue-16-config", "uneven", "nearly-a-shard-a-round"],
)
def test_as_many_shards_as_sites_never_runs_dry(sizes: list[int], windows: int) -> None:
    """`data.shards == sites` (issue 16 item 2): a site whose shard runs out mid-round continues
    into that shard's next epoch instead of taking a neighbour's, so no site is ever left
    without data, over many epochs and with dropped contributions; every window once per epoch."""
    ledger = DataLedger.create(sizes, SITES)
    rng = random.Random(3)
    for r in range(400):
        for site in SITES:
            ledger.reserve(site, windows)
        ledger.settle(r, {s for s in SITES if rng.random() > 0.1})
    assert min(s.epoch for s in ledger.shards) >= 2
    assert check_exactly_once(ledger.consumed, sizes) == []


def test_a_reservation_wraps_into_its_shards_next_epoch() -> None:
    ledger = DataLedger.create([10, 10], ["a", "b"])
    ledger.reserve("a", 8), ledger.reserve("b", 8)
    ledger.settle(0, {"a", "b"})
    assert ledger.reserve("a", 8) == [DataRange(0, 8, 10, 0), DataRange(0, 0, 6, 1)]
    assert ledger.reserve("b", 8) == [DataRange(1, 8, 10, 0), DataRange(1, 0, 6, 1)]
    ledger.settle(1, {"a"})  # b's round was dropped: its cursor stays in epoch 0
    assert ledger.reserve("b", 8) == [DataRange(1, 8, 10, 0), DataRange(1, 0, 6, 1)]
    assert ledger.reserve("a", 8) == [DataRange(0, 6, 10, 1), DataRange(0, 0, 4, 2)]


def test_a_wrap_never_hands_out_a_window_twice_in_one_round() -> None:
    ledger = DataLedger.create([10, 10], ["a", "b"])
    ledger.reserve("a", 3), ledger.reserve("b", 1)
    ledger.settle(0, {"a", "b"})
    # a's shard has 7 windows left and 3 before them: 12 windows are 10 of its own, then b's
    ranges = ledger.reserve("a", 12)
    assert ranges[:2] == [DataRange(0, 3, 10, 0), DataRange(0, 0, 3, 1)]
    assert ranges[2] == DataRange(1, 1, 3, 0)


def test_a_replay_of_the_round_records_puts_every_cursor_where_the_live_ledger_has_it() -> None:
    """Rounds by time train a prefix of each reservation (the rest is returned, behind a cursor
    that moved past it) and late merging holds windows: a restart that replays the rounds'
    records (consumed ranges and pending windows) must leave each shard's cursor past the
    returned windows too, or the next reservation hands them out twice (issue 41, mode c)."""
    rng = random.Random(1)
    live, records = DataLedger.create(SIZES, SITES), []
    for round_ in range(40):
        for site in SITES:
            live.reserve(site, 4)
        for site, trained in [(s, r) for (s, t), r in list(live.held.items()) if t == round_ - 1]:
            if rng.random() < 0.5:
                live.consume_held(round_, site, round_ - 1, trained[: rng.randint(1, len(trained))])
        contributors = {s for s in SITES if rng.random() > 0.3}
        trained = {s: _prefix(live.reservations[s], rng.randint(1, 4)) for s in contributors}
        live.settle(round_, contributors, hold=set(SITES), trained=trained)
        live.expire_held(round_)  # outer.max_staleness 1
        consumed = [[c.site, *astuple(c.range)] for c in live.consumed if c.round == round_]
        records.append((round_, consumed, live.pending_state()))
    assert any(r[2]["returned"] for r in records) and any(r[2]["held"] for r in records)
    replayed = DataLedger.create(SIZES, SITES)
    for round_, consumed, pending in records:
        replayed.replay(round_, consumed, pending)
    cursor = [(s.consumed, s.epoch) for s in replayed.shards]
    assert cursor == [(s.consumed, s.epoch) for s in live.shards]
    assert (replayed.held, replayed.returned) == (live.held, live.returned)
    for ledger in (live, replayed):  # both go on handing out every window once
        for round_ in range(40, 60):
            for site in SITES:
                ledger.reserve(site, 4)
            ledger.settle(round_, set(SITES))
        assert check_exactly_once(ledger.consumed, SIZES, ledger.pending()) == []


def _prefix(ranges: list[DataRange], windows: int) -> list[DataRange]:
    from geodiloco.workload.data import split_windows

    return split_windows(ranges, windows)[0]
