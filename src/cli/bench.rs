//! `cp-hicache bench`: transfer, materialise, select and release in the default and the tuned
//! configuration, each with a baseline measured in the same run; a table on stdout, optional
//! JSON rows and an SVG bar chart of the ratios. `--check` instead compares every kernel family
//! with the Rust references on random inputs (the GPU acceptance check), in every shape bench
//! times without a tuning file.

use std::path::PathBuf;
use std::process::ExitCode;

use super::common::{check_outputs, write_json, write_output, BackendArg, SizeArgs};
use super::tune::progress_bar;
use crate::exec::Backend;
use crate::jit::open_executor;
use crate::jit::{Jit, JitConfig};
use crate::kernels::{Family, KernelSpec};
use crate::tuning::bench::{
    self, default_deployments, deployment_by_name, BenchConfig, BenchFault, BenchOptions, BenchRow,
};
use crate::tuning::{check, DeviceKey, TuningFile};

/// Most pages one select/release launch may request: 4× the larger default (16,384), a
/// 4M-token prefill at page 64. The lane stacks, request and output buffers grow with it
/// (the output locations by 8 bytes × page size per page: 512 MiB at page 1024).
pub const MAX_ALLOC_PAGES: u32 = 65536;

/// Options of `bench`. `--layers` and `--repeats` keep bench's own wording.
#[derive(Debug, clap::Args)]
#[command(
    mut_arg("layers", |a| a.help("Layers per copy launch, 1-64")),
    mut_arg("repeats", |a| a.help("Timed repeats, 1-1000; the median is reported"))
)]
pub struct BenchArgs {
    /// `--backend`.
    #[command(flatten)]
    pub executor: BackendArg,
    /// One deployment (`<nsa|mla>_ps<N>_cp<C>`); default: mla_ps16 and nsa_ps64 at CP 1 and 8.
    #[arg(long, value_name = "NAME")]
    pub deployment: Option<String>,
    /// Also write the rows as a JSON array to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Tuning file for the tuned configuration (default: `<cache dir>/tuning.json` when it
    /// exists; otherwise the built-in CPU preset on the host).
    #[arg(long, value_name = "FILE")]
    pub tuning: Option<PathBuf>,
    /// Write an SVG bar chart of the ratios to FILE.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Smaller copies and fewer repeats.
    #[arg(long)]
    pub quick: bool,
    /// `--pages`, `--layers`, `--repeats`.
    #[command(flatten)]
    pub sizes: SizeArgs,
    /// Pages requested per select/release launch, 1-65536 (repeatable; default 2048 and
    /// 16384).
    #[arg(long = "alloc-pages", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=MAX_ALLOC_PAGES as i64))]
    pub alloc_pages: Vec<u32>,
    /// Also time the default configuration's transfers on the DMA path (config `dma`: copy
    /// regions, i.e. batched cuMemcpyAsync on a GPU, memcpy on the host). Always on with CUDA.
    #[arg(long)]
    pub dma: bool,
    /// Instead of timing, run every kernel family on random inputs and compare with the Rust
    /// references (exit status 1 on any difference). It times nothing, so the timing and
    /// output options are refused with it rather than ignored.
    #[arg(long, conflicts_with_all = [
        "json", "plot", "tuning", "quick", "dma", "alloc_pages", "pages", "layers", "repeats",
    ])]
    pub check: bool,
    /// With --check, check only the kernels of FAMILY (repeatable): select_owner_pages,
    /// release_pages, transfer_pages, materialise, synthesise or verify. For a sanitizer
    /// tool that is slow on the others (scripts/gpu-check.sh runs racecheck and synccheck on
    /// the allocator kernels).
    #[arg(long = "family", value_name = "FAMILY", requires = "check", value_parser = parse_family)]
    pub families: Vec<Family>,
    /// Inject a fault to exercise a failure path: compile-error (the first kernel's source is
    /// broken) or launch-error (the first launch fails). The failing kernel is reported, the
    /// others are still measured, and the exit status is 1.
    #[arg(long, value_name = "FAULT", value_parser = parse_bench_fault)]
    pub inject: Option<BenchFault>,
    /// Compile (NVRTC, sm_90) every kernel `bench`, `bench --check` and `tune --quick` load on
    /// a GPU into the JIT cache, without running anything: prepares a cache for a GPU machine
    /// without NVRTC (`CP_HICACHE_JIT=off`). Only `--deployment` applies; the executor,
    /// timing, check and output options are refused with it rather than ignored.
    #[arg(long, conflicts_with_all = [
        "backend", "check", "inject", "json", "plot", "tuning", "quick", "dma", "alloc_pages",
        "pages", "layers", "repeats",
    ])]
    pub prebuild: bool,
    /// Instead of the kernels, time the page store (the storage tier) in a scratch folder
    /// under DIR (made and removed): `--pages` records of every layer (`--layers`) of each
    /// deployment, put into and got from the store, against plain file writes and reads of
    /// the same bytes in the same run. Put DIR on the file system the store will use.
    #[arg(long, value_name = "DIR", conflicts_with_all = [
        "check", "prebuild", "inject", "tuning", "dma", "alloc_pages",
    ])]
    pub storage: Option<PathBuf>,
}

