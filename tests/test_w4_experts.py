"""W4Experts: vs a float64 loop over tokens on the experts' dequantized weights (every 4-bit format, zero points and
biases, nvfp4's per-expert global scales, odd K and partial groups, skipped slots, idle experts, T = 1, leading
dims), bad input named, torch.compile(fullgraph=True), from_float (stacked = per expert, round trip within half a
step), quantize_ on tiny transformers Qwen3-MoE / Mixtral (logits vs float64 on the dequantized weights), and
dequantize_model back to the model's dense experts module. What stays dense under the 4-bit configs, and why
(gpt-oss, GELU, interleaved, biased experts): tests/test_quantize.py."""
import pytest
import torch

import torch_lowbit
from reference import w4_weight_f64
from test_experts import _check, _routing, ref_experts
from torch_lowbit.nn import W4Experts
from torch_lowbit.quantize_w4 import quantize_w4

PROJ = ("gate_up", "down")
# variant -> (format, group_size, offset?, global scale?)
VARIANTS = {"nvfp4": ("nvfp4", 16, False, True), "nvfp4-no-global": ("nvfp4", 16, False, False),
            "mxfp4": ("mxfp4", 32, False, False), "int4": ("int4", 16, False, False),
            "int4-zp": ("int4", 16, True, False), "uint4": ("uint4", 8, True, False)}


