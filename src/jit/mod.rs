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

use cache::{Lookup, Manifest, NewEntry};
use key::KeyInputs;
use rayon::prelude::*;
use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock, RwLock};
use std::time::Instant;

/// The CUDA-emulation header force-included in host builds (`templates/cuda_emu.h`), compiled
/// into the binary so a deployment never reads the source tree at run time.
pub const EMU_HEADER: &str = include_str!("../../templates/cuda_emu.h");

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

/// The answer to a [`JitRequest`].
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

/// Environment variable that turns compiling off (`CP_HICACHE_JIT=off`).
pub const JIT_ENV: &str = "CP_HICACHE_JIT";

/// Whether cache misses may compile.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum JitMode {
    /// Compile on a miss.
    #[default]
    On,
    /// A miss is an error (prebuilt-only deployments).
    Off,
}

impl JitMode {
    /// `CP_HICACHE_JIT=off` (or `0`, `false`, `no`) → `Off`; unset, empty, `on`, `1`, `true`,
    /// `yes` → `On`. Anything else is [`JitError::Config`]: a misspelt `off` must not quietly
    /// let a prebuilt-only deployment compile.
    pub fn from_env() -> Result<JitMode, JitError> {
        let v = match std::env::var(JIT_ENV) {
            Ok(v) => v,
            Err(std::env::VarError::NotPresent) => return Ok(JitMode::On),
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(JitError::Config {
                    name: JIT_ENV,
                    value: v.to_string_lossy().into_owned(),
                    reason: "not valid UTF-8".to_string(),
                })
            }
        };
        if v.trim().is_empty() {
            return Ok(JitMode::On);
        }
        match crate::env::parse_switch(&v) {
            Some(true) => Ok(JitMode::On),
            Some(false) => Ok(JitMode::Off),
            None => Err(JitError::Config {
                name: JIT_ENV,
                value: v,
                reason: "expected off (0, false, no) or on (1, true, yes)".to_string(),
            }),
        }
    }
}

/// Everything a [`Jit`] needs; built once, not re-read afterwards.
///
/// The settings that change what a kernel's render compiles into (the compiler options, the
/// host compiler and the emulation header) are private, set only through `unsafe` setters:
/// the safe loaders ([`DeploymentKernels::load`](crate::cluster::DeploymentKernels::load),
/// the kernel-backed allocator, `tune`, `bench`) load what this JIT builds under the spec's
/// signature, and a safe [`Executor::launch`](crate::exec::Executor::launch) trusts the code to
/// stay within it. What the process environment names (`$CXX`, `CP_HICACHE_NVRTC`, the cache
/// directory and its prebuilt entries) is trusted the same way a library search path is.
#[derive(Debug, Clone)]
pub struct JitConfig {
    /// Root of the on-disk cache.
    pub cache_dir: PathBuf,
    /// Whether misses may compile.
    pub mode: JitMode,
    /// How long one host compile may run before it is killed (the identity probes get at most
    /// [`hostcc::PROBE_TIMEOUT`])
    /// ([`hostcc::DEFAULT_COMPILE_TIMEOUT`], `CP_HICACHE_COMPILE_TIMEOUT` seconds).
    pub compile_timeout: std::time::Duration,
    /// Allow-listed environment snapshot that goes into every key.
    pub env: Vec<(String, Option<String>)>,
    /// Whether NVRTC may be loaded. `false` behaves exactly as if NVRTC were not installed
    /// (tests of prebuilt-only deployments use it instead of changing the process environment).
    pub nvrtc_enabled: bool,
    /// NVRTC options (the arch comes from each request).
    nvrtc: NvrtcOptions,
    /// Host compiler options (the sanitizer mode comes from each request).
    host: HostCcOptions,
    /// Host compiler program; `None` → `$CXX`, else `c++`.
    cxx: Option<String>,
    /// The CUDA-emulation header text force-included in host builds.
    emu_header: String,
}

