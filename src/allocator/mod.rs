//! The owner-lane page allocator: one free stack ("lane") per CP rank, so that pages can be
//! handed out with an exact owner sequence.
//!
//! `alloc_pages_with_owners` is the only way the load path gets pages: it returns pages whose
//! owners equal the requested sequence, in input order, or nothing at all. Plain
//! `alloc_pages` exists for CP = 1 and callers without an owner pattern; using it on the load
//! path is the seed's bug.
//!
//! Every rank keeps a replica; replicas see the same calls and must stay identical, so the
//! allocator is deterministic and exposes a [`StateDigest`]. The pop/push order is the one
//! pinned in `docs/KERNELS.md`, so this host implementation is the oracle of the select and
//! release kernels. Success is decided from the per-lane counts alone, as the kernel-backed
//! version must do without reading device memory.

pub mod kernel;

pub use kernel::{
    BufferSizes, DeviceSlice, KernelAllocError, KernelAllocOptions, KernelLaneAllocator, KernelRun,
};

use crate::layout::{CpLayout, PageId, Rank, TokenLoc};
use sha2::{Digest, Sha256};
use std::fmt;

/// Env var that turns on the invariant check of every operation (see
/// [`OwnerLaneAllocator::set_debug_checks`]).
pub const DEBUG_ENV: &str = "CP_HICACHE_DEBUG_ALLOC";

/// Why an allocator call failed. On every error the allocator is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    /// Some lanes lack pages for the requested owner sequence; `deficit[o]` is how many pages
    /// lane `o` is short. Nothing was allocated.
    #[error("owner lanes are short of pages (deficit per lane: {deficit:?})")]
    LanesShort {
        /// Pages missing per lane.
        deficit: Vec<u32>,
    },
    /// Fewer free pages in all lanes together than requested.
    #[error("{requested} pages requested but only {free} are free")]
    OutOfPages {
        /// Pages requested.
        requested: usize,
        /// Pages free across all lanes.
        free: usize,
    },
    /// A requested owner is not a rank of the layout.
    #[error("owner {owner} at position {index} is out of range for CP {cp}")]
    OwnerOutOfRange {
        /// Position in the request.
        index: usize,
        /// The rejected owner.
        owner: u8,
        /// CP degree.
        cp: u8,
    },
    /// Freeing the null page.
    #[error("the null page cannot be freed")]
    NullPage,
    /// Freeing a page outside the layout.
    #[error("{page} does not belong to this allocator ({pages} pages)")]
    Foreign {
        /// The rejected page.
        page: PageId,
        /// Pages in the layout.
        pages: u32,
    },
    /// Freeing a page that is not allocated (already free, or twice in one call).
    #[error("double free of {page}")]
    DoubleFree {
        /// The page.
        page: PageId,
    },
    /// The debug invariant check found a corrupted state. The check runs on the state the
    /// operation would leave, before it is committed: the operation was not applied (a state
    /// corrupted before the call stays as it was).
    #[error("allocator invariant violated: {what}")]
    Invariant {
        /// Description of the violation.
        what: String,
    },
}

impl AllocError {
    /// Whether this is a shortage (recoverable by eviction) rather than a misuse.
    pub fn is_shortage(&self) -> bool {
        matches!(
            self,
            AllocError::LanesShort { .. } | AllocError::OutOfPages { .. }
        )
    }
}

/// A SHA-256 digest of a replica's state; equal digests mean identical replicas.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct StateDigest(pub [u8; 32]);

impl fmt::Display for StateDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0[..8]))
    }
}

impl fmt::Debug for StateDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "StateDigest({})", hex::encode(self.0))
    }
}

/// Pages handed out by one allocation, in request order; their token locations are
/// page-contiguous.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageRun {
    pages: Vec<PageId>,
    page_size: u32,
}

impl PageRun {
    /// The pages, in request order.
    pub fn pages(&self) -> &[PageId] {
        &self.pages
    }

    /// Consumes the run, returning its pages.
    pub fn into_pages(self) -> Vec<PageId> {
        self.pages
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether the run has no pages.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Token locations of every slot, page after page.
    pub fn locs(&self) -> impl Iterator<Item = TokenLoc> + '_ {
        let ps = u64::from(self.page_size);
        self.pages
            .iter()
            .flat_map(move |p| (0..ps).map(move |o| TokenLoc(u64::from(p.0) * ps + o)))
    }
}

