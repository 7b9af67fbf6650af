// msl_shim.h -- compile Metal Shading Language compute kernels as C++20 on a CPU.
//
// Usage:  g++ -std=c++20 -I include -x c++ -include msl_shim.h kernel.metal ...
// (the kernel's own `#include <metal_stdlib>` resolves to include/metal_stdlib, which includes this file).
//
// What this file does:
//   * scalar types: uint/ushort/uchar/ulong, half (= _Float16), bfloat (RNE storage struct)
//   * vector types: vec<T,N> (float4, half4, uchar4, bfloat4, ...) with Metal alignment, .x/.xy/.xyzw swizzles,
//     arithmetic with scalar broadcast, explicit conversions, comparisons -> bool vectors; packed_* types
//   * the math / integer / as_type library subset kernels use
//   * simd_* cross-lane functions, threadgroup_barrier, simdgroup_matrix<T,8,8>: forwarded to the emulator
//     runtime (msl_runtime.h), which runs every GPU thread as a fiber
//   * address-space keywords and [[attributes]] as macros (see the end of this file)
#pragma once

// Kernels test __METAL_VERSION__ to tell MSL from host C++ (shared parameter headers): claim MSL 3.1.
#ifndef __METAL_VERSION__
#define __METAL_VERSION__ 310
#endif

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <source_location>
#include <type_traits>

#pragma GCC diagnostic ignored "-Wattributes"
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wuser-defined-literals"
#pragma clang diagnostic ignored "-Wgnu-anonymous-struct"
#pragma clang diagnostic ignored "-Wnested-anon-types"
#else
#pragma GCC diagnostic ignored "-Wliteral-suffix"
#pragma GCC diagnostic ignored "-Wpedantic"
#endif

namespace metal {

// ------------------------------------------------------------------------------------------------ scalars
typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;  // 64-bit on LP64, like Metal
typedef _Float16 half;

struct bfloat {
  uint16_t bits;
  static constexpr uint16_t from_float(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                          // round to nearest even
    return uint16_t(u >> 16);
  }
  bfloat() = default;
  constexpr bfloat(float f) : bits(from_float(f)) {}
  constexpr bfloat(double d) : bits(from_float(float(d))) {}
  constexpr bfloat(half h) : bits(from_float(float(h))) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  constexpr bfloat(I i) : bits(from_float(float(i))) {}
  constexpr operator float() const { return std::bit_cast<float>(uint32_t(bits) << 16); }
  template <class U> bfloat& operator+=(U o) { return *this = bfloat(float(*this) + float(o)); }
  template <class U> bfloat& operator-=(U o) { return *this = bfloat(float(*this) - float(o)); }
  template <class U> bfloat& operator*=(U o) { return *this = bfloat(float(*this) * float(o)); }
  template <class U> bfloat& operator/=(U o) { return *this = bfloat(float(*this) / float(o)); }
  constexpr bfloat operator-() const { bfloat r; r.bits = uint16_t(bits ^ 0x8000u); return r; }
  constexpr bfloat operator+() const { return *this; }
};
// bfloat op bfloat -> bfloat (rounded), bfloat op float -> float, bfloat op int -> bfloat
#define MSL_BF_OP(op)                                                                                        \
  constexpr bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); }                  \
  constexpr float operator op(bfloat a, float b) { return float(a) op b; }                                   \
  constexpr float operator op(float a, bfloat b) { return a op float(b); }                                   \
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>                                       \
  constexpr bfloat operator op(bfloat a, I b) { return bfloat(float(a) op float(b)); }                       \
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>                                       \
  constexpr bfloat operator op(I a, bfloat b) { return bfloat(float(a) op float(b)); }
MSL_BF_OP(+) MSL_BF_OP(-) MSL_BF_OP(*) MSL_BF_OP(/)
#undef MSL_BF_OP

