//! `cp-hicache tune`: times every launch-shape candidate of a deployment's allocator and
//! page-copy kernels on the executor at hand, merges the results into a tuning file keyed by
//! device and compiler, and prints the table and the launch shapes the file now selects.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use super::common::{check_merge_target, BackendArg, SizeArgs};
use crate::jit::open_executor;
use crate::jit::{Jit, JitConfig};
use crate::tuning::{self, bench::deployment_by_name, tuner::TuneOptions, TuneEvent, TuningFile};

/// Options of `tune`.
#[derive(Debug, clap::Args)]
pub struct TuneArgs {
    /// Deployment to tune: a reference name or any `<nsa|mla>_ps<N>_cp<C>[_ti<I>]` (`_ti<I>`: token-interleaved).
    #[arg(long, value_name = "NAME", default_value = super::compile::DEFAULT_DEPLOYMENT)]
    pub deployment: String,
    /// `--backend`.
    #[command(flatten)]
    pub executor: BackendArg,
    /// Tuning file to merge into (default: `<cache dir>/tuning.json`): an existing file must
    /// parse (its entries are kept); its folder must exist.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// A handful of candidates per kernel on smaller sizes (well under a minute on a CPU).
    #[arg(long)]
    pub quick: bool,
    /// `--pages`, `--layers`, `--repeats`.
    #[command(flatten)]
    pub sizes: SizeArgs,
}

pub(super) fn progress_bar(prefix: String) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(0);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed} {msg}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(prefix);
    Some(bar)
}

pub(super) fn run(args: &TuneArgs) -> Result<ExitCode, crate::Error> {
    let dep =
        deployment_by_name(&args.deployment).map_err(|e| crate::Error::Usage(e.to_string()))?;
    let mut opts = TuneOptions::new(args.quick);
    args.sizes
        .apply(&mut opts.sizes, std::slice::from_ref(&dep))?;
    let path = args.out.clone().unwrap_or_else(tuning::default_path);
    check_merge_target(&path, args.out.is_some())?;
    let exec = open_executor(args.executor.backend)?;
    // As in bench: one error up front when no kernel can be built for this executor.
    crate::tuning::measure::target_for(exec.as_ref())?;
    let jit = Jit::new(JitConfig::from_env()?);
    let bar = progress_bar(format!("tuning {} on {}", dep.name, exec.backend()));
    let on_event = |ev: TuneEvent| {
        if let Some(b) = &bar {
            match ev {
                TuneEvent::Planned { steps } => b.set_length(steps),
                TuneEvent::Step { what } => {
                    b.set_message(what);
                    b.inc(1);
                }
            }
        }
    };
    let tuning::Tuned {
        device,
        entries,
        failed,
        wrong_output,
    } = tuning::tune(&dep, exec.as_ref(), &jit, &opts, &on_event)?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }

    outln!("device: {device}");
    outln!(
        "{:<44}  {:<22}  {:>10}  {:>8}  note",
        "kernel",
        "candidate",
        "ms",
        "GB/s"
    );
    for e in &entries {
        for r in &e.results {
            let mark = if r.choice == e.best { "best" } else { "" };
            // On a GPU a transfer's time is beside the busy kernel (docs/KERNELS.md "busy").
            let beside = match (r.beside_busy, r.gbps, r.seconds) {
                (Some(b), Some(g), Some(s)) if r.dropped.is_none() => format!(
                    " beside busy; alone {:.2} GB/s; busy slowdown {:.3}x",
                    g * s / b.alone_seconds.max(1e-12),
                    b.busy_slowdown
                ),
                _ => String::new(),
            };
            outln!(
                "{:<44}  {:<22}  {:>10}  {:>8}  {}{beside}",
                e.spec_key,
                r.choice.to_string(),
                r.seconds
                    .map_or_else(|| "-".into(), |s| format!("{:.3}", s * 1e3)),
                r.gbps.map_or_else(|| "-".into(), |g| format!("{g:.2}")),
                r.dropped.as_deref().unwrap_or(mark),
            );
        }
    }

    // Kernels none of whose candidates ran fail the command, but the others' winners are
    // written first: a rerun after a fix need not time them again.
    for e in &failed {
        eprintln!("error: {e}");
    }
    // A shape that computes wrong bytes never wins, but it is a kernel bug all the same: the
    // run fails so that it is seen, after the valid winners are written.
    for w in &wrong_output {
        eprintln!("error: wrong output, candidate dropped (a kernel bug at this shape): {w}");
    }
    if entries.is_empty() {
        return Ok(ExitCode::FAILURE);
    }
    let file = TuningFile::merge_into(&path, entries)?;
    let (tuned, warnings, _) = dep.with_tuning(&file, &device);
    for w in crate::tuning::warning_lines(&warnings) {
        eprintln!("warning: {w}");
    }
    outln!(
        "tuned {}: alloc_threads {} (default {}), copy {} (default {}), transfer kernels {} (default {}), transfers by {} (default {}), synth_threads {} (default {}); written to {}",
        dep.name,
        tuned.alloc_threads,
        dep.alloc_threads,
        tuned.copy,
        dep.copy,
        tuned.transfer_copy,
        dep.transfer_copy,
        tuned.transfer_path,
        dep.transfer_path,
        tuned.synth_threads,
        dep.synth_threads,
        path.display()
    );
    Ok(if failed.is_empty() && wrong_output.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
