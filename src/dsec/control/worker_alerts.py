"""Alerts a worker asks for (``alert`` events it sends), as the alert sinks get them: attributed, never disguised.

The control plane signs what it sends to the alert webhooks, so a worker's words must not read as the control
plane's: the alert is named ``worker_reported_<what the worker called it>`` (it cannot take the name, and so the
group and deduplication key, of an alert the control plane raises), carries ``labels.source = "worker"`` and the
worker id in its summary, and is at most a warning (a worker cannot page anyone with ``critical``).
"""

from __future__ import annotations

import re

from dsec.alerts import Alert, Severity
from dsec.model import Event

PREFIX = "worker_reported_"
SUMMARY_CHARS = 300


def worker_alert(ev: Event) -> Alert:
    data = dict(ev.data)
    data.pop("source", None)
    asked = str(data.pop("name", None) or data.get("reason") or "alert")
    slug = re.sub(r"[^a-z0-9_]+", "_", asked.lower()).strip("_")[:48] or "alert"
    raw = data.pop("severity", "warning")
    severity = Severity.INFO if raw == Severity.INFO.value else Severity.WARNING
    text = str(data.pop("summary", None) or data.get("message") or data.get("reason") or "")
    summary = f"reported by worker {ev.worker_id}: {text}"[:SUMMARY_CHARS]
    return Alert(
        name=PREFIX + slug,
        severity=severity,
        ts=ev.ts,
        pool=ev.pool or None,
        worker_id=ev.worker_id or None,
        summary=summary,
        labels={"source": "worker"},
        data=data,
    )
