//! JIT layer: keys, disk cache, host compiler, NVRTC, cross-process locking.
//!
//! NVRTC tests print one line and return early when the library is missing, unless
//! `CP_HICACHE_REQUIRE_NVRTC=1`, in which case they fail.

use cp_hicache::jit::cache::{Manifest, NewEntry};
use cp_hicache::jit::key::{capture_env, stable_digest, CacheKey, KeyInputs, KEY_ENV_ALLOWLIST};
use cp_hicache::jit::nvrtc::NOT_FOUND_HINT;
use cp_hicache::jit::{
    Arch, Artifact, CacheHit, DiskCache, HostCcOptions, Jit, JitConfig, JitError, JitMode,
    JitRequest, NvrtcCompiler, NvrtcOptions, Sanitize, Target,
};
use std::path::{Path, PathBuf};

mod support;

const HEADER: &str = "// test emulation header\n#define CP_TEST_HEADER 1\n";
const ADD_SRC: &str = "extern \"C\" int add(int a, int b) { return a + b + CP_TEST_HEADER - 1; }\n";

fn host_req(uri: &str, source: &str) -> JitRequest {
    JitRequest {
        uri: uri.to_string(),
        source: source.to_string(),
        target: Target::Host {
            sanitize: Sanitize::None,
        },
    }
}

/// A config building this file's test sources with its own small header.
fn config(dir: &Path, header: &str) -> JitConfig {
    let mut c = JitConfig::new(dir);
    // SAFETY: this JIT builds only this file's test sources, which the tests load and call
    // with libloading themselves; nothing loads them as spec kernels.
    unsafe { c.set_emu_header(header) };
    c
}

fn jit_in(dir: &Path) -> Jit {
    Jit::new(config(dir, HEADER))
}

fn so_path(k: &cp_hicache::jit::CompiledKernel) -> PathBuf {
    match &k.artifact {
        Artifact::SharedObject(p) => p.clone(),
        other => panic!("expected a shared object, got {other:?}"),
    }
}

/// Calls `add` from a built library (the real loader lives in the executor).
fn call_add(path: &Path, a: i32, b: i32) -> i32 {
    // SAFETY: the library was just built from ADD_SRC, which has no initialisers, and exports
    // `add` with exactly this C signature; the handle outlives the call.
    unsafe {
        let lib = libloading::Library::new(path).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(i32, i32) -> i32> = lib.get(b"add").unwrap();
        f(a, b)
    }
}

// ---------------------------------------------------------------- keys

#[test]
fn key_changes_with_every_input() {
    let args = vec!["-O2".to_string()];
    let args2 = vec!["-O3".to_string()];
    let env = vec![("CXX".to_string(), None)];
    let env2 = vec![("CXX".to_string(), Some("clang++".to_string()))];
    let base = KeyInputs {
        crate_version: "0.1.0",
        uri: "k",
        source: "src",
        compiler: "gcc 12",
        options_args: &args,
        options_digest: [0; 32],
        target: "host",
        emu_header: Some("hdr"),
        env: &env,
    };
    let k0 = CacheKey::compute(&base);
    let variants = [
        KeyInputs {
            crate_version: "0.1.1",
            ..base
        },
        KeyInputs { uri: "k2", ..base },
        KeyInputs {
            source: "src ",
            ..base
        },
        KeyInputs {
            compiler: "gcc 13",
            ..base
        },
        KeyInputs {
            options_args: &args2,
            ..base
        },
        KeyInputs {
            options_digest: [1; 32],
            ..base
        },
        KeyInputs {
            target: "host-asan",
            ..base
        },
        KeyInputs {
            emu_header: Some("hdr2"),
            ..base
        },
        KeyInputs {
            emu_header: None,
            ..base
        },
        KeyInputs { env: &env2, ..base },
        KeyInputs { env: &[], ..base },
    ];
    let mut seen = std::collections::HashSet::new();
    seen.insert(k0.hash.clone());
    for (i, v) in variants.iter().enumerate() {
        let k = CacheKey::compute(v);
        assert!(
            seen.insert(k.hash.clone()),
            "variant {i} did not change the key"
        );
    }
    assert_eq!(CacheKey::compute(&base), k0, "key is deterministic");
}

