//! The CUDA executor (cudarc driver API): device pools with `cuMemAlloc`, host pools pinned and
//! device-mapped (kernels read them directly), modules from CUBIN images, `cuLaunchKernel` with
//! `void**` parameters on the executor's stream; layer-wise loads on a second stream of
//! greatest priority, backups on a third of least priority (docs/DESIGN.md §4.4 says which
//! stream does what).
//!
//! The driver is probed before cudarc is touched (cudarc panics when libcuda is missing), so a
//! machine without a driver or device gets [`ExecError::Unavailable`].
//!
//! Peer pools go over CUDA IPC ([`Executor::export`]: `cuIpcGetMemHandle`;
//! [`Executor::import`]: `cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`, the
//! mapping's size checked with `cuMemGetAddressRange`, closed with `cuIpcCloseMemHandle` when
//! the buffer is freed). CUDA cannot open a handle in the process that exported it (the driver
//! fails with `CUDA_ERROR_INVALID_CONTEXT`), so the executor refuses that itself with
//! [`ExecError::IpcSameProcess`] and says it cannot map in-process
//! ([`Executor::maps_in_process`]): ranks in one process on one GPU share one executor and
//! use each other's buffers directly; IPC is for ranks in separate processes. The exported
//! bytes are laid out in the private `ipc` module.
//!
//! Status: written against the driver API and run end to end (IPC across processes
//! included) on the stand-in driver of `tests/fake_cuda/`; not yet run on a GPU (the
//! development machine has none).
//!
//! Thread-safety: `Send + Sync`; one mutex serialises buffer bookkeeping and launches, and all
//! work but a layer-wise load's and a backup's goes to the executor's stream, so operations
//! are stream-ordered in call order; a load's or backup's work is ordered after what came
//! before it, and later work after it only through its events.

mod driver;
use driver::Lane;
mod numa;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};

use super::launch::{Marshalled, TableWrite};
use super::registry::Registry;
use super::PendingLaunch;
use super::{
    check_range, check_regions, Backend, BufferId, CopyRegion, Counters, DmaMode, EventId,
    ExecError, Executor, KernelArg, KernelArtifact, KernelId, KernelSignature, LaunchConfig,
    LaunchFailure, LoadOp, MemKind,
};

enum CudaBuffer {
    /// `cuMemAlloc`; `shareable` when [`Executor::alloc_shareable`] made it (it may be
    /// exported).
    Device {
        mem: driver::DeviceMem,
        shareable: bool,
    },
    Host(driver::PinnedMem),
    /// A peer process's device buffer, opened from its IPC handle.
    Imported(driver::IpcMem),
    /// Memory the caller owns (an engine's tensor; [`Executor::adopt`]): never freed here.
    Borrowed {
        /// Its device address.
        addr: u64,
        /// Its size in bytes.
        len: usize,
    },
}

impl CudaBuffer {
    fn addr(&self) -> u64 {
        match self {
            CudaBuffer::Device { mem, .. } => mem.addr(),
            CudaBuffer::Host(m) => m.addr(),
            CudaBuffer::Imported(m) => m.addr(),
            CudaBuffer::Borrowed { addr, .. } => *addr,
        }
    }
    fn len(&self) -> usize {
        match self {
            CudaBuffer::Device { mem, .. } => mem.len(),
            CudaBuffer::Host(m) => m.len(),
            CudaBuffer::Imported(m) => m.len(),
            CudaBuffer::Borrowed { len, .. } => *len,
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
    /// The driver is the tests' stand-in, which runs host libraries as its modules.
    emulated: bool,
    ordinal: usize,
    name: String,
    capability: (u32, u32),
    gpu: driver::Gpu,
    state: Mutex<State>,
    /// Pinned memory uploads pass through; locked after `state`.
    staging: Mutex<driver::Staging>,
    /// Events recorded for later waits ([`Executor::record_event`]), and released ones
    /// kept for reuse.
    events: Mutex<EventPool>,
    /// Page tables as last written, per buffer; locked after `state`.
    tables: Mutex<HashMap<BufferId, Vec<CachedTable>>>,
    /// Freed buffers whose memory goes back to the driver once their events complete.
    reaper: Mutex<Vec<Doomed>>,
    fail_next_launch: AtomicBool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn driver_err(op: &'static str) -> impl FnOnce(String) -> ExecError {
    move |message| ExecError::Driver { op, message }
}

impl CudaExecutor {
    /// Writes `data` at `offset` in `buffer` in stream order ([`Executor::upload`]), under the
    /// state lock the caller holds (a launch writes its page tables this way).
    fn write_locked(
        &self,
        gpu: &driver::Gpu,
        st: &mut State,
        buffer: BufferId,
        offset: u64,
        data: &[u8],
    ) -> Result<(), ExecError> {
        let buf = st.buffer_mut(buffer)?;
        let off = check_range("upload", buffer, buf.len(), offset, data.len() as u64)?.start;
        // Only the tables these bytes overwrite: forgetting the buffer's others would forget
        // which of them the load stream read, and a later rewrite of one would not wait for it
        // (a step's second load-back, then a verify's table, raced that way).
        self.forget_tables_in(buffer, off as u64..(off + data.len()) as u64);
        match buf {
            // Bounds checked above; the buffer stays alive while the lock is held, and freeing
            // it later waits for the copy (cuMemFree / cuIpcCloseMemHandle after a sync).
            CudaBuffer::Device { .. } | CudaBuffer::Imported(_) | CudaBuffer::Borrowed { .. } => {
                let dst = buf.addr() + off as u64;
                let mut staging = self.staging.lock().unwrap_or_else(|p| p.into_inner());
                let rings = staging.rings();
                driver::upload_in_bounds(gpu, &mut staging, dst, data)
                    .map_err(driver_err("upload"))?;
                // A new staging ring is a page-locked allocation: counted, so that a load
                // path that needed one shows it.
                st.counters.allocs += (staging.rings() - rings) as u64;
            }
            // Pinned host memory is written by the CPU once the stream is idle: a counted
            // synchronisation (host buffers are never uploaded to on the load path).
            CudaBuffer::Host(m) => {
                m.write_after(gpu, off, data)
                    .map_err(driver_err("upload"))?;
                st.counters.syncs += 1;
            }
        }
        st.counters.uploads += 1;
        st.counters.bytes_uploaded += data.len() as u64;
        Ok(())
    }

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
            emulated: stand_in_driver(),
            ordinal,
            capability,
            name: gpu.name(),
            gpu,
            state: Mutex::new(Registry::new()),
            staging: Mutex::new(driver::Staging::default()),
            events: Mutex::new(EventPool::default()),
            tables: Mutex::new(HashMap::new()),
            reaper: Mutex::new(Vec::new()),
            fail_next_launch: AtomicBool::new(false),
        })
    }

