//! The third tier: a page store under device and host memory that outlives the process.
//!
//! Records are *canonical*: one per sequence page (`page_size` consecutive tokens of a
//! prompt), holding every layer of every buffer kind of the deployment (NSA's `kv` and
//! `index_k` together, never one without the other), each page in the layout of a page
//! that holds consecutive tokens. A record's key ([`RecordKey`]) chains the tokens up to and
//! including its page, salted with the deployment's [`Fingerprint`], which leaves out the
//! CP degree, the rank and the layout: a store written by CP 8 is read by CP 1. Synthesised
//! KV is a function of a token's prefix hash and layer alone (its slot places the bytes, it
//! does not change them), so a record verifies under any topology.
//!
//! [`PageStore`] is what the rank needs from a store; [`DirStore`] is the embedded one, a
//! directory shared by every rank's process and by later runs. A store over an existing
//! distributed engine (Mooncake Store, 3FS) implements the same trait.

mod bench;
mod dir;
mod fault;
mod fsx;
mod key;
mod object;
mod parts;
pub mod record;

pub use bench::bench_store;
pub use dir::{Clock, DirStore};

pub use fault::{Damage, DamagingStore};
pub use key::{Fingerprint, RecordKey};
pub use object::{get_each_into, object_name, put_each, MemObjects, ObjectBackend, ObjectStore};
pub use parts::PageSlots;
pub use record::{RecordError, Refusal};
use serde::Serialize;

/// Refuses a whole record's payload that is not `payload_bytes` long (a store's `put`).
pub(crate) fn check_payload(
    key: &RecordKey,
    payload: &[u8],
    payload_bytes: u64,
) -> Result<(), StorageError> {
    if payload.len() as u64 != payload_bytes {
        return Err(StorageError::Config(format!(
            "a {}-byte payload for record {key}, this deployment's pages are {payload_bytes} \
             bytes",
            payload.len()
        )));
    }
    Ok(())
}

/// Refuses a part that cannot be part `part` of `parts` of a record of `payload_bytes`
/// (a store's `put_part`): empty, longer than a record, or numbered past the parts.
pub(crate) fn check_part(
    key: &RecordKey,
    part: u32,
    parts: u32,
    payload: &[u8],
    payload_bytes: u64,
) -> Result<(), StorageError> {
    if payload.is_empty() || payload.len() as u64 > payload_bytes || part >= parts {
        return Err(StorageError::Config(format!(
            "part {part} of {parts} of record {key} with a {}-byte payload, this \
             deployment's pages are {payload_bytes} bytes (a part holds some of a page's \
             tokens)",
            payload.len()
        )));
    }
    Ok(())
}

/// Bytes of one record's payload for `dep` with `layers` layers: every layer of every
/// buffer kind of one page, buffer kinds in the model's order, layers in order.
pub fn payload_bytes(dep: &crate::kernels::Deployment, layers: u32) -> u64 {
    dep.model
        .buffers()
        .iter()
        .map(|b| b.page_bytes(dep.page_size) * u64::from(layers))
        .sum()
}

/// Why a store could not do what was asked (not a refused record: that is a [`Lookup`]).
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    /// The file system failed.
    #[error("storage: cannot {what}: {source}")]
    Io {
        /// What was being done, and to which path.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The store was set up or called wrongly.
    #[error("storage: {0}")]
    Config(String),
    /// The engine under an [`ObjectStore`] failed (Mooncake Store's master gone, a client
    /// call raised).
    #[error("storage: {0}")]
    Backend(String),
    /// Something else is where the store keeps a file or folder of its own (a link, a
    /// FIFO): the store follows and reads none, so it cannot be used until that is moved.
    #[error(
        "storage: {} is {found}, not the {want} the store keeps there (the store follows no \
         link and reads no FIFO): move it away",
        path.display()
    )]
    NotOurs {
        /// Where.
        path: std::path::PathBuf,
        /// What is there, in words.
        found: &'static str,
        /// What the store keeps there: `file` or `folder`.
        want: &'static str,
    },
    /// A write to a store this process may only read (a read-only mount, another user's
    /// store).
    #[error("storage: {} is read-only to this process: its records are read, none written", .0.display())]
    ReadOnly(std::path::PathBuf),
}

/// What [`PageStore::put`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Put {
    /// The record was written; keeping the byte budget evicted `evicted` older records.
    Written {
        /// Records evicted to make room.
        evicted: u64,
    },
    /// A record of this key was there already (its writer wrote the same bytes).
    Present,
}

/// What [`PageStore::put_part`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartPut {
    /// The part is kept until the record's other parts come.
    Held,
    /// This part completed the record, which was assembled and written.
    Completed {
        /// Records evicted to make room.
        evicted: u64,
    },
    /// The record was there already (whole); the part was not kept.
    Present,
}

/// Builds a record's payload from its parts' payloads, in part order; `None` when a part
/// is not of the size its writer's layout gives it.
pub type Assemble<'a> = &'a dyn Fn(&[Vec<u8>]) -> Option<Vec<u8>>;

/// One part for [`PageStore::put_parts`]: the arguments of a [`PageStore::put_part`].
pub struct PartItem<'a> {
    /// The record's key.
    pub key: RecordKey,
    /// Which part this is, of `parts`.
    pub part: u32,
    /// How many parts the record has.
    pub parts: u32,
    /// The part's payload.
    pub payload: &'a [u8],
    /// Builds the record's payload from its parts', for the writer that completes it.
    pub assemble: Assemble<'a>,
}

