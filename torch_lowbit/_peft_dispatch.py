"""PEFT's LoRA wraps Fp8Linear / Int8Linear / W4Linear as soon as torch_lowbit is imported, with no change to the
user's config: ``peft.get_peft_model(model, LoraConfig(...))``, ``PeftModel.from_pretrained(base, adapter_dir)``,
``target_modules="all-linear"``.

PEFT (0.21) has no global registry for third-party layers: its extension point is per config
(``LoraConfig._register_custom_module``, what :func:`torch_lowbit.peft.register` calls), and a config that
``PeftModel.from_pretrained`` reads from ``adapter_config.json`` never passes through user code. So torch_lowbit
adds hooks:
- ``peft.tuners.lora.model.LoraModel._create_new_module`` (the static method that creates every LoRA layer) is
  wrapped so that a target whose base layer is a torch_lowbit layer becomes :class:`torch_lowbit.peft.LowbitLoraLinear`,
  unless the config maps that layer type to a custom module of its own (which PEFT then uses, as before). Every other
  target goes to PEFT's own dispatchers untouched.
- ``peft.tuners.tuners_utils._maybe_include_all_linear_layers`` (which expands ``"all-linear"`` to the model's
  ``nn.Linear`` names; the low-bit layers are not ``nn.Linear``) is wrapped so that a LoRA config's expansion also
  names the low-bit layers, with PEFT's exclusions (the output embedding, a classification head, layers inside
  adapters). Without it a quantized model's "all-linear" adapter silently trained only what stayed in float (on a
  4-bit MoE: the routers). PEFT calls it for every LoRA injection, so it also warns where the config targets fused
  experts held quantized (LoRA cannot adapt them). If a PEFT release renames the helper, this hook is skipped and the
  tests say so.
- ``PeftModel.get_nb_trainable_parameters`` (and ``PeftMixedModel``'s), which ``print_trainable_parameters``
  prints, counts ``named_parameters()``: the low-bit weights are buffers, so "all params" left them out and a LoRA
  on a quantized model showed a trainable share many times the true one. The wrapper adds them, one per weight, as
  PEFT counts a bitsandbytes 4-bit weight (:func:`torch_lowbit.nn.low_bit_parameter_count`).

Each is installed once, when both packages are imported: at torch_lowbit's import if the PEFT module is
already loaded, else right after it loads (``torch_lowbit._import_hooks``). This module imports
nothing of PEFT (which pulls in transformers) until PEFT creates a LoRA layer on a torch_lowbit layer or expands
"all-linear".
"""
from __future__ import annotations

import functools
import sys

from ._import_hooks import after_import

_LORA_MODEL = "peft.tuners.lora.model"
_TUNERS_UTILS = "peft.tuners.tuners_utils"
_ALL_LINEAR = "_maybe_include_all_linear_layers"
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


def _is_lora(peft_config) -> bool:
    return str(getattr(peft_config, "peft_type", "")).rsplit(".", 1)[-1] == "LORA"


def _wrap_all_linear() -> None:
    tuners_utils = sys.modules.get(_TUNERS_UTILS)
    expand = getattr(tuners_utils, _ALL_LINEAR, None)
    if expand is None or getattr(expand, _MARK, False):
        return

    # PEFT calls this once per adapter injection with the config it will apply (after its transformers-v5 MoE
    # conversion has turned expert targets into target_parameters), so it is also where frozen experts are named
    @functools.wraps(expand)
    def _maybe_include_all_linear_layers(peft_config, model):
        if not _is_lora(peft_config):
            return expand(peft_config, model)
        targets = getattr(peft_config, "target_modules", None)
        all_linear = isinstance(targets, str) and targets.lower() == "all-linear"
        peft_config = expand(peft_config, model)
        from .peft import low_bit_linear_names, warn_of_quantized_expert_targets
        if all_linear:
            peft_config.target_modules = set(peft_config.target_modules) | low_bit_linear_names(model, peft_config)
        warn_of_quantized_expert_targets(model, peft_config)
        return peft_config

    setattr(_maybe_include_all_linear_layers, _MARK, True)
    # PEFT's tuners import the helper by name: rebind it wherever a loaded peft module holds the original
    for name, module in list(sys.modules.items()):
        if (name == "peft" or name.startswith("peft.")) and getattr(module, _ALL_LINEAR, None) is expand:
            setattr(module, _ALL_LINEAR, _maybe_include_all_linear_layers)


# the PEFT modules whose model class counts parameters -> that class
_COUNTING_MODELS = {"peft.peft_model": "PeftModel", "peft.mixed_model": "PeftMixedModel"}


def _wrap_parameter_count(module) -> None:
    cls = getattr(module, _COUNTING_MODELS[module.__name__], None)
    count = getattr(cls, "get_nb_trainable_parameters", None)
    if count is None or getattr(count, _MARK, False):
        return

    @functools.wraps(count)
    def get_nb_trainable_parameters(self):
        from .nn import low_bit_parameter_count
        trainable, total = count(self)
        return trainable, total + low_bit_parameter_count(self)  # frozen: never trainable

    setattr(get_nb_trainable_parameters, _MARK, True)
    cls.get_nb_trainable_parameters = get_nb_trainable_parameters


def _install_hooks(lora_model_module) -> None:
    _wrap_create_new_module(lora_model_module)
    _wrap_all_linear()


def install() -> None:
    """Route PEFT's LoRA layer creation for torch_lowbit layers through :mod:`torch_lowbit.peft` (see the module
    docstring); idempotent."""
    after_import(_LORA_MODEL, _install_hooks)
    for name in _COUNTING_MODELS:
        after_import(name, _wrap_parameter_count)
