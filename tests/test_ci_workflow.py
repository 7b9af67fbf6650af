""".github/workflows/ci.yml, checked as far as Linux can: it parses, its Linux job is .ci/run, every command
it runs exists here (repository paths, `python -m` modules, bench suites), the macOS jobs build the metallib
on macos-14, macos-15 and macos-26 (there the M5 library too), and the on-demand hardware job runs the suite
(twice: once under Metal's validation layers), the main job, metal-traffic, m5 and the cpu suite."""
import os
import shlex

import pytest

yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKFLOW = os.path.join(ROOT, ".github", "workflows", "ci.yml")
ACTIONS = {"actions/checkout", "actions/setup-python", "actions/upload-artifact"}  # what the workflow may use
TOOLS = {"bash", "pip", "python", "python3", "xcrun", "tee"}  # executables the runner image provides
STDLIB_MODULES = {"pip", "venv"}  # `python -m` modules of every Python; others must be here or in the test extra


@pytest.fixture(scope="module")
def workflow():
    with open(WORKFLOW, encoding="utf-8") as f:
        return yaml.safe_load(f)


def runs(job):
    return [s["run"] for s in job["steps"] if "run" in s]


def commands(script):
    """Each command of a run script, as argv lists (split at pipes and &&)."""
    out = []
    for line in script.splitlines():
        for part in line.replace("&&", "|").split("|"):
            argv = shlex.split(part, comments=True)
            if argv:
                out.append(argv)
    return out


def test_triggers(workflow):
    on = workflow[True] if True in workflow else workflow["on"]  # YAML 1.1 reads a bare `on` key as True
    assert {"push", "pull_request", "workflow_dispatch"} <= set(on)


def test_linux_job_is_ci_run(workflow):
    job = workflow["jobs"]["linux"]
    assert job["runs-on"] == "ubuntu-latest"
    assert runs(job) == ["bash .ci/run"]


def test_macos_jobs_build_with_apple_toolchain(workflow):
    job = workflow["jobs"]["macos"]
    assert job["strategy"]["matrix"]["os"] == ["macos-14", "macos-15", "macos-26"]
    assert job["runs-on"] == "${{ matrix.os }}"
    assert job["env"]["TORCH_LOWBIT_METALLIB"] == "1"  # a missing Metal compiler or a kernel error fails the job
    scripts = runs(job)
    assert any(s.startswith("pip install --no-build-isolation -e") for s in scripts)
    assert "python -m torch_lowbit.env" in scripts
    assert any(s.startswith("python -m pytest") and s.endswith("tests") for s in scripts)


def test_macos_26_must_build_the_m5_library(workflow):
    # the one SDK with the tensor-op headers: a probe that stops compiling there must fail CI, not skip quietly
    steps = [s for s in workflow["jobs"]["macos"]["steps"] if s.get("if") == "matrix.os == 'macos-26'"]
    assert len(steps) == 1 and "lowbit_apple10.metallib" in steps[0]["run"] and "assert" in steps[0]["run"]
    names = [lib.name for lib in _metallib().libraries()]
    assert "lowbit_apple10" in names  # the library the step checks is one the build makes


def _metallib():
    import importlib.util
    spec = importlib.util.spec_from_file_location("metallib", os.path.join(ROOT, "csrc", "metal", "metallib.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hardware_job_on_demand_on_a_self_hosted_mac(workflow):
    job = workflow["jobs"]["mac-hardware"]
    assert job["runs-on"] == ["self-hosted", "macOS", "ARM64"]
    assert job["if"] == "github.event_name == 'workflow_dispatch'"
    argvs = [c for s in runs(job) for c in commands(s)]
    assert any(c[1:4] == ["-m", "pytest", "-q"] for c in argvs)
    bench = [c for c in argvs if c[1:3] == ["-m", "torch_lowbit.bench"]]
    assert any("--json" in c for c in bench) and any(c[3:5] == ["--suite", "metal-traffic"] for c in bench)
    assert any(c[3:5] == ["--suite", "m5"] for c in bench)  # M5 vs portable, on an M5
    cpu = [c for c in bench if c[3:5] == ["--suite", "cpu"]]  # the Arm kernel sets' speed: no other job has it
    assert cpu and "--json" in cpu[0]
    upload = [s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact")]
    assert upload and "bench-layer.json" in upload[0]["with"]["path"]
    assert cpu[0][cpu[0].index("--json") + 1] in upload[0]["with"]["path"]
    for other in ("linux", "macos"):
        assert workflow["jobs"][other]["if"] == "github.event_name != 'workflow_dispatch'"


def test_hardware_job_runs_the_suite_again_under_metal_validation(workflow):
    steps = workflow["jobs"]["mac-hardware"]["steps"]
    suite = [i for i, s in enumerate(steps) if "run" in s and commands(s["run"])[0][1:3] == ["-m", "pytest"]]
    assert len(suite) == 2
    plain, validated = (steps[i] for i in suite)
    assert "env" not in plain and plain["run"] == validated["run"]  # the same suite, the mps cases included
    assert validated["env"] == {"MTL_DEBUG_LAYER": "1", "MTL_SHADER_VALIDATION": "1"}
    assert validated["if"] == "always()"  # also after a failure of the plain run


def extra_test_modules():  # not a test: the `test` extra of pyproject.toml
    import tomllib
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"]["optional-dependencies"]["test"])


def module_exists(name):
    if name in STDLIB_MODULES or name in extra_test_modules():
        return True
    path = os.path.join(ROOT, *name.split("."))
    return os.path.exists(path + ".py") or os.path.exists(os.path.join(path, "__main__.py"))


def test_every_command_exists_here(workflow):
    from torch_lowbit.bench import SUITES
    for name, job in workflow["jobs"].items():
        for step in job["steps"]:
            if "uses" in step:
                assert step["uses"].split("@")[0] in ACTIONS, f"{name}: unexpected action {step['uses']}"
                continue
            for argv in commands(step["run"]):
                exe = argv[0]
                if "/" in exe:  # a venv's interpreter, e.g. .venv/bin/python
                    assert exe.endswith("/bin/python"), f"{name}: {exe}"
                    exe = "python"
                assert exe in TOOLS, f"{name}: unknown executable {exe!r} in {step['run']!r}"
                if exe == "bash":
                    assert os.path.isfile(os.path.join(ROOT, argv[1])), f"{name}: {argv[1]} is not in the repository"
                if exe.startswith("python") and "-m" in argv:
                    mod = argv[argv.index("-m") + 1]
                    assert module_exists(mod), f"{name}: python -m {mod}: no such module here"
                    if mod == "torch_lowbit.bench" and "--suite" in argv:
                        assert argv[argv.index("--suite") + 1] in SUITES
                    if mod == "pytest":
                        assert os.path.isdir(os.path.join(ROOT, argv[-1]))
                if exe == "pip" or (exe.startswith("python") and argv[1:3] == ["-m", "pip"]):
                    if "-e" in argv:
                        extra = argv[argv.index("-e") + 1]
                        assert extra == ".[test]"
