//! Deployments: a model's buffer shapes at one page size and CP degree, with the launch
//! shapes to use, and the list of every kernel the deployment needs.

use std::fmt;

use super::spec::{
    AllocSpec, BufferKind, BusyKind, BusySpec, CopyLaunch, Direction, HostLayout, KernelSpec,
    MaterialiseSpec, ReleaseSpec, SelectOutput, SynthSpec, TokenOrder, TransferSpec, VecWidth,
    VerifySpec,
};
use super::{Arch, KernelError, TransferPath};
use crate::layout::Layout;

/// The model whose KV buffers a deployment caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ModelShape {
    /// DeepSeek-V3.2 NSA: `kv` (656 B/token, token-major) and `index_k` (132 B/token,
    /// page-organised). Requires page size 64.
    Nsa,
    /// Plain MLA with a bf16 cache: `kv` (1152 B/token, token-major).
    MlaBf16,
    /// A GQA or MHA model's bf16 K and V of one TP shard ([`BufferKind::GqaKv`]:
    /// `4 × kv_heads × head_dim` B/token, keys then values in a page). Named
    /// `gqa{kv_heads}x{head_dim}`, so every name, kernel uri and storage fingerprint
    /// carries the shard's shape.
    Gqa {
        /// KV heads per rank (the model's KV heads over the TP degree).
        kv_heads: u16,
        /// Elements per head.
        head_dim: u16,
    },
}

impl fmt::Display for ModelShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelShape::Nsa => f.write_str("nsa"),
            ModelShape::MlaBf16 => f.write_str("mla"),
            ModelShape::Gqa { kv_heads, head_dim } => write!(f, "gqa{kv_heads}x{head_dim}"),
        }
    }
}

/// A model name that [`ModelShape`]'s `FromStr` does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown model {given:?}: expected nsa, mla, gqa (8 KV heads of 128) or gqa<KV_HEADS>x<HEAD_DIM> (e.g. gqa4x64)")]
pub struct UnknownModel {
    /// The name given.
    pub given: String,
}

/// Which of a model's tensor-parallel head shards a deployment holds: shard `rank` of
/// `size`. A GQA/MHA model splits its KV heads over the TP ranks, so two shards of one
/// model have the same shape ([`ModelShape::Gqa`] names only the heads a rank holds) but
/// different bytes; the shard goes into the storage fingerprint and the synthesised KV
/// (when `size > 1`) so that one shard's records are never served to another. Where the
/// TP degree exceeds the model's KV heads, ranks holding copies of the same heads name the
/// same shard (`rank` = TP rank / copies, `size` = the number of distinct shards).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TpShard {
    rank: u16,
    size: u16,
}

/// A TP shard that cannot exist, or that a model cannot have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TpShardError {
    /// A TP size of 0.
    #[error("TP size 0: a model is split over at least 1 rank (1 = not split)")]
    ZeroSize,
    /// A rank that is not below the size.
    #[error("TP rank {rank} is not below the TP size {size} (ranks are 0..{size})")]
    RankOutOfRange {
        /// The rank given.
        rank: u16,
        /// The size given.
        size: u16,
    },
    /// A split of a model whose KV is not split by heads: MLA's and NSA's latent KV is the
    /// same on every TP rank, so every rank reads and writes the same records.
    #[error(
        "model {model} keeps the same latent KV on every TP rank (nothing is split by heads), \
         so every TP rank shares its records: give no TP shard (TP size 1), not rank {rank} \
         of {size}"
    )]
    Replicated {
        /// The model.
        model: ModelShape,
        /// The rank given.
        rank: u16,
        /// The size given.
        size: u16,
    },
}

impl TpShard {
    /// No split: the whole model's KV heads on one rank (or KV replicated on every rank).
    /// Fingerprints and synthesised KV are those of a deployment without a TP shard.
    pub const WHOLE: TpShard = TpShard { rank: 0, size: 1 };

    /// Shard `rank` of `size`, refusing a size of 0 and a rank not below the size.
    pub fn new(rank: u16, size: u16) -> Result<TpShard, TpShardError> {
        if size == 0 {
            return Err(TpShardError::ZeroSize);
        }
        if rank >= size {
            return Err(TpShardError::RankOutOfRange { rank, size });
        }
        Ok(TpShard { rank, size })
    }

    /// The shard's index, `0..size`.
    pub fn rank(self) -> u16 {
        self.rank
    }

