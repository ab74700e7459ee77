//! Executor memory of one rank: its device and host pool per buffer kind, its views of every
//! owner's device pool (its own and its peers', as attention reads them), and the scratch
//! buffers a request uploads its control data into.

use super::ClusterError;
use crate::exec::{BufferId, ExecError, Executor, MemKind};
use crate::kernels::{page_stride, reference, BufferKind, Deployment, HostLayout, PageTable};
use crate::ops::Tensors;
use std::collections::HashMap;
use std::sync::Arc;

/// The byte every pool and dense buffer starts as: a slot nobody wrote reads as poison, so
/// a page loaded into the wrong owner shows up as a mismatch. The cluster writes it again
/// over freed device pages and over the dense buffer before each materialisation
/// ([`Pools::poison_device_pages`], [`Pools::dense`]), so stale bytes that happen to be
/// right cannot stand in for a copy that did not happen.
pub const POISON: u8 = 0xA5;

/// Pool sizes shared by every rank and buffer kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolGeometry {
    /// Layers per buffer kind.
    pub layers: u32,
    /// Pages in each rank's device pool (`ceil(pages / cp)`).
    pub local_pages: u32,
    /// Pages in each rank's host pool.
    pub host_pages: u32,
}

impl PoolGeometry {
    /// Bytes of every rank's device pools and of every rank's host pools for `dep`
    /// (saturating: the sizes are checked against memory before anything is allocated).
    pub fn pool_bytes(&self, dep: &Deployment) -> (u64, u64) {
        let page: u64 = dep
            .model
            .buffers()
            .iter()
            .map(|b| b.page_bytes(dep.page_size))
            .sum();
        let per_page = page
            .saturating_mul(u64::from(self.layers))
            .saturating_mul(u64::from(dep.cp));
        (
            per_page.saturating_mul(u64::from(self.local_pages)),
            per_page.saturating_mul(u64::from(self.host_pages)),
        )
    }
}

/// How a rank reaches its peers' device pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PeerAccess {
    /// The ranks share one executor (one process, one GPU): a peer's pool is its buffer
    /// handle, used as it is. IPC handles cannot be opened in the process that made them,
    /// so this is how ranks in one process on one GPU reach each other.
    Direct,
    /// Each rank has its own executor: pools are allocated shareable, their handles
    /// all-gathered, and every peer's pool mapped ([`Executor::import`]): POSIX shared
    /// memory on the host executor, in one process or across processes; CUDA IPC on the
    /// CUDA executor, across processes only ([`Executor::maps_in_process`]).
    Mapped,
    /// No rank reaches a peer's pool. To verify, each rank reads back the sequence's pages it
    /// owns from its own pool and all-gathers them through the group, and every rank checks
    /// the whole sequence from what its peers sent. For memory peers cannot map: an
    /// engine's tensors in other processes (plain CPU tensors, torch CUDA memory). The cost:
    /// every verified page crosses the group once per peer (`bytes_gathered`), and the
    /// read-back waits for the rank's stream.
    Gathered,
}

impl PeerAccess {
    /// The report's name for it (`group.peer_pools`).
    pub fn describe(self, exec: &dyn Executor) -> &'static str {
        match self {
            PeerAccess::Direct => "direct",
            PeerAccess::Mapped => exec.peer_mapping().unwrap_or("none"),
            PeerAccess::Gathered => "gathered",
        }
    }
}

/// Where one device pool's layers are, as a rank reaches it: each layer's first page, pages
/// `page_stride` bytes apart (a [`PageTable`]'s entries), and the whole pool's buffer when it
/// is the cache's own layer-major one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolView {
    /// The `[layers][local_pages][page_bytes]` buffer the cache allocated (or mapped); `None`
    /// for an engine's adopted memory.
    pub buffer: Option<BufferId>,
    /// Each layer's first page.
    pub layers: Vec<(BufferId, u64)>,
}

