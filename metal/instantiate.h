// The instantiation of a template kernel under the host_name the plans build (csrc/metal/plans.h kernel_name):
//   LOWBIT_KERNEL(base, func, T, args...)                    func<T, args...> as "<base>_<T>"
//   LOWBIT_KERNEL_VARIANT(base, variant, func, T, args...)   func<T, args...> as "<base>_<T>_<variant>"
// T is the kernel's activation / output dtype (float, half, bfloat), its first template argument. So a kernel's
// name is written once, in the scheme the plans compose. One invocation per line: the emulator (csrc/emu/msl_prep.py)
// and the address-space check (csrc/emu/msl_check.py) expand these lines themselves, as this preprocessor does.
// C++14 preprocessor only (MSL 3.1): no __VA_OPT__.
#pragma once

#define LOWBIT_KERNEL_INSTANCE(NAME, ...) \
  template [[host_name(NAME)]] [[kernel]] decltype(__VA_ARGS__) __VA_ARGS__;
// "T" of (T, args...): the extra argument keeps `...` non-empty where args is
#define LOWBIT_KERNEL_DTYPE(...) LOWBIT_KERNEL_DTYPE_(__VA_ARGS__, unused)
#define LOWBIT_KERNEL_DTYPE_(T, ...) #T
#define LOWBIT_KERNEL(BASE, FUNC, ...) \
  LOWBIT_KERNEL_INSTANCE(#BASE "_" LOWBIT_KERNEL_DTYPE(__VA_ARGS__), FUNC<__VA_ARGS__>)
#define LOWBIT_KERNEL_VARIANT(BASE, VARIANT, FUNC, ...) \
  LOWBIT_KERNEL_INSTANCE(#BASE "_" LOWBIT_KERNEL_DTYPE(__VA_ARGS__) "_" #VARIANT, FUNC<__VA_ARGS__>)
