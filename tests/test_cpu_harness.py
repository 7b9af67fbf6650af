"""The CPU kernel sets without torch: tests/cpu_harness/harness.cpp built with the host compiler from the same
csrc/cpu/arch/ sources as _C, checking every set this CPU supports against independent references and the portable
set (exact int8 sums, fp8 decode and dequantize bits; float64 bounds for the fp32 sums). Planted bugs in the vector
loops must make it fail."""
import os
import platform
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cpu", "arch"))
from kernel_set_sources import kernel_set_sources  # noqa: E402

HARNESS = os.path.join("tests", "cpu_harness", "harness.cpp")
HOST_CXX = shutil.which("g++") or shutil.which("c++")
# -O1: a few seconds to build on two cores; _C's -O3 build runs through the op tests (test_cpu_kernels.py)
CXX_FLAGS = ["-std=c++17", "-O1", "-Wall", "-Werror", "-I", os.path.join(ROOT, "csrc")]


def compile_objects(cxx, flags, sources, out_dir, replaced=None):
    """Object files of `sources` (relative to ROOT) in out_dir, compiled in parallel; replaced maps a source to the
    text to compile instead of it (a planted bug)."""
    os.makedirs(out_dir, exist_ok=True)

    def one(src):
        path = os.path.join(ROOT, src)
        if replaced and src in replaced:
            path = os.path.join(out_dir, os.path.basename(src))
            with open(path, "w") as f:
                f.write(replaced[src])
        obj = os.path.join(out_dir, src.replace(os.sep, "_") + ".o")
        r = subprocess.run([cxx, *flags, "-c", path, "-o", obj], capture_output=True, text=True)
        assert r.returncode == 0, f"{src} does not compile:\n{r.stderr[-3000:]}"
        return obj

    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(one, sources))


def link(cxx, objs, out, extra=()):
    r = subprocess.run([cxx, *objs, *extra, "-o", out], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def run(cmd, timeout=120):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


needs_host_cxx = pytest.mark.skipif(HOST_CXX is None, reason="no host C++ compiler (g++ / c++) on PATH")
HOST_SOURCES = [HARNESS] + kernel_set_sources(ROOT, platform.machine())


@pytest.fixture(scope="module")
def host_objects(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("harness"))
    return out, dict(zip(HOST_SOURCES, compile_objects(HOST_CXX, CXX_FLAGS, HOST_SOURCES, out)))


@needs_host_cxx
def test_every_supported_set_matches_the_references(host_objects):
    out, objs = host_objects
    exe = link(HOST_CXX, list(objs.values()), os.path.join(out, "harness"))
    r = run([exe])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    from torch_lowbit.testing import cpu_kernel_sets  # the harness and _C agree on the sets and their support
    expected = [f"ok {name}:" if ok else f"skipped {name}:" for name, ok in cpu_kernel_sets()]
    assert [line.split(" ")[0] + " " + line.split(" ")[1] for line in r.stdout.splitlines()] == expected, r.stdout


# Planted bugs in the x86 sets: (file, text, replacement, what the harness must notice)
X86_PLANTS = [
    ("csrc/cpu/arch/x86/avx2.cpp", "nan[r] = nan[r] || avx2::has_nan_code(nan_acc);", "nan[r] = nan[r];",
     "a NaN code neither flagged nor decoded NaN (fp32 panel decode)"),
    ("csrc/cpu/arch/x86/avx2.cpp", "_mm256_permute4x64_epi64(p, 0xD8)", "_mm256_permute4x64_epi64(p, 0xE4)",
     "bf16 dequantize in the wrong order"),
    ("csrc/cpu/arch/x86/avxvnni.cpp", "c##R##b = _mm256_dpbusd_avx_epi32(c##R##b, a, b1);",
     "c##R##b = _mm256_dpbusd_avx_epi32(c##R##b, a, b0);", "the VNNI micro-tile's second strip half"),
    ("csrc/cpu/arch/x86/avx512.cpp", "(__mmask64(1) << (K - full)) - 1", "(__mmask64(1) << (K - full - 1)) - 1",
     "the int8 GEMV tile drops the last byte of a tail"),
]


@needs_host_cxx
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 kernel sets")
@pytest.mark.parametrize("src,text,planted,what", X86_PLANTS, ids=[p[3] for p in X86_PLANTS])
def test_planted_x86_bug_fails_the_harness(host_objects, src, text, planted, what):
    out, objs = host_objects
    code = open(os.path.join(ROOT, src)).read()
    assert code.count(text) == 1, f"the planted text is no longer in {src}: update the plant"
    plant_dir = os.path.join(out, "plant_" + str(abs(hash(planted))))
    flags = [f for f in CXX_FLAGS if f != "-Werror"]  # a plant may leave a variable unused
    obj = compile_objects(HOST_CXX, flags, [src], plant_dir, {src: code.replace(text, planted)})[0]
    exe = link(HOST_CXX, [obj if s == src else o for s, o in objs.items()], os.path.join(plant_dir, "harness"))
    set_name = os.path.splitext(os.path.basename(src))[0]
    r = run([exe, set_name])
    if "lacks its features" in r.stdout:
        pytest.skip(f"this CPU cannot run the {set_name} set")
    assert r.returncode == 1 and f"FAILED {set_name}" in r.stdout, f"{what}: not caught\n{r.stdout[-2000:]}"
