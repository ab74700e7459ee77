//! One CP rank's whole cache, as an engine process hosts it: [`RankCache`].
//!
//! A rank owns its radix-tree replica, its allocator replica over the whole logical page
//! space (every rank must know every page's owner), its host page pool, its device pools
//! (its owned pages only), its executor and the deployment's kernels. It agrees with its
//! peers through a [`Collective`]: decisions that depend only on replicated state (matching,
//! allocation, device eviction) are taken locally and come out identical on every rank;
//! those that depend on per-rank state go through the group (a backup's host shortfalls,
//! whether any rank failed a step, the mismatch bitmaps, the digests).
//!
//! One request flows one way: match → load back → allocate → compute → materialise →
//! verify → insert → back up → release ([`RankCache::serve`]). Attention on every rank reads
//! each page from its owner's pool, so every rank materialises and verifies the whole
//! sequence over its own view of all owners' pools ([`pools::PeerAccess`]); a wrong peer
//! mapping shows as mismatches on the rank that has it.
//!
//! # Barriers, and why each is there
//!
//! - *Pools connected* (start-up): every rank has mapped every peer's pools before any
//!   request can make a peer read them.
//! - *Request N written* (after load-back and synthesis, before materialise): a rank's
//!   loaded and computed pages are in its pool before any peer reads them.
//! - *Request N verified* (after verify, before insert): no rank frees, poisons or reuses a
//!   page of this sequence while a peer may still be reading it.
//! - *Request N outcome* (the end): every rank's step succeeded, so none rolls back alone;
//!   a rank whose step failed contributes its failure to whatever round its peers are in,
//!   and every rank then rolls the request back.
//!
//! On a GPU a barrier of host threads does not order other streams: ranks that share one
//! executor share its stream; ranks with executors of their own ([`PeerAccess::Mapped`]:
//! shared memory on the host executor, CUDA IPC between processes) synchronise their stream
//! after synthesis and before the *written* barrier, so everything they enqueued into their
//! pools (the load-back's layers included) has run before any peer reads it. A peer's
//! stream cannot wait on this rank's events (they belong to its process; CUDA's
//! `cuIpcGetEventHandle` is not used), so the host waits instead: one synchronisation per
//! request, after the load path and before materialise. It is not a load-path stall:
//! `load_path_syncs` counts only what the load-back itself did (the executor's counters
//! around it), and a rank's own materialisation still waits for each layer of its load on
//! the device side. Per-layer readiness across ranks (a peer's attention on layer `l`
//! waiting only for this rank's layer `l`) is not built.
//!
//! The SGLang call each method stands for is named in its documentation.

mod backup;
mod config;
mod evict;
mod kernels;
mod load;
pub mod pools;
mod request;
mod rollback;
mod stats;
mod verify;

pub use config::{ClusterConfig, ClusterError, Fault, PeerErrorKind, WritePolicy};
use evict::Eviction;
pub use kernels::{DeploymentKernels, KernelLoadError, Loaded, SourceHook};
pub use load::LoadHandle;
pub use pools::{PeerAccess, PoolGeometry, Pools};
pub use request::Request;
use rollback::Freed;
pub use stats::{RequestStats, RollbackDrops};
pub use verify::{Mismatches, Verdict};

use crate::allocator::kernel::{KernelAllocOptions, KernelLaneAllocator};
use crate::allocator::{AllocError, OwnerLaneAllocator, StateDigest};
use crate::exec::{EventId, Executor, KernelArg};
use crate::group::Collective;
use crate::hicache::host_pool::HostPagePool;
use crate::hicache::tree::{Evicted, MatchResult, NodeId, RadixTree, TreeError};
use crate::jit::Jit;
use crate::kernels::{
    clamp_layer_range, layer_range_args, reference, transfer_args, transfer_regions, BufferKind,
    Direction, PoolShape,
};
use crate::layout::{zigzag_owners, CpLayout, PageId, Rank};
use crate::metadata::{HostPage, NodeMetadata};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

