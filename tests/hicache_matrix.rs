//! Correctness of the CP cluster across CP degrees (1, 2, 4, 8), page sizes (MLA bf16 at
//! page 16, NSA at page 64) and both write policies: every cache hit — device-resident or
//! loaded back from the host — is verified byte for byte on every layer and buffer, through
//! splits at page boundaries, nodes that own zero pages on some ranks, and long prefixes
//! shared by many requests.

mod hicache_support;

use cp_hicache::cluster::{Cluster, WritePolicy};
use cp_hicache::kernels::{ModelShape, TransferPath};
use hicache_support::{cat, evict_all, lane_capacities, serve, tokens, Setup};

const POLICIES: [WritePolicy; 2] = [WritePolicy::WriteThrough, WritePolicy::WriteBack];

/// Cold prefill, a device hit, eviction of everything, then a host hit.
fn cold_evict_hit(c: &mut Cluster) {
    let ps = c.layout().page_size() as usize;
    let a = tokens(1, 10 * ps + ps / 2);
    let s = serve(c, &a);
    assert_eq!(s.computed_tokens, a.len() as u64);
    let s = serve(c, &a);
    assert_eq!(s.device_hit_tokens, (10 * ps) as u64);
    assert!(evict_all(c) > 0);
    let s = serve(c, &a);
    assert_eq!(s.host_hit_tokens, (10 * ps) as u64, "{s:?}");
    assert_eq!(s.pages_loaded, 10);
    // Loaded pages are device hits again.
    let s = serve(c, &a);
    assert_eq!(s.device_hit_tokens, (10 * ps) as u64, "{s:?}");
}

/// Prompts diverging inside a node (mid-page), on the device and on the host.
fn splits(c: &mut Cluster) {
    let ps = c.layout().page_size() as usize;
    let a = tokens(2, 8 * ps + 5);
    // b shares 3 pages and 7 tokens of a's 4th page: the match splits a's node after page 3.
    let b = cat(&a[..3 * ps + 7], &tokens(3, 2 * ps));
    serve(c, &a);
    let s = serve(c, &b);
    assert_eq!(s.device_hit_tokens, (3 * ps) as u64, "{s:?}");
    evict_all(c);
    // A host-only node split on a load: c2 shares 2 pages and a bit of a's host copy.
    let c2 = cat(&a[..2 * ps + 3], &tokens(4, ps + 1));
    let s = serve(c, &c2);
    assert_eq!(s.host_hit_tokens, (2 * ps) as u64, "{s:?}");
    // a: 2 pages on the device, 1 page (split remainder) + 5 pages on the host.
    let s = serve(c, &a);
    assert_eq!(s.device_hit_tokens, (2 * ps) as u64, "{s:?}");
    assert_eq!(s.host_hit_tokens, (6 * ps) as u64, "{s:?}");
    let s = serve(c, &b);
    assert_eq!(s.device_hit_tokens, (3 * ps) as u64, "{s:?}");
    assert!(s.host_hit_tokens > 0, "{s:?}");
}

/// One-page nodes (owned by rank 0 only, so every other rank owns zero pages of them) and
/// three-page nodes (owned by at most three ranks), loaded back as one concatenated run.
fn zero_owned_nodes(c: &mut Cluster) {
    let ps = c.layout().page_size() as usize;
    let base = tokens(5, 14 * ps);
    for k in 1..=8 {
        serve(c, &base[..k * ps + 3]);
    }
    serve(c, &base[..11 * ps]);
    serve(c, &base[..14 * ps]);
    evict_all(c);
    let s = serve(c, &base);
    assert_eq!(s.host_hit_tokens, (14 * ps) as u64, "{s:?}");
    // The first five pages again after a full eviction, then the rest loaded from the
    // middle of the chain on top of them.
    evict_all(c);
    let s = serve(c, &base[..5 * ps + 1]);
    assert_eq!(s.host_hit_tokens, (5 * ps) as u64, "{s:?}");
    let s = serve(c, &base);
    assert_eq!(s.device_hit_tokens, (5 * ps) as u64, "{s:?}");
    assert_eq!(s.host_hit_tokens, (9 * ps) as u64, "{s:?}");
    // A partial eviction: the chain's LRU end (its last nine pages: nodes of 3, 3, 1, 1 and
    // 1 pages) leaves the device, the first five pages stay; the load starts mid-chain.
    assert_eq!(c.evict_device_lru(9).unwrap(), 5);
    let s = serve(c, &base);
    assert_eq!(s.device_hit_tokens, (5 * ps) as u64, "{s:?}");
    assert_eq!(s.host_hit_tokens, (9 * ps) as u64, "{s:?}");
}

