//! The busy kernel: its bench, and running it on a companion executor to time other work
//! while the SMs are busy, as an engine's transfers run while the model computes.

use super::compile::compile_and_load;
use super::workload::Owned;
use crate::exec::{BufferId, ExecError, Executor, KernelArg, KernelId, LaunchConfig, MemKind};
use crate::jit::Jit;
use crate::kernels::KernelSpec;

/// The busy kernel's output buffer: `n` words on the device, each thread computing one
/// (docs/KERNELS.md "busy").
pub struct BusyBench<'e> {
    mem: Owned<'e>,
    out: BufferId,
    /// Output words: one per thread of the launch.
    pub n: u32,
}

impl<'e> BusyBench<'e> {
    /// Words enough to fill an H200's 132 SMs at 2048 resident threads each, twice over.
    pub const GPU_WORDS: u32 = 132 * 2048 * 2;

    /// Allocates `n` output words on `exec`'s device, poisoned.
    pub fn new(exec: &'e dyn Executor, n: u32) -> Result<BusyBench<'e>, ExecError> {
        let mut mem = Owned {
            exec,
            ids: Vec::new(),
        };
        let out = mem.alloc(MemKind::Device, 4 * u64::from(n), 0xA5)?;
        Ok(BusyBench { mem, out, n })
    }

    /// The output buffer.
    pub fn out(&self) -> BufferId {
        self.out
    }

    /// Launches `kernel` (compiled from the busy `spec`) for `rounds` rounds per word,
    /// without synchronising.
    pub fn launch(
        &self,
        kernel: KernelId,
        spec: &KernelSpec,
        rounds: u32,
        seed: u32,
    ) -> Result<(), ExecError> {
        let d = spec.launch_dims(self.n, 1);
        let cfg = LaunchConfig::linear(d.grid, d.block);
        self.mem.exec.launch(
            kernel,
            &cfg,
            &[
                KernelArg::Ptr(self.out, 0),
                KernelArg::U32(self.n),
                KernelArg::U32(rounds),
                KernelArg::U32(seed),
            ],
        )
    }
}

/// The busy kernel on a companion executor ([`Executor::companion`]: the same GPU, its own
/// stream), to time work on the main executor while the SMs are busy, as an engine's
/// transfers run while the model computes.
pub struct Beside {
    comp: Box<dyn Executor>,
    kernel: KernelId,
    spec: KernelSpec,
    out: BufferId,
    n: u32,
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
}

impl Beside {
    /// Opens `exec`'s companion and compiles the busy kernel for it. `Ok(None)` when
    /// `exec` has none (the host executor); `Err` says why the busy kernel cannot run.
    pub fn open(exec: &dyn Executor, jit: &Jit) -> Result<Option<Beside>, String> {
        let comp = match exec.companion() {
            Ok(Some(c)) => c,
            Ok(None) => return Ok(None),
            Err(e) => return Err(format!("no companion executor: {e}")),
        };
        let spec = KernelSpec::Busy(crate::kernels::BusySpec::default());
        // SAFETY: no hook: the JIT's build of the busy spec's render.
        let kernel = unsafe { compile_and_load(comp.as_ref(), jit, &[spec], true, None, &|| {}) }
            .pop()
            .unwrap_or_else(|| Err("internal: no compile result".into()))
            .map_err(|e| format!("busy kernel: {e}"))?;
        let n = BusyBench::GPU_WORDS;
        let out = comp
            .alloc(MemKind::Device, 4 * n as usize, 0)
            .map_err(|e| format!("busy kernel buffer: {e}"))?;
        let mut b = Beside {
            comp,
            kernel,
            spec,
            out,
            n,
            round_seconds: 0.0,
        };
        const CALIBRATION_ROUNDS: u32 = 4096;
        let alone = b
            .time_alone(CALIBRATION_ROUNDS)
            .map_err(|e| format!("busy kernel calibration: {e}"))?;
        b.round_seconds = alone / f64::from(CALIBRATION_ROUNDS);
        Ok(Some(b))
    }

    fn launch(&self, rounds: u32) -> Result<(), ExecError> {
        let d = self.spec.launch_dims(self.n, 1);
        self.comp.launch(
            self.kernel,
            &LaunchConfig::linear(d.grid, d.block),
            &[
                KernelArg::Ptr(self.out, 0),
                KernelArg::U32(self.n),
                KernelArg::U32(rounds),
                KernelArg::U32(0x5EED),
            ],
        )
    }

    fn time_alone(&self, rounds: u32) -> Result<f64, ExecError> {
        self.comp.time_work(&mut || self.launch(rounds))
    }

    /// Runs the busy kernel for about twice `expected` seconds on the companion and times
    /// `repeats` runs of `work` on `exec` meanwhile: the work's seconds per run, and how much
    /// it slowed the busy kernel (timed alone at the same rounds afterwards).
    pub fn time_beside(
        &self,
        exec: &dyn Executor,
        expected: f64,
        repeats: u32,
        work: &(dyn Fn() -> Result<(), ExecError> + Sync),
    ) -> Result<BesideTiming, ExecError> {
        let repeats = repeats.max(1);
        let span = 2.0 * expected * f64::from(repeats) + 1e-3;
        let rounds = (span / self.round_seconds.max(1e-12)).clamp(1.0, f64::from(u32::MAX)) as u32;
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (busy, timed) = std::thread::scope(|s| {
            let busy = s.spawn(move || {
                self.comp.time_work(&mut || {
                    let r = self.launch(rounds);
                    // The work starts once the busy kernel is enqueued (or failed to be).
                    let _ = tx.send(());
                    r
                })
            });
            let _ = rx.recv();
            let timed = exec.time_work(&mut || (0..repeats).try_for_each(|_| work()));
            let busy = busy.join().unwrap_or_else(|_| {
                Err(ExecError::Driver {
                    op: "busy kernel",
                    message: "the timing thread panicked".into(),
                })
            });
            (busy, timed)
        });
        let (busy, timed) = (busy?, timed?);
        let alone = self.time_alone(rounds)?;
        Ok(BesideTiming {
            seconds: timed / f64::from(repeats),
            busy_slowdown: busy / alone.max(1e-12),
        })
    }
}

impl Drop for Beside {
    fn drop(&mut self) {
        let _ = self.comp.free(self.out);
    }
}