template <class T> struct is_msl_scalar : std::bool_constant<std::is_arithmetic_v<T>> {};
template <> struct is_msl_scalar<half> : std::true_type {};
template <> struct is_msl_scalar<bfloat> : std::true_type {};
template <class T> inline constexpr bool is_scalar_v = is_msl_scalar<std::remove_cv_t<T>>::value;

// ------------------------------------------------------------------------------------------------ vectors
}  // namespace metal
namespace msl::rt {
// A vector load or store at an address not aligned as MSL requires (a vector type's size, 3-component
// vectors that of 4, packed vectors their scalar's): reported with kernel, buffer, byte offset and thread,
// and the threadgroup abandoned, like a memory fault (runtime.cpp). On the GPU such a load returns
// wrong data or faults.
void misaligned_vector(const void* p, size_t align, size_t bytes, bool store);
inline void check_vector_aligned(const void* p, size_t align, size_t bytes, bool store) {
  uintptr_t a = reinterpret_cast<uintptr_t>(p);
  asm("" : "+r"(a));  // the compiler may not fold the test from the pointer's static type
  if (a & (align - 1)) [[unlikely]] misaligned_vector(p, align, bytes, store);
}
}  // namespace msl::rt
namespace metal {

template <class T, int N> struct vec;
template <class T, int N, class V = vec<T, N>> struct packed_vec;  // V only makes vec<T,N> an ADL-associated class

template <int... I> constexpr bool distinct_idx() {
  constexpr int a[] = {I...};
  for (size_t i = 0; i < sizeof...(I); i++)
    for (size_t j = i + 1; j < sizeof...(I); j++)
      if (a[i] == a[j]) return false;
  return true;
}

// swizzle proxy: lives in the vector's union, reads/writes the selected components
template <class V, class T, int N, int... I> struct swz {
  T v[N];
  static constexpr int M = sizeof...(I);
  operator V() const { return V(v[I]...); }
  T operator[](int i) const { constexpr int idx[] = {I...}; return v[idx[i]]; }
  swz& operator=(const V& r) {
    static_assert(distinct_idx<I...>(), "swizzle with repeated components is not an lvalue");
    int k = 0;
    ((v[I] = r[k++]), ...);
    return *this;
  }
  swz& operator=(const swz& o) { return *this = V(o); }
  template <class U> swz& operator+=(const U& o) { return *this = V(*this) + o; }
  template <class U> swz& operator-=(const U& o) { return *this = V(*this) - o; }
  template <class U> swz& operator*=(const U& o) { return *this = V(*this) * o; }
  template <class U> swz& operator/=(const U& o) { return *this = V(*this) / o; }
};

#include "msl_swizzle.inc"

template <class T, int N> struct vstore;
template <class T> struct vstore<T, 2> { union { T v[2]; struct { T x, y; }; struct { T r, g; }; MSL_SWIZZLES_2 }; };
template <class T> struct vstore<T, 3> { union { T v[3]; struct { T x, y, z; }; struct { T r, g, b; }; MSL_SWIZZLES_3 }; };
template <class T> struct vstore<T, 4> { union { T v[4]; struct { T x, y, z, w; }; struct { T r, g, b, a; }; MSL_SWIZZLES_4 }; };

template <class A> struct ncomp { static constexpr int value = 1; };
template <class T, int N> struct ncomp<vec<T, N>> { static constexpr int value = N; };
template <class T, int N, class V> struct ncomp<packed_vec<T, N, V>> { static constexpr int value = N; };
template <class V, class T, int N, int... I> struct ncomp<swz<V, T, N, I...>> { static constexpr int value = sizeof...(I); };
template <class A> inline constexpr int ncomp_v = ncomp<std::remove_cvref_t<A>>::value;

template <class T, int N>
struct alignas(sizeof(T) * (N == 3 ? 4 : N)) vec : vstore<T, N> {
  using value_type = T;
  static constexpr int size = N;

