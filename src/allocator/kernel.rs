//! The kernel-backed owner-lane allocator: the lane free stacks and tops live in executor
//! (device) memory and the select / release kernels pop and push them, while a host mirror
//! decides success.
//!
//! docs/DESIGN.md §2.3: success is decided from "the per-lane counts, which is enough to decide success
//! without reading device memory". This type keeps a full [`OwnerLaneAllocator`] as the
//! mirror, because the host also needs the page ids (for the radix tree) and the mirror pops
//! and pushes in exactly the kernels' LIFO order (docs/KERNELS.md "Lane free stacks"), so the
//! pages it predicts are the pages the kernel writes. An allocation or a free therefore
//! uploads a small control array and launches one kernel; it never reads device memory back
//! and never synchronises (the executor's counters prove it).
//!
//! All or nothing, like the host allocator: a shortage or misuse is the mirror's typed
//! [`AllocError`] and nothing is launched; a failed launch rolls the mirror back and
//! re-uploads its state, so the allocator is unchanged on every error. If that re-upload
//! fails too, the device lanes no longer follow the mirror: the allocator is then broken and
//! refuses every allocation and free ([`KernelAllocError::Broken`]) until a successful
//! [`KernelLaneAllocator::restore`] uploads a whole state again.
//!
//! The select kernel guards all or nothing itself as well, without trusting the mirror: if
//! the device lanes ever hold fewer pages than the mirror counted (drift, or another stream
//! popping them), the launch changes no lane top, hands out page 0 for every request and adds
//! the deficit to a status array in device memory ([`SelectStatus`]). Reading it would stall,
//! so allocations never do: [`KernelLaneAllocator::check_status`] reads it when the caller
//! synchronises anyway (and [`KernelLaneAllocator::debug_check_device`] starts with it), and
//! a refusal is [`KernelAllocError::DeviceRefused`].
//!
//! The release kernel guards the same way: if a free would push more pages onto a device
//! lane than it has slots (the device lanes hold more pages than the mirror counts: a double
//! free, or pages pushed behind the allocator's back), or names an invalid page, the launch
//! changes no lane top and no stack slot and records the overflow in its own status words
//! ([`ReleaseStatus`], beside the select's in the same buffer), which
//! [`KernelLaneAllocator::check_status`] reads in the same read and reports as
//! [`KernelAllocError::DeviceRefusedRelease`].
//!
//! One stream: every launch and upload that touches an allocator's lanes goes through the one
//! executor it was built with (executors are one ordered stream, docs/KERNELS.md "One stream
//! per rank's allocator"); the lane buffers and kernels are handles of that executor, which
//! every other executor refuses.

use std::sync::Arc;

use super::{AllocError, OwnerLaneAllocator, PageRun, StateDigest};
use crate::exec::{BufferId, ExecError, Executor, KernelArg, KernelId, LaunchConfig, MemKind};
use crate::jit::{spec_request, target_for, Arch, Jit, JitError, Sanitize};
use crate::kernels::{
    AllocSpec, KernelError, KernelSpec, ReleaseSpec, ReleaseStatus, SelectOutput, SelectStatus,
};
use crate::layout::{CpLayout, PageId, Rank};

/// Poison byte of freshly allocated output buffers (docs/KERNELS.md).
const POISON: u8 = 0xA5;

