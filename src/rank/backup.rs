//! Backup (write-back / write-through): device pages to this rank's host pool, on a plan
//! every rank computes alike from the replicated tree and every rank's host capacity.

use super::*;

/// A backup that may still run on the executor's backup stream: the event after it, and the
/// device pages (this rank's local ids, sorted) it reads. Its event goes back to the
/// executor when it is dropped.
pub(super) struct PendingBackup {
    exec: Arc<dyn Executor>,
    event: EventId,
    locals: Vec<u32>,
}

impl Drop for PendingBackup {
    fn drop(&mut self) {
        self.exec.release_event(self.event);
    }
}

impl RankCache {
    /// Backs a device node up on every rank, or on none: host pages for each rank's owned
    /// pages, the device→host transfer, and the validated metadata. Every rank computes
    /// every rank's host shortfall from the replicated tree and the capacities gathered at
    /// start-up (no round), so they all take one plan: when some rank is short, host
    /// copies are evicted in LRU order, but only ones that free pages on a short rank, and
    /// only when that makes the backup fit; otherwise the backup is skipped (and counted)
    /// and no host copy is thrown away. SGLang: `HiRadixCache.write_backup` /
    /// `HiCacheController.write`.
    pub(super) fn write_back(
        &mut self,
        node: NodeId,
        stats: &mut RequestStats,
    ) -> Result<(), ClusterError> {
        let pages = self
            .tree
            .node(node)?
            .device()
            .ok_or(TreeError::NotOnDevice { node })?
            .to_vec();
        let owners: Vec<u8> = pages.iter().map(|&p| self.layout.owner(p).0).collect();
        let me = self.rank.0;
        let need = owners.iter().filter(|&&o| o == me).count() as u32;
        if !self.make_host_room(&owners, stats)? {
            stats.backups_skipped += 1;
            return Ok(());
        }
        let host_pages = self.host.alloc(need as usize)?;
        let (src, dst): (Vec<u32>, Vec<u32>) = owners
            .iter()
            .zip(&pages)
            .filter(|(&o, _)| o == me)
            .zip(&host_pages)
            .map(|((_, &p), h)| (self.layout.local(p).0, h.0))
            .unzip();
        // On the executor's backup stream: a later load does not wait for it, and whoever
        // frees these device pages waits for its event first (`after_backups`). Readers of
        // the host pages come after it: a load of them only once the device copy is evicted
        // (which waited), and host reads wait for all the executor's streams.
        self.prune_backups();
        let mut done = None;
        stats.bytes_d2h += self.transfer(
            Direction::DeviceToHost,
            &src,
            &dst,
            0..self.pools.geometry().layers,
            On::Backup(&mut done),
        )?;
        if let Some(event) = done {
            let mut locals = src;
            locals.sort_unstable();
            self.backups.push(PendingBackup {
                exec: self.exec.clone(),
                event,
                locals,
            });
        }
        let meta = NodeMetadata::new(&self.layout, self.rank, owners, host_pages)?;
        self.tree.set_host(node, meta)?;
        stats.pages_written += pages.len() as u64;
        self.store_backup(node, stats)
    }

