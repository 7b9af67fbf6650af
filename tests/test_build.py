"""The build: setup.py's metallib step (csrc/metal/metallib.py) run against a fake `xcrun`, and the package.

No Apple toolchain exists here, so the decisions and commands of the macOS build are checked with a stand-in
`xcrun` on PATH that records every call and fails where a real compiler would: a kernel that does not compile
must fail the build with the compiler's message; TORCH_LOWBIT_METALLIB=1 without a toolchain must be an error.
"""
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "csrc", "metal"))
sys.path.insert(0, os.path.join(ROOT, "csrc"))
import cxx_runtime  # noqa: E402
import metallib  # noqa: E402

# A stand-in for Apple's xcrun: appends its argv to $FAKE_XCRUN_LOG (one JSON list a line); `metal -c F -o O`
# fails with a clang-style error when F holds PLANTED_ERROR, else writes O; `metallib ... -o O` writes O.
# FAKE_XCRUN_NO_METAL=1 makes `metal` fail as Xcode 26 does without its Metal toolchain component;
# FAKE_XCRUN_NO_TENSOR=1 makes it fail on Metal 4 tensor-op sources, as an SDK before macOS 26 does.
FAKE_XCRUN = textwrap.dedent("""\
    #!{python}
    import json, os, sys
    args = sys.argv[1:]
    with open(os.environ["FAKE_XCRUN_LOG"], "a") as f:
        f.write(json.dumps(args) + "\\n")
    if args[:2] == ["-sdk", "macosx"]:
        args = args[2:]
    if args[0] == "--find":
        print("/fake/usr/bin/" + args[1]); sys.exit(0)
    if args[0] == "metal" and os.environ.get("FAKE_XCRUN_NO_METAL") == "1":
        print("error: cannot execute tool 'metal' due to missing Metal Toolchain"); sys.exit(1)
    if args[0] == "metal" and args[1:] == ["--version"]:
        print("Apple metal version 32023.0 (fake)"); sys.exit(0)
    out = args[args.index("-o") + 1]
    if args[0] == "metal":
        src = args[args.index("-c") + 1]
        if os.environ.get("FAKE_XCRUN_NO_TENSOR") == "1" and "MetalPerformancePrimitives" in open(src).read():
            print(src + ":3:10: fatal error: 'MetalPerformancePrimitives/MetalPerformancePrimitives.h' file not found")
            sys.exit(1)
        if "PLANTED_ERROR" in open(src).read():
            print(src + ":2:1: error: unknown type name 'PLANTED_ERROR'"); sys.exit(1)
        print(src + ":1:1: warning: a warning the build must show")
    open(out, "w").write("fake " + args[0])
    """)


