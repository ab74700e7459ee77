// verify_nsa_idx_ps64_t128
// Rendered by cp-hicache from templates/verify.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define PAGE_SIZE 64
#define LOG2_PAGE_SIZE 6
#define PAGE_BYTES 8448
#define BUFFER_ID 1
#define THREADS 128

// splitmix64 finaliser.
static __device__ inline u64 chc_mix64(u64 z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Random word d of field `field` of a token with prefix hash h in `layer`; it holds the
// elements d * per_draw .. of the field, one lane each, low lane first.
static __device__ inline u64 chc_draw(u64 h, u32 layer, u32 field, u32 e)
{
    const u64 key = ((u64)layer << 40) ^ ((u64)BUFFER_ID << 32) ^ ((u64)field << 24) ^ (u64)e;
    return chc_mix64(h ^ chc_mix64(key));
}

// The encoders are not static: a buffer kind may use only some of them, and unused
// non-static functions draw no NVRTC warning.

// Finite fp8-e4m3: any byte but the two NaN encodings.
__device__ inline u8 chc_enc_fp8(u64 r)
{
    u32 c = (u32)(r & 0xffu);
    if ((c & 0x7fu) == 0x7fu) {
        c ^= 0x01u;
    }
    return (u8)c;
}

// Positive f32 scale in [2^-8, 2^-7).
__device__ inline u32 chc_enc_f32(u64 r)
{
    return ((127u - 8u) << 23) | (u32)(r & 0x7fffffu);
}

// Finite bf16 with a small exponent range.
__device__ inline u16 chc_enc_bf16(u64 r)
{
    return (u16)((u32)(r & 0x8000u) | ((120u + (u32)((r >> 8) & 15u)) << 7) | (u32)(r & 0x7fu));
}

// Compares the dense nsa_idx buffer [layer][seq_page][PAGE_BYTES] with the synthesised
// bytes of tokens [start_page * PAGE_SIZE, n_tokens) and sets bit t of bad_tokens (word t / 32,
// bit t % 32) for every mismatched token t (any byte of any field in any layer). Bits are only
// ever set, so the verify kernels of every buffer kind can share one bitmap and a token wrong
// in several is counted once. Blocks stride over tokens, threads over the elements of a token.
extern "C" __global__ void __launch_bounds__(THREADS) verify_nsa_idx_ps64_t128(
    const u8* __restrict__ dense, const u64* __restrict__ prefix_hash, u32 n_tokens,
    u32 start_page, u32 layers, u32* __restrict__ bad_tokens)
{
    const u64 n_pages = ((u64)n_tokens + PAGE_SIZE - 1u) >> LOG2_PAGE_SIZE;
    for (u64 t = ((u64)start_page << LOG2_PAGE_SIZE) + blockIdx.x; t < n_tokens; t += gridDim.x) {
        const u64 h = prefix_hash[t];
        const u64 i = t >> LOG2_PAGE_SIZE;
        const u32 j = (u32)(t & (PAGE_SIZE - 1u));
        u32 bad = 0u;
        for (u32 layer = 0; layer < layers; ++layer) {
            const u8* src = dense + ((u64)layer * n_pages + i) * PAGE_BYTES;
            // field 0: 128 x fp8_e4m3 per token, 8 per draw
            for (u32 d = threadIdx.x; d < 16u; d += THREADS) {
                const u64 r = chc_draw(h, layer, 0u, d);
                for (u32 s = 0; s < 8u; ++s) {
                    const u32 e = d * 8u + s;
                    if (e < 128u && *(const u8*)(src + 0u + j * 128u + e * 1u) != chc_enc_fp8(r >> (s * 8u))) {
                        bad = 1u;
                    }
                }
            }
            // field 1: 1 x f32 per token, 2 per draw
            for (u32 d = threadIdx.x; d < 1u; d += THREADS) {
                const u64 r = chc_draw(h, layer, 1u, d);
                for (u32 s = 0; s < 2u; ++s) {
                    const u32 e = d * 2u + s;
                    if (e < 1u && *(const u32*)(src + 8192u + j * 4u + e * 4u) != chc_enc_f32(r >> (s * 32u))) {
                        bad = 1u;
                    }
                }
            }
        }
        // Setting a bit is idempotent, so any thread that saw a mismatch sets it: no barrier
        // per token (on the CPU emulator a barrier is a fiber switch per thread).
        if (bad) {
            atomicOr(bad_tokens + (t >> 5), 1u << (u32)(t & 31u));
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(verify_nsa_idx_ps64_t128)
#endif