// Hand-written kernels for tests/emu.rs (compiled with templates/cuda_emu.h force-included).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define FULL 0xffffffffu

// Block-wide sum through shared memory and __syncthreads (blockDim.x must be 256).
extern "C" __global__ void __launch_bounds__(256) block_sum(const u32* __restrict__ in, u32* __restrict__ out) {
  __shared__ u32 s[256];
  u32 t = threadIdx.x;
  s[t] = in[blockIdx.x * blockDim.x + t];
  __syncthreads();
  for (u32 k = blockDim.x / 2; k > 0; k >>= 1) {
    if (t < k) s[t] += s[t + k];
    __syncthreads();
  }
  if (t == 0) out[blockIdx.x] = s[0];
}

// __syncthreads_count / _and / _or over pred[global thread].
extern "C" __global__ void sync_variants(const u32* pred, u32* out) {
  u32 g = blockIdx.x * blockDim.x + threadIdx.x;
  int p = pred[g] != 0;
  int c = __syncthreads_count(p);
  int a = __syncthreads_and(p);
  int o = __syncthreads_or(p);
  if (threadIdx.x == 0) {
    out[3 * blockIdx.x + 0] = (u32)c;
    out[3 * blockIdx.x + 1] = (u32)a;
    out[3 * blockIdx.x + 2] = (u32)o;
  }
}

#define NOPS 17
// Warp intrinsics; threads with threadIdx.x >= live exit first. out[t * NOPS + op].
extern "C" __global__ void warp_ops(const u32* in, u32* out, u32 live) {
  u32 t = threadIdx.x;
  if (t >= live) return;
  u32 lane = t & 31;
  u32 v = in[blockIdx.x * blockDim.x + t];
  u32* o = out + (blockIdx.x * blockDim.x + t) * NOPS;
  o[0] = __ballot_sync(FULL, v & 1);
  o[1] = (u32)__any_sync(FULL, v == 7);
  o[2] = (u32)__all_sync(FULL, v < 1000);
  o[3] = __shfl_sync(FULL, v, 3);
  o[4] = __shfl_up_sync(FULL, v, 2);
  o[5] = __shfl_down_sync(FULL, v, 5);
  o[6] = __shfl_xor_sync(FULL, v, 1);
  o[7] = __shfl_sync(FULL, v, 0, 8);
  o[8] = __match_any_sync(FULL, v % 3);
  // Two disjoint partial-mask groups at different intrinsics.
  if (lane < 16)
    o[9] = __ballot_sync(0x0000ffffu, v & 1);
  else
    o[9] = __shfl_down_sync(0xffff0000u, v, 1);
  __syncwarp();
  // 64-bit and float shuffles.
  u64 w = ((u64)v << 32) | (u64)(v * 3);
  u64 w2 = __shfl_xor_sync(FULL, w, 2);
  float f = (float)v * 0.5f;
  float f2 = __shfl_sync(FULL, f, 0);
  o[10] = (u32)(w2 >> 32) + (u32)w2 + (u32)(f2 * 2.0f) * 1000u;
  // Sub-warp widths (PTX shfl.sync): xor and down may reach up to the end of the own
  // segment, so a butterfly reads from an earlier segment (lane 19 ^ 16 at width 16 reads
  // lane 3) but never from a later one; up stops at the segment start; idx wraps in it.
  o[11] = __shfl_xor_sync(FULL, v, 16, 16);
  o[12] = __shfl_xor_sync(FULL, v, 8, 8);
  o[13] = __shfl_up_sync(FULL, v, 3, 8);
  o[14] = __shfl_down_sync(FULL, v, 3, 8);
  o[15] = __shfl_sync(FULL, v, 13, 8);
  // Only the low 5 bits of the offset count: a delta of ~0u is 31.
  o[16] = __shfl_down_sync(FULL, v, 0xffffffffu);
}

// Atomics across blocks.
extern "C" __global__ void atomics(u32* counter, u64* sum, i32* mn, i32* mx, u32* slot, u32* sub, u32* exch) {
  u32 g = blockIdx.x * blockDim.x + threadIdx.x;
  atomicAdd(counter, 1);
  atomicAdd(sum, (u64)g);
  atomicMin(mn, (i32)g - 100);
  atomicMax(mx, (i32)g - 100);
  atomicCAS(slot, 0xffffffffu, g);
  atomicSub(sub, 2);
  atomicExch(exch, g);
}

