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

static __device__ inline void chc_stamp_end(u64* stamps)
{
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicMax(&stamps[1], chc_globaltimer());
    }
}
