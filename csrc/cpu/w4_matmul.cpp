#include "cpu/w4_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/arch/kernel_set.h"
#include "cpu/brgemm.h"
#include "cpu/chunk_pack.h"
#include "cpu/fp8_matmul.h"
#include "cpu/fp8_simd.h"
#include "cpu/parallel.h"
#include "cpu/transposed_matmul.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {

W4Operand w4_operand(const W4Weight& w, int64_t e, const float* bias) {
  W4Operand op;
  const int64_t per = w.N * w.G;
  const int64_t scale_bytes = w.scale.element_size();
  op.codes = w.codes.data_ptr<uint8_t>() + e * w.N * w.row_bytes();
  op.scale = static_cast<const uint8_t*>(w.scale.data_ptr()) + e * per * scale_bytes;
  op.scale_enc = w.scale_enc;
  op.offset_kind = w.offset_kind();
  if (w.offset.defined())
    op.offset = static_cast<const uint8_t*>(w.offset.data_ptr()) + e * per * w.offset.element_size();
  op.values = w.format->values;
  op.N = w.N;
  op.K = w.K;
  op.group = w.group;
  op.G = w.G;
  if (w.global_scale.defined()) op.global = w.global_scale.cpu().data_ptr<float>()[e];
  op.bias = bias;
  return op;
}

namespace {

// The GEMM's blocking: weight rows per panel (one task) and K positions per decoded window (64 x 1024 fp32:
// 256 KB, in L2 beside the window of activations).
constexpr int64_t kPanelRows = 64;
constexpr int64_t kWindow = 1024;
// Digit-plane steps per task of the activation pack (about 1 us of work): shorter rows are packed on one thread.
constexpr int64_t kPlaneStepsGrain = 16;

// The global scale and the output bias, after the K reduction.
inline float finish(const W4Operand& op, int64_t n, float sum) {
  const float v = sum * op.global;
  return op.bias ? v + op.bias[n] : v;
}

// The packed orders as chunk tables (chunk_pack.h): position p of a chunk / bf16 step holds code kOrder[p].
template <int64_t kC, int64_t (*kPos)(int64_t)>
constexpr std::array<uint8_t, kC> packed_order() {
  std::array<uint8_t, kC> o{};
  for (int64_t k = 0; k < kC; k++) o[size_t(kPos(k))] = uint8_t(k);
  return o;
}
constexpr auto kW4ChunkOrder = packed_order<kW4Chunk, w4_packed_pos>();
constexpr auto kW4Bf16StepOrder = packed_order<kW4Bf16Step, w4_bf16_pos>();

// x [M, K] -> [M][w4_padded(K)] fp32 in the packed order, zero padded.
template <typename T>
void pack(const T* x, int64_t M, int64_t K, float* dst) {
  const int64_t Kp = w4_padded(K);
  at::parallel_for(0, M, rows_grain(K, 1 << 14), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++) pack_chunks<kW4ChunkOrder>(x + m * K, K, Kp, dst + m * Kp);
  });
}

// Panels of kPanelRows weight rows, each decoded window by window into fp32 (exact) and multiplied with the
// packed activations in torch's fp32 GEMM (single-threaded inside the task): sums [rows][M] per panel.
template <typename T>
void panel_gemm(const W4Kernels& kern, const float* xp, int64_t M, const W4Operand& op, T* out, int64_t ldo) {
  const int64_t Kp = w4_padded(op.K), panels = ceil_div(op.N, kPanelRows);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  parallel_chunks(panels, 1, [&](int64_t b, int64_t) {
    const int64_t r0 = b * kPanelRows, nr = std::min(kPanelRows, op.N - r0);
    float* panel = scratch<float>(Slot::Panel, size_t(kPanelRows * kWindow));
    float* sums = scratch<float>(Slot::Accum, size_t(kPanelRows * M));
    at::Tensor C = at::from_blob(sums, {nr, M}, f32);
    for (int64_t k0 = 0; k0 < Kp; k0 += kWindow) {
      const int64_t w = std::min(kWindow, Kp - k0);
      kern.decode_rows(op, r0, nr, k0, w, panel, w);
      const at::Tensor a = at::from_blob(panel, {nr, w}, f32);
      const at::Tensor xt = at::from_blob(const_cast<float*>(xp) + k0, {M, w}, {Kp, 1}, f32).t();
      if (k0 == 0) at::mm_out(C, a, xt);
      else C.addmm_(a, xt);
    }
    for (int64_t m = 0; m < M; m++)
      for (int64_t r = 0; r < nr; r++) out[m * ldo + r0 + r] = T(finish(op, r0 + r, sums[r * M + m]));
  });
  release_scratch_above_cap(Slot::Panel);
  release_scratch_above_cap(Slot::Accum);
}

