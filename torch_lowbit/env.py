"""What a bug report needs: ``python -m torch_lowbit.env``.

Prints the versions (torch_lowbit, torch, Python, OS), the device torch_lowbit would run on, and what this
install holds: on a Mac the GPU, its Apple family and how the Metal kernels were loaded (a precompiled
metallib or the embedded source, which this command compiles if needed, and why a metallib that exists did not
load) and each kernel's limit on threads per threadgroup; on the CPU the instruction-set
level and the GEMM route (AMX, AVX-512 BF16 or fp32 panels); which extensions were built (emulator, traffic build).
"""
import platform
import sys

import torch

import torch_lowbit
from torch_lowbit import _C, emulator, testing


def _os_name():
    mac = platform.mac_ver()[0]
    if mac:
        return f"macOS {mac} ({platform.machine()})"
    return f"{platform.system()} {platform.release()} ({platform.machine()})"


def _mps_lines():
    if not torch.backends.mps.is_built():
        return ["mps: not in this torch build"]
    if not torch.backends.mps.is_available():
        return ["mps: built, but no Metal device is available (a VM, such as GitHub's hosted macOS runners, has none)"]
    info = _C._mps_info()
    if info is None:
        return ["mps: available, but torch_lowbit was built without its Metal launcher (not built on macOS?)"]
    fam, msl = info["apple_family"], info["msl_version"]
    lines = [f"mps GPU: {info['gpu']} (MTLGPUFamilyApple{fam}, kernels MSL {msl // 100}.{msl % 100})"]
    lines += [f"metal library {how}" for how in info["libraries"]]
    lines.append(_m5_line(msl, info["libraries"]))
    lines += _pipeline_lines(info.get("pipelines", {}))
    return lines


def _m5_line(msl, libraries):
    """Whether the M5 tensor-op kernels (the lowbit_apple10 library, MSL 4.0) run, and if not, why."""
    if msl >= 400:
        return "M5 tensor-op kernels: on (int8_mm, fp8_mm, fp8_grouped_mm prefill)"
    why = next((how.split(": ", 1)[1] for how in libraries if how.startswith("lowbit_apple10:")),
               "this build has no lowbit_apple10 library")
    return f"M5 tensor-op kernels: off, the portable kernels run ({why})"


def _pipeline_lines(limits):
    """Each kernel's maxTotalThreadsPerThreadgroup, grouped by limit (most kernels allow Metal's 1024; a
    register-heavy one may allow fewer, and its plan then runs a narrower variant)."""
    by_limit = {}
    for name, limit in sorted(limits.items()):
        by_limit.setdefault(limit, []).append(name)
    return [f"metal pipelines allowing {limit} threads per threadgroup ({len(names)}): {', '.join(names)}"
            for limit, names in sorted(by_limit.items())]


def report():
    """The report as a list of lines."""
    device = "mps" if torch.backends.mps.is_available() else "cpu"
    lines = [
        f"torch_lowbit: {torch_lowbit.__version__} ({torch_lowbit.__file__})",
        f"torch: {torch.__version__}",
        f"Python: {sys.version.split()[0]} ({platform.python_implementation()})",
        f"OS: {_os_name()}",
        f"device: {device}",
    ]
    lines += _mps_lines()
    lines += [
        f"cpu instruction set: {testing.cpu_isa()}",
        f"cpu GEMM route: {testing.GEMM_ROUTE_NAMES[testing.cpu_gemm_route()]}",
        f"cpu threads: {torch.get_num_threads()}",
        f"MSL emulator (_msl_emu): {'built' if emulator.available() else 'not built'}",
        f"traffic build (_msl_trace): {'built' if emulator.trace_available() else 'not built'}",
    ]
    return lines


def main():
    print("\n".join(report()))


if __name__ == "__main__":
    main()
