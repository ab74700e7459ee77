//! Launch shapes: the access width and launch shape of the page-copy families, the GPU
//! default transfer grid and the candidates the tuner times, and the 1-D launch a spec
//! recommends.

use std::fmt;

/// Width of one global-memory access in the copy loops.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum VecWidth {
    /// Byte accesses (`u8`): any page size.
    V1,
    /// Word accesses (`u32`).
    V4,
    /// 16-byte accesses (`uint4`): the GPU default.
    #[default]
    V16,
}

impl fmt::Display for VecWidth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "v{}", self.bytes())
    }
}

impl VecWidth {
    /// Bytes per access.
    pub fn bytes(self) -> u32 {
        match self {
            VecWidth::V1 => 1,
            VecWidth::V4 => 4,
            VecWidth::V16 => 16,
        }
    }

    /// The CUDA type of one access.
    pub(crate) fn c_type(self) -> &'static str {
        match self {
            VecWidth::V1 => "u8",
            VecWidth::V4 => "u32",
            VecWidth::V16 => "uint4",
        }
    }

    /// The widest access that divides `page_bytes`, so every deployment gets a valid default.
    pub fn widest_for(page_bytes: u64) -> VecWidth {
        [VecWidth::V16, VecWidth::V4]
            .into_iter()
            .find(|v| page_bytes % u64::from(v.bytes()) == 0)
            .unwrap_or(VecWidth::V1)
    }
}

/// Launch shape of the page-copy families (transfer, materialise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CopyLaunch {
    /// Threads per block (1..=1024; a transfer's must be at most a warp or whole warps, see
    /// [`CopyLaunch::group_lanes`]).
    pub threads: u32,
    /// Pages (page pairs) each work item copies (1..=64). Materialise gives an item to a
    /// block; a transfer gives it to a group of [`CopyLaunch::group_lanes`] threads (a warp),
    /// so for transfers this is pairs per group item, not per block.
    pub pages_per_block: u32,
    /// Access width.
    pub vec: VecWidth,
    /// Loads per thread in a copy round (1..=16): what it keeps in flight, as far as the
    /// page allows ([`CopyLaunch::bytes_in_flight`]).
    pub unroll: u32,
    /// Where the layer loop runs. `false`: in the grid, each (page group, layer) is a work
    /// item of its own. `true`: in the block (a transfer: in the group), each work item
    /// copies its pages for every layer, page by page, so a page-first host page is walked
    /// contiguously and the grid has `layers` times fewer items. (A loop outside the kernel, one launch per layer, is
    /// the grid form with `layers` times the launches, so it is not a candidate.)
    pub layers_in_block: bool,
    /// Whether pages are stored with `__stcs` (cache-streaming: the copy is not read again
    /// soon) instead of plain stores. The CPU emulation makes these non-temporal stores,
    /// which skip the read-for-ownership of each destination line: one thread walking a
    /// page then nears memcpy, while many threads striding through a page leave partial
    /// lines and slow down many times, so the tuner decides per executor.
    pub streaming_stores: bool,
    /// Most blocks a launch gets (0: no cap, one block per work item up to 65536). The
    /// kernels stride over their work items, so a capped grid is only a launch change: the
    /// render is the same code, its uri gains `_g<max_blocks>`. A host↔device transfer is
    /// bound by the link, not the SMs, and a capped grid leaves the SMs to the compute
    /// kernels running beside it (docs/KERNELS.md "Capped transfer grid").
    pub max_blocks: u32,
}

impl Default for CopyLaunch {
    fn default() -> Self {
        CopyLaunch {
            threads: 128,
            pages_per_block: 1,
            vec: VecWidth::V16,
            unroll: 4,
            layers_in_block: false,
            streaming_stores: false,
            max_blocks: 0,
        }
    }
}

impl fmt::Display for CopyLaunch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "t{}_ppb{}_{}_u{}",
            self.threads, self.pages_per_block, self.vec, self.unroll
        )?;
        if self.layers_in_block {
            f.write_str("_lb")?;
        }
        if self.streaming_stores {
            f.write_str("_cs")?;
        }
        if self.max_blocks != 0 {
            write!(f, "_g{}", self.max_blocks)?;
        }
        Ok(())
    }
}

