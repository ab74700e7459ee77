//! `RankCache.step`: a scheduler's whole step (the requests it ends, grows and admits) in
//! at most one group round (the core crate's `RankCache::step`).

use super::convert::ids;
use super::{RankCache, Request};
use crate::errors::{cluster, usage};
use cp_hicache::rank::{ClusterError, Ending, Step};
use pyo3::prelude::*;
use std::sync::Mutex;

/// Per failed operation: which list it was in (`"finish"`, `"extend"`, `"begin"`), its index
/// there, and the exception.
type Failures = Vec<(&'static str, usize, Py<PyAny>)>;

#[pymethods]
impl RankCache {
    /// One scheduler step, in order: `finish` ((request, ok) pairs), `extend` ((request,
    /// tokens as u32 bytes) pairs), `begin` (prompts as u32 bytes, with `allocate` and
    /// `chunk` as `begin`'s). At most one group round whatever the batch; none when every
    /// extend's tokens land in kept partial pages. Returns the admitted requests (`None` for
    /// a prompt not admitted) and the failures: a failed operation fails its request on every
    /// rank (an extend or finish leaves it as it was, an end some rank said not ok abandons
    /// it), never the step. With `stream`, the cache's work first waits on the device for
    /// the engine's work on it, and the stream then waits for the cache's work on the pages
    /// the step handed out.
    #[pyo3(signature = (begin, extend, finish, allocate = true, chunk = None, stream = None))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn step(
        &self,
        py: Python<'_>,
        begin: Vec<Vec<u8>>,
        extend: Vec<(Bound<'_, Request>, Vec<u8>)>,
        finish: Vec<(Bound<'_, Request>, bool)>,
        allocate: bool,
        chunk: Option<usize>,
        stream: Option<u64>,
    ) -> PyResult<(Vec<Option<Request>>, Failures)> {
        if chunk.is_some() && !allocate {
            return Err(usage(
                "chunk= takes the first chunk's pages at once: it needs allocate=True",
            ));
        }
        if chunk == Some(0) {
            return Err(usage("chunk must be at least one token"));
        }
        let mut seen: Vec<*const Request> = Vec::new();
        for req in finish
            .iter()
            .map(|(r, _)| r)
            .chain(extend.iter().map(|(r, _)| r))
        {
            self.owns(req.get())?;
            let p: *const Request = req.get();
            if seen.contains(&p) {
                return Err(usage(
                    "a request appears twice in one step (an end and an extend, or two \
                     extends): give it its tokens in one extend",
                ));
            }
            seen.push(p);
        }
        let prompts = begin
            .iter()
            .map(|t| ids(t, "begin tokens"))
            .collect::<PyResult<Vec<_>>>()?;
        let tokens = extend
            .iter()
            .map(|(_, t)| ids(t, "extend tokens"))
            .collect::<PyResult<Vec<_>>>()?;
        if tokens.iter().any(Vec::is_empty) {
            return Err(usage("extend needs at least one token"));
        }
        self.follow(py, stream)?;
        let finish_reqs: Vec<(&Request, bool)> =
            finish.iter().map(|(r, ok)| (r.get(), *ok)).collect();
        let extend_reqs: Vec<&Request> = extend.iter().map(|(r, _)| r.get()).collect();
        let out = self
            .with(py, |r| {
                // Every request's lock, taken with the GIL released (as every step takes it).
                let mut fin: Vec<_> = finish_reqs.iter().map(|(q, ok)| (q.lock(), *ok)).collect();
                let mut ext: Vec<_> = extend_reqs.iter().map(|q| q.lock()).collect();
                r.step(Step {
                    finish: fin.iter_mut().map(|(g, ok)| (&mut **g, *ok)).collect(),
                    extend: ext
                        .iter_mut()
                        .zip(&tokens)
                        .map(|(g, t)| (&mut **g, t.as_slice()))
                        .collect(),
                    begin: prompts.iter().map(Vec::as_slice).collect(),
                    allocate,
                    chunk,
                })
            })?
            .map_err(cluster)?;
        self.lead(py, stream)?;
        let rank = self.rank;
        let mut failures: Failures = Vec::new();
        let mut fail = |what: &'static str, i: usize, e: ClusterError| {
            failures.push((what, i, cluster(e).into_value(py).into_any()));
        };
        for (i, (ending, (req, ok))) in out.finished.into_iter().zip(&finish_reqs).enumerate() {
            match ending {
                Err(e) => fail("finish", i, e),
                // Abandoned where this rank said ok: another rank's forward failed.
                Ok(Ending::Abandoned { by }) if *ok => fail(
                    "finish",
                    i,
                    ClusterError::Abandoned {
                        rank,
                        request: py.detach(|| req.lock().number()),
                        by,
                    },
                ),
                Ok(_) => {}
            }
        }
        for (i, r) in out.extended.into_iter().enumerate() {
            if let Err(e) = r {
                fail("extend", i, e);
            }
        }
        let mut begun = Vec::with_capacity(out.begun.len());
        for (i, r) in out.begun.into_iter().enumerate() {
            match r {
                Ok(req) => begun.push(Some(Request {
                    inner: Mutex::new(req),
                    cache: self.id,
                    layers: self.deployment.layers,
                })),
                Err(e) => {
                    begun.push(None);
                    fail("begin", i, e);
                }
            }
        }
        Ok((begun, failures))
    }
}
