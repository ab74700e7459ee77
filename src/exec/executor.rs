//! The [`Executor`] trait: the one interface the CUDA and host executors implement, with its
//! contract and the defaults shared by executors without peer mappings, streams or events.

#[cfg(doc)]
use super::{merge_regions, LaunchFailure};
use super::{
    Address, Backend, BufferId, CopyRegion, Counters, DmaMode, EventId, ExecError, KernelArg,
    KernelArtifact, KernelId, LaunchConfig, LoadOp, MemKind,
};

/// A kernel executor.
///
/// Contract:
/// - All methods take `&self`; implementations are `Send + Sync` and serialise their own
///   state, so one executor may be shared by threads. Launches are stream-ordered: a launch,
///   upload or read observes every earlier call on the same executor.
/// - One executor has one stream for its calls: launches, uploads, copies and fills run in
///   the order they were called (a layer-wise load, [`Executor::load_layers`], and a
///   backup, [`Executor::backup`], may run on streams of their own, ordered by their
///   events); wrappers forward to one inner executor. Work on another executor is another
///   stream, unordered with this one, and buffer and kernel
///   handles of one executor are refused by every other ([`ExecError::UnknownBuffer`],
///   [`ExecError::UnknownKernel`]).
/// - Allocator launches of one rank run on one stream. The select kernel reads and writes
///   back the lane tops from one block, so a release on another stream in between would lose
///   its pushes or hand pages out twice. A
///   [`KernelLaneAllocator`](crate::allocator::KernelLaneAllocator) therefore keeps the
///   executor it was built with and issues every upload and launch on its lanes there (no
///   method takes another executor), and no other executor accepts its lane buffers. Code
///   that frees pages from elsewhere (a write-back path) frees them through that allocator.
/// - `upload` does not synchronise with the host (the data is staged); `read` waits for the
///   work that writes the buffer and is counted in [`Counters::reads`]; `synchronize` is counted
///   in [`Counters::syncs`].
/// - Every failure is a typed [`ExecError`]; a failed launch leaves buffers allocated and the
///   executor usable, but the contents of buffers the kernel wrote are unspecified.
/// - Buffers and kernels are released when freed or when the executor is dropped.
pub trait Executor: Send + Sync {
    /// Which backend this is.
    fn backend(&self) -> Backend;

    /// A human-readable device description (for `info`, tuning keys and logs).
    fn device_name(&self) -> String;

    /// The device's `(major, minor)` compute capability, which decides the CUBIN architecture
    /// (`jit::target_for`); `None` for executors that do not run CUBINs.
    fn compute_capability(&self) -> Option<(u32, u32)> {
        None
    }

    /// Whether the device runs kernels built for the host emulator instead of CUBINs: only
    /// the stand-in CUDA driver of the tests (`tests/fake_cuda/libcuda.cpp`), whose
    /// "modules" are host libraries. `jit::target_for` then builds host libraries for it, so
    /// the CUDA executor's plumbing can be driven from Python and Rust without a GPU.
    fn runs_emulated_kernels(&self) -> bool {
        false
    }

    /// Allocates `bytes` of `kind` memory filled with `fill` (the poison byte, `0xA5` for pools).
    fn alloc(&self, kind: MemKind, bytes: usize, fill: u8) -> Result<BufferId, ExecError>;

    /// Frees a buffer.
    fn free(&self, buffer: BufferId) -> Result<(), ExecError>;

    /// Allocates device memory (filled with `fill`) that other ranks' executors can map,
    /// in this process or another, through [`Executor::export`] and [`Executor::import`]:
    /// a rank's KV pools, which attention on every rank reads. Executors without peer
    /// mappings refuse ([`ExecError::Peer`]); their ranks must share one executor and reach
    /// each other's buffers directly.
    fn alloc_shareable(&self, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        let _ = (bytes, fill);
        Err(ExecError::Peer {
            op: "alloc_shareable",
            message: format!("the {} executor has no peer mappings", self.backend()),
        })
    }

