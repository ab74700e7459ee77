//! Compiler options as data: each options struct derives `Default + Hash + Eq` so it can be part
//! of the cache key, and turns into flags through exactly one `to_args()`.

use super::JitError;
use std::fmt;
use std::str::FromStr;

/// The target architecture is the kernels' (a deployment names it); the JIT re-exports it.
pub use crate::kernels::Arch;

/// Sanitizer mode of a host (CPU emulation) build.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Sanitize {
    /// A plain optimised build.
    #[default]
    None,
    /// AddressSanitizer: kernel memory checks without a GPU.
    Address,
}

impl fmt::Display for Sanitize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Sanitize::None => "none",
            Sanitize::Address => "address",
        })
    }
}

/// Environment variable selecting the sanitizer mode of host builds (`address` or `none`),
/// named with the host executor's other settings.
pub use crate::exec::host::SANITIZE_ENV;

impl FromStr for Sanitize {
    type Err = JitError;
    /// `address` (or `asan`), and `none` (or `0`, or empty).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "none" | "0" => Ok(Sanitize::None),
            "address" | "asan" => Ok(Sanitize::Address),
            _ => Err(JitError::Config {
                name: SANITIZE_ENV,
                value: s.to_string(),
                reason: "expected address or none".to_string(),
            }),
        }
    }
}

impl Sanitize {
    /// The mode `CP_HICACHE_EMU_SANITIZE` selects (unset → `None`); an unknown value is
    /// [`JitError::Config`], so a misspelt mode never silently builds uninstrumented kernels.
    /// Loading an `Address` build needs the ASan runtime preloaded into the process.
    pub fn from_env() -> Result<Sanitize, JitError> {
        match std::env::var(SANITIZE_ENV) {
            Ok(v) => v.parse(),
            Err(std::env::VarError::NotPresent) => Ok(Sanitize::None),
            Err(std::env::VarError::NotUnicode(v)) => Err(JitError::Config {
                name: SANITIZE_ENV,
                value: v.to_string_lossy().into_owned(),
                reason: "not valid UTF-8".to_string(),
            }),
        }
    }

    /// The extra host compiler flags of this mode (part of [`HostCcOptions::to_args`]).
    pub fn cxx_flags(self) -> &'static [&'static str] {
        match self {
            Sanitize::None => &[],
            Sanitize::Address => &["-fsanitize=address", "-fno-omit-frame-pointer", "-g"],
        }
    }
}

/// NVRTC options. The architecture here is overridden by the request's target at compile time.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NvrtcOptions {
    /// Real architecture to emit a CUBIN for.
    pub arch: Arch,
    /// Ask ptxas for its `-v` resource report (registers, spills, shared memory).
    pub resource_usage: bool,
    /// `--use_fast_math`; off by default because the kernels are integer-only anyway.
    pub fast_math: bool,
    /// `--generate-line-info`, for profilers.
    pub line_info: bool,
    /// `--maxrregcount=N`, a register cap per thread.
    pub max_registers: Option<u32>,
    /// Extra flags appended verbatim (they are part of the cache key like everything else).
    pub extra: Vec<String>,
}

impl Default for NvrtcOptions {
    fn default() -> Self {
        NvrtcOptions {
            arch: Arch::default(),
            resource_usage: true,
            fast_math: false,
            line_info: false,
            max_registers: None,
            extra: Vec::new(),
        }
    }
}

impl NvrtcOptions {
    /// The same options for another architecture.
    pub fn with_arch(mut self, arch: Arch) -> Self {
        self.arch = arch;
        self
    }

    /// The NVRTC option vector, in a fixed order.
    pub fn to_args(&self) -> Vec<String> {
        let mut args = vec![
            format!("--gpu-architecture={}", self.arch),
            "--std=c++17".to_string(),
        ];
        if self.resource_usage {
            args.push("--ptxas-options=-v".to_string());
        }
        if self.fast_math {
            args.push("--use_fast_math".to_string());
        }
        if self.line_info {
            args.push("--generate-line-info".to_string());
        }
        if let Some(n) = self.max_registers {
            args.push(format!("--maxrregcount={n}"));
        }
        args.extend(self.extra.iter().cloned());
        args
    }
}

