//! The kernel-backed owner-lane allocator against its oracle, the host `OwnerLaneAllocator`:
//! over random layouts and operation sequences — every (CP, page size) pair, both block
//! orders — both return the same pages and errors, the device stacks and tops read back equal
//! the mirror after every operation, the select kernel's `out_pages` equal the oracle's run
//! (whose token locations the host derives from them), and an allocation or a free does no read back and no synchronisation.

mod support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cp_hicache::allocator::{
    AllocError, KernelAllocError, KernelAllocOptions, KernelLaneAllocator, KernelRun,
    OwnerLaneAllocator, PageRun,
};
use cp_hicache::exec::{
    Backend, BlockOrder, BufferId, CopyRegion, Counters, ExecError, Executor, HostExecutor,
    KernelArg, KernelArtifact, KernelId, LaunchConfig, MemKind,
};
use cp_hicache::kernels::reference;
use cp_hicache::layout::{zigzag_owners, CpLayout, PageId};
use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestRunner};
use support::{u32s, Rng, ORDERS};

/// CP degrees (3 for a non-power of two) and page sizes: every pair runs, in both orders.
const CPS: [u8; 6] = [1, 2, 3, 4, 8, 16];
const PSS: [u32; 3] = [1, 16, 64];
/// Random cases per (CP, page size, block order), and operations per case.
const CASES: u32 = 2;
const OPS: usize = 30;

/// Allocations that succeeded (with at least one page) and that were shortages, over all
/// cases: both paths must be well exercised.
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static SHORT: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone)]
enum Op {
    /// Owners drawn at random; `len` may exceed what the lanes hold (a shortage).
    Alloc { len: u16, seed: u64 },
    /// A zigzag owner pattern over `len` pages, as a cold prefill asks.
    Zigzag { len: u16 },
    /// `alloc_pages(n)` without an owner pattern.
    Plain { len: u16 },
    /// Free a random subset (in random order) of the allocated pages.
    Free { per_mille: u16, seed: u64 },
    /// A misuse that must be rejected before anything is launched.
    Misuse { kind: u8, seed: u64 },
}

/// A request size: mostly small, so most allocations fit (and the lanes drain over a case),
/// sometimes up to `max`, more than small layouts hold (a shortage).
fn len(max: u16) -> impl Strategy<Value = u16> {
    prop_oneof![3 => 0u16..48, 1 => 0..max]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (len(400), any::<u64>()).prop_map(|(len, seed)| Op::Alloc { len, seed }),
        1 => len(300).prop_map(|len| Op::Zigzag { len }),
        1 => len(300).prop_map(|len| Op::Plain { len }),
        3 => (0u16..=1000, any::<u64>()).prop_map(|(per_mille, seed)| Op::Free { per_mille, seed }),
        1 => (0u8..4, any::<u64>()).prop_map(|(kind, seed)| Op::Misuse { kind, seed }),
    ]
}

/// Checks what the select kernel wrote for a successful allocation (`out_pages`, read back
/// from the executor) against `want`, the oracle's run, and that the run's host-side token
/// locations are the page-contiguous slots of those device pages (the kernel writes none:
/// consumers derive them).
fn check_outputs(ex: &dyn Executor, k: &KernelRun, want: &PageRun, page_size: u32) {
    let n = want.len();
    assert_eq!(k.pages.len, n as u64);
    if n == 0 {
        return;
    }
    let mut pages = vec![0u8; 4 * n];
    ex.read(k.pages.buffer, k.pages.offset, &mut pages).unwrap();
    let want_pages: Vec<u32> = want.pages().iter().map(|p| p.0).collect();
    assert_eq!(u32s(&pages), want_pages, "out_pages");
    let locs = reference::page_locs(page_size, &u32s(&pages)).unwrap();
    let host_locs: Vec<i64> = k.run.locs().map(|l| l.0 as i64).collect();
    assert_eq!(host_locs, locs, "locations must be page-contiguous");
}

