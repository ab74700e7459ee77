//! Owner-lane exhaustion on the load path: a load-back that finds one lane short evicts for
//! that lane and succeeds; when nothing can be evicted it degrades to a miss and the tokens
//! are recomputed correctly; nothing leaks either way. Also the host pool running full.

mod hicache_support;

use cp_hicache::cluster::{Fault, WritePolicy};
use cp_hicache::kernels::ModelShape;
use hicache_support::{evict_all, lane_capacities, serve, tokens, Setup};

const POLICIES: [WritePolicy; 2] = [WritePolicy::WriteThrough, WritePolicy::WriteBack];

#[test]
fn load_back_evicts_for_the_short_lane_and_succeeds() {
    for policy in POLICIES {
        let mut setup = Setup::new(ModelShape::MlaBf16, 16, 2);
        setup.device_pages = 33; // 16 pages per lane
        setup.policy = policy;
        setup.fault = Some(Fault::LaneExhaustion); // 8 of lane 0's pages are gone for ever
        let mut c = setup.build();
        let caps = lane_capacities(&c);
        assert_eq!(c.lane_free_counts(), vec![caps[0] / 2, caps[1]]);
        // 8 pages, zigzag owners 0,0,1,1,1,1,0,0: four of lane 0.
        let a = tokens(1, 8 * 16);
        serve(&mut c, &a);
        evict_all(&mut c);
        // One-page prompts all land in lane 0 (zigzag of one page is owner 0).
        for i in 0..7 {
            serve(&mut c, &tokens(10 + i, 16));
        }
        assert_eq!(c.lane_free_counts()[0], 1, "{policy}");
        let s = serve(&mut c, &a);
        assert_eq!(s.host_hit_tokens, 8 * 16, "{policy}: {s:?}");
        assert!(s.evictions_lane >= 3, "{policy}: {s:?}");
        assert_eq!(s.load_degraded_to_miss, 0);
        // Everything back: lane 0 keeps only its reserved half out.
        evict_all(&mut c);
        assert_eq!(c.lane_free_counts(), vec![caps[0] / 2, caps[1]], "{policy}");
    }
}

#[test]
fn load_back_degrades_to_a_miss_when_the_lane_cannot_be_freed() {
    for policy in POLICIES {
        let mut setup = Setup::new(ModelShape::MlaBf16, 16, 2);
        setup.device_pages = 17; // 8 pages per lane
        setup.policy = policy;
        let mut c = setup.build();
        let caps = lane_capacities(&c);
        let a = tokens(1, 8 * 16); // owners 0,0,1,1,1,1,0,0
        let head = &a[..6 * 16];
        serve(&mut c, &a);
        // Split a after page 6: the tail node keeps owners 0,0 (both lane 0).
        let s = serve(&mut c, head);
        assert_eq!(s.device_hit_tokens, 6 * 16);
        evict_all(&mut c);
        let s = serve(&mut c, head);
        assert_eq!(s.host_hit_tokens, 6 * 16, "{policy}: {s:?}");
        // Five one-page prompts in lane 0, held by "in-flight requests", as is the head.
        let ones: Vec<Vec<u32>> = (0..5).map(|i| tokens(10 + i, 16)).collect();
        for p in &ones {
            serve(&mut c, p);
        }
        let mut pins = vec![c.pin_prefix(head).unwrap()];
        for p in &ones {
            pins.push(c.pin_prefix(p).unwrap());
        }
        assert!(pins.iter().all(|p| p.tokens > 0));
        assert_eq!(c.lane_free_counts()[0], 1, "{policy}");
        // The tail needs two lane-0 pages, only one exists and nothing may be evicted: a
        // miss. Recomputing it needs owners 0,1 (zigzag of two pages), which fits.
        let s = serve(&mut c, &a);
        assert_eq!(s.load_degraded_to_miss, 1, "{policy}: {s:?}");
        assert_eq!(s.host_hit_tokens, 0);
        assert_eq!(s.device_hit_tokens, 6 * 16);
        assert_eq!(s.computed_tokens, 2 * 16);
        // The recomputed pages have owners 0,1, not the host copy's 0,0: the copy is
        // replaced (a node's device pages and host copy name the same owners).
        assert_eq!(s.host_copies_replaced, 1, "{policy}: {s:?}");
        for p in pins {
            c.unpin(p).unwrap();
        }
        c.check_invariants().unwrap();
        evict_all(&mut c);
        assert_eq!(c.lane_free_counts(), caps, "{policy}: pages leaked");
        // The tail was backed up afresh (write-through on insert, write-back on eviction)
        // with its new owners, and loads back fine now.
        let s = serve(&mut c, &a);
        assert_eq!(s.host_hit_tokens, 8 * 16, "{policy}: {s:?}");
        evict_all(&mut c);
        assert_eq!(c.lane_free_counts(), caps);
    }
}

