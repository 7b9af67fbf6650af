"""quantize_ on diffusers models: the diffusion default filter (torch_lowbit.diffusion), FLUX / SD3 / Wan transformers
of diffusers built with small dims, torch.compile(fullgraph=True) of the quantized transformer, and a FluxPipeline of
tiny locally built components (transformers' CLIP and T5 encoders, word-level tokenizers built in memory: no files,
no network) running end to end with its transformer quantized, moved with .to() and with enable_model_cpu_offload."""
import copy

import pytest
import torch
import torch.nn as nn

import torch_lowbit
from reference import fp8_weight_f64
from torch_lowbit.diffusion import diffusion_filter, diffusion_skip_reason, is_diffusers_model
from torch_lowbit.nn import Fp8Linear, Int8Linear

diffusers = pytest.importorskip("diffusers")

CONFIGS = {"fp8": torch_lowbit.Fp8WeightOnly(), "int8": torch_lowbit.Int8Dynamic()}
LAYER = {"fp8": Fp8Linear, "int8": Int8Linear}
# max |y - y_dense| / max |y_dense| of one forward of the tiny models (random weights, 1-2 blocks): measured
# 0.2-0.9 % for fp8 (e4m3: 3 mantissa bits) and 0.05-0.3 % for int8 (per-channel weights, per-token activations);
# a wrong scale or a swapped layer is off by orders of magnitude
MODEL_ERR = {"fp8": 0.03, "int8": 0.015}


def _flux():
    return diffusers.FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                            pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])


def _flux_inputs(g, S=16, T=8):
    """inputs of the tiny FLUX transformers (in_channels 4, joint and pooled width 32): S image, T text tokens"""
    return dict(hidden_states=torch.randn(1, S, 4, generator=g),
                encoder_hidden_states=torch.randn(1, T, 32, generator=g),
                pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                img_ids=torch.randn(S, 3, generator=g), txt_ids=torch.randn(T, 3, generator=g))


def _sd3():
    return diffusers.SD3Transformer2DModel(sample_size=8, patch_size=1, in_channels=4, num_layers=1,
                                           attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
                                           joint_attention_dim=32, pooled_projection_dim=64, out_channels=4)


def _sd3_inputs(g):
    return dict(hidden_states=torch.randn(1, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 6, 32, generator=g),
                pooled_projections=torch.randn(1, 64, generator=g), timestep=torch.tensor([10.0]))


def _wan():
    return diffusers.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                           in_channels=16, out_channels=16, text_dim=32, freq_dim=256, ffn_dim=32,
                                           num_layers=1, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                                           rope_max_seq_len=32)


