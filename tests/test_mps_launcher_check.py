"""The launcher check: csrc/metal/mps_launcher.mm compiles as Objective-C++ here, without a Mac.

clang parses the file (-fsyntax-only) against tests/launcher_stubs/ -- Apple's Foundation / Metal /
libdispatch declarations that the launcher (and torch's ATen/mps headers) use, each written from Apple's
documented signature -- and against the installed torch's own headers, ATen/mps/MPSStream.h and
MPSDevice.h included (they ship in every torch wheel). A misspelled selector, a wrong argument type or a
torch MPS API that moved then fails here. It compiles once per macOS SDK level the stubs model (14, 15, 26:
tests/launcher_stubs/Availability.h): a name newer than the oldest SDK must be hidden by a compile-time SDK
check, since `@available` only tests the OS at run time. Objective-C reports an unknown selector only as a warning, so
warnings are errors. `-fobjc-runtime=gnustep-2.0` only tells clang which Objective-C ABI to assume (Debian's
clang ships no Apple runtime); with -fsyntax-only nothing is generated.

Run it by hand: python tests/test_mps_launcher_check.py  (prints the command, then compiles)
"""
import os
import re
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


# The heavy, SDK-independent includes of mps_launcher.mm (torch's own headers). The test precompiles them
# once (a PCH) so that the real file and every mutant parse in ~2 s of CPU instead of ~12 s each; the headers
# parsed are the same as without it (their include guards skip them in the .mm). The Apple stubs and torch's
# ATen/mps headers that include them are small and differ per SDK level: parsed with each file.
PREFIX = """#include <ATen/ATen.h>
#include <torch/library.h>
"""

# the SDK levels of tests/launcher_stubs (LOWBIT_STUB_SDK): the oldest macOS the kernels run on, and newer ones
SDK_LEVELS = {"macOS 14 SDK": 140000, "macOS 15 SDK": 150000, "macOS 26 SDK": 260000}


def clang_flags():
    from torch.utils.cpp_extension import include_paths
    flags = ["-fblocks", "-std=c++20", "-fobjc-runtime=gnustep-2.0", "-Wall", "-Werror", "-ferror-limit=5",
             "-I", STUBS]
    for p in include_paths():
        flags += ["-isystem", p]  # torch's headers: their own warnings are not ours
    return flags


def check_command(source, gen_dir, sdk, pch=None):
    """The clang invocation of the check at SDK level `sdk` (LOWBIT_STUB_SDK). gen_dir holds
    lowbit_metal_libraries.h (its content is irrelevant)."""
    cmd = [find_clang(), "-x", "objective-c++", "-fsyntax-only"] + clang_flags() + [f"-DLOWBIT_STUB_SDK={sdk}"]
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
    # a stand-in for build/gen/lowbit_metal_libraries.h, so that the check does not depend on a build
    with open(os.path.join(d, "lowbit_metal_libraries.h"), "w") as f:
        f.write('#pragma once\n#include "metal/metal_libraries.h"\n'
                'static const lowbit::metal::MetalLibrary kLowbitMetalLibraries[] = {{"lowbit", 301, 7, 14, ""}};\n')


# Planted mistakes: (what, SDK level, original text, replacement, a fragment of the expected diagnostic)
MUTANTS = [
    ("misspelled selector", "macOS 15 SDK", "setThreadgroupMemoryLength:(dp", "setThreadGroupMemoryLength:(dp",
     "not found"),
    ("torch API that does not exist", "macOS 15 SDK", "stream->commandEncoder()", "stream->computeEncoder()",
     "no member named"),
    ("wrong argument type", "macOS 15 SDK", "setBuffer:getMTLBufferStorage(a.tensor)",
     "setBuffer:a.tensor.data_ptr()", "error:"),
    # issue 11 defect 2: `options.mathMode` under @available alone does not build with the macOS 14 SDK
    ("mathMode guarded by @available only", "macOS 14 SDK", "#if LOWBIT_SDK_MACOS_15\n  if (@available",
     "#if 1\n  if (@available", "mathMode"),
    ("MTLGPUFamilyApple10 without its SDK guard", "macOS 15 SDK", "#if LOWBIT_SDK_MACOS_26\n      {MTLGPUFamilyApple10",
     "#if 1\n      {MTLGPUFamilyApple10", "MTLGPUFamilyApple10"),
    ("deprecated fastMathEnabled not silenced", "macOS 15 SDK",
     '#pragma clang diagnostic ignored "-Wdeprecated-declarations"', "", "deprecated"),
]


@pytest.fixture(scope="module")
def compiled():
    """Compile the real launcher and every mutant concurrently (each parse costs several CPU seconds)."""
    if sys.platform == "darwin":
        # the stubs would shadow the real SDK's headers; on macOS the build itself compiles the launcher
        pytest.skip("on macOS the build compiles mps_launcher.mm against the real SDK")
    if find_clang() is None:
        pytest.skip("clang is not installed (apt-get install clang)")
    src = open(LAUNCHER, encoding="ascii").read()
    with tempfile.TemporaryDirectory() as d:
        write_gen_header(d)
        pch = build_pch(d)
        jobs = {level: (LAUNCHER, sdk) for level, sdk in SDK_LEVELS.items()}
        for what, level, old, new, _ in MUTANTS:
            assert src.count(old) == 1, f"mutant '{what}': {old!r} must occur once in mps_launcher.mm"
            path = os.path.join(d, "".join(c if c.isalnum() else "_" for c in what) + ".mm")
            with open(path, "w") as f:
                f.write(src.replace(old, new))
            jobs[what] = (path, SDK_LEVELS[level])
        yield run_parallel({k: check_command(path, d, sdk, pch) for k, (path, sdk) in jobs.items()})


