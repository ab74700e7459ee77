//! `KernelSpec`: one kernel family plus every compile-time constant and launch-shape choice
//! that changes its source. The spec names itself (`uri()`), validates itself, and lists its
//! tuning candidates; rendering lives in `render.rs`.

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

/// Element type of a synthesised field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dtype {
    /// fp8 e4m3 (1 byte).
    Fp8E4m3,
    /// IEEE f32 (4 bytes), used for scales.
    F32,
    /// bfloat16 (2 bytes).
    Bf16,
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dtype::Fp8E4m3 => "fp8_e4m3",
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
        })
    }
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> u32 {
        match self {
            Dtype::Fp8E4m3 => 1,
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }

    /// Elements synthesised from one 64-bit draw: element `e` takes lane `e % per_draw` (of
    /// `64 / per_draw` bits, low lane first) of draw `e / per_draw`. One draw per element
    /// made the synthesis and the check of every token most of a CPU replay's time; each
    /// encoder uses at most its lane's bits (fp8 8, bf16 16, f32 23 of 32).
    pub fn per_draw(self) -> u32 {
        8 / self.size()
    }

    /// The rendered packer (templates/synth_common.cu): the draw word with each of its
    /// `per_draw` lanes encoded, so its little-endian bytes are the elements' bytes.
    pub(crate) fn packer(self) -> &'static str {
        match self {
            Dtype::Fp8E4m3 => "chc_pack_fp8",
            Dtype::F32 => "chc_pack_f32",
            Dtype::Bf16 => "chc_pack_bf16",
        }
    }
}

/// How a buffer's per-token fields are arranged inside one page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Arrangement {
    /// All fields of token 0, then of token 1, ….
    TokenMajor,
    /// Field 0 of every token, then field 1 of every token, ….
    PageOrganised,
}

/// A KV buffer kind of a model (docs/KERNELS.md "Buffer kinds").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BufferKind {
    /// NSA latent KV: 512 fp8 + 4 f32 scales + 64 bf16 RoPE per token, token-major.
    NsaKv,
    /// NSA indexer keys: 128 fp8 per token then 1 f32 scale per token, page-organised.
    NsaIndexK,
    /// Plain MLA KV: 576 bf16 per token, token-major.
    MlaKv,
}

impl fmt::Display for BufferKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BufferKind::NsaKv => "nsa_kv",
            BufferKind::NsaIndexK => "nsa_idx",
            BufferKind::MlaKv => "mla_kv",
        })
    }
}

/// Where the elements of one field live inside a page: element `e` of the token in slot
/// `j` starts at byte `base + j * tok_stride + e * dtype.size()`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FieldLayout {
    /// Field index `f` in the synthesis hash.
    pub id: u32,
    /// Element type.
    pub dtype: Dtype,
    /// Elements per token.
    pub count: u32,
    /// Byte offset of slot 0, element 0.
    pub base: u32,
    /// Bytes between consecutive token slots.
    pub tok_stride: u32,
}

impl FieldLayout {
    /// Byte offset of element `e` of the token in page slot `slot`.
    pub fn offset(&self, slot: u32, e: u32) -> usize {
        self.base as usize
            + slot as usize * self.tok_stride as usize
            + (e * self.dtype.size()) as usize
    }

    /// Draws per token: `ceil(count / per_draw)` (docs/KERNELS.md "Synthesised KV").
    pub fn draws(&self) -> u32 {
        self.count.div_ceil(self.dtype.per_draw())
    }

    /// Draws whose `per_draw` elements all exist. Their encoded elements fill all 8 bytes
    /// of the draw word, so the synthesise and verify kernels store or compare each as one
    /// `u64` (element `e` of the draw in its bytes `e * size ..`, little-endian).
    pub fn full_draws(&self) -> u32 {
        self.count / self.dtype.per_draw()
    }

    /// The accesses that cover the last, partial draw when `count` is not a multiple of
    /// `per_draw` (empty otherwise): `(byte offset in the draw, width)`, widest first
    /// (4, 2, 1), each taking the draw word's bytes at that offset. The kernels never touch a
    /// byte past the field's last element, so a partial draw cannot be one 8-byte store
    /// (nsa `index_k`'s single f32 scale per token is half a draw).
    pub fn tail_accesses(&self) -> Vec<(u32, u32)> {
        let mut left = (self.count % self.dtype.per_draw()) * self.dtype.size();
        let mut off = 0;
        let mut out = Vec::new();
        for width in [4, 2, 1] {
            if left >= width {
                out.push((off, width));
                off += width;
                left -= width;
            }
        }
        out
    }

    /// Checks that every access of the synthesise and verify kernels to this field is
    /// aligned to its width (a GPU faults on a misaligned access that the CPU runs without
    /// complaint), in every slot of every page of `page_bytes` bytes. Buffers start 16-byte
    /// aligned ([`KernelParam::align`]) and pages follow each other, so the page size, the
    /// token stride and the access's offset in slot 0 must all be multiples of the width:
    /// 8 for the full draws, the width of each access of a partial last draw.
    pub fn check_access_alignment(&self, page_bytes: u64) -> Result<(), FieldMisalignment> {
        let full = (self.full_draws() > 0).then_some((0u32, 8u32));
        let tail_start = self.full_draws() * 8;
        let tail = self
            .tail_accesses()
            .into_iter()
            .map(|(off, width)| (tail_start + off, width));
        for (off, width) in full.into_iter().chain(tail) {
            let at = u64::from(self.base) + u64::from(off);
            let checks = [
                ("page bytes", page_bytes),
                ("token stride", u64::from(self.tok_stride)),
                ("offset in the page", at),
            ];
            if let Some(&(what, value)) = checks.iter().find(|(_, v)| v % u64::from(width) != 0) {
                return Err(FieldMisalignment {
                    field: self.id,
                    width,
                    what,
                    value,
                });
            }
        }
        Ok(())
    }
}

/// Why an access of the synthesise or verify kernels to a field would be misaligned
/// ([`FieldLayout::check_access_alignment`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldMisalignment {
    /// The field index.
    pub field: u32,
    /// Bytes of the access (8 for a full draw).
    pub width: u32,
    /// Which quantity is not a multiple of the width: `page bytes`, `token stride` or
    /// `offset in the page`.
    pub what: &'static str,
    /// Its value.
    pub value: u64,
}

impl BufferKind {
    /// The buffer index `b` of the synthesis hash.
    pub fn id(self) -> u32 {
        match self {
            BufferKind::NsaKv | BufferKind::MlaKv => 0,
            BufferKind::NsaIndexK => 1,
        }
    }

