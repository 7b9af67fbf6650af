"""compressed-tensors (llmcompressor): ``weight`` + ``weight_scale`` in the model's dtype (often bf16): per tensor
``[1]``, per channel ``[N, 1]``, per block ``[ceil(N/bh), ceil(K/bw)]`` with the weight padded to whole blocks and
its true shape in ``weight_shape_original``. ``format`` float-quantized (FP8), int-quantized (INT8 W8A8, per-token
dynamic activations) or naive-quantized; ``ignore`` holds names and ``re:`` regexes. The 4-bit formats
(pack-quantized, nvfp4-pack-quantized, mxfp4-pack-quantized) are read and written by ``ct_w4.py``."""
from __future__ import annotations

import re

import torch

from ..granularity import PerBlock, PerChannel, PerTensor
from . import ct_w4
from .registry import (CheckpointError, CheckpointFormat, Example, activation_scheme_name, block_field, config_field,
                       name_list)

SUPPORTED_FORMATS = ("float-quantized", "int-quantized", "naive-quantized", "dense") + tuple(ct_w4.W4_FORMATS)
MIXED = "mixed-precision"
STRATEGIES = ("tensor", "channel", "block")
EXAMPLE_BLOCK = PerBlock(16, 32)  # partial blocks on the tests' dims (48, 80, 97: multiples of neither)


