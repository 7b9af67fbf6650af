#include "cpu/fp8_matmul.h"

#include <ATen/Parallel.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/bit_cast.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu/bf16_terms.h"
#include "cpu/brgemm.h"
#include "cpu/chunk_pack.h"
#include "cpu/fp8_simd.h"
#include "cpu/parallel.h"
#include "cpu/workspace.h"

namespace lowbit::cpu {
namespace {

// What multiplies output column n's sums after the K reduction: its tensor / channel scale (block scales were
// applied per segment: 1), NaN where the column met a NaN code.
inline float column_scale(const Fp8Operand& op, int64_t n, bool nan) {
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  if (op.layout.kind == ScaleKind::Tensor) return op.scale[0];
  return op.layout.kind == ScaleKind::Channel ? op.scale[n] : 1.f;
}

inline float finish(const Fp8Operand& op, int64_t n, float sum, bool nan) {
  const float v = sum * kDecodeUnscale * column_scale(op, n, nan);
  return op.bias ? v + op.bias[n] : v;
}

// finish() for a tile of the GEMM's output: the sums of columns [r0, r0 + nr) (s: their rows of the transposed
// sums, row stride lds) for rows [m_begin, m_end) into out [..][ldo], through 16 x 16 blocks so that the sums are
// read and out is written along their rows (element by element, the transposed loop took a sixth of the GEMM's
// time at N = 14336, M = 64): (sum * unscale) * mul (+ add), the multipliers and addends of columns
// [n0, n0 + rn) from columns(n0, rn, mul, add).
template <typename T, typename Columns>
void finish_tile(const float* s, int64_t lds, int64_t m_begin, int64_t m_end, int64_t r0, int64_t nr, float unscale,
                 bool has_add, Columns&& columns, T* out, int64_t ldo) {
  constexpr int64_t kB = 16;
  for (int64_t rb = 0; rb < nr; rb += kB) {
    const int64_t rn = std::min(kB, nr - rb);
    float scale[kB], bias[kB];
    columns(r0 + rb, rn, scale, bias);
    for (int64_t m0 = m_begin; m0 < m_end; m0 += kB) {
      const int64_t mn = std::min(kB, m_end - m0);
      float t[kB][kB];
      for (int64_t i = 0; i < rn; i++)
        for (int64_t j = 0; j < mn; j++) {
          const float v = s[(rb + i) * lds + m0 + j] * unscale * scale[i];
          t[j][i] = has_add ? v + bias[i] : v;
        }
      for (int64_t j = 0; j < mn; j++)
        for (int64_t i = 0; i < rn; i++) out[(m0 + j) * ldo + r0 + rb + i] = T(t[j][i]);
    }
  }
}

inline const float* block_scale_row(const Fp8Operand& op, int64_t n) {
  return op.scale + (n / op.layout.bn) * op.layout.kb;
}

// x [M, K] -> packed fp32 segments: segment s of row m at dst + s * seg_stride + m * row_stride.
template <typename T>
void pack(const T* x, int64_t M, const KSegments& seg, float* dst, int64_t row_stride, int64_t seg_stride) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; m++)
      for (int64_t s = 0; s < seg.count; s++)
        pack_chunks<kChunkOrder>(x + m * seg.K + seg.begin(s), seg.size(s), seg.padded,
                                 dst + s * seg_stride + m * row_stride);
  });
}

// The GEMM regimes go through K in windows, and the windows in groups. A group's activations (all rows of an M
// block, every window of the group) are packed at once; then, in one parallel region, the weight panels go to
// whichever thread asks next, and each panel runs through every window of the group: the window's slice of the
// panel decoded and multiplied into the panel's fp32 sums, which persist across windows and groups and are
// written out after the last window. A panel's sums stay in L1 across a group, and the group's activations in
// L2 beside a decoded slice (Bf16Engine; measured 1.1-1.6x faster at M = 16-256 than every thread running through
// the windows one by one over a fixed share of panels, which fetched each panel's sums again per window). Scratch
// is bounded by the group and the tiles -- never by K, nor by the chunk padding of short K blocks (block_size
// [.., 1] pads each code to a chunk: a window then holds few codes).
struct KWindow {
  int64_t s0, s1;  // segments
  int64_t p0, p1;  // positions of each of them (chunk multiples): all of a segment's, or a slice of one segment
  int64_t seg_width() const { return p1 - p0; }
  int64_t width() const { return (s1 - s0) * (p1 - p0); }
  // codes [*first, *first + n) of segment s fall in this window
  int64_t codes(const KSegments& seg, int64_t s, int64_t* first) const {
    *first = seg.begin(s) + p0;
    return std::clamp<int64_t>(seg.size(s) - p0, 0, p1 - p0);
  }
};

