//! Shared setup of the cluster-level integration tests (`hicache_*`, `cluster`, `r_*`): a
//! host-executor cluster whose JIT cache lives under CARGO_TARGET_TMPDIR (shared by every test
//! binary), prompt builders, a `serve` that checks everything the cluster promises after each
//! request, and [`Spy`], a host executor that counts frees and fails a chosen launch.
#![allow(dead_code)]

use cp_hicache::cluster::{Cluster, ClusterConfig, Fault, RequestStats, WritePolicy};
use cp_hicache::exec::{
    Backend, BufferId, CopyRegion, Counters, EventId, ExecError, Executor, HostExecutor,
    HostOptions, KernelArg, KernelArtifact, KernelId, LaunchConfig, MemKind,
};
use cp_hicache::jit::{Jit, JitConfig, Sanitize};
use cp_hicache::kernels::{CopyLaunch, Deployment, ModelShape, TransferPath};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

pub fn jit() -> Jit {
    Jit::new(JitConfig::new(concat!(
        env!("CARGO_TARGET_TMPDIR"),
        "/jit-cache"
    )))
}

/// Cluster settings with test-friendly defaults (roomy host pools, no fault).
#[derive(Clone, Debug)]
pub struct Setup {
    pub model: ModelShape,
    pub page_size: u32,
    pub cp: u8,
    pub layers: u32,
    pub device_pages: u32,
    pub host_pages: u32,
    pub policy: WritePolicy,
    pub fault: Option<Fault>,
    pub transfer_path: TransferPath,
    /// The transfer kernel's launch shape, when not the deployment's default.
    pub transfer_launch: Option<CopyLaunch>,
}

impl Setup {
    pub fn new(model: ModelShape, page_size: u32, cp: u8) -> Setup {
        Setup {
            model,
            page_size,
            cp,
            layers: 1,
            device_pages: 16 * u32::from(cp) + 1,
            host_pages: 256,
            policy: WritePolicy::WriteThrough,
            fault: None,
            transfer_path: TransferPath::Kernel,
            transfer_launch: None,
        }
    }

    /// The cluster on a fresh host executor.
    pub fn build(&self) -> Cluster {
        self.build_on(Arc::new(host_executor()))
    }

    /// The cluster on `exec`.
    pub fn build_on(&self, exec: Arc<dyn Executor>) -> Cluster {
        let mut deployment = Deployment::new(self.model, self.page_size, self.cp).unwrap();
        deployment.transfer_path = self.transfer_path;
        if let Some(launch) = self.transfer_launch {
            deployment.transfer_copy = launch;
        }
        let config = ClusterConfig {
            deployment,
            layers: self.layers,
            device_pages: self.device_pages,
            host_pages: self.host_pages,
            policy: self.policy,
            fault: self.fault,
            sanitize: Sanitize::None,
        };
        Cluster::new(config, exec, &jit()).unwrap()
    }
}

/// `n` pseudo-random tokens from stream `seed` (distinct streams share no page).
pub fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            let x = u64::from(seed) << 32 | u64::from(i);
            (cp_hicache::kernels::reference::mix64(x) % 50_000) as u32
        })
        .collect()
}

/// `n` tokens of stream `seed` from a linear sequence over a 1,000-token vocabulary
/// (`seed * 7919 + i * 31 mod 1000`): the streams of two seeds below 1,000 differ in their
/// first token, so they share no page. Tests whose pool sizes were worked out on these
/// exact prompts use it; others use [`tokens`].
pub fn linear_tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| seed.wrapping_mul(7919).wrapping_add(i * 31) % 1000)
        .collect()
}

/// `a` followed by `b`.
pub fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().chain(b).copied().collect()
}

