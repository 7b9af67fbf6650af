// Stub for the launcher check: torch's ATen/mps/MPSStream.h includes this header and names these
// classes as pointer types; mps_launcher.mm uses nothing from it.
#pragma once
#import <MetalPerformanceShaders/MetalPerformanceShaders.h>

@class MPSGraph;
@class MPSGraphExecutionDescriptor;
@class MPSGraphCompilationDescriptor;
