//! `bench`: transfer, materialise, select and release of several deployments, each against a
//! baseline measured in the same run, in the default (GPU-shaped) and the tuned configuration.
//!
//! Baselines: one copy of the same bytes between the same memory kinds through
//! `Executor::copy_regions`, a single-threaded `memcpy` on the host executor (launches run on
//! the calling thread) and a pinned `cuMemcpyAsync` on CUDA (pinned host ↔ device for
//! transfers, device ↔ device for materialise). Select and release are compared with the Rust
//! reference allocator on the same requests. Copies use scattered page ids (random pool
//! slots, as in a cache after churn): the kernels do not care, and for the DMA path it is the
//! pessimistic case (no two pages merge into one copy); fresh pools give it longer runs.

use serde::{Deserialize, Serialize};

use super::candidate::{host_copy_preset, LaunchChoice, HOST_ALLOC_THREADS_PRESET};
use super::file::TuningFile;
use super::key::{spec_key, DeviceKey};
use super::measure::{
    baseline_name, compile_and_load, time_copy_baseline, AllocBench, CopyBench, Sizes,
};
use super::TuningError;
use crate::exec::{Backend, DmaMode, Executor, KernelId, MemKind};
use crate::jit::Jit;
use crate::kernels::{Deployment, Direction, KernelError, KernelSpec, ModelShape, SelectOutput};

/// One measurement, as printed and written by `bench --json`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BenchRow {
    /// Kernel uri (the launch shape is part of it).
    pub kernel: String,
    /// Shape-independent spec key.
    pub spec: String,
    /// `host` or `cuda`.
    pub backend: String,
    /// `default` (GPU-shaped), `tuned`, or `dma` (the default configuration's transfers on
    /// the DMA path; `kernel` then reads `dma(<uri>)`). A configuration whose transfers take
    /// the DMA path (a tuning file chose it) names its transfer rows `dma(<uri>)` or
    /// `dma-each(<uri>)` (one copy call per merged region).
    pub config: String,
    /// Where the launch shapes came from: `default` (the deployment's), `file` (a tuning
    /// file measured on this device) or `preset` (the built-in CPU shapes, which `tuned`
    /// means on the host executor when no tuning file has any for it). Absent in reports
    /// written before it existed.
    #[serde(default)]
    pub shapes: String,
    /// Deployment name.
    pub deployment: String,
    /// Bytes one launch moves (for select/release: 4 bytes per requested page).
    pub bytes: u64,
    /// Median seconds per launch.
    pub seconds: f64,
    /// `bytes / seconds` in GB/s.
    pub gbps: f64,
    /// What the baseline is (`memcpy`, `cuMemcpyAsync`, `rust_reference`).
    pub baseline: String,
    /// Baseline throughput on the same bytes, in GB/s.
    pub baseline_gbps: f64,
    /// `gbps / baseline_gbps`: above 1 the kernel beats the baseline.
    pub ratio: f64,
    /// DMA rows: median host seconds the submission took (the copy calls, as the host clock
    /// sees them). A batch of many small copies can keep the host busier than the copy
    /// engines: `seconds` is the device's time only. Absent for kernels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub submit_seconds: Option<f64>,
}

/// What `bench` measures.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Copy workload sizes and repeats.
    pub sizes: Sizes,
    /// Requests per select/release launch (one row each).
    pub alloc_pages: Vec<u32>,
    /// Also time both transfers of every default configuration on the DMA path (config
    /// `dma`): the copy-engine alternative tuning weighs on a GPU.
    pub dma_rows: bool,
    /// A fault to provoke (`bench --inject`).
    pub inject: Option<BenchFault>,
}

impl BenchOptions {
    /// Full (256 pages × 4 layers) or quick sizes; select/release at 2,048 and 16,384 pages.
    pub fn new(quick: bool) -> BenchOptions {
        BenchOptions {
            sizes: if quick { Sizes::quick() } else { Sizes::full() },
            alloc_pages: vec![2048, 16384],
            dma_rows: false,
            inject: None,
        }
    }
}

/// The deployments `bench` runs by default: page 16 with MLA and page 64 with NSA, at CP 1
/// and 8.
pub fn default_deployments() -> Result<Vec<Deployment>, KernelError> {
    [
        (ModelShape::MlaBf16, 16, 1),
        (ModelShape::MlaBf16, 16, 8),
        (ModelShape::Nsa, 64, 1),
        (ModelShape::Nsa, 64, 8),
    ]
    .into_iter()
    .map(|(m, ps, cp)| Deployment::new(m, ps, cp))
    .collect()
}

