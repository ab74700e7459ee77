//! A request in steps, as an engine drives it: [`RankCache::begin`] (match and load back),
//! [`RankCache::allocate`] (pages for the tokens to compute), the engine's own forward
//! writing KV into the pools, any number of [`RankCache::extend`] (the next prefill chunk or
//! decode token: the pages filled so far go into the tree unfinished, pages for the new
//! tokens are allocated, the partial last page is kept), each followed by a forward, then
//! [`RankCache::finish`] (insert, back up, release), or [`RankCache::abandon`]. [`RankCache::serve`] is these steps with synthesised KV and
//! verification in between, as one all-or-nothing operation.
//!
//! Each step is agreed across the group on its own: it succeeds on every rank or every rank
//! restores its state from before that step (the request keeps what earlier steps gave it,
//! and the engine may retry the step or abandon the request).

use super::*;
use crate::rank::storage::StorageRun;

mod step;
pub use step::{Step, StepOutcome};

/// Where a begin's storage run comes from.
pub(super) enum StorageRead<'a> {
    /// Read now, agreed in a round of the begin's own (a request served whole).
    Round,
    /// Read and agreed before the step's passes ([`RankCache::step`]); `None`: nothing to
    /// read.
    Agreed(Option<&'a StorageRun>),
}

/// A request between its steps: the pages it holds so far (the cached prefix, then those
/// allocated to compute) and its load-back, if any. Every rank holds the same pages.
///
/// Give it back with [`RankCache::finish`] or [`RankCache::abandon`] (after which every step
/// refuses it); a request dropped without either keeps its prefix locked and its allocated
/// pages in use. A step that fails leaves the request as it was before that step.
#[must_use = "a request holds locks and pages until it is finished or abandoned"]
pub struct Request {
    pub(super) n: usize,
    pub(super) tokens: Vec<u32>,
    /// The prefix hashes of `tokens` (the synthesised KV's seeds), kept as the request
    /// grows so each token is hashed once.
    pub(super) hashes: Vec<u64>,
    /// Logical pages of the sequence so far, in order.
    pub(super) pages: Vec<PageId>,
    /// How many leading pages came from the cache (device hits and loaded pages).
    pub(super) cached: usize,
    /// How many leading pages the tree holds (the cached prefix, then pages
    /// [`RankCache::extend`] inserted unfinished): the request locks them, and an abandon
    /// leaves them cached.
    pub(super) in_tree: usize,
    /// The first token the engine's next forward computes (its KV is not written yet).
    pub(super) fresh_from: usize,
    /// The deepest locked node (holding the first `in_tree` pages).
    pub(super) locked: NodeId,
    pub(super) load: Option<LoadHandle>,
    pub(super) allocated: bool,
    /// Finished or abandoned: its locks and pages are given back.
    pub(super) done: bool,
    pub(super) stats: RequestStats,
}

/// What a step may change in a request, to put back when the step fails on any rank.
#[derive(Clone)]
struct Saved {
    tokens: usize,
    pages: Vec<PageId>,
    in_tree: usize,
    fresh_from: usize,
    locked: NodeId,
    allocated: bool,
    stats: RequestStats,
}

impl Request {
    fn save(&self) -> Saved {
        Saved {
            tokens: self.tokens.len(),
            pages: self.pages.clone(),
            in_tree: self.in_tree,
            fresh_from: self.fresh_from,
            locked: self.locked,
            allocated: self.allocated,
            stats: self.stats.clone(),
        }
    }

    /// Puts back what `saved` holds; the group rounds the failed step took stay counted.
    fn restore(&mut self, saved: Saved) {
        let rounds = self.stats.group_rounds;
        self.tokens.truncate(saved.tokens);
        self.hashes.truncate(saved.tokens);
        self.pages = saved.pages;
        self.in_tree = saved.in_tree;
        self.fresh_from = saved.fresh_from;
        self.locked = saved.locked;
        self.allocated = saved.allocated;
        self.stats = saved.stats;
        self.stats.group_rounds = rounds;
    }

