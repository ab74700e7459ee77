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
/// the real one does) when `$STUB_NO_NVRTC` is set.
const STUB: &str = r#"#!/usr/bin/env bash
printf '%s\n' "$@" >>"$STUB_LOG"
echo "JIT=${CP_HICACHE_JIT:-}" >>"$STUB_LOG"
echo --END-- >>"$STUB_LOG"
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
        // No compute-sanitizer or nvidia-smi here, whatever the machine has.
        .env("PATH", "/usr/bin:/bin");
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
        ("bench", "ok"),
        ("replay", "ok"),
        ("replay-dma", "ok"),
        ("memcheck", "skipped"),
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
