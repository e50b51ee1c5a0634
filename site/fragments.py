"""Fragments of the canonical parameter vector, and when a site syncs each (Streaming DiLoCo).

The plan is a pure function of the canonical parameter list (names and sizes, in canonical
order), so every site and the coordinator derive the same plan from the model alone.

Strided across layers, as in Streaming DiLoCo: the parameters of numbered block ℓ go to
fragment ℓ mod P, so every fragment spans the depth of the network. Then, unlike the paper,
the parameters outside the numbered blocks (embeddings, final norm, head: in a small model the
largest tensors) go, largest first, to the fragment with the fewest elements so far, which
keeps the fragments close in size, and so the WAN's peak close to 1/P of the model's.

Fragment p is merged every H inner steps at step ``(p + 1)·H // P`` of the round (fragment
P−1 at the round's end, as blocking DiLoCo does) and pushed τ steps before that, so the
exchange overlaps τ inner steps; with τ < H // P one fragment at most is on the WAN at a time.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from geodiloco.params import canonical_parameters

_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def block_index(name: str) -> int | None:
    """The number of the block a canonical parameter name lies in (``blocks.3.attn.w`` → 3)."""
    match = _BLOCK.search(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    """Which canonical parameters each fragment holds, and where they lie in the flat vector."""

    members: tuple[tuple[int, ...], ...]  # per fragment, its parameter indices in canonical order
    sizes: tuple[int, ...]  # elements of every canonical parameter

    @classmethod
    def strided(cls, params: Sequence[tuple[str, int]], parts: int) -> FragmentPlan:
        """The plan for ``parts`` fragments of ``params`` (canonical name, elements)."""
        if parts < 1:
            raise ValueError(f"fragments must be >= 1, got {parts}")
        owner: dict[int, int] = {}
        load = [0] * parts
        blocks = sorted({b for name, _ in params if (b := block_index(name)) is not None})
        stride = {b: i % parts for i, b in enumerate(blocks)}
        for i, (name, numel) in enumerate(params):
            b = block_index(name)
            if b is not None:
                owner[i] = stride[b]
                load[owner[i]] += numel
        rest = sorted((i for i in range(len(params)) if i not in owner), key=lambda i: (-params[i][1], i))
        for i in rest:
            owner[i] = min(range(parts), key=lambda p: (load[p], p))
            load[owner[i]] += params[i][1]
        members = tuple(tuple(i for i in range(len(params)) if owner[i] == p) for p in range(parts))
        empty = [p for p, m in enumerate(members) if not m]
        if empty:
            raise ValueError(
                f"outer.fragments {parts} is more than this model can fill: fragments {empty} would be "
                f"empty ({len(blocks)} numbered blocks, {len(params)} parameters)"
            )
        return cls(members, tuple(n for _, n in params))

    @classmethod
    def of_model(cls, model: nn.Module, parts: int) -> FragmentPlan:
        return cls.strided([(n, p.numel()) for n, p in canonical_parameters(model)], parts)

    @property
    def count(self) -> int:
        return len(self.members)

    def numel(self, fragment: int) -> int:
        return sum(self.sizes[i] for i in self.members[fragment])

    def ranges(self, fragment: int) -> list[tuple[int, int]]:
        """The fragment's (start, numel) ranges of the canonical vector, ascending, merged."""
        starts = [0]
        for n in self.sizes:
            starts.append(starts[-1] + n)
        out: list[tuple[int, int]] = []
        for i in self.members[fragment]:
            if out and out[-1][0] + out[-1][1] == starts[i]:
                out[-1] = (out[-1][0], out[-1][1] + self.sizes[i])
            elif self.sizes[i]:
                out.append((starts[i], self.sizes[i]))
        return out

    def gather(self, fragment: int, flat: torch.Tensor) -> torch.Tensor:
        """The fragment's own vector: its elements of the canonical ``flat``, in order."""
        return torch.cat([flat[a : a + n] for a, n in self.ranges(fragment)])

    def scatter(self, fragment: int, values: torch.Tensor, flat: torch.Tensor) -> None:
        """Write the fragment's vector ``values`` back into the canonical ``flat``."""
        at = 0
        for a, n in self.ranges(fragment):
            flat[a : a + n].copy_(values[at : at + n])
            at += n


class ParameterSubset(nn.Module):
    """Some of a model's parameters under their canonical names: a :class:`ShardMap` of it maps
    one fragment, whose canonical vector is its parameters' elements in canonical order."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self._named = named

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return iter(self._named)


@dataclass(frozen=True, slots=True)
class Schedule:
    """At which inner step of a round (1..H) each fragment is pushed and merged."""

    steps: int  # H
    fragments: int  # P
    overlap: int  # τ

    def __post_init__(self) -> None:
        if not 1 <= self.fragments <= self.steps:
            raise ValueError(f"fragments {self.fragments} must be in [1, steps_per_round {self.steps}]")
        if not 0 <= self.overlap < self.steps // self.fragments:
            raise ValueError(
                f"overlap_steps {self.overlap} must be in [0, steps_per_round // fragments "
                f"= {self.steps // self.fragments})"
            )

    def merge_step(self, fragment: int) -> int:
        return (fragment + 1) * self.steps // self.fragments

    def push_step(self, fragment: int) -> int:
        return self.merge_step(fragment) - self.overlap
