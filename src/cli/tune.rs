//! `cp-hicache tune`: times every launch-shape candidate of a deployment's allocator and
//! page-copy kernels on the executor at hand, merges the results into a tuning file keyed by
//! device and compiler, and prints the table and the launch shapes the file now selects.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use super::common::{check_merge_target, BackendArg, SizeArgs};
use crate::jit::open_executor;
use crate::jit::{Jit, JitConfig};
use crate::tuning::sweep::SweepOptions;
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
    /// Instead of tuning, sweep the deployment's transfers (docs/KERNELS.md "Transfer
    /// sweep"): each buffer alone and all together, in both directions, at every
    /// `--sweep-threads` × `--sweep-grids` shape and on the DMA paths (`dma`, `dma-each`,
    /// `dma-staged`; CUDA only), each timed alone and beside the ALU and HBM busy kernels on
    /// a GPU. It writes no tuning file: the one-buffer transfers are not kernels the cache
    /// runs.
    #[arg(long, conflicts_with = "out")]
    pub sweep: bool,
    /// Threads per block the sweep times (comma-separated; default 128,256,512).
    #[arg(long, value_name = "N,..", value_delimiter = ',', requires = "sweep",
          value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub sweep_threads: Vec<u32>,
    /// Grid caps in blocks the sweep times (comma-separated; default 1,2,4,8,16).
    #[arg(long, value_name = "N,..", value_delimiter = ',', requires = "sweep",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    pub sweep_grids: Vec<u32>,
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

/// Moves `bar` (when there is one) on a tune or sweep event.
fn show_progress(bar: Option<&indicatif::ProgressBar>, ev: TuneEvent) {
    if let Some(b) = bar {
        match ev {
            TuneEvent::Planned { steps } => b.set_length(steps),
            TuneEvent::Step { what } => {
                b.set_message(what);
                b.inc(1);
            }
        }
    }
}

pub(super) fn run(args: &TuneArgs) -> Result<ExitCode, crate::Error> {
    let dep =
        deployment_by_name(&args.deployment).map_err(|e| crate::Error::Usage(e.to_string()))?;
    if args.sweep {
        return run_sweep(args, &dep);
    }
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
    let on_event = |ev: TuneEvent| show_progress(bar.as_ref(), ev);
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
    outln!("{:<44}  {:<22}  {}", "kernel", "candidate", RESULT_HEADER);
    for e in &entries {
        for r in &e.results {
            let mark = if r.choice == e.best { "best" } else { "" };
            outln!(
                "{:<44}  {:<22}  {}",
                e.spec_key,
                r.choice.to_string(),
                result_columns(r, mark)
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

/// `tune --sweep`: the table of [`tuning::sweep::sweep`]; exit status 1 when a candidate
/// computed wrong bytes (a kernel bug at that shape), as in `tune`.
fn run_sweep(args: &TuneArgs, dep: &crate::kernels::Deployment) -> Result<ExitCode, crate::Error> {
    let mut opts = SweepOptions::new(args.quick);
    args.sizes
        .apply(&mut opts.sizes, std::slice::from_ref(dep))?;
    if !args.sweep_threads.is_empty() {
        opts.threads = args.sweep_threads.clone();
    }
    if !args.sweep_grids.is_empty() {
        opts.grids = args.sweep_grids.clone();
    }
    let exec = open_executor(args.executor.backend)?;
    crate::tuning::measure::target_for(exec.as_ref())?;
    let jit = Jit::new(JitConfig::from_env()?);
    let bar = progress_bar(format!("sweeping {} on {}", dep.name, exec.backend()));
    let on_event = |ev: TuneEvent| show_progress(bar.as_ref(), ev);
    let swept = tuning::sweep::sweep(dep, exec.as_ref(), &jit, &opts, &on_event)?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    outln!("device: {}", swept.device);
    outln!("sizes: {}", opts.sizes.describe());
    outln!(
        "{:<44}  {:<16}  {:<26}  {}",
        "kernel",
        "buffers",
        "candidate",
        RESULT_HEADER
    );
    let mut wrong = 0;
    for r in &swept.rows {
        if r.result
            .dropped
            .as_deref()
            .is_some_and(tuning::tuner::is_wrong_output)
        {
            wrong += 1;
        }
        outln!(
            "{:<44}  {:<16}  {:<26}  {}",
            r.spec_key,
            r.buffers,
            r.candidate,
            result_columns(&r.result, "")
        );
    }
    Ok(if wrong == 0 {
        ExitCode::SUCCESS
    } else {
        eprintln!(
            "error: {wrong} sweep candidate(s) computed wrong bytes (kernel bugs at those shapes)"
        );
        ExitCode::FAILURE
    })
}

/// The measurement columns of a tune or sweep row (after kernel and candidate).
const RESULT_HEADER: &str = "        ms      GB/s     alone       hbm    alu-x    hbm-x  note";

/// A candidate's measurement columns under [`RESULT_HEADER`]: ms, GB/s (beside the ALU busy
/// kernel on a GPU), then [`BesideColumns`], then the note (`mark`, or why it was dropped,
/// and where the busy kernels ran).
fn result_columns(r: &tuning::CandidateResult, mark: &str) -> String {
    let c = BesideColumns::of(r);
    format!(
        "{:>10}  {:>8}  {:>8}  {:>8}  {:>7}  {:>7}  {}",
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
    )
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
            let resident = o
                .resident_lead_ns
                .map(|ns| format!(" resident {:+.1}us", ns as f64 / 1e3))
                .unwrap_or_default();
            format!(
                "{name} {:+.1}us {:.0}%{resident}",
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tuning::{BesideBusy, BesideCompanion, CandidateResult, LaunchChoice, Overlap};

    /// The note says where each busy kernel ran, and where the transfer's own stamps
    /// measured it (a kernel row's stamped twin) how long after the transfer's last block
    /// start the busy kernel began; where they did not (here the HBM one), nothing.
    #[test]
    fn the_note_gives_each_start_overlap_and_the_resident_lead_where_measured() {
        let overlap = |lag, lead| Overlap {
            start_lag_ns: lag,
            covered: 0.98,
            resident_lead_ns: lead,
        };
        let result = CandidateResult {
            choice: LaunchChoice::of_copy(&crate::kernels::CopyLaunch::gpu_transfer()),
            seconds: Some(1e-3),
            gbps: Some(40.0),
            dropped: None,
            beside_busy: Some(BesideBusy {
                alone_seconds: 0.5e-3,
                busy_slowdown: 1.01,
                alu_overlap: Some(overlap(3_200, Some(1_000))),
                hbm: Some(BesideCompanion {
                    seconds: 2e-3,
                    slowdown: 1.05,
                    overlap: overlap(-4_100, None),
                }),
            }),
        };
        let c = BesideColumns::of(&result);
        assert_eq!(
            c.overlap,
            "start, overlap: alu +3.2us 98% resident +1.0us, hbm -4.1us 98%"
        );
        assert_eq!((c.alone.as_str(), c.hbm.as_str()), ("80.00", "20.00"));
    }
}
