//! The driver of C ranks in one process: [`Cluster`] runs one [`RankCache`] per CP rank, each
//! on its own OS thread, agreeing through a [`LocalGroup`], the way C engine processes agree
//! through theirs. `replay` and the tests drive exactly the code an engine hosts.
//!
//! Each rank has its own radix tree, allocator and host page pool, and (by default) its own
//! executor; its device pools are mapped by every peer (POSIX shared memory on the CPU), and
//! every rank materialises and verifies every request over its own view of all owners'
//! pools. After every request the ranks' digests must agree
//! ([`Cluster::replicas_agree`]).
//!
//! Driving it from Rust (the CPU emulation executor here; `jit::open_executor` picks a GPU
//! when there is one): a prompt is computed, evicted from the device to the host, and loaded
//! back with its owners on the next hit, every token verified on every rank.
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
//! let execs = (0..2)
//!     .map(|_| Arc::new(HostExecutor::new(HostOptions::default())) as _)
//!     .collect();
//! let mut cluster = Cluster::with_executors(config, execs, &jit)?; // one executor per rank
//! let prompt: Vec<u32> = (0..160).collect(); // 10 pages, zigzag owners 0,0,0,1,1,1,1,1,0,0
//! let cold = cluster.serve(&prompt)?;
//! assert_eq!(cold.computed_tokens, 160);
//! cluster.evict_device_lru(usize::MAX)?; // the device copy goes; the host backup stays
//! let warm = cluster.serve(&prompt)?;
//! assert_eq!(warm.host_hit_tokens, 160); // loaded back into pages with the same owners
//! assert_eq!(warm.mismatched_tokens, 0); // every token checked on every rank
//! assert_eq!(warm.load_path_syncs, 0); // the load path read nothing back from the device
//! assert!(cluster.replicas_agree());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod ranks;
pub mod stats;

pub use crate::rank::{
    ClusterConfig, ClusterError, DeploymentKernels, Fault, KernelLoadError, Loaded, PeerAccess,
    PoolGeometry, Pools, RequestStats, RollbackDrops, SourceHook, Verdict, WritePolicy,
};
pub use ranks::Ranks;
pub use stats::ReplayReport;

use crate::allocator::StateDigest;
use crate::exec::{Executor, RankView};
use crate::group::{LocalGroup, DEFAULT_TIMEOUT};
use crate::hicache::tree::NodeId;
use crate::jit::Jit;
use crate::kernels::BufferKind;
use crate::layout::CpLayout;
use crate::rank::{LiveShape, RankCache};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

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

/// A job for every rank's thread; its result comes back type-erased.
type Job = Box<dyn FnOnce(&mut RankCache) -> Box<dyn std::any::Any + Send> + Send>;

/// One rank's thread and its mailbox.
struct Worker {
    jobs: mpsc::Sender<(String, Job)>,
    results: mpsc::Receiver<Box<dyn std::any::Any + Send>>,
    thread: Option<JoinHandle<()>>,
}

/// How the ranks of a [`Cluster`] ran, for reports.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GroupInfo {
    /// The collective's transport (`"local"`: threads of one process).
    pub kind: &'static str,
    /// Ranks in the group.
    pub ranks: usize,
    /// How ranks reach their peers' pools (`"shared-memory"`, `"direct"`).
    pub peer_pools: &'static str,
    /// Whether each rank has an executor of its own.
    pub executor_per_rank: bool,
    /// Ranks that materialise and verify every request (all of them unless restricted).
    pub verifying_ranks: usize,
}

/// C ranks, one thread each, driven by one request stream. See the module documentation.
pub struct Cluster {
    /// Tells clusters apart, so a pin is only given back to the cluster that took it.
    id: u64,
    layout: CpLayout,
    config: ClusterConfig,
    exec: Arc<dyn Executor>,
    kernels: DeploymentKernels,
    /// The ranks' threads (behind a lock, so queries can take `&self`: one call at a time
    /// reaches the ranks).
    workers: std::sync::Mutex<Vec<Worker>>,
    info: GroupInfo,
    /// Set once a rank's thread is gone (the rank and what the cluster was doing): every
    /// later call fails with it.
    dead: std::sync::Mutex<Option<(usize, String)>>,
}

