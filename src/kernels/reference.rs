//! Plain Rust references with exactly the semantics of each kernel family, over byte and
//! `u32` slices: the oracle for the executors' tests and the HiCache verifier.
//!
//! Each function takes the kernel's parameters in the kernel's order (docs/KERNELS.md),
//! with pointers replaced by slices. Out-of-range pages are skipped exactly as the kernels
//! skip them; slices too short for the declared geometry are a [`ReferenceError`], never a
//! panic.

use super::spec::{BufferKind, Direction, HostLayout, TokenOrder};
use crate::layout::{Layout, Placement};

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

/// The splitmix64 finaliser.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Seed of the prefix-hash chain (`h[-1]`).
pub const PREFIX_HASH_SEED: u64 = 0x6a09_e667_f3bc_c908;

/// `prefix_hash[t]` for every position: a hash of `tokens[0..=t]` (docs/KERNELS.md).
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = PREFIX_HASH_SEED;
    tokens
        .iter()
        .map(|&t| {
            h = mix64(h ^ u64::from(t).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            h
        })
        .collect()
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
pub fn select_owner_pages(
    cp: u8,
    page_size: u32,
    owners: &[u8],
    lane_stacks: &[u32],
    lane_tops: &mut [u32],
    lane_cap: u32,
    status: &mut [u32],
) -> Result<(Vec<u32>, Vec<i64>), ReferenceError> {
    let cpn = check_cp(cp)?;
    check_ps(page_size)?;
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
    let locs = pages
        .iter()
        .flat_map(|&p| {
            (0..page_size).map(move |j| (i64::from(p) * i64::from(page_size)) + i64::from(j))
        })
        .collect();
    Ok((pages, locs))
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

/// Work items (sequence pages) of a `synthesise` launch writing tokens `[first_token,
/// n_tokens)` in `order`: the pages from the one holding `first_token` (from its granule's
/// first page when tokens are interleaved, since every page of a granule holds later tokens).
pub fn synthesise_items(order: TokenOrder, page_size: u32, n_tokens: u32, first_token: u32) -> u32 {
    let place = placement(order, page_size);
    let n_pages = place.pages_holding(u64::from(n_tokens));
    let granule = match order {
        TokenOrder::Paged => 1,
        TokenOrder::Interleaved { cp, .. } => u64::from(cp),
    };
    let start = u64::from(first_token) / (u64::from(page_size) * granule) * granule;
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
mod tests {
    use super::*;
    use half::bf16;

    const ALL: [BufferKind; 3] = [BufferKind::NsaKv, BufferKind::NsaIndexK, BufferKind::MlaKv];

    /// e4m3 decoding (no infinities; NaN is S.1111.111).
    fn fp8_e4m3(c: u8) -> f32 {
        let (s, e, m) = ((c >> 7) & 1, (c >> 3) & 15, c & 7);
        assert!(!(e == 15 && m == 7), "NaN {c:#x}");
        let v = if e == 0 {
            f32::from(m) / 8.0 * 2f32.powi(-6)
        } else {
            (1.0 + f32::from(m) / 8.0) * 2f32.powi(i32::from(e) - 7)
        };
        if s == 1 {
            -v
        } else {
            v
        }
    }

    // A geometry whose size overflows 64 bits is an error, not a wrapped size that passes
    // the length check and then indexes out of bounds.
    #[test]
    fn overflowing_geometry_is_an_error() {
        let big = 1u64 << 40;
        let err = transfer_pages(
            Direction::DeviceToHost,
            HostLayout::PageFirst,
            big,
            &[],
            &mut [],
            &[0],
            &[0],
            1,
            1 << 12,
            0,
            1 << 12,
            1 << 12,
            1,
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                ReferenceError::Overflow {
                    what: "device pool",
                    ..
                }
            ),
            "{err}"
        );
        let pools: [&[u8]; 2] = [&[], &[]];
        let err = materialise(2, big, &pools, &[1], 1, u32::MAX, u32::MAX, &mut []).unwrap_err();
        assert!(
            matches!(err, ReferenceError::Overflow { what: "pool", .. }),
            "{err}"
        );
    }

    #[test]
    fn encoders_yield_finite_values() {
        for i in 0..200_000u64 {
            let r = mix64(i);
            assert!(fp8_e4m3(enc_fp8(r)).is_finite());
            let f = f32::from_bits(enc_f32(r));
            assert!(
                f.is_finite() && (2f32.powi(-8)..2f32.powi(-7)).contains(&f),
                "{f}"
            );
            assert!(bf16::from_bits(enc_bf16(r)).to_f32().is_finite());
        }
        for c in 0..=255u8 {
            let r = u64::from(c);
            assert_ne!(enc_fp8(r) & 0x7f, 0x7f);
        }
    }

    #[test]
    fn prefix_hash_depends_on_the_whole_prefix() {
        let a = prefix_hashes(&[1, 2, 3]);
        let b = prefix_hashes(&[9, 2, 3]);
        assert_eq!(a.len(), 3);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        assert_eq!(prefix_hashes(&[1, 2]), a[..2]);
    }

    #[test]
    fn synth_depends_only_on_hash_layer_and_slot_position() {
        for b in ALL {
            let ps = 16;
            let pb = b.page_bytes(ps) as usize;
            let (mut p1, mut p2) = (vec![0xA5u8; pb], vec![0x00u8; pb]);
            synth_token(b, ps, 42, 3, 5, &mut p1).unwrap();
            synth_token(b, ps, 42, 3, 5, &mut p2).unwrap();
            let fields = b.field_layouts(ps);
            let token_bytes = |p: &[u8]| -> Vec<u8> {
                fields
                    .iter()
                    .flat_map(|f| {
                        (0..f.count).flat_map(|e| {
                            let o = f.offset(5, e);
                            p[o..o + f.dtype.size() as usize].to_vec()
                        })
                    })
                    .collect()
            };
            assert_eq!(token_bytes(&p1), token_bytes(&p2), "{b}");
            let mut p3 = vec![0u8; pb];
            synth_token(b, ps, 42, 4, 5, &mut p3).unwrap();
            assert_ne!(token_bytes(&p1), token_bytes(&p3), "{b}: layer must matter");
            let mut p4 = vec![0u8; pb];
            synth_token(b, ps, 43, 3, 5, &mut p4).unwrap();
            assert_ne!(token_bytes(&p1), token_bytes(&p4), "{b}: hash must matter");
            // Only the token's own bytes were written.
            let written = p1.iter().filter(|&&x| x != 0xA5).count();
            assert!(written <= b.bytes_per_token() as usize);
        }
    }

    #[test]
    fn select_then_release_round_trips() {
        let (cp, cap) = (4u8, 8u32);
        // Fresh lanes: pages of owner o in descending order, page 0 excluded.
        let mut stacks = vec![0u32; 4 * cap as usize];
        let mut tops = vec![0u32; 4];
        for o in 0..4u32 {
            let mut pages: Vec<u32> = (0..cap * 4).filter(|p| p % 4 == o && *p != 0).collect();
            pages.reverse();
            for (k, p) in pages.iter().enumerate() {
                stacks[(o * cap) as usize + k] = *p;
            }
            tops[o as usize] = pages.len() as u32;
        }
        let (stacks0, tops0) = (stacks.clone(), tops.clone());
        let owners = [0u8, 1, 1, 3, 0, 2, 1];
        let mut status = [0u32; 6];
        let (pages, locs) =
            select_owner_pages(cp, 4, &owners, &stacks, &mut tops, cap, &mut status).unwrap();
        assert_eq!(pages, [4, 1, 5, 3, 8, 2, 9]);
        assert!(pages.iter().zip(owners).all(|(p, o)| p % 4 == u32::from(o)));
        assert_eq!(&locs[..5], &[16, 17, 18, 19, 4]);
        assert_eq!(tops, [5, 5, 7, 7]);
        assert_eq!(status, [0; 6], "a granted launch leaves the status alone");
        // Releasing in reverse order restores the stacks exactly.
        let rev: Vec<u32> = pages.iter().rev().copied().collect();
        release_pages(cp, &rev, &mut stacks, &mut tops, cap, &mut status).unwrap();
        assert_eq!((stacks, tops), (stacks0, tops0));
        assert_eq!(status, [0; 6], "a granted release leaves the status alone");
    }

    #[test]
    fn an_overflowing_lane_or_an_invalid_page_refuses_the_whole_release() {
        // Two lanes of 2 slots: lane 0 holds page 2 (one slot free), lane 1 is empty.
        let stacks0 = vec![2u32, 7, 9, 9];
        let tops0 = vec![1u32, 0];
        let mut status = vec![0u32; 4];
        // Lane 0 gets page 2 twice (a double free: it already holds it) and has room for
        // one: lane 1's page is not pushed either.
        let (mut stacks, mut tops) = (stacks0.clone(), tops0.clone());
        release_pages(2, &[2, 1, 2], &mut stacks, &mut tops, 2, &mut status).unwrap();
        assert_eq!((&stacks, &tops), (&stacks0, &tops0));
        assert_eq!(status, [1, 1, 0, 0]);
        // Page 0, and page 4 (local index 2 of a 2-slot lane), are invalid even where every
        // lane has room; the words add up, saturating.
        status[3] = u32::MAX - 1;
        release_pages(2, &[3, 0, 4], &mut stacks, &mut tops, 2, &mut status).unwrap();
        assert_eq!((&stacks, &tops), (&stacks0, &tops0));
        assert_eq!(status, [2, 1, 0, u32::MAX]);
        // What fits is pushed in input order, and the status stays as it was.
        release_pages(2, &[1, 3], &mut stacks, &mut tops, 2, &mut status).unwrap();
        assert_eq!(stacks, [2, 7, 1, 3]);
        assert_eq!(tops, [1, 2]);
        assert_eq!(status, [2, 1, 0, u32::MAX]);
        // Tops beyond the capacity are clamped first: a full lane refuses one more page.
        let mut tops = vec![5u32, 0];
        release_pages(2, &[2], &mut stacks, &mut tops, 2, &mut status).unwrap();
        assert_eq!(tops, [5, 0], "a refused release changes no top");
        assert_eq!(status, [3, 2, 0, u32::MAX]);
    }

    #[test]
    fn a_short_lane_or_a_bad_owner_refuses_the_whole_launch() {
        // Lane 0 holds one page (2; slot 1 is free), lane 1 two (3, then 1): pops come from
        // the top.
        let stacks = vec![2u32, 4, 1, 3];
        let tops0 = vec![1u32, 2];
        // Lane 0 asked for 2, has 1: nothing is taken from lane 1 either.
        let (mut tops, mut status) = (tops0.clone(), vec![0u32; 4]);
        let (pages, locs) =
            select_owner_pages(2, 2, &[0, 1, 0], &stacks, &mut tops, 2, &mut status).unwrap();
        assert_eq!(pages, [0, 0, 0]);
        assert_eq!(locs, [0, 1, 0, 1, 0, 1], "page 0's slots");
        assert_eq!(tops, tops0);
        assert_eq!(status, [1, 1, 0, 0]);
        // A bad owner alone refuses too; the words add up (saturating).
        status[0] = u32::MAX;
        let (pages, _) =
            select_owner_pages(2, 2, &[1, 7, 9], &stacks, &mut tops, 2, &mut status).unwrap();
        assert_eq!(pages, [0, 0, 0]);
        assert_eq!(tops, tops0);
        assert_eq!(status, [u32::MAX, 1, 0, 2]);
        // Tops beyond the capacity are clamped before the check, and written back clamped.
        let mut tops = vec![5u32, 2];
        let (pages, _) =
            select_owner_pages(2, 1, &[0, 0], &stacks, &mut tops, 2, &mut status).unwrap();
        assert_eq!(
            pages,
            [4, 2],
            "lane 0 has 2 slots, not 5: the first pop is slot 1"
        );
        assert_eq!(tops, [0, 2]);
        assert_eq!(status, [u32::MAX, 1, 0, 2], "granted: unchanged");
        let mut tops = tops0.clone();
        assert!(select_owner_pages(2, 1, &[0], &stacks[..3], &mut tops, 2, &mut status).is_err());
        assert!(select_owner_pages(0, 1, &[0], &stacks, &mut tops, 2, &mut status).is_err());
        assert!(select_owner_pages(2, 1, &[0], &stacks, &mut tops, 2, &mut status[..3]).is_err());
    }

    #[test]
    fn transfer_round_trips_in_both_layouts() {
        let (pb, layers, dev_pages, host_pages) = (32u64, 3u32, 5u32, 4u32);
        let dev: Vec<u8> = (0..(pb * 3 * 5)).map(|i| (i * 7 % 251) as u8).collect();
        for layout in [HostLayout::PageFirst, HostLayout::LayerFirst] {
            let mut host = vec![0xA5u8; (pb * 3 * 4) as usize];
            let (d, h) = ([1u32, 4, 2, 9], [3u32, 0, 1, 2]);
            transfer_pages(
                Direction::DeviceToHost,
                layout,
                pb,
                &dev,
                &mut host,
                &d,
                &h,
                4,
                layers,
                0,
                layers,
                dev_pages,
                host_pages,
            )
            .unwrap();
            let mut back = vec![0xA5u8; dev.len()];
            transfer_pages(
                Direction::HostToDevice,
                layout,
                pb,
                &host,
                &mut back,
                &h,
                &d,
                4,
                layers,
                0,
                layers,
                dev_pages,
                host_pages,
            )
            .unwrap();
            for l in 0..layers {
                for p in 0..dev_pages {
                    let o = device_offset(p, l, dev_pages, pb) as usize;
                    let moved = [1, 4, 2].contains(&p);
                    let want = if moved {
                        &dev[o..o + 32]
                    } else {
                        &[0xA5u8; 32][..]
                    };
                    assert_eq!(&back[o..o + 32], want, "{layout} l{l} p{p}");
                }
            }
        }
    }

    #[test]
    fn transfer_of_a_layer_range_moves_only_those_layers() {
        let (pb, layers, dev_pages, host_pages) = (16u64, 3u32, 4u32, 4u32);
        let dev: Vec<u8> = (0..(pb * 3 * 4)).map(|i| (i * 7 % 251) as u8 | 1).collect();
        for layout in [HostLayout::PageFirst, HostLayout::LayerFirst] {
            for (first, count) in [(1u32, 1u32), (2, 5), (0, 0), (3, 1), (u32::MAX, 2)] {
                let mut host = vec![0u8; (pb * 3 * 4) as usize];
                transfer_pages(
                    Direction::DeviceToHost,
                    layout,
                    pb,
                    &dev,
                    &mut host,
                    &[1, 3],
                    &[2, 0],
                    2,
                    layers,
                    first,
                    count,
                    dev_pages,
                    host_pages,
                )
                .unwrap();
                let range = crate::kernels::clamp_layer_range(first, count, layers);
                for l in 0..layers {
                    for (d, h) in [(1u32, 2u32), (3, 0)] {
                        let o = host_offset(layout, h, l, layers, host_pages, pb) as usize;
                        let s = device_offset(d, l, dev_pages, pb) as usize;
                        let page = &host[o..o + pb as usize];
                        if range.contains(&l) {
                            assert_eq!(
                                page,
                                &dev[s..s + pb as usize],
                                "{layout} {first}+{count} l{l}"
                            );
                        } else {
                            assert!(
                                page.iter().all(|&b| b == 0),
                                "{layout} {first}+{count} l{l}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn transfer_refuses_one_destination_page_twice() {
        let (pb, layers, pages) = (32u64, 1u32, 4u32);
        let dev = vec![1u8; (pb * 4) as usize];
        let mut host = vec![0xA5u8; (pb * 4) as usize];
        let run = |n: u32, host: &mut [u8]| {
            transfer_pages(
                Direction::DeviceToHost,
                HostLayout::PageFirst,
                pb,
                &dev,
                host,
                &[0, 1, 2],
                &[3, 0, 3],
                n,
                layers,
                0,
                layers,
                pages,
                pages,
            )
        };
        let err = run(3, &mut host).unwrap_err();
        assert!(
            matches!(
                err,
                ReferenceError::DuplicateDestination(crate::kernels::DuplicateDestination {
                    page: 3,
                    first: 0,
                    second: 2
                })
            ),
            "{err}"
        );
        assert!(host.iter().all(|&b| b == 0xA5), "nothing moved");
        // Only the first n pairs count: two distinct pages move.
        run(2, &mut host).unwrap();
        let moved = host
            .chunks(pb as usize)
            .map(|p| p[0] == 1)
            .collect::<Vec<_>>();
        assert_eq!(moved, [true, false, false, true]);
    }

    #[test]
    fn synthesise_materialise_verify_agree() {
        for b in ALL {
            let (cp, ps, layers, local) = (4u8, 16u32, 2u32, 6u32);
            let pb = b.page_bytes(ps);
            let tokens: Vec<u32> = (0..70).map(|i| i * 31 + 7).collect();
            let hashes = prefix_hashes(&tokens);
            let seq_pages = [5u32, 2, 11, 8, 3];
            let mut pools: Vec<Vec<u8>> = (0..cp)
                .map(|_| vec![0xA5u8; (u64::from(layers * local) * pb) as usize])
                .collect();
            for (rank, pool) in pools.iter_mut().enumerate() {
                synthesise(
                    b,
                    cp,
                    ps,
                    TokenOrder::Paged,
                    pool,
                    &hashes,
                    &seq_pages,
                    70,
                    0,
                    rank as u32,
                    layers,
                    local,
                )
                .unwrap();
            }
            let views: Vec<&[u8]> = pools.iter().map(|p| p.as_slice()).collect();
            let mut dense = vec![0u8; (u64::from(layers) * 5 * pb) as usize];
            materialise(cp, pb, &views, &seq_pages, 5, layers, local, &mut dense).unwrap();
            let bad_tokens = |words: Vec<u32>| -> Vec<u32> {
                assert_eq!(words.len(), 3, "70 tokens take 3 words");
                (0..96)
                    .filter(|&t| words[t / 32] >> (t % 32) & 1 == 1)
                    .map(|t| t as u32)
                    .collect()
            };
            assert_eq!(
                bad_tokens(
                    verify(b, ps, TokenOrder::Paged, &dense, &hashes, 70, 0, layers).unwrap()
                ),
                Vec::<u32>::new(),
                "{b}"
            );
            // Poison rank 3: its pages 11 (tokens 32..48) and 3 (tokens 64..70) mismatch.
            let mut broken = pools.clone();
            broken[3] = vec![0xA5u8; broken[3].len()];
            let views: Vec<&[u8]> = broken.iter().map(|p| p.as_slice()).collect();
            materialise(cp, pb, &views, &seq_pages, 5, layers, local, &mut dense).unwrap();
            assert_eq!(
                bad_tokens(
                    verify(b, ps, TokenOrder::Paged, &dense, &hashes, 70, 0, layers).unwrap()
                ),
                (32..48).chain(64..70).collect::<Vec<u32>>(),
                "{b}"
            );
            assert_eq!(
                bad_tokens(
                    verify(b, ps, TokenOrder::Paged, &dense, &hashes, 70, 3, layers).unwrap()
                ),
                (64..70).collect::<Vec<u32>>(),
                "{b}"
            );
        }
    }

    /// Token-interleaved: each rank's pages hold its runs; materialised pages equal the
    /// reference dense buffer, and a rank's lost pool flags exactly its tokens.
    #[test]
    fn interleaved_synthesise_materialise_verify_agree() {
        let (cp, ps, layers, local, run) = (4u8, 8u32, 2u32, 4u32, 2u32);
        let order = TokenOrder::Interleaved { cp, run };
        for b in [BufferKind::MlaKv, BufferKind::NsaIndexK] {
            let pb = b.page_bytes(ps);
            let n = 45u32; // one whole granule of 32 tokens and 13 more
            let tokens: Vec<u32> = (0..n).map(|i| i * 13 + 1).collect();
            let hashes = prefix_hashes(&tokens);
            // Two aligned groups: local pages 2 and 1 of every rank.
            let seq_pages = [8u32, 9, 10, 11, 4, 5, 6, 7];
            let mut pools: Vec<Vec<u8>> = (0..cp)
                .map(|_| vec![0xA5u8; (u64::from(layers * local) * pb) as usize])
                .collect();
            for (rank, pool) in pools.iter_mut().enumerate() {
                synthesise(
                    b,
                    cp,
                    ps,
                    order,
                    pool,
                    &hashes,
                    &seq_pages,
                    n,
                    0,
                    rank as u32,
                    layers,
                    local,
                )
                .unwrap();
            }
            let views: Vec<&[u8]> = pools.iter().map(|p| p.as_slice()).collect();
            let mut got = vec![0u8; (u64::from(layers) * 8 * pb) as usize];
            materialise(cp, pb, &views, &seq_pages, 8, layers, local, &mut got).unwrap();
            assert_eq!(got, dense(b, ps, order, &hashes, n, layers).unwrap(), "{b}");
            let ok = verify(b, ps, order, &got, &hashes, n, 0, layers).unwrap();
            assert!(ok.iter().all(|&w| w == 0), "{b}");
            let mut broken = pools.clone();
            broken[1] = vec![0xA5u8; broken[1].len()];
            let views: Vec<&[u8]> = broken.iter().map(|p| p.as_slice()).collect();
            materialise(cp, pb, &views, &seq_pages, 8, layers, local, &mut got).unwrap();
            let bad = verify(b, ps, order, &got, &hashes, n, 0, layers).unwrap();
            let flagged: Vec<u32> = (0..n)
                .filter(|&t| bad[(t / 32) as usize] >> (t % 32) & 1 == 1)
                .collect();
            // Rank 1 holds runs 1, 5, 9, ... of each granule: tokens 2,3 10,11 ... 34,35 42,43.
            let want: Vec<u32> = (0..n).filter(|t| (t / run) % u32::from(cp) == 1).collect();
            assert_eq!(flagged, want, "{b}");
        }
    }
}
