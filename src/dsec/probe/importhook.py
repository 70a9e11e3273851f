"""Post-import hooks: run a callback right after a module finishes importing (or now, if it already has).

This is how the probe instruments torch and gymnasium without importing them itself: a process that
never imports torch pays nothing. Implemented as a meta-path finder that wraps the real loader's
``exec_module``; the finder steps aside for every other module.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]

_lock = threading.Lock()
_callbacks: dict[str, list[Callback]] = {}
_finder: _PostImportFinder | None = None


def _run(module: ModuleType, callbacks: list[Callback]) -> None:
    for cb in callbacks:
        try:
            cb(module)
        except Exception:  # an instrumentation bug must never break the user's import
            log.warning("dsec: post-import hook for %s failed", module.__name__, exc_info=True)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, name: str) -> None:
        self._inner = inner
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        with _lock:
            callbacks = _callbacks.pop(self._name, [])
        _run(module, callbacks)

    def __getattr__(self, item: str) -> Any:  # get_source, is_package, ... of the real loader
        return getattr(self._inner, item)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname not in _callbacks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.name = None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _Loader(spec.loader, fullname)
        return spec


def when_imported(name: str, callback: Callback) -> None:
    """Call ``callback(module)`` once ``name`` is imported (immediately if it already is)."""
    global _finder
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        _run(module, [callback])
        return
    with _lock:
        _callbacks.setdefault(name, []).append(callback)
        if _finder is None:
            _finder = _PostImportFinder()
            sys.meta_path.insert(0, _finder)
