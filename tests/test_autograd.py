"""Gradients through the low-bit layers: fp8_mm / fp8_grouped_mm / Int8Linear (straight through) / Fp8Experts /
w4_mm / w4_grouped_mm / W4Experts vs float64 references on the dequantized weights, on cpu and through the
emulator; frozen weights refused; opcheck's autograd tests; a compiled training step; activation checkpointing."""
import math
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.library import opcheck

import torch_lowbit
from conftest import backends_for
from reference import (assert_matmul_close, fp8_weight_f64, random_fp8_bits, ref_fp8_grouped_mm_t, ref_matmul_t,
                       w4_weight_f64)
from test_fp8_mm import make_scale
from test_w4_cpu_kernels import transposed_weight
from torch_lowbit.nn import Fp8Linear, Int8Linear
from torch_lowbit.nn.experts import Fp8Experts

ACC_RTOL = 1e-5


def rows(t):
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


@pytest.mark.parametrize("backend", backends_for("fp8_mm"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block_16x32", "block_3x7"])
@pytest.mark.parametrize("M", [1, 11])
def test_fp8_mm_grad_x_and_bias(backend, dtype, layout, M):
    N, K = 37, 70
    g = torch.Generator().manual_seed(M + len(layout))
    bits = random_fp8_bits((N, K), g)
    scale, block = make_scale(layout, N, K, g)
    x = torch.randn(2, M, K, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(N, generator=g).to(dtype).requires_grad_()
    go = torch.randn(2, M, N, generator=g).to(dtype)
    out = backend.op("fp8_mm")(x, bits, scale, bias, block)
    out.backward(go)
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    w64 = backend.transposed_weight(fp8_weight_f64(bits, scale, block), rows(go).shape[0], dtype)
    ref, absref = ref_matmul_t(rows(go), w64)
    assert_matmul_close(rows(x.grad), ref, absref, acc_rtol=ACC_RTOL)
    gb = go.double().sum((0, 1))
    assert_matmul_close(bias.grad, gb, go.double().abs().sum((0, 1)), acc_rtol=ACC_RTOL)


def test_layers_before_a_low_bit_layer_get_gradients():
    # the example: the layer before an Fp8Linear used to get no gradient (only a warning)
    torch.manual_seed(0)
    pre = nn.Linear(16, 64)
    layer = Fp8Linear.from_float(nn.Linear(64, 40), "channel")
    x = torch.randn(5, 16)
    layer(pre(x)).sum().backward()
    w64 = fp8_weight_f64(layer.weight.view(torch.uint8), layer.weight_scale).to(torch.float64)
    h_grad = torch.ones(5, 40, dtype=torch.float64) @ w64  # d sum / d pre(x)
    ref = h_grad.T @ x.double()
    torch.testing.assert_close(pre.weight.grad.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pre.bias.grad.double(), h_grad.sum(0), rtol=1e-5, atol=1e-5)


def _int8_linear_on(backend):
    from torch_lowbit._autograd import int8_linear
    ns = "lowbit_emu" if backend.is_metal else "lowbit"
    return lambda x, wq, ws, b: int8_linear(x, wq, ws, b, ns)


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 9])
def test_int8_linear_straight_through(backend, dtype, M):
    N, K = 37, 70
    g = torch.Generator().manual_seed(M)
    wq = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    ws = torch.rand(N, generator=g) / 50
    x = torch.randn(M, K, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(N, generator=g).to(dtype).requires_grad_()
    go = torch.randn(M, N, generator=g).to(dtype)
    out = _int8_linear_on(backend)(x, wq, ws, bias)
    q, s = backend.op("int8_quantize")(x.detach())
    assert torch.equal(out.detach(), backend.op("int8_mm")(q, s, wq, ws, bias.detach(), dtype))  # the same forward
    out.backward(go)
    ref, absref = ref_matmul_t(go, backend.transposed_weight(wq.double() * ws.double()[:, None], M, dtype))
    assert_matmul_close(x.grad, ref, absref, acc_rtol=ACC_RTOL)
    assert_matmul_close(bias.grad, go.double().sum(0), go.double().abs().sum(0), acc_rtol=ACC_RTOL)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode", "nothing_requires_grad"])
def test_int8_linear_without_gradient_skips_the_autograd_function(monkeypatch, mode):
    # torch's Function.apply binds default arguments through inspect.signature on every call: in decode, where no
    # gradient is needed, that cost several times the op pair itself. Such calls run the ops directly.
    from torch_lowbit import _autograd

    def refuse(*args):
        raise AssertionError("int8_linear went through the autograd.Function")

    monkeypatch.setattr(_autograd._Int8Linear, "apply", refuse)
    g = torch.Generator().manual_seed(5)
    wq = torch.randint(-128, 128, (6, 40), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(6, generator=g) / 50, torch.randn(6, generator=g)
    x = torch.randn(3, 40, generator=g).bfloat16()
    q, s = torch.ops.lowbit.int8_quantize(x)
    want = torch.ops.lowbit.int8_mm(q, s, wq, ws, bias, torch.bfloat16)
    if mode == "nothing_requires_grad":
        out = _autograd.int8_linear(x, wq, ws, bias)
    else:
        with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
            out = _autograd.int8_linear(x.requires_grad_(), wq, ws, bias)
    assert torch.equal(out, want)
    # a gradient wanted through any argument still takes the Function (which records, or refuses w_scale)
    for args in ((x.detach().requires_grad_(), wq, ws, bias), (x.detach(), wq, ws, bias.requires_grad_()),
                 (x.detach(), wq, ws.requires_grad_(), None)):
        with pytest.raises(AssertionError, match="went through"):
            _autograd.int8_linear(*args)


def test_int8_layer_trains_through_int8_linear():
    torch.manual_seed(1)
    layer = Int8Linear.from_float(nn.Linear(48, 20))
    x = torch.randn(3, 48, requires_grad=True)
    layer(x).sum().backward()
    ref = torch.ones(3, 20, dtype=torch.float64) @ (layer.weight.double() * layer.weight_scale.double()[:, None])
    torch.testing.assert_close(x.grad.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch_lowbit.emulator.available(), reason="the Metal emulator is not built in this install")
@pytest.mark.parametrize("M", [1, 11])
def test_emulator_backward_runs_the_metal_transposed_kernels(M):
    # the emulator's backward multiplies through its own fp8_mm_t (the Metal kernels), not the CPU kernel
    from torch_lowbit._autograd import _transposed
    for name in ("fp8_mm_t", "fp8_grouped_mm_t", "int8_weight_mm_t"):
        assert _transposed("lowbit_emu", name)._qualified_op_name == f"lowbit_emu::{name}"
    g = torch.Generator().manual_seed(M)
    N, K = 37, 70
    bits = random_fp8_bits((N, K), g)
    scale, block = make_scale("block_16x32", N, K, g)
    x = torch.randn(M, K, generator=g).requires_grad_()
    go = torch.randn(M, N, generator=g)
    torch.ops.lowbit_emu.fp8_mm(x, bits, scale, None, block).backward(go)
    assert torch.equal(x.grad, torch.ops.lowbit_emu.fp8_mm_t(go, bits, scale, block))
    ref, absref = ref_matmul_t(go, fp8_weight_f64(bits, scale, block))
    assert_matmul_close(x.grad, ref, absref, acc_rtol=ACC_RTOL)


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_fp8_grouped_mm_grad_x(backend, layout):
    g = torch.Generator().manual_seed(len(layout))
    E, N, K, T = 3, 40, 72, 22
    offsets = torch.tensor([0, 1, 1, 13, 17], dtype=torch.int32)
    ids = torch.tensor([2, 0, 1, -1], dtype=torch.int32)
    bits = random_fp8_bits((E, N, K), g)
    block = [16, 32] if layout == "block" else None
    scale = torch.rand(E, 3, 3, generator=g) + 0.5 if block else torch.rand(E, N, generator=g) + 0.5
    x = torch.randn(T, K, generator=g).requires_grad_()
    go = torch.randn(T, N, generator=g)
    backend.op("fp8_grouped_mm")(x, bits, scale, offsets, ids, block).backward(go)
    ref, absref = ref_fp8_grouped_mm_t(go, bits, scale, offsets, ids, block)
    assert_matmul_close(x.grad, ref, absref, acc_rtol=ACC_RTOL)
    assert (x.grad[13:] == 0).all()


def _experts_f64(x, ids, weights, gu, down):
    """Differentiable float64 experts, token by token and slot by slot."""
    I = down.shape[2]
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e >= 0:
                h = gu[e] @ x[t]
                acc = acc + weights[t, j] * (down[e] @ (F.silu(h[:I]) * h[I:]))
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_experts_grads_for_hidden_and_routing_weights(granularity):
    torch.manual_seed(2)
    E, H, I, T, k = 4, 40, 24, 9, 2
    ex = Fp8Experts.from_float(torch.randn(E, 2 * I, H) / 6, torch.randn(E, H, I) / 5, granularity, (16, 16))
    hidden = torch.randn(T, H, requires_grad=True)
    ids = torch.randint(0, E - 1, (T, k))  # expert E - 1 idle
    ids[3, 1] = -1  # a skipped slot
    weights = torch.rand(T, k, requires_grad=True)
    go = torch.randn(T, H)
    ex(hidden, ids, weights).backward(go)

    def deq(w, s):
        return torch.stack([fp8_weight_f64(w[e].view(torch.uint8), s[e], ex.block_size if s.dim() == 3 else None)
                            for e in range(E)])
    h64 = hidden.detach().double().requires_grad_()
    w64 = weights.detach().double().requires_grad_()
    _experts_f64(h64, ids, w64, deq(ex.gate_up, ex.gate_up_scale), deq(ex.down, ex.down_scale)).backward(go.double())
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(weights.grad.double(), w64.grad, rtol=1e-4, atol=1e-4)
    assert weights.grad[3, 1] == 0


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
def test_frozen_weights_and_scales_refuse_gradients(backend):
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.zeros(4, 8, dtype=torch.float8_e4m3fn)
    s = torch.ones(4)
    for name, args in (("weight", (w.clone().requires_grad_(), s)), ("scale", (w, s.clone().requires_grad_()))):
        out = backend.op("fp8_mm")(x, *args)
        with pytest.raises(RuntimeError, match=f"fp8_mm: {name} requires grad, but low-bit weights .* frozen"):
            out.sum().backward()
    experts_w = torch.zeros(2, 4, 8, dtype=torch.float8_e4m3fn)
    out = backend.op("fp8_grouped_mm")(x, experts_w, torch.ones(2, requires_grad=True),
                                       torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="fp8_grouped_mm: scale requires grad"):
        out.sum().backward()
    out = _int8_linear_on(backend)(x, torch.zeros(4, 8, dtype=torch.int8), torch.ones(4, requires_grad=True), None)
    with pytest.raises(RuntimeError, match="int8_linear: w_scale requires grad"):
        out.sum().backward()


def test_int8_ops_alone_are_not_differentiable_and_say_so():
    x = torch.randn(3, 8, requires_grad=True)
    q, s = torch_lowbit.int8_quantize(x)
    out = torch_lowbit.int8_mm(q, s, torch.ones(4, 8, dtype=torch.int8), torch.ones(4), out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="x_scale requires grad.*torch_lowbit.int8_linear"):
        out.sum().backward()
    with pytest.raises(RuntimeError, match="int8_quantize is not differentiable.*int8_linear"):
        s.sum().backward()


def _python_frames(fn):
    """The files of the Python functions that run during fn()."""
    files = set()

    def profile(frame, event, arg):
        if event == "call":
            files.add(frame.f_code.co_filename.replace("\\", "/"))
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return files


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
def test_calls_without_gradients_stay_in_cpp(backend):
    # the ops' Autograd kernel (csrc/autograd.h) goes to Python only when a gradient is needed: a Python autograd
    # kernel (torch.library.register_autograd) made every inference call cross into Python and back
    g = torch.Generator().manual_seed(5)
    fp8_mm, int8_mm, int8_quantize = (backend.op(n) for n in ("fp8_mm", "int8_mm", "int8_quantize"))
    x = backend.to(torch.randn(3, 40, generator=g))
    bits, scale = backend.to(_bits(16, 40)), backend.to(torch.rand(16, generator=g))
    wq = backend.to(torch.randint(-127, 128, (16, 40), dtype=torch.int8, generator=g))
    autograd_files = ("torch_lowbit/_autograd.py", "torch/_library/autograd.py")

    def grad_python(files):
        return {f for f in files if f.endswith(autograd_files)}

    def inference():
        fp8_mm(x, bits, scale, None, None)
        int8_mm(*int8_quantize(x), wq, scale, None, torch.float32)
    assert not grad_python(_python_frames(inference))
    xg = x.clone().requires_grad_()
    with torch.no_grad():
        assert not grad_python(_python_frames(lambda: fp8_mm(xg, bits, scale, None, None)))
    out = []
    assert grad_python(_python_frames(lambda: out.append(fp8_mm(xg, bits, scale, None, None))))
    assert out[0].grad_fn is not None
    with pytest.raises(RuntimeError, match=r"\(40\).*\(39\)|\(39\).*\(40\)"):  # the message comes through whole
        fp8_mm(xg, bits[:, :39].contiguous(), scale, None, None)


def _bits(*shape):
    return random_fp8_bits(shape, torch.Generator().manual_seed(sum(shape)))


@pytest.mark.parametrize("op,args", [
    ("fp8_mm", lambda: (torch.randn(3, 40, requires_grad=True), _bits(16, 40), torch.rand(16),
                        torch.randn(16, requires_grad=True), None)),
    ("fp8_mm", lambda: (torch.randn(2, 40, requires_grad=True), _bits(16, 40), torch.rand(2, 3), None, [8, 16])),
    ("fp8_grouped_mm", lambda: (torch.randn(7, 40, requires_grad=True), _bits(3, 16, 40), torch.rand(3),
                                torch.tensor([0, 2, 2, 6], dtype=torch.int32),
                                torch.tensor([1, -1, 0], dtype=torch.int32), None)),
    ("int8_mm", lambda: (torch.randint(-127, 128, (3, 40), dtype=torch.int8), torch.rand(3),
                         torch.randint(-127, 128, (16, 40), dtype=torch.int8), torch.rand(16),
                         torch.randn(16, requires_grad=True), torch.float32)),
    ("fp8_mm_t", lambda: (torch.randn(3, 16), _bits(16, 40), torch.rand(16), None)),
    ("fp8_grouped_mm_t", lambda: (torch.randn(7, 16), _bits(3, 16, 40), torch.rand(3, 16),
                                  torch.tensor([0, 2, 2, 6], dtype=torch.int32), None, None)),
    ("int8_weight_mm_t", lambda: (torch.randn(3, 16), torch.randint(-127, 128, (16, 40), dtype=torch.int8),
                                  torch.rand(16))),
    ("w4_mm", lambda: (torch.randn(3, 41, requires_grad=True), *_w4(16, 41, "int4_zp"),
                       torch.randn(16, requires_grad=True))),
    ("w4_mm_t", lambda: (torch.randn(3, 16, requires_grad=True), *_w4(16, 41, "nvfp4")[:4], 41,
                         *_w4(16, 41, "nvfp4")[4:])),
    ("w4_grouped_mm", lambda: (torch.randn(22, 71, requires_grad=True), *_w4_experts(3, 16, 71, "int4_zp")[:4],
                               *_GROUPS, *_w4_experts(3, 16, 71, "int4_zp")[4:])),
    ("w4_grouped_mm_t", lambda: (torch.randn(22, 16, requires_grad=True), *_w4_experts(3, 16, 71, "nvfp4")[:4], 71,
                                 *_GROUPS, *_w4_experts(3, 16, 71, "nvfp4")[4:])),
])
def test_opcheck_with_gradients(op, args):
    opcheck(getattr(torch.ops.lowbit, op).default, args())


class _Block(nn.Module):
    """Frozen low-bit layers around a trainable one (what LoRA adds), gated MLP shaped."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.gate = Fp8Linear.from_float(nn.Linear(40, 52, bias=False), "block", (16, 16))
        self.up = Int8Linear.from_float(nn.Linear(40, 52))
        self.adapter = nn.Linear(52, 52)
        self.down = Fp8Linear.from_float(nn.Linear(52, 40), "channel")

    def forward(self, x):
        return x + self.down(self.adapter(F.silu(self.gate(x)) * self.up(x)))


def _train_steps(model, step, n=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(n):
        x = torch.randn(2, 5 + i, 40, generator=torch.Generator().manual_seed(i))
        losses.append(step(model, opt, x))
    return losses, [p.detach().clone() for p in model.parameters()]


def test_compiled_training_step_matches_eager():
    torch._dynamo.reset()

    def step(model, opt, x):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    eager_losses, eager_params = _train_steps(_Block(), step)
    model = _Block()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=True)
    opt_step = None

    def compiled_step(m, opt, x):
        nonlocal opt_step
        # torch's optimizers break the graph on purpose inside step(): fullgraph applies to the model's forward and
        # (AOT autograd) backward graphs; the optimizer step is compiled as torch's docs do it
        opt_step = opt_step or torch.compile(opt.step, backend="aot_eager")
        loss = compiled(x).square().mean()
        loss.backward()
        opt_step()
        opt.zero_grad()
        return float(loss.detach())

    losses, params = _train_steps(model, compiled_step)
    torch.testing.assert_close(losses, eager_losses, rtol=1e-5, atol=1e-6)
    for p, q in zip(params, eager_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_gives_the_same_gradients():
    from torch.utils.checkpoint import checkpoint
    x = torch.randn(2, 6, 40)
    grads = []
    for ckpt in (False, True):
        model = _Block()
        out = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
        out.square().sum().backward()
        # the low-bit layers' biases are frozen parameters (no grad); the adapter's are trained
        grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


# ---- second order: gradients of gradients (gradient penalties, Hessian-vector products)
def _grad_of_grad_norm(forward, x):
    """d/dx |d(|forward(x)|^2)/dx|^2: nonzero only if the backward pass is itself differentiable w.r.t. what it
    multiplies (forward linear in x: 8 x W^T W W^T W)."""
    y = forward(x)
    gx, = torch.autograd.grad(y.double().square().sum(), x, create_graph=True)
    gx.double().square().sum().backward()
    return x.grad


def _assert_second_order_close(forward, forward_f64, x, dtype):
    x = x.to(dtype).requires_grad_()
    got = _grad_of_grad_norm(forward, x).double()
    ref = _grad_of_grad_norm(forward_f64, x.detach().double().requires_grad_())
    assert ref.abs().max() > 0
    # rounding to the activations' dtype at every stage (y, dy, dx, ddx, ...): norm-wise relative error
    rtol = 1e-2 if dtype == torch.bfloat16 else 2e-6
    err = float((got - ref).norm() / ref.norm())
    assert err <= rtol, f"relative error {err:.3g} of d|dx|^2/dx against float64 (rtol {rtol})"


@pytest.mark.parametrize("backend", backends_for("fp8_mm", emu_rev=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["channel", "block_16x32"])
def test_fp8_mm_second_order_gradients_match_float64(backend, dtype, layout):
    N, K = 37, 70
    g = torch.Generator().manual_seed(len(layout))
    bits = random_fp8_bits((N, K), g)
    scale, block = make_scale(layout, N, K, g)
    scale = scale / 64  # keeps |8 x W^T W W^T W| well inside bf16's range
    w64 = fp8_weight_f64(bits, scale, block)
    _assert_second_order_close(lambda x: backend.op("fp8_mm")(x, bits, scale, None, block), lambda x: x @ w64.T,
                               torch.randn(2, 5, K, generator=g), dtype)


@pytest.mark.parametrize("backend", backends_for("fp8_grouped_mm", emu_rev=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_grouped_mm_second_order_gradients_match_float64(backend, dtype):
    g = torch.Generator().manual_seed(7)
    E, N, K, T = 3, 40, 72, 22
    offsets = torch.tensor([0, 1, 1, 13, 17], dtype=torch.int32)
    ids = torch.tensor([2, 0, 1, -1], dtype=torch.int32)
    bits = random_fp8_bits((E, N, K), g)
    scale = (torch.rand(E, N, generator=g) + 0.5) / 64
    # each row's dense weight (zero for rows of expert -1 and rows in no group)
    w_rows = torch.zeros(T, N, K, dtype=torch.float64)
    for grp, e in enumerate(ids.tolist()):
        if e >= 0:
            w_rows[offsets[grp]:offsets[grp + 1]] = fp8_weight_f64(bits[e], scale[e])
    _assert_second_order_close(lambda x: backend.op("fp8_grouped_mm")(x, bits, scale, offsets, ids, None),
                               lambda x: torch.einsum("tnk,tk->tn", w_rows, x), torch.randn(T, K, generator=g), dtype)


@pytest.mark.parametrize("backend", backends_for("int8_mm", emu_rev=False))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_second_order_gradients_match_float64(backend, dtype):
    N, K = 37, 70
    g = torch.Generator().manual_seed(3)
    wq = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    ws = torch.rand(N, generator=g) / 2000
    w64 = wq.double() * ws.double()[:, None]
    linear = _int8_linear_on(backend)

    def straight_through_f64(x):
        # the value int8_linear computes (activations quantized), the derivative of x @ W^T (straight through)
        dense = x @ w64.T
        return dense + (linear(x.detach().to(dtype), wq, ws, None).double() - dense).detach()
    _assert_second_order_close(lambda x: linear(x, wq, ws, None), straight_through_f64,
                               torch.randn(6, K, generator=g), dtype)


def test_second_order_gradient_through_frozen_scale_is_refused():
    w = torch.ones(4, 8, dtype=torch.float8_e4m3fn)
    gx = torch.ops.lowbit.fp8_mm_t(torch.ones(3, 4), w, torch.ones(4, requires_grad=True), None)
    with pytest.raises(RuntimeError, match="fp8_mm_t: scale requires grad"):
        gx.sum().backward()
    gx = torch.ops.lowbit.int8_weight_mm_t(torch.ones(3, 4), w.view(torch.int8), torch.ones(4, requires_grad=True))
    with pytest.raises(RuntimeError, match="int8_weight_mm_t: w_scale requires grad"):
        gx.sum().backward()


# ---- 4-bit weights (w4_mm): the same contract
def _w4(N, K, kind, seed=0):
    """(codes, scale, format, group_size, offset, global_scale) of a random 4-bit weight."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, (K + 1) // 2), dtype=torch.uint8, generator=g)
    if kind == "nvfp4":
        scale = torch.randint(0x20, 0x40, (N, -(-K // 16)), dtype=torch.uint8, generator=g)
        return codes, scale, "nvfp4", 16, None, torch.tensor([0.02])
    scale = (torch.rand(N, -(-K // 16), generator=g) / 40).to(torch.bfloat16)
    return codes, scale, "int4", 16, torch.randint(-8, 8, scale.shape, dtype=torch.int8, generator=g), None


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nvfp4", "int4_zp"])
@pytest.mark.parametrize("M", [1, 11])
def test_w4_mm_grad_x_and_bias(backend, dtype, kind, M):
    N, K = 37, 70
    codes, scale, fmt, gs, offset, glob = _w4(N, K, kind, M)
    g = torch.Generator().manual_seed(M)
    x = torch.randn(2, M, K, generator=g).to(dtype).requires_grad_()
    bias = torch.randn(N, generator=g).to(dtype).requires_grad_()
    go = torch.randn(2, M, N, generator=g).to(dtype)
    backend.op("w4_mm")(x, codes, scale, fmt, gs, offset, glob, bias).backward(go)
    assert x.grad.shape == x.shape and x.grad.dtype == dtype
    # the CPU's GEMM regime may multiply by the bf16-dequantized weight (test_w4_cpu_kernels.transposed_weight)
    w64 = (transposed_weight(fmt, codes, scale, gs, K, offset, glob, 2 * M, dtype) if backend.name == "cpu"
           else w4_weight_f64(fmt, codes, scale, gs, K, offset, glob))
    ref, absref = ref_matmul_t(rows(go), w64)
    assert_matmul_close(rows(x.grad), ref, absref, acc_rtol=ACC_RTOL)
    assert_matmul_close(bias.grad, go.double().sum((0, 1)), go.double().abs().sum((0, 1)), acc_rtol=ACC_RTOL)


@pytest.mark.parametrize("backend", backends_for("w4_mm"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nvfp4", "int4_zp"])
def test_w4_mm_second_order_gradients_match_float64(backend, dtype, kind):
    N, K = 37, 70
    codes, scale, fmt, gs, offset, glob = _w4(N, K, kind, 5)
    w64 = w4_weight_f64(fmt, codes, scale, gs, K, offset, glob)
    _assert_second_order_close(lambda x: backend.op("w4_mm")(x, codes, scale, fmt, gs, offset, glob),
                               lambda x: x @ w64.T, torch.randn(2, 5, K, generator=torch.Generator().manual_seed(1)),
                               dtype)


def test_w4_mm_frozen_codes_scales_and_offsets_refuse_gradients():
    x = torch.randn(3, 32, requires_grad=True)
    codes, scale, fmt, gs, offset, _ = _w4(4, 32, "int4_zp")
    for name, args in (("scale", (codes, scale.float().requires_grad_(), fmt, gs, offset)),
                       ("offset", (codes, scale.float(), "uint4", gs, torch.zeros(4, 2, requires_grad=True)))):
        out = torch.ops.lowbit.w4_mm(x, *args)
        with pytest.raises(RuntimeError, match=f"w4_mm: {name} requires grad, but low-bit weights .* frozen"):
            out.sum().backward()
    nv = _w4(4, 32, "nvfp4")
    out = torch.ops.lowbit.w4_mm(x, *nv[:5], torch.tensor([0.5], requires_grad=True))
    with pytest.raises(RuntimeError, match="w4_mm: global_scale requires grad"):
        out.sum().backward()
    gx = torch.ops.lowbit.w4_mm_t(torch.ones(3, 4), codes, scale.float().requires_grad_(), fmt, gs, 32, offset)
    with pytest.raises(RuntimeError, match="w4_mm_t: scale requires grad"):
        gx.sum().backward()


def test_w4_layer_trains_the_layer_before_it():
    from torch_lowbit.nn import W4Linear
    torch.manual_seed(0)
    pre = nn.Linear(16, 64)
    layer = W4Linear.from_float(nn.Linear(64, 40), "int4", 32, symmetric=False)
    x = torch.randn(5, 16)
    layer(pre(x)).sum().backward()
    w64 = w4_weight_f64("int4", layer.weight_packed, layer.weight_scale, 32, 64, layer.weight_offset)
    h_grad = torch.ones(5, 40, dtype=torch.float64) @ w64
    torch.testing.assert_close(pre.weight.grad.double(), h_grad.T @ x.double(), rtol=1e-5, atol=1e-5)


# ---- 4-bit grouped (MoE) weights: w4_grouped_mm, W4Experts
def _w4_experts(E, N, K, kind, seed=0):
    """_w4 per expert, stacked: (codes, scale, format, group_size, offset, global_scale [E] (nvfp4, one each))."""
    parts = [_w4(N, K, kind, seed + e) for e in range(E)]
    codes, scale, fmt, gs, offset, glob = parts[0]
    stack = [torch.stack([p[i] for p in parts]) for i in (0, 1)]
    offset = None if offset is None else torch.stack([p[4] for p in parts])
    glob = None if glob is None else torch.tensor([0.02 * (1 + e) for e in range(E)])
    return stack[0], stack[1], fmt, gs, offset, glob


_GROUPS = (torch.tensor([0, 1, 1, 13, 17], dtype=torch.int32), torch.tensor([2, 0, 1, -1], dtype=torch.int32))


def _w4_grouped_ref_t(backend, go, codes, scale, fmt, gs, K, offset, glob):
    from reference import _grouped
    offsets, ids = _GROUPS

    def weight(rows, e):  # the CPU's GEMM regime may multiply by the bf16-dequantized weight
        args = (fmt, codes[e], scale[e], gs, K, None if offset is None else offset[e], None if glob is None else glob[e])
        if backend.name == "cpu":
            return transposed_weight(*args, rows.shape[0], go.dtype)
        return w4_weight_f64(*args)
    return _grouped(go, offsets, ids, K, lambda rows, e: ref_matmul_t(rows, weight(rows, e)))


@pytest.mark.parametrize("backend", backends_for("w4_grouped_mm"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["nvfp4", "int4_zp"])
def test_w4_grouped_mm_grad_x(backend, dtype, kind):
    E, N, K, T = 3, 40, 71, 22
    codes, scale, fmt, gs, offset, glob = _w4_experts(E, N, K, kind)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, K, generator=g).to(dtype).requires_grad_()
    go = torch.randn(T, N, generator=g).to(dtype)
    backend.op("w4_grouped_mm")(x, codes, scale, fmt, gs, *_GROUPS, offset, glob).backward(go)
    assert x.grad.dtype == dtype
    ref, absref = _w4_grouped_ref_t(backend, go, codes, scale, fmt, gs, K, offset, glob)
    assert_matmul_close(x.grad, ref, absref, acc_rtol=ACC_RTOL)
    assert (x.grad[13:] == 0).all() and (x.grad[1:13] != 0).any()  # rows of expert -1 and in no group: zero


@pytest.mark.parametrize("backend", backends_for("w4_grouped_mm"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4_grouped_mm_second_order_gradients_match_float64(backend, dtype):
    E, N, K, T = 3, 40, 71, 22
    codes, scale, fmt, gs, offset, glob = _w4_experts(E, N, K, "nvfp4", seed=9)
    offsets, ids = _GROUPS
    w_rows = torch.zeros(T, N, K, dtype=torch.float64)
    for grp, e in enumerate(ids.tolist()):
        if e >= 0:
            w_rows[offsets[grp]:offsets[grp + 1]] = w4_weight_f64(fmt, codes[e], scale[e], gs, K, None, glob[e])
    _assert_second_order_close(lambda x: backend.op("w4_grouped_mm")(x, codes, scale, fmt, gs, offsets, ids, None,
                                                                     glob),
                               lambda x: torch.einsum("tnk,tk->tn", w_rows, x),
                               torch.randn(T, K, generator=torch.Generator().manual_seed(2)), dtype)


def test_w4_grouped_mm_frozen_codes_scales_and_offsets_refuse_gradients():
    x = torch.randn(3, 32, requires_grad=True)
    codes, scale, fmt, gs, offset, _ = _w4_experts(2, 4, 32, "int4_zp")
    groups = (torch.tensor([0, 2, 3], dtype=torch.int32), None)
    for name, args in (("scale", (codes, scale.float().requires_grad_(), fmt, gs, *groups, offset)),
                       ("offset", (codes, scale.float(), "uint4", gs, *groups,
                                   torch.zeros(2, 4, 2, requires_grad=True)))):
        out = torch.ops.lowbit.w4_grouped_mm(x, *args)
        with pytest.raises(RuntimeError, match=f"w4_grouped_mm: {name} requires grad, but low-bit weights .* frozen"):
            out.sum().backward()
    nv = _w4_experts(2, 4, 32, "nvfp4")
    out = torch.ops.lowbit.w4_grouped_mm(x, *nv[:4], *groups, None, torch.tensor([0.5, 1.0], requires_grad=True))
    with pytest.raises(RuntimeError, match="w4_grouped_mm: global_scale requires grad"):
        out.sum().backward()
    gx = torch.ops.lowbit.w4_grouped_mm_t(torch.ones(3, 4), codes, scale.float().requires_grad_(), fmt, gs, 32,
                                          *groups, offset)
    with pytest.raises(RuntimeError, match="w4_grouped_mm_t: scale requires grad"):
        gx.sum().backward()


@pytest.mark.parametrize("fmt,gs,kw", [("nvfp4", 16, {}), ("int4", 16, {"symmetric": False})])
def test_w4_experts_grads_for_hidden_and_routing_weights(fmt, gs, kw):
    from torch_lowbit.nn import W4Experts
    torch.manual_seed(2)
    E, H, I, T, k = 4, 41, 24, 9, 2
    ex = W4Experts.from_float(torch.randn(E, 2 * I, H) / 6, torch.randn(E, H, I) / 5, fmt, gs, **kw)
    hidden = torch.randn(T, H, requires_grad=True)
    ids = torch.randint(0, E - 1, (T, k))  # expert E - 1 idle
    ids[3, 1] = -1  # a skipped slot
    weights = torch.rand(T, k, requires_grad=True)
    go = torch.randn(T, H)
    ex(hidden, ids, weights).backward(go)

    def deq(p, K):
        t = [getattr(ex, f"{p}_{s}") for s in ("packed", "scale", "offset", "scale_2")]
        return torch.stack([w4_weight_f64(fmt, t[0][e], t[1][e], gs, K, *(None if v is None else v[e] for v in t[2:]))
                            for e in range(E)])
    h64 = hidden.detach().double().requires_grad_()
    w64 = weights.detach().double().requires_grad_()
    _experts_f64(h64, ids, w64, deq("gate_up", H), deq("down", I)).backward(go.double())
    torch.testing.assert_close(hidden.grad.double(), h64.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(weights.grad.double(), w64.grad, rtol=1e-4, atol=1e-4)
    assert weights.grad[3, 1] == 0 and hidden.grad.abs().max() > 0
