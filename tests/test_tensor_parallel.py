"""Tensor parallelism (torch_lowbit.distributed): each low-bit layer cut for a rank under the column-wise /
row-wise / experts splits (the ranks' pieces recombine into the single-process layer's output; uneven splits
refused by name), and whole tiny Llama / Qwen3-MoE / Mixtral checkpoints from the real writers (compressed-tensors
FP8 channel and block, INT8 W8A8; transformers' fine-grained FP8) loaded with ``from_pretrained(tp_plan="auto")`` by
real gloo process groups of 2 and 4 ranks (tests/tp_worker.py; one launch per world size, bounded in time): logits
equal to the single-process model's within rel 1e-5, the same greedy tokens on every rank, each rank holding at
most 1/world + 5% of the low-bit bytes; the same through transformers' own ``from_pretrained`` of a dense
checkpoint with ``TorchLowbitConfig`` and a tensor-parallel plan; the INT8 activation quantization of split rows bitwise equal to
int8_quantize of the whole rows."""
import copy

import pytest
import torch

import torch_lowbit
from torch_lowbit.distributed import SplitError, lowbit_bytes, shard_layer
from torch_lowbit.nn import Fp8Experts, Fp8Linear, Int8Experts, Int8Linear, W4Experts, W4Linear

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

import tp_worker  # noqa: E402
from hf_writers import tiny_model, write_compressed_tensors, write_hf_fp8  # noqa: E402

# sizes that split over 4 ranks under both writers' blocks (compressed-tensors 16x32, fine-grained FP8 8x16):
# heads 8 / kv heads 4, q 128 rows, k / v 64, MLP and experts intermediate 128
TP_SIZES = dict(V=128, H=64, I=128, MOE_I=128, HEADS=8, KV_HEADS=4, HEAD_DIM=16)


