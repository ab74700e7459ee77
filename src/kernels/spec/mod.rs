//! `KernelSpec`: one kernel family plus every compile-time constant and launch-shape choice
//! that changes its source. The spec names itself (`uri()`), validates itself, and lists its
//! tuning candidates; rendering lives in `render.rs`.
//!
//! The pieces a spec is built from live in submodules, re-exported here: `buffer` (buffer
//! kinds, field layouts), `launch` (copy launch shapes, transfer grids, launch dims),
//! `families` (the per-family specs and token order), `status` (the select and release
//! status words) and `params` (kernel parameters, reaches, signatures).

mod buffer;
mod families;
mod launch;
mod params;
mod status;

pub use buffer::{
    Arrangement, BufferKind, Dtype, FieldLayout, FieldMisalignment, ShapeError,
    GQA_MAX_HEAD_ELEMENTS,
};
pub use families::{
    AllocSpec, BusyKind, BusySpec, Direction, HostLayout, MaterialiseSpec, ReleaseSpec,
    SelectOutput, SynthSpec, TokenOrder, TransferSpec, VerifySpec,
};
// The sm_90 occupancy limits stay at their old path, though only materialise's own module,
// the busy companions' shape (`SM_MAX_THREADS`) and the tests use them.
#[allow(unused_imports)]
pub use families::{SM_MAX_BLOCKS, SM_MAX_THREADS};
pub use launch::{
    CopyLaunch, CopyMapping, InFlight, LaunchDims, VecWidth, GPU_TRANSFER_BLOCKS,
    GPU_TRANSFER_THREADS, GPU_TRANSFER_UNROLL, TRANSFER_GRID_CAPS, WARP_LANES,
};
pub(crate) use params::render_params;
pub use params::{KernelParam, KernelSignature, Reach, ReachError, Strided, TableEntries};
pub use status::{ReleaseStatus, SelectStatus};

use std::fmt;

use super::KernelError;

/// The kernel families of docs/DESIGN.md §3.1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// Owner-page selection (alloc): pops pages from the lane free stacks.
    SelectOwnerPages,
    /// Lane release (free): pushes pages back to their lanes.
    ReleasePages,
    /// Page transfer between a device pool and a host pool.
    TransferPages,
    /// Gather of a sequence's pages from the CP owner pools into one dense buffer.
    Materialise,
    /// Deterministic KV synthesis into a rank's pool.
    Synthesise,
    /// Comparison of a dense buffer against the synthesised bytes.
    Verify,
    /// A compute-bound stand-in for the model's kernels: `tune` on a GPU times transfers
    /// while it occupies the SMs (docs/KERNELS.md "busy"). No deployment runs it to serve.
    Busy,
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Family::SelectOwnerPages => "select_owner_pages",
            Family::ReleasePages => "release_pages",
            Family::TransferPages => "transfer_pages",
            Family::Materialise => "materialise",
            Family::Synthesise => "synthesise",
            Family::Verify => "verify",
            Family::Busy => "busy",
        })
    }
}

/// One renderable kernel: a family and every constant its source depends on. Two specs are
/// equal exactly when their renders are equal, so the spec is a sound cache-key input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KernelSpec {
    /// See [`AllocSpec`].
    SelectOwnerPages(AllocSpec),
    /// See [`ReleaseSpec`].
    ReleasePages(ReleaseSpec),
    /// See [`TransferSpec`].
    TransferPages(TransferSpec),
    /// See [`MaterialiseSpec`].
    Materialise(MaterialiseSpec),
    /// See [`SynthSpec`].
    Synthesise(SynthSpec),
    /// See [`VerifySpec`].
    Verify(VerifySpec),
    /// See [`BusySpec`].
    Busy(BusySpec),
}

/// Cap on the recommended grid: the kernels stride over their work, so more blocks than this
/// add nothing.
const MAX_GRID: u64 = 1 << 16;

/// Most layers a layer-wise load puts in one transfer launch
/// ([`KernelSpec::layers_per_launch`]): the first layer's reader waits for this many.
pub const MAX_LAYERS_PER_LAUNCH: u32 = 4;

/// Bytes of a stamped transfer's `stamps` ([`TransferSpec::stamps`]): its first block start,
/// last block end and last block start, in nanoseconds of the device's clock.
pub const TRANSFER_STAMP_BYTES: u64 = 24;