#[test]
fn jit_key_covers_header_options_and_target() {
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let req = host_req("add", ADD_SRC);
    let k = jit.key_for(&req).unwrap();
    assert!(k.readable.starts_with("add-"));

    let mut other_header = config(dir.path(), "// other\n");
    other_header.env = jit.config().env.clone();
    assert_ne!(Jit::new(other_header).key_for(&req).unwrap(), k);

    let mut cfg = config(dir.path(), HEADER);
    let o3 = HostCcOptions {
        opt_level: "3".into(),
        ..cfg.host().clone()
    };
    // SAFETY: another optimisation level builds the same code (`config`'s note holds too).
    unsafe { cfg.set_host(o3) };
    assert_ne!(Jit::new(cfg).key_for(&req).unwrap(), k);

    let asan = JitRequest {
        target: Target::Host {
            sanitize: Sanitize::Address,
        },
        ..req.clone()
    };
    assert_ne!(jit.key_for(&asan).unwrap(), k);
    let src = JitRequest {
        source: format!("{ADD_SRC}\n"),
        ..req.clone()
    };
    assert_ne!(jit.key_for(&src).unwrap(), k);
    assert!(jit.key_for(&host_req("bad/uri", ADD_SRC)).is_err());
}

// ---------------------------------------------------------------- host compile + cache

#[test]
fn host_compile_round_trip_memory_and_disk() {
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let req = host_req("add", ADD_SRC);

    let first = jit.get(&req).unwrap();
    assert_eq!(first.cache_hit, CacheHit::Miss);
    let so = so_path(&first);
    assert!(so.starts_with(dir.path().join("host").join(&first.key.readable)));
    assert_eq!(call_add(&so, 2, 3), 5);
    let entry = dir.path().join("host").join(&first.key.readable);
    assert!(entry.join("manifest.json").is_file());
    assert_eq!(
        std::fs::read_to_string(entry.join("add.cu")).unwrap(),
        ADD_SRC
    );

    let second = jit.get(&req).unwrap();
    assert_eq!(second.cache_hit, CacheHit::Memory);
    assert_eq!(so_path(&second), so);

    let fresh = jit_in(dir.path());
    let third = fresh.get(&req).unwrap();
    assert_eq!(third.cache_hit, CacheHit::Disk);
    assert_eq!(so_path(&third), so);
    assert_eq!(third.key, first.key);
}

