"""The ``local`` launcher: one subprocess per worker on this machine, under the DSec probe.

Each worker runs in its own session (so a group can be killed as a whole, children included), with the probe
injected exactly as ``dsec run`` does, ``CUDA_VISIBLE_DEVICES`` set to its placed GPU's index, and its CPU affinity
set to the placed NUMA node's CPUs (those that exist here; none set when the placement's CPUs are not this
machine's — a synthetic inventory, say).

With ``warm=True`` the launcher keeps, per group, one *standby* process per rank that has already imported torch
and friends (warm.py); a restart hands the new ranks to the standbys instead of starting interpreters, then starts
new standbys for the next time. Standbys cost memory (one idle interpreter with torch per rank) and a burst of CPU
when they start; they are only used for ``python script.py ...`` / ``python -m module ...`` commands.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from dsec.launch.base import Exit, WorkerLaunch
from dsec.launch.warm import warm_argv
from dsec.probe.launch import probe_env

# What a standby imports ahead: the training stack and the probe itself (its HTTP client, snapshot codec).
WARM_MODULES = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    # DDP imports torch._dynamo at its first forward: ~1.7 s on this 2-core machine, a replacement's biggest cost
    "torch._dynamo",
    "torch.testing._internal.distributed.fake_pg",
    "numpy",
    "gymnasium",
    "gymnasium.envs.classic_control",
    "dsec.probe.runtime",
    "dsec.probe.torch_hooks",
    "dsec.probe.gym_hooks",
    "dsec.probe.healing",
    "dsec.probe.heal_sync",
    "dsec.snapshot",
)


@dataclass
class _Proc:
    spec: WorkerLaunch
    popen: subprocess.Popen[bytes]
    log: IO[bytes] | None
    ready: Path | None = None  # a standby's "imports done" marker


class LocalLauncher:
    name = "local"
    starts_single_workers = True

    def __init__(
        self,
        base_env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        warm: bool = False,
        warm_modules: tuple[str, ...] = WARM_MODULES,
        refill_after_s: float = 5.0,
        inherit_output: bool = False,  # no log_dir: workers write to this process's stdout/stderr (else nowhere)
    ) -> None:
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.inherit_output = inherit_output
        self.warm = warm
        self.warm_modules = warm_modules
        self._procs: dict[str, _Proc] = {}
        self._spares: dict[str, list[_Proc]] = {}  # group -> standby processes
        self._spare_n = 0
        self.warm_starts = 0  # workers started on a standby (for reports and tests)
        # Standbys import torch: start them once a group has settled, not while it is (re)starting on the same CPUs.
        self.refill_after_s = refill_after_s
        self._refill_due: dict[str, tuple[float, list[WorkerLaunch]]] = {}
        self._ranks: collections.defaultdict[str, dict[str, WorkerLaunch]] = collections.defaultdict(dict)
        self._ready_tmp: Path | None = None

    def _log(self, name: str) -> IO[bytes] | None:
        if self.log_dir is None:
            return None
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return open(self.log_dir / f"{name}.log", "ab")

    def start(self, workers: list[WorkerLaunch]) -> None:
        for w in workers:
            env = probe_env(self.base_env, dict(w.env))
            if w.gpu_index is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(w.gpu_index)
            cpus = _usable(w.cpus)
            spare = self._take_spare(w)
            argv = warm_argv(w.command)
            if spare is not None and argv is not None and spare.popen.stdin is not None:
                order = json.dumps({"argv": argv, "env": env}) + "\n"
                spare.popen.stdin.write(order.encode())
                spare.popen.stdin.close()
                if cpus:
                    with contextlib.suppress(OSError):
                        os.sched_setaffinity(spare.popen.pid, cpus)
                self._procs[w.worker] = _Proc(w, spare.popen, spare.log)
                self.warm_starts += 1
            else:
                log = self._log(w.worker)
                popen = subprocess.Popen(
                    list(w.command),
                    env=env,
                    stdout=log if log is not None else None if self.inherit_output else subprocess.DEVNULL,
                    stderr=subprocess.STDOUT if log is not None or not self.inherit_output else None,
                    start_new_session=True,
                    preexec_fn=(lambda cpus=cpus: os.sched_setaffinity(0, cpus)) if cpus else None,
                )
                self._procs[w.worker] = _Proc(w, popen, log)
        if self.warm:
            for group in sorted({w.group for w in workers}):
                due = time.monotonic() + self.refill_after_s
                # One standby per rank of the group, whichever ranks this start was for (a replacement is one).
                for w in workers:
                    if w.group == group:
                        self._ranks[group][w.worker] = w
                self._refill_due[group] = (due, list(self._ranks[group].values()))

    # -- standbys ----------------------------------------------------------------------------------------------
    def _take_spare(self, w: WorkerLaunch) -> _Proc | None:
        spares = self._spares.get(w.group, [])
        while spares:
            spare = spares.pop(0)
            if spare.popen.poll() is None:
                return spare
            if spare.log is not None:
                spare.log.close()
        return None

    def _refill(self, group: str, workers: list[WorkerLaunch]) -> None:
        """One standby per rank of ``group``, started without the probe (it is configured when used)."""
        if not workers or warm_argv(workers[0].command) is None:
            return
        spares = self._spares.setdefault(group, [])
        for _ in range(len(workers) - len(spares)):
            self._spare_n += 1
            log = self._log(f"standby-{group}-{self._spare_n}")
            ready = self._ready_dir() / f"{group}-{self._spare_n}"
            env = {**self.base_env, **workers[0].env, "DSEC_STANDBY_READY": str(ready)}
            popen = subprocess.Popen(
                [workers[0].command[0], "-m", "dsec.launch.warm", *self.warm_modules],
                env=env,
                stdin=subprocess.PIPE,
                stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            spares.append(_Proc(workers[0], popen, log, ready))

    def _ready_dir(self) -> Path:
        if self._ready_tmp is None:
            self._ready_tmp = Path(tempfile.mkdtemp(prefix="dsec-standby-"))
        return self._ready_tmp

    def standbys_ready(self, group: str) -> int:
        """How many standbys of ``group`` have finished their imports and wait for a job."""
        return sum(
            1
            for s in self._spares.get(group, [])
            if s.ready is not None and s.ready.exists() and s.popen.poll() is None
        )

    def poll(self) -> list[Exit]:
        now = time.monotonic()
        for group, (due, workers) in list(self._refill_due.items()):
            if now >= due:
                del self._refill_due[group]
                self._refill(group, workers)
        out = []
        for name, p in list(self._procs.items()):
            code = p.popen.poll()
            if code is not None:
                out.append(Exit(name, p.spec.group, code, time.time(), p.popen.pid))
                self._close(name)
        return out

    def pids(self, group: str | None = None) -> dict[str, int]:
        return {n: p.popen.pid for n, p in self._procs.items() if group is None or p.spec.group == group}

    def stop_group(self, group: str, grace_s: float = 0.0) -> None:
        """SIGKILL every process of the group's workers (their whole sessions); a gloo rank whose peer died hangs
        in its collective, so a grace period only delays the restart. Returns once they are reaped."""
        self.stop_workers([n for n, p in self._procs.items() if p.spec.group == group], grace_s)

    def stop_workers(self, names: list[str], grace_s: float = 0.0) -> None:
        """Stop these workers' processes only (as :meth:`stop_group` does); their peers keep running. A stopped
        worker is not reported by :meth:`poll` (a stop is not an exit to act on)."""
        victims = [(n, self._procs[n]) for n in names if n in self._procs]
        if grace_s > 0:
            for _, p in victims:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.popen.pid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(p.popen.poll() is None for _, p in victims):
                time.sleep(0.02)
        for _, p in victims:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.popen.pid, signal.SIGKILL)
        for name, p in victims:
            p.popen.wait()
            self._close(name)

    def stop(self) -> None:
        for group in {p.spec.group for p in self._procs.values()}:
            self.stop_group(group)
        for spares in self._spares.values():
            for spare in spares:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(spare.popen.pid, signal.SIGKILL)
                spare.popen.wait()
                if spare.popen.stdin is not None:
                    spare.popen.stdin.close()
                if spare.log is not None:
                    spare.log.close()
        self._spares.clear()
        if self._ready_tmp is not None:
            shutil.rmtree(self._ready_tmp, ignore_errors=True)
            self._ready_tmp = None

    def _close(self, name: str) -> None:
        p = self._procs.pop(name, None)
        if p is not None and p.log is not None:
            p.log.close()


def _usable(cpus: tuple[int, ...]) -> set[int]:
    if not cpus or not hasattr(os, "sched_getaffinity"):
        return set()
    return set(cpus) & os.sched_getaffinity(0)
