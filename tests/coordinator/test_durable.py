"""The coordinator's durable state at rest: sealed when the run seals, refused when it is not
the file this run wrote (tampered, truncated, another run secret, sealed-ness swapped)."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
from pathlib import Path

import pytest
import torch
import xxhash

from geodiloco.app import cli
from geodiloco.coordinator import durable, unbuffered
from geodiloco.coordinator.durable import (
    SEALED_MAGIC,
    STATE_FILE,
    STATE_LABEL,
    CorruptStateError,
    StateError,
    load_state,
    save_state,
)
from geodiloco.coordinator.rounds import RoundController
from geodiloco.security.sealing import Keyring, Sealer
from geodiloco.testing.configs import tiny_config

N = 1000
RUN_SECRET = bytes(range(32))


def sealer(secret: bytes = RUN_SECRET) -> Sealer:
    return Keyring(secret, "test-run").at_rest(STATE_LABEL)


def controller(run_dir: Path, key: Sealer | None) -> RoundController:
    cfg = tiny_config(round_timeout_s=0.2, limits__max_delta_norm_ratio=0.0, snapshot_every=1)
    return RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, run_dir, key)


async def commit_round(c: RoundController, value: float) -> None:
    for name in c.cfg.sites:
        await c.join(name, "")
    for name in c.cfg.sites:
        await c.contribute(name, "", c.round, 100, torch.full((N,), value))


def test_sealed_state_hides_theta_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    c = controller(tmp_path, sealer())
    asyncio.run(commit_round(c, 0.123456))
    blob = (tmp_path / STATE_FILE).read_bytes()
    assert blob.startswith(SEALED_MAGIC)
    theta_bytes = c.theta.numpy().tobytes()
    assert theta_bytes[:64] not in blob  # the parameters are not there in the clear
    restarted = controller(tmp_path, sealer())
    assert restarted.round == 1 and torch.equal(restarted.theta, c.theta)
    assert restarted.hashes == c.hashes


def test_tampered_sealed_state_is_refused(tmp_path: Path) -> None:
    asyncio.run(commit_round(controller(tmp_path, sealer()), 0.5))
    path = tmp_path / STATE_FILE
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match="does not authenticate"):
        controller(tmp_path, sealer())
    path.write_bytes(bytes(data[:-1]))
    with pytest.raises(CorruptStateError, match="truncated or altered"):
        controller(tmp_path, sealer())


def test_state_sealed_under_another_run_secret_is_refused(tmp_path: Path) -> None:
    asyncio.run(commit_round(controller(tmp_path, sealer()), 0.5))
    with pytest.raises(StateError, match="another run secret"):
        controller(tmp_path, sealer(os.urandom(32)))


def test_sealed_and_plain_states_are_not_interchangeable(tmp_path: Path) -> None:
    sealed_dir, plain_dir = tmp_path / "sealed", tmp_path / "plain"
    asyncio.run(commit_round(controller(sealed_dir, sealer()), 0.5))
    asyncio.run(commit_round(controller(plain_dir, None), 0.5))
    with pytest.raises(StateError, match="is sealed: start the coordinator with the run's --run-secret"):
        controller(sealed_dir, None)
    with pytest.raises(StateError, match="is not sealed, but this run seals its state"):
        controller(plain_dir, sealer())


def test_segments_cannot_be_reordered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(durable, "SEGMENT_BYTES", 1024)
    path = tmp_path / STATE_FILE
    state = {"theta": torch.arange(2048, dtype=torch.float32)}
    save_state(path, state, sealer())
    assert torch.equal(load_state(path, sealer())["theta"], state["theta"])  # type: ignore[index]
    header, seg = durable._SEALED_HEADER.size, 12 + 1024 + 16
    data = path.read_bytes()
    swapped = data[:header] + data[header + seg : header + 2 * seg] + data[header : header + seg]
    path.write_bytes(swapped + data[header + 2 * seg :])
    with pytest.raises(CorruptStateError, match="segment 0 does not authenticate"):
        load_state(path, sealer())


def test_a_sealed_file_cut_at_a_segment_boundary_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every segment knows whether it is the last: dropping whole segments off the end (or
    appending a sealed segment of this file) does not authenticate."""
    monkeypatch.setattr(durable, "SEGMENT_BYTES", 1024)
    path = tmp_path / STATE_FILE
    save_state(path, {"theta": torch.arange(2048, dtype=torch.float32)}, sealer())
    header, seg = durable._SEALED_HEADER.size, 12 + 1024 + 16
    data = path.read_bytes()
    count = -(-(len(data) - header) // seg)
    path.write_bytes(data[: header + (count - 1) * seg])
    with pytest.raises(CorruptStateError, match=f"segment {count - 2} does not authenticate"):
        load_state(path, sealer())
    path.write_bytes(data + data[header : header + seg])
    with pytest.raises(CorruptStateError, match="does not authenticate"):
        load_state(path, sealer())


@pytest.mark.parametrize("length", [0, 1023, 1024, 1025, 4096])
def test_streamed_payloads_of_any_length_read_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, length: int
) -> None:
    """Segment edges: empty, one short of, exactly at and one past a segment, several segments;
    sealed and checksummed, written in pieces that straddle segments."""
    monkeypatch.setattr(durable, "SEGMENT_BYTES", 1024)
    payload = os.urandom(length)
    for key in (None, sealer()):
        path = tmp_path / f"{length}-{key is None}"
        with durable.DurableWriter(path, key, "label") as out:
            for at in range(0, length, 700):
                out.write(payload[at : at + 700])
            out.commit()
        assert durable.read_payload(path, key, "label") == payload
        assert not path.with_name(path.name + ".tmp").exists()


