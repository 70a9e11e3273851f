"""Cost accounting (pure): device-hours by phase, DSec's own overhead and the opportunity cost of degrading, over
recorded events and worker records. See ``phases`` (what a device-hour was spent on), ``accounting`` (the
report), ``ledger`` (the same report kept up to date between refreshes) and docs/observability.md ("Cost
accounting")."""

from dsec.cost.accounting import (
    CostReport,
    PoolCost,
    ProcessUsage,
    account,
    recovery_comparison,
    snapshot_overhead,
    throughput_effect,
)
from dsec.cost.ledger import CostLedger
from dsec.cost.phases import (
    PHASES,
    PROGRESS_METRICS,
    STATE_TYPES,
    WINDOW_TYPES,
    Hours,
    Interval,
    Segment,
    Window,
    WindowError,
    WorkerRecord,
    diff_ci,
    mean_ci,
    worker_segments,
)

__all__ = [
    "PHASES",
    "PROGRESS_METRICS",
    "STATE_TYPES",
    "WINDOW_TYPES",
    "CostLedger",
    "CostReport",
    "Hours",
    "Interval",
    "PoolCost",
    "ProcessUsage",
    "Segment",
    "Window",
    "WindowError",
    "WorkerRecord",
    "account",
    "diff_ci",
    "mean_ci",
    "recovery_comparison",
    "snapshot_overhead",
    "throughput_effect",
    "worker_segments",
]
