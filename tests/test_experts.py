"""Fp8Experts: vs a float64 loop over tokens; skipped slots (-1), idle experts, every scale granularity with
partial blocks, torch.compile(fullgraph=True), bad input; and the loader building it from per-expert tensors. Int8Experts: vs a
float64 W8A8 token loop, straight-through gradients, compressed-tensors' int8 experts, the save_quantized round trip."""
import math

import pytest
import torch
import torch.nn.functional as F

import torch_lowbit
import torch_lowbit.nn as tlnn
from reference import fp8_bits_to_f64, random_fp8_bits
from torch_lowbit.nn import Int8Experts, Int8Linear
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


@pytest.mark.parametrize("granularity", ["channel", "block", "int8"])
def test_torch_compile_fullgraph_equals_eager(granularity):
    # T = 7, 2 of 5 experts each, some slots skipped: idle experts too, which Int8Experts skips in eager mode only
    torch._dynamo.reset()
    layer = _int8_layer(5, 32, 16)[0] if granularity == "int8" else _layer(5, 32, 16, granularity, (16, 16))[0]
    compiled = torch.compile(layer, fullgraph=True)
    for T, seed in ((7, 1), (13, 2)):
        ids, w = _routing(T, 2, 5, seed, skip_frac=0.2)
        if T == 7:
            ids[ids == 3] = 4  # expert 3 idle
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


@pytest.mark.parametrize("convert,dtype", [(lambda m: m.half(), torch.float16),
                                           (lambda m: m.to(torch.bfloat16), torch.bfloat16),
                                           (lambda m: m.to("cpu", torch.float16), torch.float16),
                                           (lambda m: m.float(), torch.float32),
                                           (lambda m: m.double(), torch.bfloat16), (lambda m: m.cpu(), torch.bfloat16)])
def test_module_dtype_conversion_keeps_fp8_codes_and_fp32_scales(convert, dtype):
    layer, gu, down = _layer(3, 24, 10, "block", (8, 16))
    assert layer.dtype == torch.bfloat16
    codes = (layer.gate_up.clone(), layer.down.clone(), layer.gate_up_scale.clone(), layer.down_scale.clone())
    convert(layer)
    # the dense dtype follows the cast as a dense layer's weight would, to the dtypes the ops compute in
    assert layer.dtype == dtype and layer.dequantize()[0].dtype == dtype
    def bits(t):
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    for t, before in zip((layer.gate_up, layer.down, layer.gate_up_scale, layer.down_scale), codes):
        assert t.dtype == before.dtype and torch.equal(bits(t), bits(before))
    ids, w = _routing(6, 2, 3, seed=4)
    x = torch.randn(6, 24)
    _check(layer(x, ids, w), ref_experts(x, ids, w, gu, down), torch.float32)
    assert layer.state_dict()["gate_up"].dtype == torch.float8_e4m3fn


# ------------------------------------------------------------------------------------------------ Int8Experts
def _int8_layer(E, H, I, seed=0):
    from torch_lowbit.nn import Int8Experts
    g = torch.Generator().manual_seed(seed)
    gu = torch.randint(-127, 128, (E, 2 * I, H), generator=g, dtype=torch.int8)
    dn = torch.randint(-127, 128, (E, H, I), generator=g, dtype=torch.int8)
    gs, ds = torch.rand(E, 2 * I, generator=g) * 2e-3 + 1e-3, torch.rand(E, H, generator=g) * 2e-3 + 1e-3
    return Int8Experts.from_quantized(gu, gs, dn, ds), (gu, gs, dn, ds)


def _w8a8_f64(x, wq, ws, dtype):
    """One int8_linear in float64: x per row by the int8_quantize reference, exact integer products, the product
    rounded once to the activation dtype (what int8_mm returns)."""
    from reference import ref_int8_quantize
    q, s, _ = ref_int8_quantize(x)
    acc = q.to(torch.int64) @ wq.to(torch.int64).T
    return (acc.double() * s.double()[:, None] * ws.double()[None, :]).to(dtype)


