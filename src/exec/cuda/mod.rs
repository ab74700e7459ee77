//! The CUDA executor (cudarc driver API): device pools with `cuMemAlloc`, host pools pinned and
//! device-mapped (kernels read them directly), modules from CUBIN images, `cuLaunchKernel` with
//! `void**` parameters on one stream.
//!
//! The driver is probed before cudarc is touched (cudarc panics when libcuda is missing), so a
//! machine without a driver or device gets [`ExecError::Unavailable`].
//!
//! Status: written against the driver API but not yet run on a GPU (the development machine
//! has none); the host executor is the tested path.
//!
//! Thread-safety: `Send + Sync`; one mutex serialises buffer bookkeeping and launches, and all
//! work goes to one stream, so operations are stream-ordered in call order.

mod driver;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::registry::Registry;
use super::PendingLaunch;
use super::{
    check_range, check_regions, Backend, BufferId, CopyRegion, Counters, EventId, ExecError,
    Executor, KernelArg, KernelArtifact, KernelId, LaunchConfig, LaunchFailure, MemKind,
};
use crate::kernels::KernelSignature;

enum CudaBuffer {
    Device(driver::DeviceMem),
    Host(driver::PinnedMem),
}

impl CudaBuffer {
    fn addr(&self) -> u64 {
        match self {
            CudaBuffer::Device(m) => m.addr(),
            CudaBuffer::Host(m) => m.addr(),
        }
    }
    fn len(&self) -> usize {
        match self {
            CudaBuffer::Device(m) => m.len(),
            CudaBuffer::Host(m) => m.len(),
        }
    }
}

struct LoadedKernel {
    name: String,
    module: driver::Module,
    signature: Option<KernelSignature>,
}

type State = Registry<CudaBuffer, LoadedKernel>;

/// The CUDA executor for one device.
pub struct CudaExecutor {
    ordinal: usize,
    name: String,
    capability: (u32, u32),
    gpu: driver::Gpu,
    state: Mutex<State>,
    /// Pinned memory uploads pass through; locked after `state`.
    staging: Mutex<driver::Staging>,
    /// Events recorded for later waits ([`Executor::record_event`]), by id.
    events: Mutex<(
        u64,
        std::collections::HashMap<u64, cudarc::driver::CudaEvent>,
    )>,
    fail_next_launch: AtomicBool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn driver_err(op: &'static str) -> impl FnOnce(String) -> ExecError {
    move |message| ExecError::Driver { op, message }
}

impl CudaExecutor {
    /// True when the CUDA driver library is present and reports at least one device.
    /// Never panics (cudarc panics when libcuda is missing, so this checks first).
    pub fn usable() -> bool {
        driver::device_count().map(|n| n > 0).unwrap_or(false)
    }

    /// What the driver probe found: the device count, or why there is none (for `info`).
    pub fn probe() -> Result<usize, String> {
        driver::device_count()
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
        let gpu = driver::Gpu::open(ordinal).map_err(unavailable)?;
        let capability = gpu.compute_capability().map_err(unavailable)?;
        Ok(CudaExecutor {
            ordinal,
            capability,
            name: gpu.name(),
            gpu,
            state: Mutex::new(Registry::new()),
            staging: Mutex::new(driver::Staging::default()),
            events: Mutex::new((0, std::collections::HashMap::new())),
            fail_next_launch: AtomicBool::new(false),
        })
    }

    /// Whether copy batches go out as one `cuMemcpyBatchAsync` (the driver exports it, CUDA
    /// 12.8+) rather than one `cuMemcpyAsync` per merged region.
    pub fn batched_copies(&self) -> bool {
        driver::batch_copies()
    }

    /// The device ordinal this executor drives.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }
}

impl Executor for CudaExecutor {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn compute_capability(&self) -> Option<(u32, u32)> {
        Some(self.capability)
    }

    fn alloc(&self, kind: MemKind, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        let alloc_err = |reason: String| ExecError::Alloc {
            bytes,
            kind,
            reason,
        };
        let buf = match kind {
            MemKind::Device => {
                CudaBuffer::Device(self.gpu.alloc_device(bytes, fill).map_err(alloc_err)?)
            }
            MemKind::Host => CudaBuffer::Host(self.gpu.alloc_host(bytes, fill).map_err(alloc_err)?),
        };
        Ok(lock(&self.state).add_buffer(buf))
    }

