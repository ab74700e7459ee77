// transfer_pages_h2d_pf_ps64_b132_t512_ppb1_v16_u4_g4
// Rendered by cp-hicache from templates/transfer_pages.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define PAGE_SIZE 64
#define BYTES_PER_TOKEN 132
#define PAGE_BYTES 8448
#define VEC_T uint4
#define VEC_BYTES 16
#define PAGE_VECS 528
#define THREADS 512
#define PAGES_PER_BLOCK 1
#define UNROLL 4
#define LAYERS_IN_BLOCK 0
#define STREAM_STORES 0

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

// Byte offset of (page, layer) in the device pool: [layer][local_page][PAGE_BYTES].
static __device__ inline u64 chc_device_off(u32 page, u32 layer, u32 layers, u32 device_pages, u32 host_pages)
{
    return ((u64)layer * device_pages + page) * PAGE_BYTES;
}

// Byte offset of (page, layer) in the host pool: page-first [host_page][layer][PAGE_BYTES].
static __device__ inline u64 chc_host_off(u32 page, u32 layer, u32 layers, u32 device_pages, u32 host_pages)
{
    return ((u64)page * layers + layer) * PAGE_BYTES;
}

// Copies page blobs host → device for layers [first_layer, first_layer + layer_count)
// of every pair, clamped to the pools' [0, layers) (`layers` stays the pools' total in the
// offsets): pair i moves src_pages[i] to dst_pages[i]. Work item w = (group of
// PAGES_PER_BLOCK pairs, layer of the range), or with LAYERS_IN_BLOCK the group alone, whose
// pages are copied for every layer of the range, page by page; blocks stride over the items,
// so any grid is correct. Pairs whose page is outside its pool are skipped; an empty range
// (or one wholly past `layers`) copies nothing.
extern "C" __global__ void __launch_bounds__(THREADS) transfer_pages_h2d_pf_ps64_b132_t512_ppb1_v16_u4_g4(
    const u8* src, u8* dst, const u32* src_pages, const u32* dst_pages, u32 n, u32 layers,
    u32 first_layer, u32 layer_count, u32 device_pages, u32 host_pages)
{
    // The range, clamped in 64 bits: first_layer + layer_count near 2^32 must not wrap.
    const u64 range_end = (u64)first_layer + layer_count;
    const u32 l_end = range_end < layers ? (u32)range_end : layers;
    const u32 span = first_layer < l_end ? l_end - first_layer : 0u;
    // In 64 bits: n near 2^32 must not wrap the rounding (or the pair index below) to 0.
    const u32 groups = (u32)(((u64)n + PAGES_PER_BLOCK - 1u) / PAGES_PER_BLOCK);
    const u64 items = span == 0u ? 0u : (u64)groups * (LAYERS_IN_BLOCK ? 1u : span);
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u32 l0 = LAYERS_IN_BLOCK ? first_layer : first_layer + (u32)(w / groups);
        const u32 l1 = LAYERS_IN_BLOCK ? l_end : l0 + 1u;
        const u32 first = (u32)(w % groups) * PAGES_PER_BLOCK;
        for (u32 q = 0; q < PAGES_PER_BLOCK; ++q) {
            const u64 i = (u64)first + q;
            if (i >= n) {
                break;
            }
            const u32 sp = src_pages[i];
            const u32 dp = dst_pages[i];
            if (sp >= host_pages || dp >= device_pages) {
                continue;
            }
            for (u32 layer = l0; layer < l1; ++layer) {
                chc_copy_page(dst + chc_device_off(dp, layer, layers, device_pages, host_pages),
                              src + chc_host_off(sp, layer, layers, device_pages, host_pages));
            }
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(transfer_pages_h2d_pf_ps64_b132_t512_ppb1_v16_u4_g4)
#endif