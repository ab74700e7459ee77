//! The step API as an engine drives it (`begin`, `allocate`, its own forward writing the
//! pools, `finish` / `abandon`), with ranks as threads, each with an executor and a cache
//! of its own, reading each other's pools through shared-memory mappings as engine
//! processes do. Each test makes one way of reading wrong KV, or of hanging, happen: a slow
//! peer still reading when its owner ends the request, ranks handed different prompts or
//! settings, a rank that cannot start, ranks that disagree on how a request ends.

mod hicache_support;

use cp_hicache::cluster::{ClusterConfig, ClusterError};
use cp_hicache::exec::Executor;
use cp_hicache::group::{Collective, GroupError, LocalGroup, LocalMember};
use cp_hicache::kernels::{BufferKind, CopyLaunch, Deployment, ModelShape};
use cp_hicache::layout::PageId;
use cp_hicache::rank::{Ending, PeerAccess, RankCache, Request, WritePolicy, START_ROUND};
use hicache_support::{host_executor, jit, tokens, Spy};
use std::sync::{Arc, Barrier};
use std::thread;
use std::time::{Duration, Instant};

const PS: usize = 16;

fn config(cp: u8, device_pages: u32) -> ClusterConfig {
    ClusterConfig {
        deployment: Deployment::new(ModelShape::MlaBf16, PS as u32, cp).unwrap(),
        layers: 2,
        device_pages,
        host_pages: 64,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: cp_hicache::jit::Sanitize::None,
    }
}

/// Runs `f(rank, member)` on one thread per rank of a fresh group and returns each rank's
/// result, in rank order.
fn on_ranks<T: Send + 'static>(
    cp: u8,
    f: impl Fn(u8, LocalMember) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let f = Arc::new(f);
    let threads: Vec<_> = LocalGroup::members(cp, Duration::from_secs(60))
        .into_iter()
        .enumerate()
        .map(|(r, m)| {
            let f = f.clone();
            thread::spawn(move || f(r as u8, m))
        })
        .collect();
    threads.into_iter().map(|t| t.join().unwrap()).collect()
}

/// Rank `member.rank()`'s cache over an executor of its own.
fn rank_cache(config: ClusterConfig, member: LocalMember) -> Result<RankCache, ClusterError> {
    let exec: Arc<dyn Executor> = Arc::new(host_executor());
    RankCache::new(config, exec, &jit(), Box::new(member), PeerAccess::Mapped)
}

/// The bytes an engine's forward writes for the `i`-th page of a sequence in `layer` of
/// `kind`: unlike anything the cache writes (poison is 0xA5), and different per page and
/// layer. Keyed by the position in the sequence, which a load-back keeps (not the page id).
fn forward_bytes(rc: &RankCache, kind: BufferKind, i: usize, layer: u32) -> Vec<u8> {
    let n = kind.page_bytes(rc.layout().page_size()) as usize;
    (0..n)
        .map(|b| (i * 31 + layer as usize * 7 + b) as u8 | 1)
        .collect()
}

/// Where `page`'s bytes of `layer` start in its owner's pool.
fn offset(rc: &RankCache, kind: BufferKind, page: PageId, layer: u32) -> u64 {
    let g = rc.pools().geometry();
    let n = kind.page_bytes(rc.layout().page_size());
    (u64::from(layer) * u64::from(g.local_pages) + u64::from(rc.layout().local(page).0)) * n
}

/// The engine's forward on this rank: writes every page of `req` it owns from
/// `req.cached_pages()` on, every layer and buffer kind.
fn forward(rc: &RankCache, req: &Request) {
    for (i, &p) in req.pages().iter().enumerate().skip(req.cached_pages()) {
        if rc.layout().owner(p) != rc.rank() {
            continue;
        }
        for kind in rc.config().deployment.model.buffers() {
            for layer in 0..rc.pools().geometry().layers {
                rc.executor()
                    .upload(
                        rc.pools().device(kind).expect("the cache's own pool"),
                        offset(rc, kind, p, layer),
                        &forward_bytes(rc, kind, i, layer),
                    )
                    .unwrap();
            }
        }
    }
}

