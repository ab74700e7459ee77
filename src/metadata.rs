//! Per-rank metadata of one backed-up radix-tree node (the seed's `CpHiCacheNodeMetadata`).
//!
//! `page_owners` is identical on every rank and is the single source of truth for which
//! positions a rank owns: owned positions are derived, never stored twice, so they cannot
//! drift apart. Load-back allocates fresh device pages with exactly this owner sequence.
//!
//! Every constructor and the byte decoder validate; an invalid value cannot exist.
//! Besides the seed's fields the metadata records the CP degree, so that owners and the rank
//! can be validated without a layout at hand (for example when decoding from L3 storage).

use crate::layout::{CpLayout, Rank, MAX_CP, MAX_PAGE_SIZE};
use std::collections::HashSet;

/// A page slot in one rank's host pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HostPage(pub u32);

/// Why metadata was rejected, on construction, split, concat or decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetadataError {
    /// CP degree outside `1..=16`.
    #[error("CP degree {cp} is out of range 1..={MAX_CP}")]
    BadCp {
        /// The rejected degree.
        cp: u8,
    },
    /// Page size not a power of two in `1..=1024`.
    #[error("page size {page_size} is not a power of two in 1..={MAX_PAGE_SIZE}")]
    BadPageSize {
        /// The rejected page size.
        page_size: u32,
    },
    /// Page size differs from the layout's (or from another node's in a concat).
    #[error("page size {found} does not match the expected {expected}")]
    PageSizeMismatch {
        /// What the layout or first node says.
        expected: u32,
        /// What this node says.
        found: u32,
    },
    /// CP degree differs from the layout's (or from another node's).
    #[error("CP degree {found} does not match the expected {expected}")]
    CpMismatch {
        /// What the layout or first node says.
        expected: u8,
        /// What this node says.
        found: u8,
    },
    /// Rank differs between nodes of one concat, or from the rank decoding it.
    #[error("rank {found} does not match the expected rank {expected}")]
    RankMismatch {
        /// The first node's rank.
        expected: u8,
        /// This node's rank.
        found: u8,
    },
    /// The node's rank is not below the CP degree.
    #[error("rank {rank} is out of range for CP {cp}")]
    RankOutOfRange {
        /// The rejected rank.
        rank: u8,
        /// CP degree.
        cp: u8,
    },
    /// A page owner is not below the CP degree.
    #[error("page {index} has owner {owner}, out of range for CP {cp}")]
    OwnerOutOfRange {
        /// Page index within the node.
        index: usize,
        /// The rejected owner.
        owner: u8,
        /// CP degree.
        cp: u8,
    },
    /// `host_pages` does not have one entry per owned page.
    #[error("rank {rank} owns {expected} pages but {found} host pages are recorded")]
    HostCountMismatch {
        /// The node's rank.
        rank: u8,
        /// Owned pages according to `page_owners`.
        expected: usize,
        /// Host pages recorded.
        found: usize,
    },
    /// A host page beyond the host pool it is read into ([`NodeMetadata::decode_for`]).
    #[error("host page {page} is outside the host pool of {pages} pages")]
    HostPageOutOfPool {
        /// The host page.
        page: u32,
        /// Pages of the pool.
        pages: u32,
    },
    /// A host page appears twice (within a node or across the nodes of a concat).
    #[error("host page {page} is referenced twice")]
    DuplicateHostPage {
        /// The repeated host page.
        page: u32,
    },
    /// `split` at a token that is not a granule boundary strictly inside the node.
    #[error("cannot split a node of {len} tokens at token {at}: the split must be aligned to whole granules ({granule} pages of {page_size} tokens) and strictly inside")]
    BadSplit {
        /// Requested split token.
        at: u64,
        /// Node length in tokens.
        len: u64,
        /// Page size.
        page_size: u32,
        /// Pages per granule.
        granule: u32,
    },
    /// Owners that break an interleaved layout's granule: not whole groups of `cp` pages,
    /// or a page not owned by its position (`i % cp`).
    #[error("owners do not follow the layout's granule of {granule} pages: {what}")]
    Misaligned {
        /// Pages per granule.
        granule: u32,
        /// What is wrong.
        what: String,
    },
    /// `concat` of an empty list.
    #[error("cannot concatenate zero nodes")]
    EmptyConcat,
    /// More pages than a layout has page ids for (and than the encoding's u32 count holds).
    #[error(
        "a node of {pages} pages is more than the {} page ids of any layout",
        MAX_NODE_PAGES
    )]
    TooManyPages {
        /// Pages the node would have.
        pages: u64,
    },
    /// Encoded bytes end early.
    #[error("encoded metadata is truncated: {needed} bytes needed, {available} available")]
    Truncated {
        /// Bytes needed to continue decoding.
        needed: usize,
        /// Bytes present.
        available: usize,
    },
    /// Encoded bytes do not start with the magic.
    #[error("encoded metadata has a bad magic {found:02x?}")]
    BadMagic {
        /// The first four bytes.
        found: [u8; 4],
    },
    /// An encoding version this build does not read.
    #[error(
        "encoded metadata version {found} is not supported (this build reads version {supported})"
    )]
    UnsupportedVersion {
        /// The version byte.
        found: u8,
        /// The version this build writes and reads.
        supported: u8,
    },
    /// Bytes that are not canonical: reserved bits set or trailing garbage.
    #[error("encoded metadata is not canonical: {what}")]
    NonCanonical {
        /// What was wrong.
        what: &'static str,
    },
}

