// cuda_emu.h — CUDA emulation for running cp-hicache kernel renders on the CPU.
//
// Force-included (`-include cuda_emu.h`) when a render is compiled into a shared library:
//   c++ -std=c++17 -O2 -fPIC -shared -DCP_HICACHE_EMU -include cuda_emu.h -x c++ k.cu -o k.so
//
// Model (see docs/KERNELS.md, "Host emulation"):
// - Blocks run one after another on the calling OS thread, forward or reverse. Reverse also
//   reverses the threads: at the start of a block and after every rendezvous the ready
//   threads run highest index first, so a kernel that needs a barrier it lacks (thread 0
//   must not overtake thread 17) fails in one of the two orders.
// - Each thread of a block is a fiber with its own stack. Fibers switch only at rendezvous
//   points: __syncthreads* and the warp intrinsics. Fibers are never preempted, so atomics
//   are plain read-modify-write operations and data races inside a block are hidden.
// - A rendezvous completes when every non-exited thread of its group (the block for barriers,
//   the lanes of `mask` for warp intrinsics) has arrived at the same intrinsic with the same
//   mask. Lanes that exited are not waited for; a shuffle that reads an exited or
//   non-participating lane returns the caller's own value.
// - When no fiber can run and some have not exited (deadlock), or threads of one group meet at
//   different intrinsics (mismatch), the launch is abandoned (no unwinding, the fiber stacks
//   are simply reused later) and a diagnostic naming the kernel, the block, the threads and
//   the intrinsics (with source lines) is returned through CpEmuLaunch::err_buf.
// - __shared__ variables are thread_local with the default TLS model (initial-exec would make
//   dlopen fail). They keep their values between blocks and launches on the same OS thread,
//   so kernels that read uninitialised shared memory give block-order dependent results.
// - The kernel entry `<name>__emu_launch` is safe to call from several OS threads at once;
//   it must not be called recursively from inside a kernel.
//
// Context switch: hand-written x86-64 (callee-saved registers, rsp, MXCSR, x87 control word);
// other architectures, or -DCP_EMU_FORCE_UCONTEXT, use ucontext (slower: swapcontext makes a
// signal-mask system call per switch).
// ASan: with -fsanitize=address every switch is annotated with
// __sanitizer_start_switch_fiber / __sanitizer_finish_switch_fiber and reused stacks are
// unpoisoned. The process loading such a library needs the ASan runtime preloaded.
//
// This header deliberately does not define u8, u16, u32, u64, i32 or i64: renders typedef
// those themselves.
#pragma once
#ifndef CP_HICACHE_CUDA_EMU_H
#define CP_HICACHE_CUDA_EMU_H

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <csetjmp>
#include <ctime>
#include <tuple>
#include <type_traits>
#include <utility>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__x86_64__)
// SSE2 only (_mm_stream_si128/_si32, _mm_sfence): <immintrin.h> would double every kernel's
// compile time.
#include <emmintrin.h>
#endif

#if !defined(__x86_64__) || defined(CP_EMU_FORCE_UCONTEXT)
#define CP_EMU_USE_UCONTEXT 1
#include <ucontext.h>
#else
#define CP_EMU_USE_UCONTEXT 0
#endif

#if defined(__SANITIZE_ADDRESS__)
#define CP_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CP_EMU_ASAN 1
#endif
#endif
#ifndef CP_EMU_ASAN
#define CP_EMU_ASAN 0
#endif
#if CP_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// ---------------------------------------------------------------------------------------------
// Qualifiers and attributes
// ---------------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
// Default TLS model on purpose: initial-exec TLS makes dlopen of the library fail.
#define __shared__ static thread_local

// ---------------------------------------------------------------------------------------------
// Vector types and built-in variables
// ---------------------------------------------------------------------------------------------
struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
};
struct __align__(16) uint4 {
  unsigned int x, y, z, w;
};
struct __align__(16) int4 {
  int x, y, z, w;
};
struct __align__(8) uint2 {
  unsigned int x, y;
};
struct __align__(16) ulonglong2 {
  unsigned long long x, y;
};
static inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  return uint4{x, y, z, w};
}
static inline int4 make_int4(int x, int y, int z, int w) { return int4{x, y, z, w}; }
static inline uint2 make_uint2(unsigned int x, unsigned int y) { return uint2{x, y}; }
static inline uint3 make_uint3(unsigned int x, unsigned int y, unsigned int z) { return uint3{x, y, z}; }

// Updated by the scheduler on every fiber switch.
static thread_local uint3 threadIdx;
static thread_local uint3 blockIdx;
static thread_local dim3 blockDim;
static thread_local dim3 gridDim;
static constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Launch ABI (mirrored by src/exec/host/ffi.rs; bump CP_EMU_ABI_VERSION on any change)
// ---------------------------------------------------------------------------------------------
#define CP_EMU_ABI_VERSION 1u
#define CP_EMU_FLAG_REVERSE 1u
// Largest fiber stack a launch may ask for (mirrored by HostOptions in src/exec/host/mod.rs);
// larger requests are refused rather than rounded past the top of the address range.
#define CP_EMU_MAX_STACK_BYTES (64ull << 20)
// madvise(MADV_GUARD_INSTALL), from Linux 6.13's <linux/mman.h>; older headers lack it.
#define CP_EMU_MADV_GUARD_INSTALL 102
// Fiber stacks a thread's pool keeps between launches where guards split mappings (see the end
// of `launch`); with guard regions every pool is kept.
#define CP_EMU_KEEP_STACKS 256u
// Inaccessible bytes below every fiber stack (rounded up to whole pages).
#define CP_EMU_GUARD_BYTES (64u << 10)

