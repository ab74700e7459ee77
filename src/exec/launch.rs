//! What a launch takes: kernel artifacts, the launch shape and typed kernel arguments, with
//! the marshalling and bounds and aliasing checks every executor runs before a kernel does.

use std::path::{Path, PathBuf};

#[cfg(doc)]
use super::{signature, Executor};
use super::{BufferId, ExecError, LaunchFailure};
use crate::kernels::KernelSignature;

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
