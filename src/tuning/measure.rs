//! Measurement building blocks shared by `tune`, `bench` and `bench --check`: workload sizes,
//! median timing, the buffers and argument lists of each kernel family (docs/KERNELS.md), the
//! baselines (`memcpy` on the host, pinned `cuMemcpyAsync` on CUDA, the Rust references), the
//! DMA path of transfers, and compiling
//! plus loading a set of specs through the JIT.

use std::ops::Range;
use std::time::Instant;

use super::TuningError;
use crate::exec::{
    Backend, BufferId, CopyRegion, DmaMode, ExecError, Executor, KernelArg, KernelId, LaunchConfig,
    MemKind,
};
use crate::jit::{spec_request, Arch, Jit, JitRequest, Sanitize, Target};
use crate::kernels::{
    check_distinct_destinations, clamp_layer_range, layer_range_args, transfer_args,
    transfer_regions, BufferKind, Direction, KernelSpec, PoolShape, ReleaseStatus, SelectStatus,
    SynthSpec, TokenOrder, TransferSpec, VerifySpec,
};

/// Workload sizes of one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sizes {
    /// Pages (page pairs for transfers, sequence pages for materialise) per launch.
    pub pages: u32,
    /// Layers per launch.
    pub layers: u32,
    /// Untimed launches first.
    pub warmup: u32,
    /// Timed launches; the median is reported.
    pub repeats: u32,
}

impl Sizes {
    /// Realistic sizes: 256 pages × 4 layers, 1 warm-up, median of 7.
    pub fn full() -> Sizes {
        Sizes {
            pages: 256,
            layers: 4,
            warmup: 1,
            repeats: 7,
        }
    }

    /// Short runs: 128 pages × 2 layers, 1 warm-up, median of 3.
    pub fn quick() -> Sizes {
        Sizes {
            pages: 128,
            layers: 2,
            warmup: 1,
            repeats: 3,
        }
    }

    /// Short description for tables and tuning entries.
    pub fn describe(&self) -> String {
        format!(
            "pages={} layers={} warmup={} repeats={}",
            self.pages, self.layers, self.warmup, self.repeats
        )
    }
}

/// Median and minimum seconds of the timed repeats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Median seconds.
    pub median: f64,
    /// Fastest repeat.
    pub min: f64,
}

impl Timing {
    /// The median (the mean of the two middle samples for an even count) and the minimum of
    /// at least one sample.
    fn of(mut samples: Vec<f64>) -> Timing {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let median = if n % 2 == 0 {
            (samples[n / 2 - 1] + samples[n / 2]) / 2.0
        } else {
            samples[n / 2]
        };
        Timing {
            median,
            min: samples[0],
        }
    }
}

/// Runs `setup` then times `run`, `warmup` untimed and `repeats` timed times (at least one).
pub fn time_with<E>(
    warmup: u32,
    repeats: u32,
    mut setup: impl FnMut() -> Result<(), E>,
    mut run: impl FnMut() -> Result<(), E>,
) -> Result<Timing, E> {
    for _ in 0..warmup {
        setup()?;
        run()?;
    }
    let mut samples = Vec::with_capacity(repeats.max(1) as usize);
    for _ in 0..repeats.max(1) {
        setup()?;
        let t = Instant::now();
        run()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    Ok(Timing::of(samples))
}

/// Like [`time_with`] for work enqueued on `exec`: each timed repeat is measured by the
/// executor ([`Executor::time_work`]: CUDA events on a GPU), so the untimed `setup` stays out
/// of the numbers. At least one warm-up runs whatever `warmup` says: a first launch may load
/// the module lazily (CUDA) or fault in fresh pages (host).
pub fn time_device(
    exec: &dyn Executor,
    warmup: u32,
    repeats: u32,
    mut setup: impl FnMut() -> Result<(), ExecError>,
    mut run: impl FnMut() -> Result<(), ExecError>,
) -> Result<Timing, ExecError> {
    for _ in 0..warmup.max(1) {
        setup()?;
        run()?;
        exec.synchronize()?;
    }
    let mut samples = Vec::with_capacity(repeats.max(1) as usize);
    for _ in 0..repeats.max(1) {
        setup()?;
        samples.push(exec.time_work(&mut run)?);
    }
    Ok(Timing::of(samples))
}

/// [`time_device`] at `sizes`' warm-up and repeats, for work that needs no setup per repeat.
fn time_sized(
    exec: &dyn Executor,
    sizes: &Sizes,
    run: impl FnMut() -> Result<(), ExecError>,
) -> Result<Timing, ExecError> {
    time_device(exec, sizes.warmup, sizes.repeats, || Ok(()), run)
}

/// Deterministic splitmix64 stream (fixed seeds keep runs comparable).
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// The next value.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        crate::kernels::reference::mix64(self.0)
    }

    /// A value in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// The first `take` entries of a random permutation of `0..n`.
    pub fn sample(&mut self, n: u32, take: u32) -> Vec<u32> {
        let mut v: Vec<u32> = (0..n).collect();
        let take = take.min(n) as usize;
        for i in 0..take {
            let j = i + self.below((v.len() - i) as u64) as usize;
            v.swap(i, j);
        }
        v.truncate(take);
        v
    }

    /// `len` random bytes.
    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(len + 8);
        while out.len() < len {
            out.extend_from_slice(&self.next_u64().to_le_bytes());
        }
        out.truncate(len);
        out
    }
}

/// Little-endian bytes of a `u32` slice (kernel inputs).
pub fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The JIT target for an executor: its device's arch on CUDA; on the host, the sanitizer mode
/// `CP_HICACHE_EMU_SANITIZE` selects.
pub fn target_for(exec: &dyn Executor) -> Result<Target, TuningError> {
    Ok(crate::jit::target_for(
        exec,
        Arch::default(),
        Sanitize::from_env()?,
    )?)
}

pub use crate::jit::SourceHook;