extern "C" {
/// Launch configuration passed to `<name>__emu_launch`.
struct CpEmuLaunch {
  uint32_t abi_version;       // must be CP_EMU_ABI_VERSION
  uint32_t grid[3];           // blocks in x, y, z
  uint32_t block[3];          // threads per block in x, y, z
  uint32_t dyn_shared_bytes;  // must be 0: dynamic shared memory is not emulated
  uint32_t flags;             // CP_EMU_FLAG_REVERSE: run blocks, and ready threads, last to first
  uint32_t num_params;        // number of entries in params (checked against the kernel)
  uint64_t stack_bytes;       // fiber stack size, 0 = default
  const uint64_t* param_sizes;  // optional: byte size of each parameter (checked)
  char* err_buf;              // optional: receives a NUL-terminated diagnostic
  uint64_t err_cap;           // size of err_buf in bytes
};

/// The calling OS thread's fiber-stack pool in this library, as `cp_emu_stack_stats` reports
/// it (mirrored by src/exec/host/ffi.rs). Counts cover the thread's lifetime.
struct CpEmuStackStats {
  uint64_t maps;           // chunks of stacks mapped (one mmap each)
  uint64_t unmaps;         // chunks unmapped (one munmap each)
  uint64_t stacks_mapped;  // stacks mapped, all chunks together
  uint64_t stacks_live;    // stacks held now
  uint64_t stack_bytes;    // size of every stack: the largest a launch asked so far (0: none)
  uint32_t guard_regions;  // 1: guards are MADV_GUARD_INSTALL regions, every pool is kept;
                           // 0: PROT_NONE ranges (or nothing mapped yet)
  uint32_t reserved;       // 0
};
}

/// Status codes returned by `<name>__emu_launch`.
enum CpEmuStatus : int {
  CP_EMU_OK = 0,
  CP_EMU_EINVAL = 1,     // bad launch configuration or parameters
  CP_EMU_EDEADLOCK = 2,  // no thread can proceed
  CP_EMU_EMISMATCH = 3,  // threads of one group met at different intrinsics / masks
  CP_EMU_EMASK = 4,      // a warp intrinsic's mask does not contain the calling lane
  CP_EMU_ENOMEM = 5,     // fiber stacks could not be allocated
  CP_EMU_ETRAP = 6,      // __trap() was called
  CP_EMU_EABI = 7,       // cfg->abi_version differs: nothing else in cfg was read or written
};