/// Most pages one node can have: page ids are `u32`, so no layout has more, and
/// [`NodeMetadata::encode`] writes the count as a `u32`.
pub const MAX_NODE_PAGES: u64 = u32::MAX as u64;

/// Refuses a node of more than [`MAX_NODE_PAGES`] pages.
fn check_page_count(pages: u64) -> Result<(), MetadataError> {
    if pages > MAX_NODE_PAGES {
        return Err(MetadataError::TooManyPages { pages });
    }
    Ok(())
}

/// Metadata of one node on one rank.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct NodeMetadata {
    cp: u8,
    page_size: u32,
    /// Pages per granule of the layout (1, or `cp` when ownership is positional): from the
    /// layout, not encoded (a decoder is given the layout).
    granule: u8,
    rank: Rank,
    page_owners: Vec<u8>,
    host_pages: Vec<HostPage>,
}

impl NodeMetadata {
    /// Builds metadata checked against a layout: same page size, owners and rank below CP, one
    /// host page per owned page, no host page repeated.
    pub fn new(
        layout: &CpLayout,
        rank: Rank,
        page_owners: Vec<u8>,
        host_pages: Vec<HostPage>,
    ) -> Result<Self, MetadataError> {
        Self::from_parts(
            layout.cp(),
            layout.page_size(),
            rank,
            page_owners,
            host_pages,
        )?
        .in_granule(layout.granule())
    }

    /// This metadata under a layout whose granule is `granule` pages: with a granule of `cp`
    /// the node must be whole groups and page `i` owned by `i % cp` (ownership is positional).
    fn in_granule(mut self, granule: u32) -> Result<Self, MetadataError> {
        if granule > 1 {
            let misaligned = |what: String| MetadataError::Misaligned { granule, what };
            if self.page_owners.len() % granule as usize != 0 {
                return Err(misaligned(format!(
                    "{} pages are not whole granules",
                    self.page_owners.len()
                )));
            }
            if let Some((i, &o)) = self
                .page_owners
                .iter()
                .enumerate()
                .find(|(i, &o)| usize::from(o) != i % usize::from(self.cp))
            {
                return Err(misaligned(format!(
                    "page {i} is owned by rank {o}, not by rank {}",
                    i % usize::from(self.cp)
                )));
            }
        }
        self.granule = granule as u8;
        Ok(self)
    }

