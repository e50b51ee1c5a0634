import torch

from geodiloco.params import flatten_parameters, load_flat_parameters, state_hash
from geodiloco.workload import GPTConfig, build_model


def test_same_seed_gives_bit_identical_parameters() -> None:
    cfg = GPTConfig(n_layer=1, d_model=16, n_head=2, seq_len=8)
    a, b = build_model(cfg, 7), build_model(cfg, 7)
    assert state_hash(flatten_parameters(a)) == state_hash(flatten_parameters(b))
    assert state_hash(flatten_parameters(build_model(cfg, 8))) != state_hash(flatten_parameters(a))


def test_flat_roundtrip_and_loss() -> None:
    cfg = GPTConfig(n_layer=1, d_model=16, n_head=2, seq_len=8)
    model = build_model(cfg, 0)
    flat = flatten_parameters(model)
    load_flat_parameters(model, flat * 2)
    assert torch.equal(flatten_parameters(model), flat * 2)
    x = torch.randint(0, 256, (2, 8))
    loss = model(x, x)
    assert 4.0 < float(loss) < 7.0  # ~ln(256) at initialisation