// Windows of at most max_width positions (at least one chunk): runs of whole segments, or slices of equal size
// of a longer segment.
std::vector<KWindow> k_windows(const KSegments& seg, int64_t max_width, int64_t chunk) {
  std::vector<KWindow> out;
  max_width = std::max(chunk, max_width / chunk * chunk);
  if (seg.padded <= max_width) {
    const int64_t per = max_width / seg.padded;
    for (int64_t s = 0; s < seg.count; s += per) out.push_back({s, std::min(seg.count, s + per), 0, seg.padded});
    return out;
  }
  const int64_t slices = ceil_div(seg.padded, max_width), step = ceil_div(ceil_div(seg.padded, slices), chunk) * chunk;
  for (int64_t s = 0; s < seg.count; s++)
    for (int64_t p = 0; p < seg.padded; p += step) out.push_back({s, s + 1, p, std::min(seg.padded, p + step)});
  return out;
}

// Bytes a window's packed activations (all terms, all rows of an M block) may take, and one decoded bf16 panel
// slice: together they stay in a 2 MB L2. The slice's size measured best at M = 64 on 16 Sapphire Rapids cores
// (128 KB, of 128 KB to 8 MB: 3.0-3.3 ms against 4.0-4.9 ms at K = 14336, N = 4096).
constexpr int64_t kWindowBytes = 512 << 10;
constexpr int64_t kBf16SliceBytes = 128 << 10;
// The smallest window worth a pass over the panels, whatever M: below it the calls' fixed costs dominate.
constexpr int64_t kMinWindow = 256;
// The output tiles of the finishing pass (after an M block's last window): rows x columns. Each task writes whole
// runs of its rows: when each weight panel's task wrote its own 64 columns of every row of a large M block, the
// writes (32 bytes per row, rows tens of KB apart: a TLB miss and a partial line each) took longer than the
// products (M = 4096, N = 3072 on 16 Sapphire Rapids cores: 3x the GEMM's own time).
constexpr int64_t kFinishRows = 16, kFinishCols = 1024;

// The panel decoders pad only to a whole chunk; a short last segment would leave stale scratch (maybe NaN) up
// to the segment's padded length, which the zero-padded activations still multiply (0 * NaN = NaN).
template <typename E>
void zero_segment_tail(E* segment, int64_t ld, int64_t nrows, int64_t written, int64_t padded) {
  for (int64_t r = 0; written < padded && r < nrows; r++)
    std::fill(segment + r * ld + written, segment + r * ld + padded, E(0));
}

// Decode rows [r0, r0 + nr) of the weight's window w into panel [nr][w.width()] (segment by segment, zero padded).
template <typename E, typename Decode>
void decode_window(const Fp8Operand& op, const KSegments& seg, const KWindow& w, int64_t r0, int64_t nr, int64_t chunk,
                   E* panel, Decode&& decode) {
  for (int64_t s = w.s0; s < w.s1; s++) {
    int64_t k0;
    const int64_t n = w.codes(seg, s, &k0);
    E* segment = panel + (s - w.s0) * w.seg_width();
    if (n > 0) decode(op.w + r0 * op.K, op.K, nr, k0, n, segment, w.width());
    zero_segment_tail(segment, w.width(), nr, ceil_div(n, chunk) * chunk, w.seg_width());
  }
}

// What a thread of the GEMM's parallel region holds across its panels: the engine's per-thread state and its
// Panel / Tile scratch (given back after its last panel where above the cap).
template <class Engine>
struct PanelThreadScope {
  [[maybe_unused]] typename Engine::Worker worker;  // AMX: releases the tile state after this thread's calls
  ~PanelThreadScope() {
    release_scratch_above_cap(Slot::Panel);
    release_scratch_above_cap(Slot::Tile);
  }
};

