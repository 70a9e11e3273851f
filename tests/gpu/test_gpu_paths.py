"""DSec's GPU paths on a real device (issue 23), through ``benchmarks/gpu_check.py``.

NOT YET RUN ON A GPU: written on a machine without one, where the ``gpu`` tests skip. Each of them runs one check of
the script in its own processes (``--only CHECK``: a real control plane, real CUDA/NCCL) and asserts on the check's
JSON report. The other tests need no GPU and run in CI: the skip path (CUDA hidden with ``CUDA_VISIBLE_DEVICES=""``,
so they also run on GPU machines), argument errors, the ``nvidia-smi`` parsers, and a CPU self-check of the
script's plumbing (the probe over gloo, a small snapshot).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import load_module

try:
    import torch
except ImportError:  # the skip path must still work: the script reports "torch is not installed"
    torch = None

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = ["nvml", "quota", "probe", "snapshot", "inject", "memory_watch"]
HAS_CUDA = torch is not None and torch.cuda.is_available()


def needs_gpu(test: Any) -> Any:
    """Marked ``gpu`` and skipped without CUDA. The timeout covers one check in a fresh process tree: `import
    torch`, CUDA/NCCL start-up and, for the probe, four DDP runs."""
    for mark in (pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device"), pytest.mark.timeout(600)):
        test = mark(test)
    return test


def run_raw(*args: str, cuda_visible: str | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_") and k != "LD_PRELOAD"}
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False)


def run_script(*args: str, cuda_visible: str | None = None, timeout: float = 120) -> tuple[Any, dict[str, Any]]:
    proc = run_raw(*args, cuda_visible=cuda_visible, timeout=timeout)
    lines = proc.stdout.strip().splitlines()
    assert lines, f"no output (exit {proc.returncode}); stderr ends: {proc.stderr[-3000:]}"
    return proc, dict(json.loads(lines[-1]))


def load_script() -> ModuleType:
    return load_module("gpu_check", SCRIPT)


# -- without a GPU ------------------------------------------------------------------------------------------
def test_without_cuda_every_check_is_skipped_with_a_reason(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc, report = run_script("--out", str(out), cuda_visible="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(proc.stdout.strip().splitlines()) == 1, "stdout must hold the JSON line only"
    assert list(report["checks"]) == CHECKS
    for name, result in report["checks"].items():
        assert set(result) == {"skipped"}, (name, result)
        reason = result["skipped"]
        assert "no CUDA device" in reason or "torch is not installed" in reason, (name, reason)
    assert report["ok"] is True
    assert report["ran"] == [] and report["failed"] == [] and report["skipped"] == CHECKS
    assert json.loads(out.read_text()) == report


def test_only_names_the_checks_to_run_in_order_once() -> None:
    proc, report = run_script("--only", "snapshot, nvml,snapshot", cuda_visible="")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(report["checks"]) == ["snapshot", "nvml"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--only", "nvml,bogus"), "expected a comma-separated list of nvml, quota, probe, snapshot, inject"),
        (("--only", ","), "expected a comma-separated list"),
        (("--budget-s", "0"), "--budget-s=0.0: expected a positive number"),
        (("--probe-world", "-1"), "--probe-world=-1: expected a positive number"),
        (("--device", "tpu"), "invalid choice: 'tpu'"),
    ],
)
def test_bad_arguments_are_usage_errors(args: tuple[str, ...], message: str) -> None:
    proc = run_raw(*args, cuda_visible="")
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert proc.stdout == ""


SMI_Q = """
==============NVSMI LOG==============

Timestamp                                 : Mon Jan  6 10:00:00 2025
Driver Version                            : 550.54.15
CUDA Version                              : 12.4

Attached GPUs                             : 2
GPU 00000000:18:00.0
    Product Name                          : NVIDIA H200
    PCI
        Bus                               : 0x18
        Bus Id                            : 00000000:18:00.0
    FB Memory Usage
        Total                             : 143771 MiB
        Reserved                          : 551 MiB
        Free                              : 143219 MiB
    BAR1 Memory Usage
        Total                             : 262144 MiB
    Clocks Event Reasons
        Idle                              : Active
        Applications Clocks Setting       : Not Active
        SW Power Cap                      : Active
        HW Slowdown                       : Not Active
        HW Thermal Slowdown               : Not Active

GPU 00000000:2A:00.0
    Product Name                          : NVIDIA H200
    FB Memory Usage
        Total                             : 143771 MiB
    Clocks Throttle Reasons
        Idle                              : Not Active
        HW Thermal Slowdown               : Active
