"""geodiloco.wire: every value survives the trip to its protocol message and back, and the
messages carry exactly what the protocol document says."""

from __future__ import annotations

import dataclasses

from geodiloco.compression import EncodedChunk
from geodiloco.exchange import FragmentState, JoinInfo, PushPart, RoundReport, Served, WireChunk
from geodiloco.segment import Segment
from geodiloco.v1 import outer_sync_pb2
from geodiloco.wire import (
    join_info_from_proto,
    join_info_to_proto,
    push_messages,
    ranges_from_proto,
    ranges_to_proto,
    report_from_proto,
    report_to_proto,
    served_messages,
)
from geodiloco.workload.data import DataRange

RANGES = [DataRange(0, 0, 10, 0), DataRange(3, 100, 164, 2)]


def test_data_ranges_round_trip() -> None:
    assert ranges_from_proto(ranges_to_proto(RANGES)) == RANGES
    encoded = [m.SerializeToString() for m in ranges_to_proto(RANGES)]
    assert ranges_from_proto(outer_sync_pb2.DataRange.FromString(b) for b in encoded) == RANGES


def test_a_join_answer_round_trips_through_its_bytes() -> None:
    info = JoinInfo(
        run_id="run",
        run_config_json='{"rounds": 3}',
        round=7,
        state_hash="ab" * 32,
        shard_index=1,
        shard_count=3,
        num_params=12_345,
        heartbeat_interval_s=0.5,
        finished=False,
        data=RANGES,
        key_id=0x1234ABCD,
        fragments=(FragmentState(7, "aa", False), FragmentState(6, "bb", True)),
    )
    message = join_info_to_proto(info)
    assert [f.fragment for f in message.fragments] == [0, 1]
    again = join_info_from_proto(outer_sync_pb2.JoinResponse.FromString(message.SerializeToString()))
    assert again == info
    old = dataclasses.replace(info, fragments=())  # a coordinator of one fragment may send none
    assert join_info_from_proto(join_info_to_proto(old)).fragment_states == (
        FragmentState(7, "ab" * 32, False),
    )


def test_a_push_part_becomes_one_message_per_chunk_and_data_rides_on_the_first() -> None:
    box = Segment(40, 3, 4, 10)  # 3 rows of 4 elements, 10 apart (a column shard)
    chunks = [
        WireChunk(Segment(0, 1, 8, 8), b"first"),
        WireChunk(box, b"second"),
        EncodedChunk(90, 5, b"third"),
    ]
    part = PushPart(fragment=2, round=5, codec="q8", chunks=chunks, tokens=640, data=RANGES, part=1, parts=4)
    out = list(push_messages("run", "site-a", part))
    assert [payload for _, payload in out] == [b"first", b"second", b"third"]
    heads = [h for h, _ in out]
    for seq, h in enumerate(heads):
        assert (h.header.run_id, h.header.site, h.header.round, h.header.fragment) == ("run", "site-a", 5, 2)
        assert (h.header.codec, h.header.seq, h.tokens, h.total_chunks, h.part, h.parts) == (
            "q8",
            seq,
            640,
            3,
            1,
            4,
        )
        assert not h.payload  # the client joins the payload itself, copying it once
    assert ranges_from_proto(heads[0].data) == RANGES and not heads[1].data and not heads[2].data
    assert (heads[0].header.start, heads[0].header.numel, heads[0].header.rows) == (0, 8, 0)
    assert (heads[1].header.start, heads[1].header.numel) == (40, 12)
    assert (heads[1].header.rows, heads[1].header.stride) == (3, 10)
    assert (heads[2].header.start, heads[2].header.numel, heads[2].header.rows) == (90, 5, 0)


def test_a_served_pull_is_a_stream_whose_last_message_says_what_to_train_on_next() -> None:
    served = Served(
        full_state=True,
        codec="fp32",
        round=4,
        next_round=4,
        state_hash="cd" * 32,
        total_chunks=5,
        finished=False,
        mine=[(1, EncodedChunk(10, 10, b"x")), (3, EncodedChunk(30, 10, b"y"))],
        data=RANGES,
    )
    out = list(served_messages("run", "site-b", 1, served))
    assert [p for _, p in out] == [b"x", b"y"]
    heads = [h for h, _ in out]
    assert [h.header.seq for h in heads] == [1, 3] and [h.header.start for h in heads] == [10, 30]
    for h in heads:
        assert h.kind == outer_sync_pb2.PullRequest.FULL_STATE and h.total_chunks == 5
        assert (h.header.site, h.header.fragment, h.header.round, h.next_round) == ("site-b", 1, 4, 4)
    assert not heads[0].data and ranges_from_proto(heads[1].data) == RANGES
    update = dataclasses.replace(served, full_state=False, data=[])
    assert all(
        h.kind == outer_sync_pb2.PullRequest.UPDATE and not h.data
        for h, _ in served_messages("r", "s", 0, update)
    )


def test_a_round_report_round_trips_through_its_bytes() -> None:
    report = RoundReport(
        fragment=1,
        round=9,
        state_hash="ef" * 32,
        eval_loss_sum=12.5,
        eval_count=7,
        train_loss=1.75,
        tokens=4096,
        compute_seconds=3.25,
    )
    message = report_to_proto("run", "site-c", report)
    assert (message.run_id, message.site) == ("run", "site-c")
    assert report_from_proto(outer_sync_pb2.ReportRequest.FromString(message.SerializeToString())) == report
