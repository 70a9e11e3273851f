"""``dsec.client``: a small synchronous client for the control-plane API (used by the probe and the CLI).

Exceptions::

    ClientError         (dsec.errors.TransportError) also: an answer that cannot be read, a malformed endpoint
     ├── ApiError       the server answered 4xx/5xx (status, code, message, field)
     └── Unreachable    no answer: connection refused, reset, timed out

No httpx exception escapes: each is translated here, with the httpx one as ``__cause__``.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from dsec.errors import TransportError


class ClientError(TransportError):
    """Base of all client errors."""


class ApiError(ClientError):
    def __init__(self, status: int, code: str, message: str, field: str | None) -> None:
        super().__init__(f"HTTP {status} {code}: {message}" + (f" (field: {field})" if field else ""))
        self.status = status
        self.code = code
        self.message = message
        self.field = field


class Unreachable(ClientError):
    """The control plane did not answer."""


class Client:
    """One keep-alive connection pool to a control plane. ``close()`` or use as a context manager."""

    def __init__(
        self,
        endpoint: str,
        token: str | None = None,
        timeout: float = 5.0,
        transport: httpx.BaseTransport | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        """``verify``: for an https endpoint, the SSL context to trust it with (e.g.
        ``ssl.create_default_context(cafile=...)`` for a private CA); the default trusts certifi's CAs, or the bundle
        in ``SSL_CERT_FILE`` — which is how a probe started by ``dsec run`` trusts a private CA."""
        self.endpoint = endpoint.rstrip("/")
        self.token = token
        try:
            self._http = httpx.Client(base_url=self.endpoint, timeout=timeout, transport=transport, verify=verify)
        except httpx.InvalidURL as exc:
            raise ClientError(f"endpoint {endpoint!r} is not a URL: {exc}; expected e.g. http://host:8000") from exc

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        token: str | None = None,
    ) -> Any:
        tok = token or self.token
        headers = {"Authorization": f"Bearer {tok}"} if tok else {}
        try:
            resp = self._http.request(method, path, json=json, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise Unreachable(f"{method} {self.endpoint}{path}: {exc or type(exc).__name__}") from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            # An answer that cannot be decoded, or a path that makes the URL invalid: retrying will not help,
            # so this is not Unreachable.
            raise ClientError(f"{method} {self.endpoint}{path}: {exc or type(exc).__name__}") from exc
        if resp.status_code >= 400:
            try:
                body = resp.json()
            except ValueError:
                body = {}
            raise ApiError(
                resp.status_code,
                str(body.get("error", "http_error")),
                str(body.get("message", resp.text[:200])),
                body.get("field"),
            )
        if resp.status_code == 204 or not resp.content:
            return None
        if resp.headers.get("content-type", "").startswith("application/json"):
            try:
                return resp.json()
            except ValueError as exc:
                raise ClientError(f"{method} {self.endpoint}{path}: the JSON answer does not parse: {exc}") from exc
        return resp.text

    # -- worker protocol -------------------------------------------------------------------------
    def register(
        self,
        pool: str,
        *,
        role: str = "other",
        group: str = "default",
        rank: int = 0,
        host: str = "",
        pid: int = 0,
        device: str | None = None,
        heartbeat_interval_s: float = 5.0,
        token: str | None = None,
    ) -> dict[str, Any]:
        body = {
            "pool": pool,
            "role": role,
            "group": group,
            "rank": rank,
            "host": host,
            "pid": pid,
            "device": device,
            "heartbeat_interval_s": heartbeat_interval_s,
        }
        return dict(self.request("POST", "/v1/workers/register", json=body, token=token))

    def heartbeat(
        self,
        worker_id: str,
        seq: int,
        *,
        acked_directive_version: int = 0,
        metrics: Mapping[str, float] | None = None,
        events: Sequence[Mapping[str, Any]] = (),
        token: str | None = None,
        inferred_role: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "seq": seq,
            "acked_directive_version": acked_directive_version,
            "metrics": dict(metrics or {}),
            "events": list(events),
        }
        if inferred_role is not None:
            body["inferred_role"] = dict(inferred_role)
        return dict(self.request("POST", f"/v1/workers/{worker_id}/heartbeat", json=body, token=token))

    def deregister(self, worker_id: str, reason: str = "exit", token: str | None = None) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/workers/{worker_id}/deregister", params={"reason": reason}, token=token))

    # -- admin -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/status"))

    def workers(self, pool: str | None = None, state: str | None = None) -> list[dict[str, Any]]:
        params = {k: v for k, v in {"pool": pool, "state": state}.items() if v is not None}
        return list(self.request("GET", "/v1/workers", params=params)["items"])

    def worker(self, worker_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/workers/{worker_id}"))

    def directive(self, worker_id: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/workers/{worker_id}/directive"))

    def set_directive(self, worker_id: str, **fields: Any) -> dict[str, Any]:
        return dict(self.request("PATCH", f"/v1/workers/{worker_id}/directive", json=fields))

    def pools(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/pools")["items"])

    def put_pool(self, name: str, **spec: Any) -> dict[str, Any]:
        return dict(self.request("PUT", f"/v1/pools/{name}", json=spec))

    def events(
        self,
        *,
        worker_id: str | None = None,
        pool: str | None = None,
        types: Sequence[str] = (),
        since: float | None = None,
        until: float | None = None,
        cursor: int = 0,
        limit: int = 100,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"cursor": cursor, "limit": limit}
        for key, value in (("worker_id", worker_id), ("pool", pool), ("since", since), ("until", until)):
            if value is not None:
                params[key] = value
        if types:
            params["type"] = list(types)
        return dict(self.request("GET", "/v1/events", params=params))

    def cost(self, pool: str | None = None, since: float | None = None, until: float | None = None) -> dict[str, Any]:
        """``GET /v1/cost``: cost accounting over [since, until) (unix seconds; default the last hour)."""
        params = {k: v for k, v in (("pool", pool), ("since", since), ("until", until)) if v is not None}
        return dict(self.request("GET", "/v1/cost", params=params))

    def all_events(self, **filters: Any) -> list[dict[str, Any]]:
        """Every matching event, following the cursor."""
        out: list[dict[str, Any]] = []
        cursor = 0
        while True:
            page = self.events(cursor=cursor, limit=1000, **filters)
            out.extend(page["items"])
            if page["next_cursor"] is None:
                return out
            cursor = int(page["next_cursor"])

    def create_token(self, pool: str | None = None, kind: str = "pool", label: str = "") -> str:
        body = {"kind": kind, "pool": pool if kind == "pool" else None, "label": label}
        return str(self.request("POST", "/v1/tokens", json=body)["token"])

    def tokens(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/tokens")["items"])

    def revoke_token(self, token_id: str) -> None:
        self.request("DELETE", f"/v1/tokens/{token_id}")

    def metrics_text(self) -> str:
        return str(self.request("GET", "/metrics"))

    def policies(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/policies"))

    def put_policies(self, text: str, source: str = "policies.yaml") -> dict[str, Any]:
        return dict(self.request("PUT", "/v1/policies", json={"text": text, "source": source}))

    def place(self, job: Mapping[str, Any], complete_only: bool = False) -> dict[str, Any]:
        params = {"complete_only": "true"} if complete_only else None
        return dict(self.request("POST", "/v1/placements", json=dict(job), params=params))

    def placement(self, job: str) -> dict[str, Any]:
        return dict(self.request("GET", f"/v1/placements/{job}"))

    def release_placement(self, job: str) -> None:
        self.request("DELETE", f"/v1/placements/{job}")

    def devices(self) -> list[dict[str, Any]]:
        return list(self.request("GET", "/v1/devices")["items"])

    def record_event(self, type: str, data: Mapping[str, Any], pool: str | None = None) -> int:
        body = {"type": type, "data": dict(data), "pool": pool}
        return int(self.request("POST", "/v1/events", json=body)["id"])

    def register_runtime(self, **spec: Any) -> dict[str, Any]:
        return dict(self.request("POST", "/v1/runtimes", json=spec))

    def runtime_report(self, runtime_id: str, token: str | None = None, **report: Any) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/runtimes/{runtime_id}/report", json=report, token=token))

    def push_policy(self, runtime_id: str, policy: str, **params: Any) -> dict[str, Any]:
        return dict(self.request("POST", f"/v1/runtimes/{runtime_id}/policies", json={"policy": policy, **params}))

    def deliveries(self, runtime_id: str) -> list[dict[str, Any]]:
        return list(self.request("GET", f"/v1/runtimes/{runtime_id}/deliveries")["items"])

    def metric_series(self) -> dict[str, Any]:
        return dict(self.request("GET", "/v1/metrics/series"))
