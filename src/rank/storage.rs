//! The rank's third tier: pages backed up to a [`PageStore`] that outlives the process, and
//! prefixes that miss in device and host memory read back from it under any CP degree.
//!
//! - *Writes.* Each record has one writer: the rank that owns the page under this run's
//!   layout writes it from its host copy, when the page is backed up to the host
//!   ([`StoragePolicy::WithHost`]) or when its host copy is evicted
//!   ([`StoragePolicy::OnHostEvict`]). A record already present is left alone (its writer
//!   wrote the same bytes: a key names its whole prefix). A node's records go to the store
//!   in batches ([`PageStore::put_many`], [`BATCH_BYTES`] at most), one engine call each
//!   where the store batches.
//! - *Parts.* Where the layout splits a sequence page across ranks (`token-interleave`),
//!   each rank holding tokens of a record writes them as a part; the record is assembled
//!   when its last part comes, and a reader takes its tokens out of the records its page's
//!   tokens come from ([`crate::storage::PageSlots`]).
//! - *Reads.* Past the pages the tree matched, every rank reads the records of the pages it
//!   will own, up to its first miss or refused record (in batches where the store batches,
//!   one record at a time where it does not: `RankCache::read_records`); the group agrees
//!   on the shortest run (one round), in whole granules. The run becomes a host-only node of
//!   the tree (each rank's records in its own host pool), which the ordinary load-back then
//!   brings to the device with its owners preserved and verifies like any page.

use super::prefetch::Read;
use super::*;
use crate::kernels::HostLayout;
use crate::storage::{
    Fingerprint, Lookup, PageSlots, PageStore, PartItem, PartPut, Put, RecordError, RecordKey,
    Refusal, StorageError,
};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// When a rank writes its pages to the store.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum StoragePolicy {
    /// With every host backup (the store holds everything the host tier ever held).
    #[default]
    WithHost,
    /// When a host copy is evicted (the store holds what the host tier let go).
    OnHostEvict,
}

impl StoragePolicy {
    /// Every policy, for help texts.
    pub const ALL: [StoragePolicy; 2] = [StoragePolicy::WithHost, StoragePolicy::OnHostEvict];
}

impl fmt::Display for StoragePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoragePolicy::WithHost => "with-host",
            StoragePolicy::OnHostEvict => "on-host-evict",
        })
    }
}

impl FromStr for StoragePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        StoragePolicy::ALL
            .into_iter()
            .find(|p| p.to_string() == s)
            .ok_or_else(|| {
                format!("unknown storage policy `{s}` (expected with-host or on-host-evict)")
            })
    }
}

/// A rank's store and when it writes to it.
pub(super) struct Tier {
    store: Arc<dyn PageStore>,
    policy: StoragePolicy,
}

/// The name of the round in which every rank attaches its store
/// ([`RankCache::attach_storage`]); a rank that cannot open its store fails this round.
pub const STORAGE_ROUND: &str = "storage attached";

impl RankCache {
    /// Attaches the third tier: `store` (every rank's over the same records, typically one
    /// directory) written per `policy`. A collective: every rank calls it, and every rank
    /// fails alike when a rank's store does not hold this deployment's records, when the
    /// ranks' stores or policies differ. Where the layout splits a sequence page across
    /// ranks, records are written in parts ([`PageStore::put_part`]). SGLang: `HiCacheController`'s storage
    /// backend (`--hicache-storage-backend`).
    pub fn attach_storage(
        &mut self,
        store: Arc<dyn PageStore>,
        policy: StoragePolicy,
    ) -> Result<(), ClusterError> {
        self.check_connected()?;
        let mine = match self.storage_problem(store.as_ref()) {
            Some(why) => {
                let e = ClusterError::Config(format!("rank {}: {why}", self.rank.0));
                let _ = self.group.fail(STORAGE_ROUND, &e.to_string());
                return Err(e);
            }
            None => format!("{} {policy}", hex::encode(store.fingerprint().digest())),
        };
        let all = self.group.all_gather(STORAGE_ROUND, mine.as_bytes())?;
        let differences: Vec<String> = all
            .iter()
            .enumerate()
            .filter(|(_, b)| b.as_slice() != all[0].as_slice())
            .map(|(r, b)| {
                format!(
                    "rank {r} attaches `{}`, rank 0 `{}` (fingerprint and policy)",
                    String::from_utf8_lossy(b),
                    String::from_utf8_lossy(&all[0])
                )
            })
            .collect();
        if !differences.is_empty() {
            return Err(ClusterError::ConfigDiverged {
                rank: self.rank.0,
                differences,
            });
        }
        self.storage = Some(Tier { store, policy });
        Ok(())
    }

