"""The site side of DiLoCo, wrapped around any model, any parallel layout and any inner loop.

Every rank of the site talks to the coordinator for its own part: it computes the pseudo-gradient
of the elements it owns (its local shard; replicated parameters are split among the ranks that
hold them), compresses and streams them, and pulls its share of the update's chunks. Ranks pass
the pulled chunks (still compressed) to each other over the site's own process group and each
decodes only what lands in its shard, so no rank ever holds the whole model::

    sync = OuterSync.connect("coordinator:50051", site="dc-west", tls=files, site_secret=secret)
    model = sync.attach(model)              # any DDP / FSDP2 / TP wrapping already applied
    while not sync.finished:
        ...; inner_optimizer.step()
        if sync.step(tokens=n):             # every H inner steps: outer sync
            ...                             # e.g. evaluate, then sync.report(...)

Rank 0 alone joins, heartbeats, reports and leaves; control decisions (push again, resync) are
agreed by every rank, so the ranks of a site never disagree on the state they hold.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, TypeVar

import grpc
import torch
from torch import nn

from geodiloco.compression import ErrorFeedback, Pipeline, Place, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.params import HASH_BLOCK, Checksum
from geodiloco.security.tls import TlsFiles
from geodiloco.segment import Segment
from geodiloco.site.client import (
    Heartbeater,
    JoinInfo,
    LazyChunks,
    OuterSyncClient,
    PulledPart,
    WireChunk,
)
from geodiloco.site.group import SiteGroup
from geodiloco.site.shards import ShardMap, subview

log = logging.getLogger("geodiloco.site")

MAX_EXCHANGES = 5
CATCH_UP_ROUNDS = 2  # missed rounds caught up through kept updates (q8: ~1 byte/param each, state ~4)
T = TypeVar("T")


class Outcome(IntEnum):
    """What a rank's last call asks the site to do next; the worst of all ranks wins."""

    OK = 0
    PUSH_AGAIN = 1  # the coordinator lost the uncommitted contribution (restart)
    RESYNC = 2  # the round closed without this site, or its lease lapsed: rejoin, full state
    FAILED = 3


def _outcome(exc: Exception) -> Outcome:
    if isinstance(exc, grpc.RpcError):
        if exc.code() == grpc.StatusCode.ABORTED:
            return Outcome.PUSH_AGAIN
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
            return Outcome.RESYNC
    return Outcome.FAILED


class DeltaEncoding(LazyChunks):
    """A rank's pseudo-gradient, compressed chunk by chunk when the push stream takes it: chunk
    i+1 is encoded while chunk i is on the wire, and each chunk's error-feedback residual is kept
    as it is encoded (no model-sized decoded copy). Encoded chunks are kept for a retried push."""

    def __init__(
        self,
        codec: Pipeline,
        round_: int,
        to_send: torch.Tensor,
        segments: list[tuple[int, Segment]],
        residual: torch.Tensor,
    ) -> None:
        self.codec, self.round, self.to_send, self.segments = codec, round_, to_send, segments
        self.residual = residual
        self._done: dict[int, WireChunk] = {}

    def __len__(self) -> int:
        return len(self.segments)

    def chunk(self, i: int) -> WireChunk:
        chunk = self._done.get(i)
        if chunk is None:
            offset, segment = self.segments[i]
            values = self.to_send[offset : offset + segment.numel]
            with torch.no_grad():
                # on Δ's device: a GPU site quantises there and decodes there for the residual
                payload, back = self.codec.roundtrip(values, Place(self.round, segment))
                torch.sub(values, back, out=self.residual[offset : offset + segment.numel])
            chunk = self._done[i] = WireChunk(segment, payload)
        return chunk

    def finish(self) -> None:
        """Encode what no push took, so the residual covers the whole Δ."""
        for i in range(len(self)):
            self[i]


@dataclass(slots=True)
class RoundResult:
    round: int  # the round just closed
    state_hash: str
    tokens: int
    finished: bool


