"""Run a callback right after a named module finishes importing (a post-import hook).

Why: verl imports every `verl.plugins` entry point in every process that imports verl,
including vLLM's engine processes. Registering trainer `tide` eagerly would import verl's
whole trainer stack there (+3 s per process, and an early platform lookup). Instead the
entry point waits until verl itself imports the module that holds the registry, and
registers then. Nothing of verl is replaced: the finder only observes that import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, Optional

_lock = threading.RLock()
_pending: dict[str, list[Callable[[ModuleType], None]]] = {}


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Call `callback(module)` once `module_name` is imported (at once if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            _pending.setdefault(module_name, []).append(callback)
            if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
                sys.meta_path.insert(0, _PostImportFinder())
            return
    callback(module)


def _run_callbacks(module: ModuleType) -> None:
    with _lock:
        callbacks = _pending.pop(module.__name__, [])
    for callback in callbacks:
        callback(module)


class _NotifyingLoader(importlib.abc.Loader):
    def __init__(self, wrapped: importlib.abc.Loader):
        self._wrapped = wrapped

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._wrapped.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._wrapped.exec_module(module)
        _run_callbacks(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tools that ask
        return getattr(self._wrapped, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        with _lock:
            if fullname not in _pending:
                return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _NotifyingLoader(spec.loader)
                return spec
        return None
