#!/usr/bin/env python3
"""msl_prep.py KERNEL.metal > OUT.cpp -- the only source rewriting the emulator needs (setup.py calls prep()).

1. kernel-scope `[alignas(A)] threadgroup T name[...];` variables -> storage `MSL_TG_VAR<T [...], A> msl_tg_name;`
   (static thread_local: shared by the fibers of one threadgroup), `auto& name = msl_tg_name.get();` (placed at
   the alignment the declaration promises, msl_runtime.h TgVar) and `MSL_TG_POISON(name);` (0xFF at threadgroup
   start). `threadgroup` as a pointer/reference qualifier is left alone (msl_shim.h defines it away).
2. `[[threadgroup(i)]]` -> `[[msl_threadgroup_binding(i)]]` (the keyword macro would eat it otherwise).
3. appends a registry entry for every non-template `kernel void NAME(` / `[[kernel]] void NAME(`.
4. explicit instantiations of template kernels, written one per statement as
     template [[host_name("NAME")]] [[kernel]] decltype(FUNC<ARGS>) FUNC<ARGS>;
   or through metal/instantiate.h's macros (expanded here first, as Apple's preprocessor expands them:
   expand_kernel_macros), are blanked (default arguments are illegal in explicit instantiations) and registered
   as NAME calling FUNC<ARGS>() instead. Instantiations produced by other macros are not seen.
5. a file that includes <MetalPerformancePrimitives/...> is MSL 4.0 with tensors (the M5 variant library):
   __METAL_VERSION__ 400 and __HAVE_TENSOR__ are defined before it, as Apple's compiler defines them.
Line numbers are preserved (a #line directive points diagnostics at the original file).
"""
import re
import sys


def mask_comments_strings(src):
    """Copy of src with comments and string/char literals blanked (newlines kept), so offsets line up."""
    out, i, n = list(src), 0, len(src)
    while i < n:
        c2 = src[i:i + 2]
        if c2 == "//":
            j = src.find("\n", i)
            j = n if j < 0 else j
        elif c2 == "/*":
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
        elif src[i] in "\"'":
            q, j = src[i], i + 1
            while j < n and src[j] != q:
                j += 2 if src[j] == "\\" else 1
            j += 1
        else:
            i += 1
            continue
        for k in range(i, min(j, n)):
            if out[k] != "\n":
                out[k] = " "
        i = j
    return "".join(out)


def split_top(s, sep=","):
    parts, depth, cur = [], 0, ""
    for ch in s:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == sep and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


TG_DECL = re.compile(r"(?:(?<=[;{}])|(?<=^))(\s*)(?:alignas\s*\(\s*(\d+)\s*\)\s*)?threadgroup\b([^;{}()=]*);", re.M)
INSTANCE = re.compile(r"template\s*\[\[\s*host_name\(\s*\"(\w+)\"\s*\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*"
                      r"decltype\(\s*([^;]*?)\s*\)\s*([^;]*?)\s*;")
KERNEL = re.compile(r"(?:\bkernel\b|\[\[\s*kernel\s*\]\])\s*void\s+(\w+)\s*\(")
# metal/instantiate.h: LOWBIT_KERNEL(BASE, FUNC, T, ARGS...) and LOWBIT_KERNEL_VARIANT(BASE, VARIANT, FUNC, T, ARGS...)
KERNEL_MACRO = re.compile(r"^[ \t]*(LOWBIT_KERNEL(?:_VARIANT)?)\s*\(", re.M)


def kernel_macro_instance(macro, args):
    """(host_name, FUNC<T, ARGS...>) of one metal/instantiate.h invocation with its arguments split"""
    variant = macro == "LOWBIT_KERNEL_VARIANT"
    head = 3 if variant else 2
    if len(args) < head + 1 or not all(re.fullmatch(r"\w+", a) for a in args[:head + 1]):
        raise ValueError(f"{macro}: want (BASE, {'VARIANT, ' if variant else ''}FUNC, T[, ARGS...]) with "
                         f"identifiers for all but ARGS, got ({', '.join(args)})")
    base, func, dtype = args[0], args[head - 1], args[head]
    name = f"{base}_{dtype}_{args[1]}" if variant else f"{base}_{dtype}"
    return name, f"{func}<{', '.join(args[head:])}>"


