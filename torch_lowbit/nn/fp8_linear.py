"""Fp8Linear: W8A16 linear layer, fp8 (e4m3fn) weights with per-tensor / per-channel / block scales; optionally
the FP8 activation quantization of a W8A8 checkpoint (dynamic per-token or static per-tensor)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .. import _ops
from .._autocast import autocast_dtype
from .._storage import FP8, as_fp8_dtype, as_stored_fp8
from ..granularity import GranularityLike, PerBlock, as_granularity, infer_granularity
from ..quantize import Fp8WeightOnly, quantize_fp8, register_quantize_module_handler
from ._quantized_linear import QuantizedLinear, cat_per_row, frozen_bias, same_attributes, same_tensor


class Fp8Linear(QuantizedLinear):
    """``y = x @ (fp8(weight) * weight_scale).T + bias``, computed by ``torch_lowbit.fp8_mm`` (fp32 accumulation,
    output in x's dtype, the weight never dequantized in memory).

    Buffers (checkpoint names): ``weight`` ``[N, K]`` float8_e4m3fn (held as uint8 bits on a device that cannot
    hold fp8: mps before PyTorch 2.15; state_dicts always carry float8_e4m3fn), ``weight_scale`` float32 (``[1]``
    per tensor, ``[N]`` per channel, ``[ceil(N/bn), ceil(K/bk)]`` per block; 0-d and ``[N, 1]`` are accepted),
    ``bias`` ``[N]`` in ``dtype`` (optional), ``input_scale`` (optional: the static activation scale of ModelOpt /
    compressed-tensors checkpoints).

    Activations: ``activation_scheme`` records the activation quantization the weights were written for --
    None (weights only), ``"dynamic"`` (FP8 per token, ``scale = amax(|row|) / 448`` at run time) or ``"static"``
    (FP8 per tensor with ``input_scale``) -- and ``save_quantized`` writes it back. By default the layer computes
    W8A16 (x in its own dtype, closer to the unquantized model); with ``quantize_activations`` True it runs the
    scheme: ``x`` quantized to fp8 and back in float32 (:func:`torch_lowbit._ops.fp8_fake_quantize`), then
    ``fp8_mm`` in float32, output in x's dtype -- what the checkpoint's own stack (compressed-tensors) computes.
    """
    _format_buffers = ("weight", "weight_scale", "input_scale")
    _fp8_buffers = ("weight",)
    _scale_buffers = ("weight_scale", "input_scale")
    ACTIVATION_SCHEMES = {None: "weights only", "dynamic": "fp8 dynamic per-token",
                          "static": "fp8 static per-tensor (input_scale)"}

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 granularity: GranularityLike = "channel", block_size=None, device=None,
                 dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        g = as_granularity(granularity, block_size)
        if block_size is not None and not isinstance(g, PerBlock):
            raise ValueError(f"Fp8Linear: block_size is only used with granularity='block', got block_size="
                             f"{block_size!r} with granularity={granularity!r}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.granularity, self.block_size = g, g.block_size
        N, K = self.out_features, self.in_features
        self.register_buffer("weight", as_stored_fp8(torch.zeros(N, K, dtype=torch.uint8, device=device)))
        self.register_buffer("weight_scale", torch.ones(g.scale_shape(N, K), dtype=torch.float32, device=device))
        self.register_parameter("bias", frozen_bias(torch.zeros(N, dtype=dtype, device=device) if bias else None))
        self.register_buffer("input_scale", None)
        self.activation_scheme: Optional[str] = None
        self.quantize_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        if not self.quantize_activations:
            return _ops.fp8_mm(x, self.weight, self.weight_scale, self.bias, self.block_size)
        static = self.input_scale if self.activation_scheme == "static" else None
        xq = _ops.fp8_fake_quantize(x, static)  # float32: not rounded again to x's dtype (nor by autocast)
        out_dtype = autocast_dtype(x)
        if out_dtype is None:
            return _ops.fp8_mm(xq, self.weight, self.weight_scale, self.bias, self.block_size).to(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            return _ops.fp8_mm(xq, self.weight, self.weight_scale, self.bias, self.block_size).to(out_dtype)

    def set_activation_scheme(self, scheme: Optional[str], run: bool = False) -> "Fp8Linear":
        """Record the activation quantization the weights were written for (None, ``"dynamic"``, ``"static"``; a
        static scheme needs a positive finite one-element ``input_scale``) and whether forward runs it
        (``run=True``) or stays W8A16 (the default). Returns the layer."""
        if scheme not in self.ACTIVATION_SCHEMES:
            raise ValueError(f"Fp8Linear: activation_scheme must be one of {list(self.ACTIVATION_SCHEMES)}, got "
                             f"{scheme!r}")
        if run and scheme is None:
            raise ValueError("Fp8Linear: run=True needs an activation_scheme ('dynamic' or 'static'), got None")
        if scheme == "static":
            s = self.input_scale
            if s is None or s.numel() != 1:
                raise ValueError(f"Fp8Linear: activation_scheme='static' needs a one-element input_scale, got "
                                 f"{None if s is None else tuple(s.shape)}")
            if not s.is_meta and not bool(torch.isfinite(s).all() and (s > 0).all()):
                raise ValueError(f"Fp8Linear: input_scale must be a positive finite number for activation_scheme="
                                 f"'static', got {s.reshape(-1).tolist()}")
        self.activation_scheme, self.quantize_activations = scheme, bool(run)
        return self

    @classmethod
    def _cat_rows(cls, layers, bias, where):
        first = layers[0]
        same_attributes(layers, ("activation_scheme", "quantize_activations", "block_size"), where)
        if first.block_size is not None:  # whole blocks of rows: every layer but the last fills its last block
            bn = first.block_size[0]
            for i, layer in enumerate(layers[:-1]):
                if layer.out_features % bn:
                    raise ValueError(f"{where}: layers[{i}] has {layer.out_features} output features, not a multiple "
                                     f"of its scale blocks' {bn} rows: its last block would take the next layer's rows")
            scale = torch.cat([layer.weight_scale for layer in layers])
        elif all(layer.weight_scale.numel() == 1 and torch.equal(layer.weight_scale.reshape(1),
                                                                 first.weight_scale.reshape(1)) for layer in layers):
            scale = first.weight_scale  # one per-tensor scale stays one
        else:
            scale = cat_per_row(layers, "weight_scale")  # per-tensor scales become their rows'
        weight = torch.cat([layer.weight.view(torch.uint8) for layer in layers])
        return cls.from_quantized(weight, scale, bias, block_size=first.block_size,
                                  input_scale=same_tensor(layers, "input_scale", where),
                                  activation_scheme=first.activation_scheme,
                                  quantize_activations=first.quantize_activations)

    @classmethod
    def from_quantized(cls, weight: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                       block_size=None, input_scale: Optional[torch.Tensor] = None,
                       activation_scheme: Optional[str] = None, quantize_activations: bool = False) -> "Fp8Linear":
        """A layer around existing tensors (e.g. from a checkpoint). ``weight`` ``[N, K]`` float8_e4m3fn or uint8 bits
        is used as is (made contiguous if it is not); scales are widened to float32 and keep their shape; the
        granularity follows from ``weight_scale``'s shape and ``block_size``. ``activation_scheme`` /
        ``quantize_activations``: see :meth:`set_activation_scheme`."""
        if not isinstance(weight, torch.Tensor) or weight.dtype not in (FP8, torch.uint8) or weight.dim() != 2:
            raise ValueError("Fp8Linear.from_quantized: weight must be [N, K] float8_e4m3fn or uint8 (fp8 bits), got "
                             + (f"{weight.dtype} of shape {tuple(weight.shape)}" if isinstance(weight, torch.Tensor)
                                else type(weight).__name__))
        N, K = weight.shape
        for name, t in (("weight_scale", weight_scale), ("bias", bias), ("input_scale", input_scale)):
            if t is None and name != "weight_scale":
                continue
            if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == FP8:
                raise ValueError(f"Fp8Linear.from_quantized: {name} must be a floating tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)}")
            if t.device != weight.device:
                raise ValueError(f"Fp8Linear.from_quantized: {name} is on {t.device} but weight is on {weight.device}")
        if bias is not None and tuple(bias.shape) != (N,):
            raise ValueError(f"Fp8Linear.from_quantized: bias must be [N] = [{N}], got {tuple(bias.shape)}")
        granularity = infer_granularity(weight_scale.shape, N, K, block_size, what="Fp8Linear: weight_scale")
        layer = cls(K, N, bias=bias is not None, granularity=granularity, device="meta",
                    dtype=bias.dtype if bias is not None else torch.bfloat16)
        layer.weight = as_stored_fp8(weight.contiguous())
        layer.weight_scale = weight_scale.to(torch.float32)
        layer.bias = frozen_bias(bias)
        layer.input_scale = None if input_scale is None else input_scale.to(torch.float32)
        return layer.set_activation_scheme(activation_scheme, quantize_activations)

    @classmethod
    def from_float(cls, linear: nn.Linear, granularity: GranularityLike = "channel", block_size=None) -> "Fp8Linear":
        """Quantize an nn.Linear with ``quantize_fp8`` (``block_size`` is used only with ``granularity="block"``,
        default 128 x 128). The bias is kept in its dtype."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"Fp8Linear.from_float: linear must be an nn.Linear, got {type(linear).__name__}")
        g = as_granularity(granularity, block_size)
        w, s = quantize_fp8(linear.weight.detach(), g)
        bias = None if linear.bias is None else linear.bias.detach()
        return cls.from_quantized(w, s, bias, block_size=g.block_size)

    def extra_repr(self) -> str:
        s = (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
             f"granularity={self.granularity.kind}")
        if self.block_size is not None:
            s += f", block_size={self.block_size}"
        if self.activation_scheme is not None:
            scheme = self.ACTIVATION_SCHEMES[self.activation_scheme]
            s += (f", activations={scheme}" if self.quantize_activations
                  else f", activations=x's dtype (checkpoint: {scheme})")
        if self.weight.dtype != FP8:
            s += ", weight held as uint8 bits"
        return s

    # ---- fp8 <-> uint8 bits at the edges
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        self._adopt_optional_buffer("input_scale", state_dict, prefix, self.weight.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _load_weight_entry(self, state_dict, key, error_msgs):
        if key not in state_dict:
            return
        v = state_dict[key]
        if v.dtype not in (FP8, torch.uint8):
            return self._reject_weight(state_dict, key, error_msgs, "float8_e4m3fn (or uint8 fp8 bits)")
        if v.dtype != self.weight.dtype:  # the same bytes, never a value conversion
            state_dict[key] = v.view(self.weight.dtype)


@register_quantize_module_handler(Fp8WeightOnly)
def _quantize_fp8_weight_only(linear: nn.Linear, config: Fp8WeightOnly) -> Fp8Linear:
    return Fp8Linear.from_float(linear, config.granularity)