  vec() = default;
  // one access each, like a GPU vector load / store, and aligned like one
  vec(const vec& o) { load_check(&o); __builtin_memcpy(this->v, o.v, sizeof(T) * N); }
  vec& operator=(const vec& o) {
    load_check(&o);
    msl::rt::check_vector_aligned(this, alignof(vec), sizeof(T) * N, true);
    __builtin_memcpy(this->v, o.v, sizeof(T) * N);
    return *this;
  }
  vec(T s) { for (int i = 0; i < N; i++) this->v[i] = s; }                        // splat
  template <class S, std::enable_if_t<is_scalar_v<S> && !std::is_same_v<S, T>, int> = 0>
  vec(S s) : vec(T(s)) {}                                                          // splat with scalar conversion
  template <class... A, std::enable_if_t<(sizeof...(A) >= 2) && ((ncomp_v<A> + ...) == N), int> = 0>
  vec(const A&... a) { int k = 0; (put(k, a), ...); }                             // float4(f2, z, w) ...
  template <class U, std::enable_if_t<!std::is_same_v<U, T>, int> = 0>
  explicit vec(const vec<U, N>& o) {
    vec<U, N>::load_check(&o);
    U t[N];
    __builtin_memcpy(t, o.v, sizeof(t));  // read the source as one access, then convert
    for (int i = 0; i < N; i++) this->v[i] = T(t[i]);
  }
  template <class U, class W>
  explicit(!std::is_same_v<U, T>) vec(const packed_vec<U, N, W>& o) {
    msl::rt::check_vector_aligned(&o, alignof(U), sizeof(U) * N, false);
    if constexpr (std::is_same_v<U, T>) __builtin_memcpy(this->v, o.v, sizeof(T) * N);
    else for (int i = 0; i < N; i++) this->v[i] = T(o.v[i]);
  }
  template <class V2, class U, int N2, int... I, std::enable_if_t<sizeof...(I) == N && !std::is_same_v<U, T>, int> = 0>
  explicit vec(const swz<V2, U, N2, I...>& s) { for (int i = 0; i < N; i++) this->v[i] = T(s[i]); }

  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }

#define MSL_VEC_COMPOUND(op)                                                                          \
  vec& operator op##=(const vec& o) { for (int i = 0; i < N; i++) this->v[i] = T(this->v[i] op o.v[i]); return *this; } \
  vec& operator op##=(T s) { for (int i = 0; i < N; i++) this->v[i] = T(this->v[i] op s); return *this; }
  MSL_VEC_COMPOUND(+) MSL_VEC_COMPOUND(-) MSL_VEC_COMPOUND(*) MSL_VEC_COMPOUND(/) MSL_VEC_COMPOUND(%)
  MSL_VEC_COMPOUND(&) MSL_VEC_COMPOUND(|) MSL_VEC_COMPOUND(^) MSL_VEC_COMPOUND(<<) MSL_VEC_COMPOUND(>>)
#undef MSL_VEC_COMPOUND

