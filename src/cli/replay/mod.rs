//! `cp-hicache replay`: the main job. Replays a prefix-sharing workload through the CP
//! cluster, verifying every request's materialised KV byte for byte, and reports hit rates,
//! traffic, throughput, replica agreement and mismatched tokens.

mod args;
mod memory;

use crate::cluster::{
    Cluster, ClusterConfig, Fault, Ranks, ReplayReport, RequestStats, RollbackDrops,
};
use crate::exec::{open_executor, Executor};
use crate::jit::{Jit, JitConfig, Sanitize};
use crate::kernels::Deployment;
pub use args::*;
use args::{live_shape, ReplayPlan, RequestStream};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
pub use memory::*;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// Runs the replay and prints the report; the exit status says whether it was correct.
pub(super) fn run(args: &ReplayArgs) -> Result<ExitCode, crate::Error> {
    let plan = args.validate()?;
    args.check_files()?;
    let (workload, total) = args.workload()?;
    let exec: Arc<dyn Executor> = Arc::from(open_executor(args.backend)?);
    let jit = Jit::new(JitConfig::from_env()?);
    let setup = Setup::new(args, &plan, exec.as_ref(), &jit)?;
    check_memory(&setup.config, exec.backend())?;
    // One executor per rank where peers in this process can map each other's pools (shared
    // memory on the CPU), as engine processes each hold their own; on one GPU the ranks share
    // it (CUDA IPC handles cannot be opened by the process that made them).
    let mut cluster = if args.peer_pools == PeerPools::Gathered {
        Cluster::gathered(setup.config.clone(), exec, &jit)
    } else if exec.maps_in_process() {
        let mut execs = vec![exec];
        for _ in 1..args.cp {
            execs.push(Arc::from(open_executor(args.backend)?));
        }
        Cluster::with_executors(setup.config.clone(), execs, &jit)
    } else {
        Cluster::new(setup.config.clone(), exec, &jit)
    }
    .map_err(cluster_error)?;
    if let Some(store) = open_store(args, &setup.config)? {
        cluster
            .attach_storage(store, args.storage_policy)
            .map_err(cluster_error)?;
    }
    drive(&mut cluster, args, plan, setup, workload, total)
}

/// The store of `--storage`, if any, opened for this deployment's records.
fn open_store(
    args: &ReplayArgs,
    config: &ClusterConfig,
) -> Result<Option<Arc<dyn crate::storage::PageStore>>, crate::Error> {
    let Some(dir) = &args.storage else {
        return Ok(None);
    };
    let store = crate::storage::DirStore::for_deployment(
        dir,
        &config.deployment,
        config.layers,
        args.storage_bytes,
    )
    .map_err(|e| cluster_error(e.into()))?;
    Ok(Some(match args.inject.and_then(Fault::storage_damage) {
        Some(damage) => Arc::new(crate::storage::DamagingStore::new(store, damage, 3)),
        None => Arc::new(store),
    }))
}

/// Checks a replay's arguments as [`replay_rank`] will, before any rank starts: everything
/// `cp-hicache replay` refuses with exit status 2 (the settings, the trace's every line, the
/// output file) is refused here, so a launcher refuses it once instead of in every rank.
pub fn check_replay_args(args: &ReplayArgs) -> Result<(), crate::Error> {
    let plan = args.validate()?;
    args.check_files()?;
    if let Some(t) = args.trace.as_ref().filter(|t| t.exists() && !t.is_file()) {
        return Err(crate::Error::Usage(format!(
            "--trace {} is not a regular file: every rank process reads the trace itself, so \
             it cannot be a pipe",
            t.display()
        )));
    }
    drop(args.workload()?);
    // Checked once here: ranks checking while their peers allocate would see each other's
    // pools as used memory, and could refuse on some ranks only.
    let config = ClusterConfig {
        deployment: plan.deployment,
        layers: args.layers,
        device_pages: args.device_pages,
        host_pages: args.host_pages,
        policy: args.policy,
        fault: args.inject,
        sanitize: Sanitize::None,
    };
    check_memory(&config, args.backend.resolve())
}

