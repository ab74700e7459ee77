//! `tune --sweep`: a deployment's transfers over the launch shapes and buffers that decide
//! where the link is full (docs/KERNELS.md "Transfer sweep"): each buffer alone and both
//! together, at each thread count × grid cap, and the DMA paths (one batch, one call per run,
//! staged through a device buffer), each timed alone and beside the ALU and HBM busy kernels
//! on a GPU. It measures only: the buffer subsets are not kernels the cache runs, so nothing
//! is written to a tuning file.

use super::candidate::{Candidate, LaunchChoice};
use super::check::{check_one, check_transfer};
use super::file::CandidateResult;
use super::key::{spec_key, DeviceKey};
use super::measure::{compile_and_load, CopyBench, Sizes};
use super::tuner::{
    checked, loaded_twin, record, stamped_twins, time_dma_candidate, BesideBoth, Companions,
    TuneEvent,
};
use super::TuningError;
use crate::exec::{Backend, DmaMode, ExecError, Executor, KernelId};
use crate::jit::Jit;
use crate::kernels::{
    CopyLaunch, Deployment, Direction, KernelSpec, TransferSpec, VecWidth, TRANSFER_GRID_CAPS,
};

/// Threads per block a sweep times by default.
pub const SWEEP_THREADS: [u32; 3] = [128, 256, 512];

/// What a sweep times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SweepOptions {
    /// Workload sizes and repeats.
    pub sizes: Sizes,
    /// Threads per block (default [`SWEEP_THREADS`]).
    pub threads: Vec<u32>,
    /// Grid caps in blocks (default [`TRANSFER_GRID_CAPS`]).
    pub grids: Vec<u32>,
}

impl SweepOptions {
    /// Every default thread count and grid cap, at full or quick sizes.
    pub fn new(quick: bool) -> SweepOptions {
        SweepOptions {
            sizes: if quick { Sizes::quick() } else { Sizes::full() },
            threads: SWEEP_THREADS.to_vec(),
            grids: TRANSFER_GRID_CAPS.to_vec(),
        }
    }
}

/// One timed (or dropped) candidate of a sweep.
#[derive(Debug, Clone, PartialEq)]
pub struct SweepRow {
    /// The buffers' transfer without its launch shape ([`spec_key`]).
    pub spec_key: String,
    /// Which buffers it moves: a buffer's name, or both joined by `+`.
    pub buffers: String,
    /// The candidate: a launch shape, `dma`, `dma-each` or `dma-staged`.
    pub candidate: String,
    /// What it measured, as a tune candidate reports it (the time is the one beside the
    /// ALU busy kernel where one ran).
    pub result: CandidateResult,
}

/// What a sweep measured.
#[derive(Debug)]
pub struct Swept {
    /// The device it ran on.
    pub device: DeviceKey,
    /// Rows in order: direction, buffers, kernel shapes, then the DMA paths.
    pub rows: Vec<SweepRow>,
}

/// The transfers of `dep` in `direction` a sweep times: both buffers together and, where
/// the model has two, each alone (the kernel's cost per buffer, and what a launch of one
/// small-page buffer keeps in flight). Each with its name and the vector width its pages
/// allow.
pub fn buffer_subsets(dep: &Deployment, direction: Direction) -> Vec<(String, TransferSpec)> {
    let both = dep.transfer(direction);
    let names: Vec<String> = dep.model.buffers().iter().map(|b| b.to_string()).collect();
    let mut out = vec![(names.join("+"), both)];
    if both.second_bytes_per_token.is_some() {
        for (name, one) in names.into_iter().zip(both.descriptors()) {
            let vec = VecWidth::widest_for(one.common_page_bytes()).min(dep.transfer_copy.vec);
            let launch = CopyLaunch {
                vec,
                ..dep.transfer_copy
            };
            out.push((name, TransferSpec { launch, ..one }));
        }
    }
    out
}

/// `base` at each of `opts`' thread counts and grid caps (other fields as `base`'s); shapes
/// that do not validate are left out.
pub fn sweep_shapes(base: &TransferSpec, opts: &SweepOptions) -> Vec<TransferSpec> {
    let mut out = Vec::new();
    for &threads in &opts.threads {
        for &max_blocks in &opts.grids {
            let s = TransferSpec {
                launch: CopyLaunch {
                    threads,
                    max_blocks,
                    ..base.launch
                },
                ..*base
            };
            if KernelSpec::TransferPages(s).validate().is_ok() && !out.contains(&s) {
                out.push(s);
            }
        }
    }
    out
}

