// Parameter structs passed by value (`constant P& p [[buffer(i)]]`), shared by the .metal kernels and the
// host plans (csrc/metal/plan_*.cpp), so both sides agree on the layout. 32-bit fields only.
#pragma once
#ifdef __METAL_VERSION__
#include <metal_stdlib>
#define LOWBIT_PARAMS_NAMESPACE_BEGIN
#define LOWBIT_PARAMS_NAMESPACE_END
#define LOWBIT_CONSTANT constant constexpr
#else
#include <cstdint>
#define LOWBIT_PARAMS_NAMESPACE_BEGIN namespace lowbit::metal { using uint = uint32_t;
#define LOWBIT_PARAMS_NAMESPACE_END }
#define LOWBIT_CONSTANT inline constexpr
#endif

LOWBIT_PARAMS_NAMESPACE_BEGIN

// How an fp8 weight's fp32 scale applies (lowbit::ScaleKind): 0 per tensor (scale[0]), 1 per output
// channel (scale[n]), 2 per [bn, bk] block (scale[(n / bn) * kb + k / bk]).
struct ScaleParams {
  uint kind;
  uint bn, bk;     // block size (kind 2)
  uint kb;         // blocks along K = ceil(K / bk) (kind 2)
  uint bk_shift;   // log2(bk) when bk is a power of two (k / bk == k >> bk_shift), else kScaleBkNoShift
};
LOWBIT_CONSTANT uint kScaleBkNoShift = 0xFFFFFFFFu;

struct Fp8DequantizeParams {
  uint N, K;
  uint vec4;  // K % 4 == 0 and the weight starts 4-byte aligned: 4-byte weight loads, 4-element stores
  ScaleParams scale;
};

// ---- fp8 ----
// Kernel geometry: the .metal instantiations and the plans' grids both use these.
// Decode GEMVs give each threadgroup 4 weight rows: N = 1024 is then 256 threadgroups, >= 4 per core of a
// 40-core GPU (MLX qmv / llama.cpp mul_mv give 8 per threadgroup; with fewer rows small N still fills the GPU).
LOWBIT_CONSTANT uint kFp8GemvSimdgroups = 2;      // simdgroups per threadgroup: M == 1 GEMV, grouped decode
LOWBIT_CONSTANT uint kFp8GemvColsM1 = 2;          // M == 1 GEMV: output columns (weight rows) per simdgroup
LOWBIT_CONSTANT uint kFp8GemvColsRows = 2;        // multi-row GEMVs: output columns per simdgroup
LOWBIT_CONSTANT uint kFp8GemvRows = 8;            // multi-row GEMVs: activation rows per pass
// The multi-row GEMV stages each K step of its activation rows once per threadgroup, so its x traffic per
// weight byte is kFp8GemvRows * sizeof(T) / (weight rows per threadgroup): 16 rows make it 1 for bf16 / fp16.
LOWBIT_CONSTANT uint kFp8GemvRowsSimdgroups = 8;
LOWBIT_CONSTANT uint kFp8GemmTile = 32;           // tiled GEMM: BM = BN = BK
LOWBIT_CONSTANT uint kFp8GemmThreads = 128;       // tiled GEMM: 4 simdgroups, 2 x 2 over the output tile
// M5 (metal/fp8_gemm_mpp.h): matmul2d on 4 simdgroups, a kFp8MppBM x kFp8MppBN tile (MLX's quantized NAX GEMM
// tile), K advancing kFp8MppBK per run; the grouped kernel keeps the portable tile table's kFp8GemmTile rows
LOWBIT_CONSTANT uint kFp8MppBM = 64;
LOWBIT_CONSTANT uint kFp8MppBN = 64;
LOWBIT_CONSTANT uint kFp8MppBK = 64;
LOWBIT_CONSTANT uint kFp8MppThreads = 128;

// The dtype of a buffer the kernel reads in its own type (a bias): bias_dtype fields
enum LowbitDtype : uint {
  kDtypeFloat = 0u,
  kDtypeHalf = 1u,
  kDtypeBfloat = 2u,
};

// Fp8MmParams::flags / Fp8GroupedMmParams::flags
LOWBIT_CONSTANT uint kFp8VecLoadBytes = 16;  // the widest load of the fp8 kernels' vector paths (uint4)
enum Fp8Flags : uint {
  // K % 16 == 0 and x and the weight start 16-byte aligned: every row starts aligned, so kernels may use
  // uint4 / vec<T, 4> loads; otherwise they use byte-aligned packed or scalar loads.
  kFp8VecLoads = 1u,
  kFp8HasBias = 2u,  // fp8_mm only: bias [N] (of dtype bias_dtype) is bound and added
};

