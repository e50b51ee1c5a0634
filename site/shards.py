"""Where each rank's local parameter shards lie in the canonical flat vector, and who sends what.

The wire speaks one layout for every site: parameters in canonical-name order, flattened, each
element at a fixed index (:mod:`geodiloco.params`). A rank of an FSDP2 or tensor-parallel site
holds pieces of that vector; a rank of a DDP site holds all of it. This module maps a rank's
local tensors to :class:`Segment` s of the canonical vector (strided boxes, because a
column-sharded matrix is not contiguous), and splits every piece that several ranks hold
(replicated parameters) among those ranks, so that each element is *owned* by exactly one rank
of the site. A rank pushes only what it owns, and nothing ever gathers the full model.

A pipeline stage holds some parameters only: its model carries a :class:`StagePlacement` (the
whole model's parameter list and which stages hold what), so offsets are those of the whole
model and a parameter held by several stages (a tied embedding) is split among all its holders.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, _mesh_resources
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from geodiloco.compression import Pipeline, Place
from geodiloco.compression.staging import Staging
from geodiloco.params import (
    Checksum,
    DeviceSums,
    add_and_hash,
    add_encoded_and_hash,
    canonical_parameters,
)
from geodiloco.segment import Segment

PP_DIM = "pp"  # the mesh dim of pipeline stages: ranks along it hold different parameters
PLACEMENT_ATTR = "geodiloco_stage_placement"


@dataclass(frozen=True, slots=True, eq=False)
class StagePlacement:
    """Where a pipeline stage's parameters lie in the whole model.

    ``canonical``: every parameter of the whole model (canonical name, shape), in canonical order;
    ``holders``: the stages holding each; ``stage``: this rank's; ``dp_index`` of ``dp_count``:
    this rank among the ranks of its stage (which all hold its plain tensors). The groups are
    for reductions over replicas (checkpoint): the stage's ranks, and per set of several holders
    the group of this rank's copies in those stages (None where it would be alone)."""

    canonical: tuple[tuple[str, tuple[int, ...]], ...]
    holders: dict[str, tuple[int, ...]]
    stage: int
    dp_index: int = 0
    dp_count: int = 1
    stage_group: ProcessGroup | None = None
    shared: dict[tuple[int, ...], ProcessGroup] = field(default_factory=dict)


def stage_placement(model: nn.Module) -> StagePlacement | None:
    """The placement :func:`~geodiloco.site.parallel.pipeline_stages.split_stage` left on a
    stage's model, if any."""
    placement = getattr(model, PLACEMENT_ATTR, None)
    return placement if isinstance(placement, StagePlacement) else None


@dataclass(slots=True)
class Piece:
    """One parameter's local tensor on this rank, as a ``rows x cols`` view, and its place."""

    name: str
    local: torch.Tensor  # 2-D view sharing storage with the parameter
    segment: Segment


@dataclass(frozen=True, slots=True)
class Owned:
    """A part of a piece this rank sends: rows ``[r0, r1)`` and columns ``[c0, c1)`` of it."""

    piece: int
    rows: slice
    cols: slice
    segment: Segment


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


def _placement_box(p: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    for placement in p.placements:
        if (isinstance(placement, Shard | _StridedShard) and placement.dim >= 2) or not isinstance(
            placement, Shard | _StridedShard | Replicate
        ):
            raise ValueError(f"placement {placement} is not supported: shard on dim 0 or 1, or replicate")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    if any(isinstance(placement, _StridedShard) for placement in p.placements):
        offset = tuple(_first_index(p, dim) if dim < 2 else 0 for dim in range(p.dim()))
    return tuple(shape), tuple(offset)


def _first_index(p: DTensor, dim: int) -> int:
    """The global index of this rank's first element along ``dim``, checking that its elements
    along ``dim`` are consecutive. FSDP2 over a tensor-parallel model shards a dim twice
    (``_StridedShard`` then ``Shard``); each rank's rows still form one block, found here by
    sharding the indices of that dim alone the same way (locally: no communication)."""
    placements = [
        (_StridedShard(0, split_factor=pl.split_factor) if isinstance(pl, _StridedShard) else Shard(0))
        if isinstance(pl, Shard | _StridedShard) and pl.dim == dim
        else Replicate()
        for pl in p.placements
    ]
    index = torch.arange(p.shape[dim], device=p.device_mesh.device_type)
    local = distribute_tensor(index, p.device_mesh, placements, src_data_rank=None).to_local()
    if local.numel() == 0:
        return p.shape[dim]
    first = int(local[0])
    if int(local[-1]) - first != local.numel() - 1 or not bool((local.diff() == 1).all()):
        raise ValueError(f"placements {p.placements}: this rank's elements along dim {dim} are not one block")
    return first


def replica_dims(p: DTensor) -> tuple[DeviceMesh, list[int]]:
    """The site's whole mesh and its dims along which ranks hold the same local piece of ``p``:
    its Replicate dims, and the dims its own mesh does not span (FSDP2's dp mesh under TP)."""
    mesh = p.device_mesh
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else _mesh_resources.get_root_mesh(mesh)
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if names is None or root_names is None:
        return mesh, [d for d, pl in enumerate(p.placements) if isinstance(pl, Replicate)]
    kept = {names[d] for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)}
    return root, [d for d, name in enumerate(root_names) if name not in kept]


