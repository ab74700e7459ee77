//! Launch-configuration candidates per kernel family (docs/DESIGN.md §3.6 "Tuning"): threads per
//! block, pages per block, vector width, unroll and where the layer loop runs as kernel
//! renders, plus the DMA path for transfers on a GPU, both ways a driver can issue it: one
//! `cuMemcpyBatchAsync` per batch (`dma`) and one `cuMemcpyAsync` per merged region
//! (`dma-each`).

use serde::{Deserialize, Serialize};
use std::fmt;

use crate::exec::{Backend, DmaMode};
use crate::kernels::{
    AllocSpec, CopyLaunch, KernelSpec, MaterialiseSpec, ReleaseSpec, SynthSpec, TransferSpec,
    VecWidth, VerifySpec,
};

/// A launch choice as stored in a tuning file: what a deployment field is set to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LaunchChoice {
    /// A page-copy launch shape (transfer, materialise).
    Copy {
        /// Threads per block.
        threads: u32,
        /// Pages per work item.
        pages_per_block: u32,
        /// Bytes per access (1, 4 or 16).
        vec_bytes: u32,
        /// Accesses in flight per thread.
        unroll: u32,
        /// Whether each work item loops over the layers ([`CopyLaunch::layers_in_block`]);
        /// absent in files written before it existed, which meant `false`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        layers_in_block: bool,
        /// Whether pages are stored with `__stcs` ([`CopyLaunch::streaming_stores`]); absent
        /// in files written before it existed, which meant `false`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        streaming_stores: bool,
        /// Most blocks per launch ([`CopyLaunch::max_blocks`], transfers only); absent in
        /// files written before it existed, which meant 0 (no cap).
        #[serde(default, skip_serializing_if = "is_zero")]
        max_blocks: u32,
    },
    /// Threads per block of the allocator, synthesis and verification families.
    Threads {
        /// Threads per block.
        threads: u32,
    },
    /// Copy-engine DMA of the page blobs instead of a kernel (transfers only), the batch in
    /// one `cuMemcpyBatchAsync` ([`DmaMode::Batched`]).
    Dma,
    /// Copy-engine DMA, one `cuMemcpyAsync` per merged run of page blobs
    /// ([`DmaMode::PerRegion`]). Absent from files written before it existed.
    DmaEach,
}

impl fmt::Display for LaunchChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LaunchChoice::Copy {
                threads,
                pages_per_block,
                vec_bytes,
                unroll,
                layers_in_block,
                streaming_stores,
                max_blocks,
            } => {
                write!(f, "t{threads}_ppb{pages_per_block}_v{vec_bytes}_u{unroll}")?;
                if *layers_in_block {
                    f.write_str("_lb")?;
                }
                if *streaming_stores {
                    f.write_str("_cs")?;
                }
                if *max_blocks != 0 {
                    write!(f, "_g{max_blocks}")?;
                }
                Ok(())
            }
            LaunchChoice::Threads { threads } => write!(f, "t{threads}"),
            LaunchChoice::Dma => f.write_str("dma"),
            LaunchChoice::DmaEach => f.write_str("dma-each"),
        }
    }
}

impl LaunchChoice {
    /// The DMA choice of `mode`.
    pub fn of_dma(mode: DmaMode) -> LaunchChoice {
        match mode {
            DmaMode::Batched => LaunchChoice::Dma,
            DmaMode::PerRegion => LaunchChoice::DmaEach,
        }
    }

    /// How this choice issues DMA copies, or `None` for a kernel shape.
    pub fn dma_mode(&self) -> Option<DmaMode> {
        match self {
            LaunchChoice::Dma => Some(DmaMode::Batched),
            LaunchChoice::DmaEach => Some(DmaMode::PerRegion),
            _ => None,
        }
    }

    /// Whether this is a DMA choice (no kernel shape).
    pub fn is_dma(&self) -> bool {
        self.dma_mode().is_some()
    }

