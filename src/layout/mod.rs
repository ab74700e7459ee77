//! The CP page layout: which rank owns each logical page, where it lives in that rank's pool,
//! and ([`contract`]) which rank owns each token under the engines' layouts.
//!
//! Everything here is pure arithmetic. The newtypes exist because mixing a logical page with
//! a local page, or a rank with an owner index, is exactly the class of bug this crate was
//! written to make impossible (see the seed: bytes loaded into a page another rank owns).

use std::fmt;

pub mod contract;

pub use contract::{check_aligned_groups, Layout, LoadBack, Placement, LAYOUT_NAMES};

/// Largest supported CP degree (owners are stored as 4-bit values on disk).
pub const MAX_CP: u8 = 16;
/// Largest supported page size in tokens.
pub const MAX_PAGE_SIZE: u32 = 1024;

/// A logical page id, global across the CP group. Page 0 is the null (padding) page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PageId(pub u32);

/// A page index inside one rank's own device pool (`PageId / cp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LocalPage(pub u32);

/// A CP rank, `0..cp`. Also used as the owner of a page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank(pub u8);

/// A token location in the logical KV index space: `page * page_size + offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TokenLoc(pub u64);

impl PageId {
    /// The null page: padding, never allocated, never freed.
    pub const NULL: PageId = PageId(0);
}

impl fmt::Display for PageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "page {}", self.0)
    }
}

impl fmt::Display for Rank {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {}", self.0)
    }
}

/// Why a layout (or a value checked against one) was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// CP degree outside `1..=16`.
    #[error("CP degree {cp} is out of range: it must be between 1 and {MAX_CP}")]
    CpOutOfRange {
        /// The rejected degree.
        cp: u32,
    },
    /// Page size that is zero, not a power of two, or above the maximum.
    #[error(
        "page size {page_size} is invalid: it must be a power of two between 1 and {MAX_PAGE_SIZE}"
    )]
    BadPageSize {
        /// The rejected page size.
        page_size: u32,
    },
    /// Too few pages for every lane to hold at least one allocatable page.
    #[error("{pages} pages are too few for CP {cp}: need at least {min} (page 0 is the null page and every rank needs one page)")]
    TooFewPages {
        /// Requested page count.
        pages: u32,
        /// CP degree.
        cp: u8,
        /// The minimum that would work.
        min: u32,
    },
    /// The token space `pages * page_size` does not fit the 63-bit token locations kernels use.
    #[error("{pages} pages of {page_size} tokens overflow the token location space")]
    TooManyTokens {
        /// Requested page count.
        pages: u32,
        /// Page size.
        page_size: u32,
    },
    /// A page id at or beyond the layout's page count.
    #[error("{page} is out of range: the layout has {pages} pages")]
    PageOutOfRange {
        /// The rejected page.
        page: PageId,
        /// The layout's page count.
        pages: u32,
    },
    /// A rank at or beyond the CP degree.
    #[error("{rank} is out of range for CP {cp}")]
    RankOutOfRange {
        /// The rejected rank.
        rank: Rank,
        /// The CP degree.
        cp: u8,
    },
    /// A layout name that is not one of [`LAYOUT_NAMES`].
    #[error("unknown layout {name:?}: expected one of zigzag, round-robin, page-interleave, token-interleave")]
    UnknownLayout {
        /// The rejected name.
        name: String,
    },
    /// An interleave size given to a layout that has none.
    #[error("an interleave size ({size}) applies to token-interleave only, not to {layout}")]
    InterleaveSizeUnused {
        /// The layout named.
        layout: Layout,
        /// The size given.
        size: u32,
    },
    /// A token-interleave run that is not a power of two dividing the page.
    #[error("interleave size {size} is invalid: it must be a power of two no larger than the page size {page_size}")]
    BadInterleaveSize {
        /// The rejected size.
        size: u32,
        /// The page size it must divide.
        page_size: u32,
    },
    /// A granule that is neither one page nor one page per rank.
    #[error("a granule of {granule} pages is invalid for CP {cp}: it must be 1 or {cp}")]
    BadGranule {
        /// The rejected granule.
        granule: u32,
        /// The CP degree.
        cp: u8,
    },
    /// Pages (or a split) that do not respect a layout's granule.
    #[error("not aligned to the layout's granule: {what}")]
    Misaligned {
        /// What was misaligned.
        what: String,
    },
}

