//! A scheduler's whole step in at most one group round ([`RankCache::step`]).
//!
//! Every rank runs the step's operations in order (finish, extend, begin) on its replica,
//! then one outcome round carries the step's decision digest and, per operation, what this
//! rank did with it. Where every rank did the same, that round was the whole step. Where a
//! rank failed an operation (or ended a request with `ok = false` that its peers finished),
//! every rank rolls the step back and runs it again with that operation skipped (abandoned,
//! for an end): extra rounds only on the failure path, and per request, not per batch.
//! A step whose only operations are decode tokens landing in a request's kept partial page
//! decides nothing the replicas could differ on: it takes no round, and its inputs ride on
//! the next round's digest.

use super::*;
use crate::rank::fence::Fence;
use crate::rank::storage::StorageRun;

/// One scheduler step: the requests it ends, grows and admits, applied in that order (a
/// step's finished requests free pages its new requests may take).
#[derive(Default)]
pub struct Step<'r> {
    /// Requests to end, each with whether this rank's forward succeeded (`false`: every
    /// rank abandons it, [`RankCache::end`]).
    pub finish: Vec<(&'r mut Request, bool)>,
    /// Requests to grow by the given tokens ([`RankCache::extend`]).
    pub extend: Vec<(&'r mut Request, &'r [u32])>,
    /// Prompts to admit, in order ([`RankCache::begin`]).
    pub begin: Vec<&'r [u32]>,
    /// Whether admitted requests get their pages at once ([`RankCache::begin_allocated`]).
    pub allocate: bool,
    /// Take only the cached prefix and this many tokens of each admitted prompt (a chunked
    /// prefill's first chunk, [`RankCache::begin_chunk`]); needs `allocate`.
    pub chunk: Option<usize>,
}

/// What a step did with each of its requests, in the order the step gave them.
pub struct StepOutcome {
    /// Per ended request: finished or abandoned on every rank, or the error that left it
    /// open (as a failed [`RankCache::end`] does).
    pub finished: Vec<Result<Ending, ClusterError>>,
    /// Per grown request: grown, or the error that left it as it was.
    pub extended: Vec<Result<(), ClusterError>>,
    /// Per admitted prompt: its new request, or why it was not admitted.
    pub begun: Vec<Result<Request, ClusterError>>,
    /// Group rounds the step took: 1 when every rank agreed at once, 0 for a step that
    /// decided nothing.
    pub rounds: u64,
}

/// How a pass runs one operation. Ordered: the agreed mode of an operation is the
/// greatest any rank asked for, so modes only grow and the passes end.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Mode {
    Run,
    /// Some rank failed it: every rank leaves it undone.
    Skip,
    /// Some rank ended the request with `ok = false`: every rank abandons it.
    Abandon,
}

impl Mode {
    fn from_byte(b: u8) -> Option<Mode> {
        [Mode::Run, Mode::Skip, Mode::Abandon]
            .get(usize::from(b))
            .copied()
    }
}

/// What a pass did with one operation on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Status {
    Done,
    Failed(String),
    /// Not reached: the pass stopped at an earlier failure.
    NotRun,
}

/// One rank's part of a step's outcome round, per operation.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Report {
    digest: Vec<u8>,
    ops: Vec<(Mode, Status)>,
    /// The store's run (pages) each admitted prompt that read the store installed.
    runs: Vec<u32>,
}

impl Report {
    fn encode(&self) -> Vec<u8> {
        let mut b = self.digest.clone();
        b.extend((self.ops.len() as u32).to_le_bytes());
        for (mode, status) in &self.ops {
            b.push(*mode as u8);
            match status {
                Status::Done => b.push(0),
                Status::NotRun => b.push(2),
                Status::Failed(why) => {
                    b.push(1);
                    b.extend((why.len() as u32).to_le_bytes());
                    b.extend(why.as_bytes());
                }
            }
        }
        b.extend((self.runs.len() as u32).to_le_bytes());
        b.extend(self.runs.iter().flat_map(|r| r.to_le_bytes()));
        b
    }

