"""Hugging Face models end to end: tiny transformers 5 models (Llama, Qwen3-MoE, Mixtral) quantized and saved by
the real writers (compressed-tensors, transformers' FineGrainedFP8 quantize step), loaded into torch_lowbit layers
-- built on the meta device, under parameters_on_meta, or for real -- and compared with each writer's own
dequantized reload (fp32 logits, greedy tokens); from_pretrained, save_quantized, and the errors."""
import json
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hf_writers as W
import torch_lowbit
from hf_writers import transformers
from torch_lowbit.formats import CheckpointError, load_quantized
from torch_lowbit.formats.moe import computes_silu
from torch_lowbit.nn import Fp8Experts, Fp8Linear, Int8Linear

IDS = torch.tensor([[3, 17, 42, 5, 88, 1, 0, 64, 23], [96, 2, 2, 50, 11, 7, 33, 8, 70]])
PROMPT = torch.tensor([[7, 61, 3, 30, 98, 12]])
ROTARY = ["model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(arch, writer, scheme) -> (directory, the writer's dequantized fp32 model): each written once."""
    cache = {}

    def get(arch, writer, scheme):
        key = (arch, writer, scheme)
        if key not in cache:
            write, reload = W.WRITERS[writer]
            path = str(tmp_path_factory.mktemp(f"{arch}-{writer}-{scheme}"))
            write(W.tiny_model(arch), arch, path, scheme)
            cache[key] = (path, (W.dequantized_by_hand if key in W.WRITER_RELOAD_FAILS else reload)(path))
        return cache[key]
    return get


def _build(arch, how):
    config = W.tiny_config(arch)
    if how == "meta":
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if how == "parameters_on_meta":
        with torch_lowbit.parameters_on_meta():
            return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return W.tiny_model(arch, seed=1)  # real random weights, all overwritten by the checkpoint


def _rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits


CASES = [("llama", "ct", s, "meta") for s in ("fp8-tensor", "fp8-channel", "fp8-block", "fp8-channel-w8a16",
                                              "int8-w8a8")]
CASES += [("llama", "hf-fp8", "block", "parameters_on_meta")]
CASES += [("qwen3_moe", "ct", s, "meta") for s in ("fp8-tensor", "fp8-channel", "fp8-block")]
CASES += [("qwen3_moe", "hf-fp8", "block", "meta"), ("qwen3_moe", "ct", "fp8-block", "real")]
CASES += [("mixtral", "ct", "fp8-channel", "meta"), ("mixtral", "ct", "fp8-block", "parameters_on_meta")]


@pytest.mark.parametrize("arch,writer,scheme,how", CASES, ids=["-".join(c) for c in CASES])
def test_load_quantized_matches_the_writers_dequantized_model(checkpoints, arch, writer, scheme, how):
    path, ref = checkpoints(arch, writer, scheme)
    model = _build(arch, how)
    report = load_quantized(model, path, dtype=torch.float32)
    layer = Int8Linear if scheme.startswith("int8") else Fp8Linear
    linears = [n for n, m in ref.named_modules() if type(m) is nn.Linear and n != "lm_head"]
    assert linears and all(isinstance(model.get_submodule(n), layer) for n in linears)
    experts = [n for n, m in ref.named_modules() if hasattr(m, "gate_up_proj")]
    assert all(isinstance(model.get_submodule(n), Fp8Experts) for n in experts)
    assert len(experts) == (W.LAYERS if arch != "llama" else 0)
    assert set(report.converted) == set(linears) | set(experts)
    assert report.unused_keys == [] and report.missing_keys == []
    assert report.recomputed_buffers == (sorted(ROTARY) if how == "meta" else []) or \
        sorted(report.recomputed_buffers) == sorted(ROTARY)
    assert (arch == "mixtral") == bool(report.renamed_keys)  # block_sparse_moe.experts.{e}.w1 -> mlp.experts ...
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    for n in ROTARY:
        assert torch.equal(model.get_buffer(n), ref.get_buffer(n))
    # W8A8 rounds activations to int8 per token (the writer's reload runs them dense): about 0.4% each
    assert _rel_err(_logits(model), _logits(ref)) <= (5e-2 if scheme.startswith("int8") else 1e-6)


@pytest.mark.parametrize("arch,writer,scheme", [("qwen3_moe", "ct", "fp8-channel"), ("llama", "ct", "fp8-block"),
                                                ("mixtral", "ct", "fp8-block"), ("qwen3_moe", "hf-fp8", "block")])
def test_from_pretrained_generates_the_writers_greedy_tokens(checkpoints, arch, writer, scheme):
    path, ref = checkpoints(arch, writer, scheme)
    model, report = torch_lowbit.from_pretrained(path, dtype=torch.float32, return_report=True)
    assert type(model).__name__ == type(ref).__name__ and not model.training
    assert model.device == torch_lowbit.hf.best_device()
    assert not any(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    assert report.recomputed_buffers == []  # parameters_on_meta: the rotary buffers were computed in __init__
    if arch != "llama":
        assert isinstance(model.model.layers[0].mlp.experts, Fp8Experts)
    want = ref.generate(PROMPT, max_new_tokens=8, do_sample=False)
    got = model.generate(PROMPT, max_new_tokens=8, do_sample=False)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,convert", [(torch.float16, lambda m: m.half()),
                                           (torch.bfloat16, lambda m: m.to(torch.bfloat16))])
