//! The CP cluster end to end on the host executor: cold prefill, eviction, owner-preserving
//! load-back, verification of every hit, and the seed's bug reproduced on purpose.

mod hicache_support;

use cp_hicache::cluster::{Cluster, Fault, WritePolicy};
use cp_hicache::kernels::ModelShape;
use hicache_support::{linear_tokens as tokens, serve_checked as serve, Setup};

/// A two-layer cluster on a fresh host executor.
fn cluster(
    model: ModelShape,
    ps: u32,
    cp: u8,
    device_pages: u32,
    host_pages: u32,
    policy: WritePolicy,
    fault: Option<Fault>,
) -> Cluster {
    Setup {
        layers: 2,
        device_pages,
        host_pages,
        policy,
        fault,
        ..Setup::new(model, ps, cp)
    }
    .build()
}

#[test]
fn cold_then_hit_then_load_back_verifies() {
    for policy in [WritePolicy::WriteThrough, WritePolicy::WriteBack] {
        let mut c = cluster(ModelShape::MlaBf16, 16, 4, 64, 64, policy, None);
        let a = tokens(1, 300);
        let s = serve(&mut c, &a);
        assert_eq!(s.mismatched_tokens, 0);
        assert_eq!(s.computed_tokens, 300);
        let s = serve(&mut c, &a);
        assert_eq!(s.mismatched_tokens, 0);
        assert_eq!(s.device_hit_tokens, 288);
        // Fill the device with other prompts so `a` is evicted to the host.
        for i in 2..8 {
            let s = serve(&mut c, &tokens(i, 400));
            assert_eq!(s.mismatched_tokens, 0);
        }
        let s = serve(&mut c, &a);
        assert_eq!(s.mismatched_tokens, 0, "{policy}");
        assert!(s.host_hit_tokens > 0, "{policy}: {s:?}");
        assert_eq!(s.load_path_syncs, 0);
    }
}

#[test]
fn plain_alloc_on_load_is_caught_by_verification() {
    let mut c = cluster(
        ModelShape::MlaBf16,
        16,
        4,
        64,
        64,
        WritePolicy::WriteThrough,
        Some(Fault::PlainAllocOnLoad),
    );
    let a = tokens(1, 300);
    serve(&mut c, &a);
    for i in 2..8 {
        serve(&mut c, &tokens(i, 400));
    }
    let s = c.serve(&a).unwrap();
    assert!(s.host_hit_tokens > 0);
    assert!(s.mismatched_tokens > 0, "the seed's bug must show: {s:?}");
    // The debug check catches it too: loaded pages whose owners differ from the recorded
    // ones (as SGLANG_DEBUG_MEMORY_POOL would), on every rank.
    let err = c.check_invariants().unwrap_err().to_string();
    assert!(err.contains("is owned by rank"), "{err}");
}