/// One rank's pools and scratch buffers; freed (and peer mappings unmapped) when dropped.
pub struct Pools {
    exec: Arc<dyn Executor>,
    geometry: PoolGeometry,
    page_size: u32,
    access: PeerAccess,
    /// This rank's device pool per buffer kind.
    device: HashMap<BufferKind, PoolView>,
    /// Bytes from page to page of the device pools (the same on every rank).
    strides: HashMap<BufferKind, u32>,
    /// An engine's regions this rank adopted (forgotten, never freed, on drop).
    adopted: Vec<BufferId>,
    host: HashMap<BufferKind, BufferId>,
    /// Every owner's device pool per buffer kind, in rank order, as this executor reaches
    /// it (`None`: a peer's pool under [`PeerAccess::Gathered`]); empty until
    /// [`Pools::connect`].
    views: HashMap<BufferKind, Vec<Option<PoolView>>>,
    /// Peer mappings this rank made (unmapped on drop; direct handles are the peer's).
    imported: Vec<BufferId>,
    /// Per buffer kind, where launches write their page tables ([`PageTable::at`]), each
    /// table at a place of its own, so that its bytes never change once written and no
    /// stream rewrites a table another stream's launch may still read: the transfer's
    /// (every layer), then per layer every owner's pool ([`Pools::views_table`]), then per
    /// layer this rank's pool in every owner's entry ([`Pools::own_table`]).
    tables: HashMap<BufferKind, BufferId>,
    /// Owners (the CP degree): entries of a one-layer materialise table.
    owners: u32,
    scratch: HashMap<&'static str, (BufferId, usize)>,
}

impl Pools {
    /// Allocates this rank's device and host pool per buffer kind, poisoned. The device
    /// pools are shareable under [`PeerAccess::Mapped`].
    pub fn new(
        exec: Arc<dyn Executor>,
        dep: &Deployment,
        geometry: PoolGeometry,
        access: PeerAccess,
    ) -> Result<Pools, ExecError> {
        let mut pools = Pools::without_device(exec, dep, geometry, access)?;
        for b in dep.model.buffers() {
            let page = b.page_bytes(dep.page_size);
            let bytes = page as usize * geometry.layers as usize * geometry.local_pages as usize;
            let d = match access {
                PeerAccess::Direct | PeerAccess::Gathered => {
                    pools.exec.alloc(MemKind::Device, bytes, POISON)?
                }
                PeerAccess::Mapped => pools.exec.alloc_shareable(bytes, POISON)?,
            };
            pools.device.insert(b, own_view(d, geometry, page));
            pools.strides.insert(b, page_stride(page));
        }
        Ok(pools)
    }

    /// This rank's pools over an engine's device memory, one [`Tensors`] per buffer kind in
    /// the model's order (SGLang's per-layer tensors, a layer-major or page-major cross-layer
    /// tensor), adopted instead of allocated; host pools and scratch are the cache's own.
    /// Every tensor is checked first: the layer count, 16-byte alignment, whole pages, the
    /// same pages in every layer, at least `local_pages` of them (the cache uses the first
    /// `local_pages`), and a stride that fits the kernels; a refusal names the buffer, the
    /// layer and the rule ([`ClusterError::EngineBuffer`]). The pages are poisoned, as the
    /// cache's own pools start. The DMA transfer path, which copies layer-major pools, is
    /// refused, and so is [`PeerAccess::Mapped`] with peers: they cannot map an engine's
    /// memory. Ranks in other processes adopt under [`PeerAccess::Gathered`].
    ///
    /// # Safety
    /// Every region must be memory of the executor's address space, valid for reads and
    /// writes for as long as the pools live, and left to the cache's kernels while they run
    /// ([`Executor::adopt`]).
    pub unsafe fn adopting(
        exec: Arc<dyn Executor>,
        dep: &Deployment,
        geometry: PoolGeometry,
        access: PeerAccess,
        device: &[Tensors],
    ) -> Result<Pools, ClusterError> {
        let bad = |what: String, why: String| ClusterError::EngineBuffer { what, why };
        let buffers = dep.model.buffers();
        if device.len() != buffers.len() {
            let names: Vec<String> = buffers.iter().map(ToString::to_string).collect();
            return Err(bad(
                "device".into(),
                format!(
                    "{} buffers given, the {} model has {} ({})",
                    device.len(),
                    dep.model,
                    buffers.len(),
                    names.join(", ")
                ),
            ));
        }
        if access == PeerAccess::Mapped && dep.cp > 1 {
            return Err(bad(
                "device".into(),
                "peers in other processes cannot map an engine's memory: adopt it with peer \
                 access `gathered` (verification then moves each rank's pages through the \
                 group), or with every rank in one process (`direct`)"
                    .into(),
            ));
        }
        let mut checked = Vec::with_capacity(buffers.len());
        for (&b, t) in buffers.iter().zip(device) {
            let what = format!("device[{b}]");
            let pb = b.page_bytes(dep.page_size);
            let pages = crate::ops::tensor_pages(&what, b, pb, geometry.layers, t).map_err(
                |e| match e {
                    crate::ops::OpsError::BadArgument { what, why } => bad(what, why),
                    other => bad(what.clone(), other.to_string()),
                },
            )?;
            if pages < geometry.local_pages {
                return Err(bad(
                    what,
                    format!(
                        "{pages} pages per layer, fewer than the {} local pages of this \
                         rank's pool",
                        geometry.local_pages
                    ),
                ));
            }
            let stride = t.page_stride(geometry.layers, pb);
            let stride = u32::try_from(stride).map_err(|_| {
                bad(
                    what.clone(),
                    format!("a page stride of {stride} bytes does not fit 32 bits"),
                )
            })?;
            checked.push((b, t, pages, stride));
        }
        let mut pools = Pools::without_device(exec, dep, geometry, access)?;
        for (b, t, pages, stride) in checked {
            let mut ids = Vec::new();
            for r in t.regions() {
                // SAFETY: the caller's contract.
                let id = unsafe { pools.exec.adopt(r.addr, r.bytes as usize) }?;
                pools.adopted.push(id);
                ids.push(id);
            }
            let pb = b.page_bytes(dep.page_size);
            let layers = (0..geometry.layers)
                .map(|l| crate::ops::layer_at(t, &ids, l, pages, pb))
                .collect();
            pools.device.insert(
                b,
                PoolView {
                    buffer: None,
                    layers,
                },
            );
            pools.strides.insert(b, stride);
            let all: Vec<u32> = (0..geometry.local_pages).collect();
            pools.poison_device_pages(b, &all)?;
        }
        Ok(pools)
    }

