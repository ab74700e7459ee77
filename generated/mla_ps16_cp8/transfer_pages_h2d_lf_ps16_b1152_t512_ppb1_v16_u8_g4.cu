// transfer_pages_h2d_lf_ps16_b1152_t512_ppb1_v16_u8_g4
// Rendered by cp-hicache from templates/transfer_pages.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define PAGE_SIZE 16
#define BYTES_PER_TOKEN 1152
#define PAGE_BYTES 18432
#define VEC_T uint4
#define VEC_BYTES 16
#define PAGE_VECS 1152
#define THREADS 512
#define PAGES_PER_BLOCK 1
#define UNROLL 8
#define LAYERS_IN_BLOCK 0
#define STREAM_STORES 0
#define BUFFERS 1

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

// Byte offset of (page, layer) in a host pool of page_bytes pages: layer-first [layer][host_page][page_bytes].
static __device__ inline u64 chc_host_off(u32 page, u32 layer, u32 layers, u32 host_pages, u64 page_bytes)
{
    return ((u64)layer * host_pages + page) * page_bytes;
}

// Copies work item w of one buffer (device pool through its page table `device`, pages
// page_stride bytes apart; host pool `host`; pages of page_bytes = page_vecs vectors): the
// pairs [first, first + np) for the layers [l0, l1), continuing this thread's place `v` in
// the block's flat run; returns its place in the next page of the run. Pairs whose page is
// outside its pool are skipped (not part of the run).
static __device__ inline u32 chc_transfer_item(const u64* __restrict__ device, const u8* __restrict__ host,
                                               const u32* __restrict__ src_pages, const u32* __restrict__ dst_pages,
                                               u32 first, u32 np, u32 l0, u32 l1, u32 layers,
                                               u32 device_pages, u32 host_pages, u64 page_stride,
                                               u64 page_bytes, u32 page_vecs, u32 v)
{
    for (u32 q = 0; q < np; ++q) {
        const u32 sp = src_pages[first + q];
        const u32 dp = dst_pages[first + q];
        if (sp >= host_pages || dp >= device_pages) {
            continue;
        }
        for (u32 layer = l0; layer < l1; ++layer) {
            u8* dev = (u8*)device[layer] + (u64)dp * page_stride;
            const u8* h = host + chc_host_off(sp, layer, layers, host_pages, page_bytes);
            chc_copy_vecs(dev, h, v, page_vecs);
            v = chc_next_start(v, page_vecs);
        }
    }
    return v;
}

// Copies page blobs host → device for layers [first_layer, first_layer + layer_count)
// of every pair, clamped to the pools' [0, layers) (`layers` stays the pools' total in the
// offsets): pair i moves src_pages[i] to dst_pages[i].
// A device pool is a page table: layer l's pages start at device[l], page_stride bytes apart
// (the cache's own pools, an engine's per-layer tensors, one cross-layer tensor in either
// order). Work item w = (buffer, group of PAGES_PER_BLOCK pairs, layer of the range), or with
// LAYERS_IN_BLOCK (buffer, group), whose pages are copied for every layer of the range, page
// by page; blocks stride over the items, so any grid is correct. A block's pages, over all its
// items, are one flat run of vectors (chc_copy_vecs), so page tails do not idle threads. Pairs
// whose page is outside its pool are skipped; an empty range (or one wholly past `layers`)
// copies nothing.
extern "C" __global__ void __launch_bounds__(THREADS) transfer_pages_h2d_lf_ps16_b1152_t512_ppb1_v16_u8_g4(
    const u64* __restrict__ device, const u8* __restrict__ host,
    const u32* __restrict__ src_pages, const u32* __restrict__ dst_pages, u32 n, u32 layers,
    u32 first_layer, u32 layer_count, u32 device_pages, u32 host_pages, u32 page_stride)
{
    // The range, clamped in 64 bits: first_layer + layer_count near 2^32 must not wrap.
    const u64 range_end = (u64)first_layer + layer_count;
    const u32 l_end = range_end < layers ? (u32)range_end : layers;
    const u32 span = first_layer < l_end ? l_end - first_layer : 0u;
    // In 64 bits: n near 2^32 must not wrap the rounding (or the pair index below) to 0.
    const u32 groups = (u32)(((u64)n + PAGES_PER_BLOCK - 1u) / PAGES_PER_BLOCK);
    const u64 per_buffer = span == 0u ? 0u : (u64)groups * (LAYERS_IN_BLOCK ? 1u : span);
    const u64 items = per_buffer * BUFFERS;
    // This thread's first vector in the next page of the block's flat run (chc_copy_vecs).
    u32 v = threadIdx.x;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u64 wb = w % per_buffer;
        const u32 l0 = LAYERS_IN_BLOCK ? first_layer : first_layer + (u32)(wb / groups);
        const u32 l1 = LAYERS_IN_BLOCK ? l_end : l0 + 1u;
        const u32 first = (u32)(wb % groups) * PAGES_PER_BLOCK;
        const u32 np = (u64)first + PAGES_PER_BLOCK <= n ? PAGES_PER_BLOCK : n - first;
        v = chc_transfer_item(device, host, src_pages, dst_pages, first, np, l0, l1, layers,
                              device_pages, host_pages, page_stride, PAGE_BYTES, PAGE_VECS, v);
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(transfer_pages_h2d_lf_ps16_b1152_t512_ppb1_v16_u8_g4)
#endif