/// Zigzag owners for `n` pages (docs/DESIGN.md §2.1): `2C` chunks as equal as possible, the first
/// `n % 2C` chunks one page longer; chunk `k` belongs to rank `k` for `k < C`, else `2C-1-k`.
/// A `cp` of 0 is treated as 1.
pub fn zigzag_owners(cp: u8, n: usize) -> Vec<u8> {
    let cp = usize::from(cp.max(1));
    let chunks = 2 * cp;
    let (base, extra) = (n / chunks, n % chunks);
    let mut owners = Vec::with_capacity(n);
    for k in 0..chunks {
        let len = base + usize::from(k < extra);
        let rank = if k < cp { k } else { chunks - 1 - k };
        // `rank < cp <= 16`, so the cast is lossless.
        owners.extend(std::iter::repeat_n(rank as u8, len));
    }
    owners
}

/// Round-robin owners for `n` pages: page `i` belongs to rank `i % C`. A `cp` of 0 is
/// treated as 1.
pub fn round_robin_owners(cp: u8, n: usize) -> Vec<u8> {
    let cp = cp.max(1);
    (0..n).map(|i| (i % usize::from(cp)) as u8).collect()
}

/// The CP page layout of one deployment: CP degree, page size and logical page count.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpLayout {
    cp: u8,
    page_size: u32,
    pages: u32,
    /// Pages per granule: 1, or `cp` for the interleaved layouts, whose lanes then hold
    /// only whole aligned groups (group 0, which holds the null page, is never allocated).
    granule: u8,
}

impl CpLayout {
    /// Validated construction. Takes wide integers so hostile values (a CP of 300, say) are
    /// rejected with a clear error rather than truncated.
    pub fn new(cp: u32, page_size: u32, pages: u32) -> Result<Self, LayoutError> {
        if !(1..=u32::from(MAX_CP)).contains(&cp) {
            return Err(LayoutError::CpOutOfRange { cp });
        }
        let cp = cp as u8;
        if page_size == 0 || !page_size.is_power_of_two() || page_size > MAX_PAGE_SIZE {
            return Err(LayoutError::BadPageSize { page_size });
        }
        let min = Self::min_pages(cp);
        if pages < min {
            return Err(LayoutError::TooFewPages { pages, cp, min });
        }
        if u64::from(pages) * u64::from(page_size) > i64::MAX as u64 {
            return Err(LayoutError::TooManyTokens { pages, page_size });
        }
        Ok(CpLayout {
            cp,
            page_size,
            pages,
            granule: 1,
        })
    }

    /// This layout with allocations in granules of `granule` pages (1, or `cp`: aligned
    /// groups of one page per rank). A granule of `cp` needs at least two groups (group 0
    /// holds the null page and is never allocated); pages past the last whole group are
    /// never allocated either.
    pub fn with_granule(self, granule: u32) -> Result<Self, LayoutError> {
        if granule != 1 && granule != u32::from(self.cp) {
            return Err(LayoutError::BadGranule {
                granule,
                cp: self.cp,
            });
        }
        let min = if granule == 1 {
            Self::min_pages(self.cp)
        } else {
            2 * granule
        };
        if self.pages < min {
            return Err(LayoutError::TooFewPages {
                pages: self.pages,
                cp: self.cp,
                min,
            });
        }
        Ok(CpLayout {
            granule: granule as u8,
            ..self
        })
    }

    /// Pages per granule (1, or `cp` for the interleaved layouts).
    pub fn granule(&self) -> u32 {
        u32::from(self.granule)
    }

    /// The smallest page count for which every lane has an allocatable page: the null page
    /// plus one page per rank.
    pub fn min_pages(cp: u8) -> u32 {
        u32::from(cp) + 1
    }

