"""Codec pipelines named by a spec: ``[topk:F[:B] |] <value codec>[:args] [| zstd[:level]]``.

Examples: ``"q8|zstd:1"`` (int8, 128-element blocks, then zstd), ``"q4:64"``, ``"fp4"``,
``"topk:0.05|q2|zstd:3"`` (keep 5%, their values at 2 bits, indices Elias-Fano coded),
``"cyclic:0.4|q2"`` (the 40% of elements whose turn it is this round, no indices; encoding and
decoding need the chunk's :class:`~.cyclic.Place`), ``"fp32|zstd:1"`` (lossless). After a
sparsifier the value codec may be omitted (fp32).

Every encoded chunk is framed (:mod:`.envelope`); the raw size before entropy coding depends
only on the element count (for ``cyclic``, also on the chunk's place, which the receiver knows),
which bounds what a decoder ever allocates.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from geodiloco.compression import envelope, indices, nibbles
from geodiloco.compression.base import ValueCodec, reinterpret, require_finite
from geodiloco.compression.bits import pack_bits
from geodiloco.compression.casts import Bf16, Fp16, Fp32
from geodiloco.compression.codec_error import CodecError
from geodiloco.compression.cyclic import Cyclic, Place
from geodiloco.compression.entropy import Zstd
from geodiloco.compression.levels import (
    SIGN_LEVELS,
    LevelQuantizer,
    e2m1_levels,
    gaussian_two_bit_levels,
    normal_float_levels,
)
from geodiloco.compression.quantize import BlockwiseAbsmax
from geodiloco.compression.sparsify import TopK
from geodiloco.compression.staging import thread_staging


@dataclass(frozen=True, slots=True)
class StageArgs:
    """Arguments of one stage: ``name:pos1:pos2:key=value:flag``."""

    name: str
    positional: list[str]
    options: dict[str, str | None]

    def only(self, max_positional: int, options: tuple[str, ...] = ()) -> None:
        if len(self.positional) > max_positional:
            raise CodecError(f"{self.name} takes at most {max_positional} positional argument(s)")
        unknown = sorted(set(self.options) - set(options))
        if unknown:
            accepted = ", ".join(options) or "none"
            raise CodecError(f"{self.name}: unknown option(s) {', '.join(unknown)}; accepted: {accepted}")

    def int_at(self, i: int, default: int) -> int:
        return int(self.positional[i]) if len(self.positional) > i else default


def _quantizer(bits: int) -> Callable[[StageArgs], ValueCodec]:
    def build(a: StageArgs) -> ValueCodec:
        a.only(1, ("sr",))
        seed: int | None = None
        if "sr" in a.options:
            seed = int(a.options["sr"] or 0)
        return BlockwiseAbsmax(bits=bits, block=a.int_at(0, 128), sr_seed=seed)

    return build


def _levels(
    name: str,
    levels: tuple[float, ...],
    bits: int = 4,
    scale: Literal["absmax", "rms", "mean_abs"] = "absmax",
) -> Callable[[StageArgs], ValueCodec]:
    def build(a: StageArgs) -> ValueCodec:
        a.only(1)
        return LevelQuantizer(name=name, levels=levels, block=a.int_at(0, 128), bits=bits, scale=scale)

    return build


def _plain(codec: ValueCodec) -> Callable[[StageArgs], ValueCodec]:
    def build(a: StageArgs) -> ValueCodec:
        a.only(0)
        return codec

    return build


def _topk(a: StageArgs) -> TopK:
    a.only(2)
    if not a.positional:
        raise CodecError("topk needs a fraction, e.g. topk:0.02 or topk:0.02:256 (per block)")
    return TopK(fraction=float(a.positional[0]), block=a.int_at(1, 0))


def _cyclic(a: StageArgs) -> Cyclic:
    a.only(1)
    if not a.positional:
        raise CodecError("cyclic needs a fraction, e.g. cyclic:0.4")
    return Cyclic(fraction=float(a.positional[0]))


def _zstd(a: StageArgs) -> Zstd:
    a.only(1)
    return Zstd(level=a.int_at(0, 3))


VALUE_CODECS: dict[str, Callable[[StageArgs], ValueCodec]] = {
    "fp32": _plain(Fp32()),
    "fp16": _plain(Fp16()),
    "bf16": _plain(Bf16()),
    "q8": _quantizer(8),
    "q4": _quantizer(4),
    "q2": _quantizer(2),
    "fp4": _levels("fp4", e2m1_levels()),
    "nf4": _levels("nf4", normal_float_levels()),
    "lm2": _levels("lm2", gaussian_two_bit_levels(), bits=2, scale="rms"),
    "sign": _levels("sign", SIGN_LEVELS, bits=1, scale="mean_abs"),
}
DEVICE_CODECS = (BlockwiseAbsmax, LevelQuantizer)  # value codecs with an ``encode_on_device``
SPARSIFIERS: dict[str, Callable[[StageArgs], TopK | Cyclic]] = {"topk": _topk, "cyclic": _cyclic}
BYTE_STAGES: dict[str, Callable[[StageArgs], Zstd]] = {"zstd": _zstd}


def known_stages() -> list[str]:
    return [*VALUE_CODECS, *SPARSIFIERS, *BYTE_STAGES]


def _known() -> str:
    return (
        f"known: {', '.join(VALUE_CODECS)} (values); {', '.join(SPARSIFIERS)} (sparsifier, first); "
        f"{', '.join(BYTE_STAGES)} (bytes, last)"
    )


@dataclass(frozen=True, slots=True)
class Pipeline:
    """Optional sparsifier, one value codec, optional entropy stage, inside a checked frame.

    ``place`` (the chunk's round and canonical elements) matters only to a ``cyclic``
    sparsifier, which needs it on both sides; other pipelines ignore it.
    """

    spec: str
    values: ValueCodec
    sparsifier: TopK | Cyclic | None = None
    entropy: Zstd | None = None
    tag: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tag", envelope.codec_tag(self.canonical))

    @property
    def canonical(self) -> str:
        stages = [self.sparsifier, self.values, self.entropy]
        return "|".join(s.spec for s in stages if s is not None)

    def raw_size(self, numel: int, place: Place | None = None) -> int:
        """Bytes before entropy coding: a function of ``numel`` (and, for ``cyclic``, of the place;
        without one, of the expected count)."""
        if self.sparsifier is None:
            return self.values.encoded_size(numel)
        if isinstance(self.sparsifier, Cyclic):
            k = (
                self.sparsifier.nominal_count(numel)
                if place is None
                else self.sparsifier.select(place, numel).numel()
            )
            return self.sparsifier.prefix_size + self.values.encoded_size(k)
        return self.sparsifier.index_size(numel) + self.values.encoded_size(self.sparsifier.count(numel))

    @property
    def splits_nibbles(self) -> bool:
        """Whether zstd gets only the high nibbles of int8 codes (see :mod:`.nibbles`)."""
        return (
            self.entropy is not None
            and self.sparsifier is None
            and isinstance(self.values, BlockwiseAbsmax)
            and self.values.bits == 8
        )

    def bits_per_param(self, numel: int) -> float:
        """Bits per parameter of a frame before entropy coding (zstd only ever shrinks it)."""
        return 8.0 * (envelope.HEADER_SIZE + self.raw_size(numel)) / max(numel, 1)

    def encode(self, x: torch.Tensor, place: Place | None = None, *, on_device: bool | None = None) -> bytes:
        """The frame of ``x``; see :meth:`roundtrip` for where the work is done."""
        x = x.detach().reshape(-1)
        if self._codes_on_device(x, on_device):
            return self._device_roundtrip(x, place)[0]
        x = x.to("cpu", torch.float32)
        raw, prefix = self._raw_of(x, place)
        return self._seal(raw, x.numel(), prefix)

    def _raw_of(self, x: torch.Tensor, place: Place | None) -> tuple[torch.Tensor, bytes]:
        """The raw bytes (before the entropy stage) of the host fp32 ``x``, and the frame's prefix."""
        if self.sparsifier is None:
            return self.values.encode(x), b""
        if isinstance(self.sparsifier, Cyclic):
            require_finite(x)  # dropped elements too: they ride the error feedback
            kept = self.sparsifier.select(place, x.numel())
            assert place is not None
            return self.values.encode(x[kept]), self.sparsifier.prefix(place)
        kept, values = self.sparsifier.select_values(x)
        return torch.cat([indices.encode(kept, x.numel()), self.values.encode(values)]), b""

    def _seal(self, raw: torch.Tensor, numel: int, prefix: bytes) -> bytes:
        """Entropy-code the raw bytes (host uint8) and frame them."""
        body: bytes | memoryview = raw.numpy().data.cast("B")
        if self.splits_nibbles:  # steps, low nibbles as they are, then zstd over the high ones
            assert self.entropy is not None
            head = raw.numel() - numel
            hi, lo = nibbles.split(raw[head:])
            coded = self.entropy.encode(hi.numpy().data.cast("B"), of_frame=raw.numel())
            return envelope.seal(self.tag, numel, prefix, body[:head], lo.numpy().data, coded)
        if self.entropy is not None:
            body = self.entropy.encode(body)
        return envelope.seal(self.tag, numel, prefix, body)

    @property
    def device_ready(self) -> bool:
        """Whether values on an accelerator are coded there: q8/q4/q2 with round to nearest, fp4
        or nf4, alone or after ``cyclic`` or per-tensor ``topk``. Others copy fp32 to the host."""
        values_ready = isinstance(self.values, DEVICE_CODECS) and self.values.device_ready
        return values_ready and not (isinstance(self.sparsifier, TopK) and self.sparsifier.block)

    def _codes_on_device(self, x: torch.Tensor, on_device: bool | None) -> bool:
        """``on_device`` None: on the device exactly when ``x`` is not on the CPU (where the C
        kernels are faster); True forces the device path on any tensor (how CPU tests run it)."""
        wanted = x.device.type != "cpu" if on_device is None else on_device
        return wanted and self.device_ready

    def device_stage(
        self, x: torch.Tensor, place: Place | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sparsify and quantise on ``x``'s device: (raw value bytes, decoded values, kept
        indices for a top-k index set or None), all on that device."""
        assert isinstance(self.values, DEVICE_CODECS)
        x = x.to(torch.float32)
        if self.sparsifier is None:
            raw, back = self.values.encode_on_device(x)
            return raw, back, None
        if isinstance(self.sparsifier, Cyclic):
            require_finite(x)  # dropped elements too: they ride the error feedback
            kept = kept_on_device(self.sparsifier.select(place, x.numel()), x.numel(), x.device)
        else:
            kept = self.sparsifier.select(x)
        raw, kept_back = self.values.encode_on_device(x[kept])
        back = torch.zeros(x.numel(), dtype=torch.float32, device=x.device)
        back[kept] = kept_back
        return raw, back, kept if isinstance(self.sparsifier, TopK) else None

    def _device_roundtrip(self, x: torch.Tensor, place: Place | None) -> tuple[bytes, torch.Tensor]:
        raw, back, kept = self.device_stage(x, place)
        host = host_copy(raw)  # codes and steps: the only bytes from the device but top-k's indices
        prefix = b""
        if isinstance(self.sparsifier, Cyclic):
            assert place is not None  # select() refused a missing place
            prefix = self.sparsifier.prefix(place)
        elif kept is not None:  # Elias-Fano over int64 indices on the host: k x 8 bytes cross
            host = torch.cat([indices.encode(kept.cpu(), x.numel()), host])
        return self._seal(host, x.numel(), prefix), back

    def decode(self, data: bytes | memoryview, numel: int, place: Place | None = None) -> torch.Tensor:
        """The fp32 tensor of ``numel`` elements in ``data``; CodecError on any inconsistency."""
        raw, kept = self._unpack(data, numel, place)
        return self._values(raw, numel, kept)

    def unpack(
        self,
        data: bytes | memoryview,
        numel: int,
        place: Place | None = None,
        scratch: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The frame's raw bytes (its body after the entropy stage: value codes, scales, indices),
        checked for size; :meth:`decode_raw` gives its values. A receiver that needs the values
        twice keeps these and undoes the entropy stage once. A nibble-split frame's bytes are
        joined into ``scratch`` (host uint8) where it is large enough: a receiver decoding chunk
        after chunk reuses its pages instead of taking fresh ones per chunk."""
        return self._unpack(data, numel, place, scratch)[0]

    def decode_raw(self, raw: torch.Tensor, numel: int, place: Place | None = None) -> torch.Tensor:
        """The fp32 values of raw bytes from :meth:`unpack` (or the encoder's, before framing)."""
        kept = self.sparsifier.select(place, numel) if isinstance(self.sparsifier, Cyclic) else None
        if raw.numel() != self._body_size(numel, kept):
            raise CodecError(f"{self.spec}: {raw.numel()} raw bytes, expected {self._body_size(numel, kept)}")
        return self._values(raw, numel, kept)

    @property
    def decodes_on_device(self) -> bool:
        """Whether :meth:`decode_on_device` takes this pipeline's raw bytes: blockwise q8/q4/q2 or
        fp32 values, no sparsifier (the outer updates and full states as configured by default)."""
        return self.sparsifier is None and isinstance(self.values, BlockwiseAbsmax | Fp32)

    def check_raw(self, raw: torch.Tensor, numel: int) -> None:
        """Refuse, on the host and without decoding, the raw bytes :meth:`decode_raw` refuses."""
        if not self.decodes_on_device:
            raise CodecError(f"{self.spec}: decoded on the host only")
        if isinstance(self.values, BlockwiseAbsmax):
            self.values.check(raw, numel)
            return
        if raw.numel() != 4 * numel:
            raise CodecError(f"{self.spec}: {raw.numel()} raw bytes, expected {4 * numel}")
        self.values.decode(raw, numel)  # fp32: a view, finite or refused

    def decode_on_device(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """:meth:`decode_raw`'s values of raw bytes that :meth:`check_raw` passed and that were then
        copied to a device: the same bits, computed there, with no host round trip (no check
        waits for the device)."""
        if not self.decodes_on_device:
            raise CodecError(f"{self.spec}: decoded on the host only")
        if isinstance(self.values, BlockwiseAbsmax):
            return self.values.decode_on_device(raw, numel)
        return reinterpret(raw, torch.float32)

    def fold_raw(
        self, raw: torch.Tensor, place: Place, total: torch.Tensor, weight: float, first: bool
    ) -> None:
        """``total``'s elements at ``place`` = weight · the values of ``raw`` (from :meth:`unpack`),
        or += when not ``first``. Blockwise q8 alone folds straight from its codes in one pass (no
        fp32 copy of the values); other codecs decode first. The same values either way."""
        seg = place.segment
        if self.sparsifier is None and isinstance(self.values, BlockwiseAbsmax):
            out = total[seg.start : seg.end]
            if self.values.fold(raw, seg.numel, out, seg.row_len, seg.stride, weight, not first):
                return
        values = self.decode_raw(raw, seg.numel, place).view(seg.rows, seg.row_len)
        view = seg.view_of(total)
        if first:
            torch.mul(values, weight, out=view)
        else:
            view.add_(values, alpha=weight)

    def apply_raw(
        self, raw: torch.Tensor, theta: torch.Tensor, first: int, residual: torch.Tensor | None = None
    ) -> tuple[float, int, int] | None:
        """θ += the values of ``raw`` (from :meth:`unpack` or :meth:`roundtrip_raw`, ``theta``'s
        size) and ``residual`` −= them, with the new θ's Σ θ² and checksum sums, in one pass from
        the codes: blockwise q8 alone, or top-k with the sign code (None elsewhere, nothing
        written; decode instead)."""
        if self.sparsifier is None and isinstance(self.values, BlockwiseAbsmax):
            return self.values.add_and_hash(raw, theta, first, residual)
        if (
            isinstance(self.sparsifier, TopK)
            and isinstance(self.values, LevelQuantizer)
            and self.values.fused
        ):
            numel = theta.numel()
            if raw.numel() != self.raw_size(numel):
                raise CodecError(f"{self.spec}: {raw.numel()} raw bytes, expected {self.raw_size(numel)}")
            split = self.sparsifier.index_size(numel)
            kept = indices.decode(raw[:split], numel, self.sparsifier.count(numel))
            return self.values.add_and_hash(raw[split:], kept, theta, first, residual)
        return None

    def raw_sumsq(self, raw: torch.Tensor, numel: int) -> float | None:
        """Σ x² of :meth:`decode_raw`'s values computed from the raw bytes without decoding them,
        where the codec has that path (blockwise q8, no sparsifier); None where it has not."""
        if self.sparsifier is not None or not isinstance(self.values, BlockwiseAbsmax):
            return None
        return self.values.sumsq(raw, numel)  # checks the size, as decode_raw does

    def _body_size(self, numel: int, kept: torch.Tensor | None) -> int:
        """Raw bytes after any prefix; ``kept``: a cyclic sparsifier's elements at the place."""
        if kept is not None:
            return self.values.encoded_size(kept.numel())
        return self.raw_size(numel)

    def _unpack(
        self, data: bytes | memoryview, numel: int, place: Place | None, scratch: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        body = envelope.open_frame(data, self.tag, numel, self.spec)
        kept: torch.Tensor | None = None
        if isinstance(self.sparsifier, Cyclic):
            body = self.sparsifier.check_prefix(body, place)
            kept = self.sparsifier.select(place, numel)
        size = self._body_size(numel, kept)
        if self.splits_nibbles:
            return self._join_nibbles(body, size, numel, scratch), kept
        if self.entropy is not None:
            body = memoryview(self.entropy.decode(body, size))
        elif len(body) != size:
            raise CodecError(f"{self.spec}: frame body is {len(body)} bytes, expected {size}")
        raw = (
            torch.frombuffer(bytearray(body), dtype=torch.uint8)
            if size
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw, kept

    def _values(self, raw: torch.Tensor, numel: int, kept: torch.Tensor | None) -> torch.Tensor:
        """Values of raw bytes of the right size; ``kept`` as in :meth:`_body_size`."""
        if self.sparsifier is None:
            return self.values.decode(raw, numel)
        if kept is None:
            assert isinstance(self.sparsifier, TopK)
            split = self.sparsifier.index_size(numel)
            kept = indices.decode(raw[:split], numel, self.sparsifier.count(numel))
            raw = raw[split:]
        out = torch.empty(numel, dtype=torch.float32)
        if isinstance(self.values, LevelQuantizer) and self.values.scatter(raw, kept, out):
            return out  # zeros but the kept values, in one pass
        out.zero_()[kept] = self.values.decode(raw, kept.numel())
        return out

    def _join_nibbles(
        self, body: memoryview, size: int, numel: int, scratch: torch.Tensor | None
    ) -> torch.Tensor:
        """The raw bytes of a nibble-split frame body: steps, low nibbles, zstd of the high ones."""
        assert self.entropy is not None
        head, half = size - numel, nibbles.half_size(numel)
        if len(body) < head + half:
            raise CodecError(
                f"{self.spec}: frame body is {len(body)} bytes, shorter than its {head + half} stored"
            )
        if scratch is not None and scratch.numel() >= size:
            raw = scratch[:size]
        else:
            raw = torch.empty(size, dtype=torch.uint8)
        raw.numpy()[:head] = memoryview(body[:head])
        hi = self.entropy.decode(body[head + half :], half)
        nibbles.join(hi, body[head : head + half], raw[head:])
        return raw

    def roundtrip_raw(self, x: torch.Tensor, place: Place | None = None) -> tuple[bytes, torch.Tensor]:
        """The frame of ``x`` and its raw bytes (on the host), from which :meth:`decode_raw` (or
        :meth:`apply_raw`) gives exactly what every receiver decodes. For a host fp32 ``x`` the raw
        bytes may share its memory (fp32 codes)."""
        host = x.detach().reshape(-1).to("cpu", torch.float32)
        raw, prefix = self._raw_of(host, place)
        return self._seal(raw, host.numel(), prefix), raw

    def encode_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor, place: Place | None = None
    ) -> bytes:
        """The frame of ``x``, and ``residual`` = x − the values every receiver decodes from it
        (error feedback's record), written in place. Top-k on the host copies ``x`` and corrects
        the kept elements (:meth:`~.sparsify.TopK.residual`) where :meth:`roundtrip` would write
        a dense decoded tensor and subtract it: the same bits."""
        flat = x.detach().reshape(-1)
        host = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in (flat, residual))
        if isinstance(self.sparsifier, TopK) and host and residual.is_contiguous():
            kept, values = self.sparsifier.select_values(flat)
            coded = self.values.encode(values)
            data = self._seal(torch.cat([indices.encode(kept, flat.numel()), coded]), flat.numel(), b"")
            self.sparsifier.residual(flat, kept, self.values.decode(coded, kept.numel()), residual.view(-1))
            return data
        data, back = self.roundtrip(x, place)
        torch.sub(x, back.view_as(x), out=residual.view_as(x))
        return data

    def roundtrip(
        self, x: torch.Tensor, place: Place | None = None, *, on_device: bool | None = None
    ) -> tuple[bytes, torch.Tensor]:
        """Encode, and the exact tensor every receiver will decode from those bytes, on ``x``'s device.

        On an accelerator a :attr:`device_ready` pipeline quantises there and copies only the raw
        bytes to the host (through a pinned buffer), and the decoded values are computed there
        from the codes; other pipelines copy fp32 to the host and the decoded values back.
        """
        x = x.detach().reshape(-1)
        if self._codes_on_device(x, on_device):
            return self._device_roundtrip(x, place)
        host = x.to("cpu", torch.float32)
        raw, prefix = self._raw_of(host, place)
        data = self._seal(raw, host.numel(), prefix)
        # the values decoded from the raw bytes the frame holds: what every receiver decodes, without
        # undoing the entropy stage that was just applied (lossless)
        values = self.decode_raw(raw, host.numel(), place)
        if values.untyped_storage().data_ptr() == host.untyped_storage().data_ptr():
            values = values.clone()  # fp32 codes are x's own bytes: the caller may change x next
        return data, values.to(x.device)

    def error_bound(self, x: torch.Tensor, place: Place | None = None) -> torch.Tensor:
        """Per-element bound on ``|x - roundtrip(x)|``: dropped elements are off by their size."""
        x = x.detach().reshape(-1).to(torch.float32)
        if self.sparsifier is None:
            return self.values.error_bound(x)
        if isinstance(self.sparsifier, Cyclic):
            kept = self.sparsifier.select(place, x.numel())
        else:
            kept = self.sparsifier.select(x)
        bound = x.abs()
        bound[kept] = self.values.error_bound(x[kept])
        return bound


def kept_on_device(kept: torch.Tensor, numel: int, device: torch.device) -> torch.Tensor:
    """A host-made sorted index set on ``device``, sent as a bit mask: an eighth of a byte per
    element instead of eight bytes per kept one."""
    mask = torch.zeros(numel, dtype=torch.bool)
    mask[kept] = True
    packed = pack_bits(mask, 1).to(device)
    bits = packed[:, None] >> torch.arange(8, dtype=torch.uint8, device=device)
    return torch.nonzero(bits.bitwise_and_(1).view(-1)[:numel]).view(-1)


def host_copy(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8) on the host: from CUDA on the thread's side stream through its pinned
    buffer (:mod:`.staging`), valid until the thread's next call (the caller frames it first);
    a CPU tensor as it is."""
    if raw.device.type == "cpu":
        return raw
    return thread_staging(raw.device).to_host(raw)


def _parse_stage(text: str) -> StageArgs:
    name, *args = (p.strip() for p in text.strip().split(":"))
    positional: list[str] = []
    options: dict[str, str | None] = {}
    for arg in args:
        key, eq, value = arg.partition("=")
        if eq or (not arg[:1].isdigit() and not arg.startswith((".", "-"))):
            options[key.strip()] = value.strip() if eq else None
        else:
            positional.append(arg)
    return StageArgs(name, positional, options)


@functools.lru_cache(maxsize=256)
def parse_pipeline(spec: str) -> Pipeline:
    """Build a pipeline from its spec; unknown names raise with the list of known ones.

    A pipeline is an immutable value, so each spec is parsed once per process: the run's codecs
    (:class:`~geodiloco.config.CompressionConfig`) and the codec named by every chunk received
    are looked up, not parsed again (a refused spec is not cached: it raises every time)."""
    stages = [_parse_stage(p) for p in spec.split("|") if p.strip()]
    if not stages:
        raise CodecError(f"empty codec pipeline {spec!r}; {_known()}")
    for stage in stages:
        if stage.name not in (*VALUE_CODECS, *SPARSIFIERS, *BYTE_STAGES):
            raise CodecError(f"unknown codec stage {stage.name!r} in {spec!r}; {_known()}")
    try:
        sparsifier = SPARSIFIERS[stages[0].name](stages.pop(0)) if stages[0].name in SPARSIFIERS else None
        entropy = (
            BYTE_STAGES[stages[-1].name](stages.pop()) if stages and stages[-1].name in BYTE_STAGES else None
        )
        if len(stages) > 1 or any(s.name not in VALUE_CODECS for s in stages):
            raise CodecError(
                f"codec pipeline {spec!r} must be [sparsifier |] value codec [| byte stage], "
                f"with one of each at most; {_known()}"
            )
        if not stages and sparsifier is None:
            raise CodecError(f"codec pipeline {spec!r} has no value codec; {_known()}")
        values = VALUE_CODECS[stages[0].name](stages[0]) if stages else Fp32()
    except CodecError as exc:
        raise CodecError(f"{exc} (in {spec!r})") from None
    except ValueError as exc:
        raise CodecError(f"bad argument in codec pipeline {spec!r}: {exc}") from None
    return Pipeline(spec=spec, values=values, sparsifier=sparsifier, entropy=entropy)