    fn check_open(&self, step: &str) -> Result<(), ClusterError> {
        if self.done {
            return Err(ClusterError::Config(format!(
                "request {} was already finished or abandoned: it cannot {step}",
                self.n
            )));
        }
        Ok(())
    }

    /// Refuses a step that needs the request's pages before [`RankCache::allocate`] gave
    /// them (`for_what`: what the pages are for).
    fn check_allocated(&self, for_what: &str) -> Result<(), ClusterError> {
        if !self.allocated {
            return Err(ClusterError::Config(format!(
                "request {} has no pages {for_what} yet: allocate first",
                self.n
            )));
        }
        Ok(())
    }

    /// The request's number on this rank (requests are numbered as they begin; every rank
    /// numbers alike): what errors and rounds name it by.
    pub fn number(&self) -> usize {
        self.n
    }

    /// The tokens so far: the prompt, then whatever [`RankCache::extend`] added.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Logical pages of the sequence so far: the cached prefix, then (after
    /// [`RankCache::allocate`]) the pages to compute into, the last one possibly partial.
    /// Where each token sits is the layout's placement (page `i` holds tokens
    /// `i * page_size ..` except under token-interleave); a page's owner and local page are
    /// [`CpLayout::owner`] and [`CpLayout::local`]. [`RankCache::extend`] may replace pages
    /// it inserts with the tree's own copies of the same tokens (another request inserted
    /// them first): read the pages again after each extend.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// The first token whose KV the engine's next forward writes: the first uncached token
    /// after [`RankCache::allocate`], the first new token after [`RankCache::extend`].
    pub fn computed_from(&self) -> usize {
        self.fresh_from
    }

    /// Leading pages the tree holds (the cached prefix and the pages extends inserted
    /// unfinished); the rest are the request's own until it finishes.
    pub fn pages_in_tree(&self) -> usize {
        self.in_tree
    }

    /// Leading pages that came from the cache (device hits, then loaded pages); the
    /// engine computes the tokens from `cached_pages() * page_size` on.
    pub fn cached_pages(&self) -> usize {
        self.cached
    }

    /// The load-back in flight, if the match reached host-only nodes: attention on layer
    /// `l` waits with [`LoadHandle::wait_layer`] first.
    pub fn load(&self) -> Option<&LoadHandle> {
        self.load.as_ref()
    }

    /// The request's statistics so far.
    pub fn stats(&self) -> &RequestStats {
        &self.stats
    }
}

/// How a request ended ([`RankCache::end`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// Every rank finished it: inserted, backed up per the policy, released.
    Finished(Box<RequestStats>),
    /// Some rank ended it with `ok = false` (or abandoned it): every rank abandoned it.
    Abandoned {
        /// The ranks that did not finish it.
        by: Vec<u8>,
    },
}

impl RankCache {
    /// Matches `tokens` (whole pages) and loads the host-only part of the match back into
    /// pages with their recorded owners, layer by layer; the matched prefix is locked until
    /// the request ends. Every rank calls it with the same tokens: the outcome round
    /// compares what each rank decided, and ranks that differ fail with
    /// [`ClusterError::Diverged`].
    ///
    /// Fence: when `begin` returns on any rank, work ordered after its cache's stream reads
    /// every peer's loaded pages. Ranks whose peers read their pools through their own
    /// executors ([`PeerAccess::Mapped`]: other processes) record an interprocess event
    /// after the load and before the outcome round, and after it their cache stream waits
    /// for every peer's, on the device. Executors without interprocess events synchronise
    /// their stream instead: one host synchronisation per step that loaded something
    /// ([`RankCache::step`]), counted in [`RequestStats::fence_syncs`] of its first request
    /// that loaded. Ranks that share one executor share its stream, where
    /// [`LoadHandle::wait_layer`] orders layer by layer. SGLang: `HiRadixCache.match_prefix`
    /// + `init_load_back` (`HiCacheController.load`).
    pub fn begin(&mut self, tokens: &[u32]) -> Result<Request, ClusterError> {
        self.begin_with(tokens, false, None)
    }

