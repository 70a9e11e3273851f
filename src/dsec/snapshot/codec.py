"""Per-tensor encodings of a snapshot, and the byte-level delta between two snapshots.

A *mode* (``snapshot_compression_level`` 0..3) says how model tensors and optimizer state are stored:

=====  ============  =================  ==========================  ===========================================
level  name          weights            optimizer state             restore
=====  ============  =================  ==========================  ===========================================
0      lossless      raw bytes          raw, in every snapshot      bit-exact
1      q8            8-bit blocks       8-bit, in every snapshot    weights within absmax/254 of each block
2      q8-lite       8-bit blocks       4-bit, in base snapshots    as 1; optimizer state as of the chain's base
3      q4-lite       4-bit blocks       4-bit, in base snapshots    weights within absmax/14 of each block
=====  ============  =================  ==========================  ===========================================

Level 2 is the default. Tensors that are not floating point, or are small (< ``QUANTIZE_MIN`` elements: biases,
step counters, RNG states), are always stored raw, so counters and seeds restore exactly in every mode.
Non-negative optimizer tensors (Adam's ``exp_avg_sq``) are quantized as their square root, and a zero code
restores to half a quantization step rather than 0: the true value lies in [0, step/2), and dividing a momentum by
``sqrt(0) + eps`` after a restore would turn a rounding error into a huge update; the upper bound only shortens it.

The *encoded bytes* of a tensor are what is delta-encoded: raw bytes use XOR (nearby floats share sign and
exponent bytes, which XOR to zero), quantized bytes use subtraction mod 256 (a code that moved by one step gives a
small number). Both are exact and invertible, so a delta chain reproduces the encoded bytes bit for bit and
quantization error does not accumulate along a chain: every snapshot is quantized from the live tensor.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dsec import quant

if TYPE_CHECKING:
    import torch

QUANTIZE_MIN = 4096
DEFAULT_LEVEL = 2
ENCODINGS = ("raw", "q8", "q4")
# The tensor dtypes a manifest may name. A manifest is data from a file: its dtype is looked up in torch only when it
# is one of these names (``getattr(torch, name)`` on anything else would hand back ``torch.load`` and the like).
DTYPES = frozenset(
    {
        "float64", "float32", "float16", "bfloat16", "complex64", "complex128",
        "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    }
)  # fmt: skip


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; ValueError for a name outside ``DTYPES`` or one this torch lacks."""
    import torch

    dtype = getattr(torch, name, None) if name in DTYPES else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {name!r} is not a tensor dtype this torch knows")
    return dtype


@dataclass(frozen=True)
class Mode:
    level: int
    name: str
    weight_bits: int  # 32 = raw
    optimizer: str  # keep | quantize | drop
    optimizer_bits: int
    optimizer_in_deltas: bool  # False: optimizer state is refreshed only in base snapshots

    @property
    def lossless(self) -> bool:
        return self.weight_bits == 32 and self.optimizer == "keep"

    def as_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "name": self.name,
            "weight_bits": self.weight_bits,
            "optimizer": self.optimizer,
            "optimizer_bits": self.optimizer_bits,
            "optimizer_in_deltas": self.optimizer_in_deltas,
        }


MODES = {
    0: Mode(0, "lossless", 32, "keep", 32, True),
    1: Mode(1, "q8", 8, "quantize", 8, True),
    2: Mode(2, "q8-lite", 8, "quantize", 4, False),
    3: Mode(3, "q4-lite", 4, "quantize", 4, False),
}
OPTIMIZER_POLICIES = ("keep", "quantize", "drop")


def mode_for(level: int, optimizer: str | None = None) -> Mode:
    """The mode of ``level``, with the optimizer policy optionally overridden (keep / quantize / drop)."""
    if level not in MODES:
        raise ValueError(f"snapshot_compression_level={level!r} is invalid: expected one of {sorted(MODES)}")
    mode = MODES[level]
    if optimizer is None or optimizer == mode.optimizer:
        return mode
    if optimizer not in OPTIMIZER_POLICIES:
        raise ValueError(f"optimizer policy {optimizer!r} is invalid: expected one of {OPTIMIZER_POLICIES}")
    bits = 32 if optimizer == "keep" else mode.optimizer_bits if mode.optimizer_bits < 32 else 8
    in_deltas = mode.optimizer_in_deltas or optimizer == "keep"
    return Mode(level, f"{mode.name}+optim-{optimizer}", mode.weight_bits, optimizer, bits, in_deltas)