impl Cluster {
    /// C ranks sharing `exec` (one process, one device). Peers map each other's pools when
    /// the executor can (shared memory on the host, so the mapped path is what runs and is
    /// tested); otherwise (CUDA in one process) they reach them directly.
    pub fn new(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
    ) -> Result<Cluster, ClusterError> {
        let access = if exec.maps_in_process() {
            PeerAccess::Mapped
        } else {
            PeerAccess::Direct
        };
        Self::sharing(config, exec, access, jit)
    }

    /// C ranks sharing `exec` that never reach each other's pools
    /// ([`PeerAccess::Gathered`]): to verify, each rank's pages of a sequence go through the
    /// group, as ranks over an engine's own memory in separate processes verify.
    pub fn gathered(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        jit: &Jit,
    ) -> Result<Cluster, ClusterError> {
        Self::sharing(config, exec, PeerAccess::Gathered, jit)
    }

    /// C ranks sharing `exec`, reaching each other's pools by `access`.
    fn sharing(
        config: ClusterConfig,
        exec: Arc<dyn Executor>,
        access: PeerAccess,
        jit: &Jit,
    ) -> Result<Cluster, ClusterError> {
        let cp = usize::from(config.deployment.cp);
        // Each rank counts its own calls, so a rank's load path is not charged for its
        // peers' read-backs.
        let mut cluster = Self::start(
            config,
            RankView::split(exec.clone(), cp.max(1)),
            access,
            false,
            jit,
        )?;
        cluster.exec = exec;
        Ok(cluster)
    }

    /// C ranks, rank `r` on `execs[r]`, as C engine processes each hold their own executor;
    /// every executor must map peers' pools ([`Executor::peer_mapping`]). The ranks run as
    /// threads of this process, so their executors must also map in-process
    /// ([`Executor::maps_in_process`]); CUDA IPC does not, and such ranks fail to connect
    /// their pools with [`ExecError::IpcSameProcess`](crate::exec::ExecError::IpcSameProcess):
    /// CUDA ranks of one process share one executor ([`Cluster::new`]), and CUDA ranks with
    /// executors of their own are separate processes, each a [`RankCache`] over its own
    /// collective member.
    pub fn with_executors(
        config: ClusterConfig,
        execs: Vec<Arc<dyn Executor>>,
        jit: &Jit,
    ) -> Result<Cluster, ClusterError> {
        if execs.len() != usize::from(config.deployment.cp) {
            return Err(ClusterError::Config(format!(
                "a CP {} cluster needs {} executors, not {}",
                config.deployment.cp,
                config.deployment.cp,
                execs.len()
            )));
        }
        if let Some(e) = execs.iter().find(|e| e.peer_mapping().is_none()) {
            return Err(ClusterError::Config(format!(
                "the {} executor cannot map peers' pools: its ranks must share one executor",
                e.backend()
            )));
        }
        Self::start(config, execs, PeerAccess::Mapped, true, jit)
    }

