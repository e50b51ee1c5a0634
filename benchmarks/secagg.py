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

``poison`` (the 4-site row): benchmarks/robust.py's rows, one site of four poisoning, for the default
aggregation rule and ``mean`` under each attack, with the int8 codec; real processes, 16 rounds of 4
steps on the reference workload (``--smoke``: one attack, in process). Those rules run on the
coordinator's plain sums, so these runs have secure aggregation off: with it on, only ``mean`` applies
(docs/robustness.md). ``--no-poison`` leaves the list empty.

``--smoke`` (65,536 parameters, one repeat: seconds) only checks that the benchmark still runs.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from robust import poison_rows

from geodiloco.compression import envelope, parse_pipeline
from geodiloco.pages import keep_freed_pages
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
    "final_eval_loss_secure/plain: null until secure aggregation is wired into the coordinator's "
    "rounds (next step, docs/security.md)"
)
POISON_SITES = 4  # the row whose `poison` list is filled: one poisoning site of four


def best(fn: Callable[[], object], repeats: int) -> float:
    """The least CPU time of this thread over the repeats: the work is single-threaded here (the
    cipher, numpy and the C kernel run in the calling thread), and CPU time, unlike wall time,
    does not count the time other processes hold the core on a shared machine."""
    times = []
    for _ in range(repeats):
        started = time.thread_time()
        fn()
        times.append(time.thread_time() - started)
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


def finish(fed: Federation, out: np.ndarray) -> tuple[np.ndarray, tuple[str, ...]]:
    """Close the pushes, collect the reveals, unmask into ``out``: (the sum, the dropped sites)."""
    request = fed.coordinator.close_pushes()
    for n in request.survivors:
        fed.coordinator.receive_reveal(fed.sites[n].reveal(request))
    return fed.coordinator.unmask(out).codes, request.dropped


