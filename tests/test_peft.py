"""LoRA with PEFT on FP8 / INT8 / 4-bit (QLoRA) bases: a tiny transformers Llama (dims not multiples of 128) trains
adapters on cpu and through the emulator; the adapters' gradients match the same LoRA on the dequantized base in
float64; merging is refused, and merging into torch_lowbit.dequantize_model's dense copy matches float64; unmerged
inference works; plain PEFT calls (no torch_lowbit.peft.register) wrap the low-bit layers and reload saved
adapters; bias="all" / "lora_only" train the low-bit layers' biases; LoRA on the attention of a tiny Qwen3-MoE whose
experts are W4Experts (QLoRA on MoE) matches float64 and trains."""
import copy

import pytest
import torch
import torch.nn as nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import torch_lowbit  # noqa: E402
import torch_lowbit.peft as lowbit_peft  # noqa: E402
from reference import layer_weight_f64  # noqa: E402
from torch_lowbit.nn import Fp8Linear, Int8Linear, W4Linear  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_llama(layers=2, biases=False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=40, intermediate_size=72, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   attention_bias=biases, mlp_bias=biases, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    if biases:  # transformers initializes them to zero: random ones give every layer's bias a part in the output
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith(".bias"):
                    p.normal_(0, 0.1)
    return model


def lora(model, **kw):
    config = lowbit_peft.register(peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **kw))
    return peft.get_peft_model(model, config)


def dequantized_copy(quantized):
    """The same model with every Fp8Linear / W4Linear replaced by an nn.Linear holding its dequantized weight
    (float64)."""
    dense = copy.deepcopy(quantized).double()
    for name, m in list(dense.named_modules()):
        for cname, child in list(m.named_children()):
            if isinstance(child, (Fp8Linear, W4Linear)):
                lin = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                dtype=torch.float64)
                with torch.no_grad():
                    lin.weight.copy_(layer_weight_f64(child))
                    if child.bias is not None:
                        lin.bias.copy_(child.bias.double())
                setattr(m, cname, lin)
    return dense


def batch(steps_seed=0, B=2, S=7):
    ids = torch.randint(0, 50, (B, S), generator=torch.Generator().manual_seed(steps_seed))
    return ids


def adapters(model):
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def train(model, steps, params=None):
    opt = torch.optim.AdamW(params or list(adapters(model).values()), lr=3e-2)
    ids = batch()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.fixture
def emulated_layers(monkeypatch):
    """Route Fp8Linear / Int8Linear through torch.ops.lowbit_emu (the Metal kernels in the emulator)."""
    from torch_lowbit import _autograd, _ops
    if not torch_lowbit.emulator.available():
        pytest.skip("the Metal emulator is not built in this install")
    monkeypatch.setattr(_ops, "fp8_mm", lambda x, w, s, b=None, bs=None: torch.ops.lowbit_emu.fp8_mm(
        x, w, s, b, _ops._blocks("fp8_mm", bs)))
    monkeypatch.setattr(_ops, "int8_linear", lambda x, w, s, b=None: _autograd.int8_linear(x, w, s, b, "lowbit_emu"))


@pytest.mark.parametrize("config", [torch_lowbit.Fp8WeightOnly("channel"),
                                    torch_lowbit.Fp8WeightOnly("block", (16, 32)), torch_lowbit.Nvfp4WeightOnly(),
                                    torch_lowbit.Int4WeightOnly(16, symmetric=False),
                                    torch_lowbit.AffineWeightOnly(32)],
                         ids=["fp8-channel", "fp8-block", "nvfp4", "int4-asym", "uint4"])
