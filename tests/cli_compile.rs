//! The `render` and `compile` commands, run as the built binary: exit statuses, messages, the
//! render tree equal to `generated/`, and the JSON rows of a cold then warm compile.
//!
//! The compile runs need NVRTC; without it they print one line and pass, unless
//! `CP_HICACHE_REQUIRE_NVRTC=1`.

use cp_hicache::jit::nvrtc::NOT_FOUND_HINT;
use cp_hicache::jit::NvrtcCompiler;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_cp-hicache"));
    c.env_remove("CP_HICACHE_JIT").env("RUST_LOG", "warn");
    c
}

fn run(c: &mut Command) -> Output {
    c.output().expect("the binary starts")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn generated_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("generated")
}

fn nvrtc_present() -> bool {
    match NvrtcCompiler::load() {
        Ok(_) => true,
        Err(e) => {
            if std::env::var("CP_HICACHE_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("CP_HICACHE_REQUIRE_NVRTC=1 but: {e}");
            }
            println!("{NOT_FOUND_HINT}");
            false
        }
    }
}

fn files_under(root: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(PathBuf, Vec<u8>)>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(root, &p, out);
            } else {
                let rel = p.strip_prefix(root).unwrap().to_path_buf();
                out.push((rel, std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

#[test]
fn list_deployments_prints_reference_names() {
    let out = run(bin().args(["compile", "--list-deployments"]));
    assert!(out.status.success(), "{}", text(&out.stderr));
    let names: Vec<String> = cp_hicache::kernels::Deployment::reference()
        .into_iter()
        .map(|d| d.name)
        .collect();
    let printed: Vec<String> = text(&out.stdout).lines().map(str::to_string).collect();
    assert_eq!(printed, names);
}

/// `--list-deployments` only lists: the options of a compile are refused with it (exit
/// status 2, both flags named) rather than ignored, and no `--json` file appears.
#[test]
fn list_deployments_refuses_compile_options() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("c.json");
    let json = json.to_str().unwrap();
    for (extra, flag) in [
        (&["--deployment", "all"][..], "--deployment"),
        (&["--target", "host"], "--target"),
        (&["--arch", "sm_80"], "--arch"),
        (&["--json", json], "--json"),
    ] {
        let out = run(bin()
            .args(["compile", "--list-deployments"])
            .args(extra)
            .env("CP_HICACHE_CACHE_DIR", tmp.path().join("cache")));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{extra:?}: {stderr}");
        assert!(
            stderr.contains("cannot be used with")
                && stderr.contains("--list-deployments")
                && stderr.contains(flag),
            "{extra:?}: {stderr}"
        );
        assert!(out.stdout.is_empty(), "{extra:?}: {}", text(&out.stdout));
    }
    assert!(!Path::new(json).exists());
}

#[test]
fn render_writes_exactly_generated_and_check_agrees() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("gen");
    let out = run(bin().args(["render", "--out"]).arg(&out_dir));
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(files_under(&out_dir), files_under(&generated_dir()));

    let out = run(bin().args(["render", "--check", "--out"]).arg(&out_dir));
    assert!(out.status.success(), "{}", text(&out.stdout));
    let out = run(bin()
        .args(["render", "--check", "--out"])
        .arg(generated_dir()));
    assert!(
        out.status.success(),
        "generated/ is stale: {}",
        text(&out.stdout)
    );

    // One deployment checks only its own directory.
    let out = run(bin()
        .args(["render", "--check", "--deployment", "mla_ps16_cp4", "--out"])
        .arg(&out_dir));
    assert!(out.status.success(), "{}", text(&out.stdout));

    // A changed, a missing and an extra file are each listed; exit 1.
    let dep = out_dir.join("nsa_ps64_cp8");
    std::fs::write(dep.join("release_pages_cp8_t256.cu"), "// edited\n").unwrap();
    std::fs::remove_file(dep.join("index.json")).unwrap();
    std::fs::write(dep.join("stale.cu"), "").unwrap();
    let out = run(bin().args(["render", "--check", "--out"]).arg(&out_dir));
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    for needle in [
        "changed  nsa_ps64_cp8/release_pages_cp8_t256.cu",
        "missing  nsa_ps64_cp8/index.json",
        "extra    nsa_ps64_cp8/stale.cu",
    ] {
        assert!(stdout.contains(needle), "{needle:?} not in:\n{stdout}");
    }
    // The fix names the folder that was checked, not generated/.
    let fix = format!(
        "regenerate with: cp-hicache render --out {}\n",
        out_dir.display()
    );
    assert!(stdout.contains(&fix), "{fix:?} not in:\n{stdout}");
}

/// `render --check` on a folder that does not exist (or is a file) says so in one line and
/// exits 2, instead of listing every rendered file as missing.
#[test]
fn render_check_of_a_missing_folder_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("file");
    std::fs::write(&file, "").unwrap();
    for (dir, what) in [
        (tmp.path().join("nope"), "does not exist"),
        (file, "is not a directory"),
    ] {
        let out = run(bin()
            .args(["render", "--check", "--deployment", "nsa_ps64_cp2", "--out"])
            .arg(&dir));
        assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains(&format!("{} {what}", dir.display()))
                && stderr.contains(&format!(
                    "cp-hicache render --out {} --deployment nsa_ps64_cp2",
                    dir.display()
                )),
            "{stderr}"
        );
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
        assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    }
}

