"""What torch_lowbit sets on a diffusers model (a transformer, a UNet) that holds its layers, per model, as
``enable_save_pretrained`` does on a transformers model: ``num_parameters()`` counting the low-bit weights
(``hf.attach_parameter_count``), ``save_pretrained()``, ``fuse_qkv_projections()`` and ``dequantize()``.

``save_pretrained`` of a model ``quantize_`` made (no quantizer of diffusers' behind it) wrote the low-bit tensors
under a config.json without a quantization config: diffusers' ``from_pretrained`` then loaded the fp8 codes into
plain nn.Linear weights as values, without their scales, and said only that the ``weight_scale`` tensors were
unused. Here the config gets the ``TorchLowbitConfig`` that diffusers' loader of this method reads back (it rebuilds
the Fp8Linear / Int8Linear / W4Linear layers from the tensors the directory holds, the 4-bit format and group size
from the config); what that loader cannot rebuild (experts; two 4-bit formats or group sizes) is refused by name
before anything is written.

diffusers fuses attention projections (``transformer.fuse_qkv_projections()``, a step of its torch.compile recipes)
by concatenating the projections' dense ``weight`` tensors into a new ``nn.Linear``; on low-bit projections that
failed deep inside diffusers ("check_uniform_bounds not implemented for 'Float8_e4m3fn'"). Here diffusers' own
method runs with each low-bit projection stood in for by an empty (meta) ``nn.Linear`` of its shape, so that
diffusers still decides what to fuse (per model class and diffusers version) and sets its flags; each fused layer it
made from stand-ins then becomes the low-bit projections joined by ``cat_out_features`` (codes and scales as they
are: each slice of the fused output is what its projection gives), and the projections are put back, as diffusers
keeps them for ``unfuse_qkv_projections()``. Nothing of diffusers is imported here.
"""
from __future__ import annotations

import inspect
import types

import torch.nn as nn

# the layers diffusers' fuse_projections makes -> the projections it joins into each, in order
FUSED_PROJECTIONS = {"to_qkv": ("to_q", "to_k", "to_v"), "to_kv": ("to_k", "to_v"),
                     "to_added_qkv": ("add_q_proj", "add_k_proj", "add_v_proj"),
                     "to_added_kv": ("add_k_proj", "add_v_proj")}


def attach_diffusers_methods(model: nn.Module) -> nn.Module:
    """Set ``num_parameters``, and ``fuse_qkv_projections``, ``save_pretrained`` and ``dequantize`` where the model's
    class has them, on a diffusers model holding torch_lowbit layers (see the module docstring). Returns the model."""
    from .hf import attach_parameter_count

    if callable(getattr(type(model), "fuse_qkv_projections", None)):
        model.fuse_qkv_projections = types.MethodType(_fuse_qkv_projections, model)
    if callable(getattr(type(model), "save_pretrained", None)):
        model.save_pretrained = types.MethodType(_save_pretrained, model)
    if callable(getattr(type(model), "dequantize", None)):
        model.dequantize = types.MethodType(_dequantize, model)
    return attach_parameter_count(model)


def _dequantize(self, dtype=None):
    """diffusers' ``ModelMixin.dequantize`` for a model holding torch_lowbit layers, however they got there (its
    own says "quantize your model first" without a diffusers quantizer, and asks for an issue with ours): see
    :func:`dense_again`; the diffusers quantizer is dropped too."""
    dense_again(self, dtype)
    if getattr(self, "hf_quantizer", None) is not None:
        del self.hf_quantizer
    self.is_quantized = False
    return self


def dense_again(model, dtype=None) -> None:
    """`model`'s low-bit layers dense (``dequantize_``; dtype: a torch dtype or diffusers' spelling of one, default
    the model's), then the class's own methods and a config without a quantization config: a save_pretrained after
    it writes a dense model that loads as one."""
    from .dequantize import dequantize_
    from .hf import _spelled_dtype, detach_model_methods

    dequantize_(model, dtype=_spelled_dtype(dtype))
    detach_model_methods(model)
    model.__dict__.pop("fuse_qkv_projections", None)  # the one method a transformers model is not given
    config = model._internal_dict  # diffusers' FrozenDict: a new one without the key
    if "quantization_config" in config:
        model._internal_dict = type(config)({k: v for k, v in config.items() if k != "quantization_config"})


