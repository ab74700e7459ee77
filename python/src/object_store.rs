//! A page store whose objects a Python object keeps (`cp_hicache.mooncake.MooncakeStore`
//! over Mooncake Store, or any object with the same four methods): the rank's
//! `ObjectStore` writes and checks the records (the bytes `DirStore` writes: header,
//! checksum, canonical key), the Python object only moves whole objects by name, the GIL
//! taken per call.
//!
//! The object's methods:
//! - `put_object(name: str, data: bytes) -> bool`: stores `data` unless `name` is there
//!   (True when written, False when it was there);
//! - `get_object(name: str) -> bytes | None`;
//! - `objects_exist(names: list[str]) -> list[bool]`;
//! - `remove_object(name: str) -> bool | None`: True when this call removed the object,
//!   False when there was none (None: cannot tell, read as True). Of callers removing one
//!   object at once at most one may be answered True: a record in parts is put by the
//!   writer whose removal of its part 0 is;
//! - optionally `usage() -> int` (bytes the store holds);
//! - optionally `remove_objects(names: list[str]) -> list[bool | None]`: `remove_object`
//!   of each in one call (each answer as `remove_object`'s; an exception instance in place
//!   of one says that object's removal failed): a batch of records in parts claims and
//!   clears their assembly in one call each;
//! - optionally, both or neither, the batch calls that read and write this process's memory
//!   at addresses given (no `bytes` made): `put_objects_from(names, addrs, sizes) -> list[bool]`
//!   (object `names[i]` stored, unless there, as the bytes of the buffers `addrs[i][j]` of
//!   `sizes[i][j]` bytes, in order; whether written) and `get_objects_into(names, addrs,
//!   sizes) -> list[int | None]` (each read into its buffers, in order: its length, read
//!   when it fits in them, its bytes first, or None when there is none). The addresses
//!   are valid for the call only. In either list an exception instance in place of an
//!   answer says that object's call failed (the others' answers stand: a batch holds a
//!   node's or a request's records, and one failed object must not take the others'
//!   writes or hits with it); an exception raised fails the whole batch. A
//!   `put_objects_from` that answers fewer objects than it was given fails them all.
//! - optionally `gathers_puts: bool` (read once): true when `put_objects_from` moves an
//!   object's several buffers as they are (no join); the page store then hands it each
//!   record as two buffers, its header and the page in place, instead of copying the page
//!   behind its header first.

use cp_hicache::storage::{get_each_into, put_each, ObjectBackend, StorageError};
use pyo3::exceptions::PyBaseException;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The methods a Python object must have to keep a page store's objects.
pub const METHODS: [&str; 4] = ["put_object", "get_object", "objects_exist", "remove_object"];

/// The optional batch methods at addresses (both, or neither, are used).
pub const BATCH_METHODS: [&str; 2] = ["put_objects_from", "get_objects_into"];

/// An [`ObjectBackend`] calling a Python object's methods.
pub struct PyBackend {
    obj: Py<PyAny>,
    /// The object's class, for error messages.
    what: String,
    /// Whether it has [`BATCH_METHODS`].
    batched: bool,
    /// Whether it is batched and says `gathers_puts`.
    gathers: bool,
    /// Whether it has `remove_objects`.
    removes_many: bool,
}

impl PyBackend {
    /// `obj`, checked to have [`METHODS`].
    pub fn new(obj: &Bound<'_, PyAny>) -> PyResult<PyBackend> {
        let missing: Vec<&str> = METHODS
            .iter()
            .copied()
            .filter(|m| !obj.hasattr(*m).unwrap_or(false))
            .collect();
        let what = obj
            .get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "?".into());
        if !missing.is_empty() {
            return Err(crate::errors::usage(format!(
                "a store object needs the methods {}; a {what} lacks {}",
                METHODS.join(", "),
                missing.join(", ")
            )));
        }
        let batched = BATCH_METHODS
            .iter()
            .all(|m| obj.hasattr(*m).unwrap_or(false));
        let gathers = batched
            && obj
                .getattr("gathers_puts")
                .and_then(|g| g.is_truthy())
                .unwrap_or(false);
        let removes_many = obj.hasattr("remove_objects").unwrap_or(false);
        Ok(PyBackend {
            obj: obj.clone().unbind(),
            what,
            batched,
            gathers,
            removes_many,
        })
    }

    fn call<T>(
        &self,
        method: &str,
        f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<T>,
    ) -> Result<T, StorageError> {
        Python::attach(|py| {
            f(self.obj.bind(py))
                .map_err(|e| StorageError::Backend(format!("{}.{method} failed: {e}", self.what)))
        })
    }
}

impl ObjectBackend for PyBackend {
    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<bool, StorageError> {
        self.call("put_object", |o| {
            let data = PyBytes::new(o.py(), bytes);
            o.call_method1("put_object", (name, data))?.is_truthy()
        })
    }

    fn get(&self, name: &str) -> Result<Option<Vec<u8>>, StorageError> {
        self.call("get_object", |o| {
            let got = o.call_method1("get_object", (name,))?;
            if got.is_none() {
                return Ok(None);
            }
            let b = got
                .cast::<PyBytes>()
                .map_err(|_| crate::errors::usage("get_object must return bytes or None"))?;
            Ok(Some(b.as_bytes().to_vec()))
        })
    }

