// Metal's launch limits on every Apple GPU of the portable floor (M1 and later), in one place for the plans'
// shared check (plan_common.cpp) and the emulator's (csrc/emu/runtime.cpp). No dependencies: the emulator
// includes it without ATen.
#pragma once
#include <cstdint>

namespace lowbit::metal {

inline constexpr uint64_t kMaxThreadsPerThreadgroup = 1024;  // maxTotalThreadsPerThreadgroup
inline constexpr uint64_t kMaxThreadgroupMemoryBytes = 32768;  // static arrays + [[threadgroup(i)]], together
inline constexpr uint64_t kMaxSetBytesBytes = 4096;  // setBytes: larger values must be buffers
// thread_position_in_grid / threads_per_grid are 32-bit `uint`: threadgroups * threads per dimension must fit
inline constexpr uint64_t kMaxThreadsPerGridDim = uint64_t(1) << 32;

}  // namespace lowbit::metal
