{% include "prelude.cu" %}
{% include "synth_common.cu" %}
{% if interleaved %}{% include "interleave.cu" %}{% endif %}
{% if interleaved %}// Writes the synthesised {{ buffer }} bytes (docs/KERNELS.md) of tokens [first_token, n_tokens)
// of the sequence, token-interleaved (chc_token_at), that `rank` owns into its pool
{% else %}// Writes the synthesised {{ buffer }} bytes (docs/KERNELS.md) of tokens [first_token, n_tokens)
// of the sequence that `rank` owns into its pool
{% endif %}// (a page table: layer l's local pages start at pool[l], page_stride bytes apart); other tokens (an extended request's earlier tokens in its
// kept partial page), other pages and padding slots are left untouched.
// Work item w = (layer, page); blocks stride over the items. Per field, the threads stride
// over the flat pairs x -> (slot x / D, draw x % D) of the page's real tokens, each draw one
// 8-byte store (a partial last draw: its bytes only). Thread i takes x = i + k * THREADS: every
// PHASES-th of its pairs has the same draw, TOK_STEP slots on (PHASES * THREADS = TOK_STEP * D
// = lcm(THREADS, D)), so it walks them phase by phase and mixes the draw's key once a phase.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
{%- if interleaved %}
    const u32 n_pages = (u32)(((u64)n_tokens + GRANULE_TOKENS - 1u) / GRANULE_TOKENS * CP);
    // Every page of first_token's granule may hold later tokens.
    const u32 start_page = (u32)((u64)first_token / GRANULE_TOKENS * CP);
{%- else %}
    const u32 n_pages = (u32)(((u64)n_tokens + PAGE_SIZE - 1u) >> LOG2_PAGE_SIZE);
    const u32 start_page = first_token >> LOG2_PAGE_SIZE;
{%- endif %}
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
        u8* dst = (u8*)pool[layer] + (u64)local * page_stride;
{%- if interleaved %}
        const u32 real = chc_tokens_in_page(i, n_tokens);
        // A page holds its tokens in order: its first `lo` slots are before first_token.
        const u32 lo = chc_tokens_in_page(i, first_token);
{%- else %}
        const u64 t0 = (u64)i << LOG2_PAGE_SIZE;
        const u64* hashes = prefix_hash + t0;
        const u64 left = n_tokens - t0;
        const u32 real = left < PAGE_SIZE ? (u32)left : PAGE_SIZE;
        const u32 lo = first_token > t0 ? (u32)(first_token - t0) : 0u;
{%- endif %}
{%- for f in fields %}
        // Field {{ f.id }}: {{ f.count }} x {{ f.dtype }} per token at byte {{ f.base }} + slot * {{ f.tok_stride }}, {{ f.per_draw }} per draw.
{%- for g in f.segments %}
        // {{ g.what }}: D = {{ g.draws }}, PHASES = {{ g.phases }}, TOK_STEP = {{ g.tok_step }}.
        for (u32 p = 0; p < {{ g.phases }}u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / {{ g.draws }}u;
            if (j0 >= real) {
                break;
            }
            const u32 d = {{ g.first_draw }}u + x % {{ g.draws }}u;
            const u64 key = chc_key(layer, {{ f.id }}u, d);
            u8* at = dst + {{ f.base }}u + d * 8u;
            // The first of this thread's slots (j0 + k * TOK_STEP) at or after lo.
            const u32 j1 = j0 < lo ? j0 + (lo - j0 + {{ g.tok_step }}u - 1u) / {{ g.tok_step }}u * {{ g.tok_step }}u : j0;
            for (u32 j = j1; j < real; j += {{ g.tok_step }}u) {
{%- if interleaved %}
                const u64 r = {{ f.pack }}(chc_mix64(prefix_hash[chc_token_at(i, j)] ^ key));
{%- else %}
                const u64 r = {{ f.pack }}(chc_mix64(hashes[j] ^ key));
{%- endif %}
                u8* q = at + j * {{ f.tok_stride }}u;
{%- for a in g.accesses %}
                *({{ a.ctype }}*)(q + {{ a.off }}u) = {{ a.value }};
{%- endfor %}
            }
        }
{%- endfor %}
{%- endfor %}
    }
}
{% include "epilogue.cu" %}
