//! The launch-time check of a kernel's arguments and launch shape against its signature,
//! shared by both executors so that a launch the host emulator refuses is refused on a GPU
//! too.
//!
//! `cuLaunchKernel` copies as many bytes per parameter as the kernel declares, whatever the
//! caller passed, so a wrong argument list reads garbage instead of failing. Kernels rendered
//! from a [`KernelSpec`](crate::kernels::KernelSpec) carry their
//! [`signature`](crate::kernels::KernelSpec::signature) into the executor, which runs
//! [`check_signature`] before marshalling anything.

use std::sync::atomic::{AtomicBool, Ordering};

use super::{
    BufferId, ExecError, KernelArg, KernelParam, KernelSignature, LaunchConfig, LaunchFailure,
};

/// How an argument was passed, for the diagnostic.
fn arg_kind(arg: &KernelArg<'_>) -> &'static str {
    match arg {
        KernelArg::Ptr(..) => "pointer",
        KernelArg::Null => "null pointer",
        KernelArg::U32(_) => "u32",
        KernelArg::I32(_) => "i32",
        KernelArg::U64(_) => "u64",
        KernelArg::I64(_) => "i64",
        KernelArg::Bytes(_) => "bytes",
        KernelArg::Table(..) => "page table",
    }
}

/// Whether an argument of the right size is also of the right kind: a page table takes a
/// [`KernelArg::Table`] (never a plain pointer, whose addresses in memory no executor could
/// check), another pointer parameter a buffer pointer (never null: every rendered kernel
/// dereferences every pointer it takes), a scalar a scalar (a `u64` and a pointer have the
/// same size, but are not interchangeable).
fn kind_fits(p: &KernelParam, arg: &KernelArg<'_>) -> bool {
    let pointer = matches!(
        arg,
        KernelArg::Ptr(..) | KernelArg::Null | KernelArg::Table(..)
    );
    if p.entries.is_some() {
        matches!(arg, KernelArg::Table(..))
    } else if p.c_type.ends_with('*') {
        matches!(arg, KernelArg::Ptr(..))
    } else {
        !pointer
    }
}

/// Checks a launch against `signature`: the block is the kernel's `threads` in x, the grid is
/// one block for a single-block kernel, and `args` match the parameters (the count, then each
/// argument's size and kind). `None` (a kernel loaded without a signature, which only
/// [`Executor::launch_unchecked`](super::Executor::launch_unchecked) runs) accepts anything;
/// the host emulator still checks such launches against the compiled kernel itself. How far
/// pointers reach is checked where they are resolved to buffers
/// ([`marshal_args`](super::marshal_args)).
///
/// A mismatch is [`ExecError::Launch`] with [`LaunchFailure::InvalidConfig`], naming the kernel
/// and what differs (for arguments, the first offending parameter by index and name, and the
/// expected and given sizes). Nothing has been launched when it is returned, so the executor
/// stays usable.
pub(crate) fn check_signature(
    kernel: &str,
    signature: Option<&KernelSignature>,
    config: &LaunchConfig,
    args: &[KernelArg<'_>],
) -> Result<(), ExecError> {
    let Some(signature) = signature else {
        return Ok(());
    };
    let invalid = |message: String| ExecError::Launch {
        kernel: kernel.to_string(),
        cause: LaunchFailure::InvalidConfig,
        message,
    };
    if config.block != [signature.threads, 1, 1] {
        return Err(invalid(format!(
            "block {:?}, but the kernel is compiled for blocks of [{}, 1, 1] threads (it strides by \
             its THREADS, so another block size would skip or overrun work)",
            config.block, signature.threads
        )));
    }
    if signature.single_block && config.grid != [1, 1, 1] {
        return Err(invalid(format!(
            "grid {:?}, but the kernel updates the lane stacks from exactly one block",
            config.grid
        )));
    }
    let params = &signature.params[..];
    let counts = if args.len() == params.len() {
        String::new()
    } else {
        format!(
            " ({} arguments for {} parameters)",
            args.len(),
            params.len()
        )
    };
    // The first size mismatch is reported even when the count is wrong too: a missing or
    // extra argument in the middle usually shows up there first.
    for (i, (p, arg)) in params.iter().zip(args).enumerate() {
        if arg.size() == p.size && !kind_fits(p, arg) {
            return Err(invalid(format!(
                "parameter {i} `{}` ({}) cannot take argument {i}, a {} of the same size{counts}",
                p.name,
                p.c_type,
                arg_kind(arg),
            )));
        }
        if arg.size() != p.size {
            return Err(invalid(format!(
                "parameter {i} `{}` ({}) takes {} bytes, argument {i} is a {} of {} bytes{counts}",
                p.name,
                p.c_type,
                p.size,
                arg_kind(arg),
                arg.size()
            )));
        }
        // Buffer bases are at least 64-byte aligned, so the offset decides the alignment.
        let misaligned = |align: u64| move |off: &u64| off % align.max(1) != 0;
        let bad = match arg {
            KernelArg::Ptr(_, off) => Some(*off).filter(misaligned(p.align)).map(|o| (o, None)),
            KernelArg::Table(_, off, entries) => Some(*off)
                .filter(misaligned(p.align))
                .map(|o| (o, None))
                .or_else(|| {
                    let align = p.entries.map_or(p.align, |t| t.align);
                    entries
                        .iter()
                        .map(|&(_, off)| off)
                        .enumerate()
                        .find(|(_, off)| misaligned(align)(off))
                        .map(|(j, o)| (o, Some(j)))
                }),
            _ => None,
        };
        if let Some((off, entry)) = bad {
            let (what, align) = match entry {
                Some(j) => (
                    format!("pointer {j} of argument {i}"),
                    p.entries.map_or(p.align, |t| t.align),
                ),
                None => (format!("argument {i}"), p.align),
            };
            return Err(invalid(format!(
                "parameter {i} `{}` ({}) needs {align}-byte alignment, {what} points {off} bytes \
                 into its buffer (a GPU faults on the misaligned access)",
                p.name, p.c_type
            )));
        }
    }
    if let Some(p) = params.get(args.len()) {
        return Err(invalid(format!(
            "parameter {} `{}` ({}) takes {} bytes, no argument given{counts}",
            args.len(),
            p.name,
            p.c_type,
            p.size
        )));
    }
    if let Some(arg) = args.get(params.len()) {
        let last = params
            .last()
            .map(|p| format!("the last parameter {} `{}`", params.len() - 1, p.name))
            .unwrap_or_else(|| "no parameter: the kernel takes none".into());
        return Err(invalid(format!(
            "argument {} (a {} of {} bytes) follows {last}{counts}",
            params.len(),
            arg_kind(arg),
            arg.size()
        )));
    }
    Ok(())
}

/// A launch as both executors check it before anything runs.
pub(crate) struct PendingLaunch<'a, 'b> {
    /// Kernel (entry) name, for diagnostics.
    pub kernel: &'a str,
    /// The signature the kernel was loaded with.
    pub signature: Option<&'a KernelSignature>,
    /// Whether a kernel without a signature may run (`launch_unchecked`).
    pub unsigned_ok: bool,
    /// Grid and block.
    pub config: &'a LaunchConfig,
    /// The arguments.
    pub args: &'a [KernelArg<'b>],
}

impl PendingLaunch<'_, '_> {
    /// The parameter bytes of a launch that may run: a kernel without a signature is refused
    /// unless `unsigned_ok`, then [`check_signature`], then
    /// [`marshal_args`](super::marshal_args) (pointers resolved and bounded by their reach),
    /// then an armed injected failure is consumed. Only a launch that would run consumes it:
    /// an invalid one reports why it is invalid, and the failure stays armed.
    pub(crate) fn marshal(
        &self,
        fail_next: &AtomicBool,
        resolve: impl Fn(BufferId) -> Result<(u64, usize), ExecError>,
    ) -> Result<super::launch::Marshalled, ExecError> {
        let (kernel, signature) = (self.kernel, self.signature);
        if signature.is_none() && !self.unsigned_ok {
            return Err(ExecError::Launch {
                kernel: kernel.to_string(),
                cause: LaunchFailure::InvalidConfig,
                message: "the kernel was loaded without a signature, so nothing bounds what it \
                          reaches: only `launch_unchecked` runs it"
                    .into(),
            });
        }
        check_signature(kernel, signature, self.config, self.args)?;
        let bytes = super::marshal_args(kernel, signature, self.args, resolve)?;
        if fail_next.swap(false, Ordering::SeqCst) {
            return Err(ExecError::Launch {
                kernel: kernel.to_string(),
                cause: LaunchFailure::Injected,
                message: "launch failure injected; the kernel did not run".into(),
            });
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::BufferId;
    use crate::exec::LaunchConfig;
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
        crate::exec::marshal_args(&name, None, &[KernelArg::Ptr(BufferId(1), 0); 2], resolve)
            .unwrap();
        // Two read-only page lists on the same bytes.
        let t = KernelSpec::TransferPages(TransferSpec {
            second_bytes_per_token: None,
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
                format!(
                    "grid {grid:?}, but the kernel updates the lane stacks from exactly one block"
                )
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
}