impl JitConfig {
    /// A config with default options, the project's [`EMU_HEADER`], JIT on, and the current
    /// allow-listed environment.
    pub fn new(cache_dir: impl Into<PathBuf>) -> JitConfig {
        JitConfig {
            cache_dir: cache_dir.into(),
            mode: JitMode::On,
            compile_timeout: hostcc::DEFAULT_COMPILE_TIMEOUT,
            env: key::capture_env(key::KEY_ENV_ALLOWLIST),
            nvrtc_enabled: true,
            nvrtc: NvrtcOptions::default(),
            host: HostCcOptions::default(),
            cxx: None,
            emu_header: EMU_HEADER.to_string(),
        }
    }

    /// NVRTC options (the arch comes from each request).
    pub fn nvrtc(&self) -> &NvrtcOptions {
        &self.nvrtc
    }

    /// Host compiler options (the sanitizer mode comes from each request).
    pub fn host(&self) -> &HostCcOptions {
        &self.host
    }

    /// Host compiler program; `None` → `$CXX`, else `c++`.
    pub fn cxx(&self) -> Option<&str> {
        self.cxx.as_deref()
    }

    /// The CUDA-emulation header text force-included in host builds.
    pub fn emu_header(&self) -> &str {
        &self.emu_header
    }

    /// Replaces the NVRTC options.
    ///
    /// # Safety
    ///
    /// Every spec's render must still compile into code that does what the render says, so
    /// that it stays within its signature's [`Reach`](crate::kernels::Reach): another
    /// optimisation level, line info or a register cap is fine; a `-D` that redefines a
    /// keyword or a name the kernels use is not.
    pub unsafe fn set_nvrtc(&mut self, options: NvrtcOptions) {
        self.nvrtc = options;
    }

    /// Replaces the host compiler options.
    ///
    /// # Safety
    ///
    /// As for [`set_nvrtc`](Self::set_nvrtc), for host builds.
    pub unsafe fn set_host(&mut self, options: HostCcOptions) {
        self.host = options;
    }

    /// Sets the host compiler program (`None`: `$CXX`, else `c++`).
    ///
    /// # Safety
    ///
    /// It must be a C++ compiler that builds each render as written: the shared objects it
    /// makes are loaded into this process and launched as the spec's kernels.
    pub unsafe fn set_cxx(&mut self, program: Option<String>) {
        self.cxx = program;
    }

    /// Replaces the CUDA-emulation header.
    ///
    /// # Safety
    ///
    /// The header must implement the CUDA subset as [`EMU_HEADER`] does (docs/KERNELS.md
    /// "Host emulation"): it is compiled into every host kernel, whose loading runs its
    /// initialisers, and whose launches the executor trusts to stay within the spec's
    /// signature.
    pub unsafe fn set_emu_header(&mut self, header: impl Into<String>) {
        self.emu_header = header.into();
    }

    /// A config from the process environment: `CP_HICACHE_CACHE_DIR`, `CP_HICACHE_JIT` and
    /// `CP_HICACHE_COMPILE_TIMEOUT` (an unknown value of either is [`JitError::Config`]).
    pub fn from_env() -> Result<JitConfig, JitError> {
        let mut c = JitConfig::new(DiskCache::default_root());
        c.mode = JitMode::from_env()?;
        if let Some(v) = std::env::var_os(hostcc::COMPILE_TIMEOUT_ENV) {
            let text = v.to_string_lossy().into_owned();
            c.compile_timeout = match v.to_str().map(|t| t.trim().parse::<u64>()) {
                Some(Ok(secs)) if secs > 0 => std::time::Duration::from_secs(secs),
                _ => {
                    return Err(JitError::Config {
                        name: hostcc::COMPILE_TIMEOUT_ENV,
                        value: text,
                        reason: "expected a whole number of seconds above 0".to_string(),
                    })
                }
            };
        }
        Ok(c)
    }
}

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

    /// True for a miss refused by [`JitMode::Off`].
    pub fn is_jit_off(&self) -> bool {
        matches!(self, JitError::JitOff { .. })
    }

    /// True for a corrupt cache entry refused by [`JitMode::Off`].
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

enum Compiler {
    /// NVRTC itself is loaded only when something must be compiled.
    Nvrtc(NvrtcOptions),
    Host(HostCompiler, HostCcOptions),
}

