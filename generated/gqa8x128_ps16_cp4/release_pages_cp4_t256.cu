// release_pages_cp4_t256
// Rendered by cp-hicache from templates/release_pages.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define CP 4
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

// The lane a released page goes back to, or CP for an invalid page: page 0 (null), or a
// local index page / CP >= lane_cap, which no lane of lane_cap slots owns.
static __device__ inline u32 chc_release_lane(u32 page, u32 lane_cap)
{
    return (page != 0u && page / CP < lane_cap) ? page % CP : CP;
}

// Pushes pages back onto their owner's lane free stack (owner = page % CP) in input order
// (docs/KERNELS.md). Launch: 1 block of THREADS (more are refused: chc_refuse_grid).
// All or nothing, whatever the host checked: when any lane would hold more than lane_cap
// pages, or any page is invalid (chc_release_lane), no lane top and no stack slot changes,
// and the status words add up the refusal:
//   status[0] += 1, status[1 + o] += pages lane o had no room for, status[CP + 1] += invalid
// pages (saturating). The host reads them back only when it synchronises anyway.
extern "C" __global__ void __launch_bounds__(THREADS) release_pages_cp4_t256(
    const u32* __restrict__ pages, u32 n, u32* __restrict__ lane_stacks,
    u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ status)
{
    if (chc_refuse_grid(status)) {
        return;
    }
    __shared__ u32 s_warp_cnt[WARPS * CP];
    __shared__ u32 s_base[CP];
    __shared__ u32 s_top[CP];
    __shared__ u32 s_count[CP];
    __shared__ u32 s_bad_pages;
    __shared__ u32 s_refused;
    if (threadIdx.x < CP) {
        s_base[threadIdx.x] = 0u;
        s_count[threadIdx.x] = 0u;
        const u32 top = lane_tops[threadIdx.x];
        s_top[threadIdx.x] = top < lane_cap ? top : lane_cap;
    }
    if (threadIdx.x == 0) {
        s_bad_pages = 0u;
        s_refused = 0u;
    }
    __syncthreads();
    // Count first, writing nothing: each warp's leader of an owner adds its peers to the
    // lane's count (one shared atomic per owner per warp), and invalid pages are counted with
    // a shared atomicAdd each, only on that error path.
    // In 64 bits: with n near 2^32 a u32 base would wrap to 0 and never end the loop.
    for (u64 base = 0; base < n; base += THREADS) {
        const u64 i = base + threadIdx.x;
        u32 o = CP;
        if (i < n) {
            o = chc_release_lane(pages[i], lane_cap);
            if (o == CP) {
                atomicAdd(&s_bad_pages, 1u);
            }
        }
        const u32 peers = __match_any_sync(0xffffffffu, o);
        if (o < CP && (peers & ((1u << (threadIdx.x & 31u)) - 1u)) == 0u) {
            atomicAdd(&s_count[o], (u32)__popc(peers));
        }
    }
    __syncthreads();
    // Any lane without room for its pages, or any invalid page, refuses the whole launch.
    if ((threadIdx.x < CP && s_count[threadIdx.x] > lane_cap - s_top[threadIdx.x])
        || (threadIdx.x == 0 && s_bad_pages != 0u)) {
        s_refused = 1u;
    }
    __syncthreads();
    if (s_refused != 0u) {
        if (threadIdx.x < CP) {
            const u32 room = lane_cap - s_top[threadIdx.x];
            const u32 want = s_count[threadIdx.x];
            const u32 over = want > room ? want - room : 0u;
            status[1u + threadIdx.x] = chc_sat_add(status[1u + threadIdx.x], over);
        }
        if (threadIdx.x == 0) {
            status[0] = chc_sat_add(status[0], 1u);
            status[CP + 1u] = chc_sat_add(status[CP + 1u], s_bad_pages);
        }
        return; // s_refused is the same for every thread: no barrier is left waiting.
    }
    for (u64 base = 0; base < n; base += THREADS) {
        const u64 i = base + threadIdx.x;
        u32 o = CP;
        u32 page = 0u;
        if (i < n) {
            page = pages[i];
            o = chc_release_lane(page, lane_cap);
        }
        const u32 k = chc_tile_rank(o, s_warp_cnt, s_base);
        // Every lane has room (the count above), so the bound only keeps the reach should
        // the pages change under the launch.
        if (o < CP) {
            const u32 slot = s_top[o] + k;
            if (slot < lane_cap) {
                lane_stacks[(u64)o * lane_cap + slot] = page;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < CP) {
        const u32 pushed = s_top[threadIdx.x] + s_base[threadIdx.x];
        lane_tops[threadIdx.x] = pushed < lane_cap ? pushed : lane_cap;
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(release_pages_cp4_t256)
#endif