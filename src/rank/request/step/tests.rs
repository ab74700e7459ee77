//! A scheduler's batches: one round a step, none for decode tokens in kept partial pages,
//! and one request's failure failing that request on every rank, not the step.

use super::super::tests::{ranks_in, tokens};
use super::*;
use crate::allocator::StateDigest;
use crate::layout::Layout;

/// Runs `each` on `n` ranks (threads, zigzag, 64 pages a lane) and returns their results
/// in rank order.
fn on_ranks<T: Send>(n: usize, each: impl Fn(&mut RankCache) -> T + Sync) -> Vec<T> {
    let ranks = ranks_in(n, Layout::Zigzag, 64);
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|mut rc| {
                let each = &each;
                s.spawn(move || each(&mut rc))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn begin_all(rc: &mut RankCache, prompts: &[Vec<u32>]) -> StepOutcome {
    rc.step(Step {
        begin: prompts.iter().map(Vec::as_slice).collect(),
        allocate: true,
        ..Step::default()
    })
    .unwrap()
}

/// Eight requests admitted in one step, decoded a token a step for 20 steps, finished in
/// one step: 1 round to admit, a round only in the decode steps that insert a filled page
/// or need a new one (2 of 20), 1 to finish; every token verifies on every rank and the
/// replicas agree.
#[test]
fn a_batch_takes_one_round_a_step_and_decode_in_kept_pages_takes_none() {
    let out = on_ranks(2, |rc| {
        let prompts: Vec<Vec<u32>> = (0..8).map(|i| tokens(i * 1000..i * 1000 + 20)).collect();
        let before = rc.rounds();
        let begun = begin_all(rc, &prompts);
        assert_eq!(begun.rounds, 1);
        assert_eq!(rc.rounds() - before, 1);
        let mut reqs: Vec<Request> = begun.begun.into_iter().map(Result::unwrap).collect();
        for r in &mut reqs {
            rc.synthesise(r).unwrap();
        }
        let mut per_step = Vec::new();
        for t in 0..20u32 {
            let next: Vec<[u32; 1]> = (0..8).map(|i| [90_000 + i * 100 + t]).collect();
            let before = rc.rounds();
            let out = rc
                .step(Step {
                    extend: reqs
                        .iter_mut()
                        .zip(&next)
                        .map(|(r, t)| (r, &t[..]))
                        .collect(),
                    ..Step::default()
                })
                .unwrap();
            assert_eq!(rc.rounds() - before, out.rounds);
            per_step.push(out.rounds);
            for (r, e) in reqs.iter_mut().zip(out.extended) {
                e.unwrap();
                rc.synthesise(r).unwrap();
            }
        }
        for r in &mut reqs {
            assert_eq!(r.tokens().len(), 40);
            assert_eq!(rc.verify(r).unwrap().all.count, 0);
        }
        let before = rc.rounds();
        let done = rc
            .step(Step {
                finish: reqs.iter_mut().map(|r| (r, true)).collect(),
                ..Step::default()
            })
            .unwrap();
        assert_eq!((done.rounds, rc.rounds() - before), (1, 1));
        for f in done.finished {
            assert!(matches!(f.unwrap(), Ending::Finished(_)));
        }
        rc.check_invariants().unwrap();
        (per_step, rc.digest())
    });
    let (steps, digest) = &out[0];
    // Token 20 (the first decode) inserts the first filled page; token 32 needs a new page.
    let mut want = vec![0; 20];
    want[0] = 1;
    want[12] = 1;
    assert_eq!(steps, &want);
    assert_eq!(&out[1].1, digest, "the replicas agree");
}

/// One rank fails the first of two extends in a step: that request fails on both ranks and
/// is left as it was (and extends on a retry), the other request grows; everything
/// verifies and the replicas agree.
#[test]
fn a_request_a_rank_failed_fails_on_every_rank_and_the_rest_of_the_step_lands() {
    let out: Vec<(bool, bool, StateDigest)> = on_ranks(2, |rc| {
        let prompts = [tokens(0..20), tokens(5000..5020)];
        let mut reqs: Vec<Request> = begin_all(rc, &prompts)
            .begun
            .into_iter()
            .map(Result::unwrap)
            .collect();
        for r in &mut reqs {
            rc.synthesise(r).unwrap();
        }
        let chunk = [tokens(20..40), tokens(5020..5040)];
        let pages: Vec<Vec<PageId>> = reqs.iter().map(|r| r.pages().to_vec()).collect();
        if rc.rank().0 == 1 {
            // The first launch of the step (the first extend's backup or allocation) fails.
            rc.executor().inject_launch_failure();
        }
        let out = rc
            .step(Step {
                extend: reqs
                    .iter_mut()
                    .zip(&chunk)
                    .map(|(r, t)| (r, t.as_slice()))
                    .collect(),
                ..Step::default()
            })
            .unwrap();
        // Round, rollback (2 rounds), the second pass's round.
        assert_eq!(out.rounds, 4);
        let mut ext = out.extended.into_iter();
        let e = ext.next().unwrap().unwrap_err();
        let peer = e.is_peer_failure();
        ext.next().unwrap().unwrap();
        assert_eq!(
            reqs[0].pages(),
            &pages[0][..],
            "the failed request as it was"
        );
        assert_eq!(reqs[0].tokens().len(), 20);
        assert_eq!(reqs[1].tokens().len(), 40);
        rc.synthesise(&mut reqs[1]).unwrap();
        rc.extend(&mut reqs[0], &chunk[0]).unwrap();
        rc.synthesise(&mut reqs[0]).unwrap();
        let mut bad = 0;
        for r in &mut reqs {
            bad += rc.verify(r).unwrap().all.count;
        }
        let done = rc
            .step(Step {
                finish: reqs.iter_mut().map(|r| (r, true)).collect(),
                ..Step::default()
            })
            .unwrap();
        assert!(done.finished.iter().all(Result::is_ok));
        rc.check_invariants().unwrap();
        (peer, bad == 0, rc.digest())
    });
    assert!(out[0].0, "rank 0 learnt of rank 1's failure");
    assert!(!out[1].0, "rank 1 has its own error");
    assert!(out[0].1 && out[1].1, "every token verifies");
    assert_eq!(out[0].2, out[1].2, "the replicas agree");
}

/// In a step ending three requests, rank 1 ends the middle one with `ok = false`: it is
/// abandoned on both ranks (naming rank 1), the others finish; a new request in the same
/// step is admitted.
#[test]
fn an_end_one_rank_says_not_ok_abandons_that_request_everywhere_and_the_step_goes_on() {
    let out = on_ranks(2, |rc| {
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| tokens(i * 1000..i * 1000 + 40)).collect();
        let mut reqs: Vec<Request> = begin_all(rc, &prompts)
            .begun
            .into_iter()
            .map(Result::unwrap)
            .collect();
        for r in &mut reqs {
            rc.synthesise(r).unwrap();
        }
        let me = rc.rank().0;
        let newcomer = tokens(7000..7040);
        let out = rc
            .step(Step {
                finish: reqs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, r)| (r, !(i == 1 && me == 1)))
                    .collect(),
                begin: vec![&newcomer],
                allocate: true,
                ..Step::default()
            })
            .unwrap();
        let endings: Vec<Ending> = out.finished.into_iter().map(Result::unwrap).collect();
        let mut new = out.begun.into_iter().next().unwrap().unwrap();
        rc.synthesise(&mut new).unwrap();
        assert_eq!(rc.verify(&mut new).unwrap().all.count, 0);
        rc.finish(&mut new).unwrap();
        // The finished ones are cached, the abandoned one is not.
        let mut hits = Vec::new();
        for p in &prompts {
            hits.push(rc.serve(p).unwrap().device_hit_tokens);
        }
        rc.check_invariants().unwrap();
        (endings, hits, rc.digest())
    });
    for (endings, hits, _) in &out {
        assert!(matches!(endings[0], Ending::Finished(_)));
        assert_eq!(endings[1], Ending::Abandoned { by: vec![1] });
        assert!(matches!(endings[2], Ending::Finished(_)));
        assert_eq!(hits, &[32, 0, 32]);
    }
    assert_eq!(out[0].2, out[1].2, "the replicas agree");
}

