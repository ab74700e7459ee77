//! The per-rank, page-aligned radix tree of HiCache: which token prefixes are on the device,
//! backed up on the host, or both, and which of them to evict.
//!
//! Every rank keeps its own tree and every rank sees the same calls, so the tree must stay
//! identical across ranks. It is therefore fully deterministic: LRU stamps come from a
//! logical clock (one tick per `match_prefix` / `insert`), children are kept in a `BTreeMap`,
//! candidates are ordered by `(stamp, NodeId)`, and node slots are reused in a fixed (stack)
//! order. [`RadixTree::digest`] hashes everything that must agree across ranks.
//!
//! Keys are whole pages of tokens and children are keyed by their first page, as SGLang does
//! for page sizes above one: a trailing partial page never matches and never gets inserted.
//! A node's device value is one logical page per page of its key (token locations are
//! page-contiguous, so pages suffice); its host value is this rank's [`NodeMetadata`].
//!
//! Structural invariants ([`RadixTree::check_invariants`]):
//! - every node but the root holds a device value, host metadata, or both;
//! - device residency is closed towards the root: a node on the device has a parent on the
//!   device (or the root), so the device-resident part of any path is a prefix;
//! - a node's lock count is at least the sum of its children's (locks cover the path).
//!
//! The eviction helpers decide *what* to free and hand it back; freeing device pages in the
//! allocator and host pages in the host pool is the caller's job.

use crate::allocator::StateDigest;
use crate::layout::{CpLayout, LayoutError, PageId, Rank};
use crate::metadata::{HostPage, MetadataError, NodeMetadata};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

/// A node handle: an arena slot plus the slot's generation, so a handle to a removed node
/// is rejected instead of silently naming whatever reuses its slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId {
    index: u32,
    generation: u32,
}

impl NodeId {
    /// The root: empty key, never evicted, never locked.
    pub const ROOT: NodeId = NodeId {
        index: 0,
        generation: 0,
    };

    /// The arena slot.
    pub fn index(self) -> u32 {
        self.index
    }

    /// How many times the slot was reused before this node took it.
    pub fn generation(self) -> u32 {
        self.generation
    }

    /// The handle as one number, to send to other ranks (replicas name a node alike).
    pub fn to_bits(self) -> u64 {
        u64::from(self.index) << 32 | u64::from(self.generation)
    }

    /// The handle [`NodeId::to_bits`] gave (a stale or foreign one is refused by the tree
    /// calls that take it).
    pub fn from_bits(bits: u64) -> NodeId {
        NodeId {
            index: (bits >> 32) as u32,
            generation: bits as u32,
        }
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "node {}.{}", self.index, self.generation)
    }
}

/// Why a tree call was rejected. Every call validates before it mutates, so on an error the
/// tree is unchanged (splits made while walking are the one exception: they keep the tree
/// equivalent).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    /// The rank, or a device page, is not part of the layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// A handle to a node that is not (or no longer) in the tree.
    #[error("{node} is not in the tree")]
    UnknownNode {
        /// The stale or foreign handle.
        node: NodeId,
    },
    /// An operation that makes no sense on the root (it has no key and holds nothing).
    #[error("{op} is not allowed on the root")]
    Root {
        /// The operation.
        op: &'static str,
    },
    /// `insert` got a token count that is not `pages * page_size`.
    #[error("{tokens} tokens do not fill {pages} pages of {page_size} tokens")]
    LengthMismatch {
        /// Tokens given.
        tokens: usize,
        /// Pages given.
        pages: usize,
        /// Page size.
        page_size: u32,
    },
    /// A device value or host metadata whose page count differs from the node's key.
    #[error("{node} has {expected} pages but {found} were given")]
    PageCount {
        /// The node.
        node: NodeId,
        /// Pages in the node's key.
        expected: usize,
        /// Pages given.
        found: usize,
    },
    /// The null page was offered as a device page.
    #[error("the null page cannot be held by the tree (position {index})")]
    NullPage {
        /// Position in the call's page list.
        index: usize,
    },
    /// A device page already held by the tree, or repeated in one call.
    #[error("{page} is already held by the tree")]
    PageHeld {
        /// The page.
        page: PageId,
    },
    /// A host page already recorded by another node, or repeated.
    #[error("host page {} is already held by the tree", page.0)]
    HostPageHeld {
        /// The host page.
        page: HostPage,
    },
    /// A node expected to be backed up has no host metadata.
    #[error("{node} has no host copy")]
    NotBackedUp {
        /// The node.
        node: NodeId,
    },
    /// A node expected on the device has no device value.
    #[error("{node} is not on the device")]
    NotOnDevice {
        /// The node.
        node: NodeId,
    },
    /// `set_device` on a node that already has a device value.
    #[error("{node} already has a device value")]
    AlreadyOnDevice {
        /// The node.
        node: NodeId,
    },
    /// `set_host` on a node that already has host metadata.
    #[error("{node} already has host metadata")]
    AlreadyOnHost {
        /// The node.
        node: NodeId,
    },
    /// `set_device` below a node that is not on the device (device residency must stay a
    /// prefix of every path; set values top-down).
    #[error("{node} cannot go on the device: its parent {parent} is not on the device")]
    ParentNotOnDevice {
        /// The node.
        node: NodeId,
        /// Its parent.
        parent: NodeId,
    },
    /// `take_device` from a node whose child is still on the device.
    #[error("{node} cannot leave the device: its child {child} is still on the device")]
    ChildOnDevice {
        /// The node.
        node: NodeId,
        /// A child that is on the device.
        child: NodeId,
    },
    /// A `take_*` that would leave a node with neither device value nor host metadata; nodes
    /// leave the tree only through eviction.
    #[error("taking the {what} of {node} would leave it empty")]
    WouldEmpty {
        /// The node.
        node: NodeId,
        /// What was being taken.
        what: &'static str,
    },
    /// Device pages of a locked node cannot be taken.
    #[error("{node} is locked ({count} locks)")]
    Locked {
        /// The node.
        node: NodeId,
        /// Its lock count.
        count: u32,
    },
    /// `unlock` of a path where some node is not locked.
    #[error("unlocking {node} would take {at} below zero locks")]
    UnlockBelowZero {
        /// The node passed to `unlock`.
        node: NodeId,
        /// The node on its path that has no lock left.
        at: NodeId,
    },
    /// Device pages and host metadata disagree on a page's owner: the load path must
    /// allocate pages with exactly the recorded owners.
    #[error("{node}: {page} is owned by rank {found} but the host metadata says rank {expected} (page {index})")]
    OwnerMismatch {
        /// The node.
        node: NodeId,
        /// Page index within the node.
        index: usize,
        /// The device page.
        page: PageId,
        /// Owner recorded in the host metadata.
        expected: u8,
        /// Owner of the device page.
        found: u8,
    },
    /// Host metadata of another rank.
    #[error("host metadata of rank {found} given to the tree of rank {expected}")]
    RankMismatch {
        /// This tree's rank.
        expected: u8,
        /// The metadata's rank.
        found: u8,
    },
    /// Host metadata was invalid for this tree or could not be split.
    #[error("host metadata of {node}: {source}")]
    Metadata {
        /// The node.
        node: NodeId,
        /// The metadata error.
        source: MetadataError,
    },
    /// `check_invariants` found a corrupted structure.
    #[error("radix tree invariant violated: {what}")]
    Invariant {
        /// Description of the violation.
        what: String,
    },
}

/// What a `match_prefix` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatchResult {
    /// Tokens matched (whole pages; device-resident and host-only nodes together).
    pub matched_tokens: usize,
    /// Device pages of the device-resident prefix of the match, in order.
    pub device_pages: Vec<PageId>,
    /// Host-only nodes right after the device prefix, in path order: the candidates for a
    /// load-back.
    pub host_nodes: Vec<NodeId>,
    /// Deepest node reached (the root when nothing matched).
    pub last_node: NodeId,
    /// Deepest node of the device-resident prefix (the root when it is empty).
    pub last_device_node: NodeId,
}

/// What an `insert` did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InsertResult {
    /// The node that ends the inserted sequence (the root for an empty one).
    pub node: NodeId,
    /// Tokens that were already in the tree before this call.
    pub prefix_tokens: usize,
    /// Incoming pages for tokens already on the device, in order: the caller frees them.
    pub duplicate_pages: Vec<PageId>,
    /// Incoming pages adopted by existing host-only nodes.
    pub adopted_pages: usize,
    /// Host copies that adopted pages with other owners replaced (see
    /// [`RadixTree::insert`]): the caller frees their host pages.
    pub dropped_host_copies: Vec<NodeMetadata>,
}

/// One node's device eviction: the device pages to free and, if the node left the tree,
/// host metadata released with it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Evicted {
    /// The evicted node (no longer valid when `removed`).
    pub node: NodeId,
    /// Its device pages, for the caller to free in the allocator.
    pub device_pages: Vec<PageId>,
    /// Whether the node left the tree (it had no host copy).
    pub removed: bool,
    /// Host metadata of host-only descendants removed together with the node (a removed node
    /// takes its subtree along); the caller frees these host pages.
    pub host_released: Vec<NodeMetadata>,
}

/// A read-only view of one node.
#[derive(Clone, Copy, Debug)]
pub struct NodeView<'a> {
    id: NodeId,
    node: &'a Node,
}

