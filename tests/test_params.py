from torch import nn

from geodiloco.params import canonical_name, canonical_parameters


def test_wrapper_prefixes_are_removed() -> None:
    assert canonical_name("module.blocks.0.fc.weight") == "blocks.0.fc.weight"
    assert canonical_name("_orig_mod.module.tok.weight") == "tok.weight"


def test_canonical_order_is_sorted_by_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    names = [n for n, _ in canonical_parameters(model)]
    assert names == sorted(names)
