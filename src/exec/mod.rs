//! Kernel executors: one [`Executor`] trait that runs the same rendered kernels on a GPU
//! (the CUDA executor) or on the CPU (the host executor, through the CUDA-emulation header).
//!
//! An executor owns device buffers, host buffers, loaded kernels and a stream of launches. The
//! caller allocates buffers (filled with a poison byte), uploads small control data, loads a
//! kernel artifact, launches it with typed arguments, and reads results back only when it must.
//! Every read back and every synchronisation is counted ([`Counters`]) so that a caller can
//! assert that a path (for example HiCache load-back) is free of them.
//!
//! Ranks with executors of their own reach each other's device pools through peer mappings
//! ([`Executor::alloc_shareable`], [`Executor::export`], [`Executor::import`]): POSIX shared
//! memory on the host executor, which maps in this process or another, and CUDA IPC on the
//! CUDA executor, which maps only across processes ([`Executor::maps_in_process`],
//! [`ExecError::IpcSameProcess`]).

pub mod cuda;
pub mod host;
mod registry;
mod share;
mod signature;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use host::{BlockOrder, HostExecutor, HostOptions};
pub use share::RankView;
pub(crate) use signature::PendingLaunch;

use crate::kernels::KernelSignature;

/// Errors of the executors. Every variant carries enough context to be reported as is.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The backend cannot be used on this machine (no driver, no device, no library).
    #[error("{backend} executor unavailable: {reason}")]
    Unavailable {
        /// Which backend was asked for.
        backend: Backend,
        /// Why it cannot be used.
        reason: String,
    },
    /// A buffer could not be allocated.
    #[error("cannot allocate {bytes} bytes of {kind} memory: {reason}")]
    Alloc {
        /// Requested size.
        bytes: usize,
        /// Device or host memory.
        kind: MemKind,
        /// Underlying reason.
        reason: String,
    },
    /// A buffer handle that this executor does not know (freed, or from another executor).
    #[error("unknown buffer {0:?}")]
    UnknownBuffer(BufferId),
    /// A read, upload or pointer argument outside a buffer.
    #[error("{op} of {len} bytes at offset {offset} is outside buffer {buffer:?} of {size} bytes")]
    OutOfBounds {
        /// The operation (`read`, `upload`, `kernel argument`).
        op: &'static str,
        /// The buffer.
        buffer: BufferId,
        /// Start offset in bytes.
        offset: u64,
        /// Length in bytes.
        len: u64,
        /// Buffer size in bytes.
        size: usize,
    },
    /// A kernel artifact could not be loaded, or its entry point was not found.
    #[error("cannot load kernel `{entry}` from {artifact}: {message}")]
    Load {
        /// Entry (kernel) name.
        entry: String,
        /// Where the artifact came from (a path, or "CUBIN (N bytes)").
        artifact: String,
        /// Loader message.
        message: String,
    },
    /// An artifact kind that this executor does not run (a CUBIN on the host executor, ...).
    #[error("{backend} executor cannot load {artifact}")]
    WrongArtifact {
        /// The executor's backend.
        backend: Backend,
        /// The artifact kind offered.
        artifact: &'static str,
    },
    /// A kernel handle that this executor does not know.
    #[error("unknown kernel {0:?}")]
    UnknownKernel(KernelId),
    /// A launch failed: bad configuration, deadlock or mismatched intrinsics in the emulator,
    /// a driver error, or an injected fault.
    #[error("launch of kernel `{kernel}` failed ({cause}): {message}")]
    Launch {
        /// Kernel (entry) name.
        kernel: String,
        /// Classified cause.
        cause: LaunchFailure,
        /// Diagnostic from the emulator or the driver.
        message: String,
    },
    /// A configuration value (environment variable, option) is invalid.
    #[error("invalid {name} `{value}`: {reason}")]
    Config {
        /// Option or variable name.
        name: &'static str,
        /// The value found.
        value: String,
        /// What is accepted.
        reason: String,
    },
    /// A copy region whose source and destination overlap inside one buffer.
    #[error("copy in buffer {buffer:?} overlaps itself: {region}")]
    OverlappingCopy {
        /// The buffer.
        buffer: BufferId,
        /// The offending region.
        region: CopyRegion,
    },
    /// The executor cannot do what was asked (adopting memory it did not allocate, on a
    /// backend without that yet).
    #[error("{backend} executor: {what} is not supported")]
    NotSupported {
        /// The executor's backend.
        backend: Backend,
        /// What was asked.
        what: &'static str,
    },
    /// A peer mapping could not be made: the executor has none, or a handle that does not
    /// name a live shareable buffer.
    #[error("peer mapping ({op}): {message}")]
    Peer {
        /// `alloc_shareable`, `export` or `import`.
        op: &'static str,
        /// Why.
        message: String,
    },
    /// A CUDA IPC handle opened in the process that exported it. CUDA refuses that
    /// (`cuIpcOpenMemHandle` fails with `CUDA_ERROR_INVALID_CONTEXT`), so the executor does
    /// not try: ranks in one process share one executor and reach each other's buffers
    /// directly ([`PeerAccess::Direct`](crate::rank::PeerAccess::Direct)); IPC is for ranks
    /// in separate processes.
    #[error(
        "peer mapping (import): buffer {buffer:?} was exported by this process (pid {pid}); \
         a CUDA IPC handle cannot be opened in the process that made it, so ranks in one \
         process must share one executor and reach each other's pools directly"
    )]
    IpcSameProcess {
        /// The exporter's buffer.
        buffer: BufferId,
        /// This process.
        pid: u32,
    },
    /// An error reported by the CUDA driver outside a launch.
    #[error("CUDA driver error in {op}: {message}")]
    Driver {
        /// Operation that failed.
        op: &'static str,
        /// Driver message.
        message: String,
    },
}

