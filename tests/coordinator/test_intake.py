"""Push intake: staging of checked raw bytes, interval coverage, and a broken push never reaching the mean."""

from __future__ import annotations

import io
import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch

from geodiloco.compression import envelope, parse_pipeline
from geodiloco.config import LimitsConfig
from geodiloco.coordinator.aggregator import sum_of_squares
from geodiloco.coordinator.intake import Intake, SpillFiles, Staged
from geodiloco.coordinator.refusals import InvalidArgument
from geodiloco.exchange import WireChunk
from geodiloco.segment import Segment
from geodiloco.site.edge.client import OuterSyncClient, delta_messages
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.v1 import outer_sync_pb2_grpc

CODEC = "q8|zstd:3"
PLAIN = "q8"


def staged(segments: list[Segment]) -> Staged:
    s = Staged(0, 1, 1, [], parse_pipeline(CODEC), io.BytesIO(), SpillFiles(None))
    attempt = s.begin(0, 1, 1, [])
    assert attempt is not None
    for seg in segments:
        s.stage(0, attempt, seg, b"", 0.0, 1 << 40)
    return s


def test_coverage_of_column_shards_is_checked_on_intervals() -> None:
    rows, cols = 6, 10  # a 6 x 10 matrix at element 4, its columns split over two ranks
    left, right = Segment(4, rows, 4, cols), Segment(8, rows, 6, cols)
    head, tail = Segment(0, 1, 4, 4), Segment(64, 1, 36, 36)
    staged([head, left, right, tail]).check_covered(100)
    with pytest.raises(InvalidArgument, match="elements are missing"):
        staged([head, left, tail]).check_covered(100)
    with pytest.raises(InvalidArgument, match="overlap at element 7"):
        staged([head, left, Segment(7, rows, 6, cols), Segment(63, 1, 37, 37)]).check_covered(100)