def ref_int8_experts(x, ids, weights, tensors, st=False):
    """Token by token, slot by slot: W8A8 in float64, rounded where the layer rounds (each projection's output, the
    SwiGLU). st=True: values as computed, gradients straight through each activation quantization, i.e. of
    x @ (wq * ws)^T (what Int8Linear's backward promises), in float64 autograd."""
    gu, gs, dn, ds = tensors
    dtype = x.dtype
    I = dn.shape[2]
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue

            def proj(a, wq, ws):
                value = _w8a8_f64(a.detach().to(dtype)[None], wq, ws, dtype)[0].double()
                if not st:
                    return value
                lin = a.double() @ (wq.double() * ws.double()[:, None]).T
                return value + lin - lin.detach()
            h = proj(x[t], gu[e], gs[e])
            a = (F.silu(h[:I].float().double()) * h[I:].double())
            a = a + (a.to(torch.float32).to(dtype).double() - a).detach()  # rounded as the layer rounds, in value only
            acc = acc + weights[t, j].double() * proj(a, dn[e], ds[e])
        out.append(acc)
    return torch.stack(out) if out else torch.zeros(0, x.shape[1], dtype=torch.float64)


@pytest.mark.parametrize("T,k,skip", [(1, 1, 0.0), (5, 2, 0.0), (23, 3, 0.3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_experts_match_float64_w8a8_token_loop(T, k, skip, dtype):
    E, H, I = 6, 40, 24
    layer, tensors = _int8_layer(E, H, I, seed=T)
    ids, w = _routing(T, k, E, seed=T, skip_frac=skip, only=[0, 2, 3, 5] if T > 5 else None)  # idle experts
    x = (torch.randn(T, H) * 3).to(dtype)
    out = layer(x, ids, w)
    ref = ref_int8_experts(x, ids, w, tensors)
    assert out.dtype == dtype and out.shape == (T, H)
    # fp32: the W8A8 arithmetic itself (W8A16 would be off by ~1e-2); bf16: its output rounding
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    err = (out.double() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), err


def test_int8_experts_skipped_slots_and_empty_batch():
    layer, tensors = _int8_layer(4, 16, 8)
    ids = torch.tensor([[-1, -1], [1, -1], [3, 1]])
    w = torch.tensor([[float("nan"), 1.0], [0.5, float("inf")], [0.25, 0.75]])  # skipped weights are never read
    x = torch.randn(3, 16)
    out = layer(x, ids, w)
    assert torch.equal(out[0], torch.zeros(16))
    ref = ref_int8_experts(x, ids, torch.nan_to_num(w, posinf=0.0), tensors)
    assert (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert layer(torch.randn(0, 16), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)).shape == (0, 16)
    with pytest.raises(RuntimeError, match="topk_ids must be < num_experts"):
        layer(torch.randn(1, 16), torch.tensor([[4]]), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"Int8Experts: hidden must be \[\.\.\., hidden_size\] = \[\.\.\., 16\]"):
        layer(torch.randn(2, 12), torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1))


def test_int8_experts_gradients_pass_straight_through_activation_quantization():
    layer, tensors = _int8_layer(4, 16, 8, seed=3)
    ids, w = _routing(7, 2, 4, seed=2, skip_frac=0.2)
    x = torch.randn(7, 16, requires_grad=True)
    w = w.clone().requires_grad_(True)
    g = torch.randn(7, 16)
    (layer(x, ids, w) * g).sum().backward()
    x64, w64 = x.detach().clone().requires_grad_(True), w.detach().double().clone().requires_grad_(True)
    (ref_int8_experts(x64, ids, w64, tensors, st=True) * g.double()).sum().backward()
    assert x.grad.abs().max() > 0
    assert (x.grad.double() - x64.grad).abs().max() <= 1e-4 * x64.grad.abs().max()
    assert (w.grad.double() - w64.grad).abs().max() <= 1e-4 * w64.grad.abs().max()


def test_int8_experts_from_float_quantizes_each_expert_per_channel():
    from reference import ref_quantize_int8
    from torch_lowbit.nn import Int8Experts
    torch.manual_seed(0)
    gate_up, down = torch.randn(3, 2 * 12, 20, dtype=torch.bfloat16), torch.randn(3, 20, 12)
    gate_up[1, 5] = 0  # a zero row: scale 0, codes 0
    layer = Int8Experts.from_float(gate_up, down)
    for e in range(3):
        for got_q, got_s, w in ((layer.gate_up[e], layer.gate_up_scale[e], gate_up[e]),
                                (layer.down[e], layer.down_scale[e], down[e])):
            q, s = ref_quantize_int8(w)
            assert torch.equal(got_q, q) and torch.equal(got_s, s)
    assert layer.dtype == torch.bfloat16
    layer.half()  # module-wide conversions keep int8 codes and fp32 scales
    assert layer.gate_up.dtype == torch.int8 and layer.gate_up_scale.dtype == torch.float32
    fresh = Int8Experts(3, 20, 12)
    fresh.load_state_dict(layer.state_dict())
    x, (ids, w) = torch.randn(4, 20), _routing(4, 2, 3, seed=1)
    assert torch.equal(fresh(x, ids, w), layer(x, ids, w))


@pytest.mark.parametrize("args,match", [
    (dict(gate_up=torch.zeros(2, 8, 4)), "gate_up must be a 3-D int8 tensor, got torch.float32"),
    (dict(gate_up_scale=torch.ones(2, 7)), r"gate_up_scale must be \[E, N\] = \[2, 8\] \(per channel\)"),
    (dict(down=torch.zeros(2, 4, 5, dtype=torch.int8), down_scale=torch.ones(2, 4)), r"down must be \[E, H, I\]"),
    (dict(down_scale=torch.ones(2, 4, dtype=torch.int32)), "down_scale must be a floating tensor"),
])
def test_int8_experts_from_quantized_names_the_bad_argument(args, match):
    from torch_lowbit.nn import Int8Experts
    kw = dict(gate_up=torch.zeros(2, 8, 4, dtype=torch.int8), gate_up_scale=torch.ones(2, 8),
              down=torch.zeros(2, 4, 4, dtype=torch.int8), down_scale=torch.ones(2, 4))
    kw.update(args)
    with pytest.raises(ValueError, match=match):
        Int8Experts.from_quantized(kw["gate_up"], kw["gate_up_scale"], kw["down"], kw["down_scale"])


# ------------------------------------------------------------------------ INT8 experts through checkpoints
IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23]])


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_compressed_tensors_int8_w8a8_experts_load_into_int8_experts(tmp_path, arch):
    import hf_writers as W
    import torch_lowbit
    from torch_lowbit.nn import Int8Experts
    W.write_compressed_tensors(W.tiny_model(arch), arch, str(tmp_path), "int8-w8a8")
    model, report = torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32, return_report=True)
    # transformers 5.24 cannot reload compressed-tensors int8 MoE experts itself ("Concatenate on tensors destined
    # for ...gate_up_proj"): the reference is the checkpoint dequantized in float64 and loaded dense by transformers
    ref = W.dequantized_by_hand(str(tmp_path))
    for i in range(2):
        name = f"model.layers.{i}.mlp.experts"
        ours, theirs = model.get_submodule(name), ref.get_submodule(name)
        assert isinstance(ours, Int8Experts) and report.converted[name] == "Int8Experts(E=4, channel)"
        assert torch.equal(ours.gate_up.float() * ours.gate_up_scale[..., None], theirs.gate_up_proj)
        assert torch.equal(ours.down.float() * ours.down_scale[..., None], theirs.down_proj)
    assert report.unused_keys == [] and report.missing_keys == []
    with torch.no_grad():
        out, want = model(IDS).logits.double(), ref(IDS).logits.double()
    # the dense reference does not quantize activations: W8A8's per-token rounding is the whole difference
    assert (out - want).abs().max() <= 5e-2 * want.abs().max()


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_save_quantized_writes_int8_experts_per_expert_and_reloads_them(tmp_path, arch):
    import json

    from safetensors import safe_open

    import hf_writers as W
    import torch_lowbit
    from torch_lowbit.nn import Int8Experts
    model = torch_lowbit.quantize_(W.tiny_model(arch), torch_lowbit.Int8Dynamic())
    torch_lowbit.save_quantized(model, tmp_path)
    leaf = "block_sparse_moe.experts.3.w1" if arch == "mixtral" else "mlp.experts.3.gate_proj"
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        w, s = f.get_tensor(f"model.layers.1.{leaf}.weight"), f.get_tensor(f"model.layers.1.{leaf}.weight_scale")
    experts = model.model.layers[1].mlp.experts
    assert torch.equal(w, experts.gate_up[3, :112]) and torch.equal(s, experts.gate_up_scale[3, :112, None])
    groups = json.loads((tmp_path / "config.json").read_text())["quantization_config"]["config_groups"]
    assert [g["weights"]["type"] for g in groups.values()] == ["int"]  # one int-quantized W8A8 scheme
    back = torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32)
    assert isinstance(back.model.layers[1].mlp.experts, Int8Experts)
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, model(IDS).logits)


