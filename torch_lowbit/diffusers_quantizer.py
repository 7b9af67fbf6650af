"""``TorchLowbitConfig`` in diffusers: its ``from_pretrained`` and ``from_single_file`` take the same config as
transformers does::

    transformer = FluxTransformer2DModel.from_pretrained(path, subfolder="transformer", torch_dtype=torch.bfloat16,
                                                         quantization_config=TorchLowbitConfig("fp8"))
    transformer = FluxTransformer2DModel.from_single_file("flux1-dev-fp8.safetensors", config=repo_or_dir,
                                                          subfolder="transformer",
                                                          quantization_config=TorchLowbitConfig("fp8"))

diffusers has no public registration hook: importing this module (``torch_lowbit.hf_quantizer`` does, where diffusers
is installed) adds ``torch_lowbit`` to its quantizer and config mappings (``diffusers.quantizers.auto``), once.

- Dense weights (``from_pretrained`` of a bf16 / fp32 model): each nn.Linear weight is quantized as it is read
  (``Fp8WeightOnly`` -> Fp8Linear, ``Int8Dynamic`` -> Int8Linear, the 4-bit configs -> W4Linear), one layer at a
  time; which layers stay in high precision is the diffusion rule (:mod:`torch_lowbit.diffusion`) unless
  ``modules_to_not_convert`` names them.
- ``save_pretrained`` writes the layers' own tensors (``weight`` fp8 / int8 with ``weight_scale`` fp32; 4-bit:
  ``weight_packed``, ``weight_scale``, ``weight_offset`` / ``weight_scale_2`` where the layer has them; ``bias``)
  and the config; ``from_pretrained`` of that directory builds the same layers and loads them as stored. A layer's
  kind is its stored tensors' (fp8, int8, packed codes); a 4-bit layer's format and group size are the config's,
  as the tensors alone cannot tell them (int4 without zero points and uint4 without biases are the same bytes).
- Single files (``from_single_file``): diffusers' own conversion function maps the file's names to the model's,
  run on :class:`~torch_lowbit.formats.lazy.LazyTensor` stand-ins, so nothing is read while it renames, splits and
  concatenates. Then each model tensor is read when diffusers asks for it: an fp8 linear weight of a diffusion FP8
  file (raw e4m3, ComfyUI's scaled fp8, ``weight_scale``) becomes an Fp8Linear holding the stored codes and their
  scale (the rows it is made of read straight from the file: no dense copy at any time), a dense linear weight is
  quantized like ``from_pretrained``'s, other fp8 tensors are upcast exactly (``float(w) * scale``).
"""
from __future__ import annotations

import os
import sys
from typing import Optional

import torch
import torch.nn as nn
from diffusers.quantizers import auto as _auto
from diffusers.quantizers.base import DiffusersQuantizer

from ._storage import to_fp8_storage
from .diffusion import diffusion_filter
from .formats.detect import matches
from .formats.lazy import LazyTensor, evaluate, leaves, row_runs
from .formats.source import CheckpointError, SafetensorsSource, Source, StateDictSource
from .hf_quantizer import QUANT_METHOD, W4_CONFIGS, W4_FIXED_GROUP, TorchLowbitConfig
from .nn import Fp8Linear, Int8Linear, W4Linear
from .nn._quantized_linear import frozen_bias
from .quantize import _handler_for, _swappable

# the layers a diffusers checkpoint of this method holds -> TorchLowbitConfig's weights that make one
LAYER_WEIGHTS = {Fp8Linear: lambda layer: "fp8", Int8Linear: lambda layer: "int8", W4Linear: lambda layer: layer.format}
SAVED_LAYERS = tuple(LAYER_WEIGHTS)
_LAYERS = {torch.float8_e4m3fn: Fp8Linear, torch.int8: Int8Linear}  # stored weight dtype -> layer


