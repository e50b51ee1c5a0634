"""The run's configuration: a tree of small typed dataclasses.

The coordinator owns the run config and hands it to every site at join time, so all sites
train with the same settings. Files are TOML or JSON; ``--set section.key=value`` overrides
one value. Every error names the field and, where there is a fixed set, the accepted values.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geodiloco.compression import CodecError, Pipeline, parse_pipeline
from geodiloco.config_errors import ConfigError as ConfigError
from geodiloco.workload.model import GPTConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

OUTER_OPTIMIZERS = ("nesterov", "fedavg")
BUILDERS = ("model", "optimizer", "data", "loss")
REFERENCE_BUILDERS = {
    "model": "geodiloco.workload.reference:build_model",
    "optimizer": "geodiloco.workload.reference:build_optimizer",
    "data": "geodiloco.workload.reference:build_data",
}
REFERENCE_INNER = {"lr": 6e-3, "weight_decay": 0.01, "grad_clip": 1.0}
# settings only the reference data builder reads (the rest of `data` is read by every run)
REFERENCE_DATA_FIELDS = ("paths", "max_bytes", "eval_fraction", "eval_sequences")
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
_BUILDER_REF = re.compile(rf"{_DOTTED}:{_DOTTED}")


def _require(cond: bool, field_name: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{field_name}: {message}")


@dataclass(kw_only=True, slots=True)
class ModelConfig(GPTConfig):
    """The reference model's shape. ``experts`` > 0 makes every block's MLP a mixture of that
    many experts (:mod:`geodiloco.workload.moe`): each token goes to its ``top_k`` experts, and a
    load-balancing loss weighted ``aux_loss_weight`` keeps the router from favouring a few."""

    experts: int = 0  # 0: the dense reference model
    top_k: int = 2
    aux_loss_weight: float = 0.01

    def __post_init__(self) -> None:
        GPTConfig.__post_init__(self)  # zero-argument super() fails in a slotted dataclass
        _require(
            self.experts == 0 or self.experts >= 2,
            "model.experts",
            f"must be 0 (a dense model) or >= 2, got {self.experts}",
        )
        _require(
            self.top_k >= 1 and (self.experts == 0 or self.top_k <= self.experts),
            "model.top_k",
            f"must be in [1, model.experts ({self.experts})], got {self.top_k}",
        )
        _require(
            0 <= self.aux_loss_weight < float("inf"),
            "model.aux_loss_weight",
            f"must be >= 0 and finite, got {self.aux_loss_weight}",
        )


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Training text. Empty ``paths`` means the running interpreter's standard library."""

    paths: list[str] = field(default_factory=list)
    max_bytes: int = 4_000_000  # 0: all of the text (it is read in place, never held whole)
    shards: int = 24  # units of the coordinator's data ledger
    eval_fraction: float = 0.05
    eval_sequences: int = 192
    batch_size: int = 8  # per rank
    # what one ledger item (window) weighs in the average: a site's weight is the tokens of the
    # windows the ledger handed it and it trained, never more than that (a larger claim is
    # capped); 0: model.seq_len with the reference data, 1 (the items) with one's own data
    tokens_per_item: int = 0

    def __post_init__(self) -> None:
        _require(self.max_bytes >= 0, "data.max_bytes", f"must be >= 0 (0: all), got {self.max_bytes}")
        _require(
            0.0 < self.eval_fraction < 0.5,
            "data.eval_fraction",
            f"must be in (0, 0.5), got {self.eval_fraction}",
        )
        _require(self.eval_sequences > 0, "data.eval_sequences", "must be > 0")
        _require(self.shards > 0, "data.shards", f"must be > 0, got {self.shards}")
        _require(self.batch_size > 0, "data.batch_size", f"must be > 0, got {self.batch_size}")
        _require(
            0 <= self.tokens_per_item <= 1 << 30,
            "data.tokens_per_item",
            f"must be in [0, {1 << 30}] (0: model.seq_len or 1), got {self.tokens_per_item}",
        )