/// Serves `t` and checks: the token accounting adds up, replicas agree, the invariants
/// (conservation included) hold, and no load path (one that degraded to a miss included)
/// read back or synchronised.
/// Mismatches are returned, not asserted, so fault tests can use it.
pub fn serve_checked(c: &mut Cluster, t: &[u32]) -> RequestStats {
    let s = c.serve(t).unwrap();
    assert!(c.replicas_agree(), "replicas disagree after {s:?}");
    c.check_invariants().unwrap();
    assert_eq!(
        s.device_hit_tokens + s.host_hit_tokens + s.computed_tokens,
        s.prompt_tokens,
        "{s:?}"
    );
    assert_eq!(s.load_path_syncs, 0, "a load path synchronised: {s:?}");
    s
}

/// [`serve_checked`] plus zero mismatched tokens.
pub fn serve(c: &mut Cluster, t: &[u32]) -> RequestStats {
    let s = serve_checked(c, t);
    assert_eq!(s.mismatched_tokens, 0, "mismatch: {s:?}");
    s
}

/// Evicts every unlocked device node and checks the invariants after it.
pub fn evict_all(c: &mut Cluster) -> usize {
    let n = c.evict_device_lru(usize::MAX).unwrap();
    assert!(c.replicas_agree());
    c.check_invariants().unwrap();
    n
}

/// Lane capacities of the layout (free + used per lane when nothing leaks).
pub fn lane_capacities(c: &Cluster) -> Vec<u32> {
    let l = c.layout();
    (0..l.cp())
        .map(|r| l.lane_capacity(cp_hicache::layout::Rank(r)))
        .collect()
}

/// A host executor with the options of the environment (block order, sanitizer).
pub fn host_executor() -> HostExecutor {
    HostExecutor::new(HostOptions::from_env().unwrap())
}

/// A host executor that counts [`Executor::free`] calls, can fail one chosen launch
/// (besides what [`Executor::inject_launch_failure`] does), every upload or the next fill, and can turn the launches of
/// chosen kernels into no-ops that report success (a kernel that silently copies nothing);
/// everything else is delegated.
pub struct Spy {
    inner: HostExecutor,
    /// Launches left before the one to fail (`i64::MAX`: none is chosen).
    countdown: AtomicI64,
    frees: AtomicU64,
    /// Entry name of every loaded kernel.
    entries: Mutex<HashMap<KernelId, String>>,
    /// Launches of kernels whose entry starts with this prefix do nothing.
    skip: Mutex<Option<String>>,
    skipped: AtomicU64,
    /// Every upload fails while set.
    fail_uploads: AtomicBool,
    /// Set: the next fill fails (once).
    fail_fill: AtomicBool,
    /// Host→device copies of this layer are held back ([`Spy::hold_h2d_layer`]).
    hold: Mutex<Option<HoldH2d>>,
}

/// What [`Spy::hold_h2d_layer`] holds back, and what it saw.
struct HoldH2d {
    layer: u32,
    release: bool,
    held: Vec<Held>,
    /// Events recorded so far (each id is the count at its record).
    events: u64,
    log: Vec<String>,
}

/// A held launch: the events recorded before it, the kernel, its shape and its arguments.
type Held = (u64, KernelId, LaunchConfig, Vec<Owned>);

/// A transfer argument, owned so that the launch can run later.
#[derive(Clone)]
enum Owned {
    Ptr(BufferId, u64),
    U32(u32),
    Table(BufferId, u64, Vec<(BufferId, u64)>),
}

impl Spy {
    /// A spy over a fresh [`host_executor`], failing nothing.
    pub fn new() -> Arc<Spy> {
        Arc::new(Spy {
            inner: host_executor(),
            countdown: AtomicI64::new(i64::MAX),
            frees: AtomicU64::new(0),
            entries: Mutex::new(HashMap::new()),
            skip: Mutex::new(None),
            skipped: AtomicU64::new(0),
            fail_uploads: AtomicBool::new(false),
            fail_fill: AtomicBool::new(false),
            hold: Mutex::new(None),
        })
    }

