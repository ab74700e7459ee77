//! `cp_hicache._native`: the Rust side of the `cp_hicache` Python package.
//!
//! Thin by design: each class and function wraps one thing of the core crate (a deployment,
//! the JIT warm-up, one rank's cache, the replay of one rank) and turns its errors into
//! Python exceptions carrying the Rust message. Nothing panics across the boundary: every
//! fallible call returns a `PyResult`, and PyO3 turns a panic that escapes anyway into a
//! `PanicException` instead of unwinding into the interpreter. The Python modules in
//! `cp_hicache/` add what is easier there: NumPy conversions, the `torch.distributed`
//! collective and the process launcher.

mod collective;
mod dlpack;
mod errors;
mod object_store;
mod ops;
mod rank;
mod replay;
mod storage;

use cp_hicache::exec::Backend;
use cp_hicache::jit::open_executor;
use cp_hicache::jit::{Jit, JitConfig, Sanitize};
use cp_hicache::kernels::{Deployment as CoreDeployment, ModelShape, TpShard, TransferPath};
use cp_hicache::rank::DeploymentKernels;
use errors::{to_py, usage};
use pyo3::prelude::*;
use std::path::PathBuf;
use std::time::Instant;

/// What an engine deploys: the model's KV buffers, page size, CP degree and layers.
#[pyclass(module = "cp_hicache._native", frozen)]
#[derive(Clone)]
pub struct Deployment {
    pub(crate) inner: CoreDeployment,
    pub(crate) layers: u32,
}

