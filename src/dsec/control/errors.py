"""API errors: every 4xx names the field (or the id) that caused it.

Body: ``{"error": <code>, "message": <human text>, "field": <dotted path or null>, "details": [...]}``.
"""

from __future__ import annotations

from typing import Any

from dsec.errors import DsecError


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