    /// A handle (bytes, to be all-gathered) that lets a peer map `buffer`, which
    /// [`Executor::alloc_shareable`] made.
    fn export(&self, buffer: BufferId) -> Result<Vec<u8>, ExecError> {
        let _ = buffer;
        Err(ExecError::Peer {
            op: "export",
            message: format!("the {} executor has no peer mappings", self.backend()),
        })
    }

    /// Maps a peer's exported buffer: the returned buffer reads and writes the peer's bytes
    /// (freeing it only unmaps). A handle of another kind of executor, or of a buffer that
    /// is gone, is refused ([`ExecError::Peer`]); so is, on CUDA, a handle this process
    /// exported ([`ExecError::IpcSameProcess`]: see [`Executor::maps_in_process`]).
    fn import(&self, handle: &[u8]) -> Result<BufferId, ExecError> {
        let _ = handle;
        Err(ExecError::Peer {
            op: "import",
            message: format!("the {} executor has no peer mappings", self.backend()),
        })
    }

    /// Registers `bytes` of memory at `addr` that the caller owns (an engine's tensor) as a
    /// buffer kernels can be launched on; [`Executor::free`] forgets it without freeing the
    /// memory. Backends that cannot address foreign memory say so.
    ///
    /// # Safety
    /// `addr` must be memory of the executor's address space (host memory for the host
    /// executor, device memory of its context for CUDA), valid for reads and writes of
    /// `bytes` bytes until the buffer is freed, and not touched by anyone else while work on
    /// it runs.
    unsafe fn adopt(&self, addr: u64, bytes: usize) -> Result<BufferId, ExecError> {
        let _ = (addr, bytes);
        Err(ExecError::NotSupported {
            backend: self.backend(),
            what: "adopting memory it did not allocate",
        })
    }

    /// Makes the executor's work from now on wait for the work enqueued so far on the
    /// caller's `stream` (a raw `CUstream` on CUDA): the device waits, the host does not.
    ///
    /// # Safety
    /// `stream` must be a live stream of the executor's context.
    unsafe fn follow_stream(&self, stream: u64) -> Result<(), ExecError> {
        let _ = stream;
        Err(ExecError::NotSupported {
            backend: self.backend(),
            what: "ordering against a caller's stream",
        })
    }

    /// Makes the caller's `stream` wait for the executor's work enqueued so far.
    ///
    /// # Safety
    /// As [`Executor::follow_stream`].
    unsafe fn lead_stream(&self, stream: u64) -> Result<(), ExecError> {
        let _ = stream;
        Err(ExecError::NotSupported {
            backend: self.backend(),
            what: "ordering against a caller's stream",
        })
    }

    /// Says that every peer has mapped `buffer` (made by [`Executor::alloc_shareable`]) and
    /// no later import will come: an executor whose handles are names in a system-wide
    /// namespace removes the name now, so that a process killed from here on leaks nothing
    /// (the host executor unlinks its POSIX shared-memory object; existing mappings stay
    /// valid). Nothing to do where handles die with their process (CUDA IPC), the default.
    fn seal_shareable(&self, buffer: BufferId) -> Result<(), ExecError> {
        let _ = buffer;
        Ok(())
    }

