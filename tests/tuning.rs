//! Tuning: the file round trip, entries from another device or compiler ignored with a
//! warning (never misapplied), matching entries applied through the one-call API, and a real
//! quick tuning run on the host executor in which a broken candidate is dropped.
//!
//! The host runs need a C++ compiler; without one they print one line and pass, unless
//! `CP_HICACHE_REQUIRE_HOSTCC=1`.

use cp_hicache::exec::{Backend, HostExecutor, HostOptions};
use cp_hicache::jit::{Jit, JitConfig, SourceHook};
use cp_hicache::kernels::{CopyLaunch, Deployment, KernelSpec, TransferPath, VecWidth};
use cp_hicache::tuning::{
    self, tuner::TuneOptions, CandidateResult, DeviceKey, LaunchChoice, Sizes, TuningEntry,
    TuningError, TuningFile, WarningKind,
};

fn device(name: &str) -> DeviceKey {
    DeviceKey {
        backend: "host".into(),
        device: name.into(),
        capability: "Test CPU".into(),
        compiler: "c++ 12.2.0".into(),
        kernels: cp_hicache::kernels::sources_digest().into(),
    }
}

fn entry(dev: &DeviceKey, spec: &KernelSpec, timings: &[(LaunchChoice, f64)]) -> TuningEntry {
    let best = timings
        .iter()
        .min_by(|a, b| a.1.total_cmp(&b.1))
        .copied()
        .unwrap();
    TuningEntry {
        device: dev.clone(),
        family: spec.family().to_string(),
        spec_key: tuning::spec_key(spec),
        best: best.0,
        best_seconds: best.1,
        workload: "test".into(),
        results: timings
            .iter()
            .map(|&(choice, s)| CandidateResult {
                choice,
                seconds: Some(s),
                gbps: None,
                dropped: None,
                beside_busy: None,
            })
            .collect(),
    }
}

const CPU_COPY: LaunchChoice = LaunchChoice::Copy {
    threads: 1,
    pages_per_block: 16,
    vec_bytes: 16,
    unroll: 1,
    layers_in_block: false,
    streaming_stores: true,
    max_blocks: 0,
};
const GPU_COPY: LaunchChoice = LaunchChoice::Copy {
    threads: 128,
    pages_per_block: 1,
    vec_bytes: 16,
    unroll: 4,
    layers_in_block: false,
    streaming_stores: false,
    max_blocks: 0,
};

/// A file tuned for `dev` in which the CPU shape and 32 allocator threads win.
fn file_for(dev: &DeviceKey, dep: &Deployment) -> TuningFile {
    let mut f = TuningFile::default();
    for spec in tuning::tuner::tuned_specs(dep) {
        let timings: Vec<(LaunchChoice, f64)> = match spec {
            KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => vec![
                (LaunchChoice::Threads { threads: 32 }, 1.0),
                (LaunchChoice::Threads { threads: 256 }, 2.0),
            ],
            _ => vec![(CPU_COPY, 1.0), (GPU_COPY, 4.0), (LaunchChoice::Dma, 0.5)],
        };
        f.upsert(entry(dev, &spec, &timings));
    }
    f
}

#[test]
fn file_round_trips_and_upsert_replaces() {
    let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
    let dev = device("machine-a");
    let mut f = file_for(&dev, &dep);
    let n = f.entries.len();
    assert_eq!(n, tuning::tuner::tuned_specs(&dep).len());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub").join("tuning.json");
    f.save(&path).unwrap();
    let back = TuningFile::load(&path).unwrap();
    assert_eq!(back, f);
    // Same key replaces, another device adds.
    let e = f.entries[0].clone();
    f.upsert(e.clone());
    assert_eq!(f.entries.len(), n);
    let mut other = e;
    other.device = device("machine-b");
    f.upsert(other);
    assert_eq!(f.entries.len(), n + 1);
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("tuning.json")]);
}

#[test]
fn matching_entries_are_applied_with_one_call() {
    let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
    let dev = device("machine-a");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tuning.json");
    file_for(&dev, &dep).save(&path).unwrap();
    let mut tuned = dep.clone();
    let warnings = tuning::apply(&mut tuned, Some(&path), &dev).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(tuned.alloc_threads, 32);
    // DMA is fastest in the file but is not a kernel shape: the best kernel shape wins for
    // materialise, and transfers take the DMA path.
    assert_eq!(tuned.transfer_path, TransferPath::Dma);
    assert_eq!(
        tuned.copy,
        CopyLaunch {
            threads: 1,
            pages_per_block: 16,
            vec: VecWidth::V16,
            unroll: 1,
            layers_in_block: false,
            streaming_stores: true,
            max_blocks: 0,
        }
    );
    assert_eq!(tuned.transfer_copy, tuned.copy);
    assert_eq!(tuned.synth_threads, dep.synth_threads);
    tuned.validate().unwrap();
}

