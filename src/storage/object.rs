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
//! shared lock: of two writers that both see the set complete, the one whose removal of
//! part 0 finds it assembles and puts the record, the other holds (the engine removes an
//! object once), so a record is put and counted once. Leases, eviction and capacity are
//! the engine's.

use super::record::{self, HEADER_BYTES};
use super::{
    Assemble, Filled, Fingerprint, Lookup, PageStore, PartItem, PartPut, Put, RecordError,
    RecordKey, Refusal, StorageError, StoreStats,
};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Bytes of record buffers an [`ObjectStore`] keeps for its next batch: memory fresh from
/// the allocator costs a page fault per 4 KiB at its first touch, which every batch of
/// records paid again (a third of a batch read's time for 200 KB records here).
const SPARE_BYTES: usize = 128 << 20;

/// Payloads of at least this many bytes go to an engine that
/// [gathers](ObjectBackend::gathers) as their header and the caller's memory in place
/// (no copy); smaller ones are built whole in one buffer. Measured against Mooncake
/// Store's TCP transport (BENCHMARKS.md, "Mooncake Store throughput"): its batch put of
/// two buffers per object costs more per object than a copy of 200 KB saves, and less
/// than a copy of 512 KB or 1 MiB.
pub const GATHER_BYTES: u64 = 512 << 10;

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
    /// Removes object `name`: `true` when this call removed it, `false` when there was
    /// none. Of callers removing one object at once, at most one may be answered `true`
    /// (a writer of a record in parts claims its assembly so); a backend that cannot tell
    /// answers `true`.
    fn remove(&self, name: &str) -> Result<bool, StorageError>;
    /// [`remove`](Self::remove) of each of `names`, in one call of the engine where it
    /// has one: one answer per name, in order, each as `remove`'s (of callers removing
    /// one object at once, at most one is answered `true`).
    fn remove_many(&self, names: &[String]) -> Vec<Result<bool, StorageError>> {
        names.iter().map(|n| self.remove(n)).collect()
    }
    /// Bytes the store holds, as far as this client can tell (0 when it cannot).
    fn usage(&self) -> Result<u64, StorageError> {
        Ok(0)
    }
    /// Whether [`put_many`](Self::put_many) and [`get_many_into`](Self::get_many_into) are
    /// one call of the engine (not the per-object defaults).
    fn batches(&self) -> bool {
        false
    }
    /// Whether [`put_many`](Self::put_many) hands the engine an object's slices as they
    /// are, and [`get_many_into`](Self::get_many_into) fills several slices in one
    /// transfer (Mooncake Store's `batch_put_from_multi_buffers` and
    /// `batch_get_into_multi_buffers`): a record of at least `GATHER_BYTES` of payload
    /// then goes as its header and the caller's payload in place, and is read so, with
    /// no copy; else the store builds each record in one buffer first, and reads it whole
    /// into one.
    fn gathers(&self) -> bool {
        false
    }
    /// [`put_if_absent`](Self::put_if_absent) of each `(name, slices)` (the object is the
    /// slices' bytes, in order), in one call of the engine where it has one: one answer
    /// per item, in order.
    fn put_many(&self, items: &[(String, Vec<&[u8]>)]) -> Vec<Result<bool, StorageError>> {
        put_each(self, items)
    }
    /// Reads object `names[i]` into the slices of `dsts[i]`, in order, in one call of the
    /// engine where it has one: for each, `Some(len)`, its length (read when it fits in the
    /// slices, its bytes first; a longer object is not read), or `None` when there is
    /// none.
    fn get_many_into(
        &self,
        names: &[String],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Vec<Result<Option<usize>, StorageError>> {
        get_each_into(self, names, dsts)
    }
}

/// An object store in this process's memory: each clone is another client of the same
/// objects. For tests (of an engine's storage path, or of this crate's), where a real store
/// would add a server and nothing to check; nothing is evicted and nothing survives the
/// process.
#[derive(Clone, Debug, Default)]
pub struct MemObjects(Arc<Mutex<HashMap<String, Vec<u8>>>>);