def _random_w4(fmt, E, N, K, gs, offset, global_scale, g):
    """{packed, scale, offset, scale_2} of random stacked 4-bit experts whose weights are O(1 / sqrt(K))."""
    G = -(-K // gs)
    t = {"packed": torch.randint(0, 256, (E, N, (K + 1) // 2), dtype=torch.uint8, generator=g)}
    if fmt == "nvfp4":  # e4m3 bits 0x28..0x37: 2^-2 .. 2^-1 (times a global scale 1/8 .. 1/4 when there is one)
        t["scale"] = torch.randint(0x28, 0x38, (E, N, G), dtype=torch.uint8, generator=g)
        if not global_scale:
            t["scale"] = t["scale"] - 0x10  # 2^-4 .. 2^-3
    elif fmt == "mxfp4":  # e8m0 2^-5 .. 2^-3
        t["scale"] = torch.randint(122, 125, (E, N, G), dtype=torch.uint8, generator=g)
    else:
        t["scale"] = (torch.rand(E, N, G, generator=g) * 0.03 + 0.01).to(torch.bfloat16)
    if offset:
        t["offset"] = (torch.randint(-3, 4, (E, N, G), dtype=torch.int8, generator=g) if fmt == "int4" else
                       (torch.rand(E, N, G, generator=g) * 0.2 - 0.1 - 7.5 * t["scale"].float()).to(torch.bfloat16))
    if global_scale:
        t["scale_2"] = torch.rand(E, generator=g) * 0.125 + 0.125  # a different one per expert
    return t


def _layer(variant, E=6, H=41, I=24, seed=0, dtype=torch.float32):
    """(layer, gate_up f64 [E, 2I, H], down f64 [E, H, I]); H odd (a half-used last byte), groups partial."""
    fmt, gs, offset, glob = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    gu = _random_w4(fmt, E, 2 * I, H, gs, offset, glob, g)
    dn = _random_w4(fmt, E, H, I, gs, offset, glob, g)
    layer = W4Experts.from_quantized(gu, dn, format=fmt, group_size=gs, hidden_size=H, intermediate_size=I,
                                     dtype=dtype)
    return layer, _dequant_f64(layer)


def _dequant_f64(layer):
    """The layer's stacked weights in float64 by tests/reference.py's definitions of the formats."""
    out = []
    for p, K in zip(PROJ, (layer.hidden_size, layer.intermediate_size)):
        t = {s: getattr(layer, f"{p}_{s}") for s in ("packed", "scale", "offset", "scale_2")}
        out.append(torch.stack([w4_weight_f64(layer.format, t["packed"][e], t["scale"][e], layer.group_size, K,
                                              None if t["offset"] is None else t["offset"][e],
                                              None if t["scale_2"] is None else t["scale_2"][e])
                                for e in range(layer.num_experts)]))
    return out


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("T,k", [(1, 1), (1, 6), (40, 3)])  # (1, 6): one token, every expert
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_token_loop(variant, T, k, dtype):
    layer, (gu, down) = _layer(variant, seed=T * 10 + k)
    ids, w = _routing(T, k, 6, seed=T)
    x = torch.randn(T, 41).to(dtype)
    _check(layer(x, ids, w), ref_experts(x, ids, w, gu, down), dtype)


def test_per_expert_global_scales_are_each_experts_own():
    layer, (gu, down) = _layer("nvfp4", E=4)
    assert layer.gate_up_scale_2.unique().numel() == 4
    x = torch.randn(8, 41)
    ids, w = torch.full((8, 1), 2), torch.ones(8, 1)
    out = layer(x, ids, w)
    _check(out, ref_experts(x, ids, w, gu, down), torch.float32)
    layer.gate_up_scale_2[2] *= 2  # the gate and up products of expert 2 double: silu(2g) * 2u, not 4x nor 1x
    assert not torch.allclose(out, layer(x, ids, w), rtol=0.1)
    layer.gate_up_scale_2[2] /= 2
    layer.down_scale_2[[0, 1, 3]] = 0.0  # other experts' global scales are never read for expert 2's rows
    assert torch.equal(layer(x, ids, w), out)


def test_skipped_slots_tokens_routed_nowhere_and_idle_experts():
    layer, (gu, down) = _layer("int4-zp", E=8)
    ids, w = _routing(12, 2, 8, seed=3, skip_frac=0.4, only=[1, 5, 6])  # experts 0, 2, 3, 4, 7 get nothing
    ids[4] = -1  # token 4 routes nowhere
    ids[7, 0], w[7, 0] = -1, float("nan")  # a skipped slot's weight is never read
    x = torch.randn(12, 41)
    out = layer(x, ids, w)
    assert torch.equal(out[4], torch.zeros(41))
    _check(out, ref_experts(x, ids, torch.nan_to_num(w), gu, down), torch.float32)


def test_empty_batch_and_leading_dims():
    layer, (gu, down) = _layer("uint4", E=4)
    assert layer(torch.randn(0, 41), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)).shape == (0, 41)
    x = torch.randn(2, 3, 41, dtype=torch.bfloat16)
    ids, w = _routing(6, 2, 4, seed=1)
    out = layer(x, ids.int().reshape(2, 3, 2), w.reshape(2, 3, 2))  # int32 ids, [B, S, k] routing
    assert out.shape == (2, 3, 41) and out.dtype == torch.bfloat16
    _check(out.reshape(6, 41), ref_experts(x.reshape(6, 41), ids, w, gu, down), torch.bfloat16)


@pytest.mark.parametrize("variant", ["nvfp4"])
def test_torch_compile_fullgraph_equals_eager(variant):
    # fullgraph=True fails on any graph break: a host synchronization (.item(), .tolist()) or data-dependent branch
    torch._dynamo.reset()
    layer, _ = _layer(variant, E=5)
    compiled = torch.compile(layer, fullgraph=True)
    for T, seed in ((7, 1), (13, 2)):
        ids, w = _routing(T, 2, 5, seed, skip_frac=0.2)
        x = torch.randn(T, 41, dtype=torch.bfloat16)
        assert torch.equal(compiled(x, ids, w), layer(x, ids, w))


# ------------------------------------------------------------------------------------------------- state_dict
def _empty(variant, group_size=None, **kw):
    """An unloaded layer of `variant`'s options (kw overrides them), shaped as _layer's."""
    fmt, gs, offset, glob = VARIANTS[variant]
    options = {"offset": offset, "global_scale": glob, **kw}
    return W4Experts(6, 41, 24, format=fmt, group_size=group_size or gs, dtype=torch.float32, **options)


def _assert_runs(layer, gu, down):
    ids, w = _routing(9, 2, 6, seed=4)
    x = torch.randn(9, 41, generator=torch.Generator().manual_seed(5))
    _check(layer(x, ids, w), ref_experts(x, ids, w, gu, down), torch.float32)


def test_state_dict_loads_by_its_formats_meaning():
    """nvfp4 scales load as bits whichever 8-bit dtype holds them; another format's scales or offsets are errors
    naming the key, strict or not (a value copy turned E4M3 codes into bf16 numbers, int8 zero points into biases)."""
    src, (gu, down) = _layer("nvfp4")
    sd = src.state_dict()
    for as_bits in (False, True):
        layer = _empty("nvfp4")
        layer.load_state_dict({k: v.view(torch.uint8) if as_bits and k.endswith("_scale") else v
                               for k, v in sd.items()})
        _assert_runs(layer, gu, down)
    for source, target, key in (("nvfp4", "int4", "gate_up_scale"), ("nvfp4", "mxfp4", "down_scale"),
                                ("int4", "nvfp4", "gate_up_scale"), ("int4-zp", "uint4", "down_offset"),
                                ("uint4", "int4-zp", "gate_up_offset"), ("nvfp4", "int4", "down_scale_2")):
        layer, other = _empty(target, group_size=VARIANTS[source][1]), _layer(source)[0].state_dict()
        if source == "nvfp4":  # _layer's nvfp4 holds uint8 bits; a checkpoint's scales are float8_e4m3fn
            other = {k: v.view(torch.float8_e4m3fn) if k.endswith("_scale") else v for k, v in other.items()}
        for strict in (True, False):
            with pytest.raises(RuntimeError, match=rf"{key}: format '{layer.format}' (stores|takes no)"):
                layer.load_state_dict(other, strict=strict)


@pytest.mark.parametrize("variant", ["int4-zp", "uint4", "nvfp4"])
@pytest.mark.parametrize("strict", [True, False])
def test_state_dict_zero_points_and_global_scales_a_layer_lacks_are_taken(variant, strict):
    """A layer built without offsets / global scales adopts a state_dict's (strict=False dropped them silently)."""
    src, (gu, down) = _layer(variant)
    layer = _empty(variant, offset=False, global_scale=False)
    keys = layer.load_state_dict(src.state_dict(), strict=strict)
    assert not keys.missing_keys and not keys.unexpected_keys
    for p in PROJ:
        for s in ("offset", "scale_2"):
            assert (getattr(layer, f"{p}_{s}") is None) == (getattr(src, f"{p}_{s}") is None)
    _assert_runs(layer, gu, down)


# ------------------------------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    layer, _ = _layer("int4", E=4)
    with pytest.raises(RuntimeError, match="W4Experts: topk_ids must be < num_experts"):
        layer(torch.randn(2, 41), torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2))
    with pytest.raises(ValueError, match=r"W4Experts: hidden must be \[\.\.\., hidden_size\] = \[\.\.\., 41\]"):
        layer(torch.randn(2, 40), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))
    with pytest.raises(ValueError, match="W4Experts: topk_ids must be an integer tensor"):
        layer(torch.randn(2, 41), torch.zeros(2, 1), torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"W4Experts: topk_weights must have topk_ids' shape \(2, 1\)"):
        layer(torch.randn(2, 41), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 2))
    gu = {"packed": torch.zeros(2, 8, 8, dtype=torch.uint8), "scale": torch.ones(2, 8, 3)}
    dn = {"packed": torch.zeros(2, 16, 2, dtype=torch.uint8), "scale": torch.ones(2, 16, 1)}
    with pytest.raises(RuntimeError, match=r"w4_grouped_mm: scale must be \[E, N, ceil\(K/group_size\)\] = "
                                           r"\[2, 8, 2\] for K = 16, group_size = 8, got \[2, 8, 3\]"):
        W4Experts.from_quantized(gu, dn, format="int4", group_size=8, hidden_size=16, intermediate_size=4)
    with pytest.raises(ValueError, match="gate_up and down must both have, or both lack, offset, scale_2 and bias"):
        W4Experts.from_quantized({**gu, "scale": torch.ones(2, 8, 2), "offset": torch.zeros(2, 8, 2, dtype=torch.int8)},
                                 dn, format="int4", group_size=8, hidden_size=16, intermediate_size=4)
    with pytest.raises(ValueError, match=r"W4Experts.from_float: gate_up must be \[E, 2I, H\] and down \[E, H, I\]; "
                                         r"got gate_up \[2, 8, 16\] and down \[2, 16, 5\]"):
        W4Experts.from_float(torch.randn(2, 8, 16), torch.randn(2, 16, 5))
    with pytest.raises(ValueError, match="W4Experts.from_float: down must be a floating-point 3-D tensor, got "
                                         "torch.float32 of shape \\(16, 4\\)"):
        W4Experts.from_float(torch.randn(2, 8, 16), torch.randn(16, 4))
    with pytest.raises(ValueError, match="W4Experts.from_float: format must be one of .* got 'nf4'"):
        W4Experts.from_float(torch.randn(2, 8, 16), torch.randn(2, 16, 4), "nf4")
    with pytest.raises(ValueError, match="quantize_w4: symmetric=False .* is for format 'int4'"):
        W4Experts.from_float(torch.randn(2, 8, 16), torch.randn(2, 16, 4), "mxfp4", symmetric=False)
    with pytest.raises(ValueError, match="quantize_w4: w contains NaN or inf"):
        W4Experts.from_float(torch.full((2, 8, 16), float("inf")), torch.randn(2, 16, 4))


