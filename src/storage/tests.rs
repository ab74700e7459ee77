use super::*;
use crate::kernels::{Deployment, ModelShape};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

fn fp(layers: u32) -> Fingerprint {
    Fingerprint::of(
        &Deployment::new(ModelShape::MlaBf16, 16, 4).unwrap(),
        layers,
    )
}

/// A clock that moves one second per call, so every use has its own time.
fn ticking() -> (Clock, Arc<AtomicU64>) {
    let t = Arc::new(AtomicU64::new(1));
    let c = t.clone();
    (
        Box::new(move || {
            SystemTime::UNIX_EPOCH + Duration::from_secs(c.fetch_add(1, Ordering::Relaxed))
        }),
        t,
    )
}

fn payload(seed: u8, n: u64) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31) ^ seed).collect()
}

#[test]
fn the_fingerprint_leaves_out_the_topology_but_not_the_bytes() {
    let a = Fingerprint::of(&Deployment::new(ModelShape::MlaBf16, 16, 4).unwrap(), 2);
    for cp in [1u8, 2, 8] {
        let mut d = Deployment::new(ModelShape::MlaBf16, 16, cp).unwrap();
        d.layout = crate::layout::Layout::PageInterleave;
        assert_eq!(Fingerprint::of(&d, 2), a, "cp {cp}");
    }
    assert_ne!(
        Fingerprint::of(&Deployment::new(ModelShape::MlaBf16, 16, 4).unwrap(), 3),
        a
    );
    assert_ne!(
        Fingerprint::of(&Deployment::new(ModelShape::MlaBf16, 32, 4).unwrap(), 2),
        a
    );
    assert_ne!(
        Fingerprint::of(&Deployment::new(ModelShape::Nsa, 64, 4).unwrap(), 2),
        a
    );
    assert!(
        a.describe().contains("mla_kv:1152B/token"),
        "{}",
        a.describe()
    );
    // GQA shapes differ from each other even at the same bytes per token (8 × 128 and
    // 16 × 64 heads both have 4096): a record of one shard shape is not another's.
    let gqa = |kv_heads, head_dim| {
        Fingerprint::of(
            &Deployment::new(ModelShape::Gqa { kv_heads, head_dim }, 16, 4).unwrap(),
            2,
        )
    };
    assert_ne!(gqa(8, 128), gqa(16, 64));
    assert_ne!(gqa(8, 128), gqa(4, 128));
    assert_ne!(gqa(8, 128), a);
    assert_eq!(gqa(8, 128), gqa(8, 128));
    assert!(
        gqa(8, 128)
            .describe()
            .contains("model=gqa8x128;layers=2;page_size=16;buffers=gqa8x128_kv:4096B/token:PageOrganised:bf16x1024+bf16x1024"),
        "{}",
        gqa(8, 128).describe()
    );
}

/// A GQA deployment's TP head shard is in the fingerprint only when the model is split: an
/// unsplit deployment's fingerprint is the one every store written before shards were
/// named carries (its SHA-256 worked out apart from this code), and two shards of one
/// split differ from each other and from the unsplit shape.
#[test]
fn the_fingerprint_names_the_tp_shard_of_a_split_model_only() {
    use crate::kernels::TpShard;
    let gqa = Deployment::new(ModelShape::GQA_DEFAULT, 16, 4).unwrap();
    let shard = |rank, size| {
        Fingerprint::of(
            &gqa.clone()
                .with_tp(TpShard::new(rank, size).unwrap())
                .unwrap(),
            2,
        )
    };
    let whole = Fingerprint::of(&gqa, 2);
    assert_eq!(whole.to_string(), "4bc286bb6c74ac01b78a254396f73217");
    assert_eq!(shard(0, 1), whole);
    assert_eq!(shard(1, 2).to_string(), "368bbcaa6758b215af53e6c0e8f19d7d");
    assert!(
        shard(1, 2)
            .describe()
            .starts_with("model=gqa8x128;tp=1/2;layers=2;"),
        "{}",
        shard(1, 2).describe()
    );
    assert_ne!(shard(0, 2), shard(1, 2));
    assert_ne!(shard(0, 2), whole);
    assert_ne!(shard(0, 2), shard(0, 4));
    // Keys are salted with the fingerprint: the shards' records of one prompt never share
    // a name.
    let tokens: Vec<u32> = (0..64).collect();
    let a = RecordKey::chain(&shard(0, 2), &tokens, 16);
    let b = RecordKey::chain(&shard(1, 2), &tokens, 16);
    assert!(a.iter().all(|k| !b.contains(k)));
}