impl ExecError {
    /// True for the executor-unavailable error (callers fall back to another backend).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ExecError::Unavailable { .. })
    }

    /// The launch failure cause, if this is a launch error.
    pub fn launch_failure(&self) -> Option<LaunchFailure> {
        match self {
            ExecError::Launch { cause, .. } => Some(*cause),
            _ => None,
        }
    }
}

/// Why a launch failed; lets callers and tests tell a deadlock from a bad configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LaunchFailure {
    /// Launch shape, parameter count or parameter sizes rejected.
    InvalidConfig,
    /// No thread could proceed (for example `__syncthreads` in divergent code).
    Deadlock,
    /// Threads of one group met at different intrinsics or masks.
    Mismatch,
    /// A warp intrinsic's mask did not contain the calling lane.
    BadMask,
    /// The executor ran out of memory for the launch (fiber stacks).
    OutOfMemory,
    /// The kernel called `__trap()`.
    Trap,
    /// A fault injected with [`Executor::inject_launch_failure`].
    Injected,
    /// Anything else (driver error, unknown status).
    Other,
}

impl fmt::Display for LaunchFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LaunchFailure::InvalidConfig => "invalid configuration",
            LaunchFailure::Deadlock => "deadlock",
            LaunchFailure::Mismatch => "mismatched intrinsics",
            LaunchFailure::BadMask => "bad warp mask",
            LaunchFailure::OutOfMemory => "out of memory",
            LaunchFailure::Trap => "trap",
            LaunchFailure::Injected => "injected fault",
            LaunchFailure::Other => "error",
        })
    }
}

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

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Device memory (`cuMemAlloc`; a heap allocation on the host executor).
    Device,
    /// Host memory that kernels can address directly (pinned and device-mapped on CUDA).
    Host,
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemKind::Device => "device",
            MemKind::Host => "host",
        })
    }
}

/// Handle of a buffer owned by one executor. Handles are never reused within an executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

/// Handle of a kernel loaded into one executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelId(pub u64);

/// A point in one executor's stream ([`Executor::record_event`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(pub u64);

/// A compiled kernel, as produced by the JIT for one backend.
///
/// `signature` is the kernel's launch contract when it was rendered from a spec
/// ([`KernelSpec::signature`](crate::kernels::KernelSpec::signature); the JIT's
/// [`CompiledKernel::load_spec`](crate::jit::CompiledKernel::load_spec) passes it). The executor
/// keeps it with the loaded kernel and checks every launch's shape and arguments against it.
/// A kernel loaded with `None` (hand-written test kernels) is refused by
/// [`Executor::launch`] and runs only through [`Executor::launch_unchecked`].
#[derive(Debug, Clone, Copy)]
pub enum KernelArtifact<'a> {
    /// A host-emulation shared library; the executor resolves `<entry>__emu_launch`.
    /// It must be a kernel render compiled with `cuda_emu.h` (as the JIT builds them):
    /// loading runs its initialisers, and the entry is called with the `CpEmuLaunch` ABI.
    HostLibrary {
        /// Path of the `.so`.
        path: &'a Path,
        /// Kernel entry name (the spec's `uri()`).
        entry: &'a str,
        /// The kernel's launch contract, checked on every launch when given.
        signature: Option<&'a KernelSignature>,
    },
    /// A CUBIN image for the CUDA executor.
    Cubin {
        /// The image bytes.
        image: &'a [u8],
        /// Kernel entry name (the spec's `uri()`).
        entry: &'a str,
        /// The kernel's launch contract, checked on every launch when given.
        signature: Option<&'a KernelSignature>,
    },
}

impl<'a> KernelArtifact<'a> {
    /// The kernel entry name.
    pub fn entry(&self) -> &str {
        match self {
            KernelArtifact::HostLibrary { entry, .. } | KernelArtifact::Cubin { entry, .. } => {
                entry
            }
        }
    }

