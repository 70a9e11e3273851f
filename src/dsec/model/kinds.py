"""The enumerations of DSec's domain types (:mod:`dsec.model`): worker roles and states, device health, event
types, and the event types a worker may report itself."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """What a worker does in the RL job."""

    ACTOR = "actor"
    LEARNER = "learner"
    OTHER = "other"


class WorkerState(str, enum.Enum):
    """Liveness of a registered worker, as the control plane sees it.

    ACTIVE: heartbeats arrive within the allowed interval.
    LOST: missed ``lost_after_beats`` consecutive beats; directives are kept, it may come back.
    DEREGISTERED: left cleanly; terminal.
    """

    ACTIVE = "active"
    LOST = "lost"
    DEREGISTERED = "deregistered"


class DeviceHealth(str, enum.Enum):
    """Health of a device as judged by the scheduler (issue: device health)."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    DRAINED = "drained"
    PROBATION = "probation"


class EventType(str, enum.Enum):
    """Every kind of event the control plane records. Workers may only send the worker-side kinds."""

    REGISTERED = "registered"
    DEREGISTERED = "deregistered"
    LOST = "lost"
    REJOINED = "rejoined"
    # The probe inferred the worker's role from what it does (``from``, ``to``, ``evidence``); the record now says it.
    ROLE_INFERRED = "role_inferred"
    DIRECTIVE_SET = "directive_set"
    DIRECTIVE_ACKED = "directive_acked"
    # A worker cannot carry out a directive field (``field``, ``reason``, ``version``, ``requested``): never acked.
    DIRECTIVE_UNAPPLIABLE = "directive_unappliable"
    MELTDOWN = "meltdown"  # a worker's breaker opened (entry into degradation)
    RECOVERED = "recovered"  # a worker's breaker closed again, or a precision fallback was undone
    BREAKER = "breaker"  # any other breaker transition (escalate, step down, ack)
    QUOTA = "quota"  # an elastic memory quota changed
    SNAPSHOT = "snapshot"
    RESTORE = "restore"
    POLICY_ACTION = "policy_action"  # a rule changed (or, in a dry run, would have changed) a knob
    POLICY = "policy"  # a rule's state changed: pending, firing, resolved, reset
    PLACEMENT = "placement"  # a job was placed (devices per worker, score)
    DEVICE = "device"  # a device's health changed, or a run on it ended (history for its profile)
    RECOVERY = "recovery"  # a launcher restarted a worker group, or a group healed in place (phases timed)
    HEAL = "heal"  # a healing group's membership changed: an epoch formed or broke, a replacement waits, a fencing
    WEBHOOK = "webhook"  # a policy pushed to an agent runtime was delivered or given up (attempts logged)
    ALERT = "alert"
    ANOMALY = "anomaly"
    LOG = "log"
    POOL_CHANGED = "pool_changed"
    # Room made on a card for a memory burst: an actor is asked to move off it (dsec.quota.room; the launcher's
    # supervisor acts on it). Its own type so that a supervisor reads these, not every quota change of the fleet.
    ROOM = "room"


#: Event kinds a worker may report in a heartbeat; the rest are decided by the control plane.
WORKER_EVENT_TYPES = frozenset(
    {
        EventType.SNAPSHOT,
        EventType.RESTORE,
        EventType.ALERT,
        EventType.ANOMALY,
        EventType.LOG,
        EventType.DIRECTIVE_UNAPPLIABLE,
    }
)