// The windowed GEMM (see KWindow) over an engine that packs, decodes and multiplies: Fp32Engine (fp32 panels of an
// fp8 weight in torch's fp32 GEMM) or Bf16Engine (bf16 panels of any PanelWeight in oneDNN's AMX brgemm). sums
// [N][mb] holds each output column's fp32 sums for the rows of the M block; nan [N] the columns that met a NaN
// code (engines whose decode does not produce NaN).
template <class Engine, typename T>
void windowed_gemm(const Engine& eng, const T* x, int64_t M, T* out, int64_t ldo) {
  using Act = typename Engine::Act;
  const KSegments& seg = eng.seg;
  const int64_t N = eng.N(), K = seg.K, R = Engine::kRows, panels = ceil_div(N, R);
  const int64_t Mb = eng.m_block(M);
  float* sums = scratch<float>(Slot::Accum, size_t(N * Mb + ceil_div(N, 4)));
  bool* nan = reinterpret_cast<bool*>(sums + N * Mb);
  for (int64_t m0 = 0; m0 < M; m0 += Mb) {
    const int64_t mb = std::min(Mb, M - m0);
    // the engine may start the sums at a value of its own (block offsets): the first window adds to it
    const bool preset = eng.preset_sums(x + m0 * K, mb, sums);
    const std::vector<KWindow> windows = k_windows(seg, eng.max_width(mb, seg), Engine::kChunkLen);
    const size_t nw = windows.size();
    int64_t max_width = 0;
    for (const KWindow& w : windows) max_width = std::max(max_width, w.width());
    // act_at[i]: where window i's packed activations start in its group's buffer
    std::vector<int64_t> act_at(nw + 1, 0);
    for (size_t g0 = 0, g1; g0 < nw; g0 = g1) {
      act_at[g0] = 0;
      for (g1 = g0; g1 < nw; g1++) {  // at least one window
        const int64_t end = act_at[g1] + eng.act_elems(mb, windows[g1]);
        if (g1 > g0 && end * int64_t(sizeof(Act)) > Engine::kGroupBytes) break;
        act_at[g1 + 1] = end;
      }
      Act* xp = scratch<Act>(Slot::Activations, size_t(act_at[g1]));
      std::vector<int64_t> items_at(g1 - g0 + 1, 0);  // the group's pack items, window by window
      for (size_t i = g0; i < g1; i++) items_at[i - g0 + 1] = items_at[i - g0] + eng.pack_items(mb, windows[i]);
      at::parallel_for(0, items_at.back(), 1, [&](int64_t i0, int64_t i1) {
        size_t wi = g0;
        for (int64_t i = i0; i < i1; i++) {
          while (items_at[wi - g0 + 1] <= i) wi++;
          eng.pack_item(x + m0 * K, mb, seg, windows[wi], i - items_at[wi - g0], xp + act_at[wi]);
        }
      });
      parallel_chunks<PanelThreadScope<Engine>>(panels, 1, [&](int64_t b, int64_t) {
        auto* panel = scratch<typename Engine::Elem>(Slot::Panel, size_t(eng.terms() * R * eng.panel_ld(max_width)));
        const int64_t r0 = b * R, nr = std::min(R, N - r0);
        float* s = sums + r0 * mb;
        if (g0 == 0) std::fill(nan + r0, nan + r0 + nr, false);
        for (size_t wi = g0; wi < g1; wi++) {
          eng.decode(windows[wi], r0, nr, panel, nan + r0);
          eng.multiply(windows[wi], r0, nr, panel, xp + act_at[wi], mb, wi == 0 && !preset, s);
        }
      });
    }
    const int64_t col_tiles = ceil_div(N, kFinishCols);
    at::parallel_for(0, ceil_div(mb, kFinishRows) * col_tiles, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; t++) {
        const int64_t r = t / col_tiles * kFinishRows, n0 = t % col_tiles * kFinishCols;
        eng.finish(sums + n0 * mb, mb, r, std::min(mb, r + kFinishRows), nan, n0, std::min(kFinishCols, N - n0),
                   out + m0 * ldo, ldo);
      }
    });
  }
  release_scratch_above_cap(Slot::Activations);
  release_scratch_above_cap(Slot::Accum);
}

// fp32 panels of kRows weight rows times the packed activations in torch's fp32 GEMM (MKL here): the decoded
// panel is reused for all rows of the M block. Block scales: a batched GEMM gives each segment's partial sums,
// which are scaled and added.
template <typename T>
struct Fp32Engine {
  using Act = float;
  using Elem = float;
  struct Worker {};
  // Smaller panels make MKL choose its no-copy kernels, which measured slower.
  static constexpr int64_t kRows = 256, kCols = 1, kChunkLen = kChunk;
  // packed activations of a group: read by every thread for every panel (in L3: MKL reads long rows best)
  static constexpr int64_t kGroupBytes = 8 << 20;
  // a decoded panel slice, and the window's activations (shared by all threads, which MKL reads best in long
  // rows: no L2 target here)
  static constexpr int64_t kPanelBytes = 2 << 20, kActBytes = 8 << 20;
  const Fp8Kernels& kern;
  const Fp8Operand& op;
  bool block = op.layout.kind == ScaleKind::Block;
  KSegments seg = k_segments_for(block, op.layout.bk, op.K, kChunkLen);

  int64_t N() const { return op.N; }
  static constexpr int terms() { return 1; }
  static constexpr int64_t panel_ld(int64_t width) { return width; }  // a decoded panel's row stride
  bool preset_sums(const T*, int64_t, float*) const { return false; }
  // M blocks: the sums kept across windows (fp32 [N][M block]) take at most about 32 MB; each block decodes the
  // weights again
  int64_t m_block(int64_t M) const { return std::min(M, ceil_div(M, ceil_div(M * op.N * 4, int64_t(32) << 20))); }
  void finish(const float* s, int64_t lds, int64_t m_begin, int64_t m_end, const bool* nan, int64_t r0, int64_t nr,
              T* out, int64_t ldo) const {
    finish_tile(s, lds, m_begin, m_end, r0, nr, kDecodeUnscale, op.bias != nullptr,
                 [&](int64_t n0, int64_t rn, float* mul, float* add) {
                   for (int64_t i = 0; i < rn; i++) {
                     mul[i] = column_scale(op, n0 + i, nan[n0 + i]);
                     add[i] = op.bias ? op.bias[n0 + i] : 0.f;
                   }
                 },
                 out, ldo);
  }

