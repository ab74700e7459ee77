{% include "prelude.cu" %}
{% include "synth_common.cu" %}
{% if interleaved %}{% include "interleave.cu" %}{% endif %}
// Sets bit t of the bitmap (word t / 32, bit t % 32). The word is read first: where a whole
// sequence is wrong (a load that never happened) every pair of every token mismatches, and
// one atomic per token and thread is enough. A stale read only costs one atomic more: bits
// are only ever set, so a bit seen set is set. The read is volatile (`ld.volatile`, not a
// plain load the compiler may cache or reorder), since other threads' atomics write the word
// meanwhile.
static __device__ inline void chc_flag_token(u32* bad_tokens, u32 t)
{
    const u32 bit = 1u << (t & 31u);
    if ((((const volatile u32*)bad_tokens)[t >> 5] & bit) == 0u) {
        atomicOr(bad_tokens + (t >> 5), bit);
    }
}

// Compares the dense {{ buffer }} buffer [layer][seq_page][PAGE_BYTES] with the synthesised
// bytes of tokens [start_page * PAGE_SIZE, n_tokens) and sets bit t of bad_tokens for every
// mismatched token t (any byte of any field in any layer). Bits are only ever set, so the
// verify kernels of every buffer kind can share one bitmap and a token wrong in several is
// counted once, and so can the work items of one token's layers.
// Work item w = (layer, run of ITEM_TOKENS tokens); blocks stride over the items. Per field,
// the threads stride over the flat pairs x -> (token x / D, draw x % D) of the run, each draw
// one 8-byte load and compare (a partial last draw: its bytes only); a thread walks its pairs
// phase by phase as in synthesise, mixing the draw's key once a phase. Every thread that sees
// a mismatch sets the token's bit itself: no barrier, no shared memory.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
{%- if interleaved %}
    // Token-interleaved: the dense buffer holds whole granules (chc_page_of, chc_slot_of).
    const u64 n_pages = ((u64)n_tokens + GRANULE_TOKENS - 1u) / GRANULE_TOKENS * CP;
{%- else %}
    const u64 n_pages = ((u64)n_tokens + PAGE_SIZE - 1u) >> LOG2_PAGE_SIZE;
{%- endif %}
    const u64 first = (u64)start_page << LOG2_PAGE_SIZE;
    const u64 runs = first < n_tokens ? (n_tokens - first + ITEM_TOKENS - 1u) / ITEM_TOKENS : 0u;
    const u64 items = runs * layers;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u32 layer = (u32)(w / runs);
        const u32 t0 = (u32)(first + (w % runs) * ITEM_TOKENS);
        const u32 nt = n_tokens - t0 < ITEM_TOKENS ? n_tokens - t0 : ITEM_TOKENS;
        const u8* src = dense + (u64)layer * n_pages * PAGE_BYTES;
{%- for f in fields %}
        // Field {{ f.id }}: {{ f.count }} x {{ f.dtype }} per token at byte {{ f.base }} + slot * {{ f.tok_stride }}, {{ f.per_draw }} per draw.
{%- for g in f.segments %}
        // {{ g.what }}: D = {{ g.draws }}, PHASES = {{ g.phases }}, TOK_STEP = {{ g.tok_step }}.
        for (u32 p = 0; p < {{ g.phases }}u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / {{ g.draws }}u;
            if (j0 >= nt) {
                break;
            }
            const u32 d = {{ g.first_draw }}u + x % {{ g.draws }}u;
            const u64 key = chc_key(layer, {{ f.id }}u, d);
            const u8* at = src + {{ f.base }}u + d * 8u;
            for (u32 j = j0; j < nt; j += {{ g.tok_step }}u) {
                const u32 t = t0 + j;
                const u64 r = {{ f.pack }}(chc_mix64(prefix_hash[t] ^ key));
{%- if interleaved %}
                const u8* q = at + chc_page_of(t) * PAGE_BYTES + chc_slot_of(t) * {{ f.tok_stride }}u;
{%- else %}
                const u8* q = at + (u64)(t >> LOG2_PAGE_SIZE) * PAGE_BYTES + (t & (PAGE_SIZE - 1u)) * {{ f.tok_stride }}u;
{%- endif %}
                if ({% for a in g.accesses %}{% if !loop.first %} | {% endif %}(*(const {{ a.ctype }}*)(q + {{ a.off }}u) != {{ a.value }}){% endfor %}) {
                    chc_flag_token(bad_tokens, t);
                }
            }
        }
{%- endfor %}
{%- endfor %}
    }
}
{% include "epilogue.cu" %}