// ---- the GEMM regime and the transposed product on bf16 panels (AMX, or the kernel set's bf16 GEMM) ----
//
// Numerics. A decoded weight is exact in one bf16 word when its code value and its scale together have at most
// 8 significant bits and there is no offset: e2m1 values (2 bits) times e4m3 (4) or e8m0 (1) scales -- nvfp4,
// mxfp4 -- are, up to bf16's subnormals, which AMX reads as zero (weights below 2^-126: e8m0 scale bytes below 2;
// as for fp8). Those run the forward product on one term, the sums as exact as the fp32 path's. Others (int4 /
// uint4 with 16- or 32-bit scales, zero points or biases, a table such as NF4's) take two terms, hi + lo
// (w4_kernels.h: |w - hi - lo| <= 2^-16 |w|), each multiplied with x's first bf16 term, and hi with x's others:
// per product at most about 2^-15 relative off, 16x below the rounding of a half output and 128x below a bf16
// one. Float x keeps the fp32 path for them (2^-15 would show in an fp32 output). On the kernel set's bf16 GEMM
// the integer formats instead run one exact term with the group scales (and biases) applied to each group's sums
// as they leave its registers (w4_grouped_exact), and on AMX the same in the kernel set's tile kernel where it has
// one (brgemm calls of group_size codes, each group's sums scaled in memory, cost more than the second term).
// w4_mm_t: for bf16 grad_out the product is grad_out times the bf16-dequantized weight (global * w in fp32, rounded
// once to bf16: w4_dequantize(dtype=bfloat16)'s bits) in torch's bf16 GEMM, as the bf16 layer on that weight
// computes (fp8_mm_t does the same); exact for the formats above where the global scale is a power of two.

// Significant bits of a finite value (0 for zero; many for inf / NaN).
int significant_bits(float v) {
  if (v == 0.f) return 0;
  if (!std::isfinite(v)) return 64;
  int e;
  double m = std::fabs(std::frexp(double(v), &e));
  int bits = 0;
  while (m != 0.0) {
    m = m * 2.0 - std::floor(m * 2.0);
    bits++;
  }
  return bits;
}

// Whether every decoded weight of op is exact in one bf16 word (see above).
bool w4_exact_in_bf16(const W4Operand& op) {
  if (op.offset) return false;
  int value_bits = 0;
  for (int c = 0; c < 16; c++) value_bits = std::max(value_bits, significant_bits(op.values[c]));
  int scale_bits = 24;
  switch (op.scale_enc) {
    case W4Scale::F16: scale_bits = 11; break;
    case W4Scale::BF16: scale_bits = 8; break;
    case W4Scale::E4M3: scale_bits = 4; break;
    case W4Scale::E8M0: scale_bits = 1; break;
    default: break;
  }
  return value_bits + scale_bits <= 8;
}

static_assert(kW4Bf16Chunk == kBf16Chunk, "w4 bf16 panels are chunked as the bf16 GEMM packs x");
constexpr std::array<uint8_t, kBf16Chunk> make_natural_order() {
  std::array<uint8_t, kBf16Chunk> o{};
  for (int p = 0; p < kBf16Chunk; p++) o[p] = uint8_t(p);
  return o;
}
constexpr std::array<uint8_t, kBf16Chunk> kNaturalOrder = make_natural_order();

