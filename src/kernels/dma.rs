//! The DMA path of the transfer family: the page pairs that `transfer_pages` copies with a
//! kernel, as copy regions for [`Executor::copy_regions`](crate::exec::Executor::copy_regions)
//! (`cuMemcpyBatchAsync`, or `cuMemcpyAsync` per merged region, on a GPU). Tuning may prefer it to the kernel
//! ([`TransferPath::Dma`]); both move exactly the same bytes, which the tests check against the
//! kernel on the host executor.
//!
//! Everything here is host arithmetic over page ids the caller already has, so the DMA path
//! reads nothing back from the device, like the kernel path.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use super::reference::{device_offset, host_offset};
use super::{Direction, PageTable, TransferSpec};
use crate::exec::{BufferId, CopyRegion, DmaMode, KernelArg};

/// How a deployment moves pages between host and device pools.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransferPath {
    /// The `transfer_pages` kernel (zero-copy access to mapped pinned host memory).
    #[default]
    Kernel,
    /// Copy-engine transfers: the contiguous runs of page blobs in one `cuMemcpyBatchAsync`
    /// (CUDA 12.8+), or one `cuMemcpyAsync` per run on older drivers ([`DmaMode::Batched`]).
    Dma,
    /// Copy-engine transfers, one `cuMemcpyAsync` per contiguous run even where the driver
    /// has `cuMemcpyBatchAsync` ([`DmaMode::PerRegion`]): what `tune` picks when its
    /// candidate `dma-each` beats both the batch and the kernel.
    DmaEach,
}

impl TransferPath {
    /// How the DMA path issues its copies, or `None` for the kernel path.
    pub fn dma_mode(self) -> Option<DmaMode> {
        match self {
            TransferPath::Kernel => None,
            TransferPath::Dma => Some(DmaMode::Batched),
            TransferPath::DmaEach => Some(DmaMode::PerRegion),
        }
    }
}

impl fmt::Display for TransferPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransferPath::Kernel => "kernel",
            TransferPath::Dma => "dma",
            TransferPath::DmaEach => "dma-each",
        })
    }
}

impl FromStr for TransferPath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "kernel" => Ok(TransferPath::Kernel),
            "dma" => Ok(TransferPath::Dma),
            "dma-each" => Ok(TransferPath::DmaEach),
            other => Err(format!(
                "unknown transfer path `{other}`: expected kernel, dma or dma-each"
            )),
        }
    }
}

/// The pools a transfer runs between, as the kernel's size arguments give them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolShape {
    /// Layers per pool.
    pub layers: u32,
    /// Pages per layer of the device pool.
    pub device_pages: u32,
    /// Pages of the host pool.
    pub host_pages: u32,
}

impl PoolShape {
    /// The pools a transfer in `direction` reads and writes, source first, as (name, pages).
    pub fn ends(&self, direction: Direction) -> [(&'static str, u32); 2] {
        let device = ("device", self.device_pages);
        let host = ("host", self.host_pages);
        match direction {
            Direction::DeviceToHost => [device, host],
            Direction::HostToDevice => [host, device],
        }
    }
}

/// Two pairs of one transfer that name the same destination page
/// ([`check_distinct_destinations`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
#[error(
    "pairs {first} and {second} both write destination page {page}: on a GPU their 16-byte \
     pieces would interleave"
)]
pub struct DuplicateDestination {
    /// The destination page named twice.
    pub page: u32,
    /// The first pair naming it (index into the page lists).
    pub first: usize,
    /// The next pair naming it.
    pub second: usize,
}