    /// [`RankCache::begin`] and [`RankCache::allocate`] as one step, in one round: what an
    /// engine that allocates right after matching (SGLang's scheduler, vLLM's
    /// `allocate_slots`) calls, so that a request takes two rounds in all (this and its
    /// end).
    pub fn begin_allocated(&mut self, tokens: &[u32]) -> Result<Request, ClusterError> {
        self.begin_with(tokens, true, None)
    }

    /// The first step of a chunked prefill: matches (and loads back) the whole prompt, as
    /// [`RankCache::begin_allocated`] does, but takes only the cached prefix and the next
    /// `chunk` tokens into the request and allocates their pages; the engine gives it the
    /// rest of the prompt with [`RankCache::extend`], chunk by chunk (SGLang's chunked
    /// prefill schedules the same way: match once, then compute the uncached part in
    /// chunks). [`Request::tokens`] says how far the request got.
    pub fn begin_chunk(&mut self, tokens: &[u32], chunk: usize) -> Result<Request, ClusterError> {
        if chunk == 0 {
            return Err(ClusterError::Config(
                "a prefill chunk needs at least one token".into(),
            ));
        }
        self.begin_with(tokens, true, Some(chunk))
    }

    fn begin_with(
        &mut self,
        tokens: &[u32],
        allocate: bool,
        chunk: Option<usize>,
    ) -> Result<Request, ClusterError> {
        let out = self.step(Step {
            begin: vec![tokens],
            allocate,
            chunk,
            ..Step::default()
        })?;
        out.begun.into_iter().next().expect("a step of one begin")
    }

    /// Allocates the pages of the tokens the cache does not hold, zigzag over the owners,
    /// evicting (lane-targeted, then LRU) when short. SGLang: the KV pool allocator's
    /// `alloc` (with `evict` on a shortage).
    pub fn allocate(&mut self, req: &mut Request) -> Result<(), ClusterError> {
        req.check_open("allocate")?;
        if req.allocated {
            return Err(ClusterError::Config(format!(
                "request {} already has its pages",
                req.n
            )));
        }
        let n = req.n;
        let saved = req.save();
        let rounds = self.rounds();
        let inputs = Self::request_inputs(&req.tokens, &req.pages, req.cached);
        let out = self.agreed(&format!("request {n} allocate"), &inputs, |me| {
            me.allocate_inner(req)
        });
        req.stats.group_rounds += self.rounds() - rounds;
        if out.is_err() {
            // Every rank restored its state from before the step: so does the request.
            req.restore(saved);
        }
        out
    }

    /// Adds `tokens` to an open request whose pages are allocated: the next chunk of a
    /// chunked prefill, or decode tokens. The engine's forward has written the KV of every
    /// token so far; its next forward writes the new ones (from
    /// [`Request::computed_from`]) into [`Request::pages`]. In one round:
    /// - the whole granules written so far go into the tree unfinished, locked by the request
    ///   and backed up per the write policy (SGLang's `cache_unfinished_req`); where another
    ///   request inserted the same tokens first, the request takes the tree's pages and its
    ///   own are freed once every rank is past this round (re-read [`Request::pages`]);
    /// - the partial last page is kept (its written tokens stay; the new ones go after them),
    ///   and pages for the tokens past it are allocated, by position ([`Layout::appended_owners`]),
    ///   evicting when short.
    ///
    /// A step that fails on any rank leaves the request as it was.
    ///
    /// [`Layout::appended_owners`]: crate::layout::Layout::appended_owners
    pub fn extend(&mut self, req: &mut Request, tokens: &[u32]) -> Result<(), ClusterError> {
        let out = self.step(Step {
            extend: vec![(req, tokens)],
            ..Step::default()
        })?;
        out.extended
            .into_iter()
            .next()
            .expect("a step of one extend")
    }