    /// Builds metadata from raw parts, validating all of them (the decoder's last step; the
    /// layout is checked by the callers).
    fn from_parts(
        cp: u8,
        page_size: u32,
        rank: Rank,
        page_owners: Vec<u8>,
        host_pages: Vec<HostPage>,
    ) -> Result<Self, MetadataError> {
        if !(1..=MAX_CP).contains(&cp) {
            return Err(MetadataError::BadCp { cp });
        }
        if page_size == 0 || !page_size.is_power_of_two() || page_size > MAX_PAGE_SIZE {
            return Err(MetadataError::BadPageSize { page_size });
        }
        if rank.0 >= cp {
            return Err(MetadataError::RankOutOfRange { rank: rank.0, cp });
        }
        check_page_count(page_owners.len() as u64)?;
        if let Some((index, &owner)) = page_owners.iter().enumerate().find(|(_, &o)| o >= cp) {
            return Err(MetadataError::OwnerOutOfRange { index, owner, cp });
        }
        let owned = page_owners.iter().filter(|&&o| o == rank.0).count();
        if owned != host_pages.len() {
            return Err(MetadataError::HostCountMismatch {
                rank: rank.0,
                expected: owned,
                found: host_pages.len(),
            });
        }
        check_unique(host_pages.iter())?;
        Ok(NodeMetadata {
            cp,
            page_size,
            granule: 1,
            rank,
            page_owners,
            host_pages,
        })
    }

    /// Checks that this metadata belongs to `layout` (CP degree and page size).
    pub fn check_layout(&self, layout: &CpLayout) -> Result<(), MetadataError> {
        if self.page_size != layout.page_size() {
            return Err(MetadataError::PageSizeMismatch {
                expected: layout.page_size(),
                found: self.page_size,
            });
        }
        if self.cp != layout.cp() {
            return Err(MetadataError::CpMismatch {
                expected: layout.cp(),
                found: self.cp,
            });
        }
        Ok(())
    }

    /// CP degree the owners refer to.
    pub fn cp(&self) -> u8 {
        self.cp
    }

    /// Tokens per page.
    pub fn page_size(&self) -> u32 {
        self.page_size
    }

    /// The rank this metadata describes.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// Owner of every page of the node, identical on all ranks.
    pub fn page_owners(&self) -> &[u8] {
        &self.page_owners
    }

    /// This rank's host page for each page it owns, in page order.
    pub fn host_pages(&self) -> &[HostPage] {
        &self.host_pages
    }

    /// Pages in the node.
    pub fn num_pages(&self) -> usize {
        self.page_owners.len()
    }

    /// Tokens in the node (whole pages).
    pub fn len_tokens(&self) -> u64 {
        self.page_owners.len() as u64 * u64::from(self.page_size)
    }

