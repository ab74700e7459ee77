//! `tune`: times every candidate launch shape of a deployment's kernels on the executor at
//! hand and returns one [`TuningEntry`] per kernel (the caller merges them into a file).
//!
//! Tuned families: select and release (the allocator, `alloc_threads`), transfer in both
//! directions and materialise for every buffer (`copy`), synthesise and verify (`synth_threads`:
//! on the CPU emulation one thread per block is several times faster than 128, and replay
//! spends most of its time there).
//!
//! Every candidate's output is checked against the reference before it is timed.

use std::collections::HashMap;

use super::candidate::{candidates_for, Candidate, LaunchChoice};
use super::check::{check_one, check_transfer};
use super::file::{BesideBusy, BesideCompanion, CandidateResult, TuningEntry};
use super::key::{spec_key, DeviceKey};
use super::measure::{
    compile_and_load, synth_pages, AllocBench, Beside, BesideTiming, CopyBench, Sizes, SourceHook,
    StampedRun, SynthBench,
};
use super::TuningError;
use crate::exec::{DmaMode, ExecError, Executor, KernelId};
use crate::jit::Jit;
use crate::kernels::{BusyKind, Deployment, KernelSpec};

/// Options of a tuning run.
#[derive(Clone, Copy)]
pub struct TuneOptions<'a> {
    /// Copy workload sizes and repeats.
    pub sizes: Sizes,
    /// Requests per select/release launch.
    pub alloc_pages: u32,
    /// Only a handful of candidates per kernel.
    pub quick: bool,
    /// Edits candidate sources before compiling (fault injection in tests); set only
    /// through [`TuneOptions::with_source_hook`], whose contract keeps the edited kernels'
    /// launches in bounds.
    hook: Option<SourceHook<'a>>,
}

impl<'a> TuneOptions<'a> {
    /// The same options with `hook` editing every candidate's source before it compiles
    /// (tests and fault injection).
    ///
    /// # Safety
    ///
    /// The edited candidates are launched by a safe [`tune`]: `hook` must keep every kernel
    /// within its spec's signature, each parameter's [`Reach`](crate::kernels::Reach), as the
    /// rendered source does (breaking the compile, or changing the values written, is fine;
    /// an edit that indexes further is not).
    pub unsafe fn with_source_hook<'b>(self, hook: SourceHook<'b>) -> TuneOptions<'b>
    where
        'a: 'b,
    {
        TuneOptions {
            hook: Some(hook),
            ..self
        }
    }

    /// Full or quick defaults.
    pub fn new(quick: bool) -> TuneOptions<'static> {
        TuneOptions {
            sizes: if quick { Sizes::quick() } else { Sizes::full() },
            alloc_pages: 2048,
            quick,
            hook: None,
        }
    }
}

/// Progress of a tuning run, for a progress bar.
#[derive(Debug, Clone)]
pub enum TuneEvent {
    /// The run will take `steps` steps (one per compile, one per timed candidate).
    Planned {
        /// Total steps.
        steps: u64,
    },
    /// One step finished.
    Step {
        /// What it was.
        what: String,
    },
}

/// The kernels whose launch shapes a deployment's tunable fields decide.
pub fn tuned_specs(dep: &Deployment) -> Vec<KernelSpec> {
    dep.specs()
}

/// What a tuning run produced.
#[derive(Debug)]
pub struct Tuned {
    /// The key of the device tuned on.
    pub device: DeviceKey,
    /// One entry per kernel that has a winner.
    pub entries: Vec<TuningEntry>,
    /// One [`TuningError::NoCandidate`] per kernel none of whose candidates ran: the other
    /// kernels' results are kept, not lost with them.
    pub failed: Vec<TuningError>,
    /// Candidates that ran but computed wrong bytes (`kernel candidate: difference`). They
    /// were dropped, so no winner is affected, but each is a kernel bug at that shape.
    pub wrong_output: Vec<String>,
}

