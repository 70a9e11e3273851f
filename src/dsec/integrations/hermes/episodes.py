"""One agent run (a Hermes ``run_conversation``): its counts while it runs, what a scorer is handed once it ended, and
the scorer ``$DSEC_HERMES_SCORER`` names."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dsec.integrations.hermes.settings import SCORER_ENV


@dataclass(frozen=True)
class EpisodeResult:
    """One finished agent run, as handed to a scorer."""

    session_id: str
    task_id: str
    completed: bool  # Hermes: the run ended with a final answer
    interrupted: bool  # Hermes: the user (or the harness) interrupted it
    llm_calls: int
    llm_errors: int
    tool_calls: int
    tool_failures: int
    duration_s: float
    user_message: str | None
    final_response: str | None
    ended_by: str  # "session_end", or "abandoned" when Hermes never closed it (an API failure, exit)

    @property
    def success(self) -> bool:
        return self.completed and not self.interrupted


Scorer = Callable[[EpisodeResult], "float | None"]


@dataclass
class _Episode:
    """An open run's counts, while the monitor waits for Hermes to close it."""

    session_id: str
    task_id: str
    started: float
    last_activity: float
    failing: bool = False  # the last LLM request failed (Hermes may have given up on the run)
    llm_calls: int = 0
    llm_errors: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    turn_started: float | None = None
    user_message: str | None = None
    final_response: str | None = None
    request_started: dict[str, float] = field(default_factory=dict)


def load_scorer(spec: str) -> Scorer:
    """``"package.module:function"`` -> the function."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{SCORER_ENV}={spec!r} is invalid: expected 'package.module:function'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{SCORER_ENV}={spec!r} is not callable")
    scorer: Scorer = obj
    return scorer
