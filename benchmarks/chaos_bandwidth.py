"""Chaos on a real network: the PPO example with one rank behind a rate-limited link, DSec off and on.

The straggler of ``chaos_real.py`` is simulated (the probe delays its own syncs); here the slow network is real.
Topology (Linux network namespaces; this kernel has ``tbf`` but no ``netem``): a namespace holds rank 1, joined
to this namespace by a veth pair whose two ends each shape their egress with a token bucket (``tc qdisc ... tbf
rate R``), so every byte between rank 1 and rank 0 crosses an R Mbit/s link both ways. Rank 0, the rendezvous store
and (DSec on) the control plane are on the near end's address; rank 1's heartbeats cross the same link.

* DSec OFF: the ranks (``--world``, 2 by default; only rank 1 is far) started directly (``RANK``/``WORLD_SIZE``/
  ``MASTER_ADDR`` in their environment, no probe): the unmodified script, all-reduces at full precision.
* DSec ON: ``dsec serve`` on the near address and the supervisor (the Python API behind ``dsec launch``, local
  launcher) starting the same command; the probe measures each gradient sync, and the control plane's default
  judgment (the circuit breaker) decides, from what the probes report, whether to degrade the group (4-bit
  compression with error feedback, then gradient accumulation).

Both runs: ``--duration`` seconds of training from rank 0's first progress line (its reported elapsed
time subtracted); goodput = PPO updates completed in that budget (each is 8 epochs x 4 minibatches of optimizer
steps); ``goodput_ratio`` = DSec / baseline. Also reported: the breaker's decisions and highest level, the directives
acked, each rank's last sync latency and compression bits as the control plane saw them (DSec run).

Skips (``{"skipped": reason}`` as the last line, exit 0) where a namespace, a veth pair or a ``tbf`` qdisc cannot be
made (not root, no iproute2, a kernel without it). Every namespace, link, process and server it made is removed.

    python benchmarks/chaos_bandwidth.py [--rate-mbit 2] [--duration 60] [--world 2] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from chaos_real import (
    ADMIN,
    START_TIMEOUT_S,
    ControlPlane,
    Line,
    LogTail,
    base_env,
    script_args,
    stop_group,
    tail,
)

WRAP = Path(__file__).resolve().with_name("_netns_rank.py")
POOL, GROUP, FAR_RANK = "bench", "learners", 1
OPT_STEPS_PER_UPDATE = 32  # 8 epochs x 4 minibatches (chaos_real's script_args)


class Unavailable(RuntimeError):
    """The rate-limited link cannot be made here (the reason is the message)."""


class LimitedLink:
    """A network namespace joined to this one by a veth pair, both ends shaped to ``rate_mbit`` by ``tbf``."""

    def __init__(self, rate_mbit: float) -> None:
        tag = os.getpid() % 100_000
        self.netns = f"dsecbw{tag}"
        self.near_if, self.far_if = f"dbw{tag}n", f"dbw{tag}f"
        octet = tag % 250 + 1
        self.near_ip, self.far_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit={rate_mbit!r} is invalid: expected a rate > 0")
        self.rate_mbit = rate_mbit
        self._made: list[list[str]] = []  # how to remove what was made, last first

    def _run(self, *cmd: str) -> None:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"{' '.join(cmd)}: {exc}") from None
        if out.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")

    def __enter__(self) -> LimitedLink:
        shape = ["tbf", "rate", f"{self.rate_mbit:g}mbit", "burst", "16kb", "latency", "400ms"]
        try:
            self._run("ip", "netns", "add", self.netns)
            self._made.append(["ip", "netns", "del", self.netns])
            self._run("ip", "link", "add", self.near_if, "type", "veth", "peer", "name", self.far_if)
            self._made.append(["ip", "link", "del", self.near_if])  # its peer goes with it
            self._run("ip", "link", "set", self.far_if, "netns", self.netns)
            self._run("ip", "addr", "add", f"{self.near_ip}/30", "dev", self.near_if)
            self._run("ip", "link", "set", self.near_if, "up")
            self._run("ip", "-n", self.netns, "addr", "add", f"{self.far_ip}/30", "dev", self.far_if)
            self._run("ip", "-n", self.netns, "link", "set", self.far_if, "up")
            self._run("ip", "-n", self.netns, "link", "set", "lo", "up")
            self._run("tc", "qdisc", "add", "dev", self.near_if, "root", *shape)
            self._run("ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev", self.far_if, "root", *shape)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        while self._made:  # only what this link made (a name that was taken already is not ours)
            subprocess.run(self._made.pop(), capture_output=True, timeout=10)

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run as one rank: the far rank inside the namespace (see _netns_rank.py)."""
        return [sys.executable, str(WRAP), self.netns, self.near_if, self.far_if, str(FAR_RANK), "--", *argv]


