// The inner loops of the 4-bit weight x float activation products (w4_mm, w4_mm_t, w4_dequantize), a table of
// function pointers in every kernel set (kernel_set.h); w4_matmul.cpp drives them. Kernels see a format only as
// its 16 code values, its scale encoding and its offset kind (w4_formats.h), never by name.
//
// Every weight is decoded exactly per element, in fp32, as the contract says: each group's 16 possible weights
// are a table (value * scale, (value - zero point) * scale, or value * scale + bias, rounded as those fp32
// expressions are), and a code picks its entry -- the same bits as decoding element by element. The global scale
// and the output bias are applied by the driver after the K reduction. The one exception, the bf16-activation
// GEMV (gemv_rows_bf16), scales each group's fp32 sum of x * value once, as fp8's block scales are, and adds the
// group's zero point or bias times the group's sum of x: the same value up to fp32 rounding. Where the float64 sum
// has infinite terms it may differ in kind: an inf scale gives its column inf where float64 has NaN (terms of both
// signs), and an infinite x times a code of value 0 gives NaN where a zero point or bias made that weight nonzero.
//
// Packed order: K is cut into chunks of kW4Chunk codes (16 bytes of codes); in each chunk the 16 even codes come
// first, then the 16 odd ones -- the order in which a byte's low and high nibbles come out of a vector decode.
// Activations are packed once per call in this order, zero padded to whole chunks; the decoded GEMM panels use it
// too. Decoded positions past K are zero (a padded code with an inf / NaN table entry would otherwise give NaN).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "w4_formats.h"

