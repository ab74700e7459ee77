//! The CUDA executor without a GPU: tests/fake_cuda/libcuda.cpp is a stand-in driver that
//! keeps "device" memory on the host and checks every pointer the executor hands it (copies,
//! memsets and frees must fall inside live allocations of the right kind, a context must be
//! current). Work is queued and runs only when something waits for it, as on a GPU, so a
//! missing synchronisation reads stale bytes and fails verification. Its "modules" are kernel
//! renders compiled for the host emulator, so the real kernels run behind `cuLaunchKernel`.
//!
//! What this proves on a machine without a GPU: the CUDA executor's driver plumbing (probe,
//! context, device and pinned mapped memory, uploads and read-backs, `void**` parameters,
//! copy regions, events, module load and unload, every release in `Drop`) carries the whole
//! cache and every kernel family correctly; and its CUDA IPC peer pools work across processes
//! (the stand-in's device memory is POSIX shared memory) and are refused within one, as CUDA
//! refuses them. What it cannot prove: the CUBINs and the hardware.
//!
//! The stand-in must be found before any real libcuda, so the checks run in child processes
//! (this test binary again, with LD_LIBRARY_PATH set) as ignored tests: `child` (which starts
//! `ipc_peer` as a process of its own), and one `rank_process` per CP rank for the
//! multi-process cache, whose ranks agree through `cp_hicache::group::FileGroup`.

mod hicache_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use cp_hicache::cluster::{Cluster, ClusterConfig, ClusterError, WritePolicy};
use cp_hicache::exec::cuda::CudaExecutor;
use cp_hicache::exec::{
    Backend, BufferId, CopyRegion, Counters, DmaMode, EventId, ExecError, Executor, KernelArg,
    KernelArtifact, KernelId, LaunchConfig, LaunchFailure, LoadOp, MemKind,
};
use cp_hicache::jit::{open_executor, spec_request, target_for, Arch, Sanitize, Target};
use cp_hicache::kernels::{
    Deployment, KernelSpec, ModelShape, ReleaseSpec, TransferPath, MAX_LAYERS_PER_LAUNCH,
};
use cp_hicache::rank::{PeerAccess, RankCache};
use hicache_support::{cat, evict_all, jit, serve, tokens, Setup};

const CHILD_ENV: &str = "CP_HICACHE_FAKE_CUDA_CHILD";

/// Builds the stand-in driver as `libcuda.so` and `libcuda.so.1` in the folder `name` of its
/// own, once per test process and folder (tests run in parallel); with `batch` false, without
/// `cuMemcpyBatchAsync` (a driver older than CUDA 12.8). Each file is written under a
/// temporary name and renamed into place, so that a process already running on an earlier
/// build keeps its (unlinked) copy instead of seeing the library rewritten under it.
fn build_fake_driver_with(name: &str, batch: bool) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, dir)) = built.iter().find(|(n, _)| n == name) {
        return dir.clone();
    }
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fake_cuda/libcuda.cpp");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let tmp = dir.join(format!(".libcuda.{}.so", std::process::id()));
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-fPIC", "-shared"])
        .args((!batch).then_some("-DFAKE_CUDA_NO_BATCH"))
        .arg("-o")
        .arg(&tmp)
        .arg(src)
        .arg("-ldl")
        .output()
        .unwrap_or_else(|e| panic!("{cxx}: {e}"));
    assert!(
        out.status.success(),
        "building the stand-in driver failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let copy = dir.join(format!(".libcuda.{}.so.copy", std::process::id()));
    std::fs::copy(&tmp, &copy).unwrap();
    std::fs::rename(&tmp, dir.join("libcuda.so.1")).unwrap();
    std::fs::rename(&copy, dir.join("libcuda.so")).unwrap();
    built.push((name.to_string(), dir.clone()));
    dir
}

fn build_fake_driver() -> PathBuf {
    build_fake_driver_with("fake-cuda", true)
}

/// Runs the ignored test `name` in a child process that loads the stand-in driver in `dir`.
fn run_child(dir: &Path, name: &str) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            name,
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_LIBRARY_PATH", dir)
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{name} failed:\n{stdout}\n{stderr}"
    );
}

