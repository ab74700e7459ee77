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

mod audit;
mod evict;
mod insert;
mod matching;
mod stale;

use crate::layout::{CpLayout, LayoutError, PageId, Rank};
use crate::metadata::{HostPage, MetadataError, NodeMetadata};
use std::collections::{BTreeMap, HashSet};
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

    // ---- internals ----

    fn ps(&self) -> usize {
        self.layout.page_size() as usize
    }

    /// Tokens per granule: keys are whole granules and children are keyed by their first.
    fn unit(&self) -> usize {
        self.ps() * self.granule()
    }

    /// Pages per granule (1, or `cp` under the interleaved layouts).
    fn granule(&self) -> usize {
        self.layout.granule() as usize
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
}

#[cfg(test)]
mod tests;
