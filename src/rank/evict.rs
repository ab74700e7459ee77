//! Allocation with eviction (device LRU, owner-lane targeted), the error that says why a
//! request does not fit, and re-poisoning of what was freed.

use super::*;

pub(super) enum Eviction {
    Lru(usize),
    Lanes(Vec<u32>),
}

impl RankCache {
    /// Allocates `owners` (any lanes when `plain`) in this rank's allocator replica, or
    /// `None` on a shortage (nothing changed). Replicas that saw the same calls decide alike;
    /// the digests, compared after every request, prove it.
    pub(super) fn try_alloc(
        &mut self,
        owners: &[u8],
        plain: bool,
    ) -> Result<Option<Vec<PageId>>, ClusterError> {
        let res = if plain {
            self.alloc.alloc_pages(owners.len())
        } else {
            self.alloc.alloc_pages_with_owners(owners)
        };
        match res {
            Ok(k) => {
                let pages = k.run.into_pages();
                if self.layout.granule() > 1 {
                    // The lanes move in lockstep, so positional owners give aligned groups;
                    // anything else is a bug that would put a granule's pages on the wrong
                    // local pages of the engine's logical page: refuse it.
                    if let Err(e) = crate::layout::check_aligned_groups(self.layout.cp(), &pages) {
                        self.alloc.free(&pages)?;
                        return Err(e.into());
                    }
                }
                Ok(Some(pages))
            }
            Err(e) if e.is_shortage() => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Allocates the pages to compute, evicting as needed (see [`Self::alloc_evicting`]).
    /// `held` are the device pages the request already holds (its cached prefix, locked;
    /// for the error). SGLang: `TokenToKVPoolAllocator.alloc` after `evict`.
    pub(super) fn alloc_with_eviction(
        &mut self,
        owners: &[u8],
        held: &[PageId],
        stats: &mut RequestStats,
    ) -> Result<Vec<PageId>, ClusterError> {
        match self.alloc_evicting(owners, false, stats)? {
            Some(run) => Ok(run),
            None => {
                let deficit = self.alloc.deficit(owners)?;
                Err(self.pool_too_small(owners, held, &deficit))
            }
        }
    }

    /// Allocates `owners` (any lanes when `plain`), evicting unlocked device nodes until it
    /// fits: device LRU while the pool as a whole is short, owner-lane targeted eviction
    /// when only some lanes are, and LRU again when no leaf frees a short lane. `None` once
    /// nothing more can be evicted. The load path and the compute path both allocate
    /// through here, so a load-back degrades to a miss only when computing would not fit
    /// either.
    pub(super) fn alloc_evicting(
        &mut self,
        owners: &[u8],
        plain: bool,
        stats: &mut RequestStats,
    ) -> Result<Option<Vec<PageId>>, ClusterError> {
        loop {
            if let Some(run) = self.try_alloc(owners, plain)? {
                return Ok(Some(run));
            }
            let free = self.alloc.mirror().free_pages();
            let evicted = if owners.len() > free {
                let n = self.evict(Eviction::Lru(owners.len() - free), stats)?;
                stats.evictions_lru += n as u64;
                n
            } else {
                let deficit = self.alloc.deficit(owners)?;
                let n = self.evict(Eviction::Lanes(deficit), stats)?;
                stats.evictions_lane += n as u64;
                if n > 0 {
                    n
                } else {
                    // The short lanes' pages can sit in nodes that are not leaves yet, under
                    // leaves holding only other lanes' pages, which lane-targeted eviction
                    // skips. Evict LRU to uncover them.
                    let n = self.evict(Eviction::Lru(1), stats)?;
                    stats.evictions_lru += n as u64;
                    n
                }
            };
            if evicted == 0 {
                return Ok(None);
            }
        }
    }

    /// Why `owners` cannot be allocated next to `held` once nothing more can be evicted:
    /// the whole pool, or (the usual case) the owner lanes in `deficit`, each with what it
    /// needs, what the request's cached prefix holds in it and what it holds in all. A
    /// total count alone would read as a contradiction when the pool has room overall.
    pub(super) fn pool_too_small(
        &self,
        owners: &[u8],
        held: &[PageId],
        deficit: &[u32],
    ) -> ClusterError {
        let cp = usize::from(self.layout.cp());
        let free = self.alloc.lane_free_counts();
        let count = |owners: &mut dyn Iterator<Item = u8>| {
            let mut n = vec![0u32; cp];
            for o in owners {
                n[usize::from(o)] += 1;
            }
            n
        };
        let computed = count(&mut owners.iter().copied());
        let cached = count(&mut held.iter().map(|&p| self.layout.owner(p).0));
        let needed = (held.len() + owners.len()) as u64;
        let available = (held.len() + free.iter().sum::<u32>() as usize) as u64;
        let mut lanes = Vec::new();
        for (l, &d) in deficit.iter().enumerate().filter(|(_, &d)| d > 0) {
            let need = cached[l] + computed[l];
            let capacity = self.layout.lane_capacity(Rank(l as u8));
            let usable = free[l] + cached[l];
            let what = if need > capacity {
                format!("holds only {capacity} pages")
            } else {
                format!(
                    "only {usable} of its {capacity} pages are free or the request's own \
                     (the others are locked or reserved)"
                )
            };
            lanes.push(format!(
                "lane {l} needs {need} ({} of the cached prefix + {} to compute) but {what}, \
                 {d} short",
                cached[l], computed[l]
            ));
        }
        let mut what = if needed > available {
            format!(
                "the request needs {needed} device pages at once but only {available} are free \
                 or its own once everything unlocked is evicted"
            )
        } else {
            format!(
                "the request's {needed} device pages fit the pool ({available} free or its own \
                 once everything unlocked is evicted) but not its owner lanes"
            )
        };
        if !lanes.is_empty() {
            what += &format!(": {}", lanes.join("; "));
        }
        // The cached prefix stays locked while the request is served; say when computing
        // the whole prompt afresh (one zigzag pattern) would have fitted.
        let fresh =
            count(&mut zigzag_owners(self.layout.cp(), held.len() + owners.len()).into_iter());
        if !held.is_empty() && (0..cp).all(|l| fresh[l] <= free[l] + cached[l]) {
            what += " (computing the whole prompt afresh, without its cached prefix, would fit)";
        }
        ClusterError::PoolTooSmall {
            what,
            flag: "--device-pages",
            needed,
            available,
        }
    }

    /// Evicts device nodes and frees what they held (every rank evicts the same nodes).
    /// Under write-back, every node the eviction would drop from the tree is backed up first
    /// (its backups are counted in `stats`), so only nodes whose backup did not fit lose
    /// their KV. Returns the node count.
    pub(super) fn evict(
        &mut self,
        how: Eviction,
        stats: &mut RequestStats,
    ) -> Result<usize, ClusterError> {
        if self.config.policy == WritePolicy::WriteBack {
            // The plan names every node the eviction takes: not only the LRU leaves of now,
            // but also parents that become leaves on the way. Backing up changes no device
            // state and no stamp, so the real eviction below takes the same nodes, now backed
            // up, and keeps them (and their host-only descendants) in the tree.
            let plan = match &how {
                Eviction::Lru(n) => self.tree.device_eviction_plan_lru(*n)?,
                Eviction::Lanes(d) => self.tree.device_eviction_plan_for_lanes(d)?,
            };
            for node in plan {
                if self.tree.node(node)?.host().is_none() {
                    self.write_back(node, stats)?;
                }
            }
        }
        if self.stores_on_host_evict() {
            // A node not backed up leaves the tree with its subtree, whose host copies go
            // with it: under `on-host-evict` they are stored first, as any host copy the
            // host tier lets go is.
            let plan = match &how {
                Eviction::Lru(n) => self.tree.device_eviction_plan_lru(*n)?,
                Eviction::Lanes(d) => self.tree.device_eviction_plan_for_lanes(d)?,
            };
            for node in plan {
                if self.tree.node(node)?.host().is_some() {
                    continue;
                }
                let mut stack: Vec<NodeId> = self.tree.node(node)?.children().collect();
                while let Some(d) = stack.pop() {
                    let n = self.tree.node(d)?;
                    stack.extend(n.children());
                    if n.host().is_some() {
                        self.store_node(d, stats)?;
                    }
                }
            }
        }
        let evicted: Vec<Evicted> = match &how {
            Eviction::Lru(n) => self.tree.evict_device_lru(*n)?,
            Eviction::Lanes(d) => self.tree.evict_device_for_lanes(d)?,
        };
        let count = evicted.len();
        // Backups still reading these pages finish first (their event, on the device).
        let pages: Vec<PageId> = evicted
            .iter()
            .flat_map(|e| e.device_pages.iter().copied())
            .collect();
        self.after_backups(Some(&pages))?;
        let mut released = BTreeSet::new();
        let mut released_host = Vec::new();
        for e in evicted {
            self.alloc.free(&e.device_pages)?;
            self.freed.device.extend(e.device_pages.iter().copied());
            released.extend(e.device_pages.iter().copied());
            for meta in &e.host_released {
                self.host.free(meta.host_pages())?;
                self.freed.host.extend(meta.host_pages().iter().copied());
                released_host.extend(meta.host_pages().iter().copied());
            }
        }
        self.poison_freed(released)?;
        self.poison_freed_host(released_host)?;
        Ok(count)
    }

    /// Poisons freed host pages on this rank's host pools, every buffer kind (when
    /// [`RankCache::set_repoison`] is on): a backup that reuses one and whose device→host
    /// copy does nothing must leave poison there, not the bytes of an earlier backup of the
    /// same prefix, which would load back and verify clean.
    pub(super) fn poison_freed_host(&mut self, pages: Vec<HostPage>) -> Result<(), ClusterError> {
        if !self.repoison || pages.is_empty() {
            return Ok(());
        }
        let layout = self.config.deployment.host_layout;
        let pages: Vec<u32> = pages.iter().map(|p| p.0).collect();
        for b in self.config.deployment.model.buffers() {
            self.pools.poison_host_pages(b, layout, &pages)?;
        }
        Ok(())
    }

    /// Poisons the freed device pages this rank owns, every buffer kind (when
    /// [`RankCache::set_repoison`] is on); each owner poisons its own.
    pub(super) fn poison_freed(
        &mut self,
        pages: impl IntoIterator<Item = PageId>,
    ) -> Result<(), ClusterError> {
        if !self.repoison {
            return Ok(());
        }
        let locals: BTreeSet<u32> = pages
            .into_iter()
            .filter(|&p| self.layout.owner(p) == self.rank)
            .map(|p| self.layout.local(p).0)
            .collect();
        if locals.is_empty() {
            return Ok(());
        }
        let locals: Vec<u32> = locals.into_iter().collect();
        for b in self.config.deployment.model.buffers() {
            self.pools.poison_device_pages(b, &locals)?;
        }
        Ok(())
    }
}
