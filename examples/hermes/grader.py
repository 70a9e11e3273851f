"""An example episode scorer for the dsec_monitor Hermes plugin.

DSEC_HERMES_SCORER=grader:score (with this directory on PYTHONPATH) makes the plugin call ``score`` once per
agent run; what it returns is the episode's return (None: the default, 1.0 if the run completed else 0.0).
"""

from __future__ import annotations

from dsec.integrations.hermes import EpisodeResult


def score(result: EpisodeResult) -> float | None:
    if not result.completed:
        return 0.0
    # Full marks for an answer reached without failed tool calls, less for every failure on the way.
    return max(0.0, 1.0 - 0.25 * result.tool_failures)
