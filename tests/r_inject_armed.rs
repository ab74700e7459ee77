//! Regression tests from the review of `Cluster::inject_launch_failure`: the executor was
//! armed at the start of the chosen request and nothing disarmed it, so a request that failed
//! before its first launch (a `PoolTooSmall`, say) left the executor armed and the injected
//! failure hit whichever launch came next: the next request, instead of none.
//!
//! The contract pinned here: an injected failure makes at most one request fail, the chosen
//! one; if that request is empty (it launches nothing) the failure moves to the next request.

mod hicache_support;

use cp_hicache::cluster::{Cluster, ClusterError};
use cp_hicache::exec::{Executor, LaunchFailure};
use cp_hicache::kernels::ModelShape;
use hicache_support::{linear_tokens as tokens, serve, Setup, Spy};
use std::sync::Arc;

/// MLA, page 16, CP 2: 16 device pages per lane.
fn cluster_on(exec: Arc<dyn Executor>) -> Cluster {
    Setup::new(ModelShape::MlaBf16, 16, 2).build_on(exec)
}

/// Whether `e` is the injected launch failure (of a cluster or an allocator kernel).
fn injected(e: &ClusterError) -> bool {
    e.launch_failure() == Some(LaunchFailure::Injected)
}

/// The chosen request, the first one, needs more device pages than the pool has and nothing
/// can be evicted, so it fails with `PoolTooSmall` before launching anything. The failure
/// aimed at it goes with it: the rollback and the next requests must not meet it.
#[test]
fn failure_aimed_at_a_request_failing_before_its_first_launch_is_not_left_armed() {
    for exec in [
        Arc::new(hicache_support::host_executor()) as Arc<dyn Executor>,
        Spy::new(),
    ] {
        let mut c = cluster_on(exec);
        c.inject_launch_failure(0);
        let before = c.executor().counters();
        let err = c.serve(&tokens(2, 16 * 40)).unwrap_err();
        assert!(matches!(err, ClusterError::PoolTooSmall { .. }), "{err}");
        assert_eq!(
            c.executor().counters().since(&before).launches,
            0,
            "the premise: the request failed before its first launch"
        );
        c.check_invariants().unwrap();
        let s = c
            .serve(&tokens(1, 64))
            .unwrap_or_else(|e| panic!("the next request met the injected failure: {e}"));
        assert_eq!(s.mismatched_tokens, 0);
        let s = serve(&mut c, &tokens(1, 64));
        assert_eq!(s.device_hit_tokens, 64);
    }
}

/// The chosen request fails at its first launch, is rolled back, and the next one succeeds.
#[test]
fn failure_aimed_at_a_request_fails_that_request_only() {
    let mut c = cluster_on(Spy::new());
    serve(&mut c, &tokens(1, 64));
    c.inject_launch_failure(1);
    let digests = c.replica_digests();
    let err = c.serve(&tokens(2, 64)).unwrap_err();
    assert!(injected(&err), "{err}");
    assert_eq!(
        c.replica_digests(),
        digests,
        "a failed request leaves no trace"
    );
    serve(&mut c, &tokens(2, 64));
    serve(&mut c, &tokens(3, 64));
}

/// An empty prompt launches nothing, so a failure aimed at it fails the next request.
#[test]
fn failure_aimed_at_an_empty_prompt_fails_the_next_request() {
    let mut c = cluster_on(Spy::new());
    c.inject_launch_failure(0);
    let s = serve(&mut c, &[]);
    assert_eq!(s.prompt_tokens, 0);
    let err = c.serve(&tokens(1, 64)).unwrap_err();
    assert!(injected(&err), "{err}");
    serve(&mut c, &tokens(1, 64));
}

/// The executor side: a failure no launch consumed can be disarmed, once.
#[test]
fn executors_disarm_an_unconsumed_failure() {
    for exec in [
        Arc::new(hicache_support::host_executor()) as Arc<dyn Executor>,
        Spy::new(),
    ] {
        assert!(!exec.disarm_launch_failure());
        exec.inject_launch_failure();
        assert!(exec.disarm_launch_failure());
        assert!(!exec.disarm_launch_failure());
    }
}
