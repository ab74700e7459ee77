//! `scripts/gpu-check.sh` without a GPU: the script runs a stand-in binary that records its
//! command lines, so its control flow (a failing step does not stop the others, the table,
//! the exit status) is checked here; every recorded command line is then parsed by the real
//! binary (with `--help` appended, which clap honours only after accepting every earlier
//! argument), so the script cannot drift from the CLI it drives.

use std::path::Path;
use std::process::Command;

/// A stand-in `cp-hicache` that appends its arguments (one per line, then its
/// `CP_HICACHE_JIT` and `--END--`) to `$STUB_LOG`, exits 1 for `bench --check` when
/// `$STUB_FAIL_CHECK` is set, and reports no NVRTC from `info` (early in a long report, as
/// the real one does) when `$STUB_NO_NVRTC` is set. `tune` and `bench` print tables in the
/// real commands' formats (`src/cli/tune.rs`, `print_table` in `src/cli/bench.rs`: the same
/// field widths), with made-up numbers: `tune` a transfer row per candidate, `dma` and
/// `dma-each` included (`dma-each` left out when `$STUB_NO_DMA_EACH` is set), and an allocator
/// row; `bench` transfer rows and select / release rows at 2,048 and 16,384 pages.
const STUB: &str = r#"#!/usr/bin/env bash
printf '%s\n' "$@" >>"$STUB_LOG"
echo "JIT=${CP_HICACHE_JIT:-}" >>"$STUB_LOG"
echo --END-- >>"$STUB_LOG"
tune_row() { printf '%-44s  %-22s  %10s  %8s  %8s  %8s  %7s  %7s  %s\n' "$@"; }
bench_row() {
  printf '%-13s  %-7s  %-38s  %10s  %9s  %8s  %8s  %6s  %s\n' "$@"
}
sweep_row() { printf '%-44s  %-16s  %-26s  %10s  %8s  %8s  %8s  %7s  %7s  %s\n' "$@"; }
if [[ "$1" == tune && " $* " == *" --sweep "* ]]; then
  echo "device: cuda stub"
  echo "sizes: pages=256 layers=4 warmup=1 repeats=7"
  sweep_row kernel buffers candidate ms GB/s alone hbm alu-x hbm-x note
  for d in h2d d2h; do
    for b in "nsa_kv+nsa_idx b656_b132" "nsa_kv b656" "nsa_idx b132"; do
      set -- $b
      for c in t128_ppb1_v16_u8_g1 t256_ppb1_v16_u8_g4 t512_ppb1_v16_u8_g16 dma dma-each \
        dma-staged; do
        if [[ -n "${STUB_NO_STAGED:-}" && "$c" == dma-staged ]]; then continue; fi
        note="start, overlap: alu +3.2us 100% resident +1.0us, hbm +4.1us 100% resident +1.9us"
        if [[ "$c" == dma* ]]; then note="start, overlap: alu +3.2us 100%, hbm +4.1us 100%"; fi
        sweep_row "transfer_pages_${d}_pf_ps64_$2" "$1" "$c" 1.000 40.00 45.00 38.00 1.010 \
          1.050 "$note"
      done
    done
  done
  exit 0
fi
if [[ "$1" == tune ]]; then
  echo "device: cuda stub"
  tune_row kernel candidate ms GB/s alone hbm alu-x hbm-x note
  for k in transfer_pages_h2d_pf_ps64_b656 transfer_pages_d2h_pf_ps64_b656; do
    tune_row "$k" t512_ppb1_v16_u8_g4 1.000 1.00 1.10 0.80 1.010 1.050 \
      "best; start, overlap: alu +3.2us 100% resident +1.0us, hbm +4.1us 100% resident +1.9us"
    tune_row "$k" dma 2.000 0.50 0.60 0.45 1.000 1.020 \
      "start, overlap: alu +2.0us 100%, hbm +2.5us 100%"
    if [[ -z "${STUB_NO_DMA_EACH:-}" ]]; then
      tune_row "$k" dma-each 3.000 0.33 0.40 0.30 1.000 1.010 \
        "start, overlap: alu +2.2us 100%, hbm +2.6us 100%"
    fi
  done
  tune_row select_owner_pages_cp8_ps64 t256 0.010 - - - - - best
  exit 0
