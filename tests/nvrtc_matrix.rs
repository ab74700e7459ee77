//! The NVRTC matrix CI runs: every kernel of every reference deployment compiles for sm_90 with
//! no register spills and no stack frame; and prebuilt-only deployments (`CP_HICACHE_JIT=off`)
//! load committed CUBINs without NVRTC.
//!
//! Without NVRTC each test prints one line and passes, unless `CP_HICACHE_REQUIRE_NVRTC=1`.

use cp_hicache::exec::Backend;
use cp_hicache::jit::key::{capture_env, stable_digest, CacheKey, KeyInputs, KEY_ENV_ALLOWLIST};
use cp_hicache::jit::nvrtc::NOT_FOUND_HINT;
use cp_hicache::jit::spec_request;
use cp_hicache::jit::{
    deployment_requests, warm_up_deployment, Arch, Artifact, CacheHit, Jit, JitConfig, JitMode,
    JitRequest, NvrtcCompiler, NvrtcOptions, Target,
};
use cp_hicache::kernels::Deployment;
use cp_hicache::tuning::candidate::{candidates_for, Candidate};
use std::path::Path;

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

fn jit_in(dir: &Path, mode: JitMode, nvrtc_enabled: bool) -> Jit {
    let mut c = JitConfig::new(dir);
    c.mode = mode;
    c.nvrtc_enabled = nvrtc_enabled;
    Jit::new(c)
}

const SM90: Target = Target::Nvrtc { arch: Arch::Sm90 };

/// Compiles `requests` for sm_90 in parallel and asserts that each has a resource report
/// with no spills and no stack frame; returns each one's registers per thread.
fn assert_all_compile_without_spills_or_stack(requests: &[JitRequest]) -> Vec<u32> {
    let dir = tempfile::tempdir().unwrap();
    let jit = jit_in(dir.path(), JitMode::On, true);
    let results = jit.warm_up(requests);
    let mut problems = Vec::new();
    for (req, r) in requests.iter().zip(&results) {
        match r {
            Err(e) => problems.push(format!("{}: {e}", req.uri)),
            Ok(k) => match k.report {
                None => problems.push(format!("{}: no ptxas resource report", req.uri)),
                Some(rep) if rep.spill_bytes > 0 || rep.stack_bytes > 0 => problems.push(format!(
                    "{}: {} spill bytes, {} stack bytes",
                    req.uri, rep.spill_bytes, rep.stack_bytes
                )),
                Some(_) => {}
            },
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    results
        .iter()
        .map(|r| {
            r.as_ref()
                .ok()
                .and_then(|k| k.report)
                .map_or(0, |r| r.registers)
        })
        .collect()
}

#[test]
fn every_reference_kernel_compiles_for_sm90_without_spills_or_stack() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    // Unique kernels across all deployments (several are shared, e.g. transfer and verify).
    let mut requests: Vec<JitRequest> = Vec::new();
    let mut transfers: Vec<(String, u32)> = Vec::new();
    let mut push = |req: JitRequest| {
        if !requests.iter().any(|r| r.uri == req.uri) {
            requests.push(req);
        }
    };
    for dep in Deployment::reference() {
        for (spec, req) in deployment_requests(&dep, SM90).unwrap() {
            push(req);
            // `tune`'s stamped twin of each transfer, timed beside the busy kernels.
            if let Some(twin) = spec.stamped() {
                push(spec_request(&twin, SM90, None).unwrap());
                for s in [spec, twin] {
                    transfers.push((s.uri(), s.threads()));
                }
            }
        }
    }
    // The busy kernels `tune` runs beside transfers on a GPU.
    for busy in Deployment::reference()[0].busy_specs() {
        requests.push(spec_request(&busy, SM90, None).unwrap());
    }
    let registers = assert_all_compile_without_spills_or_stack(&requests);
    let regs = |uri: &str| registers[requests.iter().position(|r| r.uri == uri).unwrap()];
    // One transfer block and the busy kernel's blocks fit in an SM's 65,536 registers, as in
    // a model's: the busy grid leaves each SM room for a 512-thread transfer block, so it
    // runs (2,048 - 512) / 256 = 6 blocks of 256 threads per SM (docs/KERNELS.md "busy").
    let busy = (2048 - 512) / 256 * 256 * regs("busy_hbm_t256").max(regs("busy_alu_t256"));
    for (uri, threads) in &transfers {
        let block = regs(uri) * threads;
        assert!(
            block + busy <= 65_536,
            "{uri}: {} registers x {threads} threads leave no room for the busy blocks ({busy})",
            regs(uri)
        );
    }
    println!("{} unique kernels compiled for sm_90", requests.len());
}

/// `tune` on a GPU compiles every candidate shape, streaming stores (`__stcs`) included, so
/// each must be valid CUDA for NVRTC without headers, not only for the CPU emulation.
#[test]
fn every_tuning_candidate_compiles_for_sm90_without_spills_or_stack() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    let mut requests: Vec<JitRequest> = Vec::new();
    for name in ["nsa_ps64_cp8", "mla_ps16_cp8", "gqa8x128_ps16_cp4"] {
        for spec in Deployment::by_name(name).unwrap().specs() {
            for cand in candidates_for(&spec, Backend::Cuda, false) {
                let Candidate::Kernel(k) = cand else { continue };
                let req = spec_request(&k, SM90, None).unwrap();
                if !requests.iter().any(|r| r.uri == req.uri) {
                    requests.push(req);
                }
            }
        }
    }
    // And `tune --sweep`'s shapes (gpu-check's): each buffer alone and both, 128 to 512
    // threads, 1 to 16 blocks.
    let sweep = cp_hicache::tuning::sweep::sweep_specs(
        &Deployment::by_name("nsa_ps64_cp8").unwrap(),
        &cp_hicache::tuning::sweep::SweepOptions::new(true),
    );
    for k in sweep {
        let req = spec_request(&k, SM90, None).unwrap();
        if !requests.iter().any(|r| r.uri == req.uri) {
            requests.push(req);
        }
    }
    assert!(
        requests.iter().any(|r| r.uri.ends_with("_cs")),
        "the candidates include streaming stores"
    );
    let _ = assert_all_compile_without_spills_or_stack(&requests);
    println!(
        "{} unique tuning candidates compiled for sm_90",
        requests.len()
    );
}