#[test]
fn a_store_round_trips_records_and_refuses_bad_ones_as_misses() {
    let dir = tempfile::tempdir().unwrap();
    let n = 3 * 1152 * 16;
    let s = DirStore::open(dir.path(), fp(3), n, 1 << 30).unwrap();
    let keys = RecordKey::chain(s.fingerprint(), &(0..64).collect::<Vec<u32>>(), 16);
    assert_eq!(keys.len(), 4);
    assert_eq!(s.present_run(&keys).unwrap(), 0);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(
            s.put(k, &payload(i as u8, n)).unwrap(),
            Put::Written { evicted: 0 }
        );
    }
    assert_eq!(s.put(&keys[0], &payload(0, n)).unwrap(), Put::Present);
    assert_eq!(s.present_run(&keys).unwrap(), 4);
    for (i, k) in keys.iter().enumerate() {
        assert_eq!(s.get(k).unwrap(), Lookup::Hit(payload(i as u8, n)));
    }
    assert_eq!(s.usage().unwrap(), 4 * s.record_bytes());
    // A flipped byte, a torn record, another deployment's record: each refused and gone.
    let path = s.path_of(&keys[1]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    assert!(matches!(
        s.get(&keys[1]).unwrap(),
        Lookup::Refused(RecordError::Checksum { .. })
    ));
    assert_eq!(s.get(&keys[1]).unwrap(), Lookup::Miss);
    let path = s.path_of(&keys[2]);
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        s.get(&keys[2]).unwrap(),
        Lookup::Refused(RecordError::Torn { .. })
    ));
    let other = record::encode(&fp(4), &keys[3], &payload(3, n));
    std::fs::write(s.path_of(&keys[3]), other).unwrap();
    assert!(matches!(
        s.get(&keys[3]).unwrap(),
        Lookup::Refused(RecordError::Fingerprint { .. })
    ));
    assert_eq!(s.present_run(&keys).unwrap(), 1);
    let st = s.stats();
    assert_eq!(
        (st.refused_checksum, st.refused_torn, st.refused_fingerprint),
        (1, 1, 1)
    );
    assert_eq!((st.records_written, st.already_present), (4, 1));
    // A wrong payload size is the caller's error, not a record.
    assert!(matches!(
        s.put(&keys[1], &[0u8; 3]),
        Err(StorageError::Config(_))
    ));
}

#[test]
fn the_budget_evicts_the_least_recently_used_records() {
    let dir = tempfile::tempdir().unwrap();
    let n = 4096u64;
    let (clock, _) = ticking();
    let rec = record::HEADER_BYTES as u64 + n;
    let s = DirStore::with_clock(dir.path(), fp(1), n, 3 * rec, clock).unwrap();
    let keys: Vec<RecordKey> = (0..5u8).map(|i| RecordKey([i; 16])).collect();
    for k in &keys[..3] {
        s.put(k, &payload(k.0[0], n)).unwrap();
    }
    // Key 0 is used again, so key 1 is the least recently used when key 3 arrives.
    assert!(matches!(s.get(&keys[0]).unwrap(), Lookup::Hit(_)));
    s.put(&keys[3], &payload(3, n)).unwrap();
    assert_eq!(s.get(&keys[1]).unwrap(), Lookup::Miss);
    for k in [0, 2, 3] {
        assert!(
            matches!(s.get(&keys[k]).unwrap(), Lookup::Hit(_)),
            "key {k}"
        );
    }
    assert_eq!(s.usage().unwrap(), 3 * rec);
    assert_eq!(s.stats().evictions, 1);
    // A store reopened with a smaller budget keeps to it, the most recently used first.
    drop(s);
    let (clock, _) = ticking();
    let s = DirStore::with_clock(dir.path(), fp(1), n, rec, clock).unwrap();
    assert_eq!(s.usage().unwrap(), rec);
    assert!(matches!(s.get(&keys[3]).unwrap(), Lookup::Hit(_)));
    assert!(DirStore::open(dir.path(), fp(1), n, rec - 1).is_err());
}

