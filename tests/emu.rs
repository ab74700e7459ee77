//! Host executor and CUDA-emulation header: hand-written kernels in `tests/emu/kernels.cu`,
//! compiled here by invoking `c++` directly (the executor itself never compiles), run in both
//! block orders.
//!
//! `CP_HICACHE_EMU_SANITIZE=address` compiles the kernels with AddressSanitizer; the test
//! process then needs the ASan runtime preloaded (see `asan_catches_out_of_bounds_write`).
//! That test skips without libasan, unless `CP_HICACHE_REQUIRE_HOSTCC=1`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use cp_hicache::exec::host::EMU_HEADER;
use cp_hicache::exec::{
    BlockOrder, BufferId, EmuStackStats, ExecError, Executor, HostExecutor, HostOptions, KernelArg,
    KernelArtifact, KernelId, LaunchConfig, LaunchFailure, MemKind,
};
use cp_hicache::jit::{HostCcOptions, HostCompiler, Sanitize};
use sha2::{Digest, Sha256};

const KERNELS: &str = include_str!("emu/kernels.cu");
const NOPS: usize = 17;
const POISON: u8 = 0xA5;

fn header_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("templates/cuda_emu.h")
}

/// Compiles `source` into a shared library under the cargo test tmp dir, keyed by content and
/// flags (compiled once, written atomically, so parallel tests and reruns share it).
fn compile_with(source: &str, extra: &[String]) -> PathBuf {
    try_compile_with(source, extra).unwrap_or_else(|e| panic!("c++ failed:\n{e}"))
}

/// [`compile_with`], or the compiler's error output.
fn try_compile_with(source: &str, extra: &[String]) -> Result<PathBuf, String> {
    let mut h = Sha256::new();
    h.update(EMU_HEADER.as_bytes());
    h.update(source.as_bytes());
    for f in extra {
        h.update(f.as_bytes());
        h.update([0]);
    }
    let key = hex::encode(&h.finalize()[..12]);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("emu");
    std::fs::create_dir_all(&dir).unwrap();
    let so = dir.join(format!("k-{key}.so"));
    if so.exists() {
        return Ok(so);
    }
    // Unique per call, not only per process: parallel tests of one process may compile the
    // same key at once, and one must not remove or rename the other's files.
    static CALLS: AtomicU64 = AtomicU64::new(0);
    let unique = format!(
        "{}.{}",
        std::process::id(),
        CALLS.fetch_add(1, Ordering::Relaxed)
    );
    let src = dir.join(format!("k-{key}.{unique}.cu"));
    std::fs::write(&src, source).unwrap();
    let tmp = dir.join(format!("k-{key}.{unique}.so.tmp"));
    // The JIT's own flags (stack-clash protection included), with the header by path.
    let options = HostCcOptions {
        header_name: header_path().display().to_string(),
        extra: extra.to_vec(),
        ..HostCcOptions::default()
    };
    let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args(HostCompiler::command_args(&options, &src, &tmp))
        .env_remove("LD_PRELOAD")
        .output()
        .expect("run c++");
    let _ = std::fs::remove_file(&src);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    std::fs::rename(&tmp, &so).unwrap();
    Ok(so)
}

fn sanitize_flags() -> Vec<String> {
    let mode = Sanitize::from_env().expect("CP_HICACHE_EMU_SANITIZE");
    if mode == Sanitize::Address {
        // Loading an ASan library into a process without the runtime aborts it outright.
        let preload = std::env::var("LD_PRELOAD").unwrap_or_default();
        assert!(
            preload.contains("asan"),
            "CP_HICACHE_EMU_SANITIZE=address needs LD_PRELOAD=$(c++ -print-file-name=libasan.so) \
             and ASAN_OPTIONS=detect_leaks=0 for the test process (use a cargo runner)"
        );
    }
    flags(mode)
}

fn flags(mode: Sanitize) -> Vec<String> {
    mode.cxx_flags().iter().map(|f| f.to_string()).collect()
}

/// The test kernels, built in the mode selected by `CP_HICACHE_EMU_SANITIZE`.
fn kernels_so() -> &'static Path {
    static SO: OnceLock<PathBuf> = OnceLock::new();
    SO.get_or_init(|| compile_with(KERNELS, &sanitize_flags()))
}