impl<'a> NodeView<'a> {
    /// The node's handle.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The node's own tokens (whole pages; empty for the root).
    pub fn key(&self) -> &'a [u32] {
        &self.node.key
    }

    /// Pages in the node's key.
    pub fn num_pages(&self, page_size: u32) -> usize {
        self.node.key.len() / page_size as usize
    }

    /// The parent (`None` for the root).
    pub fn parent(&self) -> Option<NodeId> {
        self.node.parent
    }

    /// Children in key order.
    pub fn children(&self) -> impl Iterator<Item = NodeId> + 'a {
        self.node.children.values().copied()
    }

    /// Device pages, one per page of the key, when on the device.
    pub fn device(&self) -> Option<&'a [PageId]> {
        self.node.device.as_deref()
    }

    /// This rank's host metadata, when backed up.
    pub fn host(&self) -> Option<&'a NodeMetadata> {
        self.node.host.as_ref()
    }

    /// Lock count (locks of this node and of its descendants).
    pub fn lock_count(&self) -> u32 {
        self.node.lock
    }

    /// Logical time of the last touch.
    pub fn stamp(&self) -> u64 {
        self.node.stamp
    }
}

#[derive(Clone, Debug)]
struct Node {
    key: Vec<u32>,
    children: BTreeMap<Vec<u32>, NodeId>,
    parent: Option<NodeId>,
    device: Option<Vec<PageId>>,
    host: Option<NodeMetadata>,
    lock: u32,
    stamp: u64,
}

#[derive(Clone, Debug)]
struct Slot {
    generation: u32,
    node: Option<Node>,
}

/// The changes of one [`RadixTree::drop_stale`], planned before any is made.
struct StalePlan {
    /// Nodes whose device value goes, in the order their pages are freed.
    loses_device: Vec<NodeId>,
    /// Nodes removed, each after its children.
    removed: Vec<NodeId>,
}

/// One rank's radix tree. `Send + Sync` plain data: every change takes `&mut self`, so
/// threads share it behind a lock (the [`Cluster`](crate::cluster::Cluster) owns one per
/// rank).
#[derive(Clone, Debug)]
pub struct RadixTree {
    layout: CpLayout,
    rank: Rank,
    slots: Vec<Slot>,
    /// Freed slot indices; the last one is reused first.
    free_slots: Vec<u32>,
    clock: u64,
    held_device: HashSet<PageId>,
    held_host: HashSet<HostPage>,
    live: usize,
}

fn invariant(what: String) -> TreeError {
    TreeError::Invariant { what }
}

/// Leading whole pages on which `a` and `b` agree.
fn common_pages(a: &[u32], b: &[u32], ps: usize) -> usize {
    a.chunks_exact(ps)
        .zip(b.chunks_exact(ps))
        .take_while(|(x, y)| x == y)
        .count()
}

/// What a device eviction is for: which candidates it takes and when it has done enough.
trait DeviceTarget {
    /// Whether the eviction has reached its target.
    fn met(&self) -> bool;
    /// Whether to evict a candidate holding `pages`; counts them if so.
    fn take(&mut self, pages: &[PageId]) -> bool;
}

/// Any candidates, until `wanted` device pages are released.
struct PagesWanted {
    wanted: usize,
    released: usize,
}

impl DeviceTarget for PagesWanted {
    fn met(&self) -> bool {
        self.released >= self.wanted
    }

    fn take(&mut self, pages: &[PageId]) -> bool {
        self.released += pages.len();
        true
    }
}

/// Only candidates that free a page of a lane still short, until no lane is.
struct LanesShort {
    short: Vec<u32>,
    layout: CpLayout,
}

impl DeviceTarget for LanesShort {
    fn met(&self) -> bool {
        self.short.iter().all(|&d| d == 0)
    }

    fn take(&mut self, pages: &[PageId]) -> bool {
        let layout = self.layout;
        let lane = |p: &PageId| usize::from(layout.owner(*p).0);
        if !pages
            .iter()
            .any(|p| self.short.get(lane(p)).is_some_and(|&s| s > 0))
        {
            return false;
        }
        for p in pages {
            let l = lane(p);
            if let Some(s) = self.short.get_mut(l) {
                *s = s.saturating_sub(1);
            }
        }
        true
    }
}

impl RadixTree {
    /// An empty tree (just the root) for `rank` of `layout`.
    pub fn new(layout: CpLayout, rank: Rank) -> Result<Self, TreeError> {
        layout.check_rank(rank)?;
        let root = Node {
            key: Vec::new(),
            children: BTreeMap::new(),
            parent: None,
            device: None,
            host: None,
            lock: 0,
            stamp: 0,
        };
        Ok(RadixTree {
            layout,
            rank,
            slots: vec![Slot {
                generation: 0,
                node: Some(root),
            }],
            free_slots: Vec::new(),
            clock: 0,
            held_device: HashSet::new(),
            held_host: HashSet::new(),
            live: 1,
        })
    }

    /// The layout the tree's pages belong to.
    pub fn layout(&self) -> &CpLayout {
        &self.layout
    }

    /// The rank whose host metadata the tree keeps.
    pub fn rank(&self) -> Rank {
        self.rank
    }

    /// The logical clock: how many `match_prefix` / `insert` calls stamped nodes.
    pub fn clock(&self) -> u64 {
        self.clock
    }

    /// Nodes in the tree besides the root.
    pub fn node_count(&self) -> usize {
        self.live - 1
    }

    /// Device pages held by the tree.
    pub fn device_pages(&self) -> usize {
        self.held_device.len()
    }

    /// A cheap digest of what every replica shares (the clock, node and slot counts, the
    /// device pages held): what each step's decision digest covers, in O(1), where the full
    /// [`RadixTree::digest`] reads every key.
    pub fn summary_digest(&self) -> StateDigest {
        let mut h = Sha256::new();
        h.update(b"cp-hicache radix tree summary v1");
        for v in [
            self.clock,
            self.live as u64,
            self.slots.len() as u64,
            self.free_slots.len() as u64,
            self.held_device.len() as u64,
        ] {
            h.update(v.to_le_bytes());
        }
        StateDigest(h.finalize().into())
    }

    /// Host pages each rank's pool holds for the tree's host copies, in rank order: every
    /// replica knows every rank's count, since host metadata records every page's owner.
    pub fn host_pages_by_owner(&self) -> Vec<u32> {
        let mut out = vec![0u32; usize::from(self.layout.cp())];
        for (_, n) in self.live_nodes() {
            for &o in n.host.as_ref().map_or(&[][..], |m| m.page_owners()) {
                if let Some(c) = out.get_mut(usize::from(o)) {
                    *c += 1;
                }
            }
        }
        out
    }

    /// Device pages that device eviction could release: those of unlocked nodes (a node with
    /// a locked descendant is itself locked).
    pub fn evictable_device_pages(&self) -> usize {
        self.live_nodes()
            .filter(|(_, n)| n.lock == 0)
            .filter_map(|(_, n)| n.device.as_ref().map(Vec::len))
            .sum()
    }

    /// Logical pages of nodes that have host metadata (the same on every rank).
    pub fn host_backed_pages(&self) -> usize {
        let ps = self.ps();
        self.live_nodes()
            .filter(|(_, n)| n.host.is_some())
            .map(|(_, n)| n.key.len() / ps)
            .sum()
    }

    /// Whether `node` is a live handle.
    pub fn contains(&self, node: NodeId) -> bool {
        self.get(node).is_ok()
    }