# ------------------------------------------------------------------------------------------------- from_float
def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("fmt,gs,kw", [("int4", 16, {}), ("int4", 32, {"symmetric": False}), ("nvfp4", None, {}),
                                       ("mxfp4", None, {}), ("uint4", 16, {}), ("uint4", 64, {"rule": "minmax"}),
                                       ("int4", None, {"scale_dtype": torch.float16})])
def test_from_float_is_quantize_w4_of_each_expert_and_rounds_within_half_a_step(fmt, gs, kw, monkeypatch):
    from test_w4_quantize import _step_bound
    from torch_lowbit.nn import w4_experts
    monkeypatch.setattr(w4_experts, "_QUANTIZE_SLICE_ELEMENTS", 2 * 40 * 37)  # slices of 2 experts, then 1
    g = torch.Generator().manual_seed(len(fmt) + (gs or 0))
    gate_up, down = torch.randn(3, 2 * 20, 37, generator=g), torch.randn(3, 37, 20, generator=g) * 3
    gate_up[1, 4] = 0  # a zero row: zero scales, zero outputs
    layer = W4Experts.from_float(gate_up, down, fmt, gs, **kw)
    assert layer.format == fmt and layer.dtype == torch.float32
    for p, w in zip(PROJ, (gate_up, down)):
        K = w.shape[2]
        for e in range(3):
            q = quantize_w4(w[e], fmt, layer.group_size, **kw)  # the 2-D path, checked against the writers
            got = [getattr(layer, f"{p}_{s}") for s in ("packed", "scale", "offset", "scale_2")]
            assert torch.equal(got[0][e], q.weight_packed) and torch.equal(_bits(got[1][e]), _bits(q.weight_scale))
            assert (got[2] is None) == (q.weight_offset is None) and (got[3] is None) == (q.weight_scale_2 is None)
            if q.weight_offset is not None:
                assert torch.equal(got[2][e], q.weight_offset)
            if q.weight_scale_2 is not None:  # one tensor scale per expert: from that expert's amax
                assert torch.equal(got[3][e:e + 1], q.weight_scale_2)
            w_deq, bound = _step_bound(fmt, q, K, min(layer.group_size, K))
            # nvfp4: e4m3-rounded scales may put the group max up to an ulp past 6 * s; an fp16 scale below
            # amax / 7.5 by its rounding moves the top code by up to 7.5 * 2^-11 of a step
            slack = 1 + {"nvfp4": 2 ** -3, torch.float16: 2 ** -6}.get(kw.get("scale_dtype", fmt), 1e-6)
            if fmt == "mxfp4":  # saturation past 6 * s: up to 2 * s (test_w4_quantize)
                bound = bound * 2
            assert ((w_deq - w[e].double()).abs() <= bound * slack + 1e-12).all(), (p, e)
    assert torch.equal(_dequant_f64(layer)[0][1, 4], torch.zeros(37, dtype=torch.float64))


