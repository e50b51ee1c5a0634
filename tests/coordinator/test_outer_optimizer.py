import pytest
import torch

from geodiloco.config import OuterConfig
from geodiloco.coordinator.aggregator import WeightedMean
from geodiloco.coordinator.outer_optimizer import FedAvgOuter, NesterovOuter, build_outer_optimizer
from helpers import DEVICES


def test_nesterov_matches_hand_computation() -> None:
    opt = NesterovOuter(lr=0.7, momentum=0.9)
    d1 = torch.tensor([1.0, -2.0, 0.5])
    d2 = torch.tensor([0.5, 1.0, -1.0])
    # round 1: m = d1; change = -0.7 * (d1 + 0.9 * d1) = -1.33 * d1
    assert torch.allclose(opt.step(d1), torch.tensor([-1.33, 2.66, -0.665]))
    # round 2: m = 0.9 * d1 + d2 = [1.4, -0.8, -0.55]; change = -0.7 * (d2 + 0.9 m)
    expected = -0.7 * (torch.tensor([0.5, 1.0, -1.0]) + 0.9 * torch.tensor([1.4, -0.8, -0.55]))
    assert torch.allclose(opt.step(d2), expected)
    assert torch.allclose(opt.buffer, torch.tensor([1.4, -0.8, -0.55]))


def test_nesterov_momentum_warmup_ramps_linearly() -> None:
    opt = NesterovOuter(lr=1.0, momentum=0.8, warmup_rounds=4)
    d = torch.ones(2)
    assert torch.allclose(opt.step(d.clone()), -d)  # momentum 0 in the first round
    assert opt.current_momentum() == pytest.approx(0.2)
    for _ in range(5):
        opt.step(d.clone())
    assert opt.current_momentum() == pytest.approx(0.8)


def test_fedavg_is_the_average_of_site_parameters() -> None:
    theta = torch.tensor([1.0, 2.0])
    site_a, site_b = torch.tensor([0.0, 2.0]), torch.tensor([1.0, 4.0])
    mean = WeightedMean(2)
    mean.add("a", theta - site_a, tokens=300)
    mean.add("b", theta - site_b, tokens=100)
    change = FedAvgOuter().step(mean.mean())
    # token-weighted: (300 * site_a + 100 * site_b) / 400
    assert torch.allclose(theta + change, torch.tensor([0.25, 2.5]))


def test_weighted_mean_refuses_empty_and_zero_weight() -> None:
    mean = WeightedMean(3)
    with pytest.raises(ValueError):
        mean.mean()
    with pytest.raises(ValueError):
        mean.add("a", torch.zeros(3), tokens=0)


def test_state_dict_roundtrip_resumes_identically() -> None:
    a = NesterovOuter(lr=0.7, momentum=0.9)
    a.step(torch.ones(4))
    b = NesterovOuter(lr=0.7, momentum=0.9)
    b.load_state_dict(a.state_dict())
    d = torch.arange(4.0)
    assert torch.equal(a.step(d.clone()), b.step(d.clone()))


def test_steps_reuse_the_averaged_delta_in_place() -> None:
    for opt in (NesterovOuter(lr=0.7, momentum=0.9), FedAvgOuter()):
        d = torch.ones(3)
        assert opt.step(d).data_ptr() == d.data_ptr()  # no model-sized temporaries


def test_build_from_config() -> None:
    assert isinstance(build_outer_optimizer(OuterConfig(optimizer="fedavg", lr=1.0)), FedAvgOuter)
    assert isinstance(build_outer_optimizer(OuterConfig()), NesterovOuter)


@pytest.mark.parametrize("device", DEVICES)
def test_span_steps_equal_the_whole_step_and_keep_state_where_the_mean_lives(device: str) -> None:
    """The round close steps chunk spans in any order; the momentum is made like the mean."""
    whole, spans = NesterovOuter(lr=0.7, momentum=0.9), NesterovOuter(lr=0.7, momentum=0.9)
    for r in range(3):
        d = torch.randn(10, dtype=torch.float64, device=device) + r
        expected = whole.step(d.clone())
        got = d.clone()
        step = spans.round_step(got)
        for start, end in ((6, 10), (0, 3), (3, 6)):
            step(got[start:end], start)
        assert torch.equal(got, expected)
    assert spans.buffer is not None and spans.buffer.dtype == torch.float64
    assert spans.buffer.device.type == device and spans.steps == whole.steps == 3


@pytest.mark.parametrize("optimizer", ["nesterov", "fedavg"])
@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_the_fused_send_step_equals_the_torch_ops(
    monkeypatch: pytest.MonkeyPatch, optimizer: str, decay: float
) -> None:
    """send = step(total / divisor) + decay · residual: Nesterov's C pass gives the same fp32
    values and momentum as the torch ops, round after round, spans in any order."""
    from geodiloco.coordinator import outer_optimizer

    def rounds() -> tuple[list[torch.Tensor], torch.Tensor | None]:
        torch.manual_seed(3)
        opt = build_outer_optimizer(OuterConfig(optimizer=optimizer, lr=0.7, momentum=0.9, warmup_rounds=2))
        residual, sent = torch.randn(1_001) * 0.01, []
        for _ in range(3):
            total = torch.randn(1_001) * 5
            send = opt.send_step(total, 7, residual, decay)
            for start, end in ((500, 1_001), (0, 500)):
                assert send(total[start:end], start).data_ptr() == residual[start:end].data_ptr()
            sent.append(residual.clone())
            residual.mul_(0.3)  # what the encoding dropped, for the next round
        return sent, getattr(opt, "buffer", None)

    fused = rounds()
    monkeypatch.setattr(outer_optimizer, "_kernels", None)
    reference = rounds()
    assert all(torch.equal(a, b) for a, b in zip(fused[0], reference[0], strict=True))
    assert (fused[1] is None) == (reference[1] is None)
    if fused[1] is not None and reference[1] is not None:
        assert torch.equal(fused[1], reference[1])