fi
if [[ "$1" == bench && " $* " != *" --check "* ]]; then
  echo "device: cuda stub"
  bench_row deployment config kernel bytes ms GB/s base ratio baseline
  bench_row nsa_ps64_cp8 default transfer_pages_h2d_pf_ps64_b656_t512_ppb1_v16_u8_g4 \
    8192 1.000 1.00 1.00 1.00 cuMemcpyAsync
  bench_row nsa_ps64_cp8 dma "dma(transfer_pages_h2d_pf_ps64_b656_t512_ppb1_v16_u8_g4)" \
    8192 2.000 0.50 1.00 0.50 "cuMemcpyAsync  0.300"
  bench_row nsa_ps64_cp8 dma "dma-each(transfer_pages_h2d_pf_ps64_b656_t512_ppb1_v16_u8_g4)" \
    8192 3.000 0.33 1.00 0.33 "cuMemcpyAsync  2.500"
  bench_row nsa_ps64_cp8 dma "dma-staged(transfer_pages_h2d_pf_ps64_b656_t512_ppb1_v16_u8_g4)" \
    8192 1.500 0.66 1.00 0.66 "cuMemcpyAsync  0.020"
  bench_row - link "link(h2d,256MiB)" 268435456 5.000 53.69 53.69 1.00 "cuMemcpyAsync  -"
  bench_row - link "link(d2h,256MiB)" 268435456 5.100 52.63 52.63 1.00 "cuMemcpyAsync  -"
  for n in 8192 65536; do
    bench_row nsa_ps64_cp8 default select_owner_pages_cp8_ps64_nolocs_t256 "$n" 0.010 0.82 0.16 5.12 \
      rust_reference
    bench_row nsa_ps64_cp8 tuned release_pages_cp8_t32 "$n" 0.011 0.74 1.60 0.46 rust_reference
  done
  exit 0
fi
if [[ -n "${STUB_NO_NVRTC:-}" && "$1" == info ]]; then
  echo "  NVRTC              not found: libnvrtc"
  for i in $(seq 1 20000); do echo "  line $i of a long report"; done
  exit 0
fi
if [[ -n "${STUB_FAIL_CHECK:-}" && "$1" == bench && " $* " == *" --check "* ]]; then
  echo "check on cuda: 1 failures"
  exit 1
fi
echo "stub ran: $*"
"#;

/// One recorded call: its arguments and the `CP_HICACHE_JIT` it saw.
struct Call {
    args: Vec<String>,
    jit: String,
}

/// A stand-in `compute-sanitizer`: records its `--tool` in `$STUB_LOG` as a call of its own
/// (`sanitizer <tool>`), then runs the command after its options.
const SANITIZER_STUB: &str = r#"#!/usr/bin/env bash
tool=""
while [[ "$1" == --* ]]; do
  if [[ "$1" == --tool ]]; then tool="$2"; fi
  shift 2
done
printf 'sanitizer\n%s\nJIT=\n--END--\n' "$tool" >>"$STUB_LOG"
exec "$@"
"#;

fn run_script(dir: &Path, stub_env: &[(&str, &str)]) -> (std::process::Output, Vec<Call>) {
    let tag: String = stub_env.iter().map(|(k, _)| *k).collect();
    let stub = dir.join("cp-hicache-stub");
    std::fs::write(&stub, STUB).unwrap();
    let mut perm = std::fs::metadata(&stub).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&stub, perm).unwrap();
    let log = dir.join(format!("calls-{tag}.log"));
    let mut cmd = Command::new("bash");
    cmd.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/gpu-check.sh"))
        .arg(&stub)
        .env("STUB_LOG", &log)
        .env("GPU_CHECK_OUT", dir.join(format!("out-{tag}")))
        .env("GPU_CHECK_TIMEOUT", "60")
        // No compute-sanitizer or nvidia-smi here, whatever the machine has, unless the
        // sanitizer stub is asked for.
        .env("PATH", "/usr/bin:/bin");
    if stub_env.iter().any(|(k, _)| *k == "STUB_SANITIZER") {
        let bin = dir.join("sanitizer-bin");
        std::fs::create_dir_all(&bin).unwrap();
        let path = bin.join("compute-sanitizer");
        std::fs::write(&path, SANITIZER_STUB).unwrap();
        let mut perm = std::fs::metadata(&path).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&path, perm).unwrap();
        cmd.env("PATH", format!("{}:/usr/bin:/bin", bin.display()));
    }
    cmd.envs(stub_env.iter().copied());
    let out = cmd.output().unwrap();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    let mut calls = Vec::new();
    let mut cur = Vec::new();
    for line in text.lines() {
        if line == "--END--" {
            let jit = cur.pop().unwrap_or_default();
            calls.push(Call {
                args: std::mem::take(&mut cur),
                jit: jit.trim_start_matches("JIT=").to_string(),
            });
        } else {
            cur.push(line.to_string());
        }
    }
    (out, calls)
}