  int64_t max_width(int64_t mb, const KSegments& seg) const {
    int64_t w = std::min(kPanelBytes / (kRows * 4), std::max(kMinWindow, kActBytes / (mb * 4)));
    // block scales: the batched GEMM's partial sums, [segments][kRows][mb], within kPanelBytes too
    if (block) w = std::min(w, std::max<int64_t>(1, kPanelBytes / (mb * kRows * 4)) * seg.padded);
    return w;
  }
  // [mb][width] without block scales (one segment); [segment][mb][segment width] with
  int64_t act_elems(int64_t mb, const KWindow& w) const { return mb * w.width(); }
  // a pack item is one activation row (each writes its own runs of positions)
  int64_t pack_items(int64_t mb, const KWindow&) const { return mb; }
  void pack_item(const T* x, int64_t mb, const KSegments& seg, const KWindow& w, int64_t m, float* dst) const {
    const int64_t sw = w.seg_width();
    for (int64_t s = w.s0; s < w.s1; s++) {
      int64_t k0;
      const int64_t n = w.codes(seg, s, &k0);
      pack_chunks<kChunkOrder>(x + m * seg.K + k0, n, sw, dst + (s - w.s0) * mb * sw + m * sw);
    }
  }
  void decode(const KWindow& w, int64_t r0, int64_t nr, float* panel, bool* nan) const {
    decode_window(op, seg, w, r0, nr, kChunk, panel,
                  [&](const uint8_t* rows, int64_t K, int64_t n_rows, int64_t k0, int64_t n, float* dst, int64_t ld) {
                    kern.decode_rows(rows, K, n_rows, k0, n, dst, ld, nan);
                  });
  }
  void multiply(const KWindow& w, int64_t r0, int64_t nr, const float* panel, const float* xp, int64_t mb, bool first,
                float* sums) const {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    const int64_t ns = w.s1 - w.s0, sw = w.seg_width();
    auto* A = const_cast<float*>(panel);
    auto* X = const_cast<float*>(xp);
    if (!block) {
      // panel @ x^T into transposed sums [nr][mb]: measured faster with MKL than x @ panel^T
      at::Tensor C = at::from_blob(sums, {nr, mb}, f32);
      const at::Tensor a = at::from_blob(A, {nr, sw}, f32), xt = at::from_blob(X, {mb, sw}, f32).t();
      if (first) at::mm_out(C, a, xt);
      else C.addmm_(a, xt);
      return;
    }
    // each segment's partial sums, transposed like the sums: part[s][r][m] = panel_s[r] . x_s[m]
    float* part = scratch<float>(Slot::Tile, size_t(ns * nr * mb));
    at::Tensor P = at::from_blob(part, {ns, nr, mb}, f32);
    at::bmm_out(P, at::from_blob(A, {ns, nr, sw}, {sw, w.width(), 1}, f32),
                at::from_blob(X, {ns, sw, mb}, {mb * sw, 1, sw}, f32));
    for (int64_t r = 0; r < nr; r++) {
      const float* bs = block_scale_row(op, r0 + r) + w.s0;
      float* dst = sums + r * mb;
      for (int64_t s = 0; s < ns; s++) {
        const float* src = part + (s * nr + r) * mb;
        const bool init = first && s == 0;
        for (int64_t m = 0; m < mb; m++) dst[m] = init ? bs[s] * src[m] : dst[m] + bs[s] * src[m];
      }
    }
  }
};

// The bf16 GEMM's blocking: weight rows per decoded panel (the brgemm's A), activation rows per brgemm call (its
// N) and K positions per call (A and B blocks of 64 KB). Picked by the best of 12 alternating runs at M = 64, 256,
// 1024 (K = 4096, N = 14336) on a Sapphire Rapids; this shared machine's run-to-run spread (up to 2x) hides
// differences much below 20%.
constexpr int64_t kBf16Panel = 64;
constexpr int64_t kBf16Cols = 64;
constexpr int64_t kBf16Depth = 512;

static_assert(2 * kVnniPackUnits == kBf16Chunk, "a pack block of bf16 pairs is one chunk");

// The VNNI pair each pair of a chunk's codes goes to under a PanelWeight's order (its pairs hold consecutive codes).
inline std::array<uint8_t, kVnniPackUnits> pair_destinations(const uint8_t* order) {
  std::array<uint8_t, kVnniPackUnits> to{};
  for (int q = 0; q < kBf16Chunk; q += 2) to[order[q] / 2] = uint8_t(q / 2);
  return to;
}