"""

TOPO = (
    "\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\t0-47\t0\t\tN/A\n"
    "GPU1\tNV18\t X \t0-47\t0\t\tN/A\n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)


def test_nvidia_smi_parsers_read_the_fields_the_nvml_check_compares() -> None:
    """Against text written after the documented layout of ``nvidia-smi -q`` / ``topo -m`` (no real output here)."""
    gc = load_script()
    gpus = gc.parse_smi_q(SMI_Q)
    assert [g["Bus Id"] for g in gpus] == ["00000000:18:00.0", "00000000:2A:00.0"]
    assert gc.smi_value(gpus[0], "Product Name") == "NVIDIA H200"
    assert gc.smi_value(gpus[0], "FB Memory Usage/Total") == "143771 MiB"  # not BAR1's Total
    assert gc.smi_reasons(gpus[0]) == 0x1 | 0x4  # idle + SW power cap
    assert gc.smi_reasons(gpus[1]) == 0x40  # the older "Clocks Throttle Reasons" heading
    assert gc.parse_topo(TOPO) == {0: {1}, 1: {0}}
    assert gc.parse_topo("no matrix here") is None


def test_nvml_check_compares_dsec_inventory_with_nvidia_smi() -> None:
    """The comparison logic, driven by DSec's own NVML stand-in and the canned nvidia-smi text above."""
    from dsec.scheduler.fake_nvml import FakeGpu, FakeNvml

    gc = load_script()
    smi = {"-q": SMI_Q, "topo": TOPO}

    def run(cmd: list[str]) -> str | None:
        return smi.get(cmd[1])

    h200 = {"name": "NVIDIA H200", "memory_gb": 140.4, "numa_node": 0}
    fake = FakeNvml([FakeGpu(**h200, nvlink_to=[1], throttle_reasons=0x4), FakeGpu(**h200, nvlink_to=[0])])
    result = gc.check_nvml({}, binding=(fake, "fake"), run=run, numa_of=lambda bus: 0)
    assert result["ok"], result["failures"]
    first = result["devices"][0]
    assert first["match"] == {"name": True, "memory": True, "numa_node": True, "nvlink_peers": True}
    assert first["dsec"]["throttle_reasons"] == 0x4 and first["nvidia_smi"]["trouble_reasons"] == 0x4
    assert first["nvidia_smi"]["memory_gb"] == 140.4

    wrong = FakeNvml([FakeGpu(**{**h200, "numa_node": None}, nvlink_to=[]), FakeGpu(**h200, nvlink_to=[0])])
    result = gc.check_nvml({}, binding=(wrong, "fake"), run=run, numa_of=lambda bus: 1)
    assert not result["ok"]
    assert any("numa_node differs" in f for f in result["failures"])
    assert any("gpu0: nvlink_peers differs" in f for f in result["failures"])

    result = gc.check_nvml({}, binding=(fake, "fake"), run=lambda cmd: None, numa_of=lambda bus: 0)
    assert result["failures"] == ["nvidia-smi -q did not run: nothing to compare the inventory with"]


@pytest.mark.timeout(600)
@pytest.mark.slow  # ~26 s: the whole GPU script on CPU; run it (make test-slow) before a device check
def test_cpu_self_check_runs_the_same_orchestration_without_a_gpu() -> None:
    """``--device cpu``: the orchestration a GPU run uses (control plane, `dsec run` DDP workers, the quota's directive
    round trip, LD_PRELOAD of libdsec_inject.so, snapshot and restore) over gloo, CPU tensors and stub CUDA/NCCL
    libraries. It proves the script's plumbing, nothing about GPUs."""
    args = ("--device", "cpu", "--probe-steps", "5", "--snapshot-params", "300000", "--budget-s", "500")
    proc, report = run_script(*args, timeout=560)
    checks = report["checks"]
    assert checks["nvml"]["skipped"].startswith("--device cpu"), checks["nvml"]
    assert checks["memory_watch"]["skipped"].startswith("--device cpu"), checks["memory_watch"]

    probe = checks["probe"]
    assert probe.get("ok"), probe
    assert probe["backend"] == "gloo" and probe["world_size"] == 1
    assert set(probe["bytes_per_sync"]) == {"32", "8", "4"}
    assert probe["compression_ratio_4bit"] >= 6 and probe["compression_ratio_8bit"] >= 3
    for bits in ("32", "8", "4"):
        run = probe["runs"][bits]
        assert run["effective_bits"] == int(bits) and run["sync_errors_total"] == 0 and run["sync_ops_total"] > 0
    assert "sync_ops_total" not in probe["runs"]["plain"]  # the baseline ran without the probe

    snap = checks["snapshot"]
    assert snap.get("ok"), snap
    assert snap["bit_exact"] and snap["rng_restored"] and snap["mismatches"] == []
    assert snap["blocking_ms_median"] >= 0 and min(snap["torch_save_ms"]) > 0 and snap["restore_s"] > 0

    quota = checks["quota"]
    assert quota.get("ok"), quota
    assert quota["under_quota"]["quota_gb"] == 2.0 and quota["after_raise"]["quota_gb"] == 6.0
    assert quota["control_plane_under_quota"]["memory_quota_gb"] == 2.0
    assert quota["control_plane_after_raise"]["memory_quota_gb"] == 6.0

    inject = checks["inject"]
    if "skipped" in inject:  # no gcc for the stubs, or no build/native/libdsec_inject.so and no gcc to build it
        assert shutil.which("gcc") is None, inject
    else:
        assert inject.get("ok"), inject
        did, seen = inject["ctypes"]["process"], inject["ctypes"]["control_plane"]
        assert set(did["providers"].values()) == {str(ROOT / "build" / "native" / "libdsec_inject.so")}
        assert seen["cuda_malloc_count_total"] == did["mallocs"] and seen["cuda_free_count_total"] == did["frees"]
        assert seen["cuda_allocated_bytes"] == did["live_bytes"]
        assert seen["nccl_allreduce_bytes_total"] == did["allreduce_bytes"] > 0
    assert proc.returncode == 0 and report["ok"], report["failed"]