/// One rank's replica of the owner-lane allocator.
#[derive(Clone, Debug)]
pub struct OwnerLaneAllocator {
    layout: CpLayout,
    /// Lane `o`'s free stack; the top is the end. Fresh lanes are descending so first pops
    /// return ascending pages.
    lanes: Vec<Vec<PageId>>,
    /// One bit per page: allocated. Lets `free` reject double and foreign frees.
    allocated: Vec<u64>,
    debug_checks: bool,
}

/// Whether `CP_HICACHE_DEBUG_ALLOC` turns the invariant checks on. A value that is neither on
/// nor off turns them on (the safe side) and says so once.
fn debug_checks_from_env() -> bool {
    let Ok(v) = std::env::var(DEBUG_ENV) else {
        return false;
    };
    crate::env::parse_switch(&v).unwrap_or_else(|| {
        static WARNED: std::sync::Once = std::sync::Once::new();
        WARNED.call_once(|| {
            tracing::warn!(
                target: "cp_hicache::allocator",
                "{DEBUG_ENV}={v:?} is neither on (1, on, true, yes) nor off (0, off, false, no): checks on"
            );
        });
        true
    })
}

impl OwnerLaneAllocator {
    /// A fresh allocator with every non-null page free. Invariant checks are on when
    /// `CP_HICACHE_DEBUG_ALLOC` is on (`1`, `on`, `true`, `yes`).
    pub fn new(layout: CpLayout) -> Self {
        let lanes = (0..layout.cp())
            .map(|r| layout.lane_pages(Rank(r)).rev().collect())
            .collect();
        let debug_checks = debug_checks_from_env();
        OwnerLaneAllocator {
            layout,
            lanes,
            allocated: vec![0; (layout.pages() as usize).div_ceil(64)],
            debug_checks,
        }
    }

    /// The layout this allocator manages.
    pub fn layout(&self) -> &CpLayout {
        &self.layout
    }

    /// Turns the invariant check of every operation on or off. When on, each allocation and
    /// free is applied to a copy whose invariants ([`check_invariants`](Self::check_invariants))
    /// are checked before the copy replaces the allocator, so a violation is reported as
    /// [`AllocError::Invariant`] with the allocator unchanged, never half-applied. This costs
    /// a copy and a full check per operation (tests and debugging only).
    pub fn set_debug_checks(&mut self, on: bool) {
        self.debug_checks = on;
    }

    /// Free pages per lane.
    pub fn lane_free_counts(&self) -> Vec<u32> {
        self.lanes.iter().map(|l| l.len() as u32).collect()
    }

    /// The free stack of lane `rank`, bottom first (the next page popped is the last). The
    /// kernel-backed allocator keeps exactly this stack in device memory. Empty for a rank
    /// outside the layout.
    pub fn lane_stack(&self, rank: Rank) -> &[PageId] {
        self.lanes
            .get(usize::from(rank.0))
            .map_or(&[], Vec::as_slice)
    }

    /// Free pages over all lanes.
    pub fn free_pages(&self) -> usize {
        self.lanes.iter().map(Vec::len).sum()
    }

    /// Allocated pages per lane.
    pub fn lane_used_counts(&self) -> Vec<u32> {
        (0..self.layout.cp())
            .map(|r| self.layout.lane_capacity(Rank(r)) - self.lanes[usize::from(r)].len() as u32)
            .collect()
    }

    /// How many pages each lane lacks to serve `owners` (all zero when it would succeed).
    pub fn deficit(&self, owners: &[u8]) -> Result<Vec<u32>, AllocError> {
        let need = self.count_owners(owners)?;
        Ok(need
            .iter()
            .zip(&self.lanes)
            .map(|(&n, lane)| n.saturating_sub(lane.len() as u32))
            .collect())
    }