@dataclass(kw_only=True, slots=True)
class InnerConfig:
    """The sites' inner steps: the outer-sync period H, the lr schedule and gradient clipping.

    geodiloco applies the schedule and clipping to whatever optimizer ``workload.optimizer``
    builds: warm-up and decay scale each parameter group's own lr, clipping bounds the global
    gradient norm (across shards). ``lr`` and ``weight_decay`` are the reference optimizer's
    (AdamW) and are refused with one's own, which sets its own; unset (null), they take the
    reference defaults, and so does ``grad_clip`` with the reference optimizer, while with one's
    own it defaults to 0 (no clipping). The saved run config holds the values used.
    """

    steps_per_round: int = 25
    # rounds by time: each site trains until this many seconds of its round passed (at least one
    # step, at most steps_per_round, the windows the ledger reserves) and weighs what it trained;
    # 0: every round is steps_per_round steps
    round_seconds: float = 0.0
    lr: float | None = None  # reference optimizer: 6e-3
    weight_decay: float | None = None  # reference optimizer: 0.01
    warmup_steps: int = 0
    decay_steps: int = 0  # cosine decay to lr * min_lr_ratio over this many steps after warm-up; 0: none
    min_lr_ratio: float = 0.1
    grad_clip: float | None = None  # reference optimizer: 1.0; one's own: 0 (not clipped)

    def __post_init__(self) -> None:
        _require(self.steps_per_round > 0, "inner.steps_per_round", "must be > 0")
        _require(
            0 <= self.round_seconds < float("inf"),
            "inner.round_seconds",
            f"must be >= 0 (0: rounds of steps_per_round steps), got {self.round_seconds}",
        )
        _require(self.lr is None or self.lr > 0, "inner.lr", f"must be > 0, got {self.lr}")
        _require(self.weight_decay is None or self.weight_decay >= 0, "inner.weight_decay", "must be >= 0")
        _require(self.warmup_steps >= 0, "inner.warmup_steps", "must be >= 0")
        _require(self.decay_steps >= 0, "inner.decay_steps", "must be >= 0 (0 keeps the lr constant)")
        _require(
            0 <= self.min_lr_ratio <= 1, "inner.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}"
        )
        _require(
            self.grad_clip is None or self.grad_clip >= 0,
            "inner.grad_clip",
            "must be >= 0 (0 disables clipping)",
        )

    def resolve(self, reference_optimizer: bool, optimizer: str) -> None:
        """Fill the unset values with what the run will use; refuse settings nobody reads."""
        if reference_optimizer:
            self.lr = REFERENCE_INNER["lr"] if self.lr is None else self.lr
            self.weight_decay = (
                REFERENCE_INNER["weight_decay"] if self.weight_decay is None else self.weight_decay
            )
            self.grad_clip = REFERENCE_INNER["grad_clip"] if self.grad_clip is None else self.grad_clip
            return
        for name in ("lr", "weight_decay"):
            _require(
                getattr(self, name) is None,
                f"inner.{name}",
                f"is read only by the reference optimizer; workload.optimizer {optimizer} sets its own "
                "(drop the setting, or set it in your builder, e.g. from workload.options)",
            )
        self.grad_clip = 0.0 if self.grad_clip is None else self.grad_clip


@dataclass(kw_only=True, slots=True)
class OuterConfig:
    """The coordinator's outer optimizer.

    ``nesterov`` defaults to the DiLoCo paper's lr 0.7 and momentum 0.9; ``fedavg`` is plain
    federated averaging (lr 1, no momentum). ``warmup_rounds`` ramps momentum from 0 to its
    value over that many rounds, which helps runs that start from scratch.
    """

    optimizer: str = "nesterov"
    lr: float = 0.7
    momentum: float = 0.9
    warmup_rounds: int = 0
    # Streaming DiLoCo: the model is synced in `fragments` fragments at staggered steps; each
    # fragment's exchange overlaps `overlap_steps` inner steps (0: the site waits, as DiLoCo
    # does), then the global fragment is mixed in: local <- mix_alpha·local + (1 - mix_alpha)·global
    # (with overlap_steps 0 the parameters take the global values).
    fragments: int = 1
    overlap_steps: int = 0
    mix_alpha: float = 0.5
    # a push up to this many rounds late is merged into its fragment's open round with weight
    # tokens // (1 + staleness), not dropped (0: late pushes are dropped)
    max_staleness: int = 2

    def __post_init__(self) -> None:
        _require(
            self.optimizer in OUTER_OPTIMIZERS,
            "outer.optimizer",
            f"unknown value {self.optimizer!r}; accepted: {', '.join(OUTER_OPTIMIZERS)}",
        )
        _require(self.lr > 0, "outer.lr", f"must be > 0, got {self.lr}")
        _require(0 <= self.momentum < 1, "outer.momentum", f"must be in [0, 1), got {self.momentum}")
        _require(self.warmup_rounds >= 0, "outer.warmup_rounds", "must be >= 0")
        _require(self.fragments >= 1, "outer.fragments", f"must be >= 1, got {self.fragments}")
        _require(self.overlap_steps >= 0, "outer.overlap_steps", f"must be >= 0, got {self.overlap_steps}")
        _require(0 <= self.mix_alpha < 1, "outer.mix_alpha", f"must be in [0, 1), got {self.mix_alpha}")
        _require(
            0 <= self.max_staleness <= 4,
            "outer.max_staleness",
            f"must be in [0, 4] (pushes are kept 4 rounds), got {self.max_staleness}",
        )


