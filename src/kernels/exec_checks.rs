//! The executors' launch checks against the signatures the kernel specs give: the signature
//! check (block, grid, each argument's size, kind and alignment), the marshalling that bounds
//! every pointer by its reach, and the refusal of aliasing written pointers. These tests build
//! real specs, so they live here, above the executors ([`crate::exec`] imports nothing from
//! the kernels).

use std::sync::atomic::{AtomicBool, Ordering};

use crate::exec::{
    check_signature, marshal_args, BufferId, ExecError, KernelArg, KernelSignature, LaunchConfig,
    LaunchFailure, Marshalled, PendingLaunch,
};
use crate::kernels::{
    Direction, HostLayout, KernelSpec, MaterialiseSpec, ReleaseSpec, TransferSpec,
};

fn release() -> (String, KernelSignature) {
    let spec = KernelSpec::ReleasePages(ReleaseSpec { cp: 4, threads: 32 });
    (spec.entry_name(), spec.signature())
}

/// A signature without parameters, for blocks of 32 threads and any grid.
fn no_params() -> KernelSignature {
    KernelSignature {
        params: vec![],
        threads: 32,
        single_block: false,
    }
}

/// One block of the signature's threads: a shape every signature accepts.
fn shape(sig: &KernelSignature) -> LaunchConfig {
    LaunchConfig::linear(1, sig.threads)
}

fn good_args() -> Vec<KernelArg<'static>> {
    vec![
        KernelArg::Ptr(BufferId(1), 0),
        KernelArg::U32(3),
        KernelArg::Ptr(BufferId(2), 0),
        KernelArg::Ptr(BufferId(3), 0),
        KernelArg::U32(8),
        KernelArg::Ptr(BufferId(4), 0),
    ]
}

/// The message of an InvalidConfig launch error for `kernel` (panics on anything else).
fn invalid(kernel: &str, r: Result<(), ExecError>) -> String {
    match r {
        Err(ExecError::Launch {
            kernel: k,
            cause: LaunchFailure::InvalidConfig,
            message,
        }) if k == kernel => message,
        other => panic!("expected InvalidConfig for {kernel}, got {other:?}"),
    }
}

#[test]
fn matching_arguments_pass_and_no_signature_accepts_anything() {
    let (name, sig) = release();
    check_signature(&name, Some(&sig), &shape(&sig), &good_args()).unwrap();
    check_signature(&name, None, &LaunchConfig::linear(3, 7), &[]).unwrap();
    check_signature(
        &name,
        None,
        &LaunchConfig::linear(3, 7),
        &[KernelArg::U32(1); 9],
    )
    .unwrap();
    check_signature(&name, Some(&no_params()), &shape(&no_params()), &[]).unwrap();
}