/// Times every candidate of every tuned kernel of `dep` on `exec` and returns the device key
/// and one entry per kernel. Candidates that fail to render, compile (or spill, on NVRTC),
/// load or launch, or whose output differs from the reference, are recorded as dropped (the
/// last also in [`Tuned::wrong_output`]); a kernel none of whose candidates ran is listed in
/// [`Tuned::failed`]. Errors outside a
/// candidate (the device key, the workload's buffers) end the run.
pub fn tune(
    dep: &Deployment,
    exec: &dyn Executor,
    jit: &Jit,
    opts: &TuneOptions<'_>,
    progress: &(dyn Fn(TuneEvent) + Sync),
) -> Result<Tuned, TuningError> {
    let device = DeviceKey::for_executor(exec, jit)?;
    let backend = exec.backend();
    let bases = tuned_specs(dep);
    let plans: Vec<(KernelSpec, Vec<Candidate>)> = bases
        .iter()
        .map(|b| (*b, candidates_for(b, backend, opts.quick)))
        .collect();
    let mut unique: Vec<KernelSpec> = Vec::new();
    for (_, cands) in &plans {
        for c in cands {
            if let Candidate::Kernel(s) = c {
                if !unique.contains(s) {
                    unique.push(*s);
                }
            }
        }
    }
    // On a GPU, transfers are timed while a busy kernel keeps the SMs (ALU) or HBM busy
    // beside them (docs/KERNELS.md "busy"): what an engine's copies see while the model
    // runs, each candidate's first run by its stamped twin. Without a companion stream (the
    // host executor) they are timed alone.
    let transfers = plans
        .iter()
        .any(|(b, _)| matches!(b, KernelSpec::TransferPages(_)));
    let companions = if transfers {
        Companions::open(exec, jit)
    } else {
        Companions::default()
    };
    let twins = stamped_twins(&unique, &companions);
    unique.extend(twins);
    let timed: usize = plans.iter().map(|(_, c)| c.len()).sum();
    progress(TuneEvent::Planned {
        steps: (unique.len() + timed) as u64,
    });
    // SAFETY: `opts.hook` is set only through `with_source_hook`, whose caller vouches for it.
    let compiled = unsafe {
        compile_and_load(exec, jit, &unique, true, opts.hook, &|| {
            progress(TuneEvent::Step {
                what: "compile".into(),
            })
        })
    };
    let loaded: HashMap<KernelSpec, Result<KernelId, String>> =
        unique.into_iter().zip(compiled).collect();

    let mut entries = Vec::with_capacity(plans.len());
    let mut failed = Vec::new();
    let mut wrong_output = Vec::new();
    for (seed, (base, cands)) in plans.iter().enumerate() {
        let key = spec_key(base);
        let mut results = Vec::with_capacity(cands.len());
        let bench = Workload::new(exec, base, opts, seed as u64 + 1)?;
        for cand in cands {
            let choice = cand.choice();
            let mut result = CandidateResult {
                choice,
                seconds: None,
                gbps: None,
                dropped: None,
                beside_busy: None,
            };
            match cand {
                Candidate::Dma(_, mode) => match (cand.supported_by(backend), &bench) {
                    (Err(e), _) => result.dropped = Some(e.to_string()),
                    (Ok(()), Workload::Copy(c)) => {
                        result = time_dma_candidate(
                            exec,
                            base,
                            c,
                            &companions,
                            &opts.sizes,
                            seed as u64 + 1,
                            *mode,
                        )
                    }
                    (Ok(()), _) => result.dropped = Some(super::measure::no_dma_path().to_string()),
                },
                Candidate::Kernel(spec) => match loaded.get(spec) {
                    Some(Ok(kernel)) => {
                        let run = checked(check_one(exec, spec, *kernel, seed as u64 + 1))
                            .and_then(|()| {
                                let launch_failed = |e| format!("launch failed: {e}");
                                let (seconds, bytes) = bench
                                    .time(*kernel, spec, &opts.sizes)
                                    .map_err(launch_failed)?;
                                let busy = match (&bench, spec) {
                                    (Workload::Copy(c), KernelSpec::TransferPages(_)) => companions
                                        .time_transfer(
                                            c,
                                            (spec, *kernel),
                                            loaded_twin(|t| loaded.get(t), spec),
                                            seconds,
                                            opts.sizes.repeats,
                                        )
                                        .map_err(launch_failed)?,
                                    _ => None,
                                };
                                Ok((seconds, bytes, busy))
                            });
                        match run {
                            Ok((seconds, bytes, busy)) => record(&mut result, seconds, bytes, busy),
                            Err(why) => result.dropped = Some(why),
                        }
                    }
                    Some(Err(e)) => result.dropped = Some(e.clone()),
                    None => result.dropped = Some("not compiled".into()),
                },
            }
            if let Some(why) = &result.dropped {
                if let Some(diff) = why.strip_prefix(WRONG_OUTPUT) {
                    wrong_output.push(format!("{key} {choice}: {diff}"));
                }
                tracing::info!(target: "cp_hicache::tuning", kernel = %key, candidate = %choice, "dropped: {why}");
            }
            progress(TuneEvent::Step {
                what: format!("{key} {choice}"),
            });
            results.push(result);
        }
        let best = results
            .iter()
            .filter_map(|r| r.seconds.map(|s| (r.choice, s)))
            .min_by(|a, b| a.1.total_cmp(&b.1));
        let Some((best, best_seconds)) = best else {
            failed.push(TuningError::NoCandidate {
                spec_key: key,
                reasons: results.iter().filter_map(|r| r.dropped.clone()).collect(),
            });
            continue;
        };
        entries.push(TuningEntry {
            device: device.clone(),
            family: base.family().to_string(),
            spec_key: key,
            best,
            best_seconds,
            workload: match base {
                KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => format!(
                    "requests={} warmup={} repeats={}",
                    opts.alloc_pages, opts.sizes.warmup, opts.sizes.repeats
                ),
                KernelSpec::Synthesise(_) | KernelSpec::Verify(_) => Sizes {
                    pages: synth_pages(&opts.sizes),
                    ..opts.sizes
                }
                .describe(),
                _ => opts.sizes.describe(),
            },
            results,
        });
    }
    Ok(Tuned {
        device,
        entries,
        failed,
        wrong_output,
    })
}

