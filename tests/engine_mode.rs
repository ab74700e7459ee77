//! Engine mode: C ranks, each on its own thread with its own executor, agreeing through a
//! collective and reading each other's pools through shared-memory mappings, as C engine
//! processes would. Each test makes one cross-rank failure happen and checks what every rank
//! does about it.

mod hicache_support;

use cp_hicache::cluster::{Cluster, ClusterConfig, ClusterError};
use cp_hicache::exec::Executor;
use cp_hicache::kernels::{CopyLaunch, Deployment, ModelShape};
use hicache_support::{evict_all, host_executor, jit, serve, serve_checked, tokens, Setup, Spy};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The cluster of `setup` with one host executor per rank.
fn per_rank(setup: &Setup) -> Cluster {
    let config = ClusterConfig {
        deployment: Deployment::new(setup.model, setup.page_size, setup.cp).unwrap(),
        layers: setup.layers,
        device_pages: setup.device_pages,
        host_pages: setup.host_pages,
        policy: setup.policy,
        fault: setup.fault,
        sanitize: cp_hicache::jit::Sanitize::None,
    };
    let execs: Vec<Arc<dyn Executor>> = (0..setup.cp)
        .map(|_| Arc::new(host_executor()) as Arc<dyn Executor>)
        .collect();
    Cluster::with_executors(config, execs, &jit()).unwrap()
}

#[test]
fn ranks_with_executors_of_their_own_serve_and_verify_on_every_rank() {
    let setup = Setup {
        layers: 2,
        ..Setup::new(ModelShape::Nsa, 64, 4)
    };
    let mut c = per_rank(&setup);
    let info = c.group_info().clone();
    assert_eq!(
        (
            info.kind,
            info.ranks,
            info.peer_pools,
            info.executor_per_rank
        ),
        ("local", 4, "shared-memory", true)
    );
    let a = tokens(1, 9 * 64 + 5);
    serve(&mut c, &a);
    evict_all(&mut c);
    let s = serve(&mut c, &a);
    assert_eq!(s.host_hit_tokens, 9 * 64, "{s:?}");
    // Every rank materialised and verified the whole sequence over its own mappings.
    assert_eq!(c.last_verdict().by_rank, vec![0; 4]);
    c.check_device_lanes().unwrap();
}

/// One rank maps one peer's pools wrongly (it reads rank 2's pool where rank 1's should be):
/// the mismatches show on that rank only, and in the request's verdict.
#[test]
fn a_wrong_peer_mapping_shows_on_that_rank_only() {
    let setup = Setup::new(ModelShape::MlaBf16, 16, 4);
    let mut c = per_rank(&setup);
    c.debug_view_peer_as(3, 1, 2);
    // 8 pages, zigzag owners 0,1,2,3,3,2,1,0: two pages live on rank 1.
    let s = serve_checked(&mut c, &tokens(5, 8 * 16));
    let v = c.last_verdict();
    assert_eq!(v.by_rank[..3], [0, 0, 0], "{v:?}");
    assert_eq!(
        v.by_rank[3],
        2 * 16,
        "rank 3 read rank 1's two pages from rank 2: {v:?}"
    );
    assert_eq!(s.mismatched_tokens, 2 * 16);
}

/// A launch failure on one rank, at the request's first launch, before anything was
/// evicted: every rank rolls back to exactly the state before (digests equal), and the next
/// request is served with nothing mismatched.
#[test]
fn a_launch_failure_on_one_rank_rolls_every_rank_back() {
    for rank in [0, 2] {
        let setup = Setup::new(ModelShape::MlaBf16, 16, 3);
        let mut c = per_rank(&setup);
        serve(&mut c, &tokens(1, 5 * 16));
        let before = c.replica_digests();
        c.inject_launch_failure_on(rank, 1);
        let err = c.serve(&tokens(2, 6 * 16 + 3)).unwrap_err();
        assert!(err.launch_failure().is_some(), "rank {rank}: {err}");
        assert!(err.to_string().contains("injected"), "{err}");
        assert_eq!(
            c.replica_digests(),
            before,
            "rank {rank}: every rank restored"
        );
        assert!(c.last_rollback().is_empty());
        c.check_invariants().unwrap();
        let s = serve(&mut c, &tokens(2, 6 * 16 + 3));
        assert_eq!(s.computed_tokens, 6 * 16 + 3);
        let s = serve(&mut c, &tokens(1, 5 * 16));
        assert_eq!(s.device_hit_tokens, 5 * 16, "the cache survived: {s:?}");
    }
}