@dataclass
class Staged:
    """A tensor captured for a snapshot: either a raw CPU copy or its quantized form (already small)."""

    dtype: str
    shape: tuple[int, ...]
    enc: str  # raw | q8 | q4
    sqrt: bool = False
    raw: torch.Tensor | None = None
    q: quant.Quantized | None = None

    def encoded(self) -> np.ndarray:
        """The tensor's encoded bytes (uint8), the unit of checksums and deltas."""
        if self.raw is not None:
            return _tensor_bytes(self.raw)
        assert self.q is not None
        return quant.to_bytes(self.q).numpy()


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    import torch

    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of ``t``: the only work done while the step gate holds the training thread."""
    return t.detach().to("cpu", copy=True)


def stage(t: torch.Tensor, bits: int, *, nonneg_sqrt: bool = False) -> Staged:
    """Capture ``t`` now: quantized when ``bits`` < 32 and the tensor is a large float tensor, else copied raw.

    Runs on the snapshot thread while the tensor is not being modified (between optimizer steps)."""
    dtype = str(t.dtype).removeprefix("torch.")
    shape = tuple(t.shape)
    if bits >= 32 or not t.is_floating_point() or t.numel() < QUANTIZE_MIN:
        return Staged(dtype, shape, "raw", raw=t.detach().to("cpu", copy=True))
    src = t.detach()
    use_sqrt = False
    if nonneg_sqrt and bool((src >= 0).all()):
        src, use_sqrt = src.float().sqrt(), True
    q = quant.quantize(src, bits)
    if q.codes.device.type != "cpu":
        q = quant.Quantized(q.codes.cpu(), q.scales.cpu(), q.numel, q.bits, q.block)
    return Staged(dtype, shape, f"q{bits}", sqrt=use_sqrt, q=q)


def decode(enc_bytes: np.ndarray, spec: dict[str, Any]) -> torch.Tensor:
    """The tensor that encoded bytes ``enc_bytes`` describe (``spec`` = the manifest's tensor entry)."""
    import torch

    dtype = torch_dtype(spec["dtype"])
    shape = tuple(spec["shape"])
    if spec["enc"] == "raw":
        if int(np.prod(shape)) == 0:
            return torch.empty(shape, dtype=dtype)
        # A copy: the caller (an optimizer's load_state_dict) may keep the tensor, and the bytes are reused.
        return torch.from_numpy(np.array(enc_bytes, dtype=np.uint8, copy=True)).view(dtype).reshape(shape)
    arr = np.ascontiguousarray(enc_bytes)
    buf = torch.from_numpy(arr if arr.flags.writeable else arr.copy())
    bits = int(spec["enc"][1:])
    numel = int(np.prod(shape)) if shape else 1
    q = quant.from_bytes(buf, numel, bits, int(spec.get("block") or quant.DEFAULT_BLOCK))
    if not spec.get("sqrt"):
        return quant.dequantize(q, dtype).reshape(shape)
    # Square root was stored; a zero code becomes half a step (see the module docstring).
    codes = q.codes
    if bits == 4:
        codes = torch.stack((codes & 0x0F, codes >> 4), dim=1).view(-1)
    blocks = (codes.to(torch.float32) - quant.QMAX[bits]).view(-1, q.block)
    # A block with any nonzero value has a code at qmax: all-zero codes mean the block was exactly zero.
    floor = torch.where((blocks == 0).all(dim=1), 0.0, q.scales / 2)
    blocks.mul_(q.scales.unsqueeze(1))
    root = torch.where(blocks > 0, blocks, floor.unsqueeze(1))
    return root.square_().view(-1)[:numel].to(dtype).reshape(shape)


def digest(data: bytes | np.ndarray) -> str:
    return hashlib.sha256(data.data if isinstance(data, np.ndarray) else data).hexdigest()


def delta(new: np.ndarray, old: np.ndarray, op: str) -> np.ndarray:
    """Bytes that turn ``old`` into ``new`` with :func:`undelta` (same length)."""
    out: np.ndarray = np.bitwise_xor(new, old) if op == "xor" else np.subtract(new, old, dtype=np.uint8)
    return out


def undelta(d: np.ndarray, old: np.ndarray, op: str) -> np.ndarray:
    out: np.ndarray = np.bitwise_xor(d, old) if op == "xor" else np.add(old, d, dtype=np.uint8)
    return out


def delta_op(enc: str) -> str:
    return "xor" if enc == "raw" else "sub"
