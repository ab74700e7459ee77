//! Plain Rust references with exactly the semantics of each kernel family, over byte and
//! `u32` slices: the oracle for the executors' tests and the HiCache verifier.
//!
//! Each function takes the kernel's parameters in the kernel's order (docs/KERNELS.md),
//! with pointers replaced by slices. Out-of-range pages are skipped exactly as the kernels
//! skip them; slices too short for the declared geometry are a [`ReferenceError`], never a
//! panic.

use super::spec::{BufferKind, Direction, HostLayout, TokenOrder};
use crate::layout::{Layout, Placement};

/// The splitmix64 finaliser the synthesised bytes are drawn with (defined below the
/// executors, which use it too).
pub use crate::splitmix::mix64;

/// Slices that do not fit the geometry the call declares.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    /// A slice shorter than the geometry requires.
    #[error("{what}: need {need} elements, have {have}")]
    TooShort {
        /// Which argument.
        what: &'static str,
        /// Elements required.
        need: u64,
        /// Elements given.
        have: usize,
    },
    /// A geometry whose byte size does not fit in 64 bits.
    #[error("{what}: {layers} layers x {pages} pages x {page_bytes} bytes overflows 64 bits")]
    Overflow {
        /// Which argument.
        what: &'static str,
        /// Layers.
        layers: u32,
        /// Pages per layer.
        pages: u32,
        /// Bytes per page.
        page_bytes: u64,
    },
    /// A parameter outside the kernel's domain (for example CP 0 or a page size that is
    /// not a power of two).
    #[error("{what} = {value} is invalid")]
    Invalid {
        /// Which parameter.
        what: &'static str,
        /// The rejected value.
        value: u64,
    },
    /// A transfer whose pairs name one destination page twice: the kernel's result is not
    /// defined (on a GPU the two copies interleave), so there is nothing to compare with.
    #[error(transparent)]
    DuplicateDestination(#[from] super::DuplicateDestination),
}

fn need<T>(what: &'static str, s: &[T], need: u64) -> Result<(), ReferenceError> {
    if (s.len() as u64) < need {
        Err(ReferenceError::TooShort {
            what,
            need,
            have: s.len(),
        })
    } else {
        Ok(())
    }
}

/// Bytes of `layers` x `pages` pages of `page_bytes`, checked: once a slice is known to hold
/// this many, every offset inside it is smaller and cannot overflow.
fn extent(
    what: &'static str,
    layers: u32,
    pages: u32,
    page_bytes: u64,
) -> Result<u64, ReferenceError> {
    u64::from(layers)
        .checked_mul(u64::from(pages))
        .and_then(|x| x.checked_mul(page_bytes))
        .ok_or(ReferenceError::Overflow {
            what,
            layers,
            pages,
            page_bytes,
        })
}

fn check_cp(cp: u8) -> Result<u32, ReferenceError> {
    if (1..=16).contains(&cp) {
        Ok(u32::from(cp))
    } else {
        Err(ReferenceError::Invalid {
            what: "cp",
            value: u64::from(cp),
        })
    }
}

fn check_ps(page_size: u32) -> Result<(), ReferenceError> {
    if page_size.is_power_of_two() && page_size <= 1024 {
        Ok(())
    } else {
        Err(ReferenceError::Invalid {
            what: "page_size",
            value: u64::from(page_size),
        })
    }
}

/// Seed of the prefix-hash chain (`h[-1]`).
pub const PREFIX_HASH_SEED: u64 = 0x6a09_e667_f3bc_c908;

/// `prefix_hash[t]` for every position: a hash of `tokens[0..=t]` (docs/KERNELS.md).
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    prefix_hashes_from(PREFIX_HASH_SEED, tokens)
}

/// [`prefix_hashes`] of a chain seeded with `seed` instead of [`PREFIX_HASH_SEED`] (a TP
/// head shard's, [`TpShard::prefix_hash_seed`](super::TpShard::prefix_hash_seed)).
pub fn prefix_hashes_from(seed: u64, tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len());
    extend_prefix_hashes_from(&mut out, seed, tokens);
    out
}