def run_parallel(commands, width=2):
    """{key: (returncode, output)}; at most `width` parses at once (each holds ~0.5 GB)."""
    results, running, todo = {}, {}, list(commands.items())
    while todo or running:
        while todo and len(running) < width:
            k, cmd = todo.pop(0)
            running[k] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        k = next(iter(running))
        p = running.pop(k)
        results[k] = (p.wait(), p.communicate()[0])
    return results


@pytest.mark.parametrize("level", SDK_LEVELS)
def test_launcher_compiles_against_apple_stubs_and_torch_headers(compiled, level):
    rc, out = compiled[level]
    assert rc == 0, f"mps_launcher.mm fails the launcher check with the {level}:\n" + out


@pytest.mark.parametrize("what,level,old,new,diagnostic", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_launcher_check_catches(compiled, what, level, old, new, diagnostic):
    rc, out = compiled[what]
    assert rc != 0, f"the launcher check accepted a {what} ({old} -> {new})"
    assert diagnostic in out, out


# ---- autorelease pools ----
# Objective-C methods outside the alloc / new / copy families hand back autoreleased objects (an NSString from
# stringWithUTF8String:, an NSError's localizedDescription), freed only when the innermost @autoreleasepool
# drains. The ops run on Python's threads and on the stream's queue, which drain none for us: every message send
# of the launcher must lie inside an @autoreleasepool block (the rule PyTorch's MPS ops follow). A lexical check:
# the file is small and written to it, one pool per function that talks to Objective-C.
sys.path.insert(0, os.path.join(ROOT, "csrc", "emu"))
from msl_prep import mask_comments_strings  # noqa: E402


def _matching(text, i):
    """Index of the bracket closing the one at text[i]."""
    pairs, depth = {"[": "]", "(": ")", "{": "}"}, 0
    opening, closing = text[i], pairs[text[i]]
    for j in range(i, len(text)):
        depth += (text[j] == opening) - (text[j] == closing)
        if depth == 0:
            return j
    raise ValueError(f"unbalanced {opening} at {i}")


def _top_level(inner):
    """inner with every nested (), [] and {} group replaced by one placeholder word R."""
    out, i = [], 0
    while i < len(inner):
        if inner[i] in "([{":
            out.append("R")
            i = _matching(inner, i) + 1
        else:
            out.append(inner[i])
            i += 1
    return "".join(out)


MESSAGE = re.compile(r"^\s*[\w.\->]*[\w)\]]\s+[A-Za-z_]\w*\s*(:|$)", re.S)


def message_sends(text):
    """Offsets of the Objective-C message sends `[receiver selector...]` in text (comments and strings masked)."""
    return [i for i, c in enumerate(text) if c == "[" and MESSAGE.match(_top_level(text[i + 1:_matching(text, i)]))]


def pools(text):
    """(start, end) of every @autoreleasepool block's braces."""
    spans = []
    for m in re.finditer(r"@autoreleasepool\s*\{", text):
        spans.append((m.end() - 1, _matching(text, m.end() - 1)))
    return spans


def sends_outside_pools(source):
    text = mask_comments_strings(source)
    spans = pools(text)
    return [text.count("\n", 0, i) + 1 for i in message_sends(text) if not any(a < i < b for a, b in spans)]


def test_every_message_send_is_inside_an_autoreleasepool():
    src = open(LAUNCHER, encoding="ascii").read()
    assert len(message_sends(mask_comments_strings(src))) >= 20  # the scanner sees the launcher's messages
    assert sends_outside_pools(src) == [], "mps_launcher.mm lines with a message send outside an @autoreleasepool"


def test_pool_check_catches_each_missing_pool():
    src = open(LAUNCHER, encoding="ascii").read()
    starts = [m.start() for m in re.finditer(r"@autoreleasepool", mask_comments_strings(src))]
    assert len(starts) >= 8
    for at in starts:  # drop one pool, keep its block: the messages in it are flagged
        mutant = src[:at] + " " * len("@autoreleasepool") + src[at + len("@autoreleasepool"):]
        assert sends_outside_pools(mutant), f"removing the pool at line {src.count(chr(10), 0, at) + 1} went unseen"


def test_message_scanner_tells_messages_from_subscripts_and_lambdas():
    text = ("[[maybe_unused]] int a = v[i]; auto f = [&](int x) { return x; }; [obj release]; "
            "[[NSProcessInfo processInfo] isOperatingSystemAtLeastVersion:v]; [dev newBufferWithLength:n - 1 "
            "options:0]; x = y[n - offset];")
    sends = [text[i:i + 12] for i in message_sends(text)]
    assert sends == ["[obj release", "[[NSProcessI", "[NSProcessIn", "[dev newBuff"]


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        write_gen_header(d)
        rc = 0
        for level, sdk in SDK_LEVELS.items():
            cmd = check_command(LAUNCHER, d, sdk)
            print(level + ": " + " ".join(cmd))
            rc |= subprocess.call(cmd)
        sys.exit(rc)
