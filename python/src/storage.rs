//! `cp_hicache._native.PageStore`: the storage tier's directory store for an engine's own
//! host pool (SGLang's HiCache L3 backend, `cp_hicache.sglang`): pages named by the engine's
//! chained page hashes, read from and written to the host pool's page buffers in place.

use crate::errors::usage;
use cp_hicache::storage::{
    DirStore, Fingerprint, Lookup, PageStore as _, Put, RecordKey, StorageError,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;

/// A page store in a directory, shared by processes (every CP rank's, and later runs').
#[pyclass(module = "cp_hicache._native", frozen)]
pub struct PageStore {
    store: DirStore,
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
        Ok(PageStore { store })
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
        self.check_parts(&parts)?;
        let key = self.key(name);
        py.detach(|| match self.store.get(&key) {
            Ok(Lookup::Hit(payload)) => {
                let mut at = 0;
                for &(p, n) in &parts {
                    // SAFETY: the caller's contract: each part is writable for its length
                    // during this call, and the payload holds their total (checked above
                    // against the store's page size, which the store checked on read).
                    unsafe {
                        std::ptr::copy_nonoverlapping(payload[at..].as_ptr(), p as *mut u8, n)
                    };
                    at += n;
                }
                Ok(true)
            }
            Ok(Lookup::Miss | Lookup::Refused(_)) => Ok(false),
            Err(e) => Err(usage(e)),
        })
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
        d.set_item("read_only", self.store.is_read_only())?;
        Ok(d)
    }

    /// The file of page `name`'s record (for tests that damage one).
    fn path_of(&self, name: &str) -> PathBuf {
        self.store.path_of(&self.key(name))
    }
}
