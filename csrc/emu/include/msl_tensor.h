// msl_tensor.h -- the emulator's model of Metal 4 tensors and Metal Performance Primitives' matmul2d
// (<metal_tensor>, <MetalPerformancePrimitives/MetalPerformancePrimitives.h>; the shim headers of those names
// include this file). Only what torch_lowbit's M5 kernels use, and strict where the hardware is opaque:
//
// * tensor<T, extents, tag>: a non-owning view of device or threadgroup memory with extents (x = the inner,
//   contiguous dimension first, as Apple's headers order them: a row-major [rows, cols] matrix has extents
//   (cols, rows)), strides and an origin. slice(x, y) moves the origin and keeps the parent's bounds: what
//   matmul2d reads outside them is 0, what it writes there is dropped. A static slice<E0, E1>(x, y) has no
//   bounds check on the GPU (Apple: for "inside" tiles), so one reaching past the parent's extents is an error.
// * matmul2d<matmul2d_descriptor(m, n, k, transpose_left, transpose_right, relaxed_precision, mode),
//   execution_simdgroups<S>>::run(left, right, destination) is a collective of the whole execution scope:
//   the threadgroup must have exactly 32 * S threads, every thread must call run at the same call site with
//   the same operands (checked), and the operands are read when the first thread of the scope enters run (a
//   GPU may start then: a missing barrier before run shows) and must stay unchanged until the scope's next
//   rendezvous (a barrier after run that is missing shows). Results written to a tensor in memory become
//   visible only at the next threadgroup_barrier (until then the window holds poison).
// * Cooperative destination tensors (get_destination_cooperative_tensor): each thread owns get_capacity()
//   elements whose lane layout is implementation-defined. The emulator's layout is a per-launch switch
//   (msl_emu_set_tensor_ops, from Python torch_lowbit.emulator.tensor_ops): a plausible M5 layout (8x8
//   fragments, simdgroup-matrix lane order, fragments dealt round-robin to the simdgroups) or a seeded random
//   permutation; both keep one invalid slot per thread, so a kernel that assumes a layout, or that skips
//   is_valid_element, fails. A cooperative tensor is poisoned on construction (NaN / a huge int).
// * Arithmetic: integer products are summed exactly in int64 and an int32 destination that overflows is an
//   error; float products are summed in float in a switchable order (k ascending, k descending, 8-wide
//   partial sums), so a test must compare against float64 within a bound, never bit for bit.
// * The type pairs of Apple's table (MPPTensorOpsMatMul2d.h, macOS 26.2 SDK) as static_asserts, bfloat rows
//   from OS 26.1; relaxed_precision = true is refused (torch_lowbit never trades accuracy for speed).
#pragma once
// the library headers come after msl_shim.h's keyword macros (`constant` is a field name in <sys/timex.h>)
#pragma push_macro("constant")
#pragma push_macro("device")
#pragma push_macro("thread")
#pragma push_macro("kernel")
#undef constant
#undef device
#undef thread
#undef kernel
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#pragma pop_macro("constant")
#pragma pop_macro("device")
#pragma pop_macro("thread")
#pragma pop_macro("kernel")

#ifndef MSL_EMU_TENSOR_OS
#define MSL_EMU_TENSOR_OS 2602  // the OS (major * 100 + minor) the M5 library targets: csrc/metal/metallib.py
#endif

namespace msl::rt {
// runtime.cpp: the threadgroup-wide rendezvous of a tensor op, and the hook called at every rendezvous
void block_tg_collective(Resolver r, const void* in, void* out, const std::source_location& loc);
unsigned long tg_epoch();                      // unique per threadgroup run (a new one per threadgroup)
// every translation unit of tensor-op kernels adds its hook, called at each rendezvous of a threadgroup with
// kind 0 (a barrier releases), 1 (a tensor op releases, before its resolver), 2 (the threadgroup ends)
void add_tg_rendezvous_hook(void (*hook)(int kind));
int tensor_layout();                           // 0 plausible M5 layout, 1 seeded permutation
int tensor_sum_order();                        // 0 k ascending, 1 k descending, 2 8-wide partial sums
unsigned tensor_seed();
}  // namespace msl::rt