/// Why `dma` is not timed where the executor has no batch call: it would issue one call per
/// merged region, exactly what `dma-each` times, and one measurement under two names would
/// read as a comparison that was never made.
pub const DMA_FALLBACK: &str = "not timed: no batch copy call here (cuMemcpyBatchAsync, CUDA \
                                12.8+), so dma falls back to one call per merged region, which \
                                dma-each times";

/// The busy kernels transfers are timed beside on a GPU (docs/KERNELS.md "busy"): none on
/// the host executor; the HBM one only beside the ALU one, whose time is the candidate's.
#[derive(Default)]
pub struct Companions<'e> {
    /// The ALU busy kernel: the candidate's time is the one beside it.
    pub alu: Option<Beside<'e>>,
    /// The HBM busy kernel.
    pub hbm: Option<Beside<'e>>,
}

/// A candidate timed beside the ALU busy kernel, and the HBM one when it runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BesideBoth {
    /// Beside the ALU busy kernel.
    pub alu: BesideTiming,
    /// Beside the HBM busy kernel.
    pub hbm: Option<BesideTiming>,
}

impl<'e> Companions<'e> {
    /// The ALU busy kernel beside `exec` and, when it runs, the HBM one; none where `exec`
    /// has no companion stream (the host executor) or a busy kernel cannot run there (a
    /// warning says why: the transfers are then timed alone).
    pub fn open(exec: &'e dyn Executor, jit: &Jit) -> Companions<'e> {
        let open = |kind| {
            Beside::open(exec, jit, kind).unwrap_or_else(|why| {
                tracing::warn!(target: "cp_hicache::tuning", "transfers not timed beside {kind}: {why}");
                None
            })
        };
        let alu = open(BusyKind::Alu);
        Companions {
            hbm: alu.as_ref().and_then(|_| open(BusyKind::Hbm)),
            alu,
        }
    }

    /// Times `repeats` runs of `work` (about `expected` seconds each) beside each companion,
    /// ALU first, the first run by `stamped` where given ([`Beside::time_beside`]);
    /// `Ok(None)` without an ALU companion.
    pub fn time(
        &self,
        expected: f64,
        repeats: u32,
        work: &(dyn Fn() -> Result<(), ExecError> + Sync),
        stamped: Option<StampedRun<'_>>,
    ) -> Result<Option<BesideBoth>, ExecError> {
        let Some(alu) = &self.alu else {
            return Ok(None);
        };
        let alu = alu.time_beside(expected, repeats, work, stamped)?;
        let hbm = self
            .hbm
            .as_ref()
            .map(|h| h.time_beside(expected, repeats, work, stamped))
            .transpose()?;
        Ok(Some(BesideBoth { alu, hbm }))
    }

    /// Whether transfers are timed beside a busy kernel here (a GPU), so their stamped twins
    /// ([`KernelSpec::stamped`]) are worth compiling.
    pub fn present(&self) -> bool {
        self.alu.is_some()
    }

    /// Times transfer `kernel` (compiled from `spec`) on `bench` beside each companion
    /// (about `expected` seconds a run), its first run by the stamped twin `twin` where that
    /// loaded, so its own block stamps say where it ran (docs/KERNELS.md "busy").
    pub fn time_transfer(
        &self,
        bench: &CopyBench<'_>,
        (spec, kernel): (&KernelSpec, KernelId),
        twin: Option<(KernelSpec, KernelId)>,
        expected: f64,
        repeats: u32,
    ) -> Result<Option<BesideBoth>, ExecError> {
        let stamped = twin.map(|(twin_spec, twin_kernel)| {
            move |stamps| bench.launch_stamped(twin_kernel, &twin_spec, stamps)
        });
        self.time(
            expected,
            repeats,
            &|| bench.launch(kernel, spec),
            stamped.as_ref().map(|f| f as StampedRun<'_>),
        )
    }
}

/// `spec`'s stamped twin and its kernel, where it compiled and loaded (a twin that did not
/// leaves the candidate timed with the marker's stamp, and says why in the log).
/// `loaded` says what compiling a spec gave, `None` where it was not compiled (no twins
/// without companions).
pub(super) fn loaded_twin<'a>(
    loaded: impl Fn(&KernelSpec) -> Option<&'a Result<KernelId, String>>,
    spec: &KernelSpec,
) -> Option<(KernelSpec, KernelId)> {
    let twin = spec.stamped()?;
    match loaded(&twin)? {
        Ok(kernel) => Some((twin, *kernel)),
        Err(why) => {
            tracing::warn!(target: "cp_hicache::tuning", kernel = %twin, "stamped twin not loaded: {why}");
            None
        }
    }
}

/// The stamped twin of each transfer in `specs` not already among them (none where
/// `companions` has no busy kernel: transfers are then timed alone).
pub(super) fn stamped_twins(specs: &[KernelSpec], companions: &Companions<'_>) -> Vec<KernelSpec> {
    if !companions.present() {
        return Vec::new();
    }
    let mut twins: Vec<KernelSpec> = Vec::new();
    for twin in specs.iter().filter_map(KernelSpec::stamped) {
        if !specs.contains(&twin) && !twins.contains(&twin) {
            twins.push(twin);
        }
    }
    twins
}

/// Checks, then times the DMA path of transfer `base` on `bench` with its batch issued as
/// `mode` (the tune candidates `dma` and `dma-each`): alone, and beside the busy kernels in
/// `companions`, as the kernel shapes are. [`DmaMode::Batched`] on an executor that has
/// no batch call ([`Executor::batched_copies`]) is not timed but dropped with
/// [`DMA_FALLBACK`]. Output that differs from the reference drops the candidate, with the
/// difference.
pub fn time_dma_candidate(
    exec: &dyn Executor,
    base: &KernelSpec,
    bench: &CopyBench<'_>,
    companions: &Companions<'_>,
    sizes: &Sizes,
    seed: u64,
    mode: DmaMode,
) -> CandidateResult {
    let mut result = CandidateResult {
        choice: LaunchChoice::of_dma(mode),
        seconds: None,
        gbps: None,
        dropped: None,
        beside_busy: None,
    };
    if mode == DmaMode::Batched && !exec.batched_copies() {
        result.dropped = Some(DMA_FALLBACK.into());
        return result;
    }
    if let Err(why) = checked(check_transfer(exec, base, seed, |b| b.copy_dma_with(mode))) {
        result.dropped = Some(why);
        return result;
    }
    let timed = bench.time_dma_with(sizes, mode).and_then(|t| {
        let busy = companions.time(t.median, sizes.repeats, &|| bench.copy_dma_with(mode), None)?;
        Ok((t.median, busy))
    });
    match timed {
        Ok((seconds, busy)) => record(&mut result, seconds, Some(bench.bytes()), busy),
        Err(e) => result.dropped = Some(format!("DMA copy failed: {e}")),
    }
    result
}

/// Fills a timed result: alone, or (on a GPU, for transfers) beside the busy kernels, where
/// the time beside the ALU one is the candidate's (docs/KERNELS.md "busy") and the others
/// are kept with it.
pub(super) fn record(
    result: &mut CandidateResult,
    alone: f64,
    bytes: Option<u64>,
    busy: Option<BesideBoth>,
) {
    let seconds = busy.map_or(alone, |b| b.alu.seconds);
    result.seconds = Some(seconds);
    result.gbps = bytes.map(|b| b as f64 / seconds / 1e9);
    result.beside_busy = busy.map(|b| BesideBusy {
        alone_seconds: alone,
        busy_slowdown: b.alu.busy_slowdown,
        alu_overlap: Some(b.alu.overlap),
        hbm: b.hbm.map(|h| BesideCompanion {
            seconds: h.seconds,
            slowdown: h.busy_slowdown,
            overlap: h.overlap,
        }),
    });
}

/// How the drop note of a candidate with wrong output starts.
const WRONG_OUTPUT: &str = "output differs from the reference: ";

/// Whether a drop note says the candidate computed wrong bytes (a kernel bug at its shape,
/// not a shape the device cannot run).
pub fn is_wrong_output(dropped: &str) -> bool {
    dropped.starts_with(WRONG_OUTPUT)
}

/// Why a candidate whose output was checked against the reference (`bench --check`'s
/// inputs) must be dropped: a fast candidate that computes the wrong bytes, or skips work,
/// must never become the tuned shape.
pub(super) fn checked(outcome: Result<Result<String, String>, TuningError>) -> Result<(), String> {
    match outcome {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(diff)) => Err(format!("{WRONG_OUTPUT}{diff}")),
        Err(e) => Err(format!("check failed: {e}")),
    }
}