// Everything internal has internal linkage (unnamed namespace): nothing but the launch entries
// is exported, so two libraries built in different modes (asm / ucontext / ASan) can never
// interpose each other's helpers, even if one is loaded RTLD_GLOBAL.
namespace cp_emu {
namespace {

// ---------------------------------------------------------------------------------------------
// Execution contexts
// ---------------------------------------------------------------------------------------------
#if !CP_EMU_USE_UCONTEXT
struct Ctx {
  void* sp;
};

// Saves callee-saved registers, MXCSR and the x87 control word on the current stack, stores
// rsp into *save, switches to `to` and restores the same from there.
__attribute__((naked, noinline)) static void ctx_swap_raw(void** /*save*/, void* /*to*/) {
  __asm__ volatile(
      "pushq %rbp\n\t"
      "pushq %rbx\n\t"
      "pushq %r12\n\t"
      "pushq %r13\n\t"
      "pushq %r14\n\t"
      "pushq %r15\n\t"
      "subq $8, %rsp\n\t"
      "stmxcsr (%rsp)\n\t"
      "fnstcw 4(%rsp)\n\t"
      "movq %rsp, (%rdi)\n\t"
      "movq %rsi, %rsp\n\t"
      "ldmxcsr (%rsp)\n\t"
      "fldcw 4(%rsp)\n\t"
      "addq $8, %rsp\n\t"
      "popq %r15\n\t"
      "popq %r14\n\t"
      "popq %r13\n\t"
      "popq %r12\n\t"
      "popq %rbx\n\t"
      "popq %rbp\n\t"
      "ret\n\t");
}

static inline void ctx_swap(Ctx* save, Ctx* to) { ctx_swap_raw(&save->sp, to->sp); }

static inline void ctx_init(Ctx* c, char* lo, size_t size, void (*entry)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(lo) + size) & ~static_cast<uintptr_t>(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  uint32_t mxcsr;
  uint16_t fpucw;
  __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
  __asm__ volatile("fnstcw %0" : "=m"(fpucw));
  *--sp = 0;                                     // fake return address of entry (never used)
  *--sp = reinterpret_cast<uint64_t>(entry);     // popped by `ret`
  for (int i = 0; i < 6; ++i) *--sp = 0;         // rbp rbx r12 r13 r14 r15
  *--sp = static_cast<uint64_t>(mxcsr) | (static_cast<uint64_t>(fpucw) << 32);
  // After the swap pops everything, `ret` leaves rsp == top - 8 (≡ 8 mod 16), as after a call.
  c->sp = sp;
}
#else
struct Ctx {
  ucontext_t uc;
};
static inline void ctx_swap(Ctx* save, Ctx* to) { swapcontext(&save->uc, &to->uc); }
static inline void ctx_init(Ctx* c, char* lo, size_t size, void (*entry)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = lo;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, entry, 0);
}
#endif

// ---------------------------------------------------------------------------------------------
// Fibers and the per-OS-thread scheduler
// ---------------------------------------------------------------------------------------------
enum Kind : uint8_t {
  K_NONE,
  K_BAR_SYNC,
  K_BAR_COUNT,
  K_BAR_AND,
  K_BAR_OR,
  K_SYNCWARP,
  K_BALLOT,
  K_ANY,
  K_ALL,
  K_SHFL,
  K_SHFL_UP,
  K_SHFL_DOWN,
  K_SHFL_XOR,
  K_MATCH_ANY,
};
static inline bool is_barrier(Kind k) { return k >= K_BAR_SYNC && k <= K_BAR_OR; }
static inline const char* kind_name(Kind k) {
  switch (k) {
    case K_BAR_SYNC: return "__syncthreads";
    case K_BAR_COUNT: return "__syncthreads_count";
    case K_BAR_AND: return "__syncthreads_and";
    case K_BAR_OR: return "__syncthreads_or";
    case K_SYNCWARP: return "__syncwarp";
    case K_BALLOT: return "__ballot_sync";
    case K_ANY: return "__any_sync";
    case K_ALL: return "__all_sync";
    case K_SHFL: return "__shfl_sync";
    case K_SHFL_UP: return "__shfl_up_sync";
    case K_SHFL_DOWN: return "__shfl_down_sync";
    case K_SHFL_XOR: return "__shfl_xor_sync";
    case K_MATCH_ANY: return "__match_any_sync";
    default: return "?";
  }
}

enum State : uint8_t { S_READY, S_WAIT, S_EXIT };

struct Fiber {
  Ctx ctx;
  char* stack_lo;
  uint3 tid;
  unsigned linear;
  State state;
  Kind kind;
  int line;
  unsigned mask;
  int arg;
  int width;
  uint64_t val;
  uint64_t res;
};

// Fiber stacks and descriptors, reused across blocks and launches on this OS thread.
//
// Stacks only grow: they keep the largest size any launch on this thread asked of this library
// (a launch asking less runs on the larger stacks), and a launch with more threads per block
// maps the stacks it lacks in one more chunk. So kernels that alternate on a thread (another
// stack size, another block size) map nothing once the pool is large enough: unmapping and
// remapping the stacks per launch made the CPU executor spend most of its time in mmap,
// munmap, TLB shootdowns and first-touch page clearing. A chunk is one mapping holding
// `count` slots of [guard][stack], the guard at the low end of every stack.
struct Chunk {
  char* base;
  size_t bytes;
  unsigned count;  // stacks in the chunk
};

enum GuardMode : uint8_t { G_UNKNOWN, G_REGIONS, G_PROT_NONE };

struct Pool {
  Fiber* fibers = nullptr;
  char** stacks = nullptr;
  Chunk* chunks = nullptr;
  unsigned cap = 0;        // descriptors (and stack slots) allocated
  unsigned nstacks = 0;    // stacks mapped
  unsigned nchunks = 0;    // chunks mapped
  unsigned chunk_cap = 0;  // chunk descriptors allocated
  size_t stack_bytes = 0;  // size of every mapped stack: the largest asked so far
  size_t guard = 0;
  GuardMode guard_mode = G_UNKNOWN;
  uint64_t n_maps = 0;           // chunks mapped, over the thread's lifetime
  uint64_t n_unmaps = 0;         // chunks unmapped
  uint64_t n_stacks_mapped = 0;  // stacks mapped
  void unmap_last_chunk() {
    Chunk& c = chunks[--nchunks];
    munmap(c.base, c.bytes);
    nstacks -= c.count;
    n_unmaps++;
  }
  void release_stacks() {
    while (nchunks > 0) unmap_last_chunk();
  }
  ~Pool() {
    release_stacks();
    free(chunks);
    free(stacks);
    free(fibers);
  }
  // Guard at the low end of the stack slot at `lo`: a stack overflow faults instead of
  // corrupting a neighbour. A guard region (Linux 6.13+) does not split the mapping, so a chunk
  // stays one mapping however many stacks it holds, and neighbouring chunks merge: pools of
  // many kernels on many threads stay far below vm.max_map_count. Older kernels refuse it;
  // then the guard is a PROT_NONE range, two mappings per stack (see the end of `launch`).
  bool install_guard(char* lo) {
    if (guard_mode != G_PROT_NONE) {
      if (madvise(lo, guard, CP_EMU_MADV_GUARD_INSTALL) == 0) {
        guard_mode = G_REGIONS;
        return true;
      }
      if (guard_mode == G_REGIONS) return false;  // worked before: a real failure
    }
    guard_mode = G_PROT_NONE;
    return mprotect(lo, guard, PROT_NONE) == 0;
  }
  // Ensures n fibers with stacks of at least `bytes` each; false when out of memory.
  bool ensure(unsigned n, size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    // The guard spans CP_EMU_GUARD_BYTES (whole pages): a frame that skips past a single
    // page without touching it (code built without -fstack-clash-protection) still lands in
    // it. It is address space only (never committed).
    if (guard == 0) guard = (CP_EMU_GUARD_BYTES + page - 1) & ~(page - 1);
    if (bytes > CP_EMU_MAX_STACK_BYTES) return false;  // also keeps the rounding from wrapping
    bytes = (bytes + page - 1) & ~(page - 1);
    if (bytes > stack_bytes) {
      // Grow only: the smaller stacks go, every later launch asking up to `bytes` reuses these.
      release_stacks();
      stack_bytes = bytes;
    }
    if (n > cap) {
      Fiber* nf = static_cast<Fiber*>(realloc(fibers, sizeof(Fiber) * n));
      if (!nf) return false;
      fibers = nf;
      char** ns = static_cast<char**>(realloc(stacks, sizeof(char*) * n));
      if (!ns) return false;
      stacks = ns;
      cap = n;
    }
    if (nstacks >= n) return true;
    if (nchunks == chunk_cap) {
      unsigned nc = chunk_cap ? chunk_cap * 2 : 4;
      Chunk* cs = static_cast<Chunk*>(realloc(chunks, sizeof(Chunk) * nc));
      if (!cs) return false;
      chunks = cs;
      chunk_cap = nc;
    }
    const unsigned count = n - nstacks;
    const size_t slot = stack_bytes + guard;  // at most 64 MiB + guard: no overflow below
    const size_t total = slot * count;        // count <= 1024 threads per block
    void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    n_maps++;
    char* base = static_cast<char*>(p);
    for (unsigned i = 0; i < count; ++i) {
      if (!install_guard(base + i * slot)) {
        munmap(p, total);
        n_unmaps++;
        return false;
      }
    }
    chunks[nchunks++] = Chunk{base, total, count};
    for (unsigned i = 0; i < count; ++i) stacks[nstacks++] = base + i * slot + guard;
    n_stacks_mapped += count;
    return true;
  }
};

struct Sched {
  Fiber* f;              // fibers of the current block
  unsigned n;            // threads per block
  unsigned* q;           // ready queue (fiber indices)
  unsigned qhead, qlen;
  Fiber* cur;            // running fiber, nullptr on the scheduler
  Ctx main;              // the scheduler's context
  unsigned n_alive;
  unsigned n_bar;
  bool abort;
  int status;
  const char* kernel;
  void (*body)(void*);
  void* body_ctx;
  char* err;
  size_t err_cap;
  bool in_launch;
  bool direct;           // one thread per block: runs on the scheduler's stack, no fibers
  bool reverse;          // ready threads run highest index first
  sigjmp_buf direct_abort;
#if CP_EMU_ASAN
  const void* main_lo;
  size_t main_size;
  bool from_main;
#endif
};

static thread_local Sched g;
static thread_local Pool g_pool;
static thread_local unsigned* g_queue = nullptr;
static thread_local unsigned g_queue_cap = 0;

static inline void set_builtins(const Fiber* f) { threadIdx = f->tid; }

// Switches from the current context (fiber `from`, or the scheduler when null) to `to` (a fiber,
// or the scheduler when null). `exiting` marks a fiber that will never be resumed.
static inline void switch_ctx(Fiber* from, Fiber* to, bool exiting) {
  Ctx* save = from ? &from->ctx : &g.main;
  Ctx* target = to ? &to->ctx : &g.main;
  g.cur = to;
  if (to) set_builtins(to);
#if CP_EMU_ASAN
  void* fake = nullptr;
  const void* lo = to ? static_cast<const void*>(to->stack_lo) : g.main_lo;
  size_t sz = to ? g_pool.stack_bytes : g.main_size;
  g.from_main = (from == nullptr);
  __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, lo, sz);
  ctx_swap(save, target);
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#else
  (void)exiting;
  ctx_swap(save, target);
#endif
}

