"""``dsec snapshots ls | show | verify | restore | compact``: inspect and use a snapshot store offline."""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.text import Text

from dsec.cli_common import Wide, fail, stdout_console, widen
from dsec.cli_progress import OnProgress, ShowProgress, bars

snapshots_app = typer.Typer(help="Inspect, verify and restore state snapshots.", no_args_is_help=True)
out = Console()

SnapshotDir = Annotated[
    Path, typer.Option("--dir", envvar="DSEC_SNAPSHOT_DIR", help="Snapshot store directory.", show_default=True)
]
DEFAULT_DIR = Path(".dsec/snapshots")
MIB = float(1 << 20)


def _store(root: Path) -> Any:
    from dsec.snapshot import LocalDirStore

    if not (root / "manifests").is_dir():
        raise fail(f"{root}: not a snapshot store (no manifests/ directory)", 2)
    return LocalDirStore(root)


def _split(ident: str, store: Any) -> tuple[str, int | None]:
    """``worker/seq`` or ``worker`` (its newest snapshot)."""
    worker, _, seq = ident.partition("/")
    if worker not in store.workers():
        raise fail(f"no snapshots for worker {worker!r} (workers: {', '.join(store.workers()) or 'none'})", 2)
    if seq and not seq.isdigit():
        raise fail(f"snapshot id {ident!r} is invalid: expected WORKER or WORKER/NUMBER", 2)
    return worker, int(seq) if seq else None


def _newest_or(ident: str, store: Any) -> tuple[str, int]:
    """``WORKER/N``, or ``WORKER`` meaning its newest snapshot."""
    worker, seq = _split(ident, store)
    return worker, seq if seq is not None else store.manifests(worker)[-1]


@snapshots_app.command("ls")
def ls(
    worker: Annotated[str | None, typer.Argument(help="Only this worker.")] = None,
    root: SnapshotDir = DEFAULT_DIR,
    wide: Wide = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="JSON lines (one object per snapshot) instead of a table.")
    ] = False,
) -> None:
    """List snapshots, oldest first (--wide: base, full size and total time too)."""
    from dsec.render import snapshots_table
    from dsec.snapshot import listing

    store = _store(root)
    workers = [worker] if worker else store.workers()
    try:
        rows = [row for w in workers for row in listing(store, w)]
    except ValueError as exc:  # a worker name that cannot be in a store
        raise fail(exc, 2) from None
    if as_json:
        for row in rows:
            out.print(json.dumps(row), markup=False, highlight=False, soft_wrap=True)
        return
    console = stdout_console()
    table = snapshots_table(rows, wide=wide, width=console.width)
    if wide:
        widen(console, table)
    console.print(table)
    for r in rows:
        if "error" in r:
            console.print(Text(r["error"], style="red"))


@snapshots_app.command("show")
def show(
    ident: Annotated[str, typer.Argument(help="WORKER/NUMBER or WORKER (newest).")], root: SnapshotDir = DEFAULT_DIR
) -> None:
    """Print a snapshot's manifest (tensors summarized)."""
    from dsec.snapshot import CorruptSnapshot
    from dsec.snapshot.reader import read_manifest

    store = _store(root)
    worker, seq = _newest_or(ident, store)
    try:
        m = read_manifest(store, worker, seq)
    except CorruptSnapshot as exc:
        raise fail(str(exc)) from None
    tensors = m.pop("tensors")
    m["tensors"] = {
        name: f"{e['enc']} {e['dtype']}{e['shape']} "
        + ("from parent" if e.get("from_parent") else f"{'delta' if e.get('delta') else 'full'} {e.get('stored', 0)} B")
        for name, e in tensors.items()
    }
    m["meta"] = {"optimizers": sorted(m["meta"].get("optimizers", {})), "state": sorted(m["meta"].get("state", {}))}
    out.print_json(json.dumps(m))


@snapshots_app.command("verify")
def verify_cmd(
    worker: Annotated[str | None, typer.Argument(help="Only this worker.")] = None,
    root: SnapshotDir = DEFAULT_DIR,
    show_progress: ShowProgress = None,
) -> None:
    """Rebuild and checksum every snapshot; exit 1 if any is damaged."""
    from dsec.snapshot import CorruptSnapshot, load

    store = _store(root)
    targets = [(w, seq) for w in ([worker] if worker else store.workers()) for seq in store.manifests(w)]
    bad = 0
    with bars(show_progress) as b:
        task = b.task("verifying", total=len(targets), unit="snapshots")
        # One snapshot at a time, as dsec.snapshot.verify does, so that the bar counts snapshots verified.
        for done, (w, seq) in enumerate(targets, 1):
            try:
                load(store, w, seq)
                b.out(f"ok      {w}/{seq}")
            except CorruptSnapshot as exc:
                bad += 1
                b.out(f"[red]damaged[/red] {w}/{seq}: {exc}", highlight=False)
            task.update(done)
    if bad:
        raise typer.Exit(1)