/// `Executor::launch_unchecked` and `load_kernel` for this file's kernels, which have no
/// signatures.
trait TestKernels {
    fn run(&self, k: KernelId, cfg: &LaunchConfig, args: &[KernelArg<'_>])
        -> Result<(), ExecError>;
    fn load_lib(&self, artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError>;
}

impl<E: Executor + ?Sized> TestKernels for E {
    fn run(
        &self,
        k: KernelId,
        cfg: &LaunchConfig,
        args: &[KernelArg<'_>],
    ) -> Result<(), ExecError> {
        // SAFETY: the kernels of `tests/emu/kernels.cu` (and `FILL_PTX`) index their pointer
        // arguments only by thread, block and the counts passed with them, and each test
        // allocates its buffers for the grid and counts it launches with (the one launch that
        // writes out of bounds on purpose, under ASan, calls `launch_unchecked` itself).
        unsafe { self.launch_unchecked(k, cfg, args) }
    }

    fn load_lib(&self, artifact: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        // SAFETY: the artifacts are `tests/emu/kernels.cu` (or `FILL_PTX`) built with
        // `cuda_emu.h` by `compile_with`, or ones the executor refuses before loading
        // anything (missing path, missing entry, wrong kind).
        unsafe { self.load_kernel(artifact) }
    }
}

fn load(ex: &HostExecutor, so: &Path, entry: &str) -> KernelId {
    ex.load_lib(&KernelArtifact::HostLibrary {
        path: so,
        entry,
        signature: None,
    })
    .unwrap()
}

fn executor(order: BlockOrder) -> HostExecutor {
    HostExecutor::new(HostOptions {
        block_order: order,
        ..HostOptions::default()
    })
}

/// Runs `f` once per block order.
fn both_orders(mut f: impl FnMut(&HostExecutor, BlockOrder)) {
    for order in [BlockOrder::Forward, BlockOrder::Reverse] {
        f(&executor(order), order);
    }
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn alloc_u32(ex: &HostExecutor, v: &[u32]) -> BufferId {
    let b = ex.alloc(MemKind::Device, v.len() * 4, POISON).unwrap();
    ex.upload(b, 0, &u32s(v)).unwrap();
    b
}

fn read_u32(ex: &HostExecutor, b: BufferId) -> Vec<u32> {
    let mut bytes = vec![0u8; ex.size(b).unwrap()];
    ex.read(b, 0, &mut bytes).unwrap();
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn launch_err(
    ex: &HostExecutor,
    k: KernelId,
    cfg: LaunchConfig,
    args: &[KernelArg<'_>],
) -> ExecError {
    ex.run(k, &cfg, args).expect_err("launch should fail")
}

#[test]
fn block_reduction_through_shared_memory() {
    both_orders(|ex, _| {
        let blocks = 5usize;
        let input: Vec<u32> = (0..blocks as u32 * 256).map(|i| i * 3 + 1).collect();
        let inb = alloc_u32(ex, &input);
        let out = ex.alloc(MemKind::Device, blocks * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "block_sum");
        ex.run(
            k,
            &LaunchConfig::linear(blocks as u32, 256),
            &[KernelArg::Ptr(inb, 0), KernelArg::Ptr(out, 0)],
        )
        .unwrap();
        let want: Vec<u32> = input.chunks(256).map(|c| c.iter().sum()).collect();
        assert_eq!(read_u32(ex, out), want);
    });
}

#[test]
fn syncthreads_count_and_or() {
    both_orders(|ex, _| {
        let threads = 96usize;
        // Block 0: some set; block 1: all set; block 2: none set.
        let mut pred = vec![0u32; threads * 3];
        for (i, p) in pred[..threads].iter_mut().enumerate() {
            *p = u32::from(i % 5 == 0);
        }
        pred[threads..2 * threads].fill(7);
        let pb = alloc_u32(ex, &pred);
        let out = ex.alloc(MemKind::Device, 9 * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "sync_variants");
        ex.run(
            k,
            &LaunchConfig::linear(3, threads as u32),
            &[KernelArg::Ptr(pb, 0), KernelArg::Ptr(out, 0)],
        )
        .unwrap();
        assert_eq!(read_u32(ex, out), vec![20, 0, 1, 96, 1, 1, 0, 0, 0]);
    });
}

/// Reference model of `warp_ops` for one warp: `vals[j]` is lane j's value, `alive[j]` whether
/// it did not exit.
fn warp_ops_model(vals: &[u32; 32], alive: &[bool; 32]) -> Vec<Option<[u32; NOPS]>> {
    let part = |j: usize| alive[j];
    let get = |src: usize, j: usize| {
        if src < 32 && part(src) {
            vals[src]
        } else {
            vals[j]
        }
    };
    let ballot = |f: &dyn Fn(u32) -> bool, lanes: std::ops::Range<usize>| {
        lanes
            .filter(|&j| part(j) && f(vals[j]))
            .fold(0u32, |m, j| m | 1 << j)
    };
    (0..32)
        .map(|j| {
            if !alive[j] {
                return None;
            }
            let v = vals[j];
            let mut o = [0u32; NOPS];
            o[0] = ballot(&|x| x & 1 == 1, 0..32);
            o[1] = u32::from((0..32).any(|l| part(l) && vals[l] == 7));
            o[2] = u32::from((0..32).filter(|&l| part(l)).all(|l| vals[l] < 1000));
            o[3] = get(3, j);
            o[4] = if j >= 2 { get(j - 2, j) } else { v };
            o[5] = if j + 5 < 32 { get(j + 5, j) } else { v };
            o[6] = get(j ^ 1, j);
            o[7] = get(j & !7, j);
            o[8] = ballot(&|x| x % 3 == v % 3, 0..32);
            o[9] = if j < 16 {
                ballot(&|x| x & 1 == 1, 0..16)
            } else if j + 1 < 32 {
                get(j + 1, j)
            } else {
                v
            };
            let w2_src = get(j ^ 2, j);
            let w2 = (u64::from(w2_src) << 32) | u64::from(w2_src.wrapping_mul(3));
            let f2 = get(0, j) as f32 * 0.5;
            o[10] = ((w2 >> 32) as u32)
                .wrapping_add(w2 as u32)
                .wrapping_add(((f2 * 2.0) as u32).wrapping_mul(1000));
            // PTX shfl.sync at width w: segment start j & !(w - 1), end start | (w - 1).
            let start = |w: usize| j & !(w - 1);
            let end = |w: usize| start(w) | (w - 1);
            let xor = |m: usize, w: usize| if j ^ m <= end(w) { get(j ^ m, j) } else { v };
            o[11] = xor(16, 16);
            o[12] = xor(8, 8);
            o[13] = if j >= start(8) + 3 { get(j - 3, j) } else { v };
            o[14] = if j + 3 <= end(8) { get(j + 3, j) } else { v };
            o[15] = get(start(8) | (13 & 7), j);
            o[16] = if j + 31 <= 31 { get(j + 31, j) } else { v };
            Some(o)
        })
        .collect()
}

#[test]
fn warp_intrinsics_match_model_with_partial_masks_and_exited_lanes() {
    // The sub-warp butterfly the model encodes: lane 19 ^ 16 at width 16 reads lane 3 (an
    // earlier segment), lane 3 ^ 16 would be lane 19 (a later one) and keeps its own value.
    let vals: [u32; 32] = std::array::from_fn(|j| 100 + j as u32);
    let model = warp_ops_model(&vals, &[true; 32]);
    assert_eq!(model[19].unwrap()[11], 103);
    assert_eq!(model[3].unwrap()[11], 103);
    assert_eq!(model[11].unwrap()[12], 103);
    assert_eq!(model[0].unwrap()[16], 131);
    assert_eq!(model[1].unwrap()[16], 101);
    both_orders(|ex, _| {
        let (blocks, threads) = (2usize, 64usize);
        let input: Vec<u32> = (0..(blocks * threads) as u32)
            .map(|i| (i * 7 + 3) % 11)
            .collect();
        let k = load(ex, kernels_so(), "warp_ops");
        for live in [64u32, 50, 33, 7] {
            let inb = alloc_u32(ex, &input);
            let out = ex
                .alloc(MemKind::Device, blocks * threads * NOPS * 4, POISON)
                .unwrap();
            ex.run(
                k,
                &LaunchConfig::linear(blocks as u32, threads as u32),
                &[
                    KernelArg::Ptr(inb, 0),
                    KernelArg::Ptr(out, 0),
                    KernelArg::U32(live),
                ],
            )
            .unwrap();
            let got = read_u32(ex, out);
            for b in 0..blocks {
                for w in 0..threads / 32 {
                    let base = b * threads + w * 32;
                    let vals: [u32; 32] = input[base..base + 32].try_into().unwrap();
                    let alive: [bool; 32] = std::array::from_fn(|j| ((w * 32 + j) as u32) < live);
                    for (j, want) in warp_ops_model(&vals, &alive).into_iter().enumerate() {
                        let t = base + j;
                        let row = &got[t * NOPS..(t + 1) * NOPS];
                        match want {
                            Some(w) => assert_eq!(
                                row,
                                &w[..],
                                "live {live} block {b} thread {}",
                                w_idx(t, b, threads)
                            ),
                            None => {
                                assert!(row.iter().all(|&x| x == 0xA5A5_A5A5), "exited lane wrote")
                            }
                        }
                    }
                }
            }
        }
    });
}

fn w_idx(t: usize, b: usize, threads: usize) -> usize {
    t - b * threads
}

#[test]
fn atomics_across_blocks() {
    both_orders(|ex, order| {
        let (blocks, threads) = (7u32, 96u32);
        let total = blocks * threads;
        let counter = alloc_u32(ex, &[0]);
        let sum = ex.alloc(MemKind::Device, 8, 0).unwrap();
        let mn = alloc_u32(ex, &[i32::MAX as u32]);
        let mx = alloc_u32(ex, &[i32::MIN as u32]);
        let slot = alloc_u32(ex, &[u32::MAX]);
        let sub = alloc_u32(ex, &[10_000]);
        let exch = alloc_u32(ex, &[0]);
        let k = load(ex, kernels_so(), "atomics");
        let args: Vec<KernelArg> = [counter, sum, mn, mx, slot, sub, exch]
            .iter()
            .map(|&b| KernelArg::Ptr(b, 0))
            .collect();
        ex.run(k, &LaunchConfig::linear(blocks, threads), &args)
            .unwrap();
        assert_eq!(read_u32(ex, counter), vec![total]);
        let mut s = [0u8; 8];
        ex.read(sum, 0, &mut s).unwrap();
        assert_eq!(
            u64::from_le_bytes(s),
            u64::from(total) * u64::from(total - 1) / 2
        );
        assert_eq!(read_u32(ex, mn)[0] as i32, -100);
        assert_eq!(read_u32(ex, mx)[0] as i32, total as i32 - 101);
        assert_eq!(read_u32(ex, sub), vec![10_000 - 2 * total]);
        // The first thread to run claims the slot and the last one's exchange stays: both
        // depend on the order, deterministically (reverse runs threads backwards too).
        let (first, last) = match order {
            BlockOrder::Forward => (0, total - 1),
            BlockOrder::Reverse => (total - 1, 0),
        };
        assert_eq!(read_u32(ex, slot), vec![first]);
        assert_eq!(read_u32(ex, exch), vec![last]);
    });
}

/// `struct Params { u32 n; u64 mul; i64 add; u16 tag; }` in C layout (32 bytes).
fn params_bytes(n: u32, mul: u64, add: i64, tag: u16) -> Vec<u8> {
    let mut b = vec![0u8; 32];
    b[0..4].copy_from_slice(&n.to_le_bytes());
    b[8..16].copy_from_slice(&mul.to_le_bytes());
    b[16..24].copy_from_slice(&add.to_le_bytes());
    b[24..26].copy_from_slice(&tag.to_le_bytes());
    b
}

#[test]
fn by_value_struct_and_pointer_params() {
    both_orders(|ex, _| {
        let n = 300u32;
        let a: Vec<u8> = (0..n + 8).map(|i| (i % 251) as u8).collect();
        let bvals: Vec<u64> = (0..u64::from(n)).map(|i| i * 1_000_003).collect();
        let ab = ex.alloc(MemKind::Host, a.len(), POISON).unwrap();
        ex.upload(ab, 0, &a).unwrap();
        let bb = ex.alloc(MemKind::Device, bvals.len() * 8, POISON).unwrap();
        ex.upload(
            bb,
            0,
            &bvals
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect::<Vec<_>>(),
        )
        .unwrap();
        let out = ex.alloc(MemKind::Device, n as usize * 8, POISON).unwrap();
        let p = params_bytes(n, 3, -5, 9);
        let k = load(ex, kernels_so(), "struct_params");
        ex.run(
            k,
            &LaunchConfig::linear(n.div_ceil(128), 128),
            // `a` is passed with a byte offset of 8.
            &[
                KernelArg::Bytes(&p),
                KernelArg::Ptr(ab, 8),
                KernelArg::Ptr(bb, 0),
                KernelArg::Ptr(out, 0),
                KernelArg::I32(-2),
            ],
        )
        .unwrap();
        let mut raw = vec![0u8; n as usize * 8];
        ex.read(out, 0, &mut raw).unwrap();
        for i in 0..n as usize {
            let got = u64::from_le_bytes(raw[i * 8..i * 8 + 8].try_into().unwrap());
            let want = (bvals[i] * 3 + u64::from(a[i + 8])).wrapping_add((-5i64) as u64) + 9 - 2;
            assert_eq!(got, want, "element {i}");
        }
    });
}

#[test]
fn shared_memory_persists_across_blocks_so_order_matters() {
    // The kernel reads `s` before writing it: each block sees what the previous block left.
    let mut results = vec![];
    both_orders(|ex, order| {
        let out = ex.alloc(MemKind::Device, 4 * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "shared_persist");
        ex.run(k, &LaunchConfig::linear(4, 32), &[KernelArg::Ptr(out, 0)])
            .unwrap();
        let got = read_u32(ex, out);
        match order {
            BlockOrder::Forward => assert_eq!(&got[1..], &[100, 101, 102]),
            BlockOrder::Reverse => assert_eq!(&got[..3], &[101, 102, 103]),
        }
        results.push(got);
    });
    assert_ne!(
        results[0], results[1],
        "the block order must change a buggy kernel's output"
    );
}

#[test]
fn reverse_runs_the_threads_of_a_block_backwards_after_every_barrier() {
    both_orders(|ex, order| {
        let log = alloc_u32(ex, &[0; 1 + 2 * 8]);
        let k = load(ex, kernels_so(), "run_order");
        ex.run(k, &LaunchConfig::linear(1, 8), &[KernelArg::Ptr(log, 0)])
            .unwrap();
        let got = read_u32(ex, log);
        let round: Vec<u32> = match order {
            BlockOrder::Forward => (0..8).collect(),
            BlockOrder::Reverse => (0..8).rev().collect(),
        };
        assert_eq!(got[0], 16);
        assert_eq!(&got[1..9], &round[..], "{order}: before the barrier");
        assert_eq!(&got[9..], &round[..], "{order}: after the barrier");
    });
}

#[test]
fn a_missing_barrier_shows_in_one_of_the_orders() {
    // Thread 0 publishes a shared value that the others read with no barrier between: right
    // when thread 0 runs first, stale when it runs last.
    let mut right = vec![];
    both_orders(|ex, _| {
        let (blocks, threads) = (3, 32);
        let out = ex
            .alloc(MemKind::Device, 4 * blocks * threads, POISON)
            .unwrap();
        let k = load(ex, kernels_so(), "missing_barrier");
        ex.run(
            k,
            &LaunchConfig::linear(blocks as u32, threads as u32),
            &[KernelArg::Ptr(out, 0)],
        )
        .unwrap();
        let got = read_u32(ex, out);
        right.push((0..blocks * threads).all(|i| got[i] == 1000 + (i / threads) as u32));
    });
    assert_eq!(
        right,
        [true, false],
        "forward hides the bug, reverse must show it"
    );
}

#[test]
fn deadlock_is_a_typed_error_naming_kernel_threads_and_intrinsics() {
    both_orders(|ex, _| {
        let out = ex.alloc(MemKind::Device, 64 * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "deadlock_elsewhere");
        let e = launch_err(
            ex,
            k,
            LaunchConfig::linear(2, 64),
            &[KernelArg::Ptr(out, 0)],
        );
        assert_eq!(e.launch_failure(), Some(LaunchFailure::Deadlock), "{e}");
        let msg = e.to_string();
        for needle in [
            "deadlock_elsewhere",
            "block (",
            "threads 0-15",
            "__syncthreads",
            "__shfl_sync",
            "deadlock",
        ] {
            assert!(msg.contains(needle), "`{needle}` missing from: {msg}");
        }
        // The executor stays usable after an abandoned launch.
        let k2 = load(ex, kernels_so(), "block_sum");
        let inb = alloc_u32(ex, &[1; 256]);
        ex.run(
            k2,
            &LaunchConfig::linear(1, 256),
            &[KernelArg::Ptr(inb, 0), KernelArg::Ptr(out, 0)],
        )
        .unwrap();
        assert_eq!(read_u32(ex, out)[0], 256);
    });
}

#[test]
fn divergent_barriers_are_reported() {
    both_orders(|ex, _| {
        let out = ex.alloc(MemKind::Device, 16, POISON).unwrap();
        let k = load(ex, kernels_so(), "divergent_barrier");
        let e = launch_err(
            ex,
            k,
            LaunchConfig::linear(1, 32),
            &[KernelArg::Ptr(out, 0)],
        );
        assert_eq!(e.launch_failure(), Some(LaunchFailure::Mismatch), "{e}");
        assert!(e.to_string().contains("divergent_barrier"), "{e}");
        assert!(
            e.to_string()
                .contains("threads 16-31: waiting at __syncthreads"),
            "{e}"
        );
    });
}

#[test]
fn barrier_does_not_wait_for_exited_threads() {
    both_orders(|ex, _| {
        let out = ex.alloc(MemKind::Device, 64 * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "barrier_after_exit");
        ex.run(k, &LaunchConfig::linear(1, 64), &[KernelArg::Ptr(out, 0)])
            .unwrap();
        let got = read_u32(ex, out);
        for (t, &g) in got.iter().enumerate().take(16) {
            assert_eq!(g, t as u32 + (15 - t as u32) * 100);
        }
        assert!(got[16..].iter().all(|&x| x == 0xA5A5_A5A5));
    });
}

#[test]
fn mismatched_warp_intrinsics_are_reported() {
    both_orders(|ex, _| {
        let out = ex.alloc(MemKind::Device, 32 * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "mismatch_warp");
        let e = launch_err(
            ex,
            k,
            LaunchConfig::linear(1, 32),
            &[KernelArg::Ptr(out, 0)],
        );
        assert_eq!(e.launch_failure(), Some(LaunchFailure::Mismatch), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("__ballot_sync") && msg.contains("__any_sync"),
            "{msg}"
        );
    });
}

#[test]
fn bad_mask_and_trap_are_reported() {
    both_orders(|ex, _| {
        let out = ex.alloc(MemKind::Device, 64 * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "bad_mask");
        let e = launch_err(
            ex,
            k,
            LaunchConfig::linear(1, 32),
            &[KernelArg::Ptr(out, 0)],
        );
        assert_eq!(e.launch_failure(), Some(LaunchFailure::BadMask), "{e}");
        let k = load(ex, kernels_so(), "trap_kernel");
        let e = launch_err(
            ex,
            k,
            LaunchConfig::linear(2, 32),
            &[KernelArg::Ptr(out, 0)],
        );
        assert_eq!(e.launch_failure(), Some(LaunchFailure::Trap), "{e}");
        assert!(e.to_string().contains("block (1,0,0)"), "{e}");
    });
}

#[test]
fn single_thread_blocks_run_on_the_direct_path() {
    both_orders(|ex, _| {
        // Barrier variants with one thread per block.
        let pred = alloc_u32(ex, &[0, 5, 1]);
        let out = ex.alloc(MemKind::Device, 9 * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "sync_variants");
        ex.run(
            k,
            &LaunchConfig::linear(3, 1),
            &[KernelArg::Ptr(pred, 0), KernelArg::Ptr(out, 0)],
        )
        .unwrap();
        assert_eq!(read_u32(ex, out), vec![0, 0, 0, 1, 1, 1, 1, 1, 1]);
        // Warp intrinsics where lane 0 is the only participant.
        let input: Vec<u32> = vec![7, 4, 1000];
        let inb = alloc_u32(ex, &input);
        let wout = ex.alloc(MemKind::Device, 3 * NOPS * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "warp_ops");
        ex.run(
            k,
            &LaunchConfig::linear(3, 1),
            &[
                KernelArg::Ptr(inb, 0),
                KernelArg::Ptr(wout, 0),
                KernelArg::U32(1),
            ],
        )
        .unwrap();
        let got = read_u32(ex, wout);
        for (b, &v) in input.iter().enumerate() {
            let mut vals = [0u32; 32];
            vals[0] = v;
            let alive: [bool; 32] = std::array::from_fn(|j| j == 0);
            let want = warp_ops_model(&vals, &alive)[0].unwrap();
            assert_eq!(&got[b * NOPS..(b + 1) * NOPS], &want[..], "block {b}");
        }
        // A failure on the direct path is reported and leaves the executor usable.
        let k = load(ex, kernels_so(), "lane1_mask");
        let e = launch_err(ex, k, LaunchConfig::linear(2, 1), &[KernelArg::Ptr(out, 0)]);
        assert_eq!(e.launch_failure(), Some(LaunchFailure::BadMask), "{e}");
        let k = load(ex, kernels_so(), "sync_variants");
        ex.run(
            k,
            &LaunchConfig::linear(3, 1),
            &[KernelArg::Ptr(pred, 0), KernelArg::Ptr(out, 0)],
        )
        .unwrap();
    });
}

/// `__stcs` on a type CUDA has no overload for fails to compile on the CPU too, naming the
/// rule, so such a kernel cannot pass the CPU tests and fail only under NVRTC.
#[test]
fn streaming_stores_of_other_types_do_not_compile() {
    let src = "struct Pair { unsigned a, b; };\n\
               extern \"C\" __global__ void k(Pair* p) { __stcs(p, Pair{1u, 2u}); }\n\
               CP_HICACHE_EMU_EXPORT(k)\n";
    let err = try_compile_with(src, &[]).expect_err("__stcs of a struct compiled");
    assert!(
        err.contains("__stcs takes a built-in scalar or vector type"),
        "{err}"
    );
}

/// The safe `Executor::launch` (a provided method over `launch_with`) refuses a kernel loaded
/// without a signature, without running it; `launch_unchecked` runs the same kernel.
#[test]
fn the_safe_launch_refuses_a_kernel_without_a_signature() {
    let ex = executor(BlockOrder::Forward);
    let pred = alloc_u32(&ex, &[0, 5, 1]);
    let out = ex.alloc(MemKind::Device, 9 * 4, POISON).unwrap();
    let k = load(&ex, kernels_so(), "sync_variants");
    let cfg = LaunchConfig::linear(3, 1);
    let args = [KernelArg::Ptr(pred, 0), KernelArg::Ptr(out, 0)];
    let e = ex.launch(k, &cfg, &args).unwrap_err();
    assert_eq!(
        e.launch_failure(),
        Some(LaunchFailure::InvalidConfig),
        "{e}"
    );
    assert!(
        e.to_string().contains("only `launch_unchecked` runs it"),
        "{e}"
    );
    assert_eq!(
        read_u32(&ex, out),
        vec![u32::from_ne_bytes([POISON; 4]); 9],
        "it did not run"
    );
    ex.run(k, &cfg, &args).unwrap();
    assert_eq!(read_u32(&ex, out), vec![0, 0, 0, 1, 1, 1, 1, 1, 1]);
}

#[test]
fn invalid_launches_are_typed_errors() {
    let ex = executor(BlockOrder::Forward);
    let out = ex.alloc(MemKind::Device, 4096, POISON).unwrap();
    let k = load(&ex, kernels_so(), "coords");
    let p = [KernelArg::Ptr(out, 0)];
    let cases: Vec<(LaunchConfig, Vec<KernelArg>)> = vec![
        (LaunchConfig::linear(1, 2048), p.to_vec()),
        (LaunchConfig::linear(0, 32), p.to_vec()),
        // CUDA's grid limits: 2^31 - 1 blocks in x, 65535 in y and z.
        (LaunchConfig::linear(1 << 31, 32), p.to_vec()),
        (
            LaunchConfig {
                grid: [1, 1, 65536],
                ..LaunchConfig::linear(1, 32)
            },
            p.to_vec(),
        ),
        (
            LaunchConfig {
                shared_bytes: 128,
                ..LaunchConfig::linear(1, 32)
            },
            p.to_vec(),
        ),
        (LaunchConfig::linear(1, 32), vec![]),
        (
            LaunchConfig::linear(1, 32),
            vec![KernelArg::Ptr(out, 0), KernelArg::U32(1)],
        ),
        (LaunchConfig::linear(1, 32), vec![KernelArg::U32(1)]),
    ];
    for (cfg, args) in cases {
        let e = launch_err(&ex, k, cfg, &args);
        assert_eq!(
            e.launch_failure(),
            Some(LaunchFailure::InvalidConfig),
            "{cfg:?}: {e}"
        );
        assert!(e.to_string().contains("coords"), "{e}");
    }
}

#[test]
fn three_dimensional_shapes() {
    both_orders(|ex, _| {
        let (grid, block) = ([3u32, 2, 2], [4u32, 2, 3]);
        let n = (grid.iter().product::<u32>() * block.iter().product::<u32>()) as usize;
        let out = ex.alloc(MemKind::Device, n * 4, POISON).unwrap();
        let k = load(ex, kernels_so(), "coords");
        ex.run(
            k,
            &LaunchConfig {
                grid,
                block,
                shared_bytes: 0,
            },
            &[KernelArg::Ptr(out, 0)],
        )
        .unwrap();
        let got = read_u32(ex, out);
        let mut i = 0;
        for bz in 0..grid[2] {
            for by in 0..grid[1] {
                for bx in 0..grid[0] {
                    for tz in 0..block[2] {
                        for ty in 0..block[1] {
                            for tx in 0..block[0] {
                                let want = tx | ty << 4 | tz << 8 | bx << 12 | by << 16 | bz << 20;
                                assert_eq!(got[i], want);
                                i += 1;
                            }
                        }
                    }
                }
            }
        }
    });
}

#[test]
fn large_thread_stacks_work() {
    let ex = executor(BlockOrder::Forward);
    let out = ex.alloc(MemKind::Device, 128 * 4, POISON).unwrap();
    let k = load(&ex, kernels_so(), "big_stack");
    ex.run(k, &LaunchConfig::linear(2, 128), &[KernelArg::Ptr(out, 0)])
        .unwrap();
    let got = read_u32(&ex, out);
    for (t, &g) in got.iter().enumerate() {
        let want: u32 = (0..4096u32).map(|i| i ^ t as u32).sum();
        assert_eq!(g, want);
    }
}

/// The fiber-stack pool is never remapped per launch: kernels alternating on one thread with
/// other stack sizes (two executors over one library share its pool on this thread) and other
/// block sizes map stacks only while the pool grows to the largest of each, then not again.
/// Remapping per launch made the replay spend most of its time in mmap and munmap.
#[test]
fn fiber_stacks_are_not_remapped_per_launch() {
    // A library of its own (the define only changes the cache key): each library has its own
    // pool per thread, so no other test's launches count here, whichever thread runs this.
    let mut extra = sanitize_flags();
    extra.push("-DCP_EMU_POOL_TEST=1".into());
    let so = compile_with(KERNELS, &extra);
    let with_stack = |bytes: u64| {
        HostExecutor::new(HostOptions {
            stack_bytes: bytes,
            ..HostOptions::default()
        })
    };
    let (small, big) = (with_stack(64 << 10), with_stack(256 << 10));
    let input: Vec<u32> = (0..512).collect();
    let (inb, out) = (
        alloc_u32(&small, &input),
        small.alloc(MemKind::Device, 8, POISON).unwrap(),
    );
    let sum_small = load(&small, &so, "block_sum");
    let frames_big = load(&big, &so, "big_stack");
    let empty_big = load(&big, &so, "empty_kernel");
    let big_out = big.alloc(MemKind::Device, 128 * 4, POISON).unwrap();
    let stats = || {
        small
            .stack_stats(sum_small)
            .unwrap()
            .expect("cp_emu_stack_stats exported")
    };
    assert_eq!(
        stats(),
        EmuStackStats::default(),
        "nothing launched on this thread yet"
    );
    let round = |threads: u32| {
        small
            .run(
                sum_small,
                &LaunchConfig::linear(2, threads),
                &[KernelArg::Ptr(inb, 0), KernelArg::Ptr(out, 0)],
            )
            .unwrap();
        let want = |b: u32| (b * threads..(b + 1) * threads).sum::<u32>();
        assert_eq!(read_u32(&small, out), [want(0), want(1)]);
        big.run(
            frames_big,
            &LaunchConfig::linear(2, 128),
            &[KernelArg::Ptr(big_out, 0)],
        )
        .unwrap();
        assert_eq!(
            read_u32(&big, big_out)[127],
            (0..4096u32).map(|i| i ^ 127).sum::<u32>()
        );
    };
    // 256 stacks of 64 KiB, then 256 KiB ones for big_stack's 128 threads: the only unmap,
    // as the size grows; block_sum then runs on them and adds the 128 stacks it lacks.
    round(256);
    let first = stats();
    assert_eq!(
        (first.maps, first.unmaps, first.stacks_live),
        (2, 1, 128),
        "{first:?}"
    );
    assert_eq!(first.stack_bytes, 256 << 10, "{first:?}");
    round(256);
    let grown = stats();
    assert_eq!(
        (grown.maps, grown.unmaps, grown.stacks_live),
        (3, 1, 256),
        "{grown:?}"
    );
    for i in 0..50 {
        round(if i % 2 == 0 { 64 } else { 256 });
    }
    assert_eq!(stats(), grown, "launches that fit the pool remapped stacks");
    // More threads per block: one more chunk for the stacks the pool lacks, kept where guards
    // are guard regions. With PROT_NONE guards (kernels before 6.13) the stacks past 256 are
    // given back after each launch, to stay under vm.max_map_count.
    big.run(empty_big, &LaunchConfig::linear(1, 512), &[])
        .unwrap();
    let wide = stats();
    assert_eq!(wide.stacks_mapped, grown.stacks_mapped + 256, "{wide:?}");
    for _ in 0..20 {
        big.run(empty_big, &LaunchConfig::linear(3, 512), &[])
            .unwrap();
        round(128);
    }
    let after = stats();
    if after.guard_regions {
        assert_eq!(after, wide, "512-thread launches remapped stacks");
        assert_eq!(after.stacks_live, 512, "{after:?}");
    } else {
        eprintln!("PROT_NONE guards (no MADV_GUARD_INSTALL): stacks past 256 are not kept");
        assert_eq!(after.stacks_live, 256, "{after:?}");
    }
}

/// Runs `probe_raw(which)` from the test kernels: a launch through the raw ABI with inputs the
/// executor never produces. Returns the status and the diagnostic.
fn probe_raw(which: i32) -> (i32, String) {
    let mut err = vec![0u8; 512];
    // SAFETY: the library is built from tests/emu/kernels.cu with the emulation header, whose
    // initialisers only set up TLS; `probe_raw` has exactly this C signature and writes at most
    // `cap` bytes to `err`, which outlives the call, as does the library handle.
    let status = unsafe {
        let lib = libloading::Library::new(kernels_so()).unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(i32, *mut u8, u64) -> i32> =
            lib.get(b"probe_raw").unwrap();
        f(which, err.as_mut_ptr(), err.len() as u64)
    };
    let msg = std::ffi::CStr::from_bytes_until_nul(&err)
        .unwrap()
        .to_string_lossy()
        .into_owned();
    (status, msg)
}

/// The launch entry refuses, with a diagnostic instead of a crash, a null params array for a
/// kernel that takes parameters and a stack size whose page rounding would wrap around.
#[test]
fn raw_launch_rejects_null_params_and_huge_stacks() {
    const EINVAL: i32 = 1;
    let (status, msg) = probe_raw(0);
    assert_eq!(status, EINVAL, "{msg}");
    assert!(
        msg.contains("probe_k") && msg.contains("params is null"),
        "{msg}"
    );
    let (status, msg) = probe_raw(1);
    assert_eq!(status, EINVAL, "{msg}");
    assert!(msg.contains("fiber stack"), "{msg}");
    assert_eq!(probe_raw(2), (0, String::new()));
}

/// A launch configuration of another ABI version is refused on its version alone: neither its
/// parameter sizes nor its error buffer are touched (their layout may differ).
#[test]
fn raw_launch_checks_the_abi_version_before_anything_else() {
    const EABI: i32 = 7;
    assert_eq!(probe_raw(3), (EABI, String::new()));
}

#[test]
fn launch_fault_injection() {
    let ex = executor(BlockOrder::Forward);
    let out = ex.alloc(MemKind::Device, 4, POISON).unwrap();
    let k = load(&ex, kernels_so(), "shared_persist");
    ex.inject_launch_failure();
    // An invalid launch reports why, and leaves the failure armed for the next valid one.
    let e = launch_err(
        &ex,
        k,
        LaunchConfig::linear(1, 32),
        &[KernelArg::Ptr(out, 8)],
    );
    assert_eq!(
        e.launch_failure(),
        Some(LaunchFailure::InvalidConfig),
        "{e}"
    );
    let e = launch_err(
        &ex,
        k,
        LaunchConfig::linear(1, 32),
        &[KernelArg::Ptr(out, 0)],
    );
    assert_eq!(e.launch_failure(), Some(LaunchFailure::Injected));
    assert!(e.to_string().contains("shared_persist"));
    assert_eq!(
        read_u32(&ex, out),
        vec![0xA5A5_A5A5],
        "the kernel must not have run"
    );
    ex.run(k, &LaunchConfig::linear(1, 32), &[KernelArg::Ptr(out, 0)])
        .unwrap();
}

#[test]
fn bounds_and_handles_are_checked() {
    let ex = executor(BlockOrder::Forward);
    let b = ex.alloc(MemKind::Device, 64, POISON).unwrap();
    let mut big = [0u8; 65];
    assert!(matches!(
        ex.read(b, 0, &mut big),
        Err(ExecError::OutOfBounds {
            op: "read",
            size: 64,
            ..
        })
    ));
    assert!(matches!(
        ex.upload(b, 60, &[0; 8]),
        Err(ExecError::OutOfBounds { op: "upload", .. })
    ));
    let k = load(&ex, kernels_so(), "shared_persist");
    // One past the end is a valid pointer; two past is not.
    ex.run(k, &LaunchConfig::linear(1, 1), &[KernelArg::Ptr(b, 0)])
        .unwrap();
    let e = launch_err(&ex, k, LaunchConfig::linear(1, 1), &[KernelArg::Ptr(b, 65)]);
    assert_eq!(
        e.launch_failure(),
        Some(LaunchFailure::InvalidConfig),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        format!(
            "launch of kernel `shared_persist` failed (invalid configuration): parameter 0: \
             kernel argument of 0 bytes at offset 65 is outside buffer {b:?} of 64 bytes"
        )
    );
    ex.free(b).unwrap();
    assert!(matches!(
        ex.read(b, 0, &mut big[..1]),
        Err(ExecError::UnknownBuffer(_))
    ));
    assert!(matches!(
        ex.run(KernelId(999), &LaunchConfig::linear(1, 1), &[]),
        Err(ExecError::UnknownKernel(_))
    ));
    let e = ex
        .load_lib(&KernelArtifact::HostLibrary {
            path: kernels_so(),
            entry: "no_such_kernel",
            signature: None,
        })
        .unwrap_err();
    assert!(
        matches!(e, ExecError::Load { .. }) && e.to_string().contains("no_such_kernel"),
        "{e}"
    );
    let e = ex
        .load_lib(&KernelArtifact::HostLibrary {
            path: Path::new("/nonexistent/k.so"),
            entry: "k",
            signature: None,
        })
        .unwrap_err();
    assert!(matches!(e, ExecError::Load { .. }), "{e}");
    let e = ex
        .load_lib(&KernelArtifact::Cubin {
            image: &[0; 16],
            entry: "k",
            signature: None,
        })
        .unwrap_err();
    assert!(matches!(e, ExecError::WrongArtifact { .. }), "{e}");
}

#[test]
fn counters_show_sync_free_scopes() {
    let ex = executor(BlockOrder::Forward);
    let k = load(&ex, kernels_so(), "block_sum");
    let before = ex.counters();
    let inb = alloc_u32(&ex, &[2; 512]);
    let out = ex.alloc(MemKind::Device, 8, POISON).unwrap();
    ex.run(
        k,
        &LaunchConfig::linear(2, 256),
        &[KernelArg::Ptr(inb, 0), KernelArg::Ptr(out, 0)],
    )
    .unwrap();
    let scope = ex.counters().since(&before);
    assert_eq!(scope.launches, 1);
    assert_eq!(scope.uploads, 1);
    assert_eq!(scope.bytes_uploaded, 2048);
    assert_eq!(scope.allocs, 2);
    assert!(scope.is_sync_free(), "{scope:?}");
    let mid = ex.counters();
    ex.synchronize().unwrap();
    assert_eq!(read_u32(&ex, out), vec![512, 512]);
    let scope = ex.counters().since(&mid);
    assert_eq!((scope.syncs, scope.reads, scope.bytes_read), (1, 1, 8));
    assert!(!scope.is_sync_free());
}

#[test]
fn executors_on_several_threads_keep_shared_memory_apart() {
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                let ex = executor(BlockOrder::Forward);
                let k = load(&ex, kernels_so(), "block_sum");
                for round in 0..20u32 {
                    let inb = alloc_u32(&ex, &[round; 1024]);
                    let out = ex.alloc(MemKind::Device, 16, POISON).unwrap();
                    ex.run(
                        k,
                        &LaunchConfig::linear(4, 256),
                        &[KernelArg::Ptr(inb, 0), KernelArg::Ptr(out, 0)],
                    )
                    .unwrap();
                    assert_eq!(read_u32(&ex, out), vec![round * 256; 4]);
                }
            });
        }
    });
}

#[test]
fn ucontext_fallback_runs_the_same_kernels() {
    if Sanitize::from_env().unwrap() != Sanitize::None {
        eprintln!("skipped: ucontext fallback is checked in the plain build only");
        return;
    }
    let so = compile_with(KERNELS, &["-DCP_EMU_FORCE_UCONTEXT".to_string()]);
    both_orders(|ex, _| {
        let input: Vec<u32> = (0..512).collect();
        let inb = alloc_u32(ex, &input);
        // deadlock_elsewhere's second warp completes its shuffle and writes out[32..64].
        let out = ex.alloc(MemKind::Device, 64 * 4, POISON).unwrap();
        let k = load(ex, &so, "block_sum");
        ex.run(
            k,
            &LaunchConfig::linear(2, 256),
            &[KernelArg::Ptr(inb, 0), KernelArg::Ptr(out, 0)],
        )
        .unwrap();
        assert_eq!(
            read_u32(ex, out)[..2],
            [(0..256u32).sum::<u32>(), (256..512u32).sum::<u32>()]
        );
        let k = load(ex, &so, "deadlock_elsewhere");
        let e = launch_err(
            ex,
            k,
            LaunchConfig::linear(1, 64),
            &[KernelArg::Ptr(out, 0)],
        );
        assert_eq!(e.launch_failure(), Some(LaunchFailure::Deadlock));
    });
}

const ASAN_CHILD_ENV: &str = "CP_HICACHE_EMU_TEST_ASAN_CHILD_SO";

fn libasan() -> Option<PathBuf> {
    let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .arg("-print-file-name=libasan.so")
        .env_remove("LD_PRELOAD")
        .output()
        .ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    // Without the library the compiler echoes the bare name back.
    (p.is_absolute() && p.exists()).then_some(p)
}

/// Child side of `asan_catches_out_of_bounds_write`: does nothing unless the parent set the
/// library path.
#[test]
fn asan_child_oob_write() {
    let Ok(so) = std::env::var(ASAN_CHILD_ENV) else {
        return;
    };
    let ex = executor(BlockOrder::Forward);
    let out = ex.alloc(MemKind::Device, 64, POISON).unwrap();
    let k = load(&ex, Path::new(&so), "oob_write");
    // Writes out[16], one element past the 64-byte buffer; ASan aborts the process here.
    // SAFETY: none: this breaks `launch_unchecked`'s contract on purpose, only in a child
    // process whose kernels are built with AddressSanitizer (and its runtime preloaded), which
    // aborts at the first byte out of bounds.
    unsafe {
        ex.launch_unchecked(
            k,
            &LaunchConfig::linear(1, 32),
            &[KernelArg::Ptr(out, 0), KernelArg::U32(16)],
        )
    }
    .unwrap();
    eprintln!("ASAN-CHILD: launch returned without a report");
}

#[test]
fn asan_catches_out_of_bounds_write() {
    if std::env::var_os(ASAN_CHILD_ENV).is_some() {
        return;
    }
    let Some(asan) = libasan() else {
        let why = "libasan.so not found by `c++ -print-file-name=libasan.so`";
        // CI has the runtime: there a skip would hide that ASan never ran.
        if std::env::var("CP_HICACHE_REQUIRE_HOSTCC").as_deref() == Ok("1") {
            panic!("CP_HICACHE_REQUIRE_HOSTCC=1 but: {why}");
        }
        eprintln!("skipped: {why}");
        return;
    };
    let so = compile_with(KERNELS, &flags(Sanitize::Address));
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "asan_child_oob_write",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ASAN_CHILD_ENV, &so)
        .env("LD_PRELOAD", &asan)
        .env("ASAN_OPTIONS", "detect_leaks=0")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the child should have been aborted by ASan:\n{stderr}"
    );
    assert!(
        stderr.contains("AddressSanitizer"),
        "no ASan report in:\n{stderr}"
    );
    assert!(
        stderr.contains("oob_write"),
        "the report should name the kernel frame:\n{stderr}"
    );
}

