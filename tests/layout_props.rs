//! Property tests of the CP layouts (docs/DESIGN.md §2.1) against simple oracles: owner and
//! slot arithmetic, metadata split and concat at the granule (misaligned splits refused),
//! and the grouped allocator's lanes staying in lockstep so that every allocation is aligned
//! groups.

use cp_hicache::allocator::OwnerLaneAllocator;
use cp_hicache::layout::{check_aligned_groups, CpLayout, Layout, PageId, Rank};
use cp_hicache::metadata::{HostPage, MetadataError, NodeMetadata};
use proptest::prelude::*;
use proptest::test_runner::RngSeed;

/// A layout of every kind, with a CP degree and a page size it accepts.
fn layout() -> impl Strategy<Value = (Layout, u8, u32)> {
    (1u8..=16, 0u32..=6, 0u32..=6, 0usize..4).prop_map(|(cp, ps_shift, run_shift, kind)| {
        let ps = 1 << ps_shift;
        let layout = match kind {
            0 => Layout::Zigzag,
            1 => Layout::RoundRobin,
            2 => Layout::PageInterleave,
            _ => Layout::TokenInterleave {
                size: 1 << run_shift.min(ps_shift),
            },
        };
        (layout, cp, ps)
    })
}

/// Where the oracle puts tokens `0..n`: granule by granule, each token to the page of the
/// rank its run belongs to (or, for the page layouts, to page `t / ps`), in arrival order.
fn oracle_places(layout: Layout, cp: u8, ps: u32, n: u64) -> Vec<(u64, u32)> {
    let (cp, ps) = (u64::from(cp), u64::from(ps));
    let run = u64::from(layout.interleave(ps as u32));
    let mut filled = std::collections::HashMap::<u64, u32>::new();
    (0..n)
        .map(|t| {
            let page = if run < ps {
                let granule = t / (ps * cp);
                let rank = ((t - granule * ps * cp) / run) % cp;
                granule * cp + rank
            } else {
                t / ps
            };
            let slot = filled.entry(page).or_insert(0);
            *slot += 1;
            (page, *slot - 1)
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig {
        rng_seed: RngSeed::Fixed(0x6c61_796f),
        ..ProptestConfig::default()
    })]

    #[test]
    fn placement_matches_the_oracle((layout, cp, ps) in layout(), n in 0u64..600) {
        prop_assume!(layout.validate(ps).is_ok());
        let place = layout.placement(cp, ps);
        let oracle = oracle_places(layout, cp, ps, n);
        for (t, &(page, slot)) in oracle.iter().enumerate() {
            prop_assert_eq!(place.place(t as u64), (page, slot), "token {}", t);
            prop_assert_eq!(place.token(page, slot), t as u64);
        }
        let pages = place.pages_holding(n);
        prop_assert!(oracle.iter().all(|&(p, _)| p < pages));
        for p in 0..pages {
            let real = oracle.iter().filter(|&&(q, _)| q == p).count() as u32;
            prop_assert_eq!(place.tokens_in_page(p, n), real, "page {}", p);
        }
        // Whole granules for the interleaved layouts, whole pages otherwise.
        let granule = u64::from(layout.granule_pages(cp));
        prop_assert_eq!(pages % if layout.interleaves_tokens(ps) { granule } else { 1 }, 0);
        prop_assert_eq!(
            layout.pages_for(cp, ps, n as usize) as u64,
            n.div_ceil(u64::from(ps) * granule) * granule
        );
    }

    #[test]
    fn interleaved_owners_are_positional((layout, cp, _) in layout(), start in 0usize..8, n in 0usize..40) {
        prop_assume!(layout.granule_pages(cp) > 1);
        let start = start * cp as usize;
        let owners = layout.owners(cp, start, n);
        prop_assert_eq!(owners.len(), n);
        for (i, &o) in owners.iter().enumerate() {
            prop_assert_eq!(usize::from(o), (start + i) % usize::from(cp));
        }
    }

    #[test]
    fn metadata_splits_only_at_the_granule(cp in 1u8..=8, shift in 0u32..=4, granules in 2usize..6, at in any::<prop::sample::Index>(), rank in any::<prop::sample::Index>()) {
        let ps = 1u32 << shift;
        let layout = CpLayout::new(u32::from(cp), ps, 64 * u32::from(cp)).unwrap()
            .with_granule(u32::from(cp)).unwrap();
        let n = granules * usize::from(cp);
        let owners: Vec<u8> = (0..n).map(|i| (i % usize::from(cp)) as u8).collect();
        let rank = Rank(rank.index(usize::from(cp)) as u8);
        let host: Vec<HostPage> = (0..granules as u32).map(HostPage).collect();
        let m = NodeMetadata::new(&layout, rank, owners.clone(), host).unwrap();
        let at_page = at.index(n - 1) + 1;
        let split = m.split(at_page as u64 * u64::from(ps));
        if at_page % usize::from(cp) == 0 {
            let (l, r) = split.unwrap();
            prop_assert_eq!(NodeMetadata::concat([&l, &r]).unwrap(), m.clone());
        } else {
            prop_assert!(matches!(split, Err(MetadataError::BadSplit { .. })), "{:?}", split);
        }
        // Owners that are not positional, or not whole granules, are refused.
        if cp > 1 {
            let mut swapped = owners.clone();
            swapped.swap(0, 1);
            let host = (0..granules as u32).map(HostPage).collect();
            let refused = matches!(
                NodeMetadata::new(&layout, rank, swapped, host),
                Err(MetadataError::Misaligned { .. })
            );
            prop_assert!(refused, "owners swapped");
            let short = owners[..n - 1].to_vec();
            let owned = short.iter().filter(|&&o| o == rank.0).count() as u32;
            let host = (0..owned).map(HostPage).collect();
            let refused = matches!(
                NodeMetadata::new(&layout, rank, short, host),
                Err(MetadataError::Misaligned { .. })
            );
            prop_assert!(refused, "not whole granules");
        }
    }

    /// Random allocations of whole granules and frees of whole earlier allocations: every
    /// allocation is aligned groups and the lanes stay in lockstep.
    #[test]
    fn grouped_lanes_stay_in_lockstep(cp in 1u8..=8, ops in prop::collection::vec((any::<bool>(), 1usize..4, any::<prop::sample::Index>()), 1..40)) {
        let layout = CpLayout::new(u32::from(cp), 4, 24 * u32::from(cp) + 3).unwrap()
            .with_granule(u32::from(cp)).unwrap();
        let mut a = OwnerLaneAllocator::new(layout);
        let mut held: Vec<Vec<PageId>> = Vec::new();
        for (alloc, granules, pick) in ops {
            if alloc || held.is_empty() {
                let owners = Layout::PageInterleave.owners(cp, 0, granules * usize::from(cp));
                match a.alloc_pages_with_owners(&owners) {
                    Ok(run) => {
                        check_aligned_groups(cp, run.pages()).unwrap();
                        held.push(run.into_pages());
                    }
                    Err(e) => prop_assert!(e.is_shortage(), "{}", e),
                }
            } else {
                let run = held.remove(pick.index(held.len()));
                a.free(&run).unwrap();
            }
            a.check_invariants().unwrap();
        }
    }
}