/// Transfers take the capped grid with the fewest blocks whose cost is within 5 % of the
/// cheapest transfer shape (on a GPU `tune` times them beside the busy kernel): here 2
/// blocks, 4 % slower than 4; 1 block is 52 % slower. Materialise keeps the full grid, and
/// a capped shape is never applied to it.
#[test]
fn transfers_take_the_fewest_blocks_that_keep_the_bandwidth() {
    let dep = Deployment::by_name("mla_ps16_cp8").unwrap();
    let dev = device("gpu-like");
    let capped = |max_blocks| LaunchChoice::Copy {
        threads: 512,
        pages_per_block: 1,
        vec_bytes: 16,
        unroll: 8,
        layers_in_block: false,
        streaming_stores: false,
        max_blocks,
    };
    let mut f = TuningFile::default();
    for spec in tuning::tuner::tuned_specs(&dep) {
        let timings = match spec {
            KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => {
                vec![(LaunchChoice::Threads { threads: 32 }, 1.0)]
            }
            KernelSpec::TransferPages(_) => vec![
                (GPU_COPY, 1.0),
                (CPU_COPY, 3.0),
                (capped(1), 1.5),
                (capped(2), 1.03),
                (capped(4), 0.99),
            ],
            _ => vec![(GPU_COPY, 1.0), (CPU_COPY, 3.0)],
        };
        f.upsert(entry(&dev, &spec, &timings));
    }
    let (tuned, warnings, applied) = dep.with_tuning(&f, &dev);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(LaunchChoice::of_copy(&tuned.copy), GPU_COPY);
    assert_eq!(LaunchChoice::of_copy(&tuned.transfer_copy), capped(2));
    assert_eq!(applied.transfer_copy, Some(capped(2)));
    assert_eq!(tuned.transfer_path, TransferPath::Kernel);
    tuned.validate().unwrap();
    for spec in tuned.specs() {
        match spec {
            KernelSpec::TransferPages(t) => assert_eq!(t.launch.max_blocks, 2),
            KernelSpec::Materialise(m) => assert_eq!(m.launch.max_blocks, 0),
            _ => {}
        }
    }
    // A capped shape does not fit materialise.
    let m = tuned.materialise_spec(cp_hicache::kernels::BufferKind::MlaKv);
    assert_eq!(capped(2).apply_to(&m), None);
}

/// DMA takes over transfers only when it was measured for every transfer and its total beats
/// the best kernel shape's over the transfers; otherwise the transfer kernel stays.
#[test]
fn dma_decides_the_transfer_path_when_its_total_over_the_transfers_wins() {
    let dep = Deployment::by_name("mla_ps16_cp8").unwrap();
    let dev = device("gpu-like");
    let with = |dma: &dyn Fn(usize) -> Option<f64>| {
        let mut f = TuningFile::default();
        let mut transfer = 0;
        for spec in tuning::tuner::tuned_specs(&dep) {
            let mut timings = match spec {
                KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => {
                    vec![(LaunchChoice::Threads { threads: 32 }, 1.0)]
                }
                _ => vec![(GPU_COPY, 1.0), (CPU_COPY, 3.0)],
            };
            if let KernelSpec::TransferPages(_) = spec {
                if let Some(t) = dma(transfer) {
                    timings.push((LaunchChoice::Dma, t));
                }
                transfer += 1;
            }
            f.upsert(entry(&dev, &spec, &timings));
        }
        let (tuned, warnings, applied) = dep.with_tuning(&f, &dev);
        assert!(warnings.is_empty(), "{warnings:?}");
        assert_eq!(applied.transfer_path, Some(tuned.transfer_path));
        assert_eq!(tuning::LaunchChoice::of_copy(&tuned.copy), GPU_COPY);
        tuned.transfer_path
    };
    assert_eq!(with(&|_| Some(0.5)), TransferPath::Dma);
    assert_eq!(with(&|_| Some(1.5)), TransferPath::Kernel);
    // Faster on one direction, slower on the other: the totals decide.
    assert_eq!(
        with(&|i| Some(if i == 0 { 0.2 } else { 1.5 })),
        TransferPath::Dma
    );
    assert_eq!(
        with(&|i| Some(if i == 0 { 0.9 } else { 1.5 })),
        TransferPath::Kernel
    );
    // Not measured for one transfer (a host-tuned file has no DMA at all): the kernel.
    assert_eq!(with(&|i| (i == 0).then_some(0.1)), TransferPath::Kernel);
    assert_eq!(with(&|_| None), TransferPath::Kernel);
}

