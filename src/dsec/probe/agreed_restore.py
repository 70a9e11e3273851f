"""The rank-agreed restore of a DDP group: every rank restores the same step, or none restores anything.

All ranks call :func:`agree` at the same point of the script (the DDP wrapper's construction), before any training
step. The ranks exchange the steps their snapshots hold and try them newest first:

1. each rank that holds the step loads its snapshot of it (verified byte for byte; a damaged one is skipped);
2. the ranks exchange whether they have it. Nobody: the next step. Everyone: each restores its own.
3. Some ranks only: the lowest rank that has it (the source) sends it to the others (snapshot/transfer.py); each
   receiver verifies it before use and keeps its own random-number streams. A receiver whose copy does not verify
   says so, and the next rank that has the step sends it; no rank left: the next step.
4. Nothing is applied before every rank holds a verified copy of the chosen step (one more exchange), so a group
   never resumes at different steps, whatever each rank's own newest snapshot is.

Why the newest step *anywhere* and not only steps every rank holds: when healing in place fails late, the survivors
have trained (and snapshotted) for a while after the dead rank's last snapshot, and per-rank retention may have
dropped every step the dead rank also holds. Restoring only common steps then restores nothing — or throws away the
survivors' progress. Shipping the newest verified state costs one transfer of the snapshot at restart.

No step verifies anywhere (or there is no snapshot): nothing is restored on any rank and a ``restore`` event with
status ``none`` says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.snapshot.manifest import CorruptSnapshot

if TYPE_CHECKING:
    import numpy as np

    from dsec.snapshot import Snapshotter
    from dsec.snapshot.reader import Loaded

log = logging.getLogger(__name__)

MAX_AGREE_TRIES = 8  # steps tried (newest first) before a group gives up restoring


@dataclass
class Agreement:
    """What the group agreed on, for this rank: the snapshot to apply (None: restore nothing) and why."""

    loaded: Loaded | None
    note: dict[str, Any] = field(default_factory=dict)
    skipped: list[tuple[int, str]] = field(default_factory=list)
    message: str = ""


def agree(
    snap: Snapshotter, pg: Any, at_most: int | None, on_skipped: Callable[[int, str], None], where: str
) -> Agreement:
    """Run the agreement on process group ``pg`` (every rank calls it); ``at_most`` limits snapshot numbers as
    ``DSEC_RESTORE=N`` does; ``on_skipped(seq, reason)`` reports a damaged snapshot of this rank; ``where`` names
    the snapshot directory in messages."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    mine = [(seq, step) for seq, step in snap.manifest_steps() if at_most is None or seq <= at_most]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, sorted({step for _, step in mine}, reverse=True), group=pg)
    candidates = sorted(set().union(*(set(steps) for steps in everyone)), reverse=True)
    out = Agreement(None, {"group_ranks": world, "rank": rank})
    refused: dict[int, str] = {}
    for step in candidates[:MAX_AGREE_TRIES]:
        loaded = _load_step(snap, mine, step, out, on_skipped)
        oks: list[Any] = [None] * world
        dist.all_gather_object(oks, loaded is not None, group=pg)
        if not any(oks):
            refused[step] = "damaged on every rank that holds it"
            continue
        got, source, shipped = _share(pg, rank, loaded, oks, step)
        if got is not None:
            out.loaded = got
            out.note["agreed_step"] = step
            if source is not None:
                out.note.update(source_rank=source, shipped_bytes=shipped)
            return out
        refused[step] = "no verified copy reached every rank"
    if not any(everyone):
        out.message = f"no snapshot in {where} for any rank of the group"
    else:
        newest = {str(r): steps[:5] for r, steps in enumerate(everyone)}
        tried = "; ".join(f"step {s}: {why}" for s, why in refused.items())
        out.message = f"no step verifies for the whole group ({tried}; newest steps per rank: {newest})"
    return out


def _load_step(
    snap: Snapshotter, mine: list[tuple[int, int]], step: int, out: Agreement, on_skipped: Callable[[int, str], None]
) -> Loaded | None:
    for seq in (seq for seq, st in mine if st == step):
        try:
            return snap.load(seq)
        except CorruptSnapshot as exc:
            out.skipped.append((seq, str(exc)))
            on_skipped(seq, str(exc))
    return None


def _share(
    pg: Any, rank: int, loaded: Loaded | None, oks: list[Any], step: int
) -> tuple[Loaded | None, int | None, int]:
    """Bring ``step`` to the ranks that lack it, from each holder in turn until every rank has a verified copy.
    Returns (this rank's copy, the source rank when one sent, bytes sent) — (None, ..) when it did not reach every
    rank, on every rank alike."""
    import torch.distributed as dist

    from dsec.snapshot.transfer import unpack, without_rng

    if all(oks):  # every rank verified its own copy (the exchange that said so was the last one needed)
        return loaded, None, 0
    mine = loaded  # None on the ranks that lack the step, until a copy that verifies arrives
    for source in (r for r, ok in enumerate(oks) if ok):
        received = _broadcast(loaded if rank == source else None, pg, source)
        if mine is None:
            try:
                mine = without_rng(unpack(*received, where=f"snapshot of step {step} received from rank {source}"))
            except CorruptSnapshot as exc:
                log.error("dsec: %s", exc)
        ready: list[Any] = [None] * len(oks)
        dist.all_gather_object(ready, mine is not None, group=pg)
        if all(ready):
            return mine, source, len(received[0]) + int(received[1].size)
    return None, None, 0


def _broadcast(loaded: Loaded | None, pg: Any, source: int) -> tuple[bytes, np.ndarray]:
    """The source's snapshot, packed, on every rank of ``pg`` (the source passes it, the others None).

    A broadcast rather than point-to-point sends: with healing on, the script's default group is a placeholder whose
    collectives the probe carries over the current epoch's group (probe/healing.py), and broadcast is one of them;
    send/recv are not. The ranks that already hold the step receive a copy they do not use — once, at restart."""
    import torch
    import torch.distributed as dist

    from dsec.snapshot.transfer import pack

    src = _global_rank(pg, source)
    if loaded is not None:
        sealed, flat = pack(loaded)
        head = torch.frombuffer(bytearray(sealed), dtype=torch.uint8)
        body = torch.from_numpy(flat)
        sizes = torch.tensor([head.numel(), body.numel()], dtype=torch.int64)
    else:
        sizes = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(sizes, src=src, group=pg)
    hlen, nbytes = (int(v) for v in sizes.tolist())
    if loaded is None:
        head = torch.empty(hlen, dtype=torch.uint8)
        body = torch.empty(nbytes, dtype=torch.uint8)
    dist.broadcast(head, src=src, group=pg)
    if nbytes:
        dist.broadcast(body, src=src, group=pg)
    return head.numpy().tobytes(), body.numpy()


def _global_rank(pg: Any, group_rank: int) -> int:
    import torch.distributed as dist

    try:
        return int(dist.get_global_rank(pg, group_rank))
    except (AttributeError, ValueError, RuntimeError):  # the default group (or a placeholder for it): the same rank
        return group_rank
