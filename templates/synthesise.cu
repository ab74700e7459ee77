{% include "prelude.cu" %}
{% include "synth_common.cu" %}

// Writes the synthesised {{ buffer }} bytes (docs/KERNELS.md) of the real tokens of sequence
// pages [start_page, ceil(n_tokens / PAGE_SIZE)) that `rank` owns into its pool
// [layer][local_page][PAGE_BYTES]; other pages and padding slots are left untouched.
// Work item w = (layer, page); blocks stride over the items, threads over the elements.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
    const u32 n_pages = (u32)(((u64)n_tokens + PAGE_SIZE - 1u) >> LOG2_PAGE_SIZE);
    const u32 span = n_pages > start_page ? n_pages - start_page : 0u;
    const u64 items = (u64)span * layers;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u32 layer = (u32)(w / span);
        const u32 i = start_page + (u32)(w % span);
        const u32 page = seq_pages[i];
        const u32 local = page / CP;
        if (page % CP != rank || local >= local_pages) {
            continue;
        }
        u8* dst = pool + ((u64)layer * local_pages + local) * PAGE_BYTES;
        const u64 t0 = (u64)i << LOG2_PAGE_SIZE;
        const u64 left = n_tokens - t0;
        const u32 real = left < PAGE_SIZE ? (u32)left : PAGE_SIZE;
{%- for f in fields %}
        // field {{ f.id }}: {{ f.count }} x {{ f.dtype }} per token, {{ f.per_draw }} per draw
        for (u32 x = threadIdx.x; x < real * {{ f.draws }}u; x += THREADS) {
            const u32 j = x / {{ f.draws }}u;
            const u32 d = x % {{ f.draws }}u;
            const u64 r = chc_draw(prefix_hash[t0 + j], layer, {{ f.id }}u, d);
            for (u32 s = 0; s < {{ f.per_draw }}u; ++s) {
                const u32 e = d * {{ f.per_draw }}u + s;
                if (e < {{ f.count }}u) {
                    *({{ f.ctype }}*)(dst + {{ f.base }}u + j * {{ f.tok_stride }}u + e * {{ f.size }}u) = {{ f.enc }}(r >> (s * {{ f.lane_bits }}u));
                }
            }
        }
{%- endfor %}
    }
}
{% include "epilogue.cu" %}