def test_adapter_gradients_match_dequantized_base_in_float64(config):
    model = tiny_llama()
    torch_lowbit.quantize_(model, config)
    assert isinstance(model.model.layers[0].mlp.down_proj, (Fp8Linear, W4Linear))
    dense = dequantized_copy(model)
    pm, pd = lora(model, init_lora_weights=False), lora(dense, init_lora_weights=False)  # random B: nonzero grads
    with torch.no_grad():
        for (n, p), (nd, q) in zip(adapters(pm).items(), adapters(pd).items()):
            assert n == nd
            q.copy_(p.double())
    assert isinstance(pm.base_model.model.model.layers[0].self_attn.q_proj, lowbit_peft.LowbitLoraLinear)
    ids = batch()
    pm(input_ids=ids, labels=ids).loss.backward()
    pd(input_ids=ids, labels=ids).loss.backward()
    for (n, p), q in zip(adapters(pm).items(), adapters(pd).values()):
        assert p.dtype == torch.float32 and p.grad is not None, n
        # fp32 forward and backward through the whole model vs float64: relative to the gradient's scale
        tol = 1e-4 * float(q.grad.abs().max()) + 1e-7
        assert float((p.grad.double() - q.grad).abs().max()) <= tol, n
    assert all(not p.requires_grad for n, p in pm.named_parameters() if "lora_" not in n)


@pytest.mark.parametrize("config", [torch_lowbit.Fp8WeightOnly("channel"), torch_lowbit.Int8Dynamic(),
                                    torch_lowbit.Mxfp4WeightOnly()])
def test_lora_trains_on_low_bit_base_and_merge_is_refused(config):
    model = tiny_llama()
    torch_lowbit.quantize_(model, config)
    pm = lora(model)
    losses = train(pm, 4)
    assert losses[-1] < 0.9 * losses[0], losses
    ids = batch(1)
    with torch.no_grad():
        out = pm(input_ids=ids).logits
        with pm.disable_adapter():
            base = pm(input_ids=ids).logits
        assert torch.isfinite(out).all() and not torch.equal(out, base)  # unmerged inference, adapters active
    with pytest.raises(ValueError, match="merging a LoRA adapter into a (Fp8|Int8|W4)Linear base is not supported"):
        pm.merge_and_unload()


def test_dora_is_refused():
    model = tiny_llama(1)
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly("channel"))
    with pytest.raises(ValueError, match="DoRA needs the dense base weight"):
        lora(model, use_dora=True)


def test_lora_trains_through_the_emulator(emulated_layers):
    model = tiny_llama(1)
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly("block", (16, 16)))
    losses = train(lora(model), 3)
    assert losses[-1] < losses[0], losses


def trainable(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("bias", ["all", "lora_only"])
@pytest.mark.parametrize("config", [torch_lowbit.Fp8WeightOnly("channel"), torch_lowbit.Int8Dynamic()],
                         ids=["fp8", "int8"])
def test_peft_bias_configs_train_the_low_bit_layers_biases(config, bias):
    dense = tiny_llama(1, biases=True)
    model = copy.deepcopy(dense)
    torch_lowbit.quantize_(model, config)
    pm, pd = lora(model, bias=bias), lora(dense, bias=bias)
    # the same tensors train as on the dense model: the adapters and the targeted layers' biases
    assert list(trainable(pm)) == list(trainable(pd))
    biases = {n: p for n, p in trainable(pm).items() if n.endswith(".bias")}
    assert len(biases) == 7, list(biases)
    # each bias's gradient is the float64 sum of its layer's output gradient over the tokens
    grad_outs = {}

    def keep_grad_out(name):
        def hook(module, args, out):
            out.register_hook(lambda g: grad_outs.__setitem__(name, g.detach().double()))
        return hook
    for name, m in pm.named_modules():
        if isinstance(m, (Fp8Linear, Int8Linear)):
            m.register_forward_hook(keep_grad_out(name))
    ids = batch()
    pm(input_ids=ids, labels=ids).loss.backward()
    for n, p in biases.items():
        go = grad_outs[n.removesuffix(".bias")]
        want, bound = go.sum((0, 1)), go.abs().sum((0, 1))
        assert p.grad is not None and p.grad.dtype == p.dtype, n
        assert ((p.grad.double() - want).abs() <= 1e-6 * bound + 1e-12).all(), n
    before = {n: p.detach().clone() for n, p in biases.items()}
    pm.zero_grad()
    train(pm, 2, list(trainable(pm).values()))
    assert all(not torch.equal(before[n], p) for n, p in biases.items())


def test_peft_bias_all_on_fp8_base_matches_the_dequantized_model_in_float64():
    model = tiny_llama(1, biases=True)
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly("block", (16, 32)))
    dense = dequantized_copy(model)
    pm, pd = lora(model, bias="all", init_lora_weights=False), lora(dense, bias="all", init_lora_weights=False)
    with torch.no_grad():
        for (n, p), (nd, q) in zip(trainable(pm).items(), trainable(pd).items()):
            assert n == nd
            q.copy_(p.double())
    ids = batch()
    pm(input_ids=ids, labels=ids).loss.backward()
    pd(input_ids=ids, labels=ids).loss.backward()
    for (n, p), q in zip(trainable(pm).items(), trainable(pd).values()):
        tol = 1e-4 * float(q.grad.abs().max()) + 1e-7
        assert float((p.grad.double() - q.grad).abs().max()) <= tol, n
    assert sum(n.endswith(".bias") for n in trainable(pm)) == 7


