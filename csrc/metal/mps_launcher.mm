// The MPS launcher: runs a plan's Dispatch on PyTorch's current MPS stream, following PyTorch's own MPS
// op pattern (aten/src/ATen/native/mps/operations/*.mm): encode on the stream's command encoder inside
// dispatch_sync_with_rethrow on the stream's serial queue; never a private queue, a wait, a commit or an
// endEncoding (the stream owns the command buffer and coalesces our kernels with its own), nor a CPU copy.
// It also registers every planned op (planned_ops.h) for the MPS dispatch key. macOS only (setup.py adds *.mm on darwin).
//
// Every Objective-C message below is sent inside an @autoreleasepool of its own function (as PyTorch's MPS ops
// do): the ops run on Python's threads and on the stream's queue, neither of which drains a pool for us, so an
// autoreleased NSString or NSError would otherwise live until the thread exits. tests/test_mps_launcher_check.py
// checks it.
//
// Checked on Linux by tests/test_mps_launcher_check.py: clang compiles this file in Objective-C++ mode
// against tests/launcher_stubs/ (the Apple declarations used here) and the installed torch's own headers.
// Every Apple call below must therefore also be declared there, from Apple's documented signature.
#include <torch/library.h>

#include <ATen/mps/MPSDevice.h>
#include <ATen/mps/MPSStream.h>

#import <Foundation/Foundation.h>
#import <Metal/Metal.h>
#include <Availability.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "lowbit_metal_libraries.h"  // kLowbitMetalLibraries: each library's embedded source (setup.py)
#include "metal/library_loading.h"
#include "metal/mps_info.h"
#include "metal/planned_ops.h"

// ---- the SDK this file is compiled against ----
// `@available` checks the OS at run time only; a name that an older SDK does not declare must also be hidden
// from the compiler. __MAC_OS_X_VERSION_MAX_ALLOWED is the SDK's macOS version (Availability.h).
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
#define LOWBIT_SDK_MACOS_15 1  // MTLCompileOptions.mathMode / mathFloatingPointFunctions
#else
#define LOWBIT_SDK_MACOS_15 0
#endif
#if defined(__MAC_OS_X_VERSION_MAX_ALLOWED) && __MAC_OS_X_VERSION_MAX_ALLOWED >= 260000
#define LOWBIT_SDK_MACOS_26 1  // MTLGPUFamilyApple10
#else
#define LOWBIT_SDK_MACOS_26 0
#endif