    /// Allocates pages whose owners equal `owners`, in input order. All or nothing: on a
    /// shortage it returns [`AllocError::LanesShort`] with the deficit and changes nothing.
    pub fn alloc_pages_with_owners(&mut self, owners: &[u8]) -> Result<PageRun, AllocError> {
        let deficit = self.deficit(owners)?;
        if deficit.iter().any(|&d| d > 0) {
            return Err(AllocError::LanesShort { deficit });
        }
        // Within one call the k-th request of owner o takes lane[top - 1 - k]: plain pops.
        let pages = self.commit(|a| {
            owners
                .iter()
                .map(|&o| {
                    let page = a.lanes[usize::from(o)]
                        .pop()
                        .expect("deficit check guarantees a free page");
                    a.set_allocated(page, true);
                    page
                })
                .collect()
        })?;
        Ok(PageRun {
            pages,
            page_size: self.layout.page_size(),
        })
    }

    /// Allocates `n` pages from any lanes, for CP = 1 or callers without an owner pattern.
    /// Each page comes from the lane with the most free pages left (ties: lowest rank), which
    /// keeps lanes balanced and the choice deterministic.
    pub fn alloc_pages(&mut self, n: usize) -> Result<PageRun, AllocError> {
        let owners = self.plain_owners(n)?;
        self.alloc_pages_with_owners(&owners)
    }

    /// The owner sequence [`alloc_pages`](Self::alloc_pages) would request for `n` pages, so a
    /// kernel-backed replica can launch exactly the same selection. Changes nothing.
    pub fn plain_owners(&self, n: usize) -> Result<Vec<u8>, AllocError> {
        let free = self.free_pages();
        if n > free {
            return Err(AllocError::OutOfPages { requested: n, free });
        }
        let mut left = self.lane_free_counts();
        Ok((0..n)
            .map(|_| {
                let (o, _) = left
                    .iter()
                    .enumerate()
                    .rev()
                    .max_by_key(|(_, &c)| c)
                    .expect("cp >= 1");
                left[o] -= 1;
                o as u8
            })
            .collect())
    }

    /// Returns pages to their own lanes, pushed in input order. All or nothing: the null page,
    /// a page outside the layout, or a page not allocated (including twice in one call) is
    /// an error and nothing is freed.
    pub fn free(&mut self, pages: &[PageId]) -> Result<(), AllocError> {
        // Each page's bit is cleared as it is checked, so a page repeated in the call reads
        // as free the second time; then every cleared bit is set back. Costs the call's
        // length, not the bitmap's (which a copy of it would).
        let mut checked = 0;
        let mut refused = None;
        for &page in pages {
            if let Err(e) = self.check_allocated(page) {
                refused = Some(e);
                break;
            }
            self.set_allocated(page, false);
            checked += 1;
        }
        for &page in &pages[..checked] {
            self.set_allocated(page, true);
        }
        if let Some(e) = refused {
            return Err(e);
        }
        self.commit(|a| {
            for &page in pages {
                a.set_allocated(page, false);
                a.lanes[usize::from(a.layout.owner(page).0)].push(page);
            }
        })
    }

    /// Why `page` cannot be freed now, if it cannot.
    fn check_allocated(&self, page: PageId) -> Result<(), AllocError> {
        if page == PageId::NULL {
            return Err(AllocError::NullPage);
        }
        if page.0 >= self.layout.pages() {
            return Err(AllocError::Foreign {
                page,
                pages: self.layout.pages(),
            });
        }
        if !self.is_allocated(page) {
            return Err(AllocError::DoubleFree { page });
        }
        Ok(())
    }

    /// Whether `page` is currently allocated.
    pub fn is_allocated(&self, page: PageId) -> bool {
        if page.0 >= self.layout.pages() {
            return false;
        }
        let (word, bit) = bit_of(page);
        self.allocated[word] & bit != 0
    }

    /// Digest of the complete state: layout, every lane's stack in order, and the allocated
    /// set. Replicas that saw the same calls have equal digests.
    pub fn digest(&self) -> StateDigest {
        let mut h = Sha256::new();
        h.update([self.layout.cp()]);
        h.update(self.layout.page_size().to_le_bytes());
        h.update(self.layout.pages().to_le_bytes());
        for lane in &self.lanes {
            h.update((lane.len() as u32).to_le_bytes());
            for p in lane {
                h.update(p.0.to_le_bytes());
            }
        }
        for w in &self.allocated {
            h.update(w.to_le_bytes());
        }
        StateDigest(h.finalize().into())
    }

