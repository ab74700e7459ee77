// busy_alu_t256
// Rendered by cp-hicache from templates/busy.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define THREADS 256

// One round of the busy chain: an LCG step and a xorshift, dependent on the last (so the
// compiler can neither vectorise nor shorten the chain).
static __device__ inline u32 chc_busy_round(u32 x)
{
    x = x * 1664525u + 1013904223u;
    return x ^ (x >> 13);
}

// Nanoseconds on a clock every SM shares, so block starts of kernels on different streams
// compare: %globaltimer on the GPU, CLOCK_MONOTONIC in the emulation.
static __device__ inline u64 chc_globaltimer()
{
#ifdef CP_HICACHE_EMU
    return cp_emu::globaltimer_ns();
#else
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}

// stamps[0] becomes the earliest block start of the launch, stamps[1] its latest block end
// (the caller sets them to ~0 and 0): where the kernel ran, to compare with another's.
static __device__ inline void chc_stamp_start(u64* stamps)
{
    if (threadIdx.x == 0) {
        atomicMin(&stamps[0], chc_globaltimer());
    }
}

// Every thread of the block must call it (it synchronises the block).
static __device__ inline void chc_stamp_end(u64* stamps)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicMax(&stamps[1], chc_globaltimer());
    }
}

// chc_stamp_start, and stamps[2] becomes the latest block start (the caller sets it to 0): a
// kernel whose every block started before another kernel's first block start was resident
// before that one, not queued behind it.
static __device__ inline void chc_stamp_start_and_last(u64* stamps)
{
    if (threadIdx.x == 0) {
        const u64 t = chc_globaltimer();
        atomicMin(&stamps[0], t);
        atomicMax(&stamps[2], t);
    }
}

// A compute-bound stand-in for the model's kernels: thread word i of [0, n) starts from
// seed ^ (i * 0x9E3779B9), runs `rounds` dependent rounds and stores the result to out[i].
// It holds registers and issue slots for as long as `rounds` says and touches almost no
// memory, so timing a transfer beside it shows what the transfer costs the model and what
// the model costs the transfer. Threads stride over the words, so any grid is correct.
// `stamps` gets the launch's first block start and last block end (chc_stamp_*).
extern "C" __global__ void __launch_bounds__(THREADS) busy_alu_t256(
    u32* __restrict__ out, u32 n, u32 rounds, u32 seed, u64* __restrict__ stamps)
{
    chc_stamp_start(stamps);
    for (u64 i = (u64)blockIdx.x * THREADS + threadIdx.x; i < n; i += (u64)gridDim.x * THREADS) {
        u32 x = seed ^ ((u32)i * 0x9E3779B9u);
        for (u32 r = 0; r < rounds; ++r) {
            x = chc_busy_round(x);
        }
        out[i] = x;
    }
    chc_stamp_end(stamps);
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(busy_alu_t256)
#endif