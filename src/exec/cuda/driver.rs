//! The unsafe boundary of the CUDA executor: probing for the driver library before any cudarc
//! call (cudarc panics when libcuda is missing), and owned wrappers over raw driver handles
//! (device memory, pinned device-mapped host memory, peers' memory opened over CUDA IPC, modules)
//! that release in `Drop`.

use std::collections::VecDeque;
use std::ffi::{c_void, CString};
use std::sync::Arc;

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream};

/// Whether libcuda can be loaded.
fn driver_present() -> bool {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library by its known names
    // and closes it again; it has no preconditions.
    unsafe { sys::is_culib_present() }
}

/// Number of CUDA devices, or why none can be counted.
pub(crate) fn device_count() -> Result<usize, String> {
    if !driver_present() {
        return Err("the CUDA driver library (libcuda) was not found".into());
    }
    result::init().map_err(|e| {
        if e.0 == sys::cudaError_enum::CUDA_ERROR_STUB_LIBRARY {
            "cuInit failed: the libcuda found first is the CUDA toolkit's stub library; remove \
             its folder (…/lib64/stubs) from LD_LIBRARY_PATH so the driver's libcuda.so.1 loads"
                .to_string()
        } else {
            format!("cuInit failed: {e:?}")
        }
    })?;
    let n = result::device::get_count().map_err(|e| format!("cuDeviceGetCount failed: {e:?}"))?;
    Ok(n.max(0) as usize)
}

/// A device context, the stream work goes to, and the executor's three streams. Only
/// created after [`device_count`] succeeded.
pub(crate) struct Gpu {
    ctx: Arc<CudaContext>,
    /// Where this handle's work goes: one of the three below ([`Gpu::lane`]).
    stream: Arc<CudaStream>,
    /// The executor's own stream (the cache's): everything but loads and backups.
    main: Arc<CudaStream>,
    /// Layer-wise loads run here, at the context's greatest priority, so that a load does
    /// not queue behind a model's kernels launched earlier.
    load: Arc<CudaStream>,
    /// Backups (device to host write-back) run here, at the context's least priority, so
    /// that a load never queues behind one and the link's two directions are used at once.
    backup: Arc<CudaStream>,
    /// The device's PCI bus id, and the NUMA node it hangs off (where the pinned host pool
    /// is allocated), where known.
    place: Arc<(Option<String>, Option<u32>)>,
}

/// The executor's streams ([`Gpu::lane`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lane {
    /// The cache's own stream.
    Main,
    /// Layer-wise loads, at the greatest priority.
    Load,
    /// Backups, at the least priority.
    Backup,
}

/// Whether copy batches go out as `cuMemcpyBatchAsync`: the driver exports it (CUDA 12.8+;
/// cudarc resolves driver symbols lazily and panics on a missing one, so this looks it up
/// first, once), and it has not refused a whole batch as `NOT_SUPPORTED` in this process.
pub(crate) fn batch_copies() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let has = *HAS.get_or_init(|| {
        // SAFETY: only looks the symbol up (the library is loaded: a context is open).
        unsafe { sys::culib().get::<unsafe extern "C" fn()>(b"cuMemcpyBatchAsync\0") }.is_ok()
    });
    has && !BATCH_REFUSED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Set once `cuMemcpyBatchAsync` refused a whole batch as `NOT_SUPPORTED` (a driver or
/// platform without batched copies for these memory kinds): copies go one by one since.
static BATCH_REFUSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn err(op: &str) -> impl FnOnce(result::DriverError) -> String + '_ {
    move |e| format!("{op}: {e:?}")
}

impl Gpu {
    /// Opens device `ordinal` (the driver must be present: call after [`device_count`]).
    pub(crate) fn open(ordinal: usize) -> Result<Gpu, String> {
        let ctx = CudaContext::new(ordinal).map_err(err("cuCtxCreate"))?;
        let stream = ctx.new_stream().map_err(err("cuStreamCreate"))?;
        ctx.bind_to_thread().map_err(err("cuCtxSetCurrent"))?;
        // Numerically lowest is greatest: (0, -5) on current GPUs.
        let (least, greatest) =
            result::stream::get_priority_range().map_err(err("cuCtxGetStreamPriorityRange"))?;
        let load = ctx
            .new_stream_with_priority(greatest)
            .map_err(err("cuStreamCreateWithPriority"))?;
        let backup = ctx
            .new_stream_with_priority(least)
            .map_err(err("cuStreamCreateWithPriority"))?;
        let mut id = [0 as std::ffi::c_char; 32];
        // SAFETY: `id` holds 32 bytes, which the driver fills with a NUL-terminated string.
        let bus_id = unsafe { sys::cuDeviceGetPCIBusId(id.as_mut_ptr(), 32, ctx.cu_device()) }
            .result()
            .ok()
            // SAFETY: NUL-terminated by the driver (and by the zeroed array's last byte).
            .map(|()| unsafe { std::ffi::CStr::from_ptr(id.as_ptr()) })
            .map(|s| s.to_string_lossy().into_owned());
        let node = bus_id
            .as_deref()
            .and_then(|b| super::numa::node_of(b, std::path::Path::new("/sys")));
        Ok(Gpu {
            ctx,
            main: Arc::clone(&stream),
            stream,
            load,
            backup,
            place: Arc::new((bus_id, node)),
        })
    }

    /// The device's PCI bus id and its NUMA node, where known.
    pub(crate) fn place(&self) -> (Option<String>, Option<u32>) {
        (*self.place).clone()
    }

