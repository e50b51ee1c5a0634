#!/usr/bin/env python3
"""Write the protocol conformance vectors (docs/protocol.md §11) from the Python implementation.

Run it after a deliberate change of the wire format, then commit the JSON files:
``python scripts/protocol_vectors.py`` (default output ``tests/protocol/vectors``).
tests/protocol/test_vectors.py checks that the committed files are exactly what this writes.
Every input is fixed (seeded generators, fixed nonces), so the output is deterministic.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from geodiloco.compression import parse_pipeline
from geodiloco.compression.entropy import stored_frame
from geodiloco.compression.envelope import seal as frame
from geodiloco.params import state_hash
from geodiloco.security.chunks import delta_aad, update_aad  # the AAD bytes themselves are the vector
from geodiloco.security.joinproof import join_proof
from geodiloco.security.sealing import SiteKeys, key_id
from geodiloco.security.secrets import hkdf, site_secret
from geodiloco.v1 import outer_sync_pb2

OUT = Path(__file__).resolve().parent.parent / "tests" / "protocol" / "vectors"


def f32le(values: torch.Tensor) -> str:
    return values.to(torch.float32).contiguous().numpy().astype("<f4").tobytes().hex()


def numbers(values: torch.Tensor) -> list[float] | None:
    """Readable values for small cases only; the ``*_f32le`` hex is authoritative."""
    return [float(v) for v in values.to(torch.float32).tolist()] if values.numel() <= 16 else None


def gaussian(seed: int, n: int, scale: float = 1.0) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy((rng.standard_normal(n) * scale).astype(np.float32))


def frame_case(name: str, spec: str, x: torch.Tensor, *, exact: bool) -> dict[str, Any]:
    """One frame: ``exact`` cases must be encoded to these very bytes (no zstd compressor choice)."""
    pipeline = parse_pipeline(spec)
    data, back = pipeline.roundtrip(x)
    return {
        "name": name,
        "spec": spec,
        "canonical": pipeline.canonical,
        "tag": pipeline.tag,
        "numel": x.numel(),
        "input": numbers(x),
        "input_f32le": f32le(x),
        "frame": data.hex(),
        "decoded": numbers(back),
        "decoded_f32le": f32le(back),
        "encode_exact": exact,
    }


def stored_q8_zstd_case() -> dict[str, Any]:
    """q8|zstd:3 with the high nibbles in a raw-block zstd frame (what a sender without a zstd
    compressor writes): every receiver must decode it like a compressed one."""
    x = gaussian(7, 301, 0.01)
    q8 = parse_pipeline("q8")
    raw = q8.values.encode(x)
    head = raw.numel() - x.numel()
    codes = raw[head:].numpy().tobytes()
    hi = bytearray((len(codes) + 1) // 2)
    lo = bytearray(len(hi))
    for j, c in enumerate(codes):
        hi[j // 2] |= (c >> 4) << (4 * (j % 2))
        lo[j // 2] |= (c & 0x0F) << (4 * (j % 2))
    pipeline = parse_pipeline("q8|zstd:3")
    body = raw[:head].numpy().tobytes() + bytes(lo) + stored_frame(bytes(hi))
    data = frame(pipeline.tag, x.numel(), body)
    back = pipeline.decode(data, x.numel())
    case = frame_case("q8_zstd_stored_301", "q8|zstd:3", x, exact=False)
    case.update(frame=data.hex(), decoded=numbers(back), decoded_f32le=f32le(back), encode_exact=True)
    case["note"] = "raw-block zstd frame for the high nibbles: the form a compressor-less sender writes"
    return case


def frames() -> dict[str, Any]:
    ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 3.25], dtype=torch.float32)
    zeros_then = torch.cat([torch.zeros(128), gaussian(3, 40)])
    cases = [
        frame_case("fp32_5", "fp32", torch.tensor([1.0, -0.0, 3.5e-42, -2.75, 1e30]), exact=True),
        frame_case("q8_ties", "q8", ties, exact=True),
        frame_case("q8_300", "q8", gaussian(1, 300, 0.02), exact=True),
        frame_case("q8_zero_block", "q8", zeros_then, exact=True),
        frame_case("q8_64_200", "q8:64", gaussian(2, 200), exact=True),
        frame_case("q4_257", "q4", gaussian(4, 257, 0.5), exact=True),
        frame_case("q4_ties", "q4", ties, exact=True),
        frame_case("q8_zstd_301", "q8|zstd:3", gaussian(5, 301, 0.01), exact=False),
        stored_q8_zstd_case(),
        frame_case("q4_zstd_130", "q4|zstd:3", gaussian(6, 130), exact=False),
        frame_case("fp32_zstd_full_state_1000", "fp32|zstd:1", gaussian(8, 1000, 0.1), exact=False),
    ]
    specs = [
        {"spec": s, "canonical": parse_pipeline(s).canonical, "tag": parse_pipeline(s).tag}
        for s in ("fp32", "q8", "q8:64", "q4", "q8|zstd", "q8|zstd:3", " q8 | zstd:1 ", "fp32|zstd:1")
    ]
    return {"specs": specs, "frames": cases}


def _ranges(msg: Any, *ranges: tuple[int, int, int, int]) -> None:
    for shard, start, end, epoch in ranges:
        msg.data.add(shard=shard, start=start, end=end, epoch=epoch)


def sealing() -> dict[str, Any]:
    run_secret = bytes(range(32))
    run_id, site = "vector-run", "site-ts"
    secret = site_secret(run_secret, site)
    keys = SiteKeys.derive(secret, run_id)
    up = hkdf(secret, f"chunk\0{run_id}\0up".encode())
    down = hkdf(secret, f"chunk\0{run_id}\0down".encode())
    payload = frame(parse_pipeline("q8").tag, 3, bytes(4) + bytes([1, 2, 3]))

    delta = outer_sync_pb2.DeltaChunk(tokens=4096, total_chunks=2, part=0, parts=1)
    h = delta.header
    h.run_id, h.round, h.fragment, h.site, h.codec, h.seq = run_id, 7, 0, site, "q8", 0
    h.start, h.numel, h.key_id = 1000, 3, keys.key_id
    _ranges(delta, (3, 40, 64, 0), (5, 0, 8, 1))
    strided = outer_sync_pb2.DeltaChunk(tokens=4096, total_chunks=2, part=1, parts=0)
    strided.header.CopyFrom(h)
    strided.header.seq, strided.header.rows, strided.header.stride, strided.header.numel = 1, 3, 100, 6

    update = outer_sync_pb2.UpdateChunk(
        next_round=8, state_hash="ab" * 32, total_chunks=1, finished=False, kind=1
    )
    update.header.CopyFrom(h)
    update.header.codec = "q8|zstd:3"
    _ranges(update, (3, 64, 88, 0))
    full = outer_sync_pb2.UpdateChunk(
        next_round=8, state_hash="cd" * 32, total_chunks=4, finished=True, kind=2
    )
    full.header.CopyFrom(h)
    full.header.codec, full.header.seq = "fp32|zstd:1", 3

    cases = []
    for i, (name, msg, aad_of, key) in enumerate(
        (
            ("delta", delta, delta_aad, up),
            ("delta_strided_parts0", strided, delta_aad, up),
            ("update", update, update_aad, down),
            ("full_state_finished", full, update_aad, down),
        )
    ):
        nonce = bytes([i + 1]) * 12
        aad = aad_of(msg)
        cases.append(
            {
                "name": name,
                "message": msg.__class__.__name__,
                "fields": json.loads(_json_of(msg)),
                "aad": aad.hex(),
                "key": "up" if key is up else "down",
                "nonce": nonce.hex(),
                "plaintext": payload.hex(),
                "sealed": AESGCM(key).encrypt(nonce, payload, aad).hex(),
            }
        )
    other_run = "another-run"
    return {
        "run_secret": run_secret.hex(),
        "site": site,
        "run_id": run_id,
        "hkdf_salt": b"geodiloco/v1".hex(),
        "site_secret": secret.hex(),
        "key_id": keys.key_id,
        "key_up": up.hex(),
        "key_down": down.hex(),
        "key_ids": [
            {"site_secret": secret.hex(), "run_id": other_run, "key_id": key_id(secret, other_run)},
            {"site_secret": bytes(32).hex(), "run_id": "", "key_id": key_id(bytes(32), "")},
        ],
        "cases": cases,
        "join_proofs": [
            {"run_id": run_id, "world_size": 4, "proof": join_proof(secret, run_id, site, 4).hex()},
            {"run_id": "", "world_size": 0, "proof": join_proof(secret, "", site, 0).hex()},
        ],
    }


def _json_of(msg: Any) -> str:
    from google.protobuf.json_format import MessageToJson

    return MessageToJson(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def hashes() -> dict[str, Any]:
    specials = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4028235e38, 1e-45, float(np.float32(0.1))])
    cases = []
    for name, x in (
        ("empty", torch.zeros(0)),
        ("specials_7", specials),
        ("gaussian_5000", gaussian(9, 5000)),
    ):
        cases.append({"name": name, "numel": x.numel(), "values_f32le": f32le(x), "hash": state_hash(x)})
    return {"cases": cases}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="directory for the JSON files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, content in (("frames", frames()), ("sealing", sealing()), ("hash", hashes())):
        (args.out / f"{name}.json").write_text(json.dumps(content, indent=1, sort_keys=True) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
