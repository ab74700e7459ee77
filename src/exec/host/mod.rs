//! The host executor: runs kernel renders compiled against `templates/cuda_emu.h` on the CPU.
//!
//! Buffers are 64-byte-aligned heap allocations whose addresses are passed to kernels as
//! device pointers (device and host buffers alike). Kernels are loaded from a `.so` path (the
//! JIT compiles them; this module never compiles anything) and run synchronously on the
//! calling thread, blocks one after another, the threads of a block as fibers. A launch that
//! deadlocks or meets mismatched intrinsics returns [`ExecError::Launch`] with the emulator's
//! diagnostic instead of hanging.
//!
//! Thread-safety: `HostExecutor` is `Send + Sync`; one mutex serialises buffer operations and
//! launches, so a buffer cannot be freed while a kernel runs on it.

mod ffi;

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use super::registry::Registry;
use super::PendingLaunch;
use super::{
    check_range, check_regions, Backend, BufferId, CopyRegion, Counters, ExecError, Executor,
    KernelArg, KernelArtifact, KernelId, KernelSignature, LaunchConfig, LaunchFailure, MemKind,
};

/// The CUDA-emulation header: the ABI this executor loads kernels by (`CpEmuLaunch`) and the
/// CUDA built-ins it emulates. The JIT force-includes it when compiling a render for this
/// executor (and hashes it into the cache key).
pub const EMU_HEADER: &str = include_str!("../../../templates/cuda_emu.h");

/// Environment variable selecting the block order (`forward` or `reverse`).
pub const ORDER_ENV: &str = "CP_HICACHE_EMU_ORDER";

/// Environment variable selecting a sanitizer build of emulation libraries; the JIT reads it
/// (its `Sanitize::from_env`) because the mode is a compile option.
pub const SANITIZE_ENV: &str = "CP_HICACHE_EMU_SANITIZE";

/// How to run a process that loads AddressSanitizer builds of the kernels.
pub const ASAN_HINT: &str = "run with LD_PRELOAD=$(c++ -print-file-name=libasan.so) \
    ASAN_OPTIONS=detect_leaks=0 (the ASan runtime must be loaded first)";

/// Whether the AddressSanitizer runtime is loaded in this process, which loading kernels built
/// with `CP_HICACHE_EMU_SANITIZE=address` needs (otherwise the runtime ends the process).
pub fn asan_runtime_loaded() -> bool {
    ffi::asan_runtime_loaded()
}

/// Order in which the blocks of a launch run, and the threads of a block between rendezvous.
/// Shared memory keeps its values between blocks, so running tests in both orders exposes
/// kernels that read uninitialised shared memory; reversing the threads too exposes a
/// missing barrier where a lower thread overtaking a higher one (or the reverse) matters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum BlockOrder {
    /// Block 0 first.
    #[default]
    Forward,
    /// Last block first, and in each block the highest ready thread first.
    Reverse,
}

impl fmt::Display for BlockOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlockOrder::Forward => "forward",
            BlockOrder::Reverse => "reverse",
        })
    }
}

impl FromStr for BlockOrder {
    type Err = ExecError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "forward" => Ok(BlockOrder::Forward),
            "reverse" => Ok(BlockOrder::Reverse),
            _ => Err(ExecError::Config {
                name: ORDER_ENV,
                value: s.to_string(),
                reason: "expected forward or reverse".into(),
            }),
        }
    }
}

/// Largest fiber stack a launch may ask for (the emulator's `CP_EMU_MAX_STACK_BYTES`).
pub const MAX_STACK_BYTES: u64 = 64 << 20;

/// Host executor settings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct HostOptions {
    /// Block order of every launch.
    pub block_order: BlockOrder,
    /// Fiber stack size in bytes; 0 lets the emulator choose (64 KiB, 256 KiB under ASan).
    /// At most [`MAX_STACK_BYTES`]; a launch with more is [`ExecError::Config`].
    pub stack_bytes: u64,
}

impl HostOptions {
    /// Checks the settings a launch depends on: `stack_bytes` at most [`MAX_STACK_BYTES`].
    pub fn validate(&self) -> Result<(), ExecError> {
        if self.stack_bytes > MAX_STACK_BYTES {
            return Err(ExecError::Config {
                name: "stack_bytes",
                value: self.stack_bytes.to_string(),
                reason: format!("a fiber stack is at most {MAX_STACK_BYTES} bytes"),
            });
        }
        Ok(())
    }