    /// The kernel's launch contract, when it has one.
    pub fn signature(&self) -> Option<&'a KernelSignature> {
        match *self {
            KernelArtifact::HostLibrary { signature, .. }
            | KernelArtifact::Cubin { signature, .. } => signature,
        }
    }

    /// A short description for error messages.
    pub fn describe(&self) -> String {
        match self {
            KernelArtifact::HostLibrary { path, .. } => path.display().to_string(),
            KernelArtifact::Cubin { image, .. } => format!("CUBIN ({} bytes)", image.len()),
        }
    }

    /// The library path, for host artifacts.
    pub fn path(&self) -> Option<PathBuf> {
        match self {
            KernelArtifact::HostLibrary { path, .. } => Some(path.to_path_buf()),
            KernelArtifact::Cubin { .. } => None,
        }
    }
}

/// One kernel argument, turned into a `void**` entry by the executor's FFI layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelArg<'a> {
    /// Address of `buffer` plus a byte offset (checked against the buffer's size).
    Ptr(BufferId, u64),
    /// A null pointer. No rendered kernel accepts one (they dereference every pointer), so a
    /// launch of a kernel loaded with a signature refuses it; it is for hand-written kernels
    /// that do not dereference that parameter.
    Null,
    /// `u32` by value.
    U32(u32),
    /// `i32` by value.
    I32(i32),
    /// `u64` by value.
    U64(u64),
    /// `i64` by value.
    I64(i64),
    /// A by-value struct: its exact bytes in the kernel's layout (`#[repr(C)]`).
    Bytes(&'a [u8]),
    /// A by-value struct of pointers (`struct { const u8* p[N]; }`), each the address of a
    /// buffer plus a byte offset; the executor fills in the addresses.
    PtrStruct(&'a [(BufferId, u64)]),
}

impl KernelArg<'_> {
    /// Size of the argument value in bytes, as the kernel sees it.
    pub fn size(&self) -> usize {
        match self {
            KernelArg::Ptr(..) | KernelArg::Null | KernelArg::U64(_) | KernelArg::I64(_) => 8,
            KernelArg::U32(_) | KernelArg::I32(_) => 4,
            KernelArg::Bytes(b) => b.len(),
            KernelArg::PtrStruct(p) => 8 * p.len(),
        }
    }
}

/// Checks that `len` bytes at `offset` lie inside a buffer of `size` bytes; returns the range.
pub(crate) fn check_range(
    op: &'static str,
    buffer: BufferId,
    size: usize,
    offset: u64,
    len: u64,
) -> Result<std::ops::Range<usize>, ExecError> {
    let oob = || ExecError::OutOfBounds {
        op,
        buffer,
        offset,
        len,
        size,
    };
    let end = offset.checked_add(len).ok_or_else(oob)?;
    if end > size as u64 {
        return Err(oob());
    }
    Ok(offset as usize..end as usize)
}

