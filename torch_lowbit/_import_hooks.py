"""Run a function once a module has been imported, without importing it: at once if it already is, else right
after its first import runs (a one-shot import watcher at the front of ``sys.meta_path``, gone once nothing is
pending). How torch_lowbit hooks into optional libraries (PEFT, diffusers) in either import order while importing
none of them itself."""
from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, Dict, List

_pending: Dict[str, List[Callable]] = {}  # module name -> what runs after it is imported


class _RunAfterExec(importlib.abc.Loader):
    """The module's own loader, then the pending functions; handed back to the module once it has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = module.__spec__.loader = self._loader
        for fn in _pending.pop(module.__name__, ()):
            fn(module)
        if not _pending:
            _remove_watchers()


class _ImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for a module with pending functions it takes the spec the other finders give and has
    them run after the module does."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if type(finder).__name__ == _ImportWatcher.__name__ or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _RunAfterExec(spec.loader)
                return spec
        return None


def _remove_watchers() -> None:
    # by class name: a reloaded torch_lowbit defines a new class, and one watcher is enough
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != _ImportWatcher.__name__]


def after_import(name: str, fn: Callable) -> None:
    """``fn(module)`` once module ``name`` is imported: now if it is, else after its import runs. A module caught
    halfway through its own import (this call made from inside it) gets nothing."""
    module = sys.modules.get(name)
    if module is not None:
        if not getattr(getattr(module, "__spec__", None), "_initializing", False):
            fn(module)
        return
    if fn not in _pending.setdefault(name, []):
        _pending[name].append(fn)
    if not any(type(f).__name__ == _ImportWatcher.__name__ for f in sys.meta_path):
        sys.meta_path.insert(0, _ImportWatcher())