// fp8_mm: out[M, N] = x[M, K] @ (dec(w[N, K]) * scale)^T + bias
struct Fp8MmParams {
  uint M, N, K;
  uint flags;
  uint bias_dtype;  // LowbitDtype
  ScaleParams scale;
};

// fp8_grouped_mm: x[T, K], w[E, N, K], offsets[G + 1], expert_ids[G] -> out[T, N]
struct Fp8GroupedMmParams {
  uint T, N, K, E, G;
  uint flags;
  uint scale_stride;  // floats of scale per expert: 1 (tensor), N (channel) or nb * kb (block)
  ScaleParams scale;
};

// ---- transposed products (fp8_mm_t, fp8_grouped_mm_t, int8_weight_mm_t): out[M, K] = g[M, N] @ W[N, K] ----
// The GEMM variant reuses the fp8 GEMM's geometry (kFp8GemmTile, kFp8GemmThreads), so fp8_grouped_tiles'
// 32-row tile table serves fp8_grouped_mm_t's prefill as well.
LOWBIT_CONSTANT uint kMmTGemvSimdgroups = 8;  // GEMV: simdgroups per threadgroup, each walking every 8th row of W
LOWBIT_CONSTANT uint kMmTGemvLaneCols = 4;    // GEMV: output columns per lane (one 4-byte weight load per row)
LOWBIT_CONSTANT uint kMmTGemvCols = 32 * kMmTGemvLaneCols;  // GEMV: output columns per threadgroup
LOWBIT_CONSTANT uint kMmTGemvRows = 8;        // small-M GEMV: rows of g per pass
LOWBIT_CONSTANT uint kMmTWeightVecBytes = 4;  // the weight loads' width (uint: 4 codes)
LOWBIT_CONSTANT uint kMmTGradVecBytes = 16;   // the GEMM's widest g load (vec<float, 4>)
// MmTParams::flags / Fp8GroupedMmParams::flags of fp8_grouped_mm_t
enum MmTFlags : uint {
  kMmTWeightVec = 1u,  // K % 4 == 0 and W starts 4-byte aligned: 4-byte weight loads
  kMmTGradVec = 2u,    // N * sizeof(T) % 16 == 0 and g starts 16-byte aligned: vector loads of g's rows
};

// fp8_mm_t / int8_weight_mm_t: g[M, N], W[N, K] (fp8 or int8 codes) -> out[M, K]
struct MmTParams {
  uint M, N, K;
  uint flags;
  ScaleParams scale;  // int8: kind 0 (w_scale[0]) or 1 (w_scale[n])
};

// ---- int8 ----
// int8_gemv: kInt8GemvSimdgroups x kInt8GemvRows weight rows and kInt8GemvXRows x rows per threadgroup (the same
// 4 weight rows per threadgroup as the fp8 decode GEMV, for the same reason); K advances kInt8GemvStepK bytes
// per step (32 lanes x 16).
LOWBIT_CONSTANT uint kInt8GemvSimdgroups = 2;
LOWBIT_CONSTANT uint kInt8GemvRows = 2;
LOWBIT_CONSTANT uint kInt8GemvXRows = 4;
LOWBIT_CONSTANT uint kInt8GemvStepK = 512;
// int8_gemm: a kInt8GemmBM (x rows) x kInt8GemmBN (weight rows) output tile per threadgroup of
// kInt8GemmThreads, K advancing kInt8GemmBK per step.
LOWBIT_CONSTANT uint kInt8GemmBM = 32;
LOWBIT_CONSTANT uint kInt8GemmBN = 64;
LOWBIT_CONSTANT uint kInt8GemmBK = 32;
LOWBIT_CONSTANT uint kInt8GemmThreads = 128;
// int8_gemm_mpp (M5, metal/int8_gemm_apple10.metal): a kInt8MppBM x kInt8MppBN tile per threadgroup of 4
// simdgroups on Metal 4's matmul2d, K advancing kInt8MppBK per run (the seed's 64 x 64 tile of 4 simdgroups)
LOWBIT_CONSTANT uint kInt8MppBM = 64;
LOWBIT_CONSTANT uint kInt8MppBN = 64;
LOWBIT_CONSTANT uint kInt8MppBK = 64;
LOWBIT_CONSTANT uint kInt8MppThreads = 128;