/// A deployment by name: a reference name, or any `<nsa|mla|gqa<H>x<D>>_ps<N>_cp<C>[_ti<I>]` (`_ti<I>`:
/// token-interleaved `I` tokens at a time, the only layout whose kernels differ).
pub fn deployment_by_name(name: &str) -> Result<Deployment, KernelError> {
    if let Ok(d) = Deployment::by_name(name) {
        return Ok(d);
    }
    let parsed = (|| {
        let mut it = name.split('_');
        let model: ModelShape = it.next()?.parse().ok()?;
        let ps = it.next()?.strip_prefix("ps")?.parse().ok()?;
        let cp = it.next()?.strip_prefix("cp")?.parse().ok()?;
        let run = match it.next() {
            None => None,
            Some(ti) => Some(ti.strip_prefix("ti")?.parse().ok()?),
        };
        it.next().is_none().then_some((model, ps, cp, run))
    })();
    match parsed {
        Some((m, ps, cp, None)) => Deployment::new(m, ps, cp),
        Some((m, ps, cp, Some(size))) => {
            Deployment::new(m, ps, cp)?.with_layout(crate::layout::Layout::TokenInterleave { size })
        }
        None => Deployment::by_name(name),
    }
}

/// The tuned configuration of `dep`: the tuning file's choices for `device` when it has any,
/// else (on the host executor) the CPU-friendly preset, else the default. Returns the
/// deployment and where its shapes came from (`file`, `preset`, `default`), plus the warnings
/// of ignored entries.
pub fn tuned_config(
    dep: &Deployment,
    file: Option<&TuningFile>,
    device: &DeviceKey,
) -> (Deployment, &'static str, Vec<super::TuningWarning>) {
    if let Some(f) = file {
        let (d, warnings, applied) = dep.with_tuning(f, device);
        if applied != super::Applied::default() {
            return (d, "file", warnings);
        }
        if device.backend != Backend::Host.to_string() {
            return (d, "default", warnings);
        }
        return (host_preset(dep), "preset", warnings);
    }
    if device.backend == Backend::Host.to_string() {
        (host_preset(dep), "preset", Vec::new())
    } else {
        (dep.clone(), "default", Vec::new())
    }
}

fn host_preset(dep: &Deployment) -> Deployment {
    let mut d = dep.clone();
    d.copy = host_copy_preset();
    d.transfer_copy = host_copy_preset();
    d.alloc_threads = HOST_ALLOC_THREADS_PRESET;
    if d.validate().is_ok() {
        d
    } else {
        dep.clone()
    }
}

/// A configuration `bench` times: its name in the rows, where its shapes came from
/// ([`BenchRow::shapes`]) and the deployment with those shapes.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// `default` or `tuned`.
    pub name: String,
    /// `default`, `file` or `preset` ([`tuned_config`]'s second value).
    pub shapes: &'static str,
    /// The deployment, shapes applied.
    pub deployment: Deployment,
}

/// One timed kernel of the plan.
struct Job {
    config: String,
    shapes: &'static str,
    deployment: String,
    spec: KernelSpec,
    alloc_pages: u32,
    /// A transfer timed on the DMA path instead of its kernel, issued this way.
    dma: Option<DmaMode>,
    /// With `dma`: the staged path (contiguous runs by DMA to a device staging buffer, the
    /// kernel between it and the device pools: [`CopyBench::copy_staged`]).
    staged: bool,
}

/// The kernels `bench` times for one configured deployment: transfer both ways (by kernel or
/// DMA, as the deployment says) and materialise of the first buffer, select and release at
/// each allocator size; with `opts.dma_rows`, the default configuration's transfers once more
/// on the DMA path.
fn jobs(c: &BenchConfig, opts: &BenchOptions) -> Vec<Job> {
    let (config, dep) = (c.name.as_str(), &c.deployment);
    let b = dep.model.buffers()[0];
    let job = |config: &str, spec, alloc_pages, dma: Option<DmaMode>| Job {
        config: config.to_string(),
        // The DMA rows run the default configuration's transfers.
        shapes: if dma.is_some() && config == "dma" {
            "default"
        } else {
            c.shapes
        },
        deployment: dep.name.clone(),
        spec,
        alloc_pages,
        dma,
        staged: false,
    };
    let dma = dep.transfer_path.dma_mode();
    let transfers =
        [Direction::HostToDevice, Direction::DeviceToHost].map(|d| dep.transfer_spec(d));
    let mut out: Vec<Job> = transfers.iter().map(|&t| job(config, t, 0, dma)).collect();
    out.push(job(config, dep.materialise_spec(b), 0, None));
    // The select the cache's allocator runs: pages only, its consumers derive the slots.
    for &n in &opts.alloc_pages {
        out.push(job(config, dep.select_spec(SelectOutput::Pages), n, None));
        out.push(job(config, dep.release_spec(), n, None));
    }
    if opts.dma_rows && config == "default" && dma.is_none() {
        // Both ways of issuing the direct copies, and the staged path.
        for t in transfers {
            out.push(job("dma", t, 0, Some(DmaMode::Batched)));
            out.push(job("dma", t, 0, Some(DmaMode::PerRegion)));
            out.push(Job {
                staged: true,
                ..job("dma", t, 0, Some(DmaMode::Batched))
            });
        }
    }
    out
}