    /// The per-token fields, in order.
    pub fn fields(self) -> &'static [(Dtype, u32)] {
        match self {
            BufferKind::NsaKv => &[(Dtype::Fp8E4m3, 512), (Dtype::F32, 4), (Dtype::Bf16, 64)],
            BufferKind::NsaIndexK => &[(Dtype::Fp8E4m3, 128), (Dtype::F32, 1)],
            BufferKind::MlaKv => &[(Dtype::Bf16, 576)],
        }
    }

    /// Field arrangement inside a page.
    pub fn arrangement(self) -> Arrangement {
        match self {
            BufferKind::NsaKv | BufferKind::MlaKv => Arrangement::TokenMajor,
            BufferKind::NsaIndexK => Arrangement::PageOrganised,
        }
    }

    /// Bytes per token (656, 132, 1152).
    pub fn bytes_per_token(self) -> u32 {
        self.fields().iter().map(|(d, c)| d.size() * c).sum()
    }

    /// Bytes of one page of `page_size` tokens.
    pub fn page_bytes(self, page_size: u32) -> u64 {
        u64::from(self.bytes_per_token()) * u64::from(page_size)
    }

    /// Checks [`FieldLayout::check_access_alignment`] for every field at `page_size`. Every
    /// buffer kind passes at every page size the kernels accept, except nsa `index_k` at page
    /// size 1 (132-byte pages: every other page starts 4 bytes off an 8-byte boundary).
    pub fn check_access_alignment(self, page_size: u32) -> Result<(), FieldMisalignment> {
        let page_bytes = self.page_bytes(page_size);
        self.field_layouts(page_size)
            .iter()
            .try_for_each(|f| f.check_access_alignment(page_bytes))
    }

    /// Byte placement of every field in a page of `page_size` tokens.
    pub fn field_layouts(self, page_size: u32) -> Vec<FieldLayout> {
        let bpt = self.bytes_per_token();
        let mut before = 0u32;
        self.fields()
            .iter()
            .enumerate()
            .map(|(id, &(dtype, count))| {
                let field_bytes = dtype.size() * count;
                let (base, tok_stride) = match self.arrangement() {
                    Arrangement::TokenMajor => (before, bpt),
                    Arrangement::PageOrganised => (before.saturating_mul(page_size), field_bytes),
                };
                before += field_bytes;
                FieldLayout {
                    id: id as u32,
                    dtype,
                    count,
                    base,
                    tok_stride,
                }
            })
            .collect()
    }
}

/// Launch shape of the page-copy families (transfer, materialise).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CopyLaunch {
    /// Threads per block (1..=1024).
    pub threads: u32,
    /// Pages each work item copies (1..=64).
    pub pages_per_block: u32,
    /// Access width.
    pub vec: VecWidth,
    /// Accesses in flight per thread (1..=16).
    pub unroll: u32,
    /// Where the layer loop runs. `false`: in the grid, each (page group, layer) is a work
    /// item of its own. `true`: in the block, each work item copies its pages for every
    /// layer, page by page, so a page-first host page is walked contiguously and the grid
    /// has `layers` times fewer items. (A loop outside the kernel, one launch per layer, is
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

/// Vectors in flight per thread of the GPU default transfer grid.
pub const GPU_TRANSFER_UNROLL: u32 = 8;

/// The capped grid sizes the tuner times for transfers ([`CopyLaunch::capped_candidates`]).
pub const TRANSFER_GRID_CAPS: [u32; 5] = [1, 2, 4, 8, 16];

impl CopyLaunch {
    /// The default launch of host↔device transfers: [`GPU_TRANSFER_BLOCKS`] blocks of
    /// [`GPU_TRANSFER_THREADS`] threads, 16-byte accesses, [`GPU_TRANSFER_UNROLL`] in flight
    /// per thread. 4 × 512 × 8 × 16 B = 256 KiB in flight, twice what a PCIe Gen5 x16 link
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

    /// The capped-grid transfer shapes worth timing for a page of `page_bytes`: 256 and 512
    /// threads, 8 vectors in flight each, at each of [`TRANSFER_GRID_CAPS`] blocks (the tuner keeps the fewest blocks
    /// that hold the bandwidth while a compute kernel runs beside).
    pub fn capped_candidates(page_bytes: u64) -> Vec<CopyLaunch> {
        let vec = VecWidth::widest_for(page_bytes);
        let mut out = Vec::new();
        for threads in [256, 512] {
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

/// Owner-page selection: one block of `threads` (a multiple of 32) pops pages for a
/// sequence of owners.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AllocSpec {
    /// CP degree.
    pub cp: u8,
    /// Tokens per page (the kernel also writes token locations).
    pub page_size: u32,
    /// Threads of the single block.
    pub threads: u32,
}

impl AllocSpec {
    /// Words of the kernel's `status` array: [`SelectStatus::words`] at this CP.
    pub fn status_words(&self) -> usize {
        SelectStatus::words(self.cp)
    }
}

/// The select kernel's status words, `u32 status[CP + 2]` in device memory
/// (docs/KERNELS.md "select_owner_pages"): what every launch that came up short added up since
/// the host last cleared them. A launch is refused, all or nothing, when a lane holds fewer
/// pages than it was asked for or an owner is not below CP; it then changes no lane top and
/// writes page 0 for every request. The counts saturate at `u32::MAX`.
///
/// | word | meaning |
/// | --- | --- |
/// | `0` | launches refused |
/// | `1 + o`, `o < CP` | pages lane `o` lacked, summed over those launches |
/// | `CP + 1` | requests naming an owner `>= CP`, summed over those launches |
///
/// All zero means no launch was refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct SelectStatus {
    /// Launches refused (word 0).
    pub refused: u32,
    /// Pages each lane lacked, summed over the refused launches (words `1..=CP`).
    pub lane_deficits: Vec<u32>,
    /// Requests whose owner was not below CP, summed over the refused launches (word `CP + 1`).
    pub bad_owners: u32,
}

impl SelectStatus {
    /// Words of the array at CP `cp`: `cp + 2`.
    pub const fn words(cp: u8) -> usize {
        cp as usize + 2
    }

    /// A clear status (no launch refused) at CP `cp`.
    pub fn clear(cp: u8) -> SelectStatus {
        SelectStatus {
            refused: 0,
            lane_deficits: vec![0; usize::from(cp)],
            bad_owners: 0,
        }
    }

    /// Decodes the words of a kernel's status array (`cp + 2` of them, so at least 2);
    /// `None` for fewer than 2.
    pub fn from_words(words: &[u32]) -> Option<SelectStatus> {
        let (&refused, rest) = words.split_first()?;
        let (&bad_owners, lanes) = rest.split_last()?;
        Some(SelectStatus {
            refused,
            lane_deficits: lanes.to_vec(),
            bad_owners,
        })
    }

    /// The words as the kernel lays them out.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.lane_deficits.len() + 2);
        w.push(self.refused);
        w.extend_from_slice(&self.lane_deficits);
        w.push(self.bad_owners);
        w
    }

    /// Whether no launch was refused (every word zero).
    pub fn is_clear(&self) -> bool {
        self.refused == 0 && self.bad_owners == 0 && self.lane_deficits.iter().all(|&d| d == 0)
    }

    /// `(lane, pages it lacked)` for every lane that came up short.
    pub fn short_lanes(&self) -> Vec<(u8, u32)> {
        self.lane_deficits
            .iter()
            .enumerate()
            .filter(|&(_, &d)| d > 0)
            .map(|(o, &d)| (o as u8, d))
            .collect()
    }
}

