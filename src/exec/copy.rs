//! DMA copy batches: [`CopyRegion`], [`DmaMode`], and the merging and checking of a batch
//! that both executors share, so a batch moves the same bytes on every backend.

use std::fmt;

#[cfg(doc)]
use super::Executor;
use super::{check_range, BufferId, ExecError};

/// One contiguous copy of a DMA batch ([`Executor::copy_regions`]): `len` bytes from
/// `src_offset` of the source buffer to `dst_offset` of the destination buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyRegion {
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

impl fmt::Display for CopyRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes from offset {} to offset {}",
            self.len, self.src_offset, self.dst_offset
        )
    }
}

/// How an executor issues a merged DMA batch ([`Executor::copy_regions_with`]). `tune` times
/// both on a GPU (candidates `dma` and `dma-each`), and a deployment's
/// [`TransferPath`](crate::kernels::TransferPath) names the one it takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DmaMode {
    /// The whole batch in one call where the executor has one (`cuMemcpyBatchAsync`, CUDA
    /// 12.8+: [`Executor::batched_copies`]); elsewhere the same as [`DmaMode::PerRegion`].
    #[default]
    Batched,
    /// One call per merged region (`cuMemcpyAsync` each on CUDA, `memcpy` each on the host
    /// executor), even where a batch call exists.
    PerRegion,
}

impl fmt::Display for DmaMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DmaMode::Batched => "batched",
            DmaMode::PerRegion => "per-region",
        })
    }
}

/// The regions of a copy batch with neighbours merged: a region whose source and destination
/// both start where another's end becomes one longer region, so a batch of page blobs issues
/// one copy per contiguous run, not one per blob (2,048 pages × 61 layers would otherwise be
/// ≈ 125,000 `cuMemcpyAsync` calls per buffer). Empty regions are dropped. Between two
/// buffers (`same_buffer` false) whose destinations are pairwise disjoint (transfers refuse
/// a page named twice), the order of the regions does not matter, so they are sorted by
/// destination first and scattered runs merge too; otherwise (within one buffer, where a
/// region may read what an earlier one wrote, or with overlapping destinations) only
/// consecutive regions merge, in order. Both executors merge every batch
/// ([`Executor::copy_regions`]); the bytes moved are the same.
pub fn merge_regions(regions: &[CopyRegion], same_buffer: bool) -> Vec<CopyRegion> {
    let mut v: Vec<CopyRegion> = regions.iter().copied().filter(|r| r.len > 0).collect();
    if !same_buffer {
        let mut sorted = v.clone();
        sorted.sort_by_key(|r| (r.dst_offset, r.src_offset));
        if sorted
            .windows(2)
            .all(|w| w[0].dst_offset + w[0].len <= w[1].dst_offset)
        {
            v = sorted;
        }
    }
    let mut out: Vec<CopyRegion> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(p)
                if p.src_offset + p.len == r.src_offset && p.dst_offset + p.len == r.dst_offset =>
            {
                p.len += r.len
            }
            _ => out.push(r),
        }
    }
    out
}

/// Checks every region of a copy batch against both buffers before anything is copied, so a
/// bad batch changes nothing; returns the bytes the batch moves. Within one buffer a region's
/// source and destination must not overlap (`memcpy` semantics); regions are applied in order.
pub(crate) fn check_regions(
    (src, src_size): (BufferId, usize),
    (dst, dst_size): (BufferId, usize),
    regions: &[CopyRegion],
) -> Result<u64, ExecError> {
    let mut bytes = 0u64;
    for &r in regions {
        let s = check_range("copy source", src, src_size, r.src_offset, r.len)?;
        let d = check_range("copy destination", dst, dst_size, r.dst_offset, r.len)?;
        if src == dst && r.len > 0 && s.start < d.end && d.start < s.end {
            return Err(ExecError::OverlappingCopy {
                buffer: src,
                region: r,
            });
        }
        bytes += r.len;
    }
    Ok(bytes)
}

/// One piece of a layer's work in a layer-wise load ([`Executor::load_layers`]).
#[derive(Debug, Clone)]
pub enum LoadOp<'a> {
    /// A checked kernel launch ([`Executor::launch`]).
    Launch {
        /// The kernel.
        kernel: super::KernelId,
        /// Its shape.
        config: super::LaunchConfig,
        /// Its arguments.
        args: Vec<super::KernelArg<'a>>,
    },
    /// Copies between two buffers ([`Executor::copy_regions_with`]).
    Copy {
        /// The source buffer.
        src: super::BufferId,
        /// The destination buffer.
        dst: super::BufferId,
        /// What goes where.
        regions: Vec<CopyRegion>,
        /// How the copies are submitted.
        mode: DmaMode,
    },
    /// Bytes for `buffer` at `offset` ([`Executor::upload`](super::Executor::upload)), in
    /// order with the load's other work: a load's own page ids, which then need nothing
    /// ordered against the cache's stream (another stream rewriting them while the load
    /// still reads them would hand its later layers another request's pages).
    Upload {
        /// The buffer written.
        buffer: super::BufferId,
        /// Where in it.
        offset: u64,
        /// What.
        data: &'a [u8],
    },
}

impl LoadOp<'_> {
    /// Enqueues this work on `exec`'s own stream.
    pub fn run<E: super::Executor + ?Sized>(&self, exec: &E) -> Result<(), super::ExecError> {
        match self {
            LoadOp::Launch {
                kernel,
                config,
                args,
            } => exec.launch(*kernel, config, args),
            LoadOp::Copy {
                src,
                dst,
                regions,
                mode,
            } => exec.copy_regions_with(*src, *dst, regions, *mode),
            LoadOp::Upload {
                buffer,
                offset,
                data,
            } => exec.upload(*buffer, *offset, data),
        }
    }
}