    /// Everything but the device pools: host pools (poisoned), page tables and scratch.
    fn without_device(
        exec: Arc<dyn Executor>,
        dep: &Deployment,
        geometry: PoolGeometry,
        access: PeerAccess,
    ) -> Result<Pools, ExecError> {
        let mut pools = Pools {
            exec,
            geometry,
            page_size: dep.page_size,
            access,
            device: HashMap::new(),
            strides: HashMap::new(),
            adopted: Vec::new(),
            host: HashMap::new(),
            views: HashMap::new(),
            imported: Vec::new(),
            tables: HashMap::new(),
            owners: u32::from(dep.cp),
            scratch: HashMap::new(),
        };
        // Transfer page pairs never exceed a pool, so these never grow on the load path
        // (growing means freeing and allocating, which synchronises on CUDA).
        let max_pairs = 4 * geometry.local_pages.max(geometry.host_pages) as usize;
        pools.scratch("pairs.src", max_pairs, 0)?;
        pools.scratch("pairs.dst", max_pairs, 0)?;
        // A layer-wise load's own page ids, written on the load stream (`load_pairs`).
        pools.scratch("load.src", max_pairs, 0)?;
        pools.scratch("load.dst", max_pairs, 0)?;
        // A backup's own page ids, written on the backup stream (`backup_pairs`).
        pools.scratch("backup.src", max_pairs, 0)?;
        pools.scratch("backup.dst", max_pairs, 0)?;
        for b in dep.model.buffers() {
            let page = b.page_bytes(dep.page_size) as usize;
            let layers = geometry.layers as usize;
            // A zero-page host pool still gets a buffer so kernels have a valid pointer.
            let h = pools.exec.alloc(
                MemKind::Host,
                (page * layers * geometry.host_pages as usize).max(16),
                POISON,
            )?;
            pools.host.insert(b, h);
            let entries = layers * (1 + 2 * usize::from(dep.cp));
            let t = pools.exec.alloc(MemKind::Device, 8 * entries.max(1), 0)?;
            pools.tables.insert(b, t);
        }
        Ok(pools)
    }

    /// What peers need to reach this rank's device pool of `b` (to all-gather): under
    /// [`PeerAccess::Direct`] its page stride and each layer's first page; under
    /// [`PeerAccess::Mapped`] the executor's export of the pool buffer; under
    /// [`PeerAccess::Gathered`] its page stride alone (peers check the pools are alike).
    pub fn handle(&self, b: BufferKind) -> Result<Vec<u8>, ExecError> {
        let view = &self.device[&b];
        match self.access {
            PeerAccess::Gathered => Ok(self.strides[&b].to_le_bytes().to_vec()),
            PeerAccess::Direct => {
                let mut out = self.strides[&b].to_le_bytes().to_vec();
                for &(id, off) in &view.layers {
                    out.extend(id.0.to_le_bytes());
                    out.extend(off.to_le_bytes());
                }
                Ok(out)
            }
            PeerAccess::Mapped => match view.buffer {
                Some(id) => self.exec.export(id),
                None => Err(ExecError::Peer {
                    op: "export",
                    message: format!(
                        "this rank's {b} pool is an engine's memory, which peers in other \
                         processes cannot map"
                    ),
                }),
            },
        }
    }