    fn start(
        config: ClusterConfig,
        execs: Vec<Arc<dyn Executor>>,
        access: PeerAccess,
        executor_per_rank: bool,
        jit: &Jit,
    ) -> Result<Cluster, ClusterError> {
        let layout = config.layout()?;
        let members = LocalGroup::members(layout.cp(), group_timeout()?);
        // Every rank builds itself (kernels, pools, peer mappings) on a thread of its own:
        // mapping the peers' pools is a collective.
        let built: Vec<Result<RankCache, ClusterError>> = std::thread::scope(|s| {
            let handles: Vec<_> = members
                .into_iter()
                .zip(&execs)
                .map(|(m, exec)| {
                    let config = config.clone();
                    let exec = exec.clone();
                    s.spawn(move || RankCache::new(config, exec, jit, Box::new(m), access))
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(r, h)| {
                    h.join().unwrap_or_else(|_| {
                        Err(ClusterError::Config(format!(
                            "rank {r} panicked while starting"
                        )))
                    })
                })
                .collect()
        });
        // The error worth reporting is a rank's own, not its peers' "the group was aborted".
        let mut ranks = Vec::with_capacity(built.len());
        let mut first_err: Option<ClusterError> = None;
        for r in built {
            match r {
                Ok(rank) => ranks.push(rank),
                Err(e) => {
                    let replace = match &first_err {
                        None => true,
                        Some(prev) => prev.is_group_broken() && !e.is_group_broken(),
                    };
                    if replace {
                        first_err = Some(e);
                    }
                }
            }
        }
        if let Some(e) = first_err {
            return Err(e);
        }
        let kernels = ranks[0].kernels().clone();
        let info = GroupInfo {
            kind: ranks[0].group_kind(),
            ranks: ranks.len(),
            peer_pools: ranks[0].peer_pools(),
            executor_per_rank,
            verifying_ranks: ranks.len(),
        };
        let workers = ranks
            .into_iter()
            .map(|rank| {
                let (jobs, inbox) = mpsc::channel::<(String, Job)>();
                let (outbox, results) = mpsc::channel();
                let r = rank.rank().0;
                let thread = std::thread::Builder::new()
                    .name(format!("cp-rank-{r}"))
                    .spawn(move || {
                        let mut rank = rank;
                        while let Ok((_, job)) = inbox.recv() {
                            if outbox.send(job(&mut rank)).is_err() {
                                break;
                            }
                        }
                    })
                    .map_err(|e| ClusterError::Config(format!("cannot start rank {r}: {e}")))?;
                Ok(Worker {
                    jobs,
                    results,
                    thread: Some(thread),
                })
            })
            .collect::<Result<Vec<_>, ClusterError>>()?;
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        Ok(Cluster {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            layout,
            config,
            exec: execs[0].clone(),
            kernels,
            workers: std::sync::Mutex::new(workers),
            info,
            dead: std::sync::Mutex::new(None),
        })
    }

    /// Runs `f` on every rank's thread at once and returns each rank's result, in rank
    /// order. A rank whose thread died (a panic) ends the call with an error naming it and
    /// what it was doing; its peers' collective calls fail promptly, since the group was
    /// aborted as the thread unwound.
    fn on_all<T: Send + 'static>(
        &self,
        what: &str,
        f: impl Fn(&mut RankCache) -> T + Send + Sync + 'static,
    ) -> Result<Vec<T>, ClusterError> {
        let workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        let mut dead = self.dead.lock().unwrap_or_else(|p| p.into_inner());
        let died = |(rank, what): &(usize, String)| ClusterError::RankDied {
            rank: *rank,
            what: what.clone(),
        };
        if let Some(d) = &*dead {
            return Err(died(d));
        }
        let f = Arc::new(f);
        for w in workers.iter() {
            let f = f.clone();
            let job: Job = Box::new(move |rank| Box::new(f(rank)));
            // A send fails only when the thread is gone; the receive below reports it.
            let _ = w.jobs.send((what.to_string(), job));
        }
        let mut out = Vec::with_capacity(workers.len());
        for (r, w) in workers.iter().enumerate() {
            match w.results.recv() {
                Ok(v) => out.push(*v.downcast::<T>().expect("each job returns its own type")),
                Err(_) => {
                    dead.get_or_insert((r, what.to_string()));
                }
            }
        }
        if let Some(d) = &*dead {
            return Err(died(d));
        }
        Ok(out)
    }

    /// The error to report for an operation every rank made: a rank's own error rather than
    /// its peers' reports of it ([`ClusterError::is_peer_failure`]), and rather than a broken
    /// group's follow-on errors.
    fn combine<T>(results: Vec<Result<T, ClusterError>>) -> Result<Vec<T>, ClusterError> {
        let mut oks = Vec::with_capacity(results.len());
        let mut best: Option<ClusterError> = None;
        let rank_of =
            |e: &ClusterError| u8::from(e.is_peer_failure()) * 2 + u8::from(e.is_group_broken());
        for r in results {
            match r {
                Ok(v) => oks.push(v),
                Err(e) => {
                    if best.as_ref().is_none_or(|b| rank_of(&e) < rank_of(b)) {
                        best = Some(e);
                    }
                }
            }
        }
        match best {
            Some(e) => Err(e),
            None => Ok(oks),
        }
    }

    /// How the ranks run: the group's transport, its size, and how peers reach each other's
    /// pools.
    pub fn group_info(&self) -> &GroupInfo {
        &self.info
    }

    /// The layout.
    pub fn layout(&self) -> &CpLayout {
        &self.layout
    }

    /// The settings.
    pub fn config(&self) -> &ClusterConfig {
        &self.config
    }