/// Decode tokens in a kept partial page take no round, so ranks given different tokens do
/// not learn it then: the next step with a round compares what happened since the last one
/// and fails with `Diverged` on every rank.
#[test]
fn a_roundless_step_is_compared_at_the_next_round() {
    let out = on_ranks(2, |rc| {
        let mut req = rc.begin_allocated(&tokens(0..20)).unwrap();
        rc.synthesise(&mut req).unwrap();
        rc.extend(&mut req, &[1]).unwrap();
        let before = rc.rounds();
        let t = 77 + u32::from(rc.rank().0);
        rc.extend(&mut req, &[t]).unwrap();
        assert_eq!(rc.rounds(), before, "no round");
        let e = rc.extend(&mut req, &tokens(100..120)).unwrap_err();
        assert_eq!(
            req.tokens().len(),
            22,
            "the failed step left the request as it was"
        );
        rc.abandon(&mut req).unwrap();
        e.to_string()
    });
    for e in out {
        assert!(e.contains("diverged") || e.contains("differ"), "{e}");
    }
}

/// Bad steps are refused before any round: an empty extend, a chunk without allocation.
#[test]
fn malformed_steps_are_refused_before_any_round() {
    let out = on_ranks(1, |rc| {
        let mut req = rc.begin_allocated(&tokens(0..20)).unwrap();
        let before = rc.rounds();
        let empty: [u32; 0] = [];
        let e = rc
            .step(Step {
                extend: vec![(&mut req, &empty[..])],
                ..Step::default()
            })
            .err()
            .unwrap();
        assert!(e.to_string().contains("at least one token"), "{e}");
        let p = tokens(0..40);
        let e = rc
            .step(Step {
                begin: vec![&p],
                chunk: Some(16),
                ..Step::default()
            })
            .err()
            .unwrap();
        assert!(e.to_string().contains("needs allocate"), "{e}");
        assert_eq!(rc.rounds(), before);
        rc.abandon(&mut req).unwrap();
    });
    assert_eq!(out.len(), 1);
}