    /// CP degree.
    pub fn cp(&self) -> u8 {
        self.cp
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// Logical page count, including the null page.
    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// `log2(page_size)`; kernels shift instead of dividing.
    pub fn page_shift(&self) -> u32 {
        self.page_size.trailing_zeros()
    }

    /// Owner rank of a logical page: `p % cp`.
    pub fn owner(&self, page: PageId) -> Rank {
        Rank((page.0 % u32::from(self.cp)) as u8)
    }

    /// Slot of a logical page inside its owner's pool: `p / cp`.
    pub fn local(&self, page: PageId) -> LocalPage {
        LocalPage(page.0 / u32::from(self.cp))
    }

    /// Inverse of (`owner`, `local`); `None` for a rank or local page this layout does not
    /// have, rather than some other rank's page.
    pub fn global(&self, rank: Rank, local: LocalPage) -> Option<PageId> {
        if rank.0 >= self.cp {
            return None;
        }
        local
            .0
            .checked_mul(u32::from(self.cp))
            .and_then(|p| p.checked_add(u32::from(rank.0)))
            .filter(|&p| p < self.pages)
            .map(PageId)
    }

    /// Local pages in each rank's device pool: `ceil(pages / cp)`. KV is sharded, not
    /// replicated.
    pub fn local_pages_per_rank(&self) -> u32 {
        self.pages.div_ceil(u32::from(self.cp))
    }

    /// Checks that a page id is a real page of this layout (the null page included).
    pub fn check_page(&self, page: PageId) -> Result<(), LayoutError> {
        if page.0 >= self.pages {
            return Err(LayoutError::PageOutOfRange {
                page,
                pages: self.pages,
            });
        }
        Ok(())
    }

    /// Checks that a rank exists in this layout.
    pub fn check_rank(&self, rank: Rank) -> Result<(), LayoutError> {
        if rank.0 >= self.cp {
            return Err(LayoutError::RankOutOfRange { rank, cp: self.cp });
        }
        Ok(())
    }

    /// Whether `page` belongs to the lane of `rank`: allocatable (not null), in range and
    /// owned by `rank`.
    pub fn in_lane(&self, page: PageId, rank: Rank) -> bool {
        page != PageId::NULL
            && page.0 >= self.lane_first(rank)
            && page.0 < self.lane_end()
            && self.owner(page) == rank
    }

    /// All allocatable pages of a lane, ascending; none for a rank this layout does not have.
    pub fn lane_pages(&self, rank: Rank) -> impl DoubleEndedIterator<Item = PageId> + '_ {
        let start = self.lane_first(rank);
        (start..self.lane_end())
            .step_by(usize::from(self.cp))
            .map(PageId)
    }

    /// Number of allocatable pages in a lane (0 for a rank this layout does not have).
    pub fn lane_capacity(&self, rank: Rank) -> u32 {
        let (first, end) = (self.lane_first(rank), self.lane_end());
        if first >= end {
            0
        } else {
            (end - first).div_ceil(u32::from(self.cp))
        }
    }

    /// One past the last allocatable page: every page, or the last whole group when
    /// allocations are in groups.
    fn lane_end(&self) -> u32 {
        if self.granule > 1 {
            self.pages - self.pages % u32::from(self.cp)
        } else {
            self.pages
        }
    }

    /// The lowest allocatable page of a lane (page 0 is the null page, so lane 0 starts at
    /// `cp`); `pages` (an empty lane) for a rank out of range.
    fn lane_first(&self, rank: Rank) -> u32 {
        match rank.0 {
            r if r >= self.cp => self.pages,
            r if r == 0 || self.granule > 1 => u32::from(self.cp) + u32::from(r),
            r => u32::from(r),
        }
    }

    /// The page holding a token location. A location beyond every 32-bit page maps to
    /// `PageId(u32::MAX)`, which no layout has, instead of wrapping onto a real page.
    pub fn page_of(&self, loc: TokenLoc) -> PageId {
        PageId(u32::try_from(loc.0 >> self.page_shift()).unwrap_or(u32::MAX))
    }