@pytest.fixture
def fake_xcrun(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "xcrun"
    script.write_text(FAKE_XCRUN.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "xcrun.log"
    log.write_text("")
    monkeypatch.setenv("PATH", str(bindir) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("FAKE_XCRUN_LOG", str(log))
    return lambda: [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture
def no_xcrun(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


# ---- when the build makes a metallib ----
def test_metallib_is_macos_only_by_default():
    assert metallib.want_metallib({}, is_mac=False, toolchain_missing=lambda: pytest.fail("probed off macOS")) is False
    assert metallib.want_metallib({}, is_mac=True, toolchain_missing=lambda: None) is True


def test_metallib_0_never_probes():
    env = {metallib.MODE_ENV: "0"}
    assert metallib.want_metallib(env, is_mac=True, toolchain_missing=lambda: pytest.fail("probed")) is False


def test_metallib_1_without_toolchain_is_a_build_error(no_xcrun):
    with pytest.raises(metallib.MetalBuildError, match=r"TORCH_LOWBIT_METALLIB=1.*xcrun is not on PATH"):
        metallib.want_metallib({metallib.MODE_ENV: "1"}, is_mac=False)


def test_metallib_mode_must_be_0_or_1():
    with pytest.raises(metallib.MetalBuildError, match=r"TORCH_LOWBIT_METALLIB='yes': expected 0, 1 or unset"):
        metallib.want_metallib({metallib.MODE_ENV: "yes"}, is_mac=True)


def test_toolchain_found_through_xcrun(fake_xcrun):
    assert metallib.find_toolchain() is None
    assert metallib.want_metallib({}, is_mac=True) is True
    assert ["-sdk", "macosx", "metal", "--version"] in fake_xcrun()


def test_xcode26_without_metal_component_falls_back_to_source(fake_xcrun, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_XCRUN_NO_METAL", "1")
    assert metallib.want_metallib({}, is_mac=True) is False
    assert "downloadComponent MetalToolchain" in capsys.readouterr().out
    with pytest.raises(metallib.MetalBuildError, match="missing Metal Toolchain"):
        metallib.want_metallib({metallib.MODE_ENV: "1"}, is_mac=True)


# ---- what it runs ----
def test_every_kernel_compiled_into_the_portable_or_the_m5_library(fake_xcrun, tmp_path, capsys):
    out = tmp_path / "pkg"
    built = metallib.build_metallibs(ROOT, str(out), str(tmp_path / "air"))
    assert built == [str(out / "lowbit.metallib"), str(out / "lowbit_apple10.metallib")]
    calls = fake_xcrun()
    compiles = [c for c in calls if c[2] == "metal" and "-probe.metal" not in c[c.index("-c") + 1]]
    sources = sorted(os.path.relpath(c[c.index("-c") + 1], ROOT) for c in compiles)
    assert sources == metallib.metal_files(ROOT) and len(sources) >= 7
    for c in compiles:
        if os.path.basename(c[c.index("-c") + 1]).endswith("_apple10.metal"):
            assert {"-std=metal4.0", "-mmacosx-version-min=26.2", "-fno-fast-math", "-Wall"} <= set(c), c
        else:
            assert {"-std=metal3.1", "-mmacosx-version-min=14.0", "-fno-fast-math", "-Wall"} <= set(c), c
    links = [c for c in calls if c[2] == "metallib"]
    assert [link[-1] for link in links] == built
    for link in links:
        lib = "lowbit_apple10" if link[-1].endswith("lowbit_apple10.metallib") else "lowbit"
        assert sorted(link[3:-2]) == sorted(c[c.index("-o") + 1] for c in compiles
                                            if os.path.basename(c[c.index("-o") + 1]).startswith(lib + "-"))
    assert "a warning the build must show" in capsys.readouterr().out


def test_sdk_without_tensor_ops_skips_the_m5_library_with_a_message(fake_xcrun, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_XCRUN_NO_TENSOR", "1")
    out = tmp_path / "pkg"
    out.mkdir()
    (out / "lowbit_apple10.metallib").write_text("stale")  # from a build with a newer SDK
    built = metallib.build_metallibs(ROOT, str(out), str(tmp_path / "air"))
    assert built == [str(out / "lowbit.metallib")]
    assert not (out / "lowbit_apple10.metallib").exists()
    text = capsys.readouterr().out
    assert "not building lowbit_apple10.metallib (metal4.0)" in text and "file not found" in text
    assert not any("_apple10.metal" in " ".join(c) for c in fake_xcrun() if c[2] == "metal")


def test_kernel_that_does_not_compile_fails_the_build_with_its_message(fake_xcrun, tmp_path):
    root = tmp_path / "repo"
    (root / "metal").mkdir(parents=True)
    (root / "metal" / "good.metal").write_text("kernel void good() {}\n")
    (root / "metal" / "bad.metal").write_text("// a kernel Apple's compiler rejects\nPLANTED_ERROR x;\n")
    with pytest.raises(metallib.MetalBuildError) as e:
        metallib.build_metallibs(str(root), str(tmp_path / "out"), str(tmp_path / "air"))
    assert "bad.metal:2:1: error: unknown type name 'PLANTED_ERROR'" in str(e.value)
    assert "building lowbit.metallib failed" in str(e.value)
    assert not (tmp_path / "out" / "lowbit.metallib").exists()


def _repo_with_a_kernel_apple_rejects(tmp_path):
    root = tmp_path / "repo"
    (root / "metal").mkdir(parents=True)
    (root / "metal" / "good.metal").write_text("kernel void good() {}\n")
    (root / "metal" / "bad.metal").write_text("// a kernel Apple's compiler rejects\nPLANTED_ERROR x;\n")
    return root


def test_compiler_error_in_auto_mode_prints_and_falls_back_to_the_source(fake_xcrun, tmp_path):
    root, out = _repo_with_a_kernel_apple_rejects(tmp_path), tmp_path / "out"
    out.mkdir()
    (out / "lowbit.metallib").write_text("stale")
    lines = []
    built = metallib.prepare_metallibs({}, True, str(root), str(out), str(tmp_path / "air"), log=lines.append)
    assert built == [] and not (out / "lowbit.metallib").exists()  # the launcher compiles the embedded source
    text = "\n".join(lines)
    assert "bad.metal:2:1: error: unknown type name 'PLANTED_ERROR'" in text
    assert "compiled from the embedded source at first use (TORCH_LOWBIT_METALLIB=1 makes this an error)" in text


def test_compiler_error_with_metallib_1_fails_the_build(fake_xcrun, tmp_path):
    root = _repo_with_a_kernel_apple_rejects(tmp_path)
    with pytest.raises(metallib.MetalBuildError, match="PLANTED_ERROR"):
        metallib.prepare_metallibs({metallib.MODE_ENV: "1"}, True, str(root), str(tmp_path / "out"),
                                   str(tmp_path / "air"), log=lambda s: None)


def test_auto_mode_builds_the_metallibs_where_they_compile(fake_xcrun, tmp_path):
    built = metallib.prepare_metallibs({}, True, ROOT, str(tmp_path / "out"), str(tmp_path / "air"),
                                       log=lambda s: None)
    # the fake compiler takes every library's probe: the portable library and each variant library are built
    assert built == [str(tmp_path / "out" / f"{lib.name}.metallib") for lib in metallib.libraries()]
    assert len(built) >= 2 and all(os.path.exists(b) for b in built)


def test_setup_py_metallib_1_without_toolchain_fails(tmp_path):
    env = dict(os.environ, PATH=os.path.dirname(sys.executable), TORCH_LOWBIT_METALLIB="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "setup.py"), "build_ext",
                        "--build-lib", str(tmp_path / "lib"), "--build-temp", str(tmp_path / "tmp")],
                       cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode != 0
    assert "TORCH_LOWBIT_METALLIB=1, but Apple's Metal toolchain is not usable" in r.stdout, r.stdout[-2000:]
    assert not (tmp_path / "lib").exists()  # nothing was compiled


def test_stale_metallib_removed_when_not_built(tmp_path):
    (tmp_path / "lowbit.metallib").write_text("old")
    metallib.remove_metallibs(str(tmp_path))
    assert not (tmp_path / "lowbit.metallib").exists()


# ---- the libraries: one portable, variants in one list ----
def test_embedded_source_holds_every_kernel():
    header = metallib.libraries_header(ROOT)
    assert '{"lowbit", 301, 7, 14, kLowbitMetalSource_lowbit, 0}' in header
    assert '{"lowbit_apple10", 400, 10, 26, kLowbitMetalSource_lowbit_apple10, 2}' in header  # macOS 26.2
    for f in metallib.metal_files(ROOT):
        for line in open(os.path.join(ROOT, f), encoding="ascii"):
            if line.startswith(("kernel void", "LOWBIT_KERNEL")):
                assert line in header, f"{f}: {line!r} missing from the embedded source"
    assert "#include \"" not in header.split("kLowbitMetalSource_lowbit", 1)[1]  # local includes inlined


def test_variant_library_gets_its_language_version_and_its_files(monkeypatch, tmp_path, fake_xcrun):
    claimed = metallib.metal_files(ROOT)[0]
    variant = metallib.Library("lowbit_apple10", msl_version=400, apple_family=10, macos=26, files=(claimed,))
    monkeypatch.setattr(metallib, "VARIANTS", (variant,))
    assert claimed not in metallib.library_files(metallib.PORTABLE, ROOT)
    header = metallib.libraries_header(ROOT)
    assert '{"lowbit_apple10", 400, 10, 26, kLowbitMetalSource_lowbit_apple10, 0}' in header
    assert header.index('"lowbit", 301') < header.index('"lowbit_apple10", 400')  # portable first
    metallib.build_metallibs(ROOT, str(tmp_path / "out"), str(tmp_path / "air"))
    variant_compiles = [c for c in fake_xcrun() if c[2] == "metal" and "-std=metal4.0" in c]
    assert [os.path.relpath(c[c.index("-c") + 1], ROOT) for c in variant_compiles] == [claimed]
    assert "-mmacosx-version-min=26.0" in variant_compiles[0]
    assert (tmp_path / "out" / "lowbit_apple10.metallib").exists()


# ---- the package: one version, an sdist that builds and runs elsewhere ----
def test_one_version_number():
    import torch_lowbit
    from torch_lowbit import _version
    assert torch_lowbit.__version__ == _version.__version__
    pyproject = open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8").read()
    assert 'dynamic = ["version"]' in pyproject and "torch_lowbit._version.__version__" in pyproject
    assert "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]


# ---- the C++ runtime: _C shares torch's libstdc++ ----

elf_needed = cxx_runtime.elf_needed


class FakeCompiler:
    def __init__(self, **commands):
        self.__dict__.update(commands)


class FakeExtension:
    def __init__(self, name, extra_link_args):
        self.name, self.extra_link_args = name, extra_link_args


def test_static_cxx_runtime_flags_removed_from_every_link_command():
    compiler = FakeCompiler(linker_so=["g++", "-shared", "-static-libstdc++", "-Wl,-O1"],
                            linker_so_cxx=["g++", "-static-libstdc++", "-shared"], compiler_so=["gcc", "-O2"])
    exts = [FakeExtension("torch_lowbit._C", ["-fopenmp", "-static-libstdc++"]), FakeExtension("other", ["-ldl"])]
    where = cxx_runtime.keep_cxx_runtime_shared(compiler, exts)
    assert compiler.linker_so == ["g++", "-shared", "-Wl,-O1"] and compiler.linker_so_cxx == ["g++", "-shared"]
    assert compiler.compiler_so == ["gcc", "-O2"]
    assert exts[0].extra_link_args == ["-fopenmp"] and exts[1].extra_link_args == ["-ldl"]
    assert where == ["-static-libstdc++ from the compiler's linker_so", "-static-libstdc++ from the compiler's "
                     "linker_so_cxx", "-static-libstdc++ from torch_lowbit._C's extra_link_args"]
    assert cxx_runtime.keep_cxx_runtime_shared(FakeCompiler(linker_so=["cc", "-shared"]), []) == []


def test_elf_needed_reads_a_known_library():
    import torch
    libc10 = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    if not sys.platform.startswith("linux") or not os.path.exists(libc10):
        pytest.skip("ELF shared objects: Linux")
    assert any(n.startswith("libc.so") for n in elf_needed(libc10))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ and ELF: Linux")
def test_build_check_refuses_an_object_without_the_shared_libstdcxx():
    import _json  # a C extension of the standard library: needs no libstdc++
    import torch
    assert cxx_runtime.static_runtime_error(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")) is None
    error = cxx_runtime.static_runtime_error(_json.__file__)
    assert error and _json.__file__ in error and "static copy of libstdc++" in error


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ and ELF: Linux")
def test_loaded_libstdcxx_is_the_one_torch_mapped():
    import torch  # noqa: F401
    path = cxx_runtime.loaded_libstdcxx()
    assert path and os.path.basename(path).startswith("libstdc++.so") and os.path.exists(path)
    assert cxx_runtime.loaded_libstdcxx("/nonexistent/maps") is None


def test_loaded_libstdcxx_reads_paths_with_spaces(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f10-7f20 r--p 00000000 00:2a 41   /home/u/My Env/lib/libc10.so\n"
                    "7f20-7f30 r-xp 00000000 00:2a 42   /home/u/My Env/lib/libstdc++.so.6.0.33\n")
    assert cxx_runtime.loaded_libstdcxx(str(maps)) == "/home/u/My Env/lib/libstdc++.so.6.0.33"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libstdc++ and ELF: Linux")
def test_extension_links_the_shared_libstdcxx():
    """A _C with its own static libstdc++ crashes or cuts every error message holding a number (cxx_runtime.py)."""
    from torch_lowbit import _C
    assert "libstdc++.so.6" in elf_needed(_C.__file__), elf_needed(_C.__file__)


CI = os.environ.get("TORCH_LOWBIT_CI") == "1"

SMOKE = """
import os, sys, torch, torch_lowbit
assert os.path.realpath(torch_lowbit.__file__).startswith(os.path.realpath(sys.prefix)), torch_lowbit.__file__
print(torch_lowbit.__version__)
g = torch.Generator().manual_seed(7)
w = (torch.randn(40, 72, generator=g) * 8).to(torch.float8_e4m3fn)
s = torch.rand(40, generator=g) + 0.5
x = torch.randn(3, 72, generator=g)
ref = x.double() @ (w.double() * s.double()[:, None]).T
out = torch_lowbit.fp8_mm(x, w, s)
err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
assert out.shape == (3, 40) and err < 1e-5, err
xq, wq = torch.zeros(2, 8, dtype=torch.int8), torch.zeros(4, 16, dtype=torch.int8)
try:
    torch.ops.lowbit.int8_mm(xq, torch.ones(2, 1), wq, torch.ones(4, 1), None, torch.float32)
    raise AssertionError("int8_mm accepted K = 8 against K = 16")
except RuntimeError as e:  # the numbers in the message: a static libstdc++ in _C cuts it at the first one
    assert "(8) must equal wq's K (16)" in str(e), str(e)
print("smoke ok", err)
"""


def installed_files_state():
    """(file, mtime) of torch_lowbit as installed in this interpreter's site-packages (the shared editable
    install, if any; not the egg-info that building the sdist leaves in the checkout)."""
    import importlib.metadata as md
    import site
    state = []
    for dist in md.distributions(name="torch_lowbit", path=site.getsitepackages()):
        paths = [dist.locate_file(f) for f in dist.files or []]
        state += [(str(p), os.path.getmtime(p)) for p in paths if os.path.exists(p)]
    return sorted(state)


def sdist_members(tarball):
    import tarfile
    with tarfile.open(tarball) as t:
        return {n.split("/", 1)[1] for n in t.getnames() if "/" in n}


@pytest.mark.skipif(not CI, reason="builds _C from an sdist in a fresh venv (a from-scratch compile, minutes): "
                                   "runs in CI (.ci/run sets TORCH_LOWBIT_CI=1)")
def test_sdist_round_trip(tmp_path):
    """python -m build --sdist; pip install --no-build-isolation in a fresh venv (torch from the host, emulator
    off and no optimization to keep the build short); import it there and run one op on cpu. The shared install is
    not touched: the venv has its own site-packages, and pip leaves packages outside it alone."""
    shared_before = installed_files_state()
    r = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--skip-dependency-check",
                        "--outdir", str(tmp_path), ROOT], cwd=tmp_path, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
    (tarball,) = tmp_path.glob("torch_lowbit-*.tar.gz")
    members = sdist_members(tarball)
    needed = ["setup.py", "pyproject.toml", "README.md", "MANIFEST.in"]
    for top in ("csrc", "metal"):
        for dirpath, dirnames, files in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            needed += [os.path.relpath(os.path.join(dirpath, f), ROOT) for f in files if not f.endswith(".pyc")]
    missing = sorted(set(needed) - members)
    assert not missing, f"not in the sdist: {missing}"
    assert not [m for m in members if m.endswith((".so", ".metallib"))]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    # A toolchain that links libstdc++ statically by default (a compiler wrapper adding -static-libstdc++ to
    # every link, out of the build's reach), and LDFLAGS asking for it: the build must still link the shared one
    cxx = tmp_path / "static-cxx"
    cxx.write_text('#!/bin/sh\nexec g++ "$@" -static-libstdc++\n')
    cxx.chmod(0o755)
    # emulator off and no optimization: the archive's build and link are what is checked, in a third of the time
    env = dict(os.environ, TORCH_LOWBIT_EMULATOR="0", TORCH_LOWBIT_OPTIMIZE="0", MAX_JOBS="2",
               LDFLAGS="-static-libstdc++", CXX=str(cxx))
    r = subprocess.run([py, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-cache-dir",
                        str(tarball)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True)
    assert r.returncode == 0, r.stdout[-3000:]
    (built,) = (venv / "lib").glob("python*/site-packages/torch_lowbit/_C*.so")
    assert "libstdc++.so.6" in elf_needed(built), elf_needed(built)
    r = subprocess.run([py, "-c", SMOKE], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 0, r.stdout[-3000:]
    import torch_lowbit
    assert r.stdout.splitlines()[0] == torch_lowbit.__version__ and "smoke ok" in r.stdout
    assert installed_files_state() == shared_before, "the round trip changed this interpreter's torch_lowbit install"