    /// A read-only view of a node.
    pub fn node(&self, node: NodeId) -> Result<NodeView<'_>, TreeError> {
        Ok(NodeView {
            id: node,
            node: self.get(node)?,
        })
    }

    /// All nodes, root first, in the canonical (depth-first, key-ordered) order.
    pub fn node_ids(&self) -> Vec<NodeId> {
        let mut out = Vec::with_capacity(self.live);
        let mut stack = vec![NodeId::ROOT];
        while let Some(id) = stack.pop() {
            out.push(id);
            if let Ok(n) = self.get(id) {
                stack.extend(n.children.values().rev().copied());
            }
        }
        out
    }

    /// The nodes from the root's child down to `node` (empty for the root).
    pub fn path(&self, node: NodeId) -> Result<Vec<NodeId>, TreeError> {
        let mut path = Vec::new();
        let mut cur = node;
        while cur != NodeId::ROOT {
            path.push(cur);
            cur = self
                .get(cur)?
                .parent
                .ok_or_else(|| invariant(format!("{cur} has no parent")))?;
        }
        path.reverse();
        Ok(path)
    }

    /// All tokens from the root to the end of `node`.
    pub fn prefix_tokens(&self, node: NodeId) -> Result<Vec<u32>, TreeError> {
        let mut out = Vec::new();
        for id in self.path(node)? {
            out.extend_from_slice(&self.get(id)?.key);
        }
        Ok(out)
    }

    /// Matches the longest whole-page prefix of `tokens`, splitting the last node when the
    /// match ends inside it, and touches every node on the matched path.
    pub fn match_prefix(&mut self, tokens: &[u32]) -> Result<MatchResult, TreeError> {
        let ps = self.ps();
        let whole = tokens.len() / ps * ps;
        self.clock += 1;
        let (path, matched_pages) = self.descend(&tokens[..whole], self.clock)?;
        let mut device_pages = Vec::new();
        let mut host_nodes = Vec::new();
        let mut last_device_node = NodeId::ROOT;
        let mut on_device = true;
        for &id in &path {
            let n = self.get(id)?;
            if on_device {
                if let Some(d) = &n.device {
                    device_pages.extend_from_slice(d);
                    last_device_node = id;
                    continue;
                }
                on_device = false;
            }
            if n.device.is_none() && n.host.is_some() {
                host_nodes.push(id);
            } else {
                break;
            }
        }
        Ok(MatchResult {
            matched_tokens: matched_pages * ps,
            device_pages,
            host_nodes,
            last_node: path.last().copied().unwrap_or(NodeId::ROOT),
            last_device_node,
        })
    }

    /// Inserts `tokens` with their device `pages` (`tokens.len() == pages.len() * page_size`).
    /// Pages for tokens already on the device come back as duplicates, except the tree's own
    /// pages passed back at their own positions; host-only nodes on the path adopt theirs;
    /// the rest becomes a new leaf.
    ///
    /// A node's device pages and host copy must name the same owners (a later backup or
    /// load relies on it). Pages adopted by a host-only node whose `page_owners` differ (a
    /// prefix recomputed after its load-back degraded to a miss gets fresh zigzag owners)
    /// therefore replace its host copy: the copy leaves the node and comes back in
    /// [`InsertResult::dropped_host_copies`], for the caller to free its host pages.
    pub fn insert(&mut self, tokens: &[u32], pages: &[PageId]) -> Result<InsertResult, TreeError> {
        let ps = self.ps();
        if pages.len().checked_mul(ps) != Some(tokens.len()) {
            return Err(TreeError::LengthMismatch {
                tokens: tokens.len(),
                pages: pages.len(),
                page_size: self.layout.page_size(),
            });
        }
        // The caller may pass the tree's own pages for the prefix it matched (the usual case
        // after a hit): those are neither new nor duplicates.
        let existing = self.existing_device_pages(tokens)?;
        let incoming: Vec<PageId> = pages
            .iter()
            .zip(existing.iter().chain(std::iter::repeat(&None)))
            .filter(|(p, e)| e.as_ref() != Some(*p))
            .map(|(&p, _)| p)
            .collect();
        self.check_new_pages(&incoming)?;
        self.clock += 1;
        let now = self.clock;
        let (path, matched_pages) = self.descend(tokens, now)?;
        let mut duplicate_pages = Vec::new();
        let mut adopted_pages = 0;
        let mut offset = 0;
        let mut dropped_host_copies = Vec::new();
        for &id in &path {
            let n = self.get(id)?;
            let np = n.key.len() / ps;
            let mine = &pages[offset..offset + np];
            offset += np;
            if let Some(have) = &n.device {
                duplicate_pages.extend(
                    mine.iter()
                        .zip(have)
                        .filter(|(m, h)| m != h)
                        .map(|(m, _)| *m),
                );
                continue;
            }
            let keeps_host = match &n.host {
                Some(h) => self.check_owners(id, mine, h).is_ok(),
                None => true,
            };
            let n = self.get_mut(id)?;
            n.device = Some(mine.to_vec());
            let dropped = if keeps_host { None } else { n.host.take() };
            self.held_device.extend(mine.iter().copied());
            adopted_pages += np;
            if let Some(meta) = dropped {
                for p in meta.host_pages() {
                    self.held_host.remove(p);
                }
                dropped_host_copies.push(meta);
            }
        }
        let mut node = path.last().copied().unwrap_or(NodeId::ROOT);
        if offset < pages.len() {
            let leaf = Node {
                key: tokens[offset * ps..].to_vec(),
                children: BTreeMap::new(),
                parent: Some(node),
                device: Some(pages[offset..].to_vec()),
                host: None,
                lock: 0,
                stamp: now,
            };
            self.held_device.extend(pages[offset..].iter().copied());
            let first = leaf.key[..ps].to_vec();
            let id = self.alloc(leaf);
            self.get_mut(node)?.children.insert(first, id);
            node = id;
        }
        Ok(InsertResult {
            node,
            prefix_tokens: matched_pages * ps,
            duplicate_pages,
            adopted_pages,
            dropped_host_copies,
        })
    }

    /// Puts `node` on the device with `pages` (one per page of its key), for example after a
    /// load-back. The parent must be on the device (set values top-down); when the node is
    /// backed up, each page's owner must equal the recorded owner.
    pub fn set_device(&mut self, node: NodeId, pages: Vec<PageId>) -> Result<(), TreeError> {
        self.set_device_checked(node, pages, true)
    }

    /// Like [`RadixTree::set_device`] but without the owner check: it reproduces the seed's
    /// bug on purpose, for the `plain-alloc-on-load` fault injection, so that the verifier can
    /// show it catches what this check would otherwise have stopped. Crate-private: nothing
    /// outside the fault injection may put pages on the device without the owner check.
    pub(crate) fn set_device_ignoring_owners(
        &mut self,
        node: NodeId,
        pages: Vec<PageId>,
    ) -> Result<(), TreeError> {
        self.set_device_checked(node, pages, false)
    }

    fn set_device_checked(
        &mut self,
        node: NodeId,
        pages: Vec<PageId>,
        check_owners: bool,
    ) -> Result<(), TreeError> {
        self.not_root(node, "set_device")?;
        let ps = self.ps();
        let n = self.get(node)?;
        if n.device.is_some() {
            return Err(TreeError::AlreadyOnDevice { node });
        }
        let expected = n.key.len() / ps;
        if pages.len() != expected {
            return Err(TreeError::PageCount {
                node,
                expected,
                found: pages.len(),
            });
        }
        let parent = n
            .parent
            .ok_or_else(|| invariant(format!("{node} has no parent")))?;
        if parent != NodeId::ROOT && self.get(parent)?.device.is_none() {
            return Err(TreeError::ParentNotOnDevice { node, parent });
        }
        if let (Some(h), true) = (&n.host, check_owners) {
            self.check_owners(node, &pages, h)?;
        }
        self.check_new_pages(&pages)?;
        self.held_device.extend(pages.iter().copied());
        self.get_mut(node)?.device = Some(pages);
        Ok(())
    }

    /// Records this rank's host metadata for `node` (after a backup). It must belong to this
    /// tree's layout and rank, cover the node's pages, use host pages no other node holds,
    /// and, when the node is on the device, record the device pages' owners.
    pub fn set_host(&mut self, node: NodeId, meta: NodeMetadata) -> Result<(), TreeError> {
        self.not_root(node, "set_host")?;
        meta.check_layout(&self.layout)
            .map_err(|source| TreeError::Metadata { node, source })?;
        if meta.rank() != self.rank {
            return Err(TreeError::RankMismatch {
                expected: self.rank.0,
                found: meta.rank().0,
            });
        }
        let ps = self.ps();
        let n = self.get(node)?;
        if n.host.is_some() {
            return Err(TreeError::AlreadyOnHost { node });
        }
        let expected = n.key.len() / ps;
        if meta.num_pages() != expected {
            return Err(TreeError::PageCount {
                node,
                expected,
                found: meta.num_pages(),
            });
        }
        if let Some(d) = &n.device {
            self.check_owners(node, d, &meta)?;
        }
        if let Some(&page) = meta
            .host_pages()
            .iter()
            .find(|p| self.held_host.contains(p))
        {
            return Err(TreeError::HostPageHeld { page });
        }
        self.held_host.extend(meta.host_pages().iter().copied());
        self.get_mut(node)?.host = Some(meta);
        Ok(())
    }

    /// Takes the device pages of a backed-up, unlocked node none of whose children is on the
    /// device (the caller frees them); the node stays as host-only.
    pub fn take_device(&mut self, node: NodeId) -> Result<Vec<PageId>, TreeError> {
        self.not_root(node, "take_device")?;
        let n = self.get(node)?;
        if n.device.is_none() {
            return Ok(Vec::new());
        }
        if n.host.is_none() {
            return Err(TreeError::WouldEmpty {
                node,
                what: "device value",
            });
        }
        if n.lock > 0 {
            return Err(TreeError::Locked {
                node,
                count: n.lock,
            });
        }
        for &child in n.children.values() {
            if self.get(child)?.device.is_some() {
                return Err(TreeError::ChildOnDevice { node, child });
            }
        }
        let pages = self.get_mut(node)?.device.take().unwrap_or_default();
        for p in &pages {
            self.held_device.remove(p);
        }
        Ok(pages)
    }

    /// Takes the host metadata of a node that is on the device (the caller frees the host
    /// pages); `None` when it had none.
    pub fn take_host(&mut self, node: NodeId) -> Result<Option<NodeMetadata>, TreeError> {
        self.not_root(node, "take_host")?;
        let n = self.get(node)?;
        if n.host.is_none() {
            return Ok(None);
        }
        if n.device.is_none() {
            return Err(TreeError::WouldEmpty {
                node,
                what: "host metadata",
            });
        }
        let meta = self.get_mut(node)?.host.take();
        for p in meta.iter().flat_map(|m| m.host_pages()) {
            self.held_host.remove(p);
        }
        Ok(meta)
    }

    /// Locks `node` and its ancestors against eviction (the root is never counted).
    pub fn lock(&mut self, node: NodeId) -> Result<(), TreeError> {
        for id in self.path(node)? {
            self.get_mut(id)?.lock += 1;
        }
        Ok(())
    }

    /// Releases one lock of `node` and its ancestors; all or nothing.
    pub fn unlock(&mut self, node: NodeId) -> Result<(), TreeError> {
        let path = self.path(node)?;
        for &id in &path {
            if self.get(id)?.lock == 0 {
                return Err(TreeError::UnlockBelowZero { node, at: id });
            }
        }
        for id in path {
            self.get_mut(id)?.lock -= 1;
        }
        Ok(())
    }

    /// Evicts unlocked device leaves (on the device, no child on the device), oldest stamp
    /// first (ties: lower `NodeId`), until at least `n_pages` device pages were released or
    /// nothing is left to evict. A backed-up node only drops its device pages; any other
    /// node leaves the tree with its (host-only) subtree, and its parent may become a
    /// candidate. It evicts exactly the nodes of [`RadixTree::device_eviction_plan_lru`].
    pub fn evict_device_lru(&mut self, n_pages: usize) -> Result<Vec<Evicted>, TreeError> {
        let plan = self.device_eviction_plan_lru(n_pages)?;
        self.evict_device_plan(plan)
    }

    /// Like [`RadixTree::evict_device_lru`], in the same order, but only evicts nodes that
    /// free at least one page of a lane still short (`deficit[lane]` pages, lanes by the
    /// layout's page owners), and stops as soon as every deficit is covered or no candidate
    /// is left. It evicts exactly the nodes of [`RadixTree::device_eviction_plan_for_lanes`].
    pub fn evict_device_for_lanes(&mut self, deficit: &[u32]) -> Result<Vec<Evicted>, TreeError> {
        let plan = self.device_eviction_plan_for_lanes(deficit)?;
        self.evict_device_plan(plan)
    }

    /// The nodes [`RadixTree::evict_device_lru`] would evict, in order, leaving the tree as
    /// it is. Under write-back the caller backs up the planned nodes that are not backed up
    /// yet, so that the eviction keeps them (host-only) instead of removing them.
    pub fn device_eviction_plan_lru(&self, n_pages: usize) -> Result<Vec<NodeId>, TreeError> {
        self.device_eviction_plan(PagesWanted {
            wanted: n_pages,
            released: 0,
        })
    }

    /// The nodes [`RadixTree::evict_device_for_lanes`] would evict, in order, leaving the
    /// tree as it is.
    pub fn device_eviction_plan_for_lanes(
        &self,
        deficit: &[u32],
    ) -> Result<Vec<NodeId>, TreeError> {
        self.device_eviction_plan(LanesShort {
            short: deficit.to_vec(),
            layout: self.layout,
        })
    }

    /// Removes unlocked host-only leaves (no device value, no children), oldest stamp first,
    /// until at least `n_pages` logical pages were released or none is left, and returns
    /// their metadata so the caller frees the host pages. Pages are counted logically (not
    /// this rank's host pages) so that every rank evicts the same nodes.
    pub fn evict_host_lru(&mut self, n_pages: usize) -> Result<Vec<NodeMetadata>, TreeError> {
        let mut cands = BTreeSet::new();
        for (id, n) in self.live_nodes() {
            if self.is_host_candidate(id, n) {
                cands.insert((n.stamp, id));
            }
        }
        let mut out = Vec::new();
        let mut released = 0;
        while released < n_pages {
            let Some((_, id)) = cands.pop_first() else {
                break;
            };
            let parent = self.get(id)?.parent;
            let n = self.remove_leaf(id)?;
            if let Some(meta) = n.host {
                released += meta.num_pages();
                out.push(meta);
            }
            if let Some(p) = parent {
                let pn = self.get(p)?;
                if self.is_host_candidate(p, pn) {
                    cands.insert((pn.stamp, p));
                }
            }
        }
        Ok(out)
    }

    /// Like [`RadixTree::evict_host_lru`], in the same order, but only removes host-only
    /// leaves that own at least one page of a rank still short (`deficit[rank]` host pages,
    /// ranks by the node's `page_owners`), and stops as soon as every deficit is covered or
    /// no candidate is left. The choice depends only on `page_owners`, which every rank
    /// shares, so every rank evicts the same nodes. It removes exactly the nodes of
    /// [`RadixTree::host_eviction_plan_for_ranks`], in its order.
    pub fn evict_host_for_ranks(
        &mut self,
        deficit: &[u32],
    ) -> Result<Vec<NodeMetadata>, TreeError> {
        let plan = self.host_eviction_plan_for_ranks(deficit)?;
        let mut out = Vec::with_capacity(plan.len());
        for id in plan {
            let n = self.remove_leaf(id)?;
            out.push(
                n.host.ok_or_else(|| {
                    invariant(format!("planned host eviction of {id} without host"))
                })?,
            );
        }
        Ok(out)
    }

    /// The nodes [`RadixTree::evict_host_for_ranks`] would remove, in order, leaving the tree
    /// as it is: a backup short of host pages decides on this whether evicting would cover
    /// its whole shortfall before evicting anything. A parent becomes a candidate once every
    /// child it has is planned.
    pub fn host_eviction_plan_for_ranks(&self, deficit: &[u32]) -> Result<Vec<NodeId>, TreeError> {
        let mut short = deficit.to_vec();
        let mut cands = BTreeSet::new();
        for (id, n) in self.live_nodes() {
            if self.is_host_candidate(id, n) {
                cands.insert((n.stamp, id));
            }
        }
        let mut planned_children: HashMap<NodeId, usize> = HashMap::new();
        let mut plan = Vec::new();
        while short.iter().any(|&d| d > 0) {
            let Some((_, id)) = cands.pop_first() else {
                break;
            };
            let n = self.get(id)?;
            let Some(meta) = n.host.as_ref() else {
                continue;
            };
            let helps = meta
                .page_owners()
                .iter()
                .any(|&o| short.get(usize::from(o)).is_some_and(|&s| s > 0));
            if !helps {
                continue;
            }
            for &o in meta.page_owners() {
                if let Some(s) = short.get_mut(usize::from(o)) {
                    *s = s.saturating_sub(1);
                }
            }
            plan.push(id);
            if let Some(p) = n.parent {
                let gone = planned_children.entry(p).or_default();
                *gone += 1;
                let pn = self.get(p)?;
                if Self::is_host_candidate_without(p, pn, *gone) {
                    cands.insert((pn.stamp, p));
                }
            }
        }
        Ok(plan)
    }

    /// Nodes whose device value holds one of `device`.
    fn nodes_holding_device(&self, device: &BTreeSet<PageId>) -> Vec<NodeId> {
        self.live_nodes()
            .filter(|(_, n)| {
                n.device
                    .as_ref()
                    .is_some_and(|d| d.iter().any(|p| device.contains(p)))
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// Nodes whose host metadata references one of `host` (this rank's host pages).
    pub fn nodes_holding_host(&self, host: &BTreeSet<HostPage>) -> BTreeSet<NodeId> {
        self.live_nodes()
            .filter(|(_, n)| {
                n.host
                    .as_ref()
                    .is_some_and(|m| m.host_pages().iter().any(|p| host.contains(p)))
            })
            .map(|(id, _)| id)
            .collect()
    }

    /// Forgets what a failed operation may have overwritten, on a tree restored from before
    /// it: every node holding one of `device` (pages the operation evicted, then possibly
    /// reused) loses its device value, and its device-resident descendants theirs (device
    /// residency is a prefix of every path); every node in `host_nodes` loses its host
    /// metadata. Nodes left with neither are removed with their subtrees. Returns the device
    /// pages and host metadata released, for the caller to free. Replicas stay identical when
    /// every rank is given the same sets (host nodes are chosen for the whole cluster: a node
    /// may own no host page on one rank and a reused one on another).
    pub fn drop_stale(
        &mut self,
        device: &BTreeSet<PageId>,
        host_nodes: &BTreeSet<NodeId>,
    ) -> Result<(Vec<PageId>, Vec<NodeMetadata>), TreeError> {
        let mut freed_pages = Vec::new();
        let mut freed_meta = Vec::new();
        if device.is_empty() && host_nodes.is_empty() {
            return Ok((freed_pages, freed_meta));
        }
        // Planned read-only first, so a locked node refuses the call before anything changes.
        let plan = self.stale_plan(device, host_nodes)?;
        for id in plan.loses_device {
            if let Some(d) = self.get_mut(id)?.device.take() {
                for p in &d {
                    self.held_device.remove(p);
                }
                freed_pages.extend(d);
            }
        }
        for &id in host_nodes {
            if !self.contains(id) {
                continue;
            }
            if let Some(m) = self.get_mut(id)?.host.take() {
                for p in m.host_pages() {
                    self.held_host.remove(p);
                }
                freed_meta.push(m);
            }
        }
        for id in plan.removed {
            let n = self.remove_leaf(id)?;
            freed_pages.extend(n.device.unwrap_or_default());
            freed_meta.extend(n.host);
        }
        Ok((freed_pages, freed_meta))
    }

    /// What [`RadixTree::drop_stale`] changes, found without changing anything: the nodes
    /// that lose their device value (the ones holding a page of `device`, and their
    /// device-resident descendants), and the nodes left holding nothing, with their
    /// subtrees, each subtree leaves first so that every removal is of a leaf. A locked node
    /// among the removed is a [`TreeError::Locked`].
    fn stale_plan(
        &self,
        device: &BTreeSet<PageId>,
        host_nodes: &BTreeSet<NodeId>,
    ) -> Result<StalePlan, TreeError> {
        let mut loses_device = Vec::new();
        let mut losing = HashSet::new();
        let mut stack = self.nodes_holding_device(device);
        while let Some(id) = stack.pop() {
            let n = self.get(id)?;
            if n.device.is_some() && losing.insert(id) {
                loses_device.push(id);
                stack.extend(n.children.values().copied());
            }
        }
        let mut removed = Vec::new();
        let mut removing = HashSet::new();
        for (id, n) in self.live_nodes() {
            let empty = id != NodeId::ROOT
                && (n.device.is_none() || losing.contains(&id))
                && (n.host.is_none() || host_nodes.contains(&id));
            if !empty || removing.contains(&id) {
                continue;
            }
            // A descendant planned earlier went with its own subtree, before this one.
            let mut order = Vec::new();
            let mut stack = vec![id];
            while let Some(d) = stack.pop() {
                if !removing.insert(d) {
                    continue;
                }
                let dn = self.get(d)?;
                if dn.lock > 0 {
                    return Err(TreeError::Locked {
                        node: d,
                        count: dn.lock,
                    });
                }
                order.push(d);
                stack.extend(dn.children.values().copied());
            }
            removed.extend(order.into_iter().rev());
        }
        Ok(StalePlan {
            loses_device,
            removed,
        })
    }

    /// SHA-256 over everything that must agree across ranks, in canonical order: layout,
    /// clock, slot allocation state (free slots with their generations), and per node its
    /// handle, key, device pages, whether it is backed up and the recorded page owners, lock
    /// count and stamp. This rank's host page slots (and the rank itself) are left out, since
    /// they differ between ranks.
    pub fn digest(&self) -> StateDigest {
        let mut h = Sha256::new();
        h.update(b"cp-hicache radix tree v1");
        h.update([self.layout.cp()]);
        h.update(self.layout.page_size().to_le_bytes());
        h.update(self.clock.to_le_bytes());
        h.update((self.slots.len() as u64).to_le_bytes());
        h.update((self.free_slots.len() as u64).to_le_bytes());
        for &s in &self.free_slots {
            // The generation the slot's next node gets: replicas must hand out equal handles.
            h.update(s.to_le_bytes());
            h.update(self.slots[s as usize].generation.to_le_bytes());
        }
        for id in self.node_ids() {
            let Ok(n) = self.get(id) else { continue };
            h.update(id.index.to_le_bytes());
            h.update(id.generation.to_le_bytes());
            h.update((n.key.len() as u64).to_le_bytes());
            for t in &n.key {
                h.update(t.to_le_bytes());
            }
            match &n.device {
                Some(d) => {
                    h.update([1]);
                    for p in d {
                        h.update(p.0.to_le_bytes());
                    }
                }
                None => h.update([0]),
            }
            match &n.host {
                Some(m) => {
                    h.update([1]);
                    h.update(m.page_owners());
                }
                None => h.update([0]),
            }
            h.update(n.lock.to_le_bytes());
            h.update(n.stamp.to_le_bytes());
            h.update((n.children.len() as u64).to_le_bytes());
        }
        StateDigest(h.finalize().into())
    }

    /// Verifies the structure: links, page alignment, value sizes, unique pages, residency
    /// rules and lock counts (see the module doc).
    pub fn check_invariants(&self) -> Result<(), TreeError> {
        let ps = self.ps();
        let mut device = HashSet::new();
        let mut host = HashSet::new();
        let mut reached = 0;
        for id in self.node_ids() {
            reached += 1;
            let n = self.get(id)?;
            let is_root = id == NodeId::ROOT;
            if is_root {
                if !n.key.is_empty() || n.device.is_some() || n.host.is_some() || n.lock != 0 {
                    return Err(invariant("the root holds a key, a value or a lock".into()));
                }
            } else {
                if n.key.is_empty() || n.key.len() % ps != 0 {
                    return Err(invariant(format!(
                        "{id}: key of {} tokens is not whole pages",
                        n.key.len()
                    )));
                }
                let parent = n
                    .parent
                    .ok_or_else(|| invariant(format!("{id} has no parent")))?;
                let pn = self.get(parent)?;
                if pn.children.get(&n.key[..ps]) != Some(&id) {
                    return Err(invariant(format!(
                        "{id} is not its parent's child for its first page"
                    )));
                }
                if n.device.is_none() && n.host.is_none() {
                    return Err(invariant(format!("{id} holds nothing")));
                }
                if n.device.is_some() && parent != NodeId::ROOT && pn.device.is_none() {
                    return Err(invariant(format!(
                        "{id} is on the device but its parent is not"
                    )));
                }
            }
            if n.stamp > self.clock {
                return Err(invariant(format!("{id} is stamped in the future")));
            }
            let pages = n.key.len() / ps;
            let mut child_locks: u64 = 0;
            for (first, &c) in &n.children {
                let cn = self.get(c)?;
                if cn.parent != Some(id) || cn.key.get(..ps) != Some(first.as_slice()) {
                    return Err(invariant(format!("{c} is badly linked under {id}")));
                }
                child_locks += u64::from(cn.lock);
            }
            if !is_root && u64::from(n.lock) < child_locks {
                return Err(invariant(format!(
                    "{id} has {} locks but its children {child_locks}",
                    n.lock
                )));
            }
            if let Some(d) = &n.device {
                if d.len() != pages {
                    return Err(invariant(format!(
                        "{id}: {} device pages for {pages} key pages",
                        d.len()
                    )));
                }
                for &p in d {
                    if p == PageId::NULL || !device.insert(p) {
                        return Err(invariant(format!("{p} is null or held twice")));
                    }
                }
            }
            if let Some(m) = &n.host {
                if m.num_pages() != pages || m.rank() != self.rank {
                    return Err(invariant(format!("{id}: host metadata does not fit")));
                }
                // The seed's bug: device pages whose owners differ from those recorded at
                // backup (`set_device` refuses them; only the injected fault gets past it).
                if let Some(d) = &n.device {
                    self.check_owners(id, d, m)?;
                }
                for &p in m.host_pages() {
                    if !host.insert(p) {
                        return Err(invariant(format!("host page {} is held twice", p.0)));
                    }
                }
            }
        }
        if reached != self.live {
            return Err(invariant(format!(
                "{reached} nodes reachable but {} live",
                self.live
            )));
        }
        if device != self.held_device || host != self.held_host {
            return Err(invariant("the held-page sets drifted".into()));
        }
        Ok(())
    }

    // ---- internals ----

    fn ps(&self) -> usize {
        self.layout.page_size() as usize
    }

    fn get(&self, id: NodeId) -> Result<&Node, TreeError> {
        self.slots
            .get(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.node.as_ref())
            .ok_or(TreeError::UnknownNode { node: id })
    }

    fn get_mut(&mut self, id: NodeId) -> Result<&mut Node, TreeError> {
        self.slots
            .get_mut(id.index as usize)
            .filter(|s| s.generation == id.generation)
            .and_then(|s| s.node.as_mut())
            .ok_or(TreeError::UnknownNode { node: id })
    }

    fn live_nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.slots.iter().enumerate().filter_map(|(i, s)| {
            s.node.as_ref().map(|n| {
                (
                    NodeId {
                        index: i as u32,
                        generation: s.generation,
                    },
                    n,
                )
            })
        })
    }

    fn not_root(&self, node: NodeId, op: &'static str) -> Result<(), TreeError> {
        if node == NodeId::ROOT {
            return Err(TreeError::Root { op });
        }
        Ok(())
    }

    fn alloc(&mut self, node: Node) -> NodeId {
        self.live += 1;
        if let Some(index) = self.free_slots.pop() {
            let slot = &mut self.slots[index as usize];
            slot.node = Some(node);
            return NodeId {
                index,
                generation: slot.generation,
            };
        }
        self.slots.push(Slot {
            generation: 0,
            node: Some(node),
        });
        NodeId {
            index: (self.slots.len() - 1) as u32,
            generation: 0,
        }
    }

    /// Rejects the null page, pages outside the layout (their owner and local slot would be
    /// garbage), and pages already held or repeated.
    fn check_new_pages(&self, pages: &[PageId]) -> Result<(), TreeError> {
        let mut seen = HashSet::with_capacity(pages.len());
        for (index, &page) in pages.iter().enumerate() {
            if page == PageId::NULL {
                return Err(TreeError::NullPage { index });
            }
            self.layout.check_page(page)?;
            if self.held_device.contains(&page) || !seen.insert(page) {
                return Err(TreeError::PageHeld { page });
            }
        }
        Ok(())
    }

    fn check_owners(
        &self,
        node: NodeId,
        pages: &[PageId],
        meta: &NodeMetadata,
    ) -> Result<(), TreeError> {
        for (index, (&page, &expected)) in pages.iter().zip(meta.page_owners()).enumerate() {
            let found = self.layout.owner(page).0;
            if found != expected {
                return Err(TreeError::OwnerMismatch {
                    node,
                    index,
                    page,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }

    /// Follows `tokens` (whole pages) from the root, splitting the node where the match ends
    /// inside one, and stamps the path with `now`. Returns the path (root excluded) and the
    /// matched page count.
    /// The device page the tree holds at each page position of the longest matching path,
    /// without changing anything (no split, no stamp).
    fn existing_device_pages(&self, tokens: &[u32]) -> Result<Vec<Option<PageId>>, TreeError> {
        let ps = self.ps();
        let mut out = Vec::new();
        let mut node = NodeId::ROOT;
        let mut pos = 0;
        while pos + ps <= tokens.len() {
            let Some(&child) = self.get(node)?.children.get(&tokens[pos..pos + ps]) else {
                break;
            };
            let c = self.get(child)?;
            let k = common_pages(&c.key, &tokens[pos..], ps);
            out.extend((0..k).map(|i| c.device.as_ref().map(|d| d[i])));
            pos += k * ps;
            if k < c.key.len() / ps {
                break;
            }
            node = child;
        }
        Ok(out)
    }

    fn descend(&mut self, tokens: &[u32], now: u64) -> Result<(Vec<NodeId>, usize), TreeError> {
        let ps = self.ps();
        let mut path = Vec::new();
        let mut node = NodeId::ROOT;
        let mut pos = 0;
        self.get_mut(node)?.stamp = now;
        while pos + ps <= tokens.len() {
            let Some(&child) = self.get(node)?.children.get(&tokens[pos..pos + ps]) else {
                break;
            };
            let c = self.get(child)?;
            let c_pages = c.key.len() / ps;
            let k = common_pages(&c.key, &tokens[pos..], ps);
            let partial = k < c_pages;
            let reached = if partial {
                self.split(child, k)?
            } else {
                child
            };
            self.get_mut(reached)?.stamp = now;
            path.push(reached);
            pos += k * ps;
            node = reached;
            if partial {
                break;
            }
        }
        Ok((path, pos / ps))
    }

    /// Splits `child` after `at_pages` pages. The new node takes the prefix (and the
    /// parent's link); `child` keeps its handle and the suffix, so outstanding handles (and
    /// locks) to it stay valid. Returns the new prefix node.
    fn split(&mut self, child: NodeId, at_pages: usize) -> Result<NodeId, TreeError> {
        let ps = self.ps();
        let at = at_pages * ps;
        let c = self.get(child)?;
        if at == 0 || at >= c.key.len() {
            return Err(invariant(format!("split of {child} at token {at}")));
        }
        let host_halves = match &c.host {
            Some(m) => Some(m.split(at as u64).map_err(|source| TreeError::Metadata {
                node: child,
                source,
            })?),
            None => None,
        };
        let parent = c
            .parent
            .ok_or_else(|| invariant(format!("{child} has no parent")))?;
        let (stamp, lock) = (c.stamp, c.lock);
        let n = self.get_mut(child)?;
        let suffix_key = n.key.split_off(at);
        let prefix_key = std::mem::replace(&mut n.key, suffix_key);
        let prefix_device = n.device.as_mut().map(|d| {
            let rest = d.split_off(at_pages);
            std::mem::replace(d, rest)
        });
        let (prefix_host, suffix_host) = match host_halves {
            Some((l, r)) => (Some(l), Some(r)),
            None => (None, None),
        };
        n.host = suffix_host;
        let suffix_first = n.key[..ps].to_vec();
        let new_id = self.alloc(Node {
            key: prefix_key.clone(),
            children: BTreeMap::from([(suffix_first, child)]),
            parent: Some(parent),
            device: prefix_device,
            host: prefix_host,
            lock,
            stamp,
        });
        self.get_mut(child)?.parent = Some(new_id);
        self.get_mut(parent)?
            .children
            .insert(prefix_key[..ps].to_vec(), new_id);
        Ok(new_id)
    }

    /// Whether `n` is an unlocked device leaf once the `planned` nodes left the device.
    fn is_device_candidate(
        &self,
        id: NodeId,
        n: &Node,
        planned: &HashSet<NodeId>,
    ) -> Result<bool, TreeError> {
        if id == NodeId::ROOT || n.lock > 0 || n.device.is_none() {
            return Ok(false);
        }
        for &c in n.children.values() {
            if self.get(c)?.device.is_some() && !planned.contains(&c) {
                return Ok(false);
            }
        }
        Ok(true)
    }

    fn is_host_candidate(&self, id: NodeId, n: &Node) -> bool {
        Self::is_host_candidate_without(id, n, 0)
    }

    /// Whether `n` would be a host-eviction candidate once `gone` of its children were removed.
    fn is_host_candidate_without(id: NodeId, n: &Node, gone: usize) -> bool {
        id != NodeId::ROOT
            && n.lock == 0
            && n.device.is_none()
            && n.host.is_some()
            && n.children.len() == gone
    }

    /// Walks the device candidates in eviction order (oldest stamp, then lower `NodeId`) as
    /// evicting would, without changing the tree: a parent becomes a candidate once none of
    /// its children is on the device or every one that is was planned. `target` decides
    /// which candidates to take and when the walk stops.
    fn device_eviction_plan(
        &self,
        mut target: impl DeviceTarget,
    ) -> Result<Vec<NodeId>, TreeError> {
        let mut cands = BTreeSet::new();
        for (id, n) in self.live_nodes() {
            if self.is_device_candidate(id, n, &HashSet::new())? {
                cands.insert((n.stamp, id));
            }
        }
        let mut planned = HashSet::new();
        let mut plan = Vec::new();
        while !target.met() {
            let Some((_, id)) = cands.pop_first() else {
                break;
            };
            let n = self.get(id)?;
            if !target.take(n.device.as_deref().unwrap_or_default()) {
                continue;
            }
            planned.insert(id);
            plan.push(id);
            if let Some(p) = n.parent {
                let pn = self.get(p)?;
                if self.is_device_candidate(p, pn, &planned)? {
                    cands.insert((pn.stamp, p));
                }
            }
        }
        Ok(plan)
    }

    /// Evicts the nodes of a device eviction plan, in order.
    fn evict_device_plan(&mut self, plan: Vec<NodeId>) -> Result<Vec<Evicted>, TreeError> {
        plan.into_iter()
            .map(|id| self.evict_device_node(id))
            .collect()
    }

    /// Evicts one device leaf: drops its device pages and, if it is not backed up, removes
    /// it with its subtree.
    fn evict_device_node(&mut self, id: NodeId) -> Result<Evicted, TreeError> {
        if !self.is_device_candidate(id, self.get(id)?, &HashSet::new())? {
            return Err(invariant(format!(
                "planned device eviction of {id}, not a device leaf"
            )));
        }
        let n = self.get_mut(id)?;
        let device_pages = n.device.take().unwrap_or_default();
        let backed_up = n.host.is_some();
        for p in &device_pages {
            self.held_device.remove(p);
        }
        let mut host_released = Vec::new();
        if !backed_up {
            // Children are off the device (the node was a device leaf), so by the residency
            // rules the whole subtree is host-only and unlocked: it goes too.
            let mut stack: Vec<NodeId> = self.get(id)?.children.values().copied().collect();
            let mut order = Vec::new();
            while let Some(d) = stack.pop() {
                order.push(d);
                stack.extend(self.get(d)?.children.values().copied());
            }
            for d in order.into_iter().rev() {
                if let Some(m) = self.remove_leaf(d)?.host {
                    host_released.push(m);
                }
            }
            self.remove_leaf(id)?;
        }
        Ok(Evicted {
            node: id,
            device_pages,
            removed: !backed_up,
            host_released,
        })
    }

    /// Unlinks a childless node, frees its slot and its held pages, and returns it.
    fn remove_leaf(&mut self, id: NodeId) -> Result<Node, TreeError> {
        self.not_root(id, "remove")?;
        let ps = self.ps();
        let n = self.get(id)?;
        if !n.children.is_empty() {
            return Err(invariant(format!("removing {id}, which has children")));
        }
        let parent = n
            .parent
            .ok_or_else(|| invariant(format!("{id} has no parent")))?;
        let first = n.key[..ps].to_vec();
        self.get_mut(parent)?.children.remove(&first);
        let slot = &mut self.slots[id.index as usize];
        let n = slot
            .node
            .take()
            .ok_or(TreeError::UnknownNode { node: id })?;
        slot.generation = slot.generation.wrapping_add(1);
        self.free_slots.push(id.index);
        self.live -= 1;
        if let Some(d) = &n.device {
            for p in d {
                self.held_device.remove(p);
            }
        }
        if let Some(m) = &n.host {
            for p in m.host_pages() {
                self.held_host.remove(p);
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(cp: u32, ps: u32) -> RadixTree {
        RadixTree::new(CpLayout::new(cp, ps, 1024).unwrap(), Rank(0)).unwrap()
    }

    fn pages(v: &[u32]) -> Vec<PageId> {
        v.iter().copied().map(PageId).collect()
    }

    /// Replicas that would hand out different handles for their next node must not hash
    /// equal: the free slots' generations are part of the digest.
    #[test]
    fn the_digest_covers_free_slot_generations() {
        let mut t = tree(1, 2);
        t.insert(&[1, 2], &pages(&[10])).unwrap();
        assert_eq!(t.evict_device_lru(usize::MAX).unwrap().len(), 1);
        let free = *t
            .free_slots
            .first()
            .expect("the evicted node's slot is free");
        let mut other = t.clone();
        other.slots[free as usize].generation += 1;
        assert_ne!(t.digest(), other.digest());
    }

    /// A host-only node (CP 2, owners 0,1, rank 0 holding host page 7) and its key.
    fn host_only_node() -> (RadixTree, NodeId, Vec<u32>) {
        let mut t = tree(2, 2);
        let key = vec![1, 2, 3, 4];
        let node = t.insert(&key, &pages(&[2, 3])).unwrap().node;
        let meta = NodeMetadata::new(&t.layout, Rank(0), vec![0, 1], vec![HostPage(7)]).unwrap();
        t.set_host(node, meta).unwrap();
        t.take_device(node).unwrap();
        (t, node, key)
    }

    /// Pages with the owners the host copy records are adopted and the copy stays.
    #[test]
    fn insert_keeps_a_host_copy_whose_owners_match() {
        let (mut t, node, key) = host_only_node();
        let r = t.insert(&key, &pages(&[4, 5])).unwrap();
        assert_eq!(r.adopted_pages, 2);
        assert!(r.dropped_host_copies.is_empty());
        let n = t.node(node).unwrap();
        assert_eq!(n.device(), Some(&pages(&[4, 5])[..]));
        assert_eq!(n.host().unwrap().host_pages(), &[HostPage(7)]);
        t.check_invariants().unwrap();
    }

    /// Pages with other owners (a recompute after a degraded load-back) replace the host
    /// copy: it comes back for the caller to free, and no device page sits under a host
    /// copy that names another owner. See: issue 20.
    #[test]
    fn r20_insert_replaces_a_host_copy_whose_owners_differ() {
        let (mut t, node, key) = host_only_node();
        let r = t.insert(&key, &pages(&[4, 6])).unwrap();
        assert_eq!(r.adopted_pages, 2);
        assert_eq!(r.dropped_host_copies.len(), 1);
        assert_eq!(r.dropped_host_copies[0].host_pages(), &[HostPage(7)]);
        let n = t.node(node).unwrap();
        assert_eq!(n.device(), Some(&pages(&[4, 6])[..]));
        assert!(n.host().is_none());
        t.check_invariants().unwrap();
        // The host page is free for another node again.
        let other = t.insert(&[9, 9], &pages(&[8])).unwrap().node;
        let meta = NodeMetadata::new(&t.layout, Rank(0), vec![0], vec![HostPage(7)]).unwrap();
        t.set_host(other, meta).unwrap();
    }

    #[test]
    fn match_splits_at_page_boundaries_only() {
        let mut t = tree(1, 2);
        let r = t
            .insert(&[1, 2, 3, 4, 5, 6], &pages(&[10, 11, 12]))
            .unwrap();
        assert_eq!(r.prefix_tokens, 0);
        // The match diverges inside page 1: only page 0 matches, the node splits after it.
        let m = t.match_prefix(&[1, 2, 3, 9, 5, 6]).unwrap();
        assert_eq!(m.matched_tokens, 2);
        assert_eq!(m.device_pages, pages(&[10]));
        assert_eq!(t.node_count(), 2);
        // A trailing partial page never matches.
        let m = t.match_prefix(&[1, 2, 3]).unwrap();
        assert_eq!(m.matched_tokens, 2);
        let m = t.match_prefix(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
        assert_eq!(m.device_pages, pages(&[10, 11, 12]));
        assert_eq!(m.last_node, r.node, "the suffix keeps the original handle");
        t.check_invariants().unwrap();
    }

    #[test]
    fn insert_returns_duplicates_and_rejects_bad_input() {
        let mut t = tree(1, 2);
        t.insert(&[1, 2, 3, 4], &pages(&[10, 11])).unwrap();
        let r = t
            .insert(&[1, 2, 3, 4, 7, 8], &pages(&[20, 21, 22]))
            .unwrap();
        assert_eq!(r.duplicate_pages, pages(&[20, 21]));
        assert_eq!(r.prefix_tokens, 4);
        assert_eq!(t.device_pages(), 3);
        assert!(matches!(
            t.insert(&[1, 2, 3], &pages(&[30, 31])),
            Err(TreeError::LengthMismatch { .. })
        ));
        assert_eq!(
            t.insert(&[5, 5], &pages(&[10])),
            Err(TreeError::PageHeld { page: PageId(10) })
        );
        assert_eq!(
            t.insert(&[5, 5], &pages(&[0])),
            Err(TreeError::NullPage { index: 0 })
        );
        for page in [1024, u32::MAX] {
            assert_eq!(
                t.insert(&[5, 5], &pages(&[page])),
                Err(TreeError::Layout(LayoutError::PageOutOfRange {
                    page: PageId(page),
                    pages: 1024
                }))
            );
        }
        assert_eq!(t.device_pages(), 3, "a refused insert holds nothing");
        t.check_invariants().unwrap();
    }

    #[test]
    fn host_eviction_for_ranks_takes_only_nodes_that_help() {
        let layout = CpLayout::new(2, 1, 64).unwrap();
        let mut t = RadixTree::new(layout, Rank(0)).unwrap();
        // Oldest first: a owns only rank 1's pages, b one of each, c only rank 0's.
        let mut ids = Vec::new();
        for (i, (tokens, p, owners, host)) in [
            (vec![1, 1], pages(&[3, 5]), vec![1, 1], vec![]),
            (vec![2, 2], pages(&[2, 7]), vec![0, 1], vec![0]),
            (vec![3, 3], pages(&[4, 6]), vec![0, 0], vec![1, 2]),
        ]
        .into_iter()
        .enumerate()
        {
            let node = t.insert(&tokens, &p).unwrap().node;
            let host = host.into_iter().map(HostPage).collect();
            t.set_host(
                node,
                NodeMetadata::new(&layout, Rank(0), owners, host).unwrap(),
            )
            .unwrap();
            t.take_device(node).unwrap();
            ids.push((i, node));
        }
        // Rank 0 is short of 2 host pages: a does not help, b gives 1, c the other.
        let gone = t.evict_host_for_ranks(&[2, 0]).unwrap();
        let owners: Vec<&[u8]> = gone.iter().map(|m| m.page_owners()).collect();
        assert_eq!(owners, vec![&[0, 1][..], &[0, 0][..]]);
        assert!(t.contains(ids[0].1));
        assert!(!t.contains(ids[1].1) && !t.contains(ids[2].1));
        // Nothing short: nothing evicted.
        assert!(t.evict_host_for_ranks(&[0, 0]).unwrap().is_empty());
        t.check_invariants().unwrap();
    }

    #[test]
    fn split_keeps_host_metadata_consistent() {
        let layout = CpLayout::new(2, 2, 64).unwrap();
        let mut t = RadixTree::new(layout, Rank(1)).unwrap();
        let p = pages(&[2, 3, 5, 4]); // owners 0,1,1,0
        let r = t.insert(&[1, 1, 2, 2, 3, 3, 4, 4], &p).unwrap();
        let meta = NodeMetadata::new(
            &layout,
            Rank(1),
            vec![0, 1, 1, 0],
            vec![HostPage(7), HostPage(8)],
        )
        .unwrap();
        t.set_host(r.node, meta).unwrap();
        let m = t.match_prefix(&[1, 1, 2, 2, 9, 9]).unwrap();
        let left = t.node(m.last_node).unwrap().host().unwrap().clone();
        let right = t.node(r.node).unwrap().host().unwrap().clone();
        assert_eq!(left.page_owners(), &[0, 1]);
        assert_eq!(left.host_pages(), &[HostPage(7)]);
        assert_eq!(right.page_owners(), &[1, 0]);
        assert_eq!(right.host_pages(), &[HostPage(8)]);
        t.check_invariants().unwrap();
    }

    #[test]
    fn set_device_checks_owners_and_order() {
        let layout = CpLayout::new(2, 1, 64).unwrap();
        let mut t = RadixTree::new(layout, Rank(0)).unwrap();
        let a = t.insert(&[1, 2], &pages(&[2, 3])).unwrap().node;
        let b = t.insert(&[1, 2, 3], &pages(&[12, 13, 4])).unwrap();
        assert_eq!(b.duplicate_pages, pages(&[12, 13]));
        let b = b.node;
        let meta = |owners: Vec<u8>, host: Vec<u32>| {
            NodeMetadata::new(
                &layout,
                Rank(0),
                owners,
                host.into_iter().map(HostPage).collect(),
            )
            .unwrap()
        };
        assert!(matches!(
            t.set_host(a, meta(vec![1, 1], vec![])),
            Err(TreeError::OwnerMismatch { index: 0, .. })
        ));
        t.set_host(a, meta(vec![0, 1], vec![1])).unwrap();
        t.set_host(b, meta(vec![0], vec![2])).unwrap();
        assert!(matches!(
            t.take_device(a),
            Err(TreeError::ChildOnDevice { .. })
        ));
        assert_eq!(t.take_device(b).unwrap(), pages(&[4]));
        assert_eq!(t.take_device(a).unwrap(), pages(&[2, 3]));
        assert!(matches!(
            t.set_device(b, pages(&[6])),
            Err(TreeError::ParentNotOnDevice { .. })
        ));
        // The seed's bug: pages with the wrong owners are refused on the load path.
        assert!(matches!(
            t.set_device(a, pages(&[3, 5])),
            Err(TreeError::OwnerMismatch { index: 0, .. })
        ));
        t.set_device(a, pages(&[4, 5])).unwrap();
        t.set_device(b, pages(&[6])).unwrap();
        assert!(matches!(t.take_host(a), Ok(Some(_))));
        assert!(matches!(
            t.take_device(a),
            Err(TreeError::WouldEmpty { .. })
        ));
        t.check_invariants().unwrap();
    }

    /// Runs `misuse` on `t` and records in `broken` unless it fails with exactly `want` and
    /// leaves the digest, the host pages (which the digest leaves out) and the invariants as
    /// they were.
    fn refused(
        broken: &mut Vec<String>,
        name: &str,
        t: &mut RadixTree,
        misuse: impl FnOnce(&mut RadixTree) -> Result<(), TreeError>,
        want: TreeError,
    ) {
        let host = |t: &RadixTree| -> Vec<(NodeId, Vec<HostPage>)> {
            t.node_ids()
                .into_iter()
                .filter_map(|id| Some((id, t.node(id).ok()?.host()?.host_pages().to_vec())))
                .collect()
        };
        let (digest, held) = (t.digest(), host(t));
        match misuse(t) {
            Err(e) if e == want => {}
            other => broken.push(format!("{name}: got {other:?}, want Err({want:?})")),
        }
        if t.digest() != digest || host(t) != held {
            broken.push(format!("{name}: the refused call changed the tree"));
        }
        if let Err(e) = t.check_invariants() {
            broken.push(format!("{name}: {e}"));
        }
    }

    /// Every state guard refuses its misuse with its own variant and changes nothing: these
    /// guards stop a device or host page from being held twice and KV from being taken from
    /// under a request, and no other test drives the tree into them. Each case starts from a
    /// fresh tree and failures are collected, so a mutant names every guard it broke. Each
    /// misuse would succeed without its guard (right owners, free pages).
    #[test]
    fn misuse_is_refused_and_changes_nothing() {
        let layout = CpLayout::new(2, 1, 64).unwrap();
        let owners =
            |p: &[u32]| -> Vec<u8> { p.iter().map(|&p| layout.owner(PageId(p)).0).collect() };
        let meta = |rank: u8, owners: Vec<u8>, host: &[u32]| {
            let host = host.iter().copied().map(HostPage).collect();
            NodeMetadata::new(&layout, Rank(rank), owners, host).unwrap()
        };
        // a [2, 3] on the device, backed up in host page 1; its child b [4] on the device
        // only; c host-only in host page 2.
        let fixture = || {
            let mut t = RadixTree::new(layout, Rank(0)).unwrap();
            let a = t.insert(&[1, 2], &pages(&[2, 3])).unwrap().node;
            let b = t.insert(&[1, 2, 3], &pages(&[12, 13, 4])).unwrap().node;
            let c = t.insert(&[5, 6], &pages(&[10, 11])).unwrap().node;
            t.set_host(a, meta(0, owners(&[2, 3]), &[1])).unwrap();
            t.set_host(c, meta(0, owners(&[10, 11]), &[2])).unwrap();
            t.take_device(c).unwrap();
            t.check_invariants().unwrap();
            (t, a, b, c)
        };
        let mut broken = Vec::new();
        let bad = &mut broken;

        let (mut t, a, _, _) = fixture();
        let want = TreeError::AlreadyOnDevice { node: a };
        refused(
            bad,
            "AlreadyOnDevice",
            &mut t,
            |t| t.set_device(a, pages(&[8, 9])),
            want,
        );

        let (mut t, _, _, c) = fixture();
        let want = TreeError::PageCount {
            node: c,
            expected: 2,
            found: 1,
        };
        refused(
            bad,
            "set_device PageCount",
            &mut t,
            |t| t.set_device(c, pages(&[6])),
            want,
        );

        let (mut t, _, b, _) = fixture();
        let want = TreeError::RankMismatch {
            expected: 0,
            found: 1,
        };
        let m = meta(1, owners(&[4]), &[]);
        refused(bad, "RankMismatch", &mut t, |t| t.set_host(b, m), want);

        let (mut t, a, _, _) = fixture();
        let want = TreeError::AlreadyOnHost { node: a };
        let m = meta(0, owners(&[2, 3]), &[5]);
        refused(bad, "AlreadyOnHost", &mut t, |t| t.set_host(a, m), want);

        let (mut t, _, b, _) = fixture();
        let want = TreeError::PageCount {
            node: b,
            expected: 1,
            found: 2,
        };
        let m = meta(0, owners(&[4, 6]), &[7, 8]);
        refused(
            bad,
            "set_host PageCount",
            &mut t,
            |t| t.set_host(b, m),
            want,
        );

        let (mut t, _, b, _) = fixture();
        let want = TreeError::HostPageHeld { page: HostPage(1) };
        let m = meta(0, owners(&[4]), &[1]); // a's host page
        refused(bad, "HostPageHeld", &mut t, |t| t.set_host(b, m), want);

        let (mut t, _, b, _) = fixture();
        t.set_host(b, meta(0, owners(&[4]), &[3])).unwrap();
        t.lock(b).unwrap();
        let want = TreeError::Locked { node: b, count: 1 };
        refused(
            bad,
            "take_device Locked",
            &mut t,
            |t| t.take_device(b).map(drop),
            want,
        );

        // b's page went stale: b would be left empty and removed, but a request holds it.
        let (mut t, _, b, _) = fixture();
        t.lock(b).unwrap();
        let stale = BTreeSet::from([PageId(4)]);
        let want = TreeError::Locked { node: b, count: 1 };
        let drop_b = |t: &mut RadixTree| t.drop_stale(&stale, &BTreeSet::new()).map(drop);
        refused(bad, "drop_stale Locked", &mut t, drop_b, want);

        // A handle to a reused slot, or to a slot that never existed, names no node.
        let (mut t, a, _, _) = fixture();
        let gone = NodeId {
            index: a.index,
            generation: a.generation + 1,
        };
        let want = TreeError::UnknownNode { node: gone };
        refused(
            bad,
            "UnknownNode",
            &mut t,
            |t| t.set_device(gone, pages(&[8, 9])),
            want,
        );
        let never = NodeId {
            index: 99,
            generation: 0,
        };
        let want = TreeError::UnknownNode { node: never };
        refused(
            bad,
            "UnknownNode",
            &mut t,
            |t| t.take_device(never).map(drop),
            want,
        );

        let (mut t, ..) = fixture();
        let root = NodeId::ROOT;
        let want = |op| TreeError::Root { op };
        refused(
            bad,
            "Root",
            &mut t,
            |t| t.set_device(root, vec![]),
            want("set_device"),
        );
        let m = meta(0, vec![], &[]);
        refused(
            bad,
            "Root",
            &mut t,
            |t| t.set_host(root, m),
            want("set_host"),
        );
        let take = |t: &mut RadixTree| t.take_device(root).map(drop);
        refused(bad, "Root", &mut t, take, want("take_device"));
        let take = |t: &mut RadixTree| t.take_host(root).map(drop);
        refused(bad, "Root", &mut t, take, want("take_host"));

        assert!(
            broken.is_empty(),
            "guards that did not hold:\n{}",
            broken.join("\n")
        );
    }

    #[test]
    fn locks_cover_the_path_and_never_go_negative() {
        let mut t = tree(1, 1);
        let a = t.insert(&[1, 2], &pages(&[1, 2])).unwrap().node;
        let b = t.insert(&[1, 2, 3], &pages(&[9, 9 + 1, 3])).unwrap().node;
        t.lock(b).unwrap();
        assert_eq!(t.node(a).unwrap().lock_count(), 1);
        assert_eq!(t.evictable_device_pages(), 0);
        assert!(t.evict_device_lru(10).unwrap().is_empty());
        t.unlock(b).unwrap();
        assert_eq!(
            t.unlock(b),
            Err(TreeError::UnlockBelowZero { node: b, at: a })
        );
        t.check_invariants().unwrap();
    }

    #[test]
    fn device_eviction_is_lru_and_removes_unbacked_nodes() {
        let mut t = tree(1, 1);
        let a = t.insert(&[1, 2], &pages(&[1, 2])).unwrap().node;
        let b = t.insert(&[3, 4], &pages(&[3, 4])).unwrap().node;
        let c = t.insert(&[1, 2, 5], &pages(&[11, 12, 5])).unwrap().node;
        t.match_prefix(&[3]).unwrap(); // splits b and touches its prefix
        let ev = t.evict_device_lru(1).unwrap();
        // Device leaves: b's suffix [4] (stamp 2; the split left it untouched) and c (3).
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].node, b);
        assert_eq!(ev[0].device_pages, pages(&[4]));
        assert!(ev[0].removed);
        let ev = t.evict_device_lru(2).unwrap();
        let nodes: Vec<_> = ev.iter().map(|e| e.node).collect();
        assert_eq!(nodes, vec![c, a]);
        assert!(!t.contains(a));
        assert_eq!(t.device_pages(), 1);
        t.check_invariants().unwrap();
    }

    #[test]
    fn lane_eviction_skips_nodes_of_full_lanes() {
        let layout = CpLayout::new(2, 1, 64).unwrap();
        let mut t = RadixTree::new(layout, Rank(0)).unwrap();
        let a = t.insert(&[1], &pages(&[2])).unwrap().node; // lane 0, oldest
        let b = t.insert(&[2], &pages(&[3])).unwrap().node; // lane 1
        let c = t.insert(&[3, 3], &pages(&[5, 7])).unwrap().node; // lane 1
        let d = t.insert(&[4], &pages(&[9])).unwrap().node; // lane 1, newest
        let ev = t.evict_device_for_lanes(&[0, 3]).unwrap();
        let nodes: Vec<_> = ev.iter().map(|e| e.node).collect();
        assert_eq!(nodes, vec![b, c], "a has no lane-1 page; c covers the rest");
        assert!(t.contains(a) && t.contains(d));
        // Nothing left can cover lane 1 beyond d: stop when candidates run out.
        let ev = t.evict_device_for_lanes(&[0, 5]).unwrap();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].node, d);
        assert!(t.evict_device_for_lanes(&[0, 0]).unwrap().is_empty());
        t.check_invariants().unwrap();
    }

    #[test]
    fn digest_tracks_state() {
        let mut t = tree(2, 2);
        let d0 = t.digest();
        t.insert(&[1, 2], &pages(&[1])).unwrap();
        let d1 = t.digest();
        assert_ne!(d0, d1);
        let mut u = t.clone();
        assert_eq!(u.digest(), d1);
        u.match_prefix(&[1, 2]).unwrap();
        assert_ne!(u.digest(), d1, "the clock and stamps are part of the state");
    }

    #[test]
    fn long_path_matches_in_one_walk() {
        let ps = 64;
        let n_pages = 2048; // 128k tokens
        let mut t = RadixTree::new(CpLayout::new(1, ps, n_pages + 1).unwrap(), Rank(0)).unwrap();
        let tokens: Vec<u32> = (0..n_pages * ps).collect();
        let p: Vec<PageId> = (1..=n_pages).map(PageId).collect();
        t.insert(&tokens, &p).unwrap();
        let m = t.match_prefix(&tokens).unwrap();
        assert_eq!(m.matched_tokens, tokens.len());
        assert_eq!(m.device_pages, p);
    }
}
