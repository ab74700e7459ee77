//! Engine mode: C ranks, each on its own thread with its own executor, agreeing through a
//! collective and reading each other's pools through shared-memory mappings, as C engine
//! processes would. Each test makes one cross-rank failure happen and checks what every rank
//! does about it.

mod hicache_support;

use cp_hicache::cluster::{Cluster, ClusterConfig, ClusterError};
use cp_hicache::exec::{
    BufferId, CopyRegion, Counters, EventId, ExecError, Executor, KernelArg, KernelArtifact,
    KernelId, LaunchConfig, MemKind,
};
use cp_hicache::kernels::{Deployment, ModelShape};
use hicache_support::{evict_all, host_executor, jit, serve, serve_checked, tokens, Setup};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The cluster of `setup` with one host executor per rank.
fn per_rank(setup: &Setup) -> Cluster {
    let config = ClusterConfig {
        deployment: Deployment::new(setup.model, setup.page_size, setup.cp).unwrap(),
        layers: setup.layers,
        device_pages: setup.device_pages,
        host_pages: setup.host_pages,
        policy: setup.policy,
        fault: setup.fault,
        sanitize: cp_hicache::jit::Sanitize::None,
    };
    let execs: Vec<Arc<dyn Executor>> = (0..setup.cp)
        .map(|_| Arc::new(host_executor()) as Arc<dyn Executor>)
        .collect();
    Cluster::with_executors(config, execs, &jit()).unwrap()
}

#[test]
fn ranks_with_executors_of_their_own_serve_and_verify_on_every_rank() {
    let setup = Setup {
        layers: 2,
        ..Setup::new(ModelShape::Nsa, 64, 4)
    };
    let mut c = per_rank(&setup);
    let info = c.group_info().clone();
    assert_eq!(
        (
            info.kind,
            info.ranks,
            info.peer_pools,
            info.executor_per_rank
        ),
        ("local", 4, "shared-memory", true)
    );
    let a = tokens(1, 9 * 64 + 5);
    serve(&mut c, &a);
    evict_all(&mut c);
    let s = serve(&mut c, &a);
    assert_eq!(s.host_hit_tokens, 9 * 64, "{s:?}");
    // Every rank materialised and verified the whole sequence over its own mappings.
    assert_eq!(c.last_verdict().by_rank, vec![0; 4]);
    c.check_device_lanes().unwrap();
}

/// One rank maps one peer's pools wrongly (it reads rank 2's pool where rank 1's should be):
/// the mismatches show on that rank only, and in the request's verdict.
#[test]
fn a_wrong_peer_mapping_shows_on_that_rank_only() {
    let setup = Setup::new(ModelShape::MlaBf16, 16, 4);
    let mut c = per_rank(&setup);
    c.debug_view_peer_as(3, 1, 2);
    // 8 pages, zigzag owners 0,1,2,3,3,2,1,0: two pages live on rank 1.
    let s = serve_checked(&mut c, &tokens(5, 8 * 16));
    let v = c.last_verdict();
    assert_eq!(v.by_rank[..3], [0, 0, 0], "{v:?}");
    assert_eq!(
        v.by_rank[3],
        2 * 16,
        "rank 3 read rank 1's two pages from rank 2: {v:?}"
    );
    assert_eq!(s.mismatched_tokens, 2 * 16);
}

/// A launch failure on one rank, at the request's first launch, before anything was
/// evicted: every rank rolls back to exactly the state before (digests equal), and the next
/// request is served with nothing mismatched.
#[test]
fn a_launch_failure_on_one_rank_rolls_every_rank_back() {
    for rank in [0, 2] {
        let setup = Setup::new(ModelShape::MlaBf16, 16, 3);
        let mut c = per_rank(&setup);
        serve(&mut c, &tokens(1, 5 * 16));
        let before = c.replica_digests();
        c.inject_launch_failure_on(rank, 1);
        let err = c.serve(&tokens(2, 6 * 16 + 3)).unwrap_err();
        assert!(err.launch_failure().is_some(), "rank {rank}: {err}");
        assert!(err.to_string().contains("injected"), "{err}");
        assert_eq!(
            c.replica_digests(),
            before,
            "rank {rank}: every rank restored"
        );
        assert!(c.last_rollback().is_empty());
        c.check_invariants().unwrap();
        let s = serve(&mut c, &tokens(2, 6 * 16 + 3));
        assert_eq!(s.computed_tokens, 6 * 16 + 3);
        let s = serve(&mut c, &tokens(1, 5 * 16));
        assert_eq!(s.device_hit_tokens, 5 * 16, "the cache survived: {s:?}");
    }
}