/// Every kernel a sweep of `dep` with `opts` compiles (for `bench --prebuild`).
pub fn sweep_specs(dep: &Deployment, opts: &SweepOptions) -> Vec<KernelSpec> {
    let mut out = Vec::new();
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        for (_, base) in buffer_subsets(dep, direction) {
            for s in std::iter::once(base).chain(sweep_shapes(&base, opts)) {
                let spec = KernelSpec::TransferPages(s);
                if !out.contains(&spec) {
                    out.push(spec);
                }
            }
        }
    }
    out
}

/// Times the sweep of `dep` on `exec`. Every kernel candidate's output is checked against the
/// reference first, as in `tune`; a candidate that fails is a row with the reason, and the
/// others still run. The DMA rows run on CUDA only (elsewhere they say why not); the staged
/// row uses the deployment's own transfer shape for its device-side kernel.
pub fn sweep(
    dep: &Deployment,
    exec: &dyn Executor,
    jit: &Jit,
    opts: &SweepOptions,
    progress: &(dyn Fn(TuneEvent) + Sync),
) -> Result<Swept, TuningError> {
    let device = DeviceKey::for_executor(exec, jit)?;
    let backend = exec.backend();
    let mut plans: Vec<(String, TransferSpec, Vec<TransferSpec>)> = Vec::new();
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        for (name, base) in buffer_subsets(dep, direction) {
            let shapes = sweep_shapes(&base, opts);
            plans.push((name, base, shapes));
        }
    }
    // Beside the busy kernels (a GPU) each shape's first run is its stamped twin's.
    let companions = Companions::open(exec, jit);
    let mut unique = sweep_specs(dep, opts);
    let twins = stamped_twins(&unique, &companions);
    unique.extend(twins);
    let dma_rows = 3;
    let timed: usize = plans.iter().map(|(_, _, s)| s.len() + dma_rows).sum();
    progress(TuneEvent::Planned {
        steps: (unique.len() + timed) as u64,
    });
    // SAFETY: no source hook: the kernels are the rendered sources.
    let compiled = unsafe {
        compile_and_load(exec, jit, &unique, true, None, &|| {
            progress(TuneEvent::Step {
                what: "compile".into(),
            })
        })
    };
    let compiled_of =
        |spec: &KernelSpec| unique.iter().position(|s| s == spec).map(|i| &compiled[i]);
    let kernel_of = |spec: &KernelSpec| -> Result<KernelId, String> {
        match compiled_of(spec) {
            Some(Ok(k)) => Ok(*k),
            Some(Err(e)) => Err(e.clone()),
            None => Err("not compiled".into()),
        }
    };
    let mut rows = Vec::new();
    for (seed, (buffers, base, shapes)) in plans.iter().enumerate() {
        let seed = seed as u64 + 1;
        let base_spec = KernelSpec::TransferPages(*base);
        let key = spec_key(&base_spec);
        let (bench, _) = CopyBench::new(exec, &base_spec, &opts.sizes, seed)?;
        let mut row = |candidate: String, result: CandidateResult| {
            progress(TuneEvent::Step {
                what: format!("{key} {buffers} {candidate}"),
            });
            rows.push(SweepRow {
                spec_key: key.clone(),
                buffers: buffers.clone(),
                candidate,
                result,
            });
        };
        for s in shapes {
            let spec = KernelSpec::TransferPages(*s);
            let result = match kernel_of(&spec) {
                Ok(kernel) => {
                    // A twin that did not load leaves the row timed with the marker's stamp.
                    let twin = loaded_twin(compiled_of, &spec);
                    let kernels = Kernels {
                        spec: &spec,
                        kernel,
                        twin,
                    };
                    time_kernel(exec, kernels, &bench, &companions, &opts.sizes, seed)
                }
                Err(why) => dropped(LaunchChoice::of_spec(&spec), why),
            };
            row(s.launch.to_string(), result);
        }
        for mode in [DmaMode::Batched, DmaMode::PerRegion] {
            let cand = Candidate::Dma(base_spec, mode);
            let result = match cand.supported_by(backend) {
                Err(e) => dropped(cand.choice(), e.to_string()),
                Ok(()) => time_dma_candidate(
                    exec,
                    &base_spec,
                    &bench,
                    &companions,
                    &opts.sizes,
                    seed,
                    mode,
                ),
            };
            row(cand.choice().to_string(), result);
        }
        let staged = match (backend, kernel_of(&base_spec)) {
            (Backend::Cuda, Ok(kernel)) => time_staged_candidate(
                exec,
                &base_spec,
                kernel,
                &bench,
                &companions,
                &opts.sizes,
                seed,
            ),
            (Backend::Cuda, Err(why)) => dropped(LaunchChoice::Dma, why),
            (other, _) => dropped(
                LaunchChoice::Dma,
                format!(
                    "dma-staged is unsupported by the {other} executor: copy-engine DMA is a \
                     GPU path"
                ),
            ),
        };
        row("dma-staged".into(), staged);
    }
    Ok(Swept { device, rows })
}

