"""The ``ray`` launcher: each worker group in a Ray placement group whose bundles sit where DSec's placement put them.

One placement group per worker group, one bundle per worker (``{"CPU": 1, "GPU": 1}``, or ``{"CPU": 1}`` for a
worker without a device) and, per bundle, a Ray *label selector* naming the node DSec chose::

    ray.util.placement_group.placement_group(
        bundles=[{"CPU": 1, "GPU": 1}, ...],
        strategy="STRICT_PACK",                       # "PACK" when the group spans several nodes
        bundle_label_selector=[{"dsec/node": "node-0"}, ...],  # one selector per bundle, same order
    )

so every node of the Ray cluster must carry its DSec name as a label: ``ray start --labels "dsec/node=node-0"``
(or ``labels={"dsec/node": "node-0"}`` for ``ray.init`` / ``ray.cluster_utils.Cluster``). A worker whose placement
names no node gets an empty selector (any node). Ray picks the GPU *within* the node for each bundle: the worker's
``CUDA_VISIBLE_DEVICES`` comes from ``ray.get_gpu_ids()`` in its actor, not from ``WorkerLaunch.gpu_index`` (with
one DSec worker per device the two differ only in numbering, never in sharing).

Each worker is one Ray actor (``max_restarts=0``: DSec's supervisor, not Ray, decides about restarts) scheduled into
its bundle with ``PlacementGroupSchedulingStrategy``. The actor runs the worker's command as a subprocess (its own
session, so stopping it reaches its children) with ``worker.env`` plus ``CUDA_VISIBLE_DEVICES``, through a tiny exec
shim that asks the kernel to SIGKILL it when the actor process dies (``PR_SET_PDEATHSIG``, Linux) — when a node's
raylet goes away its actors die, and their commands must not live on holding GPUs. The actor's ``run()`` answers
the exit status; :meth:`RayLauncher.poll` watches those futures with ``ray.wait(..., timeout=0)``: an exit status
becomes ``Exit(code=status)`` (a signal status only once the actor answers a ping: a node going down can kill
the command a moment before its actor), a dead actor (node removed, actor process killed: ``ActorDiedError``) becomes
``Exit(code=None)``. ``ActorUnavailableError`` is not taken for a death: a node whose raylet stops answering first
makes its actors *unavailable* until the GCS declares the node dead (health checks: 5 x 3 s by default); meanwhile
:meth:`~RayLauncher.poll` re-attaches to the command (the actor's ``wait()``) once a second, and only counts the
worker lost (``code=None``) when Ray says the actor died or after ``unavailable_s``. Workers of a group stopped with
:meth:`~RayLauncher.stop_group` are not reported.

A placement group that cannot be placed (a node label nobody carries, too few free GPUs there) would wait forever:
:meth:`RayLauncher.start` waits ``pg_timeout_s`` and then raises a ``RuntimeError`` naming the group. After a node
is lost Ray keeps the group's placement group in ``RESCHEDULING`` (its label selectors pin the lost bundles to the
lost node); :meth:`RayLauncher.stop_group` removes it, and the supervisor relaunches the group from a new placement.

Ray is imported lazily: importing DSec never imports Ray.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from dsec.launch.base import Exit, WorkerLaunch
from dsec.launch.ray_actor import runner_class
from dsec.launch.ray_cluster import NODE_LABEL, GpuMode, connect, known_nodes, rendezvous, wants_gpu


@dataclass
class _Running:
    launch: WorkerLaunch
    actor: Any
    run_ref: Any  # the command's exit status (None until started, or while re-attaching)
    info: dict[str, Any] = field(default_factory=dict)
    reported: bool = False
    error: str = ""
    unavailable_since: float = 0.0  # time.monotonic() of the first ActorUnavailableError (0: none)
    reattach_at: float = 0.0
    # A command killed by a signal is only reported once its actor answered a ping: ``killed`` holds its status
    # meanwhile and ``run_ref`` the ping (see RayLauncher.poll).
    killed: int | None = None


@dataclass
class _Group:
    name: str
    pg: Any
    strategy: str
    workers: list[_Running]


class RayLauncher:
    """Launches placed workers as Ray actors in per-group placement groups pinned to DSec's nodes by label."""

    name = "ray"
    # A group is one placement group, started whole (start() refuses a group that runs): a worker restarted alone
    # would need a bundle of the running group's placement group. Not built; the group restarts instead.
    starts_single_workers = False
    reattach_s = 1.0  # an unavailable actor is asked again for its command's exit at most this often
    unavailable_s = 60.0  # ... and counted lost (Exit(code=None)) after this long

    def __init__(
        self,
        address: str | None = None,
        namespace: str = "dsec",
        pg_timeout_s: float = 60.0,
        *,
        grace_s: float = 0.0,
        gpus: GpuMode = "auto",
        local_cpus: int = 64,
        start_timeout_s: float | None = None,
    ) -> None:
        import ray

        self.pg_timeout_s = pg_timeout_s
        # A placed group's actors starting (a process each, imports included): slower than placement on a busy
        # machine; the placement wait by default.
        self.start_timeout_s = pg_timeout_s if start_timeout_s is None else start_timeout_s
        self.grace_s = grace_s
        self.namespace = namespace
        self.gpus = gpus
        self._owns_ray = False
        # A local Ray started here has one node (this machine): nothing to pin to; see ray_cluster.py.
        self._local = False
        if not ray.is_initialized():
            self._local = connect(address, namespace, local_cpus)
            self._owns_ray = True
        self._groups: dict[str, _Group] = {}
        self._stopped = False

    # -- starting ------------------------------------------------------------------------------------------------
    def start(self, workers: list[WorkerLaunch]) -> None:
        """Start every worker; all or nothing (a group that cannot be placed stops the groups started here)."""
        if self._stopped:
            raise RuntimeError("this RayLauncher is stopped")
        groups: dict[str, list[WorkerLaunch]] = {}
        for w in workers:
            groups.setdefault(w.group, []).append(w)
        names = [w.worker for w in workers]
        running = {r.launch.worker for g in self._groups.values() for r in g.workers}
        dup = sorted({n for n in names if names.count(n) > 1} | (set(names) & running))
        if dup:
            raise ValueError(f"worker names must be unique in the job: {', '.join(dup)} given twice or already running")
        busy = sorted(set(groups) & set(self._groups))
        if busy:
            raise ValueError(f"group(s) {', '.join(busy)} already running: stop_group() first")
        started: list[str] = []
        try:
            for group, members in groups.items():
                self._groups[group] = self._start_group(group, members)
                started.append(group)
        except BaseException:
            for group in started:
                self.stop_group(group)
            raise

    def _start_group(self, group: str, members: list[WorkerLaunch]) -> _Group:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpu = [wants_gpu(self.gpus, w.device is not None) for w in members]
        bundles: list[dict[str, float]] = [{"CPU": 1.0, "GPU": 1.0} if g else {"CPU": 1.0} for g in gpu]
        pin = not self._local
        selectors = [{NODE_LABEL: w.node} if pin and w.node is not None else {} for w in members]
        nodes = {w.node for w in members} if pin else {None}
        strategy = "STRICT_PACK" if len(nodes) == 1 and None not in nodes else "PACK"
        pg = placement_group(
            bundles, strategy=strategy, name=f"{self.namespace}:{group}", bundle_label_selector=selectors
        )
        if not pg.wait(timeout_seconds=self.pg_timeout_s):
            remove_placement_group(pg)
            wanted = ", ".join(
                f"{w.worker}->{(w.node if pin else None) or 'any node'}{' (GPU)' if g else ''}"
                for w, g in zip(members, gpu, strict=True)
            )
            raise RuntimeError(
                f"group {group!r} could not be placed within {self.pg_timeout_s:g} s ({strategy} placement group: "
                f"{wanted}); nodes Ray knows by {NODE_LABEL}: {', '.join(known_nodes()) or 'none'} (label each node "
                f"with its DSec name: ray start --labels {NODE_LABEL}=<node>; docs/scheduling.md)"
            )
        runner = runner_class()
        out = _Group(group, pg, strategy, [])
        try:
            for i, (w, g) in enumerate(zip(members, gpu, strict=True)):
                actor = runner.options(
                    num_cpus=1,
                    num_gpus=1 if g else 0,
                    max_restarts=0,
                    max_task_retries=0,
                    max_concurrency=8,  # info()/terminate()/wait() answer while run() waits for the command
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=pg, placement_group_bundle_index=i
                    ),
                ).remote(w.worker, list(w.command), dict(w.env), list(w.cpus), os.getcwd())
                out.workers.append(_Running(w, actor, None))
            # one node (STRICT_PACK, or a local Ray): the one-machine rendezvous holds, no round trip to ask
            extra, unset = self._rendezvous(out.workers) if strategy == "PACK" and not self._local else ({}, [])
            for r in out.workers:
                r.run_ref = r.actor.run.remote(extra, unset)
            infos = ray.get(
                [r.actor.info.remote(self.start_timeout_s) for r in out.workers], timeout=self.start_timeout_s
            )
        except Exception as e:  # GetTimeoutError, ActorDiedError (its node went away meanwhile), ...
            self._teardown(out)
            raise RuntimeError(
                f"group {group!r}: its actors did not start within {self.start_timeout_s:g} s: {e}"
            ) from e
        except BaseException:
            self._teardown(out)
            raise
        for r, info in zip(out.workers, infos, strict=True):
            r.info = info
            if info.get("error"):
                r.error = info["error"]
        return out

    def _rendezvous(self, workers: list[_Running]) -> tuple[dict[str, str], list[str]]:
        """Rank 0's address for a group whose actors landed on several hosts (see ray_cluster.rendezvous)."""
        import ray

        ips = ray.get([r.actor.node_ip.remote() for r in workers], timeout=self.start_timeout_s)
        rank0 = next(ip for r, ip in zip(workers, ips, strict=True) if r.launch.rank == 0)
        return rendezvous(workers[0].launch.env, rank0, set(ips))

    # -- watching ------------------------------------------------------------------------------------------------
    def poll(self) -> list[Exit]:
        """Workers that exited since the last poll (``ray.wait`` with timeout 0: never blocks).

        ``ActorDiedError`` (the node is gone, or the actor was killed) is final: ``Exit(code=None)``.
        ``ActorUnavailableError`` is not (Ray: "temporarily unavailable", e.g. its raylet stopped answering before
        the GCS declares the node dead): the launcher re-attaches to the command (``wait()``) at most once per
        ``reattach_s`` until the actor answers or is declared dead, and gives up (``code=None``) after
        ``unavailable_s``.

        A command killed by a signal (negative status) is reported only after its actor answers a ping: when a node
        goes down, its commands can be killed a moment before their actors, and an actor may still hand back the
        signal status before it dies itself. Taken as it comes, that node loss would read as a crash of the command
        (``code=-9``) with the node still counted alive; the ping fails on a dead node, and the worker is reported
        lost (``code=None``) with Ray's reason, as its peers on that node are."""
        import ray

        now = time.monotonic()
        for r in self._pending():
            if r.run_ref is None and now >= r.reattach_at:
                r.run_ref = (r.actor.node_ip if r.killed is not None else r.actor.wait).remote()
        watched = [r for r in self._pending() if r.run_ref is not None]
        if not watched:
            return []
        refs = [r.run_ref for r in watched]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        done = {ref.hex() for ref in ready}
        exits: list[Exit] = []
        for r in watched:
            if r.run_ref.hex() not in done:
                continue
            code: int | None
            try:
                answer = ray.get(r.run_ref, timeout=0)
            except ray.exceptions.ActorUnavailableError as e:
                r.error = _describe(e)
                r.unavailable_since = r.unavailable_since or now
                if now - r.unavailable_since < self.unavailable_s:
                    r.run_ref, r.reattach_at = None, now + self.reattach_s
                    continue
                code = None
            except ray.exceptions.RayError as e:  # ActorDiedError (node gone, actor killed), worker crash, ...
                code = None
                r.error = _describe(e)
            else:
                if r.killed is None and int(answer) < 0:  # killed by a signal: is its actor (its node) still there?
                    r.killed, r.run_ref = int(answer), r.actor.node_ip.remote()
                    continue
                code = r.killed if r.killed is not None else int(answer)
            r.reported = True
            exits.append(Exit(r.launch.worker, r.launch.group, code, time.time()))
        return exits

    def _pending(self) -> list[_Running]:
        return [r for g in self._groups.values() for r in g.workers if not r.reported]

    def where(self) -> dict[str, str]:
        """Worker -> the ``dsec/node`` label of the node its actor actually runs on ("" when it has none)."""
        return {
            r.launch.worker: str(r.info.get("labels", {}).get(NODE_LABEL, ""))
            for g in self._groups.values()
            for r in g.workers
        }

    def details(self) -> dict[str, dict[str, Any]]:
        """Per worker: Ray node id, node labels, GPU ids, the command's CUDA_VISIBLE_DEVICES and pid, the actor's
        pid, last error."""
        return {
            r.launch.worker: {**r.info, "group": r.launch.group, "error": r.error}
            for g in self._groups.values()
            for r in g.workers
        }

    def placement_group(self, group: str) -> Any:
        """The Ray placement group of a running group (for ``placement_group_table``)."""
        return self._groups[group].pg

    # -- stopping ------------------------------------------------------------------------------------------------
    def stop_group(self, group: str, grace_s: float | None = None) -> None:
        """Stop ``group``'s commands (their process groups: SIGTERM, then SIGKILL after ``grace_s``, default the
        launcher's ``grace_s``: 0, SIGKILL at once, as a gloo rank whose peer died hangs in its collective anyway),
        kill its actors, remove its placement group; returns when they are gone. Its workers are no longer reported
        by :meth:`poll` (a stop is not an exit to act on)."""
        g = self._groups.pop(group, None)
        if g is not None:
            self._teardown(g, self.grace_s if grace_s is None else grace_s)

    def _teardown(self, g: _Group, grace_s: float | None = None) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        grace = self.grace_s if grace_s is None else grace_s
        actors = [r.actor for r in g.workers]
        if actors:
            refs = [a.terminate.remote(grace) for a in actors]
            # dead actors answer at once (with an error); live ones within the grace period plus SIGKILL's wait
            ray.wait(refs, num_returns=len(refs), timeout=grace + 10.0)
            for a in actors:
                _quietly(ray.kill, a, no_restart=True)
            runs = [r.run_ref for r in g.workers if r.run_ref is not None]
            if runs:
                ray.wait(runs, num_returns=len(runs), timeout=10.0)
        _quietly(remove_placement_group, g.pg)

    def stop(self) -> None:
        """Stop every group; shut Ray down when this launcher started it. Idempotent."""
        if self._stopped:
            return
        try:
            for group in list(self._groups):
                self.stop_group(group)
        finally:
            self._stopped = True
            if self._owns_ray:
                import ray

                ray.shutdown()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"[:1000]


def _quietly(fn: Any, *args: Any, **kwargs: Any) -> None:
    with contextlib.suppress(Exception):
        fn(*args, **kwargs)
