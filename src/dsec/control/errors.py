"""API errors: every 4xx names the field (or the id) that caused it.

Body: ``{"error": <code>, "message": <human text>, "field": <dotted path or null>, "details": [...]}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from dsec.errors import DsecError


class ErrorBody(BaseModel):
    """What every error answer carries (``ApiError.body()``, validation errors, 413, 429): the OpenAPI model of it."""

    error: str = Field(..., description="a stable code: invalid, not_found, conflict, fenced, rate_limited, ...")
    message: str = Field(..., description="human text naming the field and the value")
    field: str | None = Field(..., description="dotted path of the field (or header, or id) at fault, or null")
    details: list[dict[str, Any]] = Field(..., description="one entry per problem (validation errors)")


# Why each documented error status is answered; the OpenAPI descriptions (docs/protocol.md has the full list).
STATUS_REASONS: dict[int, str] = {
    401: "no or malformed Authorization: Bearer header",
    403: "the token may not do this (another pool, worker or runtime; not admin; unknown or revoked)",
    404: "no such id (to admin and read tokens; other tokens get 403 for ids they may not know exist)",
    409: "conflicts with the current state",
    413: "request body larger than max_body_bytes",
    422: "invalid input: malformed JSON, wrong type, out of range, unknown field; `field` names it",
    429: "over a rate limit or budget (Retry-After on the per-token rate limit)",
    503: "the state store is unavailable; nothing was applied, retry",
}


def documented(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI ``responses=`` entries for error statuses, each with the error body's model."""
    return {s: {"model": ErrorBody, "description": STATUS_REASONS[s]} for s in statuses}


class ApiError(DsecError):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        field: str | None = None,
        details: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.field = field
        self.details = details or []

    def body(self) -> dict[str, Any]:
        return {"error": self.code, "message": self.message, "field": self.field, "details": self.details}


def not_found(what: str, value: str, field: str) -> ApiError:
    return ApiError(404, "not_found", f"{field} {value!r}: no such {what}", field)


def unauthorized(message: str = "missing or malformed Authorization: Bearer <token> header") -> ApiError:
    return ApiError(401, "unauthorized", message, "Authorization")


def forbidden(message: str, field: str = "Authorization") -> ApiError:
    return ApiError(403, "forbidden", message, field)


def conflict(message: str, field: str) -> ApiError:
    return ApiError(409, "conflict", message, field)


def unavailable(message: str) -> ApiError:
    return ApiError(503, "unavailable", message, None)
