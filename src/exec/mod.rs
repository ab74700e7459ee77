//! Kernel executors: one [`Executor`] trait that runs the same rendered kernels on a GPU
//! (the CUDA executor) or on the CPU (the host executor, through the CUDA-emulation header).
//!
//! An executor owns device buffers, host buffers, loaded kernels and a stream of launches. The
//! caller allocates buffers (filled with a poison byte), uploads small control data, loads a
//! kernel artifact, launches it with typed arguments, and reads results back only when it must.
//! Every read back and every synchronisation is counted ([`Counters`]) so that a caller can
//! assert that a path (for example HiCache load-back) is free of them.
//!
//! Ranks with executors of their own reach each other's device pools through peer mappings
//! ([`Executor::alloc_shareable`], [`Executor::export`], [`Executor::import`]): POSIX shared
//! memory on the host executor, which maps in this process or another, and CUDA IPC on the
//! CUDA executor, which maps only across processes ([`Executor::maps_in_process`],
//! [`ExecError::IpcSameProcess`]).
//!
//! The executors are the bottom of the one-way order `exec` ← `kernels` ← `jit` (DESIGN.md
//! §1.2): they own the kernel signatures they check ([`KernelSignature`], which the kernel
//! specs build) and import nothing from the kernels or the JIT (`tests/layering.rs`).

mod backend;
mod copy;
mod counters;
pub mod cuda;
mod error;
mod executor;
pub mod host;
mod launch;
mod params;
mod registry;
mod share;
mod signature;
#[cfg(test)]
mod tests;

use std::fmt;

pub use backend::Backend;
pub(crate) use copy::check_regions;
pub use copy::{merge_regions, CopyRegion, DmaMode, LoadOp};
pub use counters::Counters;
pub use error::{ExecError, LaunchFailure};
pub use executor::Executor;
pub use host::{BlockOrder, EmuStackStats, HostExecutor, HostOptions};
pub(crate) use launch::{check_range, marshal_args};
pub use launch::{KernelArg, KernelArtifact, LaunchConfig};
pub(crate) use params::PAGE_ALIGN;
pub use params::{KernelParam, KernelSignature, Reach, ReachError, Strided, TableEntries};
pub use share::RankView;
pub(crate) use signature::PendingLaunch;
// For the launch-check tests in `kernels::exec_checks`, which build real kernel specs.
#[cfg(test)]
pub(crate) use launch::Marshalled;
#[cfg(test)]
pub(crate) use signature::check_signature;

/// Where a buffer lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Device memory (`cuMemAlloc`; a heap allocation on the host executor).
    Device,
    /// Host memory that kernels can address directly (pinned and device-mapped on CUDA).
    Host,
}

impl fmt::Display for MemKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            MemKind::Device => "device",
            MemKind::Host => "host",
        })
    }
}

/// Handle of a buffer owned by one executor. Handles are never reused within an executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

/// Handle of a kernel loaded into one executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KernelId(pub u64);

/// A point in one executor's stream ([`Executor::record_event`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EventId(pub u64);

/// Where a buffer's bytes are ([`Executor::address`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Address {
    /// The first byte's address in `space`.
    pub ptr: u64,
    /// Which memory the address is in.
    pub space: AddressSpace,
}

/// The memory an [`Address`] is in, as DLPack names devices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AddressSpace {
    /// This process's (host) memory.
    Host,
    /// CUDA device memory of the device with this ordinal.
    Cuda(i32),
}
