//! `cp-hicache replay` through the binary: a small correct run, every `--inject` fault, and
//! bad input that must end in one clear line and exit status 2, never a panic.

use std::path::PathBuf;
use std::process::{Command, Output};

mod support;

/// `tests/data/mooncake_sample.jsonl` (48 records) replayed with 16 tokens per hash id on a
/// small MLA deployment whose host pool holds it, so load-backs happen.
const MOONCAKE_SAMPLE: &[&str] = &[
    "replay",
    "--trace",
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/mooncake_sample.jsonl"
    ),
    "--replay-block-tokens",
    "16",
    "--model",
    "mla",
    "--page-size",
    "16",
    "--cp",
    "4",
    "--layers",
    "1",
    "--device-pages",
    "129",
    "--host-pages",
    "256",
    "--quiet",
];

const SMALL: &[&str] = &[
    "replay",
    "--model",
    "mla",
    "--page-size",
    "64",
    "--cp",
    "4",
    "--layers",
    "1",
    "--conversations",
    "12",
    "--device-pages",
    "160",
    "--host-pages",
    "48",
    "--quiet",
];

fn replay(extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    replay_with(SMALL, extra)
}

/// [`SMALL`] with `--host-pages` set to `host_pages`, plus `extra`.
fn replay_host_pages(host_pages: &str, extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    replay_set(&[("--host-pages", host_pages)], extra)
}

/// [`SMALL`] with the options in `set` given other values (an option may appear only once),
/// plus `extra`.
fn replay_set(set: &[(&str, &str)], extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    let mut base = SMALL.to_vec();
    for &(opt, value) in set {
        let at = base.iter().position(|&a| a == opt).unwrap();
        base[at + 1] = value;
    }
    replay_with(&base, extra)
}

fn replay_with(base: &[&str], extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(base)
        .args(extra)
        .arg("--json")
        .arg(&json)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .env_remove("CP_HICACHE_JIT")
        .output()
        .unwrap();
    let report = std::fs::read_to_string(&json)
        .ok()
        .map(|t| serde_json::from_str(&t).unwrap());
    (out, report)
}

fn cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-replay-cache")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