/// Refuses a transfer whose pairs name one destination page twice, before anything is
/// launched: every path that moves page pairs (the cluster's transfers by kernel or by DMA,
/// the `tune` / `bench` / `bench --check` harness) calls it with the pairs it is about to
/// move.
///
/// The `transfer_pages` kernel gives no order between pairs: on a GPU the blocks of two such
/// pairs store their 16-byte vectors concurrently, so the page would end up a mix of both
/// sources, while the CPU emulator runs blocks one after another and shows one source whole.
/// The pairs are host data, so the host can refuse them; the kernel and the executors cannot
/// (the page ids are in device memory). The error names the page and the first two pairs
/// with it (the lowest page named twice). Host work only: it reads and allocates nothing on
/// the executor, so it is free on the load path.
pub fn check_distinct_destinations(dst_pages: &[u32]) -> Result<(), DuplicateDestination> {
    if dst_pages.len() < 2 {
        return Ok(());
    }
    let mut order: Vec<usize> = (0..dst_pages.len()).collect();
    // Stable by page: equal pages keep their pair order.
    order.sort_by_key(|&i| dst_pages[i]);
    match order
        .windows(2)
        .find(|w| dst_pages[w[0]] == dst_pages[w[1]])
    {
        None => Ok(()),
        Some(w) => Err(DuplicateDestination {
            page: dst_pages[w[0]],
            first: w[0],
            second: w[1],
        }),
    }
}

/// The layers a transfer of layers `[first_layer, first_layer + layer_count)` copies out of
/// pools of `layers` layers: the range clamped to `[0, layers)`, as the `transfer_pages`
/// kernel clamps its `first_layer` / `layer_count` arguments (in 64 bits: a sum past
/// `u32::MAX` does not wrap). Empty when the range is empty or starts at or past `layers`.
pub fn clamp_layer_range(first_layer: u32, layer_count: u32, layers: u32) -> Range<u32> {
    let end = (u64::from(first_layer) + u64::from(layer_count)).min(u64::from(layers)) as u32;
    if first_layer < end {
        first_layer..end
    } else {
        0..0
    }
}

/// The `first_layer` / `layer_count` kernel arguments of a layer range (an empty or reversed
/// range gives a count of 0).
pub fn layer_range_args(layers: &Range<u32>) -> (u32, u32) {
    (layers.start, layers.end.saturating_sub(layers.start))
}

/// The arguments of a `transfer_pages` launch, in [`KernelSpec::params`](super::KernelSpec::params)
/// order: `ends` holds each buffer's (device pool as a page table, host pool and offset) in the spec's
/// descriptor order ([`TransferSpec::descriptors`]); the first leads, a second comes last
/// (`device1`, `host1`, `page_stride1`). `page_ids` are the uploaded (source, destination)
/// page lists of `n` pairs, `(first_layer, layer_count)` the kernel's layer range as given
/// (it clamps them; [`layer_range_args`] turns a `Range` into them), `pools` the sizes the
/// kernel is told. The kernel path's one place for this order, as [`transfer_regions`] is
/// the DMA path's.
pub fn transfer_args<'a>(
    ends: &'a [(&'a PageTable, (BufferId, u64))],
    page_ids: (BufferId, BufferId),
    n: u32,
    pools: PoolShape,
    (first_layer, layer_count): (u32, u32),
) -> Vec<KernelArg<'a>> {
    let mut args = vec![
        ends[0].0.arg(),
        KernelArg::Ptr(ends[0].1 .0, ends[0].1 .1),
        KernelArg::Ptr(page_ids.0, 0),
        KernelArg::Ptr(page_ids.1, 0),
        KernelArg::U32(n),
        KernelArg::U32(pools.layers),
        KernelArg::U32(first_layer),
        KernelArg::U32(layer_count),
        KernelArg::U32(pools.device_pages),
        KernelArg::U32(pools.host_pages),
        KernelArg::U32(ends[0].0.page_stride),
    ];
    for &(device, host) in &ends[1..] {
        args.extend([
            device.arg(),
            KernelArg::Ptr(host.0, host.1),
            KernelArg::U32(device.page_stride),
        ]);
    }
    args
}

/// The copy regions that move page `src_pages[i]` to `dst_pages[i]` for every pair and every
/// layer of `layer_range` (clamped to the pools' `[0, pools.layers)` as by
/// [`clamp_layer_range`], so one layer or an out-of-range range is fine), with `spec`'s
/// direction and host layout: exactly the bytes `transfer_pages` copies,
/// including its rule that a pair with a page outside its pool is skipped. Regions that
/// continue the previous one on both sides are merged, so runs of consecutive pages become one
/// copy. Pairs beyond the shorter list are ignored (the kernel takes `n` explicitly).
///
/// Destination pages must be distinct, as for the kernel: callers refuse pairs that are not
/// with [`check_distinct_destinations`] first (the regions themselves are applied in order by
/// [`Executor::copy_regions`](crate::exec::Executor::copy_regions), so they would not mix bytes,
/// but the DMA path must accept exactly what the kernel path accepts).
pub fn transfer_regions(
    spec: &TransferSpec,
    src_pages: &[u32],
    dst_pages: &[u32],
    pools: PoolShape,
    layer_range: Range<u32>,
) -> Vec<CopyRegion> {
    let page_bytes = spec.page_bytes();
    let device_pages = pools.device_pages;
    transfer_regions_at(spec, src_pages, dst_pages, pools, layer_range, |p, l| {
        device_offset(p, l, device_pages, page_bytes)
    })
}