def test_an_uncommitted_writer_leaves_the_previous_file(tmp_path: Path) -> None:
    path = tmp_path / "f"
    with durable.DurableWriter(path, None, "label") as out:
        out.write(b"before")
        out.commit()
    with durable.DurableWriter(path, None, "label") as out:
        out.write(b"after")
    assert durable.read_payload(path, None, "label") == b"before"
    assert [p.name for p in tmp_path.iterdir()] == ["f"]


def test_files_of_the_earlier_formats_still_read(tmp_path: Path) -> None:
    """Checksum in the header (GDLSTAT2) and segment count in the header (GDLSTAS1): a run
    directory written before the streamed formats resumes."""
    state = {"round": 3, "theta": torch.arange(5000, dtype=torch.float32)}
    new = tmp_path / "new"
    save_state(new, state)
    payload = bytes(durable.read_payload(new, None, STATE_LABEL))
    old = tmp_path / "old"
    digest = xxhash.xxh3_128(payload).digest()
    old.write_bytes(durable._HEADER.pack(durable.MAGIC_HEADED, digest, len(payload)) + payload)
    assert torch.equal(load_state(old)["theta"], state["theta"])  # type: ignore[index]
    key = sealer()
    aad = durable.SEALED_MAGIC_COUNTED + STATE_LABEL.encode()
    aad += durable._SEGMENT_AAD_COUNTED.pack(0, 1, durable.SEGMENT_BYTES, len(payload))
    nonce, sealed = key.seal(payload, aad)
    header = durable._SEALED_HEADER_COUNTED.pack(
        durable.SEALED_MAGIC_COUNTED, key.key_id, len(payload), durable.SEGMENT_BYTES
    )
    old.write_bytes(header + nonce + sealed)
    assert torch.equal(load_state(old, key)["theta"], state["theta"])  # type: ignore[index]
    old.write_bytes(header + nonce + sealed[:-1])
    with pytest.raises(CorruptStateError, match="truncated or altered"):
        load_state(old, key)


def test_serve_refuses_a_sealed_state_without_the_secret_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "coord"
    asyncio.run(commit_round(controller(run_dir, sealer()), 0.5))
    config = tmp_path / "run.json"
    config.write_text(tiny_config().to_json())
    args = ["coordinator", "serve", "--config", str(config), "--port", "0", "--run-dir", str(run_dir)]
    assert cli.main([*args, "--insecure"]) == 2
    err = capsys.readouterr().err
    assert "is sealed: start the coordinator with the run's --run-secret" in err
    assert "Traceback" not in err


def test_resume_needs_neither_theta_nor_the_data(tmp_path: Path) -> None:
    """A restart builds no model and reads no corpus: θ and the ledger come from the snapshot."""
    first = controller(tmp_path, None)
    asyncio.run(commit_round(first, 0.5))
    resumed = RoundController(first.cfg, None, None, tmp_path)
    assert resumed.round == first.round == 1
    assert torch.equal(resumed.theta, first.theta)
    assert resumed.ledger.state_dict() == first.ledger.state_dict()
    with pytest.raises(StateError, match="no saved state"):
        RoundController(first.cfg, None, None, tmp_path / "empty")


