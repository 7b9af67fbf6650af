"""compressed-tensors' 4-bit weight layouts (llmcompressor's W4A16, W4A16_ASYM, NVFP4A16, MXFP4 schemes; GPTQ and
AWQ checkpoints in the same formats), read and written. A config group's ``format`` says which:

- ``pack-quantized``, int 4-bit, strategy ``group`` (``group_size``) or ``channel``: ``weight_packed`` int32
  ``[N, ceil(K/8)]``, eight codes per word along K, code j in bits ``4*(j%8)``, stored as ``q + 8`` (q in
  [-8, 7]); ``weight_scale`` ``[N, G]`` in the model's dtype; ``weight_shape`` ``[N, K]``; asymmetric:
  ``weight_zero_point`` int32 ``[ceil(N/8), G]``, the int8 zero points packed the same way along N (dim 0).
  ``w = (q - zp) * scale``: torch_lowbit's ``int4`` ``(code - 8 - zp) * s`` with the same zero points.
- ``nvfp4-pack-quantized`` (float 4-bit, strategy ``tensor_group``, group 16): ``weight_packed`` uint8
  ``[N, K/2]`` (even k low), ``weight_scale`` float8_e4m3fn ``[N, K/16]``, ``weight_global_scale`` fp32 ``[1]``,
  a divisor: ``w = e2m1 * (scale / global_scale)``.
- ``mxfp4-pack-quantized`` (float 4-bit, group 32; compressed-tensors >= 0.20): the same packing, ``weight_scale``
  uint8 E8M0 exponents ``[N, K/32]``, no global scale.

The packed codes become W4Linear's bytes as a view of the words (``tensors.nibble_bytes``): no dense copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from .registry import CheckpointError, config_field
from .tensors import W4Weight, nibble_bytes, nibble_words, unpack_nibbles

# compressed-tensors format -> (weight type, torch_lowbit format, the group size it fixes or None)
W4_FORMATS = {"pack-quantized": ("int", "int4", None), "nvfp4-pack-quantized": ("float", "nvfp4", 16),
              "mxfp4-pack-quantized": ("float", "mxfp4", 32)}
INT4_STRATEGIES = ("group", "channel")


@dataclass(frozen=True)
class W4Args:
    """One config group's 4-bit weights: torch_lowbit format, strategy, group size (None: per channel),
    symmetric."""
    format: str
    strategy: str
    group_size: Optional[int]
    symmetric: bool = True


def parse_args(ct_format: str, w: dict, where: str) -> W4Args:
    """A config group's ``weights`` of a 4-bit compressed-tensors format, or a CheckpointError naming the field."""
    bits, typ = config_field(w, "num_bits", int, where, 8), config_field(w, "type", str, where, "int")
    want_type, fmt, fixed_group = W4_FORMATS[ct_format]
    if bits != 4 or typ != want_type:
        raise CheckpointError(f"{where}: {bits}-bit {typ} weights in format {ct_format!r} are not supported: "
                              f"torch_lowbit reads 4-bit {want_type} weights in it")
    strategy = config_field(w, "strategy", str, where, "group")
    group = config_field(w, "group_size", int, where, None)
    symmetric = config_field(w, "symmetric", bool, where, True)
    actorder = config_field(w, "actorder", (str, bool), where, None)
    if fmt == "int4":
        if strategy not in INT4_STRATEGIES:
            raise CheckpointError(f"{where}.strategy {strategy!r} is not supported for 4-bit int weights "
                                  f"{INT4_STRATEGIES}")
        if strategy == "group" and (group is None or group < 1):
            raise CheckpointError(f"{where}.group_size must be a positive int for strategy 'group', got {group!r}")
        if actorder == "group":  # groups follow a permutation (weight_g_idx): not contiguous runs of K
            raise CheckpointError(f"{where}.actorder 'group' is not supported: its groups are a permutation of the "
                                  f"input features (weight_g_idx), not consecutive runs of K")
        return W4Args(fmt, strategy, group if strategy == "group" else None, symmetric)
    if not symmetric:
        raise CheckpointError(f"{where}: asymmetric {fmt} weights (zero points) are not supported")
    if group != fixed_group:
        raise CheckpointError(f"{where}.group_size must be {fixed_group} for {ct_format!r}, got {group!r}")
    return W4Args(fmt, strategy, group, True)


def _int_shape(src, key: str) -> Tuple[int, int]:
    t = src.get(key).reshape(-1)
    if t.numel() != 2 or t.is_floating_point():
        raise CheckpointError(f"{key} must hold two integers [N, K], got {t.tolist()}")
    return int(t[0]), int(t[1])


