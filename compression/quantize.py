"""Blockwise absmax quantisation to 8, 4 or 2 bits, bit-packed, with optional stochastic rounding.

Layout: one fp32 step per block, then the codes (int8 for 8 bits, packed unsigned otherwise).
Grids: 8 and 4 bits are symmetric with an exact zero (codes -127..127 and -7..7); 2 bits would
waste a quarter of its codes on a symmetric grid, so it uses the four levels ±a/3, ±a
(``a`` = the block's absmax). Round to nearest: error <= step/2; stochastic: error < step.
"""

from __future__ import annotations

import math
import threading
import zlib
from dataclasses import dataclass

import torch

from geodiloco.compression.base import as_blocks, block_rows, n_blocks, reinterpret
from geodiloco.compression.bits import pack_bits, packed_size, unpack_bits
from geodiloco.compression.codec_error import CodecError

try:  # the fused C kernels for 8 bits, built at install time; same bytes as the torch path
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

# bits -> (half-range in steps, code offset, largest code): value = (code - offset) * step
_GRIDS: dict[int, tuple[float, float, int]] = {8: (127.0, 0.0, 127), 4: (7.0, 7.0, 14), 2: (1.5, 1.5, 3)}
FP32_MAX = torch.finfo(torch.float32).max
SCRATCH_MAX = 1 << 21  # elements: one streamed chunk at most; larger inputs get a fresh buffer

_scratch = threading.local()


def _scratch_fp32(numel: int, device: torch.device) -> torch.Tensor:
    """A per-thread fp32 work buffer: a fresh multi-MB temporary per chunk costs more in page
    faults than the arithmetic that fills it (an accelerator's caching allocator already reuses)."""
    if numel > SCRATCH_MAX or device.type != "cpu":
        return torch.empty(numel, dtype=torch.float32, device=device)
    buf: torch.Tensor | None = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < numel:
        # no more than asked: ranks hold only their shard
        buf = torch.empty(numel, dtype=torch.float32, device=device)
        _scratch.buf = buf
    return buf[:numel]


