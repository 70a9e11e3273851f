"""The YAML policy engine: operators' experience as rules, with guardrails, dry runs and what-if replay.

rules.py parses and validates policy files; expr.py is the expression language; engine.py runs rules in given
time; series.py holds metric history; replay.py runs a file over recorded series in virtual time."""

from dsec.policy.engine import Decision, Engine, RuleState, Scope, Transition
from dsec.policy.rules import KNOBS, POOL_METRICS, WORKER_METRICS, PolicySet, Rule, compile_policies, load_policies
from dsec.policy.series import SeriesStore

__all__ = [
    "KNOBS",
    "POOL_METRICS",
    "WORKER_METRICS",
    "Decision",
    "Engine",
    "PolicySet",
    "Rule",
    "RuleState",
    "Scope",
    "SeriesStore",
    "Transition",
    "compile_policies",
    "load_policies",
]