    /// `None` for bytes no rank of this step could have sent.
    fn decode(b: &[u8], ops: usize, runs: usize) -> Option<Report> {
        let digest = b.get(..DIGEST)?.to_vec();
        let mut at = DIGEST;
        let mut take = |n: usize| {
            let s = b.get(at..at + n)?;
            at += n;
            Some(s)
        };
        let u32_at = |s: &[u8]| u32::from_le_bytes(s.try_into().expect("4 bytes")) as usize;
        if u32_at(take(4)?) != ops {
            return None;
        }
        let mut out = Vec::with_capacity(ops);
        for _ in 0..ops {
            let mode = Mode::from_byte(take(1)?[0])?;
            let status = match take(1)?[0] {
                0 => Status::Done,
                2 => Status::NotRun,
                1 => {
                    let n = u32_at(take(4)?);
                    Status::Failed(String::from_utf8(take(n)?.to_vec()).ok()?)
                }
                _ => return None,
            };
            out.push((mode, status));
        }
        if u32_at(take(4)?) != runs {
            return None;
        }
        let runs = (0..runs)
            .map(|_| Some(u32_at(take(4)?) as u32))
            .collect::<Option<Vec<u32>>>()?;
        (at == b.len()).then_some(Report {
            digest,
            ops: out,
            runs,
        })
    }
}

/// What one pass over a step's operations left on this rank.
struct Pass {
    ops: Vec<(Mode, Status)>,
    /// This rank's own failure, at the operation where the pass stopped.
    error: Option<(usize, ClusterError)>,
    /// Device pages to free once every rank is past the round.
    release: Vec<PageId>,
    begun: Vec<Option<Request>>,
}