struct Plan {
    compiler: Compiler,
    compiler_id: String,
    args: Vec<String>,
    key: CacheKey,
    target_dir: String,
}

/// File in the cache root remembering each NVRTC library's identity. (`v2`: identities include
/// the library's digest; records of the older `nvrtc-identity.json`, version only, are not
/// reused.)
pub const NVRTC_IDENTITY_FILE: &str = "nvrtc-identity.v2.json";

/// What identifies one library file on disk: a changed file changes its length or mtime.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
struct LibraryStamp {
    library: PathBuf,
    len: u64,
    mtime_ns: u64,
}

impl LibraryStamp {
    fn of(path: &std::path::Path) -> Option<LibraryStamp> {
        let meta = std::fs::metadata(path).ok()?;
        let mtime_ns = meta
            .modified()
            .ok()?
            .duration_since(std::time::UNIX_EPOCH)
            .ok()?
            .as_nanos();
        let mtime_ns = u64::try_from(mtime_ns).ok()?;
        Some(LibraryStamp {
            library: path.to_path_buf(),
            len: meta.len(),
            mtime_ns,
        })
    }
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct IdentityRecord {
    stamp: LibraryStamp,
    identity: String,
}

/// The whole host compiler command line with placeholder paths: the key covers the
/// arguments added around the options too, not only the options.
fn host_key_args(opts: &HostCcOptions) -> Vec<String> {
    HostCompiler::command_args(opts, Path::new("<source>"), Path::new("<output>"))
}

/// A disk hit whose manifest describes another entry (another full key hash, uri or target,
/// e.g. a copied or hand-edited directory) is corrupt: the directory name is only a prefix of
/// the key, so the manifest is what vouches for the artifact.
fn for_request(found: Lookup, req: &JitRequest, hash: &str, target: &str) -> Lookup {
    let Lookup::Hit(entry) = found else {
        return found;
    };
    let m = &entry.manifest;
    let mismatch = if m.key != hash {
        Some(format!("manifest key {} is not {hash}", m.key))
    } else if m.uri != req.uri {
        Some(format!("manifest uri {:?} is not {:?}", m.uri, req.uri))
    } else if m.target != target {
        Some(format!("manifest target {:?} is not {target:?}", m.target))
    } else {
        None
    };
    match mismatch {
        Some(reason) => Lookup::Corrupt {
            dir: entry.dir,
            reason,
        },
        None => Lookup::Hit(entry),
    }
}

fn corrupt_entry(req: &JitRequest, path: PathBuf, reason: String) -> JitError {
    tracing::debug!(
        target: "cp_hicache::jit",
        uri = %req.uri,
        target_name = %req.target,
        path = %path.display(),
        reason = %reason,
        "corrupt JIT cache entry with CP_HICACHE_JIT=off"
    );
    JitError::CorruptEntry {
        uri: req.uri.clone(),
        path,
        reason,
    }
}

/// The JIT front end: compilers (loaded lazily), the disk cache and the in-memory map.
pub struct Jit {
    config: JitConfig,
    cache: DiskCache,
    nvrtc: OnceLock<Result<NvrtcCompiler, NvrtcError>>,
    host: OnceLock<Result<HostCompiler, HostCcError>>,
    memory: RwLock<HashMap<String, CompiledKernel>>,
}

impl fmt::Debug for Jit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Jit")
            .field("cache_dir", &self.config.cache_dir)
            .field("mode", &self.config.mode)
            .finish_non_exhaustive()
    }
}