    /// The number of shards the model's KV heads are split into.
    pub fn size(self) -> u16 {
        self.size
    }

    /// Whether the model is split (`size > 1`): only then does the shard change the
    /// fingerprint and the synthesised KV, so unsplit stores stay readable.
    pub fn is_split(self) -> bool {
        self.size > 1
    }

    /// The seed of the prefix-hash chain of synthesised KV (`h[-1]`, docs/KERNELS.md): the
    /// usual seed unsplit, else one drawn from the shard, so that every token of one shard
    /// synthesises other bytes than the same token of another and verification catches a
    /// page of the wrong shard. Host-side: the kernels take the hashes as they are.
    pub fn prefix_hash_seed(self) -> u64 {
        use super::reference::{mix64, PREFIX_HASH_SEED};
        if !self.is_split() {
            return PREFIX_HASH_SEED;
        }
        let shard = (0x7470_u64 << 32) | (u64::from(self.size) << 16) | u64::from(self.rank);
        mix64(PREFIX_HASH_SEED ^ mix64(shard))
    }
}

impl Default for TpShard {
    fn default() -> TpShard {
        TpShard::WHOLE
    }
}

/// `rank/size`, what `--tp` takes.
impl fmt::Display for TpShard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.rank, self.size)
    }
}

impl std::str::FromStr for ModelShape {
    type Err = UnknownModel;

    /// `nsa`, `mla`, `gqa` ([`ModelShape::GQA_DEFAULT`]) or `gqa<KV_HEADS>x<HEAD_DIM>`, the
    /// names [`ModelShape`]'s `Display` writes. The GQA shape is checked by
    /// [`Deployment::new`], not here.
    fn from_str(s: &str) -> Result<ModelShape, UnknownModel> {
        let unknown = || UnknownModel {
            given: s.to_string(),
        };
        match s {
            "nsa" => Ok(ModelShape::Nsa),
            "mla" => Ok(ModelShape::MlaBf16),
            "gqa" => Ok(ModelShape::GQA_DEFAULT),
            _ => {
                let (h, d) = s
                    .strip_prefix("gqa")
                    .and_then(|r| r.split_once('x'))
                    .ok_or_else(unknown)?;
                let num = |x: &str| -> Result<u16, UnknownModel> {
                    if x.is_empty() || !x.bytes().all(|c| c.is_ascii_digit()) {
                        return Err(unknown());
                    }
                    x.parse().map_err(|_| unknown())
                };
                Ok(ModelShape::Gqa {
                    kv_heads: num(h)?,
                    head_dim: num(d)?,
                })
            }
        }
    }
}

/// The buffer kinds of a model, in the order the cache keeps them (one or two): a slice
/// by [`Deref`](std::ops::Deref), and an iterator of kinds by value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Buffers {
    kinds: [BufferKind; 2],
    len: u8,
}

impl Buffers {
    fn one(a: BufferKind) -> Buffers {
        Buffers {
            kinds: [a, a],
            len: 1,
        }
    }

    fn two(a: BufferKind, b: BufferKind) -> Buffers {
        Buffers {
            kinds: [a, b],
            len: 2,
        }
    }
}

impl std::ops::Deref for Buffers {
    type Target = [BufferKind];

    fn deref(&self) -> &[BufferKind] {
        &self.kinds[..usize::from(self.len)]
    }
}

impl IntoIterator for Buffers {
    type Item = BufferKind;
    type IntoIter = std::iter::Take<std::array::IntoIter<BufferKind, 2>>;

    fn into_iter(self) -> Self::IntoIter {
        self.kinds.into_iter().take(usize::from(self.len))
    }
}

impl<'a> IntoIterator for &'a Buffers {
    type Item = &'a BufferKind;
    type IntoIter = std::slice::Iter<'a, BufferKind>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl ModelShape {
    /// The default GQA shape of the command line and the Python package: 8 KV heads of 128
    /// (Llama-3-8B's or Llama-3-70B's KV heads at TP 1; at TP 2 a rank holds 4 of them).
    pub const GQA_DEFAULT: ModelShape = ModelShape::Gqa {
        kv_heads: 8,
        head_dim: 128,
    };