/// A written parameter overlapping another pointer's reach is refused, naming both;
/// disjoint ranges of one buffer, and read-only parameters on the same bytes, are fine.
#[test]
fn written_parameters_must_not_alias_other_pointers() {
    let (name, sig) = release();
    let resolve = |_| Ok((0x1000, 1 << 20));
    let marshal = |sig: &KernelSignature, args: &[KernelArg<'_>]| {
        crate::exec::marshal_args(&name, Some(sig), args, resolve).map(|_| ())
    };
    // pages (read, 4 × n = 12 bytes), lane_stacks (written, 4·CP × lane_cap = 128),
    // lane_tops (written, 4·CP = 16), status (written, 4·(CP + 2) = 24).
    let mut args = good_args();
    args[2] = KernelArg::Ptr(BufferId(1), 8);
    let msg = invalid(&name, marshal(&sig, &args));
    assert!(
        msg.starts_with(
            "parameter 2 `lane_stacks` (written) overlaps parameter 0 `pages` in buffer \
             BufferId(1): bytes 8..136 and 0..12"
        ),
        "{msg}"
    );
    args[2] = KernelArg::Ptr(BufferId(1), 12);
    marshal(&sig, &args).unwrap();
    args[3] = KernelArg::Ptr(BufferId(1), 136);
    let msg = invalid(&name, marshal(&sig, &args));
    assert!(
        msg.starts_with("parameter 2 `lane_stacks` (written) overlaps parameter 3 `lane_tops`"),
        "{msg}"
    );
    args[3] = KernelArg::Ptr(BufferId(1), 140);
    marshal(&sig, &args).unwrap();
    args[5] = KernelArg::Ptr(BufferId(1), 152);
    let msg = invalid(&name, marshal(&sig, &args));
    assert!(
        msg.starts_with("parameter 3 `lane_tops` (written) overlaps parameter 5 `status`"),
        "{msg}"
    );
    args[5] = KernelArg::Ptr(BufferId(1), 156);
    marshal(&sig, &args).unwrap();
    // With n = 0 the pages reach nothing, so they may point into the stacks.
    args[0] = KernelArg::Ptr(BufferId(1), 20);
    args[1] = KernelArg::U32(0);
    marshal(&sig, &args).unwrap();
    // Unsigned kernels are not checked (nothing says what they write).
    crate::exec::marshal_args(&name, None, &[KernelArg::Ptr(BufferId(1), 0); 2], resolve).unwrap();
    // Two read-only page lists on the same bytes.
    let t = KernelSpec::TransferPages(TransferSpec {
        second_bytes_per_token: None,
        stamps: false,
        direction: Direction::HostToDevice,
        layout: HostLayout::PageFirst,
        page_size: 16,
        bytes_per_token: 64,
        launch: Default::default(),
    });
    fn targs(layers: &[(BufferId, u64)], stride: u32) -> Vec<KernelArg<'_>> {
        let list = KernelArg::Ptr(BufferId(5), 0);
        vec![
            KernelArg::Table(BufferId(8), 0, layers),
            KernelArg::Ptr(BufferId(7), 0),
            list,
            list,
            KernelArg::U32(4),
            KernelArg::U32(2),
            KernelArg::U32(0),
            KernelArg::U32(2),
            KernelArg::U32(4),
            KernelArg::U32(4),
            KernelArg::U32(stride),
        ]
    }
    let layers = [(BufferId(6), 0), (BufferId(6), 4 * 1024)];
    marshal(&t.signature(), &targs(&layers, 1024)).unwrap();
    // The written layers of one pool must not share a byte: 4 pages of 1 KiB from 4 KiB
    // apart fit, from 2 KiB apart they overlap.
    let close = [(BufferId(6), 0), (BufferId(6), 2 * 1024)];
    let msg = invalid("t", marshal_t(&t, &targs(&close, 1024)));
    assert!(
        msg.starts_with("parameter 0 `device` (written) overlaps parameter 0 `device`"),
        "{msg}"
    );
    // Interleaved page by page (a cross-layer [page][layer] tensor): layer 1 one page
    // after layer 0, pages two apart, never meet.
    let interleaved = [(BufferId(6), 0), (BufferId(6), 1024)];
    marshal(&t.signature(), &targs(&interleaved, 2048)).unwrap();
    let msg = invalid("t", marshal_t(&t, &targs(&interleaved, 1024)));
    assert!(msg.contains("overlaps"), "{msg}");
    // A stride below a page, or not a multiple of 16 bytes, is refused.
    for stride in [1008, 1030] {
        let msg = invalid("t", marshal_t(&t, &targs(&layers, stride)));
        assert!(
            msg.contains(&format!("page stride of {stride} bytes")),
            "{msg}"
        );
    }
    // One pointer per layer, no more, no fewer.
    let short = [(BufferId(6), 0)];
    let msg = invalid("t", marshal_t(&t, &targs(&short, 1024)));
    assert!(
        msg.contains("reads 2 pointers (8 × layers), but the table has 1"),
        "{msg}"
    );
}

