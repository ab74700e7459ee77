//! `RankCache`: one CP rank's cache, as an engine process hosts it (the core crate's
//! `cp_hicache::rank::RankCache`), agreeing with its peers through a Python collective.
//!
//! Calls that may wait on peers or run kernels release the GIL; the collective takes it
//! back for each round. Token ids and page ids cross the boundary as little-endian `u32`
//! bytes (the Python wrapper turns NumPy arrays into them and back).

use crate::collective::{GroupSlot, InterruptSlot, PyCollective};
use crate::dlpack::Pool;
use crate::errors::{cluster, to_py, usage, CacheError};
use crate::Deployment;
use cp_hicache::exec::Address;
use cp_hicache::group::{Collective, LocalGroup, DEFAULT_TIMEOUT};
use cp_hicache::jit::open_executor;
use cp_hicache::jit::{Jit, JitConfig, Sanitize};
use cp_hicache::kernels::BufferKind;
use cp_hicache::layout::{CpLayout, PageId, Placement};
use cp_hicache::rank::{
    ClusterConfig, Fault, PeerAccess, PoolGeometry, RankCache as CoreRank, Request as CoreRequest,
    RequestStats, WritePolicy,
};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// One CP rank's cache: its radix-tree and allocator replicas, its host pool, its device
/// pools (shared with its peers) and its kernels.
/// Where a pool is mapped in this process, and how many bytes the mapping holds (`None` in
/// [`RankCache::pools`] for an engine's adopted memory, which has no single mapping).
type Mapping = (Address, usize);

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

/// A page count argument: a whole number in `1..=u32::MAX`, or a `UsageError` naming it.
fn pages_arg(value: &Bound<'_, PyAny>, name: &str) -> PyResult<u32> {
    let bad = || {
        let shown = value
            .repr()
            .map_or_else(|_| "?".to_string(), |r| r.to_string());
        usage(format!(
            "{name}={shown}: a page count is a whole number from 1 to {}",
            u32::MAX
        ))
    };
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad());
    }
    let n: i64 = value.extract().map_err(|_| bad())?;
    u32::try_from(n).ok().filter(|&n| n > 0).ok_or_else(bad)
}

/// `u32` ids from little-endian bytes.
fn ids(bytes: &[u8], what: &str) -> PyResult<Vec<u32>> {
    if bytes.len() % 4 != 0 {
        return Err(usage(format!(
            "{what}: {} bytes is not a whole number of u32 ids",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect())
}

/// Little-endian bytes of `u32` ids.
fn id_bytes<'py>(py: Python<'py>, v: impl IntoIterator<Item = u32>) -> Bound<'py, PyBytes> {
    let b: Vec<u8> = v.into_iter().flat_map(u32::to_le_bytes).collect();
    PyBytes::new(py, &b)
}

/// A JSON value as a Python object (dicts, lists, numbers, strings, None).
pub(crate) fn to_object(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
    use pyo3::IntoPyObjectExt;
    Ok(match v {
        serde_json::Value::Null => py.None(),
        serde_json::Value::Bool(b) => b.into_py_any(py)?,
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_py_any(py)?,
            (None, Some(i)) => i.into_py_any(py)?,
            _ => n.as_f64().unwrap_or(f64::NAN).into_py_any(py)?,
        },
        serde_json::Value::String(s) => s.into_py_any(py)?,
        serde_json::Value::Array(a) => a
            .iter()
            .map(|x| to_object(py, x))
            .collect::<PyResult<Vec<_>>>()?
            .into_py_any(py)?,
        serde_json::Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, to_object(py, x)?)?;
            }
            d.into_any().unbind()
        }
    })
}

/// A request's statistics as a dict.
fn stats_object(py: Python<'_>, stats: &RequestStats) -> PyResult<Py<PyAny>> {
    let v = serde_json::to_value(stats).map_err(|e| CacheError::new_err(e.to_string()))?;
    let out = to_object(py, &v)?;
    out.bind(py)
        .set_item("first_mismatched_token", stats.first_mismatched_token)?;
    Ok(out)
}

/// A request between its steps (`RankCache.begin` … `finish`).
#[pyclass(module = "cp_hicache._native", frozen)]
pub struct Request {
    inner: Mutex<CoreRequest>,
    /// The cache that began it: no other may take its steps.
    cache: u64,
    /// The deployment's layers, the range of `wait_layer`.
    layers: u32,
}