# ---- dequantize_model: fused fp8 experts become dense experts
@pytest.mark.parametrize("granularity, block", [("tensor", None), ("channel", None), ("block", (32, 16))])
def test_dequantize_is_fp8_times_scale_rounded_once(granularity, block):
    from torch_lowbit.dequantize import DenseSwiGLUExperts
    layer, gu, down = _layer(3, 40, 24, granularity, block, seed=4)  # 48 rows, 40 columns: partial blocks
    for dtype in (torch.float32, torch.bfloat16):
        got_gu, got_down = layer.dequantize(dtype)
        assert got_gu.dtype == dtype and torch.equal(got_gu, gu.to(dtype)) and torch.equal(got_down, down.to(dtype))
    dense = torch_lowbit.dequantize_model(torch.nn.Sequential(layer), dtype=torch.float32)[0]
    assert type(dense) is DenseSwiGLUExperts and torch.equal(dense.down_proj, down.float())
    ids, w = _routing(7, 2, 3, seed=2, skip_frac=0.2)
    x = torch.randn(7, 40)
    with torch.no_grad():
        out = dense(x, ids, w).double()
    want = ref_experts(x, ids, w, gu, down)
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()
    empty = Fp8Experts(0, 40, 24)
    assert [tuple(t.shape) for t in empty.dequantize(torch.float32)] == [(0, 48, 40), (0, 40, 24)]


