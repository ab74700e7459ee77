//! The cache's kernels as ops on memory an engine owns: an engine that keeps its own KV
//! cache (its own pools, page tables and request lifecycle) can still take our JIT'd
//! kernels, the way FlashInfer and sgl-kernel serve engines. [`Ops::warm_up`] compiles and
//! loads a deployment's kernels once; each op then launches on the caller's memory, adopted
//! for the call ([`Executor::adopt`]) and checked first.
//!
//! Memory is described per buffer kind as [`Tensors`]: one tensor per layer (SGLang's
//! per-layer `kv` buffers), one layer-major cross-layer tensor (`[layers, pages, page]`), or
//! one page-major tensor (vLLM's cross-layer `[blocks, layers, page]`), any dtype whose
//! items tile a page. Device tensors reach the kernels as page tables
//! ([`PageTable`]), so every order is one launch. Device pools are indexed by local page; host pools follow the
//! deployment's host layout (page-first `[page][layer]` is one cross-layer tensor only).
//!
//! Every op checks its arguments before launching anything and fails with
//! [`OpsError::BadArgument`] naming the argument and the rule it breaks.

use crate::exec::{BufferId, Executor, KernelArg, MemKind};
use crate::jit::{Jit, Sanitize};
use crate::kernels::{
    transfer_args, BufferKind, Deployment, Direction, HostLayout, KernelSpec, PageTable, PoolShape,
    SelectOutput,
};
use crate::rank::{DeploymentKernels, KernelLoadError};
use std::ops::Range;
use std::sync::{Arc, Mutex};

#[cfg(test)]
mod tests;

/// Bytes of memory the caller owns, at an address of the executor's address space.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub bytes: u64,
}

/// One buffer kind's pages as an engine holds them. Device tensors reach the kernels as page
/// tables, so any of these serves; a host tensor follows the deployment's host layout and a
/// dense output is layer-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Tensors {
    /// `[layers][pages][page_bytes]` in one tensor (or, for a host pool, the deployment's
    /// host layout).
    CrossLayer(Region),
    /// One `[pages][page_bytes]` tensor per layer (SGLang's per-layer buffers).
    PerLayer(Vec<Region>),
    /// `[pages][layers][page_bytes]` in one tensor: vLLM's cross-layer KV cache
    /// (`[num_blocks, num_layers, ...]`), pages `layers × page_bytes` apart. Device tensors
    /// and pools only.
    PageMajor(Region),
}

impl Tensors {
    /// The memory regions, in layer order (one for a single tensor).
    pub fn regions(&self) -> &[Region] {
        match self {
            Tensors::CrossLayer(r) | Tensors::PageMajor(r) => std::slice::from_ref(r),
            Tensors::PerLayer(v) => v,
        }
    }

    /// Bytes from one page of a layer to the next, for pages of `page_bytes` in `layers`
    /// layers.
    pub fn page_stride(&self, layers: u32, page_bytes: u64) -> u64 {
        match self {
            Tensors::PageMajor(_) => u64::from(layers) * page_bytes,
            _ => page_bytes,
        }
    }
}

/// An engine's owner lanes, as the allocator kernels keep them: lane `r` holds the free
/// pages of rank `r` (pages `p` with `p % cp == r`) as a stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lanes {
    /// `u32[cp][lane_cap]`: lane `r`'s pages in `stacks[r][..tops[r]]`, top last.
    pub stacks: Region,
    /// `u32[cp]`: pages in each lane.
    pub tops: Region,
    /// `u32[cp + 2]`: refused launches, each lane's deficit (select) or overflow (release),
    /// bad owners or pages: the kernels' status words, left alone by a granted launch.
    pub status: Region,
}

/// The alignment every tensor's start needs: the kernels move pages in 16-byte vectors.
pub const ALIGN: u64 = 16;

/// Why an op refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum OpsError {
    /// An argument breaks a rule; nothing was launched.
    #[error("{what}: {why}")]
    BadArgument {
        /// The argument (`device[kv] layer 3`, `dst_pages[7]`).
        what: String,
        /// The rule it breaks.
        why: String,
    },
    /// The kernels could not be made ready.
    #[error(transparent)]
    Kernels(#[from] KernelLoadError),
    /// A selection the lanes cannot give (all or nothing: no lane changed).
    #[error(
        "the lanes cannot give these owners' pages: {}; no lane changed",
        short.iter().enumerate().filter(|(_, &d)| d > 0)
            .map(|(r, d)| format!("lane {r} is {d} short")).collect::<Vec<_>>().join(", ")
    )]
    LanesShort {
        /// Each lane's deficit.
        short: Vec<u32>,
    },
    /// A release the lanes cannot take (all or nothing: no lane changed).
    #[error(
        "the lanes cannot take these pages back: {}; no lane changed",
        over.iter().enumerate().filter(|(_, &d)| d > 0)
            .map(|(r, d)| format!("lane {r} has no room for {d}")).collect::<Vec<_>>().join(", ")
    )]
    LanesFull {
        /// Pages each lane had no room for.
        over: Vec<u32>,
    },
    /// The executor failed (a launch, adopting the memory).
    #[error(transparent)]
    Exec(#[from] crate::exec::ExecError),
}

