"""Which layers of a diffusion model stay in high precision: the one rule that ``quantize_`` (on a diffusers model)
and the diffusers quantizer (``TorchLowbitConfig`` in diffusers' ``from_pretrained``) both follow.

A diffusion transformer's blocks -- attention projections, MLPs, the adaLN modulation linears inside the blocks --
are quantized. Kept in high precision, as ModelOpt's diffusers recipe and the FP8 files of the FLUX / SD3.5 / Wan
community do: the embedders (timestep / guidance / text-pooled embedders, ``x_embedder``, ``context_embedder``,
patch embeddings, Qwen-Image's ``img_in`` / ``txt_in``, LTX's ``caption_projection``), the UNet's per-resnet timestep
projections (``time_emb_proj``), and the model's final layer (the top-level ``norm_out`` modulation and
``proj_out``). These are a few percent of the weights; they take the noisy latent in, map the timestep to every
block's modulation, and write the predicted noise out, where an error reaches every step of the sampler unfiltered.
Norms hold no nn.Linear and are never swapped anyway.

``proj_out`` / ``proj_in`` / ``norm_out`` are the model's own entry and exit only at the top level:
FLUX's ``single_transformer_blocks.N.proj_out`` (the single block's fused attention + MLP output, one of its
largest layers) and a UNet's ``...attentions.N.proj_in`` are block layers and are quantized.
"""
from __future__ import annotations

from typing import Optional

import torch.nn as nn

# a path component containing one of these names an embedder at any depth
EMBEDDER_MARKERS = ("embed", "time_emb_proj")
# top-level children that are the model's input or output projection
ENTRY_EXIT_LAYERS = ("proj_in", "proj_out", "norm_out", "img_in", "txt_in", "caption_projection")


def diffusion_skip_reason(fqn: str) -> Optional[str]:
    """Why the module named ``fqn`` (its dotted name in the diffusion model: ``"x_embedder"``,
    ``"transformer_blocks.0.attn.to_q"``) stays in high precision, or None if it is quantized."""
    parts = fqn.split(".") if fqn else []
    for part in parts:
        if any(marker in part for marker in EMBEDDER_MARKERS):
            return f"diffusion default: an embedder ({part})"
    if parts and parts[0] in ENTRY_EXIT_LAYERS:
        return f"diffusion default: the model's {'output' if parts[0] in ('proj_out', 'norm_out') else 'input'} " \
               f"layer ({parts[0]})"
    return None


def diffusion_filter(module: nn.Module, fqn: str) -> bool:
    """``quantize_``'s filter for diffusion models (its default on a diffusers model): True for every layer except
    those :func:`diffusion_skip_reason` names."""
    return diffusion_skip_reason(fqn) is None


def is_diffusers_model(model: nn.Module) -> bool:
    """A diffusers model (``ModelMixin``: a transformer, UNet, VAE, ...), told by its class without importing
    diffusers."""
    return any(c.__module__.split(".", 1)[0] == "diffusers" and c.__name__ == "ModelMixin"
               for c in type(model).__mro__)


def pipeline_hint(obj) -> str:
    """For an error about a diffusers pipeline passed where a model is expected: which of its components to pass."""
    components = getattr(obj, "components", None)
    if not isinstance(components, dict):
        return ""
    denoisers = [name for name in ("transformer", "transformer_2", "unet", "prior")
                 if isinstance(components.get(name), nn.Module)]
    if not denoisers:
        return ""
    return (f"; a diffusers pipeline holds several models: quantize its denoiser, e.g. "
            f"quantize_(pipe.{denoisers[0]}, config)")