/// A stale file fails `render --check`; rendering again leaves it (render never deletes), so
/// the hint names it for deletion, and following the hint makes the check pass. A `--out`
/// that is a file is refused by render itself, and `--check` does not suggest rendering
/// into it without moving it first.
#[test]
fn render_check_hints_lead_to_a_passing_check() {
    let tmp = tempfile::tempdir().unwrap();
    let out_dir = tmp.path().join("gen dir");
    let dep = ["--deployment", "mla_ps16_cp4"];
    let render = |extra: &[&str]| {
        run(bin()
            .arg("render")
            .args(dep)
            .args(extra)
            .arg("--out")
            .arg(&out_dir))
    };
    assert!(render(&[]).status.success());
    let stale = out_dir.join("mla_ps16_cp4/old_kernel.cu");
    std::fs::write(&stale, "// stale\n").unwrap();
    let out = render(&["--check"]);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(!stdout.contains("regenerate"), "{stdout}");
    let hint = stdout
        .lines()
        .find_map(|l| l.split_once("deletes files): "))
        .unwrap_or_else(|| panic!("no delete hint in:\n{stdout}"))
        .1;
    assert_eq!(hint, format!("rm -- '{}'", stale.display()));
    // Rendering again warns about the file and says how to delete it.
    let out = render(&[]);
    assert!(out.status.success());
    assert!(text(&out.stderr).contains(hint), "{}", text(&out.stderr));
    assert!(render(&["--check"]).status.code() == Some(1));
    // The hint, run by a shell, fixes the tree.
    let rm = Command::new("/bin/sh").args(["-c", hint]).status().unwrap();
    assert!(rm.success());
    let out = render(&["--check"]);
    assert!(out.status.success(), "{}", text(&out.stdout));

    // A file where the folder should be.
    let file = tmp.path().join("file");
    std::fs::write(&file, "mine").unwrap();
    let out = run(bin().args(["render", "--out"]).arg(&file));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("is not a directory"), "{stderr}");
    let out = run(bin().args(["render", "--check", "--out"]).arg(&file));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("move the file away"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "mine");
}

