//! The launch-time check of a kernel's arguments and launch shape against its signature,
//! shared by both executors so that a launch the host emulator refuses is refused on a GPU
//! too.
//!
//! `cuLaunchKernel` copies as many bytes per parameter as the kernel declares, whatever the
//! caller passed, so a wrong argument list reads garbage instead of failing. Kernels rendered
//! from a [`KernelSpec`](crate::kernels::KernelSpec) carry their
//! [`signature`](crate::kernels::KernelSpec::signature) into the executor, which runs
//! [`check_signature`] before marshalling anything. (The tests of these checks against real
//! kernel signatures are the kernels' `exec_checks`: nothing here imports the kernels.)

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
