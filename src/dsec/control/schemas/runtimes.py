"""Bodies of the webhook protocol for agent runtimes (docs/webhooks.md): registration with a callback URL, a
runtime's report, and a policy pushed to it."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsec.control.schemas.fields import Bool, Float, Int, Name, Strict, _check_json_value

_H16 = "[0-9A-Fa-f]{1,4}"
# IPv6 in brackets, without an embedded IPv4 (the forms RFC 4291 section 2.2 lists as 1 and 2).
_IPV6 = "|".join(
    [
        f"(?:{_H16}:){{7}}{_H16}",
        f"(?:{_H16}:){{1,7}}:",
        *(f"(?:{_H16}:){{1,{6 - k}}}(?::{_H16}){{1,{k + 1}}}" for k in range(6)),
        f":(?::{_H16}){{1,7}}",
        "::",
    ]
)
_PORT = "(?:[1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
# What egress.check_callback_url parses (urlsplit): a host name or IPv4, or a bracketed IPv6; no user-info; no
# fragment. Whether a literal address is private depends on the settings: the field's description says so.
# Path and query: visible ASCII but '#' (a URL is ASCII, RFC 3986; non-ASCII is percent-encoded). Not \S: what counts
# as whitespace differs between ECMA regexes (the schema's readers) and pydantic's (U+0085, for one).
_PATH = '(?:[/?][!-"$-~]*)?'
CALLBACK_URL_PATTERN = rf"^https?://(?:[A-Za-z0-9._~-]+|\[(?:{_IPV6})\])(?::{_PORT})?{_PATH}$"


class RuntimeRegister(Strict):
    """Body of POST /v1/runtimes: an agent runtime that wants DSec's policies at its callback URL."""

    name: Name
    type: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    callback_url: str = Field(
        ...,
        max_length=2048,
        pattern=CALLBACK_URL_PATTERN,
        description="http(s), no user-info, no fragment, port 1-65535; a literal loopback, private or link-local "
        "address is refused (422) unless webhook_allow_private",
    )
    secret: str = Field(..., min_length=16, max_length=512)
    pool: Name | None = None


class RuntimeReport(Strict):
    """Body of POST /v1/runtimes/{id}/report."""

    concurrent_agents: Int = Field(..., ge=0, le=10_000_000)
    avg_llm_latency_ms: Float = Field(..., ge=0, le=3_600_000)
    function_calling: Bool


_SCALAR: dict[str, Any] = {"type": ["string", "number", "boolean", "null"]}


class PolicyPush(BaseModel):
    """Body of POST /v1/runtimes/{id}/policies: ``policy`` plus its parameters (JSON scalars or lists of them)."""

    # What _params checks, in the schema: at most 32 parameters named by at most 64 characters, each a scalar or a
    # list of at most 256 scalars.
    model_config = ConfigDict(
        extra="allow",
        allow_inf_nan=False,
        json_schema_extra={
            "additionalProperties": {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR, "maxItems": 256}]},
            "maxProperties": 33,
            "propertyNames": {"maxLength": 64},
        },
    )
    policy: str = Field(
        ...,
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="the policy's name; every other field is a parameter (integers within 64 bits)",
    )

    @model_validator(mode="after")
    def _params(self) -> PolicyPush:
        extra = self.model_extra or {}
        if len(extra) > 32:
            raise ValueError("at most 32 policy parameters")
        for key, value in extra.items():
            if len(key) > 64:
                raise ValueError(f"parameter name {key[:20]!r}... is longer than 64 characters")
            items = value if isinstance(value, list) else [value]
            if len(items) > 256 or not all(v is None or isinstance(v, (bool, int, float, str)) for v in items):
                raise ValueError(f"parameter {key!r}: expected a JSON scalar or a list of at most 256 scalars")
            _check_json_value(items)  # 64-bit integers: the push is stored and sent as JSON
        return self