/// Options of the host C++ compiler that builds the CPU-emulation shared library.
///
/// The compiler program itself is not an option (it is `$CXX` or `c++`, and its identity goes
/// into the cache key separately); the emulation header is passed by file name and found in the
/// build directory, which is the compiler's working directory.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HostCcOptions {
    /// Optimisation level digit or letter (`2` → `-O2`).
    pub opt_level: String,
    /// Sanitizer mode; overridden by the request's target at compile time.
    pub sanitize: Sanitize,
    /// File name of the emulation header force-included before the source.
    pub header_name: String,
    /// Extra flags appended verbatim.
    pub extra: Vec<String>,
}

impl Default for HostCcOptions {
    fn default() -> Self {
        HostCcOptions {
            opt_level: "2".to_string(),
            sanitize: Sanitize::None,
            header_name: "cuda_emu.h".to_string(),
            extra: Vec::new(),
        }
    }
}

impl HostCcOptions {
    /// The same options with another sanitizer mode.
    pub fn with_sanitize(mut self, sanitize: Sanitize) -> Self {
        self.sanitize = sanitize;
        self
    }

    /// The compiler flags (without the program, the input and the output), in a fixed order.
    ///
    /// `-fstack-clash-protection` (GCC 8+, Clang 11+; off by default in Debian's GCC) makes a
    /// frame larger than a page probe every page it allocates, so a kernel thread that
    /// overflows its fiber stack faults on the guard below it instead of jumping over it.
    pub fn to_args(&self) -> Vec<String> {
        let mut args: Vec<String> = [
            "-std=c++17".to_string(),
            format!("-O{}", self.opt_level),
            "-fPIC".to_string(),
            "-shared".to_string(),
            "-fstack-clash-protection".to_string(),
            "-DCP_HICACHE_EMU".to_string(),
            "-include".to_string(),
            self.header_name.clone(),
        ]
        .into();
        args.extend(self.sanitize.cxx_flags().iter().map(|s| s.to_string()));
        args.extend(self.extra.iter().cloned());
        args
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_default_args() {
        assert_eq!(
            NvrtcOptions::default().to_args(),
            [
                "--gpu-architecture=sm_90",
                "--std=c++17",
                "--ptxas-options=-v"
            ]
        );
    }

    #[test]
    fn nvrtc_all_args() {
        let o = NvrtcOptions {
            arch: Arch::Sm80,
            resource_usage: false,
            fast_math: true,
            line_info: true,
            max_registers: Some(64),
            extra: vec!["-DFOO=1".into()],
        };
        assert_eq!(
            o.to_args(),
            [
                "--gpu-architecture=sm_80",
                "--std=c++17",
                "--use_fast_math",
                "--generate-line-info",
                "--maxrregcount=64",
                "-DFOO=1"
            ]
        );
        assert_eq!(
            NvrtcOptions::default().with_arch(Arch::Sm100).to_args()[0],
            "--gpu-architecture=sm_100"
        );
    }

    #[test]
    fn host_default_args() {
        assert_eq!(
            HostCcOptions::default().to_args(),
            [
                "-std=c++17",
                "-O2",
                "-fPIC",
                "-shared",
                "-fstack-clash-protection",
                "-DCP_HICACHE_EMU",
                "-include",
                "cuda_emu.h"
            ]
        );
    }

    #[test]
    fn host_asan_args() {
        let o = HostCcOptions::default().with_sanitize(Sanitize::Address);
        assert_eq!(
            o.to_args(),
            [
                "-std=c++17",
                "-O2",
                "-fPIC",
                "-shared",
                "-fstack-clash-protection",
                "-DCP_HICACHE_EMU",
                "-include",
                "cuda_emu.h",
                "-fsanitize=address",
                "-fno-omit-frame-pointer",
                "-g"
            ]
        );
    }

    #[test]
    fn sanitize_parses() {
        assert_eq!("address".parse::<Sanitize>().unwrap(), Sanitize::Address);
        assert_eq!(" ASan ".parse::<Sanitize>().unwrap(), Sanitize::Address);
        assert_eq!("none".parse::<Sanitize>().unwrap(), Sanitize::None);
        assert_eq!("".parse::<Sanitize>().unwrap(), Sanitize::None);
        assert!(matches!(
            "adress".parse::<Sanitize>(),
            Err(JitError::Config { name: SANITIZE_ENV, value, .. }) if value == "adress"
        ));
        assert!(Sanitize::None.cxx_flags().is_empty());
    }
}
