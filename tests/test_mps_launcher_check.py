"""The launcher check: csrc/metal/mps_launcher.mm compiles as Objective-C++ here, without a Mac.

clang parses the file (-fsyntax-only) against tests/launcher_stubs/ -- Apple's Foundation / Metal /
libdispatch declarations that the launcher (and torch's ATen/mps headers) use, each written from Apple's
documented signature -- and against the installed torch's own headers, ATen/mps/MPSStream.h and
MPSDevice.h included (they ship in every torch wheel). A misspelled selector, a wrong argument type or a
torch MPS API that moved then fails here. Objective-C reports an unknown selector only as a warning, so
warnings are errors. `-fobjc-runtime=gnustep-2.0` only tells clang which Objective-C ABI to assume (Debian's
clang ships no Apple runtime); with -fsyntax-only nothing is generated.

Run it by hand: python tests/test_mps_launcher_check.py  (prints the command, then compiles)
"""
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(ROOT, "csrc", "metal", "mps_launcher.mm")
STUBS = os.path.join(ROOT, "tests", "launcher_stubs")


def find_clang():
    return shutil.which("clang++") or shutil.which("clang")


# The heavy, unchanging includes of mps_launcher.mm (torch + Apple stubs). The test precompiles them once
# (a PCH) so that the real file and every mutant parse in ~2 s of CPU instead of ~12 s each; the headers
# parsed are the same as without it (their include guards skip them in the .mm).
PREFIX = """#include <ATen/ATen.h>
#include <torch/library.h>
#include <torch/version.h>
#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>
#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
"""


def clang_flags():
    from torch.utils.cpp_extension import include_paths
    flags = ["-fblocks", "-std=c++20", "-fobjc-runtime=gnustep-2.0", "-Wall", "-Werror", "-ferror-limit=5",
             "-I", STUBS]
    for p in include_paths():
        flags += ["-isystem", p]  # torch's headers: their own warnings are not ours
    return flags


def check_command(source, gen_dir, pch=None):
    """The clang invocation of the check. gen_dir holds lowbit_metal_source.h (its content is irrelevant)."""
    cmd = [find_clang(), "-x", "objective-c++", "-fsyntax-only"] + clang_flags()
    if pch:
        cmd += ["-include-pch", pch]
    return cmd + ["-I", os.path.join(ROOT, "csrc"), "-I", gen_dir, source]


def build_pch(d):
    header, pch = os.path.join(d, "prefix.h"), os.path.join(d, "prefix.pch")
    with open(header, "w") as f:
        f.write(PREFIX)
    r = subprocess.run([find_clang(), "-x", "objective-c++-header"] + clang_flags() + [header, "-o", pch],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 0, "the launcher check's headers (torch + tests/launcher_stubs) fail:\n" + r.stdout
    return pch


def write_gen_header(d):
    # a stand-in for build/gen/lowbit_metal_source.h, so that the check does not depend on a build
    with open(os.path.join(d, "lowbit_metal_source.h"), "w") as f:
        f.write('#pragma once\nstatic const char kLowbitMetalSource[] = "";\n')


# Planted mistakes: (what, original text, replacement, a fragment of the expected diagnostic)
MUTANTS = [
    ("misspelled selector", "setThreadgroupMemoryLength:(dp", "setThreadGroupMemoryLength:(dp", "not found"),
    ("torch API that does not exist", "stream->commandEncoder()", "stream->computeEncoder()", "no member named"),
    ("wrong argument type", "setBuffer:getMTLBufferStorage(a.tensor)", "setBuffer:a.tensor.data_ptr()",
     "error:"),
]


@pytest.fixture(scope="module")
def compiled():
    """Compile the real launcher and every mutant concurrently (each parse costs several CPU seconds)."""
    if find_clang() is None:
        pytest.skip("clang is not installed (apt-get install clang)")
    src = open(LAUNCHER, encoding="ascii").read()
    with tempfile.TemporaryDirectory() as d:
        write_gen_header(d)
        pch = build_pch(d)
        jobs = {"real": subprocess.Popen(check_command(LAUNCHER, d, pch), stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, text=True)}
        for what, old, new, _ in MUTANTS:
            assert src.count(old) == 1, f"mutant '{what}': {old!r} must occur once in mps_launcher.mm"
            path = os.path.join(d, what.replace(" ", "_") + ".mm")
            with open(path, "w") as f:
                f.write(src.replace(old, new))
            jobs[what] = subprocess.Popen(check_command(path, d, pch), stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True)
        yield {k: (p.wait(), p.communicate()[0]) for k, p in jobs.items()}


def test_launcher_compiles_against_apple_stubs_and_torch_headers(compiled):
    rc, out = compiled["real"]
    assert rc == 0, "mps_launcher.mm fails the launcher check:\n" + out


@pytest.mark.parametrize("what,old,new,diagnostic", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_launcher_check_catches(compiled, what, old, new, diagnostic):
    rc, out = compiled[what]
    assert rc != 0, f"the launcher check accepted a {what} ({old} -> {new})"
    assert diagnostic in out, out


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        write_gen_header(d)
        cmd = check_command(LAUNCHER, d)
        print(" ".join(cmd))
        sys.exit(subprocess.call(cmd))