#[test]
fn a_failing_step_is_reported_and_the_others_still_run() {
    let dir = tempfile::tempdir().unwrap();
    let (out, calls) = run_script(dir.path(), &[("STUB_FAIL_CHECK", "1")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let table = &stdout[stdout.find("step       result").expect("table")..];
    for (step, result) in [
        ("info", "ok"),
        ("compile", "ok"),
        ("check", "FAIL(1)"),
        ("tune", "ok"),
        ("sweep", "ok"),
        ("bench", "ok"),
        ("replay", "ok"),
        ("replay-dma", "ok"),
        ("replay-writeback", "ok"),
        ("replay-batch", "ok"),
        ("replay-procs", "ok"),
        ("replay-procs-batch", "ok"),
        ("memcheck", "skipped"),
        ("racecheck", "skipped"),
        ("synccheck", "skipped"),
    ] {
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().take(2).eq([step, result])),
            "{step} {result} missing in\n{table}"
        );
    }
    assert!(stdout.contains("gpu-check: FAILED"), "{stdout}");
    assert!(calls.len() >= 7, "{} calls", calls.len());
}

#[test]
fn every_command_line_parses_with_the_real_binary() {
    let dir = tempfile::tempdir().unwrap();
    let (out, calls) = run_script(dir.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("gpu-check: all steps passed"), "{stdout}");
    let mut commands = std::collections::BTreeSet::new();
    for Call { args, .. } in &calls {
        let parsed = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
            .args(args)
            .arg("--help")
            .output()
            .unwrap();
        assert!(
            parsed.status.success(),
            "gpu-check.sh runs `cp-hicache {}`, which the CLI rejects: {}",
            args.join(" "),
            String::from_utf8_lossy(&parsed.stderr)
        );
        commands.insert(args.first().cloned().unwrap_or_default());
    }
    assert_eq!(
        commands.into_iter().collect::<Vec<_>>(),
        ["bench", "compile", "info", "replay", "tune"]
    );
}

/// Before its summary the script prints tune's transfer rows (both DMA candidates among them)
/// and bench's select and release rows at 2,048 pages (8,192 bytes) unchanged, under the
/// headers BENCHMARKS.md "gpu-check transfers" documents, and saves them as transfers.txt
/// and allocator.txt; a DMA candidate missing from tune's rows is named.
#[test]
fn transfers_and_allocator_rows_come_before_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = run_script(dir.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let summary = stdout.find("step       result").expect("table");
    let transfers = stdout
        .find(
            "\ntransfers (tune): kernel  candidate  ms  GB/s-beside-alu  GB/s-alone  \
             GB/s-beside-hbm  alu-slowdown  hbm-slowdown  note\n",
        )
        .expect("transfers header");
    let sweep = stdout.find("\nsweep (nsa_ps64_cp8)").expect("sweep header");
    let allocator = stdout
        .find(
            "\nallocator at 2,048 pages (bench): deployment  config  kernel  bytes  ms  GB/s  \
             base  ratio  baseline\n",
        )
        .expect("allocator header");
    assert!(
        transfers < sweep && sweep < allocator && allocator < summary,
        "{stdout}"
    );
    let section = |from: usize, to: usize| -> Vec<String> {
        stdout[from..to]
            .lines()
            .skip(2)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()
    };
    let rows = section(transfers, sweep);
    let saved = std::fs::read_to_string(dir.path().join("out-/transfers.txt")).unwrap();
    assert_eq!(rows, saved.lines().collect::<Vec<_>>(), "{stdout}");
    for dir_ in ["h2d", "d2h"] {
        for candidate in ["t512_ppb1_v16_u8_g4", "dma", "dma-each"] {
            assert_eq!(
                rows.iter()
                    .filter(|l| {
                        let f: Vec<&str> = l.split_whitespace().collect();
                        f[0] == format!("transfer_pages_{dir_}_pf_ps64_b656") && f[1] == candidate
                    })
                    .count(),
                1,
                "{dir_} {candidate} in {rows:?}"
            );
        }
    }
    assert!(
        rows.iter().all(|l| l.starts_with("transfer_pages_")),
        "{rows:?}"
    );
    assert!(!stdout.contains("note: tune printed no"), "{stdout}");
    let dma = stdout
        .find("\ndma and the link (bench)")
        .expect("dma header");
    assert!(allocator < dma && dma < summary, "{stdout}");
    let alloc = section(allocator, dma);
    let saved = std::fs::read_to_string(dir.path().join("out-/allocator.txt")).unwrap();
    assert_eq!(alloc, saved.lines().collect::<Vec<_>>(), "{stdout}");
    let kernels: Vec<(&str, &str)> = alloc
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[2], f[3])
        })
        .collect();
    assert_eq!(
        kernels,
        [
            ("select_owner_pages_cp8_ps64_nolocs_t256", "8192"),
            ("release_pages_cp8_t32", "8192")
        ],
        "{stdout}"
    );
    // A tune table without one DMA candidate is named, not silently shorter.
    let (out, _) = run_script(dir.path(), &[("STUB_NO_DMA_EACH", "1")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("note: tune printed no 'dma-each' transfer row")
            && !stdout.contains("note: tune printed no 'dma' transfer row"),
        "{stdout}"
    );
}

