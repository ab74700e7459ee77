//! Per-request statistics of the cluster and the replay report built from them.

pub use crate::rank::RequestStats;
use serde::Serialize;
use std::fmt::Write as _;

/// The replay report: totals plus the run's setting and outcome. Field names are the JSON
/// contract scripts rely on.
#[derive(Clone, Debug, Serialize)]
pub struct ReplayReport {
    /// Requests replayed.
    pub requests: u64,
    /// Totals over all requests.
    #[serde(flatten)]
    pub totals: RequestStats,
    /// Whether every rank's allocator and tree digests agreed after every request, and the
    /// device lane stacks with the allocators' mirrors at the end.
    pub replicas_agree: bool,
    /// Whether every rank's device lane stacks equalled its allocator's host mirror after
    /// the run.
    pub device_lanes_agree: bool,
    /// Group rounds per served request (`group_rounds` over the requests that were served;
    /// every rank takes the same rounds).
    pub rounds_per_request: f64,
    /// Requests served together (`replay --batch`); 1: one at a time.
    pub batch: u32,
    /// Serving steps of the batches (`RankCache::step` calls; 0 without `--batch`).
    pub steps: u64,
    /// Group rounds per serving step of the batches (0 without `--batch`).
    pub rounds_per_step: f64,
    /// Wall time of the replay loop.
    pub wall_seconds: f64,
    /// Prompt tokens per second of wall time.
    pub tokens_per_second: f64,
    /// Executor backend that ran the kernels.
    pub backend: String,
    /// CP degree.
    pub cp: u8,
    /// Page size in tokens.
    pub page_size: u32,
    /// Model buffer shape.
    pub model: String,
    /// The TP head shard of a split GQA model (`1/2`: shard 1 of 2); none unsplit.
    pub tp_shard: Option<String>,
    /// Layers per buffer.
    pub layers: u32,
    /// Write policy.
    pub policy: String,
    /// The CP layout (`zigzag`, `round-robin`, `page-interleave`, `token-interleave(I)`).
    pub layout: String,
    /// Prefill chunk in tokens (`--chunk-tokens`); none: whole prompts.
    pub chunk_tokens: Option<u32>,
    /// Tokens decoded after each prompt (`--decode-tokens`: a count or `trace`); none: no
    /// decode.
    pub decode_tokens: Option<String>,
    /// Workload description.
    pub workload: String,
    /// Requests that failed with an error (their state was rolled back).
    pub failed_requests: u64,
    /// Requests skipped because they need more device pages at once than the pool can give
    /// them (they were rolled back; the replay went on).
    pub requests_skipped: u64,
    /// Device pages whose cache entries the rollbacks of failed requests dropped, because
    /// the failed request had evicted them and may have reused them.
    pub rollback_dropped_device_pages: u64,
    /// Host copies the rollbacks of failed requests dropped, for the same reason.
    pub rollback_dropped_host_copies: u64,
    /// The injected fault, if any.
    pub fault: Option<String>,
    /// Whether the injected fault did anything (a load-back under `plain-alloc-on-load`, a
    /// failed launch under `launch-error`, …); none without a fault.
    pub fault_fired: Option<bool>,
    /// Why an injected fault never fired (then the run tested nothing of it).
    pub fault_not_fired_because: Option<String>,
    /// The tuning file whose launch shapes ran (`--tuning`, or `<cache>/tuning.json` when it
    /// exists); none when the defaults ran (no file, or none of its entries applied).
    pub tuning_file: Option<String>,
    /// Launch shape of the transfer and materialise kernels (from tuning, or the default).
    pub copy_launch: String,
    /// How the ranks ran: the collective (`kind`), `ranks`, how each reaches its peers'
    /// pools (`peer_pools`), and whether each has its own executor.
    pub group: super::GroupInfo,
    /// How pages moved between host and device (`kernel` or `dma`).
    pub transfer_path: String,
    /// Threads per block of the synthesise and verify kernels.
    pub synth_threads: u32,
    /// The storage tier (`--storage`): its directory, policy and byte budget; none without.
    pub storage: Option<String>,
}

impl ReplayReport {
    /// Whether the run is correct: no mismatched token and replicas in agreement.
    pub fn ok(&self) -> bool {
        self.totals.mismatched_tokens == 0 && self.replicas_agree && self.device_lanes_agree
    }

