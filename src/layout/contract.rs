//! The CP layout contract: which rank owns each token of a sequence, where in that rank's
//! pages it sits, what a load-back must preserve, and the granule that splits, matches and
//! allocations align to (docs/DESIGN.md §2.1).
//!
//! A sequence is a list of logical pages ([`PageId`]), page `p` owned by rank `p % cp`. The
//! layouts differ in how they choose those pages and fill them:
//!
//! | layout | owner of sequence page `i` | tokens of page `i` | granule |
//! |---|---|---|---|
//! | `zigzag` | chosen at allocation (zigzag), recorded | `i·ps ..` | 1 page |
//! | `round-robin` | chosen at allocation (`i % cp` from the first computed page), recorded | `i·ps ..` | 1 page |
//! | `page-interleave` | `i % cp` (positional) | `i·ps ..` | `cp` pages |
//! | `token-interleave(I)` | `i % cp` (positional) | every `cp`-th run of `I` tokens of its granule | `cp` pages |
//!
//! In the interleaved layouts a granule is a *logical page* of the engine: `cp` physical
//! pages, one per rank, allocated together as an aligned group (pages `g·cp .. g·cp + cp`),
//! so every rank's page of granule `g` is its local page `g`: SGLang's `PageShardSpec`
//! logical pages (`page-interleave`) and vLLM's block of `block_size × cp` tokens under
//! decode context parallelism (`token-interleave`, `I = cp_kv_cache_interleave_size`;
//! SGLang's NSA prefill split is `I = 1`). `page-interleave` is `token-interleave` with
//! `I = page_size`.
//!
//! Backing up always has one writer per page: the rank that owns it copies it into its own
//! host pool, whatever the layout. No page is ever written by two ranks.

use std::fmt;

use super::{LayoutError, PageId};

/// The CP layout of a deployment: how a sequence's tokens are spread over the ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub enum Layout {
    /// Pages of consecutive tokens; a request's computed pages go to `2C` near-equal
    /// chunks, chunk `k` owned by `k` for `k < C`, else `2C-1-k` (balances causal
    /// attention). Owners are recorded and restored on a load-back.
    #[default]
    Zigzag,
    /// Pages of consecutive tokens; computed page `i` (counted from the first computed page)
    /// owned by `i % C`. Owners are recorded and restored on a load-back.
    RoundRobin,
    /// SGLang's logical pages: granules of `C` pages, page `i` of the sequence owned by
    /// `i % C` and holding tokens `i·ps ..`.
    PageInterleave,
    /// vLLM's decode context parallelism: token `t` on rank `(t / size) % C`, each rank's
    /// pages holding only its own tokens, in order. `size` divides the page size.
    TokenInterleave {
        /// Tokens per run (vLLM's `cp_kv_cache_interleave_size`), a power of two.
        size: u32,
    },
}

/// What a load-back must preserve for a layout's pages to be read correctly.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadBack {
    /// Each page's recorded owner: the owners are a choice made at allocation, so a page
    /// loaded onto another rank is read from the wrong pool (the seed's bug).
    RecordedOwners,
    /// Nothing beyond the granule: ownership is positional (page `i` of a sequence is
    /// owned by `i % C`), so pages allocated as aligned groups have the right owners by
    /// construction. Loading a page onto the wrong rank still breaks it.
    Positional,
}

/// The layouts' names, as `--layout` and Python's `layout=` spell them.
pub const LAYOUT_NAMES: [&str; 4] = [
    "zigzag",
    "round-robin",
    "page-interleave",
    "token-interleave",
];

impl Layout {
    /// Parses a layout name (`-` or `_` between words) and, for `token-interleave`, its
    /// run size. A size given to another layout is refused rather than ignored.
    pub fn parse(name: &str, interleave_size: Option<u32>) -> Result<Layout, LayoutError> {
        let layout = match name.replace('_', "-").as_str() {
            "zigzag" => Layout::Zigzag,
            "round-robin" => Layout::RoundRobin,
            "page-interleave" => Layout::PageInterleave,
            "token-interleave" => {
                return Ok(Layout::TokenInterleave {
                    size: interleave_size.unwrap_or(1),
                })
            }
            _ => {
                return Err(LayoutError::UnknownLayout {
                    name: name.to_string(),
                })
            }
        };
        match interleave_size {
            Some(size) => Err(LayoutError::InterleaveSizeUnused { layout, size }),
            None => Ok(layout),
        }
    }