    /// Verifies lane membership, that no page is both free and allocated or free twice, that
    /// the null page is never free, and conservation (free + used = capacity per lane).
    pub fn check_invariants(&self) -> Result<(), AllocError> {
        let mut free = vec![false; self.layout.pages() as usize];
        for (o, lane) in self.lanes.iter().enumerate() {
            for &p in lane {
                if !self.layout.in_lane(p, Rank(o as u8)) {
                    return Err(invariant(format!("{p} is in lane {o} but not of it")));
                }
                if std::mem::replace(&mut free[p.0 as usize], true) {
                    return Err(invariant(format!("{p} is free twice")));
                }
                if self.is_allocated(p) {
                    return Err(invariant(format!("{p} is both free and allocated")));
                }
            }
        }
        if self.is_allocated(PageId::NULL) {
            return Err(invariant("the null page is allocated".into()));
        }
        for r in 0..self.layout.cp() {
            let cap = self.layout.lane_capacity(Rank(r)) as usize;
            let used = self
                .layout
                .lane_pages(Rank(r))
                .filter(|&p| self.is_allocated(p))
                .count();
            let free_n = self.lanes[usize::from(r)].len();
            if used + free_n != cap {
                return Err(invariant(format!(
                    "lane {r}: {free_n} free + {used} used != capacity {cap}"
                )));
            }
        }
        if self.layout.granule() > 1 {
            // Allocations and frees are whole aligned groups, so every lane holds the same
            // groups in the same order: popping one page per lane gives an aligned group.
            let lane0 = &self.lanes[0];
            for (r, lane) in self.lanes.iter().enumerate().skip(1) {
                let lockstep = lane.len() == lane0.len()
                    && lane.iter().zip(lane0).all(|(p, q)| p.0 == q.0 + r as u32);
                if !lockstep {
                    return Err(invariant(format!(
                        "lane {r} is out of lockstep with lane 0: its free pages are not the \
                         same groups in the same order"
                    )));
                }
            }
        }
        Ok(())
    }

    fn count_owners(&self, owners: &[u8]) -> Result<Vec<u32>, AllocError> {
        let cp = self.layout.cp();
        let mut need = vec![0u32; usize::from(cp)];
        for (index, &owner) in owners.iter().enumerate() {
            if owner >= cp {
                return Err(AllocError::OwnerOutOfRange { index, owner, cp });
            }
            // Saturating: a request for 2^32 pages of one lane is short (no lane holds that
            // many), never a wrapped count that makes it look satisfiable.
            need[usize::from(owner)] = need[usize::from(owner)].saturating_add(1);
        }
        Ok(need)
    }

    fn set_allocated(&mut self, page: PageId, on: bool) {
        let (word, bit) = bit_of(page);
        if on {
            self.allocated[word] |= bit;
        } else {
            self.allocated[word] &= !bit;
        }
    }

    /// Applies `op`, an infallible mutation (callers validate before). With debug checks on,
    /// `op` runs on a copy whose invariants are checked before it replaces `self`, so a
    /// violation leaves `self` unchanged.
    fn commit<T>(&mut self, op: impl FnOnce(&mut Self) -> T) -> Result<T, AllocError> {
        if !self.debug_checks {
            return Ok(op(self));
        }
        let mut next = self.clone();
        let out = op(&mut next);
        next.check_invariants()?;
        *self = next;
        Ok(out)
    }
}

fn bit_of(page: PageId) -> (usize, u64) {
    ((page.0 / 64) as usize, 1u64 << (page.0 % 64))
}