class TorchLowbitDiffusersQuantizer(DiffusersQuantizer):
    """diffusers' side of ``TorchLowbitConfig``. ``pre_quantized``: the checkpoint holds torch_lowbit layers (a
    directory written by ``save_pretrained``; diffusers also says so for every single file)."""
    requires_calibration = False
    use_keep_in_fp32_modules = True  # the model's fp32 modules stay fp32, as in a load without quantization

    def __init__(self, quantization_config, **kwargs):
        super().__init__(quantization_config, **kwargs)
        self._files = None  # from_pretrained's checkpoint files (maybe_update_loaded_keys)
        self._single: Optional[_SingleFile] = None
        self._keep_fp32 = []

    # ---------------------------------------------------------------------------- configuration
    def update_torch_dtype(self, torch_dtype):
        return torch.bfloat16 if torch_dtype is None else torch_dtype

    @property
    def is_serializable(self):
        return True

    @property
    def is_trainable(self):
        return False

    @property
    def is_compileable(self) -> bool:
        return True

    def _converted(self, fqn: str) -> bool:
        names = self.quantization_config.modules_to_not_convert
        if names is None:
            return diffusion_filter(None, fqn)
        return not any(matches(fqn, p) for p in names)

    # ---------------------------------------------------------------------------- the steps diffusers calls
    def maybe_update_loaded_keys(self, loaded_keys, checkpoint_files):
        self._files = list(checkpoint_files)  # from_pretrained: a directory, never a single file
        return loaded_keys

    def maybe_update_state_dict(self, state_dict):
        # from_single_file calls this with the whole file, before anything else; from_pretrained calls it for each
        # shard, after maybe_update_loaded_keys
        if self._files is not None or self._single is not None:
            return state_dict
        self._single = _SingleFile(state_dict, self.quantization_config)
        return self._single.lazy

    def _process_model_before_weight_loading(self, model, keep_in_fp32_modules=None, state_dict=None, **kwargs):
        self._keep_fp32 = list(keep_in_fp32_modules or [])
        if self._single is not None:
            self._single.consume_scales(state_dict)
        elif self.pre_quantized and self._files:
            _build_saved_layers(model, self._files, self.quantization_config)
        return model

    def check_if_quantized_param(self, model, param_value, param_name, state_dict, **kwargs):
        if isinstance(state_dict.get(param_name), LazyTensor):
            return True  # a single file: every tensor is read here
        module, attr = _module_of(model, param_name)
        if isinstance(module, SAVED_LAYERS):
            return True
        return (not self.pre_quantized and attr == "weight" and _swappable(module)
                and self._converted(param_name.rsplit(".", 1)[0]))

    def create_quantized_param(self, model, param_value, param_name, target_device, state_dict, unexpected_keys=None,
                               dtype=None, **kwargs):
        stored = state_dict.get(param_name, param_value)  # as the checkpoint holds it (diffusers casts param_value)
        device = torch.device(target_device) if target_device is not None else torch.device("cpu")
        if isinstance(stored, LazyTensor):
            return self._single.load(self, model, param_name, stored, device, dtype)
        module, attr = _module_of(model, param_name)
        if isinstance(module, SAVED_LAYERS):
            value = param_value if attr == "bias" else stored
            return _set_layer_tensor(module, attr, value, device)
        self._quantize_linear(model, param_name, param_value.to(device))

    def _quantize_linear(self, model, param_name: str, weight: torch.Tensor):
        """Swap the nn.Linear owning `param_name` for its quantized layer, made from `weight` (real, on its device);
        its bias, loaded or not yet, moves over."""
        name = param_name.rsplit(".", 1)[0]
        linear = model.get_submodule(name)
        dense = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        dense.weight = nn.Parameter(weight, requires_grad=False)
        config = self.quantization_config.quantize_config()
        layer = _handler_for(config)(dense, config)
        if linear.bias is not None:
            layer.bias = linear.bias if linear.bias.is_meta else frozen_bias(linear.bias.detach().to(weight.device))
        model.set_submodule(name, layer)

    def _dequantize(self, model):
        from ._diffusers_model import dense_again

        dense_again(model)  # diffusers' dequantize then drops this quantizer
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if meta and self._single is not None:  # a conversion that only renames (Wan's) leaves a missing tensor here
            raise CheckpointError(f"{self._single.where}: diffusers' conversion of its tensors left these tensors "
                                  f"of {type(model).__name__} without a value: {', '.join(meta[:6])}; the file lacks "
                                  f"the tensors it maps to them")
        if meta:
            raise CheckpointError(f"after loading, {len(meta)} model tensors were given no value by the checkpoint "
                                  f"(still on the meta device): {', '.join(meta[:6])}")
        from ._diffusers_model import attach_diffusers_methods
        return attach_diffusers_methods(model)