/// One CP rank's cache. See the module documentation.
pub struct RankCache {
    rank: Rank,
    layout: CpLayout,
    config: ClusterConfig,
    exec: Arc<dyn Executor>,
    kernels: DeploymentKernels,
    pools: Pools,
    tree: RadixTree,
    alloc: KernelLaneAllocator,
    host: HostPagePool,
    group: Box<dyn Collective>,
    peer_access: PeerAccess,
    launch_failure_at: Option<usize>,
    panic_at: Option<usize>,
    served: usize,
    freed: Freed,
    capture_dense: bool,
    last_dense: Vec<(BufferKind, Vec<u8>)>,
    repoison: bool,
    verifies: bool,
    verifying_ranks: usize,
    digest_calls: std::cell::Cell<u64>,
    last_rollback: RollbackDrops,
    last_verdict: Verdict,
}

impl RankCache {
    /// Builds rank `group.rank()`: its kernels on `exec`, its pools (poisoned), its tree,
    /// allocator and host pool; then maps every peer's pools through `group` (every rank
    /// must call this; a rank that fails aborts the group, so its peers fail too instead of
    /// waiting). SGLang: `HiRadixCache.__init__` with its `HiCacheController` and host pool.
    pub fn new(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        group: Box<dyn Collective>,
        peer_access: PeerAccess,
    ) -> Result<RankCache, ClusterError> {
        let built = Self::build(config, exec, jit, &*group, peer_access);
        let (layout, config, exec, kernels, mut pools, tree, alloc, host) = match built {
            Ok(parts) => parts,
            Err(e) => {
                group.abort(&format!("rank {} could not start: {e}", group.rank().0));
                return Err(e);
            }
        };
        let rank = group.rank();
        for &b in config.deployment.model.buffers() {
            let mine = match pools.handle(b) {
                Ok(h) => h,
                Err(e) => {
                    group.abort(&format!("rank {} could not export its pools: {e}", rank.0));
                    return Err(e.into());
                }
            };
            let handles = group.all_gather(&format!("pool handles {b}"), &mine)?;
            if let Err((peer, source)) = pools.connect(b, usize::from(rank.0), &handles) {
                let e = ClusterError::PeerPool {
                    rank: rank.0,
                    peer: peer as u8,
                    buffer: b,
                    source,
                };
                group.abort(&e.to_string());
                return Err(e);
            }
        }
        // Every rank has mapped every peer before any request makes a peer read them.
        group.barrier("pools connected")?;
        let size = group.size();
        Ok(RankCache {
            rank,
            layout,
            config,
            exec,
            kernels,
            pools,
            tree,
            alloc,
            host,
            group,
            peer_access,
            launch_failure_at: None,
            panic_at: None,
            served: 0,
            freed: Freed::default(),
            capture_dense: false,
            last_dense: Vec::new(),
            repoison: true,
            verifies: true,
            verifying_ranks: size,
            digest_calls: std::cell::Cell::new(0),
            last_rollback: RollbackDrops::default(),
            last_verdict: Verdict::default(),
        })
    }