    /// This context with `lane`'s stream as the stream work goes to.
    pub(crate) fn lane(&self, lane: Lane) -> Gpu {
        let stream = match lane {
            Lane::Main => &self.main,
            Lane::Load => &self.load,
            Lane::Backup => &self.backup,
        };
        Gpu {
            ctx: Arc::clone(&self.ctx),
            stream: Arc::clone(stream),
            main: Arc::clone(&self.main),
            load: Arc::clone(&self.load),
            backup: Arc::clone(&self.backup),
            place: Arc::clone(&self.place),
        }
    }

    /// Which of the executor's streams this handle's work goes to.
    pub(crate) fn which(&self) -> Lane {
        if Arc::ptr_eq(&self.stream, &self.load) {
            Lane::Load
        } else if Arc::ptr_eq(&self.stream, &self.backup) {
            Lane::Backup
        } else {
            Lane::Main
        }
    }

    /// A new event without timing, for [`Gpu::record_into`] and [`Gpu::order`] to reuse.
    pub(crate) fn new_event(&self) -> Result<CudaEvent, String> {
        self.ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(err("cuEventCreate"))
    }

    /// Records the current end of this handle's stream into `event` (a pooled one: an
    /// earlier recording's waits already took its state).
    pub(crate) fn record_into(&self, event: &CudaEvent) -> Result<(), String> {
        self.bind()?;
        event.record(&self.stream).map_err(err("cuEventRecord"))
    }

    /// Makes this handle's stream wait for the work enqueued so far on `lane`'s stream.
    pub(crate) fn after(&self, lane: Lane, event: &CudaEvent) -> Result<(), String> {
        let done = self.lane(lane).stream;
        // SAFETY: both streams are this context's and alive as long as `self`.
        unsafe { self.order(done.cu_stream(), self.stream.cu_stream(), event) }
    }

