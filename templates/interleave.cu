
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