impl MemObjects {
    /// The objects, to look at or to damage as a faulty store would.
    pub fn objects(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while the lock was held left whole objects (every change is one map
        // operation), so a poisoned lock is still consistent.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ObjectBackend for MemObjects {
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError> {
        let mut m = self.objects();
        if m.contains_key(name) {
            return Ok(false);
        }
        m.insert(name.to_string(), bytes.to_vec());
        Ok(true)
    }
    fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
        Ok(self.objects().get(name).cloned())
    }
    fn exist(&self, names: &[String]) -> Result<Vec<bool>, StorageError> {
        let m = self.objects();
        Ok(names.iter().map(|n| m.contains_key(n)).collect())
    }
    fn remove(&self, name: &str) -> Result<bool, StorageError> {
        Ok(self.objects().remove(name).is_some())
    }
    fn usage(&self) -> Result<u64, StorageError> {
        Ok(self.objects().values().map(|v| v.len() as u64).sum())
    }
}

/// [`ObjectBackend::put_many`] as a `put_if_absent` of each item's bytes.
pub fn put_each<B: ObjectBackend + ?Sized>(
    backend: &B,
    items: &[(String, Vec<&[u8]>)],
) -> Vec<Result<bool, StorageError>> {
    items
        .iter()
        .map(|(n, slices)| match slices.as_slice() {
            [one] => backend.put_if_absent(n, one),
            many => backend.put_if_absent(n, &many.concat()),
        })
        .collect()
}

/// [`ObjectBackend::get_many_into`] as a `get` of each object, copied into its slices.
pub fn get_each_into<B: ObjectBackend + ?Sized>(
    backend: &B,
    names: &[String],
    dsts: &mut [Vec<&mut [u8]>],
) -> Vec<Result<Option<usize>, StorageError>> {
    names
        .iter()
        .zip(dsts.iter_mut())
        .map(|(n, dst)| {
            let Some(bytes) = backend.get(n)? else {
                return Ok(None);
            };
            if bytes.len() <= dst.iter().map(|d| d.len()).sum::<usize>() {
                super::scatter(&bytes, dst);
            }
            Ok(Some(bytes.len()))
        })
        .collect()
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
    /// Record buffers for the next batch, at most [`SPARE_BYTES`].
    spare: Mutex<Vec<Vec<u8>>>,
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
            spare: Mutex::new(Vec::new()),
        })
    }

    /// `n` record buffers, kept ones first: of `len` bytes (holding anything) when `len`
    /// is given, else empty.
    fn take_buffers(&self, n: usize, len: Option<usize>) -> Vec<Vec<u8>> {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        (0..n)
            .map(|_| {
                let mut b = spare.pop().unwrap_or_default();
                match len {
                    Some(len) => b.resize(len, 0),
                    None => b.clear(),
                }
                b
            })
            .collect()
    }

    /// Keeps `bufs` for the next batch, up to [`SPARE_BYTES`] in all.
    fn give_back(&self, bufs: Vec<Vec<u8>>) {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        let mut held: usize = spare.iter().map(Vec::capacity).sum();
        for b in bufs {
            if held + b.capacity() > SPARE_BYTES {
                break;
            }
            held += b.capacity();
            spare.push(b);
        }
    }

    /// Whether records go to the backend and come back as their header and the caller's
    /// memory in place (`GATHER_BYTES`).
    fn gathers(&self) -> bool {
        self.backend.gathers() && self.payload_bytes >= GATHER_BYTES
    }

    /// [`PageStore::get_many_into`] where the records come as their header and the
    /// caller's slices: each record's header into a buffer of its own, its payload
    /// straight into the caller's memory (no copy), then checked there. A record refused
    /// may so leave bytes in the caller's slices (served as a miss, as any refusal). An
    /// object longer than a record is not read.
    fn get_scattered(
        &self,
        keys: &[RecordKey],
        names: &[String],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Vec<Result<Filled, StorageError>> {
        let mut heads = vec![[0u8; HEADER_BYTES]; keys.len()];
        let answers = {
            let mut bufs: Vec<Vec<&mut [u8]>> = heads
                .iter_mut()
                .zip(dsts.iter_mut())
                .map(|(h, d)| {
                    let mut b: Vec<&mut [u8]> = Vec::with_capacity(d.len() + 1);
                    b.push(&mut h[..]);
                    b.extend(d.iter_mut().map(|s| &mut **s));
                    b
                })
                .collect();
            self.backend.get_many_into(names, &mut bufs)
        };
        self.settle_gets(keys, names, answers, |i, key, len| {
            let head = &heads[i];
            if len < HEADER_BYTES {
                return Err(RecordError::Torn {
                    have: len as u64,
                    want: HEADER_BYTES as u64,
                });
            }
            record::check_header(head, len as u64, &self.fp, key, self.payload_bytes)?;
            let parts: Vec<&[u8]> = dsts[i].iter().map(|s| &s[..]).collect();
            record::check_payload_parts(head, &parts)
        })
    }

    /// The answers of one [`ObjectBackend::get_many_into`] of `names` (one per key; a
    /// backend that answers fewer fails every get) made into outcomes: a missing object a
    /// counted miss; one longer than a record refused unread; otherwise `check(i, key,
    /// len)` decides (checking the record where it landed, and placing its payload). A
    /// refused record is removed, so that it can be written again.
    fn settle_gets(
        &self,
        keys: &[RecordKey],
        names: &[String],
        answers: Vec<Result<Option<usize>, StorageError>>,
        mut check: impl FnMut(usize, &RecordKey, usize) -> Result<(), RecordError>,
    ) -> Vec<Result<Filled, StorageError>> {
        if answers.len() != keys.len() {
            let why = format!(
                "the backend answered {} of {} gets",
                answers.len(),
                keys.len()
            );
            return keys
                .iter()
                .map(|_| Err(StorageError::Backend(why.clone())))
                .collect();
        }
        let whole = HEADER_BYTES + self.payload_bytes as usize;
        keys.iter()
            .zip(names)
            .zip(answers)
            .enumerate()
            .map(|(i, ((key, name), answer))| {
                let Some(len) = answer? else {
                    self.stats.misses.fetch_add(1, Ordering::Relaxed);
                    return Ok(Filled::Miss);
                };
                let checked = if len > whole {
                    // Longer than any record of this deployment: not read.
                    Err(RecordError::Length {
                        have: (len - HEADER_BYTES) as u64,
                        want: self.payload_bytes,
                    })
                } else {
                    check(i, key, len)
                };
                match checked {
                    Ok(()) => {
                        self.stats.records_read.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .bytes_read
                            .fetch_add(len as u64, Ordering::Relaxed);
                        Ok(Filled::Hit)
                    }
                    Err(why) => {
                        self.refused(&why);
                        // Removed, so the record can be written again.
                        let _ = self.backend.remove(name);
                        Ok(Filled::Refused(why))
                    }
                }
            })
            .collect()
    }

    /// Completes the records of `done` (key, parts, assembler), each of whose parts were
    /// all seen there, in four calls of the engine for all of them: one
    /// [`get_many_into`](ObjectBackend::get_many_into) of every part (each checked
    /// against its own header), one [`remove_many`](ObjectBackend::remove_many) of the
    /// part 0 of each record read whole (the claim: of the writers that read a record's
    /// whole set, the one whose removal of its part 0 finds it assembles and puts it; no
    /// shared lock, as the engine removes an object once, so a record is put, and counted,
    /// by one writer), one [`put_many`](PageStore::put_many) of the records assembled, and
    /// one `remove_many` of their other parts. One outcome per record, in order.
    fn complete_many(
        &self,
        done: &[(RecordKey, u32, Assemble<'_>)],
    ) -> Vec<Result<PartPut, StorageError>> {
        if done.is_empty() {
            return Vec::new();
        }
        let mut out: Vec<Option<Result<PartPut, StorageError>>> =
            done.iter().map(|_| None).collect();
        let names: Vec<Vec<String>> = done
            .iter()
            .map(|(key, parts, _)| (0..*parts).map(|p| part_name(key, p, *parts)).collect())
            .collect();
        let flat: Vec<String> = names.iter().flatten().cloned().collect();
        // A part is at most a page: a buffer of a whole record holds any.
        let mut bufs =
            self.take_buffers(flat.len(), Some(HEADER_BYTES + self.payload_bytes as usize));
        let answers = {
            let mut dsts: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| vec![&mut b[..]]).collect();
            self.backend.get_many_into(&flat, &mut dsts)
        };
        let mut answers = if answers.len() == flat.len() {
            answers
        } else {
            let why = format!(
                "the backend answered {} of {} gets",
                answers.len(),
                flat.len()
            );
            flat.iter()
                .map(|_| Err(StorageError::Backend(why.clone())))
                .collect()
        }
        .into_iter();
        // The parts of each record read whole, checked: its payloads, by record.
        let mut read: Vec<(usize, Vec<Vec<u8>>)> = Vec::with_capacity(done.len());
        let mut at = 0;
        for (r, (key, parts, _)) in done.iter().enumerate() {
            let n = *parts as usize;
            let mine: Vec<Result<Option<usize>, StorageError>> = answers.by_ref().take(n).collect();
            let mut all = Vec::with_capacity(n);
            for (p, answer) in mine.into_iter().enumerate() {
                if out[r].is_some() {
                    break;
                }
                match answer {
                    Err(e) => out[r] = Some(Err(e)),
                    // Taken meanwhile by another writer that assembled it.
                    Ok(None) => out[r] = Some(Ok(PartPut::Held)),
                    Ok(Some(len)) => {
                        match self.check_part(&bufs[at + p], len, key, p as u32, *parts) {
                            Ok(payload) => all.push(payload.to_vec()),
                            Err(why) => {
                                // A damaged part: removed, so the next writers start it again.
                                self.refused(&why);
                                let _ = self.backend.remove(&names[r][p]);
                                out[r] = Some(Ok(PartPut::Held));
                            }
                        }
                    }
                }
            }
            at += n;
            if out[r].is_none() {
                read.push((r, all));
            }
        }
        self.give_back(bufs);
        // The claims, one call for all.
        let zeros: Vec<String> = read.iter().map(|(r, _)| names[*r][0].clone()).collect();
        let claims = if zeros.is_empty() {
            Vec::new()
        } else {
            self.backend.remove_many(&zeros)
        };
        let claims = if claims.len() == zeros.len() {
            claims
        } else {
            let why = format!(
                "the backend answered {} of {} removals",
                claims.len(),
                zeros.len()
            );
            zeros
                .iter()
                .map(|_| Err(StorageError::Backend(why.clone())))
                .collect()
        };
        let mut won: Vec<(usize, Vec<u8>)> = Vec::with_capacity(read.len());
        for ((r, all), claim) in read.into_iter().zip(claims) {
            let (key, _, assemble) = &done[r];
            match claim {
                Err(e) => out[r] = Some(Err(e)),
                Ok(false) => out[r] = Some(Ok(PartPut::Held)),
                Ok(true) => match assemble(&all) {
                    Some(payload) => won.push((r, payload)),
                    None => {
                        let sizes: Vec<usize> = all.iter().map(Vec::len).collect();
                        out[r] = Some(Err(StorageError::Config(format!(
                            "the parts of record {key} ({sizes:?} bytes) are not of this \
                             layout's sizes: two layouts write parts of one record"
                        ))));
                    }
                },
            }
        }
        let records: Vec<(RecordKey, &[u8])> =
            won.iter().map(|(r, p)| (done[*r].0, &p[..])).collect();
        let puts = if records.is_empty() {
            Vec::new()
        } else {
            self.put_many(&records)
        };
        let rest: Vec<String> = won
            .iter()
            .flat_map(|(r, _)| names[*r][1..].iter().cloned())
            .collect();
        for ((r, _), put) in won.iter().zip(puts) {
            out[*r] = Some(put.map(|p| match p {
                Put::Written { evicted } => PartPut::Completed { evicted },
                Put::Present => PartPut::Present,
            }));
        }
        if !rest.is_empty() {
            let _ = self.backend.remove_many(&rest);
        }
        out.into_iter()
            .map(|o| o.expect("every record answered"))
            .collect()
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

    /// The payload of part `part` of `parts` of `key`'s record, read into `buf` (`len`
    /// bytes long; a longer object was not read), checked against its own header.
    fn check_part<'a>(
        &self,
        buf: &'a [u8],
        len: usize,
        key: &RecordKey,
        part: u32,
        parts: u32,
    ) -> Result<&'a [u8], RecordError> {
        let bytes = buf.get(..len).ok_or(RecordError::Length {
            have: len.saturating_sub(HEADER_BYTES) as u64,
            want: self.payload_bytes,
        })?;
        let head = bytes.get(..HEADER_BYTES).ok_or(RecordError::Torn {
            have: bytes.len() as u64,
            want: HEADER_BYTES as u64,
        })?;
        // A part is at most a page: its header's length is checked against its own.
        let part_len = u64::from_le_bytes(head[48..56].try_into().expect("8 bytes"));
        if part_len == 0 || part_len > self.payload_bytes {
            return Err(RecordError::Length {
                have: part_len,
                want: self.payload_bytes,
            });
        }
        record::decode(bytes, &self.fp, &self.part_key(key, part, parts), part_len)
    }
}

