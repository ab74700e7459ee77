//! The step API against `serve`, live requests (extend, the kept partial page, unfinished
//! inserts), abandons and failed steps.

use super::super::tests::one_rank;
use super::*;
use crate::allocator::StateDigest;
use crate::kernels::TransferPath;

fn prompt(pages: u32) -> Vec<u32> {
    (0..pages * 16).map(|t| t * 7 + 3).collect()
}

/// The steps an engine makes give exactly what `serve` gives, cold and after a load-back.
#[test]
fn steps_equal_serve_cold_and_loaded_back() {
    let (mut whole, mut steps) = (
        one_rank(TransferPath::Kernel),
        one_rank(TransferPath::Kernel),
    );
    for round in 0..2 {
        let p = prompt(3);
        let a = whole.serve(&p).unwrap();
        let mut req = steps.begin(&p).unwrap();
        steps.allocate(&mut req).unwrap();
        let v = steps.synthesise_and_verify(&mut req).unwrap();
        assert_eq!(v.all.count, 0);
        let b = steps.finish(&mut req).unwrap();
        assert_eq!(a, b, "round {round}");
        assert_eq!(whole.digest(), steps.digest());
        if round == 0 {
            assert_eq!(b.computed_tokens, 48);
            whole.evict_device_lru(usize::MAX).unwrap();
            steps.evict_device_lru(usize::MAX).unwrap();
        } else {
            assert_eq!(b.host_hit_tokens, 48);
            assert_eq!(b.pages_loaded, 3);
        }
        steps.check_invariants().unwrap();
    }
}

/// Abandoning gives back the pages and the lock, and the request is refused from then on.
#[test]
fn an_abandoned_request_gives_everything_back() {
    let mut rc = one_rank(TransferPath::Kernel);
    rc.serve(&prompt(2)).unwrap();
    let free = rc.lane_free_counts();
    let mut longer = prompt(2);
    longer.extend(1000..1032);
    let mut req = rc.begin(&longer).unwrap();
    assert_eq!(req.cached_pages(), 2);
    rc.allocate(&mut req).unwrap();
    assert_eq!(req.pages().len(), 4);
    assert_ne!(rc.lane_free_counts(), free);
    rc.abandon(&mut req).unwrap();
    // (The lane stacks may hold the pages in another order: digests can differ.)
    assert_eq!(rc.lane_free_counts(), free);
    rc.check_invariants().unwrap();
    // Everything unlocked: an eviction takes the whole cached prefix.
    assert!(rc.evict_device_lru(usize::MAX).unwrap() >= 1);
    for e in [
        rc.allocate(&mut req).unwrap_err(),
        rc.finish(&mut req).unwrap_err(),
        rc.abandon(&mut req).unwrap_err(),
    ] {
        assert!(
            e.to_string().contains("already finished or abandoned"),
            "{e}"
        );
    }
}

/// A step that fails leaves the request as it was before it; it can still be abandoned.
#[test]
fn a_failed_allocation_leaves_the_request_unchanged() {
    let mut rc = one_rank(TransferPath::Kernel);
    let mut req = rc.begin(&prompt(12)).unwrap(); // 12 pages, 8 in the pool
    let e = rc.allocate(&mut req).unwrap_err();
    assert!(e.is_pool_too_small(), "{e}");
    assert!(req.pages().is_empty());
    assert_eq!(req.stats().computed_tokens, 0);
    let e = rc.finish(&mut req).unwrap_err();
    assert!(e.to_string().contains("allocate first"), "{e}");
    rc.abandon(&mut req).unwrap();
    rc.check_invariants().unwrap();
}

pub(super) fn tokens(range: std::ops::Range<u32>) -> Vec<u32> {
    range.map(|t| t * 7 + 3).collect()
}

