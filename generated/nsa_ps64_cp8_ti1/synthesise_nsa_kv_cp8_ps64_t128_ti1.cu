// synthesise_nsa_kv_cp8_ps64_t128_ti1
// Rendered by cp-hicache from templates/synthesise.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define CP 8
#define PAGE_SIZE 64
#define LOG2_PAGE_SIZE 6
#define PAGE_BYTES 41984
#define BUFFER_ID 0
#define THREADS 128
#define RUN 1
#define LOG2_RUN 0
#define GRANULE_TOKENS 512

// splitmix64 finaliser.
static __device__ inline u64 chc_mix64(u64 z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// The mixed key of draw d of field `field` in `layer`: it does not depend on the token, so the
// kernels mix it once and use it for every token they take with that draw. Draw d of the
// token with prefix hash h is chc_mix64(h ^ chc_key(layer, field, d)).
static __device__ inline u64 chc_key(u32 layer, u32 field, u32 d)
{
    return chc_mix64(((u64)layer << 40) ^ ((u64)BUFFER_ID << 32) ^ ((u64)field << 24) ^ (u64)d);
}

// The packers turn a draw into the 8 bytes of its encoded elements, element s in lane s
// (bytes s * size ..), so a little-endian store of the word writes exactly the elements'
// bytes. Each lane is encoded from its own bits only, with the same integer operations as
// one element at a time (docs/KERNELS.md "Synthesised KV"). They are not static: a buffer
// kind may use only some of them, and unused non-static functions draw no NVRTC warning.

// 8 finite fp8-e4m3: any byte but the two NaN encodings (c ^= 1 where c & 0x7f == 0x7f).
// Adding 1 to each byte's low 7 bits carries into its bit 7 exactly when they are all ones,
// and never into the next byte.
__device__ inline u64 chc_pack_fp8(u64 r)
{
    const u64 nan = ((r & 0x7f7f7f7f7f7f7f7full) + 0x0101010101010101ull) & 0x8080808080808080ull;
    return r ^ (nan >> 7);
}

// 2 positive f32 scales in [2^-8, 2^-7): ((127 - 8) << 23) | (lane & 0x7fffff).
__device__ inline u64 chc_pack_f32(u64 r)
{
    return (r & 0x007fffff007fffffull) | 0x3b8000003b800000ull;
}

// 4 finite bf16 with a small exponent range: (lane & 0x8000) | ((120 + ((lane >> 8) & 15)) << 7)
// | (lane & 0x7f). The biased exponent 120..135 fills lane bits 7..14 without a carry out.
__device__ inline u64 chc_pack_bf16(u64 r)
{
    return (r & 0x807f807f807f807full)
        | ((((r >> 8) & 0x000f000f000f000full) + 0x0078007800780078ull) << 7);
}

// Token-interleave (docs/KERNELS.md "Layouts"): a granule is CP pages, one per rank, holding
// GRANULE_TOKENS = PAGE_SIZE * CP tokens. In granule g, run k of RUN tokens goes to the page
// of rank k % CP, after that page's earlier runs; sequence page i is rank i % CP's page of
// granule i / CP. Not static: each kernel uses only some of them (as the packers).

// The token in slot j of sequence page i.
__device__ inline u64 chc_token_at(u32 i, u32 j)
{
    return (u64)(i / CP) * GRANULE_TOKENS + (u64)(j >> LOG2_RUN) * ((u64)RUN * CP)
        + (u64)(i % CP) * RUN + (j & (RUN - 1u));
}

// How many slots of sequence page i hold one of the first n_tokens tokens: its first ones,
// since a page holds its tokens in order.
__device__ inline u32 chc_tokens_in_page(u32 i, u64 n_tokens)
{
    const u64 g0 = (u64)(i / CP) * GRANULE_TOKENS;
    const u64 over = n_tokens > g0 ? n_tokens - g0 : 0u;
    const u64 left = over < GRANULE_TOKENS ? over : GRANULE_TOKENS;
    const u64 stride = (u64)RUN * CP;
    const u64 rest = left % stride;
    const u64 mine = (u64)(i % CP) * RUN;
    const u64 part = rest > mine ? (rest - mine < RUN ? rest - mine : RUN) : 0u;
    return (u32)(left / stride * RUN + part);
}

// The sequence page holding token t.
__device__ inline u64 chc_page_of(u64 t)
{
    return t / GRANULE_TOKENS * CP + ((t % GRANULE_TOKENS) >> LOG2_RUN) % CP;
}

// The slot of token t in its page.
__device__ inline u32 chc_slot_of(u64 t)
{
    const u64 rel = t % GRANULE_TOKENS;
    return (u32)(rel / ((u64)RUN * CP) * RUN + (rel & (RUN - 1u)));
}

// Writes the synthesised nsa_kv bytes (docs/KERNELS.md) of tokens [first_token, n_tokens)
// of the sequence, token-interleaved (chc_token_at), that `rank` owns into its pool
// (a page table: layer l's local pages start at pool[l], page_stride bytes apart); other tokens (an extended request's earlier tokens in its
// kept partial page), other pages and padding slots are left untouched.
// Work item w = (layer, page); blocks stride over the items. Per field, the threads stride
// over the flat pairs x -> (slot x / D, draw x % D) of the page's real tokens, each draw one
// 8-byte store (a partial last draw: its bytes only). Thread i takes x = i + k * THREADS: every
// PHASES-th of its pairs has the same draw, TOK_STEP slots on (PHASES * THREADS = TOK_STEP * D
// = lcm(THREADS, D)), so it walks them phase by phase and mixes the draw's key once a phase.
extern "C" __global__ void __launch_bounds__(THREADS) synthesise_nsa_kv_cp8_ps64_t128_ti1(
    const u64* __restrict__ pool, const u64* __restrict__ prefix_hash,
    const u32* __restrict__ seq_pages, u32 n_tokens, u32 first_token, u32 rank, u32 layers,
    u32 local_pages, u32 page_stride)
{
    const u32 n_pages = (u32)(((u64)n_tokens + GRANULE_TOKENS - 1u) / GRANULE_TOKENS * CP);
    // Every page of first_token's granule may hold later tokens.
    const u32 start_page = (u32)((u64)first_token / GRANULE_TOKENS * CP);
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
        const u32 real = chc_tokens_in_page(i, n_tokens);
        // A page holds its tokens in order: its first `lo` slots are before first_token.
        const u32 lo = chc_tokens_in_page(i, first_token);
        // Field 0: 512 x fp8_e4m3 per token at byte 0 + slot * 656, 8 per draw.
        // Draws 0..64, full: one u64 each: D = 64, PHASES = 1, TOK_STEP = 2.
        for (u32 p = 0; p < 1u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / 64u;
            if (j0 >= real) {
                break;
            }
            const u32 d = 0u + x % 64u;
            const u64 key = chc_key(layer, 0u, d);
            u8* at = dst + 0u + d * 8u;
            // The first of this thread's slots (j0 + k * TOK_STEP) at or after lo.
            const u32 j1 = j0 < lo ? j0 + (lo - j0 + 2u - 1u) / 2u * 2u : j0;
            for (u32 j = j1; j < real; j += 2u) {
                const u64 r = chc_pack_fp8(chc_mix64(prefix_hash[chc_token_at(i, j)] ^ key));
                u8* q = at + j * 656u;
                *(u64*)(q + 0u) = r;
            }
        }
        // Field 1: 4 x f32 per token at byte 512 + slot * 656, 2 per draw.
        // Draws 0..2, full: one u64 each: D = 2, PHASES = 1, TOK_STEP = 64.
        for (u32 p = 0; p < 1u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / 2u;
            if (j0 >= real) {
                break;
            }
            const u32 d = 0u + x % 2u;
            const u64 key = chc_key(layer, 1u, d);
            u8* at = dst + 512u + d * 8u;
            // The first of this thread's slots (j0 + k * TOK_STEP) at or after lo.
            const u32 j1 = j0 < lo ? j0 + (lo - j0 + 64u - 1u) / 64u * 64u : j0;
            for (u32 j = j1; j < real; j += 64u) {
                const u64 r = chc_pack_f32(chc_mix64(prefix_hash[chc_token_at(i, j)] ^ key));
                u8* q = at + j * 656u;
                *(u64*)(q + 0u) = r;
            }
        }
        // Field 2: 64 x bf16 per token at byte 528 + slot * 656, 4 per draw.
        // Draws 0..16, full: one u64 each: D = 16, PHASES = 1, TOK_STEP = 8.
        for (u32 p = 0; p < 1u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / 16u;
            if (j0 >= real) {
                break;
            }
            const u32 d = 0u + x % 16u;
            const u64 key = chc_key(layer, 2u, d);
            u8* at = dst + 528u + d * 8u;
            // The first of this thread's slots (j0 + k * TOK_STEP) at or after lo.
            const u32 j1 = j0 < lo ? j0 + (lo - j0 + 8u - 1u) / 8u * 8u : j0;
            for (u32 j = j1; j < real; j += 8u) {
                const u64 r = chc_pack_bf16(chc_mix64(prefix_hash[chc_token_at(i, j)] ^ key));
                u8* q = at + j * 656u;
                *(u64*)(q + 0u) = r;
            }
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(synthesise_nsa_kv_cp8_ps64_t128_ti1)
#endif