    /// Reaches every owner's device pool of `b` from its handle (`handles[r]` is rank `r`'s,
    /// `me` this rank): this rank's own pool as it is, each peer's mapped or, under
    /// [`PeerAccess::Direct`], used directly; under [`PeerAccess::Gathered`] no peer's. Every
    /// owner's pool must have this rank's page stride (one page table serves them all) and
    /// hold this rank's pool shape.
    /// `Err((peer, error))` names the peer whose pool could not be reached.
    pub fn connect(
        &mut self,
        b: BufferKind,
        me: usize,
        handles: &[Vec<u8>],
    ) -> Result<(), (usize, ExecError)> {
        let g = self.geometry;
        let pb = b.page_bytes(self.page_size);
        let stride = self.strides[&b];
        let peer = |message: String| ExecError::Peer {
            op: "import",
            message,
        };
        let mismatch = |r: usize, theirs: u32| {
            (
                r,
                peer(format!(
                    "rank {r}'s {b} pool has pages {theirs} bytes apart, this rank's \
                     {stride}: every rank's pool must be laid out alike"
                )),
            )
        };
        let mut view = Vec::with_capacity(handles.len());
        for (r, h) in handles.iter().enumerate() {
            let v = if r == me {
                self.device[&b].clone()
            } else {
                match self.access {
                    PeerAccess::Direct => {
                        let (theirs, v) = parse_direct(h, g.layers).ok_or_else(|| {
                            (r, peer(format!("a direct handle of {} bytes", h.len())))
                        })?;
                        if theirs != stride {
                            return Err(mismatch(r, theirs));
                        }
                        v
                    }
                    PeerAccess::Mapped => {
                        let id = self.exec.import(h).map_err(|e| (r, e))?;
                        self.imported.push(id);
                        own_view(id, g, pb)
                    }
                    PeerAccess::Gathered => {
                        let theirs = <[u8; 4]>::try_from(h.as_slice()).map_err(|_| {
                            (r, peer(format!("a gathered handle of {} bytes", h.len())))
                        })?;
                        let theirs = u32::from_le_bytes(theirs);
                        if theirs != stride {
                            return Err(mismatch(r, theirs));
                        }
                        view.push(None);
                        continue;
                    }
                }
            };
            // Every view holds this rank's pool shape: a peer's that is smaller would let a
            // read through it run past the end.
            let reach = u64::from(g.local_pages.saturating_sub(1)) * u64::from(stride) + pb;
            for (l, &(id, off)) in v.layers.iter().enumerate() {
                let have = self.exec.size(id).map_err(|e| (r, e))? as u64;
                if g.local_pages > 0 && have < off.saturating_add(reach) {
                    return Err((
                        r,
                        peer(format!(
                            "rank {r}'s {b} pool holds {} bytes of layer {l}, fewer than the \
                             {reach} of this rank's pool shape",
                            have.saturating_sub(off)
                        )),
                    ));
                }
            }
            view.push(Some(v));
        }
        self.views.insert(b, view);
        Ok(())
    }

    /// Tells the executor that every peer has mapped this rank's device pools
    /// ([`Executor::seal_shareable`]): on the host executor their shared-memory names go
    /// now, so a rank killed from here on leaves nothing in `/dev/shm`.
    pub fn seal(&self) -> Result<(), ExecError> {
        if self.access == PeerAccess::Mapped {
            for id in self.device.values().filter_map(|v| v.buffer) {
                self.exec.seal_shareable(id)?;
            }
        }
        Ok(())
    }

    /// The pool sizes.
    pub fn geometry(&self) -> PoolGeometry {
        self.geometry
    }

    /// This rank's device pool of buffer `b`, when it is the cache's own layer-major buffer
    /// (`None` for an engine's adopted memory).
    pub fn device(&self, b: BufferKind) -> Option<BufferId> {
        self.device[&b].buffer
    }

