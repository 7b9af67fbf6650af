#include "metal/library_loading.h"

#include <c10/util/Exception.h>

namespace lowbit::metal {

std::string msl_name(uint32_t version) {
  return "MSL " + std::to_string(version / 100) + "." + std::to_string(version % 100);
}

std::string load_library(const MetalLibrary& lib, const std::string& metallib_path, bool metallib_exists,
                         const LibraryLoader& load_metallib, const LibraryLoader& compile_source) {
  const std::string name(lib.name);
  std::string metallib_failure;
  if (metallib_exists) {
    std::string error;
    if (load_metallib(error)) return name + ": metallib " + metallib_path;
    metallib_failure = "the metallib " + metallib_path + " failed to load: " + error;
  }
  std::string error;
  TORCH_CHECK(compile_source(error), "torch_lowbit mps: compiling the ", name, " kernels (", msl_name(lib.msl_version),
              ") failed: ", error, metallib_failure.empty() ? "" : "; before that, ", metallib_failure);
  const std::string how = name + ": source (" + msl_name(lib.msl_version) + ")";
  return metallib_failure.empty() ? how : how + "; " + metallib_failure;
}

}  // namespace lowbit::metal
