// The MPS launcher: runs a plan's Dispatch on PyTorch's current MPS stream, following PyTorch's own MPS
// op pattern (aten/src/ATen/native/mps/operations/*.mm): encode on the stream's command encoder inside
// dispatch_sync_with_rethrow on the stream's serial queue; never a private queue, a wait, a commit or an
// endEncoding (the stream owns the command buffer and coalesces our kernels with its own), nor a CPU copy.
// It also registers the five ops for the MPS dispatch key. macOS only (setup.py adds *.mm on darwin).
//
// Checked on Linux by tests/test_mps_launcher_check.py: clang compiles this file in Objective-C++ mode
// against tests/launcher_stubs/ (the Apple declarations used here) and the installed torch's own headers.
// Every Apple call below must therefore also be declared there, from Apple's documented signature.
#include <torch/library.h>
#include <torch/version.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>

#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>

#include "lowbit_metal_source.h"  // kLowbitMetalSource: every metal/*.metal, local includes inlined (setup.py)
#include "metal/planned_ops.h"

namespace lowbit::metal {
namespace {

// ---- what moved between torch versions ----
// dispatch_sync_with_rethrow (a TORCH_CHECK thrown inside a dispatch_sync block would otherwise unwind into
// libdispatch and std::terminate): declared in ATen/native/mps/OperationUtils.h (at::native::mps) up to
// torch 2.9, moved to ATen/mps/MPSStream.h (at::mps) by pytorch#167445 for 2.10. OperationUtils.h is not
// included here (it drags in MPSGraph and fmt and changes every release), so before 2.10 we define the
// same function ourselves.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10)
using at::mps::dispatch_sync_with_rethrow;
#else
void dispatch_sync_with_rethrow(dispatch_queue_t queue, void (^block)()) {
  __block std::exception_ptr error;
  dispatch_sync(queue, ^() {
    try {
      block();
    } catch (...) {
      error = std::current_exception();
    }
  });
  if (error) std::rethrow_exception(error);
}
#endif

// at::native::mps::getMTLBufferStorage (OperationUtils.h, every torch 2.x): the MPS allocator's data
// pointer of a storage *is* its id<MTLBuffer>. Same one-liner, without including OperationUtils.h.
inline id<MTLBuffer> getMTLBufferStorage(const at::TensorBase& t) {
  return __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
}

std::string describe(NSError* error) {
  return error == nil ? std::string("unknown error") : std::string([[error localizedDescription] UTF8String]);
}

// The kernels, compiled once per process from the embedded source, and one pipeline state per kernel
// name, created on first use. Both are guarded by one mutex: ops may be called from several threads.
class KernelCache {
 public:
  static KernelCache& get() {
    static KernelCache* cache = new KernelCache();  // never destroyed: pipelines live as long as the process
    return *cache;
  }

  id<MTLComputePipelineState> pipeline(const std::string& name) {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = pipelines_.find(name);
    if (it != pipelines_.end()) return it->second;
    id<MTLLibrary> lib = library();
    id<MTLFunction> fn = [lib newFunctionWithName:[NSString stringWithUTF8String:name.c_str()]];
    TORCH_CHECK(fn != nil, "torch_lowbit mps: no kernel named '", name, "' in metal/*.metal");
    NSError* error = nil;
    id<MTLComputePipelineState> pso = [device_ newComputePipelineStateWithFunction:fn error:&error];
    [fn release];
    TORCH_CHECK(pso != nil, "torch_lowbit mps: cannot create the pipeline of '", name, "': ", describe(error));
    pipelines_.emplace(name, pso);
    return pso;
  }

 private:
  KernelCache() : device_(at::mps::MPSDevice::getInstance()->device()) {}

