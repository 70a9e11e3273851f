"""Demo scenes for what an operator looks at after the run: `dsec top` (one frame, with the read-only token the
dashboard uses) and the cost accounting of the demo's own window (`GET /v1/cost`)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any

from dsec.client import Client, ClientError

WIDTH = 100  # the column budget every listing keeps


def top_frame(endpoint: str, read_token: str, pool: str) -> dict[str, Any]:
    """`dsec top --once` as an operator runs it (text at 100 columns) and its `--json` frame; ``error`` on failure."""
    base = [sys.executable, "-m", "dsec.cli", "top", "--once", "--pool", pool, "--endpoint", endpoint]
    env = {**os.environ, "DSEC_READ_TOKEN": read_token, "COLUMNS": str(WIDTH)}
    env.pop("DSEC_ADMIN_TOKEN", None)
    try:
        text = subprocess.run(base, env=env, capture_output=True, text=True, timeout=60)
        frame = subprocess.run([*base, "--json"], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return {"error": "dsec top did not answer within 60 s"}
    if text.returncode != 0 or frame.returncode != 0:
        return {"error": (text.stderr or frame.stderr).strip()[-500:]}
    try:
        data = json.loads(frame.stdout)
    except ValueError as exc:
        return {"error": f"dsec top --json printed no JSON ({exc})"}
    return {"text": text.stdout, "frame": data}


def top_ok(result: dict[str, Any]) -> bool:
    """It ran with a read-only token, fits the width, and orders by trouble: a lost worker, if any, comes first."""
    if "error" in result:
        return False
    rows = result["frame"].get("workers", [])
    fits = all(len(line) <= WIDTH for line in result["text"].splitlines())
    lost = [i for i, r in enumerate(rows) if r.get("state") == "lost"]
    return bool(rows) and fits and (not lost or lost[0] == 0)


def cost_report(client: Client, pool: str, since: float, until: float) -> dict[str, Any]:
    """The cost accounting of ``pool`` over the demo's window; ``error`` when the control plane refuses it."""
    try:
        return client.cost(pool=pool, since=since, until=until)
    except ClientError as exc:
        return {"error": str(exc)}


def cost_ok(report: dict[str, Any]) -> bool:
    """Device-hours were counted, their phases add up to the total, and the breaker scene's degradation shows."""
    if "error" in report or not report.get("pools"):
        return False
    hours = report["pools"][0]["device_hours"]
    parts = sum(hours[p] for p in ("useful", "degraded", "recovering", "idle"))
    return hours["total"] > 0 and math.isclose(parts, hours["total"], rel_tol=1e-9) and hours["degraded"] > 0


def cost_rows(report: dict[str, Any]) -> list[tuple[str, str]]:
    if "error" in report or not report.get("pools"):
        return [("cost accounting (GET /v1/cost)", report.get("error", "no pool in the report"))]
    p = report["pools"][0]
    h = {k: v * 3600.0 for k, v in p["device_hours"].items()}  # the demo's window is minutes: device-seconds
    snaps = p["implicit"]["snapshots"]
    return [
        (
            "device time (GET /v1/cost)",
            f"{h['total']:.0f} device-s: useful {h['useful']:.0f}, degraded {h['degraded']:.0f}, "
            f"recovering {h['recovering']:.0f}, idle {h['idle']:.0f}",
        ),
        (
            "DSec's own cost (GET /v1/cost)",
            f"{snaps.get('count', 0)} snapshots, {snaps.get('bytes', 0) / 2**20:.1f} MiB written; "
            f"estimated: {', '.join(report.get('estimated', [])) or 'nothing'}",
        ),
    ]
