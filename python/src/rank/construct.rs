//! Start-up (`RankCache(...)`: the group, the executor, the pools, every peer's pools
//! mapped), the garbage collector's hooks, `close`, and the properties fixed at start-up.

use super::convert::pages_arg;
use super::RankCache;
use crate::collective::PyCollective;
use crate::errors::{cluster, to_py, usage};
use crate::Deployment;
use cp_hicache::group::{Collective, LocalGroup, DEFAULT_TIMEOUT};
use cp_hicache::jit::open_executor;
use cp_hicache::jit::{Jit, JitConfig, Sanitize};
use cp_hicache::rank::{ClusterConfig, Fault, PeerAccess, RankCache as CoreRank, WritePolicy};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

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
        for kind in deployment.inner.model.buffers() {
            let exec = core.executor();
            let addresses = core
                .pools()
                .views(kind)
                .iter()
                .map(|v| match v.as_ref().and_then(|v| v.buffer) {
                    Some(id) => Ok(Some((
                        host_addressable(exec.as_ref(), exec.address(id)?),
                        exec.size(id)?,
                    ))),
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

    fn __repr__(&self) -> String {
        format!(
            "RankCache(rank={}, deployment={})",
            self.rank, self.deployment.inner.name
        )
    }
}

/// `address` as a consumer may reach it: the stand-in CUDA driver of the tests
/// (`tests/fake_cuda/`, the one executor that runs emulated kernels on a CUDA backend) keeps
/// its "device" memory in this process's host memory, so its pools are handed out as CPU
/// tensors. A CPU build of torch then reads and writes them in place, and the engine loop
/// runs on the CUDA executor without a GPU; a real GPU's pools stay CUDA tensors.
fn host_addressable(
    exec: &dyn cp_hicache::exec::Executor,
    address: cp_hicache::exec::Address,
) -> cp_hicache::exec::Address {
    if exec.runs_emulated_kernels() {
        cp_hicache::exec::Address {
            space: cp_hicache::exec::AddressSpace::Host,
            ..address
        }
    } else {
        address
    }
}
