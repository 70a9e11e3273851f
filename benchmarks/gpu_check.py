"""GPU validation (issue 23): every GPU path of DSec, run once on a real device, reported as one JSON line.

NOT YET RUN ON A GPU. This script and tests/gpu/test_gpu_paths.py were written on a machine without one: the code
paths below have only been exercised through their skip paths and the ``--device cpu`` self-check.

Checks (``--only``), each in its own process group with its own timeout, so one hang cannot take the whole budget:

- ``nvml``: the inventory ``dsec.scheduler.inventory.discover_nvml`` builds (name, memory, NUMA node, NVLink peers,
  throttle reasons) next to ``nvidia-smi -q``, ``nvidia-smi topo -m`` and the kernel's ``numa_node`` of each PCI
  device. NVML through ``pynvml`` (nvidia-ml-py) when installed, else a ctypes binding of the same calls on
  ``libnvidia-ml.so.1`` (the driver's library). Pass: same devices, names, memory within 2%, NUMA nodes, peers.
- ``quota``: a probed process (``dsec.attach()``) is asked by the control plane for a 2 GiB ``memory_quota_gb``;
  it allocates 128 MiB blocks up to 3 GiB. Pass: ``torch.OutOfMemoryError`` at or below 2 GiB while the device still
  had free memory (the OOM is the process's own limit, not the card's), the control plane sees ``memory_quota_gb``
  2 and ``memory_used_gb`` at most 2; after the quota is raised to 6 GiB the same process reaches 3 GiB.
- ``probe``: DDP over NCCL, world size 1 (NCCL refuses two ranks on one GPU; ``--probe-world N`` with N GPUs), run
  plain and under ``dsec run`` at 32, 8 and 4 bits. Reports the step time of each, the probe's overhead at 32 bits,
  and the bytes per sync each run reported to the control plane. Pass: every run finishes, 32-bit / 4-bit bytes
  >= 6 and 32-bit / 8-bit >= 3.
- ``snapshot``: a ~100M-parameter MLP + Adam on the GPU: blocking ms of level-0 snapshots vs ``torch.save`` + fsync
  of the same state, restore time into a fresh model, bit-exactness of parameters and optimizer state, CUDA RNG
  state restored, and whether ``codec.host_copy`` returns pinned memory. Pass: bit-exact, RNG equal.
- ``memory_watch``: the drain and the burst snapshot on CUDA (dsec.probe.device_memory): a probed process with its
  allocator capped at 2 GiB by the probe grows its tensors at a burst's rate (0.4 GB/s) and then, in a second
  process, at a slow climb's (0.045 GB/s) into a final limit. Pass: a ``memory_burst`` snapshot in the last 2.5 s
  before the burst's ``torch.OutOfMemoryError``; the climb drained (``MemoryRecycle``, a ``memory_recycle``
  snapshot) with no OOM. Skipped with ``--device cpu`` (the fake card stands in there, in the unit tests).
- ``inject``: ``build/native/libdsec_inject.so`` (``make native`` when missing) under LD_PRELOAD in a process that
  calls the real ``cudaMalloc``/``cudaFree`` of libcudart and ``ncclAllReduce`` of libnccl through ctypes (the
  libraries torch loaded, else the nvidia-* wheels, else the system's; the report names them). Pass: the
  allocation, free and all-reduce counts and bytes reach the control plane. A second process does the same
  through torch (caching allocator, ProcessGroupNCCL); its figures are reported, not required.

Each check reports ``{"ok": true|false, ...figures, "failures": [...]}``, or ``{"skipped": reason}``, or
``{"ok": false, "error": text}``. Without a CUDA device every check is skipped with the reason, the JSON line is
still printed and the exit status is 0. ``--device cpu`` is a self-check of this script's plumbing, not of GPU
paths, and its figures say nothing about GPUs: the probe over gloo, a small snapshot on CPU, the quota check's
directive round trip without any allocator limit, and the inject check against stub CUDA/NCCL libraries compiled
at run time (gcc); nvml is skipped.

    python benchmarks/gpu_check.py [--only nvml,quota,probe,snapshot,inject] [--out FILE] [--budget-s 450]

Last stdout line: one JSON object. Exit status: 0 when no check failed, 1 when one did, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import queue
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).resolve()
CHECKS = ("nvml", "quota", "probe", "snapshot", "inject", "memory_watch")
# Guesses, never measured on a GPU: each covers process starts, `import torch` and CUDA/NCCL initialization.
TIMEOUT_S = {"nvml": 60.0, "quota": 150.0, "probe": 240.0, "snapshot": 240.0, "inject": 150.0, "memory_watch": 150.0}
NEEDS_CONTROL_PLANE = ("quota", "probe", "inject", "memory_watch")
MIN_CHECK_S = 15.0  # a check given less than this by the budget is skipped, not started to be killed
ADMIN_TOKEN = "dsa_gpu-check-admin-token-0123456789"
QUOTA_GB, RAISED_QUOTA_GB, FILL_GB, CHUNK_MB = 2.0, 6.0, 3.0, 128
CPU_SKIPS = {
    "nvml": "--device cpu: NVML describes NVIDIA GPUs; there is nothing to discover on CPU",
    "memory_watch": "--device cpu: the watch reads a CUDA device's memory (on CPU the fake card stands in for it: "
    "tests/unit/probe/test_cuda_memory_watch.py, test_recycle.py)",
}


class Skip(Exception):
    """A check that cannot run here; the message says why."""


# ================================================================================================ parent side
def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="gpu_check.py",
        description=__doc__.split("\n\n")[0],
        epilog=f"checks: {', '.join(CHECKS)}",
    )
    ap.add_argument("--only", type=check_list, default=list(CHECKS), metavar="CHECK[,CHECK]", help="checks to run")
    ap.add_argument("--out", type=Path, help="also write the JSON result here")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: self-check of this script only")
    ap.add_argument("--budget-s", type=float, default=450.0, help="all checks together (default 450 s)")
    ap.add_argument("--timeout-s", type=float, help="per-check timeout (default: per check, 60-240 s)")
    ap.add_argument("--snapshot-params", type=int, help="model size of the snapshot check (default 100M; cpu 1M)")
    ap.add_argument("--probe-steps", type=int, help="timed DDP steps per probe run (default 60; cpu 10)")
    ap.add_argument("--probe-world", type=int, default=1, help="DDP ranks, one per GPU (default 1)")
    args = ap.parse_args(argv)
    for name in ("budget_s", "timeout_s", "snapshot_params", "probe_steps", "probe_world"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            ap.error(f"--{name.replace('_', '-')}={value}: expected a positive number")
    return args


def check_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated list of {', '.join(CHECKS)}")
    return list(dict.fromkeys(names))


def cuda_status(device: str) -> tuple[str | None, dict[str, Any]]:
    """(why every check is skipped, or None; what this machine has). Never initializes CUDA in this process."""
    try:
        import torch
    except ImportError as exc:
        return f"torch is not installed ({exc})", {}
    info: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda}
    if device == "cpu":
        return None, info
    if torch.version.cuda is None:
        return f"no CUDA device: torch {torch.__version__} is a CPU-only build", info
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return f"no CUDA device: torch.cuda.is_available() is False (CUDA_VISIBLE_DEVICES={visible!r})", info
    info["device_count"] = torch.cuda.device_count()
    return None, info


def clean_env() -> dict[str, str]:
    """This process's environment without DSec settings or preloads: each child adds exactly what it needs."""
    return {k: v for k, v in os.environ.items() if not k.startswith("DSEC_") and k != "LD_PRELOAD"}


@contextlib.contextmanager
def control_plane() -> Iterator[str]:
    """A real control plane (uvicorn on a thread) over a temporary SQLite home, like benchmarks/recovery.py."""
    from dsec.control.app import create_app
    from dsec.control.server import ServerThread
    from dsec.control.settings import Settings

    home = Path(tempfile.mkdtemp(prefix="dsec-gpu-check-"))
    try:
        settings = Settings.from_env(home=home, admin_token=ADMIN_TOKEN, reconcile_interval_s=0.1, alert_log=False)
        with ServerThread(create_app(settings)) as server:
            yield server.url
    finally:
        shutil.rmtree(home, ignore_errors=True)


