//! Glue between the kernel descriptions and the JIT: a [`Deployment`] becomes one
//! [`JitRequest`] per kernel it needs, and [`warm_up_deployment`] compiles (or loads) them all in
//! parallel, as `cp-hicache compile` does and as an engine does at start-up.
//!
//! Every JIT event is logged by the JIT itself (target `cp_hicache::jit`).

use super::{Arch, CompiledKernel, Jit, JitError, JitRequest, Sanitize, Target};
use crate::exec::{Backend, ExecError, Executor};
use crate::kernels::{Deployment, KernelError, KernelSpec};

/// Test and fault-injection hook: edits one kernel's source before it is compiled.
pub type SourceHook<'a> = &'a (dyn Fn(&KernelSpec, String) -> String + Sync);

/// The source edit of `--inject compile-error`: `src` with an `#error` line, so that every
/// compiler (NVRTC, the host C++ compiler) refuses it with a message naming the injection.
pub fn break_source(src: String) -> String {
    format!("{src}\n#error \"fault injected: this kernel does not compile\"\n")
}

/// What compiles kernels for `exec`: host shared libraries for the CPU emulation; NVRTC
/// CUBINs for a CUDA device, built for the newest supported architecture its compute
/// capability runs ([`Arch::for_device`]), whatever `arch` says (`arch` is used only when the
/// executor reports no capability). A GPU no supported architecture runs is
/// [`ExecError::Unavailable`], not a module-load failure later; so is an AddressSanitizer
/// build for a host executor in a process without the ASan runtime, which would otherwise be
/// ended by the runtime at the first load, after every kernel was compiled.
pub fn target_for(
    exec: &dyn Executor,
    arch: Arch,
    sanitize: Sanitize,
) -> Result<Target, ExecError> {
    let mut target = target_of(
        exec.backend(),
        exec.compute_capability(),
        arch,
        sanitize,
        || exec.device_name(),
    )?;
    // The stand-in driver runs host libraries behind `cuLaunchKernel` (once its device has
    // passed the architecture check a real one would).
    if exec.runs_emulated_kernels() {
        target = Target::Host { sanitize };
    }
    if target
        == (Target::Host {
            sanitize: Sanitize::Address,
        })
        && !crate::exec::host::asan_runtime_loaded()
    {
        return Err(ExecError::Unavailable {
            backend: Backend::Host,
            reason: format!(
                "kernels built with CP_HICACHE_EMU_SANITIZE=address cannot be loaded here: {}",
                crate::exec::host::ASAN_HINT
            ),
        });
    }
    Ok(target)
}

fn target_of(
    backend: Backend,
    capability: Option<(u32, u32)>,
    arch: Arch,
    sanitize: Sanitize,
    device: impl FnOnce() -> String,
) -> Result<Target, ExecError> {
    match (backend, capability) {
        (Backend::Cuda, None) => Ok(Target::Nvrtc { arch }),
        (Backend::Cuda, Some((major, minor))) => match Arch::for_device(major, minor) {
            Some(arch) => Ok(Target::Nvrtc { arch }),
            None => Err(ExecError::Unavailable {
                backend,
                reason: format!(
                    "{} has compute capability {major}.{minor}; kernels are built for {}",
                    device(),
                    Arch::ALL.map(|a| a.to_string()).join(", ")
                ),
            }),
        },
        _ => Ok(Target::Host { sanitize }),
    }
}

/// The JIT request for one spec: its render, edited by `hook` if given, for `target`.
pub fn spec_request(
    spec: &KernelSpec,
    target: Target,
    hook: Option<SourceHook<'_>>,
) -> Result<JitRequest, KernelError> {
    let source = spec.render()?;
    Ok(JitRequest {
        uri: spec.uri(),
        source: match hook {
            Some(h) => h(spec, source),
            None => source,
        },
        target,
    })
}

/// One kernel of a deployment and what the JIT made of it.
pub type KernelOutcome = (KernelSpec, Result<CompiledKernel, JitError>);

/// Errors of a deployment warm-up.
#[derive(Debug, thiserror::Error)]
pub enum WarmUpError {
    /// A kernel of the deployment could not be rendered.
    #[error("deployment {deployment}: {source}")]
    Render {
        /// Deployment name.
        deployment: String,
        /// The render error.
        #[source]
        source: KernelError,
    },
    /// One or more kernels failed to compile or load; every failure is listed.
    #[error("deployment {deployment}: {} of {total} kernels failed:\n{}", failures.len(),
        distinct_lines(failures))]
    Jit {
        /// Deployment name.
        deployment: String,
        /// Number of kernels requested.
        total: usize,
        /// Each failure, naming its kernel.
        failures: Vec<JitError>,
    },
}

