"""Protocol messages to the values both ends use, and back: the one place that knows both.

Each conversion comes in a pair (``X_to_proto`` / ``X_from_proto``) where both directions are
used; the site's gRPC edge and the coordinator's servicers call these, and their cores see only
the values (:mod:`geodiloco.exchange`, :class:`~geodiloco.workload.data.DataRange`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from geodiloco.exchange import FragmentState, JoinInfo, PushPart, RoundReport, Served, wire_chunk
from geodiloco.v1 import outer_sync_pb2
from geodiloco.workload.data import DataRange

# Call metadata naming the site that opens a push stream, so the coordinator holds its lease
# from the first byte (plaintext loopback runs; with mTLS the certificate names the site).
PUSHER_KEY = "geodiloco-site"


def ranges_to_proto(data: Iterable[DataRange]) -> list[outer_sync_pb2.DataRange]:
    return [outer_sync_pb2.DataRange(shard=d.shard, start=d.start, end=d.end, epoch=d.epoch) for d in data]


def ranges_from_proto(data: Iterable[outer_sync_pb2.DataRange]) -> list[DataRange]:
    return [DataRange(d.shard, d.start, d.end, d.epoch) for d in data]


def push_messages(
    run_id: str, site: str, part: PushPart
) -> Iterator[tuple[outer_sync_pb2.DeltaChunk, bytes]]:
    """A push part as its PushDelta stream, one (message without its payload, payload) at a
    time: the client encodes the two itself (:func:`~geodiloco.security.raw_requests.encode_with`),
    copying the payload once, and a sequence that encodes its chunks when they are taken is
    encoded chunk by chunk while the earlier ones are on the wire. Plain encoded chunks are
    contiguous ranges. The data ranges ride on the first message only."""
    total = len(part.chunks)
    for seq, item in enumerate(part.chunks):
        chunk = wire_chunk(item)
        boxed = chunk.segment.rows > 1
        head = outer_sync_pb2.DeltaChunk(
            header=outer_sync_pb2.ChunkHeader(
                run_id=run_id,
                round=part.round,
                fragment=part.fragment,
                site=site,
                codec=part.codec,
                seq=seq,
                start=chunk.segment.start,
                numel=chunk.segment.numel,
                rows=chunk.segment.rows if boxed else 0,
                stride=chunk.segment.stride if boxed else 0,
            ),
            tokens=part.tokens,
            total_chunks=total,
            data=ranges_to_proto(part.data or []) if seq == 0 else [],
            part=part.part,
            parts=part.parts,
        )
        yield head, chunk.payload


def join_info_to_proto(info: JoinInfo) -> outer_sync_pb2.JoinResponse:
    return outer_sync_pb2.JoinResponse(
        run_id=info.run_id,
        run_config_json=info.run_config_json,
        round=info.round,
        state_hash=info.state_hash,
        shard_index=info.shard_index,
        shard_count=info.shard_count,
        num_params=info.num_params,
        heartbeat_interval_s=info.heartbeat_interval_s,
        finished=info.finished,
        data=ranges_to_proto(info.data),
        key_id=info.key_id,
        fragments=[
            outer_sync_pb2.FragmentState(
                fragment=p, round=f.round, state_hash=f.state_hash, finished=f.finished
            )
            for p, f in enumerate(info.fragments)
        ],
    )


def join_info_from_proto(r: outer_sync_pb2.JoinResponse) -> JoinInfo:
    return JoinInfo(
        r.run_id,
        r.run_config_json,
        r.round,
        r.state_hash,
        r.shard_index,
        r.shard_count,
        r.num_params,
        r.heartbeat_interval_s,
        r.finished,
        ranges_from_proto(r.data),
        r.key_id,
        tuple(FragmentState(f.round, f.state_hash, f.finished) for f in r.fragments),
    )


def served_messages(
    run_id: str, site: str, fragment: int, served: Served
) -> Iterator[tuple[outer_sync_pb2.UpdateChunk, bytes | memoryview]]:
    """A pull's answer as its PullUpdate stream: (message without its payload, payload).
    The data to train on rides on the stream's last message only."""
    kind = outer_sync_pb2.PullRequest.FULL_STATE if served.full_state else outer_sync_pb2.PullRequest.UPDATE
    last = len(served.mine) - 1
    for i, (seq, chunk) in enumerate(served.mine):
        head = outer_sync_pb2.UpdateChunk(
            header=outer_sync_pb2.ChunkHeader(
                run_id=run_id,
                round=served.round,
                fragment=fragment,
                site=site,
                codec=served.codec,
                seq=seq,
                start=chunk.start,
                numel=chunk.numel,
            ),
            next_round=served.next_round,
            state_hash=served.state_hash,
            total_chunks=served.total_chunks,
            finished=served.finished,
            kind=kind,
            data=ranges_to_proto(served.data) if i == last else [],
        )
        yield head, chunk.payload


def report_to_proto(run_id: str, site: str, report: RoundReport) -> outer_sync_pb2.ReportRequest:
    r = report
    return outer_sync_pb2.ReportRequest(
        run_id=run_id,
        site=site,
        fragment=r.fragment,
        round=r.round,
        state_hash=r.state_hash,
        eval_loss_sum=r.eval_loss_sum,
        eval_count=r.eval_count,
        train_loss=r.train_loss,
        tokens=r.tokens,
        compute_seconds=r.compute_seconds,
    )


def report_from_proto(r: outer_sync_pb2.ReportRequest) -> RoundReport:
    return RoundReport(
        r.fragment,
        r.round,
        r.state_hash,
        r.eval_loss_sum,
        r.eval_count,
        r.train_loss,
        r.tokens,
        r.compute_seconds,
    )
