#!/usr/bin/env python3
"""msl_check.py [FILE.metal ...] -- the address-space check: compile Metal kernels with clang as C++ for OpenCL.

The emulator compiles kernels as plain C++, where `device`, `threadgroup`, `constant` and `thread` vanish; so it
accepts what Apple's compiler rejects. This check compiles every metal/*.metal (default) with

    clang -x cl -cl-std=clc++2021 -fsyntax-only   (no generic address space, no fp64)

against csrc/emu/clcpp/metal_stdlib, which maps the four address spaces to __global / __local / __constant /
__private: a pointer or reference passed across address spaces, a pointer argument of a kernel without an
address space, a member function called on device memory without a `device` overload, a program-scope
variable outside `constant`, `double`, `std::` and non-ASCII bytes all fail. Exit status 1 on any error.

Template kernels: OpenCL kernels cannot be templates, so each instantiation line
    template [[host_name("NAME")]] [[kernel]] decltype(FUNC<ARGS>) FUNC<ARGS>;
(or metal/instantiate.h's LOWBIT_KERNEL line that expands to it) becomes a copy of FUNC's definition in
`namespace msl_check_NAME`, with the template parameters declared there from ARGS, compiled as a real kernel
(a #line directive keeps diagnostics on the original lines).
The rewritten files live in a temporary directory; the originals are not touched.
"""
from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from msl_prep import INSTANCE, KERNEL, expand_kernel_macros, mask_comments_strings, split_top  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
SHIM = os.path.join(HERE, "clcpp")
ROOT = os.path.dirname(os.path.dirname(HERE))

CLANG_FLAGS = ["-x", "cl", "-cl-std=clc++2021", "--target=spir64", "-cl-no-stdinc",
               # no fp64 (`double` is an error), no program-scope variables outside `constant`; fp16 for `half`.
               # The generic address space stays on: clang 14 cannot pass a struct by value without it. What
               # it lets through (unqualified pointers, device objects bound to `this`) the AST lint catches.
               "-Xclang", "-cl-ext=-cl_khr_fp64,-__opencl_c_fp64,-__opencl_c_program_scope_global_variables,"
               "-__opencl_c_device_enqueue,+cl_khr_fp16",
               "-fsyntax-only", "-Wno-unknown-attributes", "-ferror-limit=50", "-fno-color-diagnostics",
               "-Xclang", "-ast-dump"]
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


@dataclass
class TemplateKernel:
    name: str
    params: List[Tuple[str, str, Optional[str]]]  # (kind "type" or a value type, name, default)
    text: str                                     # from after the template header to the closing brace
    file: str                                     # path for #line
    line: int
    col: int


def clang_binary() -> Optional[str]:
    return shutil.which(os.environ.get("MSL_CHECK_CLANG", "clang"))


