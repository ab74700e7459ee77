//! Unit tests of the executor vocabulary: backend parsing, counters, copy-region merging
//! and checks, and kernel-argument sizes, kept out of `mod.rs` to keep it short. The launch
//! checks against real kernel signatures are tested above, in `kernels::exec_checks`.

use super::*;

#[test]
fn backend_parses_and_prints() {
    for b in [Backend::Auto, Backend::Host, Backend::Cuda] {
        assert_eq!(b.to_string().parse::<Backend>().unwrap(), b);
    }
    assert_eq!(" GPU ".parse::<Backend>().unwrap(), Backend::Cuda);
    assert!(matches!(
        "tpu".parse::<Backend>(),
        Err(ExecError::Config { .. })
    ));
}

#[test]
fn counters_diff() {
    let a = Counters {
        launches: 2,
        reads: 1,
        ..Default::default()
    };
    let b = Counters {
        launches: 5,
        reads: 1,
        syncs: 1,
        ..Default::default()
    };
    let d = b.since(&a);
    assert_eq!(d.launches, 3);
    assert_eq!(d.reads, 0);
    assert!(!d.is_sync_free());
    assert!(Counters::default().is_sync_free());
}

#[test]
fn adjacent_regions_merge_into_one_copy_per_run() {
    let r = |src_offset, dst_offset, len| CopyRegion {
        src_offset,
        dst_offset,
        len,
    };
    // Four page blobs, scattered in the batch, two contiguous runs on both sides; an
    // empty region is dropped.
    let batch = [
        r(200, 20, 10),
        r(0, 100, 10),
        r(190, 10, 10),
        r(10, 110, 10),
        r(5, 5, 0),
    ];
    assert_eq!(
        merge_regions(&batch, false),
        [r(190, 10, 20), r(0, 100, 20)]
    );
    // Within one buffer the order stays: only consecutive regions merge.
    assert_eq!(merge_regions(&batch, true), batch[..4]);
    // Contiguous on one side only: not merged.
    assert_eq!(
        merge_regions(&[r(0, 0, 8), r(16, 8, 8)], false),
        [r(0, 0, 8), r(16, 8, 8)]
    );
    // Overlapping destinations keep their order (the later copy wins).
    let overlap = [r(100, 0, 8), r(0, 0, 8), r(8, 8, 8)];
    assert_eq!(merge_regions(&overlap, false), [r(100, 0, 8), r(0, 0, 16)]);
    // 2,048 page pairs in order, one layer each: one region.
    let pages: Vec<CopyRegion> = (0..2048).map(|i| r(i * 656, i * 656, 656)).collect();
    assert_eq!(merge_regions(&pages, false), [r(0, 0, 2048 * 656)]);
}

#[test]
fn regions_are_checked_before_copying() {
    let (a, b) = (BufferId(1), BufferId(2));
    let r = |src_offset, dst_offset, len| CopyRegion {
        src_offset,
        dst_offset,
        len,
    };
    assert_eq!(
        check_regions((a, 64), (b, 32), &[r(0, 0, 16), r(48, 16, 16)]).unwrap(),
        32
    );
    assert!(matches!(
        check_regions((a, 64), (b, 32), &[r(0, 0, 16), r(0, 17, 16)]),
        Err(ExecError::OutOfBounds {
            op: "copy destination",
            ..
        })
    ));
    assert!(matches!(
        check_regions((a, 64), (b, 32), &[r(60, 0, 8)]),
        Err(ExecError::OutOfBounds {
            op: "copy source",
            ..
        })
    ));
    assert!(matches!(
        check_regions((a, 64), (a, 64), &[r(0, 8, 16)]),
        Err(ExecError::OverlappingCopy { .. })
    ));
    assert_eq!(
        check_regions((a, 64), (a, 64), &[r(0, 16, 16), r(8, 8, 0)]).unwrap(),
        16
    );
}

#[test]
fn arg_sizes() {
    assert_eq!(KernelArg::U32(1).size(), 4);
    assert_eq!(KernelArg::Ptr(BufferId(1), 0).size(), 8);
    assert_eq!(KernelArg::Bytes(&[0; 24]).size(), 24);
}
