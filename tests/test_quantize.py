"""quantize_fp8 / quantize_int8 against numpy references: scales, codes, saturation, zero blocks, partial edge
blocks, round-trip error bounds, bad input; quantize_ on MoE models (fused and per-expert experts, the experts it must
leave dense, filter_fn, the report, progress, TorchLowbitConfig through the same walker)."""
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_lowbit
from reference import fp8_bits_to_f64, fp8_weight_f64, ref_quantize_fp8, ref_quantize_int8

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 1), (3, 5), (17, 33), (70, 300), (130, 129)]


def _weight(N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + N * 7 + K)
    w = torch.randn(N, K, generator=g) * 0.05
    if N * K > 4:  # a few outliers, as real weights have, so scales differ a lot between rows / blocks
        idx = torch.randint(0, N * K, (max(1, N * K // 50),), generator=g)
        w.view(-1)[idx] *= 30
    return w.to(dtype)


def _check_fp8(w, granularity, block_size=(128, 128)):
    q, s = torch_lowbit.quantize_fp8(w, granularity, block_size)
    codes, ref_s, full = ref_quantize_fp8(w, granularity, block_size)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == ref_s.shape
    assert torch.equal(s, ref_s)  # the same float32 division: bit exact
    got = fp8_bits_to_f64(q.view(torch.uint8))
    assert not torch.isnan(got).any()
    assert torch.equal(got, fp8_bits_to_f64(codes))
    return q, s, full


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES)
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_scales_and_codes_match_reference(dtype, N, K, granularity):
    _check_fp8(_weight(N, K, dtype), granularity, (32, 64))


@pytest.mark.parametrize("block_size", [(128, 128), (1, 1), (16, 7), (200, 3), (2 ** 63 - 1, 5), (2, 2 ** 40),
                                        (2 ** 31, 2 ** 31)])  # blocks past the weight: one partial block, no padding
def test_fp8_block_shapes_partial_edges(block_size):
    w = _weight(130, 129, torch.bfloat16)
    _, s, _ = _check_fp8(w, "block", block_size)
    bn, bk = block_size
    assert s.shape == (-(-130 // bn), -(-129 // bk))


def test_fp8_scale_shapes():
    w = _weight(70, 300, torch.float32)
    assert torch_lowbit.quantize_fp8(w, "tensor")[1].shape == (1,)
    assert torch_lowbit.quantize_fp8(w, "channel")[1].shape == (70,)
    assert torch_lowbit.quantize_fp8(w, "block")[1].shape == (1, 3)
    assert torch_lowbit.quantize_fp8(w)[1].shape == (1,)  # the default is per tensor


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_saturates_the_largest_values_to_448(granularity):
    # amax / (amax / 448) can round just above 448: the cast must still give 448, never NaN
    w = torch.tensor([[3.0, -1e-3, 7.0e-7], [-0.3, 0.1, 2.5e4]])
    vals = np.float32(np.random.default_rng(0).uniform(0.1, 1e4, 4000))
    over = vals[(vals / (vals / np.float32(448))).astype(np.float32) > np.float32(448)]
    assert len(over), "no rounding-over case found to test saturation with"
    w[0, 0], w[1, 2] = float(over[0]), -float(over[1])
    q, s, _ = _check_fp8(w, granularity, (1, 2))
    d = q.float()
    assert d[0, 0] == 448 and d[1, 2] == -448


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_zero_rows_and_blocks_give_scale_0_and_no_nan(granularity):
    w = _weight(40, 70, torch.bfloat16)
    w[8:16] = 0  # whole rows, and with block (8, 32) whole blocks
    w[:, 32:64] = 0
    if granularity == "tensor":
        w.zero_()
    q, s, _ = _check_fp8(w, granularity, (8, 32))
    assert (s == 0).any()
    assert not torch.isnan(q.float()).any() and (q.float()[8:16] == 0).all()


@pytest.mark.parametrize("N,K", [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_empty(N, K, granularity):
    q, s = torch_lowbit.quantize_fp8(torch.zeros(N, K), granularity, (4, 4))
    assert q.shape == (N, K)
    assert s.shape == {"tensor": (1,), "channel": (N,), "block": (-(-N // 4), -(-K // 4))}[granularity]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_round_trip_error_bound(dtype, granularity):
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative in the normal range; below 2^-6 (subnormals) the
    # step is 2^-9, so the error is at most 2^-10 * scale there
    w = _weight(70, 300, dtype)
    q, s, full = _check_fp8(w, granularity, (32, 64))
    w64 = w.double()
    deq = fp8_bits_to_f64(q.view(torch.uint8)) * full
    err = (deq - w64).abs()
    bound = torch.maximum(w64.abs() * 2.0 ** -4, full * 2.0 ** -10) * (1 + 1e-6) + 1e-30
    assert (err <= bound).all()
    assert err.max() > 0  # the bound is not vacuous


def test_fp8_computes_in_float32_not_the_weights_dtype():
    # a bf16 scale (8 bits) would be off by up to 2^-9 relative; the float32 one is exact to the reference
    w = _weight(9, 17, torch.bfloat16)
    _, s = torch_lowbit.quantize_fp8(w, "channel")
    assert torch.equal(s, w.float().abs().amax(1) / 448)
    assert not torch.equal(s, (w.abs().amax(1) / 448).float())


@pytest.mark.parametrize("w,kwargs,exc,match", [
    (torch.zeros(4, 4, dtype=torch.int32), {}, ValueError, "w must be a floating-point weight"),
    (torch.zeros(4, 4).to(torch.float8_e4m3fn), {}, ValueError, "w must be a floating-point weight"),
    (torch.zeros(2, 4, 4), {}, ValueError, r"w must be \[N, K\]"),
    (torch.zeros(4), {}, ValueError, r"w must be \[N, K\]"),
    ([[1.0]], {}, TypeError, "w must be a torch.Tensor"),
    (torch.zeros(4, 4), {"granularity": "row"}, ValueError, "granularity must be one of"),
    (torch.zeros(4, 4), {"granularity": "block", "block_size": (0, 4)}, ValueError, "block_size must be two positive"),
    (torch.zeros(4, 4), {"granularity": "block", "block_size": (4,)}, ValueError, "block_size must be two positive"),
    (torch.zeros(4, 4), {"granularity": "block", "block_size": (2.5, 4)}, ValueError, "block_size must be two pos"),
    (torch.tensor([[1.0, float("nan")]]), {}, ValueError, "w contains NaN or inf"),
    (torch.tensor([[1.0], [float("inf")]]), {"granularity": "channel"}, ValueError, "w contains NaN or inf"),
])
def test_fp8_bad_input(w, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        torch_lowbit.quantize_fp8(w, **kwargs)


def test_fp8_on_a_device_that_cannot_hold_fp8(monkeypatch):
    # what mps before torch 2.15 does: the codes come back as uint8 bits, the same bytes
    w = _weight(17, 33, torch.bfloat16)
    ref_q, ref_s = torch_lowbit.quantize_fp8(w, "channel")
    monkeypatch.setattr(torch_lowbit._storage, "_device_type_holds_fp8", lambda device_type: False)
    q, s = torch_lowbit.quantize_fp8(w, "channel")
    assert q.dtype == torch.uint8 and torch.equal(q, ref_q.view(torch.uint8)) and torch.equal(s, ref_s)


# ---------------------------------------------------------------------------------------------- int8
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K", SHAPES)
def test_int8_matches_reference(dtype, N, K):
    w = _weight(N, K, dtype)
    q, s = torch_lowbit.quantize_int8(w)
    rq, rs = ref_quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (N, K) and s.dtype == torch.float32 and s.shape == (N,)
    assert torch.equal(s, rs) and torch.equal(q, rq)
    assert q.min() >= -127 and (q.abs().amax(1) == 127).all()  # symmetric: the row max maps to +-127


def test_int8_rounds_half_to_even():
    w = torch.tensor([[127.0, 2.5, 3.5, -2.5, -3.5, 0.5, 1.5, -126.5]])  # scale exactly 1
    q, s = torch_lowbit.quantize_int8(w)
    assert s.tolist() == [1.0]
    assert q.tolist() == [[127, 2, 4, -2, -4, 0, 2, -126]]


def test_int8_zero_rows_and_empty():
    w = _weight(6, 10, torch.float32)
    w[2] = 0
    q, s = torch_lowbit.quantize_int8(w)
    assert s[2] == 0 and (q[2] == 0).all() and torch.isfinite(s).all()
    q, s = torch_lowbit.quantize_int8(torch.zeros(3, 0))
    assert q.shape == (3, 0) and s.tolist() == [0, 0, 0]
    q, s = torch_lowbit.quantize_int8(torch.zeros(0, 3))
    assert q.shape == (0, 3) and s.shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_round_trip_error_bound(dtype):
    w = _weight(70, 300, dtype)
    q, s = torch_lowbit.quantize_int8(w)
    err = (q.double() * s.double()[:, None] - w.double()).abs()
    assert (err <= s.double()[:, None] * (0.5 + 1e-5)).all()
    assert err.max() > 0


@pytest.mark.parametrize("w,exc,match", [
    (torch.zeros(4, 4, dtype=torch.int8), ValueError, "quantize_int8: w must be a floating-point weight"),
    (torch.zeros(4), ValueError, r"quantize_int8: w must be \[N, K\]"),
    (torch.tensor([[float("inf"), 1.0]]), ValueError, "w contains NaN or inf"),
])
def test_int8_bad_input(w, exc, match):
    with pytest.raises(exc, match=match):
        torch_lowbit.quantize_int8(w)


# ---------------------------------------------------------------------------------------------- quantize_ on MoE
def _dequantized_f64(dense, quantized):
    """A float64 copy of `dense` whose weights are those of `quantized`'s layers, dequantized here (codes times
    scales, by the format's definition), so that transformers' own forward is the reference."""
    import copy

    from reference import expand_scale, fp8_bits_to_f64, w4_weight_f64
    from torch_lowbit.nn import Fp8Experts, Fp8Linear, Int8Experts, Int8Linear, W4Experts, W4Linear

    def fp8(codes, scale, block):
        return fp8_bits_to_f64(codes.view(torch.uint8)) * expand_scale(scale, *codes.shape, block)

    ref = copy.deepcopy(dense).double()
    ref.set_experts_implementation("eager")  # transformers' default grouped_mm takes no float64
    with torch.no_grad():
        for name, m in quantized.named_modules():
            if isinstance(m, Fp8Linear):
                ref.get_submodule(name).weight.copy_(fp8(m.weight, m.weight_scale, m.block_size))
            elif isinstance(m, Int8Linear):
                ref.get_submodule(name).weight.copy_(m.weight.double() * m.weight_scale.double()[:, None])
            elif isinstance(m, Fp8Experts):
                r = ref.get_submodule(name)
                for e in range(m.num_experts):
                    r.gate_up_proj[e] = fp8(m.gate_up[e], m.gate_up_scale[e], m.block_size)
                    r.down_proj[e] = fp8(m.down[e], m.down_scale[e], m.block_size)
            elif isinstance(m, Int8Experts):
                r = ref.get_submodule(name)
                r.gate_up_proj.copy_(m.gate_up.double() * m.gate_up_scale.double()[..., None])
                r.down_proj.copy_(m.down.double() * m.down_scale.double()[..., None])
            elif isinstance(m, W4Linear):
                ref.get_submodule(name).weight.copy_(w4_weight_f64(
                    m.format, m.weight_packed, m.weight_scale, m.group_size, m.in_features, m.weight_offset,
                    m.weight_scale_2))
            elif isinstance(m, W4Experts):
                r = ref.get_submodule(name)
                for p, K in (("gate_up", m.hidden_size), ("down", m.intermediate_size)):
                    t = [getattr(m, f"{p}_{s}") for s in ("packed", "scale", "offset", "scale_2")]
                    for e in range(m.num_experts):
                        getattr(r, f"{p}_proj")[e] = w4_weight_f64(m.format, t[0][e], t[1][e], m.group_size, K,
                                                                   *(None if v is None else v[e] for v in t[2:]))
    return ref


MOE_CONFIGS = {"fp8-channel": torch_lowbit.Fp8WeightOnly(), "fp8-block": torch_lowbit.Fp8WeightOnly("block", (16, 32)),
               "int8": torch_lowbit.Int8Dynamic()}
MOE_IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23], [96, 2, 2, 50, 11, 7, 33, 8, 70]])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_quantize__converts_fused_moe_experts_and_reports_it(arch, name):
    import hf_writers as W
    from torch_lowbit.nn import Fp8Experts, Int8Experts
    dense = W.tiny_model(arch)
    model, report = torch_lowbit.quantize_(W.tiny_model(arch), MOE_CONFIGS[name], return_report=True)
    layer = Int8Experts if name == "int8" else Fp8Experts
    for i in range(W.LAYERS):
        fqn = f"model.layers.{i}.mlp.experts"
        assert isinstance(model.get_submodule(fqn), layer)
        assert report.converted[fqn].startswith(f"{layer.__name__}(E={W.EXPERTS}")
    assert report.skipped == {"lm_head": "skipped by the default filter (lm_head)"}
    assert type(model.lm_head) is torch.nn.Linear
    ref = _dequantized_f64(dense, model)
    with torch.no_grad():
        out, want = model(MOE_IDS).logits.double(), ref(MOE_IDS).logits
    err = ((out - want).abs().max() / want.abs().max()).item()
    # W8A16 matches the dequantized model up to fp32 accumulation; W8A8 also rounds each token's activations
    assert err <= (5e-2 if name == "int8" else 1e-5), err


def test_quantize__per_expert_linear_layout_converts_each_linear():
    import hf_writers as W
    from torch_lowbit.nn import Int8Linear
    model = W.split_experts(W.tiny_model("mixtral"), "mixtral")  # experts as a ModuleList of MLPs
    model, report = torch_lowbit.quantize_(model, torch_lowbit.Int8Dynamic(), return_report=True)
    for e in range(W.EXPERTS):
        for leaf in ("w1", "w2", "w3"):
            fqn = f"model.layers.1.mlp.experts.{e}.{leaf}"
            assert isinstance(model.get_submodule(fqn), Int8Linear) and report.converted[fqn] == "Int8Linear(channel)"


def test_quantize__filter_fn_is_asked_about_experts_too():
    import hf_writers as W
    asked = {}

    def keep_experts_dense(module, fqn):
        asked[fqn] = type(module).__name__
        return not fqn.endswith("experts") and fqn != "lm_head"
    model, report = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Fp8WeightOnly(),
                                           filter_fn=keep_experts_dense, return_report=True)
    assert asked["model.layers.0.mlp.experts"] == "Qwen3MoeExperts" and asked["lm_head"] == "Linear"
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    assert report.skipped["model.layers.1.mlp.experts"] == "filter_fn returned False"
    assert "model.layers.1.self_attn.q_proj" in report.converted


class _InterleavedExperts(torch.nn.Module):
    """Fused experts whose gate and up rows alternate (no transformers flag says so): same tensors, another
    arithmetic."""

    def __init__(self, E=3, H=16, I=8):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(E, 2 * I, H) * 0.3)
        self.down_proj = torch.nn.Parameter(torch.randn(E, H, I) * 0.3)

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        for t in range(hidden.shape[0]):
            for j in range(top_k_index.shape[1]):
                e = int(top_k_index[t, j])
                h = self.gate_up_proj[e] @ hidden[t]
                out[t] += top_k_weights[t, j] * (self.down_proj[e] @ (F.silu(h[0::2]) * h[1::2]))
        return out


class _BiasedExperts(_InterleavedExperts):
    def __init__(self):
        super().__init__()
        self.down_proj_bias = torch.nn.Parameter(torch.zeros(3, 16))


def _gelu_qwen3():
    import hf_writers as W
    from transformers.activations import ACT2FN
    model = W.tiny_model("qwen3_moe")
    model.model.layers[0].mlp.experts.act_fn = ACT2FN["gelu"]
    return model, "model.layers.0.mlp.experts", "does not compute x \\* sigmoid\\(x\\)"


def _gpt_oss():
    import hf_writers as W
    cfg = W.transformers.GptOssConfig(vocab_size=101, hidden_size=48, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4,
                                      num_experts_per_tok=2, layer_types=["full_attention"])
    torch.manual_seed(0)
    return W.transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), "model.layers.0.mlp.experts", \
        "is_transposed=True"


@pytest.mark.parametrize("build", [
    _gelu_qwen3, _gpt_oss,
    lambda: (torch.nn.Sequential(_InterleavedExperts()), "0", "differs from the SwiGLU of its gate_up_proj"),
    lambda: (torch.nn.Sequential(_BiasedExperts()), "0", "holds down_proj_bias besides gate_up_proj"),
], ids=["gelu", "gpt-oss", "interleaved", "bias"])
@pytest.mark.parametrize("config", [torch_lowbit.Fp8WeightOnly(), torch_lowbit.Int8Dynamic(),
                                    torch_lowbit.Nvfp4WeightOnly()], ids=["fp8", "int8", "nvfp4"])
def test_quantize__experts_it_cannot_convert_stay_dense_with_the_reason(build, config):
    model, fqn, why = build()
    dense_type = type(model.get_submodule(fqn))
    with pytest.warns(UserWarning, match=f"MoE experts {fqn} left in high precision: .*{why}"):
        model, report = torch_lowbit.quantize_(model, config, return_report=True)
    assert type(model.get_submodule(fqn)) is dense_type
    assert fqn not in report.converted and re.search(why, report.skipped[fqn])


def test_quantize__shows_progress_in_modules(monkeypatch, capsys):
    import hf_writers as W
    from torch_lowbit import _progress

    class EveryUpdate(_progress.Progress):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "interval": 0.0, "enabled": True})
    monkeypatch.setattr(_progress, "Progress", EveryUpdate)
    _, report = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Int8Dynamic(), return_report=True)
    lines = capsys.readouterr().err.strip().splitlines()
    total = len(report.converted) + len(report.skipped)  # 2 layers x (4 attention + experts) + lm_head
    assert total == 11
    assert lines[-1].startswith(f"torch_lowbit quantize_: {total}/{total} modules")


@pytest.mark.parametrize("weights", ["fp8", "int8"])
def test_torch_lowbit_config_converts_experts_through_quantize_(tmp_path, weights):
    import hf_writers as W
    from torch_lowbit.nn import Fp8Experts, Int8Experts
    W.tiny_model("qwen3_moe").save_pretrained(tmp_path)
    config = torch_lowbit.TorchLowbitConfig(weights, "block", (16, 32))
    model = W.transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                quantization_config=config)
    assert isinstance(model.model.layers[1].mlp.experts, Int8Experts if weights == "int8" else Fp8Experts)
    want = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), config.quantize_config())
    with torch.no_grad():
        assert torch.equal(model(MOE_IDS).logits, want(MOE_IDS).logits)


def test_a_layer_a_parent_holds_twice_is_quantized_under_both_names():
    # named_children() names a module once per parent: the second name kept the dense layer, silently
    shared = torch.nn.Linear(32, 32)
    model = torch.nn.Sequential(shared, torch.nn.ReLU(), shared)
    x = torch.randn(3, 32)
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly())
    assert isinstance(model[0], torch_lowbit.nn.Fp8Linear) and model[2] is model[0]
    w = fp8_weight_f64(model[0].weight.view(torch.uint8), model[0].weight_scale)
    h = torch.relu(x.double() @ w.T + model[0].bias.double())
    want = h @ w.T + model[0].bias.double()
    assert float((model(x).double() - want).abs().max()) <= 1e-4 * float(want.abs().max())