impl<B: ObjectBackend> PageStore for ObjectStore<B> {
    fn fingerprint(&self) -> &Fingerprint {
        &self.fp
    }

    fn payload_bytes(&self) -> u64 {
        self.payload_bytes
    }

    fn batches(&self) -> bool {
        self.backend.batches()
    }

    fn put(&self, key: &RecordKey, payload: &[u8]) -> Result<Put, StorageError> {
        self.put_many(&[(*key, payload)])
            .pop()
            .expect("one answer per item")
    }

    /// One [`ObjectBackend::put_many`] of the records. Where the backend
    /// [gathers](ObjectBackend::gathers) an object's slices and a payload is at least
    /// `GATHER_BYTES`, each record is its header and
    /// the caller's payload in place (the checksum reads the payload, nothing copies it);
    /// else each is built whole in one buffer (one copy of the payload behind its header,
    /// its checksum taken in the same pass: [`record::encode_into`]). The backend's
    /// put-if-absent says which were there (no test of presence first, which would cost
    /// the engine a second call per batch). A backend that answers fewer puts than it was
    /// given fails every record of the batch: which ones it wrote is unknown.
    fn put_many(&self, items: &[(RecordKey, &[u8])]) -> Vec<Result<Put, StorageError>> {
        let mut out: Vec<Option<Result<Put, StorageError>>> = items.iter().map(|_| None).collect();
        let mut at = Vec::with_capacity(items.len());
        for (i, (key, payload)) in items.iter().enumerate() {
            match super::check_payload(key, payload, self.payload_bytes) {
                Ok(()) => at.push(i),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        let answers = if self.gathers() {
            let heads: Vec<[u8; HEADER_BYTES]> = at
                .iter()
                .map(|&i| record::header(&self.fp, &items[i].0, items[i].1))
                .collect();
            let batch: Vec<(String, Vec<&[u8]>)> = at
                .iter()
                .zip(&heads)
                .map(|(&i, head)| (object_name(&items[i].0), vec![&head[..], items[i].1]))
                .collect();
            self.backend.put_many(&batch)
        } else {
            let mut records = self.take_buffers(at.len(), None);
            for (&i, rec) in at.iter().zip(records.iter_mut()) {
                record::encode_into(&self.fp, &items[i].0, items[i].1, rec);
            }
            let batch: Vec<(String, Vec<&[u8]>)> = at
                .iter()
                .zip(&records)
                .map(|(&i, rec)| (object_name(&items[i].0), vec![&rec[..]]))
                .collect();
            let answers = self.backend.put_many(&batch);
            drop(batch);
            self.give_back(records);
            answers
        };
        if answers.len() != at.len() {
            let why = format!(
                "the backend answered {} of {} puts",
                answers.len(),
                at.len()
            );
            for &i in &at {
                out[i] = Some(Err(StorageError::Backend(why.clone())));
            }
        } else {
            for (&i, answer) in at.iter().zip(answers) {
                let bytes = (HEADER_BYTES + items[i].1.len()) as u64;
                out[i] = Some(answer.map(|written| {
                    if written {
                        self.stats.records_written.fetch_add(1, Ordering::Relaxed);
                        self.stats.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                        Put::Written { evicted: 0 }
                    } else {
                        self.stats.already_present.fetch_add(1, Ordering::Relaxed);
                        Put::Present
                    }
                }));
            }
        }
        out.into_iter()
            .map(|o| o.expect("every item answered"))
            .collect()
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
        self.complete_many(&[(*key, parts, assemble)])
            .pop()
            .expect("one outcome per record")
    }

    /// One [`ObjectBackend::exist`] of the items' records, one
    /// [`ObjectBackend::put_many`] of their parts (each not there already) and one
    /// [`ObjectBackend::exist`] of every part of those records, where `PageStore::put_part`
    /// makes the three calls for each part; the records whose parts are then all there
    /// are completed together, in four more calls for all of them (a batch read of their
    /// parts, a batch removal of their part 0s as the claims, a put of the records and a
    /// batch removal of their other parts).
    fn put_parts(&self, items: &[PartItem<'_>]) -> Vec<Result<PartPut, StorageError>> {
        let mut out: Vec<Option<Result<PartPut, StorageError>>> =
            items.iter().map(|_| None).collect();
        let mut live = Vec::with_capacity(items.len());
        for (i, it) in items.iter().enumerate() {
            match super::check_part(&it.key, it.part, it.parts, it.payload, self.payload_bytes) {
                Ok(()) => live.push(i),
                Err(e) => out[i] = Some(Err(e)),
            }
        }
        // Every answer of a call that failed, or answered another count, is its error.
        let fail_all =
            |out: &mut Vec<Option<Result<PartPut, StorageError>>>, live: &[usize], why: String| {
                for &i in live {
                    out[i] = Some(Err(StorageError::Backend(why.clone())));
                }
            };
        let wholes: Vec<String> = live.iter().map(|&i| object_name(&items[i].key)).collect();
        match self.backend.exist(&wholes) {
            Ok(there) if there.len() == live.len() => {
                let mut kept = Vec::with_capacity(live.len());
                for (&i, &t) in live.iter().zip(&there) {
                    if t {
                        self.stats.already_present.fetch_add(1, Ordering::Relaxed);
                        out[i] = Some(Ok(PartPut::Present));
                    } else {
                        kept.push(i);
                    }
                }
                live = kept;
            }
            Ok(there) => {
                let why = format!(
                    "the backend answered {} of {} names",
                    there.len(),
                    live.len()
                );
                fail_all(&mut out, &live, why);
                live.clear();
            }
            Err(e) => {
                fail_all(&mut out, &live, e.to_string());
                live.clear();
            }
        }
        let encoded: Vec<Vec<u8>> = live
            .iter()
            .map(|&i| {
                let it = &items[i];
                record::encode(
                    &self.fp,
                    &self.part_key(&it.key, it.part, it.parts),
                    it.payload,
                )
            })
            .collect();
        let batch: Vec<(String, Vec<&[u8]>)> = live
            .iter()
            .zip(&encoded)
            .map(|(&i, b)| {
                let it = &items[i];
                (part_name(&it.key, it.part, it.parts), vec![&b[..]])
            })
            .collect();
        if !batch.is_empty() {
            let answers = self.backend.put_many(&batch);
            if answers.len() != live.len() {
                let why = format!(
                    "the backend answered {} of {} puts",
                    answers.len(),
                    live.len()
                );
                fail_all(&mut out, &live, why);
                live.clear();
            } else {
                let mut kept = Vec::with_capacity(live.len());
                for (&i, answer) in live.iter().zip(answers) {
                    match answer {
                        Ok(_) => kept.push(i),
                        Err(e) => out[i] = Some(Err(e)),
                    }
                }
                live = kept;
            }
        }
        // Which records have every part there: one call for all.
        let names: Vec<String> = live
            .iter()
            .flat_map(|&i| {
                let it = &items[i];
                (0..it.parts).map(move |p| part_name(&it.key, p, it.parts))
            })
            .collect();
        if !names.is_empty() {
            match self.backend.exist(&names) {
                Ok(there) if there.len() == names.len() => {
                    let mut at = 0;
                    let mut whole = Vec::new();
                    for &i in &live {
                        let it = &items[i];
                        let n = it.parts as usize;
                        if there[at..at + n].iter().all(|&e| e) {
                            whole.push(i);
                        } else {
                            out[i] = Some(Ok(PartPut::Held));
                        }
                        at += n;
                    }
                    // The records whose parts are all there, completed together.
                    let done: Vec<(RecordKey, u32, Assemble<'_>)> = whole
                        .iter()
                        .map(|&i| (items[i].key, items[i].parts, items[i].assemble))
                        .collect();
                    for (&i, put) in whole.iter().zip(self.complete_many(&done)) {
                        out[i] = Some(put);
                    }
                }
                Ok(there) => {
                    let why = format!(
                        "the backend answered {} of {} names",
                        there.len(),
                        names.len()
                    );
                    fail_all(&mut out, &live, why);
                }
                Err(e) => fail_all(&mut out, &live, e.to_string()),
            }
        }
        out.into_iter()
            .map(|o| o.expect("every item answered"))
            .collect()
    }

    fn get(&self, key: &RecordKey) -> Result<Lookup, StorageError> {
        self.get_many(std::slice::from_ref(key))
            .pop()
            .expect("one answer per key")
    }

    /// [`get_many_into`](PageStore::get_many_into) buffers of a payload's size.
    fn get_many(&self, keys: &[RecordKey]) -> Vec<Result<Lookup, StorageError>> {
        let mut bufs: Vec<Vec<u8>> = keys
            .iter()
            .map(|_| vec![0u8; self.payload_bytes as usize])
            .collect();
        let got = {
            let mut dsts: Vec<Vec<&mut [u8]>> = bufs.iter_mut().map(|b| vec![&mut b[..]]).collect();
            self.get_many_into(keys, &mut dsts)
        };
        got.into_iter()
            .zip(bufs)
            .map(|(got, buf)| {
                got.map(|f| match f {
                    Filled::Hit => Lookup::Hit(buf),
                    Filled::Miss => Lookup::Miss,
                    Filled::Refused(e) => Lookup::Refused(e),
                })
            })
            .collect()
    }

    /// One [`ObjectBackend::get_many_into`] of the records, each whole into a buffer of a
    /// record's size (one buffer per object, as for puts), checked as
    /// [`get`](PageStore::get) checks it, its payload then copied into the caller's slices
    /// (an object longer than a record is not read: refused as of another length).
    fn get_many_into(
        &self,
        keys: &[RecordKey],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Vec<Result<Filled, StorageError>> {
        let names: Vec<String> = keys.iter().map(object_name).collect();
        let whole = HEADER_BYTES + self.payload_bytes as usize;
        if let Some(t) = dsts
            .iter()
            .map(|d| d.iter().map(|s| s.len()).sum::<usize>())
            .find(|&t| t as u64 != self.payload_bytes)
        {
            let why = format!(
                "buffers of {t} bytes for a {}-byte payload",
                self.payload_bytes
            );
            return keys
                .iter()
                .map(|_| Err(StorageError::Config(why.clone())))
                .collect();
        }
        if self.gathers() {
            return self.get_scattered(keys, &names, dsts);
        }
        let mut bufs = self.take_buffers(keys.len(), Some(whole));
        let answers = {
            let mut whole_bufs: Vec<Vec<&mut [u8]>> =
                bufs.iter_mut().map(|b| vec![&mut b[..]]).collect();
            self.backend.get_many_into(&names, &mut whole_bufs)
        };
        let out = self.settle_gets(keys, &names, answers, |i, key, len| {
            let payload = record::decode(&bufs[i][..len], &self.fp, key, self.payload_bytes)?;
            super::scatter(payload, &mut dsts[i]);
            Ok(())
        });
        self.give_back(bufs);
        out
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
    use std::sync::Mutex;

    /// `get`, `exist` and `remove` of a test backend, as its field `mem`'s.
    macro_rules! reads_from_mem {
        () => {
            fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
                self.mem.get(name)
            }
            fn exist(&self, names: &[String]) -> Result<Vec<bool>, StorageError> {
                self.mem.exist(names)
            }
            fn remove(&self, name: &str) -> Result<bool, StorageError> {
                self.mem.remove(name)
            }
        };
    }

    type Mem = MemObjects;

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

    /// A backend that gathers an object's slices is handed each record as its header and
    /// the caller's payload in place (nothing copied), and stores the bytes of a record
    /// built whole.
    #[test]
    fn a_gathering_backend_gets_the_header_and_the_payload_in_place() {
        #[derive(Default)]
        struct Gathering {
            mem: Mem,
            slices: Mutex<Vec<(usize, usize)>>,
        }
        impl ObjectBackend for Gathering {
            fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError> {
                self.mem.put_if_absent(name, bytes)
            }
            reads_from_mem!();
            fn gathers(&self) -> bool {
                true
            }
            fn put_many(&self, items: &[(String, Vec<&[u8]>)]) -> Vec<Result<bool, StorageError>> {
                let mut seen = self.slices.lock().unwrap();
                for (_, slices) in items {
                    seen.extend(slices.iter().map(|s| (s.as_ptr() as usize, s.len())));
                }
                put_each(self, items)
            }
        }
        let n = GATHER_BYTES as usize;
        let s =
            ObjectStore::new(Gathering::default(), Fingerprint::named("test"), n as u64).unwrap();
        let keys = RecordKey::chain(s.fingerprint(), &[1, 2, 3, 4], 2);
        let (a, b) = (vec![1u8; n], vec![2u8; n]);
        let puts = s.put_many(&[(keys[0], &a[..]), (keys[1], &b[..])]);
        assert!(
            puts.iter().all(|p| matches!(p, Ok(Put::Written { .. }))),
            "{puts:?}"
        );
        let seen = s.backend().slices.lock().unwrap().clone();
        assert_eq!(seen.len(), 4, "a header and a payload per record");
        assert_eq!(seen[1], (a.as_ptr() as usize, n), "the payload in place");
        assert_eq!(seen[3], (b.as_ptr() as usize, n));
        assert_eq!((seen[0].1, seen[2].1), (HEADER_BYTES, HEADER_BYTES));
        let raw = s.backend().get(&object_name(&keys[1])).unwrap().unwrap();
        assert_eq!(raw, record::encode(s.fingerprint(), &keys[1], &b));
        // Read back into the caller's memory in two slices, checked there.
        let mut out = vec![0u8; n];
        let (lo, hi) = out.split_at_mut(1000);
        let got = s.get_many_into(&keys[1..2], &mut [vec![lo, hi]]);
        assert!(matches!(got[..], [Ok(Filled::Hit)]), "{got:?}");
        assert_eq!(out, b);
        // A damaged one, a short one and a long one are refused and counted.
        let mut bad = record::encode(s.fingerprint(), &keys[0], &a);
        bad[HEADER_BYTES + 5] ^= 1;
        let m = &s.backend().mem;
        m.objects().insert(object_name(&keys[0]), bad);
        m.objects()
            .insert(object_name(&keys[1]), raw[..n / 2].to_vec());
        let long = [&raw[..], b"x"].concat();
        let got = s.get_many(&keys[..2]);
        assert!(
            matches!(got[0], Ok(Lookup::Refused(RecordError::Checksum { .. }))),
            "{:?}",
            got[0]
        );
        assert!(
            matches!(got[1], Ok(Lookup::Refused(RecordError::Torn { .. }))),
            "{:?}",
            got[1]
        );
        m.objects().insert(object_name(&keys[1]), long);
        let got = s.get(&keys[1]);
        assert!(
            matches!(got, Ok(Lookup::Refused(RecordError::Length { .. }))),
            "{got:?}"
        );
        let st = s.stats();
        assert_eq!(
            (st.refused_checksum, st.refused_torn, st.records_read),
            (2, 1, 1)
        );
    }

    /// A backend that answers fewer gets than it was asked: every get of the call fails
    /// (which answer is whose is unknown), on the copying path and the in-place one alike,
    /// and nothing is counted read.
    #[test]
    fn gets_answered_short_fail_every_get_of_the_call() {
        struct Short {
            mem: Mem,
            gathers: bool,
        }
        impl ObjectBackend for Short {
            fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError> {
                self.mem.put_if_absent(name, bytes)
            }
            reads_from_mem!();
            fn gathers(&self) -> bool {
                self.gathers
            }
            fn get_many_into(
                &self,
                names: &[String],
                dsts: &mut [Vec<&mut [u8]>],
            ) -> Vec<Result<Option<usize>, StorageError>> {
                let mut answers = get_each_into(self, names, dsts);
                answers.pop();
                answers
            }
        }
        for gathers in [false, true] {
            let n = GATHER_BYTES as usize;
            let backend = Short {
                mem: Mem::default(),
                gathers,
            };
            let s = ObjectStore::new(backend, Fingerprint::named("test"), n as u64).unwrap();
            let keys = RecordKey::chain(s.fingerprint(), &[1, 2, 3, 4], 2);
            let (a, b) = (vec![1u8; n], vec![2u8; n]);
            for (k, v) in [(keys[0], &a), (keys[1], &b)] {
                assert!(matches!(s.put(&k, v), Ok(Put::Written { .. })));
            }
            let got = s.get_many(&keys[..2]);
            assert!(
                got.iter()
                    .all(|g| matches!(g, Err(StorageError::Backend(w)) if w.contains("1 of 2"))),
                "gathers {gathers}: {got:?}"
            );
            assert_eq!(s.stats().records_read, 0, "gathers {gathers}");
        }
    }

    /// An engine whose put answers success for an object that is there (Mooncake Store's,
    /// its presence test racing another's put), and whose reads of parts wait for a second
    /// reader: two writers completing the same records both read every part before either
    /// claims one.
    struct Racing {
        mem: Mem,
        reads: std::sync::Barrier,
    }

    impl ObjectBackend for Racing {
        fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError> {
            self.mem.put_if_absent(name, bytes)?;
            Ok(true)
        }
        reads_from_mem!();
        fn get_many_into(
            &self,
            names: &[String],
            dsts: &mut [Vec<&mut [u8]>],
        ) -> Vec<Result<Option<usize>, StorageError>> {
            let got = get_each_into(self, names, dsts);
            if names.iter().any(|n| n.contains("/part-")) {
                self.reads.wait();
            }
            got
        }
    }

    /// Two writers, one per part of `records` records in two parts whose parts are all
    /// there (as both put theirs before looking), completing them at once: by `put_part`
    /// of each (`batched` false, one record) or one `put_parts` of all. Each record is put
    /// and counted by one of them (the one whose removal of its part 0 found it), and read
    /// back whole; the parts are gone.
    fn race(records: usize, batched: bool) {
        let s = ObjectStore::new(
            Racing {
                mem: Mem::default(),
                reads: std::sync::Barrier::new(2),
            },
            Fingerprint::named("test"),
            8,
        )
        .unwrap();
        let tokens: Vec<u32> = (0..2 * records as u32).collect();
        let keys = RecordKey::chain(s.fingerprint(), &tokens, 2);
        for key in &keys {
            for (p, bytes) in [(0, b"abcd"), (1, b"efgh")] {
                let part = record::encode(&s.fp, &s.part_key(key, p, 2), bytes);
                s.backend()
                    .mem
                    .put_if_absent(&part_name(key, p, 2), &part)
                    .unwrap();
            }
        }
        let puts: Vec<Vec<PartPut>> = std::thread::scope(|t| {
            let writers: Vec<_> = [(0u32, b"abcd"), (1, b"efgh")]
                .into_iter()
                .map(|(p, bytes)| {
                    let (s, keys) = (&s, &keys);
                    t.spawn(move || {
                        let cat: Assemble<'_> = &|all: &[Vec<u8>]| Some(all.concat());
                        if !batched {
                            return vec![s.put_part(&keys[0], p, 2, bytes, cat).unwrap()];
                        }
                        let items: Vec<PartItem<'_>> = keys
                            .iter()
                            .map(|k| PartItem {
                                key: *k,
                                part: p,
                                parts: 2,
                                payload: bytes,
                                assemble: cat,
                            })
                            .collect();
                        s.put_parts(&items)
                            .into_iter()
                            .map(Result::unwrap)
                            .collect()
                    })
                })
                .collect();
            writers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        for (r, key) in keys.iter().enumerate() {
            let completed = puts
                .iter()
                .filter(|w| matches!(w[r], PartPut::Completed { .. }))
                .count();
            assert_eq!(completed, 1, "record {r}: {puts:?}");
            assert_eq!(s.get(key).unwrap(), Lookup::Hit(b"abcdefgh".to_vec()));
        }
        assert_eq!(s.stats().records_written, keys.len() as u64);
        assert_eq!(
            s.backend().mem.objects().len(),
            keys.len(),
            "the parts are gone"
        );
    }

    /// Two writers that see a record's parts complete at once: one puts and counts the
    /// record, the other holds.
    #[test]
    fn two_writers_completing_a_record_at_once_count_it_once() {
        race(1, false);
    }

    /// Two writers whose batches of parts complete the same ten records at once: each
    /// record is put and counted by one of them, whichever writer that is, record by
    /// record.
    #[test]
    fn two_writers_completing_records_in_one_batch_count_each_once() {
        race(10, true);
    }

    /// A batch of parts is three calls of the engine (the records' presence, the parts'
    /// put, the parts' presence), where `put_part` of each makes three per part; the
    /// batch that completes records assembles each.
    #[test]
    fn a_batch_of_parts_is_three_engine_calls() {
        #[derive(Default)]
        struct Counting {
            mem: Mem,
            calls: Mutex<Vec<&'static str>>,
        }
        impl ObjectBackend for Counting {
            fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError> {
                self.calls.lock().unwrap().push("put");
                self.mem.put_if_absent(name, bytes)
            }
            fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
                self.calls.lock().unwrap().push("get");
                self.mem.get(name)
            }
            fn exist(&self, names: &[String]) -> Result<Vec<bool>, StorageError> {
                self.calls.lock().unwrap().push("exist");
                self.mem.exist(names)
            }
            fn remove(&self, name: &str) -> Result<bool, StorageError> {
                self.calls.lock().unwrap().push("remove");
                self.mem.remove(name)
            }
            fn put_many(&self, items: &[(String, Vec<&[u8]>)]) -> Vec<Result<bool, StorageError>> {
                self.calls.lock().unwrap().push("put_many");
                items
                    .iter()
                    .map(|(n, s)| self.mem.put_if_absent(n, &s.concat()))
                    .collect()
            }
            fn get_many_into(
                &self,
                names: &[String],
                dsts: &mut [Vec<&mut [u8]>],
            ) -> Vec<Result<Option<usize>, StorageError>> {
                self.calls.lock().unwrap().push("get_many");
                get_each_into(&self.mem, names, dsts)
            }
            fn remove_many(&self, names: &[String]) -> Vec<Result<bool, StorageError>> {
                self.calls.lock().unwrap().push("remove_many");
                self.mem.remove_many(names)
            }
        }
        let s = ObjectStore::new(Counting::default(), Fingerprint::named("test"), 8).unwrap();
        let keys = RecordKey::chain(s.fingerprint(), &[1, 2, 3, 4, 5, 6, 7, 8], 2);
        let cat: Assemble<'_> = &|all: &[Vec<u8>]| Some(all.concat());
        let items = |part: u32, bytes: &'static [u8; 4]| -> Vec<PartItem<'_>> {
            keys.iter()
                .map(|k| PartItem {
                    key: *k,
                    part,
                    parts: 2,
                    payload: bytes,
                    assemble: cat,
                })
                .collect()
        };
        let held = s.put_parts(&items(1, b"efgh"));
        assert!(
            held.iter().all(|p| matches!(p, Ok(PartPut::Held))),
            "{held:?}"
        );
        let calls = std::mem::take(&mut *s.backend().calls.lock().unwrap());
        assert_eq!(calls, ["exist", "put_many", "exist"]);
        let done = s.put_parts(&items(0, b"abcd"));
        assert!(
            done.iter()
                .all(|p| matches!(p, Ok(PartPut::Completed { .. }))),
            "{done:?}"
        );
        // The four records completed together: one read of every part, one removal of
        // each part 0 (the claims), one put of the records, one removal of the rest.
        let calls = std::mem::take(&mut *s.backend().calls.lock().unwrap());
        assert_eq!(
            calls,
            [
                "exist",
                "put_many",
                "exist",
                "get_many",
                "remove_many",
                "put_many",
                "remove_many"
            ]
        );
        for k in &keys {
            assert_eq!(s.get(k).unwrap(), Lookup::Hit(b"abcdefgh".to_vec()));
        }
        assert_eq!(s.stats().records_written, 4);
        assert_eq!(s.backend().mem.objects().len(), 4, "the parts are gone");
        // A record there already: its part is not put.
        assert!(matches!(
            s.put_parts(&items(0, b"abcd"))[..],
            [Ok(PartPut::Present), ..]
        ));
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
        assert_eq!(s.backend().objects().len(), 1, "the parts are gone");
        assert_eq!(
            s.put_part(&key, 0, 2, b"abcd", cat).unwrap(),
            PartPut::Present
        );
    }
}
