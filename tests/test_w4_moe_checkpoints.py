"""4-bit MoE checkpoints: llmcompressor's W4A16 / NVFP4A16 and mlx_lm.convert's 4-bit of tiny Qwen3-MoE and Mixtral
models (the real writers, see w4_writers.py) load with from_pretrained into W4Experts (the experts stacked, gate rows
then up rows) that compute what the writer's own dequantized model computes; save_quantized writes them back one
compressed-tensors Linear per expert and projection, which transformers and torch_lowbit read; and loading a
4-bit MoE checkpoint peaks near its file size."""
import json
import os
import shutil

import pytest
import torch

import torch_lowbit
from torch_lowbit.formats import CheckpointError
from torch_lowbit.nn.w4_experts import W4Experts

import w4_writers as W4
from peak_memory import linux_only, peak_growth

LLMC_CASES = [(arch, scheme) for arch in W4.MOE_ARCHS for scheme in ("W4A16", "NVFP4A16")]
W4_FORMAT = {"W4A16": "int4", "NVFP4A16": "nvfp4"}
# the per-expert leaf names each writer uses for (gate, up, down) in the checkpoint
LEAVES = {"mixtral": ("w1", "w3", "w2")}


@pytest.fixture(scope="session")
def moe_dense_dirs(tmp_path_factory):
    return W4.write_dense_archs(tmp_path_factory.mktemp("w4-moe-dense"), W4.MOE_ARCHS)


@pytest.fixture(scope="session")
def moe_llmc_written(tmp_path_factory, moe_dense_dirs):
    return W4.write_llmcompressor_cases(tmp_path_factory.mktemp("w4-moe-llmc"), moe_dense_dirs, LLMC_CASES)


@pytest.fixture(scope="session")
def moe_mlx_written(tmp_path_factory, moe_dense_dirs):
    """(checkpoint, mlx's own dequantized reference) per MoE architecture, MLX affine with groups of 64."""
    paths = W4.write_mlx_cases(tmp_path_factory.mktemp("w4-moe-mlx"), moe_dense_dirs,
                               [(arch, "affine-g64") for arch in W4.MOE_ARCHS])
    return {arch: paths[arch, "affine-g64"] for arch in W4.MOE_ARCHS}


def _ours(path):
    return torch_lowbit.from_pretrained(path, dtype=torch.float32, device="cpu", return_report=True)


def _experts(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, W4Experts)}


# ------------------------------------------------------------------------------------------------ llmcompressor
@pytest.mark.parametrize("arch,scheme", LLMC_CASES)
def test_llmcompressor_moe_checkpoint_computes_the_writers_dequantized_model(moe_llmc_written, tmp_path, arch,
                                                                             scheme):
    path = moe_llmc_written[arch, scheme]
    ours, report = _ours(path)
    experts = _experts(ours)
    assert sorted(experts) == [f"model.layers.{i}.mlp.experts" for i in range(W4.LAYERS)]
    assert {(m.format, m.num_experts, m.hidden_size, m.intermediate_size) for m in experts.values()} == {
        (W4_FORMAT[scheme], W4.EXPERTS, W4.H, W4.MOE_I)}
    assert all((m.gate_up_scale_2 is not None) == (scheme == "NVFP4A16") for m in experts.values())
    assert all(report.converted[n].startswith(f"W4Experts(E={W4.EXPERTS}, {W4_FORMAT[scheme]}") for n in experts)
    assert report.high_precision == {"lm_head": "in the ignore list"} and not report.unused_keys
    W4.assert_same_model(ours, W4.dense_model(W4.ct_float64_reference(path, tmp_path / "ref")))
    if (arch, scheme) == ("qwen3_moe", "W4A16"):
        # where the writer's stack reads its own MoE checkpoint: transformers cannot read llmcompressor's Mixtral
        # experts names, and compressed-tensors 0.20 decompresses stacked nvfp4 experts wrong
        W4.assert_same_model(ours, W4.transformers_reload(path))


@pytest.mark.parametrize("arch,scheme", [("qwen3_moe", "NVFP4A16"), ("mixtral", "W4A16")])  # each format, each arch
def test_save_quantized_of_a_llmcompressor_moe_checkpoint_reads_back(moe_llmc_written, tmp_path, arch, scheme):
    """The writer's bytes come back one Linear per expert and projection, under the names the architecture's
    checkpoints use (Mixtral: block_sparse_moe.experts.{e}.w1 / w3 / w2, which transformers reads; llmcompressor
    writes its linearized gate_proj / up_proj / down_proj there); torch_lowbit reads them back to the same logits,
    transformers' decompression (int4) or the float64 reference (nvfp4: compressed-tensors 0.20 decompresses
    stacked nvfp4 experts wrong) to the writer's model."""
    from safetensors.torch import load_file

    path = moe_llmc_written[arch, scheme]
    ours, _ = _ours(path)
    torch_lowbit.save_quantized(ours, tmp_path / "saved")
    written, original = (load_file(os.path.join(p, "model.safetensors")) for p in (tmp_path / "saved", path))
    leaves = LEAVES.get(arch)
    if leaves:
        original = {W4._renamed(k, {f".{p}_proj.": f".{leaf}." for p, leaf in zip(("gate", "up", "down"), leaves)})
                    if ".experts." in k else k: v for k, v in original.items()}
    assert set(written) == set(original)
    for k, t in original.items():  # the writer's bytes, except nvfp4's divisor (see ct_w4.global_divisor)
        if not k.endswith("weight_global_scale"):
            assert torch.equal(written[k].view(torch.uint8), t.view(torch.uint8)), k
    again, report = _ours(tmp_path / "saved")
    assert set(_experts(again)) == set(_experts(ours)) and not report.unused_keys
    assert torch.equal(W4.logits(again), W4.logits(ours))
    if scheme == "NVFP4A16":
        W4.assert_same_model(ours, W4.dense_model(W4.ct_float64_reference(tmp_path / "saved", tmp_path / "ref")))
    else:
        W4.assert_same_model(ours, W4.transformers_reload(tmp_path / "saved"))