/// The bytes each `void**` entry of a launch points at, one vector per argument, in the
/// kernel's parameter order. `resolve` gives a buffer's base address and size; pointer
/// offsets may be one past the end, never beyond.
///
/// With a `signature` (checked by [`signature::check_signature`] first), every pointer must
/// also have its parameter's [`Reach`](crate::kernels::Reach) left in its buffer after the
/// offset, the reach computed from this launch's scalar arguments (the 32 bits the kernel
/// sees): that is what keeps a launch inside its buffers. A pointer parameter that declares
/// no reach is refused.
///
/// A pointer argument whose buffer is unknown, whose offset lies outside it, or whose buffer
/// is shorter than its reach is [`ExecError::Launch`] with [`LaunchFailure::InvalidConfig`],
/// naming `kernel` and the parameter (its index, and its name and type when `signature`
/// gives them) before the underlying [`ExecError::UnknownBuffer`] /
/// [`ExecError::OutOfBounds`] message.
///
/// With a `signature`, a parameter the kernel writes ([`KernelParam::writes`]) must not
/// overlap any other pointer's reach: threads would read bytes other threads are writing, so
/// the result would depend on the order they run in (different on a GPU and in each
/// emulated block order). Such a launch is refused the same way, naming both parameters.
///
/// [`KernelParam::writes`]: crate::kernels::KernelParam::writes
pub(crate) fn marshal_args(
    kernel: &str,
    signature: Option<&KernelSignature>,
    args: &[KernelArg<'_>],
    resolve: impl Fn(BufferId) -> Result<(u64, usize), ExecError>,
) -> Result<Vec<Vec<u8>>, ExecError> {
    // A count as the kernel sees it: the 32 bits of a u32 (or i32) argument.
    let scalar = |name: &str| {
        let i = signature?.params.iter().position(|p| p.name == name)?;
        match args.get(i)? {
            KernelArg::U32(v) => Some(*v),
            KernelArg::I32(v) => Some(*v as u32),
            _ => None,
        }
    };
    // Bytes a pointer argument must have from its offset on: its parameter's reach. A signed
    // kernel's pointer parameter without one is refused: nothing would bound it.
    let reach = |i: usize| -> Result<u64, ExecError> {
        let Some(p) = signature.and_then(|s| s.params.get(i)) else {
            return Ok(0);
        };
        let problem = match p.reach.map(|r| (r, r.bytes(scalar))) {
            Some((_, Ok(bytes))) => return Ok(bytes),
            Some((r, Err(e))) => format!("reaches {r} bytes, which {e}"),
            None => "declares no reach, so nothing bounds what the kernel touches".into(),
        };
        Err(ExecError::Launch {
            kernel: kernel.to_string(),
            cause: LaunchFailure::InvalidConfig,
            message: format!("parameter {i} `{}` {problem}", p.name),
        })
    };
    let pointer = |b: BufferId, off: u64, reach: u64| -> Result<[u8; 8], ExecError> {
        let (addr, size) = resolve(b)?;
        check_range("kernel argument", b, size, off, reach)?;
        Ok((addr + off).to_ne_bytes())
    };
    let invalid = |i: usize, element: Option<usize>, e: ExecError| {
        let p = signature.and_then(|s| s.params.get(i));
        let param = match p {
            Some(p) => format!("parameter {i} `{}` ({})", p.name, p.c_type),
            None => format!("parameter {i}"),
        };
        let element = element
            .map(|j| format!(", pointer {j}"))
            .unwrap_or_default();
        // A buffer shorter than the reach: say what the kernel needs from it.
        let reach = match p.and_then(|p| p.reach) {
            Some(r) if matches!(e, ExecError::OutOfBounds { len, .. } if len > 0) => {
                format!(" (the kernel reaches {r} bytes from it)")
            }
            _ => String::new(),
        };
        ExecError::Launch {
            kernel: kernel.to_string(),
            cause: LaunchFailure::InvalidConfig,
            message: format!("{param}{element}: {e}{reach}"),
        }
    };
    // What each pointer reaches, checked in bounds above: (parameter, buffer, byte range).
    let mut spans: Vec<(usize, BufferId, std::ops::Range<u64>)> = Vec::new();
    let mut out = Vec::with_capacity(args.len());
    for (i, arg) in args.iter().enumerate() {
        out.push(match *arg {
            KernelArg::Ptr(b, off) => {
                let reach = reach(i)?;
                let bytes = pointer(b, off, reach).map_err(|e| invalid(i, None, e))?;
                spans.push((i, b, off..off + reach));
                bytes.to_vec()
            }
            KernelArg::Null => vec![0; 8],
            KernelArg::U32(v) => v.to_ne_bytes().to_vec(),
            KernelArg::I32(v) => v.to_ne_bytes().to_vec(),
            KernelArg::U64(v) => v.to_ne_bytes().to_vec(),
            KernelArg::I64(v) => v.to_ne_bytes().to_vec(),
            KernelArg::Bytes(b) => b.to_vec(),
            KernelArg::PtrStruct(ptrs) => {
                let mut out = Vec::with_capacity(8 * ptrs.len());
                let reach = reach(i)?;
                for (j, &(b, off)) in ptrs.iter().enumerate() {
                    out.extend_from_slice(
                        &pointer(b, off, reach).map_err(|e| invalid(i, Some(j), e))?,
                    );
                    spans.push((i, b, off..off + reach));
                }
                out
            }
        });
    }
    if let Some(sig) = signature {
        check_no_aliased_output(kernel, sig, &spans)?;
    }
    Ok(out)
}

/// Refuses a launch in which a written parameter's reach overlaps another pointer's
/// ([`marshal_args`]). `spans` are (parameter index, buffer, byte range); empty ranges touch
/// nothing.
fn check_no_aliased_output(
    kernel: &str,
    sig: &KernelSignature,
    spans: &[(usize, BufferId, std::ops::Range<u64>)],
) -> Result<(), ExecError> {
    let writes = |i: usize| sig.params.get(i).is_some_and(|p| p.writes());
    for (k, (i, b, r)) in spans.iter().enumerate() {
        for (j, c, s) in &spans[k + 1..] {
            let touch = !r.is_empty() && !s.is_empty();
            let overlap = touch && b == c && r.start < s.end && s.start < r.end;
            if !overlap || !(writes(*i) || writes(*j)) {
                continue;
            }
            // Name the written one first.
            let ((w, wr), (o, or)) = if writes(*i) {
                ((i, r), (j, s))
            } else {
                ((j, s), (i, r))
            };
            let name = |p: usize| sig.params.get(p).map_or("?", |p| p.name);
            return Err(ExecError::Launch {
                kernel: kernel.to_string(),
                cause: LaunchFailure::InvalidConfig,
                message: format!(
                    "parameter {w} `{}` (written) overlaps parameter {o} `{}` in buffer {b:?}: \
                     bytes {}..{} and {}..{}; a kernel's output must not alias another of its \
                     pointers (threads would read what others write, in no fixed order)",
                    name(*w),
                    name(*o),
                    wr.start,
                    wr.end,
                    or.start,
                    or.end
                ),
            });
        }
    }
    Ok(())
}

/// One contiguous copy of a DMA batch ([`Executor::copy_regions`]): `len` bytes from
/// `src_offset` of the source buffer to `dst_offset` of the destination buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CopyRegion {
    /// Byte offset in the source buffer.
    pub src_offset: u64,
    /// Byte offset in the destination buffer.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

impl fmt::Display for CopyRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} bytes from offset {} to offset {}",
            self.len, self.src_offset, self.dst_offset
        )
    }
}