    /// The human-readable summary table.
    pub fn to_table(&self) -> String {
        let t = &self.totals;
        // Of every token the requests held: prompts and what extends added.
        let all = t.prompt_tokens + t.extended_tokens;
        let pct = |n: u64| {
            if all == 0 {
                0.0
            } else {
                100.0 * n as f64 / all as f64
            }
        };
        let mut s = String::new();
        let mut row = |k: &str, v: String| {
            let _ = writeln!(s, "  {k:<28} {v}");
        };
        row("workload", self.workload.clone());
        row(
            "deployment",
            format!(
                "{}{} · CP {} · page {} · {} layers · {} · {} · {}",
                self.model,
                self.tp_shard
                    .as_ref()
                    .map_or(String::new(), |tp| format!(" · TP shard {tp}")),
                self.cp,
                self.page_size,
                self.layers,
                self.layout,
                self.policy,
                self.backend
            ),
        );
        row(
            "tuning file",
            self.tuning_file
                .clone()
                .unwrap_or_else(|| "none: default shapes (`cp-hicache tune` finds faster)".into()),
        );
        row("copy launch shape", self.copy_launch.clone());
        row("host<->device transfers", self.transfer_path.clone());
        row("synth/verify threads", self.synth_threads.to_string());
        row("requests", self.requests.to_string());
        if self.requests_skipped > 0 {
            // The label fits the column; the skip warning says what did not fit.
            row(
                "requests skipped (no room)",
                self.requests_skipped.to_string(),
            );
        }
        row("prompt tokens", t.prompt_tokens.to_string());
        if self.chunk_tokens.is_some() || self.decode_tokens.is_some() {
            row(
                "live requests",
                format!(
                    "prefill {} · decode {} · {} tokens added by {} extends",
                    self.chunk_tokens
                        .map_or("whole".to_string(), |c| format!("in {c}-token chunks")),
                    self.decode_tokens.as_deref().unwrap_or("none"),
                    t.extended_tokens,
                    t.extends
                ),
            );
        }
        row(
            "device hit tokens",
            format!("{} ({:.1}%)", t.device_hit_tokens, pct(t.device_hit_tokens)),
        );
        row(
            "host hit tokens (loaded)",
            format!("{} ({:.1}%)", t.host_hit_tokens, pct(t.host_hit_tokens)),
        );
        if let Some(storage) = &self.storage {
            row("storage", storage.clone());
            row(
                "storage hit tokens (read)",
                format!(
                    "{} ({:.1}%)",
                    t.storage_hit_tokens,
                    pct(t.storage_hit_tokens)
                ),
            );
            row(
                "storage records read",
                format!(
                    "{} ({}; {} read ahead)",
                    t.storage_records_read,
                    human_bytes(t.storage_bytes_read),
                    t.storage_records_prefetched
                ),
            );
            row(
                "storage records written",
                format!(
                    "{} ({})",
                    t.storage_records_written,
                    human_bytes(t.storage_bytes_written)
                ),
            );
            row(
                "storage records refused",
                format!(
                    "{} (torn {} · checksum {} · fingerprint {})",
                    t.storage_refused(),
                    t.storage_refused_torn,
                    t.storage_refused_checksum,
                    t.storage_refused_fingerprint
                ),
            );
            row("storage evictions", t.storage_evictions.to_string());
            if t.storage_io_errors > 0 {
                row(
                    "storage I/O errors",
                    format!(
                        "{} (served as misses or left unwritten)",
                        t.storage_io_errors
                    ),
                );
            }
            if t.storage_reads_skipped > 0 {
                row(
                    "storage reads skipped",
                    format!("{} (no host room)", t.storage_reads_skipped),
                );
            }
        }
        row(
            "computed tokens",
            format!("{} ({:.1}%)", t.computed_tokens, pct(t.computed_tokens)),
        );
        row(
            "pages loaded / written",
            format!("{} / {}", t.pages_loaded, t.pages_written),
        );
        row(
            "evictions lru / lane",
            format!("{} / {}", t.evictions_lru, t.evictions_lane),
        );
        row(
            "load-backs degraded to miss",
            t.load_degraded_to_miss.to_string(),
        );
        if t.pages_loaded_misowned > 0 {
            row("pages loaded misowned", t.pages_loaded_misowned.to_string());
        }
        row("host copies replaced", t.host_copies_replaced.to_string());
        row("backups skipped (host full)", t.backups_skipped.to_string());
        row(
            "host evictions for backups",
            t.host_evictions_for_backup.to_string(),
        );
        row(
            "bytes h2d / d2h",
            format!(
                "{} / {}",
                human_bytes(t.bytes_h2d),
                human_bytes(t.bytes_d2h)
            ),
        );
        if t.bytes_gathered > 0 {
            row("bytes gathered to verify", human_bytes(t.bytes_gathered));
        }
        row("load-path syncs", t.load_path_syncs.to_string());
        row(
            "group rounds / request",
            format!("{:.2} ({} in all)", self.rounds_per_request, t.group_rounds),
        );
        if self.batch > 1 {
            row(
                "group rounds / step",
                format!(
                    "{:.2} ({} steps of batches of {})",
                    self.rounds_per_step, self.steps, self.batch
                ),
            );
        }
        row(
            "ranks",
            format!(
                "{} {}, {} group, {} peer pools{}, {}",
                self.group.ranks,
                // LocalGroup ranks are threads of this process; any other group's are
                // processes of their own.
                if self.group.kind == "local" {
                    "threads"
                } else {
                    "processes"
                },
                self.group.kind,
                self.group.peer_pools,
                if self.group.executor_per_rank {
                    ", an executor each"
                } else {
                    ", one executor"
                },
                if self.group.verifying_ranks == self.group.ranks {
                    "every rank verifies".to_string()
                } else {
                    format!("ranks 0..{} verify", self.group.verifying_ranks)
                }
            ),
        );
        row(
            "throughput",
            format!(
                "{:.0} tokens/s ({:.2} s)",
                self.tokens_per_second, self.wall_seconds
            ),
        );
        row(
            "replicas agree",
            if self.replicas_agree { "yes" } else { "NO" }.into(),
        );
        row(
            "device lane stacks agree",
            if self.device_lanes_agree { "yes" } else { "NO" }.into(),
        );
        if let Some(f) = &self.fault {
            let outcome = match (self.fault_fired, &self.fault_not_fired_because) {
                (Some(false), Some(why)) => format!(" (NEVER FIRED: {why})"),
                (Some(false), None) => " (NEVER FIRED)".into(),
                _ => String::new(),
            };
            row("injected fault", format!("{f}{outcome}"));
        }
        if self.failed_requests > 0 {
            row("failed requests", self.failed_requests.to_string());
            row(
                "dropped by rollbacks",
                format!(
                    "{} device pages / {} host copies",
                    self.rollback_dropped_device_pages, self.rollback_dropped_host_copies
                ),
            );
        }
        row("mismatched tokens", t.mismatched_tokens.to_string());
        s
    }
}