/// Attention on this rank: reads every page of `req` from its owner's pool (through this
/// rank's mapping of it) and counts the page-layers whose bytes are not what the forward
/// wrote.
fn attention_mismatches(rc: &RankCache, req: &Request) -> usize {
    let mut wrong = 0;
    for (i, &p) in req.pages().iter().enumerate() {
        let owner = usize::from(rc.layout().owner(p).0);
        for kind in rc.config().deployment.model.buffers() {
            for layer in 0..rc.pools().geometry().layers {
                let want = forward_bytes(rc, kind, i, layer);
                let mut got = vec![0u8; want.len()];
                rc.executor()
                    .read(
                        rc.pools().views(kind)[owner]
                            .as_ref()
                            .and_then(|v| v.buffer)
                            .expect("the cache's own pool"),
                        offset(rc, kind, p, layer),
                        &mut got,
                    )
                    .unwrap();
                wrong += usize::from(got != want);
            }
        }
    }
    wrong
}

/// Finding 2: `finish` and `abandon` freed and re-poisoned the partial last page and the
/// pages of an abandoned request while a slow peer was still reading them. Rank 0 ends the
/// request as soon as its own attention is done; rank 1 reads 300 ms later. Rank 1 must
/// still read what the forward wrote: nothing is freed before every rank has reached the
/// end of the request.
#[test]
fn ending_a_request_frees_nothing_a_slow_peer_still_reads() {
    for ok in [true, false] {
        let forward_done = Arc::new(Barrier::new(2));
        let wrong = on_ranks(2, move |r, m| {
            let mut rc = rank_cache(config(2, 65), m).unwrap();
            // 4 pages over 2 ranks, zigzag 0,1,1,0: the partial last page is rank 0's.
            let prompt = tokens(7, 3 * PS + 5);
            let mut req = rc.begin_allocated(&prompt).unwrap();
            assert_eq!(req.pages().len(), 4);
            forward(&rc, &req);
            // The engine's own forward ends together on every rank (its collectives).
            forward_done.wait();
            if r == 1 {
                thread::sleep(Duration::from_millis(300));
            }
            let wrong = attention_mismatches(&rc, &req);
            if ok {
                let stats = rc.finish(&mut req).unwrap();
                assert_eq!(stats.computed_tokens, prompt.len() as u64);
            } else {
                rc.abandon(&mut req).unwrap();
            }
            rc.check_invariants().unwrap();
            wrong
        });
        assert_eq!(wrong, [0, 0], "ok={ok}: a peer read freed pages");
    }
}

/// Finding 1: `begin` returned once this rank's load-back was queued, not when its peers'
/// were done. Each rank's executor holds back its layer-1 host→device copies until someone
/// waits for them (the host executor's delay hook, [`Spy::hold_h2d_layer`]), as a GPU
/// stream runs them late. A peer's attention reads the loaded pages right after `begin`,
/// through its own mapping, with no wait of its own: it must see every loaded byte.
#[test]
fn begin_returns_only_when_every_peer_can_read_the_loaded_pages() {
    let written = Arc::new(Barrier::new(2));
    let out = on_ranks(2, move |r, m| {
        let spy = Spy::new();
        let exec: Arc<dyn Executor> = spy.clone();
        // An uncapped transfer grid: a launch per layer, so layer 1's can be held (the
        // default capped one puts the layers of so few pages in one launch).
        let mut cfg = config(2, 65);
        cfg.deployment.transfer_copy = CopyLaunch {
            max_blocks: 0,
            ..CopyLaunch::gpu_transfer()
        };
        let mut rc = RankCache::new(cfg, exec, &jit(), Box::new(m), PeerAccess::Mapped).unwrap();
        let prompt = tokens(11, 6 * PS + 2);
        let mut req = rc.begin_allocated(&prompt).unwrap();
        forward(&rc, &req);
        written.wait();
        assert_eq!(attention_mismatches(&rc, &req), 0);
        rc.finish(&mut req).unwrap();
        rc.evict_device_lru(usize::MAX).unwrap();
        spy.hold_h2d_layer(1, true);
        // Layer by layer (one launch per layer, so one can be held), as for an engine
        // whose attention waits per layer.
        rc.set_layer_waits(true);
        let mut req = rc.begin_allocated(&prompt).unwrap();
        assert_eq!(req.cached_pages(), 6, "rank {r}");
        forward(&rc, &req);
        written.wait();
        let wrong = attention_mismatches(&rc, &req);
        let log = spy.hold_log();
        rc.finish(&mut req).unwrap();
        (wrong, log)
    });
    for (r, (wrong, log)) in out.into_iter().enumerate() {
        assert!(
            log.iter().any(|l| l == "h2d held"),
            "rank {r}: nothing held: {log:?}"
        );
        assert_eq!(wrong, 0, "rank {r} read stale loaded pages: {log:?}");
    }
}