def kill_group(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
    return None


def run_check(name: str, ctx: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """One check in its own process group: its result, or why there is none."""
    cmd = [sys.executable, str(SCRIPT), "_check", name, json.dumps(ctx)]
    proc = subprocess.Popen(
        cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=clean_env(), start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        return {"ok": False, "error": f"timed out after {timeout_s:.0f} s; its process group was killed"}
    finally:
        kill_group(proc)  # workers it left behind (a check that crashed mid-way)
    result = last_json(out)
    if result is None:
        return {"ok": False, "error": f"exited with {proc.returncode} without a result", "stdout_tail": out[-1500:]}
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_check", "_worker"):
        return internal(argv)
    args = parse_args(argv)
    t_start = time.monotonic()
    cpu = args.device == "cpu"
    skip_all, machine = cuda_status(args.device)
    ctx: dict[str, Any] = {
        "device": args.device,
        "admin_token": ADMIN_TOKEN,
        "snapshot_params": args.snapshot_params or (1_000_000 if cpu else 100_000_000),
        "probe_steps": args.probe_steps or (10 if cpu else 60),
        "probe_world": args.probe_world,
    }
    results: dict[str, dict[str, Any]] = {}
    todo = []
    for name in args.only:
        if skip_all is not None:
            results[name] = {"skipped": skip_all}
        elif cpu and name in CPU_SKIPS:
            results[name] = {"skipped": CPU_SKIPS[name]}
        else:
            todo.append(name)
    with contextlib.ExitStack() as stack:
        if any(name in NEEDS_CONTROL_PLANE for name in todo):
            try:
                ctx["endpoint"] = stack.enter_context(control_plane())
            except Exception as exc:
                for name in [n for n in todo if n in NEEDS_CONTROL_PLANE]:
                    results[name] = {"ok": False, "error": f"the control plane did not start: {exc}"}
                    todo.remove(name)
        for name in todo:
            left = args.budget_s - (time.monotonic() - t_start)
            timeout_s = min(args.timeout_s or TIMEOUT_S[name], left)
            if timeout_s < MIN_CHECK_S:
                results[name] = {"skipped": f"the time budget ({args.budget_s:.0f} s) is spent"}
                continue
            print(f"gpu_check: {name} (timeout {timeout_s:.0f} s)", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            result = run_check(name, {**ctx, "timeout_s": timeout_s}, timeout_s)
            result.setdefault("seconds", round(time.monotonic() - t0, 1))
            results[name] = result
            print(f"gpu_check: {name}: {summary(results[name])}", file=sys.stderr, flush=True)
    ordered = {name: results[name] for name in args.only}
    failed = [n for n, r in ordered.items() if "skipped" not in r and not r.get("ok")]
    report = {
        "script": "benchmarks/gpu_check.py",
        "device": args.device,
        **machine,
        "ok": not failed,
        "ran": [n for n, r in ordered.items() if "skipped" not in r],
        "failed": failed,
        "skipped": [n for n, r in ordered.items() if "skipped" in r],
        "elapsed_s": round(time.monotonic() - t_start, 1),
        "checks": ordered,
    }
    line = dumps(report)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line, flush=True)
    return 1 if failed else 0


def summary(result: dict[str, Any]) -> str:
    if "skipped" in result:
        return f"skipped ({result['skipped']})"
    if "error" in result:
        return f"ERROR {result['error']}"
    return "ok" if result.get("ok") else f"FAILED {result.get('failures')}"


def dumps(value: Any) -> str:
    from dsec.jsonsafe import json_safe

    return json.dumps(json_safe(value), allow_nan=False)


# ================================================================================================ child side
def internal(argv: list[str]) -> int:
    role, name, ctx = argv[0], argv[1], json.loads(argv[2])
    if role == "_worker":
        WORKERS[name](ctx)
        return 0
    try:
        result = CHECK_FUNCS[name](ctx)
    except Skip as exc:
        result = {"skipped": str(exc)}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2500:]}
    print(dumps(result), flush=True)
    return 0


def verdict(figures: dict[str, Any], failures: list[str]) -> dict[str, Any]:
    return {"ok": not failures, **figures, "failures": failures}


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def admin_client(ctx: dict[str, Any]) -> Any:
    from dsec.client import Client

    return Client(ctx["endpoint"], token=ctx["admin_token"], timeout=10.0)


def pool_with_token(admin: Any, pool: str, **spec: Any) -> str:
    admin.put_pool(pool, **spec)
    return str(admin.create_token(pool, label="gpu_check"))


def pool_worker(admin: Any, pool: str) -> dict[str, Any] | None:
    found = admin.workers(pool=pool)
    return dict(found[-1]) if found else None


def metrics_of(admin: Any, pool: str) -> dict[str, float]:
    w = pool_worker(admin, pool)
    return dict(w["metrics"]) if w else {}


def probe_settings(ctx: dict[str, Any], pool: str, token: str, **extra: str) -> dict[str, str]:
    return {
        "DSEC_ENDPOINT": ctx["endpoint"],
        "DSEC_SANDBOX_ID": pool,
        "DSEC_TOKEN": token,
        "DSEC_ROLE": "learner",
        "DSEC_HEARTBEAT_INTERVAL": "0.2",
        **extra,
    }


def emit(obj: dict[str, Any]) -> None:
    """A worker's message to its check: one JSON line on stdout."""
    sys.stdout.write(dumps(obj) + "\n")
    sys.stdout.flush()


def commands() -> Iterator[dict[str, Any]]:
    """A worker's commands from its check, one JSON line each on stdin, until stdin closes."""
    for line in sys.stdin:
        if line.strip():
            yield dict(json.loads(line))


class Child:
    """A worker process speaking JSON lines (commands on stdin, messages on stdout; stderr to a log file)."""

    def __init__(self, kind: str, ctx: dict[str, Any], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        with log.open("wb") as fh:
            self.proc = subprocess.Popen(
                [sys.executable, str(SCRIPT), "_worker", kind, json.dumps(ctx)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=fh,
                text=True,
                env=env,
            )
        threading.Thread(target=self._read, name="gpu-check-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if isinstance(msg, dict) and "event" in msg:
                    self._messages.put(msg)
        self._messages.put(None)  # stdout closed: the process is exiting

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def request(self, event: str, timeout_s: float, **command: Any) -> dict[str, Any]:
        """Send ``command`` and wait for the answer ``event``."""
        self.send(**command)
        return self.expect(event, timeout_s)

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._messages.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {event!r} from the worker within {timeout_s:g} s; {self.tail()}") from None
            if msg is None:
                self.proc.wait(timeout=10)
                raise RuntimeError(f"worker exited with {self.proc.returncode} before {event!r}; {self.tail()}")
            if msg["event"] == event:
                return msg

    def tail(self, chars: int = 1500) -> str:
        try:
            return "its log ends: " + self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "no log"

    def close(self, timeout_s: float = 20.0) -> int:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sync(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------------------------ nvml
SMI_REASON_BITS = {
    "idle": 0x1,
    "applications clocks setting": 0x2,
    "sw power cap": 0x4,
    "hw slowdown": 0x8,
    "sync boost": 0x10,
    "sw thermal slowdown": 0x20,
    "hw thermal slowdown": 0x40,
    "hw power brake slowdown": 0x80,
    "display clock setting": 0x100,
}
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_smi_q(text: str) -> list[dict[str, str]]:
    """``nvidia-smi -q`` as one flat dict per GPU: ``"Section/Key" -> value``. Sections are the indented lines
    without `` : ``; a GPU block starts with ``GPU <bus id>`` at column 0 (its key ``Bus Id``)."""
    gpus: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    stack: list[tuple[int, str]] = []
    for raw in _ANSI.sub("", text).splitlines():
        line = raw.strip()
        if not line:
            continue
        indent = len(raw) - len(raw.lstrip())
        head = re.fullmatch(r"GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]+:[0-9A-Fa-f]+\.[0-9A-Fa-f]+)", line)
        if head and indent == 0:
            current = {"Bus Id": head.group(1)}
            gpus.append(current)
            stack = []
            continue
        if current is None:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        pair = re.match(r"^(.*?\S)\s+:(?:\s(.*))?$", line)
        if pair:
            current["/".join([s for _, s in stack] + [pair.group(1)])] = (pair.group(2) or "").strip()
        else:
            stack.append((indent, line))
    return gpus


def smi_value(gpu: dict[str, str], *paths: str) -> str | None:
    """The first of ``paths`` (case-insensitive, matched at the end of a key) that ``gpu`` holds."""
    for path in paths:
        for key, value in gpu.items():
            if key.lower() == path.lower() or key.lower().endswith("/" + path.lower()):
                return value
    return None


def smi_reasons(gpu: dict[str, str]) -> int:
    """The active clocks event ("throttle") reasons of ``nvidia-smi -q`` as NVML's bitmask."""
    bits = 0
    for key, value in gpu.items():
        section, _, name = key.lower().rpartition("/")
        if ("clocks event reasons" in section or "clocks throttle reasons" in section) and value == "Active":
            bits |= SMI_REASON_BITS.get(name.strip(), 0)
    return bits


def parse_topo(text: str) -> dict[int, set[int]] | None:
    """``nvidia-smi topo -m``: GPU index -> the GPUs it reaches over NVLink (``NV#`` cells); None if unreadable."""
    lines = [ln.rstrip() for ln in _ANSI.sub("", text).splitlines() if ln.strip()]
    header = next((ln.split() for ln in lines if ln[:1].isspace() and ln.split()[:1] == ["GPU0"]), None)
    if header is None:
        return None
    columns: list[int] = []
    for cell in header:
        if not re.fullmatch(r"GPU\d+", cell):
            break
        columns.append(int(cell[3:]))
    out: dict[int, set[int]] = {}
    for ln in lines:
        parts = ln.split()
        if ln[:1].isspace() or not parts or not re.fullmatch(r"GPU\d+", parts[0]):
            continue
        cells = parts[1 : 1 + len(columns)]
        out[int(parts[0][3:])] = {columns[k] for k, c in enumerate(cells) if c.startswith("NV")}
    return out


def sysfs_numa(bus_id: str) -> int | None:
    """The kernel's NUMA node of a PCI device (``00000000:18:00.0`` -> /sys/bus/pci/devices/0000:18:00.0)."""
    domain, _, rest = bus_id.partition(":")
    try:
        path = Path("/sys/bus/pci/devices") / f"{int(domain, 16):04x}:{rest}".lower() / "numa_node"
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


class NvmlError(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"NVML error {code}: {text}")
        self.code = code


class _PciInfo(ctypes.Structure):  # nvmlPciInfo_t (nvml.h; what nvmlDeviceGetPciInfo_v3 fills)
    _fields_ = [
        ("busIdLegacy", ctypes.c_char * 16),
        ("domain", ctypes.c_uint),
        ("bus", ctypes.c_uint),
        ("device", ctypes.c_uint),
        ("pciDeviceId", ctypes.c_uint),
        ("pciSubSystemId", ctypes.c_uint),
        ("busId", ctypes.c_char * 32),
    ]


class _Memory(ctypes.Structure):  # nvmlMemory_t
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class CtypesNvml:
    """The pynvml calls ``discover_nvml`` makes, over the driver's ``libnvidia-ml.so.1`` with ctypes: used when
    nvidia-ml-py is not installed, so the check runs on a machine that has only the driver and torch."""

    NVML_NVLINK_MAX_LINKS = 18
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self, path: str = "libnvidia-ml.so.1") -> None:
        self._lib = ctypes.CDLL(path)

    def _call(self, name: str, *args: Any) -> None:
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            raise NvmlError(13, f"{name} is not in this driver's NVML") from None  # NVML_ERROR_FUNCTION_NOT_FOUND
        rc = int(fn(*args))
        if rc != 0:
            describe = self._lib.nvmlErrorString
            describe.restype = ctypes.c_char_p
            raise NvmlError(rc, (describe(rc) or b"?").decode())

    def nvmlInit(self) -> None:
        self._call("nvmlInit_v2")

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlDeviceGetCount(self) -> int:
        n = ctypes.c_uint()
        self._call("nvmlDeviceGetCount_v2", ctypes.byref(n))
        return n.value

    def nvmlDeviceGetHandleByIndex(self, index: int) -> ctypes.c_void_p:
        handle = ctypes.c_void_p()
        self._call("nvmlDeviceGetHandleByIndex_v2", ctypes.c_uint(index), ctypes.byref(handle))
        return handle

    def nvmlDeviceGetName(self, handle: ctypes.c_void_p) -> bytes:
        buf = ctypes.create_string_buffer(96)  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
        self._call("nvmlDeviceGetName", handle, buf, ctypes.c_uint(96))
        return buf.value

    def nvmlDeviceGetMemoryInfo(self, handle: ctypes.c_void_p) -> _Memory:
        mem = _Memory()
        self._call("nvmlDeviceGetMemoryInfo", handle, ctypes.byref(mem))
        return mem

    def nvmlDeviceGetNumaNodeId(self, handle: ctypes.c_void_p) -> int:
        node = ctypes.c_uint()
        self._call("nvmlDeviceGetNumaNodeId", handle, ctypes.byref(node))
        return node.value

    def nvmlDeviceGetPciInfo(self, handle: ctypes.c_void_p) -> _PciInfo:
        pci = _PciInfo()
        self._call("nvmlDeviceGetPciInfo_v3", handle, ctypes.byref(pci))
        return pci

    def nvmlDeviceGetNvLinkState(self, handle: ctypes.c_void_p, link: int) -> int:
        state = ctypes.c_uint()
        self._call("nvmlDeviceGetNvLinkState", handle, ctypes.c_uint(link), ctypes.byref(state))
        return state.value

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: ctypes.c_void_p, link: int) -> _PciInfo:
        pci = _PciInfo()
        self._call("nvmlDeviceGetNvLinkRemotePciInfo_v2", handle, ctypes.c_uint(link), ctypes.byref(pci))
        return pci

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: ctypes.c_void_p) -> int:
        reasons = ctypes.c_ulonglong()
        try:
            self._call("nvmlDeviceGetCurrentClocksEventReasons", handle, ctypes.byref(reasons))
        except NvmlError as exc:
            if exc.code != 13:
                raise
            self._call("nvmlDeviceGetCurrentClocksThrottleReasons", handle, ctypes.byref(reasons))  # older drivers
        return reasons.value

    def nvmlDeviceGetTotalEccErrors(self, handle: ctypes.c_void_p, error_type: int, counter_type: int) -> int:
        count = ctypes.c_ulonglong()
        args = (handle, ctypes.c_uint(error_type), ctypes.c_uint(counter_type), ctypes.byref(count))
        self._call("nvmlDeviceGetTotalEccErrors", *args)
        return count.value


def nvml_binding() -> tuple[Any, str]:
    try:
        import pynvml

        return pynvml, "pynvml (nvidia-ml-py)"
    except ImportError:
        pass
    try:
        return CtypesNvml(), "ctypes on libnvidia-ml.so.1 (nvidia-ml-py is not installed)"
    except OSError as exc:
        raise Skip(f"no NVML: nvidia-ml-py is not installed and libnvidia-ml.so.1 cannot be loaded ({exc})") from None


def run_text(cmd: list[str], timeout_s: float = 30.0) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    return proc.stdout if proc.returncode == 0 else None


def check_nvml(
    ctx: dict[str, Any],
    binding: tuple[Any, str] | None = None,
    run: Callable[[list[str]], str | None] = run_text,
    numa_of: Callable[[str], int | None] = sysfs_numa,
) -> dict[str, Any]:
    """``binding`` (NVML module, its description), ``run`` (nvidia-smi) and ``numa_of`` (the kernel's NUMA node of a
    bus id) are seams for tests: by default the real NVML, nvidia-smi and /sys."""
    from dsec.scheduler.inventory import TROUBLE_REASONS, discover_nvml

    nvml, description = binding or nvml_binding()
    inv = discover_nvml(nvml)
    devices = sorted(inv.devices.values(), key=lambda d: int(d.id.rsplit("gpu", 1)[1]))
    smi_text = run(["nvidia-smi", "-q"])
    smi = parse_smi_q(smi_text) if smi_text is not None else None
    topo_text = run(["nvidia-smi", "topo", "-m"])
    topo = parse_topo(topo_text) if topo_text is not None else None
    failures: list[str] = []
    if not devices:
        failures.append("discover_nvml found no device")
    if smi is None:
        failures.append("nvidia-smi -q did not run: nothing to compare the inventory with")
    elif len(smi) != len(devices):
        failures.append(f"discover_nvml found {len(devices)} devices, nvidia-smi -q {len(smi)}")
    rows = []
    for i, d in enumerate(devices):
        signals = inv.signals.get(d.id)
        row: dict[str, Any] = {
            "dsec": {
                "id": d.id,
                "name": d.model,
                "memory_gb": d.memory_gb,
                "numa_node": d.numa_node,
                "nvlink_peers": list(d.nvlink_peers),
                "throttle_reasons": signals.throttle_reasons if signals else None,
                "ecc_uncorrected": signals.ecc_uncorrected if signals else None,
            }
        }
        peers = {int(p.rsplit("gpu", 1)[1]) for p in d.nvlink_peers}
        if smi is not None and i < len(smi):
            g = smi[i]
            total = smi_value(g, "FB Memory Usage/Total") or ""
            mib = float(total.split()[0]) if total[:1].isdigit() else None
            bus = g["Bus Id"]
            reasons = smi_reasons(g)
            row["nvidia_smi"] = {
                "name": smi_value(g, "Product Name"),
                "memory_gb": round(mib / 1024, 2) if mib is not None else None,
                "bus_id": bus,
                "numa_node_sysfs": numa_of(bus),
                "active_clock_reasons": reasons,
                "trouble_reasons": reasons & TROUBLE_REASONS,
                "nvlink_peers_topo": sorted(topo.get(i, set())) if topo is not None else None,
            }
            smi_row = row["nvidia_smi"]
            match = {
                "name": smi_row["name"] == d.model,
                "memory": mib is not None and abs(d.memory_gb - mib / 1024) <= 0.02 * max(d.memory_gb, 1e-9),
                # -1 from both: a machine without NUMA information; None: the kernel did not say.
                "numa_node": smi_row["numa_node_sysfs"] is None or smi_row["numa_node_sysfs"] == d.numa_node,
                "nvlink_peers": topo is None or topo.get(i, set()) == peers,
            }
            row["match"] = match
            failures += [f"{d.id}: {what} differs" for what, same in match.items() if not same]
            # Throttle reasons are sampled at two instants a few hundred ms apart: reported side by side, not judged.
        rows.append(row)
    return verdict(
        {
            "binding": description,
            "node": next(iter(inv.nodes), None),
            "numa_cpus": {str(k): len(v) for n in inv.nodes.values() for k, v in n.numa_cpus.items()},
            "devices": rows,
            "topo_readable": topo is not None,
        },
        failures,
    )


# ------------------------------------------------------------------------------------------------ quota
def check_quota(ctx: dict[str, Any]) -> dict[str, Any]:
    admin = admin_client(ctx)
    pool = "gpu-quota"
    # The planner raises a quota below the pool's base and caps it at the ceiling: base 0.25 GB and ceiling 8 GB leave
    # 2 and 6 GB alone (no devices in the pool, so no capacity-driven growth or reclaim either).
    token = pool_with_token(admin, pool, memory_base_gb=0.25, memory_ceiling_gb=8.0)
    env = {**clean_env(), **probe_settings(ctx, pool, token)}
    cuda = ctx["device"] == "cuda"
    fill_gb = FILL_GB if cuda else 0.25  # CPU: only the directive round trip is checked; no allocator limit there
    tmp = tempfile.TemporaryDirectory(prefix="gpu-check-quota-")
    with tmp, Child("quota", ctx, env, Path(tmp.name) / "worker.log") as w:
        wid = w.expect("registered", 60)["worker_id"]

        def set_quota(gb: float) -> None:
            version = int(admin.set_directive(wid, memory_quota_gb=gb)["desired_version"])
            wait_until(lambda: admin.directive(wid)["acked_version"] >= version, 20, f"the {gb:g} GB quota acked")

        def seen(quota: float, used_ok: Callable[[float], bool]) -> dict[str, float]:
            def ready() -> dict[str, float] | None:
                m = metrics_of(admin, pool)
                if m.get("memory_quota_gb") == quota and used_ok(float(m.get("memory_used_gb", -1.0))):
                    return m
                return None

            m = wait_until(ready, 15, f"the control plane to see quota {quota:g} GB and the memory in use")
            return {k: m[k] for k in sorted(m) if "memory" in k or k.startswith("cuda")}

        set_quota(QUOTA_GB)
        under = w.request("filled", 60, cmd="fill", target_gb=fill_gb)
        cp_under = seen(QUOTA_GB, (lambda used: 0 < used <= QUOTA_GB + 0.01) if cuda else (lambda used: used > 0))
        set_quota(RAISED_QUOTA_GB)
        raised = w.request("filled", 60, cmd="fill", target_gb=fill_gb)
        cp_raised = seen(RAISED_QUOTA_GB, (lambda used: used >= fill_gb - 0.01) if cuda else (lambda used: used > 0))
        w.send(cmd="exit")
        w.close()
        events = admin.all_events(worker_id=wid)
    failures = [
        f"the worker's probe holds quota {got['quota_gb']} GB, the control plane set {want:g}"
        for got, want in ((under, QUOTA_GB), (raised, RAISED_QUOTA_GB))
        if got.get("quota_gb") != want
    ]
    if cuda and under.get("oom_type") != "OutOfMemoryError":
        failures.append(f"no torch.OutOfMemoryError under the {QUOTA_GB:g} GB quota: {under.get('oom_type')}")
    if cuda and not QUOTA_GB - 0.5 <= under["held_gb"] <= QUOTA_GB + 1e-6:
        failures.append(f"held {under['held_gb']:.3f} GB at the OOM: expected just under {QUOTA_GB:g} GB")
    if cuda and (under.get("device_free_gb") or 0.0) < 1.0:
        failures.append("the device itself was out of memory: the OOM was not the quota's")
    if raised.get("oom") or raised["held_gb"] < fill_gb - 1e-6:
        failures.append(f"after raising the quota to {RAISED_QUOTA_GB:g} GB it held {raised['held_gb']:.3f} GB")
    text = json.dumps(events).lower()
    return verdict(
        {
            "worker_id": wid,
            "fill_gb": fill_gb,
            "under_quota": under,
            "after_raise": raised,
            "control_plane_under_quota": cp_under,
            "control_plane_after_raise": cp_raised,
            # The probe reports memory as metrics (memory_used_gb = torch's reserved bytes, next to memory_quota_gb);
            # it has no OOM event. Whether any event mentions the OOM is recorded, not required.
            "oom_in_events": "outofmemory" in text or "out of memory" in text or '"oom"' in text,
            "event_types": sorted({str(e.get("type")) for e in events}),
        },
        failures,
    )


def worker_quota(ctx: dict[str, Any]) -> None:
    import torch

    import dsec

    cuda = ctx["device"] == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.empty(1, device=device)  # the CUDA context, before the probe sees a quota
    probe = dsec.attach()
    if probe is None:
        raise SystemExit("dsec.attach() returned None: DSEC_ENDPOINT / DSEC_SANDBOX_ID missing")
    rep = wait_until(lambda: probe.reporter if probe.reporter and probe.reporter.worker_id else None, 30, "register")
    emit({"event": "registered", "worker_id": rep.worker_id})
    blocks: list[Any] = []
    chunk = CHUNK_MB << 20
    for cmd in commands():
        if cmd.get("cmd") == "exit":
            break
        target = int(float(cmd["target_gb"]) * 2**30)
        oom: BaseException | None = None
        while len(blocks) * chunk < target:
            try:
                blocks.append(torch.empty(chunk, dtype=torch.uint8, device=device))
            except torch.OutOfMemoryError as exc:
                oom = exc
                break
        free, total = torch.cuda.mem_get_info(device) if cuda else (None, None)
        # torch names the limit it hit ("... X GiB allowed;") when a per-process fraction is set.
        allowed = re.search(r"([\d.]+ [KMGT]iB) allowed", str(oom)) if oom else None
        emit(
            {
                "event": "filled",
                "held_gb": len(blocks) * chunk / 2**30,
                "reserved_gb": torch.cuda.memory_reserved(device) / 2**30 if cuda else None,
                "oom": oom is not None,
                "oom_type": type(oom).__name__ if oom else None,
                "oom_message": str(oom)[:700] if oom else None,
                "oom_allowed": allowed.group(1) if allowed else None,
                "device_free_gb": free / 2**30 if free is not None else None,
                "device_total_gb": total / 2**30 if total is not None else None,
                "quota_gb": probe.actuators.memory_quota_gb,
                "fraction_applied": probe.actuators.memory_fraction_applied,
            }
        )
    dsec.detach()


# ------------------------------------------------------------------------------------------------ memory watch
# The allocator cap for both runs, and where the slow climb's limit is final (at the ceiling).
WATCH_CAP_GB, WATCH_BURST_GB_PER_S, WATCH_CLIMB_GB_PER_S = 2.0, 0.4, 0.045


def check_memory_watch(ctx: dict[str, Any]) -> dict[str, Any]:
    """The drain and the burst snapshot on a real CUDA device (dsec.probe.device_memory): one probed process with
    snapshots, its allocator capped at 2 GiB by the probe (``set_per_process_memory_fraction``). A burst (0.4 GB/s of
    128 MiB tensors between optimizer steps) must be snapshotted as it rises — a snapshot whose manifest lists
    ``memory_burst``, at a step before the OOM and within the last ~2.5 s of steps — and then fail with the
    allocator's own ``torch.OutOfMemoryError``. A slow climb (0.045 GB/s) into the same cap, now final (at the
    ceiling), must end in the drain (``MemoryRecycle``, a ``memory_recycle`` snapshot) before any OOM."""
    admin = admin_client(ctx)
    pool = "gpu-memory-watch"
    token = pool_with_token(admin, pool)
    failures: list[str] = []
    runs: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-watch-") as tmp:
        snaps = Path(tmp) / "snaps"
        # Beats a minute apart: the control plane's quota plans must not move the cap the worker sets for the run.
        env = {**clean_env(), **probe_settings(ctx, pool, token, DSEC_SNAPSHOT_DIR=str(snaps),
                                               DSEC_HEARTBEAT_INTERVAL="60")}  # fmt: skip
        for kind, rate in (("burst", WATCH_BURST_GB_PER_S), ("climb", WATCH_CLIMB_GB_PER_S)):
            with Child("memory_watch", ctx, env, Path(tmp) / f"{kind}.log") as w:
                w.expect("registered", 60)
                # From 1 GB (the burst) or 1.7 GB (the climb: ~7 s to the cap) held.
                start = 1.0 if kind == "burst" else 1.7
                runs[kind] = w.request("grown", 90, cmd="grow", kind=kind, gb_per_s=rate, start_gb=start, seconds=30.0)
                w.send(cmd="exit")
        from dsec.snapshot import LocalDirStore
        from dsec.snapshot.reader import read_manifest

        store = LocalDirStore(snaps)
        manifests = [read_manifest(store, wk, seq) for wk in store.workers() for seq in store.manifests(wk)]
    asked = {r: [int(m["step"]) for m in manifests if r in (m.get("requests") or [])]
             for r in ("memory_burst", "memory_recycle")}  # fmt: skip
    burst, climb = runs["burst"], runs["climb"]
    if burst.get("stopped") != "OutOfMemoryError":
        failures.append(f"the burst ended in {burst.get('stopped')}, not torch.OutOfMemoryError")
    before = [s for s in asked["memory_burst"] if s <= int(burst.get("steps") or 0)]
    if not before:
        failures.append(f"no memory_burst snapshot before the burst's OOM (burst snapshots at {asked['memory_burst']})")
    elif int(burst["steps"]) - max(before) > burst["steps_per_s"] * 2.5:
        failures.append(f"the burst snapshot (step {max(before)}) was not in the last 2.5 s before the OOM")
    if climb.get("stopped") != "MemoryRecycle" or not asked["memory_recycle"]:
        failures.append(f"the slow climb ended in {climb.get('stopped')} ({asked['memory_recycle']} drain snapshots)")
    return verdict({"runs": runs, "snapshot_steps": asked}, failures)


def worker_memory_watch(ctx: dict[str, Any]) -> None:
    import torch

    import dsec
    from dsec.probe.recycle import MemoryRecycle

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.empty(1, device=device)  # the CUDA context: the probe reads only a device the training code initialised
    probe = dsec.attach()
    if probe is None:
        raise SystemExit("dsec.attach() returned None: DSEC_ENDPOINT / DSEC_SANDBOX_ID missing")
    wait_until(lambda: probe.reporter if probe.reporter and probe.reporter.worker_id else None, 30, "register")
    emit({"event": "registered"})
    model = torch.nn.Linear(512, 512).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512, device=device)
    chunk = CHUNK_MB << 20
    for cmd in commands():
        if cmd.get("cmd") == "exit":
            break
        a = probe.actuators
        # The cap (the grant, a limit above it for the burst; for the climb the limit is at the ceiling: final).
        burst = cmd["kind"] == "burst"
        a.memory_quota_gb, a.memory_limit_gb = 1.0, WATCH_CAP_GB
        a.memory_ceiling_gb = 1.5 if burst else WATCH_CAP_GB
        a._apply_memory_quota()
        blocks: list[Any] = []
        stopped: BaseException | None = None
        t0 = time.monotonic()
        steps = 0
        try:
            while time.monotonic() - t0 < float(cmd["seconds"]):
                want = (float(cmd["start_gb"]) + float(cmd["gb_per_s"]) * (time.monotonic() - t0)) * 2**30
                while len(blocks) * chunk < want:
                    blocks.append(torch.empty(chunk, dtype=torch.uint8, device=device))
                opt.zero_grad()
                model(x).square().mean().backward()
                opt.step()
                steps += 1
                time.sleep(0.01)
        except (torch.OutOfMemoryError, MemoryRecycle) as exc:
            stopped = exc
        elapsed = time.monotonic() - t0
        emit(
            {
                "event": "grown",
                "stopped": type(stopped).__name__ if stopped else None,
                "message": str(stopped)[:500] if stopped else None,
                "steps": probe.snapshots.steps if probe.snapshots is not None else None,
                "steps_per_s": steps / max(elapsed, 1e-6),
                "seconds": round(elapsed, 2),
                "held_gb": len(blocks) * chunk / 2**30,
                "reserved_gb": torch.cuda.memory_reserved(device) / 2**30,
                "fraction_applied": a.memory_fraction_applied,
            }
        )
        blocks.clear()
        torch.cuda.empty_cache()
    dsec.detach()


# ------------------------------------------------------------------------------------------------ probe
def check_probe(ctx: dict[str, Any]) -> dict[str, Any]:
    from dsec.control.server import free_port
    from dsec.probe.launch import probe_env

    cuda = ctx["device"] == "cuda"
    world = int(ctx["probe_world"])
    if cuda:
        import torch

        if world > torch.cuda.device_count():
            # NCCL rejects two ranks on one device ("Duplicate GPU detected"); say so rather than time out.
            raise Skip(f"--probe-world {world} needs {world} GPUs, this machine has {torch.cuda.device_count()}")
    admin = admin_client(ctx)
    runs: dict[str, dict[str, Any]] = {}
    cp_bytes: dict[str, float] = {}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-probe-") as tmp:
        for variant, bits in (("plain", None), ("32", 32), ("8", 8), ("4", 4)):
            env = clean_env()
            pool = f"gpu-probe-{variant}"
            if bits is not None:
                token = pool_with_token(admin, pool)
                env = probe_env(env, probe_settings(ctx, pool, token, DSEC_COMPRESSION_BITS=str(bits)))
            port = free_port()
            procs = []
            logs = []
            for rank in range(world):
                rank_env = {
                    **env,
                    "RANK": str(rank),
                    "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "GLOO_SOCKET_IFNAME": "lo",
                }
                logs.append(Path(tmp) / f"{variant}-{rank}.log")
                with logs[-1].open("wb") as fh:
                    cmd = [sys.executable, str(SCRIPT), "_worker", "ddp", json.dumps(ctx)]
                    procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=fh, text=True, env=rank_env))
            outs = []
            deadline = time.monotonic() + max(30.0, float(ctx["timeout_s"]) / 5)
            for rank, proc in enumerate(procs):
                try:
                    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    for p in procs:
                        p.kill()
                        p.wait()
                    out = ""
                outs.append((proc.returncode, last_json(out), logs[rank]))
            code, result, log = outs[0]
            if code != 0 or result is None or any(c != 0 for c, _, _ in outs):
                log = next((lg for c, _, lg in outs if c != 0), log)  # the first rank that failed says why
                tail = log.read_text(errors="replace")[-1500:]
                runs[variant] = {"ok": False, "exit": [c for c, _, _ in outs], "log_tail": tail}
                failures.append(f"the {variant} run failed (exit {[c for c, _, _ in outs]})")
                continue
            runs[variant] = result
            if bits is not None:

                def reported(pool: str = pool) -> dict[str, float] | None:
                    m = metrics_of(admin, pool)
                    return m if m.get("sync_ops_total") else None

                try:
                    m = wait_until(reported, 15, f"the {variant}-bit run's syncs at the control plane")
                    cp_bytes[variant] = m["sync_bytes_total"] / m["sync_ops_total"]
                except TimeoutError as exc:
                    failures.append(str(exc))
    step = {v: r["step_ms_median"] for v, r in runs.items() if "step_ms_median" in r}
    figures: dict[str, Any] = {
        "world_size": world,
        "backend": "nccl" if cuda else "gloo",
        "params": next((r["params"] for r in runs.values() if "params" in r), None),
        "step_ms_median": step,
        "bytes_per_sync": {k: round(v, 1) for k, v in cp_bytes.items()},
        "runs": runs,
    }
    if "plain" in step and "32" in step:
        figures["probe_overhead_ratio_32bit"] = round(step["32"] / step["plain"] - 1, 4)
    for bits, floor in (("4", 6.0), ("8", 3.0)):
        if "32" in cp_bytes and bits in cp_bytes:
            ratio = cp_bytes["32"] / cp_bytes[bits]
            figures[f"compression_ratio_{bits}bit"] = round(ratio, 3)
            if ratio < floor:
                failures.append(f"32-bit / {bits}-bit bytes per sync is {ratio:.2f}, expected >= {floor:g}")
        elif not failures:
            failures.append(f"no bytes per sync for 32 and {bits} bits at the control plane")
    return verdict(figures, failures)