    /// Synthesises the tokens the engine's forward would write now (from
    /// [`Request::computed_from`]) into this rank's pages: the stand-in for the model's
    /// forward when driving the steps without a model. No group round; verify with
    /// [`RankCache::verify`].
    pub fn synthesise(&mut self, req: &mut Request) -> Result<(), ClusterError> {
        req.check_open("synthesise")?;
        req.check_allocated("to compute into")?;
        self.synthesise_tokens(&req.hashes, &req.pages, req.fresh_from)
    }

    /// Materialises the request's whole sequence from every owner's pool (its partial last
    /// page included) and verifies every token against the synthesised KV, on every rank:
    /// the pages must hold what [`RankCache::synthesise`] (or an engine writing the same
    /// bytes) wrote. Waits for the load-back layer by layer.
    pub fn verify(&mut self, req: &mut Request) -> Result<Verdict, ClusterError> {
        self.verify_step(req, false)
    }

    /// Synthesises this rank's computed pages (the stand-in for the model's forward),
    /// materialises the whole sequence from every owner's pool and verifies every token,
    /// as [`RankCache::serve`] does; for an engine's own KV this is its test harness, not a
    /// serving step. Waits for the load-back layer by layer.
    pub fn synthesise_and_verify(&mut self, req: &mut Request) -> Result<Verdict, ClusterError> {
        self.verify_step(req, true)
    }

    fn verify_step(
        &mut self,
        req: &mut Request,
        synthesise: bool,
    ) -> Result<Verdict, ClusterError> {
        req.check_open("verify")?;
        req.check_allocated("to compute into")?;
        let n = req.n;
        let inputs = Self::request_inputs(&req.tokens, &req.pages, req.cached);
        let first = if synthesise {
            req.fresh_from
        } else {
            req.hashes.len()
        };
        // The harness's rounds are not the request's: `group_rounds` counts serving steps.
        let v = self.agreed(&format!("request {n} verify"), &inputs, |me| {
            me.compute_and_verify(&req.hashes, &req.pages, first, n, req.load.as_ref())
        })?;
        req.stats.mismatched_tokens += v.all.count;
        req.stats.bytes_gathered += v.bytes_gathered;
        req.stats.first_mismatched_token = req.stats.first_mismatched_token.or(v.all.first);
        self.last_verdict = v.clone();
        Ok(v)
    }

    /// Inserts the request's whole pages into the tree, backs the new nodes up per the write
    /// policy, and releases the request's locks; pages the tree does not keep (the partial
    /// last page, pages it already had) are freed once every rank has reached this call.
    /// The pages must hold the request's KV (the engine's forward has written them). If any
    /// rank ends the request with `ok = false` instead ([`RankCache::end`],
    /// [`RankCache::abandon`]), every rank abandons it and this returns
    /// [`ClusterError::Abandoned`] naming those ranks. SGLang: `cache_finished_req` /
    /// `insert`, `write_backup`, `dec_lock_ref`.
    pub fn finish(&mut self, req: &mut Request) -> Result<RequestStats, ClusterError> {
        match self.end(req, true)? {
            Ending::Finished(stats) => Ok(*stats),
            Ending::Abandoned { by } => Err(ClusterError::Abandoned {
                rank: self.rank.0,
                request: req.n,
                by,
            }),
        }
    }

    /// Gives a request up between its steps (its forward failed, or the engine aborted it):
    /// unlocks its prefix and frees the pages allocated for it (its loaded pages stay
    /// cached). The same step as [`RankCache::finish`] with `ok = false`
    /// ([`RankCache::end`]), so a rank that abandons while its peers finish makes every
    /// rank abandon. SGLang: `dec_lock_ref` and freeing an aborted request's KV.
    pub fn abandon(&mut self, req: &mut Request) -> Result<(), ClusterError> {
        self.end(req, false).map(drop)
    }

