//! `bench` and `tune` as the built binary on the host executor, on tiny sizes: JSON rows with
//! every field and positive numbers, the SVG plot, `--check` against the references, and a
//! tuning file from another machine ignored with a warning. No timing assertions.

use std::path::Path;
use std::process::{Command, Output};

fn bin(cache: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cp-hicache"));
    c.env_remove("CP_HICACHE_JIT")
        .env("RUST_LOG", "warn")
        .env("CP_HICACHE_CACHE_DIR", cache);
    c
}

fn run(c: &mut Command) -> Output {
    let out = c.output().expect("the binary starts");
    assert!(
        out.status.success(),
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

const TINY: &[&str] = &[
    "--backend",
    "host",
    "--deployment",
    "mla_ps16_cp8",
    "--pages",
    "8",
    "--layers",
    "1",
    "--repeats",
    "1",
    "--alloc-pages",
    "64",
];

#[test]
fn bench_json_rows_have_every_field_and_positive_numbers() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("rows.json");
    let svg = dir.path().join("ratios.svg");
    let out = run(bin(&dir.path().join("cache"))
        .arg("bench")
        .args(TINY)
        .arg("--quick")
        .arg("--dma")
        .arg("--json")
        .arg(&json)
        .arg("--plot")
        .arg(&svg));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("ratio"), "{stdout}");
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    // default + tuned (the host preset), 3 copies + select + release each, and both
    // transfers of the default configuration on the DMA path three ways (dma, dma-each,
    // dma-staged).
    assert_eq!(rows.len(), 16, "{rows:#?}");
    for r in &rows {
        for k in ["kernel", "spec", "backend", "config"] {
            assert!(r[k].as_str().is_some_and(|s| !s.is_empty()), "{k} in {r}");
        }
        assert_eq!(r["backend"], "host");
        assert!(r["bytes"].as_u64().is_some_and(|b| b > 0), "{r}");
        for k in ["seconds", "gbps", "baseline_gbps", "ratio"] {
            assert!(r[k].as_f64().is_some_and(|v| v > 0.0), "{k} in {r}");
        }
    }
    let configs: std::collections::BTreeSet<&str> =
        rows.iter().filter_map(|r| r["config"].as_str()).collect();
    assert_eq!(
        configs.into_iter().collect::<Vec<_>>(),
        ["default", "dma", "tuned"]
    );
    // Without a tuning file, "tuned" on the host is the built-in preset, and the rows say so.
    for r in &rows {
        let want = if r["config"] == "tuned" {
            "preset"
        } else {
            "default"
        };
        assert_eq!(r["shapes"], want, "{r}");
    }
    for r in rows.iter().filter(|r| r["config"] == "dma") {
        let k = r["kernel"].as_str().unwrap();
        assert!(
            ["dma(", "dma-each(", "dma-staged("]
                .iter()
                .any(|p| k.starts_with(&format!("{p}transfer_pages"))),
            "{r}"
        );
        assert_eq!(r["baseline"], "memcpy", "{r}");
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("<rect"), "{svg}");
}