// The ready queue is filled only while no fiber runs (block start, `resolve`), in ascending
// thread order, so taking from the back runs exactly that round in descending order.
static inline Fiber* pop_ready() {
  if (g.qhead == g.qlen) return nullptr;
  return &g.f[g.q[g.reverse ? --g.qlen : g.qhead++]];
}

// Hands the OS thread to the next ready fiber, or back to the scheduler.
static inline void yield_from(Fiber* self, bool exiting) { switch_ctx(self, pop_ready(), exiting); }

// ---------------------------------------------------------------------------------------------
// Diagnostics
// ---------------------------------------------------------------------------------------------
__attribute__((format(printf, 1, 2))) static void err_append(const char* fmt, ...) {
  if (!g.err || g.err_cap == 0) return;
  size_t used = strnlen(g.err, g.err_cap);
  if (used + 1 >= g.err_cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g.err + used, g.err_cap - used, fmt, ap);
  va_end(ap);
}

static void err_begin(const char* what) {
  if (g.err && g.err_cap) g.err[0] = '\0';
  err_append("kernel `%s`, block (%u,%u,%u) of grid (%u,%u,%u), %u threads per block: %s", g.kernel ? g.kernel : "?",
             blockIdx.x, blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, g.n, what);
}

static bool same_wait(const Fiber& a, const Fiber& b) {
  if (a.state != b.state) return false;
  if (a.state != S_WAIT) return true;
  return a.kind == b.kind && a.line == b.line && a.mask == b.mask;
}

// Appends "; threads A-B: <where>" for every run of threads in the same situation.
static void err_threads() {
  unsigned i = 0;
  while (i < g.n) {
    unsigned j = i;
    while (j + 1 < g.n && same_wait(g.f[i], g.f[j + 1])) ++j;
    const Fiber& f = g.f[i];
    if (i == j)
      err_append("; thread %u: ", i);
    else
      err_append("; threads %u-%u: ", i, j);
    if (f.state == S_EXIT)
      err_append("exited");
    else if (f.state == S_READY)
      err_append("runnable");
    else if (is_barrier(f.kind))
      err_append("waiting at %s (line %d)", kind_name(f.kind), f.line);
    else
      err_append("waiting at %s(mask 0x%08x) (line %d)", kind_name(f.kind), f.mask, f.line);
    i = j + 1;
  }
}

// Aborts the launch from inside a fiber: the fiber is abandoned, never resumed.
[[noreturn]] static void fail_from_fiber(int status) {
  g.abort = true;
  g.status = status;
  if (g.direct) siglongjmp(g.direct_abort, 1);  // kernel frames are plain C: nothing to unwind
  switch_ctx(g.cur, nullptr, true);
  __builtin_trap();
}

// ---------------------------------------------------------------------------------------------
// Rendezvous resolution (runs on the scheduler when no fiber is ready)
// ---------------------------------------------------------------------------------------------
static inline void make_ready(Fiber& f) {
  f.state = S_READY;
  g.q[g.qlen++] = f.linear;
}

static void resolve_warp_group(unsigned base, unsigned part) {
  Fiber* w = g.f + base;
  Kind k = w[__builtin_ctz(part)].kind;
  uint64_t bits = 0;
  for (unsigned m = part; m; m &= m - 1) {
    unsigned j = __builtin_ctz(m);
    if (w[j].val != 0) bits |= 1ull << j;
  }
  for (unsigned m = part; m; m &= m - 1) {
    unsigned j = __builtin_ctz(m);
    Fiber& f = w[j];
    unsigned width = static_cast<unsigned>(f.width);
    if (width == 0 || width > 32 || (width & (width - 1))) width = 32;
    // PTX shfl.sync semantics: the segment is [seg, max_lane]; only the low 5 bits of the
    // lane / offset operand count; a computed source outside the allowed range reads the own
    // value. For up the limit is the segment start, for down and xor the segment end (so a
    // butterfly may read from an earlier segment, e.g. lane 19 ^ 16 at width 16 reads lane 3).
    unsigned seg = j & ~(width - 1);
    unsigned max_lane = seg | (width - 1);
    unsigned b = static_cast<unsigned>(f.arg) & 31u;
    int src = static_cast<int>(j);
    switch (k) {
      case K_SYNCWARP: f.res = 0; break;
      case K_BALLOT: f.res = bits; break;
      case K_ANY: f.res = bits != 0; break;
      case K_ALL: f.res = bits == part; break;
      case K_MATCH_ANY: {
        uint64_t r = 0;
        for (unsigned q = part; q; q &= q - 1) {
          unsigned t = __builtin_ctz(q);
          if (w[t].val == f.val) r |= 1ull << t;
        }
        f.res = r;
        break;
      }
      case K_SHFL: src = static_cast<int>(seg | (b & (width - 1))); break;
      case K_SHFL_UP:
        if (j >= seg + b) src = static_cast<int>(j - b);
        break;
      case K_SHFL_DOWN:
        if (j + b <= max_lane) src = static_cast<int>(j + b);
        break;
      case K_SHFL_XOR:
        if ((j ^ b) <= max_lane) src = static_cast<int>(j ^ b);
        break;
      default: break;
    }
    if (k >= K_SHFL && k <= K_SHFL_XOR) {
      // Reading a lane that does not take part (outside mask, exited) returns the own value.
      f.res = ((part >> src) & 1u) ? w[src].val : f.val;
    }
  }
  for (unsigned m = part; m; m &= m - 1) make_ready(w[__builtin_ctz(m)]);
}

