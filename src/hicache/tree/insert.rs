//! Putting things in the tree and taking them out again: inserting sequences, a node's device
//! value and host copy, and the locks that keep a path from eviction.

use super::{invariant, InsertResult, Node, NodeId, RadixTree, TreeError};
use crate::layout::{LayoutError, PageId};
use crate::metadata::NodeMetadata;
use std::collections::{BTreeMap, HashSet};

impl RadixTree {
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
        let (ps, unit) = (self.ps(), self.unit());
        if pages.len().checked_mul(ps) != Some(tokens.len()) {
            return Err(TreeError::LengthMismatch {
                tokens: tokens.len(),
                pages: pages.len(),
                page_size: self.layout.page_size(),
            });
        }
        if tokens.len() % unit != 0 {
            return Err(TreeError::Layout(LayoutError::Misaligned {
                what: format!(
                    "{} pages inserted, not whole granules of {} pages",
                    pages.len(),
                    self.granule()
                ),
            }));
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
        if self.granule() > 1 {
            // Every granule must be an aligned group, except one made of the tree's own pages
            // at their own positions: those were checked when they were put on the device
            // (only an injected fault, `set_device_ignoring_owners`, puts others there, and
            // verification and the audit are what must catch it).
            let cp = self.granule();
            for (g, group) in pages.chunks(cp).enumerate() {
                let own = group
                    .iter()
                    .enumerate()
                    .all(|(r, p)| existing.get(g * cp + r) == Some(&Some(*p)));
                if !own {
                    crate::layout::check_aligned_groups(self.layout.cp(), group).map_err(|e| {
                        match e {
                            // Named as the whole sequence's granule, not the group's.
                            LayoutError::Misaligned { what } => LayoutError::Misaligned {
                                what: what.replacen("granule 0:", &format!("granule {g}:"), 1),
                            },
                            other => other,
                        }
                    })?;
                }
            }
        }
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
            let first = leaf.key[..unit].to_vec();
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

    /// Like [`RadixTree::set_device`] but without the owner checks (the recorded owners, and
    /// under the positional layouts the aligned groups that are their owners): it reproduces
    /// the seed's bug on purpose, for the `plain-alloc-on-load` and `granule-shift-on-load`
    /// fault injections, so that the verifier can show it catches what these checks would
    /// otherwise have stopped. Crate-private: nothing outside the fault injection may put
    /// pages on the device without the owner checks.
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
        if self.granule() > 1 && check_owners {
            crate::layout::check_aligned_groups(self.layout.cp(), &pages)?;
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

    /// Adds a host-only leaf under `parent` holding `key` (whole granules), whose copy is
    /// `meta`: pages read from the storage tier, which a load-back then brings to the
    /// device like any host copy. `parent` must be the root or a node whose prefix `key`
    /// continues, with no child starting like `key` (the caller matched up to `parent`).
    pub fn insert_host_leaf(
        &mut self,
        parent: NodeId,
        key: &[u32],
        meta: NodeMetadata,
    ) -> Result<NodeId, TreeError> {
        let (ps, unit) = (self.ps(), self.unit());
        if key.is_empty() || key.len() % unit != 0 {
            return Err(TreeError::Layout(LayoutError::Misaligned {
                what: format!(
                    "a host-only leaf of {} tokens, not whole granules of {unit} tokens",
                    key.len()
                ),
            }));
        }
        if self.get(parent)?.children.contains_key(&key[..unit]) {
            return Err(invariant(format!(
                "{parent} already has a child starting like the leaf added under it"
            )));
        }
        meta.check_layout(&self.layout)
            .map_err(|source| TreeError::Metadata {
                node: parent,
                source,
            })?;
        if meta.rank() != self.rank {
            return Err(TreeError::RankMismatch {
                expected: self.rank.0,
                found: meta.rank().0,
            });
        }
        if meta.num_pages() != key.len() / ps {
            return Err(TreeError::PageCount {
                node: parent,
                expected: key.len() / ps,
                found: meta.num_pages(),
            });
        }
        if let Some(&page) = meta
            .host_pages()
            .iter()
            .find(|p| self.held_host.contains(p))
        {
            return Err(TreeError::HostPageHeld { page });
        }
        self.clock += 1;
        let leaf = Node {
            key: key.to_vec(),
            children: BTreeMap::new(),
            parent: Some(parent),
            device: None,
            host: None,
            lock: 0,
            stamp: self.clock,
        };
        self.held_host.extend(meta.host_pages().iter().copied());
        let id = self.alloc(leaf);
        self.get_mut(id)?.host = Some(meta);
        self.get_mut(parent)?
            .children
            .insert(key[..unit].to_vec(), id);
        Ok(id)
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

    pub(super) fn check_owners(
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
}