fn run_case(order: BlockOrder, cp: u8, ps: u32, pages: u32, ops: &[Op]) {
    let layout = CpLayout::new(u32::from(cp), ps, pages).unwrap();
    let ex: Arc<dyn Executor> = Arc::new(support::executor(order));
    let mut dev = KernelLaneAllocator::new(
        layout,
        Arc::clone(&ex),
        support::jit(),
        KernelAllocOptions::default(),
    )
    .unwrap();
    let mut oracle = OwnerLaneAllocator::new(layout);
    oracle.set_debug_checks(true);
    dev.debug_check_device().unwrap();
    let mut allocated: Vec<PageId> = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        let ctx = format!("cp{cp} ps{ps} {order} pages{pages} op {i}: {op:?}");
        let before = ex.counters();
        let launches_expected;
        match op {
            Op::Alloc { .. } | Op::Zigzag { .. } | Op::Plain { .. } => {
                let (got, want) = match *op {
                    Op::Plain { len } => (
                        dev.alloc_pages(usize::from(len)),
                        oracle.alloc_pages(usize::from(len)),
                    ),
                    Op::Zigzag { len } => {
                        let owners = zigzag_owners(cp, usize::from(len));
                        (
                            dev.alloc_pages_with_owners(&owners),
                            oracle.alloc_pages_with_owners(&owners),
                        )
                    }
                    Op::Alloc { len, seed } => {
                        let mut rng = Rng::new(&[seed]);
                        let owners: Vec<u8> =
                            (0..len).map(|_| rng.below(u64::from(cp)) as u8).collect();
                        (
                            dev.alloc_pages_with_owners(&owners),
                            oracle.alloc_pages_with_owners(&owners),
                        )
                    }
                    _ => unreachable!(),
                };
                let d = ex.counters().since(&before);
                assert!(d.is_sync_free(), "{ctx}: {d:?}");
                match (got, want) {
                    (Ok(k), Ok(run)) => {
                        // `k.run` is the kernel allocator's host mirror (an
                        // `OwnerLaneAllocator` too), so this only checks the mirror was driven
                        // like the oracle. The kernel itself is checked by `check_outputs`
                        // (what the select kernel wrote, read back, against the oracle's run)
                        // and by `debug_check_device` (the device stacks and tops) below.
                        assert_eq!(k.run, run, "{ctx}");
                        launches_expected = u64::from(!run.is_empty());
                        check_outputs(ex.as_ref(), &k, &run, ps);
                        if !run.is_empty() {
                            ALLOCATED.fetch_add(1, Ordering::Relaxed);
                        }
                        allocated.extend_from_slice(run.pages());
                    }
                    (Err(KernelAllocError::Alloc(e)), Err(w)) => {
                        assert_eq!(e, w, "{ctx}");
                        assert!(e.is_shortage(), "{ctx}: {e}");
                        SHORT.fetch_add(1, Ordering::Relaxed);
                        launches_expected = 0;
                    }
                    (g, w) => panic!("{ctx}: kernel {g:?} vs oracle {w:?}"),
                }
                assert_eq!(d.launches, launches_expected, "{ctx}");
            }
            Op::Free { per_mille, seed } => {
                let mut rng = Rng::new(&[*seed]);
                let mut pick = Vec::new();
                allocated.retain(|&p| {
                    let take = rng.below(1000) < u64::from(*per_mille);
                    if take {
                        pick.push(p);
                    }
                    !take
                });
                let perm = rng.permutation(pick.len() as u32);
                let pick: Vec<PageId> = perm.iter().map(|&i| pick[i as usize]).collect();
                dev.free(&pick).unwrap_or_else(|e| panic!("{ctx}: {e}"));
                oracle.free(&pick).unwrap();
                let d = ex.counters().since(&before);
                assert!(d.is_sync_free(), "{ctx}: {d:?}");
                assert_eq!(d.launches, u64::from(!pick.is_empty()), "{ctx}");
            }
            Op::Misuse { kind, seed } => {
                let mut rng = Rng::new(&[*seed]);
                let bad: Vec<PageId> = match kind {
                    // Page 0.
                    0 => vec![PageId::NULL],
                    // A page outside the layout.
                    1 => vec![PageId(pages + rng.below(5) as u32)],
                    // A page that is free (never allocated, or freed already).
                    2 => match (1..pages).map(PageId).find(|p| !oracle.is_allocated(*p)) {
                        Some(p) => vec![p],
                        None => vec![PageId::NULL],
                    },
                    // A valid page twice in one call (nothing may be freed).
                    _ => match allocated.first() {
                        Some(&p) => vec![p, p],
                        None => vec![PageId::NULL],
                    },
                };
                let e = dev.free(&bad).unwrap_err();
                let w = oracle.free(&bad).unwrap_err();
                assert!(
                    matches!(&e, KernelAllocError::Alloc(x) if *x == w),
                    "{ctx}: {e} vs {w}"
                );
                let bad_owner = [cp];
                let e = dev.alloc_pages_with_owners(&bad_owner).unwrap_err();
                assert!(
                    matches!(e.as_alloc(), Some(AllocError::OwnerOutOfRange { .. })),
                    "{ctx}: {e}"
                );
                let d = ex.counters().since(&before);
                assert_eq!(
                    (d.launches, d.uploads, d.reads, d.syncs),
                    (0, 0, 0, 0),
                    "{ctx}"
                );
            }
        }
        assert_eq!(dev.digest(), oracle.digest(), "{ctx}");
        assert_eq!(dev.lane_free_counts(), oracle.lane_free_counts(), "{ctx}");
        dev.debug_check_device()
            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    }
}

