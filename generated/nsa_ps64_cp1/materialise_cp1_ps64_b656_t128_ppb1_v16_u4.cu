// materialise_cp1_ps64_b656_t128_ppb1_v16_u4
// Rendered by cp-hicache from templates/materialise.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define CP 1
#define PAGE_SIZE 64
#define BYTES_PER_TOKEN 656
#define PAGE_BYTES 41984
#define VEC_T uint4
#define VEC_BYTES 16
#define PAGE_VECS 2624
#define THREADS 128
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

// The CP rank pools of one buffer kind, passed by value so nothing needs uploading.
struct ChcPools {
    const u8* p[CP];
};

// Gathers sequence page i (global page p = seq_pages[i]) from rank p % CP, local page p / CP,
// into dense[layer][i][PAGE_BYTES], for every layer. Work item w = (group of PAGES_PER_BLOCK
// pages, layer), or with LAYERS_IN_BLOCK the group alone, whose pages are gathered for every
// layer, page by page; blocks stride over the items. Pages beyond local_pages are skipped.
extern "C" __global__ void __launch_bounds__(THREADS) materialise_cp1_ps64_b656_t128_ppb1_v16_u4(
    const __grid_constant__ ChcPools pools, const u32* seq_pages, u32 n, u32 layers,
    u32 local_pages, u8* dense)
{
    // In 64 bits: n near 2^32 must not wrap the rounding (or the pair index below) to 0.
    const u32 groups = (u32)(((u64)n + PAGES_PER_BLOCK - 1u) / PAGES_PER_BLOCK);
    const u64 items = (u64)groups * (LAYERS_IN_BLOCK ? 1u : layers);
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u32 l0 = (u32)(w / groups);
        const u32 l1 = LAYERS_IN_BLOCK ? layers : l0 + 1u;
        const u32 first = (u32)(w % groups) * PAGES_PER_BLOCK;
        for (u32 q = 0; q < PAGES_PER_BLOCK; ++q) {
            const u64 i = (u64)first + q;
            if (i >= n) {
                break;
            }
            const u32 page = seq_pages[i];
            const u32 owner = page % CP;
            const u32 local = page / CP;
            if (local >= local_pages) {
                continue;
            }
            for (u32 layer = l0; layer < l1; ++layer) {
                chc_copy_page(dense + ((u64)layer * n + i) * PAGE_BYTES,
                              pools.p[owner] + ((u64)layer * local_pages + local) * PAGE_BYTES);
            }
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(materialise_cp1_ps64_b656_t128_ppb1_v16_u4)
#endif