/// Blocks of the GPU default transfer grid ([`CopyLaunch::gpu_transfer`]).
pub const GPU_TRANSFER_BLOCKS: u32 = 4;

/// Threads per block of the GPU default transfer grid ([`CopyLaunch::gpu_transfer`]).
pub const GPU_TRANSFER_THREADS: u32 = 512;

/// Loads in flight per thread of the GPU default transfer grid.
pub const GPU_TRANSFER_UNROLL: u32 = 8;

/// Threads of a warp: the most lanes a transfer's copy group has.
pub const WARP_LANES: u32 = 32;

/// How a copy kernel splits its pages among a block's threads: what bounds its loads in
/// flight ([`CopyLaunch::bytes_in_flight`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CopyMapping {
    /// A block's pages are one flat run of vectors, thread `t` taking `t, t + THREADS, …` of
    /// each page: a round never crosses a page, so a page of fewer than `THREADS × UNROLL`
    /// vectors leaves each thread only its share of the page in flight. Materialise (and
    /// transfers before issue 29).
    BlockRun,
    /// Each group of [`CopyLaunch::group_lanes`] threads copies a page item of its own,
    /// lane `l` taking `l, l + lanes, …`: `UNROLL` loads per lane until the page has fewer
    /// than `lanes × UNROLL` vectors (a page under 4 KiB at 32 lanes × 8 × 16 B).
    /// Transfers.
    Groups,
}

/// Bytes a copy launch keeps in flight (loads issued, not yet stored) in the first round
/// of each page, when every block and group has work; later rounds of a page keep the same
/// or, in its last round, less.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InFlight {
    /// Per warp (the block's threads when fewer than 32): for [`CopyMapping::BlockRun`] the
    /// block's bytes shared evenly among its warps (the mean, rounded down).
    pub per_warp: u64,
    /// Per block.
    pub per_block: u64,
    /// Per launch of a capped grid ([`CopyLaunch::max_blocks`] blocks); `None` uncapped,
    /// where the grid grows with the work.
    pub per_launch: Option<u64>,
}

/// The capped grid sizes the tuner times for transfers ([`CopyLaunch::capped_candidates`]).
pub const TRANSFER_GRID_CAPS: [u32; 5] = [1, 2, 4, 8, 16];

impl CopyLaunch {
    /// The default launch of host↔device transfers: [`GPU_TRANSFER_BLOCKS`] blocks of
    /// [`GPU_TRANSFER_THREADS`] threads, 16-byte accesses, [`GPU_TRANSFER_UNROLL`] in flight
    /// per thread. With a warp per page item that is 4 × 512 × 8 × 16 B = 256 KiB in flight
    /// for every page of the reference deployments (all at least 4 KiB; 64 warps need 64
    /// items, e.g. a per-layer load of 32 NSA pages), twice what a PCIe Gen5 x16 link
    /// (≈ 55 GB/s, ≈ 2 µs round trip) needs, so a slower round trip through a loaded GPU
    /// still fills it; SGLang's transfer kernel uses 2 blocks × 1024 threads for the same
    /// reason. The rest of the GPU stays free for the model (docs/KERNELS.md).
    pub fn gpu_transfer() -> CopyLaunch {
        CopyLaunch {
            threads: GPU_TRANSFER_THREADS,
            unroll: GPU_TRANSFER_UNROLL,
            max_blocks: GPU_TRANSFER_BLOCKS,
            ..CopyLaunch::default()
        }
    }

    /// The capped-grid transfer shapes worth timing for a page of `page_bytes`: 64, 128,
    /// 256 and 512 threads, 8 loads in flight each, at each of [`TRANSFER_GRID_CAPS`]
    /// blocks (the tuner keeps the fewest blocks that hold the bandwidth while a compute
    /// kernel runs beside). Since each warp keeps its own 4 KiB in flight, small blocks are
    /// a finer step: 1 block of 64 threads keeps 8 KiB, 16 of 512 keep 1 MiB.
    pub fn capped_candidates(page_bytes: u64) -> Vec<CopyLaunch> {
        let vec = VecWidth::widest_for(page_bytes);
        let mut out = Vec::new();
        for threads in [64, 128, 256, 512] {
            for max_blocks in TRANSFER_GRID_CAPS {
                out.push(CopyLaunch {
                    threads,
                    vec,
                    max_blocks,
                    ..CopyLaunch::gpu_transfer()
                });
            }
        }
        out
    }