impl Request {
    fn lock(&self) -> MutexGuard<'_, CoreRequest> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[pymethods]
impl Request {
    /// Logical pages of the sequence so far (u32 bytes): the cached prefix, then the pages
    /// allocated to compute into.
    #[getter]
    fn pages<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        // Every lock is taken with the GIL released: a step in flight holds it while its
        // collective round needs the GIL.
        let pages: Vec<u32> = py.detach(|| self.lock().pages().iter().map(|p| p.0).collect());
        id_bytes(py, pages)
    }

    /// Leading pages that came from the cache (device hits, then loaded pages).
    #[getter]
    fn cached_pages(&self, py: Python<'_>) -> usize {
        py.detach(|| self.lock().cached_pages())
    }

    /// The tokens so far (u32 bytes): the prompt's taken part, then what `extend` added.
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let tokens: Vec<u32> = py.detach(|| self.lock().tokens().to_vec());
        id_bytes(py, tokens)
    }

    /// The first token whose KV the engine's next forward writes.
    #[getter]
    fn computed_from(&self, py: Python<'_>) -> usize {
        py.detach(|| self.lock().computed_from())
    }

    /// Leading pages the tree holds (the cached prefix, then pages `extend` inserted
    /// unfinished).
    #[getter]
    fn pages_in_tree(&self, py: Python<'_>) -> usize {
        py.detach(|| self.lock().pages_in_tree())
    }

    /// Layers of the load-back in flight (0 when nothing is loaded back).
    #[getter]
    fn loading_layers(&self, py: Python<'_>) -> u32 {
        py.detach(|| self.lock().load().map_or(0, |l| l.layers()))
    }

    /// Makes work enqueued from now on wait for layer `layer` of the load-back (a
    /// device-side wait; immediate on the CPU): the cache's own work, or with `stream` (a raw
    /// `CUstream` of the device's primary context, the Python wrapper checked it is an int in
    /// u64) the engine's work on that stream. Without a load-back there is nothing to wait
    /// for.
    #[pyo3(signature = (layer, stream=None))]
    fn wait_layer(&self, py: Python<'_>, layer: u32, stream: Option<u64>) -> PyResult<()> {
        if layer >= self.layers {
            return Err(usage(format!(
                "layer {layer} is outside the deployment's {} layers",
                self.layers
            )));
        }
        py.detach(|| match (self.lock().load(), stream) {
            (Some(l), None) => l.wait_layer(layer).map_err(to_py),
            // SAFETY: the engine hands in a live stream of the cache's device context
            // (`Request.wait_layer` says so: a handle the driver can dereference, as any raw
            // pointer an engine passes).
            (Some(l), Some(s)) => unsafe { l.wait_layer_on(layer, s) }.map_err(to_py),
            (None, _) => Ok(()),
        })
    }

    /// Waits for every layer of the load-back.
    fn wait_all(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| match self.lock().load() {
            Some(l) => l.wait_all().map_err(to_py),
            None => Ok(()),
        })
    }

    /// The request's statistics so far.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let s = py.detach(|| self.lock().stats().clone());
        stats_object(py, &s)
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

