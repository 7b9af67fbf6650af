"""4-bit checkpoints from the real writers (llmcompressor 0.14, mlx_lm.convert; see w4_writers.py) load with
from_pretrained into W4Linear layers that compute what the writer's own dequantized model computes, and
save_quantized writes them back as compressed-tensors that transformers and torch_lowbit read."""
import json
import os

import pytest
import torch

import torch_lowbit
from torch_lowbit.formats import CheckpointError
from torch_lowbit.nn.w4_linear import W4Linear

import w4_writers as W4

LAYER_LINEARS = 7 * W4.LAYERS  # q, k, v, o, gate, up, down per layer
# every scheme on Llama; Qwen3 (q/k norms, another conversion mapping) on two, to keep the writer's time small
LLMC_CASES = [("llama", scheme) for scheme in W4.LLMC_SCHEMES] + [("qwen3", "W4A16_ASYM"), ("qwen3", "NVFP4A16")]
MLX_CASES = [("llama", "affine-g64"), ("qwen3", "affine-g64"), ("llama", "affine-g32"), ("llama", "mxfp4"),
             ("llama", "nvfp4")]
W4_FORMAT = {"W4A16": "int4", "W4A16_ASYM": "int4", "GPTQ": "int4", "NVFP4A16": "nvfp4", "MXFP4A16": "mxfp4"}


@pytest.fixture(scope="session")
def dense_dirs(tmp_path_factory):
    return W4.write_dense_archs(tmp_path_factory.mktemp("w4-dense"), W4.ARCHS)


@pytest.fixture(scope="session")
def llmc_written(tmp_path_factory, dense_dirs):
    """Every (arch, scheme) written by llmcompressor once per session, in one subprocess."""
    return W4.write_llmcompressor_cases(tmp_path_factory.mktemp("w4-llmc"), dense_dirs, LLMC_CASES)


@pytest.fixture(scope="session")
def mlx_written(tmp_path_factory, dense_dirs):
    """(checkpoint, mlx's own dequantized reference) for each MLX case, once per session."""
    return W4.write_mlx_cases(tmp_path_factory.mktemp("w4-mlx"), dense_dirs, MLX_CASES + [("llama", "mixed-3-4")],
                              without_reference=("mixed-3-4",))


def _ours(path):
    return torch_lowbit.from_pretrained(path, dtype=torch.float32, device="cpu", return_report=True)


# ------------------------------------------------------------------------------------------------ llmcompressor
@pytest.mark.parametrize("arch,scheme", LLMC_CASES)
def test_llmcompressor_checkpoint_computes_the_writers_dequantized_model(llmc_written, tmp_path, arch, scheme):
    path = llmc_written[arch, scheme]
    ours, report = _ours(path)
    w4 = [m for m in ours.modules() if isinstance(m, W4Linear)]
    assert len(w4) == LAYER_LINEARS and {m.format for m in w4} == {W4_FORMAT[scheme]}
    assert report.high_precision == {"lm_head": "in the ignore list"} and not report.unused_keys
    assert (scheme == "W4A16_ASYM") == all(m.weight_offset is not None for m in w4)
    W4.assert_same_model(ours, W4.dense_model(W4.ct_float64_reference(path, tmp_path / "ref")))
    if scheme != "NVFP4A16":  # compressed-tensors' own nvfp4 decompression rounds scale / global_scale to bf16
        theirs = W4.transformers_reload(path)
        W4.assert_same_model(ours, theirs)


@pytest.mark.parametrize("arch,scheme", LLMC_CASES)
def test_save_quantized_of_a_llmcompressor_checkpoint_reads_back_in_transformers(llmc_written, tmp_path, arch,
                                                                                 scheme):
    from safetensors.torch import load_file

    path = llmc_written[arch, scheme]
    ours, _ = _ours(path)
    torch_lowbit.save_quantized(ours, tmp_path / "saved")
    written, original = (load_file(os.path.join(p, "model.safetensors")) for p in (tmp_path / "saved", path))
    assert set(written) == set(original)
    for k, t in original.items():  # the writer's bytes, except nvfp4's divisor (see ct_w4.global_divisor)
        if not k.endswith("weight_global_scale"):
            assert torch.equal(written[k].view(torch.uint8), t.view(torch.uint8)), k
    again, _ = _ours(tmp_path / "saved")
    assert torch.equal(W4.logits(again), W4.logits(ours))
    if scheme == "NVFP4A16":
        W4.assert_same_model(ours, W4.dense_model(W4.ct_float64_reference(tmp_path / "saved", tmp_path / "ref")))
    else:
        W4.assert_same_model(ours, W4.transformers_reload(tmp_path / "saved"))


# --------------------------------------------------------------------------------------------------------- mlx
@pytest.mark.parametrize("arch,case", MLX_CASES)
def test_mlx_checkpoint_computes_mlx_dequantized_model(mlx_written, arch, case):
    path, ref = mlx_written[arch, case]
    ours, report = _ours(path)
    fmt = {"mxfp4": "mxfp4", "nvfp4": "nvfp4"}.get(case, "uint4")
    w4 = {n: m for n, m in ours.named_modules() if isinstance(m, W4Linear)}
    assert len(w4) == LAYER_LINEARS + 1 and "lm_head" in w4  # MLX quantizes lm_head too
    assert {m.format for m in w4.values()} == {fmt} and not report.unused_keys
    reference = W4.dense_model(ref)
    # the quantized embedding is dequantized once at load, by the same arithmetic as mlx's
    assert torch.allclose(ours.model.embed_tokens.weight, reference.model.embed_tokens.weight, rtol=2 ** -23, atol=0)
    W4.assert_same_model(ours, reference)


def test_mlx_checkpoint_with_3bit_layers_is_refused_by_name(mlx_written):
    path, _ = mlx_written["llama", "mixed-3-4"]
    with pytest.raises(CheckpointError, match=r"bits is 3: torch_lowbit reads 4-bit MLX weights only"):
        torch_lowbit.from_pretrained(path, dtype=torch.float32, device="cpu")


def test_save_quantized_refuses_mlx_affine_weights_with_the_reason(mlx_written, tmp_path):
    path, _ = mlx_written["llama", "affine-g64"]
    ours, _ = _ours(path)
    with pytest.raises(ValueError, match=r"format 'uint4' .* has no compressed-tensors form"):
        torch_lowbit.save_quantized(ours, tmp_path / "saved")
    assert not os.path.exists(tmp_path / "saved")


@pytest.mark.parametrize("case", ["mxfp4", "nvfp4"])
def test_mlx_fp4_checkpoint_saves_as_compressed_tensors_torch_lowbit_reads_back(mlx_written, tmp_path, case):
    """MLX's mxfp4 / nvfp4 (no global scale) are compressed-tensors' layouts with other names: written as
    mxfp4- / nvfp4-pack-quantized (the embedding dense, as loaded), they load back to the same logits."""
    path, _ = mlx_written["llama", case]
    ours, _ = _ours(path)
    torch_lowbit.save_quantized(ours, tmp_path / "saved")
    with open(tmp_path / "saved" / "config.json") as f:
        assert json.load(f)["quantization_config"]["format"] == f"{case}-pack-quantized"
    again, _ = _ours(tmp_path / "saved")
    assert torch.equal(W4.logits(again), W4.logits(ours))