@dataclass(kw_only=True, slots=True)
class GraceConfig:
    """How long a round waits for its stragglers after its first contribution.

    Off (``adaptive`` false), ``round_timeout_s``. On, the window follows the measured arrivals
    of the last ``rounds`` rounds: their lags behind each round's first contribution (late ones
    included), the ``quantile`` of those, times ``1 + margin``, plus ``floor_s``, never more
    than ``round_timeout_s``; and never more than ``max_share`` of the sites' training time
    per round (at least ``floor_s``): a site later than that is not waited for, its push merged
    late, until it comes within it again (0: no such bound; None: 0.5 with rounds by time, 0
    with step rounds, where a slower site is late by design) (:mod:`geodiloco.coordinator.grace`)."""

    adaptive: bool = True
    quantile: float = 0.9
    margin: float = 0.5
    floor_s: float = 0.5
    rounds: int = 8
    max_share: float | None = None

    def share(self, by_time: bool) -> float:
        """``max_share``, or its default for rounds by time (0.5) or of steps (0: off)."""
        return self.max_share if self.max_share is not None else (0.5 if by_time else 0.0)

    def __post_init__(self) -> None:
        _require(0 < self.quantile <= 1, "grace.quantile", f"must be in (0, 1], got {self.quantile}")
        _require(0 <= self.margin < float("inf"), "grace.margin", f"must be >= 0, got {self.margin}")
        _require(0 <= self.floor_s < float("inf"), "grace.floor_s", f"must be >= 0, got {self.floor_s}")
        _require(self.rounds >= 1, "grace.rounds", f"must be >= 1, got {self.rounds}")
        _require(
            self.max_share is None or 0 <= self.max_share < float("inf"),
            "grace.max_share",
            f"must be >= 0 or null, got {self.max_share}",
        )


AGGREGATION_RULES = ("mean", "clip", "trimmed_mean", "median", "filtered_mean")


@dataclass(kw_only=True, slots=True)
class AggregationConfig:
    """How the coordinator combines the sites' pseudo-gradients, per fragment
    (:mod:`geodiloco.coordinator.robust`).

    ``mean``: the token-weighted mean. ``clip``: each Δ_k scaled down to at most
    ``clip_multiple`` x the round's median site norm, then the weighted mean. ``trimmed_mean``:
    per coordinate, the ``trim`` lowest and highest values dropped, the weighted mean of the rest.
    ``median``: per coordinate, the weighted median. ``filtered_mean``: the contributions farther
    from the coordinate-wise median than ``filter_multiple`` x the median distance dropped (at
    most a minority), the weighted mean of the rest. ``trimmed_mean`` needs ``2 x trim + 1``
    contributions, ``median`` and ``filtered_mean`` 3; a round with fewer uses ``clip``."""

    rule: str = "filtered_mean"  # survives one poisoning site of four; honest runs: the mean's loss
    clip_multiple: float = 2.0
    trim: int = 1
    filter_multiple: float = 2.0

    def __post_init__(self) -> None:
        _require(
            self.rule in AGGREGATION_RULES,
            "aggregation.rule",
            f"unknown value {self.rule!r}; accepted: {', '.join(AGGREGATION_RULES)}",
        )
        _require(
            1.0 <= self.clip_multiple < float("inf"),
            "aggregation.clip_multiple",
            f"must be >= 1 (a multiple of the median site norm), got {self.clip_multiple}",
        )
        _require(
            1.0 <= self.filter_multiple < float("inf"),
            "aggregation.filter_multiple",
            f"must be >= 1 (a multiple of the median distance), got {self.filter_multiple}",
        )
        _require(
            isinstance(self.trim, int) and self.trim >= 1,
            "aggregation.trim",
            f"must be an integer >= 1 (values dropped at each end), got {self.trim!r}",
        )


