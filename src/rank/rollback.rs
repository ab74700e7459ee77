//! All or nothing across the group: a rank's snapshot before an operation, the agreement
//! on its outcome, and the rollback every rank makes when any rank failed.

use super::*;

/// This rank's state as it was before an operation, to roll back to on error.
pub(super) struct Snapshot {
    tree: RadixTree,
    mirror: OwnerLaneAllocator,
    host: HostPagePool,
}

/// What the operation in progress freed on this rank: device pages (identical on every
/// rank) and host pages (this rank's). Their bytes may since have been overwritten by the
/// same operation, so a rollback must not bring back nodes that still point at them.
#[derive(Default)]
pub(super) struct Freed {
    pub(super) device: BTreeSet<PageId>,
    pub(super) host: BTreeSet<HostPage>,
}

impl RankCache {
    /// Runs `step` as one operation every rank makes, all or nothing across the group: it
    /// succeeds on every rank, or every rank restores its state from before it. A rank
    /// whose step failed tells the group (its failure ends the round its peers are in); a
    /// rank that learns of a peer's failure stops there. An error that broke the group is
    /// returned without a rollback: no agreement on one is possible.
    pub(super) fn agreed<T>(
        &mut self,
        what: &str,
        step: impl FnOnce(&mut Self) -> Result<T, ClusterError>,
    ) -> Result<T, ClusterError> {
        let snapshot = self.snapshot();
        let err = match step(self) {
            Ok(v) => match self.group.barrier(&format!("{what} outcome")) {
                Ok(()) => return Ok(v),
                Err(e) => ClusterError::from(e),
            },
            Err(e) if e.is_peer_failure() || e.is_group_broken() => e,
            Err(e) => match self.group.fail(what, &e.to_string()) {
                Ok(_) => e,
                Err(broken) => broken.into(),
            },
        };
        if err.is_group_broken() {
            return Err(err);
        }
        self.restore(snapshot, what)?;
        Err(err)
    }

    pub(super) fn snapshot(&mut self) -> Snapshot {
        self.freed = Freed::default();
        self.last_rollback = RollbackDrops::default();
        Snapshot {
            tree: self.tree.clone(),
            mirror: self.alloc.mirror().clone(),
            host: self.host.clone(),
        }
    }

    /// Puts this rank back to `snapshot` (every rank does, for the same operation), except
    /// that nodes whose pages the failed operation had freed stay dropped: those pages may
    /// have been handed out again and overwritten before the failure, so bringing the nodes
    /// back would serve foreign bytes. What each rank freed is all-gathered, so every replica
    /// drops the same nodes: host pages differ per rank, and a rank that failed early freed
    /// fewer device pages than its peers, which went on until they learnt of the failure.
    pub(super) fn restore(&mut self, snapshot: Snapshot, what: &str) -> Result<(), ClusterError> {
        let mut freed = std::mem::take(&mut self.freed);
        let mine: Vec<u8> = freed
            .device
            .iter()
            .flat_map(|p| p.0.to_le_bytes())
            .collect();
        for v in self
            .group
            .all_gather(&format!("{what} rollback: freed device pages"), &mine)?
        {
            freed.device.extend(
                v.chunks_exact(4)
                    .map(|c| PageId(u32::from_le_bytes(c.try_into().expect("4 bytes")))),
            );
        }
        let Snapshot {
            mut tree,
            mut mirror,
            mut host,
        } = snapshot;
        let mine: Vec<u8> = tree
            .nodes_holding_host(&freed.host)
            .into_iter()
            .flat_map(|id| id.to_bits().to_le_bytes())
            .collect();
        let host_nodes: BTreeSet<NodeId> = self
            .group
            .all_gather(&format!("{what} rollback: stale host copies"), &mine)?
            .iter()
            .flat_map(|v| {
                v.chunks_exact(8)
                    .map(|c| NodeId::from_bits(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
            })
            .collect();
        let (pages, metas) = tree.drop_stale(&freed.device, &host_nodes)?;
        let drops = RollbackDrops {
            device_pages: pages.len() as u64,
            host_copies: metas.len() as u64,
        };
        mirror.free(&pages)?;
        for m in &metas {
            host.free(m.host_pages())?;
        }
        // Pages the failed operation allocated (or the rollback drops) become free: they may
        // hold bytes it wrote. So do the pages it evicted: an eviction that failed part-way
        // had not poisoned them yet.
        let mut released: BTreeSet<PageId> = (1..self.layout.pages())
            .map(PageId)
            .filter(|&p| self.alloc.mirror().is_allocated(p) && !mirror.is_allocated(p))
            .collect();
        released.extend(
            freed
                .device
                .iter()
                .copied()
                .filter(|&p| !mirror.is_allocated(p)),
        );
        // Host pages the failed operation allocated (a backup it wrote) become free too.
        let released_host: Vec<HostPage> = (0..self.host.capacity())
            .map(HostPage)
            .filter(|&p| self.host.is_allocated(p) && !host.is_allocated(p))
            .collect();
        self.tree = tree;
        self.host = host;
        let restored = self.alloc.restore(mirror);
        self.last_rollback = drops;
        let poisoned = self
            .poison_freed(released)
            .and_then(|()| self.poison_freed_host(released_host));
        restored?;
        poisoned
    }
}