// Returns true when at least one group completed; otherwise writes the diagnostic.
static bool resolve() {
  g.qhead = g.qlen = 0;
  if (g.n_bar > 0 && g.n_bar == g.n_alive) {
    Kind k = K_NONE;
    int line = 0;
    bool mixed = false;
    uint64_t count = 0;
    for (unsigned i = 0; i < g.n; ++i) {
      Fiber& f = g.f[i];
      if (f.state != S_WAIT) continue;
      if (k == K_NONE) {
        k = f.kind;
        line = f.line;
      }
      // A different variant, or the same one at another source line, is a divergent barrier.
      if (f.kind != k || f.line != line) mixed = true;
      count += f.val != 0;
    }
    if (mixed) {
      err_begin("mismatched barriers: threads of the block wait at different barriers (divergent __syncthreads)");
      err_threads();
      g.status = CP_EMU_EMISMATCH;
      return false;
    }
    uint64_t r = 0;
    switch (k) {
      case K_BAR_COUNT: r = count; break;
      case K_BAR_AND: r = count == g.n_alive; break;
      case K_BAR_OR: r = count != 0; break;
      default: break;
    }
    for (unsigned i = 0; i < g.n; ++i) {
      Fiber& f = g.f[i];
      if (f.state != S_WAIT) continue;
      f.res = r;
      make_ready(f);
    }
    g.n_bar = 0;
    return true;
  }
  bool mismatch = false;
  for (unsigned base = 0; base < g.n; base += 32) {
    unsigned cnt = g.n - base < 32 ? g.n - base : 32;
    Fiber* w = g.f + base;
    unsigned alive = 0;
    for (unsigned j = 0; j < cnt; ++j)
      if (w[j].state != S_EXIT) alive |= 1u << j;
    unsigned done = 0;
    for (unsigned j = 0; j < cnt; ++j) {
      Fiber& f = w[j];
      if (f.state != S_WAIT || is_barrier(f.kind) || ((done >> j) & 1u)) continue;
      unsigned part = f.mask & alive;
      bool ok = true;
      for (unsigned m = part; m; m &= m - 1) {
        const Fiber& o = w[__builtin_ctz(m)];
        if (o.state != S_WAIT || o.kind != f.kind || o.mask != f.mask) {
          ok = false;
          if (o.state == S_WAIT && !is_barrier(o.kind)) mismatch = true;
        }
      }
      if (ok) {
        done |= part;
        resolve_warp_group(base, part);
      }
    }
  }
  if (g.qlen > 0) return true;
  if (mismatch) {
    err_begin("mismatched warp intrinsics: lanes of one group wait at different intrinsics or masks");
    g.status = CP_EMU_EMISMATCH;
  } else {
    err_begin("deadlock: no thread can proceed");
    g.status = CP_EMU_EDEADLOCK;
  }
  err_threads();
  return false;
}

// Called by the intrinsics on the running fiber.
static inline uint64_t rendezvous(Kind k, int line, unsigned mask, uint64_t val, int arg, int width) {
  Fiber* f = g.cur;
  f->kind = k;
  f->line = line;
  f->mask = mask;
  f->val = val;
  f->arg = arg;
  f->width = width;
  if (is_barrier(k)) {
    g.n_bar++;
  } else if (!((mask >> (f->linear & 31u)) & 1u)) {
    err_begin("warp intrinsic mask does not contain the calling lane");
    err_append("; thread %u (lane %u) at %s(mask 0x%08x) (line %d)", f->linear, f->linear & 31u, kind_name(k), mask,
               line);
    fail_from_fiber(CP_EMU_EMASK);
  }
  f->state = S_WAIT;
  if (g.direct && is_barrier(k)) {
    // The only thread of the block: count/and/or of one predicate is the predicate itself.
    g.n_bar = 0;
    f->state = S_READY;
    return k == K_BAR_SYNC ? 0 : val;
  }
  if (g.direct) {
    // The only thread of the block: every group is complete as soon as it arrives.
    resolve();
    g.qhead = g.qlen = 0;
    return f->res;
  }
  yield_from(f, false);
  return f->res;
}

static void fiber_entry() {
#if CP_EMU_ASAN
  const void* lo = nullptr;
  size_t sz = 0;
  __sanitizer_finish_switch_fiber(nullptr, &lo, &sz);
  if (g.from_main) {
    g.main_lo = lo;
    g.main_size = sz;
  }
#endif
  g.body(g.body_ctx);
  Fiber* self = g.cur;
  self->state = S_EXIT;
  g.n_alive--;
  yield_from(self, true);
  __builtin_trap();  // an exited fiber is never resumed
}

// Runs one block; returns CP_EMU_OK or an error status (diagnostic already written).
static int run_block() {
  for (unsigned i = 0; i < g.n; ++i) {
    Fiber& f = g.f[i];
    f.linear = i;
    f.tid = uint3{i % blockDim.x, (i / blockDim.x) % blockDim.y, i / (blockDim.x * blockDim.y)};
    f.state = S_READY;
    f.kind = K_NONE;
    f.stack_lo = g_pool.stacks[i];
#if CP_EMU_ASAN
    ASAN_UNPOISON_MEMORY_REGION(f.stack_lo, g_pool.stack_bytes);
#endif
    ctx_init(&f.ctx, f.stack_lo, g_pool.stack_bytes, fiber_entry);
    g.q[i] = i;
  }
  g.qhead = 0;
  g.qlen = g.n;
  g.n_alive = g.n;
  g.n_bar = 0;
  for (;;) {
    Fiber* f = pop_ready();
    if (!f) {
      if (g.n_alive == 0) return CP_EMU_OK;
      if (!resolve()) return g.status;
      continue;
    }
    switch_ctx(nullptr, f, false);
    if (g.abort) return g.status;
  }
}

// Runs a one-thread block directly on the calling stack (no fiber switch at all).
static int run_block_direct() {
  Fiber& f = g.f[0];
  f.linear = 0;
  f.tid = uint3{0, 0, 0};
  f.state = S_READY;
  f.kind = K_NONE;
  g.cur = &f;
  set_builtins(&f);
  g.n_alive = 1;
  g.n_bar = 0;
  if (sigsetjmp(g.direct_abort, 0) != 0) return g.status;
  g.body(g.body_ctx);
  f.state = S_EXIT;
  return CP_EMU_OK;
}