fn marshal_t(spec: &KernelSpec, args: &[KernelArg<'_>]) -> Result<(), ExecError> {
    crate::exec::marshal_args("t", Some(&spec.signature()), args, |_| {
        Ok((0x1000, 1 << 20))
    })
    .map(|_| ())
}

// A kernel without a signature runs only through `launch_unchecked`, and an armed
// injected failure is consumed only by a launch that would have run.
#[test]
fn pending_launches_refuse_unsigned_kernels_and_keep_the_failure_armed() {
    let (name, sig) = release();
    let fail = AtomicBool::new(true);
    let run = |signature: Option<&KernelSignature>, unsigned_ok: bool, n: usize| {
        let args = good_args();
        PendingLaunch {
            kernel: &name,
            signature,
            unsigned_ok,
            config: &shape(&sig),
            args: &args[..n],
        }
        .marshal(&fail, |_| Ok((0x1000, 1 << 20)))
        .map(|m| m.params.len())
    };
    let msg = invalid(&name, run(None, false, 6).map(|_| ()));
    assert!(msg.contains("only `launch_unchecked` runs it"), "{msg}");
    let msg = invalid(&name, run(Some(&sig), false, 5).map(|_| ()));
    assert!(msg.contains("no argument given"), "{msg}");
    assert!(
        fail.load(Ordering::SeqCst),
        "refused launches leave the failure armed"
    );
    let e = run(Some(&sig), false, 6).unwrap_err();
    assert_eq!(e.launch_failure(), Some(LaunchFailure::Injected));
    assert_eq!(run(Some(&sig), false, 6).unwrap(), 6);
    assert_eq!(run(None, true, 6).unwrap(), 6);
}

#[test]
fn one_argument_too_few_names_the_missing_parameter() {
    let (name, sig) = release();
    let args = &good_args()[..4];
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), args),
    );
    assert_eq!(
        msg,
        "parameter 4 `lane_cap` (u32) takes 4 bytes, no argument given \
         (4 arguments for 6 parameters)"
    );
    let err = check_signature(&name, Some(&sig), &shape(&sig), args).unwrap_err();
    assert!(err.to_string().contains(&name), "{err}");
}

#[test]
fn one_argument_too_many_names_the_last_parameter() {
    let (name, sig) = release();
    let mut args = good_args();
    args.push(KernelArg::U64(7));
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), &args),
    );
    assert_eq!(
        msg,
        "argument 6 (a u64 of 8 bytes) follows the last parameter 5 `status` \
         (7 arguments for 6 parameters)"
    );
    let msg = invalid(
        "k",
        check_signature("k", Some(&no_params()), &shape(&no_params()), &args[..1]),
    );
    assert!(msg.contains("the kernel takes none"), "{msg}");
}

#[test]
fn a_u32_where_a_pointer_belongs_names_the_parameter_and_both_sizes() {
    let (name, sig) = release();
    let mut args = good_args();
    args[2] = KernelArg::U32(0);
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), &args),
    );
    assert_eq!(
        msg,
        "parameter 2 `lane_stacks` (u32*) takes 8 bytes, argument 2 is a u32 of 4 bytes"
    );
}

#[test]
fn a_same_sized_value_of_the_wrong_kind_is_refused() {
    let (name, sig) = release();
    let mut args = good_args();
    args[0] = KernelArg::U64(0x1000);
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), &args),
    );
    assert_eq!(
        msg,
        "parameter 0 `pages` (const u32*) cannot take argument 0, a u64 of the same size"
    );
    let mut args = good_args();
    args[1] = KernelArg::I32(3);
    check_signature(&name, Some(&sig), &shape(&sig), &args).unwrap();
}

#[test]
fn null_is_refused_for_every_pointer_parameter() {
    let (name, sig) = release();
    for i in [0, 2, 3, 5] {
        let mut args = good_args();
        args[i] = KernelArg::Null;
        let msg = invalid(
            &name,
            check_signature(&name, Some(&sig), &shape(&sig), &args),
        );
        assert!(
            msg.starts_with(&format!("parameter {i} `"))
                && msg.ends_with(&format!(
                    "cannot take argument {i}, a null pointer of the same size"
                )),
            "{msg}"
        );
    }
}

#[test]
fn a_dropped_middle_argument_reports_the_first_shifted_size() {
    let (name, sig) = release();
    let mut args = good_args();
    args.remove(1);
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), &args),
    );
    assert_eq!(
        msg,
        "parameter 1 `n` (u32) takes 4 bytes, argument 1 is a pointer of 8 bytes \
         (5 arguments for 6 parameters)"
    );
}