def _wan_inputs(g):
    return dict(hidden_states=torch.randn(1, 16, 2, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(1, 6, 32, generator=g), timestep=torch.tensor([10]))


# model -> (builder, inputs, the nn.Linear layers the diffusion default keeps in high precision)
_EMBEDDERS = ["time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2",
              "time_text_embed.text_embedder.linear_1", "time_text_embed.text_embedder.linear_2", "context_embedder"]
MODELS = {
    "flux": (_flux, _flux_inputs, _EMBEDDERS + ["x_embedder", "norm_out.linear", "proj_out"]),
    "sd3": (_sd3, _sd3_inputs, _EMBEDDERS + ["norm_out.linear", "proj_out"]),
    "wan": (_wan, _wan_inputs, [f"condition_embedder.{n}" for n in (
        "time_embedder.linear_1", "time_embedder.linear_2", "time_proj", "text_embedder.linear_1",
        "text_embedder.linear_2")] + ["proj_out"]),
}


def _rel(y, ref):
    return float((y.double() - ref.double()).abs().max() / ref.double().abs().max())


@pytest.mark.parametrize("fqn,kept", [
    ("x_embedder", True), ("context_embedder", True), ("time_text_embed.timestep_embedder.linear_1", True),
    ("condition_embedder.image_embedder.ff.net.0.proj", True), ("time_guidance_embed.linear_1", True),
    ("down_blocks.0.resnets.0.time_emb_proj", True), ("img_in", True), ("txt_in", True), ("proj_out", True),
    ("norm_out.linear", True), ("caption_projection.linear_1", True), ("proj_in", True),
    # block layers, named like the entry / exit layers only below the top level
    ("single_transformer_blocks.3.proj_out", False), ("down_blocks.1.attentions.0.proj_in", False),
    ("transformer_blocks.0.norm1.linear", False), ("transformer_blocks.0.attn.to_q", False),
    ("single_transformer_blocks.0.proj_mlp", False), ("blocks.2.ffn.net.2", False),
    ("double_stream_modulation_img.linear", False), ("", False),
])
def test_diffusion_skip_rule(fqn, kept):
    reason = diffusion_skip_reason(fqn)
    assert (reason is not None) == kept, (fqn, reason)
    assert diffusion_filter(nn.Linear(2, 2), fqn) is (not kept)
    if kept:
        assert reason.startswith("diffusion default: ")


def _dequantized_reference(qmodel, dense):
    """The dense model in float64 whose converted layers hold exactly the fp8 weights times their scales."""
    ref = copy.deepcopy(dense).double()
    for name, layer in qmodel.named_modules():
        if isinstance(layer, Fp8Linear):
            lin = ref.get_submodule(name)
            lin.weight.data = fp8_weight_f64(layer.weight.view(torch.uint8), layer.weight_scale)
    return ref


@pytest.mark.parametrize("scheme", CONFIGS)
@pytest.mark.parametrize("model", MODELS)
def test_quantize_diffusers_transformer(model, scheme):
    build, inputs, kept = MODELS[model]
    torch.manual_seed(0)
    dense = build().eval()
    assert is_diffusers_model(dense)
    x = inputs(torch.Generator().manual_seed(1))
    q, report = torch_lowbit.quantize_(copy.deepcopy(dense), CONFIGS[scheme], return_report=True)
    # the diffusion default, not the transformers one: embedders and the final layer stay nn.Linear
    assert sorted(report.skipped) == sorted(kept)
    assert all(type(q.get_submodule(n)) is nn.Linear for n in kept)
    linears = [n for n, m in dense.named_modules() if isinstance(m, nn.Linear)]
    assert sorted(report.converted) == sorted(set(linears) - set(kept))
    assert all(type(q.get_submodule(n)) is LAYER[scheme] for n in report.converted)
    with torch.no_grad():
        y_dense = dense(**x, return_dict=False)[0]
        y = q(**x, return_dict=False)[0]
        err = _rel(y, y_dense)
        assert 0 < err < MODEL_ERR[scheme], err
        if scheme == "fp8":  # the same model on the exact dequantized weights, in float64
            ref = _dequantized_reference(q, dense)
            y_ref = ref(**{k: v.double() if v.is_floating_point() else v for k, v in x.items()}, return_dict=False)[0]
            assert _rel(y, y_ref) < 1e-5
        torch._dynamo.reset()
        compiled = torch.compile(q, fullgraph=True, backend="eager")  # a graph break anywhere is an error
        torch.testing.assert_close(compiled(**x, return_dict=False)[0], y, rtol=1e-6, atol=1e-6)


def test_quantize_diffusers_explicit_filter_replaces_the_default():
    torch.manual_seed(0)
    q, report = torch_lowbit.quantize_(_flux(), CONFIGS["fp8"], filter_fn=lambda m, fqn: fqn != "proj_out",
                                       return_report=True)
    assert report.skipped == {"proj_out": "filter_fn returned False"}
    assert isinstance(q.x_embedder, Fp8Linear)
    # the rule passed by hand on any module gives the diffusion reasons
    plain = nn.ModuleDict({"x_embedder": nn.Linear(4, 8), "blocks": nn.ModuleList([nn.Linear(8, 8)])})
    _, report = torch_lowbit.quantize_(plain, CONFIGS["int8"], filter_fn=torch_lowbit.diffusion_filter,
                                       return_report=True)
    assert report.skipped == {"x_embedder": "diffusion default: an embedder (x_embedder)"}
    assert list(report.converted) == ["blocks.0"]


@pytest.mark.parametrize("scheme", CONFIGS)
def test_quantized_flux_compiles_fullgraph_with_inductor(scheme):
    torch.manual_seed(0)
    q = torch_lowbit.quantize_(_flux().to(torch.bfloat16).eval(), CONFIGS[scheme])
    x = {k: v.to(torch.bfloat16) if k != "timestep" and v.is_floating_point() else v
         for k, v in _flux_inputs(torch.Generator().manual_seed(1)).items()}
    torch._dynamo.reset()
    compiled = torch.compile(q, fullgraph=True)
    with torch.no_grad():
        y = q(**x, return_dict=False)[0]
        yc = compiled(**x, return_dict=False)[0]
    assert yc.dtype == torch.bfloat16
    # inductor fuses the bf16 glue around the low-bit ops (norms, modulation) with other roundings
    assert _rel(yc, y) < 2e-2


# ------------------------------------------------------------------------------------------------ FluxPipeline
def _word_tokenizer(max_length):
    """A word-level tokenizer built in memory (no vocabulary files): enough for the pipeline's padding and
    truncation to max_length."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<unk>", "</s>", "a", "photo", "of", "the", "red", "cat", "dog"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>",
                                   model_max_length=max_length)


@pytest.fixture(scope="module")
def tiny_flux_pipeline():
    """FluxPipeline of tiny random components, shaped like diffusers' own FLUX pipeline tests."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=10, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        projection_dim=32, max_position_embeddings=77, pad_token_id=0, bos_token_id=2, eos_token_id=2)).eval()
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=10, d_model=32, d_ff=37, d_kv=8, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=2)).eval()
    vae = diffusers.AutoencoderKL(sample_size=32, in_channels=3, out_channels=3, block_out_channels=(4,),
                                  layers_per_block=1, latent_channels=1, norm_num_groups=1, use_quant_conv=False,
                                  use_post_quant_conv=False, shift_factor=0.0609, scaling_factor=1.5035)
    pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=clip,
                                  tokenizer=_word_tokenizer(77), text_encoder_2=t5, tokenizer_2=_word_tokenizer(16),
                                  transformer=_flux().eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _image(pipe, **kwargs):
    with torch.no_grad():
        return pipe("a photo of a red cat", num_inference_steps=2, guidance_scale=3.5, height=32, width=32,
                    max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0),
                    **kwargs).images


