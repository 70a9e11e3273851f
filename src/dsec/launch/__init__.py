"""Launcher backends behind one interface (base.py), chosen by name: ``local`` and ``ray``; the supervisor that
places a job, starts it and restarts failed groups from their snapshots (supervisor.py); job files (jobfile.py)."""

from __future__ import annotations

from typing import Any

from dsec.launch.base import Exit, Launcher, WorkerLaunch

BACKENDS = ("local", "ray")


def make_launcher(name: str, **options: Any) -> Launcher:
    """A launcher by name; ``options`` that a backend does not take are ignored."""
    if name == "local":
        from dsec.launch.local import LocalLauncher

        return LocalLauncher(
            base_env=options.get("base_env"), log_dir=options.get("log_dir"), warm=bool(options.get("warm", False))
        )
    if name == "ray":
        from dsec.launch.ray_backend import RayLauncher

        ray = options.get("ray")  # jobfile.RaySettings, when the job file has one
        return RayLauncher(
            address=options.get("address", ray.address if ray else None),
            gpus=ray.gpus if ray else "auto",
            local_cpus=ray.local_cpus if ray else 64,
        )
    raise ValueError(f"launcher {name!r} is unknown: expected one of {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "Exit", "Launcher", "WorkerLaunch", "make_launcher"]