    /// Defaults, with the block order from `CP_HICACHE_EMU_ORDER` when set. A value that is
    /// not `forward`, `reverse` or empty, or not UTF-8, is [`ExecError::Config`].
    pub fn from_env() -> Result<HostOptions, ExecError> {
        Ok(HostOptions {
            block_order: block_order_from(std::env::var(ORDER_ENV))?,
            ..HostOptions::default()
        })
    }
}

/// The block order a lookup of [`ORDER_ENV`] gives: forward when unset.
fn block_order_from(var: Result<String, std::env::VarError>) -> Result<BlockOrder, ExecError> {
    match var {
        Ok(v) => v.parse(),
        Err(std::env::VarError::NotPresent) => Ok(BlockOrder::Forward),
        Err(std::env::VarError::NotUnicode(v)) => Err(ExecError::Config {
            name: ORDER_ENV,
            value: v.to_string_lossy().into_owned(),
            reason: "not valid UTF-8".into(),
        }),
    }
}

/// The fiber-stack pool of the calling OS thread in one kernel library
/// ([`HostExecutor::stack_stats`]). The emulator keeps each pool's stacks at the largest size
/// asked so far and maps more only for a launch with more threads per block than before, so
/// `maps` stays constant over launches that fit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EmuStackStats {
    /// Chunks of stacks mapped over the thread's lifetime (one `mmap` each).
    pub maps: u64,
    /// Chunks unmapped (one `munmap` each): when the stack size grows, or, without guard
    /// regions, the stacks past 256 after a launch.
    pub unmaps: u64,
    /// Stacks mapped over the thread's lifetime.
    pub stacks_mapped: u64,
    /// Stacks held now.
    pub stacks_live: u64,
    /// Size of every stack: the largest a launch on this thread asked so far.
    pub stack_bytes: u64,
    /// Whether guards are `MADV_GUARD_INSTALL` regions (Linux 6.13+), with which every pool is
    /// kept; false with `PROT_NONE` guards, or before anything was mapped.
    pub guard_regions: bool,
}

/// What an exported buffer's handle starts with (then `<bytes>:<shm name>`).
const SHM_HANDLE: &str = "cp-hicache-shm:";

struct HostBuffer {
    mem: ffi::HostMem,
    kind: MemKind,
}

struct LoadedKernel {
    name: String,
    kernel: Arc<ffi::EmuKernel>,
    signature: Option<KernelSignature>,
}

type State = Registry<HostBuffer, LoadedKernel>;

/// The CPU emulation executor. See the module documentation.
pub struct HostExecutor {
    options: Mutex<HostOptions>,
    state: Mutex<State>,
    fail_next_launch: AtomicBool,
    /// Whether this executor removed the shared memory of processes that are gone, before
    /// its first shared pool ([`ffi::remove_orphaned_segments`]).
    swept: AtomicBool,
}

impl HostExecutor {
    /// Creates an executor with `options`.
    pub fn new(options: HostOptions) -> HostExecutor {
        HostExecutor {
            options: Mutex::new(options),
            state: Mutex::new(Registry::new()),
            fail_next_launch: AtomicBool::new(false),
            swept: AtomicBool::new(false),
        }
    }

    /// Creates an executor configured from the environment (`CP_HICACHE_EMU_ORDER`).
    pub fn from_env() -> Result<HostExecutor, ExecError> {
        Ok(HostExecutor::new(HostOptions::from_env()?))
    }

    /// Sets the block order of later launches.
    pub fn set_block_order(&self, order: BlockOrder) {
        lock(&self.options).block_order = order;
    }

    /// The current options.
    pub fn options(&self) -> HostOptions {
        *lock(&self.options)
    }

    /// The calling OS thread's fiber-stack pool in `kernel`'s library (every library has a
    /// pool per thread; launches run on the calling thread). `None` for a library built from
    /// an emulation header that does not report it.
    pub fn stack_stats(&self, kernel: KernelId) -> Result<Option<EmuStackStats>, ExecError> {
        let emu = Arc::clone(&lock(&self.state).kernel(kernel)?.kernel);
        Ok(emu.stack_stats().map(|s| EmuStackStats {
            maps: s.maps,
            unmaps: s.unmaps,
            stacks_mapped: s.stacks_mapped,
            stacks_live: s.stacks_live,
            stack_bytes: s.stack_bytes,
            guard_regions: s.guard_regions != 0,
        }))
    }

