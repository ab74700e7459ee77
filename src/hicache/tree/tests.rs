use super::*;
use std::collections::BTreeSet;

fn tree(cp: u32, ps: u32) -> RadixTree {
    RadixTree::new(CpLayout::new(cp, ps, 1024).unwrap(), Rank(0)).unwrap()
}

fn pages(v: &[u32]) -> Vec<PageId> {
    v.iter().copied().map(PageId).collect()
}

/// Replicas that would hand out different handles for their next node must not hash
/// equal: the free slots' generations are part of the digest.
#[test]
fn the_digest_covers_free_slot_generations() {
    let mut t = tree(1, 2);
    t.insert(&[1, 2], &pages(&[10])).unwrap();
    assert_eq!(t.evict_device_lru(usize::MAX).unwrap().len(), 1);
    let free = *t
        .free_slots
        .first()
        .expect("the evicted node's slot is free");
    let mut other = t.clone();
    other.slots[free as usize].generation += 1;
    assert_ne!(t.digest(), other.digest());
}

/// A host-only node (CP 2, owners 0,1, rank 0 holding host page 7) and its key.
fn host_only_node() -> (RadixTree, NodeId, Vec<u32>) {
    let mut t = tree(2, 2);
    let key = vec![1, 2, 3, 4];
    let node = t.insert(&key, &pages(&[2, 3])).unwrap().node;
    let meta = NodeMetadata::new(&t.layout, Rank(0), vec![0, 1], vec![HostPage(7)]).unwrap();
    t.set_host(node, meta).unwrap();
    t.take_device(node).unwrap();
    (t, node, key)
}

/// Pages with the owners the host copy records are adopted and the copy stays.
#[test]
fn insert_keeps_a_host_copy_whose_owners_match() {
    let (mut t, node, key) = host_only_node();
    let r = t.insert(&key, &pages(&[4, 5])).unwrap();
    assert_eq!(r.adopted_pages, 2);
    assert!(r.dropped_host_copies.is_empty());
    let n = t.node(node).unwrap();
    assert_eq!(n.device(), Some(&pages(&[4, 5])[..]));
    assert_eq!(n.host().unwrap().host_pages(), &[HostPage(7)]);
    t.check_invariants().unwrap();
}

/// Pages with other owners (a recompute after a degraded load-back) replace the host
/// copy: it comes back for the caller to free, and no device page sits under a host
/// copy that names another owner. See: issue 20.
#[test]
fn r20_insert_replaces_a_host_copy_whose_owners_differ() {
    let (mut t, node, key) = host_only_node();
    let r = t.insert(&key, &pages(&[4, 6])).unwrap();
    assert_eq!(r.adopted_pages, 2);
    assert_eq!(r.dropped_host_copies.len(), 1);
    assert_eq!(r.dropped_host_copies[0].host_pages(), &[HostPage(7)]);
    let n = t.node(node).unwrap();
    assert_eq!(n.device(), Some(&pages(&[4, 6])[..]));
    assert!(n.host().is_none());
    t.check_invariants().unwrap();
    // The host page is free for another node again.
    let other = t.insert(&[9, 9], &pages(&[8])).unwrap().node;
    let meta = NodeMetadata::new(&t.layout, Rank(0), vec![0], vec![HostPage(7)]).unwrap();
    t.set_host(other, meta).unwrap();
}

#[test]
fn match_splits_at_page_boundaries_only() {
    let mut t = tree(1, 2);
    let r = t
        .insert(&[1, 2, 3, 4, 5, 6], &pages(&[10, 11, 12]))
        .unwrap();
    assert_eq!(r.prefix_tokens, 0);
    // The match diverges inside page 1: only page 0 matches, the node splits after it.
    let m = t.match_prefix(&[1, 2, 3, 9, 5, 6]).unwrap();
    assert_eq!(m.matched_tokens, 2);
    assert_eq!(m.device_pages, pages(&[10]));
    assert_eq!(t.node_count(), 2);
    // A trailing partial page never matches.
    let m = t.match_prefix(&[1, 2, 3]).unwrap();
    assert_eq!(m.matched_tokens, 2);
    let m = t.match_prefix(&[1, 2, 3, 4, 5, 6, 7]).unwrap();
    assert_eq!(m.device_pages, pages(&[10, 11, 12]));
    assert_eq!(m.last_node, r.node, "the suffix keeps the original handle");
    t.check_invariants().unwrap();
}

