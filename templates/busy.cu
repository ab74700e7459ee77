{% include "prelude.cu" %}

{% include "busy_common.cu" %}

// A compute-bound stand-in for the model's kernels: thread word i of [0, n) starts from
// seed ^ (i * 0x9E3779B9), runs `rounds` dependent rounds and stores the result to out[i].
// It holds registers and issue slots for as long as `rounds` says and touches almost no
// memory, so timing a transfer beside it shows what the transfer costs the model and what
// the model costs the transfer. Threads stride over the words, so any grid is correct.
// `stamps` gets the launch's first block start and last block end (chc_stamp_*).
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
    chc_stamp_start(stamps);
    for (u64 i = (u64)blockIdx.x * THREADS + threadIdx.x; i < n; i += (u64)gridDim.x * THREADS) {
        u32 x = seed ^ ((u32)i * 0x9E3779B9u);
        for (u32 r = 0; r < rounds; ++r) {
            x = chc_busy_round(x);
        }
        out[i] = x;
    }
    chc_stamp_end(stamps);
}
{% include "epilogue.cu" %}