def sum_of(codes: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    total = np.zeros(next(iter(codes.values())).size, dtype=np.int32)
    for n in names:
        total += codes[n]
    return total


def whole_round(sites: int, params: int, repeats: int, seed: int, out: np.ndarray) -> dict[str, Any]:
    """Every site pushes: masking (one site's), wire bytes, unmasking and the exact-sum check."""
    fed, codes = prepare(sites, params, SecAggConfig(), seed)
    names = list(fed.sites)
    masker = fed.sites[names[0]].masker()
    cuts = [0, *bounds(params), params]
    spans = list(itertools.pairwise(cuts))
    # per chunk, the best of the repeats: a preemption on a shared machine spoils one chunk's time,
    # not the whole pass's
    own = codes[names[0]]
    mask_s = sum(best(functools.partial(masker.mask, own[a:b], a), repeats) for a, b in spans)
    sent = {n: sum(len(c.payload) for c in fed.push(n, codes[n], bounds(params))) for n in names}
    plain = parse_pipeline(CODEC)
    plain_bytes = sum(len(plain.encode(torch.zeros(b - a))) for a, b in spans)
    total, _ = finish(fed, out)
    exact = bool(np.array_equal(total, sum_of(codes, names)))
    return {
        "degree": len(fed.sites[names[0]].neighbours),
        "exact": exact,
        "expansion": uplink_bytes(fed, names[0], sent[names[0]], len(spans)) / plain_bytes,
        "mask_s": mask_s,
        "unmask_s": best(lambda: fed.coordinator.unmask(out), repeats),
    }


def lost_round(sites: int, params: int, seed: int, out: np.ndarray) -> tuple[bool, float]:
    """One site masks, then is lost: (the survivors' exact sum came out, CPU seconds from closing
    the pushes to the sum: the reveal phase, rebuilding its key, removing its pair masks)."""
    fed, codes = prepare(sites, params, SecAggConfig(), seed)
    names = list(fed.sites)
    for n in names[:-1]:
        fed.push(n, codes[n], bounds(params))
    fed.sites[names[-1]].mask(codes[names[-1]][: min(params, CHUNK)], 0)
    started = time.thread_time()
    total, dropped = finish(fed, out)
    elapsed = time.thread_time() - started
    return bool(np.array_equal(total, sum_of(codes, names[:-1]))) and dropped == (names[-1],), elapsed


def self_masked_unmask(sites: int, params: int, repeats: int, seed: int, out: np.ndarray) -> float:
    """Unmasking with self-masks on: one more stream per survivor at the coordinator."""
    fed, codes = prepare(sites, params, SecAggConfig(self_masks=True), seed)
    for n in fed.sites:
        fed.push(n, codes[n], bounds(params))
    finish(fed, out)
    return best(lambda: fed.coordinator.unmask(out), repeats)


def mean_errors(sites: int, params: int, seed: int) -> tuple[float, float]:
    """Relative L2 error of the weighted mean through shared scales, and through the plain codec
    (each site's own absmax steps, decoded and weighted by the coordinator): what the shared
    grid costs in precision, ahead of the training runs that will measure it in loss."""
    fed = federation([f"dc-{i:02d}" for i in range(sites)], params, tokens=None, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    deltas = {n: torch.randn(params, generator=gen) * (1 + i % 3) for i, n in enumerate(fed.sites)}
    for n, s in fed.sites.items():
        fed.coordinator.receive_scales(s.propose([(0, deltas[n])]))
    plan = fed.coordinator.scale_plan()
    for n, s in fed.sites.items():
        fed.push(n, s.quantise(deltas[n], 0, plan), [])
    total, _ = finish(fed, np.empty(params, dtype=np.uint16))
    secure = shared_scale.dequantise(total, 128, plan.exponents, 1.0)
    exact = sum(deltas.values()) / sites
    codec = parse_pipeline(CODEC)
    plain = sum(codec.decode(codec.encode(d), params) for d in deltas.values()) / sites
    norm = float(exact.norm())
    return float((secure - exact).norm()) / norm, float((plain - exact).norm()) / norm


def row(sites: int, params: int, repeats: int, seed: int) -> dict[str, Any]:
    out = np.empty(params, dtype=np.uint16)  # the coordinator's reused sum buffer
    whole = whole_round(sites, params, repeats, seed, out)
    recovered, dropout_s = lost_round(sites, params, seed + 1, out)
    self_unmask_s = self_masked_unmask(sites, params, repeats, seed + 2, out)
    secure_err, plain_err = mean_errors(sites, min(params, 1 << 20), seed + 3)
    mparams = params / 1e6
    mask_ms, unmask_ms = 1e3 * whole["mask_s"] / mparams, 1e3 * whole["unmask_s"] / mparams
    print(
        f"{sites:>5} {params:>10} {whole['degree']:>6} {whole['expansion']:>9.3f} {mask_ms:>9.2f} "
        f"{unmask_ms:>10.2f} {1e3 * self_unmask_s / mparams:>13.2f} {dropout_s:>10.3f} "
        f"{whole['exact']!s:>6} {recovered!s:>9} {secure_err:>10.4f} {plain_err:>9.4f}"
    )
    return {
        "sites": sites,
        "params": params,
        "codec": CODEC,
        "exact_sum": whole["exact"],
        "expansion": round(whole["expansion"], 4),
        "mask_ms_per_mparam": round(mask_ms, 3),
        "unmask_ms_per_mparam": round(unmask_ms, 3),
        "dropout_recovered": recovered,
        # the lost site's share: the recovery's time beyond an unmask with nobody lost
        "dropout_extra_s": round(max(dropout_s - whole["unmask_s"], 0.0), 4),
        "final_eval_loss_secure": None,
        "final_eval_loss_plain": None,
        "poison": [],
    }


def with_poison(rows: list[dict[str, Any]], smoke: bool) -> None:
    """Fill the 4-site row's ``poison`` from benchmarks/robust.py (same codec as the timing rows)."""
    for r in rows:
        if r["sites"] == POISON_SITES:
            r["poison"] = poison_rows(POISON_SITES, smoke, overrides={"compression.uplink": CODEC})
            for p in r["poison"]:
                print(
                    f"poison, {POISON_SITES} sites: rule {p['rule']:<13} attack {p['attack']:<9} final eval "
                    f"loss {p['final_eval_loss']:.4f}, honest (3 sites) {p['honest_eval_loss']:.4f}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=16 << 20, help="parameters per site (default 16M)")
    parser.add_argument("--sites", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="65,536 parameters, one repeat")
    parser.add_argument("--no-poison", action="store_true", help="leave the 4-site row's poison list empty")
    args = parser.parse_args()
    if args.smoke:
        args.params, args.repeats = 1 << 16, 1
    torch.set_num_threads(1)  # one core, as the figures are per core
    keep_freed_pages()  # as the coordinator and the sites do: no fresh page faults per chunk
    print(f"secure aggregation, {args.params:,} parameters per site, codec {CODEC}, one core (CPU time)")
    print(
        " sites     params degree expansion  mask ms/M  unmask ms/M  +self-masks ms/M  dropout s"
        "  exact recovered mean err  plain err"
    )
    rows = [row(n, args.params, args.repeats, args.seed) for n in args.sites]
    if not args.no_poison:
        with_poison(rows, args.smoke)
    assert all(set(r) == set(KEYS) for r in rows)
    print("note:", WHY_NULL)
    print(
        "dropout s: from closing the pushes to the sum with one site lost (reveals, its key rebuilt, its "
        "pair masks removed), in process; over a WAN the reveals add one coordinator-sites round trip"
    )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
