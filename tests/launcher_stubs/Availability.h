// Stub of <Availability.h> for the launcher check (tests/test_mps_launcher_check.py): which macOS SDK the
// stubs pretend to be. The check compiles mps_launcher.mm once per SDK level (-DLOWBIT_STUB_SDK=140000,
// 150000, 260000); the Foundation and Metal stubs declare a name only from the SDK that introduced it, as
// Apple's headers do. In a real SDK, __MAC_OS_X_VERSION_MAX_ALLOWED is that SDK's macOS version.
#pragma once

#ifndef LOWBIT_STUB_SDK
#error "the launcher check passes -DLOWBIT_STUB_SDK=<SDK macOS version, 140000 for the macOS 14 SDK>"
#endif
#define __MAC_OS_X_VERSION_MAX_ALLOWED LOWBIT_STUB_SDK
#define __MAC_14_0 140000
#define __MAC_15_0 150000
#define __MAC_26_0 260000
