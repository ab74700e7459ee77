//! One CP rank's whole cache, as an engine process hosts it: [`RankCache`].
//!
//! A rank owns its radix-tree replica, its allocator replica over the whole logical page
//! space (every rank must know every page's owner), its host page pool, its device pools
//! (its owned pages only), its executor and the deployment's kernels. It agrees with its
//! peers through a [`Collective`]: decisions that depend only on replicated state (matching,
//! allocation, device eviction, a backup's host plan, since every rank's host usage follows
//! from the replicated tree and its capacity from start-up) are taken locally and come out
//! identical on every rank; what depends on per-rank state goes through the group (whether
//! any rank failed a step, the mismatch bitmaps, the digests of every step's decision).
//!
//! One request flows one way: match → load back → allocate → compute → materialise →
//! verify → insert → back up → release ([`RankCache::serve`]). Attention on every rank reads
//! each page from its owner's pool, so every rank materialises and verifies the whole
//! sequence over its own view of all owners' pools ([`pools::PeerAccess`]); a wrong peer
//! mapping shows as mismatches on the rank that has it.
//!
//! # Rounds, fences, and why each is there
//!
//! - *Start-up* ([`START_ROUND`]): every rank's settings (compared: ranks that differ never
//!   start), host capacity and pool handles; a rank that cannot start contributes its
//!   failure here, so its peers fail at once. *Pools connected*: every rank has mapped
//!   every peer's pools before any request makes a peer read them, and before the names
//!   are removed ([`Pools::seal`]).
//! - Every agreed step ends with an *outcome* round carrying the rank's decision digest
//!   (its inputs and a summary of the state it left): a failure on any rank rolls the step
//!   back everywhere, and ranks that decided differently all undo it
//!   ([`ClusterError::Diverged`]).
//! - *begin* fence: a rank with an executor of its own ([`PeerAccess::Mapped`]) records an
//!   interprocess event (CUDA: `CU_EVENT_INTERPROCESS`, its handle exchanged at start-up)
//!   after a step's load-backs and before the outcome round; after the round every rank's
//!   cache stream waits for each peer's on the device (`src/rank/fence.rs`). So when `begin` returns,
//!   work ordered after the cache's stream (its own, an engine stream handed in) reads
//!   every peer's loaded pages. Executors without such events (the host executor)
//!   synchronise their stream instead: one host wait per step ([`RankCache::step`]) whose
//!   admissions loaded something, counted in [`RequestStats::fence_syncs`];
//!   `load_path_syncs` counts only what the load-back itself did.
//! - *end* fence ([`RankCache::end`]): `finish` and `abandon` free nothing a peer may still
//!   read before every rank has reached the request's end round.
//! - In [`RankCache::serve`]: *request N written* (after load-back and synthesis, with the
//!   same fence), *request N verified* (no rank frees, poisons or reuses a
//!   page of this sequence while a peer may still read it), then the outcome.
//!
//! The SGLang call each method stands for is named in its documentation.

mod backup;
mod config;
mod evict;
mod fence;
mod kernels;
mod live;
mod load;
pub mod pools;
mod prefetch;
mod request;
mod rollback;
mod stats;
mod storage;
mod transfer;
#[cfg(test)]
use crate::kernels::PoolShape;
#[cfg(test)]
pub(crate) use transfer::check_transfer_pages;
use transfer::On;
mod verify;

pub use config::{ClusterConfig, ClusterError, Fault, PeerErrorKind, WritePolicy};
use evict::Eviction;
pub use kernels::{DeploymentKernels, KernelLoadError, Loaded, SourceHook};
pub use live::{BatchServed, LiveShape};
pub use load::LoadHandle;
pub use pools::{PeerAccess, PoolGeometry, Pools};
pub use prefetch::PREFETCH_BYTES;
use request::StorageRead;
pub use request::{Ending, Request, Step, StepOutcome};
use rollback::{Freed, DIGEST};
pub use stats::{RequestStats, RollbackDrops, RANK_COUNTS};
pub use storage::{StoragePolicy, STORAGE_ROUND};
pub use verify::{Mismatches, Verdict};

