"""Codec benchmark: bits/param, error and one-core throughput of every codec and useful pipelines.

Run:  .venv/bin/python benchmarks/codecs.py --json runs/codecs.json

Tensors: a real pseudo-gradient (θ_0 − θ after H=25 AdamW steps of the reference workload, the
demo's settings, site 1's shard; 478K parameters) and a Gaussian tensor of one default chunk
(2^20 elements); each pipeline encodes the whole tensor as one frame. Both fit in the CPU's
caches, so their memcpy is a cache copy. ``--large N`` adds a Gaussian tensor of N elements
(default 2^26, 256 MB) encoded as the system does, in chunks of 2^20 elements (``encode_chunks``,
``decode_chunks_into``), for the int8 pipelines only: there memcpy streams from DRAM.
Throughput is in MB/s of fp32 input, best of ``--repeats``, next to ``memcpy_MBps``
(``dst.copy_(src)`` of the same tensor into a preallocated one) measured in the same run, before
and after the pipelines (the larger kept). Everything runs on one thread. ``--smoke`` (every
pipeline once, a 2-step pseudo-gradient, small tensors: seconds) only checks that it still runs.

``WRAPPERS`` maps the "sealed" column's values to a (wrap, unwrap) pair applied to every
encoded payload: "off", and "on" = AES-256-GCM sealing and opening as on the wire.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from geodiloco.app.demo import DemoOptions, demo_config
from geodiloco.compression import Place, decode_chunks_into, encode_chunks, parse_pipeline
from geodiloco.compression.envelope import HEADER_SIZE
from geodiloco.params import flatten_parameters
from geodiloco.progress import Progress
from geodiloco.security.sealing import NONCE_BYTES, Sealer
from geodiloco.workload import (
    DataRange,
    DataShards,
    build_model,
    inner_step,
    load_corpus,
    make_inner_optimizer,
    rank_batch,
)

PIPELINES = [
    "fp32",
    "fp32|zstd:1",
    "fp16",
    "bf16",
    "q8",
    "q8|zstd:1",
    "q8|zstd:3",
    "q8:32",
    "q4",
    "q4|zstd:3",
    "q4:32",
    "q4:32:sr",
    "fp4",
    "fp4:32",
    "nf4",
    "nf4|zstd:3",
    "q2",
    "q2|zstd:3",
    "q2:32",
    "q2:32:sr",
    "q2:256",
    "lm2",
    "lm2:256",
    "topk:0.02|fp32",
    "topk:0.1|q4",
    "topk:0.1|q2",
    "topk:0.1|q2|zstd:3",
    "topk:0.2|q2",
    "topk:0.1:256|q2",
    "topk:0.05|q2|zstd:3",
    "topk:0.14|q2|zstd:1",
    "cyclic:0.4|q2",
    "cyclic:0.47|q2:256|zstd:1",
    "cyclic:0.5|q2|zstd:1",
    "sign:256",
    "sign:4096",
    "topk:0.05:4096|q2",
    "topk:0.1:4096|q2",
    "topk:0.025:4096|q2",
    "topk:0.065:4096|sign:256",
    "topk:0.03:4096|sign:256",
]
LARGE_PIPELINES = ["q8", "q8|zstd:1", "q8|zstd:3"]
CHUNK = 1 << 20

Wrapper = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]
_SEALER = Sealer(os.urandom(32), key_id=1)
_AAD = b"geodiloco chunk header: run, round, fragment, site, seq, start, numel, codec, key id"


def _seal(payload: bytes) -> bytes:
    nonce, sealed = _SEALER.seal(payload, _AAD)
    return nonce + sealed


def _open(data: bytes) -> bytes:
    return _SEALER.open(data[:NONCE_BYTES], data[NONCE_BYTES:], _AAD)


# "on": every encoded payload sealed with AES-256-GCM (as the wire does), and opened before decoding.
WRAPPERS: dict[str, Wrapper] = {"off": (lambda b: b, lambda b: b), "on": (_seal, _open)}


@dataclass(slots=True)
class Row:
    name: str
    tensor: str
    sealed: str
    bits_per_param: float
    rel_l2_error: float
    cosine: float
    encode_MBps: float
    decode_MBps: float
    entropy_gain: float  # frame size without the zstd stage / with it (1.0 without zstd)


def pseudo_gradient(steps: int = 25) -> torch.Tensor:
    """θ_0 − θ after ``steps`` inner AdamW steps of the reference workload (demo settings)."""
    cfg = demo_config(DemoOptions())
    model = build_model(cfg.model, cfg.seed)
    optimizer = make_inner_optimizer(model, cfg.inner)
    corpus = load_corpus(cfg.data.paths, cfg.data.max_bytes, cfg.data.eval_fraction)
    shards = DataShards(corpus, count=cfg.data.shards, seq_len=cfg.model.seq_len, seed=cfg.seed)
    windows = shards.windows([DataRange(0, 0, steps * cfg.data.batch_size)])
    theta0 = flatten_parameters(model).clone()
    for step in range(steps):
        x, y = rank_batch(windows, step, 0, 1, cfg.data.batch_size)
        inner_step(model, optimizer, cfg.inner, step, x, y)
    return theta0 - flatten_parameters(model)


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def memcpy_mbps(x: torch.Tensor, repeats: int) -> float:
    dst = torch.empty_like(x)
    return 4 * x.numel() / 1e6 / best_seconds(lambda: dst.copy_(x), repeats)


def rel_l2(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x.double() - y.double()).norm() / x.double().norm())


def cosine(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=0))


def measure(spec: str, tensor: str, x: torch.Tensor, sealed: str, repeats: int) -> Row:
    pipeline = parse_pipeline(spec)
    wrap, unwrap = WRAPPERS[sealed]
    place = Place.span(0, 0, x.numel())  # the round-0 chunk at the vector's start (cyclic needs one)
    frame = pipeline.encode(x, place)
    payload = wrap(frame)
    y = pipeline.decode(unwrap(payload), x.numel(), place)
    mb = 4 * x.numel() / 1e6
    enc = best_seconds(lambda: wrap(pipeline.encode(x, place)), repeats)
    dec = best_seconds(lambda: pipeline.decode(unwrap(payload), x.numel(), place), repeats)
    return Row(
        name=spec,
        tensor=tensor,
        sealed=sealed,
        bits_per_param=8 * len(payload) / x.numel(),
        rel_l2_error=rel_l2(x, y),
        cosine=cosine(x, y),
        encode_MBps=mb / enc,
        decode_MBps=mb / dec,
        entropy_gain=(HEADER_SIZE + pipeline.raw_size(x.numel(), place)) / len(frame),
    )


def measure_chunked(spec: str, tensor: str, x: torch.Tensor, sealed: str, repeats: int) -> Row:
    """Like :func:`measure`, but chunk by chunk as the system streams a large tensor."""
    pipeline = parse_pipeline(spec)
    chunks, y = encode_chunks(pipeline, x, CHUNK, round_=0)
    out = torch.empty_like(x)
    mb = 4 * x.numel() / 1e6
    enc = best_seconds(
        lambda: [
            pipeline.encode(x[c.start : c.start + c.numel], Place.span(0, c.start, c.numel)) for c in chunks
        ],
        repeats,
    )
    dec = best_seconds(lambda: decode_chunks_into(pipeline, chunks, out, round_=0), repeats)
    return Row(
        name=spec,
        tensor=tensor,
        sealed=sealed,
        bits_per_param=8 * sum(len(c.payload) for c in chunks) / x.numel(),
        rel_l2_error=rel_l2(x, y),
        cosine=cosine(x, y),
        encode_MBps=mb / enc,
        decode_MBps=mb / dec,
        entropy_gain=sum(
            HEADER_SIZE + pipeline.raw_size(c.numel, Place.span(0, c.start, c.numel)) for c in chunks
        )
        / sum(len(c.payload) for c in chunks),
    )


def table(rows: list[Row], memcpy: dict[str, float]) -> str:
    lines = [
        "| pipeline | tensor | sealed | bits/param | zstd gain | rel. L2 error | cosine | encode MB/s "
        "| decode MB/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| `{r.name}` | {r.tensor} | {r.sealed} | {r.bits_per_param:.3f} | {r.entropy_gain:.3f}x | "
            f"{r.rel_l2_error:.4f} | "
            f"{r.cosine:.4f} | {r.encode_MBps:,.0f} | {r.decode_MBps:,.0f} |"
        )
    lines += [f"| memcpy | {t} | | 32 | | 0 | 1 | {v:,.0f} | {v:,.0f} |" for t, v in memcpy.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--pipelines", nargs="*", default=PIPELINES)
    parser.add_argument("--large", type=int, default=1 << 26, help="elements of the large tensor (0: skip)")
    parser.add_argument("--smoke", action="store_true", help="every pipeline once on small tensors")
    args = parser.parse_args(argv)
    if args.smoke:
        args.repeats, args.large = 1, 2 * CHUNK
    torch.set_num_threads(1)
    torch.manual_seed(0)
    gaussian = 1 << (16 if args.smoke else 20)
    tensors = {"pseudo-gradient": pseudo_gradient(2 if args.smoke else 25), "gaussian": torch.randn(gaussian)}
    rows: list[Row] = []
    memcpy: dict[str, float] = {}
    large = LARGE_PIPELINES if args.large else []
    progress = Progress("codec benchmark", (len(tensors) * len(args.pipelines) + len(large)) * len(WRAPPERS))

    def done(row: Row) -> Row:
        progress.advance(note=f"{row.name} ({row.sealed}) on {row.tensor}")
        return row

    for tensor, x in tensors.items():
        memcpy[tensor] = memcpy_mbps(x, args.repeats)
        rows += [
            done(measure(s, tensor, x, sealed, args.repeats)) for s in args.pipelines for sealed in WRAPPERS
        ]
        memcpy[tensor] = max(memcpy[tensor], memcpy_mbps(x, args.repeats))  # before and after
    if args.large:
        tensor, x = f"gaussian {args.large * 4 >> 20} MB, chunked", torch.randn(args.large)
        memcpy[tensor] = memcpy_mbps(x, 5)
        rows += [done(measure_chunked(s, tensor, x, sealed, 5)) for s in large for sealed in WRAPPERS]
        memcpy[tensor] = max(memcpy[tensor], memcpy_mbps(x, 5))
    progress.close()
    print(table(rows, memcpy))
    if args.json:
        entries: list[dict[str, object]] = [asdict(r) for r in rows]
        entries += [{"name": "memcpy_MBps", "tensor": t, "memcpy_MBps": v} for t, v in memcpy.items()]
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(entries, indent=2))


if __name__ == "__main__":
    main()