/// Why a kernel-backed allocator call failed. On every error the allocator (mirror and
/// device state) is unchanged.
#[derive(Debug, thiserror::Error)]
pub enum KernelAllocError {
    /// A shortage or misuse, decided by the host mirror; nothing was launched.
    #[error(transparent)]
    Alloc(#[from] AllocError),
    /// The select or release kernel could not be rendered.
    #[error(transparent)]
    Kernel(#[from] KernelError),
    /// The select or release kernel could not be compiled.
    #[error(transparent)]
    Jit(#[from] JitError),
    /// The executor failed (buffer, upload, load or launch).
    #[error(transparent)]
    Exec(#[from] ExecError),
    /// [`KernelLaneAllocator::debug_check_device`] found device stacks that differ from the
    /// mirror.
    #[error("device lane state differs from the host mirror: {what}")]
    DeviceMismatch {
        /// The first difference found.
        what: String,
    },
    /// The select kernel refused allocations that the host mirror had granted (found by
    /// [`KernelLaneAllocator::check_status`]): the device lanes held fewer pages than the
    /// mirror counted, so the device lanes and the mirror have drifted apart (a bug, or a
    /// launch on the lanes outside this allocator). The refused launches handed out page 0
    /// and changed no lane; the status stays set until
    /// [`KernelLaneAllocator::restore`] uploads a whole state.
    #[error(
        "the device refused allocations its host mirror granted ({status}); the device lanes \
         and the mirror have drifted apart: restore the allocator from a known state"
    )]
    DeviceRefused {
        /// The status words: refused launches, each lane's deficit, bad owners.
        status: SelectStatus,
    },
    /// The release kernel refused frees that the host mirror had accepted (found by
    /// [`KernelLaneAllocator::check_status`], which reports this before a select refusal:
    /// a refused release leaves the device lanes short of pages the mirror counts free, so a
    /// later select may be refused for it). A device lane had no room for the pages freed
    /// onto it, so it held more pages than the mirror counted (a double free, or pages pushed
    /// behind the allocator's back), or a page was invalid. The refused launches changed no
    /// lane top and no stack slot; the status stays set until
    /// [`KernelLaneAllocator::restore`] uploads a whole state.
    #[error(
        "the device refused frees its host mirror accepted ({status}; {select}); the device \
         lanes and the mirror have drifted apart: restore the allocator from a known state"
    )]
    DeviceRefusedRelease {
        /// The release status words: refused launches, each lane's overflow, invalid pages.
        status: ReleaseStatus,
        /// The select status words, read in the same read (often clear).
        select: SelectStatus,
    },
    /// An earlier failure could not be undone on the device (re-uploading the mirror failed),
    /// so the device lanes may differ from the mirror; nothing is launched until
    /// [`KernelLaneAllocator::restore`] succeeds.
    #[error(
        "the allocator's device lanes are out of step with its host mirror since an earlier \
         failure could not be undone ({cause}); restore it from a known state"
    )]
    Broken {
        /// Why the device lanes could not be restored.
        cause: String,
    },
    /// [`KernelLaneAllocator::restore`] was given the state of an allocator of another layout.
    #[error("cannot restore an allocator of layout {ours:?} from a state of layout {theirs:?}")]
    LayoutMismatch {
        /// This allocator's layout.
        ours: CpLayout,
        /// The layout of the state offered.
        theirs: CpLayout,
    },
}

impl KernelAllocError {
    /// Whether this is a shortage (recoverable by eviction), exactly as
    /// [`AllocError::is_shortage`].
    pub fn is_shortage(&self) -> bool {
        matches!(self, KernelAllocError::Alloc(e) if e.is_shortage())
    }

    /// The host allocator's error, when the mirror refused the call.
    pub fn as_alloc(&self) -> Option<&AllocError> {
        match self {
            KernelAllocError::Alloc(e) => Some(e),
            _ => None,
        }
    }
}

/// How to build the allocator's kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelAllocOptions {
    /// Threads of the select and release blocks (a multiple of 32 in 32..=1024).
    pub threads: u32,
    /// Sanitizer mode of host-emulation builds (ignored on CUDA).
    pub sanitize: Sanitize,
    /// Architecture of CUDA builds when the executor reports no compute capability; a CUDA
    /// executor builds for its own device (`jit::target_for`). Ignored on the host executor.
    pub arch: Arch,
}

impl Default for KernelAllocOptions {
    /// The deployments' default shape: `t256`, no sanitizer, `sm_90` as the fallback arch.
    fn default() -> Self {
        KernelAllocOptions {
            threads: 256,
            sanitize: Sanitize::None,
            arch: Arch::default(),
        }
    }
}

