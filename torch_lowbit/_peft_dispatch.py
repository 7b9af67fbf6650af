"""PEFT's LoRA wraps Fp8Linear / Int8Linear as soon as torch_lowbit is imported, with no change to the user's
config: ``peft.get_peft_model(model, LoraConfig(...))``, ``PeftModel.from_pretrained(base, adapter_dir)``.

PEFT (0.21) has no global registry for third-party layers: its extension point is per config
(``LoraConfig._register_custom_module``, what :func:`torch_lowbit.peft.register` calls), and a config that
``PeftModel.from_pretrained`` reads from ``adapter_config.json`` never passes through user code. So torch_lowbit
adds one hook, and only one: ``peft.tuners.lora.model.LoraModel._create_new_module`` (the static method that
creates every LoRA layer) is wrapped so that a target whose base layer is a torch_lowbit layer becomes
:class:`torch_lowbit.peft.LowbitLoraLinear`, unless the config maps that layer type to a custom module of its own
(which PEFT then uses, as before). Every other target goes to PEFT's own dispatchers untouched.

The hook is installed once, when both packages are imported: at torch_lowbit's import if PEFT's LoRA module is
already loaded, else right after it loads (a one-shot import watcher that removes itself). This module imports
nothing of PEFT (which pulls in transformers) until PEFT creates a LoRA layer on a torch_lowbit layer.
"""
from __future__ import annotations

import functools
import importlib.abc
import sys

_LORA_MODEL = "peft.tuners.lora.model"
_MARK = "_torch_lowbit_dispatch"


def _wrap_create_new_module(lora_model_module) -> None:
    lora_model = lora_model_module.LoraModel
    create = lora_model._create_new_module  # a staticmethod: the plain function
    if getattr(create, _MARK, False):
        return

    @functools.wraps(create)
    def _create_new_module(lora_config, adapter_name, target, **kwargs):
        from .peft import dispatch_low_bit
        new_module = dispatch_low_bit(target, adapter_name, config=lora_config, **kwargs)
        return new_module if new_module is not None else create(lora_config, adapter_name, target, **kwargs)

    setattr(_create_new_module, _MARK, True)
    lora_model._create_new_module = staticmethod(_create_new_module)


class _InstallAfterExec(importlib.abc.Loader):
    """The LoRA module's own loader, then the hook; handed back to the module once it has run."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        try:
            self._loader.exec_module(module)
        finally:
            module.__loader__ = module.__spec__.loader = self._loader
        _wrap_create_new_module(module)


class _LoraImportWatcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when peft's LoRA module is about to be imported, it takes the spec the other finders
    give, has the hook installed after the module runs, and leaves ``sys.meta_path``."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _LORA_MODEL:
            return None
        _remove_watchers()
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _InstallAfterExec(spec.loader)
                return spec
        return None


def _remove_watchers() -> None:
    # by class name: a reloaded torch_lowbit defines a new class, and one watcher is enough
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != _LoraImportWatcher.__name__]


def install() -> None:
    """Route PEFT's LoRA layer creation for torch_lowbit layers through :mod:`torch_lowbit.peft` (see the module
    docstring); idempotent."""
    module = sys.modules.get(_LORA_MODEL)
    if module is not None and hasattr(module, "LoraModel"):
        _wrap_create_new_module(module)
    elif module is None:
        _remove_watchers()
        sys.meta_path.insert(0, _LoraImportWatcher())