    /// The memory kind a buffer was allocated as.
    pub fn kind(&self, buffer: BufferId) -> Result<MemKind, ExecError> {
        lock(&self.state).buffer(buffer).map(|b| b.kind)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock cannot leave the maps half-updated in a way that matters
    // for memory safety, so a poisoned lock is simply taken over.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn failure_of(status: i32) -> LaunchFailure {
    match status {
        1 => LaunchFailure::InvalidConfig,
        2 => LaunchFailure::Deadlock,
        3 => LaunchFailure::Mismatch,
        4 => LaunchFailure::BadMask,
        5 => LaunchFailure::OutOfMemory,
        6 => LaunchFailure::Trap,
        ffi::STATUS_ABI => LaunchFailure::InvalidConfig,
        _ => LaunchFailure::Other,
    }
}

impl Executor for HostExecutor {
    fn backend(&self) -> Backend {
        Backend::Host
    }

    fn device_name(&self) -> String {
        format!("host CPU emulation ({})", std::env::consts::ARCH)
    }

    fn alloc(&self, kind: MemKind, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        let mem = ffi::HostMem::new(bytes, fill).ok_or_else(|| ExecError::Alloc {
            bytes,
            kind,
            reason: "out of host memory".into(),
        })?;
        Ok(lock(&self.state).add_buffer(HostBuffer { mem, kind }))
    }

    fn free(&self, buffer: BufferId) -> Result<(), ExecError> {
        lock(&self.state).remove_buffer(buffer).map(drop)
    }

    fn alloc_shareable(&self, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        // A new cache's first shared pool: first take away what crashed processes left in
        // /dev/shm (their pools stay there for good otherwise).
        if !self.swept.swap(true, Ordering::AcqRel) {
            let removed = ffi::remove_orphaned_segments(std::path::Path::new("/dev/shm"));
            if !removed.is_empty() {
                tracing::info!(
                    "removed {} shared-memory objects of processes that are gone: {}",
                    removed.len(),
                    removed.join(", ")
                );
            }
        }
        let mem = ffi::HostMem::new_shared(bytes, fill).map_err(|reason| ExecError::Alloc {
            bytes,
            kind: MemKind::Device,
            reason: format!("shared memory: {reason}"),
        })?;
        Ok(lock(&self.state).add_buffer(HostBuffer {
            mem,
            kind: MemKind::Device,
        }))
    }

    fn export(&self, buffer: BufferId) -> Result<Vec<u8>, ExecError> {
        let st = lock(&self.state);
        let b = st.buffer(buffer)?;
        let name = b.mem.shared_name().ok_or_else(|| ExecError::Peer {
            op: "export",
            message: format!(
                "buffer {buffer:?} was not allocated shareable, or was sealed (every peer \
                 has mapped it already)"
            ),
        })?;
        Ok(format!("{SHM_HANDLE}{}:{name}", b.mem.len()).into_bytes())
    }

    fn import(&self, handle: &[u8]) -> Result<BufferId, ExecError> {
        let bad = |message: String| ExecError::Peer {
            op: "import",
            message,
        };
        let text = std::str::from_utf8(handle)
            .ok()
            .and_then(|t| t.strip_prefix(SHM_HANDLE))
            .ok_or_else(|| bad("not a host-executor shared-memory handle".into()))?;
        let (len, name) = text
            .split_once(':')
            .and_then(|(l, n)| Some((l.parse::<usize>().ok()?, n)))
            .ok_or_else(|| bad(format!("malformed handle `{text}`")))?;
        let mem = ffi::HostMem::open_shared(name, len).map_err(bad)?;
        Ok(lock(&self.state).add_buffer(HostBuffer {
            mem,
            kind: MemKind::Device,
        }))
    }

    unsafe fn adopt(&self, addr: u64, bytes: usize) -> Result<BufferId, ExecError> {
        // SAFETY: the caller guarantees `addr` is host memory valid for `bytes` bytes until
        // the buffer is freed.
        let mem = unsafe { ffi::HostMem::borrowed(addr as *mut u8, bytes) }.ok_or_else(|| {
            ExecError::Alloc {
                bytes,
                kind: MemKind::Device,
                reason: "a null address cannot be adopted".into(),
            }
        })?;
        Ok(lock(&self.state).add_buffer(HostBuffer {
            mem,
            kind: MemKind::Device,
        }))
    }