// Whether the weight runs as one exact bf16 term per code with its group scales on the groups' partial sums (the
// panel GEMM's block scales), where w4_exact_in_bf16 does not hold: every value minus its zero point is exact in
// bf16 (integers below 256: int4 / uint4 codes less int8 zero points), and groups of whole chunks of the panel GEMM
// (smaller groups would pad each one to a chunk). Biases (MLX's w = q * scale + bias) add bias * the group's sum
// of x (block offsets). Half the products of two terms, and exact ones: the sums are the GEMV's (w4_kernels.h:
// each group's sum scaled once; the bias, too, multiplies a sum). On AMX only with the set's tile kernel (above).
bool w4_grouped_exact(const W4Operand& op) {
  if (op.G <= 1 || op.group % kBf16Chunk != 0 || (amx_gemm_available() && amx_segment_gemm() == nullptr)) return false;
  for (int c = 0; c < 16; c++) {
    const float v = op.values[c];
    if (v != std::nearbyint(v) || std::fabs(v) > 127.f) return false;  // minus an int8 zero point: below 256
  }
  return true;
}

// count group scales (or biases) stored in enc, as fp32, into out: a copy the grouped panels make per call, in
// parallel (one thread's scalar loop took milliseconds of a 14336 x 4096 product at group size 64). bf16, the
// scales and biases of torch's and MLX's writers, is a shift the compiler vectorizes (the general decode's
// per-value switch was 7% of uint4 g64's product at M = 64 on one core).
void group_values_to_float(W4Scale enc, const void* stored, int64_t count, float* out) {
  at::parallel_for(0, count, 1 << 15, [&](int64_t a, int64_t b) {
    if (enc == W4Scale::BF16) {  // locals: stores through the captured `out` would make it reload every value
      const auto* words = static_cast<const uint16_t*>(stored);
      float* dst = out;
      for (int64_t i = a; i < b; i++) {
        const uint32_t bits = uint32_t(words[i]) << 16;
        std::memcpy(dst + i, &bits, 4);
      }
      return;
    }
    for (int64_t i = a; i < b; i++) out[i] = w4_scale_to_float(enc, stored, i);
  });
}

// A 4-bit weight as the bf16 panel GEMM reads it (fp8_matmul.h): the set's bf16 decode, natural order; the
// global scale and the bias after the K reduction. Grouped (w4_grouped_exact): the decode sees unit scales --
// values less zero points -- and the group scales, in fp32, multiply each group's sums. Without zero points every
// group's decode table is the values themselves, so the decode sees one unit-scale group a row (a table per row
// and window instead of one per group: a third of uint4 g64's decode). Those per-call copies (8 bytes a group
// with biases: 7 MB at 14336 x 4096, group 64) live in the calling thread's Operand scratch, reused from call to
// call: as fresh allocations their page faults were a seventh of uint4's M = 64 product.
struct W4PanelWeight final : PanelWeight {
  W4Operand op;  // global = 1 for the decode: the global scale multiplies the sums
  const W4Kernels& kern;
  float global;
  int64_t groups = 0;                   // grouped: the weight's groups a row
  const float* group_scales = nullptr;  // grouped: [N][groups] fp32
  const float* group_biases = nullptr;  // grouped, with biases: [N][groups] fp32 (the decode sees none)
  W4PanelWeight(const W4Operand& o, const W4Kernels& k, int term_count, bool grouped = false) : op(o), kern(k) {
    op.global = 1.f;
    global = o.global;
    N = op.N;
    K = op.K;
    terms = term_count;
    order = kNaturalOrder.data();
    has_add = op.bias != nullptr;
    if (grouped) {
      block = true;
      block_k = op.group;
      groups = op.G;
      const int64_t count = op.N * op.G;
      const bool biases = o.offset_kind == W4Offset::Bias && o.offset != nullptr;
      const bool zero_points = o.offset_kind == W4Offset::ZeroPoint && o.offset != nullptr;
      const int64_t floats = ceil_div(count, 16) * 16;  // each array on its own cache lines
      const int64_t units = zero_points ? count : op.N;  // the decode's unit scales: per group or per row
      const int64_t float_bytes = floats * 4 * (biases ? 2 : 1);
      auto* buf = scratch<uint8_t>(Slot::Operand, size_t(float_bytes + units));
      float* scales = reinterpret_cast<float*>(buf);
      group_values_to_float(o.scale_enc, o.scale, count, scales);
      group_scales = scales;
      if (biases) {
        float* b = scales + floats;
        group_values_to_float(o.scale_enc, o.offset, count, b);
        group_biases = b;
        op.offset = nullptr;
        op.offset_kind = W4Offset::None;
      }
      uint8_t* unit = buf + float_bytes;  // E8M0 1s
      std::memset(unit, 127, size_t(units));
      op.scale = unit;
      op.scale_enc = W4Scale::E8M0;
      if (!zero_points) {  // the row as one group, as a per-channel operand holds it
        op.G = 1;
        op.group = std::max<int64_t>(op.K, 1);
      }
    }
  }
  const float* block_scale_row(int64_t n) const override { return group_scales + n * groups; }
  const float* block_offsets() const override { return group_biases; }
  void decode(int64_t r0, int64_t nr, int64_t k0, int64_t n, uint16_t* dst, int64_t ld,
              int64_t term_stride) const override {
    kern.decode_rows_bf16(op, r0, nr, k0, n, terms, dst, ld, term_stride);
  }
  void columns(int64_t n0, int64_t nr, float* mul, float* add) const override {
    for (int64_t i = 0; i < nr; i++) {
      mul[i] = global;
      add[i] = op.bias ? op.bias[n0 + i] : 0.f;
    }
  }
};

