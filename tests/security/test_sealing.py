"""AEAD sealing of chunks and files: every bound field matters, keys are separated, nonces fresh."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from geodiloco.security.chunks import KeyMismatch, open_delta, open_update, seal_delta, seal_update
from geodiloco.security.sealing import (
    ChunkHeaderFields,
    Keyring,
    SealError,
    SiteKeys,
    read_sealed,
    write_sealed,
)
from geodiloco.security.secrets import site_secret
from geodiloco.v1 import outer_sync_pb2

RUN_SECRET = bytes(range(32))


def delta_chunk(**header: object) -> outer_sync_pb2.DeltaChunk:
    fields: dict[str, object] = dict(
        run_id="run", round=4, fragment=0, site="site-a", codec="q8|zstd:3", seq=1, start=4096, numel=4096
    )
    fields.update(header)
    return outer_sync_pb2.DeltaChunk(
        header=outer_sync_pb2.ChunkHeader(**fields),
        payload=b"pseudo-gradient bytes" * 10,
        tokens=512,
        total_chunks=3,
    )


def test_site_keys_from_the_site_secret_match_the_coordinators() -> None:
    ring = Keyring(RUN_SECRET, "run")
    site = SiteKeys.derive(site_secret(RUN_SECRET, "site-a"), "run")
    msg = delta_chunk()
    seal_delta(site.up, msg)
    assert open_delta(ring.site("site-a").up, msg) == b"pseudo-gradient bytes" * 10
    assert ring.site("site-a").key_id == site.key_id != ring.site("site-b").key_id


def test_every_header_field_and_stream_field_is_bound() -> None:
    keys = Keyring(RUN_SECRET, "run").site("site-a")
    changes = {
        "run_id": "other",
        "round": 5,
        "fragment": 1,
        "site": "site-b",
        "codec": "fp32",
        "seq": 2,
        "start": 0,
        "numel": 4095,
    }
    for field, value in changes.items():
        msg = delta_chunk()
        seal_delta(keys.up, msg)
        setattr(msg.header, field, value)
        with pytest.raises(SealError, match="authentication tag"):
            open_delta(keys.up, msg)
    for field, value in {"tokens": 513, "total_chunks": 4}.items():
        msg = delta_chunk()
        seal_delta(keys.up, msg)
        setattr(msg, field, value)
        with pytest.raises(SealError, match="authentication tag"):
            open_delta(keys.up, msg)


def test_any_flipped_byte_is_rejected() -> None:
    keys = Keyring(RUN_SECRET, "run").site("site-a")
    msg = delta_chunk()
    seal_delta(keys.up, msg)
    for i in range(len(msg.payload)):
        bad = outer_sync_pb2.DeltaChunk()
        bad.CopyFrom(msg)
        flipped = bytearray(msg.payload)
        flipped[i] ^= 0x80
        bad.payload = bytes(flipped)
        with pytest.raises(SealError):
            open_delta(keys.up, bad)
    nonce = bytearray(msg.header.nonce)
    nonce[0] ^= 1
    msg.header.nonce = bytes(nonce)
    with pytest.raises(SealError):
        open_delta(keys.up, msg)


def test_directions_runs_and_sites_have_separate_keys() -> None:
    ring = Keyring(RUN_SECRET, "run")
    msg = delta_chunk()
    seal_delta(ring.site("site-a").up, msg)
    for sealer in (ring.site("site-a").down, Keyring(RUN_SECRET, "run-2").site("site-a").up):
        with pytest.raises(SealError):
            open_delta(sealer, msg)
    with pytest.raises(KeyMismatch, match="key id"):
        open_delta(ring.site("site-b").up, msg)  # different key id: named as a wrong secret
    update = outer_sync_pb2.UpdateChunk(header=msg.header, payload=b"x" * 40, next_round=5, kind=1)
    seal_update(ring.site("site-a").down, update)
    assert open_update(ring.site("site-a").down, update) == b"x" * 40
    update.kind = 2  # an update relabelled as full state
    with pytest.raises(SealError):
        open_update(ring.site("site-a").down, update)


def test_nonces_are_fresh_even_for_identical_chunks() -> None:
    """A site that crashes and re-pushes the same round must never reuse a nonce."""
    keys = Keyring(RUN_SECRET, "run").site("site-a")
    nonces = set()
    for _ in range(2000):
        msg = delta_chunk()
        seal_delta(keys.up, msg)
        nonces.add(msg.header.nonce)
    assert len(nonces) == 2000 and all(len(n) == 12 for n in nonces)


def test_aad_encoding_is_unambiguous() -> None:
    base = ChunkHeaderFields("up", "ab", 1, 0, "c", 0, 0, 1, "q8", "delta", 7)
    shifted = dataclasses.replace(base, run_id="a", site="bc")  # same concatenated text
    assert base.aad() != shifted.aad()


def test_sealed_files_open_only_unaltered_with_their_label(tmp_path: Path) -> None:
    ring = Keyring(RUN_SECRET, "run")
    path = tmp_path / "state.sealed"
    write_sealed(path, b"theta and momentum", ring.at_rest("state"), "state")
    assert b"theta" not in path.read_bytes()
    assert read_sealed(path, ring.at_rest("state"), "state") == b"theta and momentum"
    with pytest.raises(SealError):
        read_sealed(path, ring.at_rest("state"), "checkpoint")
    with pytest.raises(SealError):
        read_sealed(path, Keyring(os.urandom(32), "run").at_rest("state"), "state")
    blob = bytearray(path.read_bytes())
    blob[-1] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(SealError):
        read_sealed(path, ring.at_rest("state"), "state")


def test_key_objects_never_print_their_secrets() -> None:
    ring = Keyring(RUN_SECRET, "run")
    text = repr(ring) + repr(ring.site("site-a")) + repr(ring.at_rest("state"))
    assert RUN_SECRET.hex() not in text and site_secret(RUN_SECRET, "site-a").hex() not in text
    assert "run" in text


def test_open_into_writes_the_payload_where_it_is_told_and_refuses_what_open_refuses() -> None:
    """A restart opens its state straight into the memory it keeps: the same bytes open() gives,
    in the buffer given, and the same refusals (another label, a flipped byte, a wrong size)."""
    key = Keyring(RUN_SECRET, "run").at_rest("state")
    payload = os.urandom(5000)
    nonce, sealed = key.seal(payload, b"label")
    out = bytearray(len(payload) + 8)
    key.open_into(nonce, memoryview(sealed), b"label", memoryview(out)[4:-4])
    assert bytes(out[4:-4]) == key.open(nonce, sealed, b"label") == payload
    assert out[:4] == out[-4:] == bytes(4)  # nothing written outside
    flipped = bytearray(sealed)
    flipped[7] ^= 1
    for args in ((sealed, b"other"), (bytes(flipped), b"label")):
        with pytest.raises(SealError, match="authentication tag mismatch"):
            key.open_into(nonce, args[0], args[1], memoryview(bytearray(len(payload))))
    with pytest.raises(SealError, match="to open"):
        key.open_into(nonce, sealed, b"label", memoryview(bytearray(len(payload) - 1)))
