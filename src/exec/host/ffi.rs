//! All unsafe code of the host executor: aligned buffer memory, `dlopen` of emulation
//! libraries, and the call of `<entry>__emu_launch` with a `cuLaunchKernel`-shaped `void**`.
//! Loading and launching are `unsafe fn`s: the executor calls them only from its own
//! `unsafe fn load_kernel`, whose caller vouches for the library, and from its launch, after
//! checking every pointer's buffer against the signature's reach (or, for a kernel without a
//! signature, under `launch_unchecked`'s contract).
//!
//! The launch ABI mirrors `CpEmuLaunch` in `templates/cuda_emu.h`; bump [`ABI_VERSION`] in both
//! places on any change.

use std::alloc::Layout;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::path::Path;
use std::ptr::NonNull;

/// Version of the `CpEmuLaunch` layout (`CP_EMU_ABI_VERSION` in the header).
pub(crate) const ABI_VERSION: u32 = 1;
/// `CP_EMU_FLAG_REVERSE`: run blocks from last to first, and the ready threads of a block
/// highest index first.
pub(crate) const FLAG_REVERSE: u32 = 1;
/// `CP_EMU_EABI`: the library speaks another launch ABI; it wrote no diagnostic.
pub(crate) const STATUS_ABI: i32 = 7;
/// Alignment of host-executor buffers, as for a `cuMemAlloc` allocation or better.
pub(crate) const BUFFER_ALIGN: usize = 64;
const ERR_CAP: usize = 4096;

/// The launch configuration passed to the emulation entry (layout of `CpEmuLaunch`).
#[repr(C)]
struct CpEmuLaunch {
    abi_version: u32,
    grid: [u32; 3],
    block: [u32; 3],
    dyn_shared_bytes: u32,
    flags: u32,
    num_params: u32,
    stack_bytes: u64,
    param_sizes: *const u64,
    err_buf: *mut c_char,
    err_cap: u64,
}

type LaunchFn = unsafe extern "C" fn(*const CpEmuLaunch, *mut *mut c_void) -> c_int;

/// The calling thread's fiber-stack pool in one library (layout of `CpEmuStackStats`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct CpEmuStackStats {
    pub(crate) maps: u64,
    pub(crate) unmaps: u64,
    pub(crate) stacks_mapped: u64,
    pub(crate) stacks_live: u64,
    pub(crate) stack_bytes: u64,
    pub(crate) guard_regions: u32,
    pub(crate) _reserved: u32,
}

type StatsFn = unsafe extern "C" fn(*mut CpEmuStackStats);

/// A 64-byte-aligned, zero-length-safe allocation whose address kernels use as a device
/// pointer: heap memory, or a POSIX shared-memory object that other executors (other ranks,
/// in this process or another) map too ([`HostMem::new_shared`], [`HostMem::open_shared`]).
pub(crate) struct HostMem {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

enum Backing {
    Heap(Layout),
    /// A mapping of `map_len` bytes; the creator holds the object's name and unlinks it when
    /// the buffer is freed (mappings made from it stay valid until they are unmapped).
    Shared {
        map_len: usize,
        owned_name: Option<std::ffi::CString>,
    },
    /// Memory the caller owns (an engine's tensor): never freed or unmapped here.
    Borrowed,
}

// SAFETY: HostMem exclusively owns its allocation or mapping (like a Box<[u8]>); the raw
// pointer is never shared outside the owner except as an address handed to kernels run under
// the owner's lock. A shared-memory mapping is also written by peers' kernels: that is the
// point of a peer pool, and the cache orders those writes with collective barriers.
unsafe impl Send for HostMem {}
// SAFETY: shared references only allow reading through `as_slice`; mutation needs `&mut self`.
unsafe impl Sync for HostMem {}

/// Serial of this process's shared-memory objects, for unique names.
static NEXT_SHM: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// What every shared-memory object of this crate is named after: `cp-hicache-<pid>-<serial>-
/// <nanos>`, the pid being the creator's.
const SHM_PREFIX: &str = "cp-hicache-";

/// Removes from `dir` (`/dev/shm` on Linux) the shared-memory objects whose creator process
/// is gone: `cp-hicache-<pid>-…` with no process `<pid>`. A process that ends normally
/// unlinks its objects (as soon as every peer mapped them, or when its pools are freed); one
/// that dies before that (killed, crashed) leaves them for good, each as large as a pool, and
/// only a later process can take them away. Only those go: objects of a live process
/// (this one included), names of another shape and anything that cannot be removed (another
/// user's) stay. Peers that still map a removed object keep their mappings. A pid the
/// system reused for a new process keeps its objects (the check errs on the side of keeping).
/// Returns the names removed.
pub(crate) fn remove_orphaned_segments(dir: &std::path::Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let me = std::process::id();
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = name
            .strip_prefix(SHM_PREFIX)
            .and_then(|rest| rest.split_once('-'))
            .and_then(|(pid, _)| pid.parse::<u32>().ok())
            .filter(|&pid| pid != 0 && pid != me)
        else {
            continue;
        };
        if process_exists(pid) {
            continue;
        }
        if std::fs::remove_file(entry.path()).is_ok() {
            removed.push(name.to_string());
        }
    }
    removed
}

