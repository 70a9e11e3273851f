"""The small header every rank adds to the last bucket of a synchronized step, and how it travels.

Each rank writes its own :class:`Header`; after the collective every rank holds every rank's header, so whatever is
decided from the headers is decided identically on every rank, without an extra collective. Fields:

- ``bits`` / ``accum``: the compression level and accumulation this rank asks for (see ddp.py);
- ``stamp``: the wall clock when this rank entered the collective (straggler attribution, see ddp.py);
- ``flags``: :class:`Flag` bits (wants a group snapshot, its snapshotter is busy, a fingerprint is attached, ...);
- ``fingerprint``: 24 bits of the replica fingerprint (probe/replicas.py), valid when ``Flag.FINGERPRINT`` is set;
- ``hyper``: 24 bits of a digest of the optimizer hyper-parameters this rank will apply;
- ``admit``: under healing, the collective (24 low bits of its number) at which this rank proposes to admit a
  waiting replacement (probe/elastic.py), valid with ``Flag.JOIN_KNOWN``.

Two encodings. In the ``all_reduce`` path the header rides in extra elements of the bucket's own dtype: each rank
writes its fields into *its own* slots and zeros elsewhere, so the sum is every rank's fields exactly — as long as
every slot holds an integer the dtype represents exactly (float32: 24 bits, float16: 11 bits); wider fields are
split over several slots. The arrival stamp is milliseconds modulo a period the dtype holds (differences are taken
on that circle). In the byte paths (``all_gather`` / ``all_to_all``) the header is a fixed 32-byte struct in front
of each rank's chunk.
"""

from __future__ import annotations

import array
import enum
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HEADER_BYTES = 32
# The DDP comm hook's all_reduce path carries the header every Nth synchronized step (DSEC_HEADER_EVERY; ddp.py says
# what N > 1 costs). Default 1: every step, which with the comm hook's header fast path costs 0.41-0.43% of a
# learner-sized step (cnn benchmark; N = 8 was 0.35% before the fast path, and with it the demo's breaker scene
# blamed the straggler's healthy peer in 2 of 14 runs, docs/benchmarks.md), so N > 1 stays opt-in.
DEFAULT_EVERY = 1
_STRUCT = struct.Struct("<iidIIII")  # bits, accum, stamp (s), flags, fingerprint, hyper, admit
# Bits an element of the slot dtype holds exactly, and the stamp period (ms) it holds.
SLOT_BITS = {32: 24, 16: 11}
STAMP_PERIOD_MS = {32: float(2**20), 16: 2048.0}
# Field widths in bits (the stamp is one slot of its own).
_WIDTHS = (("bits", 6), ("accum", 16), ("flags", 8), ("fingerprint", 24), ("hyper", 24), ("admit", 24))
MAX_ACCUM = 2**16 - 1
MASK24 = 2**24 - 1


class Flag(enum.IntFlag):
    SNAPSHOT_WANTED = 1  # this rank's snapshot period is due or a snapshot was requested
    SNAPSHOT_BUSY = 2  # this rank's previous snapshot is still being written
    FINGERPRINT = 4  # ``fingerprint`` holds this rank's replica fingerprint
    JOIN_KNOWN = 8  # this rank knows of a replacement waiting to join (``admit`` holds its proposed point)
    PRESENT = 16  # a header was written here (under healing, a dead rank's slots stay zero)
    CONTRIBUTES = 32  # this rank's gradient counts in the average (not a replacement in its first period)


@dataclass(frozen=True)
class Header:
    bits: int
    accum: int
    stamp: float = 0.0  # seconds (wall clock); in the all_reduce path milliseconds on the circle
    flags: int = 0
    fingerprint: int = 0
    hyper: int = 0
    admit: int = 0

    def has(self, flag: Flag) -> bool:
        return bool(self.flags & flag)