    /// The device name.
    pub(crate) fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|e| format!("CUDA device ({e:?})"))
    }

    /// The device's `(major, minor)` compute capability.
    pub(crate) fn compute_capability(&self) -> Result<(u32, u32), String> {
        let (major, minor) = self
            .ctx
            .compute_capability()
            .map_err(err("cuDeviceGetAttribute(compute capability)"))?;
        Ok((major.max(0) as u32, minor.max(0) as u32))
    }

    /// The device's SM count; `None` where the driver does not say (or says 0).
    pub(crate) fn multiprocessors(&self) -> Option<u32> {
        let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        match self.ctx.attribute(attr) {
            Ok(n) if n > 0 => Some(n as u32),
            _ => None,
        }
    }

    /// An event (with timing) recorded at the current end of the executor's stream.
    pub(crate) fn record_event(&self) -> Result<cudarc::driver::CudaEvent, String> {
        self.stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(err("cuEventRecord"))
    }

    /// Makes work enqueued on the executor's stream from now on wait for `event`
    /// (`cuStreamWaitEvent`: the device waits, the host does not).
    pub(crate) fn wait_event(&self, event: &cudarc::driver::CudaEvent) -> Result<(), String> {
        self.bind()?;
        self.stream.wait(event).map_err(err("cuStreamWaitEvent"))
    }

    /// Makes work enqueued on `stream`, a stream of this context that is not the executor's
    /// (an engine's raw `CUstream`; 0 the legacy default stream), wait for `event`.
    ///
    /// # Safety
    /// `stream` must be a live stream of this executor's context, or 0.
    pub(crate) unsafe fn wait_event_on(
        &self,
        event: &cudarc::driver::CudaEvent,
        stream: u64,
    ) -> Result<(), String> {
        self.bind()?;
        // SAFETY: the event is live (pooled by the executor); the caller vouches for `stream`.
        unsafe {
            result::stream::wait_event(
                stream as usize as sys::CUstream,
                event.cu_event(),
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(err("cuStreamWaitEvent"))
    }

    /// Orders two streams of this context: work enqueued on `waiter` from now on waits for
    /// the work enqueued on `done` so far (`event`, a pooled one of this context, recorded on
    /// `done` and waited on by `waiter`: the device waits, the host does not). The event may
    /// be recorded again at once: the wait takes its state at the time of the call.
    ///
    /// # Safety
    /// Both must be live streams of this executor's context.
    unsafe fn order(
        &self,
        done: sys::CUstream,
        waiter: sys::CUstream,
        event: &CudaEvent,
    ) -> Result<(), String> {
        self.bind()?;
        let ev = event.cu_event();
        // SAFETY: `ev` is alive as long as `event`; the streams are live (the caller's
        // contract).
        unsafe {
            result::event::record(ev, done)
                .map_err(err("cuEventRecord"))
                .and_then(|()| {
                    result::stream::wait_event(
                        waiter,
                        ev,
                        sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                    )
                    .map_err(err("cuStreamWaitEvent"))
                })
        }
    }

    /// Makes the executor's stream wait for the work enqueued so far on `stream` (a raw
    /// `CUstream` handle of the caller's).
    ///
    /// # Safety
    /// `stream` must be a live stream of this executor's context.
    pub(crate) unsafe fn follow(&self, stream: u64, event: &CudaEvent) -> Result<(), String> {
        // SAFETY: the caller's contract; ours is alive as long as `self`.
        unsafe { self.order(stream as sys::CUstream, self.stream.cu_stream(), event) }
    }

    /// Makes `stream` (a raw `CUstream` of the caller's) wait for the work enqueued so far on
    /// the executor's stream.
    ///
    /// # Safety
    /// As [`Gpu::follow`].
    pub(crate) unsafe fn lead(&self, stream: u64, event: &CudaEvent) -> Result<(), String> {
        // SAFETY: as in `follow`.
        unsafe { self.order(self.stream.cu_stream(), stream as sys::CUstream, event) }
    }

    /// Milliseconds between two recorded events, waiting for the second.
    pub(crate) fn elapsed_ms(
        start: &cudarc::driver::CudaEvent,
        end: &cudarc::driver::CudaEvent,
    ) -> Result<f32, String> {
        start.elapsed_ms(end).map_err(err("cuEventElapsedTime"))
    }

    fn bind(&self) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(err("cuCtxSetCurrent"))
    }

    /// Allocates `len` bytes of device memory filled with `fill` (stream-ordered).
    pub(crate) fn alloc_device(&self, len: usize, fill: u8) -> Result<DeviceMem, String> {
        self.bind()?;
        // SAFETY: the context is current; a zero-byte request is rounded up to one byte.
        let ptr = unsafe { result::malloc_sync(len.max(1)) }.map_err(err("cuMemAlloc"))?;
        let mem = DeviceMem {
            ptr,
            len,
            ctx: Arc::clone(&self.ctx),
        };
        // SAFETY: `ptr` is a live allocation of at least `len` bytes.
        unsafe { result::memset_d8_async(ptr, fill, len, self.stream.cu_stream()) }
            .map_err(err("cuMemsetD8Async"))?;
        Ok(mem)
    }

    /// Allocates `len` bytes of pinned, device-mapped host memory filled with `fill`.
    pub(crate) fn alloc_host(&self, len: usize, fill: u8) -> Result<PinnedMem, String> {
        self.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // On the GPU's NUMA node: the driver touches and pins the pages in the call.
        let preferred = self.place.1.and_then(super::numa::prefer);
        // SAFETY: the context is current; a zero-byte request is rounded up to one byte.
        let host = unsafe { result::malloc_host(len.max(1), flags) };
        drop(preferred);
        let host = host.map_err(err("cuMemHostAlloc"))?;
        let mut mem = PinnedMem {
            host,
            dev: 0,
            len,
            ctx: Arc::clone(&self.ctx),
        };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `host` was allocated with CU_MEMHOSTALLOC_DEVICEMAP; `dev` is a valid out slot.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) }
            .result()
            .map_err(err("cuMemHostGetDevicePointer"))?;
        mem.dev = dev;
        // SAFETY: `host` points at `len.max(1)` writable bytes that no kernel uses yet.
        unsafe { std::ptr::write_bytes(host as *mut u8, fill, len) };
        Ok(mem)
    }

    /// Copies `data` to device address `dst`, stream-ordered and without waiting: `data` is
    /// copied into `staging` (pinned memory) and sent from there, so `data` may be dropped
    /// when this returns. From pageable memory the driver may wait for the stream before
    /// staging a copy itself, a synchronisation that no counter would see.
    ///
    /// # Safety
    /// `dst .. dst + data.len()` must lie inside a live allocation of this context.
    pub(crate) unsafe fn upload(
        &self,
        staging: &mut Staging,
        dst: u64,
        data: &[u8],
    ) -> Result<(), String> {
        if data.is_empty() {
            return Ok(());
        }
        self.bind()?;
        let (ring, start) = staging.reserve(self, data.len())?;
        host_access(ring.host as u64 + start as u64, data.len(), true);
        // SAFETY: `reserve` returned `data.len()` bytes inside `ring` that no copy in flight
        // reads, and the executor's lock excludes other CPU access.
        let src = unsafe {
            let p = (ring.host as *mut u8).add(start);
            std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len());
            std::slice::from_raw_parts(p as *const u8, data.len())
        };
        // SAFETY: the destination is inside a live allocation (caller); the pinned source
        // stays untouched until the event recorded after this copy has completed.
        unsafe { result::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
            .map_err(err("cuMemcpyHtoDAsync"))?;
        let done = staging.spare_event(self).and_then(|e| {
            e.record(&self.stream)
                .map_err(err("cuEventRecord"))
                .map(|()| e)
        });
        match done {
            Ok(done) => {
                staging.in_flight.push_back(InFlight { start, done });
                Ok(())
            }
            Err(e) => {
                // The region is untracked: let the copy finish before it can be handed out
                // again.
                let _ = self.synchronize();
                Err(e)
            }
        }
    }

    /// Copies from device address `src` into `out` and waits for it.
    ///
    /// # Safety
    /// `src .. src + out.len()` must lie inside a live allocation of this context.
    pub(crate) unsafe fn read(&self, src: u64, out: &mut [u8]) -> Result<(), String> {
        if out.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the range is inside a live allocation (caller); `out` stays borrowed until
        // the stream synchronisation below has completed the copy.
        unsafe {
            result::memcpy_dtoh_async(out, src, self.stream.cu_stream())
                .map_err(err("cuMemcpyDtoHAsync"))?;
            result::stream::synchronize(self.stream.cu_stream()).map_err(err("cuStreamSynchronize"))
        }
    }

    /// Enqueues the copies `(dst, src, len)` on the executor's stream: one
    /// `cuMemcpyBatchAsync` (CUDA 12.8+) when `batch` (the caller checked that the driver
    /// exports it: [`batch_copies`]), else one `cuMemcpyAsync` each. Addresses are unified (device memory, or the mapping of
    /// pinned host memory), so the driver picks the copy engine's direction itself; pinned host
    /// memory makes these true DMA transfers.
    ///
    /// # Safety
    /// Every range must lie inside a live allocation of this context, and stay alive until
    /// the copies have run.
    pub(crate) unsafe fn copy(
        &self,
        copies: &[(u64, u64, u64)],
        batch: bool,
    ) -> Result<(), String> {
        self.bind()?;
        let live: Vec<&(u64, u64, u64)> = copies.iter().filter(|c| c.2 > 0).collect();
        // Checked here too: cudarc would panic on the missing symbol.
        if live.len() > 1 && batch && batch_copies() {
            let mut dsts: Vec<sys::CUdeviceptr> = live.iter().map(|c| c.0).collect();
            let mut srcs: Vec<sys::CUdeviceptr> = live.iter().map(|c| c.1).collect();
            let mut sizes: Vec<usize> = live.iter().map(|c| c.2 as usize).collect();
            // One attribute for every copy: stream-ordered source access (the sources were
            // written by earlier work on this stream). The location hints are for managed
            // memory and ignored for device and pinned memory, as here.
            // SAFETY: a plain C struct; all-zero is a valid bit pattern for each field.
            let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            let mut attr_idx: usize = 0;
            let mut fail_idx: usize = usize::MAX;
            // SAFETY: the arrays hold `live.len()` entries each, one attribute applies from
            // copy 0, and every range is inside a live allocation (caller).
            let r = unsafe {
                sys::cuMemcpyBatchAsync(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    live.len(),
                    &mut attrs,
                    &mut attr_idx,
                    1,
                    &mut fail_idx,
                    self.stream.cu_stream(),
                )
            };
            // NOT_SUPPORTED for the whole batch (no copy named) queued nothing: the same
            // copies go one by one, now and from now on.
            let refused =
                r == sys::cudaError_enum::CUDA_ERROR_NOT_SUPPORTED && fail_idx == usize::MAX;
            if !refused {
                return r.result().map_err(|e| {
                    format!(
                        "cuMemcpyBatchAsync ({} copies, failed at {fail_idx}): {e:?}",
                        live.len()
                    )
                });
            }
            if !BATCH_REFUSED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(
                    "cuMemcpyBatchAsync refused a batch of {} copies as NOT_SUPPORTED; copies \
                     go one cuMemcpyAsync each from now on",
                    live.len()
                );
            }
        }
        for &&(dst, src, len) in &live {
            // SAFETY: both ranges are inside live allocations (caller).
            unsafe { sys::cuMemcpyAsync(dst, src, len as usize, self.stream.cu_stream()) }
                .result()
                .map_err(err("cuMemcpyAsync"))?;
        }
        Ok(())
    }

    /// Enqueues one `cuMemsetD8Async` per `(addr, len)` on the executor's stream.
    ///
    /// # Safety
    /// Every range must lie inside a live device allocation of this context, and stay alive
    /// until the fills have run.
    pub(crate) unsafe fn fill(&self, ranges: &[(u64, u64)], byte: u8) -> Result<(), String> {
        self.bind()?;
        for &(dst, len) in ranges.iter().filter(|r| r.1 > 0) {
            // SAFETY: the range is inside a live device allocation (caller).
            unsafe { result::memset_d8_async(dst, byte, len as usize, self.stream.cu_stream()) }
                .map_err(err("cuMemsetD8Async"))?;
        }
        Ok(())
    }

    /// Waits for all work on the executor's three streams (never the context's others).
    pub(crate) fn synchronize(&self) -> Result<(), String> {
        self.bind()?;
        for s in [&self.main, &self.load, &self.backup] {
            // SAFETY: the streams are alive as long as `self`.
            unsafe { result::stream::synchronize(s.cu_stream()) }
                .map_err(err("cuStreamSynchronize"))?;
        }
        Ok(())
    }

    /// Loads a CUBIN (or NUL-terminated PTX) image and resolves `entry`.
    pub(crate) fn load(&self, image: &[u8], entry: &str) -> Result<Module, String> {
        self.bind()?;
        let name =
            CString::new(entry).map_err(|_| format!("entry name `{entry}` contains a NUL byte"))?;
        // PTX must be NUL-terminated; a trailing zero is harmless for a CUBIN (ELF) image,
        // which is copied into 8-byte-aligned storage (a `Vec<u8>` promises no alignment).
        let mut owned = vec![0u64; image.len() / 8 + 1];
        // SAFETY: `owned` holds at least `image.len() + 1` bytes; the regions are distinct.
        unsafe {
            std::ptr::copy_nonoverlapping(
                image.as_ptr(),
                owned.as_mut_ptr() as *mut u8,
                image.len(),
            )
        };
        // SAFETY: `owned` is a complete image that outlives the call (the driver copies it).
        let module = unsafe { result::module::load_data(owned.as_ptr() as *const c_void) }
            .map_err(err("cuModuleLoadData"))?;
        let mut m = Module {
            module,
            func: std::ptr::null_mut(),
            ctx: Arc::clone(&self.ctx),
        };
        // SAFETY: `module` was just loaded and is owned by `m`.
        m.func = unsafe { result::module::get_function(module, name) }
            .map_err(err("cuModuleGetFunction"))?;
        Ok(m)
    }

    /// Launches `module`'s kernel on the executor's stream; `args[i]` holds the exact bytes of
    /// parameter `i`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list in count and sizes, and every pointer
    /// argument must address memory that stays alive until the kernel has finished and is
    /// large enough for everything the kernel accesses through it given its size arguments.
    pub(crate) unsafe fn launch(
        &self,
        module: &Module,
        grid: [u32; 3],
        block: [u32; 3],
        shared_bytes: u32,
        args: &[&[u8]],
    ) -> Result<(), String> {
        self.bind()?;
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.as_ptr() as *mut c_void).collect();
        // SAFETY: `params[i]` points at the bytes of argument i, which the driver copies during
        // the call; argument validity is the caller's contract.
        unsafe {
            result::launch_kernel(
                module.func,
                (grid[0], grid[1], grid[2]),
                (block[0], block[1], block[2]),
                shared_bytes,
                self.stream.cu_stream(),
                &mut params,
            )
        }
        .map_err(err("cuLaunchKernel"))
    }

    /// The IPC handle of the device allocation at `mem` (`cuIpcGetMemHandle`): 64 opaque
    /// bytes that another process opens with [`Gpu::ipc_open`].
    pub(crate) fn ipc_handle(&self, mem: &DeviceMem) -> Result<[u8; IPC_HANDLE_BYTES], String> {
        self.bind()?;
        let mut handle = sys::CUipcMemHandle_st {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: `mem.ptr` is the base of a live cuMemAlloc allocation of this context, and
        // `handle` is a valid out slot.
        unsafe { sys::cuIpcGetMemHandle(&mut handle, mem.ptr) }
            .result()
            .map_err(err("cuIpcGetMemHandle"))?;
        Ok(handle.reserved.map(|c| c as u8))
    }

    /// A new interprocess event (`CU_EVENT_INTERPROCESS`, without timing, as the driver
    /// requires) and its handle (`cuIpcGetEventHandle`), which another process opens with
    /// [`Gpu::ipc_open_event`].
    pub(crate) fn ipc_event(&self) -> Result<(IpcEvent, [u8; IPC_HANDLE_BYTES]), String> {
        self.bind()?;
        let flags = sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32
            | sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the context is current; `raw` is a valid out slot.
        unsafe { sys::cuEventCreate(&mut raw, flags) }
            .result()
            .map_err(err("cuEventCreate"))?;
        // Owned from here: an error below destroys it.
        let event = IpcEvent {
            raw,
            ctx: Arc::clone(&self.ctx),
        };
        let mut handle = sys::CUipcEventHandle_st {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        // SAFETY: a live interprocess event of this context; `handle` is a valid out slot.
        unsafe { sys::cuIpcGetEventHandle(&mut handle, event.raw) }
            .result()
            .map_err(err("cuIpcGetEventHandle"))?;
        Ok((event, handle.reserved.map(|c| c as u8)))
    }

    /// Opens another process's interprocess event from its handle (`cuIpcOpenEventHandle`):
    /// waits on it wait for the owner's recordings.
    pub(crate) fn ipc_open_event(
        &self,
        handle: &[u8; IPC_HANDLE_BYTES],
    ) -> Result<IpcEvent, String> {
        self.bind()?;
        let handle = sys::CUipcEventHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out slot; the driver checks the handle.
        unsafe { sys::cuIpcOpenEventHandle(&mut raw, handle) }
            .result()
            .map_err(err("cuIpcOpenEventHandle"))?;
        Ok(IpcEvent {
            raw,
            ctx: Arc::clone(&self.ctx),
        })
    }

    /// Records `event` (this process's) at the current end of the executor's stream.
    pub(crate) fn record_ipc(&self, event: &IpcEvent) -> Result<(), String> {
        self.bind()?;
        // SAFETY: both are live objects of this context.
        unsafe { sys::cuEventRecord(event.raw, self.stream.cu_stream()) }
            .result()
            .map_err(err("cuEventRecord"))
    }

    /// Makes work enqueued on `stream` (the executor's with `None`; else a live stream of this
    /// context, or 0) from now on wait for `event`'s last recording.
    ///
    /// # Safety
    /// A `stream` given must be a live stream of this context, or 0.
    pub(crate) unsafe fn wait_ipc(
        &self,
        event: &IpcEvent,
        stream: Option<u64>,
    ) -> Result<(), String> {
        self.bind()?;
        let on = match stream {
            Some(s) => s as usize as sys::CUstream,
            None => self.stream.cu_stream(),
        };
        // SAFETY: the event is live; the caller vouches for `stream`.
        unsafe { sys::cuStreamWaitEvent(on, event.raw, 0) }
            .result()
            .map_err(err("cuStreamWaitEvent"))
    }

    /// Waits on the host until `event`'s last recording has run (`cuEventSynchronize`).
    pub(crate) fn sync_ipc(&self, event: &IpcEvent) -> Result<(), String> {
        self.bind()?;
        // SAFETY: a live event of this context.
        unsafe { sys::cuEventSynchronize(event.raw) }
            .result()
            .map_err(err("cuEventSynchronize"))
    }

    /// Whether `event`'s last recording has run (`cuEventQuery`, never waited for).
    pub(crate) fn ipc_done(&self, event: &IpcEvent) -> Result<bool, String> {
        self.bind()?;
        // SAFETY: a live event of this context.
        match unsafe { sys::cuEventQuery(event.raw) } {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            e => Err(format!("cuEventQuery: {e:?}")),
        }
    }

    /// Maps another process's device allocation of `len` bytes from its IPC handle
    /// (`cuIpcOpenMemHandle` with `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`). The driver refuses a
    /// handle this process exported (`CUDA_ERROR_INVALID_CONTEXT`); the executor checks that
    /// first, so the refusal here is for handles that lie about their origin.
    pub(crate) fn ipc_open(
        &self,
        handle: &[u8; IPC_HANDLE_BYTES],
        len: usize,
    ) -> Result<IpcMem, String> {
        self.bind()?;
        let handle = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: `ptr` is a valid out slot; the handle is passed by value and the driver
        // checks it (a handle naming nothing is an error, not a mapping).
        unsafe { sys::cuIpcOpenMemHandle_v2(&mut ptr, handle, flags) }
            .result()
            .map_err(err("cuIpcOpenMemHandle"))?;
        // Owned from here: an error below closes it again.
        let mem = IpcMem {
            ptr,
            len,
            ctx: Arc::clone(&self.ctx),
        };
        // The size comes from the peer's bytes: bounds checks rely on it, so the mapping
        // must really be that large.
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: `ptr` is a live mapping of this context; both out slots are valid.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(err("cuMemGetAddressRange"))?;
        if base != ptr || size < len {
            return Err(format!(
                "cuIpcOpenMemHandle mapped an allocation of {size} bytes at {base:#x} (opened \
                 at {ptr:#x}), not the {len} bytes the handle names"
            ));
        }
        Ok(mem)
    }
}

/// Pinned memory that uploads pass through (see [`Gpu::upload`]): a ring whose regions are
/// reused only once the event recorded after their copy has completed, which is queried,
/// never waited for. When every region is still in flight, a ring twice as large replaces it;
/// the old one is kept (not freed: freeing pinned memory waits for the device) and released
/// with the executor, so the memory held is at most twice the largest ring.
#[derive(Default)]
pub(crate) struct Staging {
    ring: Option<PinnedMem>,
    /// Where the next region starts.
    head: usize,
    /// Regions of `ring` whose copies may still run, oldest first.
    in_flight: VecDeque<InFlight>,
    /// Completed events, for reuse.
    spare: Vec<CudaEvent>,
    /// Rings replaced by a larger one.
    retired: Vec<PinnedMem>,
}

/// One staged upload, from `start` of the ring up to the next one's start (or `head`);
/// reusable once `done` has completed.
struct InFlight {
    start: usize,
    done: CudaEvent,
}

/// Regions start at multiples of this, so that the copy engine reads aligned sources.
const STAGING_ALIGN: usize = 256;
/// The first ring's size; a request larger than half a ring gets a larger one.
const STAGING_MIN: usize = 64 << 10;

impl Staging {
    /// Returns `len` bytes of the ring that no copy in flight reads: the ring and the offset.
    fn reserve(&mut self, gpu: &Gpu, len: usize) -> Result<(&PinnedMem, usize), String> {
        self.reclaim()?;
        let len = len.div_ceil(STAGING_ALIGN) * STAGING_ALIGN;
        let start = match self.ring.as_ref().and_then(|r| self.fit(r.len(), len)) {
            Some(start) => start,
            None => {
                // Ring sizes start at STAGING_MIN and only double.
                let size = self
                    .ring
                    .as_ref()
                    .map_or(STAGING_MIN, |r| 2 * r.len())
                    .max(2 * len);
                let ring = gpu.alloc_host(size, 0)?;
                if let Some(old) = self.ring.replace(ring) {
                    self.retired.push(old);
                }
                // The old ring's copies complete on their own; only this ring is tracked.
                self.spare.extend(self.in_flight.drain(..).map(|f| f.done));
                0
            }
        };
        self.head = start + len;
        let ring = self.ring.as_ref().ok_or("staging ring missing")?;
        Ok((ring, start))
    }

    /// Where `len` free bytes start in a ring of `size` bytes, if they are free: after the
    /// newest region, or wrapping to 0 ahead of the oldest.
    fn fit(&self, size: usize, len: usize) -> Option<usize> {
        let Some(oldest) = self.in_flight.front() else {
            return (len <= size).then_some(0);
        };
        let tail = oldest.start;
        if self.head > tail {
            // In flight: [tail, head). Free: [head, size), then [0, tail).
            if len <= size - self.head {
                Some(self.head)
            } else {
                (len <= tail).then_some(0)
            }
        } else {
            // In flight: [tail, size) and [0, head) (or the whole ring when head == tail).
            (self.head < tail && len <= tail - self.head).then_some(self.head)
        }
    }

    /// Rings allocated so far: each one was a page-locked allocation, which stalls concurrent
    /// streams like a device allocation, so the executor counts it as one.
    pub(crate) fn rings(&self) -> usize {
        self.retired.len() + usize::from(self.ring.is_some())
    }

    /// Frees the regions whose copies have completed, oldest first.
    fn reclaim(&mut self) -> Result<(), String> {
        while let Some(oldest) = self.in_flight.front() {
            if !oldest.done.try_is_complete().map_err(err("cuEventQuery"))? {
                break;
            }
            if let Some(f) = self.in_flight.pop_front() {
                self.spare.push(f.done);
            }
        }
        if self.in_flight.is_empty() {
            self.head = 0;
        }
        Ok(())
    }

    /// A completed (or new) event to record after a copy.
    fn spare_event(&mut self, gpu: &Gpu) -> Result<CudaEvent, String> {
        match self.spare.pop() {
            Some(e) => Ok(e),
            None => gpu
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(err("cuEventCreate")),
        }
    }
}

/// Makes `ctx` current for a release in `Drop`. Unlike `CudaContext::bind_to_thread`, it does
/// not first take an error that an earlier cudarc drop recorded in the context (that would
/// skip this release and leak it); such an error still surfaces on the next normal call.
fn bind_for_drop(ctx: &CudaContext) -> bool {
    // SAFETY: the context is alive (`ctx` holds a reference); making it current has no other
    // precondition.
    unsafe { result::ctx::set_current(ctx.cu_ctx()) }.is_ok()
}

/// An interprocess event (`CU_EVENT_INTERPROCESS`): this process's, which peers open by its
/// handle, or a peer's opened here. Destroyed in `Drop`.
pub(crate) struct IpcEvent {
    raw: sys::CUevent,
    ctx: Arc<CudaContext>,
}

// SAFETY: the event is owned exclusively by this value and used only through the executor,
// which serialises its calls.
unsafe impl Send for IpcEvent {}

impl Drop for IpcEvent {
    fn drop(&mut self) {
        let raw = std::mem::replace(&mut self.raw, std::ptr::null_mut());
        if !raw.is_null() && bind_for_drop(&self.ctx) {
            // SAFETY: created or opened in this context and destroyed exactly once (swapped
            // out above); work waiting on it keeps its own reference in the driver.
            let _ = unsafe { sys::cuEventDestroy_v2(raw) };
        }
    }
}

/// Device memory from `cuMemAlloc`, freed in `Drop`.
pub(crate) struct DeviceMem {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceMem {
    /// Device address.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for DeviceMem {
    fn drop(&mut self) {
        let ptr = std::mem::replace(&mut self.ptr, 0);
        if ptr != 0 && bind_for_drop(&self.ctx) {
            // SAFETY: `ptr` came from cuMemAlloc in this context and is freed exactly once
            // (null-swapped above); the executor drops it only after its streams passed the
            // work enqueued before the free (`CudaExecutor::free`'s events, or its drop's
            // stream synchronisation).
            let _ = unsafe { result::free_sync(ptr) };
        }
    }
}

/// Bytes of a `CUipcMemHandle`.
pub(crate) const IPC_HANDLE_BYTES: usize = 64;

/// Another process's device allocation, mapped into this context by `cuIpcOpenMemHandle`;
/// unmapped with `cuIpcCloseMemHandle` in `Drop` (never `cuMemFree`: the exporter owns the
/// memory).
pub(crate) struct IpcMem {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

impl IpcMem {
    /// Device address of the mapping in this context.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr
    }
    /// Size in bytes: what the exporter's handle said, checked against the mapping.
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

impl Drop for IpcMem {
    fn drop(&mut self) {
        let ptr = std::mem::replace(&mut self.ptr, 0);
        if ptr != 0 && bind_for_drop(&self.ctx) {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle in this context and is closed
            // exactly once (null-swapped above), once the executor's streams passed the work
            // that read the peer's memory (as for `DeviceMem`).
            let _ = unsafe { sys::cuIpcCloseMemHandle(ptr) };
        }
    }
}

/// Pinned, device-mapped host memory from `cuMemHostAlloc`, freed in `Drop`.
pub(crate) struct PinnedMem {
    host: *mut c_void,
    dev: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned exclusively by this value; the raw pointer is only used by
// the owner (under the executor's lock) and by kernels through its device address.
unsafe impl Send for PinnedMem {}

impl PinnedMem {
    /// Device address of the mapping.
    pub(crate) fn addr(&self) -> u64 {
        self.dev
    }
    /// Size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Writes `data` at `offset` from the CPU, after waiting for all work on `gpu`'s stream
    /// (kernels may be reading or writing the mapping; the typed driver copies are not meant
    /// for host-to-host transfers, so pinned memory is written directly).
    pub(crate) fn write_after(
        &mut self,
        gpu: &Gpu,
        offset: usize,
        data: &[u8],
    ) -> Result<(), String> {
        check_inside(offset, data.len(), self.len)?;
        gpu.synchronize()?;
        host_access(self.host as u64 + offset as u64, data.len(), true);
        // SAFETY: the range is inside the allocation (checked above), `&mut self` excludes
        // other CPU access, and the stream is idle, so no kernel touches the mapping.
        unsafe {
            std::ptr::copy_nonoverlapping(
                data.as_ptr(),
                (self.host as *mut u8).add(offset),
                data.len(),
            )
        };
        Ok(())
    }

    /// Writes `byte` over each `(offset, len)` range from the CPU, after waiting for all work
    /// on `gpu`'s stream (one synchronisation for the batch).
    pub(crate) fn fill_after(
        &mut self,
        gpu: &Gpu,
        ranges: &[(u64, u64)],
        byte: u8,
    ) -> Result<(), String> {
        for &(offset, len) in ranges {
            check_inside(offset as usize, len as usize, self.len)?;
        }
        gpu.synchronize()?;
        for &(offset, len) in ranges {
            host_access(self.host as u64 + offset, len as usize, true);
            // SAFETY: as in `write_after`: inside the allocation, no other CPU access, and
            // the stream is idle.
            unsafe {
                std::ptr::write_bytes(
                    (self.host as *mut u8).add(offset as usize),
                    byte,
                    len as usize,
                )
            };
        }
        Ok(())
    }

    /// Reads `out.len()` bytes at `offset` from the CPU, after waiting for all work on `gpu`'s
    /// stream.
    pub(crate) fn read_after(
        &self,
        gpu: &Gpu,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), String> {
        check_inside(offset, out.len(), self.len)?;
        gpu.synchronize()?;
        host_access(self.host as u64 + offset as u64, out.len(), false);
        // SAFETY: the range is inside the allocation (checked above) and the stream is idle,
        // so no kernel writes the mapping while it is copied.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (self.host as *const u8).add(offset),
                out.as_mut_ptr(),
                out.len(),
            )
        };
        Ok(())
    }
}

fn check_inside(offset: usize, len: usize, size: usize) -> Result<(), String> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(format!(
            "{len} bytes at {offset} are outside {size} bytes of pinned memory"
        )),
    }
}