@pytest.mark.parametrize("pushes", [[10_000], [12_000, 10_000]])
def test_a_push_is_decoded_once_and_folded_from_its_staged_raw_bytes(pushes: list[int]) -> None:
    """Staged: the checked decode's raw bytes (int8 codes and scales, no zstd); the fold turns
    them into exactly the values a decode of the frames gives. A later push reuses the staging
    file of an earlier, larger one, whose bytes are still past its end."""
    spills = SpillFiles(None)
    files = []
    for n in pushes:
        pipeline, size = parse_pipeline(CODEC), 3000
        intake = Intake(pipeline, n, size, LimitsConfig(), opener=bytes)
        s = Staged(0, 1, 1, [], pipeline, spills.take(), spills)
        files.append(s.spill)
        attempt = s.begin(0, 1, 1, [])
        assert attempt is not None
        delta, expected = torch.randn(n) * 1e-3, torch.zeros(n)
        pieces = []
        for start in range(0, n, size):
            segment = Segment(start, 1, min(size, n - start), min(size, n - start))
            frame = pipeline.encode(segment.view_of(delta))
            raw, sumsq = intake.decode_checked(frame, 0, segment, start // size)
            decoded = pipeline.decode(frame, segment.numel)
            assert raw.numel() == pipeline.raw_size(segment.numel)
            assert sumsq == pytest.approx(sum_of_squares(decoded), rel=1e-6)  # from the codes, in double
            s.stage(0, attempt, segment, raw.numpy().data, sumsq, n)
            segment.view_of(expected).add_(decoded, alpha=3.0)
            pieces.append((segment, decoded))
        s.check_covered(n)
        total = torch.full((n,), 7.0)  # the last round's leftovers: the round's first fold overwrites them
        with ThreadPoolExecutor(2) as pool:
            s.fold_into(total, 3.0, True, pool)
            assert torch.equal(total, expected)
            s.fold_into(total, 3.0, False, pool)
        for segment, decoded in pieces:
            segment.view_of(expected).add_(decoded, alpha=3.0)
        assert torch.equal(total, expected)
        assert s.staged_bytes == sum(pipeline.raw_size(min(size, n - a)) for a in range(0, n, size))
        s.close()
    assert all(f is files[0] for f in files)  # one file, reused
    spills.take().close()


def test_an_abandoned_attempt_leaves_nothing_and_its_late_chunks_are_dropped() -> None:
    s = staged([Segment(0, 1, 10, 10)])
    s.abandon(0)
    assert not s.chunks and s.claimed == 0 and not s.streaming
    again = s.begin(0, 1, 1, [])
    assert again is not None
    s.stage(0, again - 1, Segment(0, 1, 10, 10), b"x", 1.0, 100)  # a chunk of the old attempt
    assert not s.chunks and s.total_sumsq == 0.0


def test_compressed_staging_never_folds_a_broken_push() -> None:
    # site-b is live: the round stays open; plain q8 so that a frame can be poisoned by hand
    # the mean's sum, folded as pushes complete, is what this checks
    cfg = tiny_config(round_timeout_s=60.0, compression__uplink=PLAIN, aggregation__rule="mean")
    with CoordinatorThread(cfg) as coordinator:
        c = coordinator.controller
        n = c.num_params
        a, b = OuterSyncClient(coordinator.target, "site-a"), OuterSyncClient(coordinator.target, "site-b")
        a.join(), b.join()
        stub = outer_sync_pb2_grpc.OuterSyncStub(a.channel)
        codec = parse_pipeline(PLAIN)
        delta = torch.randn(n) * 1e-3
        half = n // 2

        def part(index: int, values: torch.Tensor, start: int, tokens: int = 100) -> list[Any]:
            chunks = [
                WireChunk(Segment(start + at, 1, len(piece), len(piece)), codec.encode(piece))
                for at, piece in ((i, values[i : i + 500]) for i in range(0, values.numel(), 500))
            ]
            return delta_messages(a.run_id, a.site, 0, PLAIN, chunks, tokens, a.assigned, index, 2)

        def refused(msgs: Any, *codes: grpc.StatusCode) -> str:
            with pytest.raises(grpc.RpcError) as err:
                stub.PushDelta(iter(msgs) if isinstance(msgs, list) else msgs, timeout=10)
            assert err.value.code() in (codes or (grpc.StatusCode.INVALID_ARGUMENT,))
            assert not bool(c.mean.total.any()) and not c.mean.contributors and c.mean.weight == 0
            return str(err.value.details())

        assert not stub.PushDelta(iter(part(0, delta[:half], 0)), timeout=10).duplicate
        poisoned = part(1, delta[half:], half)
        raw = codec.values.encode(delta[half : half + 500])
        raw[:4].view(torch.float32)[0] = float("nan")  # the first block's step
        poisoned[0].payload = envelope.seal(codec.tag, 500, raw.numpy().tobytes())
        assert "not finite" in refused(poisoned)  # the decoder refuses it as it arrives

        def breaks_midway() -> Any:
            yield from part(1, delta[half:], half)[:1]
            raise ConnectionError("rank died mid-push")

        refused(breaks_midway(), grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
        time.sleep(0.3)  # the coordinator learns of the broken stream a moment after the site
        assert "overlap" in refused(part(1, delta[: n - half], 0))  # part 1 re-sends part 0's range
        assert not stub.PushDelta(iter(part(0, delta[:half], 0)), timeout=10).duplicate
        huge = torch.full((n - half,), 1e3)
        assert "max_delta_norm_ratio" in refused(part(1, huge, half))
        assert not stub.PushDelta(iter(part(0, delta[:half], 0)), timeout=10).duplicate
        assert not stub.PushDelta(iter(part(1, delta[half:], half)), timeout=10).duplicate
        assert c.mean.contributors == ["site-a"] and c.mean.weight == 100

        def received(values: torch.Tensor) -> torch.Tensor:
            pieces = [values[i : i + 500] for i in range(0, values.numel(), 500)]
            return torch.cat([codec.decode(codec.encode(p), p.numel()) for p in pieces])

        expected = torch.cat([received(delta[:half]), received(delta[half:])])
        assert torch.equal(c.mean.total, expected * 100.0)
        a.close(), b.close()


def test_sum_of_squares_is_fast_yet_exact_about_what_is_finite() -> None:
    """An fp32 dot first; the float64 sum only tells an fp32 overflow from a NaN or Inf."""
    assert sum_of_squares(torch.tensor([3.0, 4.0])) == 25.0
    assert sum_of_squares(torch.tensor([1e30, 1e30])) == pytest.approx(2e60)  # overflows fp32 only
    assert math.isnan(sum_of_squares(torch.tensor([1.0, float("nan")])))
    assert sum_of_squares(torch.tensor([1.0, float("-inf")])) == float("inf")
    assert sum_of_squares(torch.zeros(0)) == 0.0