/// When transfers take DMA, the copy shape serves materialise alone and is its best shape,
/// not the compromise that also counted the transfers.
#[test]
fn with_dma_transfers_the_copy_shape_is_materialises_own_best() {
    let dep = Deployment::by_name("mla_ps16_cp8").unwrap();
    let dev = device("gpu-like");
    let file = |dma: f64| {
        let mut f = TuningFile::default();
        for spec in tuning::tuner::tuned_specs(&dep) {
            let timings = match spec {
                KernelSpec::SelectOwnerPages(_) | KernelSpec::ReleasePages(_) => {
                    vec![(LaunchChoice::Threads { threads: 32 }, 1.0)]
                }
                // Summed with the transfers, GPU_COPY wins (1 + 1 + 2 < 3 + 3 + 1.5).
                KernelSpec::TransferPages(_) => {
                    vec![(GPU_COPY, 1.0), (CPU_COPY, 3.0), (LaunchChoice::Dma, dma)]
                }
                _ => vec![(GPU_COPY, 2.0), (CPU_COPY, 1.5)],
            };
            f.upsert(entry(&dev, &spec, &timings));
        }
        f
    };
    let shape = |d: &Deployment| LaunchChoice::of_copy(&d.copy);
    let (tuned, warnings, _) = dep.with_tuning(&file(0.5), &dev);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(tuned.transfer_path, TransferPath::Dma);
    assert_eq!(shape(&tuned), CPU_COPY);
    let (tuned, _, _) = dep.with_tuning(&file(1.5), &dev);
    assert_eq!(tuned.transfer_path, TransferPath::Kernel);
    assert_eq!(shape(&tuned), GPU_COPY);
}

#[test]
fn a_file_from_another_machine_is_ignored_with_a_warning() {
    let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
    let file = file_for(&device("machine-a"), &dep);
    let here = device("machine-b");
    let (out, warnings, applied) = dep.with_tuning(&file, &here);
    assert_eq!(out, dep, "nothing may be applied");
    assert_eq!(applied, tuning::Applied::default());
    assert_eq!(warnings.len(), file.entries.len());
    assert!(warnings.iter().all(|w| w.kind == WarningKind::Foreign));
    let msg = warnings[0].to_string();
    assert!(
        msg.contains("machine-a") && msg.contains("machine-b"),
        "{msg}"
    );
    assert!(msg.contains("foreign: another device or CPU"), "{msg}");
    // Shown to a person as one line that counts them.
    let lines = tuning::warning_lines(&warnings);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains(&format!("and {} more kernels ignored", warnings.len() - 1))
            && lines[0].contains("machine-a"),
        "{lines:?}"
    );

    // Same machine, upgraded compiler: stale, also ignored.
    let mut upgraded = device("machine-a");
    upgraded.compiler = "c++ 13.1.0".into();
    let mut d = dep.clone();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    file.save(&path).unwrap();
    let warnings = tuning::apply(&mut d, Some(&path), &upgraded).unwrap();
    assert_eq!(d, dep);
    assert!(!warnings.is_empty());
    assert!(warnings.iter().all(|w| w.kind == WarningKind::Stale));
    // The two kinds read differently, so nobody has to diff the two device strings.
    assert!(warnings[0]
        .to_string()
        .contains("stale: this device, another compiler"));

    // Same machine and compiler, measured by a build with other kernel sources (or by one
    // that recorded none): stale too, and the warning says to tune again.
    for kernels in ["0123456789ab", ""] {
        let mut other = file.clone();
        for e in &mut other.entries {
            e.device.kernels = kernels.into();
        }
        let (d, warnings, _) = dep.with_tuning(&other, &device("machine-a"));
        assert_eq!(d, dep, "{kernels:?}");
        assert!(!warnings.is_empty());
        assert!(warnings.iter().all(|w| w.kind == WarningKind::Stale));
        let msg = warnings[0].to_string();
        assert!(
            msg.contains("other kernel sources") && msg.contains("cp-hicache tune"),
            "{msg}"
        );
    }
}

#[test]
fn entries_for_other_kernels_do_not_leak_into_a_deployment() {
    // Tuned for NSA page 64 CP 8; MLA page 64 CP 4 shares no kernel and keeps its defaults.
    let dev = device("machine-a");
    let file = file_for(&dev, &Deployment::by_name("nsa_ps64_cp8").unwrap());
    let mla = Deployment::by_name("mla_ps64_cp4").unwrap();
    let (out, warnings, _) = mla.with_tuning(&file, &dev);
    assert_eq!(out, mla);
    assert!(warnings.is_empty());
    // Transfers and verify do not depend on CP, so their entries match NSA at CP 4; but the
    // copy shape is shared with materialise at CP 4, and the synth/verify threads with
    // synthesise at CP 4, which were never tuned: they would run untimed and unchecked, so
    // the defaults stay, with a warning naming what is missing. The allocator kernels depend
    // on CP and keep their default without a word.
    let nsa4 = Deployment::by_name("nsa_ps64_cp4").unwrap();
    let (out, warnings, applied) = nsa4.with_tuning(&file, &dev);
    assert_eq!(out, nsa4);
    assert_eq!(applied, tuning::Applied::default());
    assert_eq!(warnings.len(), 2, "{warnings:?}");
    assert!(warnings.iter().all(|w| w.kind == WarningKind::Unusable));
    for (w, missing) in warnings
        .iter()
        .zip(["materialise_cp4", "synthesise_nsa_kv_cp4"])
    {
        let msg = w.to_string();
        assert!(
            msg.contains(missing) && msg.contains("tune --deployment nsa_ps64_cp4"),
            "{msg}"
        );
    }
    // Tuned for CP 4 as well, every kernel sharing the shape is covered and it applies.
    let mut both = file.clone();
    for e in file_for(&dev, &nsa4).entries {
        both.upsert(e);
    }
    let (_, warnings, applied) = nsa4.with_tuning(&both, &dev);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(applied.copy, Some(CPU_COPY));
}