/// How an executor issues a merged DMA batch ([`Executor::copy_regions_with`]). `tune` times
/// both on a GPU (candidates `dma` and `dma-each`), and a deployment's
/// [`TransferPath`](crate::kernels::TransferPath) names the one it takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DmaMode {
    /// The whole batch in one call where the executor has one (`cuMemcpyBatchAsync`, CUDA
    /// 12.8+: [`Executor::batched_copies`]); elsewhere the same as [`DmaMode::PerRegion`].
    #[default]
    Batched,
    /// One call per merged region (`cuMemcpyAsync` each on CUDA, `memcpy` each on the host
    /// executor), even where a batch call exists.
    PerRegion,
}

impl fmt::Display for DmaMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DmaMode::Batched => "batched",
            DmaMode::PerRegion => "per-region",
        })
    }
}

/// The regions of a copy batch with neighbours merged: a region whose source and destination
/// both start where another's end becomes one longer region, so a batch of page blobs issues
/// one copy per contiguous run, not one per blob (2,048 pages × 61 layers would otherwise be
/// ≈ 125,000 `cuMemcpyAsync` calls per buffer). Empty regions are dropped. Between two
/// buffers (`same_buffer` false) whose destinations are pairwise disjoint (transfers refuse
/// a page named twice), the order of the regions does not matter, so they are sorted by
/// destination first and scattered runs merge too; otherwise (within one buffer, where a
/// region may read what an earlier one wrote, or with overlapping destinations) only
/// consecutive regions merge, in order. Both executors merge every batch
/// ([`Executor::copy_regions`]); the bytes moved are the same.
pub fn merge_regions(regions: &[CopyRegion], same_buffer: bool) -> Vec<CopyRegion> {
    let mut v: Vec<CopyRegion> = regions.iter().copied().filter(|r| r.len > 0).collect();
    if !same_buffer {
        let mut sorted = v.clone();
        sorted.sort_by_key(|r| (r.dst_offset, r.src_offset));
        if sorted
            .windows(2)
            .all(|w| w[0].dst_offset + w[0].len <= w[1].dst_offset)
        {
            v = sorted;
        }
    }
    let mut out: Vec<CopyRegion> = Vec::with_capacity(v.len());
    for r in v {
        match out.last_mut() {
            Some(p)
                if p.src_offset + p.len == r.src_offset && p.dst_offset + p.len == r.dst_offset =>
            {
                p.len += r.len
            }
            _ => out.push(r),
        }
    }
    out
}

/// Checks every region of a copy batch against both buffers before anything is copied, so a
/// bad batch changes nothing; returns the bytes the batch moves. Within one buffer a region's
/// source and destination must not overlap (`memcpy` semantics); regions are applied in order.
pub(crate) fn check_regions(
    (src, src_size): (BufferId, usize),
    (dst, dst_size): (BufferId, usize),
    regions: &[CopyRegion],
) -> Result<u64, ExecError> {
    let mut bytes = 0u64;
    for &r in regions {
        let s = check_range("copy source", src, src_size, r.src_offset, r.len)?;
        let d = check_range("copy destination", dst, dst_size, r.dst_offset, r.len)?;
        if src == dst && r.len > 0 && s.start < d.end && d.start < s.end {
            return Err(ExecError::OverlappingCopy {
                buffer: src,
                region: r,
            });
        }
        bytes += r.len;
    }
    Ok(bytes)
}

/// Launch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
    /// Dynamic shared memory bytes (the host executor supports only 0).
    pub shared_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional launch of `blocks` blocks of `threads` threads.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        LaunchConfig {
            grid: [blocks, 1, 1],
            block: [threads, 1, 1],
            shared_bytes: 0,
        }
    }
}

