"""The CPU kernel sets without torch: tests/cpu_harness/harness.cpp built from the same csrc/cpu/arch/ sources as
_C, checking every set a CPU supports against independent references and the portable set (exact int8 sums, fp8
decode and dequantize bits; float64 bounds for the fp32 sums). With the host compiler for this machine's sets, and
cross-compiled (g++-aarch64-linux-gnu, static) for the Arm sets, run under qemu-aarch64 as CPUs of each level.
Planted bugs in the vector loops must make it fail."""
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


def source_path(src, replaced, out_dir):
    """Where to compile `src` (relative to ROOT) from: the file itself, or its replacement text (a planted bug)
    written into out_dir."""
    if not (replaced and src in replaced):
        return os.path.join(ROOT, src)
    path = os.path.join(out_dir, os.path.basename(src))
    with open(path, "w") as f:
        f.write(replaced[src])
    return path


def compile_objects(cxx, flags, sources, out_dir, replaced=None):
    """Object files of `sources` (relative to ROOT) in out_dir, compiled in parallel; replaced maps a source to the
    text to compile instead of it (a planted bug)."""
    os.makedirs(out_dir, exist_ok=True)

    def one(src):
        path = source_path(src, replaced, out_dir)
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
    # the harness and _C agree on the sets, their support and the set this CPU runs
    from torch_lowbit.testing import cpu_kernel_sets, default_cpu_isa
    expected = [f"ok {name}:" if ok else f"skipped {name}:" for name, ok in cpu_kernel_sets()]
    lines = r.stdout.splitlines()
    assert [line.split(" ")[0] + " " + line.split(" ")[1] for line in lines[:-1]] == expected, r.stdout
    assert lines[-1] == "selected " + default_cpu_isa(), r.stdout


def vex_vnni_instructions(obj):
    """The VEX-encoded byte / word dot products (AVX-VNNI) in an object file's code."""
    r = run([shutil.which("objdump"), "-d", "--no-show-raw-insn", obj])
    assert r.returncode == 0, r.stderr
    return [line.strip() for line in r.stdout.splitlines() if "{vex}" in line and "vpdp" in line]


@needs_host_cxx
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or shutil.which("objdump") is None,
                    reason="x86 kernel sets, objdump")
def test_avx512_set_runs_without_avx_vnni(host_objects, tmp_path):
    # Zen 4 has AVX-512 VNNI and BF16 but not AVX-VNNI, and runs the avx512 set: none of the set's code may be
    # VEX-encoded VNNI (its targets leave avxvnni out, so the compiler cannot emit it); a function built with
    # avxvnni shows what the scan finds
    out, objs = host_objects
    for src in ("csrc/cpu/arch/x86/avx512.cpp", "csrc/cpu/arch/x86/w4_avx512.cpp"):
        assert vex_vnni_instructions(objs[src.replace("/", os.sep)]) == [], src
    plant = tmp_path / "vex.cpp"
    plant.write_text('#include <immintrin.h>\n__attribute__((target("avxvnni"))) __m256i f(__m256i a, __m256i b, '
                     '__m256i c) { return _mm256_dpbusd_avx_epi32(a, b, c); }\n')
    obj = compile_objects(HOST_CXX, ["-O1"], [str(plant)], str(tmp_path))[0]
    assert vex_vnni_instructions(obj) != []


