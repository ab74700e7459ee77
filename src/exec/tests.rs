//! Unit tests of the executor vocabulary: backend parsing, counters, copy-region merging
//! and checks, and kernel-argument marshalling, kept out of `mod.rs` to keep it short.

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
fn a_bad_pointer_argument_names_the_kernel_and_the_parameter() {
    use crate::kernels::{KernelSpec, ReleaseSpec};
    let spec = KernelSpec::ReleasePages(ReleaseSpec { cp: 2, threads: 32 });
    let sig = spec.signature();
    let resolve = |b: BufferId| match b.0 {
        1..=4 => Ok((0x1000 * b.0, 64)),
        _ => Err(ExecError::UnknownBuffer(b)),
    };
    let message = |r: Result<crate::exec::launch::Marshalled, ExecError>| match r {
        Err(ExecError::Launch {
            kernel,
            cause: LaunchFailure::InvalidConfig,
            message,
        }) if kernel == "k" => message,
        other => panic!("{other:?}"),
    };
    // Release of 2 pages over 2 lanes of `lane_cap` slots: 8 bytes of pages, 8 ×
    // lane_cap bytes of stacks, 8 bytes of tops, 16 of status words, each in a buffer of
    // its own (the written stacks, tops and status must not alias another pointer).
    let release = |stacks_offset: u64, lane_cap: u32| {
        [
            KernelArg::Ptr(BufferId(2), 0),
            KernelArg::U32(2),
            KernelArg::Ptr(BufferId(1), stacks_offset),
            KernelArg::Ptr(BufferId(3), 0),
            KernelArg::U32(lane_cap),
            KernelArg::Ptr(BufferId(4), 0),
        ]
    };
    assert_eq!(
        message(marshal_args("k", Some(&sig), &release(65, 0), resolve)),
        "parameter 2 `lane_stacks` (u32*): kernel argument of 0 bytes at offset 65 is \
         outside buffer BufferId(1) of 64 bytes"
    );
    // The stacks reach 8 × lane_cap bytes: 64 fit from offset 0, not one byte more.
    marshal_args("k", Some(&sig), &release(0, 8), resolve).unwrap();
    marshal_args("k", Some(&sig), &release(8, 7), resolve).unwrap();
    assert_eq!(
        message(marshal_args("k", Some(&sig), &release(8, 8), resolve)),
        "parameter 2 `lane_stacks` (u32*): kernel argument of 64 bytes at offset 8 is \
         outside buffer BufferId(1) of 64 bytes (the kernel reaches 8 × lane_cap bytes \
         from it)"
    );
    assert_eq!(
        message(marshal_args(
            "k",
            Some(&sig),
            &release(0, u32::MAX),
            resolve
        )),
        "parameter 2 `lane_stacks` (u32*): kernel argument of 34359738360 bytes at offset \
         0 is outside buffer BufferId(1) of 64 bytes (the kernel reaches 8 × lane_cap \
         bytes from it)"
    );
    assert_eq!(
        message(marshal_args("k", Some(&sig), &release(0, 8)[..4], resolve)),
        "parameter 2 `lane_stacks` reaches 8 × lane_cap bytes, which has no u32 argument \
         for `lane_cap`"
    );
    let args = [KernelArg::U32(2), KernelArg::Ptr(BufferId(7), 0)];
    assert_eq!(
        message(marshal_args("k", None, &args, resolve)),
        "parameter 1: unknown buffer BufferId(7)"
    );
    // Without a signature a table's pointers only start inside their buffers (as a plain
    // pointer's do), and an unknown one is still refused.
    let ptrs = [(BufferId(1), 0), (BufferId(9), 0)];
    let e = marshal_args(
        "k",
        None,
        &[KernelArg::Table(BufferId(3), 0, &ptrs)],
        resolve,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .ends_with("parameter 0, pointer 1: unknown buffer BufferId(9)"),
        "{e}"
    );
    // One past the end is a valid pointer for a parameter that reaches nothing (`n` = 0).
    let ok = marshal_args(
        "k",
        Some(&sig),
        &[KernelArg::Ptr(BufferId(1), 64), KernelArg::U32(0)],
        resolve,
    );
    assert_eq!(
        ok.unwrap().params,
        vec![
            (0x1000u64 + 64).to_ne_bytes().to_vec(),
            0u32.to_ne_bytes().to_vec()
        ]
    );
}

#[test]
fn arg_sizes() {
    assert_eq!(KernelArg::U32(1).size(), 4);
    assert_eq!(KernelArg::Ptr(BufferId(1), 0).size(), 8);
    assert_eq!(KernelArg::Bytes(&[0; 24]).size(), 24);
}