/// Whether a process `pid` exists (signal 0 delivers nothing: only the checks run). One that
/// exists but is another user's answers `EPERM`: it exists.
fn process_exists(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    // SAFETY: signal 0 sends nothing; it only asks whether `pid` could be signalled.
    if unsafe { libc::kill(pid, 0) } == 0 {
        return true;
    }
    std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// The last OS error, as text.
fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

impl HostMem {
    /// Allocates `len` bytes (at least one is reserved) filled with `fill`; `None` when out of
    /// memory or the size overflows.
    pub(crate) fn new(len: usize, fill: u8) -> Option<HostMem> {
        let layout = Layout::from_size_align(len.max(1), BUFFER_ALIGN).ok()?;
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let ptr = NonNull::new(raw)?;
        // SAFETY: `ptr` points at `layout.size() >= len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), fill, layout.size()) };
        Some(HostMem {
            ptr,
            len,
            backing: Backing::Heap(layout),
        })
    }

    /// Memory at `ptr` that the caller owns, as a buffer (`None` for a null pointer).
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, and stay so (and be accessed
    /// by nothing else while kernels run on it) until the buffer is dropped.
    pub(crate) unsafe fn borrowed(ptr: *mut u8, len: usize) -> Option<HostMem> {
        Some(HostMem {
            ptr: NonNull::new(ptr)?,
            len,
            backing: Backing::Borrowed,
        })
    }

    /// Creates a POSIX shared-memory object of `len` bytes filled with `fill` and maps it;
    /// its name ([`HostMem::shared_name`]) lets other executors map the same bytes.
    pub(crate) fn new_shared(len: usize, fill: u8) -> Result<HostMem, String> {
        let name = format!(
            "/{SHM_PREFIX}{}-{}-{:x}",
            std::process::id(),
            NEXT_SHM.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos())
        );
        let cname = std::ffi::CString::new(name).expect("no NUL in the name");
        // SAFETY: `cname` is a valid C string; O_EXCL makes a name clash an error.
        let fd = unsafe {
            libc::shm_open(
                cname.as_ptr(),
                libc::O_CREAT | libc::O_EXCL | libc::O_RDWR,
                0o600,
            )
        };
        if fd < 0 {
            return Err(os_error("shm_open"));
        }
        let map_len = len.max(1);
        let mapped = (|| {
            let size =
                libc::off_t::try_from(map_len).map_err(|_| "size overflows off_t".to_string())?;
            // SAFETY: `fd` is an open shared-memory object of ours.
            if unsafe { libc::ftruncate(fd, size) } != 0 {
                return Err(os_error("ftruncate"));
            }
            // SAFETY: as in `map`.
            unsafe { map(fd, map_len) }
        })();
        // SAFETY: `fd` is open; the mapping (if any) keeps the object alive.
        unsafe { libc::close(fd) };
        let ptr = match mapped {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: the name is ours and valid.
                unsafe { libc::shm_unlink(cname.as_ptr()) };
                return Err(e);
            }
        };
        // SAFETY: the mapping is `map_len >= len` writable bytes.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), fill, map_len) };
        Ok(HostMem {
            ptr,
            len,
            backing: Backing::Shared {
                map_len,
                owned_name: Some(cname),
            },
        })
    }

    /// Maps the shared-memory object `name` (made by [`HostMem::new_shared`] of `len`
    /// bytes, in this process or another). An object that is gone or smaller than `len` is
    /// an error.
    pub(crate) fn open_shared(name: &str, len: usize) -> Result<HostMem, String> {
        if !name.starts_with("/cp-hicache-") || name[1..].contains('/') {
            return Err(format!("`{name}` is not a cp-hicache shared-memory name"));
        }
        let cname = std::ffi::CString::new(name).map_err(|_| "a NUL in the name".to_string())?;
        // SAFETY: `cname` is a valid C string.
        let fd = unsafe { libc::shm_open(cname.as_ptr(), libc::O_RDWR, 0) };
        if fd < 0 {
            return Err(os_error(&format!("shm_open {name}")));
        }
        let map_len = len.max(1);
        let mapped = (|| {
            // SAFETY: an all-zero `stat` is a valid out value.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: `fd` is open and `st` a valid out slot.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(os_error("fstat"));
            }
            if (st.st_size as u64) < map_len as u64 {
                return Err(format!(
                    "{name} holds {} bytes, not the {len} its handle names",
                    st.st_size
                ));
            }
            // SAFETY: as in `map`.
            unsafe { map(fd, map_len) }
        })();
        // SAFETY: `fd` is open; the mapping (if any) keeps the object alive.
        unsafe { libc::close(fd) };
        Ok(HostMem {
            ptr: mapped?,
            len,
            backing: Backing::Shared {
                map_len,
                owned_name: None,
            },
        })
    }

    /// The shared-memory object's name, for a buffer this executor created shared.
    pub(crate) fn shared_name(&self) -> Option<&str> {
        match &self.backing {
            Backing::Shared {
                owned_name: Some(n),
                ..
            } => n.to_str().ok(),
            _ => None,
        }
    }

    /// Removes the shared-memory object's name now, for a buffer this executor created
    /// shared (peers keep their mappings, and so does this buffer; no one can map it any
    /// more). Whether it was such a buffer; a second call does nothing more.
    pub(crate) fn unlink_shared(&mut self) -> bool {
        match &mut self.backing {
            Backing::Shared { owned_name, .. } => {
                if let Some(name) = owned_name.take() {
                    // SAFETY: a valid C string naming our object; mappings survive.
                    unsafe { libc::shm_unlink(name.as_ptr()) };
                }
                true
            }
            Backing::Heap(_) | Backing::Borrowed => false,
        }
    }

    /// Size in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The address kernels see.
    pub(crate) fn addr(&self) -> u64 {
        self.ptr.as_ptr() as u64
    }

    /// The bytes (no kernel is running: the owner's lock is held by the caller).
    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` initialised bytes for the lifetime of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Maps `len` bytes of `fd` shared, readable and writable.
///
/// # Safety
/// `fd` must be an open shared-memory object of at least `len` bytes.
unsafe fn map(fd: c_int, len: usize) -> Result<NonNull<u8>, String> {
    // SAFETY: a fresh mapping chosen by the kernel; `fd` is valid (caller).
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(os_error("mmap"));
    }
    NonNull::new(p.cast::<u8>()).ok_or_else(|| "mmap returned null".to_string())
}

impl Drop for HostMem {
    fn drop(&mut self) {
        match &self.backing {
            Backing::Heap(layout) => {
                // SAFETY: `ptr` was allocated with `layout` by `std::alloc::alloc` and is
                // freed once.
                unsafe { std::alloc::dealloc(self.ptr.as_ptr(), *layout) };
            }
            Backing::Shared {
                map_len,
                owned_name,
            } => {
                // SAFETY: `ptr` is a mapping of `map_len` bytes made by `map`, unmapped once.
                unsafe { libc::munmap(self.ptr.as_ptr().cast(), *map_len) };
                if let Some(name) = owned_name {
                    // SAFETY: a valid C string naming our object; peers' mappings survive.
                    unsafe { libc::shm_unlink(name.as_ptr()) };
                }
            }
            // The caller's memory: it frees it.
            Backing::Borrowed => {}
        }
    }
}

/// A loaded emulation library and one kernel entry in it. The library stays loaded while the
/// kernel exists; it is closed in `Drop`.
pub(crate) struct EmuKernel {
    entry: LaunchFn,
    /// `cp_emu_stack_stats`, absent from libraries built from an older header.
    stats: Option<StatsFn>,
    lib: Option<libloading::Library>,
}

impl EmuKernel {
    /// Opens `path` (`RTLD_NOW | RTLD_LOCAL`) and resolves `<entry>__emu_launch`.
    ///
    /// # Safety
    /// `path` must be a library built from a kernel render with `cuda_emu.h` (its initialisers
    /// are then trivial, and `<entry>__emu_launch` has the `CpEmuLaunch` signature).
    pub(crate) unsafe fn load(path: &Path, entry: &str) -> Result<EmuKernel, String> {
        use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
        // SAFETY: guaranteed by the caller (see `# Safety`).
        let lib: libloading::Library = unsafe { Library::open(Some(path), RTLD_NOW | RTLD_LOCAL) }
            .map_err(|e| e.to_string())?
            .into();
        let symbol = format!("{entry}__emu_launch");
        // SAFETY: the caller guarantees the symbol's type; the raw function pointer copied out
        // here is only called while `lib` (stored next to it) keeps the library loaded.
        let f: LaunchFn = unsafe {
            *lib.get::<LaunchFn>(symbol.as_bytes())
                .map_err(|e| format!("entry `{symbol}` not found: {e}"))?
        };
        // SAFETY: as above: a library built with cuda_emu.h exports `cp_emu_stack_stats` with
        // this signature (an older one may lack it); the pointer is called only while `lib`
        // keeps the library loaded.
        let stats: Option<StatsFn> =
            unsafe { lib.get::<StatsFn>(b"cp_emu_stack_stats").ok().map(|s| *s) };
        Ok(EmuKernel {
            entry: f,
            stats,
            lib: Some(lib),
        })
    }

    /// The calling OS thread's fiber-stack pool in this kernel's library (`None` for a
    /// library built from a header without `cp_emu_stack_stats`).
    pub(crate) fn stack_stats(&self) -> Option<CpEmuStackStats> {
        let f = self.stats?;
        let mut out = CpEmuStackStats::default();
        // SAFETY: `f` is the library's `cp_emu_stack_stats` (see `load`), which writes one
        // `CpEmuStackStats` to `out`; the library stays loaded while `self` exists.
        unsafe { f(&mut out) };
        Some(out)
    }

    /// Runs the kernel to completion on the calling thread. `args[i]` holds the exact bytes of
    /// parameter `i`. Returns the emulator status and its diagnostic on failure.
    ///
    /// # Safety
    /// Every pointer among the arguments must address memory that stays alive for the call
    /// and is large enough for everything the kernel accesses through it given its size
    /// arguments (what [`Executor::launch`](crate::exec::Executor::launch) checks against the
    /// signature's reach, and the contract of
    /// [`Executor::launch_unchecked`](crate::exec::Executor::launch_unchecked)).
    pub(crate) unsafe fn launch(
        &self,
        shape: &LaunchShape,
        args: &[&[u8]],
    ) -> Result<(), (i32, String)> {
        let mut params: Vec<*mut c_void> = args.iter().map(|a| a.as_ptr() as *mut c_void).collect();
        let sizes: Vec<u64> = args.iter().map(|a| a.len() as u64).collect();
        let mut err = vec![0u8; ERR_CAP];
        let cfg = CpEmuLaunch {
            abi_version: ABI_VERSION,
            grid: shape.grid,
            block: shape.block,
            dyn_shared_bytes: shape.shared_bytes,
            flags: if shape.reverse { FLAG_REVERSE } else { 0 },
            num_params: args.len() as u32,
            stack_bytes: shape.stack_bytes,
            param_sizes: sizes.as_ptr(),
            err_buf: err.as_mut_ptr() as *mut c_char,
            err_cap: ERR_CAP as u64,
        };
        // SAFETY: `cfg`, `params`, `sizes` and `err` outlive the call; the entry checks the ABI
        // version, the parameter count and every parameter's size against the kernel signature
        // before reading `params[i]` (each points at `sizes[i]` readable bytes), and writes at
        // most `err_cap` bytes to `err`. Pointer arguments point into memory large enough for
        // the kernel's accesses and alive for the call (guaranteed by the caller).
        let status = unsafe { (self.entry)(&cfg, params.as_mut_ptr()) };
        if status == 0 {
            return Ok(());
        }
        if status == STATUS_ABI {
            return Err((
                status,
                format!(
                    "the library was built for another emulation launch ABI than this \
                     executor's (version {ABI_VERSION}); rebuild it from the current cuda_emu.h"
                ),
            ));
        }
        let msg = CStr::from_bytes_until_nul(&err)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_else(|_| String::from_utf8_lossy(&err).into_owned());
        Err((status, msg))
    }
}