/// Runs this process's rank (`group.rank()`) of a replay whose ranks are separate processes
/// (`python -m cp_hicache.replay`; its launcher calls [`check_replay_args`] first, which
/// checks memory for the whole group): the same workload, checks and report as
/// `cp-hicache replay`, on one [`RankCache`](crate::rank::RankCache) agreeing with its peers
/// through `group`. Every rank verifies (unless `--verify-ranks`); rank 0 prints the report
/// and writes `--json`. Every rank returns the same exit status.
///
/// The executor is this process's own (`--backend`), and peers map its pools (POSIX shared
/// memory on the CPU), so it must support [`Executor::peer_mapping`].
pub fn replay_rank(
    args: &ReplayArgs,
    group: Box<dyn crate::group::Collective>,
) -> Result<ExitCode, crate::Error> {
    let plan = args.validate()?;
    let (workload, total) = args.workload()?;
    if group.size() != usize::from(args.cp) {
        return Err(crate::Error::Usage(format!(
            "--cp {} needs {} rank processes, not {}",
            args.cp,
            args.cp,
            group.size()
        )));
    }
    let exec: Arc<dyn Executor> = Arc::from(open_executor(args.backend)?);
    if exec.peer_mapping().is_none() && args.peer_pools == PeerPools::Mapped {
        return Err(crate::Error::Usage(format!(
            "the {} executor cannot map peers' pools across processes",
            exec.backend()
        )));
    }
    let jit = Jit::new(JitConfig::from_env()?);
    // Memory was checked once for the group (`check_replay_args`), not per rank.
    let setup = Setup::new(args, &plan, exec.as_ref(), &jit)?;
    let mut rank = crate::rank::RankCache::new(
        setup.config.clone(),
        exec,
        &jit,
        group,
        match args.peer_pools {
            PeerPools::Mapped => crate::rank::PeerAccess::Mapped,
            PeerPools::Gathered => crate::rank::PeerAccess::Gathered,
        },
    )
    .map_err(cluster_error)?;
    // Every rank attaches (a collective), even one whose store failed to open: its failure
    // then ends its peers' round at once.
    match open_store(args, &setup.config) {
        Ok(Some(store)) => rank
            .attach_storage(store, args.storage_policy)
            .map_err(cluster_error)?,
        Ok(None) => {}
        Err(e) => {
            let _ = rank
                .group()
                .fail(crate::rank::STORAGE_ROUND, &e.to_string());
            return Err(e);
        }
    }
    drive(&mut rank, args, plan, setup, workload, total)
}

/// The cluster settings a replay runs with, and what the report says about them.
struct Setup {
    config: ClusterConfig,
    deployment: Deployment,
    backend: String,
    tuning_file: Option<PathBuf>,
}

impl Setup {
    fn new(
        args: &ReplayArgs,
        plan: &ReplayPlan,
        exec: &dyn Executor,
        jit: &Jit,
    ) -> Result<Setup, crate::Error> {
        // Launch shapes tuned for this executor: from --tuning, else <cache>/tuning.json if any.
        let mut deployment = plan.deployment.clone();
        let device = crate::tuning::DeviceKey::for_executor(exec, jit)?;
        let warnings = crate::tuning::apply(&mut deployment, args.tuning.as_deref(), &device)?;
        // Named in the report only when some of its shapes run.
        let tuning_file = (deployment != plan.deployment).then(|| {
            args.tuning
                .clone()
                .unwrap_or_else(crate::tuning::default_path)
        });
        for warning in crate::tuning::warning_lines(&warnings) {
            eprintln!("warning: {warning}");
        }
        if let Some(path) = args.transfer {
            deployment.transfer_path = path;
        }
        let config = ClusterConfig {
            deployment: deployment.clone(),
            layers: args.layers,
            device_pages: args.device_pages,
            host_pages: args.host_pages,
            policy: args.policy,
            fault: args.inject,
            sanitize: Sanitize::from_env()?,
        };
        Ok(Setup {
            config,
            deployment,
            backend: exec.backend().to_string(),
            tuning_file,
        })
    }
}