    /// The layout's name (`token-interleave` without its size; [`fmt::Display`] adds it).
    pub fn name(self) -> &'static str {
        match self {
            Layout::Zigzag => LAYOUT_NAMES[0],
            Layout::RoundRobin => LAYOUT_NAMES[1],
            Layout::PageInterleave => LAYOUT_NAMES[2],
            Layout::TokenInterleave { .. } => LAYOUT_NAMES[3],
        }
    }

    /// Checks the layout against a page size: a token run must be a power of two that
    /// divides the page (so that a page holds whole runs).
    pub fn validate(self, page_size: u32) -> Result<(), LayoutError> {
        if let Layout::TokenInterleave { size } = self {
            if size == 0 || !size.is_power_of_two() || size > page_size {
                return Err(LayoutError::BadInterleaveSize { size, page_size });
            }
        }
        Ok(())
    }

    /// Pages per granule: node splits, matches and allocations are whole granules.
    pub fn granule_pages(self, cp: u8) -> u32 {
        match self {
            Layout::Zigzag | Layout::RoundRobin => 1,
            Layout::PageInterleave | Layout::TokenInterleave { .. } => u32::from(cp.max(1)),
        }
    }

    /// What a load-back must preserve.
    pub fn load_back(self) -> LoadBack {
        match self {
            Layout::Zigzag | Layout::RoundRobin => LoadBack::RecordedOwners,
            Layout::PageInterleave | Layout::TokenInterleave { .. } => LoadBack::Positional,
        }
    }

    /// Tokens per interleave run; a page layout's runs are whole pages.
    pub fn interleave(self, page_size: u32) -> u32 {
        match self {
            Layout::TokenInterleave { size } => size,
            _ => page_size,
        }
    }

    /// Whether pages hold runs shorter than a page (token order differs from page order):
    /// only then do the synthesise and verify kernels need the placement arithmetic.
    pub fn interleaves_tokens(self, page_size: u32) -> bool {
        self.interleave(page_size) < page_size
    }

    /// Owners of `n` freshly computed pages of a sequence whose first `start` pages are
    /// cached (`start` is a whole number of granules).
    pub fn owners(self, cp: u8, start: usize, n: usize) -> Vec<u8> {
        let cp = cp.max(1);
        match self {
            Layout::Zigzag => super::zigzag_owners(cp, n),
            Layout::RoundRobin => super::round_robin_owners(cp, n),
            Layout::PageInterleave | Layout::TokenInterleave { .. } => (start..start + n)
                .map(|i| (i % usize::from(cp)) as u8)
                .collect(),
        }
    }

    /// Owners of `n` pages appended to an open request whose first `start` pages it already
    /// holds (a prefill chunk or decode tokens past its last page): by position, page `i` to
    /// rank `i % cp`, in every layout. Zigzag balances the pages of one prefill; a request
    /// that grows a chunk or a token at a time would put every appended page on the first
    /// ranks, so its appended pages go round by position instead (still recorded).
    pub fn appended_owners(self, cp: u8, start: usize, n: usize) -> Vec<u8> {
        let cp = usize::from(cp.max(1));
        (start..start + n).map(|i| (i % cp) as u8).collect()
    }

    /// Sequence pages a prompt of `tokens` tokens needs: whole pages, rounded up to whole
    /// granules where the layout allocates in granules.
    pub fn pages_for(self, cp: u8, page_size: u32, tokens: usize) -> usize {
        let g = self.granule_pages(cp) as usize;
        tokens.div_ceil(page_size as usize * g) * g
    }

    /// The token arithmetic of this layout at one CP degree and page size.
    pub fn placement(self, cp: u8, page_size: u32) -> Placement {
        Placement {
            cp: u64::from(cp.max(1)),
            page_size: u64::from(page_size),
            run: u64::from(self.interleave(page_size)),
        }
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Layout::TokenInterleave { size } => write!(f, "token-interleave({size})"),
            other => f.write_str(other.name()),
        }
    }
}

/// Where each token of a sequence sits: its sequence page (an index into the request's
/// page list) and its slot in that page. Pure arithmetic; see the module table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placement {
    cp: u64,
    page_size: u64,
    /// Tokens per interleave run (`page_size` for the page layouts).
    run: u64,
}

impl Placement {
    fn granule_tokens(&self) -> u64 {
        self.page_size * self.cp
    }

    fn interleaved(&self) -> bool {
        self.run < self.page_size
    }

    /// (sequence page, slot) of token `t`.
    pub fn place(&self, t: u64) -> (u64, u32) {
        if !self.interleaved() {
            return (t / self.page_size, (t % self.page_size) as u32);
        }
        let (g, rel) = (t / self.granule_tokens(), t % self.granule_tokens());
        let rank = (rel / self.run) % self.cp;
        let slot = (rel / (self.run * self.cp)) * self.run + rel % self.run;
        (g * self.cp + rank, slot as u32)
    }

    /// The token at `slot` of sequence page `page`: the inverse of [`Placement::place`].
    pub fn token(&self, page: u64, slot: u32) -> u64 {
        let slot = u64::from(slot);
        if !self.interleaved() {
            return page * self.page_size + slot;
        }
        let (g, rank) = (page / self.cp, page % self.cp);
        g * self.granule_tokens()
            + (slot / self.run) * self.run * self.cp
            + rank * self.run
            + slot % self.run
    }

