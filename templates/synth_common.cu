
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
