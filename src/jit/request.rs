//! What a caller asks for: a [`JitRequest`] (uri, source, [`Target`]) and its uri check.

use super::{Arch, JitError, Sanitize};
use std::fmt;

/// What to compile for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// A CUBIN through NVRTC.
    Nvrtc {
        /// GPU architecture.
        arch: Arch,
    },
    /// A shared library through the host C++ compiler, for the CPU-emulation executor.
    Host {
        /// Sanitizer mode.
        sanitize: Sanitize,
    },
}

impl Default for Target {
    fn default() -> Self {
        Target::Nvrtc {
            arch: Arch::default(),
        }
    }
}

impl fmt::Display for Target {
    /// The cache sub-directory name: `sm_90`, `host`, `host-asan`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Nvrtc { arch } => write!(f, "{arch}"),
            Target::Host {
                sanitize: Sanitize::None,
            } => f.write_str("host"),
            Target::Host {
                sanitize: Sanitize::Address,
            } => f.write_str("host-asan"),
        }
    }
}

/// One kernel to compile: a readable name (the entry point), its rendered source and a target.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JitRequest {
    /// Readable kernel name (the spec's `uri()`); a C identifier, used in paths and logs.
    pub uri: String,
    /// The rendered, self-contained source.
    pub source: String,
    /// What to compile it for.
    pub target: Target,
}

/// Checks that a uri is a C identifier (it is the kernel's entry name and a path component).
pub fn validate_uri(uri: &str) -> Result<(), JitError> {
    let bad = |reason: &str| {
        Err(JitError::InvalidUri {
            uri: uri.to_string(),
            reason: reason.to_string(),
        })
    };
    if uri.is_empty() {
        return bad("empty");
    }
    if uri.len() > 160 {
        return bad("longer than 160 characters");
    }
    if uri.starts_with(|c: char| c.is_ascii_digit()) {
        return bad("starts with a digit");
    }
    if !uri.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return bad("only ASCII letters, digits and '_' are allowed");
    }
    Ok(())
}