/// Several stores (as processes would) writing the same records into one directory at once:
/// every record reads back whole, and the budget holds.
#[test]
fn concurrent_writers_leave_whole_records_within_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let n = 8192u64;
    let rec = record::HEADER_BYTES as u64 + n;
    let budget = 40 * rec;
    let keys: Vec<RecordKey> = (0..64u8).map(|i| RecordKey([i; 16])).collect();
    std::thread::scope(|s| {
        for w in 0..4 {
            let (dir, keys) = (dir.path(), &keys);
            s.spawn(move || {
                let st = DirStore::open(dir, fp(1), n, budget).unwrap();
                for i in 0..keys.len() {
                    let k = &keys[(i * 7 + w * 13) % keys.len()];
                    st.put(k, &payload(k.0[0], n)).unwrap();
                    if let Lookup::Refused(why) = st.get(k).unwrap() {
                        panic!("writer {w}: {why}");
                    }
                }
            });
        }
    });
    let s = DirStore::open(dir.path(), fp(1), n, budget).unwrap();
    let mut present = 0;
    for k in &keys {
        match s.get(k).unwrap() {
            Lookup::Hit(p) => {
                assert_eq!(p, payload(k.0[0], n));
                present += 1;
            }
            Lookup::Miss => {}
            Lookup::Refused(why) => panic!("{k}: {why}"),
        }
    }
    assert!(present > 0 && present as u64 * rec <= budget, "{present}");
    assert!(s.usage().unwrap() <= budget);
    assert_eq!(
        std::fs::read_dir(dir.path().join("tmp"))
            .unwrap()
            .filter(|e| {
                !e.as_ref()
                    .unwrap()
                    .file_name()
                    .to_string_lossy()
                    .starts_with("FINGERPRINT")
            })
            .count(),
        0,
        "nothing left aside"
    );
}

/// A directory holds one deployment's records: opening it for another is refused, naming
/// both, and changes nothing; the same deployment opens it again.
#[test]
fn a_store_of_another_deployment_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let n = 2 * 1152 * 16;
    drop(DirStore::open(dir.path(), fp(2), n, 1 << 30).unwrap());
    let err = DirStore::open(dir.path(), fp(3), 3 * 1152 * 16, 1 << 30)
        .err()
        .expect("another deployment's store");
    let msg = err.to_string();
    assert!(
        msg.contains("layers=2") && msg.contains("layers=3"),
        "{msg}"
    );
    DirStore::open(dir.path(), fp(2), n, 1 << 30).unwrap();
}

/// Damage that cannot apply (a record shorter than its header) and a bench of no records
/// are errors or no-ops, never a panic or a NaN.
#[test]
fn degenerate_damage_and_benches_are_refused_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let dep = Deployment::new(ModelShape::MlaBf16, 16, 4).unwrap();
    let err = bench_store(dir.path(), &dep, 2, 0, 1, &|| {}).unwrap_err();
    assert!(err.to_string().contains("at least one record"), "{err}");

    let n = 2 * 1152 * 16;
    let inner = DirStore::open(&dir.path().join("s"), fp(2), n, 1 << 30).unwrap();
    let key = RecordKey::of_name(inner.fingerprint(), "short");
    let path = inner.path_of(&key);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, b"tiny").unwrap();
    let store = DamagingStore::new(inner, Damage::Flip, 1);
    assert!(matches!(store.get(&key).unwrap(), Lookup::Refused(_)));
}

