//! The crate-level error: one variant per module error, so callers can match on the concern
//! that failed while `?` works across modules.

use crate::cluster::ClusterError;
use crate::exec::ExecError;
use crate::hicache::tree::TreeError;
use crate::{
    allocator::AllocError,
    jit::{JitError, WarmUpError},
    kernels::KernelError,
    layout::LayoutError,
    metadata::MetadataError,
};

/// Any error cp-hicache reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An invalid layout or a value outside it.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// Invalid node metadata or a malformed encoding.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// An allocator shortage or misuse.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// A radix-tree operation was refused.
    #[error(transparent)]
    Tree(#[from] TreeError),
    /// A host page pool misuse.
    #[error(transparent)]
    HostPool(#[from] crate::hicache::host_pool::HostPoolError),
    /// The reference decode step refused its input.
    #[error(transparent)]
    Decode(#[from] crate::hicache::decode::DecodeError),
    /// The kernel-backed allocator failed (a launch, an upload, or a misuse).
    #[error(transparent)]
    KernelAlloc(#[from] crate::allocator::KernelAllocError),
    /// A kernel could not be compiled or loaded from the JIT cache.
    #[error(transparent)]
    Jit(#[from] JitError),
    /// The cluster could not be built or could not serve a request.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// An executor could not be opened or failed.
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// A kernel spec, deployment or render-tree error.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// A deployment warm-up failed (every failing kernel is listed).
    #[error(transparent)]
    WarmUp(#[from] WarmUpError),
    /// Tuning, benchmarking or a tuning file failed.
    #[error(transparent)]
    Tuning(#[from] crate::tuning::TuningError),
    /// A workload could not be read: a trace that cannot be opened or has a bad line, or an
    /// invalid workload setting. Always the user's input.
    #[error(transparent)]
    Workload(#[from] crate::workload::WorkloadError),
    /// Invalid command-line input that clap could not catch.
    #[error("{0}")]
    Usage(String),
    /// An I/O error, with what was being done.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl Error {
    /// Whether the error is the user's input (exit status 2) rather than a failure (1).
    pub fn is_usage(&self) -> bool {
        match self {
            Error::Usage(_) | Error::Layout(_) => true,
            // A trace that cannot be found or opened is the user's input; a read that fails
            // part way (EIO) is a failure.
            Error::Workload(crate::workload::WorkloadError::Io { source, .. }) => matches!(
                source.kind(),
                std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::PermissionDenied
                    | std::io::ErrorKind::IsADirectory
                    | std::io::ErrorKind::InvalidInput
            ),
            Error::Workload(_) => true,
            Error::Tuning(e) => e.is_usage(),
            // A misspelt environment variable or option value is the user's input too.
            Error::Exec(crate::exec::ExecError::Config { .. })
            | Error::Jit(crate::jit::JitError::Config { .. }) => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::WorkloadError;

    #[test]
    fn a_failed_trace_read_is_a_failure_but_a_missing_trace_is_input() {
        let io = |kind| -> Error {
            WorkloadError::Io {
                path: "t.jsonl".into(),
                source: std::io::Error::from(kind),
            }
            .into()
        };
        assert!(io(std::io::ErrorKind::NotFound).is_usage());
        assert!(io(std::io::ErrorKind::PermissionDenied).is_usage());
        assert!(!io(std::io::ErrorKind::Other).is_usage());
    }

    /// A workload error keeps its type through `?` and is the user's input (exit status 2).
    #[test]
    fn workload_errors_keep_their_type_and_are_usage() {
        let e: Error = WorkloadError::BadLine {
            path: "t.jsonl".into(),
            line: 3,
            message: "bad".into(),
        }
        .into();
        assert!(matches!(
            e,
            Error::Workload(WorkloadError::BadLine { line: 3, .. })
        ));
        assert!(e.is_usage());
        assert_eq!(e.to_string(), "t.jsonl:3: bad");
        let e: Error = WorkloadError::Config("x".into()).into();
        assert!(e.is_usage());
    }
}