def _module_of(model, param_name: str):
    mod_name, _, attr = param_name.rpartition(".")
    return (model.get_submodule(mod_name) if mod_name else model), attr


def _set_layer_tensor(layer, attr: str, value: torch.Tensor, device):
    """One stored tensor of a layer of SAVED_LAYERS: codes and scales as stored (fp8 / int8 scales float32; the
    4-bit layer was built with its tensors' dtypes), the bias in the dtype diffusers loads the model in."""
    if isinstance(layer, W4Linear) and getattr(layer, attr, None) is not None and attr in layer._format_buffers:
        setattr(layer, attr, to_fp8_storage(value, device) if attr in layer._fp8_buffers else value.to(device))
    elif attr == "weight":
        layer.weight = to_fp8_storage(value, device) if isinstance(layer, Fp8Linear) else value.to(device)
    elif attr == "bias":
        layer.bias = frozen_bias(value.to(device))
    elif attr in ("weight_scale", "input_scale"):
        setattr(layer, attr, value.to(device=device, dtype=torch.float32))
    else:
        raise CheckpointError(f"{type(layer).__name__} has no tensor {attr!r}")


def _build_saved_layers(model, files, config: TorchLowbitConfig):
    """The torch_lowbit layers a ``save_pretrained`` directory holds, swapped in (on meta) before diffusers loads
    it: a module whose ``weight`` is stored as fp8 / int8 beside a ``weight_scale`` is one, as the file says (fp8
    scales per block of the config's block size, where it says so), and so is one with a ``weight_packed`` (4-bit, in
    the config's format and group size)."""
    other = [f for f in files if not str(f).endswith(".safetensors")]
    if other:  # a pickle of safe_serialization=False, or a FlashPack file
        raise CheckpointError(f"{other[0]}: torch_lowbit reads the layers of a saved model only from .safetensors "
                              f"files (it unpickles nothing); save it with safe_serialization=True (the default)")
    src = SafetensorsSource(files, description=os.path.dirname(files[0]))
    try:
        for key in src.keys():
            if not key.endswith(".weight_scale"):
                continue
            name = key[: -len(".weight_scale")]
            packed = f"{name}.weight_packed" in src
            wkey = f"{name}.weight_packed" if packed else f"{name}.weight"
            known = packed or (wkey in src and src.dtype(wkey) in _LAYERS)
            try:
                linear = model.get_submodule(name) if known else None
            except AttributeError:
                # a layer the model builds only later (a fused to_qkv saved with its projections): its tensors are
                # unused keys, as diffusers reports them for a dense fused model
                continue
            if not known or not isinstance(linear, nn.Linear):
                raise CheckpointError(f"{src.description}: {key!r} is the scale of no fp8 / int8 / 4-bit weight of an "
                                      f"nn.Linear {name!r} of {type(model).__name__}")
            build = _saved_w4_layer if packed else _saved_fp8_int8_layer
            model.set_submodule(name, build(src, name, linear, config))
    finally:
        src.close()


def _saved_fp8_int8_layer(src, name: str, linear: nn.Linear, config: TorchLowbitConfig):
    from .granularity import infer_granularity

    wkey, key = f"{name}.weight", f"{name}.weight_scale"
    N, K = src.shape(wkey)
    bias = linear.bias is not None
    if _LAYERS[src.dtype(wkey)] is Int8Linear:
        return Int8Linear(K, N, bias, device="meta")
    block_size = config.block_size if config.granularity == "block" else None
    g = infer_granularity(src.shape(key), N, K, block_size, what=key)
    layer = Fp8Linear(K, N, bias, granularity=g, block_size=g.block_size, device="meta")
    if tuple(src.shape(key)) != tuple(layer.weight_scale.shape):  # [N, 1] or 0-d, as stored
        layer.weight_scale = torch.empty(src.shape(key), device="meta")
    return layer


def row_group(group, K: int) -> int:
    """The group size a 4-bit layer of K codes a row has under a config's `group` (None: per channel): never longer
    than the row, as quantize_ makes it. What the loader builds and what save_pretrained checks it can record."""
    return max(K, 1) if group is None else min(group, max(K, 1))