const FRAME_CHILD_ENV: &str = "CP_HICACHE_EMU_TEST_FRAME_CHILD";

/// Child side of `a_frame_past_the_stack_faults_in_the_guard`: launches `huge_frame` on
/// fibers of 64 KiB stacks; the process is expected to die of SIGSEGV in the guard.
#[test]
fn frame_child_overflows_its_stack() {
    if std::env::var_os(FRAME_CHILD_ENV).is_none() {
        return;
    }
    let ex = HostExecutor::new(HostOptions {
        stack_bytes: 64 << 10,
        ..HostOptions::default()
    });
    let out = ex.alloc(MemKind::Device, 32 * 4, POISON).unwrap();
    let k = load(&ex, kernels_so(), "huge_frame");
    let r = ex.run(k, &LaunchConfig::linear(1, 32), &[KernelArg::Ptr(out, 0)]);
    eprintln!("FRAME-CHILD: the launch returned {r:?}");
}

/// A kernel thread whose frame is larger than its fiber stack and the guard below it together
/// faults in the guard (the kernels are built with `-fstack-clash-protection`, which probes
/// every page of a large frame) instead of writing into the neighbouring fiber's stack.
#[test]
fn a_frame_past_the_stack_faults_in_the_guard() {
    use std::os::unix::process::ExitStatusExt;
    if std::env::var_os(FRAME_CHILD_ENV).is_some()
        || !matches!(Sanitize::from_env(), Ok(Sanitize::None))
    {
        return;
    }
    kernels_so();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "frame_child_overflows_its_stack",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(FRAME_CHILD_ENV, "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.signal(),
        Some(11),
        "the child should have died of SIGSEGV in the guard ({}):\n{stderr}",
        out.status
    );
    assert!(!stderr.contains("FRAME-CHILD"), "{stderr}");
}