# -- on a GPU -----------------------------------------------------------------------------------------------
def gpu_check(name: str) -> dict[str, Any]:
    """Run one check on the GPU; skip when the script itself skipped it (it says why), fail on its errors."""
    _, report = run_script("--only", name, timeout=580)
    result = dict(report["checks"][name])
    if "skipped" in result:
        pytest.skip(f"gpu_check skipped {name}: {result['skipped']}")
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}"
    return result


@needs_gpu
def test_nvml_inventory_matches_nvidia_smi() -> None:
    result = gpu_check("nvml")
    assert result["devices"], "discover_nvml found no device"
    for row in result["devices"]:
        assert row["dsec"]["memory_gb"] > 0, row
        assert "match" in row, f"nothing from nvidia-smi -q to compare with: {row}"
        assert all(row["match"].values()), row
    assert result["ok"], result["failures"]


@needs_gpu
def test_memory_quota_oom_is_the_process_own_and_a_raised_quota_lets_it_continue() -> None:
    result = gpu_check("quota")
    under, raised = result["under_quota"], result["after_raise"]
    assert under["oom"] and under["oom_type"] == "OutOfMemoryError", under
    assert 1.5 <= under["held_gb"] <= 2.0, under
    assert under["device_free_gb"] > 1.0, "the card itself was full: the OOM says nothing about the quota"
    seen = result["control_plane_under_quota"]
    assert seen["memory_quota_gb"] == 2.0 and 0 < seen["memory_used_gb"] <= 2.01, seen
    assert not raised["oom"] and raised["held_gb"] >= 3.0, raised
    seen = result["control_plane_after_raise"]
    assert seen["memory_quota_gb"] == 6.0 and seen["memory_used_gb"] >= 2.99, seen
    assert result["ok"], result["failures"]


@needs_gpu
def test_comm_hook_over_nccl_compresses_bytes_per_sync() -> None:
    result = gpu_check("probe")
    assert result["backend"] == "nccl"
    sent = result["bytes_per_sync"]
    assert set(sent) == {"32", "8", "4"}, result["failures"]
    assert sent["32"] / sent["4"] >= 6, sent
    assert sent["32"] / sent["8"] >= 3, sent
    for bits in ("32", "8", "4"):
        run = result["runs"][bits]
        assert run["effective_bits"] == int(bits) and run["sync_errors_total"] == 0, run
    assert isinstance(result["probe_overhead_ratio_32bit"], float)
    assert result["ok"], result["failures"]


@needs_gpu
def test_snapshot_of_a_100m_model_on_the_gpu_restores_bit_exact() -> None:
    result = gpu_check("snapshot")
    assert result["params"] >= 90_000_000
    assert result["bit_exact"], result["mismatches"]
    assert result["rng_restored"], "the CUDA RNG did not come back with the snapshot"
    assert result["blocking_ms_median"] > 0 and min(result["torch_save_ms"]) > 0 and result["restore_s"] > 0
    assert result["ok"], result["failures"]


@needs_gpu
def test_inject_library_reports_real_cuda_allocations_and_nccl_allreduce() -> None:
    result = gpu_check("inject")
    raw = result["ctypes"]
    assert "process" in raw, raw.get("error")
    did, seen = raw["process"], raw["control_plane"]
    assert all(str(p).endswith("libdsec_inject.so") for p in did["providers"].values()), did["providers"]
    assert seen.get("cuda_malloc_count_total", 0) >= did["mallocs"], seen
    assert seen.get("cuda_malloc_bytes_total", 0) >= did["malloc_bytes"], seen
    assert seen.get("cuda_free_count_total", 0) >= did["frees"], seen
    assert did["allreduces"] == 5, "NCCL was not found: no all-reduce was made"
    assert seen.get("nccl_allreduce_count_total") == did["allreduces"], seen
    assert seen.get("nccl_allreduce_bytes_total") == did["allreduce_bytes"], seen
    assert result["ok"], result["failures"]


@needs_gpu
def test_the_burst_snapshot_and_the_drain_read_the_cuda_allocator() -> None:
    result = gpu_check("memory_watch")
    burst, climb = result["runs"]["burst"], result["runs"]["climb"]
    assert burst["stopped"] == "OutOfMemoryError" and burst["fraction_applied"], burst
    assert any(s <= burst["steps"] for s in result["snapshot_steps"]["memory_burst"]), result["snapshot_steps"]
    assert climb["stopped"] == "MemoryRecycle" and result["snapshot_steps"]["memory_recycle"], climb
    assert result["ok"], result["failures"]