/// A typed array in an executor buffer: `len` elements starting `offset` bytes into
/// `buffer`, ready to be passed to a later kernel as `KernelArg::Ptr(buffer, offset)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceSlice {
    /// The buffer.
    pub buffer: BufferId,
    /// Byte offset of element 0.
    pub offset: u64,
    /// Number of elements.
    pub len: u64,
}

/// The result of a kernel-backed allocation: the mirror's pages, and where the select kernel
/// wrote them in executor memory. The device array stays valid until the next allocation
/// call on the same allocator (which reuses, and may reallocate, the output buffer).
///
/// The kernel writes no token locations ([`SelectOutput::Pages`]): nothing in the cache reads
/// them on the device, and they would be `8 × page_size` bytes per page from the kernel's one
/// block. [`PageRun::locs`] derives them from the pages on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelRun {
    /// The pages, in request order, as predicted by the host mirror.
    pub run: PageRun,
    /// `u32 out_pages[n]`: the same pages, written by the select kernel.
    pub pages: DeviceSlice,
}

/// An executor buffer that grows on demand (contents are not preserved).
#[derive(Debug, Clone, Copy)]
struct Growable {
    id: BufferId,
    bytes: usize,
}

/// Buffers allocated for an allocator under construction: freed when dropped unless
/// [`Allocated::keep`] hands them over, so a failed constructor leaks none of them.
struct Allocated<'e> {
    exec: &'e dyn Executor,
    ids: Vec<BufferId>,
}

impl Allocated<'_> {
    fn alloc(&mut self, bytes: usize, fill: u8) -> Result<BufferId, ExecError> {
        let id = self.exec.alloc(MemKind::Device, bytes, fill)?;
        self.ids.push(id);
        Ok(id)
    }

    fn growable(&mut self, bytes: usize) -> Result<Growable, ExecError> {
        let g = Growable::new(self.exec, bytes)?;
        self.ids.push(g.id);
        Ok(g)
    }

    /// The buffers now belong to a finished allocator (whose `Drop` frees them).
    fn keep(mut self) {
        self.ids.clear();
    }
}

impl Drop for Allocated<'_> {
    fn drop(&mut self) {
        for &b in &self.ids {
            // Nothing useful can be done about a failed free on an error path.
            let _ = self.exec.free(b);
        }
    }
}

/// The smallest growable buffer.
const MIN_GROWABLE: usize = 64;

/// The executor buffers of one rank's allocator for `layout`, in bytes: the lane stacks
/// (every lane fits, at most `ceil(pages / cp)` pages each) and tops, then the inputs and
/// outputs, sized for the largest possible call (every page at once) so that an allocation
/// or a free never grows a buffer: on CUDA that would be a synchronising
/// cuMemFree/cuMemAlloc on the load path. No token locations: the select kernel writes
/// pages only ([`KernelRun`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BufferSizes {
    /// Lane free stacks: 4 bytes per slot.
    pub stacks: u64,
    /// Lane tops: 4 bytes per lane.
    pub tops: u64,
    /// The status words of the select kernel, then of the release kernel: 4 bytes per lane,
    /// plus 8, each.
    pub status: u64,
    /// Owners of a request: 1 byte per page.
    pub owners_in: u64,
    /// Pages of a free: 4 bytes per page.
    pub pages_in: u64,
    /// Pages a select hands out: 4 bytes per page.
    pub out_pages: u64,
}

impl BufferSizes {
    /// The sizes for `layout`.
    pub fn of(layout: &CpLayout) -> BufferSizes {
        let (cp, pages) = (u64::from(layout.cp()), u64::from(layout.pages()));
        let growable = |bytes: u64| bytes.max(MIN_GROWABLE as u64);
        BufferSizes {
            stacks: 4 * cp * u64::from(layout.local_pages_per_rank()),
            tops: 4 * cp,
            status: 4 * status_words(layout.cp()) as u64,
            owners_in: growable(pages),
            pages_in: growable(4 * pages),
            out_pages: growable(4 * pages),
        }
    }