    /// Rank 0's executor (every rank's, when they share one).
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.exec
    }

    /// Rank 0's loaded kernels.
    pub fn kernels(&self) -> &DeploymentKernels {
        &self.kernels
    }

    /// Makes the first launch of request number `request` (0-based, counted over
    /// [`Cluster::serve`] calls) fail on the last rank, so that request fails there and every
    /// rank rolls it back. The failure never outlives its request: if the request fails on
    /// its own before its first launch (a [`ClusterError::PoolTooSmall`], say), the failure
    /// is dropped with it. An empty prompt launches nothing, so a failure aimed at one moves
    /// to the next request.
    pub fn inject_launch_failure(&mut self, request: usize) {
        let last = self.info.ranks - 1;
        self.inject_launch_failure_on(last, request);
    }

    /// [`Cluster::inject_launch_failure`] aimed at rank `rank`.
    pub fn inject_launch_failure_on(&mut self, rank: usize, request: usize) {
        let _ = self.on_all("arming a launch failure", move |r| {
            if usize::from(r.rank().0) == rank {
                r.inject_launch_failure(request);
            }
        });
    }

    /// Makes rank `rank`'s thread panic in request number `request`: for the test that a
    /// rank that dies mid-request ends the run with an error naming it, never a hang.
    #[doc(hidden)]
    pub fn debug_panic_in(&mut self, rank: usize, request: usize) {
        let _ = self.on_all("arming a panic", move |r| {
            if usize::from(r.rank().0) == rank {
                r.debug_panic_in(request);
            }
        });
    }

    /// Makes rank `rank` read `peer`'s pools through `other`'s mapping: a wrong peer
    /// mapping, on purpose, for the test that it shows as mismatches on that rank only.
    #[doc(hidden)]
    pub fn debug_view_peer_as(&mut self, rank: usize, peer: usize, other: usize) {
        let _ = self.on_all("remapping a peer", move |r| {
            if usize::from(r.rank().0) == rank {
                r.debug_view_peer_as(peer, other);
            }
        });
    }

    /// Materialises and verifies on ranks `0..n` only (every rank by default). Each rank
    /// verifies the whole sequence over its own mappings, so on a CPU this costs `n` times
    /// one verification; a wrong mapping on a rank left out goes unseen.
    pub fn set_verifying_ranks(&mut self, n: usize) {
        self.info.verifying_ranks = n.clamp(1, self.info.ranks);
        let n = self.info.verifying_ranks;
        let _ = self.on_all("choosing the verifying ranks", move |r| {
            r.set_verifying_ranks(n);
        });
    }

    /// Whether every rank's loads in steps run layer by layer, their readers waiting for
    /// each layer ([`RankCache::set_layer_waits`](crate::rank::RankCache::set_layer_waits)).
    pub fn set_layer_waits(&mut self, on: bool) {
        let _ = self.on_all("choosing layer waits", move |r| r.set_layer_waits(on));
    }

    /// Per rank: a digest of the allocator and the tree (host slots excluded: they differ
    /// between ranks by design). Empty once a rank's thread is gone.
    pub fn replica_digests(&self) -> Vec<StateDigest> {
        self.try_replica_digests().unwrap_or_default()
    }

    /// [`Cluster::replica_digests`], with the error that says which rank's thread is gone.
    pub fn try_replica_digests(&self) -> Result<Vec<StateDigest>, ClusterError> {
        self.on_all("computing digests", |r| r.digest())
    }

    /// Whether every rank's digest is equal (false once a rank's thread is gone).
    pub fn replicas_agree(&self) -> bool {
        let d = self.replica_digests();
        !d.is_empty() && d.windows(2).all(|w| w[0] == w[1])
    }

    /// Reads every rank's device lane stacks back and compares them with the allocator's
    /// host mirror. A counted read-back per rank, so call it outside the load path (replay
    /// calls it once, after the run).
    pub fn check_device_lanes(&self) -> Result<(), ClusterError> {
        Self::combine(self.on_all("checking device lanes", |r| r.check_device_lanes())?).map(drop)
    }

    /// Free device pages per lane (rank 0's replica).
    pub fn lane_free_counts(&self) -> Vec<u32> {
        self.on_all("counting free pages", |r| r.lane_free_counts())
            .map(|mut v| v.swap_remove(0))
            .unwrap_or_default()
    }

    /// Checks every rank's allocator and tree invariants, conservation included.
    pub fn check_invariants(&self) -> Result<(), ClusterError> {
        Self::combine(self.on_all("checking invariants", |r| r.check_invariants())?).map(drop)
    }

    /// Evicts device nodes in LRU order on every rank alike until at least `pages` device
    /// pages were released or nothing unlocked is left (write-back backs them up first), so
    /// tests and tools can apply memory pressure between requests. Returns the node count.
    /// On error every rank's state is restored.
    pub fn evict_device_lru(&mut self, pages: usize) -> Result<usize, ClusterError> {
        let counts = Self::combine(self.on_all("evicting", move |r| r.evict_device_lru(pages))?)?;
        Ok(counts[0])
    }

    /// Locks the device-resident prefix of `tokens` on every rank, as a request still
    /// decoding from it would, so eviction cannot take it. Returns what was pinned (possibly
    /// nothing); pair it with [`Cluster::unpin`].
    pub fn pin_prefix(&mut self, tokens: &[u32]) -> Result<Pinned, ClusterError> {
        let ps = self.layout.page_size() as usize;
        let tokens = Arc::new(tokens.to_vec());
        let pinned = Self::combine(self.on_all("pinning a prefix", move |r| {
            let m = r.match_prefix(&tokens)?;
            r.lock(m.last_device_node)?;
            Ok((m.last_device_node, m.device_pages.len()))
        })?)?;
        let (node, pages) = pinned[0];
        Ok(Pinned {
            cluster: self.id,
            node,
            tokens: pages * ps,
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
        let node = pinned.node;
        let result = self
            .on_all("unpinning a prefix", move |r| r.unlock(node))
            .and_then(Self::combine);
        result.map(drop).map_err(|source| UnpinError {
            pinned,
            source: Box::new(source),
        })
    }

    /// When on, every request reads its dense materialised buffers back (after verifying
    /// them) so that [`Cluster::last_dense`] can feed a reference decode. Off by default: the
    /// read-back is a device→host synchronisation a serving path would not do.
    pub fn set_capture_dense(&mut self, on: bool) {
        let _ = self.on_all("setting dense capture", move |r| r.set_capture_dense(on));
    }

    /// Whether freed device and host pages, and the dense buffers, are poisoned again (see
    /// [`RankCache::set_repoison`]). On by default.
    pub fn set_repoison(&mut self, on: bool) {
        let _ = self.on_all("setting re-poisoning", move |r| r.set_repoison(on));
    }

    /// Rank 0's dense materialised buffers of the last request, one per buffer kind, each
    /// laid out `[layer][seq_page][page bytes]` (docs/KERNELS.md); empty unless capture is on.
    pub fn last_dense(&self) -> Vec<(BufferKind, Vec<u8>)> {
        self.on_all("reading dense captures", |r| r.last_dense().to_vec())
            .map(|mut v| v.swap_remove(0))
            .unwrap_or_default()
    }

    /// What the last request's verification found, over all ranks and per rank.
    pub fn last_verdict(&self) -> Verdict {
        self.on_all("reading the verdict", |r| r.last_verdict().clone())
            .map(|mut v| v.swap_remove(0))
            .unwrap_or_default()
    }

    /// Serves one prompt on every rank at once: match, load back, compute the rest,
    /// materialise and verify (on every rank), insert, back up. On error every rank's state
    /// is restored to what it was, so a failed request leaves no trace but the error. The
    /// returned statistics are rank 0's, with byte counts summed over the ranks.
    pub fn serve(&mut self, tokens: &[u32]) -> Result<RequestStats, ClusterError> {
        let tokens = Arc::new(tokens.to_vec());
        let all = Self::combine(self.on_all("serving a request", move |r| r.serve(&tokens))?)?;
        let mut stats = all[0].clone();
        stats.set_rank_counts(RequestStats::sum_rank_counts(&all));
        Ok(stats)
    }

    /// Serves one prompt as a live request on every rank at once
    /// ([`RankCache::serve_live`]): chunked prefill and decode through the step API. A
    /// failure abandons the request on every rank. The returned statistics are rank 0's,
    /// with byte counts summed over the ranks.
    pub fn serve_live(
        &mut self,
        tokens: &[u32],
        shape: &LiveShape,
    ) -> Result<RequestStats, ClusterError> {
        let (tokens, shape) = (Arc::new(tokens.to_vec()), Arc::new(shape.clone()));
        let all = Self::combine(self.on_all("serving a live request", move |r| {
            r.serve_live(&tokens, &shape)
        })?)?;
        let mut stats = all[0].clone();
        stats.set_rank_counts(RequestStats::sum_rank_counts(&all));
        Ok(stats)
    }

    /// Serves `prompts` together on every rank at once, batched as a scheduler steps them
    /// ([`RankCache::serve_batch`]). Each request's statistics are rank 0's, with byte
    /// counts summed over the ranks; a failed request's error is the one of the rank that
    /// caused it.
    pub fn serve_batch(
        &mut self,
        prompts: &[Vec<u32>],
        shapes: &[LiveShape],
    ) -> Result<crate::rank::BatchServed, ClusterError> {
        let (prompts, shapes) = (Arc::new(prompts.to_vec()), Arc::new(shapes.to_vec()));
        let all = Self::combine(self.on_all("serving a batch", move |r| {
            let views: Vec<&[u32]> = prompts.iter().map(Vec::as_slice).collect();
            r.serve_batch(&views, &shapes)
        })?)?;
        let mut ranks = all.into_iter();
        let mut out = ranks
            .next()
            .ok_or_else(|| ClusterError::Config("no ranks".into()))?;
        let others: Vec<_> = ranks.collect();
        for (i, r) in out.requests.iter_mut().enumerate() {
            let peers = others.iter().map(|o| &o.requests[i]);
            match r {
                Ok(stats) => {
                    let oks: Vec<RequestStats> = std::iter::once(stats.clone())
                        .chain(peers.filter_map(|p| p.as_ref().ok().cloned()))
                        .collect();
                    stats.set_rank_counts(RequestStats::sum_rank_counts(&oks));
                }
                Err(e) if e.is_peer_failure() => {
                    // The rank that failed it says why.
                    let own = peers.enumerate().find_map(|(k, p)| match p {
                        Err(own) if !own.is_peer_failure() => Some((k + 1, own)),
                        _ => None,
                    });
                    if let Some((rank, own)) = own {
                        *e = ClusterError::PeerReported {
                            rank,
                            message: own.to_string(),
                            kind: crate::rank::PeerErrorKind::of(own),
                        };
                    }
                }
                Err(_) => {}
            }
        }
        Ok(out)
    }

    /// Starts every rank reading ahead the records it would read for `prompt`
    /// ([`RankCache::prefetch`]); returns how many records the ranks asked for, in all.
    pub fn prefetch(&mut self, prompt: &[u32], skip_tokens: usize) -> Result<usize, ClusterError> {
        let prompt = Arc::new(prompt.to_vec());
        let all = Self::combine(
            self.on_all("reading ahead", move |r| r.prefetch(&prompt, skip_tokens))?,
        )?;
        Ok(all.into_iter().sum())
    }

    /// Attaches `store` as every rank's third tier, written per `policy`
    /// ([`RankCache::attach_storage`]).
    pub fn attach_storage(
        &mut self,
        store: Arc<dyn crate::storage::PageStore>,
        policy: crate::rank::StoragePolicy,
    ) -> Result<(), ClusterError> {
        Self::combine(self.on_all("attaching the store", move |r| {
            r.attach_storage(store.clone(), policy)
        })?)
        .map(drop)
    }

    /// What the rollback of the last failed operation dropped (empty until one fails, and
    /// reset when the next operation starts).
    pub fn last_rollback(&self) -> RollbackDrops {
        self.on_all("reading the rollback", |r| r.last_rollback())
            .map(|mut v| v.swap_remove(0))
            .unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let workers = std::mem::take(self.workers.get_mut().unwrap_or_else(|p| p.into_inner()));
        let mut threads = Vec::new();
        for w in workers {
            // Dropping the mailbox ends the thread's loop.
            let Worker { thread, .. } = w;
            threads.extend(thread);
        }
        for t in threads {
            let _ = t.join();
        }
    }
}

/// The variable bounding one collective call, in seconds.
pub const GROUP_TIMEOUT_ENV: &str = "CP_HICACHE_GROUP_TIMEOUT";

/// The bound on one collective call: [`GROUP_TIMEOUT_ENV`] seconds, else
/// [`DEFAULT_TIMEOUT`]. A value that is not a positive number of seconds is an error.
fn group_timeout() -> Result<Duration, ClusterError> {
    match std::env::var(GROUP_TIMEOUT_ENV) {
        Err(std::env::VarError::NotPresent) => Ok(DEFAULT_TIMEOUT),
        Ok(v) => v
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
            .map(Duration::from_secs_f64)
            .ok_or_else(|| {
                ClusterError::Config(format!(
                    "{GROUP_TIMEOUT_ENV}=`{v}` is not a positive number of seconds"
                ))
            }),
        Err(e) => Err(ClusterError::Config(format!("{GROUP_TIMEOUT_ENV}: {e}"))),
    }
}