/// Operation counts since the executor was created. Take a snapshot before a scope and call
/// [`Counters::since`] after it to get that scope's counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Counters {
    /// Kernel launches (including failed ones).
    pub launches: u64,
    /// Synchronisations: explicit ones ([`Executor::synchronize`], [`Executor::time_work`])
    /// and, on CUDA, writes to pinned host memory, which wait for the device. Frees, which
    /// also wait on CUDA, are counted in `frees` only ([`Counters::stalls`] adds them up).
    pub syncs: u64,
    /// Read-backs ([`Executor::read`]); each one waits for the work writing the buffer.
    pub reads: u64,
    /// Bytes read back.
    pub bytes_read: u64,
    /// Uploads ([`Executor::upload`]).
    pub uploads: u64,
    /// Bytes uploaded.
    pub bytes_uploaded: u64,
    /// Buffer allocations, and on CUDA the pinned staging rings uploads had to allocate
    /// (a page-locked allocation stalls concurrent streams, as a device allocation does).
    pub allocs: u64,
    /// Buffers freed ([`Executor::free`]), on every backend (as `allocs` counts allocations);
    /// on CUDA each one waits for the context's work (`cuCtxSynchronize` before `cuMemFree`).
    pub frees: u64,
    /// Copy batches ([`Executor::copy_regions`]).
    pub copies: u64,
    /// Bytes moved by copy batches.
    pub bytes_copied: u64,
    /// Fill batches ([`Executor::fill`]).
    pub fills: u64,
    /// Bytes written by fill batches.
    pub bytes_filled: u64,
}

impl Counters {
    /// What a path that must not stall the device adds up to, and must keep at 0: read-backs,
    /// synchronisations, allocations and frees. Each waits for the device, or stalls other
    /// streams, on CUDA; counting all four on every backend lets a CPU test see a path that
    /// would stall a GPU.
    pub fn stalls(&self) -> u64 {
        self.reads + self.syncs + self.allocs + self.frees
    }

    /// `self` and `other` added up (a caller's share of work counted in pieces).
    pub fn plus(&self, other: &Counters) -> Counters {
        Counters {
            launches: self.launches + other.launches,
            syncs: self.syncs + other.syncs,
            reads: self.reads + other.reads,
            bytes_read: self.bytes_read + other.bytes_read,
            uploads: self.uploads + other.uploads,
            bytes_uploaded: self.bytes_uploaded + other.bytes_uploaded,
            allocs: self.allocs + other.allocs,
            frees: self.frees + other.frees,
            copies: self.copies + other.copies,
            bytes_copied: self.bytes_copied + other.bytes_copied,
            fills: self.fills + other.fills,
            bytes_filled: self.bytes_filled + other.bytes_filled,
        }
    }

    /// Counts accumulated between `earlier` and `self`.
    pub fn since(&self, earlier: &Counters) -> Counters {
        Counters {
            launches: self.launches.saturating_sub(earlier.launches),
            syncs: self.syncs.saturating_sub(earlier.syncs),
            reads: self.reads.saturating_sub(earlier.reads),
            bytes_read: self.bytes_read.saturating_sub(earlier.bytes_read),
            uploads: self.uploads.saturating_sub(earlier.uploads),
            bytes_uploaded: self.bytes_uploaded.saturating_sub(earlier.bytes_uploaded),
            allocs: self.allocs.saturating_sub(earlier.allocs),
            frees: self.frees.saturating_sub(earlier.frees),
            copies: self.copies.saturating_sub(earlier.copies),
            bytes_copied: self.bytes_copied.saturating_sub(earlier.bytes_copied),
            fills: self.fills.saturating_sub(earlier.fills),
            bytes_filled: self.bytes_filled.saturating_sub(earlier.bytes_filled),
        }
    }

    /// True when the scope neither read back nor synchronised.
    pub fn is_sync_free(&self) -> bool {
        self.reads == 0 && self.syncs == 0
    }
}

/// Where a buffer's bytes are ([`Executor::address`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Address {
    /// The first byte's address in `space`.
    pub ptr: u64,
    /// Which memory the address is in.
    pub space: AddressSpace,
}

/// The memory an [`Address`] is in, as DLPack names devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressSpace {
    /// This process's (host) memory.
    Host,
    /// CUDA device memory of the device with this ordinal.
    Cuda(i32),
}

