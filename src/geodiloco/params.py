"""The canonical flat view of a model's parameters, shared by every site and the coordinator.

Parameters are ordered by canonical name (wrapper prefixes such as DDP's ``module.`` removed),
so the layout does not depend on how a site wraps or shards its model.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

if TYPE_CHECKING:
    from geodiloco.compression import Pipeline, Place

try:
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name.replace("._orig_mod.", ".").replace(".module.", ".")


def canonical_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    return sorted(named, key=lambda item: item[0])


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for _, p in canonical_parameters(model))


@torch.no_grad()
def flatten_parameters(model: nn.Module) -> torch.Tensor:
    """A new fp32 vector holding every parameter in canonical order."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for _, p in canonical_parameters(model)])


@torch.no_grad()
def load_flat_parameters(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a canonical flat vector into the model's parameters, in place."""
    offset = 0
    for name, p in canonical_parameters(model):
        n = p.numel()
        if offset + n > flat.numel():
            raise ValueError(f"flat vector too short at parameter {name}")
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, model has {offset}")


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64
_LOW32 = (1 << 32) - 1
# Elements hashed at a time: bounds the scratch memory; the digest does not depend on it (sums of
# up to 2^20 32-bit halves stay exact in 64 bits). A device has memory to spare and pays per launch.
HASH_BLOCK, DEVICE_HASH_BLOCK = 1 << 16, 1 << 20
KERNEL_HASH_BLOCK = 1 << 28  # the C kernel's runs: under 2^32 elements, so its 64-bit sums never wrap


def _signed(constant: int) -> int:
    return constant - (1 << 64)  # the same 64 bits as a torch int64 scalar


def _mix(positions: np.ndarray, values: torch.Tensor) -> tuple[int, int]:
    """Sums of the low and high halves of splitmix64(index, fp32 bits) over a block of a CPU
    tensor, computed in place on ``positions`` (uint64; numpy's unsigned arithmetic wraps and
    shifts logically)."""
    x = positions
    x *= np.uint64(_GOLDEN)
    x += values.detach().to(torch.float32).contiguous().numpy().view(np.uint32)
    for bits, factor in ((30, _MIX1), (27, _MIX2)):
        x ^= x >> np.uint64(bits)
        x *= np.uint64(factor)
    x ^= x >> np.uint64(31)
    high = int((x >> np.uint64(32)).sum(dtype=np.uint64))
    x &= np.uint64(_LOW32)
    return int(x.sum(dtype=np.uint64)), high


def _mix_on_device(positions: torch.Tensor, values: torch.Tensor) -> tuple[int, int]:
    """The same sums for a tensor on an accelerator, with torch's int64 ops where the values are
    (integer arithmetic wraps the same way on any device, so the bits match the CPU path)."""
    low, high = _mix_sums_on_device(positions, values)
    return int(low), int(high)


def _mix_sums_on_device(positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_mix_on_device`'s sums as 0-d int64 tensors where the values are (nothing waits)."""
    x = positions.to(values.device).mul_(_signed(_GOLDEN))
    scratch = values.detach().to(torch.float32).contiguous().view(torch.int32).to(torch.int64)
    x += scratch.bitwise_and_(_LOW32)
    for bits, factor in ((30, _signed(_MIX1)), (27, _signed(_MIX2)), (31, 1)):
        torch.bitwise_right_shift(x, bits, out=scratch)
        scratch &= (1 << (64 - bits)) - 1  # a logical shift: torch shifts signed values arithmetically
        x ^= scratch
        if factor != 1:
            x *= factor
    low = torch.bitwise_and(x, _LOW32, out=scratch).sum()
    torch.bitwise_right_shift(x, 32, out=scratch)
    high = scratch.bitwise_and_(_LOW32).sum()
    return low, high


class Checksum:
    """A hash of the canonical parameters that any partition of them can compute in parts.

    Every element contributes ``mix(index, fp32 bits)`` to two sums, so ranks holding disjoint
    pieces of the model (in any mesh) add their parts up and get the same digest as one process
    holding it all. It detects replicas that differ by one bit anywhere; it is a consistency
    check, not a defence against a forger (see the threat model).
    """

    def __init__(self, low: int = 0, high: int = 0, count: int = 0) -> None:
        self.low, self.high, self.count = low, high, count

    def add(self, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Add the elements ``values`` found at canonical ``positions`` (int64, same length)."""
        positions, values = positions.reshape(-1), values.reshape(-1)
        if values.device.type == "cpu":
            low, high = _mix(positions.cpu().numpy().astype(np.uint64), values)
        else:
            low, high = _mix_on_device(positions.to(torch.int64), values)
        self.low, self.high, self.count = self.low + low, self.high + high, self.count + positions.numel()

    def add_rows(self, start: int, stride: int, values: torch.Tensor) -> None:
        """Add the rows of ``values`` (rows x row_len), row r a run of canonical elements from
        ``start + r * stride``: e.g. a rank's shard of a matrix split by columns."""
        rows, row_len = values.shape
        if values.device.type == "cpu" and _kernels is not None and 0 < values.numel() < KERNEL_HASH_BLOCK:
            flat = values.detach().to(torch.float32).contiguous()
            low, high = _kernels.checksum_rows(flat.numpy(), row_len, start, stride)
            self.low, self.high, self.count = self.low + low, self.high + high, self.count + values.numel()
            return
        first = torch.arange(rows, dtype=torch.int64) * stride + start
        self.add(first[:, None] + torch.arange(row_len, dtype=torch.int64), values)

    def add_range(self, start: int, values: torch.Tensor) -> None:
        """Add a contiguous run of canonical elements starting at ``start``."""
        flat = values.detach().reshape(-1)
        on_cpu = flat.device.type == "cpu"
        if on_cpu and _kernels is not None:  # ~20x the numpy path, and it leaves the GIL
            flat = flat.to(torch.float32).contiguous()
            for a in range(0, flat.numel(), KERNEL_HASH_BLOCK):
                part = flat[a : a + KERNEL_HASH_BLOCK]
                low, high = _kernels.checksum_range(part.numpy(), start + a)
                self.low, self.high, self.count = self.low + low, self.high + high, self.count + part.numel()
            return
        block = HASH_BLOCK if on_cpu else DEVICE_HASH_BLOCK
        for a in range(0, flat.numel(), block):
            part = flat[a : a + block]
            if on_cpu:
                low, high = _mix(np.arange(start + a, start + a + part.numel(), dtype=np.uint64), part)
            else:
                end = start + a + part.numel()
                low, high = _mix_on_device(
                    torch.arange(start + a, end, dtype=torch.int64, device=flat.device), part
                )
            self.low, self.high, self.count = self.low + low, self.high + high, self.count + part.numel()

    def merge(self, other: Checksum) -> Checksum:
        return Checksum(self.low + other.low, self.high + other.high, self.count + other.count)

    def hexdigest(self) -> str:
        return hashlib.sha256(f"{self.low}:{self.high}:{self.count}".encode()).hexdigest()


class DeviceSums:
    """A :class:`Checksum` whose sums are still on the device: runs are added to it without the
    host waiting, and it is read once (:meth:`settle`, after the work that made it). int64 sums of
    up to 2^31 elements stay exact (each element adds under 2^32)."""

    LIMIT = 1 << 31

    def __init__(self, device: torch.device) -> None:
        self.low = torch.zeros((), dtype=torch.int64, device=device)
        self.high = torch.zeros((), dtype=torch.int64, device=device)
        self.count = 0

    def add_range(self, start: int, values: torch.Tensor) -> None:
        """Add a contiguous run of canonical elements starting at ``start`` (as
        :meth:`Checksum.add_range`), where ``values`` are."""
        flat = values.detach().reshape(-1)
        if self.count + flat.numel() >= self.LIMIT:
            raise ValueError(f"{self.count + flat.numel()} elements: past what int64 sums hold exactly")
        for a in range(0, flat.numel(), DEVICE_HASH_BLOCK):
            part = flat[a : a + DEVICE_HASH_BLOCK]
            end = start + a + part.numel()
            low, high = _mix_sums_on_device(
                torch.arange(start + a, end, dtype=torch.int64, device=flat.device), part
            )
            self.low += low
            self.high += high
        self.count += flat.numel()

    def settle(self) -> Checksum:
        """The sums as a :class:`Checksum` (reads the device: call it once the work is done)."""
        return Checksum(int(self.low), int(self.high), self.count)


def add_and_hash(
    theta: torch.Tensor, change: torch.Tensor, start: int, residual: torch.Tensor | None = None
) -> tuple[Checksum, float]:
    """θ += ``change`` in place (and ``residual`` −= ``change``, where given): the new θ's checksum
    as a run from canonical index ``start``, and Σ θ² (in double).

    On the host the C kernel does all of it in one pass over the span (the hash's multiplies
    then hide the memory traffic of the adds); the torch path gives the same θ and checksum, and
    the same Σ θ² up to the order of the additions."""
    tensors = [t for t in (theta, change, residual) if t is not None]
    if (
        _kernels is not None
        and theta.numel() < KERNEL_HASH_BLOCK
        and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
    ):
        sumsq, low, high = _kernels.add_and_hash(
            theta.numpy(), change.numpy(), None if residual is None else residual.numpy(), start
        )
        return Checksum(low, high, theta.numel()), sumsq
    theta.add_(change.view_as(theta))
    if residual is not None:
        residual.sub_(change.view_as(residual))
    checksum = Checksum()
    checksum.add_range(start, theta)
    return checksum, float(torch.linalg.vector_norm(theta, dtype=torch.float64)) ** 2


def add_encoded_and_hash(
    codec: Pipeline,
    raw: torch.Tensor,
    place: Place,
    theta: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> tuple[Checksum, float]:
    """:func:`add_and_hash` of the values of ``codec``'s raw bytes ``raw`` at ``place`` (θ's span,
    from :meth:`~Pipeline.unpack` or :meth:`~Pipeline.roundtrip_raw`): blockwise q8 adds straight
    from its codes into a host θ, the fp32 values never written out; other codecs, and θ on an
    accelerator, decode first (then copy the values to θ's device). Same results."""
    start = place.segment.start
    fused = codec.apply_raw(raw, theta, start, residual)
    if fused is not None:
        sumsq, low, high = fused
        return Checksum(low, high, theta.numel()), sumsq
    values = codec.decode_raw(raw, theta.numel(), place)
    if residual is not None and values.untyped_storage().data_ptr() == residual.untyped_storage().data_ptr():
        values = values.clone()  # fp32 codes are the residual's own bytes, which the add changes
    return add_and_hash(theta, values.to(theta.device), start, residual)


def state_hash(flat: torch.Tensor) -> str:
    """Digest of a whole canonical vector: equal digests mean bit-identical replicas."""
    checksum = Checksum()
    checksum.add_range(0, flat)
    return checksum.hexdigest()
