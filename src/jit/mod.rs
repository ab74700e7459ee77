//! The JIT: decides what to compile and where it comes from. A request (readable `uri`, rendered
//! source, target) is answered from the in-memory map, else from the on-disk cache, else by
//! compiling it (NVRTC → CUBIN, or the host C++ compiler → `.so`) and committing the result.
//!
//! Every event is logged with `tracing` (target `cp_hicache::jit`): uri, target, key prefix,
//! outcome (memory / disk hit, miss, corrupt), milliseconds and cache path. Events that end
//! in a returned error are logged at `debug`: the error itself reaches the caller, and a
//! command-line user sees it once.
//! `CP_HICACHE_JIT=off` ([`JitMode::Off`]) turns a cache miss into [`JitError::JitOff`], for
//! prebuilt-only deployments. With JIT off and no NVRTC at all, committed NVRTC entries are
//! still found: an entry is used when it is the only one that reproduces its own key from the
//! request under the compiler its manifest names (see [`Jit::get`]).
//!
//! A warm start does not load NVRTC: its identity (a key input: version and a short SHA-256 of
//! the library file) is remembered per library file in `<cache>/nvrtc-identity.v2.json`
//! ([`Jit::nvrtc_identity`]) and confirmed on the first miss.
//!
//! Thread-safety: [`Jit`] is `Send + Sync`; share it by reference or `Arc`. Concurrent requests
//! for the same entry, from threads or processes, compile it once (per-entry `flock`).
//!
//! The JIT is the top of the one-way order `exec` ← `kernels` ← `jit` (DESIGN.md §1.2): it
//! compiles the kernels' renders for the executors and uses both; neither imports it
//! ([`Arch`] is the kernels', re-exported here).

pub mod cache;
pub mod deployment;
pub mod hostcc;
pub mod key;
pub mod nvrtc;
pub mod options;

pub use cache::{CacheError, DiskCache};
pub use deployment::{
    break_source, deployment_requests, deployment_target, spec_request, target_for,
    warm_up_deployment, warm_up_deployment_each, KernelOutcome, SourceHook, WarmUpError,
};
pub use hostcc::{HostCcError, HostCompiler};
pub use key::CacheKey;
pub use nvrtc::{NvrtcCompiler, NvrtcError, ResourceReport};
pub use options::{Arch, HostCcOptions, NvrtcOptions, Sanitize, SANITIZE_ENV};

mod config;
mod driver;
mod error;
mod identity;
mod kernel;
mod open;
mod request;

pub use config::{JitConfig, JitMode, EMU_HEADER, JIT_ENV};
pub use driver::Jit;
pub use error::JitError;
pub use identity::NVRTC_IDENTITY_FILE;
pub use kernel::{Artifact, CacheHit, CompiledKernel};
pub use open::open_executor;
pub use request::{validate_uri, JitRequest, Target};

#[cfg(test)]
mod tests;