namespace metal {
inline constexpr size_t dynamic_extent = size_t(-1);

template <class T, size_t N> struct array {
  T v[N];
  T& operator[](size_t i) { return v[i]; }
  const T& operator[](size_t i) const { return v[i]; }
};

template <class I, size_t... E> struct extents {
  using index_type = I;
  static constexpr int R = int(sizeof...(E));
  static constexpr size_t static_v[R] = {E...};
  I v[R];
  constexpr extents() : v{I(E == dynamic_extent ? 0 : E)...} {}
  template <class... A, std::enable_if_t<(sizeof...(A) > 0), int> = 0> constexpr extents(A... a) : v{} {
    const I given[] = {I(a)...};
    int j = 0;
    for (int r = 0; r < R; r++) v[r] = static_v[r] == dynamic_extent ? given[j++] : I(static_v[r]);
  }
  static constexpr int rank() { return R; }
  constexpr I extent(int r) const { return v[r]; }
};
template <class I, int R> struct dextents_of;
template <class I> struct dextents_of<I, 1> { using type = extents<I, dynamic_extent>; };
template <class I> struct dextents_of<I, 2> { using type = extents<I, dynamic_extent, dynamic_extent>; };
template <class I, int R> using dextents = typename dextents_of<I, R>::type;

struct tensor_inline {};
struct tensor_handle {};
struct tensor_offset {};

template <int N> struct execution_simdgroups { static constexpr int simdgroups = N; };
struct execution_simdgroup {};
struct execution_thread {};

// A 2-D view: element (x, y) of the view is data[(org[0] + x) * stride[0] + (org[1] + y) * stride[1]]; it
// exists when it is inside the parent's extents and inside the view's window (win < 0: to the parent's end).
template <class T, class Ext, class Tag = tensor_handle> struct tensor {
  static_assert(Ext::R == 2, "the emulator models 2-D tensors only");
  using element_type = T;
  using index_type = typename Ext::index_type;
  using extents_type = Ext;
  T* data = nullptr;
  long ext[2] = {0, 0}, stride[2] = {1, 0}, org[2] = {0, 0}, win[2] = {-1, -1};

  tensor() = default;
  tensor(T* p, Ext e) : data(p) {
    ext[0] = long(e.extent(0)), ext[1] = long(e.extent(1));
    stride[0] = 1, stride[1] = ext[0];
    set_static_window();
  }
  template <class I> tensor(T* p, Ext e, array<I, 2> s) : tensor(p, e) {
    stride[0] = long(s[0]), stride[1] = long(s[1]);
  }
  template <class T2, class E2, class G2> tensor(const tensor<T2, E2, G2>& o)
      : data(o.data), ext{o.ext[0], o.ext[1]}, stride{o.stride[0], o.stride[1]}, org{o.org[0], o.org[1]},
        win{o.win[0], o.win[1]} {}

  void set_static_window() {
    for (int r = 0; r < 2; r++)
      if (Ext::static_v[r] != dynamic_extent) win[r] = long(Ext::static_v[r]);
  }
  long size(int r) const {  // elements of dimension r the view reaches (at least 0)
    long to_end = ext[r] - org[r];
    long n = win[r] < 0 ? to_end : (win[r] < to_end ? win[r] : to_end);
    return n < 0 ? 0 : n;
  }
  Ext extents() const {
    Ext e;
    e.v[0] = typename Ext::index_type(size(0)), e.v[1] = typename Ext::index_type(size(1));
    return e;
  }
  bool contains(long x, long y) const { return x >= 0 && y >= 0 && x < size(0) && y < size(1); }
  T* at(long x, long y) const { return data + (org[0] + x) * stride[0] + (org[1] + y) * stride[1]; }

  tensor<T, Ext, tensor_offset> slice(long x, long y) const {
    tensor<T, Ext, tensor_offset> s(*this);
    s.org[0] += x, s.org[1] += y;
    s.win[0] = win[0] < 0 ? -1 : win[0] - x, s.win[1] = win[1] < 0 ? -1 : win[1] - y;
    return s;
  }
  template <size_t E0, size_t E1> tensor<T, metal::extents<index_type, E0, E1>, tensor_offset> slice(long x, long y) const {
    tensor<T, metal::extents<index_type, E0, E1>, tensor_offset> s(slice(x, y));
    const size_t e[2] = {E0, E1};
    for (int r = 0; r < 2; r++) {
      if (e[r] == dynamic_extent) continue;
      s.win[r] = long(e[r]);
      if (s.org[r] + long(e[r]) > ext[r])
        msl::rt::report_error("tensor slice<%ld, %ld>(%ld, %ld): the static window reaches past the tensor's extent "
                              "%ld in dimension %d (a static slice is not bounds-checked on the GPU)",
                              long(E0 == dynamic_extent ? -1 : long(E0)), long(E1 == dynamic_extent ? -1 : long(E1)),
                              x, y, ext[r], r);
    }
    return s;
  }
  template <size_t E0, size_t E1> auto static_slice(long x, long y) const { return slice<E0, E1>(x, y); }
};
}  // namespace metal

