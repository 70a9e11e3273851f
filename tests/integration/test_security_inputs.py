"""Admin inputs that used to cost the control plane seconds of CPU, gigabytes or a 500 (docs/security.md, finding
10): YAML alias bombs, deep nesting in YAML, expressions and event data. Against a real control plane on loopback."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import Harness
from dsec.yamlconf import ConfigError, load_marked

# 7 levels of 9 aliases: 9^7 = 4.8 million strings from 300-odd bytes.
BOMB = (
    "a: &a [x,x,x,x,x,x,x,x,x]\n"
    + "".join(f"{n}: &{n} [{','.join([f'*{p}'] * 9)}]\n" for p, n in zip("abcdef", "bcdefg", strict=True))
    + "policies: *g\n"
)


def put_policies(h: Harness, text: str) -> Any:
    with h.http() as http:
        return http.put("/v1/policies", json={"text": text}, headers={"Authorization": f"Bearer {h.admin_token}"})


def test_a_yaml_alias_bomb_is_refused_at_once(server: Harness) -> None:
    assert len(BOMB) < 400
    before = server.admin.policies()
    r = put_policies(server, BOMB)
    assert r.status_code == 422 and r.json()["field"] == "text", r.text
    assert "too many values" in r.json()["message"]
    assert server.admin.policies() == before


def test_merge_keys_still_work_within_the_budget() -> None:
    text = "base: &base {a: 1, b: 2}\nitems:\n" + "".join(f"  - {{<<: *base, c: {i}}}\n" for i in range(500))
    data = load_marked(text).data
    assert len(data["items"]) == 500 and data["items"][499] == {"a": 1, "b": 2, "c": 499}


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("policies: " + "[" * 3000 + "]" * 3000, "nested"),
        (
            "policies:\n  - name: deep\n    when: " + "(" * 40 + "dsec_workers_lost" + ")" * 40 + " > 0\n"
            "    then: [{knob: gpu_quota, by: 1}]\n",
            "nested deeper than 32",
        ),
        (
            "policies:\n  - name: deep\n    when: " + "(" * 5000 + "1" + ")" * 5000 + " > 0\n"
            "    then: [{knob: gpu_quota, by: 1}]\n",
            "at most 4096",
        ),
        (
            "policies:\n  - name: long\n    when: " + " + ".join(["1"] * 200) + " > 0\n"
            "    then: [{knob: gpu_quota, by: 1}]\n",
            "too long",
        ),
    ],
    ids=["yaml-nesting", "expr-nesting", "expr-5000-deep", "expr-long"],
)
def test_deep_policy_text_is_422_not_500(server: Harness, text: str, words: str) -> None:
    r = put_policies(server, text)
    assert r.status_code == 422, r.text[:300]
    assert words in r.json()["message"], r.json()["message"][:300]
    with server.http() as http:
        assert http.get("/healthz").status_code == 200


def test_event_data_nesting_is_bounded_on_every_route(server: Harness) -> None:
    deep: Any = "leaf"
    for _ in range(20):
        deep = {"d": deep}
    with server.http() as http:
        r = http.post("/v1/events", json={"type": "log", "data": deep},
                      headers={"Authorization": f"Bearer {server.admin_token}"})  # fmt: skip
        assert r.status_code == 422 and r.json()["field"] == "data", r.text
    assert not server.admin.all_events(types=["log"])


def test_the_expansion_error_says_where() -> None:
    with pytest.raises(ConfigError) as info:
        load_marked(BOMB, "bomb.yaml")
    (problem,) = info.value.problems
    assert problem.startswith("bomb.yaml:") and "too many values" in problem