def test_unsealed_state_is_checksummed_and_earlier_sha256_files_still_read(tmp_path: Path) -> None:
    state = {"round": 3, "theta": torch.arange(5000, dtype=torch.float32)}
    path = tmp_path / STATE_FILE
    save_state(path, state)
    blob = bytearray(path.read_bytes())
    assert blob.startswith(durable.MAGIC)
    assert torch.equal(load_state(path)["theta"], state["theta"])  # type: ignore[index]
    blob[-7 - durable._TRAILER.size] ^= 1  # one bit of θ
    path.write_bytes(blob)
    with pytest.raises(CorruptStateError, match="checksum mismatch"):
        load_state(path)
    # a file of the first version (SHA-256 header) is read, and checked, the same way
    payload = bytes(blob[len(durable.MAGIC) : -durable._TRAILER.size])
    payload = payload[:-7] + bytes([payload[-7] ^ 1]) + payload[-6:]
    old = durable._HEADER_SHA256.pack(durable.MAGIC_SHA256, hashlib.sha256(payload).digest(), len(payload))
    path.write_bytes(old + payload)
    assert torch.equal(load_state(path)["theta"], state["theta"])  # type: ignore[index]
    path.write_bytes(old + payload[:-1] + b"\0")
    with pytest.raises(CorruptStateError, match="checksum mismatch"):
        load_state(path)


@pytest.mark.parametrize("sealed", [False, True])
def test_large_tensors_load_as_aligned_views_of_the_file_read_once(tmp_path: Path, sealed: bool) -> None:
    """Each tensor is padded to a page-aligned offset of the memory the file is read (unsealed)
    or opened (sealed) into: a large tensor is that memory (no copy), wherever it falls after an
    odd skeleton and odd-sized tensors; a small one is a copy (it would hold the whole file
    alive)."""
    key = sealer() if sealed else None
    big = durable.VIEW_BYTES // 4 + 3
    state = {
        "round": 7,
        "odd": torch.arange(5, dtype=torch.int64),
        "theta": torch.randn(big),
        "m": torch.randn(big),
    }
    path = tmp_path / STATE_FILE
    save_state(path, state, key)
    loaded = load_state(path, key)
    assert loaded is not None
    for name in ("odd", "theta", "m"):
        assert torch.equal(loaded[name], state[name])
    views = [loaded["theta"], loaded["m"]]
    assert all(t.data_ptr() % 4096 == 0 for t in views)
    assert views[1].data_ptr() - views[0].data_ptr() == -(-(big * 4 + 8) // 4096) * 4096  # one read
    odd = loaded["odd"].data_ptr()
    assert not views[0].data_ptr() - 2 * 4096 < odd < views[0].data_ptr()  # not in the file's memory
    loaded["theta"] += 1  # a view is writable, as a fresh tensor is
    assert torch.equal(loaded["theta"], state["theta"] + 1)


def test_states_without_padding_still_read_and_a_bad_pad_is_refused(tmp_path: Path) -> None:
    """GDLRAW01 (tensors back to back) is read by copying; a padding length no writer gives (a
    file written by hand with its checksum made right) is refused, not trusted."""
    theta = torch.randn(durable.VIEW_BYTES // 4 + 1)
    skeleton, tensors = durable._split({"round": 2, "theta": theta}, [])
    meta = io.BytesIO()
    torch.save(skeleton, meta)
    head = meta.tell().to_bytes(8, "little") + meta.getvalue()
    path = tmp_path / STATE_FILE
    with durable.DurableWriter(path, None, STATE_LABEL) as out:
        out.write(durable.RAW_MAGIC_UNPADDED + head)
        out.write(durable._bytes_of(tensors[0]))
        out.commit()
    assert torch.equal(load_state(path)["theta"], theta)  # type: ignore[index]
    with durable.DurableWriter(path, None, STATE_LABEL) as out:
        out.write(durable.RAW_MAGIC + head + (4096).to_bytes(8, "little") + bytes(4096))
        out.write(durable._bytes_of(tensors[0]))
        out.commit()
    with pytest.raises(CorruptStateError, match="4096 bytes of padding before a tensor"):
        load_state(path)


def test_a_sealed_state_read_ahead_resumes_the_same(tmp_path: Path) -> None:
    """A restarted coordinator reads its snapshot ahead, before its imports (sealed or not): the
    state it resumes is the one a plain read gives, and the read ahead is used up."""
    c = controller(tmp_path, sealer())
    asyncio.run(commit_round(c, 0.25))
    unbuffered.read_ahead(tmp_path / STATE_FILE)
    restarted = controller(tmp_path, sealer())
    assert unbuffered.taken_ahead(tmp_path / STATE_FILE) is None
    assert restarted.round == 1 and torch.equal(restarted.theta, c.theta)
    assert restarted.hashes == c.hashes