namespace mpp::tensor_ops {

struct matmul2d_descriptor {
  enum class mode { multiply, multiply_accumulate };
  int m, n, k;
  bool transpose_left, transpose_right;
  bool relaxed_precision;
  mode matmul_mode;
  constexpr matmul2d_descriptor(int m_, int n_, int k_ = int(metal::dynamic_extent), bool tl = false, bool tr = false,
                                bool relaxed = false, mode md = mode::multiply)
      : m(m_), n(n_), k(k_), transpose_left(tl), transpose_right(tr), relaxed_precision(relaxed), matmul_mode(md) {}
};

namespace emu {
using metal::half;
using metal::bfloat;
enum class Kind { i8, u8, f16, bf16, f32, i32, other };
template <class T> constexpr Kind kind_of() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, char> || std::is_same_v<U, signed char>) return Kind::i8;  // MSL's char is signed
  else if constexpr (std::is_same_v<U, unsigned char>) return Kind::u8;
  else if constexpr (std::is_same_v<U, half>) return Kind::f16;
  else if constexpr (std::is_same_v<U, bfloat>) return Kind::bf16;
  else if constexpr (std::is_same_v<U, float>) return Kind::f32;
  else if constexpr (std::is_same_v<U, int>) return Kind::i32;
  else return Kind::other;
}
constexpr bool is_int(Kind k) { return k == Kind::i8 || k == Kind::u8 || k == Kind::i32; }
constexpr bool is_8bit(Kind k) { return k == Kind::i8 || k == Kind::u8; }
// Apple's table (MPPTensorOpsMatMul2d.h, macOS 26.2 SDK) for the element types the emulator knows: int8 x int8
// and uint8 x uint8 give int32 only; with a float operand the destination is float; otherwise (half, bfloat and
// 8-bit operands) float, or half where an operand is half, or bfloat where an operand is bfloat. bfloat from 26.1.
constexpr bool supported(Kind l, Kind r, Kind d) {
  if (l == Kind::other || r == Kind::other || l == Kind::i32 || r == Kind::i32) return false;
  if ((l == Kind::bf16 || r == Kind::bf16 || d == Kind::bf16) && MSL_EMU_TENSOR_OS < 2601) return false;
  if (is_8bit(l) && is_8bit(r)) return l == r && d == Kind::i32;
  if (l == Kind::f32 || r == Kind::f32 || d == Kind::f32) return d == Kind::f32;
  if (d == Kind::f16) return l == Kind::f16 || r == Kind::f16;
  if (d == Kind::bf16) return l == Kind::bf16 || r == Kind::bf16;
  return false;
}
template <class T> inline double to_f64(const T& v) {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, char>) return double((signed char)v);
  else return double(float(v));
}
template <class T> inline int64_t to_i64(const T& v) {
  if constexpr (std::is_same_v<std::remove_cv_t<T>, char>) return int64_t((signed char)v);
  else return int64_t(v);
}
// A float element's poison is a signaling NaN with its own payload: arithmetic never produces it (a NaN it
// produces or propagates is quiet), so a sum that is legitimately NaN -- the canonical 0x7FC00000 of a NaN weight
// -- is never taken for an element nobody wrote.
template <class T> inline T poison() {
  if constexpr (std::is_integral_v<T>) {
    return T(0x7EADBEEF);
  } else if constexpr (std::is_same_v<T, float>) {
    const uint32_t bits = 0x7FA5A5A5u;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else {
    return T(NAN);
  }
}
template <class T> inline bool is_poison(const T& v) {
  const T p = poison<T>();
  return std::memcmp(&v, &p, sizeof(T)) == 0;
}

// The first element (index) whose bytes differ from the snapshot, or -1
inline long changed(const std::vector<unsigned char*>& where, const std::vector<unsigned char>& bytes, size_t elem) {
  for (size_t i = 0; i < where.size(); i++)
    if (std::memcmp(where[i], bytes.data() + i * elem, elem) != 0) return long(i);
  return -1;
}

// An operand as the first thread of the scope saw it: rows x cols of float64 / int64 (row-major, logical
// orientation after the transpose flag), and the view it came from, to compare the other threads' views with.
struct ViewKey {
  const void* data; long ext[2], stride[2], org[2], win[2];
  bool operator==(const ViewKey& o) const { return std::memcmp(this, &o, sizeof o) == 0; }
};
template <class V> ViewKey key_of(const V& t) {
  ViewKey k;
  std::memset(&k, 0, sizeof k);
  k.data = t.data;
  for (int r = 0; r < 2; r++) k.ext[r] = t.ext[r], k.stride[r] = t.stride[r], k.org[r] = t.org[r], k.win[r] = t.win[r];
  return k;
}

// The lane layout of an m x n destination among T = 32 * S threads: slot -> (row, col) or -1 (invalid).
struct Layout {
  int m = 0, n = 0, threads = 0, cap = 0, mode = -1;
  unsigned seed = 0;
  std::vector<int> elem;  // [thread * cap + slot] = row * n + col, or -1
};
static const Layout& layout_for(int m, int n, int threads, int cap) {
  static thread_local std::vector<Layout> cache;  // per worker thread: a handful of shapes per process
  const int mode = msl::rt::tensor_layout();
  const unsigned seed = msl::rt::tensor_seed();
  for (const Layout& L : cache)
    if (L.m == m && L.n == n && L.threads == threads && L.cap == cap && L.mode == mode && L.seed == seed) return L;
  Layout L;
  L.m = m, L.n = n, L.threads = threads, L.cap = cap, L.mode = mode, L.seed = seed;
  L.elem.assign(size_t(threads) * cap, -1);
  const int S = threads / 32, frags_n = n / 8, frags = (m / 8) * frags_n;
  if (mode == 0) {
    // plausible: 8x8 fragments in row-major order dealt round-robin to the simdgroups; within a fragment the
    // lanes hold two adjacent elements each in simdgroup_matrix order (metal_simdgroup_matrix's row/col)
    for (int f = 0; f < frags; f++) {
      const int sg = f % S, base = (f / S) * 2, fr = (f / frags_n) * 8, fc = (f % frags_n) * 8;
      for (int lane = 0; lane < 32; lane++) {
        const int r = int(((lane >> 4) & 1) * 4 + ((lane >> 1) & 3)), c = int(((lane >> 3) & 1) * 4 + (lane & 1) * 2);
        for (int j = 0; j < 2; j++) L.elem[size_t(sg * 32 + lane) * cap + base + j] = (fr + r) * n + fc + c + j;
      }
    }
  } else {
    // a permutation of all slots (seeded), the first m * n of which hold the elements in order
    std::vector<int> pos(size_t(threads) * cap);
    for (size_t i = 0; i < pos.size(); i++) pos[i] = int(i);
    uint64_t s = 0x9E3779B97F4A7C15ull ^ seed;
    for (size_t i = pos.size() - 1; i > 0; i--) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      std::swap(pos[i], pos[size_t(s % (i + 1))]);
    }
    for (int e = 0; e < m * n; e++) L.elem[size_t(pos[size_t(e)])] = e;
  }
  cache.push_back(std::move(L));
  return cache.back();
}