    fn seal_shareable(&self, buffer: BufferId) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let b = st.buffer_mut(buffer)?;
        if !b.mem.unlink_shared() {
            return Err(ExecError::Peer {
                op: "seal",
                message: format!("buffer {buffer:?} was not allocated shareable"),
            });
        }
        Ok(())
    }

    fn peer_mapping(&self) -> Option<&'static str> {
        Some("shared-memory")
    }

    fn size(&self, buffer: BufferId) -> Result<usize, ExecError> {
        lock(&self.state).buffer(buffer).map(|b| b.mem.len())
    }

    fn address(&self, buffer: BufferId) -> Result<super::Address, ExecError> {
        lock(&self.state).buffer(buffer).map(|b| super::Address {
            ptr: b.mem.addr(),
            space: super::AddressSpace::Host,
        })
    }

    fn upload(&self, buffer: BufferId, offset: u64, data: &[u8]) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer_mut(buffer)?;
        let r = check_range("upload", buffer, buf.mem.len(), offset, data.len() as u64)?;
        buf.mem.as_mut_slice()[r].copy_from_slice(data);
        st.counters.uploads += 1;
        st.counters.bytes_uploaded += data.len() as u64;
        Ok(())
    }

    fn read(&self, buffer: BufferId, offset: u64, out: &mut [u8]) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer(buffer)?;
        let r = check_range("read", buffer, buf.mem.len(), offset, out.len() as u64)?;
        out.copy_from_slice(&buf.mem.as_slice()[r]);
        st.counters.reads += 1;
        st.counters.bytes_read += out.len() as u64;
        Ok(())
    }

    unsafe fn load_kernel(&self, artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        let KernelArtifact::HostLibrary {
            path,
            entry,
            signature,
        } = *artifact
        else {
            return Err(ExecError::WrongArtifact {
                backend: Backend::Host,
                artifact: "a CUBIN",
            });
        };
        // SAFETY: the caller guarantees the library is a kernel render the JIT compiled with
        // cuda_emu.h (the contract of `Executor::load_kernel`), which is what
        // `EmuKernel::load` requires: trivial initialisers and the `CpEmuLaunch` entry type.
        let kernel = unsafe { ffi::EmuKernel::load(path, entry) };
        let kernel = kernel.map_err(|message| ExecError::Load {
            entry: entry.to_string(),
            artifact: artifact.describe(),
            message,
        })?;
        Ok(lock(&self.state).add_kernel(LoadedKernel {
            name: entry.to_string(),
            signature: signature.cloned(),
            kernel: Arc::new(kernel),
        }))
    }

    fn copy_regions(
        &self,
        src: BufferId,
        dst: BufferId,
        regions: &[CopyRegion],
    ) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let size = |b| st.buffer(b).map(|x| x.mem.len());
        let bytes = check_regions((src, size(src)?), (dst, size(dst)?), regions)?;
        // One copy per contiguous run, as on CUDA (same bytes).
        let regions = &super::merge_regions(regions, src == dst)[..];
        // Ranges were checked above (and against self-overlap), so the slicing cannot fail.
        let range = |off: u64, len: u64| off as usize..(off + len) as usize;
        match st.pair_mut(src, dst)? {
            Some((s, d)) => {
                let (s, d) = (s.mem.as_slice(), d.mem.as_mut_slice());
                for r in regions {
                    d[range(r.dst_offset, r.len)].copy_from_slice(&s[range(r.src_offset, r.len)]);
                }
            }
            None => {
                let m = st.buffer_mut(src)?.mem.as_mut_slice();
                for r in regions {
                    m.copy_within(range(r.src_offset, r.len), r.dst_offset as usize);
                }
            }
        }
        st.counters.copies += 1;
        st.counters.bytes_copied += bytes;
        Ok(())
    }

    fn fill(&self, buffer: BufferId, ranges: &[(u64, u64)], byte: u8) -> Result<(), ExecError> {
        let mut st = lock(&self.state);
        let buf = st.buffer_mut(buffer)?;
        let size = buf.mem.len();
        let checked = ranges
            .iter()
            .map(|&(offset, len)| check_range("fill", buffer, size, offset, len))
            .collect::<Result<Vec<_>, _>>()?;
        let mem = buf.mem.as_mut_slice();
        let mut bytes = 0u64;
        for r in checked {
            bytes += r.len() as u64;
            mem[r].fill(byte);
        }
        st.counters.fills += 1;
        st.counters.bytes_filled += bytes;
        Ok(())
    }

    fn synchronize(&self) -> Result<(), ExecError> {
        // Launches run to completion on the calling thread; only the count matters.
        lock(&self.state).counters.syncs += 1;
        Ok(())
    }

    fn counters(&self) -> Counters {
        lock(&self.state).counters
    }

    fn inject_launch_failure(&self) {
        self.fail_next_launch.store(true, Ordering::SeqCst);
    }

    fn disarm_launch_failure(&self) -> bool {
        self.fail_next_launch.swap(false, Ordering::SeqCst)
    }

    /// Checks the launch against the kernel's signature (refusing an unsigned kernel unless
    /// `unsigned_ok`), resolves and bounds the pointers, then runs the blocks.
    unsafe fn launch_with(
        &self,
        kernel: KernelId,
        config: &LaunchConfig,
        args: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError> {
        let options = self.options();
        options.validate()?;
        let mut st = lock(&self.state);
        st.counters.launches += 1;
        let k = st.kernel(kernel)?;
        let name = k.name.clone();
        let emu = Arc::clone(&k.kernel);
        let launch = PendingLaunch {
            kernel: &name,
            signature: k.signature.as_ref(),
            unsigned_ok,
            config,
            args,
        };
        let marshalled = launch.marshal(&self.fail_next_launch, |b| {
            let buf = st.buffer(b)?;
            Ok((buf.mem.addr(), buf.mem.len()))
        })?;
        // The page tables' addresses, checked in bounds by `marshal`.
        for t in &marshalled.tables {
            let buf = st.buffer_mut(t.buffer)?;
            let r = check_range(
                "page table",
                t.buffer,
                buf.mem.len(),
                t.offset,
                t.bytes.len() as u64,
            )?;
            buf.mem.as_mut_slice()[r].copy_from_slice(&t.bytes);
        }
        let views: Vec<&[u8]> = marshalled.params.iter().map(Vec::as_slice).collect();
        let shape = ffi::LaunchShape {
            grid: config.grid,
            block: config.block,
            shared_bytes: config.shared_bytes,
            reverse: options.block_order == BlockOrder::Reverse,
            stack_bytes: options.stack_bytes,
        };
        // The state lock stays held while the kernel runs, so no buffer can be freed under it.
        // SAFETY: pointer arguments were resolved to live buffers of this executor (kept alive
        // by the lock) and checked to start inside them; with a signature, each also holds its
        // parameter's reach from there; without one, the buffers being large enough is the
        // caller's contract (`Executor::launch_unchecked`).
        let result = unsafe { emu.launch(&shape, &views) };
        drop(st);
        result.map_err(|(status, message)| ExecError::Launch {
            kernel: name,
            cause: failure_of(status),
            message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_order_parses() {
        assert_eq!(
            "reverse".parse::<BlockOrder>().unwrap(),
            BlockOrder::Reverse
        );
        assert_eq!("".parse::<BlockOrder>().unwrap(), BlockOrder::Forward);
        assert!("sideways".parse::<BlockOrder>().is_err());
    }

    #[test]
    fn block_order_variable_must_be_utf8() {
        use std::env::VarError;
        use std::os::unix::ffi::OsStringExt;
        assert_eq!(
            block_order_from(Err(VarError::NotPresent)).unwrap(),
            BlockOrder::Forward
        );
        assert_eq!(
            block_order_from(Ok(" Reverse ".into())).unwrap(),
            BlockOrder::Reverse
        );
        let bad = std::ffi::OsString::from_vec(b"rev\xffrse".to_vec());
        let e = block_order_from(Err(VarError::NotUnicode(bad))).unwrap_err();
        assert!(
            matches!(&e, ExecError::Config { name: ORDER_ENV, reason, .. } if reason == "not valid UTF-8"),
            "{e}"
        );
    }

    #[test]
    fn bounds_are_checked() {
        let ex = HostExecutor::new(HostOptions::default());
        let b = ex.alloc(MemKind::Device, 16, 0xA5).unwrap();
        let mut out = [0u8; 16];
        ex.read(b, 0, &mut out).unwrap();
        assert_eq!(out, [0xA5; 16]);
        assert!(matches!(
            ex.read(b, 1, &mut out),
            Err(ExecError::OutOfBounds { op: "read", .. })
        ));
        assert!(matches!(
            ex.upload(b, u64::MAX, &[1]),
            Err(ExecError::OutOfBounds { .. })
        ));
        ex.free(b).unwrap();
        let c = ex.counters();
        assert_eq!((c.allocs, c.frees, c.syncs), (1, 1, 0), "{c:?}");
        assert!(matches!(ex.free(b), Err(ExecError::UnknownBuffer(_))));
        assert_eq!(ex.counters().frees, 1, "a refused free is not counted");
    }

    #[test]
    fn oversized_stack_is_a_config_error() {
        let ex = HostExecutor::new(HostOptions {
            stack_bytes: u64::MAX,
            ..HostOptions::default()
        });
        let e = ex
            .launch(KernelId(1), &LaunchConfig::linear(1, 32), &[])
            .unwrap_err();
        assert!(
            matches!(&e, ExecError::Config { name: "stack_bytes", value, .. } if value == &u64::MAX.to_string()),
            "{e}"
        );
        assert_eq!(ex.counters().launches, 0);
        let at_limit = HostOptions {
            stack_bytes: MAX_STACK_BYTES,
            ..HostOptions::default()
        };
        assert!(at_limit.validate().is_ok());
        assert!(
            EMU_HEADER.contains(&format!(
                "#define CP_EMU_MAX_STACK_BYTES ({}ull << 20)",
                MAX_STACK_BYTES >> 20
            )),
            "the header's limit differs"
        );
    }

    #[test]
    fn handles_of_another_executor_are_unknown() {
        let (one, two) = (
            HostExecutor::new(HostOptions::default()),
            HostExecutor::new(HostOptions::default()),
        );
        let a = one.alloc(MemKind::Device, 16, 1).unwrap();
        let b = two.alloc(MemKind::Device, 16, 2).unwrap();
        let mut out = [0u8; 16];
        assert!(matches!(two.read(a, 0, &mut out), Err(ExecError::UnknownBuffer(id)) if id == a));
        assert!(matches!(one.free(b), Err(ExecError::UnknownBuffer(id)) if id == b));
        two.read(b, 0, &mut out).unwrap();
        assert_eq!(out, [2; 16]);
    }

    #[test]
    fn copy_regions_between_and_within_buffers() {
        let ex = HostExecutor::new(HostOptions::default());
        let a = ex.alloc(MemKind::Host, 32, 0).unwrap();
        let b = ex.alloc(MemKind::Device, 32, 0xA5).unwrap();
        let data: Vec<u8> = (0..32).collect();
        ex.upload(a, 0, &data).unwrap();
        let r = |src_offset, dst_offset, len| CopyRegion {
            src_offset,
            dst_offset,
            len,
        };
        ex.copy_regions(a, b, &[r(0, 16, 8), r(24, 0, 8)]).unwrap();
        ex.copy_regions(b, b, &[r(16, 8, 4)]).unwrap();
        let mut out = [0u8; 32];
        ex.read(b, 0, &mut out).unwrap();
        let mut want = [0xA5u8; 32];
        want[..8].copy_from_slice(&data[24..]);
        want[16..24].copy_from_slice(&data[..8]);
        want[8..12].copy_from_slice(&data[..4]);
        assert_eq!(out, want);
        // A batch with one bad region copies nothing.
        let before = ex.counters();
        assert!(ex.copy_regions(a, b, &[r(0, 0, 8), r(30, 0, 8)]).is_err());
        ex.read(b, 0, &mut out).unwrap();
        assert_eq!(out, want);
        let c = ex.counters().since(&before);
        assert_eq!((c.copies, c.bytes_copied), (0, 0));
        assert!(ex.copy_regions(a, BufferId(999), &[]).is_err());
    }

    /// A shareable buffer mapped by a second executor (another rank) is the same memory:
    /// writes through either show in the other; the mapping outlives the owner's free.
    #[test]
    fn an_imported_buffer_maps_the_peers_bytes() {
        let owner = HostExecutor::new(HostOptions::default());
        let peer = HostExecutor::new(HostOptions::default());
        let b = owner.alloc_shareable(4096, 0xA5).unwrap();
        let handle = owner.export(b).unwrap();
        let m = peer.import(&handle).unwrap();
        assert_eq!(peer.size(m).unwrap(), 4096);
        let mut out = [0u8; 4];
        peer.read(m, 100, &mut out).unwrap();
        assert_eq!(out, [0xA5; 4]);
        owner.upload(b, 100, &[1, 2, 3, 4]).unwrap();
        peer.read(m, 100, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4]);
        peer.upload(m, 0, &[9]).unwrap();
        owner.read(b, 0, &mut out[..1]).unwrap();
        assert_eq!(out[0], 9);
        owner.free(b).unwrap();
        peer.read(m, 100, &mut out).unwrap();
        assert_eq!(out, [1, 2, 3, 4], "a mapping outlives the owner's free");
        // The name is unlinked with the owner's buffer: a late import fails.
        let err = peer.import(&handle).unwrap_err();
        assert!(err.to_string().contains("shm_open"), "{err}");
        peer.free(m).unwrap();
    }

    /// Sealing unlinks the name once every peer has mapped: nothing is left in /dev/shm
    /// for a killed process to leak, the mappings still share bytes, and a late import or
    /// export is refused.
    #[test]
    fn a_sealed_buffer_leaves_no_name_behind() {
        let owner = HostExecutor::new(HostOptions::default());
        let peer = HostExecutor::new(HostOptions::default());
        let b = owner.alloc_shareable(4096, 0).unwrap();
        let handle = owner.export(b).unwrap();
        let name = String::from_utf8(handle.clone()).unwrap();
        let path = format!("/dev/shm{}", name.rsplit(':').next().unwrap());
        assert!(std::path::Path::new(&path).exists(), "{path}");
        let m = peer.import(&handle).unwrap();
        owner.seal_shareable(b).unwrap();
        owner.seal_shareable(b).unwrap(); // idempotent
        peer.seal_shareable(m).unwrap(); // a mapping has no name to remove
        assert!(
            !std::path::Path::new(&path).exists(),
            "{path} is still linked"
        );
        owner.upload(b, 8, &[7]).unwrap();
        let mut out = [0u8; 1];
        peer.read(m, 8, &mut out).unwrap();
        assert_eq!(out, [7]);
        assert!(peer.import(&handle).is_err());
        assert!(owner.export(b).is_err());
        let heap = owner.alloc(MemKind::Device, 64, 0).unwrap();
        assert!(owner.seal_shareable(heap).is_err());
        owner.free(b).unwrap();
        peer.free(m).unwrap();
    }

    #[test]
    fn bad_peer_handles_are_refused() {
        let ex = HostExecutor::new(HostOptions::default());
        let heap = ex.alloc(MemKind::Device, 64, 0).unwrap();
        assert!(ex
            .export(heap)
            .unwrap_err()
            .to_string()
            .contains("not allocated shareable"));
        for h in [
            &b"garbage"[..],
            b"cp-hicache-shm:12",
            b"cp-hicache-shm:x:/cp-hicache-1",
        ] {
            assert!(matches!(ex.import(h), Err(ExecError::Peer { .. })), "{h:?}");
        }
        let err = ex.import(b"cp-hicache-shm:64:/etc/passwd").unwrap_err();
        assert!(
            err.to_string()
                .contains("not a cp-hicache shared-memory name"),
            "{err}"
        );
        // A handle naming more bytes than the object has.
        let b = ex.alloc_shareable(64, 0).unwrap();
        let h = String::from_utf8(ex.export(b).unwrap()).unwrap();
        let big = h.replace("shm:64:", "shm:65536:");
        let err = ex.import(big.as_bytes()).unwrap_err();
        assert!(err.to_string().contains("holds 64 bytes"), "{err}");
    }

    #[test]
    fn fill_writes_every_range_or_nothing() {
        let ex = HostExecutor::new(HostOptions::default());
        let b = ex.alloc(MemKind::Device, 32, 0).unwrap();
        ex.fill(b, &[(0, 4), (20, 12)], 0xA5).unwrap();
        let mut out = [0u8; 32];
        ex.read(b, 0, &mut out).unwrap();
        let mut want = [0u8; 32];
        want[..4].fill(0xA5);
        want[20..].fill(0xA5);
        assert_eq!(out, want);
        let c = ex.counters();
        assert_eq!((c.fills, c.bytes_filled, c.uploads), (1, 16, 0));
        assert!(matches!(
            ex.fill(b, &[(4, 4), (30, 4)], 1),
            Err(ExecError::OutOfBounds { offset: 30, .. })
        ));
        ex.read(b, 0, &mut out).unwrap();
        assert_eq!(out, want, "a rejected batch writes nothing");
    }
}