    /// Ends a request on every rank, in one round: finished when every rank says `ok`,
    /// abandoned everywhere when any rank says not (its forward failed).
    ///
    /// A rank that says `ok` first does the finish locally (insert, back up; nothing freed
    /// yet) and contributes its decision digest; one that does not contributes nothing but
    /// its flag. Then:
    /// - every rank `ok` and every digest equal: each rank frees the pages the tree does not
    ///   keep, now that no peer reads them (fence: nothing is freed or poisoned before every
    ///   rank has reached this round);
    /// - some rank not `ok`: every rank undoes its local finish and abandons the request
    ///   ([`Ending::Abandoned`]);
    /// - digests differ: every rank undoes its local finish and fails with
    ///   [`ClusterError::Diverged`]; the request stays open (abandon it);
    /// - some rank's local finish failed: every rank undoes it and the request stays open,
    ///   as after any failed step.
    ///
    /// Freeing after the round can only fail on a broken executor; the rank then aborts the
    /// group, since its peers have moved on.
    pub fn end(&mut self, req: &mut Request, ok: bool) -> Result<Ending, ClusterError> {
        let out = self.step(Step {
            finish: vec![(req, ok)],
            ..Step::default()
        })?;
        out.finished.into_iter().next().expect("a step of one end")
    }

    /// Runs work every rank has committed to in the last round (frees a fence held back):
    /// nothing can be undone together any more, so a failure aborts the group, naming this
    /// rank.
    fn commit(
        &mut self,
        what: &str,
        work: impl FnOnce(&mut Self) -> Result<(), ClusterError>,
    ) -> Result<(), ClusterError> {
        work(self).inspect_err(|e| {
            self.group.abort(&format!(
                "rank {} failed after {what} was agreed, so the replicas can no longer agree: \
                 {e}",
                self.rank.0
            ));
        })
    }

    /// Frees device pages the tree does not keep (and poisons them), once no peer reads them.
    pub(super) fn release_pages(&mut self, pages: Vec<PageId>) -> Result<(), ClusterError> {
        self.after_backups(Some(&pages))?;
        self.alloc.free(&pages)?;
        self.poison_freed(pages)
    }

    /// Pages of the whole granules in `tokens` tokens: what the tree matches and keeps.
    pub(super) fn whole_granule_pages(&self, tokens: usize) -> usize {
        let granule = self.layout.granule() as usize;
        tokens / (self.layout.page_size() as usize * granule) * granule
    }