// The model's state is per translation unit (internal linkage): g++ gives inline variables process-wide
// STB_GNU_UNIQUE binding, which would tie the shipped emulator, its traffic build and the tests' planted-kernel
// libraries, loaded into one process, to one copy.
struct Run;  // one pending run of a threadgroup (the first arrival's view of the operands)
static thread_local Run* tl_pending_run = nullptr;
}  // namespace emu

// A destination owned by the execution scope, `Cap` elements per thread (see Layout).
template <class E, int M, int N, int Threads> struct cooperative_destination {
  static_assert(M % 8 == 0 && N % 8 == 0, "the emulator's cooperative layouts tile the destination in 8x8 fragments");
  static constexpr int Cap = ((M / 8) * (N / 8) + Threads / 32 - 1) / (Threads / 32) * 2 + 1;
  using element_type = E;
  E v[Cap];
  cooperative_destination() { for (int i = 0; i < Cap; i++) v[i] = emu::poison<E>(); }
  static constexpr uint16_t get_capacity() { return uint16_t(Cap); }
  static int thread_index() {
    const uint32_t t = msl::rt::tl_cur->tiitg;
    if (t >= uint32_t(Threads))
      msl::rt::report_error("cooperative tensor of a %d-thread execution scope used by thread %u", Threads, t);
    return int(t % uint32_t(Threads));
  }
  static int element(int i) {
    if (i < 0 || i >= Cap) {
      msl::rt::report_error("cooperative tensor element %d of %d", i, Cap);
      return -1;
    }
    return emu::layout_for(M, N, Threads, Cap).elem[size_t(thread_index()) * Cap + i];
  }
  bool is_valid_element(int i) const { return element(i) >= 0; }
  // (column, row) in the M x N destination, x first as Apple's indices are; an invalid slot answers (0, 0),
  // an element another thread owns, so a kernel that skips is_valid_element corrupts it
  metal::array<int, 2> get_multidimensional_index(int i) const {
    const int e = element(i);
    if (e < 0) return metal::array<int, 2>{{0, 0}};
    return metal::array<int, 2>{{e % N, e / N}};
  }
  E& operator[](int i) { return v[i]; }
  const E& operator[](int i) const { return v[i]; }
  template <class T, class Ext, class Tag> void store(const metal::tensor<T, Ext, Tag>& t) {
    for (int i = 0; i < Cap; i++) {
      const int e = element(i);
      if (e >= 0 && t.contains(e % N, e / N)) *t.at(e % N, e / N) = T(v[i]);
    }
  }
};
template <class X> inline constexpr bool is_cooperative_v = false;
template <class E, int M, int N, int T> inline constexpr bool is_cooperative_v<cooperative_destination<E, M, N, T>> = true;