/// Renders, compiles (in parallel, through the JIT cache) and loads each spec; one result per
/// spec: the kernel handle, or why it cannot run (render, compile or load error; with
/// `drop_spilling`, which the tuner sets for its candidates, also an NVRTC build that spills
/// registers or uses a stack frame). Checks and benchmarks run such a build as replay does.
///
/// # Safety
///
/// `hook`, when given, must keep every kernel within its spec's signature: each parameter's
/// [`Reach`](crate::kernels::Reach) bounds what the kernel touches. An edit that only makes
/// a source fail to compile (the compile-error fault) does.
pub unsafe fn compile_and_load(
    exec: &dyn Executor,
    jit: &Jit,
    specs: &[KernelSpec],
    drop_spilling: bool,
    hook: Option<SourceHook<'_>>,
    on_done: &(dyn Fn() + Sync),
) -> Vec<Result<KernelId, String>> {
    let target = match target_for(exec) {
        Ok(t) => t,
        Err(e) => return specs.iter().map(|_| Err(e.to_string())).collect(),
    };
    let requests: Vec<Result<JitRequest, String>> = specs
        .iter()
        .map(|spec| spec_request(spec, target, hook).map_err(|e| e.to_string()))
        .collect();
    let ok: Vec<JitRequest> = requests
        .iter()
        .filter_map(|r| r.as_ref().ok().cloned())
        .collect();
    let mut compiled = jit.warm_up_with(&ok, |_| on_done()).into_iter();
    specs
        .iter()
        .zip(requests)
        .map(|(spec, req)| {
            req?;
            let k = compiled
                .next()
                .ok_or_else(|| "internal: missing JIT result".to_string())?
                .map_err(|e| e.to_string())?;
            if let Some(rep) = k.report.as_ref().filter(|_| drop_spilling) {
                if rep.spill_bytes > 0 || rep.stack_bytes > 0 {
                    return Err(format!(
                        "spills {} bytes, {}-byte stack frame",
                        rep.spill_bytes, rep.stack_bytes
                    ));
                }
            }
            // SAFETY: `k` is the JIT's build of `spec` for `exec`'s target (`target_for`),
            // from its render or an edit the caller vouches for.
            unsafe { k.load_spec(exec, spec) }.map_err(|e| e.to_string())
        })
        .collect()
}

/// Frees a list of buffers when dropped.
struct Owned<'e> {
    exec: &'e dyn Executor,
    ids: Vec<BufferId>,
}

impl Owned<'_> {
    fn alloc(&mut self, kind: MemKind, bytes: u64, fill: u8) -> Result<BufferId, ExecError> {
        let id = self.exec.alloc(kind, bytes.max(1) as usize, fill)?;
        self.ids.push(id);
        Ok(id)
    }
}

impl Drop for Owned<'_> {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            let _ = self.exec.free(id);
        }
    }
}

/// Buffers and arguments of one page-copy kernel (transfer or materialise) at given sizes:
/// realistic scattered page ids over pools with some slack. Every candidate of the same spec
/// key runs on the same buffers.
pub struct CopyBench<'e> {
    mem: Owned<'e>,
    kind: CopyKind,
    n: u32,
    layers: u32,
    /// The layers a transfer copies (`first_layer`, `layer_count` kernel arguments); every
    /// layer for materialise.
    first_layer: u32,
    layer_count: u32,
    page_bytes: u64,
    /// Pool pages per rank (device pool, or each CP pool).
    pub device_pages: u32,
    /// Host pool pages (transfers).
    pub host_pages: u32,
}

enum CopyKind {
    Transfer {
        /// Each buffer's pools, in the spec's descriptor order.
        buffers: Vec<TransferBuffers>,
        src_pages: BufferId,
        dst_pages: BufferId,
        direction: Direction,
    },
    Materialise {
        pools: Vec<(BufferId, u64)>,
        seq_pages: BufferId,
        dense: BufferId,
    },
}

/// One buffer of a transfer workload: its source and destination pools, and the page pairs
/// as copy regions of those pools (the DMA path).
#[derive(Debug, Clone)]
pub struct TransferBuffers {
    /// Source pool.
    pub src: BufferId,
    /// Destination pool.
    pub dst: BufferId,
    /// The page pairs as copy regions.
    pub regions: Vec<CopyRegion>,
}

/// The page ids a copy workload uses, also needed by the references in `--check`.
#[derive(Debug, Clone)]
pub struct CopyPages {
    /// Transfer source pages, or materialise sequence pages (global ids).
    pub first: Vec<u32>,
    /// Transfer destination pages (empty for materialise).
    pub second: Vec<u32>,
}

impl<'e> CopyBench<'e> {
    /// Allocates pools (poisoned with `0xA5`) and uploads page ids for `spec` (a transfer or
    /// materialise spec). `seed` fixes the page ids. Transfers copy every layer.
    pub fn new(
        exec: &'e dyn Executor,
        spec: &KernelSpec,
        sizes: &Sizes,
        seed: u64,
    ) -> Result<(CopyBench<'e>, CopyPages), TuningError> {
        CopyBench::new_in_layers(exec, spec, sizes, seed, 0..u32::MAX)
    }