impl Drop for EmuKernel {
    fn drop(&mut self) {
        // Null-swap first, then close.
        if let Some(lib) = self.lib.take() {
            let _ = lib.close();
        }
    }
}

/// Whether the AddressSanitizer runtime is already in this process (preloaded, as it must
/// be): loading an ASan-built kernel library without it makes the runtime end the process.
pub(crate) fn asan_runtime_loaded() -> bool {
    let this = libloading::os::unix::Library::this();
    // SAFETY: only the symbol's address is looked up; it is never called or dereferenced.
    unsafe { this.get::<*const c_void>(b"__asan_init") }.is_ok()
}

/// Launch shape and emulator settings for one launch.
pub(crate) struct LaunchShape {
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) shared_bytes: u32,
    pub(crate) reverse: bool,
    pub(crate) stack_bytes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_struct_layout_matches_header() {
        assert_eq!(std::mem::size_of::<CpEmuLaunch>(), 72);
        assert_eq!(std::mem::offset_of!(CpEmuLaunch, stack_bytes), 40);
        assert_eq!(std::mem::offset_of!(CpEmuLaunch, err_cap), 64);
        assert_eq!(std::mem::size_of::<CpEmuStackStats>(), 48);
        assert_eq!(std::mem::offset_of!(CpEmuStackStats, guard_regions), 40);
    }

    #[test]
    fn only_the_segments_of_processes_that_are_gone_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        // A process that ran and was reaped: its pid names no process now.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let gone = child.id();
        child.wait().unwrap();
        let me = std::process::id();
        let parent = std::os::unix::process::parent_id();
        let names = [
            format!("cp-hicache-{gone}-3-1f2e"),
            format!("cp-hicache-{me}-1-ab"),
            format!("cp-hicache-{parent}-2-cd"),
            "cp-hicache-notapid-1-ef".to_string(),
            "cp-hicache-0-1-ef".to_string(),
            format!("fake-cuda-{gone}-1"),
            format!("other-{gone}-1"),
        ];
        for n in &names {
            std::fs::write(dir.path().join(n), b"x").unwrap();
        }
        assert_eq!(remove_orphaned_segments(dir.path()), vec![names[0].clone()]);
        let mut left: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        let mut want = names[1..].to_vec();
        want.sort();
        assert_eq!(left, want);
        // A directory that does not exist (no /dev/shm) removes nothing.
        assert!(remove_orphaned_segments(&dir.path().join("absent")).is_empty());
    }

    #[test]
    fn host_mem_is_aligned_and_filled() {
        let m = HostMem::new(100, 0xA5).unwrap();
        assert_eq!(m.addr() % BUFFER_ALIGN as u64, 0);
        assert!(m.as_slice().iter().all(|&b| b == 0xA5));
        assert_eq!(HostMem::new(0, 0).unwrap().len(), 0);
    }
}
