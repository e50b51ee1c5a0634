"""A site's layout as the command line gives it (``--layout``, ``--mixed-precision``): parsed
and checked without torch, so that `geodiloco site run` refuses a bad layout in one line before
it starts torchrun, without paying torch's import. :mod:`geodiloco.site.parallel.layout` applies it."""

from __future__ import annotations

import math
from dataclasses import dataclass

PRESETS = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "ep")
PRECISIONS = ("fp32", "bf16", "fp8")
ACTIVATION_CHECKPOINTING = ("none", "block", "selective")  # parallel.activation_checkpointing
FP8_CAPABILITY = (8, 9)  # float8 tensor cores: Ada and Hopper onwards
FP8_MULTIPLE = 16  # torchao float8 matmuls need both dims of a weight divisible by 16
MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
MICROBATCHES = "microbatches"  # a layout key that is not a mesh dim: the pipeline's microbatches


class LayoutError(ValueError):
    """A layout that does not fit the site's ranks or that this version cannot build."""


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """pp x dp_replicate x dp_shard x tp = the site's ranks; ``mixed_precision``: fp32, bf16 or
    fp8; ``microbatches``: how many a pipeline splits each batch into (0: one per stage).

    ``ep``: the data-parallel ranks split each mixture-of-experts layer's experts in groups of
    ``ep`` (:mod:`geodiloco.site.parallel.experts`); it divides them rather than multiplying the ranks.

    ``activation_checkpointing`` (``none``, ``block``: recompute each transformer block in the
    backward, ``selective``: keep each block's matmul and attention outputs, recompute the rest)
    and ``compile`` (``torch.compile`` each block) are applied per block before FSDP2 or DDP
    (:mod:`geodiloco.site.parallel.per_block`); neither changes a parameter's name or the layout's
    ranks."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    mixed_precision: str = "fp32"
    microbatches: int = 0
    ep: int = 1
    activation_checkpointing: str = "none"
    compile: bool = False

    def __post_init__(self) -> None:
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise LayoutError(
                f"parallel.activation_checkpointing: {self.activation_checkpointing!r} is not one of "
                f"{', '.join(ACTIVATION_CHECKPOINTING)}"
            )
        if not isinstance(self.compile, bool):
            raise LayoutError(f"parallel.compile: expected true or false, got {self.compile!r}")

    @classmethod
    def parse(
        cls,
        text: str,
        world: int,
        mixed_precision: str = "fp32",
        nodes: int = 1,
        *,
        activation_checkpointing: str = "none",
        compile: bool = False,
    ) -> ParallelConfig:
        """``ddp``, ``fsdp``, ``tp``, ``hsdp`` (FSDP2 inside each of the site's ``nodes``, a replica
        per node; on one node, 2 replicas), ``fsdp+tp`` (TP of 2), ``ep`` (DDP with the experts
        split over all ranks), or ``pp=P,dp_replicate=R,dp_shard=S,tp=T,ep=E[,microbatches=M]``."""
        replicas = nodes if nodes > 1 else 2
        presets = {
            "ddp": {"dp_replicate": world},
            "fsdp": {"dp_shard": world},
            "tp": {"tp": world},
            "hsdp": {"dp_replicate": replicas, "dp_shard": world // replicas},
            "fsdp+tp": {"dp_shard": world // 2, "tp": 2},
            "ep": {"dp_replicate": world, "ep": world},
        }
        if text in presets:
            sizes = presets[text]
        else:
            sizes = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                key, eq, value = item.partition("=")
                known = (*MESH_DIMS, MICROBATCHES, "ep")
                if not eq or key.strip() not in known or not value.strip().isdigit():
                    raise LayoutError(
                        f"layout: {item!r} is not one of {', '.join(PRESETS)} or {'|'.join(known)}=N[,...]"
                    )
                sizes[key.strip()] = int(value)
        config = cls(
            **sizes,
            mixed_precision=mixed_precision,
            activation_checkpointing=activation_checkpointing,
            compile=compile,
        )
        config.check(world)
        return config

    def check(self, world: int) -> None:
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.tp)
        if min(sizes) < 1 or math.prod(sizes) != world:
            stages = f"pp {self.pp} x " if self.pp != 1 else ""
            raise LayoutError(
                f"layout: {stages}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp} "
                f"must equal the site's {world} ranks"
            )
        if self.pp > 1 and self.tp > 1:
            raise LayoutError("layout: pipeline with tensor parallel (pp and tp > 1) is not supported yet")
        if self.pp > 1 and self.mixed_precision != "fp32":
            raise LayoutError(
                f"mixed-precision: {self.mixed_precision} is not supported with pipeline stages (pp > 1) yet"
            )
        if self.microbatches and self.microbatches < self.pp:
            raise LayoutError(f"layout: microbatches={self.microbatches} must be at least pp={self.pp}")
        if self.tp > 1 and self.dp_replicate > 1 and self.dp_shard == 1:
            raise LayoutError("layout: replicating a tensor-parallel model needs dp_shard > 1 (HSDP + TP)")
        if self.mixed_precision not in PRECISIONS:
            raise LayoutError(
                f"mixed-precision: {self.mixed_precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        if self.mixed_precision == "fp8" and self.tp > 1:
            raise LayoutError("mixed-precision: fp8 is not supported with tensor parallel (tp > 1) yet")
        if self.ep < 1 or self.data_parallel % self.ep:
            raise LayoutError(
                f"layout: ep {self.ep} must divide the {self.data_parallel} data-parallel ranks"
            )
        if self.ep > 1 and (self.dp_shard > 1 or self.tp > 1 or self.pp > 1):
            raise LayoutError("layout: ep > 1 composes with dp_replicate (DDP) only in this version")

    @property
    def data_parallel(self) -> int:
        """Ranks that train on different batches (tensor-parallel ranks share theirs)."""
        return self.dp_replicate * self.dp_shard

    @property
    def stage_microbatches(self) -> int:
        return self.microbatches or self.pp

    @property
    def name(self) -> str:
        if self.pp > 1:
            stage = ParallelConfig(dp_replicate=self.dp_replicate, dp_shard=self.dp_shard)
            return "pp" if self.data_parallel == 1 else f"pp+{stage.name}"
        if self.ep > 1:
            return "ep"
        if self.tp > 1:
            return "tp" if self.data_parallel == 1 else "fsdp+tp"
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp"