def _pieces(width: int, cap: int) -> int:
    return -(-width // cap)


def _count_slots(bits: int) -> int:
    cap = SLOT_BITS[bits]
    return 1 + sum(_pieces(w, cap) for _, w in _WIDTHS)


# Slots per rank by slot dtype, counted once: the comm hook reads it at every step (counting cost ~20 µs there).
SLOTS_PER_RANK = {bits: _count_slots(bits) for bits in SLOT_BITS}


def slots_per_rank(bits: int) -> int:
    return SLOTS_PER_RANK[bits]


# Per slot dtype: (field width, the shifts of its pieces), in slot order after the stamp. Computed once: the header
# is encoded and decoded on the training path (ddp.py), where a Python loop re-deriving this cost tens of µs.
_LAYOUT = {
    bits: tuple((width, tuple(cap * i for i in range(_pieces(width, cap)))) for _, width in _WIDTHS)
    for bits, cap in SLOT_BITS.items()
}


def encode_slots(
    h: Header, rank: int, world: int, bits: int, dtype: torch.dtype, stamp_ms: float, device: Any = None
) -> torch.Tensor:
    """The header as ``world * slots_per_rank`` elements of ``dtype`` (on ``device``: the bucket's): this rank's
    fields in its slots, zeros elsewhere (summed over ranks by the all_reduce)."""
    values = slot_values(h, rank, world, bits)
    return slots_tensor(values, rank, bits, stamp_ms, dtype, device)


def slots_tensor(
    values: list[float], rank: int, bits: int, stamp_ms: float, dtype: torch.dtype, device: Any = None
) -> torch.Tensor:
    """The slots of :func:`slot_values` with this rank's arrival stamp, as a tensor (``values`` is not changed)."""
    import torch

    values = values.copy()
    values[SLOTS_PER_RANK[bits] * rank] = stamp_ms % STAMP_PERIOD_MS[bits]
    # One tensor from a typed buffer (torch.zeros + torch.tensor + a slice assignment cost several times more).
    # (frombuffer keeps the array alive as long as the tensor; float32 holds every slot value exactly, and so does
    # float16 those of the 16-bit layout.)
    return torch.frombuffer(array.array("f", values), dtype=torch.float32).to(dtype=dtype, device=device)


def slot_values(h: Header, rank: int, world: int, bits: int) -> list[float]:
    """Every slot's value for this rank's header, its stamp slot left 0: what the comm hook can keep while the
    fields do not change (they change at a level change, a fingerprint, a snapshot vote; the stamp every step)."""
    mask = (1 << SLOT_BITS[bits]) - 1
    n = SLOTS_PER_RANK[bits]
    values = [0.0] * (n * world)
    pos = n * rank
    fields = (h.bits, h.accum, h.flags, h.fingerprint, h.hyper, h.admit)  # the order of _WIDTHS
    for (name, _), v, (width, shifts) in zip(_WIDTHS, fields, _LAYOUT[bits], strict=True):
        v = int(v)
        if v < 0 or v >= 1 << width:
            raise ValueError(f"header field {name}={v} does not fit in {width} bits")
        for shift in shifts:
            pos += 1
            values[pos] = float((v >> shift) & mask)
    return values


def decode_slots(slots: torch.Tensor, world: int, bits: int) -> list[Header]:
    """Every rank's header from the summed slots (stamps in ms, on the circle of ``STAMP_PERIOD_MS[bits]``)."""
    n = SLOTS_PER_RANK[bits]
    flat = slots.tolist()  # float32 / float16 values are exact integers here (they hold no more bits)
    layout = _LAYOUT[bits]
    out = []
    for r in range(world):
        pos = r * n
        stamp = flat[pos]
        fields = []
        for _, shifts in layout:
            v = 0
            for shift in shifts:
                pos += 1
                v |= round(flat[pos]) << shift
            fields.append(v)
        out.append(Header(fields[0], fields[1], stamp, fields[2], fields[3], fields[4], fields[5]))
    return out


def encode_bytes(h: Header, device: Any = None) -> torch.Tensor:
    import torch

    raw = _STRUCT.pack(h.bits, h.accum, h.stamp, h.flags, h.fingerprint, h.hyper, h.admit)
    out = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out if device is None else out.to(device)


def decode_bytes(chunk: torch.Tensor) -> Header:
    raw = chunk[:HEADER_BYTES].cpu().numpy().tobytes()
    bits, accum, stamp, flags, fingerprint, hyper, admit = _STRUCT.unpack(raw)
    return Header(bits, accum, stamp, flags, fingerprint, hyper, admit)


def circle_deltas(stamps: list[float], mine: float, period_ms: float | None) -> list[float]:
    """Seconds from this rank's stamp to every rank's: plain differences of seconds, or differences of
    milliseconds on a circle of ``period_ms`` (the all_reduce path)."""
    if period_ms is None:
        return [s - mine for s in stamps]
    half = period_ms / 2
    return [(((s - mine + half) % period_ms) - half) / 1000.0 for s in stamps]


def stamp_now_ms(now_s: float) -> float:
    return float(math.floor(now_s * 1000.0))
