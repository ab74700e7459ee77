// materialise_cp4_ps16_b4096_t128_ppb1_v16_u4
// Rendered by cp-hicache from templates/materialise.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define CP 4
#define PAGE_SIZE 16
#define BYTES_PER_TOKEN 4096
#define PAGE_BYTES 65536
#define VEC_T uint4
#define VEC_BYTES 16
#define PAGE_VECS 4096
#define THREADS 128
#define PAGES_PER_BLOCK 1
#define UNROLL 4
#define LAYERS_IN_BLOCK 0
#define STREAM_STORES 0
#define MIN_BLOCKS 16

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

// Gathers sequence page i (global page p = seq_pages[i]) from rank p % CP, local page p / CP,
// into dense[layer][i][PAGE_BYTES], for every layer. The pools are a page table: rank r's
// layer l starts at pools[r * layers + l], its pages page_stride bytes apart. Work item w = (group of PAGES_PER_BLOCK
// pages, layer), or with LAYERS_IN_BLOCK the group alone, whose pages are gathered for every
// layer, page by page; blocks stride over the items. A block's pages, over all its items, are
// one flat run of vectors (chc_copy_vecs). Pages beyond local_pages are skipped. MIN_BLOCKS
// blocks fit an SM (a full one): the gather is bound by HBM, so occupancy is bytes in flight.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) materialise_cp4_ps16_b4096_t128_ppb1_v16_u4(
    const u64* __restrict__ pools, const u32* __restrict__ seq_pages, u32 n, u32 layers,
    u32 local_pages, u32 page_stride, u8* __restrict__ dense)
{
    // In 64 bits: n near 2^32 must not wrap the rounding (or the pair index below) to 0.
    const u32 groups = (u32)(((u64)n + PAGES_PER_BLOCK - 1u) / PAGES_PER_BLOCK);
    const u64 items = (u64)groups * (LAYERS_IN_BLOCK ? 1u : layers);
    // This thread's first vector in the next page of the block's flat run (chc_copy_vecs).
    u32 v = threadIdx.x;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u32 l0 = (u32)(w / groups);
        const u32 l1 = LAYERS_IN_BLOCK ? layers : l0 + 1u;
        const u32 first = (u32)(w % groups) * PAGES_PER_BLOCK;
        const u32 np = (u64)first + PAGES_PER_BLOCK <= n ? PAGES_PER_BLOCK : n - first;
        for (u32 q = 0; q < np; ++q) {
            const u32 i = first + q;
            const u32 page = seq_pages[i];
            const u32 owner = page % CP;
            const u32 local = page / CP;
            // Pages beyond local_pages are skipped (not part of the run).
            if (local >= local_pages) {
                continue;
            }
            for (u32 layer = l0; layer < l1; ++layer) {
                chc_copy_vecs(dense + ((u64)layer * n + i) * PAGE_BYTES,
                              (const u8*)pools[owner * layers + layer] + (u64)local * page_stride, v, PAGE_VECS);
                v = chc_next_start(v, PAGE_VECS);
            }
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(materialise_cp4_ps16_b4096_t128_ppb1_v16_u4)
#endif