use crate::allocator::kernel::{KernelAllocOptions, KernelLaneAllocator};
use crate::allocator::{AllocError, OwnerLaneAllocator, StateDigest};
use crate::exec::{EventId, Executor, KernelArg};
use crate::group::{Collective, Counted, GroupError};
use crate::hicache::host_pool::HostPagePool;
use crate::hicache::tree::{Evicted, MatchResult, NodeId, RadixTree, TreeError};
use crate::jit::Jit;
use crate::kernels::{reference, BufferKind, Direction};
use crate::layout::{zigzag_owners, CpLayout, PageId, Rank};
use crate::metadata::{HostPage, NodeMetadata};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
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
    group: Counted,
    /// Every rank's host pool capacity (pages), from the start-up round: with the replicated
    /// tree it tells every rank's host free count, so a backup's plan needs no round.
    host_capacities: Vec<u32>,
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
    /// Bytes a step asks to piggyback on its outcome round (after the decision digest).
    outcome_note: Vec<u8>,
    /// Every rank's note from the last agreed outcome round, in rank order.
    outcome_notes: Vec<Vec<u8>>,
    /// After the disconnect round ([`RankCache::disconnect`]).
    disconnected: bool,
    /// The third tier, once attached ([`RankCache::attach_storage`]).
    storage: Option<storage::Tier>,
    /// The thread reading records ahead of requests ([`RankCache::prefetch`]), once asked.
    prefetcher: Option<prefetch::Prefetcher>,
    /// Whether a load's reader waits for each layer ([`RankCache::set_layer_waits`]).
    layer_waits: bool,
    /// A digest chained over the steps decided without a round since the last one
    /// ([`RankCache::step`]): the next decision digest covers them.
    unagreed: Vec<u8>,
    /// Steps called so far: names a batch's rounds.
    steps: u64,
    /// Backups that may still run on the executor's backup stream ([`RankCache::write_back`]):
    /// their pages are freed only after them.
    backups: Vec<backup::PendingBackup>,
    /// The interprocess fence of a [`PeerAccess::Mapped`] group on an executor that has one
    /// (`None`: fence on the host).
    fences: Option<fence::Fences>,
}

/// The name of a group's first round (every rank's configuration, host capacity and pool
/// handles). A rank that cannot start contributes its failure to it
/// ([`RankCache::refuse_start`]), so its peers fail at once instead of at the group timeout.
pub const START_ROUND: &str = "start-up";

/// What a rank tells its peers in the start-up round.
#[derive(serde::Serialize, serde::Deserialize)]
struct StartUp {
    /// The settings every rank must share, by name, as text (compared, and shown when they
    /// differ).
    settings: Vec<(String, String)>,
    /// This rank's host pool pages (may differ between ranks).
    host_pages: u32,
    /// Its device pool handle per buffer kind, in the deployment's order.
    handles: Vec<Vec<u8>>,
    /// Its fence's interprocess event handles ([`fence`]), none where the executor has no
    /// such events or peers share this rank's executor.
    #[serde(default)]
    fences: Vec<Vec<u8>>,
}

