//! The busy kernels: their bench, and running one on a companion executor to time other work
//! while the SMs (ALU) or HBM are busy, as an engine's transfers run while the model computes.

use super::compile::compile_and_load;
use super::workload::Owned;
use crate::exec::{BufferId, ExecError, Executor, KernelArg, KernelId, LaunchConfig, MemKind};
use crate::jit::Jit;
use crate::kernels::{
    BusyKind, BusySpec, KernelSpec, GPU_TRANSFER_THREADS, SM_MAX_THREADS, TRANSFER_STAMP_BYTES,
};
use crate::tuning::file::Overlap;

/// Bytes of a busy kernel's `stamps`: its first block start and last block end, in
/// nanoseconds of `%globaltimer` (templates/busy_common.cu).
const STAMP_BYTES: usize = 16;

/// What `stamps` holds before a launch: no block has started (`~0`) or ended (`0`), so
/// every block's `atomicMin` / `atomicMax` lands. A stamped transfer's third word, its last
/// block start, starts at 0 too.
fn unstamped() -> [u8; TRANSFER_STAMP_BYTES as usize] {
    let mut b = [0u8; TRANSFER_STAMP_BYTES as usize];
    b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    b
}

/// When a busy launch ran, by the device's clock (`%globaltimer`, CLOCK_MONOTONIC in the
/// emulation): nanoseconds of its first block start and its last block end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamps {
    /// The earliest block start.
    pub start_ns: u64,
    /// The latest block end.
    pub end_ns: u64,
}

impl Stamps {
    fn read(exec: &dyn Executor, buf: BufferId) -> Result<Stamps, ExecError> {
        Ok(Stamps::read_words::<2>(exec, buf)?.0)
    }

    /// The stamps of a stamped transfer ([`TransferSpec::stamps`](crate::kernels::TransferSpec::stamps)),
    /// and its last block start.
    pub fn read_transfer(exec: &dyn Executor, buf: BufferId) -> Result<(Stamps, u64), ExecError> {
        let (stamps, words) = Stamps::read_words::<3>(exec, buf)?;
        Ok((stamps, words[2]))
    }

    fn read_words<const N: usize>(
        exec: &dyn Executor,
        buf: BufferId,
    ) -> Result<(Stamps, [u64; N]), ExecError> {
        let mut b = [[0u8; 8]; N];
        exec.read(buf, 0, b.as_flattened_mut())?;
        let words = b.map(u64::from_le_bytes);
        Ok((
            Stamps {
                start_ns: words[0],
                end_ns: words[1],
            },
            words,
        ))
    }

    /// Whether a block started and ended, in that order (a launch that ran).
    pub fn is_sane(&self) -> bool {
        self.start_ns != u64::MAX && self.end_ns != 0 && self.start_ns <= self.end_ns
    }
}

/// A busy kernel's buffers: `n` words on the device, each computed by one thread, and its
/// stamps (docs/KERNELS.md "busy").
pub struct BusyBench<'e> {
    mem: Owned<'e>,
    out: BufferId,
    stamps: BufferId,
    /// Output words.
    pub n: u32,
}

impl<'e> BusyBench<'e> {
    /// Allocates `n` output words on `exec`'s device, poisoned, and the stamps.
    pub fn new(exec: &'e dyn Executor, n: u32) -> Result<BusyBench<'e>, ExecError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        let out = mem.alloc(MemKind::Device, 4 * u64::from(n), 0xA5)?;
        let stamps = mem.alloc(MemKind::Device, STAMP_BYTES as u64, 0)?;
        Ok(BusyBench {
            mem,
            out,
            stamps,
            n,
        })
    }

    /// The output buffer.
    pub fn out(&self) -> BufferId {
        self.out
    }

    /// Launches `kernel` (compiled from the busy `spec`) for `rounds` rounds per word on the
    /// grid that gives each word a thread, resetting the stamps first, without synchronising.
    pub fn launch(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        rounds: u32,
        seed: u32,
    ) -> Result<(), ExecError> {
        let d = spec.launch_dims(self.n, 1);
        launch_busy(
            self.mem.exec,
            kernel,
            LaunchConfig::linear(d.grid, d.block),
            (self.out, self.n),
            self.stamps,
            rounds,
            seed,
        )
    }

    /// The stamps of the last launch (after it finished).
    pub fn stamps(&self) -> Result<Stamps, ExecError> {
        Stamps::read(self.mem.exec, self.stamps)
    }
}