/// A fault `bench --inject` exercises. The other faults of `replay --inject` break the cache
/// (its allocator, pools or load path), which `bench` does not run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BenchFault {
    /// The first kernel's source is broken before compiling: its rows fail, the rest run.
    CompileError,
    /// The first kernel launch fails: that row fails, the rest run.
    LaunchError,
}

impl std::str::FromStr for BenchFault {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.parse::<crate::cluster::Fault>()? {
            crate::cluster::Fault::CompileError => Ok(BenchFault::CompileError),
            crate::cluster::Fault::LaunchError => Ok(BenchFault::LaunchError),
            other => Err(format!(
                "`{other}` is a cache fault: inject it into `replay`; bench takes \
                 compile-error or launch-error"
            )),
        }
    }
}

impl BenchFault {
    /// The source edit of `compile-error`: `first` (the first kernel a run compiles) no longer
    /// compiles; every other source is left as it is.
    pub fn break_first(first: Option<KernelSpec>) -> impl Fn(&KernelSpec, String) -> String + Sync {
        move |spec, src| {
            if Some(*spec) == first {
                crate::jit::break_source(src)
            } else {
                src
            }
        }
    }
}

/// Bytes of the link-ceiling rows on CUDA (`config` `link`): one pinned copy this large
/// each way.
pub const LINK_BYTES: u64 = 256 << 20;

/// A timed kernel that failed; the others were still measured.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BenchFailure {
    /// Kernel uri (or `dma(<uri>)`).
    pub kernel: String,
    /// Configuration name.
    pub config: String,
    /// Deployment name.
    pub deployment: String,
    /// What went wrong.
    pub error: String,
}

/// The rows that were measured, and the kernels that failed.
#[derive(Debug, Clone, Default)]
pub struct BenchOutcome {
    /// One row per measured kernel and size.
    pub rows: Vec<BenchRow>,
    /// One entry per kernel and size that failed to compile, load or run.
    pub failures: Vec<BenchFailure>,
}