@dataclass(kw_only=True, slots=True)
class CompressionConfig:
    """Codec pipelines per direction, error-feedback decay, and the chunk size of streamed payloads."""

    uplink: str = "q8|zstd:3"
    downlink: str = "q8|zstd:3"
    chunk_elements: int = 1 << 20
    feedback_decay: float = 1.0  # residual kept per round by every sender; 0 turns error feedback off
    # the coordinator's own (for the update it sends), where it should differ from the sites'; None: the same
    downlink_feedback_decay: float | None = None

    def __post_init__(self) -> None:
        for name in ("uplink", "downlink"):
            try:
                parse_pipeline(getattr(self, name))
            except CodecError as exc:
                raise ConfigError(f"compression.{name}: {exc}") from None
        _require(
            0 < self.chunk_elements <= 1 << 21,
            "compression.chunk_elements",
            f"must be in [1, {1 << 21}] (chunks stay a few MiB), got {self.chunk_elements}",
        )
        _require(
            0 <= self.feedback_decay <= 1,
            "compression.feedback_decay",
            f"must be in [0, 1], got {self.feedback_decay}",
        )
        _require(
            self.downlink_feedback_decay is None or 0 <= self.downlink_feedback_decay <= 1,
            "compression.downlink_feedback_decay",
            f"must be in [0, 1] or null (as compression.feedback_decay), got {self.downlink_feedback_decay}",
        )

    @property
    def downlink_decay(self) -> float:
        """The coordinator's residual decay: ``downlink_feedback_decay``, or the sites' when unset."""
        return self.feedback_decay if self.downlink_feedback_decay is None else self.downlink_feedback_decay

    @property
    def uplink_pipeline(self) -> Pipeline:
        """The sites' codec, built from its spec (parsed once, when the config was checked)."""
        return parse_pipeline(self.uplink)

    @property
    def downlink_pipeline(self) -> Pipeline:
        """The coordinator's codec for updates."""
        return parse_pipeline(self.downlink)


@dataclass(kw_only=True, slots=True)
class LimitsConfig:
    """What the coordinator accepts from a site; anything beyond is refused and dropped."""

    max_message_bytes: int = 32 * 1024 * 1024  # one gRPC message; larger is RESOURCE_EXHAUSTED
    max_delta_norm_ratio: float = 1.0  # ‖Δ_k‖ <= ratio · ‖θ_r‖ (a site moved the whole model); 0: off
    chunk_timeout_s: float = 60.0  # longest wait for the next chunk of a push
    joins_per_minute: int = 30  # per peer (certificate identity, or address without TLS)
    # Counts a site declares: each is checked before anything it sized is allocated or changed.
    max_world_size: int = 4096  # ranks (data-parallel replicas) a site may declare at Join
    max_parts: int = 4096  # parts of one push, and pullers of one update (one per rank)
    max_chunks_per_part: int = 1 << 20  # chunks one push stream may declare
    max_data_ranges: int = 1024  # data ranges one push may name
    max_tokens: int = 1 << 40  # tokens of one push or report, and eval sequences of one report

    def __post_init__(self) -> None:
        _require(
            self.max_message_bytes >= 64 * 1024,
            "limits.max_message_bytes",
            f"must be >= 65536, got {self.max_message_bytes}",
        )
        _require(self.max_delta_norm_ratio >= 0, "limits.max_delta_norm_ratio", "must be >= 0 (0 disables)")
        _require(self.chunk_timeout_s > 0, "limits.chunk_timeout_s", "must be > 0")
        _require(self.joins_per_minute > 0, "limits.joins_per_minute", "must be > 0")
        for name in ("max_world_size", "max_parts", "max_chunks_per_part", "max_data_ranges", "max_tokens"):
            value = getattr(self, name)
            _require(0 < value <= 1 << 62, f"limits.{name}", f"must be in [1, {1 << 62}], got {value}")