    /// Threads of a transfer's copy group: a warp, or the whole block when it has fewer
    /// threads (one thread walks every page in order). A group copies a page item of its
    /// own, so a page's vectors are shared by 32 lanes instead of the block's threads.
    pub fn group_lanes(&self) -> u32 {
        self.threads.clamp(1, WARP_LANES)
    }

    /// Copy groups per block (a transfer's block is whole groups).
    pub fn groups_per_block(&self) -> u32 {
        self.threads.max(1) / self.group_lanes()
    }

    /// Bytes in flight ([`InFlight`]) when this shape copies pages of `page_bytes` (one
    /// buffer's) under `mapping`: the first round of a page issues `min(page_vecs, threads ×
    /// UNROLL)` loads per block under [`CopyMapping::BlockRun`] and `min(page_vecs, lanes ×
    /// UNROLL)` per group under [`CopyMapping::Groups`]. The access width is this shape's
    /// (the kernels narrow it to one that divides the page first).
    pub fn bytes_in_flight(&self, page_bytes: u64, mapping: CopyMapping) -> InFlight {
        let vec = u64::from(self.vec.bytes());
        let page_vecs = page_bytes / vec;
        let threads = u64::from(self.threads.max(1));
        let lanes = u64::from(self.group_lanes());
        let warps = threads.div_ceil(u64::from(WARP_LANES));
        let unroll = u64::from(self.unroll);
        let (per_warp, per_block) = match mapping {
            CopyMapping::BlockRun => {
                let block = page_vecs.min(threads * unroll) * vec;
                (block / warps, block)
            }
            CopyMapping::Groups => {
                let warp = page_vecs.min(lanes * unroll) * vec;
                (warp, warp * u64::from(self.groups_per_block()))
            }
        };
        InFlight {
            per_warp,
            per_block,
            per_launch: (self.max_blocks != 0).then(|| per_block * u64::from(self.max_blocks)),
        }
    }

    /// Launch shapes worth timing for a page of `page_bytes`: a CPU-friendly one (one thread
    /// walks a page contiguously), GPU-shaped ones, two with word accesses instead of the
    /// widest, two that loop over the layers in the block, and two GPU shapes with streaming
    /// stores. Shapes the page cannot use are dropped.
    pub fn candidates(page_bytes: u64) -> Vec<CopyLaunch> {
        let v = VecWidth::widest_for(page_bytes);
        let shape = |threads, pages_per_block, unroll| CopyLaunch {
            threads,
            pages_per_block,
            vec: v,
            unroll,
            ..CopyLaunch::default()
        };
        let words = |l: CopyLaunch| CopyLaunch {
            vec: VecWidth::V4,
            ..l
        };
        let layers_in_block = |l: CopyLaunch| CopyLaunch {
            layers_in_block: true,
            ..l
        };
        let streaming = |l: CopyLaunch| CopyLaunch {
            streaming_stores: true,
            ..l
        };
        let mut out = vec![
            shape(1, 1, 1),
            shape(1, 4, 1),
            shape(32, 1, 2),
            shape(64, 1, 4),
            shape(128, 1, 4),
            shape(256, 1, 2),
            shape(128, 2, 2),
            shape(512, 1, 1),
            shape(256, 1, 8),
            layers_in_block(shape(1, 4, 1)),
            layers_in_block(shape(128, 1, 4)),
            streaming(shape(128, 1, 4)),
            streaming(layers_in_block(shape(128, 1, 4))),
        ];
        if v != VecWidth::V4 && page_bytes % 4 == 0 {
            out.extend([words(shape(1, 4, 1)), words(shape(128, 1, 4))]);
        }
        out
    }
}

/// A 1-D launch: `grid` blocks of `block` threads, no dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchDims {
    /// Blocks (gridDim.x).
    pub grid: u32,
    /// Threads per block (blockDim.x).
    pub block: u32,
}