    /// All of them.
    pub fn total(&self) -> u64 {
        self.stacks + self.tops + self.status + self.owners_in + self.pages_in + self.out_pages
    }
}

impl Growable {
    fn new(exec: &dyn Executor, bytes: usize) -> Result<Growable, ExecError> {
        let bytes = bytes.max(MIN_GROWABLE);
        Ok(Growable {
            id: exec.alloc(MemKind::Device, bytes, POISON)?,
            bytes,
        })
    }

    /// Makes room for `bytes`; a new buffer is allocated (never read back) when it is short.
    fn ensure(&mut self, exec: &dyn Executor, bytes: usize) -> Result<(), ExecError> {
        if bytes <= self.bytes {
            return Ok(());
        }
        let grown = Growable::new(exec, bytes.next_power_of_two())?;
        let old = std::mem::replace(self, grown);
        exec.free(old.id)
    }
}

/// One rank's owner-lane allocator whose lanes live in executor memory. See the module
/// documentation.
///
/// Thread-safety: `Send + Sync` (the executor is shared); mutation needs `&mut self`.
///
/// Streams: the allocator keeps the executor it was built with for its whole life and issues
/// every upload and launch on its lanes there, and an executor is one ordered stream
/// ([`Executor`]), so all allocator launches of one rank run on one stream, in call order. No
/// method takes another executor, and the lane buffers ([`stacks_buffer`](Self::stacks_buffer),
/// [`tops_buffer`](Self::tops_buffer)) are handles that every other executor refuses
/// ([`ExecError::UnknownBuffer`]). Work that frees pages on another stream (a write-back
/// stream, say) must free them through this allocator, on this executor.
pub struct KernelLaneAllocator {
    exec: Arc<dyn Executor>,
    mirror: OwnerLaneAllocator,
    select: (KernelSpec, KernelId),
    release: (KernelSpec, KernelId),
    lane_cap: u32,
    stacks: BufferId,
    tops: BufferId,
    /// `u32 status[2 * (CP + 2)]`: the select kernel's refusals ([`SelectStatus`]), then the
    /// release kernel's ([`ReleaseStatus`]).
    status: BufferId,
    owners_in: Growable,
    pages_in: Growable,
    out_pages: Growable,
    /// Set when the device lanes could not be brought back in step with the mirror.
    broken: Option<String>,
}

impl std::fmt::Debug for KernelLaneAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelLaneAllocator")
            .field("layout", self.mirror.layout())
            .field("select", &self.select.0.uri())
            .field("release", &self.release.0.uri())
            .field("lane_cap", &self.lane_cap)
            .finish_non_exhaustive()
    }
}

impl KernelLaneAllocator {
    /// A fresh allocator for `layout`: compiles (through `jit`) and loads the select and
    /// release kernels, and uploads the lane stacks once.
    pub fn new(
        layout: CpLayout,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        options: KernelAllocOptions,
    ) -> Result<KernelLaneAllocator, KernelAllocError> {
        Self::from_allocator(OwnerLaneAllocator::new(layout), exec, jit, options)
    }

