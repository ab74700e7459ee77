//! The CP cluster: C rank replicas driven in lockstep by one request stream.
//!
//! Each rank has its own radix tree, device allocator and host page pool. They see the same
//! calls, so their trees and allocators stay identical; [`Cluster::replicas_agree`] checks
//! it through state digests after every request. Each rank moves only the bytes of the pages
//! it owns; materialisation gathers every page from its owner's pool, as attention does, and
//! the verify kernel compares the result with deterministically synthesised KV, so a page
//! loaded into the wrong owner shows up as mismatched tokens.
//!
//! Decisions that must be identical on every rank (whether a backup happens, which nodes
//! are evicted) are taken once for the cluster from all ranks' counts, the way an engine
//! would agree on them with an all-reduce.
//!
//! Driving it from Rust (the CPU emulation executor here; `exec::open_executor` picks a GPU
//! when there is one): a prompt is computed, evicted from the device to the host, and loaded
//! back with its owners on the next hit, every token verified.
//!
//! ```
//! use std::sync::Arc;
//! use cp_hicache::cluster::{Cluster, ClusterConfig, WritePolicy};
//! use cp_hicache::exec::{HostExecutor, HostOptions};
//! use cp_hicache::jit::{Jit, JitConfig, Sanitize};
//! use cp_hicache::kernels::{Deployment, ModelShape};
//!
//! let jit = Jit::new(JitConfig::new(std::env::temp_dir().join("cp-hicache-doc-cache")));
//! # if jit.host_compiler().is_err() && std::env::var_os("CP_HICACHE_REQUIRE_HOSTCC").is_none() {
//! #     return Ok(()); // no C++ compiler to build the emulated kernels with
//! # }
//! let config = ClusterConfig {
//!     deployment: Deployment::new(ModelShape::MlaBf16, 16, 2)?, // page 16, CP 2
//!     layers: 1,
//!     device_pages: 65, // 32 per rank, plus the null page
//!     host_pages: 64,   // per rank
//!     policy: WritePolicy::WriteThrough,
//!     fault: None,
//!     sanitize: Sanitize::None,
//! };
//! let mut cluster = Cluster::new(config, Arc::new(HostExecutor::new(HostOptions::default())), &jit)?;
//! let prompt: Vec<u32> = (0..160).collect(); // 10 pages, zigzag owners 0,0,0,1,1,1,1,1,0,0
//! let cold = cluster.serve(&prompt)?;
//! assert_eq!(cold.computed_tokens, 160);
//! cluster.evict_device_lru(usize::MAX)?; // the device copy goes; the host backup stays
//! let warm = cluster.serve(&prompt)?;
//! assert_eq!(warm.host_hit_tokens, 160); // loaded back into pages with the same owners
//! assert_eq!(warm.mismatched_tokens, 0); // every token checked against synthesised KV
//! assert_eq!(warm.load_path_syncs, 0); // the load path read nothing back from the device
//! assert!(cluster.replicas_agree());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod kernels;
mod pools;
pub mod stats;

pub use kernels::{DeploymentKernels, KernelLoadError, Loaded, SourceHook};
pub use pools::{PoolGeometry, Pools};
pub use stats::{ReplayReport, RequestStats};

use crate::allocator::kernel::{KernelAllocError, KernelAllocOptions, KernelLaneAllocator};
use crate::allocator::{AllocError, OwnerLaneAllocator, StateDigest};
use crate::exec::{Executor, KernelArg};
use crate::hicache::host_pool::{HostPagePool, HostPoolError};
use crate::hicache::tree::{Evicted, NodeId, RadixTree, TreeError};
use crate::jit::{Jit, Sanitize};
use crate::kernels::{
    reference, transfer_regions, BufferKind, Deployment, Direction, PoolShape, TransferPath,
};
use crate::layout::{zigzag_owners, CpLayout, LayoutError, PageId, Rank};
use crate::metadata::{HostPage, MetadataError, NodeMetadata};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// When device pages are backed up to the host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WritePolicy {
    /// Back up every node when it is inserted.
    #[default]
    WriteThrough,
    /// Back up a node only when it is about to be evicted from the device.
    WriteBack,
}

impl fmt::Display for WritePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WritePolicy::WriteThrough => "write_through",
            WritePolicy::WriteBack => "write_back",
        })
    }
}

impl FromStr for WritePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "write_through" | "write-through" => Ok(WritePolicy::WriteThrough),
            "write_back" | "write-back" => Ok(WritePolicy::WriteBack),
            _ => Err(format!(
                "unknown write policy `{s}` (expected write_through or write_back)"
            )),
        }
    }
}

/// Faults injected on purpose to exercise failure paths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fault {
    /// The seed's bug: load-back allocates with plain `alloc_pages`, ignoring owners.
    PlainAllocOnLoad,
    /// Half of lane 0 is reserved for ever, so lane 0 runs short first.
    LaneExhaustion,
    /// The host pools hold almost nothing, so backups evict host LRU or are skipped.
    HostPoolFull,
    /// One kernel's source is broken before compiling.
    CompileError,
    /// The executor fails one launch (of the request given to [`Cluster::inject_launch_failure`]).
    LaunchError,
}

impl Fault {
    /// Every fault, for help texts.
    pub const ALL: [Fault; 5] = [
        Fault::PlainAllocOnLoad,
        Fault::LaneExhaustion,
        Fault::HostPoolFull,
        Fault::CompileError,
        Fault::LaunchError,
    ];
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Fault::PlainAllocOnLoad => "plain-alloc-on-load",
            Fault::LaneExhaustion => "lane-exhaustion",
            Fault::HostPoolFull => "host-pool-full",
            Fault::CompileError => "compile-error",
            Fault::LaunchError => "launch-error",
        })
    }
}

impl FromStr for Fault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Fault::ALL
            .into_iter()
            .find(|f| f.to_string() == s)
            .ok_or_else(|| {
                let names: Vec<String> = Fault::ALL.iter().map(Fault::to_string).collect();
                format!(
                    "unknown fault `{s}` (expected one of: {})",
                    names.join(", ")
                )
            })
    }
}

/// Everything that shapes a cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Model shapes, page size, CP degree and kernel launch shapes.
    pub deployment: Deployment,
    /// Layers per buffer kind.
    pub layers: u32,
    /// Logical device pages (the layout's page count, null page included).
    pub device_pages: u32,
    /// Host pages per rank.
    pub host_pages: u32,
    /// Backup policy.
    pub policy: WritePolicy,
    /// A fault to inject, if any.
    pub fault: Option<Fault>,
    /// Sanitizer build of host-emulation kernels.
    pub sanitize: Sanitize,
}

/// Host pages per rank left when [`Fault::HostPoolFull`] is injected.
const HOST_PAGES_UNDER_FAULT: u32 = 2;

impl ClusterConfig {
    /// The layout of the device pages (an invalid page size, CP degree or page count is an
    /// error).
    pub fn layout(&self) -> Result<CpLayout, ClusterError> {
        let dep = &self.deployment;
        Ok(CpLayout::new(
            u32::from(dep.cp),
            dep.page_size,
            self.device_pages,
        )?)
    }

    /// The pools a cluster of this configuration allocates: each rank's share of the device
    /// pages, and its host pages (fewer under [`Fault::HostPoolFull`]). Known before anything
    /// is allocated, so a caller can check them against the memory it has.
    pub fn pool_geometry(&self) -> Result<PoolGeometry, ClusterError> {
        let host_pages = if self.fault == Some(Fault::HostPoolFull) {
            self.host_pages.min(HOST_PAGES_UNDER_FAULT)
        } else {
            self.host_pages
        };
        Ok(PoolGeometry {
            layers: self.layers,
            local_pages: self.layout()?.local_pages_per_rank(),
            host_pages,
        })
    }
}

