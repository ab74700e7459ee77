//! One rank's host page pool: which host page slots are free.
//!
//! It is the owner-lane allocator with a single lane (CP = 1), so it inherits the same
//! determinism, all-or-nothing allocation, double-free detection and state digest. Host
//! page `h` is the allocator's page `h + 1`, since the allocator reserves page 0.

use crate::allocator::{AllocError, OwnerLaneAllocator, StateDigest};
use crate::layout::{CpLayout, LayoutError, PageId, Rank};
use crate::metadata::HostPage;

/// Why a host pool call failed, in host page numbers (not the slot allocator's page ids).
/// On every error the pool is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostPoolError {
    /// Fewer free host pages than requested.
    #[error("{rank}: {requested} host pages requested but only {free} are free")]
    Short {
        /// The pool's rank.
        rank: Rank,
        /// Pages requested.
        requested: usize,
        /// Pages free.
        free: u32,
    },
    /// Freeing a host page outside the pool.
    #[error("{rank}: host page {} is not in the pool of {capacity} host pages", page.0)]
    Foreign {
        /// The pool's rank.
        rank: Rank,
        /// The rejected host page.
        page: HostPage,
        /// Host pages in the pool.
        capacity: u32,
    },
    /// Freeing a host page that is not allocated (already free, or twice in one call).
    #[error("{rank}: double free of host page {}", page.0)]
    DoubleFree {
        /// The pool's rank.
        rank: Rank,
        /// The host page.
        page: HostPage,
    },
    /// Any other refusal of the underlying slot allocator (an invariant check).
    #[error("{rank}: host pool: {source}")]
    Slots {
        /// The pool's rank.
        rank: Rank,
        /// The slot allocator's error.
        source: AllocError,
    },
}

impl HostPoolError {
    /// Whether this is a shortage rather than a misuse.
    pub fn is_shortage(&self) -> bool {
        matches!(self, HostPoolError::Short { .. })
    }
}

/// Free host pages of one rank.
#[derive(Clone, Debug)]
pub struct HostPagePool {
    slots: OwnerLaneAllocator,
    capacity: u32,
    rank: Rank,
}

impl HostPagePool {
    /// A pool of `capacity` host pages of `rank`, all free.
    pub fn new(rank: Rank, capacity: u32) -> Result<Self, LayoutError> {
        let pages = capacity.checked_add(1).ok_or(LayoutError::TooManyTokens {
            pages: capacity,
            page_size: 1,
        })?;
        // A pool with zero pages is legal (backups are then always skipped); the layout
        // needs two pages, so keep the spare one permanently allocated.
        let mut slots = OwnerLaneAllocator::new(CpLayout::new(1, 1, pages.max(2))?);
        if capacity == 0 {
            slots
                .alloc_pages(1)
                .expect("a two-page single-lane layout has one free page");
        }
        Ok(HostPagePool {
            slots,
            capacity,
            rank,
        })
    }

    /// Host pages in the pool.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Free host pages.
    pub fn free_count(&self) -> u32 {
        self.slots.lane_free_counts()[0]
    }

    /// Takes `n` host pages, or none: a shortage is [`HostPoolError::Short`].
    pub fn alloc(&mut self, n: usize) -> Result<Vec<HostPage>, HostPoolError> {
        match self.slots.alloc_pages(n) {
            Ok(run) => Ok(run.pages().iter().map(|p| HostPage(p.0 - 1)).collect()),
            Err(e) if e.is_shortage() => Err(HostPoolError::Short {
                rank: self.rank,
                requested: n,
                free: self.free_count(),
            }),
            Err(source) => Err(self.slots_error(source)),
        }
    }

    /// Returns host pages; a double or foreign free is an error (naming the host page) and
    /// frees nothing.
    pub fn free(&mut self, pages: &[HostPage]) -> Result<(), HostPoolError> {
        if let Some(&page) = pages.iter().find(|h| h.0 >= self.capacity) {
            return Err(HostPoolError::Foreign {
                rank: self.rank,
                page,
                capacity: self.capacity,
            });
        }
        // In range, so `h + 1` cannot overflow and is a page of the slot layout.
        let ids: Vec<PageId> = pages.iter().map(|h| PageId(h.0 + 1)).collect();
        self.slots.free(&ids).map_err(|e| match e {
            AllocError::DoubleFree { page } => HostPoolError::DoubleFree {
                rank: self.rank,
                page: HostPage(page.0 - 1),
            },
            other => self.slots_error(other),
        })
    }

    fn slots_error(&self, source: AllocError) -> HostPoolError {
        HostPoolError::Slots {
            rank: self.rank,
            source,
        }
    }

    /// Whether host page `page` is currently handed out, so invariant checks can prove that
    /// every host page a tree references is really held.
    pub fn is_allocated(&self, page: HostPage) -> bool {
        page.0 < self.capacity && self.slots.is_allocated(PageId(page.0 + 1))
    }

    /// Digest of the pool state, for replica agreement.
    pub fn digest(&self) -> StateDigest {
        self.slots.digest()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocates_frees_and_rejects_misuse() {
        let mut p = HostPagePool::new(Rank(3), 3).unwrap();
        let a = p.alloc(2).unwrap();
        assert_eq!(a, vec![HostPage(0), HostPage(1)]);
        let short = p.alloc(2).unwrap_err();
        assert!(short.is_shortage());
        assert_eq!(
            short.to_string(),
            "rank 3: 2 host pages requested but only 1 are free"
        );
        assert_eq!(p.free_count(), 1);
        assert_eq!(
            p.free(&[HostPage(7)]),
            Err(HostPoolError::Foreign {
                rank: Rank(3),
                page: HostPage(7),
                capacity: 3
            })
        );
        p.free(&a).unwrap();
        assert_eq!(
            p.free(&a[..1]),
            Err(HostPoolError::DoubleFree {
                rank: Rank(3),
                page: HostPage(0)
            })
        );
        assert_eq!(p.free_count(), 3);
    }

    #[test]
    fn errors_name_host_pages_not_slot_ids() {
        let mut p = HostPagePool::new(Rank(1), 8).unwrap();
        let a = p.alloc(6).unwrap();
        assert_eq!(a[5], HostPage(5));
        p.free(&a[5..]).unwrap();
        let err = p.free(&[HostPage(5)]).unwrap_err();
        assert_eq!(err.to_string(), "rank 1: double free of host page 5");
        // A repeated page within one call, after a valid one: nothing is freed.
        let err = p.free(&[HostPage(4), HostPage(4)]).unwrap_err();
        assert_eq!(err.to_string(), "rank 1: double free of host page 4");
        assert!(p.is_allocated(HostPage(4)));
        let err = p.free(&[HostPage(u32::MAX)]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "rank 1: host page 4294967295 is not in the pool of 8 host pages"
        );
        let err = p.free(&[HostPage(8)]).unwrap_err();
        assert!(
            err.to_string().contains("host page 8 is not in the pool"),
            "{err}"
        );
    }

    #[test]
    fn empty_pool_is_legal() {
        let mut p = HostPagePool::new(Rank(0), 0).unwrap();
        assert_eq!(p.free_count(), 0);
        assert!(p.alloc(1).is_err());
        assert_eq!(p.alloc(0).unwrap(), vec![]);
        assert!(matches!(
            p.free(&[HostPage(0)]),
            Err(HostPoolError::Foreign { .. })
        ));
    }
}
