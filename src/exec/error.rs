//! The executors' errors: [`ExecError`] and the classified cause of a failed launch
//! ([`LaunchFailure`]), kept apart so every executor and caller shares one error vocabulary.

use std::fmt;

#[cfg(doc)]
use super::Executor;
use super::{Backend, BufferId, CopyRegion, KernelId, MemKind};

/// Errors of the executors. Every variant carries enough context to be reported as is.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The backend cannot be used on this machine (no driver, no device, no library).
    #[error("{backend} executor unavailable: {reason}")]
    Unavailable {
        /// Which backend was asked for.
        backend: Backend,
        /// Why it cannot be used.
        reason: String,
    },
    /// A buffer could not be allocated.
    #[error("cannot allocate {bytes} bytes of {kind} memory: {reason}")]
    Alloc {
        /// Requested size.
        bytes: usize,
        /// Device or host memory.
        kind: MemKind,
        /// Underlying reason.
        reason: String,
    },
    /// A buffer handle that this executor does not know (freed, or from another executor).
    #[error("unknown buffer {0:?}")]
    UnknownBuffer(BufferId),
    /// A read, upload or pointer argument outside a buffer.
    #[error("{op} of {len} bytes at offset {offset} is outside buffer {buffer:?} of {size} bytes")]
    OutOfBounds {
        /// The operation (`read`, `upload`, `kernel argument`).
        op: &'static str,
        /// The buffer.
        buffer: BufferId,
        /// Start offset in bytes.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Buffer size in bytes.
        size: usize,
    },
    /// A kernel artifact could not be loaded, or its entry point was not found.
    #[error("cannot load kernel `{entry}` from {artifact}: {message}")]
    Load {
        /// Entry (kernel) name.
        entry: String,
        /// Where the artifact came from (a path, or "CUBIN (N bytes)").
        artifact: String,
        /// Loader message.
        message: String,
    },
    /// An artifact kind that this executor does not run (a CUBIN on the host executor, ...).
    #[error("{backend} executor cannot load {artifact}")]
    WrongArtifact {
        /// The executor's backend.
        backend: Backend,
        /// The artifact kind offered.
        artifact: &'static str,
    },
    /// A kernel handle that this executor does not know.
    #[error("unknown kernel {0:?}")]
    UnknownKernel(KernelId),
    /// A launch failed: bad configuration, deadlock or mismatched intrinsics in the emulator,
    /// a driver error, or an injected fault.
    #[error("launch of kernel `{kernel}` failed ({cause}): {message}")]
    Launch {
        /// Kernel (entry) name.
        kernel: String,
        /// Classified cause.
        cause: LaunchFailure,
        /// Diagnostic from the emulator or the driver.
        message: String,
    },
    /// A configuration value (environment variable, option) is invalid.
    #[error("invalid {name} `{value}`: {reason}")]
    Config {
        /// Option or variable name.
        name: &'static str,
        /// The value found.
        value: String,
        /// What is accepted.
        reason: String,
    },
    /// A copy region whose source and destination overlap inside one buffer.
    #[error("copy in buffer {buffer:?} overlaps itself: {region}")]
    OverlappingCopy {
        /// The buffer.
        buffer: BufferId,
        /// The offending region.
        region: CopyRegion,
    },
    /// The executor cannot do what was asked (adopting memory it did not allocate, on a
    /// backend without that yet).
    #[error("{backend} executor: {what} is not supported")]
    NotSupported {
        /// The executor's backend.
        backend: Backend,
        /// What was asked.
        what: &'static str,
    },
    /// A peer mapping could not be made: the executor has none, or a handle that does not
    /// name a live shareable buffer.
    #[error("peer mapping ({op}): {message}")]
    Peer {
        /// `alloc_shareable`, `export` or `import`.
        op: &'static str,
        /// Why.
        message: String,
    },
    /// A CUDA IPC handle opened in the process that exported it. CUDA refuses that
    /// (`cuIpcOpenMemHandle` fails with `CUDA_ERROR_INVALID_CONTEXT`), so the executor does
    /// not try: ranks in one process share one executor and reach each other's buffers
    /// directly ([`PeerAccess::Direct`](crate::rank::PeerAccess::Direct)); IPC is for ranks
    /// in separate processes.
    #[error(
        "peer mapping (import): buffer {buffer:?} was exported by this process (pid {pid}); \
         a CUDA IPC handle cannot be opened in the process that made it, so ranks in one \
         process must share one executor and reach each other's pools directly"
    )]
    IpcSameProcess {
        /// The exporter's buffer.
        buffer: BufferId,
        /// This process.
        pid: u32,
    },
    /// An error reported by the CUDA driver outside a launch.
    #[error("CUDA driver error in {op}: {message}")]
    Driver {
        /// Operation that failed.
        op: &'static str,
        /// Driver message.
        message: String,
    },
}

impl ExecError {
    /// True for the executor-unavailable error (callers fall back to another backend).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ExecError::Unavailable { .. })
    }

    /// The launch failure cause, if this is a launch error.
    pub fn launch_failure(&self) -> Option<LaunchFailure> {
        match self {
            ExecError::Launch { cause, .. } => Some(*cause),
            _ => None,
        }
    }
}

/// Why a launch failed; lets callers and tests tell a deadlock from a bad configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LaunchFailure {
    /// Launch shape, parameter count or parameter sizes rejected.
    InvalidConfig,
    /// No thread could proceed (for example `__syncthreads` in divergent code).
    Deadlock,
    /// Threads of one group met at different intrinsics or masks.
    Mismatch,
    /// A warp intrinsic's mask did not contain the calling lane.
    BadMask,
    /// The executor ran out of memory for the launch (fiber stacks).
    OutOfMemory,
    /// The kernel called `__trap()`.
    Trap,
    /// A fault injected with [`Executor::inject_launch_failure`].
    Injected,
    /// Anything else (driver error, unknown status).
    Other,
}

impl fmt::Display for LaunchFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchFailure::InvalidConfig => "invalid configuration",
            LaunchFailure::Deadlock => "deadlock",
            LaunchFailure::Mismatch => "mismatched intrinsics",
            LaunchFailure::BadMask => "bad warp mask",
            LaunchFailure::OutOfMemory => "out of memory",
            LaunchFailure::Trap => "trap",
            LaunchFailure::Injected => "injected fault",
            LaunchFailure::Other => "error",
        })
    }
}
