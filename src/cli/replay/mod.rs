//! `cp-hicache replay`: the main job. Replays a prefix-sharing workload through the CP
//! cluster, verifying every request's materialised KV byte for byte, and reports hit rates,
//! traffic, throughput, replica agreement and mismatched tokens.

mod args;
mod drive;
mod memory;
mod processes;
mod report;

use crate::cluster::{Cluster, ClusterConfig, Fault, Ranks};
use crate::exec::Executor;
use crate::jit::open_executor;
use crate::jit::{Jit, JitConfig, Sanitize};
use crate::kernels::Deployment;
pub use args::*;
use args::{ReplayPlan, RequestStream};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
pub use memory::*;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

/// Runs the replay and prints the report; the exit status says whether it was correct.
pub(super) fn run(args: &ReplayArgs) -> Result<ExitCode, crate::Error> {
    if let Some(member) = processes::Member::from_env()? {
        return member.run(args);
    }
    if args.processes {
        return processes::launch(args);
    }
    let plan = args.validate()?;
    args.check_files()?;
    let (workload, total) = args.workload()?;
    let exec: Arc<dyn Executor> = Arc::from(open_executor(args.backend)?);
    let jit = Jit::new(JitConfig::from_env()?);
    let mut setup = Setup::new(args, &plan, exec.as_ref(), &jit)?;
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
    if let Some(store) = open_store(args, &setup.config, None)? {
        setup.storage_read_only = store.read_only();
        cluster
            .attach_storage(store, args.storage_policy)
            .map_err(cluster_error)?;
    }
    drive(&mut cluster, args, plan, setup, workload, total)
}

/// Opens the store of a `--storage` that names a store of objects
/// ([`OBJECT_STORE_SCHEME`], Mooncake Store), for the deployment of the config: given by a
/// process that can reach one (`python -m cp_hicache.replay`, through Python).
pub type ObjectStoreOpener<'a> =
    &'a dyn Fn(&str, &ClusterConfig) -> Result<Arc<dyn crate::storage::PageStore>, crate::Error>;

/// How a `--storage` names a Mooncake Store (its master) instead of a directory.
pub const OBJECT_STORE_SCHEME: &str = "mooncake://";

/// The store of `--storage`, if any, opened for this deployment's records: a directory, or
/// a `mooncake://` store opened by `objects` (`None`: this process cannot reach one).
fn open_store(
    args: &ReplayArgs,
    config: &ClusterConfig,
    objects: Option<ObjectStoreOpener<'_>>,
) -> Result<Option<Arc<dyn crate::storage::PageStore>>, crate::Error> {
    let Some(dir) = &args.storage else {
        return Ok(None);
    };
    if let Some(url) = dir.to_str().filter(|s| s.starts_with(OBJECT_STORE_SCHEME)) {
        let Some(open) = objects else {
            return Err(crate::Error::Usage(format!(
                "--storage {url}: this process reaches Mooncake Store only through Python \
                 (python -m cp_hicache.replay --ranks N ... --storage {url})"
            )));
        };
        if let Some(fault) = args.inject.filter(|f| f.storage_damage().is_some()) {
            return Err(crate::Error::Usage(format!(
                "--inject {fault} damages records in a directory store, not in {url}"
            )));
        }
        return open(url, config).map(Some);
    }
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
    replay_rank_with(args, group, None)
}

/// [`replay_rank`] where a `--storage mooncake://...` is opened by `objects`.
pub fn replay_rank_with(
    args: &ReplayArgs,
    group: Box<dyn crate::group::Collective>,
    objects: Option<ObjectStoreOpener<'_>>,
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
    let mut setup = Setup::new(args, &plan, exec.as_ref(), &jit)?;
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
    match open_store(args, &setup.config, objects) {
        Ok(Some(store)) => {
            setup.storage_read_only = store.read_only();
            rank.attach_storage(store, args.storage_policy)
                .map_err(cluster_error)?
        }
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
    /// Whether the store (`--storage`) could only be read: records are read, none written.
    storage_read_only: bool,
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
            storage_read_only: false,
        })
    }
}

/// The replay itself, over every rank in this process or this process's one rank: the same
/// calls either way (see [`Ranks`]), so both report the same: the requests
/// ([`drive::replay_all`]), then the verdict and the report ([`report::conclude`]).
fn drive(
    cluster: &mut dyn Ranks,
    args: &ReplayArgs,
    plan: ReplayPlan,
    setup: Setup,
    workload: RequestStream,
    total: Option<u64>,
) -> Result<ExitCode, crate::Error> {
    if let Some(n) = args.verify_ranks {
        cluster.set_verifying_ranks(usize::from(n));
    }
    cluster.set_layer_waits(args.layer_waits);
    tracing::info!(
        kernels_ms = cluster.kernels().startup_ms,
        cache_hits = cluster.kernels().cache_hits,
        "kernels ready"
    );
    let tally = drive::replay_all(cluster, args, workload, total)?;
    report::conclude(cluster, args, plan, setup, tally)
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
