//! The allocator's device lane stacks against its host mirror: an undo that cannot reach the
//! device marks the allocator broken (typed error, healed by a successful restore), a restore
//! from another layout names both layouts, and the cluster's lane check (which replay runs
//! after a replay) catches device lanes that a kernel left out of step, and a select or a
//! release the device refused because of it.

mod hicache_support;

use cp_hicache::allocator::kernel::{KernelAllocError, KernelAllocOptions, KernelLaneAllocator};
use cp_hicache::allocator::OwnerLaneAllocator;
use cp_hicache::cluster::ClusterError;
use cp_hicache::kernels::ModelShape;
use cp_hicache::layout::CpLayout;
use hicache_support::{jit, serve, tokens, Setup, Spy};

fn allocator(spy: &std::sync::Arc<Spy>, layout: CpLayout) -> KernelLaneAllocator {
    KernelLaneAllocator::new(layout, spy.clone(), &jit(), KernelAllocOptions::default()).unwrap()
}

#[test]
fn a_failed_undo_breaks_the_allocator_until_a_restore() {
    let spy = Spy::new();
    let layout = CpLayout::new(2, 16, 33).unwrap();
    let mut a = allocator(&spy, layout);
    let before = a.mirror().clone();
    spy.fail_uploads(true);
    // The owners upload fails, and so does re-uploading the lanes afterwards.
    let err = a.alloc_pages_with_owners(&[0, 1]).unwrap_err();
    assert!(matches!(err, KernelAllocError::Exec(_)), "{err}");
    assert!(a.is_broken());
    spy.fail_uploads(false);
    for err in [
        a.alloc_pages_with_owners(&[0]).unwrap_err(),
        a.alloc_pages(1).unwrap_err(),
        a.free(&[]).unwrap_err(),
    ] {
        assert!(matches!(err, KernelAllocError::Broken { .. }), "{err}");
        assert!(err.to_string().contains("upload failure injected"), "{err}");
    }
    // A restore that fails keeps it broken; one that succeeds heals it.
    spy.fail_uploads(true);
    assert!(a.restore(before.clone()).is_err());
    assert!(a.is_broken());
    spy.fail_uploads(false);
    a.restore(before).unwrap();
    assert!(!a.is_broken());
    a.alloc_pages_with_owners(&[0, 1]).unwrap();
    a.debug_check_device().unwrap();
}

#[test]
fn a_restore_from_another_layout_names_both() {
    let spy = Spy::new();
    let ours = CpLayout::new(2, 16, 33).unwrap();
    let theirs = CpLayout::new(4, 16, 33).unwrap();
    let mut a = allocator(&spy, ours);
    let err = a.restore(OwnerLaneAllocator::new(theirs)).unwrap_err();
    match &err {
        KernelAllocError::LayoutMismatch { ours: o, theirs: t } => {
            assert_eq!((*o, *t), (ours, theirs));
        }
        other => panic!("{other}"),
    }
    let text = err.to_string();
    assert!(
        text.contains(&format!("{ours:?}")) && text.contains(&format!("{theirs:?}")),
        "{text}"
    );
    assert!(!a.is_broken());
}

