"""The low-bit matmuls under torch.autocast behave as F.linear does there: floating activations and bias cast to
autocast's dtype, the product in it, weights and scales untouched (the result equals the op on explicitly cast
inputs, bit for bit), gradients back to the uncast fp32 input; outside autocast nothing changes. Every op in both
namespaces (cpu kernels and the emulator), the layers (the W8A8 and fp8-activation paths included), fused experts,
a LoRA training step of a quantized transformers model under autocast, and the layers under torch.compile. The mps cases run
on a Mac."""
import pytest
import torch
import torch.nn as nn

import torch_lowbit
from torch_lowbit.nn import Fp8Experts, Fp8Linear, Int8Linear, W4Experts, W4Linear

AUTOCAST_DTYPES = [torch.bfloat16, torch.float16]
HAS_MPS = torch.backends.mps.is_available()


def _namespaces():
    out = ["lowbit"]
    if torch_lowbit.emulator.available():
        out.append("lowbit_emu")
    return out


def _x(T, K, seed=0):
    return torch.randn(T, K, generator=torch.Generator().manual_seed(seed))


def _linear(K=40, N=24):
    torch.manual_seed(0)
    lin = nn.Linear(K, N)
    with torch.no_grad():
        lin.bias.normal_(0, 0.1)
    return lin


def _op_cases():
    """name -> (args of the op with fp32 x (and fp32 bias where the op takes one), the positions of x and bias)."""
    fp8 = Fp8Linear.from_float(_linear(), "block", (16, 32))
    w4 = W4Linear.from_float(_linear(), "uint4", 16)
    g = torch.Generator().manual_seed(1)
    gu, dn = torch.randn(3, 48, 40, generator=g) * 0.1, torch.randn(3, 40, 24, generator=g) * 0.1
    f8e = Fp8Experts.from_float(gu, dn)
    w4e = W4Experts.from_float(gu, dn, "nvfp4")
    offsets, ids = torch.tensor([0, 2, 2, 7], dtype=torch.int32), torch.tensor([2, 0, 1], dtype=torch.int32)
    x = _x(7, 40)
    return {
        "fp8_mm": ((x, fp8.weight, fp8.weight_scale, fp8.bias, [16, 32]), (0, 3)),
        "w4_mm": ((x, w4.weight_packed, w4.weight_scale, "uint4", 16, w4.weight_offset, None, w4.bias), (0, 7)),
        "fp8_grouped_mm": ((x, f8e.gate_up, f8e.gate_up_scale, offsets, ids, None), (0,)),
        "w4_grouped_mm": ((x, w4e.gate_up_packed, w4e.gate_up_scale, "nvfp4", 16, offsets, ids, None,
                           w4e.gate_up_scale_2), (0,)),
    }


OP_CASES = _op_cases()


@pytest.mark.parametrize("ns", _namespaces())
@pytest.mark.parametrize("name", list(OP_CASES))
@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_op_under_autocast_is_the_op_on_cast_inputs(ns, name, dtype):
    args, cast_at = OP_CASES[name]
    op = getattr(getattr(torch.ops, ns), name)
    plain = op(*args)
    assert plain.dtype == torch.float32
    cast = [a.to(dtype) if i in cast_at and a is not None else a for i, a in enumerate(args)]
    want = op(*cast)
    assert want.dtype == dtype
    with torch.autocast("cpu", dtype=dtype):
        got = op(*args)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(op(*args), plain)  # outside autocast again: as before
    # the weights and scales were not cast: the same tensors, same dtypes
    assert all(a is b for i, (a, b) in enumerate(zip(args, OP_CASES[name][0])) if i not in cast_at)


@pytest.mark.parametrize("name", ["fp8_mm", "w4_mm", "fp8_grouped_mm", "w4_grouped_mm"])
def test_gradient_under_autocast_reaches_the_fp32_input(name):
    args, cast_at = OP_CASES[name]
    op = getattr(torch.ops.lowbit, name)
    x = args[0].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = op(x, *args[1:])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    out.backward(g)
    assert x.grad.dtype == torch.float32
    x2 = args[0].clone().requires_grad_(True)
    cast = [x2.to(torch.bfloat16)] + [a.to(torch.bfloat16) if i in cast_at and a is not None else a
                                      for i, a in enumerate(args) if i > 0]
    op(*cast).backward(g)
    assert torch.equal(x.grad, x2.grad)