#[test]
fn insert_returns_duplicates_and_rejects_bad_input() {
    let mut t = tree(1, 2);
    t.insert(&[1, 2, 3, 4], &pages(&[10, 11])).unwrap();
    let r = t
        .insert(&[1, 2, 3, 4, 7, 8], &pages(&[20, 21, 22]))
        .unwrap();
    assert_eq!(r.duplicate_pages, pages(&[20, 21]));
    assert_eq!(r.prefix_tokens, 4);
    assert_eq!(t.device_pages(), 3);
    assert!(matches!(
        t.insert(&[1, 2, 3], &pages(&[30, 31])),
        Err(TreeError::LengthMismatch { .. })
    ));
    assert_eq!(
        t.insert(&[5, 5], &pages(&[10])),
        Err(TreeError::PageHeld { page: PageId(10) })
    );
    assert_eq!(
        t.insert(&[5, 5], &pages(&[0])),
        Err(TreeError::NullPage { index: 0 })
    );
    for page in [1024, u32::MAX] {
        assert_eq!(
            t.insert(&[5, 5], &pages(&[page])),
            Err(TreeError::Layout(LayoutError::PageOutOfRange {
                page: PageId(page),
                pages: 1024
            }))
        );
    }
    assert_eq!(t.device_pages(), 3, "a refused insert holds nothing");
    t.check_invariants().unwrap();
}

#[test]
fn host_eviction_for_ranks_takes_only_nodes_that_help() {
    let layout = CpLayout::new(2, 1, 64).unwrap();
    let mut t = RadixTree::new(layout, Rank(0)).unwrap();
    // Oldest first: a owns only rank 1's pages, b one of each, c only rank 0's.
    let mut ids = Vec::new();
    for (i, (tokens, p, owners, host)) in [
        (vec![1, 1], pages(&[3, 5]), vec![1, 1], vec![]),
        (vec![2, 2], pages(&[2, 7]), vec![0, 1], vec![0]),
        (vec![3, 3], pages(&[4, 6]), vec![0, 0], vec![1, 2]),
    ]
    .into_iter()
    .enumerate()
    {
        let node = t.insert(&tokens, &p).unwrap().node;
        let host = host.into_iter().map(HostPage).collect();
        t.set_host(
            node,
            NodeMetadata::new(&layout, Rank(0), owners, host).unwrap(),
        )
        .unwrap();
        t.take_device(node).unwrap();
        ids.push((i, node));
    }
    // Rank 0 is short of 2 host pages: a does not help, b gives 1, c the other.
    let gone = t.evict_host_for_ranks(&[2, 0]).unwrap();
    let owners: Vec<&[u8]> = gone.iter().map(|m| m.page_owners()).collect();
    assert_eq!(owners, vec![&[0, 1][..], &[0, 0][..]]);
    assert!(t.contains(ids[0].1));
    assert!(!t.contains(ids[1].1) && !t.contains(ids[2].1));
    // Nothing short: nothing evicted.
    assert!(t.evict_host_for_ranks(&[0, 0]).unwrap().is_empty());
    t.check_invariants().unwrap();
}