    /// The buffer kinds, in the order the cache keeps them.
    pub fn buffers(self) -> Buffers {
        match self {
            ModelShape::Nsa => Buffers::two(BufferKind::NsaKv, BufferKind::NsaIndexK),
            ModelShape::MlaBf16 => Buffers::one(BufferKind::MlaKv),
            ModelShape::Gqa { kv_heads, head_dim } => {
                Buffers::one(BufferKind::GqaKv { kv_heads, head_dim })
            }
        }
    }

    /// The model's family name without its shape: `nsa`, `mla` or `gqa` (what `--model`
    /// and `Deployment(model=...)` take).
    pub fn family(self) -> &'static str {
        match self {
            ModelShape::Nsa => "nsa",
            ModelShape::MlaBf16 => "mla",
            ModelShape::Gqa { .. } => "gqa",
        }
    }
}

/// One serving configuration: model, page size, CP degree, target and launch shapes. It
/// decides every `KernelSpec` the cache uses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Deployment {
    /// Readable name, e.g. `nsa_ps64_cp8` (also the render-tree directory).
    pub name: String,
    /// Model buffer shapes.
    pub model: ModelShape,
    /// Tokens per page.
    pub page_size: u32,
    /// CP degree.
    pub cp: u8,
    /// The CP layout (who owns each token): [`Deployment::with_layout`] sets it, so that
    /// the name follows. Only token-interleave changes kernels (synthesise and verify).
    pub layout: Layout,
    /// NVRTC target of offline builds (`compile`, `bench --prebuild`); a CUDA executor
    /// builds for its own device's architecture instead (`jit::target_for`).
    pub arch: Arch,
    /// Host pool arrangement.
    pub host_layout: HostLayout,
    /// Threads of the allocator kernels (multiple of 32).
    pub alloc_threads: u32,
    /// Launch shape of materialise (its vector width is narrowed per buffer when a page is
    /// not a multiple of it). Materialise always runs the full grid: a `max_blocks` here is
    /// ignored.
    pub copy: CopyLaunch,
    /// Launch shape of the host↔device transfer kernels, narrowed like `copy`. The default is
    /// the capped grid [`CopyLaunch::gpu_transfer`]: a few blocks, because a transfer is
    /// bound by the link and the model's kernels need the SMs.
    pub transfer_copy: CopyLaunch,
    /// Threads of synthesise and verify.
    pub synth_threads: u32,
    /// Whether host↔device page transfers run the transfer kernel or copy-engine DMA
    /// (tuning decides; the transfer kernels are compiled either way).
    pub transfer_path: TransferPath,
    /// Which TP head shard this deployment holds ([`Deployment::with_tp`] sets it, checked
    /// against the model). It changes no kernel and not the name, only the storage
    /// fingerprint and the synthesised KV.
    tp: TpShard,
}

/// `l` with its vector width narrowed to the widest that divides `page_bytes`, when its own
/// does not.
fn narrowed(mut l: CopyLaunch, page_bytes: u64) -> CopyLaunch {
    if page_bytes % u64::from(l.vec.bytes()) != 0 {
        l.vec = VecWidth::widest_for(page_bytes);
    }
    l
}

/// The reference deployments: (model, page size, CP degrees).
const REFERENCE: &[(ModelShape, u32, &[u8])] = &[
    (ModelShape::Nsa, 64, &[1, 2, 4, 8, 16]),
    (ModelShape::MlaBf16, 16, &[4, 8]),
    (ModelShape::MlaBf16, 64, &[4, 8]),
    (ModelShape::GQA_DEFAULT, 16, &[4]),
];

/// The reference deployments of layouts whose kernels differ: (model, page size, CP, layout).
const REFERENCE_LAYOUTS: &[(ModelShape, u32, u8, Layout)] =
    &[(ModelShape::Nsa, 64, 8, Layout::TokenInterleave { size: 1 })];

impl Deployment {
    /// A deployment with the default launch shapes, named `<model>_ps<page>_cp<cp>`
    /// (`gqa8x128_ps16_cp4`). NSA uses the page-first host layout, MLA and GQA the
    /// layer-first one, so the reference render covers both. Validates every kernel spec it
    /// implies.
    pub fn new(model: ModelShape, page_size: u32, cp: u8) -> Result<Deployment, KernelError> {
        let name = format!("{model}_ps{page_size}_cp{cp}");
        if model == ModelShape::Nsa && page_size != 64 {
            return Err(KernelError::InvalidDeployment {
                name,
                reason: format!("NSA requires page size 64, got {page_size}"),
            });
        }
        if let Some(e) = model.buffers().iter().find_map(|b| b.check_shape().err()) {
            return Err(KernelError::InvalidDeployment {
                name,
                reason: e.to_string(),
            });
        }
        let dep = Deployment {
            name,
            model,
            page_size,
            cp,
            layout: Layout::default(),
            arch: Arch::default(),
            host_layout: match model {
                ModelShape::Nsa => HostLayout::PageFirst,
                ModelShape::MlaBf16 | ModelShape::Gqa { .. } => HostLayout::LayerFirst,
            },
            alloc_threads: 256,
            copy: CopyLaunch::default(),
            transfer_copy: CopyLaunch::gpu_transfer(),
            synth_threads: 128,
            transfer_path: TransferPath::Kernel,
            tp: TpShard::WHOLE,
        };
        dep.validate()?;
        Ok(dep)
    }