    /// An allocator that starts from the state of a host allocator (which becomes the
    /// mirror), for example a replica that already served requests.
    pub fn from_allocator(
        mirror: OwnerLaneAllocator,
        exec: Arc<dyn Executor>,
        jit: &Jit,
        options: KernelAllocOptions,
    ) -> Result<KernelLaneAllocator, KernelAllocError> {
        let layout = *mirror.layout();
        let specs = [
            KernelSpec::SelectOwnerPages(AllocSpec {
                cp: layout.cp(),
                page_size: layout.page_size(),
                threads: options.threads,
                output: SelectOutput::Pages,
            }),
            KernelSpec::ReleasePages(ReleaseSpec {
                cp: layout.cp(),
                threads: options.threads,
            }),
        ];
        let target = target_for(exec.as_ref(), options.arch, options.sanitize)?;
        let requests = specs
            .iter()
            .map(|spec| spec_request(spec, target, None))
            .collect::<Result<Vec<_>, KernelError>>()?;
        let mut ids = Vec::with_capacity(specs.len());
        for (spec, compiled) in specs.iter().zip(jit.warm_up(&requests)) {
            let compiled = compiled?;
            // SAFETY: `compiled` is the JIT's build of `spec` for `exec`'s target.
            ids.push(unsafe { compiled.load_spec(exec.as_ref(), spec) }?);
        }
        // Every lane fits: a lane holds at most ceil(pages / cp) pages.
        let lane_cap = layout.local_pages_per_rank();
        let sizes = BufferSizes::of(&layout);
        let size = |bytes: u64| {
            usize::try_from(bytes).map_err(|_| ExecError::Alloc {
                bytes: usize::MAX,
                kind: MemKind::Device,
                reason: format!("{bytes} bytes are more than this machine can address"),
            })
        };
        // A failed allocation frees the ones before it (`Allocated`'s drop).
        let mut mem = Allocated {
            exec: exec.as_ref(),
            ids: Vec::new(),
        };
        let stacks = mem.alloc(size(sizes.stacks)?, POISON)?;
        let tops = mem.alloc(size(sizes.tops)?, POISON)?;
        // Clear: no launch refused yet.
        let status = mem.alloc(size(sizes.status)?, 0)?;
        let owners_in = mem.growable(size(sizes.owners_in)?)?;
        let pages_in = mem.growable(size(sizes.pages_in)?)?;
        let out_pages = mem.growable(size(sizes.out_pages)?)?;
        mem.keep();
        let me = KernelLaneAllocator {
            select: (specs[0], ids[0]),
            release: (specs[1], ids[1]),
            lane_cap,
            stacks,
            tops,
            status,
            owners_in,
            pages_in,
            out_pages,
            mirror,
            exec,
            broken: None,
        };
        // From here on the allocator's own `Drop` frees the buffers.
        me.upload_state()?;
        Ok(me)
    }

    /// The layout this allocator manages.
    pub fn layout(&self) -> &CpLayout {
        self.mirror.layout()
    }

    /// The host mirror (the oracle: its stacks equal the device stacks after every call).
    pub fn mirror(&self) -> &OwnerLaneAllocator {
        &self.mirror
    }

    /// The executor the lanes live in.
    pub fn executor(&self) -> &Arc<dyn Executor> {
        &self.exec
    }

    /// Slots per lane in the device stacks (`lane_cap` of the kernels).
    pub fn lane_cap(&self) -> u32 {
        self.lane_cap
    }

    /// `u32 lane_stacks[CP * lane_cap]` in executor memory.
    pub fn stacks_buffer(&self) -> BufferId {
        self.stacks
    }

    /// `u32 lane_tops[CP]` in executor memory.
    pub fn tops_buffer(&self) -> BufferId {
        self.tops
    }

    /// `u32 status[2 * (CP + 2)]` in executor memory: the select kernel's refusals
    /// ([`SelectStatus`]) from offset 0, then the release kernel's ([`ReleaseStatus`]) from
    /// [`release_status_offset`](Self::release_status_offset). One buffer, so that
    /// [`check_status`](Self::check_status) reads both in one read.
    pub fn status_buffer(&self) -> BufferId {
        self.status
    }

    /// Byte offset of the release kernel's status words in
    /// [`status_buffer`](Self::status_buffer).
    pub fn release_status_offset(&self) -> u64 {
        release_status_offset(self.layout().cp())
    }