def _saved_w4_layer(src, name: str, linear: nn.Linear, config: TorchLowbitConfig) -> W4Linear:
    """A 4-bit layer of the config's format and group size (a group never longer than the row, as quantize_ makes
    them), with the scale dtype, zero points or biases and global scale its stored tensors have."""
    fmt, K, N = config.weights, linear.in_features, linear.out_features
    if fmt not in W4_CONFIGS:
        raise CheckpointError(f"{src.description}: {name}.weight_packed holds 4-bit codes, but config.json's "
                              f"quantization_config says weights={fmt!r} (4-bit: {' / '.join(W4_CONFIGS)})")
    group = row_group(W4_FIXED_GROUP.get(fmt, config.group_size), K)
    try:
        layer = W4Linear(K, N, linear.bias is not None, format=fmt, group_size=group,
                         scale_dtype=src.dtype(f"{name}.weight_scale"), offset=f"{name}.weight_offset" in src,
                         global_scale=f"{name}.weight_scale_2" in src, device="meta")
    except ValueError as e:
        raise CheckpointError(f"{src.description}: {name}: {e}") from None
    for attr in layer._format_buffers:
        held = getattr(layer, attr)
        if held is not None and tuple(src.shape(f"{name}.{attr}")) != tuple(held.shape):
            raise CheckpointError(f"{src.description}: {name}.{attr} has shape {tuple(src.shape(f'{name}.{attr}'))}, "
                                  f"expected {tuple(held.shape)} for {fmt} weights [{N}, {K}] in groups of {group} "
                                  f"(config.json's quantization_config)")
    return layer