impl RankCache {
    /// Runs a scheduler's step, finish then extend then begin, each operation with the
    /// semantics of its single-request call, in **at most one group round** whatever the
    /// batch: the outcome round carries the step's decision digest and every rank's
    /// failures. One request's failure fails that request on every rank, not the step: a
    /// failed extend or finish leaves its request as it was, a failed begin admits nothing,
    /// and an end some rank says not `ok` abandons the request on every rank; those cost the
    /// rollback and another round. A step of decode tokens that land in kept partial pages
    /// (nothing inserted, nothing allocated) takes no round; the next round's digest covers
    /// it. Pages the step frees (finished requests', pages the tree replaced) are freed after
    /// the round, when no peer reads them. With a store attached, admitted prompts past the
    /// tree's match read it first; each rank installs the run it found, the outcome round
    /// compares them, and only where ranks found different runs does the step run again with
    /// the shortest.
    ///
    /// An error for the whole step (the group broke, or the ranks decided differently:
    /// [`ClusterError::Diverged`]) leaves every request as it was and admits nothing.
    pub fn step(&mut self, mut step: Step<'_>) -> Result<StepOutcome, ClusterError> {
        self.check_connected()?;
        self.check_step(&step)?;
        let (nf, ne, nb) = (step.finish.len(), step.extend.len(), step.begin.len());
        let base_n = self.served;
        self.served += nb;
        let what = self.step_name(&step, base_n);
        // Whatever comes next (releases, poison fills, a roll-back) runs after the loads of
        // the requests being ended.
        for (req, _) in &mut step.finish {
            req.load = None;
        }
        let extend_inputs: Vec<Vec<u8>> = step
            .extend
            .iter()
            .map(|(req, tokens)| Self::extend_inputs(req, tokens))
            .collect();
        if nf == 0
            && nb == 0
            && step
                .extend
                .iter()
                .all(|(req, tokens)| self.extend_is_trivial(req, tokens.len()))
        {
            return self.roundless_step(step, &what, &extend_inputs);
        }
        let saved: Vec<Saved> = step
            .finish
            .iter()
            .map(|(r, _)| r.save())
            .chain(step.extend.iter().map(|(r, _)| r.save()))
            .collect();
        let rounds = self.rounds();
        let (mut runs, probe_stats) = self.probe_begins(&step)?;
        let probed = runs.iter().flatten().count();
        let ops = nf + ne + nb;
        let mut modes: Vec<Mode> = step
            .finish
            .iter()
            .map(|&(_, ok)| if ok { Mode::Run } else { Mode::Abandon })
            .chain(std::iter::repeat_n(Mode::Run, ne + nb))
            .collect();
        let mut failures: Vec<Vec<(u8, String)>> = vec![Vec::new(); ops];
        let mut mine: Vec<Option<ClusterError>> = (0..ops).map(|_| None).collect();
        let mut by: Vec<BTreeSet<u8>> = vec![BTreeSet::new(); nf];
        let mut first = true;
        let round = format!("{what} outcome");
        loop {
            let snapshot = self.snapshot();
            let mut pass = self.run_pass(&mut step, &modes, &runs, &probe_stats, base_n, &what)?;
            let fence = self.fence_loads(&mut pass, nf + ne);
            if let Some((j, e)) = pass.error.take() {
                mine[j].get_or_insert(e);
            }
            let inputs = self.step_inputs(&step, &pass.ops, &extend_inputs);
            let report = Report {
                digest: self.decision(&what, &inputs),
                ops: pass.ops,
                runs: runs.iter().flatten().map(|r| r.agreed as u32).collect(),
            };
            let gathered = self.group.exchange(&round, Ok(&report.encode()));
            self.unagreed.clear();
            let reports = gathered.map_err(ClusterError::from).and_then(|all| {
                self.check_round(&round, &all, |_, b| {
                    Report::decode(b, ops, probed).is_none().then(|| {
                        format!("{} bytes, not a step report of {ops} operations", b.len())
                    })
                })?;
                Ok(all
                    .iter()
                    .map(|b| Report::decode(b, ops, probed).expect("checked"))
                    .collect::<Vec<_>>())
            });
            let reports = match reports {
                Ok(r) => r,
                Err(e) => {
                    if !e.is_group_broken() {
                        drop(pass.begun);
                        // The requests follow the state back even when the rollback's own
                        // executor work failed (the state itself was restored).
                        let rolled = self.roll_back(snapshot, &what);
                        Self::restore_requests(&mut step, saved);
                        rolled?;
                    }
                    return Err(e);
                }
            };
            // The greatest mode any rank asked for, per operation; settled when every rank
            // ran every operation in the same mode without a failure.
            let mut settled = true;
            let mut next = modes.clone();
            for j in 0..ops {
                for (r, rep) in reports.iter().enumerate() {
                    let (mode, status) = &rep.ops[j];
                    let wants = match status {
                        Status::Failed(why) => {
                            if !failures[j].iter().any(|(f, _)| usize::from(*f) == r) {
                                failures[j].push((r as u8, why.clone()));
                            }
                            Mode::Skip
                        }
                        Status::Done | Status::NotRun => *mode,
                    };
                    if j < nf && (first && *mode == Mode::Abandon || wants == Mode::Skip) {
                        // Ranks that did not finish the request: said not ok, or failed.
                        by[j].insert(r as u8);
                    }
                    next[j] = next[j].max(wants);
                    settled &= *status == Status::Done && *mode == reports[0].ops[j].0;
                }
            }
            first = false;
            // The store's runs: each rank installed what it found; where they differ, every
            // rank takes the shortest (whole granules, as every rank rounded) and runs again.
            for (k, run) in runs.iter_mut().flatten().enumerate() {
                let shortest = reports.iter().map(|r| r.runs[k]).min().unwrap_or(0);
                if reports.iter().any(|r| r.runs[k] != shortest) {
                    settled = false;
                    run.agreed = shortest as usize;
                }
            }
            if !settled {
                drop(pass.begun);
                let rolled = self.roll_back(snapshot, &what);
                Self::restore_requests(&mut step, saved.clone());
                rolled?;
                modes = next;
                continue;
            }
            let digests: Vec<Vec<u8>> = reports.into_iter().map(|r| r.digest).collect();
            if let Err(e) = self.check_agreement(&what, &digests) {
                drop(pass.begun);
                let rolled = self.roll_back(snapshot, &what);
                Self::restore_requests(&mut step, saved);
                rolled?;
                return Err(e);
            }
            // The peers' loads, before anything reads them.
            let loads = pass
                .begun
                .iter_mut()
                .flatten()
                .filter_map(|r| r.load.as_mut());
            self.after_peer_fences(fence, loads)?;
            // Every rank is past the round: no peer reads these pages any more.
            let release = std::mem::take(&mut pass.release);
            self.commit(&what, |me| me.release_pages(release))?;
            let taken = self.rounds() - rounds;
            return Ok(self.step_outcome(step, &modes, pass.begun, mine, failures, by, taken));
        }
    }