def expand_kernel_macros(src):
    """src with each metal/instantiate.h invocation written out as the explicit instantiation it expands to
    (template [[host_name("NAME")]] [[kernel]] decltype(F<A>) F<A>;), on its own lines (line numbers kept)."""
    masked = mask_comments_strings(src)
    out, pos = [], 0
    for m in KERNEL_MACRO.finditer(masked):
        if m.start() < pos:
            continue
        open_ = m.end() - 1
        depth, i = 0, open_
        while True:
            depth += {"(": 1, ")": -1}.get(masked[i], 0)
            if depth == 0:
                break
            i += 1
        args = [" ".join(a.split()) for a in split_top(src[open_ + 1:i])]
        name, expr = kernel_macro_instance(m.group(1), args)
        end = i + 1
        line = f'template [[host_name("{name}")]] [[kernel]] decltype({expr}) {expr};'
        out.append(src[pos:m.start()] + line + "\n" * src.count("\n", m.start(), end))
        pos = end
    return "".join(out) + src[pos:]


def prep(src, path):
    src = expand_kernel_macros(src)
    masked = mask_comments_strings(src)
    edits = []  # (start, end, replacement)
    for m in TG_DECL.finditer(masked):
        align, body = m.group(2) or "0", m.group(3)
        top = re.sub(r"\[[^\]]*\]", "", body)
        if "*" in top or "&" in top:
            continue  # a pointer/reference declaration: plain qualifier
        decls, base = [], None
        for d in split_top(body):
            d = d.strip()
            ident = re.match(r"^(.*?)(\w+)\s*(\[.*)?$", d, re.S) if d else None
            if ident:
                base = ident.group(1) if base is None else base  # `T a[4], b[8]`: the type comes first
                decls.append((ident.group(2), ident.group(3) or ""))
        if not decls or not base.strip():
            continue
        text = " ".join(f"MSL_TG_VAR<{base.strip()} {dims}, {align}> msl_tg_{nm}; auto& {nm} = msl_tg_{nm}.get(); "
                        f"MSL_TG_POISON({nm});" for nm, dims in decls)
        start = m.start(0) + len(m.group(1))
        # one line for the whole declaration, then its own newlines: line numbers stay the source's
        edits.append((start, m.end(0), " ".join(text.split("\n")) + "\n" * masked.count("\n", start, m.end(0))))
    for m in re.finditer(r"\[\[\s*threadgroup\s*\(", masked):
        edits.append((m.start(0), m.end(0), "[[msl_threadgroup_binding("))
    instances = []
    # host_name strings are blanked in `masked`: match on the source, then check the match is live code
    for m in INSTANCE.finditer(src):
        if not masked[m.start():m.start() + 8] == "template":
            continue
        instances.append((m.group(1), m.group(3)))
        edits.append((m.start(0), m.end(0), "".join(ch if ch == "\n" else " " for ch in m.group(0))))
    kernels = []
    for m in KERNEL.finditer(masked):
        before = masked[max(0, m.start() - 200):m.start()]
        if re.search(r"template\s*<[^;{}]*>\s*(\[\[[^\]]*\]\]\s*)*$", before):
            if not any(f.startswith(m.group(1) + "<") for _, f in instances):
                print(f"msl_prep: {path}: template kernel {m.group(1)} has no instantiation", file=sys.stderr)
            continue
        kernels.append(m.group(1))
    out = src
    for s, e, r in sorted(edits, key=lambda x: x[0], reverse=True):
        out = out[:s] + r + out[e:]
    head = f'#line 1 "{path}"\n'
    if re.search(r"^\s*#\s*include\s*<MetalPerformancePrimitives/", masked, re.M):
        head = "#define __METAL_VERSION__ 400\n#define __HAVE_TENSOR__ 1\n" + head
    tail = "\n#include \"msl_undef.h\"\n" + "".join(
        f"static ::msl::rt::Registrar msl_reg_{k}(\"{k}\", +[] {{ {k}(); }});\n" for k in kernels) + "".join(
        f"static ::msl::rt::Registrar msl_reg_{n}(\"{n}\", +[] {{ {f}(); }});\n" for n, f in instances)
    return head + out + tail


if __name__ == "__main__":
    p = sys.argv[1]
    sys.stdout.write(prep(open(p, encoding="ascii").read(), p))
