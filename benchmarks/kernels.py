"""The per-chunk passes of an outer-sync round, each timed alone on one core.

Run:  .venv/bin/python benchmarks/kernels.py [--json PATH] [--elements N] [--repeats R]
      [--sparse SPEC]  (--smoke: a few thousand elements, one repeat)

A round at N parameters runs each pass below over all N elements, once or more: a site encodes
its push (``encode``) and adds and hashes the update it pulls (``apply_q8``, one rank;
``unpack`` undoes the entropy stage first); the coordinator undoes the entropy stage of each
push (``unpack``), checks its norm from the codes (``sumsq_q8``) and folds it into the round's
sum (``fold_q8``), then closes the round: the Nesterov step with the downlink's residual
(``nesterov_send``), quantisation and entropy coding of the update (``encode``), and θ +=
update with the new θ's checksum and Σ θ² (``apply_q8`` with a residual). ``checksum_range``
is a site's digest of a tensor it holds. The scale benchmark (``benchmarks/scale.py``) tells
what a whole round costs on shared cores; these figures tell which pass a change moved, with
far less noise. Each figure is the best of ``--repeats`` timings of ten calls, in milliseconds
per chunk and nanoseconds per element.

``--sparse SPEC`` (a ``topk:F:B|sign:S`` pipeline, issue 42) times its passes instead: the
per-block top-k (``topk``; ``topk (portable)``: the kernel's path for CPUs without AVX-512),
the index set's Elias-Fano code and the kept values' sign code, each way, then the whole
``encode``, a site's ``encode + residual`` (error feedback's record without a dense decoded
tensor), ``decode``, and ``apply`` (θ += the update with θ's checksum and Σ θ², from the
codes, as a site applies what it pulls). ``memcpy`` of the chunk is the yardstick. Each is the
best of ``--repeats`` single calls (each takes a fraction of a millisecond: on shared cores a
window of ten is rarely left alone).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from geodiloco.compression import Place, indices, parse_pipeline
from geodiloco.compression.levels import LevelQuantizer
from geodiloco.compression.quantize import _kernels
from geodiloco.compression.sparsify import TopK

CODEC = "q8|zstd:1"  # the scale benchmark's, both ways
BLOCK = 128  # q8's block


def best_ms(fn: Callable[[], object], repeats: int, calls: int = 10) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def passes(n: int) -> dict[str, Callable[[], object]]:
    """One call of each pass over a chunk of ``n`` elements (bell-shaped values, as a
    pseudo-gradient of many inner steps is)."""
    if _kernels is None:
        raise SystemExit("the C kernels are not built (run `make setup`)")
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(n, generator=gen) * 1e-3
    codec = parse_pipeline(CODEC)
    place = Place.span(0, 0, n)
    frame = codec.encode(delta, place)
    raw = codec.unpack(frame, n, place)
    head = raw.numel() - n  # one fp32 step per block, then the int8 codes
    steps, codes = raw[:head].view(torch.float32).numpy(), raw[head:].view(torch.int8).numpy()
    theta, residual = (torch.randn(n, generator=gen).numpy() for _ in range(2))
    total, momentum, send = (np.zeros(n, np.float32) for _ in range(3))
    values = delta.numpy()
    return {
        "encode": lambda: codec.encode(delta, place),
        "unpack": lambda: codec.unpack(frame, n, place),
        "sumsq_q8": lambda: _kernels.sumsq_q8(steps, codes, BLOCK),
        "fold_q8": lambda: _kernels.fold_q8(steps, codes, BLOCK, total, n, n, 0.5, True),
        "nesterov_send": lambda: _kernels.nesterov_send(total, momentum, send, 2.0, 0.9, 0.7, 1.0),
        "apply_q8": lambda: _kernels.apply_q8(theta, steps, codes, BLOCK, None, 12_345),
        "apply_q8 (residual)": lambda: _kernels.apply_q8(theta, steps, codes, BLOCK, residual, 12_345),
        "checksum_range": lambda: _kernels.checksum_range(values, 12_345),
    }


def sparse_passes(n: int, spec: str) -> dict[str, Callable[[], object]]:
    """One call of each pass of a top-k + sign pipeline over a chunk of ``n`` bell-shaped values."""
    if _kernels is None:
        raise SystemExit("the C kernels are not built (run `make setup`)")
    codec = parse_pipeline(spec)
    topk, signs = codec.sparsifier, codec.values
    if not isinstance(topk, TopK) or not isinstance(signs, LevelQuantizer) or not signs.fused:
        raise SystemExit(f"--sparse takes a topk:F:B|sign:S pipeline, not {spec!r}")
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(n, generator=gen) * 1e-3
    place = Place.span(0, 0, n)
    block = topk.block or n
    k = topk.count(n)
    kept, values = topk.select_values(delta)
    index_code, sign_code = indices.encode(kept, n), signs.encode(values)
    frame = codec.encode(delta, place)
    raw, theta = codec.unpack(frame, n, place), torch.randn(n, generator=gen)
    out_kept, out_values = np.empty(k, np.int64), np.empty(k, np.float32)
    out, residual, x = torch.empty(n), torch.empty(n), delta.numpy()
    copy = np.empty_like(x)
    return {
        "memcpy": lambda: np.copyto(copy, x),
        "topk": lambda: _kernels.topk(x, block, topk.count(block), out_kept, out_values),
        "topk (portable)": lambda: _kernels.topk(x, block, topk.count(block), out_kept, out_values, True),
        "elias_fano_encode": lambda: indices.encode(kept, n),
        "sign_encode": lambda: signs.encode(values),
        "encode": lambda: codec.encode(delta, place),
        "encode + residual": lambda: codec.encode_with_residual(delta, residual, place),
        "elias_fano_decode": lambda: indices.decode(index_code, n, k),
        "sign_decode (scatter)": lambda: signs.scatter(sign_code, kept, out),
        "decode": lambda: codec.decode(frame, n, place),
        "apply": lambda: codec.apply_raw(raw, theta, 12_345),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 20, help="elements of a chunk (the sync's)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--smoke", action="store_true", help="a tiny chunk, one repeat")
    parser.add_argument("--sparse", metavar="SPEC", help="time a topk:F:B|sign:S pipeline's passes instead")
    args = parser.parse_args(argv)
    if args.smoke:
        args.elements, args.repeats = 4096, 1
    torch.set_num_threads(1)
    rows = []
    chosen = sparse_passes(args.elements, args.sparse) if args.sparse else passes(args.elements)
    for name, fn in chosen.items():
        ms = best_ms(fn, args.repeats, calls=1 if args.sparse else 10)
        rows.append(
            {"pass": name, "elements": args.elements, "ms": ms, "ns_per_element": ms * 1e6 / args.elements}
        )
        print(f"{name:22s} {ms:8.3f} ms  {rows[-1]['ns_per_element']:6.2f} ns/element", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