// An unwritable --json is refused before the first request, not after the whole run.
#[test]
fn unwritable_json_is_refused_before_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("missing").join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(SMALL)
        .arg("--json")
        .arg(&bad)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("cannot write {}", bad.display())),
        "{}",
        stderr(&out)
    );
    assert!(
        out.stdout.is_empty(),
        "no report: the run never started: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// Two reports of the same workload served alike: the same tokens hit, loaded and
/// computed, in the same group rounds.
fn assert_same_requests(a: &serde_json::Value, b: &serde_json::Value, what: &str) {
    for k in [
        "prompt_tokens",
        "device_hit_tokens",
        "host_hit_tokens",
        "computed_tokens",
        "group_rounds",
    ] {
        assert_eq!(num(a, k), num(b, k), "{what}: {k}");
    }
}

fn num(r: &serde_json::Value, k: &str) -> u64 {
    r[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {r}"))
}

#[test]
fn small_run_verifies_and_reports() {
    let (out, report) = replay(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert_eq!(r["replicas_agree"], true);
    assert_eq!(r["device_lanes_agree"], true);
    assert!(num(&r, "host_hit_tokens") > 0, "{r}");
    assert!(num(&r, "pages_loaded") > 0);
    assert!(num(&r, "evictions_lru") > 0);
    assert_eq!(num(&r, "load_path_syncs"), 0);
    assert_eq!(
        num(&r, "prompt_tokens"),
        num(&r, "device_hit_tokens") + num(&r, "host_hit_tokens") + num(&r, "computed_tokens")
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("mismatched tokens"), "{text}");
    assert!(text.contains("device lane stacks agree     yes"), "{text}");
    assert_eq!(r["transfer_path"], "kernel");
}

/// The report says how the ranks ran: threads of one process, an executor each, peers'
/// pools in shared memory, and which ranks verified.
#[test]
fn the_report_says_how_the_ranks_ran() {
    let (out, report) = replay(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let g = &report.unwrap()["group"];
    assert_eq!(g["kind"], "local");
    assert_eq!(g["ranks"], 4);
    assert_eq!(g["peer_pools"], "shared-memory");
    assert_eq!(g["executor_per_rank"], true);
    assert_eq!(g["verifying_ranks"], 4);
    let (out, report) = replay(&["--verify-ranks", "1"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(r["group"]["verifying_ranks"], 1);
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ranks 0..1 verify"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
}

/// `--transfer dma` and `--transfer dma-each` move pages by copy regions instead of the
/// transfer kernel and serve the same verified hits (on the CPU both are `memcpy` per merged
/// run; on a GPU one batch call against one call per run).
#[test]
fn dma_transfers_verify_and_report() {
    for path in ["dma", "dma-each"] {
        let (out, report) = replay(&["--transfer", path]);
        assert_eq!(out.status.code(), Some(0), "{path}: {}", stderr(&out));
        let r = report.unwrap();
        assert_eq!(r["transfer_path"], path);
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{path}");
        assert!(num(&r, "host_hit_tokens") > 0, "{path}: {r}");
        assert_eq!(num(&r, "load_path_syncs"), 0, "{path}");
    }
}

/// A reader that stops early (`replay | head`) stops only the printing: the run goes on, its
/// `--json` is written and a mismatch still exits 1 (it used to end with status 0 and no
/// file, so a `pipefail` check passed the seed's bug).
#[test]
fn a_closed_stdout_keeps_the_verdict_and_the_report() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let args: Vec<&str> = SMALL.iter().copied().filter(|&a| a != "--quiet").collect();
    let out = support::output_with_closed_stdout(
        Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
            .args(&args)
            .args(["--inject", "plain-alloc-on-load", "--json"])
            .arg(&json)
            .env("CP_HICACHE_CACHE_DIR", cache_dir())
            .env_remove("CP_HICACHE_JIT"),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(num(&r, "mismatched_tokens") > 0, "{r}");
    assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
}

/// Round-robin owners serve and verify like zigzag (the report and the JSON name the
/// layout), and the seed's bug is caught under them too: loaded pages keep their recorded
/// owners whatever the pattern.
#[test]
fn the_round_robin_layout_serves_verified_and_catches_the_seed_bug() {
    let (out, report) = replay(&["--layout", "round-robin"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(r["layout"], "round-robin");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    assert!(num(&r, "host_hit_tokens") > 0, "{r}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("layers · round-robin ·"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let (out, report) = replay(&["--layout", "round-robin", "--inject", "plain-alloc-on-load"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(num(&report.unwrap(), "mismatched_tokens") > 0);
    let (_, report) = replay(&[]);
    assert_eq!(report.unwrap()["layout"], "zigzag");
}

/// Every layout replays the built-in conversations and a Mooncake-format trace (a sample of
/// the conversation trace, with repeated prefixes) with 0 mismatches on every rank, host
/// hits, and agreeing replicas; the interleaved layouts refuse the faults that have no
/// owners to lose, saying why.
#[test]
fn every_layout_replays_verified_with_host_hits() {
    let layouts: [&[&str]; 5] = [
        &["--layout", "zigzag"],
        &["--layout", "round-robin"],
        &["--layout", "page-interleave"],
        &["--layout", "token-interleave"],
        &["--layout", "token-interleave", "--interleave-size", "16"],
    ];
    for layout in layouts {
        for (what, (out, report)) in [
            ("built-in", replay(layout)),
            ("trace", replay_with(MOONCAKE_SAMPLE, layout)),
        ] {
            assert_eq!(
                out.status.code(),
                Some(0),
                "{layout:?} {what}: {}",
                stderr(&out)
            );
            let r = report.unwrap();
            assert_eq!(num(&r, "mismatched_tokens"), 0, "{layout:?} {what}: {r}");
            assert!(num(&r, "host_hit_tokens") > 0, "{layout:?} {what}: {r}");
            assert_eq!(r["replicas_agree"], true, "{layout:?} {what}: {r}");
            assert_eq!(r["device_lanes_agree"], true, "{layout:?} {what}: {r}");
        }
    }
    for fault in ["plain-alloc-on-load", "lane-exhaustion"] {
        let (out, _) = replay(&["--layout", "page-interleave", "--inject", fault]);
        assert_eq!(out.status.code(), Some(2), "{fault}: {}", stderr(&out));
        assert!(
            stderr(&out).contains(&format!("--inject {fault}: under page-interleave")),
            "{}",
            stderr(&out)
        );
    }
    let (out, _) = replay(&["--layout", "zigzag", "--interleave-size", "4"]);
    assert!(
        stderr(&out).contains("applies to token-interleave only"),
        "{}",
        stderr(&out)
    );
}

/// The seed's bug in the positional layouts' form: `granule-shift-on-load` puts each loaded
/// granule's pages one rank on, every page loaded back is read from another rank's slot,
/// and verification catches it (mismatches, exit status 1) as it catches
/// `plain-alloc-on-load` under zigzag; where a granule is one page it is refused.
#[test]
fn granule_shift_on_load_is_caught_under_the_positional_layouts() {
    for layout in [
        &["--layout", "page-interleave"][..],
        &["--layout", "token-interleave", "--interleave-size", "4"],
    ] {
        let (out, report) = replay(&[layout, &["--inject", "granule-shift-on-load"]].concat());
        assert_eq!(out.status.code(), Some(1), "{layout:?}: {}", stderr(&out));
        let r = report.unwrap();
        assert!(num(&r, "mismatched_tokens") > 0, "{layout:?}: {r}");
        assert!(num(&r, "pages_loaded_misowned") > 0, "{layout:?}: {r}");
    }
    let (out, _) = replay(&["--layout", "zigzag", "--inject", "granule-shift-on-load"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("nothing to shift"),
        "{}",
        stderr(&out)
    );
}

/// With `--peer-pools gathered` no rank reads a peer's pool: each sends its pages through
/// the group. The replay serves exactly as with mapped pools (the same hits and tokens, 0
/// mismatches, under a positional layout with chunked prefill and decode too), reports what
/// it gathered, and still catches the seed's bug.
#[test]
fn gathered_peer_pools_serve_like_mapped_ones_and_catch_the_seed_bug() {
    for extra in [
        &[][..],
        &[
            "--layout",
            "token-interleave",
            "--chunk-tokens",
            "100",
            "--decode-tokens",
            "7",
        ][..],
    ] {
        let (out, mapped) = replay(extra);
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {}", stderr(&out));
        let mapped = mapped.unwrap();
        let (out, gathered) = replay(&[extra, &["--peer-pools", "gathered"]].concat());
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {}", stderr(&out));
        let gathered = gathered.unwrap();
        assert_same_requests(&mapped, &gathered, &format!("{extra:?}"));
        assert!(num(&gathered, "host_hit_tokens") > 0, "{gathered}");
        assert_eq!(num(&gathered, "mismatched_tokens"), 0, "{gathered}");
        assert_eq!(num(&mapped, "bytes_gathered"), 0);
        assert!(num(&gathered, "bytes_gathered") > 0, "{gathered}");
        assert_eq!(gathered["group"]["peer_pools"], "gathered");
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("bytes gathered to verify"),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }
    let (out, report) = replay(&[
        "--peer-pools",
        "gathered",
        "--inject",
        "plain-alloc-on-load",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(num(&report.unwrap(), "mismatched_tokens") > 0);
}

#[test]
fn plain_alloc_on_load_reports_mismatches() {
    let (out, report) = replay(&["--inject", "plain-alloc-on-load"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r = report.unwrap();
    assert!(num(&r, "host_hit_tokens") > 0);
    assert!(
        num(&r, "mismatched_tokens") > 0,
        "the seed's bug must show: {r}"
    );
    // Wrongly loaded pages stay on the device, so later device hits mismatch too; but every
    // token is counted once, however many buffer kinds differ.
    assert!(
        num(&r, "mismatched_tokens") <= num(&r, "prompt_tokens"),
        "each token counts once: {r}"
    );
    assert!(
        stderr(&out).contains("mismatched tokens, the first at token"),
        "{}",
        stderr(&out)
    );
    assert_eq!(r["fault_fired"], true);
}

/// A fault that never fires tested nothing: with a device pool large enough that no
/// prefix is ever evicted there is no load-back for `plain-alloc-on-load` to corrupt, nor a
/// lane shortage for `lane-exhaustion`; the run says so (warning, report row, JSON).
#[test]
fn a_fault_that_never_fires_is_reported() {
    for (fault, why) in [
        (
            "plain-alloc-on-load",
            "no page was loaded back from the host",
        ),
        ("lane-exhaustion", "no allocation ran short of a lane"),
    ] {
        let (out, report) = replay_set(
            &[("--conversations", "2"), ("--device-pages", "1024")],
            &["--inject", fault],
        );
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(0), "{err}");
        assert!(
            err.contains(&format!(
                "warning: the injected fault {fault} never fired: {why}"
            )),
            "{err}"
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(&format!("{fault} (NEVER FIRED: {why}")),
            "{text}"
        );
        let r = report.unwrap();
        assert_eq!(r["fault_fired"], false, "{r}");
        assert!(r["fault_not_fired_because"].as_str().unwrap().contains(why));
    }
}

/// At CP 1 every page has the one owner: `plain-alloc-on-load` loads pages back but cannot
/// give one another owner, so it tested nothing and must not claim to have fired. At CP 4
/// (the run above, [`plain_alloc_on_load_reports_mismatches`]) it fires.
#[test]
fn plain_alloc_on_load_at_cp_1_never_fires() {
    let (out, report) = replay_set(
        &[("--cp", "1"), ("--device-pages", "24")],
        &["--inject", "plain-alloc-on-load"],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let r = report.unwrap();
    assert!(num(&r, "pages_loaded") > 0, "{r}");
    assert_eq!(num(&r, "pages_loaded_misowned"), 0, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    assert_eq!(r["fault_fired"], false, "{r}");
    let why = r["fault_not_fired_because"].as_str().unwrap();
    assert!(why.contains("at CP 1"), "{why}");
    assert!(err.contains("never fired: at CP 1"), "{err}");
}

/// A load-back whose short lane is held only by inner nodes (whose leaves hold the other
/// lane) evicts by LRU to uncover it, as the compute path would, instead of degrading to a
/// miss and then evicting the same nodes to recompute the page. MLA, page 16, CP 2, 9
/// device pages: four pages per lane. See: issue 20.
#[test]
fn r20_a_load_back_evicts_lru_before_degrading_to_a_miss() {
    let record16 = |ids: &[u32]| {
        let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
        format!(
            "{{\"timestamp\": 0, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
            16 * ids.len(),
            ids.join(", ")
        )
    };
    // P (one page, owner 0) is backed up; four 2-page prompts (owners 0,1) fill both lanes
    // and push P's device copy out; re-requesting their first pages splits each into an
    // inner node (lane 0) over a leaf (lane 1); then P comes back from the host.
    let mut trace = record16(&[100]);
    for i in 0..4 {
        trace += &record16(&[2 * i + 1, 2 * i + 2]);
    }
    for i in 0..4 {
        trace += &record16(&[2 * i + 1]);
    }
    trace += &record16(&[100]);
    let (out, report) =
        replay_trace_blocks(&trace, "16", &["--page-size", "16", "--device-pages", "9"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    let r = report.unwrap();
    assert_eq!(num(&r, "load_degraded_to_miss"), 0, "{r}");
    assert_eq!(num(&r, "host_hit_tokens"), 16, "{r}");
    assert_eq!(num(&r, "pages_loaded"), 1, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
}

#[test]
fn lane_exhaustion_stays_correct() {
    let (out, report) = replay(&["--inject", "lane-exhaustion"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(r["fault_fired"], true);
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert!(
        num(&r, "evictions_lane") + num(&r, "load_degraded_to_miss") > 0,
        "{r}"
    );
}

#[test]
fn host_pool_full_stays_correct() {
    let (out, report) = replay(&["--inject", "host-pool-full"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert!(num(&r, "backups_skipped") > 0, "{r}");
}

#[test]
fn compile_error_names_the_kernel() {
    let (out, _) = replay(&["--inject", "compile-error"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    // One error for the deployment, listing every kernel that failed.
    assert!(err.contains("error: deployment mla_"), "{err}");
    assert!(err.contains("kernels failed:"), "{err}");
    assert!(err.contains("host compile of `verify_mla_kv"), "{err}");
    assert!(
        err.contains("fault injected"),
        "the compiler log is shown: {err}"
    );
    assert!(!err.contains("panicked"), "{err}");
}

/// The launch failure is aimed at one rank (the last): every rank rolls the request back.
/// Its peers, which learn of the failure at their next collective call, may have evicted
/// (and poisoned) pages by then; the rollback drops the entries that held them, so the state
/// is either unchanged or changed by exactly those drops, and the replicas agree either way.
#[test]
fn launch_error_on_one_rank_rolls_every_rank_back() {
    let (out, report) = replay(&["--inject", "launch-error"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("injected fault"), "{err}");
    assert!(
        err.contains("state unchanged")
            || err.contains("rolled back, dropping stale cache entries"),
        "{err}"
    );
    assert!(!err.contains("disagree"), "{err}");
    let r = report.unwrap();
    assert_eq!(num(&r, "failed_requests"), 1);
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert_eq!(r["replicas_agree"], true);
}

/// Under write-back with a tiny host pool the failing request has evicted host copies before
/// its launch failed; the rollback drops them (their pages may have been reused), so the
/// state differs from before, yet the replicas agree and the report says so.
#[test]
fn a_rollback_that_drops_stale_entries_keeps_the_replicas_in_agreement() {
    let (out, report) =
        replay_host_pages("8", &["--policy", "write_back", "--inject", "launch-error"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("injected fault"), "{err}");
    assert!(
        err.contains("rolled back, dropping stale cache entries"),
        "{err}"
    );
    assert!(!err.contains("disagree"), "{err}");
    let r = report.unwrap();
    assert_eq!(num(&r, "failed_requests"), 1);
    assert!(num(&r, "rollback_dropped_host_copies") > 0, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert_eq!(r["replicas_agree"], true);
}

/// Runs replay expecting a usage error: exit 2, one clear line, no panic.
/// Runs `args`, expects exit status 2 naming `want`; returns stderr for further checks.
/// The `--help` text of `command` (none: the binary's own), checked to exit 0.
fn help_of(command: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(command)
        .arg("--help")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn usage_error(args: &[&str], want: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(args)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert!(err.contains(want), "{args:?}: {err} should mention {want}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn trace_file(lines: &str) -> tempfile::NamedTempFile {
    let f = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(f.path(), lines).unwrap();
    f
}

#[test]
fn bad_traces_name_the_line() {
    let good =
        "{\"timestamp\": 0, \"input_length\": 700, \"output_length\": 10, \"hash_ids\": [0, 1]}\n";
    for (bad, want) in [
        (
            "{\"timestamp\": 0, \"input_length\": 7",
            ":2: not a Mooncake trace record",
        ),
        (
            "{\"input_length\": -3, \"output_length\": 1, \"hash_ids\": [0]}",
            ":2: input_length -3",
        ),
        (
            "{\"input_length\": 5000000000, \"output_length\": 1, \"hash_ids\": [0]}",
            ":2: input_length 5000000000 is out of range",
        ),
        (
            "{\"input_length\": 100, \"output_length\": 1, \"hash_ids\": [0, 0, 0]}",
            ":2: too many hash_ids: input_length 100 needs ceil(100 / 512) = 1 \
             (one per 512-token block, --block-tokens 512), the line has 3",
        ),
        (
            "{\"input_length\": 1500, \"output_length\": 1, \"hash_ids\": [0, 1]}",
            ":2: too few hash_ids: input_length 1500 needs ceil(1500 / 512) = 3 \
             (one per 512-token block, --block-tokens 512), the line has 2",
        ),
        (
            "{\"timestamp\": 0, \"input_length\": 7, \"output_length\": 1, \"hash_ids\": [0]} x",
            ":2: not a Mooncake trace record: trailing characters at column 74",
        ),
    ] {
        let f = trace_file(&format!("{good}{bad}\n"));
        let path = f.path().to_str().unwrap();
        usage_error(
            &[
                "replay", "--trace", path, "--model", "mla", "--cp", "2", "-q",
            ],
            want,
        );
    }
    usage_error(
        &["replay", "--trace", "/nonexistent/t.jsonl", "-q"],
        "cannot read trace /nonexistent/t.jsonl",
    );
}

/// A request larger than the device pool is rolled back, counted as skipped and named once;
/// the replay goes on and still exits 0.
#[test]
fn an_oversized_request_is_skipped_and_the_replay_goes_on() {
    let ids = |n: usize| (0..n).map(|i| (100 + i).to_string()).collect::<Vec<_>>();
    let lines = format!(
        "{}\n{}\n{}\n{}\n",
        "{\"timestamp\": 0, \"input_length\": 88, \"output_length\": 1, \"hash_ids\": [0, 1]}",
        format_args!(
            "{{\"timestamp\": 1, \"input_length\": 1280, \"output_length\": 1, \"hash_ids\": [{}]}}",
            ids(20).join(", ")
        ),
        "{\"timestamp\": 2, \"input_length\": 188, \"output_length\": 1, \"hash_ids\": [0, 1, 2]}",
        format_args!(
            "{{\"timestamp\": 3, \"input_length\": 1536, \"output_length\": 1, \"hash_ids\": [{}]}}",
            ids(24).join(", ")
        ),
    );
    let (out, r) = replay_trace(&lines, &["--device-pages", "12"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(
            "request 1 (trace line 2) skipped: the request needs 20 device pages at once but \
             only 11 are free or its own"
        ),
        "{err}"
    );
    assert_eq!(err.matches("warning").count(), 1, "warned once: {err}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("requests skipped (no room)   2\n"), "{text}");
    let r = r.expect("a JSON report");
    assert_eq!(num(&r, "requests"), 4);
    assert_eq!(num(&r, "requests_skipped"), 2);
    assert_eq!(num(&r, "failed_requests"), 0);
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert_eq!(num(&r, "prompt_tokens"), 88 + 188);
    assert_eq!(r["replicas_agree"], true);
}

#[test]
fn bad_settings_are_usage_errors() {
    usage_error(&["replay", "--page-size", "48"], "must be a power of two");
    usage_error(&["replay", "--cp", "0"], "--cp");
    usage_error(&["replay", "--cp", "17"], "--cp");
    usage_error(
        &["replay", "--model", "nsa", "--page-size", "16"],
        "NSA requires page size 64",
    );
    usage_error(
        &["replay", "--inject", "cosmic-ray"],
        "unknown fault `cosmic-ray`",
    );
    usage_error(
        &["replay", "--transfer", "pcie"],
        "unknown transfer path `pcie`",
    );
    usage_error(
        &["replay", "--verify-ranks", "0"],
        "--verify-ranks 0 is not in 1..=8",
    );
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(SMALL)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .env("CP_HICACHE_GROUP_TIMEOUT", "soon")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("CP_HICACHE_GROUP_TIMEOUT=`soon` is not a positive number"),
        "{}",
        stderr(&out)
    );
    usage_error(
        &["replay", "--cp", "2", "--verify-ranks", "3"],
        "--verify-ranks 3 is not in 1..=2",
    );
    usage_error(
        &[
            "replay",
            "--model",
            "mla",
            "--cp",
            "2",
            "--layers",
            "1",
            "--device-pages",
            "12",
            "-q",
        ],
        "raise --device-pages",
    );
}

/// Runs `replay --trace` on `lines` (MLA, CP 2, one layer, 64 tokens per block) plus
/// `extra`, with a JSON report.
fn replay_trace(lines: &str, extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    replay_trace_blocks(lines, "64", extra)
}

/// [`replay_trace`] with `block_tokens` tokens per block.
fn replay_trace_blocks(
    lines: &str,
    block_tokens: &str,
    extra: &[&str],
) -> (Output, Option<serde_json::Value>) {
    let f = trace_file(lines);
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(["replay", "--trace"])
        .arg(f.path())
        .args([
            "--block-tokens",
            block_tokens,
            "--model",
            "mla",
            "--cp",
            "2",
            "--layers",
            "1",
            "-q",
        ])
        .args(extra)
        .arg("--json")
        .arg(&json)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    let report = std::fs::read_to_string(&json)
        .ok()
        .map(|t| serde_json::from_str(&t).unwrap());
    (out, report)
}

/// A trace record of `ids.len()` full 64-token blocks (the block size [`replay_trace`]
/// gives).
fn record(ids: &[u32]) -> String {
    let ids: Vec<String> = ids.iter().map(u32::to_string).collect();
    format!(
        "{{\"timestamp\": 0, \"input_length\": {}, \"output_length\": 1, \"hash_ids\": [{}]}}\n",
        64 * ids.len(),
        ids.join(", ")
    )
}

/// At CP 2 with 12 device pages lane 0 holds 5 pages and lane 1 holds 6. The second request
/// hits the first one's page (lane 0, held while it is served) and computes 9 more in the
/// zigzag pattern, 5 of them on lane 0: 10 pages fit the pool's 11, but lane 0 would need 6.
/// The warning names the lane and the cause, not a page count that seems to fit.
#[test]
fn a_lane_shortfall_is_named_as_such() {
    let trace = format!(
        "{}{}",
        record(&[0]),
        record(&[0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    );
    let (out, report) = replay_trace(&trace, &["--device-pages", "12"]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains(
            "request 1 (trace line 2) skipped: the request's 10 device pages fit the pool (11 \
             free or its own once everything unlocked is evicted) but not its owner lanes: lane \
             0 needs 6 (1 of the cached prefix + 5 to compute) but holds only 5 pages, 1 short \
             (computing the whole prompt afresh, without its cached prefix, would fit)"
        ),
        "{err}"
    );
    let r = report.unwrap();
    assert_eq!(num(&r, "requests_skipped"), 1);
    assert_eq!(num(&r, "mismatched_tokens"), 0);
}

/// Nothing verified is not a pass: an empty, blank or BOM-only trace and `--requests 0` are
/// usage errors, refused before any kernel is built.
#[test]
fn a_replay_of_no_request_is_a_usage_error() {
    for text in ["", "\n  \n\n", "\u{feff}\n"] {
        let f = trace_file(text);
        let path = f.path().to_str().unwrap();
        usage_error(
            &["replay", "--trace", path, "-q"],
            "has no request (it is empty or blank): nothing to verify",
        );
    }
    usage_error(
        &["replay", "--requests", "0", "-q"],
        "replaying 0 requests verifies nothing",
    );
}

/// `--json` naming the trace or the tuning file the replay reads is refused up front (exit
/// status 2, both flags named) instead of replacing that input with the report.
#[test]
fn json_may_not_overwrite_the_trace_or_the_tuning_file() {
    let trace = record(&[0, 1]);
    let f = trace_file(&trace);
    let path = f.path().to_str().unwrap();
    // The same file under another spelling is still the same file.
    let dotted = format!(
        "{}/./{}",
        f.path().parent().unwrap().display(),
        f.path().file_name().unwrap().to_string_lossy()
    );
    usage_error(
        &["replay", "--trace", path, "-q", "--json", &dotted],
        "--json",
    );
    usage_error(
        &["replay", "--trace", path, "-q", "--json", path],
        "is the --trace input",
    );
    assert_eq!(std::fs::read_to_string(f.path()).unwrap(), trace);

    let tuning = trace_file("{\"format\": 1, \"entries\": []}\n");
    let tpath = tuning.path().to_str().unwrap();
    usage_error(
        &["replay", "--tuning", tpath, "-q", "--json", tpath],
        "is the --tuning input",
    );
    assert_eq!(
        std::fs::read_to_string(tuning.path()).unwrap(),
        "{\"format\": 1, \"entries\": []}\n"
    );
}

/// A trace saved with a UTF-8 byte order mark replays like one without.
#[test]
fn a_trace_with_a_byte_order_mark_replays() {
    let (out, report) = replay_trace(&format!("\u{feff}{}", record(&[0, 1])), &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(num(&r, "requests"), 1);
    assert_eq!(num(&r, "prompt_tokens"), 128);
}

/// `--seed` and `--conversations` shape the built-in workload only; with a trace they would
/// be ignored, so they are refused.
#[test]
fn built_in_workload_options_conflict_with_a_trace() {
    let f = trace_file(&record(&[0]));
    let path = f.path().to_str().unwrap();
    for opt in ["--seed", "--conversations"] {
        usage_error(
            &["replay", "--trace", path, opt, "3", "-q"],
            "cannot be used with",
        );
    }
}

/// `--block-tokens` shapes a trace only: without one it would be ignored, so it is refused,
/// and its range is checked at parsing.
#[test]
fn block_tokens_needs_a_trace_and_a_range() {
    usage_error(&["replay", "--block-tokens", "64", "-q"], "--trace");
    let f = trace_file(&record(&[0]));
    let path = f.path().to_str().unwrap();
    usage_error(
        &["replay", "--trace", path, "--block-tokens", "0", "-q"],
        "0 is not in 1..=65536",
    );
}

/// A workload size past the generator's range is refused; it used to wrap around and
/// replay 4 requests, or none.
#[test]
fn a_huge_conversation_count_is_refused() {
    usage_error(
        &["replay", "--conversations", "4611686018427387905", "-q"],
        "not a conversation count in 1..=1000000",
    );
}

/// A directory given as the trace is named as one (it was "empty").
#[test]
fn a_directory_is_not_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    usage_error(
        &["replay", "--trace", dir.path().to_str().unwrap(), "-q"],
        "is a directory",
    );
}

/// A trace read from a pipe replays: counting its lines for the progress bar used to drain
/// it first, and the replay then saw no request.
#[test]
fn a_trace_from_a_pipe_replays() {
    use std::io::Write as _;
    let mut child = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(["replay", "--trace", "/dev/stdin", "--block-tokens", "64"])
        .args(["--model", "mla", "--cp", "2", "--layers", "1", "-q"])
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = [record(&[0, 1]), record(&[0, 1, 2])].join("\n");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        report.contains("requests                     2"),
        "{report}"
    );
}

/// A replay whose pools cannot fit in memory is refused before anything is allocated (it
/// used to be killed by the kernel's OOM killer, without a word).
#[test]
fn a_replay_too_large_for_memory_is_refused() {
    let args = [
        "replay",
        "--device-pages",
        "4000000000",
        "--backend",
        "host",
        "-q",
    ];
    let err = usage_error(&args, "GiB of host memory");
    // The lane allocators are part of the estimate (they used to be left out).
    assert!(err.contains("lane allocators"), "{err}");
}

/// Replay is the default command, so its options work without the word `replay`; with
/// another command they are refused.
#[test]
fn replay_options_work_without_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let mut args: Vec<&str> = SMALL[1..].to_vec();
    let at = args.iter().position(|&a| a == "--conversations").unwrap();
    args[at + 1] = "2";
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(&args)
        .arg("--json")
        .arg(&json)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(num(&r, "cp"), 4);
    assert!(r["workload"].as_str().unwrap().contains("2 conversations"));
    usage_error(&["--cp", "2", "info"], "cannot be used with");
}

#[test]
fn help_lists_values_and_ranges() {
    let help = help_of(&["replay"]);
    for want in [
        "write_through: back up every node",
        "write_back:    back up a node only when it is evicted",
        "auto: CUDA when a GPU is usable",
        "host: the CPU emulation",
        "cuda: the CUDA driver",
        "default: all of them",
        "1..=256",
        "Conversations in the built-in workload (not with --trace): each is",
        "Tokens one trace hash id stands for: the trace's block size",
    ] {
        assert!(help.contains(want), "{want} missing from\n{help}");
    }
    // `--storage` works under every layout (issue 44, finding 9): the text once said it was
    // refused with token-interleave.
    let storage = help
        .split("--storage <DIR>")
        .nth(1)
        .and_then(|s| s.split("--storage-bytes").next())
        .unwrap_or_else(|| panic!("--storage missing from\n{help}"));
    assert!(
        storage.contains("Under --layout token-interleave, where a sequence page is split"),
        "{storage}"
    );
    for stale in ["Not with --layout", "not built yet", "refused"] {
        assert!(
            !storage.contains(stale),
            "{stale:?} in --storage's help: {storage}"
        );
    }
    let help = help_of(&[]);
    assert!(
        help.contains("Replay options (without a command)"),
        "{help}"
    );
    assert!(help.contains("--conversations <N>"), "{help}");
}

/// The injected launch failure is aimed at the middle request; when that one is skipped as
/// too large before launching anything (nothing is cached for it to evict: the tiny
/// requests fill no whole page) the failure moves on to the next, and when no later request
/// launches anything the run says the fault never fired.
#[test]
fn a_launch_failure_aimed_at_a_skipped_request_moves_on() {
    let big: Vec<u32> = (100..120).collect();
    // 13 tokens: less than a page.
    let tiny =
        "{\"timestamp\": 0, \"input_length\": 13, \"output_length\": 1, \"hash_ids\": [0]}\n";
    let (out, report) = replay_trace(
        &format!("{tiny}{}{tiny}", record(&big)),
        &["--device-pages", "12", "--inject", "launch-error"],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("request 2 failed"), "{err}");
    let r = report.unwrap();
    assert_eq!(num(&r, "failed_requests"), 1);
    assert_eq!(num(&r, "requests_skipped"), 1);
    assert_eq!(r["fault_fired"], true);

    let (out, report) = replay_trace(
        &format!("{tiny}{}", record(&big)),
        &["--device-pages", "12", "--inject", "launch-error"],
    );
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(
        err.contains("warning: the injected fault launch-error never fired"),
        "{err}"
    );
    assert_eq!(report.unwrap()["fault_fired"], false);
}

/// `--block-tokens` is the trace's block size (DESIGN §5): a trace of 64-token blocks replays
/// with `--block-tokens 64` as exactly its input lengths (it was refused: the ids were always
/// counted as 512-token blocks, and --block-tokens only scaled the replay down).
#[test]
fn block_tokens_is_the_traces_block_size() {
    let trace = "{\"timestamp\": 0, \"input_length\": 128, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
                 {\"timestamp\": 1, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [1, 3]}\n";
    let (out, report) = replay_trace(trace, &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(num(&r, "requests"), 2);
    assert_eq!(num(&r, "prompt_tokens"), 228);
    assert!(r["workload"]
        .as_str()
        .unwrap()
        .contains("(64 tokens per block)"));
    // 512-token blocks read as 64-token ones are refused, with a hint.
    let f = trace_file(
        "{\"timestamp\": 0, \"input_length\": 700, \"output_length\": 1, \"hash_ids\": [0, 1]}\n",
    );
    usage_error(
        &[
            "replay",
            "--trace",
            f.path().to_str().unwrap(),
            "--block-tokens",
            "64",
            "-q",
        ],
        ":1: too few hash_ids: input_length 700 needs ceil(700 / 64) = 11 (one per 64-token \
         block, --block-tokens 64), the line has 2; it fits 512-token blocks",
    );
}

/// `--replay-block-tokens` scales a trace down: each hash id becomes N tokens, and the
/// lengths scale with it.
#[test]
fn replay_block_tokens_scales_the_trace() {
    let trace = "{\"timestamp\": 0, \"input_length\": 128, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
                 {\"timestamp\": 1, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [1, 3]}\n";
    let (out, report) = replay_trace(trace, &["--replay-block-tokens", "16"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    // 128 -> 32 tokens (two whole blocks of 16), 100 -> ceil(100 * 16 / 64) = 25.
    assert_eq!(num(&r, "prompt_tokens"), 32 + 25);
    assert!(
        r["workload"]
            .as_str()
            .unwrap()
            .contains("(64 tokens per block, replayed as 16)"),
        "{r}"
    );
    usage_error(&["replay", "--replay-block-tokens", "16", "-q"], "--trace");
}

/// A bad line in a trace file is refused before any work, naming file:line: the trace is
/// read through first. (It used to be found only when the replay reached it, after the
/// kernels were built and the requests before it verified, and the run then ended with no
/// report; here the compile-error fault would have ended the run first, with exit status 1.)
#[test]
fn a_bad_line_in_a_trace_file_is_refused_before_any_work() {
    let text = format!(
        "{}{}not json\n{}",
        record(&[0]),
        record(&[0, 1]),
        record(&[2])
    );
    let f = trace_file(&text);
    let path = f.path().to_str().unwrap();
    let args = [
        "replay",
        "--trace",
        path,
        "--block-tokens",
        "64",
        "-q",
        "--inject",
        "compile-error",
    ];
    usage_error(&args, &format!("{path}:3: not a Mooncake trace record"));
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(args)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    assert!(out.stdout.is_empty(), "no report: nothing ran");
    assert!(!stderr(&out).contains("compile"), "{}", stderr(&out));
    // Lines past --requests are not replayed, so not checked either.
    let (out, report) = replay_trace(&text, &["--requests", "2"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(num(&report.unwrap(), "requests"), 2);
}

/// A pipe cannot be read twice, so its bad line is found when the replay reaches it: the
/// replay stops there, still prints the report of what ran and writes --json (whose
/// workload says where it was cut), then exits 2. It used to exit 2 with no report at all.
#[test]
fn a_bad_line_in_a_pipe_stops_with_a_report() {
    use std::io::Write as _;
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(["replay", "--trace", "/dev/stdin", "--block-tokens", "64"])
        .args([
            "--model", "mla", "--cp", "2", "--layers", "1", "-q", "--json",
        ])
        .arg(&json)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = format!(
        "{}{}{{\"input_length\": 7\n{}",
        record(&[0, 1]),
        record(&[0, 1, 2]),
        record(&[3])
    );
    child
        .stdin
        .take()
        .unwrap()
        .write_all(lines.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains(
            "error: /dev/stdin:3: not a Mooncake trace record: EOF while parsing an object at \
             column 18\n  the replay stopped there: the report covers the 2 requests before it"
        ),
        "{err}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("requests                     2"), "{text}");
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(num(&r, "requests"), 2);
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    assert!(
        r["workload"]
            .as_str()
            .unwrap()
            .contains("cut short by /dev/stdin:3: not a Mooncake trace record"),
        "{r}"
    );
}

/// Chunked prefill and decode (`--chunk-tokens 256 --decode-tokens trace`) under every
/// layout, on the built-in workload and the Mooncake sample: requests grow by extends
/// (partial pages kept and verified after the prefill and after the decode), later turns hit
/// earlier answers, and nothing mismatches. The seed's fault is still caught when requests
/// are live; bad values are refused.
#[test]
fn chunked_prefill_and_decode_replay_verified_under_every_layout() {
    let live = ["--chunk-tokens", "256", "--decode-tokens", "trace"];
    for layout in [
        "zigzag",
        "round-robin",
        "page-interleave",
        "token-interleave",
    ] {
        let mut extra = vec!["--layout", layout];
        extra.extend(live);
        let mut runs = vec![("built-in", replay(&extra))];
        if layout == "zigzag" || layout == "token-interleave" {
            runs.push(("trace", replay_with(MOONCAKE_SAMPLE, &extra)));
        }
        for (what, (out, report)) in runs {
            assert_eq!(
                out.status.code(),
                Some(0),
                "{layout} {what}: {}",
                stderr(&out)
            );
            let r = report.unwrap();
            assert_eq!(num(&r, "mismatched_tokens"), 0, "{layout} {what}: {r}");
            assert!(
                num(&r, "extends") > num(&r, "requests"),
                "{layout} {what}: {r}"
            );
            assert!(num(&r, "extended_tokens") > 0, "{layout} {what}: {r}");
            let hit = num(&r, "device_hit_tokens") + num(&r, "host_hit_tokens");
            assert!(hit > 0, "{layout} {what}: {r}");
            assert_eq!(r["replicas_agree"], true, "{layout} {what}: {r}");
            assert_eq!(r["device_lanes_agree"], true, "{layout} {what}: {r}");
            assert_eq!(r["chunk_tokens"], 256, "{r}");
            assert_eq!(r["decode_tokens"], "trace", "{r}");
        }
    }
    // Decoded answers are hit by the next turn: more tokens hit than without the decode.
    let hits = |r: &serde_json::Value| num(r, "device_hit_tokens") + num(r, "host_hit_tokens");
    let plain = replay(&["--chunk-tokens", "256"]).1.unwrap();
    let decoded = replay(&live).1.unwrap();
    assert!(hits(&decoded) > hits(&plain), "{decoded}\n{plain}");
    // The seed's bug is caught in live requests too.
    let mut faulty = vec!["--inject", "plain-alloc-on-load"];
    faulty.extend(live);
    let (out, report) = replay(&faulty);
    let r = report.unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(num(&r, "mismatched_tokens") > 0, "{r}");
    for (bad, why) in [
        (["--chunk-tokens", "0"], "--chunk-tokens"),
        (
            ["--decode-tokens", "some"],
            "neither `trace` nor a token count",
        ),
    ] {
        let (out, _) = replay(&bad);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(stderr(&out).contains(why), "{bad:?}: {}", stderr(&out));
    }
}

/// Batches (`--batch 8`) under every layout: requests admitted, grown and ended together
/// through steps of at most one round (most decode steps none), every token verified, the
/// replicas agreeing; far fewer rounds a request than one at a time. A launch failure aimed
/// into a batch fails one request on every rank and the batch goes on; the seed's fault is
/// still caught.
#[test]
fn batched_requests_take_at_most_a_round_a_step_and_verify_under_every_layout() {
    let live = ["--chunk-tokens", "256", "--decode-tokens", "24"];
    // Room for eight requests at once.
    let big =
        |extra: &[&str]| replay_set(&[("--device-pages", "640"), ("--host-pages", "256")], extra);
    for layout in [
        "zigzag",
        "round-robin",
        "page-interleave",
        "token-interleave",
    ] {
        let mut extra = vec!["--layout", layout];
        extra.extend(live);
        let one = big(&extra).1.unwrap();
        extra.extend(["--batch", "8"]);
        let (out, r) = big(&extra);
        assert_eq!(out.status.code(), Some(0), "{layout}: {}", stderr(&out));
        let r = r.unwrap();
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{layout}: {r}");
        assert_eq!(r["replicas_agree"], true, "{layout}: {r}");
        assert_eq!(r["device_lanes_agree"], true, "{layout}: {r}");
        assert_eq!(r["batch"], 8, "{r}");
        assert_eq!(num(&r, "requests_skipped"), 0, "{layout}: {r}");
        assert!(num(&r, "steps") > num(&r, "requests"), "{layout}: {r}");
        let per_step = r["rounds_per_step"].as_f64().unwrap();
        assert!(per_step > 0.0 && per_step <= 1.0, "{layout}: {r}");
        let per_request = |r: &serde_json::Value| r["rounds_per_request"].as_f64().unwrap();
        assert!(
            per_request(&r) * 2.0 < per_request(&one),
            "{layout}: {r}\n{one}"
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains("group rounds / step"),
            "{layout}"
        );
    }
    let mut faulty = vec!["--batch", "8", "--inject", "launch-error"];
    faulty.extend(live);
    let (out, r) = big(&faulty);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r = r.unwrap();
    assert_eq!(num(&r, "failed_requests"), 1, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    assert_eq!(r["replicas_agree"], true, "{r}");
    // A small device pool, so that pages are loaded back from the host.
    let mut seed = vec!["--batch", "4", "--inject", "plain-alloc-on-load"];
    seed.extend(live);
    let (out, r) = replay(&seed);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(num(&r.unwrap(), "mismatched_tokens") > 0);
}

// `--processes`: each rank a process of this binary, agreeing through files and mapping
// each other's pools (shared memory): the same requests as the in-process replay, verified
// on every rank, and the seed's bug caught there too. A rank that dies ends the run with
// exit status 1, naming it, and the group's folder is removed.
#[test]
fn ranks_as_processes_replay_like_threads_and_catch_the_seed_bug() {
    let (out, threads) = replay(&[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let threads = threads.unwrap();
    let (out, procs) = replay(&["--processes"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let procs = procs.unwrap();
    assert_same_requests(&threads, &procs, "threads against processes");
    assert!(num(&procs, "host_hit_tokens") > 0, "{procs}");
    assert_eq!(num(&procs, "mismatched_tokens"), 0, "{procs}");
    assert_eq!(procs["group"]["kind"], "files", "{procs}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        text.matches("cp-hicache replay").count(),
        1,
        "one report, rank 0's: {text}"
    );
    let (out, report) = replay(&["--processes", "--inject", "plain-alloc-on-load"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(num(&report.unwrap(), "mismatched_tokens") > 0);
    // A rank process that cannot start its replay (a group timeout it refuses) fails alone
    // at once: every rank refuses it the same way, and the launcher says so.
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(SMALL)
        .arg("--processes")
        .env("CP_HICACHE_GROUP_TIMEOUT", "soon")
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("CP_HICACHE_GROUP_TIMEOUT=soon"),
        "{}",
        stderr(&out)
    );
}

/// `replay --model gqa`: a GQA shard (4 KV heads of 32 per rank, page 64) replays verified
/// under the four CP layouts, with host hits and 0 mismatched tokens, and its report names
/// the shape; the seed's bug is caught on it; `--kv-heads` without `--model gqa` is a usage
/// error, as is a shape with no heads.
#[test]
fn gqa_replays_verified_under_every_layout() {
    let gqa: &[(&str, &str)] = &[("--model", "gqa")];
    let shape = ["--kv-heads", "4", "--head-dim", "32"];
    for layout in [
        "zigzag",
        "round-robin",
        "page-interleave",
        "token-interleave",
    ] {
        let (out, report) = replay_set(gqa, &[&shape[..], &["--layout", layout]].concat());
        assert_eq!(out.status.code(), Some(0), "{layout}: {}", stderr(&out));
        let r = report.unwrap();
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{layout}: {r}");
        assert!(num(&r, "host_hit_tokens") > 0, "{layout}: {r}");
        assert_eq!(r["replicas_agree"], true, "{layout}: {r}");
        assert_eq!(r["model"], "gqa4x32", "{layout}: {r}");
    }
    let (out, report) = replay_set(
        gqa,
        &[&shape[..], &["--inject", "plain-alloc-on-load"]].concat(),
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(num(&report.unwrap(), "mismatched_tokens") > 0);
    usage_error(
        &["replay", "--model", "mla", "--kv-heads", "4"],
        "give --model gqa",
    );
    usage_error(
        &["replay", "--model", "gqa", "--kv-heads", "0"],
        "--kv-heads",
    );
    let help = help_of(&["replay"]);
    for want in [
        "gqa:",
        "--kv-heads <KV_HEADS>",
        "KV heads per rank",
        "[default: 8]",
        "--head-dim <HEAD_DIM>",
        "[default: 128]",
    ] {
        assert!(help.contains(want), "{want} missing from\n{help}");
    }
}

/// `replay --model gqa --tp-rank R --tp-size S`: a TP head shard replays verified into a
/// store and its report names the shard; the model's other shard is refused that store
/// (same shard shape, other heads: its records are not this shard's), naming both; a shard
/// that cannot exist, or a split of a model whose KV every TP rank shares, is a usage
/// error; `--help` says what the options do.
#[test]
fn gqa_tp_shards_replay_into_stores_of_their_own() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    let store = store.to_str().unwrap();
    let shard = |rank: &str| {
        replay_set(
            &[("--model", "gqa")],
            &[
                "--kv-heads",
                "4",
                "--head-dim",
                "32",
                "--tp-rank",
                rank,
                "--tp-size",
                "2",
                "--storage",
                store,
            ],
        )
    };
    let (out, report) = shard("0");
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = report.unwrap();
    assert_eq!(r["tp_shard"], "0/2", "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    assert!(num(&r, "storage_records_written") > 0, "{r}");
    let (out, _) = shard("1");
    assert_ne!(out.status.code(), Some(0), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(err.contains("tp=0/2") && err.contains("tp=1/2"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let (out, report) = replay_set(&[("--model", "gqa")], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(report.unwrap()["tp_shard"], serde_json::Value::Null);
    usage_error(
        &[
            "replay",
            "--model",
            "gqa",
            "--tp-rank",
            "2",
            "--tp-size",
            "2",
        ],
        "TP rank 2 is not below the TP size 2",
    );
    usage_error(&["replay", "--model", "gqa", "--tp-size", "0"], "TP size 0");
    usage_error(
        &[
            "replay",
            "--model",
            "mla",
            "--tp-rank",
            "1",
            "--tp-size",
            "2",
        ],
        "same latent KV on every TP rank",
    );
    let help = help_of(&["replay"]);
    for want in [
        "--tp-rank <R>",
        "--tp-size <S>",
        "which TP head shard",
        "[default: 1]",
    ] {
        assert!(help.contains(want), "{want} missing from\n{help}");
    }
}

/// `replay --processes` with a rank killed while it runs: its peers fail within the group
/// timeout, the launcher names the killed rank and exits 1, and the group's folder is
/// removed.
#[test]
fn a_killed_rank_process_ends_the_run_naming_it() {
    let launcher = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(SMALL)
        .args(["--processes", "--requests", "400"])
        .env("CP_HICACHE_GROUP_TIMEOUT", "5")
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = launcher.id();
    let children = format!("/proc/{pid}/task/{pid}/children");
    let start = std::time::Instant::now();
    let ranks: Vec<i32> = loop {
        let listed: Vec<i32> = std::fs::read_to_string(&children)
            .unwrap_or_default()
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        if listed.len() == 4 {
            break listed;
        }
        assert!(start.elapsed().as_secs() < 60, "the ranks never started");
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    // The victim's rank, from the member variable the launcher gave it (once it runs the
    // binary: until its exec, a child has the launcher's environment).
    let victim = ranks[2];
    let rank = loop {
        let environ = std::fs::read(format!("/proc/{victim}/environ")).unwrap_or_default();
        let member = environ
            .split(|&b| b == 0)
            .find_map(|v| v.strip_prefix(b"CP_HICACHE_REPLAY_MEMBER="))
            .map(|m| {
                String::from_utf8_lossy(m)
                    .split(' ')
                    .next()
                    .unwrap()
                    .to_string()
            });
        if let Some(rank) = member {
            break rank;
        }
        assert!(
            start.elapsed().as_secs() < 60,
            "rank process {victim} never ran"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    };
    // SAFETY: a plain kill(2) of a child this test's launcher started.
    assert_eq!(unsafe { libc::kill(victim, libc::SIGKILL) }, 0);
    let out = launcher.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains(&format!("rank {rank} was killed during the replay")),
        "{}",
        stderr(&out)
    );
    let prefix = format!("cp-hicache-group.{pid}.");
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "the group's folder is left: {left:?}");
}

/// `replay --processes` under `CP_HICACHE_REPLAY_WRAPPER` (a command each rank starts
/// under, `{rank}` its rank): here a script per rank that notes its process id and runs the
/// rank in its place. Every rank under its wrapper serves the replay; then rank 2's wrapper
/// is not executable, so its process cannot be started: the run exits 1 naming rank 2,
/// ranks 0 and 1 (started before it) fail their first round naming it and end (their
/// processes gone, nothing of theirs left in /dev/shm), rank 3 is never started, and the
/// group's folder is removed.
#[test]
fn a_rank_that_cannot_be_started_ends_the_run_naming_it() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let wrap = |r: u8, mode: u32| {
        let path = dir.path().join(format!("wrap-{r}"));
        let pid = dir.path().join(format!("pid-{r}"));
        std::fs::write(
            &path,
            format!("#!/bin/sh\necho $$ > '{}'\nexec \"$@\"\n", pid.display()),
        )
        .unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    let run = || {
        let child = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
            .args(SMALL)
            .args(["--processes", "--requests", "8"])
            .env(
                "CP_HICACHE_REPLAY_WRAPPER",
                format!("{}/wrap-{{rank}}", dir.path().display()),
            )
            .env("CP_HICACHE_GROUP_TIMEOUT", "30")
            .env("CP_HICACHE_CACHE_DIR", cache_dir())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let launcher = child.id();
        (launcher, child.wait_with_output().unwrap())
    };
    let pid = |r: u8| -> Option<i32> {
        std::fs::read_to_string(dir.path().join(format!("pid-{r}")))
            .ok()
            .map(|t| t.trim().parse().unwrap())
    };
    for r in 0..4 {
        wrap(r, 0o755);
    }
    let (_, out) = run();
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        (0..4).all(|r| pid(r).is_some()),
        "a rank ran without its wrapper"
    );
    for r in 0..4 {
        let _ = std::fs::remove_file(dir.path().join(format!("pid-{r}")));
    }
    wrap(2, 0o644);
    let (launcher, out) = run();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("error: cannot start rank 2 (") && err.contains("wrap-2"),
        "{err}"
    );
    assert!(
        err.contains("the CP group was aborted by rank 2 while it was being started"),
        "the started ranks did not name it: {err}"
    );
    assert_eq!(pid(3), None, "rank 3 was started after rank 2 could not be");
    for r in 0..2 {
        let p = pid(r).unwrap_or_else(|| panic!("rank {r} never ran: {err}"));
        assert!(
            !std::path::Path::new(&format!("/proc/{p}")).exists(),
            "rank {r} (process {p}) is still there"
        );
        let prefix = format!("cp-hicache-{p}-");
        let left: Vec<_> = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.starts_with(&prefix))
                    .collect()
            })
            .unwrap_or_default();
        assert!(left.is_empty(), "rank {r} left {left:?} in /dev/shm");
    }
    let prefix = format!("cp-hicache-group.{launcher}.");
    let left: Vec<_> = std::fs::read_dir(std::env::temp_dir())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    assert!(left.is_empty(), "the group's folder is left: {left:?}");
}