/// A long system prompt shared by many requests under device-pool pressure.
fn long_shared_prefix(c: &mut Cluster) {
    let ps = c.layout().page_size() as usize;
    let system = tokens(6, 6 * ps);
    let prompts: Vec<Vec<u32>> = (0..12u32)
        .map(|i| cat(&system, &tokens(100 + i, ps + 7 * i as usize % ps + 1)))
        .collect();
    let mut host_hits = 0;
    for round in 0..2 {
        for (i, p) in prompts.iter().enumerate() {
            let s = serve(c, p);
            host_hits += s.host_hit_tokens;
            if i % 3 == 2 {
                c.evict_device_lru(3).unwrap();
                c.check_invariants().unwrap();
            }
        }
        if round == 0 {
            evict_all(c);
        }
    }
    assert!(host_hits > 0);
}

fn run(model: ModelShape, page_size: u32, cp: u8) {
    run_with(model, page_size, cp, TransferPath::Kernel);
}

fn run_with(model: ModelShape, page_size: u32, cp: u8, path: TransferPath) {
    for policy in POLICIES {
        let mut setup = Setup::new(model, page_size, cp);
        setup.policy = policy;
        setup.layers = 2;
        setup.transfer_path = path;
        let mut c = setup.build();
        let before = c.executor().counters();
        cold_evict_hit(&mut c);
        splits(&mut c);
        zero_owned_nodes(&mut c);
        long_shared_prefix(&mut c);
        // Nothing leaked: with every node evicted, every lane is whole again.
        evict_all(&mut c);
        assert_eq!(c.lane_free_counts(), lane_capacities(&c), "{policy}");
        // Transfers took the deployment's path: copy batches only on the DMA path.
        let copies = c.executor().counters().since(&before).copies;
        assert_eq!(
            copies > 0,
            path == TransferPath::Dma,
            "{policy} {path}: {copies}"
        );
    }
}

#[test]
fn mla_page16_cp1() {
    run(ModelShape::MlaBf16, 16, 1);
}

#[test]
fn mla_page16_cp2() {
    run(ModelShape::MlaBf16, 16, 2);
}

#[test]
fn mla_page16_cp4() {
    run(ModelShape::MlaBf16, 16, 4);
}

#[test]
fn mla_page16_cp8() {
    run(ModelShape::MlaBf16, 16, 8);
}

#[test]
fn nsa_page64_cp1() {
    run(ModelShape::Nsa, 64, 1);
}

#[test]
fn nsa_page64_cp2() {
    run(ModelShape::Nsa, 64, 2);
}

#[test]
fn nsa_page64_cp4() {
    run(ModelShape::Nsa, 64, 4);
}

#[test]
fn nsa_page64_cp8() {
    run(ModelShape::Nsa, 64, 8);
}

/// The DMA transfer path (copy regions instead of the transfer kernel) serves the same
/// verified hits, in both host layouts (MLA layer-first, NSA page-first).
#[test]
fn mla_page16_cp4_dma() {
    run_with(ModelShape::MlaBf16, 16, 4, TransferPath::Dma);
}

#[test]
fn nsa_page64_cp8_dma() {
    run_with(ModelShape::Nsa, 64, 8, TransferPath::Dma);
}