/// A kernel executor.
///
/// Contract:
/// - All methods take `&self`; implementations are `Send + Sync` and serialise their own
///   state, so one executor may be shared by threads. Launches are stream-ordered: a launch,
///   upload or read observes every earlier call on the same executor.
/// - One executor is one stream: launches, uploads, copies and fills run in the order they
///   were called, never on several streams; wrappers forward to one inner executor. Work on
///   another executor is another stream, unordered with this one, and buffer and kernel
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
    /// [`CompiledKernel::load_spec`](crate::jit::CompiledKernel::load_spec) passes it): a host
    /// library is `dlopen`ed, which runs its initialisers, and its `<entry>__emu_launch` is
    /// later called with the `CpEmuLaunch` ABI; a CUBIN's entry is later launched with
    /// arguments laid out for the kernel's signature. Any other library or image is arbitrary
    /// code in this process or on the device. With a signature, the artifact must be built
    /// from the unedited render of the spec that signature came from
    /// ([`KernelSpec::signature`](crate::kernels::KernelSpec::signature)): the safe
    /// [`launch`](Executor::launch) trusts the kernel to stay within each parameter's
    /// [`Reach`](crate::kernels::Reach).
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
    ///   [`Reach`](crate::kernels::Reach) from the offset on, computed from this launch's
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

    /// Makes work enqueued from now on wait for `event`: a wait on the device side
    /// (`cuStreamWaitEvent`), not a host synchronisation, so it is not counted as one and
    /// may be used on the load path. An event of another executor, or one released, is
    /// refused.
    fn wait_event(&self, event: EventId) -> Result<(), ExecError> {
        let _ = event;
        Ok(())
    }

    /// Releases an event once nothing will wait for it any more.
    fn release_event(&self, event: EventId) {
        let _ = event;
    }

    /// Cancels a failure armed by [`Executor::inject_launch_failure`] that no launch has
    /// consumed yet; returns whether one was armed. Executors that arm failures override
    /// this (wrappers forward it); the default, for executors that cannot be armed, does
    /// nothing and returns false.
    fn disarm_launch_failure(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_parses_and_prints() {
        for b in [Backend::Auto, Backend::Host, Backend::Cuda] {
            assert_eq!(b.to_string().parse::<Backend>().unwrap(), b);
        }
        assert_eq!(" GPU ".parse::<Backend>().unwrap(), Backend::Cuda);
        assert!(matches!(
            "tpu".parse::<Backend>(),
            Err(ExecError::Config { .. })
        ));
    }

    #[test]
    fn counters_diff() {
        let a = Counters {
            launches: 2,
            reads: 1,
            ..Default::default()
        };
        let b = Counters {
            launches: 5,
            reads: 1,
            syncs: 1,
            ..Default::default()
        };
        let d = b.since(&a);
        assert_eq!(d.launches, 3);
        assert_eq!(d.reads, 0);
        assert!(!d.is_sync_free());
        assert!(Counters::default().is_sync_free());
    }

    #[test]
    fn adjacent_regions_merge_into_one_copy_per_run() {
        let r = |src_offset, dst_offset, len| CopyRegion {
            src_offset,
            dst_offset,
            len,
        };
        // Four page blobs, scattered in the batch, two contiguous runs on both sides; an
        // empty region is dropped.
        let batch = [
            r(200, 20, 10),
            r(0, 100, 10),
            r(190, 10, 10),
            r(10, 110, 10),
            r(5, 5, 0),
        ];
        assert_eq!(
            merge_regions(&batch, false),
            [r(190, 10, 20), r(0, 100, 20)]
        );
        // Within one buffer the order stays: only consecutive regions merge.
        assert_eq!(merge_regions(&batch, true), batch[..4]);
        // Contiguous on one side only: not merged.
        assert_eq!(
            merge_regions(&[r(0, 0, 8), r(16, 8, 8)], false),
            [r(0, 0, 8), r(16, 8, 8)]
        );
        // Overlapping destinations keep their order (the later copy wins).
        let overlap = [r(100, 0, 8), r(0, 0, 8), r(8, 8, 8)];
        assert_eq!(merge_regions(&overlap, false), [r(100, 0, 8), r(0, 0, 16)]);
        // 2,048 page pairs in order, one layer each: one region.
        let pages: Vec<CopyRegion> = (0..2048).map(|i| r(i * 656, i * 656, 656)).collect();
        assert_eq!(merge_regions(&pages, false), [r(0, 0, 2048 * 656)]);
    }

    #[test]
    fn regions_are_checked_before_copying() {
        let (a, b) = (BufferId(1), BufferId(2));
        let r = |src_offset, dst_offset, len| CopyRegion {
            src_offset,
            dst_offset,
            len,
        };
        assert_eq!(
            check_regions((a, 64), (b, 32), &[r(0, 0, 16), r(48, 16, 16)]).unwrap(),
            32
        );
        assert!(matches!(
            check_regions((a, 64), (b, 32), &[r(0, 0, 16), r(0, 17, 16)]),
            Err(ExecError::OutOfBounds {
                op: "copy destination",
                ..
            })
        ));
        assert!(matches!(
            check_regions((a, 64), (b, 32), &[r(60, 0, 8)]),
            Err(ExecError::OutOfBounds {
                op: "copy source",
                ..
            })
        ));
        assert!(matches!(
            check_regions((a, 64), (a, 64), &[r(0, 8, 16)]),
            Err(ExecError::OverlappingCopy { .. })
        ));
        assert_eq!(
            check_regions((a, 64), (a, 64), &[r(0, 16, 16), r(8, 8, 0)]).unwrap(),
            16
        );
    }

    #[test]
    fn a_bad_pointer_argument_names_the_kernel_and_the_parameter() {
        use crate::kernels::{KernelSpec, ReleaseSpec};
        let spec = KernelSpec::ReleasePages(ReleaseSpec { cp: 2, threads: 32 });
        let sig = spec.signature();
        let resolve = |b: BufferId| match b.0 {
            1..=4 => Ok((0x1000 * b.0, 64)),
            _ => Err(ExecError::UnknownBuffer(b)),
        };
        let message = |r: Result<Vec<Vec<u8>>, ExecError>| match r {
            Err(ExecError::Launch {
                kernel,
                cause: LaunchFailure::InvalidConfig,
                message,
            }) if kernel == "k" => message,
            other => panic!("{other:?}"),
        };
        // Release of 2 pages over 2 lanes of `lane_cap` slots: 8 bytes of pages, 8 ×
        // lane_cap bytes of stacks, 8 bytes of tops, 16 of status words, each in a buffer of
        // its own (the written stacks, tops and status must not alias another pointer).
        let release = |stacks_offset: u64, lane_cap: u32| {
            [
                KernelArg::Ptr(BufferId(2), 0),
                KernelArg::U32(2),
                KernelArg::Ptr(BufferId(1), stacks_offset),
                KernelArg::Ptr(BufferId(3), 0),
                KernelArg::U32(lane_cap),
                KernelArg::Ptr(BufferId(4), 0),
            ]
        };
        assert_eq!(
            message(marshal_args("k", Some(&sig), &release(65, 0), resolve)),
            "parameter 2 `lane_stacks` (u32*): kernel argument of 0 bytes at offset 65 is \
             outside buffer BufferId(1) of 64 bytes"
        );
        // The stacks reach 8 × lane_cap bytes: 64 fit from offset 0, not one byte more.
        marshal_args("k", Some(&sig), &release(0, 8), resolve).unwrap();
        marshal_args("k", Some(&sig), &release(8, 7), resolve).unwrap();
        assert_eq!(
            message(marshal_args("k", Some(&sig), &release(8, 8), resolve)),
            "parameter 2 `lane_stacks` (u32*): kernel argument of 64 bytes at offset 8 is \
             outside buffer BufferId(1) of 64 bytes (the kernel reaches 8 × lane_cap bytes \
             from it)"
        );
        assert_eq!(
            message(marshal_args(
                "k",
                Some(&sig),
                &release(0, u32::MAX),
                resolve
            )),
            "parameter 2 `lane_stacks` (u32*): kernel argument of 34359738360 bytes at offset \
             0 is outside buffer BufferId(1) of 64 bytes (the kernel reaches 8 × lane_cap \
             bytes from it)"
        );
        assert_eq!(
            message(marshal_args("k", Some(&sig), &release(0, 8)[..4], resolve)),
            "parameter 2 `lane_stacks` reaches 8 × lane_cap bytes, which has no u32 argument \
             for `lane_cap`"
        );
        let args = [KernelArg::U32(2), KernelArg::Ptr(BufferId(7), 0)];
        assert_eq!(
            message(marshal_args("k", None, &args, resolve)),
            "parameter 1: unknown buffer BufferId(7)"
        );
        let ptrs = [(BufferId(1), 0), (BufferId(9), 0)];
        let e = marshal_args("k", None, &[KernelArg::PtrStruct(&ptrs)], resolve).unwrap_err();
        assert!(
            e.to_string()
                .ends_with("parameter 0, pointer 1: unknown buffer BufferId(9)"),
            "{e}"
        );
        // One past the end is a valid pointer for a parameter that reaches nothing (`n` = 0).
        let ok = marshal_args(
            "k",
            Some(&sig),
            &[KernelArg::Ptr(BufferId(1), 64), KernelArg::U32(0)],
            resolve,
        );
        assert_eq!(
            ok.unwrap(),
            vec![
                (0x1000u64 + 64).to_ne_bytes().to_vec(),
                0u32.to_ne_bytes().to_vec()
            ]
        );
    }

    #[test]
    fn arg_sizes() {
        assert_eq!(KernelArg::U32(1).size(), 4);
        assert_eq!(KernelArg::Ptr(BufferId(1), 0).size(), 8);
        assert_eq!(KernelArg::Bytes(&[0; 24]).size(), 24);
    }
}
