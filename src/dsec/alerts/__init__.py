"""Alert routing: alerts from health checks and workers, grouped and rate-limited, sent to sinks.

``Alert`` is what is raised; ``AlertRouter`` deduplicates and groups alerts (``AlertGrouper`` holds
the decisions) and delivers ``Notification``s to sinks: ``LogSink``, ``WebhookSink`` (signed, see
``signing``) and ``RecordingSink``. ``sinks_from_config`` builds sinks from configuration.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsec.alerts.model import Alert, AlertKey, Severity
    from dsec.alerts.router import AlertGrouper, AlertRouter, GroupKey, Notification, Sink
    from dsec.alerts.signing import (
        DELIVERY_HEADER,
        EVENT_HEADER,
        SIGNATURE_HEADER,
        TIMESTAMP_HEADER,
        SignatureError,
        sign,
        sign_all,
        verify,
    )
    from dsec.alerts.sinks import ALERT_EVENT, LogSink, RecordingSink, WebhookError, WebhookSink, sinks_from_config

__all__ = [
    "ALERT_EVENT",
    "DELIVERY_HEADER",
    "EVENT_HEADER",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Alert",
    "AlertGrouper",
    "AlertKey",
    "AlertRouter",
    "GroupKey",
    "LogSink",
    "Notification",
    "RecordingSink",
    "Severity",
    "SignatureError",
    "Sink",
    "WebhookError",
    "WebhookSink",
    "sign",
    "sign_all",
    "sinks_from_config",
    "verify",
]

# Resolved on first use (PEP 562): the alert model (dsec.alerts.model) is part of the decision core's vocabulary,
# and importing it must not load the webhook sink's HTTP client.
_HOME = {
    **dict.fromkeys(("Alert", "AlertKey", "Severity"), "model"),
    **dict.fromkeys(("AlertGrouper", "AlertRouter", "GroupKey", "Notification", "Sink"), "router"),
    **dict.fromkeys(
        (
            "DELIVERY_HEADER",
            "EVENT_HEADER",
            "SIGNATURE_HEADER",
            "TIMESTAMP_HEADER",
            "SignatureError",
            "sign",
            "sign_all",
            "verify",
        ),
        "signing",
    ),
    **dict.fromkeys(
        ("ALERT_EVENT", "LogSink", "RecordingSink", "WebhookError", "WebhookSink", "sinks_from_config"), "sinks"
    ),
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'dsec.alerts' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"dsec.alerts.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