    /// Reads the status words of the select and release kernels back (one counted read,
    /// which waits for the launches before it: call it where the caller synchronises anyway,
    /// never on the load path). Some release launch refused on the device is
    /// [`KernelAllocError::DeviceRefusedRelease`], naming the lanes and their overflows;
    /// otherwise some select launch refused is [`KernelAllocError::DeviceRefused`], naming the
    /// lanes and their deficits. The status stays set until [`restore`](Self::restore).
    pub fn check_status(&self) -> Result<(), KernelAllocError> {
        let cp = self.layout().cp();
        let words = self.read_u32(self.status, status_words(cp))?;
        let (select, release) = words.split_at(SelectStatus::words(cp));
        let malformed = |what: &str, n: usize| KernelAllocError::DeviceMismatch {
            what: format!("the {what} status has {n} words"),
        };
        let select =
            SelectStatus::from_words(select).ok_or_else(|| malformed("select", select.len()))?;
        let status = ReleaseStatus::from_words(release)
            .ok_or_else(|| malformed("release", release.len()))?;
        if !status.is_clear() {
            Err(KernelAllocError::DeviceRefusedRelease { status, select })
        } else if !select.is_clear() {
            Err(KernelAllocError::DeviceRefused { status: select })
        } else {
            Ok(())
        }
    }

    /// The select and release specs (uris name the compiled kernels).
    pub fn specs(&self) -> [KernelSpec; 2] {
        [self.select.0, self.release.0]
    }

    /// Free pages per lane (host counts; no device access).
    pub fn lane_free_counts(&self) -> Vec<u32> {
        self.mirror.lane_free_counts()
    }

    /// How many pages each lane lacks to serve `owners` (host counts; no device access).
    pub fn deficit(&self, owners: &[u8]) -> Result<Vec<u32>, KernelAllocError> {
        Ok(self.mirror.deficit(owners)?)
    }

    /// Whether an earlier failure left the device lanes out of step with the mirror
    /// ([`KernelAllocError::Broken`]).
    pub fn is_broken(&self) -> bool {
        self.broken.is_some()
    }