#[test]
fn bench_check_matches_the_references() {
    let dir = tempfile::tempdir().unwrap();
    let out = run(bin(&dir.path().join("cache")).args([
        "bench",
        "--check",
        "--backend",
        "host",
        "--deployment",
        "nsa_ps64_cp2",
    ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    // 3 allocator kernels (select with and without token locations, release), 2 transfers
    // (each moving both buffers) and their DMA paths, and 3 per buffer (materialise,
    // synthesise, verify), 2 buffers; then the CPU preset bench times as tuned: 3 allocator
    // kernels, 2 transfers and a materialise per buffer; then the default copy shape with
    // streaming stores: 2 transfers and a materialise per buffer.
    assert_eq!(stdout.matches("  ok  ").count(), 15 + 7 + 4, "{stdout}");
    assert_eq!(stdout.matches("dma(transfer_pages").count(), 2, "{stdout}");
    assert_eq!(
        stdout.matches("dma-staged(transfer_pages").count(),
        2,
        "{stdout}"
    );
    assert_eq!(stdout.matches("_b656_b132_").count(), 2 * 5, "{stdout}");
    for shape in ["_t1_ppb16_v16_u1_cs ", "_t128_ppb1_v16_u4_cs "] {
        assert_eq!(stdout.matches(shape).count(), 4, "{shape}: {stdout}");
    }
    for select in [
        "select_owner_pages_cp2_ps64_t32 ",
        "select_owner_pages_cp2_ps64_nolocs_t32 ",
    ] {
        assert!(stdout.contains(select), "{select}: {stdout}");
    }
    assert!(stdout.contains("0 failures"), "{stdout}");
}

#[test]
fn tune_writes_a_file_and_a_foreign_file_is_ignored_with_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let file = dir.path().join("tuning.json");
    let tiny: Vec<&str> = TINY
        .iter()
        .copied()
        .filter(|a| *a != "--alloc-pages" && *a != "64")
        .collect();
    let out = run(bin(&cache)
        .arg("tune")
        .args(&tiny)
        .arg("--quick")
        .arg("--out")
        .arg(&file));
    // The busy companions' columns (docs/CLI.md "tune"): `-` on the host, which has none.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let header = stdout.lines().find(|l| l.starts_with("kernel ")).unwrap();
    let columns: Vec<&str> = header.split_whitespace().collect();
    assert_eq!(
        columns,
        [
            "kernel",
            "candidate",
            "ms",
            "GB/s",
            "alone",
            "hbm",
            "alu-x",
            "hbm-x",
            "note"
        ]
    );
    let transfer = stdout
        .lines()
        .find(|l| l.starts_with("transfer_pages_"))
        .unwrap();
    assert_eq!(transfer.split_whitespace().nth(4), Some("-"), "{stdout}");
    assert!(
        !dir.path().join(".tuning.json.lock").exists(),
        "the merge lock file was left beside the tuning file"
    );
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let entries = json["entries"].as_array_mut().unwrap();
    // select with and without token locations, release, transfer d2h and h2d, materialise,
    // synthesise, verify.
    assert_eq!(entries.len(), 8);
    for e in entries.iter_mut() {
        e["device"]["device"] = "NVIDIA H200".into();
    }
    let foreign = dir.path().join("foreign.json");
    std::fs::write(&foreign, serde_json::to_string(&json).unwrap()).unwrap();
    let out = run(bin(&cache)
        .arg("bench")
        .args(TINY)
        .arg("--tuning")
        .arg(&foreign));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: tuning for") && stderr.contains("NVIDIA H200"),
        "{stderr}"
    );
    // Once: one line for the entries ignored alike, and no log line repeating it.
    assert_eq!(stderr.matches("NVIDIA H200").count(), 1, "{stderr}");

    // Replay applies a tuning file of this machine and ignores the foreign one.
    let replay = |tuning: &std::path::Path| {
        run(bin(&cache)
            .args([
                "replay",
                "--backend",
                "host",
                "--model",
                "mla",
                "--page-size",
                "16",
                "--cp",
                "8",
                "--layers",
                "1",
                "--conversations",
                "2",
                "--device-pages",
                "1024",
                "--host-pages",
                "64",
                "--quiet",
                "--tuning",
            ])
            .arg(tuning))
    };
    let own = replay(&file);
    let table = String::from_utf8_lossy(&own.stdout);
    assert!(!String::from_utf8_lossy(&own.stderr).contains("warning"));
    // On the CPU emulation one thread walking whole pages always wins by far.
    assert!(
        table.contains("copy launch shape            t1_"),
        "{table}"
    );
    // The report names the file whose shapes ran, and none when no entry applied.
    assert!(
        table.contains(&format!("tuning file                  {}", file.display())),
        "{table}"
    );
    let other = replay(&foreign);
    let table = String::from_utf8_lossy(&other.stdout);
    let stderr = String::from_utf8_lossy(&other.stderr);
    assert!(stderr.contains("warning: tuning for"), "{stderr}");
    assert!(
        table.contains("copy launch shape            t128_ppb1_v16_u4"),
        "{table}"
    );
    assert!(
        table.contains("tuning file                  none: default shapes"),
        "{table}"
    );
}

/// Runs the binary and returns its output whatever the status.
fn output(c: &mut Command) -> Output {
    c.output().expect("the binary starts")
}

/// `bench --inject`: the broken kernel is reported, every other kernel is still measured,
/// the exit status is 1; a cache fault is a usage error.
#[test]
fn bench_inject_reports_the_failing_kernel_and_measures_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    for (fault, needle) in [
        (
            "compile-error",
            "fault injected: this kernel does not compile",
        ),
        ("launch-error", "launch failure injected"),
    ] {
        let json = dir.path().join(format!("{fault}.json"));
        let out = output(
            bin(&dir.path().join("cache"))
                .arg("bench")
                .args(TINY)
                .arg("--quick")
                .args(["--inject", fault, "--json"])
                .arg(&json),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{fault}: {stderr}");
        assert!(stderr.contains(needle), "{fault}: {stderr}");
        assert_eq!(
            stderr.matches("error: mla_ps16_cp8 ").count(),
            1,
            "{stderr}"
        );
        let rows: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        // 10 kernels planned (default and tuned), one failed.
        assert_eq!(rows.len(), 9, "{fault}: {rows:#?}");
    }
    let out = output(
        bin(&dir.path().join("cache"))
            .arg("bench")
            .args(TINY)
            .args(["--inject", "lane-exhaustion"]),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is a cache fault"), "{stderr}");
}

#[test]
fn bench_check_inject_fails_one_row() {
    let dir = tempfile::tempdir().unwrap();
    for fault in ["compile-error", "launch-error"] {
        let out = output(bin(&dir.path().join("cache")).args([
            "bench",
            "--check",
            "--backend",
            "host",
            "--deployment",
            "nsa_ps64_cp2",
            "--inject",
            fault,
        ]));
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{fault}: {stdout}");
        assert_eq!(stdout.matches("  FAIL  ").count(), 1, "{fault}: {stdout}");
        // The 15 rows of the defaults, 7 of the CPU preset and 4 streaming (see above), one
        // failed.
        assert_eq!(
            stdout.matches("  ok  ").count(),
            14 + 7 + 4,
            "{fault}: {stdout}"
        );
        assert!(stdout.contains(": 1 failure\n"), "{stdout}");
        // Every table row is one line, however many lines the failure's detail has; the
        // table ends at the first blank line (the full details follow it).
        let table: Vec<&str> = stdout
            .lines()
            .skip(1)
            .take_while(|l| !l.is_empty() && !l.starts_with("check on "))
            .collect();
        assert_eq!(table.len(), 15 + 7 + 4, "{fault}: {stdout}");
        for row in &table {
            assert!(
                row.starts_with("nsa_ps64_cp2 "),
                "{fault}: {row:?}\n{stdout}"
            );
        }
    }
}

/// `--check` times nothing: the options only timing uses (`--json`, `--plot`, sizes,
/// `--tuning`, ...) are refused with it, not silently ignored.
#[test]
fn bench_check_refuses_timing_and_output_options() {
    let dir = tempfile::tempdir().unwrap();
    for extra in [
        &["--json", "bc.json"][..],
        &["--plot", "bc.svg"],
        &["--tuning", "t.json"],
        &["--pages", "8"],
        &["--alloc-pages", "64"],
        &["--quick"],
    ] {
        let out = output(
            bin(&dir.path().join("cache"))
                .current_dir(dir.path())
                .args(["bench", "--check", "--backend", "host"])
                .args(extra),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(
            stderr.contains("cannot be used with"),
            "{extra:?}: {stderr}"
        );
        assert!(!dir.path().join("bc.json").exists() && !dir.path().join("bc.svg").exists());
    }
}

/// Sizes out of range are refused by the parser (exit status 2, the range named) before
/// anything is allocated: zero is not rounded up and a huge `--alloc-pages` never reaches the
/// allocator; a product of pages and layers past the memory budget is refused too.
/// A misspelt emulator setting is bad input for bench and tune as for replay: exit status 2
/// naming the variable, before any work.
#[test]
fn a_misspelt_sanitizer_setting_is_a_usage_error() {
    let dir = tempfile::tempdir().unwrap();
    let out_file = dir.path().join("t.json");
    for args in [
        &["bench", "--check", "--backend", "host"][..],
        &["bench", "--backend", "host"],
        &[
            "tune",
            "--backend",
            "host",
            "--out",
            out_file.to_str().unwrap(),
        ],
    ] {
        let out = output(
            bin(&dir.path().join("cache"))
                .args(args)
                .env("CP_HICACHE_EMU_SANITIZE", "adress"),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("CP_HICACHE_EMU_SANITIZE"),
            "{args:?}: {stderr}"
        );
    }
}

#[test]
fn out_of_range_sizes_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["bench", "--alloc-pages", "0"][..],
        &["bench", "--alloc-pages", "4294967295"],
        &["bench", "--alloc-pages", "100000000"],
        &["bench", "--pages", "0"],
        &["bench", "--layers", "0"],
        &["tune", "--repeats", "0"],
        &["tune", "--pages", "100000"],
        &["bench", "--repeats", "1001"],
    ] {
        let out = output(bin(&dir.path().join("cache")).args(args));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("not in "), "{args:?}: {stderr}");
    }
    let out = output(bin(&dir.path().join("cache")).args([
        "tune",
        "--backend",
        "host",
        "--deployment",
        "nsa_ps64_cp8",
        "--pages",
        "4096",
        "--layers",
        "64",
    ]));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("lower --pages or --layers"), "{stderr}");
}