    /// The token location at `offset` inside `page`; `None` when the offset is not inside a
    /// page (it would name a slot of the next page).
    pub fn loc(&self, page: PageId, offset: u32) -> Option<TokenLoc> {
        (offset < self.page_size)
            .then(|| TokenLoc((u64::from(page.0) << self.page_shift()) | u64::from(offset)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zigzag_pins_small_cases() {
        // See issue 2: C=2, 5 pages: chunks sized 2,1,1,1.
        assert_eq!(zigzag_owners(2, 5), vec![0, 0, 1, 1, 0]);
        assert_eq!(zigzag_owners(2, 4), vec![0, 1, 1, 0]);
        assert_eq!(zigzag_owners(2, 8), vec![0, 0, 1, 1, 1, 1, 0, 0]);
        assert_eq!(zigzag_owners(4, 8), vec![0, 1, 2, 3, 3, 2, 1, 0]);
        assert_eq!(zigzag_owners(4, 3), vec![0, 1, 2]);
        assert_eq!(zigzag_owners(1, 3), vec![0, 0, 0]);
        assert_eq!(zigzag_owners(3, 0), Vec::<u8>::new());
        assert_eq!(zigzag_owners(3, 7), vec![0, 0, 1, 2, 2, 1, 0]);
    }

    #[test]
    fn round_robin_cycles() {
        assert_eq!(round_robin_owners(3, 7), vec![0, 1, 2, 0, 1, 2, 0]);
        assert_eq!(Layout::RoundRobin.owners(2, 5, 3), vec![0, 1, 0]);
    }

    #[test]
    fn grouped_lanes_hold_whole_groups_in_lockstep() {
        let l = CpLayout::new(3, 4, 14).unwrap().with_granule(3).unwrap();
        let lanes: Vec<Vec<u32>> = (0..3)
            .map(|r| l.lane_pages(Rank(r)).map(|p| p.0).collect())
            .collect();
        // Group 0 (the null page's) and pages 12, 13 (no whole group) are never allocated.
        assert_eq!(lanes, [vec![3, 6, 9], vec![4, 7, 10], vec![5, 8, 11]]);
        assert!((0..3).all(|r| l.lane_capacity(Rank(r)) == 3));
        assert!(!l.in_lane(PageId(1), Rank(1)));
        assert!(!l.in_lane(PageId(12), Rank(0)));
        assert!(CpLayout::new(3, 4, 5).unwrap().with_granule(3).is_err());
        assert!(CpLayout::new(3, 4, 6).unwrap().with_granule(2).is_err());
    }

    #[test]
    fn layout_rejects_hostile_values() {
        assert!(matches!(
            CpLayout::new(0, 64, 100),
            Err(LayoutError::CpOutOfRange { cp: 0 })
        ));
        assert!(CpLayout::new(17, 64, 100).is_err());
        assert!(CpLayout::new(u32::MAX, 64, 100).is_err());
        assert!(CpLayout::new(2, 0, 100).is_err());
        assert!(CpLayout::new(2, 48, 100).is_err());
        assert!(CpLayout::new(2, 2048, 100).is_err());
        assert!(matches!(
            CpLayout::new(8, 64, 8),
            Err(LayoutError::TooFewPages { min: 9, .. })
        ));
        assert!(CpLayout::new(8, 64, 9).is_ok());
        assert!(CpLayout::new(16, 1024, u32::MAX).is_ok());
    }

    #[test]
    fn owner_local_global_round_trip() {
        let l = CpLayout::new(3, 16, 20).unwrap();
        for p in 0..20 {
            let page = PageId(p);
            assert_eq!(l.global(l.owner(page), l.local(page)), Some(page));
            assert!(l.local(page).0 < l.local_pages_per_rank());
        }
        assert_eq!(l.local_pages_per_rank(), 7);
        // Page 20 would be rank 2's local 6: beyond the layout. Rank 3 does not exist.
        assert_eq!(l.global(Rank(2), LocalPage(6)), None);
        assert_eq!(l.global(Rank(3), LocalPage(0)), None);
        assert_eq!(l.global(Rank(1), LocalPage(u32::MAX)), None);
    }

    #[test]
    fn ranks_out_of_range_have_empty_lanes() {
        let l = CpLayout::new(4, 16, 64).unwrap();
        for r in [4u8, 5, 255] {
            assert_eq!(l.lane_pages(Rank(r)).count(), 0, "rank {r}");
            assert_eq!(l.lane_capacity(Rank(r)), 0, "rank {r}");
        }
    }

    #[test]
    fn lanes_partition_the_non_null_pages() {
        for cp in 1..=5u32 {
            for pages in (cp + 1)..(cp + 12) {
                let l = CpLayout::new(cp, 4, pages).unwrap();
                let mut seen = vec![false; pages as usize];
                for r in 0..cp as u8 {
                    let lane: Vec<_> = l.lane_pages(Rank(r)).collect();
                    assert_eq!(lane.len() as u32, l.lane_capacity(Rank(r)));
                    for p in lane {
                        assert!(l.in_lane(p, Rank(r)));
                        assert!(!seen[p.0 as usize]);
                        seen[p.0 as usize] = true;
                    }
                }
                assert!(!seen[0]);
                assert!(seen[1..].iter().all(|&s| s));
            }
        }
    }

    #[test]
    fn locs_and_owners() {
        let l = CpLayout::new(4, 4, 32).unwrap();
        let locs: Vec<_> = [5u32, 6, 8]
            .iter()
            .flat_map(|&p| (0..4).map(move |o| (p, o)))
            .map(|(p, o)| l.loc(PageId(p), o).unwrap())
            .collect();
        assert_eq!(l.page_of(locs[5]), PageId(6));
        assert_eq!(l.loc(PageId(5), 4), None, "offset 4 is page 6's first slot");
        assert_eq!(l.page_of(TokenLoc(u64::MAX)), PageId(u32::MAX));
        assert!(l.check_page(l.page_of(TokenLoc(1 << 40))).is_err());
    }
}