impl Jit {
    /// A JIT with this configuration. Nothing is loaded until the first request.
    pub fn new(config: JitConfig) -> Jit {
        Jit {
            cache: DiskCache::new(config.cache_dir.clone()),
            config,
            nvrtc: OnceLock::new(),
            host: OnceLock::new(),
            memory: RwLock::new(HashMap::new()),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &JitConfig {
        &self.config
    }

    /// The disk cache.
    pub fn cache(&self) -> &DiskCache {
        &self.cache
    }

    /// The NVRTC compiler, loading it on first use.
    pub fn nvrtc(&self) -> Result<&NvrtcCompiler, JitError> {
        if !self.config.nvrtc_enabled {
            return Err(JitError::NvrtcUnavailable {
                searched: vec!["nothing: NVRTC disabled by JitConfig::nvrtc_enabled".to_string()],
                requested: None,
            });
        }
        self.nvrtc
            .get_or_init(NvrtcCompiler::load)
            .as_ref()
            .map_err(|e| e.clone().into())
    }

    /// The NVRTC identity ([`NvrtcCompiler::identity`]: version and library digest) that goes
    /// into cache and tuning keys, without loading NVRTC when possible: once NVRTC is loaded it
    /// is asked directly; otherwise the library that discovery would load is located (no
    /// `dlopen`, no hashing) and its identity is read from
    /// `<cache>/nvrtc-identity.v2.json`, recorded per (path, length, mtime) the first time that
    /// library was loaded. A warm start thus reads cache entries without paying the NVRTC load;
    /// a miss loads NVRTC anyway and re-keys if the remembered identity was wrong.
    pub fn nvrtc_identity(&self) -> Result<String, JitError> {
        if let Some(Ok(nv)) = self.nvrtc.get() {
            return Ok(nv.identity());
        }
        let located = if self.config.nvrtc_enabled {
            nvrtc::locate().and_then(|p| LibraryStamp::of(&p))
        } else {
            None
        };
        if let Some(stamp) = &located {
            if let Some(id) = self.remembered_identity(stamp) {
                return Ok(id);
            }
        }
        let nv = self.nvrtc()?;
        let id = nv.identity();
        if let Some(stamp) = located.filter(|s| nv.library() == Some(s.library.as_path())) {
            self.remember_identity(stamp, &id);
        }
        Ok(id)
    }

    fn remembered_identity(&self, stamp: &LibraryStamp) -> Option<String> {
        let text = self.cache.read_aux(NVRTC_IDENTITY_FILE)?;
        let known: Vec<IdentityRecord> = serde_json::from_slice(&text).ok()?;
        known
            .into_iter()
            .find(|r| &r.stamp == stamp)
            .map(|r| r.identity)
    }

    fn remember_identity(&self, stamp: LibraryStamp, identity: &str) {
        if self.config.mode == JitMode::Off {
            return; // a prebuilt cache is left exactly as it was
        }
        let mut known: Vec<IdentityRecord> = self
            .cache
            .read_aux(NVRTC_IDENTITY_FILE)
            .and_then(|t| serde_json::from_slice(&t).ok())
            .unwrap_or_default();
        known.retain(|r| r.stamp.library != stamp.library);
        known.push(IdentityRecord {
            stamp,
            identity: identity.to_string(),
        });
        let written = serde_json::to_vec_pretty(&known)
            .map_err(|e| e.to_string())
            .and_then(|t| {
                self.cache
                    .write_aux(NVRTC_IDENTITY_FILE, &t)
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            tracing::debug!(target: "cp_hicache::jit", error = %e, "NVRTC identity not recorded");
        }
    }

    /// The host compiler, detecting it on first use.
    pub fn host_compiler(&self) -> Result<&HostCompiler, JitError> {
        self.host
            .get_or_init(|| {
                HostCompiler::detect_within(self.config.cxx.as_deref(), self.config.compile_timeout)
            })
            .as_ref()
            .map_err(|e| e.clone().into())
    }

    /// Forgets the in-memory map (the disk cache is untouched).
    pub fn clear_memory(&self) {
        self.memory
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    fn plan(&self, req: &JitRequest) -> Result<Plan, JitError> {
        let (compiler, compiler_id) = match req.target {
            Target::Nvrtc { arch } => (
                Compiler::Nvrtc(self.config.nvrtc.clone().with_arch(arch)),
                self.nvrtc_identity()?,
            ),
            Target::Host { sanitize } => {
                let cc = self.host_compiler()?.clone();
                let id = format!("{} [{}]", cc.identity(), cc.program());
                let opts = self.config.host.clone().with_sanitize(sanitize);
                (Compiler::Host(cc, opts), id)
            }
        };
        let (key, args) = self.key_with(req, &compiler_id);
        Ok(Plan {
            compiler,
            compiler_id,
            args,
            key,
            target_dir: req.target.to_string(),
        })
    }

    /// The cache key a request would use (loads the compiler to learn its version).
    pub fn key_for(&self, req: &JitRequest) -> Result<CacheKey, JitError> {
        validate_uri(&req.uri)?;
        Ok(self.plan(req)?.key)
    }

    /// Returns the compiled kernel for a request: from memory, from disk, or by compiling it.
    ///
    /// Errors: an invalid uri, a missing compiler, a compile error (with the full log), a cache
    /// I/O error, or [`JitError::JitOff`] on a miss when compiling is off. A corrupt disk entry
    /// (its artifact does not match its manifest, or its manifest names another key, uri or
    /// target) is never loaded: it is logged, discarded and recompiled, or, when compiling is
    /// off, left untouched and reported as [`JitError::CorruptEntry`].
    pub fn get(&self, req: &JitRequest) -> Result<CompiledKernel, JitError> {
        let start = Instant::now();
        let result = self.resolve(req, start);
        if let Err(e) = &result {
            tracing::debug!(
                target: "cp_hicache::jit",
                uri = %req.uri,
                target_name = %req.target,
                cache = "failed",
                ms = start.elapsed().as_secs_f64() * 1e3,
                error = %e,
                "jit"
            );
        }
        result
    }

    /// [`Jit::get`] without the failure event.
    fn resolve(&self, req: &JitRequest, start: Instant) -> Result<CompiledKernel, JitError> {
        validate_uri(&req.uri)?;
        let plan = match self.plan(req) {
            Ok(plan) => plan,
            // No compiler here: a prebuilt cache may still hold the entry.
            Err(e) if e.is_unavailable() && self.config.mode == JitMode::Off => {
                return self.get_prebuilt(req, start);
            }
            Err(e) => return Err(e),
        };
        let ms = |s: Instant| s.elapsed().as_secs_f64() * 1e3;

        let cached = self
            .memory
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&plan.key.hash)
            .cloned();
        if let Some(mut k) = cached {
            k.cache_hit = CacheHit::Memory;
            k.compile_ms = ms(start);
            self.log(&k);
            return Ok(k);
        }

        let cache_err = |source: CacheError| JitError::Cache {
            uri: req.uri.clone(),
            source: Arc::new(source),
        };
        let (td, name) = (plan.target_dir.as_str(), plan.key.readable.as_str());
        let lookup = || -> Result<Lookup, JitError> {
            let found = self.cache.lookup(td, name).map_err(cache_err)?;
            Ok(for_request(found, req, &plan.key.hash, td))
        };
        // Fast path without the lock: committed entries only appear by rename, manifest last.
        if let Lookup::Hit(entry) = lookup()? {
            return Ok(self.finish(req, &plan.key, *entry, CacheHit::Disk, ms(start)));
        }
        // The lock only keeps two compilers of one entry apart. With compiling off nothing is
        // written, not even a lock file: a prebuilt cache is left exactly as it was, and a
        // read-only one answers a miss with JitOff rather than a lock-file error. (Commits
        // are atomic, manifest last, so reading beside another process's commit is safe.)
        let lock = match self.config.mode {
            JitMode::Off => None,
            JitMode::On => {
                let wait = Instant::now();
                let lock = self.cache.lock(td, name).map_err(cache_err)?;
                let waited = ms(wait);
                if waited >= 1.0 {
                    // Another thread or process held the entry: usually compiling it.
                    tracing::debug!(
                        target: "cp_hicache::jit",
                        uri = %req.uri,
                        target_name = %req.target,
                        ms = waited,
                        "waited for the entry lock"
                    );
                }
                Some(lock)
            }
        };
        let corrupt = match lookup()? {
            Lookup::Hit(entry) => {
                return Ok(self.finish(req, &plan.key, *entry, CacheHit::Disk, ms(start)))
            }
            Lookup::Corrupt { dir, reason } if self.config.mode == JitMode::Off => {
                // A prebuilt cache is never modified; the error comes once the key is confirmed.
                Some((dir, reason))
            }
            Lookup::Corrupt { dir, reason } => {
                tracing::warn!(
                    target: "cp_hicache::jit",
                    uri = %req.uri,
                    target_name = %req.target,
                    key = %plan.key.readable,
                    path = %dir.display(),
                    reason = %reason,
                    "corrupt JIT cache entry discarded"
                );
                self.cache.discard(td, name).map_err(cache_err)?;
                None
            }
            Lookup::Miss => None,
        };
        if matches!(plan.compiler, Compiler::Nvrtc(_)) {
            // The key may rest on a remembered NVRTC identity: confirm it with the library itself
            // before declaring a miss.
            match self.nvrtc() {
                Ok(nv) if nv.identity() != plan.compiler_id => {
                    tracing::warn!(
                        target: "cp_hicache::jit",
                        remembered = %plan.compiler_id,
                        loaded = %nv.identity(),
                        "NVRTC identity changed; re-keying"
                    );
                    let id = nv.identity();
                    if let Some(stamp) = nvrtc::locate()
                        .and_then(|p| LibraryStamp::of(&p))
                        .filter(|s| nv.library() == Some(s.library.as_path()))
                    {
                        self.remember_identity(stamp, &id);
                    }
                    drop(lock);
                    // NVRTC is loaded now, so `plan` asks it directly: no further recursion.
                    return self.resolve(req, start);
                }
                Ok(_) => {}
                Err(e) if e.is_unavailable() && self.config.mode == JitMode::Off => {
                    drop(lock);
                    return self.get_prebuilt(req, start);
                }
                Err(e) => return Err(e),
            }
        }
        if let Some((path, reason)) = corrupt {
            return Err(corrupt_entry(req, path, reason));
        }
        if self.config.mode == JitMode::Off {
            let path = self.cache.entry_dir(td, name).map_err(cache_err)?;
            return Err(JitError::JitOff {
                uri: req.uri.clone(),
                key: plan.key.readable.clone(),
                path,
            });
        }

        let compile_start = Instant::now();
        let (bytes, artifact_file, extra) = match &plan.compiler {
            Compiler::Nvrtc(opts) => {
                let nv = self.nvrtc()?;
                let out = nv.compile(&req.uri, &req.source, opts)?;
                let extra = serde_json::json!({ "report": out.report, "log": out.log });
                (out.cubin, format!("{}.cubin", req.uri), extra)
            }
            Compiler::Host(cc, opts) => {
                let so = cc.compile(&req.uri, &req.source, &self.config.emu_header, opts)?;
                (so, format!("{}.so", req.uri), serde_json::Value::Null)
            }
        };
        let compile_ms = ms(compile_start);
        let source_file = format!("{}.cu", req.uri);
        let manifest = Manifest::describe(
            &req.uri,
            &plan.key.hash,
            td,
            &plan.compiler_id,
            plan.args.clone(),
            compile_ms,
            extra,
        );
        let entry = self
            .cache
            .commit(
                td,
                name,
                NewEntry {
                    artifact_file: &artifact_file,
                    artifact: &bytes,
                    source_file: &source_file,
                    source: &req.source,
                    manifest,
                },
            )
            .map_err(cache_err)?;
        drop(lock);
        Ok(self.finish(req, &plan.key, entry, CacheHit::Miss, ms(start)))
    }

    /// The key of a request under a given compiler identity, and the compiler arguments it
    /// covers (recorded in the manifest). Needs no compiler, so a prebuilt entry can be
    /// matched on a machine that has none.
    fn key_with(&self, req: &JitRequest, compiler_id: &str) -> (CacheKey, Vec<String>) {
        let (args, digest, header) = match req.target {
            Target::Nvrtc { arch } => {
                let opts = self.config.nvrtc.clone().with_arch(arch);
                (opts.to_args(), key::stable_digest(&opts), None)
            }
            Target::Host { sanitize } => {
                let opts = self.config.host.clone().with_sanitize(sanitize);
                (
                    host_key_args(&opts),
                    key::stable_digest(&opts),
                    Some(self.config.emu_header.as_str()),
                )
            }
        };
        let key = CacheKey::compute(&KeyInputs {
            crate_version: env!("CARGO_PKG_VERSION"),
            uri: &req.uri,
            source: &req.source,
            compiler: compiler_id,
            options_args: &args,
            options_digest: digest,
            target: &req.target.to_string(),
            emu_header: header,
            env: &self.config.env,
        });
        (key, args)
    }

    /// Prebuilt-only lookup when the target's compiler (NVRTC or the host C++ compiler) is
    /// unavailable and JIT is off: the compiler version (a key input) is unknown, so every committed entry
    /// `<cache>/<target>/<uri>-*/` is considered, its key recomputed from the request with the
    /// compiler its manifest names, and it is used only if exactly one entry both reproduces its
    /// own key (same crate version, uri, source, options, arch and environment) and passes its
    /// integrity check. When none passes but an entry of this uri is corrupt,
    /// [`JitError::CorruptEntry`] names it; otherwise [`JitError::JitOff`].
    fn get_prebuilt(&self, req: &JitRequest, start: Instant) -> Result<CompiledKernel, JitError> {
        let cache_err = |source: CacheError| JitError::Cache {
            uri: req.uri.clone(),
            source: Arc::new(source),
        };
        let td = req.target.to_string();
        let target_root = self.cache.root().join(&td);
        let prefix = format!("{}-", req.uri);
        let mut names: Vec<String> = match std::fs::read_dir(&target_root) {
            Ok(rd) => rd
                .filter_map(|e| e.ok())
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| {
                    n.len() == prefix.len() + CacheKey::PREFIX_HEX
                        && n.starts_with(&prefix)
                        && n[prefix.len()..].bytes().all(|b| b.is_ascii_hexdigit())
                })
                .collect(),
            Err(_) => Vec::new(),
        };
        names.sort();
        let mut matches: Vec<(CacheKey, cache::CacheEntry)> = Vec::new();
        // Entries of this uri that may be the one asked for but fail their integrity check.
        let mut corrupt: Vec<(PathBuf, String)> = Vec::new();
        for name in &names {
            let dir = target_root.join(name);
            let Ok(text) = std::fs::read(dir.join(cache::MANIFEST)) else {
                continue;
            };
            let manifest = match serde_json::from_slice::<Manifest>(&text) {
                Ok(m) => m,
                Err(e) => {
                    corrupt.push((dir, format!("unreadable manifest: {e}")));
                    continue;
                }
            };
            let (key, _) = self.key_with(req, &manifest.compiler);
            if key.hash != manifest.key || &key.readable != name {
                continue;
            }
            let found = self.cache.lookup(&td, name).map_err(cache_err)?;
            match for_request(found, req, &key.hash, &td) {
                Lookup::Hit(entry) => matches.push((key, *entry)),
                Lookup::Corrupt { dir, reason } => {
                    tracing::warn!(
                        target: "cp_hicache::jit",
                        uri = %req.uri,
                        path = %dir.display(),
                        reason = %reason,
                        "corrupt prebuilt JIT cache entry not used"
                    );
                    corrupt.push((dir, reason));
                }
                Lookup::Miss => {}
            }
        }
        if matches.is_empty() {
            if let Some((path, reason)) = corrupt.into_iter().next() {
                return Err(corrupt_entry(req, path, reason));
            }
        }
        if matches.len() == 1 {
            if let Some((key, entry)) = matches.pop() {
                let cached = self
                    .memory
                    .read()
                    .unwrap_or_else(|e| e.into_inner())
                    .get(&key.hash)
                    .cloned();
                let elapsed = start.elapsed().as_secs_f64() * 1e3;
                if let Some(mut k) = cached {
                    k.cache_hit = CacheHit::Memory;
                    k.compile_ms = elapsed;
                    self.log(&k);
                    return Ok(k);
                }
                return Ok(self.finish(req, &key, entry, CacheHit::Disk, elapsed));
            }
        }
        let key = format!(
            "{prefix}* (NVRTC unavailable; {} prebuilt entries match, exactly one is needed)",
            matches.len()
        );
        tracing::debug!(
            target: "cp_hicache::jit",
            uri = %req.uri,
            target_name = %req.target,
            path = %target_root.display(),
            matching = matches.len(),
            "JIT miss with CP_HICACHE_JIT=off and no NVRTC"
        );
        Err(JitError::JitOff {
            uri: req.uri.clone(),
            key,
            path: target_root,
        })
    }

    fn finish(
        &self,
        req: &JitRequest,
        key: &CacheKey,
        entry: cache::CacheEntry,
        hit: CacheHit,
        elapsed_ms: f64,
    ) -> CompiledKernel {
        let (artifact, report) = match req.target {
            Target::Nvrtc { .. } => {
                let report = entry
                    .manifest
                    .extra
                    .get("report")
                    .and_then(|r| serde_json::from_value(r.clone()).ok());
                (Artifact::Cubin(Arc::from(entry.artifact)), report)
            }
            Target::Host { .. } => (Artifact::SharedObject(entry.artifact_path), None),
        };
        let k = CompiledKernel {
            uri: req.uri.clone(),
            target: req.target,
            artifact,
            report,
            compile_ms: elapsed_ms,
            cache_hit: hit,
            key: key.clone(),
            entry_dir: entry.dir,
        };
        self.memory
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.hash.clone(), k.clone());
        self.log(&k);
        k
    }

    fn log(&self, k: &CompiledKernel) {
        tracing::info!(
            target: "cp_hicache::jit",
            uri = %k.uri,
            target_name = %k.target,
            key = %k.key.readable,
            cache = %k.cache_hit,
            ms = k.compile_ms,
            path = %k.entry_dir.display(),
            "jit"
        );
    }

    /// Compiles (or loads) every request in parallel; one result per request, in order.
    pub fn warm_up(&self, requests: &[JitRequest]) -> Vec<Result<CompiledKernel, JitError>> {
        self.warm_up_with(requests, |_| {})
    }

    /// [`Jit::warm_up`], calling `on_done` (from a worker thread) as each request finishes, e.g.
    /// to advance a progress bar.
    pub fn warm_up_with(
        &self,
        requests: &[JitRequest],
        on_done: impl Fn(&Result<CompiledKernel, JitError>) + Sync,
    ) -> Vec<Result<CompiledKernel, JitError>> {
        let start = Instant::now();
        let results: Vec<Result<CompiledKernel, JitError>> = requests
            .par_iter()
            .map(|r| {
                let result = self.get(r);
                on_done(&result);
                result
            })
            .collect();
        let count = |h: CacheHit| {
            results
                .iter()
                .filter(|r| matches!(r, Ok(k) if k.cache_hit == h))
                .count()
        };
        tracing::info!(
            target: "cp_hicache::jit",
            kernels = requests.len(),
            compiled = count(CacheHit::Miss),
            disk_hits = count(CacheHit::Disk),
            memory_hits = count(CacheHit::Memory),
            failed = results.iter().filter(|r| r.is_err()).count(),
            ms = start.elapsed().as_secs_f64() * 1e3,
            "jit warm-up"
        );
        results
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_dir_names() {
        assert_eq!(Target::default().to_string(), "sm_90");
        assert_eq!(Target::Nvrtc { arch: Arch::Sm100 }.to_string(), "sm_100");
        assert_eq!(
            Target::Host {
                sanitize: Sanitize::None
            }
            .to_string(),
            "host"
        );
        assert_eq!(
            Target::Host {
                sanitize: Sanitize::Address
            }
            .to_string(),
            "host-asan"
        );
    }

    #[test]
    fn uri_validation() {
        assert!(validate_uri("transfer_pages_ps64_b41984").is_ok());
        assert!(validate_uri("").is_err());
        assert!(validate_uri("9abc").is_err());
        assert!(validate_uri("a/b").is_err());
        assert!(validate_uri("a-b").is_err());
        assert!(validate_uri(&"a".repeat(161)).is_err());
    }

    #[test]
    fn jit_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Jit>();
    }
}