# ---- plain PEFT calls (no torch_lowbit.peft.register), reload, merge into a dense copy
LOW_BIT_CONFIGS = pytest.mark.parametrize("config", [torch_lowbit.Fp8WeightOnly("block", (16, 32)),
                                                     torch_lowbit.Int8Dynamic(), torch_lowbit.Nvfp4WeightOnly(),
                                                     torch_lowbit.Int4WeightOnly(16, symmetric=False)],
                                           ids=["fp8", "int8", "nvfp4", "int4-asym"])


def plain_lora(**kw):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, **kw)


def quantized_llama(config):
    model = tiny_llama(1, biases=True)
    torch_lowbit.quantize_(model, config)
    return model


@LOW_BIT_CONFIGS
def test_plain_peft_calls_wrap_low_bit_layers_and_reload_a_saved_adapter(config, tmp_path):
    base = quantized_llama(config)
    fresh, spare = copy.deepcopy(base), copy.deepcopy(base)
    pm = peft.get_peft_model(base, plain_lora())
    assert isinstance(pm.base_model.model.model.layers[0].mlp.down_proj, lowbit_peft.LowbitLoraLinear)
    train(pm, 2)
    pm.save_pretrained(tmp_path)
    loaded_config = peft.LoraConfig.from_pretrained(tmp_path)
    assert loaded_config._custom_modules is None  # nothing registered on it: the plain calls below must work alone
    loaded = peft.PeftModel.from_pretrained(fresh, tmp_path)
    ids = batch(1)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, pm(input_ids=ids).logits)
    again = peft.get_peft_model(spare, loaded_config)
    assert isinstance(again.base_model.model.model.layers[0].self_attn.q_proj, lowbit_peft.LowbitLoraLinear)


_FRESH_PROCESS = r"""
import sys
import peft  # first: torch_lowbit then finds PEFT's LoRA already imported
from peft import PeftModel
assert "peft.tuners.lora.model" in sys.modules
import torch
import torch_lowbit
sys.path.insert(0, sys.argv[1])
from test_peft import quantized_llama, batch, tiny_llama
base = quantized_llama(torch_lowbit.Fp8WeightOnly("block", (16, 32)))
base.load_state_dict(torch.load(sys.argv[2] + "/base.pt", weights_only=True))
model = PeftModel.from_pretrained(base, sys.argv[2])
with torch.no_grad():
    torch.save(model(input_ids=batch(1)).logits, sys.argv[2] + "/logits.pt")
# "all-linear" expands to the low-bit layers in this import order too (PEFT's tuners already hold its helper)
import torch_lowbit.peft
fresh = peft.get_peft_model(quantized_llama(torch_lowbit.Int8Dynamic()), peft.LoraConfig(target_modules="all-linear"))
assert isinstance(fresh.base_model.model.model.layers[0].mlp.down_proj, torch_lowbit.peft.LowbitLoraLinear)
# and its parameter count is the dense model's (the counting hook in this import order)
dense = peft.get_peft_model(tiny_llama(1, biases=True), peft.LoraConfig(target_modules="all-linear"))
assert fresh.get_nb_trainable_parameters() == dense.get_nb_trainable_parameters()
"""


