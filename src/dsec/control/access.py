"""Who may do what: token kinds, the checks routes make, and tokens' lifecycle (create, list, revoke).

Token kinds (docs/security.md has the threat model)::

    admin    every route
    read     every GET of the admin API (dashboards, `dsec status`); nothing that changes state
    pool     registers workers in its pool (devices of that pool only, up to max_workers_per_token live ones);
             registers runtimes for allow-listed callback hosts
    worker   heartbeats, deregisters and reads the directive of its own worker
    runtime  reports for its own runtime

Checks authenticate before they look anything up, so an unknown id and someone else's id answer the same 403 to a
token that may not see either, and a 403 names nothing but the request's own values.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dsec.control import auth, errors
from dsec.control.store import Store, TokenRow

if TYPE_CHECKING:
    from dsec.control.state import HotState, LiveWorker


class Access:
    def __init__(
        self,
        state: HotState,
        store: Store,
        clock: Callable[[], float],
        configured_admin: str | None,
        runtime_token: Callable[[str], bool],
    ) -> None:
        self.state = state
        self.store = store
        self.clock = clock
        self.configured_admin = auth.hash_token(configured_admin) if configured_admin else None
        self._runtime_token = runtime_token

    def load(self) -> None:
        st = self.state
        for tok in self.store.list_tokens():
            if tok.kind == "admin":
                st.admin_token_hashes.add(tok.token_hash)
            elif tok.kind == "read":
                st.read_token_hashes.add(tok.token_hash)
            elif tok.pool:
                st.pool_token_hashes[tok.token_hash] = tok.pool
        if self.configured_admin:
            st.admin_token_hashes.add(self.configured_admin)

    # -- checks -----------------------------------------------------------------------------------------------------
    def kind(self, token_hash: str) -> str | None:
        """admin | read | pool | worker | runtime, or None for a token nobody issued."""
        st = self.state
        if token_hash in st.admin_token_hashes:
            return "admin"
        if token_hash in st.read_token_hashes:
            return "read"
        if token_hash in st.pool_token_hashes:
            return "pool"
        if token_hash in st.worker_token_hashes:
            return "worker"
        return "runtime" if self._runtime_token(token_hash) else None

    def is_admin(self, token: str | None) -> bool:
        return token is not None and auth.hash_token(token) in self.state.admin_token_hashes

    def require_admin(self, token: str | None) -> None:
        if token is None:
            raise errors.unauthorized()
        if not self.is_admin(token):
            raise errors.forbidden("this route needs an admin token")

    def require_read(self, token: str | None) -> None:
        """Admin or read-only token."""
        if token is None:
            raise errors.unauthorized()
        h = auth.hash_token(token)
        if h not in self.state.admin_token_hashes and h not in self.state.read_token_hashes:
            raise errors.forbidden("this route needs an admin or read-only token")

    def pool_of_token(self, token: str | None) -> str | None:
        return None if token is None else self.state.pool_token_hashes.get(auth.hash_token(token))

    def batch_sender(self, token: str | None) -> None:
        """Who may send ``POST /v1/heartbeats``: an admin token, or the token of a worker this control plane knows
        (a node agent sends one of its batch's own). It only lets the body be parsed: every item is authorized by
        its own worker token (``worker_for``), so a sender can beat only for workers whose tokens it was given."""
        if token is None:
            raise errors.unauthorized()
        h = auth.hash_token(token)
        if h in self.state.worker_token_hashes or h in self.state.admin_token_hashes:
            return
        if h in self.state.pool_token_hashes:
            raise errors.forbidden("a pool token registers workers; a batch of heartbeats needs a worker's token")
        if self.kind(h) is not None:
            raise errors.forbidden("a batch of heartbeats is sent with the token of one of its workers")
        raise errors.forbidden("unknown or revoked token")

    def worker_for(self, worker_id: str, token: str | None, read: bool = False) -> LiveWorker:
        """The worker, if ``token`` is its own token or an admin token (or, with ``read``, a read-only token)."""
        if token is None:
            raise errors.unauthorized()
        st = self.state
        h = auth.hash_token(token)
        w = st.workers.get(worker_id)
        if h in st.admin_token_hashes or (read and h in st.read_token_hashes):
            if w is None:
                raise errors.not_found("worker", worker_id, "worker_id")
            return w
        if w is not None and auth.same_hash(h, w.token_hash):
            return w
        if h in st.pool_token_hashes:
            raise errors.forbidden("a pool token registers workers; heartbeats need the worker's own token")
        own = st.worker_token_hashes.get(h)
        if own is not None:
            # The caller's own id only: whether worker_id exists, and where, is not this token's business.
            raise errors.forbidden(
                f"this token is worker {own!r}'s; a worker reports only as itself, not as worker_id {worker_id!r}",
                "worker_id",
            )
        if self.kind(h) is not None:
            raise errors.forbidden(f"this token may not act on worker_id {worker_id!r}", "worker_id")
        raise errors.forbidden("unknown or revoked token")

    # -- lifecycle --------------------------------------------------------------------------------------------------
    async def create(self, kind: str, pool: str | None, label: str) -> str:
        if kind == "pool" and pool not in self.state.pools:
            raise errors.not_found("pool", str(pool), "pool")
        token = auth.new_token(auth.PREFIXES[kind])
        row = TokenRow(auth.hash_token(token), pool if kind == "pool" else None, kind, label, self.clock())
        await asyncio.to_thread(self.store.put_token, row)
        if kind == "admin":
            self.state.admin_token_hashes.add(row.token_hash)
        elif kind == "read":
            self.state.read_token_hashes.add(row.token_hash)
        else:
            self.state.pool_token_hashes[row.token_hash] = str(pool)
        return token

    async def list(self) -> list[dict[str, Any]]:
        rows = await asyncio.to_thread(self.store.list_tokens)
        return [
            {
                "id": auth.token_id(r.token_hash),
                "kind": r.kind,
                "pool": r.pool,
                "label": r.label,
                "created_at": r.created_at,
            }
            for r in sorted(rows, key=lambda r: (r.created_at, r.token_hash))
        ]

    async def revoke(self, token_id: str) -> None:
        st = self.state
        if self.configured_admin and auth.token_id(self.configured_admin) == token_id:
            raise errors.conflict(
                "this admin token comes from the configuration (DSEC_ADMIN_TOKEN or $DSEC_HOME/admin.token): "
                "change it there and restart",
                "token_id",
            )
        known = [*st.admin_token_hashes, *st.read_token_hashes, *st.pool_token_hashes]
        hashes = [h for h in known if auth.token_id(h) == token_id]
        if not hashes:
            raise errors.not_found("token", token_id, "token_id")
        for h in hashes:
            await asyncio.to_thread(self.store.delete_token, h)  # durable first: a restart must not revive it
            self.forget(h)

    def forget(self, token_hash: str) -> None:
        st = self.state
        st.admin_token_hashes.discard(token_hash)
        st.read_token_hashes.discard(token_hash)
        st.pool_token_hashes.pop(token_hash, None)

    def forget_pool(self, pool: str) -> None:
        """The pool is gone (its token rows went with it, in the store's transaction)."""
        for h in [h for h, p in self.state.pool_token_hashes.items() if p == pool]:
            self.forget(h)