// Decoded bf16 panels of a PanelWeight times the packed activation terms, fp32 accumulation: on a CPU with AMX
// (amx_gemm_available) in torch's oneDNN brgemm -- at M = 64 (fp8), 3x (bf16, half x) and 2x (float x) faster
// there than fp32 panels in the fp32 GEMM -- and elsewhere in the kernel set's bf16 GEMM (AVX-512 BF16), on the
// same operands. For fp8 the sums are the fp32 path's: decoded weights and bf16 terms are exact
// in bf16, their products exact in fp32. (AMX, like vdpbf16ps, reads bf16 denormals -- below 1e-38 -- as zero.)
// Decoded NaN codes are NaN and flow through the sums. Block scales multiply each segment's sums. A weight of two
// terms (PanelWeight) is two panels, each multiplied with the activation terms as PanelWeight says.
template <typename T>
struct Bf16Engine {
  using Act = uint16_t;
  using Elem = uint16_t;
  using Worker = AmxTileScope;
  static constexpr int64_t kRows = kBf16Panel, kCols = kBf16Cols, kChunkLen = kBf16Chunk;
  // packed activations of a group, in L2 with a decoded slice: measured at M = 64-256 on 16 and 2 Sapphire Rapids
  // cores, 0.5 and 2 MB within the noise of 1 MB
  static constexpr int64_t kGroupBytes = 1 << 20;
  static constexpr int64_t kPanelSumsBytes = 64 << 10;
  const PanelWeight& pw;
  bool block = pw.block;
  KSegments seg = k_segments_for(block, pw.block_k, pw.K, kChunkLen);
  // the kernel set's pack of full blocks of bf16 x (null: every block by the scalar loop), and where it puts each
  // pair of a chunk
  VnniPackFn pack = kernel_set().vnni_pack;
  std::array<uint8_t, kVnniPackUnits> pack_to = pair_destinations(pw.order);
  // null: oneDNN's AMX brgemm multiplies
  Bf16GemmFn gemm = amx_gemm_available() ? nullptr : kernel_set().bf16_gemm;
  // block scales: the set's bf16 GEMM, or on AMX its tile kernel (null: brgemm per segment, scaled in memory)
  Bf16GemmFn segment_gemm = amx_gemm_available() ? amx_segment_gemm() : gemm;

