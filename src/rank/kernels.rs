//! The kernels one deployment needs, compiled through the JIT for the executor at hand and
//! loaded into it once at start-up.

use crate::exec::{Executor, KernelId, LaunchConfig};
pub use crate::jit::SourceHook;
use crate::jit::{spec_request, target_for, Jit, Sanitize};
use crate::kernels::{BufferKind, Deployment, Direction, KernelSpec};
use std::collections::HashMap;
use std::time::Instant;

/// One loaded kernel: its spec (for launch shapes and names) and the executor handle.
#[derive(Clone, Debug)]
pub struct Loaded {
    /// The spec it was rendered from.
    pub spec: KernelSpec,
    /// The executor's handle.
    pub id: KernelId,
}

impl Loaded {
    /// The recommended launch for `items` units of work over `layers` layers.
    pub fn launch(&self, items: u32, layers: u32) -> LaunchConfig {
        let d = self.spec.launch_dims(items, layers);
        LaunchConfig::linear(d.grid, d.block)
    }
}

/// Every kernel of a deployment, by role.
#[derive(Clone, Debug)]
pub struct DeploymentKernels {
    /// By direction: one kernel moves every buffer of a page.
    transfer: HashMap<Direction, Loaded>,
    materialise: HashMap<BufferKind, Loaded>,
    synthesise: HashMap<BufferKind, Loaded>,
    verify: HashMap<BufferKind, Loaded>,
    /// Wall time of compiling (or loading from cache) and loading all kernels.
    pub startup_ms: f64,
    /// How many kernels came from the JIT cache.
    pub cache_hits: usize,
}

/// Why the kernels could not be made ready.
#[derive(Debug, thiserror::Error)]
pub enum KernelLoadError {
    /// Rendering a spec failed.
    #[error(transparent)]
    Render(#[from] crate::kernels::KernelError),
    /// Compiling failed (the error names the kernel and carries the compiler log).
    #[error(transparent)]
    Jit(#[from] crate::jit::JitError),
    /// One or more kernels could not be compiled or found in the cache: every one is listed,
    /// so a prebuilt cache missing ten kernels says so once, not one kernel per attempt.
    #[error(transparent)]
    WarmUp(#[from] crate::jit::WarmUpError),
    /// The executor refused the artifact.
    #[error(transparent)]
    Exec(#[from] crate::exec::ExecError),
}

impl DeploymentKernels {
    /// How many kernels are loaded.
    pub fn len(&self) -> usize {
        self.transfer.len() + self.materialise.len() + self.synthesise.len() + self.verify.len()
    }

    /// Whether no kernel is loaded (never, for a deployment with a buffer).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Renders, compiles (in parallel, through the JIT cache) and loads every kernel of the
    /// deployment that the cluster launches.
    pub fn load(
        deployment: &Deployment,
        jit: &Jit,
        exec: &dyn Executor,
        sanitize: Sanitize,
    ) -> Result<DeploymentKernels, KernelLoadError> {
        // SAFETY: no hook, so every kernel is the JIT's build of its spec's render.
        unsafe { Self::load_with_hook(deployment, jit, exec, sanitize, None) }
    }

    /// [`load`](Self::load) with `hook` editing sources before they compile (fault injection).
    ///
    /// # Safety
    ///
    /// The kernels are launched through the safe [`Executor::launch`]: `hook` must keep every
    /// kernel within its spec's signature, each parameter's
    /// [`Reach`](crate::kernels::Reach), as the rendered source does (an edit that only breaks
    /// the compile does).
    pub unsafe fn load_with_hook(
        deployment: &Deployment,
        jit: &Jit,
        exec: &dyn Executor,
        sanitize: Sanitize,
        hook: Option<SourceHook<'_>>,
    ) -> Result<DeploymentKernels, KernelLoadError> {
        let start = Instant::now();
        let buffers = deployment.model.buffers();
        const DIRECTIONS: [Direction; 2] = [Direction::DeviceToHost, Direction::HostToDevice];
        let mut specs: Vec<KernelSpec> = DIRECTIONS
            .iter()
            .map(|&d| deployment.transfer_spec(d))
            .collect();
        for b in buffers {
            specs.push(deployment.materialise_spec(b));
            specs.push(deployment.synth_spec(b));
            specs.push(deployment.verify_spec(b));
        }
        let target = target_for(exec, deployment.arch, sanitize)?;
        let requests = specs
            .iter()
            .map(|spec| spec_request(spec, target, hook))
            .collect::<Result<Vec<_>, _>>()?;
        let mut compiled = Vec::with_capacity(specs.len());
        let mut failures = Vec::new();
        for result in jit.warm_up(&requests) {
            match result {
                Ok(kernel) => compiled.push(kernel),
                Err(e) => failures.push(e),
            }
        }
        if !failures.is_empty() {
            return Err(crate::jit::WarmUpError::Jit {
                deployment: deployment.name.clone(),
                total: specs.len(),
                failures,
            }
            .into());
        }
        let mut loaded = Vec::with_capacity(specs.len());
        let mut cache_hits = 0;
        for (spec, kernel) in specs.iter().zip(compiled) {
            cache_hits += usize::from(kernel.cache_hit.is_hit());
            // SAFETY: `kernel` is the JIT's build of `spec` for `exec`'s target, from its
            // render or an edit the caller vouches for.
            let id = unsafe { kernel.load_spec(exec, spec) }?;
            loaded.push(Loaded { spec: *spec, id });
        }
        let mut k = DeploymentKernels {
            transfer: HashMap::new(),
            materialise: HashMap::new(),
            synthesise: HashMap::new(),
            verify: HashMap::new(),
            startup_ms: 0.0,
            cache_hits,
        };
        let mut it = loaded.into_iter();
        for d in DIRECTIONS {
            k.transfer.insert(d, it.next().expect("one per spec"));
        }
        for b in buffers {
            k.materialise.insert(b, it.next().expect("one per spec"));
            k.synthesise.insert(b, it.next().expect("one per spec"));
            k.verify.insert(b, it.next().expect("one per spec"));
        }
        k.startup_ms = start.elapsed().as_secs_f64() * 1e3;
        Ok(k)
    }

    /// The transfer kernel of a direction (every buffer of the model in one launch).
    pub fn transfer(&self, d: Direction) -> &Loaded {
        &self.transfer[&d]
    }

    /// The materialise kernel of a buffer.
    pub fn materialise(&self, b: BufferKind) -> &Loaded {
        &self.materialise[&b]
    }

    /// The synthesise kernel of a buffer.
    pub fn synthesise(&self, b: BufferKind) -> &Loaded {
        &self.synthesise[&b]
    }

    /// The verify kernel of a buffer.
    pub fn verify(&self, b: BufferKind) -> &Loaded {
        &self.verify[&b]
    }
}
