"""``dsec.integrations.native``: the ctypes binding to ``libdsec_inject.so``, DSec's C reporting library.

::

    from dsec.integrations import native
    native.init("http://127.0.0.1:8080", "my-trainer")  # pool and token: DSEC_SANDBOX_ID, DSEC_TOKEN
    native.report_episode_end(12.5, 200)

The library reports from its own background thread (register, then heartbeats); these calls only update
counters and never wait on the network (``shutdown`` waits at most about 3 s, for a final beat). Which library:
``load(path)``, else ``$DSEC_NATIVE_LIB``, else ``build/native/libdsec_inject.so`` in the repository checkout
(``make native``). Build, environment, metrics and LD_PRELOAD use: docs/native.md.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

from dsec.errors import DsecError

ENV_LIB = "DSEC_NATIVE_LIB"
LIBRARY_NAME = "libdsec_inject.so"
# src/dsec/integrations/native.py -> the repository root is three directories up from this one.
BUILD_PATH = Path(__file__).resolve().parents[3] / "build" / "native" / LIBRARY_NAME

# dsec_init return codes (native/dsec_inject.h)
OK = 0
ERR_CONFIG = -1
ERR_THREAD = -2


class NativeLibraryNotFound(DsecError, FileNotFoundError):
    """``libdsec_inject.so`` is not where it was looked for."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None


def library_path(path: str | os.PathLike[str] | None = None) -> Path:
    """The library ``load(path)`` would open: ``path``, else ``$DSEC_NATIVE_LIB``, else the checkout's build."""
    if path is not None:
        return Path(path)
    env = os.environ.get(ENV_LIB)
    return Path(env) if env else BUILD_PATH


def load(path: str | os.PathLike[str] | None = None) -> ctypes.CDLL:
    """Open the library (see ``library_path``) and make it the one ``init``/``report_episode_end``/``shutdown``
    use. Loading it does not start reporting (only ``LD_PRELOAD`` does, by itself)."""
    global _lib
    where = library_path(path)
    if not where.is_file():
        how = f"${ENV_LIB}" if path is None and os.environ.get(ENV_LIB) else "run `make native`, or set $" + ENV_LIB
        raise NativeLibraryNotFound(f"{where}: no such file ({how})")
    lib = ctypes.CDLL(str(where))
    lib.dsec_init.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.dsec_init.restype = ctypes.c_int
    lib.dsec_report_episode_end.argtypes = [ctypes.c_double, ctypes.c_long]
    lib.dsec_report_episode_end.restype = None
    lib.dsec_shutdown.argtypes = []
    lib.dsec_shutdown.restype = None
    with _lock:
        _lib = lib
    return lib


def _library() -> ctypes.CDLL:
    with _lock:
        lib = _lib
    return lib if lib is not None else load()


def _encode(value: str | None) -> bytes | None:
    return value.encode() if value else None


def init(endpoint: str | None = None, name: str | None = None) -> bool:
    """Start reporting (endpoint ``None``: ``$DSEC_ENDPOINT``; name ``None``: ``$DSEC_NAME`` or the program
    name). True when reporting runs (started now or already running); False when it is not configured
    (no endpoint, no ``$DSEC_SANDBOX_ID``, an endpoint that is not ``http://``) or could not start — the
    caller then simply goes on without it, as with ``dsec.attach()``."""
    rc = int(_library().dsec_init(_encode(endpoint), _encode(name)))
    return rc == OK


def report_episode_end(reward: float, length: int) -> None:
    """One finished episode (``episodes_total``, ``episode_return_mean``, ``episode_length_mean``)."""
    _library().dsec_report_episode_end(float(reward), int(length))


def shutdown() -> None:
    """Final beat and deregistration (bounded to about 3 s); idempotent."""
    _library().dsec_shutdown()
