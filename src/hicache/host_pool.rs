//! One rank's host page pool: which host page slots are free.
//!
//! It is the owner-lane allocator with a single lane (CP = 1), so it inherits the same
//! determinism, all-or-nothing allocation, double-free detection and state digest. Host
//! page `h` is the allocator's page `h + 1`, since the allocator reserves page 0.

use crate::allocator::{AllocError, OwnerLaneAllocator, StateDigest};
use crate::layout::{CpLayout, LayoutError, PageId};
use crate::metadata::HostPage;

/// Free host pages of one rank.
#[derive(Clone, Debug)]
pub struct HostPagePool {
    slots: OwnerLaneAllocator,
    capacity: u32,
}

impl HostPagePool {
    /// A pool of `capacity` host pages, all free.
    pub fn new(capacity: u32) -> Result<Self, LayoutError> {
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
        Ok(HostPagePool { slots, capacity })
    }

    /// Host pages in the pool.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Free host pages.
    pub fn free_count(&self) -> u32 {
        self.slots.lane_free_counts()[0]
    }

    /// Takes `n` host pages, or none: a shortage is [`AllocError::OutOfPages`].
    pub fn alloc(&mut self, n: usize) -> Result<Vec<HostPage>, AllocError> {
        Ok(self
            .slots
            .alloc_pages(n)?
            .pages()
            .iter()
            .map(|p| HostPage(p.0 - 1))
            .collect())
    }

    /// Returns host pages; a double or foreign free is an error and frees nothing.
    pub fn free(&mut self, pages: &[HostPage]) -> Result<(), AllocError> {
        let ids: Vec<PageId> = pages
            .iter()
            .map(|h| {
                if h.0 >= self.capacity {
                    PageId(u32::MAX)
                } else {
                    PageId(h.0 + 1)
                }
            })
            .collect();
        self.slots.free(&ids)
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
        let mut p = HostPagePool::new(3).unwrap();
        let a = p.alloc(2).unwrap();
        assert_eq!(a, vec![HostPage(0), HostPage(1)]);
        assert!(p.alloc(2).unwrap_err().is_shortage());
        assert_eq!(p.free_count(), 1);
        assert!(p.free(&[HostPage(7)]).is_err());
        p.free(&a).unwrap();
        assert!(p.free(&a[..1]).is_err());
        assert_eq!(p.free_count(), 3);
    }

    #[test]
    fn empty_pool_is_legal() {
        let mut p = HostPagePool::new(0).unwrap();
        assert_eq!(p.free_count(), 0);
        assert!(p.alloc(1).is_err());
        assert_eq!(p.alloc(0).unwrap(), vec![]);
    }
}