#[test]
fn bad_files_are_errors_not_guesses() {
    let dir = tempfile::tempdir().unwrap();
    let mut dep = Deployment::by_name("mla_ps16_cp4").unwrap();
    let dev = device("m");
    let missing = dir.path().join("missing.json");
    let err = tuning::apply(&mut dep, Some(&missing), &dev).unwrap_err();
    assert!(matches!(err, TuningError::Read { .. }), "{err}");
    assert!(err.is_usage(), "{err}");
    assert!(
        err.to_string()
            .starts_with(&format!("cannot read tuning file {}", missing.display())),
        "{err}"
    );
    let err = tuning::apply(&mut dep, Some(dir.path()), &dev).unwrap_err();
    assert!(
        matches!(err, TuningError::Read { .. }) && err.is_usage(),
        "{err}"
    );
    let future = dir.path().join("future.json");
    std::fs::write(&future, r#"{"format": 99, "entries": []}"#).unwrap();
    let err = tuning::apply(&mut dep, Some(&future), &dev).unwrap_err();
    assert!(
        matches!(err, TuningError::Format { found: 99, .. }) && err.is_usage(),
        "{err}"
    );
    let garbage = dir.path().join("garbage.json");
    std::fs::write(&garbage, "not json").unwrap();
    assert!(matches!(
        TuningFile::load(&garbage),
        Err(TuningError::Parse { .. })
    ));
}

/// Says why a host run is skipped, or fails under `CP_HICACHE_REQUIRE_HOSTCC=1` (CI has a
/// compiler, so a skip there would be a silent pass).
fn skip_without_compiler(e: &dyn std::fmt::Display) {
    if std::env::var("CP_HICACHE_REQUIRE_HOSTCC").as_deref() == Ok("1") {
        panic!("CP_HICACHE_REQUIRE_HOSTCC=1 but: no host C++ compiler: {e}");
    }
    eprintln!("skipping: no host C++ compiler: {e}");
}

/// A quick tune of `mla_ps16_cp8` on the host executor (small sizes, one repeat) with
/// candidate sources edited by `hook`; `None` (after saying so) without a C++ compiler.
fn quick_host_tune(hook: SourceHook<'_>) -> Option<(Deployment, DeviceKey, Vec<TuningEntry>)> {
    let (dep, tuned) = quick_host_tune_all(hook)?;
    assert!(tuned.failed.is_empty(), "{:?}", tuned.failed);
    Some((dep, tuned.device, tuned.entries))
}

/// [`quick_host_tune`], with the kernels that could not be tuned.
fn quick_host_tune_all(hook: SourceHook<'_>) -> Option<(Deployment, tuning::Tuned)> {
    let cache = tempfile::tempdir().unwrap();
    let jit = Jit::new(JitConfig::new(cache.path()));
    if let Err(e) = jit.host_compiler() {
        skip_without_compiler(&e);
        return None;
    }
    let exec = HostExecutor::new(HostOptions::default());
    let dep = Deployment::by_name("mla_ps16_cp8").unwrap();
    let mut opts = TuneOptions::new(true);
    opts.sizes = Sizes {
        pages: 24,
        layers: 2,
        warmup: 0,
        repeats: 1,
    };
    opts.alloc_pages = 96;
    // SAFETY: the hooks of these tests break a compile (`#error`) or stop a page loop one
    // page early; none makes a kernel index further than its render does.
    let opts = unsafe { opts.with_source_hook(hook) };
    let tuned = tuning::tune(&dep, &exec, &jit, &opts, &|_| {}).unwrap();
    Some((dep, tuned))
}

/// A token-interleaved deployment (by its `_ti` name) tunes on the host: its synthesise and
/// verify candidates are checked against the references in their own token order, and their
/// entries have keys of their own, apart from the paged kernels'.
#[test]
fn a_token_interleaved_deployment_tunes_under_keys_of_its_own() {
    let cache = tempfile::tempdir().unwrap();
    let jit = Jit::new(JitConfig::new(cache.path()));
    if let Err(e) = jit.host_compiler() {
        skip_without_compiler(&e);
        return;
    }
    let exec = HostExecutor::new(HostOptions::default());
    let dep = cp_hicache::tuning::bench::deployment_by_name("mla_ps16_cp4_ti2").unwrap();
    assert_eq!(dep.name, "mla_ps16_cp4_ti2");
    let mut opts = TuneOptions::new(true);
    opts.sizes = Sizes {
        pages: 8,
        layers: 1,
        warmup: 0,
        repeats: 1,
    };
    opts.alloc_pages = 32;
    let tuned = tuning::tune(&dep, &exec, &jit, &opts, &|_| {}).unwrap();
    assert!(tuned.failed.is_empty(), "{:?}", tuned.failed);
    let keys: Vec<&str> = tuned.entries.iter().map(|e| e.spec_key.as_str()).collect();
    for key in [
        "synthesise_mla_kv_cp4_ps16_ti2",
        "verify_mla_kv_ps16_cp4ti2",
    ] {
        assert!(keys.contains(&key), "{key} in {keys:?}");
    }
}

/// A kernel none of whose candidates compiles is reported, and the other kernels keep their
/// winners (they used to be lost with it).
#[test]
fn a_kernel_without_a_usable_candidate_does_not_lose_the_others() {
    let hook = |spec: &KernelSpec, src: String| -> String {
        if spec.family().to_string() == "release_pages" {
            format!("#error injected broken kernel\n{src}")
        } else {
            src
        }
    };
    let Some((dep, tuned)) = quick_host_tune_all(&hook) else {
        return;
    };
    assert_eq!(tuned.failed.len(), 1, "{:?}", tuned.failed);
    let err = tuned.failed[0].to_string();
    assert!(
        err.starts_with("release_pages_cp8: no candidate could be timed"),
        "{err}"
    );
    assert_eq!(
        tuned.entries.len(),
        tuning::tuner::tuned_specs(&dep).len() - 1
    );
    assert!(tuned.entries.iter().all(|e| e.family != "release_pages"));
}

#[test]
fn quick_tune_on_the_host_drops_a_broken_candidate() {
    // Break every copy candidate of the CPU_COPY shape (not its layers-in-block twin).
    let hook = |spec: &KernelSpec, src: String| -> String {
        if spec.uri().ends_with("_t1_ppb16_v16_u1_cs") {
            format!("#error injected broken candidate\n{src}")
        } else {
            src
        }
    };
    let Some((dep, key, entries)) = quick_host_tune(&hook) else {
        return;
    };
    assert_eq!(key.backend, Backend::Host.to_string());
    assert_eq!(entries.len(), tuning::tuner::tuned_specs(&dep).len());
    // Each entry records the workload it ran: synthesise and verify run a few pages only.
    for e in &entries {
        let want = match e.family.as_str() {
            "synthesise" | "verify" => "pages=8 layers=2",
            "select_owner_pages" | "release_pages" => "requests=96",
            _ => "pages=24 layers=2",
        };
        assert!(
            e.workload.starts_with(want),
            "{}: {}",
            e.spec_key,
            e.workload
        );
    }
    let mut saw_broken = false;
    for e in &entries {
        assert!(e.best_seconds > 0.0);
        for r in &e.results {
            if r.choice == CPU_COPY {
                saw_broken = true;
                let why = r.dropped.as_deref().unwrap_or("");
                assert!(
                    r.seconds.is_none(),
                    "{}: broken candidate timed",
                    e.spec_key
                );
                assert!(why.contains("injected") || why.contains("error"), "{why}");
                assert_ne!(e.best, CPU_COPY);
            } else {
                assert!(
                    r.seconds.is_some(),
                    "{} {}: {:?}",
                    e.spec_key,
                    r.choice,
                    r.dropped
                );
            }
        }
    }
    assert!(saw_broken);
    // The results apply to the same device, and the broken shape is never chosen.
    let mut file = TuningFile::default();
    entries.into_iter().for_each(|e| file.upsert(e));
    let (tuned, warnings, applied) = dep.with_tuning(&file, &key);
    assert!(warnings.is_empty(), "{warnings:?}");
    assert!(applied.copy.is_some() && applied.alloc_threads.is_some());
    assert_ne!(applied.copy, Some(CPU_COPY));
    tuned.validate().unwrap();
}

// A candidate that compiles and runs but skips the last page of every group (fast and
// wrong) is checked against the reference before it is timed, dropped with the difference,
// and never chosen.
#[test]
fn quick_tune_drops_a_candidate_with_wrong_output() {
    let hook = |spec: &KernelSpec, src: String| -> String {
        if spec.uri().contains("_t1_ppb16_") {
            let bound = "? PAGES_PER_BLOCK : n - first;";
            assert!(src.contains(bound), "{spec}: no page bound to break");
            // One page fewer per group (np >= 1, so no wrap): the last one is skipped.
            src.replace(bound, "? PAGES_PER_BLOCK - 1u : n - first - 1u;")
        } else {
            src
        }
    };
    let Some((_, tuned)) = quick_host_tune_all(&hook) else {
        return;
    };
    assert!(tuned.failed.is_empty(), "{:?}", tuned.failed);
    let entries = tuned.entries;
    let mut dropped = 0;
    for e in &entries {
        for r in e.results.iter().filter(|r| r.choice == CPU_COPY) {
            dropped += 1;
            let why = r.dropped.as_deref().unwrap_or("(timed)");
            assert!(
                why.starts_with("output differs from the reference: first difference at byte"),
                "{}: {why}",
                e.spec_key
            );
            assert!(r.seconds.is_none());
            assert_ne!(e.best, CPU_COPY, "{}", e.spec_key);
        }
    }
    assert!(
        dropped >= 3,
        "transfers and materialise have the broken candidate"
    );
    // Each broken shape (this one, and its layers-in-block twin) is reported as a kernel bug
    // (the CLI fails the run on them), named by kernel and shape; no other shape is.
    assert!(
        tuned.wrong_output.len() >= dropped,
        "{:?}",
        tuned.wrong_output
    );
    for w in &tuned.wrong_output {
        assert!(
            w.contains(" t1_ppb16_") && w.contains(": first difference at byte"),
            "{w}"
        );
    }
}

/// The warm-up API picks the tuning file up: the kernels it compiles have the tuned shapes on
/// this machine's device key, and the default shapes (with a warning) for another machine's.
#[test]
fn warm_up_compiles_the_tuned_kernels() {
    let jit = Jit::new(JitConfig::new(concat!(
        env!("CARGO_TARGET_TMPDIR"),
        "/jit-cache"
    )));
    if let Err(e) = jit.host_compiler() {
        skip_without_compiler(&e);
        return;
    }
    let exec = HostExecutor::new(HostOptions::default());
    let dep = Deployment::by_name("mla_ps16_cp8").unwrap();
    let here = DeviceKey::for_executor(&exec, &jit).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tuning.json");
    file_for(&here, &dep).save(&path).unwrap();
    let start = tuning::warm_up_tuned(&jit, &exec, &dep, Some(&path)).unwrap();
    assert!(start.warnings.is_empty(), "{:?}", start.warnings);
    assert_eq!(start.deployment.alloc_threads, 32);
    let uris: Vec<String> = start.kernels.iter().map(|k| k.uri.clone()).collect();
    let want: Vec<String> = start.deployment.specs().iter().map(|s| s.uri()).collect();
    assert_eq!(uris, want);
    assert!(
        uris.iter()
            .any(|u| u.starts_with("transfer_pages") && u.ends_with("_t1_ppb16_v16_u1_cs")),
        "{uris:?}"
    );
    assert!(
        uris.iter()
            .any(|u| u.starts_with("select_owner_pages") && u.ends_with("_t32")),
        "{uris:?}"
    );
    // Another machine's file: ignored with a warning, the default shapes are compiled.
    file_for(&device("machine-b"), &dep).save(&path).unwrap();
    let start = tuning::warm_up_tuned(&jit, &exec, &dep, Some(&path)).unwrap();
    assert!(!start.warnings.is_empty());
    assert_eq!(start.deployment, dep);
    assert_eq!(start.kernels.len(), dep.specs().len());
}

/// The DMA path exists for transfers only: timing it on a materialise workload is a typed
/// error, and on a transfer workload it moves the bench's bytes.
#[test]
fn dma_timing_is_for_transfers_only() {
    use cp_hicache::exec::{ExecError, Executor};
    use cp_hicache::kernels::{BufferKind, Direction};
    use cp_hicache::tuning::measure::CopyBench;
    let exec = HostExecutor::new(HostOptions::default());
    let dep = Deployment::by_name("mla_ps16_cp4").unwrap();
    let sizes = Sizes {
        pages: 8,
        layers: 2,
        warmup: 0,
        repeats: 1,
    };
    let (m, _) =
        CopyBench::new(&exec, &dep.materialise_spec(BufferKind::MlaKv), &sizes, 1).unwrap();
    assert!(matches!(m.copy_dma(), Err(ExecError::Config { .. })));
    assert!(m.time_dma(&sizes).is_err());
    let t = dep.transfer_spec(Direction::HostToDevice);
    let (b, _) = CopyBench::new(&exec, &t, &sizes, 1).unwrap();
    let before = exec.counters();
    assert!(b.time_dma(&sizes).unwrap().median > 0.0);
    let c = exec.counters().since(&before);
    // One warm-up and one timed repeat, each moving every page of every layer.
    assert_eq!(c.copies, 2);
    assert_eq!(c.bytes_copied, 2 * b.bytes());
}

/// The busy kernels `tune` runs beside transfers on a GPU (ALU and HBM) compute exactly the
/// reference's words on the host executor and stamp their block start and end (their own
/// check, as `bench --check` runs for any kernel), in both block orders, and the host
/// executor has no companion stream, so a host tune times transfers alone.
#[test]
fn the_busy_kernels_run_on_the_host_executor_and_match_their_reference() {
    let Some(jit) = host_jit() else { return };
    let busy = Deployment::by_name("nsa_ps64_cp8").unwrap().busy_specs();
    assert_eq!(busy.map(|s| s.uri()), ["busy_alu_t256", "busy_hbm_t256"]);
    for order in [
        cp_hicache::exec::BlockOrder::Forward,
        cp_hicache::exec::BlockOrder::Reverse,
    ] {
        let exec = HostExecutor::new(HostOptions {
            block_order: order,
            ..HostOptions::default()
        });
        // SAFETY: no hook.
        let rows = unsafe { tuning::check::check_specs_with(&exec, &jit, &busy, None) }.unwrap();
        assert_eq!(rows.len(), 2);
        for row in &rows {
            assert!(row.ok, "{order:?} {}: {}", row.kernel, row.detail);
            assert!(row.detail.contains("4004 bytes equal"), "{}", row.detail);
        }
        use cp_hicache::exec::Executor;
        assert!(exec.companion().unwrap().is_none());
    }
    let words = cp_hicache::kernels::reference::busy(3, 2, 7);
    assert_eq!(words.len(), 3);
    assert_ne!(words[0], words[1]);
}

/// The JIT of the host tests; `None` (after saying so) without a C++ compiler.
fn host_jit() -> Option<Jit> {
    let jit = Jit::new(JitConfig::new(concat!(
        env!("CARGO_TARGET_TMPDIR"),
        "/jit-cache"
    )));
    match jit.host_compiler() {
        Ok(_) => Some(jit),
        Err(e) => {
            skip_without_compiler(&e);
            None
        }
    }
}

/// Each busy kernel runs as a companion on a second host executor (another OS thread, as a
/// second stream on a GPU) and is timed beside work on the first: the work's time, the busy
/// kernel's slowdown and its stamps against the marker's come back sane. The work's first
/// run is enqueued before the busy kernel; on the host that run has finished by then, so the
/// busy kernel starts after the work (a positive lag). Whether the two overlap is not
/// asserted: the host has two cores shared with other builds.
#[test]
fn the_busy_companions_run_and_are_timed_beside_work_on_the_host_executor() {
    use cp_hicache::exec::{Executor, MemKind};
    use cp_hicache::kernels::{BusyKind, BusySpec};
    use cp_hicache::tuning::measure::{Beside, CompanionShape};
    let Some(jit) = host_jit() else { return };
    let exec = HostExecutor::new(HostOptions::default());
    const BYTES: u64 = 1 << 20;
    let buf = exec.alloc(MemKind::Device, BYTES as usize, 0).unwrap();
    // 1 MiB of HBM words: small enough for a fast test.
    let shape = CompanionShape {
        grid: 4,
        hbm_words: 1 << 18,
    };
    for kind in [BusyKind::Alu, BusyKind::Hbm] {
        let comp = Box::new(HostExecutor::new(HostOptions::default()));
        let b = Beside::with_companion(&exec, comp, &jit, BusySpec::of(kind), shape).unwrap();
        assert_eq!(b.kind(), kind);
        let t = b
            .time_beside(1e-3, 3, &|| exec.fill(buf, &[(0, BYTES)], 7), None)
            .unwrap();
        assert!(t.seconds > 0.0 && t.seconds.is_finite(), "{kind}: {t:?}");
        assert!(
            t.busy_slowdown > 0.0 && t.busy_slowdown.is_finite(),
            "{kind}: {t:?}"
        );
        assert!(t.overlap.start_lag_ns > 0, "{kind}: {t:?}");
        assert!(
            t.overlap.start_lag_ns < 60_000_000_000,
            "{kind}: stamps a minute apart: {t:?}"
        );
        assert!((0.0..=1.0).contains(&t.overlap.covered), "{kind}: {t:?}");
    }
    exec.free(buf).unwrap();
}

/// Workload of the transfers timed beside the companions on the host: small, for fast tests.
const BESIDE_SIZES: Sizes = Sizes {
    pages: 8,
    layers: 2,
    warmup: 0,
    repeats: 2,
};

/// Both busy companions, each on a host executor of its own (another OS thread, as a second
/// stream on a GPU), on small buffers.
fn host_companions<'e>(
    exec: &'e HostExecutor,
    jit: &Jit,
) -> cp_hicache::tuning::tuner::Companions<'e> {
    use cp_hicache::kernels::{BusyKind, BusySpec};
    use cp_hicache::tuning::measure::{Beside, CompanionShape};
    let shape = CompanionShape {
        grid: 2,
        hbm_words: 1 << 16,
    };
    let open = |kind| {
        let comp = Box::new(HostExecutor::new(HostOptions::default()));
        Some(Beside::with_companion(exec, comp, jit, BusySpec::of(kind), shape).unwrap())
    };
    cp_hicache::tuning::tuner::Companions {
        alu: open(BusyKind::Alu),
        hbm: open(BusyKind::Hbm),
    }
}