    /// [`CopyBench::new`] whose transfer copies only the layers of `layer_range` (clamped to
    /// `sizes.layers`, as the kernel clamps it; the pools keep every layer). Materialise
    /// ignores the range and copies every layer.
    pub fn new_in_layers(
        exec: &'e dyn Executor,
        spec: &KernelSpec,
        sizes: &Sizes,
        seed: u64,
        layer_range: Range<u32>,
    ) -> Result<(CopyBench<'e>, CopyPages), TuningError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        let mut rng = SplitMix(seed);
        let n = sizes.pages.max(1);
        let layers = sizes.layers.max(1);
        let slack = n / 4 + 1;
        match spec {
            KernelSpec::TransferPages(s) => {
                let pools = PoolShape {
                    layers,
                    device_pages: n + slack,
                    host_pages: n + slack,
                };
                let dev_ids = rng.sample(pools.device_pages, n);
                let host_ids = rng.sample(pools.host_pages, n);
                let (sp, dp) = match s.direction {
                    Direction::DeviceToHost => (dev_ids, host_ids),
                    Direction::HostToDevice => (host_ids, dev_ids),
                };
                CopyBench::transfer(exec, s, pools, sp, dp, layer_range)
            }
            KernelSpec::Materialise(s) => {
                let page_bytes = s.page_bytes();
                let cp = u32::from(s.cp);
                let local_pages = n.div_ceil(cp) + slack;
                let pool_bytes = u64::from(layers) * u64::from(local_pages) * page_bytes;
                let mut pools = Vec::with_capacity(cp as usize);
                for _ in 0..cp {
                    pools.push((mem.alloc(MemKind::Device, pool_bytes, 0xA5)?, 0));
                }
                // Distinct global pages, page 0 (null) excluded.
                let seq: Vec<u32> = rng
                    .sample(cp * local_pages - 1, n)
                    .into_iter()
                    .map(|p| p + 1)
                    .collect();
                let seq_pages = mem.alloc(MemKind::Device, 4 * u64::from(n), 0)?;
                exec.upload(seq_pages, 0, &u32_bytes(&seq))?;
                let dense = mem.alloc(
                    MemKind::Device,
                    u64::from(layers) * u64::from(n) * page_bytes,
                    0xA5,
                )?;
                Ok((
                    CopyBench {
                        mem,
                        kind: CopyKind::Materialise {
                            pools,
                            seq_pages,
                            dense,
                        },
                        n,
                        layers,
                        first_layer: 0,
                        layer_count: layers,
                        page_bytes,
                        device_pages: local_pages,
                        host_pages: 0,
                    },
                    CopyPages {
                        first: seq,
                        second: Vec::new(),
                    },
                ))
            }
            other => Err(TuningError::Reference {
                what: "copy bench",
                message: format!("{} is not a page-copy kernel", other.uri()),
            }),
        }
    }

    /// A transfer of `src_pages[i]` → `dst_pages[i]` between pools of `pools`' sizes (poisoned
    /// with `0xA5`), with the page ids uploaded, for the layers of `layer_range` (passed to
    /// the kernel as `first_layer` / `layer_count`, which clamps them to `pools.layers`). Pairs that name one destination page twice are
    /// refused before anything is allocated ([`TuningError::Transfer`]), as the cluster refuses
    /// them: the kernel's result would not be defined on a GPU.
    pub fn transfer(
        exec: &'e dyn Executor,
        s: &TransferSpec,
        pools: PoolShape,
        src_pages: Vec<u32>,
        dst_pages: Vec<u32>,
        layer_range: Range<u32>,
    ) -> Result<(CopyBench<'e>, CopyPages), TuningError> {
        check_distinct_destinations(&dst_pages)?;
        let n = match u32::try_from(src_pages.len()) {
            Ok(n) if src_pages.len() == dst_pages.len() => n,
            _ => {
                return Err(TuningError::Reference {
                    what: "transfer workload",
                    message: format!(
                        "{} source pages for {} destination pages (one each, at most 2^32 - 1 \
                         pairs)",
                        src_pages.len(),
                        dst_pages.len()
                    ),
                })
            }
        };
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        let PoolShape {
            layers,
            device_pages,
            host_pages,
        } = pools;
        let mut buffers = Vec::new();
        for d in s.descriptors() {
            let page_bytes = d.page_bytes();
            let dev_bytes = u64::from(layers) * u64::from(device_pages) * page_bytes;
            let host_bytes = u64::from(layers) * u64::from(host_pages) * page_bytes;
            let dev = mem.alloc(MemKind::Device, dev_bytes, 0xA5)?;
            let host = mem.alloc(MemKind::Host, host_bytes, 0xA5)?;
            let (src, dst) = match s.direction {
                Direction::DeviceToHost => (dev, host),
                Direction::HostToDevice => (host, dev),
            };
            let regions = transfer_regions(&d, &src_pages, &dst_pages, pools, layer_range.clone());
            buffers.push(TransferBuffers { src, dst, regions });
        }
        let page_bytes = s.total_page_bytes();
        let src_buf = mem.alloc(MemKind::Device, 4 * u64::from(n), 0)?;
        let dst_buf = mem.alloc(MemKind::Device, 4 * u64::from(n), 0)?;
        exec.upload(src_buf, 0, &u32_bytes(&src_pages))?;
        exec.upload(dst_buf, 0, &u32_bytes(&dst_pages))?;
        let (first_layer, layer_count) = layer_range_args(&layer_range);
        Ok((
            CopyBench {
                mem,
                kind: CopyKind::Transfer {
                    buffers,
                    src_pages: src_buf,
                    dst_pages: dst_buf,
                    direction: s.direction,
                },
                n,
                layers,
                first_layer,
                layer_count,
                page_bytes,
                device_pages,
                host_pages,
            },
            CopyPages {
                first: src_pages,
                second: dst_pages,
            },
        ))
    }

    /// Bytes one launch moves (read once, written once).
    pub fn bytes(&self) -> u64 {
        u64::from(self.n) * u64::from(self.launch_layers()) * self.page_bytes
    }

    /// The layers one launch copies: the layer range clamped to the pools' layers.
    pub fn layer_range(&self) -> Range<u32> {
        clamp_layer_range(self.first_layer, self.layer_count, self.layers)
    }

    fn launch_layers(&self) -> u32 {
        self.layer_range().len() as u32
    }

    /// The buffers: (sources, destination). For a transfer its first buffer's source (see
    /// [`CopyBench::transfer_buffers`] for every buffer); for materialise the CP pools.
    pub fn buffers(&self) -> (Vec<BufferId>, BufferId) {
        match &self.kind {
            CopyKind::Transfer { buffers, .. } => (vec![buffers[0].src], buffers[0].dst),
            CopyKind::Materialise { pools, dense, .. } => {
                (pools.iter().map(|p| p.0).collect(), *dense)
            }
        }
    }

