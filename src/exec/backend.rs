//! Backend selection: [`Backend`] (`--backend auto|host|cuda`) and [`open_executor`], which
//! turns a choice into an executor, in one place so `auto` resolves the same way everywhere.

use std::fmt;
use std::str::FromStr;

use super::{cuda, ExecError, Executor, HostExecutor, HostOptions};

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

impl Backend {
    /// Resolves `Auto` to the backend that [`open_executor`] would pick now.
    pub fn resolve(self) -> Backend {
        match self {
            Backend::Auto if auto_gpu().is_ok() => Backend::Cuda,
            Backend::Auto => Backend::Host,
            other => other,
        }
    }
}

/// The GPU `Auto` takes: device 0, when a driver and a device are usable and kernels can be
/// built for its architecture; otherwise why not.
fn auto_gpu() -> Result<cuda::CudaExecutor, String> {
    if !cuda::CudaExecutor::usable() {
        return Err("no usable CUDA device".into());
    }
    let gpu = cuda::CudaExecutor::new(0).map_err(|e| e.to_string())?;
    // The JIT's rule for the device's kernel target decides (and explains a refusal).
    crate::jit::target_for(
        &gpu,
        crate::jit::Arch::default(),
        crate::jit::Sanitize::None,
    )
    .map_err(|e| e.to_string())?;
    Ok(gpu)
}

/// Opens the executor for `backend`. `Auto` picks CUDA when a device is usable and kernels
/// can be built for it, and otherwise the host executor (saying why when a driver was found).
/// The host executor takes its block order from `CP_HICACHE_EMU_ORDER`.
pub fn open_executor(backend: Backend) -> Result<Box<dyn Executor>, ExecError> {
    let host = || -> Result<Box<dyn Executor>, ExecError> {
        Ok(Box::new(HostExecutor::new(HostOptions::from_env()?)))
    };
    match backend {
        Backend::Cuda => Ok(Box::new(cuda::CudaExecutor::new(0)?)),
        Backend::Host => host(),
        Backend::Auto => match auto_gpu() {
            Ok(gpu) => Ok(Box::new(gpu)),
            Err(why) => {
                if cuda::CudaExecutor::usable() {
                    tracing::warn!(target: "cp_hicache::exec", "--backend auto: using the host executor: {why}");
                }
                host()
            }
        },
    }
}