/// A rank whose thread panics mid-request ends the request with an error naming that rank,
/// promptly (its peers' collective calls fail as its group member unwinds, long before the
/// timeout), and the cluster refuses further work with the same error instead of hanging.
#[test]
fn a_rank_that_panics_mid_request_is_named_and_nothing_hangs() {
    let setup = Setup::new(ModelShape::MlaBf16, 16, 4);
    let mut c = per_rank(&setup);
    serve(&mut c, &tokens(1, 4 * 16));
    c.debug_panic_in(2, 1);
    let start = Instant::now();
    let err = c.serve(&tokens(2, 4 * 16)).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "it waited for the timeout"
    );
    assert!(
        matches!(err, ClusterError::RankDied { rank: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("rank 2's thread died"), "{err}");
    assert!(err.to_string().contains("while serving a request"), "{err}");
    let again = c.serve(&tokens(3, 16)).unwrap_err();
    assert!(
        matches!(again, ClusterError::RankDied { rank: 2, .. }),
        "{again}"
    );
    assert!(!c.replicas_agree());
}

/// Ranks sharing one executor (one process, one device) each count only their own calls,
/// so a load path is not charged for a peer's read-backs: loads stay at 0 syncs with four
/// ranks on threads.
#[test]
fn ranks_sharing_an_executor_count_their_own_load_path() {
    let setup = Setup::new(ModelShape::MlaBf16, 16, 4);
    let mut c = setup.build();
    let info = c.group_info().clone();
    assert_eq!(
        (info.peer_pools, info.executor_per_rank),
        ("shared-memory", false)
    );
    for i in 0..6 {
        serve(&mut c, &tokens(10 + i, 7 * 16 + 1));
    }
    evict_all(&mut c);
    for i in 0..6 {
        let s = serve(&mut c, &tokens(10 + i, 7 * 16 + 1));
        assert_eq!(s.host_hit_tokens, 7 * 16, "{s:?}");
        assert_eq!(s.load_path_syncs, 0, "{s:?}");
    }
}

/// A host executor whose host→device copies of layer 1 are held back, as a GPU's copies are
/// still in flight, until work waits on an event recorded after them: then they run. With
/// `release` off they never run, as if attention read the layer before its copy finished.
struct HoldBack {
    inner: cp_hicache::exec::HostExecutor,
    release: bool,
    entries: std::sync::Mutex<std::collections::HashMap<KernelId, String>>,
    held: std::sync::Mutex<Vec<Held>>,
    events: std::sync::atomic::AtomicU64,
    log: std::sync::Mutex<Vec<String>>,
}

/// A held launch: the events recorded before it, the kernel, its shape and arguments.
type Held = (u64, KernelId, LaunchConfig, Vec<Owned>);

#[derive(Clone, Copy)]
enum Owned {
    Ptr(BufferId, u64),
    U32(u32),
}

impl HoldBack {
    fn new(release: bool) -> Arc<HoldBack> {
        Arc::new(HoldBack {
            inner: host_executor(),
            release,
            entries: Default::default(),
            held: Default::default(),
            events: Default::default(),
            log: Default::default(),
        })
    }
}

impl Executor for HoldBack {
    fn backend(&self) -> cp_hicache::exec::Backend {
        self.inner.backend()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn alloc(&self, k: MemKind, b: usize, f: u8) -> Result<BufferId, ExecError> {
        self.inner.alloc(k, b, f)
    }
    fn free(&self, b: BufferId) -> Result<(), ExecError> {
        self.inner.free(b)
    }
    fn alloc_shareable(&self, b: usize, f: u8) -> Result<BufferId, ExecError> {
        self.inner.alloc_shareable(b, f)
    }
    fn export(&self, b: BufferId) -> Result<Vec<u8>, ExecError> {
        self.inner.export(b)
    }
    fn import(&self, h: &[u8]) -> Result<BufferId, ExecError> {
        self.inner.import(h)
    }
    fn peer_mapping(&self) -> Option<&'static str> {
        self.inner.peer_mapping()
    }
    fn size(&self, b: BufferId) -> Result<usize, ExecError> {
        self.inner.size(b)
    }
    fn upload(&self, b: BufferId, o: u64, d: &[u8]) -> Result<(), ExecError> {
        self.inner.upload(b, o, d)
    }
    fn read(&self, b: BufferId, o: u64, d: &mut [u8]) -> Result<(), ExecError> {
        self.inner.read(b, o, d)
    }
    fn fill(&self, b: BufferId, r: &[(u64, u64)], v: u8) -> Result<(), ExecError> {
        self.inner.fill(b, r, v)
    }
    unsafe fn load_kernel(&self, a: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        // SAFETY: forwarded; the caller's guarantee is the inner executor's.
        let id = unsafe { self.inner.load_kernel(a) }?;
        self.entries
            .lock()
            .unwrap()
            .insert(id, a.entry().to_string());
        Ok(id)
    }
    unsafe fn launch_with(
        &self,
        k: KernelId,
        c: &LaunchConfig,
        a: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError> {
        let entry = self
            .entries
            .lock()
            .unwrap()
            .get(&k)
            .cloned()
            .unwrap_or_default();
        // transfer_pages(src, dst, src_pages, dst_pages, n, layers, first_layer, ...)
        if entry.starts_with("transfer_pages_h2d") && matches!(a.get(6), Some(KernelArg::U32(1))) {
            let owned = a
                .iter()
                .map(|x| match x {
                    KernelArg::Ptr(b, o) => Owned::Ptr(*b, *o),
                    KernelArg::U32(v) => Owned::U32(*v),
                    _ => panic!("a transfer takes pointers and u32s"),
                })
                .collect();
            let seq = self.events.load(std::sync::atomic::Ordering::SeqCst);
            self.held.lock().unwrap().push((seq, k, *c, owned));
            self.log.lock().unwrap().push("h2d held".into());
            return Ok(());
        }
        self.log.lock().unwrap().push(entry);
        // SAFETY: forwarded; the caller's guarantee is the inner executor's.
        unsafe { self.inner.launch_with(k, c, a, unsigned_ok) }
    }
    fn copy_regions(&self, s: BufferId, d: BufferId, r: &[CopyRegion]) -> Result<(), ExecError> {
        self.inner.copy_regions(s, d, r)
    }
    fn synchronize(&self) -> Result<(), ExecError> {
        // A synchronisation waits for everything, held copies included.
        self.run_held(u64::MAX)?;
        self.inner.synchronize()
    }
    fn counters(&self) -> Counters {
        self.inner.counters()
    }
    fn record_event(&self) -> Result<EventId, ExecError> {
        Ok(EventId(
            self.events
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                + 1,
        ))
    }
    fn wait_event(&self, e: EventId) -> Result<(), ExecError> {
        if !self.release {
            return Ok(());
        }
        self.run_held(e.0)
    }
    fn inject_launch_failure(&self) {
        self.inner.inject_launch_failure()
    }
    fn disarm_launch_failure(&self) -> bool {
        self.inner.disarm_launch_failure()
    }
}

impl HoldBack {
    /// Runs the held copies enqueued before event `before`.
    fn run_held(&self, before: u64) -> Result<(), ExecError> {
        let ready: Vec<_> = {
            let mut held = self.held.lock().unwrap();
            let (ready, later) = held.drain(..).partition(|h| h.0 < before);
            *held = later;
            ready
        };
        for (_, k, c, args) in ready {
            let args: Vec<KernelArg<'_>> = args
                .iter()
                .map(|x| match *x {
                    Owned::Ptr(b, o) => KernelArg::Ptr(b, o),
                    Owned::U32(v) => KernelArg::U32(v),
                })
                .collect();
            self.log.lock().unwrap().push("h2d released".into());
            self.inner.launch(k, &c, &args)?;
        }
        Ok(())
    }
}

/// Loads back a prompt on one rank (its own pool is all it reads, so nothing but its own
/// waits orders its copies) whose host→device copies are held back until something waits for
/// their layer's event. Returns the mismatched tokens of the load and the executor's log.
fn load_with_held_copies(release: bool) -> (u64, Vec<String>) {
    let setup = Setup {
        layers: 3,
        ..Setup::new(ModelShape::MlaBf16, 16, 1)
    };
    let config = ClusterConfig {
        deployment: Deployment::new(setup.model, setup.page_size, setup.cp).unwrap(),
        layers: setup.layers,
        device_pages: setup.device_pages,
        host_pages: setup.host_pages,
        policy: setup.policy,
        fault: None,
        sanitize: cp_hicache::jit::Sanitize::None,
    };
    let execs: Vec<Arc<HoldBack>> = vec![HoldBack::new(release)];
    let mut c = Cluster::with_executors(
        config,
        execs
            .iter()
            .map(|e| e.clone() as Arc<dyn Executor>)
            .collect(),
        &jit(),
    )
    .unwrap();
    let a = tokens(1, 6 * 16);
    serve(&mut c, &a);
    evict_all(&mut c);
    execs[0].log.lock().unwrap().clear();
    let s = serve_checked(&mut c, &a);
    assert_eq!(s.host_hit_tokens, 6 * 16, "{s:?}");
    let log = execs[0].log.lock().unwrap().clone();
    (s.mismatched_tokens, log)
}

/// Verification reads each layer only after waiting for that layer's load-back, the way
/// attention would: with layer 1's copy held back until a wait, the load verifies clean, and
/// the held copy ran after layer 0 was materialised and before layer 1 was (layer 0 did not
/// wait for it; layer 1 did). A copy nobody waits for never runs, and every loaded token
/// mismatches (in layer 1).
#[test]
fn verification_waits_for_each_layer_of_the_load() {
    let (bad, log) = load_with_held_copies(true);
    assert_eq!(bad, 0, "{log:?}");
    let held = log.iter().position(|l| l == "h2d held");
    let released = log.iter().position(|l| l == "h2d released");
    let materialised: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("materialise"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(materialised.len(), 3, "one launch per layer: {log:?}");
    assert!(held.is_some(), "layer 1's copy was held: {log:?}");
    assert!(
        released > Some(materialised[0]) && released < Some(materialised[1]),
        "layer 0 went ahead, layer 1 waited for its copy: {log:?}"
    );
    let (bad, log) = load_with_held_copies(false);
    assert_eq!(
        bad,
        6 * 16,
        "a layer read before its copy ran must mismatch: {log:?}"
    );
}