    /// The fence of a step's loads where peers read this rank's pools through executors of
    /// their own ([`PeerAccess::Mapped`]: other processes on CUDA), which cannot wait on this
    /// rank's ordinary events. With interprocess events (`src/rank/fence.rs`): loads whose
    /// readers wait per layer recorded this rank's per-layer fence as they were enqueued,
    /// and after the outcome round their handles wait for the peers' layers with their
    /// own; other loads are waited for by the cache's stream on the device, this rank's
    /// fence recorded after them, and the step waits for the peers' after the outcome
    /// round. Otherwise the host waits for the copies once, before the outcome round lets
    /// anyone read, counted on the first request that loaded. Whether a step
    /// loaded is replicated (every rank loads its part of the same nodes), so every rank
    /// fences alike. A failure fails that admission (the round still comes, so the peers
    /// learn it).
    fn fence_loads(&mut self, pass: &mut Pass, first_begin: usize) -> Option<Fence> {
        if self.peer_access != PeerAccess::Mapped || self.group.size() < 2 {
            return None;
        }
        let i = pass
            .begun
            .iter()
            .position(|r| r.as_ref().is_some_and(|r| r.load.is_some()))?;
        let loads = || pass.begun.iter().flatten().filter_map(|r| r.load.as_ref());
        let fenced = match self.fence_layers(loads()) {
            Some(fence) => Ok(Some(fence)),
            None => self.fence_own_work(loads()),
        };
        let req = pass.begun[i].as_mut().expect("found above");
        match fenced {
            Ok(Some(fence)) => return Some(fence),
            Ok(None) => req.stats.fence_syncs += 1,
            Err(e) if pass.error.is_none() => {
                let j = first_begin + i;
                let e = ClusterError::from(e);
                pass.ops[j].1 = Status::Failed(e.to_string());
                pass.error = Some((j, e));
            }
            Err(_) => {}
        }
        None
    }