#[test]
fn split_keeps_host_metadata_consistent() {
    let layout = CpLayout::new(2, 2, 64).unwrap();
    let mut t = RadixTree::new(layout, Rank(1)).unwrap();
    let p = pages(&[2, 3, 5, 4]); // owners 0,1,1,0
    let r = t.insert(&[1, 1, 2, 2, 3, 3, 4, 4], &p).unwrap();
    let meta = NodeMetadata::new(
        &layout,
        Rank(1),
        vec![0, 1, 1, 0],
        vec![HostPage(7), HostPage(8)],
    )
    .unwrap();
    t.set_host(r.node, meta).unwrap();
    let m = t.match_prefix(&[1, 1, 2, 2, 9, 9]).unwrap();
    let left = t.node(m.last_node).unwrap().host().unwrap().clone();
    let right = t.node(r.node).unwrap().host().unwrap().clone();
    assert_eq!(left.page_owners(), &[0, 1]);
    assert_eq!(left.host_pages(), &[HostPage(7)]);
    assert_eq!(right.page_owners(), &[1, 0]);
    assert_eq!(right.host_pages(), &[HostPage(8)]);
    t.check_invariants().unwrap();
}

#[test]
fn set_device_checks_owners_and_order() {
    let layout = CpLayout::new(2, 1, 64).unwrap();
    let mut t = RadixTree::new(layout, Rank(0)).unwrap();
    let a = t.insert(&[1, 2], &pages(&[2, 3])).unwrap().node;
    let b = t.insert(&[1, 2, 3], &pages(&[12, 13, 4])).unwrap();
    assert_eq!(b.duplicate_pages, pages(&[12, 13]));
    let b = b.node;
    let meta = |owners: Vec<u8>, host: Vec<u32>| {
        NodeMetadata::new(
            &layout,
            Rank(0),
            owners,
            host.into_iter().map(HostPage).collect(),
        )
        .unwrap()
    };
    assert!(matches!(
        t.set_host(a, meta(vec![1, 1], vec![])),
        Err(TreeError::OwnerMismatch { index: 0, .. })
    ));
    t.set_host(a, meta(vec![0, 1], vec![1])).unwrap();
    t.set_host(b, meta(vec![0], vec![2])).unwrap();
    assert!(matches!(
        t.take_device(a),
        Err(TreeError::ChildOnDevice { .. })
    ));
    assert_eq!(t.take_device(b).unwrap(), pages(&[4]));
    assert_eq!(t.take_device(a).unwrap(), pages(&[2, 3]));
    assert!(matches!(
        t.set_device(b, pages(&[6])),
        Err(TreeError::ParentNotOnDevice { .. })
    ));
    // The seed's bug: pages with the wrong owners are refused on the load path.
    assert!(matches!(
        t.set_device(a, pages(&[3, 5])),
        Err(TreeError::OwnerMismatch { index: 0, .. })
    ));
    t.set_device(a, pages(&[4, 5])).unwrap();
    t.set_device(b, pages(&[6])).unwrap();
    assert!(matches!(t.take_host(a), Ok(Some(_))));
    assert!(matches!(
        t.take_device(a),
        Err(TreeError::WouldEmpty { .. })
    ));
    t.check_invariants().unwrap();
}

/// Runs `misuse` on `t` and records in `broken` unless it fails with exactly `want` and
/// leaves the digest, the host pages (which the digest leaves out) and the invariants as
/// they were.
fn refused(
    broken: &mut Vec<String>,
    name: &str,
    t: &mut RadixTree,
    misuse: impl FnOnce(&mut RadixTree) -> Result<(), TreeError>,
    want: TreeError,
) {
    let host = |t: &RadixTree| -> Vec<(NodeId, Vec<HostPage>)> {
        t.node_ids()
            .into_iter()
            .filter_map(|id| Some((id, t.node(id).ok()?.host()?.host_pages().to_vec())))
            .collect()
    };
    let (digest, held) = (t.digest(), host(t));
    match misuse(t) {
        Err(e) if e == want => {}
        other => broken.push(format!("{name}: got {other:?}, want Err({want:?})")),
    }
    if t.digest() != digest || host(t) != held {
        broken.push(format!("{name}: the refused call changed the tree"));
    }
    if let Err(e) = t.check_invariants() {
        broken.push(format!("{name}: {e}"));
    }
}