class OuterSync:
    """Snapshots θ_r, computes Δ every H steps, pushes it, and applies the outer update."""

    def __init__(
        self, client: OuterSyncClient, info: JoinInfo, group: SiteGroup, data_parallel_size: int
    ) -> None:
        self.client = client
        self.info = info
        self.group = group
        self.data_parallel_size = data_parallel_size
        self.config = RunConfig.from_json(info.run_config_json)
        self.round = info.round
        self.data = info.data  # the ledger's windows for the current round
        self.finished = info.finished
        self.steps_in_round = 0
        self.tokens_in_round = 0
        self.uplink = parse_pipeline(self.config.compression.uplink)
        self.model: nn.Module | None = None
        self.shards: ShardMap | None = None
        self.snapshot: list[torch.Tensor] = []  # θ_r, laid out like the rank's local pieces
        self.feedback = ErrorFeedback(0)
        self.part, self.parts = 0, 1
        self.last_result: RoundResult | None = None
        self._heartbeat: Heartbeater | None = None

    @classmethod
    def connect(
        cls,
        target: str,
        site: str,
        *,
        tls: TlsFiles | None = None,
        site_secret: bytes | None = None,
        data_parallel_size: int | None = None,
    ) -> OuterSync:
        """Join the run (rank 0) and share what the coordinator said with the site's ranks.

        Call it on every rank. ``tls`` (mutual TLS) and ``site_secret`` (payload sealing) are what
        a coordinator started without ``--insecure`` requires. ``data_parallel_size`` is how many
        different batches the site trains on per step (ranks / tensor-parallel degree; default:
        every rank), which sizes its share of the data ledger.
        """
        group = SiteGroup()
        data_parallel = data_parallel_size or group.world
        client = OuterSyncClient(target, site, tls=tls, site_secret=site_secret)
        joined = client.join(world_size=data_parallel) if group.rank == 0 else None
        if joined is not None:
            log.info(
                "site %s joined run %s at round %d (shard %d of %d)",
                site,
                joined.run_id,
                joined.round,
                joined.shard_index,
                joined.shard_count,
            )
        info = group.broadcast(joined)
        assert isinstance(info, JoinInfo)
        if group.rank != 0:
            client.adopt(info.run_id, info.key_id)
        sync = cls(client, info, group, data_parallel)
        if group.rank == 0:
            sync._heartbeat = Heartbeater(client, info.heartbeat_interval_s, data_parallel)
            sync._heartbeat.start()
        return sync

    @property
    def shard_index(self) -> int:
        return self.info.shard_index

    @property
    def shard_count(self) -> int:
        return self.info.shard_count

    def attach(self, model: nn.Module) -> nn.Module:
        """Bring ``model`` (already wrapped for its layout) to the run's current global parameters,
        pulling the full state only if it differs."""
        self.model = model
        self.shards = ShardMap(model, self.group.rank, self.group.world)
        if self.shards.num_params != self.info.num_params:
            raise ValueError(
                f"model has {self.shards.num_params} parameters, the run has {self.info.num_params}"
            )
        owners = self.group.gather(self.shards.owned_numel > 0)
        self.part, self.parts = sum(owners[: self.group.rank]), sum(owners)
        self.feedback = ErrorFeedback(self.shards.owned_numel, self.config.compression.feedback_decay)
        self.snapshot = self.shards.clone_locals()
        if self.digest() != self.info.state_hash:
            self.reload_global_state()
            log.info("loaded global state of round %d", self.round)
        return model

    def reload_global_state(self) -> None:
        """Replace the parameters and snapshot with the run's current global state."""
        pulled = self._agreed_pull(full_state=True)
        self._apply(pulled)
        self.round, self.finished, self.data = pulled.next_round, pulled.finished, pulled.data
        self.steps_in_round = self.tokens_in_round = 0

    def digest(self, tensors: list[torch.Tensor] | None = None) -> str:
        """The canonical state hash of the site's parameters (or of ``tensors`` laid out like them),
        each rank adding the elements it owns."""
        assert self.shards is not None
        checksum = Checksum()
        for owned, view in self.shards.owned_views(tensors):
            for offset, segment in owned.segment.split_rows(HASH_BLOCK):
                checksum.add(segment.positions(), subview(view, owned.segment, offset, segment))
        parts = self.group.gather((checksum.low, checksum.high, checksum.count))
        total = Checksum()
        for low, high, count in parts:
            total = total.merge(Checksum(low, high, count))
        return total.hexdigest()

    def step(self, tokens: int) -> bool:
        """Count one inner step of ``tokens`` on this rank; every H steps run the outer sync."""
        self.steps_in_round += 1
        self.tokens_in_round += tokens
        if self.steps_in_round < self.config.inner.steps_per_round:
            return False
        self.sync()
        return True

    def sync(self) -> RoundResult:
        """Push this rank's part of the round's pseudo-gradient and apply the committed update."""
        if self.model is None or self.shards is None:
            raise RuntimeError("call attach(model) before syncing")
        replication = self.group.world // self.data_parallel_size
        tokens = self.group.sum(self.tokens_in_round) // max(replication, 1)
        closed = self.round
        chunks = self._encode_delta()
        pulled, applied = self._exchange(closed, chunks, tokens)
        chunks.finish()  # a push cut short (a resync) still leaves the residual of the whole Δ
        if not applied:
            self._apply(pulled)
        digest = self.digest(self.snapshot)
        if self.group.rank == 0 and digest != pulled.state_hash:
            log.error(
                "parameters diverged after round %d: %s != %s", closed, digest[:12], pulled.state_hash[:12]
            )
        self.round, self.finished, self.data = pulled.next_round, pulled.finished, pulled.data
        self.steps_in_round = self.tokens_in_round = 0
        # after a resync the state is that of a later round than the one this site trained
        self.last_result = RoundResult(pulled.next_round - 1, digest, tokens, pulled.finished)
        if self._heartbeat is not None:
            self._heartbeat.round = self.round
        return self.last_result

    @torch.no_grad()
    def _encode_delta(self) -> DeltaEncoding:
        """Δ = θ_r − θ on the owned elements, plus the error-feedback residual, to be compressed
        chunk by chunk as the push stream takes it (see :class:`DeltaEncoding`)."""
        assert self.shards is not None
        delta = self.shards.gather_owned(self.snapshot)
        at = 0
        for owned, view in self.shards.owned_views():
            n = owned.segment.numel
            delta[at : at + n].view(view.shape).sub_(view)
            at += n
        to_send = self.feedback.compensate(delta)
        del delta
        segments = list(self.shards.wire_segments(self.config.compression.chunk_elements))
        return DeltaEncoding(self.uplink, self.round, to_send, segments, self.feedback.residual)

    def _call(self, fn: Callable[[], T]) -> tuple[T | None, Outcome]:
        try:
            return fn(), Outcome.OK
        except Exception as exc:  # every rank must learn of it, or the others would wait forever
            outcome = _outcome(exc)
            detail = f"{exc.code().name} {exc.details()}" if isinstance(exc, grpc.RpcError) else repr(exc)
            (log.error if outcome is Outcome.FAILED else log.warning)("rank %d: %s", self.group.rank, detail)
            return None, outcome

    def _exchange(self, round_: int, chunks: Sequence[WireChunk], tokens: int) -> tuple[PulledPart, bool]:
        """Push (idempotent) and pull the round's update, all ranks together.

        Recovers from a restarted coordinator that lost the uncommitted contribution (ABORTED:
        push again) and from a lapsed membership or a round that closed without this site
        (FAILED_PRECONDITION: rejoin and continue from the coordinator's current state).
        """
        resync = False
        for _ in range(MAX_EXCHANGES):
            if not resync and chunks:
                _, outcome = self._call(
                    lambda: self.client.push(
                        round_,
                        self.uplink.spec,
                        chunks,
                        tokens,
                        self.data,
                        timeout_s=self.pull_timeout_s,
                        part=self.part,
                        parts=self.parts,
                    )
                )
                outcome = self.group.agree(outcome)
                if outcome is Outcome.FAILED:
                    raise RuntimeError(f"round {round_}: a rank of this site could not push its part")
                resync = outcome is Outcome.RESYNC
            elif not resync:
                self.group.agree(Outcome.OK)  # a rank that owns nothing still takes part
            if resync:
                current, _ = self._rejoin()
                caught = self._catch_up(round_, current)
                if caught is not None:
                    return caught, True
            pulled, outcome = self._call(functools.partial(self._pull, round_, resync))
            outcome = self.group.agree(outcome)
            if outcome is Outcome.FAILED:
                raise RuntimeError(f"round {round_}: a rank of this site could not pull its share")
            if outcome is Outcome.PUSH_AGAIN:
                log.warning("round %d: the coordinator lost this contribution; pushing again", round_)
                continue
            if outcome is Outcome.RESYNC:
                log.warning("round %d refused; rejoining and resyncing", round_)
                resync = True
                continue
            assert pulled is not None
            if len({repr(f) for f in self.group.gather(pulled.facts)}) != 1:
                log.warning("round %d: ranks pulled different states (a commit in between); again", round_)
                resync = True
                continue
            if not (pulled.finished or pulled.data):
                # the round committed while this site was counted lost: no data is reserved for it
                log.warning("round %d: no data assigned (lease lapsed); rejoining", round_)
                return dataclasses.replace(pulled, data=self._rejoin()[1]), False
            return pulled, False
        raise RuntimeError(f"round {round_}: no update after {MAX_EXCHANGES} attempts")

    def _rejoin(self) -> tuple[int, list[Any]]:
        """Rank 0 joins again; every rank learns the current round and the data it now has."""
        info, outcome = (None, Outcome.OK)
        if self.group.rank == 0:
            info, outcome = self._call(lambda: self.client.join(world_size=self.data_parallel_size))
        if self.group.agree(outcome) is not Outcome.OK:
            raise RuntimeError("rejoining the run failed")
        return self.group.broadcast((info.round, info.data) if info is not None else (0, []))

    def _catch_up(self, round_: int, current: int) -> PulledPart | None:
        """From θ_round_ (the snapshot) to the current round through the coordinator's kept
        compressed updates, when only a round or two were missed: the same additions the
        coordinator made, so the result is bit-identical, for a fraction of the state's bytes.
        None when that is not possible (too far behind, updates no longer kept, hash differs):
        the caller pulls the full state."""
        if not 0 < current - round_ <= CATCH_UP_ROUNDS:
            return None
        pulled = None
        for r in range(round_, current):
            pulled = self._agreed_pull(full_state=False, round_=r)
            self._apply(pulled)
            if pulled.is_full_state:  # no longer kept: the coordinator sent its state instead
                return pulled
        assert pulled is not None
        if self.digest(self.snapshot) != pulled.state_hash:
            log.warning("catching up from round %d through kept updates missed the hash", round_)
            return None
        log.info("caught up from round %d to %d with %d kept updates", round_, current, current - round_)
        return pulled

    def _pull(self, round_: int, full_state: bool) -> PulledPart:
        return self.client.pull(
            round_,
            full_state=full_state,
            timeout_s=self.pull_timeout_s,
            part=self.group.rank,
            parts=self.group.world,
        )

    def _agreed_pull(self, full_state: bool, round_: int | None = None) -> PulledPart:
        """Every rank pulls its share of the same state or update (retried if a commit came in
        between two ranks' full-state pulls)."""
        at = self.round if round_ is None else round_
        for _ in range(MAX_EXCHANGES):
            pulled, outcome = self._call(functools.partial(self._pull, at, full_state))
            if self.group.agree(outcome) is not Outcome.OK:
                raise RuntimeError("pulling the run's state failed")
            assert pulled is not None
            if len({repr(f) for f in self.group.gather(pulled.facts)}) == 1:
                return pulled
        raise RuntimeError("the run's state kept changing while the site pulled it")

    @torch.no_grad()
    def _apply(self, pulled: PulledPart) -> None:
        """Decode every chunk on the ranks that hold its elements: snapshot += update (or = state),
        then the parameters take the snapshot's values."""
        assert self.shards is not None
        codec = parse_pipeline(pulled.codec)
        written = 0
        for seq in range(pulled.total_chunks):
            src = seq % self.group.world
            chunk = self.group.share_chunk(pulled.chunks.get(seq) if self.group.rank == src else None, src)
            if not self.shards.holds(chunk.start, chunk.numel):
                continue
            values = codec.decode(
                chunk.payload, chunk.numel, Place.span(pulled.round, chunk.start, chunk.numel)
            )
            written += self.shards.scatter_range(
                chunk.start, values, self.snapshot, add=not pulled.is_full_state
            )
        if written != self.shards.local_numel:
            raise RuntimeError(
                f"the pulled chunks covered {written} of this rank's {self.shards.local_numel} elements"
            )
        for piece, values in zip(self.shards.pieces, self.snapshot, strict=True):
            piece.local.copy_(values)

    @property
    def pull_timeout_s(self) -> float:
        return self.config.round_timeout_s + 300

    def report(
        self, eval_loss_sum: float, eval_count: int, train_loss: float, compute_seconds: float
    ) -> None:
        """Tell the coordinator this site's hash and metrics for the round just closed (rank 0)."""
        if self.group.rank != 0 or self.last_result is None:
            return
        r = self.last_result
        try:
            response = self.client.report(
                r.round, r.state_hash, eval_loss_sum, eval_count, train_loss, r.tokens, compute_seconds
            )
        except grpc.RpcError as exc:  # metrics only: never worth stopping the training for
            log.warning("report of round %d failed: %s %s", r.round, exc.code().name, exc.details())
            return
        if not response.hash_ok:
            log.error("coordinator reports a hash mismatch after round %d", r.round)

    def close(self, reason: str = "done") -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.group.rank == 0:
            try:
                self.client.leave(reason)
            except grpc.RpcError as exc:  # its lease may have lapsed already: nothing to undo
                log.warning("leave failed: %s %s", exc.code().name, exc.details())
        self.client.close()

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent

    @property
    def bytes_received(self) -> int:
        return self.client.bytes_received
