"""How a rank's push and pull are spread over several streams (site/link.py, Strided)."""

from __future__ import annotations

from geodiloco.exchange import Strided, strided
from geodiloco.site.link import puller_of, push_streams


def test_every_chunk_has_exactly_one_puller_and_each_rank_gets_its_streams_share() -> None:
    pullers, streams, total = 3, 4, 101
    asked = {
        (r, k): {s for s in range(total) if s % (pullers * streams) == r * streams + k}
        for r in range(pullers)
        for k in range(streams)
    }
    for seq in range(total):
        owners = [rk for rk, seqs in asked.items() if seq in seqs]
        assert len(owners) == 1 and owners[0][0] == puller_of(seq, pullers, streams)
    assert [puller_of(s, 5, 1) for s in range(12)] == [s % 5 for s in range(12)]  # one stream: as before


def test_a_push_part_per_stream_each_with_a_chunk() -> None:
    assert push_streams(4, 10) == 4
    assert push_streams(4, 2) == 2
    assert push_streams(1, 10) == 1
    assert push_streams(4, 0) == 1  # the client refuses an empty push itself


def test_strided_takes_items_only_when_asked() -> None:
    taken: list[int] = []

    class Lazy(list[int]):
        def __getitem__(self, i):  # type: ignore[no-untyped-def,override]
            taken.append(i)
            return super().__getitem__(i)

    items = Lazy(range(10))
    view = Strided(items, 1, 3)
    assert len(view) == 3 and not taken
    assert list(view) == [1, 4, 7] and taken == [1, 4, 7]
    assert view[-1] == 7 and view[0:2] == [1, 4]
    assert strided(items, 0, 1) is items
    assert sorted(x for k in range(3) for x in strided(items, k, 3)) == list(range(10))
