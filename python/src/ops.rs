//! `cp_hicache.ops`: the cache's kernels on the caller's tensors ([`cp_hicache::ops`]). The
//! Python side (`cp_hicache/ops.py`) checks what only it can see (tensor kinds, devices,
//! contiguity, dtypes) and passes each tensor as its address and size; the Rust side checks
//! shapes, alignment, pages and ranges before anything is launched.

use crate::errors::{to_py, usage, CacheError, CacheFullError};
use crate::Deployment;
use cp_hicache::jit::open_executor;
use cp_hicache::jit::{Jit, JitConfig, Sanitize};
use cp_hicache::kernels::{BufferKind, Direction};
use cp_hicache::ops::{Lanes, Ops as CoreOps, OpsError, Region, Tensors};
use pyo3::prelude::*;
use std::sync::Arc;

/// One buffer kind's tensors as Python passes them: `(kind, [(addr, bytes), ...])`, the kind
/// `"cross_layer"`, `"per_layer"` or `"page_major"`.
pub(crate) type TensorsArg = (String, Vec<(u64, u64)>);

/// An engine's lanes as Python passes them: `(stacks, tops, status)`, each `(addr, bytes)`.
type LanesArg = ((u64, u64), (u64, u64), (u64, u64));

fn region((addr, bytes): (u64, u64)) -> Region {
    Region { addr, bytes }
}

fn lanes((stacks, tops, status): LanesArg) -> Lanes {
    Lanes {
        stacks: region(stacks),
        tops: region(tops),
        status: region(status),
    }
}

pub(crate) fn tensors((kind, regions): TensorsArg, what: &str) -> PyResult<Tensors> {
    let regions: Vec<Region> = regions
        .into_iter()
        .map(|(addr, bytes)| Region { addr, bytes })
        .collect();
    match (kind.as_str(), regions.as_slice()) {
        ("per_layer", _) => Ok(Tensors::PerLayer(regions)),
        ("cross_layer", [one]) => Ok(Tensors::CrossLayer(*one)),
        ("page_major", [one]) => Ok(Tensors::PageMajor(*one)),
        ("cross_layer" | "page_major", _) => Err(usage(format!(
            "{what}: a {kind} tensor is one region, not {}",
            regions.len()
        ))),
        _ => Err(usage(format!(
            "{what}: tensors are cross_layer, per_layer or page_major, not {kind:?}"
        ))),
    }
}

fn ops_err(e: OpsError) -> PyErr {
    match e {
        OpsError::BadArgument { .. } => usage(e.to_string()),
        OpsError::LanesShort { .. } | OpsError::LanesFull { .. } => {
            CacheFullError::new_err(e.to_string())
        }
        OpsError::Kernels(_) | OpsError::Exec(_) => CacheError::new_err(e.to_string()),
    }
}