/// What [`PageStore::get`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// The record's payload, its header and checksum checked.
    Hit(Vec<u8>),
    /// No record of this key.
    Miss,
    /// A record whose bytes were refused (served as a miss, counted).
    Refused(RecordError),
}

/// Copies `bytes` into `dst`'s slices in order, as far as both go.
pub(crate) fn scatter(bytes: &[u8], dst: &mut [&mut [u8]]) {
    let mut at = 0;
    for d in dst.iter_mut() {
        let n = d.len().min(bytes.len().saturating_sub(at));
        d[..n].copy_from_slice(&bytes[at..at + n]);
        at += n;
    }
}

/// What [`PageStore::get_many_into`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Filled {
    /// The record's payload is in the caller's buffers, its header and checksum checked.
    Hit,
    /// No record of this key.
    Miss,
    /// A record whose bytes were refused (served as a miss, counted).
    Refused(RecordError),
}

/// What a store has done since it was opened (this process's view).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StoreStats {
    /// Records written.
    pub records_written: u64,
    /// Bytes written (headers included).
    pub bytes_written: u64,
    /// Writes skipped: the record was there.
    pub already_present: u64,
    /// Records read and accepted.
    pub records_read: u64,
    /// Bytes of them (headers included).
    pub bytes_read: u64,
    /// Reads that found no record.
    pub misses: u64,
    /// Records refused as torn.
    pub refused_torn: u64,
    /// Records refused by their checksum (or misfiled).
    pub refused_checksum: u64,
    /// Records of another deployment or format refused.
    pub refused_fingerprint: u64,
    /// Records evicted to keep the byte budget.
    pub evictions: u64,
    /// Bytes evicted.
    pub evicted_bytes: u64,
}

/// What a rank needs from a page store. Every call may run beside other processes using
/// the same store.
pub trait PageStore: Send + Sync {
    /// The deployment whose records this store reads and writes.
    fn fingerprint(&self) -> &Fingerprint;

    /// Bytes of one record's payload.
    fn payload_bytes(&self) -> u64;

    /// Whether this process may only read the store: its writes are refused
    /// ([`StorageError::ReadOnly`]), so a rank makes none.
    fn read_only(&self) -> bool {
        false
    }

    /// Stores `payload` as the record of `key`, visible whole or not at all.
    fn put(&self, key: &RecordKey, payload: &[u8]) -> Result<Put, StorageError>;

    /// Stores `payload` as part `part` of the `parts` parts of `key`'s record, for a layout
    /// that splits a sequence page across ranks (each rank writes its tokens, packed: at
    /// most a record's payload). The record
    /// becomes visible, whole, when its last part comes: that writer assembles the parts
    /// with `assemble` and writes the record as [`put`](Self::put) does.
    fn put_part(
        &self,
        key: &RecordKey,
        part: u32,
        parts: u32,
        payload: &[u8],
        assemble: Assemble<'_>,
    ) -> Result<PartPut, StorageError>;

    /// [`put_part`](Self::put_part) of each of `items`, in a few calls of an engine for
    /// them all where the store batches (an [`ObjectStore`]): one answer per item, in
    /// order.
    fn put_parts(&self, items: &[PartItem<'_>]) -> Vec<Result<PartPut, StorageError>> {
        items
            .iter()
            .map(|i| self.put_part(&i.key, i.part, i.parts, i.payload, i.assemble))
            .collect()
    }

    /// The record of `key`, checked.
    fn get(&self, key: &RecordKey) -> Result<Lookup, StorageError>;

    /// Whether [`put_many`](Self::put_many) and [`get_many`](Self::get_many) make one call
    /// of an engine for a whole batch (an [`ObjectStore`] whose backend has batch calls), so
    /// that a rank hands them a request's records at once. Otherwise (a directory: a file
    /// per record either way) a rank reads one record at a time, up to its first miss.
    fn batches(&self) -> bool {
        false
    }

    /// [`put`](Self::put) of each `(key, payload)`, in one batch where the store can (an
    /// [`ObjectStore`] makes one call of its engine): one answer per item, in order.
    fn put_many(&self, items: &[(RecordKey, &[u8])]) -> Vec<Result<Put, StorageError>> {
        items.iter().map(|(k, p)| self.put(k, p)).collect()
    }

    /// [`get`](Self::get) of each of `keys`, in one batch where the store can: one answer
    /// per key, in order.
    fn get_many(&self, keys: &[RecordKey]) -> Vec<Result<Lookup, StorageError>> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    /// [`get_many`](Self::get_many) into the caller's memory: record `keys[i]`'s payload
    /// goes to the slices of `dsts[i]`, in order (their lengths add up to a payload). A
    /// miss or a refusal leaves them as they were.
    fn get_many_into(
        &self,
        keys: &[RecordKey],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Vec<Result<Filled, StorageError>> {
        self.get_many(keys)
            .into_iter()
            .zip(dsts.iter_mut())
            .map(|(got, dst)| {
                Ok(match got? {
                    Lookup::Hit(payload) => {
                        scatter(&payload, dst);
                        Filled::Hit
                    }
                    Lookup::Miss => Filled::Miss,
                    Lookup::Refused(e) => Filled::Refused(e),
                })
            })
            .collect()
    }

    /// How many of `keys`, from the first, have a record (a prefix's run in the store),
    /// without reading them.
    fn present_run(&self, keys: &[RecordKey]) -> Result<usize, StorageError>;

    /// This process's counts.
    fn stats(&self) -> StoreStats;

    /// Bytes of records the store holds now, over every process (for a [`DirStore`], with
    /// the parts and files aside that count against its budget).
    fn usage(&self) -> Result<u64, StorageError>;
}

#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod tests;