impl Drop for PinnedMem {
    fn drop(&mut self) {
        let host = std::mem::replace(&mut self.host, std::ptr::null_mut());
        if !host.is_null() && bind_for_drop(&self.ctx) {
            // SAFETY: `host` came from cuMemHostAlloc and is freed exactly once, once the
            // executor's streams passed the work that used the mapping (as for `DeviceMem`;
            // a staging ring is dropped with the executor, after its streams finished).
            let _ = unsafe { result::free_host(host) };
        }
    }
}

/// A loaded module and its kernel entry, unloaded in `Drop`.
pub(crate) struct Module {
    module: sys::CUmodule,
    func: sys::CUfunction,
    ctx: Arc<CudaContext>,
}

// SAFETY: driver module and function handles may be used from any thread once the owning
// context is current, which every use ensures.
unsafe impl Send for Module {}
// SAFETY: launching through a shared handle does not mutate it.
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        let module = std::mem::replace(&mut self.module, std::ptr::null_mut());
        if !module.is_null() && bind_for_drop(&self.ctx) {
            // SAFETY: `module` was loaded by cuModuleLoadData and is unloaded exactly once,
            // with the executor, after its streams finished (kernels are never unloaded
            // while it lives).
            let _ = unsafe { result::module::unload(module) };
        }
    }
}