/// Copy batches on a driver with `cuMemcpyBatchAsync` (one batched call per batch, or one
/// `cuMemcpyAsync` per merged region when asked for [`DmaMode::PerRegion`]) and on one
/// without it (one `cuMemcpyAsync` per merged region in either mode): the same bytes every
/// way. And tune's two DMA candidates on each: `dma` and `dma-each` both timed where the
/// batch call exists, `dma` reported as falling back (not timed twice) where it does not.
#[test]
fn copy_batches_with_and_without_cu_memcpy_batch_async() {
    run_child(
        &build_fake_driver_with("fake-cuda-batch", true),
        "child_batch_copies",
    );
    run_child(
        &build_fake_driver_with("fake-cuda-nobatch", false),
        "child_region_copies",
    );
    // A driver that has the call but refuses every batch as NOT_SUPPORTED.
    let dir = build_fake_driver_with("fake-cuda-batch", true);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child_batch_refused",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_LIBRARY_PATH", &dir)
        .env(CHILD_ENV, "1")
        .env("FAKE_CUDA_BATCH_NOT_SUPPORTED", "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child_batch_refused failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A counter of the stand-in driver: `fake_cuda_batch_calls` (`cuMemcpyBatchAsync` calls)
/// or `fake_cuda_copy_calls` (`cuMemcpyAsync` calls).
fn driver_count(hook: &[u8]) -> u64 {
    // SAFETY: the stand-in driver is the libcuda this process loaded (LD_LIBRARY_PATH); the
    // hook takes no arguments and reads one counter.
    unsafe {
        let lib = libloading::Library::new("libcuda.so").unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn() -> u64> = lib.get(hook).unwrap();
        f()
    }
}

/// `(cuMemcpyBatchAsync, cuMemcpyAsync)` calls so far.
fn copy_calls() -> (u64, u64) {
    (
        driver_count(b"fake_cuda_batch_calls"),
        driver_count(b"fake_cuda_copy_calls"),
    )
}

/// Scattered page blobs host → device and back: merged into two runs, sent as one batch when
/// the driver has `cuMemcpyBatchAsync` and the batch is asked for, else as one
/// `cuMemcpyAsync` per run, and the bytes land as the regions say either way.
fn copies_land(batched: bool) {
    let ex = CudaExecutor::new(0).unwrap();
    assert_eq!(ex.batched_copies(), batched);
    let r = |src_offset, dst_offset, len| CopyRegion {
        src_offset,
        dst_offset,
        len,
    };
    for mode in [DmaMode::Batched, DmaMode::PerRegion] {
        let host = ex.alloc(MemKind::Host, 64, 0).unwrap();
        let dev = ex.alloc(MemKind::Device, 64, 0xA5).unwrap();
        let data: Vec<u8> = (0..64).collect();
        ex.upload(host, 0, &data).unwrap();
        let before = copy_calls();
        ex.copy_regions_with(
            host,
            dev,
            &[r(40, 8, 8), r(0, 32, 8), r(32, 0, 8), r(8, 40, 8)],
            mode,
        )
        .unwrap();
        let after = copy_calls();
        let one_batch = batched && mode == DmaMode::Batched;
        assert_eq!(
            (after.0 - before.0, after.1 - before.1),
            if one_batch { (1, 0) } else { (0, 2) },
            "{mode}: (batch calls, cuMemcpyAsync calls) for two merged runs"
        );
        let mut out = [0u8; 64];
        ex.read(dev, 0, &mut out).unwrap();
        let mut want = [0xA5u8; 64];
        want[..16].copy_from_slice(&data[32..48]);
        want[32..48].copy_from_slice(&data[..16]);
        assert_eq!(out, want, "{mode}");
        ex.free(host).unwrap();
        ex.free(dev).unwrap();
    }
    // `copy_regions` is the batched mode.
    let host = ex.alloc(MemKind::Host, 64, 0).unwrap();
    let dev = ex.alloc(MemKind::Device, 64, 0xA5).unwrap();
    let before = copy_calls();
    ex.copy_regions(host, dev, &[r(0, 8, 8), r(32, 0, 8)])
        .unwrap();
    ex.synchronize().unwrap();
    let after = copy_calls();
    assert_eq!(
        (after.0 - before.0, after.1 - before.1),
        if batched { (1, 0) } else { (0, 2) }
    );
    // A bad range fails the batch before anything is queued.
    assert!(ex
        .copy_regions(dev, host, &[r(0, 0, 8), r(60, 8, 8)])
        .is_err());
    ex.free(host).unwrap();
    ex.free(dev).unwrap();
}

#[test]
#[ignore = "run by copy_batches_with_and_without_cu_memcpy_batch_async"]
fn child_batch_copies() {
    assert_eq!(std::env::var(CHILD_ENV).as_deref(), Ok("1"));
    copies_land(true);
    dma_candidates(true);
}

/// Issue 29: a `cuMemcpyBatchAsync` that refuses the whole batch as `NOT_SUPPORTED` (no copy
/// named, nothing queued) falls back to one `cuMemcpyAsync` per merged region, the bytes
/// land, and later batches are not tried again.
#[test]
#[ignore = "run by copy_batches_with_and_without_cu_memcpy_batch_async"]
fn child_batch_refused() {
    assert_eq!(std::env::var(CHILD_ENV).as_deref(), Ok("1"));
    let ex = CudaExecutor::new(0).unwrap();
    assert!(ex.batched_copies(), "the driver exports the call");
    let r = |src_offset, dst_offset, len| CopyRegion {
        src_offset,
        dst_offset,
        len,
    };
    let host = ex.alloc(MemKind::Host, 64, 0).unwrap();
    let dev = ex.alloc(MemKind::Device, 64, 0xA5).unwrap();
    let data: Vec<u8> = (0..64).collect();
    ex.upload(host, 0, &data).unwrap();
    for round in 0..2 {
        let (refused, before) = (driver_count(b"fake_cuda_batch_refusals"), copy_calls());
        ex.copy_regions_with(host, dev, &[r(0, 32, 16), r(32, 0, 16)], DmaMode::Batched)
            .unwrap();
        let after = copy_calls();
        assert_eq!(
            (
                driver_count(b"fake_cuda_batch_refusals") - refused,
                after.0 - before.0,
                after.1 - before.1
            ),
            (u64::from(round == 0), 0, 2),
            "round {round}: (refusals, batches, cuMemcpyAsync calls)"
        );
        let mut out = [0u8; 64];
        ex.read(dev, 0, &mut out).unwrap();
        assert_eq!(&out[..16], &data[32..48], "round {round}");
        assert_eq!(&out[32..48], &data[..16], "round {round}");
    }
    assert!(!ex.batched_copies(), "not tried again after the refusal");
    ex.free(host).unwrap();
    ex.free(dev).unwrap();
}

#[test]
#[ignore = "run by copy_batches_with_and_without_cu_memcpy_batch_async"]
fn child_region_copies() {
    assert_eq!(std::env::var(CHILD_ENV).as_deref(), Ok("1"));
    copies_land(false);
    dma_candidates(false);
}

/// Tune's DMA candidates of one transfer on the stand-in driver, each checked against the
/// reference and timed (no timing is asserted): where the driver has `cuMemcpyBatchAsync`,
/// `dma` is timed with batch calls only and `dma-each` with `cuMemcpyAsync` calls only; where
/// it has not, `dma` is not timed (it would be `dma-each` under another name) and says so,
/// and `dma-each` is timed.
fn dma_candidates(batched: bool) {
    use cp_hicache::tuning::measure::CopyBench;
    use cp_hicache::tuning::tuner::{time_dma_candidate, DMA_FALLBACK};
    use cp_hicache::tuning::{LaunchChoice, Sizes};
    let gpu = StandInGpu {
        cuda: CudaExecutor::new(0).unwrap(),
    };
    assert_eq!(gpu.batched_copies(), batched, "the wrapper forwards it");
    let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
    let sizes = Sizes {
        pages: 24,
        layers: 2,
        warmup: 0,
        repeats: 2,
    };
    for dir in [
        cp_hicache::kernels::Direction::HostToDevice,
        cp_hicache::kernels::Direction::DeviceToHost,
    ] {
        let spec = dep.transfer_spec(dir);
        let (bench, _) = CopyBench::new(&gpu, &spec, &sizes, 11).unwrap();
        for mode in [DmaMode::Batched, DmaMode::PerRegion] {
            let before = copy_calls();
            let none = cp_hicache::tuning::tuner::Companions::default();
            let r = time_dma_candidate(&gpu, &spec, &bench, &none, &sizes, 5, mode);
            let after = copy_calls();
            let (batches, each) = (after.0 - before.0, after.1 - before.1);
            assert_eq!(r.choice, LaunchChoice::of_dma(mode));
            assert!(r.beside_busy.is_none(), "no busy kernel here");
            if mode == DmaMode::Batched && !batched {
                assert_eq!(r.dropped.as_deref(), Some(DMA_FALLBACK), "{dir}");
                assert_eq!((r.seconds, batches, each), (None, 0, 0), "{dir}");
                continue;
            }
            assert!(r.dropped.is_none(), "{dir} {mode}: {:?}", r.dropped);
            assert!(r.seconds.is_some() && r.gbps.is_some(), "{dir} {mode}");
            if mode == DmaMode::Batched {
                assert!(
                    batches > 0 && each == 0,
                    "{dir}: {batches} batches, {each} calls"
                );
            } else {
                assert!(
                    batches == 0 && each > 0,
                    "{dir}: {batches} batches, {each} calls"
                );
            }
        }
        // The sweep's staged path: contiguous runs by DMA to a device staging buffer and
        // the transfer kernel between it and the pools, checked against the reference, then
        // timed. One batch per buffer where the driver has the call.
        // SAFETY: no source hook; the kernel is the rendered transfer.
        let kernel = unsafe {
            cp_hicache::tuning::measure::compile_and_load(
                &gpu,
                &jit(),
                &[spec],
                false,
                None,
                &|| {},
            )
        }
        .remove(0)
        .unwrap();
        let none = cp_hicache::tuning::tuner::Companions::default();
        let before = copy_calls();
        let r = cp_hicache::tuning::sweep::time_staged_candidate(
            &gpu, &spec, kernel, &bench, &none, &sizes, 5,
        );
        let after = copy_calls();
        assert!(r.dropped.is_none(), "{dir} staged: {:?}", r.dropped);
        assert!(r.seconds.is_some() && r.gbps.is_some(), "{dir} staged");
        let (batches, each) = (after.0 - before.0, after.1 - before.1);
        assert!(
            if batched {
                batches > 0
            } else {
                batches == 0 && each > 0
            },
            "{dir} staged: {batches} batches, {each} calls"
        );
    }
}

#[test]
fn cuda_executor_on_the_stand_in_driver() {
    let dir = build_fake_driver();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("LD_LIBRARY_PATH", &dir)
        .env(CHILD_ENV, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
}

/// The CUDA executor seen as a host-backend executor, so that the JIT builds host libraries;
/// each is handed to the CUDA executor as a stand-in "CUBIN" that names it.
struct StandInGpu {
    cuda: CudaExecutor,
}

impl Executor for StandInGpu {
    fn backend(&self) -> Backend {
        Backend::Host
    }
    fn multiprocessors(&self) -> Option<u32> {
        self.cuda.multiprocessors()
    }
    fn device_name(&self) -> String {
        self.cuda.device_name()
    }
    fn alloc(&self, k: MemKind, b: usize, f: u8) -> Result<BufferId, ExecError> {
        self.cuda.alloc(k, b, f)
    }
    fn free(&self, b: BufferId) -> Result<(), ExecError> {
        self.cuda.free(b)
    }
    fn size(&self, b: BufferId) -> Result<usize, ExecError> {
        self.cuda.size(b)
    }
    fn address(&self, b: BufferId) -> Result<cp_hicache::exec::Address, ExecError> {
        self.cuda.address(b)
    }
    fn upload(&self, b: BufferId, o: u64, d: &[u8]) -> Result<(), ExecError> {
        self.cuda.upload(b, o, d)
    }
    fn read(&self, b: BufferId, o: u64, d: &mut [u8]) -> Result<(), ExecError> {
        self.cuda.read(b, o, d)
    }
    fn fill(&self, b: BufferId, r: &[(u64, u64)], v: u8) -> Result<(), ExecError> {
        self.cuda.fill(b, r, v)
    }
    unsafe fn load_kernel(&self, a: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        let KernelArtifact::HostLibrary {
            path,
            entry,
            signature,
        } = *a
        else {
            // SAFETY: forwarded; the caller's guarantee is the CUDA executor's.
            return unsafe { self.cuda.load_kernel(a) };
        };
        let sizes: Vec<String> = signature
            .expect("spec kernels carry their signature")
            .params
            .iter()
            .map(|p| p.size.to_string())
            .collect();
        let image = format!(
            "CPHEMU1\n{}\n{entry}\n{}\n",
            path.display(),
            sizes.join(",")
        );
        // SAFETY: the stand-in image names a library the JIT built (the caller's guarantee)
        // for the fake driver, which runs it with the emulator.
        unsafe {
            self.cuda.load_kernel(&KernelArtifact::Cubin {
                image: image.as_bytes(),
                entry,
                signature,
            })
        }
    }
    unsafe fn launch_with(
        &self,
        k: KernelId,
        c: &LaunchConfig,
        a: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError> {
        // SAFETY: forwarded; the caller's guarantee is the CUDA executor's.
        unsafe { self.cuda.launch_with(k, c, a, unsigned_ok) }
    }
    fn copy_regions(&self, s: BufferId, d: BufferId, r: &[CopyRegion]) -> Result<(), ExecError> {
        self.cuda.copy_regions(s, d, r)
    }
    fn copy_regions_with(
        &self,
        s: BufferId,
        d: BufferId,
        r: &[CopyRegion],
        m: DmaMode,
    ) -> Result<(), ExecError> {
        self.cuda.copy_regions_with(s, d, r, m)
    }
    fn batched_copies(&self) -> bool {
        self.cuda.batched_copies()
    }
    fn alloc_shareable(&self, b: usize, f: u8) -> Result<BufferId, ExecError> {
        self.cuda.alloc_shareable(b, f)
    }
    fn export(&self, b: BufferId) -> Result<Vec<u8>, ExecError> {
        self.cuda.export(b)
    }
    fn import(&self, h: &[u8]) -> Result<BufferId, ExecError> {
        self.cuda.import(h)
    }
    fn peer_mapping(&self) -> Option<&'static str> {
        self.cuda.peer_mapping()
    }
    fn maps_in_process(&self) -> bool {
        self.cuda.maps_in_process()
    }
    fn load_layers(
        &self,
        l: &[Vec<LoadOp<'_>>],
        s: &[&[EventId]],
    ) -> Result<Vec<EventId>, ExecError> {
        self.cuda.load_layers(l, s)
    }
    fn backup(&self, ops: &[LoadOp<'_>]) -> Result<EventId, ExecError> {
        self.cuda.backup(ops)
    }
    fn event_done(&self, e: EventId) -> Result<bool, ExecError> {
        self.cuda.event_done(e)
    }
    fn record_event(&self) -> Result<EventId, ExecError> {
        self.cuda.record_event()
    }
    fn wait_event(&self, e: EventId) -> Result<(), ExecError> {
        self.cuda.wait_event(e)
    }
    fn release_event(&self, e: EventId) {
        self.cuda.release_event(e)
    }
    fn shared_event(&self) -> Result<(EventId, Vec<u8>), ExecError> {
        self.cuda.shared_event()
    }
    fn record_shared(&self, e: EventId) -> Result<(), ExecError> {
        self.cuda.record_shared(e)
    }
    fn open_shared_event(&self, h: &[u8]) -> Result<EventId, ExecError> {
        self.cuda.open_shared_event(h)
    }
    fn sync_event(&self, e: EventId) -> Result<(), ExecError> {
        self.cuda.sync_event(e)
    }
    fn synchronize(&self) -> Result<(), ExecError> {
        self.cuda.synchronize()
    }
    unsafe fn adopt(&self, addr: u64, bytes: usize) -> Result<BufferId, ExecError> {
        // SAFETY: forwarded; the caller's guarantee is the CUDA executor's.
        unsafe { self.cuda.adopt(addr, bytes) }
    }
    unsafe fn follow_stream(&self, s: u64) -> Result<(), ExecError> {
        // SAFETY: as above.
        unsafe { self.cuda.follow_stream(s) }
    }
    unsafe fn lead_stream(&self, s: u64) -> Result<(), ExecError> {
        // SAFETY: as above.
        unsafe { self.cuda.lead_stream(s) }
    }
    fn time_work(&self, w: &mut dyn FnMut() -> Result<(), ExecError>) -> Result<f64, ExecError> {
        self.cuda.time_work(w)
    }
    fn counters(&self) -> Counters {
        self.cuda.counters()
    }
    fn inject_launch_failure(&self) {
        self.cuda.inject_launch_failure()
    }
    fn disarm_launch_failure(&self) -> bool {
        self.cuda.disarm_launch_failure()
    }
}

fn live_allocations() -> i32 {
    // SAFETY: the stand-in driver is the libcuda this process loaded (LD_LIBRARY_PATH), and
    // the hook takes no arguments and only reads its allocation table.
    unsafe {
        let lib = libloading::Library::new("libcuda.so").unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn() -> i32> =
            lib.get(b"fake_cuda_live_allocations").unwrap();
        f()
    }
}

fn executor_basics() {
    // A stub libcuda first on the library path is named as such, not a bare error code.
    std::env::set_var("FAKE_CUDA_INIT_RESULT", "34");
    let why = CudaExecutor::probe().unwrap_err();
    std::env::remove_var("FAKE_CUDA_INIT_RESULT");
    assert!(why.contains("stub library"), "{why}");
    assert!(CudaExecutor::usable());
    assert_eq!(Backend::Auto.resolve(), Backend::Cuda);
    assert_eq!(
        open_executor(Backend::Auto).unwrap().backend(),
        Backend::Cuda
    );
    // A GPU no kernel target runs on: `auto` falls back to the host, `cuda` opens it, and
    // building kernels for it is a clear Unavailable error.
    std::env::set_var("FAKE_CUDA_CC", "12.0");
    assert_eq!(Backend::Auto.resolve(), Backend::Host);
    assert_eq!(
        open_executor(Backend::Auto).unwrap().backend(),
        Backend::Host
    );
    let odd = open_executor(Backend::Cuda).unwrap();
    assert_eq!(odd.compute_capability(), Some((12, 0)));
    let err = target_for(odd.as_ref(), Arch::Sm90, Sanitize::None).unwrap_err();
    assert!(
        err.is_unavailable() && err.to_string().contains("12.0"),
        "{err}"
    );
    drop(odd);
    std::env::remove_var("FAKE_CUDA_CC");
    let err = CudaExecutor::new(1).err().expect("one device only");
    assert!(err.is_unavailable(), "{err}");
    let ex = CudaExecutor::new(0).unwrap();
    assert!(
        ex.device_name().contains("Fake H200"),
        "{}",
        ex.device_name()
    );
    assert_eq!(ex.compute_capability(), Some((9, 0)));
    let dev = ex.alloc(MemKind::Device, 64, 0xA5).unwrap();
    let host = ex.alloc(MemKind::Host, 64, 0x5A).unwrap();
    let mut out = [0u8; 64];
    ex.read(dev, 0, &mut out).unwrap();
    assert_eq!(out, [0xA5; 64]);
    ex.read(host, 0, &mut out).unwrap();
    assert_eq!(out, [0x5A; 64]);
    let data: Vec<u8> = (0..64).collect();
    let before = ex.counters();
    ex.upload(host, 0, &data).unwrap();
    let c = ex.counters().since(&before);
    assert_eq!(
        (c.uploads, c.syncs),
        (1, 1),
        "a pinned-host upload waits for the stream"
    );
    ex.upload(dev, 32, &data[..32]).unwrap();
    let r = |src_offset, dst_offset, len| CopyRegion {
        src_offset,
        dst_offset,
        len,
    };
    ex.copy_regions(host, dev, &[r(0, 0, 16)]).unwrap();
    ex.copy_regions(dev, dev, &[r(32, 16, 8)]).unwrap();
    ex.read(dev, 0, &mut out).unwrap();
    let mut want = [0xA5u8; 64];
    want[..16].copy_from_slice(&data[..16]);
    want[16..24].copy_from_slice(&data[..8]);
    want[32..].copy_from_slice(&data[..32]);
    assert_eq!(out, want);
    ex.copy_regions(dev, host, &[r(0, 48, 16)]).unwrap();
    ex.read(host, 48, &mut out[..16]).unwrap();
    assert_eq!(out[..16], want[..16]);
    assert!(matches!(
        ex.read(dev, 60, &mut out[..8]),
        Err(ExecError::OutOfBounds { .. })
    ));
    assert!(ex.copy_regions(dev, host, &[r(60, 0, 8)]).is_err());
    // Fills: device memory with cuMemsetD8Async (no sync), pinned host memory by the CPU
    // after the stream is idle (one counted sync); a batch with a bad range writes nothing.
    let before_fill = ex.counters();
    ex.fill(dev, &[(0, 4), (40, 8)], 0x11).unwrap();
    let c = ex.counters().since(&before_fill);
    assert_eq!((c.fills, c.bytes_filled, c.syncs), (1, 12, 0), "{c:?}");
    ex.fill(host, &[(60, 4)], 0x22).unwrap();
    assert!(matches!(
        ex.fill(dev, &[(8, 4), (62, 4)], 0x33),
        Err(ExecError::OutOfBounds { .. })
    ));
    ex.read(dev, 0, &mut out).unwrap();
    want[..4].fill(0x11);
    want[40..48].fill(0x11);
    assert_eq!(out, want);
    ex.read(host, 56, &mut out[..8]).unwrap();
    assert_eq!(out[4..8], [0x22; 4]);
    let before_timing = ex.counters();
    let t = ex
        .time_work(&mut || ex.copy_regions(host, dev, &[r(0, 0, 64)]))
        .unwrap();
    let c = ex.counters().since(&before_timing);
    assert!(t > 0.0 && t < 1.0, "{t} s for 64 bytes");
    assert_eq!((c.copies, c.syncs), (1, 1), "{c:?}");
    // SAFETY: the fake driver refuses the image before anything could run.
    let bad = unsafe {
        ex.load_kernel(&KernelArtifact::Cubin {
            image: b"not an image",
            entry: "k",
            signature: None,
        })
    };
    assert!(matches!(bad, Err(ExecError::Load { .. })));
    // A free waits for the device before releasing the memory: counted as a free (once),
    // which is a stall, device and pinned host memory alike; a refused free counts nothing.
    for b in [dev, host] {
        let before_free = ex.counters();
        ex.free(b).unwrap();
        let c = ex.counters().since(&before_free);
        assert_eq!((c.frees, c.syncs, c.stalls()), (1, 0, 1), "{c:?}");
    }
    let before_free = ex.counters();
    assert!(ex.free(dev).is_err());
    assert_eq!(ex.counters().since(&before_free), Counters::default());
    drop(ex);
    assert_eq!(live_allocations(), 0, "the executor leaked driver memory");
}

fn cache_on_the_gpu(model: ModelShape, page_size: u32, cp: u8, path: TransferPath) {
    let mut setup = Setup::new(model, page_size, cp);
    setup.layers = 2;
    setup.transfer_path = path;
    let gpu = StandInGpu {
        cuda: CudaExecutor::new(0).unwrap(),
    };
    let mut c: Cluster = setup.build_on(Arc::new(gpu));
    // Ranks of one process share the executor: CUDA IPC cannot map in-process.
    assert_eq!(c.group_info().peer_pools, "direct");
    let ps = page_size as usize;
    let a = tokens(1, 5 * ps + 3);
    serve(&mut c, &a);
    let hit = serve(&mut c, &a);
    assert!(hit.device_hit_tokens > 0, "{hit:?}");
    evict_all(&mut c);
    let back = serve(&mut c, &a);
    assert!(back.host_hit_tokens > 0, "{back:?}");
    let b = cat(&a[..3 * ps], &tokens(2, 2 * ps + 1));
    serve(&mut c, &b);
    let copies = c.executor().counters().copies;
    assert_eq!(
        copies > 0,
        path.dma_mode().is_some(),
        "{path}: {copies} copy batches"
    );
    drop(c);
    assert_eq!(live_allocations(), 0, "the cluster leaked driver memory");
}

/// `cp-hicache info` describes the device, where its pinned host memory goes (the stand-in's
/// PCI bus id, whose sysfs entry here has no NUMA node), and what `--backend auto` picks.
fn info_names_the_device() {
    let out = Command::new(env!("CARGO_BIN_EXE_cp-hicache"))
        .arg("info")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains(
            "Fake H200 (cp-hicache test driver), compute capability 9.0, PCI 0000:00:00.0, "
        ),
        "{text}"
    );
    assert!(
        text.contains("NUMA node") && text.contains("kernels for sm_90"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l.split_whitespace().eq(["backend", "auto", "cuda"])),
        "{text}"
    );
}

/// Launch failures on the CUDA executor are typed and leave it usable: a wrong argument list
/// is refused by the signature before the driver sees it, an injected failure runs nothing.
fn launch_failures_are_typed() {
    let gpu = StandInGpu {
        cuda: CudaExecutor::new(0).unwrap(),
    };
    let spec = KernelSpec::ReleasePages(ReleaseSpec { cp: 2, threads: 32 });
    let req = spec_request(
        &spec,
        Target::Host {
            sanitize: Sanitize::None,
        },
        None,
    )
    .unwrap();
    // SAFETY: the JIT's build of `spec` for the stand-in's (host) target.
    let k = unsafe { jit().get(&req).unwrap().load_spec(&gpu, &spec) }.unwrap();
    let buf = |n| gpu.alloc(MemKind::Device, n, 0).unwrap();
    let (pages, tops, stacks, status) = (buf(8), buf(8), buf(64), buf(16));
    gpu.upload(pages, 0, &[2, 0, 0, 0, 3, 0, 0, 0]).unwrap();
    let args = [
        KernelArg::Ptr(pages, 0),
        KernelArg::U32(2),
        KernelArg::Ptr(stacks, 0),
        KernelArg::Ptr(tops, 0),
        KernelArg::U32(8),
        KernelArg::Ptr(status, 0),
    ];
    let cfg = LaunchConfig::linear(1, 32);
    let launch = |args: &[KernelArg<'_>]| gpu.launch(k, &cfg, args);
    let cause = |r: Result<(), ExecError>| r.unwrap_err().launch_failure();
    assert_eq!(
        cause(launch(&args[..4])),
        Some(LaunchFailure::InvalidConfig)
    );
    gpu.inject_launch_failure();
    // An invalid launch is refused as such and leaves the failure armed.
    assert_eq!(
        cause(launch(&args[..4])),
        Some(LaunchFailure::InvalidConfig)
    );
    assert_eq!(cause(launch(&args)), Some(LaunchFailure::Injected));
    launch(&args).unwrap();
    let mut tops_after = [0u8; 8];
    gpu.read(tops, 0, &mut tops_after).unwrap();
    // Page 2 went back to lane 0, page 3 to lane 1: each lane's top grew by one.
    assert_eq!(tops_after, [1, 0, 0, 0, 1, 0, 0, 0]);
}

/// Uploads go through pinned staging and are sent without waiting: many uploads of varied
/// sizes, with the stream waited for only now and then, each land intact (the stand-in reads
/// a pinned source when the copy runs, so a staging region reused too early shows as wrong
/// bytes), and none of them synchronises.
fn staged_uploads_never_overwrite_a_copy_in_flight() {
    let ex = CudaExecutor::new(0).unwrap();
    let mut seed = 0x9e37_79b9_u64;
    let mut next = move |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut bufs: Vec<(BufferId, Vec<u8>)> = Vec::new();
    let mut grown = 0;
    for round in 0..40u32 {
        let before = ex.counters();
        let mut made = 0;
        for _ in 0..1 + next(6) {
            made += 1;
            // From a few bytes to more than the first ring (64 KiB) holds.
            let len = 1 + next(if round % 9 == 0 { 200_000 } else { 20_000 }) as usize;
            let data: Vec<u8> = (0..len).map(|i| (i as u64 ^ next(256)) as u8).collect();
            let b = ex.alloc(MemKind::Device, len, 0).unwrap();
            ex.upload(b, 0, &data).unwrap();
            bufs.push((b, data));
        }
        let after = ex.counters().since(&before);
        assert_eq!(
            (after.syncs, after.reads),
            (0, 0),
            "uploads wait for nothing"
        );
        grown += after.allocs - made;
        if round % 4 == 3 {
            // Waiting lets the earlier copies complete, so their regions are reused next.
            ex.synchronize().unwrap();
        }
    }
    // Each staging ring counts as an allocation: the first, and at least one larger one for
    // the uploads past 64 KiB.
    assert!(grown >= 2, "staging rings counted: {grown}");
    for (b, data) in &bufs {
        let mut out = vec![0u8; data.len()];
        ex.read(*b, 0, &mut out).unwrap();
        assert!(
            out == *data,
            "an upload of {} bytes was overwritten",
            data.len()
        );
        ex.free(*b).unwrap();
    }
}

/// Issue 29: tune's busy companions on the stand-in driver: a second CUDA executor (its own
/// stream) runs each busy kernel beside fills on the first, the block stamps of the busy
/// kernel (its stream) and of the marker (the work's) are read back, and the device's SM
/// count, which sizes the companions' grid on a GPU, comes from the driver. A transfer's
/// stamped twin stamps its own blocks through the CUDA executor. Timings and the overlap
/// itself are not asserted: the stand-in runs kernels on the CPU.
fn busy_companions_on_a_second_stream() {
    use cp_hicache::kernels::{BusyKind, BusySpec, Direction};
    use cp_hicache::tuning::measure::{compile_and_load, Beside, CompanionShape, CopyBench, Sizes};
    use cp_hicache::tuning::tuner::Companions;
    let gpu = StandInGpu {
        cuda: CudaExecutor::new(0).unwrap(),
    };
    assert_eq!(gpu.cuda.multiprocessors(), Some(132));
    let jit = jit();
    const BYTES: u64 = 1 << 16;
    let buf = gpu.alloc(MemKind::Device, BYTES as usize, 0).unwrap();
    let shape = CompanionShape {
        grid: 2,
        hbm_words: 1 << 14,
    };
    for kind in [BusyKind::Alu, BusyKind::Hbm] {
        let comp = Box::new(StandInGpu {
            cuda: CudaExecutor::new(0).unwrap(),
        });
        let b = Beside::with_companion(&gpu, comp, &jit, BusySpec::of(kind), shape).unwrap();
        let t = b
            .time_beside(1e-4, 2, &|| gpu.fill(buf, &[(0, BYTES)], 3), None)
            .unwrap();
        assert!(t.seconds >= 0.0 && t.busy_slowdown > 0.0, "{kind}: {t:?}");
        assert!(
            t.overlap.start_lag_ns.abs() < 60_000_000_000,
            "{kind}: stamps a minute apart: {t:?}"
        );
        assert!((0.0..=1.0).contains(&t.overlap.covered), "{kind}: {t:?}");
    }
    gpu.free(buf).unwrap();
    // A transfer's first run beside the busy kernel is its stamped twin, launched through
    // the CUDA executor with its `stamps`: where it ran comes from its own blocks.
    let companions = Companions {
        alu: Some(
            Beside::with_companion(
                &gpu,
                Box::new(StandInGpu {
                    cuda: CudaExecutor::new(0).unwrap(),
                }),
                &jit,
                BusySpec::of(BusyKind::Alu),
                shape,
            )
            .unwrap(),
        ),
        hbm: None,
    };
    let spec = Deployment::by_name("nsa_ps64_cp8")
        .unwrap()
        .transfer_spec(Direction::HostToDevice);
    let twin = spec.stamped().unwrap();
    // SAFETY: no hook: the rendered sources.
    let k = unsafe { compile_and_load(&gpu, &jit, &[spec, twin], true, None, &|| {}) };
    let (kernel, twin_kernel) = (*k[0].as_ref().unwrap(), *k[1].as_ref().unwrap());
    let sizes = Sizes {
        pages: 4,
        layers: 2,
        warmup: 0,
        repeats: 2,
    };
    let (bench, _) = CopyBench::new(&gpu, &spec, &sizes, 3).unwrap();
    let both = companions
        .time_transfer(&bench, (&spec, kernel), Some((twin, twin_kernel)), 1e-4, 2)
        .unwrap()
        .expect("timed beside the ALU kernel");
    let lead = both
        .alu
        .overlap
        .resident_lead_ns
        .expect("the twin's stamps");
    assert!(lead.abs() < 60_000_000_000, "{both:?}");
}

fn every_family_matches_the_references() {
    let gpu = StandInGpu {
        cuda: CudaExecutor::new(0).unwrap(),
    };
    let jit = jit();
    for name in ["nsa_ps64_cp8", "mla_ps16_cp4"] {
        let dep = Deployment::by_name(name).unwrap();
        let rows = cp_hicache::tuning::check::check_deployment(&gpu, &jit, &dep).unwrap();
        // The stand-in driver has cuMemcpyBatchAsync: both ways of issuing the DMA path.
        assert!(rows.iter().any(|r| r.kernel.starts_with("dma(")));
        assert!(rows.iter().any(|r| r.kernel.starts_with("dma-each(")));
        for r in &rows {
            assert!(r.ok, "{name} {}: {}", r.kernel, r.detail);
        }
    }
}

/// CUDA IPC within one process: a handle is refused by the process that exported it, by the
/// executor itself (a typed error, before the driver is called) and, for a handle that hides
/// where it came from, by the driver (`CUDA_ERROR_INVALID_CONTEXT`, as CUDA does). Ranks with
/// CUDA executors of their own in one process therefore cannot connect, and say why.
fn ipc_in_one_process_is_refused() {
    let owner = CudaExecutor::new(0).unwrap();
    let other = CudaExecutor::new(0).unwrap();
    assert_eq!(
        (owner.peer_mapping(), owner.maps_in_process()),
        (Some("ipc"), false)
    );
    let b = owner.alloc_shareable(4096, 0xA5).unwrap();
    let plain = owner.alloc(MemKind::Device, 64, 0).unwrap();
    let err = owner.export(plain).unwrap_err();
    assert!(
        matches!(&err, ExecError::Peer { op: "export", message }
            if message.contains("not allocated shareable")),
        "{err}"
    );
    let handle = owner.export(b).unwrap();
    for ex in [&owner, &other] {
        let err = ex.import(&handle).unwrap_err();
        assert!(
            err.to_string()
                .contains("cannot be opened in the process that made it"),
            "{err}"
        );
        assert!(
            matches!(err, ExecError::IpcSameProcess { buffer, pid }
                if buffer == b && pid == std::process::id()),
            "{err}"
        );
    }
    // A handle whose process token (bytes 12..20) is not this process's reaches the driver,
    // which refuses it as CUDA does; the error names the buffer, the call and the result.
    let mut forged = handle.clone();
    forged[12] ^= 0xFF;
    let err = other.import(&forged).unwrap_err();
    let shown = err.to_string();
    assert!(
        matches!(err, ExecError::Peer { op: "import", .. })
            && shown.contains(&format!("{b:?}"))
            && shown.contains("cuIpcOpenMemHandle")
            && shown.contains("CUDA_ERROR_INVALID_CONTEXT"),
        "{shown}"
    );
    assert!(matches!(
        other.import(b"cp-hicache-shm:64:/cp-hicache-1"),
        Err(ExecError::Peer { op: "import", .. })
    ));
    owner.free(plain).unwrap();
    owner.free(b).unwrap();
    drop((owner, other));

    // Two ranks of this process, each with its own CUDA executor: connecting fails on the
    // typed error, naming the peer.
    let mut deployment = Deployment::new(ModelShape::MlaBf16, 16, 2).unwrap();
    deployment.transfer_path = TransferPath::Kernel;
    let execs: Vec<Arc<dyn Executor>> = (0..2)
        .map(|_| {
            Arc::new(StandInGpu {
                cuda: CudaExecutor::new(0).unwrap(),
            }) as Arc<dyn Executor>
        })
        .collect();
    let err = Cluster::with_executors(rank_config(deployment), execs, &jit())
        .err()
        .expect("CUDA IPC cannot connect ranks of one process");
    assert!(
        matches!(
            err,
            ClusterError::PeerPool {
                source: ExecError::IpcSameProcess { .. },
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(live_allocations(), 0, "a failed start leaked driver memory");
}

/// The settings every rank process of the IPC tests uses.
fn rank_config(deployment: Deployment) -> ClusterConfig {
    let cp = u32::from(deployment.cp);
    ClusterConfig {
        deployment,
        layers: 2,
        device_pages: 16 * cp + 1,
        host_pages: 256,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: Sanitize::None,
    }
}

/// Runs this test binary again as the ignored test `test`, with `env` set (the stand-in
/// driver's folder is already first on the library path of this process).
fn spawn_self(test: &str, env: &[(&str, String)]) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args([
        "--ignored",
        "--exact",
        test,
        "--nocapture",
        "--test-threads=1",
    ])
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

fn assert_passed(what: &str, child: std::process::Child) {
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{what} failed:\n{stdout}\n{stderr}"
    );
}

const IPC_PEER_ENV: &str = "CP_HICACHE_FAKE_CUDA_IPC_PEER";
const IPC_PATTERN: std::ops::Range<u32> = 0..4096;

fn ipc_pattern() -> Vec<u8> {
    IPC_PATTERN.map(|i| (i * 7 + 3) as u8).collect()
}

/// CUDA IPC across processes, at the executor level: this process exports a buffer, another
/// process (this binary again, as `ipc_peer`) opens it through the stand-in driver, reads
/// what this one wrote and synchronised, writes through the mapping (upload, copy, fill),
/// and closes it; this process then sees those writes.
fn ipc_across_processes() {
    let owner = CudaExecutor::new(0).unwrap();
    let b = owner.alloc_shareable(8192, 0xA5).unwrap();
    owner.upload(b, 1000, &ipc_pattern()).unwrap();
    // A buffer freed before the peer opens it (its memory goes back to the driver once the
    // executor's streams are past the free: at the synchronisation below).
    let gone = owner.alloc_shareable(64, 0).unwrap();
    let gone_handle = owner.export(gone).unwrap();
    owner.free(gone).unwrap();
    // What a peer reads must have run first: the stream is asynchronous.
    owner.synchronize().unwrap();
    // Enqueued and never waited for: the peer must not see it (it would on a GPU only by
    // chance), which is why a rank synchronises before its peers read its pools.
    owner.upload(b, 5200, &[0x11; 64]).unwrap();
    let peer = spawn_self(
        "ipc_peer",
        &[(
            IPC_PEER_ENV,
            format!(
                "{} {}",
                hex::encode(owner.export(b).unwrap()),
                hex::encode(gone_handle)
            ),
        )],
    );
    assert_passed("the IPC peer process", peer);
    let mut out = vec![0u8; 8192];
    owner.read(b, 0, &mut out).unwrap();
    assert_eq!(out[..256], [0x5A; 256], "the peer's upload");
    let copied: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
    assert_eq!(out[6000..6512], copied[..], "the peer's copy");
    assert_eq!(out[7000..7016], [0x77; 16], "the peer's fill");
    assert_eq!(out[1000..5096], ipc_pattern()[..]);
    assert_eq!(
        out[5200..5264],
        [0x11; 64],
        "this process's own late upload"
    );
    owner.free(b).unwrap();
}

#[test]
#[ignore = "run by the stand-in driver's child, as a process of its own"]
fn ipc_peer() {
    let env = std::env::var(IPC_PEER_ENV).expect("run through ipc_across_processes");
    let (handle, gone) = env.split_once(' ').unwrap();
    let (handle, gone) = (hex::decode(handle).unwrap(), hex::decode(gone).unwrap());
    let peer = CudaExecutor::new(0).unwrap();
    let m = peer.import(&handle).unwrap();
    assert_eq!(peer.size(m).unwrap(), 8192);
    // A handle that claims more bytes than the allocation has (its size: bytes 28..36) is
    // refused after the driver says how large the mapping is; the mapping is closed again.
    let mut bigger = handle.clone();
    bigger[28..36].copy_from_slice(&(1u64 << 20).to_le_bytes());
    let err = peer.import(&bigger).unwrap_err().to_string();
    assert!(
        err.contains("an allocation of 8192 bytes") && err.contains("not the 1048576 bytes"),
        "{err}"
    );
    let mut out = vec![0u8; 4096];
    peer.read(m, 1000, &mut out).unwrap();
    assert_eq!(out, ipc_pattern(), "what the owner wrote and synchronised");
    peer.read(m, 5200, &mut out[..64]).unwrap();
    assert_eq!(out[..64], [0xA5; 64], "what the owner has not run yet");
    peer.upload(m, 0, &[0x5A; 256]).unwrap();
    let own = peer.alloc(MemKind::Device, 512, 0).unwrap();
    let copied: Vec<u8> = (0..512u32).map(|i| i as u8).collect();
    peer.upload(own, 0, &copied).unwrap();
    let region = CopyRegion {
        src_offset: 0,
        dst_offset: 6000,
        len: 512,
    };
    peer.copy_regions(own, m, &[region]).unwrap();
    peer.fill(m, &[(7000, 16)], 0x77).unwrap();
    // Bounds are the exporter's size.
    assert!(matches!(
        peer.read(m, 8190, &mut out[..4]),
        Err(ExecError::OutOfBounds { .. })
    ));
    // A buffer its owner freed cannot be opened: the driver's error, with context.
    let err = peer.import(&gone).unwrap_err().to_string();
    assert!(
        err.contains("cuIpcOpenMemHandle") && err.contains("CUDA_ERROR_INVALID_HANDLE"),
        "{err}"
    );
    peer.free(own).unwrap();
    // Freeing the mapping waits for the work on it, then closes it (cuIpcCloseMemHandle;
    // the stand-in's cuMemFree would refuse it, and a mapping left open counts as live).
    peer.free(m).unwrap();
    drop(peer);
    assert_eq!(live_allocations(), 0, "the mapping was not closed");
}

const RANK_ENV: &str = "CP_HICACHE_FAKE_CUDA_RANK";

/// The headline of engine mode on the stand-in driver: CP ranks as separate processes, each
/// with its own CUDA executor, agreeing through a collective over files
/// (`cp_hicache::group::FileGroup`) and reading each other's device pools through CUDA IPC
/// mappings. Every rank serves the same requests (computed, device hits, loaded back from
/// host after an eviction) and verifies the whole sequence over its own mappings with no
/// mismatch; then one rank maps a peer wrongly on purpose, and the mismatches show on that
/// rank only.
#[test]
fn ranks_in_separate_processes_share_pools_through_cuda_ipc() {
    let lib = build_fake_driver().to_str().unwrap().to_string();
    let group = tempfile::tempdir().unwrap();
    let cp = 4;
    let ranks: Vec<_> = (0..cp)
        .map(|r| {
            let at = format!("{r} {cp} {}", group.path().to_str().unwrap());
            spawn_self(
                "rank_process",
                &[("LD_LIBRARY_PATH", lib.clone()), (RANK_ENV, at)],
            )
        })
        .collect();
    for (r, child) in ranks.into_iter().enumerate() {
        assert_passed(&format!("rank process {r}"), child);
    }
}

#[test]
#[ignore = "run by ranks_in_separate_processes_share_pools_through_cuda_ipc, one process per rank"]
fn rank_process() {
    let env = std::env::var(RANK_ENV).expect("run through the multi-process test");
    let mut parts = env.splitn(3, ' ');
    let rank: u8 = parts.next().unwrap().parse().unwrap();
    let cp: u8 = parts.next().unwrap().parse().unwrap();
    let dir = PathBuf::from(parts.next().unwrap());
    let group =
        cp_hicache::group::FileGroup::new(dir, rank, usize::from(cp), Duration::from_secs(120));
    let gpu: Arc<dyn Executor> = Arc::new(StandInGpu {
        cuda: CudaExecutor::new(0).unwrap(),
    });
    let deployment = Deployment::new(ModelShape::MlaBf16, 16, cp).unwrap();
    let mut me = RankCache::new(
        rank_config(deployment),
        gpu.clone(),
        &jit(),
        Box::new(group),
        PeerAccess::Mapped,
    )
    .unwrap();
    assert_eq!((me.peer_pools(), me.group_kind()), ("ipc", "files"));
    let check = |me: &mut RankCache, t: &[u32]| {
        let s = me.serve(t).unwrap();
        assert_eq!(s.mismatched_tokens, 0, "rank {rank}: {s:?}");
        assert_eq!(s.load_path_syncs, 0, "rank {rank}: {s:?}");
        assert_eq!(me.last_verdict().by_rank, vec![0; usize::from(cp)]);
        let digests = me.all_digests("digests").unwrap();
        assert!(digests.iter().all(|d| *d == digests[0]), "replicas differ");
        me.check_invariants().unwrap();
        s
    };
    let ps = 16;
    let a = tokens(1, 5 * ps + 3);
    let first = check(&mut me, &a);
    assert_eq!(first.computed_tokens, a.len() as u64);
    let hit = check(&mut me, &a);
    assert!(hit.device_hit_tokens > 0, "{hit:?}");
    me.evict_device_lru(usize::MAX).unwrap();
    let back = check(&mut me, &a);
    assert_eq!(back.host_hit_tokens, 5 * ps as u64, "{back:?}");
    check(&mut me, &cat(&a[..3 * ps], &tokens(2, 2 * ps + 1)));
    begin_fences_loads_for_every_peer(&mut me, &tokens(4, 6 * ps));
    begin_fences_each_layer_for_every_peer(&mut me, &tokens(5, 6 * ps));
    // Rank 1 reads rank 2's pools where rank 0's should be: only rank 1 sees mismatches.
    if rank == 1 {
        me.debug_view_peer_as(0, 2);
    }
    let s = me.serve(&tokens(3, 6 * ps)).unwrap();
    let by_rank = &me.last_verdict().by_rank;
    assert!(
        s.mismatched_tokens > 0,
        "a wrong mapping went unseen: {s:?}"
    );
    assert!(
        by_rank[1] > 0 && by_rank.iter().enumerate().all(|(r, &n)| r == 1 || n == 0),
        "{by_rank:?}"
    );
    drop(me);
    drop(gpu);
    assert_eq!(live_allocations(), 0, "rank {rank} leaked driver memory");
    println!("rank {rank} of {cp}: served and verified through CUDA IPC");
}

const FENCE_OPEN_ENV: &str = "CP_HICACHE_FAKE_CUDA_FENCE_OPEN";

/// A peer's fence event that will not open (`cuIpcOpenEventHandle` refused): start-up ends
/// on every rank with a typed error, [`ClusterError::PeerFence`] naming the peer on the rank
/// that could not open it and [`ClusterError::StartFailed`] naming that rank on the others,
/// within a round (not at the group timeout); every event a rank created or opened is
/// destroyed again, and no rank leaves a shared-memory object behind. Once in the whole-load
/// ring, once in the per-layer ring (a rank opens each peer's whole ring, then its per-layer
/// one: with 2 layers, 6 events a peer, so rank 1's open 1 is rank 0's second whole slot,
/// and its open 8 is rank 2's first per-layer event). And a start-up that fails before any
/// open (rank 1 with another write policy: `ConfigDiverged` on every rank) releases every
/// rank's own events too (they were plain ids until the opens, and stayed alive).
#[test]
fn a_peer_fence_that_will_not_open_fails_start_up_naming_it() {
    let lib = build_fake_driver().to_str().unwrap().to_string();
    let cp = 3;
    for (open, peer, ring) in [
        ("1", 0, "whole"),
        ("8", 2, "per-layer"),
        ("diverge", 0, "no"),
    ] {
        let group = tempfile::tempdir().unwrap();
        let ranks: Vec<_> = (0..cp)
            .map(|r| {
                let at = format!("{r} {cp} {open} {peer} {}", group.path().to_str().unwrap());
                spawn_self(
                    "fence_open_rank_process",
                    &[("LD_LIBRARY_PATH", lib.clone()), (FENCE_OPEN_ENV, at)],
                )
            })
            .collect();
        let pids: Vec<u32> = ranks.iter().map(std::process::Child::id).collect();
        for (r, child) in ranks.into_iter().enumerate() {
            assert_ended(&format!("rank process {r} ({ring} ring)"), child);
        }
        let left: Vec<String> = std::fs::read_dir("/dev/shm")
            .map(|d| {
                d.filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| {
                        pids.iter().any(|p| {
                            n.starts_with(&format!("fake-cuda-{p}-"))
                                || n.starts_with(&format!("fake-cuda-ev-{p}-"))
                        })
                    })
                    .collect()
            })
            .unwrap_or_default();
        assert!(left.is_empty(), "{ring} ring: left in /dev/shm: {left:?}");
    }
}

/// Waits for a rank process that must pass within its group's timeout (10 s a round) and a
/// start-up's worth of time: one still running after 120 s has hung, and is killed.
fn assert_ended(what: &str, mut child: std::process::Child) {
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "{what} hung:\n{}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_passed(what, child);
}

#[test]
#[ignore = "run by a_peer_fence_that_will_not_open_fails_start_up_naming_it, one process per rank"]
fn fence_open_rank_process() {
    let env = std::env::var(FENCE_OPEN_ENV).expect("run through the fence open test");
    let parts: Vec<&str> = env.splitn(5, ' ').collect();
    let (rank, cp): (u8, u8) = (parts[0].parse().unwrap(), parts[1].parse().unwrap());
    // Rank 1 cannot open its `open`th peer event (or, with `diverge`, starts with another
    // write policy than its peers).
    let (open, peer): (Option<i32>, u8) = (parts[2].parse().ok(), parts[3].parse().unwrap());
    let dir = PathBuf::from(parts[4]);
    let failing = 1;
    let mut config = rank_config(Deployment::new(ModelShape::MlaBf16, 16, cp).unwrap());
    if rank == failing {
        match open {
            Some(k) => set_driver_count(b"fake_cuda_fail_ipc_event_open_at", k),
            None => config.policy = WritePolicy::WriteBack,
        }
    }
    let group =
        cp_hicache::group::FileGroup::new(dir, rank, usize::from(cp), Duration::from_secs(10));
    let gpu: Arc<dyn Executor> = Arc::new(StandInGpu {
        cuda: CudaExecutor::new(0).unwrap(),
    });
    let err = match RankCache::new(
        config,
        gpu.clone(),
        &jit(),
        Box::new(group),
        PeerAccess::Mapped,
    ) {
        Ok(_) => panic!("rank {rank} started though rank {failing} could not open a fence"),
        Err(e) => e,
    };
    let text = err.to_string();
    if open.is_none() {
        assert!(
            matches!(&err, ClusterError::ConfigDiverged { .. }) && text.contains("write policy"),
            "{err:?}"
        );
    } else if rank == failing {
        assert!(
            matches!(&err, ClusterError::PeerFence { rank: r, peer: p, .. }
                if *r == failing && *p == peer),
            "{err:?}"
        );
        assert!(
            text.contains(&format!("cannot open rank {peer}'s fence events"))
                && text.contains("CUDA_ERROR_INVALID_VALUE"),
            "{text}"
        );
    } else {
        let ClusterError::StartFailed { failures, .. } = &err else {
            panic!("rank {rank}: {err:?}");
        };
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert_eq!(failures[0].0, failing, "{failures:?}");
        assert!(
            failures[0]
                .1
                .contains(&format!("cannot open rank {peer}'s fence events")),
            "{failures:?}"
        );
    }
    // Every event this rank made or opened is gone while its executor lives (an engine
    // may try again in the same process), then every allocation with the executor.
    assert_eq!(
        driver_count(b"fake_cuda_live_ipc_events"),
        0,
        "rank {rank} kept interprocess events: {text}"
    );
    drop(gpu);
    assert_eq!(live_allocations(), 0, "rank {rank} leaked driver memory");
    println!("rank {rank} of {cp}: start-up refused as it should be: {text}");
}

/// Every page of `req`, every layer and buffer kind, read through this rank's views of its
/// owners' pools (its own, and its IPC mappings of its peers'), in sequence order.
fn read_through_views(me: &RankCache, req: &cp_hicache::rank::Request) -> Vec<Vec<u8>> {
    let g = me.pools().geometry();
    let mut out = Vec::new();
    for &p in req.pages() {
        let owner = usize::from(me.layout().owner(p).0);
        let local = u64::from(me.layout().local(p).0);
        for kind in me.config().deployment.model.buffers() {
            let n = kind.page_bytes(me.layout().page_size());
            for layer in 0..u64::from(g.layers) {
                let mut bytes = vec![0u8; n as usize];
                let at = (layer * u64::from(g.local_pages) + local) * n;
                me.executor()
                    .read(
                        me.pools().views(kind)[owner]
                            .as_ref()
                            .and_then(|v| v.buffer)
                            .expect("the cache's own pool"),
                        at,
                        &mut bytes,
                    )
                    .unwrap();
                out.push(bytes);
            }
        }
    }
    out
}

/// Finding 1 of the engine-safety review: `begin` returned once this rank's load-back was
/// queued, but a peer's copies run on the peer's own stream (another process): reading
/// through the IPC mapping right after `begin` saw stale (poisoned) pages. Now `begin`
/// returns only when every rank's loaded pages are in its pool.
fn begin_fences_loads_for_every_peer(me: &mut RankCache, prompt: &[u32]) {
    let rank = me.rank().0;
    let cp = me.group().size() as u64;
    let want = served_then_evicted(me, prompt);
    let waits = driver_count(b"fake_cuda_ipc_event_waits");
    let mut req = me.begin(prompt).unwrap();
    assert_eq!(req.stats().pages_loaded, req.pages().len() as u64);
    assert_eq!(
        driver_count(b"fake_cuda_ipc_event_waits") - waits,
        cp - 1,
        "rank {rank}: one wait on each peer's fence"
    );
    // Straight after `begin`, with no wait or synchronisation of its own: every peer page
    // a rank sees was made readable by `begin` alone.
    let stale = stale_reads(me, &req, &want);
    assert_eq!(
        stale, 0,
        "rank {rank}: {stale} page-layers read stale after begin"
    );
    // The fence was interprocess events, not a host synchronisation: the cache's stream
    // waited for each peer's on the device.
    assert_eq!(req.stats().fence_syncs, 0, "rank {rank}: {:?}", req.stats());
    me.abandon(&mut req).unwrap();
    // The device refuses the waits on the peers' fences: the host waits for each instead,
    // and the pages are as current.
    let want = served_then_evicted(me, prompt);
    let syncs = driver_count(b"fake_cuda_ipc_event_syncs");
    set_driver_count(b"fake_cuda_fail_ipc_waits", cp as i32 - 1);
    let mut req = me.begin(prompt).unwrap();
    assert_eq!(
        driver_count(b"fake_cuda_ipc_event_syncs") - syncs,
        cp - 1,
        "rank {rank}: a host wait for each peer's refused fence"
    );
    let stale = stale_reads(me, &req, &want);
    assert_eq!(
        stale, 0,
        "rank {rank}: {stale} page-layers read stale after refused waits"
    );
    me.abandon(&mut req).unwrap();
}

/// Serves `prompt`, then evicts it from every rank's device pool (poisoned, the poison
/// landed everywhere): what each rank reads through its views of the owners' pools after
/// the next load must be `want`, the pages as they were.
fn served_then_evicted(me: &mut RankCache, prompt: &[u32]) -> Vec<Vec<u8>> {
    let rank = me.rank().0;
    me.serve(prompt).unwrap();
    let mut req = me.begin(prompt).unwrap();
    assert_eq!(
        req.cached_pages(),
        req.pages().len(),
        "rank {rank}: a device hit"
    );
    let want = read_through_views(me, &req);
    me.abandon(&mut req).unwrap();
    me.evict_device_lru(usize::MAX).unwrap();
    me.executor().synchronize().unwrap();
    me.group().barrier("poison landed").unwrap();
    want
}

/// Rank 0 reads every page of `req` through its views first, while no peer has read
/// anything (a read flushes the reader's own stream, which would land its loads), then
/// the others: the page-layers that differ from `want`.
fn stale_reads(me: &RankCache, req: &cp_hicache::rank::Request, want: &[Vec<u8>]) -> usize {
    let rank = me.rank().0;
    let mut got = Vec::new();
    if rank == 0 {
        got = read_through_views(me, req);
    }
    me.group().barrier("rank 0 read").unwrap();
    if rank != 0 {
        got = read_through_views(me, req);
    }
    want.iter().zip(&got).filter(|(w, g)| w != g).count()
}

/// With the engine waiting per layer (`set_layer_waits`), `begin` in a group of processes
/// waits for no peer: each load records its rank's per-layer interprocess events as it is
/// enqueued, and `wait_layer(l)` waits, on the device, for layer `l` of every peer's load
/// of the step (one event a peer, a different one each layer), with its own. A wait the
/// device refuses falls back to the host.
fn begin_fences_each_layer_for_every_peer(me: &mut RankCache, prompt: &[u32]) {
    let rank = me.rank().0;
    let cp = me.group().size() as u64;
    let layers = me.pools().geometry().layers;
    me.set_layer_waits(true);
    let want = served_then_evicted(me, prompt);
    let (waits, events) = (
        driver_count(b"fake_cuda_ipc_event_waits"),
        driver_count(b"fake_cuda_ipc_events_waited"),
    );
    let mut req = me.begin(prompt).unwrap();
    assert_eq!(req.stats().pages_loaded, req.pages().len() as u64);
    assert_eq!(
        driver_count(b"fake_cuda_ipc_event_waits"),
        waits,
        "rank {rank}: begin waited for a peer's whole load"
    );
    let load = req.load().expect("a load-back");
    for l in 0..layers {
        let (w, e) = (
            driver_count(b"fake_cuda_ipc_event_waits"),
            driver_count(b"fake_cuda_ipc_events_waited"),
        );
        load.wait_layer(l).unwrap();
        assert_eq!(
            (
                driver_count(b"fake_cuda_ipc_event_waits") - w,
                driver_count(b"fake_cuda_ipc_events_waited") - e
            ),
            (cp - 1, cp - 1),
            "rank {rank}, layer {l}: one wait on each peer's own event of the layer"
        );
    }
    assert_eq!(
        driver_count(b"fake_cuda_ipc_events_waited") - events,
        (cp - 1) * u64::from(layers)
    );
    // A wait the device refuses: the host waits for that peer's layer instead.
    let syncs = driver_count(b"fake_cuda_ipc_event_syncs");
    set_driver_count(b"fake_cuda_fail_ipc_waits", cp as i32 - 1);
    load.wait_layer(layers - 1).unwrap();
    assert_eq!(driver_count(b"fake_cuda_ipc_event_syncs") - syncs, cp - 1);
    let stale = stale_reads(me, &req, &want);
    assert_eq!(
        stale, 0,
        "rank {rank}: {stale} page-layers read stale after waiting for every layer"
    );
    assert_eq!(req.stats().fence_syncs, 0, "rank {rank}: {:?}", req.stats());
    me.abandon(&mut req).unwrap();
    me.set_layer_waits(false);
}

/// The stand-in driver's counters of streams and events, in one snapshot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct StreamCounts {
    /// Launches and copies enqueued on a stream of greater priority.
    prioritised_work: u64,
    /// Waits issued on a stream of greater priority.
    waits_on_prioritised: u64,
    /// Waits issued on another stream for an event recorded on one.
    waits_for_prioritised: u64,
    events_created: u64,
}

impl StreamCounts {
    fn now() -> StreamCounts {
        StreamCounts {
            prioritised_work: driver_count(b"fake_cuda_prioritised_work"),
            waits_on_prioritised: driver_count(b"fake_cuda_waits_on_prioritised"),
            waits_for_prioritised: driver_count(b"fake_cuda_waits_for_prioritised"),
            events_created: driver_count(b"fake_cuda_events_created"),
        }
    }

    fn since(self, before: StreamCounts) -> StreamCounts {
        StreamCounts {
            prioritised_work: self.prioritised_work - before.prioritised_work,
            waits_on_prioritised: self.waits_on_prioritised - before.waits_on_prioritised,
            waits_for_prioritised: self.waits_for_prioritised - before.waits_for_prioritised,
            events_created: self.events_created - before.events_created,
        }
    }
}

/// Issue 29's load stream: a load whose reader waits per layer runs on a stream of its own
/// at the greatest priority (the transfer's launches there, nothing else), its reader
/// waits for each layer on the cache's stream (never on the load stream, which waits once
/// per load, for the work before it), and its events come from a pool: none is created
/// after the first loads, over 1,000 layer loads. An engine's stream handed in gets the
/// per-layer waits instead of the cache's. Without per-layer readers, a load is one
/// all-layer launch on the cache's stream.
fn loads_run_on_a_prioritised_stream_of_their_own() {
    let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
    let layers = 8u32;
    let mut me = one_rank(
        &gpu,
        Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap(),
        layers,
    );
    let prompt = tokens(7, 4 * 16);
    me.serve(&prompt).unwrap();

    // The engine's path, its reader waiting per layer.
    me.set_layer_waits(true);
    let load_once = |me: &mut RankCache| {
        me.evict_device_lru(usize::MAX).unwrap();
        let before = StreamCounts::now();
        let launches = gpu.counters().launches;
        let mut req = me.begin(&prompt).unwrap();
        let load = req.load().expect("a host hit loads back");
        assert_eq!(load.layers(), layers);
        let loaded = StreamCounts::now().since(before);
        for l in 0..layers {
            load.wait_layer(l).unwrap();
        }
        let waited = StreamCounts::now().since(before);
        me.abandon(&mut req).unwrap();
        // The stand-in runs queued work only when something waits: without this, every
        // staged upload (page lists) would still be in flight and its ring event unreusable,
        // as no GPU would leave it.
        gpu.synchronize().unwrap();
        (loaded, waited, gpu.counters().launches - launches)
    };
    let (loaded, waited, by_layer) = load_once(&mut me);
    // 4 pages are 4 of the default launch's 64 warp groups: 4 layers a launch
    // (`KernelSpec::layers_per_launch`), each layer with its event.
    let launches_by_layer = u64::from(layers.div_ceil(MAX_LAYERS_PER_LAUNCH));
    // The page lists and the transfer, a launch per 4 layers, on the load stream, which
    // waits once, for the work before the load.
    assert!(loaded.prioritised_work >= launches_by_layer, "{loaded:?}");
    assert_eq!(loaded.waits_on_prioritised, 1, "{loaded:?}");
    assert_eq!(loaded.waits_for_prioritised, 0, "{loaded:?}");
    // The reader's waits, one per layer, on the cache's stream.
    assert_eq!(waited.waits_on_prioritised, 1, "{waited:?}");
    assert_eq!(
        waited.waits_for_prioritised,
        u64::from(layers),
        "{waited:?}"
    );
    let created = StreamCounts::now().events_created;
    let mut layer_loads = u64::from(layers);
    while layer_loads < 1000 {
        let (loaded, waited, _) = load_once(&mut me);
        assert_eq!(loaded.waits_on_prioritised, 1, "{loaded:?}");
        assert_eq!(waited.waits_for_prioritised, u64::from(layers));
        layer_loads += u64::from(layers);
    }
    assert_eq!(
        StreamCounts::now().events_created,
        created,
        "{layer_loads} layer loads created events"
    );

    // An engine's attention waits per layer on its own stream, handed in: each wait is
    // issued on that stream, for an event of the load stream, and none on the cache's.
    me.evict_device_lru(usize::MAX).unwrap();
    let mut engine: cudarc::driver::sys::CUstream = std::ptr::null_mut();
    // SAFETY: the executor made its context current on this thread.
    unsafe { cudarc::driver::sys::cuStreamCreate(&mut engine, 0) }
        .result()
        .unwrap();
    let engine_waits = || {
        // SAFETY: the stand-in driver's hook reads the counter of a live stream of its own.
        unsafe {
            let lib = libloading::Library::new("libcuda.so").unwrap();
            let f: libloading::Symbol<unsafe extern "C" fn(cudarc::driver::sys::CUstream) -> u64> =
                lib.get(b"fake_cuda_stream_waits").unwrap();
            f(engine)
        }
    };
    let mut req = me.begin(&prompt).unwrap();
    let load = req.load().expect("a host hit loads back");
    let before = (StreamCounts::now(), engine_waits());
    for l in 0..layers {
        // SAFETY: `engine` is a live stream of the executor's context.
        unsafe { load.wait_layer_on(l, engine as u64) }.unwrap();
    }
    let after = StreamCounts::now().since(before.0);
    assert_eq!(engine_waits() - before.1, u64::from(layers));
    assert_eq!(after.waits_for_prioritised, u64::from(layers), "{after:?}");
    assert_eq!(after.waits_on_prioritised, 0, "{after:?}");
    // A layer outside the load is refused before the driver is called.
    // SAFETY: as above.
    let err = unsafe { load.wait_layer_on(layers, engine as u64) }.unwrap_err();
    assert!(err.to_string().contains("layer"), "{err}");
    assert_eq!(engine_waits() - before.1, u64::from(layers));
    me.abandon(&mut req).unwrap();
    gpu.synchronize().unwrap();
    // SAFETY: nothing is enqueued on it any more.
    unsafe { cudarc::driver::sys::cuStreamDestroy_v2(engine) }
        .result()
        .unwrap();

    // Without per-layer readers: one all-layer launch, none of it on the load stream.
    me.set_layer_waits(false);
    let (loaded, waited, launches) = load_once(&mut me);
    assert_eq!(loaded, StreamCounts::default(), "{loaded:?}");
    assert_eq!(waited.waits_for_prioritised, 0, "{waited:?}");
    assert_eq!(
        by_layer - launches,
        launches_by_layer - 1,
        "one transfer launch for every layer, not one per 4 layers"
    );

    // The serving cycle's reader (verification) waits per layer: its loads go to the load
    // stream, and every byte still verifies.
    me.evict_device_lru(usize::MAX).unwrap();
    let before = StreamCounts::now();
    let s = me.serve(&prompt).unwrap();
    let after = StreamCounts::now().since(before);
    assert_eq!(s.host_hit_tokens, prompt.len() as u64, "{s:?}");
    assert_eq!(s.mismatched_tokens, 0, "{s:?}");
    assert!(
        after.waits_for_prioritised >= u64::from(layers),
        "{after:?}"
    );
    drop(me);
    drop(gpu);
    assert_eq!(live_allocations(), 0, "leaked driver memory");
}

/// `cp_hicache::ops` on memory the caller allocated through the driver (device memory and
/// pinned host memory, adopted for each call and never freed by the ops), with a stream of
/// the caller's: the transfer's bytes are the reference's, and an op given the stream orders
/// itself after the caller's work and the caller's stream after it (two cross-stream waits;
/// none without a stream).
fn ops_on_the_callers_memory_and_stream() {
    use cp_hicache::kernels::{reference, BufferKind, Direction};
    use cp_hicache::ops::{Ops, Region, Tensors};
    // The plain CUDA executor: it finds the stand-in driver and builds host libraries for
    // it (as `cp_hicache.ops` with backend="cuda" does from Python).
    let cuda = CudaExecutor::new(0).unwrap();
    assert!(cuda.runs_emulated_kernels());
    let exec: Arc<dyn Executor> = Arc::new(cuda);
    let dep = Deployment::new(ModelShape::MlaBf16, 16, 2).unwrap();
    let ops = Ops::warm_up(dep.clone(), 2, exec.clone(), &jit(), Sanitize::None).unwrap();
    let pb = BufferKind::MlaKv.page_bytes(16);
    let (dev_bytes, host_bytes) = (2 * 4 * pb, 2 * 6 * pb);
    let dev = exec
        .alloc(MemKind::Device, dev_bytes as usize, 0x11)
        .unwrap();
    let host = exec.alloc(MemKind::Host, host_bytes as usize, 0).unwrap();
    let pattern: Vec<u8> = (0..host_bytes).map(|i| (i * 7 % 251) as u8).collect();
    exec.upload(host, 0, &pattern).unwrap();
    let region = |b: BufferId, bytes: u64| Region {
        addr: exec.address(b).unwrap().ptr,
        bytes,
    };
    let device = [Tensors::CrossLayer(region(dev, dev_bytes))];
    let hosts = [Tensors::CrossLayer(region(host, host_bytes))];
    // A stream of the caller's, in the executor's context.
    let mut stream: cudarc::driver::sys::CUstream = std::ptr::null_mut();
    // SAFETY: the executor made its context current on this thread.
    unsafe { cudarc::driver::sys::cuStreamCreate(&mut stream, 0) }
        .result()
        .unwrap();
    let waits = || driver_count(b"fake_cuda_cross_stream_waits");
    let before = waits();
    let (src, dst) = ([5u32, 0, 2], [3u32, 1, 0]);
    // SAFETY: the memory and the stream live across the call.
    let moved = unsafe {
        ops.on_stream(Some(stream as u64), |o| {
            o.transfer(Direction::HostToDevice, &device, &hosts, &src, &dst, 0..2)
        })
    }
    .unwrap();
    assert_eq!(moved, 3 * 2 * pb);
    assert_eq!(
        waits() - before,
        2,
        "after the caller's stream, and it after the op"
    );
    let mut got = vec![0u8; dev_bytes as usize];
    exec.read(dev, 0, &mut got).unwrap();
    let mut want = vec![0x11u8; dev_bytes as usize];
    reference::transfer_pages(
        Direction::HostToDevice,
        dep.host_layout,
        pb,
        &pattern,
        &mut want,
        &src,
        &dst,
        3,
        2,
        0,
        2,
        4,
        6,
    )
    .unwrap();
    assert!(got == want, "the transfer's bytes are the reference's");
    let before = waits();
    // SAFETY: as above.
    unsafe {
        ops.on_stream(None, |o| {
            o.transfer(Direction::DeviceToHost, &device, &hosts, &[1], &[4], 0..1)
        })
    }
    .unwrap();
    assert_eq!(waits(), before, "no stream, no cross-stream wait");
    // SAFETY: created above, no work pending on it after the op's synchronisation.
    unsafe { cudarc::driver::sys::cuStreamDestroy_v2(stream) }
        .result()
        .unwrap();
    exec.free(dev).unwrap();
    exec.free(host).unwrap();
}

/// A one-rank cache (`PeerAccess::Direct`, a local group of one) of `layers` layers on `gpu`.
fn one_rank(gpu: &Arc<dyn Executor>, dep: Deployment, layers: u32) -> RankCache {
    let mut config = rank_config(dep);
    config.layers = layers;
    let group = cp_hicache::group::LocalGroup::members(1, Duration::from_secs(60))
        .pop()
        .unwrap();
    RankCache::new(
        config,
        gpu.clone(),
        &jit(),
        Box::new(group),
        PeerAccess::Direct,
    )
    .unwrap()
}

/// The race checker (tests/fake_cuda/streams.h) and the three stream races of issue 42, under
/// every scheduling mode: `child_streams` in a process of its own per mode (a process whose
/// races were not taken exits with status 86, so an unexpected race fails here too).
#[test]
fn streams_race_checker_and_the_load_races() {
    let dir = build_fake_driver();
    // The race checker orders by happens-before, not by what ran first, so every mode
    // reports the same races; the modes differ in the mismatches a missing wait shows.
    // `eager` (one queue, the stand-in as it was) shows none of them, and a second random
    // seed found nothing the first had not (`.ci/run` runs the driver's other tests under a
    // third).
    for (mode, seed) in [("lazy", "0"), ("adversarial", "0"), ("random", "1")] {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "child_streams",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("LD_LIBRARY_PATH", &dir)
            .env(CHILD_ENV, "1")
            .env("FAKE_CUDA_SCHED", mode)
            .env("FAKE_CUDA_SEED", seed)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "child_streams under FAKE_CUDA_SCHED={mode} FAKE_CUDA_SEED={seed} failed \
             ({}):\n{stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
#[ignore = "run by streams_race_checker_and_the_load_races, in a process that loads the stand-in libcuda"]
fn child_streams() {
    assert_eq!(std::env::var(CHILD_ENV).as_deref(), Ok("1"));
    race_checker_self_tests();
    failed_load_orders_the_cache_stream_after_its_layers();
    back_to_back_loads_keep_their_page_ids();
    a_step_of_loads_rolled_back_by_a_failed_admission();
    serving_makes_no_context_wide_synchronisation();
    loads_do_not_wait_for_backups();
    freed_pages_wait_for_their_backup();
    a_refused_backup_wait_waits_on_the_host();
    assert_eq!(driver_count(b"fake_cuda_races"), 0);
    assert_eq!(live_allocations(), 0);
}

/// The bytes of a pinned host buffer as they are now, read from the CPU without waiting for
/// any stream (undeclared to the race checker: a test's look at what has run).
fn host_bytes_now(gpu: &Arc<dyn Executor>, buf: BufferId) -> Vec<u8> {
    let a = gpu.address(buf).unwrap();
    let len = gpu.size(buf).unwrap();
    // SAFETY: a live pinned allocation of `len` bytes whose device address is its host
    // address (the stand-in's memory is host memory); only read.
    unsafe { std::slice::from_raw_parts(a.ptr as *const u8, len) }.to_vec()
}

/// P1 of issue 42: backups run on a stream of their own (the least priority), so a request's
/// load does not queue behind another's write-through backup. Under `lazy` and
/// `adversarial` the stand-in runs only what a wait needs: when the load has been waited
/// for and read, the backup has not run (the host pool still holds what it held), and a
/// synchronisation then runs it; the backed-up copy loads back and verifies.
fn loads_do_not_wait_for_backups() {
    use cp_hicache::kernels::BufferKind;
    // 1 = lazy, 2 = adversarial (tests/fake_cuda/streams.h `Mode`).
    let only_what_is_needed = matches!(driver_count(b"fake_cuda_sched_mode") & 0xffff_ffff, 1 | 2);
    for path in [TransferPath::Kernel, TransferPath::Dma] {
        let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
        let mut dep = Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap();
        dep.transfer_path = path;
        let mut me = one_rank(&gpu, dep, 4);
        let (a, b) = (tokens(41, 6 * 16), tokens(42, 5 * 16));
        assert_eq!(me.serve(&b).unwrap().mismatched_tokens, 0);
        me.evict_device_lru(usize::MAX).unwrap();
        gpu.synchronize().unwrap();
        let host = me.pools().host(BufferKind::MlaKv);
        let before = host_bytes_now(&gpu, host);
        // A's prefill: finishing it backs it up (write-through), on the backup stream.
        let mut ra = me.begin_allocated(&a).unwrap();
        me.synthesise(&mut ra).unwrap();
        me.finish(&mut ra).unwrap();
        // B's prefix loads back layer by layer and is read (a device read: the cache's
        // stream only).
        me.set_layer_waits(true);
        let mut rb = me.begin_allocated(&b).unwrap();
        assert!(rb.load().is_some(), "{path:?}: a host hit loads back");
        let v = me.synthesise_and_verify(&mut rb).unwrap();
        assert_eq!(v.all.count, 0, "{path:?}: B's tokens");
        if only_what_is_needed {
            assert!(
                host_bytes_now(&gpu, host) == before,
                "{path:?}: A's backup ran before B's load was read: the load waited for it"
            );
        }
        me.finish(&mut rb).unwrap();
        gpu.synchronize().unwrap();
        assert!(
            host_bytes_now(&gpu, host) != before,
            "{path:?}: A's backup never ran"
        );
        // A's copy is A's.
        me.evict_device_lru(usize::MAX).unwrap();
        let mut ra = me.begin_allocated(&a).unwrap();
        assert!(ra.load().is_some(), "{path:?}: A's host copy loads back");
        let v = me.synthesise_and_verify(&mut ra).unwrap();
        assert_eq!(v.all.count, 0, "{path:?}: A's tokens from its backup");
        me.finish(&mut ra).unwrap();
        assert_eq!(take_races(), 0, "{path:?}: races");
        drop(me);
        drop(gpu);
    }
}

/// The other half of P1: pages a pending backup reads are freed only after it. A's backup
/// is enqueued; at once A's pages are evicted from the device and handed to C (it needs more
/// pages than A left unused), whose prefill writes them. The eviction orders the cache's stream after A's backup (a device
/// wait), so A's host copy holds A's bytes, not C's, and loads back clean; the checker sees
/// no race between the backup's reads and C's writes.
fn freed_pages_wait_for_their_backup() {
    for path in [TransferPath::Kernel, TransferPath::Dma] {
        let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
        let mut dep = Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap();
        dep.transfer_path = path;
        let mut me = one_rank(&gpu, dep, 4);
        for round in 0..2u32 {
            let (a, c) = (
                tokens(51 + 2 * round, 8 * 16),
                tokens(52 + 2 * round, 15 * 16),
            );
            let mut ra = me.begin_allocated(&a).unwrap();
            me.synthesise(&mut ra).unwrap();
            me.finish(&mut ra).unwrap();
            me.evict_device_lru(usize::MAX).unwrap();
            let mut rc = me.begin_allocated(&c).unwrap();
            me.synthesise(&mut rc).unwrap();
            me.finish(&mut rc).unwrap();
            me.evict_device_lru(usize::MAX).unwrap();
            me.set_layer_waits(round == 1);
            let mut ra = me.begin_allocated(&a).unwrap();
            assert!(ra.load().is_some(), "{path:?} round {round}: A loads back");
            let v = me.synthesise_and_verify(&mut ra).unwrap();
            assert_eq!(
                v.all.count, 0,
                "{path:?} round {round}: A's host copy holds another request's bytes"
            );
            me.finish(&mut ra).unwrap();
            me.evict_device_lru(usize::MAX).unwrap();
            assert_eq!(take_races(), 0, "{path:?} round {round}: races");
        }
        drop(me);
        drop(gpu);
    }
}

/// A free whose backup wait the device refuses: the host waits instead, the eviction
/// completes (its pages back in the allocator, not lost between the tree and it), and the
/// backup's copy is whole when the pages are written again. Under `lazy` the backup has
/// not run when the wait is refused, so freeing without any wait would let C's prefill
/// overwrite A's pages before they are copied; returning the error left the evicted pages
/// out of both the tree and the allocator.
fn a_refused_backup_wait_waits_on_the_host() {
    let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
    let mut me = one_rank(
        &gpu,
        Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap(),
        4,
    );
    let free_pages = |me: &RankCache| me.lane_free_counts().iter().sum::<u32>();
    let empty = free_pages(&me);
    let (a, c) = (tokens(71, 8 * 16), tokens(72, 15 * 16));
    let mut ra = me.begin_allocated(&a).unwrap();
    me.synthesise(&mut ra).unwrap();
    me.finish(&mut ra).unwrap();
    // A's backup is pending; the device refuses the eviction's wait for it.
    set_failed_stream_waits(1);
    me.evict_device_lru(usize::MAX).unwrap();
    set_failed_stream_waits(0);
    assert_eq!(
        free_pages(&me),
        empty,
        "the evicted pages went back to the allocator"
    );
    me.check_invariants().unwrap();
    let mut rc = me.begin_allocated(&c).unwrap();
    me.synthesise(&mut rc).unwrap();
    me.finish(&mut rc).unwrap();
    me.evict_device_lru(usize::MAX).unwrap();
    let mut ra = me.begin_allocated(&a).unwrap();
    assert!(ra.load().is_some(), "A loads back");
    let v = me.synthesise_and_verify(&mut ra).unwrap();
    assert_eq!(v.all.count, 0, "A's host copy holds C's bytes");
    me.finish(&mut ra).unwrap();
    me.evict_device_lru(usize::MAX).unwrap();
    assert_eq!(take_races(), 0);
    drop(me);
    drop(gpu);
}

/// Makes the stand-in refuse the next `n` cuStreamWaitEvent calls.
fn set_failed_stream_waits(n: i32) {
    set_driver_count(b"fake_cuda_fail_stream_waits", n)
}

/// Sets one of the stand-in driver's failure counters.
fn set_driver_count(hook: &[u8], n: i32) {
    // SAFETY: the stand-in driver's hook sets a counter.
    unsafe {
        let lib = libloading::Library::new("libcuda.so").unwrap();
        let f: libloading::Symbol<unsafe extern "C" fn(i32)> = lib.get(hook).unwrap();
        f(n)
    }
}

/// Races found so far, forgotten (the process would exit 86 for them otherwise).
fn take_races() -> u64 {
    driver_count(b"fake_cuda_take_races")
}

/// A stream of the executor's context, as an engine would make one.
fn engine_stream() -> cudarc::driver::sys::CUstream {
    let mut s: cudarc::driver::sys::CUstream = std::ptr::null_mut();
    // SAFETY: the caller's executor made its context current on this thread.
    unsafe { cudarc::driver::sys::cuStreamCreate(&mut s, 1) }
        .result()
        .unwrap();
    s
}

/// The checker's self-tests: work on two streams that touches the same bytes, unordered, is
/// a race (a write against a write, a read against a write, a free against pending work);
/// the same work ordered by an event, or touching other bytes, or only reading, is not.
fn race_checker_self_tests() {
    use cudarc::driver::{result, sys};
    let ex = CudaExecutor::new(0).unwrap();
    let buf = ex.alloc(MemKind::Device, 4096, 0).unwrap();
    let addr = ex.address(buf).unwrap().ptr;
    ex.synchronize().unwrap();
    let engine = engine_stream();
    let memset = |at: u64, n: usize, v: u8| {
        // SAFETY: inside the live buffer; the engine stream is live.
        unsafe { result::memset_d8_async(at, v, n, engine) }.unwrap()
    };
    assert_eq!(take_races(), 0);

    // A write on the cache's stream and one on the engine's, unordered: caught.
    ex.fill(buf, &[(0, 256)], 1).unwrap();
    memset(addr + 128, 16, 2);
    assert_eq!(take_races(), 1, "an unordered write pair");
    // Ordered through an event (the engine's stream waits for the cache's): not a race.
    ex.fill(buf, &[(1024, 256)], 1).unwrap();
    // SAFETY: a live stream of the context.
    unsafe { ex.lead_stream(engine as u64) }.unwrap();
    memset(addr + 1024, 16, 2);
    assert_eq!(take_races(), 0, "an ordered pair");
    // Other bytes, unordered: not a race.
    ex.fill(buf, &[(2048, 64)], 1).unwrap();
    memset(addr + 3072, 64, 2);
    assert_eq!(take_races(), 0, "disjoint bytes");
    // A read against a write, unordered: caught (the engine's write, then the cache reads the
    // bytes in a copy without waiting for it).
    memset(addr + 512, 64, 3);
    ex.copy_regions(
        buf,
        buf,
        &[CopyRegion {
            src_offset: 512,
            dst_offset: 3584,
            len: 64,
        }],
    )
    .unwrap();
    assert_eq!(take_races(), 1, "an unordered read of a write");
    // After a synchronisation of both, the host has seen everything: no race.
    ex.synchronize().unwrap();
    // SAFETY: a live stream.
    unsafe { sys::cuStreamSynchronize(engine) }
        .result()
        .unwrap();
    memset(addr, 4096, 4);
    ex.synchronize().unwrap();
    assert_eq!(take_races(), 0, "work ordered by host synchronisations");

    // A CPU read of pinned memory that an unordered copy writes: caught (the executor's read
    // waits for its own streams, not the engine's); after the engine's stream, not.
    let pinned = ex.alloc(MemKind::Host, 256, 0).unwrap();
    let pin = ex.address(pinned).unwrap().ptr;
    // SAFETY: both ranges are inside live allocations; the stream is live.
    unsafe { sys::cuMemcpyAsync(pin, addr, 256, engine) }
        .result()
        .unwrap();
    let mut out = [0u8; 256];
    ex.read(pinned, 0, &mut out).unwrap();
    assert_eq!(
        take_races(),
        1,
        "a CPU read of pinned memory a pending copy writes"
    );
    // SAFETY: a live stream.
    unsafe { sys::cuStreamSynchronize(engine) }
        .result()
        .unwrap();
    ex.read(pinned, 0, &mut out).unwrap();
    assert_eq!(take_races(), 0, "a CPU read after the copy");
    ex.free(pinned).unwrap();

    // A free of memory that unordered work still writes: caught.
    // SAFETY: plain driver calls on this context; the memory is freed once.
    unsafe {
        let raw = result::malloc_sync(1024).unwrap();
        result::memset_d8_async(raw, 7, 1024, engine).unwrap();
        result::free_sync(raw).unwrap();
        assert_eq!(take_races(), 1, "a free of memory pending work writes");
        let raw = result::malloc_sync(1024).unwrap();
        result::memset_d8_async(raw, 7, 1024, engine).unwrap();
        sys::cuStreamSynchronize(engine).result().unwrap();
        result::free_sync(raw).unwrap();
        assert_eq!(take_races(), 0, "a free after the stream's work");
    }
    // Every launch of the cache declared what it reaches.
    assert_eq!(driver_count(b"fake_cuda_undeclared_launches"), 0);
    ex.free(buf).unwrap();
    // SAFETY: nothing is enqueued on it any more.
    unsafe { sys::cuStreamDestroy_v2(engine) }.result().unwrap();
    assert_eq!(take_races(), 0);
}

/// C3 of issue 42: a layer-wise load that fails part-way (here its second layer's copy is
/// refused) must leave the cache's stream ordered after the layers it did enqueue, which
/// still run: a rollback then poisons and frees their pages. Before the fix the poison fill
/// raced the first layer's copy (the checker's report), and under `adversarial` scheduling
/// the copy landed after the fill: the poisoned bytes read back as the load's.
fn failed_load_orders_the_cache_stream_after_its_layers() {
    let ex = CudaExecutor::new(0).unwrap();
    let host = ex.alloc(MemKind::Host, 4096, 0x11).unwrap();
    let dev = ex.alloc(MemKind::Device, 4096, 0).unwrap();
    ex.synchronize().unwrap();
    let region = |len| CopyRegion {
        src_offset: 0,
        dst_offset: 0,
        len,
    };
    let layers = vec![
        vec![LoadOp::Copy {
            src: host,
            dst: dev,
            regions: vec![region(4096)],
            mode: DmaMode::Batched,
        }],
        vec![LoadOp::Copy {
            src: host,
            dst: dev,
            regions: vec![region(8192)],
            mode: DmaMode::Batched,
        }],
    ];
    let err = ex.load_layers(&layers, &[]).unwrap_err();
    assert!(matches!(err, ExecError::OutOfBounds { .. }), "{err}");
    // The rollback's poison on the cache's stream.
    ex.fill(dev, &[(0, 4096)], 0xA5).unwrap();
    let mut back = vec![0u8; 4096];
    ex.read(dev, 0, &mut back).unwrap();
    assert_eq!(
        take_races(),
        0,
        "the poison raced the failed load's first layer"
    );
    assert!(
        back.iter().all(|&b| b == 0xA5),
        "the failed load's first layer landed after the poison"
    );
    ex.free(dev).unwrap();
    ex.free(host).unwrap();
}

/// C1 and C2 of issue 42: two requests' loads back to back on one rank (SGLang's
/// `init_load_back` for a batch), each layer-wise on the load stream, then both verified.
/// Before the fix the second `begin` rewrote the page ids the first load's later layers
/// still read (one scratch buffer, written on the cache's stream: C1), and materialise
/// rewrote the page table the loads read (C2): the checker reported both, and under
/// `adversarial` scheduling the first request's pages read back poisoned.
fn back_to_back_loads_keep_their_page_ids() {
    for path in [TransferPath::Kernel, TransferPath::Dma] {
        let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
        let layers = 4u32;
        let mut dep = Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap();
        dep.transfer_path = path;
        let mut me = one_rank(&gpu, dep, layers);
        let (a, b) = (tokens(21, 6 * 16), tokens(22, 5 * 16));
        for p in [&a, &b] {
            let s = me.serve(p).unwrap();
            assert_eq!(s.mismatched_tokens, 0, "{s:?}");
        }
        me.set_layer_waits(true);
        for round in 0..3 {
            me.evict_device_lru(usize::MAX).unwrap();
            let mut ra = me.begin_allocated(&a).unwrap();
            assert!(ra.load().is_some(), "a host hit loads back");
            let mut rb = me.begin_allocated(&b).unwrap();
            assert!(rb.load().is_some(), "a host hit loads back");
            let va = me.synthesise_and_verify(&mut ra).unwrap();
            let vb = me.synthesise_and_verify(&mut rb).unwrap();
            assert_eq!(
                (va.all.count, vb.all.count),
                (0, 0),
                "{path:?} round {round}: mismatched tokens of the first and second load"
            );
            me.finish(&mut ra).unwrap();
            me.finish(&mut rb).unwrap();
            assert_eq!(take_races(), 0, "{path:?} round {round}: races");
        }
        drop(me);
        drop(gpu);
    }
}

/// A scheduler's step (issue 45) admits prompts whose prefixes are on the host, each with a
/// layer-wise load. Then again with a third prompt the pool cannot hold: two loads are in
/// flight when its allocation fails, so the step rolls back (poisoning what it allocated) and
/// runs again without it. The rollback must wait for the loads it undoes, and the second
/// pass's loads own their page ids: no race, and every token of the admitted requests
/// verifies.
fn a_step_of_loads_rolled_back_by_a_failed_admission() {
    use cp_hicache::rank::Step;
    let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
    let mut me = one_rank(
        &gpu,
        Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap(),
        4,
    );
    // 3, 2 and 2 cached pages, each with one more to compute: 10 of the pool's 17.
    let prompts = [tokens(31, 3 * 16), tokens(32, 2 * 16), tokens(33, 2 * 16)];
    for p in &prompts {
        assert_eq!(me.serve(p).unwrap().mismatched_tokens, 0);
    }
    let longer: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| p.iter().copied().chain(900..916).collect())
        .collect();
    let huge = tokens(34, 20 * 16);
    me.set_layer_waits(true);
    for (round, third) in [&longer[2], &huge].into_iter().enumerate() {
        me.evict_device_lru(usize::MAX).unwrap();
        let begin = vec![longer[0].as_slice(), longer[1].as_slice(), third.as_slice()];
        let out = me
            .step(Step {
                begin,
                allocate: true,
                ..Step::default()
            })
            .unwrap();
        // The failure costs a rollback (2 rounds) and another pass's round.
        assert_eq!(out.rounds, if round == 0 { 1 } else { 4 }, "round {round}");
        let mut reqs = Vec::new();
        for (i, r) in out.begun.into_iter().enumerate() {
            match r {
                Ok(r) => reqs.push(r),
                Err(e) => assert!(round == 1 && i == 2 && e.is_pool_too_small(), "{e}"),
            }
        }
        assert_eq!(reqs.len(), 3 - round);
        for r in &mut reqs {
            assert!(r.load().is_some(), "round {round}: a host hit loads back");
            let v = me.synthesise_and_verify(r).unwrap();
            assert_eq!(v.all.count, 0, "round {round}: mismatched tokens");
        }
        me.step(Step {
            finish: reqs.iter_mut().map(|r| (r, true)).collect(),
            ..Step::default()
        })
        .unwrap();
        me.check_invariants().unwrap();
        assert_eq!(take_races(), 0, "round {round}: races");
    }
    drop(me);
    drop(gpu);
}

/// D1 of issue 42: `cuCtxSynchronize` waits on every stream of the context (an engine's
/// NCCL stream included, which can deadlock, and is illegal under graph capture). An
/// engine's loop (begin with a load, its forward, extend, finish, an ops call with its
/// stream, scratch that grows and is freed) makes none: frees go back to the driver once the
/// executor's events say its streams are past them.
fn serving_makes_no_context_wide_synchronisation() {
    use cp_hicache::kernels::{BufferKind, Direction};
    use cp_hicache::ops::{Ops, Region, Tensors};
    let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
    let mut me = one_rank(
        &gpu,
        Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap(),
        4,
    );
    let dep = Deployment::new(ModelShape::MlaBf16, 16, 1).unwrap();
    let ops = Ops::warm_up(dep, 4, gpu.clone(), &jit(), Sanitize::None).unwrap();
    let pb = BufferKind::MlaKv.page_bytes(16);
    let dev = gpu
        .alloc(MemKind::Device, (4 * 8 * pb) as usize, 0)
        .unwrap();
    let host = gpu.alloc(MemKind::Host, (4 * 8 * pb) as usize, 0).unwrap();
    let region = |b: BufferId| Region {
        addr: gpu.address(b).unwrap().ptr,
        bytes: 4 * 8 * pb,
    };
    let device = [Tensors::CrossLayer(region(dev))];
    let hosts = [Tensors::CrossLayer(region(host))];
    let engine = engine_stream();
    let prompt = tokens(31, 5 * 16);
    me.serve(&prompt).unwrap();
    me.set_layer_waits(true);
    let before = driver_count(b"fake_cuda_ctx_syncs");
    for step in 0..4u32 {
        me.evict_device_lru(usize::MAX).unwrap();
        let mut req = me.begin_allocated(&prompt).unwrap();
        let v = me.synthesise_and_verify(&mut req).unwrap();
        assert_eq!(v.all.count, 0, "step {step}");
        // The engine hands its stream to extend and finish (P5): the cache's backups wait on
        // the device for its forward, with no host synchronisation.
        let waits = driver_count(b"fake_cuda_cross_stream_waits");
        // SAFETY: a live stream of the context.
        unsafe { me.follow_engine_stream(engine as u64) }.unwrap();
        me.extend(&mut req, &tokens(40 + step, 16 + 3)).unwrap();
        me.synthesise(&mut req).unwrap();
        // SAFETY: as above.
        unsafe { me.follow_engine_stream(engine as u64) }.unwrap();
        me.finish(&mut req).unwrap();
        assert!(driver_count(b"fake_cuda_cross_stream_waits") - waits >= 2);
        let n = 2 + step as usize;
        let (src, dst): (Vec<u32>, Vec<u32>) = (0..n as u32).map(|i| (i, 7 - i)).unzip();
        // SAFETY: the memory and the stream live across the call.
        unsafe {
            ops.on_stream(Some(engine as u64), |o| {
                o.transfer(Direction::HostToDevice, &device, &hosts, &src, &dst, 0..4)
            })
        }
        .unwrap();
    }
    assert_eq!(
        driver_count(b"fake_cuda_ctx_syncs") - before,
        0,
        "context-wide synchronisations on the serving path"
    );
    drop(ops);
    drop(me);
    gpu.free(dev).unwrap();
    gpu.free(host).unwrap();
    drop(gpu);
    // SAFETY: nothing is enqueued on it any more.
    unsafe { cudarc::driver::sys::cuStreamDestroy_v2(engine) }
        .result()
        .unwrap();
    assert_eq!(take_races(), 0);
}

#[test]
#[ignore = "run by cuda_executor_on_the_stand_in_driver, in a process that loads the stand-in libcuda"]
fn child() {
    assert_eq!(
        std::env::var(CHILD_ENV).as_deref(),
        Ok("1"),
        "run through cuda_executor_on_the_stand_in_driver"
    );
    executor_basics();
    info_names_the_device();
    launch_failures_are_typed();
    staged_uploads_never_overwrite_a_copy_in_flight();
    for path in [
        TransferPath::Kernel,
        TransferPath::Dma,
        TransferPath::DmaEach,
    ] {
        cache_on_the_gpu(ModelShape::MlaBf16, 16, 4, path);
        cache_on_the_gpu(ModelShape::Nsa, 64, 8, path);
    }
    every_family_matches_the_references();
    busy_companions_on_a_second_stream();
    loads_run_on_a_prioritised_stream_of_their_own();
    ops_on_the_callers_memory_and_stream();
    ipc_in_one_process_is_refused();
    ipc_across_processes();
    assert_eq!(live_allocations(), 0);
}

/// BENCHMARKS.md "Load submission on the stand-in": the host's cost of submitting a
/// layer-wise load, per layer (61-layer NSA at page 64 against 1 layer, the difference over
/// 60), with the stand-in's call sites off (`FAKE_CUDA_SITES=0`) and `lazy` scheduling, so
/// that no queued work runs while `begin` submits. Run by hand:
/// `LD_LIBRARY_PATH=<stand-in> CP_HICACHE_FAKE_CUDA_CHILD=1 FAKE_CUDA_SITES=0
/// cuda_fake_driver --ignored --exact submission_cost_per_layer --nocapture`.
#[test]
#[ignore = "a measurement, run by hand on the stand-in driver"]
fn submission_cost_per_layer() {
    assert_eq!(std::env::var(CHILD_ENV).as_deref(), Ok("1"));
    let begin_ms = |layers: u32| {
        let gpu: Arc<dyn Executor> = Arc::new(CudaExecutor::new(0).unwrap());
        let mut me = one_rank(
            &gpu,
            Deployment::new(ModelShape::Nsa, 64, 1).unwrap(),
            layers,
        );
        let prompt = tokens(51, 8 * 64);
        me.serve(&prompt).unwrap();
        me.set_layer_waits(true);
        let mut times = Vec::new();
        for _ in 0..15 {
            me.evict_device_lru(usize::MAX).unwrap();
            gpu.synchronize().unwrap();
            let t = std::time::Instant::now();
            let mut req = me.begin(&prompt).unwrap();
            times.push(t.elapsed().as_secs_f64() * 1e3);
            assert!(req.load().is_some());
            me.abandon(&mut req).unwrap();
            gpu.synchronize().unwrap();
        }
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let (one, many) = (begin_ms(1), begin_ms(61));
    println!(
        "begin with a layer-wise load: 1 layer {one:.3} ms, 61 layers {many:.3} ms, \
         {:.1} us per layer",
        (many - one) / 60.0 * 1e3
    );
}