# Planted bugs in the x86 sets: (file, text, replacement, what the harness must notice)
X86_PLANTS = [
    ("csrc/cpu/arch/x86/w4_avx2.cpp", "w4_group(op, byte_table, n0 + r, k / 16).scale",
     "w4_group(op, byte_table, n0 + r, k / 32).scale", "the AVX2 group-16 walk scales a half-chunk by another group"),
    ("csrc/cpu/arch/x86/avx512.cpp", "r[4 + c] = _mm512_shuffle_i32x4(a0, b0, 0xDD);",
     "r[4 + c] = _mm512_shuffle_i32x4(a0, b0, 0x88);", "the AMX activation pack's transpose repeats a column"),
    ("csrc/cpu/arch/x86/avx2.cpp", "nan[r] = nan[r] || avx2::has_nan_code(nan_acc);", "nan[r] = nan[r];",
     "a NaN code neither flagged nor decoded NaN (fp32 panel decode)"),
    ("csrc/cpu/arch/x86/avx2.cpp", "_mm256_permute4x64_epi64(p, 0xD8)", "_mm256_permute4x64_epi64(p, 0xE4)",
     "bf16 dequantize in the wrong order"),
    ("csrc/cpu/arch/x86/avxvnni.cpp", "c##R##b = _mm256_dpbusd_avx_epi32(c##R##b, a, b1);",
     "c##R##b = _mm256_dpbusd_avx_epi32(c##R##b, a, b0);", "the VNNI micro-tile's second strip half"),
    ("csrc/cpu/arch/x86/avx512.cpp", "(__mmask64(1) << (K - full)) - 1", "(__mmask64(1) << (K - full - 1)) - 1",
     "the int8 GEMV tile drops the last byte of a tail"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "__mmask16((1u << ((valid + 1) / 2)) - 1)", "__mmask16((1u << (valid / 2)) - 1)",
     "the 4-bit tail load drops the last byte of an odd K"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "_mm512_set_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0)",
     "_mm512_set_epi32(16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0, 0)",
     "a chunk across two groups takes code pair 7 from the first group's table"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "_mm256_cvtepi8_epi16(b8), 7)", "_mm256_cvtepu8_epi16(b8), 7)",
     "the e4m3 scale decode zero-extends the byte (drops the sign)"),
    ("csrc/cpu/arch/x86/w4_avx2.cpp", "lookup(t, _mm256_srli_epi32(idx, 4), _mm256_slli_epi32(idx, 24))",
     "lookup(t, _mm256_srli_epi32(idx, 4), _mm256_slli_epi32(idx, 28))",
     "the odd codes' table half picked by the even code's bit 3"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "_mm512_set1_epi32(0x7FFF)), odd), 16)",
     "_mm512_set1_epi32(0x8000)), odd), 16)", "the bf16 panel decode rounds ties away from even"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "_mm512_maskz_sub_ps(finite, t, _mm512_castsi512_ps(out.term[0]))",
     "_mm512_maskz_sub_ps(finite, t, _mm512_castsi512_ps(_mm512_slli_epi32(hi, 17)))",
     "the bf16 panel decode's second term subtracts the wrong first term"),
    ("csrc/cpu/arch/x86/avx512.cpp", "const bool accumulate = add || k0 > 0;", "const bool accumulate = add;",
     "the bf16 GEMM's later depth blocks overwrite the earlier ones' sums"),
    ("csrc/cpu/arch/x86/avx512.cpp", "end = std::min(sg.k1, (s + 1) * sg.seg);",
     "end = std::min(sg.k1, (s + 2) * sg.seg);",
     "the segmented bf16 GEMM scales the next segment's products with a segment's scale"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "0xFF00, 0x00210021)", "0xFF00, 0x00010021)",
     "the one-term bf16 panel decode takes a chunk's odd codes of its second group from the first group's table"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "_mm512_set1_epi32(0xFFFF)) == 0) {", "_mm512_set1_epi32(0xFFFF)) != 0) {",
     "the bf16 panel decode takes a group's fp32 table as bf16 where it is not exact (unrounded)"),
    ("csrc/cpu/arch/portable/w4_portable.cpp", "end = std::min(k1, (g + 1) * op.group);",
     "end = std::min(k1, (g + 1) * op.group + 1);", "the portable 4-bit decode runs a group one code too far"),
]


def planted_harness(cxx, objects, plants, plant, link_extra=()):
    """(the harness built with `plant` -- (source, text, replacement, what) -- in its source, the set's name)."""
    out, objs = objects
    src, text, planted, _ = plant
    code = open(os.path.join(ROOT, src)).read()
    assert code.count(text) == 1, f"the planted text is no longer in {src}: update the plant"
    plant_dir = os.path.join(out, "plant_" + str(plants.index(plant)))
    # a plant may leave a variable unused (no -Werror); -O0: the plant's build is most of these tests' time, and
    # what is checked is the harness noticing the bug, not the optimizer
    flags = ["-O0" if f == "-O1" else f for f in CXX_FLAGS if f != "-Werror"]
    obj = compile_objects(cxx, flags, [src], plant_dir, {src: code.replace(text, planted)})[0]
    exe = link(cxx, [obj if s == src else o for s, o in objs.items()], os.path.join(plant_dir, "harness"), link_extra)
    # a set's file is named after it; its 4-bit loops' file too, with the prefix w4_
    return exe, os.path.splitext(os.path.basename(src))[0].removeprefix("w4_")