impl fmt::Display for SelectStatus {
    /// `2 select launches refused: lane 0 short by 3 pages, lane 2 short by 1 page, 1 owner
    /// out of range`, or `no select launch refused`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clear() {
            return f.write_str("no select launch refused");
        }
        write!(
            f,
            "{} select {} refused",
            self.refused,
            plural(self.refused, "launch", "launches")
        )?;
        let mut what: Vec<String> = self
            .short_lanes()
            .into_iter()
            .map(|(o, d)| format!("lane {o} short by {d} {}", plural(d, "page", "pages")))
            .collect();
        if self.bad_owners > 0 {
            what.push(format!(
                "{} {} out of range",
                self.bad_owners,
                plural(self.bad_owners, "owner", "owners")
            ));
        }
        if !what.is_empty() {
            write!(f, ": {}", what.join(", "))?;
        }
        Ok(())
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

/// The release kernel's status words, `u32 status[CP + 2]` in device memory
/// (docs/KERNELS.md "release_pages"), laid out like [`SelectStatus`]: what every refused
/// release launch added up since the host last cleared them. A launch is refused, all or
/// nothing, when a lane would hold more than `lane_cap` pages or a page is invalid (page 0,
/// or a local index `page / CP >= lane_cap` that no lane of `lane_cap` slots owns); it then
/// changes no lane top and no stack slot, so a drift between the host mirror and the device
/// (a double free, a launch on the lanes behind the allocator's back) cannot overflow a lane
/// or lose pages silently. The counts saturate at `u32::MAX`.
///
/// | word | meaning |
/// | --- | --- |
/// | `0` | launches refused |
/// | `1 + o`, `o < CP` | pages lane `o` had no room for, summed over those launches |
/// | `CP + 1` | invalid pages, summed over those launches |
///
/// All zero means no launch was refused.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct ReleaseStatus {
    /// Launches refused (word 0).
    pub refused: u32,
    /// Pages each lane had no room for, summed over the refused launches (words `1..=CP`).
    pub lane_overflows: Vec<u32>,
    /// Invalid pages (0, or a local index past `lane_cap`), summed over the refused launches
    /// (word `CP + 1`).
    pub bad_pages: u32,
}

impl ReleaseStatus {
    /// Words of the array at CP `cp`: `cp + 2`.
    pub const fn words(cp: u8) -> usize {
        cp as usize + 2
    }

    /// A clear status (no launch refused) at CP `cp`.
    pub fn clear(cp: u8) -> ReleaseStatus {
        ReleaseStatus {
            refused: 0,
            lane_overflows: vec![0; usize::from(cp)],
            bad_pages: 0,
        }
    }

    /// Decodes the words of a kernel's status array (`cp + 2` of them, so at least 2);
    /// `None` for fewer than 2.
    pub fn from_words(words: &[u32]) -> Option<ReleaseStatus> {
        let (&refused, rest) = words.split_first()?;
        let (&bad_pages, lanes) = rest.split_last()?;
        Some(ReleaseStatus {
            refused,
            lane_overflows: lanes.to_vec(),
            bad_pages,
        })
    }

    /// The words as the kernel lays them out.
    pub fn to_words(&self) -> Vec<u32> {
        let mut w = Vec::with_capacity(self.lane_overflows.len() + 2);
        w.push(self.refused);
        w.extend_from_slice(&self.lane_overflows);
        w.push(self.bad_pages);
        w
    }

    /// Whether no launch was refused (every word zero).
    pub fn is_clear(&self) -> bool {
        self.refused == 0 && self.bad_pages == 0 && self.lane_overflows.iter().all(|&d| d == 0)
    }

    /// `(lane, pages it had no room for)` for every lane that would have overflowed.
    pub fn full_lanes(&self) -> Vec<(u8, u32)> {
        self.lane_overflows
            .iter()
            .enumerate()
            .filter(|&(_, &d)| d > 0)
            .map(|(o, &d)| (o as u8, d))
            .collect()
    }
}

impl fmt::Display for ReleaseStatus {
    /// `2 release launches refused: lane 0 over its capacity by 3 pages, lane 2 over its
    /// capacity by 1 page, 1 invalid page (0, or past the lanes)`, or `no release launch
    /// refused`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_clear() {
            return f.write_str("no release launch refused");
        }
        write!(
            f,
            "{} release {} refused",
            self.refused,
            plural(self.refused, "launch", "launches")
        )?;
        let mut what: Vec<String> = self
            .full_lanes()
            .into_iter()
            .map(|(o, d)| {
                format!(
                    "lane {o} over its capacity by {d} {}",
                    plural(d, "page", "pages")
                )
            })
            .collect();
        if self.bad_pages > 0 {
            what.push(format!(
                "{} invalid {} (0, or past the lanes)",
                self.bad_pages,
                plural(self.bad_pages, "page", "pages")
            ));
        }
        if !what.is_empty() {
            write!(f, ": {}", what.join(", "))?;
        }
        Ok(())
    }
}

/// `one` for a count of 1, else `many`.
fn plural(n: u32, one: &'static str, many: &'static str) -> &'static str {
    if n == 1 {
        one
    } else {
        many
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
}

impl TransferSpec {
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

/// The busy kernel: `threads` per block, each thread running `rounds` dependent integer
/// multiply-adds per output word (docs/KERNELS.md "busy").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BusySpec {
    /// Threads per block (1..=1024).
    pub threads: u32,
}

