// synthesise_gqa8x128_kv_cp4_ps16_t128
// Rendered by cp-hicache from templates/synthesise.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define CP 4
#define PAGE_SIZE 16
#define LOG2_PAGE_SIZE 4
#define PAGE_BYTES 65536
#define BUFFER_ID 0
#define THREADS 128

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

// Writes the synthesised gqa8x128_kv bytes (docs/KERNELS.md) of tokens [first_token, n_tokens)
// of the sequence that `rank` owns into its pool
// (a page table: layer l's local pages start at pool[l], page_stride bytes apart); other tokens (an extended request's earlier tokens in its
// kept partial page), other pages and padding slots are left untouched.
// Work item w = (layer, page); blocks stride over the items. Per field, the threads stride
// over the flat pairs x -> (slot x / D, draw x % D) of the page's real tokens, each draw one
// 8-byte store (a partial last draw: its bytes only). Thread i takes x = i + k * THREADS: every
// PHASES-th of its pairs has the same draw, TOK_STEP slots on (PHASES * THREADS = TOK_STEP * D
// = lcm(THREADS, D)), so it walks them phase by phase and mixes the draw's key once a phase.
extern "C" __global__ void __launch_bounds__(THREADS) synthesise_gqa8x128_kv_cp4_ps16_t128(
    const u64* __restrict__ pool, const u64* __restrict__ prefix_hash,
    const u32* __restrict__ seq_pages, u32 n_tokens, u32 first_token, u32 rank, u32 layers,
    u32 local_pages, u32 page_stride)
{
    const u32 n_pages = (u32)(((u64)n_tokens + PAGE_SIZE - 1u) >> LOG2_PAGE_SIZE);
    const u32 start_page = first_token >> LOG2_PAGE_SIZE;
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
        const u64 t0 = (u64)i << LOG2_PAGE_SIZE;
        const u64* hashes = prefix_hash + t0;
        const u64 left = n_tokens - t0;
        const u32 real = left < PAGE_SIZE ? (u32)left : PAGE_SIZE;
        const u32 lo = first_token > t0 ? (u32)(first_token - t0) : 0u;
        // Field 0: 1024 x bf16 per token at byte 0 + slot * 2048, 4 per draw.
        // Draws 0..256, full: one u64 each: D = 256, PHASES = 2, TOK_STEP = 1.
        for (u32 p = 0; p < 2u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / 256u;
            if (j0 >= real) {
                break;
            }
            const u32 d = 0u + x % 256u;
            const u64 key = chc_key(layer, 0u, d);
            u8* at = dst + 0u + d * 8u;
            // The first of this thread's slots (j0 + k * TOK_STEP) at or after lo.
            const u32 j1 = j0 < lo ? j0 + (lo - j0 + 1u - 1u) / 1u * 1u : j0;
            for (u32 j = j1; j < real; j += 1u) {
                const u64 r = chc_pack_bf16(chc_mix64(hashes[j] ^ key));
                u8* q = at + j * 2048u;
                *(u64*)(q + 0u) = r;
            }
        }
        // Field 1: 1024 x bf16 per token at byte 32768 + slot * 2048, 4 per draw.
        // Draws 0..256, full: one u64 each: D = 256, PHASES = 2, TOK_STEP = 1.
        for (u32 p = 0; p < 2u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / 256u;
            if (j0 >= real) {
                break;
            }
            const u32 d = 0u + x % 256u;
            const u64 key = chc_key(layer, 1u, d);
            u8* at = dst + 32768u + d * 8u;
            // The first of this thread's slots (j0 + k * TOK_STEP) at or after lo.
            const u32 j1 = j0 < lo ? j0 + (lo - j0 + 1u - 1u) / 1u * 1u : j0;
            for (u32 j = j1; j < real; j += 1u) {
                const u64 r = chc_pack_bf16(chc_mix64(hashes[j] ^ key));
                u8* q = at + j * 2048u;
                *(u64*)(q + 0u) = r;
            }
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(synthesise_gqa8x128_kv_cp4_ps16_t128)
#endif