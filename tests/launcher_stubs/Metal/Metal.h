// Stub of Metal for the launcher check (tests/test_mps_launcher_check.py). Declares exactly what
// csrc/metal/mps_launcher.mm uses, each as in Apple's Metal documentation (Objective-C declarations,
// quoted above each), plus opaque forward declarations of the types torch's ATen/mps headers mention.
#pragma once
#import <Foundation/Foundation.h>

#pragma clang assume_nonnull begin  // NS_ASSUME_NONNULL_BEGIN, as in Apple's headers

// typedef struct { NSUInteger width, height, depth; } MTLSize;
typedef struct {
  NSUInteger width, height, depth;
} MTLSize;
// MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth);
static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize s = {width, height, depth};
  return s;
}

// typedef NS_ENUM(NSUInteger, MTLLanguageVersion) { ... MTLLanguageVersion3_1 = (3 << 16) + 1 ... };
typedef enum : NSUInteger {
  MTLLanguageVersion3_1 API_AVAILABLE(macos(14.0)) = (3 << 16) + 1,
} MTLLanguageVersion;

#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000  // new in the macOS 15 SDK
// typedef NS_ENUM(NSInteger, MTLMathMode) { MTLMathModeSafe = 0, MTLMathModeRelaxed = 1, MTLMathModeFast = 2 };
typedef enum : NSInteger {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
} MTLMathMode;
// typedef NS_ENUM(NSInteger, MTLMathFloatingPointFunctions) { MTLMathFloatingPointFunctionsFast = 0,
//                                                            MTLMathFloatingPointFunctionsPrecise = 1 };
typedef enum : NSInteger {
  MTLMathFloatingPointFunctionsFast = 0,
  MTLMathFloatingPointFunctionsPrecise = 1,
} MTLMathFloatingPointFunctions;
#define LOWBIT_STUB_FAST_MATH_DEPRECATED __attribute__((deprecated("Use mathMode instead")))
#else
#define LOWBIT_STUB_FAST_MATH_DEPRECATED
#endif

// @interface MTLCompileOptions : NSObject <NSCopying>
//   @property (readwrite, nonatomic) MTLLanguageVersion languageVersion;
//   @property (readwrite, nonatomic) BOOL fastMathEnabled
//       API_DEPRECATED("Use mathMode instead", macos(10.11, 15.0));   (so marked from the macOS 15 SDK)
//   @property (readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0));
//   @property (readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions API_AVAILABLE(macos(15.0));
@interface MTLCompileOptions : NSObject
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@property(readwrite, nonatomic) BOOL fastMathEnabled LOWBIT_STUB_FAST_MATH_DEPRECATED;
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 150000
@property(readwrite, nonatomic) MTLMathMode mathMode API_AVAILABLE(macos(15.0));
@property(readwrite, nonatomic) MTLMathFloatingPointFunctions mathFloatingPointFunctions API_AVAILABLE(macos(15.0));
#endif
@end

// typedef NS_ENUM(NSInteger, MTLGPUFamily) { ... MTLGPUFamilyApple7 = 1007, MTLGPUFamilyApple8 = 1008,
//   MTLGPUFamilyApple9 = 1009 (both SDKs), MTLGPUFamilyApple10 = 1010 (the macOS 26 SDK) ... };
typedef enum : NSInteger {
  MTLGPUFamilyApple7 = 1007,
  MTLGPUFamilyApple8 = 1008,
  MTLGPUFamilyApple9 = 1009,
#if __MAC_OS_X_VERSION_MAX_ALLOWED >= 260000
  MTLGPUFamilyApple10 = 1010,
#endif
} MTLGPUFamily;

// @protocol MTLBuffer <MTLResource>: bound by setBuffer:offset:atIndex:, no members used
@protocol MTLBuffer <NSObject>
@end

// @protocol MTLFunction <NSObject>: no members used
@protocol MTLFunction <NSObject>
@end

// @protocol MTLLibrary <NSObject>
//   - (nullable id <MTLFunction>)newFunctionWithName:(NSString *)functionName;
//   @property (readonly) NSArray <NSString *> *functionNames;
@protocol MTLLibrary <NSObject>
- (nullable id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@property(readonly) NSArray<NSString*>* functionNames;
@end

// @protocol MTLComputePipelineState <NSObject>
//   @property (readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@end

// @protocol MTLDevice <NSObject>
//   @property (nonnull, readonly) NSString *name;
//   - (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily API_AVAILABLE(macos(10.15));
//   - (nullable id <MTLLibrary>)newLibraryWithURL:(NSURL *)url error:(__autoreleasing NSError **)error;
//   - (nullable id <MTLLibrary>)newLibraryWithSource:(NSString *)source options:(nullable MTLCompileOptions *)options
//                                              error:(__autoreleasing NSError **)error;
//   - (nullable id <MTLComputePipelineState>)newComputePipelineStateWithFunction:(id <MTLFunction>)computeFunction
//                                                                          error:(__autoreleasing NSError **)error;
@protocol MTLDevice <NSObject>
@property(nonnull, readonly) NSString* name;
- (BOOL)supportsFamily:(MTLGPUFamily)gpuFamily API_AVAILABLE(macos(10.15));
- (nullable id<MTLLibrary>)newLibraryWithURL:(NSURL*)url error:(__autoreleasing NSError**)error;
- (nullable id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                                        options:(nullable MTLCompileOptions*)options
                                          error:(__autoreleasing NSError**)error;
- (nullable id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                                      error:(__autoreleasing NSError**)error;
@end

// @protocol MTLCommandEncoder <NSObject>: no members used (never endEncoding: the stream owns the encoder)
@protocol MTLCommandEncoder <NSObject>
@end

// @protocol MTLComputeCommandEncoder <MTLCommandEncoder>
//   - (void)setComputePipelineState:(id <MTLComputePipelineState>)state;
//   - (void)setBytes:(const void *)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
//   - (void)setBuffer:(nullable id <MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
//   - (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
//   - (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setBuffer:(nullable id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

// Mentioned by torch's ATen/mps headers only (member types, typedefs): opaque here.
@protocol MTLCommandQueue;
@protocol MTLCommandBuffer;
@protocol MTLSharedEvent;
@protocol MTLArgumentEncoder;
typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

#pragma clang assume_nonnull end