/// Verify blocks stride over work items (a run of [`VerifySpec::item_tokens`] tokens in one
/// layer). On the CPU emulator every block starts a fiber per thread, so when a block was one
/// token, starting fibers was most of the work (a 20-30 % faster default replay with this
/// cap); on an H200 it is about 8 blocks per SM, plenty for a check that is not on the
/// serving path.
const VERIFY_MAX_BLOCKS: u64 = 1024;

impl KernelSpec {
    /// The kernel family.
    pub fn family(&self) -> Family {
        match self {
            KernelSpec::SelectOwnerPages(_) => Family::SelectOwnerPages,
            KernelSpec::ReleasePages(_) => Family::ReleasePages,
            KernelSpec::TransferPages(_) => Family::TransferPages,
            KernelSpec::Materialise(_) => Family::Materialise,
            KernelSpec::Synthesise(_) => Family::Synthesise,
            KernelSpec::Verify(_) => Family::Verify,
            KernelSpec::Busy(_) => Family::Busy,
        }
    }

    /// `tune`'s twin of this kernel that stamps where it ran on the device's clock
    /// ([`TransferSpec::stamps`]): transfers only, `None` for the other families.
    pub fn stamped(&self) -> Option<KernelSpec> {
        match self {
            KernelSpec::TransferPages(s) => Some(KernelSpec::TransferPages(s.stamped())),
            _ => None,
        }
    }

    /// Readable unique name spelling every parameter, e.g.
    /// `transfer_pages_h2d_pf_ps64_b656_t128_ppb1_v16_u4`. It is also the entry name.
    pub fn uri(&self) -> String {
        let fam = self.family();
        match self {
            KernelSpec::SelectOwnerPages(s) => format!(
                "{fam}_cp{}_ps{}{}_t{}",
                s.cp,
                s.page_size,
                s.output.uri_suffix(),
                s.threads
            ),
            KernelSpec::ReleasePages(s) => format!("{fam}_cp{}_t{}", s.cp, s.threads),
            KernelSpec::TransferPages(s) => format!(
                "{}_{}{}",
                s.stem(),
                s.launch,
                if s.stamps { "_stamped" } else { "" }
            ),
            KernelSpec::Materialise(s) => format!(
                "{fam}_cp{}_ps{}_b{}_{}",
                s.cp, s.page_size, s.bytes_per_token, s.launch
            ),
            KernelSpec::Synthesise(s) => {
                let order = match s.order {
                    TokenOrder::Paged => String::new(),
                    TokenOrder::Interleaved { run, .. } => format!("_ti{run}"),
                };
                format!(
                    "{fam}_{}_cp{}_ps{}_t{}{order}",
                    s.buffer, s.cp, s.page_size, s.threads
                )
            }
            KernelSpec::Verify(s) => {
                format!(
                    "{fam}_{}_ps{}_t{}{}",
                    s.buffer,
                    s.page_size,
                    s.threads,
                    s.order.uri_suffix()
                )
            }
            KernelSpec::Busy(s) => format!("{fam}_{}_t{}", s.kind, s.threads),
        }
    }

    /// The `extern "C"` name of the kernel in its render: the uri.
    pub fn entry_name(&self) -> String {
        self.uri()
    }