fn pages(bytes: &[u8], what: &str) -> PyResult<Vec<u32>> {
    if bytes.len() % 4 != 0 {
        return Err(usage(format!(
            "{what}: {} bytes are not u32 page ids",
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

fn buffer_kind(ops: &CoreOps, name: &str) -> PyResult<BufferKind> {
    deployment_buffer(ops.deployment(), name)
}

/// The buffer kind of `dep` named `name`, or a usage error listing its buffers.
pub(crate) fn deployment_buffer(
    dep: &cp_hicache::kernels::Deployment,
    name: &str,
) -> PyResult<BufferKind> {
    let buffers = dep.model.buffers();
    buffers
        .iter()
        .copied()
        .find(|b| b.to_string() == name)
        .ok_or_else(|| {
            usage(format!(
                "buffer {name:?} is not one of the deployment's: {}",
                buffers
                    .iter()
                    .map(|b| format!("{:?}", b.to_string()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
}

/// A deployment's transfer and materialise kernels, compiled and loaded once, launched on the
/// caller's tensors.
#[pyclass(module = "cp_hicache._native", frozen)]
pub struct Ops {
    inner: CoreOps,
}

#[pymethods]
impl Ops {
    #[new]
    #[pyo3(signature = (deployment, backend = "host"))]
    fn new(py: Python<'_>, deployment: &Deployment, backend: &str) -> PyResult<Self> {
        let backend = crate::backend(backend)?;
        let (dep, layers) = (deployment.inner.clone(), deployment.layers);
        py.detach(move || {
            let exec: Arc<dyn cp_hicache::exec::Executor> =
                Arc::from(open_executor(backend).map_err(to_py)?);
            let jit = Jit::new(JitConfig::from_env().map_err(to_py)?);
            let sanitize = Sanitize::from_env().map_err(to_py)?;
            let inner = CoreOps::warm_up(dep, layers, exec, &jit, sanitize).map_err(ops_err)?;
            Ok(Ops { inner })
        })
    }

    /// The executor's backend (`host` or `cuda`).
    #[getter]
    fn backend(&self) -> String {
        self.inner.executor().backend().to_string()
    }

    /// Bytes of one page of `buffer`.
    fn page_bytes(&self, buffer: &str) -> PyResult<u64> {
        let b = buffer_kind(&self.inner, buffer)?;
        Ok(b.page_bytes(self.inner.deployment().page_size))
    }

    /// The buffer kinds, in the order `transfer` takes them.
    #[getter]
    fn buffers(&self) -> Vec<String> {
        self.inner
            .deployment()
            .model
            .buffers()
            .iter()
            .map(ToString::to_string)
            .collect()
    }

    /// Moves pages between host and device tensors (see `cp_hicache.ops.Ops.transfer`);
    /// `stream` is the caller's raw stream handle (CUDA), the op ordered after its work and
    /// it after the op.
    #[pyo3(signature = (direction, device, host, src_pages, dst_pages, first_layer, layer_end, stream = None))]
    #[allow(clippy::too_many_arguments)]
    fn transfer(
        &self,
        py: Python<'_>,
        direction: &str,
        device: Vec<TensorsArg>,
        host: Vec<TensorsArg>,
        src_pages: &[u8],
        dst_pages: &[u8],
        first_layer: u32,
        layer_end: u32,
        stream: Option<u64>,
    ) -> PyResult<u64> {
        let dir = match direction {
            "h2d" => Direction::HostToDevice,
            "d2h" => Direction::DeviceToHost,
            other => {
                return Err(usage(format!(
                    "direction {other:?} is neither \"h2d\" nor \"d2h\""
                )))
            }
        };
        let device = device
            .into_iter()
            .map(|t| tensors(t, "device"))
            .collect::<PyResult<Vec<_>>>()?;
        let host = host
            .into_iter()
            .map(|t| tensors(t, "host"))
            .collect::<PyResult<Vec<_>>>()?;
        let (src, dst) = (
            pages(src_pages, "src_pages")?,
            pages(dst_pages, "dst_pages")?,
        );
        // The tensors stay alive in the caller's frame for the whole call (the Python wrapper
        // holds them), and the host executor's launches finish before it returns.
        py.detach(|| {
            // SAFETY: see above; the wrapper passed CPU tensors' own addresses and sizes.
            unsafe {
                self.inner.on_stream(stream, |o| {
                    o.transfer(dir, &device, &host, &src, &dst, first_layer..layer_end)
                })
            }
        })
        .map_err(ops_err)
    }

    /// Gathers a sequence's pages from every rank's pool (see
    /// `cp_hicache.ops.Ops.materialise`); `stream` as in `transfer`.
    #[pyo3(signature = (buffer, pools, seq_pages, dense, stream = None))]
    fn materialise(
        &self,
        py: Python<'_>,
        buffer: &str,
        pools: Vec<TensorsArg>,
        seq_pages: &[u8],
        dense: TensorsArg,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let b = buffer_kind(&self.inner, buffer)?;
        let pools = pools
            .into_iter()
            .map(|t| tensors(t, "pools"))
            .collect::<PyResult<Vec<_>>>()?;
        let dense = tensors(dense, "out")?;
        let seq = pages(seq_pages, "seq_pages")?;
        py.detach(|| {
            // SAFETY: as in `transfer`.
            unsafe {
                self.inner
                    .on_stream(stream, |o| o.materialise(b, &pools, &seq, &dense))
            }
        })
        .map_err(ops_err)
    }

    /// Pops one page per owner from the engine's lanes into `out_pages`, and their token
    /// slots into `out_locs` when given (`None` runs the kernel that writes pages only; see
    /// `cp_hicache.ops.Ops.select`); `stream` as in `transfer`.
    #[pyo3(signature = (lanes_arg, owners, out_pages, out_locs = None, stream = None))]
    fn select(
        &self,
        py: Python<'_>,
        lanes_arg: LanesArg,
        owners: &[u8],
        out_pages: (u64, u64),
        out_locs: Option<(u64, u64)>,
        stream: Option<u64>,
    ) -> PyResult<()> {
        let l = lanes(lanes_arg);
        let locs = out_locs.map(region);
        py.detach(|| {
            // SAFETY: as in `transfer`.
            unsafe {
                self.inner
                    .on_stream(stream, |o| o.select(&l, owners, region(out_pages), locs))
            }
        })
        .map_err(ops_err)
    }

    /// Pushes pages back onto the engine's lanes (see `cp_hicache.ops.Ops.release`);
    /// `stream` as in `transfer`.
    #[pyo3(signature = (lanes_arg, pages_arg, stream = None))]
    fn release(
        &self,
        py: Python<'_>,
        lanes_arg: LanesArg,
        pages_arg: &[u8],
        stream: Option<u64>,
    ) -> PyResult<()> {
        let l = lanes(lanes_arg);
        let p = pages(pages_arg, "pages")?;
        py.detach(|| {
            // SAFETY: as in `transfer`.
            unsafe { self.inner.on_stream(stream, |o| o.release(&l, &p)) }
        })
        .map_err(ops_err)
    }
}