// The bf16 panels run now: the set decodes to bf16, and the CPU runs torch's brgemm on AMX or the set's bf16 GEMM.
bool w4_bf16_panels(const W4Kernels& kern) {
  return kern.decode_rows_bf16 != nullptr && bf16_panel_gemm_available();
}

// How w4_mm's GEMM regime multiplies op for x of type T (see the numerics above).
enum class W4GemmRoute { Bf16OneTerm, Bf16Grouped, Bf16TwoTerms, Fp32 };
template <typename T>
W4GemmRoute w4_gemm_route(const W4Kernels& kern, const W4Operand& op) {
  if (!w4_bf16_panels(kern)) return W4GemmRoute::Fp32;
  if (w4_exact_in_bf16(op)) return W4GemmRoute::Bf16OneTerm;
  if (w4_grouped_exact(op)) return W4GemmRoute::Bf16Grouped;
  return std::is_same_v<T, float> ? W4GemmRoute::Fp32 : W4GemmRoute::Bf16TwoTerms;
}

// The bf16 panel GEMM where the route has it; false for the fp32 panels.
template <typename T>
bool bf16_gemm(W4GemmRoute route, const W4Kernels& kern, const T* x, int64_t M, const W4Operand& op, T* out,
               int64_t ldo) {
  if (route == W4GemmRoute::Fp32) return false;
  bf16_panel_gemm(x, M, W4PanelWeight(op, kern, route == W4GemmRoute::Bf16TwoTerms ? 2 : 1,
                                      route == W4GemmRoute::Bf16Grouped),
                  out, ldo);
  release_scratch_above_cap(Slot::Operand);
  return true;
}

// From this many rows w4_mm runs its GEMM regime: the GEMV tiles decode the weight again for every 4 rows, the
// GEMM once per M block but into panels, at a cost that AMX hides. On AMX (K = 4096, N = 14336, 2 cores) one term
// at 8 rows took the time of the GEMV's 4 (int4 g128 4.2 against 4.4 ms, 6.3 at 5 rows; uint4 g64 with biases
// 7.3 against 4.8, 7.1 at 5 and 10.4 at 6; nvfp4 5.7 against 6.5, 7.4 at 5). Elsewhere, measured at K = 4096,
// N = 14336 on 2 cores (bf16 x; GEMV and GEMM equal at): Zen 5, one-term bf16 panels and grouped ones 20 rows
// (mxfp4, int4 g128, nvfp4 20-24), two-term 64, fp32 panels 16-32 (mxfp4, int4); Zen 4, whose vdpbf16ps is half
// as wide, grouped ones later (int4 g128 24-32 rows; uint4 g64 with biases, its GEMV on bf16 tiles, about
// 32): the threshold keeps Zen 5's.
int64_t w4_gemm_min_rows(W4GemmRoute route) {
  if (route != W4GemmRoute::Fp32 && amx_gemm_available())
    return route == W4GemmRoute::Bf16TwoTerms ? kW4GemmMinRows : kW4AmxOneTermMinRows;
  return route == W4GemmRoute::Bf16TwoTerms ? 64 : route == W4GemmRoute::Fp32 ? 24 : 20;
}