    /// The launch contract executors check: parameters, block size, and whether the grid
    /// must be one block.
    pub fn signature(&self) -> KernelSignature {
        KernelSignature {
            params: self.params(),
            threads: self.threads(),
            single_block: matches!(
                self,
                KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_)
            ),
        }
    }

    /// The kernel's parameters in order (docs/KERNELS.md "Kernels"): the render spells its
    /// `extern "C"` parameter list from them, and executors check launches against them.
    pub fn params(&self) -> Vec<KernelParam> {
        use KernelParam as P;
        use Reach as R;
        match self {
            KernelSpec::SelectOwnerPages(s) => {
                let mut params = vec![
                    P::ptr("const u8*", "owners", 1, R::of(1).times("n")),
                    P::u32("n"),
                    P::ptr(
                        "const u32*",
                        "lane_stacks",
                        4,
                        R::of(4 * s.cp as u64).times("lane_cap"),
                    ),
                    P::ptr("u32*", "lane_tops", 4, R::of(4 * s.cp as u64)),
                    P::u32("lane_cap"),
                    P::ptr("u32*", "out_pages", 4, R::of(4).times("n")),
                ];
                if s.output.writes_locs() {
                    params.push(P::ptr(
                        "i64*",
                        "out_locs",
                        8,
                        R::of(8 * u64::from(s.page_size)).times("n"),
                    ));
                }
                params.push(P::ptr(
                    "u32*",
                    "status",
                    4,
                    R::of(4 * s.status_words() as u64),
                ));
                params
            }
            KernelSpec::ReleasePages(s) => vec![
                P::ptr("const u32*", "pages", 4, R::of(4).times("n")),
                P::u32("n"),
                P::ptr(
                    "u32*",
                    "lane_stacks",
                    4,
                    R::of(4 * s.cp as u64).times("lane_cap"),
                ),
                P::ptr("u32*", "lane_tops", 4, R::of(4 * s.cp as u64)),
                P::u32("lane_cap"),
                P::ptr("u32*", "status", 4, R::of(4 * s.status_words() as u64)),
            ],
            KernelSpec::TransferPages(s) => {
                let h2d = s.direction == Direction::HostToDevice;
                // The device pools through page tables, the host pool as one buffer.
                let ends = |pb: u64, table: &'static str, host: &'static str, stride| {
                    let pages = Strided {
                        unit: pb,
                        count: "device_pages",
                        stride,
                    };
                    let host_reach = R::of(pb).times("layers").times("host_pages");
                    let host = if h2d {
                        P::pages("const u8*", host, host_reach)
                    } else {
                        P::pages("u8*", host, host_reach)
                    };
                    [P::table(table, 1, pages, h2d), host]
                };
                let mut params = ends(s.page_bytes(), "device", "host", "page_stride").to_vec();
                params.extend([
                    P::ptr("const u32*", "src_pages", 4, R::of(4).times("n")),
                    P::ptr("const u32*", "dst_pages", 4, R::of(4).times("n")),
                    P::u32("n"),
                    P::u32("layers"),
                    P::u32("first_layer"),
                    P::u32("layer_count"),
                    P::u32("device_pages"),
                    P::u32("host_pages"),
                    P::u32("page_stride"),
                ]);
                // The second buffer's pools come last, so a one-buffer launch's arguments
                // are a prefix of a two-buffer one's.
                if let Some(second) = s.descriptors().get(1) {
                    params.extend(ends(
                        second.page_bytes(),
                        "device1",
                        "host1",
                        "page_stride1",
                    ));
                    params.push(P::u32("page_stride1"));
                }
                if s.stamps {
                    params.push(P::ptr("u64*", "stamps", 8, R::of(TRANSFER_STAMP_BYTES)));
                }
                params
            }
            KernelSpec::Materialise(s) => {
                let pb = s.page_bytes();
                let pages = Strided {
                    unit: pb,
                    count: "local_pages",
                    stride: "page_stride",
                };
                vec![
                    P::table("pools", u64::from(s.cp), pages, false),
                    P::ptr("const u32*", "seq_pages", 4, R::of(4).times("n")),
                    P::u32("n"),
                    P::u32("layers"),
                    P::u32("local_pages"),
                    P::u32("page_stride"),
                    P::pages("u8*", "dense", R::of(pb).times("layers").times("n")),
                ]
            }
            KernelSpec::Synthesise(s) => vec![
                P::table(
                    "pool",
                    1,
                    Strided {
                        unit: s.buffer.page_bytes(s.page_size),
                        count: "local_pages",
                        stride: "page_stride",
                    },
                    true,
                ),
                P::ptr("const u64*", "prefix_hash", 8, R::of(8).times("n_tokens")),
                P::ptr(
                    "const u32*",
                    "seq_pages",
                    4,
                    s.order.pages_reach(R::of(4), "n_tokens", s.page_size),
                ),
                P::u32("n_tokens"),
                P::u32("first_token"),
                P::u32("rank"),
                P::u32("layers"),
                P::u32("local_pages"),
                P::u32("page_stride"),
            ],
            KernelSpec::Verify(s) => vec![
                P::pages(
                    "const u8*",
                    "dense",
                    s.order.pages_reach(
                        R::of(s.buffer.page_bytes(s.page_size)).times("layers"),
                        "n_tokens",
                        s.page_size,
                    ),
                ),
                P::ptr("const u64*", "prefix_hash", 8, R::of(8).times("n_tokens")),
                P::u32("n_tokens"),
                P::u32("start_page"),
                P::u32("layers"),
                P::ptr("u32*", "bad_tokens", 4, R::of(4).times_ceil("n_tokens", 32)),
            ],
            KernelSpec::Busy(_) => vec![
                P::ptr("u32*", "out", 4, R::of(4).times("n")),
                P::u32("n"),
                P::u32("rounds"),
                P::u32("seed"),
                P::ptr("u64*", "stamps", 8, R::of(16)),
            ],
        }
    }

    /// Template file (under `templates/`) this spec renders from.
    pub fn template(&self) -> &'static str {
        if let KernelSpec::Busy(BusySpec {
            kind: BusyKind::Hbm,
            ..
        }) = self
        {
            return "busy_hbm.cu";
        }
        match self.family() {
            Family::SelectOwnerPages => "select_owner_pages.cu",
            Family::ReleasePages => "release_pages.cu",
            Family::TransferPages => "transfer_pages.cu",
            Family::Materialise => "materialise.cu",
            Family::Synthesise => "synthesise.cu",
            Family::Verify => "verify.cu",
            Family::Busy => "busy.cu",
        }
    }

    /// Threads per block the kernel is compiled for (`__launch_bounds__`).
    pub fn threads(&self) -> u32 {
        match self {
            KernelSpec::SelectOwnerPages(s) => s.threads,
            KernelSpec::ReleasePages(s) => s.threads,
            KernelSpec::TransferPages(s) => s.launch.threads,
            KernelSpec::Materialise(s) => s.launch.threads,
            KernelSpec::Synthesise(s) => s.threads,
            KernelSpec::Verify(s) => s.threads,
            KernelSpec::Busy(s) => s.threads,
        }
    }

    /// Checks every constant; `render()` calls it first. Errors name the parameter.
    pub fn validate(&self) -> Result<(), KernelError> {
        let fam = self.family();
        let check_cp = |cp: u8| {
            if (1..=16).contains(&cp) {
                Ok(())
            } else {
                Err(KernelError::InvalidCp { family: fam, cp })
            }
        };
        let check_ps = |page_size: u32| {
            if page_size.is_power_of_two() && page_size <= 1024 {
                Ok(())
            } else {
                Err(KernelError::InvalidPageSize {
                    family: fam,
                    page_size,
                })
            }
        };
        let bad = |what, value, reason| KernelError::InvalidLaunch {
            family: fam,
            what,
            value,
            reason,
        };
        let check_block = |threads: u32| {
            if (1..=1024).contains(&threads) {
                Ok(())
            } else {
                Err(bad("threads", threads, "must be in 1..=1024"))
            }
        };
        let check_warp_block = |threads: u32| {
            if threads % 32 == 0 && (32..=1024).contains(&threads) {
                Ok(())
            } else {
                Err(bad(
                    "threads",
                    threads,
                    "warp-cooperative kernels need a multiple of 32 in 32..=1024",
                ))
            }
        };
        let check_fields = |buffer: BufferKind, page_size: u32| {
            buffer
                .check_shape()
                .map_err(|source| KernelError::InvalidShape {
                    family: fam,
                    source,
                })?;
            buffer
                .check_access_alignment(page_size)
                .map_err(|misalignment| KernelError::FieldMisaligned {
                    family: fam,
                    buffer,
                    page_size,
                    misalignment,
                })
        };
        let check_copy = |page_size: u32, bpt: u32, l: &CopyLaunch| {
            check_ps(page_size)?;
            check_block(l.threads)?;
            if bpt == 0 {
                return Err(bad("bytes_per_token", bpt, "must be positive"));
            }
            if !(1..=64).contains(&l.pages_per_block) {
                return Err(bad(
                    "pages_per_block",
                    l.pages_per_block,
                    "must be in 1..=64",
                ));
            }
            if !(1..=16).contains(&l.unroll) {
                return Err(bad("unroll", l.unroll, "must be in 1..=16"));
            }
            if u64::from(l.max_blocks) > MAX_GRID {
                return Err(bad("max_blocks", l.max_blocks, "must be in 0..=65536"));
            }
            let page_bytes = u64::from(bpt) * u64::from(page_size);
            if page_bytes > u64::from(u32::MAX / 2) {
                return Err(bad(
                    "bytes_per_token",
                    bpt,
                    "page bytes must fit in 31 bits",
                ));
            }
            if page_bytes % u64::from(l.vec.bytes()) != 0 {
                return Err(KernelError::VectorMisaligned {
                    family: fam,
                    page_bytes,
                    vec_bytes: l.vec.bytes(),
                });
            }
            Ok(())
        };
        let check_order = |order: TokenOrder, page_size: u32| match order {
            TokenOrder::Paged => Ok(()),
            TokenOrder::Interleaved { cp, run } => {
                check_cp(cp)?;
                if run.is_power_of_two() && run < page_size {
                    Ok(())
                } else {
                    Err(bad(
                        "interleave run",
                        run,
                        "must be a power of two below the page size (a run of a whole page is Paged)",
                    ))
                }
            }
        };
        match self {
            KernelSpec::SelectOwnerPages(s) => {
                check_cp(s.cp)?;
                check_ps(s.page_size)?;
                check_warp_block(s.threads)
            }
            KernelSpec::ReleasePages(s) => {
                check_cp(s.cp)?;
                check_warp_block(s.threads)
            }
            KernelSpec::TransferPages(s) => {
                // A warp (or a smaller block) copies each page item: a partial warp would
                // be a group with another stride.
                let t = s.launch.threads;
                if t > WARP_LANES && t % WARP_LANES != 0 {
                    return Err(bad(
                        "threads",
                        t,
                        "transfers need at most 32 threads or a multiple of 32",
                    ));
                }
                s.descriptors()
                    .iter()
                    .try_for_each(|d| check_copy(d.page_size, d.bytes_per_token, &d.launch))
            }
            KernelSpec::Materialise(s) => {
                check_cp(s.cp)?;
                check_copy(s.page_size, s.bytes_per_token, &s.launch)
            }
            KernelSpec::Synthesise(s) => {
                check_cp(s.cp)?;
                check_ps(s.page_size)?;
                check_block(s.threads)?;
                check_order(s.order, s.page_size)?;
                if let TokenOrder::Interleaved { cp, .. } = s.order {
                    if cp != s.cp {
                        return Err(bad(
                            "order cp",
                            u32::from(cp),
                            "must equal the spec's CP degree",
                        ));
                    }
                }
                check_fields(s.buffer, s.page_size)
            }
            KernelSpec::Verify(s) => {
                check_ps(s.page_size)?;
                check_block(s.threads)?;
                check_order(s.order, s.page_size)?;
                check_fields(s.buffer, s.page_size)
            }
            KernelSpec::Busy(s) => check_block(s.threads),
        }
    }

    /// This spec with each launch configuration worth timing (docs/DESIGN.md §3.6 "Tuning"): same
    /// family and constants, different launch shape; invalid shapes are left out. Always
    /// includes a CPU-friendly shape (1 thread per block for the copy and synthesis
    /// families, one warp for the warp-cooperative allocator families).
    pub fn candidates(&self) -> Vec<KernelSpec> {
        let mut out: Vec<KernelSpec> = match *self {
            KernelSpec::SelectOwnerPages(s) => [32, 128, 256, 512, 1024]
                .into_iter()
                .map(|threads| KernelSpec::SelectOwnerPages(AllocSpec { threads, ..s }))
                .collect(),
            KernelSpec::ReleasePages(s) => [32, 128, 256, 512, 1024]
                .into_iter()
                .map(|threads| KernelSpec::ReleasePages(ReleaseSpec { threads, ..s }))
                .collect(),
            KernelSpec::TransferPages(s) => {
                let pb = s.common_page_bytes();
                CopyLaunch::candidates(pb)
                    .into_iter()
                    .chain(CopyLaunch::capped_candidates(pb))
                    .map(|launch| KernelSpec::TransferPages(TransferSpec { launch, ..s }))
                    .collect()
            }
            KernelSpec::Materialise(s) => {
                let pb = s.page_bytes();
                CopyLaunch::candidates(pb)
                    .into_iter()
                    .map(|launch| KernelSpec::Materialise(MaterialiseSpec { launch, ..s }))
                    .collect()
            }
            KernelSpec::Synthesise(s) => [1, 32, 128, 256]
                .into_iter()
                .map(|threads| KernelSpec::Synthesise(SynthSpec { threads, ..s }))
                .collect(),
            KernelSpec::Verify(s) => [1, 32, 128, 256]
                .into_iter()
                .map(|threads| KernelSpec::Verify(VerifySpec { threads, ..s }))
                .collect(),
            // Not tuned: it only stands in for the model while transfers are timed.
            KernelSpec::Busy(_) => Vec::new(),
        };
        if !out.contains(self) {
            out.push(*self);
        }
        out.retain(|c| c.validate().is_ok());
        out
    }

    /// Layers a layer-wise load of `pairs` page pairs puts in one launch of this transfer:
    /// up to [`MAX_LAYERS_PER_LAUNCH`] when a layer's items fill at most half of a capped
    /// grid's groups, else 1. A layer of a few pages is a few warps on one launch and one
    /// event, its time mostly their fixed cost, and its layer's reader waits no longer for
    /// a few of them together. Uncapped grids, layer loops in the block and other kernels
    /// keep a launch per layer.
    pub fn layers_per_launch(&self, pairs: u32) -> u32 {
        let KernelSpec::TransferPages(s) = self else {
            return 1;
        };
        let l = &s.launch;
        if l.max_blocks == 0 || l.layers_in_block || pairs == 0 {
            return 1;
        }
        let items =
            u64::from(pairs.div_ceil(l.pages_per_block.max(1))) * u64::from(s.buffer_count());
        let groups = u64::from(l.max_blocks) * u64::from(l.groups_per_block());
        (groups / items).clamp(1, u64::from(MAX_LAYERS_PER_LAUNCH)) as u32
    }

    /// Recommended launch for `items` units of work over `layers` layers. The unit is a
    /// request (select), a page (release), a page pair (transfer), a sequence page
    /// (materialise; synthesise: the pages from the one holding `first_token`, or its granule), a token (verify: one block per
    /// [`VerifySpec::item_tokens`] tokens and layer) or an output word (busy: one per thread, `layers` ignored). For a transfer `layers` is the layer count of the launch (its layer range
    /// clamped to the pools, [`clamp_layer_range`](super::clamp_layer_range)), not the
    /// pools' total: a per-layer load is sized for one layer. A transfer gets a group
    /// ([`CopyLaunch::group_lanes`]) per work item, [`CopyLaunch::groups_per_block`] to a
    /// block (a capped transfer grid: a block per item up to the cap, so that few items still
    /// spread over the cap's blocks); materialise a block per work item. Select and release need exactly one block ([`KernelSignature::single_block`]);
    /// every other kernel strides over its work, so any grid is correct, and this one is
    /// never 0 and at most 65536 (verify: 1024; a copy launch with
    /// [`CopyLaunch::max_blocks`]: that many).
    pub fn launch_dims(&self, items: u32, layers: u32) -> LaunchDims {
        let blocks = match self {
            KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => 1,
            KernelSpec::TransferPages(TransferSpec { launch, .. })
            | KernelSpec::Materialise(MaterialiseSpec { launch, .. }) => {
                let layer_items = if launch.layers_in_block { 1 } else { layers };
                // A transfer's work item goes to a group, so a block takes several.
                let (buffers, items_per_block) = match self {
                    KernelSpec::TransferPages(s) => (s.buffer_count(), launch.groups_per_block()),
                    _ => (1, 1),
                };
                let work = u64::from(items).div_ceil(u64::from(launch.pages_per_block.max(1)))
                    * u64::from(layer_items)
                    * u64::from(buffers);
                match launch.max_blocks {
                    0 => work.div_ceil(u64::from(items_per_block)),
                    // A capped grid takes a block per item up to the cap, so a small load
                    // spreads over the cap's SMs: the transfer numbers its groups
                    // block-minor, item i in block i mod grid.
                    cap => work.min(u64::from(cap)),
                }
            }
            KernelSpec::Synthesise(_) => u64::from(items) * u64::from(layers),
            KernelSpec::Verify(s) => (u64::from(items).div_ceil(u64::from(s.item_tokens()))
                * u64::from(layers))
            .min(VERIFY_MAX_BLOCKS),
            KernelSpec::Busy(s) => u64::from(items).div_ceil(u64::from(s.threads.max(1))),
        };
        LaunchDims {
            grid: blocks.clamp(1, MAX_GRID) as u32,
            block: self.threads(),
        }
    }
}

impl fmt::Display for KernelSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.uri())
    }
}

#[cfg(test)]
mod tests;
