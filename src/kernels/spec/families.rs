//! The per-family specs: every compile-time constant and launch-shape choice of one kernel
//! family, and the token order of the families that place tokens.

use std::fmt;

use super::{BufferKind, CopyLaunch, Family, Reach, ReleaseStatus, SelectStatus};

/// What the select kernel writes for each request besides its page.
///
/// Token locations are a pure function of the pages (`page * page_size + offset`), and one
/// block writing `8 × page_size` bytes per page is most of the launch (1 MiB at 2,048 pages of
/// 64), so a consumer that derives them itself (the cache, an engine computing its own
/// `out_cache_loc`) runs the kernel without them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum SelectOutput {
    /// `out_pages` and `out_locs` (`i64[n * page_size]`, page-contiguous token slots).
    #[default]
    PagesAndLocs,
    /// `out_pages` alone: the kernel has no `out_locs` parameter.
    Pages,
}

impl SelectOutput {
    /// Whether the kernel writes `out_locs`.
    pub fn writes_locs(self) -> bool {
        self == SelectOutput::PagesAndLocs
    }

    /// What the output adds to the uri (before the block size, so that the tuning key, the
    /// uri less its launch shape, is a prefix of it): nothing for the kernel that writes
    /// locations (the uri it always had), `_nolocs` for the one that does not.
    pub fn uri_suffix(self) -> &'static str {
        match self {
            SelectOutput::PagesAndLocs => "",
            SelectOutput::Pages => "_nolocs",
        }
    }
}

/// Owner-page selection: one block of `threads` (a multiple of 32) pops pages for a
/// sequence of owners.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocSpec {
    /// CP degree.
    pub cp: u8,
    /// Tokens per page (of the token locations, when the kernel writes them).
    pub page_size: u32,
    /// Threads of the single block.
    pub threads: u32,
    /// Whether the kernel writes token locations besides the pages.
    pub output: SelectOutput,
}

impl AllocSpec {
    /// Words of the kernel's `status` array: [`SelectStatus::words`] at this CP.
    pub fn status_words(&self) -> usize {
        SelectStatus::words(self.cp)
    }
}

/// Lane release: one block of `threads` (a multiple of 32) pushes pages back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReleaseSpec {
    /// CP degree.
    pub cp: u8,
    /// Threads of the single block.
    pub threads: u32,
}

impl ReleaseSpec {
    /// Words of the kernel's `status` array: [`ReleaseStatus::words`] at this CP.
    pub fn status_words(&self) -> usize {
        ReleaseStatus::words(self.cp)
    }
}

/// Direction of a page transfer; the device side always has the device layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum Direction {
    /// Write-back: device pool → host pool.
    #[default]
    DeviceToHost,
    /// Load-back: host pool → device pool.
    HostToDevice,
}

impl fmt::Display for Direction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Direction::DeviceToHost => "d2h",
            Direction::HostToDevice => "h2d",
        })
    }
}

/// Arrangement of a host pool (docs/KERNELS.md "Memory layouts").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum HostLayout {
    /// `[host_page][layer][PAGE_BYTES]`: one contiguous blob per page.
    #[default]
    PageFirst,
    /// `[layer][host_page][PAGE_BYTES]`: like the device pool.
    LayerFirst,
}

impl fmt::Display for HostLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            HostLayout::PageFirst => "pf",
            HostLayout::LayerFirst => "lf",
        })
    }
}

impl HostLayout {
    /// The C expression of the byte offset of `(page, layer)` in a host pool; the names are
    /// the parameters of the rendered `chc_host_off`.
    pub(crate) fn offset_expr(self) -> &'static str {
        match self {
            HostLayout::PageFirst => "((u64)page * layers + layer) * page_bytes",
            HostLayout::LayerFirst => "((u64)layer * host_pages + page) * page_bytes",
        }
    }

    /// Human description for the rendered comment.
    pub(crate) fn describe(self) -> &'static str {
        match self {
            HostLayout::PageFirst => "page-first [host_page][layer][page_bytes]",
            HostLayout::LayerFirst => "layer-first [layer][host_page][page_bytes]",
        }
    }
}

/// Page transfer between device pools and host pools: one buffer kind, or two moved by one
/// launch (NSA's `kv` and `index_k`), each a descriptor of its own pools, since a page move
/// always moves every buffer of the page and a second launch would only add its latency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransferSpec {
    /// Copy direction.
    pub direction: Direction,
    /// Host pool arrangement.
    pub layout: HostLayout,
    /// Tokens per page.
    pub page_size: u32,
    /// Bytes per token of the first buffer kind (parameters `src`, `dst`).
    pub bytes_per_token: u32,
    /// Bytes per token of a second buffer kind the same launch moves for the same page pairs
    /// and layers (parameters `src1`, `dst1`), or `None`.
    pub second_bytes_per_token: Option<u32>,
    /// Launch shape.
    pub launch: CopyLaunch,
    /// Whether the kernel takes a last parameter `u64* stamps` and writes its first block
    /// start, last block end and last block start there by the device's clock: `tune`'s
    /// twin of a transfer, timed beside a busy kernel to show where each ran
    /// (docs/KERNELS.md "busy"). Serving never runs it; the copy is the same.
    pub stamps: bool,
}

