"""libdsec_inject.so (native/, docs/native.md) against a real control plane, without a GPU.

Stub ``cudaMalloc``/``cudaFree`` (malloc-backed; an absurd size fails) and ``ncclAllReduce`` (memcpy and a short
sleep) are built here as shared libraries; test programs linked against them run under
``LD_PRELOAD=build/native/libdsec_inject.so`` and what they did is read back through the admin API.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, wait_for
from dsec.control.server import free_port
from dsec.integrations import native

ROOT = Path(__file__).resolve().parents[2]
SO = ROOT / "build" / "native" / "libdsec_inject.so"
SOURCES = (ROOT / "native" / "dsec_inject.c", ROOT / "native" / "dsec_inject.h")
GCC = shutil.which("gcc")

pytestmark = [
    pytest.mark.skipif(GCC is None, reason="gcc not found: the stub CUDA/NCCL libraries and test programs need it"),
    pytest.mark.skipif(not SO.is_file(), reason=f"{SO.relative_to(ROOT)} is missing: run `make native` (needs gcc)"),
]

CUDART_STUB = r"""
#include <stdlib.h>
int cudaMalloc(void **ptr, size_t size) {
    if (ptr == NULL) return 1;                                /* cudaErrorInvalidValue */
    if (size > ((size_t)1 << 40)) { *ptr = NULL; return 2; }  /* cudaErrorMemoryAllocation */
    *ptr = malloc(size ? size : 1);
    return *ptr ? 0 : 2;
}
int cudaFree(void *ptr) { free(ptr); return 0; }
"""

NCCL_STUB = r"""
#include <string.h>
#include <unistd.h>
int ncclAllReduce(const void *send, void *recv, size_t count, int datatype, int op, void *comm, void *stream) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    (void)op; (void)comm; (void)stream;
    if (datatype < 0 || datatype > 9) return 4;               /* ncclInvalidArgument */
    memcpy(recv, send, count * sizes[datatype]);
    usleep(2000);
    return 0;
}
"""

# Linked against the stubs and against libdsec_inject itself (episodes through the real API). Phase 1, then
# it waits for stdin to close, then phase 2 and exit.
LINKED_PROGRAM = r"""
#include <stdio.h>
#include <string.h>
#include "dsec_inject.h"
int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
int ncclAllReduce(const void *, void *, size_t, int, int, void *, void *);

int main(void) {
    if (dsec_init(NULL, "ignored-when-preloaded") != 0) return 10;
    void *p[4] = {0};
    size_t sizes[4] = {1 << 20, 3 << 20, 4096, 12345};
    for (int i = 0; i < 4; i++) if (cudaMalloc(&p[i], sizes[i]) != 0 || p[i] == NULL) return 11;
    void *huge = (void *)1;
    if (cudaMalloc(&huge, (size_t)1 << 50) == 0) return 12;
    if (cudaFree(p[0]) != 0 || cudaFree(p[1]) != 0) return 13;
    float a[256], b[256];
    double c[128], d[128];
    for (int i = 0; i < 256; i++) a[i] = (float)i;
    for (int i = 0; i < 128; i++) c[i] = i * 0.5;
    for (int k = 0; k < 5; k++) if (ncclAllReduce(a, b, 256, 7 /* ncclFloat32 */, 0, NULL, NULL) != 0) return 14;
    if (ncclAllReduce(c, d, 128, 8 /* ncclFloat64 */, 0, NULL, NULL) != 0) return 15;
    if (memcmp(a, b, sizeof a) != 0 || memcmp(c, d, sizeof c) != 0) return 16;
    dsec_report_episode_end(2.0, 20);
    dsec_report_episode_end(2.0, 20);
    while (getchar() != EOF) {}
    void *q = NULL;
    if (cudaMalloc(&q, 1000) != 0) return 17;
    dsec_report_episode_end(5.0, 50);
    printf("ok\n");
    return 0;
}
"""

# Not linked against any CUDA/NCCL library: the symbols come from the preloaded library (weak references,
# NULL without it). With arguments, it first dlopens them RTLD_LOCAL, so RTLD_NEXT cannot see them.
UNLINKED_PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
int cudaMalloc(void **ptr, size_t size) __attribute__((weak));
int cudaFree(void *ptr) __attribute__((weak));
int ncclAllReduce(const void *, void *, size_t, int, int, void *, void *) __attribute__((weak));

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) if (dlopen(argv[i], RTLD_NOW | RTLD_LOCAL) == NULL) return 20;
    if (!cudaMalloc || !cudaFree || !ncclAllReduce) return 21;
    void *p = NULL;
    int m = cudaMalloc(&p, 1000);
    int f = p ? cudaFree(p) : cudaFree((void *)16);
    int a[64], b[64];
    for (int i = 0; i < 64; i++) a[i] = i;
    memset(b, 0, sizeof b);
    int n = ncclAllReduce(a, b, 64, 2 /* ncclInt32 */, 0, NULL, NULL);
    printf("%d %d %d %s\n", m, f, n, memcmp(a, b, sizeof a) == 0 ? "same" : "differ");
    return 0;
}
"""