/// A request grows: its partial page is kept across extends (each step synthesises only
/// its new tokens, and every earlier token still verifies), filled pages go into the
/// tree unfinished and stay there, and a later request hits them.
#[test]
fn extend_keeps_the_partial_page_and_inserts_filled_pages_unfinished() {
    let mut rc = one_rank(TransferPath::Kernel);
    let mut req = rc.begin_allocated(&tokens(0..20)).unwrap();
    assert_eq!((req.pages().len(), req.computed_from()), (2, 0));
    rc.synthesise(&mut req).unwrap();
    assert_eq!(rc.verify(&mut req).unwrap().all.count, 0);
    let partial = req.pages()[1];
    // A chunk that stays in the partial page: no new page, the filled one is inserted.
    rc.extend(&mut req, &tokens(20..25)).unwrap();
    assert_eq!(req.pages().len(), 2);
    assert_eq!(req.pages()[1], partial, "the partial page is kept");
    assert_eq!((req.pages_in_tree(), req.computed_from()), (1, 20));
    // Before the forward writes the new tokens, verification sees exactly them missing.
    let v = rc.verify(&mut req).unwrap();
    assert_eq!((v.all.count, v.all.first), (5, Some(20)));
    rc.synthesise(&mut req).unwrap();
    assert_eq!(rc.verify(&mut req).unwrap().all.count, 0);
    // Decode a token at a time across two page boundaries.
    for t in 25..40 {
        rc.extend(&mut req, &tokens(t..t + 1)).unwrap();
        rc.synthesise(&mut req).unwrap();
    }
    assert_eq!(req.pages().len(), 3);
    assert_eq!(req.pages()[1], partial);
    assert_eq!(req.pages_in_tree(), 2);
    assert_eq!(rc.verify(&mut req).unwrap().all.count, 0);
    let stats = rc.finish(&mut req).unwrap();
    assert_eq!((stats.prompt_tokens, stats.extended_tokens), (20, 20));
    assert_eq!((stats.computed_tokens, stats.extends), (40, 16));
    // The tree keeps whole pages: a longer request hits 32 tokens on the device.
    let again = rc.serve(&tokens(0..48)).unwrap();
    assert_eq!((again.device_hit_tokens, again.mismatched_tokens), (32, 0));
    rc.check_invariants().unwrap();
}

/// Two requests compute the same prompt at once: the second one's extend finds the
/// first one's pages in the tree, takes them and frees its own, and still verifies.
#[test]
fn extend_takes_the_trees_pages_where_another_request_inserted_first() {
    let mut rc = one_rank(TransferPath::Kernel);
    let free = rc.lane_free_counts();
    let p = tokens(0..36);
    let mut a = rc.begin_allocated(&p).unwrap();
    let mut b = rc.begin_allocated(&p).unwrap();
    for r in [&mut a, &mut b] {
        rc.synthesise(r).unwrap();
    }
    rc.extend(&mut a, &tokens(36..37)).unwrap();
    let theirs = a.pages()[..2].to_vec();
    let mine = b.pages()[..2].to_vec();
    assert_ne!(theirs, mine);
    rc.extend(&mut b, &tokens(36..37)).unwrap();
    assert_eq!(b.pages()[..2], theirs[..], "b now reads the tree's pages");
    assert_eq!(b.pages_in_tree(), 2);
    for r in [&mut a, &mut b] {
        rc.synthesise(r).unwrap();
        assert_eq!(rc.verify(r).unwrap().all.count, 0);
        rc.finish(r).unwrap();
    }
    rc.check_invariants().unwrap();
    rc.evict_device_lru(usize::MAX).unwrap();
    assert_eq!(rc.lane_free_counts(), free, "nothing leaked");
}

/// An abandoned request leaves the pages it inserted unfinished cached (SGLang keeps
/// them too) and frees the rest.
#[test]
fn abandoning_an_extended_request_keeps_what_it_inserted() {
    let mut rc = one_rank(TransferPath::Kernel);
    let free = rc.lane_free_counts();
    let mut req = rc.begin_allocated(&tokens(0..40)).unwrap();
    rc.synthesise(&mut req).unwrap();
    rc.extend(&mut req, &tokens(40..60)).unwrap();
    assert_eq!((req.pages().len(), req.pages_in_tree()), (4, 2));
    rc.abandon(&mut req).unwrap();
    rc.check_invariants().unwrap();
    let hit = rc.serve(&tokens(0..40)).unwrap();
    assert_eq!((hit.device_hit_tokens, hit.mismatched_tokens), (32, 0));
    rc.evict_device_lru(usize::MAX).unwrap();
    assert_eq!(rc.lane_free_counts(), free, "nothing leaked");
    for e in [
        rc.extend(&mut req, &tokens(0..1)).unwrap_err(),
        rc.synthesise(&mut req).unwrap_err(),
    ] {
        assert!(e.to_string().contains("already finished"), "{e}");
    }
}

