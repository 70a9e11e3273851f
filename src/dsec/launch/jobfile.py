"""Job files for ``dsec launch``: what to run, in which groups, under which control plane and snapshot store.

Example (``examples/jobs/ppo.yaml``)::

    job: ppo-cartpole
    pool: pool-0
    launcher: local                      # local | ray (examples/jobs/ppo-ray.yaml; ``ray:`` settings)
    snapshots: {dir: .dsec/snapshots, interval_s: 5}   # adapted to the failure history unless cadence: fixed (below)
    restart: {max_restarts: 3}
    groups:
      - name: learners
        role: learner
        world_size: 2                    # one process per rank (RANK / WORLD_SIZE / MASTER_* in its environment)
        memory_gb: 4
        load_class: short-episode
        replay_share: false
        heal: true                       # replace a dead rank in place; its peers keep training
        command: [python, examples/ppo_cartpole_ddp.py, --max-seconds, "60"]
      - name: actors                     # (not in ppo.yaml) independent env runners:
        role: actor                      # restart_scope defaults to worker: a dead one restarts alone
        world_size: 4
        command: [python, my_env_runner.py]

The control plane comes from ``--endpoint`` / ``DSEC_ENDPOINT`` and the pool token from ``DSEC_TOKEN`` (for the
workers' probes) — the same variables ``dsec run`` uses. Errors name file, line and column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsec.scheduler.placement import GroupSpec, JobSpec, WorkerSpec
from dsec.yamlconf import load_file


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class SnapshotSettings(_Strict):
    enabled: bool = True
    dir: Path = Path(".dsec/snapshots")
    interval_s: float | None = Field(None, ge=1, le=86400)
    # ``failure_history`` (the default): each learner's interval from its group's history — Young's
    # sqrt(2 x cost x MTBF) over the restarts that rolled the group back to its snapshots, the job's other groups'
    # history and ``interval_s`` (or the pool's) the prior, 30 s to 30 min (dsec.decide.cadence, probe/cadence.py,
    # dsec.job_history); ``fixed``: every ``interval_s`` (the default until 2026-12-04).
    cadence: Literal["fixed", "failure_history"] = "failure_history"


class RestartSettings(_Strict):
    max_restarts: int = Field(3, ge=0, le=1000)
    resume_timeout_s: float = Field(120.0, gt=0, le=3600)
    # Healing groups: how long a replacement may wait for admission before the group falls back to a restart from
    # its agreed snapshots (a script whose collectives never repeat has no admission point).
    admit_timeout_s: float = Field(120.0, gt=0, le=3600)


class RaySettings(_Strict):
    """``launcher: ray`` only (launch/ray_cluster.py). ``address``: none = ``RAY_ADDRESS`` if set, else a local Ray
    started for this job and stopped with it; ``auto`` = the cluster ``ray start`` runs on this machine; or an
    address. ``gpus``: ``auto`` asks for a GPU per placed worker only when the cluster has GPUs."""

    address: str | None = Field(None, min_length=1, max_length=512)
    gpus: Literal["auto", "always", "never"] = "auto"
    local_cpus: int = Field(64, ge=1, le=4096)  # logical CPUs of a local Ray (a worker takes one)


class GroupFile(_Strict):
    name: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    role: Literal["learner", "actor", "other"] = "learner"
    world_size: int = Field(1, ge=1, le=1024)
    command: list[str] = Field(..., min_length=1)
    memory_gb: float = Field(4.0, gt=0, le=4096)
    load_class: Literal["long-episode", "short-episode", "sync-heavy"] = "short-episode"
    replay_share: bool = False
    # Heal in place: a dead rank is replaced without stopping its peers (docs/healing.md); gloo DDP jobs only.
    heal: bool = False
    # What a dead process takes down: ``group`` — every rank restarts from the group's agreed snapshots (ranks that
    # share a process group, e.g. DDP learners); ``worker`` — only that process restarts, from its own newest
    # snapshot, its peers keep running (independent processes: env runners, actors). Default: ``worker`` for
    # ``role: actor``, else ``group``.
    restart_scope: Literal["group", "worker"] | None = None
    env: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _scope_fits(self) -> GroupFile:
        if self.heal and self.restart_scope == "worker":
            raise ValueError(
                "restart_scope: 'worker' restarts one process and leaves its peers alone; heal: true is for ranks "
                "that share a process group (a replacement joins it). Choose one"
            )
        return self

    @property
    def scope(self) -> Literal["group", "worker"]:
        if self.restart_scope is not None:
            return self.restart_scope
        return "worker" if self.role == "actor" and not self.heal else "group"


class JobFile(_Strict):
    job: str = Field(..., pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    pool: str
    launcher: Literal["local", "ray"] = "local"
    # local launcher: keep a warm standby process per rank (torch already imported) for fast restarts
    warm_standby: bool = False
    snapshots: SnapshotSettings = Field(default_factory=SnapshotSettings)
    restart: RestartSettings = Field(default_factory=RestartSettings)
    ray: RaySettings = Field(default_factory=RaySettings)
    groups: list[GroupFile] = Field(..., min_length=1)

    def spec(self) -> JobSpec:
        """The placement request: one worker per rank, named ``<group>-<rank>``."""
        return JobSpec(
            self.job,
            tuple(
                GroupSpec(
                    g.name,
                    tuple(
                        WorkerSpec(f"{g.name}-{r}", g.role, g.memory_gb, f"{self.job}/{g.name}-{r}")
                        for r in range(g.world_size)
                    ),
                    g.load_class,
                    g.replay_share,
                )
                for g in self.groups
            ),
            self.pool,
        )


def load_job(path: str | Path) -> JobFile:
    return load_file(JobFile, path)