def _layers():
    fp8_act = Fp8Linear.from_float(_linear())
    fp8_act.set_activation_scheme("dynamic", run=True)
    return {"fp8": Fp8Linear.from_float(_linear()), "fp8-dynamic-activations": fp8_act,
            "int8": Int8Linear.from_float(_linear()), "int4": W4Linear.from_float(_linear(), "int4", 16)}


@pytest.mark.parametrize("kind", list(_layers()))
@pytest.mark.parametrize("dtype", AUTOCAST_DTYPES, ids=str)
def test_layer_under_autocast_gives_what_nn_linear_gives_there(kind, dtype):
    layer = _layers()[kind]
    x = _x(5, 40, seed=2)
    with torch.autocast("cpu", dtype=dtype):
        got = layer(x)
        dense = _linear()(x)
    assert got.dtype == dense.dtype == dtype
    # the same layer on the activations autocast casts, its bias in that dtype too
    layer_cast = _layers()[kind]
    if layer_cast.bias is not None:
        layer_cast.bias = nn.Parameter(layer_cast.bias.to(dtype), requires_grad=False)
    want = layer_cast(x.to(dtype))
    if kind != "fp8-dynamic-activations":  # that one quantizes the uncast x (see the test below)
        assert torch.equal(got, want)
    assert layer(x).dtype == torch.float32


def test_fp8_activation_path_is_not_rounded_again_by_autocast():
    # the fake-quantized activations are fp32 values on the e4m3 grid times the scale: autocast must not round
    # them to bf16 before the product (only the product is given in bf16)
    layer = _layers()["fp8-dynamic-activations"]
    x = _x(5, 40, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    assert torch.equal(got, layer(x).to(torch.bfloat16))


@pytest.mark.parametrize("cls", [Fp8Experts, W4Experts])
def test_experts_under_autocast_run_their_products_in_the_autocast_dtype(cls):
    g = torch.Generator().manual_seed(5)
    gu, dn = torch.randn(3, 48, 40, generator=g) * 0.1, torch.randn(3, 40, 24, generator=g) * 0.1
    layer = cls.from_float(gu, dn)
    x = _x(6, 40, seed=6)
    ids = torch.tensor([[0, 2], [1, 2], [0, 1], [2, 0], [1, 0], [2, 1]])
    w = torch.rand(6, 2, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x, ids, w)
    # as transformers' dense experts under autocast: the products in bf16, the weighted sum back in hidden's dtype
    assert got.dtype == torch.float32
    want = layer(x.to(torch.bfloat16), ids, w).float()
    assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())
    assert not torch.equal(got, layer(x, ids, w))  # the products did change precision


def test_lora_step_of_a_quantized_model_under_autocast():
    peft = pytest.importorskip("peft")
    import hf_writers as W
    model = torch_lowbit.quantize_(W.tiny_model("llama"), torch_lowbit.Nvfp4WeightOnly())
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    outputs = {}
    q_proj = pm.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    q_proj.register_forward_hook(lambda m, i, o: outputs.__setitem__("q", o.dtype))
    ids = torch.randint(0, W.V, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = pm(input_ids=ids, labels=ids).loss
    loss.backward()
    assert outputs["q"] == torch.bfloat16
    grads = [p.grad for n, p in pm.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() and g.dtype == torch.float32 for g in grads)


@pytest.mark.parametrize("kind", list(_layers()))
def test_compiled_layer_under_autocast_equals_eager(kind):
    torch._dynamo.reset()
    layer = _layers()[kind]
    compiled = torch.compile(layer, fullgraph=True)
    x = _x(5, 40, seed=7)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), layer(x)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.skipif(not HAS_MPS, reason="needs an Apple GPU (mps)")
@pytest.mark.parametrize("name", list(OP_CASES))
def test_op_under_mps_autocast_is_the_op_on_cast_inputs(name):
    args, cast_at = OP_CASES[name]
    args = [a.to("mps") if isinstance(a, torch.Tensor) else a for a in args]
    op = getattr(torch.ops.lowbit, name)
    want = op(*[a.to(torch.float16) if i in cast_at and a is not None else a for i, a in enumerate(args)])
    with torch.autocast("mps", dtype=torch.float16):
        got = op(*args)
    assert got.dtype == torch.float16 and torch.equal(got.cpu(), want.cpu())