    /// Refuses a step its requests cannot take, before any round: every rank's engine
    /// gives the same step, so every rank refuses it alike.
    fn check_step(&self, step: &Step<'_>) -> Result<(), ClusterError> {
        let mut seen = BTreeSet::new();
        for (req, ok) in &step.finish {
            req.check_open(if *ok { "finish" } else { "abandon" })?;
            if *ok {
                req.check_allocated("for its uncached tokens")?;
            }
            if !seen.insert(req.n) {
                return Err(ClusterError::Config(format!(
                    "request {} appears twice in one step",
                    req.n
                )));
            }
        }
        for (req, tokens) in &step.extend {
            req.check_open("extend")?;
            req.check_allocated("to extend")?;
            if tokens.is_empty() {
                return Err(ClusterError::Config(format!(
                    "request {}: extend needs at least one token",
                    req.n
                )));
            }
            if !seen.insert(req.n) {
                return Err(ClusterError::Config(format!(
                    "request {} appears twice in one step (an end and an extend, or two \
                     extends): give it its tokens in one extend",
                    req.n
                )));
            }
        }
        match step.chunk {
            Some(0) => Err(ClusterError::Config(
                "a prefill chunk needs at least one token".into(),
            )),
            Some(_) if !step.allocate => Err(ClusterError::Config(
                "a chunked begin allocates its first chunk: a step with a chunk needs \
                 allocate"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// Names a step's rounds as its single-request call did, so a one-request step reads
    /// as before in errors and traces.
    fn step_name(&mut self, step: &Step<'_>, base_n: usize) -> String {
        let k = self.steps;
        self.steps += 1;
        match (
            step.finish.as_slice(),
            step.extend.as_slice(),
            step.begin.len(),
        ) {
            ([(req, _)], [], 0) => format!("request {} end", req.n),
            ([], [(req, _)], 0) => format!("request {} extend", req.n),
            ([], [], 1) if step.allocate => format!("request {base_n} begin+allocate"),
            ([], [], 1) => format!("request {base_n} begin"),
            _ => format!(
                "step {k} ({} end, {} extend, {} begin)",
                step.finish.len(),
                step.extend.len(),
                step.begin.len()
            ),
        }
    }

    /// Whether extending `req` by `n` tokens inserts nothing and allocates nothing (a
    /// decoded token inside the kept partial page): replicated state alone decides it.
    pub(super) fn extend_is_trivial(&self, req: &Request, n: usize) -> bool {
        let ps = self.layout.page_size();
        let (layout, cp) = (self.config.deployment.layout, self.layout.cp());
        self.whole_granule_pages(req.tokens.len()) <= req.in_tree
            && layout.pages_for(cp, ps, req.tokens.len() + n) <= req.pages.len()
    }

    /// What an extend's decision covers: O(1) in the request's length (the last prefix
    /// hash covers every token so far; a decoded token must not cost a hash of the whole
    /// sequence), and the new tokens.
    fn extend_inputs(req: &Request, tokens: &[u32]) -> Vec<u8> {
        let mut inputs = Vec::with_capacity(48 + 4 * tokens.len());
        for v in [
            req.n as u64,
            req.tokens.len() as u64,
            req.hashes.last().copied().unwrap_or_default(),
            req.pages.len() as u64,
            req.pages.last().map_or(0, |p| u64::from(p.0)),
            req.in_tree as u64,
        ] {
            inputs.extend(v.to_le_bytes());
        }
        inputs.extend(tokens.iter().flat_map(|t| t.to_le_bytes()));
        inputs
    }

    /// A step that changes no replicated state: its extends run with no round, and what
    /// they were given is chained into the digest the next round compares.
    fn roundless_step(
        &mut self,
        step: Step<'_>,
        what: &str,
        inputs: &[Vec<u8>],
    ) -> Result<StepOutcome, ClusterError> {
        let mut h = Sha256::new();
        h.update(&self.unagreed);
        h.update(what.as_bytes());
        for i in inputs {
            h.update((i.len() as u64).to_le_bytes());
            h.update(i);
        }
        let mut extended = Vec::with_capacity(step.extend.len());
        for (req, tokens) in step.extend {
            let release = self.extend_inner(req, tokens)?;
            debug_assert!(release.is_empty(), "a trivial extend inserts nothing");
            extended.push(Ok(()));
        }
        self.unagreed = h.finalize().to_vec();
        Ok(StepOutcome {
            finished: Vec::new(),
            extended,
            begun: Vec::new(),
            rounds: 0,
        })
    }

    /// Reads the store for every admitted prompt the tree does not match to its end (which
    /// every rank knows alike), before the passes. Each rank first installs the run it found
    /// (whole granules); the outcome round carries every rank's, and where they differ the
    /// step runs again with the shortest ([`RankCache::step`]). Returns each prompt's run and
    /// the counts its reads made.
    fn probe_begins(
        &mut self,
        step: &Step<'_>,
    ) -> Result<(Vec<Option<StorageRun>>, Vec<RequestStats>), ClusterError> {
        let nb = step.begin.len();
        let mut stats = vec![RequestStats::default(); nb];
        if self.storage.is_none() {
            return Ok(((0..nb).map(|_| None).collect(), stats));
        }
        let ps = self.layout.page_size() as usize;
        let granule = self.layout.granule() as usize;
        let mut runs = Vec::with_capacity(nb);
        for (tokens, stats) in step.begin.iter().zip(&mut stats) {
            let key = &tokens[..self.whole_granule_pages(tokens.len()) * ps];
            let matched = self.tree.matched_pages(key)?;
            let mut run = self.probe_storage(key, matched, stats);
            if let Some(run) = &mut run {
                let mine = run.run;
                run.agree(std::iter::once(mine), granule);
            }
            runs.push(run);
        }
        Ok((runs, stats))
    }

    /// Runs the step's operations in `modes` on this replica, stopping at the first that
    /// fails here. Errs only when the group broke.
    fn run_pass(
        &mut self,
        step: &mut Step<'_>,
        modes: &[Mode],
        runs: &[Option<StorageRun>],
        probe_stats: &[RequestStats],
        base_n: usize,
        what: &str,
    ) -> Result<Pass, ClusterError> {
        let nf = step.finish.len();
        let ne = step.extend.len();
        let mut pass = Pass {
            ops: modes.iter().map(|&m| (m, Status::NotRun)).collect(),
            error: None,
            release: Vec::new(),
            begun: Vec::with_capacity(step.begin.len()),
        };
        let record = |pass: &mut Pass, j: usize, r: Result<(), ClusterError>| match r {
            Ok(()) => {
                pass.ops[j].1 = Status::Done;
                Ok(true)
            }
            Err(e) if e.is_group_broken() || e.is_peer_failure() => Err(e),
            Err(e) => {
                pass.ops[j].1 = Status::Failed(e.to_string());
                pass.error = Some((j, e));
                Ok(false)
            }
        };
        for (j, (req, _)) in step.finish.iter_mut().enumerate() {
            let r = match modes[j] {
                Mode::Skip => Ok(()),
                Mode::Run => self.finish_inner(req).map(|free| pass.release.extend(free)),
                Mode::Abandon => {
                    // What the tree holds (the cached prefix, pages inserted unfinished)
                    // stays cached; the rest is freed after the round.
                    // An unlock that fails here leaves this replica unlike its peers'.
                    pass.release.extend_from_slice(&req.pages[req.in_tree..]);
                    let locked = req.locked;
                    self.commit(what, |me| me.unlock(locked))
                }
            };
            if !record(&mut pass, j, r)? {
                return Ok(pass);
            }
        }
        for (i, (req, tokens)) in step.extend.iter_mut().enumerate() {
            let j = nf + i;
            let r = match modes[j] {
                Mode::Run => self
                    .extend_inner(req, tokens)
                    .map(|free| pass.release.extend(free)),
                Mode::Skip | Mode::Abandon => Ok(()),
            };
            if !record(&mut pass, j, r)? {
                return Ok(pass);
            }
        }
        for (i, tokens) in step.begin.iter().enumerate() {
            let j = nf + ne + i;
            if modes[j] != Mode::Run {
                pass.begun.push(None);
                record(&mut pass, j, Ok(()))?;
                continue;
            }
            let r = self.begin_op(
                tokens,
                base_n + i,
                step.allocate,
                step.chunk,
                runs[i].as_ref(),
                &probe_stats[i],
            );
            let r = r.map(|req| pass.begun.push(Some(req)));
            if !record(&mut pass, j, r)? {
                return Ok(pass);
            }
        }
        Ok(pass)
    }

    /// One admitted prompt: match, load back (the store's agreed run included), take the
    /// first chunk, allocate.
    fn begin_op(
        &mut self,
        tokens: &[u32],
        n: usize,
        allocate: bool,
        chunk: Option<usize>,
        run: Option<&StorageRun>,
        probe_stats: &RequestStats,
    ) -> Result<Request, ClusterError> {
        let mut req = self.begin_inner(tokens, n, false, true, StorageRead::Agreed(run))?;
        req.stats.add(probe_stats);
        if let Some(chunk) = chunk {
            let ps = self.layout.page_size() as usize;
            let take = (req.cached * ps).saturating_add(chunk).min(tokens.len());
            req.tokens.truncate(take);
            req.hashes.truncate(take);
            req.stats.prompt_tokens = take as u64;
        }
        if allocate {
            self.allocate_inner(&mut req)?;
        }
        Ok(req)
    }

    /// What the step's decision digest covers beside the state: each operation's mode and
    /// inputs (an ended request's tokens and pages as the pass left them).
    fn step_inputs(
        &self,
        step: &Step<'_>,
        ops: &[(Mode, Status)],
        extend_inputs: &[Vec<u8>],
    ) -> Vec<u8> {
        let mut h = Sha256::new();
        for (j, (req, _)) in step.finish.iter().enumerate() {
            h.update([ops[j].0 as u8]);
            // An abandon keeps no token: ranks whose roundless steps gave a request other
            // tokens (they diverged, and learnt it at the next round) can still give it up.
            let tokens = if ops[j].0 == Mode::Abandon {
                &[][..]
            } else {
                &req.tokens[..]
            };
            h.update(Self::request_inputs(tokens, &req.pages, req.cached));
        }
        let nf = step.finish.len();
        for (i, inputs) in extend_inputs.iter().enumerate() {
            h.update([ops[nf + i].0 as u8]);
            h.update((inputs.len() as u64).to_le_bytes());
            h.update(inputs);
        }
        let ne = extend_inputs.len();
        h.update([u8::from(step.allocate)]);
        h.update((step.chunk.unwrap_or(0) as u64).to_le_bytes());
        for (i, tokens) in step.begin.iter().enumerate() {
            h.update([ops[nf + ne + i].0 as u8]);
            h.update(Self::request_inputs(tokens, &[], 0));
        }
        h.finalize().to_vec()
    }

    fn restore_requests(step: &mut Step<'_>, saved: Vec<Saved>) {
        let reqs = step
            .finish
            .iter_mut()
            .map(|(r, _)| &mut **r)
            .chain(step.extend.iter_mut().map(|(r, _)| &mut **r));
        for (req, saved) in reqs.zip(saved) {
            req.restore(saved);
        }
    }

    /// Each request's result once the step settled in `modes`.
    #[allow(clippy::too_many_arguments)]
    fn step_outcome(
        &self,
        step: Step<'_>,
        modes: &[Mode],
        begun: Vec<Option<Request>>,
        mut mine: Vec<Option<ClusterError>>,
        failures: Vec<Vec<(u8, String)>>,
        by: Vec<BTreeSet<u8>>,
        rounds: u64,
    ) -> StepOutcome {
        let mut failures = failures.into_iter();
        let mut mine_iter = mine.iter_mut();
        let mut failed = move || -> ClusterError {
            let peers = failures.next().unwrap_or_default();
            mine_iter
                .next()
                .and_then(Option::take)
                .unwrap_or_else(|| GroupError::PeerFailed { failures: peers }.into())
        };
        let nf = step.finish.len();
        let ne = step.extend.len();
        let mut finished = Vec::with_capacity(nf);
        for ((req, _), (mode, by)) in step.finish.into_iter().zip(modes.iter().zip(by)) {
            let err = failed();
            req.stats.group_rounds += rounds;
            finished.push(match mode {
                Mode::Run => {
                    req.done = true;
                    Ok(Ending::Finished(Box::new(req.stats.clone())))
                }
                Mode::Abandon => {
                    req.done = true;
                    Ok(Ending::Abandoned {
                        by: by.into_iter().collect(),
                    })
                }
                Mode::Skip => Err(err),
            });
        }
        let mut extended = Vec::with_capacity(ne);
        for ((req, _), mode) in step.extend.into_iter().zip(&modes[nf..]) {
            let err = failed();
            req.stats.group_rounds += rounds;
            extended.push(if *mode == Mode::Run { Ok(()) } else { Err(err) });
        }
        let mut out = Vec::with_capacity(begun.len());
        for req in begun {
            let err = failed();
            out.push(match req {
                Some(mut req) => {
                    req.stats.group_rounds += rounds;
                    Ok(req)
                }
                None => Err(err),
            });
        }
        StepOutcome {
            finished,
            extended,
            begun: out,
            rounds,
        }
    }
}

#[cfg(test)]
mod tests;