    /// Why `store` cannot be this rank's third tier, if it cannot.
    fn storage_problem(&self, store: &dyn PageStore) -> Option<String> {
        let dep = &self.config.deployment;
        let fp = Fingerprint::of(dep, self.config.layers);
        if store.fingerprint() != &fp {
            return Some(format!(
                "the store holds records of {}, this deployment's are {}",
                store.fingerprint().describe(),
                fp.describe()
            ));
        }
        let want = crate::storage::payload_bytes(dep, self.config.layers);
        (store.payload_bytes() != want).then(|| {
            format!(
                "the store's records hold {} bytes, this deployment's pages {want}",
                store.payload_bytes()
            )
        })
    }

    /// The attached store, if any.
    pub fn storage(&self) -> Option<&Arc<dyn PageStore>> {
        self.storage.as_ref().map(|t| &t.store)
    }

    /// Whether pages are written to the store when their host copies are evicted.
    pub(super) fn stores_on_host_evict(&self) -> bool {
        self.storage
            .as_ref()
            .is_some_and(|t| t.policy == StoragePolicy::OnHostEvict)
    }

    /// Writes node `id`'s pages this rank owns from its host copy to the store, when the
    /// policy writes with every host backup.
    pub(super) fn store_backup(
        &mut self,
        id: NodeId,
        stats: &mut RequestStats,
    ) -> Result<(), ClusterError> {
        if self
            .storage
            .as_ref()
            .is_some_and(|t| t.policy == StoragePolicy::WithHost)
        {
            self.store_node(id, stats)?;
        }
        Ok(())
    }

    /// Writes node `id`'s pages this rank owns, from its host copy, to the store.
    pub(super) fn store_node(
        &mut self,
        id: NodeId,
        stats: &mut RequestStats,
    ) -> Result<(), ClusterError> {
        // A store this process may only read is read, never written.
        let Some(tier) = self.storage.as_ref().filter(|t| !t.store.read_only()) else {
            return Ok(());
        };
        let store = tier.store.clone();
        let ps = self.layout.page_size();
        let tokens = self.tree.prefix_tokens(id)?;
        let meta = self
            .tree
            .node(id)?
            .host()
            .ok_or(TreeError::NotBackedUp { node: id })?
            .clone();
        let keys = RecordKey::chain(store.fingerprint(), &tokens, ps);
        let first = keys.len() - meta.num_pages();
        if self.split_pages() {
            return self.store_parts(&store, &keys, first, &meta, stats);
        }
        // The node's records this rank owns, in batches (one call each of a store that
        // batches; a record at a time of one that does not), up to the first batch that
        // fails.
        let owned: Vec<(usize, HostPage)> = meta.owned_pages().collect();
        for chunk in owned.chunks(batch_records(store.as_ref())) {
            let mut payloads = Vec::with_capacity(chunk.len());
            for &(_, host) in chunk {
                payloads.push(self.read_host_page(host)?);
            }
            let items: Vec<(RecordKey, &[u8])> = chunk
                .iter()
                .zip(&payloads)
                .map(|(&(i, _), p)| (keys[first + i], &p[..]))
                .collect();
            let mut puts = store.put_many(&items).into_iter();
            let (mut failed, mut why) = (0u64, None);
            for (_, payload) in &items {
                match puts.next().unwrap_or_else(unanswered) {
                    Ok(Put::Written { evicted }) => {
                        stats.storage_records_written += 1;
                        stats.storage_bytes_written += payload.len() as u64;
                        stats.storage_evictions += evicted;
                    }
                    Ok(Put::Present) => {}
                    Err(e) => {
                        failed += 1;
                        why.get_or_insert(e);
                    }
                }
            }
            if let Some(e) = why {
                // A record left out is a later miss; failing here would leave this rank
                // out of the request's next round. Each record of the batch that failed is
                // counted; the node's later batches are not tried (a store that failed
                // once, its master gone, may take seconds to fail each call).
                tracing::warn!(rank = self.rank.0, records = failed, error = %e, "storage write failed");
                stats.storage_io_errors += failed;
                break;
            }
        }
        Ok(())
    }

