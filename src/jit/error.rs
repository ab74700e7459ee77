//! [`JitError`] and its conversions from the compilers' errors, shared by every part of the JIT.

use super::{nvrtc, CacheError, HostCcError, NvrtcError};
use std::path::PathBuf;
use std::sync::Arc;

/// Errors of the JIT, each naming the kernel's readable uri where there is one.
#[derive(Debug, Clone, thiserror::Error)]
pub enum JitError {
    /// The uri is not a C identifier of reasonable length.
    #[error("invalid kernel uri {uri:?}: {reason}")]
    InvalidUri {
        /// The offending uri.
        uri: String,
        /// Why.
        reason: String,
    },
    /// NVRTC could not be found or loaded.
    #[error("{} (searched: {})", nvrtc::unavailable_hint(requested.as_deref()), searched.join(", "))]
    NvrtcUnavailable {
        /// Every place looked at.
        searched: Vec<String>,
        /// When `CP_HICACHE_NVRTC` is set: why the library it names could not be used
        /// ([`nvrtc::NvrtcError::Unavailable`]).
        requested: Option<String>,
    },
    /// NVRTC rejected the source.
    #[error("NVRTC failed to compile `{uri}` with {options:?}:\n{log}")]
    Nvrtc {
        /// Readable kernel name.
        uri: String,
        /// Options used.
        options: Vec<String>,
        /// Full compiler log.
        log: String,
    },
    /// An NVRTC API call failed, or the input could not be passed to NVRTC.
    #[error("NVRTC error for `{uri}`: {detail}")]
    NvrtcCall {
        /// Readable kernel name.
        uri: String,
        /// What failed.
        detail: String,
    },
    /// The host compiler could not be run.
    #[error("host C++ compiler `{program}` is not usable: {reason}")]
    HostCcUnavailable {
        /// The program.
        program: String,
        /// Why.
        reason: String,
    },
    /// The host compiler rejected the source.
    #[error("host compile of `{uri}` failed ({status}): {cmd}\n{stderr}")]
    HostCc {
        /// Readable kernel name.
        uri: String,
        /// Full command line.
        cmd: String,
        /// Exit status.
        status: String,
        /// Compiler diagnostics.
        stderr: String,
    },
    /// The on-disk cache failed.
    #[error("JIT cache error for `{uri}`: {source}")]
    Cache {
        /// Readable kernel name.
        uri: String,
        /// The cache error.
        source: Arc<CacheError>,
    },
    /// An environment setting of the JIT has an unusable value.
    #[error("{name}={value:?}: {reason}")]
    Config {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
        /// What is expected.
        reason: String,
    },
    /// A cache entry for the kernel fails its integrity check while JIT compilation is off:
    /// it is left as it is (a prebuilt cache is never modified) and reported, not rebuilt.
    #[error("kernel `{uri}`: cache entry {path} is corrupt ({reason}) and CP_HICACHE_JIT=off forbids rebuilding it; restore the prebuilt cache or enable JIT")]
    CorruptEntry {
        /// Readable kernel name.
        uri: String,
        /// The entry directory.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A cache miss while JIT compilation is off.
    #[error("kernel `{uri}` ({key}) is not in the cache at {path} and CP_HICACHE_JIT=off forbids compiling it; fill the cache with `cp-hicache compile` (and `bench --prebuild`) on a machine with the same compiler, crate version and compiler environment, or unset CP_HICACHE_JIT")]
    JitOff {
        /// Readable kernel name.
        uri: String,
        /// Readable key.
        key: String,
        /// The entry directory that was expected.
        path: PathBuf,
    },
}

impl JitError {
    /// True when a compiler is missing (not a bug in the source).
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            JitError::NvrtcUnavailable { .. } | JitError::HostCcUnavailable { .. }
        )
    }

    /// True for a miss refused by [`JitMode::Off`](super::JitMode::Off).
    pub fn is_jit_off(&self) -> bool {
        matches!(self, JitError::JitOff { .. })
    }

    /// True for a corrupt cache entry refused by [`JitMode::Off`](super::JitMode::Off).
    pub fn is_corrupt(&self) -> bool {
        matches!(self, JitError::CorruptEntry { .. })
    }

    /// True when the source failed to compile.
    pub fn is_compile_error(&self) -> bool {
        matches!(self, JitError::Nvrtc { .. } | JitError::HostCc { .. })
    }
}

impl From<NvrtcError> for JitError {
    fn from(e: NvrtcError) -> Self {
        match e {
            NvrtcError::Unavailable {
                searched,
                requested,
            } => JitError::NvrtcUnavailable {
                searched,
                requested,
            },
            NvrtcError::Compile { uri, options, log } => JitError::Nvrtc { uri, options, log },
            NvrtcError::Api { uri, call, code } => JitError::NvrtcCall {
                uri,
                detail: format!("{call} returned {code}"),
            },
            NvrtcError::Nul { uri } => JitError::NvrtcCall {
                uri,
                detail: "source or option contains a NUL byte".to_string(),
            },
        }
    }
}

impl From<HostCcError> for JitError {
    fn from(e: HostCcError) -> Self {
        match e {
            HostCcError::Unavailable { program, reason } => {
                JitError::HostCcUnavailable { program, reason }
            }
            HostCcError::Compile {
                uri,
                cmd,
                status,
                stderr,
            } => JitError::HostCc {
                uri,
                cmd,
                status,
                stderr,
            },
            HostCcError::Io { uri, path, reason } => JitError::HostCc {
                uri,
                cmd: String::new(),
                status: "I/O error".to_string(),
                stderr: format!("{}: {reason}", path.display()),
            },
        }
    }
}