/// Bad tuning files are the user's input: `bench --tuning` and `replay --tuning` with a
/// missing file, a directory, a corrupt file or another format version exit 2 naming the
/// tuning file, before anything runs.
#[test]
fn bad_tuning_files_are_usage_errors_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let corrupt = dir.path().join("corrupt.json");
    std::fs::write(&corrupt, "{not json").unwrap();
    let future = dir.path().join("future.json");
    std::fs::write(&future, r#"{"format": 99, "entries": []}"#).unwrap();
    let cases = [
        (dir.path().join("missing.json"), "tuning file"),
        (dir.path().to_path_buf(), "tuning file"),
        (corrupt, "tuning file"),
        (future, "format 99"),
    ];
    for (path, needle) in &cases {
        for cmd in [
            &["bench", "--backend", "host", "--deployment", "mla_ps16_cp8"][..],
            &[
                "replay",
                "--backend",
                "host",
                "--layers",
                "1",
                "--conversations",
                "1",
                "--quiet",
            ],
        ] {
            let out = output(bin(&cache).args(cmd).arg("--tuning").arg(path));
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{cmd:?} {path:?}: {stderr}");
            assert!(
                stderr.contains(needle) && stderr.contains(&*path.to_string_lossy()),
                "{cmd:?} {path:?}: {stderr}"
            );
            assert!(out.stdout.is_empty(), "{cmd:?} {path:?}: ran anyway");
        }
    }
}