/// Finding 3: ranks handed different prompts carried on with different caches. Now the
/// step's outcome round compares what each rank decided: every rank fails that step with
/// an error naming the ranks and the step, undoes it, and the group goes on.
#[test]
fn ranks_with_different_prompts_fail_the_step_and_go_on() {
    let out = on_ranks(2, |r, m| {
        let mut rc = rank_cache(config(2, 65), m).unwrap();
        let shared = tokens(1, 4 * PS);
        rc.serve(&shared).unwrap();
        let before = rc.digest();
        // Rank 0 asks for the cached prompt, rank 1 for another one of the same length.
        let mine = if r == 0 {
            shared.clone()
        } else {
            tokens(2, 4 * PS)
        };
        let err = match rc.begin(&mine) {
            Err(e) => e,
            Ok(_) => panic!("rank {r}: different prompts went through"),
        };
        assert_eq!(rc.digest(), before, "rank {r}: the step was not undone");
        rc.check_invariants().unwrap();
        // The group goes on.
        let again = rc.serve(&shared).unwrap();
        assert_eq!(again.device_hit_tokens, 4 * PS as u64);
        assert_eq!(again.mismatched_tokens, 0);
        err
    });
    for (r, e) in out.iter().enumerate() {
        assert!(
            matches!(e, ClusterError::Diverged { step, groups, .. }
                if step == "request 1 begin" && groups.len() == 2),
            "rank {r}: {e}"
        );
        assert!(
            e.to_string()
                .contains("the ranks decided differently (rank(s) 0 vs rank(s) 1)"),
            "{e}"
        );
    }
}

/// Finding 3: `device_pages` 65 on one rank and 66 on the other started and served. Now the
/// start-up round compares the settings and every rank refuses to start, naming the setting
/// and each rank's value.
#[test]
fn ranks_with_different_pool_sizes_refuse_to_start() {
    let out = on_ranks(2, |r, m| {
        rank_cache(config(2, 65 + u32::from(r)), m)
            .err()
            .map(|e| e.to_string())
    });
    for (r, e) in out.iter().enumerate() {
        let e = e.as_deref().unwrap_or_else(|| panic!("rank {r} started"));
        assert!(
            e.contains("the ranks' configurations differ: device pages: rank 0 65, rank 1 66"),
            "rank {r}: {e}"
        );
    }
}

/// Finding 4: a rank that could not start left its peers waiting for the whole group
/// timeout. Now its failure is its contribution to the first round: the peer fails at once,
/// naming it and its error. Both ways: the cache's own build failing (a kernel that does not
/// compile), and the engine's own checks failing before the cache is built
/// ([`RankCache::refuse_start`]).
#[test]
fn a_rank_that_cannot_start_fails_its_peers_at_once() {
    for engine_side in [false, true] {
        let start = Instant::now();
        let out = on_ranks(3, move |r, m| {
            if r != 2 {
                return Some(rank_cache(config(3, 96), m).err().unwrap());
            }
            if engine_side {
                RankCache::refuse_start(&m, "bad tuning file: not JSON").unwrap();
                m.leave();
            } else {
                let mut c = config(3, 96);
                c.fault = Some(cp_hicache::rank::Fault::CompileError);
                assert!(rank_cache(c, m).is_err());
            }
            None
        });
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "peers waited for the group timeout"
        );
        for e in out.into_iter().flatten() {
            assert!(
                matches!(&e, ClusterError::StartFailed { failures, .. } if failures[0].0 == 2),
                "{e}"
            );
            let shown = e.to_string();
            let why = if engine_side {
                "bad tuning file"
            } else {
                "compile"
            };
            assert!(
                shown.contains("the CP group cannot start: rank 2 failed: could not start")
                    && shown.contains(why),
                "{shown}"
            );
            assert!(e.is_group_broken());
        }
    }
}