// w4_mm_t's GEMM regime for bf16 g where transposed_panels_bf16: column panels (all N rows, kc codes) decoded to bf16 by all threads,
// then multiplied with g in one torch bf16 GEMM straight into out (transposed_matmul.cpp's scheme and sizes).
template <typename T>
bool bf16_gemm_t(const W4Kernels& kern, const T* g, int64_t M, const W4Operand& op, T* out, int64_t ldo) {
  if constexpr (!std::is_same_v<T, c10::BFloat16>) {
    return false;
  } else {
    if (M < kW4GemmMinRows || kern.decode_rows_bf16 == nullptr || !transposed_panels_bf16()) return false;
    const int64_t N = op.N, K = op.K;
    const int64_t bytes = std::max(int64_t(8) << 20, (int64_t(2) << 20) * int64_t(at::get_num_threads()));
    const int64_t kc = std::min(std::max<int64_t>(bytes / (N * 2) / kBf16Chunk * kBf16Chunk, 256),
                                ceil_div(K, kBf16Chunk) * kBf16Chunk);
    const auto bf16 = at::TensorOptions().dtype(at::kBFloat16);
    const at::Tensor panel = at::empty({N * kc}, bf16);
    auto* pp = reinterpret_cast<uint16_t*>(panel.data_ptr());
    const at::Tensor A = at::from_blob(const_cast<T*>(g), {M, N}, bf16);
    const at::Tensor out_all = at::from_blob(out, {M, K}, {ldo, 1}, bf16);
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kw = std::min(kc, K - k0);
      at::parallel_for(0, N, 16, [&](int64_t a, int64_t b) {
        kern.decode_rows_bf16(op, a, b - a, k0, kw, 1, pp + a * kc, kc, 0);
      });
      at::Tensor C = out_all.narrow(1, k0, kw);
      at::mm_out(C, A, at::from_blob(pp, {N, kw}, {kc, 1}, bf16));
    }
    return true;
  }
}

}  // namespace

template <typename T>
W4GemvActivations w4_gemv_activations(const W4Kernels& kern, const W4Operand& op) {
  W4GemvActivations a;
  a.K = op.K;
  a.bf16 = std::is_same_v<T, c10::BFloat16> && kern.gemv_rows_bf16 && kern.gemv_bf16_takes(op);
  if (!a.bf16) return a;
  a.group_sums = w4_bf16_row_group_sums(op);
  if (a.group_sums) a.group = op.G <= 1 ? op.K : op.group;
  a.pack_bf16_row = kern.pack_bf16_row;
  a.pack_plane_steps = kern.pack_plane_steps;
  return a;
}

template <typename T>
void w4_pack_rows(const W4GemvActivations& acts, const T* x, int64_t M, void* dst) {
  if (!acts.bf16) return pack(x, M, acts.K, static_cast<float*>(dst));
  const int64_t K = acts.K, Kp = w4_bf16_padded(K), ld = acts.row_elems();
  for (int64_t m = 0; m < M; m++) {  // the bits of bf16 x, moved: a few KB per row
    uint16_t* row = static_cast<uint16_t*>(dst) + m * ld;
    if (acts.pack_bf16_row) {
      acts.pack_bf16_row(reinterpret_cast<const uint16_t*>(x) + m * K, K, acts.group, acts.group_sums, row);
      continue;
    }
    pack_chunks<kW4Bf16StepOrder>(reinterpret_cast<const uint16_t*>(x) + m * K, K, Kp, row);
    if (acts.group_sums == 0) continue;
    float* sums = reinterpret_cast<float*>(row + Kp);
    std::fill(sums, sums + acts.group_sums, 0.f);
    segment_sums(x + m * K, K, acts.group, sums);
  }
  if (!acts.pack_plane_steps) return;
  // The planes cost about 60 times the bf16 words' moves: a row of the longest projections (K = 14336, 112 steps)
  // took 7 us on one thread, a few percent of a 16-thread GEMV, so long rows are split among threads.
  const int64_t steps = Kp / kW4Bf16Step, plane_at = w4_plane_steps_at(K, acts.group_sums);
  at::parallel_for(0, M * steps, kPlaneStepsGrain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1;) {
      const int64_t m = i / steps, s0 = i % steps, s1 = std::min(steps, s0 + i1 - i);
      uint16_t* row = static_cast<uint16_t*>(dst) + m * ld;
      acts.pack_plane_steps(reinterpret_cast<const uint16_t*>(x) + m * K, K, s0, s1,
                            reinterpret_cast<W4PlaneStep*>(row + plane_at));
      i += s1 - s0;
    }
  });
}

