//! The replay loop: every request through the ranks, one at a time, and what each did,
//! tallied for the report. A failed request is rolled back and the loop goes on; a broken
//! group ends it.

use super::args::{live_shape, ReplayArgs, RequestStream};
use super::{cluster_error, note, progress_bar};
use crate::cluster::{Fault, Ranks, RequestStats, RollbackDrops};
use crate::workload::{Request, WorkloadError};
use indicatif::ProgressBar;
use std::time::Instant;

/// What the requests did, for the report.
pub(super) struct Tally {
    /// Every served request's statistics, summed.
    pub(super) totals: RequestStats,
    /// Requests taken from the workload (served, skipped or failed).
    pub(super) requests: u64,
    /// Requests that failed (rolled back).
    pub(super) failed: u64,
    /// Requests skipped: they did not fit in the device pool.
    pub(super) skipped: u64,
    /// What the rollbacks of failed requests dropped.
    pub(super) dropped: RollbackDrops,
    /// The first request after which the replicas disagreed.
    pub(super) disagreed_at: Option<usize>,
    /// A bad input line the up-front check could not see (a pipe, or a file changed since):
    /// the replay stopped there, and what ran is still reported.
    pub(super) input_error: Option<WorkloadError>,
    /// The `--request-log` lines.
    pub(super) log: String,
    /// Wall time of the loop.
    pub(super) wall_seconds: f64,
    /// Serving steps of the batches (`--batch`), and the group rounds they took.
    pub(super) steps: u64,
    pub(super) step_rounds: u64,
}

/// Where the injected launch failure is aimed (`--inject launch-error`): a request in the
/// middle, on the last rank, once the cache holds something worth protecting.
struct LaunchFailure {
    rank: usize,
    at: Option<usize>,
}

/// Serves every request of `workload` on `cluster` (`total` of them when known).
pub(super) fn replay_all(
    cluster: &mut dyn Ranks,
    args: &ReplayArgs,
    workload: RequestStream,
    total: Option<u64>,
) -> Result<Tally, crate::Error> {
    let mut aim = LaunchFailure {
        rank: usize::from(args.cp) - 1,
        at: None,
    };
    if args.inject == Some(Fault::LaunchError) {
        let at = total.map_or(1, |t| (t / 2) as usize);
        cluster.inject_launch_failure_on(aim.rank, at);
        aim.at = Some(at);
    }
    // Only the reporting process draws and notes; every rank still makes every call.
    let reports = cluster.reports();
    let bar = if reports {
        progress_bar(total, args.quiet)
    } else {
        ProgressBar::hidden()
    };
    let say = |line: String| {
        if reports {
            note(&bar, line);
        }
    };
    let start = Instant::now();
    let mut tally = Tally {
        totals: RequestStats::default(),
        requests: 0,
        failed: 0,
        skipped: 0,
        dropped: RollbackDrops::default(),
        disagreed_at: None,
        input_error: None,
        log: String::new(),
        wall_seconds: 0.0,
        steps: 0,
        step_rounds: 0,
    };
    let prefetch = args.storage.is_some() && !args.no_prefetch;
    let mut workload = workload.peekable();
    if args.batch > 1 {
        let mut batch = Vec::with_capacity(args.batch as usize);
        loop {
            batch.clear();
            while batch.len() < args.batch as usize {
                match workload.next() {
                    Some(Ok(req)) => batch.push(req),
                    Some(Err(e)) => {
                        tally.input_error = Some(e);
                        break;
                    }
                    None => break,
                }
            }
            if batch.is_empty() {
                break;
            }
            if let Err(e) = tally.serve_batch(cluster, args, &batch, &say) {
                bar.finish_and_clear();
                return Err(e);
            }
            bar.inc(batch.len() as u64);
            bar.set_message(format!("{} mismatched", tally.totals.mismatched_tokens));
            if tally.input_error.is_some() {
                break;
            }
        }
    }
    while let Some(req) = workload.next().filter(|_| args.batch == 1) {
        let req = match req {
            Ok(req) => req,
            Err(e) => {
                tally.input_error = Some(e);
                break;
            }
        };
        // The next request's records, past what this one will cache, are read while this
        // one is served.
        if let (true, Some(Ok(next))) = (prefetch, workload.peek()) {
            let shared = req
                .tokens
                .iter()
                .zip(&next.tokens)
                .take_while(|(a, b)| a == b)
                .count();
            if let Err(e) = cluster.prefetch(&next.tokens, shared) {
                bar.finish_and_clear();
                return Err(cluster_error(e));
            }
        }
        if let Err(e) = tally.serve(cluster, args, &req, &mut aim, &say) {
            bar.finish_and_clear();
            return Err(e);
        }
        bar.inc(1);
        bar.set_message(format!("{} mismatched", tally.totals.mismatched_tokens));
    }
    bar.finish_and_clear();
    tally.wall_seconds = start.elapsed().as_secs_f64();
    Ok(tally)
}

