"""Bodies of the admin API's other writes: tokens, the policy file, placements and a tool's event."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from dsec.control.schemas.fields import EVENT_DATA_RULES, Bool, Float, Name, Strict, _event_data


class TokenCreate(Strict):
    """A pool token names its pool (``kind`` defaults to pool); read and admin tokens have none."""

    # The cross-field rule in JSON Schema terms (OpenAPI 3.1), so generated clients and fuzzers see it too.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {"properties": {"kind": {"const": "pool"}}},
            "then": {"required": ["pool"], "properties": {"pool": {"type": "string"}}},
            "else": {"properties": {"pool": {"type": "null"}}},
        }
    )
    kind: Literal["pool", "read", "admin"] = "pool"
    pool: Name | None = None
    label: str = Field("", max_length=200)

    @model_validator(mode="after")
    def _pool_for_pool_tokens(self) -> TokenCreate:
        if self.kind == "pool" and not self.pool:
            raise ValueError("pool is required for a pool token")
        if self.kind != "pool" and self.pool:
            raise ValueError(f"a{'n' if self.kind == 'admin' else ''} {self.kind} token has no pool")
        return self


class PolicyUpload(Strict):
    """Body of PUT /v1/policies: the YAML text of a policy file and a name for its error messages."""

    model_config = ConfigDict(extra="forbid", str_max_length=1 << 20)
    text: str = Field(..., max_length=1 << 20)
    source: str = Field("policies.yaml", max_length=256)


class PlacementWorker(Strict):
    name: Name
    role: Literal["learner", "actor", "other"] = "learner"
    memory_gb: Float = Field(8.0, gt=0, le=4096)
    key: str | None = Field(None, max_length=256)
    device: Name | None = Field(
        None,
        description="pin: the worker stays on (or goes to) this device, assigned before the others whatever its "
        "health; an unknown device is a 422, one outside the pool or held by another job leaves the worker unplaced",
    )


class PlacementGroup(Strict):
    name: Name
    workers: list[PlacementWorker] = Field(..., min_length=1, max_length=4096)
    load_class: Literal["long-episode", "short-episode", "sync-heavy"] = "short-episode"
    replay_share: Bool = False


class PlacementRequest(Strict):
    """Body of POST /v1/placements: a job's worker groups to place."""

    name: Name
    pool: Name | None = None
    groups: list[PlacementGroup] = Field(..., min_length=1, max_length=1024)

    @field_validator("groups")
    @classmethod
    def _unique_names(cls, groups: list[PlacementGroup]) -> list[PlacementGroup]:
        # An assignment is found by worker name, and a group restarts by name: both must be unique in the job.
        for what, names in (
            ("group", [g.name for g in groups]),
            ("worker", [w.name for g in groups for w in g.workers]),
        ):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{what} names must be unique in a job: {', '.join(dup)} repeated")
        pinned = [w.device for g in groups for w in g.workers if w.device is not None]
        dup = sorted({d for d in pinned if pinned.count(d) > 1})
        if dup:
            raise ValueError(f"a device takes one worker: {', '.join(dup)} pinned more than once (workers[].device)")
        return groups


class EventRecord(Strict):
    """Body of POST /v1/events: an event a tool records (a launcher's recovery timeline, a note)."""

    type: Literal["recovery", "log"]
    pool: Name | None = None
    worker_id: str | None = Field(None, max_length=64)
    data: dict[str, Any] = Field(default_factory=dict, description=EVENT_DATA_RULES)

    @field_validator("data")
    @classmethod
    def _data_ok(cls, v: dict[str, Any]) -> dict[str, Any]:
        return _event_data(v)
