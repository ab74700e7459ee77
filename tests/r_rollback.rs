//! Regression tests from the review of the cluster's rollback: a failed operation may have
//! evicted nodes and reused their pages before failing, so a rollback must not bring those
//! nodes back; and a load-back must not grow (free and reallocate) executor buffers, which
//! synchronises on CUDA. Plus randomised stress runs where every request must verify.

mod hicache_support;

use cp_hicache::cluster::{Cluster, ClusterError, Fault, WritePolicy};
use cp_hicache::exec::Executor;
use cp_hicache::kernels::ModelShape;
use hicache_support::{host_executor, linear_tokens as tokens, Setup, Spy};
use std::sync::Arc;

/// MLA, page 16, CP 2, two layers on `exec`.
fn cluster_host(
    exec: Arc<dyn Executor>,
    device_pages: u32,
    host_pages: u32,
    policy: WritePolicy,
) -> Cluster {
    Setup {
        layers: 2,
        device_pages,
        host_pages,
        policy,
        ..Setup::new(ModelShape::MlaBf16, 16, 2)
    }
    .build_on(exec)
}

/// [`cluster_host`] with 64 host pages.
fn cluster_with(exec: Arc<dyn Executor>, device_pages: u32, policy: WritePolicy) -> Cluster {
    cluster_host(exec, device_pages, 64, policy)
}

/// A request that fails with PoolTooSmall after its load-back reused the device pages of an
/// evicted (backed-up) node: the rollback must not put that node back on the device, since
/// its pages now hold the loaded node's bytes. The next hit on it must verify.
#[test]
fn failed_request_rollback_leaves_overwritten_device_pages() {
    let mut c = cluster_with(Arc::new(host_executor()), 24, WritePolicy::WriteThrough);
    let a = tokens(1, 128);
    let x = tokens(2, 128);
    let y = tokens(3, 128);
    for t in [&a, &x, &y] {
        let s = c.serve(t).unwrap();
        assert_eq!(s.mismatched_tokens, 0);
    }
    // a is host-only now; x, y on the device. a + 20 pages: the load evicts x (lane 0 short)
    // and reuses its pages, then the compute cannot fit -> PoolTooSmall -> restore.
    let long = tokens(1, 128 + 16 * 20);
    let err = c.serve(&long).unwrap_err();
    assert!(matches!(err, ClusterError::PoolTooSmall { .. }), "{err}");
    c.check_invariants().unwrap();
    let s = c.serve(&x).unwrap();
    assert_eq!(s.device_hit_tokens + s.host_hit_tokens, 128, "{s:?}");
    assert_eq!(
        s.mismatched_tokens, 0,
        "x's KV was overwritten by the failed request: {s:?}"
    );
}

/// Same class of bug through a launch failure in the middle of a request (any launch after
/// bytes were written into pages the snapshot still attributes to another node).
#[test]
fn failed_launch_rollback_leaves_overwritten_device_pages() {
    let mut bad = Vec::new();
    for k in 0..40 {
        let exec = Spy::new();
        let dynexec: Arc<dyn Executor> = exec.clone();
        let mut c = cluster_with(dynexec, 16, WritePolicy::WriteThrough);
        let a = tokens(1, 176); // 11 pages
        let b = tokens(2, 176);
        c.serve(&a).unwrap();
        exec.fail_launch(k);
        let failed = c.serve(&b).is_err();
        exec.fail_none();
        if !failed {
            break;
        }
        let s = c.serve(&a).unwrap();
        if s.mismatched_tokens > 0 {
            bad.push((k, s.device_hit_tokens, s.mismatched_tokens));
        }
    }
    assert!(
        bad.is_empty(),
        "launch k of request b failed -> a then mismatches: {bad:?}"
    );
}

/// Host-side twin: a backup reuses the host pages of a host-LRU-evicted node, a later launch
/// of the same request fails, restore() gives the evicted node its metadata back, but its
/// host pages now hold the other prefix's bytes; loading it back mismatches.
#[test]
fn failed_launch_rollback_leaves_overwritten_host_pages() {
    let mut bad = Vec::new();
    for k in 0..40 {
        let exec = Spy::new();
        let dynexec: Arc<dyn Executor> = exec.clone();
        let mut c = cluster_host(dynexec, 64, 4, WritePolicy::WriteThrough);
        let a = tokens(1, 128);
        let b = tokens(2, 128);
        c.serve(&a).unwrap();
        c.evict_device_lru(1000).unwrap(); // a is host-only now
        exec.fail_launch(k);
        let failed = c.serve(&b).is_err();
        exec.fail_none();
        if !failed {
            break;
        }
        let s = c.serve(&a).unwrap();
        if s.mismatched_tokens > 0 {
            bad.push((k, s.host_hit_tokens, s.mismatched_tokens));
        }
    }
    assert!(
        bad.is_empty(),
        "launch k of request b failed -> a loads back garbage: {bad:?}"
    );
}