/// Every state guard refuses its misuse with its own variant and changes nothing: these
/// guards stop a device or host page from being held twice and KV from being taken from
/// under a request, and no other test drives the tree into them. Each case starts from a
/// fresh tree and failures are collected, so a mutant names every guard it broke. Each
/// misuse would succeed without its guard (right owners, free pages).
#[test]
fn misuse_is_refused_and_changes_nothing() {
    let layout = CpLayout::new(2, 1, 64).unwrap();
    let owners = |p: &[u32]| -> Vec<u8> { p.iter().map(|&p| layout.owner(PageId(p)).0).collect() };
    let meta = |rank: u8, owners: Vec<u8>, host: &[u32]| {
        let host = host.iter().copied().map(HostPage).collect();
        NodeMetadata::new(&layout, Rank(rank), owners, host).unwrap()
    };
    // a [2, 3] on the device, backed up in host page 1; its child b [4] on the device
    // only; c host-only in host page 2.
    let fixture = || {
        let mut t = RadixTree::new(layout, Rank(0)).unwrap();
        let a = t.insert(&[1, 2], &pages(&[2, 3])).unwrap().node;
        let b = t.insert(&[1, 2, 3], &pages(&[12, 13, 4])).unwrap().node;
        let c = t.insert(&[5, 6], &pages(&[10, 11])).unwrap().node;
        t.set_host(a, meta(0, owners(&[2, 3]), &[1])).unwrap();
        t.set_host(c, meta(0, owners(&[10, 11]), &[2])).unwrap();
        t.take_device(c).unwrap();
        t.check_invariants().unwrap();
        (t, a, b, c)
    };
    let mut broken = Vec::new();
    let bad = &mut broken;

    let (mut t, a, _, _) = fixture();
    let want = TreeError::AlreadyOnDevice { node: a };
    refused(
        bad,
        "AlreadyOnDevice",
        &mut t,
        |t| t.set_device(a, pages(&[8, 9])),
        want,
    );

    let (mut t, _, _, c) = fixture();
    let want = TreeError::PageCount {
        node: c,
        expected: 2,
        found: 1,
    };
    refused(
        bad,
        "set_device PageCount",
        &mut t,
        |t| t.set_device(c, pages(&[6])),
        want,
    );

    let (mut t, _, b, _) = fixture();
    let want = TreeError::RankMismatch {
        expected: 0,
        found: 1,
    };
    let m = meta(1, owners(&[4]), &[]);
    refused(bad, "RankMismatch", &mut t, |t| t.set_host(b, m), want);

    let (mut t, a, _, _) = fixture();
    let want = TreeError::AlreadyOnHost { node: a };
    let m = meta(0, owners(&[2, 3]), &[5]);
    refused(bad, "AlreadyOnHost", &mut t, |t| t.set_host(a, m), want);

    let (mut t, _, b, _) = fixture();
    let want = TreeError::PageCount {
        node: b,
        expected: 1,
        found: 2,
    };
    let m = meta(0, owners(&[4, 6]), &[7, 8]);
    refused(
        bad,
        "set_host PageCount",
        &mut t,
        |t| t.set_host(b, m),
        want,
    );

    let (mut t, _, b, _) = fixture();
    let want = TreeError::HostPageHeld { page: HostPage(1) };
    let m = meta(0, owners(&[4]), &[1]); // a's host page
    refused(bad, "HostPageHeld", &mut t, |t| t.set_host(b, m), want);

    let (mut t, _, b, _) = fixture();
    t.set_host(b, meta(0, owners(&[4]), &[3])).unwrap();
    t.lock(b).unwrap();
    let want = TreeError::Locked { node: b, count: 1 };
    refused(
        bad,
        "take_device Locked",
        &mut t,
        |t| t.take_device(b).map(drop),
        want,
    );

    // b's page went stale: b would be left empty and removed, but a request holds it.
    let (mut t, _, b, _) = fixture();
    t.lock(b).unwrap();
    let stale = BTreeSet::from([PageId(4)]);
    let want = TreeError::Locked { node: b, count: 1 };
    let drop_b = |t: &mut RadixTree| t.drop_stale(&stale, &BTreeSet::new()).map(drop);
    refused(bad, "drop_stale Locked", &mut t, drop_b, want);

    // A handle to a reused slot, or to a slot that never existed, names no node.
    let (mut t, a, _, _) = fixture();
    let gone = NodeId {
        index: a.index,
        generation: a.generation + 1,
    };
    let want = TreeError::UnknownNode { node: gone };
    refused(
        bad,
        "UnknownNode",
        &mut t,
        |t| t.set_device(gone, pages(&[8, 9])),
        want,
    );
    let never = NodeId {
        index: 99,
        generation: 0,
    };
    let want = TreeError::UnknownNode { node: never };
    refused(
        bad,
        "UnknownNode",
        &mut t,
        |t| t.take_device(never).map(drop),
        want,
    );

    let (mut t, ..) = fixture();
    let root = NodeId::ROOT;
    let want = |op| TreeError::Root { op };
    refused(
        bad,
        "Root",
        &mut t,
        |t| t.set_device(root, vec![]),
        want("set_device"),
    );
    let m = meta(0, vec![], &[]);
    refused(
        bad,
        "Root",
        &mut t,
        |t| t.set_host(root, m),
        want("set_host"),
    );
    let take = |t: &mut RadixTree| t.take_device(root).map(drop);
    refused(bad, "Root", &mut t, take, want("take_device"));
    let take = |t: &mut RadixTree| t.take_host(root).map(drop);
    refused(bad, "Root", &mut t, take, want("take_host"));

    assert!(
        broken.is_empty(),
        "guards that did not hold:\n{}",
        broken.join("\n")
    );
}