def test_model_dtype_conversion_after_loading_equals_loading_in_that_dtype(checkpoints, dtype, convert):
    path, _ = checkpoints("qwen3_moe", "ct", "fp8-channel")
    converted = convert(torch_lowbit.from_pretrained(path, dtype=torch.float32))
    direct = convert(torch_lowbit.from_pretrained(path, dtype=dtype))  # converts only the fp32 rotary buffers
    experts = converted.model.layers[1].mlp.experts
    assert experts.gate_up.dtype == torch.float8_e4m3fn and experts.gate_up_scale.dtype == torch.float32
    assert converted.model.embed_tokens.weight.dtype == dtype
    assert torch.equal(_logits(converted), _logits(direct))
    assert torch.equal(converted.generate(PROMPT, max_new_tokens=4, do_sample=False),
                       direct.generate(PROMPT, max_new_tokens=4, do_sample=False))


def _dtypes_outside(model, converted):
    """name -> dtype of every parameter and buffer of `model` outside the modules named in `converted`."""
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {k: v.dtype for k, v in tensors.items() if not any(k.startswith(c + ".") for c in converted)}


def test_deepseek_v3_in_its_fp8_layout_gives_the_writers_logits_and_greedy_tokens(tmp_path):
    # MLA attention, a dense first layer, grouped routing with a score-correction bias, experts stacked from
    # DeepSeek's per-expert names: the float32 load against transformers' own dequantized reload
    W.write_hf_fp8(W.tiny_model("deepseek_v3"), "deepseek_v3", str(tmp_path))
    ref = W.hf_fp8_dequantized(str(tmp_path))
    model = torch_lowbit.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert isinstance(model.model.layers[1].mlp.experts, Fp8Experts)
    assert isinstance(model.model.layers[0].self_attn.kv_a_proj_with_mqa, Fp8Linear)
    assert _rel_err(_logits(model), _logits(ref)) <= 1e-5
    assert torch.equal(model.generate(PROMPT, max_new_tokens=8, do_sample=False),
                       ref.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_deepseek_v3s_multi_token_prediction_layer_is_skipped_as_transformers_skips_it(tmp_path):
    # DeepSeek-V3's published checkpoints hold a multi-token-prediction layer (61) beside the model, in FP8 like the
    # rest, which transformers' class does not build (_keys_to_ignore_on_load_unexpected); GLM-4.5 (layer 46 / 92)
    # and Qwen3-Next (mtp.*) do the same. Those keys are skipped unread, as transformers skips them; an FP8 weight
    # the class does not declare is still refused.
    from safetensors.torch import load_file, save_file

    W.write_hf_fp8(W.tiny_model("deepseek_v3"), "deepseek_v3", str(tmp_path / "plain"))
    plain = torch_lowbit.from_pretrained(str(tmp_path / "plain"), dtype=torch.float32, device="cpu")
    sd = load_file(tmp_path / "plain" / "model.safetensors")
    mtp = {k.replace("model.layers.1.", "model.layers.61.", 1): v.clone() for k, v in sd.items()
           if k.startswith("model.layers.1.")}  # a decoder layer, with eh_proj and its norms beside it
    mtp["model.layers.61.eh_proj.weight"] = torch.randn(W.H, 2 * W.H).to(torch.float8_e4m3fn)
    mtp["model.layers.61.eh_proj.weight_scale_inv"] = torch.ones(W.H // 8, 2 * W.H // 16)
    mtp["model.layers.61.enorm.weight"], mtp["model.layers.61.hnorm.weight"] = torch.ones(W.H), torch.ones(W.H)
    stray = {k.replace(".61.", ".60."): v.clone() for k, v in mtp.items() if ".eh_proj." in k}  # not declared
    for name, extra in (("mtp", mtp), ("stray", stray)):
        os.makedirs(tmp_path / name)
        for f in ("config.json", "generation_config.json"):
            if os.path.exists(tmp_path / "plain" / f):
                os.link(tmp_path / "plain" / f, tmp_path / name / f)
        save_file({**sd, **extra}, tmp_path / name / "model.safetensors", metadata={"format": "pt"})
    model, report = torch_lowbit.from_pretrained(str(tmp_path / "mtp"), dtype=torch.float32, device="cpu",
                                                 return_report=True, strict=True)
    assert report.ignored_keys == sorted(mtp) and report.unused_keys == [] and len(mtp) > 40
    assert torch.equal(_logits(model), _logits(plain))
    with pytest.raises(CheckpointError, match=r"quantized weights for modules the model does not have.*"
                                              r"model\.layers\.60\.eh_proj"):
        torch_lowbit.from_pretrained(str(tmp_path / "stray"), dtype=torch.float32, device="cpu")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_from_pretrained_keeps_deepseek_v3s_router_in_fp32_as_transformers_does(tmp_path, dtype):
    # DeepSeek-V3 in its own FP8 layout (what transformers' FineGrainedFP8 step writes): transformers loads the
    # router's gate weight and score-correction bias in fp32 whatever the dtype (_keep_in_fp32_modules_strict);
    # rounded to bf16 the bias moves which experts a token takes. Every tensor outside the low-bit layers takes the
    # dtype transformers gives it, and the kept ones their stored values.
    model = W.tiny_model("deepseek_v3")
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.linspace(0.1, 0.2, b.numel()) + 1e-4 / 3)  # exact in neither bf16 nor fp16
    stored = {k: v.clone() for k, v in model.state_dict().items() if ".mlp.gate." in k}
    W.write_hf_fp8(model, "deepseek_v3", str(tmp_path))
    ours, report = torch_lowbit.from_pretrained(str(tmp_path), dtype=dtype, device="cpu", return_report=True)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=dtype)
    assert "model.layers.1.mlp.experts" in report.converted and "model.layers.0.self_attn.kv_b_proj" in report.converted
    got, want = _dtypes_outside(ours, report.converted), _dtypes_outside(theirs, report.converted)
    assert got == {k: want[k] for k in got} and len(got) == 15  # embeddings, norms, the router, lm_head
    kept = {k for k, d in got.items() if d == torch.float32 and "rotary" not in k}
    assert kept == set(stored) == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias"}
    state = ours.state_dict()
    for k in kept:
        assert torch.equal(state[k], stored[k])