    /// The copy shape, when this is one with a valid vector width.
    pub fn copy_launch(&self) -> Option<CopyLaunch> {
        match *self {
            LaunchChoice::Copy {
                threads,
                pages_per_block,
                vec_bytes,
                unroll,
                layers_in_block,
                streaming_stores,
                max_blocks,
            } => Some(CopyLaunch {
                threads,
                pages_per_block,
                vec: vec_width(vec_bytes)?,
                unroll,
                layers_in_block,
                streaming_stores,
                max_blocks,
            }),
            _ => None,
        }
    }

    /// The choice of a copy launch shape.
    pub fn of_copy(l: &CopyLaunch) -> LaunchChoice {
        LaunchChoice::Copy {
            threads: l.threads,
            pages_per_block: l.pages_per_block,
            vec_bytes: l.vec.bytes(),
            unroll: l.unroll,
            layers_in_block: l.layers_in_block,
            streaming_stores: l.streaming_stores,
            max_blocks: l.max_blocks,
        }
    }

    /// The grid cap of a copy choice (0: none, and for every other choice).
    pub fn max_blocks(&self) -> u32 {
        match *self {
            LaunchChoice::Copy { max_blocks, .. } => max_blocks,
            _ => 0,
        }
    }

    /// The launch choice a kernel spec embodies.
    pub fn of_spec(spec: &KernelSpec) -> LaunchChoice {
        match spec {
            KernelSpec::TransferPages(s) => Self::of_copy(&s.launch),
            KernelSpec::Materialise(s) => Self::of_copy(&s.launch),
            other => LaunchChoice::Threads {
                threads: other.threads(),
            },
        }
    }

    /// `spec` with this launch choice, or `None` when the choice does not fit the family
    /// (a copy shape for an allocator kernel, DMA for anything) or the result is invalid.
    pub fn apply_to(&self, spec: &KernelSpec) -> Option<KernelSpec> {
        let out = match (*spec, self) {
            (KernelSpec::TransferPages(s), LaunchChoice::Copy { .. }) => {
                KernelSpec::TransferPages(TransferSpec {
                    launch: self.copy_launch()?,
                    ..s
                })
            }
            // Materialise runs the full grid: a capped shape is a transfer shape only.
            (KernelSpec::Materialise(s), LaunchChoice::Copy { max_blocks: 0, .. }) => {
                KernelSpec::Materialise(MaterialiseSpec {
                    launch: self.copy_launch()?,
                    ..s
                })
            }
            (KernelSpec::SelectOwnerPages(s), &LaunchChoice::Threads { threads }) => {
                KernelSpec::SelectOwnerPages(AllocSpec { threads, ..s })
            }
            (KernelSpec::ReleasePages(s), &LaunchChoice::Threads { threads }) => {
                KernelSpec::ReleasePages(ReleaseSpec { threads, ..s })
            }
            (KernelSpec::Synthesise(s), &LaunchChoice::Threads { threads }) => {
                KernelSpec::Synthesise(SynthSpec { threads, ..s })
            }
            (KernelSpec::Verify(s), &LaunchChoice::Threads { threads }) => {
                KernelSpec::Verify(VerifySpec { threads, ..s })
            }
            _ => return None,
        };
        out.validate().ok().map(|()| out)
    }
}

fn is_zero(v: &u32) -> bool {
    *v == 0
}

fn vec_width(bytes: u32) -> Option<VecWidth> {
    [VecWidth::V1, VecWidth::V4, VecWidth::V16]
        .into_iter()
        .find(|v| v.bytes() == bytes)
}

/// One thing to time for a kernel: a render with a launch shape, or the DMA path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Candidate {
    /// A kernel render (compiled through the JIT and launched).
    Kernel(KernelSpec),
    /// Copy-engine DMA of the merged page blobs (transfers only), issued as the mode says.
    /// Only the CUDA executor accepts it; see [`Candidate::supported_by`].
    Dma(KernelSpec, DmaMode),
}

