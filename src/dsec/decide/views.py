"""The immutable inputs of the decision core: what a decision may know about a worker.

The control plane builds a :class:`WorkerView` from its live worker record at the moment of a decision; the
simulator builds them from its arrays. Decisions never see the executor's mutable records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from dsec.health.interventions import agent_name
from dsec.model import DirectiveFields, WorkerState


@dataclass(frozen=True, slots=True)
class WorkerView:
    id: str
    pool: str
    role: str
    group: str
    rank: int
    state: WorkerState = WorkerState.ACTIVE
    fields: DirectiveFields = field(default_factory=DirectiveFields)  # the directive in force (desired)
    metrics: Mapping[str, float] = field(default_factory=dict)  # the latest fresh telemetry
    device: str | None = None

    @property
    def agent(self) -> str:
        """The name alerts about this worker carry (``<role>_<group>_<rank>``)."""
        return agent_name(self.role, self.group, self.rank)

    @property
    def active(self) -> bool:
        return self.state is WorkerState.ACTIVE