def _with_transformer(pipe, transformer):
    return diffusers.FluxPipeline(**{**pipe.components, "transformer": transformer})


def test_quantize_a_pipeline_names_its_transformer(tiny_flux_pipeline):
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got FluxPipeline; .*quantize_\(pipe.transformer, "
                                        r"config\)"):
        torch_lowbit.quantize_(tiny_flux_pipeline, CONFIGS["fp8"])
    with pytest.raises(TypeError, match=r"model must be an nn.Module, got dict$"):
        torch_lowbit.quantize_({}, CONFIGS["fp8"])


@pytest.mark.parametrize("scheme", CONFIGS)
def test_flux_pipeline_end_to_end_quantized(tiny_flux_pipeline, scheme):
    dense = tiny_flux_pipeline
    ref = _image(dense)
    assert ref.shape == (1, 3, 32, 32) and torch.isfinite(ref).all()
    pipe = _with_transformer(dense, torch_lowbit.quantize_(copy.deepcopy(dense.transformer), CONFIGS[scheme]))
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe.transformer.transformer_blocks[0].attn.to_q, LAYER[scheme])
    img = _image(pipe)
    err = _rel(img, ref)
    assert img.shape == ref.shape and 0 < err < MODEL_ERR[scheme], err
    # the pipeline's own device handling: .to() and model cpu offload (accelerate's hooks move each model to the
    # execution device when it runs, and back): the same image
    pipe.to("cpu")
    torch.testing.assert_close(_image(pipe), img, rtol=0, atol=0)
    pipe.enable_model_cpu_offload(device="cpu")
    try:
        torch.testing.assert_close(_image(pipe), img, rtol=0, atol=0)
    finally:
        pipe.remove_all_hooks()


@pytest.mark.skipif(not torch.backends.mps.is_available(), reason="needs an Apple GPU (mps device)")
@pytest.mark.parametrize("scheme", CONFIGS)
def test_flux_pipeline_quantized_on_mps(tiny_flux_pipeline, scheme):
    pipe = _with_transformer(tiny_flux_pipeline,
                             torch_lowbit.quantize_(copy.deepcopy(tiny_flux_pipeline.transformer), CONFIGS[scheme]))
    pipe.set_progress_bar_config(disable=True)
    on_cpu = _image(pipe)
    pipe.to("mps")
    assert pipe.transformer.transformer_blocks[0].attn.to_q.weight.device.type == "mps"
    torch.testing.assert_close(_image(pipe).cpu(), on_cpu, rtol=0, atol=2e-3)
    pipe.to("cpu")
    pipe.enable_model_cpu_offload(device="mps")
    try:
        torch.testing.assert_close(_image(pipe).cpu(), on_cpu, rtol=0, atol=2e-3)
    finally:
        pipe.remove_all_hooks()
