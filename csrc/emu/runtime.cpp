// runtime.cpp -- executes MSL kernels compiled through msl_shim.h.
//
// Execution model: every GPU thread of a threadgroup is a fiber (own stack); one OS worker thread runs one
// threadgroup at a time, in rounds: each runnable fiber runs until it reaches a simd collective, a
// threadgroup_barrier, or the end of the kernel. Between rounds the scheduler resolves collectives (per
// simdgroup, over the lanes waiting at the same call site = the active lanes) and barriers (all live
// threads of the threadgroup must wait at the same barrier). Workers run different threadgroups in parallel;
// kernel-scope `threadgroup` variables are `static thread_local`, i.e. shared by the fibers of one worker.
#if defined(__APPLE__)
// macOS declares the (deprecated) ucontext routines, and a ucontext_t with room for the machine context, only
// under _XOPEN_SOURCE; that hides the BSD names (MAP_ANONYMOUS, MAP_NORESERVE) unless _DARWIN_C_SOURCE is set.
#define _XOPEN_SOURCE 700
#define _DARWIN_C_SOURCE 1
#endif
#include <signal.h>
#include <setjmp.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "msl_shim.h"
#include "msl_undef.h"
#include "../metal/limits.h"

// ---------------------------------------------------------------------------------------------- context switch
// x86-64 ELF: a 14-instruction switch of the callee-saved registers (no signal-mask syscalls, ~20x faster than
// swapcontext). Elsewhere (macOS arm64 included), or with -DMSL_EMU_UCONTEXT (AddressSanitizer builds): ucontext.
#if defined(__x86_64__) && defined(__ELF__) && !defined(MSL_EMU_UCONTEXT)
#define MSL_FAST_SWITCH 1
extern "C" void msl_switch(void** save_sp, void* new_sp);
asm(R"(
  .text
  .globl msl_switch
  .hidden msl_switch
  .type msl_switch,@function
msl_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size msl_switch,.-msl_switch
)");
#endif