namespace emu {
// What each thread hands to the resolver: its destination (a cooperative tensor's elements or a memory view)
struct RunIn {
  void* dest;
  ViewKey left, right, dest_view;
  // the pending run's slot that `run` filled: its resolver reads the same one. A matmul2d instantiation of the same
  // types in two kernel files is one merged out-of-line copy, which may pair with another file's inlined `run`,
  // each naming its own file's tl_pending_run (two M5 kernels with one tile shape did: the run never resolved).
  Run** pending;
};

struct Run {
  unsigned long epoch = 0;
  std::vector<double> a, b;     // float operands, [m][k] and [k][n]
  std::vector<int64_t> ai, bi;  // integer operands
  int kk = 0;                   // the reduction length read
  ViewKey left, right;
  std::vector<unsigned char*> left_where, right_where;  // the operand elements read, and their bytes then
  std::vector<unsigned char> left_bytes, right_bytes;
  size_t left_elem = 0, right_elem = 0;
  unsigned line = 0;
};

// A deferred check or write, run at the scope's next rendezvous (checks) / next barrier (writes).
struct Deferred {
  unsigned long epoch;
  int kind;  // 0 check (any rendezvous), 1 write (barrier or threadgroup end)
  std::vector<unsigned char> bytes;
  std::vector<unsigned char*> where;  // write: one element address per element; check: the operand bytes
  size_t elem = 0;
  const char* what = "";
  unsigned line = 0;
};
static thread_local std::vector<Deferred>* tl_deferred = nullptr;
static std::vector<Deferred>& deferred() {
  if (!tl_deferred) tl_deferred = new std::vector<Deferred>();  // per worker thread, never freed (a few bytes)
  return *tl_deferred;
}
static void on_rendezvous(int kind) {
  std::vector<Deferred>& d = deferred();
  const unsigned long ep = msl::rt::tg_epoch();
  std::vector<Deferred> keep;
  for (Deferred& x : d) {
    if (x.epoch != ep) continue;  // left over from an abandoned threadgroup
    if (x.kind == 0) {
      if (changed(x.where, x.bytes, x.elem) >= 0)
        msl::rt::report_error("matmul2d::run (line %u): its %s operand was overwritten before the execution scope's next "
                              "threadgroup_barrier (threads may still be reading it: barrier after run)", x.line, x.what);
    } else if (kind == 0 || kind == 2) {
      for (size_t i = 0; i < x.where.size(); i++) std::memcpy(x.where[i], x.bytes.data() + i * x.elem, x.elem);
    } else {
      keep.push_back(std::move(x));
    }
  }
  d = std::move(keep);
}
struct HookInstaller {
  HookInstaller() { msl::rt::add_tg_rendezvous_hook(&on_rendezvous); }
};
static HookInstaller hook_installer;

// Gather the rows x cols logical matrix an operand supplies (a transposed view stores it cols x rows: logical
// (r, c) is element (x = r, y = c)); elements outside the view's extents read as 0. Records each element's
// address and bytes, to see the operand overwritten while the scope may still read it.
template <class V, class Out>
void gather(const V& t, bool transpose, int rows, int cols, std::vector<Out>& out, std::vector<unsigned char*>& where,
            std::vector<unsigned char>& bytes) {
  using T = typename V::element_type;
  out.assign(size_t(rows) * cols, Out(0));
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < cols; c++) {
      const long x = transpose ? r : c, y = transpose ? c : r;
      if (!t.contains(x, y)) continue;
      T* p = t.at(x, y);
      const T v = *p;  // the one read of the element (the traffic build counts each)
      if constexpr (std::is_same_v<Out, double>) out[size_t(r) * cols + c] = to_f64(v);
      else out[size_t(r) * cols + c] = to_i64(v);
      where.push_back(reinterpret_cast<unsigned char*>(p));
      const unsigned char* b = reinterpret_cast<const unsigned char*>(&v);
      bytes.insert(bytes.end(), b, b + sizeof(T));
    }
}
}  // namespace emu