/// Without NVRTC the script skips compiling and runs every later step with the JIT off, on
/// the carried cache, however early `info` names the missing NVRTC in a long report.
#[test]
fn no_nvrtc_runs_everything_with_the_jit_off() {
    let dir = tempfile::tempdir().unwrap();
    let (out, calls) = run_script(dir.path(), &[("STUB_NO_NVRTC", "1")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let table = &stdout[stdout.find("step       result").expect("table")..];
    assert!(
        table
            .lines()
            .any(|l| l.split_whitespace().take(2).eq(["compile", "skipped"])),
        "{table}"
    );
    assert!(calls
        .iter()
        .all(|c| c.args.first().is_none_or(|a| a != "compile")));
    let after: Vec<_> = calls.iter().filter(|c| c.args[0] != "info").collect();
    assert!(!after.is_empty());
    for c in after {
        assert_eq!(c.jit, "off", "{:?} ran with the JIT on", c.args);
    }
}

/// With compute-sanitizer on PATH: memcheck of the whole check, and racecheck and synccheck
/// of the allocator kernels alone (`--family`), each a step of its own, their command lines
/// accepted by the real binary.
#[test]
fn sanitizer_steps_check_the_allocator_for_races_and_barriers() {
    let dir = tempfile::tempdir().unwrap();
    let (out, calls) = run_script(dir.path(), &[("STUB_SANITIZER", "1")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let table = &stdout[stdout.find("step       result").expect("table")..];
    for step in ["memcheck", "racecheck", "synccheck"] {
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().take(2).eq([step, "ok"])),
            "{step} missing in\n{table}"
        );
    }
    let tools: Vec<&str> = calls
        .iter()
        .filter(|c| c.args.first().map(String::as_str) == Some("sanitizer"))
        .map(|c| c.args[1].as_str())
        .collect();
    assert_eq!(tools, ["memcheck", "racecheck", "synccheck"]);
    // Each sanitizer call is followed by the binary's own call.
    let families: Vec<Vec<&str>> = calls
        .windows(2)
        .filter(|w| w[0].args.first().map(String::as_str) == Some("sanitizer"))
        .map(|w| {
            w[1].args
                .windows(2)
                .filter(|a| a[0] == "--family")
                .map(|a| a[1].as_str())
                .collect()
        })
        .collect();
    assert_eq!(
        families,
        [
            vec![],
            vec!["select_owner_pages", "release_pages", "transfer_pages"],
            vec!["select_owner_pages", "release_pages", "transfer_pages"]
        ]
    );
    for c in calls
        .iter()
        .filter(|c| c.args.first().map(String::as_str) != Some("sanitizer"))
    {
        let parsed = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
            .args(&c.args)
            .arg("--help")
            .output()
            .unwrap();
        assert!(parsed.status.success(), "rejected: {:?}", c.args);
    }
}

/// The sweep step (`tune --sweep` on nsa_ps64_cp8): its rows come before the summary
/// unchanged under their header, are saved as sweep.txt, and a buffer set × path the sweep
/// printed no row for is named.
#[test]
fn sweep_rows_cover_each_buffer_set_and_path() {
    let dir = tempfile::tempdir().unwrap();
    let (out, calls) = run_script(dir.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    let sweeps: Vec<&Call> = calls
        .iter()
        .filter(|c| c.args.iter().any(|a| a == "--sweep"))
        .collect();
    assert_eq!(sweeps.len(), 1);
    let args = &sweeps[0].args;
    assert_eq!(args[0], "tune");
    assert!(
        args.windows(2)
            .any(|w| w == ["--deployment", "nsa_ps64_cp8"]),
        "{args:?}"
    );
    let header = "\nsweep (nsa_ps64_cp8): kernel  buffers  candidate  ms  GB/s-beside-alu  \
                  GB/s-alone  GB/s-beside-hbm  alu-slowdown  hbm-slowdown  note\n";
    let at = stdout.find(header).expect("sweep header");
    let end = stdout[at + 1..].find("\n\n").map(|e| at + 1 + e).unwrap();
    let rows: Vec<&str> = stdout[at + header.len()..end]
        .lines()
        .filter(|l| !l.is_empty())
        .collect();
    let saved = std::fs::read_to_string(dir.path().join("out-/sweep.txt")).unwrap();
    assert_eq!(rows, saved.lines().collect::<Vec<_>>(), "{stdout}");
    assert_eq!(rows.len(), 2 * 3 * 6, "{stdout}");
    assert!(!stdout.contains("note: the sweep printed no"), "{stdout}");
    let (out, _) = run_script(dir.path(), &[("STUB_NO_STAGED", "1")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    for buffers in ["nsa_kv", "nsa_idx", "nsa_kv+nsa_idx"] {
        assert!(
            stdout.contains(&format!(
                "note: the sweep printed no '{buffers}' 'dma-staged' row"
            )),
            "{stdout}"
        );
    }
    assert!(!stdout.contains("'dma-each' row"), "{stdout}");
}

/// Bench's DMA rows (with the host's submission time) and the link's ceiling rows come
/// before the summary, unchanged, and are saved as dma.txt.
#[test]
fn dma_and_link_rows_come_before_the_summary() {
    let dir = tempfile::tempdir().unwrap();
    let (out, _) = run_script(dir.path(), &[]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary = stdout.find("step       result").expect("table");
    let header = "\ndma and the link (bench): deployment  config  kernel  bytes  ms  GB/s  base  \
                  ratio  baseline  submit-ms\n";
    let at = stdout.find(header).expect("dma header");
    assert!(at < summary, "{stdout}");
    let rows: Vec<&str> = stdout[at + header.len()..summary]
        .lines()
        .filter(|l| !l.is_empty())
        .collect();
    let saved = std::fs::read_to_string(dir.path().join("out-/dma.txt")).unwrap();
    assert_eq!(rows, saved.lines().collect::<Vec<_>>(), "{stdout}");
    let kinds: Vec<(&str, &str)> = rows
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[1], *f.last().unwrap())
        })
        .collect();
    assert_eq!(
        kinds,
        [
            ("dma", "0.300"),
            ("dma", "2.500"),
            ("dma", "0.020"),
            ("link", "-"),
            ("link", "-")
        ],
        "{stdout}"
    );
}

/// The whole run keeps to `GPU_CHECK_BUDGET`: with none left, no step starts, each says so
/// in the summary, and the run fails as incomplete rather than passing.
#[test]
fn a_spent_budget_starts_no_step_and_fails_the_run() {
    let dir = tempfile::tempdir().unwrap();
    let (out, calls) = run_script(dir.path(), &[("GPU_CHECK_BUDGET", "0")]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    let table = &stdout[stdout.find("step       result").expect("table")..];
    for step in ["info", "check", "tune", "sweep", "bench", "replay"] {
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().take(2).eq([step, "NO-TIME"])),
            "{step} in\n{table}"
        );
    }
    // Only the script's own `info` probe (for NVRTC) ran.
    assert!(
        calls
            .iter()
            .all(|c| c.args.first().map(String::as_str) == Some("info")),
        "{:?}",
        calls.iter().map(|c| c.args.join(" ")).collect::<Vec<_>>()
    );
    assert!(stdout.contains("gpu-check: FAILED"), "{stdout}");
}
