"""A single rank's pull applied as it arrives: each chunk once, whatever a retry brings again."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from geodiloco.compression import EncodedChunk, Place, encode_chunks, envelope, parse_pipeline
from geodiloco.compression.codec_error import CodecError
from geodiloco.compression.staging import Staging
from geodiloco.exchange import PulledPart, StreamFacts
from geodiloco.params import state_hash
from geodiloco.site.pull_apply import ApplyAsPulled, TornSnapshot
from geodiloco.site.shards import ShardMap
from helpers import CUDA

CODEC = "q8|zstd:1"


def model_on(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(30, 40), nn.Linear(40, 7)).to(device)


def stream(
    numel: int, round_: int, full_state: bool = False
) -> tuple[list[EncodedChunk], StreamFacts, torch.Tensor]:
    """A stream's chunks, its facts and the values a receiver decodes from it."""
    spec = "fp32" if full_state else CODEC
    codec = parse_pipeline(spec)
    chunks, _ = encode_chunks(codec, torch.randn(numel) * 1e-2, 300, round_=round_)
    values = torch.cat(
        [codec.decode(c.payload, c.numel, Place.span(round_, c.start, c.numel)) for c in chunks]
    )
    return chunks, StreamFacts(full_state, spec, round_, f"hash-{round_}-{full_state}"), values


def pulled_part(chunks: list[EncodedChunk], facts: StreamFacts) -> PulledPart:
    return PulledPart(
        facts.is_full_state, facts.codec, len(chunks), dict(enumerate(chunks)), facts.round,
        facts.round + 1, facts.state_hash, False, [],
    )  # fmt: skip


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_retried_stream_adds_each_chunk_once(device: str) -> None:
    shards = ShardMap(model_on(device), 0, 1)
    snapshot = shards.clone_locals()
    base = shards.gather_owned(snapshot).cpu()
    chunks, facts, values = stream(shards.num_params, round_=3)
    sink = ApplyAsPulled(shards, lambda: snapshot)
    for seq in range(4):  # the first attempt breaks after four chunks...
        sink(seq, chunks[seq], facts)
    assert sink.touched and not sink.covers(pulled_part(chunks, facts))
    for seq, chunk in enumerate(chunks):  # ...the retry brings them all again
        sink(seq, chunk, facts)
    assert sink.covers(pulled_part(chunks, facts)) and sink.written == shards.local_numel
    assert torch.equal(shards.gather_owned(snapshot).cpu(), base + values)
    assert {t.device.type for t in snapshot} == {device}
    # hashed as it was added (chunks inside one parameter and across two): the state hash of
    # the new snapshot, each chunk counted once whatever the retry brought again
    assert sink.digest(pulled_part(chunks, facts)) == state_hash(base + values)


def test_a_full_state_after_part_of_an_update_replaces_every_element() -> None:
    shards = ShardMap(model_on("cpu"), 0, 1)
    snapshot = shards.clone_locals()
    update, update_facts, _ = stream(shards.num_params, round_=5)
    state, state_facts, values = stream(shards.num_params, round_=6, full_state=True)
    sink = ApplyAsPulled(shards, lambda: snapshot)
    sink(0, update[0], update_facts)  # the update was no longer kept when the stream came again
    for seq, chunk in enumerate(state):
        sink(seq, chunk, state_facts)
    assert sink.covers(pulled_part(state, state_facts))
    assert not sink.covers(pulled_part(update, update_facts))
    assert torch.equal(shards.gather_owned(snapshot), values)
    assert sink.digest(pulled_part(state, state_facts)) is None  # copied, not hashed: the caller hashes it
    assert sink.digest(pulled_part(update, update_facts)) is None


