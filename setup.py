"""Build torch_lowbit's extensions.

torch_lowbit._C         op schemas, CPU kernels, Metal plans and launchers (the .mm launcher on macOS only)
torch_lowbit._msl_emu   every metal/*.metal kernel compiled as C++ through the MSL emulator (csrc/emu/);
                        not built when TORCH_LOWBIT_EMULATOR=0
torch_lowbit._msl_trace the same kernels instrumented to record every device-memory access (csrc/emu/trace.cpp),
                        for `python -m torch_lowbit.bench --suite metal-traffic`; built with the emulator
                        unless TORCH_LOWBIT_TRACE=0
torch_lowbit/*.metallib on macOS with Apple's Metal toolchain, every metal/*.metal precompiled (-std=metal3.1;
                        variant libraries for newer GPUs with their own version): csrc/metal/metallib.py.
                        TORCH_LOWBIT_METALLIB=0 skips it (the launcher then compiles the embedded source at
                        first use, as it does when an auto build's compile fails), =1 makes a missing toolchain
                        or a compiler error a build error

TORCH_LOWBIT_OPTIMIZE=0 compiles _C without optimization: a quick build that checks packaging and linking (the
kernels are then many times slower); the tests' source-archive round trip uses it.
"""
import glob
import os
import platform
import sys

from setuptools import Extension, setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
IS_MAC = sys.platform == "darwin"
IS_LINUX = sys.platform.startswith("linux")
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
BUILD_EMULATOR = os.environ.get("TORCH_LOWBIT_EMULATOR", "1") != "0"
BUILD_TRACE = BUILD_EMULATOR and os.environ.get("TORCH_LOWBIT_TRACE", "1") != "0"
OPTIMIZE = os.environ.get("TORCH_LOWBIT_OPTIMIZE", "1") != "0"
GEN = os.path.join("build", "gen")

sys.path.insert(0, os.path.join(ROOT, "csrc", "emu"))
sys.path.insert(0, os.path.join(ROOT, "csrc", "metal"))
sys.path.insert(0, os.path.join(ROOT, "csrc"))
sys.path.insert(0, os.path.join(ROOT, "csrc", "cpu", "arch"))
import cxx_runtime  # noqa: E402
from kernel_set_sources import kernel_set_sources  # noqa: E402
import metallib  # noqa: E402
import msl_prep  # noqa: E402


def rel(*parts):
    return os.path.join(*parts)