def _follow(logs: Path, duration: float, alive: Any) -> list[Line]:
    """Rank 0's progress lines until ``duration`` s of training have passed (from its first line's start)."""
    tail_ = LogTail(logs)
    lines: list[Line] = []
    deadline = time.time() + START_TIMEOUT_S
    while True:
        lines += tail_.poll()
        if lines:
            t0 = lines[0].wall - lines[0].t
            if time.time() >= t0 + duration:
                return [ln for ln in lines if ln.wall <= t0 + duration]
        elif time.time() > deadline:
            raise RuntimeError(f"no progress line within {START_TIMEOUT_S:g} s")
        alive()
        time.sleep(0.2)


def _goodput(lines: list[Line], duration: float) -> dict[str, Any]:
    updates = max((ln.update for ln in lines), default=0)
    return {
        "updates": updates,
        "optimizer_steps": updates * OPT_STEPS_PER_UPDATE,
        "updates_per_min": round(60.0 * updates / duration, 2),
        "last_avg_return": lines[-1].avg_return if lines else None,
    }


def run_baseline(link: LimitedLink, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from dsec.control.server import free_port

    logs = work / "baseline"
    logs.mkdir(parents=True)
    env = {**base_env(), "WORLD_SIZE": str(args.world), "MASTER_ADDR": link.near_ip,
           "MASTER_PORT": str(free_port(link.near_ip))}  # fmt: skip
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(args.world):
            with open(logs / f"rank{rank}.log", "ab") as log:
                procs.append(
                    subprocess.Popen(
                        link.command([sys.executable, *script_args(args.seed, args.num_steps)]),
                        env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                    )
                )  # fmt: skip

        def alive() -> None:
            for rank, p in enumerate(procs):
                if p.poll() is not None:
                    raise RuntimeError(f"rank {rank} exited with {p.returncode}: {tail(logs / f'rank{rank}.log')}")

        return _goodput(_follow(logs, args.duration, alive), args.duration)
    finally:
        for p in procs:
            stop_group(p, signal.SIGTERM, grace_s=5.0)


def run_dsec(link: LimitedLink, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    from dsec.client import Client
    from dsec.launch.jobfile import JobFile
    from dsec.launch.local import LocalLauncher
    from dsec.launch.supervisor import Supervisor

    server = ControlPlane(work / "cp", work / "dsec-serve.log", host=link.near_ip)
    client = Client(server.url, token=ADMIN, timeout=30.0)
    sup: Supervisor | None = None
    try:
        devices = [f"gpu-{i}" for i in range(args.world)]
        for d in devices:
            client.request("PUT", f"/v1/devices/{d}", json={"id": d, "node": "node-0", "model": "sim", "memory_gb": 16})
        client.put_pool(POOL, devices=devices)
        job = JobFile.model_validate(
            {
                "job": "ppo-bandwidth",
                "pool": POOL,
                "snapshots": {"enabled": False},
                "restart": {"max_restarts": 0},
                "groups": [
                    {
                        "name": GROUP,
                        "role": "learner",
                        "world_size": args.world,
                        "memory_gb": 4,
                        "env": {"DSEC_HEARTBEAT_INTERVAL": str(args.beat), "MASTER_ADDR": link.near_ip,
                                "PYTHONUNBUFFERED": "1", **dict(kv.split("=", 1) for kv in args.probe_env)},
                        "command": link.command([sys.executable, *script_args(args.seed, args.num_steps)]),
                    }
                ],
            }
        )  # fmt: skip
        launcher = LocalLauncher(base_env=base_env(), log_dir=work / "dsec-logs")
        sup = Supervisor(job, launcher, client=client, endpoint=server.url,
                         pool_token=client.create_token(POOL), poll_s=0.1)  # fmt: skip
        sup.start()

        def alive() -> None:
            assert sup is not None
            sup.step()
            if sup.failed:
                raise RuntimeError(f"the job failed: {sup.failed}; {tail(work / 'dsec-logs' / f'{GROUP}-1.log')}")

        out = _goodput(_follow(work / "dsec-logs", args.duration, alive), args.duration)
        events = client.all_events(pool=POOL)
        workers = client.workers(pool=POOL)
        rank_of = {w["id"]: int(w["rank"]) for w in workers}
        breaker = [e for e in events if e["type"] in ("meltdown", "breaker", "recovered")]
        health = [e["data"] for e in client.all_events(types=["device"]) if e["data"].get("kind") == "health"]
        out.update(
            # Device health must not blame the cards for a slow link (it follows the ranks, not a card).
            devices_degraded=sorted({str(d["device"]) for d in health if d.get("to") == "degraded"}),
            # Fleet comparison flags by rank and feature (the far rank is expected on the sync features).
            fleet_outliers=sorted(
                f"{rank_of.get(e['worker_id'], '?')}:{e['data'].get('feature')}"
                for e in events
                if e["type"] == "anomaly" and e["data"].get("kind") == "fleet_outlier"
            ),
            breaker_events=len(breaker),
            breaker_max_level=max((int(e["data"].get("level_to") or 0) for e in breaker), default=0),
            directives_acked=sum(1 for e in events if e["type"] == "directive_acked"),
            ranks={
                int(w["rank"]): {
                    "sync_latency_ms_p50": (w.get("metrics") or {}).get("sync_latency_ms_p50"),
                    "sync_cost_ms_p50": (w.get("metrics") or {}).get("sync_cost_ms_p50"),
                    "compression_bits": (w.get("metrics") or {}).get("compression_bits"),
                    "compute_ms_p50": (w.get("metrics") or {}).get("compute_ms_p50"),
                }
                for w in workers
            },
        )
        return out
    finally:
        if sup is not None:
            sup.stop()
        client.close()
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate-mbit", type=float, default=2.0, help="the link's rate, each way (Mbit/s)")
    p.add_argument("--duration", type=float, default=60.0, help="training seconds per run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--world", type=int, default=2, help="ranks; rank 1 is behind the link, the others are not")
    p.add_argument("--num-steps", type=int, default=128, help="rollout length per env (the example's)")
    p.add_argument("--beat", type=float, default=1.0, help="heartbeat interval (s), DSec run")
    p.add_argument(
        "--probe-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a probe setting for the DSec run's ranks, e.g. DSEC_HEADER_EVERY=1 (repeatable)",
    )
    args = p.parse_args(argv)
    result: dict[str, Any] = {"scenario": "bandwidth", "rate_mbit": args.rate_mbit, "duration_s": args.duration,
                              "world": args.world, "far_rank": FAR_RANK}  # fmt: skip
    try:
        with LimitedLink(args.rate_mbit) as link, tempfile.TemporaryDirectory(prefix="dsec-bw-") as tmp:
            runs = {"baseline": run_baseline(link, Path(tmp), args), "dsec": run_dsec(link, Path(tmp), args)}
    except Unavailable as exc:
        print(json.dumps({**result, "skipped": f"no rate-limited link here: {exc}"}))
        return 0
    base, dsec = runs["baseline"]["updates"], runs["dsec"]["updates"]
    result.update(runs, goodput_ratio=round(dsec / base, 3) if base else None)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