    /// This deployment under `layout`. A token-interleave layout whose runs are shorter
    /// than a page changes the synthesise and verify kernels, so its name says so
    /// (`mla_ps16_cp4_ti1`); the page layouts share their kernels and their name.
    pub fn with_layout(mut self, layout: Layout) -> Result<Deployment, KernelError> {
        layout
            .validate(self.page_size)
            .map_err(|e| KernelError::InvalidDeployment {
                name: self.name.clone(),
                reason: e.to_string(),
            })?;
        if self.layout.interleaves_tokens(self.page_size) {
            let cut = self.name.rfind("_ti").unwrap_or(self.name.len());
            self.name.truncate(cut);
        }
        self.layout = layout;
        if layout.interleaves_tokens(self.page_size) {
            self.name = format!("{}_ti{}", self.name, layout.interleave(self.page_size));
        }
        self.validate()?;
        Ok(self)
    }

    /// This deployment holding TP head shard `tp`. Only a model whose KV heads are split
    /// over the TP ranks (GQA/MHA) takes a split shard; MLA and NSA keep the same latent KV
    /// on every TP rank, so a split of theirs is refused ([`TpShardError::Replicated`])
    /// rather than silently giving each rank records of its own.
    pub fn with_tp(mut self, tp: TpShard) -> Result<Deployment, KernelError> {
        if tp.is_split() && !matches!(self.model, ModelShape::Gqa { .. }) {
            return Err(KernelError::InvalidTpShard {
                name: self.name,
                source: TpShardError::Replicated {
                    model: self.model,
                    rank: tp.rank,
                    size: tp.size,
                },
            });
        }
        self.tp = tp;
        Ok(self)
    }

    /// The TP head shard this deployment holds ([`TpShard::WHOLE`] unless
    /// [`Deployment::with_tp`] split it).
    pub fn tp(&self) -> TpShard {
        self.tp
    }

    /// How tokens fill the pages under this deployment's layout.
    pub fn token_order(&self) -> TokenOrder {
        if self.layout.interleaves_tokens(self.page_size) {
            TokenOrder::Interleaved {
                cp: self.cp,
                run: self.layout.interleave(self.page_size),
            }
        } else {
            TokenOrder::Paged
        }
    }

    /// Checks every spec of the deployment.
    pub fn validate(&self) -> Result<(), KernelError> {
        self.specs().iter().try_for_each(KernelSpec::validate)
    }

    /// Every reference deployment: NSA page 64 at CP 1, 2, 4, 8, 16; MLA bf16 at page 16
    /// and 64, CP 4 and 8; GQA 8 KV heads of 128 at page 16, CP 4; then NSA page 64 at CP 8 token-interleaved one token at a time
    /// (SGLang's NSA prefill split), whose synthesise and verify kernels differ.
    pub fn reference() -> Vec<Deployment> {
        REFERENCE
            .iter()
            .flat_map(|&(model, ps, cps)| {
                cps.iter()
                    .filter_map(move |&cp| Deployment::new(model, ps, cp).ok())
            })
            .chain(
                REFERENCE_LAYOUTS
                    .iter()
                    .filter_map(|&(model, ps, cp, layout)| {
                        Deployment::new(model, ps, cp)
                            .and_then(|d| d.with_layout(layout))
                            .ok()
                    }),
            )
            .collect()
    }

    /// The reference deployment called `name`; the error lists the valid names.
    pub fn by_name(name: &str) -> Result<Deployment, KernelError> {
        let all = Deployment::reference();
        match all.iter().find(|d| d.name == name) {
            Some(d) => Ok(d.clone()),
            None => Err(KernelError::UnknownDeployment {
                name: name.to_string(),
                valid: all.into_iter().map(|d| d.name).collect(),
            }),
        }
    }

