//! AddressSanitizer builds of the kernels (`Target::Host { sanitize: Address }`): transfer and
//! materialise on small inputs match the reference with no ASan report, every family stays
//! inside buffers of exactly its signature's reach, and an out-of-bounds page really is
//! reported.
//!
//! Skipped unless `CP_HICACHE_EMU_SANITIZE=address`:
//!
//! ```sh
//! CP_HICACHE_EMU_SANITIZE=address cargo test --test kernel_asan
//! ```
//!
//! Instrumented libraries need the ASan runtime loaded first. When it is not, each test
//! compiles the kernels in-process, then re-runs itself in a child with
//! `LD_PRELOAD=$(c++ -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0`. (Preloading
//! it into `cargo test` itself also works, but only when nothing needs rebuilding: rustc
//! crashes under the preload.)

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

use cp_hicache::exec::host::SANITIZE_ENV;
use cp_hicache::exec::BlockOrder;
use cp_hicache::jit::Sanitize;
use cp_hicache::kernels::{
    AllocSpec, BufferKind, CopyLaunch, Direction, HostLayout, KernelSpec, MaterialiseSpec,
    ReleaseSpec, SelectOutput, SynthSpec, TransferSpec, VecWidth, VerifySpec,
};
use support::{cpu_copy_launch, Bench, MaterialiseCase, Rng, TransferCase, Twist, ORDERS};

const CHILD_ENV: &str = "CP_HICACHE_ASAN_OOB_CHILD";
/// Set in a child this target re-executed under the ASan runtime.
const REEXEC_ENV: &str = "CP_HICACHE_ASAN_REEXEC";
const COMMAND: &str = "CP_HICACHE_EMU_SANITIZE=address cargo test --test kernel_asan";

fn asan_loaded() -> bool {
    std::fs::read_to_string("/proc/self/maps").is_ok_and(|m| m.contains("libasan"))
}

fn libasan() -> PathBuf {
    let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .arg("-print-file-name=libasan.so")
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run c++ -print-file-name=libasan.so");
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    assert!(
        p.is_absolute() && p.exists(),
        "libasan.so not found by `c++ -print-file-name=libasan.so` (got {p:?})"
    );
    p
}

/// Whether test `name` should run its body in this process. Skips (one line) unless
/// `CP_HICACHE_EMU_SANITIZE=address`. Without the ASan runtime loaded, it compiles the
/// kernels here (the compiler must not run under the preload), re-runs just this test in a
/// child with `LD_PRELOAD=libasan.so`, asserts the child passed, and returns false.
fn run_here(name: &str) -> bool {
    let on = std::env::var(SANITIZE_ENV).is_ok_and(|v| matches!(v.trim(), "address" | "asan"));
    if !on {
        eprintln!("skipped: ASan kernel tests run with `{COMMAND}`");
        return false;
    }
    if asan_loaded() {
        return true;
    }
    assert!(
        std::env::var_os(REEXEC_ENV).is_none(),
        "re-executed child still lacks the ASan runtime"
    );
    libs();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env("LD_PRELOAD", libasan())
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .env(REEXEC_ENV, "1")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name} under ASan failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    false
}

/// The default GPU shape and the CPU shape, with the widest vector the page allows.
fn launches(page_bytes: u64) -> [CopyLaunch; 2] {
    let vec = VecWidth::widest_for(page_bytes);
    [
        CopyLaunch {
            vec,
            ..CopyLaunch::default()
        },
        cpu_copy_launch(vec),
    ]
}

/// (page size, bytes per token, a second buffer's bytes per token for the transfers) of the
/// cases: mla at 16 (v16) and an odd size at 1 (v1), moved with an `index_k`-sized buffer in
/// one launch.
const SHAPES: [(u32, u32, Option<u32>); 2] = [(16, 1152, None), (1, 33, Some(132))];
const MAT_CP: u8 = 4;

/// The copy kernels of one page shape and launch: d2h page-first, h2d layer-first (moving a
/// second buffer of `second` bytes per token too, if given) and materialise at [`MAT_CP`].
fn copy_family(
    page_size: u32,
    bytes_per_token: u32,
    second: Option<u32>,
    launch: CopyLaunch,
) -> [KernelSpec; 3] {
    let transfer = |direction, layout| {
        KernelSpec::TransferPages(TransferSpec {
            direction,
            layout,
            page_size,
            bytes_per_token,
            second_bytes_per_token: second,
            stamps: false,
            launch,
        })
    };
    [
        transfer(Direction::DeviceToHost, HostLayout::PageFirst),
        transfer(Direction::HostToDevice, HostLayout::LayerFirst),
        KernelSpec::Materialise(MaterialiseSpec {
            cp: MAT_CP,
            page_size,
            bytes_per_token,
            launch,
        }),
    ]
}