  // hidden friends: found by ADL for vec, packed_vec and swz operands (all convert to vec)
#define MSL_VEC_BINOP(op)                                                                             \
  friend vec operator op(const vec& a, const vec& b) { vec r; for (int i = 0; i < N; i++) r.v[i] = T(a.v[i] op b.v[i]); return r; } \
  friend vec operator op(const vec& a, T s) { vec r; for (int i = 0; i < N; i++) r.v[i] = T(a.v[i] op s); return r; } \
  friend vec operator op(T s, const vec& b) { vec r; for (int i = 0; i < N; i++) r.v[i] = T(s op b.v[i]); return r; }
  MSL_VEC_BINOP(+) MSL_VEC_BINOP(-) MSL_VEC_BINOP(*) MSL_VEC_BINOP(/) MSL_VEC_BINOP(%)
  MSL_VEC_BINOP(&) MSL_VEC_BINOP(|) MSL_VEC_BINOP(^) MSL_VEC_BINOP(<<) MSL_VEC_BINOP(>>)
#undef MSL_VEC_BINOP
#define MSL_VEC_CMP(op)                                                                               \
  friend vec<bool, N> operator op(const vec& a, const vec& b) { vec<bool, N> r; for (int i = 0; i < N; i++) r.v[i] = a.v[i] op b.v[i]; return r; } \
  friend vec<bool, N> operator op(const vec& a, T s) { vec<bool, N> r; for (int i = 0; i < N; i++) r.v[i] = a.v[i] op s; return r; } \
  friend vec<bool, N> operator op(T s, const vec& b) { vec<bool, N> r; for (int i = 0; i < N; i++) r.v[i] = s op b.v[i]; return r; }
  MSL_VEC_CMP(==) MSL_VEC_CMP(!=) MSL_VEC_CMP(<) MSL_VEC_CMP(<=) MSL_VEC_CMP(>) MSL_VEC_CMP(>=) MSL_VEC_CMP(&&) MSL_VEC_CMP(||)
#undef MSL_VEC_CMP
  friend vec operator-(const vec& a) { vec r; for (int i = 0; i < N; i++) r.v[i] = T(-a.v[i]); return r; }
  friend vec operator+(const vec& a) { return a; }
  friend vec operator~(const vec& a) { vec r; for (int i = 0; i < N; i++) r.v[i] = T(~a.v[i]); return r; }
  friend vec<bool, N> operator!(const vec& a) { vec<bool, N> r; for (int i = 0; i < N; i++) r.v[i] = !a.v[i]; return r; }

  static void load_check(const vec* p) { msl::rt::check_vector_aligned(p, alignof(vec), sizeof(T) * N, false); }

 private:
  template <class A> void put(int& k, const A& a) {
    if constexpr (ncomp_v<A> == 1) this->v[k++] = T(a);
    else for (int i = 0; i < ncomp_v<A>; i++) this->v[k++] = T(a[i]);
  }
  template <class, int> friend struct vec;
};

// packed_*: scalar alignment, no padding; converts implicitly to/from the matching vec
template <class T, int N, class V> struct packed_vec : vstore<T, N> {
  using value_type = T;
  static constexpr int size = N;
  packed_vec() = default;
  packed_vec(const packed_vec&) = default;
  packed_vec& operator=(const packed_vec& o) {
    check(&o, false), check(this, true);
    __builtin_memcpy(this->v, o.v, sizeof(T) * N);
    return *this;
  }
  packed_vec(const V& o) { __builtin_memcpy(this->v, o.v, sizeof(T) * N); }
  template <class... A, std::enable_if_t<(sizeof...(A) >= 2), int> = 0>
  packed_vec(const A&... a) : packed_vec(V(a...)) {}
  operator V() const { check(this, false); V r; __builtin_memcpy(r.v, this->v, sizeof(T) * N); return r; }
  static void check(const packed_vec* p, bool store) { msl::rt::check_vector_aligned(p, alignof(T), sizeof(T) * N, store); }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }
  template <class U> packed_vec& operator+=(const U& o) { return *this = V(*this) + o; }
  template <class U> packed_vec& operator-=(const U& o) { return *this = V(*this) - o; }
  template <class U> packed_vec& operator*=(const U& o) { return *this = V(*this) * o; }
};

#define MSL_VEC_TYPES(T)                                                                              \
  typedef vec<T, 2> T##2; typedef vec<T, 3> T##3; typedef vec<T, 4> T##4;                            \
  typedef packed_vec<T, 2> packed_##T##2; typedef packed_vec<T, 3> packed_##T##3; typedef packed_vec<T, 4> packed_##T##4;
typedef signed char char_;
MSL_VEC_TYPES(float) MSL_VEC_TYPES(half) MSL_VEC_TYPES(bfloat) MSL_VEC_TYPES(int) MSL_VEC_TYPES(uint)
MSL_VEC_TYPES(short) MSL_VEC_TYPES(ushort) MSL_VEC_TYPES(uchar) MSL_VEC_TYPES(long) MSL_VEC_TYPES(ulong)
MSL_VEC_TYPES(bool)
typedef vec<char_, 2> char2; typedef vec<char_, 3> char3; typedef vec<char_, 4> char4;
typedef packed_vec<char_, 4> packed_char4;
#undef MSL_VEC_TYPES

