//! Forgetting stale state after a failed operation: the nodes that hold pages it may have
//! overwritten, and dropping their values.

use super::{NodeId, RadixTree, TreeError};
use crate::layout::PageId;
use crate::metadata::{HostPage, NodeMetadata};
use std::collections::{BTreeSet, HashSet};

/// The changes of one [`RadixTree::drop_stale`], planned before any is made.
struct StalePlan {
    /// Nodes whose device value goes, in the order their pages are freed.
    loses_device: Vec<NodeId>,
    /// Nodes removed, each after its children.
    removed: Vec<NodeId>,
}

impl RadixTree {
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
}