fn copy_specs() -> Vec<KernelSpec> {
    SHAPES
        .iter()
        .flat_map(|&(ps, bpt, second)| {
            // A vector width that divides both buffers' pages.
            let common = TransferSpec {
                direction: Direction::DeviceToHost,
                layout: HostLayout::PageFirst,
                page_size: ps,
                bytes_per_token: bpt,
                second_bytes_per_token: second,
                stamps: false,
                launch: CopyLaunch::default(),
            }
            .common_page_bytes();
            launches(common).map(|l| copy_family(ps, bpt, second, l))
        })
        .flatten()
        .collect()
}

/// The other kernels of the reach test: every launch shape `tune` tries for the copy families
/// (more pages per block, the layer loop in the block, word accesses) on 528-byte pages, select
/// and release at an odd CP, synthesise and verify of every buffer kind.
fn other_specs() -> Vec<KernelSpec> {
    let (page_size, bytes_per_token) = (4, 132);
    let mut v: Vec<KernelSpec> = CopyLaunch::candidates(u64::from(page_size * bytes_per_token))
        .into_iter()
        .flat_map(|l| copy_family(page_size, bytes_per_token, None, l))
        .collect();
    v.extend([
        KernelSpec::SelectOwnerPages(AllocSpec {
            cp: 3,
            page_size: 16,
            threads: 32,
            output: SelectOutput::PagesAndLocs,
        }),
        KernelSpec::SelectOwnerPages(AllocSpec {
            cp: 3,
            page_size: 16,
            threads: 32,
            output: SelectOutput::Pages,
        }),
        KernelSpec::ReleasePages(ReleaseSpec { cp: 3, threads: 32 }),
    ]);
    let gqa = BufferKind::GqaKv {
        kv_heads: 2,
        head_dim: 12,
    };
    for buffer in [
        BufferKind::NsaKv,
        BufferKind::NsaIndexK,
        BufferKind::MlaKv,
        gqa,
    ] {
        v.push(KernelSpec::Synthesise(SynthSpec {
            buffer,
            cp: 2,
            page_size: 4,
            threads: 32,
            order: cp_hicache::kernels::TokenOrder::Paged,
        }));
        v.push(KernelSpec::Verify(VerifySpec {
            buffer,
            page_size: 4,
            threads: 32,
            order: cp_hicache::kernels::TokenOrder::Paged,
        }));
    }
    v
}

fn libs() -> &'static HashMap<KernelSpec, PathBuf> {
    static LIBS: OnceLock<HashMap<KernelSpec, PathBuf>> = OnceLock::new();
    LIBS.get_or_init(|| {
        let mut specs = copy_specs();
        specs.extend(other_specs());
        support::compile(&specs, Sanitize::Address)
    })
}

/// Layer ranges of the transfer cases over pools of 2 layers, as (first_layer, layer_count):
/// all, each one, and ranges partly or wholly past the pools (sums past 2^32 included).
const LAYER_RANGES: [(u32, u32); 7] = [
    (0, 2),
    (0, 1),
    (1, 1),
    (1, u32::MAX),
    (2, 1),
    (u32::MAX, 2),
    (u32::MAX, u32::MAX),
];