/// Prints the per-thread start and per-barrier costs (run with `--ignored --nocapture`).
#[test]
#[ignore]
fn measure_fiber_costs() {
    let ex = executor(BlockOrder::Forward);
    let empty = load(&ex, kernels_so(), "empty_kernel");
    let bars = load(&ex, kernels_so(), "barrier_loop");
    for threads in [1u32, 32, 256, 1024] {
        let blocks = (1u32 << 22) / threads;
        ex.run(empty, &LaunchConfig::linear(16, threads), &[])
            .unwrap();
        let t = std::time::Instant::now();
        ex.run(empty, &LaunchConfig::linear(blocks, threads), &[])
            .unwrap();
        let start_ns = t.elapsed().as_nanos() as f64 / f64::from(blocks * threads);
        let iters = 64u32;
        let bblocks = blocks / 16;
        let t = std::time::Instant::now();
        ex.run(
            bars,
            &LaunchConfig::linear(bblocks, threads),
            &[KernelArg::U32(iters)],
        )
        .unwrap();
        let total = t.elapsed().as_nanos() as f64;
        let bar_ns = (total - start_ns * f64::from(bblocks * threads))
            / f64::from(bblocks * threads * iters);
        println!("threads/block {threads:5}: thread start {start_ns:6.1} ns, barrier {bar_ns:6.1} ns per thread");
    }
}