template <typename T>
void w4_gemv_rows(const W4Kernels& kern, const W4GemvActivations& acts, const void* xp, int64_t M, const W4Operand& op,
                  int64_t n0, int64_t n1, T* out, int64_t ldo) {
  const int64_t ldx = acts.row_elems();
  // one activation row: 4 weight rows per fp32 tile share its loads; more rows: 2 weight rows x up to 4 x rows
  const int64_t tile_rows = M == 1 ? 4 : 2;
  // Output columns a block at a time: the kernels' sums of the block, then its global scale, bias and rounding in
  // one loop (per tile's 4 columns, that loop was 8% of a MoE expert's decode). With more activation rows than a
  // tile takes, a block is one tile's weight rows, so that the later rows find them in L1.
  constexpr int64_t kBlock = 64;
  const int64_t block = M <= kMaxTileRows ? kBlock : tile_rows;
  float sums[kMaxTileRows * kBlock];
  for (int64_t n = n0; n < n1; n += block) {
    const int64_t nb = std::min(block, n1 - n);
    for (int64_t m = 0; m < M; m += kMaxTileRows) {
      const int mr = int(std::min<int64_t>(kMaxTileRows, M - m));
      if (acts.bf16) {
        kern.gemv_rows_bf16(mr, static_cast<const uint16_t*>(xp) + m * ldx, ldx, op, n, n + nb, sums, nb);
      } else {
        for (int64_t t = 0; t < nb; t += tile_rows) {
          const int nr = int(std::min(tile_rows, nb - t));
          float tile[kMaxTileRows * kMaxTileRows];
          kern.gemv_tile(mr, nr, static_cast<const float*>(xp) + m * ldx, ldx, op, n + t, tile);
          for (int i = 0; i < mr; i++)
            for (int r = 0; r < nr; r++) sums[i * nb + t + r] = tile[i * nr + r];
        }
      }
      for (int i = 0; i < mr; i++) {
        const float* s = sums + i * nb;
        T* o = out + (m + i) * ldo + n;
        for (int64_t r = 0; r < nb; r++) o[r] = T(finish(op, n + r, s[r]));
      }
    }
  }
}

template <typename T>
int64_t w4_gemm_min_rows(const W4Operand& op) {
  return w4_gemm_min_rows(w4_gemm_route<T>(kernel_set().w4, op));
}

template <typename T>
void w4_matmul(const T* x, int64_t M, const W4Operand& op, T* out, int64_t ldo) {
  if (M == 0 || op.N == 0) return;
  if (op.K == 0) {  // an empty sum: bias or zero
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < op.N; n++) out[m * ldo + n] = T(op.bias ? op.bias[n] : 0.f);
    return;
  }
  const W4Kernels& kern = kernel_set().w4;
  const W4GemmRoute route = w4_gemm_route<T>(kern, op);
  if (M >= w4_gemm_min_rows(route) && bf16_gemm(route, kern, x, M, op, out, ldo)) return;
  if (M >= w4_gemm_min_rows(route)) {
    float* xp = scratch<float>(Slot::Activations, size_t(M * w4_padded(op.K)));
    pack(x, M, op.K, xp);
    panel_gemm(kern, xp, M, op, out, ldo);
  } else {
    const W4GemvActivations acts = w4_gemv_activations<T>(kern, op);
    uint8_t* xp = scratch<uint8_t>(Slot::Activations, size_t(M * acts.row_bytes()));
    w4_pack_rows(acts, x, M, xp);
    parallel_chunks(op.N, stream_chunk(op.N, kMaxTileRows, 16),
                    [&](int64_t n0, int64_t n1) { w4_gemv_rows(kern, acts, xp, M, op, n0, n1, out, ldo); });
  }
  release_scratch_above_cap(Slot::Activations);
}