/// The replay itself, over every rank in this process or this process's one rank: the same
/// calls either way (see [`Ranks`]), so both report the same.
fn drive(
    cluster: &mut dyn Ranks,
    args: &ReplayArgs,
    plan: ReplayPlan,
    setup: Setup,
    workload: RequestStream,
    total: Option<u64>,
) -> Result<ExitCode, crate::Error> {
    let Setup {
        deployment,
        backend,
        tuning_file,
        ..
    } = setup;
    let reports = cluster.reports();
    if let Some(n) = args.verify_ranks {
        cluster.set_verifying_ranks(usize::from(n));
    }
    tracing::info!(
        kernels_ms = cluster.kernels().startup_ms,
        cache_hits = cluster.kernels().cache_hits,
        "kernels ready"
    );
    // The request the injected launch failure is aimed at (on the last rank).
    let last = usize::from(args.cp) - 1;
    let mut launch_failure_at = None;
    if args.inject == Some(Fault::LaunchError) {
        // Fail a request in the middle, once the cache holds something worth protecting.
        let at = total.map_or(1, |t| (t / 2) as usize);
        cluster.inject_launch_failure_on(last, at);
        launch_failure_at = Some(at);
    }

    // Only the reporting process draws and notes; every rank still makes every call.
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
    let mut totals = RequestStats::default();
    let mut requests = 0u64;
    let mut disagreed_at = None;
    let mut failed = 0u64;
    let mut dropped = RollbackDrops::default();
    let mut skipped = 0u64;
    // A bad line the up-front check could not see (a pipe, or a file changed since) stops
    // the replay there; what ran is still reported.
    let mut input_error = None;
    let mut log = String::new();
    for req in workload {
        let req = match req {
            Ok(req) => req,
            Err(e) => {
                input_error = Some(e);
                break;
            }
        };
        let before = cluster.replica_digests().map_err(cluster_error)?;
        let shape = live_shape(args, &req);
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
            Ok(stats) => {
                totals.add(&stats);
                if let Some(first) = stats.first_mismatched_token {
                    say(format!(
                        "request {}: {} mismatched tokens, the first at token {first}",
                        req.id, stats.mismatched_tokens
                    ));
                }
            }
            Err(e) if e.is_pool_too_small() => {
                // The cluster rolled the request back; smaller ones can still be served. The
                // error says which lanes were short and why, not just a page count.
                if skipped == 0 {
                    let at = req
                        .line
                        .map_or(String::new(), |l| format!(" (trace line {l})"));
                    say(format!(
                        "warning: request {}{at} skipped: {e}; later requests that do not \
                             fit are skipped and counted too",
                        req.id
                    ));
                }
                skipped += 1;
                if launch_failure_at == Some(requests as usize) {
                    // The launch failure aimed at this request went with it (it launched
                    // nothing): aim at the next one, so the fault is still exercised.
                    let next = requests as usize + 1;
                    cluster.inject_launch_failure_on(last, next);
                    launch_failure_at = Some(next);
                }
            }
            Err(e) if e.is_usage() || e.is_group_broken() => {
                // A broken group (a rank gone, a timeout, diverged ranks) serves no more.
                bar.finish_and_clear();
                return Err(cluster_error(e));
            }
            Err(e) => {
                failed += 1;
                // The rollback may legitimately drop cache entries whose pages the failed
                // request had evicted (and may have reused): then the state differs from
                // before, but the replicas must still agree, and something must have been
                // dropped to explain the difference.
                let drops = cluster.last_rollback();
                dropped.device_pages += drops.device_pages;
                dropped.host_copies += drops.host_copies;
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
                    disagreed_at.get_or_insert(req.id);
                }
            }
        }
        requests += 1;
        let after = cluster.replica_digests().map_err(cluster_error)?;
        let agree = !after.is_empty() && after.windows(2).all(|w| w[0] == w[1]);
        if disagreed_at.is_none() && !agree {
            disagreed_at = Some(req.id);
            say(format!("request {}: replicas disagree", req.id));
        }
        if args.request_log.is_some() {
            entry["digests"] = after.iter().map(ToString::to_string).collect();
            log.push_str(&entry.to_string());
            log.push('\n');
        }
        bar.inc(1);
        bar.set_message(format!("{} mismatched", totals.mismatched_tokens));
    }
    bar.finish_and_clear();
    // A run that verified nothing must not read as a pass.
    if requests == 0 {
        if let Some(e) = input_error {
            return Err(e.into());
        }
        return Err(crate::Error::Usage(format!(
            "{} has no request: nothing to verify",
            plan.workload_name
        )));
    }
    if skipped == requests {
        if let Some(e) = &input_error {
            eprintln!("error: {e}");
        }
        return Err(crate::Error::Usage(format!(
            "no request fits in the device pool: all {skipped} were skipped, nothing was \
             verified; raise --device-pages"
        )));
    }
    let fault_exercised = args
        .inject
        .map(|f| fault_exercised(f, &totals, failed, args.cp, args.device_pages));
    if let (true, Some(f), Some(Err(why))) = (reports, args.inject, &fault_exercised) {
        eprintln!("warning: the injected fault {f} never fired: {why}");
    }
    let wall = start.elapsed().as_secs_f64();
    // The allocator kernels' output is never read on the serving path (the host mirror
    // decides); compare the device lane stacks with the mirrors once now, off that path.
    let device_lanes_agree = match cluster.check_device_lanes() {
        Ok(()) => true,
        Err(e) if e.is_group_broken() => return Err(cluster_error(e)),
        Err(e) => {
            if reports {
                eprintln!("device lane stacks disagree with the allocator's host mirror: {e}");
            }
            false
        }
    };
    let served = requests - failed - skipped;
    let report = ReplayReport {
        requests,
        rounds_per_request: if served > 0 {
            totals.group_rounds as f64 / served as f64
        } else {
            0.0
        },
        tokens_per_second: if wall > 0.0 {
            totals.prompt_tokens as f64 / wall
        } else {
            0.0
        },
        totals,
        replicas_agree: disagreed_at.is_none() && device_lanes_agree,
        device_lanes_agree,
        wall_seconds: wall,
        backend,
        cp: args.cp,
        page_size: args.page_size,
        model: deployment.model.to_string(),
        layers: args.layers,
        policy: args.policy.to_string(),
        layout: deployment.layout.to_string(),
        chunk_tokens: args.chunk_tokens,
        decode_tokens: args.decode_tokens.map(|d| d.to_string()),
        workload: match &input_error {
            Some(e) => format!("{}, cut short by {e}", plan.workload_name),
            None => plan.workload_name,
        },
        failed_requests: failed,
        requests_skipped: skipped,
        rollback_dropped_device_pages: dropped.device_pages,
        rollback_dropped_host_copies: dropped.host_copies,
        fault: args.inject.map(|f| f.to_string()),
        fault_fired: fault_exercised.as_ref().map(Result::is_ok),
        fault_not_fired_because: fault_exercised.and_then(Result::err),
        tuning_file: tuning_file.map(|p| p.display().to_string()),
        copy_launch: deployment.copy.to_string(),
        group: cluster.group_info(),
        transfer_path: deployment.transfer_path.to_string(),
        synth_threads: deployment.synth_threads,
        storage: args.storage.as_ref().map(|dir| {
            format!(
                "{} · {} · {}",
                dir.display(),
                args.storage_policy,
                crate::cluster::stats::human_bytes(args.storage_bytes)
            )
        }),
    };
    if reports {
        outln!("cp-hicache replay");
        out!("{}", report.to_table());
        if let Some(path) = &args.json {
            super::common::write_json(path, &report)?;
        }
        if let Some(path) = &args.request_log {
            super::common::write_output(path, &log)?;
        }
    }
    if let Some(e) = input_error {
        if reports {
            eprintln!(
            "error: {e}\n  the replay stopped there: the report covers the {requests} requests \
             before it"
            );
        }
        // A failure in what ran is the stronger verdict; otherwise the input is at fault.
        return Ok(if report.ok() && failed == 0 {
            ExitCode::from(2)
        } else {
            ExitCode::FAILURE
        });
    }
    if report.ok() && failed == 0 {
        Ok(ExitCode::SUCCESS)
    } else {
        Ok(ExitCode::FAILURE)
    }
}