def _check_shape(key: str, t: torch.Tensor, want, what: str):
    if tuple(t.shape) != tuple(want):
        raise CheckpointError(f"{key} has shape {list(t.shape)}, expected {list(want)} ({what})")


def read(src, args: W4Args, prefix: str, shape: Tuple[int, int]) -> W4Weight:
    """Module `prefix`'s 4-bit weight (the model's layer is ``shape`` = [N, K])."""
    N, K = shape
    pkey, skey = f"{prefix}.weight_packed", f"{prefix}.weight_scale"
    keys = [pkey, skey]
    if skey not in src:
        raise CheckpointError(f"{pkey} is a 4-bit weight but its scale {skey} is missing from the checkpoint")
    shape_key = f"{prefix}.weight_shape"
    if shape_key in src:
        keys.append(shape_key)
        if _int_shape(src, shape_key) != (N, K):
            raise CheckpointError(f"{shape_key} = {list(_int_shape(src, shape_key))} but the model's layer {prefix} "
                                  f"expects {[N, K]} (out_features, in_features)")
    group = args.group_size if args.group_size is not None else max(K, 1)
    G = -(-K // group)
    words = src.get(pkey)
    scale = src.get(skey)
    offset = global_scale = None
    if args.format == "int4":
        if tuple(words.shape[:1]) != (N,):
            raise CheckpointError(f"{pkey} has shape {list(words.shape)}, expected [{N}, {-(-K // 8)}] (eight 4-bit "
                                  f"codes per int32 along K = {K})")
        packed = nibble_bytes(words, K, pkey)
        if not scale.is_floating_point() or scale.dtype == torch.float64:
            raise CheckpointError(f"{skey} must be float32 / float16 / bfloat16, got {scale.dtype}")
        _check_shape(skey, scale, (N, G), f"one scale per row and group of {group}")
        zkey = f"{prefix}.weight_zero_point"
        if not args.symmetric:
            if zkey not in src:
                raise CheckpointError(f"{zkey} is missing: the config says these weights are asymmetric")
            z = src.get(zkey)
            _check_shape(zkey, z, (-(-N // 8), G), "int8 zero points packed eight per int32 along N")
            # along N (dim 0): the transposed words are rows of G, N codes each; stored as zp + 8
            offset = (unpack_nibbles(nibble_bytes(z.t(), N, zkey), N).t().to(torch.int16) - 8).to(torch.int8)
            keys.append(zkey)
        elif zkey in src:
            raise CheckpointError(f"{zkey} is in the checkpoint but the config says the weights are symmetric")
        gkey = f"{prefix}.weight_g_idx"
        if gkey in src:  # GPTQ's activation order: harmless only when it names the natural groups
            g_idx = src.get(gkey)
            if not torch.equal(g_idx.to(torch.int64), torch.arange(K) // group):
                raise CheckpointError(f"{gkey} permutes the input features across groups (GPTQ actorder 'group'): "
                                      f"torch_lowbit reads groups of consecutive K only")
            keys.append(gkey)
        scale = scale.contiguous()
    else:
        if words.dtype != torch.uint8:
            raise CheckpointError(f"{pkey} must be uint8 (two 4-bit codes per byte), got {words.dtype}")
        _check_shape(pkey, words, (N, (K + 1) // 2), "two 4-bit codes per byte along K")
        packed = words
        want_scale = torch.float8_e4m3fn if args.format == "nvfp4" else torch.uint8
        if scale.dtype != want_scale:
            raise CheckpointError(f"{skey} must be {want_scale} ({args.format} scales), got {scale.dtype}")
        _check_shape(skey, scale, (N, G), f"one scale per row and group of {group}")
        if args.format == "nvfp4":
            gkey = f"{prefix}.weight_global_scale"
            if gkey not in src:
                raise CheckpointError(f"{gkey} is missing: nvfp4-pack-quantized weights divide their scales by it")
            gs = src.get(gkey)
            if gs.numel() != 1 or not gs.is_floating_point():
                raise CheckpointError(f"{gkey} must be one floating-point number, got {gs.dtype} of shape "
                                      f"{list(gs.shape)}")
            # compressed-tensors divides: w = e2m1 * (scale / global_scale), the quotient rounded in the scale's
            # dtype (bf16 in its own decompressor). W4Linear multiplies by fp32(1 / global_scale), the reciprocal
            # taken in float64 and rounded once: within one fp32 rounding of the exact quotient (exact for a
            # power of two), where compressed-tensors' bf16 quotient is within one bf16 rounding.
            global_scale = reciprocal_f32(gs).reshape(1)
            keys.append(gkey)
    return W4Weight(args.format, group, K, packed, scale, offset, global_scale, keys)


# ---------------------------------------------------------------------------------------------------- writing
def _int4_plan(layers) -> Dict[str, tuple]:
    """Each int4 layer's config group (strategy, group size, symmetric), as few groups as the weights allow: one
    group size for all (the grouped layers' own; a layer with one group per row is written in it with its scales
    and zero points repeated, the same weights), zero points for all if any layer has them (zeros elsewhere).
    transformers (5.24) dequantizes every dense module by one config group, so one group is what it reads right;
    layers of different group sizes need a group each (compressed-tensors and torch_lowbit read those)."""
    grouped = sorted({m.group_size for m in layers.values() if m.group_size < m.in_features})
    symmetric = all(m.weight_offset is None for m in layers.values())
    plan = {}
    for name, m in layers.items():
        if m.group_size < m.in_features:
            plan[name] = ("group", m.group_size, symmetric)
        elif grouped:
            plan[name] = ("group", grouped[0], symmetric)
        else:
            plan[name] = ("channel", None, symmetric)
    return plan


def reciprocal_f32(x: torch.Tensor) -> torch.Tensor:
    """fp32(1 / x), the reciprocal taken in float64 and rounded once."""
    return (1.0 / x.to(torch.float64)).to(torch.float32)


def global_divisor(g: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``weight_global_scale`` (a divisor) for W4Linear's multiplier `g`: the fp32 nearest
    1 / g whose reciprocal the loader rounds back to `g` exactly (fp32(1/g) or a neighbour), so a checkpoint
    written and read back holds the same multiplier. Not always the divisor a loaded checkpoint had: several fp32
    divisors can share one rounded reciprocal."""
    g = g.to(torch.float32).reshape(1)
    d = reciprocal_f32(g)
    for c in (d, torch.nextafter(d, torch.full_like(d, float("inf"))), torch.nextafter(d, torch.zeros_like(d))):
        if torch.equal(reciprocal_f32(c), g):
            return c
    return d


@dataclass(frozen=True)
class ExpertWeight:
    """One expert's projection of a W4Experts, as the attributes of a W4Linear that :func:`model_tensors` reads
    (views of the stacked tensors: nothing copied until written)."""
    format: str
    group_size: int
    in_features: int
    out_features: int
    weight_packed: torch.Tensor
    weight_scale: torch.Tensor
    weight_offset: Optional[torch.Tensor]
    weight_scale_2: Optional[torch.Tensor]
    bias: None = None
    kind: str = "W4Experts"


def expert_weights(name: str, layer) -> Dict[str, ExpertWeight]:
    """A W4Experts' weights one Linear per expert and projection, under the per-expert names checkpoints use
    (``{name}.{e}.gate_proj`` = gate rows of gate_up, ``up_proj`` the rest, ``down_proj``), as
    compressed-tensors writes MoE experts. Layers whose arithmetic that layout cannot hold are refused: a per-expert
    Linear has no bias, and the loaders run [gate; up] SwiGLU."""
    if layer.gate_up_bias is not None or layer.down_bias is not None or layer.activation != "swiglu":
        raise ValueError(f"save_quantized: {name} is a W4Experts with expert biases or the activation "
                         f"{layer.activation!r}, which compressed-tensors' per-expert Linears cannot hold (the biases "
                         f"would be dropped, the activation read as SwiGLU)")
    E, H, I = layer.num_experts, layer.hidden_size, layer.intermediate_size
    out = {}
    for e in range(E):
        for proj, p, rows, K in (("gate_proj", "gate_up", slice(0, I), H), ("up_proj", "gate_up", slice(I, 2 * I), H),
                                 ("down_proj", "down", slice(0, H), I)):
            offset, scale_2 = getattr(layer, f"{p}_offset"), getattr(layer, f"{p}_scale_2")
            out[f"{name}.{e}.{proj}"] = ExpertWeight(
                layer.format, layer.group_size, K, rows.stop - rows.start, getattr(layer, f"{p}_packed")[e, rows],
                getattr(layer, f"{p}_scale")[e, rows], None if offset is None else offset[e, rows],
                None if scale_2 is None else scale_2[e].reshape(1))
    return out


def _check_writable(name: str, layer):
    if layer.format == "uint4":
        raise ValueError(f"save_quantized: {name} is a {getattr(layer, 'kind', 'W4Linear')} of format 'uint4' (MLX "
                         f"affine: w = q * scale + bias, "
                         f"float biases), which has no compressed-tensors form -- its int4 zero points are integers "
                         f"subtracted before the scale, and rewriting float biases as them would change the weights. "
                         f"Keep the MLX checkpoint, or quantize to 'int4' (Int4WeightOnly) for a compressed-tensors "
                         f"checkpoint")
    fixed = W4_FORMATS.get(f"{layer.format}-pack-quantized", (None, None, None))[2]
    if fixed is not None and layer.group_size != fixed:
        raise ValueError(f"save_quantized: {name} is a {layer.format} W4Linear with group_size {layer.group_size}, "
                         f"which has no compressed-tensors form ({layer.format}-pack-quantized has groups of {fixed})")


def model_tensors(layers) -> Tuple[Dict[str, torch.Tensor], Dict[str, tuple]]:
    """The tensors of a model's W4Linear layers (``{module name: layer}``) in compressed-tensors' layouts, and each
    module's config group key (see :func:`scheme_config`)."""
    from .._storage import as_fp8_dtype

    for name, m in layers.items():
        _check_writable(name, m)
    plan = _int4_plan({n: m for n, m in layers.items() if m.format == "int4"})
    out, schemes = {}, {}
    for name, layer in layers.items():
        N, K = layer.out_features, layer.in_features
        scale = layer.weight_scale.detach().cpu()
        if layer.format == "int4":
            strategy, group, symmetric = plan[name]
            G = 1 if group is None else -(-K // group)
            zp = layer.weight_offset
            zp = torch.zeros(N, scale.shape[1], dtype=torch.int8) if zp is None else zp.detach().cpu()
            if scale.shape[1] != G:  # one group per row written in the model's group size: the same weights
                scale, zp = scale.expand(N, G), zp.expand(N, G)
            out[f"{name}.weight_packed"] = nibble_words(layer.weight_packed.detach(), K)
            out[f"{name}.weight_scale"] = scale.contiguous()
            out[f"{name}.weight_shape"] = torch.tensor([N, K], dtype=torch.int64)
            if not symmetric:
                z = zp.to(torch.int16)
                if bool(((z < -8) | (z > 7)).any()):
                    raise ValueError(f"save_quantized: {name}.weight_offset holds zero points outside [-8, 7], which "
                                     f"compressed-tensors' 4-bit zero points cannot store")
                codes = (z + 8).to(torch.uint8).t().contiguous()  # [G, N]: packed along N
                pairs = torch.nn.functional.pad(codes, (0, N % 2)).view(G, -1, 2)
                zp_bytes = pairs[..., 0] | (pairs[..., 1] << 4)
                out[f"{name}.weight_zero_point"] = nibble_words(zp_bytes, N).t().contiguous()
            schemes[name] = ("int4", strategy, group, symmetric)
        else:
            out[f"{name}.weight_packed"] = layer.weight_packed.detach().cpu().contiguous()
            out[f"{name}.weight_scale"] = as_fp8_dtype(scale) if layer.format == "nvfp4" else scale.contiguous()
            if layer.format == "nvfp4":
                g = torch.ones(1) if layer.weight_scale_2 is None else layer.weight_scale_2.detach().cpu().reshape(1)
                out[f"{name}.weight_global_scale"] = global_divisor(g)
            schemes[name] = (layer.format, "tensor_group" if layer.format == "nvfp4" else "group", layer.group_size,
                             True)
        if layer.bias is not None:
            out[f"{name}.bias"] = layer.bias.detach().cpu()
    return out, schemes


def scheme_config(key: tuple) -> dict:
    """The config group of a module's key from :func:`model_tensors` (format, strategy, group size, symmetric)."""
    fmt, strategy, group, symmetric = key
    w = {"num_bits": 4, "type": "int" if fmt == "int4" else "float", "strategy": strategy, "group_size": group,
         "symmetric": symmetric, "dynamic": False, "block_structure": None, "actorder": None}
    if fmt == "int4" and not symmetric:
        w["zp_dtype"] = "torch.int8"
    if fmt != "int4":  # as llmcompressor records them
        w["scale_dtype"] = "torch.float8_e4m3fn" if fmt == "nvfp4" else "torch.uint8"
    return {"weights": w, "input_activations": None, "output_activations": None,
            "format": "pack-quantized" if fmt == "int4" else f"{fmt}-pack-quantized"}
