"""Secure aggregation's cost: wire expansion against the plain int8 codec, a site's masking and
the coordinator's unmasking per million parameters (one core), and the added cost of a site lost
after masking, at 4, 8 and 16 sites.

Each row runs one whole aggregation in process (geodiloco.testing.secagg_rounds: the messages a
transport would carry): every site's Δ (Gaussian, its own scale) is weighted, quantised on the
shared scales and masked in 2^21-element chunks; the coordinator unmasks, and the sum is checked
bit for bit against the sum of the sites' codes. A second aggregation loses one site after it
masked. Targets at 4 sites: masking and unmasking ≤ 2 ms per million parameters each;
expansion ≤ 1.5 up to 8 sites and ≤ 1.7 at 16.

    python benchmarks/secagg.py [--params N] [--sites 4 8 16] [--repeats R] [--json PATH] [--smoke]

``--smoke`` (65,536 parameters, one repeat: seconds) only checks that the benchmark still runs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from geodiloco.compression import envelope, parse_pipeline
from geodiloco.security.secagg import shared_scale
from geodiloco.security.secagg.coordinator_round import SecAggConfig
from geodiloco.testing.secagg_rounds import Federation, federation

CODEC = "q8"
CHUNK = 1 << 21  # compression.chunk_elements' largest value: one chunk per push message
KEYS = (
    "sites",
    "params",
    "codec",
    "exact_sum",
    "expansion",
    "mask_ms_per_mparam",
    "unmask_ms_per_mparam",
    "dropout_recovered",
    "dropout_extra_s",
    "final_eval_loss_secure",
    "final_eval_loss_plain",
    "poison",
)
WHY_NULL = (
    "final_eval_loss_secure/plain and poison: null/[] until secure aggregation is wired into the "
    "coordinator's rounds (next step, docs/security.md) and benchmarks/robust.py's poison_rows lands"
)


def best(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def bounds(params: int) -> list[int]:
    return list(range(CHUNK, params, CHUNK))


def prepare(
    sites: int, params: int, config: SecAggConfig, seed: int
) -> tuple[Federation, dict[str, np.ndarray]]:
    """Key phases, shared scales and every site's codes (the quantisation the plain codec pays too)."""
    names = [f"dc-{i:02d}" for i in range(sites)]
    tokens = {n: 1000 + 250 * i for i, n in enumerate(names)}
    fed = federation(names, params, config, tokens=tokens, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    deltas = {n: torch.randn(params, generator=gen) * (1 + i % 3) for i, n in enumerate(names)}
    for n in names:
        fed.coordinator.receive_scales(fed.sites[n].propose([(0, deltas[n])]))
    plan = fed.coordinator.scale_plan()
    codes = {n: fed.sites[n].quantise(deltas[n], 0, plan) for n in names}
    return fed, codes


def uplink_bytes(fed: Federation, site: str, payload: int, chunks: int) -> int:
    """All a site sends: keys, shares, scale proposal, masked chunks (each with the plain codec's
    frame header) and its reveal (measured as share bytes: 66 per share)."""
    roster = fed.coordinator.roster()
    blocks = shared_scale.n_blocks(roster.numel, roster.block)
    shares = sum(
        12 + len(s.ciphertext) for s in fed.coordinator.inbox(site).shares
    )  # what it receives: same size
    degree = len(fed.sites[site].neighbours)
    return 64 + shares + 2 * blocks + payload + chunks * envelope.HEADER_SIZE + 66 * degree


def row(sites: int, params: int, repeats: int, seed: int) -> dict[str, Any]:
    fed, codes = prepare(sites, params, SecAggConfig(), seed)
    names = list(fed.sites)
    first = names[0]
    masker = fed.sites[first].masker()
    cuts = [0, *bounds(params), params]
    spans = list(zip(cuts, cuts[1:], strict=False))
    mask_s = best(lambda: [masker.mask(codes[first][a:b], a) for a, b in spans], repeats)
    payload = 0
    for n in names:
        payload_n = sum(len(c.payload) for c in fed.push(n, codes[n], bounds(params)))
        payload = payload_n if n == first else payload
    plain = parse_pipeline(CODEC)
    plain_bytes = sum(len(plain.encode(torch.zeros(b - a))) for a, b in spans)
    expansion = uplink_bytes(fed, first, payload, len(spans)) / plain_bytes

    request = fed.coordinator.close_pushes()
    for n in request.survivors:
        fed.coordinator.receive_reveal(fed.sites[n].reveal(request))
    out = np.empty(params, dtype=np.uint16)
    result = fed.coordinator.unmask(out)
    expected = np.zeros(params, dtype=np.int32)
    for n in names:
        expected += codes[n]
    exact = bool(np.array_equal(result.codes, expected))
    unmask_s = best(lambda: fed.coordinator.unmask(out), repeats)
    del fed

    # one site lost after masking: its pushes never arrive
    lost_fed, lost_codes = prepare(sites, params, SecAggConfig(), seed + 1)
    lost = names[-1]
    for n in names[:-1]:
        lost_fed.push(n, lost_codes[n], bounds(params))
    lost_fed.sites[lost].mask(lost_codes[lost][: min(params, CHUNK)], 0)
    started = time.perf_counter()
    request = lost_fed.coordinator.close_pushes()
    for n in request.survivors:
        lost_fed.coordinator.receive_reveal(lost_fed.sites[n].reveal(request))
    recovered = lost_fed.coordinator.unmask(out)
    dropout_s = time.perf_counter() - started
    survivors_sum = np.zeros(params, dtype=np.int32)
    for n in names[:-1]:
        survivors_sum += lost_codes[n]
    recovered_ok = bool(np.array_equal(recovered.codes, survivors_sum)) and request.dropped == (lost,)
    del lost_fed

    # self-masks on: the coordinator's extra streams (printed, not a JSON key)
    self_fed, self_codes = prepare(sites, params, SecAggConfig(self_masks=True), seed + 2)
    for n in names:
        self_fed.push(n, self_codes[n], bounds(params))
    request = self_fed.coordinator.close_pushes()
    for n in request.survivors:
        self_fed.coordinator.receive_reveal(self_fed.sites[n].reveal(request))
    self_fed.coordinator.unmask(out)
    self_unmask_s = best(lambda: self_fed.coordinator.unmask(out), repeats)
    del self_fed

    mparams = params / 1e6
    print(
        f"{sites:>5} {params:>10} {len(fed_degree(sites)):>6} {expansion:>9.3f} {1e3 * mask_s / mparams:>9.2f} "
        f"{1e3 * unmask_s / mparams:>10.2f} {1e3 * self_unmask_s / mparams:>13.2f} {dropout_s:>10.3f} "
        f"{exact!s:>6} {recovered_ok!s:>9}"
    )
    return {
        "sites": sites,
        "params": params,
        "codec": CODEC,
        "exact_sum": exact,
        "expansion": round(expansion, 4),
        "mask_ms_per_mparam": round(1e3 * mask_s / mparams, 3),
        "unmask_ms_per_mparam": round(1e3 * unmask_s / mparams, 3),
        "dropout_recovered": recovered_ok,
        "dropout_extra_s": round(max(dropout_s - unmask_s, 0.0), 4),
        "final_eval_loss_secure": None,
        "final_eval_loss_plain": None,
        "poison": [],
    }


def fed_degree(sites: int) -> range:
    from geodiloco.security.secagg.neighbours import default_degree

    return range(default_degree(sites))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=16 << 20, help="parameters per site (default 16M)")
    parser.add_argument("--sites", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="65,536 parameters, one repeat")
    args = parser.parse_args()
    if args.smoke:
        args.params, args.repeats = 1 << 16, 1
    torch.set_num_threads(1)  # one core, as the figures are per core
    print(f"secure aggregation, {args.params:,} parameters per site, codec {CODEC}, one core")
    print(
        " sites     params degree expansion  mask ms/M  unmask ms/M  +self-masks ms/M  dropout s  exact recovered"
    )
    rows = [row(n, args.params, args.repeats, args.seed) for n in args.sites]
    assert all(set(r) == set(KEYS) for r in rows)
    print("note:", WHY_NULL)
    print(
        "dropout_extra_s: the reveal phase and the recovery streams, in process; a real round adds one "
        "coordinator-to-sites round trip for the reveals"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
