"""Role inference from the probe's own counters, and how a configured role switches it off."""

from __future__ import annotations

import pytest

from dsec.probe.config import ProbeConfig
from dsec.probe.roles import OPTIMIZER_PATIENCE, RoleInference

BASE = {"DSEC_ENDPOINT": "http://127.0.0.1:1", "DSEC_SANDBOX_ID": "p"}


def _observe(r: RoleInference, env: int = 0, updates: int = 0, syncs: int = 0, opt: bool = False) -> str | None:
    inferred = r.observe(env_steps=env, updates=updates, gradient_syncs=syncs, has_optimizer=opt)
    return None if inferred is None else inferred.role


def test_env_steps_without_optimizer_steps_make_an_actor_once() -> None:
    r = RoleInference(actor_env_steps=100)
    assert _observe(r, env=99) is None and r.role == "other"
    inferred = r.observe(env_steps=100, updates=0, gradient_syncs=0, has_optimizer=False)
    assert inferred is not None and inferred.role == "actor"
    assert inferred.evidence["env_steps"] == 100 and inferred.evidence["optimizer_steps"] == 0
    assert inferred.evidence["rule"] == "100 env steps without an optimizer step"
    assert _observe(r, env=5000) is None  # told once


def test_a_built_optimizer_gets_a_rollouts_patience() -> None:
    r = RoleInference(actor_env_steps=100)
    assert _observe(r, env=100 * OPTIMIZER_PATIENCE - 1, opt=True) is None
    assert _observe(r, env=100 * OPTIMIZER_PATIENCE, opt=True) == "actor"


@pytest.mark.parametrize(
    ("env", "syncs", "rule"),
    [
        (512, 3, "synchronized optimizer step"),
        (0, 3, "synchronized optimizer step"),
        (512, 0, "optimizer steps and env steps"),
        (0, 0, "optimizer step"),
    ],
)
def test_an_optimizer_step_makes_a_learner(env: int, syncs: int, rule: str) -> None:
    r = RoleInference(actor_env_steps=100)
    inferred = r.observe(env_steps=env, updates=1, gradient_syncs=syncs, has_optimizer=True)
    assert inferred is not None and inferred.role == "learner" and inferred.evidence["rule"] == rule
    assert inferred.evidence["gradient_syncs"] == syncs


def test_an_actor_that_starts_learning_becomes_a_learner_and_stays_one() -> None:
    r = RoleInference(actor_env_steps=10)
    assert _observe(r, env=10) == "actor"
    assert _observe(r, env=20, updates=1) == "learner"
    assert _observe(r, env=10_000, updates=1) is None and r.role == "learner"


def test_auto_is_the_default_and_an_explicit_role_is_kept() -> None:
    auto = ProbeConfig.from_env(BASE)
    assert auto is not None and auto.infer_role and auto.reporter.role == "other"
    assert auto.role_actor_env_steps == 1000
    explicit = ProbeConfig.from_env({**BASE, "DSEC_ROLE": "learner"})
    assert explicit is not None and not explicit.infer_role and explicit.reporter.role == "learner"
    also_auto = ProbeConfig.from_env({**BASE, "DSEC_ROLE": "auto", "DSEC_ROLE_ACTOR_STEPS": "50"})
    assert also_auto is not None and also_auto.infer_role and also_auto.role_actor_env_steps == 50
    code = ProbeConfig.from_env(BASE, role="actor")  # dsec.attach(role="actor")
    assert code is not None and not code.infer_role and code.reporter.role == "actor"


def test_invalid_roles_are_named() -> None:
    with pytest.raises(ValueError, match="role='critic'"):
        ProbeConfig.from_env({**BASE, "DSEC_ROLE": "critic"})
    with pytest.raises(ValueError, match="role_actor_env_steps=0"):
        ProbeConfig.from_env({**BASE, "DSEC_ROLE_ACTOR_STEPS": "0"})
