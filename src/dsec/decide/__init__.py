"""The decision core: what DSec decides, as pure functions shared by the control plane and the simulator.

Every function here takes typed, immutable inputs (a :class:`~dsec.decide.views.WorkerView`, a
:class:`~dsec.model.Pool`, metric samples, the time ``now`` as an argument) and returns *verdicts* — directive
patches, events, alerts, quota grants, occupancy for device health, policy gauge samples. Nothing here does I/O,
reads a clock, or touches shared state. The one kind of state a function may advance is the per-worker decision
state it is handed explicitly by its owner (a worker's :class:`~dsec.breaker.Breaker`, its
:class:`~dsec.health.interventions.PrecisionGuard`): the executor owns those and can snapshot/undo them.

Two executors carry verdicts out (the torchelastic pattern: a state handler returns actions, an executor applies
them):

* ``dsec.control`` — commits verdicts durably (events, directive versions) and answers the worker's heartbeat;
* ``dsec.sim`` — applies them to the simulated cluster in virtual time.

So a simulator result is evidence about the code that runs in production. Layering (checked by
tests/unit/test_import_contract.py): ``decide`` imports only the leaf cores (``model``, ``breaker``, ``health``,
``quota``, ``scheduler``, ``policy``, ``alerts`` for its severity type) — never ``control``, ``probe``, ``sim`` or
the CLI.
"""

from dsec.decide.beat import BeatInputs, BreakerMove, breaker_step, judge_beat
from dsec.decide.caps import caps_for, latency_signal, safe_latency_floor, sample_from
from dsec.decide.devices import DegradeVerdict, degrade, occupancy
from dsec.decide.fleet import FleetVerdict, judge_pool, judged_workers, slow_workers
from dsec.decide.gauges import PoolGauges, WorkerGauges, policy_samples, pool_gauges_of, pool_recovery_s
from dsec.decide.quotas import CardMemo, QuotaVerdict, observe_memory, plan_pool_quotas, precision_restore
from dsec.decide.verdicts import SOURCE, Change, Verdict, alert_event
from dsec.decide.views import WorkerView

__all__ = [
    "SOURCE",
    "BeatInputs",
    "BreakerMove",
    "CardMemo",
    "Change",
    "DegradeVerdict",
    "FleetVerdict",
    "PoolGauges",
    "QuotaVerdict",
    "Verdict",
    "WorkerGauges",
    "WorkerView",
    "alert_event",
    "breaker_step",
    "caps_for",
    "degrade",
    "judge_beat",
    "judge_pool",
    "judged_workers",
    "latency_signal",
    "observe_memory",
    "occupancy",
    "plan_pool_quotas",
    "policy_samples",
    "pool_gauges_of",
    "pool_recovery_s",
    "precision_restore",
    "safe_latency_floor",
    "sample_from",
    "slow_workers",
]
