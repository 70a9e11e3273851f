"""Block quantization of float tensors to 8 or 4 bits with one scale per block.

Used for gradient communication (the probe's compression hook) and, later, for quantized snapshots.
Symmetric, per-block absmax scaling: ``q = round(x / scale)``, ``scale = absmax / qmax`` with
qmax 127 (8-bit) or 7 (4-bit). 4-bit codes are stored two per byte. Scales are float32 so that a
block of tiny gradients does not underflow to zero (fp16 would, below ~6e-8).

Bytes per element: 8-bit 1 + 4/block, 4-bit 0.5 + 4/block; with the default block of 256 that is
3.94x / 7.76x smaller than float32. Error per element is at most scale/2 = absmax/(2*qmax) of its block.
Imports torch lazily so that importing ``dsec`` never pulls it in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_BLOCK = 256
QMAX = {8: 127, 4: 7}


@dataclass(frozen=True)
class Quantized:
    """Codes (uint8; two 4-bit codes per byte for bits=4) and one float32 scale per block."""

    codes: torch.Tensor
    scales: torch.Tensor
    numel: int
    bits: int
    block: int

    @property
    def nbytes(self) -> int:
        return int(self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size())


def encoded_size(numel: int, bits: int, block: int = DEFAULT_BLOCK) -> tuple[int, int]:
    """(code bytes, number of scales) for ``numel`` elements."""
    if bits not in QMAX:
        raise ValueError(f"bits={bits} is invalid: expected 8 or 4")
    nblocks = -(-numel // block)
    padded = nblocks * block
    return (padded if bits == 8 else padded // 2), nblocks


def quantize(x: torch.Tensor, bits: int, block: int = DEFAULT_BLOCK) -> Quantized:
    """Quantize a floating tensor (any shape; flattened) to ``bits`` with per-block scales."""
    import torch

    if bits not in QMAX:
        raise ValueError(f"bits={bits} is invalid: expected 8 or 4")
    if block < 2 or block % 2:
        raise ValueError(f"block={block} is invalid: expected an even number >= 2")
    flat = x.detach().reshape(-1).to(torch.float32)
    numel = flat.numel()
    nblocks = -(-numel // block)
    pad = nblocks * block - numel
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    blocks = flat.view(nblocks, block)
    qmax = QMAX[bits]
    absmax = blocks.abs().amax(dim=1)
    scales = torch.where(absmax > 0, absmax / qmax, torch.ones_like(absmax))
    q = torch.round(blocks / scales.unsqueeze(1)).clamp_(-qmax, qmax).to(torch.int16) + qmax
    codes = q.to(torch.uint8).view(-1)
    if bits == 4:
        pairs = codes.view(-1, 2)
        codes = pairs[:, 0] | (pairs[:, 1] << 4)
    return Quantized(codes=codes.contiguous(), scales=scales.contiguous(), numel=numel, bits=bits, block=block)


def dequantize(qt: Quantized, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The flat float tensor (length ``qt.numel``) that ``qt`` encodes."""
    import torch

    codes = qt.codes
    if qt.bits == 4:
        low = codes & 0x0F
        high = codes >> 4
        codes = torch.stack((low, high), dim=1).view(-1)
    q = codes.to(torch.float32) - QMAX[qt.bits]
    out = (q.view(-1, qt.block) * qt.scales.unsqueeze(1)).view(-1)[: qt.numel]
    return out if dtype is None else out.to(dtype)


def to_bytes(qt: Quantized) -> torch.Tensor:
    """One uint8 tensor: scales (float32 bytes) followed by codes — what goes over the wire."""
    import torch

    return torch.cat((qt.scales.view(torch.uint8), qt.codes))


def from_bytes(buf: torch.Tensor, numel: int, bits: int, block: int = DEFAULT_BLOCK) -> Quantized:
    import torch

    code_bytes, nblocks = encoded_size(numel, bits, block)
    if buf.numel() != nblocks * 4 + code_bytes:
        raise ValueError(f"buffer of {buf.numel()} bytes does not encode {numel} elements at {bits} bits")
    scales = buf[: nblocks * 4].clone().view(torch.float32)
    codes = buf[nblocks * 4 :]
    return Quantized(codes=codes, scales=scales, numel=numel, bits=bits, block=block)