@dataclass(frozen=True)
class Built:
    linked: Path
    unlinked: Path
    example: Path
    local_cudart: Path  # stub named and sonamed like the real runtime, for the RTLD_LOCAL case
    local_nccl: Path


def _gcc(*args: str | Path) -> None:
    assert GCC is not None
    proc = subprocess.run([GCC, *map(str, args)], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    newest = max(p.stat().st_mtime for p in SOURCES)
    if SO.stat().st_mtime < newest:
        pytest.fail(f"{SO.relative_to(ROOT)} is older than native/: run `make native`")
    d = tmp_path_factory.mktemp("native")
    stubs, local = d / "stubs", d / "local"
    stubs.mkdir()
    local.mkdir()
    (d / "cudart_stub.c").write_text(CUDART_STUB)
    (d / "nccl_stub.c").write_text(NCCL_STUB)
    for src, out in (
        ("cudart_stub.c", stubs / "libcudart_stub.so"),
        ("nccl_stub.c", stubs / "libnccl_stub.so"),
        ("cudart_stub.c", local / "libcudart.so.12"),
        ("nccl_stub.c", local / "libnccl.so.2"),
    ):
        _gcc("-shared", "-fPIC", "-O2", f"-Wl,-soname,{out.name}", "-o", out, d / src)
    (d / "linked.c").write_text(LINKED_PROGRAM)
    (d / "unlinked.c").write_text(UNLINKED_PROGRAM)
    lib_dir = SO.parent
    _gcc("-O2", "-o", d / "prog_linked", d / "linked.c", f"-I{ROOT / 'native'}",
         f"-L{stubs}", f"-Wl,-rpath,{stubs}", "-lcudart_stub", "-lnccl_stub",
         f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-ldsec_inject")  # fmt: skip
    _gcc("-O2", "-o", d / "prog_unlinked", d / "unlinked.c", "-ldl")
    # The example exactly as docs/native.md builds it.
    _gcc(ROOT / "examples" / "native" / "train.c", f"-I{ROOT / 'native'}", f"-L{lib_dir}",
         f"-Wl,-rpath,{lib_dir}", "-ldsec_inject", "-o", d / "train")  # fmt: skip
    return Built(d / "prog_linked", d / "prog_unlinked", d / "train", local / "libcudart.so.12", local / "libnccl.so.2")


def _env(h: Harness | None = None, preload: bool = True, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_") and k not in ("LD_PRELOAD", "RANK")}
    if preload:
        env["LD_PRELOAD"] = str(SO)
    if h is not None:
        env.update(
            DSEC_ENDPOINT=h.url,
            DSEC_SANDBOX_ID="pool-a",
            DSEC_TOKEN=h.pool_tokens["pool-a"],
            DSEC_HEARTBEAT_INTERVAL="0.1",
        )
    env.update(extra)
    return env


def _run(
    cmd: list[str | Path], env: dict[str, str], timeout: float = 20, input: str = ""
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], env=env, input=input, capture_output=True, text=True, timeout=timeout, check=False
    )


def _worker(h: Harness, group: str) -> dict[str, Any] | None:
    found = [w for w in h.admin.workers() if w["group"] == group]
    assert len(found) <= 1, found
    return found[0] if found else None


def _native_threads() -> list[str]:
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        try:
            name = comm.read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name == "dsec-native":
            names.append(name)
    return names


def test_preloaded_program_reports_allocations_allreduces_and_episodes(
    server_factory: Callable[..., Harness], built: Built
) -> None:
    h = server_factory(pools=True)
    proc = subprocess.Popen(
        [str(built.linked)],
        env=_env(h),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Phase 1 is reported by the periodic heartbeats, while the program still runs.
        def phase1() -> dict[str, Any] | None:
            w = _worker(h, "prog_linked")
            return w if w and w["metrics"].get("episodes_total") == 2 and w["beats"] >= 2 else None

        w = wait_for(phase1, timeout=15, what="the first heartbeats of the preloaded program")
        m = w["metrics"]
        assert (w["role"], w["pool"], w["pid"], w["state"]) == ("other", "pool-a", proc.pid, "active")
        assert w["heartbeat_interval_s"] == pytest.approx(0.1)
        assert m["cuda_malloc_count_total"] == 4
        assert m["cuda_malloc_bytes_total"] == (1 << 20) + (3 << 20) + 4096 + 12345
        assert m["cuda_malloc_failures_total"] == 1
        assert m["cuda_free_count_total"] == 2
        assert m["cuda_allocated_bytes"] == 4096 + 12345
        assert m["nccl_allreduce_count_total"] == 6
        assert m["nccl_allreduce_bytes_total"] == 5 * 256 * 4 + 128 * 8
        assert m["episode_return_mean"] == 2.0 and m["episode_length_mean"] == 20.0
        assert m["nccl_allreduce_latency_ms_max"] >= 2.0  # the stub sleeps 2 ms
        assert m["nccl_allreduce_latency_ms_mean"] >= 2.0
        out, err = proc.communicate(input="", timeout=15)  # stdin closed: phase 2, then exit
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert (out, err) == ("ok\n", "")  # the library writes nothing without DSEC_DEBUG
    # What phase 2 did arrived in the final beat, sent by the destructor before the deregistration.
    w = _worker(h, "prog_linked")
    assert w is not None
    m = w["metrics"]
    assert w["state"] == "deregistered"
    assert w["last_seq"] == w["beats"] >= 3  # seq 1, 2, 3, ...: every beat new, none repeated or refused
    assert w["directive"]["in_sync"]
    assert m["cuda_malloc_count_total"] == 5 and m["cuda_allocated_bytes"] == 4096 + 12345 + 1000
    assert m["episodes_total"] == 3 and m["episode_return_mean"] == 5.0 and m["episode_length_mean"] == 50.0
    events = h.admin.request("GET", "/v1/events", params={"worker_id": w["id"], "type": "deregistered"})["items"]
    assert [e["data"].get("reason") for e in events] == ["exit"]


def test_idle_preloaded_processes_do_not_register(server_factory: Callable[..., Harness], built: Built) -> None:
    """LD_PRELOAD reaches every child: a shell or launcher that counts nothing never registers."""
    h = server_factory(pools=True)
    proc = _run(["/bin/sh", "-c", '"$0" && exit 0', built.linked], _env(h))  # sh forks, runs it, exits
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")
    assert [w["group"] for w in h.admin.workers()] == ["prog_linked"]


def test_rtld_local_runtime_is_found_by_name(server_factory: Callable[..., Harness], built: Built) -> None:
    h = server_factory(pools=True)
    env = _env(h, DSEC_NAME="rtld-local", DSEC_DEBUG="1")
    proc = _run([built.unlinked, built.local_cudart, built.local_nccl], env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "0 0 0 same\n"  # the stubs ran
    # RTLD_NEXT saw nothing; the libraries were found among those already loaded, by their sonames.
    assert "cudaMalloc resolved from libcudart.so.12 (already loaded)" in proc.stderr
    assert "ncclAllReduce resolved from libnccl.so.2 (already loaded)" in proc.stderr
    w = _worker(h, "rtld-local")
    assert w is not None and w["state"] == "deregistered"
    m = w["metrics"]
    assert (m["cuda_malloc_count_total"], m["cuda_malloc_bytes_total"], m["cuda_free_count_total"]) == (1, 1000, 1)
    assert (m["nccl_allreduce_count_total"], m["nccl_allreduce_bytes_total"]) == (1, 256)
    assert m["cuda_allocated_bytes"] == 0


def test_missing_symbols_return_error_codes(built: Built) -> None:
    env = _env(DSEC_CUDART_LIB="/nonexistent/libcudart.so", DSEC_NCCL_LIB="/nonexistent/libnccl.so.2", DSEC_DEBUG="1")
    proc = _run([built.unlinked], env)
    assert proc.returncode == 0, proc.stderr
    # cudaErrorInitializationError for both CUDA calls, ncclSystemError, and nothing was written to b.
    assert proc.stdout == "3 3 2 differ\n"
    assert "cudaMalloc: no real implementation found" in proc.stderr  # DSEC_DEBUG: diagnostics on stderr only
    assert "ncclAllReduce: no real implementation found" in proc.stderr


def test_control_plane_down_or_hung_does_not_hold_the_program(built: Built) -> None:
    # Nothing listens: connection refused.
    env = _env(DSEC_ENDPOINT=f"http://127.0.0.1:{free_port()}", DSEC_SANDBOX_ID="pool-a", DSEC_TOKEN="dsp_x")
    t0 = time.monotonic()
    proc = _run([built.linked], env)
    refused_s = time.monotonic() - t0
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")
    assert refused_s < 2.0
    # A listener that never accepts: the connection opens, the request is never answered.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        env["DSEC_ENDPOINT"] = f"http://127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        proc = _run([built.linked], env)
        hung_s = time.monotonic() - t0
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "ok\n", "")
    assert hung_s < 4.5  # the exchange in flight at exit gets at most the stop budget (2.5 s)


def test_example_program(server_factory: Callable[..., Harness], built: Built) -> None:
    h = server_factory(pools=True)
    env = _env(h, preload=False)
    del env["DSEC_HEARTBEAT_INTERVAL"]  # the default 5 s: the program ends long before its first periodic beat
    proc = _run([built.example], env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    w = _worker(h, "my-trainer")
    assert w is not None and w["state"] == "deregistered" and w["beats"] == 1
    m = w["metrics"]
    assert (m["episodes_total"], m["episode_return_mean"], m["episode_length_mean"]) == (100, 24.75, 200)
    assert m["cuda_malloc_count_total"] == 0


def test_ctypes_binding(server_factory: Callable[..., Harness]) -> None:
    h = server_factory(pools=True)
    native.load()
    assert native.init(h.url, "py-native") is False  # DSEC_SANDBOX_ID is not set: not configured
    assert not _native_threads()
    os.environ.update(DSEC_SANDBOX_ID="pool-a", DSEC_TOKEN=h.pool_tokens["pool-a"], DSEC_HEARTBEAT_INTERVAL="0.1")
    try:
        assert native.init(h.url, "py-native") is True
        assert native.init(h.url, "py-native") is True  # already running: kept as it is
        assert _native_threads() == ["dsec-native"]
        native.report_episode_end(1.5, 10)
        native.report_episode_end(1.5, 10)

        def live() -> dict[str, Any] | None:
            w = _worker(h, "py-native")
            return w if w and w["metrics"].get("episodes_total") == 2 else None

        w = wait_for(live, timeout=10, what="episodes reported through ctypes")
        assert (w["pid"], w["state"], w["metrics"]["episode_return_mean"]) == (os.getpid(), "active", 1.5)
        native.report_episode_end(4.0, 40)
    finally:
        native.shutdown()
    assert not _native_threads()
    w = _worker(h, "py-native")
    assert w is not None and w["state"] == "deregistered"
    assert (w["metrics"]["episodes_total"], w["metrics"]["episode_return_mean"]) == (3, 4.0)
    native.shutdown()  # idempotent


def test_load_reports_a_missing_library(tmp_path: Path) -> None:
    with pytest.raises(native.NativeLibraryNotFound, match="make native"):
        native.load(tmp_path / "nope.so")
    os.environ["DSEC_NATIVE_LIB"] = str(tmp_path / "gone.so")  # restored by the autouse fixture
    assert native.library_path() == tmp_path / "gone.so"
    with pytest.raises(native.NativeLibraryNotFound, match=r"gone\.so.*DSEC_NATIVE_LIB"):
        native.load()
    del os.environ["DSEC_NATIVE_LIB"]
    assert native.library_path() == SO
