"""The policy engine inside the control plane: sample gauges, evaluate rules, apply and audit their actions.

- Rules come from ``--policy FILE`` (``Settings.policy_file``) or from ``PUT /v1/policies`` (``dsec policy
  apply``), which validates, stores the text as the next policy version (with its ``policy`` event, in one
  transaction) and swaps the rules in place; the newest stored version is what a restarted control plane (on this
  host or another one, against the same database) loads when no ``--policy`` is given. A
  ``$DSEC_HOME/policies.yaml`` applied by an older version is moved into the store at start.
- Every ``policy_interval_s`` (in the reconcile loop) the pool and worker gauges are sampled into a bounded
  in-memory history and the rules are evaluated. History is not persisted: after a restart a window refills, except
  ``dsec_melt_down_count``, whose history is rebuilt from the durable meltdown events.
- Rule state (pending / firing, last action, action times for ``max_per``) changes are recorded as ``policy``
  events and replayed at startup, so a pending rule keeps its ``for`` clock across a restart.
- Actions are ``policy_action`` events (rule, scope, knob, old -> new, outcome, evidence); applied ones change the
  pool (a ``pool_changed`` event) or the worker's directive (``directive_set`` by ``policy:<rule>``). A pool's
  snapshot settings are also pushed to the directives of its active workers that still follow the pool's value.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsec.control import errors
from dsec.control.store import PolicyRow, Store, StoreConflict, WriteBatch
from dsec.decide import policy_samples
from dsec.model import Event, EventType, ModelError, Pool, WorkerState
from dsec.policy.engine import Decision, Engine, RuleState, Scope, Transition
from dsec.policy.rules import Knob, PolicySet, compile_policies
from dsec.policy.series import Key, SeriesStore
from dsec.yamlconf import ConfigError

if TYPE_CHECKING:
    from dsec.control.ports import Clock, DirectiveWriter, EventLog, GaugeSource, PoolWriter
    from dsec.control.settings import Settings
    from dsec.control.state import HotState

log = logging.getLogger(__name__)

DIRECTIVE_MIRRORS = ("snapshot_interval_s", "snapshot_compression_level")  # pool fields workers follow


def samples(gauges: GaugeSource, workers: bool = True) -> dict[Key, float]:
    """The gauges policies read, keyed (metric, pool, worker); per-worker ones only when ``workers``."""
    return policy_samples(gauges.pool_gauges(), gauges.worker_gauges() if workers else ())


def pool_knob(pool: Pool, name: str) -> float | None:
    if name in ("latency_cap_ms", "bandwidth_cap_mbps"):
        return float(getattr(pool.thresholds, name))
    if name == "gpu_quota":
        return float(pool.gpu_quota if pool.gpu_quota is not None else len(pool.devices))
    value = getattr(pool, name, None)
    return None if value is None else float(value)


def with_pool_knob(pool: Pool, name: str, value: float) -> Pool:
    if name in ("latency_cap_ms", "bandwidth_cap_mbps"):
        return replace(pool, thresholds=replace(pool.thresholds, **{name: float(value)}))
    data = pool.to_dict()
    data[name] = int(value) if name in ("gpu_quota", "snapshot_compression_level") else float(value)
    return Pool.from_dict(data)


class PolicyRunner:
    """Owns the rules, their history and their states; acts through the ports it is given."""

    def __init__(
        self,
        state: HotState,
        settings: Settings,
        events: EventLog,
        gauges: GaugeSource,
        directives: DirectiveWriter,
        pools: PoolWriter,
        clock: Clock,
    ) -> None:
        self.state = state
        self.settings = settings
        self.events = events
        self.gauges = gauges
        self.directives = directives
        self.pools = pools
        self.clock = clock
        self.interval_s = settings.policy_interval_s
        self.series = SeriesStore(retention_s=3600.0)
        self.engine = Engine(PolicySet())
        self._last_tick = -math.inf
        self._last_outcome: dict[tuple[str, str, str], str] = {}
        self.applied: PolicyRow | None = None  # the newest stored version (set by load and apply_text)
        self._apply_lock = asyncio.Lock()

    # -- loading ----------------------------------------------------------------------------------------
    def load(self, applied: PolicyRow | None = None) -> None:
        """Startup: the rules (``--policy`` file, else ``applied``: the newest stored version), their persisted
        states, and the meltdown history. Broken applied rules are logged and skipped; ``dsec serve --policy`` checks
        its file before it starts."""
        self.applied = applied
        text: str | None = None
        source = ""
        if self.settings.policy_file is not None:
            source = str(self.settings.policy_file)
            try:
                text = Path(source).read_text()
            except OSError as exc:
                log.error("policies not loaded: %s", exc)
        elif applied is not None:
            text, source = applied.text, applied.source
        if text is not None:
            try:
                policies = compile_policies(text, source)
            except ConfigError as exc:
                log.error("policies not loaded: %s", exc)
                policies = PolicySet()
            self._install(policies)
        states: dict[tuple[str, str], RuleState] = {}
        for ev in self.events.iter_events(EventType.POLICY):
            st = ev.data.get("state")
            if isinstance(st, dict) and "rule" in ev.data and "scope" in ev.data:
                states[(str(ev.data["rule"]), str(ev.data["scope"]))] = RuleState.from_dict(st)
        self.engine.load_states(states)
        self._seed_meltdowns()

    def _install(self, policies: PolicySet) -> None:
        self.engine.replace_policies(policies)
        # Keep enough history for the longest window, and at least an hour for what-if exports.
        self.series.retention_s = max(3600.0, policies.history_s + 2 * self.interval_s)

    def _seed_meltdowns(self) -> None:
        now = self.clock()
        since = now - self.series.retention_s
        points: dict[str, list[tuple[float, float]]] = {}
        recent = [ev for ev in self.events.iter_events(EventType.MELTDOWN, since=since) if ev.pool]
        for ev in recent:
            assert ev.pool is not None
            points.setdefault(ev.pool, []).append((ev.ts, 1.0))
        for pool, evs in points.items():
            total = float(self.state.meltdowns.get(pool, 0))
            count = total - len(evs)
            series = [(since, count)]
            for ts, _ in evs:
                count += 1
                series.append((ts, count))
            self.series.add_series(("dsec_melt_down_count", pool, None), series)

    async def apply_text(self, text: str, source: str = "policies.yaml") -> PolicySet:
        """Validate, store and install new rules (hot reload); ConfigError leaves the running rules untouched.

        Compiling runs on a worker thread, one upload at a time: a large or hostile file must not stall heartbeats,
        and concurrent uploads must not take every thread. The text is the next version, committed with its event
        in one transaction before the rules are in force."""
        async with self._apply_lock:
            policies = await asyncio.to_thread(compile_policies, text, source)
            now = self.clock()
            row = PolicyRow(version=self.version + 1, text=text, source=source, applied_at=now)
            data = {"phase": "loaded", "rules": sorted(policies.names), "version": row.version, "source": source}
            try:
                await self.events.commit(
                    WriteBatch(policies=[row], events=[Event(ts=now, type=EventType.POLICY, data=data)])
                )
            except errors.ApiError as exc:
                if isinstance(exc.__cause__, StoreConflict):
                    # Retrying cannot help: this control plane is not the only one writing the database.
                    raise errors.conflict(
                        f"policy version {row.version} was stored meanwhile by another control plane on this "
                        "database; restart this one to load it",
                        "text",
                    ) from None
                raise
            self.applied = row
            self._install(policies)
        return policies

    @property
    def version(self) -> int:
        """The newest stored policy version (0: none was ever applied)."""
        return self.applied.version if self.applied is not None else 0

    # -- the loop -------------------------------------------------------------------------------------------
    async def tick(self, force: bool = False) -> tuple[list[Decision], list[Transition]]:
        now = self.clock()
        if not force and now - self._last_tick < self.interval_s:
            return [], []
        self._last_tick = now
        # Per-worker history only when a rule reads it: thousands of workers x hours of samples is real memory.
        per_worker = any(r.level == "worker" for r in self.engine.policies.rules)
        self.series.add(now, samples(self.gauges, workers=per_worker))
        if not self.engine.policies.rules:
            return [], []
        decisions, transitions = self.engine.evaluate(now, self._scopes(), self.series, self._knob, self._suppressed)
        await self._record(decisions, transitions, now)
        return decisions, transitions

    def _scopes(self) -> list[Scope]:
        out = [Scope(p) for p in sorted(self.state.pools)]
        out += [
            Scope(w.pool, w.id, w.info.role.value)
            for w in sorted(self.state.workers.values(), key=lambda w: w.id)
            if w.state is WorkerState.ACTIVE
        ]
        return out

    def _suppressed(self, pool: str) -> bool:
        return self.state.pool_recovering_until.get(pool, 0.0) > self.clock()

    def _knob(self, scope: Scope, knob: Knob) -> float | None:
        pool = self.state.pools.get(scope.pool)
        if pool is None:
            return None
        if knob.level == "pool":
            return pool_knob(pool, knob.name)
        w = self.state.workers.get(scope.worker or "")
        if w is None:
            return None
        value = getattr(w.directive.fields, knob.name)
        if value is None and knob.name in ("latency_cap_ms", "bandwidth_cap_mbps"):
            return pool_knob(pool, knob.name)  # the per-worker cap starts from the pool's
        return None if value is None else float(value)

    async def _record(self, decisions: list[Decision], transitions: list[Transition], now: float) -> None:
        """The transitions and the actions' events; an action that changes something commits its event with the
        change (the pool, or the worker's directive), in one transaction."""
        events = [
            Event(ts=now, type=EventType.POLICY, pool=t.scope.pool, worker_id=t.scope.worker, data=t.to_event())
            for t in transitions
        ]
        for d in decisions:
            slot = (d.rule, d.scope.key, d.knob)
            repeated = (
                d.outcome in ("suppressed", "rate_limited", "no_value") and self._last_outcome.get(slot) == d.outcome
            )
            self._last_outcome[slot] = d.outcome
            if not repeated and not d.changes:
                events.append(self._action_event(d, d.to_event(), now))
        if events:
            await self.events.record_events(events)
        for d in decisions:
            if d.changes:
                try:
                    await self._apply(d, self._action_event(d, d.to_event(), now))
                except (errors.ApiError, ModelError) as exc:
                    log.warning("policy %s could not change %s of %s: %s", d.rule, d.knob, d.scope.key, exc)
                    data = {**d.to_event(), "outcome": "failed", "detail": str(exc)}
                    await self.events.record_events([self._action_event(d, data, self.clock())])

    @staticmethod
    def _action_event(d: Decision, data: dict[str, Any], now: float) -> Event:
        return Event(ts=now, type=EventType.POLICY_ACTION, pool=d.scope.pool, worker_id=d.scope.worker, data=data)

    async def _apply(self, d: Decision, action: Event) -> None:
        assert d.new is not None
        actor = f"policy:{d.rule}"
        if d.level == "pool":
            pool = self.state.pools[d.scope.pool]
            new_pool = with_pool_knob(pool, d.knob, d.new)
            await self.pools.put_pool(new_pool, actor=actor, events=[action])
            if d.knob in DIRECTIVE_MIRRORS:
                old = getattr(pool, d.knob)
                for w in list(self.state.workers.values()):
                    if (
                        w.pool == pool.name
                        and w.state is WorkerState.ACTIVE
                        and getattr(w.directive.fields, d.knob) == old
                    ):
                        await self.directives.set_directive(w, {d.knob: getattr(new_pool, d.knob)}, actor)
            return
        target = self.state.workers.get(d.scope.worker or "")
        if target is None:
            await self.events.record_events([action])  # the worker left meanwhile: the decision is still recorded
            return
        value: Any = int(d.new) if d.knob in ("compression_bits", "grad_accum_steps", "sync_priority",
                                              "snapshot_compression_level") else float(d.new)  # fmt: skip
        await self.directives.set_directive(target, {d.knob: value}, actor, extra_events=[action])

    def status(self) -> dict[str, Any]:
        ps = self.engine.policies
        from_store = self.settings.policy_file is None and self.applied is not None
        return {
            "source": ps.source,
            # The stored version in force; None when the rules come from --policy (or none were ever applied).
            "version": self.version if from_store else None,
            "interval_s": self.interval_s,
            "rules": [
                {
                    "name": r.name,
                    "when": r.when.text,
                    "for_s": r.for_s,
                    "level": r.level,
                    "pools": list(r.pools),
                    "dry_run": r.dry_run,
                    "states": {
                        scope: st.to_dict()
                        for (name, scope), st in sorted(self.engine.states.items())
                        if name == r.name
                    },
                }
                for r in ps.rules
            ],
        }


def import_policy_file(store: Store, path: Path, clock: Clock) -> None:
    """Startup: move a ``policies.yaml`` applied by an older version (it kept applied rules in that file) into the
    store as version 1, with its event, and remove the file. Left alone (with a warning) when the store already holds
    a version, which is newer than any file; left alone (with an error) when it cannot be read."""
    if not path.exists():
        return
    current = store.current_policy()
    if current is not None:
        log.warning("%s ignored: the store holds applied policies (version %d)", path, current.version)
        return
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        log.error("policies not imported from %s: %s", path, exc)
        return
    now = clock()
    row = PolicyRow(version=1, text=text, source=path.name, applied_at=now)
    data = {"phase": "loaded", "version": 1, "source": path.name, "imported_from": str(path)}
    store.write(WriteBatch(policies=[row], events=[Event(ts=now, type=EventType.POLICY, data=data)]))
    path.unlink()
    log.info("applied policies moved from %s into the state store", path)
