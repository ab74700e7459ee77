//! Tuning per deployment and the performance harness (docs/DESIGN.md §3.6 "Tuning"): launch-shape
//! candidates per kernel family ([`candidate`]), timing them on the executor at hand
//! ([`tuner`]), a tuning file keyed by device, compiler, kernel sources and shape-independent spec key
//! ([`mod@file`], [`key`]), the `bench` measurements with baselines taken in the same run
//! ([`mod@bench`]), and a cross-check of every family against the Rust references ([`check`]).
//!
//! Applying a tuning file is one call ([`warm_up_tuned`] also compiles the tuned kernels):
//!
//! ```no_run
//! use cp_hicache::{kernels::Deployment, tuning};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let exec = cp_hicache::jit::open_executor(cp_hicache::exec::Backend::Auto)?;
//! let jit = cp_hicache::jit::Jit::new(cp_hicache::jit::JitConfig::from_env()?);
//! let device = tuning::DeviceKey::for_executor(exec.as_ref(), &jit)?;
//! let mut dep = Deployment::by_name("nsa_ps64_cp8")?;
//! for line in tuning::warning_lines(&tuning::apply(&mut dep, None, &device)?) {
//!     eprintln!("warning: {line}");
//! }
//! # Ok(()) }
//! ```

pub mod bench;
pub mod candidate;
pub mod check;
pub mod file;
pub mod key;
pub mod measure;
pub mod sweep;
pub mod tuner;

pub use candidate::{candidates_for, Candidate, LaunchChoice, Unsupported};
pub use file::{
    apply, default_path, warning_lines, Applied, BesideBusy, BesideCompanion, CandidateResult,
    Overlap, TuningEntry, TuningFile, TuningWarning, WarningKind, TUNING_FORMAT,
};
pub use key::{spec_key, DeviceKey, KeyMatch};
pub use measure::Sizes;
pub use tuner::{tune, TuneEvent, TuneOptions, Tuned};

use std::path::PathBuf;

/// Errors of tuning, benchmarking and checking; each names the file or kernel concerned.
#[derive(Debug, thiserror::Error)]
pub enum TuningError {
    /// Reading or writing a tuning or output file failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done (`read`, `write`, `rename`, `create dir`).
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A tuning file that cannot be read: missing, a directory, not permitted.
    #[error("cannot read tuning file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A tuning file that is not valid JSON of the expected shape.
    #[error("tuning file {}: {source}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// A tuning file of another format version.
    #[error("tuning file {}: format {found}, this build reads format {expected}", path.display())]
    Format {
        /// The file.
        path: PathBuf,
        /// The version found.
        found: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// Every candidate of a kernel failed to compile, load or run.
    #[error("{spec_key}: no candidate could be timed ({} dropped): {}", reasons.len(), reasons.join("; "))]
    NoCandidate {
        /// The spec key.
        spec_key: String,
        /// Why each candidate was dropped.
        reasons: Vec<String>,
    },
    /// The executor failed outside a candidate (allocating the workload, ...).
    #[error(transparent)]
    Exec(#[from] crate::exec::ExecError),
    /// The JIT failed outside a candidate (no compiler, ...).
    #[error(transparent)]
    Jit(#[from] crate::jit::JitError),
    /// A spec or deployment error.
    #[error(transparent)]
    Kernel(#[from] crate::kernels::KernelError),
    /// A reference implementation refused its input (a harness bug).
    #[error("reference {what}: {message}")]
    Reference {
        /// Which reference.
        what: &'static str,
        /// Its message.
        message: String,
    },
    /// A transfer workload whose pairs name one destination page twice, refused before
    /// anything is allocated or launched (docs/KERNELS.md "transfer_pages").
    #[error("transfer workload: {0}")]
    Transfer(#[from] crate::kernels::DuplicateDestination),
    /// A kernel's output differs from the reference (`bench --check`).
    #[error("{kernel}: output differs from the reference: {detail}")]
    Mismatch {
        /// Kernel uri.
        kernel: String,
        /// First difference.
        detail: String,
    },
}

impl TuningError {
    /// Whether the error is bad input: a bad tuning file (unreadable, not a tuning file,
    /// another format version; the file is the user's, named by `--tuning` or `--out` or kept
    /// in the cache directory) or a misspelt setting, so the CLI exits with status 2.
    pub fn is_usage(&self) -> bool {
        matches!(
            self,
            TuningError::Read { .. }
                | TuningError::Parse { .. }
                | TuningError::Format { .. }
                // A misspelt setting (CP_HICACHE_EMU_SANITIZE, ...) met on the way.
                | TuningError::Jit(crate::jit::JitError::Config { .. })
                | TuningError::Exec(crate::exec::ExecError::Config { .. })
        )
    }
}

/// What an engine's start-up produced: the deployment as tuned for this device, every kernel
/// it needs compiled (or loaded from the JIT cache), and the tuning entries ignored.
#[derive(Debug)]
pub struct TunedStart {
    /// The deployment with the tuning file's launch shapes and transfer path applied.
    pub deployment: crate::kernels::Deployment,
    /// One compiled kernel per spec of `deployment`, in
    /// [`Deployment::specs`](crate::kernels::Deployment::specs) order.
    pub kernels: Vec<crate::jit::CompiledKernel>,
    /// Entries ignored because they were measured elsewhere or do not fit (also logged).
    pub warnings: Vec<TuningWarning>,
}

/// The warm-up API with tuning: applies the tuning file at `path` (or the default
/// `<cache>/tuning.json` when it exists) for `exec`'s device, as [`apply`] does, then
/// compiles every kernel of the tuned deployment for `exec`'s backend in parallel
/// ([`warm_up_deployment`](crate::jit::warm_up_deployment)). A stale or foreign entry is
/// ignored with a warning, never applied; an unreadable explicit file is an error.
pub fn warm_up_tuned(
    jit: &crate::jit::Jit,
    exec: &dyn crate::exec::Executor,
    dep: &crate::kernels::Deployment,
    path: Option<&std::path::Path>,
) -> Result<TunedStart, crate::Error> {
    let device = key::DeviceKey::for_executor(exec, jit)?;
    let mut deployment = dep.clone();
    let warnings = file::apply(&mut deployment, path, &device)?;
    let sanitize = crate::jit::Sanitize::from_env()?;
    let target = crate::jit::target_for(exec, deployment.arch, sanitize)?;
    let kernels = crate::jit::warm_up_deployment(jit, &deployment, target)?;
    Ok(TunedStart {
        deployment,
        kernels,
        warnings,
    })
}