struct Params {
  u32 n;
  u64 mul;
  i64 add;
  u16 tag;
};

// A by-value struct and several pointer parameters.
extern "C" __global__ void struct_params(Params p, const u8* a, const u64* b, u64* out, i32 bias) {
  u32 i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  out[i] = b[i] * p.mul + a[i] + (u64)p.add + p.tag + (u64)(i64)bias;
}

// Deliberately buggy: block reads shared memory before any thread of it wrote it.
extern "C" __global__ void shared_persist(u32* out) {
  __shared__ u32 s;
  if (threadIdx.x == 0) {
    out[blockIdx.x] = s;
    s = blockIdx.x + 100;
  }
}

// Buggy on purpose: thread 0 publishes `s` and the others read it with no barrier between.
extern "C" __global__ void missing_barrier(u32* out) {
  __shared__ u32 s;
  if (threadIdx.x == 0) s = 1000u + blockIdx.x;
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// Logs the order threads run in, before and after a barrier: log[0] counts, log[1..] ids.
extern "C" __global__ void run_order(u32* log) {
  log[1 + atomicAdd(&log[0], 1u)] = threadIdx.x;
  __syncthreads();
  log[1 + atomicAdd(&log[0], 1u)] = threadIdx.x;
}

// Threads 0-15 wait at a barrier, the others at a warp shuffle: deadlock.
extern "C" __global__ void deadlock_elsewhere(u32* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
  } else {
    out[threadIdx.x] = __shfl_sync(FULL, threadIdx.x, 0);
  }
}

// Divergent barriers: two __syncthreads at different places.
extern "C" __global__ void divergent_barrier(u32* out) {
  if (threadIdx.x < 16) {
    __syncthreads();
    out[0] = 1;
  } else {
    __syncthreads();
    out[1] = 1;
  }
}

// Threads >= 16 exit; the others meet at a barrier (completes: exited threads are not waited for).
extern "C" __global__ void barrier_after_exit(u32* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = threadIdx.x;
  __syncthreads();
  u32 x = out[15 - threadIdx.x];
  __syncthreads();
  out[threadIdx.x] += x * 100;
}

// Lanes of one warp at different intrinsics with the same mask: mismatch.
extern "C" __global__ void mismatch_warp(u32* out) {
  if ((threadIdx.x & 31) < 16)
    out[threadIdx.x] = __ballot_sync(FULL, 1);
  else
    out[threadIdx.x] = (u32)__any_sync(FULL, 1);
}

// A mask without the calling lane.
extern "C" __global__ void bad_mask(u32* out) { out[threadIdx.x] = __ballot_sync(0x1u, 1); }

// A mask naming only lane 1.
extern "C" __global__ void lane1_mask(u32* out) { out[threadIdx.x] = __ballot_sync(0x2u, 1); }