def test_plain_peft_reload_in_a_fresh_process_that_imported_peft_first(tmp_path):
    # about 10 s: a fresh interpreter imports torch, transformers and peft
    import os
    import subprocess
    import sys
    base = quantized_llama(torch_lowbit.Fp8WeightOnly("block", (16, 32)))
    torch.save(base.state_dict(), tmp_path / "base.pt")
    pm = peft.get_peft_model(base, plain_lora(init_lora_weights=False))
    pm.save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
        torch_lowbit.__file__)), os.environ.get("PYTHONPATH")) if p)}
    run = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, os.path.dirname(__file__), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    with torch.no_grad():
        assert torch.equal(torch.load(tmp_path / "logits.pt"), pm(input_ids=batch(1)).logits)


@LOW_BIT_CONFIGS
def test_merge_into_a_dequantized_copy_matches_float64(config, tmp_path):
    base = quantized_llama(config)
    pm = peft.get_peft_model(base, plain_lora(init_lora_weights=False))  # random B: a nonzero update
    pm.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"torch_lowbit\.dequantize_model\(peft_model\)\.merge_and_unload\(\)"):
        pm.merge_and_unload()
    dense_base = torch_lowbit.dequantize_model(pm.get_base_model(), dtype=torch.float32)
    assert isinstance(pm.base_model.model.model.layers[0].mlp.up_proj.base_layer, (Fp8Linear, Int8Linear,
                                                                                   W4Linear))  # a copy
    merged = peft.PeftModel.from_pretrained(dense_base, tmp_path).merge_and_unload()
    eps = torch.finfo(torch.float32).eps
    for name, lora_layer in pm.named_modules():
        if not isinstance(lora_layer, lowbit_peft.LowbitLoraLinear):
            continue
        low_bit = lora_layer.base_layer
        a, b = lora_layer.lora_A["default"].weight.double(), lora_layer.lora_B["default"].weight.double()
        scaling = lora_layer.scaling["default"]
        dense = merged.get_submodule(name.removeprefix("base_model.model."))
        assert type(dense) is nn.Linear and dense.weight.dtype == torch.float32, name
        want = layer_weight_f64(low_bit) + b @ a * scaling
        bound = layer_weight_f64(low_bit).abs() + b.abs() @ a.abs() * scaling
        assert ((dense.weight.double() - want).abs() <= 4 * eps * bound).all(), name
        assert torch.equal(dense.bias, low_bit.bias)
    # the merged model computes what the unmerged adapters compute on the low-bit base (W8A16: same weights; W8A8:
    # its activations are rounded to int8, so against the unmerged adapters on the dense copy)
    unmerged = pm if not isinstance(config, torch_lowbit.Int8Dynamic) else torch_lowbit.dequantize_model(pm)
    ids = batch(1)
    with torch.no_grad():
        got, want = merged(input_ids=ids).logits, unmerged(input_ids=ids).logits
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    with torch.no_grad():  # the one-line way out the refusal names: the same merge
        assert torch.equal(torch_lowbit.dequantize_model(pm, dtype=torch.float32).merge_and_unload()(
            input_ids=ids).logits, got)