/// Tells the tests' stand-in driver what the next launch on this thread reads and writes
/// (`(address, bytes, flags)`: 1 written, 2 sparse), for its race checker
/// (`tests/fake_cuda/streams.h`). A real driver has no such hook; the executor calls this
/// only on the stand-in.
pub(crate) fn declare_accesses(accesses: &[[u64; 3]]) {
    if let Some(f) = declare_hook() {
        // SAFETY: the hook reads `3 × len` u64s from the pointer, which the slice holds.
        unsafe { f(accesses.as_ptr().cast(), accesses.len()) }
    }
}

/// Whether the stand-in's race checker wants launches' accesses ([`declare_accesses`]).
pub(crate) fn declares_accesses() -> bool {
    declare_hook().is_some()
}

type Declare = unsafe extern "C" fn(*const u64, usize);
type HostAccess = unsafe extern "C" fn(u64, u64, i32);

/// Tells the stand-in's race checker that the host is about to read (or write) `len` bytes
/// of pinned memory at `addr`: work still in flight on them is a race. A real driver has no
/// such hook (nothing is called).
pub(crate) fn host_access(addr: u64, len: usize, write: bool) {
    static HOOK: std::sync::OnceLock<Option<HostAccess>> = std::sync::OnceLock::new();
    let hook = HOOK.get_or_init(|| {
        declare_hook()?;
        // SAFETY: as in `declare_hook`: a symbol of the driver library cudarc loaded.
        let culib = unsafe { sys::culib() };
        // SAFETY: as above.
        unsafe { culib.get::<HostAccess>(b"fake_cuda_host_access\0") }
            .ok()
            .map(|f| *f)
    });
    if let Some(f) = hook {
        // SAFETY: the hook only records the range; it dereferences nothing.
        unsafe { f(addr, len as u64, i32::from(write)) }
    }
}