/// The buffers one tuned kernel is timed on.
enum Workload<'e> {
    Copy(CopyBench<'e>),
    Alloc(AllocBench<'e>),
    Synth(SynthBench<'e>),
}

impl<'e> Workload<'e> {
    fn new(
        exec: &'e dyn Executor,
        spec: &KernelSpec,
        opts: &TuneOptions<'_>,
        seed: u64,
    ) -> Result<Workload<'e>, TuningError> {
        Ok(match spec {
            KernelSpec::SelectOwnerPages(s) => Workload::Alloc(AllocBench::new(
                exec,
                s.cp,
                AllocBench::locs_page_size(spec),
                opts.alloc_pages,
                seed,
            )?),
            KernelSpec::ReleasePages(s) => {
                Workload::Alloc(AllocBench::new(exec, s.cp, None, opts.alloc_pages, seed)?)
            }
            KernelSpec::Synthesise(s) => {
                Workload::Synth(SynthBench::new(exec, s, &opts.sizes, seed)?)
            }
            KernelSpec::Verify(s) => {
                Workload::Synth(SynthBench::for_verify(exec, s, &opts.sizes, seed)?)
            }
            _ => Workload::Copy(CopyBench::new(exec, spec, &opts.sizes, seed)?.0),
        })
    }

    /// Median seconds, and the bytes moved when that is the measure.
    fn time(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        sizes: &Sizes,
    ) -> Result<(f64, Option<u64>), crate::exec::ExecError> {
        match self {
            Workload::Copy(b) => Ok((b.time(kernel, spec, sizes)?.median, Some(b.bytes()))),
            Workload::Alloc(b) => Ok((b.time(kernel, spec, sizes)?.median, None)),
            Workload::Synth(b) => Ok((b.time(kernel, spec, sizes)?.median, None)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Direction;

    /// A transfer's stamped twin is used where it loaded, and not where it failed (the
    /// marker stamps the start instead); other families have none.
    #[test]
    fn a_twin_is_used_only_where_it_loaded() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        let spec = dep.transfer_spec(Direction::HostToDevice);
        let twin = spec.stamped().unwrap();
        let mut loaded = HashMap::new();
        assert_eq!(loaded_twin(|t| loaded.get(t), &spec), None);
        loaded.insert(twin, Ok(KernelId(7)));
        assert_eq!(
            loaded_twin(|t| loaded.get(t), &spec),
            Some((twin, KernelId(7)))
        );
        loaded.insert(twin, Err("spilled".into()));
        assert_eq!(loaded_twin(|t| loaded.get(t), &spec), None);
        let select = dep.specs()[0];
        assert!(select.stamped().is_none());
        assert_eq!(loaded_twin(|t| loaded.get(t), &select), None);
    }

    /// Without a busy companion (the host executor) no twin is compiled.
    #[test]
    fn no_twins_are_compiled_without_companions() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        assert!(stamped_twins(&dep.specs(), &Companions::default()).is_empty());
    }
}
