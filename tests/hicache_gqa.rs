//! The GQA deployment kind through the whole cache, on the host executor in both block
//! orders: its K and V pages are synthesised on their owners, backed up to the host tier,
//! loaded back on a hit and verified byte for byte (0 mismatched tokens), and under the
//! seed's bug (a plain allocator on load) the owners' unwritten, poisoned slots are read and
//! verification catches the wrong owner.

mod hicache_support;

use cp_hicache::cluster::{Cluster, Fault, WritePolicy};
use cp_hicache::exec::BlockOrder;
use cp_hicache::kernels::{BufferKind, Deployment, ModelShape, TransferPath};
use hicache_support::{evict_all, host_executor, serve_checked, tokens, Setup};
use std::sync::Arc;

const ORDERS: [BlockOrder; 2] = [BlockOrder::Forward, BlockOrder::Reverse];

fn build(setup: &Setup, order: BlockOrder) -> Cluster {
    let exec = host_executor();
    exec.set_block_order(order);
    setup.build_on(Arc::new(exec))
}

/// Cold prefill, eviction to the host, a host hit: the stats of the hit.
fn reload(c: &mut Cluster, ps: usize) -> cp_hicache::cluster::RequestStats {
    let a = tokens(11, 9 * ps + ps / 2);
    let s = serve_checked(c, &a);
    assert_eq!(s.computed_tokens, a.len() as u64);
    assert!(evict_all(c) > 0);
    c.serve(&a).unwrap()
}

/// The reference GQA deployment (8 KV heads of 128, page 16, CP 4) and a small shard shape
/// (2 × 64 at CP 2), both write policies, both transfer paths, both block orders: every
/// host hit verifies with 0 mismatched tokens, and the replicas agree.
#[test]
fn gqa_pages_round_trip_through_the_host_tier() {
    let dep = Deployment::by_name("gqa8x128_ps16_cp4").unwrap();
    assert_eq!(
        dep.model.buffers()[..],
        [BufferKind::GqaKv {
            kv_heads: 8,
            head_dim: 128
        }]
    );
    let shapes = [
        (dep.model, 16u32, 4u8, TransferPath::Kernel),
        (
            ModelShape::Gqa {
                kv_heads: 2,
                head_dim: 64,
            },
            16,
            2,
            TransferPath::Dma,
        ),
    ];
    for order in ORDERS {
        for (model, ps, cp, path) in shapes {
            for policy in [WritePolicy::WriteThrough, WritePolicy::WriteBack] {
                let mut setup = Setup::new(model, ps, cp);
                setup.layers = 2;
                setup.policy = policy;
                setup.transfer_path = path;
                let mut c = build(&setup, order);
                let what = format!("{model} cp {cp} {path} {policy} {order:?}");
                let s = reload(&mut c, ps as usize);
                assert_eq!(s.host_hit_tokens, 9 * u64::from(ps), "{what}: {s:?}");
                assert_eq!(s.mismatched_tokens, 0, "{what}: {s:?}");
                assert!(c.replicas_agree(), "{what}");
                c.check_invariants().unwrap();
            }
        }
    }
}

/// The seed's bug on a GQA deployment: pages loaded into another rank's slots leave the
/// owner's poisoned slots to be read, and verification flags them, in both block orders.
#[test]
fn a_wrong_owner_on_load_is_caught_for_gqa() {
    for order in ORDERS {
        let mut setup = Setup::new(ModelShape::GQA_DEFAULT, 16, 4);
        setup.fault = Some(Fault::PlainAllocOnLoad);
        let mut c = build(&setup, order);
        let s = reload(&mut c, 16);
        assert!(s.mismatched_tokens > 0, "{order:?}: {s:?}");
        assert!(s.mismatched_tokens <= s.host_hit_tokens, "{order:?}: {s:?}");
        assert!(c.check_invariants().is_err(), "{order:?}");
    }
}
