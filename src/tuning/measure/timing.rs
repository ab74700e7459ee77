//! Workload sizes and timing: median-of-repeats on the host clock or the executor's own
//! (CUDA events), the statistics every bench, the tuner and the baselines report.

use std::time::Instant;

use crate::exec::{ExecError, Executor};

/// Workload sizes of one measurement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Sizes {
    /// Pages (page pairs for transfers, sequence pages for materialise) per launch.
    pub pages: u32,
    /// Layers per launch.
    pub layers: u32,
    /// Untimed launches first.
    pub warmup: u32,
    /// Timed launches; the median is reported.
    pub repeats: u32,
}

impl Sizes {
    /// Realistic sizes: 256 pages × 4 layers, 1 warm-up, median of 7.
    pub fn full() -> Sizes {
        Sizes {
            pages: 256,
            layers: 4,
            warmup: 1,
            repeats: 7,
        }
    }

    /// Short runs: 128 pages × 2 layers, 1 warm-up, median of 3.
    pub fn quick() -> Sizes {
        Sizes {
            pages: 128,
            layers: 2,
            warmup: 1,
            repeats: 3,
        }
    }

    /// Short description for tables and tuning entries.
    pub fn describe(&self) -> String {
        format!(
            "pages={} layers={} warmup={} repeats={}",
            self.pages, self.layers, self.warmup, self.repeats
        )
    }
}

/// Median and minimum seconds of the timed repeats.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Median seconds.
    pub median: f64,
    /// Fastest repeat.
    pub min: f64,
}

impl Timing {
    /// The median (the mean of the two middle samples for an even count) and the minimum of
    /// at least one sample.
    pub(super) fn of(mut samples: Vec<f64>) -> Timing {
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        let median = if n % 2 == 0 {
            (samples[n / 2 - 1] + samples[n / 2]) / 2.0
        } else {
            samples[n / 2]
        };
        Timing {
            median,
            min: samples[0],
        }
    }
}

/// Runs `setup` then times `run`, `warmup` untimed and `repeats` timed times (at least one).
pub fn time_with<E>(
    warmup: u32,
    repeats: u32,
    mut setup: impl FnMut() -> Result<(), E>,
    mut run: impl FnMut() -> Result<(), E>,
) -> Result<Timing, E> {
    for _ in 0..warmup {
        setup()?;
        run()?;
    }
    let mut samples = Vec::with_capacity(repeats.max(1) as usize);
    for _ in 0..repeats.max(1) {
        setup()?;
        let t = Instant::now();
        run()?;
        samples.push(t.elapsed().as_secs_f64());
    }
    Ok(Timing::of(samples))
}

/// Like [`time_with`] for work enqueued on `exec`: each timed repeat is measured by the
/// executor ([`Executor::time_work`]: CUDA events on a GPU), so the untimed `setup` stays out
/// of the numbers. At least one warm-up runs whatever `warmup` says: a first launch may load
/// the module lazily (CUDA) or fault in fresh pages (host).
pub fn time_device(
    exec: &dyn Executor,
    warmup: u32,
    repeats: u32,
    mut setup: impl FnMut() -> Result<(), ExecError>,
    mut run: impl FnMut() -> Result<(), ExecError>,
) -> Result<Timing, ExecError> {
    for _ in 0..warmup.max(1) {
        setup()?;
        run()?;
        exec.synchronize()?;
    }
    let mut samples = Vec::with_capacity(repeats.max(1) as usize);
    for _ in 0..repeats.max(1) {
        setup()?;
        samples.push(exec.time_work(&mut run)?);
    }
    Ok(Timing::of(samples))
}

/// [`time_device`] at `sizes`' warm-up and repeats, for work that needs no setup per repeat.
pub(super) fn time_sized(
    exec: &dyn Executor,
    sizes: &Sizes,
    run: impl FnMut() -> Result<(), ExecError>,
) -> Result<Timing, ExecError> {
    time_device(exec, sizes.warmup, sizes.repeats, || Ok(()), run)
}

/// [`time_sized`], and the host's time submitting each timed repeat (`run` alone, on the
/// host clock): the device's median and the submissions' median. A batch of many copies can
/// keep the host busier than the device.
pub(super) fn time_submitted(
    exec: &dyn Executor,
    sizes: &Sizes,
    mut run: impl FnMut() -> Result<(), ExecError>,
) -> Result<(Timing, Timing), ExecError> {
    let mut submits = Vec::new();
    let device = time_sized(exec, sizes, || {
        let t = Instant::now();
        let out = run();
        submits.push(t.elapsed().as_secs_f64());
        out
    })?;
    // The warm-ups ran first: the last `repeats` submissions are the timed ones.
    let timed = submits.split_off(submits.len().saturating_sub(sizes.repeats.max(1) as usize));
    Ok((device, Timing::of(timed)))
}
