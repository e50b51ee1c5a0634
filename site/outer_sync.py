"""The site side of DiLoCo, wrapped around any model and inner training loop.

Inside a site, rank 0 talks to the coordinator and the other ranks receive what it got by a
broadcast over the site's own process group, so every rank applies the same bytes::

    sync = OuterSync.connect("coordinator:50051", site="dc-west", tls=files, site_secret=secret)
    sync.attach(model)                      # loads the run's global parameters
    while not sync.finished:
        ...; inner_optimizer.step()
        if sync.step(tokens=n):             # every H inner steps: outer sync
            ...                             # e.g. evaluate, then sync.report(...)

Data parallel inside the site (every rank holds the whole model) for now.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import grpc
import torch
import torch.distributed as dist
from torch import nn

from geodiloco.compression import EncodedChunk, ErrorFeedback, encode_chunks, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.params import flatten_parameters, load_flat_parameters, state_hash
from geodiloco.security.tls import TlsFiles
from geodiloco.site.client import Heartbeater, JoinInfo, OuterSyncClient, PulledState

log = logging.getLogger("geodiloco.site")

MAX_EXCHANGES = 5
CATCH_UP_ROUNDS = 2  # missed rounds caught up through kept updates (q8: ~1 byte/param each, state ~4)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast_object(obj: object) -> object:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass(slots=True)
class RoundResult:
    round: int  # the round just closed
    state_hash: str
    tokens: int
    finished: bool


class OuterSync:
    """Snapshots θ_r, computes Δ every H steps, pushes it, and applies the outer update."""

    def __init__(self, client: OuterSyncClient | None, info: JoinInfo, world_size: int = 1) -> None:
        self.client = client  # only on rank 0
        self.info = info
        self.world_size = world_size
        self.config = RunConfig.from_json(info.run_config_json)
        self.round = info.round
        self.data = info.data  # the ledger's windows for the current round
        self.finished = info.finished
        self.steps_in_round = 0
        self.tokens_in_round = 0
        self.uplink = parse_pipeline(self.config.compression.uplink)
        self.feedback = ErrorFeedback(info.num_params)
        self.model: nn.Module | None = None
        self.snapshot = torch.empty(0)
        self.last_result: RoundResult | None = None
        self._heartbeat: Heartbeater | None = None

    @classmethod
    def connect(
        cls,
        target: str,
        site: str,
        world_size: int = 1,
        *,
        tls: TlsFiles | None = None,
        site_secret: bytes | None = None,
    ) -> OuterSync:
        """Join the run (rank 0) and share what the coordinator said with the site's ranks.

        ``tls`` (mutual TLS) and ``site_secret`` (payload sealing) are what a coordinator
        started without ``--insecure`` requires.
        """
        client, joined = None, None
        if _rank() == 0:
            client = OuterSyncClient(target, site, tls=tls, site_secret=site_secret)
            joined = client.join(world_size=world_size)
            log.info(
                "site %s joined run %s at round %d (shard %d of %d)",
                site,
                joined.run_id,
                joined.round,
                joined.shard_index,
                joined.shard_count,
            )
        info = _broadcast_object(joined)
        assert isinstance(info, JoinInfo)
        sync = cls(client, info, world_size)
        if client is not None:
            sync._heartbeat = Heartbeater(client, info.heartbeat_interval_s, world_size)
            sync._heartbeat.start()
        return sync

    @property
    def shard_index(self) -> int:
        return self.info.shard_index

    @property
    def shard_count(self) -> int:
        return self.info.shard_count

    def attach(self, model: nn.Module) -> nn.Module:
        """Bring ``model`` to the run's current global parameters (a full pull only if needed)."""
        self.model = model
        local = flatten_parameters(model)
        if local.numel() != self.info.num_params:
            raise ValueError(f"model has {local.numel()} parameters, the run has {self.info.num_params}")
        need_state = bool(_broadcast_object(state_hash(local) != self.info.state_hash))
        if need_state:
            pulled = self._pull(full_state=True)
            local = pulled.values
            self.round, self.finished, self.data = pulled.next_round, pulled.finished, pulled.data
            load_flat_parameters(model, local)
            log.info("loaded global state of round %d", self.round)
        self.snapshot = local.clone()
        return model

    def step(self, tokens: int) -> bool:
        """Count one inner step of ``tokens`` on this rank; every H steps run the outer sync."""
        self.steps_in_round += 1
        self.tokens_in_round += tokens
        if self.steps_in_round < self.config.inner.steps_per_round:
            return False
        self.sync()
        return True

    def sync(self) -> RoundResult:
        """Push this round's pseudo-gradient and apply the committed outer update."""
        if self.model is None:
            raise RuntimeError("call attach(model) before syncing")
        tokens = torch.tensor([self.tokens_in_round], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(tokens)
        delta = self.snapshot - flatten_parameters(self.model)
        closed = self.round
        exchanged = None
        if self.client is not None:
            to_send = self.feedback.compensate(delta)
            chunks, decoded = encode_chunks(self.uplink, to_send, self.config.compression.chunk_elements)
            self.feedback.record(to_send, decoded)
            exchanged = self._exchange(closed, chunks, int(tokens.item()))
        pulled = self._share(exchanged)
        new = pulled.values if pulled.is_full_state else self.snapshot + pulled.values
        load_flat_parameters(self.model, new)
        self.snapshot = new
        digest = state_hash(new)
        if self.client is not None and digest != pulled.state_hash:
            log.error(
                "parameters diverged after round %d: %s != %s", closed, digest[:12], pulled.state_hash[:12]
            )
        self.round, self.finished, self.data = pulled.next_round, pulled.finished, pulled.data
        self.steps_in_round = self.tokens_in_round = 0
        # after a resync the state is that of a later round than the one this site trained
        reached = pulled.next_round - 1
        self.last_result = RoundResult(reached, digest, int(tokens.item()), pulled.finished)
        if self._heartbeat is not None:
            self._heartbeat.round = self.round
        return self.last_result

    def _exchange(self, round_: int, chunks: list[EncodedChunk], tokens: int) -> PulledState:
        """Rank 0: push (idempotent) and pull the round's update.

        Recovers from a restarted coordinator that lost the uncommitted contribution (ABORTED:
        push again) and from a lapsed membership or a round that closed without this site
        (FAILED_PRECONDITION: rejoin and continue from the coordinator's current state).
        """
        assert self.client is not None
        resync = False
        for _ in range(MAX_EXCHANGES):
            try:
                if resync:
                    info = self.client.join(world_size=self.world_size)
                    return self._catch_up(round_, info.round)
                self.client.push(
                    round_, self.uplink.spec, chunks, tokens, self.data, timeout_s=self.pull_timeout_s
                )
                pulled = self.client.pull(round_, self.info.num_params, timeout_s=self.pull_timeout_s)
                if pulled.finished or pulled.data:
                    return pulled
                # the round committed while this site was counted lost: no data is reserved for it
                log.warning("round %d: no data assigned (lease lapsed); rejoining", round_)
                info = self.client.join(world_size=self.world_size)
                return dataclasses.replace(pulled, data=info.data)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    log.warning("round %d: the coordinator lost this contribution; pushing again", round_)
                    continue
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION:
                    raise
                log.warning("round %d refused (%s); rejoining and resyncing", round_, exc.details())
                resync = True
        raise RuntimeError(f"round {round_}: no update after {MAX_EXCHANGES} attempts")

    def _catch_up(self, round_: int, current: int) -> PulledState:
        """Rank 0, rejoined: from θ_round_ (the snapshot) to the coordinator's current round.

        Having missed a round or two, apply the coordinator's kept compressed updates in order:
        the same additions it made, so the result is bit-identical, for a fraction of the full
        state's bytes. Otherwise (or once they are no longer kept) pull the full state."""
        assert self.client is not None
        if 0 < current - round_ <= CATCH_UP_ROUNDS:
            values = self.snapshot.clone()
            for r in range(round_, current):
                pulled = self.client.pull(r, self.info.num_params, timeout_s=self.pull_timeout_s)
                if pulled.is_full_state:
                    return pulled  # the update was no longer kept: the coordinator sent the state
                values += pulled.values
            if state_hash(values) == pulled.state_hash:
                log.info(
                    "caught up from round %d to %d with %d kept updates", round_, current, current - round_
                )
                return dataclasses.replace(pulled, is_full_state=True, values=values)
            log.warning("catching up from round %d with updates missed the hash; pulling the state", round_)
        return self.client.pull(round_, self.info.num_params, full_state=True, timeout_s=self.pull_timeout_s)

    @property
    def pull_timeout_s(self) -> float:
        return self.config.round_timeout_s + 300

    def _pull(self, full_state: bool) -> PulledState:
        """Rank 0 pulls; every rank receives the decoded values by broadcast."""
        pulled = None
        if self.client is not None:
            pulled = self.client.pull(
                self.round, self.info.num_params, full_state=full_state, timeout_s=self.pull_timeout_s
            )
        return self._share(pulled)

    def _share(self, pulled: PulledState | None) -> PulledState:
        """What rank 0 pulled, on every rank of the site (metadata and values by broadcast)."""
        meta: PulledState | None = None
        values = torch.empty(self.info.num_params, dtype=torch.float32)
        if pulled is not None:
            values = pulled.values
            meta = dataclasses.replace(pulled, values=torch.empty(0))
        meta = _broadcast_object(meta)  # type: ignore[assignment]
        assert isinstance(meta, PulledState)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(values, src=0)
        return dataclasses.replace(meta, values=values)

    def report(
        self, eval_loss_sum: float, eval_count: int, train_loss: float, compute_seconds: float
    ) -> None:
        """Tell the coordinator this site's hash and metrics for the round just closed (rank 0)."""
        if self.client is None or self.last_result is None:
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
        if self.client is not None:
            try:
                self.client.leave(reason)
            except grpc.RpcError as exc:  # its lease may have lapsed already: nothing to undo
                log.warning("leave failed: %s %s", exc.code().name, exc.details())
            self.client.close()

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent if self.client else 0

    @property
    def bytes_received(self) -> int:
        return self.client.bytes_received if self.client else 0
