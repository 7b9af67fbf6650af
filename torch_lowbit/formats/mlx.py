"""MLX quantized checkpoints (``mlx_lm.convert -q``, the Hub's mlx-community models): config.json's
``quantization`` (and ``quantization_config``, no ``quant_method``) ``{group_size, bits, mode}``, with per-module
overrides keyed by module name (a dict of its own, or false: kept in high precision). A quantized module holds
``weight`` uint32 ``[N, K*bits/32]`` (eight 4-bit codes per word along K, code j in bits ``4*(j%8)``) and
``scales`` ``[N, K/group_size]``; mode ``affine`` (the default) adds ``biases`` of the scales' dtype:
``w = q * scale + bias`` (torch_lowbit's ``uint4``); mode ``mxfp4`` (E2M1, E8M0 scales as uint8, groups of 32)
and ``nvfp4`` (E2M1, E4M3 scales as uint8 bits, groups of 16, no global scale) are the formats of the same names.

MLX also quantizes embeddings (and an untied lm_head, an nn.Linear: that one becomes a W4Linear). An embedding is
not a matmul: its packed weight is dequantized once at load, in fp32 by the same arithmetic (``w4_dequantize``),
into the model's dense embedding -- its memory is the dense size. Other bit widths (2, 3, 5, 6, 8) and modes
(``mxfp8``) are refused by name."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from .registry import CheckpointError, CheckpointFormat, config_field
from .tensors import W4Weight, nibble_bytes

# MLX mode -> (torch_lowbit format, the group size it fixes or None, scale dtypes it stores)
MODES = {"affine": ("uint4", None, (torch.float32, torch.float16, torch.bfloat16)),
         "mxfp4": ("mxfp4", 32, (torch.uint8,)), "nvfp4": ("nvfp4", 16, (torch.uint8,))}
CONFIG_KEYS = ("group_size", "bits")


@dataclass(frozen=True)
class MlxArgs:
    format: str
    group_size: int
    mode: str
    bits: int = 4
    where: str = ""


def _args(cfg: dict, where: str) -> MlxArgs:
    bits = config_field(cfg, "bits", int, where, None)
    group = config_field(cfg, "group_size", int, where, None)
    mode = config_field(cfg, "mode", str, where, "affine")
    if mode not in MODES:
        raise CheckpointError(f"{where}.mode {mode!r} is not supported: torch_lowbit reads MLX's 4-bit modes "
                              f"{list(MODES)}")
    if bits == 8 and mode == "affine":
        # mlx_lm keeps MoE routers at 8 bits: dequantized once at load like embeddings (dense_tensor); a Linear
        # of 8 bits is refused where it is read
        bits = 8
    elif bits != 4:
        raise CheckpointError(f"{where}.bits is {bits!r}: torch_lowbit reads 4-bit MLX weights only (not 2, 3, 5, 6 "
                              f"or 8-bit)")
    fmt, fixed, _ = MODES[mode]
    if group is None or group < 1 or (fixed is not None and group != fixed):
        want = f"{fixed}" if fixed is not None else "a positive int"
        raise CheckpointError(f"{where}.group_size must be {want} for mode {mode!r}, got {group!r}")
    return MlxArgs(fmt, group, mode, bits, where)


class Mlx(CheckpointFormat):
    name = "mlx"
    quant_methods = ("mlx",)
    scale_key = "scales"

    def claims_config(self, qc):
        return "quant_method" not in qc and all(k in qc for k in CONFIG_KEYS)

    def parse(self, qc, side, where):
        at = where.qc
        default = _args(qc, at)
        overrides = []
        for name, v in qc.items():
            if name in ("group_size", "bits", "mode", "quant_method"):
                continue
            if v is False:
                overrides.append(((name,), None))
            elif isinstance(v, dict):
                # mlx_lm writes null for what the module takes from the defaults
                given = {k: x for k, x in v.items() if x is not None}
                overrides.append(((name,), _args({**{k: qc[k] for k in CONFIG_KEYS}, "mode": default.mode, **given},
                                                 f"{at}.{name}")))
            elif v is not True:
                raise CheckpointError(f"{at}.{name} must be a per-module quantization dict or a bool, got "
                                      f"{type(v).__name__} {v!r}")
        return self.make(weights=tuple(overrides) + ((("Linear",), default),),
                         ignore=[n for (n,), a in overrides if a is None],
                         details={"group_size": default.group_size, "bits": 4, "mode": default.mode,
                                  "overrides": len(overrides)})

    def _read(self, src, fmt, prefix, shape, bits=4):
        """Module `prefix`'s weight: a W4Weight, for `shape` [N, K] or MLX's stacked experts [E, N, K] (the
        tensors then [E, N, ...]); with bits=8 (affine only) (codes uint8 [..., N, K], scales, biases)."""
        wkey, skey, bkey = f"{prefix}.weight", f"{prefix}.scales", f"{prefix}.biases"
        args = fmt.weight_args(prefix)
        if args is None:
            raise CheckpointError(f"{wkey} is packed ({src.dtype(wkey)}) but the config keeps {prefix} unquantized")
        if args.bits != bits:
            raise CheckpointError(f"{args.where}.bits is {args.bits}: torch_lowbit reads 4-bit MLX weights only (not "
                                  f"2, 3, 5, 6 or 8-bit) in linear layers and experts; 8-bit routers and embeddings "
                                  f"are dequantized at load")
        if src.dtype(wkey) != torch.uint32:
            raise CheckpointError(f"{wkey} must be uint32 ({32 // bits} {bits}-bit codes per word), got "
                                  f"{src.dtype(wkey)}")
        *lead, N, K = shape
        lead = tuple(lead)
        per_word = 32 // bits
        words = src.get(wkey)
        if tuple(words.shape[:-1]) != lead + (N,) or words.dim() != len(shape):
            want = list(lead) + [N, -(-K // per_word)]
            raise CheckpointError(f"{wkey} has shape {list(words.shape)}, expected {want} for a {bits}-bit "
                                  f"{list(shape)} weight")
        flat = words.reshape(-1, words.shape[-1])
        if bits == 4:
            packed = nibble_bytes(flat, K, wkey).reshape(lead + (N, (K + 1) // 2))
        else:
            if words.shape[-1] * 4 != K:
                raise CheckpointError(f"{wkey} has {words.shape[-1]} words per row, expected {K} / 4")
            packed = flat.contiguous().view(torch.uint8).reshape(lead + (N, K))
            if sys.byteorder == "big":
                packed = packed.view(*lead, N, K // 4, 4).flip(-1).reshape(lead + (N, K))
        G = -(-K // args.group_size)
        scale = src.get(skey)
        _, _, scale_dtypes = MODES[args.mode]
        if scale.dtype not in scale_dtypes or tuple(scale.shape) != lead + (N, G):
            raise CheckpointError(f"{skey} must be {' / '.join(str(d) for d in scale_dtypes)} of shape "
                                  f"{list(lead) + [N, G]} (mode {args.mode!r}, groups of {args.group_size} along K = "
                                  f"{K}), got {scale.dtype} of shape {list(scale.shape)}")
        if f"{prefix}.global_scale" in src:
            raise CheckpointError(f"{prefix}.global_scale: MLX weights with a global scale are not supported")
        keys, offset = [wkey, skey], None
        if args.mode == "affine":
            if bkey not in src:
                raise CheckpointError(f"{bkey} is missing: MLX affine weights are q * scale + bias")
            offset = src.get(bkey)
            if offset.dtype != scale.dtype or offset.shape != scale.shape:
                raise CheckpointError(f"{bkey} must be {scale.dtype} of shape {list(scale.shape)} like {skey}, got "
                                      f"{offset.dtype} of shape {list(offset.shape)}")
            keys.append(bkey)
        if bits == 8:
            return packed, scale, offset, keys
        return W4Weight(args.format, args.group_size, K, packed, scale.contiguous(), offset, None, keys)

    def w4_present(self, src, fmt, prefix):
        return f"{prefix}.{self.scale_key}" in src and f"{prefix}.weight" in src

    def w4_weight(self, src, fmt, prefix, shape):
        if not self.w4_present(src, fmt, prefix):
            return None
        return self._read(src, fmt, prefix, shape)

    def stacked_experts(self, name):
        # mlx_lm's SwitchGLU: {block}.switch_mlp.{gate,up,down}_proj beside the router, for transformers'
        # {block}.experts
        parent, _, leaf = name.rpartition(".")
        return (f"{parent}.switch_mlp",) if leaf == "experts" else ()

    def dense_tensor(self, src, fmt, key, shape):
        if not key.endswith(".weight") or f"{key[:-7]}.{self.scale_key}" not in src or len(shape) != 2:
            return None
        from .. import _ops

        prefix = key[:-7]
        args = fmt.weight_args(prefix)
        if args is not None and args.bits == 8:  # q * scale + bias per group, in fp32 as mlx computes it
            codes, scale, bias, keys = self._read(src, fmt, prefix, shape, bits=8)
            g = args.group_size
            full = (lambda t: t.float().repeat_interleave(g, dim=-1)[:, :shape[1]])
            return codes.float() * full(scale) + full(bias), keys
        w = self._read(src, fmt, prefix, shape)
        dense = _ops.w4_dequantize(w.packed, w.scale, w.format, w.group_size, w.in_features, w.offset, None,
                                   torch.float32)
        return dense, w.keys


FORMAT = Mlx()
