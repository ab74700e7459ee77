//! Backup (write-back / write-through): device pages to this rank's host pool, after the
//! ranks agreed on the host capacity.

use super::*;

impl RankCache {
    /// Backs a device node up on every rank, or on none: host pages for each rank's owned
    /// pages, the device→host transfer, and the validated metadata. The ranks all-gather
    /// their host shortfalls, so they all take one plan: when some rank is short, host
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
        let mine = u64::from(need.saturating_sub(self.host.free_count()));
        let short: Vec<u32> = self
            .group
            .all_gather(
                &format!("backup of {node}: host shortfalls"),
                &mine.to_le_bytes(),
            )?
            .iter()
            .map(|v| {
                v.as_slice()
                    .try_into()
                    .map_or(0, |b| u64::from_le_bytes(b) as u32)
            })
            .collect();
        if short.iter().any(|&d| d > 0) {
            // Evict host copies only if that makes the backup fit, and only those that free
            // host pages on the short ranks: decide on the plan first (every rank evicts the
            // same nodes, so the replicated tree tells what each rank would get back).
            let mut gained = vec![0u32; short.len()];
            for id in self.tree.host_eviction_plan_for_ranks(&short)? {
                let owners = self.tree.node(id)?.host().map(NodeMetadata::page_owners);
                for o in owners.unwrap_or_default() {
                    if let Some(g) = gained.get_mut(usize::from(*o)) {
                        *g += 1;
                    }
                }
            }
            if short.iter().zip(&gained).any(|(s, g)| g < s) {
                stats.backups_skipped += 1;
                return Ok(());
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
        }
        let host_pages = self.host.alloc(need as usize)?;
        let (src, dst): (Vec<u32>, Vec<u32>) = owners
            .iter()
            .zip(&pages)
            .filter(|(&o, _)| o == me)
            .zip(&host_pages)
            .map(|((_, &p), h)| (self.layout.local(p).0, h.0))
            .unzip();
        stats.bytes_d2h += self.transfer(
            Direction::DeviceToHost,
            &src,
            &dst,
            0..self.pools.geometry().layers,
            None,
        )?;
        let meta = NodeMetadata::new(&self.layout, self.rank, owners, host_pages)?;
        self.tree.set_host(node, meta)?;
        stats.pages_written += pages.len() as u64;
        Ok(())
    }
}
