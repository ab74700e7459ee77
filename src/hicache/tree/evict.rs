//! Eviction: choosing device leaves and host-only leaves in LRU order, planning without
//! changing the tree, and removing what was chosen.

use super::{invariant, Evicted, Node, NodeId, RadixTree, TreeError};
use crate::layout::{CpLayout, PageId};
use crate::metadata::NodeMetadata;
use std::collections::{BTreeSet, HashMap, HashSet};

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
    pub(super) fn remove_leaf(&mut self, id: NodeId) -> Result<Node, TreeError> {
        self.not_root(id, "remove")?;
        let unit = self.unit();
        let n = self.get(id)?;
        if !n.children.is_empty() {
            return Err(invariant(format!("removing {id}, which has children")));
        }
        let parent = n
            .parent
            .ok_or_else(|| invariant(format!("{id} has no parent")))?;
        let first = n.key[..unit].to_vec();
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
