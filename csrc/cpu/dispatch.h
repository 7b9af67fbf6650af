// The activation / output dtypes the ops take: float32, bfloat16, float16 (never double).
#pragma once
#include <ATen/Dispatch.h>

#define LOWBIT_DISPATCH_FLOAT_TYPES(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                      \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)        \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))
