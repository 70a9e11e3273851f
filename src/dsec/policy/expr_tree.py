"""A parsed policy expression (the tree :func:`dsec.policy.expr.parse` builds) and its evaluation.

Missing data is NaN (unknown); see :mod:`dsec.policy.expr` for the language and its three-valued logic.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


# -- AST ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Metric:
    name: str
    offset: int


@dataclass(frozen=True)
class RangeCall:
    func: str
    metric: str
    window_s: float
    offset: int


@dataclass(frozen=True)
class Unary:
    op: str
    operand: Node


@dataclass(frozen=True)
class Binary:
    op: str
    left: Node
    right: Node


Node = Num | Metric | RangeCall | Unary | Binary


def _metrics(node: Node) -> set[str]:
    if isinstance(node, Metric):
        return {node.name}
    if isinstance(node, RangeCall):
        return {node.metric}
    if isinstance(node, Unary):
        return _metrics(node.operand)
    if isinstance(node, Binary):
        return _metrics(node.left) | _metrics(node.right)
    return set()


def _truth(x: float) -> bool:
    return not math.isnan(x) and x != 0.0


def _eval(
    node: Node,
    instant: Callable[[str], float],
    ranged: Callable[[str, float], Sequence[tuple[float, float]]],
    now: float,
) -> float:
    if isinstance(node, Num):
        return node.value
    if isinstance(node, Metric):
        return instant(node.name)
    if isinstance(node, RangeCall):
        return range_value(node.func, ranged(node.metric, node.window_s), node.window_s)
    if isinstance(node, Unary):
        v = _eval(node.operand, instant, ranged, now)
        if node.op == "-":
            return -v
        return math.nan if math.isnan(v) else float(not _truth(v))
    left = _eval(node.left, instant, ranged, now)
    right = _eval(node.right, instant, ranged, now)
    if node.op in ("and", "or"):
        # Three-valued: unknown (NaN) stays unknown unless the other side decides (false and x, true or x).
        decisive = 0.0 if node.op == "and" else 1.0
        sides = [math.nan if math.isnan(v) else float(_truth(v)) for v in (left, right)]
        if decisive in sides:
            return decisive
        return math.nan if any(math.isnan(v) for v in sides) else 1.0 - decisive
    if math.isnan(left) or math.isnan(right):
        return math.nan  # unknown: a rule never fires on data it does not have, not even under `not`
    if node.op == "+":
        return left + right
    if node.op == "-":
        return left - right
    if node.op == "*":
        return left * right
    if node.op == "/":
        return left / right if right != 0 else math.nan
    return float(
        {">": left > right, "<": left < right, ">=": left >= right, "<=": left <= right, "==": left == right,
         "!=": left != right}[node.op]
    )  # fmt: skip


def range_value(func: str, samples: Sequence[tuple[float, float]], window_s: float) -> float:
    """A range function over ``samples`` ((t, v), oldest first, already limited to the window)."""
    values = [v for _, v in samples if not math.isnan(v)]
    if func == "count_over_time":
        return float(len(values))
    if not values:
        return math.nan
    if func == "avg_over_time":
        return sum(values) / len(values)
    if func == "min_over_time":
        return min(values)
    if func == "max_over_time":
        return max(values)
    if func == "last_over_time":
        return values[-1]
    if func == "delta":
        return values[-1] - values[0]
    # increase / rate: growth of a counter, a drop being a reset (the counter restarted from 0).
    growth = 0.0
    for prev, cur in itertools.pairwise(values):
        growth += cur - prev if cur >= prev else cur
    if func == "increase":
        return growth
    return growth / window_s