  int64_t N() const { return pw.N; }
  int terms() const { return pw.terms; }
  // A decoded panel's row stride: its width and one cache line. Windows of 1024 codes made rows 2 KB apart, and the
  // 16 rows a tile or vector tile reads fell into two of L1's 64 sets; the line apart spreads them (bit-identical
  // sums; M = 64 products 0.3-5% faster on AMX, the 4-bit and fp8 routes alike).
  static constexpr int64_t kPanelPad = 32;
  static constexpr int64_t panel_ld(int64_t width) { return width + kPanelPad; }
  // Block offsets (w = q * scale + offset): sums[n][m] = sum over segments s of offset[n][s] * (the sum of x row m
  // over segment s), in torch's fp32 GEMM, before the windows add the scaled products -- N x segments x mb products
  // against the windows' N x K x mb, and the tiles carry no offsets.
  bool preset_sums(const T* x, int64_t mb, float* sums) const {
    const float* offsets = pw.block_offsets();
    if (offsets == nullptr) return false;
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor xs = at::empty({seg.count, mb}, f32);  // [segment][row]
    float* xsp = xs.data_ptr<float>();
    at::parallel_for(0, mb, 1, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; m++) segment_sums(x + m * seg.K, seg.K, seg.len, xsp + m, mb);
    });
    at::Tensor C = at::from_blob(sums, {pw.N, mb}, f32);
    at::mm_out(C, at::from_blob(const_cast<float*>(offsets), {pw.N, seg.count}, f32), xs);
    return true;
  }
  // M blocks of 256 rows: each panel's sums ([kRows][M block] fp32, 64 KB) stay in its thread's L2 from group to
  // group. On 16 Sapphire Rapids cores 256-row blocks took 0.9-1.1x the time of 512- and 1024-row ones at M = 1024-4096
  // (K, N = 3072-12288), and 0.6x at M = 1024, N = 12288; a block decodes the weights again, a few percent of its time.
  int64_t m_block(int64_t M) const { return std::min(M, kPanelSumsBytes / (kRows * 4) / kCols * kCols); }
  int64_t max_width(int64_t mb, const KSegments&) const {
    return std::min(kBf16SliceBytes / (kRows * 2 * pw.terms),
                    std::max(kMinWindow, kWindowBytes / (kBf16Terms<T> * mb * 2)));
  }
  void finish(const float* s, int64_t lds, int64_t m_begin, int64_t m_end, const bool*, int64_t r0, int64_t nr, T* out,
              int64_t ldo) const {
    finish_tile(s, lds, m_begin, m_end, r0, nr, pw.unscale, pw.has_add,
                 [&](int64_t n0, int64_t rn, float* mul, float* add) { pw.columns(n0, rn, mul, add); }, out, ldo);
  }
  int64_t act_elems(int64_t mb, const KWindow& w) const { return kBf16Terms<T> * mb * w.width(); }
  // term t at dst + t * mb * width; for each block of kBf16Cols rows, the block of rows c0.. (width cw) at
  // + c0 * width in VNNI pairs (brgemm.h), positions segment by segment in the weight's order, zero padded.
  // A pack item is kVnniPackRows rows of one chunk of positions: 16 rows' pairs are a whole cache line of a VNNI
  // row (kBf16Cols = 64 rows), so items never share a line but at a short last block, and a thread's run of
  // items reads its rows' codes in order.
  int64_t pack_items(int64_t mb, const KWindow& w) const {
    return ceil_div(mb, kVnniPackRows) * (w.width() / kBf16Chunk);
  }
  void pack_item(const T* x, int64_t mb, const KSegments& seg, const KWindow& w, int64_t item, uint16_t* dst) const {
    const int64_t width = w.width(), sw = w.seg_width(), chunks = sw / kBf16Chunk, per_rows = width / kBf16Chunk;
    const int64_t m_lo = item / per_rows * kVnniPackRows, m_hi = std::min(mb, m_lo + kVnniPackRows);
    const int64_t ci = item % per_rows, s = w.s0 + ci / chunks, c = ci % chunks * kBf16Chunk;
    const int64_t p = (s - w.s0) * sw + c, c0 = m_lo / kBf16Cols * kBf16Cols, cw = std::min(kBf16Cols, mb - c0);
    int64_t k0;
    const int64_t n = w.codes(seg, s, &k0);
    if constexpr (kBf16Terms<T> == 1) {
      if (pack != nullptr && m_hi - m_lo == kVnniPackRows && c + kBf16Chunk <= n) {
        pack(x + m_lo * seg.K + k0 + c, seg.K * 2, pack_to.data(),
             reinterpret_cast<uint32_t*>(dst + c0 * width + p * cw) + (m_lo - c0), cw);
        return;
      }
    }
    for (int64_t m = m_lo; m < m_hi; m++) {
      const T* src = x + m * seg.K + k0;
      // positions q, q + 1 (one VNNI pair) hold consecutive codes (PanelWeight::order): for bf16 x one 32-bit copy
      uint16_t* row = dst + c0 * width + p * cw + (m - c0) * 2;
      for (int q = 0; q < kBf16Chunk; q += 2) {
        const int64_t k = c + pw.order[q];
        uint16_t* at = row + q * cw;
        if constexpr (kBf16Terms<T> == 1) {
          if (k + 1 < n) {
            std::memcpy(at, src + k, 4);
            continue;
          }
        }
        uint16_t lo[kBf16Terms<T>] = {}, hi[kBf16Terms<T>] = {};
        if (k < n) split_bf16(src[k], lo);
        if (k + 1 < n) split_bf16(src[k + 1], hi);
        for (int t = 0; t < kBf16Terms<T>; t++) {
          at[t * mb * width] = lo[t];
          at[t * mb * width + 1] = hi[t];
        }
      }
    }
  }
  // term t of the panel at panel + t * kRows * width (row stride width)
  void decode(const KWindow& w, int64_t r0, int64_t nr, uint16_t* panel, bool*) const {
    const int64_t width = w.width(), ld = panel_ld(width), term_stride = kRows * ld;
    if (seg.padded == seg.len && w.p0 == 0 && w.p1 == seg.padded) {
      // whole segments of whole chunks lie in the panel as the codes do along K: one decode for the window (per
      // segment, a 4-bit decode set up its walk and group tables again for each row every 64-128 codes)
      const int64_t k0 = seg.begin(w.s0), n = std::min(seg.K, seg.begin(w.s1)) - k0;
      pw.decode(r0, nr, k0, n, panel, ld, term_stride);
      for (int t = 0; t < pw.terms; t++)
        zero_segment_tail(panel + t * term_stride, ld, nr, ceil_div(n, kBf16Chunk) * kBf16Chunk, width);
      return;
    }
    for (int64_t s = w.s0; s < w.s1; s++) {
      int64_t k0;
      const int64_t n = w.codes(seg, s, &k0);
      uint16_t* segment = panel + (s - w.s0) * w.seg_width();
      if (n > 0) pw.decode(r0, nr, k0, n, segment, ld, term_stride);
      for (int t = 0; t < pw.terms; t++)
        zero_segment_tail(segment + t * term_stride, ld, nr, ceil_div(n, kBf16Chunk) * kBf16Chunk, w.seg_width());
    }
  }
  // Block scales on the kernel set's bf16 GEMM (or, on AMX, its tile kernel): the window's segments in one call per
  // pair of terms, each segment's sums scaled as they leave the registers or tiles; brgemm's path below scales each
  // segment's sums in memory, which at 64-128 codes a segment cost as much as the products.
  void multiply_segments(const KWindow& w, int64_t r0, int64_t nr, const uint16_t* panel, const uint16_t* xp,
                         int64_t mb, bool first, float* sums) const {
    const int64_t width = w.width(), sw = w.seg_width(), ld = panel_ld(width);
    const float* scales[kRows];
    for (int64_t r = 0; r < nr; r++) scales[r] = pw.block_scale_row(r0 + r) + w.s0;
    const Bf16Segments segs{sw, scales};
    for (int64_t c0 = 0; c0 < mb; c0 += kBf16Cols) {
      const int64_t cw = std::min(kBf16Cols, mb - c0);
      const uint16_t* xb = xp + c0 * width;
      bool acc = !first;
      for (int tw = 0; tw < pw.terms; tw++)
        for (int t = 0; t < (tw == 0 ? kBf16Terms<T> : 1); t++) {
          segment_gemm(nr, cw, width, panel + tw * kRows * ld, ld, xb + t * mb * width, cw, sums + c0, mb, acc, &segs);
          acc = true;
        }
    }
  }
  void multiply(const KWindow& w, int64_t r0, int64_t nr, const uint16_t* panel, const uint16_t* xp, int64_t mb,
                bool first, float* sums) const {
    const int64_t width = w.width(), sw = w.seg_width(), ld = panel_ld(width);
    if (block && segment_gemm != nullptr) return multiply_segments(w, r0, nr, panel, xp, mb, first, sums);
    float* part = block ? scratch<float>(Slot::Tile, size_t(kBf16Panel * kBf16Cols)) : nullptr;
    const auto* a = reinterpret_cast<const c10::BFloat16*>(panel);
    for (int64_t c0 = 0; c0 < mb; c0 += kBf16Cols) {
      const int64_t cw = std::min(kBf16Cols, mb - c0);
      const auto* xb = reinterpret_cast<const c10::BFloat16*>(xp + c0 * width);
      for (int64_t s = w.s0; s < w.s1; s++) {
        const int64_t p = (s - w.s0) * sw;
        // without block scales the window's sums go into the persistent ones directly
        float* c = block ? part : sums + c0;
        const int64_t ldc = block ? cw : mb;
        bool acc = !block && !first;
        // weight term tw times activation term t: every pair with one first term (see PanelWeight)
        for (int tw = 0; tw < pw.terms; tw++)
          for (int t = 0; t < (tw == 0 ? kBf16Terms<T> : 1); t++)
            for (int64_t k = 0; k < sw; k += kBf16Depth) {
              const int64_t depth = std::min(kBf16Depth, sw - k);
              const auto* ak = a + tw * kRows * ld + p + k;
              const auto* bk = xb + t * mb * width + (p + k) * cw;
              if (gemm != nullptr)
                gemm(nr, cw, depth, reinterpret_cast<const uint16_t*>(ak), ld,
                     reinterpret_cast<const uint16_t*>(bk), cw, c, ldc, acc, nullptr);
              else
                at::native::cpublas::brgemm(nr, cw, depth, ld, cw, ldc, acc, ak, bk, c, true);
              acc = true;
            }
        if (block) {
          const bool init = first && s == w.s0;
          for (int64_t r = 0; r < nr; r++) {
            const float bs = pw.block_scale_row(r0 + r)[s];
            float* dst = sums + r * mb + c0;
            const float* src = part + r * cw;
            for (int64_t m = 0; m < cw; m++) dst[m] = init ? bs * src[m] : dst[m] + bs * src[m];
          }
        }
      }
    }
  }
};