fn bad(what: impl Into<String>, why: impl Into<String>) -> OpsError {
    OpsError::BadArgument {
        what: what.into(),
        why: why.into(),
    }
}

/// A deployment's kernels, loaded into an executor, as ops on the caller's memory.
pub struct Ops {
    deployment: Deployment,
    layers: u32,
    exec: Arc<dyn Executor>,
    kernels: DeploymentKernels,
    /// The owner-page selection kernels, with token locations and without them.
    select_locs: crate::exec::KernelId,
    select_pages: crate::exec::KernelId,
    /// The lane release kernel.
    release: crate::exec::KernelId,
    /// Page tables and scratch kept from call to call; locked for a whole op.
    kept: Mutex<Kept>,
}

/// What ops keep between calls, so that a warm call allocates and frees nothing (on CUDA a
/// `cuMemAlloc` or `cuMemFree` can stall every stream of the device), and a table whose
/// bytes did not change is not uploaded again (the executor skips a table it finds written).
/// Every op's work goes to the executor's one stream, in order, so one buffer per scratch
/// place is reused safely: a later call's upload runs after the earlier call's launches.
#[derive(Default)]
struct Kept {
    /// Page tables by the tensor set they describe (see [`Adopted::table`]), oldest first.
    tables: Vec<(Vec<u64>, BufferId)>,
    /// Scratch buffers (page ids, owners) by their place in a call, with their sizes; grown,
    /// never shrunk.
    scratch: Vec<(BufferId, usize)>,
}

/// The most page tables kept: an engine passes the same few tensor sets over and over.
const KEPT_TABLES: usize = 32;

/// Regions adopted for one op, forgotten (never freed) when it ends, and the tables and
/// scratch it uses from [`Kept`].
struct Adopted<'a> {
    exec: &'a dyn Executor,
    ids: Vec<BufferId>,
    kept: std::sync::MutexGuard<'a, Kept>,
    /// The next scratch place of this call.
    next_scratch: usize,
}

impl Adopted<'_> {
    /// Adopts `t`'s regions; returns their ids in layer order (one for a cross-layer tensor).
    ///
    /// # Safety
    /// As [`Executor::adopt`] for every region.
    unsafe fn tensors(&mut self, t: &Tensors) -> Result<Vec<BufferId>, OpsError> {
        let regions = t.regions();
        let mut out = Vec::with_capacity(regions.len());
        for r in regions {
            // SAFETY: the caller's contract.
            let id = unsafe { self.exec.adopt(r.addr, r.bytes as usize) }?;
            self.ids.push(id);
            out.push(id);
        }
        Ok(out)
    }

    /// The page table of tensors `t` (adopted as `ids`), `layers` layers of `pages` pages:
    /// several tables in a row, owner-major, when `t` holds several owners' tensors.
    fn table(
        &mut self,
        t: &[(&Tensors, &[BufferId])],
        layers: u32,
        pages: u32,
        page_bytes: u64,
    ) -> Result<PageTable, OpsError> {
        // The table's bytes follow from the tensors' regions and kinds and these three.
        let mut key = vec![u64::from(layers), u64::from(pages), page_bytes];
        for (tensors, _) in t {
            key.push(match tensors {
                Tensors::CrossLayer(_) => 0,
                Tensors::PerLayer(_) => 1,
                Tensors::PageMajor(_) => 2,
            });
            for r in tensors.regions() {
                key.extend([r.addr, r.bytes]);
            }
        }
        let tables = &mut self.kept.tables;
        let at = match tables.iter().position(|(k, _)| *k == key) {
            Some(i) => {
                let hit = tables.remove(i);
                let at = hit.1;
                tables.push(hit);
                at
            }
            None => {
                let at = self
                    .exec
                    .alloc(MemKind::Device, 8 * t.len() * layers as usize, 0)?;
                if tables.len() >= KEPT_TABLES {
                    let (_, old) = tables.remove(0);
                    self.exec.free(old)?;
                }
                tables.push((key, at));
                at
            }
        };
        let stride = t
            .first()
            .map_or(page_bytes, |(t, _)| t.page_stride(layers, page_bytes));
        Ok(PageTable {
            at: (at, 0),
            entries: t
                .iter()
                .flat_map(|&(t, ids)| {
                    (0..layers).map(move |l| layer_at(t, ids, l, pages, page_bytes))
                })
                .collect(),
            page_stride: u32::try_from(stride).map_err(|_| {
                bad(
                    "tensors",
                    format!("a page stride of {stride} bytes does not fit 32 bits"),
                )
            })?,
        })
    }

    fn scratch(&mut self, words: &[u32]) -> Result<BufferId, OpsError> {
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.scratch_bytes(&bytes)
    }

    /// `bytes` uploaded into this call's next scratch place (kept from call to call).
    fn scratch_bytes(&mut self, bytes: &[u8]) -> Result<BufferId, OpsError> {
        let place = self.next_scratch;
        self.next_scratch += 1;
        let need = bytes.len().max(4);
        let id = match self.kept.scratch.get(place) {
            Some(&(id, size)) if size >= need => id,
            old => {
                let old = old.map(|&(id, _)| id);
                let size = need.next_power_of_two().max(256);
                let id = self.exec.alloc(MemKind::Device, size, 0)?;
                match old {
                    Some(old) => {
                        self.kept.scratch[place] = (id, size);
                        // Back to the driver once the executor's streams are past it.
                        self.exec.free(old)?;
                    }
                    None => self.kept.scratch.push((id, size)),
                }
                id
            }
        };
        self.exec.upload(id, 0, bytes)?;
        Ok(id)
    }
}