namespace msl::rt {

enum State { RUNNABLE = 0, AT_SIMD = 1, AT_BARRIER = 2, DONE = 3 };

struct Launch {
  KernelThunk k;
  LaunchParams p;
  std::atomic<uint64_t> next{0};
  uint64_t ntg = 0;
};

struct Worker {
#ifdef MSL_FAST_SWITCH
  void* sched;
  std::vector<void*> uc;  // saved stack pointer of each fiber
#else
  ucontext_t sched;
  std::vector<ucontext_t> uc;
#endif
  std::vector<ThreadCtx> ctx;
  std::vector<char*> stacks;
  std::vector<char> tgmem[8];
  unsigned long epoch = 0;
  size_t tg_static_bytes = 0;  // kernel-scope threadgroup arrays touched by this threadgroup so far
  sigjmp_buf recover;
  bool in_tg = false;
  std::vector<char> altstack;
};

thread_local ThreadCtx* tl_cur = nullptr;
static thread_local Worker* tl_worker = nullptr;
static const size_t kStack = [] { const char* e = getenv("MSL_EMU_STACK_KB"); return size_t(e ? atoi(e) : 256) * 1024; }();
static const size_t kPage = size_t(sysconf(_SC_PAGESIZE));
// threadgroup epochs, unique across launches: a worker's first threadgroup must not match a threadgroup
// array's epoch left from an earlier launch on the same OS thread (it would skip the poisoning)
static std::atomic<unsigned long> g_epoch{0};
// MSL_EMU_SCHED=rev runs the fibers of a round in reverse thread order and the simdgroups one at a time, the last
// first, from barrier to barrier (shakes out different races)
// (the test suite flips it per launch through msl_emu_set_reverse)
static std::atomic<bool> g_reverse{[] { const char* e = getenv("MSL_EMU_SCHED"); return e && std::string(e) == "rev"; }()};

// threadgroup variables at their promised alignment only (msl_runtime.h TgVar); msl_emu_set_natural_tg_alignment
static std::atomic<bool> g_natural_tg_alignment{true};
size_t tg_var_offset(size_t natural, size_t declared) {
  const size_t a = declared > natural ? declared : natural;
  return g_natural_tg_alignment.load(std::memory_order_relaxed) && a < 16 ? a : 0;
}

// ---------------------------------------------------------------------------------------------- errors
static std::mutex g_err_mu;
static std::string g_err;
static int g_nerr = 0;
static thread_local int tl_warned_divergence = 0;

static std::string where() {
  ThreadCtx* c = tl_cur;
  if (!c) return "";
  char b[200];
  snprintf(b, sizeof b, " [threadgroup (%u,%u,%u) thread (%u,%u,%u) simdgroup %u lane %u]", c->v3[2].x, c->v3[2].y, c->v3[2].z,
           c->v3[1].x, c->v3[1].y, c->v3[1].z, c->sg, c->lane);
  return b;
}
void report_error(const char* fmt, ...) {
  char b[600];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(b, sizeof b, fmt, ap);
  va_end(ap);
  std::lock_guard<std::mutex> g(g_err_mu);
  if (++g_nerr <= 20) g_err += std::string("error: ") + b + where() + "\n";
}
static void report_warning(const std::string& s) {
  std::lock_guard<std::mutex> g(g_err_mu);
  if (g_err.size() < 8000) g_err += "warning: " + s + "\n";
}
const char* errors_text() { return g_err.c_str(); }

// ---------------------------------------------------------------------------------------------- registry
static std::map<std::string, KernelThunk>& registry() { static std::map<std::string, KernelThunk> m; return m; }
void register_kernel(const char* n, KernelThunk k) { registry()[n] = k; }
KernelThunk find_kernel(const char* n) { auto it = registry().find(n); return it == registry().end() ? nullptr : it->second; }

// ---------------------------------------------------------------------------------------------- kernel-side hooks
u3 builtin_value(BI b) {
  ThreadCtx* c = tl_cur;
  switch (b) {
    case BI::tpig: case BI::tpitg: case BI::tgpig: case BI::tptg: case BI::tgpg: case BI::tpg: return c->v3[int(b)];
    case BI::tiitg: return {c->tiitg, 0, 0};
    case BI::tiisg: return {c->lane, 0, 0};
    case BI::sgitg: return {c->sg, 0, 0};
    case BI::tpsg: return {c->tpsg, 0, 0};
    case BI::sgptg: return {c->sgptg, 0, 0};
    case BI::tiiqg: return {c->lane % 4, 0, 0};
    case BI::qgitg: return {c->tiitg / 4, 0, 0};
  }
  return {0, 0, 0};
}
[[noreturn]] static void abandon_threadgroup();
void* buffer_ptr(int i) {
  void* p = tl_cur->launch->p.buffers[i];
  if (!p) {
    report_error("kernel '%s' takes [[buffer(%d)]], which the launch bound as nil (an empty tensor: mps binds those "
                 "as nil, and Metal's validation layer rejects the dispatch; the plan must return before it)",
                 tl_cur->launch->p.kernel, i);
    abandon_threadgroup();
  }
  return p;
}
void* tg_buffer_ptr(int i) { return tl_worker->tgmem[i].data(); }
void (*trace_tg_hook)(void*, size_t) = nullptr;
void (*launch_hook)(const char*, const LaunchParams*, bool) = nullptr;
const LaunchParams* current_launch() { return tl_cur ? &tl_cur->launch->p : nullptr; }
static size_t dynamic_tg_bytes(const LaunchParams& p) {
  size_t n = 0;
  for (size_t b : p.tg_mem_sizes) n += b;
  return n;
}
void tg_poison(void* p, size_t n, unsigned long* ep) {  // first toucher in each threadgroup fills with 0xFF (NaN / -1)
  Worker* w = tl_worker;
  if (*ep != w->epoch) {
    *ep = w->epoch;
    memset(p, 0xFF, n);
    if (trace_tg_hook) trace_tg_hook(p, n);
    w->tg_static_bytes += n;
    const size_t dyn = dynamic_tg_bytes(tl_cur->launch->p);
    if (w->tg_static_bytes + dyn > lowbit::metal::kMaxThreadgroupMemoryBytes) {
      report_error("kernel '%s' uses %zu bytes of threadgroup memory (%zu in threadgroup arrays, %zu in "
                   "[[threadgroup(i)]] buffers); Apple GPUs allow %llu", tl_cur->launch->p.kernel,
                   w->tg_static_bytes + dyn, w->tg_static_bytes, dyn,
                   (unsigned long long)lowbit::metal::kMaxThreadgroupMemoryBytes);
      abandon_threadgroup();
    }
  }
}
void misaligned_vector(const void* p, size_t align, size_t bytes, bool store) {
  Worker* w = tl_worker;
  if (!w || !w->in_tg || !tl_cur) return;  // host code, not a GPU thread
  const uintptr_t a = uintptr_t(p);
  const LaunchParams& lp = tl_cur->launch->p;
  char at[200];
  snprintf(at, sizeof at, "%p in threadgroup or thread memory (a threadgroup array is aligned at alignof(T) "
           "only: declare it `alignas(%zu) threadgroup ...`)", p, align);
  for (int i = 0; i < 31; i++) {
    const uintptr_t s = uintptr_t(lp.buffers[i]);
    if (s && a >= s && a < s + lp.buffer_sizes[i])
      snprintf(at, sizeof at, "byte offset %zu of [[buffer(%d)]] (bound at device offset %zu modulo 64)", size_t(a - s), i,
               size_t(s % 64));
  }
  for (int i = 0; i < 8; i++) {
    const uintptr_t s = uintptr_t(w->tgmem[i].data());
    if (!w->tgmem[i].empty() && a >= s && a < s + w->tgmem[i].size())
      snprintf(at, sizeof at, "byte offset %zu of [[threadgroup(%d)]]", size_t(a - s), i);
  }
  report_error("kernel '%s': misaligned %zu-byte vector %s at %s (MSL needs %zu-byte alignment)", lp.kernel, bytes,
               store ? "store" : "load", at, align);
  abandon_threadgroup();
}
static void block(int state) {
  ThreadCtx* c = tl_cur;
  c->state = state;
#ifdef MSL_FAST_SWITCH
  msl_switch(static_cast<void**>(c->fiber), tl_worker->sched);
#else
  swapcontext(static_cast<ucontext_t*>(c->fiber), &tl_worker->sched);
#endif
}
void block_collective(Resolver r, const void* in, void* out, const std::source_location& loc) {
  ThreadCtx* c = tl_cur;
  c->resolver = r, c->in = in, c->out = out;
  c->site_line = loc.line(), c->site_col = loc.column(), c->site_file = loc.file_name();
  block(AT_SIMD);
}
void block_barrier(const std::source_location& loc) {
  ThreadCtx* c = tl_cur;
  c->resolver = nullptr;  // a plain barrier (a tensor op's rendezvous sets its resolver: block_tg_collective)
  c->site_line = loc.line(), c->site_col = loc.column(), c->site_file = loc.file_name();
  block(AT_BARRIER);
}

// A collective of the whole threadgroup (a Metal 4 tensor op on execution_simdgroups<N>, msl_tensor.h): it waits
// like a threadgroup_barrier, and when every live thread has arrived at the same call site the scheduler calls
// `r` once with all of them.
void block_tg_collective(Resolver r, const void* in, void* out, const std::source_location& loc) {
  ThreadCtx* c = tl_cur;
  c->resolver = r, c->in = in, c->out = out;
  c->site_line = loc.line(), c->site_col = loc.column(), c->site_file = loc.file_name();
  block(AT_BARRIER);
}
unsigned long tg_epoch() { return tl_worker ? tl_worker->epoch : 0; }
static void (*g_rendezvous_hooks[256])(int);
static std::atomic<int> g_nrendezvous_hooks{0};
void add_tg_rendezvous_hook(void (*hook)(int)) {  // at static initialisation, one per kernel translation unit
  const int i = g_nrendezvous_hooks.fetch_add(1);
  if (i < 256) g_rendezvous_hooks[i] = hook;
}
static void tg_rendezvous(int kind) {
  const int n = std::min(g_nrendezvous_hooks.load(), 256);
  for (int i = 0; i < n; i++) g_rendezvous_hooks[i](kind);
}
// The tensor-op model's switches (msl_emu_set_tensor_ops): the cooperative-tensor layout and the float sum order
static std::atomic<int> g_tensor_layout{0}, g_tensor_sum_order{0};
static std::atomic<unsigned> g_tensor_seed{1};
int tensor_layout() { return g_tensor_layout.load(); }
int tensor_sum_order() { return g_tensor_sum_order.load(); }
unsigned tensor_seed() { return g_tensor_seed.load(); }

// ---------------------------------------------------------------------------------------------- scheduler
static void fiber_entry() {
  tl_cur->launch->k();
  tl_cur->state = DONE;
#ifdef MSL_FAST_SWITCH
  void* dead;
  msl_switch(&dead, tl_worker->sched);  // never resumed
  __builtin_unreachable();
#endif
}  // ucontext: returns through uc_link to the scheduler

static void init_fiber(Worker& w, uint32_t t) {
#ifdef MSL_FAST_SWITCH
  void** sp = reinterpret_cast<void**>((uintptr_t(w.stacks[t]) + kStack) & ~uintptr_t(15));
  *--sp = nullptr;                                   // fake return address of fiber_entry (keeps the ABI alignment)
  *--sp = reinterpret_cast<void*>(&fiber_entry);     // where msl_switch's `ret` lands
  for (int i = 0; i < 6; i++) *--sp = nullptr;       // rbp rbx r12..r15
  w.uc[t] = sp;
#else
  getcontext(&w.uc[t]);
  w.uc[t].uc_stack.ss_sp = w.stacks[t];
  w.uc[t].uc_stack.ss_size = kStack;
  w.uc[t].uc_link = &w.sched;
  makecontext(&w.uc[t], fiber_entry, 0);
#endif
}

static bool same_site(const ThreadCtx& a, const ThreadCtx& b) {
  return a.site_line == b.site_line && a.site_col == b.site_col && a.resolver == b.resolver;
}

// fiber stacks (PROT_NONE guard page at the bottom) are pooled across launches
static std::mutex g_stack_mu;
static std::vector<char*> g_stack_pool;
static char* get_stack() {
  {
    std::lock_guard<std::mutex> g(g_stack_mu);
    if (!g_stack_pool.empty()) { char* s = g_stack_pool.back(); g_stack_pool.pop_back(); return s; }
  }
  char* m = static_cast<char*>(mmap(nullptr, kStack + kPage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  mprotect(m, kPage, PROT_NONE);
  return m + kPage;
}

static void run_threadgroup(Worker& w, Launch& L, u3 tg) {
  const u3 ts = L.p.tg_size;
  const uint32_t T = ts.x * ts.y * ts.z, nsg = (T + 31) / 32;
  while (w.stacks.size() < T) w.stacks.push_back(get_stack());
  w.ctx.resize(T);
  w.uc.resize(T);
  w.epoch = ++g_epoch;
  w.tg_static_bytes = 0;
  for (int i = 0; i < 8; i++) {
    w.tgmem[i].assign(L.p.tg_mem_sizes[i], char(0xFF));
  }
  for (uint32_t t = 0; t < T; t++) {
    ThreadCtx& c = w.ctx[t];
    u3 pit{t % ts.x, (t / ts.x) % ts.y, t / (ts.x * ts.y)};
    c.v3[int(BI::tpitg)] = pit;
    c.v3[int(BI::tgpig)] = tg;
    c.v3[int(BI::tptg)] = ts;
    c.v3[int(BI::tgpg)] = L.p.tgs;
    c.v3[int(BI::tpg)] = {L.p.tgs.x * ts.x, L.p.tgs.y * ts.y, L.p.tgs.z * ts.z};
    c.v3[int(BI::tpig)] = {tg.x * ts.x + pit.x, tg.y * ts.y + pit.y, tg.z * ts.z + pit.z};
    c.tiitg = t, c.lane = t % 32, c.sg = t / 32, c.tpsg = 32, c.sgptg = nsg;
    c.state = RUNNABLE, c.launch = &L, c.fiber = &w.uc[t];
    init_fiber(w, t);
  }
  if (sigsetjmp(w.recover, 0)) {  // a fiber faulted (on_segv, abandon_threadgroup): abandon this threadgroup
    tl_cur = nullptr;
    return;
  }
  w.in_tg = true;
  const bool reverse = g_reverse.load();
  // In reverse order the simdgroups also run one at a time, the last first, each until all its lanes wait at a
  // threadgroup_barrier or have finished: a schedule a GPU may run (one simdgroup far ahead of the others) that
  // lockstep rounds never produce. It shows a missing barrier between the simdgroups' reads of threadgroup
  // memory and its next overwrite, which rounds hide when those reads end in a simd collective (an MMA).
  uint32_t running_sg = nsg - 1;
  for (;;) {
    for (uint32_t i = 0; i < T; i++) {
      const uint32_t t = reverse ? T - 1 - i : i;
      if (reverse && t / 32 != running_sg) continue;
      if (w.ctx[t].state == RUNNABLE) {
        tl_cur = &w.ctx[t];
#ifdef MSL_FAST_SWITCH
        msl_switch(&w.sched, w.uc[t]);
#else
        swapcontext(&w.sched, &w.uc[t]);
#endif
      }
    }
    tl_cur = nullptr;
    bool progress = false, live = false;
    for (uint32_t t = 0; t < T; t++) live |= w.ctx[t].state != DONE;
    for (uint32_t s = 0; s < nsg; s++) {  // simd collectives, per simdgroup and call site
      ThreadCtx* lanes[32];
      int n = 0, nlive = 0;
      for (uint32_t t = s * 32; t < std::min(T, s * 32 + 32); t++) {
        if (w.ctx[t].state != DONE) nlive++;
        if (w.ctx[t].state == AT_SIMD) lanes[n++] = &w.ctx[t];
      }
      if (n == 0) continue;
      progress = true;
      if (n != nlive || !std::all_of(lanes, lanes + n, [&](ThreadCtx* c) { return same_site(*c, *lanes[0]); })) {
        if (!tl_warned_divergence++) {
          char b[300];
          snprintf(b, sizeof b, "simdgroup %u of threadgroup (%u,%u,%u): lanes wait at different simd ops/barriers (e.g. line %u); "
                   "resolved per call site, reconvergence is not modelled", s, tg.x, tg.y, tg.z, lanes[0]->site_line);
          report_warning(b);
        }
      }
      bool used[32] = {};
      for (int i = 0; i < n; i++) {
        if (used[i]) continue;
        ThreadCtx* grp[32];
        int m = 0;
        for (int j = i; j < n; j++)
          if (!used[j] && same_site(*lanes[j], *lanes[i])) used[j] = true, grp[m++] = lanes[j];
        grp[0]->resolver(m, grp);
        for (int j = 0; j < m; j++) grp[j]->state = RUNNABLE;
      }
    }
    if (!live) break;
    if (progress) continue;
    if (reverse && running_sg > 0) {  // this simdgroup waits at the barrier or is done: run the next one
      running_sg--;
      continue;
    }
    running_sg = nsg - 1;
    // every live thread waits at a threadgroup_barrier
    ThreadCtx* first = nullptr;
    int ndone = 0;
    for (uint32_t t = 0; t < T; t++) {
      ThreadCtx& c = w.ctx[t];
      if (c.state == DONE) { ndone++; continue; }
      if (!first) first = &c;
      else if (c.site_line != first->site_line || c.site_col != first->site_col) {
        tl_cur = &c;
        report_error("threads of one threadgroup wait at different threadgroup_barriers (lines %u and %u)", first->site_line, c.site_line);
        tl_cur = nullptr;
      }
    }
    if (ndone) {
      tl_cur = first;
      report_error("%d threads exited the kernel while others wait at threadgroup_barrier (line %u): undefined behaviour in Metal",
                   ndone, first->site_line);
      tl_cur = nullptr;
    }
    if (first && first->resolver) {  // a tensor op's rendezvous (block_tg_collective)
      tg_rendezvous(1);
      std::vector<ThreadCtx*> all;
      for (uint32_t t = 0; t < T; t++)
        if (w.ctx[t].state == AT_BARRIER) all.push_back(&w.ctx[t]);
      tl_cur = first;
      first->resolver(int(all.size()), all.data());
      tl_cur = nullptr;
    } else {
      tg_rendezvous(0);
    }
    for (uint32_t t = 0; t < T; t++)
      if (w.ctx[t].state == AT_BARRIER) w.ctx[t].state = RUNNABLE;
  }
  tg_rendezvous(2);  // results still pending reach memory when the threadgroup ends
  w.in_tg = false;
}

// ---------------------------------------------------------------------------------------------- faults
static std::atomic<Launch*> g_launch{nullptr};
static struct sigaction g_prev_segv, g_prev_bus;
// A fault outside a running GPU thread belongs to the host process (Python, torch): hand it to whoever
// handled it before us, so their crash reporting still works.
static void chain(int sig, siginfo_t* si, void* uc) {
  const struct sigaction& p = sig == SIGBUS ? g_prev_bus : g_prev_segv;
  if (p.sa_flags & SA_SIGINFO) { if (p.sa_sigaction) { p.sa_sigaction(sig, si, uc); return; } }
  else if (p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN) { p.sa_handler(sig); return; }
  signal(sig, SIG_DFL);
  raise(sig);
}
static void on_segv(int sig, siginfo_t* si, void* uc) {
  Worker* w = tl_worker;
  if (!w || !w->in_tg || !tl_cur) { chain(sig, si, uc); return; }
  char b[300];
  uintptr_t a = uintptr_t(si->si_addr);
  const char* what = "an address outside every buffer";
  int idx = -1;
  long off = 0;
  if (Launch* L = g_launch.load())
    for (int i = 0; i < 31; i++) {
      uintptr_t s = uintptr_t(L->p.buffers[i]), e = s + L->p.buffer_sizes[i];
      if (s && a >= e && a < e + 2 * kPage) idx = i, off = long(a - s), what = "past the end of [[buffer(%d)]]";
      if (s && a < s && a + 2 * kPage >= s) idx = i, off = long(a - s), what = "before the start of [[buffer(%d)]]";
    }
  char w2[120];
  snprintf(w2, sizeof w2, what, idx);
  snprintf(b, sizeof b, "memory fault at %p: %s (byte offset %ld, buffer size %zu)", si->si_addr, w2, off,
           idx >= 0 ? g_launch.load()->p.buffer_sizes[idx] : size_t(0));
  report_error("%s", b);
  w->in_tg = false;
  siglongjmp(w->recover, 1);
}
// A fault found by a check in the shim or runtime (already reported): leave the running fiber for good.
static void abandon_threadgroup() {
  Worker* w = tl_worker;
  w->in_tg = false;
  siglongjmp(w->recover, 1);
}
static void install_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa{};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigaction(SIGSEGV, &sa, &g_prev_segv);
    sigaction(SIGBUS, &sa, &g_prev_bus);
  });
}

