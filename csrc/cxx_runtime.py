"""The C++ runtime torch_lowbit's extensions link against (no torch, no setuptools: tests call it).

The extensions must use the shared libstdc++ that torch itself loads. A link flag such as -static-libstdc++
(from LDFLAGS, from a Python whose sysconfig carries it, or from a toolchain's defaults) puts a second, private
copy of libstdc++ into _C: then two copies of the iostream and locale state live in one process, and formatting
a number into one of our error messages reads the other copy's facets -- a segfault on one machine (torch 2.11,
gcc 13), a message silently cut at the first number on another. So the build removes such flags and says so.
"""

# Flags that link the C++ runtime statically into a shared object.
STATIC_CXX_RUNTIME_FLAGS = ("-static-libstdc++",)

# The distutils compiler attributes that hold a link command (linker_so_cxx on newer setuptools).
LINKER_ATTRIBUTES = ("linker_so", "linker_so_cxx", "linker_exe")


def without_static_cxx_runtime(args):
    """(args without the static C++ runtime flags, the flags removed)."""
    args = list(args or ())
    removed = [a for a in args if a in STATIC_CXX_RUNTIME_FLAGS]
    return [a for a in args if a not in STATIC_CXX_RUNTIME_FLAGS], removed


def keep_cxx_runtime_shared(compiler, extensions):
    """Strip the static C++ runtime flags from the compiler's link commands and the extensions' extra link args,
    in place; returns a description of each place a flag was removed from (empty when none was)."""
    where = []
    for attr in LINKER_ATTRIBUTES:
        cmd = getattr(compiler, attr, None)
        if cmd:
            kept, removed = without_static_cxx_runtime(cmd)
            if removed:
                setattr(compiler, attr, kept)
                where.append(f"{' '.join(removed)} from the compiler's {attr}")
    for ext in extensions:
        kept, removed = without_static_cxx_runtime(getattr(ext, "extra_link_args", None))
        if removed:
            ext.extra_link_args = kept
            where.append(f"{' '.join(removed)} from {ext.name}'s extra_link_args")
    return where
