// verify_gqa8x128_kv_ps16_t128
// Rendered by cp-hicache from templates/verify.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define PAGE_SIZE 16
#define LOG2_PAGE_SIZE 4
#define PAGE_BYTES 65536
#define BUFFER_ID 0
#define THREADS 128
#define ITEM_TOKENS 128

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

// Compares the dense gqa8x128_kv buffer [layer][seq_page][PAGE_BYTES] with the synthesised
// bytes of tokens [start_page * PAGE_SIZE, n_tokens) and sets bit t of bad_tokens for every
// mismatched token t (any byte of any field in any layer). Bits are only ever set, so the
// verify kernels of every buffer kind can share one bitmap and a token wrong in several is
// counted once, and so can the work items of one token's layers.
// Work item w = (layer, run of ITEM_TOKENS tokens); blocks stride over the items. Per field,
// the threads stride over the flat pairs x -> (token x / D, draw x % D) of the run, each draw
// one 8-byte load and compare (a partial last draw: its bytes only); a thread walks its pairs
// phase by phase as in synthesise, mixing the draw's key once a phase. Every thread that sees
// a mismatch sets the token's bit itself: no barrier, no shared memory.
extern "C" __global__ void __launch_bounds__(THREADS) verify_gqa8x128_kv_ps16_t128(
    const u8* __restrict__ dense, const u64* __restrict__ prefix_hash, u32 n_tokens,
    u32 start_page, u32 layers, u32* __restrict__ bad_tokens)
{
    const u64 n_pages = ((u64)n_tokens + PAGE_SIZE - 1u) >> LOG2_PAGE_SIZE;
    const u64 first = (u64)start_page << LOG2_PAGE_SIZE;
    const u64 runs = first < n_tokens ? (n_tokens - first + ITEM_TOKENS - 1u) / ITEM_TOKENS : 0u;
    const u64 items = runs * layers;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u32 layer = (u32)(w / runs);
        const u32 t0 = (u32)(first + (w % runs) * ITEM_TOKENS);
        const u32 nt = n_tokens - t0 < ITEM_TOKENS ? n_tokens - t0 : ITEM_TOKENS;
        const u8* src = dense + (u64)layer * n_pages * PAGE_BYTES;
        // Field 0: 1024 x bf16 per token at byte 0 + slot * 2048, 4 per draw.
        // Draws 0..256, full: one u64 each: D = 256, PHASES = 2, TOK_STEP = 1.
        for (u32 p = 0; p < 2u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / 256u;
            if (j0 >= nt) {
                break;
            }
            const u32 d = 0u + x % 256u;
            const u64 key = chc_key(layer, 0u, d);
            const u8* at = src + 0u + d * 8u;
            for (u32 j = j0; j < nt; j += 1u) {
                const u32 t = t0 + j;
                const u64 r = chc_pack_bf16(chc_mix64(prefix_hash[t] ^ key));
                const u8* q = at + (u64)(t >> LOG2_PAGE_SIZE) * PAGE_BYTES + (t & (PAGE_SIZE - 1u)) * 2048u;
                if ((*(const u64*)(q + 0u) != r)) {
                    chc_flag_token(bad_tokens, t);
                }
            }
        }
        // Field 1: 1024 x bf16 per token at byte 32768 + slot * 2048, 4 per draw.
        // Draws 0..256, full: one u64 each: D = 256, PHASES = 2, TOK_STEP = 1.
        for (u32 p = 0; p < 2u; ++p) {
            const u32 x = threadIdx.x + p * THREADS;
            const u32 j0 = x / 256u;
            if (j0 >= nt) {
                break;
            }
            const u32 d = 0u + x % 256u;
            const u64 key = chc_key(layer, 1u, d);
            const u8* at = src + 32768u + d * 8u;
            for (u32 j = j0; j < nt; j += 1u) {
                const u32 t = t0 + j;
                const u64 r = chc_pack_bf16(chc_mix64(prefix_hash[t] ^ key));
                const u8* q = at + (u64)(t >> LOG2_PAGE_SIZE) * PAGE_BYTES + (t & (PAGE_SIZE - 1u)) * 2048u;
                if ((*(const u64*)(q + 0u) != r)) {
                    chc_flag_token(bad_tokens, t);
                }
            }
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(verify_gqa8x128_kv_ps16_t128)
#endif