/// Every (CP, page size) pair in both block orders, `CASES` random cases each: one proptest
/// runner per combination, so none can go undrawn.
#[test]
fn kernel_allocator_agrees_with_the_oracle() {
    let case = (0u32..700, prop::collection::vec(op(), OPS));
    for order in ORDERS {
        for cp in CPS {
            for ps in PSS {
                let config = ProptestConfig {
                    cases: CASES,
                    // A fixed seed (one per combination) keeps the run deterministic (project
                    // rule); a failure reproduces from it, so nothing is persisted.
                    rng_seed: RngSeed::Fixed(
                        0x6b65_726e_656c
                            ^ (u64::from(cp) << 48)
                            ^ (u64::from(ps) << 32)
                            ^ u64::from(order == BlockOrder::Reverse),
                    ),
                    failure_persistence: None,
                    ..ProptestConfig::default()
                };
                TestRunner::new(config)
                    .run(&case, |(extra, ops)| {
                        run_case(order, cp, ps, u32::from(cp) + 1 + extra, &ops);
                        Ok(())
                    })
                    .unwrap_or_else(|e| panic!("cp{cp} ps{ps} {order}: {e}"));
            }
        }
    }
    let (allocated, short) = (
        ALLOCATED.load(Ordering::Relaxed),
        SHORT.load(Ordering::Relaxed),
    );
    println!("{allocated} allocations succeeded, {short} were shortages");
    assert!(
        allocated > 2 * short && short > 0,
        "the cases are mostly shortages (or never short): {allocated} allocated, {short} short"
    );
}

#[test]
fn fresh_lanes_pop_ascending_pages_and_failed_launches_change_nothing() {
    let layout = CpLayout::new(4, 16, 41).unwrap();
    let ex: Arc<dyn Executor> = Arc::new(support::executor(BlockOrder::Reverse));
    let mut dev = KernelLaneAllocator::new(
        layout,
        Arc::clone(&ex),
        support::jit(),
        KernelAllocOptions::default(),
    )
    .unwrap();
    let k = dev.alloc_pages_with_owners(&[1, 0, 0, 3, 2]).unwrap();
    let ids: Vec<u32> = k.run.pages().iter().map(|p| p.0).collect();
    assert_eq!(ids, [1, 4, 8, 3, 2]);
    check_outputs(ex.as_ref(), &k, &k.run, 16);

    // A failed select launch: the error is the executor's, and mirror and device are as
    // before.
    let digest = dev.digest();
    ex.inject_launch_failure();
    let e = dev.alloc_pages_with_owners(&[0, 1, 2, 3]).unwrap_err();
    assert!(matches!(e, KernelAllocError::Exec(_)), "{e}");
    assert_eq!(dev.digest(), digest);
    dev.debug_check_device().unwrap();

    // A failed release launch: the pages stay allocated, in the same stacks.
    ex.inject_launch_failure();
    let e = dev.free(k.run.pages()).unwrap_err();
    assert!(matches!(e, KernelAllocError::Exec(_)), "{e}");
    assert_eq!(dev.digest(), digest);
    dev.debug_check_device().unwrap();
    assert!(k.run.pages().iter().all(|&p| dev.mirror().is_allocated(p)));

    // And the allocator keeps working afterwards.
    dev.free(k.run.pages()).unwrap();
    dev.debug_check_device().unwrap();
    let again = dev.alloc_pages_with_owners(&[1, 0, 0, 3, 2]).unwrap();
    assert_eq!(again.run.pages().len(), 5);
    dev.debug_check_device().unwrap();
}

/// A host executor whose allocation number `fail_at` (0-based) fails.
struct FailingAlloc {
    inner: Arc<HostExecutor>,
    fail_at: usize,
    calls: std::sync::atomic::AtomicUsize,
}