/// Extending before allocating, or by nothing, is refused and changes nothing.
#[test]
fn extend_refuses_a_request_without_pages_and_an_empty_chunk() {
    let mut rc = one_rank(TransferPath::Kernel);
    let mut req = rc.begin(&tokens(0..20)).unwrap();
    let e = rc.extend(&mut req, &tokens(20..21)).unwrap_err();
    assert!(
        e.to_string()
            .contains("no pages to extend yet: allocate first"),
        "{e}"
    );
    rc.allocate(&mut req).unwrap();
    let e = rc.extend(&mut req, &[]).unwrap_err();
    assert!(e.to_string().contains("at least one token"), "{e}");
    assert_eq!(req.tokens().len(), 20);
    rc.abandon(&mut req).unwrap();
    rc.check_invariants().unwrap();
}

/// When the pool cannot hold the extension, the step fails and the request is as it was:
/// still verifying, and it can finish.
#[test]
fn a_failed_extend_leaves_the_request_unchanged() {
    let mut rc = one_rank(TransferPath::Kernel);
    let mut req = rc.begin_allocated(&tokens(0..20)).unwrap();
    rc.synthesise(&mut req).unwrap();
    let pages = req.pages().to_vec();
    let e = rc.extend(&mut req, &tokens(20..200)).unwrap_err();
    assert!(e.is_pool_too_small(), "{e}");
    assert_eq!(req.pages(), &pages[..]);
    assert_eq!((req.tokens().len(), req.pages_in_tree()), (20, 0));
    assert_eq!(rc.verify(&mut req).unwrap().all.count, 0);
    rc.finish(&mut req).unwrap();
    rc.check_invariants().unwrap();
}

/// Two ranks, each on its own host executor and thread, mapping each other's pools.
fn two_ranks() -> Vec<RankCache> {
    two_ranks_in(crate::layout::Layout::Zigzag)
}

/// Two ranks under `layout`.
fn two_ranks_in(layout: crate::layout::Layout) -> Vec<RankCache> {
    ranks_in(2, layout, 17)
}