/// Launches transfer `spec` over `n` random pairs for the layers `(first, count)` and
/// compares with the reference; with `lie` the kernel of a d2h page-first spec is told the host pool has one more page than it
/// has and the first pair writes that page, which starts exactly at the end of the buffer (an
/// out-of-bounds write ASan must report).
fn transfer_case(
    b: &mut Bench,
    spec: &KernelSpec,
    rng: &mut Rng,
    (first_layer, layer_count): (u32, u32),
    lie: bool,
) {
    let KernelSpec::TransferPages(s) = *spec else {
        unreachable!()
    };
    let (layers, device_pages, host_pages) = (2u32, 4u32, 3u32);
    let (src_cap, dst_cap) = match s.direction {
        Direction::DeviceToHost => (device_pages, host_pages),
        Direction::HostToDevice => (host_pages, device_pages),
    };
    let n = rng.range(1, u64::from(dst_cap)) as usize;
    let dst_pages: Vec<u32> = rng.permutation(dst_cap)[..n].to_vec();
    let src_pages: Vec<u32> = (0..n)
        .map(|_| rng.below(u64::from(src_cap)) as u32)
        .collect();
    let mut dst_pages = dst_pages;
    if lie {
        assert_eq!(
            (s.direction, s.layout),
            (Direction::DeviceToHost, HostLayout::PageFirst)
        );
        dst_pages[0] = host_pages;
    }
    // One source pool per buffer of the launch.
    let srcs: Vec<Vec<u8>> = s
        .descriptors()
        .iter()
        .map(|d| {
            let pool_pages = match s.direction {
                Direction::DeviceToHost => device_pages,
                Direction::HostToDevice => host_pages,
            };
            rng.bytes((u64::from(layers * pool_pages) * d.page_bytes()) as usize)
        })
        .collect();
    let span = cp_hicache::kernels::clamp_layer_range(first_layer, layer_count, layers).len();
    let copied = b.transfer(
        spec,
        spec.launch_dims(n as u32, span as u32).grid,
        &TransferCase {
            src: &srcs[0],
            src1: srcs.get(1).map_or(&[], |v| v),
            src_pages: &src_pages,
            dst_pages: &dst_pages,
            layers,
            first_layer,
            layer_count,
            device_pages,
            host_pages,
            told_host_pages: host_pages + u32::from(lie),
            guard: 0,
        },
    );
    for (i, copied) in copied.iter().enumerate() {
        assert!(
            copied.got == copied.want,
            "{spec} layers {first_layer}+{layer_count} buffer {i}: differs from the reference"
        );
    }
}

fn materialise_case(b: &mut Bench, spec: &KernelSpec, rng: &mut Rng) {
    let KernelSpec::Materialise(s) = *spec else {
        unreachable!()
    };
    let (layers, local_pages) = (2u32, 3u32);
    let pb = u64::from(s.page_size) * u64::from(s.bytes_per_token);
    let pool_bytes = (u64::from(layers * local_pages) * pb) as usize;
    let pools: Vec<Vec<u8>> = (0..s.cp).map(|_| rng.bytes(pool_bytes)).collect();
    let n = 5u32;
    let seq: Vec<u32> = (0..n)
        .map(|_| rng.below(u64::from(s.cp) * u64::from(local_pages + 1)) as u32)
        .collect();
    let copied = b.materialise(
        spec,
        spec.launch_dims(n, layers).grid,
        &MaterialiseCase {
            pools: &pools,
            seq: &seq,
            layers,
            local_pages,
            guard: 0,
        },
    );
    assert!(
        copied.got == copied.want,
        "{spec}: differs from the reference"
    );
}

#[test]
fn asan_copy_kernels_match_reference_without_reports() {
    if std::env::var_os(CHILD_ENV).is_some()
        || !run_here("asan_copy_kernels_match_reference_without_reports")
    {
        return;
    }
    for order in ORDERS {
        let mut b = Bench::new(order, libs());
        let mut rng = Rng::new(&[9, u64::from(order == BlockOrder::Reverse)]);
        for spec in copy_specs() {
            match spec {
                KernelSpec::TransferPages(_) => {
                    for range in LAYER_RANGES {
                        transfer_case(&mut b, &spec, &mut rng, range, false);
                    }
                }
                _ => {
                    for _ in 0..2 {
                        materialise_case(&mut b, &spec, &mut rng);
                    }
                }
            }
        }
    }
}

/// Every family, launched through the safe `Executor::launch` with each pointer argument in a
/// buffer of exactly its parameter's reach and random small arguments and contents (page ids,
/// owners and lane tops partly out of range): no ASan report, so no kernel touches a byte past
/// its reach, which is what the executors check before a launch.
#[test]
fn asan_every_kernel_stays_within_its_reach() {
    if std::env::var_os(CHILD_ENV).is_some()
        || !run_here("asan_every_kernel_stays_within_its_reach")
    {
        return;
    }
    let mut b = Bench::new(BlockOrder::Forward, libs());
    let mut specs = copy_specs();
    specs.extend(other_specs());
    for spec in specs {
        for trial in 0..8 {
            let mut rng = Rng::new(&[11, trial, support::uri_seed(&spec)]);
            let (ok, _) = support::reach_case(&mut b, &spec, &mut rng, Twist::None);
            ok.unwrap_or_else(|e| panic!("{spec}, trial {trial}: {e}"));
        }
    }
}