    fn exist(&self, names: &[String]) -> Result<Vec<bool>, StorageError> {
        self.call("objects_exist", |o| {
            let got: Vec<bool> = o
                .call_method1("objects_exist", (names.to_vec(),))?
                .extract()?;
            if got.len() != names.len() {
                return Err(crate::errors::usage(format!(
                    "objects_exist returned {} answers for {} names",
                    got.len(),
                    names.len()
                )));
            }
            Ok(got)
        })
    }

    fn remove(&self, name: &str) -> Result<bool, StorageError> {
        self.call("remove_object", |o| {
            let got = o.call_method1("remove_object", (name,))?;
            // None (an object that cannot tell) counts as removed.
            Ok(got.is_none() || got.is_truthy()?)
        })
    }

    fn remove_many(&self, names: &[String]) -> Vec<Result<bool, StorageError>> {
        if !self.removes_many {
            return names.iter().map(|n| self.remove(n)).collect();
        }
        let got = self.call("remove_objects", |o| {
            let got = o.call_method1("remove_objects", (names.to_vec(),))?;
            let got: Vec<Result<Option<bool>, StorageError>> =
                self.answers("remove_objects", &got, names.len())?;
            // None (an object that cannot tell) counts as removed.
            Ok(got
                .into_iter()
                .map(|a| a.map(|r| r.unwrap_or(true)))
                .collect())
        });
        spread(got, names.len())
    }

    fn usage(&self) -> Result<u64, StorageError> {
        self.call("usage", |o| {
            if o.hasattr("usage")? {
                o.call_method0("usage")?.extract()
            } else {
                Ok(0)
            }
        })
    }

    fn batches(&self) -> bool {
        self.batched
    }

    fn gathers(&self) -> bool {
        self.gathers
    }

    fn put_many(&self, items: &[(String, Vec<&[u8]>)]) -> Vec<Result<bool, StorageError>> {
        if !self.batched {
            return put_each(self, items);
        }
        let names: Vec<&str> = items.iter().map(|(n, _)| n.as_str()).collect();
        let addrs: Vec<Vec<usize>> = items
            .iter()
            .map(|(_, s)| s.iter().map(|b| b.as_ptr() as usize).collect())
            .collect();
        let sizes: Vec<Vec<usize>> = items
            .iter()
            .map(|(_, s)| s.iter().map(|b| b.len()).collect())
            .collect();
        // The slices stay borrowed, unchanged, for the call.
        let got = self.call("put_objects_from", |o| {
            let got = o.call_method1("put_objects_from", (names, addrs, sizes))?;
            self.answers("put_objects_from", &got, items.len())
        });
        spread(got, items.len())
    }

    fn get_many_into(
        &self,
        names: &[String],
        dsts: &mut [Vec<&mut [u8]>],
    ) -> Vec<Result<Option<usize>, StorageError>> {
        if !self.batched {
            return get_each_into(self, names, dsts);
        }
        let addrs: Vec<Vec<usize>> = dsts
            .iter_mut()
            .map(|d| d.iter_mut().map(|s| s.as_mut_ptr() as usize).collect())
            .collect();
        let sizes: Vec<Vec<usize>> = dsts
            .iter()
            .map(|d| d.iter().map(|s| s.len()).collect())
            .collect();
        // The slices stay borrowed, written only by the callee, for the call.
        let got = self.call("get_objects_into", |o| {
            let got = o.call_method1("get_objects_into", (names.to_vec(), addrs, sizes))?;
            self.answers("get_objects_into", &got, names.len())
        });
        spread(got, names.len())
    }
}

impl PyBackend {
    /// The `n` answers of a batch method in `got`: each extracted, or the error of an
    /// exception instance in its place (that object's call failed).
    fn answers<'py, T: FromPyObjectOwned<'py>>(
        &self,
        method: &str,
        got: &Bound<'py, PyAny>,
        n: usize,
    ) -> PyResult<Vec<Result<T, StorageError>>> {
        let got: Vec<Bound<'py, PyAny>> = got.extract()?;
        if got.len() != n {
            return Err(crate::errors::usage(format!(
                "{method} returned {} answers for {n} objects",
                got.len()
            )));
        }
        got.iter()
            .map(|a| match a.cast::<PyBaseException>() {
                Ok(e) => Ok(Err(StorageError::Backend(format!(
                    "{}.{method} failed: {e}",
                    self.what
                )))),
                Err(_) => a.extract::<T>().map(Ok).map_err(Into::into),
            })
            .collect()
    }
}

/// One answer per item: the call's (each its own), or its error for every item.
fn spread<T>(
    got: Result<Vec<Result<T, StorageError>>, StorageError>,
    n: usize,
) -> Vec<Result<T, StorageError>> {
    match got {
        Ok(v) => v,
        Err(e) => {
            let why = e.to_string();
            (0..n)
                .map(|_| Err(StorageError::Backend(why.clone())))
                .collect()
        }
    }
}
