"""The telemetry contract: every metric name that crosses a process boundary, declared once.

Workers send a flat ``{name: number}`` map per heartbeat; the control plane reads some of those names and
computes ``dsec_*`` gauges of its own, which policies and Prometheus read. Each name is declared here with
its type, unit, meaning and the producers that write it, so both sides import one list and a contract test
(tests/unit/test_telemetry_contract.py) fails when a reader reads a name no producer writes, or a producer
writes a name that is not declared. docs/telemetry.md carries ``markdown_table()`` (regenerate: see that file).

Producers: ``probe`` (the in-process probe, dsec.probe), ``native`` (the C library, native/dsec_inject.c),
``hermes`` (the Hermes harness plugin, dsec.integrations.hermes) and ``server`` (gauges the control plane
computes). Names an application reports through ``Reporter.observe/gauge/inc`` are its own and not listed.

Use the constants (``telemetry.MEMORY_USED_GB.name``) or ``get(name)``. A name containing ``{i}`` is a
template for one metric per device index (``cuda{i}_allocated_gb`` -> ``cuda0_allocated_gb``).

Model layer: stdlib only, no work at import beyond building these tuples.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

__all__ = [
    "METRICS",
    "Kind",
    "Metric",
    "Producer",
    "get",
    "lookup",
    "markdown_table",
    "names",
    "policy_metrics",
]


class Kind(str, enum.Enum):
    """GAUGE: a value at the time of the beat (or over the beat's interval). COUNTER: cumulative since the
    process started; only grows. HISTOGRAM: Prometheus buckets (server only)."""

    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


class Producer(str, enum.Enum):
    PROBE = "probe"
    NATIVE = "native"
    HERMES = "hermes"
    SERVER = "server"


PROBE, NATIVE, HERMES, SERVER = Producer.PROBE, Producer.NATIVE, Producer.HERMES, Producer.SERVER
WORKER_PRODUCERS = frozenset({PROBE, NATIVE, HERMES})


@dataclass(frozen=True)
class Metric:
    """One declared metric. ``labels``: the labels a server metric carries (``pool``, ``worker``, ...);
    ``policy``: readable in policy expressions; ``prometheus``: exposed on ``GET /metrics``."""

    name: str
    kind: Kind
    unit: str
    meaning: str
    producers: tuple[Producer, ...]
    labels: tuple[str, ...] = ()
    policy: bool = False
    prometheus: bool = False
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.producers:
            raise ValueError(f"metric {self.name!r} has no producer: every declared name needs one")
        if (self.policy or self.prometheus) and self.producers != (SERVER,):
            raise ValueError(f"metric {self.name!r}: only server metrics are read by policies or exposed")
        if "{i}" in self.name:
            regex = re.escape(self.name).replace(re.escape("{i}"), "[0-9]+")
            object.__setattr__(self, "_pattern", re.compile(regex))

    @property
    def is_template(self) -> bool:
        return self._pattern is not None

    def matches(self, name: str) -> bool:
        return name == self.name if self._pattern is None else self._pattern.fullmatch(name) is not None


def _m(name: str, kind: Kind, unit: str, meaning: str, *producers: Producer) -> Metric:
    return Metric(name, kind, unit, meaning, producers)


def _server(name: str, kind: Kind, unit: str, meaning: str, labels: tuple[str, ...], **where: bool) -> Metric:
    return Metric(name, kind, unit, meaning, (SERVER,), labels, **where)


def _quantiles(prefix: str, meaning: str, *producers: Producer) -> tuple[Metric, Metric, Metric]:
    """The probe's per-interval percentiles (dsec.health.indicators.Percentiles: nearest rank)."""
    p50, p95, p99 = (_m(f"{prefix}_{q}", Kind.GAUGE, "ms", f"{meaning} ({q}, interval)", *producers)
                     for q in ("p50", "p95", "p99"))  # fmt: skip
    return p50, p95, p99


def _summary(prefix: str, unit: str, meaning: str, *producers: Producer) -> tuple[Metric, Metric, Metric]:
    """``Reporter.observe(prefix, x)``: mean, max and count of the interval's observations."""
    return (
        _m(f"{prefix}_mean", Kind.GAUGE, unit, f"{meaning}: mean over the interval", *producers),
        _m(f"{prefix}_max", Kind.GAUGE, unit, f"{meaning}: max over the interval", *producers),
        _m(f"{prefix}_count", Kind.GAUGE, "1", f"{meaning}: observations in the interval", *producers),
    )


G, C = Kind.GAUGE, Kind.COUNTER

# -- worker metrics: gradient sync and collectives (probe/telemetry.py, probe/ddp.py, probe/torch_hooks.py) ---
SYNC_OPS_TOTAL = _m("sync_ops_total", C, "1", "gradient syncs (DDP buckets) attempted", PROBE)
SYNC_OK_TOTAL = _m("sync_ok_total", C, "1", "gradient syncs without error within the latency cap", PROBE)
SYNC_ERRORS_TOTAL = _m("sync_errors_total", C, "1", "gradient syncs that raised", PROBE)
SYNC_SLOW_TOTAL = _m("sync_slow_total", C, "1", "gradient syncs slower than the latency cap", PROBE)
SYNC_BYTES_TOTAL = _m("sync_bytes_total", C, "bytes", "gradient bytes synchronized", PROBE)
GRAD_UPLOAD_BYTES_PER_S = _m("grad_upload_bytes_per_s", G, "bytes/s", "gradient bytes synced per second", PROBE)
BYTES_PER_SYNC = _m("bytes_per_sync", G, "bytes", "mean bytes per gradient sync in the interval", PROBE)
SYNC_LATENCY_MS_P50, SYNC_LATENCY_MS_P95, SYNC_LATENCY_MS_P99 = _quantiles(
    "sync_latency_ms", "duration of this rank's gradient syncs", PROBE
)
SYNC_LAG_MS_P50, SYNC_LAG_MS_P95, SYNC_LAG_MS_P99 = _quantiles(
    "sync_lag_ms", "how late this rank arrived at a synchronized step vs its earliest peer", PROBE
)
SYNC_COST_MS_P50, SYNC_COST_MS_P95, SYNC_COST_MS_P99 = _quantiles(
    "sync_cost_ms", "time the group lost per synchronized step because of this rank", PROBE
)
COLLECTIVE_OPS_TOTAL = _m("collective_ops_total", C, "1", "explicit torch.distributed collectives", PROBE)
COLLECTIVE_BYTES_TOTAL = _m("collective_bytes_total", C, "bytes", "bytes of explicit collectives", PROBE)
COLLECTIVE_LATENCY_MS_P50, COLLECTIVE_LATENCY_MS_P95, COLLECTIVE_LATENCY_MS_P99 = _quantiles(
    "collective_latency_ms", "duration of explicit collectives", PROBE
)
# -- optimizer (probe/torch_hooks.py) ------------------------------------------------------------------------
UPDATES_TOTAL = _m("updates_total", C, "1", "optimizer steps taken", PROBE)
SKIPPED_UPDATES_TOTAL = _m("skipped_updates_total", C, "1", "optimizer steps skipped (non-finite grads)", PROBE)
STEP_MS_MEAN = _m("step_ms_mean", G, "ms", "mean wall time of an optimizer step in the interval", PROBE)
COMPUTE_MS_P50, COMPUTE_MS_P95, COMPUTE_MS_P99 = _quantiles(
    "compute_ms", "time between optimizer steps not spent waiting for gradient sync (device health: p50)", PROBE
)
GRAD_NORM = _m("grad_norm", G, "1", "gradient norm at the latest optimizer step", PROBE)
GRAD_NORM_SLOPE = _m("grad_norm_slope", G, "1/update", "least-squares slope of the gradient norm (50 updates)", PROBE)
# -- environment and episodes (probe/gym_hooks.py; the Hermes plugin and the C library report episodes too) ---
ENV_STEPS_TOTAL = _m("env_steps_total", C, "1", "environment steps", PROBE)
ENV_STEPS_PER_S = _m("env_steps_per_s", G, "1/s", "environment steps per second since the last beat", PROBE)
EPISODES_TOTAL = _m("episodes_total", C, "1", "episodes finished", PROBE, NATIVE, HERMES)
TERMINATED_TOTAL = _m("terminated_total", C, "1", "episodes that terminated", PROBE, HERMES)
TRUNCATED_TOTAL = _m("truncated_total", C, "1", "episodes that were truncated", PROBE, HERMES)
INTERRUPTED_TOTAL = _m("interrupted_total", C, "1", "episodes interrupted (crash, tool failure)", PROBE, HERMES)
CONSECUTIVE_INTERRUPTED = _m("consecutive_interrupted", G, "1", "interrupted episodes in a row", PROBE, HERMES)
EPISODE_RETURN_MEAN = _m("episode_return_mean", G, "1", "mean episode return in the interval", PROBE, NATIVE, HERMES)
EPISODE_LENGTH_MEAN = _m(
    "episode_length_mean", G, "steps", "mean episode length in the interval", PROBE, NATIVE, HERMES
)
EPISODE_LENGTH_CV = _m("episode_length_cv", G, "1", "coefficient of variation of episode lengths", PROBE, HERMES)
REWARD_VARIANCE_SHIFT = _m(
    "reward_variance_shift", G, "1", "log(var(recent returns) / var(reference returns))", PROBE, HERMES
)
# -- actuators in force (probe/actuators.py), replica agreement (probe/replicas.py) ----------------------------
COMPRESSION_BITS = _m("compression_bits", G, "bits", "gradient compression in force", PROBE)
GRAD_ACCUM_STEPS = _m("grad_accum_steps", G, "1", "gradient accumulation in force", PROBE)
ASYNC_SAMPLING = _m("async_sampling", G, "bool", "1 while sampling is allowed, 0 while paused", PROBE, HERMES)
PRECISION_BITS = _m("precision_bits", G, "bits", "autocast precision in force (32, 16)", PROBE)
MEMORY_QUOTA_GB = _m("memory_quota_gb", G, "GB", "memory quota in force (only when one is set)", PROBE)
MEMORY_LIMIT_GB = _m(
    "memory_limit_gb", G, "GB", "allocator limit in force: the quota, or more where the card has room", PROBE
)
REPLICA_CHECKS_TOTAL = _m("replica_checks_total", C, "1", "replica agreement checks made", PROBE)
REPLICA_DRIFT_TOTAL = _m("replica_drift_total", C, "1", "checks that found drifted replicas", PROBE)
REPLICA_DRIFT = _m("replica_drift", G, "bool", "1 while the latest check found drift", PROBE)
# -- memory (probe/memory.py; Hermes: process RSS) ----------------------------------------------------------
MEMORY_USED_GB = _m(
    "memory_used_gb", G, "GB", "CUDA memory reserved, else process RSS; feeds dsec_sandbox_utilization_rate", PROBE,
    HERMES,
)  # fmt: skip
MEMORY_GROWTH_GB_PER_H = _m(
    "memory_growth_gb_per_h", G, "GB/h", "least-squares slope of memory_used_gb over the last 10 minutes", PROBE
)
CUDA_ALLOCATED_GB = _m("cuda{i}_allocated_gb", G, "GB", "memory allocated by tensors on CUDA device i", PROBE)
CUDA_RESERVED_GB = _m("cuda{i}_reserved_gb", G, "GB", "memory reserved by the caching allocator on device i", PROBE)
# -- the C library (native/dsec_inject.c build_beat) ----------------------------------------------------------
CUDA_MALLOC_BYTES_TOTAL = _m("cuda_malloc_bytes_total", C, "bytes", "bytes requested through cudaMalloc", NATIVE)
CUDA_MALLOC_COUNT_TOTAL = _m("cuda_malloc_count_total", C, "1", "successful cudaMalloc calls", NATIVE)
CUDA_MALLOC_FAILURES_TOTAL = _m("cuda_malloc_failures_total", C, "1", "failed cudaMalloc calls", NATIVE)
CUDA_FREE_COUNT_TOTAL = _m("cuda_free_count_total", C, "1", "cudaFree calls", NATIVE)
CUDA_ALLOCATED_BYTES = _m("cuda_allocated_bytes", G, "bytes", "bytes cudaMalloc'd and not freed", NATIVE)
NCCL_ALLREDUCE_BYTES_TOTAL = _m("nccl_allreduce_bytes_total", C, "bytes", "bytes through ncclAllReduce", NATIVE)
NCCL_ALLREDUCE_COUNT_TOTAL = _m("nccl_allreduce_count_total", C, "1", "ncclAllReduce calls", NATIVE)
NCCL_ALLREDUCE_LATENCY = _summary("nccl_allreduce_latency_ms", "ms", "ncclAllReduce call duration", NATIVE)
# -- the Hermes plugin (integrations/hermes/plugin.py) --------------------------------------------------------
EPISODES_ACTIVE = _m("episodes_active", G, "1", "agent runs open now", HERMES)
LLM_CALLS_TOTAL = _m("llm_calls_total", C, "1", "LLM requests answered", HERMES)
LLM_ERRORS_TOTAL = _m("llm_errors_total", C, "1", "LLM requests that failed", HERMES)
LLM_INPUT_TOKENS_TOTAL = _m("llm_input_tokens_total", C, "tokens", "prompt tokens sent", HERMES)
LLM_OUTPUT_TOKENS_TOTAL = _m("llm_output_tokens_total", C, "tokens", "completion tokens received", HERMES)
TOOL_CALLS_TOTAL = _m("tool_calls_total", C, "1", "tool calls made", HERMES)
TOOL_FAILURES_TOTAL = _m("tool_failures_total", C, "1", "tool calls that failed", HERMES)
LLM_CALL_MS = _summary("llm_call_ms", "ms", "LLM request duration", HERMES)
LLM_TURN_MS = _summary("llm_turn_ms", "ms", "agent turn duration (LLM requests and tools)", HERMES)
TOOL_CALL_MS = _summary("tool_call_ms", "ms", "tool call duration", HERMES)

# -- server gauges: what policies read (control/policies.py samples) and GET /metrics exposes (metrics.py) ----
POOL, WORKER = ("pool",), ("pool", "worker")
SANDBOX_UTILIZATION_RATE = _server(
    "dsec_sandbox_utilization_rate", G, "ratio", "mean over active workers of memory_used_gb / memory quota", POOL,
    policy=True, prometheus=True,
)  # fmt: skip
GRADIENT_SYNC_SUCCESS_RATE = _server(
    "dsec_gradient_sync_success_rate", G, "ratio", "sum(sync_ok_total) / sum(sync_ops_total); NaN before any sync",
    POOL, policy=True, prometheus=True,
)  # fmt: skip
SNAPSHOT_RECOVERY_TIME = _server(
    "dsec_snapshot_recovery_time", G, "s", "lower median of workers' latest restore_s; NaN before enough restores",
    POOL, policy=True, prometheus=True,
)  # fmt: skip
MELT_DOWN_COUNT = _server(
    "dsec_melt_down_count", C, "1", "breaker meltdowns in the pool (exposed as a gauge that only grows)", POOL,
    policy=True, prometheus=True,
)  # fmt: skip
DIRECTIVES_PENDING = _server(
    "dsec_directives_pending", G, "1", "active workers whose directive is not acked yet", POOL, policy=True,
    prometheus=True,
)  # fmt: skip
WORKERS_ACTIVE = _server("dsec_workers_active", G, "1", "active workers", POOL, policy=True)
WORKERS_LOST = _server("dsec_workers_lost", G, "1", "lost workers", POOL, policy=True)
POOL_MEMORY_USED_GB = _server("dsec_pool_memory_used_gb", G, "GB", "memory used by the pool", POOL, policy=True)
POOL_MEMORY_GRANTED_GB = _server(
    "dsec_pool_memory_granted_gb", G, "GB", "memory quota granted in the pool", POOL, policy=True
)
WORKER_MELT_DOWN_COUNT = _server(
    "dsec_worker_melt_down_count", C, "1", "breaker meltdowns of the worker", WORKER, policy=True, prometheus=True
)
BREAKER_LEVEL = _server(
    "dsec_breaker_level", G, "level", "degradation in force (0 healthy .. 3 sampling paused)", WORKER, policy=True,
    prometheus=True,
)  # fmt: skip
WORKER_SYNC_LATENCY_SECONDS = _server(
    "dsec_worker_sync_latency_seconds", G, "s",
    "the breaker's latency signal: sync_cost_ms_p50, else sync_latency_ms_p50", WORKER, prometheus=True,
)  # fmt: skip
WORKER_LATENCY_CAP_SECONDS = _server(
    "dsec_worker_latency_cap_seconds", G, "s", "latency cap in force (the worker's override, else its pool's)", WORKER,
    prometheus=True,
)  # fmt: skip
WORKERS = _server("dsec_workers", G, "1", "registered workers by state", ("pool", "state"), prometheus=True)
POOL_MEMORY_GB = _server(
    "dsec_pool_memory_gb", G, "GB", "pool memory: capacity, granted, used", ("pool", "kind"), prometheus=True
)
COST_DEVICE_SECONDS = _server(
    "dsec_cost_device_seconds", G, "s", "device-seconds allocated over the last hour by phase (GET /v1/cost)",
    ("pool", "phase"), prometheus=True,
)  # fmt: skip
COST_SNAPSHOT_BYTES = _server(
    "dsec_cost_snapshot_bytes", G, "bytes", "snapshot bytes written over the last hour (snapshot events)", POOL,
    prometheus=True,
)  # fmt: skip
COST_SNAPSHOT_BACKGROUND_SECONDS = _server(
    "dsec_cost_snapshot_background_seconds", G, "s", "snapshot background time over the last hour (total_ms)", POOL,
    prometheus=True,
)  # fmt: skip
HEARTBEATS_TOTAL = _server("dsec_heartbeats_total", C, "1", "heartbeats applied", POOL, prometheus=True)
HTTP_REQUESTS_TOTAL = _server(
    "dsec_http_requests_total", C, "1", "HTTP requests", ("route", "method", "status"), prometheus=True
)
HTTP_REQUEST_DURATION_SECONDS = _server(
    "dsec_http_request_duration_seconds", Kind.HISTOGRAM, "s", "HTTP request latency", ("route",), prometheus=True
)


def _collect(namespace: dict[str, object]) -> tuple[Metric, ...]:
    out: list[Metric] = []
    for value in namespace.values():
        for m in value if isinstance(value, tuple) else (value,):
            if isinstance(m, Metric) and m not in out:
                out.append(m)
    return tuple(out)


#: Every declared metric, in declaration order.
METRICS: tuple[Metric, ...] = _collect(dict(globals()))
_BY_NAME = {m.name: m for m in METRICS if not m.is_template}
_TEMPLATES = tuple(m for m in METRICS if m.is_template)
if len(_BY_NAME) + len(_TEMPLATES) != len(METRICS):
    raise RuntimeError("dsec.telemetry: a metric name is declared twice")


def lookup(name: str) -> Metric | None:
    """The declared metric ``name`` is (a template matches its instances), or None."""
    m = _BY_NAME.get(name)
    if m is not None:
        return m
    return next((t for t in _TEMPLATES if t.matches(name)), None)


def get(name: str) -> Metric:
    m = lookup(name)
    if m is None:
        raise KeyError(f"{name!r} is not a declared metric (dsec.telemetry; docs/telemetry.md)")
    return m


def names(*producers: Producer) -> frozenset[str]:
    """Declared names (templates as written), of any of ``producers`` when given."""
    return frozenset(m.name for m in METRICS if not producers or set(producers) & set(m.producers))


def policy_metrics(labels: tuple[str, ...]) -> tuple[str, ...]:
    """Server metrics policy expressions may read at a scope: ``("pool",)`` or ``("pool", "worker")``."""
    return tuple(m.name for m in METRICS if m.policy and m.labels == labels)


def markdown_table(metrics: Iterable[Metric] = METRICS) -> str:
    """The table docs/telemetry.md carries (a test checks the two agree)."""
    rows = ["| name | type | unit | producers | meaning |", "|---|---|---|---|---|"]
    for m in metrics:
        where = ", ".join(p.value for p in m.producers)
        extra = [f"labels {', '.join(m.labels)}"] if m.labels else []
        extra += ["policies"] * m.policy + ["/metrics"] * m.prometheus
        meaning = m.meaning + (f" ({'; '.join(extra)})" if extra else "")
        rows.append(f"| `{m.name}` | {m.kind.value} | {m.unit} | {where} | {meaning} |")
    return "\n".join(rows) + "\n"
