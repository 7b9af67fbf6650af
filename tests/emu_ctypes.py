"""Test-only kernels in the repo's emulator: compile .metal files with csrc/emu (runtime, shim, msl_prep) into a
shared library with g++ and run their kernels through ctypes on numpy arrays.

The planted-bug kernels (tests/planted/) stay out of the shipped emulator this way. Libraries are cached under
build/planted/ (objects by the hash of their sources, headers and flags), so only the first test run pays
for the compile (~15 s of CPU).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EMU = os.path.join(ROOT, "csrc", "emu")
PLANTED = os.path.join(ROOT, "tests", "planted")
sys.path.insert(0, EMU)
import msl_prep  # noqa: E402

FLAGS = ["-std=c++20", "-O2", "-g0", "-fPIC", "-fno-strict-aliasing", "-w", "-fvisibility=hidden",  # as setup.py's
         "-I", os.path.join(EMU, "include"), "-I", os.path.join(ROOT, "metal"), "-I", PLANTED]
if os.uname().machine in ("x86_64", "amd64"):
    FLAGS.append("-mf16c")


class KernelError(RuntimeError):
    pass


def compiler():
    return shutil.which(os.environ.get("CXX", "g++"))


def _headers():
    inc = os.path.join(EMU, "include")
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(inc) for f in fs) + [
        os.path.join(ROOT, "metal", f) for f in sorted(os.listdir(os.path.join(ROOT, "metal"))) if f.endswith(".h")]


def _object(cxx, src, flags):
    """Cached object path for one source, by the content of it and of the headers, and the flags."""
    h = hashlib.sha256(repr((cxx, flags)).encode())
    for p in [src] + _headers():
        h.update(p.encode() + open(p, "rb").read())
    return os.path.join(ROOT, "build", "planted", "obj", f"{os.path.basename(src)}.{h.hexdigest()[:16]}.o")


def build(metal_files, trace=False):
    """Path of a shared library with the kernels of metal_files (and trace.cpp + instrumented kernels if trace)."""
    cxx = compiler()
    out = os.path.join(ROOT, "build", "planted")
    os.makedirs(os.path.join(out, "obj"), exist_ok=True)
    jobs = []  # (source to compile, flags, object)
    for src in [os.path.join(EMU, "runtime.cpp")] + ([os.path.join(EMU, "trace.cpp")] if trace else []):
        jobs.append((src, FLAGS, _object(cxx, src, FLAGS)))
    for m in metal_files:
        flags = FLAGS + (["-fsanitize=thread", "-g1"] if trace else [])
        obj = _object(cxx, m, flags)
        cpp = obj[:-2] + ".cpp"
        if not os.path.exists(cpp):
            with open(cpp, "w") as f:
                f.write(msl_prep.prep(open(m).read(), os.path.relpath(m, ROOT)))
        jobs.append((cpp, flags, obj))
    lib = os.path.join(out, hashlib.sha256("".join(o for _, _, o in jobs).encode()).hexdigest()[:16] + ".so")
    if os.path.exists(lib):
        return lib
    todo = [j for j in jobs if not os.path.exists(j[2])]

    def compile_one(job):
        src, flags, obj = job
        tmp = f"{obj}.{os.getpid()}.tmp.o"
        r = subprocess.run([cxx] + flags + ["-c", src, "-o", tmp], capture_output=True, text=True)
        if r.returncode == 0:
            os.replace(tmp, obj)
        return r

    with ThreadPoolExecutor(max_workers=2) as pool:  # two at a time: the machine is shared
        for job, r in zip(todo, pool.map(compile_one, todo)):
            if r.returncode:
                raise RuntimeError(f"compile of {job[0]} failed:\n{r.stderr}")
    tmp = lib + f".{os.getpid()}.tmp"
    subprocess.run([cxx, "-shared", "-o", tmp] + [o for _, _, o in jobs] + ["-lpthread", "-ldl"], check=True)
    os.replace(tmp, lib)
    return lib


class Library:
    def __init__(self, path):
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.lib.msl_emu_run.restype = ctypes.c_int
        self.lib.msl_emu_run.argtypes = [
            ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_size_t), ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
        self.lib.msl_emu_set_reverse.argtypes = [ctypes.c_int]
        self.lib.msl_emu_set_natural_tg_alignment.argtypes = [ctypes.c_int]

    def run(self, kernel, buffers, grid, tg, outputs=(), reverse=False, check=True, offsets=None, tg_mem=None,
            natural_tg_alignment=True):
        """buffers[i] binds [[buffer(i)]] (None: nil, as mps binds an empty tensor); indices in outputs start
        poisoned (0xFF) and are copied back. natural_tg_alignment=False places threadgroup arrays at 16 bytes
        instead of the alignment MSL promises them (msl_runtime.h TgVar).
        offsets[i]: the byte offset buffer i would be bound at on the device (its address residue modulo 64
        in the emulator; default 0). tg_mem[i]: bytes of [[threadgroup(i)]].
        Returns the emulator's report; with check, raises KernelError naming the kernel if it has any error
        or warning (like the emulator launcher of torch.ops.lowbit_emu)."""
        n = len(buffers)
        bufs = [None if b is None else np.ascontiguousarray(b) for b in buffers]
        ptrs = (ctypes.c_void_p * n)(*[None if b is None else b.ctypes.data for b in bufs])
        sizes = (ctypes.c_size_t * n)(*[0 if b is None else b.nbytes for b in bufs])
        flags = (ctypes.c_int * n)(*[3 if i in outputs else 0 for i in range(n)])
        g = (ctypes.c_uint * 3)(*(tuple(grid) + (1, 1, 1))[:3])
        t = (ctypes.c_uint * 3)(*(tuple(tg) + (1, 1, 1))[:3])
        residues = (ctypes.c_size_t * n)(*(offsets or [0] * n))
        mem = (ctypes.c_size_t * 8)(*(tg_mem or []))
        err = ctypes.create_string_buffer(16384)
        self.lib.msl_emu_set_reverse(1 if reverse else 0)
        self.lib.msl_emu_set_natural_tg_alignment(1 if natural_tg_alignment else 0)
        try:
            ne = self.lib.msl_emu_run(kernel.encode(), n, ptrs, sizes, flags, residues, g, t, mem, 0, err, len(err))
        finally:
            self.lib.msl_emu_set_reverse(0)
            self.lib.msl_emu_set_natural_tg_alignment(1)
        text = err.value.decode()
        if ne < 0:
            raise KernelError(f"no kernel named {kernel}")
        if check and (ne > 0 or "warning:" in text):
            raise KernelError(f"kernel '{kernel}' failed:\n{text}")
        for i in outputs:
            buffers[i][...] = bufs[i]
        return text


# ---- independent numerics (no bit tricks shared with the kernels) ----
def fp8_to_f64(b):
    b = np.asarray(b, np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, b & 7
    return sign * np.where(e == 0, m / 8.0 * 2.0 ** -6, (1 + m / 8.0) * 2.0 ** (e - 7.0))


def random_fp8(rng, shape):
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    return b