impl Default for BusySpec {
    fn default() -> Self {
        BusySpec { threads: 256 }
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
        (SM_MAX_THREADS / self.launch.threads.max(1)).clamp(1, SM_MAX_BLOCKS)
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
    fn uri_suffix(self) -> String {
        match self {
            TokenOrder::Paged => String::new(),
            TokenOrder::Interleaved { cp, run } => format!("_cp{cp}ti{run}"),
        }
    }

    /// `base` (bytes per sequence page) times the sequence pages the first `n` tokens span
    /// (`n` being a parameter name): whole granules when interleaved.
    fn pages_reach(self, base: Reach, n: &'static str, page_size: u32) -> Reach {
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

/// One parameter of a kernel's `extern "C"` signature (docs/KERNELS.md "Kernels").
///
/// [`KernelSpec::params`] is the single source of truth for a rendered kernel's parameter
/// list: the render spells it from these values, and executors check every launch's arguments
/// against the sizes, because `cuLaunchKernel` cannot tell a wrong argument list from a right
/// one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelParam {
    /// The C parameter name, as the kernel body uses it.
    pub name: &'static str,
    /// The C type, spelled as in the render (`const u8*`, `u32`,
    /// `const __grid_constant__ ChcPools`).
    pub c_type: &'static str,
    /// Bytes the launch passes for it: 8 for a pointer, 8 × CP for the pool struct.
    pub size: usize,
    /// For a pointer (or each pointer of the pool struct): the byte alignment the kernel
    /// needs at it. Page buffers take 16-byte vector accesses, typed arrays their element
    /// size. A GPU faults on a misaligned access the CPU emulator runs without complaint, so
    /// both executors check it. 1 for scalars.
    pub align: u64,
    /// For a pointer (or each pointer of the pool struct): how far the kernel reaches through
    /// it, from the launch's scalar arguments. `None` for scalars.
    pub reach: Option<Reach>,
}

/// How many bytes from a pointer argument a kernel may read or write: `unit` times the
/// product of `ceil(arg / per)` over `counts`, where each count is a `u32` parameter of the
/// same launch (`4 × n`, `PAGE_BYTES × layers × local_pages`, ...).
///
/// The kernels bound every index by these arguments and nothing else (page ids read from
/// memory are checked against the pool sizes passed in, docs/KERNELS.md), so when each
/// pointer's buffer holds its reach, a launch stays inside its buffers whatever the values.
/// Both executors check exactly that before a launch, which is what makes
/// [`Executor::launch`](crate::exec::Executor::launch) safe for kernels loaded with a
/// signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reach {
    /// Bytes per unit of the counts (the element size, or a page's bytes).
    pub unit: u64,
    /// Up to two scalar parameters the reach scales with, each as `(name, per)`: the count is
    /// `ceil(value / per)` (`per` = 1 for a plain count).
    pub counts: [Option<(&'static str, u32)>; 2],
}

impl Reach {
    /// A fixed number of bytes (the counts are multiplied in with [`Reach::times`]).
    const fn of(unit: u64) -> Reach {
        Reach {
            unit,
            counts: [None, None],
        }
    }

    /// The reach times `ceil(name / per)`, in the first free count slot.
    const fn times_ceil(mut self, name: &'static str, per: u32) -> Reach {
        if self.counts[0].is_none() {
            self.counts[0] = Some((name, per));
        } else {
            assert!(self.counts[1].is_none(), "a reach has two counts at most");
            self.counts[1] = Some((name, per));
        }
        self
    }

    /// The reach times `name`.
    const fn times(self, name: &'static str) -> Reach {
        self.times_ceil(name, 1)
    }

    /// The reach in bytes, given each count parameter's value.
    pub fn bytes(&self, value: impl Fn(&str) -> Option<u32>) -> Result<u64, ReachError> {
        let mut bytes = self.unit;
        for &(name, per) in self.counts.iter().flatten() {
            let v = value(name).ok_or(ReachError::NoValue(name))?;
            let count = u64::from(v).div_ceil(u64::from(per.max(1)));
            bytes = bytes.checked_mul(count).ok_or(ReachError::Overflow)?;
        }
        Ok(bytes)
    }
}

/// Why a [`Reach`] has no size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReachError {
    /// The launch has no `u32` value for this count parameter.
    #[error("has no u32 argument for `{0}`")]
    NoValue(&'static str),
    /// The product overflows 64 bits.
    #[error("overflows 64 bits for these arguments")]
    Overflow,
}

impl fmt::Display for Reach {
    /// `4 × n`, `656 × layers × local_pages`, `4 × ceil(n_tokens / 32)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.unit)?;
        for &(name, per) in self.counts.iter().flatten() {
            if per > 1 {
                write!(f, " × ceil({name} / {per})")?;
            } else {
                write!(f, " × {name}")?;
            }
        }
        Ok(())
    }
}

/// What every launch of a rendered kernel must match, checked by both executors before
/// anything runs (a GPU would run a wrong launch and give wrong results, not an error).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KernelSignature {
    /// The `extern "C"` parameters in order ([`KernelSpec::params`]).
    pub params: Vec<KernelParam>,
    /// Threads per block, in x only: the kernels stride by their compiled `THREADS`, never
    /// by `blockDim`, so fewer threads would skip work (verify would pass unchecked tokens)
    /// and more would exceed `__launch_bounds__`.
    pub threads: u32,
    /// Whether the grid must be exactly one block: select and release read and write the
    /// lane tops from one block, and a second block would hand out or push pages twice.
    pub single_block: bool,
}

/// Alignment of page buffers: the copy kernels move pages in 16-byte vectors.
const PAGE_ALIGN: u64 = 16;

impl KernelParam {
    /// Whether the kernel writes through this pointer (a pointer type without `const`); the
    /// pool struct's pointers are read only.
    pub fn writes(&self) -> bool {
        self.reach.is_some() && !self.c_type.starts_with("const ")
    }

    /// A pointer to a typed array (8 bytes on every supported target) whose elements are
    /// `align` bytes, reaching `reach` bytes.
    const fn ptr(
        c_type: &'static str,
        name: &'static str,
        align: u64,
        reach: Reach,
    ) -> KernelParam {
        KernelParam {
            name,
            c_type,
            size: 8,
            align,
            reach: Some(reach),
        }
    }

    /// A pointer to page-organised bytes (a pool, a host pool or a dense buffer).
    const fn pages(c_type: &'static str, name: &'static str, reach: Reach) -> KernelParam {
        KernelParam::ptr(c_type, name, PAGE_ALIGN, reach)
    }

    /// A `u32` parameter.
    const fn u32(name: &'static str) -> KernelParam {
        KernelParam {
            name,
            c_type: "u32",
            size: 4,
            align: 1,
            reach: None,
        }
    }

    /// The `ChcPools` struct of `cp` device pointers to pools, passed by value; each pool
    /// reaches `reach` bytes.
    const fn pools(cp: u8, reach: Reach) -> KernelParam {
        KernelParam {
            name: "pools",
            c_type: "const __grid_constant__ ChcPools",
            size: 8 * cp as usize,
            align: PAGE_ALIGN,
            reach: Some(reach),
        }
    }
}

/// Widest line of a rendered parameter list; the wrap reproduces the hand-wrapped lists the
/// templates had before the lists came from [`KernelSpec::params`], so renders did not change.
const PARAM_LINE_WIDTH: usize = 96;

/// The parameter list as the templates splice it in after `<uri>(`: `type name` items joined
/// by `, `, wrapped greedily at [`PARAM_LINE_WIDTH`] columns with a 4-space indent, closed by
/// `)`. Pointer parameters are `__restrict__`: the executors refuse a launch in which a
/// written pointer shares bytes with another pointer parameter (`exec::signature`), so no
/// two pointers a kernel writes through alias, and the compiler may keep loads in flight
/// across stores.
pub(crate) fn render_params(params: &[KernelParam]) -> String {
    const INDENT: &str = "    ";
    let mut out = String::new();
    let mut line = String::from(INDENT);
    for (i, p) in params.iter().enumerate() {
        let end = if i + 1 == params.len() { ")" } else { "," };
        let restrict = if p.c_type.ends_with('*') {
            " __restrict__"
        } else {
            ""
        };
        let item = format!("{}{restrict} {}{end}", p.c_type, p.name);
        let sep = if line.len() == INDENT.len() { "" } else { " " };
        if line.len() > INDENT.len() && line.len() + sep.len() + item.len() > PARAM_LINE_WIDTH {
            out.push_str(&line);
            out.push('\n');
            line = format!("{INDENT}{item}");
        } else {
            line.push_str(sep);
            line.push_str(&item);
        }
    }
    if params.is_empty() {
        line.push(')');
    }
    out.push_str(&line);
    out
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

/// A 1-D launch: `grid` blocks of `block` threads, no dynamic shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchDims {
    /// Blocks (gridDim.x).
    pub grid: u32,
    /// Threads per block (blockDim.x).
    pub block: u32,
}

/// Cap on the recommended grid: the kernels stride over their work, so more blocks than this
/// add nothing.
const MAX_GRID: u64 = 1 << 16;

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

