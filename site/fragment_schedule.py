"""When a site syncs each fragment (Streaming DiLoCo), and a module view of one fragment.

The plan itself (which parameters each fragment holds) is :mod:`geodiloco.fragment_plan`, shared
with the coordinator. Fragment p is merged every H inner steps at step ``(p + 1)·H // P`` of
the round (fragment P−1 at the round's end, as blocking DiLoCo does) and pushed τ steps before
that, so the exchange overlaps τ inner steps; with τ < H // P one fragment at most is on the
WAN at a time.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from geodiloco.fragment_plan import FragmentPlan, block_index

__all__ = ["FragmentPlan", "ParameterSubset", "Schedule", "block_index"]


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