def test_save_pretrained_of_a_loaded_moe_model_writes_what_transformers_reads(moe_llmc_written, tmp_path):
    ours, _ = _ours(moe_llmc_written["qwen3_moe", "W4A16"])
    ours.save_pretrained(tmp_path / "saved")
    W4.assert_same_model(ours, W4.transformers_reload(tmp_path / "saved"))


def test_gate_and_up_with_different_global_scales_are_refused(moe_llmc_written, tmp_path):
    """W4Experts holds one nvfp4 global scale per expert for gate_up: an up_proj whose divisor differs from its
    gate_proj's (llmcompressor fuses them; another writer might not) cannot be stacked without changing it."""
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(moe_llmc_written["qwen3_moe", "NVFP4A16"], path)
    sd = load_file(path / "model.safetensors")
    key = "model.layers.1.mlp.experts.2.up_proj.weight_global_scale"
    sd[key] = sd[key] * 2
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.2\.up_proj's global scale .* differs from the gate "
                                              r"projection's"):
        _ours(path)


def test_experts_in_two_formats_are_refused(moe_llmc_written, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "ckpt"
    shutil.copytree(moe_llmc_written["qwen3_moe", "W4A16"], path)
    sd = load_file(path / "model.safetensors")
    prefix = "model.layers.0.mlp.experts.3.down_proj"
    for k in [k for k in sd if k.startswith(prefix + ".")]:
        del sd[k]
    sd[prefix + ".weight"] = torch.zeros(W4.H, W4.MOE_I)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj holds no 4-bit weight while "
                                              r".*experts\.0\.gate_proj does"):
        _ours(path)


# --------------------------------------------------------------------------------------------------------- mlx
@pytest.mark.parametrize("arch", W4.MOE_ARCHS)
def test_mlx_moe_checkpoint_computes_mlx_dequantized_model(moe_mlx_written, arch):
    path, ref = moe_mlx_written[arch]
    ours, report = _ours(path)
    experts = _experts(ours)
    assert len(experts) == W4.LAYERS and {m.format for m in experts.values()} == {"uint4"}
    assert all(m.group_size == 64 and m.gate_up_offset is not None for m in experts.values())
    assert not report.unused_keys
    reference = W4.dense_model(ref)
    # mlx_lm keeps Qwen3-MoE's routers at 8 bits: dequantized once at load, q * scale + bias in fp32 as mlx does
    for i in range(W4.LAYERS):
        gate, want = (m.model.layers[i].mlp.gate.weight for m in (ours, reference))
        assert torch.allclose(gate, want, rtol=2 ** -22, atol=0)
    W4.assert_same_model(ours, reference)


def test_mlx_experts_of_another_bit_width_are_refused_by_name(moe_mlx_written, tmp_path):
    """8 bits is read for routers (dequantized at load) but never for experts or linear layers."""
    path = tmp_path / "ckpt"
    shutil.copytree(moe_mlx_written["qwen3_moe"][0], path)
    with open(path / "config.json") as f:
        cfg = json.load(f)
    for key in ("quantization", "quantization_config"):
        if key in cfg:
            cfg[key]["model.layers.1.mlp.switch_mlp.down_proj"] = {"group_size": 64, "bits": 8}
    with open(path / "config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(CheckpointError, match=r"switch_mlp\.down_proj\.bits is 8: torch_lowbit reads 4-bit MLX "
                                              r"weights only"):
        _ours(path)


def test_save_quantized_refuses_mlx_affine_experts_with_the_reason(moe_mlx_written, tmp_path):
    ours, _ = _ours(moe_mlx_written["qwen3_moe"][0])
    with pytest.raises(ValueError, match=r"format 'uint4' .* has no compressed-tensors form"):
        torch_lowbit.save_quantized(ours, tmp_path / "saved")
    assert not os.path.exists(tmp_path / "saved")
    block = ours.model.layers[0].mlp  # its experts alone: the refusal names the expert's projection
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj is a W4Experts of format 'uint4' .* has no "
                                         r"compressed-tensors form"):
        torch_lowbit.save_quantized(block, tmp_path / "saved")
    assert not os.path.exists(tmp_path / "saved")