#[test]
fn locks_cover_the_path_and_never_go_negative() {
    let mut t = tree(1, 1);
    let a = t.insert(&[1, 2], &pages(&[1, 2])).unwrap().node;
    let b = t.insert(&[1, 2, 3], &pages(&[9, 9 + 1, 3])).unwrap().node;
    t.lock(b).unwrap();
    assert_eq!(t.node(a).unwrap().lock_count(), 1);
    assert_eq!(t.evictable_device_pages(), 0);
    assert!(t.evict_device_lru(10).unwrap().is_empty());
    t.unlock(b).unwrap();
    assert_eq!(
        t.unlock(b),
        Err(TreeError::UnlockBelowZero { node: b, at: a })
    );
    t.check_invariants().unwrap();
}

#[test]
fn device_eviction_is_lru_and_removes_unbacked_nodes() {
    let mut t = tree(1, 1);
    let a = t.insert(&[1, 2], &pages(&[1, 2])).unwrap().node;
    let b = t.insert(&[3, 4], &pages(&[3, 4])).unwrap().node;
    let c = t.insert(&[1, 2, 5], &pages(&[11, 12, 5])).unwrap().node;
    t.match_prefix(&[3]).unwrap(); // splits b and touches its prefix
    let ev = t.evict_device_lru(1).unwrap();
    // Device leaves: b's suffix [4] (stamp 2; the split left it untouched) and c (3).
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].node, b);
    assert_eq!(ev[0].device_pages, pages(&[4]));
    assert!(ev[0].removed);
    let ev = t.evict_device_lru(2).unwrap();
    let nodes: Vec<_> = ev.iter().map(|e| e.node).collect();
    assert_eq!(nodes, vec![c, a]);
    assert!(!t.contains(a));
    assert_eq!(t.device_pages(), 1);
    t.check_invariants().unwrap();
}