/// [`transfer_regions`] with the device side wherever `dev(page, layer)` says: an engine's
/// memory, one buffer per layer, pages a stride apart (a [`PageTable`](super::PageTable)'s
/// entry and stride), one layer per call.
pub fn transfer_regions_at(
    spec: &TransferSpec,
    src_pages: &[u32],
    dst_pages: &[u32],
    pools: PoolShape,
    layer_range: Range<u32>,
    dev: impl Fn(u32, u32) -> u64,
) -> Vec<CopyRegion> {
    let page_bytes = spec.page_bytes();
    let PoolShape {
        layers,
        device_pages: _,
        host_pages,
    } = pools;
    let host = |p, l| host_offset(spec.layout, p, l, layers, host_pages, page_bytes);
    let [(_, src_cap), (_, dst_cap)] = pools.ends(spec.direction);
    let mut out: Vec<CopyRegion> = Vec::new();
    let (first_layer, layer_count) = layer_range_args(&layer_range);
    for l in clamp_layer_range(first_layer, layer_count, layers) {
        for (&sp, &dp) in src_pages.iter().zip(dst_pages) {
            if sp >= src_cap || dp >= dst_cap {
                continue;
            }
            let (src_offset, dst_offset) = match spec.direction {
                Direction::DeviceToHost => (dev(sp, l), host(dp, l)),
                Direction::HostToDevice => (host(sp, l), dev(dp, l)),
            };
            match out.last_mut() {
                Some(r)
                    if r.src_offset + r.len == src_offset && r.dst_offset + r.len == dst_offset =>
                {
                    r.len += page_bytes;
                }
                _ => out.push(CopyRegion {
                    src_offset,
                    dst_offset,
                    len: page_bytes,
                }),
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{CopyLaunch, HostLayout};

    fn spec(direction: Direction, layout: HostLayout) -> TransferSpec {
        TransferSpec {
            second_bytes_per_token: None,
            stamps: false,
            direction,
            layout,
            page_size: 4,
            bytes_per_token: 8,
            launch: CopyLaunch::default(),
        }
    }

    const POOLS: PoolShape = PoolShape {
        layers: 2,
        device_pages: 8,
        host_pages: 16,
    };

    #[test]
    fn consecutive_pages_merge_in_the_layer_first_layout() {
        let s = spec(Direction::HostToDevice, HostLayout::LayerFirst);
        let r = transfer_regions(&s, &[3, 4, 5, 9], &[1, 2, 3, 4], POOLS, 0..POOLS.layers);
        // Per layer: host pages 3..6 -> device 1..4 as one run, then 9 -> 4.
        assert_eq!(
            r,
            vec![
                CopyRegion {
                    src_offset: 3 * 32,
                    dst_offset: 32,
                    len: 96
                },
                CopyRegion {
                    src_offset: 9 * 32,
                    dst_offset: 4 * 32,
                    len: 32
                },
                CopyRegion {
                    src_offset: (16 + 3) * 32,
                    dst_offset: (8 + 1) * 32,
                    len: 96
                },
                CopyRegion {
                    src_offset: (16 + 9) * 32,
                    dst_offset: (8 + 4) * 32,
                    len: 32
                },
            ]
        );
    }

    #[test]
    fn page_first_host_pages_do_not_merge_across_pages() {
        let s = spec(Direction::DeviceToHost, HostLayout::PageFirst);
        let r = transfer_regions(&s, &[1, 2], &[5, 6], POOLS, 0..POOLS.layers);
        assert_eq!(r.len(), 4);
        assert_eq!(
            r[0],
            CopyRegion {
                src_offset: 32,
                dst_offset: 5 * 2 * 32,
                len: 32
            }
        );
        assert_eq!(r[3].dst_offset, (6 * 2 + 1) * 32);
        assert_eq!(r.iter().map(|r| r.len).sum::<u64>(), 2 * 2 * 32);
    }

    #[test]
    fn pairs_outside_a_pool_are_skipped_like_the_kernel() {
        let s = spec(Direction::HostToDevice, HostLayout::LayerFirst);
        assert!(transfer_regions(&s, &[16, 0], &[0, 8], POOLS, 0..2).is_empty());
    }

    #[test]
    fn a_layer_range_moves_only_its_layers() {
        let s = spec(Direction::HostToDevice, HostLayout::LayerFirst);
        let all = transfer_regions(&s, &[3, 4, 5, 9], &[1, 2, 3, 4], POOLS, 0..POOLS.layers);
        // Layer 1 alone: the second half of the full transfer's regions.
        let one = transfer_regions(&s, &[3, 4, 5, 9], &[1, 2, 3, 4], POOLS, 1..2);
        assert_eq!(one, all[2..]);
        assert_eq!(
            transfer_regions(&s, &[3, 4, 5, 9], &[1, 2, 3, 4], POOLS, 0..1),
            all[..2]
        );
        // Past the pools: clamped to the valid part, or nothing.
        assert_eq!(
            transfer_regions(&s, &[3], &[1], POOLS, 1..u32::MAX).len(),
            1
        );
        for empty in [2..3, 5..9, 1..1, u32::MAX..u32::MAX] {
            assert!(
                transfer_regions(&s, &[3], &[1], POOLS, empty.clone()).is_empty(),
                "{empty:?}"
            );
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 1..0;
        assert!(transfer_regions(&s, &[3], &[1], POOLS, reversed).is_empty());
    }

    #[test]
    fn layer_ranges_clamp_like_the_kernel() {
        assert_eq!(clamp_layer_range(0, 4, 4), 0..4);
        assert_eq!(clamp_layer_range(1, 1, 4), 1..2);
        assert_eq!(clamp_layer_range(2, 10, 4), 2..4);
        assert_eq!(clamp_layer_range(3, u32::MAX, 4), 3..4);
        assert_eq!(clamp_layer_range(u32::MAX, u32::MAX, u32::MAX), 0..0);
        assert!(clamp_layer_range(4, 1, 4).is_empty());
        assert!(clamp_layer_range(1, 0, 4).is_empty());
        assert_eq!(layer_range_args(&(2..5)), (2, 3));
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = 5..2;
        assert_eq!(layer_range_args(&reversed), (5, 0));
    }

    #[test]
    fn a_destination_page_named_twice_is_refused() {
        assert_eq!(check_distinct_destinations(&[]), Ok(()));
        assert_eq!(check_distinct_destinations(&[7]), Ok(()));
        assert_eq!(check_distinct_destinations(&[3, 1, 2, 0]), Ok(()));
        assert_eq!(
            check_distinct_destinations(&[5, 9, 2, 9, 5, 9]),
            Err(DuplicateDestination {
                page: 5,
                first: 0,
                second: 4
            })
        );
        let e = check_distinct_destinations(&[4, 8, 8]).unwrap_err();
        assert_eq!((e.page, e.first, e.second), (8, 1, 2));
        assert_eq!(
            e.to_string(),
            "pairs 1 and 2 both write destination page 8: on a GPU their 16-byte pieces would \
             interleave"
        );
    }

    #[test]
    fn transfer_path_parses() {
        assert_eq!("DMA".parse::<TransferPath>(), Ok(TransferPath::Dma));
        assert_eq!(TransferPath::default().to_string(), "kernel");
        for p in [
            TransferPath::Kernel,
            TransferPath::Dma,
            TransferPath::DmaEach,
        ] {
            assert_eq!(p.to_string().parse::<TransferPath>(), Ok(p));
        }
        assert_eq!(TransferPath::DmaEach.dma_mode(), Some(DmaMode::PerRegion));
        assert_eq!(TransferPath::Kernel.dma_mode(), None);
        assert!("pcie".parse::<TransferPath>().is_err());
    }
}
