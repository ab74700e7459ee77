//! Reading records ahead of the request that needs them (SGLang HiCache's prefetch thread):
//! [`RankCache::prefetch`] hands a prompt's records this rank will read to a thread of the
//! rank's own, which reads them in order while the rank serves other requests; the
//! request's storage read ([`RankCache::read_from_storage`]) then takes each record from
//! there, waits only for one still being read, and reads the rest itself.
//!
//! A record read ahead is the same bytes a read at the request would get (a key names its
//! prefix), so reading ahead changes only when bytes are read, never what a request sees:
//! it is checked the same way, counted when the request takes it, and a record the
//! request never takes ages out of a bounded buffer. Local to the rank: no round.

use super::{ClusterError, RankCache};
use crate::storage::{Lookup, PageStore, RecordKey, Refusal, StorageError};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Bytes of records held read ahead and not taken yet, at most: past it the oldest go.
pub const PREFETCH_BYTES: u64 = 256 << 20;

/// A read's outcome, kept until a request takes it.
pub(super) type Read = Result<Lookup, StorageError>;

/// Refused records and failed reads of the read-ahead that no request takes (past the
/// first record of a batch that is not a hit, or aged out of the buffer): the store counted
/// them, so the rank does too, as the request during which they happened ends
/// ([`Prefetcher::untaken`]), as it counts those past the first miss of its own batches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Untaken {
    pub torn: u64,
    pub checksum: u64,
    pub fingerprint: u64,
    pub io_errors: u64,
}

impl Untaken {
    fn add(&mut self, read: &Read) {
        match read {
            Ok(Lookup::Refused(e)) => match e.refusal() {
                Refusal::Torn => self.torn += 1,
                Refusal::Checksum => self.checksum += 1,
                Refusal::Fingerprint => self.fingerprint += 1,
            },
            Err(_) => self.io_errors += 1,
            Ok(Lookup::Hit(_) | Lookup::Miss) => {}
        }
    }
}

#[derive(Default)]
struct State {
    /// What no request will take, not counted by a request yet.
    untaken: Untaken,
    /// Records read, by key, and the order they came in (the oldest go first).
    done: HashMap<RecordKey, Read>,
    order: VecDeque<RecordKey>,
    bytes: u64,
    /// Records handed to the thread and not read yet.
    pending: HashSet<RecordKey>,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    read: Condvar,
}

fn lock(s: &Shared) -> MutexGuard<'_, State> {
    s.state.lock().unwrap_or_else(|p| p.into_inner())
}

fn payload_len(r: &Read) -> u64 {
    match r {
        Ok(Lookup::Hit(p)) => p.len() as u64,
        _ => 0,
    }
}

/// A rank's read-ahead thread and what it has read.
pub(super) struct Prefetcher {
    jobs: Option<Sender<Vec<RecordKey>>>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Prefetcher {
    /// Starts the thread reading from `store`.
    pub(super) fn start(store: Arc<dyn PageStore>, rank: u8) -> Prefetcher {
        let shared = Arc::new(Shared::default());
        let (tx, rx) = channel::<Vec<RecordKey>>();
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("cp-hicache-prefetch-{rank}"))
            .spawn(move || {
                // In batches where the store batches (one call each), else one record at a
                // time: in order, up to the first record that is not a hit (the request
                // would stop there too; the rest of its batch is dropped).
                let batch = super::storage::batch_records(store.as_ref());
                for job in rx {
                    let mut rest = job.as_slice();
                    while !rest.is_empty() {
                        let (chunk, tail) = rest.split_at(batch.min(rest.len()));
                        rest = tail;
                        let mut reads = match chunk {
                            [one] => vec![store.get(one)],
                            many => store.get_many(many),
                        }
                        .into_iter();
                        let mut hit = true;
                        let mut st = lock(&s);
                        for key in chunk {
                            st.pending.remove(key);
                            let read = reads.next().unwrap_or_else(|| {
                                Err(StorageError::Backend(
                                    "the store answered fewer reads than it was given".into(),
                                ))
                            });
                            if !hit {
                                // Not used, as past the first miss of a request's own
                                // batch; a refusal or failure is still counted.
                                st.untaken.add(&read);
                                continue;
                            }
                            hit = matches!(read, Ok(Lookup::Hit(_)));
                            st.bytes += payload_len(&read);
                            if st.done.insert(*key, read).is_none() {
                                st.order.push_back(*key);
                            }
                            while st.bytes > PREFETCH_BYTES {
                                let Some(old) = st.order.pop_front() else {
                                    break;
                                };
                                if let Some(r) = st.done.remove(&old) {
                                    st.bytes -= payload_len(&r);
                                    st.untaken.add(&r);
                                }
                            }
                        }
                        drop(st);
                        s.read.notify_all();
                        if !hit {
                            break;
                        }
                    }
                    let mut st = lock(&s);
                    for key in rest {
                        st.pending.remove(key);
                    }
                    drop(st);
                    s.read.notify_all();
                }
            })
            .expect("spawn the prefetch thread");
        Prefetcher {
            jobs: Some(tx),
            shared,
            thread: Some(thread),
        }
    }