@dataclass(kw_only=True, slots=True)
class WorkloadConfig:
    """What to train: ``package.module:function`` builders for the model, the inner optimizer,
    the data and the loss (protocols in :mod:`geodiloco.builders`), and free-form ``options``.

    The defaults build the reference workload. The coordinator imports the model and data
    builders (θ_0 and the ledger's shard sizes), each site all three, so the modules must be
    importable on every machine of the run (installed, or on ``PYTHONPATH``).
    """

    model: str = REFERENCE_BUILDERS["model"]
    optimizer: str = REFERENCE_BUILDERS["optimizer"]
    data: str = REFERENCE_BUILDERS["data"]
    loss: str = "geodiloco.workload.loss:build_cross_entropy"  # see geodiloco.workload.loss
    options: dict[str, Any] = field(default_factory=dict)  # read by the builders; must be JSON
    # a torch.save'd state dict (e.g. a pretrained model) loaded into the built model: θ_0 of a
    # warm start; the same file must be on every machine of the run
    init_weights: str = ""

    def __post_init__(self) -> None:
        for name in BUILDERS:
            value = getattr(self, name)
            _require(
                isinstance(value, str) and _BUILDER_REF.fullmatch(value) is not None,
                f"workload.{name}",
                f"expected 'package.module:function', got {value!r}",
            )
        _require(
            isinstance(self.options, dict), "workload.options", f"expected a table, got {self.options!r}"
        )
        try:
            json.dumps(self.options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"workload.options: must be plain JSON values ({exc})") from None


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One training run across sites."""

    run_id: str = "geodiloco-run"
    sites: list[str] = field(default_factory=lambda: ["site-1", "site-2"])
    rounds: int = 10
    # contributions a round needs before it may close; 0: the default quorum, half of `sites`
    # rounded up (see `quorum`); set it to len(sites) to wait for every site
    min_sites: int = 0
    round_timeout_s: float = 600.0
    grace: GraceConfig = field(default_factory=GraceConfig)
    heartbeat_interval_s: float = 2.0
    lease_s: float = 15.0
    # rounds between full snapshots of the coordinator's state; each round in between is logged
    # as its compressed update only (a restart replays them), and a graceful stop snapshots too
    snapshot_every: int = 10
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    compression: CompressionConfig = field(default_factory=CompressionConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    aggregation: AggregationConfig = field(default_factory=AggregationConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)

    def __post_init__(self) -> None:
        _require(bool(self.run_id), "run_id", "must not be empty")
        _require(len(self.sites) > 0, "sites", "name at least one site")
        _require(len(set(self.sites)) == len(self.sites), "sites", "names must be unique")
        for name in self.sites:
            _require(
                bool(name) and name.replace("-", "").replace("_", "").isalnum(),
                "sites",
                f"site names use letters, digits, '-' and '_'; got {name!r}",
            )
        _require(self.rounds > 0, "rounds", f"must be > 0, got {self.rounds}")
        _require(
            self.data.shards >= len(self.sites),
            "data.shards",
            f"must be at least the number of sites ({len(self.sites)}), got {self.data.shards}",
        )
        _require(
            0 <= self.min_sites <= len(self.sites),
            "min_sites",
            f"must be in [0, {len(self.sites)}] (0: half of the sites, rounded up), got {self.min_sites}",
        )
        _require(
            self.outer.fragments <= self.inner.steps_per_round,
            "outer.fragments",
            f"must be <= inner.steps_per_round ({self.inner.steps_per_round}), got {self.outer.fragments}",
        )
        spacing = self.inner.steps_per_round // self.outer.fragments
        _require(
            self.outer.overlap_steps < spacing,
            "outer.overlap_steps",
            f"must be < inner.steps_per_round // outer.fragments ({spacing}): one fragment on the "
            f"WAN at a time; got {self.outer.overlap_steps}",
        )
        _require(self.round_timeout_s > 0, "round_timeout_s", "must be > 0")
        _require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be > 0")
        _require(self.snapshot_every > 0, "snapshot_every", f"must be > 0, got {self.snapshot_every}")
        _require(
            self.lease_s > self.heartbeat_interval_s,
            "lease_s",
            f"must exceed heartbeat_interval_s ({self.heartbeat_interval_s}), got {self.lease_s}",
        )
        largest_chunk = self.compression.chunk_elements * 4 + 4096  # fp32 payload plus header
        _require(
            self.limits.max_message_bytes >= largest_chunk,
            "limits.max_message_bytes",
            f"must hold a chunk of compression.chunk_elements fp32 values ({largest_chunk} bytes), "
            f"got {self.limits.max_message_bytes}",
        )
        optimizer = self.workload.optimizer
        self.inner.resolve(optimizer == REFERENCE_BUILDERS["optimizer"], optimizer)
        self._refuse_unread_settings()

    def _refuse_unread_settings(self) -> None:
        """The reference model's and corpus's settings, changed while one's own builder is
        configured, would be silently ignored: refuse them, naming the field."""
        readers = {  # the model settings and who reads them
            "n_layer": ("model",),
            "n_head": ("model",),
            "d_model": ("model",),
            "seq_len": ("model", "data"),  # the reference data's window length too
            "experts": ("model",),
            "top_k": ("model",),
            "aux_loss_weight": ("model",),
        }
        default = ModelConfig()
        for name, keys in readers.items():
            if all(getattr(self.workload, key) != REFERENCE_BUILDERS[key] for key in keys):
                _require(
                    getattr(self.model, name) == getattr(default, name),
                    f"model.{name}",
                    f"is read only by the reference {' and '.join(keys)} builders; workload.{keys[0]} "
                    f"{getattr(self.workload, keys[0])} does not read it (put your settings in "
                    "workload.options)",
                )
        if self.workload.data != REFERENCE_BUILDERS["data"]:
            default_data = DataConfig()
            for name in REFERENCE_DATA_FIELDS:
                _require(
                    getattr(self.data, name) == getattr(default_data, name),
                    f"data.{name}",
                    f"is read only by the reference data; workload.data {self.workload.data} does not "
                    "read it (put your data's settings in workload.options)",
                )

    @property
    def item_tokens(self) -> int:
        """The tokens one ledger item weighs (``data.tokens_per_item`` resolved)."""
        if self.data.tokens_per_item:
            return self.data.tokens_per_item
        return self.model.seq_len if self.workload.data == REFERENCE_BUILDERS["data"] else 1

    @property
    def quorum(self) -> int:
        """Contributions a round needs: ``min_sites``, or by default half the sites rounded up.

        Failover is on by default: a lost site stops being waited for once its lease lapses, and
        the round closes on the others as long as they reach the quorum. Half rounded up is a
        majority for an odd number of sites and lets either of two sites carry the run alone.
        """
        return self.min_sites or (len(self.sites) + 1) // 2

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        return _build(cls, data, prefix="")

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a table, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{prefix}{unknown[0]}: unknown field; accepted: {', '.join(sorted(names))}")
    kwargs = {key: _coerce(hints[key], value, f"{prefix}{key}") for key, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except ValueError as exc:  # GPTConfig validates with plain ValueError
        raise ConfigError(str(exc)) from None


def _coerce(hint: Any, value: Any, path: str) -> Any:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, prefix=f"{path}.")
    origin = typing.get_origin(hint)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item,) = typing.get_args(hint)
        return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a table, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(hint)) != 2:
            raise ConfigError(f"{path}: unsupported type")  # only `X | None` is used by the tree
        return None if value is None else _coerce(args[0], value, path)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"outer.lr=0.5"`` -> (["outer", "lr"], 0.5); values are read as JSON when they parse."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r}: expected section.key=value")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> RunConfig:
    """Read a TOML or JSON file (or start from defaults) and apply ``--set`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"config file {p}: {exc.strerror}") from None
        try:
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"config file {p}: {exc}") from None
    return RunConfig.from_dict(apply_overrides(data, overrides or []))