impl StartUp {
    fn settings(
        config: &ClusterConfig,
        layout: &CpLayout,
        access: PeerAccess,
    ) -> Vec<(String, String)> {
        let dep = &config.deployment;
        let fault = config.fault.map_or("none".to_string(), |f| f.to_string());
        [
            ("deployment", dep.name.clone()),
            ("TP shard", dep.tp().to_string()),
            ("kernels", format!("{dep:?}")),
            ("layers", config.layers.to_string()),
            ("device pages", config.device_pages.to_string()),
            ("layout", format!("{layout:?}")),
            ("CP layout", dep.layout.to_string()),
            ("write policy", config.policy.to_string()),
            ("fault", fault),
            ("peer access", format!("{access:?}")),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Each setting that differs between `all` (in rank order), with every rank's value.
    fn differences(all: &[StartUp]) -> Vec<String> {
        let mut out = Vec::new();
        for (i, (name, value)) in all[0].settings.iter().enumerate() {
            let values: Vec<Option<&String>> = all
                .iter()
                .map(|s| s.settings.get(i).filter(|(n, _)| n == name).map(|(_, v)| v))
                .collect();
            if values.iter().any(|v| *v != Some(value)) {
                let each: Vec<String> = values
                    .iter()
                    .enumerate()
                    .map(|(r, v)| format!("rank {r} {}", v.map_or("(missing)", |v| v.as_str())))
                    .collect();
                out.push(format!("{name}: {}", each.join(", ")));
            }
        }
        if let Some((r, _)) = all
            .iter()
            .enumerate()
            .find(|(_, s)| s.settings.len() != all[0].settings.len())
        {
            out.push(format!("rank {r} sends a different list of settings"));
        }
        out
    }
}

impl RankCache {
    /// Builds rank `group.rank()`: its kernels on `exec`, its pools (poisoned), its tree,
    /// allocator and host pool; then, in one round, compares its settings with every peer's
    /// and gathers their host capacities and pool handles, maps every peer's pools, and
    /// confirms in a second round that every rank has. Every rank must call this. A rank
    /// that fails contributes its failure to the round its peers are in, so every rank fails
    /// at once ([`ClusterError::StartFailed`] naming it) instead of waiting for the group
    /// timeout. Settings that differ fail every rank with [`ClusterError::ConfigDiverged`].
    /// On the host executor the pools' shared-memory names are removed once every peer has
    /// mapped them, so a rank killed later leaks nothing. SGLang: `HiRadixCache.__init__`
    /// with its `HiCacheController` and host pool.
    pub fn new(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        group: Box<dyn Collective>,
        peer_access: PeerAccess,
    ) -> Result<RankCache, ClusterError> {
        // SAFETY: no engine memory is adopted.
        unsafe { Self::start(config, exec, jit, group, peer_access, None) }
    }

    /// [`RankCache::new`] over an engine's device memory: `device` holds one [`Tensors`](crate::ops::Tensors)
    /// per buffer kind, in the model's order (SGLang's per-layer tensors, one layer-major or
    /// one page-major cross-layer tensor), adopted as this rank's device pools instead of
    /// allocating them ([`Pools::adopting`]: what is checked, and what is refused). The
    /// kernels reach it through page tables; every peer's pool must have the same page
    /// stride, which start-up checks ([`Pools::connect`]). The engine reads the KV the cache
    /// loads, and the cache verifies what the engine wrote, in the engine's own tensors.
    ///
    /// # Safety
    /// Every region must be memory of `exec`'s address space, valid for reads and writes
    /// while the cache lives, and left to the cache's kernels while a step runs.
    pub unsafe fn adopting(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        group: Box<dyn Collective>,
        peer_access: PeerAccess,
        device: &[crate::ops::Tensors],
    ) -> Result<RankCache, ClusterError> {
        // SAFETY: the caller's contract.
        unsafe { Self::start(config, exec, jit, group, peer_access, Some(device)) }
    }

    /// [`RankCache::new`], adopting `device` when given.
    ///
    /// # Safety
    /// As [`RankCache::adopting`] for `device`.
    unsafe fn start(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        group: Box<dyn Collective>,
        peer_access: PeerAccess,
        device: Option<&[crate::ops::Tensors]>,
    ) -> Result<RankCache, ClusterError> {
        let group = Counted::new(group);
        let rank = group.rank();
        let refuse = |e: ClusterError| {
            let _ = Self::refuse_start(&group, &e.to_string());
            e
        };
        let (layout, config, exec, kernels, pools, tree, alloc, host) =
            // SAFETY: the caller's contract for `device`.
            unsafe { Self::build(config, exec, jit, &group, peer_access, device) }
                .map_err(refuse)?;
        let buffers = config.deployment.model.buffers();
        let handles = buffers
            .iter()
            .map(|&b| pools.handle(b))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| refuse(e.into()))?;
        // Interprocess events for the fence, where peers read this rank's pools through
        // executors of their own.
        let own_fences = if peer_access == PeerAccess::Mapped && group.size() > 1 {
            fence::Fences::create(&exec, pools.geometry().layers).map_err(|e| refuse(e.into()))?
        } else {
            None
        };
        let (own_fences, fence_handles) = match own_fences {
            Some((events, handles)) => (Some(events), handles),
            None => (None, Vec::new()),
        };
        // This rank's fence events, released when this goes (a failed start-up round
        // included); after a failure past that round, only once every peer has finished
        // opening them (the *pools connected* round).
        let mut fences = own_fences.map(|own| fence::Fences::new(&exec, own));
        let mine = StartUp {
            settings: StartUp::settings(&config, &layout, peer_access),
            host_pages: pools.geometry().host_pages,
            handles,
            fences: fence_handles,
        };
        let mine = serde_json::to_vec(&mine).expect("plain data serialises");
        let all = group
            .all_gather(START_ROUND, &mine)
            .map_err(|e| Self::start_error(rank, e))?;
        let all: Vec<StartUp> = all
            .iter()
            .enumerate()
            .map(|(r, bytes)| {
                serde_json::from_slice(bytes).map_err(|e| ClusterError::ConfigDiverged {
                    rank: rank.0,
                    differences: vec![format!("rank {r} sent an unreadable start-up: {e}")],
                })
            })
            .collect::<Result<_, _>>()?;
        // Every rank sees the same contributions, so every rank fails alike here.
        let differences = StartUp::differences(&all);
        if !differences.is_empty() {
            return Err(ClusterError::ConfigDiverged {
                rank: rank.0,
                differences,
            });
        }
        let mut pools = pools;
        let fence_handles: Vec<Vec<Vec<u8>>> = all.iter().map(|s| s.fences.clone()).collect();
        let connected = buffers.iter().enumerate().try_for_each(|(i, &b)| {
            let handles: Vec<Vec<u8>> = all
                .iter()
                .map(|s| s.handles.get(i).cloned().unwrap_or_default())
                .collect();
            pools
                .connect(b, usize::from(rank.0), &handles)
                .map_err(|(peer, source)| ClusterError::PeerPool {
                    rank: rank.0,
                    peer: peer as u8,
                    buffer: b,
                    source,
                })
        });
        // Every peer's fence events, opened.
        let connected = connected.and_then(|()| {
            let Some(own) = fences.as_mut() else {
                return Ok(());
            };
            match own.open_peers(&fence_handles, usize::from(rank.0)) {
                Ok(true) => Ok(()),
                // Not every rank offered a full ring: every rank fences on the host.
                Ok(false) => {
                    fences = None;
                    Ok(())
                }
                Err((peer, source)) => Err(ClusterError::PeerFence {
                    rank: rank.0,
                    peer: peer as u8,
                    source,
                }),
            }
        });
        // Every rank has mapped every peer before any request makes a peer read them, and
        // before any name is removed. A rank that failed keeps its pools and events until
        // this round, so that no peer's mapping or open fails for want of them.
        match connected {
            Ok(()) => group
                .barrier("pools connected")
                .map_err(|e| Self::start_error(rank, e))?,
            Err(e) => {
                let _ = group.fail("pools connected", &format!("could not start: {e}"));
                drop(fences);
                return Err(e);
            }
        }
        pools.seal().map_err(|e| {
            let e = ClusterError::from(e);
            group.abort(&format!("rank {} could not seal its pools: {e}", rank.0));
            e
        })?;
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
            host_capacities: all.iter().map(|s| s.host_pages).collect(),
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
            outcome_note: Vec::new(),
            outcome_notes: Vec::new(),
            disconnected: false,
            storage: None,
            prefetcher: None,
            layer_waits: false,
            unagreed: Vec::new(),
            backups: Vec::new(),
            fences,
            steps: 0,
        })
    }

    /// Leaves the group: one last round ("disconnect") in which every rank says it is done
    /// with its peers' pools, then this rank's pools are freed. Over CUDA IPC a pool freed
    /// while a peer still maps it is undefined behaviour; the round rules that out. Every rank
    /// calls it; a rank that closes while its peers still serve fails their current round at
    /// once (the calls differ), instead of leaving them to the group timeout.
    ///
    /// Dropping a cache without `close` makes no round (a drop cannot wait on peers, and may
    /// run at interpreter shutdown): its shared-memory pools are unlinked already, so peers'
    /// mappings stay valid on the host executor, but CUDA IPC peers must be done first.
    pub fn close(mut self) -> Result<(), ClusterError> {
        self.disconnect()
    }

    /// The round of [`RankCache::close`], for a caller that must keep the pools until the
    /// last view of them is gone (Python tensors taken from them): every later step is
    /// refused. Idempotent.
    pub fn disconnect(&mut self) -> Result<(), ClusterError> {
        if self.disconnected {
            return Ok(());
        }
        self.disconnected = true;
        Ok(self.group.barrier("disconnect")?)
    }

    /// Refuses a step after [`RankCache::disconnect`].
    pub(super) fn check_connected(&self) -> Result<(), ClusterError> {
        if self.disconnected {
            return Err(ClusterError::Config(format!(
                "rank {}: this cache was closed (it left its group)",
                self.rank.0
            )));
        }
        Ok(())
    }

    /// Tells the group that this rank cannot start, in its first round ([`START_ROUND`]):
    /// every peer's start-up then fails at once with [`ClusterError::StartFailed`] naming
    /// this rank and `why`. For a caller that fails before [`RankCache::new`] (an engine's
    /// own checks, a wrapper's arguments); `new` does this itself for its own failures.
    /// Waits for the peers to reach their first round. An error means the group itself
    /// broke.
    pub fn refuse_start(group: &dyn Collective, why: &str) -> Result<(), GroupError> {
        group
            .fail(START_ROUND, &format!("could not start: {why}"))
            .map(drop)
    }

    /// A failed start-up round as this rank reports it.
    fn start_error(rank: Rank, e: GroupError) -> ClusterError {
        match e {
            GroupError::PeerFailed { failures } => ClusterError::StartFailed {
                rank: rank.0,
                failures,
            },
            e => e.into(),
        }
    }

    /// Everything start-up builds before its rounds.
    ///
    /// # Safety
    /// As [`RankCache::adopting`] for `device`.
    #[allow(clippy::type_complexity)]
    unsafe fn build(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        group: &dyn Collective,
        peer_access: PeerAccess,
        device: Option<&[crate::ops::Tensors]>,
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
        let pools = match device {
            None => Pools::new(exec.clone(), dep, geometry, peer_access)?,
            // SAFETY: the caller's contract.
            Some(device) => {
                unsafe { Pools::adopting(exec.clone(), dep, geometry, peer_access, device) }?
            }
        };
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

    /// A digest of this rank's own host state, which [`RankCache::digest`] leaves out (host
    /// slots differ between ranks by design): its host pool (free stack and allocations) and
    /// which host pages each node's copy holds. Equal before and after a request that was
    /// rolled back without dropping anything.
    pub fn host_digest(&self) -> StateDigest {
        let mut h = Sha256::new();
        h.update(self.host.digest().0);
        for id in self.tree.node_ids() {
            if let Some(meta) = self.tree.node(id).ok().and_then(|n| n.host()) {
                h.update(id.to_bits().to_le_bytes());
                for p in meta.host_pages() {
                    h.update(p.0.to_le_bytes());
                }
            }
        }
        StateDigest(h.finalize().into())
    }

    /// Every rank's [`RankCache::digest`], all-gathered (a collective: every rank calls it).
    pub fn all_digests(&self, what: &str) -> Result<Vec<StateDigest>, ClusterError> {
        // Numbered, so that two ranks pairing different digest calls of one name fail as a
        // divergence at once instead of a later call.
        let seq = self.digest_calls.get();
        self.digest_calls.set(seq + 1);
        let round = format!("{what} #{seq}");
        let all = self.group.all_gather(&round, &self.digest().0)?;
        self.check_round(&round, &all, |_, b| {
            (b.len() != 32).then(|| format!("a {}-byte digest", b.len()))
        })?;
        Ok(all
            .into_iter()
            .map(|d| StateDigest(d.try_into().expect("checked: 32 bytes")))
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

    /// Whether whoever reads a load-back waits for each layer with
    /// [`LoadHandle::wait_layer`] first (off by default). On, a load runs layer by layer on
    /// the executor's load stream (CUDA: a stream of its own at the greatest priority), each
    /// layer followed by its event, so that layer `l + 1` copies while layer `l` is read;
    /// verification waits so. Off, a load is one all-layer transfer on the cache's stream,
    /// in order with all other work, so a reader that orders its stream after the cache's
    /// ([`Executor::lead_stream`]) sees it whole. Turn it on only where every reader of
    /// loaded pages waits per layer.
    pub fn set_layer_waits(&mut self, on: bool) {
        self.layer_waits = on;
    }

    /// Makes the cache's work from now on wait, on the device, for the work the engine has
    /// enqueued so far on its `stream` (a raw `CUstream`): what an engine hands to `finish`
    /// and `extend` so that the backups of the pages its forward wrote copy what it wrote,
    /// with no host synchronisation. Executors that run every call before it returns (the
    /// host executor) have nothing to order.
    ///
    /// # Safety
    /// `stream` must be a live stream of the cache's device context (or 0, the legacy
    /// default stream): the driver dereferences the handle.
    pub unsafe fn follow_engine_stream(&self, stream: u64) -> Result<(), crate::exec::ExecError> {
        if self.exec.backend() != crate::exec::Backend::Cuda {
            return Ok(());
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.exec.follow_stream(stream) }
    }

    /// Makes the engine's `stream` (a raw `CUstream`) wait, on the device, for the work the
    /// cache has enqueued so far: what an engine hands to `begin`, `allocate`, `extend` and
    /// `step` so that its forward writes the pages they handed out only after the cache's
    /// work on them (a freed page's poison, a load that is not layer-wise). Executors that
    /// run every call before it returns have nothing to order.
    ///
    /// # Safety
    /// As [`RankCache::follow_engine_stream`].
    pub unsafe fn lead_engine_stream(&self, stream: u64) -> Result<(), crate::exec::ExecError> {
        if self.exec.backend() != crate::exec::Backend::Cuda {
            return Ok(());
        }
        // SAFETY: the caller's contract, passed on.
        unsafe { self.exec.lead_stream(stream) }
    }

    /// Whether loads go layer by layer for readers that wait per layer
    /// ([`RankCache::set_layer_waits`]).
    pub fn layer_waits(&self) -> bool {
        self.layer_waits
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
        &self.group
    }

    /// The last served request's [`RequestStats::rank_counts`] summed over every rank:
    /// each rank's counts ride on the request's outcome round, so a driver of one rank per
    /// process reports group totals without a round of its own. Zeros before the first
    /// request, and after a request that failed.
    pub fn group_sums(&self) -> [u64; RANK_COUNTS] {
        let mut out = [0u64; RANK_COUNTS];
        for note in &self.outcome_notes {
            for (o, c) in out.iter_mut().zip(note.chunks_exact(8)) {
                *o = o.saturating_add(u64::from_le_bytes(c.try_into().expect("8 bytes")));
            }
        }
        out
    }

    /// Group rounds this rank has taken part in since it was built (start-up included).
    pub fn rounds(&self) -> u64 {
        self.group.rounds()
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
        self.agreed("eviction", &(pages as u64).to_le_bytes(), |me| {
            me.evict(Eviction::Lru(pages), &mut RequestStats::default())
        })
    }

    /// Serves one prompt: match, load back, compute the rest, materialise and verify,
    /// insert, back up, release; every rank of the group calls it with the same prompt. On
    /// an error on any rank, every rank restores its state to what it was, so a failed
    /// request leaves no trace but the error: this rank's own, or
    /// [`GroupError::PeerFailed`] naming the rank
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
        let rounds = self.rounds();
        let inputs = Self::request_inputs(tokens, &[], 0);
        let mut stats = self.agreed(&format!("request {n}"), &inputs, |me| {
            let result = me.serve_inner(tokens, n, panic_here);
            if armed {
                // A request that returned before its first launch did not consume the
                // failure: disarm on every exit, before the rollback.
                me.exec.disarm_launch_failure();
            }
            result
        })?;
        stats.group_rounds = self.rounds() - rounds;
        Ok(stats)
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
        // No fence after the load: compute_and_verify synchronises before its first round.
        let mut req = self.begin_inner(tokens, n, panic_here, false, StorageRead::Round)?;
        self.allocate_inner(&mut req)?;
        // 4-5. Synthesise the computed pages this rank owns, materialise everything from the
        // owners' pools, verify against the synthesised KV.
        let bad = self.compute_and_verify(
            &req.hashes,
            &req.pages,
            req.fresh_from,
            n,
            req.load.as_ref(),
        )?;
        req.load = None;
        req.stats.mismatched_tokens = bad.all.count;
        req.stats.first_mismatched_token = bad.all.first;
        req.stats.bytes_gathered += bad.bytes_gathered;
        self.last_verdict = bad;
        // The "verified" round was the fence: no peer reads this sequence any more, so the
        // pages the tree does not keep are freed at once.
        let release = self.finish_inner(&mut req)?;
        self.release_pages(release)?;
        // This rank's byte counts ride on the outcome round ([`RankCache::group_sums`]).
        self.outcome_note = req
            .stats
            .rank_counts()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        Ok(req.stats)
    }
}

#[cfg(test)]
mod tests;
