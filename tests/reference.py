"""Independent float64 references for every op (no code shared with the kernels), and tolerances."""
import math

import numpy as np
import torch


def fp8_bits_to_f64(bits: torch.Tensor) -> torch.Tensor:
    """e4m3fn codes (uint8) -> float64 by the format's definition: NaN for 0x7F/0xFF."""
    b = bits.to(torch.int64)
    sign = torch.where((b & 0x80) != 0, -1.0, 1.0).double()
    e = (b >> 3) & 0xF
    m = (b & 7).double()
    normal = (1.0 + m / 8.0) * torch.pow(2.0, (e - 7).double())
    sub = m / 8.0 * 2.0 ** -6
    v = sign * torch.where(e == 0, sub, normal)
    return torch.where((b & 0x7F) == 0x7F, torch.full_like(v, math.nan), v)


def random_fp8_bits(shape, generator=None, allow_nan=False) -> torch.Tensor:
    b = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    if not allow_nan:
        b = torch.where((b & 0x7F) == 0x7F, torch.full_like(b, 0x3F), b)
    return b


def expand_scale(scale: torch.Tensor, N: int, K: int, block_size=None) -> torch.Tensor:
    """The [N, K] float64 multiplier of each weight element for a per-tensor / channel / block scale."""
    s = scale.double()
    if block_size is not None:
        bn, bk = block_size
        rows = torch.arange(N) // bn
        cols = torch.arange(K) // bk
        return s[rows][:, cols]
    if s.numel() == 1:
        return s.reshape(1, 1).expand(N, K)
    return s.reshape(N, 1).expand(N, K)


def fp8_weight_f64(bits, scale, block_size=None):
    N, K = bits.shape
    return fp8_bits_to_f64(bits) * expand_scale(scale, N, K, block_size)


def assert_dequantized_close(out, bits, scale, block_size=None):
    """fp8_dequantize's out vs the float64 product dec(bits) * scale: NaNs in the same places, and at most one ulp
    of out's dtype off (the product is formed in fp32 and rounded once), half a subnormal step below normals."""
    N, K = bits.shape
    dtype = out.dtype
    ref = (fp8_bits_to_f64(bits) * expand_scale(scale, N, K, block_size)).to(dtype)
    got = out.cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), "NaN pattern differs from the reference"
    fi = torch.finfo(dtype)
    torch.testing.assert_close(got, ref, rtol=2 * fi.eps, atol=fi.smallest_normal * fi.eps, equal_nan=True)


def ref_fp8_mm(x, bits, scale, bias=None, block_size=None):
    """Returns (ref, absref): the float64 product and |x| @ |w|^T, which bounds the accumulation error."""
    w = fp8_weight_f64(bits, scale, block_size)
    xd = x.double()
    ref = xd @ w.T
    absref = xd.abs() @ w.abs().T
    if bias is not None:
        ref = ref + bias.double()
        absref = absref + bias.double().abs()
    return ref, absref


def _grouped(x, offsets, expert_ids, width, product):
    """(ref, absref) [T, width] of each group's rows through product(rows, expert); rows of expert -1 and rows in
    no group are zero."""
    T = x.shape[0]
    G = offsets.numel() - 1
    ids = list(range(G)) if expert_ids is None else expert_ids.tolist()
    ref = torch.zeros(T, width, dtype=torch.float64)
    absref = torch.zeros(T, width, dtype=torch.float64)
    off = offsets.tolist()
    for g in range(G):
        e = ids[g]
        if e < 0 or off[g + 1] == off[g]:
            continue
        ref[off[g]:off[g + 1]], absref[off[g]:off[g + 1]] = product(x[off[g]:off[g + 1]], e)
    return ref, absref


