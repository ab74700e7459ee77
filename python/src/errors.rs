//! The package's exceptions, and the one place Rust errors become them.
//!
//! - `CacheError` (a `RuntimeError`): a failure of the cache, an executor or the JIT.
//! - `GroupError` (a `CacheError`): the CP group broke (a rank gone, a timeout, ranks that
//!   diverged); nothing more can be served on it.
//! - `CacheFullError` (a `CacheError`): a request needs more pages at once than the pools can
//!   give it, even after evicting everything unlocked (memory pressure, not a bad argument:
//!   the request was undone and smaller ones can still be served).
//! - `DivergedError` (a `CacheError`): the ranks decided a step differently (different
//!   prompts, say); the step was undone on every rank and the group goes on.
//! - `RequestAbandoned` (a `CacheError`): `finish` found that another rank ended the
//!   request with `ok=False` (its forward failed); every rank abandoned it.
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
    CacheFullError,
    CacheError,
    "A request needs more pages at once than the pools can give it (it was undone; smaller \
     ones can still be served)."
);
create_exception!(
    cp_hicache,
    DivergedError,
    CacheError,
    "The ranks decided a step differently (different prompts?): it was undone on every rank."
);
create_exception!(
    cp_hicache,
    RequestAbandoned,
    CacheError,
    "Another rank ended the request with ok=False: every rank abandoned it."
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
    m.add("CacheFullError", py.get_type::<CacheFullError>())?;
    m.add("DivergedError", py.get_type::<DivergedError>())?;
    m.add("RequestAbandoned", py.get_type::<RequestAbandoned>())?;
    Ok(())
}

/// A usage error with `message`.
pub(crate) fn usage(message: impl std::fmt::Display) -> PyErr {
    UsageError::new_err(message.to_string())
}

/// The exception for a cluster error: usage, a broken group, or a failure.
pub(crate) fn cluster(e: ClusterError) -> PyErr {
    if e.is_pool_too_small() {
        // In Python's words: the pool sizes are `RankCache` arguments, not CLI flags.
        let message = e
            .to_string()
            .replace("--device-pages", "device_pages")
            .replace("--host-pages", "host_pages");
        CacheFullError::new_err(message)
    } else if let ClusterError::Config(message) = &e {
        // A misuse (a step out of order, a finished request): the message says it all.
        UsageError::new_err(message.clone())
    } else if matches!(e, ClusterError::Diverged { .. }) {
        DivergedError::new_err(e.to_string())
    } else if matches!(e, ClusterError::Abandoned { .. }) {
        RequestAbandoned::new_err(e.to_string())
    } else if e.is_usage() {
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
