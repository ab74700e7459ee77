//! Settings changed after start-up: per-layer waits of load-backs, the storage tier, and
//! the knobs tests use (an injected launch failure, verifying on some ranks only).

use super::RankCache;
use crate::errors::{cluster, usage};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;

#[pymethods]
impl RankCache {
    /// Attaches the storage tier: a page store in directory `path` (created if need be),
    /// shared by every rank and by later runs, holding at most `capacity_bytes` (least
    /// recently used records go first), written per `policy` (`"with-host"`: with every host
    /// backup; `"on-host-evict"`: when a host copy is evicted). A prefix that misses in
    /// device and host memory is then read back from it, under any CP degree, and verified.
    /// A collective: every rank calls it, and a rank whose store cannot open fails every
    /// rank's call.
    ///
    /// `path` may instead be an object keeping the store's objects (`put_object`,
    /// `get_object`, `objects_exist`, `remove_object`: `cp_hicache.mooncake.MooncakeStore`);
    /// the records are then written and checked here, as in a directory, and its engine's
    /// capacity applies (`capacity_bytes` is not used).
    #[pyo3(signature = (path, *, capacity_bytes = 16 << 30, policy = "with-host"))]
    fn attach_storage(
        &self,
        py: Python<'_>,
        path: &Bound<'_, PyAny>,
        capacity_bytes: u64,
        policy: &str,
    ) -> PyResult<()> {
        let policy: cp_hicache::rank::StoragePolicy = policy.parse().map_err(usage)?;
        let backend = if path.hasattr("get_object")? {
            Some(crate::object_store::PyBackend::new(path)?)
        } else {
            None
        };
        let (where_, dir) = match &backend {
            Some(_) => (path.repr()?.to_string(), None),
            None => {
                let p: PathBuf = path.extract()?;
                (p.display().to_string(), Some(p))
            }
        };
        self.with(py, move |r| {
            let config = r.config();
            let opened: Result<Arc<dyn cp_hicache::storage::PageStore>, String> =
                match (backend, dir) {
                    (Some(b), _) => cp_hicache::storage::ObjectStore::new(
                        b,
                        cp_hicache::storage::Fingerprint::of(&config.deployment, config.layers),
                        cp_hicache::storage::payload_bytes(&config.deployment, config.layers),
                    )
                    .map(|s| Arc::new(s) as _)
                    .map_err(|e| e.to_string()),
                    (None, _) if capacity_bytes == 0 => {
                        Err("capacity_bytes must be positive".to_string())
                    }
                    (None, Some(dir)) => cp_hicache::storage::DirStore::for_deployment(
                        &dir,
                        &config.deployment,
                        config.layers,
                        capacity_bytes,
                    )
                    .map(|s| Arc::new(s) as _)
                    .map_err(|e| e.to_string()),
                    (None, None) => unreachable!("a path or an object"),
                };
            match opened {
                Ok(store) => r.attach_storage(store, policy).map_err(cluster),
                Err(why) => {
                    let _ = r.group().fail(cp_hicache::rank::STORAGE_ROUND, &why);
                    Err(usage(format!(
                        "rank {}: storage at {where_}: {why}",
                        r.rank().0
                    )))
                }
            }
        })?
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

    /// Makes this rank's first launch of request number `request` fail (every rank then
    /// rolls that request back): for testing the failure path.
    fn inject_launch_failure(&self, py: Python<'_>, request: usize) -> PyResult<()> {
        self.with(py, |r| r.inject_launch_failure(request))
    }

    /// Materialise and verify on the first `n` ranks only (default: every rank).
    fn set_verifying_ranks(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        self.with(py, |r| r.set_verifying_ranks(n))
    }
}