def test_from_float_group_size_past_one_projections_k_is_per_channel_there():
    layer = W4Experts.from_float(torch.randn(2, 2 * 24, 40), torch.randn(2, 40, 24), "int4", 32)
    assert layer.gate_up_scale.shape == (2, 48, 2) and layer.down_scale.shape == (2, 40, 1)
    x, ids, w = torch.randn(3, 40), torch.tensor([[0], [1], [1]]), torch.ones(3, 1)
    gu, down = _dequant_f64(layer)
    _check(layer(x, ids, w), ref_experts(x, ids, w, gu, down), torch.float32)


# ------------------------------------------------------------------------------------------- quantize_ on MoE
W4_CONFIGS = {"int4-asym": torch_lowbit.Int4WeightOnly(32, symmetric=False), "nvfp4": torch_lowbit.Nvfp4WeightOnly(),
              "mxfp4": torch_lowbit.Mxfp4WeightOnly(), "uint4": torch_lowbit.AffineWeightOnly(32)}


@pytest.mark.parametrize("arch,name", [("qwen3_moe", "int4-asym"), ("qwen3_moe", "nvfp4"), ("mixtral", "mxfp4"),
                                       ("mixtral", "uint4")])
def test_quantize__converts_fused_experts_to_w4_experts(arch, name):
    import hf_writers as W
    from test_quantize import MOE_IDS, _dequantized_f64
    config = W4_CONFIGS[name]
    dense = W.tiny_model(arch)
    model, report = torch_lowbit.quantize_(W.tiny_model(arch), config, return_report=True)
    for i in range(W.LAYERS):
        fqn = f"model.layers.{i}.mlp.experts"
        layer = model.get_submodule(fqn)
        assert isinstance(layer, W4Experts) and layer.dtype == torch.float32
        assert report.converted[fqn] == f"W4Experts(E={W.EXPERTS}, {layer.format}, group {layer.group_size})"
        # each expert quantized as quantize_w4 quantizes that expert's weight
        want = quantize_w4(dense.get_submodule(fqn).down_proj[W.EXPERTS - 1].detach(), layer.format,
                           layer.group_size, getattr(config, "symmetric", True), rule=getattr(config, "rule", "mlx"))
        assert torch.equal(layer.down_packed[W.EXPERTS - 1], want.weight_packed)
    assert report.skipped == {"lm_head": "skipped by the default filter (lm_head)"}
    ref = _dequantized_f64(dense, model)
    with torch.no_grad():
        out, want = model(MOE_IDS).logits.double(), ref(MOE_IDS).logits
    err = ((out - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, err  # W4A16 = the dequantized model up to fp32 accumulation


# --------------------------------------------------------------------------------------------- dequantize_model
def test_dequantize_model_gives_back_the_models_own_dense_experts():
    import hf_writers as W
    from test_quantize import MOE_IDS
    dense = W.tiny_model("qwen3_moe")
    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Nvfp4WeightOnly())
    copy_ = torch_lowbit.dequantize_model(model, dtype=torch.float32)
    for i in range(W.LAYERS):
        fqn = f"model.layers.{i}.mlp.experts"
        got, layer = copy_.get_submodule(fqn), model.get_submodule(fqn)
        assert type(got) is type(dense.get_submodule(fqn)) and isinstance(layer, W4Experts)  # the model untouched
        gu, down = _dequant_f64(layer)
        assert torch.equal(got.gate_up_proj.double(), gu.float().double())  # rounded once to fp32
        assert torch.equal(got.down_proj.double(), down.float().double())
        assert not got.gate_up_proj.requires_grad and got.gate_up_proj.dtype == torch.float32
    assert not any(isinstance(m, W4Experts) for m in copy_.modules())
    with torch.no_grad():
        out, want = copy_(MOE_IDS).logits, model(MOE_IDS).logits
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()
    kept = torch_lowbit.dequantize_model(model, experts="keep")
    assert isinstance(kept.get_submodule("model.layers.0.mlp.experts"), W4Experts)


def test_dequantize_model_without_the_original_module_builds_dense_swiglu_experts():
    from torch_lowbit.dequantize import DenseSwiGLUExperts
    layer, (gu, down) = _layer("mxfp4", E=4)
    dense = torch_lowbit.dequantize_model(torch.nn.Sequential(layer), dtype=torch.float32)[0]
    assert type(dense) is DenseSwiGLUExperts and torch.equal(dense.gate_up_proj.double(), gu)
    ids, w = _routing(9, 2, 4, seed=5, skip_frac=0.2)
    x = torch.randn(9, 41)
    with torch.no_grad():
        _check(dense(x, ids, w), ref_experts(x, ids, w, gu, down), torch.float32)


def test_dequantize_model_refuses_4bit_experts_with_their_own_arithmetic():
    layer, _ = _layer("mxfp4", E=2)
    t = {p: {s: getattr(layer, f"{p}_{s}") for s in ("packed", "scale")} for p in PROJ}
    t["gate_up"]["bias"], t["down"]["bias"] = torch.zeros(2, 48), torch.zeros(2, 41)
    biased = W4Experts.from_quantized(t["gate_up"], t["down"], format="mxfp4", group_size=32, hidden_size=41,
                                      intermediate_size=24, dtype=torch.float32)
    model = torch.nn.Sequential(biased)
    with pytest.raises(ValueError, match=r"dequantize_model: 0 is a W4Experts with its own arithmetic \(activation "
                                         r"'swiglu', biases\).*experts='keep'"):
        torch_lowbit.dequantize_model(model)
    assert isinstance(torch_lowbit.dequantize_model(model, experts="keep")[0], W4Experts)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_dense_dtype_follows_half_and_the_format_buffers_do_not(variant):
    layer = _empty(variant)
    before = {n: b.dtype for n, b in layer.named_buffers()}
    layer.half()
    assert layer.dtype == torch.float16 and all(t.dtype == torch.float16 for t in layer.dequantize())
    assert {n: b.dtype for n, b in layer.named_buffers()} == before