fn invariant(what: String) -> AllocError {
    AllocError::Invariant { what }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::zigzag_owners;

    fn alloc(cp: u32, pages: u32) -> OwnerLaneAllocator {
        let mut a = OwnerLaneAllocator::new(CpLayout::new(cp, 4, pages).unwrap());
        a.set_debug_checks(true);
        a
    }

    #[test]
    fn preserves_owner_order_and_pops_ascending() {
        let mut a = alloc(2, 11);
        let run = a.alloc_pages_with_owners(&[1, 0, 0, 1]).unwrap();
        assert_eq!(
            run.pages(),
            &[PageId(1), PageId(2), PageId(4), PageId(3)][..]
        );
        assert_eq!(
            run.locs().take(5).map(|l| l.0).collect::<Vec<_>>(),
            vec![4, 5, 6, 7, 8]
        );
        assert_eq!(a.lane_free_counts(), vec![3, 3]);
    }

    #[test]
    fn all_or_nothing_on_shortage() {
        let mut a = alloc(2, 7); // lane 0: 2,4,6 ; lane 1: 1,3,5
        let before = a.digest();
        let err = a.alloc_pages_with_owners(&[0, 0, 0, 0, 1]).unwrap_err();
        assert_eq!(
            err,
            AllocError::LanesShort {
                deficit: vec![1, 0]
            }
        );
        assert!(err.is_shortage());
        assert_eq!(a.digest(), before);
        assert!(a.alloc_pages_with_owners(&zigzag_owners(2, 6)).is_ok());
        assert_eq!(a.lane_free_counts(), vec![0, 0]);
    }

    #[test]
    fn free_rejects_misuse_atomically() {
        let mut a = alloc(2, 9);
        let run = a.alloc_pages(3).unwrap();
        let before = a.digest();
        assert_eq!(a.free(&[PageId::NULL]), Err(AllocError::NullPage));
        assert!(matches!(
            a.free(&[PageId(99)]),
            Err(AllocError::Foreign { .. })
        ));
        let p = run.pages()[0];
        assert_eq!(a.free(&[p, p]), Err(AllocError::DoubleFree { page: p }));
        assert_eq!(a.digest(), before);
        a.free(run.pages()).unwrap();
        assert_eq!(a.free(&[p]), Err(AllocError::DoubleFree { page: p }));
        assert_eq!(a.lane_free_counts(), vec![4, 4]);
    }

    #[test]
    fn plain_alloc_balances_lanes() {
        let mut a = alloc(3, 13);
        let run = a.alloc_pages(6).unwrap();
        assert_eq!(a.lane_free_counts(), vec![2, 2, 2]);
        assert_eq!(run.len(), 6);
        assert!(matches!(
            a.alloc_pages(7),
            Err(AllocError::OutOfPages {
                requested: 7,
                free: 6
            })
        ));
    }

    /// With debug checks on, an operation that would leave a corrupted state reports the
    /// violation and is not applied: the allocator is exactly as before the call.
    #[test]
    fn debug_check_reports_without_applying_the_operation() {
        let mut a = alloc(2, 11); // lane 0: 2,4,6,8,10 ; lane 1: 1,3,5,7,9
        let run = a.alloc_pages_with_owners(&[0, 1]).unwrap();
        // Test-only corruption, at the bottom of lane 0 where the operations below do not
        // reach: a page of lane 1, already free there.
        a.lanes[0].insert(0, PageId(9));
        assert!(matches!(
            a.check_invariants(),
            Err(AllocError::Invariant { .. })
        ));
        let before = a.digest();
        let err = a.alloc_pages_with_owners(&[0, 1, 1]).unwrap_err();
        assert!(matches!(err, AllocError::Invariant { .. }), "{err}");
        assert_eq!(a.digest(), before, "the allocation was applied");
        let err = a.free(run.pages()).unwrap_err();
        assert!(matches!(err, AllocError::Invariant { .. }), "{err}");
        assert_eq!(a.digest(), before, "the free was applied");
        assert!(run.pages().iter().all(|&p| a.is_allocated(p)));
        // The misuse checks still come first, and without debug checks both operations run.
        assert_eq!(
            a.free(&[PageId::NULL]),
            Err(AllocError::NullPage),
            "misuse is reported as such"
        );
        a.set_debug_checks(false);
        a.free(run.pages()).unwrap();
        assert_eq!(a.lane_free_counts(), vec![6, 5]);
    }

    #[test]
    fn bad_owner_is_an_error_not_a_shortage() {
        let mut a = alloc(2, 9);
        let err = a.alloc_pages_with_owners(&[0, 2]).unwrap_err();
        assert!(matches!(err, AllocError::OwnerOutOfRange { index: 1, .. }));
        assert!(!err.is_shortage());
    }
}