    #[allow(clippy::type_complexity)]
    fn build(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        group: &dyn Collective,
        peer_access: PeerAccess,
    ) -> Result<
        (
            CpLayout,
            ClusterConfig,
            Arc<dyn Executor>,
            DeploymentKernels,
            Pools,
            RadixTree,
            KernelLaneAllocator,
            HostPagePool,
        ),
        ClusterError,
    > {
        let dep = &config.deployment;
        let layout = config.layout()?;
        if config.layers == 0 {
            return Err(ClusterError::Config("--layers must be at least 1".into()));
        }
        if group.size() != usize::from(layout.cp()) {
            return Err(ClusterError::Config(format!(
                "a CP {} deployment needs a group of {} ranks, not {}",
                layout.cp(),
                layout.cp(),
                group.size()
            )));
        }
        let rank = group.rank();
        let geometry = config.pool_geometry()?;
        let broken = |spec: &crate::kernels::KernelSpec, src: String| {
            if spec.family() == crate::kernels::Family::Verify {
                crate::jit::break_source(src)
            } else {
                src
            }
        };
        let hook: Option<SourceHook<'_>> = match config.fault {
            Some(Fault::CompileError) => Some(&broken),
            _ => None,
        };
        // SAFETY: the only hook is the compile-error fault, which makes a source fail to
        // compile.
        let kernels = unsafe {
            DeploymentKernels::load_with_hook(dep, jit, exec.as_ref(), config.sanitize, hook)
        }?;
        let pools = Pools::new(exec.clone(), dep, geometry, peer_access)?;
        let tree = RadixTree::new(layout, rank)?;
        let mut alloc = KernelLaneAllocator::new(
            layout,
            exec.clone(),
            jit,
            KernelAllocOptions {
                threads: dep.alloc_threads,
                sanitize: config.sanitize,
                arch: dep.arch,
            },
        )?;
        let host = HostPagePool::new(rank, geometry.host_pages)?;
        if config.fault == Some(Fault::LaneExhaustion) {
            // Pages reserved for ever, on every rank alike: lane 0 keeps half its pages.
            let reserve = layout.lane_capacity(Rank(0)) / 2;
            alloc.alloc_pages_with_owners(&vec![0u8; reserve as usize])?;
        }
        Ok((layout, config, exec, kernels, pools, tree, alloc, host))
    }

    /// This rank.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The layout.
    pub fn layout(&self) -> &CpLayout {
        &self.layout
    }

    /// The settings.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// The executor.
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.exec
    }

    /// The loaded kernels.
    pub fn kernels(&self) -> &DeploymentKernels {
        &self.kernels
    }

    /// The group's transport (`"local"`, ...).
    pub fn group_kind(&self) -> &'static str {
        self.group.kind()
    }

    /// How this rank reaches its peers' pools (`"shared-memory"`, `"direct"`, ...).
    pub fn peer_pools(&self) -> &'static str {
        self.peer_access.describe(self.exec.as_ref())
    }

    /// Makes this rank's first launch of request number `request` (0-based, counted over
    /// [`RankCache::serve`] calls) fail, so that request fails on this rank and every rank
    /// rolls it back. The failure never outlives its request; an empty prompt launches
    /// nothing, so a failure aimed at one moves to the next request.
    pub fn inject_launch_failure(&mut self, request: usize) {
        self.launch_failure_at = Some(request);
    }

    /// Makes this rank's thread panic in request number `request`, after the match: for the
    /// test that a rank that dies mid-request ends the run with an error naming it.
    #[doc(hidden)]
    pub fn debug_panic_in(&mut self, request: usize) {
        self.panic_at = Some(request);
    }

    /// A digest of the allocator and the tree (host slots excluded: they differ between
    /// ranks by design). Equal on every rank that saw the same calls.
    pub fn digest(&self) -> StateDigest {
        let mut h = Sha256::new();
        h.update(self.alloc.digest().0);
        h.update(self.tree.digest().0);
        StateDigest(h.finalize().into())
    }

    /// Every rank's [`RankCache::digest`], all-gathered (a collective: every rank calls it).
    pub fn all_digests(&self, what: &str) -> Result<Vec<StateDigest>, ClusterError> {
        // Numbered, so that two ranks pairing different digest calls of one name fail as a
        // divergence at once instead of a later call.
        let seq = self.digest_calls.get();
        self.digest_calls.set(seq + 1);
        let all = self
            .group
            .all_gather(&format!("{what} #{seq}"), &self.digest().0)?;
        Ok(all
            .into_iter()
            .map(|d| StateDigest(d.try_into().unwrap_or([0; 32])))
            .collect())
    }

    /// Reads the device lane stacks back and compares them with the allocator's host mirror,
    /// which decides every allocation: they differ only if a kernel or a rollback went wrong.
    /// A counted read-back, so call it outside the load path.
    pub fn check_device_lanes(&self) -> Result<(), ClusterError> {
        let rank = self.rank.0;
        self.alloc
            .check_usable()
            .and_then(|()| self.alloc.debug_check_device())
            .map_err(|source| ClusterError::DeviceLanes { rank, source })
    }

    /// Free device pages per lane.
    pub fn lane_free_counts(&self) -> Vec<u32> {
        self.alloc.lane_free_counts()
    }

    /// Checks the allocator and tree invariants, conservation included.
    pub fn check_invariants(&self) -> Result<(), ClusterError> {
        self.alloc.mirror().check_invariants()?;
        // The device lanes must equal the mirror (a counted read-back: tests only).
        self.alloc.debug_check_device()?;
        self.tree.check_invariants()?;
        let in_tree = self.tree.device_pages();
        let used: u32 = self.alloc.mirror().lane_used_counts().iter().sum();
        let reserved = if self.config.fault == Some(Fault::LaneExhaustion) {
            self.layout.lane_capacity(Rank(0)) / 2
        } else {
            0
        };
        let leaked = |what: String| ClusterError::Alloc(AllocError::Invariant { what });
        if in_tree as u32 + reserved != used {
            return Err(leaked(format!(
                "{}: {used} pages allocated but the tree holds {in_tree} (+{reserved} reserved)",
                self.rank
            )));
        }
        for id in self.tree.node_ids() {
            let n = self.tree.node(id)?;
            if let Some(&p) = n
                .device()
                .and_then(|d| d.iter().find(|&&p| !self.alloc.mirror().is_allocated(p)))
            {
                return Err(leaked(format!(
                    "{}: {id} holds {p}, which the allocator has free",
                    self.rank
                )));
            }
            if let Some(h) = n
                .host()
                .and_then(|m| m.host_pages().iter().find(|&&h| !self.host.is_allocated(h)))
            {
                return Err(leaked(format!(
                    "{}: {id} holds host page {}, which the host pool has free",
                    self.rank, h.0
                )));
            }
        }
        let host_used = self.host.capacity() - self.host.free_count();
        let host_in_tree: usize = self
            .tree
            .node_ids()
            .iter()
            .filter_map(|&id| {
                self.tree
                    .node(id)
                    .ok()?
                    .host()
                    .map(|m| m.host_pages().len())
            })
            .sum();
        if host_used as usize != host_in_tree {
            return Err(leaked(format!(
                "{}: {host_used} host pages allocated but the tree references {host_in_tree}",
                self.rank
            )));
        }
        Ok(())
    }

    /// When on, every request reads its dense materialised buffers back (after verifying
    /// them) so that [`RankCache::last_dense`] can feed a reference decode. Off by default:
    /// the read-back is a device→host synchronisation a serving path would not do.
    pub fn set_capture_dense(&mut self, on: bool) {
        self.capture_dense = on;
        if !on {
            self.last_dense.clear();
        }
    }

    /// The last request's dense materialised buffers (this rank's view), one per buffer
    /// kind, each laid out `[layer][seq_page][page bytes]` (docs/KERNELS.md); empty unless
    /// capture is on.
    pub fn last_dense(&self) -> &[(BufferKind, Vec<u8>)] {
        &self.last_dense
    }

    /// Whether device and host pages are poisoned again when they are freed (evicted,
    /// dropped by a rollback, or released at the end of a request) and the dense buffers
    /// before every materialisation. On by default, and it should stay on wherever results
    /// are checked: the lane stacks are LIFO, so a node loaded back often gets its old
    /// pages, which still hold the right bytes, and a load that copied nothing would pass.
    ///
    /// Cost: a device fill (`cuMemsetD8Async` on a GPU, `memset` on the CPU) of the poison
    /// byte over every freed page of this rank's pools (all layers and buffer kinds) and
    /// over the dense buffers of every request. Device fills are stream-ordered and neither
    /// read back nor synchronise, so the load path stays free of both. Freed host pages
    /// (host evictions, replaced copies) are poisoned by the CPU; on a GPU that waits for
    /// the stream, which the load path meets only when a write-back eviction there frees
    /// host copies.
    pub fn set_repoison(&mut self, on: bool) {
        self.repoison = on;
    }

    /// Whether this rank materialises and verifies every request (on by default). A rank
    /// that does not still takes part in every collective, with an empty bitmap.
    pub fn set_verifies(&mut self, on: bool) {
        self.verifies = on;
    }

    /// Materialise and verify on the first `n` ranks of the group only (clamped to
    /// `1..=size`): this rank verifies when it is one of them.
    pub fn set_verifying_ranks(&mut self, n: usize) {
        self.verifying_ranks = n.clamp(1, self.group.size());
        self.verifies = usize::from(self.rank.0) < self.verifying_ranks;
    }

    /// How many ranks verify ([`RankCache::set_verifying_ranks`]; every rank by default).
    pub fn verifying_ranks(&self) -> usize {
        self.verifying_ranks
    }

    /// Requests served so far ([`RankCache::serve`] calls, failed ones included): every
    /// rank of a group counts the same, so it names steps of the group's calls.
    pub fn requests_served(&self) -> usize {
        self.served
    }

    /// This rank's pools: its device pool per buffer kind (`[layer][local_page][page
    /// bytes]`, the memory an engine's attention reads and writes), its host pool and its
    /// views of its peers'.
    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    /// The group this rank agrees through.
    pub fn group(&self) -> &dyn Collective {
        &*self.group
    }

    /// Points this rank's view of `peer`'s pools at `other`'s: a wrong peer mapping on
    /// purpose, for the test that it shows as mismatches on this rank only.
    #[doc(hidden)]
    pub fn debug_view_peer_as(&mut self, peer: usize, other: usize) {
        self.pools.debug_view_peer_as(peer, other);
    }

    /// What the rollback of the last failed operation dropped.
    pub fn last_rollback(&self) -> RollbackDrops {
        self.last_rollback
    }

    /// What the last request's verification found, on every rank.
    pub fn last_verdict(&self) -> &Verdict {
        &self.last_verdict
    }

    /// Locks `node` and its ancestors against eviction (a request holding its prefix).
    /// SGLang: `inc_lock_ref`.
    pub fn lock(&mut self, node: NodeId) -> Result<(), ClusterError> {
        if node != NodeId::ROOT {
            self.tree.lock(node)?;
        }
        Ok(())
    }

    /// Releases a lock taken by [`RankCache::lock`]. SGLang: `dec_lock_ref`.
    pub fn unlock(&mut self, node: NodeId) -> Result<(), ClusterError> {
        if node != NodeId::ROOT {
            self.tree.unlock(node)?;
        }
        Ok(())
    }

    /// The longest cached prefix of `tokens` (whole pages): device-resident pages, then the
    /// host-only nodes that can be loaded back. Splits a node where the match ends inside it.
    /// SGLang: `HiRadixCache.match_prefix`.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Result<MatchResult, ClusterError> {
        let ps = self.layout.page_size() as usize;
        Ok(self.tree.match_prefix(&tokens[..tokens.len() / ps * ps])?)
    }

    /// Evicts device nodes in LRU order until at least `pages` device pages were released
    /// or nothing unlocked is left (write-back backs them up first). Returns the node count.
    /// Every rank makes the same call; on an error on any rank, every rank's state is
    /// restored. SGLang: `HiRadixCache.evict`.
    pub fn evict_device_lru(&mut self, pages: usize) -> Result<usize, ClusterError> {
        self.agreed("eviction", |me| {
            me.evict(Eviction::Lru(pages), &mut RequestStats::default())
        })
    }

    /// Serves one prompt: match, load back, compute the rest, materialise and verify,
    /// insert, back up, release; every rank of the group calls it with the same prompt. On
    /// an error on any rank, every rank restores its state to what it was, so a failed
    /// request leaves no trace but the error: this rank's own, or
    /// [`GroupError::PeerFailed`](crate::group::GroupError::PeerFailed) naming the rank
    /// that failed. An error that breaks the
    /// group (a timeout, a divergence) is returned as it is, without a rollback.
    ///
    /// SGLang's scheduler makes these calls on `HiRadixCache` per request: `match_prefix`
    /// (and `init_load_back`), `alloc`, the model's forward, `cache_finished_req` /
    /// `insert`, `write_backup`, `dec_lock_ref`.
    pub fn serve(&mut self, tokens: &[u32]) -> Result<RequestStats, ClusterError> {
        let n = self.served;
        let mut armed = false;
        if self.launch_failure_at == Some(n) {
            if tokens.is_empty() {
                // An empty prompt launches nothing: fail the next request instead of leaving
                // the executor armed for whichever launch comes later.
                self.launch_failure_at = Some(n + 1);
            } else {
                self.exec.inject_launch_failure();
                armed = true;
            }
        }
        self.served += 1;
        let panic_here = self.panic_at == Some(n);
        self.agreed(&format!("request {n}"), |me| {
            let result = me.serve_inner(tokens, n, panic_here);
            if armed {
                // A request that returned before its first launch did not consume the
                // failure: disarm on every exit, before the rollback.
                me.exec.disarm_launch_failure();
            }
            result
        })
    }

    fn serve_inner(
        &mut self,
        tokens: &[u32],
        n: usize,
        panic_here: bool,
    ) -> Result<RequestStats, ClusterError> {
        if tokens.is_empty() {
            return Ok(RequestStats::default());
        }
        let mut req = self.begin_inner(tokens, n, panic_here)?;
        self.allocate_inner(&mut req)?;
        // 4-5. Synthesise the computed pages this rank owns, materialise everything from the
        // owners' pools, verify against the synthesised KV.
        let bad =
            self.compute_and_verify(&req.tokens, &req.pages, req.cached, n, req.load.as_ref())?;
        req.load = None;
        req.stats.mismatched_tokens = bad.all.count;
        req.stats.first_mismatched_token = bad.all.first;
        self.last_verdict = bad;
        self.finish_inner(&mut req)
    }

    /// Copies this rank's page pairs for every buffer kind and every layer of `layers`
    /// (clamped to the pools' layers; `0..layers` for all of them), with the transfer kernel
    /// or by DMA as the deployment says; returns bytes moved. With `events`, the layers move
    /// one at a time, each followed by an event pushed there (a layer-wise load); the pairs
    /// are checked and uploaded once either way.
    fn transfer(
        &mut self,
        dir: Direction,
        src: &[u32],
        dst: &[u32],
        layers: Range<u32>,
        mut events: Option<&mut Vec<EventId>>,
    ) -> Result<u64, ClusterError> {
        let g = self.pools.geometry();
        let (first_layer, layer_count) = layer_range_args(&layers);
        let moved = clamp_layer_range(first_layer, layer_count, g.layers);
        if src.is_empty() {
            if let Some(events) = events.as_deref_mut() {
                for _ in moved {
                    events.push(self.exec.record_event()?);
                }
            }
            return Ok(0);
        }
        let pools = PoolShape {
            layers: g.layers,
            device_pages: g.local_pages,
            host_pages: g.host_pages,
        };
        check_transfer_pages(dir, usize::from(self.rank.0), src, dst, &pools)?;
        let dma = self.config.deployment.transfer_path.dma_mode();
        let pairs = if dma.is_some() {
            None
        } else {
            Some(self.pools.upload_pairs(src, dst)?)
        };
        let steps: Vec<Range<u32>> = match events {
            Some(_) => moved.clone().map(|l| l..l + 1).collect(),
            None => vec![moved.clone()],
        };
        let spec = self.config.deployment.transfer(dir);
        // (source pool, destination pool) of each buffer, in the spec's descriptor order.
        let ends: Vec<(crate::exec::BufferId, crate::exec::BufferId)> = self
            .config
            .deployment
            .model
            .buffers()
            .iter()
            .map(|&b| match dir {
                Direction::HostToDevice => (self.pools.host(b), self.pools.device(b)),
                Direction::DeviceToHost => (self.pools.device(b), self.pools.host(b)),
            })
            .collect();
        let mut bytes = 0;
        for step in steps {
            match pairs {
                None => {
                    for (d, &(from, to)) in spec.descriptors().iter().zip(&ends) {
                        let regions = transfer_regions(d, src, dst, pools, step.clone());
                        self.exec
                            .copy_regions_with(from, to, &regions, dma.unwrap_or_default())?;
                    }
                }
                Some((sb, db)) => {
                    // One launch moves every buffer.
                    let k = self.kernels.transfer(dir);
                    let args = transfer_args(
                        &ends,
                        (sb, db),
                        src.len() as u32,
                        pools,
                        layer_range_args(&step),
                    );
                    self.exec.launch(
                        k.id,
                        &k.launch(src.len() as u32, step.len() as u32),
                        &args,
                    )?;
                }
            }
            bytes += src.len() as u64 * step.len() as u64 * spec.total_page_bytes();
            if let Some(events) = events.as_deref_mut() {
                events.push(self.exec.record_event()?);
            }
        }
        Ok(bytes)
    }
}