template <class T> struct elem_of { using type = T; };
template <class T, int N> struct elem_of<vec<T, N>> { using type = T; };

// ------------------------------------------------------------------------------------------------ library
template <class To, class From> inline To as_type(const From& f) {
  static_assert(sizeof(To) == sizeof(From), "as_type: size mismatch");
  To t;
  std::memcpy((void*)&t, (const void*)&f, sizeof(To));
  return t;
}
// a swizzle (v.xy) is stored as its whole source vector: reinterpret the selected components only
template <class To, class V, class T, int N, int... I> inline To as_type(const swz<V, T, N, I...>& s) {
  return as_type<To>(V(s));
}

#define MSL_MAP1(name, expr)                                                                          \
  template <class T, std::enable_if_t<is_scalar_v<T>, int> = 0> inline T name(T x) { return T(expr); } \
  template <class T, int N> inline vec<T, N> name(const vec<T, N>& a) { vec<T, N> r; for (int i = 0; i < N; i++) r[i] = name(a[i]); return r; }
MSL_MAP1(exp, std::exp(float(x))) MSL_MAP1(exp2, std::exp2(float(x))) MSL_MAP1(log, std::log(float(x)))
MSL_MAP1(log2, std::log2(float(x))) MSL_MAP1(sqrt, std::sqrt(float(x))) MSL_MAP1(rsqrt, 1.0f / std::sqrt(float(x)))
MSL_MAP1(sin, std::sin(float(x))) MSL_MAP1(cos, std::cos(float(x))) MSL_MAP1(tanh, std::tanh(float(x)))
MSL_MAP1(floor, std::floor(float(x))) MSL_MAP1(ceil, std::ceil(float(x))) MSL_MAP1(round, std::round(float(x)))
MSL_MAP1(rint, std::rint(float(x))) MSL_MAP1(trunc, std::trunc(float(x))) MSL_MAP1(fabs, std::fabs(float(x)))
MSL_MAP1(fract, float(x) - std::floor(float(x))) MSL_MAP1(saturate, std::min(std::max(float(x), 0.0f), 1.0f))
MSL_MAP1(sign, float(x) > 0 ? 1.0f : (float(x) < 0 ? -1.0f : 0.0f))
#undef MSL_MAP1
template <class T, std::enable_if_t<is_scalar_v<T>, int> = 0> inline T abs(T x) { return x < T(0) ? T(-x) : x; }
template <class T, int N> inline vec<T, N> abs(const vec<T, N>& a) { vec<T, N> r; for (int i = 0; i < N; i++) r[i] = abs(a[i]); return r; }

#define MSL_MAP2(name, expr)                                                                          \
  template <class T, std::enable_if_t<is_scalar_v<T>, int> = 0> inline T name(T x, T y) { return T(expr); } \
  template <class T, int N> inline vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) { vec<T, N> r; for (int i = 0; i < N; i++) r[i] = name(a[i], b[i]); return r; } \
  template <class T, int N> inline vec<T, N> name(const vec<T, N>& a, T b) { return name(a, vec<T, N>(b)); }
