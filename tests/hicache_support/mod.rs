//! Shared setup of the `hicache_*` integration tests: a host-executor cluster whose JIT
//! cache lives under CARGO_TARGET_TMPDIR (shared by every test binary), prompt builders, and
//! a `serve` that checks everything the cluster promises after each request.
#![allow(dead_code)]

use cp_hicache::cluster::{Cluster, ClusterConfig, Fault, RequestStats, WritePolicy};
use cp_hicache::exec::host::EMU_HEADER;
use cp_hicache::exec::{Executor, HostExecutor, HostOptions};
use cp_hicache::jit::{Jit, JitConfig, Sanitize};
use cp_hicache::kernels::{Deployment, ModelShape, TransferPath};
use std::sync::Arc;

pub fn jit() -> Jit {
    Jit::new(JitConfig::new(
        concat!(env!("CARGO_TARGET_TMPDIR"), "/jit-cache"),
        EMU_HEADER,
    ))
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
        }
    }

    pub fn build(&self) -> Cluster {
        let exec: Arc<dyn Executor> = Arc::new(HostExecutor::new(HostOptions::from_env().unwrap()));
        let mut deployment = Deployment::new(self.model, self.page_size, self.cp).unwrap();
        deployment.transfer_path = self.transfer_path;
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

/// `a` followed by `b`.
pub fn cat(a: &[u32], b: &[u32]) -> Vec<u32> {
    a.iter().chain(b).copied().collect()
}

/// Serves `t` and checks: the token accounting adds up, replicas agree, the invariants
/// (conservation included) hold, and a host hit read nothing back on the load path.
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
    if s.host_hit_tokens > 0 {
        assert_eq!(s.load_path_syncs, 0, "the load path synchronised: {s:?}");
    }
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