    /// Readable unique name spelling every parameter, e.g.
    /// `transfer_pages_h2d_pf_ps64_b656_t128_ppb1_v16_u4`. It is also the entry name.
    pub fn uri(&self) -> String {
        let fam = self.family();
        match self {
            KernelSpec::SelectOwnerPages(s) => {
                format!("{fam}_cp{}_ps{}_t{}", s.cp, s.page_size, s.threads)
            }
            KernelSpec::ReleasePages(s) => format!("{fam}_cp{}_t{}", s.cp, s.threads),
            KernelSpec::TransferPages(s) => format!("{}_{}", s.stem(), s.launch),
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
            KernelSpec::Busy(s) => format!("{fam}_t{}", s.threads),
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
            KernelSpec::SelectOwnerPages(s) => vec![
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
                P::ptr(
                    "i64*",
                    "out_locs",
                    8,
                    R::of(8 * u64::from(s.page_size)).times("n"),
                ),
                P::ptr("u32*", "status", 4, R::of(4 * s.status_words() as u64)),
            ],
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
                let reach = |pb: u64| {
                    let device = R::of(pb).times("layers").times("device_pages");
                    let host = R::of(pb).times("layers").times("host_pages");
                    match s.direction {
                        Direction::DeviceToHost => (device, host),
                        Direction::HostToDevice => (host, device),
                    }
                };
                let (src, dst) = reach(s.page_bytes());
                let mut params = vec![
                    P::pages("const u8*", "src", src),
                    P::pages("u8*", "dst", dst),
                    P::ptr("const u32*", "src_pages", 4, R::of(4).times("n")),
                    P::ptr("const u32*", "dst_pages", 4, R::of(4).times("n")),
                    P::u32("n"),
                    P::u32("layers"),
                    P::u32("first_layer"),
                    P::u32("layer_count"),
                    P::u32("device_pages"),
                    P::u32("host_pages"),
                ];
                // The second buffer's pools come last, so a one-buffer launch's arguments
                // are a prefix of a two-buffer one's.
                if let Some(second) = s.descriptors().get(1) {
                    let (src1, dst1) = reach(second.page_bytes());
                    params.push(P::pages("const u8*", "src1", src1));
                    params.push(P::pages("u8*", "dst1", dst1));
                }
                params
            }
            KernelSpec::Materialise(s) => {
                let pb = s.page_bytes();
                vec![
                    P::pools(s.cp, R::of(pb).times("layers").times("local_pages")),
                    P::ptr("const u32*", "seq_pages", 4, R::of(4).times("n")),
                    P::u32("n"),
                    P::u32("layers"),
                    P::u32("local_pages"),
                    P::pages("u8*", "dense", R::of(pb).times("layers").times("n")),
                ]
            }
            KernelSpec::Synthesise(s) => vec![
                P::pages(
                    "u8*",
                    "pool",
                    R::of(s.buffer.page_bytes(s.page_size))
                        .times("layers")
                        .times("local_pages"),
                ),
                P::ptr("const u64*", "prefix_hash", 8, R::of(8).times("n_tokens")),
                P::ptr(
                    "const u32*",
                    "seq_pages",
                    4,
                    s.order.pages_reach(R::of(4), "n_tokens", s.page_size),
                ),
                P::u32("n_tokens"),
                P::u32("start_page"),
                P::u32("rank"),
                P::u32("layers"),
                P::u32("local_pages"),
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
            ],
        }
    }

    /// Template file (under `templates/`) this spec renders from.
    pub fn template(&self) -> &'static str {
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
            KernelSpec::TransferPages(s) => s
                .descriptors()
                .iter()
                .try_for_each(|d| check_copy(d.page_size, d.bytes_per_token, &d.launch)),
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

    /// Renders the self-contained CUDA C source (docs/KERNELS.md), validating first.
    pub fn render(&self) -> Result<String, KernelError> {
        super::render::render_spec(self)
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

    /// Recommended launch for `items` units of work over `layers` layers. The unit is a
    /// request (select), a page (release), a page pair (transfer), a sequence page
    /// (materialise, synthesise: pages after `start_page`), a token (verify: one block per
    /// [`VerifySpec::item_tokens`] tokens and layer) or an output word (busy: one per thread, `layers` ignored). For a transfer `layers` is the layer count of the launch (its layer range
    /// clamped to the pools, [`clamp_layer_range`](super::clamp_layer_range)), not the
    /// pools' total: a per-layer load is sized for one layer. Select and release need exactly one block ([`KernelSignature::single_block`]);
    /// every other kernel strides over its work, so any grid is correct, and this one is
    /// never 0 and at most 65536 (verify: 1024; a copy launch with
    /// [`CopyLaunch::max_blocks`]: that many).
    pub fn launch_dims(&self, items: u32, layers: u32) -> LaunchDims {
        let blocks = match self {
            KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => 1,
            KernelSpec::TransferPages(TransferSpec { launch, .. })
            | KernelSpec::Materialise(MaterialiseSpec { launch, .. }) => {
                let layer_items = if launch.layers_in_block { 1 } else { layers };
                let buffers = match self {
                    KernelSpec::TransferPages(s) => s.buffer_count(),
                    _ => 1,
                };
                let all = u64::from(items).div_ceil(u64::from(launch.pages_per_block.max(1)))
                    * u64::from(layer_items)
                    * u64::from(buffers);
                match launch.max_blocks {
                    0 => all,
                    cap => all.min(u64::from(cap)),
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
mod tests {
    use super::*;

    #[test]
    fn buffer_sizes_match_the_design() {
        assert_eq!(BufferKind::NsaKv.bytes_per_token(), 656);
        assert_eq!(BufferKind::NsaIndexK.bytes_per_token(), 132);
        assert_eq!(BufferKind::MlaKv.bytes_per_token(), 1152);
        assert_eq!(BufferKind::NsaIndexK.page_bytes(64), 8448);
    }

    #[test]
    fn field_layouts_tile_the_page_exactly() {
        for b in [BufferKind::NsaKv, BufferKind::NsaIndexK, BufferKind::MlaKv] {
            for ps in [1u32, 16, 64] {
                let mut covered = vec![0u8; b.page_bytes(ps) as usize];
                for f in b.field_layouts(ps) {
                    for slot in 0..ps {
                        for e in 0..f.count {
                            let at = f.offset(slot, e);
                            for byte in &mut covered[at..at + f.dtype.size() as usize] {
                                *byte += 1;
                            }
                        }
                    }
                }
                assert!(covered.iter().all(|&c| c == 1), "{b} ps{ps}");
            }
        }
    }

    /// The synthesise and verify kernels store and compare a draw's 8 bytes as one `u64`:
    /// every full draw of every field must be 8-byte aligned in every slot of every page, and
    /// a partial last draw aligned to each of its narrower accesses. True for every buffer
    /// kind at every page size the kernels accept but one: nsa `index_k` at page size 1 has
    /// 132-byte pages, so it is refused with a typed error (NSA deployments use page size 64).
    #[test]
    fn every_synthesised_access_is_aligned_to_its_width() {
        for b in [BufferKind::NsaKv, BufferKind::NsaIndexK, BufferKind::MlaKv] {
            for ps in (0..=10).map(|k| 1u32 << k) {
                let pb = b.page_bytes(ps);
                let got = b.check_access_alignment(ps);
                if b == BufferKind::NsaIndexK && ps == 1 {
                    assert_eq!(
                        got,
                        Err(FieldMisalignment {
                            field: 0,
                            width: 8,
                            what: "page bytes",
                            value: 132
                        })
                    );
                    continue;
                }
                assert_eq!(got, Ok(()), "{b} ps{ps}");
                for f in b.field_layouts(ps) {
                    if f.full_draws() > 0 {
                        assert_eq!(f.base % 8, 0, "{b} ps{ps} field {}", f.id);
                        assert_eq!(f.tok_stride % 8, 0, "{b} ps{ps} field {}", f.id);
                        assert_eq!(pb % 8, 0, "{b} ps{ps}");
                    }
                }
            }
        }
        // The partial draws: only nsa index_k's scale, one f32 of a draw of two, a u32.
        let mut partial = Vec::new();
        for b in [BufferKind::NsaKv, BufferKind::NsaIndexK, BufferKind::MlaKv] {
            for f in b.field_layouts(64) {
                if !f.tail_accesses().is_empty() {
                    partial.push((b, f.id, f.tail_accesses()));
                }
            }
        }
        assert_eq!(partial, vec![(BufferKind::NsaIndexK, 1, vec![(0, 4)])]);
        // Every reference deployment's synthesise and verify kernels validate.
        for d in super::super::Deployment::reference() {
            for spec in d.specs() {
                assert_eq!(spec.validate().map_err(|e| e.to_string()), Ok(()), "{spec}");
            }
        }
        for spec in [
            KernelSpec::Synthesise(SynthSpec {
                buffer: BufferKind::NsaIndexK,
                cp: 1,
                page_size: 1,
                threads: 128,
                order: TokenOrder::Paged,
            }),
            KernelSpec::Verify(VerifySpec {
                buffer: BufferKind::NsaIndexK,
                page_size: 1,
                threads: 128,
                order: TokenOrder::Paged,
            }),
        ] {
            let err = spec.render().unwrap_err();
            assert!(
                matches!(
                    err,
                    KernelError::FieldMisaligned {
                        buffer: BufferKind::NsaIndexK,
                        page_size: 1,
                        ..
                    }
                ),
                "{err}"
            );
            assert!(err.is_invalid_spec());
            assert!(
                err.to_string()
                    .contains("page bytes 132 is not a multiple of 8"),
                "{err}"
            );
        }
    }

    /// The tail accesses cover exactly the bytes of a partial last draw, widest first, each
    /// at an offset that is a multiple of its width.
    #[test]
    fn tail_accesses_cover_a_partial_draw() {
        for (dtype, count, want) in [
            (Dtype::Fp8E4m3, 16, vec![]),
            (Dtype::Fp8E4m3, 7, vec![(0, 4), (4, 2), (6, 1)]),
            (Dtype::Fp8E4m3, 13, vec![(0, 4), (4, 1)]),
            (Dtype::Bf16, 3, vec![(0, 4), (4, 2)]),
            (Dtype::Bf16, 5, vec![(0, 2)]),
            (Dtype::F32, 1, vec![(0, 4)]),
            (Dtype::F32, 4, vec![]),
        ] {
            let f = FieldLayout {
                id: 0,
                dtype,
                count,
                base: 0,
                tok_stride: 64,
            };
            assert_eq!(f.tail_accesses(), want, "{count} x {dtype}");
            assert_eq!(f.draws(), f.full_draws() + u32::from(!want.is_empty()));
        }
    }

    #[test]
    fn uri_spells_every_parameter() {
        let s = KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
            direction: Direction::HostToDevice,
            layout: HostLayout::PageFirst,
            page_size: 64,
            bytes_per_token: 656,
            launch: CopyLaunch::default(),
        });
        assert_eq!(s.uri(), "transfer_pages_h2d_pf_ps64_b656_t128_ppb1_v16_u4");
        assert_eq!(s.entry_name(), s.uri());
    }

    #[test]
    fn validation_rejects_bad_constants_without_panicking() {
        let alloc = |cp, page_size, threads| {
            KernelSpec::SelectOwnerPages(AllocSpec {
                cp,
                page_size,
                threads,
            })
            .validate()
        };
        assert!(alloc(8, 64, 256).is_ok());
        assert!(matches!(
            alloc(0, 64, 256),
            Err(KernelError::InvalidCp { .. })
        ));
        assert!(matches!(
            alloc(17, 64, 256),
            Err(KernelError::InvalidCp { .. })
        ));
        assert!(matches!(
            alloc(8, 48, 256),
            Err(KernelError::InvalidPageSize { .. })
        ));
        assert!(matches!(
            alloc(8, 64, 100),
            Err(KernelError::InvalidLaunch { .. })
        ));
        let t = KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
            direction: Direction::DeviceToHost,
            layout: HostLayout::LayerFirst,
            page_size: 1,
            bytes_per_token: 132,
            launch: CopyLaunch::default(),
        });
        assert!(matches!(
            t.validate(),
            Err(KernelError::VectorMisaligned { .. })
        ));
        assert!(t.render().is_err());
    }

    #[test]
    fn candidates_are_valid_and_include_a_cpu_shape() {
        let t = KernelSpec::Materialise(MaterialiseSpec {
            cp: 4,
            page_size: 16,
            bytes_per_token: 1152,
            launch: CopyLaunch::default(),
        });
        let c = t.candidates();
        assert!(c.contains(&t));
        assert!(c.iter().any(|s| s.threads() == 1));
        assert!(c
            .iter()
            .all(|s| s.validate().is_ok() && s.family() == Family::Materialise));
    }

    /// The bytes a C type spelling occupies as a kernel parameter on a 64-bit target.
    fn c_size(c_type: &str, cp: usize) -> usize {
        match c_type {
            t if t.ends_with('*') => 8,
            "u32" | "i32" => 4,
            "u64" | "i64" => 8,
            "const __grid_constant__ ChcPools" => 8 * cp,
            t => panic!("unexpected parameter type {t}"),
        }
    }

    #[test]
    fn param_sizes_follow_their_c_types() {
        let copy = CopyLaunch::default();
        for cp in [1u8, 3, 16] {
            let specs = [
                KernelSpec::SelectOwnerPages(AllocSpec {
                    cp,
                    page_size: 64,
                    threads: 256,
                }),
                KernelSpec::ReleasePages(ReleaseSpec { cp, threads: 256 }),
                KernelSpec::TransferPages(TransferSpec {
                    second_bytes_per_token: None,
                    direction: Direction::HostToDevice,
                    layout: HostLayout::LayerFirst,
                    page_size: 64,
                    bytes_per_token: 656,
                    launch: copy,
                }),
                KernelSpec::Materialise(MaterialiseSpec {
                    cp,
                    page_size: 64,
                    bytes_per_token: 656,
                    launch: copy,
                }),
                KernelSpec::Synthesise(SynthSpec {
                    buffer: BufferKind::NsaKv,
                    cp,
                    page_size: 64,
                    threads: 128,
                    order: TokenOrder::Paged,
                }),
                KernelSpec::Verify(VerifySpec {
                    buffer: BufferKind::MlaKv,
                    page_size: 16,
                    threads: 128,
                    order: TokenOrder::Paged,
                }),
            ];
            for spec in specs {
                let params = spec.params();
                assert!(!params.is_empty(), "{spec}");
                for p in &params {
                    assert_eq!(p.size, c_size(p.c_type, cp.into()), "{spec}: {}", p.name);
                }
                let mut names: Vec<_> = params.iter().map(|p| p.name).collect();
                names.sort_unstable();
                names.dedup();
                assert_eq!(names.len(), params.len(), "{spec}: duplicate names");
            }
        }
    }

    #[test]
    fn param_lists_wrap_like_the_hand_written_ones() {
        let select = KernelSpec::SelectOwnerPages(AllocSpec {
            cp: 8,
            page_size: 64,
            threads: 256,
        });
        assert_eq!(
            render_params(&select.params()),
            "    const u8* __restrict__ owners, u32 n, const u32* __restrict__ lane_stacks,\n    \
             u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ out_pages,\n    \
             i64* __restrict__ out_locs, u32* __restrict__ status)"
        );
        let release = KernelSpec::ReleasePages(ReleaseSpec { cp: 8, threads: 32 });
        assert_eq!(
            render_params(&release.params()),
            "    const u32* __restrict__ pages, u32 n, u32* __restrict__ lane_stacks,\n    \
             u32* __restrict__ lane_tops, u32 lane_cap, u32* __restrict__ status)"
        );
        assert_eq!(render_params(&[]), "    )");
        let long = [KernelParam {
            name: "a_parameter_name_longer_than_the_whole_line_width_allows_for_in_one_go_at_all",
            c_type: "const u8*",
            size: 8,
            align: 1,
            reach: None,
        }; 2];
        let text = render_params(&long);
        assert_eq!(text.lines().count(), 2, "{text}");
    }

    #[test]
    fn reaches_spell_and_compute_their_bytes() {
        let verify = KernelSpec::Verify(VerifySpec {
            buffer: BufferKind::NsaKv,
            page_size: 64,
            threads: 128,
            order: TokenOrder::Paged,
        });
        let reach = |spec: &KernelSpec, name: &str| {
            spec.params()
                .into_iter()
                .find(|p| p.name == name)
                .and_then(|p| p.reach)
                .unwrap()
        };
        let dense = reach(&verify, "dense");
        assert_eq!(dense.to_string(), "41984 × layers × ceil(n_tokens / 64)");
        let args = |layers: u32, n_tokens: u32| {
            move |name: &str| match name {
                "layers" => Some(layers),
                "n_tokens" => Some(n_tokens),
                _ => None,
            }
        };
        assert_eq!(dense.bytes(args(2, 65)), Ok(41984 * 2 * 2));
        assert_eq!(dense.bytes(args(2, 0)), Ok(0));
        assert_eq!(
            dense.bytes(args(u32::MAX, u32::MAX)),
            Err(ReachError::Overflow)
        );
        assert_eq!(dense.bytes(|_| None), Err(ReachError::NoValue("layers")));
        let bits = reach(&verify, "bad_tokens");
        assert_eq!(bits.to_string(), "4 × ceil(n_tokens / 32)");
        assert_eq!(bits.bytes(args(1, 33)), Ok(8));
        let tops = reach(&select_spec_for_tests(), "lane_tops");
        assert_eq!(
            (tops.to_string(), tops.bytes(|_| None)),
            ("32".into(), Ok(32))
        );
        // CP 8: the refusal count, 8 lane deficits, the bad-owner count.
        let status = reach(&select_spec_for_tests(), "status");
        assert_eq!(
            (status.to_string(), status.bytes(|_| None)),
            ("40".into(), Ok(40))
        );
    }

    #[test]
    fn select_status_words_round_trip_and_name_the_short_lanes() {
        assert_eq!(SelectStatus::words(8), 10);
        let clear = SelectStatus::clear(3);
        assert!(clear.is_clear());
        assert_eq!(clear.to_words(), [0, 0, 0, 0, 0]);
        assert_eq!(clear.to_string(), "no select launch refused");
        let s = SelectStatus::from_words(&[2, 3, 0, 1, 1]).unwrap();
        assert_eq!(s.lane_deficits, [3, 0, 1]);
        assert_eq!((s.refused, s.bad_owners), (2, 1));
        assert!(!s.is_clear());
        assert_eq!(s.short_lanes(), [(0, 3), (2, 1)]);
        assert_eq!(s.to_words(), [2, 3, 0, 1, 1]);
        assert_eq!(
            s.to_string(),
            "2 select launches refused: lane 0 short by 3 pages, lane 2 short by 1 page, \
             1 owner out of range"
        );
        assert!(SelectStatus::from_words(&[1]).is_none());
        assert_eq!(
            SelectStatus::from_words(&[1, 0]).unwrap().to_string(),
            "1 select launch refused"
        );
    }

    #[test]
    fn release_status_words_round_trip_and_name_the_full_lanes() {
        assert_eq!(ReleaseStatus::words(8), 10);
        let spec = ReleaseSpec { cp: 8, threads: 32 };
        assert_eq!(spec.status_words(), 10);
        let clear = ReleaseStatus::clear(3);
        assert!(clear.is_clear());
        assert_eq!(clear.to_words(), [0, 0, 0, 0, 0]);
        assert_eq!(clear.to_string(), "no release launch refused");
        let s = ReleaseStatus::from_words(&[2, 3, 0, 1, 1]).unwrap();
        assert_eq!(s.lane_overflows, [3, 0, 1]);
        assert_eq!((s.refused, s.bad_pages), (2, 1));
        assert!(!s.is_clear());
        assert_eq!(s.full_lanes(), [(0, 3), (2, 1)]);
        assert_eq!(s.to_words(), [2, 3, 0, 1, 1]);
        assert_eq!(
            s.to_string(),
            "2 release launches refused: lane 0 over its capacity by 3 pages, lane 2 over its \
             capacity by 1 page, 1 invalid page (0, or past the lanes)"
        );
        assert!(ReleaseStatus::from_words(&[1]).is_none());
        assert_eq!(
            ReleaseStatus::from_words(&[1, 0, 4]).unwrap().to_string(),
            "1 release launch refused: 4 invalid pages (0, or past the lanes)"
        );
        let status = KernelSpec::ReleasePages(spec)
            .params()
            .into_iter()
            .find(|p| p.name == "status")
            .and_then(|p| p.reach)
            .unwrap();
        assert_eq!(
            (status.to_string(), status.bytes(|_| None)),
            ("40".into(), Ok(40))
        );
    }

    #[test]
    fn every_pointer_of_every_family_has_a_reach_over_its_own_u32_parameters() {
        let specs = [
            select_spec_for_tests(),
            KernelSpec::ReleasePages(ReleaseSpec { cp: 8, threads: 32 }),
            KernelSpec::TransferPages(TransferSpec {
                second_bytes_per_token: None,
                direction: Direction::HostToDevice,
                layout: HostLayout::LayerFirst,
                page_size: 16,
                bytes_per_token: 1152,
                launch: CopyLaunch::default(),
            }),
            KernelSpec::Materialise(MaterialiseSpec {
                cp: 4,
                page_size: 16,
                bytes_per_token: 1152,
                launch: CopyLaunch::default(),
            }),
            KernelSpec::Synthesise(SynthSpec {
                buffer: BufferKind::NsaIndexK,
                cp: 2,
                page_size: 64,
                threads: 128,
                order: TokenOrder::Paged,
            }),
            KernelSpec::Verify(VerifySpec {
                buffer: BufferKind::MlaKv,
                page_size: 1,
                threads: 32,
                order: TokenOrder::Paged,
            }),
        ];
        let families: std::collections::BTreeSet<_> = specs.iter().map(|s| s.family()).collect();
        assert_eq!(families.len(), 6, "one spec per family");
        for spec in specs {
            let params = spec.params();
            for p in &params {
                let pointer = p.c_type.ends_with('*') || p.c_type.contains("ChcPools");
                assert_eq!(p.reach.is_some(), pointer, "{spec}: {}", p.name);
                for &(name, per) in p.reach.iter().flat_map(|r| r.counts.iter().flatten()) {
                    assert!(per >= 1, "{spec}: {}", p.name);
                    assert!(
                        params.iter().any(|q| q.name == name && q.c_type == "u32"),
                        "{spec}: `{}` reaches over `{name}`, not a u32 parameter",
                        p.name
                    );
                }
            }
        }
    }

    fn select_spec_for_tests() -> KernelSpec {
        KernelSpec::SelectOwnerPages(AllocSpec {
            cp: 8,
            page_size: 64,
            threads: 256,
        })
    }

    /// A transfer's grid is sized by the layer count of the launch: one layer of a per-layer
    /// load gets a layer's worth of blocks, and the signature carries the range.
    #[test]
    fn a_capped_copy_grid_is_at_most_its_cap_and_named_by_it() {
        let spec = |max_blocks| {
            KernelSpec::TransferPages(TransferSpec {
                second_bytes_per_token: None,
                direction: Direction::HostToDevice,
                layout: HostLayout::PageFirst,
                page_size: 64,
                bytes_per_token: 656,
                launch: CopyLaunch {
                    max_blocks,
                    ..CopyLaunch::gpu_transfer()
                },
            })
        };
        // 2,048 NSA pages × 61 layers: 65,536 blocks uncapped (the grid limit), 4 capped.
        assert_eq!(spec(0).launch_dims(2048, 61).grid, 65536);
        let d = spec(4).launch_dims(2048, 61);
        assert_eq!((d.grid, d.block), (4, 512));
        // Less work than the cap: one block per item.
        assert_eq!(spec(4).launch_dims(3, 1).grid, 3);
        assert_eq!(spec(4).launch_dims(0, 0).grid, 1);
        assert!(
            spec(4).uri().ends_with("_t512_ppb1_v16_u8_g4"),
            "{}",
            spec(4).uri()
        );
        assert!(spec(0).uri().ends_with("_u8"));
        // The cap changes the launch, not the code: the renders differ only in the name.
        let (a, b) = (spec(0).render().unwrap(), spec(4).render().unwrap());
        assert_eq!(
            a.replace(&spec(0).uri(), "K"),
            b.replace(&spec(4).uri(), "K")
        );
        assert!(spec(65537).validate().is_err());
        // Transfers get capped candidates, materialise none.
        assert!(spec(0).candidates().iter().any(|c| c.uri().contains("_g1")));
        let m = KernelSpec::Materialise(MaterialiseSpec {
            cp: 4,
            page_size: 64,
            bytes_per_token: 656,
            launch: CopyLaunch::default(),
        });
        assert!(!m.candidates().iter().any(|c| c.uri().contains("_g")));
    }

    #[test]
    fn transfer_grids_follow_the_launch_layer_count() {
        let t = |layers_in_block| {
            KernelSpec::TransferPages(TransferSpec {
                second_bytes_per_token: None,
                direction: Direction::HostToDevice,
                layout: HostLayout::LayerFirst,
                page_size: 16,
                bytes_per_token: 1152,
                launch: CopyLaunch {
                    pages_per_block: 2,
                    layers_in_block,
                    ..CopyLaunch::default()
                },
            })
        };
        assert_eq!(t(false).launch_dims(10, 61).grid, 5 * 61);
        assert_eq!(t(false).launch_dims(10, 1).grid, 5);
        assert_eq!(t(false).launch_dims(10, 0).grid, 1);
        assert_eq!(t(true).launch_dims(10, 61).grid, 5);
        assert_eq!(t(true).launch_dims(10, 1).grid, 5);
        let names: Vec<&str> = t(false).params().iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "src",
                "dst",
                "src_pages",
                "dst_pages",
                "n",
                "layers",
                "first_layer",
                "layer_count",
                "device_pages",
                "host_pages"
            ]
        );
    }

    #[test]
    fn launch_dims_are_never_empty() {
        let v = KernelSpec::Verify(VerifySpec {
            buffer: BufferKind::MlaKv,
            page_size: 16,
            threads: 32,
            order: TokenOrder::Paged,
        });
        assert_eq!(v.launch_dims(0, 4), LaunchDims { grid: 1, block: 32 });
        assert_eq!(v.launch_dims(u32::MAX, 4).grid, 1024);
        let s = KernelSpec::Synthesise(SynthSpec {
            buffer: BufferKind::MlaKv,
            cp: 4,
            page_size: 16,
            threads: 32,
            order: TokenOrder::Paged,
        });
        assert_eq!(s.launch_dims(u32::MAX, 4).grid, 1 << 16);
    }

    #[test]
    fn materialise_asks_for_a_full_sm_unless_it_needs_the_registers() {
        let m = |threads, unroll| MaterialiseSpec {
            cp: 8,
            page_size: 64,
            bytes_per_token: 656,
            launch: CopyLaunch {
                threads,
                unroll,
                ..CopyLaunch::default()
            },
        };
        assert_eq!(m(128, 4).min_blocks_per_sm(), 16);
        assert_eq!(m(512, 2).min_blocks_per_sm(), 4);
        assert_eq!(m(1, 1).min_blocks_per_sm(), SM_MAX_BLOCKS);
        assert_eq!(m(256, 8).min_blocks_per_sm(), 1);
    }

    #[test]
    fn a_two_buffer_transfer_needs_a_vector_that_divides_both_pages() {
        let t = |second, vec| {
            KernelSpec::TransferPages(TransferSpec {
                direction: Direction::HostToDevice,
                layout: HostLayout::PageFirst,
                page_size: 1,
                bytes_per_token: 656,
                second_bytes_per_token: second,
                launch: CopyLaunch {
                    vec,
                    ..CopyLaunch::default()
                },
            })
        };
        assert!(t(None, VecWidth::V16).validate().is_ok());
        assert!(matches!(
            t(Some(33), VecWidth::V16).validate(),
            Err(KernelError::VectorMisaligned { page_bytes: 33, .. })
        ));
        assert!(t(Some(33), VecWidth::V1).validate().is_ok());
        let KernelSpec::TransferPages(s) = t(Some(33), VecWidth::V1) else {
            unreachable!()
        };
        assert_eq!(s.common_page_bytes(), 1);
        assert_eq!(s.total_page_bytes(), 656 + 33);
    }
}
