//! Checking a tree: the digests replicas compare and the structural invariants.

use super::{invariant, NodeId, RadixTree, TreeError};
use crate::allocator::StateDigest;
use crate::layout::PageId;
use sha2::{Digest, Sha256};
use std::collections::HashSet;

impl RadixTree {
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
        let (ps, unit) = (self.ps(), self.unit());
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
                if n.key.is_empty() || n.key.len() % unit != 0 {
                    return Err(invariant(format!(
                        "{id}: key of {} tokens is not whole granules",
                        n.key.len()
                    )));
                }
                let parent = n
                    .parent
                    .ok_or_else(|| invariant(format!("{id} has no parent")))?;
                let pn = self.get(parent)?;
                if pn.children.get(&n.key[..unit]) != Some(&id) {
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
                if cn.parent != Some(id) || cn.key.get(..unit) != Some(first.as_slice()) {
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
}