#[test]
fn backend_selection_without_a_gpu() {
    if cp_hicache::exec::cuda::CudaExecutor::usable() {
        eprintln!("skipped: a CUDA device is usable here");
        return;
    }
    use cp_hicache::exec::Backend;
    use cp_hicache::jit::open_executor;
    assert_eq!(Backend::Auto.resolve(), Backend::Host);
    let ex = open_executor(Backend::Auto).unwrap();
    assert_eq!(ex.backend(), Backend::Host);
    let e = open_executor(Backend::Cuda).err().expect("no CUDA here");
    assert!(e.is_unavailable(), "{e}");
    // Whatever the backend, the trait object runs the same kernels.
    let out = ex.alloc(MemKind::Device, 4 * 4, POISON).unwrap();
    let k = ex
        .load_lib(&KernelArtifact::HostLibrary {
            path: kernels_so(),
            entry: "shared_persist",
            signature: None,
        })
        .unwrap();
    ex.run(k, &LaunchConfig::linear(4, 1), &[KernelArg::Ptr(out, 0)])
        .unwrap();
}

/// Hand-written PTX (the driver JIT-compiles it), so the CUDA executor can be checked on a GPU
/// machine without NVRTC: `out[tid] = v + tid`.
const FILL_PTX: &str = r#".version 7.0
.target sm_52
.address_size 64
.visible .entry fill_u32(.param .u64 out, .param .u32 v)
{
  .reg .b32 %r<4>;
  .reg .b64 %rd<4>;
  ld.param.u64 %rd1, [out];
  ld.param.u32 %r1, [v];
  cvta.to.global.u64 %rd2, %rd1;
  mov.u32 %r2, %tid.x;
  mul.wide.u32 %rd3, %r2, 4;
  add.s64 %rd2, %rd2, %rd3;
  add.u32 %r3, %r1, %r2;
  st.global.u32 [%rd2], %r3;
  ret;
}
"#;

