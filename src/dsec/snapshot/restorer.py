"""The restore side of the snapshotter: write a loaded snapshot into the registered modules, optimizers, user state
and RNGs (:func:`apply`), or into an optimizer registered after the restore (:func:`catch_up`); list the steps the
manifests record. The :class:`~dsec.snapshot.snapshotter.Snapshotter` methods of the same names delegate here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from dsec.snapshot.manifest import CorruptSnapshot
from dsec.snapshot.reader import Loaded, read_manifest
from dsec.snapshot.rng import set_rng_state
from dsec.snapshot.store import SnapshotStore

if TYPE_CHECKING:
    import torch

States = dict[str, tuple[Callable[[], Any], Callable[[Any], None]]]


def manifest_steps(store: SnapshotStore, worker: str) -> list[tuple[int, int]]:
    """(seq, step) of ``worker``'s snapshots that record a step, newest first. Reads the manifests only:
    whether the snapshot verifies is only known once it is loaded."""
    out: list[tuple[int, int]] = []
    for seq in reversed(store.manifests(worker)):
        try:
            step = read_manifest(store, worker, seq).get("step")
        except CorruptSnapshot:
            continue
        if isinstance(step, int) and not isinstance(step, bool):
            out.append((seq, step))
    return out


def apply(loaded: Loaded, modules: dict[str, Any], optimizers: dict[str, Any], states: States) -> None:
    """Write a loaded snapshot into the registered modules, optimizers, user state and RNGs."""
    import torch

    m = loaded.manifest
    tensors = loaded.decode_all()
    by_name: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for mname, mod in modules.items():
            for pname, t in (*mod.named_parameters(), *mod.named_buffers()):
                name = f"{mname}/{pname}"
                if name not in tensors:
                    raise CorruptSnapshot(f"snapshot has no tensor {name}: was it taken from another model?")
                value = tensors[name]
                if tuple(value.shape) != tuple(t.shape):
                    raise CorruptSnapshot(f"tensor {name}: shape {list(value.shape)} != model's {list(t.shape)}")
                t.copy_(value)
                by_name[name] = t
        for oname, opt in optimizers.items():
            ometa = m["meta"]["optimizers"].get(oname)
            if ometa is None:
                raise CorruptSnapshot(f"snapshot has no optimizer {oname}")
            params = [p for g in opt.param_groups for p in g["params"]]
            if len(params) != len(ometa["params"]):
                raise CorruptSnapshot(
                    f"optimizer {oname}: {len(params)} parameters, snapshot has {len(ometa['params'])}"
                )
            for p, ref in zip(params, ometa["params"], strict=False):
                if ref not in by_name:
                    p.copy_(tensors[ref].to(p.device))
            load_optimizer(opt, oname, ometa, m, tensors)
    for sname, (_get, set_) in states.items():
        if sname in m["meta"]["state"]:
            set_(m["meta"]["state"][sname])
    rng = dict(m["meta"]["rng"])
    if "rng/torch" in tensors:
        rng["torch"] = tensors["rng/torch"]
    cuda = sorted(n for n in tensors if n.startswith("rng/cuda/"))
    if cuda:
        rng["cuda"] = [tensors[n] for n in cuda]
    set_rng_state(rng)


def catch_up(loaded: Loaded | None, oname: str, opt: Any, modules: dict[str, Any]) -> None:
    """Load the restored snapshot's state into optimizer ``oname``, registered after the restore (a script
    that builds its optimizers one by one); its parameters too, when no registered module holds them."""
    import torch

    if loaded is None:
        return
    m = loaded.manifest
    ometa = m["meta"]["optimizers"].get(oname)
    if ometa is None:
        raise CorruptSnapshot(f"snapshot has no optimizer {oname}")
    held = {f"{mn}/{pn}" for mn, mod in modules.items() for pn, _ in mod.named_parameters()}
    needed = [n for n in m["tensors"] if n.startswith(f"{oname}/state/")] + [
        r for r in ometa["params"] if r not in held
    ]
    tensors = {n: loaded.tensor(n) for n in needed}
    params = [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        for p, ref in zip(params, ometa["params"], strict=False):
            if ref in tensors:
                p.copy_(tensors[ref].to(p.device))
    load_optimizer(opt, oname, ometa, m, tensors)


def load_optimizer(
    opt: Any, oname: str, ometa: dict[str, Any], manifest: dict[str, Any], tensors: dict[str, Any]
) -> None:
    current = opt.state_dict()
    state: dict[int, dict[str, Any]] = {}
    prefix = f"{oname}/state/"
    for name in manifest["tensors"]:
        if name.startswith(prefix):
            idx, key = name[len(prefix) :].split("/", 1)
            state.setdefault(int(idx), {})[key] = tensors[name]
    for name, value in ometa.get("scalars", {}).items():
        idx, key = name[len(prefix) :].split("/", 1)
        state.setdefault(int(idx), {})[key] = value
    groups = current["param_groups"]
    for group, saved in zip(groups, ometa["param_groups"], strict=False):
        for key, value in saved.items():
            if key != "params" and value is not None and isinstance(group.get(key), (int, float, bool)):
                group[key] = value
    opt.load_state_dict({"state": state, "param_groups": groups})


def replay_metadata(storage: Any, size: int, pointer: int) -> dict[str, Any]:
    """Replay-buffer metadata for ``register_state``: size, write pointer and a content hash of the first
    ``size`` entries, instead of the contents (a restored buffer refills; the hash says whether it matches)."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    arr = storage[:size]
    if hasattr(arr, "detach"):
        arr = arr.detach().cpu().numpy()
    h.update(np.ascontiguousarray(arr).tobytes())
    return {"size": int(size), "pointer": int(pointer), "hash": h.hexdigest()}