    fn copy_for(&self, buffer: BufferKind) -> CopyLaunch {
        narrowed(
            CopyLaunch {
                max_blocks: 0,
                ..self.copy
            },
            buffer.page_bytes(self.page_size),
        )
    }

    /// The owner-page selection kernel writing `output`: the cache's own allocator runs
    /// [`SelectOutput::Pages`] ([`KernelLaneAllocator`](crate::allocator::KernelLaneAllocator)),
    /// an engine asking for token locations [`SelectOutput::PagesAndLocs`]
    /// ([`Ops::select`](crate::ops::Ops::select)).
    pub fn select_spec(&self, output: SelectOutput) -> KernelSpec {
        KernelSpec::SelectOwnerPages(AllocSpec {
            cp: self.cp,
            page_size: self.page_size,
            threads: self.alloc_threads,
            output,
        })
    }

    /// The lane release kernel.
    pub fn release_spec(&self) -> KernelSpec {
        KernelSpec::ReleasePages(ReleaseSpec {
            cp: self.cp,
            threads: self.alloc_threads,
        })
    }

    /// The transfer kernel in `direction`, with the deployment's host layout: one launch
    /// moves every buffer of the model (NSA: `kv` and `index_k`).
    pub fn transfer_spec(&self, direction: Direction) -> KernelSpec {
        KernelSpec::TransferPages(self.transfer(direction))
    }

    /// The transfer in `direction`, typed (the DMA path needs its geometry): the model's
    /// buffers in order, one descriptor each, with a vector width that divides every page.
    pub fn transfer(&self, direction: Direction) -> TransferSpec {
        let buffers = self.model.buffers();
        let spec = TransferSpec {
            direction,
            layout: self.host_layout,
            page_size: self.page_size,
            bytes_per_token: buffers[0].bytes_per_token(),
            second_bytes_per_token: buffers.get(1).map(|b| b.bytes_per_token()),
            launch: self.transfer_copy,
            stamps: false,
        };
        TransferSpec {
            launch: narrowed(self.transfer_copy, spec.common_page_bytes()),
            ..spec
        }
    }

    /// The materialise kernel of `buffer`.
    pub fn materialise_spec(&self, buffer: BufferKind) -> KernelSpec {
        KernelSpec::Materialise(MaterialiseSpec {
            cp: self.cp,
            page_size: self.page_size,
            bytes_per_token: buffer.bytes_per_token(),
            launch: self.copy_for(buffer),
        })
    }

    /// The synthesise kernel of `buffer`.
    pub fn synth_spec(&self, buffer: BufferKind) -> KernelSpec {
        KernelSpec::Synthesise(SynthSpec {
            buffer,
            cp: self.cp,
            page_size: self.page_size,
            threads: self.synth_threads,
            order: self.token_order(),
        })
    }

    /// The verify kernel of `buffer`.
    pub fn verify_spec(&self, buffer: BufferKind) -> KernelSpec {
        KernelSpec::Verify(VerifySpec {
            buffer,
            page_size: self.page_size,
            threads: self.synth_threads,
            order: self.token_order(),
        })
    }

    /// The busy kernels `tune` runs beside this deployment's transfers on a GPU, ALU then
    /// HBM (not among [`Deployment::specs`]: serving never runs them).
    pub fn busy_specs(&self) -> [KernelSpec; 2] {
        [BusyKind::Alu, BusyKind::Hbm].map(|k| KernelSpec::Busy(BusySpec::of(k)))
    }

