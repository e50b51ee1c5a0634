"""The conformance vectors, both ways: Python reads the committed ones, and writes them unchanged.

A failure of the first kind means the implementation changed the wire; of the second, that the
vectors were edited by hand or are stale (regenerate with scripts/protocol_vectors.py, on purpose).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from google.protobuf.json_format import ParseDict

from geodiloco.compression import CodecError, parse_pipeline
from geodiloco.params import state_hash
from geodiloco.security.chunks import open_delta, open_update
from geodiloco.security.joinproof import join_proof
from geodiloco.security.sealing import Sealer, SealError, SiteKeys
from geodiloco.security.secrets import site_secret
from geodiloco.v1 import outer_sync_pb2

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "tests" / "protocol" / "vectors"


def load(name: str) -> Any:
    return json.loads((VECTORS / f"{name}.json").read_text())


def f32(hex_text: str) -> torch.Tensor:
    data = bytearray.fromhex(hex_text)
    return torch.frombuffer(data, dtype=torch.float32) if data else torch.zeros(0)


FRAMES = load("frames")["frames"]


@pytest.mark.parametrize("case", FRAMES, ids=[c["name"] for c in FRAMES])
def test_python_decodes_every_frame(case: dict[str, Any]) -> None:
    pipeline = parse_pipeline(case["spec"])
    assert (pipeline.canonical, pipeline.tag) == (case["canonical"], case["tag"])
    decoded = pipeline.decode(bytes.fromhex(case["frame"]), case["numel"])
    assert decoded.numpy().tobytes().hex() == case["decoded_f32le"]
    if case["encode_exact"] and "note" not in case:
        assert pipeline.encode(f32(case["input_f32le"])).hex() == case["frame"]


@pytest.mark.parametrize("case", FRAMES, ids=[c["name"] for c in FRAMES])
def test_a_flipped_body_byte_is_refused(case: dict[str, Any]) -> None:
    frame = bytearray.fromhex(case["frame"])
    frame[-1] ^= 0x01
    with pytest.raises(CodecError):
        parse_pipeline(case["spec"]).decode(bytes(frame), case["numel"])


def test_spec_canonical_forms_and_tags() -> None:
    for spec in load("frames")["specs"]:
        pipeline = parse_pipeline(spec["spec"])
        assert (pipeline.canonical, pipeline.tag) == (spec["canonical"], spec["tag"])


def test_python_opens_every_sealed_vector() -> None:
    v = load("sealing")
    secret = site_secret(bytes.fromhex(v["run_secret"]), v["site"])
    assert secret.hex() == v["site_secret"]
    keys = SiteKeys.derive(secret, v["run_id"])
    assert keys.key_id == v["key_id"]
    for other in v["key_ids"]:
        assert SiteKeys.derive(bytes.fromhex(other["site_secret"]), other["run_id"]).key_id == other["key_id"]
    for case in v["cases"]:
        kind = case["message"]
        msg = ParseDict(case["fields"], getattr(outer_sync_pb2, kind)())
        msg.header.nonce = bytes.fromhex(case["nonce"])
        msg.payload = bytes.fromhex(case["sealed"])
        sealer: Sealer = keys.up if case["key"] == "up" else keys.down
        opened = open_delta(sealer, msg) if kind == "DeltaChunk" else open_update(sealer, msg)
        assert opened.hex() == case["plaintext"]
        msg.header.start += 1  # any field of the AAD moved: the tag fails
        with pytest.raises(SealError):
            open_delta(sealer, msg) if kind == "DeltaChunk" else open_update(sealer, msg)


def test_python_join_proofs_match() -> None:
    v = load("sealing")
    secret = bytes.fromhex(v["site_secret"])
    for case in v["join_proofs"]:
        proof = join_proof(secret, case["run_id"], v["site"], case["world_size"])
        assert proof.hex() == case["proof"]
        assert join_proof(secret, case["run_id"], v["site"], case["world_size"] + 1) != proof


def test_python_hashes_match() -> None:
    for case in load("hash")["cases"]:
        values = f32(case["values_f32le"])
        assert values.numel() == case["numel"]
        assert state_hash(values) == case["hash"]


def test_vectors_are_what_python_writes_today(tmp_path: Path) -> None:
    script = ROOT / "scripts" / "protocol_vectors.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True)
    for name in ("frames", "sealing", "hash"):
        fresh = (tmp_path / f"{name}.json").read_text()
        assert fresh == (VECTORS / f"{name}.json").read_text(), f"{name}.json is stale: regenerate it"
