"""`dsec policy validate` and `dsec policy test` (what-if replay): the commands that need no control plane."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from dsec.cli import app

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "policies"
MELTDOWNS = EXAMPLES / "meltdowns-tighten-latency-cap.yaml"
SERIES = EXAMPLES / "series-meltdowns.json"
T0 = 1_800_000_000
ACTION_LINE = (
    "2027-01-15T08:31:00Z (+00:31:00)  tighten-latency-cap-on-meltdowns  pool-0  latency_cap_ms 85 -> 75  "
    "applied (observed 4)"
)


def cli(*args: str | Path) -> Result:
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# -- validate -----------------------------------------------------------------------------------------------
def test_validate_prints_ok_for_every_example() -> None:
    files = sorted(EXAMPLES.glob("*.yaml"))
    r = cli("policy", "validate", *files)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        f"{EXAMPLES / 'idle-pool-gpu-quota.yaml'}: 2 rule(s) ok: shrink-idle-pool, regrow-busy-pool",
        f"{MELTDOWNS}: 1 rule(s) ok: tighten-latency-cap-on-meltdowns",
        f"{EXAMPLES / 'slow-recovery-more-compression.yaml'}: 1 rule(s) ok: compress-snapshots-on-slow-recovery",
    ]
    assert r.stderr == ""


def test_validate_reports_file_line_column_and_exits_1(tmp_path: Path) -> None:
    bad = write(
        tmp_path,
        "bad.yaml",
        "policies:\n"
        "  - name: a\n"
        "    when: dsec_melt_count > 3\n"
        "    then: [{knob: latency_cap_ms, by: -10}]\n"
        "  - name: b\n"
        "    when: dsec_workers_lost > 1\n"
        "    then: [{knob: latency_cap, by: -10}]\n",
    )
    r = cli("policy", "validate", MELTDOWNS, bad)
    assert r.exit_code == 1
    assert r.stdout.splitlines() == [f"{MELTDOWNS}: 1 rule(s) ok: tighten-latency-cap-on-meltdowns"]
    err = r.stderr.splitlines()
    assert err[0] == (
        f"{bad}:3:11: policies[0].when: unknown metric 'dsec_melt_count' (did you mean dsec_melt_down_count?) "
        "(in: dsec_melt_count > 3)"
    )
    assert err[1].startswith(f"{bad}:7:13: policies[1].then[0].knob: unknown pool knob 'latency_cap': expected one of")
    assert len(err) == 2


def test_validate_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    broken = write(tmp_path, "broken.yaml", "policies:\n  - name: a\n    when: [x\n")
    missing = tmp_path / "missing.yaml"
    r = cli("policy", "validate", broken, missing)
    assert r.exit_code == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        f"{broken}:4:1: invalid YAML: expected ',' or ']', but got '<stream end>'",
        f"{missing}: cannot read: No such file or directory",
    ]


def test_validate_an_empty_file_has_no_rules(tmp_path: Path) -> None:
    empty = write(tmp_path, "empty.yaml", "# nothing yet\n")
    r = cli("policy", "validate", empty)
    assert r.exit_code == 0 and r.stdout.strip() == f"{empty}: 0 rule(s) ok:"


# -- test (what-if replay) ----------------------------------------------------------------------------------
def test_replay_of_the_example_prints_the_action_and_a_summary() -> None:
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--step", "1m")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [ACTION_LINE, "1 decision(s), 1 applied, over 2.00 h of series (step 1m)"]


def test_replay_default_step_is_15s() -> None:
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES)
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [ACTION_LINE, "1 decision(s), 1 applied, over 2.00 h of series (step 15s)"]


def test_replay_states_adds_pending_firing_resolved_before_the_action() -> None:
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--step", "1m", "--states")
    assert r.exit_code == 0, r.output
    rule = "tighten-latency-cap-on-meltdowns"
    assert r.stdout.splitlines() == [
        f"2027-01-15T08:31:00Z (+00:31:00)  {rule}  pool-0  -> pending",
        f"2027-01-15T08:31:00Z (+00:31:00)  {rule}  pool-0  -> firing",
        ACTION_LINE,
        f"2027-01-15T09:31:00Z (+01:31:00)  {rule}  pool-0  -> resolved",
        "1 decision(s), 1 applied, over 2.00 h of series (step 1m)",
    ]


def test_replay_json_lines() -> None:
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--step", "1m", "--json")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert rows == [
        {
            "t": T0 + 31 * 60,
            "kind": "action",
            "rule": "tighten-latency-cap-on-meltdowns",
            "scope": "pool-0",
            "knob": "latency_cap_ms",
            "level": "pool",
            "old": 85.0,
            "new": 75.0,
            "outcome": "applied",
            "dry_run": False,
            "evidence": {"when": "increase(dsec_melt_down_count[1h]) > 3", "observed": 4.0},
        }
    ]
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--step", "1m", "--json", "--states")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(row["t"], row["kind"], row.get("phase", row.get("outcome"))) for row in rows] == [
        (T0 + 31 * 60, "state", "pending"),
        (T0 + 31 * 60, "state", "firing"),
        (T0 + 31 * 60, "action", "applied"),
        (T0 + 91 * 60, "state", "resolved"),
    ]
    assert rows[0] == {
        "t": T0 + 31 * 60,
        "kind": "state",
        "rule": "tighten-latency-cap-on-meltdowns",
        "scope": "pool-0",
        "phase": "pending",
        "value": 1.0,
    }


def test_replay_set_gives_a_starting_value(tmp_path: Path) -> None:
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--step", "1m", "--set", "pool-0.latency_cap_ms=65")
    assert r.exit_code == 0, r.output
    assert "latency_cap_ms 65 -> 60  applied (observed 4)" in r.stdout.splitlines()[0]
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--step", "1m", "--set", "pool-0.latency_cap_ms=60")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [
        "2027-01-15T08:31:00Z (+00:31:00)  tighten-latency-cap-on-meltdowns  pool-0  latency_cap_ms 60 -> 60  "
        "at_bound (observed 4): latency_cap_ms is already at 60 (bounds hold it there)",
        "1 decision(s), 0 applied, over 2.00 h of series (step 1m)",
    ]


def test_replay_idle_pool_with_a_gpu_quota(tmp_path: Path) -> None:
    samples = [[T0 + i * 60, 0.2] for i in range(150)] + [[T0 + i * 60, 0.8] for i in range(150, 211)]
    series = write(
        tmp_path,
        "util.json",
        json.dumps(
            {"series": [{"metric": "dsec_sandbox_utilization_rate", "labels": {"pool": "pool-0"}, "samples": samples}]}
        ),
    )
    idle = EXAMPLES / "idle-pool-gpu-quota.yaml"
    r = cli("policy", "test", idle, "--series", series, "--step", "1m", "--set", "pool-0.gpu_quota=4", "--json")
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(row["rule"], (row["t"] - T0) / 60, row["old"], row["new"]) for row in rows] == [
        ("shrink-idle-pool", 120, 4, 3),
        ("regrow-busy-pool", 167, 3, 4),
        ("regrow-busy-pool", 177, 4, 5),
        ("regrow-busy-pool", 187, 5, 6),
        ("regrow-busy-pool", 197, 6, 7),
        ("regrow-busy-pool", 207, 7, 8),
    ]
    r = cli("policy", "test", idle, "--series", series, "--step", "1m")  # no quota: nothing to shrink
    assert r.exit_code == 0, r.output
    first = r.stdout.splitlines()[0]
    assert first.endswith("shrink-idle-pool  pool-0  gpu_quota -  no_value (observed 0.2): gpu_quota has no value "
                          "to adjust in pool-0")  # fmt: skip


@pytest.mark.parametrize("item", ["gpu_quota=2", "pool-0.gpu_quota", "pool-0.gpu_quota=two", "pool-0.gpu_quota="])
def test_replay_bad_set_exits_2(item: str) -> None:
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--set", item)
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        f"error: --set {item!r} is invalid: expected SCOPE.KNOB=NUMBER, e.g. pool-0.gpu_quota=2"
    )
    assert r.stdout == ""


def test_replay_unreadable_series_exits_2(tmp_path: Path) -> None:
    missing = tmp_path / "missing.json"
    r = cli("policy", "test", MELTDOWNS, "--series", missing)
    assert r.exit_code == 2
    assert r.stderr.strip() == f"error: {missing}: cannot read: No such file or directory"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{bad", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        ("", "Expecting value: line 1 column 1 (char 0)"),
        ("[1, 2]", 'a series file is a JSON object {"series": [{"metric", "labels", "samples"}, ...]}'),
        ('{"series": []}', "the series file holds no samples"),
        (
            '{"series": [{"metric": "dsec_workers_lost", "samples": [[1, 2]]}]}',
            "series[0]: expected metric, labels.pool and samples [[t, v], ...] ('pool')",
        ),
    ],
)
def test_replay_bad_series_file_exits_2(tmp_path: Path, text: str, message: str) -> None:
    series = write(tmp_path, "s.json", text)
    r = cli("policy", "test", MELTDOWNS, "--series", series)
    assert r.exit_code == 2
    assert r.stderr.strip() == f"error: {series}: {message}"
    assert r.stdout == ""


def test_replay_series_entry_that_is_not_an_object_exits_2(tmp_path: Path) -> None:
    series = write(tmp_path, "s.json", '{"series": ["oops"]}')
    r = cli("policy", "test", MELTDOWNS, "--series", series)
    assert r.exit_code == 2 and "series[0]" in r.stderr


@pytest.mark.parametrize(
    ("step", "message"),
    [
        ("5x", "'5x' is not a duration: expected e.g. 30s, 5m, 1h, 1h30m, 1d"),
        ("0s", "step 0.0 is invalid: expected > 0 seconds"),
    ],
)
def test_replay_bad_step_exits_2(step: str, message: str) -> None:
    r = cli("policy", "test", MELTDOWNS, "--series", SERIES, "--step", step)
    assert r.exit_code == 2 and r.stdout == ""
    # (the message is prefixed with the series file's name although the step is at fault)
    assert r.stderr.startswith("error: ") and r.stderr.strip().endswith(message)


def test_replay_bad_policy_file_exits_1(tmp_path: Path) -> None:
    bad = write(tmp_path, "bad.yaml", "policies:\n  - name: a\n    when: dsec_workers_lost >\n    then: []\n")
    r = cli("policy", "test", bad, "--series", SERIES)
    assert r.exit_code == 1
    assert r.stderr.strip() == (
        f"error: {bad}:4:5: policies[0].then: List should have at least 1 item after validation, not 0"
    )
    r = cli("policy", "test", tmp_path / "missing.yaml", "--series", SERIES)
    assert r.exit_code == 1
    assert r.stderr.strip() == f"error: {tmp_path / 'missing.yaml'}: cannot read: No such file or directory"


def test_replay_with_no_decisions_prints_only_the_summary(tmp_path: Path) -> None:
    calm = write(
        tmp_path,
        "calm.json",
        json.dumps(
            {
                "series": [
                    {
                        "metric": "dsec_melt_down_count",
                        "labels": {"pool": "pool-0"},
                        "samples": [[T0 + i * 60, 0] for i in range(61)],
                    }
                ]
            }
        ),
    )
    r = cli("policy", "test", MELTDOWNS, "--series", calm, "--step", "1m", "--states")
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == ["0 decision(s), 0 applied, over 1.00 h of series (step 1m)"]
    r = cli("policy", "test", MELTDOWNS, "--series", calm, "--json")
    assert r.exit_code == 0 and r.stdout == ""