    /// Whether the layout splits a sequence page across ranks, so records are written in
    /// parts and read by every rank of a granule.
    fn split_pages(&self) -> bool {
        let dep = &self.config.deployment;
        dep.layout.interleaves_tokens(dep.page_size) && self.layout.cp() > 1
    }

    /// The records this rank's pages hold tokens of, and which: for each sequence page `q`
    /// of a granule, the tokens in its slots come from the granule's records
    /// (`(record, slot in it)` per slot).
    fn slot_sources(&self, q: usize) -> Vec<(usize, u32)> {
        let ps = self.layout.page_size();
        let pl = self
            .config
            .deployment
            .layout
            .placement(self.layout.cp(), ps);
        (0..ps)
            .map(|s| {
                let t = pl.token(q as u64, s);
                ((t / u64::from(ps)) as usize, (t % u64::from(ps)) as u32)
            })
            .collect()
    }

    /// Writes this rank's tokens of the records of node `meta`'s granules as parts (see
    /// [`crate::storage::PageSlots`]): part `r` of a record is rank `r`'s tokens of it, in
    /// the record's slot order; the last part to come assembles the record.
    fn store_parts(
        &self,
        store: &Arc<dyn PageStore>,
        keys: &[RecordKey],
        first: usize,
        meta: &NodeMetadata,
        stats: &mut RequestStats,
    ) -> Result<(), ClusterError> {
        let cp = usize::from(self.layout.cp());
        let ps = self.layout.page_size();
        let layers = self.config.layers;
        let dep = &self.config.deployment;
        let full = PageSlots::new(dep, layers, ps);
        let pl = dep.layout.placement(cp as u8, ps);
        // Which rank holds each slot of record `c` (records of a granule share the pattern).
        let holder = |c: usize, slot: u32| -> usize {
            (pl.place(c as u64 * u64::from(ps) + u64::from(slot)).0 as usize) % cp
        };
        let full = &full;
        let holder = &holder;
        // This rank's parts of the node's records, handed to the store in batches of at
        // most BATCH_BYTES (a few engine calls each for a store that batches; a part at a
        // time for one that does not), up to the first batch with a failed part.
        let mut mine_all: Vec<OwnPart<'_>> = Vec::new();
        let mut pending = 0u64;
        for (i, host) in meta.owned_pages() {
            let q = first + i;
            let payload = self.read_host_page(host)?;
            let sources = self.slot_sources(q);
            let granule = q / cp * cp;
            for (c, key) in keys.iter().enumerate().skip(granule).take(cp) {
                let mut mine: Vec<(u32, u32)> = (0..ps)
                    .filter(|&s| sources[s as usize].0 == c)
                    .map(|s| (s, sources[s as usize].1))
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                // Slots of the record in order: the packed part's order.
                mine.sort_by_key(|&(_, at)| at);
                let part_slots = PageSlots::new(dep, layers, mine.len() as u32);
                let mut part = vec![0u8; part_slots.bytes()];
                for (j, &(s, _)) in mine.iter().enumerate() {
                    full.copy(&payload, s, &part_slots, &mut part, j as u32);
                }
                // The ranks holding tokens of record `c`, in rank order: its parts.
                let holders: Vec<usize> = (0..cp)
                    .filter(|&r| (0..ps).any(|s| holder(c, s) == r))
                    .collect();
                let me = holders
                    .iter()
                    .position(|&r| r == usize::from(self.rank.0))
                    .expect("this rank holds tokens of the record");
                let parts = holders.len() as u32;
                let assemble = move |parts: &[Vec<u8>]| -> Option<Vec<u8>> {
                    let slots: Vec<PageSlots> = holders
                        .iter()
                        .map(|&r| {
                            let n = (0..ps).filter(|&s| holder(c, s) == r).count();
                            PageSlots::new(dep, layers, n as u32)
                        })
                        .collect();
                    if parts.len() != holders.len()
                        || parts
                            .iter()
                            .zip(&slots)
                            .any(|(p, sl)| p.len() != sl.bytes())
                    {
                        return None;
                    }
                    let mut out = vec![0u8; full.bytes()];
                    let mut next = vec![0u32; holders.len()];
                    for slot in 0..ps {
                        let h = holders.iter().position(|&r| r == holder(c, slot))?;
                        slots[h].copy(&parts[h], next[h], full, &mut out, slot);
                        next[h] += 1;
                    }
                    Some(out)
                };
                pending += part.len() as u64;
                mine_all.push((*key, me as u32, parts, part, Box::new(assemble)));
                if pending >= BATCH_BYTES || !store.batches() {
                    let ok =
                        self.put_parts_batch(store.as_ref(), &mine_all, full.bytes() as u64, stats);
                    mine_all.clear();
                    pending = 0;
                    if !ok {
                        return Ok(());
                    }
                }
            }
        }
        // What is left, in the batch the last page did not fill.
        if !mine_all.is_empty() {
            self.put_parts_batch(store.as_ref(), &mine_all, full.bytes() as u64, stats);
        }
        Ok(())
    }

