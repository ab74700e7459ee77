//! Compiling plus loading a set of specs through the JIT for the executor at hand, as the
//! tuner, `bench` and `bench --check` all do before they launch anything.

use crate::exec::{Executor, KernelId};
use crate::jit::{spec_request, Arch, Jit, JitRequest, Sanitize, Target};
use crate::kernels::KernelSpec;
use crate::tuning::TuningError;

/// The JIT target for an executor: its device's arch on CUDA; on the host, the sanitizer mode
/// `CP_HICACHE_EMU_SANITIZE` selects.
pub fn target_for(exec: &dyn Executor) -> Result<Target, TuningError> {
    Ok(crate::jit::target_for(
        exec,
        Arch::default(),
        Sanitize::from_env()?,
    )?)
}

pub use crate::jit::SourceHook;

/// Renders, compiles (in parallel, through the JIT cache) and loads each spec; one result per
/// spec: the kernel handle, or why it cannot run (render, compile or load error; with
/// `drop_spilling`, which the tuner sets for its candidates, also an NVRTC build that spills
/// registers or uses a stack frame). Checks and benchmarks run such a build as replay does.
///
/// # Safety
///
/// `hook`, when given, must keep every kernel within its spec's signature: each parameter's
/// [`Reach`](crate::kernels::Reach) bounds what the kernel touches. An edit that only makes
/// a source fail to compile (the compile-error fault) does.
pub unsafe fn compile_and_load(
    exec: &dyn Executor,
    jit: &Jit,
    specs: &[KernelSpec],
    drop_spilling: bool,
    hook: Option<SourceHook<'_>>,
    on_done: &(dyn Fn() + Sync),
) -> Vec<Result<KernelId, String>> {
    let target = match target_for(exec) {
        Ok(t) => t,
        Err(e) => return specs.iter().map(|_| Err(e.to_string())).collect(),
    };
    let requests: Vec<Result<JitRequest, String>> = specs
        .iter()
        .map(|spec| spec_request(spec, target, hook).map_err(|e| e.to_string()))
        .collect();
    let ok: Vec<JitRequest> = requests
        .iter()
        .filter_map(|r| r.as_ref().ok().cloned())
        .collect();
    let mut compiled = jit.warm_up_with(&ok, |_| on_done()).into_iter();
    specs
        .iter()
        .zip(requests)
        .map(|(spec, req)| {
            req?;
            let k = compiled
                .next()
                .ok_or_else(|| "internal: missing JIT result".to_string())?
                .map_err(|e| e.to_string())?;
            if let Some(rep) = k.report.as_ref().filter(|_| drop_spilling) {
                if rep.spill_bytes > 0 || rep.stack_bytes > 0 {
                    return Err(format!(
                        "spills {} bytes, {}-byte stack frame",
                        rep.spill_bytes, rep.stack_bytes
                    ));
                }
            }
            // SAFETY: `k` is the JIT's build of `spec` for `exec`'s target (`target_for`),
            // from its render or an edit the caller vouches for.
            unsafe { k.load_spec(exec, spec) }.map_err(|e| e.to_string())
        })
        .collect()
}
