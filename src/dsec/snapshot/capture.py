"""What the training thread pays for in ``take()`` (snapshotter.py): the RNG states, user state, small tensors and
every tensor that is *not* a parameter of a registered optimizer are copied at once; the large parameters and
optimizer-state tensors are only referenced (``lazy``), and the snapshot thread reads them before the step gate
opens (writer.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsec.jsonsafe import json_safe as _json_safe
from dsec.snapshot import codec
from dsec.snapshot.jobs import _Item
from dsec.snapshot.rng import rng_state

if TYPE_CHECKING:
    import torch

SYNC_COPY_NUMEL = 65_536  # tensors smaller than this are copied in take(): cheaper than coordinating


def unwrap(module: Any) -> Any:
    """DDP / DataParallel wrap the user's module in ``.module``; snapshot the inner one so names are stable."""
    inner = getattr(module, "module", None)
    return (
        inner if inner is not None and type(module).__name__ in ("DistributedDataParallel", "DataParallel") else module
    )


def capture(
    modules: dict[str, Any],
    optimizers: dict[str, Any],
    states: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]],
    mode: codec.Mode,
    base: bool,
    last_entries: dict[str, dict[str, Any]],
    last_meta: dict[str, Any],
    last_base: int | None,
) -> tuple[list[_Item], dict[str, Any], dict[str, dict[str, Any]]]:
    """The items, metadata and carried optimizer entries of a snapshot taken now. ``base``: a chain's first snapshot
    (optimizer state is written, not carried); ``last_*``: the previous snapshot's entries, metadata and base (what
    a delta carries over)."""
    import torch

    items: list[_Item] = []
    gated = gated_ids(optimizers)
    seen: dict[int, str] = {}

    def add(name: str, t: torch.Tensor, bits: int, sqrt: bool = False) -> None:
        lazy = id(t) in gated and t.numel() >= SYNC_COPY_NUMEL
        items.append(_Item(name, t if lazy else t.detach().clone(), bits, sqrt, lazy))

    for mname, mod in modules.items():
        for pname, p in mod.named_parameters():
            seen[id(p)] = f"{mname}/{pname}"
            add(f"{mname}/{pname}", p, mode.weight_bits)
        for bname, b in mod.named_buffers():
            add(f"{mname}/{bname}", b, 32)
    meta: dict[str, Any] = {"rng": rng_state(), "state": {}, "optimizers": {}}
    carried: dict[str, dict[str, Any]] = {}
    for oname, opt in optimizers.items():
        params = [p for g in opt.param_groups for p in g["params"]]
        refs: list[str] = []
        for i, p in enumerate(params):
            if id(p) not in seen:
                seen[id(p)] = f"{oname}/param/{i}"
                add(seen[id(p)], p, mode.weight_bits)
            refs.append(seen[id(p)])
        sd = opt.state_dict()
        ometa: dict[str, Any] = {"params": refs, "param_groups": _json_safe(sd["param_groups"]), "scalars": {}}
        refresh = mode.optimizer != "drop" and (base or mode.optimizer_in_deltas)
        if refresh:
            for idx, st in sd["state"].items():
                for key, value in st.items():
                    name = f"{oname}/state/{idx}/{key}"
                    if isinstance(value, torch.Tensor):
                        add(name, value, mode.optimizer_bits, sqrt=True)
                    else:
                        ometa["scalars"][name] = _json_safe(value)
        elif mode.optimizer != "drop":
            prefix = f"{oname}/state/"
            carried.update({k: v for k, v in last_entries.items() if k.startswith(prefix)})
            ometa["scalars"] = last_meta.get("optimizers", {}).get(oname, {}).get("scalars", {})
            ometa["carried_from"] = last_base
        meta["optimizers"][oname] = ometa
    for sname, (get, _set) in states.items():
        meta["state"][sname] = get()
    items.extend(_rng_items(meta["rng"]))
    return items, meta, carried


def _rng_items(rng: dict[str, Any]) -> list[_Item]:
    """The RNG states that are tensors (torch, CUDA), taken out of ``rng`` into items of their own."""
    items: list[_Item] = []
    if "torch" in rng:
        items.append(_Item("rng/torch", rng.pop("torch"), 32, False, False))
    for i, cuda_state in enumerate(rng.pop("cuda", [])):
        items.append(_Item(f"rng/cuda/{i}", cuda_state, 32, False, False))
    return items


def gated_ids(optimizers: dict[str, Any]) -> set[int]:
    """Ids of the tensors the step gate holds: parameters and state of registered optimizers change only inside
    step(), which the gate holds back."""
    import torch

    gated: set[int] = set()
    for opt in optimizers.values():
        gated.update(id(p) for g in opt.param_groups for p in g["params"])
        gated.update(id(v) for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor))
    return gated
