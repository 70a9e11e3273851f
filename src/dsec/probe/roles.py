"""Role inference: what a probed process is, from what it does.

With ``--role auto`` (the default: no ``--role``, no ``DSEC_ROLE``) the worker registers as ``other`` and the probe
watches its own counters once per beat:

- an optimizer step -> ``learner`` at once. Evidence names whether its gradients were synchronized (DDP's comm hook
  or a recognised hand-written all-reduce counted a gradient sync), and whether the process also stepped
  environments (an on-policy learner that collects its own rollouts);
- ``actor_env_steps`` environment steps (``gymnasium.make`` / ``make_vec`` envs) without an optimizer step ->
  ``actor``. A process that built an optimizer but has not stepped it yet is given ten times as many env steps: an
  on-policy learner collects a whole rollout (thousands of steps) before its first update;
- an ``actor`` whose first optimizer step comes later becomes a ``learner`` (a second inference). A ``learner`` stays
  one; nothing is ever inferred back to ``other``.

An explicit role (``--role actor|learner|other``, ``DSEC_ROLE``, ``dsec.attach(role=...)``) is kept: no inference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

AUTO = "auto"
ROLES = ("actor", "learner", "other")
DEFAULT_ACTOR_ENV_STEPS = 1000
#: How much longer a process that built an optimizer may step environments before it counts as an actor.
OPTIMIZER_PATIENCE = 10


@dataclass(frozen=True)
class Inferred:
    role: str
    evidence: dict[str, Any]


class RoleInference:
    def __init__(self, actor_env_steps: int = DEFAULT_ACTOR_ENV_STEPS, role: str = "other") -> None:
        if actor_env_steps < 1:
            raise ValueError(f"role_actor_env_steps={actor_env_steps} is invalid: expected >= 1")
        self.actor_env_steps = actor_env_steps
        self.role = role

    def observe(self, *, env_steps: int, updates: int, gradient_syncs: int, has_optimizer: bool) -> Inferred | None:
        """The new role when the counters make one clear (once per change), else None."""
        if self.role == "learner":
            return None
        counts = {"env_steps": env_steps, "optimizer_steps": updates, "gradient_syncs": gradient_syncs}
        if updates > 0:
            if gradient_syncs > 0:
                rule = "synchronized optimizer step"
            elif env_steps > 0:
                rule = "optimizer steps and env steps"
            else:
                rule = "optimizer step"
            return self._become("learner", {**counts, "rule": rule})
        if self.role == "other":
            needed = self.actor_env_steps * (OPTIMIZER_PATIENCE if has_optimizer else 1)
            if env_steps >= needed:
                rule = f"{needed} env steps without an optimizer step"
                return self._become("actor", {**counts, "optimizer_built": has_optimizer, "rule": rule})
        return None

    def _become(self, role: str, evidence: dict[str, Any]) -> Inferred:
        self.role = role
        return Inferred(role, evidence)