def write_if_changed(path, text):
    """Keep mtimes of unchanged generated files, so ninja rebuilds only what changed."""
    full = os.path.join(ROOT, path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    if os.path.exists(full) and open(full, encoding="ascii").read() == text:
        return path
    with open(full, "w", encoding="ascii") as f:
        f.write(text)
    return path


def metal_files():
    return metallib.metal_files(ROOT)


def generate_metal_libraries_header():
    """Every Metal library's source embedded in _C, for newLibraryWithSource in mps_launcher.mm."""
    return write_if_changed(rel(GEN, "lowbit_metal_libraries.h"), metallib.libraries_header(ROOT))


def generate_emulator_sources():
    out = []
    for p in metal_files():
        name = os.path.splitext(os.path.basename(p))[0]
        text = msl_prep.prep(open(os.path.join(ROOT, p), encoding="ascii").read(), p)
        out.append(write_if_changed(rel(GEN, "emu", name + ".cpp"), text))
    return out


def cxx_flags():
    flags = ["-O3" if OPTIMIZE else "-O0", "-g0"]
    if not IS_MAC:
        flags.append("-fopenmp")
    return flags


def extensions():
    generate_metal_libraries_header()
    sources = sorted(glob.glob(rel("csrc", "*.cpp"), root_dir=ROOT) + glob.glob(rel("csrc", "cpu", "*.cpp"), root_dir=ROOT)
                     + kernel_set_sources(ROOT, platform.machine())
                     + glob.glob(rel("csrc", "metal", "*.cpp"), root_dir=ROOT))
    link = [] if IS_MAC else ["-fopenmp"]
    if IS_MAC:
        sources += sorted(glob.glob(rel("csrc", "metal", "*.mm"), root_dir=ROOT))
        link += ["-framework", "Metal", "-framework", "Foundation"]
    exts = [CppExtension(
        "torch_lowbit._C", sources,
        include_dirs=[os.path.join(ROOT, "csrc"), os.path.join(ROOT, GEN)],
        extra_compile_args={"cxx": cxx_flags()},
        extra_link_args=link + ([] if IS_MAC else ["-ldl"]),
    )]
    if BUILD_EMULATOR:
        exts.append(Extension(
            "torch_lowbit._msl_emu", [rel("csrc", "emu", "runtime.cpp")] + generate_emulator_sources(),
            include_dirs=EMU_INCLUDES, extra_compile_args={"cxx": emu_flags()}, extra_link_args=["-lpthread"],
            language="c++",
        ))
    if BUILD_TRACE:
        exts.append(trace_extension())
    return exts


# ---- the emulator flags, shared by _msl_emu and _msl_trace ----
EMU_INCLUDES = [os.path.join(ROOT, "csrc", "emu", "include"), os.path.join(ROOT, "metal")]


def emu_flags():
    # -fvisibility=hidden: each library keeps its own kernel state. g++ gives the static locals of template kernels
    # (their threadgroup arrays and epochs) STB_GNU_UNIQUE binding, one copy per process, which the emulator, its
    # traffic build and the tests' planted libraries would otherwise share; only the C API is exported.
    flags = ["-std=c++20", "-O2", "-g0", "-fPIC", "-fno-strict-aliasing", "-Wno-unused-variable", "-fvisibility=hidden"]
    if IS_X86:
        flags.append("-mf16c")  # _Float16 conversions in hardware; the emulator is a test tool
    if IS_MAC:
        flags.append("-Wno-deprecated-declarations")  # macOS deprecates the ucontext routines the fibers use
    return flags


# ---- _msl_trace: runtime + recorder built normally, the kernels with -fsanitize=thread hooks (no libtsan) ----
TRACE_EXT = "torch_lowbit._msl_trace"


def trace_extension():
    ext = Extension(TRACE_EXT, [rel("csrc", "emu", "runtime.cpp"), rel("csrc", "emu", "trace.cpp")],
                    include_dirs=EMU_INCLUDES, extra_compile_args={"cxx": emu_flags()},
                    extra_link_args=["-lpthread", "-ldl"], language="c++")
    ext.instrumented_sources = generate_emulator_sources()
    return ext


class BuildExt(BuildExtension):
    def run(self):
        # the metallibs first: with TORCH_LOWBIT_METALLIB=1 a kernel that Apple's compiler rejects fails the build
        # before the C++ starts
        out_dir = os.path.dirname(self.get_ext_fullpath("torch_lowbit._C"))
        try:
            metallib.prepare_metallibs(os.environ, IS_MAC, ROOT, out_dir, os.path.join(self.build_temp, "metallib"))
        except metallib.MetalBuildError as e:
            raise SystemExit(f"error: {e}")
        super().run()

    def build_extensions(self):
        for place in cxx_runtime.keep_cxx_runtime_shared(self.compiler, self.extensions):
            print(f"torch_lowbit: removed {place}: the extensions must share torch's libstdc++ (csrc/cxx_runtime.py)")
        runtime = cxx_runtime.loaded_libstdcxx() if IS_LINUX else None
        if runtime:
            for ext in self.extensions:
                ext.extra_link_args = [runtime] + list(ext.extra_link_args or [])
        super().build_extensions()
        if IS_LINUX:
            for ext in self.extensions:
                error = cxx_runtime.static_runtime_error(self.get_ext_fullpath(ext.name))
                if error:
                    raise SystemExit(f"error: {error}")

    def build_extension(self, ext):
        if ext.name == TRACE_EXT:
            # -g1: line tables, so that the traffic report can name the source line of each memory instruction
            flags = [f for f in emu_flags() if f != "-g0"] + ["-g1", "-fsanitize=thread"]
            ext.extra_objects = self.compiler.compile(
                ext.instrumented_sources, output_dir=os.path.join(self.build_temp, "msl_trace"),
                include_dirs=EMU_INCLUDES, extra_postargs={"cxx": flags})
        super().build_extension(ext)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt.with_options(use_ninja=True)})
