
// The block's work is one flat run of vectors: its pages one after another, `page_vecs`
// VEC_T vectors each, and thread t takes the vectors t, t + THREADS, t + 2 * THREADS, ... of
// the run. `v` is this thread's first vector in the current page; chc_copy_vecs copies this
// thread's vectors of one page from there, UNROLL loads in flight (all loads of a round
// issued before its stores), and chc_next_start carries `v` into the next page (whatever its
// size: `v` stays below THREADS). So a page's tail does not idle the threads past it: they
// start on the next page where the run goes on. With THREADS == 1 one thread walks every
// page in order. Callers pass `page_vecs` as a constant, so each inlined copy loop has a
// constant bound.
static __device__ inline void chc_copy_vecs(u8* __restrict__ dst, const u8* __restrict__ src, u32 v, u32 page_vecs)
{
    VEC_T* d = (VEC_T*)dst;
    const VEC_T* s = (const VEC_T*)src;
    for (u32 i = v; i < page_vecs; i += THREADS * UNROLL) {
        VEC_T r[UNROLL];
#pragma unroll
        for (u32 u = 0; u < UNROLL; ++u) {
            const u32 j = i + u * THREADS;
            if (j < page_vecs) {
                r[u] = s[j];
            }
        }
#pragma unroll
        for (u32 u = 0; u < UNROLL; ++u) {
            const u32 j = i + u * THREADS;
            if (j < page_vecs) {
                if (STREAM_STORES) {
                    __stcs(&d[j], r[u]);
                } else {
                    d[j] = r[u];
                }
            }
        }
    }
}

// This thread's first vector of the next page of the run, given its first `v` of this one
// and this page's `page_vecs`.
static __device__ inline u32 chc_next_start(u32 v, u32 page_vecs)
{
    if (v >= page_vecs) {
        return v - page_vecs;
    }
    return v + (page_vecs - v + THREADS - 1u) / THREADS * THREADS - page_vecs;
}
