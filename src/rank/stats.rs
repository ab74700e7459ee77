//! What one request did on a rank, and what a rollback dropped.

use serde::Serialize;

/// What one request did. Token counts are per prompt (not per rank); on one rank, byte
/// counts are that rank's, and the cluster sums them over all ranks.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RequestStats {
    /// Prompt tokens (those `begin` took).
    pub prompt_tokens: u64,
    /// Tokens added to the open request by `extend` (prefill chunks, decode tokens); also
    /// counted in `computed_tokens`. `serve_live` counts its later prefill chunks as prompt
    /// tokens and only the decoded tokens here.
    pub extended_tokens: u64,
    /// `extend` steps the request took.
    pub extends: u64,
    /// Tokens served from device-resident cache.
    pub device_hit_tokens: u64,
    /// Tokens served by loading host copies back to the device.
    pub host_hit_tokens: u64,
    /// Tokens served by reading the storage tier's records (then host→device like host
    /// hits; not counted in `host_hit_tokens`).
    pub storage_hit_tokens: u64,
    /// Storage reads skipped because the host pools could not take the agreed run.
    pub storage_reads_skipped: u64,
    /// Tokens computed (synthesised) this request.
    pub computed_tokens: u64,
    /// Pages loaded host→device (logical pages, whatever their owners).
    pub pages_loaded: u64,
    /// Pages backed up device→host (logical pages).
    pub pages_written: u64,
    /// Tree nodes evicted by device or host LRU.
    pub evictions_lru: u64,
    /// Tree nodes evicted to cover an owner-lane deficit.
    pub evictions_lane: u64,
    /// Load-backs that could not get owner-matching pages and became misses.
    pub load_degraded_to_miss: u64,
    /// Pages loaded back into a page whose owner differs from the one recorded at backup:
    /// always 0, except under the `plain-alloc-on-load` fault, where it says whether the
    /// fault did anything.
    pub pages_loaded_misowned: u64,
    /// Host copies dropped because the prefix they hold was recomputed (its load-back
    /// degraded to a miss) with other owners: a node's device pages and host copy must name
    /// the same owners, so the copy goes and the node is backed up afresh.
    pub host_copies_replaced: u64,
    /// Backups skipped because the host pool was full.
    pub backups_skipped: u64,
    /// Host copies evicted (only those holding pages of the short ranks) so that a backup
    /// fits in a full host pool; also counted in `evictions_lru`.
    pub host_evictions_for_backup: u64,
    /// Bytes copied host→device over all ranks.
    pub bytes_h2d: u64,
    /// Bytes copied device→host over all ranks.
    pub bytes_d2h: u64,
    /// Materialised tokens whose bytes differ from the synthesised KV (in any buffer kind,
    /// each token counted once).
    pub mismatched_tokens: u64,
    /// The position of the first mismatched token of a request (for the diagnostic); in
    /// totals, that of the first request that had one.
    #[serde(skip)]
    pub first_mismatched_token: Option<u64>,
    /// Device→host reads, synchronisations, allocations and frees the executor counted on
    /// load paths ([`Counters::stalls`](crate::exec::Counters::stalls)).
    pub load_path_syncs: u64,
    /// Host synchronisations made as cross-rank fences: after a step-API load-back, so that
    /// every peer can read the loaded pages when `begin` returns (a peer's stream cannot wait
    /// on this rank's events). Not on the load path itself (`load_path_syncs`).
    pub fence_syncs: u64,
    /// Group rounds the request took (every rank takes the same).
    pub group_rounds: u64,
    /// Bytes of pages the ranks sent through the group for their peers to verify
    /// ([`PeerAccess::Gathered`](crate::rank::PeerAccess::Gathered); 0 where peers map each
    /// other's pools).
    pub bytes_gathered: u64,
    /// Records this rank read from the store and accepted.
    pub storage_records_read: u64,
    /// Payload bytes of them.
    pub storage_bytes_read: u64,
    /// Records this rank wrote to the store (records already there are not written again).
    pub storage_records_written: u64,
    /// Payload bytes of them.
    pub storage_bytes_written: u64,
    /// Records refused as torn (a short file: a writer killed mid-record), served as misses.
    pub storage_refused_torn: u64,
    /// Records refused by their checksum (a changed byte) or misfiled, served as misses.
    pub storage_refused_checksum: u64,
    /// Records of another deployment or format refused, served as misses.
    pub storage_refused_fingerprint: u64,
    /// Records the store evicted to keep its byte budget while this rank wrote.
    pub storage_evictions: u64,
    /// Store reads and writes that failed (an I/O error: a full disk, a lost mount): a read
    /// ends this rank's run there and is served as a miss, a write leaves the record out.
    /// Neither fails the request, so no rank leaves the group's rounds.
    pub storage_io_errors: u64,
    /// Of the records read, those read ahead of the request ([`RankCache::prefetch`]).
    ///
    /// [`RankCache::prefetch`]: crate::rank::RankCache::prefetch
    pub storage_records_prefetched: u64,
}

/// How many of a request's counts are per rank, summed over the ranks for a report
/// ([`RequestStats::rank_counts`]).
pub const RANK_COUNTS: usize = 14;

