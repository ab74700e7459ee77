{% include "prelude.cu" %}
{% include "copy_page.cu" %}

// Byte offset of (page, layer) in a host pool of page_bytes pages: {{ host_layout_doc }}.
static __device__ inline u64 chc_host_off(u32 page, u32 layer, u32 layers, u32 host_pages, u64 page_bytes)
{
    return {{ host_off_expr }};
}

// Copies work item w of one buffer (device pool through its page table `device`, pages
// page_stride bytes apart; host pool `host`; pages of page_bytes = page_vecs vectors): the
// pairs [first, first + np) for the layers [l0, l1), continuing this thread's place `v` in
// the block's flat run; returns its place in the next page of the run. Pairs whose page is
// outside its pool are skipped (not part of the run).
static __device__ inline u32 chc_transfer_item(const u64* __restrict__ device, {{ host_type }} __restrict__ host,
                                               const u32* __restrict__ src_pages, const u32* __restrict__ dst_pages,
                                               u32 first, u32 np, u32 l0, u32 l1, u32 layers,
                                               u32 device_pages, u32 host_pages, u64 page_stride,
                                               u64 page_bytes, u32 page_vecs, u32 v)
{
    for (u32 q = 0; q < np; ++q) {
        const u32 sp = src_pages[first + q];
        const u32 dp = dst_pages[first + q];
        if (sp >= {{ src_cap }} || dp >= {{ dst_cap }}) {
            continue;
        }
        for (u32 layer = l0; layer < l1; ++layer) {
            {{ device_type }} dev = ({{ device_type }})device[layer] + (u64){{ device_page }} * page_stride;
            {{ host_type }} h = host + chc_host_off({{ host_page }}, layer, layers, host_pages, page_bytes);
            chc_copy_vecs({{ copy_args }}, v, page_vecs);
            v = chc_next_start(v, page_vecs);
        }
    }
    return v;
}

// Copies page blobs {{ direction_doc }} for layers [first_layer, first_layer + layer_count)
// of every pair, clamped to the pools' [0, layers) (`layers` stays the pools' total in the
// offsets): pair i moves src_pages[i] to dst_pages[i]{% if second %}, in both buffers: device/host
// ({{ first_doc }}) and device1/host1 ({{ second_doc }}), one launch for the page move{% endif %}.
// A device pool is a page table: layer l's pages start at device[l], page_stride bytes apart
// (the cache's own pools, an engine's per-layer tensors, one cross-layer tensor in either
// order). Work item w = (buffer, group of PAGES_PER_BLOCK pairs, layer of the range), or with
// LAYERS_IN_BLOCK (buffer, group), whose pages are copied for every layer of the range, page
// by page; blocks stride over the items, so any grid is correct. A block's pages, over all its
// items, are one flat run of vectors (chc_copy_vecs), so page tails do not idle threads. Pairs
// whose page is outside its pool are skipped; an empty range (or one wholly past `layers`)
// copies nothing.
extern "C" __global__ void __launch_bounds__(THREADS) {{ uri }}({# parameters: KernelSpec::params() #}
{{ params }}
{
    // The range, clamped in 64 bits: first_layer + layer_count near 2^32 must not wrap.
    const u64 range_end = (u64)first_layer + layer_count;
    const u32 l_end = range_end < layers ? (u32)range_end : layers;
    const u32 span = first_layer < l_end ? l_end - first_layer : 0u;
    // In 64 bits: n near 2^32 must not wrap the rounding (or the pair index below) to 0.
    const u32 groups = (u32)(((u64)n + PAGES_PER_BLOCK - 1u) / PAGES_PER_BLOCK);
    const u64 per_buffer = span == 0u ? 0u : (u64)groups * (LAYERS_IN_BLOCK ? 1u : span);
    const u64 items = per_buffer * BUFFERS;
    // This thread's first vector in the next page of the block's flat run (chc_copy_vecs).
    u32 v = threadIdx.x;
    for (u64 w = blockIdx.x; w < items; w += gridDim.x) {
        const u64 wb = w % per_buffer;
        const u32 l0 = LAYERS_IN_BLOCK ? first_layer : first_layer + (u32)(wb / groups);
        const u32 l1 = LAYERS_IN_BLOCK ? l_end : l0 + 1u;
        const u32 first = (u32)(wb % groups) * PAGES_PER_BLOCK;
        const u32 np = (u64)first + PAGES_PER_BLOCK <= n ? PAGES_PER_BLOCK : n - first;
{%- if second %}
        if (w >= per_buffer) {
            v = chc_transfer_item(device1, host1, src_pages, dst_pages, first, np, l0, l1, layers,
                                  device_pages, host_pages, page_stride1, PAGE_BYTES_1, PAGE_VECS_1, v);
            continue;
        }
{%- endif %}
        v = chc_transfer_item(device, host, src_pages, dst_pages, first, np, l0, l1, layers,
                              device_pages, host_pages, page_stride, PAGE_BYTES, PAGE_VECS, v);
    }
}
{% include "epilogue.cu" %}
