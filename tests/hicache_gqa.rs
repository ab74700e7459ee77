//! The GQA deployment kind through the whole cache, on the host executor in both block
//! orders: its K and V pages are synthesised on their owners, backed up to the host tier,
//! loaded back on a hit and verified byte for byte (0 mismatched tokens), and under the
//! seed's bug (a plain allocator on load) the owners' unwritten, poisoned slots are read and
//! verification catches the wrong owner. Two TP head shards of one model sharing a store
//! are each served only their own records, and a record of the other shard is refused by
//! its fingerprint and, were that bypassed, caught by verification.

mod hicache_support;

use cp_hicache::cluster::{Cluster, ClusterConfig, Fault, RequestStats, WritePolicy};
use cp_hicache::exec::BlockOrder;
use cp_hicache::jit::Sanitize;
use cp_hicache::kernels::{BufferKind, Deployment, ModelShape, TpShard, TransferPath};
use cp_hicache::rank::StoragePolicy;
use cp_hicache::storage::{
    object_name, payload_bytes, record, DirStore, Fingerprint, MemObjects, ObjectStore, PageStore,
    RecordKey, StorageError,
};
use hicache_support::{evict_all, host_executor, jit, serve_checked, tokens, Setup};
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

/// A shared in-memory object store (Mooncake Store's shape: one store for every rank of
/// every TP shard, no directory of a shard's own).
type SharedObjects = MemObjects;

const TP_PAGE: u32 = 16;
const TP_LAYERS: u32 = 2;

/// GQA 2 × 64 at page 16, CP 2, holding TP head shard `rank` of 2.
fn tp_deployment(rank: u16) -> Deployment {
    Deployment::new(
        ModelShape::Gqa {
            kv_heads: 2,
            head_dim: 64,
        },
        TP_PAGE,
        2,
    )
    .unwrap()
    .with_tp(TpShard::new(rank, 2).unwrap())
    .unwrap()
}

/// A fresh CP group of TP shard `rank` over `store`, writing to it with every host backup.
fn tp_cluster(rank: u16, store: Arc<dyn PageStore>) -> Cluster {
    let config = ClusterConfig {
        deployment: tp_deployment(rank),
        layers: TP_LAYERS,
        device_pages: 64,
        host_pages: 64,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: Sanitize::None,
    };
    let mut c = Cluster::new(config, Arc::new(host_executor()), &jit()).unwrap();
    c.attach_storage(store, StoragePolicy::WithHost).unwrap();
    c
}

/// Serves `t` and checks what [`serve_checked`] does, with storage hits in the token
/// accounting; mismatches are returned, not asserted.
fn serve_from_store(c: &mut Cluster, t: &[u32]) -> RequestStats {
    let s = c.serve(t).unwrap();
    assert!(c.replicas_agree(), "replicas disagree after {s:?}");
    c.check_invariants().unwrap();
    assert_eq!(
        s.device_hit_tokens + s.host_hit_tokens + s.storage_hit_tokens + s.computed_tokens,
        s.prompt_tokens,
        "{s:?}"
    );
    s
}

/// TP shard `rank`'s view of the shared objects.
fn tp_store(objects: &SharedObjects, rank: u16) -> Arc<ObjectStore<SharedObjects>> {
    let dep = tp_deployment(rank);
    Arc::new(
        ObjectStore::new(
            objects.clone(),
            Fingerprint::of(&dep, TP_LAYERS),
            payload_bytes(&dep, TP_LAYERS),
        )
        .unwrap(),
    )
}

/// Two TP shards of one GQA model (same shard shape, other heads) write one store: each
/// is served only its own records, byte for byte. The second shard finds none of the
/// first's (its keys are salted with a fingerprint naming its shard), computes and writes
/// its own, and fresh groups of either shard then read back exactly their own pages with
/// 0 mismatched tokens. Without the shard in the fingerprint the second shard would have
/// been served the first's heads as a hit.
#[test]
fn two_tp_shards_sharing_a_store_each_read_back_only_their_own_records() {
    let objects = SharedObjects::default();
    let prompt = tokens(43, 8 * TP_PAGE as usize);
    let pages = 8u64;
    let s0 = serve_from_store(&mut tp_cluster(0, tp_store(&objects, 0)), &prompt);
    assert_eq!(
        (s0.storage_records_written, s0.mismatched_tokens),
        (pages, 0),
        "{s0:?}"
    );
    let s1 = serve_from_store(&mut tp_cluster(1, tp_store(&objects, 1)), &prompt);
    assert_eq!(
        (s1.storage_hit_tokens, s1.storage_records_read),
        (0, 0),
        "shard 1 was served shard 0's records: {s1:?}"
    );
    assert_eq!(
        (s1.computed_tokens, s1.mismatched_tokens),
        (prompt.len() as u64, 0),
        "{s1:?}"
    );
    assert_eq!(s1.storage_records_written, pages, "{s1:?}");
    assert_eq!(objects.objects().len() as u64, 2 * pages);
    for rank in [0, 1] {
        let s = serve_from_store(&mut tp_cluster(rank, tp_store(&objects, rank)), &prompt);
        assert_eq!(
            s.storage_hit_tokens,
            prompt.len() as u64,
            "shard {rank}: {s:?}"
        );
        assert_eq!(s.storage_records_read, pages, "shard {rank}: {s:?}");
        assert_eq!(s.storage_refused(), 0, "shard {rank}: {s:?}");
        assert_eq!(s.mismatched_tokens, 0, "shard {rank}: {s:?}");
    }
}

