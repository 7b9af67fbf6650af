"""Fp8Experts: vs a float64 loop over tokens; skipped slots (-1), idle experts, every scale granularity with
partial blocks, torch.compile(fullgraph=True), bad input; and the loader building it from per-expert tensors."""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_lowbit.nn as tlnn
from reference import fp8_bits_to_f64, random_fp8_bits
from torch_lowbit.nn.experts import Fp8Experts


def _dequant(bits, scale, block):
    """float64 [E, N, K] from fp8 codes and a [E] / [E, N] / [E, nb, kb] scale (independent of the layer)."""
    E, N, K = bits.shape
    w = fp8_bits_to_f64(bits)
    s = scale.double()
    if s.dim() == 1:
        return w * s[:, None, None]
    if s.dim() == 2:
        return w * s[:, :, None]
    bn, bk = block
    return w * s[:, torch.arange(N) // bn][:, :, torch.arange(K) // bk]


def ref_experts(x, ids, weights, gu, down):
    """Token by token, slot by slot, in float64."""
    T, H = x.shape
    I = down.shape[2]
    out = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = gu[e] @ x[t].double()
            a = F.silu(h[:I]) * h[I:]
            out[t] += float(weights[t, j]) * (down[e] @ a)
    return out


def _layer(E, H, I, granularity, block=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu_bits = random_fp8_bits((E, 2 * I, H), g) & 0xBF  # |w| < 2: keeps SiLU inputs moderate
    d_bits = random_fp8_bits((E, H, I), g) & 0xBF

    def scale(N, K):
        shape = {"tensor": (E,), "channel": (E, N),
                 "block": (E, math.ceil(N / block[0]), math.ceil(K / block[1])) if block else None}[granularity]
        return torch.rand(shape, generator=g) * 0.05 + 0.01
    gs, ds = scale(2 * I, H), scale(H, I)
    layer = Fp8Experts.from_quantized(gu_bits.view(torch.float8_e4m3fn), gs, d_bits.view(torch.float8_e4m3fn), ds,
                                      block_size=block if granularity == "block" else None)
    return layer, _dequant(gu_bits, gs, block), _dequant(d_bits, ds, block)


def _routing(T, k, E, seed, skip_frac=0.0, only=None):
    g = torch.Generator().manual_seed(seed)
    experts = torch.arange(E) if only is None else torch.tensor(only)
    ids = experts[torch.stack([torch.randperm(len(experts), generator=g)[:k] for _ in range(T)])] if T else \
        torch.zeros(0, k, dtype=torch.int64)
    if skip_frac:
        ids = torch.where(torch.rand(ids.shape, generator=g) < skip_frac, -1, ids)
    w = torch.rand(T, k, generator=g)
    return ids, w / w.sum(-1, keepdim=True).clamp_min(1e-6)


def _check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    scale = max(ref.abs().max().item(), 1e-30)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.double() - ref).abs().max().item()
    assert err <= tol * scale, f"max error {err:.3g} vs max |ref| {scale:.3g}"


@pytest.mark.parametrize("granularity,block", [("tensor", None), ("channel", None), ("block", (16, 16)),
                                               ("block", (8, 32))])
@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (17, 2), (40, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_token_loop(granularity, block, T, k, dtype):
    E, H, I = 6, 40, 24  # partial blocks in both H and I
    layer, gu, down = _layer(E, H, I, granularity, block, seed=T * 10 + k)
    ids, w = _routing(T, k, E, seed=T)
    x = torch.randn(T, H).to(dtype)
    _check(layer(x, ids, w), ref_experts(x, ids, w, gu, down), dtype)


def test_skipped_slots_tokens_routed_nowhere_and_idle_experts():
    E, H, I = 8, 32, 16
    layer, gu, down = _layer(E, H, I, "channel")
    ids, w = _routing(12, 2, E, seed=3, skip_frac=0.4, only=[1, 5, 6])  # experts 0, 2, 3, 4, 7 get nothing
    ids[4] = -1  # token 4 routes nowhere
    w[7, 0] = float("nan")  # a skipped slot's weight is never read
    ids[7, 0] = -1
    x = torch.randn(12, H)
    out = layer(x, ids, w)
    assert torch.equal(out[4], torch.zeros(H))
    _check(out, ref_experts(x, ids, torch.nan_to_num(w), gu, down), torch.float32)


def test_empty_batch_and_leading_dims():
    layer, gu, down = _layer(4, 16, 8, "tensor")
    out = layer(torch.randn(0, 16), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    assert out.shape == (0, 16)
    x = torch.randn(2, 3, 16)
    ids, w = _routing(6, 2, 4, seed=1)
    out = layer(x, ids.int(), w)  # int32 ids are fine too
    assert out.shape == (2, 3, 16)
    _check(out.reshape(6, 16), ref_experts(x.reshape(6, 16), ids, w, gu, down), torch.float32)


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_torch_compile_fullgraph_equals_eager(granularity):
    torch._dynamo.reset()
    layer, _, _ = _layer(5, 32, 16, granularity, (16, 16))
    compiled = torch.compile(layer, fullgraph=True)
    for T, seed in ((7, 1), (13, 2)):
        ids, w = _routing(T, 2, 5, seed, skip_frac=0.2)
        x = torch.randn(T, 32, dtype=torch.bfloat16)
        assert torch.equal(compiled(x, ids, w), layer(x, ids, w))


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_from_float_quantizes_within_fp8_precision(granularity):
    torch.manual_seed(0)
    gu, down = torch.randn(3, 2 * 20, 36), torch.randn(3, 36, 20)
    layer = Fp8Experts.from_float(gu, down, granularity=granularity, block_size=(16, 16))
    got = _dequant(layer.gate_up.view(torch.uint8), layer.gate_up_scale, layer.block_size)
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4 for values above the subnormal range
    big = got.abs() > gu.abs().amax() * 2.0 ** -6 * 1.01 if granularity == "tensor" else got.abs() > 0.05
    assert ((got - gu.double()).abs() <= 2.0 ** -4 * gu.double().abs() + 1e-12)[big].all()
    assert layer.gate_up.dtype == torch.float8_e4m3fn and layer.gate_up_scale.dtype == torch.float32
    assert layer.gate_up_scale.dim() == {"tensor": 1, "channel": 2, "block": 3}[granularity]


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_from_float_all_zero_expert_gives_zero_scales_and_outputs(granularity):
    gate_up = torch.randn(2, 8, 16)
    gate_up[1] = 0  # expert 1 is all zeros: its scales are 0 (quantize_fp8's rule) and its output 0, not NaN
    down = torch.randn(2, 16, 4)
    layer = Fp8Experts.from_float(gate_up, down, granularity, (4, 8))
    assert torch.equal(layer.gate_up_scale[1], torch.zeros_like(layer.gate_up_scale[1]))
    assert torch.equal(layer.gate_up[1].float(), torch.zeros(8, 16))
    out = layer(torch.randn(3, 16), torch.ones(3, 1, dtype=torch.int64), torch.ones(3, 1))
    assert torch.equal(out, torch.zeros_like(out))


def test_state_dict_round_trip_and_uint8_bits():
    layer, _, _ = _layer(3, 16, 8, "block", (8, 8))
    fresh = Fp8Experts(3, 16, 8, granularity="block", block_size=(8, 8))
    fresh.load_state_dict(layer.state_dict())
    ids, w = _routing(5, 2, 3, seed=0)
    x = torch.randn(5, 16)
    assert torch.equal(fresh(x, ids, w), layer(x, ids, w))
    as_u8 = Fp8Experts.from_quantized(layer.gate_up.view(torch.uint8), layer.gate_up_scale,
                                      layer.down.view(torch.uint8), layer.down_scale, block_size=(8, 8))
    assert torch.equal(as_u8(x, ids, w), layer(x, ids, w))


def test_bad_input_names_the_argument():
    layer, _, _ = _layer(4, 16, 8, "channel")
    with pytest.raises(RuntimeError, match="topk_ids must be < num_experts"):
        layer(torch.randn(2, 16), torch.tensor([[0, 4], [1, 2]]), torch.ones(2, 2))
    fp8 = torch.zeros(4, 16, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"down_scale of shape \[4, 7\] fits no layout"):
        Fp8Experts.from_quantized(fp8, torch.ones(4), torch.zeros(4, 16, 8, dtype=torch.float8_e4m3fn),
                                  torch.ones(4, 7))
    with pytest.raises(ValueError, match=r"down must be \[E, H, I\]"):
        Fp8Experts.from_quantized(fp8, torch.ones(4), torch.zeros(4, 16, 9, dtype=torch.float8_e4m3fn), torch.ones(4))
    with pytest.raises(ValueError, match="gate_up must be a 3-D float8_e4m3fn"):
        Fp8Experts.from_quantized(fp8.float(), torch.ones(4), fp8, torch.ones(4))
    with pytest.raises(ValueError, match="granularity must be one of"):
        Fp8Experts(2, 8, 8, granularity="row")


@pytest.mark.parametrize("hidden,ids,weights,match", [
    ((2, 12), (2, 2), (2, 2), r"hidden must be \[\.\.\., hidden_size\] = \[\.\.\., 16\], got shape \(2, 12\)"),
    ((2, 32), (2, 2), (2, 2), r"hidden_size\] = \[\.\.\., 16\], got shape \(2, 32\)"),
    ((3, 16), (2, 2), (2, 2), r"topk_ids must be \[T, k\] with T = 3 tokens"),
    ((2, 16), (2, 2), (2, 3), r"topk_weights must have topk_ids' shape \(2, 2\), got \(2, 3\)"),
])
def test_forward_bad_shapes_name_the_argument(hidden, ids, weights, match):
    layer, _, _ = _layer(4, 16, 8, "channel")
    with pytest.raises(ValueError, match=match):
        layer(torch.randn(hidden), torch.zeros(ids, dtype=torch.int64), torch.ones(weights))


def test_forward_bad_dtypes_name_the_argument():
    layer, _, _ = _layer(4, 16, 8, "channel")
    with pytest.raises(ValueError, match="topk_ids must be an integer tensor, got torch.float32"):
        layer(torch.randn(2, 16), torch.zeros(2, 2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="topk_weights must be a floating tensor, got torch.int64"):
        layer(torch.randn(2, 16), torch.zeros(2, 2, dtype=torch.int64), torch.ones(2, 2, dtype=torch.int64))


# ------------------------------------------------------------------------------------------ through the loader
needs_layers = pytest.mark.skipif(not hasattr(tlnn, "Fp8Linear"),
                                  reason="torch_lowbit.nn.Fp8Linear / Int8Linear have not landed in this tree yet")
MOE = dict(I=32, moe=(6, 2))  # 6 experts, top-2; I a multiple of the 16-row blocks so gate/up blocks stack


def _moe_models(spec):
    from checkpoints import make_checkpoint
    from tiny_models import TinyLM
    torch.manual_seed(0)
    sd, ref = make_checkpoint(TinyLM(**MOE), spec)
    torch.manual_seed(1)
    return sd, ref, TinyLM(**MOE)


@needs_layers
# per-tensor gate and up scales differ, so gate_up widens to per channel; down keeps its per-tensor scale
@pytest.mark.parametrize("spec,gu_gran,down_gran", [("hf-fp8-block", "block", "block"),
                                                    ("modelopt-tensor", "channel", "tensor"),
                                                    ("ct-fp8-channel", "channel", "channel"),
                                                    ("fbgemm", "channel", "channel")])
def test_loader_builds_fp8_experts_from_per_expert_tensors(tmp_path, spec, gu_gran, down_gran):
    from checkpoints import write_dir
    from torch_lowbit.formats import load_quantized
    sd, ref, model = _moe_models(spec)
    write_dir(tmp_path, sd, spec)
    report = load_quantized(model, tmp_path, dtype=torch.float32)
    for i in range(2):
        name = f"model.layers.{i}.mlp.experts"
        assert isinstance(model.get_submodule(name), Fp8Experts)
        assert report.converted[name] == f"Fp8Experts(E=6, gate_up {gu_gran}, down {down_gran})"
        assert "mlp.gate" in " ".join(report.high_precision)  # the router
    assert report.unused_keys == [] and report.missing_keys == []
    ids = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23]])
    with torch.no_grad():
        out, want = model(ids).double(), ref(ids)
    assert (out - want).abs().max() <= 2e-5 * want.abs().max()


@needs_layers
def test_loader_stacks_unquantized_experts_into_the_dense_module():
    from checkpoints import config_for
    from tiny_models import DenseExperts
    from torch_lowbit.formats import load_quantized
    sd, ref, model = _moe_models("hf-fp8-block")
    name = "model.layers.0.mlp.experts"
    g = torch.Generator().manual_seed(5)
    for e in range(6):
        for p, shape in (("gate", (32, 48)), ("up", (32, 48)), ("down", (48, 32))):
            w = torch.randn(shape, generator=g).to(torch.bfloat16) * 0.1
            sd[f"{name}.{e}.{p}_proj.weight"] = w
            del sd[f"{name}.{e}.{p}_proj.weight_scale_inv"]
            with torch.no_grad():
                exp = ref.get_submodule(name)
                if p == "down":
                    exp.down_proj[e] = w.double()
                else:
                    exp.gate_up_proj[e, (0 if p == "gate" else 32):(32 if p == "gate" else 64)] = w.double()
    report = load_quantized(model, sd, config=config_for("hf-fp8-block"), dtype=torch.float32)
    assert isinstance(model.get_submodule(name), DenseExperts) and report.high_precision[name] == "stored as torch.bfloat16"
    assert isinstance(model.get_submodule("model.layers.1.mlp.experts"), Fp8Experts)
    ids = torch.tensor([[3, 17, 42, 5, 88]])
    with torch.no_grad():
        out, want = model(ids).double(), ref(ids)
    assert (out - want).abs().max() <= 2e-5 * want.abs().max()


@needs_layers
def test_loader_missing_expert_names_the_tensor():
    from checkpoints import config_for
    from torch_lowbit.formats import CheckpointError, load_quantized
    sd, _, model = _moe_models("hf-fp8-block")
    del sd["model.layers.1.mlp.experts.4.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.4\.up_proj\.weight is missing"):
        load_quantized(model, sd, config=config_for("hf-fp8-block"))
    sd, _, model = _moe_models("hf-fp8-block")
    del sd["model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"]
    with pytest.raises(CheckpointError, match=r"experts\.2\.down_proj\.weight_scale_inv is missing"):
        load_quantized(model, sd, config=config_for("hf-fp8-block"))


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16),
                                     lambda m: m.to("cpu", torch.float16), lambda m: m.double()])
def test_module_dtype_conversion_keeps_fp8_codes_and_fp32_scales(convert):
    layer, gu, down = _layer(3, 24, 10, "block", (8, 16))
    codes = (layer.gate_up.clone(), layer.down.clone(), layer.gate_up_scale.clone(), layer.down_scale.clone())
    convert(layer)
    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    for t, before in zip((layer.gate_up, layer.down, layer.gate_up_scale, layer.down_scale), codes):
        assert t.dtype == before.dtype and torch.equal(bits(t), bits(before))
    ids, w = _routing(6, 2, 3, seed=4)
    x = torch.randn(6, 24)
    _check(layer(x, ids, w), ref_experts(x, ids, w, gu, down), torch.float32)
    assert layer.state_dict()["gate_up"].dtype == torch.float8_e4m3fn
