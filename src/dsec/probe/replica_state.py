"""A replica's live state, shipped from a healthy member to a replacement over the epoch's process group.

What travels: every parameter and buffer of the DDP models, every optimizer's state and hyper-parameters, every
LR scheduler's state, and counters the probe keeps in step on every rank (synchronized steps, optimizer steps, the
agreed compression and accumulation, the period of the group's collectives). What does not: the RNG state — a copy
of a peer's generator would make the replacement draw the same actions and minibatches as that peer (duplicated
data); the replacement keeps its own stream. Nor anything in the script's own variables.

Wire format: one JSON header (names, dtypes, shapes, byte offsets, a 64-bit fingerprint of all tensors) and one
flat byte buffer, each preceded by its length; point-to-point ``send``/``recv`` from the source to each receiver.
The receiver checks the fingerprint before anything is used: a damaged transfer raises :class:`TransferError`
and nothing is applied. It is applied at the receiver's next optimizer step, not on arrival: the transfer happens
during its first gradient sync, inside ``backward()``, where autograd still needs the old weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.errors import HealingError
from dsec.jsonsafe import json_safe as _json_safe
from dsec.probe.replicas import fingerprint

if TYPE_CHECKING:
    import torch

TAG_STATE = 7_001


class TransferError(HealingError):
    """The received state does not match what the source sent (or could not be received)."""


@dataclass
class ReplicaState:
    meta: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


def capture(modules: list[Any], optimizers: list[Any], schedulers: list[Any], counters: dict[str, Any]) -> ReplicaState:
    """The state of this replica (references, not copies: call it while the training thread is held)."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for i, m in enumerate(modules):
        for name, t in (*m.named_parameters(), *m.named_buffers()):
            tensors[f"model{i}/{name}"] = t.detach()
    optim_meta = []
    for i, opt in enumerate(optimizers):
        sd = opt.state_dict()
        scalars: dict[str, Any] = {}
        for idx, st in sd["state"].items():
            for key, value in st.items():
                name = f"optim{i}/{idx}/{key}"
                if isinstance(value, torch.Tensor):
                    tensors[name] = value.detach()
                else:
                    scalars[name] = _json_safe(value)
        groups = [{k: _json_safe(v) for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        optim_meta.append({"groups": groups, "scalars": scalars})
    sched_meta = [_json_safe(s.state_dict()) for s in schedulers]
    return ReplicaState({"optimizers": optim_meta, "schedulers": sched_meta, "counters": counters}, tensors)


def _flatten(state: ReplicaState) -> tuple[dict[str, Any], torch.Tensor]:
    import torch

    index, parts, hosted, offset = [], [], [], 0
    for name, t in state.tensors.items():
        host = t.detach().to("cpu")
        raw = host.contiguous().reshape(-1).view(torch.uint8)
        index.append({"name": name, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "at": offset})
        parts.append(raw)
        hosted.append(host)
        offset += raw.numel()
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    # The receiver fingerprints host tensors: so does the sender (a device's tensors would digest differently).
    header = {**state.meta, "index": index, "nbytes": offset, "fingerprint": fingerprint(hosted)}
    return header, flat


def send(state: ReplicaState, pg: Any, dst: list[int]) -> int:
    """Send ``state`` to each process-group rank in ``dst``; returns the bytes sent to each."""
    import torch

    header, flat = _flatten(state)
    raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
    sizes = torch.tensor([raw.numel(), flat.numel()], dtype=torch.int64)
    for d in dst:
        for t in (sizes, raw, flat):
            pg.send([t], d, TAG_STATE).wait()
    return int(raw.numel() + flat.numel())


_DTYPES = {
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
    "complex128",
}


def recv(pg: Any, src: int) -> ReplicaState:
    """Receive a state sent by :func:`send` from process-group rank ``src`` and check its fingerprint."""
    import torch

    sizes = torch.empty(2, dtype=torch.int64)
    pg.recv([sizes], src, TAG_STATE).wait()
    hlen, nbytes = (int(v) for v in sizes.tolist())
    raw = torch.empty(hlen, dtype=torch.uint8)
    pg.recv([raw], src, TAG_STATE).wait()
    flat = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes:
        pg.recv([flat], src, TAG_STATE).wait()
    try:
        header = json.loads(raw.numpy().tobytes())
    except ValueError as exc:
        raise TransferError(f"state header does not parse: {exc}") from None
    tensors: dict[str, torch.Tensor] = {}
    for entry in header["index"]:
        if entry["dtype"] not in _DTYPES:
            raise TransferError(f"tensor {entry['name']}: dtype {entry['dtype']!r} is not accepted")
        dtype = getattr(torch, entry["dtype"])
        n = 1
        for d in entry["shape"]:
            n *= int(d)
        size = n * torch.empty(0, dtype=dtype).element_size()
        chunk = flat[entry["at"] : entry["at"] + size]
        if chunk.numel() != size:
            raise TransferError(f"tensor {entry['name']}: {chunk.numel()} bytes received, {size} expected")
        tensors[entry["name"]] = chunk.view(dtype).reshape(entry["shape"])
    got = fingerprint(tensors.values())
    if got != header["fingerprint"]:
        raise TransferError(f"fingerprint {got:016x} of the received state != {header['fingerprint']:016x} sent")
    meta = {k: v for k, v in header.items() if k not in ("index", "nbytes", "fingerprint")}
    return ReplicaState(meta, tensors)


def apply(state: ReplicaState, modules: list[Any], optimizers: list[Any], schedulers: list[Any]) -> None:
    """Load a received state into this replica's models, optimizers and schedulers (same script: same layout)."""
    import torch

    with torch.no_grad():
        for i, m in enumerate(modules):
            for name, t in (*m.named_parameters(), *m.named_buffers()):
                src = state.tensors.get(f"model{i}/{name}")
                if src is None or tuple(src.shape) != tuple(t.shape):
                    raise TransferError(f"model{i}/{name}: missing or of another shape in the received state")
                t.copy_(src)
    for i, opt in enumerate(optimizers):
        ometa = state.meta["optimizers"][i]
        prefix = f"optim{i}/"
        per_param: dict[int, dict[str, Any]] = {}
        for name, value in [*state.tensors.items(), *ometa["scalars"].items()]:
            if name.startswith(prefix):
                idx, key = name[len(prefix) :].split("/", 1)
                per_param.setdefault(int(idx), {})[key] = value.clone() if hasattr(value, "clone") else value
        groups = opt.state_dict()["param_groups"]
        for group, saved in zip(groups, ometa["groups"], strict=True):
            group.update({k: v for k, v in saved.items() if v is not None and k in group})
        opt.load_state_dict({"state": per_param, "param_groups": groups})
    for sched, saved in zip(schedulers, state.meta["schedulers"], strict=False):
        if isinstance(saved, dict):
            current = sched.state_dict()
            current.update({k: v for k, v in saved.items() if v is not None and k in current})
            sched.load_state_dict(current)
