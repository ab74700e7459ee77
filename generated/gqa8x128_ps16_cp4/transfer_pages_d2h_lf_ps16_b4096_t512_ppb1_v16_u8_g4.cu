// transfer_pages_d2h_lf_ps16_b4096_t512_ppb1_v16_u8_g4
// Rendered by cp-hicache from templates/transfer_pages.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define PAGE_SIZE 16
#define BYTES_PER_TOKEN 4096
#define PAGE_BYTES 65536
#define VEC_T uint4
#define VEC_BYTES 16
#define PAGE_VECS 4096
#define THREADS 512
#define PAGES_PER_BLOCK 1
#define UNROLL 8
#define LAYERS_IN_BLOCK 0
#define STREAM_STORES 0
#define GROUP_LANES 32
#define GROUPS_PER_BLOCK 16
#define BUFFERS 1
#define MIN_BLOCKS 2

// Byte offset of (page, layer) in a host pool of page_bytes pages: layer-first [layer][host_page][page_bytes].
static __device__ inline u64 chc_host_off(u32 page, u32 layer, u32 layers, u32 host_pages, u64 page_bytes)
{
    return ((u64)layer * host_pages + page) * page_bytes;
}

// Copies one page of page_vecs VEC_T vectors with the GROUP_LANES lanes of a group: lane
// `lane` takes vectors lane, lane + GROUP_LANES, ..., UNROLL loads in flight (a round's loads
// issued before its stores). A lane has page_vecs / GROUP_LANES vectors of each page, so
// even a small page keeps UNROLL loads per lane in flight until its last round (a block-wide
// stride left each thread page_vecs / THREADS). With THREADS == 1 one thread walks the page
// in order. A one-buffer launch passes page_vecs as a constant, so its copy loop has a
// constant bound. Source vectors are read as __ldcs(&s[j]).
static __device__ inline void chc_copy_page(u8* __restrict__ dst, const u8* __restrict__ src, u32 lane, u32 page_vecs)
{
    VEC_T* d = (VEC_T*)dst;
    const VEC_T* s = (const VEC_T*)src;
    for (u32 i = lane; i < page_vecs; i += GROUP_LANES * UNROLL) {
        VEC_T r[UNROLL];
#pragma unroll
        for (u32 u = 0; u < UNROLL; ++u) {
            const u32 j = i + u * GROUP_LANES;
            if (j < page_vecs) {
                r[u] = __ldcs(&s[j]);
            }
        }
#pragma unroll
        for (u32 u = 0; u < UNROLL; ++u) {
            const u32 j = i + u * GROUP_LANES;
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

// Copies the pair (sp, dp) of one buffer at one layer: the device pool's pages of that layer
// start at `base` (its page-table entry), page_stride bytes apart; host pool `host`; pages
// of page_bytes = page_vecs vectors; with this group's lanes.
static __device__ inline void chc_transfer_layer(u64 base, u8* __restrict__ host,
                                                 u32 sp, u32 dp, u32 layer, u32 layers, u32 host_pages,
                                                 u64 page_stride, u64 page_bytes, u32 page_vecs, u32 lane)
{
    const u8* dev = (const u8*)base + (u64)sp * page_stride;
    u8* h = host + chc_host_off(dp, layer, layers, host_pages, page_bytes);
    chc_copy_page(h, dev, lane, page_vecs);
}

// The pair (sp, dp) of one buffer (device pool through its page table `device`) for the
// layers [l0, l1), in order, each layer's base read from the table.
static __device__ inline void chc_transfer_pair(const u64* __restrict__ device, u8* __restrict__ host,
                                                u32 sp, u32 dp, u32 l0, u32 l1, u32 layers, u32 host_pages,
                                                u64 page_stride, u64 page_bytes, u32 page_vecs, u32 lane)
{
    for (u32 layer = l0; layer < l1; ++layer) {
        chc_transfer_layer(device[layer], host, sp, dp, layer, layers, host_pages, page_stride, page_bytes,
                           page_vecs, lane);
    }
}

// Copies page blobs device → host for layers [first_layer, first_layer + layer_count)
// of every pair, clamped to the pools' [0, layers) (`layers` stays the pools' total in the
// offsets): pair i moves src_pages[i] to dst_pages[i].
// A device pool is a page table: layer l's pages start at device[l], page_stride bytes apart
// (the cache's own pools, an engine's per-layer tensors, one cross-layer tensor in either
// order). Work item w = (pair group of PAGES_PER_BLOCK pairs, layer of the range, buffer),
// or with LAYERS_IN_BLOCK (pair group, buffer), whose pages are copied for every layer of
// the range, page by page. Each group of GROUP_LANES threads (a warp, or the whole block when
// smaller) copies an item at a time, GROUPS_PER_BLOCK groups a block; the grid's groups
// stride over the items, so any grid is correct. Pairs whose page is outside its pool are
// skipped; an empty range (or one wholly past `layers`) copies nothing. One block per SM is
// all the launch bound asks: a capped grid uses a few SMs, and without the second bound ptxas
// held small blocks to about 48 registers and spilled the walk's state.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) transfer_pages_d2h_lf_ps16_b4096_t512_ppb1_v16_u8_g4(
    const u64* __restrict__ device, u8* __restrict__ host, const u32* __restrict__ src_pages,
    const u32* __restrict__ dst_pages, u32 n, u32 layers, u32 first_layer, u32 layer_count,
    u32 device_pages, u32 host_pages, u32 page_stride)
{
    // The range, clamped in 64 bits: first_layer + layer_count near 2^32 must not wrap.
    const u64 range_end = (u64)first_layer + layer_count;
    const u32 l_end = range_end < layers ? (u32)range_end : layers;
    const u32 span = first_layer < l_end ? l_end - first_layer : 0u;
    // In 64 bits: n near 2^32 must not wrap the rounding (or the pair index below) to 0.
    const u32 groups = (u32)(((u64)n + PAGES_PER_BLOCK - 1u) / PAGES_PER_BLOCK);
    if (groups == 0u || span == 0u) {
        return;
    }
    // Items per (pair group, buffer): one per layer of the range, one with LAYERS_IN_BLOCK.
    const u32 layer_items = LAYERS_IN_BLOCK ? 1u : span;
    const u32 lane = threadIdx.x % GROUP_LANES;
    // Group g's k-th item is w = g + k * all: pair group and layer x % groups and
    // x / groups of x = w / BUFFERS, buffer (g + k) % BUFFERS. For BUFFERS = 2 that is a
    // bijection (an even `all` puts both items of each x in one wave, where they get both
    // buffers; with an odd one it is w % 2), and a group alternates buffers, so the groups
    // do not split into kv ones and index_k ones that finish first and idle.
    // Groups are numbered block-minor (group j of block b is g = j * gridDim.x + b), so a
    // load of fewer items than groups still spreads over every block of the grid, one SM
    // each, instead of filling the first block's warps.
    const u64 all = (u64)gridDim.x * GROUPS_PER_BLOCK;
    const u64 g = (u64)(threadIdx.x / GROUP_LANES) * gridDim.x + blockIdx.x;
    // The walk is carried in 32 bits (wider state spilled under ptxas) and moved by `all`
    // items a step without dividing: x as (layer, pair group), w % BUFFERS, the buffer.
    const u64 first_layer_index = g / BUFFERS / groups;
    bool more = first_layer_index < layer_items;
    u32 layer = (u32)first_layer_index;
    u32 group = (u32)(g / BUFFERS % groups);
    u32 parity = (u32)(g % BUFFERS);
    u32 b = parity;
    const u64 step_x = all / BUFFERS;
    const u64 step_layers = step_x / groups;
    const u32 step_groups = (u32)(step_x % groups);
    const u32 all_parity = (u32)(all % BUFFERS);
    // The page ids of the first pair of this group's item, loaded an item ahead.
    u32 first_sp = 0u;
    u32 first_dp = 0u;
    if (more) {
        first_sp = src_pages[group * PAGES_PER_BLOCK];
        first_dp = dst_pages[group * PAGES_PER_BLOCK];
    }
    while (more) {
        const u32 l0 = LAYERS_IN_BLOCK ? first_layer : first_layer + layer;
        const u32 l1 = LAYERS_IN_BLOCK ? l_end : l0 + 1u;
        const u32 first = group * PAGES_PER_BLOCK;
        const u32 np = (u64)first + PAGES_PER_BLOCK <= n ? PAGES_PER_BLOCK : n - first;
        // The next item: x moves by (w % BUFFERS + all) / BUFFERS, step_layers layers and
        // `add` <= groups pair groups (compared, not summed, so that nothing overflows).
        const u32 add = step_groups + (parity + all_parity) / BUFFERS;
        const bool carry = group >= groups - add;
        const u32 next_group = carry ? group - (groups - add) : group + add;
        const u64 next_layer = layer + step_layers + (carry ? 1u : 0u);
        more = next_layer < layer_items;
        // Its first pair's page ids, loaded before this item's copies:
        // their latency overlaps them instead of stalling the next item.
        u32 next_sp = 0u;
        u32 next_dp = 0u;
        if (more) {
            next_sp = src_pages[next_group * PAGES_PER_BLOCK];
            next_dp = dst_pages[next_group * PAGES_PER_BLOCK];
        }
        for (u32 q = 0u; q < np; ++q) {
            const u32 sp = q == 0u ? first_sp : src_pages[first + q];
            const u32 dp = q == 0u ? first_dp : dst_pages[first + q];
            if (sp < device_pages && dp < host_pages) {
                // The layer's base read with each pair: carried an item ahead, as a
                // two-buffer launch does, it spilled under a one-buffer launch's bound of 2
                // blocks an SM.
                chc_transfer_pair(device, host, sp, dp, l0, l1, layers, host_pages, page_stride,
                                  PAGE_BYTES, PAGE_VECS, lane);
            }
        }
        b = 0u;
        parity = (parity + all_parity) % BUFFERS;
        layer = (u32)next_layer;
        group = next_group;
        first_sp = next_sp;
        first_dp = next_dp;
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(transfer_pages_d2h_lf_ps16_b4096_t512_ppb1_v16_u8_g4)
#endif