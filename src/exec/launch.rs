//! What a launch takes: kernel artifacts, the launch shape and typed kernel arguments, with
//! the marshalling and bounds and aliasing checks every executor runs before a kernel does.

use std::path::{Path, PathBuf};

#[cfg(doc)]
use super::{signature, Executor};
use super::{BufferId, ExecError, KernelSignature, LaunchFailure};

/// A compiled kernel, as produced by the JIT for one backend.
///
/// `signature` is the kernel's launch contract when it was rendered from a spec
/// ([`KernelSpec::signature`](crate::kernels::KernelSpec::signature); the JIT's
/// `CompiledKernel::load_spec` passes it). The executor
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
    /// A page table (`const u64*`, [`TableEntries`](crate::exec::TableEntries)): the
    /// table's buffer and byte offset, then its pointers, each a buffer plus a byte offset.
    /// The executor checks every pointer like a [`KernelArg::Ptr`], writes their addresses into
    /// the table in stream order, then passes the table's address: the kernel follows only
    /// addresses that were checked for this launch.
    Table(BufferId, u64, &'a [(BufferId, u64)]),
}

impl KernelArg<'_> {
    /// Size of the argument value in bytes, as the kernel sees it.
    pub fn size(&self) -> usize {
        match self {
            KernelArg::Ptr(..)
            | KernelArg::Table(..)
            | KernelArg::Null
            | KernelArg::U64(_)
            | KernelArg::I64(_) => 8,
            KernelArg::U32(_) | KernelArg::I32(_) => 4,
            KernelArg::Bytes(b) => b.len(),
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
/// also have its parameter's [`Reach`](crate::exec::Reach) left in its buffer after the
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
/// [`KernelParam::writes`]: crate::exec::KernelParam::writes
pub(crate) fn marshal_args(
    kernel: &str,
    signature: Option<&KernelSignature>,
    args: &[KernelArg<'_>],
    resolve: impl Fn(BufferId) -> Result<(u64, usize), ExecError>,
) -> Result<Marshalled, ExecError> {
    // A count as the kernel sees it: the 32 bits of a u32 (or i32) argument.
    let scalar = |name: &str| {
        let i = signature?.params.iter().position(|p| p.name == name)?;
        match args.get(i)? {
            KernelArg::U32(v) => Some(*v),
            KernelArg::I32(v) => Some(*v as u32),
            _ => None,
        }
    };
    let refuse = |i: usize, problem: String| {
        let name = signature
            .and_then(|s| s.params.get(i))
            .map_or("?", |p| p.name);
        ExecError::Launch {
            kernel: kernel.to_string(),
            cause: LaunchFailure::InvalidConfig,
            message: format!("parameter {i} `{name}` {problem}"),
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
        Err(refuse(i, problem))
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
        let short = matches!(e, ExecError::OutOfBounds { len, .. } if len > 0);
        let reach = match (
            p.and_then(|p| p.reach),
            p.and_then(|p| p.entries),
            element.is_empty(),
        ) {
            (_, Some(t), false) if short => {
                format!(" (the kernel reaches {} bytes from it)", t.pages)
            }
            (Some(r), _, true) if short => format!(" (the kernel reaches {r} bytes from it)"),
            _ => String::new(),
        };
        ExecError::Launch {
            kernel: kernel.to_string(),
            cause: LaunchFailure::InvalidConfig,
            message: format!("{param}{element}: {e}{reach}"),
        }
    };
    let writes = |i: usize| {
        signature
            .and_then(|s| s.params.get(i))
            .is_some_and(|p| p.writes())
    };
    // What each pointer reaches, checked in bounds above.
    let mut spans: Vec<Span> = Vec::new();
    let mut out = Marshalled::default();
    for (i, arg) in args.iter().enumerate() {
        out.params.push(match *arg {
            KernelArg::Ptr(b, off) => {
                let reach = reach(i)?;
                let bytes = pointer(b, off, reach).map_err(|e| invalid(i, None, e))?;
                spans.push(Span::plain(i, b, off, reach, writes(i)));
                bytes.to_vec()
            }
            KernelArg::Null => vec![0; 8],
            KernelArg::U32(v) => v.to_ne_bytes().to_vec(),
            KernelArg::I32(v) => v.to_ne_bytes().to_vec(),
            KernelArg::U64(v) => v.to_ne_bytes().to_vec(),
            KernelArg::I64(v) => v.to_ne_bytes().to_vec(),
            KernelArg::Bytes(b) => b.to_vec(),
            KernelArg::Table(table, off, entries) => {
                let reach = reach(i)?;
                let param = signature.and_then(|s| s.params.get(i));
                let t = match (signature, param.and_then(|p| p.entries)) {
                    (_, Some(t)) => Some(t),
                    // Unchecked (`launch_unchecked`): the pointers only start inside their
                    // buffers, as for a plain pointer; the reach is the caller's contract.
                    (None, None) => None,
                    (Some(_), None) => {
                        return Err(refuse(
                            i,
                            "is not a page table, so no rule bounds a table's pointers".into(),
                        ))
                    }
                };
                let reach = if t.is_some() {
                    reach
                } else {
                    8 * entries.len() as u64
                };
                // Every slot the kernel may read holds a checked address: no more, no fewer.
                if t.is_some() && entries.len() as u64 * 8 != reach {
                    return Err(refuse(
                        i,
                        format!(
                            "reads {} pointers ({}), but the table has {}",
                            reach / 8,
                            param
                                .and_then(|p| p.reach)
                                .map(|r| r.to_string())
                                .unwrap_or_default(),
                            entries.len()
                        ),
                    ));
                }
                let (each, stride) = match t {
                    Some(t) => t
                        .pages
                        .bytes(scalar)
                        .map_err(|e| refuse(i, format!("(pointers reaching {}) {e}", t.pages)))?,
                    None => (0, 0),
                };
                let (unit, writes) = t.map_or((0, false), |t| (t.pages.unit, t.writes));
                let at = pointer(table, off, reach).map_err(|e| invalid(i, None, e))?;
                spans.push(Span::plain(i, table, off, reach, false));
                let mut bytes = Vec::with_capacity(entries.len() * 8);
                for (j, &(b, o)) in entries.iter().enumerate() {
                    bytes.extend_from_slice(
                        &pointer(b, o, each).map_err(|e| invalid(i, Some(j), e))?,
                    );
                    spans.push(Span {
                        param: i,
                        buffer: b,
                        range: o..o + each,
                        window: Some((stride, unit)),
                        writes,
                    });
                }
                out.tables.push(TableWrite {
                    buffer: table,
                    offset: off,
                    bytes,
                });
                at.to_vec()
            }
        });
    }
    if let Some(sig) = signature {
        check_no_aliased_output(kernel, sig, &spans)?;
    }
    // Page-organised memory (a table's pointers, a pool or dense page buffer) is reached at
    // the pages the launch's page ids name, which only the kernel knows: sparse.
    let paged = |p: usize| {
        signature
            .and_then(|s| s.params.get(p))
            .is_some_and(|p| p.align == crate::exec::PAGE_ALIGN)
    };
    out.accesses = spans
        .iter()
        .map(|s| Access {
            buffer: s.buffer,
            range: s.range.clone(),
            writes: s.writes,
            sparse: s.window.is_some() || paged(s.param),
        })
        .collect();
    Ok(out)
}

/// A byte range of a buffer that a launch reads or writes, as its signature bounds it: what
/// the CUDA executor declares to the stand-in driver's race checker
/// (`tests/fake_cuda/streams.h`).
#[derive(Debug, Clone)]
pub(crate) struct Access {
    pub buffer: BufferId,
    pub range: std::ops::Range<u64>,
    pub writes: bool,
    /// Reached only at some pages inside `range` (through page ids the kernel reads).
    pub sparse: bool,
}

/// A launch's marshalled arguments: the bytes each `void**` entry points at, in parameter
/// order, and the page tables the executor writes (in stream order) before the kernel runs.
#[derive(Debug, Default)]
pub(crate) struct Marshalled {
    /// One vector per argument.
    pub params: Vec<Vec<u8>>,
    /// The checked addresses of every [`KernelArg::Table`].
    pub tables: Vec<TableWrite>,
    /// What each pointer reaches.
    pub accesses: Vec<Access>,
}

/// The addresses of one page table, to write at `offset` in `buffer` before the launch.
#[derive(Debug)]
pub(crate) struct TableWrite {
    pub buffer: BufferId,
    pub offset: u64,
    pub bytes: Vec<u8>,
}

/// What one pointer of a launch reaches: `range` of `buffer`, touched everywhere or, for a
/// page table's pointer, only in windows of `unit` bytes every `stride` bytes.
struct Span {
    param: usize,
    buffer: BufferId,
    range: std::ops::Range<u64>,
    window: Option<(u64, u64)>,
    writes: bool,
}

impl Span {
    fn plain(param: usize, buffer: BufferId, off: u64, reach: u64, writes: bool) -> Span {
        Span {
            param,
            buffer,
            range: off..off + reach,
            window: None,
            writes,
        }
    }

    /// Whether the two touch a common byte. Two page tables' pointers with one stride touch
    /// only where their page windows meet (a cross-layer tensor's layers interleave page by
    /// page without sharing a byte); anything else, wherever the ranges meet.
    fn overlaps(&self, other: &Span) -> bool {
        let (r, s) = (&self.range, &other.range);
        let touch = !r.is_empty() && !s.is_empty();
        if !touch || self.buffer != other.buffer || r.start >= s.end || s.start >= r.end {
            return false;
        }
        match (self.window, other.window) {
            (Some((stride, a)), Some((stride2, b))) if stride == stride2 && stride > 0 => {
                // Where self's windows start within other's period.
                let d = (r.start + stride - s.start % stride) % stride;
                d < b || d + a > stride
            }
            _ => true,
        }
    }
}

/// Refuses a launch in which a written parameter's reach overlaps another pointer's
/// ([`marshal_args`]), a page table's pointers included (two of one written table must not
/// share a byte either); empty ranges touch nothing.
///
/// Sorted by buffer and start, a span is compared only with those that start before it ends
/// in the same buffer: O(n log n) plus the pairs whose ranges meet, where a layer-wise load
/// names a table of one span per layer and page (every pair once made it quadratic).
fn check_no_aliased_output(
    kernel: &str,
    sig: &KernelSignature,
    spans: &[Span],
) -> Result<(), ExecError> {
    let mut order: Vec<&Span> = spans.iter().filter(|s| !s.range.is_empty()).collect();
    order.sort_by_key(|s| (s.buffer, s.range.start, s.param));
    for (k, x) in order.iter().enumerate() {
        let meeting = order[k + 1..]
            .iter()
            .take_while(|y| y.buffer == x.buffer && y.range.start < x.range.end);
        for y in meeting {
            if !(x.writes || y.writes) || !x.overlaps(y) {
                continue;
            }
            // Name the written one first.
            let (w, o) = if x.writes { (x, y) } else { (y, x) };
            let name = |p: usize| sig.params.get(p).map_or("?", |p| p.name);
            let b = w.buffer;
            return Err(ExecError::Launch {
                kernel: kernel.to_string(),
                cause: LaunchFailure::InvalidConfig,
                message: format!(
                    "parameter {} `{}` (written) overlaps parameter {} `{}` in buffer {b:?}: \
                     bytes {}..{} and {}..{}; a kernel's output must not alias another of its \
                     pointers (threads would read what others write, in no fixed order)",
                    w.param,
                    name(w.param),
                    o.param,
                    name(o.param),
                    w.range.start,
                    w.range.end,
                    o.range.start,
                    o.range.end
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
