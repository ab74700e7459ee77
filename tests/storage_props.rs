//! Property tests of the page store: key chains, record headers against hostile bytes, and
//! LRU eviction under a byte budget against a simple oracle.

use cp_hicache::kernels::{Deployment, ModelShape};
use cp_hicache::storage::record::{decode, encode, HEADER_BYTES};
use cp_hicache::storage::{DirStore, Fingerprint, Lookup, PageStore, RecordKey};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

fn fp(layers: u32) -> Fingerprint {
    Fingerprint::of(
        &Deployment::new(ModelShape::MlaBf16, 16, 2).unwrap(),
        layers,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// A page's key depends on every token up to and including it, and on nothing after:
    /// the keys of a prefix are a prefix of the keys; changing token t changes exactly the
    /// keys of pages t / ps onwards; another deployment shares no key.
    #[test]
    fn keys_chain_the_prefix(tokens in prop::collection::vec(0u32..50, 0..200),
                             ps in 1u32..20, at in any::<prop::sample::Index>(), by in 1u32..9) {
        let f = fp(2);
        let keys = RecordKey::chain(&f, &tokens, ps);
        prop_assert_eq!(keys.len(), tokens.len() / ps as usize);
        let cut = tokens.len() / 2;
        let head = RecordKey::chain(&f, &tokens[..cut], ps);
        prop_assert_eq!(&keys[..head.len()], &head[..]);
        let mut grown = head.clone();
        RecordKey::extend_chain(&mut grown, &f, &tokens[head.len() * ps as usize..], ps);
        prop_assert_eq!(&grown, &keys);
        if !tokens.is_empty() {
            let t = at.index(tokens.len());
            let mut other = tokens.clone();
            other[t] += by;
            let changed = RecordKey::chain(&f, &other, ps);
            for (p, (a, b)) in keys.iter().zip(&changed).enumerate() {
                prop_assert_eq!(a == b, p < t / ps as usize, "page {}", p);
            }
        }
        let theirs = RecordKey::chain(&fp(3), &tokens, ps);
        prop_assert!(keys.iter().zip(&theirs).all(|(a, b)| a != b));
    }

    /// Any bytes decode to a payload or a typed refusal, never a panic; a record decodes to
    /// its payload; every single-byte change of it is refused.
    #[test]
    fn records_refuse_hostile_bytes(garbage in prop::collection::vec(any::<u8>(), 0..300),
                                    payload in prop::collection::vec(any::<u8>(), 0..200),
                                    at in any::<prop::sample::Index>(), flip in 1u8..=255) {
        let (f, key) = (fp(1), RecordKey([7; 16]));
        let n = payload.len() as u64;
        let _ = decode(&garbage, &f, &key, n);
        let mut forged = encode(&f, &key, &payload)[..HEADER_BYTES].to_vec();
        forged.extend_from_slice(&garbage);
        let _ = decode(&forged, &f, &key, garbage.len() as u64);
        let bytes = encode(&f, &key, &payload);
        prop_assert_eq!(decode(&bytes, &f, &key, n).unwrap(), &payload[..]);
        let mut bad = bytes.clone();
        let i = at.index(bad.len());
        bad[i] ^= flip;
        prop_assert!(decode(&bad, &f, &key, n).is_err(), "byte {} ^ {:#x} accepted", i, flip);
        prop_assert!(decode(&bytes[..bytes.len() - 1], &f, &key, n).is_err());
        prop_assert!(decode(&bytes, &f, &RecordKey([8; 16]), n).is_err());
        prop_assert!(decode(&bytes, &fp(2), &key, n).is_err());
    }
}

#[derive(Clone, Debug)]
enum Op {
    Put(u8),
    Get(u8),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![(0u8..12).prop_map(Op::Put), (0u8..12).prop_map(Op::Get)],
        1..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Under a budget of `cap` records, the store holds exactly what an LRU of `cap` entries
    /// holds (a put or a hit is a use; the record just written is never evicted).
    #[test]
    fn eviction_is_lru_under_the_byte_budget(ops in ops(), cap in 1u64..6) {
        let dir = tempfile::tempdir().unwrap();
        let n = 512u64;
        let rec = HEADER_BYTES as u64 + n;
        let tick = Arc::new(AtomicU64::new(1));
        let t = tick.clone();
        let clock = Box::new(move || {
            SystemTime::UNIX_EPOCH + Duration::from_secs(t.fetch_add(1, Ordering::Relaxed))
        });
        // Half a record over the budget: the budget is bytes, not records.
        let s = DirStore::with_clock(dir.path(), fp(1), n, cap * rec + rec / 2, clock).unwrap();
        let mut oracle: BTreeMap<u8, u64> = BTreeMap::new();
        let mut now = 0u64;
        for op in ops {
            now += 1;
            match op {
                Op::Put(k) => {
                    s.put(&RecordKey([k; 16]), &vec![k; n as usize]).unwrap();
                    oracle.insert(k, now);
                    while oracle.len() as u64 > cap {
                        let (&old, _) = oracle.iter().filter(|(&o, _)| o != k)
                            .min_by_key(|(_, &t)| t).unwrap();
                        oracle.remove(&old);
                    }
                }
                Op::Get(k) => {
                    let got = s.get(&RecordKey([k; 16])).unwrap();
                    match oracle.get_mut(&k) {
                        Some(t) => {
                            prop_assert_eq!(got, Lookup::Hit(vec![k; n as usize]));
                            *t = now;
                        }
                        None => prop_assert_eq!(got, Lookup::Miss),
                    }
                }
            }
            prop_assert_eq!(s.usage().unwrap(), oracle.len() as u64 * rec);
        }
    }
}