def _save_pretrained(self, save_directory, *args, **kwargs):
    given = inspect.signature(type(self).save_pretrained).bind(self, save_directory, *args, **kwargs).arguments
    if given.get("safe_serialization", True) is False:
        raise ValueError("save_pretrained: safe_serialization=False writes the low-bit layers as a pickle, which "
                         "torch_lowbit does not read back (it unpickles nothing); save with safe_serialization=True "
                         "(the default)")
    if given.get("use_flashpack", False):
        raise ValueError("save_pretrained: use_flashpack=True writes a FlashPack file, which torch_lowbit does not "
                         "read back; save with safetensors (the default)")
    if getattr(self, "hf_quantizer", None) is None:  # a diffusers quantizer's model: diffusers writes its config
        self.register_to_config(quantization_config=_reloadable_config(self).to_dict())
    return type(self).save_pretrained(self, save_directory, *args, **kwargs)


def _reloadable_config(model):
    """The TorchLowbitConfig under which diffusers' from_pretrained rebuilds `model`'s low-bit layers; refused,
    naming the first layer it cannot rebuild: a class its loader does not build, or what one config cannot record
    (fp8 scales per block of two sizes; 4-bit layers of two formats or group sizes)."""
    from .diffusers_quantizer import LAYER_WEIGHTS
    from .hf_quantizer import W4_DEFAULT_GROUP, TorchLowbitConfig
    from .nn import Fp8Linear, W4Linear
    from .nn._format_buffers import FormatBuffers

    kinds, fp8_blocks, w4 = set(), set(), []  # fp8 scales per block: the loader takes the config's one block size
    for name, module in model.named_modules():
        if not isinstance(module, FormatBuffers):
            continue
        if type(module) not in LAYER_WEIGHTS:
            raise ValueError(f"save_pretrained: {name} is a {type(module).__name__}, which diffusers' from_pretrained "
                             f"cannot rebuild (it rebuilds {' / '.join(c.__name__ for c in LAYER_WEIGHTS)} layers); "
                             f"{_SAVE_QUANTIZED}")
        kinds.add(LAYER_WEIGHTS[type(module)](module))
        if isinstance(module, Fp8Linear):
            fp8_blocks.add(module.block_size)
            if len(fp8_blocks) > 1:
                raise ValueError(f"save_pretrained: {name}'s fp8 scales are per "
                                 f"{'block of ' + str(module.block_size) if module.block_size else 'row or tensor'}, "
                                 f"other fp8 layers' are not: one config.json holds one block size; {_SAVE_QUANTIZED}")
        elif isinstance(module, W4Linear):
            w4.append((name, module))
    block = next(iter(fp8_blocks), None)
    fp8 = {} if block is None else {"granularity": "block", "block_size": block}
    if not w4:
        return TorchLowbitConfig(sorted(kinds)[0] if kinds else "fp8", **fp8)
    fmt, group = _w4_format_and_group(w4)
    options = {"group_size": group} if fmt in W4_DEFAULT_GROUP else {}
    if fmt == "int4":  # zero points or none: how from_pretrained of a dense model would quantize under this config
        options["symmetric"] = all(m.weight_offset is None for _, m in w4)
    return TorchLowbitConfig(fmt, **fp8, **options)


_SAVE_QUANTIZED = ("write this model with torch_lowbit.save_quantized(model, path) and read it back with "
                   "torch_lowbit.load_quantized(model, path)")


