//! A request's steps, as an engine's scheduler drives them: `begin` (match, load back,
//! allocate), `allocate`, `extend` (the next chunk or decode tokens), the forward's
//! stand-ins (`synthesise`, `verify`), `finish` and `abandon`; and `serve`, every step of one
//! prompt at once, with `match_prefix`, `evict` and `prefetch`.

use super::convert::{id_bytes, ids, request_stats_object};
use super::{RankCache, Request};
use crate::errors::{cluster, to_py, usage};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::sync::Mutex;

#[pymethods]
impl RankCache {
    /// Refuses a request another cache began (for steps written in Python).
    fn _check_owns(&self, req: &Request) -> PyResult<()> {
        self.owns(req)
    }

    /// Serves one prompt (token ids as little-endian u32 bytes): match, load back, compute,
    /// verify, insert, back up, release; every rank calls it with the same prompt. Returns
    /// the request's statistics (this rank's byte counts).
    fn serve(&self, py: Python<'_>, tokens: &[u8]) -> PyResult<Py<PyAny>> {
        let tokens = ids(tokens, "tokens")?;
        let stats = self.with(py, |r| r.serve(&tokens))?.map_err(cluster)?;
        // The prompt is the whole request: `tokens` as a request's `finish` counts them.
        request_stats_object(py, &stats, tokens.len())
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

    /// Starts reading ahead, in a thread of this rank's, the records it would read from the
    /// store for `tokens` (a request still to come) past what the tree holds and past the
    /// first `skip_tokens`; how many records it asked for. Local (no round).
    #[pyo3(signature = (tokens, skip_tokens = 0))]
    fn prefetch(&self, py: Python<'_>, tokens: &[u8], skip_tokens: usize) -> PyResult<usize> {
        let tokens = ids(tokens, "tokens")?;
        self.with(py, move |r| r.prefetch(&tokens, skip_tokens))?
            .map_err(cluster)
    }

    /// Starts a request in steps (match, then load back layer by layer; with `allocate`,
    /// also the pages to compute, in the same round): every rank calls it with the same
    /// tokens. When it returns, the loaded pages are readable by every peer. SGLang:
    /// `match_prefix` + `init_load_back`. With `stream` (the engine's raw `CUstream`), that
    /// stream then waits on the device for the cache's work on the pages handed out.
    #[pyo3(signature = (tokens, allocate = false, chunk = None, stream = None))]
    fn begin(
        &self,
        py: Python<'_>,
        tokens: &[u8],
        allocate: bool,
        chunk: Option<usize>,
        stream: Option<u64>,
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
        self.lead(py, stream)?;
        Ok(Request {
            inner: Mutex::new(req),
            cache: self.id,
            layers: self.deployment.layers,
        })
    }

    /// Allocates the pages of the tokens to compute, evicting when short, with the owners the
    /// deployment's layout gives (zigzag only under `zigzag`). With `stream`, as in `begin`.
    #[pyo3(signature = (req, stream = None))]
    fn allocate(&self, py: Python<'_>, req: &Request, stream: Option<u64>) -> PyResult<()> {
        self.owns(req)?;
        self.with(py, |r| r.allocate(&mut req.lock()))?
            .map_err(cluster)?;
        self.lead(py, stream)
    }

    /// Adds tokens to an open request (the next prefill chunk, decode tokens): inserts the
    /// whole pages written so far unfinished, keeps the partial page, allocates the pages
    /// past it. One round. With `stream` (the engine's raw `CUstream`, checked by the
    /// wrapper), the cache's work (the backups of the pages written) first waits on the
    /// device for the engine's work on it, and the stream then waits for the cache's work on
    /// the pages allocated.
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
            .map_err(cluster)?;
        self.lead(py, stream)
    }

    /// Orders the cache's stream after the engine's `stream` (a device-side wait; nothing
    /// on the CPU).
    pub(super) fn follow(&self, py: Python<'_>, stream: Option<u64>) -> PyResult<()> {
        let Some(s) = stream else { return Ok(()) };
        // SAFETY: the engine hands in a live stream of the cache's device context (`finish`
        // and `extend` say so, as `Request.wait_layer` does).
        self.with(py, |r| unsafe { r.follow_engine_stream(s) })?
            .map_err(to_py)
    }

    /// Orders the engine's `stream` after the cache's work so far (a device-side wait).
    pub(super) fn lead(&self, py: Python<'_>, stream: Option<u64>) -> PyResult<()> {
        let Some(s) = stream else { return Ok(()) };
        // SAFETY: as in `follow`.
        self.with(py, |r| unsafe { r.lead_engine_stream(s) })?
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
            self.with(py, |r| {
                let mut req = req.lock();
                r.finish(&mut req).map(|s| Some((s, req.tokens().len())))
            })?
            .map_err(cluster)?
        } else {
            self.with(py, |r| r.abandon(&mut req.lock()))?
                .map_err(cluster)?;
            None
        };
        ending
            .map(|(s, tokens)| request_stats_object(py, &s, tokens))
            .transpose()
    }

    /// Gives a request up: unlocks its prefix and frees the pages allocated for it, once
    /// every rank has ended it (`finish(req, ok=False)`).
    fn abandon(&self, py: Python<'_>, req: &Request) -> PyResult<()> {
        self.owns(req)?;
        self.with(py, |r| r.abandon(&mut req.lock()))?
            .map_err(cluster)
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
}
