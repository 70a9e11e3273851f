"""What a job's workers are started with: the job's placement (on the control plane's inventory, or offline), and
each worker's launch: its environment (rendezvous, identity, snapshots, control plane, healing run), device and
CPUs."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from dsec.client import ApiError
from dsec.job_history import history_path
from dsec.launch.base import WorkerLaunch
from dsec.launch.jobfile import JobFile
from dsec.scheduler.inventory import synthesize
from dsec.scheduler.placement import job_to_dict, place


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def place_job(job: JobFile, client: Any = None, pins: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Place a job file's workers: on the control plane's inventory (``client``: an admin Client), or offline on a
    synthetic one-node inventory with a device per worker; ``pins``: worker -> the device it keeps. RuntimeError
    when some worker cannot be placed."""
    spec = job.spec()
    if pins:
        spec = replace(
            spec,
            groups=tuple(
                replace(g, workers=tuple(replace(w, device=pins.get(w.name)) for w in g.workers)) for g in spec.groups
            ),
        )
    if client is not None:
        try:
            # Re-placing a running job (pins): all or nothing, so a failed try leaves its record and devices alone.
            body = job_to_dict(spec)
            placement: dict[str, Any] = client.place(body, complete_only=True) if pins else client.place(body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            raise RuntimeError(f"job {job.job} cannot be placed: {exc.message}") from exc
    else:
        n = sum(len(g.workers) for g in spec.groups)
        placement = place(spec, synthesize(nodes=1, gpus_per_node=n, numa_per_node=1)).to_dict()
    if not placement["complete"]:
        raise RuntimeError(f"job {job.job} cannot be placed: {placement['unplaced']}")
    return placement


def worker_launches(
    job: JobFile,
    placement: dict[str, Any],
    g: Any,
    *,
    restore: bool,
    ranks: list[int] | None,
    replacement: bool,
    runs: dict[str, str],
    endpoint: str | None,
    pool_token: str | None,
    assign_devices: bool,
    history: tuple[float, int] = (0.0, 0),
) -> list[WorkerLaunch]:
    """The launches of group ``g``'s ranks (``ranks``, or all of them) at their placed devices: ``restore`` from the
    newest snapshots, ``replacement`` of a dead rank of the healing run ``runs[g.name]``; ``history``: the group's
    seconds trained and restarts that rolled it back, for ``snapshots.cadence: failure_history``."""
    by_worker = {a["worker"]: a for a in placement["assignments"]}
    port = str(free_port())
    out = []
    for rank in range(g.world_size) if ranks is None else ranks:
        name = f"{g.name}-{rank}"
        a = by_worker[name]
        env = _env(
            job,
            g,
            rank,
            port,
            a,
            restore=restore,
            replacement=replacement,
            runs=runs,
            endpoint=endpoint,
            pool_token=pool_token,
            assign_devices=assign_devices,
            history=history,
        )
        device = str(a["device"]) if assign_devices else None
        index = device.rsplit("gpu", 1)[-1] if device else ""
        out.append(
            WorkerLaunch(
                worker=name, group=g.name, role=g.role, rank=rank, world_size=g.world_size,
                command=tuple(g.command), env=env, device=device, node=a["node"],
                cpus=tuple(a["cpus"]) if assign_devices else (),
                gpu_index=int(index) if index.isdigit() else None,
            )
        )  # fmt: skip
    return out


def _env(
    job: JobFile,
    g: Any,
    rank: int,
    port: str,
    a: dict[str, Any],
    *,
    restore: bool,
    replacement: bool,
    runs: dict[str, str],
    endpoint: str | None,
    pool_token: str | None,
    assign_devices: bool,
    history: tuple[float, int] = (0.0, 0),
) -> dict[str, str]:
    """The environment of rank ``rank`` of group ``g``, placed at assignment ``a``."""
    group = g.name
    # Rendezvous defaults for a group on this machine; a job spread over machines (Ray) sets MASTER_ADDR
    # and GLOO_SOCKET_IFNAME in its group's env, which win.
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "GLOO_SOCKET_IFNAME": "lo",
        **g.env,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(g.world_size),
        "MASTER_PORT": port,
        "DSEC_ROLE": g.role,
        "DSEC_GROUP": g.name,
        "DSEC_SANDBOX_ID": job.pool,
    }
    if job.snapshots.enabled:
        env["DSEC_SNAPSHOT_DIR"] = str(job.snapshots.dir)
    if assign_devices:
        env["DSEC_DEVICE"] = str(a["device"])  # device health judges the devices workers report
    if endpoint:
        env["DSEC_ENDPOINT"] = endpoint
    if pool_token:
        env["DSEC_TOKEN"] = pool_token
    if job.snapshots.enabled and job.snapshots.interval_s is not None:
        env["DSEC_SNAPSHOT_INTERVAL_S"] = str(job.snapshots.interval_s)
    if job.snapshots.enabled and job.snapshots.cadence != "fixed":
        env["DSEC_SNAPSHOT_CADENCE"] = job.snapshots.cadence
        env["DSEC_SNAPSHOT_HISTORY"] = f"{history[0]:.1f}:{history[1]}"
        env["DSEC_SNAPSHOT_JOB_HISTORY"] = str(history_path(job.snapshots.dir, job.job))
    if restore:
        env["DSEC_RESTORE"] = "latest"
    if group in runs:
        env["DSEC_HEAL_RUN"] = runs[group]
        if replacement:
            env["DSEC_HEAL_REPLACEMENT"] = "1"
    return env
