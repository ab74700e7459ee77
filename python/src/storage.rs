//! `cp_hicache._native.PageStore`: the storage tier's directory store for an engine's own
//! host pool (SGLang's HiCache L3 backend, `cp_hicache.sglang`): pages named by the engine's
//! chained page hashes, read from and written to the host pool's page buffers in place.

use crate::errors::usage;
use crate::object_store::PyBackend;
use cp_hicache::storage::{
    DirStore, Filled, Fingerprint, Lookup, ObjectStore, PageStore as Store, PartPut, Put,
    RecordKey, StorageError,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::path::PathBuf;

/// A page store in a directory, shared by processes (every CP rank's, and later runs'), or
/// over a Python object keeping its objects (`PageStore.over`: Mooncake Store).
#[pyclass(module = "cp_hicache._native", frozen)]
pub struct PageStore {
    store: Box<dyn Store>,
    /// The directory store, when it is one (for `path_of`).
    dir: Option<std::sync::Arc<DirStore>>,
}

/// A directory store shared with [`PageStore::dir`].
struct Shared(std::sync::Arc<DirStore>);

impl Store for Shared {
    fn fingerprint(&self) -> &Fingerprint {
        self.0.fingerprint()
    }
    fn payload_bytes(&self) -> u64 {
        self.0.payload_bytes()
    }
    fn read_only(&self) -> bool {
        self.0.is_read_only()
    }
    fn put(&self, key: &RecordKey, payload: &[u8]) -> Result<Put, StorageError> {
        self.0.put(key, payload)
    }
    fn put_part(
        &self,
        key: &RecordKey,
        part: u32,
        parts: u32,
        payload: &[u8],
        assemble: cp_hicache::storage::Assemble<'_>,
    ) -> Result<PartPut, StorageError> {
        self.0.put_part(key, part, parts, payload, assemble)
    }
    fn get(&self, key: &RecordKey) -> Result<Lookup, StorageError> {
        self.0.get(key)
    }
    fn present_run(&self, keys: &[RecordKey]) -> Result<usize, StorageError> {
        self.0.present_run(keys)
    }
    fn stats(&self) -> cp_hicache::storage::StoreStats {
        self.0.stats()
    }
    fn usage(&self) -> Result<u64, StorageError> {
        self.0.usage()
    }
}

/// One page's buffers: `(address, bytes)` each, in the order of the page's payload.
type Parts = Vec<(usize, usize)>;

impl PageStore {
    fn key(&self, name: &str) -> RecordKey {
        RecordKey::of_name(self.store.fingerprint(), name)
    }

    fn check_parts(&self, parts: &Parts) -> PyResult<()> {
        if parts.iter().any(|&(p, _)| p == 0) {
            return Err(usage("a null page buffer address"));
        }
        let total = parts
            .iter()
            .try_fold(0u64, |sum, &(_, n)| sum.checked_add(n as u64));
        if total != Some(self.store.payload_bytes()) {
            let total = total.map_or("more than 2^64".to_string(), |t| t.to_string());
            return Err(usage(format!(
                "a page of {total} bytes in {} buffers, this store's pages are {} bytes",
                parts.len(),
                self.store.payload_bytes()
            )));
        }
        Ok(())
    }

    /// The keys of the pages `names`, their buffers `parts` (one list per page) checked
    /// first: the prologue of `put_many` and `get_many`.
    fn batch_keys(&self, names: &[String], parts: &[Parts]) -> PyResult<Vec<RecordKey>> {
        if names.len() != parts.len() {
            return Err(usage(format!(
                "{} names for {} pages' buffers",
                names.len(),
                parts.len()
            )));
        }
        for p in parts {
            self.check_parts(p)?;
        }
        Ok(names.iter().map(|n| self.key(n)).collect())
    }
}

#[pymethods]
impl PageStore {
    /// Opens (creating it if need be) the store in `path` for pages described by
    /// `fingerprint` (the engine's model, dtype, layers, page size and host layout: records
    /// of other words are refused) of `page_bytes` bytes, keeping at most `capacity_bytes`.
    #[new]
    #[pyo3(signature = (path, fingerprint, page_bytes, capacity_bytes))]
    fn new(
        path: PathBuf,
        fingerprint: &str,
        page_bytes: u64,
        capacity_bytes: u64,
    ) -> PyResult<Self> {
        if page_bytes == 0 || capacity_bytes == 0 {
            return Err(usage("page_bytes and capacity_bytes must be positive"));
        }
        let store = DirStore::open(
            &path,
            Fingerprint::named(fingerprint),
            page_bytes,
            capacity_bytes,
        )
        .map_err(usage)?;
        let dir = std::sync::Arc::new(store);
        Ok(PageStore {
            store: Box::new(Shared(dir.clone())),
            dir: Some(dir),
        })
    }

    /// A store whose records are objects kept by `objects` (a
    /// `cp_hicache.mooncake.MooncakeStore`, or any object with `put_object`, `get_object`,
    /// `objects_exist` and `remove_object`), for pages described by `fingerprint` of
    /// `page_bytes` bytes: the records are a directory store's bytes, checked here on every
    /// read; the engine's capacity applies.
    #[staticmethod]
    fn over(objects: &Bound<'_, PyAny>, fingerprint: &str, page_bytes: u64) -> PyResult<Self> {
        let store = ObjectStore::new(
            PyBackend::new(objects)?,
            Fingerprint::named(fingerprint),
            page_bytes,
        )
        .map_err(usage)?;
        Ok(PageStore {
            store: Box::new(store),
            dir: None,
        })
    }

    /// Bytes of one page.
    #[getter]
    fn page_bytes(&self) -> u64 {
        self.store.payload_bytes()
    }

    /// Writes page `name` from its buffers `parts` (`[(address, bytes), ...]`, host memory
    /// the caller keeps alive and unchanged for the call); `True` once the record is whole on
    /// disk (written now, or there already), `False` when the store is read-only to this
    /// process (another user's, a read-only mount: `stats()['read_only']`).
    ///
    /// The addresses are trusted: they must be readable host memory of that many bytes, as
    /// SGLang's `get_page_buffer_meta` gives them.
    fn put(&self, py: Python<'_>, name: &str, parts: Parts) -> PyResult<bool> {
        self.check_parts(&parts)?;
        let key = self.key(name);
        let put = py.detach(|| {
            // SAFETY: the caller's contract above: each part is readable for its length
            // during this call.
            let slices: Vec<&[u8]> = parts
                .iter()
                .map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) })
                .collect();
            match slices.as_slice() {
                [one] => self.store.put(&key, one),
                many => self.store.put(&key, &many.concat()),
            }
        });
        match put {
            Ok(Put::Written { .. } | Put::Present) => Ok(true),
            // Another user's store, or a read-only mount: read, never written.
            Err(StorageError::ReadOnly(_)) => Ok(false),
            Err(e) => Err(usage(e)),
        }
    }

    /// Reads page `name` into its buffers `parts` (writable host memory, as for `put`);
    /// `False` for a miss or a refused record (torn, changed, another deployment's), which
    /// is removed and counted.
    fn get(&self, py: Python<'_>, name: &str, parts: Parts) -> PyResult<bool> {
        Ok(self.get_many(py, vec![name.to_string()], vec![parts])?[0])
    }

    /// `put` of each page of `names` from its buffers in `parts` (one list of
    /// `(address, bytes)` per page), in one batch where the store has one (a Mooncake
    /// store: one `batch_put_from`); whether each record is whole in the store. An error
    /// of any page raises it, after the others were written.
    fn put_many(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        parts: Vec<Parts>,
    ) -> PyResult<Vec<bool>> {
        let keys = self.batch_keys(&names, &parts)?;
        let puts = py.detach(|| {
            // SAFETY: as `put`: each part is readable for its length during this call.
            let joined: Vec<std::borrow::Cow<'_, [u8]>> = parts
                .iter()
                .map(|page| {
                    let slices: Vec<&[u8]> = page
                        .iter()
                        .map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) })
                        .collect();
                    match slices.as_slice() {
                        [one] => std::borrow::Cow::Borrowed(*one),
                        many => std::borrow::Cow::Owned(many.concat()),
                    }
                })
                .collect();
            let items: Vec<(RecordKey, &[u8])> = keys
                .iter()
                .zip(&joined)
                .map(|(k, p)| (*k, &p[..]))
                .collect();
            self.store.put_many(&items)
        });
        let mut out = Vec::with_capacity(puts.len());
        let mut first_error = None;
        for put in puts {
            out.push(match put {
                Ok(Put::Written { .. } | Put::Present) => true,
                Err(StorageError::ReadOnly(_)) => false,
                Err(e) => {
                    first_error.get_or_insert(e);
                    false
                }
            });
        }
        match first_error {
            Some(e) => Err(usage(e)),
            None => Ok(out),
        }
    }

    /// `get` of each page of `names` into its buffers in `parts`, in one batch where the
    /// store has one (a Mooncake store: one `batch_get_into`); whether each was read (a
    /// miss or a refused record is `False`). An error of any page raises it.
    fn get_many(
        &self,
        py: Python<'_>,
        names: Vec<String>,
        parts: Vec<Parts>,
    ) -> PyResult<Vec<bool>> {
        let keys = self.batch_keys(&names, &parts)?;
        py.detach(|| {
            // SAFETY: as documented for `get`: each part is writable host memory of its
            // length during this call, not otherwise used meanwhile.
            let mut dsts: Vec<Vec<&mut [u8]>> = parts
                .iter()
                .map(|page| {
                    page.iter()
                        .map(|&(p, n)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, n) })
                        .collect()
                })
                .collect();
            let mut out = Vec::with_capacity(keys.len());
            for got in self.store.get_many_into(&keys, &mut dsts) {
                out.push(match got.map_err(usage)? {
                    Filled::Hit => true,
                    Filled::Miss | Filled::Refused(_) => false,
                });
            }
            Ok(out)
        })
    }

    /// Writes part `part` of the `parts` parts of page `name`'s record, for an engine whose
    /// ranks each hold some of a page's tokens (vLLM's decode context parallelism): the
    /// part's payload is read from `payload` (`[(address, bytes), ...]`, host memory as for
    /// `put`; at most a page). The record becomes visible, whole, when its last part comes:
    /// that writer calls `assemble(list of the parts' payloads as bytes, in part order)`,
    /// which returns the record's payload (bytes of a page), and writes it. Returns
    /// `"held"` (kept until the other parts come), `"completed"` (this part completed the
    /// record), `"present"` (the record was there already) or `"read_only"` (the store is
    /// read-only to this process: nothing written).
    ///
    /// An `assemble` that raises, or returns anything but a page of bytes, fails the call
    /// (the parts are gone; the next writers start the record again).
    fn put_part(
        &self,
        py: Python<'_>,
        name: &str,
        part: u32,
        parts: u32,
        payload: Parts,
        assemble: Py<PyAny>,
    ) -> PyResult<&'static str> {
        if payload.iter().any(|&(p, _)| p == 0) {
            return Err(usage("a null part buffer address"));
        }
        let key = self.key(name);
        let page = self.store.payload_bytes();
        // Why assembling failed, when it was the callable's doing.
        let failure: std::sync::Mutex<Option<PyErr>> = std::sync::Mutex::new(None);
        let put = py.detach(|| {
            // SAFETY: the caller's contract above: each buffer is readable for its length
            // during this call.
            let bytes: Vec<u8> = payload
                .iter()
                .flat_map(|&(p, n)| unsafe { std::slice::from_raw_parts(p as *const u8, n) })
                .copied()
                .collect();
            let build = |all: &[Vec<u8>]| -> Option<Vec<u8>> {
                Python::attach(|py| {
                    let built = (|| -> PyResult<Vec<u8>> {
                        let list = PyList::new(py, all.iter().map(|b| PyBytes::new(py, b)))?;
                        let out = assemble.bind(py).call1((list,))?;
                        let out = out.cast::<PyBytes>().map_err(|_| {
                            usage("assemble must return the record's payload as bytes")
                        })?;
                        let v = out.as_bytes().to_vec();
                        if v.len() as u64 != page {
                            return Err(usage(format!(
                                "assemble returned {} bytes, this store's pages are {page}",
                                v.len()
                            )));
                        }
                        Ok(v)
                    })();
                    built
                        .map_err(|e| *failure.lock().unwrap_or_else(|p| p.into_inner()) = Some(e))
                        .ok()
                })
            };
            self.store.put_part(&key, part, parts, &bytes, &build)
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
        match put {
            Ok(PartPut::Held) => Ok("held"),
            Ok(PartPut::Completed { .. }) => Ok("completed"),
            Ok(PartPut::Present) => Ok("present"),
            // Another user's store, or a read-only mount: read, never written.
            Err(StorageError::ReadOnly(_)) => Ok("read_only"),
            Err(e) => Err(usage(e)),
        }
    }

    /// Whether page `name` has a record (not read: a later `get` may still refuse it).
    fn exists(&self, name: &str) -> PyResult<bool> {
        Ok(self.store.present_run(&[self.key(name)]).map_err(usage)? == 1)
    }

    /// How many of `names`, from the first, have a record.
    fn present_run(&self, names: Vec<String>) -> PyResult<usize> {
        let keys: Vec<RecordKey> = names.iter().map(|n| self.key(n)).collect();
        self.store.present_run(&keys).map_err(usage)
    }

    /// What this store did since it was opened: records written, read, refused by kind,
    /// evicted, and their bytes; and whether it is read-only to this process.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.store.stats();
        let d = PyDict::new(py);
        d.set_item("records_written", s.records_written)?;
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("already_present", s.already_present)?;
        d.set_item("records_read", s.records_read)?;
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("misses", s.misses)?;
        d.set_item("refused_torn", s.refused_torn)?;
        d.set_item("refused_checksum", s.refused_checksum)?;
        d.set_item("refused_fingerprint", s.refused_fingerprint)?;
        d.set_item("evictions", s.evictions)?;
        d.set_item("usage_bytes", self.store.usage().map_err(usage)?)?;
        d.set_item("read_only", self.store.read_only())?;
        Ok(d)
    }

    /// The file of page `name`'s record (for tests that damage one).
    fn path_of(&self, name: &str) -> PyResult<PathBuf> {
        let dir = self
            .dir
            .as_ref()
            .ok_or_else(|| usage("path_of: this store is not in a directory"))?;
        Ok(dir.path_of(&self.key(name)))
    }
}