    /// Hands `keys` to the thread (those neither read nor being read already); how many.
    fn ask(&self, keys: Vec<RecordKey>) -> usize {
        let mut st = lock(&self.shared);
        let new: Vec<RecordKey> = keys
            .into_iter()
            .filter(|k| !st.done.contains_key(k) && st.pending.insert(*k))
            .collect();
        drop(st);
        let n = new.len();
        if n > 0 {
            if let Some(jobs) = &self.jobs {
                if jobs.send(new.clone()).is_err() {
                    let mut st = lock(&self.shared);
                    for k in &new {
                        st.pending.remove(k);
                    }
                }
            }
        }
        n
    }

    /// The refusals and failed reads no request will take, since the last call.
    pub(super) fn untaken(&self) -> Untaken {
        std::mem::take(&mut lock(&self.shared).untaken)
    }

    /// The read of `key` if it was asked for: taken when read, waited for while being read;
    /// `None` when it was never asked for (or aged out).
    pub(super) fn take(&self, key: &RecordKey) -> Option<Read> {
        let mut st = lock(&self.shared);
        loop {
            if let Some(r) = st.done.remove(key) {
                st.bytes -= payload_len(&r);
                st.order.retain(|k| k != key);
                return Some(r);
            }
            // A thread that ended (it panicked) reads nothing more: read it now.
            if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                st.pending.clear();
            }
            if !st.pending.contains(key) {
                return None;
            }
            st = self
                .shared
                .read
                .wait_timeout(st, std::time::Duration::from_millis(100))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        // Closing the channel ends the thread after its current job.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl RankCache {
    /// Starts reading, in the background, the records this rank would read for `prompt`
    /// from the store: its pages past what the tree holds now and past the first
    /// `skip_tokens` tokens (a prefix the requests served before this one will have
    /// cached: a driver that knows the next prompt shares its beginning with the current
    /// one says so). Returns how many records were asked for. Local to this rank (no
    /// round), and changes nothing a request sees: without a store it does nothing.
    pub fn prefetch(&mut self, prompt: &[u32], skip_tokens: usize) -> Result<usize, ClusterError> {
        let Some(store) = self.storage().cloned() else {
            return Ok(0);
        };
        let ps = self.layout.page_size() as usize;
        let full = self.whole_granule_pages(prompt.len());
        let key = &prompt[..full * ps];
        let granule = self.layout.granule() as usize;
        let matched = self.tree.matched_pages(key)?;
        let skip = (skip_tokens / ps) / granule * granule;
        let from = matched.max(skip).min(full);
        if from >= full {
            return Ok(0);
        }
        let keys = RecordKey::chain(store.fingerprint(), key, ps as u32);
        let wanted = self.records_for(&keys, from, full - from);
        let prefetcher = self
            .prefetcher
            .get_or_insert_with(|| Prefetcher::start(store, self.rank.0));
        Ok(prefetcher.ask(wanted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{Deployment, ModelShape};
    use crate::storage::{DirStore, Fingerprint};

    /// A record asked for is read once and taken once (the bytes put); one never asked for
    /// is not there; reading stops at the first miss; a store's records go as they came.
    #[test]
    fn records_read_ahead_are_taken_once_and_stop_at_a_miss() {
        let dir = tempfile::tempdir().unwrap();
        let dep = Deployment::new(ModelShape::MlaBf16, 16, 2).unwrap();
        let n = crate::storage::payload_bytes(&dep, 1);
        let store: Arc<dyn PageStore> =
            Arc::new(DirStore::open(dir.path(), Fingerprint::of(&dep, 1), n, 1 << 30).unwrap());
        let key = |s: &str| RecordKey::of_name(store.fingerprint(), s);
        let (a, b, missing, after) = (key("a"), key("b"), key("missing"), key("after"));
        for (k, byte) in [(a, 1u8), (b, 2), (after, 3)] {
            store.put(&k, &vec![byte; n as usize]).unwrap();
        }
        let p = Prefetcher::start(store.clone(), 0);
        assert_eq!(p.ask(vec![a, b, missing, after]), 4);
        assert_eq!(p.ask(vec![a]), 0, "asked for already");
        let got = p.take(&b).unwrap().unwrap();
        assert_eq!(got, Lookup::Hit(vec![2u8; n as usize]));
        assert!(p.take(&b).is_none(), "taken once");
        assert!(matches!(p.take(&missing), Some(Ok(Lookup::Miss))));
        // Past the miss nothing was read.
        assert!(p.take(&after).is_none());
        assert!(matches!(p.take(&a), Some(Ok(Lookup::Hit(_)))));
        assert!(p.take(&key("never")).is_none());
        assert_eq!(store.stats().records_read, 2);
    }
}