def _w4_format_and_group(w4):
    """The one 4-bit format and group size (None: per channel) of the 4-bit layers ``[(name, W4Linear)]``, as the
    diffusers loader makes a layer of them (``row_group``); refused naming a layer that differs."""
    from .diffusers_quantizer import row_group

    first_name, first = w4[0]
    grouped = [(n, m) for n, m in w4 if m.group_size < m.in_features]  # the rest are per channel, whatever the group
    group = grouped[0][1].group_size if grouped else None
    if first.format == "uint4" and group is None:  # no per-channel spelling: a group as long as the longest row
        group = max(m.in_features for _, m in w4)
    for name, module in w4:
        if module.format != first.format:
            raise ValueError(f"save_pretrained: {name} is {module.format}, {first_name} is {first.format}: one "
                             f"config.json holds one 4-bit format; {_SAVE_QUANTIZED}")
        if module.group_size != row_group(group, module.in_features):
            raise ValueError(f"save_pretrained: {name} has groups of {module.group_size}, "
                             f"{grouped[0][0] if grouped else first_name} of {group or first.group_size} codes: one "
                             f"config.json holds one group size; {_SAVE_QUANTIZED}")
    return first.format, group


def _stand_in(layer) -> nn.Linear:
    return nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")


def _fuse_qkv_projections(self) -> None:
    from .nn._quantized_linear import QuantizedLinear

    sources = {name for names in FUSED_PROJECTIONS.values() for name in names}
    low_bit = {}  # module name -> (module, {projection name: its low-bit layer})
    for path, module in self.named_modules():
        found = {}
        for n, c in module._modules.items():
            if n not in sources:
                continue
            if isinstance(getattr(c, "base_layer", None), QuantizedLinear):
                raise ValueError(f"fuse_qkv_projections: {path + '.' if path else ''}{n} carries LoRA adapters on a "
                                 f"low-bit layer; a fused projection would join the base layers and leave the adapters "
                                 f"out. Fuse before loading adapters, or unload them first (unload_lora_weights)")
            if isinstance(c, QuantizedLinear):
                found[n] = c
        if found:
            low_bit[path] = (module, found)
    fuse = type(self).fuse_qkv_projections
    if not low_bit:
        return fuse(self)
    for module, found in low_bit.values():
        for name, layer in found.items():
            module._modules[name] = _stand_in(layer)
    try:
        fuse(self)
    except Exception as e:  # a projection group mixing low-bit and float layers: diffusers joins meta with real
        _restore(low_bit)
        type(self).unfuse_qkv_projections(self)
        raise ValueError(f"fuse_qkv_projections: diffusers could not fuse this model's torch_lowbit projections "
                         f"({type(e).__name__}: {e}); {_HINT}") from e
    _restore(low_bit)
    made = {}
    try:
        for path, (module, _) in low_bit.items():
            for fused, names in FUSED_PROJECTIONS.items():
                stand_in = module._modules.get(fused)
                if stand_in is None or not _is_meta(stand_in):
                    continue
                parts = [module._modules.get(n) for n in names]
                where = f"{path}.{fused}" if path else fused
                if not all(isinstance(p, QuantizedLinear) for p in parts):
                    raise ValueError(f"{where} would join {list(names)}, which are "
                                     f"{[type(p).__name__ for p in parts]}: low-bit and float projections")
                layer = type(parts[0]).cat_out_features(parts)
                if layer.out_features != stand_in.out_features:
                    raise ValueError(f"{where}: diffusers made {stand_in.out_features} output features from "
                                     f"{list(names)}, which have {layer.out_features}")
                made[(path, fused)] = (module, layer)
        replaced = {id(module._modules[fused]) for (_, fused), (module, _) in made.items()}
        left = [n for n, m in self.named_modules() if id(m) not in replaced and _is_meta(m)]
        if left:
            raise ValueError(f"diffusers fused layers torch_lowbit does not know how to join: {left[:4]}")
    except ValueError as e:
        type(self).unfuse_qkv_projections(self)
        raise ValueError(f"fuse_qkv_projections: {e}; {_HINT}") from None
    for (_, fused), (module, layer) in made.items():
        module._modules[fused] = layer


_HINT = ("the model is left unfused; to fuse low-bit projections that cannot be joined, fuse the dense model first "
         "(model.fuse_qkv_projections(), then torch_lowbit.quantize_)")


def _restore(low_bit) -> None:
    for module, found in low_bit.values():
        module._modules.update(found)


def _is_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in module.parameters(recurse=False))
