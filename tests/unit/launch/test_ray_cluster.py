"""The ``ray`` launcher's cluster rules that need no Ray: rendezvous across hosts, GPU bundles, job-file settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.launch.jobfile import load_job
from dsec.launch.ray_cluster import rendezvous, wants_gpu
from dsec.yamlconf import ConfigError

ONE_MACHINE = {"MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "MASTER_PORT": "29500"}


def test_a_group_on_one_host_keeps_the_loopback_rendezvous() -> None:
    assert rendezvous(ONE_MACHINE, "10.0.0.5", {"10.0.0.5"}) == ({}, [])


def test_a_group_across_hosts_meets_at_rank_0s_node_and_leaves_loopback() -> None:
    assert rendezvous(ONE_MACHINE, "10.0.0.5", {"10.0.0.5", "10.0.0.6"}) == (
        {"MASTER_ADDR": "10.0.0.5"},
        ["GLOO_SOCKET_IFNAME"],
    )
    # localhost counts as the one-machine default too
    assert rendezvous({"MASTER_ADDR": "localhost"}, "10.0.0.6", {"10.0.0.5", "10.0.0.6"}) == (
        {"MASTER_ADDR": "10.0.0.6"},
        [],
    )


def test_a_rendezvous_the_job_file_set_is_kept() -> None:
    own = {"MASTER_ADDR": "10.1.2.3", "GLOO_SOCKET_IFNAME": "eth1"}
    assert rendezvous(own, "10.0.0.5", {"10.0.0.5", "10.0.0.6"}) == ({}, [])
    # an interface the user named is not dropped even when only the address is filled in
    assert rendezvous({"GLOO_SOCKET_IFNAME": "eth1"}, "10.0.0.5", {"10.0.0.5", "10.0.0.6"}) == (
        {"MASTER_ADDR": "10.0.0.5"},
        [],
    )


def test_gpu_bundles_only_for_placed_workers_unless_never() -> None:
    assert wants_gpu("always", True) is True
    assert wants_gpu("always", False) is False  # a worker placed on no device never asks for one
    assert wants_gpu("never", True) is False
    assert wants_gpu("auto", False) is False


def test_job_file_ray_settings_are_checked_with_file_and_line(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "job: j\npool: p\nlauncher: ray\nray: {address: auto, gpus: never, local_cpus: 8}\n"
        "groups: [{name: g, command: [python, x.py]}]\n"
    )
    job = load_job(good)
    assert (job.ray.address, job.ray.gpus, job.ray.local_cpus) == ("auto", "never", 8)
    plain = tmp_path / "plain.yaml"
    plain.write_text("job: j\npool: p\ngroups: [{name: g, command: [python, x.py]}]\n")
    assert load_job(plain).ray.model_dump() == {"address": None, "gpus": "auto", "local_cpus": 64}
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: j\npool: p\nlauncher: ray\nray:\n  gpus: sometimes\ngroups: [{name: g, command: [x]}]\n")
    with pytest.raises(ConfigError) as e:
        load_job(bad)
    assert "ray.gpus" in str(e.value) and "bad.yaml" in str(e.value) and ":5" in str(e.value)