    /// A transfer's pools, one entry per buffer in the spec's descriptor order (empty for
    /// materialise).
    pub fn transfer_buffers(&self) -> &[TransferBuffers] {
        match &self.kind {
            CopyKind::Transfer { buffers, .. } => buffers,
            CopyKind::Materialise { .. } => &[],
        }
    }

    /// Launches `kernel` (compiled from `spec`, a candidate of this bench's spec key) with the
    /// recommended grid, without synchronising.
    pub fn launch(&self, kernel: KernelId, spec: &KernelSpec) -> Result<(), ExecError> {
        let d = spec.launch_dims(self.n, self.launch_layers());
        let cfg = LaunchConfig::linear(d.grid, d.block);
        let exec = self.mem.exec;
        match &self.kind {
            CopyKind::Transfer {
                buffers,
                src_pages,
                dst_pages,
                ..
            } => {
                let ends: Vec<(BufferId, BufferId)> =
                    buffers.iter().map(|b| (b.src, b.dst)).collect();
                let pools = PoolShape {
                    layers: self.layers,
                    device_pages: self.device_pages,
                    host_pages: self.host_pages,
                };
                let args = transfer_args(
                    &ends,
                    (*src_pages, *dst_pages),
                    self.n,
                    pools,
                    (self.first_layer, self.layer_count),
                );
                exec.launch(kernel, &cfg, &args)
            }
            CopyKind::Materialise {
                pools,
                seq_pages,
                dense,
            } => exec.launch(
                kernel,
                &cfg,
                &[
                    KernelArg::PtrStruct(pools),
                    KernelArg::Ptr(*seq_pages, 0),
                    KernelArg::U32(self.n),
                    KernelArg::U32(self.layers),
                    KernelArg::U32(self.device_pages),
                    KernelArg::Ptr(*dense, 0),
                ],
            ),
        }
    }

    /// Times `kernel`: launch and synchronise, median of the repeats.
    pub fn time(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        sizes: &Sizes,
    ) -> Result<Timing, ExecError> {
        time_sized(self.mem.exec, sizes, || self.launch(kernel, spec))
    }

    /// Enqueues the transfer by DMA instead of a kernel (same pages, same bytes), without
    /// synchronising, the batch issued as the executor's default ([`DmaMode::Batched`]).
    /// Materialise has no DMA path: a typed error.
    pub fn copy_dma(&self) -> Result<(), ExecError> {
        self.copy_dma_with(DmaMode::Batched)
    }

    /// [`copy_dma`](Self::copy_dma), the batch issued as `mode` says.
    pub fn copy_dma_with(&self, mode: DmaMode) -> Result<(), ExecError> {
        match &self.kind {
            CopyKind::Transfer { buffers, .. } => buffers.iter().try_for_each(|b| {
                self.mem
                    .exec
                    .copy_regions_with(b.src, b.dst, &b.regions, mode)
            }),
            CopyKind::Materialise { .. } => Err(no_dma_path()),
        }
    }

    /// Times the DMA path: median of the repeats, like [`CopyBench::time`].
    pub fn time_dma(&self, sizes: &Sizes) -> Result<Timing, ExecError> {
        self.time_dma_with(sizes, DmaMode::Batched)
    }

    /// [`time_dma`](Self::time_dma), the batch issued as `mode` says.
    pub fn time_dma_with(&self, sizes: &Sizes, mode: DmaMode) -> Result<Timing, ExecError> {
        time_sized(self.mem.exec, sizes, || self.copy_dma_with(mode))
    }

    /// The memory kinds the copy reads and writes (for its baseline).
    pub fn memory(&self) -> (MemKind, MemKind) {
        match &self.kind {
            CopyKind::Transfer {
                direction: Direction::HostToDevice,
                ..
            } => (MemKind::Host, MemKind::Device),
            CopyKind::Transfer { .. } => (MemKind::Device, MemKind::Host),
            CopyKind::Materialise { .. } => (MemKind::Device, MemKind::Device),
        }
    }
}

/// Buffers of the allocator kernels for `n` requests: fresh lane stacks, round-robin owners,
/// and the pages the selection returns (for release).
pub struct AllocBench<'e> {
    mem: Owned<'e>,
    cp: u8,
    n: u32,
    lane_cap: u32,
    owners: BufferId,
    /// `u32[CP * lane_cap]`.
    pub stacks: BufferId,
    /// `u32[CP]`.
    pub tops: BufferId,
    /// Output pages of select; input of release.
    pub pages: BufferId,
    /// `i64[n * page_size]`.
    pub locs: BufferId,
    /// `u32[CP + 2]`, the select kernel's status words (zero before every select).
    pub status: BufferId,
    /// `u32[CP + 2]`, the release kernel's status words (zero before every release).
    pub release_status: BufferId,
    /// Host copies for the references.
    pub host: AllocInputs,
}

/// The allocator inputs on the host (for the references and `--check`).
#[derive(Debug, Clone)]
pub struct AllocInputs {
    /// One owner per request.
    pub owners: Vec<u8>,
    /// Fresh lane stacks.
    pub stacks: Vec<u32>,
    /// Full tops.
    pub tops_full: Vec<u32>,
    /// Tops after selecting `owners`.
    pub tops_after: Vec<u32>,
    /// The pages the selection returns.
    pub selected: Vec<u32>,
    /// Lane capacity.
    pub lane_cap: u32,
}