    /// How peers map this executor's shareable buffers (`"shared-memory"`, `"ipc"`), or
    /// `None` when they cannot.
    fn peer_mapping(&self) -> Option<&'static str> {
        None
    }

    /// Whether a buffer exported here can be imported by an executor in this same process
    /// (another rank's, on a thread). True for the host executor's shared memory; false for
    /// CUDA IPC, which only opens handles of other processes: ranks that share a process
    /// share its executor instead ([`PeerAccess::Direct`](crate::rank::PeerAccess::Direct)).
    /// The default follows [`Executor::peer_mapping`].
    fn maps_in_process(&self) -> bool {
        self.peer_mapping().is_some()
    }

    /// Size of a buffer in bytes.
    fn size(&self, buffer: BufferId) -> Result<usize, ExecError>;

    /// Where `buffer`'s bytes are, so that an engine's own kernels can read and write a pool
    /// in place (the Python package hands pools out as DLPack tensors). Valid until the
    /// buffer is freed; work on it must be ordered with this executor's stream by the
    /// caller. Executors whose memory has no address a caller could use refuse.
    fn address(&self, buffer: BufferId) -> Result<Address, ExecError> {
        let _ = buffer;
        Err(ExecError::Config {
            name: "backend",
            value: self.backend().to_string(),
            reason: "its buffers have no address outside the executor".into(),
        })
    }

    /// Copies `data` into `buffer` at `offset` without synchronising (stream-ordered).
    fn upload(&self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), ExecError>;

    /// Copies `out.len()` bytes from `buffer` at `offset` back to the host (counted).
    fn read(&self, buffer: BufferId, offset: u64, out: &mut [u8]) -> Result<(), ExecError>;

    /// Loads a kernel; loading the same artifact twice may return two handles.
    ///
    /// # Safety
    ///
    /// The artifact must be one the JIT built for this executor's backend (as
    /// the JIT's `CompiledKernel::load_spec` passes it): a host
    /// library is `dlopen`ed, which runs its initialisers, and its `<entry>__emu_launch` is
    /// later called with the `CpEmuLaunch` ABI; a CUBIN's entry is later launched with
    /// arguments laid out for the kernel's signature. Any other library or image is arbitrary
    /// code in this process or on the device. With a signature, the artifact must be built
    /// from the unedited render of the spec that signature came from
    /// ([`KernelSpec::signature`](crate::kernels::KernelSpec::signature)): the safe
    /// [`launch`](Executor::launch) trusts the kernel to stay within each parameter's
    /// [`Reach`](crate::exec::Reach).
    unsafe fn load_kernel(&self, artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError>;

    /// Launches a kernel loaded with a signature (every kernel rendered from a spec is) with
    /// `args`, one per kernel parameter, in order.
    ///
    /// Both executors check the launch against the signature before anything runs, so no
    /// launch can reach outside its buffers:
    /// - the block is the kernel's compiled threads, and select and release take one block;
    /// - the argument count, and every argument's size and kind (a pointer, a pointer struct or
    ///   a scalar; never [`KernelArg::Null`] or raw bytes where pointers belong);
    /// - every pointer's alignment, and that its buffer holds the parameter's
    ///   [`Reach`](crate::exec::Reach) from the offset on, computed from this launch's
    ///   scalar arguments (`4 × n`, a page's bytes × `layers` × `local_pages`, ...).
    ///
    /// A mismatch, or a kernel loaded without a signature, is [`ExecError::Launch`] with
    /// [`LaunchFailure::InvalidConfig`] naming the kernel and the parameter; the kernel did not
    /// run and the executor stays usable. Kernels without a signature (hand-written test
    /// kernels) go through [`launch_unchecked`](Executor::launch_unchecked).
    fn launch(
        &self,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
    ) -> Result<(), ExecError> {
        // SAFETY: without `unsigned_ok` the contract of `launch_with` is empty: an unsigned
        // kernel is refused, and a signed one gets every check above.
        unsafe { self.launch_with(kernel, config, args, false) }
    }

    /// [`launch`](Executor::launch) that also takes kernels loaded without a signature.
    /// A kernel with a signature gets every check `launch` makes. Without one, the host
    /// emulator still checks the argument count and sizes against the compiled kernel, and
    /// pointers are checked to start inside their buffers, but the CUDA driver cannot check
    /// the arguments at all, and how far the kernel reaches from a pointer is unknown.
    ///
    /// # Safety
    ///
    /// For a kernel loaded without a signature: every pointer argument lies in a buffer large
    /// enough for everything the kernel reads or writes through it given the launch's size
    /// arguments and shape (the host executor runs the kernel in this process, so an access
    /// past a buffer corrupts the Rust heap; on a GPU it corrupts other allocations or faults
    /// the context), the arguments match the kernel's parameters in count, size and kind,
    /// every pointer is aligned as the kernel's accesses through it need (a misaligned vector
    /// store faults the host process or the GPU context), and [`KernelArg::Null`] goes only
    /// where the kernel does not dereference it.
    unsafe fn launch_unchecked(
        &self,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
    ) -> Result<(), ExecError> {
        // SAFETY: the caller's contract is the one `launch_with` asks for with `unsigned_ok`.
        unsafe { self.launch_with(kernel, config, args, true) }
    }

    /// What [`launch`](Executor::launch) and [`launch_unchecked`](Executor::launch_unchecked)
    /// call: the one launch entry an executor implements (callers use those two, and
    /// implementors leave them as provided, so a wrapper that forwards this forwards both).
    /// It makes every check `launch` documents for a kernel with a signature, and refuses a
    /// kernel without one unless `unsigned_ok`; the safe `launch` relies on both.
    ///
    /// # Safety
    ///
    /// With `unsigned_ok`, the contract of [`launch_unchecked`](Executor::launch_unchecked);
    /// without it, none.
    unsafe fn launch_with(
        &self,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError>;

    /// Copies every region from `src` to `dst`, in order, stream-ordered after earlier work and
    /// without synchronising: the DMA path (merged with [`merge_regions`]; one
    /// `cuMemcpyBatchAsync`, or `cuMemcpyAsync` per region, on CUDA; `memcpy` on the
    /// host executor). Device and host buffers may be mixed freely. All regions are checked
    /// before any is copied ([`ExecError::OutOfBounds`], [`ExecError::OverlappingCopy`]), so a
    /// rejected batch changes nothing. Counted in [`Counters::copies`].
    /// The same as [`copy_regions_with`](Executor::copy_regions_with) with
    /// [`DmaMode::Batched`].
    fn copy_regions(
        &self,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
    ) -> Result<(), ExecError>;

    /// [`copy_regions`](Executor::copy_regions), issuing the merged batch as `mode` says, so
    /// that `tune` can time one batch call against one call per region on the same GPU. The
    /// default ignores `mode`: right for an executor whose batch is one call per region
    /// anyway ([`batched_copies`](Executor::batched_copies) false). An executor that batches,
    /// and a wrapper around one, implements it (and `batched_copies`).
    fn copy_regions_with(
        &self,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
        mode: DmaMode,
    ) -> Result<(), ExecError> {
        let _ = mode;
        self.copy_regions(src, dst, regions)
    }

    /// Whether [`DmaMode::Batched`] issues a batch of more than one merged region as one call
    /// (the CUDA executor on a driver that exports `cuMemcpyBatchAsync`). When false both
    /// modes issue one call per merged region, so `tune` times them once, not twice under
    /// two names.
    fn batched_copies(&self) -> bool {
        false
    }

    /// Writes `byte` over every `(offset, len)` range of `buffer`, stream-ordered after
    /// earlier work and without synchronising: `cuMemsetD8Async` on CUDA device memory,
    /// `memset` on the host executor. This is how the cluster poisons freed pages and reused
    /// scratch buffers again without moving the bytes over PCIe. All ranges are checked
    /// before any is written ([`ExecError::OutOfBounds`]). Counted in [`Counters::fills`].
    fn fill(&self, buffer: BufferId, ranges: &[(u64, u64)], byte: u8) -> Result<(), ExecError>;

    /// Waits until all launched work has finished (counted).
    fn synchronize(&self) -> Result<(), ExecError>;

    /// Seconds from the start of the work `work` enqueues to its end, waiting for it to finish
    /// (counted as one synchronisation). The default is wall time around the work and a
    /// synchronise, exact for the host executor, whose launches run on the calling thread.
    /// The CUDA executor records events before and after the work on its stream: time the
    /// device spends idle waiting for the host to submit (many small DMA copies, say) is
    /// included, as an engine would see it, but time spent before the first submission is not.
    fn time_work(&self, work: &mut dyn FnMut() -> Result<(), ExecError>) -> Result<f64, ExecError> {
        let start = std::time::Instant::now();
        work()?;
        self.synchronize()?;
        Ok(start.elapsed().as_secs_f64())
    }

    /// A second executor on the same device whose work runs beside this one's (its own
    /// stream): `tune` runs the busy kernel on it while it times transfers here. `None` (the
    /// default) where work cannot overlap: the host executor runs launches on the calling
    /// thread.
    fn companion(&self) -> Result<Option<Box<dyn Executor>>, ExecError> {
        Ok(None)
    }

    /// The device's SM count, where it has SMs and says: `tune` sizes its busy companions
    /// to leave each SM room for a transfer block (docs/KERNELS.md "busy").
    fn multiprocessors(&self) -> Option<u32> {
        None
    }

    /// A snapshot of the operation counters.
    fn counters(&self) -> Counters;

    /// Makes the next launch fail with [`LaunchFailure::Injected`] without running the kernel.
    /// The failure stays armed until a launch consumes it or
    /// [`Executor::disarm_launch_failure`] cancels it. Only a launch that passes every check
    /// (kernel handle, signature, arguments) consumes it: an invalid launch reports its own
    /// error and leaves the failure armed.
    fn inject_launch_failure(&self);

    /// Marks the end of what this executor has enqueued so far: work enqueued after a
    /// [`Executor::wait_event`] on the event runs after all of it. A layer-wise load records
    /// one per layer, so attention on layer `l` waits for that layer's copies only. The
    /// default, for executors that run work as it is enqueued (the host executor), is an
    /// event that has already happened.
    fn record_event(&self) -> Result<EventId, ExecError> {
        Ok(EventId(0))
    }

    /// Enqueues a layer-wise load: `layers[l]`'s work, then an event marking layer `l`
    /// loaded, for each layer in order; returns the events. The work runs after everything
    /// enqueued before the call. Work enqueued after the call is ordered after layer `l`
    /// only by a [`Executor::wait_event`] on its event: executors with a stream of their own
    /// for loads (CUDA: the greatest priority, so a load does not queue behind a model's
    /// kernels) run the layers there, so that layer `l + 1` copies while a consumer that
    /// waited for layer `l` reads it. The default, for executors that run work as it is
    /// enqueued, runs it in order and records [`Executor::record_event`] after each layer.
    ///
    /// `signals`, empty or one entry per step: this executor's interprocess events
    /// ([`Executor::shared_event`]) to record right after that step's work, where it runs,
    /// so that a peer process waiting on one waits for the load up to that step only (the
    /// per-layer fence of `src/rank/fence.rs`). Executors without such events refuse
    /// signals, as [`Executor::record_shared`] does.
    fn load_layers(
        &self,
        layers: &[Vec<LoadOp<'_>>],
        signals: &[&[EventId]],
    ) -> Result<Vec<EventId>, ExecError> {
        let mut events = Vec::with_capacity(layers.len());
        for (i, ops) in layers.iter().enumerate() {
            for op in ops {
                op.run(self)?;
            }
            events.push(self.record_event()?);
            for &signal in signals.get(i).copied().unwrap_or_default() {
                self.record_shared(signal)?;
            }
        }
        Ok(events)
    }

    /// Enqueues a backup (device→host copies of pages nobody writes any more, and the page
    /// ids they read, as [`LoadOp`]s) and returns an event marking its end. The work runs
    /// after everything enqueued before the call; work enqueued after it is ordered after the
    /// backup only by a [`Executor::wait_event`] on the event. Executors with a stream for
    /// backups (CUDA: the least priority) run it there, so a load never queues behind a
    /// backup and the link's two directions are busy at once: whoever frees or rewrites the
    /// backup's pages waits for its event first. Host reads and writes of memory it writes
    /// ([`Executor::read`], [`Executor::upload`], [`Executor::fill`] on host buffers) wait for
    /// it as for all the executor's work. The default, for executors that run work as it is
    /// enqueued, runs it in order and records [`Executor::record_event`].
    fn backup(&self, ops: &[LoadOp<'_>]) -> Result<EventId, ExecError> {
        for op in ops {
            op.run(self)?;
        }
        self.record_event()
    }

    /// Whether the work before `event` has run (queried, never waited for: `cuEventQuery`),
    /// so that whoever keeps events of pending work can let go of finished ones. An event of
    /// another executor, or one released, is refused. The default, for executors whose
    /// events have happened when recorded, is true.
    fn event_done(&self, event: EventId) -> Result<bool, ExecError> {
        let _ = event;
        Ok(true)
    }

    /// Makes work enqueued from now on wait for `event`: a wait on the device side
    /// (`cuStreamWaitEvent`), not a host synchronisation, so it is not counted as one and
    /// may be used on the load path. An event of another executor, or one released, is
    /// refused.
    fn wait_event(&self, event: EventId) -> Result<(), ExecError> {
        let _ = event;
        Ok(())
    }

    /// [`Executor::wait_event`] issued on the caller's `stream` (a raw `CUstream` on CUDA,
    /// an engine's, as in [`Executor::follow_stream`]): work the caller enqueues there from
    /// now on waits for `event` on the device, so its kernels read what the executor loaded
    /// without a host synchronisation. Executors whose work has run by the time a call
    /// returns (the host executor) have nothing to order: `Ok`, the handle unused. An event
    /// of another executor, or one released, is refused.
    ///
    /// # Safety
    /// `stream` must be a live stream of the executor's context (or 0, the legacy default
    /// stream): the driver dereferences the handle.
    unsafe fn wait_event_on(&self, event: EventId, stream: u64) -> Result<(), ExecError> {
        let _ = (event, stream);
        Ok(())
    }

    /// Releases an event once nothing will wait for it any more.
    fn release_event(&self, event: EventId) {
        let _ = event;
    }

    /// An event that executors in other processes can wait on (CUDA: `CU_EVENT_INTERPROCESS`),
    /// and the handle (bytes, to be all-gathered) they open it with
    /// ([`Executor::open_shared_event`]). Its owner records it with
    /// [`Executor::record_shared`]; [`Executor::release_event`] destroys it. Executors with no
    /// such events refuse ([`ExecError::Peer`]), and their ranks fence on the host instead.
    fn shared_event(&self) -> Result<(EventId, Vec<u8>), ExecError> {
        Err(ExecError::Peer {
            op: "shared_event",
            message: format!("the {} executor has no interprocess events", self.backend()),
        })
    }

    /// Records `event`, one of this executor's [`Executor::shared_event`]s, at the current end
    /// of the cache's stream: a peer's wait issued after this call waits for everything
    /// enqueued on that stream before it (and what that stream waited for).
    fn record_shared(&self, event: EventId) -> Result<(), ExecError> {
        let _ = event;
        Err(ExecError::Peer {
            op: "record_shared",
            message: format!("the {} executor has no interprocess events", self.backend()),
        })
    }

    /// Waits on the host until the work before `event` has run: the fallback where the device
    /// refused [`Executor::wait_event`]. The default, for executors whose events have
    /// happened when recorded, returns at once.
    fn sync_event(&self, event: EventId) -> Result<(), ExecError> {
        let _ = event;
        Ok(())
    }

    /// Opens a peer's [`Executor::shared_event`] from its handle: [`Executor::wait_event`],
    /// [`Executor::wait_event_on`] and [`Executor::event_done`] on the returned event wait
    /// for (or query) the owner's last recording before the call.
    fn open_shared_event(&self, handle: &[u8]) -> Result<EventId, ExecError> {
        let _ = handle;
        Err(ExecError::Peer {
            op: "open_shared_event",
            message: format!("the {} executor has no interprocess events", self.backend()),
        })
    }

    /// Cancels a failure armed by [`Executor::inject_launch_failure`] that no launch has
    /// consumed yet; returns whether one was armed. Executors that arm failures override
    /// this (wrappers forward it); the default, for executors that cannot be armed, does
    /// nothing and returns false.
    fn disarm_launch_failure(&self) -> bool {
        false
    }
}
