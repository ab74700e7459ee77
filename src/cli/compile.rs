//! `cp-hicache compile`: compiles every kernel of one or all reference deployments through the
//! JIT (in parallel, through the disk cache) and prints a resource table. It is the NVRTC matrix
//! a CI runs: any compile error, register spill or stack frame fails it.

use super::common::{check_outputs, write_json};
use super::render::select_deployments;
use crate::jit::{
    deployment_requests, nvrtc::unavailable_hint, Arch, CompiledKernel, Jit, JitConfig, JitError,
    JitMode, JitRequest, Sanitize, Target,
};
use crate::kernels::{Deployment, KernelSpec};
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

/// The deployment `compile` builds when none is named.
pub const DEFAULT_DEPLOYMENT: &str = "nsa_ps64_cp8";

/// `--arch` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ArchArg {
    /// Ampere.
    #[value(name = "sm_80")]
    Sm80,
    /// Hopper.
    #[default]
    #[value(name = "sm_90")]
    Sm90,
    /// Blackwell.
    #[value(name = "sm_100")]
    Sm100,
}

impl From<ArchArg> for Arch {
    fn from(a: ArchArg) -> Arch {
        match a {
            ArchArg::Sm80 => Arch::Sm80,
            ArchArg::Sm90 => Arch::Sm90,
            ArchArg::Sm100 => Arch::Sm100,
        }
    }
}

/// `--target` values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TargetArg {
    /// A CUBIN through NVRTC, for `--arch`.
    #[default]
    Nvrtc,
    /// A shared library through the host C++ compiler and the CUDA emulation header.
    Host,
}

