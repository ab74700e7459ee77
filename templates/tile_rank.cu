
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