#[test]
fn jit_off_without_nvrtc_loads_prebuilt_entries() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
    let built = warm_up_deployment(&jit_in(dir.path(), JitMode::On, true), &dep, SM90).unwrap();

    // No NVRTC, JIT on: nothing can be keyed, a typed "unavailable" error.
    let err = warm_up_deployment(&jit_in(dir.path(), JitMode::On, false), &dep, SM90).unwrap_err();
    assert!(err.to_string().contains(NOT_FOUND_HINT), "{err}");

    // No NVRTC, JIT off: every kernel comes from the committed entries, byte for byte.
    let off = jit_in(dir.path(), JitMode::Off, false);
    let loaded = warm_up_deployment(&off, &dep, SM90).unwrap();
    assert_eq!(loaded.len(), built.len());
    for (a, b) in built.iter().zip(&loaded) {
        assert_eq!(a.uri, b.uri);
        assert_eq!(a.key, b.key);
        assert_eq!(b.cache_hit, CacheHit::Disk);
        assert_eq!(a.report, b.report, "{}", a.uri);
        assert_eq!(a.artifact, b.artifact, "{}", a.uri);
        assert!(matches!(b.artifact, Artifact::Cubin(_)));
    }
    // A second request in the same process is a memory hit.
    let again = warm_up_deployment(&off, &dep, SM90).unwrap();
    assert!(again.iter().all(|k| k.cache_hit == CacheHit::Memory));

    // Another deployment was never built: JIT-off error, not a compile.
    let other = Deployment::by_name("nsa_ps64_cp4").unwrap();
    let err = off
        .get(&deployment_requests(&other, SM90).unwrap()[0].1)
        .unwrap_err();
    assert!(err.is_jit_off(), "{err}");

    // A changed source does not match the committed entry.
    let (_, mut req) = deployment_requests(&dep, SM90).unwrap().remove(0);
    req.source.push_str("\n// changed\n");
    assert!(jit_in(dir.path(), JitMode::Off, false)
        .get(&req)
        .unwrap_err()
        .is_jit_off());
}