    /// This rank's device pool of buffer `b` as a page table of every layer.
    pub fn device_table(&self, b: BufferKind) -> PageTable {
        PageTable {
            at: (self.tables[&b], 0),
            entries: self.device[&b].layers.clone(),
            page_stride: self.strides[&b],
        }
    }

    /// Layer `layer` of every owner's device pool of buffer `b`, in rank order, as this rank
    /// reaches them: the page table of a one-layer materialise. `None` when a peer's pool is
    /// out of reach ([`PeerAccess::Gathered`]).
    pub fn views_table(&self, b: BufferKind, layer: u32) -> Option<PageTable> {
        Some(PageTable {
            at: (self.tables[&b], self.table_at(1 + layer)),
            entries: self
                .views(b)
                .iter()
                .map(|v| v.as_ref().map(|v| v.layers[layer as usize]))
                .collect::<Option<_>>()?,
            page_stride: self.strides[&b],
        })
    }

    /// Layer `layer` of this rank's own device pool of buffer `b`, in every owner's entry of
    /// a one-layer materialise's page table: for a launch over pages this rank owns only
    /// (the other entries are never read), as [`PeerAccess::Gathered`] verification reads
    /// back its share.
    pub fn own_table(&self, b: BufferKind, layer: u32, owners: usize) -> PageTable {
        debug_assert!(
            owners <= self.owners as usize,
            "{owners} owners of {}",
            self.owners
        );
        PageTable {
            at: (
                self.tables[&b],
                self.table_at(1 + self.geometry.layers + layer),
            ),
            entries: vec![self.device[&b].layers[layer as usize]; owners],
            page_stride: self.strides[&b],
        }
    }

    /// Every owner's device pool of buffer `b`, in rank order, as this rank reaches it
    /// (`None`: a peer's, under [`PeerAccess::Gathered`]).
    pub fn views(&self, b: BufferKind) -> &[Option<PoolView>] {
        self.views.get(&b).map_or(&[], Vec::as_slice)
    }

    /// Whether the device pools are an engine's adopted memory.
    pub fn adopted(&self) -> bool {
        self.device.values().any(|v| v.buffer.is_none())
    }

    /// Points this rank's view of `peer`'s pools at `other`'s instead: a wrong peer mapping,
    /// on purpose, for tests that show it surfaces as mismatches on this rank only.
    #[doc(hidden)]
    pub fn debug_view_peer_as(&mut self, peer: usize, other: usize) {
        for v in self.views.values_mut() {
            if peer < v.len() && other < v.len() {
                v[peer] = v[other].clone();
            }
        }
    }

    /// This rank's host pool of buffer `b`.
    pub fn host(&self, b: BufferKind) -> BufferId {
        self.host[&b]
    }

    /// Where one-layer materialise table `k` (1-based; 0 is the transfer's) starts in a
    /// table buffer: after every layer's entry and `k − 1` tables of `owners` entries.
    fn table_at(&self, k: u32) -> u64 {
        8 * (u64::from(self.geometry.layers) + u64::from(k - 1) * u64::from(self.owners))
    }

    /// A scratch buffer of at least `bytes`, grown by doubling.
    fn scratch(
        &mut self,
        name: &'static str,
        bytes: usize,
        fill: u8,
    ) -> Result<BufferId, ExecError> {
        if let Some(&(id, size)) = self.scratch.get(name) {
            if size >= bytes {
                return Ok(id);
            }
            self.exec.free(id)?;
            self.scratch.remove(name);
        }
        let size = bytes.next_power_of_two().max(256);
        let id = self.exec.alloc(MemKind::Device, size, fill)?;
        self.scratch.insert(name, (id, size));
        Ok(id)
    }

    /// A layer-wise load's page-id buffers, with room for `n` pairs (never grown on the load
    /// path: they hold a whole pool). The load writes them itself, on its own stream
    /// ([`LoadOp::Upload`](crate::exec::LoadOp::Upload)), so the cache's stream never
    /// rewrites page ids a load still reads.
    pub fn load_pairs(&mut self, n: usize) -> Result<(BufferId, BufferId), ExecError> {
        let s = self.scratch("load.src", 4 * n, 0)?;
        let d = self.scratch("load.dst", 4 * n, 0)?;
        Ok((s, d))
    }