# ------------------------------------------------------------------------------------------------------ memory
MEM_E, MEM_H, MEM_I, MEM_GROUP = 64, 1024, 1024, 128  # two layers of 64 experts: about 209 MB of int4 experts
_ST_NAMES = {torch.int32: "I32", torch.int64: "I64", torch.bfloat16: "BF16"}


def _write_synthetic_moe(path, experts=MEM_E):
    """A compressed-tensors W4A16 Qwen3-MoE checkpoint written directly, streamed into a .safetensors file (its
    documented layout: a little-endian u64 header length, the JSON header, the data) -- each expert's codes one
    word repeated and its bf16 scales one value, since what is measured is memory and filling is faster than
    drawing 200 MB; experts dominate its size, every other tensor of the model small and dense."""
    import struct

    tf = W4.transformers
    config = tf.Qwen3MoeConfig(vocab_size=64, hidden_size=MEM_H, moe_intermediate_size=MEM_I, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                               num_experts=experts, num_experts_per_tok=2, max_position_embeddings=32,
                               tie_word_embeddings=False)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    tensors = []  # (name, dtype, shape, bytes of one element pattern or the whole tensor)
    for k, t in model.state_dict().items():
        if ".experts." not in k:
            dense = torch.randn(t.shape, generator=g).to(torch.bfloat16)
            tensors.append((k, torch.bfloat16, tuple(t.shape), dense.view(torch.uint8).numpy().tobytes()))
        elif k.endswith("gate_up_proj"):
            block = k[: -len(".gate_up_proj")]
            for e in range(experts):
                for proj, (N, K) in (("gate_proj", (MEM_I, MEM_H)), ("up_proj", (MEM_I, MEM_H)),
                                     ("down_proj", (MEM_H, MEM_I))):
                    p = f"{block}.{e}.{proj}"
                    tensors += [(f"{p}.weight_packed", torch.int32, (N, K // 8), struct.pack("<I", 0x192A3B4C + e)),
                                (f"{p}.weight_scale", torch.bfloat16, (N, K // MEM_GROUP), b"\x24\x3c"),
                                (f"{p}.weight_shape", torch.int64, (2,), struct.pack("<2q", N, K))]
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, _ in tensors:
        n = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    os.makedirs(path)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name, dtype, shape, data in tensors:
            n = torch.Size(shape).numel() * dtype.itemsize
            f.write(data * (n // len(data)))
    data = config.to_dict()
    data["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "ignore": ["lm_head", "re:.*self_attn.*"],
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized",
                                      "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                  "group_size": MEM_GROUP, "symmetric": True}}}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(data, f)
    return os.path.getsize(os.path.join(path, "model.safetensors"))


@linux_only
def test_loading_a_4bit_moe_checkpoint_peaks_near_its_file_size(tmp_path):
    """The load's peak resident growth (the process's high-water mark during the load minus its resident size
    before it) stays within 1.1x the file: experts are stacked one checkpoint tensor at a time, never dense."""
    _write_synthetic_moe(tmp_path / "small", experts=2)
    size = _write_synthetic_moe(tmp_path / "ckpt")
    assert size >= 200e6
    growth, (experts,) = peak_growth(
        tmp_path, warmup="""
            import torch, torch_lowbit
            torch_lowbit.from_pretrained(sys.argv[1], dtype=torch.bfloat16, device="cpu")""",
        load='model = torch_lowbit.from_pretrained(sys.argv[2], dtype=torch.bfloat16, device="cpu")',
        report=['sum(t.numel() * t.element_size() for n, t in model.named_buffers() if ".experts." in n)'],
        args=(tmp_path / "small", tmp_path / "ckpt"), timeout=120)
    assert experts >= 0.95 * size  # the model holds the experts as stored
    assert growth <= 1.1 * size, f"loading peaked {growth / 1e6:.0f} MB above the baseline for a " \
                                 f"{size / 1e6:.0f} MB checkpoint ({growth / size:.2f}x)"


# ---------------------------------------------------------------------------------------- TorchLowbitConfig
@pytest.mark.parametrize("arch", W4.MOE_ARCHS)
@pytest.mark.parametrize("weights", ["int4", "nvfp4", "mxfp4", "uint4"])
def test_torch_lowbit_config_quantizes_moe_experts_to_w4experts(moe_dense_dirs, arch, weights):
    """transformers' from_pretrained with TorchLowbitConfig quantizes the fused experts into W4Experts while it
    loads, computing exactly what quantize_ with the same config makes of the dense model."""
    tf = W4.transformers
    config = torch_lowbit.TorchLowbitConfig(weights)
    model = tf.AutoModelForCausalLM.from_pretrained(moe_dense_dirs[arch], dtype=torch.float32,
                                                    quantization_config=config)
    want = torch_lowbit.quantize_(tf.AutoModelForCausalLM.from_pretrained(moe_dense_dirs[arch], dtype=torch.float32),
                                  config.quantize_config())
    got, expected = _experts(model), _experts(want)
    assert got and got.keys() == expected.keys()
    assert all(m.format == weights for m in got.values())
    ids = torch.tensor([[3, 17, 42, 5, 1, 0, 23]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want(ids).logits)