impl<'e> AllocBench<'e> {
    /// Allocates and uploads everything for `n` requests at CP `cp` and `page_size`.
    pub fn new(
        exec: &'e dyn Executor,
        cp: u8,
        page_size: u32,
        n: u32,
        seed: u64,
    ) -> Result<AllocBench<'e>, TuningError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        let c = u32::from(cp.max(1));
        let n = n.max(1);
        let lane_cap = n.div_ceil(c) + 8;
        let mut rng = SplitMix(seed);
        // Owners rotate from a random start, so every lane's demand fits its capacity.
        let start = rng.below(u64::from(c)) as u32;
        let owners: Vec<u8> = (0..n).map(|i| ((i + start) % c) as u8).collect();
        // Lane `o` owns pages `o + c * k`, `k < lane_cap` (a larger local index is invalid to
        // the release kernel), page 0 excluded; each starts full.
        let mut stacks = vec![0u32; (c * lane_cap) as usize];
        let mut tops_full = Vec::with_capacity(c as usize);
        for o in 0..c {
            let lane: Vec<u32> = (0..lane_cap)
                .map(|k| o + c * k)
                .filter(|&p| p != 0)
                .collect();
            for (slot, &p) in lane.iter().rev().enumerate() {
                stacks[(o * lane_cap) as usize + slot] = p;
            }
            tops_full.push(lane.len() as u32);
        }
        let mut tops_after = tops_full.clone();
        let mut status = vec![0u32; SelectStatus::words(cp)];
        let (selected, _) = crate::kernels::reference::select_owner_pages(
            cp,
            page_size,
            &owners,
            &stacks,
            &mut tops_after,
            lane_cap,
            &mut status,
        )
        .map_err(|e| TuningError::Reference {
            what: "select_owner_pages",
            message: e.to_string(),
        })?;
        let owners_buf = mem.alloc(MemKind::Device, u64::from(n), 0)?;
        let stacks_buf = mem.alloc(MemKind::Device, 4 * u64::from(c * lane_cap), 0)?;
        let tops = mem.alloc(MemKind::Device, 4 * u64::from(c), 0)?;
        let pages = mem.alloc(MemKind::Device, 4 * u64::from(n), 0xA5)?;
        let locs = mem.alloc(
            MemKind::Device,
            8 * u64::from(n) * u64::from(page_size),
            0xA5,
        )?;
        let status = mem.alloc(MemKind::Device, 4 * SelectStatus::words(cp) as u64, 0)?;
        let release_status = mem.alloc(MemKind::Device, 4 * ReleaseStatus::words(cp) as u64, 0)?;
        exec.upload(owners_buf, 0, &owners)?;
        exec.upload(stacks_buf, 0, &u32_bytes(&stacks))?;
        Ok(AllocBench {
            mem,
            cp,
            n,
            lane_cap,
            owners: owners_buf,
            stacks: stacks_buf,
            tops,
            pages,
            locs,
            status,
            release_status,
            host: AllocInputs {
                owners,
                stacks,
                tops_full,
                tops_after,
                selected,
                lane_cap,
            },
        })
    }

    /// Requests per launch.
    pub fn n(&self) -> u32 {
        self.n
    }

    /// CP degree.
    pub fn cp(&self) -> u8 {
        self.cp
    }

    /// Uploads full tops (and fresh stacks), then launches select (not synchronised).
    pub fn run_select(&self, kernel: KernelId, spec: &KernelSpec) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        let d = spec.launch_dims(self.n, 1);
        exec.launch(
            kernel,
            &LaunchConfig::linear(d.grid, d.block),
            &[
                KernelArg::Ptr(self.owners, 0),
                KernelArg::U32(self.n),
                KernelArg::Ptr(self.stacks, 0),
                KernelArg::Ptr(self.tops, 0),
                KernelArg::U32(self.lane_cap),
                KernelArg::Ptr(self.pages, 0),
                KernelArg::Ptr(self.locs, 0),
                KernelArg::Ptr(self.status, 0),
            ],
        )
    }

    /// Launches release of the selected pages (not synchronised).
    pub fn run_release(&self, kernel: KernelId, spec: &KernelSpec) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        let d = spec.launch_dims(self.n, 1);
        exec.launch(
            kernel,
            &LaunchConfig::linear(d.grid, d.block),
            &[
                KernelArg::Ptr(self.pages, 0),
                KernelArg::U32(self.n),
                KernelArg::Ptr(self.stacks, 0),
                KernelArg::Ptr(self.tops, 0),
                KernelArg::U32(self.lane_cap),
                KernelArg::Ptr(self.release_status, 0),
            ],
        )
    }

    /// Restores the state select starts from (fresh stacks, full tops, a clear status).
    pub fn reset_for_select(&self) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        exec.upload(self.stacks, 0, &u32_bytes(&self.host.stacks))?;
        exec.upload(self.tops, 0, &u32_bytes(&self.host.tops_full))?;
        exec.upload(self.status, 0, &vec![0u8; 4 * SelectStatus::words(self.cp)])
    }

    /// Restores the state release starts from (tops after select, selected pages, a clear
    /// status).
    pub fn reset_for_release(&self) -> Result<(), ExecError> {
        let exec = self.mem.exec;
        exec.upload(self.pages, 0, &u32_bytes(&self.host.selected))?;
        exec.upload(self.tops, 0, &u32_bytes(&self.host.tops_after))?;
        exec.upload(
            self.release_status,
            0,
            &vec![0u8; 4 * ReleaseStatus::words(self.cp)],
        )
    }

    /// Times select or release (`spec`'s family decides), each repeat from a fresh state; the
    /// state upload is outside the timed section.
    pub fn time(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        sizes: &Sizes,
    ) -> Result<Timing, ExecError> {
        let exec = self.mem.exec;
        let select = matches!(spec, KernelSpec::SelectOwnerPages(_));
        time_device(
            exec,
            sizes.warmup,
            sizes.repeats,
            || {
                if select {
                    self.reset_for_select()
                } else {
                    self.reset_for_release()
                }?;
                exec.synchronize()
            },
            || {
                if select {
                    self.run_select(kernel, spec)
                } else {
                    self.run_release(kernel, spec)
                }
            },
        )
    }

    /// Times the Rust reference of select or release on the same inputs (the allocator
    /// baseline: what the host-side allocator does per request).
    pub fn time_reference(&self, spec: &KernelSpec, sizes: &Sizes) -> Result<Timing, TuningError> {
        let h = &self.host;
        let page_size = match spec {
            KernelSpec::SelectOwnerPages(s) => s.page_size,
            _ => 1,
        };
        let mut stacks = h.stacks.clone();
        let mut tops = h.tops_full.clone();
        let mut status = vec![0u32; SelectStatus::words(self.cp)];
        let reference = |e: crate::kernels::reference::ReferenceError| TuningError::Reference {
            what: "allocator",
            message: e.to_string(),
        };
        if matches!(spec, KernelSpec::SelectOwnerPages(_)) {
            time_with(
                sizes.warmup,
                sizes.repeats,
                || Ok(()),
                || {
                    // Resetting CP tops is negligible next to the selection itself.
                    tops.copy_from_slice(&h.tops_full);
                    let out = crate::kernels::reference::select_owner_pages(
                        self.cp,
                        page_size,
                        &h.owners,
                        &h.stacks,
                        &mut tops,
                        h.lane_cap,
                        &mut status,
                    )
                    .map_err(reference)?;
                    std::hint::black_box(out);
                    Ok(())
                },
            )
        } else {
            time_with(
                sizes.warmup,
                sizes.repeats,
                || Ok(()),
                || {
                    tops.copy_from_slice(&h.tops_after);
                    crate::kernels::reference::release_pages(
                        self.cp,
                        &h.selected,
                        &mut stacks,
                        &mut tops,
                        h.lane_cap,
                        &mut status,
                    )
                    .map_err(reference)?;
                    std::hint::black_box(&stacks);
                    Ok(())
                },
            )
        }
    }
}

