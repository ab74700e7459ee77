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
        "{:<44}  {:<22}  {:>10}  {:>8}  {:>8}  {:>8}  {:>7}  {:>7}  note",
        "kernel",
        "candidate",
        "ms",
        "GB/s",
        "alone",
        "hbm",
        "alu-x",
        "hbm-x"
    );
    for e in &entries {
        for r in &e.results {
            let mark = if r.choice == e.best { "best" } else { "" };
            let c = BesideColumns::of(r);
            outln!(
                "{:<44}  {:<22}  {:>10}  {:>8}  {:>8}  {:>8}  {:>7}  {:>7}  {}",
                e.spec_key,
                r.choice.to_string(),
                r.seconds
                    .map_or_else(|| "-".into(), |s| format!("{:.3}", s * 1e3)),
                r.gbps.map_or_else(|| "-".into(), |g| format!("{g:.2}")),
                c.alone,
                c.hbm,
                c.alu_slowdown,
                c.hbm_slowdown,
                [r.dropped.as_deref().unwrap_or(mark), &c.overlap]
                    .into_iter()
                    .filter(|n| !n.is_empty())
                    .collect::<Vec<_>>()
                    .join("; "),
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

/// The columns of a transfer timed beside the busy kernels (docs/KERNELS.md "busy"), `-`
/// otherwise: GB/s alone and beside the HBM kernel (the `GB/s` column is beside the ALU
/// one), each kernel's slowdown, and in the note where each ran against the transfers.
struct BesideColumns {
    alone: String,
    hbm: String,
    alu_slowdown: String,
    hbm_slowdown: String,
    overlap: String,
}

impl BesideColumns {
    fn of(r: &tuning::CandidateResult) -> BesideColumns {
        let none = || "-".to_string();
        let (Some(b), Some(g), Some(s), None) = (r.beside_busy, r.gbps, r.seconds, &r.dropped)
        else {
            return BesideColumns {
                alone: none(),
                hbm: none(),
                alu_slowdown: none(),
                hbm_slowdown: none(),
                overlap: String::new(),
            };
        };
        // GB/s at another time for the same bytes.
        let gbps_at = |t: f64| format!("{:.2}", g * s / t.max(1e-12));
        let overlap = |name: &str, o: tuning::Overlap| {
            format!(
                "{name} {:+.1}us {:.0}%",
                o.start_lag_ns as f64 / 1e3,
                o.covered * 100.0
            )
        };
        let overlaps: Vec<String> = b
            .alu_overlap
            .map(|o| overlap("alu", o))
            .into_iter()
            .chain(b.hbm.map(|h| overlap("hbm", h.overlap)))
            .collect();
        BesideColumns {
            alone: gbps_at(b.alone_seconds),
            hbm: b.hbm.map_or_else(none, |h| gbps_at(h.seconds)),
            alu_slowdown: format!("{:.3}", b.busy_slowdown),
            hbm_slowdown: b.hbm.map_or_else(none, |h| format!("{:.3}", h.slowdown)),
            overlap: if overlaps.is_empty() {
                String::new()
            } else {
                format!("start, overlap: {}", overlaps.join(", "))
            },
        }
    }
}