// ---------------------------------------------------------------------------------------------- launch
static std::mutex g_launch_mu;  // errors, the fault map and g_launch are process-global: one launch at a time
int launch(KernelThunk k, const LaunchParams& p) {
  {
    std::lock_guard<std::mutex> g(g_err_mu);
    g_err.clear(), g_nerr = 0;
  }
  install_handlers();
  Launch L;
  L.k = k, L.p = p;
  L.ntg = uint64_t(p.tgs.x) * p.tgs.y * p.tgs.z;
  g_launch = &L;
  int nw = p.workers;
  if (const char* e = getenv("MSL_EMU_WORKERS")) nw = atoi(e);
  if (nw <= 0) nw = int(std::thread::hardware_concurrency());
  nw = int(std::max<uint64_t>(1, std::min<uint64_t>(uint64_t(nw), L.ntg)));
  auto body = [&L] {
    tl_warned_divergence = 0;  // one divergence warning per worker and launch (the calling thread is reused)
    Worker w;
    w.altstack.resize(64 * 1024);
    stack_t ss{};
    ss.ss_sp = w.altstack.data(), ss.ss_size = w.altstack.size();
    sigaltstack(&ss, nullptr);
    tl_worker = &w;
    for (uint64_t i; (i = L.next++) < L.ntg;) {
      u3 tg{uint32_t(i % L.p.tgs.x), uint32_t((i / L.p.tgs.x) % L.p.tgs.y), uint32_t(i / (uint64_t(L.p.tgs.x) * L.p.tgs.y))};
      run_threadgroup(w, L, tg);
    }
    {
      std::lock_guard<std::mutex> g(g_stack_mu);
      g_stack_pool.insert(g_stack_pool.end(), w.stacks.begin(), w.stacks.end());
    }
    ss.ss_flags = SS_DISABLE;
    sigaltstack(&ss, nullptr);
    tl_worker = nullptr;
  };
  std::vector<std::thread> th;
  for (int i = 1; i < nw; i++) th.emplace_back(body);
  body();
  for (auto& t : th) t.join();
  g_launch = nullptr;
  return g_nerr;
}

}  // namespace msl::rt

