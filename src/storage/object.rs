//! A page store over a key-value object store of another engine's (Mooncake Store): the
//! records are the bytes [`DirStore`](super::DirStore) writes (header, checksum, canonical
//! key), one object per record, so a record is refused on any mismatch whatever store it
//! came from. The engine only moves bytes ([`ObjectBackend`]); every check is here.
//!
//! Objects are named `cp-hicache/<key hex>` (a record) and
//! `cp-hicache/<key hex>/part-<i>-of-<n>` (a part of one written in parts). One writer per
//! record: a put of a name that is there already writes nothing (the backend's
//! put-if-absent), so the first whole record stays. A record written in parts is assembled
//! by the writer whose part completes the set (it sees every part present), without a
//! shared lock: two writers that both see the set complete both assemble the same bytes,
//! and the put-if-absent keeps one. Leases, eviction and capacity are the engine's.

use super::record::{self, HEADER_BYTES};
use super::{
    Assemble, Fingerprint, Lookup, PageStore, PartPut, Put, RecordError, RecordKey, Refusal,
    StorageError, StoreStats,
};
use std::sync::atomic::{AtomicU64, Ordering};

/// What a store of objects must do for [`ObjectStore`]: put, get, test and remove whole
/// objects by name. Every call may run beside other processes using the same store.
pub trait ObjectBackend: Send + Sync {
    /// Stores `bytes` as object `name` unless one of that name is there: `true` when written,
    /// `false` when it was there already (nothing written).
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError>;
    /// Object `name`'s bytes, `None` when there is none.
    fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError>;
    /// Whether each of `names` is there.
    fn exist(&self, names: &[String]) -> Result<Vec<bool>, StorageError>;
    /// Removes object `name` (nothing when there is none).
    fn remove(&self, name: &str) -> Result<(), StorageError>;
    /// Bytes the store holds, as far as this client can tell (0 when it cannot).
    fn usage(&self) -> Result<u64, StorageError> {
        Ok(0)
    }
}

#[derive(Default)]
struct Counters {
    records_written: AtomicU64,
    bytes_written: AtomicU64,
    already_present: AtomicU64,
    records_read: AtomicU64,
    bytes_read: AtomicU64,
    misses: AtomicU64,
    refused_torn: AtomicU64,
    refused_checksum: AtomicU64,
    refused_fingerprint: AtomicU64,
}

/// A [`PageStore`] whose records are objects of a [`ObjectBackend`].
pub struct ObjectStore<B> {
    backend: B,
    fp: Fingerprint,
    payload_bytes: u64,
    stats: Counters,
}

/// The object name of `key`'s record.
pub fn object_name(key: &RecordKey) -> String {
    format!("cp-hicache/{}", key.hex())
}

fn part_name(key: &RecordKey, part: u32, parts: u32) -> String {
    format!("cp-hicache/{}/part-{part}-of-{parts}", key.hex())
}

impl<B: ObjectBackend> ObjectStore<B> {
    /// A store of records of `fp` with `payload_bytes`-byte payloads in `backend`.
    pub fn new(backend: B, fp: Fingerprint, payload_bytes: u64) -> Result<Self, StorageError> {
        if payload_bytes == 0 {
            return Err(StorageError::Config(
                "payload_bytes must be positive".into(),
            ));
        }
        Ok(ObjectStore {
            backend,
            fp,
            payload_bytes,
            stats: Counters::default(),
        })
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The key a part's own header carries (as [`DirStore`](super::DirStore)'s parts), so a
    /// part filed under another record, or as another part, is refused.
    fn part_key(&self, key: &RecordKey, part: u32, parts: u32) -> RecordKey {
        RecordKey::of_name(&self.fp, &format!("{}/part {part} of {parts}", key.hex()))
    }