/// A result not measured (yet): `why` says why it never will be.
fn unmeasured(choice: LaunchChoice, why: Option<String>) -> CandidateResult {
    CandidateResult {
        choice,
        seconds: None,
        gbps: None,
        dropped: why,
        beside_busy: None,
    }
}

fn dropped(choice: LaunchChoice, why: String) -> CandidateResult {
    unmeasured(choice, Some(why))
}

/// One transfer shape's kernel and, where it loaded, its stamped twin's.
struct Kernels<'a> {
    spec: &'a KernelSpec,
    kernel: KernelId,
    twin: Option<(KernelSpec, KernelId)>,
}

/// Checks, then times one kernel shape alone and beside the busy kernels (its first run
/// beside them by its stamped twin, where given).
fn time_kernel(
    exec: &dyn Executor,
    k: Kernels<'_>,
    bench: &CopyBench<'_>,
    companions: &Companions<'_>,
    sizes: &Sizes,
    seed: u64,
) -> CandidateResult {
    let run = checked(check_one(exec, k.spec, k.kernel, seed)).and_then(|()| {
        let timed = bench.time(k.kernel, k.spec, sizes).and_then(|t| {
            let alone = t.median;
            let busy = companions.time_transfer(
                bench,
                (k.spec, k.kernel),
                k.twin,
                alone,
                sizes.repeats,
            )?;
            Ok((alone, busy))
        });
        timed.map_err(|e| format!("launch failed: {e}"))
    });
    measured(LaunchChoice::of_spec(k.spec), bench.bytes(), run)
}

/// Checks, then times the staged path ([`CopyBench::copy_staged`]: contiguous runs by one
/// DMA batch, the kernel between the staging buffer and the pools) alone and beside the
/// busy kernels. `kernel` is `spec`'s (the device side of the staged path). Output that
/// differs from the reference drops the row with the difference. The result's choice is
/// `dma` (the batch it issues); the sweep names the row `dma-staged`.
pub fn time_staged_candidate(
    exec: &dyn Executor,
    spec: &KernelSpec,
    kernel: KernelId,
    bench: &CopyBench<'_>,
    companions: &Companions<'_>,
    sizes: &Sizes,
    seed: u64,
) -> CandidateResult {
    let mode = DmaMode::Batched;
    let stage = |b: &CopyBench<'_>| b.copy_staged(kernel, spec, mode);
    let run = checked(check_transfer(exec, spec, seed, stage)).and_then(|()| {
        let alone = bench
            .time_staged_submitted(kernel, spec, sizes, mode)
            .map(|(t, _)| t.median);
        alone_then_beside(companions, sizes, alone, &|| stage(bench))
            .map_err(|e| format!("staged copy failed: {e}"))
    });
    measured(LaunchChoice::of_dma(mode), bench.bytes(), run)
}

/// The seconds of one run alone (`alone`), then `work` timed beside the busy kernels.
fn alone_then_beside(
    companions: &Companions<'_>,
    sizes: &Sizes,
    alone: Result<f64, ExecError>,
    work: &(dyn Fn() -> Result<(), ExecError> + Sync),
) -> Result<(f64, Option<BesideBoth>), ExecError> {
    let alone = alone?;
    Ok((alone, companions.time(alone, sizes.repeats, work, None)?))
}

/// The result of `choice` moving `bytes`: measured, or dropped with why.
fn measured(
    choice: LaunchChoice,
    bytes: u64,
    run: Result<(f64, Option<BesideBoth>), String>,
) -> CandidateResult {
    let mut result = unmeasured(choice, None);
    match run {
        Ok((alone, busy)) => record(&mut result, alone, Some(bytes), busy),
        Err(why) => result.dropped = Some(why),
    }
    result
}