/// A record written in parts is visible only when its last part comes, assembled once; a
/// record with a part missing reads as incomplete; a damaged part is refused.
#[test]
fn records_in_parts_appear_whole_when_the_last_part_comes() {
    let dir = tempfile::tempdir().unwrap();
    let n = 2 * 1152 * 16;
    let store = DirStore::open(dir.path(), fp(2), n, 1 << 30).unwrap();
    let key = RecordKey::of_name(store.fingerprint(), "split");
    let halves = [payload(1, n / 2), payload(2, n / 2)];
    let join = |parts: &[Vec<u8>]| (parts.len() == 2).then(|| parts.concat());
    assert_eq!(
        store.put_part(&key, 1, 2, &halves[1], &join).unwrap(),
        PartPut::Held
    );
    match store.get(&key).unwrap() {
        Lookup::Refused(RecordError::Incomplete { have: 1, parts: 2 }) => {}
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        store.put_part(&key, 0, 2, &halves[0], &join).unwrap(),
        PartPut::Completed { .. }
    ));
    assert_eq!(store.get(&key).unwrap(), Lookup::Hit(halves.concat()));
    assert!(!store.parts_dir(&key).exists());
    // A part of a record already whole is dropped.
    assert_eq!(
        store.put_part(&key, 0, 2, &halves[0], &join).unwrap(),
        PartPut::Present
    );
    // A damaged part: the record is not assembled, its parts go.
    let other = RecordKey::of_name(store.fingerprint(), "damaged");
    store.put_part(&other, 0, 2, &halves[0], &join).unwrap();
    let part = store.parts_dir(&other).join("0-of-2");
    let mut bytes = std::fs::read(&part).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&part, bytes).unwrap();
    assert_eq!(
        store.put_part(&other, 1, 2, &halves[1], &join).unwrap(),
        PartPut::Held
    );
    assert_eq!(store.get(&other).unwrap(), Lookup::Miss);
    assert_eq!(store.stats().refused_checksum, 1);
    // Bad part numbers and sizes are errors.
    assert!(store.put_part(&other, 2, 2, &halves[0], &join).is_err());
    assert!(store.put_part(&other, 0, 2, &[], &join).is_err());
}

#[test]
fn the_checksum_is_xxh3_64_of_the_header_then_the_payload() {
    // Pinned values (XXH3-64, seed 0, of the first 56 bytes then the rest): records written
    // by an earlier build stay readable only while this holds.
    for (n, want) in [
        (0usize, 0xba33_3141_c191_15a1u64),
        (1000, 0xea3c_3c3d_bff2_49ab),
        (73_792, 0x8ec0_01d5_4de0_1cba),
    ] {
        let b: Vec<u8> = (0..n + 56)
            .map(|j| (j as u32).wrapping_mul(2_654_435_761) as u8)
            .collect();
        assert_eq!(record::checksum(&b[..56], &b[56..]), want, "{n} bytes");
    }
}

/// A record encoded in one pass (copy and checksum together, into a reused buffer) is the
/// same bytes as one encoded in two, at every size around the pass's pieces, and decodes.
#[test]
fn a_record_encoded_in_one_pass_is_the_same_bytes() {
    let (f, key) = (fp(2), RecordKey::chain(&fp(2), &[5, 6], 2)[0]);
    let mut out = vec![0xAB; 3 << 20];
    for n in [
        1u64,
        100,
        (16 << 10) - 1,
        16 << 10,
        (16 << 10) + 1,
        1 << 20,
        (1 << 20) + 7,
    ] {
        let p = payload(n as u8, n);
        record::encode_into(&f, &key, &p, &mut out);
        assert_eq!(out, record::encode(&f, &key, &p), "{n} bytes");
        assert_eq!(
            record::decode(&out, &f, &key, n).unwrap(),
            &p[..],
            "{n} bytes"
        );
    }
}
