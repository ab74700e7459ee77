//! Opening the executor a `--backend` choice names. `auto` takes the GPU only when a driver and
//! a device are usable and kernels can be built for its architecture: the JIT's target rule
//! decides, so the choice lives here, above the executors (which know nothing of how
//! kernels are built).

use crate::exec::{Backend, ExecError, Executor};

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
fn auto_gpu() -> Result<crate::exec::cuda::CudaExecutor, String> {
    if !crate::exec::cuda::CudaExecutor::usable() {
        return Err("no usable CUDA device".into());
    }
    let gpu = crate::exec::cuda::CudaExecutor::new(0).map_err(|e| e.to_string())?;
    // The JIT's rule for the device's kernel target decides (and explains a refusal).
    super::target_for(&gpu, super::Arch::default(), super::Sanitize::None)
        .map_err(|e| e.to_string())?;
    Ok(gpu)
}

/// Opens the executor for `backend`. `Auto` picks CUDA when a device is usable and kernels
/// can be built for it, and otherwise the host executor (saying why when a driver was found).
/// The host executor takes its block order from `CP_HICACHE_EMU_ORDER`.
pub fn open_executor(backend: Backend) -> Result<Box<dyn Executor>, ExecError> {
    let host = || -> Result<Box<dyn Executor>, ExecError> {
        Ok(Box::new(crate::exec::HostExecutor::new(
            crate::exec::HostOptions::from_env()?,
        )))
    };
    match backend {
        Backend::Cuda => Ok(Box::new(crate::exec::cuda::CudaExecutor::new(0)?)),
        Backend::Host => host(),
        Backend::Auto => match auto_gpu() {
            Ok(gpu) => Ok(Box::new(gpu)),
            Err(why) => {
                if crate::exec::cuda::CudaExecutor::usable() {
                    tracing::warn!(target: "cp_hicache::exec", "--backend auto: using the host executor: {why}");
                }
                host()
            }
        },
    }
}