struct Int8QuantizeParams {
  uint M, K;
};

struct Int8MmParams {
  uint M, N, K;
  uint w_per_channel;  // 1: w_scale[n]; 0: w_scale[0] for every column
  uint has_bias;       // 0: the bias buffer is a placeholder and is never read
  uint bias_dtype;     // LowbitDtype
};

// ---- 4-bit weights (w4_mm, w4_dequantize, w4_mm_t; csrc/w4_formats.h) ----
// w4_gemv: kW4GemvSimdgroups simdgroups of kW4GemvCols output columns each, 4 weight rows per threadgroup (N =
// 1024 is 256 threadgroups, >= 4 per core of a 40-core GPU, as the fp8 decode GEMV); w4_gemv_rows runs
// kW4GemvRows activation rows per pass. Each lane reads kW4GemvLaneBytes code bytes (32 codes) of a row per step.
LOWBIT_CONSTANT uint kW4GemvSimdgroups = 2;
LOWBIT_CONSTANT uint kW4GemvCols = 2;
LOWBIT_CONSTANT uint kW4GemvRows = 8;
LOWBIT_CONSTANT uint kW4GemvLaneBytes = 16;
// w4_gemm and w4_mm_t_gemm: a 32 x 32 output tile, 4 simdgroups of 2 x 2 8x8 accumulators (the fp8 GEMM's geometry)
LOWBIT_CONSTANT uint kW4GemmTile = 32;
LOWBIT_CONSTANT uint kW4GemmThreads = 128;
// w4_dequantize: one thread per 8 codes of a row, threadgroups of kW4DequantizeThreadsX x kW4DequantizeThreadsY
LOWBIT_CONSTANT uint kW4DequantizeThreadsX = 64;
LOWBIT_CONSTANT uint kW4DequantizeThreadsY = 4;
LOWBIT_CONSTANT uint kW4NoShift = 0xFFFFFFFFu;

// W4Params::flags
LOWBIT_CONSTANT uint kW4CodesVecBytes = 16;  // the GEMV's code loads (uint4)
LOWBIT_CONSTANT uint kW4CodesWordBytes = 4;  // the GEMM's and the dequantize's code loads (uint)
LOWBIT_CONSTANT uint kW4XVecBytes = 16;      // activation loads (vec<T, 4> / float4)
enum W4Flags : uint {
  kW4CodesVec = 1u,         // rows of codes (ceil(K/2) bytes) start 16-byte aligned: uint4 code loads
  kW4CodesWord = 2u,        // rows of codes start 4-byte aligned: uint code loads
  kW4XVec = 4u,             // rows of x / grad_out start 16-byte aligned: vector loads
  kW4HasBias = 8u,          // w4_mm: bias [N] (of dtype bias_dtype) is bound and added
  kW4HasGlobalScale = 16u,  // global_scale (fp32 [1]) is bound and multiplies the product
  kW4MppScaled = 32u,       // w4_gemm_mpp: every value times every scale is exact in the activations' dtype
};

// One 4-bit weight [N, K] and the product's sizes. The format reaches the kernels only as its value table and
// the kernel variant of its scale encoding and offset kind (metal/w4.h): no kernel names a format.
struct W4Params {
  uint M, N, K;       // M: rows of x (w4_mm) or grad_out (w4_mm_t); 0 for w4_dequantize
  uint G;             // groups per row, ceil(K / group)
  uint group;         // group size, at most K (a group spanning K is per channel)
  uint group_shift;   // log2(group) when a power of two, else kW4NoShift
  uint flags;         // W4Flags
  uint bias_dtype;    // LowbitDtype (w4_mm with kW4HasBias)
  float values[16];   // the value of each 4-bit code
};

// A grouped 4-bit product (w4_grouped_mm, w4_grouped_mm_t): each expert's weight as W4Params describes one
// (w.M = T), the experts one after another in codes / scale / offset; the groups of rows as Fp8GroupedMmParams'
// (metal/fp8_grouped.h reads T, E and G).
struct W4GroupedParams {
  W4Params w;
  uint T;  // rows of x (grad_out)
  uint E;  // experts
  uint G;  // groups of rows (not w.G, the weight's groups per row)
};

LOWBIT_PARAMS_NAMESPACE_END