    /// The device ordinal this executor drives.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's PCI bus id and the NUMA node it hangs off, where known: pinned host
    /// memory (the host pools, staging) is allocated on that node (`info` says so).
    pub fn host_numa(&self) -> (Option<String>, Option<u32>) {
        self.gpu.place()
    }
}

/// Whether the libcuda this process loaded is the tests' stand-in driver
/// (`tests/fake_cuda/libcuda.cpp`, which exports its own counters): a real driver never
/// has `fake_cuda_live_allocations`.
fn stand_in_driver() -> bool {
    ["libcuda.so", "libcuda.so.1"].into_iter().any(|name| {
        // SAFETY: loading the driver library the process already uses (dlopen returns the
        // same handle) runs no new initialisers; only a symbol's presence is looked up.
        unsafe {
            libloading::Library::new(name).is_ok_and(|lib| {
                lib.get::<unsafe extern "C" fn() -> i32>(b"fake_cuda_live_allocations")
                    .is_ok()
            })
        }
    })
}

impl Executor for CudaExecutor {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn runs_emulated_kernels(&self) -> bool {
        self.emulated
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
        self.reap();
        let buf = match kind {
            MemKind::Device => CudaBuffer::Device {
                mem: self.gpu.alloc_device(bytes, fill).map_err(alloc_err)?,
                shareable: false,
            },
            MemKind::Host => CudaBuffer::Host(self.gpu.alloc_host(bytes, fill).map_err(alloc_err)?),
        };
        Ok(lock(&self.state).add_buffer(buf))
    }

    fn free(&self, buffer: BufferId) -> Result<(), ExecError> {
        let buf = lock(&self.state).remove_buffer(buffer)?;
        self.forget_tables(buffer);
        // The memory goes back to the driver once the executor's three streams have passed
        // the work enqueued so far (events, queried later: no host wait, and never a
        // context-wide synchronisation, which would wait on an engine's streams too).
        // `remove_buffer` counted it in `frees`, which `Counters::stalls` includes (the
        // load-path check: cuMemFree may still stall the device).
        let mut marks = Vec::with_capacity(3);
        for gpu in [Lane::Main, Lane::Load, Lane::Backup].map(|l| self.gpu.lane(l)) {
            let ev = self.spare_event()?;
            gpu.record_into(&ev).map_err(driver_err("free"))?;
            marks.push(ev);
        }
        self.reaper().push(Doomed { buf, marks });
        self.reap();
        Ok(())
    }

    /// Device memory from `cuMemAlloc` (any such allocation can be exported; only these
    /// are, so a scratch buffer is never handed to a peer by mistake).
    fn alloc_shareable(&self, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        let mem = self
            .gpu
            .alloc_device(bytes, fill)
            .map_err(|reason| ExecError::Alloc {
                bytes,
                kind: MemKind::Device,
                reason,
            })?;
        Ok(lock(&self.state).add_buffer(CudaBuffer::Device {
            mem,
            shareable: true,
        }))
    }

