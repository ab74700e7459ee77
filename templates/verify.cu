{% include "prelude.cu" %}
{% include "synth_common.cu" %}

// Compares the dense {{ buffer }} buffer [layer][seq_page][PAGE_BYTES] with the synthesised
// bytes of tokens [start_page * PAGE_SIZE, n_tokens) and sets bit t of bad_tokens (word t / 32,
// bit t % 32) for every mismatched token t (any byte of any field in any layer). Bits are only
// ever set, so the verify kernels of every buffer kind can share one bitmap and a token wrong
// in several is counted once. Blocks stride over tokens, threads over the elements of a token.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
    const u64 n_pages = ((u64)n_tokens + PAGE_SIZE - 1u) >> LOG2_PAGE_SIZE;
    for (u64 t = ((u64)start_page << LOG2_PAGE_SIZE) + blockIdx.x; t < n_tokens; t += gridDim.x) {
        const u64 h = prefix_hash[t];
        const u64 i = t >> LOG2_PAGE_SIZE;
        const u32 j = (u32)(t & (PAGE_SIZE - 1u));
        u32 bad = 0u;
        for (u32 layer = 0; layer < layers; ++layer) {
            const u8* src = dense + ((u64)layer * n_pages + i) * PAGE_BYTES;
{%- for f in fields %}
            // field {{ f.id }}: {{ f.count }} x {{ f.dtype }} per token, {{ f.per_draw }} per draw
            for (u32 d = threadIdx.x; d < {{ f.draws }}u; d += THREADS) {
                const u64 r = chc_draw(h, layer, {{ f.id }}u, d);
                for (u32 s = 0; s < {{ f.per_draw }}u; ++s) {
                    const u32 e = d * {{ f.per_draw }}u + s;
                    if (e < {{ f.count }}u && *(const {{ f.ctype }}*)(src + {{ f.base }}u + j * {{ f.tok_stride }}u + e * {{ f.size }}u) != {{ f.enc }}(r >> (s * {{ f.lane_bits }}u))) {
                        bad = 1u;
                    }
                }
            }
{%- endfor %}
        }
        // Setting a bit is idempotent, so any thread that saw a mismatch sets it: no barrier
        // per token (on the CPU emulator a barrier is a fiber switch per thread).
        if (bad) {
            atomicOr(bad_tokens + (t >> 5), 1u << (u32)(t & 31u));
        }
    }
}
{% include "epilogue.cu" %}