/// Resets `stamps`, then launches a busy kernel over `out` (buffer and words).
fn launch_busy(
    exec: &dyn Executor,
    kernel: KernelId,
    cfg: LaunchConfig,
    out: (BufferId, u32),
    stamps: BufferId,
    rounds: u32,
    seed: u32,
) -> Result<(), ExecError> {
    exec.upload(stamps, 0, &unstamped()[..STAMP_BYTES])?;
    exec.launch(
        kernel,
        &cfg,
        &[
            KernelArg::Ptr(out.0, 0),
            KernelArg::U32(out.1),
            KernelArg::U32(rounds),
            KernelArg::U32(seed),
            KernelArg::Ptr(stamps, 0),
        ],
    )
}

/// How big a companion's launch is: its grid, and the words of the HBM kernel's buffer (the
/// ALU kernel has one word per thread: its rounds, not its words, set how long it runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompanionShape {
    /// Blocks of the busy launch: one wave, all resident at once.
    pub grid: u32,
    /// Words of the HBM kernel's buffer.
    pub hbm_words: u32,
}

impl CompanionShape {
    /// SMs assumed where the device does not say ([`Executor::multiprocessors`]): an H100
    /// SXM's or an H200's.
    pub const GPU_SMS: u32 = 132;

    /// 64 Mi words: a 256 MiB buffer, five times an H100's or H200's 50 MiB L2, so every
    /// round of the HBM kernel streams from HBM.
    pub const GPU_HBM_WORDS: u32 = 64 << 20;

    /// The shape on a GPU of `sms` SMs: per SM, as many busy blocks of `threads` as leave a
    /// transfer block of up to [`GPU_TRANSFER_THREADS`] room beside them (6 of 256 threads:
    /// 1,536 of an SM's 2,048), so a transfer launched first keeps its blocks resident
    /// between repeats rather than queueing behind the busy kernel's.
    pub fn gpu(sms: u32, threads: u32) -> CompanionShape {
        let per_sm = ((SM_MAX_THREADS - GPU_TRANSFER_THREADS) / threads.max(1)).max(1);
        CompanionShape {
            grid: sms.max(1) * per_sm,
            hbm_words: Self::GPU_HBM_WORDS,
        }
    }

    fn words(&self, kind: BusyKind, threads: u32) -> u32 {
        match kind {
            BusyKind::Alu => self.grid.saturating_mul(threads),
            BusyKind::Hbm => self.hbm_words,
        }
    }
}

/// Work whose first run can stamp where it ran: given a buffer of
/// [`TRANSFER_STAMP_BYTES`] on the main executor, already reset, it enqueues one run that
/// writes its first block start, last block end and last block start there (a stamped
/// transfer, [`CopyBench::launch_stamped`](super::CopyBench::launch_stamped)).
pub type StampedRun<'a> = &'a (dyn Fn(BufferId) -> Result<(), ExecError> + Sync);

/// A busy kernel on a companion executor ([`Executor::companion`]: the same GPU, its own
/// stream), to time work on the main executor while the SMs or HBM are busy, as an engine's
/// transfers run while the model computes. Where the work is a kernel that stamps its own
/// blocks ([`StampedRun`]) its first run does; otherwise a one-block launch of the ALU kernel
/// on the main executor, just before the work, stamps where the work started.
pub struct Beside<'e> {
    exec: &'e dyn Executor,
    /// A stamped run's stamps, on `exec`.
    work_stamps: BufferId,
    marker: BusyBench<'e>,
    marker_kernel: KernelId,
    marker_spec: KernelSpec,
    comp: Box<dyn Executor>,
    kernel: KernelId,
    spec: BusySpec,
    out: BufferId,
    stamps: BufferId,
    n: u32,
    grid: u32,
    /// Seconds of one round over every word, measured alone.
    round_seconds: f64,
}

/// What one piece of work cost, and cost the busy kernel, when they ran together.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BesideTiming {
    /// Seconds of the work while the busy kernel ran.
    pub seconds: f64,
    /// Busy kernel seconds beside the work over its seconds alone (same rounds).
    pub busy_slowdown: f64,
    /// Where the busy kernel ran against the work, by the device's clock.
    pub overlap: Overlap,
}