    /// A backup's page-id buffers, with room for `n` pairs (never grown: they hold a whole
    /// pool). The backup writes them itself, on its own stream, as a layer-wise load does.
    pub fn backup_pairs(&mut self, n: usize) -> Result<(BufferId, BufferId), ExecError> {
        let s = self.scratch("backup.src", 4 * n, 0)?;
        let d = self.scratch("backup.dst", 4 * n, 0)?;
        Ok((s, d))
    }

    /// Uploads transfer page pairs; returns the (source, destination) arrays.
    pub fn upload_pairs(
        &mut self,
        src: &[u32],
        dst: &[u32],
    ) -> Result<(BufferId, BufferId), ExecError> {
        let s = self.scratch("pairs.src", 4 * src.len(), 0)?;
        let d = self.scratch("pairs.dst", 4 * dst.len(), 0)?;
        self.exec.upload(s, 0, &u32_bytes(src))?;
        self.exec.upload(d, 0, &u32_bytes(dst))?;
        Ok((s, d))
    }

    /// Uploads the page ids of a launch over some of a sequence's pages (a
    /// [`PeerAccess::Gathered`] rank's own share).
    pub fn upload_share(&mut self, pages: &[u32]) -> Result<BufferId, ExecError> {
        let s = self.scratch("share.pages", 4 * pages.len(), 0)?;
        self.exec.upload(s, 0, &u32_bytes(pages))?;
        Ok(s)
    }

    /// Uploads a sequence's prefix hashes and page ids.
    pub fn upload_sequence(
        &mut self,
        hashes: &[u64],
        pages: &[u32],
    ) -> Result<(BufferId, BufferId), ExecError> {
        self.upload_sequence_tail(hashes, pages, 0, 0)
    }

    /// Uploads what a synthesise launch from `first_token` reads: the hashes of tokens
    /// `[first_token, ..)` and the pages from `first_page` on, each at its place in buffers
    /// sized for the whole sequence (the bytes before are never read). A request growing a
    /// token at a time so uploads O(1) per step, not the whole sequence.
    pub fn upload_sequence_tail(
        &mut self,
        hashes: &[u64],
        pages: &[u32],
        first_token: usize,
        first_page: usize,
    ) -> Result<(BufferId, BufferId), ExecError> {
        let h = self.scratch("seq.hashes", 8 * hashes.len(), 0)?;
        let p = self.scratch("seq.pages", 4 * pages.len(), 0)?;
        let first_token = first_token.min(hashes.len());
        let first_page = first_page.min(pages.len());
        let bytes: Vec<u8> = hashes[first_token..]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        self.exec.upload(h, 8 * first_token as u64, &bytes)?;
        self.exec
            .upload(p, 4 * first_page as u64, &u32_bytes(&pages[first_page..]))?;
        Ok((h, p))
    }

    /// `n` zeroed u32 words (verify's token bitmap).
    pub fn zeroed_words(&mut self, n: usize) -> Result<BufferId, ExecError> {
        let c = self.scratch("verify.bad_tokens", 4 * n, 0)?;
        self.exec.upload(c, 0, &vec![0u8; 4 * n])?;
        Ok(c)
    }

    /// The dense materialisation buffer of buffer `b` for `n_pages` pages. With `poison`
    /// its first `n_pages` pages are poisoned again (every layer): the scratch buffer is
    /// reused between requests, and a materialisation that skips a page must not pass on the
    /// bytes an earlier request left there.
    pub fn dense(
        &mut self,
        b: BufferKind,
        n_pages: u32,
        poison: bool,
    ) -> Result<BufferId, ExecError> {
        let bytes = b.page_bytes(self.page_size) as usize
            * n_pages as usize
            * self.geometry.layers as usize;
        let name = match b {
            BufferKind::NsaKv => "dense.nsa_kv",
            BufferKind::NsaIndexK => "dense.nsa_idx",
            BufferKind::MlaKv => "dense.mla_kv",
            BufferKind::GqaKv { .. } => "dense.gqa_kv",
        };
        let id = self.scratch(name, bytes, POISON)?;
        if poison {
            self.fill_poison(id, &[(0, bytes as u64)])?;
        }
        Ok(id)
    }