    /// [`KernelAllocError::Broken`] when the allocator is broken, else `Ok`.
    pub fn check_usable(&self) -> Result<(), KernelAllocError> {
        match &self.broken {
            Some(cause) => Err(KernelAllocError::Broken {
                cause: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    /// Digest of the mirror's state (equal across replicas that saw the same calls).
    pub fn digest(&self) -> StateDigest {
        self.mirror.digest()
    }

    /// Allocates pages whose owners equal `owners`, in input order, and launches the select
    /// kernel that writes them to executor memory (their token locations: [`PageRun::locs`]). All or
    /// nothing: a shortage is [`AllocError::LanesShort`] with nothing launched. Uploads the
    /// owners once; never reads back or synchronises.
    pub fn alloc_pages_with_owners(
        &mut self,
        owners: &[u8],
    ) -> Result<KernelRun, KernelAllocError> {
        self.check_usable()?;
        let run = self.mirror.alloc_pages_with_owners(owners)?;
        match self.launch_select(owners) {
            Ok(()) => Ok(self.kernel_run(run)),
            Err(e) => {
                // Reverse-order pushes restore the stacks exactly (LIFO).
                let back: Vec<PageId> = run.pages().iter().rev().copied().collect();
                // The device lanes follow the mirror whatever happens to the undo (it can only
                // fail a debug invariant check, which leaves the mirror as it was); the launch
                // error is what the caller gets.
                let undo = self.mirror.free(&back);
                self.restore_device(&e);
                log_failed_undo(undo, &e);
                Err(e.into())
            }
        }
    }

    /// Allocates `n` pages from any lanes, with the same owner choice as
    /// [`OwnerLaneAllocator::alloc_pages`].
    pub fn alloc_pages(&mut self, n: usize) -> Result<KernelRun, KernelAllocError> {
        self.check_usable()?;
        let owners = self.mirror.plain_owners(n)?;
        self.alloc_pages_with_owners(&owners)
    }

    /// Returns pages to their lanes: validated on the mirror (the host allocator's errors,
    /// nothing launched), then uploaded and pushed by the release kernel. Never reads back or
    /// synchronises.
    pub fn free(&mut self, pages: &[PageId]) -> Result<(), KernelAllocError> {
        self.check_usable()?;
        self.mirror.free(pages)?;
        if let Err(e) = self.launch_release(pages) {
            // Popping the owners of the reversed list takes exactly these pages back.
            let owners: Vec<u8> = pages
                .iter()
                .rev()
                .map(|&p| self.mirror.layout().owner(p).0)
                .collect();
            let undo = self.mirror.alloc_pages_with_owners(&owners).map(drop);
            self.restore_device(&e);
            log_failed_undo(undo, &e);
            return Err(e.into());
        }
        Ok(())
    }

    /// Reads the select and release kernels' status ([`check_status`](Self::check_status)),
    /// then the device stacks and tops back (counted reads: tests, debugging, and once after a
    /// replay) and compares them with the mirror. A refused launch is reported as
    /// [`KernelAllocError::DeviceRefusedRelease`] or [`KernelAllocError::DeviceRefused`],
    /// before the difference it left in the lanes.
    pub fn debug_check_device(&self) -> Result<(), KernelAllocError> {
        self.check_status()?;
        let cp = self.layout().cp();
        let tops = self.read_u32(self.tops, usize::from(cp))?;
        let stacks = self.read_u32(self.stacks, usize::from(cp) * self.lane_cap as usize)?;
        for o in 0..cp {
            let lane = self.mirror.lane_stack(Rank(o));
            let top = tops[usize::from(o)];
            if top as usize != lane.len() {
                return Err(KernelAllocError::DeviceMismatch {
                    what: format!("lane {o}: device top {top}, mirror holds {}", lane.len()),
                });
            }
            let base = usize::from(o) * self.lane_cap as usize;
            let dev = &stacks[base..base + lane.len()];
            if let Some(k) = (0..lane.len()).find(|&k| dev[k] != lane[k].0) {
                return Err(KernelAllocError::DeviceMismatch {
                    what: format!(
                        "lane {o} slot {k}: device page {}, mirror {}",
                        dev[k], lane[k]
                    ),
                });
            }
        }
        Ok(())
    }

    fn read_u32(&self, buffer: BufferId, n: usize) -> Result<Vec<u32>, ExecError> {
        let mut bytes = vec![0u8; 4 * n];
        self.exec.read(buffer, 0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    fn kernel_run(&self, run: PageRun) -> KernelRun {
        let n = run.len() as u64;
        KernelRun {
            pages: DeviceSlice {
                buffer: self.out_pages.id,
                offset: 0,
                len: n,
            },
            run,
        }
    }

    fn launch_select(&mut self, owners: &[u8]) -> Result<(), ExecError> {
        if owners.is_empty() {
            return Ok(());
        }
        let ex = self.exec.as_ref();
        let n = owners.len();
        self.owners_in.ensure(ex, n)?;
        self.out_pages.ensure(ex, 4 * n)?;
        ex.upload(self.owners_in.id, 0, owners)?;
        let d = self.select.0.launch_dims(n as u32, 1);
        ex.launch(
            self.select.1,
            &LaunchConfig::linear(d.grid, d.block),
            &[
                KernelArg::Ptr(self.owners_in.id, 0),
                KernelArg::U32(n as u32),
                KernelArg::Ptr(self.stacks, 0),
                KernelArg::Ptr(self.tops, 0),
                KernelArg::U32(self.lane_cap),
                KernelArg::Ptr(self.out_pages.id, 0),
                KernelArg::Ptr(self.status, 0),
            ],
        )
    }

    fn launch_release(&mut self, pages: &[PageId]) -> Result<(), ExecError> {
        if pages.is_empty() {
            return Ok(());
        }
        let ex = self.exec.as_ref();
        let n = pages.len();
        self.pages_in.ensure(ex, 4 * n)?;
        let bytes: Vec<u8> = pages.iter().flat_map(|p| p.0.to_le_bytes()).collect();
        ex.upload(self.pages_in.id, 0, &bytes)?;
        let d = self.release.0.launch_dims(n as u32, 1);
        ex.launch(
            self.release.1,
            &LaunchConfig::linear(d.grid, d.block),
            &[
                KernelArg::Ptr(self.pages_in.id, 0),
                KernelArg::U32(n as u32),
                KernelArg::Ptr(self.stacks, 0),
                KernelArg::Ptr(self.tops, 0),
                KernelArg::U32(self.lane_cap),
                KernelArg::Ptr(self.status, self.release_status_offset()),
            ],
        )
    }

    /// Uploads the mirror's stacks and tops (no read back).
    fn upload_state(&self) -> Result<(), ExecError> {
        let cp = self.layout().cp();
        let cap = self.lane_cap as usize;
        let mut stacks = vec![0u32; usize::from(cp) * cap];
        let mut tops = Vec::with_capacity(usize::from(cp));
        for o in 0..cp {
            let lane = self.mirror.lane_stack(Rank(o));
            let base = usize::from(o) * cap;
            for (slot, p) in stacks[base..base + lane.len()].iter_mut().zip(lane) {
                *slot = p.0;
            }
            tops.push(lane.len() as u32);
        }
        let le = |v: &[u32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        self.exec.upload(self.stacks, 0, &le(&stacks))?;
        self.exec.upload(self.tops, 0, &le(&tops))
    }

    /// Rolls the allocator back to `mirror` (an earlier state of this allocator, e.g. a
    /// snapshot taken before a request that failed) and re-uploads it to the device lanes,
    /// and clears the select and release kernels' status (the lanes are a known state
    /// again).
    /// A successful restore also heals a broken allocator; a failed upload leaves it broken.
    pub fn restore(&mut self, mirror: OwnerLaneAllocator) -> Result<(), KernelAllocError> {
        if mirror.layout() != self.mirror.layout() {
            return Err(KernelAllocError::LayoutMismatch {
                ours: *self.mirror.layout(),
                theirs: *mirror.layout(),
            });
        }
        self.mirror = mirror;
        let clear = vec![0u8; 4 * status_words(self.layout().cp())];
        if let Err(e) = self
            .upload_state()
            .and_then(|()| self.exec.upload(self.status, 0, &clear))
        {
            self.broken = Some(format!("restoring a state failed: {e}"));
            return Err(e.into());
        }
        self.broken = None;
        Ok(())
    }

    /// After a failed launch the device lanes are unspecified: re-upload the mirror. If that
    /// fails as well, the allocator is marked broken.
    fn restore_device(&mut self, cause: &ExecError) {
        if let Err(e) = self.upload_state() {
            tracing::error!(
                target: "cp_hicache::allocator",
                %cause,
                error = %e,
                "could not restore the device lanes after a failed launch"
            );
            self.broken = Some(format!(
                "after `{cause}`, re-uploading the lanes failed: {e}"
            ));
        }
    }
}

/// Words of an allocator's status buffer: the select kernel's, then the release kernel's.
fn status_words(cp: u8) -> usize {
    SelectStatus::words(cp) + ReleaseStatus::words(cp)
}

/// Byte offset of the release kernel's words in an allocator's status buffer.
fn release_status_offset(cp: u8) -> u64 {
    4 * SelectStatus::words(cp) as u64
}

/// Reports an undo that failed after a failed launch (only a debug invariant check can fail
/// it); the launch error stays the one returned.
fn log_failed_undo(undo: Result<(), AllocError>, cause: &ExecError) {
    if let Err(e) = undo {
        tracing::error!(
            target: "cp_hicache::allocator",
            %cause,
            error = %e,
            "could not undo an allocator operation after its launch failed"
        );
    }
}

impl Drop for KernelLaneAllocator {
    fn drop(&mut self) {
        for b in [
            self.stacks,
            self.tops,
            self.status,
            self.owners_in.id,
            self.pages_in.id,
            self.out_pages.id,
        ] {
            // Nothing useful can be done about a failed free while dropping.
            let _ = self.exec.free(b);
        }
    }
}