#[test]
fn full_host_pool_skips_backups_and_stays_correct() {
    for policy in POLICIES {
        let mut setup = Setup::new(ModelShape::MlaBf16, 16, 2);
        setup.device_pages = 17;
        setup.policy = policy;
        setup.fault = Some(Fault::HostPoolFull);
        let mut c = setup.build();
        let mut skipped = 0;
        for round in 0..2 {
            for i in 0..6 {
                let s = serve(&mut c, &tokens(i, 5 * 16 + 3));
                skipped += s.backups_skipped;
            }
            if round == 0 {
                evict_all(&mut c);
            }
        }
        // Write-through skips when the request backs up, write-back when the serve evicts
        // for room (device_pages 17 cannot hold six 5-page prompts); either way a 5-page
        // node needs 3 host pages of one rank and the fault leaves 2.
        assert!(skipped > 0, "{policy}");
        evict_all(&mut c);
        assert_eq!(c.lane_free_counts(), lane_capacities(&c));
    }
}

/// A backup that cannot fit even after evicting every host copy on the short rank is
/// skipped without throwing any host copy away (CP 2, two host pages per rank; a 5-page
/// node has zigzag owners 0,0,1,1,0, three of them rank 0's).
#[test]
fn a_backup_that_cannot_fit_evicts_nothing() {
    let mut setup = Setup::new(ModelShape::MlaBf16, 16, 2);
    setup.host_pages = 2;
    let mut c = setup.build();
    let x = tokens(1, 2 * 16); // owners 0,1
    let y = tokens(2, 2 * 16);
    serve(&mut c, &x);
    serve(&mut c, &y);
    evict_all(&mut c);
    let s = serve(&mut c, &tokens(3, 5 * 16));
    assert_eq!(s.backups_skipped, 1, "{s:?}");
    assert_eq!(s.evictions_lru, 0, "{s:?}");
    for t in [&x, &y] {
        let s = serve(&mut c, t);
        assert_eq!(s.host_hit_tokens, 2 * 16, "the host copy survived: {s:?}");
    }
}

/// Host eviction for a backup takes only copies that free pages on the short rank: an
/// older copy owned by rank 0 alone survives when only rank 1 is short.
#[test]
fn a_backup_evicts_only_host_copies_of_the_short_rank() {
    let mut setup = Setup::new(ModelShape::MlaBf16, 16, 2);
    setup.host_pages = 3;
    let mut c = setup.build();
    let p = tokens(1, 16); // owners 0
    let q = tokens(2, 3 * 16); // owners 0,1,1
    serve(&mut c, &p);
    serve(&mut c, &q);
    evict_all(&mut c);
    // Rank 0 has 1 host page free and needs 1; rank 1 has 1 and needs 2.
    let s = serve(&mut c, &tokens(3, 3 * 16));
    assert_eq!(s.backups_skipped, 0, "{s:?}");
    assert_eq!(s.evictions_lru, 1, "only q's copy goes: {s:?}");
    assert_eq!(s.host_evictions_for_backup, 1, "{s:?}");
    let s = serve(&mut c, &p);
    assert_eq!(s.host_hit_tokens, 16, "p's copy survived: {s:?}");
}

/// Two requests holding the same prefix each hold it: the prefix stays on the device until
/// both pins are given back (a pin is a receipt, not a copyable value), and a pin of another
/// cluster is refused without releasing anything.
#[test]
fn a_prefix_pinned_twice_stays_until_both_pins_are_given_back() {
    let setup = Setup::new(ModelShape::MlaBf16, 16, 2);
    let mut c = setup.build();
    let mut other = setup.build();
    let a = tokens(1, 4 * 16);
    serve(&mut c, &a);
    serve(&mut other, &a);
    let p1 = c.pin_prefix(&a).unwrap();
    let p2 = c.pin_prefix(&a).unwrap();
    assert_eq!((p1.tokens, p2.tokens), (4 * 16, 4 * 16));
    let foreign = other.pin_prefix(&a).unwrap();
    let err = c.unpin(foreign).unwrap_err();
    assert!(err.to_string().contains("another cluster"), "{err}");
    // The refused pin comes back and still releases its own cluster's prefix.
    other.unpin(err.pinned).unwrap();
    evict_all(&mut other);
    assert_eq!(serve(&mut other, &a).device_hit_tokens, 0);

    c.unpin(p1).unwrap();
    evict_all(&mut c);
    let s = serve(&mut c, &a);
    assert_eq!(s.device_hit_tokens, 4 * 16, "still pinned by p2: {s:?}");
    c.unpin(p2).unwrap();
    evict_all(&mut c);
    let s = serve(&mut c, &a);
    assert_eq!(s.device_hit_tokens, 0, "{s:?}");
    c.check_invariants().unwrap();
}
