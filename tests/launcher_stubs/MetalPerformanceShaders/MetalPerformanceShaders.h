// Stub for the launcher check: torch's ATen/mps/MPSStream.h includes this header and names
// MPSCommandBuffer as a pointer type; mps_launcher.mm uses nothing from it.
#pragma once
#import <Metal/Metal.h>

@class MPSCommandBuffer;
