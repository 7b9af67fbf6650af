"""The sources of the CPU kernel sets a build for one architecture compiles (kernel_set.h): the table, the portable
set and that architecture's folder. Used by setup.py for _C and by tests/test_cpu_harness.py for the torch-free
harness (no torch, no setuptools here)."""
import glob
import os

# platform.machine() names -> the folder under csrc/cpu/arch/ with that architecture's sets
ARCH_FOLDERS = {"x86_64": "x86", "amd64": "x86", "arm64": "arm", "aarch64": "arm"}


def kernel_set_sources(root, machine):
    """Paths relative to the repository root `root`, sorted."""
    base = os.path.join("csrc", "cpu", "arch")
    dirs = [base, os.path.join(base, "portable")]
    arch = ARCH_FOLDERS.get(machine.lower())
    if arch:
        dirs.append(os.path.join(base, arch))
    return sorted(f for d in dirs for f in glob.glob(os.path.join(d, "*.cpp"), root_dir=root))