def _without_stages(p: DTensor) -> tuple[DeviceMesh, list[int]]:
    """:func:`replica_dims` less the pipeline dim: other stages hold other parameters."""
    root, dims = replica_dims(p)
    names = root.mesh_dim_names
    return root, [d for d in dims if names is None or names[d] != PP_DIM]


def _stage_replicas(name: str, p: torch.Tensor, placement: StagePlacement) -> tuple[Key, int, int]:
    """As :func:`_replicas` for a pipeline stage: the ranks of its stage (by its mesh dims but
    ``pp``) times the stages holding the parameter."""
    if isinstance(p, DTensor):
        root, dims = _without_stages(p)
        coord = root.get_coordinate()
        assert coord is not None
        index, count = 0, 1
        for dim in dims:
            index, count = index * root.size(dim) + coord[dim], count * root.size(dim)
    else:
        dims, index, count = [-1], placement.dp_index, placement.dp_count
    holders = placement.holders[name]
    return (tuple(dims), holders), holders.index(placement.stage) * count + index, count * len(holders)


def replica_groups(name: str, p: torch.Tensor, placement: StagePlacement | None) -> list[ProcessGroup | None]:
    """The groups over which ranks hold the same local piece of ``p`` (None: the default group),
    so that a sum over each, in turn, adds up every replica's part."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if placement is None:
        if not isinstance(p, DTensor):
            return [None] if distributed else []
        mesh, dims = replica_dims(p)
        return [mesh.get_group(d) for d in dims if mesh.size(d) > 1]
    groups: list[ProcessGroup | None] = []
    if isinstance(p, DTensor):
        mesh, dims = _without_stages(p)
        groups += [mesh.get_group(d) for d in dims if mesh.size(d) > 1]
    elif placement.dp_count > 1:
        groups.append(placement.stage_group)
    shared = placement.shared.get(placement.holders[name])
    return groups + ([shared] if shared is not None else [])


Key = tuple[tuple[int, ...], tuple[int, ...]]


def _replicas(p: torch.Tensor, rank: int, world: int) -> tuple[Key, int, int]:
    """Which ranks hold the same local piece of ``p`` (a key naming the mesh dims), this rank's
    index among them and their count."""
    if not isinstance(p, DTensor):
        return ((-1,), ()), rank, world  # a plain tensor: every rank of the site holds all of it
    root, replicated = replica_dims(p)
    coord = root.get_coordinate()
    assert coord is not None
    index, count = 0, 1
    for dim in replicated:
        index, count = index * root.size(dim) + coord[dim], count * root.size(dim)
    return (tuple(replicated), ()), index, count


def _piece(name: str, p: torch.Tensor, offset: int) -> Piece:
    _, global_cols = _as_2d(tuple(p.shape))
    local = local_tensor(p).detach()
    if isinstance(p, DTensor):
        shape, box = _placement_box(p)
    else:
        shape, box = tuple(p.shape), (0,) * p.dim()
    if len(shape) <= 1:
        rows, cols, r0, c0 = 1, (shape[0] if shape else 1), 0, (box[0] if box else 0)
    else:
        rows, r0 = shape[0], box[0]
        cols = shape[1] if len(shape) == 2 else math.prod(shape[1:])
        c0 = box[1] if len(shape) == 2 else 0
        if len(shape) > 2 and tuple(shape[1:]) != tuple(p.shape[1:]):
            raise ValueError(f"{name}: a parameter with more than 2 dims may only be sharded on dim 0")
    segment = Segment(offset + r0 * global_cols + c0, rows, cols, global_cols)
    if segment.contiguous:  # one row: a contiguous range of the canonical vector
        return Piece(name, local.view(1, local.numel()), segment.flat())
    return Piece(name, local.view(rows, cols), segment)


def _share(members: list[tuple[int, Piece]], index: int, count: int) -> Iterator[Owned]:
    """Replica ``index`` of ``count``'s share of pieces they all hold: an even split of their
    elements in canonical order (a multi-row piece goes by whole rows, to whoever owns a row's
    first element), so the shares are disjoint and cover everything."""
    total = sum(piece.segment.numel for _, piece in members)
    lo, hi = total * index // count, total * (index + 1) // count
    at = 0
    for i, piece in members:
        seg = piece.segment
        a, b = max(lo - at, 0), min(hi - at, seg.numel)
        at += seg.numel
        if a >= b:
            continue
        if seg.rows == 1:
            yield Owned(i, slice(0, 1), slice(a, b), Segment(seg.start + a, 1, b - a, b - a))
            continue
        r0, r1 = -(-a // seg.row_len), -(-b // seg.row_len)
        if r0 < r1:
            place = Segment(seg.start + r0 * seg.stride, r1 - r0, seg.row_len, seg.stride)
            yield Owned(i, slice(r0, r1), slice(0, seg.row_len), place)


class ShardMap:
    """This rank's pieces of the canonical vector and the part of them it owns."""

    def __init__(self, model: nn.Module, rank: int | None = None, world: int | None = None) -> None:
        rank = rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0)
        world = world if world is not None else (dist.get_world_size() if dist.is_initialized() else 1)
        self.pieces: list[Piece] = []
        groups: dict[Key, list[tuple[int, Piece]]] = {}
        share_of: dict[Key, tuple[int, int]] = {}
        placement = stage_placement(model)
        held = dict(canonical_parameters(model))
        whole = [(n, tuple(p.shape)) for n, p in held.items()] if placement is None else placement.canonical
        offset = 0
        for name, shape in whole:
            p = held.pop(name, None)
            if p is not None:
                piece = _piece(name, p, offset)
                if placement is None:
                    key, index, count = _replicas(p, rank, world)
                else:
                    key, index, count = _stage_replicas(name, p, placement)
                groups.setdefault(key, []).append((len(self.pieces), piece))
                share_of[key] = (index, count)
                self.pieces.append(piece)
            offset += math.prod(shape)
        if held:
            raise ValueError(f"parameters {sorted(held)} are not in the stage placement's list")
        owned = [o for key, members in groups.items() for o in _share(members, *share_of[key])]
        self.owned: list[Owned] = sorted(owned, key=lambda o: o.segment.start)
        self.num_params = offset

    @property
    def device(self) -> torch.device:
        """Where the rank's pieces live (the model's device; CPU for a model without parameters)."""
        return self.pieces[0].local.device if self.pieces else torch.device("cpu")

    @property
    def owned_numel(self) -> int:
        return sum(o.segment.numel for o in self.owned)

    @property
    def local_numel(self) -> int:
        return sum(p.segment.numel for p in self.pieces)

    def owned_views(self, tensors: list[torch.Tensor] | None = None) -> Iterator[tuple[Owned, torch.Tensor]]:
        """Each owned part as a 2-D view of the parameters (or of ``tensors``, laid out like them)."""
        for o in self.owned:
            base = self.pieces[o.piece].local if tensors is None else tensors[o.piece]
            yield o, base[o.rows, o.cols]

    def gather_owned(self, tensors: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The owned elements, concatenated in canonical order (fp32, on the pieces' device)."""
        out = torch.empty(self.owned_numel, dtype=torch.float32, device=self.device)
        at = 0
        for o, view in self.owned_views(tensors):
            n = o.segment.numel
            out[at : at + n].view(view.shape).copy_(view)
            at += n
        return out

    def wire_segments(self, max_numel: int) -> Iterator[tuple[int, Segment]]:
        """The owned elements as chunks of at most ``max_numel``: (offset in the owned vector,
        place). Owned parts that are adjacent in the canonical vector travel together."""
        at = 0
        for merged in _merge_adjacent([o.segment for o in self.owned]):
            for offset, seg in merged.split_rows(max_numel):
                yield at + offset, seg
            at += merged.numel

    def clone_locals(self) -> list[torch.Tensor]:
        """A copy of every local piece (e.g. the snapshot θ_r), in fp32."""
        return [p.local.detach().to(torch.float32).clone() for p in self.pieces]

    def holds(self, start: int, numel: int) -> bool:
        """Whether any of the canonical elements ``[start, start + numel)`` lie in this rank's pieces."""
        return any(
            p.segment.numel and p.segment.start < start + numel and p.segment.end > start for p in self.pieces
        )

    def scatter_range(
        self, start: int, values: torch.Tensor, targets: list[torch.Tensor], add: bool = False
    ) -> int:
        """Write (or ``add``) the canonical elements ``[start, start + len(values))`` into ``targets``
        (laid out like the pieces) wherever this rank holds them; returns how many it wrote."""
        values = _on_device_of(values, targets)
        written = 0
        for i, (r0, r1), (c0, c1), (v0, v_stride) in self._blocks(start, start + values.numel()):
            block = values.as_strided((r1 - r0, c1 - c0), (v_stride, 1), values.storage_offset() + v0)
            target = targets[i][r0:r1, c0:c1]
            target.add_(block) if add else target.copy_(block)
            written += (r1 - r0) * (c1 - c0)
        return written

    def _blocks(
        self, start: int, end: int
    ) -> Iterator[tuple[int, tuple[int, int], tuple[int, int], tuple[int, int]]]:
        """Each piece's blocks inside ``[start, end)``: (piece index, rows, cols, (offset in the
        range, row stride))."""
        for i, piece in enumerate(self.pieces):
            seg = piece.segment
            if seg.numel and seg.start < end and seg.end > start:
                for block in _overlaps(seg, start, end):
                    yield (i, *block)

    def decode_range(
        self, codec: Pipeline, data: bytes | memoryview, place: Place, staging: Staging
    ) -> torch.Tensor:
        """The values ``codec`` encoded in ``data`` at ``place``, on ``staging``'s device. With a
        resident staging and a codec that decodes there, only the raw bytes cross (checked on the
        host, copied on the side stream, decoded there); else they are decoded on the host and
        the values copied through the staging. Queue what reads them under ``staging.side()``."""
        numel = place.segment.numel
        raw = codec.unpack(data, numel, place)
        if staging.resident and codec.decodes_on_device:
            codec.check_raw(raw, numel)  # refused before anything is written, as on the host
            on_device = staging.to_device(raw)
            with staging.side():
                return codec.decode_on_device(on_device, numel)
        return staging.to_device(codec.decode_raw(raw, numel, place))

    def scatter_encoded(
        self,
        codec: Pipeline,
        data: bytes | memoryview,
        place: Place,
        targets: list[torch.Tensor],
        staging: Staging,
        add: bool = False,
    ) -> int:
        """:meth:`scatter_range` of the values ``codec`` encoded in ``data`` at ``place``
        (:meth:`decode_range`), written on ``staging``'s side stream."""
        values = self.decode_range(codec, data, place, staging)
        staging.after_current()
        with staging.side():
            return self.scatter_range(place.segment.start, values, targets, add=add)

    def add_encoded_range(
        self,
        codec: Pipeline,
        data: bytes | memoryview,
        place: Place,
        targets: list[torch.Tensor],
        staging: Staging | None = None,
    ) -> tuple[int, Checksum | DeviceSums | None]:
        """:meth:`scatter_range` ``add=True`` of the values ``codec`` encoded in ``data`` at
        ``place``, hashing the new elements as they are written (the state hash then needs no
        pass of its own): how many it wrote, and their checksum (None when a written block is
        not one run of the canonical vector, e.g. rows of a sharded matrix). A chunk inside one
        piece is added straight from its codes, its fp32 values never written out. With a
        resident ``staging`` the values are decoded, added and hashed on the device, on its side
        stream (the checksum's sums stay there until settled)."""
        start, numel = place.segment.start, place.segment.numel
        if staging is not None and staging.resident and codec.decodes_on_device:
            return self._add_on_device(codec, data, place, targets, staging)
        raw = codec.unpack(data, numel, place)
        blocks = list(self._blocks(start, start + numel))
        if len(blocks) == 1:
            i, (r0, r1), (c0, c1), _ = blocks[0]
            if r1 - r0 == 1 and c1 - c0 == numel:  # one run of one piece
                checksum, _ = add_encoded_and_hash(codec, raw, place, targets[i][r0, c0:c1])
                return numel, checksum
        values = _on_device_of(codec.decode_raw(raw, numel, place), targets)
        written, checksum, runs = 0, Checksum(), True
        for i, (r0, r1), (c0, c1), (v0, v_stride) in blocks:
            if r1 - r0 == 1:
                part, _ = add_and_hash(targets[i][r0, c0:c1], values[v0 : v0 + c1 - c0], start + v0)
                checksum = checksum.merge(part)
            else:
                block = values.as_strided((r1 - r0, c1 - c0), (v_stride, 1), values.storage_offset() + v0)
                targets[i][r0:r1, c0:c1].add_(block)
                runs = False
            written += (r1 - r0) * (c1 - c0)
        return written, checksum if runs else None

    def _add_on_device(
        self,
        codec: Pipeline,
        data: bytes | memoryview,
        place: Place,
        targets: list[torch.Tensor],
        staging: Staging,
    ) -> tuple[int, DeviceSums | None]:
        start, numel = place.segment.start, place.segment.numel
        values = self.decode_range(codec, data, place, staging)
        staging.after_current()  # the targets as the calling thread's stream last left them
        with staging.side():
            written, sums, runs = 0, DeviceSums(values.device), True
            for i, (r0, r1), (c0, c1), (v0, v_stride) in self._blocks(start, start + numel):
                if r1 - r0 == 1:
                    run = targets[i][r0, c0:c1]
                    run.add_(values[v0 : v0 + c1 - c0])
                    sums.add_range(start + v0, run)
                else:
                    block = values.as_strided((r1 - r0, c1 - c0), (v_stride, 1), values.storage_offset() + v0)
                    targets[i][r0:r1, c0:c1].add_(block)
                    runs = False
                written += (r1 - r0) * (c1 - c0)
        return written, sums if runs else None


def _on_device_of(values: torch.Tensor, targets: list[torch.Tensor]) -> torch.Tensor:
    """``values`` where ``targets`` are: decoded on the host, applied on the device."""
    return values.to(targets[0].device) if targets and values.device != targets[0].device else values


def _overlaps(
    seg: Segment, start: int, end: int
) -> Iterator[tuple[tuple[int, int], tuple[int, int], tuple[int, int]]]:
    """Blocks of ``seg`` inside ``[start, end)``: (rows, cols, (offset in the range, row stride))."""
    if seg.rows == 1:
        a, b = max(start, seg.start), min(end, seg.start + seg.row_len)
        if a < b:
            yield (0, 1), (a - seg.start, b - seg.start), (a - start, b - a)
        return
    # strided rows: full rows inside the range in one block, edge rows clipped
    r_lo = max(0, (start - seg.start - seg.row_len) // seg.stride + 1)
    r_hi = min(seg.rows, (end - seg.start) // seg.stride + 1)
    full: list[int] = []
    for r in range(r_lo, r_hi):
        row_start = seg.start + r * seg.stride
        a, b = max(start, row_start), min(end, row_start + seg.row_len)
        if a >= b:
            continue
        if a == row_start and b == row_start + seg.row_len:
            full.append(r)
            continue
        yield (r, r + 1), (a - row_start, b - row_start), (a - start, b - a)
    if full:
        r0, r1 = full[0], full[-1] + 1
        yield (r0, r1), (0, seg.row_len), (seg.start + r0 * seg.stride - start, seg.stride)


def _merge_adjacent(segments: list[Segment]) -> Iterator[Segment]:
    run: Segment | None = None
    for seg in segments:
        if run is not None and run.rows == 1 and seg.rows == 1 and run.start + run.numel == seg.start:
            n = run.numel + seg.numel
            run = Segment(run.start, 1, n, n)
            continue
        if run is not None:
            yield run
        run = seg
    if run is not None:
        yield run


def subview(view: torch.Tensor, segment: Segment, offset: int, sub: Segment) -> torch.Tensor:
    """The part of ``view`` (``segment``'s elements as rows x row_len) that ``sub``, found at
    element ``offset`` of it by :meth:`Segment.split_rows`, covers."""
    if sub.rows > 1:
        r = offset // segment.row_len
        return view[r : r + sub.rows]
    r, c = divmod(offset, view.shape[1])
    return view[r, c : c + sub.numel]