#[test]
fn host_compile_error_names_the_uri() {
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let err = jit
        .get(&host_req(
            "broken_kernel_ps64",
            "extern \"C\" int f( { nope }\n",
        ))
        .unwrap_err();
    assert!(err.is_compile_error(), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("broken_kernel_ps64"), "{msg}");
    match err {
        cp_hicache::jit::JitError::HostCc {
            uri, cmd, stderr, ..
        } => {
            assert_eq!(uri, "broken_kernel_ps64");
            assert!(cmd.contains("-DCP_HICACHE_EMU"), "{cmd}");
            assert!(!stderr.is_empty());
        }
        other => panic!("{other:?}"),
    }
    // Nothing was committed.
    let host = dir.path().join("host");
    let entries: Vec<_> = std::fs::read_dir(&host)
        .map(|r| {
            r.filter_map(|e| e.ok())
                .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    assert!(entries.is_empty(), "{entries:?}");
}

fn corrupt_then_recompile(corrupt: impl Fn(&Path)) {
    let dir = tempfile::tempdir().unwrap();
    let req = host_req("add", ADD_SRC);
    let first = jit_in(dir.path()).get(&req).unwrap();
    let so = so_path(&first);
    corrupt(&so);

    let jit = jit_in(dir.path());
    let again = jit.get(&req).unwrap();
    assert_eq!(
        again.cache_hit,
        CacheHit::Miss,
        "a corrupt entry must be recompiled"
    );
    assert_eq!(call_add(&so_path(&again), 20, 22), 42);
    let third = jit_in(dir.path()).get(&req).unwrap();
    assert_eq!(third.cache_hit, CacheHit::Disk);
}

#[test]
fn truncated_artifact_is_recompiled() {
    corrupt_then_recompile(|so| {
        let bytes = std::fs::read(so).unwrap();
        std::fs::write(so, &bytes[..bytes.len() / 2]).unwrap();
    });
}

#[test]
fn flipped_byte_is_recompiled() {
    corrupt_then_recompile(|so| {
        let mut bytes = std::fs::read(so).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(so, &bytes).unwrap();
    });
}

#[test]
fn garbage_manifest_is_recompiled() {
    corrupt_then_recompile(|so| {
        std::fs::write(so.parent().unwrap().join("manifest.json"), b"{not json").unwrap();
    });
}

/// A directory in the manifest's place (any read error but "not found") makes the entry
/// unusable, not the request: it is rebuilt.
#[test]
fn unreadable_manifest_is_recompiled() {
    corrupt_then_recompile(|so| {
        let manifest = so.parent().unwrap().join("manifest.json");
        std::fs::remove_file(&manifest).unwrap();
        std::fs::create_dir(&manifest).unwrap();
    });
}

/// The same with compiling off: the entry is named as corrupt, and left as it is.
#[test]
fn jit_off_unreadable_artifact_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let req = host_req("add", ADD_SRC);
    let so = so_path(&jit_in(dir.path()).get(&req).unwrap());
    std::fs::remove_file(&so).unwrap();
    std::fs::create_dir(&so).unwrap();
    let err = off_in(dir.path()).get(&req).unwrap_err();
    assert!(err.is_corrupt(), "{err}");
    assert!(err.to_string().contains("artifact unreadable"), "{err}");
    assert!(so.is_dir(), "a prebuilt cache was modified");
}

/// A prebuilt host cache serves a machine without a C++ compiler when compiling is off: the
/// key is recomputed with the compiler the manifest names.
#[test]
fn jit_off_without_a_host_compiler_uses_the_prebuilt_entry() {
    let dir = tempfile::tempdir().unwrap();
    let req = host_req("add", ADD_SRC);
    jit_in(dir.path()).get(&req).unwrap();
    let mut cfg = config(dir.path(), HEADER);
    // SAFETY: a compiler that does not exist builds nothing.
    unsafe { cfg.set_cxx(Some("/nonexistent/c++".to_string())) };
    let on = Jit::new(cfg.clone()).get(&req).unwrap_err();
    assert!(on.is_unavailable(), "{on}");
    cfg.mode = JitMode::Off;
    let hit = Jit::new(cfg.clone()).get(&req).unwrap();
    assert_eq!(hit.cache_hit, CacheHit::Disk);
    assert_eq!(call_add(&so_path(&hit), 40, 2), 42);
    // Another source is a miss, reported as one.
    let other = host_req("add", &ADD_SRC.replace("a + b", "b + a"));
    let err = Jit::new(cfg).get(&other).unwrap_err();
    assert!(err.is_jit_off(), "{err}");
}

#[test]
fn missing_manifest_is_a_miss() {
    corrupt_then_recompile(|so| {
        std::fs::remove_file(so.parent().unwrap().join("manifest.json")).unwrap();
    });
}

#[test]
fn jit_off_miss_is_an_error_and_hit_is_fine() {
    let dir = tempfile::tempdir().unwrap();
    let req = host_req("add", ADD_SRC);
    let mut cfg = config(dir.path(), HEADER);
    cfg.mode = JitMode::Off;
    let off = Jit::new(cfg.clone());
    let err = off.get(&req).unwrap_err();
    assert!(err.is_jit_off(), "{err}");
    assert!(err.to_string().contains("add"));
    assert!(err.to_string().contains("CP_HICACHE_JIT=off"));

    jit_in(dir.path()).get(&req).unwrap();
    let hit = Jit::new(cfg).get(&req).unwrap();
    assert_eq!(hit.cache_hit, CacheHit::Disk);
}

fn off_in(dir: &Path) -> Jit {
    let mut cfg = config(dir, HEADER);
    cfg.mode = JitMode::Off;
    cfg.nvrtc_enabled = false;
    Jit::new(cfg)
}

/// Every file under `dir` with its bytes (to show that nothing was changed).
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out: Vec<(PathBuf, Vec<u8>)> = walkdir(dir)
        .into_iter()
        .map(|p| {
            let bytes = std::fs::read(&p).unwrap();
            (p, bytes)
        })
        .collect();
    out.sort();
    out
}

fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walkdir(&p));
        } else {
            out.push(p);
        }
    }
    out
}

/// With JIT off a corrupt entry is reported with its path and reason, and the (prebuilt) cache
/// is left exactly as it was; with JIT on the same entry is rebuilt.
#[test]
fn jit_off_corrupt_entry_is_reported_not_discarded() {
    let dir = tempfile::tempdir().unwrap();
    let req = host_req("add", ADD_SRC);
    let built = jit_in(dir.path()).get(&req).unwrap();
    let so = so_path(&built);
    let mut bytes = std::fs::read(&so).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&so, &bytes).unwrap();
    let before = snapshot(dir.path());

    let err = off_in(dir.path()).get(&req).unwrap_err();
    assert!(err.is_corrupt(), "{err}");
    match &err {
        JitError::CorruptEntry { uri, path, reason } => {
            assert_eq!(uri, "add");
            assert_eq!(path, &built.entry_dir);
            assert!(reason.contains("sha256"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("CP_HICACHE_JIT=off"), "{err}");
    assert_eq!(snapshot(dir.path()), before, "the cache was modified");

    let again = jit_in(dir.path()).get(&req).unwrap();
    assert_eq!(again.cache_hit, CacheHit::Miss);
}

/// Edits one manifest field of the committed `add` entry.
fn edit_manifest(so: &Path, field: &str, value: &str) {
    let path = so.parent().unwrap().join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m[field] = value.into();
    std::fs::write(&path, serde_json::to_vec(&m).unwrap()).unwrap();
}

#[test]
fn manifest_naming_another_key_is_recompiled() {
    corrupt_then_recompile(|so| edit_manifest(so, "key", &"0".repeat(64)));
}

#[test]
fn manifest_naming_another_uri_is_recompiled() {
    corrupt_then_recompile(|so| edit_manifest(so, "uri", "other"));
}

#[test]
fn manifest_naming_another_target_is_recompiled() {
    corrupt_then_recompile(|so| edit_manifest(so, "target", "host-asan"));
}

#[test]
fn jit_off_manifest_key_mismatch_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    let req = host_req("add", ADD_SRC);
    let built = jit_in(dir.path()).get(&req).unwrap();
    edit_manifest(&so_path(&built), "key", &"0".repeat(64));
    let err = off_in(dir.path()).get(&req).unwrap_err();
    assert!(
        matches!(&err, JitError::CorruptEntry { reason, .. } if reason.contains("manifest key")),
        "{err}"
    );
}

/// Prebuilt-only lookup (JIT off, no NVRTC) of a forged NVRTC entry: found while intact; once
/// its CUBIN or manifest is damaged, the error names the entry instead of "not in the cache",
/// and the entry is left in place.
#[test]
fn prebuilt_lookup_reports_a_corrupt_entry() {
    let dir = tempfile::tempdir().unwrap();
    let req = JitRequest {
        uri: "prebuilt_k".to_string(),
        source: "extern \"C\" __global__ void prebuilt_k() {}\n".to_string(),
        target: Target::Nvrtc { arch: Arch::Sm90 },
    };
    let opts = NvrtcOptions::default().with_arch(Arch::Sm90);
    let args = opts.to_args();
    let env = capture_env(KEY_ENV_ALLOWLIST);
    let key = CacheKey::compute(&KeyInputs {
        crate_version: env!("CARGO_PKG_VERSION"),
        uri: &req.uri,
        source: &req.source,
        compiler: "nvrtc 99.9",
        options_args: &args,
        options_digest: stable_digest(&opts),
        target: "sm_90",
        emu_header: None,
        env: &env,
    });
    let cache = DiskCache::new(dir.path());
    let entry = {
        let _lock = cache.lock("sm_90", &key.readable).unwrap();
        cache
            .commit(
                "sm_90",
                &key.readable,
                NewEntry {
                    artifact_file: "prebuilt_k.cubin",
                    artifact: b"not really a cubin",
                    source_file: "prebuilt_k.cu",
                    source: &req.source,
                    manifest: Manifest::describe(
                        &req.uri,
                        &key.hash,
                        "sm_90",
                        "nvrtc 99.9",
                        args.clone(),
                        1.0,
                        serde_json::Value::Null,
                    ),
                },
            )
            .unwrap()
    };
    let k = off_in(dir.path()).get(&req).unwrap();
    assert_eq!((k.key.clone(), k.cache_hit), (key.clone(), CacheHit::Disk));

    std::fs::write(&entry.artifact_path, b"not really a cubiN").unwrap();
    let before = snapshot(dir.path());
    let err = off_in(dir.path()).get(&req).unwrap_err();
    assert!(
        matches!(&err, JitError::CorruptEntry { path, .. } if path == &entry.dir),
        "{err}"
    );
    assert_eq!(snapshot(dir.path()), before, "the cache was modified");
    std::fs::write(entry.dir.join("manifest.json"), b"{not json").unwrap();
    let err = off_in(dir.path()).get(&req).unwrap_err();
    assert!(
        matches!(&err, JitError::CorruptEntry { reason, .. } if reason.contains("manifest")),
        "{err}"
    );
    assert!(entry.artifact_path.is_file(), "the entry was removed");
}

#[test]
fn warm_up_compiles_in_parallel_once_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let mut reqs: Vec<JitRequest> = (0..4)
        .map(|i| {
            host_req(
                &format!("k{i}"),
                &format!("extern \"C\" int k{i}(int a) {{ return a + {i}; }}\n"),
            )
        })
        .collect();
    reqs.push(reqs[0].clone());
    reqs.push(host_req("bad_src", "this is not C++"));
    let results = jit.warm_up(&reqs);
    assert_eq!(results.len(), reqs.len());
    for (i, r) in results.iter().take(5).enumerate() {
        let k = r.as_ref().unwrap();
        assert_eq!(k.uri, reqs[i].uri);
    }
    let misses = results
        .iter()
        .filter(|r| matches!(r, Ok(k) if k.cache_hit == CacheHit::Miss))
        .count();
    assert_eq!(misses, 4, "the duplicate request must not compile twice");
    assert!(results[5].as_ref().unwrap_err().is_compile_error());
}

