//! `RankCache`: one CP rank's cache, as an engine process hosts it (the core crate's
//! `cp_hicache::rank::RankCache`), agreeing with its peers through a Python collective.
//!
//! Calls that may wait on peers or run kernels release the GIL; the collective takes it
//! back for each round. Token ids and page ids cross the boundary as little-endian `u32`
//! bytes (the Python wrapper turns NumPy arrays into them and back).
//!
//! Split by concern, each file one `#[pymethods]` block of the class (PyO3's
//! `multiple-pymethods`):
//! - this file: the object, its pool views, and how a call reaches the rank ([`RankCache::with`],
//!   [`RankCache::between_steps`]);
//! - [`construct`]: start-up, the garbage collector's hooks, `close`, the fixed properties;
//! - [`config`]: settings changed after start-up (layer waits, the storage tier, test knobs);
//! - [`steps`]: a request's steps (`begin`, `extend`, `finish`, ...) and `serve`;
//! - [`pools`]: the device pools as tensors, and where pages and tokens live in them;
//! - [`stats`]: digests, invariants and verdicts;
//! - [`request`]: the `Request` class a step returns;
//! - [`convert`]: arguments and results across the boundary.

mod batch;
mod config;
mod construct;
mod convert;
mod pools;
mod request;
mod stats;
mod steps;

pub use request::Request;