    /// Poisons local pages `locals` (ascending) of this rank's device pool of buffer `b`, in
    /// every layer: one fill range per run of consecutive pages per layer. Device fills are
    /// stream-ordered and neither read back nor synchronise, so this may run on the load
    /// path. Pages outside the pool are skipped.
    pub fn poison_device_pages(&mut self, b: BufferKind, locals: &[u32]) -> Result<(), ExecError> {
        let g = self.geometry;
        let page_bytes = b.page_bytes(self.page_size);
        let stride = u64::from(self.strides[&b]);
        // Runs of consecutive pages are contiguous only where pages are packed.
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for &p in locals.iter().filter(|&&p| p < g.local_pages) {
            match runs.last_mut() {
                Some((start, len)) if *start + *len == p && stride == page_bytes => *len += 1,
                _ => runs.push((p, 1)),
            }
        }
        // One fill per buffer: a layer-major pool is one, per-layer tensors one each.
        let mut fills: Vec<(BufferId, Vec<(u64, u64)>)> = Vec::new();
        for &(id, off) in &self.device[&b].layers {
            let ranges = runs.iter().map(|&(start, len)| {
                (off + u64::from(start) * stride, u64::from(len) * page_bytes)
            });
            match fills.iter_mut().find(|(f, _)| *f == id) {
                Some((_, r)) => r.extend(ranges),
                None => fills.push((id, ranges.collect())),
            }
        }
        for (id, ranges) in fills {
            self.fill_poison(id, &ranges)?;
        }
        Ok(())
    }

    /// Writes the poison byte over host pages `pages` of this rank's host pool of buffer `b`, every
    /// layer, laid out as `layout`: a freed host page reused by a backup whose copy did
    /// nothing must not still hold the right bytes. Pages outside the pool are skipped. On
    /// a GPU the pool is pinned host memory, written by the CPU once the stream is idle.
    pub fn poison_host_pages(
        &mut self,
        b: BufferKind,
        layout: HostLayout,
        pages: &[u32],
    ) -> Result<(), ExecError> {
        let g = self.geometry;
        let page_bytes = b.page_bytes(self.page_size);
        let ranges: Vec<(u64, u64)> = pages
            .iter()
            .filter(|&&p| p < g.host_pages)
            .flat_map(|&p| {
                (0..g.layers).map(move |l| {
                    (
                        reference::host_offset(layout, p, l, g.layers, g.host_pages, page_bytes),
                        page_bytes,
                    )
                })
            })
            .collect();
        let id = self.host(b);
        self.fill_poison(id, &ranges)
    }

    /// Writes [`POISON`] over each `(offset, len)` range of `buffer` (one executor fill:
    /// `cuMemsetD8Async` on a GPU, nothing crosses PCIe).
    fn fill_poison(&mut self, buffer: BufferId, ranges: &[(u64, u64)]) -> Result<(), ExecError> {
        self.exec.fill(buffer, ranges, POISON)
    }
}

impl Drop for Pools {
    fn drop(&mut self) {
        // Adopted regions are forgotten, not freed: the engine owns that memory.
        let ids = self
            .imported
            .iter()
            .chain(self.device.values().filter_map(|v| v.buffer.as_ref()))
            .chain(&self.adopted)
            .chain(self.host.values())
            .chain(self.tables.values())
            .copied()
            .chain(self.scratch.values().map(|&(id, _)| id))
            .collect::<Vec<_>>();
        for id in ids {
            // Freeing can only fail for an unknown handle; nothing useful to do in drop.
            let _ = self.exec.free(id);
        }
    }
}

pub(super) fn u32_bytes(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The view of a `[layers][local_pages][page_bytes]` pool in `id`.
fn own_view(id: BufferId, g: PoolGeometry, page_bytes: u64) -> PoolView {
    PoolView {
        buffer: Some(id),
        layers: PageTable::layer_major((id, 0), id, g.layers, g.local_pages, page_bytes).entries,
    }
}

/// A [`PeerAccess::Direct`] handle ([`Pools::handle`]): the stride and `layers` entries.
fn parse_direct(h: &[u8], layers: u32) -> Option<(u32, PoolView)> {
    let (stride, rest) = h.split_first_chunk::<4>()?;
    if rest.len() != 16 * layers as usize {
        return None;
    }
    let layers = rest
        .chunks_exact(16)
        .map(|c| {
            let (id, off) = c.split_at(8);
            (
                BufferId(u64::from_le_bytes(id.try_into().expect("8 bytes"))),
                u64::from_le_bytes(off.try_into().expect("8 bytes")),
            )
        })
        .collect();
    Some((
        u32::from_le_bytes(*stride),
        PoolView {
            buffer: None,
            layers,
        },
    ))
}
