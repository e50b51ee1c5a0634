import pytest
import torch

from geodiloco.compression import ErrorFeedback, Place, parse_pipeline

SPECS = [
    "fp16",
    "bf16",
    "q8",
    "q4",
    "q2",
    "q2:64:sr",
    "fp4",
    "nf4",
    "topk:0.1|q2",
    "topk:0.05:256|q4|zstd:1",
    "cyclic:0.4|q2",
    "cyclic:0.25|q4|zstd:1",
]


@pytest.mark.parametrize("spec", SPECS)
def test_error_feedback_drives_the_accumulated_error_to_zero(spec: str) -> None:
    pipeline = parse_pipeline(spec)
    signal = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 1e-3
    feedback = ErrorFeedback(signal.numel())
    received = torch.zeros_like(signal)
    errors = {}
    for r in range(1, 401):
        to_send = feedback.compensate(signal)
        _, decoded = pipeline.roundtrip(to_send, Place.span(r, 0, signal.numel()))
        feedback.record(to_send, decoded)
        received += decoded
        errors[r] = float((signal * r - received).norm() / (signal * r).norm())
    # Nothing is lost: what arrived plus the residual is what was sent...
    assert torch.allclose(received + feedback.residual, signal * 400, rtol=1e-4, atol=1e-7)
    # ...and the residual stays bounded, so the error of the running sum goes to zero.
    assert errors[400] < 0.05
    assert errors[400] <= errors[25] / 4 or errors[400] < 1e-5


def test_decay_bounds_what_piles_up_for_a_coordinate_that_is_never_sent() -> None:
    pipeline = parse_pipeline("cyclic:0.5")
    signal = torch.ones(64)
    for decay, bound in [(1.0, 40.0), (0.8, 5.0), (0.0, 1.0)]:
        feedback = ErrorFeedback(64, decay)
        for _ in range(40):
            to_send = feedback.compensate(signal)
            _, decoded = pipeline.roundtrip(to_send, Place.span(0, 0, 64))  # round 0 every time: same set
            feedback.record(to_send, decoded)
        dropped = decoded == 0
        assert 0 < int(dropped.sum()) < 64
        # what waits for a never-sent coordinate: the whole sum, or at most 1 / (1 - decay) rounds' worth
        assert torch.allclose(
            feedback.residual[dropped], torch.full_like(feedback.residual[dropped], bound), rtol=0.01
        )
        assert bool((feedback.residual[~dropped] == 0).all())
