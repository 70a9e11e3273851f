"""The root of every exception DSec raises, and the few groups under it.

``except DsecError`` catches anything DSec raises on purpose; a bare builtin escaping DSec is a bug or a
third-party error that was not translated at its boundary. Each leaf keeps the builtin base it had before this
tree existed (``ModelError`` is still a ``ValueError``), so callers that catch the builtin keep working.

Exceptions::

    DsecError
     ├── InvalidInput                 a value, file, expression or request DSec was given is invalid
     │    ├── ModelError              (ValueError)  dsec.model: a domain value out of range
     │    ├── ConfigError             (ValueError)  dsec.yamlconf: a config file unreadable or invalid
     │    ├── ExprError               (ValueError)  dsec.policy.expr: a bad policy expression
     │    ├── ChaosError              (ValueError)  dsec.probe.chaos: DSEC_CHAOS malformed
     │    └── SignatureError          (ValueError)  dsec.alerts.signing: a webhook request failed verification
     ├── StorageError                 a store cannot be read or written, or holds something untrustworthy
     │    ├── StoreError                            dsec.control.store.api: the control plane's database
     │    │    ├── StoreUnavailable                 cannot be reached, opened or migrated
     │    │    └── StoreConflict                    a write contradicts what is stored
     │    ├── StoreError                            dsec.snapshot.store: the snapshot store (OSError translated)
     │    │    └── ManifestExists     (FileExistsError)  a snapshot number is already taken
     │    └── CorruptSnapshot                       dsec.snapshot.manifest: bad checksum, missing chunk, ...
     ├── TransportError               talking to another process failed (httpx errors translated)
     │    ├── ClientError                           dsec.client: the control-plane client
     │    │    ├── ApiError                         the server answered 4xx/5xx
     │    │    └── Unreachable                      no answer
     │    ├── WebhookError            (RuntimeError)  dsec.alerts.sinks: a delivery failed for good
     │    └── EgressRefused                         dsec.control.egress: a destination DSec may not send to
     ├── HealingError                 in-place healing of a training group cannot go on
     │    ├── Fenced, Invalid                       dsec.heal.membership: the group refuses a process or request
     │    ├── HealUnavailable, FencedOut            dsec.probe.heal_client: the control plane's side of it
     │    ├── NotHealable             (RuntimeError)  dsec.probe.heal_ops: a collective healing cannot carry
     │    ├── Diverged                (RuntimeError)  dsec.probe.elastic: members took different paths
     │    └── TransferError                         dsec.probe.replica_state: replica state damaged in transit
     ├── ApiError                                   dsec.control.errors: a request the control plane refuses,
     │                                              rendered as an HTTP error response
     └── NativeLibraryNotFound        (FileNotFoundError)  dsec.integrations.native

Not in the tree: ``dsec.scheduler.fake_nvml.NVMLError``, a stand-in for pynvml's own error class, which the
code under test catches as pynvml's.

This module is the bottom layer: it imports nothing from DSec, so any module may import it.
"""

from __future__ import annotations

__all__ = ["DsecError", "HealingError", "InvalidInput", "StorageError", "TransportError"]


class DsecError(Exception):
    """Base of every exception DSec raises on purpose."""


class InvalidInput(DsecError):
    """A value, file, expression or request DSec was given is invalid; the message quotes it and says what
    would be accepted."""


class StorageError(DsecError):
    """A store (the control plane's database, the snapshot store) failed or holds something untrustworthy."""


class TransportError(DsecError):
    """Talking to another process (the control plane, a webhook receiver) failed."""


class HealingError(DsecError):
    """In-place healing of a training group cannot go on."""