#[test]
fn cuda_executor_runs_a_ptx_kernel_when_a_gpu_is_present() {
    use cp_hicache::exec::cuda::CudaExecutor;
    if !CudaExecutor::usable() {
        eprintln!("skipped: no usable CUDA device");
        return;
    }
    let ex = CudaExecutor::new(0).unwrap();
    let k = ex
        .load_lib(&KernelArtifact::Cubin {
            image: FILL_PTX.as_bytes(),
            entry: "fill_u32",
            signature: None,
        })
        .unwrap();
    for kind in [MemKind::Device, MemKind::Host] {
        let out = ex.alloc(kind, 64 * 4, POISON).unwrap();
        let before = ex.counters();
        ex.run(
            k,
            &LaunchConfig::linear(1, 32),
            &[KernelArg::Ptr(out, 0), KernelArg::U32(7)],
        )
        .unwrap();
        assert!(ex.counters().since(&before).is_sync_free());
        let mut bytes = vec![0u8; 64 * 4];
        ex.read(out, 0, &mut bytes).unwrap();
        let got: Vec<u32> = bytes
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for (i, &g) in got.iter().enumerate() {
            let want = if i < 32 { 7 + i as u32 } else { 0xA5A5_A5A5 };
            assert_eq!(g, want, "{kind} element {i}");
        }
    }
    ex.inject_launch_failure();
    let out = ex.alloc(MemKind::Device, 4, POISON).unwrap();
    let e = ex
        .run(
            k,
            &LaunchConfig::linear(1, 1),
            &[KernelArg::Ptr(out, 0), KernelArg::U32(1)],
        )
        .unwrap_err();
    assert_eq!(e.launch_failure(), Some(LaunchFailure::Injected));
}