fn declare_hook() -> Option<Declare> {
    static HOOK: std::sync::OnceLock<Option<Declare>> = std::sync::OnceLock::new();
    *HOOK.get_or_init(|| {
        // SAFETY: the driver library cudarc loaded (a context is open, so it is loaded);
        // only symbols are looked up in it (the same copy: a second dlopen by another name
        // could load a second copy of the stand-in).
        let culib = unsafe { sys::culib() };
        // SAFETY: as above; the hook takes no arguments and reads one flag.
        let checks =
            unsafe { culib.get::<unsafe extern "C" fn() -> i32>(b"fake_cuda_checks_races\0") }
                .is_ok_and(|f| unsafe { f() } != 0);
        // SAFETY: as above.
        let declare = unsafe { culib.get::<Declare>(b"fake_cuda_declare_accesses\0") };
        declare.ok().filter(|_| checks).map(|f| *f)
    })
}

/// [`Gpu::upload`] for a range the executor has bounds-checked against a live buffer.
pub(crate) fn upload_in_bounds(
    gpu: &Gpu,
    staging: &mut Staging,
    dst: u64,
    data: &[u8],
) -> Result<(), String> {
    // SAFETY: the executor checked `dst .. dst + len` against a live buffer it keeps locked.
    unsafe { gpu.upload(staging, dst, data) }
}