impl Drop for Adopted<'_> {
    fn drop(&mut self) {
        // No wait: the launches took the adopted addresses by value (freeing an adopted
        // region only forgets it).
        for &id in &self.ids {
            let _ = self.exec.free(id);
        }
    }
}

impl Drop for Ops {
    fn drop(&mut self) {
        // Back to the driver once the executor's streams are past them (no wait).
        let kept = self.kept.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, id) in kept.tables.drain(..) {
            let _ = self.exec.free(id);
        }
        for (id, _) in kept.scratch.drain(..) {
            let _ = self.exec.free(id);
        }
    }
}

/// Where layer `l`'s first page of a tensor of `pages` pages of `page_bytes` starts, given
/// its regions adopted as `ids` (in order): `(buffer, offset)`.
pub(crate) fn layer_at(
    t: &Tensors,
    ids: &[BufferId],
    l: u32,
    pages: u32,
    page_bytes: u64,
) -> (BufferId, u64) {
    match t {
        Tensors::CrossLayer(_) => (ids[0], u64::from(l) * u64::from(pages) * page_bytes),
        Tensors::PerLayer(_) => (ids[l as usize], 0),
        Tensors::PageMajor(_) => (ids[0], u64::from(l) * page_bytes),
    }
}

impl Ops {
    /// Compiles (or loads from the JIT cache) and loads the transfer and materialise kernels
    /// of `deployment` into `exec`, for pools of `layers` layers.
    pub fn warm_up(
        deployment: Deployment,
        layers: u32,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        sanitize: Sanitize,
    ) -> Result<Ops, OpsError> {
        if layers == 0 {
            return Err(bad("layers", "must be at least 1"));
        }
        let kernels = DeploymentKernels::load(&deployment, jit, exec.as_ref(), sanitize)?;
        let target = crate::jit::target_for(exec.as_ref(), deployment.arch, sanitize)
            .map_err(KernelLoadError::from)?;
        let specs = [
            deployment.select_spec(SelectOutput::PagesAndLocs),
            deployment.select_spec(SelectOutput::Pages),
            deployment.release_spec(),
        ];
        let requests = specs
            .iter()
            .map(|spec| crate::jit::spec_request(spec, target, None))
            .collect::<Result<Vec<_>, _>>()
            .map_err(KernelLoadError::from)?;
        let mut ids = Vec::new();
        for (spec, built) in specs.iter().zip(jit.warm_up(&requests)) {
            let built = built.map_err(KernelLoadError::from)?;
            // SAFETY: `built` is the JIT's build of `spec` for `exec`'s target.
            ids.push(unsafe { built.load_spec(exec.as_ref(), spec) }?);
        }
        Ok(Ops {
            deployment,
            layers,
            exec,
            kernels,
            select_locs: ids[0],
            select_pages: ids[1],
            release: ids[2],
            kept: Mutex::new(Kept::default()),
        })
    }

