// One round of the busy chain: an LCG step and a xorshift, dependent on the last (so the
// compiler can neither vectorise nor shorten the chain).
static __device__ inline u32 chc_busy_round(u32 x)
{
    x = x * 1664525u + 1013904223u;
    return x ^ (x >> 13);
}

{% include "stamps.cu" %}
