"""Pair keys agree on both ends, and a mask stream cut at any chunking equals one whole pass."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from geodiloco.security.secagg import mask_keys
from geodiloco.security.secagg.secagg_errors import InvalidField

SEEDS = [bytes([i]) * 32 for i in range(3)]


def test_both_ends_derive_the_same_pair_seed_and_other_pairs_differ() -> None:
    a, b, c = (mask_keys.load_private(bytes([i + 1]) * 32) for i in range(3))
    ab = mask_keys.pair_seed(mask_keys.agree(a, mask_keys.public_bytes(b), "k"), b"ctx", "a", "b")
    ba = mask_keys.pair_seed(mask_keys.agree(b, mask_keys.public_bytes(a), "k"), b"ctx", "b", "a")
    ac = mask_keys.pair_seed(mask_keys.agree(a, mask_keys.public_bytes(c), "k"), b"ctx", "a", "c")
    other_round = mask_keys.pair_seed(mask_keys.agree(a, mask_keys.public_bytes(b), "k"), b"ctx2", "a", "b")
    assert ab == ba and len({ab, ac, other_round}) == 3


def test_a_low_order_or_short_public_key_is_refused_by_name() -> None:
    own = mask_keys.load_private(bytes(range(32)))
    with pytest.raises(InvalidField, match=r"adverts\.mask_key"):
        mask_keys.agree(own, bytes(32), "adverts.mask_key")  # the all-zero point
    with pytest.raises(InvalidField, match=r"adverts\.mask_key"):
        mask_keys.agree(own, bytes(31), "adverts.mask_key")


@pytest.mark.parametrize("cuts", [[1, 2, 33, 64, 65, 1000], [31], [4096 * 3 + 5]])
def test_any_chunking_draws_the_same_masks_as_one_pass(
    cuts: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mask_keys, "PIECE", 1000)  # several pieces per call, pieces cut mid-block
    terms = [(SEEDS[0], 1), (SEEDS[1], -1), (SEEDS[2], 1)]
    numel = 20011
    whole = mask_keys.masks(numel, 0, terms)
    edges = [0, *cuts, numel]
    parts = [mask_keys.masks(b - a, a, terms) for a, b in itertools.pairwise(edges)]
    assert np.array_equal(np.concatenate(parts), whole)
    one = [mask_keys.masks(numel, 0, [t]) for t in terms]
    assert np.array_equal(whole, one[0] + one[1] + one[2])  # each signed already; uint16: mod 2^16
    acc = np.ones(numel, dtype=np.uint16)
    mask_keys.masks(numel, 0, terms, out=acc, accumulate=True)
    assert np.array_equal(acc, whole + 1)


def test_negative_only_terms_and_no_terms() -> None:
    assert np.array_equal(
        mask_keys.masks(100, 7, [(SEEDS[0], -1)]), -mask_keys.masks(100, 7, [(SEEDS[0], 1)])
    )
    assert not mask_keys.masks(50, 0, []).any()
    with pytest.raises(InvalidField, match="start"):
        mask_keys.masks(10, -1, [(SEEDS[0], 1)])
