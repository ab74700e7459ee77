//! Kernel sources: what each kernel is ([`KernelSpec`]), what a deployment needs
//! ([`Deployment`]), how specs become CUDA C (askama templates in `templates/`), and plain
//! Rust references with exactly the kernels' semantics ([`reference`](mod@reference)).
//!
//! The binary contract (parameter lists, layouts, synthesised bytes) is `docs/KERNELS.md`.
//! Compiling and running the renders is the job of the JIT and the executors.
//!
//! Imports run one way, `exec` ← `kernels` ← `jit` (DESIGN.md §1.2): the kernels use the
//! executors' signature types ([`KernelSignature`] and the others are re-exported from
//! [`crate::exec`]) and import nothing from the JIT, which takes the target [`Arch`] from here.
//!
//! ```
//! use cp_hicache::kernels::Deployment;
//! let dep = Deployment::by_name("nsa_ps64_cp8").unwrap();
//! for spec in dep.specs() {
//!     let src = spec.render().unwrap();
//!     assert!(src.contains("__launch_bounds__(THREADS"));
//!     assert!(src.contains(&spec.entry_name()));
//! }
//! ```

mod arch;
mod deployment;
mod dma;
#[cfg(test)]
mod exec_checks;
pub mod reference;
mod render;
mod spec;
mod table;

pub use arch::Arch;
pub use deployment::{Buffers, Deployment, ModelShape, TpShard, TpShardError, UnknownModel};
pub use dma::{
    check_distinct_destinations, clamp_layer_range, layer_range_args, transfer_args,
    transfer_regions, transfer_regions_at, DuplicateDestination, PoolShape, TransferPath,
};
pub use render::{diff_tree, plan_tree, render_tree, sources_digest, TreeDiff, REGENERATE_COMMAND};
pub use spec::{
    AllocSpec, Arrangement, BufferKind, BusyKind, BusySpec, CopyLaunch, CopyMapping, Direction,
    Dtype, Family, FieldLayout, FieldMisalignment, HostLayout, InFlight, KernelParam,
    KernelSignature, KernelSpec, LaunchDims, MaterialiseSpec, Reach, ReachError, ReleaseSpec,
    ReleaseStatus, SelectOutput, SelectStatus, ShapeError, Strided, SynthSpec, TableEntries,
    TokenOrder, TransferSpec, VecWidth, VerifySpec, GPU_TRANSFER_BLOCKS, GPU_TRANSFER_THREADS,
    GPU_TRANSFER_UNROLL, GQA_MAX_HEAD_ELEMENTS, MAX_LAYERS_PER_LAUNCH, TRANSFER_GRID_CAPS,
    TRANSFER_STAMP_BYTES, WARP_LANES,
};
// An SM's thread limit: `tune` sizes its busy companions by it.
pub(crate) use spec::SM_MAX_THREADS;
pub use table::{page_stride, PageTable};

use std::path::PathBuf;

/// Everything that can go wrong while describing or rendering kernels. Every variant carries
/// enough context to name the offending spec or file.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// CP degree outside 1..=16.
    #[error("{family}: CP degree {cp} is outside 1..=16")]
    InvalidCp {
        /// Kernel family being specified.
        family: Family,
        /// The rejected CP degree.
        cp: u8,
    },
    /// Page size that is not a power of two in 1..=1024.
    #[error("{family}: page size {page_size} is not a power of two in 1..=1024")]
    InvalidPageSize {
        /// Kernel family being specified.
        family: Family,
        /// The rejected page size.
        page_size: u32,
    },
    /// A launch parameter outside what the family supports.
    #[error("{family}: {what} = {value} is invalid: {reason}")]
    InvalidLaunch {
        /// Kernel family being specified.
        family: Family,
        /// Which parameter (`threads`, `pages_per_block`, `unroll`, `bytes_per_token`).
        what: &'static str,
        /// The rejected value.
        value: u32,
        /// What the family requires instead.
        reason: &'static str,
    },
    /// Page bytes that the vector width does not divide.
    #[error("{family}: page of {page_bytes} bytes is not a multiple of the {vec_bytes}-byte vector width")]
    VectorMisaligned {
        /// Kernel family being specified.
        family: Family,
        /// Bytes of one page of the buffer.
        page_bytes: u64,
        /// Bytes of one vector access.
        vec_bytes: u32,
    },
    /// A buffer kind and page size at which the synthesise or verify kernels would make a
    /// misaligned access ([`FieldLayout::check_access_alignment`]).
    #[error("{family}: {buffer} field {} at page size {page_size}: its {}-byte accesses would be misaligned ({} {} is not a multiple of {})", misalignment.field, misalignment.width, misalignment.what, misalignment.value, misalignment.width)]
    FieldMisaligned {
        /// Kernel family being specified.
        family: Family,
        /// The buffer kind.
        buffer: BufferKind,
        /// The rejected page size.
        page_size: u32,
        /// Which access and why.
        misalignment: FieldMisalignment,
    },
    /// A buffer kind whose shape is refused (a GQA buffer with no heads, or too large).
    #[error("{family}: {source}")]
    InvalidShape {
        /// Kernel family being specified.
        family: Family,
        /// What is wrong with the shape.
        source: ShapeError,
    },
    /// A deployment whose model cannot use the requested page size.
    #[error("deployment {name}: {reason}")]
    InvalidDeployment {
        /// The deployment name.
        name: String,
        /// Why it is rejected.
        reason: String,
    },
    /// A TP shard the deployment cannot hold ([`Deployment::with_tp`]).
    #[error("deployment {name}: {source}")]
    InvalidTpShard {
        /// The deployment name.
        name: String,
        /// What is wrong with the shard.
        source: TpShardError,
    },
    /// `Deployment::by_name` with a name that is not a reference deployment.
    #[error("unknown deployment {name:?}; valid names: {}", valid.join(", "))]
    UnknownDeployment {
        /// The requested name.
        name: String,
        /// Every reference deployment name.
        valid: Vec<String>,
    },
    /// The askama template failed to render.
    #[error("rendering {uri} failed: {source}")]
    Template {
        /// Entry name of the spec being rendered.
        uri: String,
        /// The askama error.
        #[source]
        source: askama::Error,
    },
    /// Reading or writing the render tree failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        /// What was being done (`write`, `read`, `rename`, `create dir`).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

impl KernelError {
    /// True for errors caused by the spec or deployment itself (not by the filesystem), which
    /// retrying cannot fix.
    pub fn is_invalid_spec(&self) -> bool {
        !matches!(self, KernelError::Io { .. } | KernelError::Template { .. })
    }
}