#[test]
fn the_lane_check_catches_a_release_kernel_that_did_nothing() {
    let spy = Spy::new();
    let mut c = Setup::new(ModelShape::MlaBf16, 16, 2).build_on(spy.clone());
    serve(&mut c, &tokens(1, 3 * 16 + 5));
    c.check_device_lanes().unwrap();
    // The partial page is released at the end of the request: the kernel pushing it back
    // does nothing, so the device lanes fall behind the mirror.
    spy.skip_kernels(Some("release_pages"));
    c.serve(&tokens(2, 2 * 16 + 5)).unwrap();
    spy.skip_kernels(None);
    assert!(spy.skipped() > 0);
    let err = c.check_device_lanes().unwrap_err();
    assert!(
        matches!(
            err,
            ClusterError::DeviceLanes {
                rank: 0,
                source: KernelAllocError::DeviceMismatch { .. }
            }
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .starts_with("rank 0: device lane state differs"),
        "{err}"
    );
}

/// Drift the select kernel now catches itself. A release kernel that did nothing leaves one
/// device lane a page behind the mirror; after evicting everything, a request that needs
/// every page of every lane is granted by the mirror, and on the device its select finds
/// that lane short. The kernel used to empty the lane and hand out page 0 for the missing
/// request, which left device and mirror tops equal (both 0) and the drift invisible to the
/// lane check; now it refuses the whole launch, and the lane check after serving (serving
/// itself reads nothing back) reports the refusal with the lane and its deficit.
#[test]
fn the_lane_check_reports_a_select_the_device_refused() {
    let spy = Spy::new();
    let mut c = Setup::new(ModelShape::MlaBf16, 16, 2).build_on(spy.clone());
    spy.skip_kernels(Some("release_pages"));
    c.serve(&tokens(2, 2 * 16 + 5)).unwrap();
    spy.skip_kernels(None);
    assert!(spy.skipped() > 0);
    c.evict_device_lru(usize::MAX).unwrap();
    let free = c.lane_free_counts();
    let all: u32 = free.iter().sum();
    assert_eq!(all, 32, "{free:?}");
    let stats = c.serve(&tokens(3, all as usize * 16)).unwrap();
    assert_eq!(stats.computed_tokens, all as u64 * 16, "{stats:?}");
    let err = c.check_device_lanes().unwrap_err();
    match &err {
        ClusterError::DeviceLanes {
            rank: 0,
            source: KernelAllocError::DeviceRefused { status },
        } => {
            assert_eq!(status.refused, 1, "{status}");
            assert_eq!(status.short_lanes().len(), 1, "{status}");
            assert_eq!(status.short_lanes()[0].1, 1, "{status}");
            assert_eq!(status.bad_owners, 0, "{status}");
        }
        other => panic!("{other}"),
    }
    let shown = err.to_string();
    assert!(
        shown.contains("the device refused allocations its host mirror granted")
            && shown.contains("short by 1 page"),
        "{shown}"
    );
}

/// Drift the release kernel now catches itself. A select kernel that did nothing leaves
/// the device lanes holding pages the mirror handed out; evicting them frees those pages
/// again onto lanes that never gave them up, a double free as the device sees it. Each lane
/// has one slot spare (33 pages: 16 per lane and the null page in 17 slots), so a lane
/// that gets two pages back would overflow: the kernel used to drop the push past the
/// capacity and clamp the top, so the lane silently lost a page; now it refuses the whole
/// launch, and the lane check (serving and evicting read nothing back) reports the refusal
/// with the lane and its overflow.
#[test]
fn the_lane_check_reports_a_release_the_device_refused() {
    let spy = Spy::new();
    let mut c = Setup::new(ModelShape::MlaBf16, 16, 2).build_on(spy.clone());
    spy.skip_kernels(Some("select_owner_pages"));
    // Four pages: two of each lane.
    c.serve(&tokens(2, 4 * 16)).unwrap();
    spy.skip_kernels(None);
    assert!(spy.skipped() > 0);
    c.evict_device_lru(usize::MAX).unwrap();
    let err = c.check_device_lanes().unwrap_err();
    match &err {
        ClusterError::DeviceLanes {
            rank: 0,
            source: KernelAllocError::DeviceRefusedRelease { status, select },
        } => {
            assert!(status.refused >= 1, "{status}");
            assert!(!status.full_lanes().is_empty(), "{status}");
            assert!(
                status.full_lanes().iter().all(|&(_, over)| over == 1),
                "{status}"
            );
            assert_eq!(status.bad_pages, 0, "{status}");
            assert!(select.is_clear(), "{select}");
        }
        other => panic!("{other}"),
    }
    let shown = err.to_string();
    assert!(
        shown.contains("the device refused frees its host mirror accepted")
            && shown.contains("over its capacity by 1 page"),
        "{shown}"
    );
}

/// A rollback whose lane re-upload fails on one rank still puts every rank's tree back: it
/// used to stop at that rank, leaving the later ranks with the failed request's tree (a
/// clock tick, a split, a lock), so the replicas never agreed again. See: review of the
/// cluster's restore.
#[test]
fn a_failed_rollback_upload_leaves_no_rank_behind() {
    let spy = Spy::new();
    let mut c = Setup::new(ModelShape::MlaBf16, 16, 2).build_on(spy.clone());
    let a = tokens(1, 4 * 16);
    serve(&mut c, &a);
    let before = c.replica_digests();
    let longer: Vec<u32> = a.iter().copied().chain(tokens(2, 2 * 16)).collect();
    // The owners upload fails, and so does the rollback's re-upload of the lanes.
    spy.fail_uploads(true);
    assert!(c.serve(&longer).is_err());
    spy.fail_uploads(false);
    assert!(c.replicas_agree(), "{:?}", c.replica_digests());
    assert_eq!(
        c.replica_digests(),
        before,
        "the ranks were not all restored"
    );
    // The broken allocator refuses the next request, whose rollback heals it.
    let err = c.serve(&a).unwrap_err();
    assert!(
        err.to_string()
            .contains("the allocator's device lanes are out of step with its host mirror"),
        "{err}"
    );
    assert!(c.replicas_agree(), "{:?}", c.replica_digests());
    assert_eq!(
        c.replica_digests(),
        before,
        "the refused request changed state"
    );
    let stats = serve(&mut c, &longer);
    assert_eq!(stats.mismatched_tokens, 0);
    assert!(c.replicas_agree(), "{:?}", c.replica_digests());
    c.check_device_lanes().unwrap();
}