/// Bytes with a binary unit, for tables.
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report of one clean request.
    fn sample() -> ReplayReport {
        ReplayReport {
            requests: 1,
            totals: RequestStats::default(),
            replicas_agree: true,
            device_lanes_agree: true,
            rounds_per_request: 3.0,
            batch: 1,
            steps: 0,
            rounds_per_step: 0.0,
            wall_seconds: 1.0,
            tokens_per_second: 0.0,
            backend: "host".into(),
            cp: 8,
            page_size: 64,
            model: "nsa".into(),
            tp_shard: None,
            layers: 4,
            policy: "write_through".into(),
            layout: "zigzag".into(),
            chunk_tokens: None,
            decode_tokens: None,
            workload: "built-in".into(),
            failed_requests: 0,
            requests_skipped: 0,
            rollback_dropped_device_pages: 0,
            rollback_dropped_host_copies: 0,
            fault: None,
            fault_fired: None,
            fault_not_fired_because: None,
            tuning_file: None,
            copy_launch: "t1_ppb16_v16_u1".into(),
            group: super::super::GroupInfo {
                kind: "local",
                ranks: 8,
                peer_pools: "shared-memory",
                executor_per_rank: true,
                verifying_ranks: 8,
            },
            transfer_path: "kernel".into(),
            synth_threads: 1,
            storage: None,
        }
    }

    #[test]
    fn json_has_the_contract_fields() {
        let r = sample();
        let v = serde_json::to_value(&r).unwrap();
        for k in [
            "requests",
            "prompt_tokens",
            "device_hit_tokens",
            "host_hit_tokens",
            "computed_tokens",
            "pages_loaded",
            "pages_written",
            "evictions_lru",
            "evictions_lane",
            "load_degraded_to_miss",
            "bytes_h2d",
            "bytes_d2h",
            "mismatched_tokens",
            "replicas_agree",
            "device_lanes_agree",
            "load_path_syncs",
            "fence_syncs",
            "group_rounds",
            "bytes_gathered",
            "rounds_per_request",
            "failed_requests",
            "requests_skipped",
            "rollback_dropped_device_pages",
            "rollback_dropped_host_copies",
            "wall_seconds",
            "tokens_per_second",
            "backend",
            "cp",
            "page_size",
            "layout",
            "storage_hit_tokens",
            "storage_records_read",
            "storage_records_written",
            "storage_refused_checksum",
            "storage_evictions",
        ] {
            assert!(v.get(k).is_some(), "missing {k}");
        }
        assert!(r.ok());
        assert!(r.to_table().contains("mismatched tokens"));
        assert_eq!(human_bytes(3 << 20), "3.0 MiB");
    }

    /// Every row's value starts in the same column, optional rows included.
    #[test]
    fn every_row_is_aligned() {
        let r = ReplayReport {
            requests: 3,
            failed_requests: 1,
            requests_skipped: 2,
            fault: Some("plain-alloc-on-load".into()),
            fault_fired: Some(false),
            fault_not_fired_because: Some("no load-back".into()),
            storage: Some("/tmp/store · with-host · 16.0 GiB".into()),
            tp_shard: Some("1/2".into()),
            ..sample()
        };
        let table = r.to_table();
        assert!(table.contains(" · TP shard 1/2 · CP "), "{table}");
        assert!(table.contains("requests skipped (no room)   2"), "{table}");
        assert!(
            table.contains("plain-alloc-on-load (NEVER FIRED: no load-back)"),
            "{table}"
        );
        for line in table.lines() {
            let b = line.as_bytes();
            assert!(
                b.len() > 31 && b[30] == b' ' && b[31] != b' ',
                "misaligned row: {line:?}\n{table}"
            );
        }
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["requests_skipped"], 2);
        assert_eq!(v["fault_fired"], false);
    }
}