    /// Steps 1-2 of a request: match, then load back host-only nodes.
    pub(super) fn begin_inner(
        &mut self,
        tokens: &[u32],
        n: usize,
        panic_here: bool,
        fence: bool,
        from_storage: StorageRead<'_>,
    ) -> Result<Request, ClusterError> {
        let ps = self.layout.page_size() as usize;
        let mut stats = RequestStats {
            prompt_tokens: tokens.len() as u64,
            ..RequestStats::default()
        };
        let full = self.whole_granule_pages(tokens.len());
        let key = &tokens[..full * ps];

        // 1. Match (identical trees give identical results on every rank).
        let m = self.tree.match_prefix(key)?;
        let mut pages = m.device_pages.clone();
        stats.device_hit_tokens = (pages.len() * ps) as u64;
        let mut locked = m.last_device_node;
        self.lock(locked)?;
        if panic_here {
            panic!(
                "rank {} panics in request {n} on purpose (a test)",
                self.rank.0
            );
        }

        // 2. Past what the tree matched, the storage tier's run becomes one more host-only
        // node (one round, when pages are left to read).
        let mut host_nodes = m.host_nodes.clone();
        let mut storage_tokens = 0;
        if self.storage.is_some() {
            let parent = host_nodes.last().copied().unwrap_or(locked);
            let matched = pages.len()
                + host_nodes
                    .iter()
                    .map(|&id| Ok(self.tree.node(id)?.num_pages(ps as u32)))
                    .sum::<Result<usize, TreeError>>()?;
            // The parent's path stays put while host room is made for the run.
            self.lock(parent)?;
            let read = match from_storage {
                StorageRead::Round => self.read_from_storage(key, matched, parent, n, &mut stats),
                StorageRead::Agreed(None) => Ok(None),
                StorageRead::Agreed(Some(run)) => {
                    self.install_storage_run(key, matched, parent, run, &mut stats)
                }
            };
            self.unlock(parent)?;
            if let Some(leaf) = read? {
                storage_tokens = self.tree.node(leaf)?.key().len() as u64;
                host_nodes.push(leaf);
            }
        }

        // 3. Load back host-only nodes, owners preserved, layer by layer.
        let mut load = None;
        if let Some(&last) = host_nodes.last() {
            // Lock the host-only nodes too: evictions on the load path (and write-back
            // backups, which may evict host LRU) must not remove the nodes being loaded.
            self.lock(last)?;
            let before = self.exec.counters();
            // The serving cycle's reader is verification, which waits per layer; an engine's
            // readers do when it says so.
            let loaded = self.load_back(
                &host_nodes,
                &mut stats,
                !fence || self.layer_waits,
                fence && self.layer_waits,
            )?;
            let c = self.exec.counters().since(&before);
            // Allocations and frees synchronise on CUDA (cuMemAlloc, cuMemFree), so they
            // count too.
            stats.load_path_syncs += c.stalls();
            // (Where peers read this rank's pool through executors of their own, the step
            // waits for its loads on the host once, before its outcome round: `RankCache::step`.)
            if let (true, true, Some((_, handle))) = (
                fence && self.layer_waits,
                self.peer_access == PeerAccess::Direct && self.group.size() > 1,
                &loaded,
            ) {
                // Peers on this executor read these pages after waiting for their own
                // loads' layers only: the cache's stream waits for this whole load (a wait on
                // the device, not the host).
                handle.wait_all()?;
            }
            match loaded {
                Some((run, handle)) => {
                    stats.storage_hit_tokens = storage_tokens;
                    stats.host_hit_tokens = (run.len() * ps) as u64 - storage_tokens;
                    stats.pages_loaded += run.len() as u64;
                    pages.extend(run);
                    self.unlock(locked)?;
                    locked = last;
                    load = Some(handle);
                }
                None => {
                    self.unlock(last)?;
                    stats.load_degraded_to_miss += 1;
                }
            }
        }
        let cached = pages.len();
        Ok(Request {
            n,
            tokens: tokens.to_vec(),
            hashes: reference::prefix_hashes_from(
                self.config.deployment.tp().prefix_hash_seed(),
                tokens,
            ),
            pages,
            cached,
            in_tree: cached,
            fresh_from: cached * ps,
            locked,
            load,
            allocated: false,
            done: false,
            stats,
        })
    }

    /// Step 3: allocate the pages to compute (whole granules), their owners as the layout
    /// says.
    pub(super) fn allocate_inner(&mut self, req: &mut Request) -> Result<(), ClusterError> {
        let ps = self.layout.page_size() as usize;
        let (layout, cp) = (self.config.deployment.layout, self.layout.cp());
        let n_pages = layout.pages_for(cp, ps as u32, req.tokens.len());
        let owners = layout.owners(cp, req.cached, n_pages - req.cached);
        let run = self.alloc_with_eviction(&owners, &req.pages, &mut req.stats)?;
        req.pages.extend(run);
        req.stats.computed_tokens = (req.tokens.len() - req.cached * ps) as u64;
        req.allocated = true;
        Ok(())
    }

    /// Adds `tokens` to the request (after inserting what it has written, unfinished) and
    /// allocates the pages past its partial last page. Returns the request's pages the
    /// tree replaced with its own, to free once every rank is past the round.
    fn extend_inner(
        &mut self,
        req: &mut Request,
        tokens: &[u32],
    ) -> Result<Vec<PageId>, ClusterError> {
        let release = self.insert_written(req, false)?;
        let ps = self.layout.page_size();
        let (layout, cp) = (self.config.deployment.layout, self.layout.cp());
        let written = req.tokens.len();
        req.tokens.extend_from_slice(tokens);
        reference::extend_prefix_hashes_from(
            &mut req.hashes,
            self.config.deployment.tp().prefix_hash_seed(),
            tokens,
        );
        let n_pages = layout.pages_for(cp, ps, req.tokens.len());
        let have = req.pages.len();
        if n_pages > have {
            let owners = layout.appended_owners(cp, have, n_pages - have);
            let run = self.alloc_with_eviction(&owners, &req.pages, &mut req.stats)?;
            req.pages.extend(run);
        }
        req.fresh_from = written;
        req.stats.computed_tokens += tokens.len() as u64;
        req.stats.extended_tokens += tokens.len() as u64;
        req.stats.extends += 1;
        Ok(release)
    }

