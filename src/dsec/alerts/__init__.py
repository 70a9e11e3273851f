"""Alert routing: alerts from health checks and workers, grouped and rate-limited, sent to sinks.

``Alert`` is what is raised; ``AlertRouter`` deduplicates and groups alerts (``AlertGrouper`` holds
the decisions) and delivers ``Notification``s to sinks: ``LogSink``, ``WebhookSink`` (signed, see
``signing``) and ``RecordingSink``. ``sinks_from_config`` builds sinks from configuration.
"""

from __future__ import annotations

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