#[test]
fn a_page_table_takes_a_table_and_nothing_else_does() {
    let spec = KernelSpec::Materialise(MaterialiseSpec {
        cp: 4,
        page_size: 16,
        bytes_per_token: 1152,
        launch: Default::default(),
    });
    let (name, sig) = (spec.entry_name(), spec.signature());
    let pools = [(BufferId(1), 0); 4];
    let rest = [
        KernelArg::Ptr(BufferId(2), 0),
        KernelArg::U32(1),
        KernelArg::U32(1),
        KernelArg::U32(1),
        KernelArg::U32(16 * 1152),
        KernelArg::Ptr(BufferId(3), 0),
    ];
    let args: Vec<KernelArg<'_>> = std::iter::once(KernelArg::Table(BufferId(4), 0, &pools))
        .chain(rest)
        .collect();
    check_signature(&name, Some(&sig), &shape(&sig), &args).unwrap();
    let mut plain = args.clone();
    plain[0] = KernelArg::Ptr(BufferId(4), 0);
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), &plain),
    );
    assert_eq!(
        msg,
        "parameter 0 `pools` (const u64*) cannot take argument 0, a pointer of the same size"
    );
    let mut table = args.clone();
    table[1] = KernelArg::Table(BufferId(2), 0, &pools);
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), &table),
    );
    assert_eq!(
        msg,
        "parameter 1 `seq_pages` (const u32*) cannot take argument 1, a page table of the \
         same size"
    );
}

#[test]
fn a_block_other_than_the_compiled_threads_is_refused() {
    let (name, sig) = release();
    for block in [[16, 1, 1], [64, 1, 1], [32, 2, 1], [32, 1, 2]] {
        let config = LaunchConfig {
            block,
            ..shape(&sig)
        };
        let msg = invalid(
            &name,
            check_signature(&name, Some(&sig), &config, &good_args()),
        );
        assert!(
            msg.starts_with(&format!(
                "block {block:?}, but the kernel is compiled for blocks of [32, 1, 1]"
            )),
            "{msg}"
        );
    }
}

#[test]
fn select_and_release_take_exactly_one_block_and_the_others_any_grid() {
    let (name, sig) = release();
    assert!(sig.single_block);
    for grid in [[2, 1, 1], [1, 2, 1], [1, 1, 2]] {
        let config = LaunchConfig {
            grid,
            ..shape(&sig)
        };
        let msg = invalid(
            &name,
            check_signature(&name, Some(&sig), &config, &good_args()),
        );
        assert_eq!(
            msg,
            format!("grid {grid:?}, but the kernel updates the lane stacks from exactly one block")
        );
    }
    let many = LaunchConfig::linear(9, 32);
    check_signature("k", Some(&no_params()), &many, &[]).unwrap();
}

#[test]
fn a_misaligned_pointer_is_refused() {
    let (name, sig) = release();
    let mut args = good_args();
    args[0] = KernelArg::Ptr(BufferId(1), 6);
    let msg = invalid(
        &name,
        check_signature(&name, Some(&sig), &shape(&sig), &args),
    );
    assert_eq!(
        msg,
        "parameter 0 `pages` (const u32*) needs 4-byte alignment, argument 0 points 6 bytes \
         into its buffer (a GPU faults on the misaligned access)"
    );
    args[0] = KernelArg::Ptr(BufferId(1), 8);
    check_signature(&name, Some(&sig), &shape(&sig), &args).unwrap();

    let spec = KernelSpec::Materialise(MaterialiseSpec {
        cp: 2,
        page_size: 16,
        bytes_per_token: 1152,
        launch: Default::default(),
    });
    let sig = spec.signature();
    let rest = [
        KernelArg::Ptr(BufferId(2), 0),
        KernelArg::U32(1),
        KernelArg::U32(1),
        KernelArg::U32(1),
        KernelArg::U32(16 * 1152),
        KernelArg::Ptr(BufferId(3), 32),
    ];
    for (pools, at, ok) in [
        ([(BufferId(1), 0), (BufferId(1), 48)], 0, true),
        ([(BufferId(1), 0), (BufferId(1), 8)], 0, false),
        ([(BufferId(1), 0), (BufferId(1), 48)], 4, false),
    ] {
        let args: Vec<_> = std::iter::once(KernelArg::Table(BufferId(4), at, &pools))
            .chain(rest)
            .collect();
        let r = check_signature("m", Some(&sig), &shape(&sig), &args);
        assert_eq!(r.is_ok(), ok, "{pools:?} at {at}: {r:?}");
    }
}

#[test]
fn a_bad_pointer_argument_names_the_kernel_and_the_parameter() {
    let spec = KernelSpec::ReleasePages(ReleaseSpec { cp: 2, threads: 32 });
    let sig = spec.signature();
    let resolve = |b: BufferId| match b.0 {
        1..=4 => Ok((0x1000 * b.0, 64)),
        _ => Err(ExecError::UnknownBuffer(b)),
    };
    let message = |r: Result<Marshalled, ExecError>| match r {
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
