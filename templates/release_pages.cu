{% include "prelude.cu" %}
{% include "tile_rank.cu" %}

// Pushes pages back onto their owner's lane free stack (owner = page % CP) in input order
// (docs/KERNELS.md). Launch: 1 block of THREADS. Page 0 and pushes past lane_cap are skipped;
// the host rejects both before launching.
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
        u32 page = 0u;
        if (i < n) {
            page = pages[i];
            o = page != 0u ? page % CP : CP;
        }
        const u32 k = chc_tile_rank(o, s_warp_cnt, s_base);
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
{% include "epilogue.cu" %}
