// The CPU kernel sets: every inner loop of the CPU ops (fp8, int8 and 4-bit products, the transposed products' row
// loop, the read-bandwidth loop) for one instruction-set level, behind one struct of function pointers.
//
// The extension is compiled for the baseline of its platform (no -mavx2), so one build runs on every x86-64 and
// aarch64 CPU: a set's loops are compiled for their level (target attributes) and only called on a CPU that
// reports the set's required features. kernel_sets.cpp holds the one table of this build's sets and the one map
// from CPU features to the set that runs; the drivers call kernel_set(), never an instruction set by name.
//
// Layout (csrc/cpu/arch/): portable/ (plain loops, every CPU, and the tails of the vector loops), x86/ and arm/,
// one file per level. Adding a level: its file, defining `const KernelSet& kernel_set_<name>()`, and its line in
// the architecture's list in kernel_sets.cpp (plus a CpuFeature bit when it needs a new feature).
// Nothing under arch/ includes ATen or c10: the sets build without torch (tests/cpu_harness).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/arch/fp8_kernels.h"
#include "cpu/arch/int8_kernels.h"
#include "cpu/arch/w4_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#define LOWBIT_X86 1
#else
#define LOWBIT_X86 0
#endif
#if defined(__aarch64__) || defined(_M_ARM64)
#define LOWBIT_ARM 1
#else
#define LOWBIT_ARM 0
#endif

namespace lowbit::cpu {

// CPU features a kernel set may require (bits of KernelSet::required and cpu_features()).
enum CpuFeature : uint64_t {
  kFeatAvx2 = 1u << 0,  // with FMA and F16C: a CPU has all three or none in practice, and the set needs each
  kFeatAvxVnni = 1u << 1,
  // AVX-512 F, BW, VL, VNNI, VBMI and BF16 together: the AVX-512 set uses all of them
  kFeatAvx512 = 1u << 2,
  // AMX (tiles, BF16, INT8): Intel's server cores, whose tuned set prefers byte dot products to bf16 ones
  kFeatAmx = 1u << 3,
  kFeatDotprod = 1u << 8,  // Arm sdot / udot (FEAT_DotProd)
  kFeatI8mm = 1u << 9,     // Arm usdot / smmla (FEAT_I8MM)
  kFeatBf16 = 1u << 10,    // Arm bfdot / bfmmla (FEAT_BF16)
};

// acc[m * lda + p] += c[m] * v[p] for m < mr, p < n (the transposed products' row walk)
using AxpyRowsFn = void (*)(int64_t mr, const float* c, const float* v, int64_t n, float* acc, int64_t lda);
// xor of the n words at p (the streaming-read baseline; the value only keeps the reads from being skipped)
using XorWordsFn = uint64_t (*)(const uint64_t* p, int64_t n);
// The GEMMs' activation pack into VNNI units (fp8_matmul.cpp's Bf16Engine, int8_mm.cpp's strips), one block of
// kVnniPackRows rows of x and kVnniPackUnits VNNI units (4 bytes: a pair of bf16 codes, a quad of int8): unit j of
// row i, the 4 bytes at x + i * ldx + 4 j (ldx in bytes), goes to dst[to[j] * ldd + i]. A row of dst holds one
// unit of every activation row (brgemm.h's VNNI order).
constexpr int kVnniPackRows = 16, kVnniPackUnits = 32;
using VnniPackFn = void (*)(const void* x, int64_t ldx, const uint8_t* to, uint32_t* dst, int64_t ldd);
// Scales along K for the bf16 GEMM: K in segments of len positions (even), segment s of row i multiplied by
// scales[i][s].
struct Bf16Segments {
  int64_t len = 0;
  const float* const* scales = nullptr;
};
// The bf16 panel GEMM's product on CPUs without AMX (fp8_matmul.cpp's Bf16Engine; brgemm.h's operands):
// C[i * ldc + j] (+= where add) sum over k < K of A[i * lda + k] * B[(k / 2) * 2 * ldb + 2 * j + k % 2] for i < M,
// j < N: A row-major, B in VNNI pairs, bf16 bits, K even; with segs, scaled segment by segment as Bf16Segments
// says. Products exact, fp32 sums (a segment's sums scaled in fp32); bf16 denormals read as zero, as AMX reads them.
using Bf16GemmFn = void (*)(int64_t M, int64_t N, int64_t K, const uint16_t* A, int64_t lda, const uint16_t* B,
                            int64_t ldb, float* C, int64_t ldc, bool add, const Bf16Segments* segs);

struct KernelSet {
  const char* name;   // what tests, the bench's --isa and the environment report call it
  uint64_t required;  // CpuFeature bits the CPU must report
  Fp8Kernels fp8;
  Int8Kernels int8;
  W4Kernels w4;
  AxpyRowsFn axpy_rows;
  XorWordsFn xor_words;
  // Whether the GEMM regimes may hand their products to oneDNN's AMX brgemm (brgemm.h), where torch can pack
  // for it: a property of the set because the panels it packs for AMX come from its bf16 decode.
  bool amx_gemm;
  VnniPackFn vnni_pack;  // null: the callers pack with their scalar loops
  // null: without AMX the GEMM regimes decode fp32 panels into torch's fp32 GEMM (a set with one has a vnni_pack
  // and a bf16 panel decode)
  Bf16GemmFn bf16_gemm = nullptr;
  // CpuFeature bits of the CPUs the set is tuned for: elsewhere it runs only when a cap names it (tests), since
  // the same instructions are slower there. Not a requirement: the set's instructions are those of `required`.
  uint64_t preferred = 0;
  // The bf16 GEMM on AMX tiles (null: none, or the OS grants no tiles), for the products whose sums are scaled
  // segment by segment, which oneDNN's brgemm would write to memory for every segment: Bf16GemmFn's contract, run
  // only where amx_gemm_available() (brgemm.h). It leaves the thread's tile configuration changed: callers release
  // it before the thread's next brgemm (brgemm.h's AmxTileScope).
  Bf16GemmFn amx_bf16_gemm = nullptr;
};

// The features this CPU reports (CpuFeature bits).
uint64_t cpu_features();
inline bool cpu_supports(const KernelSet& s) { return (cpu_features() & s.required) == s.required; }
// Whether the set is tuned for this CPU (its `preferred` features are there).
inline bool cpu_prefers(const KernelSet& s) { return (cpu_features() & s.preferred) == s.preferred; }

// Every set this build has, in order of preference: portable first, then this architecture's levels.
const std::vector<const KernelSet*>& kernel_sets();
// The set the kernels use now: the set the cap names where the CPU supports it, else the last set before it that
// the CPU supports and prefers (without a cap: the last such set of kernel_sets()).
const KernelSet& kernel_set();
// Cap the sets at the one named `name` ("best": no cap), a test switch. Returns the previous cap's name ("best"
// for none), or nullptr (the cap unchanged) where this build has no set of that name.
const char* cap_kernel_set(const std::string& name);

}  // namespace lowbit::cpu