/// Child side of `asan_reports_an_out_of_bounds_page`: does nothing unless the parent set
/// the spec's uri.
#[test]
fn asan_oob_child() {
    let Ok(uri) = std::env::var(CHILD_ENV) else {
        return;
    };
    let spec = copy_specs()
        .into_iter()
        .find(|s| s.uri() == uri)
        .expect("a spec of this target");
    let mut b = Bench::new(BlockOrder::Forward, libs());
    transfer_case(&mut b, &spec, &mut Rng::new(&[10]), (0, 2), true);
    eprintln!("ASAN-CHILD: the launch returned without a report");
}

#[test]
fn asan_reports_an_out_of_bounds_page() {
    if std::env::var_os(CHILD_ENV).is_some() || !run_here("asan_reports_an_out_of_bounds_page") {
        return;
    }
    let spec = copy_specs()
        .into_iter()
        .find(|s| matches!(s, KernelSpec::TransferPages(t) if t.direction == Direction::DeviceToHost && t.launch.threads == 1 && t.page_size == 16))
        .unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "asan_oob_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, spec.uri())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the child should have been stopped by ASan:\n{stderr}"
    );
    assert!(
        stderr.contains("AddressSanitizer") && stderr.contains("heap-buffer-overflow"),
        "no ASan heap-buffer-overflow report in:\n{stderr}"
    );
    assert!(
        stderr.contains(&spec.uri()),
        "the report should name the kernel:\n{stderr}"
    );
}

/// `replay` with `CP_HICACHE_EMU_SANITIZE=address` in a process without the ASan runtime stops
/// before compiling anything, saying how to run it (instead of being ended by the runtime at
/// the first kernel load).
#[test]
fn replay_without_the_asan_runtime_is_refused_before_compiling() {
    let cache = tempfile::tempdir().unwrap();
    let out = support::small_replay(
        cache.path(),
        &[(SANITIZE_ENV, Some("address")), ("LD_PRELOAD", None)],
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("LD_PRELOAD=$(c++ -print-file-name=libasan.so)"),
        "{stderr}"
    );
    assert!(
        !cache.path().join("host-asan").exists(),
        "compiled before refusing"
    );
}

/// `bench`, `bench --check` and `tune` refuse the same way, with one error before compiling,
/// not one per kernel.
#[test]
fn bench_and_tune_without_the_asan_runtime_are_refused_once() {
    for args in [
        &["bench", "--quick"][..],
        &["bench", "--check", "--deployment", "mla_ps16_cp1"],
        &["tune", "--quick", "--deployment", "mla_ps16_cp1"],
    ] {
        let cache = tempfile::tempdir().unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
            .args(args)
            .env("CP_HICACHE_CACHE_DIR", cache.path())
            .env(SANITIZE_ENV, "address")
            .env_remove("LD_PRELOAD")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        let errors: Vec<_> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
        assert_eq!(errors.len(), 1, "{args:?}: {stderr}");
        assert!(
            errors[0].contains("LD_PRELOAD=$(c++ -print-file-name=libasan.so)"),
            "{stderr}"
        );
        assert!(
            !cache.path().join("host-asan").exists(),
            "{args:?}: compiled before refusing"
        );
    }
}

/// The docs/CLI.md recipe: with the runtime preloaded (which the compiler children must not
/// inherit), a small replay runs ASan builds of every kernel and verifies every token.
#[test]
fn replay_runs_asan_kernels_under_the_preloaded_runtime() {
    let on = std::env::var(SANITIZE_ENV).is_ok_and(|v| matches!(v.trim(), "address" | "asan"));
    if !on {
        eprintln!("skipped: ASan kernel tests run with `{COMMAND}`");
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    let asan = libasan();
    let out = support::small_replay(
        cache.path(),
        &[
            (SANITIZE_ENV, Some("address")),
            ("LD_PRELOAD", asan.to_str()),
            ("ASAN_OPTIONS", Some("detect_leaks=0")),
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("mismatched tokens            0"),
        "{stdout}"
    );
    assert!(cache.path().join("host-asan").is_dir());
}