def worker_ddp(ctx: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cuda = ctx["device"] == "cuda"
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if cuda:
        device = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    width, depth, batch = (2048, 6, 256) if cuda else (256, 2, 32)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).to(device)
    ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(rank)
    warmup, steps = (10 if cuda else 3), int(ctx["probe_steps"])
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        x = torch.randn(batch, width, device=device, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(torch, device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    result: dict[str, Any] = {
        "rank": rank,
        "params": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "step_ms_median": statistics.median(times) * 1e3,
        "step_ms_max": max(times) * 1e3,
    }
    if os.environ.get("DSEC_ENDPOINT"):
        import dsec

        probe = dsec.attached()
        if probe is not None:
            tel = probe.telemetry
            result.update(
                sync_ops_total=tel.sync_ops_total,
                sync_errors_total=tel.sync_errors_total,
                local_bytes_per_sync=tel.sync_bytes_total / max(1, tel.sync_ops_total),
                effective_bits=probe.actuators.effective_bits,
            )
    dist.destroy_process_group()
    emit(result)


# ------------------------------------------------------------------------------------------------ snapshot
def check_snapshot(ctx: dict[str, Any]) -> dict[str, Any]:
    import torch

    from dsec.snapshot import LocalDirStore, Snapshotter, codec

    device = torch.device("cuda", 0) if ctx["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    width = 4096 if device.type == "cuda" else 512
    depth = max(1, round(int(ctx["snapshot_params"]) / (width * width + width)))

    def build(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers).to(device)
        return model, torch.optim.Adam(model.parameters(), lr=1e-4)

    gen = torch.Generator(device=device).manual_seed(1)  # training data off the default generator (RNG check)

    def step(model: Any, opt: Any) -> float:
        t0 = time.perf_counter()
        loss = model(torch.randn(64, width, device=device, generator=gen)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(torch, device)
        return time.perf_counter() - t0

    model, opt = build(0)
    for _ in range(3):
        step(model, opt)  # Adam state exists
    with tempfile.TemporaryDirectory(prefix="gpu-check-snap-") as tmp:
        root = Path(tmp)
        store = LocalDirStore(root / "snapshots")
        snap = Snapshotter(store, "gpu-check", level=0, base_every=16)
        snap.register("model", model)
        snap.register("adam", opt)
        plain = [step(model, opt) for _ in range(3)]
        blocking, overlapped, stats = [], [], []
        for k in range(3):
            ticket = snap.take(step=k)
            overlapped.append(step(model, opt))  # its optimizer step waits for the snapshot's read, if unfinished
            blocking.append(ticket.blocking_s)  # final: the next optimizer step has begun
            if not ticket.wait(timeout=120) or ticket.error:
                raise RuntimeError(f"snapshot {k} failed: {ticket.error or 'not published within 120 s'}")
            stats.append(ticket.stats)
            step(model, opt)
        save_s = [torch_save(torch, model, opt, root / f"ckpt{i}.pt") for i in range(2)]
        ckpt_bytes = (root / "ckpt0.pt").stat().st_size
        final = snap.take(step=100, wait=True)  # the reference: nothing trains after it
        expected_rng = torch.rand(4096, device=device)  # the first draw after the snapshot
        snap.close()
        if final.error:
            raise RuntimeError(f"the final snapshot failed: {final.error}")
        fresh_model, fresh_opt = build(7)
        reader = Snapshotter(LocalDirStore(store.root), "gpu-check", level=0)
        reader.register("model", fresh_model)
        reader.register("adam", fresh_opt)
        if device.type == "cuda":
            torch.cuda.manual_seed(12345)
        torch.manual_seed(12345)
        t0 = time.perf_counter()
        report = reader.restore_latest()
        sync(torch, device)
        restore_wall_s = time.perf_counter() - t0
        restored_rng = torch.rand(4096, device=device)
        reader.close()
    if report is None:
        raise RuntimeError("restore_latest() found no snapshot")
    mismatches = state_mismatches(torch, model, opt, fresh_model, fresh_opt)
    pinned = codec.host_copy(next(model.parameters())).is_pinned() if device.type == "cuda" else None
    failures = []
    if report.seq != final.seq:
        failures.append(f"restored snapshot {report.seq}, expected the last one ({final.seq})")
    if mismatches:
        failures.append(f"{len(mismatches)} tensors differ after a level-0 restore, e.g. {mismatches[:3]}")
    if not torch.equal(expected_rng, restored_rng):
        failures.append(f"the {device.type} RNG draws after the restore differ from those after the snapshot")
    blocking_ms = statistics.median(blocking) * 1e3
    save_ms = statistics.median(save_s) * 1e3
    figures = {
        "params": sum(p.numel() for p in model.parameters()),
        "state_bytes": ckpt_bytes,
        "level": 0,
        "blocking_ms": [round(b * 1e3, 3) for b in blocking],
        "blocking_ms_median": round(blocking_ms, 3),
        "torch_save_ms": [round(s * 1e3, 1) for s in save_s],
        "torch_save_over_blocking": round(save_ms / blocking_ms, 1) if blocking_ms > 0 else None,
        "snapshot_total_ms": [s.get("total_ms") for s in stats],
        "snapshot_stored_bytes": [s.get("stored_bytes") for s in stats],
        "plain_step_ms": round(statistics.median(plain) * 1e3, 3),
        "overlapped_step_ms": round(statistics.median(overlapped) * 1e3, 3),
        "restore_s": round(report.restore_s, 3),
        "restore_wall_s": round(restore_wall_s, 3),
        "bit_exact": not mismatches,
        "mismatches": mismatches[:10],
        "rng_restored": torch.equal(expected_rng, restored_rng),
        "host_copy_pinned": pinned,
    }
    if device.type == "cuda":
        figures["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    return verdict(figures, failures)


def torch_save(torch: Any, model: Any, opt: Any, path: Path) -> float:
    """A synchronous checkpoint of the same state, as benchmarks/snapshot_vs_checkpoint.py takes it."""
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    return time.perf_counter() - t0


def state_mismatches(torch: Any, model: Any, opt: Any, other: Any, other_opt: Any) -> list[str]:
    """Names of parameters, buffers and optimizer-state values that differ in bits, dtype or device."""

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, torch.Tensor):
            ok = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            return ok and torch.equal(a, b)
        return bool(a == b)

    theirs_model = other.state_dict()
    bad = [f"model/{k}" for k, v in model.state_dict().items() if not same(v, theirs_model.get(k))]
    mine, theirs = opt.state_dict()["state"], other_opt.state_dict()["state"]
    for idx, values in mine.items():
        bad += [f"adam/{idx}/{k}" for k, v in values.items() if not same(v, theirs.get(idx, {}).get(k))]
    return bad


# ------------------------------------------------------------------------------------------------ inject
NATIVE_SO = REPO / "build" / "native" / "libdsec_inject.so"
NATIVE_SOURCES = (REPO / "native" / "dsec_inject.c", REPO / "native" / "dsec_inject.h")
NCCL_FLOAT32, NCCL_SUM = 7, 0  # ncclDataType_t / ncclRedOp_t (nccl.h)


def native_library() -> Path:
    """``build/native/libdsec_inject.so``, built with ``make native`` when missing or older than its sources."""
    newest = max(p.stat().st_mtime for p in NATIVE_SOURCES)
    if NATIVE_SO.is_file() and NATIVE_SO.stat().st_mtime >= newest:
        return NATIVE_SO
    if shutil.which("gcc") is None or shutil.which("make") is None:
        raise Skip(f"{NATIVE_SO.relative_to(REPO)} is missing or stale and gcc/make are not here to build it")
    proc = subprocess.run(["make", "native"], cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    if proc.returncode != 0 or not NATIVE_SO.is_file():
        raise RuntimeError(f"make native failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return NATIVE_SO


def cuda_libraries() -> dict[str, Any]:
    """The libcudart and libnccl to call: those torch loaded (``/proc/self/maps`` after ``import torch``), else the
    nvidia-* wheels on sys.path, else what the dynamic linker finds."""
    import ctypes.util

    import torch

    found: dict[str, Any] = {"torch_cuda": torch.version.cuda}
    maps = Path("/proc/self/maps").read_text().splitlines()
    for key, pattern in (("cudart", r"/libcudart\.so[.\d]*$"), ("nccl", r"/libnccl\.so[.\d]*$")):
        loaded = sorted({ln.split()[-1] for ln in maps if re.search(pattern, ln)})
        if loaded:
            found[key], found[f"{key}_source"] = loaded[0], "loaded by torch"
            continue
        globs = ("nvidia/*/lib/libcudart.so*", "torch/lib/libcudart*.so*")
        if key == "nccl":
            globs = ("nvidia/nccl/lib/libnccl.so*", "torch/lib/libnccl*.so*")
        wheel = sorted(str(p) for d in sys.path if d and Path(d).is_dir() for g in globs for p in Path(d).glob(g))
        if wheel:
            found[key], found[f"{key}_source"] = wheel[0], "python wheel"
            continue
        system = ctypes.util.find_library(key)
        found[key], found[f"{key}_source"] = system, "system" if system else "not found"
    return found


# --device cpu: stand-ins with the calls worker_inject_ctypes makes (malloc-backed memory, memcpy "all-reduce"), named
# and sonamed like the real libraries. They prove this script's plumbing, nothing about CUDA.
STUB_CUDART = r"""
#include <stdlib.h>
#include <string.h>
int cudaSetDevice(int device) { return device == 0 ? 0 : 101; }
int cudaMalloc(void **ptr, size_t size) { *ptr = malloc(size ? size : 1); return *ptr ? 0 : 2; }
int cudaFree(void *ptr) { free(ptr); return 0; }
int cudaMemset(void *ptr, int value, size_t size) { memset(ptr, value, size); return 0; }
int cudaDeviceSynchronize(void) { return 0; }
"""
STUB_NCCL = r"""
#include <string.h>
int ncclGetVersion(int *version) { *version = 0; return 0; }
int ncclCommInitAll(void **comms, int n, const int *devices) {
    (void)devices;
    for (int i = 0; i < n; i++) comms[i] = (void *)comms;
    return 0;
}
int ncclAllReduce(const void *send, void *recv, size_t count, int type, int op, void *comm, void *stream) {
    (void)op; (void)comm; (void)stream;
    if (type != 7) return 4; /* float32 only: ncclInvalidArgument */
    memcpy(recv, send, count * 4);
    return 0;
}
int ncclCommDestroy(void *comm) { (void)comm; return 0; }
"""


def stub_libraries(where: Path) -> dict[str, Any]:
    gcc = shutil.which("gcc")
    if gcc is None:
        raise Skip("--device cpu: gcc is needed to build the stub CUDA/NCCL libraries")
    found: dict[str, Any] = {}
    for key, name, source in (("cudart", "libcudart.so.12", STUB_CUDART), ("nccl", "libnccl.so.2", STUB_NCCL)):
        (where / f"{key}.c").write_text(source)
        cmd = [gcc, "-shared", "-fPIC", "-O2", f"-Wl,-soname,{name}", "-o", str(where / name), str(where / f"{key}.c")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"building the {key} stub failed: {proc.stderr[-1000:]}")
        found[key], found[f"{key}_source"] = str(where / name), "stub built by gpu_check (--device cpu)"
    return found


def check_inject(ctx: dict[str, Any]) -> dict[str, Any]:
    cuda = ctx["device"] == "cuda"
    so = native_library()
    admin = admin_client(ctx)
    out: dict[str, Any] = {"library": str(so.relative_to(REPO))}
    failures: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-inject-") as tmp:
        libs = cuda_libraries() if cuda else stub_libraries(Path(tmp))
        out["libraries"] = libs
        if not libs.get("cudart"):
            raise RuntimeError("no libcudart found (neither loaded by torch, in a wheel, nor on the system)")
        for kind in ("inject_ctypes", "inject_torch") if cuda else ("inject_ctypes",):
            pool = f"gpu-{kind.replace('_', '-')}"
            token = pool_with_token(admin, pool)
            env = {
                **clean_env(),
                **probe_settings(ctx, pool, token),
                "LD_PRELOAD": str(so),
                "DSEC_NAME": f"gpu-check-{kind}",
                "DSEC_DEBUG": "1",  # stderr says where each real function was resolved
                "DSEC_CUDART_LIB": str(libs["cudart"]),
            }
            if libs.get("nccl"):
                env["DSEC_NCCL_LIB"] = str(libs["nccl"])
            log = Path(tmp) / f"{kind}.log"
            part: dict[str, Any]
            try:
                with Child(kind, {**ctx, **libs}, env, log) as w:
                    did = w.expect("done", 90)

                    def arrived(pool: str = pool, did: dict[str, Any] = did) -> dict[str, float] | None:
                        m = metrics_of(admin, pool)
                        ok = m.get("cuda_malloc_count_total", 0) >= did["min_mallocs"]
                        ok = ok and m.get("nccl_allreduce_count_total", 0) >= did["allreduces"]
                        return m if ok else None

                    try:
                        m = wait_until(arrived, 15, "the counts at the control plane")
                    except TimeoutError as exc:
                        m = metrics_of(admin, pool)  # what did arrive: the comparison below names the gap
                        did["timeout"] = str(exc)
                    w.send(cmd="exit")
                    w.close()
                part = {"process": did, "control_plane": {k: v for k, v in m.items() if k.startswith(("cuda", "nccl"))}}
            except Exception as exc:
                part = {"error": f"{type(exc).__name__}: {exc}"}
                if kind == "inject_ctypes":
                    failures.append(part["error"])
            text = log.read_text(errors="replace") if log.exists() else ""
            part["resolved"] = [ln for ln in text.splitlines() if "resolved" in ln or "no real implementation" in ln]
            out[kind.removeprefix("inject_")] = part
    raw = out.get("ctypes", {})
    if "process" in raw:
        p, cp = raw["process"], raw["control_plane"]
        expect = {
            "cuda_malloc_count_total": (p["mallocs"], ">="),
            "cuda_malloc_bytes_total": (p["malloc_bytes"], ">="),
            "cuda_free_count_total": (p["frees"], ">="),
            "cuda_allocated_bytes": (p["live_bytes"], ">="),  # frees found their allocation's size
            "nccl_allreduce_count_total": (p["allreduces"], "=="),
            "nccl_allreduce_bytes_total": (p["allreduce_bytes"], "=="),
        }
        for metric, (want, how) in expect.items():
            got = cp.get(metric)
            if got is None or (got < want if how == ">=" else got != want):
                failures.append(f"{metric}: control plane has {got}, the process did {want} ({how})")
        for fn, provider in p["providers"].items():
            if not str(provider).endswith("libdsec_inject.so"):
                failures.append(f"{fn} in the global scope is {provider}, not libdsec_inject.so")
    torch_part = out.get("torch", {})
    if "process" in torch_part:
        p, cp = torch_part["process"], torch_part["control_plane"]
        torch_part["ok"] = (
            cp.get("cuda_malloc_count_total", 0) >= p["min_mallocs"]
            and cp.get("nccl_allreduce_count_total", 0) >= p["allreduces"]
        )
    return verdict(out, failures)


def _dladdr_name(address: int) -> str | None:
    """The file of the shared object that holds ``address`` (dladdr)."""

    class DlInfo(ctypes.Structure):
        _fields_ = [
            ("dli_fname", ctypes.c_char_p),
            ("dli_fbase", ctypes.c_void_p),
            ("dli_sname", ctypes.c_char_p),
            ("dli_saddr", ctypes.c_void_p),
        ]

    dladdr = None
    for lib in (None, "libdl.so.2"):  # in libc since glibc 2.34, in libdl before
        with contextlib.suppress(OSError, AttributeError):
            dladdr = ctypes.CDLL(lib).dladdr
            break
    if dladdr is None:
        return None
    info = DlInfo()
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return str(info.dli_fname.decode())


def worker_inject_ctypes(ctx: dict[str, Any]) -> None:
    """A host program calling the real CUDA runtime and NCCL by their global names, as a linked program would: the
    dynamic linker resolves them to the preloaded library first (ctypes.CDLL(None) is the global scope)."""
    mode = os.RTLD_NOW | os.RTLD_GLOBAL
    cudart = ctypes.CDLL(ctx["cudart"], mode=mode)
    nccl = ctypes.CDLL(ctx["nccl"], mode=mode) if ctx.get("nccl") else None
    scope = ctypes.CDLL(None)
    providers = {}
    for name in ("cudaMalloc", "cudaFree", "ncclAllReduce"):
        fn = getattr(scope, name, None)
        address = ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else None
        providers[name] = _dladdr_name(address) if address else None
    malloc, free = scope.cudaMalloc, scope.cudaFree
    malloc.argtypes, malloc.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], ctypes.c_int
    free.argtypes, free.restype = [ctypes.c_void_p], ctypes.c_int

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise SystemExit(f"{what} returned {rc}")

    check(cudart.cudaSetDevice(0), "cudaSetDevice")
    sizes = [(i + 1) << 20 for i in range(8)]
    ptrs = []
    for size in sizes:
        ptr = ctypes.c_void_p()
        check(malloc(ctypes.byref(ptr), size), "cudaMalloc")
        ptrs.append(ptr)
    for ptr in ptrs[:5]:
        check(free(ptr), "cudaFree")
    mallocs, frees, malloc_bytes = len(sizes), 5, sum(sizes)
    allreduces = allreduce_bytes = 0
    nccl_version = None
    if nccl is not None:
        version = ctypes.c_int()
        nccl.ncclGetVersion(ctypes.byref(version))
        nccl_version = version.value
        comm = ctypes.c_void_p()
        devices = (ctypes.c_int * 1)(0)
        check(nccl.ncclCommInitAll(ctypes.byref(comm), 1, devices), "ncclCommInitAll")
        count = 1 << 20
        send, recv = ctypes.c_void_p(), ctypes.c_void_p()
        check(malloc(ctypes.byref(send), count * 4), "cudaMalloc")
        check(malloc(ctypes.byref(recv), count * 4), "cudaMalloc")
        check(cudart.cudaMemset(send, 0, ctypes.c_size_t(count * 4)), "cudaMemset")
        allreduce = scope.ncclAllReduce
        allreduce.argtypes = (
            [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 2
        )
        allreduce.restype = ctypes.c_int
        for _ in range(5):
            check(allreduce(send, recv, count, NCCL_FLOAT32, NCCL_SUM, comm, None), "ncclAllReduce")
        check(cudart.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        nccl.ncclCommDestroy(comm)
        check(free(send), "cudaFree")
        check(free(recv), "cudaFree")
        mallocs, frees, malloc_bytes = mallocs + 2, frees + 2, malloc_bytes + 2 * count * 4
        allreduces, allreduce_bytes = 5, 5 * count * 4
    emit(
        {
            "event": "done",
            "providers": providers,
            "mallocs": mallocs,
            "min_mallocs": mallocs,
            "malloc_bytes": malloc_bytes,
            "frees": frees,
            "live_bytes": sum(sizes[5:]),
            "allreduces": allreduces,
            "allreduce_bytes": allreduce_bytes,
            "nccl_version": nccl_version,
        }
    )
    for cmd in commands():
        if cmd.get("cmd") == "exit":
            break


def worker_inject_torch(ctx: dict[str, Any]) -> None:
    """The same under torch: the caching allocator's cudaMalloc/cudaFree and ProcessGroupNCCL's ncclAllReduce."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    blocks = [torch.empty(64 << 20, dtype=torch.uint8, device=device) for _ in range(4)]
    del blocks[:2]
    torch.cuda.empty_cache()  # gives the two freed segments back: cudaFree
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(1 << 20, device=device)
    for _ in range(3):
        dist.all_reduce(t)
    torch.cuda.synchronize(device)
    stats = torch.cuda.memory_stats(device)
    emit(
        {
            "event": "done",
            "min_mallocs": int(stats.get("segment.all.allocated", 0)),
            "segments_freed": int(stats.get("segment.all.freed", 0)),
            "allreduces": 3,
            "allreduce_bytes": 3 * t.numel() * 4,
        }
    )
    for cmd in commands():
        if cmd.get("cmd") == "exit":
            break
    dist.destroy_process_group()


CHECK_FUNCS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "nvml": check_nvml,
    "quota": check_quota,
    "probe": check_probe,
    "snapshot": check_snapshot,
    "inject": check_inject,
    "memory_watch": check_memory_watch,
}
WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "quota": worker_quota,
    "ddp": worker_ddp,
    "inject_ctypes": worker_inject_ctypes,
    "inject_torch": worker_inject_torch,
    "memory_watch": worker_memory_watch,
}


if __name__ == "__main__":
    sys.exit(main())
