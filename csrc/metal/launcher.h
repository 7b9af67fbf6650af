// The launcher interface: "run kernel NAME with these buffers and scalars, this threadgroup memory, on this
// grid". Plans (plan_*.cpp) build a Dispatch and hand it to a Launcher; the MPS launcher (mps_launcher.mm)
// encodes it on PyTorch's current MPS stream, the emulator launcher (emu_launcher.cpp) runs the same kernel
// in the MSL emulator on CPU tensors. Nothing here knows which one runs.
#pragma once
#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "metal/limits.h"

namespace lowbit::metal {

struct Size3 {
  uint32_t x = 1, y = 1, z = 1;
};

enum class Access { Read, Write, ReadWrite };

// One [[buffer(i)]] argument: a tensor (device memory) or a small value passed by setBytes (`constant T&`).
struct Arg {
  const char* name;          // for error messages: "[[buffer(3)]] weight"
  at::Tensor tensor;         // undefined for a value argument
  std::vector<uint8_t> bytes;
  Access access = Access::Read;
  bool is_value() const { return !tensor.defined(); }
};

constexpr int kMaxThreadgroupMemory = 8;

struct Dispatch {
  std::string kernel;                     // host_name of the kernel in metal/*.metal
  Size3 threadgroups;                     // dispatchThreadgroups: threadgroups per grid
  Size3 threads;                          // threads per threadgroup
  std::array<size_t, kMaxThreadgroupMemory> threadgroup_memory{};  // bytes for [[threadgroup(i)]]
  std::vector<Arg> args;                  // args[i] binds to [[buffer(i)]]

  explicit Dispatch(std::string name) : kernel(std::move(name)) {}

  // A tensor argument. It must be contiguous; its storage offset is honoured by every launcher.
  Dispatch& buffer(const char* name, const at::Tensor& t, Access access = Access::Read) {
    TORCH_CHECK(t.is_contiguous(), "metal launcher: ", kernel, " buffer ", name, " must be contiguous");
    args.push_back(Arg{name, t, {}, access});
    return *this;
  }
  // A scalar or POD struct argument (`constant T& name [[buffer(i)]]`).
  template <class T>
  Dispatch& value(const char* name, const T& v) {
    static_assert(std::is_trivially_copyable_v<T>, "value arguments are copied bytewise");
    std::vector<uint8_t> b(sizeof(T));
    std::memcpy(b.data(), &v, sizeof(T));
    args.push_back(Arg{name, at::Tensor(), std::move(b), Access::Read});
    return *this;
  }
  Dispatch& grid(Size3 groups, Size3 per_group) {
    threadgroups = groups;
    threads = per_group;
    return *this;
  }
  Dispatch& shared_memory(int index, size_t bytes) {
    threadgroup_memory.at(index) = bytes;
    return *this;
  }
  std::string describe_buffers() const;  // "[[buffer(0)]] x, [[buffer(1)]] weight, ..."
};

// What the device can run, for plans that pick a kernel variant for newer GPUs. apple_family is N of
// MTLGPUFamilyAppleN (7 = M1, the floor of every portable kernel); msl_version is the Metal Shading Language
// version the library was built with, major * 100 + minor (301 = MSL 3.1).
struct DeviceCaps {
  uint32_t apple_family = 7;
  uint32_t msl_version = 301;
};

class Launcher {
 public:
  virtual ~Launcher() = default;
  virtual void run(const Dispatch& d) = 0;
  virtual DeviceCaps caps() const { return {}; }
  // The most threads per threadgroup `kernel`'s pipeline takes (maxTotalThreadsPerThreadgroup): Metal's 1024, or
  // less for a kernel that needs many registers. Plans size their threadgroups within it (Target::fits).
  virtual uint32_t max_threads_per_threadgroup(const std::string& /*kernel*/) { return kMaxThreadsPerThreadgroup; }
};

inline std::string Dispatch::describe_buffers() const {
  std::string s;
  for (size_t i = 0; i < args.size(); i++) {
    if (i) s += ", ";
    s += "[[buffer(" + std::to_string(i) + ")]] " + args[i].name;
  }
  return s;
}

}  // namespace lowbit::metal
