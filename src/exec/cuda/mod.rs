//! The CUDA executor (cudarc driver API). Skeleton: it probes the driver safely and reports
//! [`ExecError::Unavailable`] where no driver or device is usable; the data paths are not yet
//! implemented and also report `Unavailable`.

mod driver;

use super::MemKind;
use super::{
    Backend, BufferId, Counters, ExecError, Executor, KernelArg, KernelArtifact, KernelId,
    LaunchConfig,
};

/// The CUDA executor for one device.
pub struct CudaExecutor {
    ordinal: usize,
    name: String,
}

impl CudaExecutor {
    /// True when the CUDA driver library is present and reports at least one device.
    /// Never panics (cudarc panics when libcuda is missing, so this checks first).
    pub fn usable() -> bool {
        driver::device_count().map(|n| n > 0).unwrap_or(false)
    }

    /// Opens device `ordinal`, or returns [`ExecError::Unavailable`] with the reason.
    pub fn new(ordinal: usize) -> Result<CudaExecutor, ExecError> {
        let unavailable = |reason: String| ExecError::Unavailable {
            backend: Backend::Cuda,
            reason,
        };
        let count = driver::device_count().map_err(unavailable)?;
        if ordinal >= count {
            return Err(unavailable(format!(
                "device {ordinal} requested, {count} present"
            )));
        }
        let name = driver::device_name(ordinal).map_err(unavailable)?;
        // The skeleton stops here: buffers, modules and launches come with the CUDA data paths.
        Err(unavailable(format!(
            "device {ordinal} ({name}) found, but the CUDA executor's data paths are not implemented yet"
        )))
    }

    /// The device ordinal this executor drives.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn not_implemented(&self, what: &str) -> ExecError {
        ExecError::Unavailable {
            backend: Backend::Cuda,
            reason: format!("{what} is not implemented in the CUDA executor skeleton"),
        }
    }
}

impl Executor for CudaExecutor {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }
    fn device_name(&self) -> String {
        self.name.clone()
    }
    fn alloc(&self, _kind: MemKind, _bytes: usize, _fill: u8) -> Result<BufferId, ExecError> {
        Err(self.not_implemented("alloc"))
    }
    fn free(&self, _buffer: BufferId) -> Result<(), ExecError> {
        Err(self.not_implemented("free"))
    }
    fn size(&self, _buffer: BufferId) -> Result<usize, ExecError> {
        Err(self.not_implemented("size"))
    }
    fn upload(&self, _buffer: BufferId, _offset: u64, _data: &[u8]) -> Result<(), ExecError> {
        Err(self.not_implemented("upload"))
    }
    fn read(&self, _buffer: BufferId, _offset: u64, _out: &mut [u8]) -> Result<(), ExecError> {
        Err(self.not_implemented("read"))
    }
    fn load_kernel(&self, _artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        Err(self.not_implemented("load_kernel"))
    }
    fn launch(
        &self,
        _k: KernelId,
        _c: &LaunchConfig,
        _a: &[KernelArg<'_>],
    ) -> Result<(), ExecError> {
        Err(self.not_implemented("launch"))
    }
    fn synchronize(&self) -> Result<(), ExecError> {
        Err(self.not_implemented("synchronize"))
    }
    fn counters(&self) -> Counters {
        Counters::default()
    }
    fn inject_launch_failure(&self) {}
}
