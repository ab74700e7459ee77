{% include "prelude.cu" %}
{% include "tile_rank.cu" %}

{% if locs -%}
// Pops one page per requested owner from the lane free stacks (LIFO, docs/KERNELS.md) and
// writes the pages and their page-contiguous token locations. Launch: 1 block of THREADS
// (more are refused: chc_refuse_grid).
// All or nothing, whatever the host checked: when any lane holds fewer pages than requested,
// or an owner is >= CP, no lane top changes, every output page is 0 (the null page, so the
// locations are its slots), and the status words add up the refusal:
{%- else -%}
// Pops one page per requested owner from the lane free stacks (LIFO, docs/KERNELS.md) and
// writes the pages only: the consumer derives the token locations (page * PAGE_SIZE + j),
// which would be 8 * PAGE_SIZE bytes per page from this one block. Launch: 1 block of
// THREADS (more are refused: chc_refuse_grid).
// All or nothing, whatever the host checked: when any lane holds fewer pages than requested,
// or an owner is >= CP, no lane top changes, every output page is 0 (the null page), and the
// status words add up the refusal:
{%- endif %}
//   status[0] += 1, status[1 + o] += deficit of lane o, status[CP + 1] += owners >= CP
// (saturating). The host reads them back only when it synchronises anyway.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
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
{%- if locs %}
    const u64 locs = (u64)n << LOG2_PAGE_SIZE;
    for (u64 j = threadIdx.x; j < locs; j += THREADS) {
        const u64 page = refused ? 0u : out_pages[j >> LOG2_PAGE_SIZE];
        out_locs[j] = (i64)((page << LOG2_PAGE_SIZE) | (j & (PAGE_SIZE - 1u)));
    }
{%- endif %}
    if (!refused && threadIdx.x < CP) {
        // No deficit: every lane holds at least what was taken from it.
        lane_tops[threadIdx.x] = s_top[threadIdx.x] - s_base[threadIdx.x];
    }
}
{% include "epilogue.cu" %}