/// Runs the benchmark over `configs`: one row per kernel
/// and size, or a failure when that kernel could not be compiled, loaded or run (the others
/// are still measured; `opts.inject` provokes one). Errors are only for a run that cannot
/// start. `progress` is called with the planned step count first (`Err`), then once per step
/// (`Ok`).
pub fn run(
    exec: &dyn Executor,
    jit: &Jit,
    configs: &[BenchConfig],
    opts: &BenchOptions,
    progress: &(dyn Fn(Result<String, u64>) + Sync),
) -> Result<BenchOutcome, TuningError> {
    let plan: Vec<Job> = configs.iter().flat_map(|c| jobs(c, opts)).collect();
    let mut unique: Vec<KernelSpec> = Vec::new();
    for j in plan.iter().filter(|j| j.dma.is_none()) {
        if !unique.contains(&j.spec) {
            unique.push(j.spec);
        }
    }
    progress(Err((unique.len() + plan.len()) as u64));
    let edit = BenchFault::break_first(unique.first().copied());
    let hook: Option<super::measure::SourceHook<'_>> =
        (opts.inject == Some(BenchFault::CompileError)).then_some(&edit);
    // SAFETY: the only hook is the compile-error fault, which makes a source fail to compile.
    let loaded = unsafe {
        compile_and_load(exec, jit, &unique, false, hook, &|| {
            progress(Ok("compile".into()))
        })
    };
    let kernel_of = |spec: &KernelSpec| -> Result<KernelId, TuningError> {
        // A spec missing from the compiled set is an error, never another kernel's handle.
        match unique
            .iter()
            .position(|s| s == spec)
            .and_then(|i| loaded.get(i))
        {
            Some(Ok(k)) => Ok(*k),
            Some(Err(e)) => Err(TuningError::NoCandidate {
                spec_key: spec.uri(),
                reasons: vec![e.clone()],
            }),
            None => Err(TuningError::NoCandidate {
                spec_key: spec.uri(),
                reasons: vec!["not compiled".into()],
            }),
        }
    };
    if opts.inject == Some(BenchFault::LaunchError) {
        exec.inject_launch_failure();
    }
    let mut out = BenchOutcome::default();
    for (i, job) in plan.iter().enumerate() {
        let kernel = match (job.dma, job.staged) {
            (Some(_), true) => format!("dma-staged({})", job.spec.uri()),
            (Some(mode), false) => format!("{}({})", LaunchChoice::of_dma(mode), job.spec.uri()),
            (None, _) => job.spec.uri(),
        };
        match time_job(exec, job, i as u64 + 7, &opts.sizes, &kernel_of) {
            Ok(Timed {
                bytes,
                seconds,
                submit_seconds,
                baseline,
                base_seconds,
            }) => {
                let gbps = bytes as f64 / seconds.max(1e-12) / 1e9;
                let baseline_gbps = bytes as f64 / base_seconds.max(1e-12) / 1e9;
                out.rows.push(BenchRow {
                    kernel: kernel.clone(),
                    spec: spec_key(&job.spec),
                    backend: exec.backend().to_string(),
                    config: job.config.clone(),
                    shapes: job.shapes.to_string(),
                    deployment: job.deployment.clone(),
                    bytes,
                    seconds,
                    gbps,
                    baseline: baseline.to_string(),
                    baseline_gbps,
                    ratio: gbps / baseline_gbps,
                    submit_seconds,
                });
            }
            Err(e) => out.failures.push(BenchFailure {
                kernel: kernel.clone(),
                config: job.config.clone(),
                deployment: job.deployment.clone(),
                error: e.to_string(),
            }),
        }
        progress(Ok(kernel));
    }
    // An injected failure that found no launch (every kernel failed earlier) goes with the run.
    exec.disarm_launch_failure();
    if exec.backend() == Backend::Cuda {
        // The link's ceiling: one large pinned copy each way, what no page transfer can beat.
        for (name, from, to) in [
            ("h2d", MemKind::Host, MemKind::Device),
            ("d2h", MemKind::Device, MemKind::Host),
        ] {
            let kernel = format!("link({name},256MiB)");
            match time_copy_baseline(exec, from, to, LINK_BYTES, &opts.sizes) {
                Ok(t) => {
                    let gbps = LINK_BYTES as f64 / t.median.max(1e-12) / 1e9;
                    out.rows.push(BenchRow {
                        kernel,
                        spec: "link".into(),
                        backend: exec.backend().to_string(),
                        config: "link".into(),
                        shapes: "default".into(),
                        deployment: "-".into(),
                        bytes: LINK_BYTES,
                        seconds: t.median,
                        gbps,
                        baseline: baseline_name(exec.backend()).into(),
                        baseline_gbps: gbps,
                        ratio: 1.0,
                        submit_seconds: None,
                    });
                }
                Err(e) => out.failures.push(BenchFailure {
                    kernel,
                    config: "link".into(),
                    deployment: "-".into(),
                    error: e.to_string(),
                }),
            }
        }
    }
    Ok(out)
}

/// What [`time_job`] measured.
struct Timed {
    bytes: u64,
    /// Median seconds.
    seconds: f64,
    /// DMA: the host's median submission seconds.
    submit_seconds: Option<f64>,
    baseline: &'static str,
    /// The baseline's median seconds.
    base_seconds: f64,
}