static int launch(const char* kernel, const CpEmuLaunch* cfg, unsigned arity, const uint64_t* sizes,
                  void (*body)(void*), void* ctx) {
  // Only abi_version may be read before it is known to match: another version may lay out
  // every other field (err_buf included) differently.
  if (cfg->abi_version != CP_EMU_ABI_VERSION) return CP_EMU_EABI;
  g.err = cfg->err_buf;
  g.err_cap = cfg->err_buf ? static_cast<size_t>(cfg->err_cap) : 0;
  if (g.err && g.err_cap) g.err[0] = '\0';
  g.kernel = kernel;
  if (g.in_launch) {
    err_append("kernel `%s`: recursive launch from inside a kernel is not supported", kernel);
    return CP_EMU_EINVAL;
  }
  if (cfg->num_params != arity) {
    err_append("kernel `%s`: %u parameters passed, the kernel takes %u", kernel, cfg->num_params, arity);
    return CP_EMU_EINVAL;
  }
  if (cfg->param_sizes) {
    for (unsigned i = 0; i < arity; ++i) {
      if (cfg->param_sizes[i] != sizes[i]) {
        err_append("kernel `%s`: parameter %u has %llu bytes, the kernel expects %llu", kernel, i,
                   static_cast<unsigned long long>(cfg->param_sizes[i]), static_cast<unsigned long long>(sizes[i]));
        return CP_EMU_EINVAL;
      }
    }
  }
  if (body == nullptr) {
    // Every other reason the entry passes no body was reported above.
    err_append("kernel `%s`: params is null, the kernel takes %u parameters", kernel, arity);
    return CP_EMU_EINVAL;
  }
  if (cfg->stack_bytes > CP_EMU_MAX_STACK_BYTES) {
    err_append("kernel `%s`: fiber stack of %llu bytes requested, the limit is %llu", kernel,
               static_cast<unsigned long long>(cfg->stack_bytes), CP_EMU_MAX_STACK_BYTES);
    return CP_EMU_EINVAL;
  }
  const uint32_t* gr = cfg->grid;
  const uint32_t* bl = cfg->block;
  // CUDA's limits, so that a shape the emulator runs also launches on a GPU.
  if (!gr[0] || !gr[1] || !gr[2] || !bl[0] || !bl[1] || !bl[2] || gr[0] > 0x7fffffffu || gr[1] > 65535 ||
      gr[2] > 65535 || bl[2] > 64 || static_cast<uint64_t>(bl[0]) * bl[1] * bl[2] > 1024) {
    err_append("kernel `%s`: invalid launch shape grid (%u,%u,%u) block (%u,%u,%u)", kernel, gr[0], gr[1], gr[2], bl[0],
               bl[1], bl[2]);
    return CP_EMU_EINVAL;
  }
  if (cfg->dyn_shared_bytes != 0) {
    err_append("kernel `%s`: dynamic shared memory (%u bytes) is not supported by the host emulator", kernel,
               cfg->dyn_shared_bytes);
    return CP_EMU_EINVAL;
  }
  unsigned n = bl[0] * bl[1] * bl[2];
#if CP_EMU_ASAN
  size_t stack = cfg->stack_bytes ? static_cast<size_t>(cfg->stack_bytes) : (size_t)256 << 10;
#else
  size_t stack = cfg->stack_bytes ? static_cast<size_t>(cfg->stack_bytes) : (size_t)64 << 10;
#endif
  if (stack < 16384) stack = 16384;
  if (!g_pool.ensure(n, stack)) {
    err_append("kernel `%s`: cannot allocate %u fiber stacks of %zu bytes", kernel, n, stack);
    return CP_EMU_ENOMEM;
  }
  if (g_queue_cap < n) {
    unsigned* q = static_cast<unsigned*>(realloc(g_queue, sizeof(unsigned) * n));
    if (!q) {
      err_append("kernel `%s`: out of memory", kernel);
      return CP_EMU_ENOMEM;
    }
    g_queue = q;
    g_queue_cap = n;
  }
  g.f = g_pool.fibers;
  g.q = g_queue;
  g.n = n;
  g.cur = nullptr;
  g.abort = false;
  g.status = CP_EMU_OK;
  g.body = body;
  g.body_ctx = ctx;
  g.in_launch = true;
  g.direct = (n == 1);
  blockDim = dim3(bl[0], bl[1], bl[2]);
  gridDim = dim3(gr[0], gr[1], gr[2]);
  uint64_t gxy = static_cast<uint64_t>(gr[0]) * gr[1];
  uint64_t total = gxy * gr[2];
  bool reverse = (cfg->flags & CP_EMU_FLAG_REVERSE) != 0;
  g.reverse = reverse;
  int status = CP_EMU_OK;
  for (uint64_t i = 0; i < total && status == CP_EMU_OK; ++i) {
    uint64_t b = reverse ? total - 1 - i : i;
    blockIdx = uint3{static_cast<unsigned>(b % gr[0]), static_cast<unsigned>((b / gr[0]) % gr[1]),
                     static_cast<unsigned>(b / gxy)};
    status = g.direct ? run_block_direct() : run_block();
  }
  g.cur = nullptr;
  g.in_launch = false;
  g.direct = false;
  // Every kernel library has its own pool per OS thread (this header is compiled into each).
  // With guard regions a chunk of stacks is one mapping, so every pool is kept. Where guards
  // are PROT_NONE ranges (kernels before 6.13) each stack is two mappings: kept for every
  // large-block kernel on every thread, they exhaust vm.max_map_count (65,530 by default)
  // once a few ranks' threads have run 512-thread transfers, so there the chunks past
  // CP_EMU_KEEP_STACKS stacks are given back after the launch.
  while (g_pool.guard_mode == G_PROT_NONE && g_pool.nstacks > CP_EMU_KEEP_STACKS) g_pool.unmap_last_chunk();
  return status;
}