# ------------------------------------------------------------------------------------------------ one layer
def _linear(kind, N=64, K=128, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(K, N, bias=bias)
    if kind == "fp8-tensor":
        return Fp8Linear.from_float(lin, "tensor")
    if kind == "fp8-channel":
        return Fp8Linear.from_float(lin, "channel")
    if kind == "fp8-block":
        return Fp8Linear.from_float(lin, torch_lowbit.PerBlock(16, 32))
    if kind == "int8":
        return Int8Linear.from_float(lin)
    if kind == "int4":
        return W4Linear.from_float(lin, "int4", group_size=16)
    if kind == "nvfp4":
        return W4Linear.from_float(lin, "nvfp4")
    raise ValueError(kind)


def _pieces(layer, style, world):
    return [shard_layer(copy.deepcopy(layer), style, r, world, "probe") for r in range(world)]


def _no_bias(layer):
    layer = copy.deepcopy(layer)
    layer._parameters["bias"] = None
    return layer


LINEARS = ["fp8-tensor", "fp8-channel", "fp8-block", "int8", "int4", "nvfp4"]


@pytest.mark.parametrize("kind", LINEARS)
@pytest.mark.parametrize("world", [2, 4])
def test_colwise_pieces_are_the_output_columns(kind, world):
    layer = _linear(kind)
    x = torch.randn(5, layer.in_features)
    y = layer(x).double()
    parts = _pieces(layer, "colwise", world)
    assert all(p.out_features == layer.out_features // world for p in parts)
    torch.testing.assert_close(torch.cat([p(x) for p in parts], -1).double(), y, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", LINEARS)
@pytest.mark.parametrize("world", [2, 4])
def test_rowwise_partial_products_sum_to_the_output(kind, world):
    layer = _linear(kind)
    x = torch.randn(5, layer.in_features)
    y = layer(x).double()
    k = layer.in_features // world
    total = layer.bias.double().clone() if layer.bias is not None else 0
    if kind == "int8":  # the activation codes of the whole rows, sliced (what shared_int8_quantize gives each rank)
        q, s = torch_lowbit.int8_quantize(x)
    for r, p in enumerate(_pieces(layer, "rowwise", world)):
        assert p.in_features == k and tuple(p.bias.shape) == (layer.out_features,)  # the bias stays whole
        xr = x[:, r * k:(r + 1) * k]
        if kind == "int8":
            total = total + torch_lowbit.int8_mm(q[:, r * k:(r + 1) * k], s, p.weight, p.weight_scale, None,
                                                 torch.float32).double()
        else:
            total = total + _no_bias(p)(xr).double()
    torch.testing.assert_close(total, y, rtol=1e-5, atol=1e-6)


def _experts(kind, E=3, H=48, I=64, seed=0):
    torch.manual_seed(seed)
    gu, dn = torch.randn(E, 2 * I, H) / H ** 0.5, torch.randn(E, H, I) / I ** 0.5
    if kind == "fp8-channel":
        return Fp8Experts.from_float(gu, dn, "channel")
    if kind == "fp8-block":
        return Fp8Experts.from_float(gu, dn, torch_lowbit.PerBlock(16, 16))
    if kind == "int8":
        return Int8Experts.from_float(gu, dn)
    if kind == "int4":
        return W4Experts.from_float(gu, dn, "int4", group_size=16)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["fp8-channel", "fp8-block", "int4"])
@pytest.mark.parametrize("world", [2, 4])
def test_experts_pieces_sum_to_the_output(kind, world):
    layer = _experts(kind)
    T = 7
    hidden = torch.randn(T, layer.hidden_size)
    ids = torch.randint(0, layer.num_experts, (T, 2))
    ids[0, 1] = -1  # a skipped slot
    weights = torch.rand(T, 2)
    y = layer(hidden, ids, weights).double()
    parts = _pieces(layer, "experts", world)
    assert all(p.intermediate_size == layer.intermediate_size // world for p in parts)
    total = sum(p(hidden, ids, weights).double() for p in parts)
    torch.testing.assert_close(total, y, rtol=1e-5, atol=1e-6)


def test_int8_experts_gate_up_splits_gate_and_up_rows_apart():
    layer = _experts("int8", I=32)
    p = shard_layer(copy.deepcopy(layer), "experts", 1, 2, "probe")
    I, h = 32, 16
    torch.testing.assert_close(p.gate_up, torch.cat([layer.gate_up[:, h:I], layer.gate_up[:, I + h:]], 1))
    torch.testing.assert_close(p.gate_up_scale, torch.cat([layer.gate_up_scale[:, h:I],
                                                           layer.gate_up_scale[:, I + h:]], 1))
    torch.testing.assert_close(p.down, layer.down[:, :, h:])
    assert torch.equal(p.down_scale, layer.down_scale)  # per output channel H: replicated


def test_pieces_own_their_memory():
    layer = _linear("fp8-channel", N=64, K=128)
    full = lowbit_bytes(layer)
    for style in ("colwise", "rowwise"):
        p = shard_layer(copy.deepcopy(layer), style, 0, 4, "probe")
        assert lowbit_bytes(p) <= full * (0.25 + 0.05), style
        assert p.weight.untyped_storage().nbytes() == 64 * 128 // 4


@pytest.mark.parametrize("style, kind, sizes, words", [
    ("colwise", "fp8-block", dict(N=48, K=96), ["N = 48", "12 per rank", "multiple of 16", "weight_scale"]),
    ("rowwise", "fp8-block", dict(N=64, K=96), ["K = 96", "24 per rank", "multiple of 32"]),
    ("colwise", "fp8-channel", dict(N=66, K=96), ["N = 66", "does not split evenly over 4 ranks"]),
    ("rowwise", "int4", dict(N=64, K=96), ["K = 96", "24 per rank", "multiple of 16"]),
    ("rowwise", "nvfp4", dict(N=64, K=96), ["K = 96", "24 per rank", "multiple of 16"]),
])
def test_uneven_split_refused_naming_layer_and_sizes(style, kind, sizes, words):
    layer = _linear(kind, **sizes)
    with pytest.raises(SplitError) as e:
        shard_layer(layer, style, 0, 4, "model.layers.3.mlp.down_proj")
    msg = str(e.value)
    for w in ["model.layers.3.mlp.down_proj", type(layer).__name__] + words:
        assert w in msg, (w, msg)


def test_experts_uneven_split_refused():
    layer = _experts("fp8-block", I=48)  # 12 rows of I per rank, blocks of 16
    with pytest.raises(SplitError, match=r"model\.layers\.0\.mlp\.experts \(Fp8Experts\): I = 48 over 4 ranks gives "
                                         r"12 per rank, which is not a multiple of 16"):
        shard_layer(layer, "experts", 0, 4, "model.layers.0.mlp.experts")


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_world_one_keeps_partial_edge_blocks(style):
    layer = _linear("fp8-block", N=40, K=72)  # blocks of 16 x 32: partial in both directions
    x = torch.randn(3, 72)
    one = shard_layer(copy.deepcopy(layer), style, 0, 1, "probe")
    assert torch.equal(one(x), layer(x)) and torch.equal(one.weight_scale, layer.weight_scale)


def test_shard_layer_bad_arguments():
    layer = _linear("fp8-channel")
    with pytest.raises(ValueError, match="style must be one of"):
        shard_layer(layer, "diagonal", 0, 2)
    with pytest.raises(ValueError, match="rank=2, world=2"):
        shard_layer(layer, "colwise", 2, 2)
    with pytest.raises(SplitError, match="is not a torch_lowbit layer"):
        shard_layer(torch.nn.Linear(4, 4), "colwise", 0, 2)


def test_rowwise_dynamic_fp8_activations_refused():
    """A per-token FP8 activation scale needs the whole row, which no rank holds: refused by name (weights-only and
    static per-tensor activations split)."""
    from torch_lowbit.distributed.styles import lowbit_style

    layer = _linear("fp8-channel").set_activation_scheme("dynamic", run=True)
    kind, style = lowbit_style("rowwise", "model.layers.0.mlp.down_proj")
    assert kind == "rowwise"
    with pytest.raises(SplitError, match=r"model\.layers\.0\.mlp\.down_proj \(Fp8Linear\): row-wise parallel with "
                                         r"dynamic per-token FP8 activations is not supported"):
        style.install_forward(layer, None, "model.layers.0.mlp.down_proj")
    with pytest.raises(SplitError, match=r"style 'sequence_parallel', which torch_lowbit's low-bit layers do not"):
        lowbit_style("sequence_parallel", "model.norm")


def test_transformers_without_tensor_parallel_styles_is_named(monkeypatch):
    import sys

    from torch_lowbit.distributed.parallel import transformers_tp

    monkeypatch.setitem(sys.modules, "transformers.distributed", None)  # `import` of it raises ImportError
    with pytest.raises(ImportError, match=r"runs on transformers' tensor-parallel styles \(transformers\.distributed"):
        transformers_tp()


class _Plans(torch.nn.Module):
    def __init__(self, tp_plan, ep_plan):
        super().__init__()
        self.tp_plan, self.ep_plan = tp_plan, ep_plan


def test_experts_that_the_ep_plan_dispatches_are_split_over_i():
    """transformers 5.25 moved MoE experts out of the tp_plans into ep_plans (expert parallelism, not implemented
    here): those experts get torch_lowbit's split over I, for its own layers only; a plan naming them keeps its
    entry, and an experts module no ep_plan dispatches gets none."""
    from torch_lowbit.distributed.parallel import resolve_plan
    from torch_lowbit.distributed.styles import LowbitExperts, lowbit_style

    tp = {"model.layers.*.self_attn.o_proj": "rowwise"}
    ep = {"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.experts.down_proj": "grouped_gemm"}
    plan = resolve_plan(_Plans(tp, ep), "auto")
    assert dict(plan) == {**tp, "model.layers.*.mlp.experts": "moe_tp_experts"}
    assert plan.lowbit_only == {"model.layers.*.mlp.experts"}
    kind, style = lowbit_style(plan["model.layers.*.mlp.experts"], "model.layers.0.mlp.experts")
    assert kind == "experts" and isinstance(style, LowbitExperts)
    named = resolve_plan(_Plans({**tp, "model.layers.*.mlp.experts": "replicate"}, ep), "auto")
    assert named["model.layers.*.mlp.experts"] == "replicate" and not named.lowbit_only
    user = resolve_plan(_Plans(tp, ep), {"model.layers.*.mlp.experts": "replicate"})
    assert user["model.layers.*.mlp.experts"] == "replicate" and not user.lowbit_only
    assert dict(resolve_plan(_Plans(tp, {}), "auto")) == tp


def test_transformers_expert_parallelism_is_refused_by_name():
    """transformers cuts experts by expert and routes tokens to their ranks under ep_size > 1; quantizing such a
    model with the experts split over I would run experts on tokens routed elsewhere: refused, naming ep_size."""
    import types

    from torch_lowbit.distributed.parallel import quantize_parallel

    model = _Plans({"model.layers.*.self_attn.o_proj": "rowwise"}, {})
    model.config = types.SimpleNamespace(distributed_config=types.SimpleNamespace(ep_size=2, tp_size=2))
    with pytest.raises(ValueError, match=r"expert parallelism \(DistributedConfig ep_size=2\) is not supported"):
        quantize_parallel(model, None, lambda m, fqn: True)


@pytest.mark.parametrize("plan", ["fast", {"model.layers.*.mlp.down_proj": 3}, ["rowwise"]])
def test_from_pretrained_bad_tp_plan_refused_before_reading(plan):
    with pytest.raises(ValueError, match=r"tp_plan must be 'auto' or a dict of module patterns to style names"):
        torch_lowbit.from_pretrained("/nonexistent/checkpoint", tp_plan=plan)


def test_from_pretrained_tp_plan_needs_a_process_group(monkeypatch):
    import torch.distributed as dist

    assert not dist.is_initialized()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(RuntimeError, match=r"tp_plan needs a torch.distributed process group: launch with torchrun"):
        torch_lowbit.from_pretrained("/nonexistent/checkpoint", tp_plan="auto")


# ------------------------------------------------------------------------------------------------ whole models
CHECKPOINTS = [  # (arch, writer, scheme)
    ("llama", "ct", "fp8-channel"), ("llama", "ct", "fp8-block"), ("llama", "ct", "int8-w8a8"),
    ("llama", "hf-fp8", "block"),
    ("qwen3_moe", "ct", "fp8-channel"), ("qwen3_moe", "ct", "int8-w8a8"), ("qwen3_moe", "hf-fp8", "block"),
    ("mixtral", "ct", "fp8-block"), ("mixtral", "ct", "int8-w8a8"),
]

HF_QUANTIZER = [("llama", "fp8"), ("qwen3_moe", "int8"), ("qwen3_moe", "int4")]  # int4: W4Linear, W4Experts


def _write(arch, writer, scheme, path, **sizes):
    model = tiny_model(arch, **sizes)
    if writer == "ct":
        return write_compressed_tensors(model, arch, str(path), scheme)
    return write_hf_fp8(model, arch, str(path), scheme)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{case name: (path, single-process logits, greedy tokens, low-bit bytes)} and the uneven checkpoint."""
    root = tmp_path_factory.mktemp("tp")
    cases = {}
    for arch, writer, scheme in CHECKPOINTS:
        name = f"{arch}-{writer}-{scheme}"
        path = _write(arch, writer, scheme, root / name, **TP_SIZES)
        model = tp_worker.tp_model(path)
        logits, tokens = tp_worker.run_model(model)
        cases[name] = (path, logits, tokens, lowbit_bytes(model))
    # transformers' from_pretrained(dense checkpoint, tp_plan, quantization_config=TorchLowbitConfig(...)): quantized
    # after transformers split the dense weights
    for arch, weights in HF_QUANTIZER:
        path = str(root / f"dense-{arch}")
        if not (root / f"dense-{arch}").exists():
            tiny_model(arch, **TP_SIZES).save_pretrained(path)
        model = tp_worker.hf_model(path, weights)
        logits, tokens = tp_worker.run_model(model)
        cases[f"hf-{arch}-{weights}"] = (path, logits, tokens, lowbit_bytes(model))
    # hf_writers' own sizes: 48 q / o rows of 4 heads, blocks of 16 x 32; kv heads 2
    uneven = _write("llama", "ct", "fp8-block", root / "uneven")
    return cases, uneven


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, checkpoints):
    """Every case on `world` ranks, in one launch."""
    cases, uneven = checkpoints
    todo = {name: (f"hf-{name.rsplit('-', 1)[1]}" if name.startswith("hf-") else "model", c[0])
            for name, c in cases.items()}
    todo["uneven"] = ("refused", uneven)
    todo["shared_quantize"] = ("shared_quantize", None)
    return request.param, tp_worker.launch(request.param, todo, timeout=150)


@pytest.mark.parametrize("case", [f"{a}-{w}-{s}" for a, w, s in CHECKPOINTS]
                         + [f"hf-{a}-{w}" for a, w in HF_QUANTIZER])
def test_tp_model_matches_single_process(ranks, checkpoints, case):
    world, results = ranks
    _, logits, tokens, full_bytes = checkpoints[0][case]
    assert len(tokens) == tp_worker.NEW_TOKENS
    for rank, res in enumerate(results):
        got = res[case]
        err = ((got["logits"].double() - logits.double()).abs().max() / logits.double().abs().max()).item()
        assert err <= 1e-5, (rank, err)
        assert got["tokens"].tolist() == tokens.tolist(), rank
        assert got["lowbit_bytes"] <= full_bytes * (1 / world + 0.05), (rank, got["lowbit_bytes"], full_bytes)
        assert got["lowbit_bytes"] < full_bytes  # something was split
        if not case.startswith("hf-"):
            # the plan's dense lm_head, split by transformers' style: a rank keeps its rows only
            assert got["lm_head_bytes"] == TP_SIZES["V"] * TP_SIZES["H"] * 4 // world
            assert got["tp"]["world_size"] == world and got["tp"]["rank"] == rank
            # per-expert checkpoints: each projection cut as read, the whole experts layer never stacked
            moe = not case.startswith("llama")
            assert got["tp"]["experts_cut_while_reading"] == (
                [f"model.layers.{i}.mlp.experts" for i in range(2)] if moe else []), got["tp"]


def test_tp_uneven_checkpoint_refused(ranks):
    world, results = ranks
    for res in results:
        msg = res["uneven"]["error"]
        assert msg is not None and msg.startswith("SplitError")
        if world == 2:  # 48 rows of q_proj: 24 per rank, blocks of 16
            assert "model.layers.0.self_attn.q_proj (Fp8Linear): N = 48 over 2 ranks gives 24 per rank" in msg, msg
        else:  # 2 kv heads cannot split over 4 ranks
            assert "num_key_value_heads = 2 does not split over 4 ranks" in msg, msg


def test_tp_int8_quantize_of_split_rows_is_the_whole_rows(ranks):
    world, results = ranks
    for res in results:
        r = res["shared_quantize"]
        assert torch.equal(r["q"], r["q_ref"])
        torch.testing.assert_close(r["s"], r["s_ref"], rtol=0, atol=0, equal_nan=True)


def test_tp_model_save_refused(ranks):
    world, results = ranks
    msg, written = results[0]["save_refused"]
    assert "save_quantized: this model is split over ranks by tensor parallelism" in msg and "tp_plan" in msg, msg
    assert not written
