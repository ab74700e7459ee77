{% include "prelude.cu" %}

{% include "busy_common.cu" %}

// A memory-bound stand-in for the model's kernels: the busy chain of busy.cu, each round
// read from and written back to out[i], so out[i] ends as busy.cu's word (the same
// reference). A round sweeps all of out before the next, so with out larger than L2 every
// round streams 8 × n bytes through HBM: timing a transfer beside it shows what the
// transfer and the model's memory traffic cost each other. A thread owns the words it
// strides over in every round, so no round waits for another thread and any grid is
// correct. `stamps` as in busy.cu.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
    chc_stamp_start(stamps);
    const u64 first = (u64)blockIdx.x * THREADS + threadIdx.x;
    const u64 stride = (u64)gridDim.x * THREADS;
    for (u64 i = first; i < n; i += stride) {
        out[i] = seed ^ ((u32)i * 0x9E3779B9u);
    }
    for (u32 r = 0; r < rounds; ++r) {
        for (u64 i = first; i < n; i += stride) {
            out[i] = chc_busy_round(out[i]);
        }
    }
    chc_stamp_end(stamps);
}
{% include "epilogue.cu" %}