namespace lowbit::metal {
namespace {

// A TORCH_CHECK thrown inside a dispatch_sync block would unwind into libdispatch and std::terminate: catch
// it in the block, rethrow it after. torch has the same function (at::mps::dispatch_sync_with_rethrow), but
// declared without TORCH_API, and PyTorch has tried to hide such symbols before (pytorch#110793, #127265):
// our own copy, for every torch version.
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

// at::native::mps::getMTLBufferStorage (OperationUtils.h, every torch 2.x): the MPS allocator's data
// pointer of a storage *is* its id<MTLBuffer>. Same one-liner, without including OperationUtils.h.
inline id<MTLBuffer> getMTLBufferStorage(const at::TensorBase& t) {
  return __builtin_bit_cast(id<MTLBuffer>, t.storage().data());
}

std::string describe(NSError* error) {
  @autoreleasepool {
    return error == nil ? std::string("unknown error") : std::string([[error localizedDescription] UTF8String]);
  }
}

// The highest N with MTLGPUFamilyAppleN that the device supports (7 = M1 ... 10 = M5), 0 below M1.
uint32_t apple_family(id<MTLDevice> device) {
  @autoreleasepool {
  const std::pair<MTLGPUFamily, uint32_t> families[] = {
#if LOWBIT_SDK_MACOS_26
      {MTLGPUFamilyApple10, 10},
#endif
      {MTLGPUFamilyApple9, 9},
      {MTLGPUFamilyApple8, 8},
      {MTLGPUFamilyApple7, 7},
  };
  for (const auto& [family, n] : families) {
    if ([device supportsFamily:family]) return n;
  }
  return 0;
  }
}

bool macos_at_least(uint32_t major, uint32_t minor = 0) {
  @autoreleasepool {
    NSOperatingSystemVersion v = {NSInteger(major), NSInteger(minor), 0};
    return [[NSProcessInfo processInfo] isOperatingSystemAtLeastVersion:v];
  }
}

// The directory of the loaded torch_lowbit._C, where the build installs the .metallib files.
std::string extension_dir() {
  Dl_info info{};
  if (dladdr(reinterpret_cast<const void*>(&extension_dir), &info) == 0 || info.dli_fname == nullptr) return ".";
  const std::string path(info.dli_fname);
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

MTLCompileOptions* compile_options(const MetalLibrary& lib) {  // owned by the caller (+1)
  @autoreleasepool {
  MTLCompileOptions* options = [[MTLCompileOptions alloc] init];
  // Apple's encoding of MTLLanguageVersion: (major << 16) + minor. macos_at_least(lib.macos) was checked.
  options.languageVersion = MTLLanguageVersion(((lib.msl_version / 100) << 16) + lib.msl_version % 100);
  // IEEE arithmetic and the precise fp32 math functions, as PyTorch's own MetalShaderLibrary sets them (mathMode
  // + mathFloatingPointFunctions from macOS 15, fastMathEnabled before): fp8 codes 0x7F / 0xFF must decode to
  // NaN and propagate, fp16 outputs overflow to inf, and the emulator that tests these kernels is strict IEEE.
  // Fast math lets the compiler assume no NaN / inf (folding 0 * x to 0) and reassociate reductions; the
  // kernels are bandwidth- or MMA-bound, so it buys nothing measurable. setup.py's metallib: -fno-fast-math.
#if LOWBIT_SDK_MACOS_15
  if (@available(macOS 15.0, *)) {
    options.mathMode = MTLMathModeSafe;
    options.mathFloatingPointFunctions = MTLMathFloatingPointFunctionsPrecise;
    return options;
  }
#endif
#pragma clang diagnostic push
#pragma clang diagnostic ignored "-Wdeprecated-declarations"  // deprecated by the macOS 15 SDK, the switch before it
  options.fastMathEnabled = NO;
#pragma clang diagnostic pop
  return options;
  }
}

// The libraries of kLowbitMetalLibraries that this device may run, loaded once per process (a precompiled
// .metallib beside the extension if the build made one, else the embedded source), and one pipeline state per
// kernel name, created on first use. Guarded by one mutex: ops may be called from several threads.
class KernelCache {
 public:
  static KernelCache& get() {
    static KernelCache* cache = new KernelCache();  // never destroyed: pipelines live as long as the process
    return *cache;
  }

  id<MTLComputePipelineState> pipeline(const std::string& name) {
    std::lock_guard<std::mutex> guard(mu_);
    return pipeline_locked(name);
  }

  // The pipeline's maxTotalThreadsPerThreadgroup (Launcher::max_threads_per_threadgroup)
  uint32_t max_threads(const std::string& name) {
    std::lock_guard<std::mutex> guard(mu_);
    pipeline_locked(name);
    return max_threads_.at(name);
  }

  DeviceCaps caps() {
    std::lock_guard<std::mutex> guard(mu_);
    load_libraries();
    return caps_;
  }

  // For the env report: loads the libraries and creates every kernel's pipeline, to list each one's limit.
  MpsInfo info() {
    @autoreleasepool {
      std::lock_guard<std::mutex> guard(mu_);
      MpsInfo out;
      out.gpu = device_ == nil ? std::string("none") : std::string([[device_ name] UTF8String]);
      try {
        load_libraries();
        for (id<MTLLibrary> lib : libraries_) {
          NSArray<NSString*>* names = [lib functionNames];
          for (NSUInteger i = 0; i < [names count]; i++) {
            const std::string name([[names objectAtIndex:i] UTF8String]);
            pipeline_locked(name);
            out.pipelines.emplace_back(name, max_threads_.at(name));
          }
        }
      } catch (const std::exception& e) {
        out.libraries.push_back(std::string("failed: ") + e.what());
      }
      out.caps = caps_;
      out.libraries.insert(out.libraries.end(), loaded_how_.begin(), loaded_how_.end());
      return out;
    }
  }

 private:
  KernelCache() : device_(at::mps::MPSDevice::getInstance()->device()) {
    caps_.apple_family = apple_family(device_);
  }

  // Called with mu_ held.
  id<MTLComputePipelineState> pipeline_locked(const std::string& name) {
    auto it = pipelines_.find(name);
    if (it != pipelines_.end()) return it->second;
    load_libraries();
    @autoreleasepool {
      NSString* ns_name = [NSString stringWithUTF8String:name.c_str()];
      id<MTLFunction> fn = nil;
      for (size_t i = 0; i < libraries_.size() && fn == nil; i++) fn = [libraries_[i] newFunctionWithName:ns_name];
      TORCH_CHECK(fn != nil, "torch_lowbit mps: no kernel named '", name, "' in the libraries loaded (",
                  c10::Join(", ", loaded_how_), ")");
      NSError* error = nil;
      id<MTLComputePipelineState> pso = [device_ newComputePipelineStateWithFunction:fn error:&error];
      [fn release];
      TORCH_CHECK(pso != nil, "torch_lowbit mps: cannot create the pipeline of '", name, "': ", describe(error));
      pipelines_.emplace(name, pso);
      max_threads_.emplace(name, uint32_t([pso maxTotalThreadsPerThreadgroup]));
      return pso;
    }
  }

  // Called with mu_ held. All or nothing: a library that fails throws, and the next call tries again.
  void load_libraries() {
    if (!libraries_.empty()) return;
    std::vector<id<MTLLibrary>> libs;
    std::vector<std::string> how;
    uint32_t msl = 0;
    try {
      for (const MetalLibrary& lib : kLowbitMetalLibraries) {
        const bool portable = &lib == &kLowbitMetalLibraries[0];
        std::string why_not;
        if (caps_.apple_family < lib.apple_family) {
          why_not = "needs MTLGPUFamilyApple" + std::to_string(lib.apple_family) + ", this GPU is Apple" +
                    std::to_string(caps_.apple_family);
        } else if (!macos_at_least(lib.macos, lib.macos_minor)) {
          why_not = "needs macOS " + std::to_string(lib.macos) + "." + std::to_string(lib.macos_minor) + " (" +
                    msl_name(lib.msl_version) + ")";
        } else if (lib.msl_version >= kTensorOpsDevice.msl_version && tensor_ops_disabled()) {
          why_not = "TORCH_LOWBIT_NO_MPP=1";
        }
        TORCH_CHECK(!portable || why_not.empty(), "torch_lowbit mps: the Metal kernels cannot run here: ", why_not);
        if (!why_not.empty()) {
          how.push_back(std::string(lib.name) + ": not loaded (" + why_not + ")");
          continue;
        }
        if (portable) {
          libs.push_back(load(lib, how));
        } else {
          // a variant that fails to build or load leaves the portable kernels running, and says why
          try {
            libs.push_back(load(lib, how));
          } catch (const std::exception& e) {
            how.push_back(std::string(lib.name) + ": failed, the portable kernels run instead (" + e.what() + ")");
            continue;
          }
        }
        msl = std::max(msl, lib.msl_version);
      }
    } catch (...) {
      @autoreleasepool {
        for (id<MTLLibrary> l : libs) [l release];
      }
      throw;
    }
    libraries_ = std::move(libs);
    loaded_how_ = std::move(how);
    caps_.msl_version = msl;
  }

  // The precompiled metallib if it loads, else the embedded source (library_loading.h says how and why).
  id<MTLLibrary> load(const MetalLibrary& lib, std::vector<std::string>& how) {
    @autoreleasepool {
      const std::string path = extension_dir() + "/" + lib.name + ".metallib";
      id<MTLLibrary> l = nil;
      how.push_back(load_library(
          lib, path, access(path.c_str(), R_OK) == 0,
          [&](std::string& why) {
            NSError* error = nil;
            l = [device_ newLibraryWithURL:[NSURL fileURLWithPath:[NSString stringWithUTF8String:path.c_str()]]
                                     error:&error];
            if (l == nil) why = describe(error);
            return l != nil;
          },
          [&](std::string& why) {
            NSError* error = nil;
            MTLCompileOptions* options = compile_options(lib);
            l = [device_ newLibraryWithSource:[NSString stringWithUTF8String:lib.source] options:options error:&error];
            [options release];
            if (l == nil) why = describe(error);
            return l != nil;
          }));
      return l;
    }
  }

  std::mutex mu_;
  id<MTLDevice> device_;
  DeviceCaps caps_;
  std::vector<id<MTLLibrary>> libraries_;  // in kLowbitMetalLibraries order, those this device may run
  std::vector<std::string> loaded_how_;
  std::unordered_map<std::string, id<MTLComputePipelineState>> pipelines_;
  std::unordered_map<std::string, uint32_t> max_threads_;  // each pipeline's maxTotalThreadsPerThreadgroup
};

MpsInfo mps_info() {
  return KernelCache::get().info();
}
[[maybe_unused]] const bool kInfoProviderSet = (mps_info_provider() = &mps_info, true);

MTLSize mtl_size(const Size3& s) {
  return MTLSizeMake(s.x, s.y, s.z);
}

}  // namespace

class MpsLauncher final : public Launcher {
 public:
  DeviceCaps caps() const override { return KernelCache::get().caps(); }
  uint32_t max_threads_per_threadgroup(const std::string& kernel) override {
    return KernelCache::get().max_threads(kernel);
  }

  void run(const Dispatch& d) override {
    if (uint64_t(d.threadgroups.x) * d.threadgroups.y * d.threadgroups.z == 0) return;
    for (const Arg& a : d.args) {
      TORCH_CHECK(a.is_value() || a.tensor.is_mps(), "torch_lowbit mps: ", d.kernel, " buffer ", a.name,
                  " must be on the mps device, got ", a.tensor.device());
      TORCH_CHECK(!a.is_value() || a.bytes.size() <= 4096, "torch_lowbit mps: ", d.kernel, " value ", a.name,
                  " is larger than setBytes allows (4 KB)");
    }
    // (Target::run checked the threads against this pipeline's maxTotalThreadsPerThreadgroup)
    id<MTLComputePipelineState> pso = KernelCache::get().pipeline(d.kernel);
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
