{% include "prelude.cu" %}
{% include "copy_page.cu" %}

// Gathers sequence page i (global page p = seq_pages[i]) from rank p % CP, local page p / CP,
// into dense[layer][i][PAGE_BYTES], for every layer. The pools are a page table: rank r's
// layer l starts at pools[r * layers + l], its pages page_stride bytes apart. Work item w = (group of PAGES_PER_BLOCK
// pages, layer), or with LAYERS_IN_BLOCK the group alone, whose pages are gathered for every
// layer, page by page; blocks stride over the items. A block's pages, over all its items, are
// one flat run of vectors (chc_copy_vecs). Pages beyond local_pages are skipped. MIN_BLOCKS
// blocks fit an SM (a full one): the gather is bound by HBM, so occupancy is bytes in flight.
extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
    // In 64 bits: n near 2^32 must not wrap the rounding (or the pair index below) to 0.
    const u32 groups = (u32)(((u64)n + PAGES_PER_BLOCK - 1u) / PAGES_PER_BLOCK);
    const u64 items = (u64)groups * (LAYERS_IN_BLOCK ? 1u : layers);
    // This thread's first vector in the next page of the block's flat run (chc_copy_vecs).
    u32 v = threadIdx.x;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u32 l0 = (u32)(w / groups);
        const u32 l1 = LAYERS_IN_BLOCK ? layers : l0 + 1u;
        const u32 first = (u32)(w % groups) * PAGES_PER_BLOCK;
        const u32 np = (u64)first + PAGES_PER_BLOCK <= n ? PAGES_PER_BLOCK : n - first;
        for (u32 q = 0; q < np; ++q) {
            const u32 i = first + q;
            const u32 page = seq_pages[i];
            const u32 owner = page % CP;
            const u32 local = page / CP;
            // Pages beyond local_pages are skipped (not part of the run).
            if (local >= local_pages) {
                continue;
            }
            for (u32 layer = l0; layer < l1; ++layer) {
                chc_copy_vecs(dense + ((u64)layer * n + i) * PAGE_BYTES,
                              (const u8*)pools[owner * layers + layer] + (u64)local * page_stride, v, PAGE_VECS);
                v = chc_next_start(v, PAGE_VECS);
            }
        }
    }
}
{% include "epilogue.cu" %}