def _match(masked: str, i: int, open_ch: str, close_ch: str) -> int:
    """Index just past the bracket that closes the one at masked[i]."""
    depth = 0
    for j in range(i, len(masked)):
        if masked[j] == open_ch:
            depth += 1
        elif masked[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced {open_ch}{close_ch}")


def _blank(s: str) -> str:
    return "".join(ch if ch == "\n" else " " for ch in s)


def _template_params(header: str) -> List[Tuple[str, str, Optional[str]]]:
    out = []
    for p in split_top(header):
        p = p.strip()
        if not p:
            continue
        default = None
        parts = split_top(p, "=")
        if len(parts) > 1:
            p, default = parts[0].strip(), "=".join(parts[1:]).strip()
        m = re.match(r"^(.*?)(\w+)$", p, re.S)
        if not m:
            raise ValueError(f"cannot read template parameter '{p}'")
        kind = m.group(1).strip()
        out.append(("type" if kind in ("typename", "class") else kind, m.group(2), default))
    return out


def prepare(src: str, path: str) -> Tuple[str, Dict[str, TemplateKernel], List[Tuple[str, str, int]]]:
    """Rewrite one file: template kernel definitions and instantiation lines blanked, `[[kernel]]` -> `kernel`.
    Returns the text (same lines), its template kernels, and its instantiations (NAME, FUNC<ARGS>, line)."""
    src = expand_kernel_macros(src)  # metal/instantiate.h's lines, as the explicit instantiations they make
    masked = mask_comments_strings(src)
    edits = []
    instances = []
    for m in INSTANCE.finditer(src):
        if masked[m.start():m.start() + 8] != "template":
            continue
        instances.append((m.group(1), m.group(3), masked.count("\n", 0, m.start()) + 1))
        edits.append((m.start(), m.end(), _blank(m.group(0))))
    templates = {}
    for m in KERNEL.finditer(masked):
        w0 = max(0, m.start() - 2000)
        window = masked[w0:m.start()]
        if not re.search(r"template\s*<[^;{}]*>\s*(\[\[[^\]]*\]\]\s*)*$", window):
            continue  # not a template: compiled in place as an OpenCL kernel
        t0 = w0 + [h.start() for h in re.finditer(r"\btemplate\s*<", window)][-1]
        lt = masked.index("<", t0)
        gt = _match(masked, lt, "<", ">")
        paren = masked.index("(", m.end() - 1)
        brace = masked.index("{", _match(masked, paren, "(", ")"))
        end = _match(masked, brace, "{", "}")
        line = masked.count("\n", 0, gt) + 1
        col = gt - (masked.rfind("\n", 0, gt) + 1)
        templates[m.group(1)] = TemplateKernel(m.group(1), _template_params(src[lt + 1:gt - 1]), src[gt:end], path,
                                               line, col)
        edits.append((t0, end, _blank(src[t0:end])))
    for m in re.finditer(r"\[\[\s*kernel\s*\]\]", masked):
        if not any(s <= m.start() < e for s, e, _ in edits):
            edits.append((m.start(), m.end(), "kernel".ljust(m.end() - m.start())))
    out = src
    for s, e, r in sorted(edits, key=lambda x: x[0], reverse=True):
        out = out[:s] + r + out[e:]
    return out, templates, instances


def _clone(inst: Tuple[str, str, int], templates: Dict[str, TemplateKernel], path: str) -> str:
    name, expr, line = inst
    m = re.match(r"^\s*([\w:]+)\s*<(.*)>\s*$", expr, re.S)
    func = m.group(1).split("::")[-1] if m else expr.strip()
    t = templates.get(func)
    if not m or t is None:
        return (f'#line {line} "{path}"\n'
                f'#error "msl_check: {name}: no template kernel definition of {expr.strip()} seen"\n')
    args = [a.strip() for a in split_top(m.group(2)) if a.strip()]
    decls = []
    for i, (kind, pname, default) in enumerate(t.params):
        value = args[i] if i < len(args) else default
        if value is None:
            return f'#line {line} "{path}"\n#error "msl_check: {name}: no argument for template parameter {pname}"\n'
        decls.append(f"typedef {value} {pname};" if kind == "type" else
                     f"__constant constexpr {kind} {pname} = {value};")
    # OpenCL kernel names are global (unmangled): the copy takes the host_name
    text = re.sub(r"\b" + re.escape(func) + r"(\s*\()", name + r"\1", t.text, count=1)
    return (f"namespace msl_check_{name} {{ {' '.join(decls)}\n#line {t.line} \"{t.file}\"\n"
            f"{' ' * t.col}{text}\n}}\n")


def translation_unit(metal: str, workdir: str) -> str:
    """Write the prepared copy of `metal` and of the local headers it includes into workdir; return its path."""
    metal = os.path.abspath(metal)
    shown = lambda p: os.path.relpath(p, ROOT) if p.startswith(ROOT + os.sep) else p  # noqa: E731
    templates: Dict[str, TemplateKernel] = {}
    instances: List[Tuple[str, str, int]] = []
    todo, seen = [metal], set()
    main_text = None
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        raw = open(p, "rb").read()
        bad = [i for i, b in enumerate(raw) if b >= 0x80]
        src = raw.decode("ascii", errors="replace")
        text, t, inst = prepare(src, shown(p))
        templates.update(t)
        instances += inst
        head = f'#line 1 "{shown(p)}"\n'
        if bad:
            line = raw.count(b"\n", 0, bad[0]) + 1
            head += (f'#line {line} "{shown(p)}"\n#error "non-ASCII byte in Metal source (MSL sources must be ASCII)"\n'
                     f'#line 1 "{shown(p)}"\n')
        for inc in INCLUDE.findall(src):  # next to the file, else in metal/ (the project's shared headers)
            found = [q for q in (os.path.join(os.path.dirname(p), inc), os.path.join(ROOT, "metal", inc))
                     if os.path.exists(q)]
            if found:
                todo.append(os.path.abspath(found[0]))
        text = head + text.replace("#pragma once", "#pragma once" if p != metal else "")
        if p == metal:
            main_text = text
        else:
            with open(os.path.join(workdir, os.path.basename(p)), "w") as f:
                f.write(text)
    main_text += "\n" + "".join(_clone(i, templates, shown(metal)) for i in instances)
    out = os.path.join(workdir, os.path.basename(metal))
    with open(out, "w") as f:
        f.write(main_text)
    return out


# ---------------------------------------------------------------------------------------------- AST lint
# With the generic address space on, an unqualified pointer or reference is `__generic` and takes any address
# space. Metal has no generic address space: an unqualified pointer is an error, and a member function's
# `this` is `thread` unless the function is qualified. In clang's AST dump both show up as:
#   - a declaration written with a `__generic` type (a pointer or reference without an address space),
#   - an implicit AddressSpaceConversion from __global / __local / __constant (device memory passed where an
#     unqualified pointer or `this` is expected), except into a constructor or an implicit (compiler-
#     declared) member such as the copy assignment, which Metal provides for every address space.
NODE = re.compile(r"^([| `-]*)(\w+) (0x[0-9a-f]+)?\s*(<[^>]*>)?(.*)$")
# every location in a dump line, in order: each one updates the dumper's "current file and line"
LOC = re.compile(r"(?:\bline:(\d+):(\d+)|\bcol:(\d+)|([^<>:,\s']+):(\d+):(\d+))")
SPACES = ("__global", "__local", "__constant")
MSL_NAME = {"__global": "device", "__local": "threadgroup", "__constant": "constant"}


def lint_ast(dump: str) -> List[str]:
    lines = dump.splitlines()
    implicit = set()
    for ln in lines:
        m = NODE.match(ln)
        if m and m.group(2).endswith("Decl") and m.group(3) and " implicit " in m.group(5) + " ":
            implicit.add(m.group(3))
    out, seen = [], set()
    cur = ["", 0, 0]
    stack = []  # (depth, kind, rest, callee address)
    skip_below = None
    for i, ln in enumerate(lines):
        m = NODE.match(ln)
        if not m:
            continue
        depth, kind, addr, rng, rest = len(m.group(1)), m.group(2), m.group(3), m.group(4) or "", m.group(5)
        for lm in LOC.finditer(rng + " " + rest.split("'")[0]):
            if lm.group(1):
                cur[1:] = [int(lm.group(1)), int(lm.group(2))]
            elif lm.group(3):
                cur[2] = int(lm.group(3))
            else:
                cur = [lm.group(4), int(lm.group(5)), int(lm.group(6))]
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if skip_below is not None and depth <= skip_below:
            skip_below = None
        if kind.endswith("Decl") and " implicit " in rest + " " and skip_below is None:
            skip_below = depth
        callee = None
        if kind in ("CXXOperatorCallExpr", "CXXMemberCallExpr"):
            for la in lines[i + 1:i + 6]:
                cm = re.search(r"CXXMethod (0x[0-9a-f]+)", la) or re.search(r"MemberExpr .* (0x[0-9a-f]+)$", la)
                if cm:
                    callee = cm.group(1)
                    break
        stack.append((depth, kind, rest, callee))
        in_project = cur[0] and not cur[0].startswith(SHIM) and not cur[0].startswith("<")
        where = f"{cur[0]}:{cur[1]}:{cur[2]}"
        msg = None
        if (kind in ("ParmVarDecl", "VarDecl", "FieldDecl") and skip_below is None and in_project
                and "__generic" in rest):
            name = re.search(r"(\w+) '", rest)
            msg = (f"'{name.group(1) if name else '?'}' is a pointer or reference without an address space "
                   f"(Metal needs device, threadgroup, constant or thread)")
        elif kind == "ImplicitCastExpr" and "<AddressSpaceConversion>" in rest and in_project:
            nxt = NODE.match(lines[i + 1]) if i + 1 < len(lines) else None
            src = re.findall(r"'([^']*)'", nxt.group(5)) if nxt else []
            space = next((sp for sp in SPACES if src and sp in src[0]), None)
            parent = stack[-2] if len(stack) > 1 else (0, "", "", None)
            method = re.search(r"(?:\.|->)(\w+) (0x[0-9a-f]+)$", parent[2]) if parent[1] == "MemberExpr" else None
            if parent[1] == "CXXConstructExpr":
                allowed = True  # copying or moving an object out of any address space
            elif method:
                allowed = method.group(2) in implicit
            elif parent[1] == "CXXOperatorCallExpr":
                allowed = parent[3] in implicit
            else:
                allowed = False
            if space and not allowed:
                msg = (f"member function '{method.group(1)}' called on {MSL_NAME[space]} memory (its `this` is "
                       f"`thread`; declare a `{MSL_NAME[space]}`-qualified overload)" if method else
                       f"{MSL_NAME[space]} memory passed where a pointer or reference without an address space "
                       f"is expected")
        if msg and (where, msg) not in seen:
            seen.add((where, msg))
            out.append(f"{where}: error: {msg}")
    return out


# OpenCL rules that are stricter than Metal's (which follows C++ for vectors): `ushort4 & 0x80` is an error in
# OpenCL (the int scalar outranks the element type), while Metal converts the scalar to the element type.
NOT_METAL_ERRORS = ("scalar operand type has greater rank than the type of the vector element",)
ERROR = re.compile(r"^(.*?:\d+:\d+: )?(fatal )?error: (.*)$", re.M)


def check(metal: str, clang: Optional[str] = None) -> Tuple[bool, str]:
    """(passed, diagnostics) for one .metal file: clang's, then the AST lint's."""
    clang = clang or clang_binary()
    if clang is None:
        raise FileNotFoundError("msl_check: clang is not installed (apt-get install clang)")
    with tempfile.TemporaryDirectory(prefix="msl_check_") as d:
        tu = translation_unit(metal, d)
        res = subprocess.run([clang] + CLANG_FLAGS + ["-I", SHIM, tu], capture_output=True, text=True)
    errors = [m.group(3) for m in ERROR.finditer(res.stderr) if "errors generated" not in m.group(3)]
    real = [e for e in errors if not any(e.startswith(n) for n in NOT_METAL_ERRORS)]
    lint = lint_ast(res.stdout) if not real else []
    text = res.stderr + "".join(line + "\n" for line in lint)
    if errors and not real:
        text += "msl_check: the errors above are OpenCL-only rules; Metal accepts this code\n"
    return not real and not lint, text


def uses_tensor_ops(path: str, seen: Optional[set] = None) -> bool:
    """MSL 4.0 files on Metal Performance Primitives (the M5 library), directly or through a local header: their
    tensor types have no OpenCL model here, so this check leaves them to the emulator's (msl_tensor.h) and to
    Apple's compiler on the macOS CI."""
    seen = set() if seen is None else seen
    seen.add(path)
    text = open(path, encoding="ascii").read()
    if "<MetalPerformancePrimitives/" in text:
        return True
    for name in INCLUDE.findall(text):
        inc = os.path.join(os.path.dirname(path), name)
        if inc not in seen and os.path.exists(inc) and uses_tensor_ops(inc, seen):
            return True
    return False


def checked_files() -> List[str]:
    return [f for f in sorted(glob.glob(os.path.join(ROOT, "metal", "*.metal"))) if not uses_tensor_ops(f)]


def main(argv: List[str]) -> int:
    files = argv or checked_files()
    failed = 0
    for f in files:
        ok, out = check(f)
        print(f"{'ok  ' if ok else 'FAIL'} {os.path.relpath(f)}")
        if out.strip():
            print(out.rstrip())
        failed += not ok
    print(f"msl_check: {len(files) - failed} of {len(files)} files pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
