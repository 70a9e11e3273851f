"""Fleet comparison: flag a worker that is slow or unstable *relative to its peers*, with robust statistics.

A fixed threshold cannot tell one straggler from a pool that is slow as a whole (a saturated link, a
bigger model, a new environment version). Comparing each worker with the median of its peers can: when
one rank of eight arrives 40 ms late at gradient sync, the median stays where the seven healthy ranks
are and the straggler stands out; when all eight slow down together, the median moves with them and
nobody is flagged. That is the point: a whole-pool slowdown is a pool problem, for the caller to see in
``FleetReport.stats`` (the pool's median over time), not a reason to degrade one worker.

Per role (actors are compared with actors, learners with learners: their step times differ by design)
and per feature, among the workers that report a finite value:

- ``median`` and ``mad`` (the median absolute deviation, scaled by 1.4826 so that it estimates the
  standard deviation under normal noise). Both ignore up to half of the values, so a few stragglers
  cannot drag the baseline they are judged against.
- ``z = (value - median) / scale`` with
  ``scale = max(mad, max(min_abs_excess, min_rel_excess * |median|) / z_threshold, 1e-9)``.
  The floor on ``scale`` matters when the peers are (nearly) identical: with MAD = 0 a plain robust z
  is infinite for any difference at all, 0.01 ms included. Flooring ``scale`` at "the smallest excess
  worth reporting, divided by the threshold" makes ``|z| > z_threshold`` equivalent to "the excess
  exceeds the floors" exactly when the spread is below that size, and keeps ``z`` a readable number.
  The last ``1e-9`` only avoids a division by zero when every floor is 0.
- A worker is an ``Outlier`` only if ``z`` exceeds ``z_threshold`` in the feature's direction AND its
  excess over the median exceeds ``min_abs_excess`` AND ``min_rel_excess * |median|`` AND at least
  ``min_peers`` workers of the role report the feature (with fewer there is no majority to say who is
  the odd one out).

Pure: no clock, no I/O; the caller gathers the latest metrics of each worker and calls ``compare``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from dsec import pacing

Direction = Literal["high", "low", "both"]
DIRECTIONS: tuple[Direction, ...] = ("high", "low", "both")

#: Scales the MAD to a consistent estimate of the standard deviation for normally distributed noise.
MAD_TO_SIGMA = 1.4826
# Guards the division when every floor is 0 and the peers are identical.
_MIN_SCALE = 1e-9


def _finite_nonneg(name: str, value: object) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: expected a finite number >= 0")


@dataclass(frozen=True)
class FeatureSpec:
    """One worker metric to compare across peers, and how large a difference must be to matter.

    ``direction``: which side is bad. "high" for times and volatility (a fast worker is not a problem),
    "low" for rates, "both" for statistics whose healthy value is a centre (a variance shift either way).
    ``min_abs_excess`` / ``min_rel_excess``: the excess over the median must exceed both
    ``min_abs_excess`` and ``min_rel_excess * |median|``, so near-identical healthy peers (where the MAD
    is tiny and any z is large) are never flagged for differences nobody would act on.
    """

    name: str
    direction: Direction
    min_abs_excess: float
    min_rel_excess: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name={self.name!r} is invalid: expected a non-empty metric name")
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction={self.direction!r} is invalid: expected one of {list(DIRECTIONS)}")
        _finite_nonneg("min_abs_excess", self.min_abs_excess)
        _finite_nonneg("min_rel_excess", self.min_rel_excess)


#: The metrics the probe reports that are comparable across peers of one role. The absolute floors are
#: set at differences that are within scheduling/measurement noise of a healthy pool, so identical peers
#: are never flagged for them; the relative floors keep a small spread around a large median quiet.
DEFAULT_FEATURES: tuple[FeatureSpec, ...] = (
    # Mean wall time of a training/env step. 5 ms is below timer and scheduler jitter for RL steps
    # (typically tens to hundreds of ms); 10% slower than the median is the least worth acting on.
    FeatureSpec("step_ms_mean", "high", min_abs_excess=5.0, min_rel_excess=0.10),
    # Median time between optimizer steps not spent waiting for gradient sync (forward, backward, optimizer, data
    # and env work): the rank's own speed, which neither a slow link nor a late peer changes. Device health acts on
    # it (a migration is expensive), so 25%: a throttling or failing card is slower than that; peers sharing a
    # loaded host differ by less (3 ranks of a small PPO on 2 cores: 6-8 ms each).
    FeatureSpec("compute_ms_p50", "high", min_abs_excess=5.0, min_rel_excess=0.25),
    # How late a rank arrives at gradient sync vs its earliest peer (median over the interval). This is
    # the straggler signal: one late rank stalls every other rank in the collective. 5 ms is jitter;
    # the relative floor stays loose because a healthy pool's median lag is small and noisy.
    FeatureSpec("sync_lag_ms_p50", "high", min_abs_excess=5.0, min_rel_excess=0.25),
    # Median duration of the worker's own sync calls (network path, NIC, PCIe): same reasoning.
    FeatureSpec("sync_latency_ms_p50", "high", min_abs_excess=5.0, min_rel_excess=0.25),
    # Coefficient of variation of episode lengths (dimensionless, already relative: no relative floor).
    # 0.1 is the run-to-run spread of a stationary environment; more means erratic episodes.
    FeatureSpec("episode_length_cv", "high", min_abs_excess=0.1, min_rel_excess=0.0),
    # log(var(recent) / var(reference)) of returns; healthy is ~0, so either sign is a change and a
    # relative floor around a ~0 median is meaningless. 0.7 ~ a 2x variance change.
    FeatureSpec("reward_variance_shift", "both", min_abs_excess=0.7, min_rel_excess=0.0),
    # Least-squares slope of the gradient norm per update: positive = growing (diverging) while peers
    # decay. 0.01/update is +0.5 over the probe's 50-update window, below that is noise. The median
    # slope hovers around 0, so no relative floor.
    FeatureSpec("grad_norm_slope", "high", min_abs_excess=0.01, min_rel_excess=0.0),
)


@dataclass(frozen=True)
class FleetConfig:
    """``z_threshold``: robust z beyond which a worker is an outlier (3.5 is the usual cut-off for
    MAD-based z, Iglewicz & Hoaglin). ``min_peers``: workers of a role that must report a feature before
    it is compared (>= 3: with two there is no majority to say which one is off)."""

    z_threshold: float = 3.5
    min_peers: int = 3
    features: tuple[FeatureSpec, ...] = DEFAULT_FEATURES

    def __post_init__(self) -> None:
        z = self.z_threshold
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not math.isfinite(z) or z <= 0:
            raise ValueError(f"z_threshold={z!r} is invalid: expected a finite number > 0")
        if isinstance(self.min_peers, bool) or not isinstance(self.min_peers, int) or self.min_peers < 3:
            raise ValueError(f"min_peers={self.min_peers!r} is invalid: expected an integer >= 3")
        object.__setattr__(self, "features", tuple(self.features))
        names = [f.name for f in self.features]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"features={duplicates!r} are listed more than once: expected unique names")


@dataclass(frozen=True)
class PeerSample:
    """The latest metrics of one worker. ``group`` is carried for the caller (e.g. a data-parallel
    group); comparison is per role. Metrics that are missing, non-numeric or not finite are ignored."""

    worker_id: str
    role: str
    group: str
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id={self.worker_id!r} is invalid: expected a non-empty worker id")
        # Role is a str enum; its hash is not the hash of its value, so normalise to the plain string
        # to group Role.ACTOR and "actor" together.
        role: object = self.role
        if isinstance(role, enum.Enum):
            role = role.value
        if not isinstance(role, str) or not role:
            raise ValueError(f"role={self.role!r} is invalid: expected a non-empty role name")
        object.__setattr__(self, "role", role)

    def value(self, name: str) -> float | None:
        """The metric as a finite float, or None if it is missing or unusable."""
        v = self.metrics.get(name)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        v = float(v)
        return v if math.isfinite(v) else None


@dataclass(frozen=True)
class RoleStats:
    """Baseline of one feature among the workers of one role. ``mad`` is scaled (x 1.4826). Reported for
    every role/feature with at least one value, compared or not (``n`` < ``min_peers``): tracking the
    median over time is how a caller sees a whole-pool slowdown, which by design flags nobody."""

    role: str
    feature: str
    n: int
    median: float
    mad: float

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "feature": self.feature, "n": self.n, "median": self.median, "mad": self.mad}


@dataclass(frozen=True)
class Outlier:
    """A worker whose ``feature`` is off from its role's ``median``. ``z`` is signed (positive: above the
    median) and uses the floored scale, so with ``mad`` = 0 it is finite."""

    worker_id: str
    role: str
    feature: str
    value: float
    median: float
    mad: float
    z: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "role": self.role,
            "feature": self.feature,
            "value": self.value,
            "median": self.median,
            "mad": self.mad,
            "z": self.z,
        }


@dataclass(frozen=True)
class FleetReport:
    """``stats`` sorted by role then feature (config order); ``outliers`` by role, feature, worker id."""

    stats: tuple[RoleStats, ...]
    outliers: tuple[Outlier, ...]

    def outliers_by_worker(self) -> dict[str, list[Outlier]]:
        """Outliers grouped per worker (workers in id order), for one alert per worker."""
        out: dict[str, list[Outlier]] = {}
        for o in sorted(self.outliers, key=lambda o: o.worker_id):
            out.setdefault(o.worker_id, []).append(o)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"stats": [s.to_dict() for s in self.stats], "outliers": [o.to_dict() for o in self.outliers]}


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2


def _is_outlier(spec: FeatureSpec, value: float, median: float, scale: float, z_threshold: float) -> float | None:
    """The signed z if ``value`` is an outlier for ``spec``, else None."""
    z = (value - median) / scale
    if spec.direction == "high":
        excess, beyond = value - median, z > z_threshold
    elif spec.direction == "low":
        excess, beyond = median - value, z < -z_threshold
    else:
        excess, beyond = abs(value - median), abs(z) > z_threshold
    if beyond and excess > spec.min_abs_excess and excess > spec.min_rel_excess * abs(median):
        return z
    return None


_FLOAT_OR_NONE = frozenset({float, type(None)})


def _finite_column(metrics: list[Mapping[str, Any]], name: str) -> tuple[list[int], list[float]]:
    """The indexes of ``metrics`` whose ``name`` is a finite number (not a bool), and those values as floats: what
    ``PeerSample.value`` reads, one column at a time (a pool's judgment reads 7 features of 10,000 workers)."""
    column = [m.get(name) for m in metrics]
    if set(map(type, column)) <= _FLOAT_OR_NONE:  # reported summaries: the common case
        index = [i for i, v in enumerate(column) if v is not None and v - v == 0.0]  # finite: inf - inf is nan
        return index, [column[i] for i in index]  # type: ignore[misc]
    index, values = [], []
    for i, v in enumerate(column):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(f := float(v)):
            index.append(i)
            values.append(f)
    return index, values


def _beyond(
    direction: Direction, index: list[int], values: list[float], median: float, cut: float
) -> list[tuple[int, float]]:
    """The (index, value) pairs whose distance from ``median`` in ``direction`` may exceed ``cut`` (z_threshold x
    scale): the only candidates ``_is_outlier`` can flag, found in one pass without a call per worker. Loose by a
    billionth, so that no value the exact test flags is left out by rounding; ``_is_outlier`` then decides."""
    cut *= 1.0 - 1e-9
    pairs = zip(index, values, strict=True)
    if direction == "high":
        return [(i, v) for i, v in pairs if v - median > cut]
    if direction == "low":
        return [(i, v) for i, v in pairs if median - v > cut]
    return [(i, v) for i, v in pairs if abs(v - median) > cut]


def compare(samples: Iterable[PeerSample], config: FleetConfig | None = None) -> FleetReport:
    """Compare every worker with the peers of its role, feature by feature. Worker ids must be unique."""
    config = config if config is not None else FleetConfig()
    by_role: dict[str, list[PeerSample]] = {}
    seen: set[str] = set()
    for sample in pacing.paced(samples):
        if sample.worker_id in seen:
            raise ValueError(f"worker_id={sample.worker_id!r} appears more than once: expected one sample per worker")
        seen.add(sample.worker_id)
        by_role.setdefault(sample.role, []).append(sample)

    stats: list[RoleStats] = []
    outliers: list[Outlier] = []
    for role in sorted(by_role):
        peers = by_role[role]
        metrics = [s.metrics for s in peers]
        for spec in config.features:
            pacing.checkpoint()  # each feature is a few passes over the role's peers
            index, values = _finite_column(metrics, spec.name)
            if not values:
                continue
            median = _median(values)
            mad = MAD_TO_SIGMA * _median([abs(v - median) for v in values])
            stats.append(RoleStats(role=role, feature=spec.name, n=len(values), median=median, mad=mad))
            if len(values) < config.min_peers:
                continue
            floor = max(spec.min_abs_excess, spec.min_rel_excess * abs(median))
            scale = max(mad, floor / config.z_threshold, _MIN_SCALE)
            found = []
            for i, v in _beyond(spec.direction, index, values, median, config.z_threshold * scale):
                z = _is_outlier(spec, v, median, scale, config.z_threshold)
                if z is not None:
                    found.append(Outlier(peers[i].worker_id, role, spec.name, v, median, mad, z))
            outliers.extend(sorted(found, key=lambda o: (o.worker_id, o.value)))
    return FleetReport(stats=tuple(stats), outliers=tuple(outliers))
