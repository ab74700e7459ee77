
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