/// A DMA candidate timed beside both companions on the host records what tune's table
/// prints: the time beside the ALU kernel as the candidate's, the one alone, the HBM
/// kernel's time and both slowdowns and overlaps.
#[test]
fn a_transfer_timed_beside_both_companions_records_each() {
    use cp_hicache::exec::DmaMode;
    use cp_hicache::kernels::Direction;
    use cp_hicache::tuning::measure::CopyBench;
    use cp_hicache::tuning::tuner::time_dma_candidate;
    let Some(jit) = host_jit() else { return };
    let exec = HostExecutor::new(HostOptions::default());
    let companions = host_companions(&exec, &jit);
    let sizes = BESIDE_SIZES;
    let spec = Deployment::by_name("nsa_ps64_cp8")
        .unwrap()
        .transfer_spec(Direction::HostToDevice);
    let (bench, _) = CopyBench::new(&exec, &spec, &sizes, 3).unwrap();
    let r = time_dma_candidate(
        &exec,
        &spec,
        &bench,
        &companions,
        &sizes,
        3,
        DmaMode::PerRegion,
    );
    assert!(r.dropped.is_none(), "{:?}", r.dropped);
    let b = r.beside_busy.expect("timed beside the companions");
    let hbm = b.hbm.expect("and beside the HBM one");
    assert!(b.alone_seconds > 0.0 && hbm.seconds > 0.0, "{b:?}");
    assert!(b.busy_slowdown > 0.0 && hbm.slowdown > 0.0, "{b:?}");
    assert!(b.alu_overlap.unwrap().start_lag_ns > 0, "{b:?}");
    assert!(hbm.overlap.start_lag_ns > 0, "{b:?}");
    // The file keeps them, and an older file without them still reads.
    let json = serde_json::to_string(&r).unwrap();
    // (serde_json may read a float back one ulp off: the integers compare exactly.)
    let back = serde_json::from_str::<CandidateResult>(&json)
        .unwrap()
        .beside_busy
        .unwrap();
    assert_eq!(
        back.alu_overlap.map(|o| o.start_lag_ns),
        b.alu_overlap.map(|o| o.start_lag_ns)
    );
    assert_eq!(
        back.hbm.map(|h| h.overlap.start_lag_ns),
        Some(hbm.overlap.start_lag_ns)
    );
    assert!((back.hbm.unwrap().slowdown / hbm.slowdown - 1.0).abs() < 1e-12);
    let mut old = serde_json::to_value(&r).unwrap();
    old["beside_busy"] = serde_json::json!({"alone_seconds": 0.5, "busy_slowdown": 1.01});
    let old: CandidateResult = serde_json::from_value(old).unwrap();
    let b = old.beside_busy.unwrap();
    assert_eq!((b.alu_overlap, b.hbm), (None, None));
}