    /// How many of the slots of sequence page `page` hold one of the first `n_tokens`
    /// tokens (a page's tokens are in slot order, so these are its first slots).
    pub fn tokens_in_page(&self, page: u64, n_tokens: u64) -> u32 {
        if !self.interleaved() {
            let t0 = page * self.page_size;
            return n_tokens.saturating_sub(t0).min(self.page_size) as u32;
        }
        let (g, rank) = (page / self.cp, page % self.cp);
        let left = n_tokens
            .saturating_sub(g * self.granule_tokens())
            .min(self.granule_tokens());
        let stride = self.run * self.cp;
        let (whole, rest) = (left / stride, left % stride);
        (whole * self.run + rest.saturating_sub(rank * self.run).min(self.run)) as u32
    }

    /// Sequence pages holding the first `n_tokens` tokens: whole granules when tokens are
    /// interleaved (every rank's page of the last granule may hold some), else whole pages.
    pub fn pages_holding(&self, n_tokens: u64) -> u64 {
        if self.interleaved() {
            n_tokens.div_ceil(self.granule_tokens()) * self.cp
        } else {
            n_tokens.div_ceil(self.page_size)
        }
    }
}

/// Checks that `pages`, the pages of a sequence under a layout whose granule is `cp`
/// pages, are aligned groups: entry `g·cp + r` is page `b·cp + r` of some group `b`.
pub fn check_aligned_groups(cp: u8, pages: &[PageId]) -> Result<(), LayoutError> {
    let cp = u32::from(cp.max(1));
    if pages.len() % cp as usize != 0 {
        return Err(LayoutError::Misaligned {
            what: format!("{} pages are not whole groups of {cp}", pages.len()),
        });
    }
    for (g, group) in pages.chunks_exact(cp as usize).enumerate() {
        let base = group[0].0 - group[0].0 % cp;
        if let Some((r, p)) = group
            .iter()
            .enumerate()
            .find(|(r, p)| p.0 != base + *r as u32)
        {
            return Err(LayoutError::Misaligned {
                what: format!(
                    "granule {g}: member {r} is {p}, not page {} of the group at page {base}",
                    base + r as u32
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_names_and_sizes() {
        assert_eq!(Layout::parse("zigzag", None), Ok(Layout::Zigzag));
        assert_eq!(Layout::parse("round_robin", None), Ok(Layout::RoundRobin));
        assert_eq!(
            Layout::parse("page-interleave", None),
            Ok(Layout::PageInterleave)
        );
        assert_eq!(
            Layout::parse("token-interleave", Some(4)),
            Ok(Layout::TokenInterleave { size: 4 })
        );
        assert_eq!(
            Layout::parse("token-interleave", None),
            Ok(Layout::TokenInterleave { size: 1 })
        );
        assert!(Layout::parse("zigzag", Some(2)).is_err());
        assert!(Layout::parse("diagonal", None).is_err());
        assert!(Layout::TokenInterleave { size: 3 }.validate(64).is_err());
        assert!(Layout::TokenInterleave { size: 128 }.validate(64).is_err());
        assert!(Layout::TokenInterleave { size: 64 }.validate(64).is_ok());
    }

    #[test]
    fn token_interleave_pins_a_small_case() {
        // cp 2, page size 4, runs of 2: granule 0 holds tokens 0..8, rank 0 gets 0,1,4,5.
        let p = Layout::TokenInterleave { size: 2 }.placement(2, 4);
        let placed: Vec<_> = (0..10).map(|t| p.place(t)).collect();
        assert_eq!(
            placed,
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3),
                (2, 0),
                (2, 1)
            ]
        );
        assert_eq!(p.tokens_in_page(0, 5), 3);
        assert_eq!(p.tokens_in_page(1, 5), 2);
        assert_eq!(p.tokens_in_page(2, 10), 2);
        assert_eq!(p.tokens_in_page(3, 10), 0);
        assert_eq!(p.pages_holding(9), 4);
    }

    #[test]
    fn interleaved_owners_are_positional() {
        assert_eq!(Layout::PageInterleave.owners(3, 3, 6), [0, 1, 2, 0, 1, 2]);
        assert_eq!(Layout::Zigzag.owners(2, 4, 4), [0, 1, 1, 0]);
        assert_eq!(Layout::PageInterleave.pages_for(4, 16, 65), 8);
        assert_eq!(Layout::Zigzag.pages_for(4, 16, 65), 5);
    }

    #[test]
    fn aligned_groups_are_checked() {
        let ok: Vec<PageId> = [8, 9, 10, 11, 4, 5, 6, 7].map(PageId).to_vec();
        assert!(check_aligned_groups(4, &ok).is_ok());
        let swapped: Vec<PageId> = [9, 8, 10, 11].map(PageId).to_vec();
        assert!(check_aligned_groups(4, &swapped).is_err());
        assert!(check_aligned_groups(4, &ok[..3]).is_err());
    }
}