use crate::collective::{GroupSlot, InterruptSlot};
use crate::errors::{usage, CacheError};
use crate::Deployment;
use cp_hicache::exec::Address;
use cp_hicache::kernels::BufferKind;
use cp_hicache::layout::CpLayout;
use cp_hicache::rank::{PoolGeometry, RankCache as CoreRank};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Where a pool is mapped in this process, and how many bytes the mapping holds (`None` in
/// [`RankCache::pools`] for an engine's adopted memory, which has no single mapping).
type Mapping = (Address, usize);

/// One CP rank's cache: its radix-tree and allocator replicas, its host pool, its device
/// pools (shared with its peers) and its kernels.
#[pyclass(module = "cp_hicache._native", frozen, weakref)]
pub struct RankCache {
    /// The rank; `None` once closed and no view of its pools is left (then its memory is
    /// freed, at once, not when the garbage collector gets to this object).
    inner: Arc<Mutex<Option<CoreRank>>>,
    /// Pool objects and DLPack tensors taken from this cache and still alive.
    views: Arc<AtomicUsize>,
    /// Tells this cache's requests from another's.
    id: u64,
    deployment: Deployment,
    rank: u8,
    /// Fixed at start-up, so that `locate` and `pool` never wait behind a step holding the
    /// rank's lock (a step can sit in a collective round for as long as a peer is slow).
    layout: CpLayout,
    /// Every buffer kind's pool per owner (this rank's own at `rank`), as addresses, with
    /// the size of each mapping (a peer's is the size it was imported with).
    pools: Vec<(BufferKind, Vec<Option<Mapping>>)>,
    geometry: PoolGeometry,
    /// After `close`: every call is refused, but the pools stay mapped until the last
    /// tensor taken from them is gone (each holds this object).
    closed: Arc<AtomicBool>,
    /// The Python group object, visible to the garbage collector (`__traverse__`,
    /// `__clear__`); `None` for a single rank's own group.
    group: Option<GroupSlot>,
    /// An interrupt raised inside the group's `exchange`, raised again as itself.
    interrupt: Option<InterruptSlot>,
    /// The engine tensors the pools adopted (`device_buffers=`), kept alive for as long as
    /// this object, which outlives the rank (declared last: dropped after `inner`).
    adopted: Option<Py<PyAny>>,
}

/// A live view of a cache's pools (a `Pool` object, a DLPack tensor): while any is alive a
/// closed cache keeps its memory; the last one to go frees it.
pub(crate) struct ViewToken {
    core: Arc<Mutex<Option<CoreRank>>>,
    views: Arc<AtomicUsize>,
    closed: Arc<AtomicBool>,
}

impl ViewToken {
    fn new(
        core: &Arc<Mutex<Option<CoreRank>>>,
        views: &Arc<AtomicUsize>,
        closed: &Arc<AtomicBool>,
    ) -> ViewToken {
        views.fetch_add(1, Ordering::AcqRel);
        ViewToken {
            core: core.clone(),
            views: views.clone(),
            closed: closed.clone(),
        }
    }

    /// Another view of the same pools (a tensor taken from a `Pool`).
    pub(crate) fn another(&self) -> ViewToken {
        ViewToken::new(&self.core, &self.views, &self.closed)
    }
}

impl Drop for ViewToken {
    fn drop(&mut self) {
        if self.views.fetch_sub(1, Ordering::AcqRel) == 1 && self.closed.load(Ordering::Acquire) {
            drop(self.core.lock().unwrap_or_else(|p| p.into_inner()).take());
        }
    }
}

thread_local! {
    /// The caches whose call is running on this thread: a call into one of them from inside
    /// its own group's `exchange` would wait for the lock its caller holds.
    static IN_CALL: std::cell::RefCell<Vec<u64>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Takes a cache off [`IN_CALL`] when its call ends, however it ends.
struct InCall(u64);

impl Drop for InCall {
    fn drop(&mut self) {
        IN_CALL.with(|c| c.borrow_mut().retain(|&id| id != self.0));
    }
}

impl RankCache {
    /// Refuses a request another cache began: its pages and locks are not this one's.
    fn owns(&self, req: &Request) -> PyResult<()> {
        if req.cache != self.id {
            return Err(usage(
                "this request was begun by another RankCache: only that cache can take its steps",
            ));
        }
        Ok(())
    }

    /// Runs `f` on the rank with the GIL released: the rank may wait on its peers, and its
    /// collective takes the GIL back for each round. (Taking the rank's lock while holding
    /// the GIL could deadlock against a thread inside a collective round.)
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CoreRank) -> R + Send,
    ) -> PyResult<R> {
        self.check_callable()?;
        IN_CALL.with(|c| c.borrow_mut().push(self.id));
        let _in_call = InCall(self.id);
        let out = self.with_locked(py, f);
        // An interrupt inside a round failed the call with a transport error; raise the
        // interrupt itself, as Python would have.
        if let Some(e) = self
            .interrupt
            .as_ref()
            .and_then(|s| s.lock().unwrap_or_else(|p| p.into_inner()).take())
        {
            return Err(e);
        }
        out
    }

    fn closed_error(&self) -> PyErr {
        CacheError::new_err(format!("rank {}: this RankCache was closed", self.rank))
    }

    /// Refuses a call on a closed cache, or one made from inside this cache's own group's
    /// `exchange` (a round of a call still running on this thread, which holds the rank).
    fn check_callable(&self) -> PyResult<()> {
        if self.closed.load(Ordering::Acquire) {
            return Err(self.closed_error());
        }
        if IN_CALL.with(|c| c.borrow().contains(&self.id)) {
            return Err(usage(format!(
                "rank {}: a call into this RankCache from inside its own group's exchange (a \
                 round of a call still running) would wait for itself for ever: refused",
                self.rank
            )));
        }
        Ok(())
    }

    /// Runs `f` on the rank between its steps, without waiting: a read of its state while a
    /// step runs on another thread (perhaps waiting on its peers for as long as the slowest
    /// one) is refused at once, since the state mid-step is neither the old one nor the new.
    fn between_steps<R>(&self, f: impl FnOnce(&CoreRank) -> R) -> PyResult<R> {
        self.check_callable()?;
        match self.inner.try_lock() {
            Ok(rank) => rank.as_ref().map(f).ok_or_else(|| self.closed_error()),
            Err(std::sync::TryLockError::WouldBlock) => Err(CacheError::new_err(format!(
                "rank {}: a step is running on this cache (it may be waiting on its peers): its \
                 state is read between steps, once that step returns",
                self.rank
            ))),
            Err(std::sync::TryLockError::Poisoned(_)) => Err(CacheError::new_err(format!(
                "rank {}: an earlier call panicked, so this rank's state is unknown; rebuild \
                 the group's caches",
                self.rank
            ))),
        }
    }

    fn with_locked<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut CoreRank) -> R + Send,
    ) -> PyResult<R> {
        py.detach(|| {
            // A call that panicked (a PanicException) may have left the rank half-changed:
            // refuse to go on from an unknown state.
            let mut rank = self.inner.lock().map_err(|_| {
                CacheError::new_err(format!(
                    "rank {}: an earlier call panicked, so this rank's state is unknown; \
                     rebuild the group's caches",
                    self.rank
                ))
            })?;
            rank.as_mut().map(f).ok_or_else(|| self.closed_error())
        })
    }
}
