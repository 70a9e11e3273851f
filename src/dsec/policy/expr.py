"""The policy expression language: a small, safe subset of PromQL over DSec's own metrics (no eval).

Grammar (precedence low to high)::

    expr    := and ('or' and)*
    and     := cmp ('and' cmp)*
    cmp     := sum (('>' | '<' | '>=' | '<=' | '==' | '!=') sum)?
    sum     := term (('+' | '-') term)*
    term    := unary (('*' | '/') unary)*
    unary   := '-' unary | 'not' unary | primary
    primary := NUMBER | FUNC '(' METRIC '[' DURATION ']' ')' | METRIC | '(' expr ')'

``METRIC`` is a DSec metric name (an unknown name is an error); without a range it is the newest sample.
Range functions: ``increase`` (growth over the window, counter resets handled), ``rate`` (increase per second),
``delta`` (last - first), ``avg_over_time``, ``min_over_time``, ``max_over_time``, ``last_over_time``,
``count_over_time``. Durations: ``30s``, ``5m``, ``1h``, ``1d``, ``1h30m``.

Missing data is NaN (unknown); a comparison with unknown is unknown, `not` of unknown is unknown, ``false and
unknown`` is false and ``true or unknown`` is true; a rule holds only when its value is known and non-zero, so it
never fires on data it does not have.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dsec.errors import InvalidInput
from dsec.policy.expr_tree import Binary as Binary
from dsec.policy.expr_tree import Metric as Metric
from dsec.policy.expr_tree import Node as Node
from dsec.policy.expr_tree import Num as Num
from dsec.policy.expr_tree import RangeCall as RangeCall
from dsec.policy.expr_tree import Unary as Unary
from dsec.policy.expr_tree import _eval, _metrics
from dsec.policy.expr_tree import range_value as range_value

RANGE_FUNCS = (
    "increase",
    "rate",
    "delta",
    "avg_over_time",
    "min_over_time",
    "max_over_time",
    "last_over_time",
    "count_over_time",
)
COMPARISONS = (">=", "<=", "==", "!=", ">", "<")
# Bounds that keep parsing and evaluation (both recursive) far from Python's recursion limit: a rule is a line or
# two, not thousands of tokens.
MAX_TOKENS = 256
MAX_NESTING = 32
_DURATION_RE = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
_TOKEN_RE = re.compile(
    r"\s*(?:(?P<dur>\d+[smhd](?:\d+[smhd])*)(?![A-Za-z0-9_])"
    r"|(?P<num>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)(?![A-Za-z0-9_.])"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)"
    r"|(?P<op>>=|<=|==|!=|[><+\-*/()\[\]]))"
)


class ExprError(InvalidInput, ValueError):
    """A bad expression; ``offset`` is the 0-based character position of the problem."""

    def __init__(self, message: str, offset: int) -> None:
        super().__init__(message)
        self.message = message
        self.offset = offset


def parse_duration(text: str) -> float:
    """Seconds in ``text`` (``90s``, ``5m``, ``1h30m``, ``1d``); ValueError with the expected forms."""
    m = _DURATION_RE.match(text.strip()) if text.strip() else None
    if not m or not any(m.groups()):
        raise ValueError(f"{text!r} is not a duration: expected e.g. 30s, 5m, 1h, 1h30m, 1d")
    d, h, mi, s = (int(g) if g else 0 for g in m.groups())
    return float(d * 86400 + h * 3600 + mi * 60 + s)


@dataclass(frozen=True)
class _Tok:
    kind: str  # num | dur | name | op | end
    text: str
    offset: int


def _tokens(text: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN_RE.match(text, pos)
        if not m or m.end() == pos:
            start = pos + (len(text[pos:]) - len(text[pos:].lstrip()))
            word = re.match(r"[A-Za-z0-9_.]+", text[start:])
            if text[start].isdigit() and word:
                raise ExprError(f"{word.group()!r} is neither a number nor a duration (e.g. 30s, 5m, 1h)", start)
            raise ExprError(f"unexpected character {text[start]!r}", start)
        kind = m.lastgroup or "op"
        out.append(_Tok(kind, m.group(kind), m.start(kind)))
        pos = m.end()
    out.append(_Tok("end", "", len(text)))
    return out


class _Parser:
    def __init__(self, text: str, metrics: Sequence[str], other_level: Sequence[str] = ()) -> None:
        self.other_level = set(other_level)
        self.text = text
        self.toks = _tokens(text)
        if len(self.toks) > MAX_TOKENS:
            raise ExprError(f"expression too long: more than {MAX_TOKENS} tokens", self.toks[MAX_TOKENS].offset)
        self.depth = 0
        self.i = 0
        self.metrics = set(metrics)
        self.windows: list[float] = []

    @property
    def tok(self) -> _Tok:
        return self.toks[self.i]

    def take(self) -> _Tok:
        t = self.toks[self.i]
        self.i += 1
        return t

    def expect(self, text: str, what: str) -> _Tok:
        if self.tok.text != text:
            raise ExprError(f"expected {what}, found {self._found()}", self.tok.offset)
        return self.take()

    def _found(self) -> str:
        return "the end of the expression" if self.tok.kind == "end" else repr(self.tok.text)

    def parse(self) -> Node:
        if self.tok.kind == "end":
            raise ExprError("empty expression", 0)
        node = self.or_()
        if self.tok.kind != "end":
            raise ExprError(f"unexpected {self._found()} after a complete expression", self.tok.offset)
        return node

    def or_(self) -> Node:
        node = self.and_()
        while self.tok.text == "or":
            self.take()
            node = Binary("or", node, self.and_())
        return node

    def and_(self) -> Node:
        node = self.cmp()
        while self.tok.text == "and":
            self.take()
            node = Binary("and", node, self.cmp())
        return node

    def cmp(self) -> Node:
        node = self.sum()
        if self.tok.text in COMPARISONS:
            op = self.take().text
            node = Binary(op, node, self.sum())
            if self.tok.text in COMPARISONS:
                raise ExprError("comparisons do not chain: use 'and'", self.tok.offset)
        return node

    def sum(self) -> Node:
        node = self.term()
        while self.tok.text in ("+", "-"):
            op = self.take().text
            node = Binary(op, node, self.term())
        return node

    def term(self) -> Node:
        node = self.unary()
        while self.tok.text in ("*", "/"):
            op = self.take().text
            node = Binary(op, node, self.unary())
        return node

    def _nest(self, offset: int) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise ExprError(f"nested deeper than {MAX_NESTING} levels", offset)

    def unary(self) -> Node:
        if self.tok.text in ("-", "not"):
            op = self.take()
            self._nest(op.offset)
            node = Unary(op.text, self.unary())
            self.depth -= 1
            return node
        return self.primary()

    def primary(self) -> Node:
        t = self.tok
        if t.kind == "num":
            self.take()
            return Num(float(t.text))
        if t.text == "(":
            self.take()
            self._nest(t.offset)
            node = self.or_()
            self.expect(")", "')'")
            self.depth -= 1
            return node
        if t.kind == "name" and t.text not in ("and", "or", "not"):
            self.take()
            if self.tok.text == "(":
                return self.call(t)
            self.check_metric(t)
            if self.tok.text == "[":
                raise ExprError(
                    f"a range selector needs a function: e.g. avg_over_time({t.text}[1h]) or increase({t.text}[1h])",
                    self.tok.offset,
                )
            return Metric(t.text, t.offset)
        if t.kind == "dur":
            raise ExprError(f"a duration ({t.text}) is only valid inside [...]", t.offset)
        raise ExprError(f"expected a number, a metric or a function, found {self._found()}", t.offset)

    def call(self, fn: _Tok) -> Node:
        if fn.text not in RANGE_FUNCS:
            raise ExprError(f"unknown function {fn.text!r}: expected one of {', '.join(RANGE_FUNCS)}", fn.offset)
        self.expect("(", "'('")
        m = self.tok
        if m.kind != "name":
            raise ExprError(
                f"{fn.text}() takes a metric with a range, e.g. {fn.text}(dsec_melt_down_count[1h])", m.offset
            )
        self.take()
        self.check_metric(m)
        self.expect("[", f"a range after {m.text}, e.g. [1h]")
        d = self.tok
        if d.kind not in ("dur", "num"):
            raise ExprError(f"expected a duration such as 5m or 1h, found {self._found()}", d.offset)
        self.take()
        try:
            window = parse_duration(d.text)
        except ValueError as exc:
            raise ExprError(str(exc), d.offset) from None
        if window <= 0:
            raise ExprError("a range must be longer than 0s", d.offset)
        self.expect("]", "']'")
        self.expect(")", "')'")
        self.windows.append(window)
        return RangeCall(fn.text, m.text, window, fn.offset)

    def check_metric(self, t: _Tok) -> None:
        if t.text in self.metrics:
            return
        if t.text in self.other_level:
            raise ExprError(f"{t.text!r} is a per-worker metric: use it in a rule with scope level: worker", t.offset)
        close = difflib.get_close_matches(t.text, sorted(self.metrics), n=3, cutoff=0.6)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ExprError(f"unknown metric {t.text!r}{hint}", t.offset)


@dataclass(frozen=True)
class Expr:
    """A parsed expression; ``window_s`` is its longest range (how much history it needs)."""

    text: str
    root: Node
    window_s: float
    metrics: frozenset[str]

    def eval(
        self, instant: Callable[[str], float], ranged: Callable[[str, float], Sequence[tuple[float, float]]], now: float
    ) -> float:
        return _eval(self.root, instant, ranged, now)

    def observed(
        self, instant: Callable[[str], float], ranged: Callable[[str, float], Sequence[tuple[float, float]]], now: float
    ) -> float:
        """The measured side of a top-level comparison (``increase(...)`` in ``increase(...) > 3``): the evidence
        an audit event shows. NaN when the expression is not a comparison."""
        node = self.root
        if isinstance(node, Binary) and node.op in COMPARISONS:
            return _eval(node.left, instant, ranged, now)
        return math.nan


def parse(text: str, metrics: Sequence[str], other_level: Sequence[str] = ()) -> Expr:
    """Parse ``text``; ``metrics`` are the names it may read, ``other_level`` names that exist at another scope
    level (for a precise message)."""
    p = _Parser(text, metrics, other_level)
    root = p.parse()
    return Expr(text, root, max(p.windows, default=0.0), frozenset(_metrics(root)))
