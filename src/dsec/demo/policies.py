"""Demo scene for the policy engine: load the shipped example policies plus one rule with demo-sized windows
(the examples count meltdowns per hour; the demo lasts a minute), and show the action the rule takes when the
breaker scene melts a learner down."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from dsec.demo import DemoRun

DEMO_RULE: dict[str, Any] = {
    "name": "demo-tighten-latency-cap-on-meltdown",
    "when": "increase(dsec_melt_down_count[5m]) >= 1",
    "scope": {"pools": ["pool-0"]},
    "then": [{"knob": "latency_cap_ms", "by": -5}],
    "bounds": {"latency_cap_ms": {"min": 60}},
    "cooldown": "10m",
    "annotations": {"runbook": "demo-sized copy of examples/policies/meltdowns-tighten-latency-cap.yaml"},
}


def example_dir() -> Path:
    """The example policies, packaged with dsec (examples/policies links to them)."""
    return Path(str(resources.files("dsec") / "data" / "policies"))


def combined_policies() -> tuple[str, list[str]]:
    """One policy file: the rules of every example file, then the demo rule."""
    rules: list[Any] = []
    files = sorted(example_dir().glob("*.yaml"))
    for f in files:
        rules += (yaml.safe_load(f.read_text()) or {}).get("policies", [])
    rules.append(DEMO_RULE)
    return yaml.safe_dump({"policies": rules}, sort_keys=False), [f.name for f in files]


def load_policies(run: DemoRun) -> bool:
    text, files = combined_policies()
    status = run.client.put_policies(text, "demo-policies.yaml")
    run.notes.append(
        f"policies: {len(status['rules'])} rules loaded with `PUT /v1/policies` (from {', '.join(files)} + "
        f"{DEMO_RULE['name']!r}, the meltdown rule with a 5-minute window)"
    )
    return True


def policy_acted(run: DemoRun) -> bool:
    acts = [e for e in run.client.all_events(types=["policy_action"]) if e["data"]["outcome"] == "applied"]
    for e in acts[:3]:
        d = e["data"]
        run.notes.append(
            f"policy {d['rule']!r} changed {d['scope']} {d['knob']} {d['old']:g} -> {d['new']:g} "
            f"(observed {d['evidence'].get('observed')} for `{d['evidence']['when']}`)"
        )
    pool = next((p for p in run.client.pools() if p["name"] == "pool-0"), None)
    lowered = pool is not None and pool["thresholds"]["latency_cap_ms"] < 85.0
    return bool(acts) and lowered