def groups_as_on_mps(offsets, expert_ids, T, E):
    """The groups the Metal kernels compute for offsets and expert ids that nothing validated (on mps they stay on
    the GPU): offsets clamped to [0, T] and made non-decreasing (a running max), ids outside [0, E) as -1.
    Valid values come back unchanged. Returns (offsets, expert_ids) int32 for the references above."""
    G = offsets.numel() - 1
    ids = list(range(G)) if expert_ids is None else expert_ids.tolist()
    bounds, row = [], 0
    for o in offsets.tolist():
        row = max(row, min(max(o, 0), T))
        bounds.append(row)
    ids = [e if 0 <= e < E else -1 for e in ids]
    return torch.tensor(bounds, dtype=torch.int32), torch.tensor(ids, dtype=torch.int32)


def ref_fp8_grouped_mm(x, bits, scale, offsets, expert_ids=None, block_size=None):
    return _grouped(x, offsets, expert_ids, bits.shape[1],
                    lambda rows, e: ref_fp8_mm(rows, bits[e], scale[e], None, block_size))


def ref_int8_quantize(x):
    """scale = absmax / 127 (fp32); q = rint(x / scale) in fp32 arithmetic, clamped to [-127, 127]. A row holding
    NaN or +-inf gets scale NaN (the quiet NaN 0x7FC00000) and q = 0; its ratio is NaN."""
    xf = x.float().numpy()
    finite = np.isfinite(xf).all(axis=-1)
    with np.errstate(invalid="ignore", over="ignore"):
        finite_abs = np.abs(np.where(np.isfinite(xf), xf, np.float32(0)))
        amax = finite_abs.max(axis=-1) if xf.shape[-1] else np.zeros(xf.shape[:-1], np.float32)
        scale = np.where(finite, (amax / np.float32(127)).astype(np.float32), np.float32(np.nan)).astype(np.float32)
        quantized = finite & (scale > 0)
        safe = np.where(quantized, scale, np.float32(1))[..., None]
        ratio = np.where(finite[..., None], (xf / safe).astype(np.float32), np.float32(np.nan))
        q = np.clip(np.rint(np.where(quantized[..., None], ratio, 0)), -127, 127).astype(np.int8)
    return torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(ratio.astype(np.float32))


def ref_int8_mm(xq, x_scale, wq, w_scale, bias=None):
    acc = xq.to(torch.int64) @ wq.to(torch.int64).T  # exact
    out = acc.double() * x_scale.double().reshape(*xq.shape[:-1], 1) * w_scale.double().reshape(-1)
    if bias is not None:
        out = out + bias.double()
    return out, acc


_EPS = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def assert_matmul_close(out, ref, absref, dtype=None, acc_rtol=2e-6, atol=None):
    """out (any float dtype) vs float64 ref: one rounding to the output dtype (half an ulp, relative) plus fp32
    accumulation error bounded by acc_rtol * |x| @ |w| per element (+ atol, a tensor like ref, where a unit is
    documented to drop terms). NaNs must be in the same places; an output past the dtype's range is +-inf."""
    dtype = dtype or out.dtype
    o = out.double().cpu()
    nan_ref = torch.isnan(ref)
    assert torch.equal(torch.isnan(o), nan_ref), "NaN pattern differs from the reference"
    o, r, a = o[~nan_ref], ref[~nan_ref], absref[~nan_ref]
    fi = torch.finfo(dtype)
    # + half the subnormal step: outputs below the smallest normal are rounded with that absolute error
    tol = 1.01 * _EPS[dtype] * r.abs() + acc_rtol * a + 0.5 * fi.smallest_normal * fi.eps
    if atol is not None:
        tol = tol + atol[~nan_ref]
    err = (o - r).abs()
    bad = err > tol
    # the reference overflows the output dtype too (or is infinite itself): inf of the same sign
    bad &= ~(torch.isinf(o) & (torch.sign(o) == torch.sign(r)) & (r.abs() > fi.max))
    bad |= torch.isinf(r) & (o != r)  # an infinite tolerance would accept anything there
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} elements off; worst err {float(err.max()):.3g} "
                           f"tol there {float(tol[err.argmax()]):.3g}")


# ---------------------------------------------------------------------------------------------- quantization
def _e4m3_positive_values() -> np.ndarray:
    """float64 values of the codes 0x00..0x7E (every finite non-negative e4m3fn value), ascending."""
    return fp8_bits_to_f64(torch.arange(0x7F, dtype=torch.uint8)).numpy()