/// Finding 5: one rank's forward failed and it abandoned the request while its peer
/// finished it, which broke the group for good. Now both calls are the same round: every
/// rank abandons, the finishing rank learns who did not finish, and the group goes on with
/// replicas that agree.
#[test]
fn a_rank_that_abandons_while_its_peers_finish_makes_every_rank_abandon() {
    let out = on_ranks(3, |r, m| {
        let mut rc = rank_cache(config(3, 96), m).unwrap();
        let cached = tokens(3, 4 * PS);
        rc.serve(&cached).unwrap();
        let free = rc.lane_free_counts();
        let mut longer = cached.clone();
        longer.extend(tokens(4, 2 * PS + 3));
        let mut req = rc.begin_allocated(&longer).unwrap();
        forward(&rc, &req);
        let ending = match r {
            1 => rc.end(&mut req, false).unwrap(),
            _ => match rc.finish(&mut req) {
                Err(ClusterError::Abandoned { request, by, .. }) => {
                    assert_eq!(request, 1);
                    Ending::Abandoned { by }
                }
                other => panic!("rank {r}: {other:?}"),
            },
        };
        assert_eq!(ending, Ending::Abandoned { by: vec![1] }, "rank {r}");
        assert_eq!(
            rc.lane_free_counts(),
            free,
            "rank {r}: pages not given back"
        );
        rc.check_invariants().unwrap();
        // The group goes on, and the replicas agree.
        let s = rc.serve(&longer).unwrap();
        assert_eq!(s.device_hit_tokens, 4 * PS as u64);
        assert_eq!(s.mismatched_tokens, 0);
        let d = rc.all_digests("after").unwrap();
        assert!(d.iter().all(|x| *x == d[0]));
    });
    assert_eq!(out.len(), 3);
}

/// A request in two rounds: `begin_allocated` and `finish`. The step API's rounds are
/// counted in the request's statistics.
#[test]
fn a_request_takes_two_rounds_through_the_step_api() {
    let written = Arc::new(Barrier::new(2));
    on_ranks(2, move |_, m| {
        let mut rc = rank_cache(config(2, 65), m).unwrap();
        let prompt = tokens(9, 5 * PS + 1);
        let mut req = rc.begin_allocated(&prompt).unwrap();
        forward(&rc, &req);
        let stats = rc.finish(&mut req).unwrap();
        assert_eq!(stats.group_rounds, 2, "{stats:?}");
        // After an eviction the load-back comes in the same two rounds.
        rc.evict_device_lru(usize::MAX).unwrap();
        let mut req = rc.begin_allocated(&prompt).unwrap();
        assert_eq!(req.cached_pages(), 5);
        forward(&rc, &req);
        // The engine's own collective: every rank's fresh pages are written.
        written.wait();
        assert_eq!(
            attention_mismatches(&rc, &req),
            0,
            "loaded pages read wrong"
        );
        let stats = rc.finish(&mut req).unwrap();
        assert_eq!(stats.group_rounds, 2, "{stats:?}");
        assert_eq!(stats.fence_syncs, 1, "{stats:?}");
        // Separate allocate: one more.
        let mut req = rc.begin(&tokens(10, 2 * PS)).unwrap();
        rc.allocate(&mut req).unwrap();
        forward(&rc, &req);
        assert_eq!(rc.finish(&mut req).unwrap().group_rounds, 3);
    });
}