template <matmul2d_descriptor D, class Scope, class... Args> class matmul2d {
  static_assert(!D.relaxed_precision,
                "matmul2d: relaxed_precision = true lets the GPU trade accuracy for speed; torch_lowbit's kernels "
                "promise exact (int) or fp32-accumulated results and never set it");
  static_assert(D.m > 0 && D.n > 0, "matmul2d_descriptor: m and n are the destination tile's static size");

 public:
  static constexpr int S = [] {
    if constexpr (requires { Scope::simdgroups; }) return Scope::simdgroups;
    else return 0;
  }();
  static_assert(S > 0, "the emulator models matmul2d on execution_simdgroups<N> only");
  static constexpr int Threads = 32 * S;
  static constexpr matmul2d_descriptor descriptor = D;
  using scope = Scope;

  template <class L, class R, class E> using cooperative_tensor_destination_t =
      cooperative_destination<E, D.m, D.n, Threads>;
  template <class L, class R, class E, class... X> cooperative_tensor_destination_t<L, R, E>
  get_destination_cooperative_tensor() const {
    static_assert(emu::supported(emu::kind_of<typename L::element_type>(), emu::kind_of<typename R::element_type>(),
                                 emu::kind_of<E>()),
                  "matmul2d: this (left, right, destination) element type combination is not in Apple's table "
                  "(MPPTensorOpsMatMul2d.h) for the targeted OS");
    return cooperative_tensor_destination_t<L, R, E>();
  }

  template <class L, class R, class Dst>
  void run(const L& left, const R& right, Dst& dst, const std::source_location& loc = std::source_location::current()) const {
    using TL = typename L::element_type;
    using TR = typename R::element_type;
    using TD = typename Dst::element_type;
    constexpr emu::Kind kl = emu::kind_of<TL>(), kr = emu::kind_of<TR>(), kd = emu::kind_of<TD>();
    static_assert(emu::supported(kl, kr, kd),
                  "matmul2d: this (left, right, destination) element type combination is not in Apple's table "
                  "(MPPTensorOpsMatMul2d.h) for the targeted OS");
    static_assert(emu::is_int(kl) == emu::is_int(kd), "matmul2d: integer operands accumulate into int32");
    msl::rt::ThreadCtx* c = msl::rt::tl_cur;
    const uint32_t T = c->v3[int(msl::rt::BI::tptg)].x * c->v3[int(msl::rt::BI::tptg)].y * c->v3[int(msl::rt::BI::tptg)].z;
    if (T != uint32_t(Threads)) {
      msl::rt::report_error("matmul2d with execution_simdgroups<%d> run by a threadgroup of %u threads (needs %d: the "
                            "scope must be the whole threadgroup)", S, T, Threads);
    }
    // The first thread of the scope to enter reads the operands.
    emu::Run*& pending = emu::tl_pending_run;
    const unsigned long ep = msl::rt::tg_epoch();
    if (pending == nullptr || pending->epoch != ep) {
      delete pending;
      pending = new emu::Run();
      pending->epoch = ep;
      pending->line = loc.line();
      pending->left = emu::key_of(left), pending->right = emu::key_of(right);
      // the reduction length: the descriptor's k, or (dynamic) the left operand's K extent
      const int k_extent = int(D.transpose_left ? left.size(1) : left.size(0));
      pending->kk = D.k == int(metal::dynamic_extent) ? k_extent : D.k;
      emu::Run& p = *pending;
      p.left_elem = sizeof(TL), p.right_elem = sizeof(TR);
      // left as [m][k]; right as [n][k] (a right operand not transposed is stored k x n)
      if constexpr (emu::is_int(kl)) {
        emu::gather(left, D.transpose_left, D.m, p.kk, p.ai, p.left_where, p.left_bytes);
        emu::gather(right, !D.transpose_right, D.n, p.kk, p.bi, p.right_where, p.right_bytes);
      } else {
        emu::gather(left, D.transpose_left, D.m, p.kk, p.a, p.left_where, p.left_bytes);
        emu::gather(right, !D.transpose_right, D.n, p.kk, p.b, p.right_where, p.right_bytes);
      }
    } else if (!(pending->left == emu::key_of(left)) || !(pending->right == emu::key_of(right))) {
      msl::rt::report_error("matmul2d::run (line %u): the threads of the execution scope pass different operands "
                            "(every thread must pass the same left and right tensors)", loc.line());
    }
    emu::RunIn in{&dst, emu::key_of(left), emu::key_of(right), {}, &pending};
    if constexpr (!is_cooperative_v<Dst>) in.dest_view = emu::key_of(dst);
    msl::rt::block_tg_collective(&resolve<L, R, Dst>, &in, nullptr, loc);
  }

 private:
  // Called once per run, with every thread of the threadgroup (L[i]->in: its RunIn).
  template <class L, class R, class Dst> static void resolve(int n, msl::rt::ThreadCtx** lanes) {
    using TD = typename Dst::element_type;
    emu::Run** slot = static_cast<const emu::RunIn*>(lanes[0]->in)->pending;
    emu::Run* run = *slot;
    *slot = nullptr;
    if (run == nullptr) return;
    if (n != Threads) {
      msl::rt::report_error("matmul2d::run (line %u) reached by %d threads; execution_simdgroups<%d> needs all %d", run->line,
                            n, S, Threads);
      delete run;
      return;
    }
    // the operands were read when the first thread entered: a thread that wrote them before entering raced
    const long lc = emu::changed(run->left_where, run->left_bytes, run->left_elem);
    const long rc = emu::changed(run->right_where, run->right_bytes, run->right_elem);
    if (lc >= 0 || rc >= 0)
      msl::rt::report_error("matmul2d::run (line %u): its %s operand was written by a thread of the scope after the first "
                            "thread entered run (a threadgroup_barrier is missing before run)", run->line,
                            lc >= 0 ? "left" : "right");
    // and they must stay so until the scope's next rendezvous (a barrier after run before overwriting them)
    for (int side = 0; side < 2; side++) {
      emu::Deferred chk;
      chk.epoch = run->epoch, chk.kind = 0, chk.line = run->line, chk.what = side ? "right" : "left";
      chk.where = side ? run->right_where : run->left_where;
      chk.bytes = side ? run->right_bytes : run->left_bytes;
      chk.elem = side ? run->right_elem : run->left_elem;
      emu::deferred().push_back(std::move(chk));
    }
    const int M = D.m, N = D.n, K = run->kk;
    const bool acc = D.matmul_mode == matmul2d_descriptor::mode::multiply_accumulate;
    const int order = msl::rt::tensor_sum_order();
    // the product of element (r, c), added to `prev` (the destination's value in accumulate mode)
    auto value = [&](int r, int c, const TD* prev) -> TD {
      if constexpr (std::is_integral_v<TD>) {
        int64_t s = 0;
        for (int k = 0; k < K; k++) s += run->ai[size_t(r) * K + k] * run->bi[size_t(c) * K + k];
        if (prev) s += int64_t(*prev);
        if (s < int64_t(INT32_MIN) || s > int64_t(INT32_MAX)) {
          msl::rt::report_error("matmul2d::run (line %u): int32 destination overflows at (row %d, column %d): %lld%s",
                                run->line, r, c, (long long)s,
                                prev ? " (multiply_accumulate onto a destination that was not zeroed?)" : "");
          return TD(0);
        }
        return TD(s);
      } else {
        auto p = [&](int k) { return float(run->a[size_t(r) * K + k]) * float(run->b[size_t(c) * K + k]); };
        float s = prev ? float(*prev) : 0.0f;
        if (order == 1) {
          for (int k = K - 1; k >= 0; k--) s += p(k);
        } else if (order == 2) {
          for (int k0 = 0; k0 < K; k0 += 8) {
            float part = 0.0f;
            for (int k = k0; k < K && k < k0 + 8; k++) part += p(k);
            s += part;
          }
        } else {
          for (int k = 0; k < K; k++) s += p(k);
        }
        return TD(s);
      }
    };
    if constexpr (is_cooperative_v<Dst>) {
      const emu::Layout& lay = emu::layout_for(M, N, Threads, Dst::Cap);
      bool reported = false;
      for (int i = 0; i < n; i++) {
        const emu::RunIn* in = static_cast<const emu::RunIn*>(lanes[i]->in);
        Dst& d = *static_cast<Dst*>(in->dest);
        const uint32_t t = lanes[i]->tiitg;
        for (int s = 0; s < Dst::Cap; s++) {
          const int e = lay.elem[size_t(t) * Dst::Cap + s];
          if (e < 0) continue;
          const TD prev = d.v[s];
          if (acc && emu::is_poison(prev) && !reported) {
            reported = true;
            msl::rt::report_error("matmul2d::run (line %u): multiply_accumulate onto a cooperative tensor element that "
                                  "was never written (the destination was not zeroed)", run->line);
          }
          d.v[s] = value(e / N, e % N, acc ? &prev : nullptr);
        }
      }
    } else {
      // a tensor in memory: poison now, the values at the next threadgroup_barrier
      const emu::RunIn* in0 = static_cast<const emu::RunIn*>(lanes[0]->in);
      for (int i = 1; i < n; i++)
        if (!(static_cast<const emu::RunIn*>(lanes[i]->in)->dest_view == in0->dest_view))
          msl::rt::report_error("matmul2d::run (line %u): the threads pass different destination tensors", run->line);
      const Dst& dv = *static_cast<const Dst*>(in0->dest);
      emu::Deferred w;
      w.epoch = run->epoch, w.kind = 1, w.elem = sizeof(TD), w.line = run->line;
      for (int r = 0; r < M; r++)
        for (int cc = 0; cc < N; cc++) {
          if (!dv.contains(cc, r)) continue;  // writes outside the extents are dropped
          TD* p = dv.at(cc, r);
          const TD prev = *p;
          const TD v = value(r, cc, acc ? &prev : nullptr);
          w.where.push_back(reinterpret_cast<unsigned char*>(p));
          w.bytes.insert(w.bytes.end(), reinterpret_cast<const unsigned char*>(&v),
                         reinterpret_cast<const unsigned char*>(&v) + sizeof(TD));
        }
      for (unsigned char* p : w.where) std::memset(p, 0xFF, sizeof(TD));
      emu::deferred().push_back(std::move(w));
    }
    delete run;
  }
};

}  // namespace mpp::tensor_ops

namespace metal {
template <class E, int M, int N, int T> using cooperative_tensor_of = mpp::tensor_ops::cooperative_destination<E, M, N, T>;
}
