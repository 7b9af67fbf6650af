"""The C++ runtime torch_lowbit's extensions link against (no torch, no setuptools: tests call it).

The extensions must use the shared libstdc++ that torch itself loads. A link flag such as -static-libstdc++
(from LDFLAGS, from a Python whose sysconfig carries it, or from a toolchain's defaults) puts a second, private
copy of libstdc++ into _C: then two copies of the iostream and locale state live in one process, and formatting
a number into one of our error messages reads the other copy's facets -- a segfault on one machine (torch 2.11,
gcc 13), a message silently cut at the first number on another. So the build removes such flags and says so,
links the libstdc++ this process loaded with torch by its path (a toolchain whose own runtime is an archive only,
or links it statically by default, then still resolves every C++ runtime symbol to the shared one), and checks
the result: a built extension without libstdc++.so.6 among its needed libraries fails the build.
"""
import struct

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


def loaded_libstdcxx(maps="/proc/self/maps"):
    """Path of the libstdc++.so this process has mapped (torch's, once torch is imported), or None."""
    try:
        with open(maps) as f:
            for line in f:
                fields = line.split(None, 5)  # address, perms, offset, dev, inode[, path: may hold spaces]
                if len(fields) == 6 and "/libstdc++.so" in fields[5]:
                    return fields[5].rstrip("\n")
    except OSError:
        pass
    return None


def elf_needed(path):
    """The DT_NEEDED entries of an ELF64 little-endian shared object (its .dynamic section, names in .dynstr)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path}: not an ELF64 little-endian file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    dynamic = next(s for s in sections if s[1] == 6)  # SHT_DYNAMIC
    strtab = sections[dynamic[6]]  # its sh_link: the string table
    names = []
    for off in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, val = struct.unpack_from("<qQ", data, off)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            start = strtab[4] + val
            names.append(data[start:data.index(b"\0", start)].decode())
    return names


def static_runtime_error(path):
    """None when the shared object at `path` needs the shared libstdc++, else the build error to stop with."""
    needed = elf_needed(path)
    if any(n.startswith("libstdc++.so") for n in needed):
        return None
    return (f"{path} was linked with its own static copy of libstdc++ (its needed libraries: {needed}); beside "
            "torch's shared libstdc++ it would crash or garble every error message holding a number. Build with a "
            "compiler that links libstdc++.so (e.g. CXX=g++ of the system), see csrc/cxx_runtime.py")