#[pymethods]
impl Deployment {
    #[new]
    #[pyo3(signature = (
        model = "nsa", page_size = 64, cp = 8, layers = 61, transfer = None,
        layout = "zigzag", interleave_size = None, kv_heads = None, head_dim = None,
        tp_rank = None, tp_size = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        model: &str,
        page_size: u32,
        cp: u8,
        layers: u32,
        transfer: Option<&str>,
        layout: &str,
        interleave_size: Option<u32>,
        kv_heads: Option<u16>,
        head_dim: Option<u16>,
        tp_rank: Option<u16>,
        tp_size: Option<u16>,
    ) -> PyResult<Self> {
        let shape = match model {
            "nsa" => ModelShape::Nsa,
            "mla" => ModelShape::MlaBf16,
            "gqa" => ModelShape::Gqa {
                kv_heads: kv_heads.unwrap_or(8),
                head_dim: head_dim.unwrap_or(128),
            },
            other => {
                return Err(usage(format!(
                    "unknown model `{other}` (expected `nsa`, DeepSeek-V3.2's nsa_kv + nsa_idx, \
                     `mla`, a bf16 MLA cache, or `gqa`, a GQA/MHA model's bf16 K and V of one \
                     TP shard with kv_heads (default 8) and head_dim (default 128), shard \
                     tp_rank of tp_size)"
                )))
            }
        };
        if shape.family() != "gqa" && (kv_heads.is_some() || head_dim.is_some()) {
            return Err(usage(format!(
                "kv_heads and head_dim describe a GQA model: give model=\"gqa\" (not {model:?})"
            )));
        }
        if !(1..=256).contains(&layers) {
            return Err(usage(format!("layers {layers} is not in 1..=256")));
        }
        let layout = cp_hicache::layout::Layout::parse(layout, interleave_size)
            .map_err(|e| usage(format!("layout={layout:?}: {e}")))?;
        if tp_rank.is_some() && tp_size.is_none() {
            return Err(usage(
                "tp_rank names a shard of tp_size: give tp_size too".to_string(),
            ));
        }
        let tp = TpShard::new(tp_rank.unwrap_or(0), tp_size.unwrap_or(1))
            .map_err(|e| usage(format!("tp_rank/tp_size: {e}")))?;
        let mut inner = CoreDeployment::new(shape, page_size, cp)
            .and_then(|d| d.with_layout(layout))
            .and_then(|d| d.with_tp(tp))
            .map_err(|e| usage(e.to_string()))?;
        if let Some(t) = transfer {
            inner.transfer_path = t.parse::<TransferPath>().map_err(usage)?;
        }
        Ok(Deployment { inner, layers })
    }

    /// The deployment's name, as the `compile` and `info` commands print it
    /// (`nsa_ps64_cp8`).
    #[getter]
    fn name(&self) -> String {
        self.inner.name.clone()
    }

    /// The model's buffer shapes (`nsa`, `mla` or `gqa`).
    #[getter]
    fn model(&self) -> &'static str {
        self.inner.model.family()
    }

    /// KV heads per rank of a GQA model (`None` for the others).
    #[getter]
    fn kv_heads(&self) -> Option<u16> {
        match self.inner.model {
            ModelShape::Gqa { kv_heads, .. } => Some(kv_heads),
            _ => None,
        }
    }

    /// Elements per head of a GQA model (`None` for the others).
    #[getter]
    fn head_dim(&self) -> Option<u16> {
        match self.inner.model {
            ModelShape::Gqa { head_dim, .. } => Some(head_dim),
            _ => None,
        }
    }

    /// The TP head shard this deployment holds, `0..tp_size` (0 unsplit).
    #[getter]
    fn tp_rank(&self) -> u16 {
        self.inner.tp().rank()
    }

    /// The TP head shards the model's KV heads are split into (1: unsplit).
    #[getter]
    fn tp_size(&self) -> u16 {
        self.inner.tp().size()
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> u32 {
        self.inner.page_size
    }

    /// The CP degree (ranks).
    #[getter]
    fn cp(&self) -> u8 {
        self.inner.cp
    }

    /// Layers per KV buffer.
    #[getter]
    fn layers(&self) -> u32 {
        self.layers
    }

    /// The CP layout: `zigzag`, `round-robin`, `page-interleave` or `token-interleave`.
    #[getter]
    fn layout(&self) -> &'static str {
        self.inner.layout.name()
    }

    /// Tokens per run of token-interleave (`None` for the page layouts).
    #[getter]
    fn interleave_size(&self) -> Option<u32> {
        match self.inner.layout {
            cp_hicache::layout::Layout::TokenInterleave { size } => Some(size),
            _ => None,
        }
    }

    /// The KV buffer kinds, each a pool (`["mla_kv"]`; `["nsa_kv", "nsa_idx"]` for NSA).
    #[getter]
    fn buffers(&self) -> Vec<String> {
        self.inner
            .model
            .buffers()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// Bytes of one page of `buffer` (one of [`buffers`](Self::buffers)).
    fn page_bytes(&self, buffer: &str) -> PyResult<u64> {
        let b = ops::deployment_buffer(&self.inner, buffer)?;
        Ok(b.page_bytes(self.inner.page_size))
    }

    fn __repr__(&self) -> String {
        let mut shape = match self.inner.model {
            ModelShape::Gqa { kv_heads, head_dim } => {
                format!(", kv_heads={kv_heads}, head_dim={head_dim}")
            }
            _ => String::new(),
        };
        let tp = self.inner.tp();
        if tp.is_split() {
            shape += &format!(", tp_rank={}, tp_size={}", tp.rank(), tp.size());
        }
        format!(
            "Deployment(model={:?}{shape}, page_size={}, cp={}, layers={}, transfer={:?}, layout={:?}{})",
            self.model(),
            self.inner.page_size,
            self.inner.cp,
            self.layers,
            self.inner.transfer_path.to_string(),
            self.layout(),
            self.interleave_size()
                .map_or(String::new(), |i| format!(", interleave_size={i}"))
        )
    }
}

/// What `warm_up` did.
#[pyclass(module = "cp_hicache._native", frozen, get_all)]
pub struct WarmUpReport {
    /// The deployment's name.
    deployment: String,
    /// The executor the kernels were loaded into (`host` or `cuda`).
    backend: String,
    /// Kernels compiled or loaded.
    kernels: usize,
    /// How many came from the JIT cache.
    cache_hits: usize,
    /// Wall time of the whole warm-up, in milliseconds (executor start included).
    milliseconds: f64,
    /// The JIT cache directory.
    cache_dir: String,
    /// The tuning file whose launch shapes were applied, if any.
    tuning_file: Option<String>,
}