/// A load-back larger than any earlier transfer/allocation grows scratch buffers on the load
/// path: exec.free (cuMemFree, an implicit device synchronisation on CUDA) runs while
/// load_path_syncs reports 0.
#[test]
fn load_path_frees_buffers_uncounted() {
    let exec = Spy::new();
    let dynexec: Arc<dyn Executor> = exec.clone();
    let mut c = cluster_host(dynexec, 1024, 1024, WritePolicy::WriteThrough);
    c.serve(&tokens(1, 16 * 100)).unwrap();
    c.serve(&tokens(1, 16 * 300)).unwrap();
    c.evict_device_lru(100_000).unwrap();
    let before = exec.frees();
    let s = c.serve(&tokens(1, 16 * 300)).unwrap();
    let frees = exec.frees() - before;
    assert_eq!(s.host_hit_tokens, 16 * 300);
    assert_eq!(s.load_path_syncs, 0);
    assert_eq!(
        frees, 0,
        "buffers freed (cuMemFree = device sync) during a load-back serve"
    );
}

/// Random stress: small pools, both policies, shared prefixes; every request must verify.
#[test]
fn stress_small_pools() {
    let mut rng: u64 = 0x1234_5678;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for policy in [WritePolicy::WriteBack, WritePolicy::WriteThrough] {
        for (dp, hp) in [(40u32, 6u32), (33, 20), (64, 3), (48, 0)] {
            let mut c = cluster_host(Arc::new(host_executor()), dp, hp, policy);
            for i in 0..120 {
                let seed = (next() % 6) as u32;
                let len = 1 + (next() % 400) as usize;
                let t = tokens(seed, len);
                match c.serve(&t) {
                    Ok(s) => {
                        assert_eq!(
                            s.mismatched_tokens, 0,
                            "{policy} dp{dp} hp{hp} req {i}: {s:?}"
                        );
                        assert_eq!(s.load_path_syncs, 0);
                    }
                    Err(ClusterError::PoolTooSmall { .. }) => {}
                    Err(e) => panic!("{policy} dp{dp} hp{hp} req {i}: {e}"),
                }
                assert!(c.replicas_agree());
                c.check_invariants()
                    .unwrap_or_else(|e| panic!("{policy} dp{dp} hp{hp} req {i}: {e}"));
            }
        }
    }
}

/// Random requests with pins (in-flight prefixes), both policies, lane exhaustion and a full
/// host pool at CP 4; requests that do not fit fail with PoolTooSmall, are rolled back, and the
/// run goes on: every later request must still verify.
fn stress_cp4(seed0: u64) {
    let mut rng: u64 = 0x9e37_79b9 ^ (seed0 * 0x1000_0001);
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    for policy in [WritePolicy::WriteBack, WritePolicy::WriteThrough] {
        for fault in [None, Some(Fault::LaneExhaustion), Some(Fault::HostPoolFull)] {
            for (dp, hp) in [(61u32, 9u32), (90, 40)] {
                let mut c = Setup {
                    layers: 1,
                    device_pages: dp,
                    host_pages: hp,
                    policy,
                    fault,
                    ..Setup::new(ModelShape::MlaBf16, 4, 4)
                }
                .build();
                let mut pins = Vec::new();
                for i in 0..150 {
                    let what = format!("seed {seed0} {policy} {fault:?} dp{dp} req {i}");
                    let seed = (next() % 5) as u32;
                    let len = 1 + (next() % 90) as usize;
                    let t = tokens(seed, len);
                    if next() % 7 == 0 {
                        pins.push(c.pin_prefix(&t).unwrap());
                    }
                    if pins.len() > 2 {
                        let p = pins.remove(0);
                        c.unpin(p).unwrap();
                    }
                    match c.serve(&t) {
                        Ok(s) => assert_eq!(s.mismatched_tokens, 0, "{what}: {s:?}"),
                        Err(ClusterError::PoolTooSmall { .. }) => {}
                        Err(e) => panic!("{what}: {e}"),
                    }
                    assert!(c.replicas_agree(), "{what}");
                    c.check_invariants()
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
            }
        }
    }
}

#[test]
fn stress_cp4_seeds() {
    for seed0 in 0u64..12 {
        stress_cp4(seed0);
    }
}