    /// A call's adopted regions, with the kept tables and scratch locked for it.
    fn held(&self) -> Adopted<'_> {
        Adopted {
            exec: self.exec.as_ref(),
            ids: Vec::new(),
            kept: self.kept.lock().unwrap_or_else(|p| p.into_inner()),
            next_scratch: 0,
        }
    }

    /// The deployment the kernels were built for.
    pub fn deployment(&self) -> &Deployment {
        &self.deployment
    }

    /// Layers per buffer.
    pub fn layers(&self) -> u32 {
        self.layers
    }

    /// The executor the ops launch on.
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.exec
    }

    /// Runs `op` in order with the caller's `stream` (a raw `CUstream` handle on CUDA):
    /// the executor's stream first waits for the work the caller enqueued on `stream` so far,
    /// and `stream` then waits for the op's work, both on the device (events), never on the
    /// host. `None` runs in the executor's own order (the host backend has no other), and
    /// the op has run when this returns (a host synchronisation of the executor's streams).
    ///
    /// # Safety
    /// `stream` must be a live stream of the executor's context.
    pub unsafe fn on_stream<T>(
        &self,
        stream: Option<u64>,
        op: impl FnOnce(&Ops) -> Result<T, OpsError>,
    ) -> Result<T, OpsError> {
        let Some(s) = stream else {
            let out = op(self)?;
            self.exec.synchronize()?;
            return Ok(out);
        };
        // SAFETY: the caller's contract.
        unsafe { self.exec.follow_stream(s) }?;
        let out = op(self);
        // SAFETY: as above.
        let led = unsafe { self.exec.lead_stream(s) };
        let out = out?;
        led?;
        Ok(out)
    }

    /// Pages of a layer-indexed tensor of `buffer`, checked ([`tensor_pages`]).
    fn pages_of(&self, what: &str, buffer: BufferKind, t: &Tensors) -> Result<u32, OpsError> {
        let pb = buffer.page_bytes(self.deployment.page_size);
        tensor_pages(what, buffer, pb, self.layers, t)
    }

    /// Pages of one side of a transfer: the same for every buffer kind.
    fn side_pages(&self, side: &str, tensors: &[Tensors]) -> Result<u32, OpsError> {
        let buffers = self.deployment.model.buffers();
        if tensors.len() != buffers.len() {
            return Err(bad(
                side,
                format!(
                    "{} buffers given, the {} model has {} ({})",
                    tensors.len(),
                    self.deployment.model,
                    buffers.len(),
                    buffers
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ));
        }
        let mut pages = None;
        for (&b, t) in buffers.iter().zip(tensors) {
            let p = self.pages_of(&format!("{side}[{b}]"), b, t)?;
            match pages {
                None => pages = Some(p),
                Some(first) if first != p => {
                    return Err(bad(
                        format!("{side}[{b}]"),
                        format!("{p} pages, but {side}[{}] has {first}", buffers[0]),
                    ))
                }
                Some(_) => {}
            }
        }
        Ok(pages.unwrap_or_default())
    }

    /// Copies page `src_pages[i]` to page `dst_pages[i]` of every buffer kind for the layers
    /// in `layers`, device → host or host → device, with the transfer kernel (one launch
    /// moving every buffer kind, one per layer when the host side is per-layer). Device pages are
    /// the device tensors' local pages. Returns the bytes moved. SGLang: `load_to_device_per_layer`
    /// / `backup_from_device_all_layer` of its host pool; vLLM: a connector's `start_load_kv`.
    ///
    /// # Safety
    /// Every region must be memory of the executor's address space, valid for reads and
    /// writes, and not touched by anyone else until the call returns.
    pub unsafe fn transfer(
        &self,
        dir: Direction,
        device: &[Tensors],
        host: &[Tensors],
        src_pages: &[u32],
        dst_pages: &[u32],
        layers: Range<u32>,
    ) -> Result<u64, OpsError> {
        let device_pages = self.side_pages("device", device)?;
        let host_pages = self.side_pages("host", host)?;
        if src_pages.len() != dst_pages.len() {
            return Err(bad(
                "src_pages, dst_pages",
                format!(
                    "{} source pages but {} destinations",
                    src_pages.len(),
                    dst_pages.len()
                ),
            ));
        }
        if layers.start >= layers.end || layers.end > self.layers {
            return Err(bad(
                "layers",
                format!(
                    "{}..{} is not a non-empty range of the {} layers",
                    layers.start, layers.end, self.layers
                ),
            ));
        }
        let (src_cap, dst_cap) = match dir {
            Direction::DeviceToHost => (device_pages, host_pages),
            Direction::HostToDevice => (host_pages, device_pages),
        };
        for (name, pages, cap) in [
            ("src_pages", src_pages, src_cap),
            ("dst_pages", dst_pages, dst_cap),
        ] {
            if let Some((i, p)) = pages.iter().enumerate().find(|(_, &p)| p >= cap) {
                return Err(bad(
                    format!("{name}[{i}]"),
                    format!("page {p} is outside the {cap} pages of its tensors"),
                ));
            }
        }
        crate::kernels::check_distinct_destinations(dst_pages)
            .map_err(|e| bad("dst_pages", e.to_string()))?;
        for (&b, t) in self.deployment.model.buffers().iter().zip(host) {
            if matches!(t, Tensors::PageMajor(_)) {
                return Err(bad(
                    format!("host[{b}]"),
                    "a page-major tensor is a device pool; a host pool follows the \
                     deployment's host layout: pass it as one cross-layer tensor",
                ));
            }
        }
        let page_first = self.deployment.host_layout == HostLayout::PageFirst;
        // Device tensors are page tables, whatever their order; the host side is one
        // pointer, so per-layer host tensors take a launch per layer.
        let host_cross = host.iter().all(|t| matches!(t, Tensors::CrossLayer(_)));
        if page_first && !host_cross {
            return Err(bad(
                "host",
                format!(
                    "the {} deployment's host pool is page-first ([page][layer]), which \
                     per-layer tensors cannot address: pass one cross-layer host tensor per \
                     buffer",
                    self.deployment.name
                ),
            ));
        }
        let spec = self.deployment.transfer(dir);
        let bytes =
            src_pages.len() as u64 * u64::from(layers.len() as u32) * spec.total_page_bytes();
        if src_pages.is_empty() {
            return Ok(0);
        }
        let mut held = self.held();
        let buffers = self.deployment.model.buffers();
        let mut tables = Vec::new();
        let mut host_ids = Vec::new();
        for ((d, h), b) in device.iter().zip(host).zip(buffers) {
            let pb = b.page_bytes(self.deployment.page_size);
            // SAFETY: the caller's contract.
            let ids = unsafe { held.tensors(d) }?;
            tables.push(held.table(&[(d, &ids)], self.layers, device_pages, pb)?);
            // SAFETY: the caller's contract.
            host_ids.push(unsafe { held.tensors(h) }?);
        }
        let src_buf = held.scratch(src_pages)?;
        let dst_buf = held.scratch(dst_pages)?;
        let k = self.kernels.transfer(dir);
        let n = src_pages.len() as u32;
        let launches: Vec<(u32, u32, Option<u32>)> = if host_cross {
            vec![(layers.start, layers.len() as u32, None)]
        } else {
            layers.clone().map(|l| (0, 1, Some(l))).collect()
        };
        for (first, count, layer) in launches {
            // One layer of each side, or all of them.
            let one: Vec<PageTable>;
            let device_tables: &[PageTable] = match layer {
                None => &tables,
                Some(l) => {
                    one = tables
                        .iter()
                        .map(|t| t.layers(l as usize..l as usize + 1))
                        .collect();
                    &one
                }
            };
            let ends: Vec<(&PageTable, (BufferId, u64))> = device_tables
                .iter()
                .zip(host)
                .zip(&host_ids)
                .zip(buffers)
                .map(|(((t, h), ids), b)| {
                    let pb = b.page_bytes(self.deployment.page_size);
                    (
                        t,
                        layer.map_or((ids[0], 0), |l| layer_at(h, ids, l, host_pages, pb)),
                    )
                })
                .collect();
            let told = PoolShape {
                layers: if layer.is_some() { 1 } else { self.layers },
                device_pages,
                host_pages,
            };
            let args = transfer_args(&ends, (src_buf, dst_buf), n, told, (first, count));
            self.exec.launch(k.id, &k.launch(n, count), &args)?;
        }
        Ok(bytes)
    }

    /// Gathers sequence page `i` (global page `p = seq_pages[i]`, owned by rank `p % cp` at
    /// its local page `p / cp`) of `buffer` from `pools[p % cp]` into page `i` of `dense`,
    /// for every layer: what attention over a CP group reads. `pools` holds every rank's
    /// device tensors (mapped into this process), `dense` `seq_pages.len()` pages per layer.
    ///
    /// # Safety
    /// As [`Ops::transfer`], for every pool and `dense`.
    pub unsafe fn materialise(
        &self,
        buffer: BufferKind,
        pools: &[Tensors],
        seq_pages: &[u32],
        dense: &Tensors,
    ) -> Result<(), OpsError> {
        if !self.deployment.model.buffers().contains(&buffer) {
            return Err(bad(
                "buffer",
                format!("the {} model has no {buffer} buffer", self.deployment.model),
            ));
        }
        let cp = self.deployment.cp;
        if pools.len() != usize::from(cp) {
            return Err(bad(
                "pools",
                format!(
                    "{} pools given for {cp} ranks: one per rank, in rank order",
                    pools.len()
                ),
            ));
        }
        let mut local_pages = None;
        for (r, t) in pools.iter().enumerate() {
            let p = self.pages_of(&format!("pools[{r}]"), buffer, t)?;
            match local_pages {
                None => local_pages = Some(p),
                Some(first) if first != p => {
                    return Err(bad(
                        format!("pools[{r}]"),
                        format!("{p} local pages, but pools[0] has {first}: ranks must match"),
                    ))
                }
                Some(_) => {}
            }
        }
        let local_pages = local_pages.unwrap_or_default();
        // One page table, one stride: every rank's pool in the same order.
        let stride = |t: &Tensors| t.page_stride(self.layers, 1);
        if let Some(r) = pools.iter().position(|t| stride(t) != stride(&pools[0])) {
            return Err(bad(
                format!("pools[{r}]"),
                "ordered unlike pools[0] (page-major against layer-major or per-layer): \
                 every rank's pool must be laid out alike",
            ));
        }
        if matches!(dense, Tensors::PageMajor(_)) {
            return Err(bad(
                "dense",
                "the dense output is layer-major ([layers][pages]), or one tensor per layer",
            ));
        }
        let n = self.pages_of("dense", buffer, dense)?;
        if n as usize != seq_pages.len() {
            return Err(bad(
                "dense",
                format!("{n} pages per layer for {} sequence pages", seq_pages.len()),
            ));
        }
        if let Some((i, p)) = seq_pages
            .iter()
            .enumerate()
            .find(|(_, &p)| p / u32::from(cp) >= local_pages)
        {
            return Err(bad(
                format!("seq_pages[{i}]"),
                format!(
                    "page {p} is local page {} of rank {}, outside its {local_pages} pages",
                    p / u32::from(cp),
                    p % u32::from(cp)
                ),
            ));
        }
        let mut held = self.held();
        let mut pool_ids = Vec::new();
        for t in pools {
            // SAFETY: the caller's contract.
            pool_ids.push(unsafe { held.tensors(t) }?);
        }
        // SAFETY: the caller's contract.
        let dense_ids = unsafe { held.tensors(dense) }?;
        let pages = held.scratch(seq_pages)?;
        let mat = self.kernels.materialise(buffer);
        let pb = buffer.page_bytes(self.deployment.page_size);
        let owners: Vec<(&Tensors, &[BufferId])> = pools
            .iter()
            .zip(&pool_ids)
            .map(|(t, ids)| (t, ids.as_slice()))
            .collect();
        let table = held.table(&owners, self.layers, local_pages, pb)?;
        // The pools are a page table; a per-layer dense buffer takes a launch per layer.
        let launches: Vec<Option<u32>> = if matches!(dense, Tensors::CrossLayer(_)) {
            vec![None]
        } else {
            (0..self.layers).map(Some).collect()
        };
        for layer in launches {
            let (pools, out, layers) = match layer {
                None => (table.clone(), (dense_ids[0], 0), self.layers),
                Some(l) => {
                    let layers = self.layers as usize;
                    let mut one = table.layers(0..0);
                    one.entries = (0..usize::from(cp))
                        .map(|r| table.entries[r * layers + l as usize])
                        .collect();
                    (one, layer_at(dense, &dense_ids, l, n, pb), 1)
                }
            };
            self.exec.launch(
                mat.id,
                &mat.launch(n, layers),
                &[
                    pools.arg(),
                    KernelArg::Ptr(pages, 0),
                    KernelArg::U32(n),
                    KernelArg::U32(layers),
                    KernelArg::U32(local_pages),
                    KernelArg::U32(pools.page_stride),
                    KernelArg::Ptr(out.0, out.1),
                ],
            )?;
        }
        Ok(())
    }

    /// The lane capacity of `lanes`, checked: `u32` words, one top per rank, `cp + 2` status
    /// words, 4-byte alignment.
    fn lane_cap(&self, lanes: &Lanes) -> Result<u32, OpsError> {
        let cp = u64::from(self.deployment.cp);
        for (what, r) in [
            ("stacks", lanes.stacks),
            ("tops", lanes.tops),
            ("status", lanes.status),
        ] {
            if r.addr % 4 != 0 {
                return Err(bad(
                    format!("lanes.{what}"),
                    "not 4-byte aligned (u32 words)",
                ));
            }
        }
        if lanes.tops.bytes != 4 * cp {
            return Err(bad(
                "lanes.tops",
                format!("{} bytes, not {cp} u32 tops", lanes.tops.bytes),
            ));
        }
        if lanes.status.bytes != 4 * (cp + 2) {
            return Err(bad(
                "lanes.status",
                format!(
                    "{} bytes, not the {} u32 status words",
                    lanes.status.bytes,
                    cp + 2
                ),
            ));
        }
        let cap = lanes.stacks.bytes / (4 * cp);
        if lanes.stacks.bytes == 0 || lanes.stacks.bytes % (4 * cp) != 0 {
            return Err(bad(
                "lanes.stacks",
                format!(
                    "{} bytes are not {cp} lanes of u32 pages",
                    lanes.stacks.bytes
                ),
            ));
        }
        u32::try_from(cap).map_err(|_| bad("lanes.stacks", "too many pages per lane"))
    }

    /// Reads the status words of an adopted `lanes.status`.
    fn status(&self, id: BufferId) -> Result<Vec<u32>, OpsError> {
        let mut b = vec![0u8; 4 * (usize::from(self.deployment.cp) + 2)];
        self.exec.read(id, 0, &mut b)?;
        Ok(b.chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    /// Pops one page per entry of `owners` from lane `owners[i]`, owner preserved (the
    /// seed's `alloc_pages_with_owners`): page `i` into `out_pages` (`u32[n]`) and, when
    /// `out_locs` is given, its token slots into it (`i64[n * page_size]`,
    /// `page * page_size + j`). `None` runs the kernel without token locations
    /// ([`SelectOutput::Pages`]): an engine that derives its slots from the pages (SGLang's
    /// `out_cache_loc`) saves the kernel's one block `8 × page_size` bytes per page. All or
    /// nothing: when a lane is short, no lane changes, every page written is 0 (and the
    /// slots page 0's), and this fails with [`OpsError::LanesShort`] (the status words count
    /// it too). Reads the status words back to tell (a host synchronisation).
    ///
    /// # Safety
    /// As [`Ops::transfer`], for the lanes and the outputs.
    pub unsafe fn select(
        &self,
        lanes: &Lanes,
        owners: &[u8],
        out_pages: Region,
        out_locs: Option<Region>,
    ) -> Result<(), OpsError> {
        let lane_cap = self.lane_cap(lanes)?;
        let cp = self.deployment.cp;
        if let Some((i, o)) = owners.iter().enumerate().find(|(_, &o)| o >= cp) {
            return Err(bad(
                format!("owners[{i}]"),
                format!("rank {o} is not below cp {cp}"),
            ));
        }
        let n = owners.len() as u64;
        let ps = u64::from(self.deployment.page_size);
        if out_pages.bytes != 4 * n || out_pages.addr % 4 != 0 {
            return Err(bad(
                "out_pages",
                format!("{} bytes, not {n} aligned u32 pages", out_pages.bytes),
            ));
        }
        if let Some(locs) = out_locs {
            if locs.bytes != 8 * n * ps || locs.addr % 8 != 0 {
                return Err(bad(
                    "out_locs",
                    format!(
                        "{} bytes, not {n} pages of {ps} aligned i64 slots",
                        locs.bytes
                    ),
                ));
            }
        }
        if owners.is_empty() {
            return Ok(());
        }
        let mut held = self.held();
        // SAFETY: the caller's contract.
        let ids: Vec<BufferId> = unsafe {
            [lanes.stacks, lanes.tops, lanes.status, out_pages]
                .iter()
                .chain(out_locs.as_ref())
                .map(|r| held.tensors(&Tensors::CrossLayer(*r)).map(|v| v[0]))
                .collect::<Result<_, _>>()?
        };
        let owners_in = held.scratch_bytes(owners)?;
        let (kernel, output) = match out_locs {
            Some(_) => (self.select_locs, SelectOutput::PagesAndLocs),
            None => (self.select_pages, SelectOutput::Pages),
        };
        // The parameters of `select_spec(output)`: `out_locs` sits between the pages and
        // the status words, and only in the kernel that writes it.
        let mut args = vec![
            KernelArg::Ptr(owners_in, 0),
            KernelArg::U32(owners.len() as u32),
            KernelArg::Ptr(ids[0], 0),
            KernelArg::Ptr(ids[1], 0),
            KernelArg::U32(lane_cap),
            KernelArg::Ptr(ids[3], 0),
        ];
        args.extend(ids.get(4).map(|&locs| KernelArg::Ptr(locs, 0)));
        args.push(KernelArg::Ptr(ids[2], 0));
        let refused = self.launch_on_lanes(
            (kernel, self.deployment.select_spec(output)),
            owners.len(),
            ids[2],
            &args,
        )?;
        match refused {
            Some(short) => Err(OpsError::LanesShort { short }),
            None => Ok(()),
        }
    }

    /// Pushes each page back onto lane `page % cp`, in order. All or nothing: an invalid
    /// page (0, or past the lanes' capacity) is refused before the launch; a lane without
    /// room fails with [`OpsError::LanesFull`] and no lane changes.
    ///
    /// # Safety
    /// As [`Ops::transfer`], for the lanes.
    pub unsafe fn release(&self, lanes: &Lanes, pages: &[u32]) -> Result<(), OpsError> {
        let lane_cap = self.lane_cap(lanes)?;
        let cp = u32::from(self.deployment.cp);
        if let Some((i, p)) = pages
            .iter()
            .enumerate()
            .find(|(_, &p)| p == 0 || p / cp >= lane_cap)
        {
            return Err(bad(
                format!("pages[{i}]"),
                format!("page {p} is the null page or past the lanes' {lane_cap} pages per rank"),
            ));
        }
        if pages.is_empty() {
            return Ok(());
        }
        let mut held = self.held();
        // SAFETY: the caller's contract.
        let ids: Vec<BufferId> = unsafe {
            [lanes.stacks, lanes.tops, lanes.status]
                .iter()
                .map(|r| held.tensors(&Tensors::CrossLayer(*r)).map(|v| v[0]))
                .collect::<Result<_, _>>()?
        };
        let pages_in = held.scratch(pages)?;
        let refused = self.launch_on_lanes(
            (self.release, self.deployment.release_spec()),
            pages.len(),
            ids[2],
            &[
                KernelArg::Ptr(pages_in, 0),
                KernelArg::U32(pages.len() as u32),
                KernelArg::Ptr(ids[0], 0),
                KernelArg::Ptr(ids[1], 0),
                KernelArg::U32(lane_cap),
                KernelArg::Ptr(ids[2], 0),
            ],
        )?;
        match refused {
            Some(over) => Err(OpsError::LanesFull { over }),
            None => Ok(()),
        }
    }

    /// Launches an allocator kernel (`n` items) whose status words are the adopted
    /// `status`; `Some(per-lane counts)` when the launch was refused (all or nothing: its
    /// refused-launch word grew, and each lane's word by its deficit or overflow).
    fn launch_on_lanes(
        &self,
        (kernel, spec): (crate::exec::KernelId, KernelSpec),
        n: usize,
        status: BufferId,
        args: &[KernelArg<'_>],
    ) -> Result<Option<Vec<u32>>, OpsError> {
        let before = self.status(status)?;
        let d = spec.launch_dims(n as u32, 1);
        self.exec.launch(
            kernel,
            &crate::exec::LaunchConfig::linear(d.grid, d.block),
            args,
        )?;
        let after = self.status(status)?;
        Ok((after[0] != before[0]).then(|| {
            after[1..=usize::from(self.deployment.cp)]
                .iter()
                .zip(&before[1..])
                .map(|(a, b)| a.wrapping_sub(*b))
                .collect()
        }))
    }
}

/// Pages of a layer-indexed tensor of `buffer` (pages of `pb` bytes, `layers` layers),
/// checked: the layer count, 16-byte alignment, whole pages, the same pages in every layer.
/// A refusal names `what` (and the layer) and the rule.
pub fn tensor_pages(
    what: &str,
    buffer: BufferKind,
    pb: u64,
    layers: u32,
    t: &Tensors,
) -> Result<u32, OpsError> {
    let layers = u64::from(layers);
    let check_start = |what: &str, r: &Region| {
        if r.addr % ALIGN != 0 {
            return Err(bad(
                what,
                format!("starts at {:#x}, not {ALIGN}-byte aligned", r.addr),
            ));
        }
        Ok(())
    };
    let pages = match t {
        Tensors::CrossLayer(r) | Tensors::PageMajor(r) => {
            check_start(what, r)?;
            if r.bytes == 0 || r.bytes % (layers * pb) != 0 {
                return Err(bad(
                    what,
                    format!(
                        "{} bytes are not {layers} layers of whole {pb}-byte {buffer} pages",
                        r.bytes
                    ),
                ));
            }
            r.bytes / (layers * pb)
        }
        Tensors::PerLayer(v) => {
            if v.len() as u64 != layers {
                return Err(bad(
                    what,
                    format!("{} per-layer tensors for {layers} layers", v.len()),
                ));
            }
            let mut pages = None;
            for (l, r) in v.iter().enumerate() {
                let what = format!("{what} layer {l}");
                check_start(&what, r)?;
                if r.bytes == 0 || r.bytes % pb != 0 {
                    return Err(bad(
                        what,
                        format!("{} bytes are not whole {pb}-byte {buffer} pages", r.bytes),
                    ));
                }
                let p = r.bytes / pb;
                match pages {
                    None => pages = Some(p),
                    Some(first) if first != p => {
                        return Err(bad(
                            what,
                            format!("{p} pages, but layer 0 has {first}: layers must match"),
                        ))
                    }
                    Some(_) => {}
                }
            }
            pages.unwrap_or_default()
        }
    };
    u32::try_from(pages).map_err(|_| bad(what, format!("{pages} pages are too many")))
}