    /// From now on, host→device copies of layer `layer` are held back, as a GPU's copies
    /// still in flight are, until work waits on an event recorded after them (or the
    /// executor synchronises); then they run. With `release` off a wait does not run them,
    /// as if attention read the layer before its copy finished. Launches are logged by entry
    /// name ("h2d held", "h2d released" for the held ones) for [`Spy::hold_log`].
    pub fn hold_h2d_layer(&self, layer: u32, release: bool) {
        *self.hold.lock().unwrap() = Some(HoldH2d {
            layer,
            release,
            held: Vec::new(),
            events: 0,
            log: Vec::new(),
        });
    }

    /// The launches logged since [`Spy::hold_h2d_layer`], in order.
    pub fn hold_log(&self) -> Vec<String> {
        self.hold
            .lock()
            .unwrap()
            .as_ref()
            .map_or_else(Vec::new, |h| h.log.clone())
    }

    /// Holds launch `k` back when it is a held layer's host→device copy (logging every
    /// launch while holding); whether it was held.
    fn holds(&self, k: KernelId, c: &LaunchConfig, a: &[KernelArg<'_>]) -> bool {
        let mut hold = self.hold.lock().unwrap();
        let Some(h) = hold.as_mut() else {
            return false;
        };
        let entry = self
            .entries
            .lock()
            .unwrap()
            .get(&k)
            .cloned()
            .unwrap_or_default();
        // transfer_pages(device, host, src_pages, dst_pages, n, layers, first_layer, ...)
        if entry.starts_with("transfer_pages_h2d")
            && matches!(a.get(6), Some(KernelArg::U32(l)) if *l == h.layer)
        {
            let owned = a
                .iter()
                .map(|x| match x {
                    KernelArg::Ptr(b, o) => Owned::Ptr(*b, *o),
                    KernelArg::U32(v) => Owned::U32(*v),
                    KernelArg::Table(b, o, e) => Owned::Table(*b, *o, e.to_vec()),
                    _ => panic!("a transfer takes pointers, page tables and u32s"),
                })
                .collect();
            h.held.push((h.events, k, *c, owned));
            h.log.push("h2d held".into());
            return true;
        }
        h.log.push(entry);
        false
    }

    /// Runs the held copies recorded before event `before` (all of them for `u64::MAX`).
    fn run_held(&self, before: u64) -> Result<(), ExecError> {
        let ready: Vec<Held> = {
            let mut hold = self.hold.lock().unwrap();
            let Some(h) = hold.as_mut() else {
                return Ok(());
            };
            let (ready, later) = h.held.drain(..).partition(|x| x.0 < before);
            h.held = later;
            h.log
                .extend(ready.iter().map(|_| "h2d released".to_string()));
            ready
        };
        for (_, k, c, args) in ready {
            let args: Vec<KernelArg<'_>> = args
                .iter()
                .map(|x| match x {
                    Owned::Ptr(b, o) => KernelArg::Ptr(*b, *o),
                    Owned::U32(v) => KernelArg::U32(*v),
                    Owned::Table(b, o, e) => KernelArg::Table(*b, *o, e),
                })
                .collect();
            self.inner.launch(k, &c, &args)?;
        }
        Ok(())
    }

    /// While `on`, every upload fails with a driver error.
    pub fn fail_uploads(&self, on: bool) {
        self.fail_uploads.store(on, Ordering::SeqCst);
    }

    /// The next fill (a poison fill) fails, once.
    pub fn fail_next_fill(&self) {
        self.fail_fill.store(true, Ordering::SeqCst);
    }

    /// From now on, launches of kernels whose entry name starts with `prefix` (for example
    /// `transfer_pages_h2d`) succeed without running; `None` runs every kernel again.
    pub fn skip_kernels(&self, prefix: Option<&str>) {
        *self.skip.lock().unwrap() = prefix.map(str::to_string);
    }

    /// Launches skipped so far.
    pub fn skipped(&self) -> u64 {
        self.skipped.load(Ordering::SeqCst)
    }

    /// Fails launch number `k` (0-based) counted from now, with the injected-fault error.
    pub fn fail_launch(&self, k: i64) {
        self.countdown.store(k, Ordering::SeqCst);
    }

    /// Fails no launch (undoes [`Spy::fail_launch`] if that launch did not come).
    pub fn fail_none(&self) {
        self.countdown.store(i64::MAX, Ordering::SeqCst);
    }

    /// `free` calls so far.
    pub fn frees(&self) -> u64 {
        self.frees.load(Ordering::SeqCst)
    }

    /// Arms the inner executor's failure when the countdown reaches this launch, and whether
    /// to skip kernel `k` (its entry starts with the skip prefix).
    fn skips(&self, k: KernelId) -> bool {
        if self.countdown.fetch_sub(1, Ordering::SeqCst) == 0 {
            self.inner.inject_launch_failure();
        }
        let skip = self.skip.lock().unwrap().clone();
        let Some(prefix) = skip else {
            return false;
        };
        let entries = self.entries.lock().unwrap();
        let skipped = entries.get(&k).is_some_and(|e| e.starts_with(&prefix));
        if skipped {
            self.skipped.fetch_add(1, Ordering::SeqCst);
        }
        skipped
    }
}

impl Executor for Spy {
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn alloc(&self, k: MemKind, b: usize, f: u8) -> Result<BufferId, ExecError> {
        self.inner.alloc(k, b, f)
    }
    fn free(&self, b: BufferId) -> Result<(), ExecError> {
        self.frees.fetch_add(1, Ordering::SeqCst);
        self.inner.free(b)
    }
    fn size(&self, b: BufferId) -> Result<usize, ExecError> {
        self.inner.size(b)
    }
    fn address(&self, b: BufferId) -> Result<cp_hicache::exec::Address, ExecError> {
        self.inner.address(b)
    }
    fn upload(&self, b: BufferId, o: u64, d: &[u8]) -> Result<(), ExecError> {
        if self.fail_uploads.load(Ordering::SeqCst) {
            return Err(ExecError::Driver {
                op: "upload",
                message: "upload failure injected by the test".into(),
            });
        }
        self.inner.upload(b, o, d)
    }
    fn read(&self, b: BufferId, o: u64, d: &mut [u8]) -> Result<(), ExecError> {
        self.inner.read(b, o, d)
    }
    fn fill(&self, b: BufferId, r: &[(u64, u64)], v: u8) -> Result<(), ExecError> {
        if self.fail_fill.swap(false, Ordering::SeqCst) {
            return Err(ExecError::Driver {
                op: "fill",
                message: "fill failure injected by the test".into(),
            });
        }
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
        if self.skips(k) || self.holds(k, c, a) {
            return Ok(());
        }
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
    fn alloc_shareable(&self, b: usize, f: u8) -> Result<BufferId, ExecError> {
        self.inner.alloc_shareable(b, f)
    }
    fn export(&self, b: BufferId) -> Result<Vec<u8>, ExecError> {
        self.inner.export(b)
    }
    fn seal_shareable(&self, b: BufferId) -> Result<(), ExecError> {
        self.inner.seal_shareable(b)
    }
    fn import(&self, h: &[u8]) -> Result<BufferId, ExecError> {
        self.inner.import(h)
    }
    fn peer_mapping(&self) -> Option<&'static str> {
        self.inner.peer_mapping()
    }
    fn record_event(&self) -> Result<EventId, ExecError> {
        let mut hold = self.hold.lock().unwrap();
        match hold.as_mut() {
            Some(h) => {
                h.events += 1;
                Ok(EventId(h.events))
            }
            None => self.inner.record_event(),
        }
    }
    fn wait_event(&self, e: EventId) -> Result<(), ExecError> {
        let release = self.hold.lock().unwrap().as_ref().map(|h| h.release);
        match release {
            Some(true) => self.run_held(e.0),
            Some(false) => Ok(()),
            None => self.inner.wait_event(e),
        }
    }
    fn release_event(&self, e: EventId) {
        self.inner.release_event(e)
    }
    fn inject_launch_failure(&self) {
        self.inner.inject_launch_failure()
    }
    fn disarm_launch_failure(&self) -> bool {
        self.inner.disarm_launch_failure()
    }
}
