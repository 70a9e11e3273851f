"""The OpenAPI document is the contract: schemathesis, with every check, against a real server finds 0 failures.

A real uvicorn server on loopback (the heartbeat shortcut in front, the example cluster loaded) is fuzzed from its own
``/openapi.json``: the examples, coverage (boundary and negative values, undeclared methods) and fuzzing phases, with
the admin token and without a token. Every check runs: no 5xx, only documented statuses, content types and headers,
answers that match their schema, schema-valid input accepted and invalid input rejected, ``Allow`` on 405s.

What JSON Schema cannot say is in the schema's descriptions and applied here as hooks, so generated "valid" input is
valid: a device body's ``id`` equals the path's ``device_id``, a pool's ``memory_ceiling_gb`` >= its
``memory_base_gb``, a healing body's ranks < its ``world``, names unique within a placement, integers in free-form
event data and policy parameters within 64 bits. PUT /v1/policies's ``text`` is a YAML document the policy engine
validates: schema-valid text is not a valid policy, so that operation runs every check but positive-data acceptance.
Long-polls are shortened (the registry's poll, ``watch?timeout=``).

The fast run (``max_examples`` 10 per operation, a fixed seed; about 30 s) runs in ``make test``; the deeper one (300
per operation, a random seed) is marked slow (``make test-slow``). A failure lists each failed check with a curl that
reproduces it.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
import schemathesis_hooks  # noqa: F401  (registers the hooks: what JSON Schema cannot say)
from fastapi import FastAPI
from schemathesis.config import SchemathesisConfig
from schemathesis.engine import events, from_schema

from conftest import Harness, make_settings
from dsec.client import Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread
from dsec.control.store import StoreError

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = next(p for p in (ROOT / "src/dsec/data/cluster.yaml", ROOT / "examples/cluster.yaml") if p.exists())
FAST_SEED = 20260


# -- the server ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def contract_app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    # Private literal callback hosts are refused per setting (the field's description says so): allowed here, so a
    # generated "http://0/" is valid. Healing long-polls are cut short so a waiting join answers 202 at once. The body
    # cap is `dsec serve`'s default (the other tests' 64 KiB would turn more generated bodies into 413s).
    with pytest.MonkeyPatch.context() as env:  # module scope: set up before the autouse _clean_environ runs
        for key in [k for k in os.environ if k.startswith("DSEC_")]:
            env.delenv(key)
        settings = make_settings(
            tmp_path_factory.mktemp("contract"),
            cluster_file=CLUSTER,
            webhook_allow_private=True,
            heal_join_timeout_s=0.2,
            max_body_bytes=1 << 20,
        )
    app = create_app(settings)
    app.state.heal.poll_s = 0.05
    return app


@pytest.fixture(scope="module")
def contract_server(contract_app: FastAPI) -> Iterator[Harness]:
    """One server for the module: its state after a run (pools, tokens, runtimes made by the fuzzer) is fine for
    the next, since every run must pass against whatever the previous ones left."""
    settings = contract_app.state.settings
    server = ServerThread(contract_app)
    h = Harness(settings=settings, server=server, admin=Client(server.url, token=settings.admin_token))
    try:
        yield h
    finally:
        h.close()


# -- the run -------------------------------------------------------------------------------------------------------
def _config(token: str | None, max_examples: int, seed: int | None) -> SchemathesisConfig:
    data: dict[str, Any] = {
        "workers": 1,
        "request-timeout": 10,
        "generation": {"max-examples": max_examples, "database": "none"},
        "phases": {"stateful": {"enabled": False}},
        "checks": {
            "enabled": True,
            # A generated body can exceed the server's cap before it breaks the schema: 413 is a rejection too.
            "negative_data_rejection": {
                "expected-statuses": [400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429, "5XX"]
            },
        },
        "operations": [
            {
                "include-path": "/v1/policies",
                "include-method": "PUT",
                "checks": {"positive_data_acceptance": {"enabled": False}},
            }
        ],
    }
    if seed is not None:
        data["seed"] = seed
    if token is not None:
        data["headers"] = {"Authorization": f"Bearer {token}"}
    return SchemathesisConfig.from_dict(data)


def run_contract(url: str, token: str | None, max_examples: int, seed: int | None) -> tuple[list[str], int]:
    """(problems, scenarios run): every failed check and every engine error, each with a curl to reproduce it."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", config=_config(token, max_examples, seed))
    problems: list[str] = []
    scenarios = 0
    for event in from_schema(schema).execute():
        if isinstance(event, events.ScenarioFinished):
            scenarios += 1
            for checks in event.recorder.checks.values():
                for check in checks:
                    info = check.failure_info
                    if info is not None:
                        problems.append(f"{event.label}: {check.name}: {info.failure.title}\n  {info.code_sample}")
        elif isinstance(event, events.NonFatalError):
            problems.append(f"{event.label}: error: {event.info.message}")
        elif isinstance(event, events.FatalError):
            problems.append(f"fatal: {event.exception!r}")
    return sorted(set(problems)), scenarios