/// A rank whose thread panics mid-request ends the request with an error naming that rank,
/// promptly (its peers' collective calls fail as its group member unwinds, long before the
/// timeout), and the cluster refuses further work with the same error instead of hanging.
#[test]
fn a_rank_that_panics_mid_request_is_named_and_nothing_hangs() {
    let setup = Setup::new(ModelShape::MlaBf16, 16, 4);
    let mut c = per_rank(&setup);
    serve(&mut c, &tokens(1, 4 * 16));
    c.debug_panic_in(2, 1);
    let start = Instant::now();
    let err = c.serve(&tokens(2, 4 * 16)).unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "it waited for the timeout"
    );
    assert!(
        matches!(err, ClusterError::RankDied { rank: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("rank 2's thread died"), "{err}");
    assert!(err.to_string().contains("while serving a request"), "{err}");
    let again = c.serve(&tokens(3, 16)).unwrap_err();
    assert!(
        matches!(again, ClusterError::RankDied { rank: 2, .. }),
        "{again}"
    );
    assert!(!c.replicas_agree());
}

/// Ranks sharing one executor (one process, one device) each count only their own calls,
/// so a load path is not charged for a peer's read-backs: loads stay at 0 syncs with four
/// ranks on threads.
#[test]
fn ranks_sharing_an_executor_count_their_own_load_path() {
    let setup = Setup::new(ModelShape::MlaBf16, 16, 4);
    let mut c = setup.build();
    let info = c.group_info().clone();
    assert_eq!(
        (info.peer_pools, info.executor_per_rank),
        ("shared-memory", false)
    );
    for i in 0..6 {
        serve(&mut c, &tokens(10 + i, 7 * 16 + 1));
    }
    evict_all(&mut c);
    for i in 0..6 {
        let s = serve(&mut c, &tokens(10 + i, 7 * 16 + 1));
        assert_eq!(s.host_hit_tokens, 7 * 16, "{s:?}");
        assert_eq!(s.load_path_syncs, 0, "{s:?}");
    }
}

/// Loads back a prompt on one rank (its own pool is all it reads, so nothing but its own
/// waits orders its copies) whose host→device copies are held back until something waits for
/// their layer's event. Returns the mismatched tokens of the load and the executor's log.
fn load_with_held_copies(release: bool) -> (u64, Vec<String>) {
    load_with_held_copies_at(1, release)
}

/// [`load_with_held_copies`] with `cp` ranks sharing the executor.
fn load_with_held_copies_at(cp: u8, release: bool) -> (u64, Vec<String>) {
    // An uncapped grid: a launch per layer, so layer 1's copy is one of its own (the default
    // capped launch puts the 3 layers of so few pages in one, `KernelSpec::layers_per_launch`).
    let per_layer = CopyLaunch {
        max_blocks: 0,
        ..CopyLaunch::gpu_transfer()
    };
    load_with_held_launch(cp, Some(per_layer), 1, release)
}

/// Loads back 6 pages of 3 layers at `cp` under the transfer launch `launch` (the default
/// when `None`), the launch whose range starts at `layer` held back until a wait.
fn load_with_held_launch(
    cp: u8,
    launch: Option<CopyLaunch>,
    layer: u32,
    release: bool,
) -> (u64, Vec<String>) {
    let setup = Setup {
        layers: 3,
        transfer_launch: launch,
        ..Setup::new(ModelShape::MlaBf16, 16, cp)
    };
    let spy = Spy::new();
    let mut c = setup.build_on(spy.clone());
    let a = tokens(1, 6 * 16);
    serve(&mut c, &a);
    evict_all(&mut c);
    spy.hold_h2d_layer(layer, release);
    let s = serve_checked(&mut c, &a);
    assert_eq!(s.host_hit_tokens, 6 * 16, "{s:?}");
    (s.mismatched_tokens, spy.hold_log())
}

/// Verification reads each layer only after waiting for that layer's load-back, the way
/// attention would: with layer 1's copy held back until a wait, the load verifies clean, and
/// the held copy ran after layer 0 was materialised and before layer 1 was (layer 0 did not
/// wait for it; layer 1 did). A copy nobody waits for never runs, and every loaded token
/// mismatches (in layer 1).
#[test]
fn verification_waits_for_each_layer_of_the_load() {
    let (bad, log) = load_with_held_copies(true);
    assert_eq!(bad, 0, "{log:?}");
    let held = log.iter().position(|l| l == "h2d held");
    let released = log.iter().position(|l| l == "h2d released");
    let materialised: Vec<usize> = log
        .iter()
        .enumerate()
        .filter(|(_, l)| l.starts_with("materialise"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(materialised.len(), 3, "one launch per layer: {log:?}");
    assert!(held.is_some(), "layer 1's copy was held: {log:?}");
    assert!(
        released > Some(materialised[0]) && released < Some(materialised[1]),
        "layer 0 went ahead, layer 1 waited for its copy: {log:?}"
    );
    let (bad, log) = load_with_held_copies(false);
    assert_eq!(
        bad,
        6 * 16,
        "a layer read before its copy ran must mismatch: {log:?}"
    );
}

/// A layer-wise load of few pages puts its layers in one launch (6 pages of the default
/// launch's 64 warp groups: up to 4 layers a launch), and each layer's event is that
/// launch's: with the launch held until a wait, layer 0's read waits for it (every layer
/// verifies), and nobody waiting leaves every loaded token mismatched.
#[test]
fn layers_sharing_a_launch_share_its_event() {
    let (bad, log) = load_with_held_launch(1, None, 0, true);
    assert_eq!(bad, 0, "{log:?}");
    let transfers = log
        .iter()
        .filter(|l| l.starts_with("transfer_pages_h2d"))
        .count()
        + log.iter().filter(|l| *l == "h2d held").count();
    assert_eq!(transfers, 1, "one launch for the 3 layers: {log:?}");
    let released = log.iter().position(|l| l == "h2d released");
    let first_read = log.iter().position(|l| l.starts_with("materialise"));
    assert!(released.is_some() && released < first_read, "{log:?}");
    let (bad, log) = load_with_held_launch(1, None, 0, false);
    assert_eq!(bad, 6 * 16, "{log:?}");
}

/// The per-layer wait at CP 4: every rank's layer-1 copies are held until a wait, and every
/// rank materialises every owner's pages layer by layer after waiting for its own layer on
/// the shared stream. The load verifies clean on every rank, and every held copy was
/// released before the verification that read it. (Unlike at CP 1, a copy nobody waits for
/// still runs here: the ranks' other work on the shared executor synchronises it.)
#[test]
fn verification_waits_for_each_layer_of_the_load_at_cp4() {
    let (bad, log) = load_with_held_copies_at(4, true);
    assert_eq!(bad, 0, "{log:?}");
    let held = log.iter().filter(|l| *l == "h2d held").count();
    let released = log.iter().filter(|l| *l == "h2d released").count();
    assert!(
        held == 4 && released == held,
        "every rank's layer 1 held, then released: {log:?}"
    );
    let last_release = log.iter().rposition(|l| l == "h2d released");
    let first_verify = log.iter().position(|l| l.starts_with("verify"));
    assert!(last_release < first_verify, "{log:?}");
}
