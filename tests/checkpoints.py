"""Write tiny synthetic checkpoints of a model in every registered format's example variants (each format module
declares its examples: ``CheckpointFormat.examples`` / ``example_config`` / ``example_tensors``), together with the
float64 model holding the very weights the checkpoint encodes. The weights, scales and the reference come from
here; the format only says how it stores them (test_formats pins what it stores against the published layouts)."""
import copy
import json
import os

import torch
from safetensors.torch import save_file
from torch import nn

from tiny_models import DenseExperts, expand_scale, fp8_dense, make_scale, small_fp8_bits
from torch_lowbit.formats.registry import all_examples

BF16 = torch.bfloat16


def examples():
    """example name -> (format, Example), over every registered format (re-read: tests may register more)."""
    return all_examples()


SPECS = examples()
FORMAT_OF = {name: fmt.name for name, (fmt, _) in SPECS.items()}
# high precision in every checkpoint (the config's ignore list names them; router gates are never quantized)
KEEP = ("lm_head", "mlp.gate", "model.layers.1.self_attn.o_proj")


def _kept(prefix):
    return any(f".{prefix}".endswith(f".{k}") for k in KEEP)


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
    fmt, ex = examples()[spec_name]
    g = torch.Generator().manual_seed(seed)
    ref = copy.deepcopy(model).double()
    sd = {}
    handled = set()
    gran = ex.granularity
    with torch.no_grad():
        for prefix, N, K, put in _weights(model):
            if _kept(prefix):
                continue
            handled.add(prefix)
            if ex.kind == "int8":
                codes = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
                values = codes.double()
            else:
                bits = small_fp8_bits((N, K), g)
                if gran is None:
                    bits = bits & 0xCF  # |w| < 0.25: no scale to tame it
                codes = bits.view(torch.float8_e4m3fn)
                values = fp8_dense(bits, torch.ones(N, K, dtype=torch.float64))
            scale = None
            full = torch.ones(N, K, dtype=torch.float64)
            if gran is not None:
                scale = make_scale(gran.kind, N, K, g, gran.block_size, base=0.002 if ex.kind == "int8" else 0.03)
                scale = scale.to(ex.scale_dtype).float()  # what the checkpoint holds is what the model must compute
                full = expand_scale(scale, gran.kind, N, K, gran.block_size)
            put(ref, values * full)
            sd.update(fmt.example_tensors(prefix, codes, scale, ex))
        # everything else: bf16 in the checkpoint, the same values in the reference
        for key, t in model.state_dict().items():
            owner = key.rsplit(".", 1)[0]
            if (owner in handled and key.endswith(".weight")) or isinstance(model.get_submodule(owner), DenseExperts):
                continue
            v = t.to(BF16)
            sd[key] = v
            ref_t = ref.get_parameter(key) if key in dict(ref.named_parameters()) else ref.get_buffer(key)
            ref_t.copy_(v.double())
        if fmt.upcasts_unscaled and gran is None:  # a non-linear tensor stored as fp8 too: upcast exactly (scale 1)
            sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.float8_e4m3fn)
        if ex.marker:
            sd[ex.marker] = torch.empty(0, dtype=torch.float8_e4m3fn)
    return sd, ref


def write_dir(path, sd, spec_name, shards=1):
    """A Hugging Face style directory: config.json (+ the format's side config), one file or an index and shards."""
    os.makedirs(path, exist_ok=True)
    fmt, ex = examples()[spec_name]
    qc, side = fmt.example_config(ex, KEEP)
    config = {"architectures": ["TinyLM"], "model_type": "tiny"}
    if qc is not None:
        config["quantization_config"] = qc
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if side is not None:
        with open(os.path.join(path, fmt.side_config), "w") as f:
            json.dump(side, f)
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
    """What a caller passes as config= with a state dict: the config.json dict (or the side config)."""
    fmt, ex = examples()[spec_name]
    qc, side = fmt.example_config(ex, KEEP)
    if side is not None:
        return copy.deepcopy(side)
    return None if qc is None else {"quantization_config": copy.deepcopy(qc)}