// ---------------------------------------------------------------------------------------------- C API (ctypes)
// Buffers are copied into guarded allocations: the data starts at the address residue modulo 64 it has on the
// device (mps binds a buffer at storage_offset * element_size from a page-aligned MTLBuffer, so misaligned
// vector loads show) and ends as close as that allows (< 64 bytes of poisoned slack) to a PROT_NONE page, so
// reading past the end faults and is reported with the buffer index and offset.
namespace {
struct Guarded {
  char* base = nullptr;
  size_t total = 0;
  char* data = nullptr;
};
constexpr size_t kResidueModulus = 64;
Guarded alloc_guarded(size_t n, size_t residue) {
  const size_t pg = msl::rt::kPage;
  size_t body = (n + pg - 1) / pg * pg + pg;  // at least one page of slack before the data
  Guarded g;
  g.total = body + pg;
  g.base = static_cast<char*>(mmap(nullptr, g.total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  mprotect(g.base + body, pg, PROT_NONE);
  residue %= kResidueModulus;
  g.data = g.base + ((body - n - residue) & ~(kResidueModulus - 1)) + residue;
  memset(g.base, 0xFF, body);  // the slack (< 16 bytes) between data end and the guard page stays poisoned
  return g;
}

// A write that lands in the poisoned slack around a buffer (past its end but short of the guard page, or in
// the page before its start) does not fault: find it afterwards by the poison it overwrote. Appends one error
// line to err and returns 1 when a byte changed (a write of 0xFF bytes there goes unseen).
int check_slack(int idx, const Guarded& g, size_t n, std::string& err) {
  const char* end = g.base + g.total - msl::rt::kPage;
  char b[200];
  for (const char* q = g.data + n; q < end; q++)
    if (*q != char(0xFF)) {
      snprintf(b, sizeof b, "error: the kernel wrote past the end of [[buffer(%d)]] (byte offset %ld, buffer size %zu)\n",
               idx, long(q - g.data), n);
      err += b;
      return 1;
    }
  for (const char* q = g.base; q < g.data; q++)
    if (*q != char(0xFF)) {
      snprintf(b, sizeof b, "error: the kernel wrote before the start of [[buffer(%d)]] (byte offset %ld)\n", idx,
               long(q - g.data));
      err += b;
      return 1;
    }
  return 0;
}
// Metal's launch limits (csrc/metal/limits.h), checked before anything runs: one error line per broken limit.
std::string launch_limit_errors(const char* kernel, int nbuf, const size_t* sizes, const int* flags,
                                const msl::rt::LaunchParams& p) {
  namespace L = lowbit::metal;
  std::string err;
  char b[300];
  const uint64_t threads = uint64_t(p.tg_size.x) * p.tg_size.y * p.tg_size.z;
  if (threads == 0 || threads > L::kMaxThreadsPerThreadgroup) {
    snprintf(b, sizeof b, "error: kernel '%s': %llu threads per threadgroup (%u,%u,%u); Apple GPUs allow 1 to %llu\n",
             kernel, (unsigned long long)threads, p.tg_size.x, p.tg_size.y, p.tg_size.z,
             (unsigned long long)L::kMaxThreadsPerThreadgroup);
    err += b;
  }
  size_t dyn = 0;
  for (size_t m : p.tg_mem_sizes) dyn += m;
  if (dyn > L::kMaxThreadgroupMemoryBytes) {
    snprintf(b, sizeof b, "error: kernel '%s': %zu bytes of [[threadgroup(i)]] memory; Apple GPUs allow %llu\n", kernel,
             dyn, (unsigned long long)L::kMaxThreadgroupMemoryBytes);
    err += b;
  }
  const uint32_t groups[3] = {p.tgs.x, p.tgs.y, p.tgs.z}, per[3] = {p.tg_size.x, p.tg_size.y, p.tg_size.z};
  for (int d = 0; d < 3; d++)
    if (uint64_t(groups[d]) * per[d] > L::kMaxThreadsPerGridDim) {
      snprintf(b, sizeof b, "error: kernel '%s': grid dimension %c has %u threadgroups x %u threads = %llu thread "
               "positions, past the 32-bit thread_position_in_grid\n", kernel, "xyz"[d], groups[d], per[d],
               (unsigned long long)(uint64_t(groups[d]) * per[d]));
      err += b;
    }
  for (int i = 0; i < nbuf; i++)
    if ((flags[i] & 4) && sizes[i] > L::kMaxSetBytesBytes) {
      snprintf(b, sizeof b, "error: kernel '%s': value [[buffer(%d)]] has %zu bytes; setBytes allows %llu\n", kernel, i,
               sizes[i], (unsigned long long)L::kMaxSetBytesBytes);
      err += b;
    }
  return err;
}
}  // namespace

// The libraries build with hidden visibility (setup.py emu_flags); their C API, found by dlsym, is exported.
#pragma GCC visibility push(default)
extern "C" {
// flags per buffer: 1 = copy back to host after the run, 2 = output only (start poisoned with 0xFF, not copied in),
// 4 = a value (setBytes: at most 4 KiB). residues (may be null: all 0): each buffer's byte offset on the device
// (storage_offset * element_size); the copy is bound at an address with the same residue modulo 64.
// Not reentrant across threads by design: msl_emu_run holds g_launch_mu for the launch and the error text.
// The error text of the launch (errors, then warnings) is copied into errbuf (NUL-terminated, cut at errcap).
int msl_emu_run(const char* kernel, int nbuf, void** host, const size_t* sizes, const int* flags,
                const size_t* residues, const unsigned* grid, const unsigned* tg, const size_t* tg_mem, int workers,
                char* errbuf, size_t errcap) {
  if (errbuf && errcap) errbuf[0] = 0;
  msl::rt::KernelThunk k = msl::rt::find_kernel(kernel);
  if (!k) return -1;
  std::lock_guard<std::mutex> launch_guard(msl::rt::g_launch_mu);
  msl::rt::LaunchParams p;
  p.tgs = {grid[0], grid[1], grid[2]};
  p.tg_size = {tg[0], tg[1], tg[2]};
  p.workers = workers;
  p.kernel = kernel;
  for (int i = 0; i < 8 && tg_mem; i++) p.tg_mem_sizes[i] = tg_mem[i];
  const std::string refused = launch_limit_errors(kernel, nbuf, sizes, flags, p);
  if (!refused.empty()) {
    if (errbuf && errcap) snprintf(errbuf, errcap, "%s", refused.c_str());
    return 1;
  }
  std::vector<Guarded> g(nbuf);
  for (int i = 0; i < nbuf; i++) {
    if (!host[i]) continue;
    g[i] = alloc_guarded(sizes[i], residues ? residues[i] : 0);
    if (!(flags[i] & 2)) memcpy(g[i].data, host[i], sizes[i]);
    p.buffers[i] = g[i].data, p.buffer_sizes[i] = sizes[i];
  }
  if (msl::rt::launch_hook) msl::rt::launch_hook(kernel, &p, true);
  int ne = msl::rt::launch(k, p);
  if (msl::rt::launch_hook) msl::rt::launch_hook(kernel, &p, false);
  std::string err = msl::rt::errors_text();
  for (int i = 0; i < nbuf; i++)
    if (host[i]) ne += check_slack(i, g[i], sizes[i], err);
  if (errbuf && errcap) snprintf(errbuf, errcap, "%s", err.c_str());
  for (int i = 0; i < nbuf; i++) {
    if (!host[i]) continue;
    if (flags[i] & 1) memcpy(host[i], g[i].data, sizes[i]);
    munmap(g[i].base, g[i].total);
  }
  return ne;
}
void msl_emu_set_reverse(int on) { msl::rt::g_reverse = on != 0; }
// layout: 0 a plausible M5 cooperative-tensor layout, 1 a permutation drawn from seed; sum_order: 0 k ascending,
// 1 k descending, 2 8-wide partial sums (msl_tensor.h)
void msl_emu_set_tensor_ops(int layout, int sum_order, unsigned seed) {
  msl::rt::g_tensor_layout = layout, msl::rt::g_tensor_sum_order = sum_order, msl::rt::g_tensor_seed = seed;
}
// 1 (the default): threadgroup variables at the alignment MSL promises them; 0: 16 bytes (msl_runtime.h TgVar)
void msl_emu_set_natural_tg_alignment(int on) { msl::rt::g_natural_tg_alignment = on != 0; }
int msl_emu_has_kernel(const char* kernel) { return msl::rt::find_kernel(kernel) != nullptr; }
}
#pragma GCC visibility pop