MSL_MAP2(max, x < y ? y : x) MSL_MAP2(min, y < x ? y : x) MSL_MAP2(fmax, std::fmax(float(x), float(y)))
MSL_MAP2(fmin, std::fmin(float(x), float(y))) MSL_MAP2(pow, std::pow(float(x), float(y)))
MSL_MAP2(powr, std::pow(float(x), float(y))) MSL_MAP2(fmod, std::fmod(float(x), float(y)))
MSL_MAP2(atan2, std::atan2(float(x), float(y))) MSL_MAP2(step, float(y) < float(x) ? 0.0f : 1.0f)
#undef MSL_MAP2
template <class T, std::enable_if_t<is_scalar_v<T>, int> = 0> inline T fma(T a, T b, T c) { return T(std::fma(float(a), float(b), float(c))); }
template <class T, int N> inline vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) { vec<T, N> r; for (int i = 0; i < N; i++) r[i] = fma(a[i], b[i], c[i]); return r; }
template <class V, class L, class H> inline V clamp(V x, L lo, H hi) { return min(max(x, V(lo)), V(hi)); }
template <class V, class S> inline V mix(V a, V b, S t) { return a + (b - a) * t; }
template <class T> inline T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> inline vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) { vec<T, N> r; for (int i = 0; i < N; i++) r[i] = c[i] ? b[i] : a[i]; return r; }
template <class T, int N> inline T dot(const vec<T, N>& a, const vec<T, N>& b) { T s = a[0] * b[0]; for (int i = 1; i < N; i++) s = T(s + a[i] * b[i]); return s; }
template <class T, int N> inline T length(const vec<T, N>& a) { return T(std::sqrt(float(dot(a, a)))); }
template <int N> inline bool all(const vec<bool, N>& a) { for (int i = 0; i < N; i++) if (!a[i]) return false; return true; }
template <int N> inline bool any(const vec<bool, N>& a) { for (int i = 0; i < N; i++) if (a[i]) return true; return false; }
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <class T, std::enable_if_t<is_scalar_v<T>, int> = 0> inline bool isnan(T x) { return std::isnan(float(x)); }
template <class T, std::enable_if_t<is_scalar_v<T>, int> = 0> inline bool isinf(T x) { return std::isinf(float(x)); }
template <class T, std::enable_if_t<is_scalar_v<T>, int> = 0> inline bool isfinite(T x) { return std::isfinite(float(x)); }
template <class T> inline T popcount(T x) { return T(std::popcount(std::make_unsigned_t<T>(x))); }
template <class T> inline T clz(T x) { return T(std::countl_zero(std::make_unsigned_t<T>(x))); }
template <class T> inline T ctz(T x) { return T(std::countr_zero(std::make_unsigned_t<T>(x))); }
template <class T> inline T extract_bits(T x, uint off, uint bits) {
  using U = std::make_unsigned_t<T>;
  if (bits == 0) return T(0);
  U m = bits >= sizeof(U) * 8 ? U(~U(0)) : U((U(1) << bits) - 1);
  return T((U(x) >> off) & m);
}
template <class T> struct numeric_limits : std::numeric_limits<T> {};
template <> struct numeric_limits<half> {
  static constexpr half max() { return half(65504.0f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr half infinity() { return half(INFINITY); }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bfloat max() { return bfloat(3.3895313892515355e38f); }
  static constexpr bfloat lowest() { return bfloat(-3.3895313892515355e38f); }
  static constexpr bfloat infinity() { return bfloat(INFINITY); }
};
template <class A, class B> inline constexpr bool is_same_v = std::is_same_v<A, B>;
using std::enable_if_t;

// x / y: the emulator's `/` is already IEEE (correctly rounded); on the GPU only precise::divide is
template <class T> inline T divide(T x, T y) { return T(x / y); }

namespace fast { using metal::divide; using metal::exp; using metal::exp2; using metal::log; using metal::log2; using metal::sqrt; using metal::rsqrt;
                 using metal::tanh; using metal::sin; using metal::cos; using metal::max; using metal::min; using metal::pow; }
namespace precise { using metal::divide; using metal::exp; using metal::exp2; using metal::log; using metal::sqrt; using metal::rsqrt; using metal::tanh; }

enum class mem_flags : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
enum memory_order { memory_order_relaxed = __ATOMIC_RELAXED, memory_order_seq_cst = __ATOMIC_SEQ_CST };

template <class T> struct atomic { T v; };
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
template <class T> inline T atomic_load_explicit(const volatile atomic<T>* a, memory_order) { return __atomic_load_n(&const_cast<atomic<T>*>(a)->v, __ATOMIC_SEQ_CST); }
template <class T, class U> inline void atomic_store_explicit(volatile atomic<T>* a, U x, memory_order) { __atomic_store_n(&const_cast<atomic<T>*>(a)->v, T(x), __ATOMIC_SEQ_CST); }
template <class T, class U> inline T atomic_fetch_add_explicit(volatile atomic<T>* a, U x, memory_order) {
  T* p = &const_cast<atomic<T>*>(a)->v;
  if constexpr (std::is_integral_v<T>) return __atomic_fetch_add(p, T(x), __ATOMIC_SEQ_CST);
  else { T old = __atomic_load_n(p, __ATOMIC_SEQ_CST); while (!__atomic_compare_exchange_n(p, &old, T(old + T(x)), true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {} return old; }
}
template <class T, class U> inline T atomic_fetch_max_explicit(volatile atomic<T>* a, U x, memory_order) {
  T* p = &const_cast<atomic<T>*>(a)->v;
  T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
  while (old < T(x) && !__atomic_compare_exchange_n(p, &old, T(x), true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
  return old;
}

}  // namespace metal

// half literal suffix: 1.0h
constexpr metal::half operator""h(long double v) { return metal::half(float(v)); }
constexpr metal::half operator""h(unsigned long long v) { return metal::half(float(v)); }

#include "msl_runtime.h"  // simd_*, barriers, simdgroup_matrix, builtin/buffer binding

// ------------------------------------------------------------------------------------------------ keywords
// Address spaces: device/thread vanish, constant becomes const. `threadgroup` vanishes as a pointer qualifier;
// kernel-scope threadgroup *variables* are rewritten by msl_prep.py to MSL_TG_VAR storage (static thread_local:
// shared by the fibers of the threadgroup that a worker OS thread is running) and a reference placed at the
// alignment the declaration promises (msl_runtime.h TgVar): a kernel that stores a float4 into a `float` array
// must declare the array alignas(16).
#define kernel
#define device
#define thread
#define constant const
#define threadgroup
#define MSL_TG_VAR alignas(16) static thread_local ::msl::rt::TgVar
#define MSL_TG_POISON(v) \
  static thread_local unsigned long msl_tg_epoch_##v = 0; ::msl::rt::tg_poison(&(v), sizeof(v), &msl_tg_epoch_##v)
// Attributes: `T name [[attr]]` becomes `T name [[]] = <proxy>[zero[0]]` -- a default argument read from the
// running fiber's context, so the launcher calls every kernel with no arguments. The closing `]]` of the
// attribute closes the two subscripts opened here.
#define MSL_BIND_(expr) ]] = (expr)[::msl::rt::zero_idx[0
#define buffer(i) MSL_BIND_(::msl::rt::BufferProxy{i})
#define msl_threadgroup_binding(i) MSL_BIND_(::msl::rt::TgBufferProxy{i})
#define thread_position_in_grid MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tpig})
#define thread_position_in_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tpitg})
#define thread_index_in_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tiitg})
#define threadgroup_position_in_grid MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tgpig})
#define threads_per_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tptg})
#define dispatch_threads_per_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tptg})
#define threadgroups_per_grid MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tgpg})
#define threads_per_grid MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tpg})
#define thread_index_in_simdgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tiisg})
#define simdgroup_index_in_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::sgitg})
#define threads_per_simdgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tpsg})
#define thread_execution_width MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tpsg})
#define simdgroups_per_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::sgptg})
#define dispatch_simdgroups_per_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::sgptg})
#define thread_index_in_quadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::tiiqg})
#define quadgroup_index_in_threadgroup MSL_BIND_(::msl::rt::BuiltinProxy{::msl::rt::BI::qgitg})
// attributes that carry no runtime meaning here
#define host_name(x)
#define max_total_threads_per_threadgroup(x)