@pytest.mark.parametrize("dtype,wo_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)],
                         ids=["float16", "bfloat16"])
def test_from_pretrained_keeps_t5s_wo_in_fp32_in_a_float16_load_as_transformers_does(tmp_path, dtype, wo_dtype):
    # T5 (_keep_in_fp32_modules = ["wo"]): float16 overflows the feed-forward output, so transformers keeps wo in
    # fp32 in a float16 load (and the model casts wo's input to it); quantize_ leaves wo dense for the same reason
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=40, d_model=32, d_ff=48, d_kv=8, num_layers=2, num_heads=4, decoder_start_token_id=0)).eval()
    torch_lowbit.save_quantized(torch_lowbit.quantize_(model, torch_lowbit.Fp8WeightOnly()), tmp_path)
    ours, report = torch_lowbit.from_pretrained(str(tmp_path), dtype=dtype, device="cpu", return_report=True)
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path), dtype=dtype)
    got, want = _dtypes_outside(ours, report.converted), _dtypes_outside(theirs, report.converted)
    assert got == {k: want[k] for k in got} and len(report.converted) == 28  # all but wo and lm_head
    assert ours.decoder.block[1].layer[2].DenseReluDense.wo.weight.dtype == wo_dtype
    ids, start = torch.tensor([[3, 7, 9, 1, 22]]), torch.tensor([[0, 5, 6]])
    with torch.no_grad():
        a, b = (m(input_ids=ids, decoder_input_ids=start).logits.float() for m in (ours, theirs))
    assert torch.isfinite(a).all() and (a - b).norm() / b.norm() < 2e-2


def test_mixtral_checkpoint_names_are_renamed_and_unfilled_quantized_modules_are_errors(checkpoints):
    path, _ = checkpoints("mixtral", "ct", "fp8-channel")
    from safetensors import safe_open
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in f.keys()  # as the writer stored it
    with pytest.raises(CheckpointError, match=r"quantized weights for modules the model does not have.*"
                                              r"block_sparse_moe\.experts\.0\.w1"):
        load_quantized(_build("mixtral", "real"), path, rename_keys=False)  # strict=False: still an error