/// `--arch` picks the NVRTC target's GPU; with `--target host` it would be ignored, so it is
/// refused (exit 2) before anything compiles.
#[test]
fn compile_refuses_arch_with_the_host_target() {
    let tmp = tempfile::tempdir().unwrap();
    let out = run(bin()
        .args(["compile", "--target", "host", "--arch", "sm_80"])
        .env("CP_HICACHE_CACHE_DIR", tmp.path()));
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("--arch") && stderr.contains("--target host"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
}

#[test]
fn unknown_deployment_is_a_usage_error_listing_names() {
    let tmp = tempfile::tempdir().unwrap();
    for args in [
        vec!["render", "--deployment", "nsa_ps32_cp8", "--out"],
        vec!["compile", "--deployment", "nsa_ps32_cp8", "--json"],
    ] {
        let out = run(bin()
            .args(&args)
            .arg(tmp.path().join("x"))
            .env("CP_HICACHE_CACHE_DIR", tmp.path()));
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(stderr.contains("nsa_ps32_cp8"), "{stderr}");
        for name in ["nsa_ps64_cp1", "nsa_ps64_cp8", "mla_ps64_cp8"] {
            assert!(stderr.contains(name), "{name} not in {stderr}");
        }
        assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    }
}

#[test]
fn compile_json_cold_then_warm() {
    if !nvrtc_present() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let compile = |json: &Path| {
        let out = run(bin()
            .args(["compile", "--deployment", "nsa_ps64_cp2", "--arch", "sm_90"])
            .arg("--json")
            .arg(json)
            .env("CP_HICACHE_CACHE_DIR", &cache));
        assert!(
            out.status.success(),
            "{}\n{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        let rows: Vec<serde_json::Value> =
            serde_json::from_slice(&std::fs::read(json).unwrap()).unwrap();
        (text(&out.stdout), rows)
    };
    let (cold_out, cold) = compile(&tmp.path().join("cold.json"));
    let (warm_out, warm) = compile(&tmp.path().join("warm.json"));

    let dep = cp_hicache::kernels::Deployment::by_name("nsa_ps64_cp2").unwrap();
    let uris: Vec<String> = dep.specs().iter().map(|s| s.uri()).collect();
    for rows in [&cold, &warm] {
        let kernels: Vec<&str> = rows.iter().map(|r| r["kernel"].as_str().unwrap()).collect();
        assert_eq!(kernels, uris);
        for r in rows.iter() {
            for field in [
                "spec",
                "arch",
                "registers",
                "spill_bytes",
                "stack_bytes",
                "shared_bytes",
                "compile_ms",
                "cache_hit",
            ] {
                assert!(!r[field].is_null(), "{field} missing in {r}");
            }
            assert_eq!(r["arch"], "sm_90");
            assert_eq!(r["spill_bytes"], 0);
            assert_eq!(r["stack_bytes"], 0);
        }
    }
    assert!(cold.iter().all(|r| r["cache_hit"] == false), "{cold_out}");
    assert!(warm.iter().all(|r| r["cache_hit"] == true), "{warm_out}");
    for (c, w) in cold.iter().zip(&warm) {
        assert_eq!(c["registers"], w["registers"]);
        assert_eq!(c["shared_bytes"], w["shared_bytes"]);
    }
    assert!(cold_out.contains("(cold)") && warm_out.contains("(warm)"));
    assert!(warm_out.contains(&format!("{} cache hits, 0 misses", uris.len())));
}

/// With NVRTC hidden, `compile` ends with one line naming the install hint (exit 1). A machine
/// with NVRTC in a system location still finds it; then the run succeeds, and `info` under the
/// same environment must name that copy, so a compile that succeeds without NVRTC cannot pass
/// for one.
/// Runs `c` with every place NVRTC is searched hidden (a cache, home and PATH under `tmp`)
/// except `CP_HICACHE_NVRTC`, which is set to `nvrtc` or removed.
fn hide_nvrtc(c: &mut Command, tmp: &std::path::Path, nvrtc: Option<&std::path::Path>) {
    c.env("CP_HICACHE_CACHE_DIR", tmp.join("cache"))
        .env("HOME", tmp)
        .env("PATH", tmp)
        .env_remove("CUDA_HOME")
        .env_remove("CUDA_PATH")
        .env_remove("VIRTUAL_ENV")
        .env_remove("CONDA_PREFIX")
        .env_remove("LD_LIBRARY_PATH");
    match nvrtc {
        Some(p) => c.env("CP_HICACHE_NVRTC", p),
        None => c.env_remove("CP_HICACHE_NVRTC"),
    };
}

#[test]
fn compile_without_nvrtc_prints_one_line_hint() {
    let tmp = tempfile::tempdir().unwrap();
    // CP_HICACHE_NVRTC unset: the hint suggests setting it (a value that cannot be used is
    // named instead; see `compile_names_an_unusable_cp_hicache_nvrtc`).
    let hidden = |c: &mut Command| hide_nvrtc(c, tmp.path(), None);
    let mut compile = bin();
    compile.args(["compile", "--deployment", "nsa_ps64_cp1"]);
    hidden(&mut compile);
    let out = run(&mut compile);
    if out.status.success() {
        let mut info = bin();
        info.args(["info", "--json"]);
        hidden(&mut info);
        let info = run(&mut info);
        let report: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
        let nvrtc = &report["nvrtc"];
        assert_eq!(
            nvrtc["ok"], true,
            "compile succeeded with NVRTC hidden, but info finds none: {nvrtc}"
        );
        println!(
            "NVRTC found outside the hidden locations ({}); nothing to check",
            nvrtc["detail"]
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(NOT_FOUND_HINT), "{stderr}");
    // `bench --prebuild` (the CUBIN cache for a GPU machine) ends the same way, not with one
    // error per kernel.
    let mut prebuild = bin();
    prebuild.args(["bench", "--prebuild", "--deployment", "nsa_ps64_cp1"]);
    hidden(&mut prebuild);
    let out = run(&mut prebuild);
    assert_eq!(out.status.code(), Some(1));
    let stderr = text(&out.stderr);
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(stderr.contains(NOT_FOUND_HINT), "{stderr}");
}

/// `CP_HICACHE_NVRTC` naming a file that is not a library: compile (and `bench --prebuild`)
/// end with one line naming the variable, its value and the `dlopen` error, not the hint to
/// set the variable. Where NVRTC is found elsewhere anyway, nothing to check here.
#[test]
fn compile_names_an_unusable_cp_hicache_nvrtc() {
    let tmp = tempfile::tempdir().unwrap();
    let text_file = tmp.path().join("passwd");
    std::fs::write(&text_file, "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    let hidden = |c: &mut Command| hide_nvrtc(c, tmp.path(), Some(&text_file));
    for args in [
        &["compile", "--deployment", "nsa_ps64_cp1"][..],
        &["bench", "--prebuild", "--deployment", "nsa_ps64_cp1"],
    ] {
        let mut c = bin();
        c.args(args);
        hidden(&mut c);
        let out = run(&mut c);
        let stderr = text(&out.stderr);
        if out.status.success() {
            println!("NVRTC found outside the hidden locations; nothing to check: {stderr}");
            return;
        }
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert_eq!(stderr.trim().lines().count(), 1, "{args:?}: {stderr}");
        let named = format!(
            "CP_HICACHE_NVRTC={} cannot be used: dlopen failed: ",
            text_file.display()
        );
        assert!(stderr.contains(&named), "{args:?}: {stderr}");
        assert!(
            !stderr.contains("or set CP_HICACHE_NVRTC"),
            "{args:?}: {stderr}"
        );
    }
}

/// A stand-in `$CXX`: answers the version probes and "compiles" by writing its arguments to the
/// `-o` file, so a host compile runs in milliseconds and its flags can be read back.
fn fake_cxx(dir: &Path) -> PathBuf {
    let path = dir.join("fake-cxx");
    std::fs::write(
        &path,
        "#!/bin/sh\n\
         case \"$1\" in --version) echo 'fake c++ 1.0'; exit 0;; -dumpmachine) echo fake; exit 0;; esac\n\
         all=\"$*\"; out=\n\
         while [ $# -gt 0 ]; do [ \"$1\" = -o ] && out=\"$2\"; shift; done\n\
         echo \"$all\" > \"$out\"\n",
    )
    .unwrap();
    let mut perm = std::fs::metadata(&path).unwrap().permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&path, perm).unwrap();
    path
}

/// `CP_HICACHE_EMU_SANITIZE=address` reaches the CLI's host builds: `compile --target host`
/// commits its entries under `<cache>/host-asan/`, built with the ASan flags; a misspelt mode
/// is refused with a message naming the variable instead of building uninstrumented kernels.
#[test]
fn emu_sanitize_env_selects_the_asan_host_build() {
    let tmp = tempfile::tempdir().unwrap();
    let cxx = fake_cxx(tmp.path());
    let cache = tmp.path().join("cache");
    let compile = |mode: &str| {
        run(bin()
            .args([
                "compile",
                "--target",
                "host",
                "--deployment",
                "mla_ps16_cp4",
            ])
            .env("CXX", &cxx)
            .env("CP_HICACHE_CACHE_DIR", &cache)
            .env("CP_HICACHE_EMU_SANITIZE", mode))
    };
    let out = compile("address");
    assert!(out.status.success(), "{}", text(&out.stderr));
    let libs: Vec<(PathBuf, Vec<u8>)> = files_under(&cache.join("host-asan"))
        .into_iter()
        .filter(|(p, _)| p.extension().is_some_and(|e| e == "so"))
        .collect();
    assert_eq!(libs.len(), 8, "{libs:?}");
    for (path, flags) in &libs {
        assert!(
            text(flags).contains("-fsanitize=address"),
            "{}: {}",
            path.display(),
            text(flags)
        );
    }
    assert!(!cache.join("host").exists());

    let out = compile("adress");
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(
        err.contains("CP_HICACHE_EMU_SANITIZE") && err.contains("adress"),
        "{err}"
    );
}

/// A report that cannot be written whole (here the file size limit stands in for a full
/// disk) leaves the earlier report as it was, with no partial or temporary file beside it:
/// `--json` is written to a temporary file and renamed.
#[test]
fn a_failed_json_write_keeps_the_earlier_report() {
    let tmp = tempfile::tempdir().unwrap();
    let cxx = fake_cxx(tmp.path());
    let reports = tmp.path().join("reports");
    std::fs::create_dir(&reports).unwrap();
    let json = reports.join("compile.json");
    let compile = |c: &mut Command| {
        c.args([
            "compile",
            "--target",
            "host",
            "--deployment",
            "mla_ps16_cp4",
            "--json",
        ])
        .arg(&json)
        .env("CXX", &cxx)
        .env("CP_HICACHE_CACHE_DIR", tmp.path().join("cache"))
        .env_remove("CP_HICACHE_EMU_SANITIZE");
        run(c)
    };
    let out = compile(&mut bin());
    assert!(out.status.success(), "{}", text(&out.stderr));
    let earlier = std::fs::read(&json).unwrap();
    assert!(earlier.len() > 1024, "{} bytes", earlier.len());
    // The second run hits the cache (nothing else is written) and its report exceeds the
    // file size limit; SIGXFSZ is ignored so the write fails with EFBIG instead.
    let mut limited = Command::new("/bin/sh");
    limited
        .args(["-c", "trap '' XFSZ; ulimit -f 1; exec \"$@\"", "sh"])
        .arg(env!("CARGO_BIN_EXE_cp-hicache"))
        .env_remove("CP_HICACHE_JIT")
        .env("RUST_LOG", "warn");
    let out = compile(&mut limited);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("writing {}", json.display())),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&json).unwrap(), earlier, "the report was cut");
    let names: Vec<_> = std::fs::read_dir(&reports)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["compile.json"], "a temporary file was left");
}

/// A compile timeout that is not a number of seconds is bad input (exit status 2), named
/// before anything compiles.
#[test]
fn a_bad_compile_timeout_is_a_usage_error() {
    let tmp = tempfile::tempdir().unwrap();
    for bad in ["abc", "0", "-5"] {
        let out = run(bin()
            .args([
                "compile",
                "--target",
                "host",
                "--deployment",
                "mla_ps16_cp4",
            ])
            .env("CP_HICACHE_CACHE_DIR", tmp.path())
            .env("CP_HICACHE_COMPILE_TIMEOUT", bad));
        let stderr = text(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{bad}: {stderr}");
        assert!(
            stderr.contains("CP_HICACHE_COMPILE_TIMEOUT") && stderr.contains(bad),
            "{stderr}"
        );
    }
}