impl Tally {
    /// Adds a served request's statistics, saying where its first mismatch is.
    fn count_served(&mut self, req: &Request, stats: &RequestStats, say: &dyn Fn(String)) {
        self.totals.add(stats);
        if let Some(first) = stats.first_mismatched_token {
            say(format!(
                "request {}: {} mismatched tokens, the first at token {first}",
                req.id, stats.mismatched_tokens
            ));
        }
    }

    /// Serves `reqs` together (`--batch`) and counts each: served, skipped (it does not
    /// fit), or failed (abandoned on every rank; the others went on). An error for the whole
    /// batch ends the replay: the group broke or the ranks diverged.
    fn serve_batch(
        &mut self,
        cluster: &mut dyn Ranks,
        args: &ReplayArgs,
        reqs: &[Request],
        say: &dyn Fn(String),
    ) -> Result<(), crate::Error> {
        let shapes: Vec<_> = reqs.iter().map(|r| live_shape(args, r)).collect();
        let prompts: Vec<Vec<u32>> = reqs.iter().map(|r| r.tokens.clone()).collect();
        let out = cluster
            .serve_batch(&prompts, &shapes)
            .map_err(cluster_error)?;
        self.steps += out.steps;
        self.step_rounds += out.step_rounds;
        // The batch's rounds, counted once (each request's own count holds every round of
        // every step it was in, shared with the others).
        self.totals.group_rounds += out.step_rounds;
        let mut entries = Vec::new();
        for (req, served) in reqs.iter().zip(out.requests) {
            let mut entry = serde_json::json!({
                "request": req.id,
                "outcome": match &served {
                    Ok(_) => "served",
                    Err(e) if e.is_pool_too_small() => "skipped",
                    Err(_) => "failed",
                },
            });
            match served {
                Ok(mut stats) => {
                    stats.group_rounds = 0;
                    entry["stats"] = serde_json::to_value(&stats).unwrap_or_default();
                    self.count_served(req, &stats, say);
                }
                Err(e) if e.is_pool_too_small() => {
                    if self.skipped == 0 {
                        say(format!(
                            "warning: request {} skipped: {e}; later requests that do not fit \
                             are skipped and counted too",
                            req.id
                        ));
                    }
                    self.skipped += 1;
                }
                Err(e) if e.is_usage() => return Err(cluster_error(e)),
                Err(e) => {
                    self.failed += 1;
                    say(format!(
                        "request {} failed: {e}\n  abandoned on every rank; the batch went on",
                        req.id
                    ));
                }
            }
            self.requests += 1;
            entries.push(entry);
        }
        let after = cluster.replica_digests().map_err(cluster_error)?;
        let agree = !after.is_empty() && after.windows(2).all(|w| w[0] == w[1]);
        if self.disagreed_at.is_none() && !agree {
            let id = reqs.last().map_or(0, |r| r.id);
            self.disagreed_at = Some(id);
            say(format!("after request {id}: replicas disagree"));
        }
        if args.request_log.is_some() {
            for mut entry in entries {
                entry["digests"] = after.iter().map(ToString::to_string).collect();
                self.log.push_str(&entry.to_string());
                self.log.push('\n');
            }
        }
        Ok(())
    }