/// `tune --out` is checked before the tuning run: a missing folder (not created), a
/// directory, or an existing file that is not a tuning file (left as it was) exit 2; so does
/// an unwritable `bench --json`.
#[test]
fn tune_out_and_bench_json_are_checked_up_front() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let corrupt = dir.path().join("corrupt.json");
    std::fs::write(&corrupt, "{not json").unwrap();
    let missing = dir.path().join("missing").join("t.json");
    for (out_path, needle) in [
        (missing.clone(), "cannot write"),
        (dir.path().to_path_buf(), "is a directory"),
        (corrupt.clone(), "fix or delete it"),
    ] {
        let out = output(
            bin(&cache)
                .args(["tune", "--backend", "host", "--quick", "--out"])
                .arg(&out_path),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{out_path:?}: {stderr}");
        assert!(stderr.contains(needle), "{out_path:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{out_path:?}: the run started");
    }
    assert!(
        !dir.path().join("missing").exists(),
        "the folder was created"
    );
    assert_eq!(std::fs::read_to_string(&corrupt).unwrap(), "{not json");
    let out = output(
        bin(&cache)
            .args(["bench", "--backend", "host", "--json"])
            .arg(&missing),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("cannot write"), "{stderr}");
}

/// `bench --json X --plot X` would write the chart over the rows: refused up front (exit
/// status 2, both flags named), as is an output naming the `--tuning` input.
#[test]
fn bench_outputs_may_not_share_a_file_or_replace_the_tuning_file() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let same = dir.path().join("out");
    let tuning = dir.path().join("t.json");
    std::fs::write(&tuning, r#"{"format": 1, "entries": []}"#).unwrap();
    for (args, needle) in [
        (
            vec![
                "--json".as_ref(),
                same.as_os_str(),
                "--plot".as_ref(),
                same.as_os_str(),
            ],
            "--json and --plot both name",
        ),
        (
            vec![
                "--tuning".as_ref(),
                tuning.as_os_str(),
                "--plot".as_ref(),
                tuning.as_os_str(),
            ],
            "--plot",
        ),
    ] {
        let out = output(bin(&cache).arg("bench").args(TINY).args(&args));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}: the run started");
    }
    assert!(!same.exists());
    assert_eq!(
        std::fs::read_to_string(&tuning).unwrap(),
        r#"{"format": 1, "entries": []}"#
    );
}

