// select_owner_pages_cp4_ps16_t256
// Rendered by cp-hicache from templates/select_owner_pages.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define CP 4
#define PAGE_SIZE 16
#define LOG2_PAGE_SIZE 4
#define THREADS 256
#define WARPS 8

// Exclusive rank of this thread's item among the items of the same owner, in input order,
// counting the earlier tiles through s_base. Every thread of the block must call it once per
// tile (it synchronises). `o == CP` marks "no item" (past the end, or invalid input).
// s_warp_cnt: [WARPS][CP] per-warp owner counts; s_base: [CP] running per-owner counts.
static __device__ inline u32 chc_tile_rank(u32 o, u32* s_warp_cnt, u32* s_base)
{
    const u32 lane = threadIdx.x & 31u;
    const u32 warp = threadIdx.x >> 5;
    for (u32 i = threadIdx.x; i < WARPS * CP; i += THREADS) {
        s_warp_cnt[i] = 0u;
    }
    __syncthreads();
    const u32 peers = __match_any_sync(0xffffffffu, o);
    const u32 below = peers & ((1u << lane) - 1u);
    if (o < CP && below == 0u) {
        s_warp_cnt[warp * CP + o] = __popc(peers);
    }
    __syncthreads();
    u32 rank = 0u;
    if (o < CP) {
        rank = s_base[o] + __popc(below);
        for (u32 w = 0; w < warp; ++w) {
            rank += s_warp_cnt[w * CP + o];
        }
    }
    __syncthreads();
    if (threadIdx.x < CP) {
        u32 total = 0u;
        for (u32 w = 0; w < WARPS; ++w) {
            total += s_warp_cnt[w * CP + threadIdx.x];
        }
        s_base[threadIdx.x] += total;
    }
    __syncthreads();
    return rank;
}

// a + b, saturating at 2^32 - 1 (the allocator kernels' status words count; they must not
// wrap back to "clear").
static __device__ inline u32 chc_sat_add(u32 a, u32 b)
{
    const u32 s = a + b;
    return s < a ? 0xffffffffu : s;
}

// One block only: the tiles count through one block's shared memory and barriers, and a
// second block would pop or push the same stack slots. A launch of more blocks refuses
// itself: block 0's first thread counts one refused launch (status[0], saturating) and
// nothing else is touched, no lane, no output. The host reads a refused launch with no
// lane and no item counted as a grid refusal. True when refused (every thread returns).
static __device__ inline bool chc_refuse_grid(u32* status)
{
    if (gridDim.x == 1u && gridDim.y == 1u && gridDim.z == 1u) {
        return false;
    }
    if (blockIdx.x == 0u && blockIdx.y == 0u && blockIdx.z == 0u && threadIdx.x == 0u) {
        status[0] = chc_sat_add(status[0], 1u);
    }
    return true;
}

// Pops one page per requested owner from the lane free stacks (LIFO, docs/KERNELS.md) and
// writes the pages and their page-contiguous token locations. Launch: 1 block of THREADS
// (more are refused: chc_refuse_grid).
// All or nothing, whatever the host checked: when any lane holds fewer pages than requested,
// or an owner is >= CP, no lane top changes, every output page is 0 (the null page, so the
// locations are its slots), and the status words add up the refusal:
//   status[0] += 1, status[1 + o] += deficit of lane o, status[CP + 1] += owners >= CP
// (saturating). The host reads them back only when it synchronises anyway.
extern "C" __global__ void __launch_bounds__(THREADS) select_owner_pages_cp4_ps16_t256(
    const u8* __restrict__ owners, u32 n, const u32* __restrict__ lane_stacks,
    u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ out_pages,
    i64* __restrict__ out_locs, u32* __restrict__ status)
{
    if (chc_refuse_grid(status)) {
        return;
    }
    __shared__ u32 s_warp_cnt[WARPS * CP];
    __shared__ u32 s_base[CP];
    __shared__ u32 s_top[CP];
    __shared__ u32 s_bad_owners;
    __shared__ u32 s_short;
    if (threadIdx.x < CP) {
        s_base[threadIdx.x] = 0u;
        const u32 top = lane_tops[threadIdx.x];
        s_top[threadIdx.x] = top < lane_cap ? top : lane_cap;
    }
    if (threadIdx.x == 0) {
        s_bad_owners = 0u;
        s_short = 0u;
    }
    __syncthreads();
    // In 64 bits: with n near 2^32 a u32 base would wrap to 0 and never end the loop.
    for (u64 base = 0; base < n; base += THREADS) {
        const u64 i = base + threadIdx.x;
        u32 o = CP;
        if (i < n) {
            const u32 req = owners[i];
            o = req < CP ? req : CP;
            if (req >= CP) {
                atomicAdd(&s_bad_owners, 1u);
            }
        }
        const u32 k = chc_tile_rank(o, s_warp_cnt, s_base);
        if (i < n) {
            u32 page = 0u;
            if (o < CP && k < s_top[o]) {
                page = lane_stacks[(u64)o * lane_cap + (s_top[o] - 1u - k)];
            }
            out_pages[i] = page;
        }
    }
    // chc_tile_rank ended on a barrier: s_base[o] now counts the requests for lane o, and
    // s_bad_owners those with an owner >= CP. Any shortage refuses the whole launch.
    if ((threadIdx.x < CP && s_base[threadIdx.x] > s_top[threadIdx.x])
        || (threadIdx.x == 0 && s_bad_owners != 0u)) {
        s_short = 1u;
    }
    __syncthreads();
    const bool refused = s_short != 0u;
    if (refused) {
        // Each thread clears the pages it wrote itself (same stride as the tile loop).
        for (u64 i = threadIdx.x; i < n; i += THREADS) {
            out_pages[i] = 0u;
        }
        if (threadIdx.x < CP) {
            const u32 want = s_base[threadIdx.x];
            const u32 top = s_top[threadIdx.x];
            const u32 deficit = want > top ? want - top : 0u;
            status[1u + threadIdx.x] = chc_sat_add(status[1u + threadIdx.x], deficit);
        }
        if (threadIdx.x == 0) {
            status[0] = chc_sat_add(status[0], 1u);
            status[CP + 1u] = chc_sat_add(status[CP + 1u], s_bad_owners);
        }
    }
    const u64 locs = (u64)n << LOG2_PAGE_SIZE;
    for (u64 j = threadIdx.x; j < locs; j += THREADS) {
        const u64 page = refused ? 0u : out_pages[j >> LOG2_PAGE_SIZE];
        out_locs[j] = (i64)((page << LOG2_PAGE_SIZE) | (j & (PAGE_SIZE - 1u)));
    }
    if (!refused && threadIdx.x < CP) {
        // No deficit: every lane holds at least what was taken from it.
        lane_tops[threadIdx.x] = s_top[threadIdx.x] - s_base[threadIdx.x];
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(select_owner_pages_cp4_ps16_t256)
#endif