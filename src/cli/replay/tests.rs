//! The fault verdicts and the memory check.

use super::memory::MemoryNeed;
use super::report::fault_exercised;
use super::*;
use crate::cluster::{RequestStats, WritePolicy};
use crate::exec::Backend;

#[test]
fn host_pool_full_fired_when_a_backup_was_skipped_or_made_room_for() {
    let fired = |skipped, evicted| {
        let totals = RequestStats {
            backups_skipped: skipped,
            host_evictions_for_backup: evicted,
            ..RequestStats::default()
        };
        fault_exercised(Fault::HostPoolFull, &totals, 0, 8, 64).is_ok()
    };
    assert!(fired(1, 0));
    assert!(
        fired(0, 1),
        "host eviction that made a backup fit is the fault firing"
    );
    assert!(!fired(0, 0));
}

/// The seed's bug is exercised only by a page loaded into another owner's page; a
/// load-back alone (CP 1, or owners that happen to match) tested nothing, and says why.
#[test]
fn plain_alloc_on_load_fired_only_when_a_page_got_another_owner() {
    let check = |cp, loaded, misowned| {
        let totals = RequestStats {
            pages_loaded: loaded,
            pages_loaded_misowned: misowned,
            ..RequestStats::default()
        };
        fault_exercised(Fault::PlainAllocOnLoad, &totals, 0, cp, 64)
    };
    assert!(check(8, 4, 1).is_ok());
    assert!(check(8, 0, 0)
        .unwrap_err()
        .contains("no page was loaded back"));
    assert!(check(1, 4, 0).unwrap_err().contains("at CP 1"));
    assert!(check(8, 4, 0)
        .unwrap_err()
        .contains("happened to get the owner"));
}

/// The positional layouts' form of the seed's bug fired only when a loaded page moved to
/// another rank's page (never at CP 1, where a granule is one page).
#[test]
fn granule_shift_on_load_fired_only_when_a_page_moved() {
    let check = |cp, loaded, misowned| {
        let totals = RequestStats {
            pages_loaded: loaded,
            pages_loaded_misowned: misowned,
            ..RequestStats::default()
        };
        fault_exercised(Fault::GranuleShiftOnLoad, &totals, 0, cp, 64)
    };
    assert!(check(4, 8, 8).is_ok());
    assert!(check(4, 0, 0)
        .unwrap_err()
        .contains("no page was loaded back"));
    assert!(check(1, 4, 0).unwrap_err().contains("at CP 1"));
    assert!(check(4, 4, 0).unwrap_err().contains("kept their owners"));
}

/// The memory check counts the kernel-backed lane allocators: per rank 13 bytes per page
/// (pages_in, out_pages, stacks, owners_in; the select kernel writes no token locations),
/// about cp × 13 bytes per logical page in all, plus the host mirrors. They used to be left
/// out.
#[test]
fn the_memory_check_counts_the_lane_allocators() {
    let args = ReplayArgs::default();
    let plan = args.validate().unwrap();
    let config = ClusterConfig {
        deployment: plan.deployment,
        layers: 1,
        device_pages: 4096,
        host_pages: 16,
        policy: WritePolicy::WriteThrough,
        fault: None,
        sanitize: Sanitize::default(),
    };
    let cp = 8u64;
    let need = MemoryNeed::new(&config, Backend::Host).unwrap();
    // Per rank: stacks, inputs and outputs per page; the lane tops; the select and the
    // release status words (CP + 2 each).
    assert_eq!(
        need.allocators,
        cp * 13 * 4096 + cp * 4 * cp + cp * 2 * 4 * (cp + 2)
    );
    assert_eq!(need.mirrors, cp * (4 * 4096 + 4096 / 8));
    assert_eq!(
        need.host_bytes(),
        need.host_pools + 2 * need.device_pools + need.allocators + need.mirrors
    );
    let gpu = MemoryNeed::new(&config, Backend::Cuda).unwrap();
    assert_eq!(gpu.host_bytes(), gpu.host_pools + gpu.mirrors);
}