/// The error for a DMA request on anything but a transfer.
pub fn no_dma_path() -> ExecError {
    ExecError::Config {
        name: "transfer path",
        value: "dma".into(),
        reason: "only transfers have a DMA path; materialise gathers with a kernel".into(),
    }
}

/// What the copy baseline of `backend` is called in reports.
pub fn baseline_name(backend: Backend) -> &'static str {
    match backend {
        Backend::Cuda => "cuMemcpyAsync",
        _ => "memcpy",
    }
}

/// Times one contiguous copy of `bytes` from `from` memory to `to` memory through
/// [`Executor::copy_regions`]: `memcpy` on the host executor (single-threaded, like its
/// launches), a pinned `cuMemcpyAsync` on CUDA (host memory is pinned). The baseline every
/// page-copy kernel is compared with in the same run.
pub fn time_copy_baseline(
    exec: &dyn Executor,
    from: MemKind,
    to: MemKind,
    bytes: u64,
    sizes: &Sizes,
) -> Result<Timing, ExecError> {
    let mut mem = Owned {
        exec,
        ids: Vec::new(),
    };
    let src = mem.alloc(from, bytes, 0x5A)?;
    let dst = mem.alloc(to, bytes, 0)?;
    let region = [CopyRegion {
        src_offset: 0,
        dst_offset: 0,
        len: bytes,
    }];
    time_sized(exec, sizes, || exec.copy_regions(src, dst, &region))
}

/// Pages a synthesise or verify timing covers: those kernels compute a splitmix64 draw for
/// every 8 bytes, so far fewer pages than a copy give a stable timing.
const SYNTH_PAGES: u32 = 8;

/// The pages a synthesise or verify bench of `sizes` really runs (a few: see [`SynthBench`]).
pub fn synth_pages(sizes: &Sizes) -> u32 {
    SYNTH_PAGES.min(sizes.pages.max(1))
}

/// Buffers of one synthesise or verify kernel: a pool (or dense buffer) of
/// a few (`SYNTH_PAGES`) pages, all owned by rank 0, and random prefix hashes. Verify runs over
/// the correctly synthesised bytes ([`SynthBench::for_verify`]), the path of every cache hit:
/// a mismatch costs the kernel an atomic that a match does not, so timing it over poison
/// would time the failure path.
pub struct SynthBench<'e> {
    mem: Owned<'e>,
    target: BufferId,
    hashes: BufferId,
    seq_pages: BufferId,
    /// Verify's bitmap of mismatched tokens (one bit per token).
    bad_tokens: BufferId,
    n_pages: u32,
    n_tokens: u32,
    layers: u32,
}