/// `close` is a round: a rank that closes while its peer still serves fails the peer's call
/// at once instead of leaving it to the group timeout.
#[test]
fn a_rank_that_closes_early_fails_its_peers_at_once() {
    let start = Instant::now();
    let out = on_ranks(2, |r, m| {
        let mut rc = rank_cache(config(2, 65), m).unwrap();
        if r == 0 {
            return rc.close().err().map(|e| e.to_string());
        }
        let e = rc.serve(&tokens(1, 2 * PS)).unwrap_err();
        Some(e.to_string())
    });
    assert!(start.elapsed() < Duration::from_secs(30));
    assert!(
        out.iter().flatten().any(|e| e.contains("diverged")),
        "{out:?}"
    );
}

/// The start-up round's name is public: an engine's wrapper that fails before building the
/// cache contributes to it with [`RankCache::refuse_start`], which pairs with a peer's
/// `all_gather` of the same round.
#[test]
fn refuse_start_pairs_with_the_start_up_round() {
    let out = on_ranks(2, |r, m| {
        let e = if r == 0 {
            RankCache::refuse_start(&m, "no GPU").err()
        } else {
            m.all_gather(START_ROUND, b"config").err()
        };
        m.leave();
        e
    });
    assert!(out[0].is_none());
    assert!(
        matches!(&out[1], Some(GroupError::PeerFailed { failures }) if failures[0].1.contains("no GPU")),
        "{out:?}"
    );
}

/// A member whose answers are corrupted for rounds whose name contains `round`: rank 1's
/// contribution, as this rank receives it, goes through `corrupt`.
struct Liar {
    inner: LocalMember,
    round: &'static str,
    corrupt: fn(&mut Vec<u8>),
}

impl Collective for Liar {
    fn rank(&self) -> cp_hicache::layout::Rank {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn kind(&self) -> &'static str {
        "liar"
    }
    fn exchange(&self, what: &str, mine: Result<&[u8], &str>) -> Result<Vec<Vec<u8>>, GroupError> {
        let mut all = self.inner.exchange(what, mine)?;
        if what.contains(self.round) {
            (self.corrupt)(&mut all[1]);
        }
        Ok(all)
    }
    fn abort(&self, why: &str) {
        self.inner.abort(why);
    }
}

/// A group that lies is not believed (issue 30, item 7): a 5-byte digest, an oversized
/// verification bitmap or an end's mode that is not a mode aborts the group with an error
/// naming the rank and the round, instead of becoming a zero digest or a wrong verdict.
#[test]
fn malformed_answers_from_the_group_abort_it() {
    type Case = (&'static str, fn(&mut Vec<u8>), &'static str);
    let cases: [Case; 3] = [
        ("digests", |b| b.truncate(5), "rank 1 sent a 5-byte digest"),
        ("verified", |b| b.extend([0u8; 4000]), "-byte bitmap for"),
        // A step's report: a 32-byte digest, the operation count, then per operation its
        // mode (0, 1 or 2) and status.
        (
            "end outcome",
            |b| b[36] = 7,
            "not a step report of 1 operations",
        ),
    ];
    for (round, corrupt, want) in cases {
        let out = on_ranks(2, move |r, m| {
            let liar = Liar {
                inner: m,
                round,
                corrupt,
            };
            let exec: Arc<dyn Executor> = Arc::new(host_executor());
            let mut rc = RankCache::new(
                config(2, 65),
                exec,
                &jit(),
                Box::new(liar),
                PeerAccess::Mapped,
            )
            .unwrap();
            let prompt = tokens(5, 3 * PS);
            let e = match round {
                "digests" => rc.all_digests("digests").err(),
                "verified" => rc.serve(&prompt).err(),
                _ => {
                    let mut req = rc.begin_allocated(&prompt).unwrap();
                    rc.finish(&mut req).err()
                }
            };
            let e = e.unwrap_or_else(|| panic!("rank {r}: {round}: believed"));
            assert!(e.is_group_broken(), "{e}");
            // Nothing more is served on the group.
            assert!(rc.serve(&prompt).unwrap_err().is_group_broken());
            e.to_string()
        });
        for e in out {
            assert!(e.contains(round) && e.contains(want), "{round}: {e}");
        }
    }
}