class _Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)
        self.proj = nn.Linear(8, 8)


def test_tensors_left_on_meta_are_an_error_naming_them():
    with torch.device("meta"):
        model = _Rotary()
    sd = {"proj.weight": torch.randn(8, 8).to(torch.float8_e4m3fn), "proj.weight_scale_inv": torch.ones(1),
          "proj.bias": torch.zeros(8)}
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": None}}
    with pytest.raises(CheckpointError, match=r"still on the meta device.*inv_freq.*parameters_on_meta"):
        load_quantized(model, sd, config=config)
    with torch_lowbit.parameters_on_meta():
        model = _Rotary()
    assert model.proj.weight.is_meta and not model.inv_freq.is_meta
    report = load_quantized(model, sd, config=config)
    assert report.recomputed_buffers == [] and isinstance(model.proj, Fp8Linear)
    assert torch.equal(model.inv_freq, _Rotary().inv_freq)


def test_parameters_on_meta_restores_nn_module_after_an_error():
    original = nn.Module.register_parameter
    with pytest.raises(RuntimeError, match="boom"):
        with torch_lowbit.parameters_on_meta():
            assert nn.Linear(3, 2).weight.is_meta
            raise RuntimeError("boom")
    assert nn.Module.register_parameter is original and not nn.Linear(3, 2).weight.is_meta


def test_silu_is_recognized_by_what_it_computes():
    from transformers.activations import ACT2FN
    for act in (ACT2FN["silu"], ACT2FN["swish"], nn.SiLU(), F.silu):
        assert computes_silu(act), act
    for act in (ACT2FN["gelu"], ACT2FN["gelu_pytorch_tanh"], nn.ReLU(), torch.sigmoid, lambda x: x * 2,
                lambda x: 1 / 0):
        assert not computes_silu(act), act


def test_experts_with_another_activation_are_refused(checkpoints):
    path, _ = checkpoints("qwen3_moe", "ct", "fp8-channel")
    model = _build("qwen3_moe", "meta")
    from transformers.activations import ACT2FN
    model.model.layers[0].mlp.experts.act_fn = ACT2FN["gelu"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.experts uses activation .*x \* sigmoid"):
        load_quantized(model, path)


# ----------------------------------------------------------------------------------------------- save_quantized
SAVE_CONFIGS = {"fp8-tensor": torch_lowbit.Fp8WeightOnly("tensor"), "fp8-block": torch_lowbit.Fp8WeightOnly("block", (16, 32)),
                "int8": torch_lowbit.Int8Dynamic()}  # fp8 per channel: the MoE round trip below


@pytest.mark.parametrize("name", sorted(SAVE_CONFIGS))
def test_save_quantized_is_read_back_by_compressed_tensors_and_by_us(tmp_path, name):
    model = torch_lowbit.quantize_(W.tiny_model("llama"), SAVE_CONFIGS[name])
    shards = name == "fp8-block"
    files = torch_lowbit.save_quantized(model, tmp_path, max_shard_size=30_000 if shards else 4 * 2 ** 30)
    assert os.path.exists(tmp_path / "model.safetensors.index.json") == shards and (len(files) > 2) == shards
    qc = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["ignore"] == ["lm_head"]
    theirs = W.ct_dequantized(str(tmp_path))
    for n, m in model.named_modules():  # compressed-tensors dequantizes to exactly our layers' weights
        if isinstance(m, Fp8Linear):
            want = torch_lowbit.fp8_dequantize(m.weight, m.weight_scale, m.block_size, dtype=torch.float32)
        elif isinstance(m, Int8Linear):
            want = m.weight.float() * m.weight_scale[:, None]
        else:
            continue
        assert torch.equal(theirs.get_submodule(n).weight, want), n
    ours = torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(_logits(ours), _logits(model))
    # compressed-tensors' own lifecycle: its scheme on each Linear, decompressed by its compressors on first use
    cfg = transformers.CompressedTensorsConfig(dequantize=False)
    ct_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                                 quantization_config=cfg).eval()
    scheme = ct_model.model.layers[0].mlp.down_proj.quantization_scheme
    assert scheme.weights.strategy == {"fp8-tensor": "tensor", "fp8-block": "block"}.get(name, "channel")
    assert scheme.weights.type == ("int" if name == "int8" else "float")
    # compressed-tensors simulates int8 activations with its own rounding (absmax / 127.5)
    assert _rel_err(_logits(ct_model), _logits(model)) <= (5e-2 if name == "int8" else 1e-6)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_save_quantized_moe_round_trip(checkpoints, tmp_path, arch):
    path, ref = checkpoints(arch, "ct", "fp8-channel")  # block-scaled MoE: see hf_writers.WRITER_RELOAD_FAILS
    model = torch_lowbit.from_pretrained(path, dtype=torch.float32)
    torch_lowbit.save_quantized(model, tmp_path)
    from safetensors import safe_open
    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    leaf = "block_sparse_moe.experts.2.w3" if arch == "mixtral" else "mlp.experts.2.up_proj"
    assert f"model.layers.1.{leaf}.weight" in keys and f"model.layers.1.{leaf}.weight_scale" in keys
    assert torch.equal(_logits(W.ct_dequantized(str(tmp_path))), _logits(ref))
    assert torch.equal(_logits(torch_lowbit.from_pretrained(tmp_path, dtype=torch.float32)), _logits(model))


