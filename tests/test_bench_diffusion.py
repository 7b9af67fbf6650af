"""The diffusion suite (one denoising step of a FLUX-shaped transformer) runs end to end at tiny dims, with diffusers'
FluxTransformer2DModel and with its own stand-in, which is the same model as diffusers' (same weights -> same
output), so the lent machines without diffusers time the real FLUX layers."""
import json
import sys

import pytest
import torch

from torch_lowbit.bench import __main__ as bench_main
from torch_lowbit.bench import diffusion

TINY = ["--hidden", "64", "--heads", "4", "--joint-dim", "32", "--pooled-dim", "16", "--in-channels", "16",
        "--image-tokens", "30", "--text-tokens", "7", "--device", "cpu"]


def _run(tmp_path, capsys, *extra):
    path = tmp_path / "out.json"
    assert bench_main.main(["--suite", "diffusion", *TINY, "--rounds", "2", "--json", str(path), *extra]) == 0
    out, err = capsys.readouterr()
    return json.loads(path.read_text()), out, err


@pytest.mark.parametrize("impl", ["diffusers", "builtin"])
def test_diffusion_suite_runs_and_writes_json(impl, tmp_path, capsys):
    if impl == "diffusers":
        pytest.importorskip("diffusers")
    data, out, err = _run(tmp_path, capsys, "--impl", impl, "--double-blocks", "2")
    expected_model = "FluxTransformer2DModel" if impl == "diffusers" else "FLUX-shaped stand-in (--impl builtin)"
    assert expected_model in data["meta"]["model"] and expected_model in out
    assert "[round 2/2]" in err and "warm-up int8" in err and "time vs bf16" in out and "rms rel err" in out
    assert data["meta"]["dims"]["double_blocks"] == 2 and data["meta"]["dims"]["hidden"] == 64
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["bf16", "fp8", "int8"]
    bf16 = rows["bf16"]
    # against the same model's float32 step (timestep and guidance exact in bf16, so the same inputs): bf16's own
    # rounding, and each mode within its distance from bf16 of bf16's (the triangle inequality)
    assert 0 < bf16["rms_err_vs_fp32"] < 0.02
    for mode in ("fp8", "int8"):
        assert 0 < rows[mode]["rms_err_vs_fp32"] < 0.05
        assert abs(rows[mode]["rms_err_vs_fp32"] - bf16["rms_err_vs_fp32"]) <= rows[mode]["rms_rel_err"] * 1.05
    assert bf16["step_vs_bf16"] == 1.0 and bf16["max_rel_err"] == 0.0 and bf16["layers_quantized"] == 0
    # 2 double blocks x 14 linears (2 modulations, 6 q / k / v, 2 attention outputs, 2 x 2 MLP) + 1 single block x 6
    # (modulation, q, k, v, proj_mlp, proj_out); the embedders and the final layer stay bf16
    for mode in ("fp8", "int8"):
        r = rows[mode]
        assert r["layers_quantized"] == 2 * 14 + 6
        assert len(r["step_ms_rounds"]) == 2 and r["step_ms"] == pytest.approx(sorted(r["step_ms_rounds"])[0] / 2
                                                                               + sorted(r["step_ms_rounds"])[1] / 2)
        assert r["step_vs_bf16"] == pytest.approx(r["step_ms"] / bf16["step_ms"])
        assert r["speedup"] == pytest.approx(1 / r["step_vs_bf16"])
        # two blocks of 8-bit weights (fp8: 3 mantissa bits) against bf16 on random weights
        assert 0 < r["rms_rel_err"] <= r["max_rel_err"] * 10 and r["max_rel_err"] < {"fp8": 0.05, "int8": 0.03}[mode]
        # 1-byte weights plus fp32 scales for the quantized layers; the bf16 rest unchanged
        assert 0.5 < r["mem_vs_bf16"] < 0.75


def test_diffusion_suite_int4_mode(tmp_path, capsys):
    """--modes takes int4 (W4A16, groups of 128 along K): the same layers quantized, within 4-bit error of bf16, in
    less memory than fp8."""
    data, out, err = _run(tmp_path, capsys, "--impl", "builtin", "--hidden", "256", "--heads", "4", "--modes",
                          "fp8,int4")
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == ["bf16", "fp8", "int4"] and "int4 = W4Linear int4 in groups of 128 (W4A16)" in out
    r = rows["int4"]
    assert r["layers_quantized"] == rows["fp8"]["layers_quantized"] == 14 + 6
    # random weights, 4-bit codes in groups of 128: about 2^-4 of each group's range per weight
    assert rows["fp8"]["rms_rel_err"] < r["rms_rel_err"] < 0.2
    assert abs(r["rms_err_vs_fp32"] - rows["bf16"]["rms_err_vs_fp32"]) <= r["rms_rel_err"] * 1.05
    assert r["mem_vs_bf16"] < rows["fp8"]["mem_vs_bf16"] < 0.75


def test_diffusion_suite_without_diffusers_runs_the_stand_in(monkeypatch, tmp_path, capsys):
    """What the lent machines (no diffusers) run by default; one mode, no float32 reference."""
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ImportError
    data, out, err = _run(tmp_path, capsys, "--double-blocks", "0", "--modes", "int8", "--no-fp32-reference")
    assert "FLUX-shaped stand-in (diffusers not installed)" in out and "float32 reference" not in err
    assert [r["mode"] for r in data["rows"]] == ["bf16", "int8"]
    assert all(r["rms_err_vs_fp32"] is None for r in data["rows"])
    assert data["rows"][1]["layers_quantized"] == 6  # the one single block


@pytest.mark.parametrize("argv,match", [(["--modes", "fp8,nf4"], "--modes must be among"),
                                        (["--hidden", "60", "--heads", "8"], "--hidden must be --heads times"),
                                        (["--double-blocks", "0", "--single-blocks", "0"], "not both 0"),
                                        (["--image-tokens", "0"], "--image-tokens must be >= 1")])
def test_diffusion_suite_bad_options(argv, match, capsys):
    with pytest.raises(SystemExit):
        diffusion.run(argv)
    assert match in capsys.readouterr().err


def test_stand_in_is_diffusers_flux():
    """diffusers' weights load into the stand-in by name (every key, same shapes) and give the same step output."""
    diffusers = pytest.importorskip("diffusers")
    args = diffusion.parse(TINY + ["--double-blocks", "2", "--single-blocks", "2", "--impl", "diffusers"])
    real, what = diffusion.build_model(args)
    assert isinstance(real, diffusers.FluxTransformer2DModel)
    real = real.float()
    stand_in = diffusion.FluxShapedTransformer(64, 4, 32, 16, 16, 4.0, 2, 2)
    stand_in.load_state_dict(real.state_dict(), strict=True)
    shapes = {k: v.shape for k, v in real.state_dict().items()}
    assert {k: v.shape for k, v in stand_in.state_dict().items()} == shapes
    x = {k: v.float() for k, v in diffusion.make_inputs(args, torch.Generator().manual_seed(0)).items()}
    with torch.no_grad():
        torch.testing.assert_close(stand_in(**x)[0], real(**x, return_dict=False)[0], rtol=1e-5, atol=1e-6)