    fn free(&self, buffer: BufferId) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.remove_buffer(buffer)?;
        // Releasing the memory waits for all work of the context (`DeviceMem` / `PinnedMem`
        // drops synchronise before cuMemFree / cuMemFreeHost); `remove_buffer` counted it
        // in `frees`, which `Counters::stalls` includes (the load-path check).
        drop(buf);
        Ok(())
    }

    fn size(&self, buffer: BufferId) -> Result<usize, ExecError> {
        lock(&self.state).buffer(buffer).map(CudaBuffer::len)
    }

    fn upload(&self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer_mut(buffer)?;
        let off = check_range("upload", buffer, buf.len(), offset, data.len() as u64)?.start;
        match buf {
            // Bounds checked above; the buffer stays alive while the lock is held, and freeing
            // it later waits for the copy (cuMemFree synchronises).
            CudaBuffer::Device(m) => {
                let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
                let rings = staging.rings();
                driver::upload_in_bounds(&self.gpu, &mut staging, m.addr() + off as u64, data)
                    .map_err(driver_err("upload"))?;
                // A new staging ring is a page-locked allocation: counted, so that a load
                // path that needed one shows it.
                st.counters.allocs += (staging.rings() - rings) as u64;
            }
            // Pinned host memory is written by the CPU once the stream is idle: a counted
            // synchronisation (host buffers are never uploaded to on the load path).
            CudaBuffer::Host(m) => {
                m.write_after(&self.gpu, off, data)
                    .map_err(driver_err("upload"))?;
                st.counters.syncs += 1;
            }
        }
        st.counters.uploads += 1;
        st.counters.bytes_uploaded += data.len() as u64;
        Ok(())
    }

    fn read(&self, buffer: BufferId, offset: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer(buffer)?;
        let off = check_range("read", buffer, buf.len(), offset, out.len() as u64)?.start;
        match buf {
            CudaBuffer::Device(m) => read_checked(&self.gpu, m.addr() + off as u64, out)?,
            CudaBuffer::Host(m) => m
                .read_after(&self.gpu, off, out)
                .map_err(driver_err("read"))?,
        }
        st.counters.reads += 1;
        st.counters.bytes_read += out.len() as u64;
        Ok(())
    }

    unsafe fn load_kernel(&self, artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        let KernelArtifact::Cubin {
            image,
            entry,
            signature,
        } = *artifact
        else {
            return Err(ExecError::WrongArtifact {
                backend: Backend::Cuda,
                artifact: "a host library",
            });
        };
        let module = self
            .gpu
            .load(image, entry)
            .map_err(|message| ExecError::Load {
                entry: entry.to_string(),
                artifact: artifact.describe(),
                message,
            })?;
        Ok(lock(&self.state).add_kernel(LoadedKernel {
            name: entry.to_string(),
            signature: signature.cloned(),
            module,
        }))
    }