// Type-erased kernel invocation: the arguments are copied once per launch; each thread gets its
// own by-value copies, as on the GPU.
template <class... A>
struct Call {
  void (*fn)(A...);
  std::tuple<std::decay_t<A>...> args;
  static void run(void* p) {
    Call* c = static_cast<Call*>(p);
    std::apply(c->fn, c->args);
  }
};

template <class T>
static T load_param(void* p) {
  static_assert(std::is_trivially_copyable<T>::value, "kernel parameters must be trivially copyable");
  T v;
  std::memcpy(static_cast<void*>(&v), p, sizeof(T));
  return v;
}

template <class... A, size_t... I>
static int launch_entry_impl(const char* name, void (*fn)(A...), const CpEmuLaunch* cfg, void** params,
                             std::index_sequence<I...>) {
  static const uint64_t sizes[sizeof...(A) + 1] = {sizeof(std::decay_t<A>)..., 0};
  if (cfg->num_params != sizeof...(A) || (sizeof...(A) > 0 && params == nullptr)) {
    return launch(name, cfg, sizeof...(A), sizes, nullptr, nullptr);  // reports arity or null params
  }
  // Check every size before reading any parameter: a parameter shorter than the kernel's
  // type must be reported, never read past its end.
  for (size_t i = 0; cfg->param_sizes != nullptr && i < sizeof...(A); ++i) {
    if (cfg->param_sizes[i] != sizes[i]) {
      return launch(name, cfg, sizeof...(A), sizes, nullptr, nullptr);  // reports the size error
    }
  }
  Call<A...> call{fn, std::tuple<std::decay_t<A>...>(load_param<std::decay_t<A>>(params[I])...)};
  return launch(name, cfg, sizeof...(A), sizes, &Call<A...>::run, &call);
}

template <class... A>
static int launch_entry(const char* name, void (*fn)(A...), const CpEmuLaunch* cfg, void** params) {
  if (cfg == nullptr) return CP_EMU_EINVAL;
  // The version first: num_params and param_sizes are only meaningful in this ABI.
  if (cfg->abi_version != CP_EMU_ABI_VERSION) return CP_EMU_EABI;
  const int rc = launch_entry_impl(name, fn, cfg, params, std::index_sequence_for<A...>{});
#if defined(__x86_64__)
  // Orders the kernel's non-temporal stores (__stcs) before whatever the caller does next,
  // as the end of a CUDA launch orders its writes; plain stores need no fence on x86-64.
  _mm_sfence();
#endif
  return rc;
}

// ---------------------------------------------------------------------------------------------
// Intrinsic implementations (the public names below are macros that add the source line)
// ---------------------------------------------------------------------------------------------
template <class T>
static inline uint64_t to_bits(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp intrinsics take values up to 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
static inline T from_bits(uint64_t b) {
  T v;
  std::memcpy(static_cast<void*>(&v), &b, sizeof(T));
  return v;
}

static inline void syncthreads(int line) { rendezvous(K_BAR_SYNC, line, 0, 0, 0, 0); }
static inline int syncthreads_count(int line, int p) {
  return static_cast<int>(rendezvous(K_BAR_COUNT, line, 0, p != 0, 0, 0));
}
static inline int syncthreads_and(int line, int p) { return static_cast<int>(rendezvous(K_BAR_AND, line, 0, p != 0, 0, 0)); }
static inline int syncthreads_or(int line, int p) { return static_cast<int>(rendezvous(K_BAR_OR, line, 0, p != 0, 0, 0)); }
// `__syncwarp()` and `__syncwarp(mask)`: the line is bound first, the optional mask second.
struct SyncWarp {
  int line;
  void operator()(unsigned mask = 0xffffffffu) const { rendezvous(K_SYNCWARP, line, mask, 0, 0, 0); }
};
static inline unsigned ballot_sync(int line, unsigned mask, int p) {
  return static_cast<unsigned>(rendezvous(K_BALLOT, line, mask, p != 0, 0, 0));
}
static inline int any_sync(int line, unsigned mask, int p) { return static_cast<int>(rendezvous(K_ANY, line, mask, p != 0, 0, 0)); }
static inline int all_sync(int line, unsigned mask, int p) { return static_cast<int>(rendezvous(K_ALL, line, mask, p != 0, 0, 0)); }
template <class T>
static inline T shfl_sync(int line, unsigned mask, T v, int src, int width = 32) {
  return from_bits<T>(rendezvous(K_SHFL, line, mask, to_bits(v), src, width));
}
template <class T>
static inline T shfl_up_sync(int line, unsigned mask, T v, unsigned d, int width = 32) {
  return from_bits<T>(rendezvous(K_SHFL_UP, line, mask, to_bits(v), static_cast<int>(d), width));
}
template <class T>
static inline T shfl_down_sync(int line, unsigned mask, T v, unsigned d, int width = 32) {
  return from_bits<T>(rendezvous(K_SHFL_DOWN, line, mask, to_bits(v), static_cast<int>(d), width));
}
template <class T>
static inline T shfl_xor_sync(int line, unsigned mask, T v, int lane_mask, int width = 32) {
  return from_bits<T>(rendezvous(K_SHFL_XOR, line, mask, to_bits(v), lane_mask, width));
}
template <class T>
static inline unsigned match_any_sync(int line, unsigned mask, T v) {
  return static_cast<unsigned>(rendezvous(K_MATCH_ANY, line, mask, to_bits(v), 0, 0));
}
[[noreturn]] static inline void trap(int line) {
  err_begin("__trap() called");
  err_append("; thread %u (line %d)", g.cur ? g.cur->linear : 0u, line);
  fail_from_fiber(CP_EMU_ETRAP);
}

// %globaltimer's stand-in: nanoseconds of CLOCK_MONOTONIC, one clock for every thread and
// library of the process, as %globaltimer is one for every SM.
static inline uint64_t globaltimer_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1000000000u + static_cast<uint64_t>(ts.tv_nsec);
}

}  // namespace
}  // namespace cp_emu