#[pymethods]
impl WarmUpReport {
    fn __repr__(&self) -> String {
        format!(
            "WarmUpReport(deployment={:?}, backend={:?}, kernels={}, cache_hits={}, \
             milliseconds={:.1})",
            self.deployment, self.backend, self.kernels, self.cache_hits, self.milliseconds
        )
    }
}

/// Opens the executor `backend` names (`auto`, `host`, `cuda`).
pub(crate) fn backend(name: &str) -> PyResult<Backend> {
    name.parse::<Backend>().map_err(usage)
}

/// Applies a tuning file (or the cache's default one when it exists) to `dep`.
pub(crate) fn tuned(
    dep: &CoreDeployment,
    tuning: Option<PathBuf>,
    exec: &dyn cp_hicache::exec::Executor,
    jit: &Jit,
) -> PyResult<(CoreDeployment, Option<String>)> {
    if let Some(p) = tuning.as_ref().filter(|p| !p.exists()) {
        return Err(usage(format!("tuning file {} does not exist", p.display())));
    }
    let mut out = dep.clone();
    let device = cp_hicache::tuning::DeviceKey::for_executor(exec, jit).map_err(to_py)?;
    cp_hicache::tuning::apply(&mut out, tuning.as_deref(), &device).map_err(to_py)?;
    let file = (out != *dep).then(|| {
        tuning
            .unwrap_or_else(cp_hicache::tuning::default_path)
            .display()
            .to_string()
    });
    Ok((out, file))
}

/// Compiles (or loads from the JIT cache) every kernel of `deployment` and loads it into
/// this process's executor: what an engine calls once per process before serving, so that
/// no request waits for a compiler. Returns a report (kernels, cache hits, milliseconds).
#[pyfunction]
#[pyo3(signature = (deployment, tuning = None, backend = "auto"))]
fn warm_up(
    py: Python<'_>,
    deployment: &Deployment,
    tuning: Option<PathBuf>,
    backend: &str,
) -> PyResult<WarmUpReport> {
    let backend = self::backend(backend)?;
    let dep = deployment.inner.clone();
    py.detach(move || {
        let start = Instant::now();
        let exec = open_executor(backend).map_err(to_py)?;
        let config = JitConfig::from_env().map_err(to_py)?;
        let cache_dir = config.cache_dir.display().to_string();
        let jit = Jit::new(config);
        let (dep, tuning_file) = tuned(&dep, tuning, exec.as_ref(), &jit)?;
        let sanitize = Sanitize::from_env().map_err(to_py)?;
        // Every kernel of the deployment for this executor's target (the allocator's select
        // and release included), as `cp-hicache compile` builds them ...
        let target =
            cp_hicache::jit::target_for(exec.as_ref(), dep.arch, sanitize).map_err(to_py)?;
        let built = cp_hicache::jit::warm_up_deployment(&jit, &dep, target).map_err(to_py)?;
        let hits = built.iter().filter(|k| k.cache_hit.is_hit()).count();
        // ... then loaded into the executor, as a rank loads them at start-up.
        DeploymentKernels::load(&dep, &jit, exec.as_ref(), sanitize)
            .map_err(|e| errors::cluster(e.into()))?;
        Ok(WarmUpReport {
            deployment: dep.name.clone(),
            backend: exec.backend().to_string(),
            kernels: built.len(),
            cache_hits: hits,
            milliseconds: start.elapsed().as_secs_f64() * 1e3,
            cache_dir,
            tuning_file,
        })
    })
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    dlpack::register_shutdown_hook(m)?;
    m.add_class::<Deployment>()?;
    m.add_class::<WarmUpReport>()?;
    m.add_class::<rank::RankCache>()?;
    m.add_class::<rank::Request>()?;
    m.add_class::<dlpack::Pool>()?;
    m.add_class::<ops::Ops>()?;
    m.add_class::<storage::PageStore>()?;
    m.add_function(wrap_pyfunction!(warm_up, m)?)?;
    m.add_function(wrap_pyfunction!(replay::check_replay, m)?)?;
    m.add_function(wrap_pyfunction!(replay::replay_rank, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