    /// Hands `parts` (key, part, parts, bytes, assemble) to the store in one
    /// [`PageStore::put_parts`], counting what it did; `false` when a part failed (each
    /// failed part counted: the node's later parts are not tried).
    fn put_parts_batch(
        &self,
        store: &dyn PageStore,
        parts: &[OwnPart<'_>],
        record_bytes: u64,
        stats: &mut RequestStats,
    ) -> bool {
        let items: Vec<PartItem<'_>> = parts
            .iter()
            .map(|(key, part, parts, bytes, assemble)| PartItem {
                key: *key,
                part: *part,
                parts: *parts,
                payload: bytes,
                assemble: &**assemble,
            })
            .collect();
        let mut puts = store.put_parts(&items).into_iter();
        let (mut failed, mut why) = (0u64, None);
        for _ in &items {
            match puts.next().unwrap_or_else(unanswered) {
                Ok(PartPut::Completed { evicted }) => {
                    stats.storage_records_written += 1;
                    stats.storage_bytes_written += record_bytes;
                    stats.storage_evictions += evicted;
                }
                Ok(PartPut::Held | PartPut::Present) => {}
                Err(e) => {
                    failed += 1;
                    why.get_or_insert(e);
                }
            }
        }
        match why {
            Some(e) => {
                tracing::warn!(rank = self.rank.0, parts = failed, error = %e, "storage part write failed");
                stats.storage_io_errors += failed;
                false
            }
            None => true,
        }
    }

    /// A host page's record payload: every layer of every buffer kind, in the model's order.
    fn read_host_page(&self, page: HostPage) -> Result<Vec<u8>, ClusterError> {
        let mut out = Vec::new();
        for (b, offset, len) in self.host_page_ranges(page) {
            let at = out.len();
            out.resize(at + len, 0);
            self.exec.read(self.pools.host(b), offset, &mut out[at..])?;
        }
        Ok(out)
    }

    /// Writes a record's payload into host page `page`.
    fn write_host_page(&self, page: HostPage, payload: &[u8]) -> Result<(), ClusterError> {
        let mut at = 0;
        for (b, offset, len) in self.host_page_ranges(page) {
            self.exec
                .upload(self.pools.host(b), offset, &payload[at..at + len])?;
            at += len;
        }
        Ok(())
    }

    /// Where host page `page` lies in the host pools, in payload order: `(buffer, offset,
    /// bytes)`, one range per buffer kind where the host layout keeps a page's layers
    /// together, one per layer otherwise.
    fn host_page_ranges(&self, page: HostPage) -> Vec<(BufferKind, u64, usize)> {
        let g = self.pools.geometry();
        let host_layout = self.config.deployment.host_layout;
        let mut out = Vec::new();
        for b in self.config.deployment.model.buffers() {
            let pb = b.page_bytes(self.layout.page_size());
            let at = |l| reference::host_offset(host_layout, page.0, l, g.layers, g.host_pages, pb);
            match host_layout {
                HostLayout::PageFirst => out.push((b, at(0), (pb * u64::from(g.layers)) as usize)),
                HostLayout::LayerFirst => {
                    out.extend((0..g.layers).map(|l| (b, at(l), pb as usize)));
                }
            }
        }
        out
    }

    /// Reads the run of `key`'s pages past the first `matched` from the store into a new
    /// host-only leaf under `parent` (see the module documentation), or `None` when the
    /// group's run is empty or does not fit in the host pools. `key` is whole granules.
    /// Makes one round when pages are left to read, which every rank knows alike.
    pub(super) fn read_from_storage(
        &mut self,
        key: &[u32],
        matched: usize,
        parent: NodeId,
        n: usize,
        stats: &mut RequestStats,
    ) -> Result<Option<NodeId>, ClusterError> {
        let Some(mut probe) = self.probe_storage(key, matched, stats) else {
            return Ok(None);
        };
        let round = format!("request {n} storage");
        let all = self
            .group
            .all_gather(&round, &(probe.run as u32).to_le_bytes())?;
        self.check_round(&round, &all, |_, b| {
            (b.len() != 4).then(|| format!("{} bytes, not a page count", b.len()))
        })?;
        probe.agree(
            all.iter()
                .map(|b| u32::from_le_bytes(b[..4].try_into().expect("checked: 4 bytes")) as usize),
            self.layout.granule() as usize,
        );
        self.install_storage_run(key, matched, parent, &probe, stats)
    }

    /// This rank's records of `key`'s pages past the first `matched`, up to its first miss
    /// or refusal, read in one batch; `None` without a store or when nothing is left to
    /// read (which every rank knows alike). Changes no replicated state: the group agrees on
    /// the run ([`StorageRun::agree`]) before anything is installed.
    pub(super) fn probe_storage(
        &self,
        key: &[u32],
        matched: usize,
        stats: &mut RequestStats,
    ) -> Option<StorageRun> {
        let tier = self.storage.as_ref()?;
        let store = tier.store.clone();
        let ps = self.layout.page_size() as usize;
        let total = key.len() / ps;
        if total <= matched {
            return None;
        }
        let keys = RecordKey::chain(store.fingerprint(), key, ps as u32);
        let (layout, cp) = (self.config.deployment.layout, self.layout.cp());
        let owners = layout.owners(cp, matched, total - matched);
        let me = self.rank.0;
        let mut records = self.read_records(
            store.as_ref(),
            &self.records_for(&keys, matched, total - matched),
            stats,
        );
        let mut payloads = Vec::new();
        let mut run = owners.len();
        let split = self.split_pages();
        for (i, _) in owners.iter().enumerate().filter(|(_, &o)| o == me) {
            let q = matched + i;
            let page = if split {
                self.split_page(&records, &keys, q)
            } else {
                records.remove(&keys[q])
            };
            match page {
                Some(p) => payloads.push(p),
                None => {
                    run = i;
                    break;
                }
            }
        }
        Some(StorageRun {
            matched,
            run,
            agreed: 0,
            owners,
            payloads,
        })
    }

    /// Installs the agreed part of `probe` past the first `matched` pages of `key` (the
    /// tree's match now, which earlier steps of a batch may have moved) as a host-only
    /// leaf under `parent`; `None` when nothing agreed is left past `matched`, when the
    /// probe started past `matched` (the pages between were not read), or when the run
    /// does not fit in the host pools. Every input is replicated, so every rank installs
    /// the same leaf.
    pub(super) fn install_storage_run(
        &mut self,
        key: &[u32],
        matched: usize,
        parent: NodeId,
        probe: &StorageRun,
        stats: &mut RequestStats,
    ) -> Result<Option<NodeId>, ClusterError> {
        let end = probe.matched + probe.agreed;
        if matched < probe.matched || end <= matched {
            return Ok(None);
        }
        let ps = self.layout.page_size() as usize;
        let me = self.rank.0;
        // The owners the records were read for (a layout's owners of a run depend on its
        // length, so they are the probe's, not recomputed); this rank's payloads start at
        // the probe's first page.
        let (from, to) = (matched - probe.matched, end - probe.matched);
        let skip = probe.owners[..from].iter().filter(|&&o| o == me).count();
        let owners = probe.owners[from..to].to_vec();
        if !self.make_host_room(&owners, stats)? {
            stats.storage_reads_skipped += 1;
            return Ok(None);
        }
        let mine = owners.iter().filter(|&&o| o == me).count();
        let host_pages = self.host.alloc(mine)?;
        for (page, payload) in host_pages.iter().zip(&probe.payloads[skip..]) {
            self.write_host_page(*page, payload)?;
        }
        let meta = NodeMetadata::new(&self.layout, self.rank, owners, host_pages)?;
        let leaf = &key[matched * ps..end * ps];
        Ok(Some(self.tree.insert_host_leaf(parent, leaf, meta)?))
    }

    /// The records of `wanted` (in the order a rank reads them: [`Self::records_for`]) up
    /// to the first that is not a hit, by key, counted. A store that batches is handed
    /// them in batches of [`batch_records`] (one call each, the records read ahead
    /// ([`RankCache::prefetch`]) taken out first), and stops after the batch holding the
    /// first miss, refused record or failed read; any other is read one record at a time,
    /// up to it. In a batch, a record past the first that is not a hit is not used: a
    /// refused one is still counted (the store removed it), and so is each failed read
    /// (a batch whose call failed counts every record), but its hits are not. A failed
    /// read is served as a miss, so that this rank still takes the round that agrees on
    /// the run.
    fn read_records(
        &self,
        store: &dyn PageStore,
        wanted: &[RecordKey],
        stats: &mut RequestStats,
    ) -> HashMap<RecordKey, Vec<u8>> {
        let mut out = HashMap::new();
        for chunk in wanted.chunks(batch_records(store)) {
            // Read ahead first, up to the first that is not a hit (the rest need no read).
            let mut ahead: Vec<Option<Read>> = Vec::with_capacity(chunk.len());
            for key in chunk {
                let read = self.prefetcher.as_ref().and_then(|p| p.take(key));
                let stop = read
                    .as_ref()
                    .is_some_and(|r| !matches!(r, Ok(Lookup::Hit(_))));
                ahead.push(read);
                if stop {
                    break;
                }
            }
            let ask: Vec<RecordKey> = chunk
                .iter()
                .zip(&ahead)
                .filter(|(_, r)| r.is_none())
                .map(|(k, _)| *k)
                .collect();
            let mut got = match ask.as_slice() {
                [] => Vec::new(),
                [one] => vec![store.get(one)],
                many => store.get_many(many),
            }
            .into_iter();
            let (mut open, mut failed, mut why) = (true, 0u64, None);
            for (key, read) in chunk.iter().zip(ahead) {
                let prefetched = read.is_some();
                match read.unwrap_or_else(|| got.next().unwrap_or_else(unanswered)) {
                    Ok(Lookup::Hit(p)) if open => {
                        stats.storage_records_read += 1;
                        stats.storage_bytes_read += p.len() as u64;
                        if prefetched {
                            stats.storage_records_prefetched += 1;
                        }
                        out.insert(*key, p);
                    }
                    Ok(Lookup::Hit(_) | Lookup::Miss) => open = false,
                    Ok(Lookup::Refused(e)) => {
                        self.count_refusal(&e, stats);
                        open = false;
                    }
                    Err(e) => {
                        failed += 1;
                        why.get_or_insert(e);
                        open = false;
                    }
                }
            }
            if let Some(e) = why {
                tracing::warn!(rank = self.rank.0, records = failed, error = %e, "storage read failed");
                stats.storage_io_errors += failed;
            }
            if !open {
                break;
            }
        }
        out
    }

    /// Counts into `stats` what the read-ahead refused or failed to read and no request
    /// takes (past the first record of its batch that is not a hit, or aged out), since
    /// the last count: as this request's own refusals and failed reads past its first miss
    /// are. Called as every request ends (`finish_inner`), whether it read the
    /// store or not, so a refusal is counted by the request during which it happened.
    pub(super) fn count_untaken(&self, stats: &mut RequestStats) {
        let Some(u) = self.prefetcher.as_ref().map(|p| p.untaken()) else {
            return;
        };
        stats.storage_refused_torn += u.torn;
        stats.storage_refused_checksum += u.checksum;
        stats.storage_refused_fingerprint += u.fingerprint;
        if u.io_errors > 0 {
            tracing::warn!(
                rank = self.rank.0,
                records = u.io_errors,
                "storage read ahead failed"
            );
            stats.storage_io_errors += u.io_errors;
        }
    }

    /// The records this rank reads for the `n` pages of `keys` past the first `matched`,
    /// in the order it reads them (its own pages; under a split layout, the whole records
    /// its pages' tokens come from).
    pub(super) fn records_for(
        &self,
        keys: &[RecordKey],
        matched: usize,
        n: usize,
    ) -> Vec<RecordKey> {
        let (layout, cp) = (self.config.deployment.layout, self.layout.cp());
        let me = self.rank.0;
        let split = self.split_pages();
        let mut out: Vec<RecordKey> = Vec::new();
        for (i, _) in layout
            .owners(cp, matched, n)
            .iter()
            .enumerate()
            .filter(|(_, &o)| o == me)
        {
            let q = matched + i;
            if split {
                for (c, _) in self.slot_sources(q) {
                    if let Some(k) = keys.get(c) {
                        if !out.contains(k) {
                            out.push(*k);
                        }
                    }
                }
            } else if let Some(k) = keys.get(q) {
                out.push(*k);
            }
        }
        out
    }

    /// Sequence page `q` of a layout that splits pages across ranks, taken out of the
    /// whole records its tokens come from (`None` when one of them was not read).
    fn split_page(
        &self,
        records: &HashMap<RecordKey, Vec<u8>>,
        keys: &[RecordKey],
        q: usize,
    ) -> Option<Vec<u8>> {
        let sources = self.slot_sources(q);
        let full = PageSlots::new(
            &self.config.deployment,
            self.config.layers,
            self.layout.page_size(),
        );
        let mut out = vec![0u8; full.bytes()];
        for (slot, &(c, at)) in sources.iter().enumerate() {
            let record = records.get(keys.get(c)?)?;
            full.copy(record, at, &full, &mut out, slot as u32);
        }
        Some(out)
    }

    /// Counts a refused record by its kind.
    fn count_refusal(&self, e: &RecordError, stats: &mut RequestStats) {
        match e.refusal() {
            Refusal::Torn => stats.storage_refused_torn += 1,
            Refusal::Checksum => stats.storage_refused_checksum += 1,
            Refusal::Fingerprint => stats.storage_refused_fingerprint += 1,
        }
    }
}

/// Records per batch a rank hands `store`: as many as fit in [`BATCH_BYTES`] (at least
/// one) where it batches, else one.
pub(super) fn batch_records(store: &dyn PageStore) -> usize {
    if store.batches() {
        (BATCH_BYTES / store.payload_bytes().max(1)).max(1) as usize
    } else {
        1
    }
}

/// Payload bytes a rank hands a store that batches in one call, at most (a record more
/// than that goes alone): the records are copied out of the host pool for the call, and a
/// prompt of thousands of pages would otherwise hold all of them at once.
pub const BATCH_BYTES: u64 = 64 << 20;

/// The answer for an item a store left unanswered (it must answer each).
/// One part of a record a rank writes: its key, its number, the record's part count, its
/// bytes, and how the record is assembled from all of them.
type OwnPart<'a> = (
    RecordKey,
    u32,
    u32,
    Vec<u8>,
    Box<dyn Fn(&[Vec<u8>]) -> Option<Vec<u8>> + 'a>,
);

fn unanswered<T>() -> Result<T, StorageError> {
    Err(StorageError::Backend(
        "the store answered fewer items than it was given".into(),
    ))
}

/// What one rank read from the store for one request ([`RankCache::probe_storage`]), and
/// the run the group agreed on.
pub(super) struct StorageRun {
    /// The pages the tree matched when the store was read: the run starts there.
    pub(super) matched: usize,
    /// How many pages past `matched` this rank found, in a row.
    pub(super) run: usize,
    /// How many pages past `matched` every rank found, in whole granules (after
    /// [`StorageRun::agree`]).
    pub(super) agreed: usize,
    /// Each page's owner past `matched`, as the records were read for them.
    owners: Vec<u8>,
    /// This rank's own pages' payloads, in page order.
    payloads: Vec<Vec<u8>>,
}

impl StorageRun {
    /// Sets the agreed run from every rank's `run`: the shortest, in whole granules.
    pub(super) fn agree(&mut self, runs: impl Iterator<Item = usize>, granule: usize) {
        self.agreed = runs.min().unwrap_or(0) / granule * granule;
    }
}