    /// The buffer's `CUipcMemHandle` (`cuIpcGetMemHandle`) with what an importer needs
    /// besides: its size, and which process and buffer it came from (the `ipc` module).
    fn export(&self, buffer: BufferId) -> Result<Vec<u8>, ExecError> {
        let st = lock(&self.state);
        let (mem, len) = match st.buffer(buffer)? {
            CudaBuffer::Device {
                mem,
                shareable: true,
            } => (mem, mem.len()),
            _ => {
                return Err(ExecError::Peer {
                    op: "export",
                    message: format!("buffer {buffer:?} was not allocated shareable"),
                })
            }
        };
        let handle = self.gpu.ipc_handle(mem).map_err(|e| ExecError::Peer {
            op: "export",
            message: format!("buffer {buffer:?} ({len} bytes): {e}"),
        })?;
        Ok(ipc::Exported {
            pid: std::process::id(),
            process: ipc::process_token(),
            buffer,
            len: len as u64,
            handle,
        }
        .to_bytes())
    }

    /// Opens a peer process's exported buffer (`cuIpcOpenMemHandle`, lazily enabling peer
    /// access); freeing the returned buffer closes it (`cuIpcCloseMemHandle`). A handle this
    /// process exported is refused with [`ExecError::IpcSameProcess`] before the driver sees
    /// it: CUDA cannot open it here, and ranks in one process share one executor instead.
    fn import(&self, handle: &[u8]) -> Result<BufferId, ExecError> {
        let h = ipc::Exported::parse(handle)?;
        if h.process == ipc::process_token() {
            return Err(ExecError::IpcSameProcess {
                buffer: h.buffer,
                pid: h.pid,
            });
        }
        let len = usize::try_from(h.len).map_err(|_| ExecError::Peer {
            op: "import",
            message: format!(
                "buffer {:?} of process {} is {} bytes",
                h.buffer, h.pid, h.len
            ),
        })?;
        let mem = self
            .gpu
            .ipc_open(&h.handle, len)
            .map_err(|e| ExecError::Peer {
                op: "import",
                message: format!(
                    "buffer {:?} ({len} bytes) of process {}: {e}",
                    h.buffer, h.pid
                ),
            })?;
        Ok(lock(&self.state).add_buffer(CudaBuffer::Imported(mem)))
    }