#[test]
fn lane_eviction_skips_nodes_of_full_lanes() {
    let layout = CpLayout::new(2, 1, 64).unwrap();
    let mut t = RadixTree::new(layout, Rank(0)).unwrap();
    let a = t.insert(&[1], &pages(&[2])).unwrap().node; // lane 0, oldest
    let b = t.insert(&[2], &pages(&[3])).unwrap().node; // lane 1
    let c = t.insert(&[3, 3], &pages(&[5, 7])).unwrap().node; // lane 1
    let d = t.insert(&[4], &pages(&[9])).unwrap().node; // lane 1, newest
    let ev = t.evict_device_for_lanes(&[0, 3]).unwrap();
    let nodes: Vec<_> = ev.iter().map(|e| e.node).collect();
    assert_eq!(nodes, vec![b, c], "a has no lane-1 page; c covers the rest");
    assert!(t.contains(a) && t.contains(d));
    // Nothing left can cover lane 1 beyond d: stop when candidates run out.
    let ev = t.evict_device_for_lanes(&[0, 5]).unwrap();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].node, d);
    assert!(t.evict_device_for_lanes(&[0, 0]).unwrap().is_empty());
    t.check_invariants().unwrap();
}

#[test]
fn digest_tracks_state() {
    let mut t = tree(2, 2);
    let d0 = t.digest();
    t.insert(&[1, 2], &pages(&[1])).unwrap();
    let d1 = t.digest();
    assert_ne!(d0, d1);
    let mut u = t.clone();
    assert_eq!(u.digest(), d1);
    u.match_prefix(&[1, 2]).unwrap();
    assert_ne!(u.digest(), d1, "the clock and stamps are part of the state");
}

#[test]
fn long_path_matches_in_one_walk() {
    let ps = 64;
    let n_pages = 2048; // 128k tokens
    let mut t = RadixTree::new(CpLayout::new(1, ps, n_pages + 1).unwrap(), Rank(0)).unwrap();
    let tokens: Vec<u32> = (0..n_pages * ps).collect();
    let p: Vec<PageId> = (1..=n_pages).map(PageId).collect();
    t.insert(&tokens, &p).unwrap();
    let m = t.match_prefix(&tokens).unwrap();
    assert_eq!(m.matched_tokens, tokens.len());
    assert_eq!(m.device_pages, p);
}

/// A run read from the storage tier becomes a host-only leaf that matches like any host
/// copy, then goes to the device with its recorded owners; bad leaves are refused.
#[test]
fn a_host_only_leaf_matches_and_loads_like_a_backed_up_node() {
    let (mut t, node, key) = host_only_node();
    let meta = |owners: Vec<u8>, host: Vec<u32>| {
        NodeMetadata::new(
            &CpLayout::new(2, 2, 1024).unwrap(),
            Rank(0),
            owners,
            host.into_iter().map(HostPage).collect(),
        )
        .unwrap()
    };
    let leaf = t
        .insert_host_leaf(node, &[5, 6, 7, 8], meta(vec![1, 0], vec![9]))
        .unwrap();
    t.check_invariants().unwrap();
    let whole: Vec<u32> = key.iter().copied().chain([5, 6, 7, 8]).collect();
    let m = t.match_prefix(&whole).unwrap();
    assert_eq!(m.host_nodes, vec![node, leaf]);
    // The same child again, a partial page, an empty key and a held host page: refused.
    assert!(t
        .insert_host_leaf(node, &[5, 6], meta(vec![0], vec![11]))
        .is_err());
    assert!(t
        .insert_host_leaf(node, &[9], meta(vec![0], vec![11]))
        .is_err());
    assert!(t.insert_host_leaf(node, &[], meta(vec![], vec![])).is_err());
    assert!(t
        .insert_host_leaf(NodeId::ROOT, &[20, 21], meta(vec![0], vec![9]))
        .is_err());
    t.check_invariants().unwrap();
    t.set_device(node, pages(&[4, 5])).unwrap();
    // Owners preserved: page 3 is rank 1's, page 2 rank 0's.
    assert!(t.set_device(leaf, pages(&[2, 3])).is_err());
    t.set_device(leaf, pages(&[3, 2])).unwrap();
    t.check_invariants().unwrap();
}
