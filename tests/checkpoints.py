"""Write tiny synthetic checkpoints of a model in every supported format (independently of the loader), together
with the float64 model holding the very weights the checkpoint encodes."""
import copy
import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from tiny_models import DenseExperts, fp8_dense, make_scale, small_fp8_bits

BF16 = torch.bfloat16

# name -> how the format stores a quantized weight. layout: scale layout (see make_scale); scale_key: suffix;
# scale_dtype; kind fp8/int8; block; pad: compressed-tensors pads block weights to whole blocks; extra: more
# per-module tensors; config: the quantization_config (None: no config.json); modelopt_file: hf_quant_config.json
BLOCK = (16, 32)  # partial blocks: H=48, I=80 are not multiples of 32, N=97 not of 16
SPECS = {
    "modelopt-tensor": dict(layout="tensor0d", scale_key="weight_scale", extra={"input_scale": "scalar"},
                            modelopt_file={"producer": {"name": "modelopt", "version": "0.29"},
                                           "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                                            "exclude_modules": ["lm_head", "*.mlp.gate",
                                                                                "model.layers.1.self_attn.o*"]}}),
    "modelopt-channel": dict(layout="channel", scale_key="weight_scale",
                             config={"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                     "exclude_modules": ["lm_head", "*mlp.gate", "model.layers.1.self_attn.o_proj"]}),
    "ct-fp8-tensor": dict(layout="tensor1", scale_key="weight_scale", scale_dtype=BF16, ct=("float", "tensor")),
    "ct-fp8-channel": dict(layout="channel2d", scale_key="weight_scale", scale_dtype=BF16, ct=("float", "channel")),
    "ct-fp8-block": dict(layout="block", scale_key="weight_scale", scale_dtype=BF16, block=BLOCK, pad=True,
                         ct=("float", "block")),
    "ct-int8": dict(layout="channel2d", scale_key="weight_scale", scale_dtype=BF16, kind="int8",
                    ct=("int", "channel")),
    "ct-naive": dict(layout="channel2d", scale_key="weight_scale", scale_dtype=torch.float32,
                     ct=("float", "channel"), ct_format="naive-quantized"),
    "hf-fp8-block": dict(layout="block", scale_key="weight_scale_inv", block=BLOCK,
                         config={"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                 "weight_block_size": list(BLOCK),
                                 "modules_to_not_convert": ["lm_head", "mlp.gate", "model.layers.1.self_attn.o_proj"]}),
    "hf-fp8-tensor": dict(layout="tensor1", scale_key="weight_scale_inv",
                          config={"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": None,
                                  "modules_to_not_convert": ["lm_head", "mlp.gate", "model.layers.1.self_attn.o_proj"]}),
    "fbgemm": dict(layout="channel2d", scale_key="weight_scale", extra={"input_scale_ub": "scalar"},
                   config={"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                           "modules_to_not_convert": ["lm_head", "mlp.gate", "model.layers.1.self_attn.o_proj"]}),
    "diffusion-raw": dict(layout=None, scale_key=None, config=None),
    "comfy": dict(layout="tensor1", scale_key="scale_weight", extra={"scale_input": "scalar"}, config=None,
                  marker="scaled_fp8"),
}
FORMAT_OF = {"modelopt-tensor": "modelopt", "modelopt-channel": "modelopt", "ct-fp8-tensor": "compressed-tensors",
             "ct-fp8-channel": "compressed-tensors", "ct-fp8-block": "compressed-tensors",
             "ct-int8": "compressed-tensors", "ct-naive": "compressed-tensors", "hf-fp8-block": "fp8",
             "hf-fp8-tensor": "fp8", "fbgemm": "fbgemm_fp8", "diffusion-raw": "diffusion-fp8",
             "comfy": "diffusion-fp8"}
# high precision in every checkpoint (the config's ignore list names them; router gates are never quantized)
KEEP = ("lm_head", ".mlp.gate", "model.layers.1.self_attn.o_proj")


def quant_config(spec_name):
    spec = SPECS[spec_name]
    if "ct" in spec:
        typ, strategy = spec["ct"]
        weights = {"num_bits": 8, "type": typ, "strategy": strategy, "symmetric": True, "dynamic": False,
                   "block_structure": list(spec["block"]) if strategy == "block" else None}
        acts = {"num_bits": 8, "type": typ, "strategy": "token", "symmetric": True, "dynamic": True}
        return {"quant_method": "compressed-tensors", "format": spec.get("ct_format", f"{typ}-quantized"),
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
                "ignore": ["lm_head", r"re:.*mlp\.gate$", "model.layers.1.self_attn.o_proj"],
                "quantization_status": "compressed"}
    return spec.get("config")


def _weights(model):
    """(prefix, N, K, write-the-f64-weight-into-the-reference) for every matrix a checkpoint may quantize."""
    out = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear:
            out.append((name, *m.weight.shape, lambda ref, w, name=name: ref.get_submodule(name).weight.copy_(w)))
        elif isinstance(m, DenseExperts):
            E, I2, H = m.gate_up_proj.shape
            I = I2 // 2
            for e in range(E):
                for p, (N, K), rows in (("gate", (I, H), slice(0, I)), ("up", (I, H), slice(I, 2 * I)),
                                        ("down", (H, I), slice(None))):
                    attr = "down_proj" if p == "down" else "gate_up_proj"

                    def put(ref, w, name=name, e=e, attr=attr, rows=rows):
                        getattr(ref.get_submodule(name), attr)[e, rows].copy_(w)
                    out.append((f"{name}.{e}.{p}_proj", N, K, put))
    return out


def make_checkpoint(model, spec_name, seed=0):
    """(state dict in the format, float64 reference model). Unquantized tensors are stored as bf16."""
    spec = SPECS[spec_name]
    g = torch.Generator().manual_seed(seed)
    ref = copy.deepcopy(model).double()
    sd = {}
    handled = set()
    with torch.no_grad():
        for prefix, N, K, put in _weights(model):
            if prefix.endswith(KEEP):
                continue
            handled.add(prefix)
            if spec.get("kind") == "int8":
                q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
                scale, full = make_scale(spec["layout"], N, K, g, spec.get("block"), base=0.002)
                scale = scale.to(spec.get("scale_dtype", torch.float32))
                put(ref, q.double() * make_scale_full(scale, N, K))
                sd[f"{prefix}.weight"] = q
            else:
                bits = small_fp8_bits((N, K), g)
                if spec["layout"] is None:
                    full = torch.ones(N, K, dtype=torch.float64)
                    scale = None
                    bits = bits & 0xCF  # |w| < 0.25: no scale to tame it
                else:
                    scale, full = make_scale(spec["layout"], N, K, g, spec.get("block"))
                    scale = scale.to(spec.get("scale_dtype", torch.float32))
                    full = make_scale_full(scale, N, K, spec.get("block"))
                put(ref, fp8_dense(bits, full))
                w = bits.view(torch.float8_e4m3fn)
                if spec.get("pad"):
                    bn, bk = spec["block"]
                    Np, Kp = -(-N // bn) * bn, -(-K // bk) * bk
                    if (Np, Kp) != (N, K):
                        padded = torch.zeros(Np, Kp, dtype=torch.uint8)
                        padded[:N, :K] = bits
                        w = padded.view(torch.float8_e4m3fn)
                        sd[f"{prefix}.weight_shape_original"] = torch.tensor([N, K])
                sd[f"{prefix}.weight"] = w
            if scale is not None:
                sd[f"{prefix}.{spec['scale_key']}"] = scale
            for k, v in spec.get("extra", {}).items():
                sd[f"{prefix}.{k}"] = torch.tensor(0.5)
        # everything else: bf16 in the checkpoint, the same values in the reference
        for key, t in model.state_dict().items():
            owner = key.rsplit(".", 1)[0]
            if (owner in handled and key.endswith(".weight")) or isinstance(model.get_submodule(owner), DenseExperts):
                continue
            v = t.to(BF16)
            sd[key] = v
            ref_t = ref.get_parameter(key) if key in dict(ref.named_parameters()) else ref.get_buffer(key)
            ref_t.copy_(v.double())
        if spec_name == "diffusion-raw":  # a non-linear tensor stored as fp8 too: upcast exactly (scale 1)
            sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.float8_e4m3fn)
        if spec.get("marker"):
            sd[spec["marker"]] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return sd, ref


def make_scale_full(scale, N, K, block=None):
    s = scale.double()
    if block is not None and s.dim() == 2 and s.shape != (N, 1):
        bn, bk = block
        return s[torch.arange(N) // bn][:, torch.arange(K) // bk]
    if s.numel() == 1:
        return s.reshape(1, 1).expand(N, K)
    return s.reshape(N, 1).expand(N, K)


def write_dir(path, sd, spec_name, shards=1):
    """A Hugging Face style directory: config.json (+ hf_quant_config.json), one file or an index and shards."""
    os.makedirs(path, exist_ok=True)
    spec = SPECS[spec_name]
    qc = quant_config(spec_name)
    config = {"architectures": ["TinyLM"], "model_type": "tiny"}
    if qc is not None:
        config["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if spec.get("modelopt_file"):
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump(spec["modelopt_file"], f)
    keys = sorted(sd)
    if shards == 1:
        save_file({k: sd[k].contiguous() for k in keys}, os.path.join(path, "model.safetensors"))
        return
    weight_map = {}
    for i in range(shards):
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: sd[k].contiguous() for k in part}, os.path.join(path, fname))
        weight_map.update({k: fname for k in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def config_for(spec_name):
    """What a caller passes as config= with a state dict: the config.json dict (or hf_quant_config.json's)."""
    spec = SPECS[spec_name]
    if spec.get("modelopt_file"):
        return copy.deepcopy(spec["modelopt_file"])
    qc = copy.deepcopy(quant_config(spec_name))
    return None if qc is None else {"quantization_config": qc}