/// The synthesised KV names the TP shard too, so a page of the wrong shard is caught by
/// verification and not only by the fingerprint: shard 0's records placed at shard 1's
/// names are refused as another deployment's (counted), and the same payloads re-sealed
/// under shard 1's fingerprint and keys (a fingerprint check bypassed) pass the store's
/// checks but fail verification on every token they carry.
#[test]
fn a_record_of_the_other_tp_shard_is_refused_and_its_bytes_fail_verification() {
    let objects = SharedObjects::default();
    let prompt = tokens(44, 4 * TP_PAGE as usize);
    let (store0, store1) = (tp_store(&objects, 0), tp_store(&objects, 1));
    let s0 = serve_from_store(&mut tp_cluster(0, store0.clone()), &prompt);
    assert_eq!(
        (s0.storage_records_written, s0.mismatched_tokens),
        (4, 0),
        "{s0:?}"
    );
    let keys0 = RecordKey::chain(store0.fingerprint(), &prompt, TP_PAGE);
    let keys1 = RecordKey::chain(store1.fingerprint(), &prompt, TP_PAGE);
    let theirs: Vec<Vec<u8>> = keys0
        .iter()
        .map(|k| objects.objects()[&object_name(k)].clone())
        .collect();

    // Copied as they are: refused by their fingerprint, counted, recomputed.
    for (k1, bytes) in keys1.iter().zip(&theirs) {
        objects.objects().insert(object_name(k1), bytes.clone());
    }
    let s = serve_from_store(&mut tp_cluster(1, store1.clone()), &prompt);
    assert_eq!(s.storage_hit_tokens, 0, "{s:?}");
    assert!(s.storage_refused_fingerprint > 0, "{s:?}");
    assert_eq!(s.mismatched_tokens, 0, "{s:?}");

    // Re-sealed as shard 1's: served, and every token of them mismatches.
    for ((k0, k1), bytes) in keys0.iter().zip(&keys1).zip(&theirs) {
        let payload = record::decode(
            bytes,
            store0.fingerprint(),
            k0,
            payload_bytes(&tp_deployment(0), TP_LAYERS),
        )
        .unwrap();
        objects.objects().insert(
            object_name(k1),
            record::encode(store1.fingerprint(), k1, payload),
        );
    }
    let s = serve_from_store(&mut tp_cluster(1, store1), &prompt);
    assert_eq!(s.storage_hit_tokens, prompt.len() as u64, "{s:?}");
    assert_eq!(s.storage_refused(), 0, "{s:?}");
    assert_eq!(s.mismatched_tokens, prompt.len() as u64, "{s:?}");
}

/// A store directory holds one deployment's records: shard 1 opening shard 0's directory
/// is refused, naming both shards. The directory's marker is only informational (every
/// record carries its own fingerprint): with it gone, shard 1 opens the directory too, the
/// two shards' records lie side by side, and each shard is served only its own, byte for
/// byte.
#[test]
fn a_tp_shard_s_directory_is_refused_to_the_other_and_records_side_by_side_stay_apart() {
    let dir = tempfile::tempdir().unwrap();
    let open = |rank| {
        DirStore::for_deployment(dir.path(), &tp_deployment(rank), TP_LAYERS, 1 << 30).map(Arc::new)
    };
    let prompt = tokens(45, 4 * TP_PAGE as usize);
    let store0 = open(0).unwrap();
    let s = serve_from_store(&mut tp_cluster(0, store0.clone()), &prompt);
    assert_eq!(
        (s.storage_records_written, s.mismatched_tokens),
        (4, 0),
        "{s:?}"
    );
    match open(1) {
        Err(StorageError::Config(why)) => {
            assert!(why.contains("tp=0/2") && why.contains("tp=1/2"), "{why}")
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("shard 1 opened shard 0's store"),
    }

    std::fs::remove_file(dir.path().join("FINGERPRINT")).unwrap();
    let store1 = open(1).unwrap();
    let s = serve_from_store(&mut tp_cluster(1, store1.clone()), &prompt);
    assert_eq!(
        (s.storage_hit_tokens, s.storage_records_read),
        (0, 0),
        "{s:?}"
    );
    assert_eq!(
        (s.storage_records_written, s.mismatched_tokens),
        (4, 0),
        "{s:?}"
    );
    let records = walk(&dir.path().join("records"))
        .filter(|p| p.extension().is_some_and(|e| e == "rec"))
        .count();
    assert_eq!(records, 8);
    for (rank, store) in [(0, store0), (1, store1)] {
        let s = serve_from_store(&mut tp_cluster(rank, store), &prompt);
        assert_eq!(
            s.storage_hit_tokens,
            prompt.len() as u64,
            "shard {rank}: {s:?}"
        );
        assert_eq!(s.storage_records_read, 4, "shard {rank}: {s:?}");
        assert_eq!(s.storage_refused(), 0, "shard {rank}: {s:?}");
        assert_eq!(s.mismatched_tokens, 0, "shard {rank}: {s:?}");
    }
}

/// Every file below `dir`.
fn walk(dir: &std::path::Path) -> impl Iterator<Item = std::path::PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .flat_map(|e| {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p).collect::<Vec<_>>()
            } else {
                vec![p]
            }
        })
        .collect::<Vec<_>>()
        .into_iter()
}
