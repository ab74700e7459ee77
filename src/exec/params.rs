//! Kernel signatures as the executors check them: the `extern "C"` parameter list of a
//! kernel, how far each pointer reaches, the page tables it follows, and the launch contract
//! ([`KernelSignature`]). The kernel specs build them
//! ([`KernelSpec::signature`](crate::kernels::KernelSpec::signature)); the executors need
//! only these descriptions, so they live here, below the kernels.

use std::fmt;

/// One parameter of a kernel's `extern "C"` signature (docs/KERNELS.md "Kernels").
///
/// [`KernelSpec::params`](crate::kernels::KernelSpec::params) is the single source of truth for a
/// rendered kernel's parameter list: the render spells it from these values, and executors
/// check every launch's arguments against the sizes, because `cuLaunchKernel` cannot tell a
/// wrong argument list from a right one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelParam {
    /// The C parameter name, as the kernel body uses it.
    pub name: &'static str,
    /// The C type, spelled as in the render (`const u8*`, `u32`,
    /// `const __grid_constant__ ChcPools`).
    pub c_type: &'static str,
    /// Bytes the launch passes for it: 8 for a pointer, 8 × CP for the pool struct.
    pub size: usize,
    /// For a pointer (or each pointer of the pool struct): the byte alignment the kernel
    /// needs at it. Page buffers take 16-byte vector accesses, typed arrays their element
    /// size. A GPU faults on a misaligned access the CPU emulator runs without complaint, so
    /// both executors check it. 1 for scalars.
    pub align: u64,
    /// For a pointer: how far the kernel reaches through it, from the launch's scalar
    /// arguments (for a page table, the table's own bytes). `None` for scalars.
    pub reach: Option<Reach>,
    /// For a page table: what each of its pointers reaches, and whether the kernel writes
    /// through them. `None` for every other parameter.
    pub entries: Option<TableEntries>,
}

/// The pointers of a page table (`const u64*`, one address per layer, or per owner and
/// layer): each is the base of one layer's pages, `stride` bytes apart, so an engine's
/// per-layer tensors, one cross-layer tensor in either order, and the cache's own pools are
/// all one kernel. The executor writes the table at launch from checked buffer addresses
/// ([`KernelArg::Table`](crate::exec::KernelArg::Table)), so a kernel never follows an address
/// nobody checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TableEntries {
    /// What each pointer reaches.
    pub pages: Strided,
    /// Whether the kernel writes through the pointers (the table itself is read only).
    pub writes: bool,
    /// The alignment each pointer and the stride need: what page offsets in one buffer
    /// would have, the largest power of two dividing a page's bytes, at most 16 (the widest
    /// vector).
    pub align: u64,
}

impl TableEntries {
    /// The alignment of pages of `unit` bytes laid end to end.
    pub const fn align_of(unit: u64) -> u64 {
        let low = unit & unit.wrapping_neg();
        if low == 0 || low > PAGE_ALIGN {
            PAGE_ALIGN
        } else {
            low
        }
    }
}

/// `count` pages of `unit` bytes, `stride` bytes apart (both `u32` parameters of the same
/// launch): `(count − 1) × stride + unit` bytes from the pointer, nothing when `count` is 0.
/// The stride must keep every page as aligned as the first ([`TableEntries::align_of`]) and,
/// with more than one page, be at least a page: smaller, pages would overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Strided {
    /// Bytes of one page.
    pub unit: u64,
    /// The parameter holding the page count.
    pub count: &'static str,
    /// The parameter holding the stride in bytes.
    pub stride: &'static str,
}

impl Strided {
    /// The reach in bytes and the stride, given each count parameter's value; a stride that
    /// breaks the rule above is [`ReachError::Stride`].
    pub fn bytes(&self, value: impl Fn(&str) -> Option<u32>) -> Result<(u64, u64), ReachError> {
        let count = u64::from(value(self.count).ok_or(ReachError::NoValue(self.count))?);
        let stride = u64::from(value(self.stride).ok_or(ReachError::NoValue(self.stride))?);
        let align = TableEntries::align_of(self.unit);
        if stride % align != 0 || (count > 1 && stride < self.unit) {
            return Err(ReachError::Stride {
                stride,
                unit: self.unit,
                align,
            });
        }
        if count == 0 {
            return Ok((0, stride));
        }
        let bytes = (count - 1)
            .checked_mul(stride)
            .and_then(|b| b.checked_add(self.unit))
            .ok_or(ReachError::Overflow)?;
        Ok((bytes, stride))
    }
}

