"""benchmarks/chaos_bandwidth.py: the rate-limited link (a network namespace, a veth pair, tbf on both ends) is
made and removed without leftovers, it limits throughput to its rate, a link that cannot be made is reported as
unavailable (the benchmark then skips), and — slow — DSec's breaker compresses a PPO job's syncs over a real 2 Mbit/s
link, which then trains faster than the unmodified job."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from chaos_bandwidth import LimitedLink, Unavailable  # noqa: E402

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("ip") is None or shutil.which("tc") is None, reason="no iproute2 here"),
]


def namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout


def links() -> str:
    return subprocess.run(["ip", "link"], capture_output=True, text=True, check=False).stdout


def test_a_link_that_cannot_be_made_is_unavailable_and_removes_only_what_it_made() -> None:
    with pytest.raises(ValueError, match="rate_mbit=0"):
        LimitedLink(rate_mbit=0)
    link = LimitedLink(rate_mbit=8.0)
    # Its near interface's name is taken: the namespace is made, the veth pair is not; the namespace is removed,
    # the interface that was there already is not.
    taken = subprocess.run(["ip", "link", "add", link.near_if, "type", "veth", "peer", "name", f"{link.near_if}x"],
                           capture_output=True, check=False)  # fmt: skip
    try:
        with pytest.raises(Unavailable), link:
            pass
        assert link.netns not in namespaces()
        if taken.returncode == 0:
            assert link.near_if in links()
    finally:
        subprocess.run(["ip", "link", "del", link.near_if], capture_output=True, check=False)


def test_the_link_carries_about_its_rate_and_is_removed() -> None:
    try:
        link = LimitedLink(rate_mbit=8.0).__enter__()
    except Unavailable as exc:
        pytest.skip(f"no rate-limited link here: {exc}")
    received: list[int] = []
    try:
        srv = socket.create_server((link.near_ip, 0))
        port = srv.getsockname()[1]

        def sink() -> None:
            conn, _ = srv.accept()
            with conn:
                while chunk := conn.recv(1 << 16):
                    received.append(len(chunk))

        t = threading.Thread(target=sink)
        t.start()
        sender = ("import socket,sys; c=socket.create_connection((sys.argv[1], int(sys.argv[2])));"
                  "c.sendall(b'x' * 2_000_000); c.close()")  # fmt: skip
        t0 = time.monotonic()
        subprocess.run(["ip", "netns", "exec", link.netns, sys.executable, "-c", sender, link.near_ip, str(port)],
                       check=True, timeout=30)  # fmt: skip
        t.join(30)
        elapsed = time.monotonic() - t0
        srv.close()
    finally:
        link.__exit__()
    assert sum(received) == 2_000_000
    mbit_per_s = 2_000_000 * 8 / 1e6 / elapsed
    assert 4.0 < mbit_per_s < 9.0, mbit_per_s  # 8 Mbit/s shaped (2 MB take ~2 s; unshaped veth: > 1 Gbit/s)
    assert link.netns not in namespaces() and link.near_if not in links()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_dsec_compresses_syncs_over_a_slow_link() -> None:
    proc = subprocess.run(
        [sys.executable, str(BENCH / "chaos_real.py"), "--scenario", "bandwidth", "--duration", "30"],
        capture_output=True, text=True, timeout=560, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skipped" in result:
        pytest.skip(result["skipped"])
    dsec = result["dsec"]
    assert dsec["breaker_max_level"] >= 1 and dsec["directives_acked"] >= 2, dsec
    assert {r["compression_bits"] for r in dsec["ranks"].values()} == {4.0}, dsec["ranks"]
    assert result["goodput_ratio"] > 1.5, result  # 2 Mbit/s: a full-precision sync is ~150 ms, a 4-bit one ~15