def test_save_quantized_needs_quantized_layers(tmp_path):
    with pytest.raises(ValueError, match="no torch_lowbit layer"):
        torch_lowbit.save_quantized(W.tiny_model("llama"), tmp_path)


def test_without_transformers_the_message_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"need transformers: pip install 'torch_lowbit\[hf\]'"):
        torch_lowbit.from_pretrained(tmp_path)


def test_from_pretrained_refuses_a_dense_checkpoint(tmp_path):
    W.tiny_model("llama").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no quantization_config"):
        torch_lowbit.from_pretrained(tmp_path)


# ------------------------------------------------------------------------------ quantizing while transformers loads
@pytest.mark.parametrize("arch,weights", [("llama", "int8"), ("qwen3_moe", "fp8")])
def test_transformers_from_pretrained_with_torch_lowbit_config_quantizes_while_loading(tmp_path, arch, weights):
    dense = W.tiny_model(arch)
    dense.save_pretrained(tmp_path)
    config = torch_lowbit.TorchLowbitConfig(weights, "block", (16, 32))
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                              quantization_config=config)
    # the same model quantized by hand, from the same dense weights
    want = torch_lowbit.quantize_(W.tiny_model(arch), config.quantize_config())
    for name, m in list(want.named_modules()):
        if hasattr(m, "gate_up_proj"):
            want.set_submodule(name, Fp8Experts.from_float(m.gate_up_proj.detach(), m.down_proj.detach(), "block",
                                                           (16, 32)))
    layer = Int8Linear if weights == "int8" else Fp8Linear
    assert isinstance(model.model.layers[0].self_attn.q_proj, layer) and type(model.lm_head) is nn.Linear
    assert (arch == "qwen3_moe") == isinstance(getattr(model.model.layers[1].mlp, "experts", None), Fp8Experts)
    assert torch.equal(_logits(model), _logits(want))
    with pytest.raises(ValueError, match="weights must be one of"):
        torch_lowbit.TorchLowbitConfig("int3")


def test_e2e_bench_suite_runs_and_writes_json(tmp_path, capsys, scheme="fp8-block"):
    from torch_lowbit.bench import __main__ as bench_main
    path = tmp_path / "e2e.json"
    argv = ["--suite", "e2e", "--scheme", scheme, "--hidden", "136", "--intermediate", "200", "--layers", "1",
            "--heads", "2", "--kv-heads", "1", "--vocab", "97", "--tokens", "3", "--repeat", "1", "--json", str(path)]
    assert bench_main.main(argv) == 0
    assert "LlamaForCausalLM" in capsys.readouterr().out
    rows = json.loads(path.read_text())["rows"]
    assert [r["model"] for r in rows] == ["bf16", f"{scheme} (torch_lowbit)"]
    assert rows[1]["memory_vs_bf16"] < 0.9 and all(r["tok_s"] > 0 for r in rows)


def test_a_transformers_conversion_other_than_expert_stacking_is_refused(checkpoints):
    from transformers.conversion_mapping import register_checkpoint_conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    class TransposedDownLlama(transformers.LlamaForCausalLM):  # a class name no real model has
        pass
    register_checkpoint_conversion_mapping("TransposedDownLlama", [WeightConverter(
        "mlp.down_proj.weight", "mlp.down_proj.weight", operations=[Transpose(0, 1)])], overwrite=True)
    path, _ = checkpoints("llama", "ct", "fp8-channel")
    with torch.device("meta"):
        model = TransposedDownLlama(W.tiny_config("llama"))
    with pytest.raises(CheckpointError, match=r"transformers converts model\.layers\.0\.mlp\.down_proj\.weight "
                                              r"\(Transpose\).*cannot apply"):
        load_quantized(model, path)