def test_dequantize_model_names_what_it_cannot_do():
    from torch_lowbit.nn.experts import Fp8Experts
    model = nn.Sequential(Fp8Linear.from_float(nn.Linear(32, 16)), Fp8Experts.from_float(
        torch.randn(2, 32, 16), torch.randn(2, 16, 16)))
    model.half()
    kept = torch_lowbit.dequantize_model(model, experts="keep")
    assert type(kept[0]) is nn.Linear and isinstance(kept[1], Fp8Experts) and kept[1] is not model[1]
    assert kept[0].weight.dtype == torch.float16  # the bias's dtype: the model's only floating parameter
    with pytest.raises(ValueError, match=r"dequantize_model: dtype must be one of .*got torch.float64"):
        torch_lowbit.dequantize_model(model, dtype=torch.float64, experts="keep")
    with pytest.raises(ValueError, match=r"dequantize_model: experts must be one of .*got 'dense'"):
        torch_lowbit.dequantize_model(model, experts="dense")



@LOW_BIT_CONFIGS
def test_dequantize_in_place_holds_the_float64_weights_and_merges(config):
    pm = peft.get_peft_model(quantized_llama(config), plain_lora(init_lora_weights=False))
    want = {n: (layer_weight_f64(m.base_layer), m.base_layer.bias) for n, m in pm.named_modules()
            if isinstance(m, lowbit_peft.LowbitLoraLinear)}
    copied = torch_lowbit.dequantize_model(pm, dtype=torch.float32)
    assert torch_lowbit.dequantize_(pm, dtype=torch.float32) is pm
    assert not [n for n, m in pm.named_modules() if isinstance(m, lowbit_peft.LOW_BIT_LAYERS)]
    eps = torch.finfo(torch.float32).eps
    for name, (w, bias) in want.items():
        dense = pm.get_submodule(name).base_layer
        assert type(dense) is nn.Linear and not dense.weight.requires_grad, name
        assert ((dense.weight.double() - w).abs() <= eps * w.abs()).all(), name  # rounded once
        assert torch.equal(dense.weight, copied.get_submodule(name).base_layer.weight)
        assert torch.equal(dense.bias, bias) and dense.bias.requires_grad == bias.requires_grad
    ids = batch(1)
    with torch.no_grad():
        unmerged = pm(input_ids=ids).logits
        assert torch.equal(unmerged, copied(input_ids=ids).logits)
        merged = pm.merge_and_unload()(input_ids=ids).logits  # PEFT's own merge on the dense layers
    assert float((merged - unmerged).abs().max()) <= 1e-5 * float(unmerged.abs().max())