def f32_to_fp8_bits_ref(r: np.ndarray) -> np.ndarray:
    """float32 values within +-448 -> e4m3fn codes by round-to-nearest, ties to the even code (uint8 numpy)."""
    vals = _e4m3_positive_values()
    a = np.abs(r.astype(np.float64))
    assert np.all(a <= 448.0), "the reference encoder expects saturated values"
    hi = np.searchsorted(vals, a, side="left")  # first code whose value is >= a (a <= 448 = vals[-1])
    lo = np.maximum(hi - 1, 0)
    d_lo, d_hi = a - vals[lo], vals[hi] - a
    code = np.where(d_lo < d_hi, lo, hi)
    code = np.where(d_lo == d_hi, np.where(lo % 2 == 0, lo, hi), code)  # a tie goes to the even mantissa
    code = np.where(d_hi == 0, hi, code)
    return (code | np.where(np.signbit(r), 0x80, 0)).astype(np.uint8)


def ref_quantize_fp8(w: torch.Tensor, granularity: str, block_size=(128, 128)):
    """(codes uint8 [N, K], scale float32, scale expanded to [N, K] float64): scale = amax / 448 in float32,
    codes of clamp(w / scale, +-448) rounded to nearest even, in float32 arithmetic (numpy, not torch)."""
    w32 = w.float().numpy()
    N, K = w32.shape
    if granularity == "tensor":
        amax = np.array([np.abs(w32).max() if w32.size else 0.0], np.float32)
        scale = (amax / np.float32(448)).astype(np.float32)
        full = np.broadcast_to(scale.reshape(1, 1), (N, K))
    elif granularity == "channel":
        amax = np.abs(w32).max(axis=1) if K else np.zeros(N, np.float32)
        scale = (amax / np.float32(448)).astype(np.float32)
        full = np.broadcast_to(scale.reshape(N, 1), (N, K))
    else:
        bn, bk = block_size
        nb, kb = -(-N // bn), -(-K // bk)
        scale = np.zeros((nb, kb), np.float32)
        for i in range(nb):
            for j in range(kb):
                blk = w32[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
                scale[i, j] = np.float32(np.abs(blk).max() if blk.size else 0.0) / np.float32(448)
        full = scale[np.arange(N) // bn][:, np.arange(K) // bk] if N and K else np.zeros((N, K), np.float32)
    safe = np.where(full == 0, np.float32(1), full).astype(np.float32)
    ratio = np.clip((w32 / safe).astype(np.float32), -448, 448)
    codes = f32_to_fp8_bits_ref(ratio)
    return torch.from_numpy(codes), torch.from_numpy(scale), torch.from_numpy(np.ascontiguousarray(full, np.float64))


def ref_quantize_int8(w: torch.Tensor):
    """(q int8, scale float32 [N]) of symmetric per-row quantization: the per-row rule of int8_quantize."""
    q, scale, _ = ref_int8_quantize(w)
    return q, scale


# ---------------------------------------------------------------------------------------------- transposed products
def ref_matmul_t(g, w64):
    """(ref, absref) of g [M, N] @ w64 [N, K] in float64 (the transposed products of the backward passes)."""
    gd = g.double()
    return gd @ w64, gd.abs() @ w64.abs()


def ref_fp8_grouped_mm_t(g, bits, scale, offsets, expert_ids=None, block_size=None, weight_for=None):
    """weight_for(rows, w64): the weight a group's rows are multiplied by (conftest's Backend.transposed_weight)."""
    weight_for = weight_for or (lambda rows, w64: w64)
    return _grouped(g, offsets, expert_ids, bits.shape[2], lambda rows, e: ref_matmul_t(
        rows, weight_for(rows, fp8_weight_f64(bits[e], scale[e], block_size))))


# ---------------------------------------------------------------------------------------------- 4-bit weights
# Written from the formats' definitions (OCP microscaling spec, compressed-tensors, MLX), not from csrc/w4_formats.h.
E2M1_F64 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
W4_VALUES_F64 = {
    "nvfp4": torch.cat([E2M1_F64, -E2M1_F64]),
    "mxfp4": torch.cat([E2M1_F64, -E2M1_F64]),
    "int4": torch.arange(16, dtype=torch.float64) - 8,
    "uint4": torch.arange(16, dtype=torch.float64),
}


def w4_codes_f64(codes: torch.Tensor, K: int) -> torch.Tensor:
    """uint8 [..., ceil(K/2)] -> the 4-bit codes [..., K] (even k in the low nibble) as int64."""
    c = codes.to(torch.int64)
    both = torch.stack([c & 0xF, c >> 4], dim=-1).reshape(*codes.shape[:-1], 2 * codes.shape[-1])
    return both[..., :K]


def w4_scale_f64(format: str, scale: torch.Tensor) -> torch.Tensor:
    """Stored group scales as float64: e4m3 bits / float8_e4m3fn (nvfp4), e8m0 bits (mxfp4: 2^(b-127), 255 NaN),
    or float values."""
    if format == "mxfp4":
        b = scale.view(torch.uint8).to(torch.int64) if scale.dtype != torch.uint8 else scale.to(torch.int64)
        v = torch.pow(2.0, (b - 127).double())
        return torch.where(b == 255, torch.full_like(v, math.nan), v)
    if format == "nvfp4":
        return fp8_bits_to_f64(scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale)
    return scale.double()


def w4_weight_f64(format, codes, scale, group_size, K, offset=None, global_scale=None) -> torch.Tensor:
    """The [N, K] float64 weight of a 4-bit format: value[code] * scale (+ bias), or (value - zero point) * scale,
    times the global scale."""
    q = W4_VALUES_F64[format][w4_codes_f64(codes, K)]
    g = torch.arange(K) // group_size
    s = w4_scale_f64(format, scale)[..., g]
    if offset is not None and format == "int4":
        w = (q - offset.double()[..., g]) * s
    elif offset is not None and format == "uint4":
        w = q * s + offset.double()[..., g]
    else:
        w = q * s
    if global_scale is not None:
        w = w * global_scale.double().reshape(())
    return w


def ref_w4_mm(x, format, codes, scale, group_size, offset=None, global_scale=None, bias=None):
    """(ref, absref) of w4_mm in float64 (see ref_fp8_mm)."""
    w = w4_weight_f64(format, codes, scale, group_size, x.shape[-1], offset, global_scale)
    xd = x.double()
    ref, absref = xd @ w.T, xd.abs() @ w.abs().T
    if bias is not None:
        ref, absref = ref + bias.double(), absref + bias.double().abs()
    return ref, absref


def ref_w4_grouped_mm(x, format, codes, scale, group_size, offsets, expert_ids=None, offset=None, global_scale=None):
    """(ref, absref) of w4_grouped_mm in float64: each group's rows through its expert's ref_w4_mm."""
    def product(rows, e):
        return ref_w4_mm(rows, format, codes[e], scale[e], group_size, None if offset is None else offset[e],
                         None if global_scale is None else global_scale[e:e + 1])
    return _grouped(x, offsets, expert_ids, codes.shape[1], product)


def layer_weight_f64(layer) -> torch.Tensor:
    """The [N, K] float64 weight a torch_lowbit linear layer holds, from its stored tensors by the formats' own
    arithmetic (told apart by those tensors: packed 4-bit codes, int8 codes, else fp8 bits)."""
    if hasattr(layer, "weight_packed"):
        return w4_weight_f64(layer.format, layer.weight_packed, layer.weight_scale, layer.group_size,
                             layer.in_features, layer.weight_offset, layer.weight_scale_2)
    if layer.weight.dtype == torch.int8:
        return layer.weight.double() * layer.weight_scale.double().reshape(-1, 1)
    return fp8_weight_f64(layer.weight.view(torch.uint8), layer.weight_scale, layer.block_size)
