"""Parameter counts of quantized models. The low-bit weights are buffers, which ``parameters()`` does not list:
transformers' ``num_parameters()``, PEFT's ``print_trainable_parameters`` and a diffusers model's
``num_parameters()`` (test_diffusers) count each of them once per weight, as the dense parameter it stands for.
The reference is the dense model's own count, before quantization."""
import copy

import pytest
import torch
import torch.nn as nn

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

import hf_writers as W  # noqa: E402
import torch_lowbit  # noqa: E402
from test_peft import LOW_BIT_CONFIGS, plain_lora, tiny_llama  # noqa: E402
from torch_lowbit.nn import Fp8Linear, W4Linear, low_bit_parameter_count  # noqa: E402


def _counts(model):
    return model.num_parameters(), model.num_parameters(exclude_embeddings=True)


def _trainable(model):
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


@LOW_BIT_CONFIGS
def test_a_quantized_llama_counts_as_the_dense_one_in_transformers_and_peft(config, capsys):
    dense = tiny_llama(1, biases=True)  # biases: the layers' own parameters, counted once
    model = torch_lowbit.quantize_(copy.deepcopy(dense), config, filter_fn=lambda m, fqn: True)
    assert sum(isinstance(m, torch_lowbit.peft.LOW_BIT_LAYERS) for m in model.modules()) == 8
    assert _counts(model) == _counts(dense)
    assert model.num_parameters(only_trainable=True) == _trainable(model) < dense.num_parameters()
    pm, pd = peft.get_peft_model(model, plain_lora()), peft.get_peft_model(copy.deepcopy(dense), plain_lora())
    assert pm.get_nb_trainable_parameters() == pd.get_nb_trainable_parameters()
    pm.print_trainable_parameters()
    pd.print_trainable_parameters()
    ours, theirs = capsys.readouterr().out.splitlines()
    assert ours == theirs and "all params: " in ours


@pytest.mark.parametrize("config", [torch_lowbit.Fp8WeightOnly(), torch_lowbit.Int8Dynamic(),
                                    torch_lowbit.Int4WeightOnly(16, symmetric=False)], ids=["fp8", "int8", "int4"])
def test_quantized_fused_experts_count_as_the_dense_experts(config):
    dense = W.tiny_model("qwen3_moe")
    model = torch_lowbit.quantize_(copy.deepcopy(dense), config)
    assert type(model.model.layers[0].mlp.experts).__name__.endswith("Experts")
    assert _counts(model) == _counts(dense)
    lora = dict(r=4, target_modules=["q_proj", "v_proj"])
    assert (peft.get_peft_model(model, peft.LoraConfig(**lora)).get_nb_trainable_parameters()
            == peft.get_peft_model(copy.deepcopy(dense), peft.LoraConfig(**lora)).get_nb_trainable_parameters())


def test_gptoss_experts_count_their_biases_too():
    from test_gptoss import GptOssForCausalLM, tiny_config
    torch.manual_seed(0)
    dense = GptOssForCausalLM(tiny_config()).eval()
    model = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Mxfp4WeightOnly(),
                                   lambda m, fqn: not isinstance(m, nn.Linear))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_bias is not None and "gate_up_bias" in dict(experts.named_buffers())
    assert _counts(model) == _counts(dense)


def test_the_dequantized_model_counts_its_own_parameters_again():
    dense = tiny_llama(1)
    model = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Fp8WeightOnly())
    assert "num_parameters" in vars(model)
    model.dequantize()
    assert "num_parameters" not in vars(model) and _counts(model) == _counts(dense)


def test_a_layer_held_twice_counts_once_as_parameters_do():
    torch.manual_seed(0)
    shared = nn.Linear(48, 48)
    dense = nn.Sequential(shared, nn.ReLU(), shared, nn.Linear(48, 20))
    model = torch_lowbit.quantize_(copy.deepcopy(dense), torch_lowbit.Int4WeightOnly(16),
                                   filter_fn=lambda m, fqn: True)
    assert model[0] is model[2] and isinstance(model[0], W4Linear)
    assert low_bit_parameter_count(model) == 48 * 48 + 20 * 48
    # with the float parameters (the biases), the dense model's count
    assert low_bit_parameter_count(model) + sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in dense.parameters())
    assert low_bit_parameter_count(Fp8Linear.from_float(nn.Linear(5, 3))) == 15
