"""Named codec pipelines: ``"<tensor stage>[:arg] [| zstd[:level]]"``.

Examples: ``"q8"``, ``"q8:256|zstd:3"`` (int8 with 256-element blocks, then zstd level 3),
``"fp32|zstd:1"`` (lossless).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from geodiloco.compression.entropy import Zstd
from geodiloco.compression.errors import CodecError
from geodiloco.compression.quantize import BlockwiseInt8, Fp32

TensorStage = Fp32 | BlockwiseInt8

_TENSOR_STAGES: dict[str, Callable[[str | None], TensorStage]] = {
    "fp32": lambda arg: Fp32(),
    "q8": lambda arg: BlockwiseInt8(block=int(arg)) if arg else BlockwiseInt8(),
}
_BYTE_STAGES: dict[str, Callable[[str | None], Zstd]] = {
    "zstd": lambda arg: Zstd(level=int(arg)) if arg else Zstd(),
}


def known_stages() -> list[str]:
    return sorted(_TENSOR_STAGES) + sorted(_BYTE_STAGES)


@dataclass(frozen=True, slots=True)
class Pipeline:
    """A tensor stage followed by an optional entropy stage."""

    spec: str
    tensor_stage: TensorStage
    entropy: Zstd | None

    def bits_per_param(self, numel: int) -> float:
        """Bits per parameter before entropy coding (an upper bound for the whole pipeline)."""
        return self.tensor_stage.bits_per_param(numel)

    def encode(self, x: torch.Tensor) -> bytes:
        raw = self.tensor_stage.encode(x)
        return self.entropy.encode(raw) if self.entropy else raw

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        if self.entropy:
            data = self.entropy.decode(data, self.tensor_stage.encoded_size(numel))
        return self.tensor_stage.decode(data, numel)

    def roundtrip(self, x: torch.Tensor) -> tuple[bytes, torch.Tensor]:
        """Encode, and the exact tensor every receiver will decode from those bytes."""
        data = self.encode(x)
        return data, self.decode(data, x.numel())


def _split(stage: str) -> tuple[str, str | None]:
    name, _, arg = stage.strip().partition(":")
    return name.strip(), (arg.strip() or None)


def parse_pipeline(spec: str) -> Pipeline:
    """Build a pipeline from its spec; unknown names raise with the list of known ones."""
    parts = [p for p in spec.split("|") if p.strip()]
    if not parts:
        raise CodecError(f"empty codec pipeline {spec!r}; known stages: {', '.join(known_stages())}")
    name, arg = _split(parts[0])
    if name not in _TENSOR_STAGES:
        raise CodecError(
            f"unknown tensor stage {name!r} in {spec!r}; known: {', '.join(sorted(_TENSOR_STAGES))}"
        )
    try:
        tensor_stage = _TENSOR_STAGES[name](arg)
        entropy = None
        for part in parts[1:]:
            bname, barg = _split(part)
            if bname not in _BYTE_STAGES:
                raise CodecError(
                    f"unknown byte stage {bname!r} in {spec!r}; known: {', '.join(sorted(_BYTE_STAGES))}"
                )
            if entropy is not None:
                raise CodecError(f"at most one entropy stage per pipeline, got {spec!r}")
            entropy = _BYTE_STAGES[bname](barg)
    except ValueError as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"bad argument in codec pipeline {spec!r}: {exc}") from None
    if isinstance(tensor_stage, BlockwiseInt8) and tensor_stage.block <= 0:
        raise CodecError(f"q8 block size must be > 0 in {spec!r}")
    return Pipeline(spec=spec, tensor_stage=tensor_stage, entropy=entropy)