    fn refused(&self, why: &RecordError) {
        let c = match why.refusal() {
            Refusal::Torn => &self.stats.refused_torn,
            Refusal::Fingerprint => &self.stats.refused_fingerprint,
            Refusal::Checksum => &self.stats.refused_checksum,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A part's payload, checked against its header; `None` when missing.
    fn read_part(
        &self,
        key: &RecordKey,
        part: u32,
        parts: u32,
    ) -> Result<Option<Result<Vec<u8>, RecordError>>, StorageError> {
        let Some(bytes) = self.backend.get(&part_name(key, part, parts))? else {
            return Ok(None);
        };
        let pk = self.part_key(key, part, parts);
        let head = bytes.get(..HEADER_BYTES).ok_or(RecordError::Torn {
            have: bytes.len() as u64,
            want: HEADER_BYTES as u64,
        });
        let checked = head.and_then(|head| {
            // A part is at most a page: its header's length is checked against its own.
            let len = u64::from_le_bytes(head[48..56].try_into().expect("8 bytes"));
            if len == 0 || len > self.payload_bytes {
                return Err(RecordError::Length {
                    have: len,
                    want: self.payload_bytes,
                });
            }
            record::decode(&bytes, &self.fp, &pk, len).map(<[u8]>::to_vec)
        });
        Ok(Some(checked))
    }
}

impl<B: ObjectBackend> PageStore for ObjectStore<B> {
    fn fingerprint(&self) -> &Fingerprint {
        &self.fp
    }

    fn payload_bytes(&self) -> u64 {
        self.payload_bytes
    }

    fn put(&self, key: &RecordKey, payload: &[u8]) -> Result<Put, StorageError> {
        super::check_payload(key, payload, self.payload_bytes)?;
        let name = object_name(key);
        if self.backend.exist(std::slice::from_ref(&name))? == [true] {
            self.stats.already_present.fetch_add(1, Ordering::Relaxed);
            return Ok(Put::Present);
        }
        let bytes = record::encode(&self.fp, key, payload);
        if self.backend.put_if_absent(&name, &bytes)? {
            self.stats.records_written.fetch_add(1, Ordering::Relaxed);
            self.stats
                .bytes_written
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            Ok(Put::Written { evicted: 0 })
        } else {
            self.stats.already_present.fetch_add(1, Ordering::Relaxed);
            Ok(Put::Present)
        }
    }

    fn put_part(
        &self,
        key: &RecordKey,
        part: u32,
        parts: u32,
        payload: &[u8],
        assemble: Assemble<'_>,
    ) -> Result<PartPut, StorageError> {
        super::check_part(key, part, parts, payload, self.payload_bytes)?;
        let whole = object_name(key);
        if self.backend.exist(std::slice::from_ref(&whole))? == [true] {
            self.stats.already_present.fetch_add(1, Ordering::Relaxed);
            return Ok(PartPut::Present);
        }
        let pk = self.part_key(key, part, parts);
        let bytes = record::encode(&self.fp, &pk, payload);
        self.backend
            .put_if_absent(&part_name(key, part, parts), &bytes)?;
        // The writer that sees every part there assembles the record.
        let names: Vec<String> = (0..parts).map(|p| part_name(key, p, parts)).collect();
        if self.backend.exist(&names)?.iter().any(|&e| !e) {
            return Ok(PartPut::Held);
        }
        let mut all = Vec::with_capacity(parts as usize);
        for p in 0..parts {
            match self.read_part(key, p, parts)? {
                // Taken meanwhile by another writer that assembled it.
                None => return Ok(PartPut::Held),
                Some(Err(why)) => {
                    // A damaged part: removed, so the next writers start it again.
                    self.refused(&why);
                    let _ = self.backend.remove(&names[p as usize]);
                    return Ok(PartPut::Held);
                }
                Some(Ok(b)) => all.push(b),
            }
        }
        let Some(payload) = assemble(&all) else {
            let sizes: Vec<usize> = all.iter().map(Vec::len).collect();
            return Err(StorageError::Config(format!(
                "the parts of record {key} ({sizes:?} bytes) are not of this layout's sizes: \
                 two layouts write parts of one record"
            )));
        };
        let put = self.put(key, &payload)?;
        for n in &names {
            let _ = self.backend.remove(n);
        }
        Ok(match put {
            Put::Written { evicted } => PartPut::Completed { evicted },
            Put::Present => PartPut::Present,
        })
    }

    fn get(&self, key: &RecordKey) -> Result<Lookup, StorageError> {
        let Some(bytes) = self.backend.get(&object_name(key))? else {
            self.stats.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(Lookup::Miss);
        };
        match record::decode(&bytes, &self.fp, key, self.payload_bytes) {
            Ok(payload) => {
                self.stats.records_read.fetch_add(1, Ordering::Relaxed);
                self.stats
                    .bytes_read
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                Ok(Lookup::Hit(payload.to_vec()))
            }
            Err(why) => {
                self.refused(&why);
                // Removed, so the record can be written again.
                let _ = self.backend.remove(&object_name(key));
                Ok(Lookup::Refused(why))
            }
        }
    }

    fn present_run(&self, keys: &[RecordKey]) -> Result<usize, StorageError> {
        if keys.is_empty() {
            return Ok(0);
        }
        let names: Vec<String> = keys.iter().map(object_name).collect();
        let there = self.backend.exist(&names)?;
        Ok(there.iter().position(|&e| !e).unwrap_or(keys.len()))
    }

    fn stats(&self) -> StoreStats {
        let s = &self.stats;
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        StoreStats {
            records_written: g(&s.records_written),
            bytes_written: g(&s.bytes_written),
            already_present: g(&s.already_present),
            records_read: g(&s.records_read),
            bytes_read: g(&s.bytes_read),
            misses: g(&s.misses),
            refused_torn: g(&s.refused_torn),
            refused_checksum: g(&s.refused_checksum),
            refused_fingerprint: g(&s.refused_fingerprint),
            evictions: 0,
            evicted_bytes: 0,
        }
    }

    fn usage(&self) -> Result<u64, StorageError> {
        self.backend.usage()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Mem(Mutex<HashMap<String, Vec<u8>>>);

    impl ObjectBackend for Mem {
        fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError> {
            let mut m = self.0.lock().unwrap();
            if m.contains_key(name) {
                return Ok(false);
            }
            m.insert(name.to_string(), bytes.to_vec());
            Ok(true)
        }
        fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
            Ok(self.0.lock().unwrap().get(name).cloned())
        }
        fn exist(&self, names: &[String]) -> Result<Vec<bool>, StorageError> {
            let m = self.0.lock().unwrap();
            Ok(names.iter().map(|n| m.contains_key(n)).collect())
        }
        fn remove(&self, name: &str) -> Result<(), StorageError> {
            self.0.lock().unwrap().remove(name);
            Ok(())
        }
    }

    fn store() -> ObjectStore<Mem> {
        ObjectStore::new(Mem::default(), Fingerprint::named("test"), 8).unwrap()
    }

    #[test]
    fn records_round_trip_and_damage_is_refused_and_counted() {
        let s = store();
        let fp = s.fingerprint().clone();
        let keys = RecordKey::chain(&fp, &[1, 2, 3, 4, 5, 6], 2);
        assert_eq!(
            s.put(&keys[0], b"abcdefgh").unwrap(),
            Put::Written { evicted: 0 }
        );
        assert_eq!(s.put(&keys[0], b"zzzzzzzz").unwrap(), Put::Present);
        assert_eq!(s.get(&keys[0]).unwrap(), Lookup::Hit(b"abcdefgh".to_vec()));
        assert_eq!(s.get(&keys[1]).unwrap(), Lookup::Miss);
        assert_eq!(s.present_run(&keys).unwrap(), 1);
        // The same bytes DirStore writes.
        let raw = s.backend().get(&object_name(&keys[0])).unwrap().unwrap();
        assert_eq!(raw, record::encode(&fp, &keys[0], b"abcdefgh"));
        // Wrong bytes under a key: refused, counted, removed.
        s.backend()
            .put_if_absent(&object_name(&keys[1]), b"junk")
            .unwrap();
        let mut flipped = record::encode(&fp, &keys[2], b"12345678");
        flipped[70] ^= 1;
        s.backend()
            .put_if_absent(&object_name(&keys[2]), &flipped)
            .unwrap();
        assert!(matches!(s.get(&keys[1]).unwrap(), Lookup::Refused(_)));
        assert!(matches!(
            s.get(&keys[2]).unwrap(),
            Lookup::Refused(RecordError::Checksum { .. })
        ));
        // A record filed under another key.
        s.backend()
            .put_if_absent(&object_name(&keys[1]), &raw)
            .unwrap();
        assert!(matches!(
            s.get(&keys[1]).unwrap(),
            Lookup::Refused(RecordError::Key { .. })
        ));
        let st = s.stats();
        assert_eq!((st.refused_torn, st.refused_checksum), (1, 2));
        assert_eq!((st.records_written, st.records_read, st.misses), (1, 1, 1));
    }

    #[test]
    fn the_last_part_assembles_the_record() {
        let s = store();
        let key = RecordKey::chain(s.fingerprint(), &[9, 9], 2)[0];
        let cat: Assemble<'_> = &|all: &[Vec<u8>]| Some(all.concat());
        assert_eq!(s.put_part(&key, 1, 2, b"efgh", cat).unwrap(), PartPut::Held);
        assert_eq!(s.get(&key).unwrap(), Lookup::Miss);
        assert_eq!(
            s.put_part(&key, 0, 2, b"abcd", cat).unwrap(),
            PartPut::Completed { evicted: 0 }
        );
        assert_eq!(s.get(&key).unwrap(), Lookup::Hit(b"abcdefgh".to_vec()));
        assert_eq!(s.backend().0.lock().unwrap().len(), 1, "the parts are gone");
        assert_eq!(
            s.put_part(&key, 0, 2, b"abcd", cat).unwrap(),
            PartPut::Present
        );
    }
}
