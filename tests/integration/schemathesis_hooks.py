"""Schemathesis hooks for DSec's API: what JSON Schema cannot say, applied so generated "valid" input is valid.

Importing this module registers them (globally). tests/integration/test_api_contract.py imports it; a CLI run uses it
with ``PYTHONPATH=tests/integration SCHEMATHESIS_HOOKS=schemathesis_hooks st run <server>/openapi.json --checks all``.
Every rule here is stated in the schema's descriptions and answered 422 naming the field by the server; a hook only
makes valid values agree, or drops a case whose valid values together break a rule. Invalid values are left as they
were generated, so negative cases stay negative.
"""

from __future__ import annotations

import re
import time
from typing import Any

import schemathesis

from dsec.control.schemas import NAME_PATTERN


def _name(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(NAME_PATTERN, value) is not None


def _number(value: Any, lo: float, hi: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and lo <= value <= hi


def _route(case: Any) -> tuple[str, str]:
    return case.operation.method.upper(), case.operation.path


def _big_int(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_big_int(v) for v in value.values())
    if isinstance(value, list):
        return any(_big_int(v) for v in value)
    return isinstance(value, int) and not -(2**63) <= value < 2**64


def _violates_cross_field_rule(case: Any) -> bool:
    """A case whose fields are each valid but together break a rule the descriptions state (the server's 422)."""
    body = case.body if isinstance(case.body, dict) else {}
    method, path = _route(case)
    if _big_int(body):  # free-form event data and policy parameters: integers within 64 bits
        return True
    if (method, path) == ("PUT", "/v1/pools/{name}"):
        base, ceiling = body.get("memory_base_gb", 7.0), body.get("memory_ceiling_gb", 12.0)
        return _number(base, 0, 4096) and _number(ceiling, 0, 4096) and ceiling < base
    if method == "POST" and path in ("/v1/heal/{run}/join", "/v1/heal/{run}/fail"):
        world = body.get("world")
        ranks = [body.get(k) for k in ("rank", "dead_rank")]
        return _number(world, 1, 65536) and any(_number(r, 0, 65535) and r >= world for r in ranks)
    if (method, path) == ("GET", "/v1/cost"):
        return _empty_window(case.query if isinstance(case.query, dict) else {})
    return False


def _seconds(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if 0 <= v < float("inf") else None


def _empty_window(query: dict[str, Any]) -> bool:
    """GET /v1/cost: ``until`` after ``since`` (defaults: until now, since one hour before until, at least 0)."""
    since = _seconds(query.get("since")) if "since" in query else None
    until = _seconds(query.get("until")) if "until" in query else None
    if ("since" in query and since is None) or ("until" in query and until is None):
        return False  # an invalid value: the case stays negative
    end = time.time() - 60 if until is None else until  # the server's now (a minute early: near it, drop the case)
    start = max(0.0, end - 3600) if since is None else since
    return end <= start


@schemathesis.hook
def filter_case(_ctx: Any, case: Any) -> bool:
    return not _violates_cross_field_rule(case)


def _unique_names(items: list[Any], seen: set[str]) -> None:
    for i, item in enumerate(items):
        if isinstance(item, dict) and _name(item.get("name")) and item["name"] in seen:
            item["name"] = f"{item['name'][:100]}-{i}-{len(seen)}"
        if isinstance(item, dict) and _name(item.get("name")):
            seen.add(item["name"])


@schemathesis.hook
def map_case(_ctx: Any, case: Any) -> Any:
    """Make valid values agree where the schema cannot say they must; invalid values are left as generated."""
    method, path = _route(case)
    body = case.body
    if (method, path) == ("PUT", "/v1/devices/{device_id}") and isinstance(body, dict):
        device_id = (case.path_parameters or {}).get("device_id")
        if _name(body.get("id")) and _name(device_id):
            body["id"] = device_id
    elif (method, path) == ("POST", "/v1/placements") and isinstance(body, dict):
        groups = body.get("groups")
        if isinstance(groups, list):
            _unique_names(groups, set())
            workers: set[str] = set()
            for g in groups:
                if isinstance(g, dict) and isinstance(g.get("workers"), list):
                    _unique_names(g["workers"], workers)
                    for w in g["workers"]:
                        # A valid pin must name a device of the inventory (422 otherwise), which holds none here.
                        if isinstance(w, dict) and _name(w.get("device")):
                            del w["device"]
    elif path == "/v1/heal/{run}/watch" and isinstance(case.query, dict):
        # A valid timeout (up to 60 s) would hold the run that long: the shortest valid one instead.
        timeout = case.query.get("timeout")
        try:
            if 0 <= float(timeout) <= 60:
                case.query["timeout"] = 0.01
        except (TypeError, ValueError):
            pass
    return case