pub(super) fn run(args: &BenchArgs) -> Result<ExitCode, crate::Error> {
    let deps = match &args.deployment {
        Some(name) => {
            vec![deployment_by_name(name).map_err(|e| crate::Error::Usage(e.to_string()))?]
        }
        None => default_deployments()?,
    };
    check_outputs(
        &[
            ("--json", args.json.as_deref()),
            ("--plot", args.plot.as_deref()),
        ],
        &[("--tuning", args.tuning.as_deref())],
    )?;
    let mut opts = BenchOptions::new(args.quick);
    args.sizes.apply(&mut opts.sizes, &deps)?;
    if !args.alloc_pages.is_empty() {
        opts.alloc_pages = args.alloc_pages.clone();
    }
    if let Some(dir) = &args.storage {
        return bench_storage(args, dir, &deps, &opts);
    }
    let jit = Jit::new(JitConfig::from_env()?);
    if args.prebuild {
        return prebuild(&jit, &deps);
    }
    // A bad --tuning file stops the run before anything is timed (exit status 2).
    let (file, unreadable) = if args.check {
        (None, Vec::new())
    } else {
        TuningFile::load_selected(args.tuning.as_deref(), &crate::tuning::default_path())?
    };
    for w in crate::tuning::warning_lines(&unreadable) {
        eprintln!("warning: {w}");
    }
    let exec = open_executor(args.executor.backend)?;
    // A target no kernel can be built for here (an ASan build without the runtime, a GPU no
    // architecture runs) is one error up front, not one per kernel.
    crate::tuning::measure::target_for(exec.as_ref())?;
    if args.check {
        return run_check(exec.as_ref(), &jit, &deps, args.inject, &args.families);
    }
    let device = DeviceKey::for_executor(exec.as_ref(), &jit)?;
    let mut configs = Vec::new();
    for dep in &deps {
        let (tuned, source, warnings) = bench::tuned_config(dep, file.as_ref(), &device);
        for w in crate::tuning::warning_lines(&warnings) {
            eprintln!("warning: {w}");
        }
        configs.push(BenchConfig {
            name: "default".to_string(),
            shapes: "default",
            deployment: dep.clone(),
        });
        if tuned != *dep {
            eprintln!(
                "{}: tuned configuration from {source}: copy {}, transfer kernels {}, alloc_threads {}, transfers by {}",
                dep.name, tuned.copy, tuned.transfer_copy, tuned.alloc_threads, tuned.transfer_path
            );
            configs.push(BenchConfig {
                name: "tuned".to_string(),
                shapes: source,
                deployment: tuned,
            });
        }
    }
    opts.dma_rows = args.dma || exec.backend() == Backend::Cuda;
    let bar = progress_bar(format!("bench on {}", exec.backend()));
    let on_step = |s: Result<String, u64>| {
        if let Some(b) = &bar {
            match s {
                Err(total) => b.set_length(total),
                Ok(what) => {
                    b.set_message(what);
                    b.inc(1);
                }
            }
        }
    };
    opts.inject = args.inject;
    let outcome = bench::run(exec.as_ref(), &jit, &configs, &opts, &on_step)?;
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    let rows = outcome.rows;
    outln!("device: {device}");
    outln!("sizes: {}", opts.sizes.describe());
    print_table(&rows)?;
    for f in &outcome.failures {
        eprintln!(
            "error: {} {} {}: {}",
            f.deployment, f.config, f.kernel, f.error
        );
    }
    if let Some(path) = &args.json {
        write_json(path, &rows)?;
    }
    if let Some(path) = &args.plot {
        write_output(path, &svg_chart(&rows))?;
    }
    Ok(if outcome.failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        eprintln!("bench: {} kernel(s) failed", outcome.failures.len());
        ExitCode::FAILURE
    })
}