/// A transfer kernel timed beside both companions runs its first run as its stamped twin,
/// so where it ran comes from its own blocks: on the host that run has finished before the
/// busy kernel is launched, so every transfer block started before the busy kernel's first
/// (a positive resident lead, no later than the start lag, since the first block start
/// comes no later than the last). The twin copies what the kernel copies (the stamped render
/// only adds the stamps), and the file keeps the lead.
#[test]
fn a_transfer_kernel_timed_beside_the_companions_stamps_its_own_blocks() {
    use cp_hicache::kernels::Direction;
    use cp_hicache::tuning::measure::{compile_and_load, CopyBench};
    let Some(jit) = host_jit() else { return };
    let exec = HostExecutor::new(HostOptions::default());
    let companions = host_companions(&exec, &jit);
    assert!(companions.present());
    let sizes = BESIDE_SIZES;
    for direction in [Direction::HostToDevice, Direction::DeviceToHost] {
        let spec = Deployment::by_name("nsa_ps64_cp8")
            .unwrap()
            .transfer_spec(direction);
        let twin = spec.stamped().expect("a transfer has a stamped twin");
        assert_eq!(twin.uri(), format!("{}_stamped", spec.uri()));
        // SAFETY: no hook: the rendered sources.
        let kernels = unsafe { compile_and_load(&exec, &jit, &[spec, twin], true, None, &|| {}) };
        let (kernel, twin_kernel) = (*kernels[0].as_ref().unwrap(), *kernels[1].as_ref().unwrap());
        let (bench, _) = CopyBench::new(&exec, &spec, &sizes, 5).unwrap();
        let both = companions
            .time_transfer(
                &bench,
                (&spec, kernel),
                Some((twin, twin_kernel)),
                1e-3,
                sizes.repeats,
            )
            .unwrap()
            .expect("timed beside the companions");
        for (name, o) in [
            ("alu", both.alu.overlap),
            ("hbm", both.hbm.unwrap().overlap),
        ] {
            let lead = o.resident_lead_ns.expect("the stamped twin's own stamps");
            assert!(lead > 0, "{direction} {name}: {o:?}");
            assert!(o.start_lag_ns >= lead, "{direction} {name}: {o:?}");
            assert!(o.start_lag_ns < 60_000_000_000, "{direction} {name}: {o:?}");
            assert!(
                (0.0..=1.0).contains(&o.covered),
                "{direction} {name}: {o:?}"
            );
        }
        // Without the twin the marker stamps the start, and there is no lead.
        let marked = companions
            .time_transfer(&bench, (&spec, kernel), None, 1e-3, sizes.repeats)
            .unwrap()
            .unwrap();
        assert_eq!(marked.alu.overlap.resident_lead_ns, None);
        assert!(marked.alu.overlap.start_lag_ns > 0);
        // The file keeps the lead.
        let mut r = CandidateResult {
            choice: cp_hicache::tuning::LaunchChoice::of_spec(&spec),
            seconds: None,
            gbps: None,
            dropped: None,
            beside_busy: None,
        };
        r.beside_busy = Some(cp_hicache::tuning::BesideBusy {
            alone_seconds: 1e-3,
            busy_slowdown: both.alu.busy_slowdown,
            alu_overlap: Some(both.alu.overlap),
            hbm: None,
        });
        let back: CandidateResult =
            serde_json::from_str(&serde_json::to_string(&r).unwrap()).unwrap();
        assert_eq!(
            back.beside_busy
                .unwrap()
                .alu_overlap
                .unwrap()
                .resident_lead_ns,
            both.alu.overlap.resident_lead_ns
        );
    }
}