impl TransferSpec {
    /// This transfer with `stamps` ([`TransferSpec::stamps`]): the same copy, and where it
    /// ran.
    pub fn stamped(self) -> TransferSpec {
        TransferSpec {
            stamps: true,
            ..self
        }
    }

    /// Bytes of one page of the first buffer kind.
    pub fn page_bytes(&self) -> u64 {
        u64::from(self.page_size) * u64::from(self.bytes_per_token)
    }

    /// Bytes of one page of every buffer the launch moves together.
    pub fn total_page_bytes(&self) -> u64 {
        self.descriptors()
            .iter()
            .map(TransferSpec::page_bytes)
            .sum()
    }

    /// The uri without the launch shape, e.g. `transfer_pages_h2d_pf_ps64_b656_b132`: what
    /// every launch shape of this transfer shares (the tuning key).
    pub fn stem(&self) -> String {
        let second = self
            .second_bytes_per_token
            .map(|b| format!("_b{b}"))
            .unwrap_or_default();
        format!(
            "{}_{}_{}_ps{}_b{}{second}",
            Family::TransferPages,
            self.direction,
            self.layout,
            self.page_size,
            self.bytes_per_token
        )
    }

    /// The kernel's `__launch_bounds__` minimum of resident blocks per SM: 2 for a
    /// one-buffer launch, so a block takes at most half an SM's registers (at 512 threads,
    /// 64 a thread) and a model's blocks fit beside it (docs/KERNELS.md "busy"). Its copy
    /// loop has a constant bound that ptxas unrolls: MLA page 64 at 512 threads took 126
    /// registers, the whole register file, under a minimum of 1. A two-buffer launch keeps
    /// 1: its loop already stays within 64 at 512 threads (NSA: 63), and bounded to 2 its
    /// device → host form spilled.
    pub fn min_blocks(&self) -> u32 {
        if self.second_bytes_per_token.is_some() {
            1
        } else {
            2
        }
    }

    /// How many buffers (descriptors) one launch moves: 1 or 2.
    pub fn buffer_count(&self) -> u32 {
        1 + u32::from(self.second_bytes_per_token.is_some())
    }

    /// Each buffer of the launch as a transfer of its own, in parameter order: what the
    /// references and the DMA path (one set of copy regions per buffer) work on.
    pub fn descriptors(&self) -> Vec<TransferSpec> {
        let one = |bytes_per_token| TransferSpec {
            bytes_per_token,
            second_bytes_per_token: None,
            ..*self
        };
        std::iter::once(one(self.bytes_per_token))
            .chain(self.second_bytes_per_token.map(one))
            .collect()
    }

    /// The largest page size (in bytes) that divides every buffer's page: vector widths must
    /// divide it.
    pub fn common_page_bytes(&self) -> u64 {
        self.descriptors()
            .iter()
            .map(TransferSpec::page_bytes)
            .fold(0, gcd)
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// What a busy kernel keeps busy (docs/KERNELS.md "busy"): the two halves of a model's
/// kernels a transfer competes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BusyKind {
    /// Issue slots and registers: a dependent integer chain in registers per word.
    Alu,
    /// HBM and L2: the same chain, each round read from and written back to its word in
    /// device memory, so a buffer larger than L2 streams through HBM every round.
    Hbm,
}

impl fmt::Display for BusyKind {
    /// `alu`, `hbm`: the uri's spelling.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BusyKind::Alu => "alu",
            BusyKind::Hbm => "hbm",
        })
    }
}

/// The busy kernel: `threads` per block, each thread running `rounds` dependent integer
/// multiply-adds per output word, in registers or through memory as `kind` says
/// (docs/KERNELS.md "busy").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BusySpec {
    /// What it keeps busy.
    pub kind: BusyKind,
    /// Threads per block (1..=1024).
    pub threads: u32,
}

impl BusySpec {
    /// The busy kernel of `kind` at 256 threads per block.
    pub const fn of(kind: BusyKind) -> BusySpec {
        BusySpec { kind, threads: 256 }
    }
}