// ---------------------------------------------------------------- two processes

const WORKER_ENV: &str = "CP_HICACHE_JIT_TEST_WORKER_DIR";

/// Worker half of `two_processes_compile_one_entry`; a no-op unless spawned by it.
#[test]
fn worker_compile_shared_entry() {
    let Some(dir) = std::env::var_os(WORKER_ENV) else {
        return;
    };
    let jit = jit_in(Path::new(&dir));
    let k = jit.get(&host_req("add", ADD_SRC)).unwrap();
    assert_eq!(call_add(&so_path(&k), 1, 1), 2);
    println!("\nOUTCOME={}", k.cache_hit);
}

#[test]
fn two_processes_compile_one_entry() {
    let dir = tempfile::tempdir().unwrap();
    let exe = std::env::current_exe().unwrap();
    let spawn = || {
        std::process::Command::new(&exe)
            .args([
                "--exact",
                "worker_compile_shared_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(WORKER_ENV, dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    let children = [spawn(), spawn()];
    let mut outcomes = Vec::new();
    for child in children {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "worker failed: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let outcome = stdout
            .lines()
            .find_map(|l| l.split("OUTCOME=").nth(1))
            .and_then(|rest| rest.split_whitespace().next())
            .unwrap_or_else(|| panic!("no outcome in {stdout}"))
            .to_string();
        outcomes.push(outcome);
    }
    outcomes.sort();
    assert_eq!(
        outcomes,
        ["disk-hit", "miss"],
        "exactly one process compiles"
    );

    let entries: Vec<String> = std::fs::read_dir(dir.path().join("host"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert_eq!(entries.len(), 1, "{entries:?}");
    let entry = dir.path().join("host").join(&entries[0]);
    let mut files: Vec<String> = std::fs::read_dir(&entry)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    files.sort();
    assert_eq!(
        files,
        ["add.cu", "add.so", "manifest.json"],
        "no temp files left"
    );
    assert_eq!(
        jit_in(dir.path())
            .get(&host_req("add", ADD_SRC))
            .unwrap()
            .cache_hit,
        CacheHit::Disk
    );
}

// ---------------------------------------------------------------- NVRTC

/// NVRTC, or `None` after printing one line (a failure under `CP_HICACHE_REQUIRE_NVRTC=1`).
fn nvrtc_or_skip() -> Option<NvrtcCompiler> {
    match NvrtcCompiler::load() {
        Ok(c) => Some(c),
        Err(e) => {
            if std::env::var("CP_HICACHE_REQUIRE_NVRTC").as_deref() == Ok("1") {
                panic!("CP_HICACHE_REQUIRE_NVRTC=1 but: {e}");
            }
            println!("{NOT_FOUND_HINT}");
            None
        }
    }
}

/// A representative page-copy kernel in the shape of the project's transfer family.
const TRANSFER_SRC: &str = r#"
typedef unsigned char u8;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
#define CP 4
#define PAGE_SIZE 64
#define LOG2_PAGE_SIZE 6
#define PAGE_BYTES 41984
#define THREADS 128
#define VEC 16

extern "C" __global__ void transfer_pages_ps64_b41984_t128(
    const u8* __restrict__ src, u8* __restrict__ dst,
    const i64* __restrict__ src_locs, const i64* __restrict__ dst_locs,
    u32 n_pages, u64 src_layer_stride, u64 dst_layer_stride, u32 layers)
{
    __shared__ i64 pages[2];
    u32 page = blockIdx.x;
    if (page >= n_pages) return;
    if (threadIdx.x == 0) {
        pages[0] = src_locs[page * PAGE_SIZE] >> LOG2_PAGE_SIZE;
        pages[1] = dst_locs[page * PAGE_SIZE] >> LOG2_PAGE_SIZE;
    }
    __syncthreads();
    for (u32 l = 0; l < layers; ++l) {
        const uint4* s = (const uint4*)(src + l * src_layer_stride + (u64)pages[0] * PAGE_BYTES);
        uint4* d = (uint4*)(dst + l * dst_layer_stride + (u64)pages[1] * PAGE_BYTES);
        #pragma unroll 4
        for (u32 i = threadIdx.x; i < PAGE_BYTES / VEC; i += THREADS) {
            d[i] = s[i];
        }
    }
}
#ifdef CP_HICACHE_EMU
CP_HICACHE_EMU_EXPORT(transfer_pages_ps64_b41984_t128)
#endif
"#;

fn nvrtc_req(arch: Arch) -> JitRequest {
    JitRequest {
        uri: "transfer_pages_ps64_b41984_t128".into(),
        source: TRANSFER_SRC.into(),
        target: Target::Nvrtc { arch },
    }
}

#[test]
fn nvrtc_compiles_sm90_with_resource_report_and_caches() {
    let t = std::time::Instant::now();
    let Some(nv) = nvrtc_or_skip() else { return };
    let load_ms = t.elapsed().as_secs_f64() * 1e3;
    assert!(nv.version().0 >= 11, "{:?}", nv.version());
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let req = nvrtc_req(Arch::Sm90);

    let cold = jit.get(&req).unwrap();
    assert_eq!(cold.cache_hit, CacheHit::Miss);
    let Artifact::Cubin(cubin) = &cold.artifact else {
        panic!("expected a CUBIN")
    };
    assert_eq!(&cubin[..4], b"\x7fELF", "a CUBIN is an ELF image");
    let report = cold.report.expect("ptxas -v report");
    assert!(report.registers > 0, "{report:?}");
    assert_eq!(report.shared_bytes, 16, "{report:?}");
    assert!(cold.entry_dir.starts_with(dir.path().join("sm_90")));

    let warm = jit_in(dir.path()).get(&req).unwrap();
    assert_eq!(warm.cache_hit, CacheHit::Disk);
    assert_eq!(warm.artifact, cold.artifact);
    assert_eq!(warm.report, cold.report);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(cold.entry_dir.join("manifest.json")).unwrap())
            .unwrap();
    println!(
        "ptxas log:\n{}",
        manifest["extra"]["log"].as_str().unwrap_or("")
    );
    println!(
        "nvrtc {}.{}: library load {load_ms:.1} ms, cold compile {:.1} ms, warm disk hit {:.2} ms, {report:?}",
        nv.version().0,
        nv.version().1,
        cold.compile_ms,
        warm.compile_ms
    );
}

#[test]
fn nvrtc_arch_matrix_has_distinct_keys() {
    let Some(_nv) = nvrtc_or_skip() else { return };
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let reqs: Vec<JitRequest> = [Arch::Sm80, Arch::Sm90, Arch::Sm100]
        .into_iter()
        .map(nvrtc_req)
        .collect();
    let results = jit.warm_up(&reqs);
    let mut keys = std::collections::HashSet::new();
    for r in results {
        let k = r.unwrap();
        assert!(k.report.is_some());
        assert!(keys.insert(k.key.hash));
    }
}

#[test]
fn nvrtc_compile_error_has_uri_and_log() {
    let Some(_nv) = nvrtc_or_skip() else { return };
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let err = jit
        .get(&JitRequest {
            uri: "broken_nvrtc_kernel".into(),
            source: "extern \"C\" __global__ void broken_nvrtc_kernel() { undeclared_name = 1; }"
                .into(),
            target: Target::default(),
        })
        .unwrap_err();
    match &err {
        cp_hicache::jit::JitError::Nvrtc { uri, options, log } => {
            assert_eq!(uri, "broken_nvrtc_kernel");
            assert!(options.iter().any(|o| o == "--gpu-architecture=sm_90"));
            assert!(log.contains("undeclared_name"), "{log}");
        }
        other => panic!("{other:?}"),
    }
    assert!(err.to_string().contains("broken_nvrtc_kernel"));
}

#[test]
fn host_asan_build_goes_to_its_own_entry() {
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path());
    let plain = jit.get(&host_req("add", ADD_SRC)).unwrap();
    let asan = jit
        .get(&JitRequest {
            target: Target::Host {
                sanitize: Sanitize::Address,
            },
            ..host_req("add", ADD_SRC)
        })
        .unwrap();
    assert_ne!(plain.key, asan.key);
    assert!(so_path(&asan).starts_with(dir.path().join("host-asan")));
}

/// A libnvrtc chosen with CP_HICACHE_NVRTC must be the one cudarc uses: when cudarc's own
/// lookup by name would resolve another installation first, NVRTC is refused with a message
/// naming both versions, instead of compiling with one and keying the cache by the other.
#[test]
fn nvrtc_chosen_and_resolved_libraries_must_agree() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("fake.c");
    std::fs::write(
        &src,
        "int nvrtcVersion(int* a, int* b) { *a = MAJ; *b = MIN; return 0; }\n\
         const char* nvrtcGetErrorString(int r) { (void)r; return \"fake\"; }\n",
    )
    .unwrap();
    let build = |sub: &str, file: &str, soname: &str, maj: &str, min: &str| {
        let out = dir.path().join(sub);
        std::fs::create_dir_all(&out).unwrap();
        let status = std::process::Command::new("cc")
            .args([
                "-shared",
                "-fPIC",
                &format!("-DMAJ={maj}"),
                &format!("-DMIN={min}"),
            ])
            .arg(format!("-Wl,-soname,{soname}"))
            .arg(&src)
            .arg("-o")
            .arg(out.join(file))
            .status()
            .unwrap();
        assert!(status.success());
        out
    };
    let chosen = build("a", "libnvrtc.so.12", "libnvrtc.so.12", "12", "9");
    let info = |other: &Path| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
            .arg("info")
            .env("CP_HICACHE_NVRTC", chosen.join("libnvrtc.so.12"))
            .env("LD_LIBRARY_PATH", other)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let other = build("b", "libnvrtc.so", "libnvrtc.so", "11", "5");
    let text = info(&other);
    assert!(
        text.contains("is nvrtc 12.9, but cudarc resolved another libnvrtc (nvrtc 11.5)"),
        "{text}"
    );
    // The same version from another build (other bytes) is refused too: the key would name
    // the chosen file's digest while the other one compiles.
    let rebuilt = build("c", "libnvrtc.so", "libnvrtc.so", "12", "9");
    let text = info(&rebuilt);
    assert!(
        text.contains("cudarc resolved another libnvrtc")
            && text.contains("the same version, another build"),
        "{text}"
    );
    // A byte-identical copy is the same library: no conflict.
    let copy = dir.path().join("d");
    std::fs::create_dir_all(&copy).unwrap();
    std::fs::copy(chosen.join("libnvrtc.so.12"), copy.join("libnvrtc.so")).unwrap();
    let text = info(&copy);
    assert!(!text.contains("cudarc resolved another libnvrtc"), "{text}");
}

/// With `CP_HICACHE_JIT=off` and an empty cache, replay stops with one error that lists every
/// missing kernel of the deployment: no per-kernel log lines repeating it, and no terminal
/// colour codes when stderr is not a terminal.
#[test]
fn jit_off_with_an_empty_cache_lists_every_missing_kernel_once() {
    let cache = tempfile::tempdir().unwrap();
    let out = support::small_replay(
        cache.path(),
        &[("CP_HICACHE_JIT", Some("off")), ("RUST_LOG", None)],
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(!err.contains('\u{1b}'), "colour codes in a pipe: {err}");
    assert_eq!(err.matches("error").count(), 1, "{err}");
    assert!(err.contains("5 of 5 kernels failed"), "{err}");
    assert_eq!(
        err.matches("CP_HICACHE_JIT=off forbids compiling").count(),
        5,
        "{err}"
    );
    // Nothing was written into the cache, not even a lock file or a folder.
    let written: Vec<_> = std::fs::read_dir(cache.path()).unwrap().collect();
    assert!(written.is_empty(), "{written:?}");
}

/// A misspelt `CP_HICACHE_JIT` is an error naming the variable, never a silently compiling run.
#[test]
fn an_unknown_jit_switch_is_refused() {
    let cache = tempfile::tempdir().unwrap();
    let out = support::small_replay(cache.path(), &[("CP_HICACHE_JIT", Some("of"))]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("CP_HICACHE_JIT=\"of\""), "{err}");
    assert!(
        !cache.path().join("host").exists(),
        "compiled despite the error"
    );
}

/// A misspelt emulator setting is a usage error (exit 2) naming the variable.
#[test]
fn misspelt_emulator_settings_are_usage_errors() {
    let cache = tempfile::tempdir().unwrap();
    for (var, value) in [
        ("CP_HICACHE_EMU_ORDER", "sideways"),
        ("CP_HICACHE_EMU_SANITIZE", "adress"),
    ] {
        let out = support::small_replay(cache.path(), &[(var, Some(value))]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{var}: {err}");
        assert!(err.contains(var) && err.contains(value), "{err}");
    }
}
