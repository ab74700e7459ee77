//! `Request`: a request between its steps, as `RankCache.begin` returns it.

use super::convert::{id_bytes, request_stats_object};
use crate::errors::{to_py, usage};
use cp_hicache::rank::Request as CoreRequest;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::{Mutex, MutexGuard};

/// A request between its steps (`RankCache.begin` … `finish`).
#[pyclass(module = "cp_hicache._native", frozen)]
pub struct Request {
    pub(super) inner: Mutex<CoreRequest>,
    /// The cache that began it: no other may take its steps.
    pub(super) cache: u64,
    /// The deployment's layers, the range of `wait_layer`.
    pub(super) layers: u32,
}

impl Request {
    pub(super) fn lock(&self) -> MutexGuard<'_, CoreRequest> {
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

    /// The request's statistics so far, with `tokens`, the request's tokens so far.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let (s, tokens) = py.detach(|| {
            let req = self.lock();
            (req.stats().clone(), req.tokens().len())
        });
        request_stats_object(py, &s, tokens)
    }
}