/// Why the cluster could not serve a request (its state is then unchanged).
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// Invalid layout settings.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The kernels could not be made ready.
    #[error(transparent)]
    Kernels(#[from] KernelLoadError),
    /// An executor operation failed (for example a failed launch).
    #[error(transparent)]
    Exec(#[from] crate::exec::ExecError),
    /// An allocator misuse (a bug, never a shortage).
    #[error("allocator: {0}")]
    Alloc(#[from] AllocError),
    /// The kernel-backed allocator failed (a launch, an upload, or a misuse).
    #[error("allocator: {0}")]
    KernelAlloc(#[from] KernelAllocError),
    /// A host pool misuse (a bug, never a shortage: backups check the free counts first).
    #[error(transparent)]
    HostPool(#[from] HostPoolError),
    /// A tree operation was refused.
    #[error(transparent)]
    Tree(#[from] TreeError),
    /// Invalid metadata was produced.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// The rank replicas, which see the same calls, decided differently (a bug).
    #[error("rank replicas diverged: {what}")]
    ReplicasDiverged {
        /// How.
        what: String,
    },
    /// A rank's device lane stacks differ from its allocator's host mirror.
    #[error("rank {rank}: {source}")]
    DeviceLanes {
        /// The rank.
        rank: u8,
        /// The difference (or why the lanes could not be read).
        source: KernelAllocError,
    },
    /// A pool cannot hold what a request needs even after evicting everything it may.
    #[error("{what}: raise {flag}")]
    PoolTooSmall {
        /// What did not fit.
        what: String,
        /// The option that sizes the pool.
        flag: &'static str,
        /// Pages the request needs at once.
        needed: u64,
        /// Pages it could have: free ones once everything unlocked is evicted, plus the ones
        /// it already holds (lanes can still be short when this is not below `needed`).
        available: u64,
    },
    /// Settings that cannot work together.
    #[error("invalid cluster setting: {0}")]
    Config(String),
    /// A transfer named a page outside its pool, had unequal page lists, or named one
    /// destination page in two pairs. A bug (the pools hand out only their own pages, each
    /// once), refused before anything moves: the kernel and the DMA path would skip a pair
    /// outside its pool silently and leave the page's old bytes, and on a GPU two pairs
    /// writing one page interleave their sources.
    #[error("rank {rank}: {what}")]
    BadTransfer {
        /// The rank whose pools the transfer is between.
        rank: usize,
        /// What is wrong with it.
        what: String,
    },
}

impl ClusterError {
    /// Why a kernel launch failed, when this error is a failed launch (of a cache kernel or
    /// of an allocator kernel), e.g. [`LaunchFailure::Injected`](crate::exec::LaunchFailure).
    pub fn launch_failure(&self) -> Option<crate::exec::LaunchFailure> {
        match self {
            ClusterError::Exec(e) | ClusterError::KernelAlloc(KernelAllocError::Exec(e)) => {
                e.launch_failure()
            }
            _ => None,
        }
    }

    /// Whether a request could not fit in the pools at all (it was rolled back; later,
    /// smaller requests can still be served).
    pub fn is_pool_too_small(&self) -> bool {
        matches!(self, ClusterError::PoolTooSmall { .. })
    }

    /// Whether the error comes from the settings (exit status 2) rather than a failure.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            ClusterError::Layout(_) | ClusterError::PoolTooSmall { .. } | ClusterError::Config(_)
        )
    }
}

/// One rank's state: its tree and host pool on the host, its allocator's lanes on the
/// device (with the host mirror that decides).
struct RankState {
    tree: RadixTree,
    alloc: KernelLaneAllocator,
    host: HostPagePool,
}

/// Frees `pages` on every rank in `ranks`, even after one refuses: an undo that stopped at
/// the first failure would leave the later ranks holding pages nobody frees. Returns the
/// first failure.
fn free_on_every_rank(ranks: &mut [RankState], pages: &[PageId]) -> Result<(), KernelAllocError> {
    let mut first = None;
    for rank in ranks {
        if let Err(e) = rank.alloc.free(pages) {
            first.get_or_insert(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// Every rank's state as it was before an operation, to roll back to on error.
struct Snapshot(Vec<(RadixTree, OwnerLaneAllocator, HostPagePool)>);

/// What the operation in progress evicted: device pages (identical on every rank) and, per
/// rank, host pages. Their bytes may since have been overwritten by the same operation.
#[derive(Default)]
struct Freed {
    device: BTreeSet<PageId>,
    host: Vec<BTreeSet<HostPage>>,
}

impl Freed {
    fn host_mut(&mut self, rank: Rank) -> &mut BTreeSet<HostPage> {
        let r = usize::from(rank.0);
        if self.host.len() <= r {
            self.host.resize_with(r + 1, BTreeSet::new);
        }
        &mut self.host[r]
    }

    fn host(&self, rank: Rank) -> BTreeSet<HostPage> {
        self.host
            .get(usize::from(rank.0))
            .cloned()
            .unwrap_or_default()
    }
}

/// What the last rollback had to drop from the state it restored: cache entries whose pages
/// the failed operation had evicted and may have overwritten ([`Cluster::last_rollback`]).
/// A rollback that drops something leaves the replicas in agreement but their digests
/// different from before the request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RollbackDrops {
    /// Device pages whose nodes lost their device copy (identical on every rank).
    pub device_pages: u64,
    /// Nodes that lost their host copy.
    pub host_copies: u64,
}

impl RollbackDrops {
    /// Whether the rollback dropped nothing (the state is exactly as before the request).
    pub fn is_empty(&self) -> bool {
        self.device_pages == 0 && self.host_copies == 0
    }
}

/// C rank replicas, their pools, and the kernels that move their bytes.
pub struct Cluster {
    /// Tells clusters apart, so a pin is only given back to the cluster that took it.
    id: u64,
    layout: CpLayout,
    config: ClusterConfig,
    exec: Arc<dyn Executor>,
    kernels: DeploymentKernels,
    pools: Pools,
    ranks: Vec<RankState>,
    launch_failure_at: Option<usize>,
    served: usize,
    /// Pages the operation in progress evicted (and may have reused): a rollback must not
    /// bring back nodes that still point at them.
    freed: Freed,
    capture_dense: bool,
    last_dense: Vec<(BufferKind, Vec<u8>)>,
    /// Whether freed device pages and the dense buffer are poisoned again
    /// ([`Cluster::set_repoison`]).
    repoison: bool,
    /// What the last rollback dropped.
    last_rollback: RollbackDrops,
}

/// A prefix held on the device by [`Cluster::pin_prefix`], the way an in-flight request
/// holds the KV it is decoding from; give it back with [`Cluster::unpin`].
///
/// A receipt, not a value: it can be neither copied nor cloned, so a request can only give
/// back its own pin, once. (With a copy, one request unpinning twice would release another
/// request's lock on the same prefix, and eviction could reuse pages still being read.)
/// Dropping it without unpinning keeps the prefix locked.
///
/// ```compile_fail
/// fn twice(p: cp_hicache::cluster::Pinned) -> [cp_hicache::cluster::Pinned; 2] {
///     [p, p] // a pin cannot be given back twice
/// }
/// ```
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a pin holds the prefix until it is given to `Cluster::unpin`"]
pub struct Pinned {
    /// [`Cluster::id`] of the cluster that pinned it.
    cluster: u64,
    node: NodeId,
    /// Tokens of the pinned device-resident prefix (whole pages).
    pub tokens: usize,
}

/// A refused [`Cluster::unpin`]: why, and the pin, still held.
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct UnpinError {
    /// The pin given back, unchanged.
    pub pinned: Pinned,
    /// Why it was refused (boxed: cluster errors are large, unpins small).
    pub source: Box<ClusterError>,
}

impl Cluster {
    /// Builds the ranks, allocates the pools (poisoned) and makes every kernel ready.
    pub fn new(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
    ) -> Result<Cluster, ClusterError> {
        let dep = &config.deployment;
        let layout = config.layout()?;
        if config.layers == 0 {
            return Err(ClusterError::Config("--layers must be at least 1".into()));
        }
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
        let pools = Pools::new(exec.clone(), dep, geometry)?;
        let mut ranks = Vec::with_capacity(usize::from(layout.cp()));
        for r in 0..layout.cp() {
            ranks.push(RankState {
                tree: RadixTree::new(layout, Rank(r))?,
                alloc: KernelLaneAllocator::new(
                    layout,
                    exec.clone(),
                    jit,
                    KernelAllocOptions {
                        threads: dep.alloc_threads,
                        sanitize: config.sanitize,
                        arch: dep.arch,
                    },
                )?,
                host: HostPagePool::new(Rank(r), geometry.host_pages)?,
            });
        }
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let mut cluster = Cluster {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            layout,
            config,
            exec,
            kernels,
            pools,
            ranks,
            launch_failure_at: None,
            served: 0,
            freed: Freed::default(),
            capture_dense: false,
            last_dense: Vec::new(),
            repoison: true,
            last_rollback: RollbackDrops::default(),
        };
        if cluster.config.fault == Some(Fault::LaneExhaustion) {
            // Pages reserved for ever, on every rank alike: lane 0 keeps half its pages.
            let reserve = cluster.layout.lane_capacity(Rank(0)) / 2;
            let owners = vec![0u8; reserve as usize];
            for r in &mut cluster.ranks {
                r.alloc.alloc_pages_with_owners(&owners)?;
            }
        }
        Ok(cluster)
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

    /// Makes the first launch of request number `request` (0-based, counted over
    /// [`Cluster::serve`] calls) fail, so that request fails and is rolled back. The failure
    /// never outlives its request: if the request fails on its own before its first launch
    /// (a [`ClusterError::PoolTooSmall`], say), the failure is dropped with it. An empty prompt
    /// launches nothing, so a failure aimed at one moves to the next request.
    pub fn inject_launch_failure(&mut self, request: usize) {
        self.launch_failure_at = Some(request);
    }

    /// Per rank: a digest of the allocator and the tree (host slots excluded: they differ
    /// between ranks by design).
    pub fn replica_digests(&self) -> Vec<StateDigest> {
        self.ranks
            .iter()
            .map(|r| {
                let mut h = Sha256::new();
                h.update(r.alloc.digest().0);
                h.update(r.tree.digest().0);
                StateDigest(h.finalize().into())
            })
            .collect()
    }

    /// Whether every replica's digest is equal.
    pub fn replicas_agree(&self) -> bool {
        let d = self.replica_digests();
        d.windows(2).all(|w| w[0] == w[1])
    }

    /// Reads every rank's device lane stacks back and compares them with the allocator's host
    /// mirror, which decides every allocation: they differ only if a kernel or a rollback
    /// went wrong. A counted read-back per rank, so call it outside the load path (replay
    /// calls it once, after the run).
    pub fn check_device_lanes(&self) -> Result<(), ClusterError> {
        for r in &self.ranks {
            let rank = r.tree.rank().0;
            r.alloc
                .check_usable()
                .and_then(|()| r.alloc.debug_check_device())
                .map_err(|source| ClusterError::DeviceLanes { rank, source })?;
        }
        Ok(())
    }

    /// Free device pages per lane (rank 0's replica).
    pub fn lane_free_counts(&self) -> Vec<u32> {
        self.ranks[0].alloc.lane_free_counts()
    }

    /// Checks every rank's allocator and tree invariants, conservation included.
    pub fn check_invariants(&self) -> Result<(), ClusterError> {
        for r in &self.ranks {
            r.alloc.mirror().check_invariants()?;
            // The device lanes must equal the mirror (a counted read-back: tests only).
            r.alloc.debug_check_device()?;
            r.tree.check_invariants()?;
            let in_tree = r.tree.device_pages();
            let used: u32 = r.alloc.mirror().lane_used_counts().iter().sum();
            let reserved = if self.config.fault == Some(Fault::LaneExhaustion) {
                self.layout.lane_capacity(Rank(0)) / 2
            } else {
                0
            };
            if in_tree as u32 + reserved != used {
                return Err(ClusterError::Alloc(AllocError::Invariant {
                    what: format!(
                        "{}: {used} pages allocated but the tree holds {in_tree} (+{reserved} reserved)",
                        r.tree.rank()
                    ),
                }));
            }
            let leaked = |what: String| ClusterError::Alloc(AllocError::Invariant { what });
            for id in r.tree.node_ids() {
                let n = r.tree.node(id)?;
                if let Some(&p) = n
                    .device()
                    .and_then(|d| d.iter().find(|&&p| !r.alloc.mirror().is_allocated(p)))
                {
                    return Err(leaked(format!(
                        "{}: {id} holds {p}, which the allocator has free",
                        r.tree.rank()
                    )));
                }
                if let Some(h) = n
                    .host()
                    .and_then(|m| m.host_pages().iter().find(|&&h| !r.host.is_allocated(h)))
                {
                    return Err(leaked(format!(
                        "{}: {id} holds host page {}, which the host pool has free",
                        r.tree.rank(),
                        h.0
                    )));
                }
            }
            let host_used = r.host.capacity() - r.host.free_count();
            let host_in_tree: usize = r
                .tree
                .node_ids()
                .iter()
                .filter_map(|&id| r.tree.node(id).ok()?.host().map(|m| m.host_pages().len()))
                .sum();
            if host_used as usize != host_in_tree {
                return Err(ClusterError::Alloc(AllocError::Invariant {
                    what: format!(
                        "{}: {host_used} host pages allocated but the tree references {host_in_tree}",
                        r.tree.rank()
                    ),
                }));
            }
        }
        Ok(())
    }

    /// Evicts device nodes in LRU order on every rank alike until at least `pages` device
    /// pages were released or nothing unlocked is left (write-back backs them up first), so
    /// tests and tools can apply memory pressure between requests. Returns the node count.
    /// On error every rank's state is restored.
    pub fn evict_device_lru(&mut self, pages: usize) -> Result<usize, ClusterError> {
        let snapshot = self.snapshot();
        let result = self.evict(Eviction::Lru(pages), &mut RequestStats::default());
        if result.is_err() {
            self.restore(snapshot)?;
        }
        result
    }

    /// Locks the device-resident prefix of `tokens` on every rank, as a request still
    /// decoding from it would, so eviction cannot take it. Returns what was pinned (possibly
    /// nothing); pair it with [`Cluster::unpin`].
    pub fn pin_prefix(&mut self, tokens: &[u32]) -> Result<Pinned, ClusterError> {
        let ps = self.layout.page_size() as usize;
        let key = &tokens[..tokens.len() / ps * ps];
        let mut matched = None;
        for r in &mut self.ranks {
            let m = r.tree.match_prefix(key)?;
            matched.get_or_insert(m);
        }
        let m = matched.ok_or_else(|| ClusterError::Config("a cluster has no rank".into()))?;
        self.lock(m.last_device_node)?;
        Ok(Pinned {
            cluster: self.id,
            node: m.last_device_node,
            tokens: m.device_pages.len() * ps,
        })
    }

    /// Releases a pin taken by [`Cluster::pin_prefix`] of this cluster. A refused pin (one
    /// of another cluster) changes nothing and comes back in the error, so it can still be
    /// given to the cluster that took it.
    pub fn unpin(&mut self, pinned: Pinned) -> Result<(), UnpinError> {
        if pinned.cluster != self.id {
            let source = ClusterError::Config(format!(
                "a pin of {} tokens taken by another cluster was given back to this one",
                pinned.tokens
            ));
            return Err(UnpinError {
                pinned,
                source: Box::new(source),
            });
        }
        self.unlock(pinned.node).map_err(|source| UnpinError {
            pinned,
            source: Box::new(source),
        })
    }

    /// When on, every request reads its dense materialised buffers back (after verifying
    /// them) so that [`Cluster::last_dense`] can feed a reference decode. Off by default: the
    /// read-back is a device→host synchronisation a serving path would not do.
    pub fn set_capture_dense(&mut self, on: bool) {
        self.capture_dense = on;
        if !on {
            self.last_dense.clear();
        }
    }

    /// Whether device and host pages are poisoned again when they are freed (evicted,
    /// dropped by a rollback, or released at the end of a request) and the dense buffers
    /// before every materialisation. On by default, and it should stay on wherever results are checked:
    /// the lane stacks are LIFO, so a node loaded back often gets its old pages, which still
    /// hold the right bytes, and a load that copied nothing would pass verification.
    ///
    /// Cost: a device fill (`cuMemsetD8Async` on a GPU, `memset` on the CPU) of the poison
    /// byte over every freed page (all layers and buffer kinds, on its owner rank) and over
    /// the dense buffers of every request: device-memory writes of about the bytes freed plus
    /// the bytes materialised, nothing over PCIe. Device fills are stream-ordered and neither
    /// read back nor synchronise, so the load path stays free of both. Freed host pages (host
    /// evictions, replaced copies) are poisoned by the CPU; on a GPU that waits for the
    /// stream, which the load path meets only when a write-back eviction there frees host
    /// copies.
    pub fn set_repoison(&mut self, on: bool) {
        self.repoison = on;
    }

    /// The last request's dense materialised buffers, one per buffer kind, each laid out
    /// `[layer][seq_page][page bytes]` (docs/KERNELS.md); empty unless capture is on.
    pub fn last_dense(&self) -> &[(BufferKind, Vec<u8>)] {
        &self.last_dense
    }

    /// Serves one prompt on every rank: match, load back, compute the rest, materialise and
    /// verify, insert, back up. On error every rank's state is restored to what it was, so a
    /// failed request leaves no trace but the error.
    pub fn serve(&mut self, tokens: &[u32]) -> Result<RequestStats, ClusterError> {
        let snapshot = self.snapshot();
        let mut armed = false;
        if self.launch_failure_at == Some(self.served) {
            if tokens.is_empty() {
                // An empty prompt launches nothing: fail the next request instead of leaving
                // the executor armed for whichever launch comes later.
                self.launch_failure_at = Some(self.served + 1);
            } else {
                self.exec.inject_launch_failure();
                armed = true;
            }
        }
        self.served += 1;
        let result = self.serve_inner(tokens);
        if armed {
            // A request that returned before its first launch (an error raised earlier) did
            // not consume the failure: disarm on every exit, before the rollback, so neither
            // the rollback nor a later request can meet it.
            self.exec.disarm_launch_failure();
        }
        if let Err(e) = &result {
            if let Err(rollback) = self.restore(snapshot) {
                tracing::error!(error = %e, %rollback, "rolling back a failed request failed");
                return Err(rollback);
            }
        }
        result
    }

    /// What the rollback of the last failed operation dropped (empty until one fails, and
    /// reset when the next operation starts).
    pub fn last_rollback(&self) -> RollbackDrops {
        self.last_rollback
    }

    fn snapshot(&mut self) -> Snapshot {
        self.freed = Freed::default();
        self.last_rollback = RollbackDrops::default();
        Snapshot(
            self.ranks
                .iter()
                .map(|r| (r.tree.clone(), r.alloc.mirror().clone(), r.host.clone()))
                .collect(),
        )
    }

    /// Puts every rank back to `snapshot`, except that nodes whose pages the failed
    /// operation had evicted stay evicted: those pages may have been handed out again and
    /// overwritten before the failure, so bringing the nodes back would serve foreign bytes.
    /// The device lanes are re-uploaded from the mirror.
    fn restore(&mut self, snapshot: Snapshot) -> Result<(), ClusterError> {
        let freed = std::mem::take(&mut self.freed);
        // Decide every rank's state on the host first, so a failure cannot leave the ranks
        // half restored.
        let host_nodes: BTreeSet<NodeId> = snapshot
            .0
            .iter()
            .flat_map(|(tree, _, _)| tree.nodes_holding_host(&freed.host(tree.rank())))
            .collect();
        let mut states = Vec::with_capacity(snapshot.0.len());
        let mut drops = RollbackDrops::default();
        for (mut tree, mut mirror, mut host) in snapshot.0 {
            let (pages, metas) = tree.drop_stale(&freed.device, &host_nodes)?;
            // Every rank drops the same nodes; count them once.
            drops = RollbackDrops {
                device_pages: pages.len() as u64,
                host_copies: metas.len() as u64,
            };
            mirror.free(&pages)?;
            for m in &metas {
                host.free(m.host_pages())?;
            }
            states.push((tree, mirror, host));
        }
        // Pages the failed operation allocated (or the rollback drops) become free: they may
        // hold bytes it wrote.
        let mut released: BTreeSet<PageId> = self
            .ranks
            .iter()
            .zip(&states)
            .flat_map(|(r, (_, mirror, _))| {
                (1..self.layout.pages())
                    .map(PageId)
                    .filter(|&p| r.alloc.mirror().is_allocated(p) && !mirror.is_allocated(p))
            })
            .collect();
        // So do the pages it evicted: free before and after, but an eviction that failed
        // part-way had not poisoned them yet, and a load-back into one must not pass on stale
        // bytes.
        released.extend(
            freed
                .device
                .iter()
                .copied()
                .filter(|&p| states.iter().all(|(_, mirror, _)| !mirror.is_allocated(p))),
        );
        // Every rank gets its state even if one allocator fails to take its lanes back (it
        // then refuses work until the next rollback): an early return here would leave the
        // later ranks in the failed operation's state, and the replicas apart for good.
        // Host pages the failed operation allocated (a backup it wrote) become free too.
        let released_host: Vec<(Rank, Vec<HostPage>)> = self
            .ranks
            .iter()
            .zip(&states)
            .map(|(r, (_, _, host))| {
                let pages = (0..r.host.capacity())
                    .map(HostPage)
                    .filter(|&p| r.host.is_allocated(p) && !host.is_allocated(p))
                    .collect();
                (r.tree.rank(), pages)
            })
            .collect();
        let mut failed = None;
        for (r, (tree, mirror, host)) in self.ranks.iter_mut().zip(states) {
            r.tree = tree;
            r.host = host;
            if let Err(e) = r.alloc.restore(mirror) {
                failed.get_or_insert(e);
            }
        }
        self.last_rollback = drops;
        let poisoned = self
            .poison_freed(released)
            .and_then(|()| self.poison_freed_host(released_host));
        match failed {
            Some(e) => Err(e.into()),
            None => poisoned,
        }
    }

    fn serve_inner(&mut self, tokens: &[u32]) -> Result<RequestStats, ClusterError> {
        let ps = self.layout.page_size() as usize;
        let n_tokens = tokens.len();
        let mut stats = RequestStats {
            prompt_tokens: n_tokens as u64,
            ..RequestStats::default()
        };
        if n_tokens == 0 {
            return Ok(stats);
        }
        let n_pages = n_tokens.div_ceil(ps);
        let full = n_tokens / ps;
        let key = &tokens[..full * ps];

        // 1. Match on every rank (identical trees give identical results).
        let mut matched = None;
        for r in &mut self.ranks {
            let m = r.tree.match_prefix(key)?;
            matched.get_or_insert(m);
        }
        let m = matched.expect("cp >= 1");
        let mut pages = m.device_pages.clone();
        stats.device_hit_tokens = (pages.len() * ps) as u64;
        let mut locked = m.last_device_node;
        self.lock(locked)?;

        // 2. Load back host-only nodes, owners preserved.
        if let Some(&last) = m.host_nodes.last() {
            // Lock the host-only nodes too: evictions on the load path (and write-back
            // backups, which may evict host LRU) must not remove the nodes being loaded.
            self.lock(last)?;
            let before = self.exec.counters();
            let loaded = self.load_cp(&m.host_nodes, &mut stats)?;
            let c = self.exec.counters().since(&before);
            // Allocations and frees synchronise on CUDA (cuMemAlloc, cuMemFree), so they
            // count too.
            stats.load_path_syncs += c.stalls();
            match loaded {
                Some(run) => {
                    stats.host_hit_tokens = (run.len() * ps) as u64;
                    stats.pages_loaded += run.len() as u64;
                    pages.extend(run);
                    self.unlock(locked)?;
                    locked = last;
                }
                None => {
                    self.unlock(last)?;
                    stats.load_degraded_to_miss += 1;
                }
            }
        }
        let cached = pages.len();

        // 3. Allocate the pages to compute, zigzag over the owners.
        let owners = zigzag_owners(self.layout.cp(), n_pages - cached);
        let run = self.alloc_with_eviction(&owners, &pages, &mut stats)?;
        pages.extend(run);
        stats.computed_tokens = (n_tokens - cached * ps) as u64;

        // 4-5. Synthesise the computed pages on their owners, materialise everything from the
        // owners, verify against the synthesised KV.
        let bad = self.compute_and_verify(tokens, &pages, cached)?;
        stats.mismatched_tokens = bad.count;
        stats.first_mismatched_token = bad.first;

        // 6. Insert the whole pages; free what the tree already had and the partial page.
        let mut dups = Vec::new();
        let mut inserted = None;
        let mut released_host = Vec::new();
        for r in &mut self.ranks {
            let ins = r.tree.insert(key, &pages[..full])?;
            dups = ins.duplicate_pages;
            inserted = Some(ins.node);
            // Every rank drops the same copies (owners are replicated); count them once.
            stats.host_copies_replaced = ins.dropped_host_copies.len() as u64;
            for meta in ins.dropped_host_copies {
                r.host.free(meta.host_pages())?;
                self.freed
                    .host_mut(r.tree.rank())
                    .extend(meta.host_pages().iter().copied());
                released_host.push((r.tree.rank(), meta.host_pages().to_vec()));
            }
        }
        self.poison_freed_host(released_host)?;
        let ours: std::collections::HashSet<PageId> = pages[..cached].iter().copied().collect();
        let mut to_free: Vec<PageId> = dups.into_iter().filter(|p| !ours.contains(p)).collect();
        to_free.extend_from_slice(&pages[full..]);
        for r in &mut self.ranks {
            r.alloc.free(&to_free)?;
        }
        self.poison_freed(to_free)?;
        let node = inserted.expect("cp >= 1");
        self.lock(node)?;
        self.unlock(locked)?;
        if self.config.policy == WritePolicy::WriteThrough && node != NodeId::ROOT {
            for id in self.ranks[0].tree.path(node)? {
                let n = self.ranks[0].tree.node(id)?;
                if n.host().is_none() && n.device().is_some() {
                    self.write_cp(id, &mut stats)?;
                }
            }
        }
        // 7. Release.
        self.unlock(node)?;
        Ok(stats)
    }

    fn lock(&mut self, node: NodeId) -> Result<(), ClusterError> {
        if node != NodeId::ROOT {
            for r in &mut self.ranks {
                r.tree.lock(node)?;
            }
        }
        Ok(())
    }

    fn unlock(&mut self, node: NodeId) -> Result<(), ClusterError> {
        if node != NodeId::ROOT {
            for r in &mut self.ranks {
                r.tree.unlock(node)?;
            }
        }
        Ok(())
    }

    /// Loads host-only nodes back: one allocation with the concatenated `page_owners`,
    /// evicting as the compute path does on a shortage (lane-targeted, then LRU), then a
    /// miss. Reads nothing back from the device. Returns the new pages, or `None` when the load degraded to a miss.
    fn load_cp(
        &mut self,
        nodes: &[NodeId],
        stats: &mut RequestStats,
    ) -> Result<Option<Vec<PageId>>, ClusterError> {
        let metas: Vec<&NodeMetadata> = nodes
            .iter()
            .map(|&id| {
                self.ranks[0]
                    .tree
                    .node(id)?
                    .host()
                    .ok_or(TreeError::NotBackedUp { node: id })
            })
            .collect::<Result<_, TreeError>>()?;
        let owners = NodeMetadata::concat(metas)?.page_owners().to_vec();
        let plain = self.config.fault == Some(Fault::PlainAllocOnLoad);
        // The same evictions as for computed pages, in the same order: a miss here would
        // only make the compute path evict the same nodes to recompute these pages.
        let Some(run) = self.alloc_evicting(&owners, plain, stats)? else {
            return Ok(None);
        };
        stats.pages_loaded_misowned += owners
            .iter()
            .zip(&run)
            .filter(|&(&o, &p)| self.layout.owner(p).0 != o)
            .count() as u64;

        // Each rank moves the pages it owns: host page -> local page of the new owner page.
        let geometry = self.pools.geometry();
        let mut at = 0usize;
        let mut per_rank: Vec<(Vec<u32>, Vec<u32>)> = vec![(vec![], vec![]); self.ranks.len()];
        for &id in nodes {
            for (r, rank) in self.ranks.iter().enumerate() {
                let meta = rank
                    .tree
                    .node(id)?
                    .host()
                    .ok_or(TreeError::NotBackedUp { node: id })?;
                for (i, host_page) in meta.owned_pages() {
                    let page = run[at + i];
                    let slot = self.layout.local(page).0;
                    // Under the injected fault the owner may be another rank: the bytes land
                    // in a slot nobody reads, which is exactly the seed's bug. Two such pages
                    // can share this rank's slot; only the first writes it, since a transfer
                    // takes each destination page once (on a GPU two would mix their bytes).
                    if plain && per_rank[r].1.contains(&slot) {
                        continue;
                    }
                    per_rank[r].0.push(host_page.0);
                    per_rank[r].1.push(slot);
                }
            }
            let n = self.ranks[0]
                .tree
                .node(id)?
                .num_pages(self.layout.page_size());
            for rank in &mut self.ranks {
                let slice = run[at..at + n].to_vec();
                if plain {
                    rank.tree.set_device_ignoring_owners(id, slice)?;
                } else {
                    rank.tree.set_device(id, slice)?;
                }
            }
            at += n;
        }
        for (r, (src, dst)) in per_rank.iter().enumerate() {
            stats.bytes_h2d += self.transfer(Direction::HostToDevice, r, src, dst)?;
        }
        debug_assert_eq!(geometry.layers, self.config.layers);
        Ok(Some(run))
    }

    /// Backs a device node up on every rank, or on none: host pages for each rank's owned
    /// pages, the device→host transfer, and the validated metadata. When some rank is short
    /// of host pages, host copies are evicted in LRU order, but only ones that free pages on
    /// a short rank, and only when that makes the backup fit; otherwise the backup is
    /// skipped (and counted) and no host copy is thrown away.
    fn write_cp(&mut self, node: NodeId, stats: &mut RequestStats) -> Result<(), ClusterError> {
        let pages = self.ranks[0]
            .tree
            .node(node)?
            .device()
            .ok_or(TreeError::NotOnDevice { node })?
            .to_vec();
        let owners: Vec<u8> = pages.iter().map(|&p| self.layout.owner(p).0).collect();
        let need = |r: usize| owners.iter().filter(|&&o| usize::from(o) == r).count() as u32;
        let short: Vec<u32> = self
            .ranks
            .iter()
            .enumerate()
            .map(|(r, s)| need(r).saturating_sub(s.host.free_count()))
            .collect();
        if short.iter().any(|&d| d > 0) {
            // Evict host copies only if that makes the backup fit, and only those that free
            // host pages on the short ranks: decide on the plan first (every rank evicts the
            // same nodes, so one replica's plan tells what each rank would get back).
            let tree = &self.ranks[0].tree;
            let mut gained = vec![0u32; self.ranks.len()];
            for id in tree.host_eviction_plan_for_ranks(&short)? {
                let owners = tree.node(id)?.host().map(NodeMetadata::page_owners);
                for o in owners.unwrap_or_default() {
                    if let Some(g) = gained.get_mut(usize::from(*o)) {
                        *g += 1;
                    }
                }
            }
            if short.iter().zip(&gained).any(|(s, g)| g < s) {
                stats.backups_skipped += 1;
                return Ok(());
            }
            let mut evicted = 0;
            let mut released_host = Vec::new();
            for r in &mut self.ranks {
                let gone = r.tree.evict_host_for_ranks(&short)?;
                evicted = gone.len();
                for meta in gone {
                    r.host.free(meta.host_pages())?;
                    self.freed
                        .host_mut(r.tree.rank())
                        .extend(meta.host_pages().iter().copied());
                    released_host.push((r.tree.rank(), meta.host_pages().to_vec()));
                }
            }
            self.poison_freed_host(released_host)?;
            stats.evictions_lru += evicted as u64;
            stats.host_evictions_for_backup += evicted as u64;
        }
        for r in 0..self.ranks.len() {
            let host_pages = self.ranks[r].host.alloc(need(r) as usize)?;
            let (src, dst): (Vec<u32>, Vec<u32>) = owners
                .iter()
                .zip(&pages)
                .filter(|(&o, _)| usize::from(o) == r)
                .zip(&host_pages)
                .map(|((_, &p), h)| (self.layout.local(p).0, h.0))
                .unzip();
            stats.bytes_d2h += self.transfer(Direction::DeviceToHost, r, &src, &dst)?;
            let meta = NodeMetadata::new(&self.layout, Rank(r as u8), owners.clone(), host_pages)?;
            self.ranks[r].tree.set_host(node, meta)?;
        }
        stats.pages_written += pages.len() as u64;
        Ok(())
    }

    /// Allocates `owners` on every replica, or returns `None` on a shortage (nothing changed).
    /// Replicas that saw the same calls decide alike, so a rank that is short, or that gets
    /// other pages, after an earlier rank allocated means they diverged: the earlier ranks'
    /// allocations are undone and it is [`ClusterError::ReplicasDiverged`]. On any other
    /// error the earlier ranks' allocations are undone as well.
    fn try_alloc(
        &mut self,
        owners: &[u8],
        plain: bool,
    ) -> Result<Option<Vec<PageId>>, ClusterError> {
        let mut out: Option<Vec<PageId>> = None;
        let mut undo_failed = None;
        for r in 0..self.ranks.len() {
            let alloc = &mut self.ranks[r].alloc;
            let res = if plain {
                alloc.alloc_pages(owners.len())
            } else {
                alloc.alloc_pages_with_owners(owners)
            };
            let err = match res {
                Ok(k) => {
                    let pages = k.run.into_pages();
                    match &out {
                        None => {
                            out = Some(pages);
                            continue;
                        }
                        Some(first) if *first == pages => continue,
                        Some(first) => {
                            let what =
                                format!("rank {r} allocated {pages:?} where rank 0 got {first:?}");
                            // This rank's allocation is undone with the earlier ones; a
                            // failure to is reported after they are.
                            let mine: Vec<PageId> = pages.into_iter().rev().collect();
                            undo_failed = self.ranks[r].alloc.free(&mine).err();
                            ClusterError::ReplicasDiverged { what }
                        }
                    }
                }
                Err(e) if e.is_shortage() && r == 0 => return Ok(None),
                Err(e) if e.is_shortage() => ClusterError::ReplicasDiverged {
                    what: format!("rank {r} is short of pages rank 0 could allocate: {e}"),
                },
                Err(e) => e.into(),
            };
            // Undo the earlier ranks' allocations (in reverse, so the LIFO lanes come back
            // exactly as they were), every one of them even when one fails: stopping there
            // would leave the later ranks holding pages nobody frees. The first failure of
            // the undo is returned after the loop, since the ranks may then disagree.
            if let Some(first) = &out {
                let back: Vec<PageId> = first.iter().rev().copied().collect();
                if let Err(e) = free_on_every_rank(&mut self.ranks[..r], &back) {
                    undo_failed.get_or_insert(e);
                }
            }
            return Err(undo_failed.map_or(err, ClusterError::from));
        }
        Ok(out)
    }

    /// Allocates the pages to compute, evicting as needed (see [`Self::alloc_evicting`]).
    /// `held` are the device pages the request already holds (its cached prefix, locked;
    /// for the error).
    fn alloc_with_eviction(
        &mut self,
        owners: &[u8],
        held: &[PageId],
        stats: &mut RequestStats,
    ) -> Result<Vec<PageId>, ClusterError> {
        match self.alloc_evicting(owners, false, stats)? {
            Some(run) => Ok(run),
            None => {
                let deficit = self.ranks[0].alloc.deficit(owners)?;
                Err(self.pool_too_small(owners, held, &deficit))
            }
        }
    }

    /// Allocates `owners` (any lanes when `plain`), evicting unlocked device nodes until it
    /// fits: device LRU while the pool as a whole is short, owner-lane targeted eviction
    /// when only some lanes are, and LRU again when no leaf frees a short lane. `None` once
    /// nothing more can be evicted. The load path and the compute path both allocate
    /// through here, so a load-back degrades to a miss only when computing would not fit
    /// either.
    fn alloc_evicting(
        &mut self,
        owners: &[u8],
        plain: bool,
        stats: &mut RequestStats,
    ) -> Result<Option<Vec<PageId>>, ClusterError> {
        loop {
            if let Some(run) = self.try_alloc(owners, plain)? {
                return Ok(Some(run));
            }
            let free = self.ranks[0].alloc.mirror().free_pages();
            let evicted = if owners.len() > free {
                let n = self.evict(Eviction::Lru(owners.len() - free), stats)?;
                stats.evictions_lru += n as u64;
                n
            } else {
                let deficit = self.ranks[0].alloc.deficit(owners)?;
                let n = self.evict(Eviction::Lanes(deficit), stats)?;
                stats.evictions_lane += n as u64;
                if n > 0 {
                    n
                } else {
                    // The short lanes' pages can sit in nodes that are not leaves yet, under
                    // leaves holding only other lanes' pages, which lane-targeted eviction
                    // skips. Evict LRU to uncover them.
                    let n = self.evict(Eviction::Lru(1), stats)?;
                    stats.evictions_lru += n as u64;
                    n
                }
            };
            if evicted == 0 {
                return Ok(None);
            }
        }
    }

    /// Why `owners` cannot be allocated next to `held` once nothing more can be evicted:
    /// the whole pool, or (the usual case) the owner lanes in `deficit`, each with what it
    /// needs, what the request's cached prefix holds in it and what it holds in all. A
    /// total count alone would read as a contradiction when the pool has room overall.
    fn pool_too_small(&self, owners: &[u8], held: &[PageId], deficit: &[u32]) -> ClusterError {
        let cp = usize::from(self.layout.cp());
        let free = self.ranks[0].alloc.lane_free_counts();
        let count = |owners: &mut dyn Iterator<Item = u8>| {
            let mut n = vec![0u32; cp];
            for o in owners {
                n[usize::from(o)] += 1;
            }
            n
        };
        let computed = count(&mut owners.iter().copied());
        let cached = count(&mut held.iter().map(|&p| self.layout.owner(p).0));
        let needed = (held.len() + owners.len()) as u64;
        let available = (held.len() + free.iter().sum::<u32>() as usize) as u64;
        let mut lanes = Vec::new();
        for (l, &d) in deficit.iter().enumerate().filter(|(_, &d)| d > 0) {
            let need = cached[l] + computed[l];
            let capacity = self.layout.lane_capacity(Rank(l as u8));
            let usable = free[l] + cached[l];
            let what = if need > capacity {
                format!("holds only {capacity} pages")
            } else {
                format!(
                    "only {usable} of its {capacity} pages are free or the request's own \
                     (the others are locked or reserved)"
                )
            };
            lanes.push(format!(
                "lane {l} needs {need} ({} of the cached prefix + {} to compute) but {what}, \
                 {d} short",
                cached[l], computed[l]
            ));
        }
        let mut what = if needed > available {
            format!(
                "the request needs {needed} device pages at once but only {available} are free \
                 or its own once everything unlocked is evicted"
            )
        } else {
            format!(
                "the request's {needed} device pages fit the pool ({available} free or its own \
                 once everything unlocked is evicted) but not its owner lanes"
            )
        };
        if !lanes.is_empty() {
            what += &format!(": {}", lanes.join("; "));
        }
        // The cached prefix stays locked while the request is served; say when computing
        // the whole prompt afresh (one zigzag pattern) would have fitted.
        let fresh =
            count(&mut zigzag_owners(self.layout.cp(), held.len() + owners.len()).into_iter());
        if !held.is_empty() && (0..cp).all(|l| fresh[l] <= free[l] + cached[l]) {
            what += " (computing the whole prompt afresh, without its cached prefix, would fit)";
        }
        ClusterError::PoolTooSmall {
            what,
            flag: "--device-pages",
            needed,
            available,
        }
    }

    /// Evicts device nodes on every rank alike and frees what they held. Under write-back,
    /// every node the eviction would drop from the tree is backed up first (its backups are
    /// counted in `stats`), so only nodes whose backup did not fit lose their KV. Returns the
    /// node count.
    fn evict(&mut self, how: Eviction, stats: &mut RequestStats) -> Result<usize, ClusterError> {
        if self.config.policy == WritePolicy::WriteBack {
            // The plan names every node the eviction takes: not only the LRU leaves of now,
            // but also parents that become leaves on the way. Backing up changes no device
            // state and no stamp, so the real eviction below takes the same nodes, now backed
            // up, and keeps them (and their host-only descendants) in the tree.
            let tree = &self.ranks[0].tree;
            let plan = match &how {
                Eviction::Lru(n) => tree.device_eviction_plan_lru(*n)?,
                Eviction::Lanes(d) => tree.device_eviction_plan_for_lanes(d)?,
            };
            for node in plan {
                if self.ranks[0].tree.node(node)?.host().is_none() {
                    self.write_cp(node, stats)?;
                }
            }
        }
        let mut count = 0;
        let mut released = BTreeSet::new();
        let mut released_host = Vec::new();
        let freed = &mut self.freed;
        for r in &mut self.ranks {
            let evicted: Vec<Evicted> = match &how {
                Eviction::Lru(n) => r.tree.evict_device_lru(*n)?,
                Eviction::Lanes(d) => r.tree.evict_device_for_lanes(d)?,
            };
            count = evicted.len();
            for e in evicted {
                r.alloc.free(&e.device_pages)?;
                freed.device.extend(e.device_pages.iter().copied());
                released.extend(e.device_pages.iter().copied());
                for meta in &e.host_released {
                    r.host.free(meta.host_pages())?;
                    freed
                        .host_mut(r.tree.rank())
                        .extend(meta.host_pages().iter().copied());
                    released_host.push((r.tree.rank(), meta.host_pages().to_vec()));
                }
            }
        }
        self.poison_freed(released)?;
        self.poison_freed_host(released_host)?;
        Ok(count)
    }

    /// Copies rank `r`'s page pairs for every buffer kind, with the transfer kernel or by DMA
    /// as the deployment says; returns bytes moved.
    fn transfer(
        &mut self,
        dir: Direction,
        r: usize,
        src: &[u32],
        dst: &[u32],
    ) -> Result<u64, ClusterError> {
        if src.is_empty() {
            return Ok(0);
        }
        let g = self.pools.geometry();
        let pools = PoolShape {
            layers: g.layers,
            device_pages: g.local_pages,
            host_pages: g.host_pages,
        };
        check_transfer_pages(dir, r, src, dst, &pools)?;
        let dma = self.config.deployment.transfer_path == TransferPath::Dma;
        let pairs = if dma {
            None
        } else {
            Some(self.pools.upload_pairs(src, dst)?)
        };
        let mut bytes = 0;
        for &b in self.config.deployment.model.buffers() {
            let (from, to) = match dir {
                Direction::HostToDevice => (self.pools.host(b, r), self.pools.device(b, r)),
                Direction::DeviceToHost => (self.pools.device(b, r), self.pools.host(b, r)),
            };
            match pairs {
                None => {
                    let spec = self.config.deployment.transfer(b, dir);
                    let regions = transfer_regions(&spec, src, dst, pools);
                    self.exec.copy_regions(from, to, &regions)?;
                }
                Some((sb, db)) => {
                    let k = self.kernels.transfer(b, dir);
                    self.exec.launch(
                        k.id,
                        &k.launch(src.len() as u32, g.layers),
                        &[
                            KernelArg::Ptr(from, 0),
                            KernelArg::Ptr(to, 0),
                            KernelArg::Ptr(sb, 0),
                            KernelArg::Ptr(db, 0),
                            KernelArg::U32(src.len() as u32),
                            KernelArg::U32(g.layers),
                            KernelArg::U32(g.local_pages),
                            KernelArg::U32(g.host_pages),
                        ],
                    )?;
                }
            }
            bytes += src.len() as u64 * u64::from(g.layers) * b.page_bytes(self.layout.page_size());
        }
        Ok(bytes)
    }

    /// Poisons freed host pages, each on its rank's host pools, every buffer kind (when
    /// [`Cluster::set_repoison`] is on): a backup that reuses one and whose device→host copy
    /// does nothing must leave poison there, not the bytes of an earlier backup of the same
    /// prefix, which would load back and verify clean.
    fn poison_freed_host(
        &mut self,
        pages: impl IntoIterator<Item = (Rank, Vec<HostPage>)>,
    ) -> Result<(), ClusterError> {
        if !self.repoison {
            return Ok(());
        }
        let layout = self.config.deployment.host_layout;
        for (rank, pages) in pages {
            if pages.is_empty() {
                continue;
            }
            let pages: Vec<u32> = pages.iter().map(|p| p.0).collect();
            for &b in self.config.deployment.model.buffers() {
                self.pools
                    .poison_host_pages(b, usize::from(rank.0), layout, &pages)?;
            }
        }
        Ok(())
    }

    /// Poisons freed device pages on their owners' pools, every buffer kind (when
    /// [`Cluster::set_repoison`] is on).
    fn poison_freed(
        &mut self,
        pages: impl IntoIterator<Item = PageId>,
    ) -> Result<(), ClusterError> {
        if !self.repoison {
            return Ok(());
        }
        let mut locals = vec![BTreeSet::new(); self.ranks.len()];
        for p in pages {
            let owner = usize::from(self.layout.owner(p).0);
            locals[owner].insert(self.layout.local(p).0);
        }
        for &b in self.config.deployment.model.buffers() {
            for (r, l) in locals.iter().enumerate() {
                if !l.is_empty() {
                    let l: Vec<u32> = l.iter().copied().collect();
                    self.pools.poison_device_pages(b, r, &l)?;
                }
            }
        }
        Ok(())
    }

    /// Synthesises pages `[start, ..)` on their owners, materialises the whole sequence from
    /// the owners' pools and finds the mismatched tokens: the verify kernels of every buffer
    /// kind set bits in one token bitmap, so a token wrong in several counts once.
    fn compute_and_verify(
        &mut self,
        tokens: &[u32],
        pages: &[PageId],
        start: usize,
    ) -> Result<Mismatches, ClusterError> {
        let g = self.pools.geometry();
        let hashes = reference::prefix_hashes(tokens);
        let page_ids: Vec<u32> = pages.iter().map(|p| p.0).collect();
        let (hash_buf, page_buf) = self.pools.upload_sequence(&hashes, &page_ids)?;
        let n_tokens = tokens.len() as u32;
        let n_pages = pages.len() as u32;
        let buffers = self.config.deployment.model.buffers();
        let words = tokens.len().div_ceil(32);
        let bad_tokens = self.pools.zeroed_words(words)?;
        let mut captured = Vec::new();
        for &b in buffers {
            let synth = self.kernels.synthesise(b);
            if (start as u32) < n_pages {
                for r in 0..self.ranks.len() {
                    self.exec.launch(
                        synth.id,
                        &synth.launch(n_pages - start as u32, g.layers),
                        &[
                            KernelArg::Ptr(self.pools.device(b, r), 0),
                            KernelArg::Ptr(hash_buf, 0),
                            KernelArg::Ptr(page_buf, 0),
                            KernelArg::U32(n_tokens),
                            KernelArg::U32(start as u32),
                            KernelArg::U32(r as u32),
                            KernelArg::U32(g.layers),
                            KernelArg::U32(g.local_pages),
                        ],
                    )?;
                }
            }
            let dense = self.pools.dense(b, n_pages, self.repoison)?;
            let pool_ptrs: Vec<_> = (0..self.ranks.len())
                .map(|r| (self.pools.device(b, r), 0u64))
                .collect();
            let mat = self.kernels.materialise(b);
            self.exec.launch(
                mat.id,
                &mat.launch(n_pages, g.layers),
                &[
                    KernelArg::PtrStruct(&pool_ptrs),
                    KernelArg::Ptr(page_buf, 0),
                    KernelArg::U32(n_pages),
                    KernelArg::U32(g.layers),
                    KernelArg::U32(g.local_pages),
                    KernelArg::Ptr(dense, 0),
                ],
            )?;
            let ver = self.kernels.verify(b);
            self.exec.launch(
                ver.id,
                &ver.launch(n_tokens, g.layers),
                &[
                    KernelArg::Ptr(dense, 0),
                    KernelArg::Ptr(hash_buf, 0),
                    KernelArg::U32(n_tokens),
                    KernelArg::U32(0),
                    KernelArg::U32(g.layers),
                    KernelArg::Ptr(bad_tokens, 0),
                ],
            )?;
            if self.capture_dense {
                let bytes = b.page_bytes(self.layout.page_size()) as usize
                    * n_pages as usize
                    * g.layers as usize;
                let mut out = vec![0u8; bytes];
                self.exec.read(dense, 0, &mut out)?;
                captured.push((b, out));
            }
        }
        if self.capture_dense {
            self.last_dense = captured;
        }
        let mut out = vec![0u8; 4 * words];
        self.exec.read(bad_tokens, 0, &mut out)?;
        Ok(Mismatches::from_bitmap(&out))
    }
}

/// The mismatched tokens of one request, from the verify kernels' bitmap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mismatches {
    count: u64,
    first: Option<u64>,
}

impl Mismatches {
    /// Counts the set bits of a little-endian `u32` bitmap (bit `t % 32` of word `t / 32`).
    fn from_bitmap(bytes: &[u8]) -> Mismatches {
        let mut m = Mismatches {
            count: 0,
            first: None,
        };
        for (i, c) in bytes.chunks_exact(4).enumerate() {
            let w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            if w != 0 && m.first.is_none() {
                m.first = Some(32 * i as u64 + u64::from(w.trailing_zeros()));
            }
            m.count += u64::from(w.count_ones());
        }
        m
    }
}

enum Eviction {
    Lru(usize),
    Lanes(Vec<u32>),
}

/// Refuses a transfer whose page lists differ in length, name a page outside its pool
/// (`pools`' device pages per rank, host pages), or name one destination page twice (on a GPU
/// the two copies would interleave: `kernels::check_distinct_destinations`).
fn check_transfer_pages(
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
    use crate::exec::{HostExecutor, HostOptions};

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
    use crate::jit::JitConfig;
    use crate::kernels::ModelShape;

    fn cluster() -> Cluster {
        // The integration tests' JIT cache (CARGO_TARGET_TMPDIR is target/tmp), so the
        // kernels are usually compiled already.
        let jit = Jit::new(JitConfig::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/target/tmp/jit-cache"
        )));
        let config = ClusterConfig {
            deployment: Deployment::new(ModelShape::MlaBf16, 16, 2).unwrap(),
            layers: 1,
            device_pages: 9,
            host_pages: 4,
            policy: WritePolicy::WriteThrough,
            fault: None,
            sanitize: Sanitize::None,
        };
        let exec = Arc::new(HostExecutor::new(HostOptions::default()));
        Cluster::new(config, exec, &jit).unwrap()
    }

    #[test]
    fn a_replica_short_after_rank_0_allocated_is_divergence_and_undone() {
        let mut c = cluster();
        // Diverge on purpose: rank 1 alone loses two pages of lane 0.
        c.ranks[1].alloc.alloc_pages_with_owners(&[0, 0]).unwrap();
        let rank0 = c.ranks[0].alloc.mirror().clone();
        let err = c.try_alloc(&[0, 0, 0, 1], false).unwrap_err();
        assert!(
            matches!(err, ClusterError::ReplicasDiverged { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("rank 1 is short"), "{err}");
        // Rank 0's allocation was undone exactly (LIFO lanes included).
        assert_eq!(c.ranks[0].alloc.mirror().digest(), rank0.digest());
        c.ranks[0].alloc.debug_check_device().unwrap();
        // A shortage on every rank alike is still a plain `None`.
        c.ranks[0].alloc.alloc_pages_with_owners(&[0, 0]).unwrap();
        assert_eq!(c.try_alloc(&[0, 0, 0], false).unwrap(), None);
    }

    /// The undo frees on every rank even when an earlier one refuses, and reports that
    /// refusal afterwards. See: issue 20.
    #[test]
    fn r20_an_undo_frees_on_every_rank_after_a_refusal() {
        let mut c = cluster();
        let before = c.ranks[0].alloc.digest();
        // Rank 1 alone holds the pages: rank 0 refuses to free what it never allocated.
        let run = c.ranks[1]
            .alloc
            .alloc_pages_with_owners(&[0, 1])
            .unwrap()
            .run;
        let back: Vec<PageId> = run.pages().iter().rev().copied().collect();
        let err = free_on_every_rank(&mut c.ranks, &back).unwrap_err();
        assert!(err.to_string().contains("double free"), "{err}");
        assert_eq!(c.ranks[1].alloc.digest(), before, "rank 1 was undone");
        c.ranks[1].alloc.debug_check_device().unwrap();
    }

    #[test]
    fn replicas_handing_out_different_pages_is_divergence_and_undone() {
        let mut c = cluster();
        // Rank 1's lane 0 pops in another order than rank 0's.
        let p = c.ranks[1].alloc.alloc_pages_with_owners(&[0]).unwrap().run;
        let q = c.ranks[1].alloc.alloc_pages_with_owners(&[0]).unwrap().run;
        c.ranks[1].alloc.free(p.pages()).unwrap();
        c.ranks[1].alloc.free(q.pages()).unwrap();
        let before: Vec<_> = c.ranks.iter().map(|r| r.alloc.digest()).collect();
        let err = c.try_alloc(&[0, 1], false).unwrap_err();
        assert!(err.to_string().contains("rank 1 allocated"), "{err}");
        let after: Vec<_> = c.ranks.iter().map(|r| r.alloc.digest()).collect();
        assert_eq!(before, after);
        for r in &c.ranks {
            r.alloc.debug_check_device().unwrap();
        }
    }

    /// Two pairs with one destination page are refused before anything is uploaded,
    /// launched or copied, on the kernel path and on the DMA path.
    #[test]
    fn a_transfer_naming_one_destination_twice_moves_nothing() {
        let mut c = cluster();
        for path in [TransferPath::Kernel, TransferPath::Dma] {
            c.config.deployment.transfer_path = path;
            let before = c.exec.counters();
            let err = c
                .transfer(Direction::HostToDevice, 1, &[0, 1], &[2, 2])
                .unwrap_err();
            assert!(
                matches!(&err, ClusterError::BadTransfer { rank: 1, what }
                    if what.contains("pairs 0 and 1 both write destination page 2")),
                "{path}: {err}"
            );
            let d = c.exec.counters().since(&before);
            assert_eq!((d.uploads, d.launches, d.copies), (0, 0, 0), "{path}");
            // Distinct pages move.
            c.transfer(Direction::HostToDevice, 1, &[0, 1], &[2, 3])
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
        assert_eq!(
            Mismatches::from_bitmap(&[0; 8]),
            Mismatches {
                count: 0,
                first: None
            }
        );
    }
}