@needs_host_cxx
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 kernel sets")
@pytest.mark.parametrize("src,text,planted,what", X86_PLANTS, ids=[p[3] for p in X86_PLANTS])
def test_planted_x86_bug_fails_the_harness(host_objects, src, text, planted, what):
    exe, set_name = planted_harness(HOST_CXX, host_objects, X86_PLANTS, (src, text, planted, what))
    r = run([exe, "--first-failure", set_name])
    if "lacks its features" in r.stdout:
        pytest.skip(f"this CPU cannot run the {set_name} set")
    assert r.returncode == 1 and f"FAILED {set_name}" in r.stdout, f"{what}: not caught\n{r.stdout[-2000:]}"


# Planted bugs in the digit-plane GEMV (w4_kernels.h), which the avx512amx set runs (on any AVX-512 CPU, by name)
PLANE_PLANTS = [
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "        if (exact) {\n", "        if (true) {\n",
     "a step whose values span 16 binades multiplied through its (empty) planes"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "      a = _mm512_slli_epi32(a, 8);\n      a = _mm512_dpbusd_epi32(a, even, _mm512_loadu_si512(d[2][0]));",
     "      a = _mm512_slli_epi32(a, 7);\n      a = _mm512_dpbusd_epi32(a, even, _mm512_loadu_si512(d[2][0]));",
     "the last digit plane joins the sum one bit off"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "plane_neg_off = _mm512_set1_epi32(-pc.off);",
     "plane_neg_off = _mm512_set1_epi32(pc.off);", "the codes' offset added instead of taken off"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "constexpr bool kLookup = kPlanes == Planes::Lookup;",
     "constexpr bool kLookup = false;", "E2M1 codes multiplied as their nibbles"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "    over |= _mm512_cmpgt_epi32_mask(i, imax);\n", "",
     "the pack keeps 255 with 2^-8, whose top digit (128) wraps to -128"),
    ("csrc/cpu/arch/x86/w4_avx512.cpp", "normal[q] = _mm512_mask_cmpneq_epi32_mask(~top, e[q], _mm512_setzero_si512());",
     "normal[q] = ~top;", "the pack takes zeros and denormals for values of exponent 0"),
]


@needs_host_cxx
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 kernel sets")
@pytest.mark.parametrize("src,text,planted,what", PLANE_PLANTS, ids=[p[3] for p in PLANE_PLANTS])
def test_planted_plane_bug_fails_the_harness(host_objects, src, text, planted, what):
    exe, _ = planted_harness(HOST_CXX, host_objects, PLANE_PLANTS, (src, text, planted, what))
    r = run([exe, "--first-failure", "avx512amx"])
    if "lacks its features" in r.stdout:
        pytest.skip("this CPU cannot run the avx512amx set")
    assert r.returncode == 1 and "FAILED avx512amx" in r.stdout, f"{what}: not caught\n{r.stdout[-2000:]}"