/// Options of `compile`.
#[derive(Debug, clap::Args)]
pub struct CompileArgs {
    /// Print the reference deployment names, one per line, and exit (compiles nothing, so
    /// the other options are refused with it rather than ignored).
    #[arg(long, conflicts_with_all = ["deployment", "arch", "target", "json"])]
    pub list_deployments: bool,
    /// A reference deployment name, or `all`.
    #[arg(long, value_name = "NAME|all", default_value = DEFAULT_DEPLOYMENT)]
    pub deployment: String,
    /// GPU architecture of the NVRTC target (default sm_90). Refused with `--target host`,
    /// which builds for this CPU, rather than ignored.
    #[arg(long, value_enum)]
    pub arch: Option<ArchArg>,
    /// Compiler: NVRTC (CUBIN) or the host C++ compiler (CPU emulation `.so`).
    #[arg(long, value_enum, default_value_t = TargetArg::Nvrtc)]
    pub target: TargetArg,
    /// Also write one JSON row per kernel to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// One row of the table and of `--json`.
#[derive(Debug, Serialize)]
struct Row {
    kernel: String,
    spec: String,
    deployments: Vec<String>,
    arch: String,
    registers: Option<u32>,
    spill_bytes: Option<u32>,
    stack_bytes: Option<u32>,
    shared_bytes: Option<u32>,
    compile_ms: Option<f64>,
    cache_hit: Option<bool>,
    error: Option<String>,
}

/// One unique kernel across the selected deployments.
struct Item {
    spec: KernelSpec,
    deployments: Vec<String>,
    request: JitRequest,
}

fn collect(deps: &[Deployment], target: Target) -> Result<Vec<Item>, crate::Error> {
    let mut items: Vec<Item> = Vec::new();
    for dep in deps {
        for (spec, request) in deployment_requests(dep, target)? {
            match items.iter_mut().find(|i| i.request.uri == request.uri) {
                Some(i) => i.deployments.push(dep.name.clone()),
                None => items.push(Item {
                    spec,
                    deployments: vec![dep.name.clone()],
                    request,
                }),
            }
        }
    }
    Ok(items)
}

pub(super) fn run(args: &CompileArgs) -> Result<ExitCode, crate::Error> {
    if args.list_deployments {
        for d in Deployment::reference() {
            outln!("{}", d.name);
        }
        return Ok(ExitCode::SUCCESS);
    }
    check_outputs(&[("--json", args.json.as_deref())], &[])?;
    let deps = select_deployments(&args.deployment)?;
    let target = match (args.target, args.arch) {
        (TargetArg::Nvrtc, arch) => Target::Nvrtc {
            arch: arch.unwrap_or_default().into(),
        },
        (TargetArg::Host, None) => Target::Host {
            sanitize: Sanitize::from_env()?,
        },
        (TargetArg::Host, Some(_)) => {
            return Err(crate::Error::Usage(
                "--arch chooses the GPU architecture of the NVRTC target; --target host \
                 compiles for this CPU: drop --arch or use --target nvrtc"
                    .into(),
            ))
        }
    };
    let start = Instant::now();
    let jit = Jit::new(JitConfig::from_env()?);
    let items = collect(&deps, target)?;
    let results = warm_up(&jit, &items, target);
    let wall_ms = start.elapsed().as_secs_f64() * 1e3;

    if let Some(code) = compiler_missing(&jit, &results, target) {
        return Ok(code);
    }

    let rows: Vec<Row> = items
        .iter()
        .zip(&results)
        .map(|(item, r)| row(item, target, r))
        .collect();
    print_table(&rows)?;
    let hits = results
        .iter()
        .filter(|r| matches!(r, Ok(k) if k.cache_hit.is_hit()))
        .count();
    let misses = results
        .iter()
        .filter(|r| matches!(r, Ok(k) if !k.cache_hit.is_hit()))
        .count();
    let failed = results.iter().filter(|r| r.is_err()).count();
    outln!(
        "total: {} kernels for {target} in {wall_ms:.1} ms wall ({}), {hits} cache hits, {misses} misses, {failed} failed",
        rows.len(),
        if misses == 0 && failed == 0 { "warm" } else { "cold" },
    );

    if let Some(path) = &args.json {
        write_json(path, &rows)?;
    }

    let mut bad = false;
    for (item, r) in items.iter().zip(&results) {
        match r {
            Err(e) => {
                bad = true;
                eprintln!("error: {} failed: {e}", item.request.uri);
            }
            Ok(k) => {
                if let Some(rep) = &k.report {
                    if rep.spill_bytes > 0 {
                        bad = true;
                        eprintln!(
                            "error: {} spills {} bytes of registers",
                            k.uri, rep.spill_bytes
                        );
                    }
                    if rep.stack_bytes > 0 {
                        bad = true;
                        eprintln!(
                            "error: {} has a {}-byte stack frame",
                            k.uri, rep.stack_bytes
                        );
                    }
                }
            }
        }
    }
    Ok(if bad {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

/// Runs the JIT warm-up over every item, with a progress bar when stderr is a terminal.
fn warm_up(jit: &Jit, items: &[Item], target: Target) -> Vec<Result<CompiledKernel, JitError>> {
    let requests: Vec<JitRequest> = items.iter().map(|i| i.request.clone()).collect();
    if !std::io::stderr().is_terminal() {
        return jit.warm_up(&requests);
    }
    let bar = indicatif::ProgressBar::new(requests.len() as u64);
    if let Ok(style) =
        indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {elapsed}")
    {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(format!("compiling for {target}"));
    let results = jit.warm_up_with(&requests, |_| bar.inc(1));
    bar.finish_and_clear();
    results
}

/// When the compiler itself is missing (and JIT-off prebuilt lookup did not serve everything),
/// prints one line with the install hint and returns exit status 1.
pub(super) fn compiler_missing(
    jit: &Jit,
    results: &[Result<CompiledKernel, JitError>],
    target: Target,
) -> Option<ExitCode> {
    let missing = results
        .iter()
        .find_map(|r| r.as_ref().err().filter(|e| e.is_unavailable()))?;
    match (target, missing) {
        (
            Target::Nvrtc { .. },
            JitError::NvrtcUnavailable {
                searched,
                requested,
            },
        ) => {
            tracing::debug!(target: "cp_hicache::jit", searched = ?searched, "NVRTC search");
            let off = if jit.config().mode == JitMode::Off {
                " (CP_HICACHE_JIT=off and no prebuilt entry matched)"
            } else {
                ""
            };
            eprintln!(
                "error: {}{off}; searched {} places (RUST_LOG=cp_hicache=debug lists them)",
                unavailable_hint(requested.as_deref()),
                searched.len()
            );
        }
        (_, e) => eprintln!("error: {e}"),
    }
    Some(ExitCode::FAILURE)
}

fn row(item: &Item, target: Target, r: &Result<CompiledKernel, JitError>) -> Row {
    let mut row = Row {
        kernel: item.request.uri.clone(),
        spec: item.spec.family().to_string(),
        deployments: item.deployments.clone(),
        arch: target.to_string(),
        registers: None,
        spill_bytes: None,
        stack_bytes: None,
        shared_bytes: None,
        compile_ms: None,
        cache_hit: None,
        error: None,
    };
    match r {
        Ok(k) => {
            if let Some(rep) = &k.report {
                row.registers = Some(rep.registers);
                row.spill_bytes = Some(rep.spill_bytes);
                row.stack_bytes = Some(rep.stack_bytes);
                row.shared_bytes = Some(rep.shared_bytes);
            }
            row.compile_ms = Some(k.compile_ms);
            row.cache_hit = Some(k.cache_hit.is_hit());
        }
        Err(e) => row.error = Some(e.to_string()),
    }
    row
}

fn print_table(rows: &[Row]) -> Result<(), crate::Error> {
    let width = rows
        .iter()
        .map(|r| r.kernel.len())
        .max()
        .unwrap_or(6)
        .max(6);
    let opt = |v: Option<u32>| v.map_or_else(|| "-".to_string(), |v| v.to_string());
    outln!(
        "{:<width$}  {:<18}  {:<6}  {:>4}  {:>5}  {:>5}  {:>6}  {:>9}  cache",
        "kernel",
        "family",
        "arch",
        "regs",
        "spill",
        "stack",
        "shared",
        "ms"
    );
    for r in rows {
        let cache = match (r.cache_hit, &r.error) {
            (_, Some(_)) => "FAILED",
            (Some(true), _) => "hit",
            _ => "miss",
        };
        outln!(
            "{:<width$}  {:<18}  {:<6}  {:>4}  {:>5}  {:>5}  {:>6}  {:>9}  {cache}",
            r.kernel,
            r.spec,
            r.arch,
            opt(r.registers),
            opt(r.spill_bytes),
            opt(r.stack_bytes),
            opt(r.shared_bytes),
            r.compile_ms
                .map_or_else(|| "-".to_string(), |m| format!("{m:.2}")),
        );
    }
    Ok(())
}