/// Whether an injected fault did anything in this run, judged from what it must cause;
/// otherwise why not. A fault that never fired tested nothing, and a clean report would
/// read as if the failure path had been exercised.
fn fault_exercised(
    fault: Fault,
    totals: &RequestStats,
    failed: u64,
    cp: u8,
    device_pages: u32,
) -> Result<(), String> {
    let fired = match fault {
        // Only a page loaded into another owner's page tests anything: at CP 1, or when
        // the plain allocation happens to give the recorded owners, the bug is invisible.
        Fault::PlainAllocOnLoad => totals.pages_loaded_misowned > 0,
        Fault::LaneExhaustion => totals.evictions_lane + totals.load_degraded_to_miss > 0,
        Fault::HostPoolFull => totals.backups_skipped + totals.host_evictions_for_backup > 0,
        // The kernels are built before the first request, so a run that got here failed.
        Fault::CompileError => true,
        Fault::LaunchError => failed > 0,
        Fault::StorageTorn => totals.storage_refused_torn > 0,
        Fault::StorageFlip => totals.storage_refused_checksum > 0,
        Fault::StorageForeign => totals.storage_refused_fingerprint > 0,
        // Verification is what must catch it.
        Fault::StorageUnchecked => totals.mismatched_tokens > 0,
    };
    if fired {
        return Ok(());
    }
    Err(match fault {
        Fault::PlainAllocOnLoad if totals.pages_loaded == 0 => format!(
            "no page was loaded back from the host, every prefix hit was still on the \
             device; a smaller --device-pages (now {device_pages}) forces load-backs"
        ),
        Fault::PlainAllocOnLoad if cp == 1 => format!(
            "at CP 1 every page has the one owner, so the {} pages loaded back could not \
             land on another owner's page; a CP above 1 makes the bug visible",
            totals.pages_loaded
        ),
        Fault::PlainAllocOnLoad => format!(
            "each of the {} pages loaded back happened to get the owner it was backed up \
             from, so the plain allocation matched the owner-preserving one",
            totals.pages_loaded
        ),
        Fault::LaneExhaustion => format!(
            "no allocation ran short of a lane: no lane-targeted eviction, no load-back \
             degraded to a miss; a smaller --device-pages (now {device_pages}) or more \
             requests make one"
        ),
        Fault::HostPoolFull => "no backup found the host pool full (none was skipped, no host \
             copy was evicted for one); longer or more requests make it"
            .into(),
        Fault::CompileError => "the kernels compiled".into(),
        Fault::LaunchError => "no request from the middle of the workload on launched a \
             kernel (each was skipped as too large, or empty)"
            .into(),
        Fault::StorageTorn | Fault::StorageFlip | Fault::StorageForeign
            if totals.storage_records_read == 0 =>
        {
            "no record was read from the store: a run before this one with the same \
             --storage writes the records a later run reads"
                .into()
        }
        Fault::StorageTorn | Fault::StorageFlip | Fault::StorageForeign => format!(
            "none of the {} records read was one the fault damaged",
            totals.storage_records_read
        ),
        Fault::StorageUnchecked => format!(
            "no damaged record was served into a hit that was verified ({} records read)",
            totals.storage_records_read
        ),
    })
}

pub(super) fn cluster_error(e: crate::cluster::ClusterError) -> crate::Error {
    if e.is_usage() {
        crate::Error::Usage(e.to_string())
    } else {
        crate::Error::Cluster(e)
    }
}

/// A line for the user on stderr, above the progress bar when there is one.
fn note(bar: &ProgressBar, line: String) {
    if bar.is_hidden() {
        eprintln!("{line}");
    } else {
        bar.println(line);
    }
}

fn progress_bar(total: Option<u64>, quiet: bool) -> ProgressBar {
    if quiet || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = match total {
        Some(n) => ProgressBar::new(n),
        None => ProgressBar::no_length(),
    };
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template(
            "{spinner} replay [{elapsed_precise}] {wide_bar} {pos}/{len} requests · {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

#[cfg(test)]
mod tests;