#[pymethods]
impl RankCache {
    /// Builds this rank's cache and maps every peer's pools through `collective` (every rank
    /// of the group must construct its cache; one that fails ends the group for all).
    #[new]
    #[pyo3(signature = (
        deployment, rank = 0, collective = None, *, device_pages, host_pages,
        policy = "write_through", backend = "auto", tuning = None, fault = None,
        device_buffers = None, keep = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        deployment: &Deployment,
        rank: u8,
        collective: Option<&Bound<'_, PyAny>>,
        device_pages: &Bound<'_, PyAny>,
        host_pages: &Bound<'_, PyAny>,
        policy: &str,
        backend: &str,
        tuning: Option<PathBuf>,
        fault: Option<&str>,
        device_buffers: Option<Vec<crate::ops::TensorsArg>>,
        keep: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let cp = deployment.inner.cp;
        let (mut group_slot, mut interrupt) = (None, None);
        let group: Box<dyn Collective> = match collective {
            Some(obj) => {
                let c = PyCollective::new(obj)?;
                group_slot = Some(c.group_slot());
                interrupt = Some(c.interrupt_slot());
                Box::new(c)
            }
            None if cp == 1 => {
                let mut m = LocalGroup::members(1, DEFAULT_TIMEOUT);
                Box::new(m.remove(0))
            }
            None => {
                return Err(usage(format!(
                    "a CP {cp} deployment needs a group of {cp} ranks: pass a \
                     torch.distributed process group"
                )))
            }
        };
        // From here on every failure is this rank's contribution to the group's first round,
        // so its peers fail at once, naming it, instead of waiting for the group timeout.
        let refuse = |group: &dyn Collective, e: PyErr| -> PyErr {
            let why = Python::attach(|py| e.value(py).to_string());
            let _ = CoreRank::refuse_start(group, &why);
            e
        };
        type Checked = (
            u32,
            u32,
            WritePolicy,
            Option<Fault>,
            cp_hicache::exec::Backend,
        );
        let checked = (|| -> PyResult<Checked> {
            let device_pages = pages_arg(device_pages, "device_pages")?;
            let host_pages = pages_arg(host_pages, "host_pages")?;
            let policy: WritePolicy = policy.parse().map_err(usage)?;
            let fault: Option<Fault> = fault.map(str::parse).transpose().map_err(usage)?;
            let backend = crate::backend(backend)?;
            if group.rank().0 != rank {
                return Err(usage(format!(
                    "rank {rank} was asked for, but the group says this process is rank {}",
                    group.rank().0
                )));
            }
            if let Some(f) = fault {
                f.check_layout(deployment.inner.layout)
                    .map_err(|why| usage(format!("fault={:?}: {why}", f.to_string())))?;
            }
            Ok((device_pages, host_pages, policy, fault, backend))
        })();
        let device = device_buffers
            .map(|v| {
                v.into_iter()
                    .enumerate()
                    .map(|(i, t)| crate::ops::tensors(t, &format!("device_buffers[{i}]")))
                    .collect::<PyResult<Vec<_>>>()
            })
            .transpose();
        let (checked, device) = match (checked, device) {
            (Ok(c), Ok(d)) => (Ok(c), d),
            (Err(e), _) | (_, Err(e)) => (Err(e), None),
        };
        let (device_pages, host_pages, policy, fault, backend) = match checked {
            Ok(x) => x,
            Err(e) => return Err(py.detach(move || refuse(&*group, e))),
        };
        let dep = deployment.clone();
        let core = py.detach(move || -> PyResult<CoreRank> {
            let prepared = (|| {
                let exec: Arc<dyn cp_hicache::exec::Executor> =
                    Arc::from(open_executor(backend).map_err(to_py)?);
                let access = if group.size() == 1 {
                    PeerAccess::Direct
                } else if device.is_some() {
                    // Peers in other processes cannot map the engine's memory: verification
                    // gathers each rank's pages through the group instead.
                    PeerAccess::Gathered
                } else if exec.peer_mapping().is_some() {
                    PeerAccess::Mapped
                } else {
                    return Err(usage(format!(
                        "the {} executor cannot map its peers' pools, so it cannot run one \
                         rank per process",
                        exec.backend()
                    )));
                };
                let jit = Jit::new(JitConfig::from_env().map_err(to_py)?);
                let (tuned, _) = crate::tuned(&dep.inner, tuning, exec.as_ref(), &jit)?;
                let config = ClusterConfig {
                    deployment: tuned,
                    layers: dep.layers,
                    device_pages,
                    host_pages,
                    policy,
                    fault,
                    sanitize: Sanitize::from_env().map_err(to_py)?,
                };
                // Before anything is allocated: a pool too large for this machine would
                // take minutes of paging, then the process.
                cp_hicache::cli::check_rank_memory(
                    &config,
                    exec.backend(),
                    "device_pages, host_pages or the deployment's layers",
                )
                .map_err(to_py)?;
                Ok((config, exec, jit, access))
            })();
            let (config, exec, jit, access) = match prepared {
                Ok(x) => x,
                Err(e) => return Err(refuse(&*group, e)),
            };
            match &device {
                None => CoreRank::new(config, exec, &jit, group, access),
                // SAFETY: the Python side checked each tensor (CPU or CUDA as the backend
                // addresses, contiguous, writable, a dtype that tiles a page), and this object
                // keeps them alive (`adopted`) for longer than the rank.
                Some(d) => unsafe { CoreRank::adopting(config, exec, &jit, group, access, d) },
            }
            .map_err(cluster)
        })?;
        let layout = *core.layout();
        let geometry = core.pools().geometry();
        let mut pools = Vec::new();
        for &kind in deployment.inner.model.buffers() {
            let exec = core.executor();
            let addresses = core
                .pools()
                .views(kind)
                .iter()
                .map(|v| match v.as_ref().and_then(|v| v.buffer) {
                    Some(id) => Ok(Some((exec.address(id)?, exec.size(id)?))),
                    None => Ok(None),
                })
                .collect::<Result<Vec<_>, cp_hicache::exec::ExecError>>()
                .map_err(to_py)?;
            pools.push((kind, addresses));
        }
        static NEXT_ID: AtomicU64 = AtomicU64::new(0);
        Ok(RankCache {
            inner: Arc::new(Mutex::new(Some(core))),
            views: Arc::new(AtomicUsize::new(0)),
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            deployment: deployment.clone(),
            rank,
            layout,
            pools,
            geometry,
            closed: Arc::new(AtomicBool::new(false)),
            group: group_slot,
            interrupt,
            adopted: keep,
        })
    }

    /// The garbage collector's view of the group object this cache holds.
    fn __traverse__(&self, visit: pyo3::gc::PyVisit<'_>) -> Result<(), pyo3::PyTraverseError> {
        if let Some(slot) = &self.group {
            // Never wait here: a round holding the slot is running Python code.
            if let Ok(obj) = slot.try_lock() {
                if let Some(obj) = obj.as_ref() {
                    visit.call(obj)?;
                }
            }
        }
        Ok(())
    }

    /// Breaks a cycle through the group object (an engine that is its own group): the cache
    /// can make no more rounds after this.
    fn __clear__(&self) {
        if let Some(slot) = &self.group {
            if let Ok(mut obj) = slot.try_lock() {
                obj.take();
            }
        }
    }

    /// Refuses a request another cache began (for steps written in Python).
    fn _check_owns(&self, req: &Request) -> PyResult<()> {
        self.owns(req)
    }

    /// This rank.
    #[getter]
    fn rank(&self) -> u8 {
        self.rank
    }

    /// The deployment.
    #[getter]
    fn deployment(&self) -> Deployment {
        self.deployment.clone()
    }

    /// The group's transport (`local` for a single rank, `torch.distributed`).
    #[getter]
    fn group_kind(&self) -> PyResult<&'static str> {
        self.between_steps(|r| r.group_kind())
    }

    /// Whether the device pools are the engine's tensors (`device_buffers=`).
    #[getter]
    fn adopts_device(&self) -> bool {
        self.adopted.is_some()
    }

    /// How this rank reaches its peers' pools (`direct`, `shared-memory`, `ipc`, `gathered`).
    #[getter]
    fn peer_pools(&self) -> PyResult<&'static str> {
        self.between_steps(|r| r.peer_pools())
    }

    /// Serves one prompt (token ids as little-endian u32 bytes): match, load back, compute,
    /// verify, insert, back up, release; every rank calls it with the same prompt. Returns
    /// the request's statistics (this rank's byte counts).
    fn serve(&self, py: Python<'_>, tokens: &[u8]) -> PyResult<Py<PyAny>> {
        let tokens = ids(tokens, "tokens")?;
        let stats = self.with(py, |r| r.serve(&tokens))?.map_err(cluster)?;
        let v = serde_json::to_value(&stats)
            .map_err(|e| to_py(cp_hicache::Error::Usage(e.to_string())))?;
        let out = to_object(py, &v)?;
        out.bind(py)
            .set_item("first_mismatched_token", stats.first_mismatched_token)?;
        Ok(out)
    }

    /// The longest cached prefix of `tokens` (whole pages): `(matched_tokens,
    /// device_pages as u32 bytes, host_nodes)`. Splits a node where the match ends inside
    /// it, so every rank calls it with the same tokens.
    fn match_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &[u8],
    ) -> PyResult<(usize, Bound<'py, PyBytes>, usize)> {
        let tokens = ids(tokens, "tokens")?;
        let m = self
            .with(py, |r| r.match_prefix(&tokens))?
            .map_err(cluster)?;
        Ok((
            m.matched_tokens,
            id_bytes(py, m.device_pages.iter().map(|p| p.0)),
            m.host_nodes.len(),
        ))
    }

    /// Evicts device nodes in LRU order until `pages` device pages were released (or
    /// nothing unlocked is left); returns how many nodes. Every rank calls it.
    fn evict(&self, py: Python<'_>, pages: usize) -> PyResult<usize> {
        self.with(py, |r| r.evict_device_lru(pages))?
            .map_err(cluster)
    }

    /// A digest (hex) of this rank's allocator and tree; equal on every rank.
    fn digest(&self) -> PyResult<String> {
        self.between_steps(|r| r.digest().to_string())
    }

    /// A digest (hex) of this rank's own host state (its host pool, and the host pages of
    /// each node's copy), which `digest` leaves out because it differs between ranks.
    fn host_digest(&self) -> PyResult<String> {
        self.between_steps(|r| r.host_digest().to_string())
    }

    /// Every rank's digest, in rank order (a collective: every rank calls it).
    fn all_digests(&self, py: Python<'_>) -> PyResult<Vec<String>> {
        let d = self
            .with(py, |r| r.all_digests("all digests (python)"))?
            .map_err(cluster)?;
        Ok(d.iter().map(ToString::to_string).collect())
    }

    /// Checks the allocator and tree invariants (reads the device lanes back: not for the
    /// serving path).
    fn check_invariants(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |r| r.check_invariants())?.map_err(cluster)
    }

    /// Free device pages per owner lane.
    fn lane_free_counts(&self) -> PyResult<Vec<u32>> {
        self.between_steps(|r| r.lane_free_counts())
    }

    /// Attaches the storage tier: a page store in directory `path` (created if need be),
    /// shared by every rank and by later runs, holding at most `capacity_bytes` (least
    /// recently used records go first), written per `policy` (`"with-host"`: with every host
    /// backup; `"on-host-evict"`: when a host copy is evicted). A prefix that misses in
    /// device and host memory is then read back from it, under any CP degree, and verified.
    /// A collective: every rank calls it, and a rank whose store cannot open fails every
    /// rank's call.
    #[pyo3(signature = (path, *, capacity_bytes = 16 << 30, policy = "with-host"))]
    fn attach_storage(
        &self,
        py: Python<'_>,
        path: PathBuf,
        capacity_bytes: u64,
        policy: &str,
    ) -> PyResult<()> {
        let policy: cp_hicache::rank::StoragePolicy = policy.parse().map_err(usage)?;
        self.with(py, move |r| {
            let config = r.config();
            let opened = if capacity_bytes == 0 {
                Err("capacity_bytes must be positive".to_string())
            } else {
                cp_hicache::storage::DirStore::for_deployment(
                    &path,
                    &config.deployment,
                    config.layers,
                    capacity_bytes,
                )
                .map_err(|e| e.to_string())
            };
            match opened {
                Ok(store) => r.attach_storage(Arc::new(store), policy).map_err(cluster),
                Err(why) => {
                    let _ = r.group().fail(cp_hicache::rank::STORAGE_ROUND, &why);
                    Err(usage(format!(
                        "rank {}: storage at {}: {why}",
                        r.rank().0,
                        path.display()
                    )))
                }
            }
        })?
    }

    /// Starts reading ahead, in a thread of this rank's, the records it would read from the
    /// store for `tokens` (a request still to come) past what the tree holds and past the
    /// first `skip_tokens`; how many records it asked for. Local (no round).
    #[pyo3(signature = (tokens, skip_tokens = 0))]
    fn prefetch(&self, py: Python<'_>, tokens: &[u8], skip_tokens: usize) -> PyResult<usize> {
        let tokens = ids(tokens, "tokens")?;
        self.with(py, move |r| r.prefetch(&tokens, skip_tokens))?
            .map_err(cluster)
    }

    /// What the last request's verification found: `{"mismatched_tokens",
    /// "first_mismatched_token", "by_rank", "bytes_gathered"}`.
    fn last_verdict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let v = self.between_steps(|r| r.last_verdict().clone())?;
        let d = PyDict::new(py);
        d.set_item("mismatched_tokens", v.all.count)?;
        d.set_item("first_mismatched_token", v.all.first)?;
        d.set_item("by_rank", v.by_rank)?;
        d.set_item("bytes_gathered", v.bytes_gathered)?;
        Ok(d)
    }

    /// Makes this rank's first launch of request number `request` fail (every rank then
    /// rolls that request back): for testing the failure path.
    fn inject_launch_failure(&self, py: Python<'_>, request: usize) -> PyResult<()> {
        self.with(py, |r| r.inject_launch_failure(request))
    }

    /// Materialise and verify on the first `n` ranks only (default: every rank).
    fn set_verifying_ranks(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        self.with(py, |r| r.set_verifying_ranks(n))
    }

    /// A device pool of `buffer` (`kv`, `index_k`) as a DLPack producer,
    /// `uint8[layers, local_pages, page_bytes]`, read and written in place: this rank's own
    /// (`owner=None`), or this rank's mapping of rank `owner`'s pool (how CP attention reads
    /// every page from its owner).
    #[pyo3(signature = (buffer, owner = None))]
    fn pool(slf: &Bound<'_, Self>, buffer: &str, owner: Option<u8>) -> PyResult<Pool> {
        let me = slf.get();
        let kinds = me.deployment.inner.model.buffers();
        let kind: BufferKind =
            *kinds
                .iter()
                .find(|k| k.to_string() == buffer)
                .ok_or_else(|| {
                    let names: Vec<String> = kinds.iter().map(ToString::to_string).collect();
                    usage(format!(
                        "no `{buffer}` pool: this deployment's buffers are {}",
                        names.join(", ")
                    ))
                })?;
        let cp = me.deployment.inner.cp;
        if let Some(o) = owner.filter(|&o| o >= cp) {
            return Err(usage(format!("owner {o} is not a rank of a CP {cp} group")));
        }
        if me.closed.load(Ordering::Acquire) {
            return Err(me.closed_error());
        }
        let g = me.geometry;
        let views = &me
            .pools
            .iter()
            .find(|(k, _)| *k == kind)
            .expect("every buffer kind has its pools")
            .1;
        let Some((address, mapped)) = views[usize::from(owner.unwrap_or(me.rank))] else {
            return Err(usage(format!(
                "the `{buffer}` pool is the engine's own memory: read it through the tensors \
                 the cache adopted"
            )));
        };
        let page_bytes = kind.page_bytes(me.deployment.inner.page_size);
        // The view never claims more than the mapping holds: its pages come from the size
        // the pool was mapped with (start-up refused a peer's smaller than this rank's).
        let row = page_bytes * u64::from(g.layers);
        let local_pages = (mapped as u64 / row.max(1)).min(u64::from(g.local_pages));
        Ok(Pool::new(
            slf.clone().into_any().unbind(),
            ViewToken::new(&me.inner, &me.views, &me.closed),
            buffer.to_string(),
            address,
            [i64::from(g.layers), local_pages as i64, page_bytes as i64],
        ))
    }

    /// Where each of the first `n_tokens` tokens of a sequence on `pages` lives, under the
    /// deployment's layout: its owner rank and its slot in the owner's pool,
    /// `local_page * page_size + slot` (u32 bytes each).
    fn place_tokens<'py>(
        &self,
        py: Python<'py>,
        pages: &[u8],
        n_tokens: u64,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let pages = ids(pages, "pages")?;
        let layout = self.layout;
        let ps = layout.page_size();
        let place: Placement = self.deployment.inner.layout.placement(layout.cp(), ps);
        if place.pages_holding(n_tokens) > pages.len() as u64 {
            return Err(usage(format!(
                "{n_tokens} tokens need {} pages under {}, not {}",
                place.pages_holding(n_tokens),
                self.deployment.inner.layout,
                pages.len()
            )));
        }
        if let Some(p) = pages.iter().find(|&&p| p >= layout.pages()) {
            return Err(usage(format!(
                "page {p} is outside the {} logical pages",
                layout.pages()
            )));
        }
        let (mut owners, mut slots) = (Vec::new(), Vec::new());
        for t in 0..n_tokens {
            let (i, j) = place.place(t);
            let page = PageId(pages[i as usize]);
            owners.push(u32::from(layout.owner(page).0));
            slots.push(layout.local(page).0 * ps + j);
        }
        Ok((id_bytes(py, owners), id_bytes(py, slots)))
    }

    /// Each page's owner rank and local page in its owner's pool (u32 bytes each).
    fn locate<'py>(
        &self,
        py: Python<'py>,
        pages: &[u8],
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        let pages = ids(pages, "pages")?;
        let layout = self.layout;
        if let Some(p) = pages.iter().find(|&&p| p >= layout.pages()) {
            return Err(usage(format!(
                "page {p} is outside the {} logical pages",
                layout.pages()
            )));
        }
        Ok((
            id_bytes(
                py,
                pages.iter().map(|&p| u32::from(layout.owner(PageId(p)).0)),
            ),
            id_bytes(py, pages.iter().map(|&p| layout.local(PageId(p)).0)),
        ))
    }

    /// Whether the engine's attention calls `Request.wait_layer(l)` before it reads layer `l`
    /// of loaded pages (False by default). True, a load runs layer by layer on a stream of
    /// its own at the greatest priority (CUDA), so layer `l + 1` copies while layer `l` is
    /// read. False, a load is one transfer on the cache's stream, in order with all its
    /// other work. Set it True only where every reader of loaded pages waits per layer.
    #[getter]
    fn layer_waits(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, |r| r.layer_waits())
    }

    #[setter]
    fn set_layer_waits(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        self.with(py, |r| r.set_layer_waits(on))
    }

    /// Starts a request in steps (match, then load back layer by layer; with `allocate`,
    /// also the pages to compute, in the same round): every rank calls it with the same
    /// tokens. When it returns, the loaded pages are readable by every peer. SGLang:
    /// `match_prefix` + `init_load_back`.
    #[pyo3(signature = (tokens, allocate = false, chunk = None))]
    fn begin(
        &self,
        py: Python<'_>,
        tokens: &[u8],
        allocate: bool,
        chunk: Option<usize>,
    ) -> PyResult<Request> {
        let tokens = ids(tokens, "tokens")?;
        if chunk.is_some() && !allocate {
            return Err(usage(
                "chunk= takes the first chunk's pages at once: it needs allocate=True",
            ));
        }
        if chunk == Some(0) {
            return Err(usage("chunk must be at least one token"));
        }
        let req = self
            .with(py, |r| match (allocate, chunk) {
                (true, Some(c)) => r.begin_chunk(&tokens, c),
                (true, None) => r.begin_allocated(&tokens),
                (false, _) => r.begin(&tokens),
            })?
            .map_err(cluster)?;
        Ok(Request {
            inner: Mutex::new(req),
            cache: self.id,
            layers: self.deployment.layers,
        })
    }

    /// Allocates the pages of the tokens to compute (zigzag owners, evicting when short).
    fn allocate(&self, py: Python<'_>, req: &Request) -> PyResult<()> {
        self.owns(req)?;
        self.with(py, |r| r.allocate(&mut req.lock()))?
            .map_err(cluster)
    }

    /// Adds tokens to an open request (the next prefill chunk, decode tokens): inserts the
    /// whole pages written so far unfinished, keeps the partial page, allocates the pages
    /// past it. One round. With `stream` (the engine's raw `CUstream`, checked by the
    /// wrapper), the cache's work (the backups of the pages written) first waits on the
    /// device for the engine's work on it.
    #[pyo3(signature = (req, tokens, stream=None))]
    fn extend(
        &self,
        py: Python<'_>,
        req: &Request,
        tokens: &[u8],
        stream: Option<u64>,
    ) -> PyResult<()> {
        self.owns(req)?;
        let tokens = ids(tokens, "tokens")?;
        if tokens.is_empty() {
            return Err(usage("extend needs at least one token"));
        }
        self.follow(py, stream)?;
        self.with(py, |r| r.extend(&mut req.lock(), &tokens))?
            .map_err(cluster)
    }

    /// Orders the cache's stream after the engine's `stream` (a device-side wait; nothing
    /// on the CPU).
    fn follow(&self, py: Python<'_>, stream: Option<u64>) -> PyResult<()> {
        let Some(s) = stream else { return Ok(()) };
        // SAFETY: the engine hands in a live stream of the cache's device context (`finish`
        // and `extend` say so, as `Request.wait_layer` does).
        self.with(py, |r| unsafe { r.follow_engine_stream(s) })?
            .map_err(to_py)
    }

    /// Synthesises this rank's share of the tokens from `computed_from` on (a forward's
    /// stand-in). No round.
    fn synthesise(&self, py: Python<'_>, req: &Request) -> PyResult<()> {
        self.owns(req)?;
        self.with(py, |r| r.synthesise(&mut req.lock()))?
            .map_err(cluster)
    }

    /// Verifies the whole sequence from every owner's pool on every rank; returns
    /// mismatched tokens.
    fn verify(&self, py: Python<'_>, req: &Request) -> PyResult<u64> {
        self.owns(req)?;
        self.with(py, |r| r.verify(&mut req.lock()))?
            .map(|v| v.all.count)
            .map_err(cluster)
    }

    /// Synthesises this rank's computed pages and verifies the whole sequence (the replay's
    /// stand-in for the model; a test harness for an engine). Returns mismatched tokens.
    fn synthesise_and_verify(&self, py: Python<'_>, req: &Request) -> PyResult<u64> {
        self.owns(req)?;
        self.with(py, |r| r.synthesise_and_verify(&mut req.lock()))?
            .map(|v| v.all.count)
            .map_err(cluster)
    }

    /// Ends a request on every rank in one round. With `ok` (this rank's forward wrote its
    /// pages): inserts the request's pages, backs them up per the policy and releases its
    /// locks; returns its statistics; raises `RequestAbandoned` when another rank said
    /// `ok=False`, after every rank abandoned the request. With `ok=False` (this rank's
    /// forward failed): every rank abandons it; returns None. Nothing is freed before every
    /// rank has reached this call. SGLang: `cache_finished_req`, `write_backup`,
    /// `dec_lock_ref`.
    /// With `stream`, the cache's work first waits on the device for the engine's work on
    /// it (its forward's writes), instead of the engine synchronising its stream first.
    #[pyo3(signature = (req, ok = true, stream = None))]
    fn finish(
        &self,
        py: Python<'_>,
        req: &Request,
        ok: bool,
        stream: Option<u64>,
    ) -> PyResult<Option<Py<PyAny>>> {
        self.owns(req)?;
        self.follow(py, stream)?;
        let ending = if ok {
            self.with(py, |r| r.finish(&mut req.lock()))?
                .map(Some)
                .map_err(cluster)?
        } else {
            self.with(py, |r| r.abandon(&mut req.lock()))?
                .map_err(cluster)?;
            None
        };
        ending.map(|s| stats_object(py, &s)).transpose()
    }

    /// Gives a request up: unlocks its prefix and frees the pages allocated for it, once
    /// every rank has ended it (`finish(req, ok=False)`).
    fn abandon(&self, py: Python<'_>, req: &Request) -> PyResult<()> {
        self.owns(req)?;
        self.with(py, |r| r.abandon(&mut req.lock()))?
            .map_err(cluster)
    }

    /// Leaves the group: a last round in which every rank says it is done with its peers'
    /// pools. Every later call is refused. The pools are freed now, or, while pool objects or
    /// tensors taken from them are alive, when the last of them goes. Idempotent.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        if self.closed.load(Ordering::Acquire) {
            return Ok(());
        }
        let out = self.with(py, |r| r.disconnect())?;
        self.closed.store(true, Ordering::Release);
        if self.views.load(Ordering::Acquire) == 0 {
            // No view of the pools is left: free them now.
            py.detach(|| drop(self.inner.lock().unwrap_or_else(|p| p.into_inner()).take()));
        }
        out.map_err(cluster)
    }

    /// Whether `close` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Waits on the host until every copy and kernel this rank's cache enqueued has run.
    /// On a GPU the cache works on its own stream: an engine whose kernels run on another
    /// stream calls this before reading pages the cache loaded (after `begin`), unless it
    /// waits per layer with `Request.wait_layer(l, stream=)`; before `finish` backs up pages
    /// it wrote, it hands its stream to `finish(stream=)` (or synchronises it). Immediate on
    /// the CPU, where every call has run when it returns.
    fn synchronize(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |r| r.executor().synchronize())?
            .map_err(to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "RankCache(rank={}, deployment={})",
            self.rank, self.deployment.inner.name
        )
    }
}