def cpu_has_amx():
    """Whether this CPU reports AMX tiles with bf16 (Linux's /proc/cpuinfo flags)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return False
    return "amx_tile" in flags and "amx_bf16" in flags


# Planted bugs in the avx512amx set's AMX tile GEMM (amx.cpp), which runs on tiles only on a CPU with AMX (elsewhere
# the vector GEMM stands in for it, and a plant there changes nothing)
AMX_PLANTS = [
    ("csrc/cpu/arch/x86/amx.cpp", "_mm512_set1_ps(segs.scales[i][s])", "_mm512_set1_ps(segs.scales[i][0])",
     "every segment's sums scaled by the first segment's scale"),
    ("csrc/cpu/arch/x86/amx.cpp", "_tile_loadd(7, b + 2 * kTileRows, sb);", "_tile_loadd(7, b + kTileRows, sb);",
     "the second column tile reads the first tile's last 8 columns"),
    ("csrc/cpu/arch/x86/amx.cpp", "const int nrows = rows[0] + rows[1];", "const int nrows = rows[0];",
     "the segment sums of a block's second tile row never reach C"),
    ("csrc/cpu/arch/x86/amx.cpp", "add ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[b], c)) : v",
     "add ? _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask[b], c + 1)) : v",
     "the segment product adds the next column of C to each sum"),
    ("csrc/cpu/arch/x86/amx.cpp", "const float one = 1.f;", "const float one = 0.5f;",
     "the product without segments scaled by its stand-in scale"),
]


@needs_host_cxx
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 kernel sets")
@pytest.mark.parametrize("src,text,planted,what", AMX_PLANTS, ids=[p[3] for p in AMX_PLANTS])
def test_planted_amx_bug_fails_the_harness(host_objects, src, text, planted, what):
    if not cpu_has_amx():
        pytest.skip("no AMX tiles on this CPU: the AMX GEMM runs as the vector one")
    exe, _ = planted_harness(HOST_CXX, host_objects, AMX_PLANTS, (src, text, planted, what))
    r = run([exe, "--first-failure", "avx512amx"])
    assert r.returncode == 1 and "FAILED avx512amx" in r.stdout, f"{what}: not caught\n{r.stdout[-2000:]}"


# ---- the Arm sets, cross-compiled and run under qemu-aarch64 ----
ARM_CXX = shutil.which("aarch64-linux-gnu-g++")
QEMU = shutil.which("qemu-aarch64")
ARM_SOURCES = [HARNESS] + kernel_set_sources(ROOT, "aarch64")
needs_arm_tools = pytest.mark.skipif(ARM_CXX is None or QEMU is None,
                                     reason="needs g++-aarch64-linux-gnu and qemu-user (apt; .ci/run installs them)")


@pytest.fixture(scope="module")
def arm_objects(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("harness_arm"))
    return out, dict(zip(ARM_SOURCES, compile_objects(ARM_CXX, CXX_FLAGS, ARM_SOURCES, out)))


# qemu CPU models of each Arm level: what each set must report, and the set kernel_set() selects there
ARM_CPUS = [
    ("cortex-a53", {"portable": "ok", "neon": "ok", "dotprod": "skipped", "i8mm": "skipped", "bf16": "skipped"},
     "neon"),  # Armv8.0
    ("cortex-a76", {"portable": "ok", "neon": "ok", "dotprod": "ok", "i8mm": "skipped", "bf16": "skipped"},
     "dotprod"),  # v8.2 + dotprod: no FEAT_I8MM, no FEAT_BF16
    ("max", {"portable": "ok", "neon": "ok", "dotprod": "ok", "i8mm": "ok", "bf16": "ok"}, "bf16"),  # all qemu has
]


@needs_arm_tools
@pytest.mark.parametrize("cpu,expected,selected", ARM_CPUS, ids=[c for c, _, _ in ARM_CPUS])
def test_arm_sets_under_qemu(arm_objects, cpu, expected, selected):
    out, objs = arm_objects
    exe = os.path.join(out, "harness")
    if not os.path.exists(exe):
        link(ARM_CXX, list(objs.values()), exe, ["-static"])
    r = run([QEMU, "-cpu", cpu, exe])
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    got = {line.split(" ")[1].rstrip(":"): line.split(" ")[0] for line in lines[:-1]}
    assert got == expected, r.stdout
    assert lines[-1] == "selected " + selected, r.stdout


ARM_PLANTS = [
    ("csrc/cpu/arch/arm/neon.cpp", "vmaxq_u8(vorrq_u8(b0, sign), vorrq_u8(b1, sign))", "vorrq_u8(vmaxq_u8(b0, b1), sign)",
     "the NaN-code flag takes the max before the sign bit (0x7F loses to 0x80)"),
    ("csrc/cpu/arch/arm/neon.cpp", "vmull_high_s8(xv[m], wv)", "vmull_s8(vget_high_s8(xv[m]), vget_low_s8(wv))",
     "the int8 GEMV multiplies the high x bytes by the low weight bytes"),
    ("csrc/cpu/arch/arm/dotprod.cpp", "int8_tile_rows_padded(x, w, K, full, xt, wt, xp, wp);",
     "int8_tile_rows_padded(x, w, K, full + 1, xt, wt, xp, wp);", "the sdot tile's tail starts a value late"),
    ("csrc/cpu/arch/arm/i8mm.cpp", "accumulate ? vld1q_s32(tile + r * kStrip + 4 * v) : vdupq_n_s32(0)",
     "vdupq_n_s32(0)", "the usdot micro-tile ignores `accumulate`"),
    ("csrc/cpu/arch/arm/bf16.cpp", "std::memcpy(tmp, w + r * K + k0 + full, size_t(n - full));",
     "std::memcpy(tmp, w + r * K + k0 + full, size_t(n - full - 1));", "the bfdot tile drops the last code of a tail"),
    ("csrc/cpu/arch/arm/bf16.cpp", "load_bf16(xp + 32 + 8 * q)", "load_bf16(xp + 8 * q)",
     "the bfdot tile pairs codes 8..15 of each 16 with the wrong activations (kBf16ChunkOrder)"),
    ("csrc/cpu/arch/arm/bf16.cpp", "hi[c] = uint8_t(u >> 24);", "hi[c] = uint8_t(c == 0x7F ? 0x3F : u >> 24);",
     "the bf16 decode table turns NaN code 0x7F into a finite value"),
    ("csrc/cpu/arch/arm/w4_neon.cpp", "{{0, 2, 4, 6}, {8, 10, 12, 14}", "{{0, 2, 4, 16}, {8, 10, 12, 14}",
     "the 4-bit tail keeps code 6 of a half past K"),
    ("csrc/cpu/arch/arm/w4_neon.cpp", "vld1q_f32(xp + 20), d[3]", "vld1q_f32(xp + 4), d[3]",
     "the 4-bit GEMV pairs odd codes 9..15 of a half with the even codes' activations"),
    ("csrc/cpu/arch/arm/w4_bf16.cpp", "d[1] = vreinterpretq_bf16_u8(vtrn1q_u8(lo13, hi13));",
     "d[1] = vreinterpretq_bf16_u8(vtrn2q_u8(lo13, hi13));", "the bf16 4-bit decode gives nibble 3 for nibble 1"),
    ("csrc/cpu/arch/arm/w4_bf16.cpp", "std::memcpy(tail[r], codes + r * s.rb + k / 2, size_t(s.rb - k / 2));",
     "std::memcpy(tail[r], codes + r * s.rb + k / 2, size_t(s.rb - k / 2 - 1));",
     "the bf16 4-bit tile drops a row's last code byte"),
    ("csrc/cpu/arch/arm/w4_bf16.cpp", "return vcombine_f32(vdup_lane_f32(v, 0), vdup_lane_f32(v, 1));",
     "return vcombine_f32(vdup_lane_f32(v, 0), vdup_lane_f32(v, 0));",
     "the bf16 4-bit tile scales a register's second group of 16 by the first's scale"),
    ("csrc/cpu/arch/arm/w4_bf16.cpp", "vdup_n_u8(kEnc == W4Scale::E4M3 ? 0x80 : 0)", "vdup_n_u8(0)",
     "the bf16 4-bit tile's scale decode misses e4m3's NaN 0x7F"),
    ("csrc/cpu/arch/arm/w4_bf16.cpp", "vst1q_u16(dst + k + 32 * j + 8 * c, v.val[j]);",
     "vst1q_u16(dst + k + 32 * c + 8 * j, v.val[j]);", "the bf16 activation pack transposes the step"),
]


@needs_arm_tools
@pytest.mark.parametrize("src,text,planted,what", ARM_PLANTS, ids=[p[3] for p in ARM_PLANTS])
def test_planted_arm_bug_fails_the_harness(arm_objects, src, text, planted, what):
    exe, set_name = planted_harness(ARM_CXX, arm_objects, ARM_PLANTS, (src, text, planted, what), ["-static"])
    r = run([QEMU, "-cpu", "max", exe, "--first-failure", set_name])
    assert r.returncode == 1 and f"FAILED {set_name}" in r.stdout, f"{what}: not caught\n{r.stdout[-2000:]}"


# ------------------------------------------------------------------------------------------- clang (Apple's compiler)
# macOS builds _C with Apple clang, which no machine of the project runs: every kernel-set source of both
# architectures must also compile with an LLVM clang of Apple clang 15's generation or newer (clang 14 lacks the
# Arm intrinsics under target attributes), as clang refuses some things gcc accepts (a NaN computed in a constant
# expression, target-attribute spellings, intrinsics outside their target)
CLANG = next((c for c in ("clang++-19", "clang++-18", "clang++-17", "clang++-16") if shutil.which(c)), None)
CLANG_TARGETS = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}


def clang_errors(target, sources, replaced=None, out_dir=None):
    """(source, first error lines) of each source that clang does not compile for `target`."""
    def one(src):
        path = source_path(src, replaced, out_dir)
        r = subprocess.run([CLANG, f"--target={target}", "-std=c++17", "-O1", "-fsyntax-only", "-Wall",
                            "-I", os.path.join(ROOT, "csrc"), *(["-I", out_dir] if out_dir else []), path],
                           capture_output=True, text=True)
        return None if r.returncode == 0 else (src, r.stderr[-1500:])

    with ThreadPoolExecutor(max_workers=4) as pool:
        return [e for e in pool.map(one, sources) if e]


def clang_finds_headers(target, tmp_path):
    """Whether clang finds the C++ standard headers for `target` (the aarch64 ones come with
    g++-aarch64-linux-gnu, which .ci/run installs; without them every source fails the same way)."""
    probe = tmp_path / "probe.cpp"
    probe.write_text("#include <cstdint>\n#include <vector>\n")
    return subprocess.run([CLANG, f"--target={target}", "-std=c++17", "-fsyntax-only", str(probe)],
                          capture_output=True).returncode == 0


@pytest.mark.skipif(CLANG is None, reason="no clang++ 16 or newer (.ci/run installs clang-16)")
@pytest.mark.parametrize("machine", sorted(CLANG_TARGETS))
def test_kernel_sets_compile_with_clang(machine, tmp_path):
    if not clang_finds_headers(CLANG_TARGETS[machine], tmp_path):
        pytest.skip(f"{CLANG} finds no C++ headers for {CLANG_TARGETS[machine]} (g++-aarch64-linux-gnu brings them)")
    errors = clang_errors(CLANG_TARGETS[machine], kernel_set_sources(ROOT, machine))
    assert not errors, "\n".join(f"{src}:\n{err}" for src, err in errors)


@pytest.mark.skipif(CLANG is None, reason="no clang++ 16 or newer (.ci/run installs clang-16)")
def test_clang_check_sees_a_nan_computed_in_a_constant_expression(tmp_path):
    """The planted form of a bug gcc accepted and clang refused (the unscaled fp8 table divided its NaNs)."""
    if not clang_finds_headers(CLANG_TARGETS["aarch64"], tmp_path):
        pytest.skip(f"{CLANG} finds no C++ headers for aarch64 (g++-aarch64-linux-gnu brings them)")
    header = os.path.join("csrc", "cpu", "fp8_simd.h")
    with open(os.path.join(ROOT, header)) as f:
        text = f.read()
    fixed = "t[i] = (i & 0x7F) == 0x7F ? v : v / kDecodeUnscale;"
    assert fixed in text
    planted = text.replace(fixed, "t[i] = v / kDecodeUnscale;")
    # the planted header shadows the real one for a source that includes it
    os.makedirs(tmp_path / "cpu", exist_ok=True)
    (tmp_path / "cpu" / "fp8_simd.h").write_text(planted)
    src = os.path.join("csrc", "cpu", "arch", "arm", "neon.cpp")
    with open(os.path.join(ROOT, src)) as f:
        errors = clang_errors(CLANG_TARGETS["aarch64"], [src], replaced={src: f.read()}, out_dir=str(tmp_path))
    assert errors and "constant" in errors[0][1], errors