/// Times one job.
fn time_job(
    exec: &dyn Executor,
    job: &Job,
    seed: u64,
    sizes: &Sizes,
    kernel_of: &dyn Fn(&KernelSpec) -> Result<KernelId, TuningError>,
) -> Result<Timed, TuningError> {
    match job.spec {
        KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => {
            let cp = match job.spec {
                KernelSpec::SelectOwnerPages(s) => s.cp,
                KernelSpec::ReleasePages(s) => s.cp,
                _ => 1,
            };
            let locs = AllocBench::locs_page_size(&job.spec);
            let b = AllocBench::new(exec, cp, locs, job.alloc_pages, seed)?;
            let kernel = kernel_of(&job.spec)?;
            let t = b.time(kernel, &job.spec, sizes)?;
            let r = b.time_reference(&job.spec, sizes)?;
            Ok(Timed {
                bytes: 4 * u64::from(job.alloc_pages),
                seconds: t.median,
                submit_seconds: None,
                baseline: "rust_reference",
                base_seconds: r.median,
            })
        }
        _ => {
            let (b, _) = CopyBench::new(exec, &job.spec, sizes, seed)?;
            let bytes = b.bytes();
            let (seconds, submit_seconds) = if let Some(mode) = job.dma {
                let (t, submit) = if job.staged {
                    let kernel = kernel_of(&job.spec)?;
                    b.time_staged_submitted(kernel, &job.spec, sizes, mode)?
                } else {
                    b.time_dma_submitted(sizes, mode)?
                };
                (t.median, Some(submit.median))
            } else {
                let kernel = kernel_of(&job.spec)?;
                (b.time(kernel, &job.spec, sizes)?.median, None)
            };
            let (from, to) = b.memory();
            drop(b);
            let base = time_copy_baseline(exec, from, to, bytes, sizes)?;
            Ok(Timed {
                bytes,
                seconds,
                submit_seconds,
                baseline: baseline_name(exec.backend()),
                base_seconds: base.median,
            })
        }
    }
}

/// `dep` with streaming stores in its copy shape: `bench --check` checks these copy kernels on
/// every backend, since `tune --quick` weighs them on a GPU.
pub fn with_streaming_stores(dep: &Deployment) -> Deployment {
    let mut d = dep.clone();
    d.copy.streaming_stores = true;
    // The transfers too, with the full grid: the streaming shape `tune --quick` weighs.
    d.transfer_copy = d.copy;
    d
}

/// Every kernel that `bench`, `bench --check`, `tune --quick` and `tune --sweep` (its default
/// shapes) may load for `deps` on a GPU: all kernels of each deployment and of its
/// [`with_streaming_stores`] twin, every quick CUDA candidate of its tuned kernels, the
/// busy kernels `tune` runs beside transfers, the sweep's transfers, and the stamped twin of
/// every transfer among them. A
/// machine without a compiler (`CP_HICACHE_JIT=off`) can run those commands from a cache
/// prebuilt with these specs (`bench --prebuild`; see scripts/gpu-check.sh).
pub fn prebuild_specs(deps: &[Deployment]) -> Vec<KernelSpec> {
    let mut out: Vec<KernelSpec> = Vec::new();
    let mut push = |s: KernelSpec| {
        if !out.contains(&s) {
            out.push(s);
        }
    };
    for dep in deps {
        dep.specs().into_iter().for_each(&mut push);
        dep.busy_specs().into_iter().for_each(&mut push);
        with_streaming_stores(dep)
            .specs()
            .into_iter()
            .for_each(&mut push);
        for base in super::tuner::tuned_specs(dep) {
            for c in super::candidates_for(&base, Backend::Cuda, true) {
                if let super::Candidate::Kernel(s) = c {
                    push(s);
                }
            }
        }
        super::sweep::sweep_specs(dep, &super::sweep::SweepOptions::new(true))
            .into_iter()
            .for_each(&mut push);
    }
    // On a GPU `tune` times each transfer's first run beside the busy kernels by its
    // stamped twin (docs/KERNELS.md "busy").
    let twins: Vec<KernelSpec> = out.iter().filter_map(KernelSpec::stamped).collect();
    out.extend(twins);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A GPU machine without NVRTC runs `bench --check` from the prebuilt cache: the streaming
    /// copy kernels it checks are prebuilt, and they are the quick CUDA candidates `tune`
    /// weighs, so prebuilding them costs no extra CUBIN.
    #[test]
    fn prebuild_covers_the_streaming_kernels_check_loads() {
        let deps = default_deployments().unwrap();
        let plain: Vec<KernelSpec> = deps.iter().flat_map(|d| d.specs()).collect();
        let all = prebuild_specs(&deps);
        for dep in &deps {
            for s in with_streaming_stores(dep).specs() {
                assert!(all.contains(&s), "{s}");
                let candidate = crate::tuning::tuner::tuned_specs(dep).iter().any(|b| {
                    super::super::candidates_for(b, Backend::Cuda, true)
                        .contains(&super::super::Candidate::Kernel(s))
                });
                assert!(plain.contains(&s) || candidate, "{s}");
            }
        }
        // Every transfer `tune` may time beside the busy kernels has its stamped twin.
        for s in &all {
            if let (KernelSpec::TransferPages(t), Some(twin)) = (s, s.stamped()) {
                assert!(t.stamps || all.contains(&twin), "{s}");
            }
        }
    }
}