def _host_fp32(*tensors: torch.Tensor) -> bool:
    """Whether the C kernels can take these tensors as they are: contiguous host fp32."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


@dataclass(frozen=True, slots=True)
class BlockwiseAbsmax:
    """``bits`` per element plus 32 bits per block of ``block`` elements.

    With ``sr_seed`` set, rounding is stochastic (unbiased) but deterministic: the noise comes
    from a generator seeded with ``sr_seed`` and a CRC of the input, so the same input gives
    the same bytes, and different rounds get different noise.
    """

    bits: int = 8
    block: int = 128
    sr_seed: int | None = None

    def __post_init__(self) -> None:
        if self.bits not in _GRIDS:
            raise CodecError(f"blockwise quantisation supports {sorted(_GRIDS)} bits, not {self.bits}")
        if not 1 <= self.block <= 1 << 20:
            raise CodecError(f"q{self.bits} block size must be in [1, {1 << 20}], got {self.block}")

    @property
    def spec(self) -> str:
        sr = "" if self.sr_seed is None else f":sr={self.sr_seed}"
        return f"q{self.bits}:{self.block}{sr}"

    def _code_bytes(self, numel: int) -> int:
        return numel if self.bits == 8 else packed_size(numel, self.bits)

    def encoded_size(self, numel: int) -> int:
        return 4 * n_blocks(numel, self.block) + self._code_bytes(numel)

    @property
    def fused(self) -> bool:
        """Whether the C kernels do this codec's work (8 bits, round to nearest)."""
        return _kernels is not None and self.bits == 8 and self.sr_seed is None

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        numel, nb = x.numel(), n_blocks(x.numel(), self.block)
        out = torch.empty(self.encoded_size(numel), dtype=torch.uint8)
        step = out[: 4 * nb].view(torch.float32)
        codes = out[4 * nb :].view(torch.int8) if self.bits == 8 else torch.empty(numel, dtype=torch.uint8)
        if self.fused and numel and x.dtype == torch.float32:
            src = x.detach().contiguous().numpy()
            if not _kernels.quantize_q8(src, self.block, step.numpy(), codes.numpy()):
                raise CodecError("tensor contains NaN or Inf")
            return out
        for first, rows in block_rows(x, self.block):
            start = first * self.block
            dst = codes[start : start + rows.numel()]
            dst.copy_(self._scale(x, first, rows, step[first : first + rows.shape[0]])[: dst.numel()])
        if self.bits != 8:
            out[4 * nb :].copy_(pack_bits(codes, self.bits))
        return out

    def _scale(self, x: torch.Tensor, first: int, rows: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Write the rows' steps into ``step``; return their codes as a flat float tensor."""
        half, offset, top = _GRIDS[self.bits]
        # two reading passes, no temporary (abs() would write a copy of the input); the final
        # abs_ turns an all-zero block's -0.0 into +0.0
        absmax = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg_()).abs_()
        if not math.isfinite(float(absmax.max())):  # NaN/Inf anywhere shows up in the largest absmax
            raise CodecError("tensor contains NaN or Inf")
        torch.div(absmax, half, out=step)
        inv = torch.reciprocal(step).nan_to_num_(posinf=0.0)  # an all-zero block: step 0, codes 0
        y = torch.mul(rows, inv[:, None], out=_scratch_fp32(rows.numel(), rows.device).view_as(rows))
        if offset:
            y.add_(offset)
        if self.sr_seed is None:
            y.round_()
        else:
            y.add_(self._noise(x, first, y.shape)).floor_().clamp_(-top if self.bits == 8 else 0, top)
        return y.view(-1)

    @property
    def device_ready(self) -> bool:
        """Whether :meth:`encode_on_device` applies: stochastic rounding seeds its noise from a CRC
        of the input's bytes on the host, so it stays a host codec."""
        return self.sr_seed is None

    def encode_on_device(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path on ``x``'s device: (the encoding as uint8, the values every receiver
        decodes from it as fp32), both on that device; the same bytes as :meth:`encode`.

        The decoded values come from the integer codes with the decoder's arithmetic (code minus
        offset, times step), so they are bit-identical to decoding the bytes (+0.0 included).
        """
        if not self.device_ready:
            raise CodecError(f"{self.spec}: stochastic rounding is coded on the host")
        numel, nb, device = x.numel(), n_blocks(x.numel(), self.block), x.device
        out = torch.empty(self.encoded_size(numel), dtype=torch.uint8, device=device)
        back = torch.empty(numel, dtype=torch.float32, device=device)
        step = out[: 4 * nb].view(torch.float32)
        dtype = torch.int8 if self.bits == 8 else torch.uint8
        codes = torch.empty(numel, dtype=dtype, device=device)
        offset = _GRIDS[self.bits][1]
        for first, rows in block_rows(x, self.block):
            start, steps = first * self.block, step[first : first + rows.shape[0]]
            dst = codes[start : start + rows.numel()]
            dst.copy_(self._scale(x, first, rows, steps)[: dst.numel()])
            values = back[start : start + dst.numel()].copy_(dst)
            if offset:
                values.sub_(offset)
            width = min(self.block, values.numel())
            values.view(-1, width).mul_(steps[: values.numel() // width, None])
        out[4 * nb :].copy_(codes.view(torch.uint8) if self.bits == 8 else pack_bits(codes, self.bits))
        return out, back

    def _noise(self, x: torch.Tensor, first: int, shape: torch.Size) -> torch.Tensor:
        seed = (self.sr_seed or 0) ^ zlib.crc32(x.contiguous().numpy().data) ^ first
        return torch.rand(shape, generator=torch.Generator().manual_seed(seed))

    def _steps(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """The block steps of ``raw``, checked: right size, each step finite and in range."""
        half = _GRIDS[self.bits][0]
        if raw.numel() != self.encoded_size(numel):
            raise CodecError(f"{self.spec}: {raw.numel()} bytes, expected {self.encoded_size(numel)}")
        nb = n_blocks(numel, self.block)
        step = reinterpret(raw[: 4 * nb], torch.float32)
        if nb and not bool(((step >= 0) & (step <= FP32_MAX / half)).all()):
            raise CodecError(f"{self.spec}: a block scale (step) is negative, too large or not finite")
        return step

    def _q8_parts(self, raw: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The checked block steps of q8 ``raw`` and its int8 codes, for the C kernels."""
        step = self._steps(raw, numel)
        return step, raw[4 * step.numel() :].view(torch.int8)

    def sumsq(self, raw: torch.Tensor, numel: int) -> float | None:
        """Σ x² of the values :meth:`decode` gives, from the codes and steps without decoding
        them (the q8 kernel, in double); None for a codec without that path. Refuses what
        :meth:`decode` refuses."""
        if not self.fused:
            return None
        step, codes = self._q8_parts(raw, numel)
        if not numel:
            return 0.0
        total = _kernels.sumsq_q8(step.numpy(), codes.numpy(), self.block)
        if total is None:
            raise CodecError(f"{self.spec}: code -128 is outside the grid")
        return total

    def fold(
        self,
        raw: torch.Tensor,
        numel: int,
        out: torch.Tensor,
        row_len: int,
        stride: int,
        weight: float,
        add: bool,
    ) -> bool:
        """``out`` = weight · :meth:`decode`'s values (+= when ``add``), from the codes in one C
        pass, the values laid in rows of ``row_len`` placed ``stride`` apart in the contiguous
        host fp32 ``out``: the values torch's mul (or add with alpha) of the decoded tensor
        gives. False, with nothing written, where the kernel does not apply (not q8, not built).
        Refuses what :meth:`decode` refuses."""
        if not (self.fused and numel and _host_fp32(out)):
            return False
        step, codes = self._q8_parts(raw, numel)
        if not _kernels.fold_q8(
            step.numpy(), codes.numpy(), self.block, out.numpy(), row_len, stride, weight, add
        ):
            raise CodecError(f"{self.spec}: code -128 is outside the grid")
        return True

    def add_and_hash(
        self,
        raw: torch.Tensor,
        theta: torch.Tensor,
        first: int,
        residual: torch.Tensor | None,
    ) -> tuple[float, int, int] | None:
        """θ += :meth:`decode`'s values (and ``residual`` −= them, where given) from the codes in
        one C pass, returning the new θ's Σ θ² and checksum sums as
        :func:`geodiloco.params.add_and_hash` computes them: the same bits as decoding first.
        None, with nothing written, where the kernel does not apply (not q8, not built, not
        contiguous host fp32). Refuses what :meth:`decode` refuses."""
        numel = theta.numel()
        tensors = [theta] if residual is None else [theta, residual]
        if not (self.fused and numel and _host_fp32(*tensors)):
            return None
        step, codes = self._q8_parts(raw, numel)
        rest = None if residual is None else residual.numpy()
        done = _kernels.apply_q8(theta.numpy(), step.numpy(), codes.numpy(), self.block, rest, first)
        if done is None:
            raise CodecError(f"{self.spec}: code -128 is outside the grid")
        return done

    def check(self, raw: torch.Tensor, numel: int) -> None:
        """Refuse what :meth:`decode` refuses, without decoding: on the host, before the bytes
        go to a device to be decoded there (:meth:`decode_on_device` checks nothing)."""
        top = _GRIDS[self.bits][2]
        body = raw[4 * self._steps(raw, numel).numel() :]
        if not numel:
            return
        if self.bits == 8 and int(body.view(torch.int8).min()) < -top:
            raise CodecError(f"{self.spec}: code -128 is outside the grid")
        if self.bits != 8 and int(unpack_bits(body, self.bits, numel).max()) > top:
            raise CodecError(f"{self.spec}: a code exceeds {top}")

    def decode_on_device(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """:meth:`decode`'s values, computed where ``raw`` is (bytes :meth:`check` passed): code
        minus offset, times step, in fp32, so the same bits as the host's decoder."""
        offset = _GRIDS[self.bits][1]
        nb = n_blocks(numel, self.block)
        step = reinterpret(raw[: 4 * nb], torch.float32)
        body = raw[4 * nb :]
        codes = body.view(torch.int8) if self.bits == 8 else unpack_bits(body, self.bits, numel)
        out = torch.empty(numel, dtype=torch.float32, device=raw.device)
        full = numel // self.block * self.block
        for lo, hi in ((0, full), (full, numel)):
            if hi > lo:
                values = out[lo:hi].copy_(codes[lo:hi]).view(-1, min(self.block, hi - lo))
                if offset:
                    values.sub_(offset)
                values.mul_(step[lo // self.block :, None][: values.shape[0]])
        return out

    def decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        _, offset, top = _GRIDS[self.bits]
        step = self._steps(raw, numel)
        nb = step.numel()
        if self.bits == 8:
            codes = raw[4 * nb :].view(torch.int8)
            if self.fused and numel:
                out = torch.empty(numel, dtype=torch.float32)
                if not _kernels.dequantize_q8(step.numpy(), codes.numpy(), self.block, out.numpy()):
                    raise CodecError(f"{self.spec}: code -128 is outside the grid")
                return out
            if numel and int(codes.min()) < -top:
                raise CodecError(f"{self.spec}: code -128 is outside the grid")
        else:
            codes = unpack_bits(raw[4 * nb :], self.bits, numel)
            if numel and int(codes.max()) > top:
                raise CodecError(f"{self.spec}: a code exceeds {top}")
        out = torch.empty(numel, dtype=torch.float32)
        full = numel // self.block * self.block
        for lo, hi in ((0, full), (full, numel)):
            if hi > lo:
                values = out[lo:hi].copy_(codes[lo:hi]).view(-1, min(self.block, hi - lo))
                if offset:
                    values.sub_(offset)
                values.mul_(step[lo // self.block :, None][: values.shape[0]])
        return out

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        half = _GRIDS[self.bits][0]
        if x.numel() == 0:
            return torch.zeros(0)
        step = as_blocks(x, self.block).abs().amax(dim=1) / half
        per_step = 1.0 if self.sr_seed is not None else 0.5
        bound = (step * per_step * (1 + 1e-5)).repeat_interleave(self.block)[: x.numel()]
        return bound + 1e-30