/// A cache directory that exists but takes no new files (a read-only prebuilt cache) is
/// refused before tuning, naming the tuning file, instead of failing after the whole run
/// when the results are merged. `/proc` takes no new files even for root (CI runs as root,
/// where chmod does not restrict); a chmod 555 folder is checked too where chmod restricts
/// this user.
#[test]
fn tune_into_an_unwritable_cache_dir_is_refused_up_front() {
    use std::os::unix::fs::PermissionsExt;
    let tiny: Vec<&str> = TINY
        .iter()
        .copied()
        .filter(|a| *a != "--alloc-pages" && *a != "64")
        .collect();
    let refused = |cache: &Path| {
        let out = output(bin(cache).args(["tune", "--quick"]).args(&tiny));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {stderr}", cache.display());
        let file = cache.join("tuning.json");
        assert!(
            stderr.contains(&format!("cannot write {}", file.display()))
                && stderr.contains("CP_HICACHE_CACHE_DIR"),
            "{stderr}"
        );
        assert!(
            out.stdout.is_empty(),
            "{}: the tuning run started",
            cache.display()
        );
    };

    let proc = Path::new("/proc");
    assert!(
        proc.is_dir() && std::fs::write(proc.join("cp-hicache-probe"), "").is_err(),
        "/proc is expected to be a folder that takes no new files, even for root"
    );
    refused(proc);

    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o555)).unwrap();
    let privileged = std::fs::write(cache.join("probe"), "").is_ok();
    if privileged {
        println!("chmod does not restrict this user (root): only /proc was checked");
    } else {
        refused(&cache);
    }
    std::fs::set_permissions(&cache, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// `--prebuild` compiles the deployment's kernels and runs nothing: the executor, timing,
/// check and output options are refused with it (exit status 2, both flags named) rather
/// than ignored.
#[test]
fn bench_prebuild_refuses_options_it_would_ignore() {
    let dir = tempfile::tempdir().unwrap();
    for (extra, flag) in [
        (&["--check"][..], "--check"),
        (&["--inject", "launch-error"], "--inject"),
        (&["--backend", "cuda"], "--backend"),
        (&["--json", "p.json"], "--json"),
        (&["--plot", "p.svg"], "--plot"),
        (&["--tuning", "t.json"], "--tuning"),
        (&["--quick"], "--quick"),
        (&["--dma"], "--dma"),
        (&["--pages", "8"], "--pages"),
        (&["--alloc-pages", "64"], "--alloc-pages"),
    ] {
        let out = output(
            bin(&dir.path().join("cache"))
                .current_dir(dir.path())
                .args(["bench", "--prebuild", "--deployment", "nsa_ps64_cp1"])
                .args(extra),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(
            stderr.contains("cannot be used with")
                && stderr.contains("--prebuild")
                && stderr.contains(flag),
            "{extra:?}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{extra:?}: it ran");
    }
    assert!(!dir.path().join("cache").exists(), "something was compiled");
}

/// `bench --storage DIR`: a put and a get row per record shape against plain files of the
/// same bytes, and nothing left behind in DIR.
#[test]
fn bench_storage_times_the_store_against_plain_files() {
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let json = cache.path().join("rows.json");
    run(bin(cache.path())
        .args(["bench", "--deployment", "nsa_ps64_cp8", "--pages", "8"])
        .args(["--layers", "2", "--repeats", "1", "--storage"])
        .arg(dir.path())
        .arg("--json")
        .arg(&json));
    let rows: Vec<serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let kinds: Vec<(&str, &str)> = rows
        .iter()
        .map(|r| {
            (
                r["kernel"].as_str().unwrap(),
                r["baseline"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(kinds.len(), 2, "{rows:?}");
    assert!(kinds[0].0.starts_with("store_put(8x") && kinds[0].1 == "file_write");
    assert!(kinds[1].0.starts_with("store_get(8x") && kinds[1].1 == "file_read");
    for r in &rows {
        for k in ["gbps", "baseline_gbps", "ratio"] {
            assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {r}");
        }
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Issue 29: `tune --sweep` times each buffer alone and both together, both ways, at every
/// thread count × grid cap asked for, plus one row per DMA path (which say why not on the
/// host), and writes no tuning file.
#[test]
fn tune_sweep_covers_every_buffer_direction_and_shape_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let out = run(bin(&cache).args([
        "tune",
        "--sweep",
        "--backend",
        "host",
        "--deployment",
        "nsa_ps64_cp8",
        "--sweep-threads",
        "32,128",
        "--sweep-grids",
        "1,3",
        "--pages",
        "6",
        "--layers",
        "2",
        "--repeats",
        "1",
    ]));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let header: Vec<&str> = stdout
        .lines()
        .find(|l| l.starts_with("kernel "))
        .unwrap()
        .split_whitespace()
        .collect();
    assert_eq!(
        header[..4],
        ["kernel", "buffers", "candidate", "ms"],
        "{stdout}"
    );
    let rows: Vec<Vec<&str>> = stdout
        .lines()
        .filter(|l| l.starts_with("transfer_pages_"))
        .map(|l| l.split_whitespace().collect())
        .collect();
    // 2 directions × 3 buffer sets × (4 shapes + 3 DMA paths).
    assert_eq!(rows.len(), 2 * 3 * 7, "{stdout}");
    for dir in ["h2d", "d2h"] {
        for (buffers, stem) in [
            ("nsa_kv+nsa_idx", "b656_b132"),
            ("nsa_kv", "b656"),
            ("nsa_idx", "b132"),
        ] {
            let of: Vec<&Vec<&str>> = rows
                .iter()
                .filter(|r| {
                    r[0] == format!("transfer_pages_{dir}_pf_ps64_{stem}") && r[1] == buffers
                })
                .collect();
            let candidates: Vec<&str> = of.iter().map(|r| r[2]).collect();
            assert_eq!(
                candidates,
                [
                    "t32_ppb1_v16_u8_g1",
                    "t32_ppb1_v16_u8_g3",
                    "t128_ppb1_v16_u8_g1",
                    "t128_ppb1_v16_u8_g3",
                    "dma",
                    "dma-each",
                    "dma-staged"
                ],
                "{dir} {buffers}: {stdout}"
            );
            for r in &of[..4] {
                let gbps: f64 = r[4].parse().unwrap_or_else(|_| panic!("{r:?}"));
                assert!(gbps > 0.0, "{r:?}");
            }
            for r in &of[4..] {
                assert_eq!(r[3], "-", "{r:?}");
                assert!(
                    r.join(" ").contains("unsupported by the host executor"),
                    "{r:?}"
                );
            }
        }
    }
    assert!(
        !cache.join("tuning.json").exists(),
        "a sweep wrote a tuning file"
    );
    // A sweep has no tuning file to write, so --out is refused rather than ignored.
    let refused = output(bin(&cache).args(["tune", "--sweep", "--out", "x.json"]));
    assert_eq!(refused.status.code(), Some(2));
    let usage = output(bin(&cache).args(["tune", "--sweep-threads", "128"]));
    assert_eq!(
        usage.status.code(),
        Some(2),
        "--sweep-threads needs --sweep"
    );
}