template <typename T>
void w4_matmul_t(const T* g, int64_t M, const W4Operand& op, T* out, int64_t ldo) {
  const int64_t N = op.N, K = op.K;
  if (M == 0 || K == 0) return;
  const W4Kernels& kern = kernel_set().w4;
  if (bf16_gemm_t(kern, g, M, op, out, ldo)) return;
  const at::Tensor gf = at::from_blob(const_cast<T*>(g), {M, N}, at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value))
                            .to(at::kFloat)
                            .contiguous();
  at::Tensor acc = at::zeros({M, K}, at::kFloat);
  // panels of decoded rows (natural order) times the matching columns of g, in torch's fp32 GEMM
  const int64_t rows = std::max<int64_t>(kPanelRows, (1 << 20) / std::max<int64_t>(K, 1));
  at::Tensor panel = at::empty({std::min(rows, N), K}, at::kFloat);
  float* pp = panel.data_ptr<float>();
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t n1 = std::min(N, n0 + rows);
    at::parallel_for(n0, n1, rows_grain(K, 1 << 14),
                     [&](int64_t a, int64_t b) { kern.dequantize_rows(op, a, b - a, pp + (a - n0) * K, K); });
    acc.addmm_(gf.narrow(1, n0, n1 - n0), panel.narrow(0, 0, n1 - n0));
  }
  const float* ap = acc.data_ptr<float>();
  at::parallel_for(0, M, rows_grain(K, 1 << 14), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t k = 0; k < K; k++) out[m * ldo + k] = T(ap[m * K + k] * op.global);
  });
}

template <typename T>
void w4_dequantize_to(const W4Operand& op, T* out) {
  const int64_t K = op.K;
  if (op.N == 0 || K == 0) return;
  const W4Kernels& kern = kernel_set().w4;
  // rows decoded into a per-thread fp32 buffer, then scaled and rounded once into the output
  constexpr int64_t kRows = 16;
  at::parallel_for(0, ceil_div(op.N, kRows), 1, [&](int64_t b0, int64_t b1) {
    float* buf = scratch<float>(Slot::Panel, size_t(kRows * K));
    for (int64_t b = b0; b < b1; b++) {
      const int64_t n0 = b * kRows, nr = std::min(kRows, op.N - n0);
      kern.dequantize_rows(op, n0, nr, buf, K);
      T* o = out + n0 * K;
      for (int64_t i = 0; i < nr * K; i++) o[i] = T(buf[i] * op.global);
    }
  });
  release_scratch_above_cap(Slot::Panel);
}

#define LOWBIT_W4_INSTANTIATE(T)                                                 \
  template W4GemvActivations w4_gemv_activations<T>(const W4Kernels&, const W4Operand&); \
  template void w4_pack_rows<T>(const W4GemvActivations&, const T*, int64_t, void*); \
  template void w4_gemv_rows<T>(const W4Kernels&, const W4GemvActivations&, const void*, int64_t, const W4Operand&, \
                                int64_t, int64_t, T*, int64_t); \
  template void w4_matmul<T>(const T*, int64_t, const W4Operand&, T*, int64_t);   \
  template void w4_matmul_t<T>(const T*, int64_t, const W4Operand&, T*, int64_t); \
  template void w4_dequantize_to<T>(const W4Operand&, T*); \
  template int64_t w4_gemm_min_rows<T>(const W4Operand&);
LOWBIT_W4_INSTANTIATE(float)
LOWBIT_W4_INSTANTIATE(c10::BFloat16)
LOWBIT_W4_INSTANTIATE(c10::Half)
#undef LOWBIT_W4_INSTANTIATE

}  // namespace lowbit::cpu