impl fmt::Display for Strided {
    /// `(local_pages - 1) × page_stride + 656`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "({} - 1) × {} + {}", self.count, self.stride, self.unit)
    }
}

/// How many bytes from a pointer argument a kernel may read or write: `unit` times the
/// product of `ceil(arg / per)` over `counts`, where each count is a `u32` parameter of the
/// same launch (`4 × n`, `PAGE_BYTES × layers × local_pages`, ...).
///
/// The kernels bound every index by these arguments and nothing else (page ids read from
/// memory are checked against the pool sizes passed in, docs/KERNELS.md), so when each
/// pointer's buffer holds its reach, a launch stays inside its buffers whatever the values.
/// Both executors check exactly that before a launch, which is what makes
/// [`Executor::launch`](crate::exec::Executor::launch) safe for kernels loaded with a
/// signature.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Reach {
    /// Bytes per unit of the counts (the element size, or a page's bytes).
    pub unit: u64,
    /// Up to two scalar parameters the reach scales with, each as `(name, per)`: the count is
    /// `ceil(value / per)` (`per` = 1 for a plain count).
    pub counts: [Option<(&'static str, u32)>; 2],
}

impl Reach {
    /// The reach in bytes, given each count parameter's value.
    pub fn bytes(&self, value: impl Fn(&str) -> Option<u32>) -> Result<u64, ReachError> {
        let mut bytes = self.unit;
        for &(name, per) in self.counts.iter().flatten() {
            let v = value(name).ok_or(ReachError::NoValue(name))?;
            let count = u64::from(v).div_ceil(u64::from(per.max(1)));
            bytes = bytes.checked_mul(count).ok_or(ReachError::Overflow)?;
        }
        Ok(bytes)
    }
}

/// Why a [`Reach`] has no size in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReachError {
    /// The launch has no `u32` value for this count parameter.
    #[error("has no u32 argument for `{0}`")]
    NoValue(&'static str),
    /// The product overflows 64 bits.
    #[error("overflows 64 bits for these arguments")]
    Overflow,
    /// A page table's stride is not a whole number of 16-byte vectors, or is smaller than a
    /// page.
    #[error(
        "has a page stride of {stride} bytes: it must be a multiple of {align} and at least a \
         page ({unit} bytes), or pages would be misaligned or overlap"
    )]
    Stride {
        /// The stride given.
        stride: u64,
        /// The page's bytes.
        unit: u64,
        /// The alignment pages need.
        align: u64,
    },
}

impl fmt::Display for Reach {
    /// `4 × n`, `656 × layers × local_pages`, `4 × ceil(n_tokens / 32)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.unit)?;
        for &(name, per) in self.counts.iter().flatten() {
            if per > 1 {
                write!(f, " × ceil({name} / {per})")?;
            } else {
                write!(f, " × {name}")?;
            }
        }
        Ok(())
    }
}

/// What every launch of a rendered kernel must match, checked by both executors before
/// anything runs (a GPU would run a wrong launch and give wrong results, not an error).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KernelSignature {
    /// The `extern "C"` parameters in order ([`KernelSpec::params`](crate::kernels::KernelSpec::params)).
    pub params: Vec<KernelParam>,
    /// Threads per block, in x only: the kernels stride by their compiled `THREADS`, never
    /// by `blockDim`, so fewer threads would skip work (verify would pass unchecked tokens)
    /// and more would exceed `__launch_bounds__`.
    pub threads: u32,
    /// Whether the grid must be exactly one block: select and release read and write the
    /// lane tops from one block, and a second block would hand out or push pages twice.
    pub single_block: bool,
}

/// Alignment of page buffers: the copy kernels move pages in 16-byte vectors.
pub(crate) const PAGE_ALIGN: u64 = 16;

impl KernelParam {
    /// Whether the kernel writes through this pointer (a pointer type without `const`); a
    /// page table is read only (whether its pointers are written is
    /// [`TableEntries::writes`]).
    pub fn writes(&self) -> bool {
        self.reach.is_some() && !self.c_type.starts_with("const ")
    }
}