class CompressedTensors(CheckpointFormat):
    name = "compressed-tensors"
    quant_methods = ("compressed-tensors", "compressed_tensors")
    original_shape_key = "weight_shape_original"
    weight_kinds = ("fp8", "int8")

    def parse(self, qc, side, where):
        at = where.qc
        fmt = config_field(qc, "format", str, at, "dense")
        groups = config_field(qc, "config_groups", dict, at, {})
        # "mixed-precision": each group names its own format (a W8A8 group beside a weight-only one, as
        # save_quantized writes FP8 layers with activations next to weight-only experts)
        formats = set() if fmt == MIXED else {fmt}
        for gname, g in groups.items():
            config_field(groups, gname, dict, f"{at}.config_groups", {})
            gfmt = config_field(g or {}, "format", str, f"{at}.config_groups.{gname}", None if fmt == MIXED else fmt)
            if gfmt is None:
                raise CheckpointError(f"{at}.config_groups.{gname}.format is missing: a 'mixed-precision' checkpoint "
                                      f"names each group's format")
            formats.add(gfmt)
        bad = formats - set(SUPPORTED_FORMATS)
        if bad:
            raise CheckpointError(f"{at}: compressed-tensors format {sorted(bad)[0]!r} is not supported: torch_lowbit "
                                  f"loads 'float-quantized' (FP8), 'int-quantized' (INT8), 'naive-quantized' and the "
                                  f"4-bit {', '.join(repr(f) for f in ct_w4.W4_FORMATS)}")
        block, kinds, activations, w4 = None, [], [], []
        for gname, g in groups.items():
            gwhere = f"{at}.config_groups.{gname}"
            w = config_field(g or {}, "weights", dict, gwhere, {})
            if not w:
                continue
            wwhere = f"{gwhere}.weights"
            gfmt = (g or {}).get("format") or fmt
            if gfmt in ct_w4.W4_FORMATS:
                args = ct_w4.parse_args(gfmt, w, wwhere)
                if (g or {}).get("input_activations"):
                    raise CheckpointError(f"{gwhere}.input_activations: 4-bit weights with quantized activations "
                                          f"are not supported (W4A16 only)")
                w4.append((tuple(name_list(g, "targets", gwhere)) or ("Linear",), args))
                kinds.append({"group": gname, "format": gfmt, "w4": args.format, "strategy": args.strategy,
                              "group_size": args.group_size, "symmetric": args.symmetric})
                continue
            bits, typ = config_field(w, "num_bits", int, wwhere, 8), config_field(w, "type", str, wwhere, "float")
            if bits != 8 or typ not in ("float", "int"):
                raise CheckpointError(f"{wwhere}: {bits}-bit {typ} weights are not supported (8-bit float or int only)")
            strategy = config_field(w, "strategy", str, wwhere, "tensor")
            if strategy not in STRATEGIES:
                raise CheckpointError(f"{wwhere}.strategy {strategy!r} is not supported {STRATEGIES}")
            if config_field(w, "symmetric", bool, wwhere, True) is False:
                raise CheckpointError(f"{wwhere}: asymmetric weights (zero points) are not supported")
            if strategy == "block":
                b = block_field(w, "block_structure", wwhere)
                if b is None:
                    raise CheckpointError(f"{wwhere}.block_structure is missing for strategy 'block'")
                if block is not None and b != block:
                    raise CheckpointError(f"{wwhere}.block_structure {list(b)} differs from another group's "
                                          f"{list(block)}")
                block = b
            acts = config_field(g or {}, "input_activations", dict, gwhere, {})
            kinds.append({"group": gname, "type": typ, "strategy": strategy, "activations": acts.get("strategy")})
            activations.append((tuple(name_list(g, "targets", gwhere)) or ("Linear",),
                                _input_scheme(acts, f"{gwhere}.input_activations")))
        return self.make(block_size=block, ignore=name_list(qc, "ignore", at), activations=tuple(activations),
                         weights=tuple(w4),
                         extra_keys=("input_scale", "input_zero_point", "weight_zero_point", self.original_shape_key,
                                     "weight_g_idx"),
                         details={"format": fmt, "groups": kinds})

    def w4_present(self, src, fmt, prefix):
        return f"{prefix}.weight_packed" in src

    def w4_weight(self, src, fmt, prefix, shape):
        pkey = f"{prefix}.weight_packed"
        if pkey not in src:
            return None
        args = fmt.weight_args(prefix)
        if args is None:
            raise CheckpointError(f"{pkey} is a packed 4-bit weight, but no 4-bit config group of the checkpoint's "
                                  f"quantization_config targets {prefix}")
        return ct_w4.read(src, args, prefix, shape)

    def examples(self):
        bf16 = torch.bfloat16
        return {"ct-fp8-tensor": Example(PerTensor(), "1", bf16),
                "ct-fp8-channel": Example(PerChannel(), "N1", bf16),
                "ct-fp8-block": Example(EXAMPLE_BLOCK, "blocks", bf16),
                "ct-int8": Example(PerChannel(), "N1", bf16, kind="int8"),
                "ct-naive": Example(PerChannel(), "N1", torch.float32, options=(("format", "naive-quantized"),))}

    def example_config(self, example, keep):
        typ = "int" if example.kind == "int8" else "float"
        g = example.granularity
        weights = {"num_bits": 8, "type": typ, "strategy": g.kind, "symmetric": True, "dynamic": False,
                   "block_structure": list(g.block_size) if g.block_size else None}
        acts = {"num_bits": 8, "type": typ, "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": example.option("format", f"{typ}-quantized"),
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
                "ignore": [f"re:.*{re.escape(k)}$" for k in keep], "quantization_status": "compressed"}, None

    def example_tensors(self, prefix, codes, scale, example):
        out = super().example_tensors(prefix, codes, scale, example)
        bs = example.granularity.block_size if example.granularity is not None else None
        if bs is not None:  # compressed-tensors pads block-quantized weights to whole blocks
            N, K = codes.shape
            Np, Kp = -(-N // bs[0]) * bs[0], -(-K // bs[1]) * bs[1]
            if (Np, Kp) != (N, K):
                padded = torch.zeros(Np, Kp, dtype=torch.uint8)
                padded[:N, :K] = codes.view(torch.uint8)
                out[f"{prefix}.weight"] = padded.view(codes.dtype)
                out[f"{prefix}.{self.original_shape_key}"] = torch.tensor([N, K])
        return out


def _input_scheme(acts: dict, where: str):
    """A group's ``input_activations`` as a QuantFormat.activations scheme (None: weights only)."""
    if not acts:
        return None
    dynamic = acts.get("dynamic", False)
    return activation_scheme_name(config_field(acts, "type", str, where, "float"),
                                  config_field(acts, "num_bits", int, where, 8),
                                  config_field(acts, "strategy", str, where, "tensor"), dynamic,
                                  config_field(acts, "symmetric", bool, where, True))


FORMAT = CompressedTensors()
