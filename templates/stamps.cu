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
