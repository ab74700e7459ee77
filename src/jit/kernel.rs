//! What the JIT answers with: [`CompiledKernel`], its [`Artifact`] and how an executor loads it.

use super::{CacheKey, ResourceReport, Target};
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

/// A compiled kernel binary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Artifact {
    /// CUBIN bytes, ready for `cuModuleLoadData`.
    Cubin(Arc<[u8]>),
    /// Path of a shared library inside the cache, ready to `dlopen`. It stays a file because
    /// the loader needs one.
    SharedObject(PathBuf),
}

/// Where a result came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheHit {
    /// Compiled by this call.
    Miss,
    /// Loaded from the on-disk cache.
    Disk,
    /// Served from this process's in-memory map.
    Memory,
}

impl CacheHit {
    /// True for disk and memory hits.
    pub fn is_hit(self) -> bool {
        self != CacheHit::Miss
    }
}

impl fmt::Display for CacheHit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CacheHit::Miss => "miss",
            CacheHit::Disk => "disk-hit",
            CacheHit::Memory => "memory-hit",
        })
    }
}

/// The answer to a [`JitRequest`](super::JitRequest).
#[derive(Debug, Clone)]
pub struct CompiledKernel {
    /// Readable kernel name.
    pub uri: String,
    /// What it was compiled for.
    pub target: Target,
    /// The binary.
    pub artifact: Artifact,
    /// ptxas resources (NVRTC targets only).
    pub report: Option<ResourceReport>,
    /// Milliseconds this request spent producing the artifact (compile on a miss, load and
    /// verify on a hit).
    pub compile_ms: f64,
    /// Where it came from.
    pub cache_hit: CacheHit,
    /// The content key.
    pub key: CacheKey,
    /// The cache entry directory.
    pub entry_dir: PathBuf,
}

impl CompiledKernel {
    /// The artifact as an executor loads it, with the kernel's entry name and, for a kernel
    /// rendered from a spec, its launch signature (checked on every launch). Spec kernels
    /// are easiest loaded with [`CompiledKernel::load_spec`]; `None` is for kernels that are
    /// not rendered from a spec.
    pub fn executor_artifact<'a>(
        &'a self,
        entry: &'a str,
        signature: Option<&'a crate::kernels::KernelSignature>,
    ) -> crate::exec::KernelArtifact<'a> {
        match &self.artifact {
            Artifact::SharedObject(path) => crate::exec::KernelArtifact::HostLibrary {
                path,
                entry,
                signature,
            },
            Artifact::Cubin(image) => crate::exec::KernelArtifact::Cubin {
                image,
                entry,
                signature,
            },
        }
    }

    /// Loads this kernel, compiled from `spec`'s render, into `exec` under the spec's entry
    /// name and with its launch signature, so that every launch's shape and arguments are checked
    /// against [`KernelSpec::signature`](crate::kernels::KernelSpec::signature) on either
    /// executor.
    ///
    /// # Safety
    ///
    /// `self` must be as [`Jit`] returned it (its public fields unchanged), compiled from
    /// `spec`'s render for `exec`'s target: then its artifact is a kernel library or image the
    /// JIT built for that executor, which is the contract of
    /// [`Executor::load_kernel`](crate::exec::Executor::load_kernel).
    ///
    /// [`Jit`]: super::Jit
    pub unsafe fn load_spec(
        &self,
        exec: &dyn crate::exec::Executor,
        spec: &crate::kernels::KernelSpec,
    ) -> Result<crate::exec::KernelId, crate::exec::ExecError> {
        let entry = spec.entry_name();
        let signature = spec.signature();
        // SAFETY: the artifact is one the JIT built for `exec` (guaranteed by the caller).
        unsafe { exec.load_kernel(&self.executor_artifact(&entry, Some(&signature))) }
    }
}