// ---------------------------------------------------------------------------------------------
// Public intrinsic names
// ---------------------------------------------------------------------------------------------
#define __syncthreads() ::cp_emu::syncthreads(__LINE__)
#define __syncthreads_count(p) ::cp_emu::syncthreads_count(__LINE__, (p))
#define __syncthreads_and(p) ::cp_emu::syncthreads_and(__LINE__, (p))
#define __syncthreads_or(p) ::cp_emu::syncthreads_or(__LINE__, (p))
#define __syncwarp ::cp_emu::SyncWarp{__LINE__}
#define __ballot_sync(m, p) ::cp_emu::ballot_sync(__LINE__, (m), (p))
#define __any_sync(m, p) ::cp_emu::any_sync(__LINE__, (m), (p))
#define __all_sync(m, p) ::cp_emu::all_sync(__LINE__, (m), (p))
#define __shfl_sync(...) ::cp_emu::shfl_sync(__LINE__, __VA_ARGS__)
#define __shfl_up_sync(...) ::cp_emu::shfl_up_sync(__LINE__, __VA_ARGS__)
#define __shfl_down_sync(...) ::cp_emu::shfl_down_sync(__LINE__, __VA_ARGS__)
#define __shfl_xor_sync(...) ::cp_emu::shfl_xor_sync(__LINE__, __VA_ARGS__)
#define __match_any_sync(m, v) ::cp_emu::match_any_sync(__LINE__, (m), (v))
#define __trap() ::cp_emu::trap(__LINE__)

static inline void __threadfence() { __asm__ volatile("" ::: "memory"); }
static inline void __threadfence_block() { __asm__ volatile("" ::: "memory"); }

template <class T>
static inline T __ldg(const T* p) {
  return *p;
}

// __ldcs ("cache streaming" load: L2 evicts the line first): a plain load on the CPU, whose
// caches take no such hint from a load. CUDA declares it for built-in scalars and vectors.
template <class T>
static inline T __ldcs(const T* p) {
  static_assert(std::is_arithmetic<T>::value || std::is_same<T, uint4>::value || std::is_same<T, int4>::value ||
                    std::is_same<T, uint2>::value || std::is_same<T, ulonglong2>::value,
                "__ldcs takes a built-in scalar or vector type");
  return *p;
}

// __stcs ("cache streaming": the data will not be read again soon) as a non-temporal store on
// x86-64, which skips the read-for-ownership of the destination line: page copies larger
// than the cache reach memcpy's bandwidth only this way. Callers align as CUDA requires
// (16 bytes for uint4), which _mm_stream_si128 needs too. Other types (u8), and every type
// under ASan or on other architectures, take a plain store: ASan does not instrument the SSE
// builtins. Non-temporal stores are ordered for other OS threads by the sfence at the end of
// every launch.
template <class T>
static inline void __stcs(T* p, T v) {
  // CUDA declares __stcs for built-in scalars and vector types only; refuse the rest here
  // too, so a kernel that would not compile under NVRTC does not compile on the CPU either.
  static_assert(std::is_arithmetic<T>::value || std::is_same<T, uint4>::value || std::is_same<T, int4>::value ||
                    std::is_same<T, uint2>::value || std::is_same<T, ulonglong2>::value,
                "__stcs takes a built-in scalar or vector type");
  *p = v;
}
#if defined(__x86_64__) && !CP_EMU_ASAN
static inline void __stcs(uint4* p, uint4 v) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm_load_si128(reinterpret_cast<const __m128i*>(&v)));
}
static inline void __stcs(unsigned int* p, unsigned int v) { _mm_stream_si32(reinterpret_cast<int*>(p), static_cast<int>(v)); }
#endif

static inline int __popc(unsigned int x) { return __builtin_popcount(x); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
static inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
static inline int __ffs(int x) { return __builtin_ffs(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
static inline unsigned int __brev(unsigned int x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
  return __builtin_bswap32(x);
}

template <class A, class B>
static inline std::common_type_t<A, B> min(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B>
static inline std::common_type_t<A, B> max(A a, B b) {
  using C = std::common_type_t<A, B>;
  return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

// Atomics: plain read-modify-write, since fibers are never preempted and blocks run one at a
// time. The value parameter is not deduced, so `atomicAdd(&u32_var, 1)` works as in CUDA.
template <class T>
using cp_emu_same_t = typename std::enable_if<true, T>::type;
template <class T>
static inline T atomicAdd(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  *p = o + v;
  return o;
}
template <class T>
static inline T atomicSub(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  *p = o - v;
  return o;
}
template <class T>
static inline T atomicExch(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  *p = v;
  return o;
}
template <class T>
static inline T atomicCAS(T* p, cp_emu_same_t<T> cmp, cp_emu_same_t<T> v) {
  T o = *p;
  if (o == cmp) *p = v;
  return o;
}
template <class T>
static inline T atomicMax(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  if (o < v) *p = v;
  return o;
}
template <class T>
static inline T atomicMin(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  if (v < o) *p = v;
  return o;
}
template <class T>
static inline T atomicAnd(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  *p = o & v;
  return o;
}
template <class T>
static inline T atomicOr(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  *p = o | v;
  return o;
}
template <class T>
static inline T atomicXor(T* p, cp_emu_same_t<T> v) {
  T o = *p;
  *p = o ^ v;
  return o;
}

// Statistics of the calling OS thread's fiber-stack pool in this library (each library has its
// own pools). Exported next to the launch entries for tests and diagnostics; nothing inside
// the library calls it, so it cannot be interposed.
extern "C" __attribute__((visibility("default"))) void cp_emu_stack_stats(CpEmuStackStats* out) {
  const ::cp_emu::Pool& p = ::cp_emu::g_pool;
  out->maps = p.n_maps;
  out->unmaps = p.n_unmaps;
  out->stacks_mapped = p.n_stacks_mapped;
  out->stacks_live = p.nstacks;
  out->stack_bytes = p.stack_bytes;
  out->guard_regions = p.guard_mode == ::cp_emu::G_REGIONS ? 1u : 0u;
  out->reserved = 0;
}

// Exports `extern "C" int <name>__emu_launch(const CpEmuLaunch*, void**)` for kernel `name`,
// deducing the parameter types from the kernel's own signature.
#define CP_HICACHE_EMU_EXPORT(name)                                                                     \
  extern "C" __attribute__((visibility("default"))) int name##__emu_launch(const CpEmuLaunch* cfg,     \
                                                                           void** params) {             \
    return ::cp_emu::launch_entry(#name, &name, cfg, params);                                           \
  }

#endif  // CP_HICACHE_CUDA_EMU_H