def _decode(loaded: Any, on_progress: OnProgress) -> dict[str, Any]:
    """Every tensor of ``loaded`` decoded in parallel (as ``Loaded.decode_all``); ``on_progress(MiB decoded, MiB)``
    counts the encoded bytes of the tensors done, in order."""
    names = list(loaded.manifest["tensors"])
    sizes = [int(loaded.encoded[n].nbytes) for n in names]
    total, done = sum(sizes) / MIB, 0
    tensors: dict[str, Any] = {}
    on_progress(0, total)
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1)), thread_name_prefix="dsec-restore") as pool:
        for name, size, tensor in zip(names, sizes, pool.map(loaded.tensor, names), strict=True):
            tensors[name] = tensor
            done += size
            on_progress(done / MIB, total)
    return tensors


@snapshots_app.command("restore")
def restore(
    ident: Annotated[str, typer.Argument(help="WORKER/NUMBER, or WORKER for its newest usable snapshot.")],
    output: Annotated[Path, typer.Option("--out", "-o", help="Write a torch.save file here.")],
    root: SnapshotDir = DEFAULT_DIR,
    show_progress: ShowProgress = None,
) -> None:
    """Rebuild a snapshot into a plain ``torch.save`` file: {"tensors": {name: tensor}, "meta": ..., "manifest": ...}.
    Without a number, falls back past damaged snapshots to the newest one that verifies."""
    import torch

    from dsec.snapshot import CorruptSnapshot, load
    from dsec.snapshot.reader import Fallback, load_latest

    store = _store(root)
    worker, seq = _split(ident, store)
    fallback = Fallback()
    with bars(show_progress) as b:
        # Reading and checking the chain reports no progress of its own: a spinner, then a bar over the decoding.
        reading = b.task(f"reading {worker}/{seq if seq is not None else 'newest'}")
        try:
            loaded = load(store, worker, seq) if seq is not None else load_latest(store, worker, fallback=fallback)
        except CorruptSnapshot as exc:
            loaded, failed = None, str(exc)
        else:
            failed = f"no usable snapshot for {worker}"
        reading.update(1, 1)
        for s, reason in fallback.skipped:
            b.note(f"skipped {worker}/{s}: {reason}")
        if loaded is not None:
            tensors = _decode(loaded, b.task(f"decoding {worker}/{loaded.seq}", unit="MiB").update)
            writing = b.task(f"writing {output.name}")
            manifest = {k: v for k, v in loaded.manifest.items() if k != "meta"}
            torch.save({"tensors": tensors, "meta": loaded.manifest["meta"], "manifest": manifest}, output)
            writing.update(1, 1)
    if loaded is None:
        raise fail(failed)
    lossy = "" if loaded.manifest["mode"].get("lossless") else " (lossy mode: weights are dequantized)"
    out.print(f"restored {worker}/{loaded.seq} ({len(tensors)} tensors) in {loaded.read_s:.3f} s -> {output}{lossy}")


@snapshots_app.command("compact")
def compact_cmd(
    ident: Annotated[str, typer.Argument(help="WORKER/NUMBER or WORKER (newest).")],
    root: SnapshotDir = DEFAULT_DIR,
    show_progress: ShowProgress = None,
) -> None:
    """Rewrite a snapshot as a self-contained base so that restoring it reads no chain."""
    from dsec.snapshot import CorruptSnapshot, compact

    store = _store(root)
    worker, seq = _newest_or(ident, store)
    with bars(show_progress) as b:
        # A spinner while the chain is read and verified, then tensors written out of the snapshot's tensors.
        task = b.task(f"compacting {worker}/{seq}", unit="tensors")
        new: int | None
        try:
            new = compact(store, worker, seq, on_progress=task.update)
        except CorruptSnapshot as exc:
            new, failed = None, str(exc)
    if new is None:
        raise fail(failed)
    out.print(f"compacted {worker}/{seq} -> {worker}/{new}")
