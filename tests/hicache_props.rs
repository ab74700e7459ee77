//! A state machine over the whole cluster: random prompts built from a tiny vocabulary of
//! 8-token blocks (so prefixes share whole and half pages), small device and host pools,
//! and random extra evictions. After every step: zero mismatched tokens, replicas in
//! agreement, the invariants (per-lane conservation on every rank, every tree page held,
//! every host page referenced by at most one node), and no synchronisation on a load path.

mod hicache_support;

use cp_hicache::cluster::{RequestStats, WritePolicy};
use cp_hicache::kernels::ModelShape;
use hicache_support::{evict_all, lane_capacities, serve, Setup};
use proptest::prelude::*;
use proptest::test_runner::{RngSeed, TestRunner};

const BLOCK: usize = 8;

#[derive(Clone, Debug)]
enum Op {
    /// Serve the prompt of these block ids, minus `cut` trailing tokens.
    Serve(Vec<u8>, usize),
    /// Evict at least this many device pages, LRU.
    Evict(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (prop::collection::vec(0u8..3, 1..=8), 0usize..BLOCK).prop_map(|(b, c)| Op::Serve(b, c)),
        1 => (1usize..6).prop_map(Op::Evict),
    ]
}

fn prompt(blocks: &[u8], cut: usize) -> Vec<u32> {
    let mut t: Vec<u32> = blocks
        .iter()
        .flat_map(|&b| (0..BLOCK as u32).map(move |i| u32::from(b) * 100 + i))
        .collect();
    t.truncate((t.len() - cut.min(t.len() - 1)).max(1));
    t
}

/// The state machine over random cases. Its totals over all cases must show the paths it
/// exists for: load-backs, lane-targeted evictions, and host evictions and skips for backups.
/// (Load-backs degraded to misses need locked prefixes, which r_rollback's stress runs pin.)
#[test]
fn cluster_state_machine() {
    let config = ProptestConfig {
        cases: 32,
        max_shrink_iters: 64,
        // A fixed seed keeps the run (and the coverage assertion below) deterministic
        // (project rule, as in kernel_allocator.rs); a failure reproduces from the seed, so
        // nothing is persisted.
        rng_seed: RngSeed::Fixed(0x0068_6963_6163_6865),
        failure_persistence: None,
        ..ProptestConfig::default()
    };
    let case = (
        prop::sample::select(vec![1u8, 2, 4, 8]),
        any::<bool>(),
        6u32..12,
        2u32..24,
        prop::collection::vec(op(), 200..260),
    );
    let totals = std::cell::RefCell::new(RequestStats::default());
    TestRunner::new(config)
        .run(&case, |(cp, write_back, lane_pages, host_pages, ops)| {
            let mut setup = Setup::new(ModelShape::MlaBf16, 16, cp);
            setup.device_pages = lane_pages * u32::from(cp) + 1;
            setup.host_pages = host_pages;
            setup.policy = if write_back {
                WritePolicy::WriteBack
            } else {
                WritePolicy::WriteThrough
            };
            let mut c = setup.build();
            for op in &ops {
                match op {
                    Op::Serve(blocks, cut) => {
                        let s = serve(&mut c, &prompt(blocks, *cut));
                        totals.borrow_mut().add(&s);
                    }
                    Op::Evict(n) => {
                        c.evict_device_lru(*n).unwrap();
                        prop_assert!(c.replicas_agree());
                        c.check_invariants().unwrap();
                    }
                }
            }
            evict_all(&mut c);
            prop_assert_eq!(c.lane_free_counts(), lane_capacities(&c));
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    let t = totals.into_inner();
    assert!(
        t.pages_loaded > 0
            && t.evictions_lane > 0
            && t.host_evictions_for_backup > 0
            && t.backups_skipped > 0,
        "the cases never reached a path they exist for: {t:?}"
    );
}

/// Deterministic pseudo-random runs in the setting where the state machine first found
/// bugs (write-back, 3 host pages: a backup during a load's eviction evicted host LRU and
/// removed the very nodes being loaded).
#[test]
fn write_back_with_a_tiny_host_pool() {
    for seed in 0..6u64 {
        for cp in [2u8, 4] {
            let mut setup = Setup::new(ModelShape::MlaBf16, 16, cp);
            setup.device_pages = 8 * u32::from(cp) + 1;
            setup.host_pages = 3;
            setup.policy = WritePolicy::WriteBack;
            let mut c = setup.build();
            let mut loaded = 0;
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut next = |m: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % m
            };
            for _ in 0..300 {
                if next(7) == 0 {
                    c.evict_device_lru(1 + next(5) as usize).unwrap();
                    c.check_invariants().unwrap();
                } else {
                    let blocks: Vec<u8> = (0..1 + next(8)).map(|_| next(3) as u8).collect();
                    let cut = next(BLOCK as u64) as usize;
                    let s = serve(&mut c, &prompt(&blocks, cut));
                    loaded += s.pages_loaded;
                }
            }
            assert!(loaded > 0, "seed {seed} cp {cp}: no load-back happened");
            evict_all(&mut c);
            assert_eq!(c.lane_free_counts(), lane_capacities(&c));
        }
    }
}
