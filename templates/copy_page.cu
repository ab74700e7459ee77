
// Copies one PAGE_BYTES page with VEC_T accesses: the block's THREADS threads stride over the
// page, UNROLL vectors in flight per thread. With THREADS == 1 one thread walks it in order.
static __device__ inline void chc_copy_page(u8* dst, const u8* src)
{
    VEC_T* d = (VEC_T*)dst;
    const VEC_T* s = (const VEC_T*)src;
    for (u32 i = threadIdx.x; i < PAGE_VECS; i += THREADS * UNROLL) {
        VEC_T r[UNROLL];
#pragma unroll
        for (u32 u = 0; u < UNROLL; ++u) {
            const u32 j = i + u * THREADS;
            if (j < PAGE_VECS) {
                r[u] = s[j];
            }
        }
#pragma unroll
        for (u32 u = 0; u < UNROLL; ++u) {
            const u32 j = i + u * THREADS;
            if (j < PAGE_VECS) {
                if (STREAM_STORES) {
                    __stcs(&d[j], r[u]);
                } else {
                    d[j] = r[u];
                }
            }
        }
    }
}