impl<'e> Beside<'e> {
    /// Opens `exec`'s companion and compiles the busy kernel of `kind` for it, at
    /// [`CompanionShape::gpu`] of the device's SMs. `Ok(None)` when `exec` has none (the
    /// host executor); `Err` says why the busy kernel cannot run.
    pub fn open(
        exec: &'e dyn Executor,
        jit: &Jit,
        kind: BusyKind,
    ) -> Result<Option<Beside<'e>>, String> {
        let comp = match exec.companion() {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(None),
            Err(e) => return Err(format!("no companion executor: {e}")),
        };
        let spec = BusySpec::of(kind);
        let sms = exec.multiprocessors().unwrap_or(CompanionShape::GPU_SMS);
        let shape = CompanionShape::gpu(sms, spec.threads);
        Beside::with_companion(exec, comp, jit, spec, shape).map(Some)
    }

    /// [`Beside::open`] with a companion and a shape of the caller's: tests run the host
    /// executor beside another (two OS threads) on small buffers.
    pub fn with_companion(
        exec: &'e dyn Executor,
        comp: Box<dyn Executor>,
        jit: &Jit,
        spec: BusySpec,
        shape: CompanionShape,
    ) -> Result<Beside<'e>, String> {
        let what = format!("busy kernel {}", KernelSpec::Busy(spec).uri());
        let load = |on: &dyn Executor, spec: KernelSpec| {
            // SAFETY: no hook: the JIT's build of the busy spec's render.
            unsafe { compile_and_load(on, jit, &[spec], true, None, &|| {}) }
                .pop()
                .unwrap_or_else(|| Err("internal: no compile result".into()))
                .map_err(|e| format!("{what}: {e}"))
        };
        let kernel = load(comp.as_ref(), KernelSpec::Busy(spec))?;
        let marker_spec = KernelSpec::Busy(BusySpec::of(BusyKind::Alu));
        let marker_kernel = load(exec, marker_spec)?;
        let mut marker = BusyBench::new(exec, 1).map_err(|e| format!("{what}: marker: {e}"))?;
        let work_stamps = marker
            .mem
            .alloc(MemKind::Device, TRANSFER_STAMP_BYTES, 0)
            .map_err(|e| format!("{what}: the work's stamps: {e}"))?;
        let n = shape.words(spec.kind, spec.threads);
        let out = comp
            .alloc(MemKind::Device, 4 * n as usize, 0)
            .map_err(|e| format!("{what}: buffer: {e}"))?;
        let stamps = match comp.alloc(MemKind::Device, STAMP_BYTES, 0) {
            Ok(s) => s,
            Err(e) => {
                let _ = comp.free(out);
                return Err(format!("{what}: stamps: {e}"));
            }
        };
        let mut b = Beside {
            exec,
            work_stamps,
            marker,
            marker_kernel,
            marker_spec,
            comp,
            kernel,
            spec,
            out,
            stamps,
            n,
            grid: shape.grid.max(1),
            round_seconds: 0.0,
        };
        // A fixed work of calibration: ≈ 4 ms of the ALU kernel on an H200, ≈ 9 ms of the
        // HBM kernel (16 sweeps of 512 MiB read and written at ≈ 1 TB/s).
        let calibration_rounds = match spec.kind {
            BusyKind::Alu => 4096,
            BusyKind::Hbm => 16,
        };
        let alone = b
            .time_alone(calibration_rounds)
            .map_err(|e| format!("{what}: calibration: {e}"))?;
        b.round_seconds = alone / f64::from(calibration_rounds);
        Ok(b)
    }

    /// What this companion keeps busy.
    pub fn kind(&self) -> BusyKind {
        self.spec.kind
    }

    fn launch(&self, rounds: u32) -> Result<(), ExecError> {
        launch_busy(
            self.comp.as_ref(),
            self.kernel,
            LaunchConfig::linear(self.grid, self.spec.threads),
            (self.out, self.n),
            self.stamps,
            rounds,
            0x5EED,
        )
    }

    fn time_alone(&self, rounds: u32) -> Result<f64, ExecError> {
        self.comp.time_work(&mut || self.launch(rounds))
    }

    /// Times `repeats` runs of `work` on the main executor with the busy kernel beside them:
    /// the work's first run is enqueued first (so its blocks are resident), then the busy
    /// kernel on the companion, for about twice `expected` seconds per run. Returns the
    /// work's seconds per run, how much it slowed the busy kernel (timed alone at the same
    /// rounds afterwards), and where the two ran by the device's clock. With `stamped` the
    /// first run is that one, and the work's own block stamps say where it started and
    /// whether every block of it started before the busy kernel's first
    /// ([`Overlap::resident_lead_ns`]); without, the marker's stamp, launched just before the
    /// work, says where it started.
    pub fn time_beside(
        &self,
        expected: f64,
        repeats: u32,
        work: &(dyn Fn() -> Result<(), ExecError> + Sync),
        stamped: Option<StampedRun<'_>>,
    ) -> Result<BesideTiming, ExecError> {
        let repeats = repeats.max(1);
        let span = 2.0 * expected * f64::from(repeats) + 1e-3;
        let rounds = (span / self.round_seconds.max(1e-12)).clamp(1.0, f64::from(u32::MAX)) as u32;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (busy, timed) = std::thread::scope(|s| {
            let busy = s.spawn(move || {
                // The work's first run was enqueued, or it failed (`tx` dropped).
                rx.recv().map_err(|_| ExecError::Driver {
                    op: "busy kernel",
                    message: "not launched: the timed work failed first".into(),
                })?;
                self.comp.time_work(&mut || self.launch(rounds))
            });
            let start = match stamped {
                // A run first, untimed, so the twin's first launch (its module's lazy load
                // on a GPU) is not in the timed runs; then its stamps are reset.
                Some(first) => first(self.work_stamps)
                    .and_then(|()| self.exec.synchronize())
                    .and_then(|()| self.exec.upload(self.work_stamps, 0, &unstamped())),
                None => self
                    .marker
                    .launch(self.marker_kernel, &self.marker_spec, 0, 0),
            };
            let timed = start.and_then(|()| {
                self.exec.time_work(&mut || {
                    for i in 0..repeats {
                        match stamped {
                            Some(first) if i == 0 => first(self.work_stamps)?,
                            _ => work()?,
                        }
                        if i == 0 {
                            let _ = tx.send(());
                        }
                    }
                    Ok(())
                })
            });
            drop(tx);
            let busy = busy.join().unwrap_or_else(|_| {
                Err(ExecError::Driver {
                    op: "busy kernel",
                    message: "the timing thread panicked".into(),
                })
            });
            (busy, timed)
        });
        let (timed, busy) = (timed?, busy?);
        let companion = Stamps::read(self.comp.as_ref(), self.stamps)?;
        let overlap = match stamped {
            Some(_) => {
                let (work, last_start) = Stamps::read_transfer(self.exec, self.work_stamps)?;
                if work.is_sane() {
                    Overlap {
                        resident_lead_ns: companion
                            .is_sane()
                            .then(|| companion.start_ns as i64 - last_start as i64),
                        ..Overlap::of(work.start_ns, timed, companion)
                    }
                } else {
                    // A twin that wrote no stamps: say nothing rather than something wrong.
                    tracing::warn!(target: "cp_hicache::tuning", "the stamped transfer left no stamps: {work:?}");
                    Overlap {
                        start_lag_ns: 0,
                        covered: 0.0,
                        resident_lead_ns: None,
                    }
                }
            }
            None => Overlap::of(self.marker.stamps()?.end_ns, timed, companion),
        };
        let alone = self.time_alone(rounds)?;
        Ok(BesideTiming {
            seconds: timed / f64::from(repeats),
            busy_slowdown: busy / alone.max(1e-12),
            overlap,
        })
    }
}

impl Overlap {
    /// Where a companion launch ran (`companion`) against work that started at `work_start`
    /// ns and took `work_seconds`.
    pub fn of(work_start: u64, work_seconds: f64, companion: Stamps) -> Overlap {
        let work_end = work_start.saturating_add((work_seconds.max(0.0) * 1e9) as u64);
        let (from, to) = (
            work_start.max(companion.start_ns),
            work_end.min(companion.end_ns),
        );
        let span = work_end.saturating_sub(work_start).max(1);
        Overlap {
            resident_lead_ns: None,
            start_lag_ns: companion.start_ns as i64 - work_start as i64,
            covered: if companion.is_sane() {
                to.saturating_sub(from) as f64 / span as f64
            } else {
                0.0
            },
        }
    }
}

impl Drop for Beside<'_> {
    fn drop(&mut self) {
        let _ = self.comp.free(self.stamps);
        let _ = self.comp.free(self.out);
    }
}
