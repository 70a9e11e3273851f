"""``dsec run --nproc-per-node N -- COMMAND``: run N ranks of a command on this machine, torchrun-style (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in each one's environment), under DSec's supervisor instead of
torchrun's agent — which restarts every worker when one fails. With ``--heal`` a dead rank is replaced in place
while its peers keep training (docs/healing.md); without, the group restarts (from its agreed snapshots when
``--snapshot-dir`` is given). The ranks' output goes to this terminal. Exit status: 0 when every rank finished
with 0, 1 when the group was given up.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping, Sequence

from dsec.client import Client
from dsec.launch.jobfile import JobFile
from dsec.launch.local import LocalLauncher
from dsec.launch.supervisor import Recovery, Supervisor


def _job_name(command: Sequence[str]) -> str:
    script = next((os.path.basename(a) for a in command[1:] if a.endswith(".py")), os.path.basename(command[0]))
    return (re.sub(r"[^A-Za-z0-9_.-]", "-", script.removesuffix(".py")) or "job")[:48]


def run_group(command: Sequence[str], env: Mapping[str, str], nproc: int, heal: bool, max_restarts: int = 3) -> int:
    snapdir = env.get("DSEC_SNAPSHOT_DIR")
    interval = env.get("DSEC_SNAPSHOT_INTERVAL_S")
    job = JobFile.model_validate(
        {
            "job": _job_name(command),
            "pool": env["DSEC_SANDBOX_ID"],
            "snapshots": {
                "enabled": bool(snapdir),
                "dir": snapdir or ".",
                "interval_s": float(interval) if interval else None,
            },
            "restart": {"max_restarts": max_restarts},
            "groups": [
                {
                    "name": env.get("DSEC_GROUP") or "default",
                    # The ranks of a supervised group train together: learners, unless a role is given.
                    "role": env.get("DSEC_ROLE") if env.get("DSEC_ROLE") not in (None, "", "auto") else "learner",
                    "world_size": nproc,
                    "heal": heal,
                    "command": list(command),
                }
            ],
        }
    )
    base = {k: v for k, v in env.items() if k not in ("DSEC_SNAPSHOT_DIR", "DSEC_RESTORE")}
    launcher = LocalLauncher(base_env=base, inherit_output=True)

    def report(r: Recovery) -> None:
        print(f"dsec: {r.mode} of {r.worker}: " + json.dumps(r.timings()), file=sys.stderr, flush=True)

    with Client(env["DSEC_ENDPOINT"], token=env.get("DSEC_TOKEN")) as pool_client:
        sup = Supervisor(
            job,
            launcher,
            endpoint=env["DSEC_ENDPOINT"],
            pool_token=env.get("DSEC_TOKEN"),
            on_recovery=report,
            heal_client=pool_client,
            assign_devices=False,
        )
        try:
            sup.start(restore=bool(env.get("DSEC_RESTORE")))
            ok = sup.run()
        finally:
            sup.stop()
    if not ok:
        print(f"dsec: {job.job} given up: {sup.failed}", file=sys.stderr)
    return 0 if ok else 1