impl<'e> SynthBench<'e> {
    /// Allocates the buffers for the synthesise kernel `spec` (a pool of one of its `cp`
    /// ranks), poisoned.
    pub fn new(
        exec: &'e dyn Executor,
        spec: &SynthSpec,
        sizes: &Sizes,
        seed: u64,
    ) -> Result<SynthBench<'e>, TuningError> {
        let shape = (spec.buffer, spec.cp, spec.page_size, spec.order);
        Self::build(exec, shape, sizes, seed, false)
    }

    /// Allocates the buffers for a verify kernel of `buffer` at `page_size`: a dense buffer
    /// that holds the synthesised bytes of every token (`reference::synthesise`), so the
    /// kernel finds no mismatch.
    pub fn for_verify(
        exec: &'e dyn Executor,
        spec: &VerifySpec,
        sizes: &Sizes,
        seed: u64,
    ) -> Result<SynthBench<'e>, TuningError> {
        let shape = (spec.buffer, 1, spec.page_size, spec.order);
        Self::build(exec, shape, sizes, seed, true)
    }

    /// The buffers for (buffer kind, CP, page size, token order).
    fn build(
        exec: &'e dyn Executor,
        (buffer, cp, page_size, order): (BufferKind, u8, u32, TokenOrder),
        sizes: &Sizes,
        seed: u64,
        synthesised: bool,
    ) -> Result<SynthBench<'e>, TuningError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        // Token-interleaved sequences are whole granules of `cp` pages.
        let granule = match order {
            TokenOrder::Paged => 1,
            TokenOrder::Interleaved { cp, .. } => u32::from(cp),
        };
        let n_pages = synth_pages(sizes).div_ceil(granule) * granule;
        let layers = sizes.layers.max(1);
        let n_tokens = n_pages * page_size;
        // Page `(i + 1) * cp` is owned by rank 0 and sits at local page `i + 1`.
        let pages: Vec<u32> = (0..n_pages).map(|i| (i + 1) * u32::from(cp)).collect();
        let local_pages = n_pages + 1;
        let bytes = u64::from(layers) * u64::from(local_pages) * buffer.page_bytes(page_size);
        let target = mem.alloc(MemKind::Device, bytes, 0xA5)?;
        let hashes = mem.alloc(MemKind::Device, 8 * u64::from(n_tokens), 0)?;
        let seq_pages = mem.alloc(MemKind::Device, 4 * u64::from(n_pages), 0)?;
        let bad_tokens = mem.alloc(MemKind::Device, 4 * u64::from(n_tokens.div_ceil(32)), 0)?;
        let mut rng = SplitMix(seed);
        let words: Vec<u64> = (0..n_tokens).map(|_| rng.next_u64()).collect();
        let h: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        exec.upload(hashes, 0, &h)?;
        exec.upload(seq_pages, 0, &u32_bytes(&pages))?;
        if synthesised {
            // Verify reads `target` as the dense [layer][n_pages][page bytes] from its start,
            // holding every token's bytes where the token order places it.
            let dense = crate::kernels::reference::dense(
                buffer, page_size, order, &words, n_tokens, layers,
            )
            .map_err(|e| TuningError::Reference {
                what: "synthesise",
                message: e.to_string(),
            })?;
            exec.upload(target, 0, &dense)?;
        }
        Ok(SynthBench {
            mem,
            target,
            hashes,
            seq_pages,
            bad_tokens,
            n_pages,
            n_tokens,
            layers,
        })
    }

    /// Launches `kernel` (a candidate of this bench's spec key) without synchronising.
    pub fn launch(&self, kernel: KernelId, spec: &KernelSpec) -> Result<(), ExecError> {
        let d = spec.launch_dims(
            match spec {
                KernelSpec::Verify(_) => self.n_tokens,
                _ => self.n_pages,
            },
            self.layers,
        );
        let cfg = LaunchConfig::linear(d.grid, d.block);
        let args: Vec<KernelArg<'_>> = match spec {
            KernelSpec::Verify(_) => vec![
                KernelArg::Ptr(self.target, 0),
                KernelArg::Ptr(self.hashes, 0),
                KernelArg::U32(self.n_tokens),
                KernelArg::U32(0),
                KernelArg::U32(self.layers),
                KernelArg::Ptr(self.bad_tokens, 0),
            ],
            _ => vec![
                KernelArg::Ptr(self.target, 0),
                KernelArg::Ptr(self.hashes, 0),
                KernelArg::Ptr(self.seq_pages, 0),
                KernelArg::U32(self.n_tokens),
                KernelArg::U32(0),
                KernelArg::U32(0),
                KernelArg::U32(self.layers),
                KernelArg::U32(self.n_pages + 1),
            ],
        };
        self.mem.exec.launch(kernel, &cfg, &args)
    }

    /// Times `kernel`: launch and synchronise, median of the repeats.
    pub fn time(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        sizes: &Sizes,
    ) -> Result<Timing, ExecError> {
        time_sized(self.mem.exec, sizes, || self.launch(kernel, spec))
    }
}

/// The busy kernel's output buffer: `n` words on the device, each thread computing one
/// (docs/KERNELS.md "busy").
pub struct BusyBench<'e> {
    mem: Owned<'e>,
    out: BufferId,
    /// Output words: one per thread of the launch.
    pub n: u32,
}

impl<'e> BusyBench<'e> {
    /// Words enough to fill an H200's 132 SMs at 2048 resident threads each, twice over.
    pub const GPU_WORDS: u32 = 132 * 2048 * 2;

    /// Allocates `n` output words on `exec`'s device, poisoned.
    pub fn new(exec: &'e dyn Executor, n: u32) -> Result<BusyBench<'e>, ExecError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        let out = mem.alloc(MemKind::Device, 4 * u64::from(n), 0xA5)?;
        Ok(BusyBench { mem, out, n })
    }

    /// The output buffer.
    pub fn out(&self) -> BufferId {
        self.out
    }

    /// Launches `kernel` (compiled from the busy `spec`) for `rounds` rounds per word,
    /// without synchronising.
    pub fn launch(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        rounds: u32,
        seed: u32,
    ) -> Result<(), ExecError> {
        let d = spec.launch_dims(self.n, 1);
        let cfg = LaunchConfig::linear(d.grid, d.block);
        self.mem.exec.launch(
            kernel,
            &cfg,
            &[
                KernelArg::Ptr(self.out, 0),
                KernelArg::U32(self.n),
                KernelArg::U32(rounds),
                KernelArg::U32(seed),
            ],
        )
    }
}

/// The busy kernel on a companion executor ([`Executor::companion`]: the same GPU, its own
/// stream), to time work on the main executor while the SMs are busy, as an engine's
/// transfers run while the model computes.
pub struct Beside {
    comp: Box<dyn Executor>,
    kernel: KernelId,
    spec: KernelSpec,
    out: BufferId,
    n: u32,
    /// Seconds of one round over every word, measured alone.
    round_seconds: f64,
}

/// What one piece of work cost, and cost the busy kernel, when they ran together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BesideTiming {
    /// Seconds of the work while the busy kernel ran.
    pub seconds: f64,
    /// Busy kernel seconds beside the work over its seconds alone (same rounds).
    pub busy_slowdown: f64,
}