def test_dequantize_in_place_replaces_a_shared_layer_once_and_checks_everything_first():
    from torch_lowbit.nn import W4Experts
    shared = Fp8Linear.from_float(nn.Linear(32, 32))
    model = nn.Sequential(shared, nn.ReLU(), shared)
    w = layer_weight_f64(shared)
    torch_lowbit.dequantize_(model, dtype=torch.float32)
    assert type(model[0]) is nn.Linear and model[2] is model[0]
    assert torch.equal(model[0].weight, w.float())
    assert type(torch_lowbit.dequantize_(Fp8Linear.from_float(nn.Linear(8, 4)))) is nn.Linear  # a bare layer
    # gpt-oss-like experts (biases) have no dense counterpart: refused before the linear layer beside them changes
    t = {p: {"packed": torch.zeros(2, rows, cols // 2, dtype=torch.uint8),
             "scale": torch.full((2, rows, cols // 32), 127, dtype=torch.uint8), "bias": torch.zeros(2, rows)}
         for p, rows, cols in (("gate_up", 64, 64), ("down", 64, 32))}
    biased = W4Experts.from_quantized(t["gate_up"], t["down"], format="mxfp4", group_size=32, hidden_size=64,
                                      intermediate_size=32, dtype=torch.float32)
    model = nn.Sequential(Fp8Linear.from_float(nn.Linear(32, 16)), biased)
    with pytest.raises(ValueError, match=r"dequantize_: 1 is a W4Experts with its own arithmetic"):
        torch_lowbit.dequantize_(model)
    assert isinstance(model[0], Fp8Linear) and model[1] is biased
    with pytest.raises(ValueError, match=r"dequantize_: dtype must be one of .*got torch.float64"):
        torch_lowbit.dequantize_(model, dtype=torch.float64, experts="keep")
    assert isinstance(model[0], Fp8Linear)


# ---- QLoRA on a 4-bit MoE: adapters on the attention, experts frozen in W4Experts
@pytest.mark.parametrize("config", [torch_lowbit.Int4WeightOnly(16, symmetric=False), torch_lowbit.Nvfp4WeightOnly()],
                         ids=["int4-asym", "nvfp4"])
def test_lora_on_the_attention_of_a_4bit_moe_matches_float64_and_trains(config):
    import hf_writers as W
    from test_quantize import _dequantized_f64
    from torch_lowbit.nn import W4Experts
    dense = W.tiny_model("qwen3_moe")
    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), config)
    assert isinstance(model.model.layers[0].mlp.experts, W4Experts)
    ref = _dequantized_f64(dense, model)
    targets = ["q_proj", "v_proj", "o_proj"]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                    init_lora_weights=False))
    pd = peft.get_peft_model(ref, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for (n, p), (nd, q) in zip(adapters(pm).items(), adapters(pd).items()):
            assert n == nd
            q.copy_(p.double())
    ids = torch.randint(0, W.V, (2, 7), generator=torch.Generator().manual_seed(0))
    pm(input_ids=ids, labels=ids).loss.backward()
    pd(input_ids=ids, labels=ids).loss.backward()
    # layer 0's adapters get their gradient back through both layers' 4-bit experts and routing weights
    assert any("layers.0.self_attn" in n for n in adapters(pm))
    for (n, p), q in zip(adapters(pm).items(), adapters(pd).values()):
        assert p.grad is not None and float(q.grad.abs().max()) > 0, n
        tol = 1e-4 * float(q.grad.abs().max()) + 1e-7
        assert float((p.grad.double() - q.grad).abs().max()) <= tol, n
    assert all(not p.requires_grad for n, p in pm.named_parameters() if "lora_" not in n)
    pm.zero_grad()
    opt = torch.optim.AdamW(list(adapters(pm).values()), lr=3e-2)
    losses = []
    for _ in range(4):
        loss = pm(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.95 * losses[0], losses


# ---- target_modules="all-linear": PEFT expands it to nn.Linear names; the low-bit layers must be among them
def _lora_targets(pm):
    return {n.removeprefix("base_model.model.") for n, m in pm.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)}


@LOW_BIT_CONFIGS
def test_all_linear_targets_every_low_bit_linear_but_the_output_embedding(config):
    model = tiny_llama(1)
    torch_lowbit.quantize_(model, config, filter_fn=lambda m, fqn: True)  # lm_head too: it must still be left out
    low_bit = {n for n, m in model.named_modules() if isinstance(m, lowbit_peft.LOW_BIT_LAYERS)}
    assert "lm_head" in low_bit and len(low_bit) == 8
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                    lora_dropout=0.0))
    assert _lora_targets(pm) == low_bit - {"lm_head"}
    assert not isinstance(pm.base_model.model.lm_head, peft.tuners.lora.LoraLayer)
    assert set(pm.peft_config["default"].target_modules) == low_bit - {"lm_head"}  # what adapter_config.json saves
    losses = train(pm, 3)
    assert losses[-1] < losses[0], losses


def test_all_linear_on_a_4bit_moe_targets_the_attention_not_only_the_router(tmp_path):
    import hf_writers as W
    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Int4WeightOnly(16, symmetric=False))
    spare = copy.deepcopy(model)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="ALL-LINEAR",
                                                    lora_dropout=0.0, init_lora_weights=False))
    targets = _lora_targets(pm)
    attention = {n for n, m in spare.named_modules() if isinstance(m, W4Linear)}
    assert attention and {n for n in attention if "self_attn" in n} == attention
    assert attention <= targets, attention - targets
    # the adapter reloads onto a fresh copy of the quantized model and gives the same logits
    pm.save_pretrained(tmp_path)
    loaded = peft.PeftModel.from_pretrained(spare, tmp_path)
    assert attention <= _lora_targets(loaded)
    ids = torch.randint(0, W.V, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, pm(input_ids=ids).logits)


