//! What a rank can say about its state: digests, invariants, free pages per lane, and the
//! last request's verification verdict.

use super::RankCache;
use crate::errors::cluster;
use pyo3::prelude::*;
use pyo3::types::PyDict;

#[pymethods]
impl RankCache {
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
}
