"""The member side of the healing protocol's HTTP routes (control/healing.py): join, admit, fail, leave, watch.

Long-polls are asked again until answered. While the control plane is unreachable (restarting, say) every call
retries with exponential backoff and jitter until ``give_up_s`` has passed since the first failure; then
:class:`HealUnavailable` — the caller cannot heal and falls back (its process exits, the supervisor restarts the
group from its agreed snapshots).
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass
from typing import Any

from dsec.backoff import Backoff
from dsec.client import ApiError, Client, Unreachable
from dsec.errors import HealingError
from dsec.heal.membership import Plan


class HealUnavailable(HealingError):
    """The control plane did not answer for ``give_up_s``."""


class FencedOut(HealingError):
    """The control plane refused this process: another incarnation holds its rank, or it was declared dead."""


@dataclass(frozen=True)
class Identity:
    run: str
    pool: str
    group: str
    world: int
    rank: int
    incarnation: str
    device: str | None = None


# 50 ms after the first failure, doubling to 2 s: a restarting control plane is back within seconds, and a
# member that waits longer than it must keeps the whole group stalled.
RETRY = Backoff(initial_s=0.05, factor=2.0, max_s=2.0)


class HealClient:
    def __init__(self, endpoint: str, token: str | None, me: Identity, give_up_s: float = 60.0) -> None:
        self.me = me
        self.give_up_s = give_up_s
        # Long-polls hold a connection up to the server's poll time (20 s) plus slack; one client per thread.
        self._endpoint, self._token = endpoint, token
        self._local = threading.local()
        self._clients: list[Client] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._rng = random.Random()  # retry jitter

    def _client(self) -> Client:
        c = getattr(self._local, "client", None)
        if c is None:
            c = Client(self._endpoint, token=self._token, timeout=30.0)
            self._local.client = c
            with self._lock:
                self._clients.append(c)
        return c

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            for c in self._clients:
                c.close()
            self._clients.clear()

    def _call(self, method: str, path: str, *, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        first_failure: float | None = None
        failures = 0
        while True:
            try:
                return self._client().request(method, f"/v1/heal/{self.me.run}/{path}", json=json, params=params)
            except Unreachable:
                why = "unreachable"
            except ApiError as exc:
                if exc.status == 409 and exc.code == "fenced":
                    raise FencedOut(exc.message) from None
                if exc.status not in (429, 503):
                    raise
                why = "busy"  # rate-limited, or its store briefly unavailable: as unreachable, retry
            now = time.monotonic()
            first_failure = first_failure or now
            if now - first_failure > self.give_up_s or self._closed.is_set():
                raise HealUnavailable(f"control plane {why} for {now - first_failure:.1f} s") from None
            time.sleep(RETRY.delay(failures, self._rng))
            failures += 1

    # -- protocol --------------------------------------------------------------------------------------------
    def join(
        self,
        address: str,
        completed: int,
        epoch: int,
        view: tuple[int, ...] = (),
        replacement: bool = False,
        pending: str | None = None,
    ) -> Plan:
        me = self.me
        body = {
            "pool": me.pool,
            "group": me.group,
            "world": me.world,
            "rank": me.rank,
            "incarnation": me.incarnation,
            "address": address,
            "completed": completed,
            "epoch": epoch,
            "view": list(view),
            "replacement": replacement,
            "device": me.device,
            "pending": pending,
        }
        while True:
            out = self._call("POST", "join", json=body)
            if out.get("status") == "formed":
                return Plan.from_dict(out["plan"])

    def admit(self, epoch: int, completed: int) -> dict[str, Any]:
        """{"status": "formed", "plan": Plan} | {"status": "broken"} | {"status": "void"}."""
        body = {"rank": self.me.rank, "incarnation": self.me.incarnation, "epoch": epoch, "completed": completed}
        while True:
            out = dict(self._call("POST", "admit", json=body))
            if out.get("status") == "formed":
                out["plan"] = Plan.from_dict(out["plan"])
                return out
            if out.get("status") in ("broken", "void"):
                return out

    def fail(self, epoch: int, reason: str) -> None:
        me = self.me
        body = {"epoch": epoch, "rank": me.rank, "incarnation": me.incarnation, "reason": reason[:500]}
        self._call("POST", "fail", json=body)

    def leave(self) -> None:
        self._call("POST", "leave", json={"rank": self.me.rank, "incarnation": self.me.incarnation})

    def watch(self, since: int, timeout: float = 20.0) -> dict[str, Any]:
        return dict(self._call("GET", "watch", params={"since": since, "timeout": timeout}))