/// Two prebuilt entries for the same request (two NVRTC versions) are ambiguous without NVRTC;
/// once one of them fails its integrity check, the other is used.
#[test]
fn jit_off_without_nvrtc_needs_exactly_one_valid_entry() {
    if nvrtc_or_skip().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let dep = Deployment::by_name("nsa_ps64_cp1").unwrap();
    let (_, req) = deployment_requests(&dep, SM90).unwrap().remove(1);
    let first = jit_in(dir.path(), JitMode::On, true).get(&req).unwrap();

    // Forge the entry another NVRTC version would have written.
    let opts = NvrtcOptions::default().with_arch(Arch::Sm90);
    let args = opts.to_args();
    let env = capture_env(KEY_ENV_ALLOWLIST);
    let other = CacheKey::compute(&KeyInputs {
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
    let other_dir = dir.path().join("sm_90").join(&other.readable);
    std::fs::create_dir_all(&other_dir).unwrap();
    for f in std::fs::read_dir(&first.entry_dir).unwrap() {
        let f = f.unwrap();
        std::fs::copy(f.path(), other_dir.join(f.file_name())).unwrap();
    }
    let manifest_path = other_dir.join("manifest.json");
    let mut m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    m["compiler"] = "nvrtc 99.9".into();
    m["key"] = other.hash.clone().into();
    std::fs::write(&manifest_path, serde_json::to_vec(&m).unwrap()).unwrap();

    let err = jit_in(dir.path(), JitMode::Off, false)
        .get(&req)
        .unwrap_err();
    assert!(err.is_jit_off(), "{err}");
    assert!(
        err.to_string().contains("2 prebuilt entries match"),
        "{err}"
    );

    // Corrupt the original: only the forged one passes its integrity check.
    let cubin = first.entry_dir.join(format!("{}.cubin", req.uri));
    let mut bytes = std::fs::read(&cubin).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&cubin, bytes).unwrap();
    let k = jit_in(dir.path(), JitMode::Off, false).get(&req).unwrap();
    assert_eq!(k.key, other);
    assert_eq!(k.entry_dir, other_dir);
}

/// A warm start keys NVRTC entries with the identity remembered in `NVRTC_IDENTITY_FILE`
/// (no NVRTC load); a wrong remembered identity is corrected on the first miss.
#[test]
fn remembered_nvrtc_identity_is_recorded_and_corrected() {
    let Some(nv) = nvrtc_or_skip() else {
        return;
    };
    let Some(lib) = cp_hicache::jit::nvrtc::locate().filter(|p| nv.library() == Some(p.as_path()))
    else {
        // CI names the library by path, so there this must run.
        let why = "NVRTC was not found by path; identity memory not exercised";
        if std::env::var("CP_HICACHE_REQUIRE_NVRTC").as_deref() == Ok("1") {
            panic!("CP_HICACHE_REQUIRE_NVRTC=1 but: {why}");
        }
        println!("{why}");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let dep = Deployment::by_name("mla_ps16_cp4").unwrap();
    let (_, req) = deployment_requests(&dep, SM90).unwrap().remove(0);
    let built = jit_in(dir.path(), JitMode::On, true).get(&req).unwrap();
    let file = dir.path().join(cp_hicache::jit::NVRTC_IDENTITY_FILE);
    let text = std::fs::read_to_string(&file).unwrap();
    assert!(text.contains(&nv.identity()), "{text}");
    assert!(text.contains(&*lib.to_string_lossy()), "{text}");

    // A fresh JIT (JIT off) finds the entry through the remembered identity.
    let k = jit_in(dir.path(), JitMode::Off, true).get(&req).unwrap();
    assert_eq!((k.key, k.cache_hit), (built.key.clone(), CacheHit::Disk));

    // A wrong remembered identity: the miss loads NVRTC, re-keys and finds the real entry.
    std::fs::write(&file, text.replace(&nv.identity(), "nvrtc 0.0")).unwrap();
    for mode in [JitMode::Off, JitMode::On] {
        let k = jit_in(dir.path(), mode, true).get(&req).unwrap();
        assert_eq!((k.key, k.cache_hit), (built.key.clone(), CacheHit::Disk));
    }
    assert_eq!(
        std::fs::read_to_string(&file).unwrap(),
        text,
        "file corrected"
    );
}