def test_another_update_on_a_partly_applied_one_is_refused() -> None:
    shards = ShardMap(model_on("cpu"), 0, 1)
    snapshot = shards.clone_locals()
    first, first_facts, _ = stream(shards.num_params, round_=1)
    second, second_facts, _ = stream(shards.num_params, round_=2)
    sink = ApplyAsPulled(shards, lambda: snapshot)
    sink(0, first[0], first_facts)
    before = [t.clone() for t in snapshot]
    with pytest.raises(TornSnapshot, match="round 1's stream"):
        sink(0, second[0], second_facts)
    with pytest.raises(TornSnapshot, match="other elements"):  # same seq, other elements: not the same stream
        sink(0, EncodedChunk(first[1].start, first[1].numel, first[1].payload), first_facts)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot, strict=True))


def test_a_chunk_with_a_code_off_the_grid_changes_nothing() -> None:
    """Added from its codes, a refused chunk must not leave part of itself in the snapshot: the
    retry that follows would add that part twice."""
    shards = ShardMap(nn.Linear(100, 100, bias=False), 0, 1)
    snapshot = shards.clone_locals()
    q8 = parse_pipeline("q8")
    chunk = encode_chunks(q8, torch.randn(shards.num_params) * 1e-2, 9000, round_=4)[0][0]  # 3 tiles
    raw = q8.unpack(chunk.payload, chunk.numel).clone()
    raw[-1] = 0x80  # the last code is -128: found only after the first tiles were decoded
    bad = EncodedChunk(chunk.start, chunk.numel, envelope.seal(q8.tag, chunk.numel, raw.numpy().tobytes()))
    before = [t.clone() for t in snapshot]
    with pytest.raises(CodecError, match="-128"):
        ApplyAsPulled(shards, lambda: snapshot)(0, bad, StreamFacts(False, "q8", 4, "hash"))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot, strict=True))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("spec", ["q8|zstd:1", "q4:64", "q2:33|zstd:1", "fp32"])
def test_decoded_on_the_device_the_snapshot_and_hash_are_the_host_paths(device: str, spec: str) -> None:
    """The device-resident path (raw bytes copied through the staging, decoded, added and hashed
    where the snapshot is; on the CPU its copies are plain ones) against the host path: the same
    snapshot bit for bit and the same state hash, update and full state alike."""
    shards = ShardMap(model_on(device), 0, 1)
    codec = parse_pipeline(spec)
    chunks, _ = encode_chunks(codec, torch.randn(shards.num_params) * 1e-2, 300, round_=3)
    results = []
    for staging in (
        Staging(torch.device("cpu"), resident=False),
        Staging(torch.device(device), resident=True),
    ):
        for full_state in (False, True):
            snapshot = ShardMap(model_on(device), 0, 1).clone_locals()
            facts = StreamFacts(full_state, spec, 3, "hash")
            sink = ApplyAsPulled(shards, lambda snapshot=snapshot: snapshot, staging)
            for seq, chunk in enumerate(chunks):
                sink(seq, chunk, facts)
            values = shards.gather_owned(snapshot).cpu()
            results.append((values.view(torch.int32), sink.digest(pulled_part(chunks, facts))))
            if not full_state:
                assert results[-1][1] == state_hash(values)  # hashed as added, on either path
    host_update, host_state, device_update, device_state = results
    for host, on_device in ((host_update, device_update), (host_state, device_state)):
        assert torch.equal(host[0], on_device[0]) and host[1] == on_device[1]


def test_decoded_on_the_device_a_code_off_the_grid_is_refused_before_anything_is_written() -> None:
    shards = ShardMap(nn.Linear(100, 100, bias=False), 0, 1)
    snapshot = shards.clone_locals()
    q8 = parse_pipeline("q8")
    chunk = encode_chunks(q8, torch.randn(shards.num_params) * 1e-2, 9000, round_=4)[0][0]
    raw = q8.unpack(chunk.payload, chunk.numel).clone()
    raw[-1] = 0x80
    bad = EncodedChunk(chunk.start, chunk.numel, envelope.seal(q8.tag, chunk.numel, raw.numpy().tobytes()))
    before = [t.clone() for t in snapshot]
    sink = ApplyAsPulled(shards, lambda: snapshot, Staging(torch.device("cpu"), resident=True))
    with pytest.raises(CodecError, match="-128"):
        sink(0, bad, StreamFacts(False, "q8", 4, "hash"))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot, strict=True))