    /// Serves one request and counts what it did: served, skipped (it does not fit), or
    /// failed (rolled back on every rank, the state checked against the digests from
    /// before). An error ends the replay: a broken group serves no more.
    fn serve(
        &mut self,
        cluster: &mut dyn Ranks,
        args: &ReplayArgs,
        req: &Request,
        aim: &mut LaunchFailure,
        say: &dyn Fn(String),
    ) -> Result<(), crate::Error> {
        let before = cluster.replica_digests().map_err(cluster_error)?;
        let shape = live_shape(args, req);
        let live = !shape.is_plain(req.tokens.len());
        let served = if live {
            cluster.serve_live(&req.tokens, &shape)
        } else {
            cluster.serve(&req.tokens)
        };
        let mut entry = serde_json::json!({
            "request": req.id,
            "outcome": match &served {
                Ok(_) => "served",
                Err(e) if e.is_pool_too_small() => "skipped",
                Err(_) => "failed",
            },
        });
        if let Ok(stats) = &served {
            entry["stats"] = serde_json::to_value(stats).unwrap_or_default();
        }
        match served {
            Ok(stats) => self.count_served(req, &stats, say),
            Err(e) if e.is_pool_too_small() => {
                // The cluster rolled the request back; smaller ones can still be served. The
                // error says which lanes were short and why, not just a page count.
                if self.skipped == 0 {
                    let at = req
                        .line
                        .map_or(String::new(), |l| format!(" (trace line {l})"));
                    say(format!(
                        "warning: request {}{at} skipped: {e}; later requests that do not \
                         fit are skipped and counted too",
                        req.id
                    ));
                }
                self.skipped += 1;
                if aim.at == Some(self.requests as usize) {
                    // The launch failure aimed at this request went with it (it launched
                    // nothing): aim at the next one, so the fault is still exercised.
                    let next = self.requests as usize + 1;
                    cluster.inject_launch_failure_on(aim.rank, next);
                    aim.at = Some(next);
                }
            }
            // A broken group (a rank gone, a timeout, diverged ranks) serves no more.
            Err(e) if e.is_usage() || e.is_group_broken() => return Err(cluster_error(e)),
            Err(e) => {
                self.failed += 1;
                // The rollback may legitimately drop cache entries whose pages the failed
                // request had evicted (and may have reused): then the state differs from
                // before, but the replicas must still agree, and something must have been
                // dropped to explain the difference.
                let drops = cluster.last_rollback();
                self.dropped.device_pages += drops.device_pages;
                self.dropped.host_copies += drops.host_copies;
                let unchanged = cluster.replica_digests().map_err(cluster_error)? == before;
                let agree = cluster.replicas_agree().map_err(cluster_error)?;
                let state = match (unchanged, agree, drops.is_empty()) {
                    (true, _, _) => "unchanged".to_string(),
                    // Steps are agreed one by one: a failed one abandons the request, and
                    // what it inserted unfinished stays cached.
                    (false, true, _) if live => "abandoned on every rank".to_string(),
                    (false, true, false) => format!(
                        "rolled back, dropping stale cache entries ({} device pages, {} host copies)",
                        drops.device_pages, drops.host_copies
                    ),
                    (false, true, true) => "CHANGED although the rollback dropped nothing".into(),
                    (false, false, _) => "CHANGED and the replicas DISAGREE".into(),
                };
                say(format!(
                    "request {} failed: {e}\n  allocator and tree state {state} (digest before {})",
                    req.id,
                    before
                        .first()
                        .map_or("unknown".to_string(), ToString::to_string)
                ));
                if !agree || (!unchanged && drops.is_empty() && !live) {
                    self.disagreed_at.get_or_insert(req.id);
                }
            }
        }
        self.requests += 1;
        let after = cluster.replica_digests().map_err(cluster_error)?;
        let agree = !after.is_empty() && after.windows(2).all(|w| w[0] == w[1]);
        if self.disagreed_at.is_none() && !agree {
            self.disagreed_at = Some(req.id);
            say(format!("request {}: replicas disagree", req.id));
        }
        if args.request_log.is_some() {
            entry["digests"] = after.iter().map(ToString::to_string).collect();
            self.log.push_str(&entry.to_string());
            self.log.push('\n');
        }
        Ok(())
    }
}
