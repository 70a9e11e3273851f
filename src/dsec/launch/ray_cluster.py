"""Which Ray cluster the ``ray`` launcher runs on, and what that cluster offers.

- **A local Ray started for the job** (no address given and no ``RAY_ADDRESS``): one node, this machine, started
  by the launcher and shut down with it — the new user's path, nothing to set up. Its workers are not pinned to
  nodes by label (there is one node); logical CPUs are ``local_cpus`` (a worker takes one, so a 2-core machine can
  run a 4-rank job as the ``local`` launcher would); GPUs are what Ray detects.
- **An existing cluster** (``address``: ``auto`` for the one ``ray start`` runs on this machine, ``host:port``,
  ``ray://...``; or ``RAY_ADDRESS``): each node must carry its DSec node name as a label
  (``ray start --labels dsec/node=node-0``) and the workers are pinned where DSec's placement put them.

On a cluster without GPUs (``gpus: auto``), bundles ask for CPU only: DSec's placement still names a device per
worker (the control plane's inventory), so device health and the probe's reports keep their names, and the command
runs with an empty ``CUDA_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any, Literal

GpuMode = Literal["auto", "always", "never"]
NODE_LABEL = "dsec/node"
LOCAL_OBJECT_STORE_BYTES = 256 * 1024 * 1024  # the launcher ships exit codes and small dicts, nothing large


def connect(address: str | None, namespace: str, local_cpus: int) -> bool:
    """Connect to (or start) the cluster; True when this started a local one-node Ray."""
    import ray

    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(
            # "local": always a new instance; without it ray.init joins a cluster `ray start` runs on this machine
            # (found through /tmp/ray), which was not asked for and refuses num_cpus
            address="local",
            namespace=namespace,
            num_cpus=local_cpus,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            labels={NODE_LABEL: socket.gethostname()},
            log_to_driver=False,
        )
        return True
    ray.init(address=address, namespace=namespace, log_to_driver=False)
    return False


def wants_gpu(mode: GpuMode, placed_on_device: bool) -> bool:
    """Whether a worker's bundle asks Ray for a GPU: only a placed worker, and (``auto``) only when the cluster
    has GPUs at all."""
    if not placed_on_device or mode == "never":
        return False
    if mode == "always":
        return True
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0)) > 0  # type: ignore[no-untyped-call]


def rendezvous(env: Mapping[str, str], rank0_ip: str, ips: set[str]) -> tuple[dict[str, str], list[str]]:
    """What a group's commands need to find rank 0 when its actors span several hosts (variables to set, variables
    to unset): ``MASTER_ADDR`` = rank 0's node address in place of the one-machine default (127.0.0.1), and no
    ``GLOO_SOCKET_IFNAME=lo`` (loopback does not reach another host). A group that set MASTER_ADDR itself (job file
    ``env``) keeps what it set."""
    if len(ips) <= 1 or env.get("MASTER_ADDR", "127.0.0.1") not in ("127.0.0.1", "localhost"):
        return {}, []
    return {"MASTER_ADDR": rank0_ip}, ["GLOO_SOCKET_IFNAME"] if env.get("GLOO_SOCKET_IFNAME") == "lo" else []


def known_nodes() -> list[str]:
    """The ``dsec/node`` labels of the live Ray nodes."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    labels = (n.get("Labels") or {} for n in nodes if n.get("Alive"))
    return sorted({str(lab[NODE_LABEL]) for lab in labels if NODE_LABEL in lab})
