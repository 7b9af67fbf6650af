"""gpt-oss's MXFP4 checkpoints (openai/gpt-oss-20b, -120b; transformers' ``quant_method: mxfp4``).

config.json's ``quantization_config`` is ``{quant_method: mxfp4, modules_to_not_convert: [...]}``; the experts of
each ``model.layers.{i}.mlp.experts`` module are stored as
``gate_up_proj_blocks`` uint8 ``[E, 2I, H/32, 16]``, ``gate_up_proj_scales`` uint8 E8M0 ``[E, 2I, H/32]``,
``gate_up_proj_bias`` ``[E, 2I]``, and ``down_proj_blocks`` ``[E, H, I/32, 16]``, ``down_proj_scales``
``[E, H, I/32]``, ``down_proj_bias`` ``[E, H]`` (gate and up rows interleaved; each 16-byte block holds 32 E2M1
codes along the input dimension, the even one in the low nibble; value = ``e2m1 * 2^(scale - 127)``). Everything
else (attention, router, embeddings, norms, sinks) is stored in bf16 and loads as it is.

The experts become :class:`~torch_lowbit.nn.gptoss_experts.GptOssW4Experts` holding the blocks and scales as
stored (the blocks' last two dims merged: a view, never a dense copy).
"""
from __future__ import annotations

import torch

from .registry import CheckpointFormat, name_list
from .source import CheckpointError

_TENSORS = ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
            "down_proj_blocks", "down_proj_scales", "down_proj_bias")


class GptOssMxfp4(CheckpointFormat):
    name = "gpt-oss-mxfp4"
    quant_methods = ("mxfp4",)
    scale_key = "scales"
    weight_kinds = ()  # no quantized nn.Linear: only the experts are MXFP4

    def parse(self, qc, side, where):
        at = where.qc
        return self.make(ignore=name_list(qc, "modules_to_not_convert", at), details={"quant_method": "mxfp4"})

    def experts(self, src, fmt, name, module, device, dtype):
        """The experts module `name` as a GptOssW4Experts if the checkpoint holds its MXFP4 blocks, else None."""
        from ..nn.gptoss_experts import GptOssW4Experts

        keys = [f"{name}.{t}" for t in _TENSORS]
        present = [k for k in keys if k in src]
        if not present:
            return None
        missing = [k for k in keys if k not in src]
        if missing:
            raise CheckpointError(f"{missing[0]} is missing: gpt-oss's MXFP4 experts {name} need "
                                  f"{', '.join(_TENSORS)}")
        if fmt.is_ignored(name):
            raise CheckpointError(f"{name} holds MXFP4 blocks but is in the checkpoint's modules_to_not_convert")
        E, H, I = (int(getattr(module, a)) for a in ("num_experts", "hidden_size", "intermediate_size"))
        want = {"gate_up_proj_blocks": (E, 2 * I, H // 32, 16), "down_proj_blocks": (E, H, I // 32, 16)}
        for t, shape in want.items():
            got = tuple(src.shape(f"{name}.{t}"))
            if got != shape or H % 32 or I % 32:
                raise CheckpointError(f"{name}.{t} has shape {list(got)}, expected {list(shape)} for the model's "
                                      f"{E} experts of hidden size {H}, intermediate size {I} (both multiples of 32)")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        t = {k: src.get(f"{name}.{k}") for k in _TENSORS}
        own = getattr(module, "gate_up_proj_bias", None)  # default: the model's own dtype for the biases
        bias_dtype = dtype or (own.dtype if isinstance(own, torch.Tensor) and own.is_floating_point()
                               else torch.bfloat16)
        try:
            layer = GptOssW4Experts.from_mxfp4(
                t["gate_up_proj_blocks"].to(dev), t["gate_up_proj_scales"].to(dev),
                t["gate_up_proj_bias"].to(dev, bias_dtype), t["down_proj_blocks"].to(dev),
                t["down_proj_scales"].to(dev), t["down_proj_bias"].to(dev, bias_dtype),
                alpha=float(getattr(module, "alpha", 1.702)), limit=float(getattr(module, "limit", 7.0)),
                dtype=bias_dtype, what=name)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        return layer, keys, f"GptOssW4Experts(E={E}, mxfp4, group 32, biases)", True


FORMAT = GptOssMxfp4()

# What gpt-oss's published checkpoints keep out of the MXFP4 conversion (their config.json)
MODULES_TO_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def checkpoint_tensors(layers: dict, caller: str) -> dict:
    """The tensors a save writes for {module name: GptOssW4Experts}: the layout above, the blocks being the
    layer's codes with the last dim split (a view), the scales and biases as held (biases of a layer without
    them: zeros, the same arithmetic)."""
    out = {}
    for name, m in layers.items():
        if m.format != "mxfp4" or m.group_size != 32:
            raise ValueError(f"{caller}: {name} is a GptOssW4Experts of format {m.format!r}, group {m.group_size}; "
                             f"gpt-oss's checkpoint layout holds MXFP4 in groups of 32 only")
        for p, proj in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            packed, scale, bias = (getattr(m, f"{p}_{t}") for t in ("packed", "scale", "bias"))
            E, rows, nbytes = packed.shape
            if nbytes % 16:
                raise ValueError(f"{caller}: {name}.{proj} has {2 * nbytes} codes per row, not whole blocks of 32 "
                                 f"(gpt-oss's layout stores [E, rows, cols/32, 16] blocks)")
            out[f"{name}.{proj}_blocks"] = packed.reshape(E, rows, nbytes // 16, 16)
            out[f"{name}.{proj}_scales"] = scale.view(torch.uint8)
            out[f"{name}.{proj}_bias"] = bias if bias is not None else torch.zeros(E, rows, dtype=torch.bfloat16)
    return out


def quantization_config(dense_experts) -> dict:
    """config.json's quantization_config for such a checkpoint; experts modules kept dense are not converted."""
    return {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_TO_NOT_CONVERT + sorted(dense_experts)}
