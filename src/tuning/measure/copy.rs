//! The page-copy benches (transfer and materialise): their buffers, page ids and argument
//! lists, the DMA path of transfers, and the contiguous-copy baseline they are compared with.

use std::ops::Range;

use super::timing::{time_sized, time_submitted, Sizes, Timing};
use super::workload::{u32_bytes, Owned, SplitMix};
use crate::exec::{
    Backend, BufferId, CopyRegion, DmaMode, ExecError, Executor, KernelArg, KernelId, LaunchConfig,
    MemKind,
};
use crate::kernels::reference::host_offset;
use crate::kernels::{
    check_distinct_destinations, clamp_layer_range, layer_range_args, page_stride, transfer_args,
    transfer_regions, transfer_regions_at, Direction, KernelSpec, PageTable, PoolShape,
    TransferSpec,
};
use crate::tuning::TuningError;

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
        /// Staging page of each pair (its index; `u32::MAX` where the host page is outside
        /// its pool, so the kernel skips the pair as the direct path does).
        staged_pages: BufferId,
    },
    Materialise {
        pools: Vec<BufferId>,
        /// The pools as the kernel's page table.
        table: PageTable,
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
    /// The device pool as the kernel's page table.
    pub table: PageTable,
    /// The staged path's device buffer: the transfer's pages, one after another, in the
    /// host pool's layout ([`CopyBench::copy_staged`]).
    pub staging: BufferId,
    /// The staged path's copies: host pool pages to staging pages (host → device), or back.
    pub staged_regions: Vec<CopyRegion>,
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
                    pools.push(mem.alloc(MemKind::Device, pool_bytes, 0xA5)?);
                }
                // Owner-major, as the kernel reads it: rank r's layer l at r × layers + l.
                let at = mem.alloc(MemKind::Device, 8 * u64::from(cp * layers.max(1)), 0)?;
                let table = PageTable {
                    at: (at, 0),
                    entries: pools
                        .iter()
                        .flat_map(|&p| {
                            PageTable::layer_major((at, 0), p, layers, local_pages, page_bytes)
                                .entries
                        })
                        .collect(),
                    page_stride: page_stride(page_bytes),
                };
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
                            table,
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
        // The staged path's page of each pair: its index, unless a page of the pair is
        // outside its pool (the pair is skipped both ways, as the direct paths skip it: no
        // staging page of poison reaches the host).
        let [(_, src_cap), (_, dst_cap)] = pools.ends(s.direction);
        let staged: Vec<u32> = src_pages
            .iter()
            .zip(&dst_pages)
            .enumerate()
            .map(|(i, (&sp, &dp))| {
                if sp < src_cap && dp < dst_cap {
                    i as u32
                } else {
                    u32::MAX
                }
            })
            .collect();
        let staging_pools = PoolShape {
            layers,
            device_pages: n,
            host_pages,
        };
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
            let at = mem.alloc(MemKind::Device, 8 * u64::from(layers.max(1)), 0)?;
            let table = PageTable::layer_major((at, 0), dev, layers, device_pages, page_bytes);
            let staging = mem.alloc(
                MemKind::Device,
                u64::from(layers) * u64::from(n.max(1)) * page_bytes,
                0xA5,
            )?;
            // Staging page i sits where host page i of an n-page pool would.
            let at_staging = |p: u32, l: u32| host_offset(d.layout, p, l, layers, n, page_bytes);
            let staged_regions = match s.direction {
                Direction::HostToDevice => transfer_regions_at(
                    &d,
                    &src_pages,
                    &staged,
                    staging_pools,
                    layer_range.clone(),
                    at_staging,
                ),
                Direction::DeviceToHost => transfer_regions_at(
                    &d,
                    &staged,
                    &dst_pages,
                    staging_pools,
                    layer_range.clone(),
                    at_staging,
                ),
            };
            buffers.push(TransferBuffers {
                src,
                dst,
                regions,
                table,
                staging,
                staged_regions,
            });
        }
        let page_bytes = s.total_page_bytes();
        let src_buf = mem.alloc(MemKind::Device, 4 * u64::from(n), 0)?;
        let dst_buf = mem.alloc(MemKind::Device, 4 * u64::from(n), 0)?;
        exec.upload(src_buf, 0, &u32_bytes(&src_pages))?;
        exec.upload(dst_buf, 0, &u32_bytes(&dst_pages))?;
        let staged_buf = mem.alloc(MemKind::Device, 4 * u64::from(n), 0)?;
        exec.upload(staged_buf, 0, &u32_bytes(&staged))?;
        let (first_layer, layer_count) = layer_range_args(&layer_range);
        Ok((
            CopyBench {
                mem,
                kind: CopyKind::Transfer {
                    buffers,
                    src_pages: src_buf,
                    dst_pages: dst_buf,
                    direction: s.direction,
                    staged_pages: staged_buf,
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

    /// The recommended grid of `spec` (a candidate of this bench's spec key) for this
    /// workload.
    fn launch_config(&self, spec: &KernelSpec) -> LaunchConfig {
        let d = spec.launch_dims(self.n, self.launch_layers());
        LaunchConfig::linear(d.grid, d.block)
    }

    fn launch_layers(&self) -> u32 {
        self.layer_range().len() as u32
    }

    /// The buffers: (sources, destination). For a transfer its first buffer's source (see
    /// [`CopyBench::transfer_buffers`] for every buffer); for materialise the CP pools.
    pub fn buffers(&self) -> (Vec<BufferId>, BufferId) {
        match &self.kind {
            CopyKind::Transfer { buffers, .. } => (vec![buffers[0].src], buffers[0].dst),
            CopyKind::Materialise { pools, dense, .. } => (pools.clone(), *dense),
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
        let cfg = self.launch_config(spec);
        let exec = self.mem.exec;
        match &self.kind {
            CopyKind::Transfer { .. } => self.launch_transfer(kernel, &cfg, false, None),
            CopyKind::Materialise {
                table,
                seq_pages,
                dense,
                ..
            } => exec.launch(
                kernel,
                &cfg,
                &[
                    table.arg(),
                    KernelArg::Ptr(*seq_pages, 0),
                    KernelArg::U32(self.n),
                    KernelArg::U32(self.layers),
                    KernelArg::U32(self.device_pages),
                    KernelArg::U32(table.page_stride),
                    KernelArg::Ptr(*dense, 0),
                ],
            ),
        }
    }

    /// [`CopyBench::launch`] of a stamped transfer ([`TransferSpec::stamps`]), whose block
    /// stamps go to `stamps` (on this bench's executor,
    /// [`TRANSFER_STAMP_BYTES`](crate::kernels::TRANSFER_STAMP_BYTES) long; the
    /// caller resets them).
    pub fn launch_stamped(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        stamps: BufferId,
    ) -> Result<(), ExecError> {
        self.launch_transfer(kernel, &self.launch_config(spec), false, Some(stamps))
    }

    /// Launches a transfer kernel between the device pools and the host pools, or with
    /// `staged` the staging buffers (an n-page pool in the host layout, pair i at page i);
    /// a stamped one with its `stamps`.
    fn launch_transfer(
        &self,
        kernel: KernelId,
        cfg: &LaunchConfig,
        staged: bool,
        stamps: Option<BufferId>,
    ) -> Result<(), ExecError> {
        let CopyKind::Transfer {
            buffers,
            src_pages,
            dst_pages,
            direction,
            staged_pages,
        } = &self.kind
        else {
            return Err(no_dma_path());
        };
        let ends: Vec<(&PageTable, (BufferId, u64))> = buffers
            .iter()
            .map(|b| {
                let host = match (staged, direction) {
                    (true, _) => b.staging,
                    (false, Direction::DeviceToHost) => b.dst,
                    (false, Direction::HostToDevice) => b.src,
                };
                (&b.table, (host, 0))
            })
            .collect();
        let pools = PoolShape {
            layers: self.layers,
            device_pages: self.device_pages,
            host_pages: if staged { self.n } else { self.host_pages },
        };
        let pages = match (staged, direction) {
            (false, _) => (*src_pages, *dst_pages),
            (true, Direction::HostToDevice) => (*staged_pages, *dst_pages),
            (true, Direction::DeviceToHost) => (*src_pages, *staged_pages),
        };
        let mut args = transfer_args(
            &ends,
            pages,
            self.n,
            pools,
            (self.first_layer, self.layer_count),
        );
        args.extend(stamps.map(|b| KernelArg::Ptr(b, 0)));
        self.mem.exec.launch(kernel, cfg, &args)
    }

    /// Enqueues the staged path of the transfer (`kernel` compiled from `spec`): the host
    /// pool's pages as contiguous runs by DMA (`mode`) to or from a device staging buffer
    /// that holds them one after another, and the transfer kernel between that buffer and the
    /// device pools (device to device). Host → device copies then scatters; device → host
    /// gathers then copies. On the page-first host layout each pair is one run of every
    /// layer, where the direct DMA path makes one copy per page and layer.
    pub fn copy_staged(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        mode: DmaMode,
    ) -> Result<(), ExecError> {
        let CopyKind::Transfer {
            buffers, direction, ..
        } = &self.kind
        else {
            return Err(no_dma_path());
        };
        let cfg = self.launch_config(spec);
        let exec = self.mem.exec;
        let copies = || {
            buffers.iter().try_for_each(|b| {
                let (from, to) = match direction {
                    Direction::HostToDevice => (b.src, b.staging),
                    Direction::DeviceToHost => (b.staging, b.dst),
                };
                exec.copy_regions_with(from, to, &b.staged_regions, mode)
            })
        };
        match direction {
            Direction::HostToDevice => {
                copies()?;
                self.launch_transfer(kernel, &cfg, true, None)
            }
            Direction::DeviceToHost => {
                self.launch_transfer(kernel, &cfg, true, None)?;
                copies()
            }
        }
    }

    /// Times the staged path ([`CopyBench::copy_staged`]) and the host's time submitting it,
    /// like [`CopyBench::time_dma_submitted`].
    pub fn time_staged_submitted(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        sizes: &Sizes,
        mode: DmaMode,
    ) -> Result<(Timing, Timing), ExecError> {
        time_submitted(self.mem.exec, sizes, || {
            self.copy_staged(kernel, spec, mode)
        })
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

    /// [`time_dma_with`](Self::time_dma_with), and the host's time submitting each timed
    /// repeat (the copy calls alone, on the host clock), both as medians of the repeats.
    pub fn time_dma_submitted(
        &self,
        sizes: &Sizes,
        mode: DmaMode,
    ) -> Result<(Timing, Timing), ExecError> {
        time_submitted(self.mem.exec, sizes, || self.copy_dma_with(mode))
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
