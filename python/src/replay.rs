//! The multi-process replay's Rust half: argument checking for the launcher, and one rank's
//! replay (`cp_hicache::cli::replay_rank`) over a Python collective.

use crate::collective::PyCollective;
use clap::Parser;
use cp_hicache::cli::ReplayArgs;
use pyo3::prelude::*;
use std::process::ExitCode;

/// `python -m cp_hicache.replay`: the replay of `cp-hicache replay`, with each CP rank in a
/// process of its own, the ranks agreeing through torch.distributed (gloo on 127.0.0.1) and
/// mapping each other's pools (shared memory). Every rank verifies every request (unless
/// --verify-ranks); rank 0 prints the report. The report and --json are those of
/// `cp-hicache replay`, with `group.kind` "torch.distributed".
///
/// Exit status: 0 every request verified with no mismatch; 1 a mismatch, a failed request,
/// a rank that died or timed out; 2 bad arguments or input.
#[derive(Debug, Parser)]
#[command(name = "python -m cp_hicache.replay", version)]
struct Cli {
    /// Rank processes to start; must equal --cp.
    #[arg(long, value_name = "C", value_parser = clap::value_parser!(u8).range(1..=16))]
    ranks: u8,
    /// Seconds a rank waits for its peers in any one collective call before the run ends
    /// with an error (the gloo group's timeout).
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        env = "CP_HICACHE_GROUP_TIMEOUT"
    )]
    group_timeout: f64,
    #[command(flatten)]
    replay: ReplayArgs,
}

fn parse(argv: &[String]) -> Result<Cli, (i32, String)> {
    let mut full = vec!["python -m cp_hicache.replay".to_string()];
    full.extend(argv.iter().cloned());
    let cli = Cli::try_parse_from(full).map_err(|e| (e.exit_code(), e.render().to_string()))?;
    if cli.replay.processes {
        return Err((
            2,
            "error: --processes is `cp-hicache replay`'s launcher; this one already runs each \
             rank in a process of its own\n"
                .to_string(),
        ));
    }
    if cli.ranks != cli.replay.cp {
        return Err((
            2,
            format!(
                "error: --ranks {} but --cp {}: each CP rank is one process\n",
                cli.ranks, cli.replay.cp
            ),
        ));
    }
    if !(cli.group_timeout.is_finite() && cli.group_timeout > 0.0 && cli.group_timeout < 1e9) {
        return Err((
            2,
            format!(
                "error: --group-timeout {} is not a positive number of seconds\n",
                cli.group_timeout
            ),
        ));
    }
    Ok(cli)
}

/// Checks the launcher's arguments before any rank starts. Returns `(None, ranks, timeout)`
/// to go on, or `(Some(status), text, ...)`: print `text` (to stdout when the status is 0,
/// as for `--help`) and exit with the status.
#[pyfunction]
pub(crate) fn check_replay(py: Python<'_>, argv: Vec<String>) -> (Option<i32>, String, u8, f64) {
    let cli = match parse(&argv) {
        Ok(cli) => cli,
        Err((code, text)) => return (Some(code), text, 0, 0.0),
    };
    match py.detach(|| cp_hicache::cli::check_replay_args(&cli.replay)) {
        Ok(()) => (None, String::new(), cli.ranks, cli.group_timeout),
        Err(e) => (
            Some(if e.is_usage() { 2 } else { 1 }),
            format!("error: {e}\n"),
            0,
            0.0,
        ),
    }
}

/// A `--storage mooncake://HOST:PORT[?OPTION=VALUE&...]`: a `cp_hicache.mooncake.MooncakeStore`
/// (`cp_hicache.mooncake.open_store`), under a page store that writes and checks the
/// records here.
fn open_objects(
    url: &str,
    config: &cp_hicache::cluster::ClusterConfig,
) -> Result<std::sync::Arc<dyn cp_hicache::storage::PageStore>, cp_hicache::Error> {
    let backend = Python::attach(|py| {
        let obj = py
            .import("cp_hicache.mooncake")?
            .call_method1("open_store", (url,))?;
        crate::object_store::PyBackend::new(&obj)
    })
    .map_err(|e| {
        cp_hicache::Error::Cluster(
            cp_hicache::storage::StorageError::Backend(format!("--storage {url}: {e}")).into(),
        )
    })?;
    let store = cp_hicache::storage::ObjectStore::new(
        backend,
        cp_hicache::storage::Fingerprint::of(&config.deployment, config.layers),
        cp_hicache::storage::payload_bytes(&config.deployment, config.layers),
    )
    .map_err(|e| cp_hicache::Error::Cluster(e.into()))?;
    Ok(std::sync::Arc::new(store))
}

/// Runs one rank of the replay (`collective.rank`); rank 0 prints the report. Returns the
/// exit status and, on an error, its message.
#[pyfunction]
pub(crate) fn replay_rank(
    py: Python<'_>,
    argv: Vec<String>,
    collective: &Bound<'_, PyAny>,
) -> PyResult<(i32, Option<String>)> {
    let cli = match parse(&argv) {
        Ok(cli) => cli,
        Err((code, text)) => return Ok((code, Some(text))),
    };
    let group = PyCollective::new(collective)?;
    let rank = cp_hicache::group::Collective::rank(&group).0;
    let out = py.detach(move || {
        cp_hicache::cli::replay_rank_with(&cli.replay, Box::new(group), Some(&open_objects))
    });
    Ok(match out {
        Ok(code) if code == ExitCode::SUCCESS => (0, None),
        // The replay's own statuses are 0, 1 (a failure in what ran) and 2 (the input).
        Ok(code) if code == ExitCode::from(2) => (2, None),
        Ok(_) => (1, None),
        Err(e) => {
            // Most errors name their rank already; say which rank for those that do not.
            let text = e.to_string();
            let named = text.starts_with(&format!("rank {rank}"));
            (
                if e.is_usage() { 2 } else { 1 },
                Some(if named {
                    text
                } else {
                    format!("rank {rank}: {text}")
                }),
            )
        }
    })
}