    /// `"ipc"`: CUDA IPC, across processes only ([`Executor::maps_in_process`] is false).
    fn peer_mapping(&self) -> Option<&'static str> {
        Some("ipc")
    }

    fn maps_in_process(&self) -> bool {
        false
    }

    fn size(&self, buffer: BufferId) -> Result<usize, ExecError> {
        lock(&self.state).buffer(buffer).map(CudaBuffer::len)
    }

    fn address(&self, buffer: BufferId) -> Result<super::Address, ExecError> {
        let st = lock(&self.state);
        let b = st.buffer(buffer)?;
        Ok(super::Address {
            ptr: b.addr(),
            // Pinned host memory is host memory (DLPack's CUDA-host is readable as CPU).
            space: match b {
                CudaBuffer::Host(_) => super::AddressSpace::Host,
                _ => super::AddressSpace::Cuda(self.ordinal as i32),
            },
        })
    }

    fn upload(&self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        self.write_locked(&self.gpu, &mut st, buffer, offset, data)
    }

    fn read(&self, buffer: BufferId, offset: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer(buffer)?;
        let off = check_range("read", buffer, buf.len(), offset, out.len() as u64)?.start;
        match buf {
            CudaBuffer::Host(m) => m
                .read_after(&self.gpu, off, out)
                .map_err(driver_err("read"))?,
            device => read_checked(&self.gpu, device.addr() + off as u64, out)?,
        }
        st.counters.reads += 1;
        st.counters.bytes_read += out.len() as u64;
        Ok(())
    }

    unsafe fn load_kernel(&self, artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        let stand_in;
        let (image, entry, signature) = match *artifact {
            KernelArtifact::Cubin {
                image,
                entry,
                signature,
            } => (image, entry, signature),
            // The stand-in driver's module image names the host library it runs.
            KernelArtifact::HostLibrary {
                path,
                entry,
                signature: Some(signature),
            } if self.emulated => {
                let sizes: Vec<String> = signature
                    .params
                    .iter()
                    .map(|p| p.size.to_string())
                    .collect();
                stand_in = format!(
                    "CPHEMU1\n{}\n{entry}\n{}\n",
                    path.display(),
                    sizes.join(",")
                );
                (stand_in.as_bytes(), entry, Some(signature))
            }
            KernelArtifact::HostLibrary { .. } => {
                return Err(ExecError::WrongArtifact {
                    backend: Backend::Cuda,
                    artifact: "a host library",
                })
            }
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
        self.copy_regions_with(src, dst, regions, DmaMode::Batched)
    }

    /// One `cuMemcpyBatchAsync` for the merged batch with [`DmaMode::Batched`] when the
    /// driver exports it, else (and always with [`DmaMode::PerRegion`]) one `cuMemcpyAsync`
    /// per merged region.
    fn copy_regions_with(
        &self,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
        mode: DmaMode,
    ) -> Result<(), ExecError> {
        self.copy_on(&self.gpu, src, dst, regions, mode)
    }

    fn fill(&self, buffer: BufferId, ranges: &[(u64, u64)], byte: u8) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer_mut(buffer)?;
        let mut bytes = 0u64;
        for &(offset, len) in ranges {
            check_range("fill", buffer, buf.len(), offset, len)?;
            bytes += len;
        }
        self.forget_tables(buffer);
        let synced = match buf {
            CudaBuffer::Device { .. } | CudaBuffer::Imported(_) | CudaBuffer::Borrowed { .. } => {
                let base = buf.addr();
                let abs: Vec<(u64, u64)> = ranges.iter().map(|&(o, l)| (base + o, l)).collect();
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

    /// Whether copy batches go out as one `cuMemcpyBatchAsync` (the driver exports it, CUDA
    /// 12.8+) rather than one `cuMemcpyAsync` per merged region.
    fn batched_copies(&self) -> bool {
        driver::batch_copies()
    }

    unsafe fn adopt(&self, addr: u64, bytes: usize) -> Result<BufferId, ExecError> {
        if addr == 0 {
            return Err(ExecError::Alloc {
                bytes,
                kind: MemKind::Device,
                reason: "a null address cannot be adopted".into(),
            });
        }
        Ok(lock(&self.state).add_buffer(CudaBuffer::Borrowed { addr, len: bytes }))
    }

    unsafe fn follow_stream(&self, stream: u64) -> Result<(), ExecError> {
        self.ordered_by("follow a stream", |ev| {
            // SAFETY: the caller's contract: a live stream of this context.
            unsafe { self.gpu.follow(stream, ev) }
        })
    }

    unsafe fn lead_stream(&self, stream: u64) -> Result<(), ExecError> {
        self.ordered_by("lead a stream", |ev| {
            // SAFETY: as in `follow_stream`.
            unsafe { self.gpu.lead(stream, ev) }
        })
    }

    fn synchronize(&self) -> Result<(), ExecError> {
        lock(&self.state).counters.syncs += 1;
        self.gpu.synchronize().map_err(driver_err("synchronize"))?;
        // Both streams are idle: every freed buffer can go now.
        self.reap();
        Ok(())
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

    fn multiprocessors(&self) -> Option<u32> {
        self.gpu.multiprocessors()
    }

    fn counters(&self) -> Counters {
        lock(&self.state).counters
    }

    fn record_event(&self) -> Result<EventId, ExecError> {
        self.record_on(&self.gpu)
    }

    fn load_layers(
        &self,
        layers: &[Vec<LoadOp<'_>>],
        signals: &[&[EventId]],
    ) -> Result<Vec<EventId>, ExecError> {
        let steps: Vec<&[LoadOp<'_>]> = layers.iter().map(Vec::as_slice).collect();
        self.run_on_lane(Lane::Load, "load_layers", &steps, signals)
    }

    fn backup(&self, ops: &[LoadOp<'_>]) -> Result<EventId, ExecError> {
        let mut events = self.run_on_lane(Lane::Backup, "backup", &[ops], &[])?;
        Ok(events.pop().expect("one step, one event"))
    }

    fn event_done(&self, event: EventId) -> Result<bool, ExecError> {
        self.on_event(
            "event_done",
            event,
            |e| {
                e.try_is_complete()
                    .map_err(|e| format!("cuEventQuery: {e:?}"))
            },
            |e| self.gpu.ipc_done(e),
        )
    }

    fn wait_event(&self, event: EventId) -> Result<(), ExecError> {
        self.on_event(
            "wait_event",
            event,
            |e| self.gpu.wait_event(e),
            // SAFETY: the executor's own stream.
            |e| unsafe { self.gpu.wait_ipc(e, None) },
        )
    }

    unsafe fn wait_event_on(&self, event: EventId, stream: u64) -> Result<(), ExecError> {
        self.on_event(
            "wait_event_on",
            event,
            // SAFETY (both): the caller vouches that `stream` is a live stream of this context.
            |e| unsafe { self.gpu.wait_event_on(e, stream) },
            |e| unsafe { self.gpu.wait_ipc(e, Some(stream)) },
        )
    }

    fn release_event(&self, event: EventId) {
        let mut pool = self.events();
        if let Some(ev) = pool.live.remove(&event.0) {
            pool.spare.push(ev);
        } else if let Some(shared) = pool.shared.remove(&event.0) {
            drop(pool);
            drop(shared);
        }
    }

    fn shared_event(&self) -> Result<(EventId, Vec<u8>), ExecError> {
        let (event, handle) = self.gpu.ipc_event().map_err(driver_err("shared_event"))?;
        let id = self.keep_shared(SharedEvent { event, own: true });
        Ok((id, handle.to_vec()))
    }

    fn record_shared(&self, event: EventId) -> Result<(), ExecError> {
        self.record_shared_on(&self.gpu, event, "record_shared")
    }

    fn sync_event(&self, event: EventId) -> Result<(), ExecError> {
        self.on_event(
            "sync_event",
            event,
            |e| {
                e.synchronize()
                    .map_err(|e| format!("cuEventSynchronize: {e:?}"))
            },
            |e| self.gpu.sync_ipc(e),
        )
    }

    fn open_shared_event(&self, handle: &[u8]) -> Result<EventId, ExecError> {
        let h: [u8; driver::IPC_HANDLE_BYTES] = handle.try_into().map_err(|_| ExecError::Peer {
            op: "open_shared_event",
            message: format!(
                "an event handle of {} bytes, not the {} of a CUipcEventHandle",
                handle.len(),
                driver::IPC_HANDLE_BYTES
            ),
        })?;
        let event = self
            .gpu
            .ipc_open_event(&h)
            .map_err(driver_err("open_shared_event"))?;
        Ok(self.keep_shared(SharedEvent { event, own: false }))
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
        // SAFETY: the caller's contract.
        unsafe { self.launch_on(&self.gpu, kernel, config, args, unsigned_ok) }
    }
}

/// Events of one executor: those recorded for later waits, by id, and released ones kept
/// for reuse, so that a layer-wise load creates no event once the pool holds enough.
#[derive(Default)]
struct EventPool {
    next: u64,
    live: std::collections::HashMap<u64, cudarc::driver::CudaEvent>,
    spare: Vec<cudarc::driver::CudaEvent>,
    /// Interprocess events, by id from the same count: this executor's (`own`, which peers
    /// open) and peers' opened here. Never reused: released, they are destroyed.
    shared: std::collections::HashMap<u64, SharedEvent>,
}

struct SharedEvent {
    event: driver::IpcEvent,
    own: bool,
}

impl CudaExecutor {
    /// Enqueues `steps` on `lane`'s stream, each followed by an event (returned) and by the
    /// recordings of its `signals` (interprocess events, one list per step or none): what
    /// [`Executor::load_layers`] and [`Executor::backup`] do. The steps' page tables are
    /// written on the cache's stream first, and the lane waits for the cache's stream once,
    /// at the start (the page lists, allocations and tables it reads). If a step fails, the
    /// cache's stream waits for the steps already enqueued before the error returns: no
    /// event of theirs reaches the caller, and what the caller does next (a rollback frees
    /// and poisons the pages they touch) must come after them.
    fn run_on_lane(
        &self,
        which: Lane,
        op_name: &'static str,
        steps: &[&[LoadOp<'_>]],
        signals: &[&[EventId]],
    ) -> Result<Vec<EventId>, ExecError> {
        let lane = self.gpu.lane(which);
        let mut events = Vec::with_capacity(steps.len());
        // Whether any of the work reached the lane's stream.
        let mut started = false;
        let out = (|| {
            // The launches' page tables are written on the cache's stream first (they hold
            // the same bytes every time, so the launches below find them written and the
            // lane never writes a table another stream reads).
            // Once per distinct set of tables: a layer-wise transfer's launches all name the
            // same one.
            let mut written: Vec<Vec<&KernelArg<'_>>> = Vec::new();
            for op in steps.iter().flat_map(|s| s.iter()) {
                if let LoadOp::Launch {
                    kernel,
                    config,
                    args,
                } = op
                {
                    let tables: Vec<&KernelArg<'_>> = args
                        .iter()
                        .filter(|a| matches!(a, KernelArg::Table(..)))
                        .collect();
                    if tables.is_empty() || written.contains(&tables) {
                        continue;
                    }
                    self.prewrite_tables(*kernel, config, args)?;
                    written.push(tables);
                }
            }
            // The lane reads what was enqueued before it (page lists, allocations, tables).
            self.ordered_by(op_name, |ev| lane.after(Lane::Main, ev))?;
            for (i, ops) in steps.iter().enumerate() {
                for op in ops.iter() {
                    started = true;
                    match op {
                        LoadOp::Upload {
                            buffer,
                            offset,
                            data,
                        } => {
                            let mut st = lock(&self.state);
                            self.write_locked(&lane, &mut st, *buffer, *offset, data)?;
                        }
                        LoadOp::Launch {
                            kernel,
                            config,
                            args,
                        } => {
                            // SAFETY: not `unsigned_ok`: every check of `launch` is made.
                            unsafe { self.launch_on(&lane, *kernel, config, args, false) }?
                        }
                        LoadOp::Copy {
                            src,
                            dst,
                            regions,
                            mode,
                        } => self.copy_on(&lane, *src, *dst, regions, *mode)?,
                    }
                }
                events.push(self.record_on(&lane)?);
                for &signal in signals.get(i).copied().unwrap_or_default() {
                    self.record_shared_on(&lane, signal, op_name)?;
                }
            }
            Ok(())
        })();
        match out {
            Ok(()) => Ok(events),
            Err(e) => {
                if started {
                    if let Err(order) = self.ordered_by(op_name, |ev| self.gpu.after(which, ev)) {
                        tracing::warn!("a failed {op_name} could not be ordered: {order}");
                        let _ = self.gpu.synchronize();
                    }
                }
                for ev in events {
                    self.release_event(ev);
                }
                Err(e)
            }
        }
    }

    /// Records `event`, one of this executor's interprocess events, on `gpu`'s stream.
    fn record_shared_on(
        &self,
        gpu: &driver::Gpu,
        event: EventId,
        op: &'static str,
    ) -> Result<(), ExecError> {
        let pool = self.events();
        match pool.shared.get(&event.0) {
            Some(s) if s.own => gpu.record_ipc(&s.event).map_err(driver_err(op)),
            _ => Err(ExecError::Driver {
                op,
                message: format!(
                    "{event:?} is not an interprocess event of this executor (a peer's opened \
                     here is only waited on)"
                ),
            }),
        }
    }

    fn events(&self) -> MutexGuard<'_, EventPool> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `live` on `event` of this executor's pool, or `shared` when it is an interprocess
    /// one (this executor's or a peer's opened here); refuses an event that is neither (of
    /// another executor, or released) for `op`.
    fn on_event<T>(
        &self,
        op: &'static str,
        event: EventId,
        live: impl FnOnce(&cudarc::driver::CudaEvent) -> Result<T, String>,
        shared: impl FnOnce(&driver::IpcEvent) -> Result<T, String>,
    ) -> Result<T, ExecError> {
        let pool = self.events();
        let out = match (pool.live.get(&event.0), pool.shared.get(&event.0)) {
            (Some(e), _) => live(e),
            (None, Some(s)) => shared(&s.event),
            (None, None) => {
                return Err(ExecError::Driver {
                    op,
                    message: format!(
                        "{event:?} is not an event of this executor (or was released)"
                    ),
                })
            }
        };
        out.map_err(driver_err(op))
    }

    /// Keeps an interprocess event under a new id.
    fn keep_shared(&self, event: SharedEvent) -> EventId {
        let mut pool = self.events();
        pool.next += 1;
        let id = pool.next;
        pool.shared.insert(id, event);
        EventId(id)
    }

    /// A released event, or a new one when none is.
    fn spare_event(&self) -> Result<cudarc::driver::CudaEvent, ExecError> {
        let spare = self.events().spare.pop();
        match spare {
            Some(ev) => Ok(ev),
            None => self.gpu.new_event().map_err(driver_err("record_event")),
        }
    }

    /// Orders two streams with a pooled event (`order`: record on one, wait on the other),
    /// then gives the event back at once: the wait took its state at the call.
    fn ordered_by(
        &self,
        op: &'static str,
        order: impl FnOnce(&cudarc::driver::CudaEvent) -> Result<(), String>,
    ) -> Result<(), ExecError> {
        let ev = self.spare_event()?;
        let out = order(&ev).map_err(driver_err(op));
        self.events().spare.push(ev);
        out
    }

    /// An event recorded at the current end of `gpu`'s stream, kept for waits by its id.
    fn record_on(&self, gpu: &driver::Gpu) -> Result<EventId, ExecError> {
        let ev = self.spare_event()?;
        if let Err(e) = gpu.record_into(&ev) {
            self.events().spare.push(ev);
            return Err(driver_err("record_event")(e));
        }
        let mut pool = self.events();
        pool.next += 1;
        let id = pool.next;
        pool.live.insert(id, ev);
        Ok(EventId(id))
    }

    /// Checks the launch against the kernel's signature (refusing an unsigned kernel unless
    /// `unsigned_ok`), resolves and bounds the pointers, then calls `cuLaunchKernel`.
    ///
    /// # Safety
    /// As [`Executor::launch_with`]; the work goes to `gpu`'s stream.
    unsafe fn launch_on(
        &self,
        gpu: &driver::Gpu,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        st.counters.launches += 1;
        let marshalled = marshal_locked(
            &st,
            kernel,
            config,
            args,
            unsigned_ok,
            &self.fail_next_launch,
        )?;
        // The page tables' checked addresses go in first, on the launch's stream, unless
        // they are there already.
        for t in &marshalled.tables {
            self.write_table_locked(gpu, &mut st, t)?;
        }
        {
            // Tables in a buffer the kernel writes are not what was written any more.
            let mut cache = self.tables();
            if !cache.is_empty() {
                for a in marshalled.accesses.iter().filter(|a| a.writes) {
                    cache.remove(&a.buffer);
                }
            }
        }
        let st = &*st;
        let k = st.kernel(kernel)?;
        if self.emulated && driver::declares_accesses() {
            let accesses: Vec<[u64; 3]> = marshalled
                .accesses
                .iter()
                .filter_map(|a| {
                    let base = st.buffer(a.buffer).ok()?.addr();
                    let flags = u64::from(a.writes) | (u64::from(a.sparse) << 1);
                    Some([base + a.range.start, a.range.end - a.range.start, flags])
                })
                .collect();
            driver::declare_accesses(&accesses);
        }
        let views: Vec<&[u8]> = marshalled.params.iter().map(Vec::as_slice).collect();
        // SAFETY: pointer arguments are addresses of live buffers of this executor, checked
        // to start inside them; the signature (when given) matched the arguments and each
        // buffer holds its parameter's reach; without a signature, the buffers being large
        // enough is the caller's contract (`Executor::launch_unchecked`).
        let launched = unsafe { launch_checked(gpu, &k.module, config, &views) };
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

    /// Writes the page tables of a launch the load stream is about to run, on the cache's
    /// stream ([`CudaExecutor::run_on_lane`]); a launch that would be refused writes nothing
    /// here (it is refused when it is enqueued), and an armed injected failure stays armed.
    fn prewrite_tables(
        &self,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
    ) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let not_armed = AtomicBool::new(false);
        let Ok(marshalled) = marshal_locked(&st, kernel, config, args, false, &not_armed) else {
            return Ok(());
        };
        for t in &marshalled.tables {
            self.write_table_locked(&self.gpu, &mut st, t)?;
        }
        Ok(())
    }

    /// Writes page table `t` on `gpu`'s stream, unless the bytes there are the ones it holds
    /// (tables are written once and read by every later launch: no stream rewrites what
    /// another stream's launch may be reading). A table that does change, after the load
    /// stream read it, is rewritten once the load stream's work so far has run.
    fn write_table_locked(
        &self,
        gpu: &driver::Gpu,
        st: &mut State,
        t: &TableWrite,
    ) -> Result<(), ExecError> {
        let lane = gpu.which();
        let mut cache = self.tables();
        let entries = cache.entry(t.buffer).or_default();
        if let Some(e) = entries
            .iter_mut()
            .find(|e| e.offset == t.offset && e.bytes == t.bytes)
        {
            if lane != Lane::Main && !e.read_by.contains(&lane) {
                e.read_by.push(lane);
            }
            return Ok(());
        }
        let end = t.offset + t.bytes.len() as u64;
        let overlaps =
            |e: &CachedTable| e.offset < end && t.offset < e.offset + e.bytes.len() as u64;
        // The side lanes that read a table these bytes overwrite, other than the writer's.
        let mut after: Vec<Lane> = Vec::new();
        for e in entries.iter().filter(|e| overlaps(e)) {
            for &l in &e.read_by {
                if l != lane && !after.contains(&l) {
                    after.push(l);
                }
            }
        }
        entries.retain(|e| !overlaps(e));
        drop(cache);
        for l in after {
            self.ordered_by("write a page table", |ev| gpu.after(l, ev))?;
        }
        self.write_locked(gpu, st, t.buffer, t.offset, &t.bytes)?;
        self.tables()
            .entry(t.buffer)
            .or_default()
            .push(CachedTable {
                offset: t.offset,
                bytes: t.bytes.clone(),
                read_by: if lane == Lane::Main {
                    Vec::new()
                } else {
                    vec![lane]
                },
            });
        Ok(())
    }

    fn tables(&self) -> MutexGuard<'_, HashMap<BufferId, Vec<CachedTable>>> {
        self.tables.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets the tables written in `buffer` that overlap `range`: something else wrote
    /// those bytes.
    fn forget_tables_in(&self, buffer: BufferId, range: std::ops::Range<u64>) {
        let mut cache = self.tables();
        if let Some(entries) = cache.get_mut(&buffer) {
            entries.retain(|e| {
                e.offset + e.bytes.len() as u64 <= range.start || range.end <= e.offset
            });
        }
    }

    /// Forgets the tables written in `buffer`: something else wrote (or freed) it.
    fn forget_tables(&self, buffer: BufferId) {
        let mut cache = self.tables();
        if !cache.is_empty() {
            cache.remove(&buffer);
        }
    }

    /// [`Executor::copy_regions_with`] on `gpu`'s stream.
    fn copy_on(
        &self,
        gpu: &driver::Gpu,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
        mode: DmaMode,
    ) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let (s, d) = (st.buffer(src)?, st.buffer(dst)?);
        let bytes = check_regions((src, s.len()), (dst, d.len()), regions)?;
        self.forget_tables(dst);
        // One copy per contiguous run (super::merge_regions), not per page blob.
        let copies: Vec<(u64, u64, u64)> = super::merge_regions(regions, src == dst)
            .iter()
            .map(|r| (d.addr() + r.dst_offset, s.addr() + r.src_offset, r.len))
            .collect();
        let batch = mode == DmaMode::Batched && driver::batch_copies();
        driver::copy_in_bounds(gpu, &copies, batch).map_err(driver_err("copy_regions"))?;
        st.counters.copies += 1;
        st.counters.bytes_copied += bytes;
        Ok(())
    }
}

/// A launch's arguments checked and laid out ([`PendingLaunch::marshal`]), under the state
/// lock the caller holds; `fail_next` is the armed injected failure it may consume.
fn marshal_locked(
    st: &State,
    kernel: KernelId,
    config: &LaunchConfig,
    args: &[KernelArg<'_>],
    unsigned_ok: bool,
    fail_next: &AtomicBool,
) -> Result<Marshalled, ExecError> {
    let k = st.kernel(kernel)?;
    PendingLaunch {
        kernel: &k.name,
        signature: k.signature.as_ref(),
        unsigned_ok,
        config,
        args,
    }
    .marshal(fail_next, |b| {
        let buf = st.buffer(b)?;
        Ok((buf.addr(), buf.len()))
    })
}

/// A freed buffer and the events after which nothing of the executor's uses it.
struct Doomed {
    buf: CudaBuffer,
    marks: Vec<cudarc::driver::CudaEvent>,
}

impl CudaExecutor {
    fn reaper(&self) -> MutexGuard<'_, Vec<Doomed>> {
        self.reaper.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Returns to the driver the freed buffers whose events have completed (queried, never
    /// waited for), oldest first; their events go back to the pool.
    fn reap(&self) {
        let done: Vec<Doomed> = {
            let mut doomed = self.reaper();
            let mut done = Vec::new();
            let mut i = 0;
            while i < doomed.len() {
                let complete = doomed[i]
                    .marks
                    .iter()
                    .all(|e| e.try_is_complete().unwrap_or(false));
                if complete {
                    done.push(doomed.remove(i));
                } else {
                    i += 1;
                }
            }
            done
        };
        for d in done {
            drop(d.buf);
            self.events().spare.extend(d.marks);
        }
    }
}

impl Drop for CudaExecutor {
    /// The executor's own streams finish their work before its memory goes (never a
    /// context-wide synchronisation: other executors and an engine share the context).
    fn drop(&mut self) {
        if let Err(e) = self.gpu.synchronize() {
            tracing::warn!("the CUDA executor's streams did not finish cleanly: {e}");
        }
        let doomed = std::mem::take(&mut *self.reaper());
        drop(doomed);
    }
}

/// A page table as the executor last wrote it ([`CudaExecutor::write_table_locked`]).
struct CachedTable {
    offset: u64,
    bytes: Vec<u8>,
    /// The side lanes (load, backup) whose launches read it since it was written.
    read_by: Vec<Lane>,
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

/// The bytes [`Executor::export`] gives a peer: `CPHCIPC1`, the exporter's pid (u32), a token
/// that tells this process from any other (u64, also across PID namespaces), the exporter's
/// buffer id (u64) and size (u64), all little-endian, then the 64-byte `CUipcMemHandle`.
pub(crate) mod ipc {
    use super::driver::IPC_HANDLE_BYTES;
    use crate::exec::{BufferId, ExecError};
    use std::sync::OnceLock;

    const MAGIC: &[u8; 8] = b"CPHCIPC1";
    /// Length of an exported handle.
    pub(crate) const LEN: usize = 8 + 4 + 8 + 8 + 8 + IPC_HANDLE_BYTES;

    /// An exported buffer, as it travels between processes.
    pub(crate) struct Exported {
        pub(crate) pid: u32,
        pub(crate) process: u64,
        pub(crate) buffer: BufferId,
        pub(crate) len: u64,
        pub(crate) handle: [u8; IPC_HANDLE_BYTES],
    }

    /// This process's token: its pid, the time it first exported, and an address in it.
    pub(crate) fn process_token() -> u64 {
        static TOKEN: OnceLock<u64> = OnceLock::new();
        *TOKEN.get_or_init(|| {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let here = &TOKEN as *const _ as u64;
            let x = nanos ^ u64::from(std::process::id()).rotate_left(32) ^ here.rotate_left(17);
            crate::splitmix::mix64(x) | 1
        })
    }

    impl Exported {
        pub(crate) fn to_bytes(&self) -> Vec<u8> {
            let mut out = Vec::with_capacity(LEN);
            out.extend_from_slice(MAGIC);
            out.extend_from_slice(&self.pid.to_le_bytes());
            out.extend_from_slice(&self.process.to_le_bytes());
            out.extend_from_slice(&self.buffer.0.to_le_bytes());
            out.extend_from_slice(&self.len.to_le_bytes());
            out.extend_from_slice(&self.handle);
            out
        }

        pub(crate) fn parse(bytes: &[u8]) -> Result<Exported, ExecError> {
            if bytes.len() != LEN || !bytes.starts_with(MAGIC) {
                return Err(ExecError::Peer {
                    op: "import",
                    message: format!(
                        "not a CUDA IPC handle of this executor ({} bytes; {LEN} starting \
                         with CPHCIPC1 expected)",
                        bytes.len()
                    ),
                });
            }
            let u64_at = |i: usize| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&bytes[i..i + 8]);
                u64::from_le_bytes(b)
            };
            let mut pid = [0u8; 4];
            pid.copy_from_slice(&bytes[8..12]);
            let mut handle = [0u8; IPC_HANDLE_BYTES];
            handle.copy_from_slice(&bytes[36..]);
            Ok(Exported {
                pid: u32::from_le_bytes(pid),
                process: u64_at(12),
                buffer: BufferId(u64_at(20)),
                len: u64_at(28),
                handle,
            })
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn exported_handles_round_trip_and_bad_ones_are_refused() {
            let e = Exported {
                pid: 7,
                process: process_token(),
                buffer: BufferId(0x1234),
                len: 4096,
                handle: std::array::from_fn(|i| i as u8),
            };
            let bytes = e.to_bytes();
            assert_eq!(bytes.len(), LEN);
            let back = Exported::parse(&bytes).unwrap();
            assert_eq!(
                (back.pid, back.process, back.buffer, back.len, back.handle),
                (7, e.process, e.buffer, 4096, e.handle)
            );
            assert_eq!(process_token(), e.process, "one token per process");
            for bad in [&bytes[..LEN - 1], b"cp-hicache-shm:64:/cp-hicache-1"] {
                let err = Exported::parse(bad).err().expect("refused");
                assert!(
                    matches!(&err, ExecError::Peer { op: "import", message }
                        if message.contains("not a CUDA IPC handle")),
                    "{err}"
                );
            }
        }
    }
}