/// [`Gpu::read`] for a range the executor has bounds-checked against a live buffer.
pub(crate) fn read_in_bounds(gpu: &Gpu, src: u64, out: &mut [u8]) -> Result<(), String> {
    // SAFETY: the executor checked `src .. src + len` against a live buffer it keeps locked.
    unsafe { gpu.read(src, out) }
}

/// [`Gpu::copy`] for regions the executor has bounds-checked against live buffers.
pub(crate) fn copy_in_bounds(
    gpu: &Gpu,
    copies: &[(u64, u64, u64)],
    batch: bool,
) -> Result<(), String> {
    // SAFETY: the executor checked every range against a live buffer it keeps locked, and
    // freeing a buffer waits for the context's work (see `DeviceMem` / `PinnedMem` drops).
    unsafe { gpu.copy(copies, batch) }
}

/// [`Gpu::fill`] of ranges the executor checked against a live device buffer it keeps locked
/// (freeing waits for the context's work, as for copies).
pub(crate) fn fill_in_bounds(gpu: &Gpu, ranges: &[(u64, u64)], byte: u8) -> Result<(), String> {
    // SAFETY: see above.
    unsafe { gpu.fill(ranges, byte) }
}

/// [`Gpu::launch`] with arguments built by the executor: pointer arguments are addresses of
/// live buffers (buffers are freed with cuMemFree / after a context sync, which wait for
/// running kernels).
///
/// # Safety
/// As for [`Gpu::launch`]: the arguments match the kernel's parameters, and each pointer's
/// buffer is large enough for everything the kernel accesses given its size arguments (what
/// [`Executor::launch`](crate::exec::Executor::launch) checks against the signature's reach,
/// and the contract of [`Executor::launch_unchecked`](crate::exec::Executor::launch_unchecked)).
pub(crate) unsafe fn launch_with_args(
    gpu: &Gpu,
    module: &Module,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    args: &[&[u8]],
) -> Result<(), String> {
    // SAFETY: guaranteed by the caller; the driver copies parameter values during the call,
    // and buffers outlive the kernel because freeing one waits for the context's work.
    unsafe { gpu.launch(module, grid, block, shared_bytes, args) }
}