    /// Every kernel the deployment needs, without duplicates, in a stable order: select with
    /// token locations, select without them, release, transfer d2h, transfer h2d (every
    /// buffer in one launch), then per buffer materialise, synthesise, verify.
    pub fn specs(&self) -> Vec<KernelSpec> {
        let mut out = vec![
            self.select_spec(SelectOutput::PagesAndLocs),
            self.select_spec(SelectOutput::Pages),
            self.release_spec(),
            self.transfer_spec(Direction::DeviceToHost),
            self.transfer_spec(Direction::HostToDevice),
        ];
        for b in self.model.buffers() {
            for s in [
                self.materialise_spec(b),
                self.synth_spec(b),
                self.verify_spec(b),
            ] {
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_names() {
        let names: Vec<String> = Deployment::reference()
            .into_iter()
            .map(|d| d.name)
            .collect();
        assert_eq!(
            names,
            [
                "nsa_ps64_cp1",
                "nsa_ps64_cp2",
                "nsa_ps64_cp4",
                "nsa_ps64_cp8",
                "nsa_ps64_cp16",
                "mla_ps16_cp4",
                "mla_ps16_cp8",
                "mla_ps64_cp4",
                "mla_ps64_cp8",
                "gqa8x128_ps16_cp4",
                "nsa_ps64_cp8_ti1"
            ]
        );
    }

    #[test]
    fn by_name_lists_valid_names() {
        assert_eq!(Deployment::by_name("mla_ps16_cp4").unwrap().cp, 4);
        let err = Deployment::by_name("nsa_ps32_cp8").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("nsa_ps64_cp8") && msg.contains("mla_ps64_cp4"),
            "{msg}"
        );
    }

    /// Model names round-trip through `Display` and `FromStr`; `gqa` alone is 8 × 128.
    #[test]
    fn model_names_parse_back() {
        for m in [
            ModelShape::Nsa,
            ModelShape::MlaBf16,
            ModelShape::Gqa {
                kv_heads: 2,
                head_dim: 64,
            },
            ModelShape::GQA_DEFAULT,
        ] {
            assert_eq!(m.to_string().parse::<ModelShape>(), Ok(m));
        }
        assert_eq!("gqa".parse::<ModelShape>(), Ok(ModelShape::GQA_DEFAULT));
        for bad in [
            "gqa8",
            "gqax128",
            "gqa8x",
            "gqa-1x2",
            "gqa8x128x1",
            "gqa99999x1",
            "mha",
        ] {
            assert!(bad.parse::<ModelShape>().is_err(), "{bad}");
        }
        let gqa = Deployment::new("gqa4x64".parse().unwrap(), 32, 2).unwrap();
        assert_eq!(gqa.name, "gqa4x64_ps32_cp2");
        assert_eq!(gqa.model.buffers().len(), 1);
        assert_eq!(gqa.model.family(), "gqa");
    }

    /// A TP shard is refused with a typed error when it cannot exist (size 0, rank not
    /// below the size) or when its model keeps the same KV on every TP rank (MLA, NSA);
    /// a GQA deployment takes it without changing its name or a kernel.
    #[test]
    fn tp_shards_are_checked_and_change_no_kernel() {
        assert_eq!(TpShard::new(0, 0), Err(TpShardError::ZeroSize));
        assert_eq!(
            TpShard::new(2, 2),
            Err(TpShardError::RankOutOfRange { rank: 2, size: 2 })
        );
        assert_eq!(TpShard::default(), TpShard::WHOLE);
        assert!(!TpShard::new(0, 1).unwrap().is_split());
        let one = TpShard::new(1, 2).unwrap();
        assert_eq!(
            (one.rank(), one.size(), one.to_string()),
            (1, 2, "1/2".into())
        );
        for model in [ModelShape::Nsa, ModelShape::MlaBf16] {
            let dep = Deployment::new(model, 64, 4).unwrap();
            match dep.clone().with_tp(one) {
                Err(KernelError::InvalidTpShard {
                    source:
                        TpShardError::Replicated {
                            rank: 1, size: 2, ..
                        },
                    ..
                }) => {}
                other => panic!("{model}: {other:?}"),
            }
            // Unsplit is every model's own state.
            assert_eq!(dep.clone().with_tp(TpShard::WHOLE).unwrap(), dep);
        }
        let gqa = Deployment::by_name("gqa8x128_ps16_cp4").unwrap();
        let split = gqa.clone().with_tp(one).unwrap();
        assert_eq!((split.tp(), gqa.tp()), (one, TpShard::WHOLE));
        assert_eq!(split.name, gqa.name);
        assert_eq!(split.specs(), gqa.specs());
        assert_ne!(split, gqa);
    }

    /// Unsplit, the prefix-hash chain keeps its seed (every existing store's bytes and the
    /// committed renders stay as they were); each shard of a split seeds its own.
    #[test]
    fn each_tp_shard_seeds_its_own_prefix_hashes() {
        use crate::kernels::reference::PREFIX_HASH_SEED;
        assert_eq!(TpShard::WHOLE.prefix_hash_seed(), PREFIX_HASH_SEED);
        let mut seeds = vec![PREFIX_HASH_SEED];
        for size in 2..=8u16 {
            for rank in 0..size {
                seeds.push(TpShard::new(rank, size).unwrap().prefix_hash_seed());
            }
        }
        let n = seeds.len();
        seeds.sort_unstable();
        seeds.dedup();
        assert_eq!(seeds.len(), n, "two shards share a seed");
    }

    #[test]
    fn nsa_needs_page_64_and_cp_is_checked() {
        assert!(Deployment::new(ModelShape::Nsa, 16, 4).is_err());
        assert!(Deployment::new(ModelShape::MlaBf16, 16, 0).is_err());
        assert!(Deployment::new(ModelShape::MlaBf16, 1, 17).is_err());
    }

    #[test]
    fn specs_cover_every_family_per_buffer() {
        let nsa = Deployment::by_name("nsa_ps64_cp8").unwrap();
        // Select with and without token locations, release, two transfers, then per buffer.
        assert_eq!(nsa.specs().len(), 3 + 2 + 2 * 3);
        let mla = Deployment::by_name("mla_ps16_cp4").unwrap();
        assert_eq!(mla.specs().len(), 3 + 2 + 3);
        let gqa = Deployment::by_name("gqa8x128_ps16_cp4").unwrap();
        assert_eq!(gqa.specs().len(), 3 + 2 + 3);
        assert_eq!(gqa.host_layout, HostLayout::LayerFirst);
        let uris: Vec<String> = gqa.specs()[3..].iter().map(KernelSpec::uri).collect();
        assert_eq!(
            uris,
            [
                "transfer_pages_d2h_lf_ps16_b4096_t512_ppb1_v16_u8_g4",
                "transfer_pages_h2d_lf_ps16_b4096_t512_ppb1_v16_u8_g4",
                "materialise_cp4_ps16_b4096_t128_ppb1_v16_u4",
                "synthesise_gqa8x128_kv_cp4_ps16_t128",
                "verify_gqa8x128_kv_ps16_t128"
            ]
        );
        let uris: Vec<String> = mla.specs()[..2].iter().map(KernelSpec::uri).collect();
        assert_eq!(
            uris,
            [
                "select_owner_pages_cp4_ps16_t256",
                "select_owner_pages_cp4_ps16_nolocs_t256"
            ]
        );
    }

    #[test]
    fn token_interleave_renames_and_changes_only_the_placing_kernels() {
        let base = Deployment::by_name("mla_ps16_cp4").unwrap();
        let ti = base
            .clone()
            .with_layout(Layout::TokenInterleave { size: 2 })
            .unwrap();
        assert_eq!(ti.name, "mla_ps16_cp4_ti2");
        let changed: Vec<String> = ti
            .specs()
            .iter()
            .filter(|s| !base.specs().contains(s))
            .map(KernelSpec::uri)
            .collect();
        assert_eq!(
            changed,
            [
                "synthesise_mla_kv_cp4_ps16_t128_ti2",
                "verify_mla_kv_ps16_t128_cp4ti2"
            ]
        );
        let back = ti.with_layout(Layout::PageInterleave).unwrap();
        assert_eq!(
            (back.name.as_str(), back.specs()),
            ("mla_ps16_cp4", base.specs())
        );
        // A run of a whole page is page order: nothing changes.
        let whole = base
            .clone()
            .with_layout(Layout::TokenInterleave { size: 16 })
            .unwrap();
        assert_eq!(whole.name, "mla_ps16_cp4");
        assert!(base
            .with_layout(Layout::TokenInterleave { size: 32 })
            .is_err());
    }

    #[test]
    fn an_nsa_transfer_moves_both_buffers_in_one_launch() {
        let nsa = Deployment::by_name("nsa_ps64_cp8").unwrap();
        let t = nsa.transfer(Direction::HostToDevice);
        assert_eq!(
            (t.bytes_per_token, t.second_bytes_per_token),
            (656, Some(132))
        );
        assert_eq!(t.total_page_bytes(), 64 * (656 + 132));
        assert_eq!(t.descriptors().len(), 2);
        assert_eq!(
            nsa.transfer_spec(Direction::HostToDevice).uri(),
            "transfer_pages_h2d_pf_ps64_b656_b132_t512_ppb1_v16_u8_g4"
        );
        let mla = Deployment::by_name("mla_ps16_cp4").unwrap();
        assert_eq!(mla.transfer(Direction::DeviceToHost).descriptors().len(), 1);
    }
}