namespace lowbit::cpu {

// One [N, K] 4-bit weight as the kernels read it (plain pointers: the sets build without torch).
struct W4Operand {
  const uint8_t* codes = nullptr;  // [N, ceil(K/2)]
  const void* scale = nullptr;     // [N, G] in scale_enc
  W4Scale scale_enc = W4Scale::F32;
  const void* offset = nullptr;    // [N, G]: int8 zero points or biases in scale_enc; null for none
  W4Offset offset_kind = W4Offset::None;
  const float* values = nullptr;   // the format's 16 code values
  int64_t N = 0, K = 0, group = 1, G = 0;
  float global = 1.f;              // the per-tensor multiplier (1 where the format has none)
  const float* bias = nullptr;     // fp32 [N] (w4_mm only)
  int64_t row_bytes() const { return (K + 1) / 2; }
};

constexpr int64_t kW4Chunk = 32;
inline int64_t w4_padded(int64_t K) { return (K + kW4Chunk - 1) / kW4Chunk * kW4Chunk; }
// The packed position of code k (see above).
constexpr int64_t w4_packed_pos(int64_t k) { return (k & ~int64_t(31)) | ((k & 1) << 4) | ((k & 31) >> 1); }

// bf16 activations (bf16 x, where the set has a bf16 tile for the weight): K in steps of 128 codes, 64 bytes of
// codes; step position 32 j + i holds code 4 i + j, the j-th nibble of the step's 16-bit word i, so that one
// shift and one 16-bit permute per j decode a whole step without widening the bytes.
constexpr int64_t kW4Bf16Step = 128;
inline int64_t w4_bf16_padded(int64_t K) { return (K + kW4Bf16Step - 1) / kW4Bf16Step * kW4Bf16Step; }
constexpr int64_t w4_bf16_pos(int64_t k) { return (k & ~int64_t(127)) | ((k & 3) << 5) | ((k & 127) >> 2); }
// How many fp32 group sums of x follow a packed bf16 row for a weight with offsets (W4Kernels::gemv_rows_bf16): one
// per group, zero padded to whole 16s (the tile reads them 16 groups at a time).
inline int64_t w4_bf16_group_sums(const W4Operand& op) { return ((op.G > 1 ? op.G : 1) + 15) / 16 * 16; }

// The fp32 group sums a packed bf16 row of x carries for op: w4_bf16_group_sums for weights with zero points or
// biases, none otherwise.
inline int64_t w4_bf16_row_group_sums(const W4Operand& op) {
  return op.offset != nullptr && op.offset_kind != W4Offset::None ? w4_bf16_group_sums(op) : 0;
}

// bf16 x as signed-byte digit planes (W4Kernels::pack_plane_steps), for cores whose byte dot products (vpdpbusd) issue
// several times as often as their bf16 ones (vdpbf16ps). Each step of 128 values of x is an integer vector times a
// power of two: i_k = x_k / 2^e, e the ulp of the step's smallest nonzero value, and each i_k is three digits in
// [-128, 127], i = d2 * 2^16 + d1 * 2^8 + d0. A code is a byte u_c = mul * value_c + off (W4PlaneCodes). Per 32-bit
// lane (codes 8 l .. 8 l + 7 of the step), the byte dot products of the codes with the digit planes, combined by
// shifts (d2, then d1, then d0), are the exact integer sum u_k i_k, at most 31 * 8 * 2^23 < 2^31; less off times the
// lane's sum of i_k it is sum (u_k - off) i_k, and times 2^e / mul the lane's sum of x * value, rounded once to
// fp32. A step is exact where its values are finite, the nonzero exponents span at most 15 binades (so the digits
// hold every i_k) and 2^e is a normal float well above the underflow; the other steps take the bf16 step. bf16
// denormals count as zero, as vdpbf16ps reads them. After a packed bf16 row and its group sums: one W4PlaneStep a
// step.
struct W4PlaneStep {
  int8_t digits[3][2][64];  // [d2, d1, d0][even, odd code]: byte j of a half is the digit of code 2 j (+ 1)
  int32_t lane_sums[16];    // lane l: the sum of i_k over codes 8 l .. 8 l + 7
  float scale;              // 2^e
  int32_t exact;            // 0: the step takes the bf16 step (its digits, sums and scale are not used)
  int32_t pad[14];
};
static_assert(sizeof(W4PlaneStep) == 512, "a plane step is eight cache lines");
// Where a packed row's planes start (words): after its w4_bf16_padded(K) bf16 words and group_sums fp32 sums. The
// pack writes them there and the GEMV reads them there.
inline int64_t w4_plane_steps_at(int64_t K, int64_t group_sums) { return w4_bf16_padded(K) + 2 * group_sums; }
inline int64_t w4_plane_steps_bytes(int64_t K) {
  return w4_bf16_padded(K) / kW4Bf16Step * int64_t(sizeof(W4PlaneStep));
}
constexpr int32_t kW4PlaneMax = 127 * 65536 + 127 * 256 + 127;  // the largest integer three digits hold
constexpr int kW4PlaneMinExponent = -120;  // the smallest e of an exact step: 2^e / mul is a normal float

// A step's digits and sums for values x[0 .. valid) (bf16 bits, natural order; zero past valid): the scalar
// definition, which the vector packs must match bit for bit.
inline void w4_plane_step(const uint16_t* x, int64_t valid, W4PlaneStep& st) {
  std::memset(&st, 0, sizeof st);
  int emin = 255, emax = 0;
  bool finite = true;
  for (int64_t k = 0; k < valid && k < kW4Bf16Step; k++) {
    const int e = (x[k] >> 7) & 0xFF;
    if (e == 255) finite = false;
    if (e == 0 || e == 255) continue;
    emin = e < emin ? e : emin;
    emax = e > emax ? e : emax;
  }
  st.scale = 1.f;
  if (emax == 0) {  // zeros (and denormals) only
    st.exact = finite;
    return;
  }
  const int ulp = emin - 127 - 7;
  bool exact = finite && emax - emin <= 15 && ulp >= kW4PlaneMinExponent;
  int32_t sums[16] = {};
  for (int64_t k = 0; k < valid && k < kW4Bf16Step && exact; k++) {
    const int e = (x[k] >> 7) & 0xFF;
    if (e == 0) continue;
    int32_t i = int32_t((x[k] & 0x7F) | 0x80) << (e - emin);
    if (x[k] & 0x8000) i = -i;
    if (i > kW4PlaneMax) exact = false;
    const int32_t d0 = ((i + 128) & 255) - 128, i1 = (i - d0) >> 8;
    const int32_t d1 = ((i1 + 128) & 255) - 128, d2 = (i1 - d1) >> 8;
    const int32_t d[3] = {d2, d1, d0};
    for (int p = 0; p < 3; p++) st.digits[p][k & 1][k >> 1] = int8_t(d[p]);
    sums[k >> 3] += i;
  }
  if (!exact) {
    std::memset(&st, 0, sizeof st);
    st.scale = 1.f;
    return;
  }
  std::memcpy(st.lane_sums, sums, sizeof sums);
  st.scale = std::ldexp(1.f, ulp);
  st.exact = 1;
}

// How a weight's codes enter the byte dot products: u_c = mul * value_c + off, all in [0, 31], mul a power of two
// (int4: u = c, off 8; uint4: u = c; E2M1: u = 2 v + 12). Formats whose values are not such integers keep the
// bf16 step.
struct W4PlaneCodes {
  uint8_t u[16] = {};
  int32_t off = 0;
  float inv_mul = 1.f;
  bool identity = false;  // u_c == c: no lookup
  bool ok = false;
};
inline W4PlaneCodes w4_plane_codes(const W4Operand& op) {
  W4PlaneCodes pc;
  for (int mul = 1; mul <= 8; mul *= 2) {
    float lo = 0.f;
    bool integral = true;
    for (int c = 0; c < 16; c++) {
      const float v = op.values[c] * float(mul);
      integral = integral && v == float(int(v)) && v >= -31.f && v <= 31.f;
      lo = v < lo ? v : lo;
    }
    if (!integral) continue;
    pc.off = int32_t(-lo);
    pc.inv_mul = 1.f / float(mul);
    pc.ok = true;
    pc.identity = true;
    for (int c = 0; c < 16; c++) {
      const int u = int(op.values[c] * float(mul)) + pc.off;
      if (u < 0 || u > 31) pc.ok = false;
      pc.u[c] = uint8_t(u);
      pc.identity = pc.identity && u == c;
    }
    return pc;
  }
  return pc;
}

// The weights a bf16 tile takes (W4Kernels::gemv_bf16_takes, every set with one): groups that are whole steps, the
// row, or 16, 32 or 64 codes (a step's sums scaled lane by lane), and code values exact in bf16 (int4, uint4, E2M1;
// an inexact table stays on the fp32 tiles).
inline bool w4_bf16_tile_takes(const W4Operand& op) {
  if (!(op.G <= 1 || op.group % kW4Bf16Step == 0 || op.group == 16 || op.group == 32 || op.group == 64)) return false;
  for (int i = 0; i < 16; i++) {
    uint32_t u;
    std::memcpy(&u, &op.values[i], 4);
    if (u & 0xFFFF) return false;
  }
  return true;
}

// One group's decode: w = (value - zp) * scale, or value * scale + bias where has_bias.
struct W4Group {
  float scale = 1.f, zp = 0.f, bias = 0.f;
  bool has_bias = false;
};

// Scales stored in one byte (E4M3, E8M0) decoded by a 256-entry table: a load instead of w4_scale_to_float's
// branches, once per group of 16 codes in the GEMV.
inline const float* w4_byte_scale_table(W4Scale enc) {
  struct Tables {
    float e4m3[256], e8m0[256];
    Tables() {
      for (int b = 0; b < 256; b++) {
        const uint8_t v = uint8_t(b);
        e4m3[b] = w4_scale_to_float(W4Scale::E4M3, &v, 0);
        e8m0[b] = w4_scale_to_float(W4Scale::E8M0, &v, 0);
      }
    }
  };
  static const Tables t;
  return enc == W4Scale::E4M3 ? t.e4m3 : enc == W4Scale::E8M0 ? t.e8m0 : nullptr;
}

// Group g of row n. byte_table: w4_byte_scale_table(op.scale_enc) (null for the float encodings).
inline W4Group w4_group(const W4Operand& op, const float* byte_table, int64_t n, int64_t g) {
  W4Group p;
  const int64_t i = n * op.G + g;
  p.scale = byte_table ? byte_table[static_cast<const uint8_t*>(op.scale)[i]] : w4_scale_to_float(op.scale_enc, op.scale, i);
  if (op.offset_kind == W4Offset::ZeroPoint && op.offset) p.zp = float(static_cast<const int8_t*>(op.offset)[i]);
  if (op.offset_kind == W4Offset::Bias && op.offset) {
    p.bias = w4_scale_to_float(op.scale_enc, op.offset, i);
    p.has_bias = true;
  }
  return p;
}

// The scalar decode of one value (portable kernels, tails). The product is stored through a volatile so that no
// compiler fuses value * scale + bias into one fma (the contract rounds the product first).
inline float w4_decode_value(float v, const W4Group& p) {
  if (!p.has_bias) return (v - p.zp) * p.scale;
  volatile float prod = v * p.scale;
  return prod + p.bias;
}

// Whether every block of 16 codes (chunk halves) lies in one group: group sizes that are multiples of 16, or one
// group per row. The vector sets decode such weights block by block; other group sizes take the portable loops.
inline bool w4_blocks_in_groups(const W4Operand& op) { return op.group % 16 == 0 || op.G <= 1; }

// Walks the blocks of 16 codes of a row from block b0 on, giving each block's group (w4_blocks_in_groups).
struct W4BlockGroups {
  int64_t per = 1, group = 0, left = 0;
  W4BlockGroups() = default;
  W4BlockGroups(const W4Operand& op, int64_t b0)
      : per(op.G <= 1 ? std::numeric_limits<int64_t>::max() : op.group / 16), group(b0 / per), left(per - b0 % per) {}
  // the group of the next block
  int64_t next() {
    if (left == 0) {
      group++;
      left = per;
    }
    left--;
    return group;
  }
};

// The vector sets' walk of one row's blocks of 16 codes in [k0, min(K, k0 + n)), k0 a multiple of 16
// (w4_blocks_in_groups): fn(k, valid, table) with the block's first code, the codes left in the range from it, and
// make_table(its group's W4Group), made again only when the group changes. Table: the set's register table type.
template <class Table, class MakeTable, class Fn>
inline __attribute__((always_inline)) void w4_for_each_block(const W4Operand& op, int64_t row, int64_t k0, int64_t n,
                                                             MakeTable&& make_table, Fn&& fn) {
  const float* byte_table = w4_byte_scale_table(op.scale_enc);
  W4BlockGroups blocks(op, k0 / 16);
  const int64_t k1 = op.K < k0 + n ? op.K : k0 + n;
  int64_t ga = -1;
  Table t{};
  for (int64_t k = k0; k < k1; k += 16) {
    const int64_t g = blocks.next();
    if (g != ga) t = make_table(w4_group(op, byte_table, row, g));
    ga = g;
    fn(k, k1 - k, t);
  }
}

// bf16 panels for the bf16 panel GEMMs (w4_matmul.cpp): decoded weights in natural order, each as `terms` bf16
// words whose sum approximates the fp32 decode -- term 0 its rounding to nearest even, term 1 (terms = 2) the
// rounding of the exact remainder w - term 0, so |w - t0 - t1| <= 2^-16 |w|. NaN: a quiet NaN (remainder 0);
// +-inf: inf (remainder 0); a finite value that would round to inf is truncated (stays finite). Subnormal
// results stay bf16 subnormals (AMX reads them as zero). Rows are zero padded to a multiple of kW4Bf16Chunk.
constexpr int64_t kW4Bf16Chunk = 64;
inline uint16_t w4_bf16_round(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if (f != f) return uint16_t((b >> 16) | 0x40);
  uint32_t r = (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
  if ((r & 0x7F80u) == 0x7F80u && (b & 0x7F800000u) != 0x7F800000u) r = b >> 16;
  return uint16_t(r);
}
inline float w4_bf16_float(uint16_t h) {
  const uint32_t b = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
// The bf16 remainder term of w given its first term hi (0 where w or hi is not finite).
inline uint16_t w4_bf16_remainder(float w, uint16_t hi) {
  const float h = w4_bf16_float(hi);
  return (w - w == 0.f && h - h == 0.f) ? w4_bf16_round(w - h) : uint16_t(0);
}

// One instantiation of a GEMV tile: W4Kernels::gemv_tile without the run-time (mr, nr) (pick_gemv_tile).
using W4GemvTileFn = void (*)(const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums);

struct W4Kernels {
  // sums[m * nr + r] = sum_k x[m * ldx + packed k] * w[n0 + r, k] for m < mr <= 4, r < nr <= 4 (no global scale).
  void (*gemv_tile)(int mr, int nr, const float* x, int64_t ldx, const W4Operand& op, int64_t n0, float* sums);
  // Rows [n0, n0 + nrows), codes [k0, k0 + n) (k0 a multiple of kW4Chunk) decoded into dst[r * ldd + p] at packed
  // positions p < w4_padded(n) relative to k0, zero past K.
  void (*decode_rows)(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n, float* dst, int64_t ldd);
  // Rows [n0, n0 + nrows), all K, in natural order: dst[r * ldd + k] (w4_dequantize, w4_mm_t's panels).
  void (*dequantize_rows)(const W4Operand& op, int64_t n0, int64_t nrows, float* dst, int64_t ldd);
  // gemv_tile's sums from bf16 activations packed by w4_bf16_pos (zero padded to w4_bf16_padded(K)), for weights
  // where gemv_bf16_takes(op), over a range of weight rows: sums[m * lds + n - n0] for m < mr <= 4 and n in
  // [n0, n1), in tiles of the set's choosing (one setup per range: a MoE expert's short rows made a per-tile setup
  // a fifth of the work); null where the set has no bf16 tile. Not exact per element as gemv_tile: each
  // group's sum of x * value is scaled once, and a group's offset multiplies the group's sum of x:
  // sum_g (scale_g * sum_{k in g} x_k * value_k + offset_g * X_g), fp32 accumulation, where offset_g is the bias
  // or -(zero point * scale). X_g, for weights with offsets: fp32 [w4_bf16_group_sums(op)] right after each row's
  // w4_bf16_padded(K) words (zero past the last group).
  bool (*gemv_bf16_takes)(const W4Operand& op) = nullptr;
  void (*gemv_rows_bf16)(int mr, const uint16_t* x, int64_t ldx, const W4Operand& op, int64_t n0, int64_t n1,
                         float* sums, int64_t lds) = nullptr;
  // Rows [n0, n0 + nrows), codes [k0, k0 + n) (k0 a multiple of kW4Chunk), each weight times op.global (an fp32
  // product: the weight w4_dequantize gives), as `terms` (1 or 2) bf16 words (see w4_bf16_round): term t of code k at dst[t * term_stride + r * ldd + k - k0], natural order, zero past K
  // and up to n rounded up to kW4Bf16Chunk. Null in sets without amx_gemm (nothing calls it there).
  void (*decode_rows_bf16)(const W4Operand& op, int64_t n0, int64_t nrows, int64_t k0, int64_t n, int terms,
                           uint16_t* dst, int64_t ldd, int64_t term_stride) = nullptr;
  // One row of gemv_rows_bf16's activations: x's K bf16 values in the bf16 order, zero padded to w4_bf16_padded(K)
  // words, then (group_sums > 0) the fp32 sum of x over each group of `group` codes, zero up to group_sums. Null: the
  // portable pack (w4_matmul.cpp), whose constant-order moves ran at about 1 ns a value.
  void (*pack_bf16_row)(const uint16_t* x, int64_t K, int64_t group, int64_t group_sums, uint16_t* dst) = nullptr;
  // Sets whose gemv_rows_bf16 reads digit planes (W4PlaneStep) right after each packed row's group sums (the row of
  // x is w4_plane_steps_bytes(K) longer): the planes of steps [s0, s1) of one row of x (K values, natural order)
  // into steps[s0 .. s1). Steps are independent, so a long row's are split among threads. Null: no planes.
  void (*pack_plane_steps)(const uint16_t* x, int64_t K, int64_t s0, int64_t s1, W4PlaneStep* steps) = nullptr;
};

// The portable kernels: every set's fallback for group sizes its vector loops do not take.
extern const W4Kernels kW4KernelsPortable;

}  // namespace lowbit::cpu
