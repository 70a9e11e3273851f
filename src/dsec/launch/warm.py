"""A warm standby worker: a Python process that has already imported the heavy modules (torch, gymnasium, numpy)
and waits for its orders, so that restarting a failed group does not pay for interpreter start-up and imports
again (on two cores, four ranks importing torch at once take seconds).

Started as ``python -m dsec.launch.warm MODULE...`` by the local launcher, *without* the probe: the probe's
configuration (rank, restore request, endpoint) is only known when the standby is given its job. The order is one
JSON line on stdin: ``{"argv": ["script.py", "--flag"], "env": {...}}``. The standby then updates its environment,
starts the probe exactly as ``dsec run``'s ``sitecustomize`` would (it hooks modules that are already imported),
and runs the script as ``__main__``. Anything that is not a ``python script.py ...`` or ``python -m module ...``
command is started cold instead (see local.py).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import sys


def warm_argv(command: tuple[str, ...] | list[str]) -> list[str] | None:
    """The script/module argv a standby can run for ``command``, or None when it is not a plain Python command."""
    if not command:
        return None
    exe = os.path.basename(command[0])
    if not (command[0] == sys.executable or exe.startswith("python")):
        return None
    rest = list(command[1:])
    if rest and rest[0] == "-m" and len(rest) >= 2:
        return rest
    if rest and rest[0].endswith(".py"):
        return rest
    return None


def main(modules: list[str]) -> int:
    for name in modules:
        # A module that is not installed here: the script will say so itself, if it needs it.
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    ready = os.environ.get("DSEC_STANDBY_READY")
    if ready:  # tell the launcher this standby is warm
        with open(ready, "w") as fh:
            fh.write(str(os.getpid()))
    line = sys.stdin.readline()
    if not line:
        return 0  # released without a job
    order = json.loads(line)
    # The order's environment is the worker's whole environment: replace ours (the standby was started with an
    # earlier launch's, e.g. DSEC_RESTORE from a restart, which a replacement must not inherit).
    os.environ.clear()
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    if os.environ.get("DSEC_ENDPOINT"):
        try:
            from dsec.probe.bootstrap import bootstrap

            bootstrap()
        except Exception as exc:  # as in sitecustomize: a broken probe never stops the program
            sys.stderr.write(f"dsec: probe not started: {exc}\n")
    argv = [str(a) for a in order["argv"]]
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