/// `n` ranks under `layout`, each on its own host executor and thread, mapping each
/// other's pools, with `device_pages` pages a lane (write-through, 1 layer, MLA, page 16).
pub(super) fn ranks_in(
    n: usize,
    layout: crate::layout::Layout,
    device_pages: u32,
) -> Vec<RankCache> {
    let jit = Jit::new(crate::jit::JitConfig::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/target/tmp/jit-cache"
    )));
    let config = ClusterConfig {
        deployment: crate::kernels::Deployment::new(
            crate::kernels::ModelShape::MlaBf16,
            16,
            n as u8,
        )
        .and_then(|d| d.with_layout(layout))
        .unwrap(),
        layers: 1,
        device_pages,
        host_pages: 8,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: crate::jit::Sanitize::None,
    };
    let members = crate::group::LocalGroup::members(n as u8, std::time::Duration::from_secs(60));
    std::thread::scope(|s| {
        let handles: Vec<_> = members
            .into_iter()
            .map(|m| {
                let (config, jit) = (config.clone(), &jit);
                s.spawn(move || {
                    let exec = Arc::new(crate::exec::HostExecutor::new(
                        crate::exec::HostOptions::default(),
                    ));
                    RankCache::new(config, exec, jit, Box::new(m), PeerAccess::Mapped).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A step that succeeds on this rank but fails on a peer is rolled back here too, and
/// the request is as it was before the step: the allocation can then be retried.
#[test]
fn a_step_a_peer_failed_is_rolled_back_and_can_be_retried() {
    let ranks = two_ranks();
    let p = prompt(4);
    let results: Vec<(usize, bool, usize, RequestStats, StateDigest)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut rc| {
                let p = p.clone();
                s.spawn(move || {
                    let mut req = rc.begin(&p).unwrap();
                    if rc.rank().0 == 1 {
                        // Rank 1's select kernel fails; rank 0's allocation succeeds.
                        rc.executor().inject_launch_failure();
                    }
                    let e = rc.allocate(&mut req).unwrap_err();
                    let peer = e.is_peer_failure();
                    let after_failure = req.pages().len();
                    assert!(!req.allocated);
                    rc.allocate(&mut req).unwrap();
                    assert_eq!(rc.synthesise_and_verify(&mut req).unwrap().all.count, 0);
                    let stats = rc.finish(&mut req).unwrap();
                    rc.check_invariants().unwrap();
                    (
                        usize::from(rc.rank().0),
                        peer,
                        after_failure,
                        stats,
                        rc.digest(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let (r0, r1) = (&results[0], &results[1]);
    assert_eq!((r0.0, r1.0), (0, 1));
    assert!(r0.1, "rank 0 learnt of rank 1's failure");
    assert!(!r1.1, "rank 1 has its own error");
    assert_eq!((r0.2, r1.2), (0, 0), "no pages kept from the failed step");
    assert_eq!(r0.3.computed_tokens, 64);
    assert_eq!(r0.3.pages_written, 4);
    assert_eq!(r0.4, r1.4, "the replicas agree");
}

/// Two ranks extend one request: with the same tokens they agree (appended pages by
/// position, one on each rank's lane, and every token verifies on both ranks); with
/// different tokens every rank fails the step with `Diverged`, the request stays as it was,
/// and it can still be finished.
#[test]
fn ranks_that_extend_differently_diverge_and_the_request_stays_as_it_was() {
    let ranks = two_ranks();
    let results: Vec<(Vec<PageId>, String, usize)> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut rc| {
                s.spawn(move || {
                    let me = rc.rank().0;
                    let mut req = rc.begin_chunk(&tokens(0..100), 40).unwrap();
                    assert_eq!(req.tokens().len(), 40);
                    rc.synthesise(&mut req).unwrap();
                    rc.extend(&mut req, &tokens(40..100)).unwrap();
                    rc.synthesise(&mut req).unwrap();
                    assert_eq!(rc.verify(&mut req).unwrap().all.count, 0);
                    let pages = req.pages().to_vec();
                    // Rank 1 is given other tokens than rank 0, enough to need a page (a
                    // step that allocates makes its round at once; see the step tests for
                    // decode tokens in a kept partial page).
                    let t: Vec<u32> = (500..520).map(|t| t + u32::from(me)).collect();
                    let e = rc.extend(&mut req, &t).unwrap_err();
                    assert_eq!(req.pages(), &pages[..], "unchanged after the failed step");
                    assert_eq!(req.tokens().len(), 100);
                    rc.extend(&mut req, &(500..520).collect::<Vec<_>>())
                        .unwrap();
                    rc.synthesise(&mut req).unwrap();
                    assert_eq!(rc.verify(&mut req).unwrap().all.count, 0);
                    rc.finish(&mut req).unwrap();
                    rc.check_invariants().unwrap();
                    (pages, e.to_string(), req.pages_in_tree())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(results[0].0, results[1].0, "the ranks hold the same pages");
    // Pages past the first chunk are appended by position: page i on rank i % 2.
    for (i, p) in results[0].0.iter().enumerate().skip(3) {
        assert_eq!(p.0 % 2, i as u32 % 2, "page {i}");
    }
    for (_, e, _) in &results {
        assert!(e.contains("diverged") || e.contains("differ"), "{e}");
    }
}

/// Under the interleaved layouts a request holds whole granules, more pages than the tokens
/// fill: a token-by-token decode must still synthesise every token into the right page (the
/// page list a synthesise uploads starts where its launch reads, not at `pages.len() - items`,
/// which once scattered tokens across the wrong pages). No verification in between, so
/// nothing refreshes the uploaded page list.
#[test]
fn a_decode_under_the_interleaved_layouts_writes_every_token_where_it_belongs() {
    use crate::layout::Layout;
    for layout in [Layout::PageInterleave, Layout::TokenInterleave { size: 4 }] {
        let ranks = two_ranks_in(layout);
        let bad: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|mut rc| {
                    s.spawn(move || {
                        let mut req = rc.begin_chunk(&tokens(0..20), 20).unwrap();
                        rc.synthesise(&mut req).unwrap();
                        for t in 20..70 {
                            rc.extend(&mut req, &[t * 7 + 3]).unwrap();
                            rc.synthesise(&mut req).unwrap();
                        }
                        assert_eq!(req.pages().len() % 2, 0, "whole granules");
                        let v = rc.verify(&mut req).unwrap();
                        rc.finish(&mut req).unwrap();
                        rc.check_invariants().unwrap();
                        v.all.count
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(bad, [0, 0], "{layout:?}");
    }
}