    /// Inserts the request's whole granules (KV the engine has written) into the tree and
    /// backs the new nodes up per the write policy; the request then locks the deepest node
    /// and holds the tree's pages (where the tree already had some of them on the device,
    /// those replace the request's, which are returned to free once no peer reads them).
    /// With `always`, inserts even when nothing is new (finish: it refreshes the path's
    /// LRU stamps).
    fn insert_written(
        &mut self,
        req: &mut Request,
        always: bool,
    ) -> Result<Vec<PageId>, ClusterError> {
        let ps = self.layout.page_size() as usize;
        let full = self.whole_granule_pages(req.tokens.len());
        if full <= req.in_tree && !always {
            return Ok(Vec::new());
        }
        let ins = self
            .tree
            .insert(&req.tokens[..full * ps], &req.pages[..full])?;
        // Every rank drops the same copies (owners are replicated).
        req.stats.host_copies_replaced += ins.dropped_host_copies.len() as u64;
        let mut released_host = Vec::new();
        for meta in ins.dropped_host_copies {
            self.host.free(meta.host_pages())?;
            self.freed.host.extend(meta.host_pages().iter().copied());
            released_host.extend(meta.host_pages().iter().copied());
        }
        self.poison_freed_host(released_host)?;
        let node = ins.node;
        let mut tree_pages = Vec::with_capacity(full);
        if node != NodeId::ROOT {
            for id in self.tree.path(node)? {
                let n = self.tree.node(id)?;
                let pages = n.device().ok_or_else(|| {
                    ClusterError::Config(format!(
                        "request {}: node {id} on the path just inserted is not on the device",
                        req.n
                    ))
                })?;
                tree_pages.extend_from_slice(pages);
            }
        }
        if tree_pages.len() != full {
            return Err(ClusterError::Config(format!(
                "request {}: the tree holds {} pages for its {full} whole pages",
                req.n,
                tree_pages.len()
            )));
        }
        let mut to_free = Vec::new();
        for (mine, theirs) in req.pages[..full].iter_mut().zip(&tree_pages) {
            if mine != theirs {
                to_free.push(*mine);
                *mine = *theirs;
            }
        }
        self.lock(node)?;
        self.unlock(req.locked)?;
        req.locked = node;
        req.in_tree = full;
        if self.config.policy == WritePolicy::WriteThrough && node != NodeId::ROOT {
            for id in self.tree.path(node)? {
                let n = self.tree.node(id)?;
                if n.host().is_none() && n.device().is_some() {
                    self.write_back(id, &mut req.stats)?;
                }
            }
        }
        Ok(to_free)
    }

    /// Steps 6-7: insert the whole granules, back up per the policy, release the locks.
    /// Returns the device pages to free (those the tree replaced, and the partial last
    /// granule, which the tree cannot key), which peers may still be reading: the caller
    /// frees them once every rank is past its reads ([`RankCache::release_pages`]).
    pub(super) fn finish_inner(&mut self, req: &mut Request) -> Result<Vec<PageId>, ClusterError> {
        let mut to_free = self.insert_written(req, true)?;
        to_free.extend_from_slice(&req.pages[req.in_tree..]);
        // 7. Release.
        self.unlock(req.locked)?;
        // What the read-ahead refused meanwhile, this request counts.
        self.count_untaken(&mut req.stats);
        Ok(to_free)
    }
}

#[cfg(test)]
mod tests;