/// Gather from the CP owner pools into a dense buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct MaterialiseSpec {
    /// CP degree (number of pools, owner arithmetic).
    pub cp: u8,
    /// Tokens per page.
    pub page_size: u32,
    /// Bytes per token of the buffer kind.
    pub bytes_per_token: u32,
    /// Launch shape.
    pub launch: CopyLaunch,
}

/// Threads an sm_90 SM holds at once.
pub const SM_MAX_THREADS: u32 = 2048;

/// Blocks an sm_90 SM holds at once.
pub const SM_MAX_BLOCKS: u32 = 32;

impl MaterialiseSpec {
    /// Bytes of one page of the buffer kind.
    pub fn page_bytes(&self) -> u64 {
        u64::from(self.page_size) * u64::from(self.bytes_per_token)
    }

    /// The blocks per SM materialise asks ptxas to fit (`__launch_bounds__`' second
    /// argument). Materialise runs the full grid on HBM, where occupancy is bytes in flight:
    /// the default `t128_ppb1_v16_u4` took 40 registers, 12 blocks per SM (75 %); asked for a
    /// full SM it takes 32 with no spill, 16 blocks (100 %). A shape with more than 64 bytes
    /// in flight per thread (`u8` of `uint4`) needs its registers: asked for a full SM it
    /// spilled 392 bytes, so it gets 1 (no bound beyond the block size). BENCHMARKS.md
    /// "Registers".
    pub fn min_blocks_per_sm(&self) -> u32 {
        if u64::from(self.launch.unroll) * u64::from(self.launch.vec.bytes()) > 64 {
            return 1;
        }
        let full = (SM_MAX_THREADS / self.launch.threads.max(1)).clamp(1, SM_MAX_BLOCKS);
        // With the layer loop in the block, a page's owner table row and offset stay live
        // across its layers: at a full SM's 32 registers the `_lb` shapes spilled 80 bytes
        // (sm_90, NVRTC), so they ask for half the blocks.
        if self.launch.layers_in_block {
            (full / 2).max(1)
        } else {
            full
        }
    }
}

/// How a sequence's tokens fill its pages, for the kernels that place tokens (synthesise,
/// verify; docs/KERNELS.md "Layouts"). Copies move whole pages and do not care.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub enum TokenOrder {
    /// Sequence page `i` holds tokens `i * page_size ..` (zigzag, round-robin and
    /// page-interleave).
    #[default]
    Paged,
    /// Token-interleave: granules of `cp` pages (one per rank); in granule `g`, token run
    /// `k` (`run` tokens) goes to the page of rank `k % cp`, after that page's earlier runs.
    Interleaved {
        /// Pages per granule (the CP degree).
        cp: u8,
        /// Tokens per run: a power of two below the page size.
        run: u32,
    },
}

impl TokenOrder {
    /// The suffix the order adds to a kernel's uri: nothing for pages of consecutive tokens.
    pub(super) fn uri_suffix(self) -> String {
        match self {
            TokenOrder::Paged => String::new(),
            TokenOrder::Interleaved { cp, run } => format!("_cp{cp}ti{run}"),
        }
    }

    /// `base` (bytes per sequence page) times the sequence pages the first `n` tokens span
    /// (`n` being a parameter name): whole granules when interleaved.
    pub(super) fn pages_reach(self, base: Reach, n: &'static str, page_size: u32) -> Reach {
        match self {
            TokenOrder::Paged => base.times_ceil(n, page_size),
            TokenOrder::Interleaved { cp, .. } => Reach {
                unit: base.unit * u64::from(cp),
                ..base
            }
            .times_ceil(n, page_size * u32::from(cp)),
        }
    }
}

/// Synthesis of one buffer kind into a rank's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SynthSpec {
    /// Buffer kind (fields and arrangement).
    pub buffer: BufferKind,
    /// CP degree (owner arithmetic).
    pub cp: u8,
    /// Tokens per page.
    pub page_size: u32,
    /// Threads per block (1..=1024).
    pub threads: u32,
    /// Where each token sits (an interleaved order's `cp` is this spec's).
    pub order: TokenOrder,
}

/// Verification of a dense buffer of one buffer kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct VerifySpec {
    /// Buffer kind (fields and arrangement).
    pub buffer: BufferKind,
    /// Tokens per page.
    pub page_size: u32,
    /// Threads per block (1..=1024).
    pub threads: u32,
    /// Where each token sits in the dense buffer's pages.
    pub order: TokenOrder,
}

impl VerifySpec {
    /// Tokens of one verify work item (a work item is a run of these tokens in one layer):
    /// `max(64, threads)`, so that every field, even one of a single draw per token, has a
    /// (token, draw) pair for every thread, and a draw key mixed once serves many tokens
    /// even at one thread per block (docs/KERNELS.md "verify").
    pub fn item_tokens(&self) -> u32 {
        self.threads.max(64)
    }
}