// __trap in one thread.
extern "C" __global__ void trap_kernel(u32* out) {
  if (blockIdx.x == 1 && threadIdx.x == 3) __trap();
  out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// 3-D shapes: each thread writes its coordinates.
extern "C" __global__ void coords(u32* out) {
  u32 bid = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  u32 tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  u32 g = bid * (blockDim.x * blockDim.y * blockDim.z) + tid;
  out[g] = threadIdx.x | (threadIdx.y << 4) | (threadIdx.z << 8) | (blockIdx.x << 12) | (blockIdx.y << 16) |
           (blockIdx.z << 20);
}

// A large stack frame per thread, with a barrier in the middle.
extern "C" __global__ void big_stack(u32* out) {
  volatile u32 local[4096];
  for (u32 i = 0; i < 4096; ++i) local[i] = i ^ threadIdx.x;
  __syncthreads();
  u32 s = 0;
  for (u32 i = 0; i < 4096; ++i) s += local[i];
  out[threadIdx.x] = s;
}

// The last thread calls a frame of 160 KiB, more than the fiber stack the guard test gives it
// (64 KiB) and the 64 KiB guard below together. The stacks of a block lie in one mapping, each
// above its guard, so below this thread's guard is the previous thread's stack. Built with
// -fstack-clash-protection, allocating the frame probes every page on the way down and faults
// in the guard. Without a guard, the one byte written lands in the stack below, and the launch
// "succeeds" (the test's child then exits normally, which the test reports).
__device__ __attribute__((noinline)) u32 huge_frame_body(u32 t) {
  volatile unsigned char frame[160 * 1024];
  frame[0] = static_cast<unsigned char>(t);
  return frame[0];
}

extern "C" __global__ void huge_frame(u32* out) {
  __syncthreads();
  out[threadIdx.x] = threadIdx.x == blockDim.x - 1 ? huge_frame_body(threadIdx.x) : threadIdx.x;
}

// Writes one element past `n` (an out-of-bounds access for the ASan test).
extern "C" __global__ void oob_write(u32* out, u32 n) {
  if (threadIdx.x == 0) out[n] = 42;
}

// Empty kernel and barrier loop, for measuring thread start and barrier costs.
extern "C" __global__ void empty_kernel() {}
extern "C" __global__ void barrier_loop(u32 iters) {
  for (u32 i = 0; i < iters; ++i) __syncthreads();
}

// Target of the raw-ABI probe below.
extern "C" __global__ void probe_k(u32* out) { out[threadIdx.x] = 1; }

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(probe_k)

// Calls probe_k's entry through the raw launch ABI with what the Rust executor never sends:
// which 0 = a null params array, 1 = a stack size near 2^64 (whose page rounding would wrap),
// 2 = a valid launch. Returns the status; the diagnostic goes to err.
extern "C" __attribute__((visibility("default"))) int probe_raw(int which, char* err, u64 cap) {
  static u32 out[32];
  u32* p = out;
  void* params[1] = {&p};
  CpEmuLaunch cfg = {};
  cfg.abi_version = CP_EMU_ABI_VERSION;
  cfg.grid[0] = cfg.grid[1] = cfg.grid[2] = 1;
  cfg.block[0] = 32;
  cfg.block[1] = cfg.block[2] = 1;
  cfg.num_params = 1;
  cfg.err_buf = err;
  cfg.err_cap = cap;
  if (which == 0) return probe_k__emu_launch(&cfg, nullptr);
  if (which == 1) cfg.stack_bytes = ~0ull - 100;
  if (which == 3) {
    // Another ABI version: no other field may be read (this pointer faults if it is).
    cfg.abi_version = CP_EMU_ABI_VERSION + 1;
    cfg.param_sizes = reinterpret_cast<const uint64_t*>(static_cast<uintptr_t>(8));
  }
  return probe_k__emu_launch(&cfg, params);
}

CP_HICACHE_EMU_EXPORT(block_sum)
CP_HICACHE_EMU_EXPORT(sync_variants)
CP_HICACHE_EMU_EXPORT(warp_ops)
CP_HICACHE_EMU_EXPORT(atomics)
CP_HICACHE_EMU_EXPORT(struct_params)
CP_HICACHE_EMU_EXPORT(shared_persist)
CP_HICACHE_EMU_EXPORT(missing_barrier)
CP_HICACHE_EMU_EXPORT(run_order)
CP_HICACHE_EMU_EXPORT(deadlock_elsewhere)
CP_HICACHE_EMU_EXPORT(divergent_barrier)
CP_HICACHE_EMU_EXPORT(barrier_after_exit)
CP_HICACHE_EMU_EXPORT(mismatch_warp)
CP_HICACHE_EMU_EXPORT(bad_mask)
CP_HICACHE_EMU_EXPORT(trap_kernel)
CP_HICACHE_EMU_EXPORT(lane1_mask)
CP_HICACHE_EMU_EXPORT(coords)
CP_HICACHE_EMU_EXPORT(big_stack)
CP_HICACHE_EMU_EXPORT(oob_write)
CP_HICACHE_EMU_EXPORT(huge_frame)
CP_HICACHE_EMU_EXPORT(empty_kernel)
CP_HICACHE_EMU_EXPORT(barrier_loop)
#endif