impl RequestStats {
    /// Adds another request's counts.
    pub fn add(&mut self, o: &RequestStats) {
        self.prompt_tokens += o.prompt_tokens;
        self.extended_tokens += o.extended_tokens;
        self.extends += o.extends;
        self.device_hit_tokens += o.device_hit_tokens;
        self.host_hit_tokens += o.host_hit_tokens;
        self.storage_hit_tokens += o.storage_hit_tokens;
        self.storage_reads_skipped += o.storage_reads_skipped;
        self.computed_tokens += o.computed_tokens;
        self.pages_loaded += o.pages_loaded;
        self.pages_written += o.pages_written;
        self.evictions_lru += o.evictions_lru;
        self.evictions_lane += o.evictions_lane;
        self.load_degraded_to_miss += o.load_degraded_to_miss;
        self.pages_loaded_misowned += o.pages_loaded_misowned;
        self.host_copies_replaced += o.host_copies_replaced;
        self.backups_skipped += o.backups_skipped;
        self.host_evictions_for_backup += o.host_evictions_for_backup;
        self.bytes_h2d += o.bytes_h2d;
        self.bytes_d2h += o.bytes_d2h;
        self.mismatched_tokens += o.mismatched_tokens;
        self.first_mismatched_token = self.first_mismatched_token.or(o.first_mismatched_token);
        self.load_path_syncs += o.load_path_syncs;
        self.fence_syncs += o.fence_syncs;
        self.group_rounds += o.group_rounds;
        self.bytes_gathered += o.bytes_gathered;
        self.storage_records_read += o.storage_records_read;
        self.storage_bytes_read += o.storage_bytes_read;
        self.storage_records_written += o.storage_records_written;
        self.storage_bytes_written += o.storage_bytes_written;
        self.storage_refused_torn += o.storage_refused_torn;
        self.storage_refused_checksum += o.storage_refused_checksum;
        self.storage_refused_fingerprint += o.storage_refused_fingerprint;
        self.storage_evictions += o.storage_evictions;
        self.storage_io_errors += o.storage_io_errors;
        self.storage_records_prefetched += o.storage_records_prefetched;
    }

    /// The counts that are this rank's own (bytes host→device, device→host, load-path syncs,
    /// bytes gathered, and what it read from, wrote to and had refused by the store), which
    /// a report sums over the ranks; the rest are the same on every rank.
    pub fn rank_counts(&self) -> [u64; RANK_COUNTS] {
        [
            self.bytes_h2d,
            self.bytes_d2h,
            self.load_path_syncs,
            self.bytes_gathered,
            self.storage_records_read,
            self.storage_bytes_read,
            self.storage_records_written,
            self.storage_bytes_written,
            self.storage_refused_torn,
            self.storage_refused_checksum,
            self.storage_refused_fingerprint,
            self.storage_evictions,
            self.storage_io_errors,
            self.storage_records_prefetched,
        ]
    }

    /// Sets the [`rank_counts`](Self::rank_counts), summed over the ranks.
    pub fn set_rank_counts(&mut self, counts: [u64; RANK_COUNTS]) {
        let [h2d, d2h, syncs, gathered, read, bytes_read, written, bytes_written, torn, checksum, fingerprint, evictions, io_errors, prefetched] =
            counts;
        self.bytes_h2d = h2d;
        self.bytes_d2h = d2h;
        self.load_path_syncs = syncs;
        self.bytes_gathered = gathered;
        self.storage_records_read = read;
        self.storage_bytes_read = bytes_read;
        self.storage_records_written = written;
        self.storage_bytes_written = bytes_written;
        self.storage_refused_torn = torn;
        self.storage_refused_checksum = checksum;
        self.storage_refused_fingerprint = fingerprint;
        self.storage_evictions = evictions;
        self.storage_io_errors = io_errors;
        self.storage_records_prefetched = prefetched;
    }

    /// Records refused by the store, of every kind.
    pub fn storage_refused(&self) -> u64 {
        self.storage_refused_torn + self.storage_refused_checksum + self.storage_refused_fingerprint
    }

    /// The [`rank_counts`](Self::rank_counts) of `all`, summed.
    pub fn sum_rank_counts<'a>(
        all: impl IntoIterator<Item = &'a RequestStats>,
    ) -> [u64; RANK_COUNTS] {
        let mut out = [0u64; RANK_COUNTS];
        for s in all {
            for (o, c) in out.iter_mut().zip(s.rank_counts()) {
                *o = o.saturating_add(c);
            }
        }
        out
    }
}

/// What the last rollback had to drop from the state it restored: cache entries whose pages
/// the failed operation had evicted and may have overwritten.
/// A rollback that drops something leaves the replicas in agreement but their digests
/// different from before the request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RollbackDrops {
    /// Device pages whose nodes lost their device copy (identical on every rank).
    pub device_pages: u64,
    /// Nodes that lost their host copy.
    pub host_copies: u64,
}

impl RollbackDrops {
    /// Whether the rollback dropped nothing (the state is exactly as before the request).
    pub fn is_empty(&self) -> bool {
        self.device_pages == 0 && self.host_copies == 0
    }
}
