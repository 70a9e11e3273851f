"""Loaded by every Python process that ``dsec run`` starts (this directory is put first on PYTHONPATH).

Starts the DSec probe when DSEC_ENDPOINT is set, then hands over to any other ``sitecustomize`` that this
file shadows. Never raises: a broken probe must not stop the user's program from starting.
"""

import os
import sys


def _start_probe() -> None:
    try:
        from dsec.probe.bootstrap import bootstrap

        bootstrap()
    except Exception as exc:  # pragma: no cover - defensive
        sys.stderr.write(f"dsec: probe not started: {exc}\n")


def _chain() -> None:
    """Import the sitecustomize this one shadows, if any, as Python would have."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        import importlib

        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    except Exception as exc:  # the other sitecustomize failed: Python would print it and go on
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(exc).__name__}: {exc}\n")
    finally:
        sys.path[:] = saved
        if ours is not None:
            sys.modules["sitecustomize"] = ours


if os.environ.get("DSEC_ENDPOINT"):
    _start_probe()
_chain()
