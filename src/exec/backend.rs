//! The backend choice: [`Backend`] (`--backend auto|host|cuda`). Turning it into an executor
//! is the JIT's (`crate::jit::open_executor`): `auto` takes a GPU only where kernels can be
//! built for it, which is the JIT's rule, and the executors know nothing of how kernels are
//! built.

use std::fmt;
use std::str::FromStr;

use super::ExecError;

/// Which executor to use: chosen on the command line (`--backend auto|host|cuda`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Backend {
    /// CUDA when a driver and a device are usable, otherwise the host emulator.
    #[default]
    Auto,
    /// The CPU emulation executor.
    Host,
    /// The CUDA driver executor.
    Cuda,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Auto => "auto",
            Backend::Host => "host",
            Backend::Cuda => "cuda",
        })
    }
}

impl FromStr for Backend {
    type Err = ExecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Backend::Auto),
            "host" | "cpu" => Ok(Backend::Host),
            "cuda" | "gpu" => Ok(Backend::Cuda),
            _ => Err(ExecError::Config {
                name: "backend",
                value: s.to_string(),
                reason: "expected auto, host or cuda".into(),
            }),
        }
    }
}
