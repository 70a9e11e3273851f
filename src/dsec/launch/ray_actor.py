"""The Ray actor that runs one worker's command (ray_backend.py schedules one into each bundle of a group's placement
group). Its classes are defined in functions so that Ray ships them by value: the nodes need no DSec install.

The command runs as a subprocess (its own session, so stopping it reaches its children) with the worker's env plus
``CUDA_VISIBLE_DEVICES``, through a tiny exec shim that asks the kernel to SIGKILL it when the actor process dies
(``PR_SET_PDEATHSIG``, Linux)."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

# Runs as the worker's process: kill me when my parent (the actor) dies, pin CPUs, exec the command.
# argv: <parent pid> <cpus, comma-separated or empty> <command...>
_EXEC_SHIM = """
import os, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(137)  # the actor died before the signal was armed
if sys.argv[2] and hasattr(os, "sched_setaffinity"):
    want = {int(c) for c in sys.argv[2].split(",")} & os.sched_getaffinity(0)
    if want:
        os.sched_setaffinity(0, want)
try:
    os.execvp(sys.argv[3], sys.argv[3:])
except OSError as e:
    print(f"dsec: cannot run {sys.argv[3]!r}: {e}", file=sys.stderr)
    os._exit(127)
"""

_RUNNER: Any = None  # the Ray actor class, built on first use (Ray is imported lazily)


def _command_class() -> Any:
    """The actor's process side, with no Ray in it: hold the command's process, wait for it, stop it."""

    class Command:
        def __init__(
            self, worker: str, command: list[str], env: dict[str, str], cpus: list[int], cwd: str = ""
        ) -> None:
            import threading

            self.worker, self.command, self.env, self.cpus = worker, command, env, cpus
            self.cwd = cwd  # the driver's working directory: relative paths in the command mean the same there
            self.proc: Any = None
            self.cuda = self.error = ""
            self.probe = ""  # "" when the command runs under the probe, else why not
            self.spawned = threading.Event()

        def wait(self) -> int:
            """The command's exit status, once it has one (a second way in when run()'s answer was lost)."""
            self.spawned.wait()
            return 127 if self.proc is None else int(self.proc.wait())

        def terminate(self, grace_s: float) -> int | None:
            """SIGTERM the command's process group and SIGKILL it after ``grace_s`` (at once when 0); answers its
            exit status."""
            import os
            import signal
            import subprocess

            self.spawned.wait(max(grace_s, 5.0))
            proc = self.proc
            if proc is None:
                return None
            if grace_s > 0 and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(grace_s)
            # SIGKILL the whole process group: the command and whatever it started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
            code = proc.poll()
            return int(code) if code is not None else None

        def _with_probe(self, settings: dict[str, str]) -> dict[str, str]:
            """This node's environment, the worker's settings, and the probe as ``dsec run`` injects it (if DSec is
            installed on this node: else the command runs without it, and ``info`` says why)."""
            import os

            try:
                from dsec.probe.launch import probe_env
            except ImportError as e:
                self.probe = f"dsec is not importable on this node ({e}): the command runs without the probe"
                return {**os.environ, **settings}
            return probe_env(os.environ, settings)

    return Command


def runner_class() -> Any:
    """The actor class, defined in a function so that Ray ships it by value (workers need no DSec install)."""
    global _RUNNER
    if _RUNNER is not None:
        return _RUNNER
    import ray

    command_class = _command_class()

    class Runner(command_class):  # type: ignore[misc,valid-type]
        def node_ip(self) -> str:
            """The address of this actor's node (the group's rendezvous address when it holds rank 0)."""
            return str(ray.util.get_node_ip_address())  # type: ignore[no-untyped-call]

        def run(self, extra_env: dict[str, str] | None = None, unset: list[str] | None = None) -> int:
            """Start the command and answer its exit status (negative: killed by that signal).

            The thread that spawns the command waits for it, so the death signal armed in the child (bound to the
            spawning thread) only fires when the actor process itself dies."""
            import os
            import subprocess

            self.cuda = ",".join(str(i) for i in ray.get_gpu_ids())
            env = self._with_probe({**self.env, **(extra_env or {})})
            for name in unset or ():
                env.pop(name, None)
            env["CUDA_VISIBLE_DEVICES"] = self.cuda
            argv = [sys.executable, "-c", _EXEC_SHIM, str(os.getpid()), ",".join(map(str, self.cpus)), *self.command]
            cwd = self.cwd if self.cwd and os.path.isdir(self.cwd) else None
            try:
                self.proc = subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True)
            except OSError as e:
                self.error = f"cannot start {self.command[0]!r}: {e}"
                return 127
            finally:
                self.spawned.set()
            return int(self.proc.wait())

        def info(self, timeout: float) -> dict[str, Any]:
            """Where this actor runs and what its command got (waits up to ``timeout`` for the command to start)."""
            import os

            self.spawned.wait(timeout)
            ctx = ray.get_runtime_context()
            return {
                "node_id": ctx.get_node_id(),
                "labels": dict(ctx.get_node_labels()),
                "gpu_ids": [str(i) for i in ray.get_gpu_ids()],
                "cuda_visible_devices": self.cuda,
                "pid": self.proc.pid if self.proc is not None else None,
                "actor_pid": os.getpid(),
                "error": self.error,
                "probe": self.probe,
            }

    Runner.__name__ = Runner.__qualname__ = "DsecWorker"  # how Ray names it in errors and logs
    _RUNNER = ray.remote(Runner)
    return _RUNNER