# ------------------------------------------------------------------------------------------------ single files
def _from_single_file_call():
    """(its locals, the file as the caller named it) of the ``from_single_file`` call under way, read from its frame
    (the quantizer is handed only the file's tensors); ({}, None) where there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "from_single_file" and "pretrained_model_link_or_path_or_dict" in frame.f_locals:
            where = frame.f_locals["pretrained_model_link_or_path_or_dict"]
            return dict(frame.f_locals), (os.fspath(where) if isinstance(where, (str, os.PathLike)) else None)
        frame = frame.f_back
    return {}, None


def _local_file(where: Optional[str], call: dict) -> Optional[str]:
    """The local file behind what the caller named: the path itself, or for a Hub link the copy diffusers has just
    downloaded into the cache (found the way it found it, without the network); None otherwise."""
    if where is None or os.path.isfile(where):
        return where
    try:
        from diffusers.loaders.single_file_utils import _extract_repo_id_and_weights_name
        from diffusers.utils.hub_utils import _get_model_file

        repo_id, weights_name = _extract_repo_id_and_weights_name(where)
        return _get_model_file(repo_id, weights_name=weights_name, cache_dir=call.get("cache_dir"),
                               local_files_only=True, token=call.get("token"), revision=call.get("revision"))
    except Exception:  # not a Hub link, or not in the cache: read from the tensors diffusers loaded
        return None


def _check_conversion(call: dict, lazy: "_LazyCheckpoint"):
    """Run diffusers' conversion for the model class being loaded on a copy of the lazy tensors (nothing is read):
    where it fails, and the file is not already in the model's own names (which diffusers loads unconverted), the
    error names the file and the tensors it holds, not a bare IndexError from inside the conversion."""
    from diffusers.loaders import single_file_model as sfm

    cls = call.get("cls")
    mapping = sfm._get_single_file_loadable_mapping_class(cls) if isinstance(cls, type) else None
    if mapping is None:
        return
    config = _model_config(cls, call)
    try:
        sfm.SINGLE_FILE_LOADABLE_CLASSES[mapping]["checkpoint_mapping_fn"](
            config=config, checkpoint=_LazyCheckpoint(lazy, where=lazy.where, model=lazy.model))
        return
    except Exception as e:  # the conversion's own failure on tensors that are not its model's
        failure = e
    if _model_keys(cls, config) == set(lazy):
        return
    if isinstance(failure, _MissingTensor):  # names the file and the tensor the conversion asked for
        raise failure
    raise CheckpointError(f"{lazy.where}: its tensors ({', '.join(repr(k) for k in list(lazy)[:3])}, ...) match no "
                          f"layout diffusers converts to {cls.__name__} (its conversion failed: "
                          f"{type(failure).__name__}: {failure})")


def _model_config(cls, call: dict):
    """The diffusers config the caller named (``config=``), as from_single_file reads it; None without one."""
    try:
        return cls.load_config(call["config"], subfolder=call.get("subfolder"),
                               local_files_only=call.get("local_files_only"), token=call.get("token"),
                               revision=call.get("config_revision"))
    except Exception:
        return None


def _model_keys(cls, config) -> set:
    """The state-dict keys of `cls` built from `config` (on meta), or an empty set."""
    try:
        from accelerate import init_empty_weights

        with init_empty_weights():
            return set(cls.from_config(config).state_dict())
    except Exception:
        return set()


class _LazyCheckpoint(dict):
    """The file's tensors as diffusers' conversion sees them: a tensor it asks for and the file lacks is an error
    naming the file and the tensor."""

    def __init__(self, items=(), where="the checkpoint", model="the model"):
        super().__init__(items)
        self.where, self.model = where, model

    def _missing(self, key):
        return _MissingTensor(f"{self.where} has no tensor {key!r}, which diffusers needs to build {self.model} from "
                              f"it: the file's tensors (e.g. {', '.join(repr(k) for k in list(self)[:3])}) are not "
                              f"this model's")

    def __getitem__(self, key):
        if key not in self:
            raise self._missing(key)
        return super().__getitem__(key)

    def pop(self, key, *default):
        if key not in self and not default:
            raise self._missing(key)
        return super().pop(key, *default)


class _MissingTensor(CheckpointError, KeyError):
    def __str__(self):
        return self.args[0]


class _SingleFile:
    """One ``from_single_file`` load: the file's tensors (read from the file itself where diffusers was given a
    path, else from the tensors it passed), its diffusion FP8 format and the lazy stand-ins diffusers converts."""

    def __init__(self, checkpoint, config: TorchLowbitConfig):
        from .formats.diffusion import FORMAT, MARKER, check_dtypes, check_scales

        call, path = _from_single_file_call()
        cls = call.get("cls")
        self.config = config
        self.src: Source = _file_source(_local_file(path, call), checkpoint) or StateDictSource(checkpoint)
        self.where = path if path is not None else "the state dict passed to from_single_file"
        check_dtypes(self.src, self.where)
        self.fmt = FORMAT.from_tensors(self.src)  # None: no fp8 tensor (a dense file: quantized like from_pretrained)
        if self.fmt is not None:
            check_scales(self.src, self.fmt, self.where)
        self.lazy = _LazyCheckpoint(((k, LazyTensor.leaf(k, self.src.dtype(k), self.src.shape(k)))
                                     for k in self.src.keys()), self.where,
                                    cls.__name__ if isinstance(cls, type) else "the model")
        _check_conversion(call, self.lazy)
        self._scale_keys = set()
        if self.fmt is not None:
            suffixes = (f".{self.fmt.scale_key}",) + tuple(f".{e}" for e in self.fmt.extra_keys)
            self._scale_keys = {k for k in self.src.keys() if k.endswith(suffixes) or k.rsplit(".", 1)[-1] == MARKER}

    def consume_scales(self, converted):
        """Drop from diffusers' converted dict what only the fp8 weights use (scales, ComfyUI's marker and input
        scales): read with their weights here, they are not the model's tensors."""
        if converted is None:
            return
        for k in [k for k, v in converted.items() if isinstance(v, LazyTensor) and leaves(v) <= self._scale_keys]:
            del converted[k]

    def _upcast(self, key: str) -> torch.Tensor:
        """A leaf as a real tensor; an fp8 one upcast exactly, ``float(w) * scale``."""
        from .formats.diffusion import weight_scale

        value = self.src.get(key)
        if value.dtype != torch.float8_e4m3fn:
            return value
        scale = weight_scale(self.src, self.fmt, key, self.where) if key.endswith(".weight") else torch.ones(1)
        return value.float() * (scale.reshape(-1, *([1] * (value.dim() - 1))) if value.dim() else scale.reshape(()))

    def load(self, quantizer, model, name: str, lazy: LazyTensor, device, dtype):
        """Put model tensor `name` (diffusers' converted `lazy`) into the model."""
        module, attr = _module_of(model, name)
        mod_name = name.rsplit(".", 1)[0]
        if attr == "weight" and lazy.dtype == torch.float8_e4m3fn and type(module) is nn.Linear \
                and (self.config.modules_to_not_convert is None or quantizer._converted(mod_name)):
            codes, scale = self._fp8_rows(name, lazy)
            layer = Fp8Linear.from_quantized(to_fp8_storage(codes, device), scale.to(device))
            if module.bias is not None:
                layer.bias = module.bias if module.bias.is_meta else frozen_bias(module.bias.detach().to(device))
            model.set_submodule(mod_name, layer)
            return
        value = evaluate(lazy, self._upcast)
        if value.is_floating_point():
            keep = any(m in name.split(".") for m in quantizer._keep_fp32)
            value = value.to(torch.float32 if keep else (dtype or value.dtype))
        if attr == "weight" and _swappable(module) and quantizer._converted(mod_name):
            return quantizer._quantize_linear(model, name, value.to(device))
        if isinstance(module, SAVED_LAYERS):
            return _set_layer_tensor(module, attr, value, device)
        from accelerate.utils import set_module_tensor_to_device

        set_module_tensor_to_device(model, name, device, value=value, dtype=value.dtype)  # else: the meta dtype

    def _fp8_rows(self, name: str, lazy: LazyTensor):
        """(codes, fp32 scale [1] or [N]) of the fp8 linear weight `name`: its rows read as stored, each with the
        scale of the checkpoint weight it comes from."""
        from .formats.diffusion import weight_scale

        runs = row_runs(lazy, self.src.shape)
        if runs is None:
            sources = sorted(leaves(lazy))
            raise CheckpointError(f"{self.where}: the model's {name} is made from {', '.join(sources[:3])} by "
                                  f"something other than taking whole rows, which fp8 codes with their scales cannot "
                                  f"follow; pass modules_to_not_convert=[{name.rsplit('.', 1)[0]!r}] to upcast it")
        N, K = lazy.shape
        # one run (a rename, one piece of a split): read as it is; several: each copied into place, one at a time
        codes = None if len(runs) == 1 else torch.empty(N, K, dtype=torch.float8_e4m3fn)
        scales = torch.empty(N, dtype=torch.float32)
        row = 0
        for key, start, stop in runs:
            if self.src.dtype(key) != torch.float8_e4m3fn:
                raise CheckpointError(f"{self.where}: the model's {name} joins float8_e4m3fn rows with rows of "
                                      f"{key!r}, which is {self.src.dtype(key)}")
            n = stop - start
            if codes is None:
                codes = self.src.get_rows(key, start, stop)
            else:
                codes[row:row + n] = self.src.get_rows(key, start, stop)
            s = weight_scale(self.src, self.fmt, key, self.where)
            scales[row:row + n] = s if s.numel() == 1 else s[start:stop]
            row += n
        uniform = N > 0 and bool((scales == scales[0]).all())
        return codes, (scales[:1].clone() if uniform or N == 0 else scales)


def _file_source(path: Optional[str], checkpoint) -> Optional[Source]:
    """The file itself, read one tensor (or rows of one) at a time into memory of our own, where `path` is a local
    .safetensors file holding exactly the tensors diffusers read from it; None otherwise."""
    if path is None or not path.endswith(".safetensors") or not os.path.isfile(path):
        return None
    src = SafetensorsSource([path], description=path)
    same = set(src.keys()) == set(checkpoint) and all(
        src.dtype(k) == v.dtype and tuple(src.shape(k)) == tuple(v.shape) for k, v in checkpoint.items())
    if not same:
        src.close()
        return None
    return src


def _register():
    if _auto.AUTO_QUANTIZER_MAPPING.get(QUANT_METHOD.value) not in (None, TorchLowbitDiffusersQuantizer):
        raise RuntimeError(f"diffusers already has a quantization method {QUANT_METHOD.value!r}: "
                           f"{_auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD.value]}")
    _auto.AUTO_QUANTIZER_MAPPING[QUANT_METHOD.value] = TorchLowbitDiffusersQuantizer
    _auto.AUTO_QUANTIZATION_CONFIG_MAPPING[QUANT_METHOD.value] = TorchLowbitConfig


_register()