impl Candidate {
    /// The launch choice this candidate stands for.
    pub fn choice(&self) -> LaunchChoice {
        match self {
            Candidate::Kernel(spec) => LaunchChoice::of_spec(spec),
            Candidate::Dma(_, mode) => LaunchChoice::of_dma(*mode),
        }
    }

    /// Whether tuning on `backend` weighs this candidate: DMA only on CUDA. The host executor
    /// can copy regions too, but there they are plain `memcpy`, and choosing them would stop
    /// the CPU from running the same transfer kernel as the GPU (replay `--transfer dma`
    /// still forces that path for testing).
    pub fn supported_by(&self, backend: Backend) -> Result<(), Unsupported> {
        match (self, backend) {
            (Candidate::Kernel(_), _) | (Candidate::Dma(..), Backend::Cuda) => Ok(()),
            (Candidate::Dma(..), _) => Err(Unsupported {
                what: "dma",
                backend,
                reason: "copy-engine DMA is a GPU candidate; on the CPU it would be plain memcpy",
            }),
        }
    }
}

/// A candidate the executor at hand cannot run (typed, so the tuner records and skips it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{what} is unsupported by the {backend} executor: {reason}")]
pub struct Unsupported {
    /// The candidate label.
    pub what: &'static str,
    /// The executor's backend.
    pub backend: Backend,
    /// Why.
    pub reason: &'static str,
}

/// The CPU-friendly copy shapes added to the family's own candidates: one thread walks each
/// page contiguously, with several pages per work item to amortise the per-block cost of the
/// emulator, the layers looped in the grid or in the block, with plain or streaming stores.
fn cpu_copy_shapes(vec: VecWidth) -> [CopyLaunch; 7] {
    let s = |pages_per_block, unroll, layers_in_block, streaming_stores| CopyLaunch {
        threads: 1,
        pages_per_block,
        vec,
        unroll,
        layers_in_block,
        streaming_stores,
        max_blocks: 0,
    };
    [
        s(16, 1, false, false),
        s(64, 1, false, false),
        s(1, 4, false, false),
        s(16, 1, true, false),
        s(16, 1, false, true),
        s(64, 1, false, true),
        s(16, 1, true, true),
    ]
}

/// The CPU-friendly copy shape the bench uses as "tuned" on the host when no tuning file
/// applies: one thread per block walking 16 pages per work item with streaming stores
/// (BENCHMARKS.md: NSA page-64 copies at 0.78-0.81 of memcpy on average over five runs,
/// against 0.55 with plain stores).
pub fn host_copy_preset() -> CopyLaunch {
    CopyLaunch {
        threads: 1,
        pages_per_block: 16,
        vec: VecWidth::V16,
        unroll: 1,
        layers_in_block: false,
        streaming_stores: true,
        max_blocks: 0,
    }
}

/// The allocator thread count the bench uses as "tuned" on the host: one warp.
pub const HOST_ALLOC_THREADS_PRESET: u32 = 32;

