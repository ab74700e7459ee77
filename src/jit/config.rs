//! How a [`Jit`](super::Jit) is set up: [`JitConfig`], [`JitMode`] and the emulation header.

use super::{hostcc, key, DiskCache, HostCcOptions, JitError, NvrtcOptions};
use std::path::PathBuf;

/// The CUDA-emulation header force-included in host builds (`templates/cuda_emu.h`), compiled
/// into the binary so a deployment never reads the source tree at run time; the host
/// executor's, whose ABI it is.
pub use crate::exec::host::EMU_HEADER;

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

/// Everything a [`Jit`](super::Jit) needs; built once, not re-read afterwards.
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
    pub(super) nvrtc: NvrtcOptions,
    /// Host compiler options (the sanitizer mode comes from each request).
    pub(super) host: HostCcOptions,
    /// Host compiler program; `None` → `$CXX`, else `c++`.
    pub(super) cxx: Option<String>,
    /// The CUDA-emulation header text force-included in host builds.
    pub(super) emu_header: String,
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