    /// Indices (within the node) of the pages this rank owns, ascending; derived from
    /// `page_owners`.
    pub fn owned_page_indices(&self) -> impl Iterator<Item = usize> + '_ {
        let rank = self.rank.0;
        self.page_owners
            .iter()
            .enumerate()
            .filter(move |(_, &o)| o == rank)
            .map(|(i, _)| i)
    }

    /// Pairs of (page index within the node, host page) for the pages this rank owns.
    pub fn owned_pages(&self) -> impl Iterator<Item = (usize, HostPage)> + '_ {
        self.owned_page_indices()
            .zip(self.host_pages.iter().copied())
    }

    /// Token positions (within the node) this rank owns, ascending; derived.
    pub fn owned_token_positions(&self) -> impl Iterator<Item = u64> + '_ {
        let ps = u64::from(self.page_size);
        self.owned_page_indices()
            .flat_map(move |i| (i as u64 * ps)..((i as u64 + 1) * ps))
    }

    /// Splits at a granule-aligned token strictly inside the node. `page_owners` splits by page
    /// index and `host_pages` by the number of owned pages on the left.
    pub fn split(&self, at_token: u64) -> Result<(NodeMetadata, NodeMetadata), MetadataError> {
        let len = self.len_tokens();
        let ps = u64::from(self.page_size);
        let unit = ps * u64::from(self.granule);
        if at_token == 0 || at_token >= len || at_token % unit != 0 {
            return Err(MetadataError::BadSplit {
                at: at_token,
                len,
                page_size: self.page_size,
                granule: u32::from(self.granule),
            });
        }
        let at_page = (at_token / ps) as usize;
        let owned_left = self.page_owners[..at_page]
            .iter()
            .filter(|&&o| o == self.rank.0)
            .count();
        let left = NodeMetadata {
            page_owners: self.page_owners[..at_page].to_vec(),
            host_pages: self.host_pages[..owned_left].to_vec(),
            ..self.clone_header()
        };
        let right = NodeMetadata {
            page_owners: self.page_owners[at_page..].to_vec(),
            host_pages: self.host_pages[owned_left..].to_vec(),
            ..self.clone_header()
        };
        Ok((left, right))
    }

    /// Joins the metadata of consecutive nodes along a path into one. All must share CP, page
    /// size and rank, and no host page may repeat across them.
    pub fn concat<'a>(
        nodes: impl IntoIterator<Item = &'a NodeMetadata>,
    ) -> Result<NodeMetadata, MetadataError> {
        let mut iter = nodes.into_iter();
        let first = iter.next().ok_or(MetadataError::EmptyConcat)?;
        let mut out = first.clone();
        for node in iter {
            check_page_count(out.page_owners.len() as u64 + node.page_owners.len() as u64)?;
            if node.cp != out.cp {
                return Err(MetadataError::CpMismatch {
                    expected: out.cp,
                    found: node.cp,
                });
            }
            if node.page_size != out.page_size {
                return Err(MetadataError::PageSizeMismatch {
                    expected: out.page_size,
                    found: node.page_size,
                });
            }
            if node.granule != out.granule {
                return Err(MetadataError::Misaligned {
                    granule: u32::from(out.granule),
                    what: format!("a node of granule {} joined to it", node.granule),
                });
            }
            if node.rank != out.rank {
                return Err(MetadataError::RankMismatch {
                    expected: out.rank.0,
                    found: node.rank.0,
                });
            }
            out.page_owners.extend_from_slice(&node.page_owners);
            out.host_pages.extend_from_slice(&node.host_pages);
        }
        check_unique(out.host_pages.iter())?;
        Ok(out)
    }

    fn clone_header(&self) -> NodeMetadata {
        NodeMetadata {
            cp: self.cp,
            page_size: self.page_size,
            granule: self.granule,
            rank: self.rank,
            page_owners: Vec::new(),
            host_pages: Vec::new(),
        }
    }

    /// Compact, versioned encoding for L3 storage. Layout (little-endian):
    /// `"CPHM"`, version (1), cp, rank, log2(page_size), n_pages: u32, owners packed two per
    /// byte (low nibble first, a spare high nibble zero), n_host: u32, host pages: u32 each.
    pub fn encode(&self) -> Vec<u8> {
        let n = self.page_owners.len();
        let mut out = Vec::with_capacity(16 + n.div_ceil(2) + 4 * self.host_pages.len());
        out.extend_from_slice(&MAGIC);
        out.push(ENCODING_VERSION);
        out.push(self.cp);
        out.push(self.rank.0);
        out.push(self.page_size.trailing_zeros() as u8);
        // Both counts fit: construction and concat cap a node at MAX_NODE_PAGES pages.
        out.extend_from_slice(&(n as u32).to_le_bytes());
        for pair in self.page_owners.chunks(2) {
            out.push(pair[0] | pair.get(1).map_or(0, |&hi| hi << 4));
        }
        out.extend_from_slice(&(self.host_pages.len() as u32).to_le_bytes());
        for page in &self.host_pages {
            out.extend_from_slice(&page.0.to_le_bytes());
        }
        out
    }

    /// Decodes and validates [`NodeMetadata::encode`]'s output for `layout`. Any malformed
    /// input (truncated, bad magic or version, owner out of range, count mismatch, duplicate
    /// host page, trailing bytes) or metadata of another CP degree or page size is a typed
    /// error; it never panics.
    pub fn decode(bytes: &[u8], layout: &CpLayout) -> Result<NodeMetadata, MetadataError> {
        let m = Self::decode_any_layout(bytes)?;
        m.check_layout(layout)?;
        m.in_granule(layout.granule())
    }

    /// [`NodeMetadata::decode`] for the rank that reads it, whose host pool has `host_pool`
    /// pages: metadata of another rank, or naming a host page outside that pool, is an error.
    /// The layout alone cannot tell; and a load-back from such a page would copy nothing
    /// (transfers skip pages outside their pools) and leave the device page's old bytes.
    pub fn decode_for(
        bytes: &[u8],
        layout: &CpLayout,
        rank: Rank,
        host_pool: u32,
    ) -> Result<NodeMetadata, MetadataError> {
        let m = Self::decode(bytes, layout)?;
        if m.rank != rank {
            return Err(MetadataError::RankMismatch {
                expected: rank.0,
                found: m.rank.0,
            });
        }
        if let Some(p) = m.host_pages.iter().find(|p| p.0 >= host_pool) {
            return Err(MetadataError::HostPageOutOfPool {
                page: p.0,
                pages: host_pool,
            });
        }
        Ok(m)
    }

    /// [`NodeMetadata::decode`] without the layout check.
    fn decode_any_layout(bytes: &[u8]) -> Result<NodeMetadata, MetadataError> {
        let mut r = Reader { bytes, pos: 0 };
        let magic = r.take(4)?;
        if magic != MAGIC {
            let mut found = [0u8; 4];
            found.copy_from_slice(magic);
            return Err(MetadataError::BadMagic { found });
        }
        let version = r.u8()?;
        if version != ENCODING_VERSION {
            return Err(MetadataError::UnsupportedVersion {
                found: version,
                supported: ENCODING_VERSION,
            });
        }
        let cp = r.u8()?;
        let rank = r.u8()?;
        let log2_ps = r.u8()?;
        if log2_ps > MAX_PAGE_SIZE.trailing_zeros() as u8 {
            return Err(MetadataError::BadPageSize {
                page_size: if log2_ps < 32 { 1 << log2_ps } else { u32::MAX },
            });
        }
        let n = r.u32()? as usize;
        let packed = r.take(n.div_ceil(2))?;
        if n % 2 == 1 && packed[packed.len() - 1] >> 4 != 0 {
            return Err(MetadataError::NonCanonical {
                what: "spare owner nibble is not zero",
            });
        }
        let owners: Vec<u8> = (0..n)
            .map(|i| (packed[i / 2] >> (4 * (i % 2))) & 0x0f)
            .collect();
        let n_host = r.u32()? as usize;
        let host_bytes = r.take(n_host.checked_mul(4).ok_or(MetadataError::Truncated {
            needed: usize::MAX,
            available: bytes.len(),
        })?)?;
        let host_pages = host_bytes
            .chunks_exact(4)
            .map(|c| HostPage(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
            .collect();
        if r.pos != bytes.len() {
            return Err(MetadataError::NonCanonical {
                what: "trailing bytes after the host pages",
            });
        }
        NodeMetadata::from_parts(cp, 1 << log2_ps, Rank(rank), owners, host_pages)
    }
}

const MAGIC: [u8; 4] = *b"CPHM";
/// The metadata encoding version this build writes and reads.
pub const ENCODING_VERSION: u8 = 1;

fn check_unique<'a>(pages: impl Iterator<Item = &'a HostPage>) -> Result<(), MetadataError> {
    let mut seen = HashSet::new();
    for page in pages {
        if !seen.insert(*page) {
            return Err(MetadataError::DuplicateHostPage { page: page.0 });
        }
    }
    Ok(())
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], MetadataError> {
        let available = self.bytes.len() - self.pos;
        if n > available {
            return Err(MetadataError::Truncated {
                needed: self.pos.saturating_add(n),
                available: self.bytes.len(),
            });
        }
        let out = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, MetadataError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, MetadataError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> CpLayout {
        CpLayout::new(2, 4, 64).unwrap()
    }

    fn hp(v: &[u32]) -> Vec<HostPage> {
        v.iter().copied().map(HostPage).collect()
    }

    #[test]
    fn a_node_is_capped_at_the_page_ids_of_a_layout() {
        // The cap itself, without allocating 4 GiB of owners.
        assert_eq!(check_page_count(MAX_NODE_PAGES), Ok(()));
        assert_eq!(
            check_page_count(MAX_NODE_PAGES + 1),
            Err(MetadataError::TooManyPages {
                pages: MAX_NODE_PAGES + 1
            })
        );
        assert_eq!(
            MAX_NODE_PAGES,
            u64::from(u32::MAX),
            "encode writes a u32 count"
        );
    }

    #[test]
    fn validates_construction() {
        let l = layout();
        assert!(NodeMetadata::new(&l, Rank(0), vec![0, 0, 1, 1, 0], hp(&[7, 8, 9])).is_ok());
        assert_eq!(
            NodeMetadata::new(&l, Rank(0), vec![0, 2], hp(&[1])),
            Err(MetadataError::OwnerOutOfRange {
                index: 1,
                owner: 2,
                cp: 2
            })
        );
        assert!(matches!(
            NodeMetadata::new(&l, Rank(1), vec![0, 1, 1], hp(&[1])),
            Err(MetadataError::HostCountMismatch {
                expected: 2,
                found: 1,
                ..
            })
        ));
        assert_eq!(
            NodeMetadata::new(&l, Rank(1), vec![1, 1], hp(&[3, 3])),
            Err(MetadataError::DuplicateHostPage { page: 3 })
        );
        assert!(NodeMetadata::new(&l, Rank(2), vec![], vec![]).is_err());
        // Owning nothing is normal.
        let none = NodeMetadata::new(&l, Rank(1), vec![0, 0], vec![]).unwrap();
        assert_eq!(none.owned_page_indices().count(), 0);
    }

    #[test]
    fn decode_for_binds_the_rank_and_the_host_pool() {
        let l = layout();
        let m = NodeMetadata::new(&l, Rank(1), vec![0, 1, 1], hp(&[7, u32::MAX])).unwrap();
        let bytes = m.encode();
        // The layout alone accepts it.
        assert_eq!(NodeMetadata::decode(&bytes, &l).unwrap(), m);
        assert_eq!(
            NodeMetadata::decode_for(&bytes, &l, Rank(0), u32::MAX),
            Err(MetadataError::RankMismatch {
                expected: 0,
                found: 1
            })
        );
        assert_eq!(
            NodeMetadata::decode_for(&bytes, &l, Rank(1), 64),
            Err(MetadataError::HostPageOutOfPool {
                page: u32::MAX,
                pages: 64
            })
        );
        let ok = NodeMetadata::new(&l, Rank(1), vec![0, 1, 1], hp(&[7, 63])).unwrap();
        assert_eq!(
            NodeMetadata::decode_for(&ok.encode(), &l, Rank(1), 64).unwrap(),
            ok
        );
    }

    #[test]
    fn derives_owned_positions() {
        let m = NodeMetadata::new(&layout(), Rank(1), vec![0, 1, 0, 1], hp(&[5, 6])).unwrap();
        assert_eq!(m.owned_page_indices().collect::<Vec<_>>(), vec![1, 3]);
        assert_eq!(
            m.owned_token_positions().collect::<Vec<_>>(),
            vec![4, 5, 6, 7, 12, 13, 14, 15]
        );
        assert_eq!(
            m.owned_pages().collect::<Vec<_>>(),
            vec![(1, HostPage(5)), (3, HostPage(6))]
        );
    }

    #[test]
    fn split_checks_alignment_and_bisects() {
        let m = NodeMetadata::new(&layout(), Rank(0), vec![0, 1, 0, 0], hp(&[1, 2, 3])).unwrap();
        assert!(matches!(m.split(0), Err(MetadataError::BadSplit { .. })));
        assert!(matches!(m.split(6), Err(MetadataError::BadSplit { .. })));
        assert!(matches!(m.split(16), Err(MetadataError::BadSplit { .. })));
        let (l, r) = m.split(8).unwrap();
        assert_eq!(l.page_owners(), &[0, 1]);
        assert_eq!(l.host_pages(), hp(&[1]).as_slice());
        assert_eq!(r.page_owners(), &[0, 0]);
        assert_eq!(r.host_pages(), hp(&[2, 3]).as_slice());
        assert_eq!(NodeMetadata::concat([&l, &r]).unwrap(), m);
    }

    #[test]
    fn concat_rejects_mixed_nodes() {
        let l = layout();
        let a = NodeMetadata::new(&l, Rank(0), vec![0], hp(&[1])).unwrap();
        let b = NodeMetadata::new(&l, Rank(1), vec![1], hp(&[2])).unwrap();
        let c = NodeMetadata::new(&l, Rank(0), vec![0], hp(&[1])).unwrap();
        assert!(matches!(
            NodeMetadata::concat([&a, &b]),
            Err(MetadataError::RankMismatch { .. })
        ));
        assert_eq!(
            NodeMetadata::concat([&a, &c]),
            Err(MetadataError::DuplicateHostPage { page: 1 })
        );
        assert_eq!(
            NodeMetadata::concat(std::iter::empty()),
            Err(MetadataError::EmptyConcat)
        );
    }

    #[test]
    fn encoding_round_trips_and_rejects_garbage() {
        let m = NodeMetadata::new(&layout(), Rank(1), vec![1, 0, 1], hp(&[9, 4])).unwrap();
        let bytes = m.encode();
        let l = layout();
        assert_eq!(NodeMetadata::decode(&bytes, &l).unwrap(), m);
        for cut in 0..bytes.len() {
            assert!(NodeMetadata::decode(&bytes[..cut], &l).is_err());
        }
        // Valid bytes of another page size or CP degree are refused for this layout.
        let ps16 = CpLayout::new(l.cp().into(), 16, l.pages()).unwrap();
        assert_eq!(
            NodeMetadata::decode(&bytes, &ps16),
            Err(MetadataError::PageSizeMismatch {
                expected: 16,
                found: l.page_size()
            })
        );
        let cp4 = CpLayout::new(4, l.page_size(), l.pages()).unwrap();
        assert_eq!(
            NodeMetadata::decode(&bytes, &cp4),
            Err(MetadataError::CpMismatch {
                expected: 4,
                found: l.cp()
            })
        );
        // Header fields out of range: CP (byte 5), rank (6), log2 page size (7).
        for (at, v) in [(5, 0u8), (5, 17), (5, 255)] {
            let mut b = bytes.clone();
            b[at] = v;
            assert!(
                matches!(NodeMetadata::decode(&b, &l), Err(MetadataError::BadCp { cp }) if cp == v),
                "cp {v}"
            );
        }
        let mut rank = bytes.clone();
        rank[6] = 2;
        assert!(matches!(
            NodeMetadata::decode(&rank, &l),
            Err(MetadataError::RankOutOfRange { rank: 2, cp: 2 })
        ));
        let mut ps = bytes.clone();
        ps[7] = 11;
        assert!(matches!(
            NodeMetadata::decode(&ps, &l),
            Err(MetadataError::BadPageSize { page_size: 2048 })
        ));
        let mut bad = bytes.clone();
        bad[4] = 9;
        assert!(matches!(
            NodeMetadata::decode(&bad, &l),
            Err(MetadataError::UnsupportedVersion { found: 9, .. })
        ));
        let mut extra = bytes.clone();
        extra.push(0);
        assert!(matches!(
            NodeMetadata::decode(&extra, &l),
            Err(MetadataError::NonCanonical { .. })
        ));
        let mut owner = bytes.clone();
        owner[12] = 0x05; // owners 5,0 for CP 2
        assert!(matches!(
            NodeMetadata::decode(&owner, &l),
            Err(MetadataError::OwnerOutOfRange { owner: 5, .. })
        ));
    }
}
