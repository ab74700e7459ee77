// synthesise_nsa_kv_cp4_ps64_t128
// Rendered by cp-hicache from templates/synthesise.cu; do not edit: regenerate instead.
// Self-contained CUDA C: no headers; the integer names below are the only typedefs.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef int i32;
typedef long long i64;

#define CP 4
#define PAGE_SIZE 64
#define LOG2_PAGE_SIZE 6
#define PAGE_BYTES 41984
#define BUFFER_ID 0
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

// Writes the synthesised nsa_kv bytes (docs/KERNELS.md) of the real tokens of sequence
// pages [start_page, ceil(n_tokens / PAGE_SIZE)) that `rank` owns into its pool
// [layer][local_page][PAGE_BYTES]; other pages and padding slots are left untouched.
// Work item w = (layer, page); blocks stride over the items, threads over the elements.
extern "C" __global__ void __launch_bounds__(THREADS) synthesise_nsa_kv_cp4_ps64_t128(
    u8* __restrict__ pool, const u64* __restrict__ prefix_hash,
    const u32* __restrict__ seq_pages, u32 n_tokens, u32 start_page, u32 rank, u32 layers,
    u32 local_pages)
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
        // field 0: 512 x fp8_e4m3 per token, 8 per draw
        for (u32 x = threadIdx.x; x < real * 64u; x += THREADS) {
            const u32 j = x / 64u;
            const u32 d = x % 64u;
            const u64 r = chc_draw(prefix_hash[t0 + j], layer, 0u, d);
            for (u32 s = 0; s < 8u; ++s) {
                const u32 e = d * 8u + s;
                if (e < 512u) {
                    *(u8*)(dst + 0u + j * 656u + e * 1u) = chc_enc_fp8(r >> (s * 8u));
                }
            }
        }
        // field 1: 4 x f32 per token, 2 per draw
        for (u32 x = threadIdx.x; x < real * 2u; x += THREADS) {
            const u32 j = x / 2u;
            const u32 d = x % 2u;
            const u64 r = chc_draw(prefix_hash[t0 + j], layer, 1u, d);
            for (u32 s = 0; s < 2u; ++s) {
                const u32 e = d * 2u + s;
                if (e < 4u) {
                    *(u32*)(dst + 512u + j * 656u + e * 4u) = chc_enc_f32(r >> (s * 32u));
                }
            }
        }
        // field 2: 64 x bf16 per token, 4 per draw
        for (u32 x = threadIdx.x; x < real * 16u; x += THREADS) {
            const u32 j = x / 16u;
            const u32 d = x % 16u;
            const u64 r = chc_draw(prefix_hash[t0 + j], layer, 2u, d);
            for (u32 s = 0; s < 4u; ++s) {
                const u32 e = d * 4u + s;
                if (e < 64u) {
                    *(u16*)(dst + 528u + j * 656u + e * 2u) = chc_enc_bf16(r >> (s * 16u));
                }
            }
        }
    }
}

#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(synthesise_nsa_kv_cp4_ps64_t128)
#endif