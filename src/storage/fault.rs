//! Damage done to a [`DirStore`]'s records on purpose (`replay --inject storage-*`), to show
//! that every kind is refused and counted, served as a miss, and that verification still
//! catches a wrong record that got past the store's own checks.

use super::record::{self, HEADER_BYTES};
use super::{
    Assemble, DirStore, Fingerprint, Lookup, PageStore, PartPut, Put, RecordKey, StorageError,
    StoreStats,
};
use std::fs;
use std::sync::atomic::{AtomicU64, Ordering};

/// What is done to a record just before it is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Damage {
    /// Cut to half its length, as a record whose writer's machine lost power before its
    /// bytes reached the disk (a writer killed mid-record leaves only a file aside).
    Torn,
    /// One payload byte flipped (bit rot, a bad transfer).
    Flip,
    /// Replaced by a whole, well-formed record of another deployment under the same key.
    Foreign,
    /// One payload byte changed after the store's checks passed, as a store that skipped
    /// its checksum would serve it: only verification can catch this one.
    Unchecked,
    /// Replaced by all but one of the parts it would be written in, as when one rank of a
    /// layout that splits pages across ranks died before writing its part: refused as
    /// incomplete (counted as torn).
    PartMissing,
    /// The read (and one write in `every`) fails with an I/O error, as on a full disk or a
    /// lost mount: the rank serves it as a miss (or leaves the record out) and goes on.
    Io,
}

/// A [`DirStore`] that damages one record read in `every` (the first read included) as
/// `damage` says. Everything else is the store's own behaviour.
pub struct DamagingStore {
    inner: DirStore,
    damage: Damage,
    every: u64,
    reads: AtomicU64,
    writes: AtomicU64,
    damaged: AtomicU64,
}

impl DamagingStore {
    /// Damages one record read in `every` of `inner`.
    pub fn new(inner: DirStore, damage: Damage, every: u64) -> DamagingStore {
        DamagingStore {
            inner,
            damage,
            every: every.max(1),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            damaged: AtomicU64::new(0),
        }
    }

    /// Records damaged so far.
    pub fn damaged(&self) -> u64 {
        self.damaged.load(Ordering::Relaxed)
    }

    /// Damages the record of `key` on disk, if there is one; whether it did.
    fn damage_on_disk(&self, key: &RecordKey) -> Result<bool, StorageError> {
        let path = self.inner.path_of(key);
        let Ok(mut bytes) = fs::read(&path) else {
            return Ok(false);
        };
        match self.damage {
            Damage::Torn => bytes.truncate(bytes.len() / 2),
            Damage::Flip => {
                let at = HEADER_BYTES + bytes.len().saturating_sub(HEADER_BYTES) / 3;
                match bytes.get_mut(at) {
                    Some(b) => *b ^= 0x5a,
                    None => return Ok(false),
                }
            }
            Damage::Foreign => {
                let other = Fingerprint::from_parts(
                    "another-model",
                    &[],
                    0,
                    self.inner.fingerprint().digest()[0].into(),
                );
                let payload = bytes.get(HEADER_BYTES..).unwrap_or_default().to_vec();
                bytes = record::encode(&other, key, &payload);
            }
            Damage::PartMissing => {
                // The record goes; parts 1.. of 4 stay, part 0 never came.
                for part in 1..4 {
                    let pk = RecordKey::of_name(
                        self.inner.fingerprint(),
                        &format!("{}/part {part} of 4", key.hex()),
                    );
                    let payload = bytes.get(HEADER_BYTES..).unwrap_or_default();
                    let dir = self.inner.parts_dir(key);
                    let p = dir.join(format!("{part}-of-4"));
                    fs::create_dir_all(&dir)
                        .and_then(|()| {
                            fs::write(&p, record::encode(self.inner.fingerprint(), &pk, payload))
                        })
                        .map_err(|e| StorageError::Io {
                            what: format!("damage {}", p.display()),
                            source: e,
                        })?;
                }
                let _ = fs::remove_file(&path);
                return Ok(true);
            }
            Damage::Unchecked | Damage::Io => return Ok(true),
        }
        fs::write(&path, &bytes).map_err(|e| StorageError::Io {
            what: format!("damage {}", path.display()),
            source: e,
        })?;
        Ok(true)
    }
}

impl PageStore for DamagingStore {
    fn fingerprint(&self) -> &Fingerprint {
        self.inner.fingerprint()
    }

    fn payload_bytes(&self) -> u64 {
        self.inner.payload_bytes()
    }

    fn read_only(&self) -> bool {
        self.inner.is_read_only()
    }

    fn put(&self, key: &RecordKey, payload: &[u8]) -> Result<Put, StorageError> {
        if self.damage == Damage::Io
            && self.writes.fetch_add(1, Ordering::Relaxed) % self.every == 0
        {
            self.damaged.fetch_add(1, Ordering::Relaxed);
            return Err(injected_io("write", key));
        }
        self.inner.put(key, payload)
    }

    fn put_part(
        &self,
        key: &RecordKey,
        part: u32,
        parts: u32,
        payload: &[u8],
        assemble: Assemble<'_>,
    ) -> Result<PartPut, StorageError> {
        if self.damage == Damage::Io
            && self.writes.fetch_add(1, Ordering::Relaxed) % self.every == 0
        {
            self.damaged.fetch_add(1, Ordering::Relaxed);
            return Err(injected_io("write a part of", key));
        }
        self.inner.put_part(key, part, parts, payload, assemble)
    }

    fn get(&self, key: &RecordKey) -> Result<Lookup, StorageError> {
        let n = self.reads.fetch_add(1, Ordering::Relaxed);
        let damaged = n % self.every == 0 && self.damage_on_disk(key)?;
        if damaged && self.damage == Damage::Io {
            self.damaged.fetch_add(1, Ordering::Relaxed);
            return Err(injected_io("read", key));
        }
        let found = self.inner.get(key)?;
        if !damaged {
            return Ok(found);
        }
        self.damaged.fetch_add(1, Ordering::Relaxed);
        Ok(match (self.damage, found) {
            (Damage::Unchecked, Lookup::Hit(mut payload)) => {
                let at = payload.len() / 3;
                if let Some(b) = payload.get_mut(at) {
                    *b ^= 0x5a;
                }
                Lookup::Hit(payload)
            }
            (_, found) => found,
        })
    }

    fn present_run(&self, keys: &[RecordKey]) -> Result<usize, StorageError> {
        self.inner.present_run(keys)
    }

    fn stats(&self) -> StoreStats {
        self.inner.stats()
    }

    fn usage(&self) -> Result<u64, StorageError> {
        self.inner.usage()
    }
}

/// The error a [`Damage::Io`] store gives.
fn injected_io(what: &str, key: &RecordKey) -> StorageError {
    StorageError::Io {
        what: format!("{what} record {key} (injected)"),
        source: std::io::Error::other("an injected I/O error"),
    }
}
