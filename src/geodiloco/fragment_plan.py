"""Fragments of the canonical parameter vector (Streaming DiLoCo), shared by both ends.

The plan is a pure function of the canonical parameter list (names and sizes, in canonical
order), so every site and the coordinator derive the same plan from the model alone; the
coordinator also keeps it in its run directory, so a restart needs no model to find it.

Strided across layers, as in Streaming DiLoCo: the parameters of numbered block ℓ go to
fragment ℓ mod P, so every fragment spans the depth of the network. Then, unlike the paper,
the parameters outside the numbered blocks (embeddings, final norm, head: in a small model the
largest tensors) go, largest first, to the fragment with the fewest elements so far, which
keeps the fragments close in size, and so the WAN's peak close to 1/P of the model's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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

    def to_json(self) -> str:
        return json.dumps({"members": [list(m) for m in self.members], "sizes": list(self.sizes)})

    @classmethod
    def from_json(cls, text: str) -> FragmentPlan:
        """A plan written by :meth:`to_json`; a malformed one raises ``ValueError``."""
        try:
            raw: Any = json.loads(text)
            plan = cls(
                tuple(tuple(int(i) for i in m) for m in raw["members"]), tuple(int(n) for n in raw["sizes"])
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a fragment plan: {exc}") from None
        if sorted(i for m in plan.members for i in m) != list(range(len(plan.sizes))):
            raise ValueError("not a fragment plan: its fragments do not partition the parameters")
        return plan
