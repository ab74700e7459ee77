//! `cp-hicache info`: what it reports about the CPU emulator's environment.

use std::process::Command;

mod support;

fn info(env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cp-hicache"));
    cmd.arg("info")
        .env_remove("CP_HICACHE_EMU_ORDER")
        .env_remove("CP_HICACHE_EMU_SANITIZE");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn info_shows_the_emulator_block_order_and_sanitizer() {
    let (ok, text) = info(&[]);
    assert!(ok, "{text}");
    assert!(
        text.contains("CPU emulator       blocks and threads run forward, sanitizer none"),
        "{text}"
    );

    let (ok, text) = info(&[
        ("CP_HICACHE_EMU_ORDER", "reverse"),
        ("CP_HICACHE_EMU_SANITIZE", "address"),
    ]);
    assert!(ok, "{text}");
    assert!(
        text.contains("CPU emulator       blocks and threads run reverse, sanitizer address"),
        "{text}"
    );
    assert!(text.contains("CP_HICACHE_EMU_ORDER"), "{text}");
}

#[test]
fn info_names_a_misspelt_emulator_setting() {
    let (ok, text) = info(&[("CP_HICACHE_EMU_SANITIZE", "adress")]);
    assert!(ok, "info reports, it does not fail: {text}");
    let line = text
        .lines()
        .find(|l| l.contains("CPU emulator"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(
        line.contains("misconfigured") && line.contains("adress"),
        "{line}"
    );
}

#[test]
fn info_json_has_plain_fields_and_the_cache_dir_really_used() {
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(["info", "--json"])
        .env("CP_HICACHE_CACHE_DIR", "")
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for probe in ["cxx", "nvrtc", "cuda", "emulator"] {
        let p = &v[probe];
        assert!(p["ok"].is_boolean(), "{probe}: {p}");
        assert!(p["detail"].is_string(), "{probe}: {p}");
    }
    // An empty CP_HICACHE_CACHE_DIR counts as unset: the default cache dir is shown.
    let dir = v["cache_dir"].as_str().unwrap();
    assert!(dir.ends_with("cp-hicache"), "{dir}");
}

/// A reader that stops early (`info | grep -q …`, as `scripts/gpu-check.sh` does) does not
/// fail the command: it ends quietly with its own status (0 here); it used to panic with
/// status 101, which `pipefail` took for a failed `grep`.
#[test]
fn a_closed_stdout_ends_quietly() {
    for args in [
        &["info"][..],
        &["info", "--json"],
        &["compile", "--list-deployments"],
    ] {
        let out = support::output_with_closed_stdout(
            Command::new(env!("CARGO_BIN_EXE_cp-hicache")).args(args),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {:?} {stderr}", out.status);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