/// One line per distinct failure, in first-seen order, with a count when it repeats (a missing
/// compiler fails every kernel with the same message).
fn distinct_lines(failures: &[JitError]) -> String {
    let mut lines: Vec<(String, usize)> = Vec::new();
    for f in failures {
        let text = f.to_string();
        match lines.iter_mut().find(|(t, _)| *t == text) {
            Some((_, n)) => *n += 1,
            None => lines.push((text, 1)),
        }
    }
    lines
        .into_iter()
        .map(|(t, n)| {
            if n > 1 {
                format!("{t} ({n} kernels)")
            } else {
                t
            }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The NVRTC target a deployment is built for by default (its own architecture).
pub fn deployment_target(dep: &Deployment) -> Target {
    Target::Nvrtc { arch: dep.arch }
}

/// One request per kernel of `dep` (in [`Deployment::specs`] order), rendered for `target`.
pub fn deployment_requests(
    dep: &Deployment,
    target: Target,
) -> Result<Vec<(KernelSpec, JitRequest)>, KernelError> {
    dep.specs()
        .into_iter()
        .map(|spec| Ok((spec, spec_request(&spec, target, None)?)))
        .collect()
}

/// Compiles or loads every kernel of `dep` for `target`, in parallel, and returns one result per
/// kernel, in [`Deployment::specs`] order, so a caller can report each failure.
pub fn warm_up_deployment_each(
    jit: &Jit,
    dep: &Deployment,
    target: Target,
) -> Result<Vec<KernelOutcome>, WarmUpError> {
    let requests = deployment_requests(dep, target).map_err(|source| WarmUpError::Render {
        deployment: dep.name.clone(),
        source,
    })?;
    let reqs: Vec<JitRequest> = requests.iter().map(|(_, r)| r.clone()).collect();
    let results = jit.warm_up(&reqs);
    Ok(requests.into_iter().map(|(s, _)| s).zip(results).collect())
}

/// Compiles or loads every kernel of `dep` for `target`, in parallel: the start-up path of an
/// engine. All kernels or an error listing every failure.
pub fn warm_up_deployment(
    jit: &Jit,
    dep: &Deployment,
    target: Target,
) -> Result<Vec<CompiledKernel>, WarmUpError> {
    let each = warm_up_deployment_each(jit, dep, target)?;
    let total = each.len();
    let mut ok = Vec::with_capacity(total);
    let mut failures = Vec::new();
    for (_, r) in each {
        match r {
            Ok(k) => ok.push(k),
            Err(e) => failures.push(e),
        }
    }
    if failures.is_empty() {
        Ok(ok)
    } else {
        Err(WarmUpError::Jit {
            deployment: dep.name.clone(),
            total,
            failures,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_failures_are_listed_once_with_a_count() {
        let missing = || JitError::HostCcUnavailable {
            program: "c++".to_string(),
            reason: "No such file or directory".to_string(),
        };
        let err = WarmUpError::Jit {
            deployment: "nsa_ps64_cp8".to_string(),
            total: 3,
            failures: vec![missing(), missing(), missing()],
        };
        let text = err.to_string();
        assert!(
            text.starts_with("deployment nsa_ps64_cp8: 3 of 3 kernels failed:\n"),
            "{text}"
        );
        assert_eq!(text.matches("No such file").count(), 1, "{text}");
        assert!(text.ends_with("(3 kernels)"), "{text}");
    }

    #[test]
    fn cuda_targets_follow_the_device() {
        let gpu = |cc| {
            target_of(Backend::Cuda, cc, Arch::Sm90, Sanitize::None, || {
                "GPU".into()
            })
        };
        assert_eq!(
            gpu(Some((8, 6))).unwrap(),
            Target::Nvrtc { arch: Arch::Sm80 }
        );
        assert_eq!(
            gpu(Some((9, 0))).unwrap(),
            Target::Nvrtc { arch: Arch::Sm90 }
        );
        assert_eq!(gpu(None).unwrap(), Target::Nvrtc { arch: Arch::Sm90 });
        let err = gpu(Some((12, 0))).unwrap_err();
        assert!(err.is_unavailable(), "{err}");
        assert!(
            err.to_string().contains("GPU has compute capability 12.0"),
            "{err}"
        );
        assert_eq!(
            target_of(Backend::Host, None, Arch::Sm90, Sanitize::None, String::new).unwrap(),
            Target::Host {
                sanitize: Sanitize::None
            }
        );
    }

    #[test]
    fn requests_follow_specs() {
        let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
        let t = deployment_target(&dep);
        assert_eq!(
            t,
            Target::Nvrtc {
                arch: crate::jit::Arch::Sm90
            }
        );
        let reqs = deployment_requests(&dep, t).unwrap();
        assert_eq!(reqs.len(), dep.specs().len());
        for (spec, req) in &reqs {
            assert_eq!(req.uri, spec.uri());
            assert!(req.source.contains(&spec.entry_name()));
            assert_eq!(req.target, t);
        }
    }
}
