// The amx set: the avx512 set on a CPU whose tile unit this process may use (AMX-TILE and AMX-BF16, the OS's
// permission), with the batch-1 bf16 4-bit GEMV's products on the tiles (w4_avx512.cpp, amx_tiles.h). Its GEMMs
// are the avx512 set's, which reach AMX through torch's brgemm already.
#include "cpu/arch/kernel_set.h"

namespace lowbit::cpu {

extern const W4Kernels kW4KernelsAmx;  // w4_avx512.cpp
const KernelSet& kernel_set_avx512();

const KernelSet& kernel_set_amx() {
  static const KernelSet s = [] {
    KernelSet k = kernel_set_avx512();
    k.name = "amx";
    k.required |= kFeatAmx;
    k.w4 = kW4KernelsAmx;
    return k;
  }();
  return s;
}

}  // namespace lowbit::cpu
