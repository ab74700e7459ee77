{% include "prelude.cu" %}
{% include "tile_rank.cu" %}

// Pops one page per requested owner from the lane free stacks (LIFO, docs/KERNELS.md) and
// writes the pages and their page-contiguous token locations. Launch: 1 block of THREADS.
// The host has checked that every lane holds enough pages; a short lane yields page 0.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
    __shared__ u32 s_warp_cnt[WARPS * CP];
    __shared__ u32 s_base[CP];
    __shared__ u32 s_top[CP];
    if (threadIdx.x < CP) {
        s_base[threadIdx.x] = 0u;
        const u32 top = lane_tops[threadIdx.x];
        s_top[threadIdx.x] = top < lane_cap ? top : lane_cap;
    }
    __syncthreads();
    // In 64 bits: with n near 2^32 a u32 base would wrap to 0 and never end the loop.
    for (u64 base = 0; base < n; base += THREADS) {
        const u64 i = base + threadIdx.x;
        u32 o = CP;
        if (i < n) {
            const u32 req = owners[i];
            o = req < CP ? req : CP;
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
    __syncthreads();
    const u64 locs = (u64)n << LOG2_PAGE_SIZE;
    for (u64 j = threadIdx.x; j < locs; j += THREADS) {
        const u64 page = out_pages[j >> LOG2_PAGE_SIZE];
        out_locs[j] = (i64)((page << LOG2_PAGE_SIZE) | (j & (PAGE_SIZE - 1u)));
    }
    if (threadIdx.x < CP) {
        const u32 used = s_base[threadIdx.x];
        const u32 top = s_top[threadIdx.x];
        lane_tops[threadIdx.x] = used < top ? top - used : 0u;
    }
}
{% include "epilogue.cu" %}