  // Called with mu_ held.
  id<MTLLibrary> library() {
    if (library_ != nil) return library_;
    MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
    // MSL 3.1 (macOS 14): the language every kernel is written and checked in (bfloat, simdgroup_matrix);
    // newer compilers accept it unchanged, so one language version serves every macOS.
    if (@available(macOS 14.0, *)) {
      options.languageVersion = MTLLanguageVersion3_1;
    } else {
      [options release];
      TORCH_CHECK(false, "torch_lowbit mps: the Metal kernels need macOS 14 or newer (Metal Shading Language 3.1)");
    }
    // IEEE math, not fast math: fp8 codes 0x7F / 0xFF must decode to NaN and propagate, fp16 outputs
    // overflow to inf, and the emulator that tests these kernels is strict IEEE. Fast math lets the
    // compiler assume no NaN / inf (folding 0 * x to 0, for one) and reassociate reductions. The kernels
    // are bandwidth- or MMA-bound, so it buys nothing measurable.
    if (@available(macOS 15.0, *)) {
      options.mathMode = MTLMathModeSafe;
    } else {
      options.fastMathEnabled = NO;
    }
    NSError* error = nil;
    library_ = [device_ newLibraryWithSource:[NSString stringWithUTF8String:kLowbitMetalSource]
                                     options:options
                                       error:&error];
    [options release];
    TORCH_CHECK(library_ != nil, "torch_lowbit mps: compiling metal/*.metal failed: ", describe(error));
    return library_;
  }

  std::mutex mu_;
  id<MTLDevice> device_;
  id<MTLLibrary> library_ = nil;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
};

MTLSize mtl_size(const Size3& s) {
  return MTLSizeMake(s.x, s.y, s.z);
}

}  // namespace

class MpsLauncher final : public Launcher {
 public:
  void run(const Dispatch& d) override {
    if (uint64_t(d.threadgroups.x) * d.threadgroups.y * d.threadgroups.z == 0) return;
    for (const Arg& a : d.args) {
      TORCH_CHECK(a.is_value() || a.tensor.is_mps(), "torch_lowbit mps: ", d.kernel, " buffer ", a.name,
                  " must be on the mps device, got ", a.tensor.device());
      TORCH_CHECK(!a.is_value() || a.bytes.size() <= 4096, "torch_lowbit mps: ", d.kernel, " value ", a.name,
                  " is larger than setBytes allows (4 KB)");
    }
    id<MTLComputePipelineState> pso = KernelCache::get().pipeline(d.kernel);
    const uint64_t threads = uint64_t(d.threads.x) * d.threads.y * d.threads.z;
    TORCH_CHECK(threads <= pso.maxTotalThreadsPerThreadgroup, "torch_lowbit mps: ", d.kernel, " asks for ", threads,
                " threads per threadgroup; this pipeline allows ", uint64_t(pso.maxTotalThreadsPerThreadgroup));
    const Dispatch* dp = &d;  // the block runs synchronously, before run() returns
    at::mps::MPSStream* stream = at::mps::getCurrentMPSStream();
    dispatch_sync_with_rethrow(stream->queue(), ^() {
      @autoreleasepool {
        id<MTLComputeCommandEncoder> enc = stream->commandEncoder();
        [enc setComputePipelineState:pso];
        for (size_t i = 0; i < dp->args.size(); i++) {
          const Arg& a = dp->args[i];
          if (a.is_value()) {
            [enc setBytes:a.bytes.data() length:a.bytes.size() atIndex:i];
          } else if (a.tensor.numel() == 0) {
            [enc setBuffer:nil offset:0 atIndex:i];  // an empty tensor may have no storage; never read
          } else {
            [enc setBuffer:getMTLBufferStorage(a.tensor)
                    offset:a.tensor.storage_offset() * a.tensor.element_size()
                   atIndex:i];
          }
        }
        for (int i = 0; i < kMaxThreadgroupMemory; i++) {
          if (dp->threadgroup_memory[i] != 0) {
            // Metal wants a multiple of 16 bytes
            [enc setThreadgroupMemoryLength:(dp->threadgroup_memory[i] + 15) / 16 * 16 atIndex:i];
          }
        }
        [enc dispatchThreadgroups:mtl_size(dp->threadgroups) threadsPerThreadgroup:mtl_size(dp->threads)];
      }
    });
  }
};

}  // namespace lowbit::metal

// ---- torch.ops.lowbit.* on the mps device: the same plans as the emulator, run by MpsLauncher ----
// HostVisible = false: plans must not read tensor values on the host (that would sync the device).
TORCH_LIBRARY_IMPL(lowbit, MPS, m) {
  lowbit::metal::PlannedOps<lowbit::metal::MpsLauncher, /*HostVisible=*/false>::register_all(m);
}