    /// Makes room in every rank's host pool for pages owned as `owners` (one per page),
    /// alike on every rank and without a round: each rank's host pool holds exactly the
    /// pages of the tree's host copies it owns, and the start-up round gave every rank's
    /// capacity. When some rank is short, host copies are evicted in LRU order, but only
    /// ones that free pages on a short rank, and only when that makes everything fit;
    /// otherwise nothing is evicted and the answer is `false`. Evicted copies go to the
    /// store first under [`StoragePolicy::OnHostEvict`](super::StoragePolicy::OnHostEvict).
    pub(super) fn make_host_room(
        &mut self,
        owners: &[u8],
        stats: &mut RequestStats,
    ) -> Result<bool, ClusterError> {
        let me = self.rank.0;
        let used = self.tree.host_pages_by_owner();
        let me_used = self.host.capacity() - self.host.free_count();
        if used[usize::from(me)] != me_used {
            return Err(ClusterError::ReplicasDiverged {
                what: format!(
                    "rank {me}'s host pool holds {me_used} pages, but the tree's host copies \
                     hold {} of its pages",
                    used[usize::from(me)]
                ),
            });
        }
        let short: Vec<u32> = owners_count(owners, used.len())
            .iter()
            .zip(&used)
            .zip(&self.host_capacities)
            .map(|((&n, &u), &cap)| n.saturating_sub(cap.saturating_sub(u)))
            .collect();
        if short.iter().all(|&d| d == 0) {
            return Ok(true);
        }
        // Decide on the plan first (every rank evicts the same nodes, so the replicated tree
        // tells what each rank would get back).
        let plan = self.tree.host_eviction_plan_for_ranks(&short)?;
        let mut gained = vec![0u32; short.len()];
        for &id in &plan {
            let owners = self.tree.node(id)?.host().map(NodeMetadata::page_owners);
            for o in owners.unwrap_or_default() {
                if let Some(g) = gained.get_mut(usize::from(*o)) {
                    *g += 1;
                }
            }
        }
        if short.iter().zip(&gained).any(|(s, g)| g < s) {
            return Ok(false);
        }
        if self.stores_on_host_evict() {
            for &id in &plan {
                self.store_node(id, stats)?;
            }
        }
        let gone = self.tree.evict_host_for_ranks(&short)?;
        let evicted = gone.len();
        let mut released = Vec::new();
        for meta in gone {
            self.host.free(meta.host_pages())?;
            self.freed.host.extend(meta.host_pages().iter().copied());
            released.extend(meta.host_pages().iter().copied());
        }
        self.poison_freed_host(released)?;
        stats.evictions_lru += evicted as u64;
        stats.host_evictions_for_backup += evicted as u64;
        Ok(true)
    }
}

impl RankCache {
    /// Orders the cache's stream after every pending backup that reads one of `pages` (all
    /// of them with `None`), before those pages are freed: a freed page is poisoned, handed
    /// out again and written, all ordered after the cache's stream (a load waits for it at
    /// its start). A device-side wait; backups of other pages go on. Only where the device
    /// refuses a wait does the host wait instead (for all of the executor's streams).
    pub(super) fn after_backups(&mut self, pages: Option<&[PageId]>) -> Result<(), ClusterError> {
        if self.backups.is_empty() {
            return Ok(());
        }
        let mine: Option<Vec<u32>> = pages.map(|pages| {
            let mut v: Vec<u32> = pages
                .iter()
                .filter(|&&p| self.layout.owner(p) == self.rank)
                .map(|&p| self.layout.local(p).0)
                .collect();
            v.sort_unstable();
            v
        });
        // A backup that reads none of the pages stays pending (a later free waits for it).
        let exec = self.exec.clone();
        let mut failed = None;
        self.backups.retain(|b| {
            let reads = mine.as_ref().is_none_or(|m| intersects(m, &b.locals));
            if !reads || failed.is_some() {
                return true;
            }
            match exec.wait_event(b.event) {
                Ok(()) => false,
                Err(e) => {
                    failed = Some(e);
                    true
                }
            }
        });
        let Some(e) = failed else {
            return Ok(());
        };
        // The device could not be told to wait: the host waits instead, for everything the
        // executor's streams hold, so the free still comes after every backup (and none is
        // pending any more). Returning the error would leave the caller's pages out of
        // the tree and not yet freed.
        tracing::warn!(
            "a backup's event could not be waited for on the device ({e}); the host waits for it"
        );
        match self.exec.synchronize() {
            Ok(()) => {
                self.backups.clear();
                Ok(())
            }
            // The device is gone: every backup stays pending, and the first error is the
            // one that says why.
            Err(_) => Err(e.into()),
        }
    }

    /// Lets go of the pending backups whose events say they have run (queried, no wait).
    fn prune_backups(&mut self) {
        let exec = self.exec.clone();
        self.backups
            .retain(|b| !exec.event_done(b.event).unwrap_or(false));
    }
}

/// Whether two sorted lists share an element.
fn intersects(a: &[u32], b: &[u32]) -> bool {
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => i += 1,
            std::cmp::Ordering::Greater => j += 1,
            std::cmp::Ordering::Equal => return true,
        }
    }
    false
}

/// How many of `owners` each of `ranks` ranks owns.
fn owners_count(owners: &[u8], ranks: usize) -> Vec<u32> {
    let mut out = vec![0u32; ranks];
    for &o in owners {
        if let Some(c) = out.get_mut(usize::from(o)) {
            *c += 1;
        }
    }
    out
}
