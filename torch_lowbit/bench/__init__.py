"""Benchmarks: ``python -m torch_lowbit.bench [--suite NAME] [suite options]``.

Every suite reports ratios against a baseline measured in the same run (these machines are noisy); none
asserts a time. Suites live in their own modules and expose ``run(argv) -> int``.
"""
SUITES = {
    "layer": "torch_lowbit.bench.layer",            # the main job: one Llama-3-8B decoder layer, fp8 / int8 vs bf16
    "cpu": "torch_lowbit.bench.cpu",                # CPU kernels vs torch baselines and memory bandwidth
    "metal-traffic": "torch_lowbit.bench.metal_traffic",  # emulated device-memory traffic of the Metal kernels
    "e2e": "torch_lowbit.bench.e2e",                # a small generated model loaded from a checkpoint
    "train": "torch_lowbit.bench.train",            # a LoRA training step on fp8 / int8 bases vs bf16
    "diffusion": "torch_lowbit.bench.diffusion",    # one denoising step of a FLUX.1-dev-shaped transformer
    "m5": "torch_lowbit.bench.m5",                  # M5 tensor-op kernels vs the portable ones (mps on an M5)
    "distributed": "torch_lowbit.bench.distributed",  # tensor parallelism at world sizes 1, 2, 4 (torchrun, gloo)
}
DEFAULT_SUITE = "layer"