impl Executor for FailingAlloc {
    fn backend(&self) -> Backend {
        self.inner.backend()
    }
    fn device_name(&self) -> String {
        self.inner.device_name()
    }
    fn alloc(&self, k: MemKind, b: usize, f: u8) -> Result<BufferId, ExecError> {
        let call = self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if call == self.fail_at {
            return Err(ExecError::Alloc {
                bytes: b,
                kind: k,
                reason: "allocation failure injected by the test".into(),
            });
        }
        self.inner.alloc(k, b, f)
    }
    fn free(&self, b: BufferId) -> Result<(), ExecError> {
        self.inner.free(b)
    }
    fn size(&self, b: BufferId) -> Result<usize, ExecError> {
        self.inner.size(b)
    }
    fn upload(&self, b: BufferId, o: u64, d: &[u8]) -> Result<(), ExecError> {
        self.inner.upload(b, o, d)
    }
    fn read(&self, b: BufferId, o: u64, d: &mut [u8]) -> Result<(), ExecError> {
        self.inner.read(b, o, d)
    }
    unsafe fn load_kernel(&self, a: &KernelArtifact<'_>) -> Result<KernelId, ExecError> {
        // SAFETY: forwarded; the caller's guarantee is the inner executor's.
        unsafe { self.inner.load_kernel(a) }
    }
    unsafe fn launch_with(
        &self,
        k: KernelId,
        c: &LaunchConfig,
        a: &[KernelArg<'_>],
        unsigned_ok: bool,
    ) -> Result<(), ExecError> {
        // SAFETY: forwarded; the caller's guarantee is the inner executor's.
        unsafe { self.inner.launch_with(k, c, a, unsigned_ok) }
    }
    fn copy_regions(&self, s: BufferId, d: BufferId, r: &[CopyRegion]) -> Result<(), ExecError> {
        self.inner.copy_regions(s, d, r)
    }
    fn fill(&self, b: BufferId, r: &[(u64, u64)], v: u8) -> Result<(), ExecError> {
        self.inner.fill(b, r, v)
    }
    fn synchronize(&self) -> Result<(), ExecError> {
        self.inner.synchronize()
    }
    fn counters(&self) -> Counters {
        self.inner.counters()
    }
    fn inject_launch_failure(&self) {
        self.inner.inject_launch_failure()
    }
    fn disarm_launch_failure(&self) -> bool {
        self.inner.disarm_launch_failure()
    }
}

/// A constructor whose k-th buffer allocation fails frees the buffers it allocated before
/// it; one whose allocations all succeed owns its buffers until it is dropped.
#[test]
fn a_failed_allocation_in_the_constructor_frees_the_earlier_buffers() {
    let layout = CpLayout::new(4, 16, 41).unwrap();
    let live = |c: Counters| c.allocs - c.frees;
    let mut failed = 0;
    for fail_at in 0.. {
        let inner = Arc::new(support::executor(BlockOrder::Forward));
        let ex: Arc<dyn Executor> = Arc::new(FailingAlloc {
            inner: Arc::clone(&inner),
            fail_at,
            calls: Default::default(),
        });
        match KernelLaneAllocator::new(layout, ex, support::jit(), KernelAllocOptions::default()) {
            Err(e) => {
                assert!(
                    matches!(&e, KernelAllocError::Exec(ExecError::Alloc { .. })),
                    "{e}"
                );
                assert_eq!(
                    live(inner.counters()),
                    0,
                    "allocation {fail_at} failed and left buffers behind"
                );
                failed += 1;
            }
            Ok(dev) => {
                assert_eq!(live(inner.counters()), fail_at as u64);
                drop(dev);
                assert_eq!(live(inner.counters()), 0);
                break;
            }
        }
    }
    assert!(failed >= 6, "only {failed} allocations were failed");
}

/// All allocator launches of one rank run on one stream: the allocator keeps the executor it
/// was built with (an executor is one ordered stream) and issues every upload and launch on
/// its lanes there, and the lane buffers (stacks, tops, the select status) are handles that
/// any other executor, i.e. any other stream, refuses; so nothing can pop or push the lanes
/// out of order with the allocator's own launches.
#[test]
fn another_executor_cannot_touch_the_lanes() {
    let layout = CpLayout::new(4, 16, 41).unwrap();
    let ex: Arc<dyn Executor> = Arc::new(support::executor(BlockOrder::Forward));
    let mut dev = KernelLaneAllocator::new(
        layout,
        Arc::clone(&ex),
        support::jit(),
        KernelAllocOptions::default(),
    )
    .unwrap();
    assert!(Arc::ptr_eq(dev.executor(), &ex));
    let other = support::executor(BlockOrder::Forward);
    for b in [dev.stacks_buffer(), dev.tops_buffer(), dev.status_buffer()] {
        let up = other.upload(b, 0, &[0; 4]);
        assert!(
            matches!(up, Err(ExecError::UnknownBuffer(id)) if id == b),
            "{up:?}"
        );
        let mut out = [0u8; 4];
        let rd = other.read(b, 0, &mut out);
        assert!(
            matches!(rd, Err(ExecError::UnknownBuffer(id)) if id == b),
            "{rd:?}"
        );
    }
    // Its own launches all went to its executor: one select, one release.
    let before = ex.counters();
    let k = dev.alloc_pages_with_owners(&[0, 1, 2, 3]).unwrap();
    dev.free(k.run.pages()).unwrap();
    assert_eq!(ex.counters().since(&before).launches, 2);
    assert_eq!(other.counters().launches, 0);
    dev.debug_check_device().unwrap();
}