def test_all_linear_in_another_peft_method_is_left_to_peft():
    # IA3 does not take the low-bit layers: the expansion for other methods stays PEFT's own (nn.Linear only)
    model = tiny_llama(1)
    torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly("channel"), filter_fn=lambda m, fqn: fqn.endswith("proj")
                           and "mlp" in fqn)
    config = peft.IA3Config(target_modules="all-linear", feedforward_modules=[])
    pm = peft.get_peft_model(model, config)
    wrapped = {n.removeprefix("base_model.model.") for n, m in pm.named_modules()
               if isinstance(m, peft.tuners.ia3.IA3Layer)}
    assert wrapped == {f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}


def test_lora_targeting_quantized_experts_warns_that_they_stay_frozen():
    import hf_writers as W
    from torch_lowbit.nn import W4Experts
    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Nvfp4WeightOnly())
    assert isinstance(model.model.layers[0].mlp.experts, W4Experts)
    with pytest.warns(UserWarning, match=r"fused experts of 2 module\(s\) held quantized .*W4Experts.*stay frozen"):
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))
    # attention only: nothing to warn about
    model = torch_lowbit.quantize_(W.tiny_model("qwen3_moe"), torch_lowbit.Nvfp4WeightOnly())
    import warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="torch_lowbit")
        peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


# ---- transformers' Trainer: QLoRA on a model TorchLowbitConfig quantized as it loaded
def test_trainer_trains_lora_on_a_torch_lowbit_config_model_and_refuses_the_bare_base(tmp_path):
    import hf_writers as W
    transformers.set_seed(0)
    W.tiny_model("llama").save_pretrained(tmp_path / "dense")

    def load():
        return transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "dense", dtype=torch.float32, quantization_config=torch_lowbit.TorchLowbitConfig("nvfp4"))

    ids = torch.randint(0, W.V, (4, 9), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=2,
                                          learning_rate=3e-2, report_to=[], use_cpu=True, save_strategy="no",
                                          logging_steps=1, disable_tqdm=True)
    with pytest.raises(ValueError, match="purely quantized"):  # transformers' own refusal, kept
        transformers.Trainer(model=load(), args=args, train_dataset=data)
    pm = peft.get_peft_model(load(), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                     lora_dropout=0.0, init_lora_weights=False))
    before = {n: p.detach().clone() for n, p in adapters(pm).items()}
    trainer = transformers.Trainer(model=pm, args=args, train_dataset=data)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 4 and losses[-1] < losses[0], losses
    assert all(not torch.equal(p, before[n]) for n, p in adapters(pm).items())
    assert isinstance(pm.base_model.model.model.layers[0].mlp.down_proj.base_layer, W4Linear)


def test_qlora_recipe_with_gradient_checkpointing_gives_the_gradients_without_it():
    # prepare_model_for_kbit_training recognizes bitsandbytes / GPTQ / torchao models only: on a torch_lowbit model
    # it upcasts and freezes but leaves checkpointing off, so the README's recipe turns it on explicitly
    import hf_writers as W
    ids = torch.randint(0, W.V, (2, 7), generator=torch.Generator().manual_seed(0))
    grads = []
    for checkpointing in (False, True):
        model = torch_lowbit.quantize_(W.tiny_model("llama").to(torch.bfloat16), torch_lowbit.Nvfp4WeightOnly())
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(1)
        pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        pm.train()
        assert pm.base_model.model.is_gradient_checkpointing == checkpointing
        pm(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in pm.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == 28
    for n, g in grads[0].items():
        assert torch.allclose(grads[1][n], g, rtol=1e-4, atol=1e-6), n