/// Every candidate worth timing for `spec` on `backend`, the spec itself included, without
/// duplicates. `quick` keeps a handful so a tuning run stays short: the spec, the CPU shapes
/// with streaming stores and one wide GPU shape, plus on the CPU the CPU shape with plain
/// stores, and on CUDA the default shape with streaming stores (whose worth only a GPU can
/// tell; on the CPU it is many times slower) and, for transfers, a capped grid of 2 blocks of
/// 512 threads (half the default transfer grid's blocks). On CUDA a transfer also has both DMA
/// candidates, `dma` and `dma-each` (the tuner times `dma-each` only once where the driver
/// has no batch call: [`Executor::batched_copies`](crate::exec::Executor::batched_copies)).
pub fn candidates_for(spec: &KernelSpec, backend: Backend, quick: bool) -> Vec<Candidate> {
    let mut specs: Vec<KernelSpec> = spec.candidates();
    let vec = match spec {
        KernelSpec::TransferPages(s) => Some(s.launch.vec),
        KernelSpec::Materialise(s) => Some(s.launch.vec),
        _ => None,
    };
    if let Some(vec) = vec {
        for l in cpu_copy_shapes(vec) {
            if let Some(s) = LaunchChoice::of_copy(&l).apply_to(spec) {
                specs.push(s);
            }
        }
    }
    if quick {
        let keep = |s: &KernelSpec| -> bool {
            if s == spec {
                return true;
            }
            match LaunchChoice::of_spec(s) {
                LaunchChoice::Copy {
                    threads,
                    pages_per_block,
                    unroll,
                    layers_in_block,
                    streaming_stores,
                    max_blocks,
                    ..
                } => match (threads, pages_per_block, unroll, streaming_stores) {
                    // On a GPU, one capped transfer grid fewer than the default's blocks.
                    (512, 1, 8, false) if max_blocks != 0 => {
                        backend == Backend::Cuda && max_blocks == 2
                    }
                    _ if max_blocks != 0 => false,
                    // The CPU shape with streaming stores and the layer loop in the grid
                    // and in the block, and one wide GPU shape.
                    (1, 16, 1, true) | (256, 1, 2, false) => true,
                    // On the CPU, the CPU shape with plain stores too: streaming stores win
                    // on large copies here, but a machine whose caches hold the pages may
                    // differ. On a GPU, the default shape with streaming stores.
                    (1, 16, 1, false) => backend != Backend::Cuda && !layers_in_block,
                    (128, 1, 4, true) => backend == Backend::Cuda && !layers_in_block,
                    _ => false,
                },
                LaunchChoice::Threads { threads } => matches!(threads, 1 | 32 | 256),
                LaunchChoice::Dma | LaunchChoice::DmaEach => false,
            }
        };
        specs.retain(keep);
    }
    let mut out: Vec<Candidate> = Vec::new();
    for s in specs {
        if s.validate().is_ok() && !out.contains(&Candidate::Kernel(s)) {
            out.push(Candidate::Kernel(s));
        }
    }
    if matches!(spec, KernelSpec::TransferPages(_)) && backend == Backend::Cuda {
        out.push(Candidate::Dma(*spec, DmaMode::Batched));
        out.push(Candidate::Dma(*spec, DmaMode::PerRegion));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{BufferKind, Deployment, Direction};

    #[test]
    fn choice_round_trips_through_specs() {
        let dep = Deployment::by_name("mla_ps16_cp8").unwrap();
        for spec in dep.specs() {
            for c in candidates_for(&spec, Backend::Host, false) {
                let Candidate::Kernel(k) = c else {
                    panic!("no DMA on host")
                };
                assert_eq!(c.choice().apply_to(&spec), Some(k));
            }
        }
    }

    #[test]
    fn dma_only_for_cuda_transfers() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        let t = dep.transfer_spec(Direction::HostToDevice);
        for quick in [true, false] {
            let dma: Vec<LaunchChoice> = candidates_for(&t, Backend::Cuda, quick)
                .iter()
                .filter(|c| matches!(c, Candidate::Dma(..)))
                .inspect(|c| {
                    assert!(c.supported_by(Backend::Cuda).is_ok());
                    assert!(c.supported_by(Backend::Host).is_err());
                })
                .map(Candidate::choice)
                .collect();
            assert_eq!(dma, [LaunchChoice::Dma, LaunchChoice::DmaEach]);
        }
        assert!(!candidates_for(&t, Backend::Host, false)
            .iter()
            .any(|c| matches!(c, Candidate::Dma(..))));
        let m = dep.materialise_spec(BufferKind::NsaKv);
        assert!(!candidates_for(&m, Backend::Cuda, false)
            .iter()
            .any(|c| matches!(c, Candidate::Dma(..))));
        for mode in [DmaMode::Batched, DmaMode::PerRegion] {
            let c = LaunchChoice::of_dma(mode);
            assert_eq!(c.dma_mode(), Some(mode));
            assert_eq!(c.apply_to(&t), None, "no kernel shape");
            let text = serde_json::to_string(&c).unwrap();
            assert_eq!(serde_json::from_str::<LaunchChoice>(&text).unwrap(), c);
        }
        assert_eq!(LaunchChoice::DmaEach.to_string(), "dma-each");
        assert_eq!(
            serde_json::to_string(&LaunchChoice::DmaEach).unwrap(),
            r#"{"kind":"dma_each"}"#
        );
    }

    #[test]
    fn quick_is_a_small_subset_with_the_spec() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        for spec in dep.specs() {
            for backend in [Backend::Host, Backend::Cuda] {
                let quick = candidates_for(&spec, backend, true);
                let full = candidates_for(&spec, backend, false);
                assert!(quick.contains(&Candidate::Kernel(spec)));
                // At most 8: on CUDA a transfer adds a capped grid and both DMA candidates.
                assert!(quick.len() <= 8 && quick.len() <= full.len(), "{backend}");
                let plain_cpu_shape = quick.iter().any(|c| {
                    matches!(
                        c.choice(),
                        LaunchChoice::Copy {
                            threads: 1,
                            streaming_stores: false,
                            ..
                        }
                    )
                });
                let copies = matches!(
                    spec,
                    KernelSpec::TransferPages(_) | KernelSpec::Materialise(_)
                );
                assert_eq!(plain_cpu_shape, copies && backend == Backend::Host);
                assert!(quick.iter().all(|c| full.contains(c)), "{backend}");
            }
            // Streaming stores with many threads per page are slow on the CPU: not in a
            // quick host run, but in a quick GPU run for the copy families.
            let streaming_gpu_shape = |b| {
                candidates_for(&spec, b, true).iter().any(|c| {
                    matches!(
                        c.choice(),
                        LaunchChoice::Copy {
                            threads: 128,
                            streaming_stores: true,
                            ..
                        }
                    )
                })
            };
            assert!(!streaming_gpu_shape(Backend::Host));
            let copies = matches!(
                spec,
                KernelSpec::TransferPages(_) | KernelSpec::Materialise(_)
            );
            assert_eq!(streaming_gpu_shape(Backend::Cuda), copies);
        }
    }

    /// Copy choices written before a boolean field existed read as `false` and write as
    /// before; with the field set they round-trip and name the shape with its suffix.
    #[test]
    fn copy_choices_without_a_later_field_read_as_before() {
        type Set = fn(&mut CopyLaunch);
        let cases: [(&str, &str, Set, &str); 2] = [
            (
                r#"{"kind":"copy","threads":1,"pages_per_block":16,"vec_bytes":16,"unroll":1}"#,
                r#""layers_in_block":true"#,
                |l| l.layers_in_block = true,
                "t1_ppb16_v16_u1_lb",
            ),
            (
                r#"{"kind":"copy","threads":1,"pages_per_block":16,"vec_bytes":16,"unroll":1,"layers_in_block":true}"#,
                r#""streaming_stores":true"#,
                |l| l.streaming_stores = true,
                "t1_ppb16_v16_u1_lb_cs",
            ),
        ];
        for (old, field, set, name) in cases {
            let c: LaunchChoice = serde_json::from_str(old).unwrap();
            let mut l = c.copy_launch().unwrap();
            assert_eq!(serde_json::to_string(&c).unwrap(), old, "writes as before");
            let before = l;
            set(&mut l);
            assert_ne!(l, before, "{field} was false when absent");
            let set_choice = LaunchChoice::of_copy(&l);
            let text = serde_json::to_string(&set_choice).unwrap();
            assert!(text.contains(field), "{text}");
            assert_eq!(
                serde_json::from_str::<LaunchChoice>(&text).unwrap(),
                set_choice
            );
            assert_eq!(set_choice.to_string(), name);
            assert_eq!(l.to_string(), name);
        }
    }
}
