//! The package's exceptions, and the one place Rust errors become them.
//!
//! - `CacheError` (a `RuntimeError`): a failure of the cache, an executor or the JIT.
//! - `GroupError` (a `CacheError`): the CP group broke (a rank gone, a timeout, ranks that
//!   diverged); nothing more can be served on it.
//! - `UsageError` (a `ValueError`): bad arguments or settings, what the command line refuses
//!   with exit status 2.
//!
//! Every message is the Rust error's, which names the rank, the step and the values.

use cp_hicache::rank::ClusterError;
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    cp_hicache,
    CacheError,
    PyRuntimeError,
    "A failure of the cache, an executor or the JIT (the message is the Rust error's)."
);
create_exception!(
    cp_hicache,
    GroupError,
    CacheError,
    "The CP group broke (a rank gone, a timeout, diverged ranks): nothing more can be served."
);
create_exception!(
    cp_hicache,
    UsageError,
    PyValueError,
    "Bad arguments or settings (what the command line refuses with exit status 2)."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("CacheError", py.get_type::<CacheError>())?;
    m.add("GroupError", py.get_type::<GroupError>())?;
    m.add("UsageError", py.get_type::<UsageError>())?;
    Ok(())
}

/// A usage error with `message`.
pub(crate) fn usage(message: impl std::fmt::Display) -> PyErr {
    UsageError::new_err(message.to_string())
}

/// The exception for a cluster error: usage, a broken group, or a failure.
pub(crate) fn cluster(e: ClusterError) -> PyErr {
    if e.is_usage() {
        UsageError::new_err(e.to_string())
    } else if e.is_group_broken() {
        GroupError::new_err(e.to_string())
    } else {
        CacheError::new_err(e.to_string())
    }
}

/// The exception for any error of the core crate.
pub(crate) fn to_py(e: impl Into<cp_hicache::Error>) -> PyErr {
    match e.into() {
        cp_hicache::Error::Cluster(c) => cluster(c),
        e if e.is_usage() => UsageError::new_err(e.to_string()),
        e => CacheError::new_err(e.to_string()),
    }
}
