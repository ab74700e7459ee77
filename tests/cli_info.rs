//! `cp-hicache info`: what it reports about the CPU emulator's environment.

use std::process::Command;

mod support;

fn info(env: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cp-hicache"));
    cmd.arg("info")
        .env_remove("CP_HICACHE_JIT")
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

/// A misspelt `CP_HICACHE_JIT` (which replay and compile refuse with exit status 2) is shown
/// as misconfigured, like a misspelt emulator setting; valid values show the mode.
#[test]
fn info_names_a_misspelt_jit_setting() {
    let jit_line = |env: &[(&str, &str)]| {
        let (ok, text) = info(env);
        assert!(ok, "info reports, it does not fail: {text}");
        text.lines()
            .find(|l| l.trim_start().starts_with("JIT "))
            .unwrap_or_else(|| panic!("no JIT line in:\n{text}"))
            .to_string()
    };
    let line = jit_line(&[("CP_HICACHE_JIT", "maybe")]);
    assert!(
        line.contains("misconfigured") && line.contains("CP_HICACHE_JIT") && line.contains("maybe"),
        "{line}"
    );
    assert!(jit_line(&[("CP_HICACHE_JIT", "off")]).contains("off: "));
    assert!(jit_line(&[("CP_HICACHE_JIT", "1")]).contains("on: "));
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .args(["info", "--json"])
        .env("CP_HICACHE_JIT", "maybe")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jit"]["ok"], false, "{}", v["jit"]);
    assert!(v["jit"]["detail"].as_str().unwrap().contains("maybe"));
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
    for probe in ["cxx", "nvrtc", "cuda", "emulator", "jit"] {
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

/// `info --json` with `CP_HICACHE_NVRTC=value` and the other NVRTC locations hidden
/// (a fake `CUDA_HOME` may be given): the NVRTC probe and stderr.
fn info_nvrtc(
    value: &std::path::Path,
    cuda_home: Option<&std::path::Path>,
) -> (serde_json::Value, String) {
    let home = tempfile::tempdir().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cp-hicache"));
    cmd.args(["info", "--json"])
        .env("CP_HICACHE_NVRTC", value)
        .env("RUST_LOG", "warn")
        .env("HOME", home.path())
        .env("PATH", home.path())
        .env_remove("CUDA_PATH")
        .env_remove("VIRTUAL_ENV")
        .env_remove("CONDA_PREFIX")
        .env_remove("LD_LIBRARY_PATH");
    match cuda_home {
        Some(d) => cmd.env("CUDA_HOME", d),
        None => cmd.env_remove("CUDA_HOME"),
    };
    let out = cmd.output().unwrap();
    assert!(out.status.success());
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    (
        report["nvrtc"].clone(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A `CP_HICACHE_NVRTC` that cannot be used is named with the reason (the `dlopen` error, a
/// missing file, a folder without the library), never the generic "set CP_HICACHE_NVRTC"
/// hint; where NVRTC is found elsewhere anyway, a warning says the same.
#[test]
fn info_names_an_unusable_cp_hicache_nvrtc_and_why() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("passwd");
    std::fs::write(&text, "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    for (value, why) in [
        (text.clone(), "cannot be used: dlopen failed: "),
        (dir.path().join("missing/libnvrtc.so.12"), "does not exist"),
        (empty, "is a folder holding no libnvrtc.so.12"),
    ] {
        let (nvrtc, stderr) = info_nvrtc(&value, None);
        let named = format!("CP_HICACHE_NVRTC={} {why}", value.display());
        if nvrtc["ok"] == true {
            // Found outside the hidden locations: the warning names the variable instead.
            assert!(
                stderr.contains(&named) && stderr.contains("instead"),
                "{stderr}"
            );
            continue;
        }
        let detail = nvrtc["detail"].as_str().unwrap();
        assert!(detail.contains(&named), "{named:?} not in: {detail}");
        assert!(!detail.contains("or set CP_HICACHE_NVRTC"), "{detail}");
    }
    // The text report says "not usable" rather than "not found".
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .arg("info")
        .env("CP_HICACHE_NVRTC", &text)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("NVRTC "))
        .unwrap();
    let detail = line.trim_start()["NVRTC".len()..].trim_start();
    if !detail.starts_with("nvrtc ") {
        let want = format!(
            "not usable: CP_HICACHE_NVRTC={} cannot be used",
            text.display()
        );
        assert!(detail.starts_with(&want), "{line}");
    }
}

/// When `CP_HICACHE_NVRTC` cannot be used but another libnvrtc is found (here a stand-in
/// under `CUDA_HOME`), that one is used and a warning names the variable and the reason.
#[test]
fn a_fallback_past_an_unusable_cp_hicache_nvrtc_is_a_warning() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("fake.c");
    std::fs::write(
        &src,
        "int nvrtcVersion(int* a, int* b) { *a = 12; *b = 9; return 0; }\n\
         const char* nvrtcGetErrorString(int r) { (void)r; return \"fake\"; }\n",
    )
    .unwrap();
    let lib64 = dir.path().join("cuda/lib64");
    std::fs::create_dir_all(&lib64).unwrap();
    // Its soname is the first name cudarc opens, so cudarc resolves to this very file.
    let status = Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libnvrtc.so"])
        .arg(&src)
        .arg("-o")
        .arg(lib64.join("libnvrtc.so.12"))
        .status()
        .unwrap();
    assert!(status.success());
    let text = dir.path().join("passwd");
    std::fs::write(&text, "not a library\n").unwrap();
    let (nvrtc, stderr) = info_nvrtc(&text, Some(&dir.path().join("cuda")));
    assert_eq!(nvrtc["ok"], true, "{nvrtc} {stderr}");
    let detail = nvrtc["detail"].as_str().unwrap();
    assert!(
        detail.contains("nvrtc 12.9") && detail.contains("cuda/lib64"),
        "{detail}"
    );
    assert!(
        stderr.contains(&format!(
            "CP_HICACHE_NVRTC={} cannot be used: dlopen failed: ",
            text.display()
        )) && stderr.contains(&format!(
            "using {} instead",
            lib64.join("libnvrtc.so.12").display()
        )),
        "{stderr}"
    );
}

/// `--help` lists every environment variable the binary reads.
#[test]
fn help_lists_the_environment() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    let env = help
        .split("Environment:")
        .nth(1)
        .unwrap_or_else(|| panic!("no Environment section: {help}"));
    for var in [
        "CP_HICACHE_CACHE_DIR",
        "CP_HICACHE_JIT",
        "CP_HICACHE_NVRTC",
        "CUDA_HOME",
        "CUDA_PATH",
        "CXX",
        "CP_HICACHE_COMPILE_TIMEOUT",
        "CP_HICACHE_EMU_ORDER",
        "CP_HICACHE_EMU_SANITIZE",
        "CP_HICACHE_DEBUG_ALLOC",
        "RUST_LOG",
    ] {
        assert!(env.contains(var), "{var} missing from --help");
    }
}