/// Refuses a transfer whose page lists differ in length, name a page outside its pool
/// (`pools`' device pages per rank, host pages), or name one destination page twice (on a GPU
/// the two copies would interleave: `kernels::check_distinct_destinations`).
pub(crate) fn check_transfer_pages(
    dir: Direction,
    rank: usize,
    src: &[u32],
    dst: &[u32],
    pools: &PoolShape,
) -> Result<(), ClusterError> {
    let bad = |what: String| Err(ClusterError::BadTransfer { rank, what });
    if src.len() != dst.len() {
        return bad(format!(
            "{dir} transfer of {} source pages to {} destination pages",
            src.len(),
            dst.len()
        ));
    }
    let [src_pool, dst_pool] = pools.ends(dir);
    for (pages, (pool, cap)) in [(src, src_pool), (dst, dst_pool)] {
        if let Some(p) = pages.iter().find(|&&p| p >= cap) {
            return bad(format!(
                "{dir} transfer names {pool} page {p}, outside the {pool} pool of {cap} pages"
            ));
        }
    }
    if let Err(e) = crate::kernels::check_distinct_destinations(dst) {
        return bad(format!("{dir} transfer: {e}"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::TransferPath;

    #[test]
    fn transfers_outside_the_pools_are_refused() {
        let (d2h, h2d) = (Direction::DeviceToHost, Direction::HostToDevice);
        // 8 device pages per rank, 16 host pages.
        let pools = PoolShape {
            layers: 1,
            device_pages: 8,
            host_pages: 16,
        };
        let ok = |dir, src: &[u32], dst: &[u32]| check_transfer_pages(dir, 1, src, dst, &pools);
        ok(d2h, &[0, 7], &[15, 3]).unwrap();
        ok(h2d, &[15, 3], &[0, 7]).unwrap();
        for (dir, src, dst, want) in [
            (
                d2h,
                &[8u32][..],
                &[0u32][..],
                "d2h transfer names device page 8, outside the device pool of 8 pages",
            ),
            (d2h, &[0], &[16], "host page 16"),
            (h2d, &[u32::MAX], &[0], "host page 4294967295"),
            (h2d, &[0], &[8], "device page 8"),
            (
                h2d,
                &[0, 1],
                &[0],
                "h2d transfer of 2 source pages to 1 destination pages",
            ),
            (
                d2h,
                &[0, 1, 2],
                &[3, 5, 3],
                "d2h transfer: pairs 0 and 2 both write destination page 3",
            ),
            (
                h2d,
                &[4, 9],
                &[7, 7],
                "pairs 0 and 1 both write destination page 7",
            ),
        ] {
            let err = ok(dir, src, dst).unwrap_err();
            let shown = err.to_string();
            assert!(
                shown.starts_with("rank 1: ") && shown.contains(want),
                "{shown}"
            );
        }
    }

    /// A one-rank cache on a fresh host executor (the integration tests' JIT cache, so the
    /// kernels are usually compiled already).
    pub(super) fn one_rank(path: TransferPath) -> RankCache {
        let jit = Jit::new(crate::jit::JitConfig::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/target/tmp/jit-cache"
        )));
        let mut deployment =
            crate::kernels::Deployment::new(crate::kernels::ModelShape::MlaBf16, 16, 1).unwrap();
        deployment.transfer_path = path;
        let config = ClusterConfig {
            deployment,
            layers: 1,
            device_pages: 9,
            host_pages: 4,
            policy: WritePolicy::WriteThrough,
            fault: None,
            sanitize: crate::jit::Sanitize::None,
        };
        let exec = Arc::new(crate::exec::HostExecutor::new(
            crate::exec::HostOptions::default(),
        ));
        let member = crate::group::LocalGroup::members(1, std::time::Duration::from_secs(60))
            .pop()
            .unwrap();
        RankCache::new(config, exec, &jit, Box::new(member), PeerAccess::Mapped).unwrap()
    }

    /// Two pairs with one destination page are refused before anything is uploaded,
    /// launched or copied, on the kernel path and on the DMA path.
    #[test]
    fn a_transfer_naming_one_destination_twice_moves_nothing() {
        for path in [
            TransferPath::Kernel,
            TransferPath::Dma,
            TransferPath::DmaEach,
        ] {
            let mut r = one_rank(path);
            let before = r.exec.counters();
            let err = r
                .transfer(Direction::HostToDevice, &[0, 1], &[2, 2], 0..1, None)
                .unwrap_err();
            assert!(
                matches!(&err, ClusterError::BadTransfer { rank: 0, what }
                    if what.contains("pairs 0 and 1 both write destination page 2")),
                "{path}: {err}"
            );
            let d = r.exec.counters().since(&before);
            assert_eq!((d.uploads, d.launches, d.copies), (0, 0, 0), "{path}");
            // Distinct pages move.
            r.transfer(Direction::HostToDevice, &[0, 1], &[2, 3], 0..1, None)
                .unwrap();
        }
    }

    #[test]
    fn mismatches_count_bits_once_and_find_the_first() {
        let words: [u32; 3] = [0, 0b1010_0000, 1 << 31];
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        assert_eq!(
            Mismatches::from_bitmap(&bytes),
            Mismatches {
                count: 3,
                first: Some(32 + 5)
            }
        );
        assert_eq!(Mismatches::from_bitmap(&[0; 8]), Mismatches::default());
    }
}
