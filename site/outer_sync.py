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

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from geodiloco.compression import ErrorFeedback, encode_chunks, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.params import flatten_parameters, load_flat_parameters, state_hash
from geodiloco.security.tls import TlsFiles
from geodiloco.site.client import Heartbeater, JoinInfo, OuterSyncClient, PulledState

log = logging.getLogger("geodiloco.site")


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

    def __init__(self, client: OuterSyncClient | None, info: JoinInfo) -> None:
        self.client = client  # only on rank 0
        self.info = info
        self.config = RunConfig.from_json(info.run_config_json)
        self.round = info.round
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
        sync = cls(client, info)
        if client is not None:
            sync._heartbeat = Heartbeater(client, info.heartbeat_interval_s)
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
            self.round, self.finished = pulled.next_round, pulled.finished
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
        if self.client is not None:
            to_send = self.feedback.compensate(delta)
            chunks, decoded = encode_chunks(self.uplink, to_send, self.config.compression.chunk_elements)
            self.feedback.record(to_send, decoded)
            self.client.push(
                closed,
                self.uplink.spec,
                chunks,
                int(tokens.item()),
                timeout_s=self.config.round_timeout_s + 60,
            )
        pulled = self._pull(full_state=False)
        new = pulled.values if pulled.is_full_state else self.snapshot + pulled.values
        load_flat_parameters(self.model, new)
        self.snapshot = new
        digest = state_hash(new)
        if self.client is not None and digest != pulled.state_hash:
            log.error(
                "parameters diverged after round %d: %s != %s", closed, digest[:12], pulled.state_hash[:12]
            )
        self.round, self.finished = pulled.next_round, pulled.finished
        self.steps_in_round = self.tokens_in_round = 0
        self.last_result = RoundResult(closed, digest, int(tokens.item()), pulled.finished)
        if self._heartbeat is not None:
            self._heartbeat.round = self.round
        return self.last_result

    def _pull(self, full_state: bool) -> PulledState:
        """Rank 0 pulls; every rank receives the decoded values by broadcast."""
        meta: PulledState | None = None
        values = torch.empty(self.info.num_params, dtype=torch.float32)
        if self.client is not None:
            pulled = self.client.pull(
                self.round,
                self.info.num_params,
                full_state=full_state,
                timeout_s=self.config.round_timeout_s + 300,
            )
            values = pulled.values
            meta = PulledState(
                pulled.is_full_state, torch.empty(0), pulled.next_round, pulled.state_hash, pulled.finished
            )
        meta = _broadcast_object(meta)  # type: ignore[assignment]
        assert isinstance(meta, PulledState)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(values, src=0)
        return PulledState(meta.is_full_state, values, meta.next_round, meta.state_hash, meta.finished)

    def report(
        self, eval_loss_sum: float, eval_count: int, train_loss: float, compute_seconds: float
    ) -> None:
        """Tell the coordinator this site's hash and metrics for the round just closed (rank 0)."""
        if self.client is None or self.last_result is None:
            return
        r = self.last_result
        response = self.client.report(
            r.round, r.state_hash, eval_loss_sum, eval_count, train_loss, r.tokens, compute_seconds
        )
        if not response.hash_ok:
            log.error("coordinator reports a hash mismatch after round %d", r.round)

    def close(self, reason: str = "done") -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self.client is not None:
            self.client.leave(reason)
            self.client.close()

    @property
    def bytes_sent(self) -> int:
        return self.client.bytes_sent if self.client else 0

    @property
    def bytes_received(self) -> int:
        return self.client.bytes_received if self.client else 0