impl Beside {
    /// Opens `exec`'s companion and compiles the busy kernel for it. `Ok(None)` when
    /// `exec` has none (the host executor); `Err` says why the busy kernel cannot run.
    pub fn open(exec: &dyn Executor, jit: &Jit) -> Result<Option<Beside>, String> {
        let comp = match exec.companion() {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(None),
            Err(e) => return Err(format!("no companion executor: {e}")),
        };
        let spec = KernelSpec::Busy(crate::kernels::BusySpec::default());
        // SAFETY: no hook: the JIT's build of the busy spec's render.
        let kernel = unsafe { compile_and_load(comp.as_ref(), jit, &[spec], true, None, &|| {}) }
            .pop()
            .unwrap_or_else(|| Err("internal: no compile result".into()))
            .map_err(|e| format!("busy kernel: {e}"))?;
        let n = BusyBench::GPU_WORDS;
        let out = comp
            .alloc(MemKind::Device, 4 * n as usize, 0)
            .map_err(|e| format!("busy kernel buffer: {e}"))?;
        let mut b = Beside {
            comp,
            kernel,
            spec,
            out,
            n,
            round_seconds: 0.0,
        };
        const CALIBRATION_ROUNDS: u32 = 4096;
        let alone = b
            .time_alone(CALIBRATION_ROUNDS)
            .map_err(|e| format!("busy kernel calibration: {e}"))?;
        b.round_seconds = alone / f64::from(CALIBRATION_ROUNDS);
        Ok(Some(b))
    }

    fn launch(&self, rounds: u32) -> Result<(), ExecError> {
        let d = self.spec.launch_dims(self.n, 1);
        self.comp.launch(
            self.kernel,
            &LaunchConfig::linear(d.grid, d.block),
            &[
                KernelArg::Ptr(self.out, 0),
                KernelArg::U32(self.n),
                KernelArg::U32(rounds),
                KernelArg::U32(0x5EED),
            ],
        )
    }

    fn time_alone(&self, rounds: u32) -> Result<f64, ExecError> {
        self.comp.time_work(&mut || self.launch(rounds))
    }

    /// Runs the busy kernel for about twice `expected` seconds on the companion and times
    /// `repeats` runs of `work` on `exec` meanwhile: the work's seconds per run, and how much
    /// it slowed the busy kernel (timed alone at the same rounds afterwards).
    pub fn time_beside(
        &self,
        exec: &dyn Executor,
        expected: f64,
        repeats: u32,
        work: &(dyn Fn() -> Result<(), ExecError> + Sync),
    ) -> Result<BesideTiming, ExecError> {
        let repeats = repeats.max(1);
        let span = 2.0 * expected * f64::from(repeats) + 1e-3;
        let rounds = (span / self.round_seconds.max(1e-12)).clamp(1.0, f64::from(u32::MAX)) as u32;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (busy, timed) = std::thread::scope(|s| {
            let busy = s.spawn(move || {
                self.comp.time_work(&mut || {
                    let r = self.launch(rounds);
                    // The work starts once the busy kernel is enqueued (or failed to be).
                    let _ = tx.send(());
                    r
                })
            });
            let _ = rx.recv();
            let timed = exec.time_work(&mut || (0..repeats).try_for_each(|_| work()));
            let busy = busy.join().unwrap_or_else(|_| {
                Err(ExecError::Driver {
                    op: "busy kernel",
                    message: "the timing thread panicked".into(),
                })
            });
            (busy, timed)
        });
        let (busy, timed) = (busy?, timed?);
        let alone = self.time_alone(rounds)?;
        Ok(BesideTiming {
            seconds: timed / f64::from(repeats),
            busy_slowdown: busy / alone.max(1e-12),
        })
    }
}

impl Drop for Beside {
    fn drop(&mut self) {
        let _ = self.comp.free(self.out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
        assert_eq!(
            Timing::of(vec![4.0, 1.0, 3.0, 2.0]),
            Timing {
                median: 2.5,
                min: 1.0
            }
        );
        assert_eq!(Timing::of(vec![3.0, 1.0, 2.0]).median, 2.0);
        assert_eq!(Timing::of(vec![5.0]).median, 5.0);
    }

    /// The harness refuses transfer pairs with one destination page twice before it
    /// allocates anything, so neither the kernel nor the DMA path of `tune`, `bench` or
    /// `bench --check` can launch them.
    #[test]
    fn a_transfer_workload_with_one_destination_twice_is_refused() {
        use crate::exec::{HostExecutor, HostOptions};
        use crate::kernels::{CopyLaunch, HostLayout};
        let exec = HostExecutor::new(HostOptions::default());
        let spec = TransferSpec {
            second_bytes_per_token: None,
            direction: Direction::HostToDevice,
            layout: HostLayout::PageFirst,
            page_size: 4,
            bytes_per_token: 8,
            launch: CopyLaunch::default(),
        };
        let pools = PoolShape {
            layers: 2,
            device_pages: 8,
            host_pages: 8,
        };
        let before = exec.counters();
        let err = CopyBench::transfer(&exec, &spec, pools, vec![0, 1, 2], vec![5, 3, 5], 0..2)
            .err()
            .expect("refused");
        assert!(
            matches!(
                err,
                TuningError::Transfer(crate::kernels::DuplicateDestination {
                    page: 5,
                    first: 0,
                    second: 2
                })
            ),
            "{err}"
        );
        assert_eq!(exec.counters().since(&before).allocs, 0);
        let err = CopyBench::transfer(&exec, &spec, pools, vec![0, 1], vec![5], 0..2)
            .err()
            .expect("refused");
        assert!(
            err.to_string()
                .contains("2 source pages for 1 destination pages"),
            "{err}"
        );
        assert_eq!(exec.counters().since(&before).allocs, 0);
        // Distinct destinations build the workload, and both paths run.
        let (b, pages) =
            CopyBench::transfer(&exec, &spec, pools, vec![0, 1, 2], vec![5, 3, 4], 0..2).unwrap();
        assert_eq!(pages.second, [5, 3, 4]);
        b.copy_dma().unwrap();
    }
}
