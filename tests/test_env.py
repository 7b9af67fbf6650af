"""`python -m torch_lowbit.env`: the bug-report command runs and says what this install is."""
import glob
import os
import platform
import subprocess
import sys

import pytest
import torch

import torch_lowbit
from torch_lowbit import env, testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.dirname(os.path.abspath(torch_lowbit.__file__))


def test_env_command_runs_and_reports_this_install():
    r = subprocess.run([sys.executable, "-m", "torch_lowbit.env"], cwd=ROOT, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=120)
    assert r.returncode == 0, r.stdout
    lines = dict(line.split(": ", 1) for line in r.stdout.splitlines())
    assert lines["torch_lowbit"].startswith(torch_lowbit.__version__ + " (")
    assert lines["torch"] == torch.__version__
    assert lines["Python"].startswith(platform.python_version())
    assert lines["device"] == ("mps" if torch.backends.mps.is_available() else "cpu")
    assert lines["cpu instruction set"] == testing.default_cpu_isa()  # what this CPU runs without a cap
    assert lines["cpu GEMM route"] == testing.GEMM_ROUTE_NAMES[testing.cpu_gemm_route()]
    built = {stem: bool(glob.glob(os.path.join(PKG, stem + ".*so"))) for stem in ("_msl_emu", "_msl_trace")}
    assert lines["MSL emulator (_msl_emu)"] == ("built" if built["_msl_emu"] else "not built")
    assert lines["traffic build (_msl_trace)"] == ("built" if built["_msl_trace"] else "not built")


def test_mps_lines_name_gpu_family_and_library(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    info = {"gpu": "Apple M3 Max", "apple_family": 9, "msl_version": 301,
            "libraries": ["lowbit: metallib /site/torch_lowbit/lowbit.metallib"]}
    monkeypatch.setattr(env._C, "_mps_info", lambda: info, raising=False)
    assert env._mps_lines()[:2] == ["mps GPU: Apple M3 Max (MTLGPUFamilyApple9, kernels MSL 3.1)",
                                    "metal library lowbit: metallib /site/torch_lowbit/lowbit.metallib"]
    monkeypatch.setattr(env._C, "_mps_info", lambda: None, raising=False)
    assert "without its Metal launcher" in env._mps_lines()[0]
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert "no Metal device is available" in env._mps_lines()[0]


@pytest.mark.parametrize("msl,libraries,expect", [
    (400, ["lowbit: source (MSL 3.1)", "lowbit_apple10: source (MSL 4.0)"], "M5 tensor-op kernels: on"),
    (301, ["lowbit: source (MSL 3.1)", "lowbit_apple10: not loaded (needs MTLGPUFamilyApple10, this GPU is Apple9)"],
     "off, the portable kernels run (not loaded (needs MTLGPUFamilyApple10, this GPU is Apple9))"),
    (301, ["lowbit: source (MSL 3.1)", "lowbit_apple10: not loaded (TORCH_LOWBIT_NO_MPP=1)"], "TORCH_LOWBIT_NO_MPP=1"),
    (301, ["lowbit: source (MSL 3.1)"], "this build has no lowbit_apple10 library"),
])
def test_mps_lines_say_whether_the_m5_kernels_run_and_why_not(monkeypatch, msl, libraries, expect):
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    info = {"gpu": "Apple M5", "apple_family": 10, "msl_version": msl, "libraries": libraries}
    monkeypatch.setattr(env._C, "_mps_info", lambda: info, raising=False)
    assert expect in env._mps_lines()[-1]


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS builds the mps launcher")
def test_mps_info_is_none_without_the_mps_launcher():
    assert torch_lowbit._C._mps_info() is None


def test_metallib_that_fails_to_load_falls_back_to_the_source_and_says_why():
    # the mps launcher's own loading code (csrc/metal/library_loading.cpp), with stand-in loaders: "" loads
    check = torch_lowbit._C._metal_library_loading_check
    assert check(True, "", "") == "lowbit: metallib /x/lowbit.metallib"
    assert check(False, "", "") == "lowbit: source (MSL 3.1)"
    assert check(True, "Invalid library file", "") == (
        "lowbit: source (MSL 3.1); the metallib /x/lowbit.metallib failed to load: Invalid library file")
    with pytest.raises(RuntimeError, match=r"compiling the lowbit kernels \(MSL 3.1\) failed: syntax error; before "
                                           r"that, the metallib /x/lowbit.metallib failed to load: stale"):
        check(True, "stale", "syntax error")
    with pytest.raises(RuntimeError, match=r"failed: syntax error$"):
        check(False, "", "syntax error")


def test_mps_lines_say_how_each_library_loaded_and_list_pipeline_limits(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    fallback = "lowbit: source (MSL 3.1); the metallib /site/lowbit.metallib failed to load: Invalid library file"
    info = {"gpu": "Apple M1", "apple_family": 7, "msl_version": 301, "libraries": [fallback],
            "pipelines": {"fp8_gemv_float": 1024, "fp8_gemv_rows_half": 896, "fp8_gemm_half": 1024}}
    monkeypatch.setattr(env._C, "_mps_info", lambda: info, raising=False)
    assert env._mps_lines()[1:] == [
        "metal library " + fallback,
        "M5 tensor-op kernels: off, the portable kernels run (this build has no lowbit_apple10 library)",
        "metal pipelines allowing 896 threads per threadgroup (1): fp8_gemv_rows_half",
        "metal pipelines allowing 1024 threads per threadgroup (2): fp8_gemm_half, fp8_gemv_float"]
