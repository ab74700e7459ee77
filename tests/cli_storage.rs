//! `cp-hicache replay --storage`: a store one run writes is read back by fresh processes
//! under other CP degrees and layouts with 0 mismatches; every damaged record is refused
//! and counted, and one that gets past the store's checks is caught by verification; two
//! runs share one directory at once and leave only whole records.

use cp_hicache::kernels::{Deployment, ModelShape};
use cp_hicache::storage::{record, Fingerprint, RecordKey};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// A small MLA deployment whose prompts fit the device pool at every CP degree used here.
const BASE: &[&str] = &[
    "replay",
    "--model",
    "mla",
    "--page-size",
    "64",
    "--layers",
    "2",
    "--conversations",
    "6",
    "--device-pages",
    "256",
    "--quiet",
];

/// [`BASE`] with `--storage store` and `extra` (option-value pairs; one that [`BASE`] has
/// replaces its value there).
fn replay(store: &Path, extra: &[&str]) -> (Output, Option<serde_json::Value>) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let out = command(store, extra, &json).output().unwrap();
    let report = std::fs::read_to_string(&json)
        .ok()
        .map(|t| serde_json::from_str(&t).unwrap());
    (out, report)
}

/// The command [`replay`] runs, its JSON report written to `json`.
fn command(store: &Path, extra: &[&str], json: &Path) -> Command {
    let mut base = BASE.to_vec();
    let mut rest = Vec::new();
    for pair in extra.chunks(2) {
        match base.iter().position(|&a| a == pair[0]) {
            Some(at) if pair.len() == 2 => base[at + 1] = pair[1],
            _ => rest.extend_from_slice(pair),
        }
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cp-hicache"));
    cmd.args(&base)
        .arg("--storage")
        .arg(store)
        .args(&rest)
        .arg("--json")
        .arg(json)
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .env_remove("CP_HICACHE_JIT");
    cmd
}

fn cache_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("cli-storage-cache")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn num(r: &serde_json::Value, k: &str) -> u64 {
    r[k].as_u64()
        .unwrap_or_else(|| panic!("{k} missing in {r}"))
}

/// A store written by a CP 8 run.
fn written_at_cp8() -> tempfile::TempDir {
    let store = tempfile::tempdir().unwrap();
    let (out, r) = replay(store.path(), &["--cp", "8"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(num(&r, "storage_records_written") > 0, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0);
    store
}

/// Copies a store (a fault damages the records it reads; each test gets its own).
fn copy_of(store: &Path) -> tempfile::TempDir {
    let to = tempfile::tempdir().unwrap();
    let status = Command::new("cp")
        .arg("-r")
        .arg(format!("{}/.", store.display()))
        .arg(to.path())
        .status()
        .unwrap();
    assert!(status.success());
    to
}

#[test]
fn a_store_written_at_cp8_reads_back_at_cp4_cp2_cp1_and_under_another_layout() {
    let store = written_at_cp8();
    for extra in [
        &["--cp", "4"][..],
        &["--cp", "2"],
        &["--cp", "1"],
        &["--cp", "2", "--layout", "page-interleave"],
        &["--cp", "4", "--layout", "round-robin"],
        &["--cp", "4", "--layout", "token-interleave"],
        &["--cp", "4", "--peer-pools", "gathered"],
        &["--cp", "2", "--chunk-tokens", "100", "--decode-tokens", "7"],
        &[
            "--cp",
            "4",
            "--policy",
            "write_back",
            "--device-pages",
            "128",
        ],
    ] {
        let (out, r) = replay(store.path(), extra);
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {}", stderr(&out));
        let r = r.unwrap();
        assert!(num(&r, "storage_hit_tokens") > 0, "{extra:?}: {r}");
        assert!(num(&r, "storage_records_read") > 0, "{extra:?}: {r}");
        assert_eq!(num(&r, "storage_refused_checksum"), 0, "{extra:?}: {r}");
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{extra:?}: {r}");
        assert_eq!(r["replicas_agree"], true);
        assert!(r["storage"].as_str().unwrap().contains("with-host"), "{r}");
        // Each rank reads its own pages: as many records as pages the hits cover; under
        // token-interleave every rank reads each record of its granule (its tokens of it).
        let per_record = if extra.contains(&"token-interleave") {
            4
        } else {
            1
        };
        assert_eq!(
            num(&r, "storage_records_read") * 64,
            num(&r, "storage_hit_tokens") * per_record,
            "{extra:?}: {r}"
        );
    }
}

#[test]
fn the_seed_bug_is_caught_on_pages_read_from_the_store() {
    let store = written_at_cp8();
    let (out, r) = replay(
        store.path(),
        &["--cp", "4", "--inject", "plain-alloc-on-load"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(num(&r, "storage_hit_tokens") > 0, "{r}");
    assert!(num(&r, "pages_loaded_misowned") > 0, "{r}");
    assert!(num(&r, "mismatched_tokens") > 0, "{r}");
}

/// Records written in parts under `token-interleave` (each rank its tokens of every page)
/// read back under zigzag, at CP 1, and under another interleave, with 0 mismatches.
#[test]
fn records_written_in_parts_read_back_under_any_layout_and_degree() {
    let store = tempfile::tempdir().unwrap();
    let (out, r) = replay(
        store.path(),
        &[
            "--cp",
            "8",
            "--layout",
            "token-interleave",
            "--interleave-size",
            "16",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(num(&r, "storage_records_written") > 0, "{r}");
    let left = std::fs::read_dir(store.path().join("parts")).map_or(0, |d| d.count());
    assert_eq!(left, 0, "every record's parts all came");
    for extra in [
        &["--cp", "4"][..],
        &["--cp", "1"],
        &[
            "--cp",
            "2",
            "--layout",
            "token-interleave",
            "--interleave-size",
            "4",
        ],
    ] {
        let (out, r) = replay(store.path(), extra);
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {}", stderr(&out));
        let r = r.unwrap();
        assert!(num(&r, "storage_hit_tokens") > 0, "{extra:?}: {r}");
        assert_eq!(num(&r, "storage_refused_torn"), 0, "{extra:?}: {r}");
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{extra:?}: {r}");
    }
}

/// Reading the next request's records ahead changes when records are read, never what a
/// request sees: the same hits, records and digests as without, most records read ahead.
#[test]
fn records_read_ahead_serve_exactly_as_records_read_at_the_request() {
    let store = written_at_cp8();
    let (out, ahead) = replay(store.path(), &["--cp", "4"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (out, now) = replay(store.path(), &["--cp", "4", "--no-prefetch"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let (ahead, now) = (ahead.unwrap(), now.unwrap());
    for k in [
        "storage_hit_tokens",
        "storage_records_read",
        "computed_tokens",
        "device_hit_tokens",
        "group_rounds",
        "mismatched_tokens",
    ] {
        assert_eq!(ahead[k], now[k], "{k}");
    }
    assert_eq!(num(&now, "storage_records_prefetched"), 0);
    assert!(
        num(&ahead, "storage_records_prefetched") * 2 > num(&ahead, "storage_records_read"),
        "{ahead}"
    );
}

#[test]
fn damaged_records_are_refused_counted_and_served_as_misses() {
    let store = written_at_cp8();
    for (fault, counter) in [
        ("storage-torn", "storage_refused_torn"),
        ("storage-flip", "storage_refused_checksum"),
        ("storage-foreign", "storage_refused_fingerprint"),
        ("storage-io", "storage_io_errors"),
        ("storage-part-missing", "storage_refused_torn"),
    ] {
        let copy = copy_of(store.path());
        let (out, r) = replay(copy.path(), &["--cp", "4", "--inject", fault]);
        assert_eq!(out.status.code(), Some(0), "{fault}: {}", stderr(&out));
        let r = r.unwrap();
        assert!(num(&r, counter) > 0, "{fault}: {r}");
        assert_eq!(r["fault_fired"], true, "{fault}: {r}");
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{fault}: {r}");
        // Refused records were recomputed and written again: a clean run reads them all.
        let (out, r) = replay(copy.path(), &["--cp", "4"]);
        assert_eq!(out.status.code(), Some(0), "{fault}: {}", stderr(&out));
        let r = r.unwrap();
        for k in [
            "storage_refused_torn",
            "storage_refused_checksum",
            "storage_refused_fingerprint",
            "storage_io_errors",
        ] {
            assert_eq!(num(&r, k), 0, "{fault} then clean: {r}");
        }
    }
}

#[test]
fn a_record_past_the_stores_checks_is_caught_by_verification() {
    let store = written_at_cp8();
    let (out, r) = replay(
        store.path(),
        &["--cp", "4", "--inject", "storage-unchecked"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(num(&r, "mismatched_tokens") > 0, "{r}");
    assert_eq!(r["fault_fired"], true, "{r}");
}

#[test]
fn two_runs_sharing_a_directory_at_once_leave_only_whole_records() {
    let store = tempfile::tempdir().unwrap();
    // One of them writes records in parts (token-interleave), one whole records, some of
    // them the same records (the workloads share prompts' beginnings).
    let runs: Vec<_> = [("8", "1", "zigzag"), ("4", "2", "token-interleave")]
        .into_iter()
        .map(|(cp, seed, layout)| {
            let store = store.path().to_path_buf();
            std::thread::spawn(move || {
                replay(&store, &["--cp", cp, "--seed", seed, "--layout", layout])
            })
        })
        .collect();
    for run in runs {
        let (out, r) = run.join().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        assert_eq!(num(&r.unwrap(), "mismatched_tokens"), 0);
    }
    // Every record at its final name decodes whole, under the key it is filed as.
    let dep = Deployment::new(ModelShape::MlaBf16, 64, 1).unwrap();
    let fp = Fingerprint::of(&dep, 2);
    let payload = cp_hicache::storage::payload_bytes(&dep, 2);
    let mut records = 0;
    for dir in std::fs::read_dir(store.path().join("records")).unwrap() {
        for f in std::fs::read_dir(dir.unwrap().path()).unwrap() {
            let path = f.unwrap().path();
            let name = path.file_stem().unwrap().to_str().unwrap();
            let key = RecordKey(hex_key(name));
            let bytes = std::fs::read(&path).unwrap();
            record::decode(&bytes, &fp, &key, payload)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            records += 1;
        }
    }
    assert!(records > 0);
    // Every part found its record: none is left waiting.
    let parts = store.path().join("parts");
    let left = std::fs::read_dir(&parts).map_or(0, |d| d.count());
    assert_eq!(left, 0, "parts left in {}", parts.display());
    // Both workloads read back in full by fresh runs: nothing refused.
    for seed in ["1", "2"] {
        let (out, r) = replay(store.path(), &["--cp", "2", "--seed", seed]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let r = r.unwrap();
        assert!(num(&r, "storage_hit_tokens") > 0, "{r}");
        assert_eq!(num(&r, "storage_refused_torn"), 0, "{r}");
        assert_eq!(num(&r, "storage_refused_checksum"), 0, "{r}");
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    }
}

fn hex_key(name: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(&name[2 * i..2 * i + 2], 16).unwrap();
    }
    out
}

#[test]
fn storage_settings_that_cannot_work_are_refused_before_the_run() {
    let store = tempfile::tempdir().unwrap();
    for (extra, says) in [
        (&["--storage-bytes", "0"][..], "not a positive byte count"),
        (&["--storage-bytes", "12X"], "unknown unit `X`"),
        (&["--storage-policy", "sometimes"], "unknown storage policy"),
    ] {
        let (out, _) = replay(store.path(), extra);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {}", stderr(&out));
        assert!(stderr(&out).contains(says), "{extra:?}: {}", stderr(&out));
    }
    let file = store.path().join("a-file");
    std::fs::write(&file, b"not a store").unwrap();
    let (out, _) = replay(&file, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("is not a directory"),
        "{}",
        stderr(&out)
    );
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(BASE)
        .args(["--inject", "storage-flip"])
        .env("CP_HICACHE_CACHE_DIR", cache_dir())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("give --storage DIR"),
        "{}",
        stderr(&out)
    );
}

/// `on-host-evict` writes a page when its host copy is evicted: with a small host pool the
/// store fills as copies go, the same run reads some back, and a later run reads them.
#[test]
fn on_host_evict_writes_evicted_host_copies() {
    let store = tempfile::tempdir().unwrap();
    let small_host = [
        "--cp",
        "4",
        "--conversations",
        "12",
        "--host-pages",
        "64",
        "--storage-policy",
        "on-host-evict",
    ];
    let (out, r) = replay(store.path(), &small_host);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(num(&r, "host_evictions_for_backup") > 0, "{r}");
    assert!(num(&r, "storage_records_written") > 0, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    assert!(
        r["storage"].as_str().unwrap().contains("on-host-evict"),
        "{r}"
    );
    let (out, r) = replay(store.path(), &["--cp", "2", "--conversations", "12"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(num(&r, "storage_hit_tokens") > 0, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
}

/// Batches through `step` read the store too (issue 45): each rank installs the run it found
/// and the outcome round compares them, so a clean read takes a round a step, and records
/// refused on one rank only (a damaged record) make the step run again with the shortest run:
/// storage hits, 0 mismatches, the replicas agreeing.
#[test]
fn batched_steps_read_the_store_and_agree_on_runs_that_differ() {
    let store = written_at_cp8();
    let copy = copy_of(store.path());
    let (out, clean) = replay(copy.path(), &["--cp", "4", "--batch", "4"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let clean = clean.unwrap();
    assert!(num(&clean, "storage_hit_tokens") > 0, "{clean}");
    assert_eq!(num(&clean, "mismatched_tokens"), 0, "{clean}");
    assert!(clean["rounds_per_step"].as_f64().unwrap() <= 1.0, "{clean}");
    let copy = copy_of(store.path());
    let (out, torn) = replay(
        copy.path(),
        &["--cp", "4", "--batch", "4", "--inject", "storage-torn"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let torn = torn.unwrap();
    assert!(num(&torn, "storage_refused_torn") > 0, "{torn}");
    assert_eq!(num(&torn, "mismatched_tokens"), 0, "{torn}");
    assert_eq!(torn["replicas_agree"], true, "{torn}");
    assert!(
        num(&torn, "group_rounds") > num(&clean, "group_rounds"),
        "{torn}\n{clean}"
    );
}

/// A GQA deployment's K and V pages (4 KV heads of 32, page 64) go to the store in one run
/// (CP 4) and come back in fresh processes at CP 2 and 1 and under token-interleave, with 0
/// mismatched tokens; a store of one GQA shard shape is refused by a run of another (its
/// fingerprint names the heads), before any work.
#[test]
fn gqa_pages_round_trip_through_the_store() {
    const GQA: &[&str] = &["--model", "gqa", "--kv-heads", "4", "--head-dim", "32"];
    let store = tempfile::tempdir().unwrap();
    let (out, r) = replay(store.path(), &[GQA, &["--cp", "4"]].concat());
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(num(&r, "storage_records_written") > 0, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    assert_eq!(r["model"], "gqa4x32", "{r}");
    for extra in [
        &["--cp", "2"][..],
        &["--cp", "1"],
        &["--cp", "4", "--layout", "token-interleave"],
    ] {
        let (out, r) = replay(store.path(), &[GQA, extra].concat());
        assert_eq!(out.status.code(), Some(0), "{extra:?}: {}", stderr(&out));
        let r = r.unwrap();
        assert!(num(&r, "storage_hit_tokens") > 0, "{extra:?}: {r}");
        assert_eq!(num(&r, "storage_refused_checksum"), 0, "{extra:?}: {r}");
        assert_eq!(num(&r, "mismatched_tokens"), 0, "{extra:?}: {r}");
    }
    let other = [
        "--model",
        "gqa",
        "--kv-heads",
        "2",
        "--head-dim",
        "64",
        "--cp",
        "2",
    ];
    let (out, _) = replay(store.path(), &other);
    assert_ne!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("gqa4x32") && stderr(&out).contains("gqa2x64"),
        "{}",
        stderr(&out)
    );
}

/// Every file and folder below `dir` (and `dir`) given mode `dirs` or `files`.
fn chmod_tree(dir: &Path, dirs: u32, files: u32) {
    use std::os::unix::fs::PermissionsExt as _;
    let meta = std::fs::symlink_metadata(dir).unwrap();
    if meta.is_dir() {
        // Opened first, so a folder made read-only is still listed.
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        for e in std::fs::read_dir(dir).unwrap() {
            chmod_tree(&e.unwrap().path(), dirs, files);
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(dirs)).unwrap();
    } else if meta.is_file() {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(files)).unwrap();
    }
}

/// Every entry below `dir`: its path, size, modification time and, for a file, its bytes.
fn snapshot(dir: &Path, out: &mut Vec<(PathBuf, u64, std::time::SystemTime, Vec<u8>)>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let bytes = if meta.is_file() {
            std::fs::read(&path).unwrap()
        } else {
            Vec::new()
        };
        out.push((path.clone(), meta.len(), meta.modified().unwrap(), bytes));
        if meta.is_dir() {
            snapshot(&path, out);
        }
    }
}

/// Issue 44, finding 5: a store this process may only read (here, one nobody may write:
/// a run as root, whom permission bits do not bind, runs the replay as `nobody`) is
/// read: the report says read-only, its records are served with 0 mismatches, and the
/// ranks write nothing to it (where a writable copy of it gets records) and count no
/// I/O error.
#[test]
fn a_read_only_store_is_read_and_never_written() {
    use std::os::unix::fs::PermissionsExt as _;
    use std::os::unix::process::CommandExt as _;
    // Written by a run of fewer conversations: the read-back run has pages to write.
    let store = tempfile::tempdir().unwrap();
    let (out, r) = replay(store.path(), &["--cp", "8", "--conversations", "3"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(num(&r.unwrap(), "storage_records_written") > 0);
    let run = ["--cp", "4"];
    let writable = copy_of(store.path());
    let (out, r) = replay(writable.path(), &run);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r = r.unwrap();
    assert!(
        num(&r, "storage_records_written") > 0,
        "nothing to write: {r}"
    );
    assert!(!r["storage"].as_str().unwrap().contains("read-only"), "{r}");

    // Readable by all, writable by none.
    chmod_tree(store.path(), 0o555, 0o444);
    let mut before = Vec::new();
    snapshot(store.path(), &mut before);
    // The report and the JIT cache go where the run may write.
    let scratch = tempfile::tempdir().unwrap();
    std::fs::set_permissions(scratch.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
    let json = scratch.path().join("report.json");
    let mut cmd = command(store.path(), &run, &json);
    cmd.env("CP_HICACHE_CACHE_DIR", scratch.path());
    // SAFETY: no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        cmd.uid(65534).gid(65534);
    }
    let out = cmd.output().unwrap();
    let mut after = Vec::new();
    snapshot(store.path(), &mut after);
    chmod_tree(store.path(), 0o755, 0o644);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert!(
        r["storage"]
            .as_str()
            .unwrap()
            .contains("read-only (records read, none written)"),
        "{r}"
    );
    assert!(num(&r, "storage_hit_tokens") > 0, "{r}");
    assert!(num(&r, "storage_records_read") > 0, "{r}");
    assert_eq!(num(&r, "mismatched_tokens"), 0, "{r}");
    assert_eq!(num(&r, "storage_records_written"), 0, "{r}");
    assert_eq!(num(&r, "storage_io_errors"), 0, "{r}");
    assert!(after == before, "the read-only store changed");
}