def test_dequantize_model_gives_back_the_models_own_dense_fp8_experts():
    import hf_writers as W
    from test_quantize import MOE_IDS
    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Fp8WeightOnly())
    copy_ = torch_lowbit.dequantize_model(model, dtype=torch.float32)
    fqn = "model.layers.0.mlp.experts"
    got, layer = copy_.get_submodule(fqn), model.get_submodule(fqn)
    assert type(got) is type(W.tiny_model("qwen3_moe").get_submodule(fqn)) and isinstance(layer, Fp8Experts)
    assert torch.equal(got.gate_up_proj.double(), _dequant(layer.gate_up.view(torch.uint8),
                                                           layer.gate_up_scale.reshape(layer.num_experts, -1),
                                                           None).float().double())
    assert not any(isinstance(m, Fp8Experts) for m in copy_.modules())
    with torch.no_grad():
        out, want = copy_(MOE_IDS).logits, model(MOE_IDS).logits
    assert (out - want).abs().max() <= 1e-5 * want.abs().max()  # W8A16: the dequantized model up to fp32 sums


def test_dequantize_model_gives_back_the_models_own_dense_int8_experts():
    # W8A8 experts had no dense counterpart: dequantize_model kept them int8 in the "dense" copy, and a transformers
    # model's dequantize() left them int8 under a config that no longer said so
    import hf_writers as W
    from test_quantize import MOE_IDS
    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Int8Dynamic())
    fqn = "model.layers.0.mlp.experts"
    layer = model.get_submodule(fqn)
    assert isinstance(layer, Int8Experts)
    want_gu = layer.gate_up.double() * layer.gate_up_scale.double()[..., None]
    want_down = layer.down.double() * layer.down_scale.double()[..., None]
    got_gu, got_down = layer.dequantize(torch.float64)
    assert torch.equal(got_gu, want_gu) and torch.equal(got_down, want_down)
    copy_ = torch_lowbit.dequantize_model(model, dtype=torch.float32)
    got = copy_.get_submodule(fqn)
    assert type(got) is type(W.tiny_model("qwen3_moe").get_submodule(fqn))
    assert torch.equal(got.gate_up_proj, want_gu.float()) and torch.equal(got.down_proj, want_down.float())
    assert not any(isinstance(m, (Int8Experts, Int8Linear)) for m in copy_.modules())
    with torch.no_grad():  # W8A8 against its dequantized weights: the activations' rounding apart
        out, want = model(MOE_IDS).logits, copy_(MOE_IDS).logits
    assert (out - want).abs().max() <= 0.05 * want.abs().max()
    torch_lowbit.dequantize_(model, dtype=torch.float32)
    assert torch.equal(model.get_submodule(fqn).gate_up_proj, want_gu.float())
