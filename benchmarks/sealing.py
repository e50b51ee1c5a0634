"""What sealing costs on top of the int8 codec pipeline, on one core.

Encodes a ~4M-element fp32 tensor with ``q8|zstd:3`` in 1M-element chunks (as a site does), with
and without sealing each chunk's message (AES-256-GCM, header as associated data), and decodes
it with and without opening them. Target: sealing adds at most 25% to the pipeline's time.

    python benchmarks/sealing.py [--numel N] [--repeats R] [--json PATH] [--smoke]

``--smoke`` (two chunks, one repeat: a second) only checks that the benchmark still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from geodiloco.compression import EncodedChunk, encode_chunks, parse_pipeline
from geodiloco.security.chunks import open_delta, seal_delta
from geodiloco.security.sealing import Keyring
from geodiloco.v1 import outer_sync_pb2

CODEC = "q8|zstd:3"
CHUNK_ELEMENTS = 1 << 20
TARGET_OVERHEAD = 0.25


def messages(chunks: list[EncodedChunk]) -> list[Any]:
    return [
        outer_sync_pb2.DeltaChunk(
            header=outer_sync_pb2.ChunkHeader(
                run_id="bench", round=3, site="site-a", codec=CODEC, seq=i, start=c.start, numel=c.numel
            ),
            payload=c.payload,
            tokens=1000,
            total_chunks=len(chunks),
        )
        for i, c in enumerate(chunks)
    ]


def best_of_pair(a: Callable[[], object], b: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Best time of each, the two alternated so that drift in machine load hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(repeats):
        for fn, out in ((a, times[0]), (b, times[1])):
            started = time.perf_counter()
            fn()
            out.append(time.perf_counter() - started)
    return min(times[0]), min(times[1])


def run(numel: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pipeline = parse_pipeline(CODEC)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3
    keys = Keyring(os.urandom(32), "bench").site("site-a")
    chunks, _ = encode_chunks(pipeline, x, CHUNK_ELEMENTS, round_=0)
    sealed = messages(chunks)
    for m in sealed:
        seal_delta(keys.up, m)
    out = torch.empty(numel)

    def encode_plain() -> None:
        messages(encode_chunks(pipeline, x, CHUNK_ELEMENTS, round_=0)[0])

    def encode_sealed() -> None:
        for m in messages(encode_chunks(pipeline, x, CHUNK_ELEMENTS, round_=0)[0]):
            seal_delta(keys.up, m)

    plain = messages(chunks)

    def decode(stream: list[Any], open_first: bool) -> None:
        for m in stream:
            payload = open_delta(keys.up, m) if open_first else m.payload
            out[m.header.start : m.header.start + m.header.numel] = pipeline.decode(payload, m.header.numel)

    t: dict[str, float] = {}
    t["encode_s"], t["encode_sealed_s"] = best_of_pair(encode_plain, encode_sealed, repeats)
    t["decode_s"], t["decode_opened_s"] = best_of_pair(
        lambda: decode(plain, False), lambda: decode(sealed, True), repeats
    )
    # The AEAD alone, the least noisy view of the same cost on a shared machine.
    t["seal_only_s"], t["open_only_s"] = best_of_pair(
        lambda: [seal_delta(keys.up, m) for m in messages(chunks)],
        lambda: [open_delta(keys.up, m) for m in sealed],
        repeats,
    )
    encode_overhead = t["encode_sealed_s"] / t["encode_s"] - 1
    decode_overhead = t["decode_opened_s"] / t["decode_s"] - 1
    payload_bytes = sum(len(c.payload) for c in chunks)
    return {
        "numel": numel,
        "codec": CODEC,
        "aead": "AES-256-GCM",
        "chunks": len(chunks),
        "payload_bytes": payload_bytes,
        "sealing_bytes_added": sum(m.ByteSize() for m in sealed) - sum(m.ByteSize() for m in plain),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        **{k: round(v, 6) for k, v in t.items()},
        "encode_overhead": round(encode_overhead, 4),
        "decode_overhead": round(decode_overhead, 4),
        "pipeline_overhead": round(
            (t["encode_sealed_s"] + t["decode_opened_s"]) / (t["encode_s"] + t["decode_s"]) - 1, 4
        ),
        "aead_overhead": round((t["seal_only_s"] + t["open_only_s"]) / (t["encode_s"] + t["decode_s"]), 4),
        "target_overhead": TARGET_OVERHEAD,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=4 << 20, help="elements (default 4Mi)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats, best kept (default 15)")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--smoke", action="store_true", help="two chunks, one repeat: does it still run")
    args = parser.parse_args()
    if args.smoke:
        args.numel, args.repeats = 2 * CHUNK_ELEMENTS, 1
    r = run(args.numel, args.repeats)
    ms = {k: r[k] * 1e3 for k in ("encode_s", "encode_sealed_s", "decode_s", "decode_opened_s")}
    print(
        f"{r['numel']:,} fp32 elements, {CODEC}, {r['chunks']} chunks, {r['payload_bytes']:,} bytes, 1 thread"
    )
    for plain, sealed, label, overhead in (
        ("encode_s", "encode_sealed_s", "sealed", r["encode_overhead"]),
        ("decode_s", "decode_opened_s", "opened", r["decode_overhead"]),
    ):
        print(f"{plain[:6]} {ms[plain]:7.1f} ms, {label} {ms[sealed]:7.1f} ms ({overhead:+.1%})")
    print(
        f"both ways {r['pipeline_overhead']:+.1%} (target <= {TARGET_OVERHEAD:.0%}); "
        f"{r['sealing_bytes_added']} bytes added on the wire"
    )
    print(
        f"AEAD alone: seal {r['seal_only_s'] * 1e3:.2f} ms + open {r['open_only_s'] * 1e3:.2f} ms = "
        f"{r['aead_overhead']:+.1%} of encode + decode"
    )
    if args.json:
        args.json.write_text(json.dumps(r, indent=2))


if __name__ == "__main__":
    main()
