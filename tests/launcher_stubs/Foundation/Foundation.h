// Stub of Foundation for the launcher check (tests/test_mps_launcher_check.py). Declares exactly what
// csrc/metal/mps_launcher.mm uses (plus the forward declarations torch's ATen/mps headers need), each as
// in Apple's documentation (Objective-C declarations; 64-bit Apple platforms). Nothing here is defined:
// the check is -fsyntax-only.
#pragma once
#include <stddef.h>

#include <Availability.h>

#include <dispatch/dispatch.h>

#pragma clang assume_nonnull begin  // NS_ASSUME_NONNULL_BEGIN, as in Apple's headers

typedef unsigned long NSUInteger;  // 64-bit platforms
typedef long NSInteger;
typedef bool BOOL;                 // <objc/objc.h>, arm64 Apple platforms
#define nil nullptr                // <objc/objc.h> (C++)
#define YES true
#define NO false
#define API_AVAILABLE(...)
#define API_DEPRECATED(...)

// @protocol NSObject: - (oneway void)release;
@protocol NSObject
- (oneway void)release;
@end

// @interface NSObject <NSObject>: + (instancetype)alloc; - (instancetype)init;
__attribute__((objc_root_class))
@interface NSObject <NSObject>
+ (instancetype)alloc;
- (instancetype)init;
@end

// @interface NSString : NSObject
//   + (nullable instancetype)stringWithUTF8String:(const char *)nullTerminatedCString;
//   @property (nullable, readonly) const char *UTF8String;
@interface NSString : NSObject
+ (nullable instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(nullable, readonly) const char* UTF8String;
@end

// @interface NSArray<__covariant ObjectType> : NSObject
//   @property (readonly) NSUInteger count;
//   - (ObjectType)objectAtIndex:(NSUInteger)index;
@interface NSArray<__covariant ObjectType> : NSObject
@property(readonly) NSUInteger count;
- (ObjectType)objectAtIndex:(NSUInteger)index;
@end

// @interface NSError : NSObject: @property (readonly, copy) NSString *localizedDescription;
@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end

// typedef struct { NSInteger majorVersion; NSInteger minorVersion; NSInteger patchVersion; } NSOperatingSystemVersion;
typedef struct {
  NSInteger majorVersion;
  NSInteger minorVersion;
  NSInteger patchVersion;
} NSOperatingSystemVersion;

// @interface NSProcessInfo : NSObject
//   @property (class, readonly, strong) NSProcessInfo *processInfo;
//   - (BOOL)isOperatingSystemAtLeastVersion:(NSOperatingSystemVersion)version;
@interface NSProcessInfo : NSObject
@property(class, readonly, strong) NSProcessInfo* processInfo;
- (BOOL)isOperatingSystemAtLeastVersion:(NSOperatingSystemVersion)version;
@end

// @interface NSURL : NSObject: + (NSURL *)fileURLWithPath:(NSString *)path;
@interface NSURL : NSObject
+ (NSURL*)fileURLWithPath:(NSString*)path;
@end

// used only as a pointer type by torch's MPSStream.h
@class NSDictionary;

#pragma clang assume_nonnull end