/// Appends the prefix hashes of `tokens` following the sequence whose hashes `hashes` holds
/// (a chain: each hash depends on the one before), so a growing request hashes each token
/// once.
pub fn extend_prefix_hashes(hashes: &mut Vec<u64>, tokens: &[u32]) {
    extend_prefix_hashes_from(hashes, PREFIX_HASH_SEED, tokens)
}

/// [`extend_prefix_hashes`] of a chain seeded with `seed` (used only while `hashes` is
/// empty).
pub fn extend_prefix_hashes_from(hashes: &mut Vec<u64>, seed: u64, tokens: &[u32]) {
    let mut h = hashes.last().copied().unwrap_or(seed);
    hashes.extend(tokens.iter().map(|&t| {
        h = mix64(h ^ u64::from(t).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        h
    }));
}

/// Random word `d` of field `field` of buffer `buffer_id`, for a token with prefix hash `h` in
/// `layer`: it holds elements `d * per_draw ..` of the field ([`Dtype::per_draw`](super::Dtype::per_draw)).
pub fn draw(h: u64, layer: u32, buffer_id: u32, field: u32, e: u32) -> u64 {
    let key = (u64::from(layer) << 40)
        ^ (u64::from(buffer_id) << 32)
        ^ (u64::from(field) << 24)
        ^ u64::from(e);
    mix64(h ^ mix64(key))
}

/// Finite fp8-e4m3 byte (never one of the NaN encodings `0x7f` / `0xff`).
pub fn enc_fp8(r: u64) -> u8 {
    let mut c = (r & 0xff) as u8;
    if c & 0x7f == 0x7f {
        c ^= 0x01;
    }
    c
}

/// f32 scale bits, positive in [2^-8, 2^-7).
pub fn enc_f32(r: u64) -> u32 {
    ((127 - 8) << 23) | (r & 0x7f_ffff) as u32
}

/// Finite bf16 bits.
pub fn enc_bf16(r: u64) -> u16 {
    ((r & 0x8000) as u32 | ((120 + ((r >> 8) & 15) as u32) << 7) | (r & 0x7f) as u32) as u16
}

/// Writes the synthesised bytes of one token (prefix hash `h`, page slot `slot`, `layer`)
/// into `page`, one page of `buffer` with `page_size` tokens.
pub fn synth_token(
    buffer: BufferKind,
    page_size: u32,
    h: u64,
    layer: u32,
    slot: u32,
    page: &mut [u8],
) -> Result<(), ReferenceError> {
    need("page", page, buffer.page_bytes(page_size))?;
    if slot >= page_size {
        return Err(ReferenceError::Invalid {
            what: "slot",
            value: u64::from(slot),
        });
    }
    for f in buffer.field_layouts(page_size) {
        for e in 0..f.count {
            let k = f.dtype.per_draw();
            let r = draw(h, layer, buffer.id(), f.id, e / k) >> ((e % k) * (64 / k));
            let at = f.offset(slot, e);
            match f.dtype {
                super::Dtype::Fp8E4m3 => page[at] = enc_fp8(r),
                super::Dtype::F32 => page[at..at + 4].copy_from_slice(&enc_f32(r).to_le_bytes()),
                super::Dtype::Bf16 => page[at..at + 2].copy_from_slice(&enc_bf16(r).to_le_bytes()),
            }
        }
    }
    Ok(())
}

/// `select_owner_pages`: pops one page per requested owner (LIFO) and returns
/// `(out_pages, out_locs)`; updates `lane_tops`. Tops are first clamped to `lane_cap`.
///
/// All or nothing: when some lane holds fewer pages than requested of it, or an owner is
/// `>= cp`, the launch is refused: `lane_tops` is left as it was, every page is 0 (so the
/// locations are page 0's slots), and `status` (the kernel's `u32[cp + 2]` status words,
/// [`SelectStatus`](super::SelectStatus)) adds 1 refused launch, each lane's deficit and the
/// number of bad owners, saturating. A launch that is not refused leaves `status` alone.
///
/// The kernel without token locations ([`SelectOutput::Pages`](super::SelectOutput)) is
/// [`select_pages`]; this is it followed by [`page_locs`].
pub fn select_owner_pages(
    cp: u8,
    page_size: u32,
    owners: &[u8],
    lane_stacks: &[u32],
    lane_tops: &mut [u32],
    lane_cap: u32,
    status: &mut [u32],
) -> Result<(Vec<u32>, Vec<i64>), ReferenceError> {
    check_cp(cp)?;
    check_ps(page_size)?;
    let pages = select_pages(cp, owners, lane_stacks, lane_tops, lane_cap, status)?;
    let locs = page_locs(page_size, &pages)?;
    Ok((pages, locs))
}

/// The page-contiguous token locations of `pages`: `page * page_size + j` for `j` in
/// `0..page_size`, page after page (what the select kernel with locations writes to
/// `out_locs`, and what a consumer of the kernel without them derives).
pub fn page_locs(page_size: u32, pages: &[u32]) -> Result<Vec<i64>, ReferenceError> {
    check_ps(page_size)?;
    Ok(pages
        .iter()
        .flat_map(|&p| {
            (0..page_size).map(move |j| (i64::from(p) * i64::from(page_size)) + i64::from(j))
        })
        .collect())
}

/// `select_owner_pages` without token locations ([`SelectOutput::Pages`](super::SelectOutput)):
/// the pages, lane tops and status words exactly as [`select_owner_pages`].
pub fn select_pages(
    cp: u8,
    owners: &[u8],
    lane_stacks: &[u32],
    lane_tops: &mut [u32],
    lane_cap: u32,
    status: &mut [u32],
) -> Result<Vec<u32>, ReferenceError> {
    let cpn = check_cp(cp)?;
    need("lane_tops", lane_tops, u64::from(cpn))?;
    need(
        "lane_stacks",
        lane_stacks,
        u64::from(cpn) * u64::from(lane_cap),
    )?;
    need("status", status, u64::from(cpn) + 2)?;
    let tops: Vec<u32> = lane_tops[..cpn as usize]
        .iter()
        .map(|&t| t.min(lane_cap))
        .collect();
    let mut used = vec![0u32; cpn as usize];
    let mut bad_owners = 0u32;
    let mut pages = Vec::with_capacity(owners.len());
    for &o in owners {
        let o = u32::from(o);
        let mut page = 0;
        if o < cpn {
            let k = used[o as usize];
            let top = tops[o as usize];
            if k < top {
                page = lane_stacks[(o * lane_cap + top - 1 - k) as usize];
            }
            used[o as usize] += 1;
        } else {
            bad_owners += 1;
        }
        pages.push(page);
    }
    let deficits: Vec<u32> = used
        .iter()
        .zip(&tops)
        .map(|(&u, &t)| u.saturating_sub(t))
        .collect();
    let refused = bad_owners > 0 || deficits.iter().any(|&d| d > 0);
    if refused {
        pages.iter_mut().for_each(|p| *p = 0);
        status[0] = status[0].saturating_add(1);
        for (w, d) in status[1..=cpn as usize].iter_mut().zip(&deficits) {
            *w = w.saturating_add(*d);
        }
        let last = cpn as usize + 1;
        status[last] = status[last].saturating_add(bad_owners);
    } else {
        for o in 0..cpn as usize {
            lane_tops[o] = tops[o] - used[o];
        }
    }
    Ok(pages)
}

/// `release_pages`: pushes each page onto lane `page % cp` in input order. Tops are first
/// clamped to `lane_cap` (and written back clamped).
///
/// All or nothing: when some page is invalid (0, or a local index `page / cp >= lane_cap`)
/// or some lane would hold more than `lane_cap` pages, the launch is refused: `lane_stacks`
/// and `lane_tops` are left as they were, and `status` (the kernel's `u32[cp + 2]` status
/// words, [`ReleaseStatus`](super::ReleaseStatus)) adds 1 refused launch, the pages each lane
/// had no room for and the number of invalid pages, saturating. A launch that is not refused
/// leaves `status` alone.
pub fn release_pages(
    cp: u8,
    pages: &[u32],
    lane_stacks: &mut [u32],
    lane_tops: &mut [u32],
    lane_cap: u32,
    status: &mut [u32],
) -> Result<(), ReferenceError> {
    let cpn = check_cp(cp)?;
    need("lane_tops", lane_tops, u64::from(cpn))?;
    need(
        "lane_stacks",
        lane_stacks,
        u64::from(cpn) * u64::from(lane_cap),
    )?;
    need("status", status, u64::from(cpn) + 2)?;
    let tops: Vec<u32> = lane_tops[..cpn as usize]
        .iter()
        .map(|&t| t.min(lane_cap))
        .collect();
    let lane = |p: u32| (p != 0 && p / cpn < lane_cap).then_some((p % cpn) as usize);
    let mut counts = vec![0u32; cpn as usize];
    let mut bad_pages = 0u32;
    for &p in pages {
        match lane(p) {
            Some(o) => counts[o] += 1,
            None => bad_pages += 1,
        }
    }
    let overflows: Vec<u32> = counts
        .iter()
        .zip(&tops)
        .map(|(&c, &t)| c.saturating_sub(lane_cap - t))
        .collect();
    if bad_pages > 0 || overflows.iter().any(|&o| o > 0) {
        status[0] = status[0].saturating_add(1);
        for (w, o) in status[1..=cpn as usize].iter_mut().zip(&overflows) {
            *w = w.saturating_add(*o);
        }
        let last = cpn as usize + 1;
        status[last] = status[last].saturating_add(bad_pages);
        return Ok(());
    }
    let mut pushed = vec![0u32; cpn as usize];
    for (o, p) in pages.iter().filter_map(|&p| lane(p).map(|o| (o, p))) {
        let slot = tops[o] + pushed[o];
        lane_stacks[o * lane_cap as usize + slot as usize] = p;
        pushed[o] += 1;
    }
    for o in 0..cpn as usize {
        lane_tops[o] = tops[o] + pushed[o];
    }
    Ok(())
}

/// Byte offset of `(page, layer)` in a device pool `[layer][page][page_bytes]`.
pub fn device_offset(page: u32, layer: u32, device_pages: u32, page_bytes: u64) -> u64 {
    (u64::from(layer) * u64::from(device_pages) + u64::from(page)) * page_bytes
}

/// Byte offset of `(page, layer)` in a host pool of `layout`.
pub fn host_offset(
    layout: HostLayout,
    page: u32,
    layer: u32,
    layers: u32,
    host_pages: u32,
    page_bytes: u64,
) -> u64 {
    match layout {
        HostLayout::PageFirst => {
            (u64::from(page) * u64::from(layers) + u64::from(layer)) * page_bytes
        }
        HostLayout::LayerFirst => {
            (u64::from(layer) * u64::from(host_pages) + u64::from(page)) * page_bytes
        }
    }
}

/// `transfer_pages`: for every pair `i < n` and every layer of
/// `[first_layer, first_layer + layer_count)` clamped to `[0, layers)`
/// ([`clamp_layer_range`](super::clamp_layer_range)), copies page `src_pages[i]` of `src`
/// to page `dst_pages[i]` of `dst`; other layers are untouched. `layers` is the pools' total
/// (their sizes and offsets). The device side is `src` for d2h and `dst` for h2d.
/// Pairs with a page outside its pool are skipped. Destination pages must be distinct (the
/// kernel gives no order between pairs): two pairs naming one are
/// [`ReferenceError::DuplicateDestination`], as every caller of the kernel refuses them
/// ([`check_distinct_destinations`](super::check_distinct_destinations)).
#[allow(clippy::too_many_arguments)]
pub fn transfer_pages(
    direction: Direction,
    layout: HostLayout,
    page_bytes: u64,
    src: &[u8],
    dst: &mut [u8],
    src_pages: &[u32],
    dst_pages: &[u32],
    n: u32,
    layers: u32,
    first_layer: u32,
    layer_count: u32,
    device_pages: u32,
    host_pages: u32,
) -> Result<(), ReferenceError> {
    need("src_pages", src_pages, u64::from(n))?;
    need("dst_pages", dst_pages, u64::from(n))?;
    super::check_distinct_destinations(&dst_pages[..n as usize])?;
    let dev_bytes = extent("device pool", layers, device_pages, page_bytes)?;
    let host_bytes = extent("host pool", layers, host_pages, page_bytes)?;
    let (src_cap, dst_cap) = match direction {
        Direction::DeviceToHost => {
            need("src (device pool)", src, dev_bytes)?;
            need("dst (host pool)", dst, host_bytes)?;
            (device_pages, host_pages)
        }
        Direction::HostToDevice => {
            need("src (host pool)", src, host_bytes)?;
            need("dst (device pool)", dst, dev_bytes)?;
            (host_pages, device_pages)
        }
    };
    let dev = |p, l| device_offset(p, l, device_pages, page_bytes);
    let host = |p, l| host_offset(layout, p, l, layers, host_pages, page_bytes);
    let pb = page_bytes as usize;
    for i in 0..n as usize {
        let (sp, dp) = (src_pages[i], dst_pages[i]);
        if sp >= src_cap || dp >= dst_cap {
            continue;
        }
        for l in super::clamp_layer_range(first_layer, layer_count, layers) {
            let (so, d) = match direction {
                Direction::DeviceToHost => (dev(sp, l), host(dp, l)),
                Direction::HostToDevice => (host(sp, l), dev(dp, l)),
            };
            let (so, d) = (so as usize, d as usize);
            dst[d..d + pb].copy_from_slice(&src[so..so + pb]);
        }
    }
    Ok(())
}

/// `materialise`: gathers sequence page `i` (global page `p = seq_pages[i]`) from pool
/// `p % cp`, local page `p / cp`, into `dense[layer][i][page_bytes]`, for every layer.
/// Pages with `p / cp >= local_pages` are skipped (their dense slots are left untouched).
#[allow(clippy::too_many_arguments)]
pub fn materialise(
    cp: u8,
    page_bytes: u64,
    pools: &[&[u8]],
    seq_pages: &[u32],
    n: u32,
    layers: u32,
    local_pages: u32,
    dense: &mut [u8],
) -> Result<(), ReferenceError> {
    let cpn = check_cp(cp)?;
    need("pools", pools, u64::from(cpn))?;
    need("seq_pages", seq_pages, u64::from(n))?;
    let pool_bytes = extent("pool", layers, local_pages, page_bytes)?;
    for pool in &pools[..cpn as usize] {
        need("pool", pool, pool_bytes)?;
    }
    need("dense", dense, extent("dense", layers, n, page_bytes)?)?;
    let pb = page_bytes as usize;
    for (i, &p) in seq_pages[..n as usize].iter().enumerate() {
        let (owner, local) = (p % cpn, p / cpn);
        if local >= local_pages {
            continue;
        }
        for l in 0..layers {
            let s = device_offset(local, l, local_pages, page_bytes) as usize;
            let d = ((u64::from(l) * u64::from(n) + i as u64) * page_bytes) as usize;
            dense[d..d + pb].copy_from_slice(&pools[owner as usize][s..s + pb]);
        }
    }
    Ok(())
}

/// The placement arithmetic of a token order (the Rust side of templates/interleave.cu).
fn placement(order: TokenOrder, page_size: u32) -> Placement {
    match order {
        TokenOrder::Paged => Layout::Zigzag.placement(1, page_size),
        TokenOrder::Interleaved { cp, run } => {
            Layout::TokenInterleave { size: run }.placement(cp, page_size)
        }
    }
}

/// The first sequence page a `synthesise` launch writing tokens from `first_token` in
/// `order` visits: the page holding `first_token`, or its granule's first page when tokens
/// are interleaved (every page of a granule holds later tokens).
pub fn synthesise_first_page(order: TokenOrder, page_size: u32, first_token: u32) -> u32 {
    let granule = match order {
        TokenOrder::Paged => 1,
        TokenOrder::Interleaved { cp, .. } => u64::from(cp),
    };
    (u64::from(first_token) / (u64::from(page_size) * granule) * granule) as u32
}

/// Work items (sequence pages) of a `synthesise` launch writing tokens `[first_token,
/// n_tokens)` in `order`: the pages from [`synthesise_first_page`] to the last one holding a
/// token (the kernel's `n_pages`, which may be fewer than a request's whole granules).
pub fn synthesise_items(order: TokenOrder, page_size: u32, n_tokens: u32, first_token: u32) -> u32 {
    let n_pages = placement(order, page_size).pages_holding(u64::from(n_tokens));
    let start = u64::from(synthesise_first_page(order, page_size, first_token));
    n_pages.saturating_sub(start) as u32
}

/// `synthesise`: writes the synthesised bytes of tokens `[first_token, n_tokens)` of the
/// sequence (placed in `order`) that `rank` owns into `pool`
/// (`[layer][local_page][page_bytes]`); other tokens (those before `first_token` in a kept
/// partial page), other pages and padding slots stay untouched.
#[allow(clippy::too_many_arguments)]
pub fn synthesise(
    buffer: BufferKind,
    cp: u8,
    page_size: u32,
    order: TokenOrder,
    pool: &mut [u8],
    prefix_hash: &[u64],
    seq_pages: &[u32],
    n_tokens: u32,
    first_token: u32,
    rank: u32,
    layers: u32,
    local_pages: u32,
) -> Result<(), ReferenceError> {
    let cpn = check_cp(cp)?;
    check_ps(page_size)?;
    let place = placement(order, page_size);
    let n_pages = place.pages_holding(u64::from(n_tokens)) as u32;
    need("prefix_hash", prefix_hash, u64::from(n_tokens))?;
    need("seq_pages", seq_pages, u64::from(n_pages))?;
    let page_bytes = buffer.page_bytes(page_size);
    need(
        "pool",
        pool,
        extent("pool", layers, local_pages, page_bytes)?,
    )?;
    let pb = page_bytes as usize;
    for i in 0..n_pages {
        let p = seq_pages[i as usize];
        let local = p / cpn;
        if p % cpn != rank || local >= local_pages {
            continue;
        }
        let real = place.tokens_in_page(u64::from(i), u64::from(n_tokens));
        // A page holds its tokens in order: those before `first_token` come first.
        let lo = place.tokens_in_page(u64::from(i), u64::from(first_token));
        for l in 0..layers {
            let at = device_offset(local, l, local_pages, page_bytes) as usize;
            let page = &mut pool[at..at + pb];
            for j in lo..real {
                let t = place.token(u64::from(i), j);
                synth_token(buffer, page_size, prefix_hash[t as usize], l, j, page)?;
            }
        }
    }
    Ok(())
}

/// The dense buffer (`[layer][seq_page][page_bytes]`, bytes outside tokens `0xA5`) that
/// materialising a sequence of `n_tokens` tokens placed in `order` from correctly
/// synthesised pools gives: what [`verify`] accepts.
pub fn dense(
    buffer: BufferKind,
    page_size: u32,
    order: TokenOrder,
    prefix_hash: &[u64],
    n_tokens: u32,
    layers: u32,
) -> Result<Vec<u8>, ReferenceError> {
    check_ps(page_size)?;
    need("prefix_hash", prefix_hash, u64::from(n_tokens))?;
    let place = placement(order, page_size);
    let n_pages = place.pages_holding(u64::from(n_tokens)) as u32;
    let page_bytes = buffer.page_bytes(page_size);
    let mut out = vec![0xA5u8; extent("dense", layers, n_pages, page_bytes)? as usize];
    let pb = page_bytes as usize;
    for t in 0..u64::from(n_tokens) {
        let (i, j) = place.place(t);
        for l in 0..layers {
            let at = ((u64::from(l) * u64::from(n_pages) + i) * page_bytes) as usize;
            synth_token(
                buffer,
                page_size,
                prefix_hash[t as usize],
                l,
                j,
                &mut out[at..at + pb],
            )?;
        }
    }
    Ok(out)
}

/// The sequence page and slot of token `t` in `order` (the kernels' placement).
pub fn place(order: TokenOrder, page_size: u32, t: u64) -> (u64, u32) {
    placement(order, page_size).place(t)
}

/// `busy`: word `i` of `[0, n)` is `seed ^ (i * 0x9E3779B9)` (wrapping, 32 bits) after
/// `rounds` rounds of `x = x * 1664525 + 1013904223; x ^= x >> 13`, as the kernel computes it.
pub fn busy(n: u32, rounds: u32, seed: u32) -> Vec<u32> {
    (0..n)
        .map(|i| {
            let mut x = seed ^ i.wrapping_mul(0x9E37_79B9);
            for _ in 0..rounds {
                x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                x ^= x >> 13;
            }
            x
        })
        .collect()
}

/// `verify`: the tokens in `[start_page * page_size, n_tokens)` whose bytes in `dense`
/// (`[layer][seq_page][page_bytes]`, tokens placed in `order`) differ from the synthesised
/// ones in any layer, as the kernel's bitmap: bit `t % 32` of word `t / 32`
/// (`n_tokens.div_ceil(32)` words).
#[allow(clippy::too_many_arguments)]
pub fn verify(
    buffer: BufferKind,
    page_size: u32,
    order: TokenOrder,
    dense: &[u8],
    prefix_hash: &[u64],
    n_tokens: u32,
    start_page: u32,
    layers: u32,
) -> Result<Vec<u32>, ReferenceError> {
    check_ps(page_size)?;
    let place = placement(order, page_size);
    let n_pages = place.pages_holding(u64::from(n_tokens)) as u32;
    need("prefix_hash", prefix_hash, u64::from(n_tokens))?;
    let page_bytes = buffer.page_bytes(page_size);
    need(
        "dense",
        dense,
        extent("dense", layers, n_pages, page_bytes)?,
    )?;
    let pb = page_bytes as usize;
    let mut expect = vec![0u8; pb];
    let mut bad = vec![0u32; n_tokens.div_ceil(32) as usize];
    let start = u64::from(start_page) * u64::from(page_size);
    for t in start..u64::from(n_tokens) {
        let (i, j) = place.place(t);
        let mut mismatch = false;
        for l in 0..layers {
            synth_token(
                buffer,
                page_size,
                prefix_hash[t as usize],
                l,
                j,
                &mut expect,
            )?;
            let at = ((u64::from(l) * u64::from(n_pages) + i) * page_bytes) as usize;
            let got = &dense[at..at + pb];
            mismatch |= buffer.field_layouts(page_size).iter().any(|f| {
                (0..f.count).any(|e| {
                    let o = f.offset(j, e);
                    let w = f.dtype.size() as usize;
                    got[o..o + w] != expect[o..o + w]
                })
            });
            if mismatch {
                break;
            }
        }
        bad[(t / 32) as usize] |= u32::from(mismatch) << (t % 32);
    }
    Ok(bad)
}

#[cfg(test)]
mod tests;
