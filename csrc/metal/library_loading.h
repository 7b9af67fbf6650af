// How the mps launcher (mps_launcher.mm) loads one Metal library: its precompiled <name>.metallib where the build
// made one and it loads, else the embedded source. A metallib that exists but does not load (a file from another
// build, an OS that rejects it) must not take the Metal backend down with it: the source is compiled instead, and
// the report line (`python -m torch_lowbit.env`) says why. Portable C++, the Objective-C calls passed in, so that
// tests run it on Linux with stand-ins (torch_lowbit._C._metal_library_loading_check).
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "metal/metal_libraries.h"

namespace lowbit::metal {

std::string msl_name(uint32_t version);  // 301 -> "MSL 3.1"

// Each loader returns whether it loaded the library, writing the reason into `error` when not.
using LibraryLoader = std::function<bool(std::string& error)>;

// Loads `lib` (the metallib at metallib_path when metallib_exists, else or after its failure the source) and
// returns the report line: "<name>: metallib <path>", "<name>: source (MSL 3.1)", or "<name>: source (MSL 3.1);
// the metallib <path> failed to load: <why>". Throws, naming every failure, when the source does not compile.
std::string load_library(const MetalLibrary& lib, const std::string& metallib_path, bool metallib_exists,
                         const LibraryLoader& load_metallib, const LibraryLoader& compile_source);

}  // namespace lowbit::metal
