"""Masked codes on the wire at ``bits`` (8 to 16) per element, not 16.

Arithmetic is mod 2^16 in uint16 lanes and only the low ``bits`` travel: 2^bits divides 2^16,
so sums agree in the ring Z_{2^bits}. Layout of a span of n elements (``bits`` = 8 + h): the n
low bytes, then the high h bits in planes of 8, 4, 2 and 1 bits (those that make up h, widest
first, lowest bits first). A plane of width w packs 8/w elements to a byte, strided: with
m = ceil(n·w/8), byte k holds elements k, k+m, k+2m, ... (element k+s·m at bit s·w). A plain bit
stream of 10- or 11-bit fields would be as small (up to a byte per plane), but its shifts differ
per element and do not vectorise; this layout is contiguous passes only (``ring_pack``,
``ring_add`` and ``ring_add_all`` in compression/_kernels.c, about memory speed; without the
kernels numpy gives the same bytes, slower).
"""

from __future__ import annotations

import numpy as np

from geodiloco.security.secagg.secagg_errors import InvalidField

try:
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

CODE_MAX = 127  # int8 codes of the shared-scale quantiser are in [-127, 127]
WIDTHS = tuple(range(8, 17))


def ring_bits(sites: int) -> int:
    """The narrowest ring holding any sum of ``sites`` codes as a signed value: 127·n < 2^(bits-1)."""
    if sites < 1:
        raise InvalidField("sites", f"must be >= 1, got {sites}")
    need = max(WIDTHS[0], (CODE_MAX * sites).bit_length() + 1)
    if need > WIDTHS[-1]:
        raise InvalidField(
            "sites", f"{sites} sites need a {need}-bit ring; at most {WIDTHS[-1]} bits supported"
        )
    return need


def _check(bits: int) -> None:
    if bits not in WIDTHS:
        raise InvalidField("ring_bits", f"must be in [{WIDTHS[0]}, {WIDTHS[-1]}], got {bits}")


def _planes(bits: int) -> list[int]:
    """The widths of the high bits' planes, widest first."""
    return [w for w in (8, 4, 2, 1) if (bits - 8) & w]


def packed_size(numel: int, bits: int) -> int:
    """n low bytes and ceil(n·w/8) per plane: ceil(n·bits/8), plus at most a byte per extra plane."""
    _check(bits)
    return numel + sum((numel * w + 7) // 8 for w in _planes(bits))


def pack(mask: np.ndarray, codes: np.ndarray, bits: int, out: np.ndarray | None = None) -> np.ndarray:
    """The wire bytes (uint8) of (mask + codes) mod 2^bits: ``mask`` uint16, ``codes`` int8, same
    length; written to the front of ``out`` (a reused uint8 buffer) where given."""
    _check(bits)
    if mask.dtype != np.uint16 or codes.dtype != np.int8 or mask.shape != codes.shape:
        raise InvalidField("codes", "pack takes a uint16 mask and int8 codes of one length")
    size = packed_size(codes.size, bits)
    out = np.empty(size, dtype=np.uint8) if out is None or out.size < size else out[:size]
    if _kernels is not None:
        _kernels.ring_pack(np.ascontiguousarray(mask), np.ascontiguousarray(codes), bits, out)
        return out
    values = mask + codes.astype(np.int16).view(np.uint16)
    out[: codes.size] = values.astype(np.uint8)
    at, low = codes.size, 8
    for w in _planes(bits):
        m = (codes.size * w + 7) // 8
        plane = out[at : at + m]
        plane[:] = 0
        for s in range(8 // w):
            part = values[s * m : (s + 1) * m]
            plane[: part.size] |= (((part >> low) & ((1 << w) - 1)) << (s * w)).astype(np.uint8)
        at, low = at + m, low + w
    return out


def add_packed(acc: np.ndarray, packed: bytes | memoryview, bits: int) -> None:
    """``acc`` (uint16) += the fields of ``packed`` (wire bytes of ``acc.size`` elements), mod 2^16."""
    _check(bits)
    if acc.dtype != np.uint16 or len(packed) != packed_size(acc.size, bits):
        raise InvalidField("payload", f"{len(packed)} bytes, expected {packed_size(acc.size, bits)}")
    if _kernels is not None:
        _kernels.ring_add(packed, bits, acc)
        return
    raw = np.frombuffer(packed, dtype=np.uint8)
    acc += raw[: acc.size]
    at, low = acc.size, 8
    for w in _planes(bits):
        m = (acc.size * w + 7) // 8
        plane = raw[at : at + m].astype(np.uint16)
        for s in range(8 // w):
            part = acc[s * m : (s + 1) * m]
            part += ((plane[: part.size] >> (s * w)) & ((1 << w) - 1)) << low
        at, low = at + m, low + w


def add_all(acc: np.ndarray, payloads: list[bytes], bits: int, assign: bool = False) -> None:
    """:func:`add_packed` of several pushes of the same span, tiled so the sum stays in cache;
    with ``assign``, ``acc`` becomes their sum (its contents are not read: no zeroing pass)."""
    _check(bits)
    size = packed_size(acc.size, bits)
    for p in payloads:
        if len(p) != size:
            raise InvalidField("payload", f"{len(p)} bytes, expected {size}")
    if _kernels is not None and acc.dtype == np.uint16:
        _kernels.ring_add_all(payloads, bits, acc, assign)
        return
    if assign:
        acc[:] = 0
    for p in payloads:
        add_packed(acc, p, bits)


def to_signed(acc: np.ndarray, bits: int) -> tuple[np.ndarray, int]:
    """The ring elements of ``acc`` (uint16, mod 2^bits) as int16 in [-2^(bits-1), 2^(bits-1)),
    in place (the result is a view of ``acc``), and the largest magnitude among them."""
    _check(bits)
    signed = acc.view(np.int16)
    if _kernels is not None and acc.size:
        return signed, _kernels.ring_signed(acc, bits)
    shift = 16 - bits
    np.left_shift(acc, shift, out=acc)
    np.right_shift(signed, shift, out=signed)
    return signed, (max(int(signed.max()), -int(signed.min())) if acc.size else 0)