def _assert_conforms(h: Harness, token: str | None, max_examples: int, seed: int | None) -> None:
    start = time.monotonic()
    problems, scenarios = run_contract(h.url, token, max_examples, seed)
    assert scenarios > 0, "schemathesis ran nothing"
    assert not problems, f"{len(problems)} contract failures in {time.monotonic() - start:.0f} s:\n" + "\n".join(
        problems[:40]
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("who", ["admin", "anonymous"])
def test_openapi_contract(contract_server: Harness, who: str) -> None:
    token = contract_server.admin_token if who == "admin" else None
    # Without a token nearly every operation answers 401 before it reads the body: a few examples each find what
    # ten would (the deep run below takes 300 either way).
    _assert_conforms(contract_server, token, max_examples=10 if token else 4, seed=FAST_SEED)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("who", ["admin", "anonymous"])
def test_openapi_contract_deep(contract_server: Harness, who: str) -> None:
    token = contract_server.admin_token if who == "admin" else None
    _assert_conforms(contract_server, token, max_examples=300, seed=None)


# -- the failures the first run found, pinned ----------------------------------------------------------------------
def test_out_of_range_cursor_is_422_naming_it(contract_server: Harness) -> None:
    with contract_server.http() as http:
        r = http.get("/v1/events", params={"cursor": 2**64}, headers=_admin(contract_server))
    assert r.status_code == 422 and r.json()["field"] == "cursor", r.text


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/devices/d0", {"id": "d0", "node": "n0", "numa_node": False}, "numa_node"),
        ("/v1/pools/p0", {"gpu_quota": True}, "gpu_quota"),
        ("/v1/pools/p0", {"memory_base_gb": "7"}, "memory_base_gb"),
        ("/v1/pools/p0", {"memory_base_gb": 20}, "memory_ceiling_gb"),  # above the default ceiling (12)
        ("/v1/devices/d0", {"id": "d1", "node": "n0"}, "id"),
    ],
)
def test_wrong_json_types_and_cross_field_rules_are_422_naming_the_field(
    contract_server: Harness, path: str, body: dict[str, Any], field: str
) -> None:
    with contract_server.http() as http:
        r = http.put(path, json=body, headers=_admin(contract_server))
    assert r.status_code == 422 and r.json()["field"] == field, r.text


def test_integral_floats_are_integers(contract_server: Harness) -> None:
    """JSON Schema's integer includes 3.0: what the document calls valid is accepted."""
    with contract_server.http() as http:
        r = http.put(
            "/v1/devices/d2", json={"id": "d2", "node": "n0", "numa_node": 1.0}, headers=_admin(contract_server)
        )
    assert r.status_code == 200 and r.json()["numa_node"] == 1, r.text


def test_405_lists_every_method_of_the_path(contract_server: Harness) -> None:
    with contract_server.http() as http:
        r = http.request("PATCH", "/v1/pools/pool-0", headers=_admin(contract_server))
    assert r.status_code == 405 and r.json()["error"] == "method_not_allowed"
    assert {m.strip() for m in r.headers["allow"].split(",")} >= {"GET", "PUT", "DELETE"}


def test_document_has_only_json_schema_keywords_and_error_bodies(contract_server: Harness) -> None:
    """Bounds pydantic could not translate (raw ge/le) would be ignored by every client and fuzzer; every error
    status carries the error body."""
    with contract_server.http() as http:
        doc = http.get("/openapi.json").json()
    assert not re.findall(r'"(ge|le|gt|lt)": ', json.dumps(doc))
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            if path.startswith("/v1/"):  # token-checked; rate limited but for healing and batches (see ratelimit.py)
                unlimited = path.startswith("/v1/heal/") or path == "/v1/heartbeats"  # a batch's items: 429 each
                expected = {"401", "403"} | (set() if unlimited else {"429"})
                assert expected <= set(op["responses"]), (method, path)
            for status, answer in op["responses"].items():
                if status.startswith("4") or (status == "503" and path.startswith("/v1/")):
                    schema = answer["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)


def test_a_failing_store_read_is_the_documented_503(
    contract_app: FastAPI, contract_server: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    def down(*_args: Any) -> None:
        raise StoreError("connection refused by db.internal:5432")

    monkeypatch.setattr(contract_app.state.cp.store, "query_events", down)
    with contract_server.http() as http:
        r = http.get("/v1/events", headers=_admin(contract_server))
    assert r.status_code == 503 and r.json()["error"] == "unavailable"
    assert "db.internal" not in r.text  # the store's error goes to the log, not to the caller


def _admin(h: Harness) -> dict[str, str]:
    return {"Authorization": f"Bearer {h.admin_token}"}