/// `bench --storage DIR`: the store against plain files, per deployment (the CP degree
/// does not change a record, so each shape is timed once).
fn bench_storage(
    args: &BenchArgs,
    dir: &std::path::Path,
    deps: &[crate::kernels::Deployment],
    opts: &BenchOptions,
) -> Result<ExitCode, crate::Error> {
    let scratch = dir.join(format!("cp-hicache-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).map_err(|e| {
        crate::Error::Usage(format!(
            "--storage {}: cannot make a scratch folder there: {e}",
            dir.display()
        ))
    })?;
    let result = bench_storage_in(&scratch, deps, opts);
    let _ = std::fs::remove_dir_all(&scratch);
    let rows = result?;
    outln!(
        "store: {} ({} records of {} layers, median of {})",
        dir.display(),
        opts.sizes.pages,
        opts.sizes.layers,
        opts.sizes.repeats
    );
    print_table(&rows)?;
    if let Some(path) = &args.json {
        write_json(path, &rows)?;
    }
    if let Some(path) = &args.plot {
        write_output(path, &svg_chart(&rows))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// The rows of [`bench_storage`], timed in `scratch`.
fn bench_storage_in(
    scratch: &std::path::Path,
    deps: &[crate::kernels::Deployment],
    opts: &BenchOptions,
) -> Result<Vec<BenchRow>, crate::Error> {
    let mut shapes: Vec<&crate::kernels::Deployment> = Vec::new();
    for dep in deps {
        if !shapes
            .iter()
            .any(|d| d.model == dep.model && d.page_size == dep.page_size)
        {
            shapes.push(dep);
        }
    }
    let sizes = &opts.sizes;
    let bar = progress_bar(format!("bench --storage {}", scratch.display()));
    if let Some(b) = &bar {
        b.set_length((shapes.len() * sizes.repeats as usize) as u64);
    }
    let mut rows = Vec::new();
    for dep in shapes {
        rows.extend(
            crate::storage::bench_store(
                scratch,
                dep,
                sizes.layers,
                sizes.pages as usize,
                sizes.repeats as usize,
                &|| {
                    if let Some(b) = &bar {
                        b.inc(1);
                    }
                },
            )
            .map_err(crate::cluster::ClusterError::from)?,
        );
    }
    if let Some(b) = &bar {
        b.finish_and_clear();
    }
    Ok(rows)
}

fn parse_bench_fault(s: &str) -> Result<BenchFault, String> {
    s.parse()
}

fn prebuild(jit: &Jit, deps: &[crate::kernels::Deployment]) -> Result<ExitCode, crate::Error> {
    let target = crate::jit::Target::Nvrtc {
        arch: crate::jit::Arch::default(),
    };
    let mut requests = Vec::new();
    for spec in bench::prebuild_specs(deps) {
        requests.push(crate::jit::JitRequest {
            uri: spec.uri(),
            source: spec.render()?,
            target,
        });
    }
    let results = jit.warm_up(&requests);
    // No NVRTC fails every kernel alike: one line, as from `compile`, not one per kernel.
    if let Some(code) = super::compile::compiler_missing(jit, &results, target) {
        return Ok(code);
    }
    let mut failed = 0;
    for (req, r) in requests.iter().zip(&results) {
        if let Err(e) = r {
            failed += 1;
            eprintln!("error: {}: {e}", req.uri);
        }
    }
    outln!(
        "prebuilt {} of {} kernels for {target} into {}",
        results.len() - failed,
        results.len(),
        jit.cache().root().display()
    );
    Ok(if failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn run_check(
    exec: &dyn crate::exec::Executor,
    jit: &Jit,
    deps: &[crate::kernels::Deployment],
    inject: Option<BenchFault>,
    families: &[Family],
) -> Result<ExitCode, crate::Error> {
    // compile-error breaks the first kernel of the first deployment; launch-error fails the
    // first launch. Either shows as a FAIL row; the other kernels are still checked.
    let edit = BenchFault::break_first(deps.first().and_then(|d| d.specs().first().copied()));
    let hook: Option<crate::jit::SourceHook<'_>> =
        (inject == Some(BenchFault::CompileError)).then_some(&edit);
    if inject == Some(BenchFault::LaunchError) {
        exec.inject_launch_failure();
    }
    let mut bad = 0;
    // A detail (a compiler's output) can span lines: the table shows its first line, the full
    // text follows the table, so every row stays one line.
    let mut details = Vec::new();
    outln!(
        "{:<16}  {:<56}  {:<6}  detail",
        "deployment",
        "kernel",
        "result"
    );
    // Besides the defaults, the shapes `bench` times as tuned when there is no tuning file
    // (the CPU preset): every shape bench reports a speed for is checked somewhere (a tuning
    // file's winners were checked by `tune` before they were timed). And the default copy
    // shape with streaming stores, which `tune --quick` weighs on a GPU: so a memcheck of
    // the check (scripts/gpu-check.sh) runs `__stcs` kernels too.
    let device = DeviceKey::for_executor(exec, jit)?;
    for dep in deps {
        let (preset, _, _) = bench::tuned_config(dep, None, &device);
        let defaults = dep.specs();
        let mut extra: Vec<KernelSpec> = Vec::new();
        let streaming = bench::with_streaming_stores(dep);
        for s in preset.specs().into_iter().chain(streaming.specs()) {
            if !defaults.contains(&s) && !extra.contains(&s) {
                extra.push(s);
            }
        }
        // SAFETY: the only hook is the compile-error fault, which makes a source fail to
        // compile; nothing it touches is launched.
        let rows = if families.is_empty() {
            let mut rows = unsafe { check::check_deployment_with(exec, jit, dep, hook) }?;
            rows.extend(unsafe { check::check_specs_with(exec, jit, &extra, hook) }?);
            rows
        } else {
            // The families asked for, without the DMA rows (no family's kernel).
            let chosen: Vec<KernelSpec> = defaults
                .iter()
                .chain(&extra)
                .copied()
                .filter(|s| families.contains(&s.family()))
                .collect();
            // SAFETY: as above.
            unsafe { check::check_specs_with(exec, jit, &chosen, hook) }?
        };
        for r in rows {
            bad += usize::from(!r.ok);
            let mut lines = r.detail.lines();
            let first = lines.next().unwrap_or("");
            let more = lines.next().is_some();
            outln!(
                "{:<16}  {:<56}  {:<6}  {first}{}",
                dep.name,
                r.kernel,
                if r.ok { "ok" } else { "FAIL" },
                if more { " …" } else { "" }
            );
            if more {
                details.push((r.kernel, r.detail));
            }
        }
    }
    for (kernel, detail) in &details {
        outln!("\n{kernel}:\n{}", detail.trim_end());
    }
    exec.disarm_launch_failure();
    outln!(
        "check on {}: {bad} {}",
        exec.backend(),
        if bad == 1 { "failure" } else { "failures" }
    );
    Ok(if bad == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

fn print_table(rows: &[BenchRow]) -> Result<(), crate::Error> {
    let w = rows
        .iter()
        .map(|r| r.kernel.len())
        .max()
        .unwrap_or(6)
        .max(6);
    // DMA rows say how long the host took to submit their copies too.
    let submits = rows.iter().any(|r| r.submit_seconds.is_some());
    outln!(
        "{:<13}  {:<7}  {:<w$}  {:>10}  {:>9}  {:>8}  {:>8}  {:>6}  baseline{}",
        "deployment",
        "config",
        "kernel",
        "bytes",
        "ms",
        "GB/s",
        "base",
        "ratio",
        if submits { "  submit ms" } else { "" }
    );
    for r in rows {
        let submit = match (submits, r.submit_seconds) {
            (true, Some(s)) => format!("  {:.3}", s * 1e3),
            (true, None) => "  -".into(),
            (false, _) => String::new(),
        };
        outln!(
            "{:<13}  {:<7}  {:<w$}  {:>10}  {:>9.3}  {:>8.2}  {:>8.2}  {:>6.2}  {}{}",
            r.deployment,
            r.config,
            r.kernel,
            r.bytes,
            r.seconds * 1e3,
            r.gbps,
            r.baseline_gbps,
            r.ratio,
            r.baseline,
            submit
        );
    }
    Ok(())
}

/// A horizontal bar chart of the ratios, written as plain SVG (no font files needed: text
/// is SVG `<text>` rendered by the viewer).
fn svg_chart(rows: &[BenchRow]) -> String {
    let bar_h = 18.0;
    let label_w = 560.0;
    let plot_w = 400.0;
    let max = rows.iter().map(|r| r.ratio).fold(1.0f64, f64::max);
    let height = 40.0 + bar_h * rows.len() as f64 + 20.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{height}\" font-family=\"monospace\" font-size=\"11\">\n\
         <text x=\"4\" y=\"16\">cp-hicache bench: kernel / baseline (ratio; 1.0 = dashed line)</text>\n",
        label_w + plot_w + 60.0
    );
    let x1 = label_w + plot_w / max;
    s.push_str(&format!(
        "<line x1=\"{x1}\" y1=\"28\" x2=\"{x1}\" y2=\"{}\" stroke=\"black\" stroke-dasharray=\"4\"/>\n",
        height - 10.0
    ));
    for (i, r) in rows.iter().enumerate() {
        let y = 30.0 + bar_h * i as f64;
        let w = (r.ratio / max * plot_w).max(1.0);
        let color = if r.config == "tuned" { "#2a7" } else { "#57a" };
        let label = format!("{} {} {}", r.deployment, r.config, r.kernel)
            .replace('&', "&amp;")
            .replace('<', "&lt;");
        s.push_str(&format!(
            "<text x=\"4\" y=\"{}\">{label}</text>\n<rect x=\"{label_w}\" y=\"{}\" width=\"{w:.1}\" height=\"{}\" fill=\"{color}\"/>\n<text x=\"{:.1}\" y=\"{}\">{:.2}</text>\n",
            y + 13.0,
            y + 3.0,
            bar_h - 4.0,
            label_w + w + 4.0,
            y + 13.0,
            r.ratio
        ));
    }
    s.push_str("</svg>\n");
    s
}

/// A kernel family by its name (the names kernel uris start with); `busy` is no deployment's
/// kernel, so it is not one to check.
fn parse_family(s: &str) -> Result<Family, String> {
    const CHECKED: [Family; 6] = [
        Family::SelectOwnerPages,
        Family::ReleasePages,
        Family::TransferPages,
        Family::Materialise,
        Family::Synthesise,
        Family::Verify,
    ];
    CHECKED
        .into_iter()
        .find(|f| f.to_string() == s)
        .ok_or_else(|| {
            let names: Vec<String> = CHECKED.iter().map(Family::to_string).collect();
            format!("unknown kernel family {s:?}; one of {}", names.join(", "))
        })
}