    fn copy_regions(
        &self,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
    ) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let (s, d) = (st.buffer(src)?, st.buffer(dst)?);
        let bytes = check_regions((src, s.len()), (dst, d.len()), regions)?;
        // One copy per contiguous run (super::merge_regions), not per page blob.
        let copies: Vec<(u64, u64, u64)> = super::merge_regions(regions, src == dst)
            .iter()
            .map(|r| (d.addr() + r.dst_offset, s.addr() + r.src_offset, r.len))
            .collect();
        driver::copy_in_bounds(&self.gpu, &copies).map_err(driver_err("copy_regions"))?;
        st.counters.copies += 1;
        st.counters.bytes_copied += bytes;
        Ok(())
    }

    fn fill(&self, buffer: BufferId, ranges: &[(u64, u64)], byte: u8) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer_mut(buffer)?;
        let mut bytes = 0u64;
        for &(offset, len) in ranges {
            check_range("fill", buffer, buf.len(), offset, len)?;
            bytes += len;
        }
        let synced = match buf {
            CudaBuffer::Device(m) => {
                let abs: Vec<(u64, u64)> = ranges.iter().map(|&(o, l)| (m.addr() + o, l)).collect();
                driver::fill_in_bounds(&self.gpu, &abs, byte).map_err(driver_err("fill"))?;
                false
            }
            // Pinned host memory is written by the CPU once the stream is idle, as uploads
            // to it are: a counted synchronisation.
            CudaBuffer::Host(m) => {
                m.fill_after(&self.gpu, ranges, byte)
                    .map_err(driver_err("fill"))?;
                true
            }
        };
        st.counters.syncs += u64::from(synced);
        st.counters.fills += 1;
        st.counters.bytes_filled += bytes;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), ExecError> {
        lock(&self.state).counters.syncs += 1;
        self.gpu.synchronize().map_err(driver_err("synchronize"))
    }

    fn time_work(&self, work: &mut dyn FnMut() -> Result<(), ExecError>) -> Result<f64, ExecError> {
        let start = self.gpu.record_event().map_err(driver_err("time_work"))?;
        work()?;
        let end = self.gpu.record_event().map_err(driver_err("time_work"))?;
        let ms = driver::Gpu::elapsed_ms(&start, &end).map_err(driver_err("time_work"))?;
        lock(&self.state).counters.syncs += 1;
        Ok(f64::from(ms) / 1e3)
    }

    fn companion(&self) -> Result<Option<Box<dyn Executor>>, ExecError> {
        // The same device's primary context, a stream of its own.
        Ok(Some(Box::new(CudaExecutor::new(self.ordinal)?)))
    }

    fn counters(&self) -> Counters {
        lock(&self.state).counters
    }

    fn record_event(&self) -> Result<EventId, ExecError> {
        let event = self.gpu.mark().map_err(driver_err("record_event"))?;
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        ev.0 += 1;
        let id = ev.0;
        ev.1.insert(id, event);
        Ok(EventId(id))
    }

    fn wait_event(&self, event: EventId) -> Result<(), ExecError> {
        let ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let e = ev.1.get(&event.0).ok_or(ExecError::Driver {
            op: "wait_event",
            message: format!("{event:?} is not an event of this executor (or was released)"),
        })?;
        self.gpu.wait_event(e).map_err(driver_err("wait_event"))
    }

    fn release_event(&self, event: EventId) {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        ev.1.remove(&event.0);
    }

    fn inject_launch_failure(&self) {
        self.fail_next_launch.store(true, Ordering::SeqCst);
    }

    fn disarm_launch_failure(&self) -> bool {
        self.fail_next_launch.swap(false, Ordering::SeqCst)
    }

    /// Checks the launch against the kernel's signature (refusing an unsigned kernel unless
    /// `unsigned_ok`), resolves and bounds the pointers, then calls `cuLaunchKernel`.
    unsafe fn launch_with(
        &self,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        st.counters.launches += 1;
        let st = &*st;
        let k = st.kernel(kernel)?;
        let launch = PendingLaunch {
            kernel: &k.name,
            signature: k.signature.as_ref(),
            unsigned_ok,
            config,
            args,
        };
        let bytes = launch.marshal(&self.fail_next_launch, |b| {
            let buf = st.buffer(b)?;
            Ok((buf.addr(), buf.len()))
        })?;
        let views: Vec<&[u8]> = bytes.iter().map(Vec::as_slice).collect();
        // SAFETY: pointer arguments are addresses of live buffers of this executor, checked
        // to start inside them; the signature (when given) matched the arguments and each
        // buffer holds its parameter's reach; without a signature, the buffers being large
        // enough is the caller's contract (`Executor::launch_unchecked`).
        let launched = unsafe { launch_checked(&self.gpu, &k.module, config, &views) };
        launched.map_err(|message| ExecError::Launch {
            kernel: k.name.clone(),
            // A bad shape or a block too large for the kernel's registers is rejected at launch;
            // faults inside a kernel surface later (read / synchronize) and are sticky: the
            // context cannot be used again, unlike a rejected launch.
            cause: if ["INVALID_VALUE", "OUT_OF_RESOURCES"]
                .iter()
                .any(|c| message.contains(c))
            {
                LaunchFailure::InvalidConfig
            } else {
                LaunchFailure::Other
            },
            message,
        })
    }
}

// Forwarders to `driver`'s checked entry points; their preconditions (ranges inside live
// allocations) are established by the callers above, which hold the state lock.
fn read_checked(gpu: &driver::Gpu, src: u64, out: &mut [u8]) -> Result<(), ExecError> {
    driver::read_in_bounds(gpu, src, out).map_err(driver_err("read"))
}

/// # Safety
/// As for [`driver::launch_with_args`].
unsafe fn launch_checked(
    gpu: &driver::Gpu,
    module: &driver::Module,
    config: &LaunchConfig,
    args: &[&[u8]],
) -> Result<(), String> {
    // SAFETY: guaranteed by the caller.
    unsafe {
        driver::launch_with_args(
            gpu,
            module,
            config.grid,
            config.block,
            config.shared_bytes,
            args,
        )
    }
}