// An fp8 weight as the bf16 panel GEMM reads it: the kernel set's exact bf16 decode (dec(code) / 256).
struct Fp8PanelWeight final : PanelWeight {
  const Fp8Operand& op;
  const Fp8Kernels& kern;
  Fp8PanelWeight(const Fp8Operand& o, const Fp8Kernels& k) : op(o), kern(k) {
    N = op.N;
    K = op.K;
    order = kBf16ChunkOrder.data();
    block = op.layout.kind == ScaleKind::Block;
    block_k = op.layout.bk;
    unscale = kDecodeUnscale;
    has_add = op.bias != nullptr;
  }
  void decode(int64_t r0, int64_t nr, int64_t k0, int64_t n, uint16_t* dst, int64_t ld, int64_t) const override {
    kern.decode_rows_bf16(op.w + r0 * op.K, op.K, nr, k0, n, dst, ld);
  }
  void columns(int64_t n0, int64_t nr, float* mul, float* add) const override {
    for (int64_t i = 0; i < nr; i++) {
      mul[i] = column_scale(op, n0 + i, false);
      add[i] = op.bias ? op.bias[n0 + i] : 0.f;
    }
  }
  const float* block_scale_row(int64_t n) const override { return lowbit::cpu::block_scale_row(op, n); }
};

// Whether the GEMM regime runs as bf16 panels and bf16 terms of x.
bool bf16_panels(const Fp8Kernels& kern) { return kern.decode_rows_bf16 != nullptr && bf16_panel_gemm_available(); }

}  // namespace

bool bf16_panel_gemm_available() { return amx_gemm_available() || kernel_set().bf16_gemm != nullptr; }

template <typename T>
void bf16_panel_gemm(const T* x, int64_t M, const PanelWeight& w, T* out, int64_t ldo) {
  windowed_gemm(Bf16Engine<T>{w}, x, M, out, ldo);
}

int64_t gemm_min_rows() {
  if (!bf16_panels(kernel_set().fp8)) return kGemmMinRows;
  return amx_gemm_available() ? kAmxGemmMinRows : kBf16GemmMinRows;
}

template <typename T>
GemvActivations gemv_activations(const Fp8Kernels& kern, const ScaleLayout& layout, int64_t K) {
  GemvActivations a;
  a.bf16 = std::is_same_v<T, c10::BFloat16> && kern.gemv_tile_bf16 != nullptr;
  a.seg = k_segments_for(layout.kind == ScaleKind::Block, layout.bk, K, a.bf16 ? kBf16Chunk : kChunk);
  return a;
}

template <typename T>
void pack_rows(const GemvActivations& acts, const T* x, int64_t M, void* dst) {
  const KSegments& seg = acts.seg;
  if (!acts.bf16) return pack(x, M, seg, static_cast<float*>(dst), seg.packed_size(), seg.padded);
  if constexpr (std::is_same_v<T, c10::BFloat16>) {  // the bf16 bits as they are
    auto* d = static_cast<uint16_t*>(dst);
    const auto* bits = reinterpret_cast<const uint16_t*>(x);
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; m++)
        for (int64_t s = 0; s < seg.count; s++)
          pack_chunks<kBf16ChunkOrder>(bits + m * seg.K + seg.begin(s), seg.size(s), seg.padded,
                                       d + m * seg.packed_size() + s * seg.padded);
    });
  }
}

template <typename T>
void gemv_rows(const Fp8Kernels& kern, const GemvActivations& acts, const void* xp, int64_t M, const Fp8Operand& op,
               int64_t n0, int64_t n1, T* out, int64_t ldo) {
  const KSegments& seg = acts.seg;
  const int64_t ldx = seg.packed_size(), K = op.K;
  const bool block = op.layout.kind == ScaleKind::Block;
  // one activation row: 4 weight rows per pass share its loads; more rows: 2 weight rows x up to 4 x rows
  const int64_t rows_per_pass = M == 1 ? 4 : 2;
  for (int64_t n = n0; n < n1;) {
    const int nr = int(std::min(rows_per_pass, n1 - n));
    const float* bs[kMaxTileRows] = {};
    if (block)
      for (int r = 0; r < nr; r++) bs[r] = block_scale_row(op, n + r);
    bool nan[kMaxTileRows] = {};
    for (int64_t m = 0; m < M; m += kMaxTileRows) {  // later groups find the weight rows in L1
      const int mr = int(std::min<int64_t>(kMaxTileRows, M - m));
      float sums[kMaxTileRows * kMaxTileRows];
      if (acts.bf16)
        kern.gemv_tile_bf16(mr, nr, static_cast<const uint16_t*>(xp) + m * ldx, ldx, op.w + n * K, K,
                            block ? bs : nullptr, seg, sums, nan);
      else
        kern.gemv_tile(mr, nr, static_cast<const float*>(xp) + m * ldx, ldx, op.w + n * K, K, block ? bs : nullptr,
                       seg, sums, nan);
      for (int i = 0; i < mr; i++)
        for (int r = 0; r < nr; r++) out[(m + i) * ldo + n + r] = T(finish(op, n + r, sums[i * nr + r], nan[r]));
    }
    n += nr;
  }
}

template <typename T>
void fp8_matmul(const T* x, int64_t M, const Fp8Operand& op, T* out, int64_t ldo) {
  if (M == 0 || op.N == 0) return;
  if (op.K == 0) {  // an empty sum: bias or zero, whatever the scale
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < op.N; n++) out[m * ldo + n] = T(op.bias ? op.bias[n] : 0.f);
    return;
  }
  const Fp8Kernels& kern = kernel_set().fp8;
  if (M >= gemm_min_rows()) {
    if (bf16_panels(kern)) return bf16_panel_gemm(x, M, Fp8PanelWeight(op, kern), out, ldo);
    return windowed_gemm(Fp32Engine<T>{kern, op}, x, M, out, ldo);
  }
  const GemvActivations acts = gemv_activations<T>(kern, op.layout, op.K);
  void* xp = scratch<uint8_t>(Slot::Activations, size_t(M * acts.row_bytes()));
  pack_rows(acts, x, M, xp);
  parallel_chunks(op.N, stream_chunk(op.N, kMaxTileRows, 16),
                  [&](int64_t n0, int64_t n1) { gemv_rows(kern, acts, xp, M, op, n0, n1, out, ldo); });
  release_scratch_above_cap(Slot::Activations);
}

#define LOWBIT_INSTANTIATE(T)                                                                                  \
  template void fp8_matmul<T>(const T*, int64_t, const Fp8Operand&, T*, int64_t);                              \
  template void bf16_panel_gemm<T>(const T*, int64_t, const PanelWeight&, T*, int64_t);                        \
  template GemvActivations gemv_activations<T>(const Fp8Kernels&, const ScaleLayout&, int64_t);                \
  template void pack_rows<T>(const GemvActivations&, const T*, int64_t, void*);                                \
  template void gemv_rows<T>(const Fp8Kernels&, const GemvActivations&, const void*, int64_t, const Fp8Operand&, \
                             int64_t, int64_t, T*, int64_t);
LOWBIT_INSTANTIATE(float)
LOWBIT_INSTANTIATE(c10::BFloat16)
LOWBIT_INSTANTIATE(c10::Half)
#undef LOWBIT_INSTANTIATE

}  // namespace lowbit::cpu
